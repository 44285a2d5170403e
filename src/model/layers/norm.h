// Normalisation submodule (Megatron-Core's FusedLayerNorm / RMSNorm as chosen by
// TransformerConfig::normalization; Ba et al. 2016, Zhang & Sennrich 2019) over the last dimension
// h, built from the kind's entry of model/variants.h (NormKind: parameters, saved statistics, ops).
// Parameters: <prefix>.weight [h] (ones; zeros with --apply-layernorm-1p, the scale then 1 + weight) and, when the kind has one (LayerNorm), <prefix>.bias [h]
// (zeros), both replicated over tensor parallelism. Saved: the fp32 row statistics (rstd, and the
// mean for LayerNorm) per activation area. Rows may be a strided view (the q/k heads of the fused
// QKV output) where the op allows it (NormKind::strided_rows).
#pragma once
#include <string>
#include <vector>

#include "model/module.h"
#include "model/transformer_config.h"

namespace mt {

class Norm {
 public:
  /// grad_sum: how the replicated parameters' gradients combine over TP (model/params.h).
  Norm(const TransformerConfig& config, std::string prefix, int64_t h, TpGradSum grad_sum, ParamRegistry& registry);
  Norm(const Norm&) = delete;
  Norm& operator=(const Norm&) = delete;

  /// Plans the statistics of `rows` rows in the open area.
  void plan(BufferPlanner& planner, int64_t rows);
  /// y = norm(x): x, y [rows, h] (act dtype; y may alias x where the op allows).
  void forward(const Tensor& y, const Tensor& x, const StepContext& ctx);
  /// Whether forward_fp8 applies: RMSNorm (LayerNorm with an FP8 output is not built).
  bool writes_fp8() const;
  /// forward and, in the same pass, q = fp8(y · scale) of the stored y with its amax recorded
  /// (ops/fp8_fused.h fp8_rmsnorm_forward: the delayed-scaling input of the next FP8 linear,
  /// Fp8Linear::FusedInput). q: y's shape; scale, record: fp32 [1] (record empty: none).
  /// Errors: mt::Error unless writes_fp8().
  void forward_fp8(const Tensor& y, const Tensor& q, const Tensor& scale, const Tensor& record, const Tensor& x,
                   const StepContext& ctx);
  /// dx = d/dx (overwrite, or += with accumulate_dx) from dy and the forward's input x; weight
  /// (and bias) gradients accumulate.
  void backward(const Tensor& dx, const Tensor& dy, const Tensor& x, bool accumulate_dx, const StepContext& ctx);

 private:
  struct Saved {
    Tensor mean, rstd;  // fp32 [rows]; mean only when kind_.saves_mean
  };
  const NormKind& kind_;
  float eps_;
  bool zero_centered_gamma_;  // --apply-layernorm-1p: the scale is 1 + weight
  ParamRef weight_, bias_;
  std::vector<Saved> saved_;  // per area
};

}  // namespace mt
