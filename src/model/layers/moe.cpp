#include "model/layers/moe.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "model/layer_graphs.h"
#include "model/layers/parallel_params.h"
#include "ops/elementwise.h"
#include "ops/gelu.h"
#include "ops/grouped_matmul.h"
#include "ops/init.h"
#include "ops/matmul.h"
#include "ops/moe_echo_exchange.h"
#include "ops/swiglu.h"

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

MoELayer::MoELayer(const TransformerConfig& c, int64_t layer, const TensorParallelRegion& tp,
                   const ExpertParallel& ep, ParamRegistry& reg)
    : config_(c),
      tp_(tp),
      ep_(ep),
      layer_(layer),
      num_experts_(c.num_moe_experts),
      topk_(c.moe_router_topk),
      num_local_(c.num_moe_experts / std::max(ep.ep_size, 1)),
      first_expert_(static_cast<int64_t>(ep.ep_rank) * (c.num_moe_experts / std::max(ep.ep_size, 1))),
      local_ffn_(c.moe_ffn() / std::max(ep.etp_size, 1)),
      gated_(c.gated_linear_unit),
      recompute_act_(c.selective_recompute().moe_act),
      router_(moe_router_options(c)) {
  MT_REQUIRE(ep.ep_size >= 1 && c.num_moe_experts % ep.ep_size == 0,
             "--num-experts {} is not divisible by expert model parallel size {}", c.num_moe_experts, ep.ep_size);
  MT_REQUIRE(ep.etp_size >= 1 && c.moe_ffn() % ep.etp_size == 0,
             "--moe-ffn-hidden-size {} is not divisible by expert tensor parallel size {}", c.moe_ffn(), ep.etp_size);
  num_echo_ = c.moe_enable_echo ? c.moe_num_echo_experts : 0;
  MT_REQUIRE(num_echo_ == 0 || ep.ep_size > 1,
             "--moe-enable-echo needs --expert-model-parallel-size > 1 (clones live on other EP ranks), got {}",
             ep.ep_size);
  dispatcher_ = make_moe_token_dispatcher(
      c.moe_token_dispatcher_type, ep,
      {num_experts_, topk_, num_local_, first_expert_, c.moe_grouped_gemm, num_echo_, c.moe_received_token_capacity});
  const std::string p = fmt::format("decoder.layers.{}.mlp.", layer);
  const int64_t h = c.hidden_size;
  reg.declare(replicated_param(p + "router.weight", {num_experts_, h}, InitKind::kNormal, c.init_method_std,
                               TpGradSum::kSequenceParallel),
              &router_weight_);
  experts_.resize(static_cast<size_t>(num_local_));
  const float out_std = c.init_method_std / std::sqrt(2.0f * static_cast<float>(c.num_layers));
  for (int64_t i = 0; i < num_local_; ++i) {
    const std::string e = fmt::format("{}experts.local_experts.{}.", p, first_expert_ + i);
    ParamSpec fc1 = column_parallel_weight(e + "linear_fc1.weight", c.moe_ffn(), h, c.init_method_std, ep.etp_size,
                                           ep.etp_rank, gated_ ? 2 : 1);
    ParamSpec fc2 = row_parallel_weight(e + "linear_fc2.weight", h, c.moe_ffn(), out_std, ep.etp_size, ep.etp_rank);
    fc1.expert = fc2.expert = true;
    reg.declare(std::move(fc1), &experts_[static_cast<size_t>(i)].fc1);
    reg.declare(std::move(fc2), &experts_[static_cast<size_t>(i)].fc2);
  }
  if (c.moe_shared_expert_intermediate_size > 0)
    shared_ = std::make_unique<MLP>(c, p + "shared_experts", c.moe_shared_expert_intermediate_size, tp, reg);
  if (shared_ && c.moe_shared_expert_gate)  // Megatron's SharedExpertMLP gate_weight [1, h]
    reg.declare(replicated_param(p + "shared_experts.gate_weight", {1, h}, InitKind::kNormal, c.init_method_std,
                                 TpGradSum::kSequenceParallel),
                &gate_weight_);
}

