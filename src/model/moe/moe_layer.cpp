#include "model/moe/moe_layer.h"

#include "model/layer_graphs.h"
#include "model/moe/moe_phase_timer.h"
#include "ops/elementwise.h"

namespace mt {

namespace {
// The backward pass being timed on this thread (MT_MOE_PHASE_TIMING), so that router_backward
// times its phases in it; set for the duration of MoELayer::backward.
thread_local MoePhasePass* t_backward_timing = nullptr;
struct BackwardTiming {
  explicit BackwardTiming(MoePhasePass& p) : saved(t_backward_timing) { t_backward_timing = &p; }
  ~BackwardTiming() { t_backward_timing = saved; }
  MoePhasePass* saved;
};
}  // namespace

MoELayer::Events::Events(Device device, int64_t chunks)
    : shared_fork(device), shared_join(device), start(device), end(device) {
  for (int64_t c = 0; c < chunks; ++c) {
    ready.push_back(std::make_unique<Event>(device));
    done.push_back(std::make_unique<Event>(device));
  }
}

MoELayer::MoELayer(const TransformerConfig& c, int64_t layer, const TensorParallelRegion& tp,
                   const ExpertParallel& ep, ParamRegistry& reg)
    : tp_(tp), layer_(layer), hidden_(c.hidden_size), shared_res_(ep.shared) {
  MT_REQUIRE(ep.ep_size >= 1 && c.num_moe_experts % ep.ep_size == 0,
             "--num-experts {} is not divisible by expert model parallel size {}", c.num_moe_experts, ep.ep_size);
  MT_REQUIRE(ep.etp_size >= 1 && c.moe_ffn() % ep.etp_size == 0,
             "--moe-ffn-hidden-size {} is not divisible by expert tensor parallel size {}", c.moe_ffn(), ep.etp_size);
  const int64_t num_echo = c.moe_enable_echo ? c.moe_num_echo_experts : 0;
  MT_REQUIRE(num_echo == 0 || ep.ep_size > 1,
             "--moe-enable-echo needs --expert-model-parallel-size > 1 (clones live on other EP ranks), got {}",
             ep.ep_size);
  const int64_t num_local = c.num_moe_experts / ep.ep_size;
  MoeDispatchSizes sizes{c.num_moe_experts,  c.moe_router_topk,  num_local, ep.ep_rank * num_local,
                         c.moe_grouped_gemm, num_echo,           c.moe_received_token_capacity};
  sizes.chunks = c.overlap_moe_expert_parallel_comm ? kOverlapChunks : 1;
  sizes.permute_fusion = c.moe_permute_fusion;
  if (c.moe_expert_capacity_set) sizes.capacity_factor = c.moe_expert_capacity_factor;
  dispatcher_ = make_moe_token_dispatcher(c.moe_token_dispatcher_type, ep, sizes);
  if (c.overlap_moe_expert_parallel_comm) {
    chunked_ = dynamic_cast<MoEAlltoAllTokenDispatcher*>(dispatcher_.get());
    MT_REQUIRE(chunked_ != nullptr,
               "--overlap-moe-expert-parallel-comm needs the dropless alltoall token dispatcher (layer {})", layer);
    delay_wgrad_ = c.delay_wgrad_compute;
  }
  // the parameters in Megatron-Core's order: router, experts, shared experts
  const std::string p = fmt::format("decoder.layers.{}.mlp.", layer);
  router_ = std::make_unique<TopKRouter>(c, layer, tp, p, reg);
  experts_ = make_moe_experts(c, p, ep, num_echo, reg);
  if (c.moe_shared_expert_intermediate_size > 0) shared_ = std::make_unique<SharedExpertMLP>(c, p, tp, reg);
  // The shared experts' TP collectives run beside the dispatcher's: only on another communicator
  // (without an expert grid the dispatcher's groups are the TP group itself; then no overlap).
  // A layout-only model (parameter specs: no communicators) never runs, so it needs no answer.
  if (shared_ && c.moe_shared_expert_overlap && tp.has_group()) {
    const Communicator* tp_group = tp.size() > 1 ? &tp.group() : nullptr;
    overlap_shared_ = tp_group == nullptr || (tp_group != ep.dispatch.get() && tp_group != ep.ep_group.get() &&
                                              tp_group != ep.etp_group.get());
  }
}

void MoELayer::plan(BufferPlanner& p, int64_t s, int64_t b) {
  const DType t = p.act_dtype();
  const int64_t h = hidden_, sl = tp_.local_seq(s), tokens = sl * b;
  const size_t a = static_cast<size_t>(p.area());
  if (x_.size() <= a) x_.resize(a + 1);
  x_[a] = p.saved(t, {sl, b, h}, "MoE input");
  router_->plan(p, tokens, b);
  // R_max expert rows, the dispatcher's bound; the output rows saved only if its backward reads them
  experts_->plan(p, dispatcher_->plan(p, tokens, h), dispatcher_->combine_backward_reads_output());
  if (shared_) shared_->plan(p, s, b);
  y_ = p.scratch("moe.y", t, {sl, b, h});
  dx_ = p.scratch("moe.dx", t, {sl, b, h});
  // the side streams and events (once, outside any step)
  if ((overlap_shared_ || chunked_) && !events_) events_ = std::make_unique<Events>(p.device(), kOverlapChunks);
  if (overlap_shared_ && !shared_stream_) shared_stream_ = &shared_res_->shared_stream(p.device());
  if (chunked_ && !comm_stream_) comm_stream_ = &shared_res_->comm_stream(p.device());
}

void MoELayer::reset_stats(const Stream& stream) {
  router_->reset_stats(stream);
  dispatcher_->reset_stats(stream);
}

StepContext MoELayer::on_stream(const StepContext& ctx, const Stream& stream) {
  StepContext s{ctx.batch, ctx.dropout, ctx.slot, stream, ctx.loss_scale, ctx.graphs};
  s.recompute = ctx.recompute;
  return s;
}

Tensor MoELayer::forward(const StepContext& ctx, const ResidualAdd* add) {
  MT_CHECK(add == nullptr, "MoELayer: the residual add is not fused into the MoE block");
  const Stream& st = ctx.stream;
  const Tensor xs = x_.at(static_cast<size_t>(ctx.slot)), x = rows(xs);
  MoePhasePass timing(MoePhaseTimer::current(), ctx, /*backward=*/false, layer_);  // MT_MOE_PHASE_TIMING
  // --- router (local tokens) and the auxiliary losses, then the dispatcher's preprocessing (the
  // routing metadata on the device): the moe_router region of per-layer graphs, or both the
  // moe_preprocess region ---
  dispatcher_->count_stats(!ctx.recompute);
  const bool pre = preprocess_captured(ctx);
  router_region(ctx, false, [&] {
    {
      const auto t = timing.phase(MoePhase::kRouter);
      router_->forward(x, dispatcher_->top(ctx.slot), dispatcher_->probs(ctx.slot), ctx);
    }
    if (pre) dispatcher_->preprocess(x, ctx.slot, st);
  });
  if (!pre) {
    const auto t = timing.phase(MoePhase::kPermute);
    dispatcher_->preprocess(x, ctx.slot, st);
  }
  // --- the shared experts beside the exchanges (--moe-shared-expert-overlap) ---
  if (overlap_shared_) {
    events_->shared_fork.record(st);
    events_->shared_fork.wait(*shared_stream_);
    shared_out_ = shared_->compute(xs, on_stream(ctx, *shared_stream_));
    events_->shared_join.record(*shared_stream_);
  }
  // --- dispatch: the rows of the local experts, ordered by expert (the host read of the counts
  // where there is one, then the token exchange); the experts (with ECHO also the clones);
  // combine: weighted sum per token, back on the token's rank ---
  if (chunked_) {
    const auto t = timing.phase(MoePhase::kPipelined);
    pipelined_forward(ctx);
  } else {
    MoeExpertCounts counts;
    Tensor out;
    {
      const auto t = timing.phase(MoePhase::kDispatch);
      counts = dispatcher_->dispatch(experts_->input(ctx.slot), x, ctx.slot, st);
    }
    {
      const auto t = timing.phase(MoePhase::kExperts);
      out = experts_->forward(std::move(counts), *dispatcher_, ctx.slot, st);
    }
    const auto t = timing.phase(MoePhase::kCombine);
    dispatcher_->combine(rows(y_), out, ctx.slot, st);
  }
  // --- the shared experts ---
  if (shared_) {
    const auto t = timing.phase(MoePhase::kSharedExperts);
    if (overlap_shared_) {
      events_->shared_join.wait(st);
      shared_->add_output(y_, shared_out_, xs, ctx);
    } else {
      shared_->forward(y_, xs, ctx);
    }
  }
  return y_;
}

void MoELayer::pipelined_forward(const StepContext& ctx) {
  const Stream& st = ctx.stream;
  const Stream& comm = *comm_stream_;
  const int slot = ctx.slot;
  const Tensor xp = experts_->input(slot);
  // the host read of the counts; the clones' weights (ECHO, over EP) before the exchanges start
  experts_->begin_forward(chunked_->plan_dispatch(xp, slot, st), *dispatcher_, slot, st);
  const Tensor out = experts_->output(slot);
  const int64_t n = chunked_->num_chunks(slot);
  Events& ev = *events_;
  ev.start.record(st);
  ev.start.wait(comm);
  for (int64_t c = 0; c < n; ++c) {
    chunked_->dispatch_chunk(xp, slot, c, comm);
    ev.ready[static_cast<size_t>(c)]->record(comm);
  }
  for (int64_t c = 0; c < n; ++c) {
    const auto r = chunked_->chunk(slot, c);
    ev.ready[static_cast<size_t>(c)]->wait(st);
    experts_->forward_range(slot, {r.first, r.last, r.row_begin, r.rows}, st);
    ev.done[static_cast<size_t>(c)]->record(st);
    ev.done[static_cast<size_t>(c)]->wait(comm);
    chunked_->combine_chunk(out, slot, c, comm);
  }
  ev.end.record(comm);
  ev.end.wait(st);
  chunked_->combine_finish(rows(y_), slot, st);
}

Tensor MoELayer::backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) {
  const Stream& st = ctx.stream;
  const int slot = ctx.slot;
  MoePhasePass timing(MoePhaseTimer::current(), ctx, /*backward=*/true, layer_);  // MT_MOE_PHASE_TIMING
  const BackwardTiming current(timing);
  // --- the shared experts' backward beside the exchanges (--moe-shared-expert-overlap) ---
  if (overlap_shared_) {
    events_->shared_fork.record(st);
    events_->shared_fork.wait(*shared_stream_);
    shared_dx_ = shared_->backward_compute(dy, x_.at(static_cast<size_t>(slot)), on_stream(ctx, *shared_stream_),
                                           defer);
    events_->shared_join.record(*shared_stream_);
  }
  {
    const auto t = timing.phase(MoePhase::kExperts);
    experts_->prepare_backward(*dispatcher_, slot, st);
  }
  // --- combine backward: row gradients and d probs; the experts' backward; the dispatch
  // backward: token gradients back to their ranks ---
  if (chunked_) {
    const auto t = timing.phase(MoePhase::kPipelined);
    pipelined_backward(dy, ctx);
  } else {
    Tensor d_xp;
    {
      const auto t = timing.phase(MoePhase::kCombine);
      // the output rows only where the dispatcher reads them (elsewhere they are scratch, long gone)
      const Tensor out = dispatcher_->combine_backward_reads_output() ? experts_->output(slot) : Tensor();
      dispatcher_->combine_backward(experts_->output_grad(slot), router_->d_probs(), rows(dy), out, slot, st);
    }
    {
      const auto t = timing.phase(MoePhase::kExperts);
      d_xp = experts_->backward(*dispatcher_, slot, st);
    }
    const auto t = timing.phase(MoePhase::kDispatch);
    dispatcher_->dispatch_backward(rows(dx_), d_xp, slot, st);
  }
  return router_backward(dy, ctx, defer);
}

