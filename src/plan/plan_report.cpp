// What `megatron plan` prints: the plan with its reasoning, the search table, the JSON object, and
// the subcommand's options (plan/plan.h).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/cli_validators.h"
#include "plan/plan.h"

namespace mt {

namespace {
double gib(double bytes) { return bytes / kGiB; }
double ms(double s) { return s * 1e3; }
}  // namespace

std::string format_plan(const TrainingPlan& p) {
  const ParallelConfig& pc = p.parallel;
  std::string o = fmt::format("> plan: {} GPUs ({}), {}\n", pc.world, p.gpu.name, p.summary);
  o += p.layout_table;
  o += fmt::format(
      "> model: {:.4g}B parameters (vocabulary {}), micro-batch {} x sequence {}, global batch {}: {} micro-batches "
      "per data-parallel rank and iteration\n",
      static_cast<double>(p.total_parameters) / 1e9, p.vocab_size, p.micro_batch_size, p.seq_length,
      p.global_batch_size, p.num_microbatches);
  o += fmt::format("> FLOPs per iteration: {:.4g} TFLOP (Megatron-Core's formula, no recompute)\n",
                   p.flops_per_iteration / 1e12);
  const double capacity = p.gpu.memory_gib / (p.gpu.is_cuda() ? 1 : pc.world);
  o += fmt::format("> memory per rank (the estimate `megatron pretrain` prints at start; {:.1f} GiB {}):\n", capacity,
                   p.gpu.is_cuda() ? "per GPU" : "of host memory per CPU rank");
  for (const RankKindPlan& k : p.stages) {
    o += fmt::format(">   stage {} (ranks {}{}), layers {}, {:.4g}M parameter elements: {}\n", k.pp_rank,
                     fmt::join(std::vector<int>(k.ranks.begin(), k.ranks.begin() + std::min<size_t>(k.ranks.size(), 8)), ","),
                     k.ranks.size() > 8 ? ",..." : "", k.layers, static_cast<double>(k.parameters) / 1e6,
                     k.memory.summary());
    o += fmt::format(">     + {:.2f} GiB reserved (CUDA context, workspaces{}) = {:.2f} GiB of {:.1f}: {}\n",
                     gib(k.reserved_bytes), pc.world > 1 ? ", NCCL" : "",
                     gib(static_cast<double>(k.memory.total()) + k.reserved_bytes), capacity,
                     k.fits ? "fits" : "DOES NOT FIT");
  }
  if (!p.fits) {
    const RankKindPlan& worst = *std::max_element(p.stages.begin(), p.stages.end(), [](const auto& x, const auto& y) {
      return x.memory.total() < y.memory.total();
    });
    std::vector<MemoryPart> parts = worst.memory.parts;
    std::stable_sort(parts.begin(), parts.end(), [](const auto& x, const auto& y) { return x.bytes > y.bytes; });
    o += fmt::format("> does not fit: stage {} needs {:.2f} GiB; largest consumers:", worst.pp_rank,
                     gib(static_cast<double>(worst.memory.total()) + worst.reserved_bytes));
    for (size_t i = 0; i < parts.size() && i < 3; ++i)
      o += fmt::format(" {} {:.2f} GiB{};", parts[i].name, gib(static_cast<double>(parts[i].bytes)),
                       parts[i].remedy.empty() ? "" : " (helps: " + parts[i].remedy + ")");
    o += "\n";
  }
  const StepPrediction& s = p.step;
  if (!s.available) return o + "> step time: no cost model for CPU ranks\n";
  o += fmt::format(
      "> predicted step: {:.1f} ms = (compute {:.1f} + TP {:.1f} + CP {:.1f} + EP {:.1f} ms on the slowest stage) x "
      "(1 + bubble {:.1f}%) + pipeline sends {:.1f} + data-parallel exposed {:.1f} + optimizer {:.1f} ms{}\n",
      ms(s.step_s), ms(s.compute_s), ms(s.tp_comm_s), ms(s.cp_comm_s), ms(s.ep_comm_s), 100 * s.bubble_fraction,
      ms(s.pp_comm_s), ms(s.dp_comm_s), ms(s.optimizer_s),
      s.muon_s > 0 ? fmt::format(" + Muon Newton-Schulz {:.1f} ms", ms(s.muon_s)) : std::string());
  if (s.moe_experts_s > 0 || s.mla_passes_s > 0 || s.fp8_gemm_saved_s > 0) {
    std::string parts;
    if (s.moe_experts_s > 0)
      parts += fmt::format("MoE experts' MLPs {:.1f} ms, MoE token passes (router, permute, dispatch, combine) "
                           "{:.1f} ms, ",
                           ms(s.moe_experts_s), ms(s.moe_token_passes_s));
    if (s.mla_attention_s > 0) parts += fmt::format("MLA core attention {:.1f} ms, ", ms(s.mla_attention_s));
    if (s.mla_passes_s > 0) parts += fmt::format("MLA pack / RoPE / unpack passes {:.1f} ms, ", ms(s.mla_passes_s));
    if (s.fp8_gemm_saved_s > 0)
      parts += fmt::format("FP8: linear GEMMs -{:.1f} ms against bf16, casts and amax passes +{:.1f} ms, ",
                           ms(s.fp8_gemm_saved_s), ms(s.fp8_casts_s));
    o += fmt::format("> of the compute: {}the rest at {:.1f}% of the peak {:.1f} ms\n", parts,
                     100 * p.gpu.compute_efficiency,
                     ms(s.compute_s - s.moe_experts_s - s.moe_token_passes_s - s.mla_attention_s - s.mla_passes_s +
                        s.fp8_gemm_saved_s - s.fp8_casts_s));
  }
  o += fmt::format("> predicted throughput: {:.1f} TFLOP/s per GPU, MFU {:.1f}% (of {:.1f}), {:.1f}K tokens/s\n",
                   s.tflops_per_gpu, 100 * s.mfu, p.gpu.peak_tflops, s.tokens_per_s / 1e3);
  return o;
}

std::string format_search(const std::vector<TrainingPlan>& plans, int refused, size_t rows) {
  std::string o = fmt::format("> {} layouts planned ({} refused by the checks), fitting ones first, by predicted step "
                              "time:\n",
                              plans.size(), refused);
  o += fmt::format("{:>4}  {:<34} {:>6} {:>12} {:>10} {:>7} {:>8}  {}\n", "rank", "layout", "m", "memory GiB",
                   "step ms", "MFU %", "bubble %", "fits");
  for (size_t i = 0; i < plans.size() && i < rows; ++i) {
    const TrainingPlan& p = plans[i];
    size_t worst = 0;
    for (const auto& k : p.stages) worst = std::max(worst, k.memory.total());
    o += fmt::format("{:>4}  {:<34} {:>6} {:>12.2f} {:>10.1f} {:>7.1f} {:>8.1f}  {}\n", i + 1, p.summary,
                     p.num_microbatches, gib(static_cast<double>(worst) + p.stages.front().reserved_bytes),
                     ms(p.step.step_s), 100 * p.step.mfu, 100 * p.step.bubble_fraction, p.fits ? "yes" : "no");
  }
  return o;
}

std::string plan_json(const TrainingPlan& p) {
  using nlohmann::json;
  const ParallelConfig& pc = p.parallel;
  json j;
  j["gpu"] = {{"name", p.gpu.name},
              {"memory_gib", p.gpu.memory_gib},
              {"peak_tflops", p.gpu.peak_tflops},
              {"compute_efficiency", p.gpu.compute_efficiency}};
  j["parallel"] = {{"world", pc.world}, {"tp", pc.tp}, {"pp", pc.pp}, {"vpp", pc.num_chunks()}, {"cp", pc.cp},
                   {"ep", pc.ep},       {"etp", pc.etp}, {"dp", pc.dp}, {"edp", pc.edp},
                   {"sequence_parallel", p.sequence_parallel}};
  j["micro_batch_size"] = p.micro_batch_size;
  j["global_batch_size"] = p.global_batch_size;
  j["num_microbatches"] = p.num_microbatches;
  j["seq_length"] = p.seq_length;
  j["vocab_size"] = p.vocab_size;
  j["parameters"] = p.total_parameters;
  j["flops_per_iteration"] = p.flops_per_iteration;
  j["fits"] = p.fits;
  json stages = json::array();
  for (const RankKindPlan& k : p.stages) {
    json parts = json::array();
    for (const MemoryPart& part : k.memory.parts) parts.push_back({{"name", part.name}, {"bytes", part.bytes}});
    stages.push_back({{"pp_rank", k.pp_rank},
                      {"ranks", k.ranks},
                      {"layers", k.layers},
                      {"parameter_elements", k.parameters},
                      {"memory_bytes", k.memory.total()},
                      {"memory_parts", parts},
                      {"reserved_bytes", k.reserved_bytes},
                      {"fits", k.fits}});
  }
  j["stages"] = stages;
  const StepPrediction& s = p.step;
  if (s.available)
    j["step"] = {{"step_s", s.step_s},         {"compute_s", s.compute_s},     {"tp_comm_s", s.tp_comm_s},
                 {"cp_comm_s", s.cp_comm_s},   {"ep_comm_s", s.ep_comm_s},     {"pp_comm_s", s.pp_comm_s},
                 {"bubble_fraction", s.bubble_fraction}, {"dp_comm_s", s.dp_comm_s}, {"optimizer_s", s.optimizer_s}, {"muon_s", s.muon_s},
                 {"moe_experts_s", s.moe_experts_s}, {"moe_token_passes_s", s.moe_token_passes_s},
                 {"mla_attention_s", s.mla_attention_s}, {"mla_passes_s", s.mla_passes_s},
                 {"fp8_gemm_saved_s", s.fp8_gemm_saved_s}, {"fp8_casts_s", s.fp8_casts_s},
                 {"tflops_per_gpu", s.tflops_per_gpu},   {"mfu", s.mfu},             {"tokens_per_s", s.tokens_per_s}};
  else
    j["step"] = nullptr;
  return j.dump(2);
}

void add_plan_options(CLI::App& app, PlanCommandArgs& args) {
  add_pretrain_options(app, args.request.args);
  // what sizes nothing: a script's values are accepted, none is needed
  for (const char* flag : {"--train-iters", "--lr"}) app.get_option(flag)->required(false);
  app.add_option("--world-size", args.request.world_size, "GPUs (ranks) of the job to plan")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--gpu", args.request.gpu, "Machine kind: h100, h200 or cpu")->capture_default_str();
  app.add_option("--gpu-profile", args.request.gpu_profile,
                 "A measured machine profile: a JSON object overriding --gpu's figures (memory_gib, "
                 "compute_efficiency, hbm_gbps, intra_bus_gbps, inter_bus_gbps, collective_latency_us, "
                 "peak_tflops, gpus_per_node, reserved_*; docs/plan.md)");
  app.add_option("--gpu-memory-gib", args.request.memory_gib, "Device memory per GPU in GiB (default: the --gpu's)")
      ->check(number_range(0, kNoMax, true));
  app.add_flag("--search", args.search, "Rank every TP/PP/VPP/CP/EP layout of --world-size GPUs that passes the checks");
  app.add_option("--top", args.top, "Rows of the --search table")->check(positive_integer())->capture_default_str();
  app.add_flag("--json", args.json, "Print the plan as one JSON object");
}

int run_plan(PlanCommandArgs& args) {
  if (args.search) {
    int refused = 0;
    const std::vector<TrainingPlan> plans = search_layouts(args.request, &refused);
    MT_REQUIRE(!plans.empty(), "--search: no layout of {} GPUs passes the checks ({} refused)",
               args.request.world_size, refused);
    if (args.json) {
      std::string out = "[";
      for (size_t i = 0; i < plans.size() && i < static_cast<size_t>(args.top); ++i)
        out += (i ? ",\n" : "\n") + plan_json(plans[i]);
      std::printf("%s\n]\n", out.c_str());
    } else {
      std::printf("%s", format_search(plans, refused, static_cast<size_t>(args.top)).c_str());
    }
    return plans.front().fits ? 0 : 2;
  }
  const TrainingPlan plan = plan_training(args.request);
  std::printf("%s\n", (args.json ? plan_json(plan) : format_plan(plan)).c_str());
  return plan.fits ? 0 : 2;
}

}  // namespace mt