void MoELayer::plan(BufferPlanner& p, int64_t s, int64_t b) {
  const DType t = p.act_dtype();
  const int64_t h = config_.hidden_size, E = num_experts_, k = topk_;
  const int64_t sl = tp_.local_seq(s);
  tokens_ = sl * b;
  const int64_t parts = gated_ ? 2 : 1;
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  Saved& sv = saved_[a];
  sv.x = p.saved(t, {sl, b, h}, "MoE input");
  const DType rd = config_.moe_router_dtype;  // the routing dtype: fp32, or fp64 (--moe-router-dtype)
  sv.logits = p.saved(rd, {tokens_, E}, "router logits");
  max_rows_ = dispatcher_->plan(p, tokens_, h);
  batch_ = b;
  sv.tokens_per_expert = p.saved(DType::kF32, {1, E}, "tokens per expert (TP x CP group)");
  if (seq_aux())
    sv.seq_tokens_per_expert = p.saved(DType::kF32, {b, E}, "tokens per expert and sequence (TP x CP group)");
  if (global_aux()) {
    sv.global_tokens = p.saved(DType::kF32, {E}, "mean tokens per expert of the step (TP x DP group)");
    global_counts_ = p.scratch("moe.global_counts", DType::kF32, {E});
    if (global_buffer_.bytes() == 0) {
      global_buffer_ = Buffer(p.device(), static_cast<size_t>(E + 1) * sizeof(float));
      global_acc_ = global_buffer_.as(DType::kF32, {E + 1});
    }
  }
  if (drops()) {
    capacity_ = moe_expert_capacity(tokens_, k, E, config_.moe_expert_capacity_factor);
    sv.top_routed = p.saved(DType::kI32, {tokens_, k}, "routing before the capacity drop");
    kept_counts_ = p.scratch("moe.kept_counts", DType::kF32, {E});
  }
  sv.xp = p.saved(t, {max_rows_, h}, "expert inputs");
  sv.pre = p.saved(t, {max_rows_, parts * local_ffn_}, "expert fc1 outputs");
  // --recompute-modules moe_act: one scratch, the activation again in the backward
  sv.act = recompute_act_ ? p.scratch("moe.act", t, {max_rows_, local_ffn_})
                          : p.saved(t, {max_rows_, local_ffn_}, "expert activations");
  sv.out = p.saved(t, {max_rows_, h}, "expert outputs");
  if (shared_) shared_->plan(p, s, b);
  if (gated_shared()) {
    sv.shared_out = p.saved(t, {tokens_, h}, "gated shared expert output");
    sv.gate_logits = p.saved(DType::kF32, {tokens_}, "shared expert gate logits");
    d_shared_ = p.scratch("moe.d_shared", t, {sl, b, h});
    d_gate_ = p.scratch("moe.d_gate", DType::kF32, {tokens_});
  }
  if (num_echo_ > 0) {  // the clones' weights and gradients: fetched per use (scratch)
    const int64_t S = num_echo_, f1 = parts * local_ffn_, f2 = local_ffn_;
    echo_w1_ = p.scratch("moe.echo.w1", t, {S, f1, h});
    echo_w2_ = p.scratch("moe.echo.w2", t, {S, h, f2});
    echo_g1_ = p.scratch("moe.echo.g1", DType::kF32, {S, f1, h});
    echo_g2_ = p.scratch("moe.echo.g2", DType::kF32, {S, h, f2});
    echo_ret_ = p.scratch("moe.echo.ret", DType::kF32, {f1 * h + h * f2});
    if (config_.moe_received_token_capacity > 0) {  // the capturable exchange (echo_fetch_weights)
      const int64_t P = ep_.ep_size, NS = P * S;
      const Tensor idx = p.scratch("moe.echo.x.index", DType::kI32, {3 * NS + S});
      echo_x_.w_send = idx.slice0(0, NS);
      echo_x_.g_send = idx.slice0(NS, 2 * NS);
      echo_x_.g_acc = idx.slice0(2 * NS, 3 * NS);
      echo_x_.w_recv = idx.slice0(3 * NS, 3 * NS + S);
      echo_x_.send1 = p.scratch("moe.echo.x.send1", t, {NS, f1, h});
      echo_x_.recv1 = p.scratch("moe.echo.x.recv1", t, {NS, f1, h});
      echo_x_.send2 = p.scratch("moe.echo.x.send2", t, {NS, h, f2});
      echo_x_.recv2 = p.scratch("moe.echo.x.recv2", t, {NS, h, f2});
      echo_x_.gsend1 = p.scratch("moe.echo.x.gsend1", DType::kF32, {NS, f1, h});
      echo_x_.grecv1 = p.scratch("moe.echo.x.grecv1", DType::kF32, {NS, f1, h});
      echo_x_.gsend2 = p.scratch("moe.echo.x.gsend2", DType::kF32, {NS, h, f2});
      echo_x_.grecv2 = p.scratch("moe.echo.x.grecv2", DType::kF32, {NS, h, f2});
    }
  }
  y_ = p.scratch("moe.y", t, {sl, b, h});
  d_out_ = p.scratch("moe.d_out", t, {max_rows_, h});
  d_act_ = p.scratch("moe.d_act", t, {max_rows_, local_ffn_});
  d_pre_ = p.scratch("moe.d_pre", t, {max_rows_, parts * local_ffn_});
  d_xp_ = p.scratch("moe.d_xp", t, {max_rows_, h});
  dx_ = p.scratch("moe.dx", t, {sl, b, h});
  d_probs_ = p.scratch("moe.d_probs", DType::kF32, {tokens_, k});
  d_logits_ = p.scratch("moe.d_logits", rd, {tokens_, E});
  if (t != DType::kF32 && rd == DType::kF32) d_logits_act_ = p.scratch("moe.d_logits_act", t, {tokens_, E});
  scores_aux_ = p.scratch("moe.scores_aux", rd, {tokens_, E});
  if (stats_buffer_.bytes() == 0) {
    stats_buffer_ = Buffer(p.device(), static_cast<size_t>(kMoeStatLosses + E) * sizeof(float));
    stats_ = stats_buffer_.as(DType::kF32, {kMoeStatLosses + E});
  }
  if (config_.moe_router_enable_expert_bias && bias_buffer_.bytes() == 0) {
    bias_buffer_ = Buffer(p.device(), static_cast<size_t>(2 * E) * sizeof(float));
    const Tensor both = bias_buffer_.as(DType::kF32, {2 * E});
    expert_bias_ = both.slice0(0, E);
    bias_counts_ = both.slice0(E, 2 * E);
  }
}

