// GELU, tanh approximation (Hendrycks & Gimpel 2016; GPT-2, Megatron's gelu_impl):
// gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Computed in fp32.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// y = gelu(x); x, y same shape and dtype (contiguous; y may alias x). fp32 on CPU; fp32, bf16
/// or fp16 on CUDA. Errors: mt::Error on shape/dtype/device mismatch.
void gelu_forward(const Tensor& y, const Tensor& x, const Stream& stream);
/// dx = dy * gelu'(x) (overwrite; dx may alias dy).
void gelu_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const Stream& stream);

MT_OP_BACKENDS(gelu_forward)
MT_OP_BACKENDS(gelu_backward)

}  // namespace mt
