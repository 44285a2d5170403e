// The `megatron` binary: one executable, Megatron-LM's flag names.
//   megatron pretrain ...         pretrain a GPT (train/trainer.h)
//   megatron preprocess-data ...  text/jsonl -> Megatron indexed dataset (data/preprocess.h)
//   megatron generate ...         sample text from a checkpoint (train/generate.h)
//   megatron serve ...            text-generation HTTP server (train/serve.h; with cpp-httplib)
//   megatron evaluate ...         validation loss, WIKITEXT103 perplexity, LAMBADA (train/evaluate.h)
//   megatron import-hf / export-hf  Hugging Face checkpoints in and out (train/hf_commands.h)
//   megatron plan ...             size a layout before renting GPUs: memory per rank, step time (plan/plan.h)
#include <CLI/CLI.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "comm/bootstrap.h"
#include "comm/launcher.h"
#ifdef MT_WITH_MPI
#include "comm/mpi/mpi_communicator.h"
#endif
#include "core/check.h"
#include "core/cli_validators.h"
#include "data/preprocess_cli.h"
#include "plan/plan.h"
#include "train/arguments.h"
#include "train/evaluate.h"
#include "train/generate.h"
#include "train/hf_commands.h"
#ifdef MT_WITH_HTTPLIB
#include "train/serve.h"
#endif
#include "train/trainer.h"

