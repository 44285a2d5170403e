#include "model/moe/router.h"

#include <algorithm>

#include "model/layers/parallel_params.h"
#include "ops/elementwise.h"
#include "ops/init.h"
#include "ops/matmul.h"

namespace mt {

MoeRouterOptions moe_router_options(const TransformerConfig& c) {
  MoeRouterOptions o;
  o.topk = c.moe_router_topk;
  o.sigmoid = c.moe_router_score_function == MoeScoreFunction::kSigmoid;
  o.pre_softmax = c.moe_router_pre_softmax;
  o.scaling_factor = c.moe_router_topk_scaling_factor;
  o.num_groups = c.moe_router_num_groups;
  o.group_topk = c.moe_router_group_topk;
  return o;
}

TopKRouter::TopKRouter(const TransformerConfig& c, int64_t layer, const TensorParallelRegion& tp,
                       const std::string& prefix, ParamRegistry& reg)
    : config_(c),
      tp_(tp),
      layer_(layer),
      num_experts_(c.num_moe_experts),
      topk_(c.moe_router_topk),
      options_(moe_router_options(c)),
      capacity_(c) {
  reg.declare(replicated_param(prefix + "router.weight", {num_experts_, c.hidden_size}, InitKind::kNormal,
                               c.init_method_std, TpGradSum::kSequenceParallel),
              &weight_);
}

void TopKRouter::plan(BufferPlanner& p, int64_t tokens, int64_t batch) {
  const DType t = p.act_dtype();
  const int64_t E = num_experts_, k = topk_;
  tokens_ = tokens;
  batch_ = batch;
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  Saved& sv = saved_[a];
  const DType rd = config_.moe_router_dtype;  // the routing dtype: fp32, or fp64 (--moe-router-dtype)
  sv.logits = p.saved(rd, {tokens, E}, "router logits");
  sv.tokens_per_expert = p.saved(DType::kF32, {1, E}, "tokens per expert (TP x CP group)");
  if (seq_aux())
    sv.seq_tokens_per_expert = p.saved(DType::kF32, {batch, E}, "tokens per expert and sequence (TP x CP group)");
  if (global_aux()) {
    sv.global_tokens = p.saved(DType::kF32, {E}, "mean tokens per expert of the step (TP x DP group)");
    global_counts_ = p.scratch("moe.global_counts", DType::kF32, {E});
    if (p.placing() && global_buffer_.bytes() == 0) {  // not while the model is only measured
      global_buffer_ = Buffer(p.device(), static_cast<size_t>(E + 1) * sizeof(float));
      global_acc_ = global_buffer_.as(DType::kF32, {E + 1});
    }
  }
  capacity_.plan(p, tokens, k, E);
  d_probs_ = p.scratch("moe.d_probs", DType::kF32, {tokens, k});
  d_logits_ = p.scratch("moe.d_logits", rd, {tokens, E});
  if (t != DType::kF32 && rd == DType::kF32) d_logits_act_ = p.scratch("moe.d_logits_act", t, {tokens, E});
  scores_aux_ = p.scratch("moe.scores_aux", rd, {tokens, E});
  if (p.placing() && stats_buffer_.bytes() == 0) {
    stats_buffer_ = Buffer(p.device(), static_cast<size_t>(kMoeStatLosses + E) * sizeof(float));
    stats_ = stats_buffer_.as(DType::kF32, {kMoeStatLosses + E});
  }
  if (p.placing() && config_.moe_router_enable_expert_bias && bias_buffer_.bytes() == 0) {
    bias_buffer_ = Buffer(p.device(), static_cast<size_t>(2 * E) * sizeof(float));
    const Tensor both = bias_buffer_.as(DType::kF32, {2 * E});
    expert_bias_ = both.slice0(0, E);
    bias_counts_ = both.slice0(E, 2 * E);
  }
}

Tensor TopKRouter::expert_bias(const Stream& stream) {
  if (!expert_bias_.empty() && !bias_zeroed_) {
    fill(bias_buffer_.as(DType::kF32, {2 * num_experts_}), 0.f, stream);
    bias_zeroed_ = true;
  }
  return expert_bias_;
}

void TopKRouter::update_expert_bias(Communicator* dp, const Stream& stream) {
  if (expert_bias_.empty() || !bias_zeroed_) return;  // no option, or no training forward yet
  if (dp && dp->size() > 1) dp->all_reduce(bias_counts_, ReduceOp::kSum, stream);
  moe_expert_bias_update(expert_bias_, bias_counts_, config_.moe_router_bias_update_rate, stream);
  fill(bias_counts_, 0.f, stream);
}

void TopKRouter::reset_global_tokens(const Stream& stream) {
  if (global_zeroed_) fill(global_acc_, 0.f, stream);  // else the first training forward zeroes it
}

void TopKRouter::reset_stats(const Stream& stream) {
  if (stats_zeroed_) fill(stats_, 0.f, stream);  // else the first forward zeroes them
}

std::vector<double> TopKRouter::stats(const Stream& stream) const {
  std::vector<double> out(static_cast<size_t>(kMoeStatLosses + num_experts_), 0.0);
  if (!stats_zeroed_) return out;
  std::vector<float> host(out.size());
  copy_bytes(host.data(), Device::cpu(), stats_.data(), stats_.device(), host.size() * sizeof(float), stream);
  stream.synchronize();
  std::copy(host.begin(), host.end(), out.begin());
  return out;
}

void TopKRouter::set_context_parallel(Communicator* tp_cp, int cp_size, int cp_rank) {
  tp_cp_ = tp_cp;
  cp_size_ = cp_size;
  cp_rank_ = cp_rank;
}

int TopKRouter::token_group_size() const { return tp_cp_ ? tp_cp_->size() : tp_.size(); }

void TopKRouter::sum_token_group(const Tensor& t, const Stream& st) const {
  if (tp_cp_) {
    if (tp_cp_->size() > 1) tp_cp_->all_reduce(t, ReduceOp::kSum, st);
  } else if (tp_.size() > 1) {
    tp_.group().all_reduce(t, ReduceOp::kSum, st);
  }
}

float TopKRouter::aux_scale(MoeLoadBalancing type, double weight) const {
  const double E = static_cast<double>(num_experts_), k = static_cast<double>(topk_);
  const double coeff = config_.moe_aux_coeff(type);
  if (type == MoeLoadBalancing::kSeqAuxLoss) {
    // Megatron's sequence_load_balancing_loss_func: coeff · mean_b Σ_e (c_be·E/(s·k)) · (P_be/s), s the
    // whole sequence (this rank holds s/(TP·CP) tokens of each sequence; Megatron's seq_length·|tp_cp|)
    const double B = static_cast<double>(batch_), s = static_cast<double>(tokens_) * token_group_size() / B;
    return static_cast<float>(weight * coeff * E / (B * k * s * s));
  }
  if (type == MoeLoadBalancing::kGlobalAuxLoss) {
    // Megatron's global switch loss coeff·E/(k·N_g²)·Σ_e P_e·c̄_e, N_g the tokens of the TP × CP × DP
    // group; weighted by weight·DP = 1/micro-batches (the fix of NVIDIA/Megatron-LM#3672)
    const double D = dp_ ? static_cast<double>(dp_->size()) : 1.0;
    const double N = static_cast<double>(tokens_) * token_group_size() * D;
    return static_cast<float>(weight * D * coeff * E / (k * N * N));
  }
  // Megatron's switch loss coeff·E/(k·N²)·Σ_e P_e·c_e with N the tokens of the TP × CP group
  const double N = static_cast<double>(tokens_) * token_group_size();
  return static_cast<float>(weight * coeff * E / (k * N * N));
}

Tensor TopKRouter::aux_counts(const Saved& sv, MoeLoadBalancing type) const {
  switch (type) {
    case MoeLoadBalancing::kSeqAuxLoss: return sv.seq_tokens_per_expert;
    case MoeLoadBalancing::kGlobalAuxLoss: return sv.global_tokens;
    default: return sv.tokens_per_expert;
  }
}

void TopKRouter::random_logits(const Tensor& logits, const StepContext& ctx) const {
  // Keyed by the token's row in the micro-batch's [s, b] layout (position·b + sequence), seed,
  // iteration, global micro-batch and layer: the same values under any layout. Without CP this TP
  // rank's tokens are the rows [tp_rank·T, (tp_rank + 1)·T) (the sequence-parallel shard is
  // contiguous). With CP the rank's [s/CP, b] rows are two chunks of c = s/(2·CP) positions, chunk
  // cp_rank then chunk 2·CP − 1 − cp_rank, each contiguous in the [s, b] layout; the TP shard of
  // them may take part of either: one box per chunk it touches.
  // With a device iteration (CUDA graphs) init_normal mixes it in when the kernel runs: the same key.
  const DropoutContext& dc = ctx.dropout;
  const uint64_t key = dc.seed * 0x9E3779B97F4A7C15ull ^ (dc.iteration_ptr ? 0 : dc.iteration << 20) ^ dc.microbatch;
  const uint32_t id = static_cast<uint32_t>(0x4D6F4500 + layer_);
  const int64_t T = tokens_, E = num_experts_, rows_total = T * token_group_size();
  const int64_t first = T * tp_.rank();  // this TP rank's first row of the CP rank's [s/CP, b] rows
  if (cp_size_ == 1) {
    init_normal(logits, 1.f, key, id, ShardBox::make({rows_total, E}, {first, 0}, {T, E}), ctx.stream,
                dc.iteration_ptr);
    return;
  }
  const int64_t chunk_rows = T * tp_.size() / 2;  // c·b
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t lo = std::max(first, half * chunk_rows), hi = std::min(first + T, (half + 1) * chunk_rows);
    if (lo >= hi) continue;
    const int64_t chunk = half == 0 ? cp_rank_ : 2 * cp_size_ - 1 - cp_rank_;
    const ShardBox box = ShardBox::make({rows_total, E}, {chunk * chunk_rows + lo - half * chunk_rows, 0}, {hi - lo, E});
    init_normal(logits.slice0(lo - first, hi - first), 1.f, key, id, box, ctx.stream, dc.iteration_ptr);
  }
}

