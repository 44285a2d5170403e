// Argument validation and backend dispatch for ops/optimizer.h.
#include "ops/optimizer.h"

#include <algorithm>
#include <string>
#include <utility>

#include "ops/dispatch.h"
#include "ops/optimizer_math.h"

namespace mt {
namespace {

void check_scalars(const Tensor& scalars, const Stream& stream, const char* fn) {
  MT_CHECK(scalars.dtype() == DType::kU8 && scalars.ndim() == 1 &&
               scalars.numel() == static_cast<int64_t>(sizeof(OptimizerScalars)) && scalars.is_contiguous(),
           "{}: scalars must be a contiguous uint8 [{}] tensor (sizeof(OptimizerScalars)), got {}", fn,
           sizeof(OptimizerScalars), scalars.str());
  MT_CHECK(reinterpret_cast<uintptr_t>(scalars.data()) % alignof(OptimizerScalars) == 0,
           "{}: scalars pointer {} not aligned to {} bytes", fn, scalars.data(), alignof(OptimizerScalars));
  MT_CHECK(stream.device() == scalars.device(), "{}: stream on {} but scalars on {}", fn, stream.device().str(),
           scalars.device().str());
}

/// main_param: fp32, or int16 remainders beside a bf16 model_param (remainder storage).
void check_main_param(const Tensor& main_param, const Tensor& model_param, const char* fn) {
  if (main_param.dtype() == DType::kI16) {
    MT_CHECK(!model_param.empty() && model_param.dtype() == DType::kBF16,
             "{}: int16 main_param (fp32 main parameters stored as remainders, --use-precision-aware-optimizer) "
             "needs the bf16 model_param holding their high bits, got {}",
             fn, model_param.empty() ? std::string("none") : model_param.str());
    check_tensor(main_param, DType::kI16, {-1}, "main_param");
  } else {
    check_tensor(main_param, DType::kF32, {-1}, "main_param");
  }
}

/// The tensors of split_param_remainders / merge_param_remainders.
void check_remainder_tensors(const Tensor& main_param, const Tensor& model_param, const Tensor& remainders,
                             const Stream& stream, const char* fn) {
  check_tensor(main_param, DType::kF32, {-1}, "main_param");
  const int64_t n = main_param.numel();
  check_tensor(model_param, DType::kBF16, {n}, "model_param");
  if (!remainders.empty()) check_tensor(remainders, DType::kI16, {n}, "remainders");
  check_same_device({&main_param, &model_param, &remainders});
  MT_CHECK(n == 0 || stream.device() == main_param.device(), "{}: stream on {} but tensors on {}", fn,
           stream.device().str(), main_param.device().str());
}

void check_adamw_hyper(const AdamWHyper& hyper) {
  MT_CHECK(hyper.beta1 >= 0.f && hyper.beta1 < 1.f, "adamw: beta1={} not in [0, 1)", hyper.beta1);
  MT_CHECK(hyper.beta2 >= 0.f && hyper.beta2 < 1.f, "adamw: beta2={} not in [0, 1)", hyper.beta2);
  MT_CHECK(hyper.eps > 0.f, "adamw: eps={} must be > 0", hyper.eps);
  MT_CHECK(hyper.lr >= 0.f && hyper.weight_decay >= 0.f, "adamw: lr={} and weight_decay={} must be >= 0", hyper.lr,
           hyper.weight_decay);
}

}  // namespace

OptimizerScalars initial_optimizer_scalars(const LossScalerConfig& cfg) {
  MT_CHECK(cfg.initial_scale > 0.f, "initial loss scale {} must be > 0", cfg.initial_scale);
  OptimizerScalars s{};
  s.grad_sumsq = 0.f;
  s.grad_norm = 0.f;
  s.clip_coeff = 1.f;
  s.loss_scale = cfg.initial_scale;
  s.found_inf = 0;
  s.step = 0;
  s.growth_tracker = 0;
  s.hysteresis_tracker = cfg.hysteresis;
  s.skipped_iters = 0;
  s.pad_ = 0;
  return s;
}

void grad_sumsq_accumulate(const Tensor& scalars, const Tensor& grads, const Stream& stream) {
  check_scalars(scalars, stream, "grad_sumsq_accumulate");
  check_tensor(grads, DType::kF32, {-1}, "grads");
  check_same_device({&scalars, &grads});
  if (grads.numel() == 0) return;
  MT_DISPATCH(scalars.device(), grad_sumsq_accumulate, scalars, grads, stream);
}

void optimizer_prepare(const Tensor& scalars, float clip_grad, const Stream& stream) {
  check_scalars(scalars, stream, "optimizer_prepare");
  MT_CHECK(clip_grad >= 0.f, "clip_grad={} must be >= 0 (0 disables clipping)", clip_grad);
  MT_DISPATCH(scalars.device(), optimizer_prepare, scalars, clip_grad, stream);
}

void adamw_step(const Tensor& main_param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const Tensor& model_param, const AdamWHyper& hyper, const Tensor& scalars, const Stream& stream) {
  check_scalars(scalars, stream, "adamw_step");
  check_main_param(main_param, model_param, "adamw_step");
  const int64_t n = main_param.numel();
  check_tensor(grad, DType::kF32, {n}, "grad");
  check_tensor(exp_avg, DType::kF32, {n}, "exp_avg");
  check_tensor(exp_avg_sq, DType::kF32, {n}, "exp_avg_sq");
  if (!model_param.empty()) {
    MT_CHECK(model_param.dtype() == DType::kBF16 || model_param.dtype() == DType::kF16,
             "model_param: dtype {} must be bf16 or fp16 (leave it empty for fp32 training)",
             dtype_name(model_param.dtype()));
    check_tensor(model_param, model_param.dtype(), {n}, "model_param");
  }
  check_same_device({&scalars, &main_param, &grad, &exp_avg, &exp_avg_sq, &model_param});
  check_adamw_hyper(hyper);
  if (n == 0) return;
  MT_DISPATCH(scalars.device(), adamw_step, main_param, grad, exp_avg, exp_avg_sq, model_param, hyper, scalars,
              stream);
}

AdamWPlan::AdamWPlan(const std::vector<AdamWRun>& runs, Device device, const Stream& stream) {
  std::vector<std::pair<int64_t, int64_t>> mains;
  for (AdamWRun r : runs) {
    if (r.grad < 0) r.grad = r.param;
    MT_CHECK(r.param >= 0 && r.main >= 0 && r.state >= 0 && r.n >= 0,
             "AdamWPlan: run (param {}, main {}, state {}, n {}) has a negative offset or size", r.param, r.main,
             r.state, r.n);
    if (r.n == 0) continue;
    mains.emplace_back(r.main, r.main + r.n);
    param_end_ = std::max(param_end_, r.param + r.n);
    grad_end_ = std::max(grad_end_, r.grad + r.n);
    main_end_ = std::max(main_end_, r.main + r.n);
    state_end_ = std::max(state_end_, r.state + r.n);
    for (int64_t o = 0; o < r.n; o += kAdamWChunk) {
      AdamWRun c = r;
      c.param += o;
      c.grad += o;
      c.main += o;
      c.state += o;
      c.n = std::min(kAdamWChunk, r.n - o);
      chunks_.push_back(c);
    }
  }
  std::sort(mains.begin(), mains.end());
  for (size_t i = 1; i < mains.size(); ++i)
    MT_CHECK(mains[i].first >= mains[i - 1].second, "AdamWPlan: runs overlap in the main parameters at element {}",
             mains[i].first);
  if (chunks_.empty()) return;
  const size_t bytes = chunks_.size() * sizeof(AdamWRun);
  table_ = Buffer(device, bytes);
  copy_bytes(table_.data(), device, chunks_.data(), Device::cpu(), bytes, stream);
  stream.synchronize();  // the host vector may change or go before the copy ran
}

Tensor AdamWPlan::table() const {
  return table_.as(DType::kU8, {static_cast<int64_t>(chunks_.size() * sizeof(AdamWRun))});
}

void adamw_multi_step(const Tensor& main_param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                      const Tensor& model_param, const AdamWPlan& plan, const AdamWHyper& hyper,
                      const Tensor& scalars, const Stream& stream) {
  check_scalars(scalars, stream, "adamw_multi_step");
  check_main_param(main_param, model_param, "adamw_multi_step");
  for (const Tensor* t : {&grad, &exp_avg, &exp_avg_sq}) check_tensor(*t, DType::kF32, {-1}, "adamw_multi_step");
  MT_CHECK(main_param.numel() >= plan.main_end() && grad.numel() >= plan.grad_end() &&
               exp_avg.numel() >= plan.state_end() && exp_avg_sq.numel() >= plan.state_end(),
           "adamw_multi_step: buffers (main {}, grad {}, exp_avg {}, exp_avg_sq {}) shorter than the plan's ranges "
           "(main {}, grad {}, state {})",
           main_param.numel(), grad.numel(), exp_avg.numel(), exp_avg_sq.numel(), plan.main_end(), plan.grad_end(),
           plan.state_end());
  if (!model_param.empty()) {
    MT_CHECK(model_param.dtype() == DType::kBF16 || model_param.dtype() == DType::kF16,
             "model_param: dtype {} must be bf16 or fp16 (leave it empty for fp32 training)",
             dtype_name(model_param.dtype()));
    check_tensor(model_param, model_param.dtype(), {-1}, "model_param");
    MT_CHECK(model_param.numel() >= plan.param_end(), "adamw_multi_step: model_param has {} elements, the plan needs {}",
             model_param.numel(), plan.param_end());
  }
  check_same_device({&scalars, &main_param, &grad, &exp_avg, &exp_avg_sq, &model_param});
  check_adamw_hyper(hyper);
  if (plan.chunks().empty()) return;
  MT_CHECK(plan.table().device() == scalars.device(), "adamw_multi_step: plan on {} but scalars on {}",
           plan.table().device().str(), scalars.device().str());
  MT_DISPATCH(scalars.device(), adamw_multi_step, main_param, grad, exp_avg, exp_avg_sq, model_param, plan, hyper,
              scalars, stream);
}

void split_param_remainders(const Tensor& main_param, const Tensor& model_param, const Tensor& remainders,
                            const Stream& stream) {
  check_remainder_tensors(main_param, model_param, remainders, stream, "split_param_remainders");
  if (main_param.numel() == 0) return;
  MT_DISPATCH(main_param.device(), split_param_remainders, main_param, model_param, remainders, stream);
}

void merge_param_remainders(const Tensor& main_param, const Tensor& model_param, const Tensor& remainders,
                            const Stream& stream) {
  MT_CHECK(!remainders.empty() || main_param.numel() == 0, "merge_param_remainders: remainders missing");
  check_remainder_tensors(main_param, model_param, remainders, stream, "merge_param_remainders");
  if (main_param.numel() == 0) return;
  MT_DISPATCH(main_param.device(), merge_param_remainders, main_param, model_param, remainders, stream);
}

void loss_scaler_update(const Tensor& scalars, const LossScalerConfig& cfg, const Stream& stream) {
  check_scalars(scalars, stream, "loss_scaler_update");
  if (cfg.dynamic) {
    MT_CHECK(cfg.min_scale > 0.f && cfg.growth_factor > 1.f && cfg.backoff_factor > 0.f && cfg.backoff_factor < 1.f,
             "loss scaler: min_scale={} growth_factor={} backoff_factor={} (need > 0, > 1, in (0, 1))",
             cfg.min_scale, cfg.growth_factor, cfg.backoff_factor);
    MT_CHECK(cfg.growth_interval > 0 && cfg.hysteresis > 0, "loss scaler: growth_interval={} and hysteresis={} must be > 0",
             cfg.growth_interval, cfg.hysteresis);
  }
  MT_DISPATCH(scalars.device(), loss_scaler_update, scalars, cfg, stream);
}

}  // namespace mt
