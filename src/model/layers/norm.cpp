#include "model/layers/norm.h"

#include "model/layers/parallel_params.h"
#include "ops/layernorm.h"
#include "ops/rmsnorm.h"

namespace mt {

Norm::Norm(const TransformerConfig& c, std::string prefix, int64_t h, TpGradSum grad_sum, ParamRegistry& reg)
    : kind_(c.normalization), eps_(c.norm_epsilon) {
  reg.declare(replicated_param(prefix + ".weight", {h}, InitKind::kOnes, 0.f, grad_sum), &weight_);
  if (kind_ == Normalization::kLayerNorm)
    reg.declare(replicated_param(prefix + ".bias", {h}, InitKind::kZeros, 0.f, grad_sum), &bias_);
}

void Norm::plan(BufferPlanner& p, int64_t rows) {
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  if (kind_ == Normalization::kLayerNorm) saved_[a].mean = p.saved(DType::kF32, {rows}, "norm mean");
  saved_[a].rstd = p.saved(DType::kF32, {rows}, "norm rstd");
}

void Norm::forward(const Tensor& y, const Tensor& x, const StepContext& ctx) {
  const Saved& s = saved_.at(static_cast<size_t>(ctx.slot));
  if (kind_ == Normalization::kLayerNorm) {
    layernorm_forward(y, s.mean, s.rstd, x, weight_.value(), bias_.value(), eps_, ctx.stream);
  } else {
    rmsnorm_forward(y, s.rstd, x, weight_.value(), eps_, ctx.stream);
  }
}

void Norm::backward(const Tensor& dx, const Tensor& dy, const Tensor& x, bool accumulate_dx, const StepContext& ctx) {
  const Saved& s = saved_.at(static_cast<size_t>(ctx.slot));
  if (kind_ == Normalization::kLayerNorm) {
    layernorm_backward(dx, weight_.grad(), bias_.grad(), dy, x, weight_.value(), s.mean, s.rstd, accumulate_dx,
                       ctx.stream);
  } else {
    rmsnorm_backward(dx, weight_.grad(), dy, x, weight_.value(), s.rstd, accumulate_dx, ctx.stream);
  }
}

}  // namespace mt
