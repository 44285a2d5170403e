#include "plan/plan.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <span>

#include "core/check.h"
#include "core/host_memory.h"
#include "data/data_args.h"
#include "model/variants.h"
#include "optim/muon.h"
#include "parallel/pipeline/schedules.h"
#include "parallel/process_groups.h"
#include "parallel/rank_generator.h"
#include "plan/plan_groups.h"
#include "train/training_setup.h"

namespace mt {

GpuSpec gpu_spec(const std::string& name) {
  GpuSpec g;
  g.name = name;
  if (name == "h100" || name == "h200") {
    // docs/plan.md "Cost model": capacities as cudaMemGetInfo reports them; the reserve = memory
    // in use beyond the buffers, measured (docs/plan.md "Memory": 0.60 GiB on one H200; on 2 H200,
    // the same on every rank since the watchdog fix: 5.83 GiB at TP 2, 6.6-7.0 GiB with PP / DP /
    // EP 2, +0.47 GiB with --tp-comm-overlap); the compute efficiency calibrated on GPT 1.3B at
    // micro-batch 8 on one GPU; the NCCL bus bandwidth measured on 4 H200 (NVLink NV18).
    const bool h200 = name == "h200";
    g.memory_gib = h200 ? 140.4 : 79.6;
    g.reserved_gib = 0.6;
    g.reserved_nccl_gib = 5.25;
    g.reserved_nccl_group_gib = 1.0;
    g.reserved_tp_overlap_gib = 0.5;
    g.peak_tflops = kMfuPeakTflops;
    g.compute_efficiency = h200 ? 0.594 : 0.566;
    g.hbm_gbps = h200 ? 4800 : 3350;
    g.intra_bus_gbps = 320;
    g.inter_bus_gbps = 40;
    g.collective_latency_us = 10;
    g.gpus_per_node = 8;
    return g;
  }
  if (name == "cpu") {
    // CPU ranks share the host: each gets its share of the available memory; no cost model.
    g.cuda = false;
    g.memory_gib = static_cast<double>(available_host_memory_bytes()) / kGiB;
    g.gpus_per_node = 1 << 20;
    return g;
  }
  MT_FAIL("--gpu {}: expected h100, h200 or cpu", name);
}

namespace {

// The pretrain arguments resolved as TrainingSetup::resolve_arguments resolves them, for
// `world` ranks, without a checkpoint or data: the vocabulary from the tokenizer flags.
struct Resolved {
  PretrainArgs args;
  TrainingLayout layout;
};

Resolved resolve(const PlanRequest& req, const GpuSpec& gpu) {
  MT_REQUIRE(req.world_size >= 1, "--world-size must be >= 1, got {}", req.world_size);
  Resolved r{req.args, {}};
  PretrainArgs& a = r.args;
  // What the plan does not read: data (the batch shapes are the flags'), the schedule's length.
  if (a.data.data_path.empty() && a.data.train_data_path.empty()) a.data.mock_data = true;
  if (a.train_iters == 0 && a.train_samples == 0) a.train_iters = 1;
  if (a.lr < 0) a.lr = 0;
  r.layout = resolve_training_layout(a, req.world_size);
  a.data_parallel_size = r.layout.parallel.dp;
  a.expert_data_parallel_size = r.layout.parallel.edp;
  MT_REQUIRE(gpu.is_cuda() || a.dtype() == DType::kF32,
             "--{} needs --gpu h100 or h200; the CPU backend trains in fp32", a.bf16 ? "bf16" : "fp16");
  a.model.vocab_size = data::build_tokenizer(a.data)->vocab_size();
  validate_pretrain_args(a);
  // --attention-backend auto as the GPU run resolves it (GPTModel): on an H100 / H200 (Hopper) with
  // a CUDA build that has cuDNN (the build's default where cuDNN is installed, as on the machines of
  // docs/benchmarks.md), not as this machine's build would — a CPU-only build resolves MLA's head
  // dim 192 to the unfused attention, whose [b, n, s, s] probabilities the plan then sized
  // (docs/plan.md "Memory": 8.6 GiB too many for bench/deepseek_v3.sh).
  if (gpu.is_cuda())
    a.model.attention_backend = resolve_attention_backend(a.model.attention_backend, a.model.head_dim(),
                                                          {true, a.dtype(), /*cudnn=*/true, /*hopper=*/true});
  GPTModel::validate_context_parallel(a.model, r.layout.parallel.cp, r.layout.parallel.tp);
  return r;
}

std::string layer_ranges(const std::vector<pipeline::LayerRange>& chunks) {
  std::string s;
  for (const auto& c : chunks) s += fmt::format("{}[{}, {})", s.empty() ? "" : " ", c.begin, c.end);
  return s;
}

// Time of one collective over `n` ranks moving `bytes` (the whole tensor: the all-reduced one, the
// gathered one) at bus bandwidth `gbps`: NCCL's bus-bandwidth convention, factor 2(n-1)/n for an
// all-reduce, (n-1)/n for an all-gather, a reduce-scatter or an all-to-all.
double collective_s(double bytes, int n, double factor_of_n, double gbps, double latency_us) {
  if (n <= 1) return 0;
  return latency_us * 1e-6 + factor_of_n * (n - 1) / n * bytes / (gbps * 1e9);
}

// The bus bandwidth of a group whose consecutive members are `stride` ranks apart: NVLink when the
// group lies within a node (RankGenerator order tp-cp-ep-dp-pp, nodes of gpus_per_node ranks).
double group_gbps(const GpuSpec& g, int size, int stride) {
  return static_cast<int64_t>(size) * stride <= g.gpus_per_node ? g.intra_bus_gbps : g.inter_bus_gbps;
}

}  // namespace

double expert_mlp_tflops(double ffn) {
  const std::span<const ExpertMlpRate> t = kExpertMlpRates;
  if (ffn <= t.front().ffn) return t.front().tflops;
  if (ffn >= t.back().ffn) return t.back().tflops;
  size_t i = 1;
  while (t[i].ffn < ffn) ++i;
  const double w = std::log(ffn / t[i - 1].ffn) / std::log(t[i].ffn / t[i - 1].ffn);
  return t[i - 1].tflops + w * (t[i].tflops - t[i - 1].tflops);
}

namespace {

struct StageWork {
  int64_t layers = 0, moe_layers = 0, recomputed = 0, recomputed_moe = 0;
  bool has_loss = false;
  ModelMemoryPlan model;
  double muon_dense_flops = 0, muon_expert_flops = 0;  // one rank's Newton-Schulz FLOPs (muon_memory)
};

// The cost model (docs/plan.md "Cost model"). Per stage, for one iteration: its FLOPs (with the
// recomputed forwards) at the calibrated rate, the TP / CP / EP collectives of its layers, then
// the pipeline bubble over the slowest stage, the boundary sends, the data-parallel gradient
// reduction not hidden by overlap and the optimizer's memory traffic.
StepPrediction predict_step(const TrainingPlan& p, const PretrainArgs& a, const std::vector<StageWork>& stages) {
  StepPrediction out;
  const GpuSpec& g = p.gpu;
  if (!g.is_cuda()) return out;
  out.available = true;
  const ParallelConfig& pc = p.parallel;
  const TransformerConfig& c = a.model;
  const double world = pc.world, m = static_cast<double>(p.num_microbatches);
  const double act = static_cast<double>(dtype_size(a.dtype()));
  const double rate = g.compute_efficiency * g.peak_tflops * 1e12;
  const double lat = g.collective_latency_us;
  // FLOPs: the LM head's share apart, the rest spread evenly over the layers; the multi-token
  // prediction (its layers, projections and heads) on the last stage with the head.
  const double mult = static_cast<double>(c.make_vocab_size_divisible_by) * pc.tp;
  const double padded_vocab = std::ceil(static_cast<double>(c.vocab_size) / mult) * mult;
  TransformerConfig no_mtp = c;
  no_mtp.mtp_num_layers = 0;
  const double mtp = p.flops_per_iteration - no_mtp.flops_per_iteration(p.global_batch_size, pc.tp);
  const double head = 6.0 * static_cast<double>(p.global_batch_size) * static_cast<double>(p.seq_length) *
                          static_cast<double>(c.hidden_size) * padded_vocab + mtp;
  // MoE layers: their experts' MLPs (top-k routed and shared; Megatron's h·F terms of them) apart,
  // at the expert-MLP rate of their intermediate size per GPU (kExpertMlpRates), and the MoE
  // layer's memory-bound passes over its top-k token rows (kMoeTokenPasses); the MTP's MoE layer
  // with the last stage's.
  const double h = static_cast<double>(c.hidden_size), topk = static_cast<double>(c.moe_router_topk);
  const double iter_tokens = static_cast<double>(p.global_batch_size) * static_cast<double>(p.seq_length);
  const double mlp_factor = 6.0 * iter_tokens * h * 2.0 * mlp_activation_kind(c.activation()).flops_factor;
  const bool moe = c.num_moe_experts > 0;
  const double moe_ffn = static_cast<double>(c.moe_ffn());
  const double shared_ffn = static_cast<double>(c.moe_shared_expert_intermediate_size);
  const double routed = moe ? mlp_factor * moe_ffn * topk : 0, shared = moe ? mlp_factor * shared_ffn : 0;
  const double mtp_moe = moe && c.is_moe_layer(c.num_layers - 1) ? static_cast<double>(c.mtp_num_layers) : 0;
  const double moe_layer_s = routed / (expert_mlp_tflops(moe_ffn / pc.etp) * 1e12) +
                             (shared > 0 ? shared / (expert_mlp_tflops(shared_ffn / pc.tp) * 1e12) : 0);
  // MLA layers (the MTP's with the last stage's): the core attention apart, at its kernels' measured
  // rates (kMlaAttention*Tflops: Q·Kᵀ and P·V at the packed head dim D, causal; backward 2.5 times
  // the forward) in place of Megatron's count of it at η, and the pack / RoPE / unpack passes over
  // the packed [T, n, 3, D] tensor (kMlaPasses*). Both per layer, for the whole global batch.
  // (cuDNN's kernels: the rates apply to the resolved fused backend; with another the core
  // attention stays in Megatron's count at η, as nothing else was measured)
  const bool mla = c.multi_latent_attention;
  const bool mla_cudnn = mla && c.attention_backend == AttentionBackend::kFused;
  const double s_len = static_cast<double>(p.seq_length), heads = static_cast<double>(c.num_attention_heads);
  const double mla_megatron =
      mla_cudnn ? 6.0 * iter_tokens * s_len * heads * static_cast<double>(c.q_head_dim() + c.v_head_dim) / 2.0 : 0;
  const double mla_forward =
      mla_cudnn ? 4.0 * iter_tokens * s_len / 2.0 * heads * static_cast<double>(c.head_dim()) : 0;
  const double mla_fwd_s = mla_forward / (kMlaAttentionForwardTflops * 1e12);
  const double mla_bwd_s = 2.5 * mla_forward / (kMlaAttentionBackwardTflops * 1e12);
  const double mtp_layers = static_cast<double>(c.mtp_num_layers);
  const double dense_head = head - mtp_moe * (routed + shared) - mtp_layers * mla_megatron;
  const double per_layer =
      (p.flops_per_iteration - head - static_cast<double>(c.num_moe_layers()) * (routed + shared)) /
          static_cast<double>(c.num_layers) -
      mla_megatron;
  // One micro-batch's activation tensor [s/cp, b, h] as TP and EP move it.
  const double tokens = static_cast<double>(p.micro_batch_size) * static_cast<double>(p.seq_length) / pc.cp;
  const double act_bytes = tokens * static_cast<double>(c.hidden_size) * act;
  const double tp_gbps = group_gbps(g, pc.tp, 1);
  // per layer, forward + backward: 4 all-reduces, or with SP 4 all-gathers + 4 reduce-scatters
  const double tp_layer = p.sequence_parallel ? 8 * collective_s(act_bytes, pc.tp, 1, tp_gbps, lat)
                                              : 4 * collective_s(act_bytes, pc.tp, 2, tp_gbps, lat);
  // CP ring: (cp - 1) steps of this rank's K and V forward, K, V and their gradients backward
  const double kv_bytes = 2.0 * tokens * static_cast<double>(c.query_groups() * c.head_dim()) * act / pc.tp;
  const double cp_layer =
      pc.cp > 1 ? 3.0 * (pc.cp - 1) * (lat * 1e-6 + kv_bytes / (group_gbps(g, pc.cp, pc.tp) * 1e9)) : 0;
  // EP: each rank's tokens (1/tp of them with SP) times top-k rows, dispatched and combined,
  // forward and backward
  const double ep_bytes =
      tokens / pc.tp * static_cast<double>(c.moe_router_topk) * static_cast<double>(c.hidden_size) * act;
  const double ep_layer = 4 * collective_s(ep_bytes, pc.ep, 1, group_gbps(g, pc.ep, pc.tp * pc.cp), lat);
  const double stage_gpus = world / pc.pp;
  // one MoE layer's token passes per micro-batch: this rank's tokens (1/tp of them with SP) times top-k rows
  const double token_pass_s = moe ? kMoeTokenPasses * tokens / pc.tp * topk * h * act / (g.hbm_gbps * 1e9) : 0;
  // one MLA layer's pass over this rank's packed [T, n/tp, 3, D] per micro-batch
  const double mla_pass_s =
      mla ? tokens * heads / pc.tp * 3.0 * static_cast<double>(c.head_dim()) * act / (g.hbm_gbps * 1e9) : 0;
  // FP8 (docs/plan.md "FP8"): the dense FP8 layers' linear GEMMs (qkv, proj, fc1, fc2; in MoE
  // layers only qkv and proj: the experts keep their measured rates) run kFp8GemmSpeedup faster than
  // at their bf16 rate, and pay the casts of each linear's input and output gradient per micro-batch
  // and of the weights once per step (FP8 with MLA is refused by the trainer). Not modelled:
  // recompute's extra forward GEMMs (at bf16's rate), the placement of --first-last-layers-bf16's
  // layers (their share spread over the stages).
  const bool fp8 = c.fp8 != Fp8Format::kNone;
  double fp8_layer_gemm_s = 0, fp8_layer_cast_s = 0, fp8_moe_layer_gemm_s = 0, fp8_moe_layer_cast_s = 0;
  double fp8_weight_cast_s = 0, fp8_moe_weight_cast_s = 0, fp8_fraction = 0;
  if (fp8) {
    const double hbm = g.hbm_gbps / 4800.0;  // the H200's bandwidths scaled to the machine's HBM
    const bool block = c.fp8_recipe == Fp8Recipe::kBlockwise, tw = c.fp8_recipe == Fp8Recipe::kTensorwise;
    const double speedup = block ? kFp8BlockGemmSpeedup : kFp8GemmSpeedup;
    const double proj_in = heads * static_cast<double>(c.head_dim());
    const double qkv_out = proj_in + 2.0 * static_cast<double>(c.query_groups() * c.head_dim());
    const double ffn = static_cast<double>(c.ffn());
    const double fc1_out = ffn * (c.gated_linear_unit ? 2.0 : 1.0);
    const double attn_params = h * qkv_out + proj_in * h, mlp_params = h * fc1_out + ffn * h;
    const double gemm_rate = kBf16LinearGemmEfficiency * g.peak_tflops * 1e12;
    const double saved = 1.0 - 1.0 / speedup;
    // per layer and iteration, this rank's share (1/tp of each GEMM; the stage's GPUs split the batch)
    fp8_layer_gemm_s = 6.0 * iter_tokens * (attn_params + mlp_params) / gemm_rate * saved;
    fp8_moe_layer_gemm_s = 6.0 * iter_tokens * attn_params / gemm_rate * saved;
    // per layer and micro-batch: this rank's x and dy elements of the four linears (1/tp of them)
    const double act_factor = (block ? kFp8BlockActCastFactor : 1.0) * 4.0 / (kFp8ActCastGBps * 1e9 * hbm) +
                              (tw ? 2.0 / (kFp8ActAmaxGBps * 1e9 * hbm) : 0.0);
    const double scale_s = tw ? kFp8TensorwiseScaleS : block ? 0.0 : kFp8DelayedScaleS;
    const double attn_elems = tokens / pc.tp * (h + proj_in + qkv_out + h);
    // delayed scaling's fused SwiGLU / GELU: fc2's input (not under SP) and fc1's output gradient
    // (the SwiGLU's without a bias; the GELU's with fc1's bias gradient and its own backward)
    const bool fused_act = !tw && !block && c.fp8_fused_activation;
    const bool swiglu = fused_act && c.activation() == MlpActivation::kSwiGLU;
    const bool gelu = c.activation() == MlpActivation::kGelu, fused_gelu = fused_act && gelu;
    const bool fc2_fused = !(pc.tp > 1 && p.sequence_parallel);
    const double fc2_x = swiglu && fc2_fused ? kFp8FusedSwigluFwdFactor : 1.0;
    const double fc1_dy = swiglu && !c.add_bias_linear ? kFp8FusedSwigluBwdFactor : 1.0;
    const double mlp_elems = tokens / pc.tp * (h + ffn * fc2_x + fc1_out * fc1_dy + h);
    // GPT style: the bias gradients of qkv, proj and fc2 (2 bytes per output element) and the GELU
    // backward over fc1's output (6 bytes), fused into bf16's GEMM epilogues, separate passes in
    // FP8; the fused GELU saves its measured time per fc1 output element
    const double bias_bytes = c.add_bias_linear ? 2.0 * tokens / pc.tp * (qkv_out + h + h) : 0.0;
    const double gelu_bytes = gelu ? 6.0 * tokens / pc.tp * ffn : 0.0;
    const double gelu_saved_s =
        fused_gelu ? tokens / pc.tp * ffn * ((fc2_fused ? kFp8FusedGeluFwdSavedPs : 0.0) + kFp8FusedGeluBwdSavedPs) *
                         1e-12 / hbm
                   : 0.0;
    // the per-tensor recipes add the biases in the fprop GEMMs' epilogues: the separate passes the
    // GPT rows were calibrated with no longer run — qkv's bias (4 bytes per output element) and,
    // at TP 1 without hidden dropout (the residual in the GEMM's C), proj's and fc2's bias +
    // residual adds (6 bytes)
    const bool bias_epilogue = c.add_bias_linear && !block;
    const double fwd_bias_saved_s =
        bias_epilogue ? tokens / pc.tp * 4.0 * qkv_out / (kFp8BiasPassGBps * 1e9 * hbm) : 0.0;
    const double fwd_residual_saved_s = bias_epilogue && pc.tp == 1 && c.hidden_dropout == 0.f
                                            ? tokens * 6.0 * h / (kFp8BiasPassGBps * 1e9 * hbm)
                                            : 0.0;
    const double extra_s = (bias_bytes + gelu_bytes) / (kFp8ActCastGBps * 1e9 * hbm) - gelu_saved_s -
                           fwd_bias_saved_s - 2.0 * fwd_residual_saved_s;
    fp8_layer_cast_s = (attn_elems + mlp_elems) * act_factor + scale_s + extra_s;
    fp8_moe_layer_cast_s = attn_elems * act_factor + scale_s +
                           (c.add_bias_linear ? 2.0 * tokens / pc.tp * (qkv_out + h) / (kFp8ActCastGBps * 1e9 * hbm)
                                              : 0.0) -
                           fwd_bias_saved_s - fwd_residual_saved_s;
    // per layer and step: the weights from the fp32 main parameters (this rank's 1/tp)
    const double per_weight = (block ? kFp8BlockWeightCastFactor : 1.0) * 6.0 / (kFp8WeightCastGBps * 1e9 * hbm) +
                              (tw ? 4.0 / (kFp8WeightAmaxGBps * 1e9 * hbm) : 0.0);
    fp8_weight_cast_s = (attn_params + mlp_params) / pc.tp * per_weight;
    fp8_moe_weight_cast_s = attn_params / pc.tp * per_weight;
    int64_t fp8_layers = 0;
    for (int64_t l = 0; l < c.num_layers; ++l) fp8_layers += c.fp8_layer(l) ? 1 : 0;
    fp8_fraction = static_cast<double>(fp8_layers) / static_cast<double>(c.num_layers);
  }
  double slowest = -1;
  for (const StageWork& s : stages) {
    const double moe_layers = static_cast<double>(s.moe_layers) + (s.has_loss ? mtp_moe : 0);
    const double flops = (static_cast<double>(s.layers) * per_layer + (s.has_loss ? dense_head : 0)) / stage_gpus;
    const double recompute = static_cast<double>(s.recomputed) * per_layer / 3.0 / stage_gpus;
    // a recomputed MoE layer repeats its experts' forward (a third) and the forward token passes (half)
    const double rec_moe = static_cast<double>(s.recomputed_moe);
    const double experts = (moe_layers + rec_moe / 3.0) * moe_layer_s / stage_gpus;
    const double token_passes = m * (moe_layers + rec_moe / 2.0) * token_pass_s;
    // MLA: a recomputed layer repeats the attention's and the passes' forward
    const double attn_layers = static_cast<double>(s.layers) + (s.has_loss ? mtp_layers : 0);
    const double rec = static_cast<double>(s.recomputed);
    const double mla_attention = ((attn_layers + rec) * mla_fwd_s + attn_layers * mla_bwd_s) / stage_gpus;
    const double mla_passes =
        m * ((attn_layers + rec) * kMlaPassesForward + attn_layers * kMlaPassesBackward) * mla_pass_s;
    // FP8: the stage's FP8 layers (dense and MoE), the GEMM time saved and the casts
    const double dense_layers = (static_cast<double>(s.layers) - static_cast<double>(s.moe_layers)) * fp8_fraction;
    const double moe_fp8_layers = static_cast<double>(s.moe_layers) * fp8_fraction;
    const double fp8_saved = (dense_layers * fp8_layer_gemm_s + moe_fp8_layers * fp8_moe_layer_gemm_s) / stage_gpus;
    const double fp8_casts = m * (dense_layers * fp8_layer_cast_s + moe_fp8_layers * fp8_moe_layer_cast_s) +
                             dense_layers * fp8_weight_cast_s + moe_fp8_layers * fp8_moe_weight_cast_s;
    const double compute =
        (flops + recompute) / rate + experts + token_passes + mla_attention + mla_passes - fp8_saved + fp8_casts;
    // a recomputed layer repeats its forward collectives (half of them)
    const double tp = m * (static_cast<double>(s.layers) + 0.5 * static_cast<double>(s.recomputed)) * tp_layer;
    const double cp = m * static_cast<double>(s.layers) * cp_layer;
    const double ep = m * static_cast<double>(s.moe_layers) * ep_layer;
    if (compute + tp + cp + ep > slowest) {
      slowest = compute + tp + cp + ep;
      out.compute_s = compute;
      out.moe_experts_s = experts;
      out.moe_token_passes_s = token_passes;
      out.mla_attention_s = mla_attention;
      out.mla_passes_s = mla_passes;
      out.fp8_gemm_saved_s = fp8_saved;
      out.fp8_casts_s = fp8_casts;
      out.tp_comm_s = tp;
      out.cp_comm_s = cp;
      out.ep_comm_s = ep;
    }
  }
  out.bubble_fraction = pipeline::bubble_fraction(pc.pp, pc.vpp, static_cast<int>(p.num_microbatches));
  if (pc.pp > 1) {  // each boundary tensor sent forward and its gradient back, per micro-batch and chunk
    const double b = static_cast<double>(stages.front().model.boundary_bytes);
    out.pp_comm_s = m * pc.num_chunks() * 2 * (lat * 1e-6 + b / (group_gbps(g, 2, pc.tp * pc.cp * pc.dp) * 1e9));
  }
  // Data parallel over dp-cp (stride tp), the experts over edp; optimizer over the owned elements.
  const bool distopt = a.use_distributed_optimizer;
  const double grad_b = a.grad_reduce_in_bf16 ? 2 : 4;
  const int k = a.num_distributed_optimizer_instances;  // hybrid sharding: instances of n / k ranks
  for (const StageWork& s : stages) {
    const double dense = static_cast<double>(s.model.params.total - s.model.params.expert);
    const double expert = static_cast<double>(s.model.params.expert);
    const auto reduce = [&](double elems, int group, int stride) {
      const int n = std::max(group / k, 1);  // the instance; its owned slices all-reduced over the k instances
      const double gbps = group_gbps(g, n, stride);
      const double grads = collective_s(elems * grad_b, n, distopt ? 1 : 2, gbps, lat);
      const double replicas = collective_s(elems / n * grad_b, k, 2, group_gbps(g, k, stride * n), lat);
      const double params = distopt ? collective_s(elems * act, n, 1, gbps, lat) : 0;
      // overlapped: what is left is the last bucket's reduction (and gather); with sharded gradients
      // the replica all-reduce runs once after the backward (GradSync::finish_grad_sync), not hidden
      const double share = std::min(static_cast<double>(s.model.params.largest_bucket) / std::max(elems, 1.0), 1.0);
      const double replicas_left = a.shard_grads() ? replicas : replicas * share;
      return (a.overlap_grad_reduce ? grads * share + replicas_left : grads + replicas) +
             (a.overlap_param_gather ? params * share : params);
    };
    const double dp = reduce(dense, pc.dp * pc.cp, pc.tp) + reduce(expert, pc.edp, pc.etp * pc.ep);
    const double owned =
        distopt ? dense / (pc.dp * pc.cp / k) + expert / std::max(pc.edp / k, 1) : dense + expert;
    // AdamW: reads gradient, main parameter and both moments, writes all but the gradient and the
    // model-dtype copy; the gradients are zeroed and their norm read (whole buffer)
    const double bytes = owned * (4 * 4 + 3 * 4 + (a.dtype() == DType::kF32 ? 0 : act)) + (dense + expert) * 8;
    const double opt = bytes / (g.hbm_gbps * 1e9);
    // Muon: the Newton-Schulz GEMMs at the model's compute rate, each matrix on one DP (EDP) rank
    // with the distributed optimizer (balanced by FLOPs: the even share), on every rank without
    const double muon = (distopt ? s.muon_dense_flops / (pc.dp * pc.cp) + s.muon_expert_flops / std::max(pc.edp, 1)
                                 : s.muon_dense_flops + s.muon_expert_flops) /
                        rate;
    out.dp_comm_s = std::max(out.dp_comm_s, dp);
    out.optimizer_s = std::max(out.optimizer_s, opt);
    out.muon_s = std::max(out.muon_s, muon);
  }
  out.step_s =
      slowest * (1 + out.bubble_fraction) + out.pp_comm_s + out.dp_comm_s + out.optimizer_s + out.muon_s;
  out.tflops_per_gpu = p.flops_per_iteration / (out.step_s * world) / 1e12;
  out.mfu = out.tflops_per_gpu / g.peak_tflops;
  out.tokens_per_s = static_cast<double>(p.global_batch_size * p.seq_length) / out.step_s;
  return out;
}

}  // namespace

GpuSpec apply_gpu_profile(GpuSpec g, const std::string& path) {
  std::ifstream in(path);
  MT_REQUIRE(in.good(), "--gpu-profile {}: cannot read the file", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL("--gpu-profile {}: not valid JSON ({})", path, e.what());
  }
  MT_REQUIRE(j.is_object(), "--gpu-profile {}: expected a JSON object of machine figures, got {}", path,
             j.type_name());
  struct Field {
    const char* key;
    double* value;
    bool zero_ok;  // >= 0 (else > 0)
  };
  const Field fields[] = {{"memory_gib", &g.memory_gib, false},
                          {"reserved_gib", &g.reserved_gib, true},
                          {"reserved_nccl_gib", &g.reserved_nccl_gib, true},
                          {"reserved_nccl_group_gib", &g.reserved_nccl_group_gib, true},
                          {"reserved_tp_overlap_gib", &g.reserved_tp_overlap_gib, true},
                          {"peak_tflops", &g.peak_tflops, false},
                          {"compute_efficiency", &g.compute_efficiency, false},
                          {"hbm_gbps", &g.hbm_gbps, false},
                          {"intra_bus_gbps", &g.intra_bus_gbps, false},
                          {"inter_bus_gbps", &g.inter_bus_gbps, false},
                          {"collective_latency_us", &g.collective_latency_us, true}};
  std::string known = "gpus_per_node";
  for (const Field& f : fields) known += std::string(", ") + f.key;
  for (const auto& [key, v] : j.items()) {
    if (key == "gpus_per_node") {
      MT_REQUIRE(v.is_number_integer() && v.get<int64_t>() >= 1 && v.get<int64_t>() <= (1 << 20),
                 "--gpu-profile {}: gpus_per_node must be an integer in [1, 1048576], got {}", path, v.dump());
      g.gpus_per_node = v.get<int>();
      continue;
    }
    const Field* f = nullptr;
    for (const Field& c : fields)
      if (key == c.key) f = &c;
    MT_REQUIRE(f != nullptr, "--gpu-profile {}: unknown key '{}' (expected any of: {})", path, key, known);
    MT_REQUIRE(v.is_number() && std::isfinite(v.get<double>()) &&
                   (f->zero_ok ? v.get<double>() >= 0 : v.get<double>() > 0),
               "--gpu-profile {}: {} must be a number {} 0, got {}", path, key, f->zero_ok ? ">=" : ">", v.dump());
    MT_REQUIRE(key != std::string("compute_efficiency") || v.get<double>() <= 1,
               "--gpu-profile {}: compute_efficiency is a fraction of peak_tflops, at most 1, got {}", path, v.dump());
    *f->value = v.get<double>();
  }
  g.name += " + " + path;
  return g;
}

GpuSpec machine_of(const PlanRequest& req) {
  GpuSpec g = gpu_spec(req.gpu);
  if (!req.gpu_profile.empty()) g = apply_gpu_profile(g, req.gpu_profile);
  if (req.memory_gib > 0) g.memory_gib = req.memory_gib;
  return g;
}

TrainingPlan plan_training(const PlanRequest& req) { return plan_training(req, machine_of(req)); }

TrainingPlan plan_training(const PlanRequest& req, const GpuSpec& machine) {
  TrainingPlan p;
  p.gpu = machine;
  const Resolved r = resolve(req, p.gpu);
  const PretrainArgs& a = r.args;
  const ParallelConfig& pc = r.layout.parallel;
  p.parallel = pc;
  p.sequence_parallel = a.sequence_parallel;
  p.micro_batch_size = a.micro_batch_size;
  p.global_batch_size = a.global_batch_size;
  p.num_microbatches = a.num_microbatches();
  p.seq_length = a.model.seq_length;
  p.vocab_size = a.model.vocab_size;
  p.total_parameters = a.model.num_parameters(pc.tp);
  p.flops_per_iteration = a.model.flops_per_iteration(a.global_batch_size, pc.tp);
  p.layout_table = layout_table(pc);
  p.summary = fmt::format("tp={} pp={} vpp={} cp={} ep={} dp={}{}{}", pc.tp, pc.pp, pc.num_chunks(), pc.cp, pc.ep,
                          pc.dp, a.sequence_parallel && pc.tp > 1 ? " sp" : "",
                          a.num_distributed_optimizer_instances > 1
                              ? fmt::format(" (optimizer instances {})", a.num_distributed_optimizer_instances)
                              : "");
  const Device device = p.gpu.is_cuda() ? Device::cuda(0) : Device::cpu();
  ModelSetupOptions o = pretrain_model_options(a, r.layout, device);
  // every stage: ranks, memory (its first rank's: the TP / CP / DP / EP ranks of a stage hold the
  // same sizes), its layers for the cost model
  const RankGroups pp_groups = ParallelGroups(pc).groups(GroupKind::kPp);
  const bool other_groups = pc.pp > 1 || pc.dp > 1 || pc.cp > 1 || pc.ep > 1;
  const double reserved =
      (p.gpu.reserved_gib +
       (pc.world > 1 ? p.gpu.reserved_nccl_gib + (other_groups ? p.gpu.reserved_nccl_group_gib : 0) +
                           (a.model.tp_comm_overlap && pc.tp > 1 ? p.gpu.reserved_tp_overlap_gib : 0)
                     : 0)) *
      kGiB;
  const double capacity = p.gpu.memory_gib * kGiB / (p.gpu.is_cuda() ? 1 : pc.world);
  std::vector<StageWork> work;
  p.fits = true;
  for (int stage = 0; stage < pc.pp; ++stage) {
    RankKindPlan k;
    k.pp_rank = stage;
    for (const auto& grp : pp_groups) k.ranks.push_back(grp[static_cast<size_t>(stage)]);
    const RankSchedule schedule = plan_rank_schedule(o, pc, stage);
    StageWork w;
    k.memory = estimate_rank_memory(o, plan_process_groups(pc, k.ranks.front()), schedule, &w.model);
    k.layers = layer_ranges(schedule.chunks);
    k.parameters = w.model.params.total;
    k.reserved_bytes = reserved;
    k.fits = static_cast<double>(k.memory.total()) + reserved <= capacity;
    p.fits = p.fits && k.fits;
    for (const auto& ch : schedule.chunks) {
      w.layers += ch.size();
      w.has_loss = w.has_loss || ch.has_loss;
      for (int64_t l = ch.begin; l < ch.end; ++l) w.moe_layers += a.model.is_moe_layer(l) ? 1 : 0;
      if (a.model.recompute_granularity == RecomputeGranularity::kFull)
        for (int64_t i = 0; i < ch.size(); ++i) {
          const int r = a.model.recompute_group(i, ch.size()) >= 0 ? 1 : 0;
          w.recomputed += r;
          w.recomputed_moe += a.model.is_moe_layer(ch.begin + i) ? r : 0;
        }
    }
    if (a.optim.optimizer == "muon") {
      const MuonMemory mm = muon_memory(GPTModel::param_specs(a.model, pc.tp, 0, schedule.chunks, pc.ep, 0),
                                        a.optim.muon, pc.tp, pc.etp, device);
      w.muon_dense_flops = mm.dense_ns_flops;
      w.muon_expert_flops = mm.expert_ns_flops;
    }
    p.recomputed_layers = std::max(p.recomputed_layers, static_cast<int>(w.recomputed));
    work.push_back(w);
    p.stages.push_back(std::move(k));
  }
  p.step = predict_step(p, a, work);
  return p;
}

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

}  // namespace

