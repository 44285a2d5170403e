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
  /// --use-distributed-optimizer (ZeRO-1, Rajbhandari et al. 2020 §5; Megatron's
  /// DistributedOptimizer): data-parallel rank d owns elements [d·N/DP, (d+1)·N/DP) of the flat
  /// buffers. Gradients are reduce-scattered instead of all-reduced, AdamW moments exist only for
  /// the owned shard (optimizer memory / DP), and the updated parameters are all-gathered.
  bool distributed = false;
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
  /// AdamW moments of the owned elements: the whole flat buffer, or [shard_begin(),
  /// shard_begin() + shard_size()) with the distributed optimizer.
  Tensor exp_avg() const { return exp_avg_.as(DType::kF32, {shard_n_}); }
  Tensor exp_avg_sq() const { return exp_avg_sq_.as(DType::kF32, {shard_n_}); }
  int64_t shard_begin() const { return shard_lo_; }
  int64_t shard_size() const { return shard_n_; }
  bool distributed() const { return shard_n_ != params_.total_elements(); }
  /// Checkpoint support: full-length moments. gather: all-gathers the shards into m, v (fp32
  /// [total] on the device; a copy without the distributed optimizer). scatter: takes this
  /// rank's shard of full-length m, v. Both outside a training step.
  void gather_moments(const Tensor& m, const Tensor& v, const Stream& stream) const;
  void scatter_moments(const Tensor& m, const Tensor& v, const Stream& stream);
  const OptimizerConfig& config() const { return config_; }

 private:
  ParamStore& params_;
  OptimizerConfig config_;
  OptimizerGroups groups_;
  Buffer exp_avg_, exp_avg_sq_, scalars_;
  int64_t shard_lo_ = 0, shard_n_ = 0;
  // Flat ranges planned once: counted in the gradient norm on this rank; with / without decay.
  std::vector<ParamStore::Range> norm_ranges_, decay_ranges_, no_decay_ranges_;
  Buffer host_scalars_;  // pinned
};

}  // namespace mt