Tensor MoELayer::expert_bias(const Stream& stream) {
  if (!expert_bias_.empty() && !bias_zeroed_) {
    fill(bias_buffer_.as(DType::kF32, {2 * num_experts_}), 0.f, stream);
    bias_zeroed_ = true;
  }
  return expert_bias_;
}

void MoELayer::update_expert_bias(Communicator* dp, const Stream& stream) {
  if (expert_bias_.empty() || !bias_zeroed_) return;  // no option, or no training forward yet
  if (dp && dp->size() > 1) dp->all_reduce(bias_counts_, ReduceOp::kSum, stream);
  moe_expert_bias_update(expert_bias_, bias_counts_, config_.moe_router_bias_update_rate, stream);
  fill(bias_counts_, 0.f, stream);
}

void MoELayer::reset_global_tokens(const Stream& stream) {
  if (global_zeroed_) fill(global_acc_, 0.f, stream);  // else the first training forward zeroes it
}

void MoELayer::reset_stats(const Stream& stream) {
  if (stats_zeroed_) fill(stats_, 0.f, stream);  // else the first forward zeroes them
  dispatcher_->reset_stats(stream);
}

std::vector<double> MoELayer::stats(const Stream& stream) const {
  std::vector<double> out(static_cast<size_t>(kMoeStatLosses + num_experts_), 0.0);
  if (!stats_zeroed_) return out;
  std::vector<float> host(out.size());
  copy_bytes(host.data(), Device::cpu(), stats_.data(), stats_.device(), host.size() * sizeof(float), stream);
  stream.synchronize();
  std::copy(host.begin(), host.end(), out.begin());
  return out;
}

