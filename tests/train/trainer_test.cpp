// The trainer's behaviour in-process (TrainingSetup + Trainer on thread ranks, CPU; a synthetic
// corpus): resuming continues bitwise on the uninterrupted run, the NaN check stops before a bad
// state is saved, the exit policy (--exit-interval, --exit-duration-in-mins, signals agreed over
// the ranks), and the step runner's CUDA-graph policies as far as the CPU runs them (per-layer
// regions and the full-iteration policy's warm-up run eagerly and equal the eager steps bitwise;
// a capture is refused).
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <thread>

#include "comm/thread_comm.h"
#include "ops/elementwise.h"
#include "testing/testing.h"
#include "train/checkpoint.h"
#include "train/trainer_testing.h"

namespace mt {
namespace {

using testing::expect_error_text;
using testing::logged;
using testing::train_in_process;

class TrainerTest : public testing::CorpusFixture {
 protected:
  // two layers: the behaviour, not the layouts, is tested here
  static TrainingResult train(const std::string& extra) {
    return train_in_process(flags("--num-layers 2 " + extra));
  }
};

std::map<int64_t, double> grad_norms(const TrainingResult& r) {
  std::map<int64_t, double> out;
  for (const auto& l : r.log) out[l.point.iteration] = l.point.grad_norm;
  return out;
}

// The losses and gradient norms of `first` then `second` (resumed from it) are `full`'s, bitwise.
void expect_resumed_bitwise(const TrainingResult& first, const TrainingResult& second, const TrainingResult& full) {
  std::map<int64_t, float> losses = first.losses;
  for (const auto& [k, v] : second.losses) losses[k] = v;
  EXPECT_EQ(losses, full.losses);
  std::map<int64_t, double> norms = grad_norms(first);
  for (const auto& [k, v] : grad_norms(second)) norms[k] = v;
  EXPECT_EQ(norms, grad_norms(full));
}

// A run stopped after 3 iterations and resumed from its checkpoint (the same layout) repeats the
// uninterrupted run's losses, gradient norms and validation losses bitwise: the parameters, the
// optimizer state, the data position, the learning-rate schedule and the dropout keys all resume.
TEST_F(TrainerTest, ResumeContinuesBitwise) {
  for (const auto& [layout, save] :
       std::vector<std::pair<std::string, std::string>>{{"", ""},
                                                        {" --nproc-per-node 2 --pipeline-model-parallel-size 2",
                                                         " --async-save"}}) {
    SCOPED_TRACE(layout + save);
    const TrainingResult full = train("--train-iters 6" + layout);
    ASSERT_EQ(full.losses.size(), 6u);
    ASSERT_EQ(full.validation.size(), 4u);  // 0, 2, 4, 6
    const std::string ck = dir("ck_resume" + std::to_string(layout.size()));
    const TrainingResult first = train("--train-iters 6 --exit-interval 3 --save " + ck + layout + save);
    EXPECT_EQ(first.iteration, 3);
    EXPECT_EQ(first.consumed_samples, 24);
    EXPECT_EQ(latest_checkpoint_iteration(ck), 3);
    const TrainingResult second = train("--train-iters 6 --load " + ck + " --save " + ck + layout + save);
    EXPECT_EQ(second.iteration, 6);
    EXPECT_EQ(second.consumed_samples, 48);
    EXPECT_EQ(second.exit_reason, "");
    EXPECT_EQ(latest_checkpoint_iteration(ck), 6);
    EXPECT_EQ(second.validation.count(0), 0u) << "a resumed run does not validate before its first step";
    expect_resumed_bitwise(first, second, full);
    for (int64_t it : {4, 6}) EXPECT_EQ(second.validation.at(it).loss, full.validation.at(it).loss) << it;
  }
}

// Multi-token prediction (--mtp-num-layers) on one rank and on the last of 2 pipeline stages (a
// tied output layer: the last stage's embedding copy feeds the MTP; an untied one: the last stage
// holds a copy of the word embedding for the MTP): every log line carries each depth's loss, and a
// run resumed from its checkpoint repeats the uninterrupted run's LM losses, gradient norms and MTP
// losses bitwise (the MTP parameters and their optimizer state resume). With
// --mtp-loss-scaling-factor 0 the LM losses equal those of a model without MTP bitwise: the MTP
// changes neither the decoder's initialisation nor its dropout masks nor, at weight 0, its gradients.
TEST_F(TrainerTest, MtpLogsItsLossesAndResumesBitwise) {
  const std::string pp2 = " --nproc-per-node 2 --pipeline-model-parallel-size 2";
  const std::string untied = " --untie-embeddings-and-output-weights";
  int run = 0;
  for (const auto& [model, layout] : {std::pair{std::string(), std::string(" --mtp-num-layers 2")},
                                      std::pair{std::string(), " --mtp-num-layers 1" + pp2},
                                      std::pair{untied, " --mtp-num-layers 1" + pp2}}) {
    SCOPED_TRACE(model + layout);
    const std::string mtp = " --position-embedding-type rope" + model + layout;
    const int depths = layout.find("layers 2") != std::string::npos ? 2 : 1;
    const TrainingResult full = train("--train-iters 6" + mtp);
    ASSERT_EQ(full.log.size(), 6u);
    for (const auto& l : full.log)
      for (int k = 1; k <= 3; ++k) {
        const std::string v = logged(l.line, fmt::format("mtp_{} loss", k));
        if (k > depths) {
          EXPECT_EQ(v, "") << l.line;
        } else {
          ASSERT_NE(v, "") << l.line;
          EXPECT_GT(std::stod(v), 1.0) << l.line;  // a cross entropy over 95 tokens, early in training
        }
      }
    const std::string ck = dir("ck_mtp" + std::to_string(run++));
    const TrainingResult first = train("--train-iters 6 --exit-interval 3 --save " + ck + mtp);
    const TrainingResult second = train("--train-iters 6 --load " + ck + " --save " + ck + mtp);
    expect_resumed_bitwise(first, second, full);
    for (const auto& l : second.log)
      EXPECT_EQ(logged(l.line, "mtp_1 loss"), logged(full.log.at(static_cast<size_t>(l.point.iteration - 1)).line,
                                                     "mtp_1 loss"))
          << l.point.iteration;
    const std::string pp = layout.find("nproc") != std::string::npos ? pp2 : "";
    const TrainingResult none = train("--train-iters 3 --position-embedding-type rope" + model + pp);
    const TrainingResult zero = train("--train-iters 3 --mtp-loss-scaling-factor 0" + mtp);
    EXPECT_EQ(zero.losses, none.losses);
    EXPECT_NE(first.losses.at(3), none.losses.at(3)) << "the MTP loss changed nothing";
  }
}

// --load == --save with nothing saved yet starts from scratch; --finetune loads the weights and
// restarts the iteration count and the data at 0 (validating first, as a fresh run does).
TEST_F(TrainerTest, AutoresumeAndFinetuneStartAtZero) {
  const std::string ck = dir("ck_auto");
  const TrainingResult fresh = train("--train-iters 2 --load " + ck + " --save " + ck);
  EXPECT_EQ(fresh.losses.size(), 2u);
  EXPECT_EQ(fresh.validation.count(0), 1u);
  EXPECT_EQ(latest_checkpoint_iteration(ck), 2);
  const TrainingResult tuned = train("--train-iters 2 --load " + ck + " --finetune");
  EXPECT_EQ(tuned.losses.size(), 2u);
  EXPECT_EQ(tuned.consumed_samples, 16);
  ASSERT_EQ(tuned.validation.count(0), 1u);
  EXPECT_LT(tuned.validation.at(0).loss, fresh.validation.at(0).loss) << "the loaded weights are the trained ones";
}

// --check-for-nan-in-loss-and-grad (the default): a learning rate of 1e30 overflows the parameters
// after the first update; the run stops with an error naming the first bad iteration, and the
// checkpoint of that iteration is never written (--save-interval 1: the last one is iteration 1).
// With --no-check-for-nan-in-loss-and-grad the run goes on and counts the iterations.
TEST_F(TrainerTest, NanCheckStopsBeforeSaving) {
  const std::string ck = dir("ck_nan");
  expect_error_text([&] { train("--train-iters 4 --lr 1e30 --lr-warmup-iters 0 --save-interval 1 --save " + ck); },
                    "iteration 2: the loss is NaN or Inf; stopping before anything more is saved", "NaN check");
  EXPECT_EQ(latest_checkpoint_iteration(ck), 1);
  expect_error_text([&] {
    train("--train-iters 4 --lr 1e30 --lr-warmup-iters 0 --nproc-per-node 2 --pipeline-model-parallel-size 2");
  }, "iteration 2: the ", "NaN check, PP 2 (the first stage sees the gradient norm, the last the loss)");
  const TrainingResult r = train("--train-iters 4 --lr 1e30 --lr-warmup-iters 0 --no-check-for-nan-in-loss-and-grad");
  EXPECT_EQ(r.iteration, 4);
  int64_t nan_iterations = 0;
  for (const auto& l : r.log) nan_iterations += l.point.nan_iterations;
  EXPECT_GE(nan_iterations, 1);
  EXPECT_TRUE(std::isfinite(r.losses.at(1)));
}

// --exit-interval stops (after saving) at the first multiple; not at --train-iters itself.
TEST_F(TrainerTest, ExitInterval) {
  const std::string ck = dir("ck_exit");
  const TrainingResult r = train("--train-iters 6 --exit-interval 2 --save " + ck);
  EXPECT_EQ(r.iteration, 2);
  EXPECT_EQ(r.exit_reason, "--exit-interval 2");
  EXPECT_EQ(latest_checkpoint_iteration(ck), 2);
  const TrainingResult no_save = train("--train-iters 6 --exit-interval 4 --nproc-per-node 2");
  EXPECT_EQ(no_save.iteration, 4);
  EXPECT_EQ(no_save.losses.size(), 4u);
  const TrainingResult end = train("--train-iters 3 --exit-interval 3");
  EXPECT_EQ(end.iteration, 3);
  EXPECT_EQ(end.exit_reason, "") << "reaching --train-iters is not an early exit";
}

// --exit-duration-in-mins: once the time has passed (here at once), every rank stops after the
// iteration and saves.
TEST_F(TrainerTest, ExitDuration) {
  const std::string ck = dir("ck_duration");
  const TrainingResult r =
      train("--train-iters 6 --exit-duration-in-mins 1e-9 --nproc-per-node 2 --tensor-model-parallel-size 2 --save " + ck);
  EXPECT_EQ(r.iteration, 1);
  EXPECT_EQ(r.exit_reason, "--exit-duration-in-mins 1e-09 reached");
  EXPECT_EQ(latest_checkpoint_iteration(ck), 1);
  EXPECT_EQ(train("--train-iters 2 --exit-duration-in-mins 1000").iteration, 2);
}

// --exit-signal-handler: a SIGTERM received by the process (before the first iteration ends) stops
// the run after that iteration with a checkpoint; the handlers are restored afterwards.
TEST_F(TrainerTest, ExitSignalSavesAndStops) {
  const std::string ck = dir("ck_signal");
  TrainingResult r;
  run_thread_ranks(1, [&](int, std::shared_ptr<Communicator> world) {
    const std::string f = flags("--num-layers 2 --train-iters 6 --exit-signal-handler --save " + ck);
    TrainingSetup setup(testing::parse_pretrain_args(f), std::move(world), Device::cpu());
    Trainer trainer(setup);
    std::raise(SIGTERM);  // handled: sets the flag
    r = trainer.train();
  });
  EXPECT_EQ(r.iteration, 1);
  EXPECT_EQ(r.exit_reason, "received signal SIGTERM (--exit-signal-handler)");
  EXPECT_EQ(latest_checkpoint_iteration(ck), 1);
  EXPECT_EQ(ExitSignalHandler::received(), SIGTERM);
}

// ExitPolicy over thread ranks: a signal or an elapsed duration seen by one rank stops every rank
// with the same reason (a signal named first); the interval alone needs no communication.
TEST(ExitPolicy, RanksAgree) {
  std::vector<std::string> reasons(2);
  run_thread_ranks(2, [&](int rank, std::shared_ptr<Communicator> world) {
    Stream st(Device::cpu());
    const ExitPolicy quiet({0, 0, [] { return 0; }}, *world, st);
    const ExitPolicy one_signal({4, 0, [rank] { return rank == 1 ? SIGTERM : 0; }}, *world, st);
    const ExitPolicy one_late({0, rank == 0 ? 1e-9 : 1e6, {}}, *world, st);
    const ExitPolicy interval({4, 0, {}}, *world, st);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    const std::string q = quiet.check(4), s = one_signal.check(4), d = one_late.check(3);
    reasons[static_cast<size_t>(rank)] = q + "|" + s + "|" + d + "|" + interval.check(4) + "|" + interval.check(5);
  });
  EXPECT_EQ(reasons[0], "|received signal SIGTERM (--exit-signal-handler)|--exit-duration-in-mins 1e-09 reached|"
                        "--exit-interval 4|");
  EXPECT_EQ(reasons[1], "|received signal SIGTERM (--exit-signal-handler)|--exit-duration-in-mins 1000000 reached|"
                        "--exit-interval 4|");
}

// --cuda-graph-impl on a CPU device is an error before the model is built.
TEST_F(TrainerTest, CudaGraphsNeedACudaDevice) {
  expect_error_text([&] { train("--train-iters 2 --cuda-graph-impl local"); },
                    "--cuda-graph-impl local needs a CUDA device; this run is on cpu", "local");
  expect_error_text([&] { train("--train-iters 2 --cuda-graph-impl full_iteration"); },
                    "--cuda-graph-impl full_iteration needs a CUDA device", "full_iteration");
}

// The step runner's policies on a CPU ModelSetup (a Llama-style model with dropout, 2 micro-batches
// of random tokens): per-layer graphs (the regions run eagerly on a CPU stream, the dropout keyed by
// the slots' device keys) and the full-iteration policy before its capture (the forward and
// backward, then the optimizer step outside, the loss through its own slot; with
// --cuda-graph-include-optimizer inside) give the eager losses, gradient norms and parameters
// bitwise; the capture itself (after the warm-up) is an error on the CPU.
struct PolicyRun {
  std::vector<float> losses, grad_norms, params;
};

PolicyRun run_policy(const CudaGraphOptions& graphs, int steps) {
  ModelSetupOptions o;
  o.model.num_layers = 2;
  o.model.hidden_size = 32;
  o.model.num_attention_heads = 4;
  o.model.num_query_groups = 2;
  o.model.seq_length = 16;
  o.model.vocab_size = 50;
  o.model.make_vocab_size_divisible_by = 8;
  o.model.gated_linear_unit = true;
  o.model.normalization = Normalization::kRMSNorm;
  o.model.position_embedding_type = PositionEmbeddingType::kRope;
  o.model.hidden_dropout = o.model.attention_dropout = 0.1f;
  o.num_microbatches = 2;
  o.micro_batch_size = 2;
  PolicyRun out;
  run_thread_ranks(1, [&](int, std::shared_ptr<Communicator> world) {
    Stream st(Device::cpu());
    ModelSetup setup(world, o, st);
    setup.model().params().initialize(11, st);
    StepRunner runner(setup, graphs, 5, nullptr, st);
    std::mt19937 rng(3);
    std::vector<testing::OwnedTensor> data;
    std::vector<MicroBatch> mbs;
    for (int m = 0; m < 2; ++m) {
      std::vector<int32_t> t(32), l(32);
      for (auto& x : t) x = static_cast<int32_t>(rng() % 50);
      for (auto& x : l) x = static_cast<int32_t>(rng() % 50);
      data.push_back(testing::make_int_tensor(t, Device::cpu(), {16, 2}, st));
      data.push_back(testing::make_int_tensor(l, Device::cpu(), {16, 2}, st));
      MicroBatch b{data[2 * m].t, data[2 * m + 1].t, Tensor()};
      b.loss_weight = 1.f / 64;
      b.aux_loss_weight = 0.5f;
      mbs.push_back(b);
    }
    testing::OwnedTensor loss(DType::kF32, Device::cpu(), {1});
    for (int it = 0; it < steps; ++it) {
      fill(loss, 0.f, st);
      runner.step(it, 1e-2f, mbs, loss.t, nullptr);
      out.losses.push_back(testing::to_host(loss.t, st)[0]);
      out.grad_norms.push_back(setup.optimizer().read_scalars_sync(st).grad_norm);
    }
    EXPECT_EQ(runner.steps_run(), steps);
    EXPECT_GE(runner.take_host_issue_ms(), 0.0);
    EXPECT_EQ(runner.take_host_issue_ms(), 0.0);  // taken
    out.params = testing::to_host(setup.model().params().main_flat(), st);
  });
  return out;
}

TEST(StepRunner, GraphPoliciesOnTheCpuEqualEagerSteps) {
  const PolicyRun eager = run_policy(CudaGraphOptions{}, 4);
  ASSERT_EQ(eager.losses.size(), 4u);
  EXPECT_NE(eager.losses[0], eager.losses[3]);
  CudaGraphOptions per_layer;
  per_layer.impl = "local";
  per_layer.scope = {"attn", "mlp"};
  per_layer.warmup_steps = 1;
  CudaGraphOptions full;
  full.impl = "full_iteration";
  full.warmup_steps = 100;  // never captured in these steps
  CudaGraphOptions full_opt = full;
  full_opt.include_optimizer = true;
  for (const auto& [name, g] : {std::pair{"per layer", per_layer}, std::pair{"full iteration warm-up", full},
                                std::pair{"full iteration with the optimizer, warm-up", full_opt}}) {
    SCOPED_TRACE(name);
    const PolicyRun r = run_policy(g, 4);
    EXPECT_EQ(r.losses, eager.losses);
    EXPECT_EQ(r.grad_norms, eager.grad_norms);
    EXPECT_EQ(r.params, eager.params);
  }
  full.warmup_steps = 2;  // the third step captures: not on a CPU stream
  EXPECT_THROW(run_policy(full, 3), Error);
}

}  // namespace
}  // namespace mt
