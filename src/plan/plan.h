// `megatron plan`: sizes a training layout before any GPU is rented (docs/plan.md).
//
// From `megatron pretrain`'s arguments and a machine (--world-size N --gpu h100|h200|cpu) it
// computes, without running a rank:
//   - the rank layout (Megatron-Core's RankGenerator, parallel/process_groups.h);
//   - per kind of rank (each pipeline stage; TP / CP / DP / EP ranks of a stage hold the same
//     sizes) the memory estimate `megatron pretrain` prints and checks at start
//     (train/memory_estimate.h: estimate_rank_memory measures the model the rank would build,
//     GPTModel::memory_plan, with groups that only know their sizes, plan/plan_groups.h), and
//     whether it fits in the device memory less what the CUDA context and NCCL take;
//   - the FLOPs of an iteration (TransformerConfig::flops_per_iteration, Megatron-Core's formula)
//     and a predicted step time and MFU from a cost model whose rates are calibrated on the
//     measurements of docs/benchmarks.md (compute rate, NCCL bus bandwidths, the pipeline bubble
//     of the 1F1B schedules, the optimizer's memory traffic);
//   - with search: every TP / PP / VPP / CP / EP layout of the world that passes the checks,
//     ranked by predicted step time, with the ones that do not fit last.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/parallel_config.h"
#include "train/arguments.h"
#include "train/memory_estimate.h"

namespace CLI {
class App;
}