int main(int argc, char** argv) {
  // More hardware work queues than CUDA's default 8, so that a stream stopped at a copy-engine
  // collective's flag wait (--ddp-copy-engine, comm/nccl/peer_copy.h) does not hold back work of
  // other streams that would share its queue. Must be set before the first CUDA call.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  CLI::App app{"megatron.cpp: Megatron-style GPT pretraining in C++/CUDA"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("megatron.cpp ") + MT_VERSION_STRING);
  app.set_help_all_flag("--help-all", "Help for every subcommand");

  mt::PretrainArgs pretrain_args;
  CLI::App* pretrain = app.add_subcommand("pretrain", "Pretrain a GPT model");
  mt::add_pretrain_options(*pretrain, pretrain_args);

  mt::GenerateArgs generate_args;
  CLI::App* generate = app.add_subcommand("generate", "Sample text from a checkpoint");
  mt::add_generate_options(*generate, generate_args);

  mt::EvaluateArgs evaluate_args;
  CLI::App* evaluate =
      app.add_subcommand("evaluate", "Zero-shot evaluation: validation loss, WIKITEXT103 perplexity, LAMBADA accuracy");
  mt::add_evaluate_options(*evaluate, evaluate_args);

#ifdef MT_WITH_HTTPLIB
  mt::ServeArgs serve_args;
  CLI::App* serve = app.add_subcommand("serve", "Text-generation server: Megatron's PUT /api and POST /v1/completions");
  mt::add_serve_options(*serve, serve_args);
#endif

  mt::ImportHfArgs import_args;
  CLI::App* import_hf = app.add_subcommand("import-hf", "Hugging Face model directory -> megatron.cpp checkpoint");
  mt::add_import_hf_options(*import_hf, import_args);
  mt::ExportHfArgs export_args;
  CLI::App* export_hf = app.add_subcommand("export-hf", "megatron.cpp checkpoint -> Hugging Face model directory");
  mt::add_export_hf_options(*export_hf, export_args);

  mt::LogitsArgs logits_args;
  CLI::App* logits = app.add_subcommand("logits", "Write a checkpoint's fp32 logits for given token ids");
  mt::add_logits_options(*logits, logits_args);

  mt::PlanCommandArgs plan_args;
  CLI::App* plan = app.add_subcommand(
      "plan", "Size a layout before renting GPUs: pretrain's flags + --world-size N --gpu h100|h200 [--search] [--json]");
  mt::add_plan_options(*plan, plan_args);

  mt::data::add_preprocess_data_command(app);
  mt::data::add_merge_datasets_command(app);
  // Every integer and floating-point flag of every subcommand: the number as written or an error
  // naming the flag and the value (no octal, no overflow to INT64_MAX, no -1 wrapped to 2^64 - 1).
  mt::strict_numbers(app);

  // A first argument that is no option and no subcommand: name it (CLI11 would only say that a
  // subcommand is required).
  std::string names;
  bool known = false;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    names += (names.empty() ? "" : ", ") + sub->get_name();
    known |= argc > 1 && sub->get_name() == argv[1];
  }
  if (argc > 1 && argv[1][0] != '-' && !known) {
    std::fprintf(stderr, "error: unknown subcommand '%s'; expected one of: %s\n", argv[1], names.c_str());
    return 1;
  }
  // Writes past a file-size limit fail with EFBIG (reported with the file's name) instead of
  // killing the process.
  std::signal(SIGXFSZ, SIG_IGN);
  // A process started by a launcher (torchrun, mpiexec, srun, ours) ends with it: no rank goes on
  // training, saving or publishing a checkpoint after its launcher died (comm/launcher.h). A
  // malformed launch environment is reported where it is read for the run.
  try {
    if (const mt::LaunchEnv env = mt::read_launch_env(); env.launcher != mt::LaunchEnv::kNone)
      mt::guard_parent_death(env.rank);
  } catch (const std::exception&) {
  }
  int rc = 0;
  try {
    app.parse(argc, argv);
    if (pretrain->parsed() && pretrain_args.nproc_per_node > 1 &&
        mt::read_launch_env().launcher == mt::LaunchEnv::kNone) {
      // Our local launcher: start N ranks of this same command on this machine.
      return mt::launch_local(pretrain_args.nproc_per_node, argc, argv, mt::resolve_device(pretrain_args.device));
    }
    if (generate->parsed() && generate_args.nproc_per_node > 1 &&
        mt::read_launch_env().launcher == mt::LaunchEnv::kNone)
      return mt::launch_local(generate_args.nproc_per_node, argc, argv, mt::resolve_device(generate_args.device));
    if (evaluate->parsed() && evaluate_args.nproc_per_node > 1 &&
        mt::read_launch_env().launcher == mt::LaunchEnv::kNone)
      return mt::launch_local(evaluate_args.nproc_per_node, argc, argv, mt::resolve_device(evaluate_args.device));
    if (evaluate->parsed()) rc = mt::run_evaluate(evaluate_args);
#ifdef MT_WITH_HTTPLIB
    if (serve->parsed() && serve_args.nproc_per_node > 1 && mt::read_launch_env().launcher == mt::LaunchEnv::kNone)
      return mt::launch_local(serve_args.nproc_per_node, argc, argv, mt::resolve_device(serve_args.device));
    if (serve->parsed()) rc = mt::run_serve(serve_args);
#endif
    if (pretrain->parsed()) rc = mt::run_pretrain(pretrain_args);
    if (generate->parsed()) rc = mt::run_generate(generate_args);
    if (import_hf->parsed()) rc = mt::run_import_hf(import_args);
    if (logits->parsed()) rc = mt::run_logits(logits_args);
    if (export_hf->parsed()) rc = mt::run_export_hf(export_args);
    if (plan->parsed()) rc = mt::run_plan(plan_args);
  } catch (const CLI::ConversionError& e) {
    // the syntax was checked (strict_numbers): an integer too large for a flag held in an int
    return app.exit(CLI::ConversionError(mt::conversion_error_message(e.what())));
  } catch (const CLI::ExtrasError& e) {
    // an unknown flag: for pretrain / plan (a Megatron-LM script's flags), where the handled ones are
    // listed; for the others, their --help
    if (pretrain->parsed() || plan->parsed()) {
      std::fprintf(stderr,
                   "error: %s\n(megatron.cpp takes Megatron-LM's flags as docs/flags.md \"Megatron-LM flags\" lists "
                   "them: implemented, accepted without effect, or refused with the reason; `megatron %s --help` "
                   "lists every flag)\n",
                   e.what(), pretrain->parsed() ? "pretrain" : "plan");
      return e.get_exit_code();
    }
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const mt::Error& e) {
    // Under several ranks, an error found before training started (arguments, data, checkpoint)
    // is the same on every rank: rank 0 prints it and exits, and the launcher (ours, mpiexec,
    // torchrun) then stops the others, which wait for that silently. A rank still running after
    // kRank0ReportWait (rank 0 did not fail the same way) prints its error itself, with its rank.
    // Exit status kReportedErrorExitStatus tells the launcher that the error has been printed.
    const mt::LaunchEnv env = mt::read_launch_env();
#ifdef MT_WITH_MPI
    if (env.world_size > 1) mt::MpiRuntime::skip_finalize();  // exit now, not when the peers finalize
#endif
    if (env.world_size > 1 && env.rank != 0 && !mt::training_started()) {
      constexpr auto kRank0ReportWait = std::chrono::seconds(3);
      std::this_thread::sleep_for(kRank0ReportWait);
      std::fprintf(stderr, "error (rank %d): %s\n", env.rank, e.what());
      return mt::kReportedErrorExitStatus;
    }
    if (env.world_size > 1 && mt::training_started()) std::fprintf(stderr, "error (rank %d): %s\n", env.rank, e.what());
    else std::fprintf(stderr, "error: %s\n", e.what());
    return mt::kReportedErrorExitStatus;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return mt::kReportedErrorExitStatus;
  }
  return rc;
}
