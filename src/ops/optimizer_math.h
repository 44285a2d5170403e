// The scalar state updates of ops/optimizer.h shared by both backends (host/device inline
// functions), so that the CPU and CUDA results of optimizer_prepare, loss_scaler_update,
// adamw_step and the fp32 <-> (bf16, int16 remainder) split and merge are bitwise identical.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"  // MT_HD
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/optimizer.h"

namespace mt {
namespace detail {

MT_HD bool is_finite_f32(float x) {
#ifdef __CUDA_ARCH__
  return isfinite(x);
#else
  return std::isfinite(x);
#endif
}

/// optimizer_prepare on the struct (see ops/optimizer.h).
MT_HD void optimizer_prepare_state(OptimizerScalars& s, float clip_grad) {
  const bool finite = is_finite_f32(s.grad_sumsq);
  // Non-finite: +inf or one canonical NaN (NaN payloads differ between host and device sqrt).
  s.grad_norm = finite ? sqrtf(s.grad_sumsq) : (s.grad_sumsq > 0.f ? INFINITY : NAN);
  s.found_inf = finite ? 0 : 1;
  s.clip_coeff = clip_grad > 0.f ? fminf(1.f, clip_grad / (s.grad_norm + 1e-6f)) : 1.f;
  s.step += s.found_inf ? 0 : 1;
}

/// loss_scaler_update on the struct: Megatron's DynamicGradScaler.update (see ops/optimizer.h).
MT_HD void loss_scaler_update_state(OptimizerScalars& s, const LossScalerConfig& cfg) {
  if (cfg.dynamic) {
    if (s.found_inf) {
      s.growth_tracker = 0;
      s.hysteresis_tracker -= 1;
      if (s.hysteresis_tracker <= 0) s.loss_scale = fmaxf(s.loss_scale * cfg.backoff_factor, cfg.min_scale);
    } else {
      s.growth_tracker += 1;
      if (s.growth_tracker == cfg.growth_interval) {
        s.growth_tracker = 0;
        s.hysteresis_tracker = cfg.hysteresis;
        s.loss_scale = s.loss_scale * cfg.growth_factor;
      }
    }
  }
  s.skipped_iters += s.found_inf ? 1 : 0;
  s.grad_sumsq = 0.f;
}

/// Per-step AdamW coefficients derived from the hyper-parameters and the scalars.
struct AdamWCoeffs {
  float inv_scale;  ///< 1 / loss_scale; g = grad * inv_scale * clip
  float clip;       ///< clip_coeff
  float bc1, bc2;  ///< 1 - beta^t, computed in double, rounded to fp32
  float lr;        ///< *h.lr_ptr when set (device memory: read when the kernel runs), else h.lr
};

MT_HD AdamWCoeffs adamw_coeffs(const AdamWHyper& h, const OptimizerScalars& s) {
  AdamWCoeffs c;
  c.inv_scale = 1.f / s.loss_scale;
  c.clip = s.clip_coeff;
  c.lr = h.lr_ptr != nullptr ? *h.lr_ptr : h.lr;
  c.bc1 = static_cast<float>(1.0 - pow(static_cast<double>(h.beta1), static_cast<double>(s.step)));
  c.bc2 = static_cast<float>(1.0 - pow(static_cast<double>(h.beta2), static_cast<double>(s.step)));
  return c;
}

/// One AdamW element update (decoupled weight decay, adam_w_mode of apex's FusedAdam). The
/// multiply-adds are explicit fmaf so that no compiler contracts them differently in the scalar
/// and the vectorised kernel paths (or on the CPU): every path gives the same bits.
MT_HD void adamw_element(float& p, float grad, float& m, float& v, const AdamWHyper& h, const AdamWCoeffs& c) {
  if (h.precomputed_update) {  // Muon's update (AdamWHyper::precomputed_update)
    p = fmaf(-c.lr, fmaf(h.weight_decay, p, grad), p);
    return;
  }
  const float g = grad * c.inv_scale * c.clip;
  m = fmaf(h.beta1, m, (1.f - h.beta1) * g);
  v = fmaf(h.beta2, v, ((1.f - h.beta2) * g) * g);
  const float denom = sqrtf(v / c.bc2) + h.eps;
  const float update = fmaf(h.weight_decay, p, (m / c.bc1) / denom);
  p = fmaf(-c.lr, update, p);
}

/// fp32 -> (bf16 bits, int16 remainder), the scheme of TransformerEngine's FusedAdam with
/// store_param_remainders (Megatron's --use-precision-aware-optimizer, bf16 parameters, fp32 main
/// parameters): with u the fp32 bits, hi = u >> 16, lo = u & 0xFFFF; hi += 1 when lo >= 0x8000
/// (so the bf16 value is x rounded to nearest, ties away from zero in magnitude: it differs from
/// the round-to-nearest-even cast only at exact ties, lo == 0x8000 with hi even); remainder =
/// (int16) lo, negative exactly when hi was incremented. The 16-bit arithmetic wraps, so the pair
/// determines every 32-bit pattern (NaN and inf included) exactly: see merge_f32_remainder.
MT_HD void split_f32_remainder(float x, uint16_t& hi, int16_t& remainder) {
  const uint32_t u = f32_to_bits(x);
  const uint32_t lo = u & 0xFFFFu;
  hi = static_cast<uint16_t>((u >> 16) + (lo >= 0x8000u ? 1u : 0u));
  remainder = static_cast<int16_t>(static_cast<uint16_t>(lo));
}

/// (bf16 bits, int16 remainder) -> the fp32 value split_f32_remainder split (exact inverse):
/// hi -= 1 when the remainder is negative, u = (hi << 16) | (uint16) remainder.
MT_HD float merge_f32_remainder(uint16_t hi, int16_t remainder) {
  const uint32_t h = (static_cast<uint32_t>(hi) - (remainder < 0 ? 1u : 0u)) & 0xFFFFu;
  return bits_to_f32((h << 16) | static_cast<uint32_t>(static_cast<uint16_t>(remainder)));
}

}  // namespace detail

}  // namespace mt
