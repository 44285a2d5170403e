#include "optim/optimizer.h"

#include <cstddef>
#include <algorithm>
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
  const int64_t total = params.total_elements();
  shard_n_ = total;
  if (groups_.distributed && groups_.dp && groups_.dp->size() > 1) {
    const int dp = groups_.dp->size();
    MT_CHECK(total % dp == 0, "flat parameter buffer of {} elements is not padded to data-parallel size {}", total, dp);
    shard_n_ = total / dp;
    shard_lo_ = groups_.dp->rank() * shard_n_;
  }
  const int tp_rank = groups_.tp_rank;
  norm_ranges_ = params.ranges(
      [tp_rank](const ParamInfo& p) { return !p.shared_embedding_copy && (p.tensor_parallel || tp_rank == 0); });
  decay_ranges_ = params.ranges([](const ParamInfo& p) { return p.weight_decay; });
  no_decay_ranges_ = params.ranges([](const ParamInfo& p) { return !p.weight_decay; });
  exp_avg_ = Buffer(params.device(), static_cast<size_t>(shard_n_) * 4);
  exp_avg_sq_ = Buffer(params.device(), static_cast<size_t>(shard_n_) * 4);
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
  const Tensor grads = params_.grads_flat();
  const bool zero = distributed();
  const int64_t lo = shard_lo_, hi = shard_lo_ + shard_n_;
  if (groups_.dp && groups_.dp->size() > 1) {
    if (zero) {
      groups_.dp->reduce_scatter(grads.flat_range(lo, shard_n_), grads, ReduceOp::kSum, stream);
    } else {
      groups_.dp->all_reduce(grads, ReduceOp::kSum, stream);
    }
  }
  // Global norm over the owned elements: TP-split parameters on every rank, replicated ones on
  // TP rank 0 only; then summed over the DP shards (distributed optimizer) and over MP.
  for (const auto& r : norm_ranges_) {
    const int64_t b = std::max(r.begin, lo), e = std::min(r.end, hi);
    if (b < e) grad_sumsq_accumulate(sc, grads.flat_range(b, e - b), stream);
  }
  const Tensor sumsq(static_cast<char*>(scalars_.data()) + offsetof(OptimizerScalars, grad_sumsq), DType::kF32,
                     scalars_.device(), {1});
  if (zero) groups_.dp->all_reduce(sumsq, ReduceOp::kSum, stream);
  if (groups_.mp && groups_.mp->size() > 1) groups_.mp->all_reduce(sumsq, ReduceOp::kSum, stream);
  optimizer_prepare(sc, config_.clip_grad, stream);
  const Tensor main = params_.main_flat();
  const Tensor model = params_.has_separate_main() ? params_.params_flat() : Tensor();
  for (const bool decay : {true, false}) {
    const AdamWHyper hp{lr, config_.beta1, config_.beta2, config_.eps, decay ? config_.weight_decay : 0.f};
    for (const auto& r : decay ? decay_ranges_ : no_decay_ranges_) {
      const int64_t b = std::max(r.begin, lo), e = std::min(r.end, hi);
      if (b >= e) continue;
      const int64_t n = e - b;
      adamw_step(main.flat_range(b, n), grads.flat_range(b, n), exp_avg().flat_range(b - lo, n),
                 exp_avg_sq().flat_range(b - lo, n), model.empty() ? Tensor() : model.flat_range(b, n), hp, sc,
                 stream);
    }
  }
  loss_scaler_update(sc, config_.scaler, stream);
  if (zero) {
    // Every rank needs the whole updated model: all-gather the owned shards (in place).
    const Tensor full = params_.params_flat();
    groups_.dp->all_gather(full, full.flat_range(lo, shard_n_), stream);
    if (params_.has_separate_main()) {  // keep the fp32 main copy whole as well (checkpoints)
      const Tensor m = params_.main_flat();
      groups_.dp->all_gather(m, m.flat_range(lo, shard_n_), stream);
    }
  }
}

void AdamWOptimizer::gather_moments(const Tensor& m, const Tensor& v, const Stream& stream) const {
  if (!distributed()) {
    copy(m, exp_avg(), stream);
    copy(v, exp_avg_sq(), stream);
    return;
  }
  copy(m.flat_range(shard_lo_, shard_n_), exp_avg(), stream);
  copy(v.flat_range(shard_lo_, shard_n_), exp_avg_sq(), stream);
  groups_.dp->all_gather(m, m.flat_range(shard_lo_, shard_n_), stream);
  groups_.dp->all_gather(v, v.flat_range(shard_lo_, shard_n_), stream);
}

void AdamWOptimizer::scatter_moments(const Tensor& m, const Tensor& v, const Stream& stream) {
  copy(exp_avg(), m.flat_range(shard_lo_, shard_n_), stream);
  copy(exp_avg_sq(), v.flat_range(shard_lo_, shard_n_), stream);
}

}  // namespace mt
