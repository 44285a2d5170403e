// Small element-wise ops: dtype cast, add, scale, fill, and Megatron's fused
// bias-dropout-add (megatron/core/fusions/fused_bias_dropout.py) with counter-RNG dropout.
#pragma once
#include "core/rng.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// dst = (dst dtype) src, element-wise, any pair of fp32/bf16/fp16 (round to nearest even).
/// dst and src need the same number of elements (shapes may differ). cast/add/scale_inplace/fill
/// accept fp32/bf16/fp16 on CPU and CUDA (bit-identical results).
void cast(const Tensor& dst, const Tensor& src, const Stream& stream);
/// y = a + b (same shape and dtype; y may alias a or b).
void add(const Tensor& y, const Tensor& a, const Tensor& b, const Stream& stream);
/// x *= alpha (in place), fp32/bf16/fp16.
void scale_inplace(const Tensor& x, float alpha, const Stream& stream);
/// x[:] = value (fp32/bf16/fp16/int32; for int32, value must be an integer, else mt::Error).
void fill(const Tensor& x, float value, const Stream& stream);

/// Dropout mask of element i (global index = global_offset + local flat index): kept iff the
/// Philox draw of (key, i) >= dropout_threshold(p) (see core/rng.h); kept values scaled 1/(1-p).
/// p = 0 is the identity and draws nothing. p must be in [0, 1) and global_offset >= 0, else
/// mt::Error. Masks are bit-identical on CPU and CUDA. Act dtype: fp32 on CPU; fp32, bf16 or fp16
/// on CUDA (fp32 math).
///
/// out = residual + dropout(x + bias), x/residual/out [n, h] (act dtype; any leading shape,
/// h = last dim), bias [h] or empty. out may alias residual or x.
void bias_dropout_add_forward(const Tensor& out, const Tensor& x, const Tensor& bias, const Tensor& residual,
                              float p, const DropoutKey& key, int64_t global_offset, const Stream& stream);
/// Backward of the above: dx = dropout_mask(dout) (overwrite); dbias += sum_n dx (fp32 [h],
/// may be empty). The residual's gradient is dout itself (identity), so nothing is written for it.
/// dx may alias dout. With p = 0, dx may be empty: dx would equal dout, so the caller uses dout
/// and only dbias is accumulated (mt::Error when dx is empty and p > 0). CUDA: dbias sums dx after rounding to the act dtype,
/// per row group into fp32 partial rows in the stream's workspace, then adds them in a fixed order
/// (ops/cuda/column_partials.cuh): deterministic, no float atomics.
void bias_dropout_add_backward(const Tensor& dx, const Tensor& dbias, const Tensor& dout, float p,
                               const DropoutKey& key, int64_t global_offset, const Stream& stream);
/// y = dropout(x) (y may alias x); backward: dx = dropout(dy) with the same key.
void dropout_forward(const Tensor& y, const Tensor& x, float p, const DropoutKey& key, int64_t global_offset,
                     const Stream& stream);

MT_OP_BACKENDS(cast)
MT_OP_BACKENDS(add)
MT_OP_BACKENDS(scale_inplace)
MT_OP_BACKENDS(fill)
MT_OP_BACKENDS(bias_dropout_add_forward)
MT_OP_BACKENDS(bias_dropout_add_backward)
MT_OP_BACKENDS(dropout_forward)

}  // namespace mt
