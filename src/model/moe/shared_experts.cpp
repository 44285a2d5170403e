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
  const Stream& st = ctx.stream;
  copy(mlp_.input(ctx.slot), x, st);
  const Tensor ys = mlp_.forward(ctx);
  if (!gated()) {
    add(y, y, ys, st);
    return;
  }
  // y += sigmoid(x · w_gate) · ys per token (Megatron's SharedExpertMLP gate); ys kept for the backward
  const Saved& sv = saved_.at(static_cast<size_t>(ctx.slot));
  copy(sv.shared_out, rows(ys), st);
  moe_shared_gate_forward(rows(y), sv.gate_logits, sv.shared_out, rows(x), gate_weight_.value(), st);
}

void SharedExpertMLP::backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const StepContext& ctx,
                               WgradDeferral* defer) {
  const Stream& st = ctx.stream;
  if (!gated()) {
    add(dx, dx, mlp_.backward(dy, ctx, defer), st);
    return;
  }
  // the gate: d ys = g · dy, d logit = g(1 − g)·<dy, ys>; dW_g += d_logitᵀ x, dx += d_logit W_g
  const Saved& sv = saved_.at(static_cast<size_t>(ctx.slot));
  moe_shared_gate_backward(rows(d_shared_), d_gate_, rows(dx), gate_weight_.grad(), rows(dy), sv.shared_out, rows(x),
                           gate_weight_.value(), sv.gate_logits, st);
  add(dx, dx, mlp_.backward(d_shared_, ctx, defer), st);
}

}  // namespace mt