float TopKRouter::z_scale(double weight) const {
  // coeff · mean over the TP × CP group's tokens, this rank's share (Megatron's coeff / |tp_cp|)
  return static_cast<float>(weight * config_.moe_z_loss_coeff / token_group_size() / static_cast<double>(tokens_));
}

void TopKRouter::forward(const Tensor& x, const Tensor& top, const Tensor& probs, const StepContext& ctx) {
  Saved& sv = saved_.at(static_cast<size_t>(ctx.slot));
  const Stream& st = ctx.stream;
  if (fp64()) {  // Megatron's router_gating_linear in float64
    moe_router_logits_fp64(sv.logits, x, weight_.value(), st);
  } else {
    matmul(sv.logits, x, weight_.value(), false, true, 1.f, 0.f, st);
  }
  if (config_.moe_router_force_load_balancing) random_logits(sv.logits, ctx);
  expert_bias(st);  // zero-initialised on first use
  // with a capacity the selection goes to the capacity's routed tensor first, the kept slots to `top`
  const Tensor routed = capacity_.on() ? capacity_.routed(ctx.slot) : top;
  moe_topk_routing(probs, routed, config_.moe_any_aux_loss() ? scores_aux_ : Tensor(), sv.logits, expert_bias_,
                   options_, st);
  if (capacity_.on()) capacity_.drop(top, probs, ctx.slot, st);
  if (ctx.dropout.training) record_training_forward(sv, routed, ctx);
}

