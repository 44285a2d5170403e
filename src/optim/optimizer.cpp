#include "optim/optimizer.h"

#include <cstddef>
#include <cstring>

namespace mt {

AdamWOptimizer::AdamWOptimizer(ParamStore& params, const OptimizerConfig& config, const Stream& stream,
                               OptimizerGroups groups)
    : params_(params), config_(config), groups_(std::move(groups)) {
  MT_REQUIRE(config.beta1 >= 0 && config.beta1 < 1, "--adam-beta1 must be in [0, 1), got {}", config.beta1);
  MT_REQUIRE(config.beta2 >= 0 && config.beta2 < 1, "--adam-beta2 must be in [0, 1), got {}", config.beta2);
  MT_REQUIRE(config.eps > 0, "--adam-eps must be positive, got {}", config.eps);
  MT_REQUIRE(config.weight_decay >= 0, "--weight-decay must be >= 0, got {}", config.weight_decay);
  MT_REQUIRE(config.clip_grad >= 0, "--clip-grad must be >= 0, got {}", config.clip_grad);
  const size_t n = static_cast<size_t>(params.total_elements());
  exp_avg_ = Buffer(params.device(), n * 4);
  exp_avg_sq_ = Buffer(params.device(), n * 4);
  scalars_ = Buffer(params.device(), sizeof(OptimizerScalars));
  host_scalars_ = Buffer(Device::cpu(), sizeof(OptimizerScalars), HostMemory::kPinned);
  memset_tensor(exp_avg(), 0, stream);
  memset_tensor(exp_avg_sq(), 0, stream);
  write_scalars(initial_optimizer_scalars(config.scaler), stream);
}

void AdamWOptimizer::write_scalars(const OptimizerScalars& s, const Stream& stream) {
  std::memcpy(host_scalars_.data(), &s, sizeof(s));
  copy_bytes(scalars_.data(), scalars_.device(), host_scalars_.data(), Device::cpu(), sizeof(s), stream);
  stream.synchronize();
}

OptimizerScalars AdamWOptimizer::read_scalars_sync(const Stream& stream) const {
  copy_bytes(host_scalars_.data(), Device::cpu(), scalars_.data(), scalars_.device(), sizeof(OptimizerScalars),
             stream);
  stream.synchronize();
  OptimizerScalars s;
  std::memcpy(&s, host_scalars_.data(), sizeof(s));
  return s;
}

Tensor AdamWOptimizer::loss_scale_tensor() const {
  char* p = static_cast<char*>(scalars_.data()) + offsetof(OptimizerScalars, loss_scale);
  return Tensor(p, DType::kF32, scalars_.device(), {1});
}

void AdamWOptimizer::step(float lr, const Stream& stream) {
  const Tensor sc = scalars();
  if (groups_.dp && groups_.dp->size() > 1) groups_.dp->all_reduce(params_.grads_flat(), ReduceOp::kSum, stream);
  // Global norm: TP-split parameters on every rank, replicated ones on TP rank 0 only.
  if (groups_.tp_rank == 0) {
    grad_sumsq_accumulate(sc, params_.grads_flat(), stream);
  } else {
    for (const auto& run : params_.runs()) {
      if (run.tensor_parallel)
        grad_sumsq_accumulate(sc, params_.grads_flat().flat_range(run.begin, run.end - run.begin), stream);
    }
  }
  if (groups_.mp && groups_.mp->size() > 1) {
    const Tensor sumsq(static_cast<char*>(scalars_.data()) + offsetof(OptimizerScalars, grad_sumsq), DType::kF32,
                       scalars_.device(), {1});
    groups_.mp->all_reduce(sumsq, ReduceOp::kSum, stream);
  }
  optimizer_prepare(sc, config_.clip_grad, stream);
  const Tensor main = params_.main_flat(), grads = params_.grads_flat();
  const Tensor model = params_.has_separate_main() ? params_.params_flat() : Tensor();
  for (const auto& run : params_.runs()) {
    const int64_t n = run.end - run.begin;
    AdamWHyper hp{lr, config_.beta1, config_.beta2, config_.eps, run.weight_decay ? config_.weight_decay : 0.f};
    adamw_step(main.flat_range(run.begin, n), grads.flat_range(run.begin, n), exp_avg().flat_range(run.begin, n),
               exp_avg_sq().flat_range(run.begin, n), model.empty() ? Tensor() : model.flat_range(run.begin, n), hp,
               sc, stream);
  }
  loss_scaler_update(sc, config_.scaler, stream);
}

}  // namespace mt