void MoELayer::pipelined_backward(const Tensor& dy, const StepContext& ctx) {
  const Stream& st = ctx.stream;
  const Stream& comm = *comm_stream_;
  const int slot = ctx.slot;
  chunked_->combine_backward_start(router_->d_probs(), rows(dy), slot, st);
  const Tensor d_out = experts_->output_grad(slot), d_xp = experts_->input_grad(slot);
  const int64_t n = chunked_->num_chunks(slot);
  Events& ev = *events_;
  ev.start.record(st);
  ev.start.wait(comm);
  for (int64_t c = 0; c < n; ++c) {
    chunked_->combine_backward_chunk(d_out, slot, c, comm);
    ev.ready[static_cast<size_t>(c)]->record(comm);
  }
  for (int64_t c = 0; c < n; ++c) {
    const auto r = chunked_->chunk(slot, c);
    ev.ready[static_cast<size_t>(c)]->wait(st);
    experts_->backward_range(slot, {r.first, r.last, r.row_begin, r.rows}, /*wgrad=*/!delay_wgrad_, st);
    ev.done[static_cast<size_t>(c)]->record(st);
    ev.done[static_cast<size_t>(c)]->wait(comm);
    chunked_->dispatch_backward_chunk(d_xp, slot, c, comm);
  }
  if (delay_wgrad_)  // the weight gradients beside the last chunks' exchanges (their inputs are intact)
    for (int64_t c = 0; c < n; ++c) {
      const auto r = chunked_->chunk(slot, c);
      experts_->wgrad_range(slot, {r.first, r.last, r.row_begin, r.rows}, st);
    }
  ev.end.record(comm);
  ev.end.wait(st);
  experts_->finish_backward(*dispatcher_, slot, st);  // ECHO: the clones' gradients home, over EP
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
  MT_CHECK(t_backward_timing != nullptr, "MoELayer::router_backward outside MoELayer::backward (layer {})", layer_);
  MoePhasePass& timing = *t_backward_timing;
  const bool pre = preprocess_captured(ctx);
  if (!pre) {
    const auto t = timing.phase(MoePhase::kPermute);
    dispatcher_->preprocess_backward(dx, ctx.slot, st);
  }
  router_region(ctx, true, [&] {
    if (pre) dispatcher_->preprocess_backward(dx, ctx.slot, st);
    const auto t = timing.phase(MoePhase::kRouter);
    router_->backward(dx, x, dispatcher_->top(ctx.slot), ctx);
  });
  if (shared_) {
    const auto t = timing.phase(MoePhase::kSharedExperts);
    if (overlap_shared_) {
      events_->shared_join.wait(st);
      shared_->finish_backward(dx_, shared_dx_, ctx);
    } else {
      shared_->backward(dx_, dy, xs, ctx, defer);
    }
  }
  return dx_;
}

}  // namespace mt
