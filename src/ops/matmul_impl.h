// Backend entry points of ops/matmul.h. Arguments were validated by ops/matmul.cpp (shapes,
// dtypes, devices, contiguity); the implementations only re-check what is backend-specific
// (the CPU backend is fp32-only).
#pragma once
#include <cmath>

#include "ops/matmul.h"

namespace mt {
namespace cpu {
void matmul(const Tensor& c, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, float alpha, float beta,
            const Stream& stream);
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& pre_gelu,
                    const Stream& stream);
void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor& dbias, const Tensor& dy, const Tensor& x,
                     const Tensor& w, const Stream& stream);
}  // namespace cpu
namespace cuda {
void matmul(const Tensor& c, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, float alpha, float beta,
            const Stream& stream);
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& pre_gelu,
                    const Stream& stream);
void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor& dbias, const Tensor& dy, const Tensor& x,
                     const Tensor& w, const Stream& stream);
}  // namespace cuda

/// GELU, tanh approximation, as in ops/gelu.h (shared by the linear+GELU fallbacks of both
/// backends so that they agree with the cuBLASLt GELU epilogue's definition).
MT_HD float linear_gelu(float x) {
  constexpr float kC = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * x * (1.f + tanhf(kC * (x + 0.044715f * x * x * x)));
}

}  // namespace mt
