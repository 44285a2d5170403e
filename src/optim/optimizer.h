// AdamW over the flat fp32 main parameters with fp32 moments, global-norm clipping and the
// loss scaler, all on the device (Megatron's MixedPrecisionOptimizer / FP32Optimizer roles).
// The whole step is stream-ordered with no host sync; its results (grad norm, found_inf,
// loss scale, skipped count) stay in a device struct read at log intervals.
#pragma once
#include "comm/communicator.h"
#include "core/buffer.h"
#include "model/params.h"
#include "ops/optimizer.h"

namespace mt {

struct OptimizerConfig {
  float beta1 = 0.9f;          ///< --adam-beta1
  float beta2 = 0.999f;        ///< --adam-beta2
  float eps = 1e-8f;           ///< --adam-eps
  float weight_decay = 0.01f;  ///< --weight-decay (not applied to biases and norm weights)
  float clip_grad = 1.0f;      ///< --clip-grad (0 = off)
  LossScalerConfig scaler{};
};

/// The groups the optimizer reduces over. dp: gradients are summed over it before the step
/// (each rank's loss gradient already carries 1/dp). mp: the gradient norm's sum of squares is
/// summed over it (tensor · pipeline parallel); parameters replicated over TP count on TP rank 0
/// only (tp_rank).
struct OptimizerGroups {
  std::shared_ptr<Communicator> dp, mp;
  int tp_rank = 0;
};

class AdamWOptimizer {
 public:
  AdamWOptimizer(ParamStore& params, const OptimizerConfig& config, const Stream& stream,
                 OptimizerGroups groups = {});

  /// One optimizer step at learning rate `lr` on the gradients accumulated in params: reduce
  /// gradients over DP, global norm (over MP), clip, AdamW, loss-scaler update.
  void step(float lr, const Stream& stream);
  /// Device fp32 [1] view of the current loss scale (multiplies the loss gradient).
  Tensor loss_scale_tensor() const;
  /// Device struct as a uint8 tensor.
  Tensor scalars() const { return scalars_.as(DType::kU8, {static_cast<int64_t>(sizeof(OptimizerScalars))}); }
  /// Copies the scalars to the host and waits: call at log intervals only.
  OptimizerScalars read_scalars_sync(const Stream& stream) const;
  void write_scalars(const OptimizerScalars& s, const Stream& stream);
  Tensor exp_avg() const { return exp_avg_.as(DType::kF32, {params_.total_elements()}); }
  Tensor exp_avg_sq() const { return exp_avg_sq_.as(DType::kF32, {params_.total_elements()}); }
  const OptimizerConfig& config() const { return config_; }

 private:
  ParamStore& params_;
  OptimizerConfig config_;
  OptimizerGroups groups_;
  Buffer exp_avg_, exp_avg_sq_, scalars_;
  Buffer host_scalars_;  // pinned
};

}  // namespace mt