namespace {
// The rows [begin, begin + n) of a [R, c] buffer.
Tensor row_range(const Tensor& t, int64_t begin, int64_t n) {
  return rows(t).slice0(begin, begin + n);
}
}  // namespace

int MoELayer::token_group_size() const { return tp_cp_ ? tp_cp_->size() : tp_.size(); }

void MoELayer::sum_token_group(const Tensor& t, const Stream& st) const {
  if (tp_cp_) {
    if (tp_cp_->size() > 1) tp_cp_->all_reduce(t, ReduceOp::kSum, st);
  } else if (tp_.size() > 1) {
    tp_.group().all_reduce(t, ReduceOp::kSum, st);
  }
}

float MoELayer::aux_scale(MoeLoadBalancing type, double weight) const {
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

Tensor MoELayer::aux_counts(const Saved& sv, MoeLoadBalancing type) const {
  switch (type) {
    case MoeLoadBalancing::kSeqAuxLoss: return sv.seq_tokens_per_expert;
    case MoeLoadBalancing::kGlobalAuxLoss: return sv.global_tokens;
    default: return sv.tokens_per_expert;
  }
}

void MoELayer::random_logits(const Tensor& logits, const StepContext& ctx) const {
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

float MoELayer::z_scale(double weight) const {
  // coeff · mean over the TP × CP group's tokens, this rank's share (Megatron's coeff / |tp_cp|)
  return static_cast<float>(weight * config_.moe_z_loss_coeff / token_group_size() / static_cast<double>(tokens_));
}

Tensor MoELayer::router_top(int slot) const {
  return drops() ? saved_.at(static_cast<size_t>(slot)).top_routed : dispatcher_->top(slot);
}

void MoELayer::router_forward(Saved& sv, const StepContext& ctx) {
  const Stream& st = ctx.stream;
  if (fp64_router()) {  // Megatron's router_gating_linear in float64
    moe_router_logits_fp64(sv.logits, rows(sv.x), router_weight_.value(), st);
  } else {
    matmul(sv.logits, rows(sv.x), router_weight_.value(), false, true, 1.f, 0.f, st);
  }
  if (config_.moe_router_force_load_balancing) random_logits(sv.logits, ctx);
  expert_bias(st);  // zero-initialised on first use
  const Tensor top = router_top(ctx.slot), probs = dispatcher_->probs(ctx.slot);
  moe_topk_routing(probs, top, config_.moe_any_aux_loss() ? scores_aux_ : Tensor(), sv.logits, expert_bias_, router_,
                   st);
  if (drops())  // the slots beyond each expert's capacity get expert -1 in the dispatcher's selection
    moe_capacity_drop(dispatcher_->top(ctx.slot), kept_counts_, top, probs, capacity_,
                      config_.moe_token_drop_policy == MoeTokenDropPolicy::kProbs, st);
  // --- auxiliary losses (values for the log; gradients in backward), on the device ---
  if (ctx.dropout.training) {
    if (!stats_zeroed_) {
      fill(stats_, 0.f, st);
      stats_zeroed_ = true;
    }
    const double w = ctx.batch.aux_loss_weight;
    moe_tokens_per_expert(sv.tokens_per_expert, top, st);
    sum_token_group(sv.tokens_per_expert, st);  // over the TP × CP group
    if (seq_aux()) {  // per sequence of the [s, b] layout, summed over the TP × CP group's pieces of it
      moe_tokens_per_expert(sv.seq_tokens_per_expert, top, st);
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
    if (drops()) {  // the kept slots (Megatron's expert-bias counts are taken after the drop)
      sum_token_group(kept_counts_, st);
      total = kept_counts_;
    }
    const Tensor counted = stats_.slice0(kMoeStatLosses, kMoeStatLosses + num_experts_);
    add(counted, counted, total, st);
    if (!expert_bias_.empty()) add(bias_counts_, bias_counts_, total, st);
  }
}

Tensor MoELayer::forward(const StepContext& ctx, const ResidualAdd* add) {
  MT_CHECK(add == nullptr, "MoELayer: the residual add is not fused into the MoE block");
  Saved& sv = saved_.at(static_cast<size_t>(ctx.slot));
  const Stream& st = ctx.stream;
  const Tensor x = rows(sv.x);
  // --- router (local tokens) and the auxiliary losses, then the dispatcher's preprocessing (the
  // routing metadata on the device): the moe_router region of per-layer graphs, or both the
  // moe_preprocess region ---
  dispatcher_->count_stats(!ctx.recompute);
  const bool pre = preprocess_captured(ctx);
  router_region(ctx, false, [&] {
    router_forward(sv, ctx);
    if (pre) dispatcher_->preprocess(x, ctx.slot, st);
  });
  if (!pre) dispatcher_->preprocess(x, ctx.slot, st);
  // --- dispatch: the rows of the local experts, ordered by expert (the host read of the counts
  // where there is one, then the token exchange) ---
  MoeExpertCounts counts = dispatcher_->dispatch(sv.xp, x, ctx.slot, st);
  if (config_.moe_grouped_gemm) {  // experts and combine over all R_max rows, counts on the device
    sv.counts = counts.device;
    echo_fetch_weights(ctx.slot, st);
    grouped_forward(sv, st);
    dispatcher_->combine(rows(y_), sv.out, ctx.slot, st);
    return finish_forward(sv, ctx);
  }
  sv.counts_host = std::move(counts.host);
  const int64_t R = std::accumulate(sv.counts_host.begin(), sv.counts_host.end(), int64_t{0});
  // --- experts (with ECHO also the clones: home weights fetched into the clone slots) ---
  echo_fetch_weights(ctx.slot, st);
  int64_t off = 0;
  for (int64_t e = 0; e < num_local_ + num_echo_; ++e) {
    const int64_t n = sv.counts_host[static_cast<size_t>(e)];
    if (n > 0) {
      const ExpertTensors ex = expert_tensors(e);
      const Tensor xe = row_range(sv.xp, off, n), pre = row_range(sv.pre, off, n), act = row_range(sv.act, off, n);
      if (gated_) {
        linear_forward(pre, xe, ex.w1, Tensor(), Tensor(), st);
        mlp_activation(act, pre, true, st);
      } else {
        linear_forward(act, xe, ex.w1, Tensor(), pre, st);  // GELU epilogue
      }
      linear_forward(row_range(sv.out, off, n), act, ex.w2, Tensor(), Tensor(), st);
    }
    off += n;
  }
  // --- combine: weighted sum per token, back on the token's rank ---
  dispatcher_->combine(rows(y_), row_range(sv.out, 0, R), ctx.slot, st);
  return finish_forward(sv, ctx);
}

Tensor MoELayer::finish_forward(Saved& sv, const StepContext& ctx) {
  if (shared_) {
    const Stream& st = ctx.stream;
    copy(shared_->input(ctx.slot), sv.x, st);
    const Tensor ys = shared_->forward(ctx);
    if (!gated_shared()) {
      add(y_, y_, ys, st);
      return y_;
    }
    // y += sigmoid(x · w_gate) · ys per token (Megatron's SharedExpertMLP gate); ys kept for the backward
    copy(sv.shared_out, rows(ys), st);
    moe_shared_gate_forward(rows(y_), sv.gate_logits, sv.shared_out, rows(sv.x), gate_weight_.value(), st);
  }
  return y_;
}

MoELayer::ExpertTensors MoELayer::expert_tensors(int64_t e) const {
  if (e < num_local_) {
    const Expert& ex = experts_[static_cast<size_t>(e)];
    return {ex.fc1.value(), ex.fc2.value(), ex.fc1.grad(), ex.fc2.grad()};
  }
  const int64_t j = e - num_local_;  // ECHO clone slot
  const auto one = [j](const Tensor& t) { return t.slice0(j, j + 1).view({t.size(1), t.size(2)}); };
  return {one(echo_w1_), one(echo_w2_), one(echo_g1_), one(echo_g2_)};
}

void MoELayer::build_tables(const Stream& st) {
  if (!fc1_w_.empty()) return;  // once: the address tables of the experts' and clone slots' weights
  std::vector<Tensor> w1, w2, g1, g2;  // and main gradients (the ParamStore's addresses are fixed)
  for (int64_t e = 0; e < num_local_ + num_echo_; ++e) {
    const ExpertTensors ex = expert_tensors(e);
    w1.push_back(ex.w1);
    w2.push_back(ex.w2);
    g1.push_back(ex.g1);
    g2.push_back(ex.g2);
  }
  fc1_w_ = GroupedWeights(std::move(w1), st);
  fc2_w_ = GroupedWeights(std::move(w2), st);
  fc1_g_ = GroupedWeights(std::move(g1), st);
  fc2_g_ = GroupedWeights(std::move(g2), st);
}

void MoELayer::echo_fetch_weights(int slot, const Stream& st) {
  if (const Tensor ce = dispatcher_->echo_clone_expert(slot); !ce.empty()) {
    // capturable: fixed-size all-to-alls of P·S expert blocks, packed and unpacked on the device
    build_tables(st);
    const EchoExchange& x = echo_x_;
    moe_echo_exchange_index(x.w_send, x.w_recv, x.g_send, x.g_acc, ce, ep_.ep_rank, num_local_, num_echo_, st);
    moe_echo_gather_experts(x.send1, fc1_w_, x.w_send, st);
    moe_echo_gather_experts(x.send2, fc2_w_, x.w_send, st);
    ep_.ep_group->all_to_all(x.recv1, x.send1, st);
    ep_.ep_group->all_to_all(x.recv2, x.send2, st);
    moe_echo_gather_blocks(echo_w1_, x.recv1, x.w_recv, st);
    moe_echo_gather_blocks(echo_w2_, x.recv2, x.w_recv, st);
    return;
  }
  const EchoPlacement* placement = dispatcher_->echo_placement(slot);
  if (!placement) return;
  std::vector<std::vector<Tensor>> local, clones;
  for (int64_t e = 0; e < num_local_ + num_echo_; ++e) {
    const ExpertTensors ex = expert_tensors(e);
    (e < num_local_ ? local : clones).push_back({ex.w1, ex.w2});
  }
  echo_dispatch_weights(*ep_.ep_group, *placement, local, clones, st);
}

void MoELayer::echo_return_grads(int slot, const Stream& st) {
  if (const Tensor ce = dispatcher_->echo_clone_expert(slot); !ce.empty()) {
    // the indices of echo_fetch_weights (this backward's refetch computed them for this slot)
    const EchoExchange& x = echo_x_;
    moe_echo_gather_blocks(x.gsend1, echo_g1_, x.g_send, st);
    moe_echo_gather_blocks(x.gsend2, echo_g2_, x.g_send, st);
    ep_.ep_group->all_to_all(x.grecv1, x.gsend1, st);
    ep_.ep_group->all_to_all(x.grecv2, x.gsend2, st);
    moe_echo_accumulate_experts(fc1_g_, x.grecv1, x.g_acc, st);  // slots in order: deterministic
    moe_echo_accumulate_experts(fc2_g_, x.grecv2, x.g_acc, st);
    return;
  }
  const EchoPlacement* placement = dispatcher_->echo_placement(slot);
  if (!placement) return;
  std::vector<std::vector<Tensor>> main, clones;
  for (int64_t e = 0; e < num_local_ + num_echo_; ++e) {
    const ExpertTensors ex = expert_tensors(e);
    (e < num_local_ ? main : clones).push_back({ex.g1, ex.g2});
  }
  echo_return_gradients(*ep_.ep_group, *placement, clones, main, echo_ret_, st);
}

void MoELayer::grouped_forward(Saved& sv, const Stream& st) {
  build_tables(st);
  // Rows beyond Σ counts: the GEMMs write zeros there, so the activation gives zeros too.
  grouped_linear_forward(sv.pre, sv.xp, fc1_w_, sv.counts, st);
  mlp_activation(sv.act, sv.pre, gated_, st);
  grouped_linear_forward(sv.out, sv.act, fc2_w_, sv.counts, st);
}

void MoELayer::grouped_backward(Saved& sv, const Stream& st) {
  build_tables(st);
  // d_out_ rows beyond Σ counts are stale (combine_backward writes the routed rows only) and never
  // read; the dgrads write zeros to their tails, so the activation backward gives zeros there.
  if (recompute_act_) mlp_activation(sv.act, sv.pre, gated_, st);
  grouped_linear_dgrad(d_act_, d_out_, fc2_w_, sv.counts, st);
  grouped_linear_wgrad(fc2_g_, d_out_, sv.act, sv.counts, st);
  if (gated_) {
    swiglu_backward(d_pre_, d_act_, sv.pre, st);
  } else {
    gelu_backward(d_pre_, d_act_, sv.pre, st);
  }
  grouped_linear_dgrad(d_xp_, d_pre_, fc1_w_, sv.counts, st);
  grouped_linear_wgrad(fc1_g_, d_pre_, sv.xp, sv.counts, st);
}

Tensor MoELayer::backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) {
  Saved& sv = saved_.at(static_cast<size_t>(ctx.slot));
  const Stream& st = ctx.stream;
  const Tensor dx = rows(dx_);
  const bool echo = num_echo_ > 0;
  if (echo) {  // the clones' weights again (scratch), their gradients from zero
    echo_fetch_weights(ctx.slot, st);
    fill(echo_g1_, 0.f, st);
    fill(echo_g2_, 0.f, st);
  }
  if (config_.moe_grouped_gemm) {  // all R_max rows, counts on the device
    dispatcher_->combine_backward(d_out_, d_probs_, rows(dy), sv.out, ctx.slot, st);
    grouped_backward(sv, st);
    echo_return_grads(ctx.slot, st);
    dispatcher_->dispatch_backward(dx, d_xp_, ctx.slot, st);
    return router_backward(sv, dy, ctx, defer);
  }
  const int64_t R = std::accumulate(sv.counts_host.begin(), sv.counts_host.end(), int64_t{0});
  // --- combine backward: row gradients and d probs ---
  dispatcher_->combine_backward(row_range(d_out_, 0, R), d_probs_, rows(dy), row_range(sv.out, 0, R), ctx.slot, st);
  // --- experts backward ---
  int64_t off = 0;
  for (int64_t e = 0; e < num_local_ + num_echo_; ++e) {
    const int64_t n = sv.counts_host[static_cast<size_t>(e)];
    if (n > 0) {
      const ExpertTensors ex = expert_tensors(e);
      const Tensor xe = row_range(sv.xp, off, n), pre = row_range(sv.pre, off, n), act = row_range(sv.act, off, n);
      const Tensor dact = row_range(d_act_, off, n), dpre = row_range(d_pre_, off, n);
      if (recompute_act_) mlp_activation(act, pre, gated_, st);
      linear_backward(dact, ex.g2, Tensor(), row_range(d_out_, off, n), act, ex.w2, st);
      if (gated_) {
        swiglu_backward(dpre, dact, pre, st);
      } else {
        gelu_backward(dpre, dact, pre, st);
      }
      linear_backward(row_range(d_xp_, off, n), ex.g1, Tensor(), dpre, xe, ex.w1, st);
    }
    off += n;
  }
  echo_return_grads(ctx.slot, st);  // the clones' weight gradients added to their home experts
  // --- dispatch backward: token gradients back to their ranks ---
  dispatcher_->dispatch_backward(dx, row_range(d_xp_, 0, R), ctx.slot, st);
  return router_backward(sv, dy, ctx, defer);
}

bool MoELayer::preprocess_captured(const StepContext& ctx) {
  return ctx.graphs != nullptr && ctx.graphs->scoped(LayerGraphs::Region::kMoePreprocess);
}

void MoELayer::router_region(const StepContext& ctx, bool backward, const std::function<void()>& body) {
  if (ctx.graphs == nullptr) {
    body();
    return;
  }
  // Reads the slot's tensors and the static scratch only (d_probs, dx; with the preprocessing the
  // dispatcher's saved maps and scratch: send rows, counts), besides the loss scale. Everything
  // that differs between micro-batches is device data: the routing, the counts, the maps.
  const auto region = preprocess_captured(ctx) ? LayerGraphs::Region::kMoePreprocess : LayerGraphs::Region::kMoeRouter;
  ctx.graphs->run(layer_, region, backward, ctx.dropout.training, ctx.slot,
                  {ctx.loss_scale.data(), nullptr, nullptr, nullptr, nullptr}, ctx.stream, body);
}

Tensor MoELayer::router_backward(Saved& sv, const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) {
  const Stream& st = ctx.stream;
  const Tensor x = rows(sv.x);
  const Tensor dx = rows(dx_);
  // --- the preprocessing's backward (alltoall: permutation 1 undone into dx), then the router's:
  // probs path, load-balancing loss, z-loss (the moe_router or moe_preprocess region) ---
  const bool pre = preprocess_captured(ctx);
  if (!pre) dispatcher_->preprocess_backward(dx, ctx.slot, st);
  router_region(ctx, true, [&] {
    if (pre) dispatcher_->preprocess_backward(dx, ctx.slot, st);
    moe_topk_routing_backward(d_logits_, d_probs_, sv.logits, router_top(ctx.slot), router_, st);
    const double w = ctx.batch.aux_loss_weight;
    for (MoeLoadBalancing type : kAuxTypes)  // the gradients of the types' losses add up
      if (config_.moe_aux_loss_on(type))
        moe_aux_scores_backward(d_logits_, sv.logits, aux_counts(sv, type), aux_scale(type, w), ctx.loss_scale,
                                router_.sigmoid, st);
    if (config_.moe_z_loss_coeff > 0) moe_z_loss(Tensor(), d_logits_, sv.logits, z_scale(w), ctx.loss_scale, st);
    if (fp64_router()) {  // dW_r += d_logitsᵀ x, dx += d_logits W_r, summed in double
      moe_router_logits_fp64_backward(dx, router_weight_.grad(), d_logits_, x, router_weight_.value(), st);
      return;
    }
    // dW_r += d_logitsᵀ x, dx += d_logits W_r (in the activation dtype)
    const Tensor d_logits = d_logits_act_.empty() ? d_logits_ : d_logits_act_;
    if (!d_logits_act_.empty()) cast(d_logits_act_, d_logits_, st);
    linear_backward(Tensor(), router_weight_.grad(), Tensor(), d_logits, x, router_weight_.value(), st);
    matmul(dx, d_logits, router_weight_.value(), false, false, 1.f, 1.f, st);
  });
  if (!shared_) return dx_;
  if (!gated_shared()) {
    add(dx_, dx_, shared_->backward(dy, ctx, defer), st);
    return dx_;
  }
  // the gate: d ys = g · dy, d logit = g(1 − g)·<dy, ys>; dW_g += d_logitᵀ x, dx += d_logit W_g
  moe_shared_gate_backward(rows(d_shared_), d_gate_, dx, gate_weight_.grad(), rows(dy), sv.shared_out, x,
                           gate_weight_.value(), sv.gate_logits, st);
  add(dx_, dx_, shared_->backward(d_shared_, ctx, defer), st);
  return dx_;
}

}  // namespace mt