void TopKRouter::record_training_forward(Saved& sv, const Tensor& routed, const StepContext& ctx) {
  const Stream& st = ctx.stream;
  if (!stats_zeroed_) {
    fill(stats_, 0.f, st);
    stats_zeroed_ = true;
  }
  const double w = ctx.batch.aux_loss_weight;
  moe_tokens_per_expert(sv.tokens_per_expert, routed, st);
  sum_token_group(sv.tokens_per_expert, st);  // over the TP × CP group
  if (seq_aux()) {  // per sequence of the [s, b] layout, summed over the TP × CP group's pieces of it
    moe_tokens_per_expert(sv.seq_tokens_per_expert, routed, st);
    sum_token_group(sv.seq_tokens_per_expert, st);
  }
  if (global_aux()) {  // the counts over TP × CP × DP, accumulated over the step's forwards so far
    if (!global_zeroed_) {
      fill(global_acc_, 0.f, st);
      global_zeroed_ = true;
    }
    copy(global_counts_, sv.tokens_per_expert.view({num_experts_}), st);
    if (dp_ && dp_->size() > 1) dp_->all_reduce(global_counts_, ReduceOp::kSum, st);
    moe_global_tokens_per_expert(sv.global_tokens, global_acc_, global_counts_, st);
  }
  if (ctx.recompute) return;  // the values and counts below were taken in the first forward
  for (MoeLoadBalancing type : kAuxTypes)  // each type's loss in its own statistic
    if (config_.moe_aux_loss_on(type)) {
      const int i = static_cast<int>(type);
      moe_aux_loss(stats_.slice0(i, i + 1), scores_aux_, aux_counts(sv, type), aux_scale(type, w), st);
    }
  if (config_.moe_z_loss_coeff > 0)
    moe_z_loss(stats_.slice0(kMoeStatZLoss, kMoeStatZLoss + 1), Tensor(), sv.logits, z_scale(w), Tensor(), st);
  Tensor total = sv.tokens_per_expert.view({num_experts_});
  if (capacity_.on()) {  // the kept slots (Megatron's expert-bias counts are taken after the drop)
    sum_token_group(capacity_.kept_counts(), st);
    total = capacity_.kept_counts();
  }
  const Tensor counted = stats_.slice0(kMoeStatLosses, kMoeStatLosses + num_experts_);
  add(counted, counted, total, st);
  if (!expert_bias_.empty()) add(bias_counts_, bias_counts_, total, st);
}

