// Small element-wise ops: dtype cast, add, scale, fill, and Megatron's fused
// bias-dropout-add (megatron/core/fusions/fused_bias_dropout.py) with counter-RNG dropout.
#pragma once
#include "core/rng.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace mt {

/// dst = (dst dtype) src, element-wise, any pair of fp32/bf16/fp16 (round to nearest even).
void cast(const Tensor& dst, const Tensor& src, const Stream& stream);
/// y = a + b (same shape and dtype; y may alias a or b).
void add(const Tensor& y, const Tensor& a, const Tensor& b, const Stream& stream);
/// x *= alpha (in place), fp32/bf16/fp16.
void scale_inplace(const Tensor& x, float alpha, const Stream& stream);
/// x[:] = value (fp32/bf16/fp16/int32).
void fill(const Tensor& x, float value, const Stream& stream);

/// Dropout mask of element i (global index = global_offset + local flat index): kept iff the
/// Philox draw of (key, i) >= dropout_threshold(p) (see core/rng.h); kept values scaled 1/(1-p).
/// p = 0 is the identity and draws nothing.
///
/// out = residual + dropout(x + bias), x/residual/out [n, h] (act dtype), bias [h] or empty.
/// out may alias residual.
void bias_dropout_add_forward(const Tensor& out, const Tensor& x, const Tensor& bias, const Tensor& residual,
                              float p, const DropoutKey& key, int64_t global_offset, const Stream& stream);
/// Backward of the above: dx = dropout_mask(dout) (overwrite); dbias += sum_n dx (fp32 [h],
/// may be empty). The residual's gradient is dout itself (identity), so nothing is written for it.
void bias_dropout_add_backward(const Tensor& dx, const Tensor& dbias, const Tensor& dout, float p,
                               const DropoutKey& key, int64_t global_offset, const Stream& stream);
/// y = dropout(x) (y may alias x); backward: dx = dropout(dy) with the same key.
void dropout_forward(const Tensor& y, const Tensor& x, float p, const DropoutKey& key, int64_t global_offset,
                     const Stream& stream);

}  // namespace mt