namespace mt {

/// Bytes per GiB (the plan prints memory in GiB).
inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

/// A machine kind: device memory, the bf16 dense peak (the MFU denominator) and the rates of the
/// cost model (docs/plan.md "Cost model" gives where each number comes from).
struct GpuSpec {
  std::string name;              ///< "h100", "h200", "cpu"
  double memory_gib = 0;         ///< device memory a process can allocate, GiB
  double reserved_gib = 0;       ///< one rank alone: CUDA context + cuBLASLt workspaces, GiB
  double reserved_nccl_gib = 0;  ///< added with several ranks (tensor parallel only): NCCL, GiB
  double reserved_nccl_group_gib = 0;    ///< more when PP, DP, CP or EP spans ranks (their communicators)
  double reserved_tp_overlap_gib = 0;    ///< more with --tp-comm-overlap (its communicators and buffers)
  double peak_tflops = 0;        ///< dense bf16 TFLOP/s (kMfuPeakTflops for H100/H200)
  double compute_efficiency = 0; ///< fraction of the peak the model FLOPs run at (whole step, one GPU)
  double hbm_gbps = 0;           ///< device memory bandwidth, GB/s (the optimizer step)
  double intra_bus_gbps = 0;     ///< NCCL bus bandwidth within a node (NVLink), GB/s
  double inter_bus_gbps = 0;     ///< NCCL bus bandwidth between nodes (InfiniBand, per GPU), GB/s
  double collective_latency_us = 0;  ///< fixed cost of one collective, µs
  int gpus_per_node = 8;
  bool cuda = true;              ///< false for "cpu" (CPU ranks share the host)
  bool is_cuda() const { return cuda; }
};

/// The GpuSpec of `name` (h100, h200, cpu). Errors: any other name, naming it and the known ones.
GpuSpec gpu_spec(const std::string& name);

/// A measured machine profile (--gpu-profile FILE): a JSON object whose keys override `base`'s
/// fields of the same names — memory_gib, reserved_gib, reserved_nccl_gib, reserved_nccl_group_gib,
/// reserved_tp_overlap_gib, peak_tflops, compute_efficiency, hbm_gbps, intra_bus_gbps,
/// inter_bus_gbps, collective_latency_us (numbers; the reserves and the latency >= 0, the rest > 0,
/// compute_efficiency at most 1) and gpus_per_node (an integer in [1, 2^20]); the name becomes
/// "NAME + FILE". Errors (mt::Error naming the
/// file and the key): unreadable file, invalid JSON, not an object, an unknown key, a value of the
/// wrong type or range.
GpuSpec apply_gpu_profile(GpuSpec base, const std::string& path);

/// One measured rate of an MoE layer's expert MLPs: fc1 + fc2 (SwiGLU's fc1 2·ffn wide), forward +
/// dgrad + wgrad, bf16, --moe-grouped-gemm, in TFLOP/s, at an intermediate size `ffn` per GPU.
struct ExpertMlpRate {
  double ffn;
  double tflops;
};
/// The expert MLPs' rates measured on an H200 (docs/plan.md "Cost model"; H100s are given the
/// same, their bf16 peak being the H200's). What sets the rate is the intermediate size (fc1's N,
/// fc2's K: a short main loop per output tile), much less the rows per expert: the shared expert
/// of bench/deepseek_v3.sh (one 4096-row GEMM pair at ffn 512) ran at 413.6 TFLOP/s, its routed
/// experts (64 × ~384 rows at ffn 512) at 422.7.
inline constexpr ExpertMlpRate kExpertMlpRates[] = {
    // bench/deepseek_v3.sh 1gpu, H200, 2026-11-29, MT_MOE_PHASE_TIMING: the "experts" phase (grouped
    // GEMMs + SwiGLU) of 15 layers, h 2048, top-6 of 64, 8 × 4096 tokens: 55.66 TFLOP in 131.69 ms
    {512, 422.7},
    // build/grouped_matmul_bench DeepSeek-style, H200, 2026-11-28: 64 × 768 rows, h 2048, 1.701 TFLOP in 3.64 ms
    {1408, 467.3},
    // build/grouped_matmul_bench Mixtral-style, H200, 2026-11-28: 8 × 8192 rows, h 4096, 46.18 TFLOP in 73.84 ms
    {14336, 625.4},
};
/// The expert-MLP rate (TFLOP/s) at intermediate size `ffn` per GPU: kExpertMlpRates interpolated
/// linearly in log(ffn), the end points' rates outside them.
double expert_mlp_tflops(double ffn);
/// The MoE layer's memory-bound work (router, permutation, dispatch, combine and what lies between
/// them, forward + backward) in units of one HBM pass over the layer's top-k token rows
/// (tokens · top-k · hidden · 2 bytes at the HBM bandwidth): bench/deepseek_v3.sh 1gpu, H200,
/// 2026-11-29, 9.35 + 3.02 + 9.84 + 13.58 + 2.87 = 38.68 ms per iteration over 15 layers × 8
/// micro-batches of 4096 tokens, top-6, hidden 2048 (one pass: 100.7 MB, 20.97 µs at 4.8 TB/s).
inline constexpr double kMoeTokenPasses = 15.37;

/// Multi-latent attention's core attention, cuDNN's fused SDPA, at the packed head dim D = max(d_qk,
/// d_v) (ops/mla.h: the value heads zero-padded to D), causal, in TFLOP/s of the kernels' own count:
/// forward Q·Kᵀ and P·V at D, 4 · s²/2 · n · D per sequence; backward 2.5 times that (5 GEMMs,
/// FlashAttention-2's count), its dO·O and dQ-conversion kernels included. Per-kernel profile of
/// bench/deepseek_v3.sh's model (2 layers, micro-batch 1, s 4096, 16 heads, D 192; ncu, one H200,
/// 2026-11-29, docs/plan.md "The DeepSeek-V3-shaped MoE"): forward 103.1 GFLOP in 183.4 µs,
/// backward 257.7 GFLOP in 600.9 µs per layer and micro-batch. Used at every sequence length, and
/// for H100s (the same bf16 peak; not measured there).
inline constexpr double kMlaAttentionForwardTflops = 562.1;
inline constexpr double kMlaAttentionBackwardTflops = 428.8;
/// MLA's tensor plumbing around the core attention in units of one HBM pass over the packed
/// [T, n, 3, D] query/key/value tensor (tokens · heads · 3 · D · 2 bytes at the HBM bandwidth):
/// forward mla_qkv_pack, RoPE, the context unpack; backward the context pad, RoPE, the unpack and
/// dk_pe's head sum. The same profile: forward 208.1 + 11.8 + 23.0 = 242.8 µs, backward 33.4 + 11.8
/// + 90.9 + 6.1 = 142.1 µs per layer and micro-batch; one pass 75.5 MB, 15.73 µs at 4.8 TB/s. The
/// pack runs at 0.65 TB/s, far from the bandwidth: a faster kernel lowers these counts.
inline constexpr double kMlaPassesForward = 15.44;
inline constexpr double kMlaPassesBackward = 9.03;

/// FP8 linear layers (--fp8-format; docs/plan.md "FP8"), from the H200 profile of the Llama-style
/// 1.18B (bench/fp8_profile.sh, 4 layers, micro-batch 4, Nsight Compute with cold caches, 2026-11-29;
/// docs/benchmarks.md "Where an FP8 step's time goes") and fp8_gemm_bench:
/// - kBf16LinearGemmEfficiency: the decoder's linear GEMMs in bf16 ran at this fraction of the
///   989.4 TFLOP/s peak (6 · 4096 · 60,817,408 · 4 = 5.98 TFLOP in 10.78 − 2.10 (LM head) = 8.68 ms);
/// - kFp8GemmSpeedup: the same GEMMs in FP8 with one scale per tensor, 8.68 → 5.50 ms (tensorwise)
///   and 5.52 ms (delayed); with 1×128 / 128×128 blocks the middle of fp8_gemm_bench's 1.22–1.57×
///   at the 1.18B's shapes;
/// - kFp8ActCastGBps / kFp8WeightCastGBps: the cast (+ transpose) passes, counted as 4 bytes per
///   element of each linear's input and output gradient (bf16 read, FP8 and its transpose written)
///   and 6 per weight element once per step (fp32 main parameter read, w and wᵀ written): activations
///   2.48 GB per 4 layers in 1.51 − 0.46 = 1.05 ms (delayed), weights 1.46 GB in 0.46 ms;
/// - kFp8BlockActCastFactor / kFp8BlockWeightCastFactor: blockwise casts against tensorwise ones
///   (fp8_gemm_bench, 4096 × 11008: 1×128 blocks 0.143 ms, 128×128 0.073 ms, one scale 0.067 ms);
/// - tensorwise's amax passes: 2 bytes per activation element at kFp8ActAmaxGBps, 4 per weight
///   element at kFp8WeightAmaxGBps (0.40 and 0.27 ms in the profile), and the scale computations
///   (kFp8TensorwiseScaleS / kFp8DelayedScaleS per FP8 layer and micro-batch: 0.10 / 0.04 ms per
///   4 layers);
/// - with biases (GPT style) the FP8 path adds the passes cuBLASLt's bf16 epilogues fuse: each
///   bias gradient but fc1's from its output gradient (2 bytes per element), and with GELU the
///   GELU backward (6 bytes per fc1 output element), at kFp8ActCastGBps;
/// - delayed scaling's fused SwiGLU (docs/fp8.md "Fused quantisation"): fc2's input cast costs
///   kFp8FusedSwigluFwdFactor of a cast (the fused kernel's time beyond the bf16 SwiGLU's, over the
///   cast's: fp8_gemm_bench at 8192 × 8192 on an H200, (0.158 − 0.113) / 0.104 ms) when there is
///   no sequence parallelism, fc1's output gradient cast kFp8FusedSwigluBwdFactor ((0.247 − 0.179)
///   / 0.198 ms) when fc1 has no bias;
/// - delayed scaling's fused GELU (GPT style): per fc1 output element the forward saves
///   kFp8FusedGeluFwdSavedPs (without sequence parallelism) and the backward kFp8FusedGeluBwdSavedPs
///   picoseconds against the unfused passes the GPT rows were calibrated on (fp8_gemm_bench --model
///   gpt_1p3b, 8192 x 8192, H200, 2026-11-29: fp8_bias_gelu with the bias + the cast + transpose
///   0.379 ms against fp8_gelu_forward's 0.152; gelu_backward + the bias gradient + the cast 0.250
///   against fp8_gelu_backward's 0.200, per 8192² elements);
/// - the per-tensor recipes' bias epilogue: the separate bias passes it replaced ran at
///   kFp8BiasPassGBps (MODEL=gpt_1p3b bench/fp8_profile.sh, H200, 2026-11-29: linear_qkv's bias
///   and the bias + residual adds of linear_proj and linear_fc2, 403 MB per layer at micro-batch 8,
///   1.04 ms per 4 layers).
/// H100s: the bandwidths scaled by the HBM ratio (not measured there).
inline constexpr double kBf16LinearGemmEfficiency = 0.696;
inline constexpr double kFp8GemmSpeedup = 1.575;
inline constexpr double kFp8FusedSwigluFwdFactor = 0.43;
inline constexpr double kFp8FusedSwigluBwdFactor = 0.34;
inline constexpr double kFp8FusedGeluFwdSavedPs = 3.38;
inline constexpr double kFp8BiasPassGBps = 1550;
inline constexpr double kFp8FusedGeluBwdSavedPs = 0.75;
inline constexpr double kFp8BlockGemmSpeedup = 1.40;
inline constexpr double kFp8ActCastGBps = 2370;
inline constexpr double kFp8WeightCastGBps = 3170;
inline constexpr double kFp8BlockActCastFactor = 2.13;
inline constexpr double kFp8BlockWeightCastFactor = 1.09;
inline constexpr double kFp8ActAmaxGBps = 3100;
inline constexpr double kFp8WeightAmaxGBps = 3600;
inline constexpr double kFp8TensorwiseScaleS = 25e-6;
inline constexpr double kFp8DelayedScaleS = 10e-6;

/// What `megatron plan` is asked.
struct PlanRequest {
  PretrainArgs args;       ///< as parsed from the script's flags (not yet resolved)
  int world_size = 1;      ///< --world-size
  std::string gpu = "h100";  ///< --gpu
  double memory_gib = 0;   ///< --gpu-memory-gib: overrides the GpuSpec's memory (0 = keep)
  std::string gpu_profile;  ///< --gpu-profile: a measured profile over --gpu's spec (apply_gpu_profile)
};

/// The memory of one kind of rank (one pipeline stage).
struct RankKindPlan {
  int pp_rank = 0;
  std::vector<int> ranks;        ///< the global ranks of this stage
  std::string layers;            ///< "[0, 16) [32, 48)": its layer ranges
  int64_t parameters = 0;        ///< parameters held by one rank of this stage
  MemoryEstimate memory;         ///< estimate_rank_memory: the buffers megatron.cpp allocates
  double reserved_bytes = 0;     ///< CUDA context, workspaces, NCCL on top
  bool fits = false;             ///< memory.total() + reserved within the device memory
};

/// The cost model's prediction of one iteration (seconds per iteration, for the slowest stage).
struct StepPrediction {
  bool available = false;        ///< false on the CPU: no cost model
  double compute_s = 0;          ///< the rank's FLOPs (with recompute) at the calibrated rate, the
                                 ///< MoE layers' experts and token passes and MLA's attention and
                                 ///< passes included
  double moe_experts_s = 0;      ///< of compute_s: the experts' MLPs at kExpertMlpRates
  double moe_token_passes_s = 0; ///< of compute_s: the MoE layers' router / permute / dispatch / combine
  double mla_attention_s = 0;    ///< of compute_s: MLA's core attention at kMlaAttention*Tflops
  double mla_passes_s = 0;       ///< of compute_s: MLA's pack / RoPE / unpack passes (kMlaPasses*)
  double tp_comm_s = 0;          ///< tensor-parallel all-reduces / SP all-gathers + reduce-scatters
  double cp_comm_s = 0;          ///< context-parallel ring exchanges of K and V
  double ep_comm_s = 0;          ///< expert-parallel token dispatch and combine
  double pp_comm_s = 0;          ///< pipeline boundary sends and receives
  double bubble_fraction = 0;    ///< (pp − 1) / (m · vpp) of the work above
  double dp_comm_s = 0;          ///< gradient reduction + parameter gather not hidden by overlap
  double optimizer_s = 0;        ///< AdamW over the owned parameters (memory bound)
  double fp8_gemm_saved_s = 0;   ///< of compute_s (subtracted): --fp8-format, the FP8 layers' linear
                                 ///< GEMMs' time saved against bf16 (qkv and proj; fc1 and fc2 of
                                 ///< dense layers; kFp8GemmSpeedup)
  double fp8_casts_s = 0;        ///< of compute_s (added): the FP8 casts, amax passes, scale updates
                                 ///< and unfused bias / GELU passes
  double muon_s = 0;             ///< --optimizer muon: the Newton-Schulz GEMMs of the rank's matrices
                                 ///< (all, or 1/DP of them with the distributed optimizer)
  double step_s = 0;             ///< the total
  double tflops_per_gpu = 0;     ///< model FLOPs / (step · world), Megatron's throughput
  double mfu = 0;                ///< tflops_per_gpu / peak
  double tokens_per_s = 0;
};

/// A planned layout.
struct TrainingPlan {
  GpuSpec gpu;
  ParallelConfig parallel;        ///< validated and derived
  bool sequence_parallel = false;
  int64_t micro_batch_size = 1, global_batch_size = 1, num_microbatches = 1, seq_length = 0;
  int64_t vocab_size = 0;
  int64_t total_parameters = 0;   ///< the whole model (padded vocabulary, tied embedding once)
  double flops_per_iteration = 0; ///< Megatron-Core's formula, no recompute
  int recomputed_layers = 0;      ///< of the stage that recomputes the most (full recompute)
  std::vector<RankKindPlan> stages;
  bool fits = false;              ///< every stage fits
  StepPrediction step;
  std::string layout_table;       ///< the rank groups (process_groups.h layout_table)
  std::string summary;            ///< "tp=2 pp=4 vpp=2 cp=1 ep=1 dp=8"
};

/// Plans `request` (errors: mt::Error naming the flag and value, as `megatron pretrain` would
/// refuse it, plus --world-size < 1 and an unknown --gpu). The vocabulary comes from the tokenizer
/// flags (its files must exist) unless --vocab-size gives it.
TrainingPlan plan_training(const PlanRequest& request);
/// The same on a machine already built (machine_of(request): --search plans every layout on one).
TrainingPlan plan_training(const PlanRequest& request, const GpuSpec& machine);
/// The machine of a request: gpu_spec(--gpu), then --gpu-profile, then --gpu-memory-gib.
GpuSpec machine_of(const PlanRequest& request);

/// One row per layout of request.world_size GPUs (TP ≤ GPUs per node, dividing the heads; PP
/// dividing the layers, with and without interleaving; CP and EP as the model allows; DP the
/// rest, --global-batch-size kept) that passes the checks: fitting layouts first, by predicted
/// step time. Layouts the checks refuse are counted in *refused.
std::vector<TrainingPlan> search_layouts(const PlanRequest& request, int* refused = nullptr);

/// The plan with its reasoning, as `megatron plan` prints it.
std::string format_plan(const TrainingPlan& plan);
/// The ranked table of search_layouts (at most `rows` rows).
std::string format_search(const std::vector<TrainingPlan>& plans, int refused, size_t rows);
/// The plan as one JSON object (every number of format_plan; bytes as integers).
std::string plan_json(const TrainingPlan& plan);

/// Options and run of the `megatron plan` subcommand (apps/megatron.cpp): the pretrain flags plus
/// --world-size, --gpu, --gpu-profile, --gpu-memory-gib, --search, --json.
struct PlanCommandArgs {
  PlanRequest request;
  bool search = false;
  bool json = false;
  int64_t top = 20;  ///< --top: rows of the search table
};
/// `megatron pretrain`'s options (--train-iters and --lr made optional: they size nothing) and the
/// plan's own.
void add_plan_options(CLI::App& app, PlanCommandArgs& args);
/// Prints the plan (or the search table); returns 0 when the layout fits, 2 when it does not.
int run_plan(PlanCommandArgs& args);
}  // namespace mt
