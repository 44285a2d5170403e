// The scalar GELU formulas (tanh approximation), shared verbatim by the CPU and CUDA code so both
// compute the same fp32 expressions.
#pragma once
#include <cmath>

#include "core/dtype.h"  // MT_HD

namespace mt {
namespace gelu_math {
inline constexpr float kSqrt2OverPi = 0.7978845608028654f;
inline constexpr float kCoeff = 0.044715f;

/// gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), fp32, evaluated in this order by
/// ops/gelu.h and by the linear+GELU fallbacks of both backends (ops/matmul.h, the cuBLASLt GELU
/// epilogue's definition): an activation recomputed from a GEMM's kept pre-activation is the
/// fallback's bit for bit.
MT_HD float gelu(float x) { return 0.5f * x * (1.f + tanhf(kSqrt2OverPi * (x + kCoeff * x * x * x))); }
/// gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2), t = tanh(u).
MT_HD float gelu_grad(float x) {
  const float u = kSqrt2OverPi * x * (1.0f + kCoeff * x * x);
  const float t = tanhf(u);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * (kSqrt2OverPi * (1.0f + 3.0f * kCoeff * x * x));
}
}  // namespace gelu_math

}  // namespace mt
