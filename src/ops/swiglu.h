// SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): the gated linear unit with SiLU,
// as Megatron's MLP computes it with --swiglu (gated_linear_unit=True, activation_func=silu):
// x = torch.chunk(x, 2, dim=-1); y = silu(x[0]) * x[1]. The fc1 output holds, per row, the gate
// half first and the linear half second. Computed in fp32 (ops/swiglu_math.h).
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// y[..., j] = silu(x[..., j]) * x[..., f + j] for j < f, silu(a) = a * sigmoid(a).
/// x: [..., 2f] (act dtype, contiguous, last dim even and >= 2); y: [..., f] (same leading
/// shape and dtype, contiguous; must not overlap x). fp32 on CPU; fp32, bf16 or fp16 on CUDA.
/// Errors: mt::Error on shape/dtype/device mismatch, an odd or zero last dimension of x, or a
/// non-contiguous tensor.
void swiglu_forward(const Tensor& y, const Tensor& x, const Stream& stream);

/// dx[..., j] = dy[..., j] * x[..., f + j] * silu'(x[..., j]) (gate half) and
/// dx[..., f + j] = dy[..., j] * silu(x[..., j]) (linear half), overwritten;
/// silu'(a) = sigmoid(a) (1 + a (1 - sigmoid(a))).
/// dx: [..., 2f] like x; dy: [..., f] like y; dx must not overlap dy or x. Errors: as forward.
void swiglu_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const Stream& stream);

MT_OP_BACKENDS(swiglu_forward)
MT_OP_BACKENDS(swiglu_backward)

}  // namespace mt
