#include "model/moe/shared_experts.h"

#include "model/layers/parallel_params.h"
#include "ops/elementwise.h"
#include "ops/moe.h"

namespace mt {

SharedExpertMLP::SharedExpertMLP(const TransformerConfig& c, const std::string& p, const TensorParallelRegion& tp,
                                 ParamRegistry& reg)
    : config_(c), tp_(tp), mlp_(c, p + "shared_experts", c.moe_shared_expert_intermediate_size, tp, reg) {
  if (gated())  // Megatron's SharedExpertMLP gate_weight [1, h]
    reg.declare(replicated_param(p + "shared_experts.gate_weight", {1, c.hidden_size}, InitKind::kNormal,
                                 c.init_method_std, TpGradSum::kSequenceParallel),
                &gate_weight_);
}

void SharedExpertMLP::plan(BufferPlanner& p, int64_t s, int64_t b) {
  mlp_.plan(p, s, b);
  if (!gated()) return;
  const DType t = p.act_dtype();
  const int64_t h = config_.hidden_size, sl = tp_.local_seq(s), tokens = sl * b;
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  Saved& sv = saved_[a];
  sv.shared_out = p.saved(t, {tokens, h}, "gated shared expert output");
  sv.gate_logits = p.saved(DType::kF32, {tokens}, "shared expert gate logits");
  d_shared_ = p.scratch("moe.d_shared", t, {sl, b, h});
  d_gate_ = p.scratch("moe.d_gate", DType::kF32, {tokens});
}

void SharedExpertMLP::forward(const Tensor& y, const Tensor& x, const StepContext& ctx) {
  add_output(y, compute(x, ctx), x, ctx);
}

Tensor SharedExpertMLP::compute(const Tensor& x, const StepContext& ctx) {
  const Stream& st = ctx.stream;
  copy(mlp_.input(ctx.slot), x, st);
  const Tensor ys = mlp_.forward(ctx);
  if (gated()) copy(saved_.at(static_cast<size_t>(ctx.slot)).shared_out, rows(ys), st);  // kept for the backward
  return ys;
}

void SharedExpertMLP::add_output(const Tensor& y, const Tensor& ys, const Tensor& x, const StepContext& ctx) {
  const Stream& st = ctx.stream;
  if (!gated()) {
    add(y, y, ys, st);
    return;
  }
  // y += sigmoid(x · w_gate) · ys per token (Megatron's SharedExpertMLP gate)
  const Saved& sv = saved_.at(static_cast<size_t>(ctx.slot));
  moe_shared_gate_forward(rows(y), sv.gate_logits, sv.shared_out, rows(x), gate_weight_.value(), st);
}

void SharedExpertMLP::backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const StepContext& ctx,
                               WgradDeferral* defer) {
  finish_backward(dx, backward_compute(dy, x, ctx, defer), ctx);
}

Tensor SharedExpertMLP::backward_compute(const Tensor& dy, const Tensor& x, const StepContext& ctx,
                                         WgradDeferral* defer) {
  if (!gated()) return mlp_.backward(dy, ctx, defer);
  // the gate: d ys = g · dy, d logit = g(1 − g)·<dy, ys>, dW_g += d_logitᵀ x (dx's part later)
  const Saved& sv = saved_.at(static_cast<size_t>(ctx.slot));
  moe_shared_gate_backward(rows(d_shared_), d_gate_, Tensor(), gate_weight_.grad(), rows(dy), sv.shared_out, rows(x),
                           gate_weight_.value(), sv.gate_logits, ctx.stream);
  return mlp_.backward(d_shared_, ctx, defer);
}

void SharedExpertMLP::finish_backward(const Tensor& dx, const Tensor& d_mlp, const StepContext& ctx) {
  const Stream& st = ctx.stream;
  if (gated()) moe_shared_gate_backward_dx(rows(dx), d_gate_, gate_weight_.value(), st);  // dx += d_logit W_g
  add(dx, dx, d_mlp, st);
}

}  // namespace mt