std::vector<TrainingPlan> search_layouts(const PlanRequest& req, int* refused) {
  const GpuSpec gpu = machine_of(req);
  const TransformerConfig& c = req.args.model;
  std::vector<TrainingPlan> plans;
  int skipped = 0;
  for (int tp : divisors(req.world_size)) {
    if (tp > gpu.gpus_per_node || c.num_attention_heads % tp != 0) continue;
    for (int cp : divisors(req.world_size / tp)) {
      if (cp > 1 && c.seq_length % (2 * cp * tp) != 0) continue;
      for (int pp : divisors(req.world_size / (tp * cp))) {
        if (c.num_layers % pp != 0) continue;
        std::vector<int64_t> layers_per_vstage = {0};  // 0: no interleaving
        for (int64_t v : {2, 4})
          if (pp > 1 && c.num_layers % (pp * v) == 0) layers_per_vstage.push_back(c.num_layers / (pp * v));
        for (int64_t lpv : layers_per_vstage) {
          for (int ep : divisors(req.world_size / (tp * pp))) {
            if (ep > 1 && (c.num_moe_experts == 0 || c.num_moe_experts % ep != 0)) continue;
            PlanRequest r = req;
            PretrainArgs& a = r.args;
            a.tensor_model_parallel_size = tp;
            a.context_parallel_size = cp;
            a.pipeline_model_parallel_size = pp;
            a.expert_model_parallel_size = ep;
            a.num_layers_per_virtual_pipeline_stage = lpv;
            a.num_virtual_stages_per_pipeline_rank = 0;
            a.sequence_parallel = tp > 1;
            a.decoder_first_pipeline_num_layers = -1;
            a.decoder_last_pipeline_num_layers = -1;
            try {
              plans.push_back(plan_training(r, gpu));
            } catch (const Error&) {
              ++skipped;  // a layout the checks refuse (batch split, heads, experts, ...)
            }
          }
        }
      }
    }
  }
  std::stable_sort(plans.begin(), plans.end(), [](const TrainingPlan& x, const TrainingPlan& y) {
    if (x.fits != y.fits) return x.fits;
    return x.step.step_s < y.step.step_s;
  });
  if (refused) *refused = skipped;
  return plans;
}

}  // namespace mt