void TopKRouter::backward(const Tensor& dx, const Tensor& x, const Tensor& top, const StepContext& ctx) {
  const Saved& sv = saved_.at(static_cast<size_t>(ctx.slot));
  const Stream& st = ctx.stream;
  const Tensor routed = capacity_.on() ? capacity_.routed(ctx.slot) : top;
  moe_topk_routing_backward(d_logits_, d_probs_, sv.logits, routed, options_, st);
  const double w = ctx.batch.aux_loss_weight;
  for (MoeLoadBalancing type : kAuxTypes)  // the gradients of the types' losses add up
    if (config_.moe_aux_loss_on(type))
      moe_aux_scores_backward(d_logits_, sv.logits, aux_counts(sv, type), aux_scale(type, w), ctx.loss_scale,
                              options_.sigmoid, st);
  if (config_.moe_z_loss_coeff > 0) moe_z_loss(Tensor(), d_logits_, sv.logits, z_scale(w), ctx.loss_scale, st);
  if (fp64()) {  // dW_r += d_logitsᵀ x, dx += d_logits W_r, summed in double
    moe_router_logits_fp64_backward(dx, weight_.grad(), d_logits_, x, weight_.value(), st);
    return;
  }
  // dW_r += d_logitsᵀ x, dx += d_logits W_r (in the activation dtype)
  const Tensor d_logits = d_logits_act_.empty() ? d_logits_ : d_logits_act_;
  if (!d_logits_act_.empty()) cast(d_logits_act_, d_logits_, st);
  linear_backward(Tensor(), weight_.grad(), Tensor(), d_logits, x, weight_.value(), st);
  matmul(dx, d_logits, weight_.value(), false, false, 1.f, 1.f, st);
}

}  // namespace mt
