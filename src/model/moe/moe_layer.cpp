#include "model/moe/moe_layer.h"

#include "model/layer_graphs.h"

namespace mt {

MoELayer::MoELayer(const TransformerConfig& c, int64_t layer, const TensorParallelRegion& tp,
                   const ExpertParallel& ep, ParamRegistry& reg)
    : tp_(tp), layer_(layer), hidden_(c.hidden_size) {
  MT_REQUIRE(ep.ep_size >= 1 && c.num_moe_experts % ep.ep_size == 0,
             "--num-experts {} is not divisible by expert model parallel size {}", c.num_moe_experts, ep.ep_size);
  MT_REQUIRE(ep.etp_size >= 1 && c.moe_ffn() % ep.etp_size == 0,
             "--moe-ffn-hidden-size {} is not divisible by expert tensor parallel size {}", c.moe_ffn(), ep.etp_size);
  const int64_t num_echo = c.moe_enable_echo ? c.moe_num_echo_experts : 0;
  MT_REQUIRE(num_echo == 0 || ep.ep_size > 1,
             "--moe-enable-echo needs --expert-model-parallel-size > 1 (clones live on other EP ranks), got {}",
             ep.ep_size);
  const int64_t num_local = c.num_moe_experts / ep.ep_size;
  dispatcher_ = make_moe_token_dispatcher(c.moe_token_dispatcher_type, ep,
                                          {c.num_moe_experts, c.moe_router_topk, num_local, ep.ep_rank * num_local,
                                           c.moe_grouped_gemm, num_echo, c.moe_received_token_capacity});
  // the parameters in Megatron-Core's order: router, experts, shared experts
  const std::string p = fmt::format("decoder.layers.{}.mlp.", layer);
  router_ = std::make_unique<TopKRouter>(c, layer, tp, p, reg);
  experts_ = make_moe_experts(c, p, ep, num_echo, reg);
  if (c.moe_shared_expert_intermediate_size > 0) shared_ = std::make_unique<SharedExpertMLP>(c, p, tp, reg);
}

void MoELayer::plan(BufferPlanner& p, int64_t s, int64_t b) {
  const DType t = p.act_dtype();
  const int64_t h = hidden_, sl = tp_.local_seq(s), tokens = sl * b;
  const size_t a = static_cast<size_t>(p.area());
  if (x_.size() <= a) x_.resize(a + 1);
  x_[a] = p.saved(t, {sl, b, h}, "MoE input");
  router_->plan(p, tokens, b);
  experts_->plan(p, dispatcher_->plan(p, tokens, h));  // R_max expert rows, the dispatcher's bound
  if (shared_) shared_->plan(p, s, b);
  y_ = p.scratch("moe.y", t, {sl, b, h});
  dx_ = p.scratch("moe.dx", t, {sl, b, h});
}

void MoELayer::reset_stats(const Stream& stream) {
  router_->reset_stats(stream);
  dispatcher_->reset_stats(stream);
}

Tensor MoELayer::forward(const StepContext& ctx, const ResidualAdd* add) {
  MT_CHECK(add == nullptr, "MoELayer: the residual add is not fused into the MoE block");
  const Stream& st = ctx.stream;
  const Tensor xs = x_.at(static_cast<size_t>(ctx.slot)), x = rows(xs);
  // --- router (local tokens) and the auxiliary losses, then the dispatcher's preprocessing (the
  // routing metadata on the device): the moe_router region of per-layer graphs, or both the
  // moe_preprocess region ---
  dispatcher_->count_stats(!ctx.recompute);
  const bool pre = preprocess_captured(ctx);
  router_region(ctx, false, [&] {
    router_->forward(x, dispatcher_->top(ctx.slot), dispatcher_->probs(ctx.slot), ctx);
    if (pre) dispatcher_->preprocess(x, ctx.slot, st);
  });
  if (!pre) dispatcher_->preprocess(x, ctx.slot, st);
  // --- dispatch: the rows of the local experts, ordered by expert (the host read of the counts
  // where there is one, then the token exchange); the experts (with ECHO also the clones) ---
  MoeExpertCounts counts = dispatcher_->dispatch(experts_->input(ctx.slot), x, ctx.slot, st);
  const Tensor out = experts_->forward(std::move(counts), *dispatcher_, ctx.slot, st);
  // --- combine: weighted sum per token, back on the token's rank; the shared experts ---
  dispatcher_->combine(rows(y_), out, ctx.slot, st);
  if (shared_) shared_->forward(y_, xs, ctx);
  return y_;
}

Tensor MoELayer::backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) {
  const Stream& st = ctx.stream;
  const int slot = ctx.slot;
  experts_->prepare_backward(*dispatcher_, slot, st);
  // --- combine backward: row gradients and d probs; the experts' backward; the dispatch
  // backward: token gradients back to their ranks ---
  dispatcher_->combine_backward(experts_->output_grad(slot), router_->d_probs(), rows(dy), experts_->output(slot),
                                slot, st);
  const Tensor d_xp = experts_->backward(*dispatcher_, slot, st);
  dispatcher_->dispatch_backward(rows(dx_), d_xp, slot, st);
  return router_backward(dy, ctx, defer);
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

Tensor MoELayer::router_backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) {
  const Stream& st = ctx.stream;
  const Tensor xs = x_.at(static_cast<size_t>(ctx.slot)), x = rows(xs);
  const Tensor dx = rows(dx_);
  // --- the preprocessing's backward (alltoall: permutation 1 undone into dx), then the router's:
  // probs path, load-balancing loss, z-loss (the moe_router or moe_preprocess region) ---
  const bool pre = preprocess_captured(ctx);
  if (!pre) dispatcher_->preprocess_backward(dx, ctx.slot, st);
  router_region(ctx, true, [&] {
    if (pre) dispatcher_->preprocess_backward(dx, ctx.slot, st);
    router_->backward(dx, x, dispatcher_->top(ctx.slot), ctx);
  });
  if (shared_) shared_->backward(dx_, dy, xs, ctx, defer);
  return dx_;
}

}  // namespace mt
