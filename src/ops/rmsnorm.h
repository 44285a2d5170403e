// RMSNorm over the last dimension (Zhang & Sennrich 2019, "Root Mean Square Layer
// Normalization"; Megatron's --normalization RMSNorm as in Llama / Qwen, Apex FusedRMSNorm /
// Transformer Engine RMSNorm semantics, zero_centered_gamma off). Statistics in fp32.
//
// Rows: x, y, dx and dy are [..., h] tensors whose last dimension is contiguous; their rows may
// be strided views (ops/row_map.h), e.g. the query heads of the fused QKV output
// qkv [s·b·g, qpg + 2, d] sliced with qkv.slice(1, 0, qpg) for q/k normalisation in place.
// Each of x, y, dx, dy is addressed through its own RowMap, so they may have different strides.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// zero_centered_gamma (Megatron's --apply-layernorm-1p, TransformerConfig::
/// layernorm_zero_centered_gamma; TransformerEngine's zero_centered_gamma): the scale is 1 + weight,
/// the 1 added in fp32 when the weight is read (not rounded to the weight's dtype); the gradients
/// (dweight = d/d(1 + weight)) are the same expressions.
/// y = x · rstd · weight per row of length h (1 + weight with zero_centered_gamma), with rstd = 1 / sqrt(mean_c(x²) + eps) (fp32).
/// x, y: [..., h] rows (act dtype; last dim contiguous, rows possibly strided, see above; the
///   leading dims are flattened to n rows); y may alias x exactly (same view: normalise in
///   place); any other overlap is undefined.
/// weight: contiguous [h], act dtype. rstd: contiguous fp32 with n elements (any shape), written
///   for backward.
/// Act dtype: fp32 on CPU; fp32, bf16 or fp16 on CUDA (fp32 math, one rounding at the store).
/// Errors: mt::Error on shape/dtype/device mismatch, a last dimension that is not contiguous or
/// leading dimensions that cannot be addressed as rows (ops/row_map.h), or eps < 0.
void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& weight, float eps,
                     const Stream& stream, bool zero_centered_gamma = false);

/// Backward of rmsnorm_forward. With g = weight ∘ dy and xhat = x · rstd (per row):
///   dx = rstd · (g − xhat · mean_c(g ∘ xhat))  =  rstd · g − x · rstd³ · mean_c(g ∘ x)
///   (overwrite, or += when accumulate_dx; act dtype, rows like x),
///   dweight += Σ_rows dy ∘ xhat  (fp32 [h] main gradient, accumulated).
/// Derivation: y_c = x_c r w_c with r = (mean(x²) + eps)^(-1/2), ∂r/∂x_j = −r³ x_j / h, so
///   ∂L/∂x_j = r w_j dy_j − (r³ x_j / h) Σ_c dy_c w_c x_c.
/// dx, dy: same shape and dtype as x, rows possibly strided (own RowMaps); dx may alias dy
/// exactly (same view). rstd: as written by rmsnorm_forward.
/// Deterministic on both backends (bitwise the same on every run; on CUDA for a given GPU model):
/// CPU in a fixed order; CUDA reduces dweight per block into fp32 partial rows in the stream's
/// workspace and adds them in a fixed order (ops/cuda/column_partials.cuh; no float atomics).
/// Errors: as rmsnorm_forward, dweight not a contiguous fp32 [h] tensor, and on CUDA h > 8 Mi (the
/// partial rows would not fit the stream's workspace).
void rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dy, const Tensor& x,
                      const Tensor& weight, const Tensor& rstd, bool accumulate_dx, const Stream& stream,
                      bool zero_centered_gamma = false);

MT_OP_BACKENDS(rmsnorm_forward)
MT_OP_BACKENDS(rmsnorm_backward)

}  // namespace mt
