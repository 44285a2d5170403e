// The scalar SwiGLU formulas, shared verbatim by the CPU and CUDA code so both compute the same
// fp32 expressions (the CUDA SwiGLU kernels and the fused FP8 SwiGLU of ops/cuda/fp8.cu must
// compile them alike — the same flags, no --use_fast_math in one only — for the fused ops to stay
// bitwise the unfused ones, tests/ops/fp8_fused_cuda_test.cpp) (Shazeer 2020, "GLU Variants Improve Transformer"; Megatron's
// bias_swiglu_impl / swiglu_back without bias).
#pragma once
#include <cmath>

#include "core/dtype.h"  // MT_HD

namespace mt::swiglu_math {

/// sigmoid(a) = 1 / (1 + exp(-a)) (0 for a -> -inf, 1 for a -> +inf; no NaN for finite a).
MT_HD float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }
/// silu(a) = a * sigmoid(a).
MT_HD float silu(float a) { return a * sigmoid(a); }
/// swiglu(a, b) = silu(a) * b: a the gate (first half of the row), b the linear part.
MT_HD float swiglu(float a, float b) { return silu(a) * b; }
/// silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a))).
MT_HD float silu_grad(float a) {
  const float s = sigmoid(a);
  return s * (1.0f + a * (1.0f - s));
}
/// d swiglu / d a times dy: dy * b * silu'(a).
MT_HD float swiglu_grad_gate(float dy, float a, float b) { return dy * b * silu_grad(a); }
/// d swiglu / d b times dy: dy * silu(a).
MT_HD float swiglu_grad_linear(float dy, float a) { return dy * silu(a); }

}  // namespace mt::swiglu_math
