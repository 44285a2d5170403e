// LayerNorm over the last dimension (Ba et al. 2016; Megatron's FusedLayerNorm semantics).
// Statistics in fp32.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// zero_centered_gamma (Megatron's --apply-layernorm-1p, TransformerConfig::
/// layernorm_zero_centered_gamma; TransformerEngine's zero_centered_gamma): the scale is 1 + weight,
/// the 1 added in fp32 when the weight is read (not rounded to the weight's dtype); the gradients
/// (dweight = d/d(1 + weight)) are the same expressions.
/// y = (x - mean) * rstd * weight + bias, rows of length h (weight: 1 + weight with zero_centered_gamma).
/// x, y: [n, h] (act dtype; any leading shape flattened to n rows); weight, bias: [h] (param
/// dtype = act dtype); mean, rstd: fp32 [n] (any shape with n elements), written for backward.
/// rstd = 1/sqrt(var + eps), var the biased variance (two-pass: mean, then centred sum).
/// Act dtype: fp32 on CPU; fp32, bf16 or fp16 on CUDA (fp32 math). Errors: mt::Error on
/// shape/dtype/device mismatch or eps < 0.
void layernorm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& weight, const Tensor& bias, float eps, const Stream& stream,
                       bool zero_centered_gamma = false);

/// dx = d/dx (overwrite, or += when accumulate_dx; act dtype [n, h]);
/// dweight += sum_n dy * xhat, dbias += sum_n dy (fp32 [h] main grads). dx may alias dy.
/// Deterministic on both backends (bitwise the same on every run; on CUDA for a given GPU model):
/// CUDA reduces dweight/dbias per row group into fp32 partial rows in the stream's workspace and
/// adds them in a fixed order (ops/cuda/column_partials.cuh; no float atomics).
/// Errors (CUDA): mt::Error when 2·h fp32 exceed the stream's workspace (h > 4 Mi).
void layernorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                        const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                        bool accumulate_dx, const Stream& stream, bool zero_centered_gamma = false);

MT_OP_BACKENDS(layernorm_forward)
MT_OP_BACKENDS(layernorm_backward)

}  // namespace mt
