#include "model/layers/norm.h"

#include "model/layers/linear.h"
#include "model/layers/parallel_params.h"
#include "ops/fp8_fused.h"

namespace mt {

Norm::Norm(const TransformerConfig& c, std::string prefix, int64_t h, TpGradSum grad_sum, ParamRegistry& reg)
    : kind_(norm_kind(c.normalization)), eps_(c.norm_epsilon), zero_centered_gamma_(c.layernorm_zero_centered_gamma) {
  // --apply-layernorm-1p: the weight is the scale minus 1, initialised to 0 (Megatron's
  // FusedLayerNorm.reset_parameters with zero_centered_gamma).
  reg.declare(replicated_param(prefix + ".weight", {h}, zero_centered_gamma_ ? InitKind::kZeros : InitKind::kOnes, 0.f,
                               grad_sum),
              &weight_);
  if (kind_.has_bias) reg.declare(replicated_param(prefix + ".bias", {h}, InitKind::kZeros, 0.f, grad_sum), &bias_);
}

void Norm::plan(BufferPlanner& p, int64_t rows) {
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  if (kind_.saves_mean) saved_[a].mean = p.saved(DType::kF32, {rows}, "norm mean");
  saved_[a].rstd = p.saved(DType::kF32, {rows}, "norm rstd");
}

void Norm::forward(const Tensor& y, const Tensor& x, const StepContext& ctx) {
  const Saved& s = saved_.at(static_cast<size_t>(ctx.slot));
  kind_.forward(y, s.mean, s.rstd, x, weight_.value(), value_or_empty(bias_), eps_, ctx.stream,
                zero_centered_gamma_);
}

bool Norm::writes_fp8() const { return kind_.kind == Normalization::kRMSNorm; }

void Norm::forward_fp8(const Tensor& y, const Tensor& q, const Tensor& scale, const Tensor& record, const Tensor& x,
                       const StepContext& ctx) {
  MT_CHECK(writes_fp8(), "a {} has no FP8 output (only RMSNorm's is fused)", kind_.names.name);
  const Saved& s = saved_.at(static_cast<size_t>(ctx.slot));
  fp8_rmsnorm_forward(y, q, s.rstd, x, weight_.value(), eps_, scale, record, ctx.stream, zero_centered_gamma_);
}

void Norm::backward(const Tensor& dx, const Tensor& dy, const Tensor& x, bool accumulate_dx, const StepContext& ctx) {
  const Saved& s = saved_.at(static_cast<size_t>(ctx.slot));
  kind_.backward(dx, weight_.grad(), grad_or_empty(bias_), dy, x, weight_.value(), s.mean, s.rstd, accumulate_dx,
                 ctx.stream, zero_centered_gamma_);
}

}  // namespace mt
