// Fused FP8 quantisation (docs/fp8.md "Fused quantisation"): the producer of an FP8 GEMM's input
// — RMSNorm before linear_qkv / linear_fc1, SwiGLU or GELU before linear_fc2 — writes the tensor's FP8
// bytes and records its amax in the pass that computes it, instead of a second pass
// (fp8_quantize) over its output (Transformer Engine's norm and activation kernels with FP8
// output). The scale must be known before the pass: delayed scaling's scale of the step. Current
// scaling needs the amax of the whole output (all-reduced over its shards) before any element is
// quantised, and blockwise scaling is out of this op's scope, so those recipes keep the separate
// pass (as TE's current scaling does).
//
// The SwiGLU's backward, or the GELU's with fc1's bias gradient, writes linear_fc1's FP8 output
// gradient the same way.
//
// The result is defined as the unfused composition on the same backend, bit for bit:
//   op(y, ..., x)                               (rmsnorm_forward / swiglu_forward / swiglu_backward /
//                                                gelu_forward / gelu_backward: y in the act dtype)
//   fp8_quantize(q, q_t, y, scale, amax)        (q = fp8(y · scale) of the STORED y; amax record)
// i.e. the value quantised is y after its rounding to the act dtype, the value the unfused
// quantiser reads back. The CPU backend runs that composition (the reference). On CUDA the RMSNorm
// is the forward kernel of ops/cuda/rmsnorm.cu with an FP8 epilogue; the SwiGLU and GELU ops are
// tile kernels of fp8_quantize's cast + transpose layout (ops/cuda/fp8.cu) computing the activation
// (or its gradient) where they load their input; y, rstd, dx are those of the unfused CUDA op and
// q, q_t, amax those of the CPU quantiser applied to them (tests/ops/fp8_fused_cuda_test.cpp). The
// GELU backward's bias gradient is the one exception to "the unfused op's bits": its CUDA sum runs
// in the tile kernel's own order, which fp8_gelu_backward without FP8 outputs shares.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// rmsnorm_forward(y, rstd, x, weight, eps, zero_centered_gamma) (ops/rmsnorm.h) and, in the same
/// pass, q[r, c] = fp8(y[r, c] · scale[0]) (the stored y; fp8_quantize's rounding, saturation and
/// NaN code) and amax[0] = max(amax[0], max |y|) when amax is given (the delayed-scaling record;
/// NaN passed over). x, y: [..., h] contiguous (no strided rows here), act dtype (fp32 on CPU;
/// fp32, bf16 or fp16 on CUDA); q: x's shape, kF8E4M3 or kF8E5M2; scale, amax: fp32, one element
/// (amax empty: not recorded; else it must hold a value >= 0). Errors: mt::Error on shape,
/// dtype, device or contiguity mismatches, eps < 0.
void fp8_rmsnorm_forward(const Tensor& y, const Tensor& q, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                         float eps, const Tensor& scale, const Tensor& amax, const Stream& stream,
                         bool zero_centered_gamma = false);

/// swiglu_forward(y, x) (ops/swiglu.h) and, in the same pass, the FP8 copies of its stored output
/// with scale[0] — q [..., f] = fp8(y · scale) and its transpose q_t [f, rows] (the cast +
/// transpose of fp8_quantize, rows = numel(y) / f) — and the amax record, as fp8_rmsnorm_forward.
/// y may be empty: not written (the value quantised is still y rounded to x's dtype, what y would
/// hold), e.g. for linear_fc2, whose backward reads only the saved q_t. q or q_t may be empty (not
/// written), not both. x: [..., 2f] (gate half, then linear half). Errors: as swiglu_forward, and
/// q / q_t / scale / amax as fp8_quantize; CUDA: more than 65535 · 128 rows.
void fp8_swiglu_forward(const Tensor& y, const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale,
                        const Tensor& amax, const Stream& stream);

/// swiglu_backward(dx, dy, x) (ops/swiglu.h) stored in x's dtype, then quantised as fp8_quantize
/// (dq, dq_t, dx, scale, amax) — in one pass, without writing dx: the output gradient of
/// linear_fc1 in FP8 (its dgrad reads dq, its wgrad dq_t; Transformer Engine's dswiglu with FP8
/// output). dy: [..., f]; x: [..., 2f]; dq: x's shape, dq_t: [2f, rows] (either may be empty, not
/// both), kF8E4M3 or kF8E5M2; scale, amax as fp8_quantize. Errors: as swiglu_backward and
/// fp8_quantize.
void fp8_swiglu_backward(const Tensor& dq, const Tensor& dq_t, const Tensor& dy, const Tensor& x, const Tensor& scale,
                         const Tensor& amax, const Stream& stream);

/// y = gelu(pre) (ops/gelu.h, of the stored pre) and, in the same pass, the FP8 copies of the stored
/// y with scale[0] — q [..., f] and q_t [f, rows] — and the amax record, as fp8_swiglu_forward: a
/// GPT-style MLP's GELU writing linear_fc2's FP8 input from linear_fc1's output (its bias added in
/// fc1's GEMM epilogue; Transformer Engine's GELU with FP8 output). Bitwise fp8_bias_gelu(pre, {},
/// y) then fp8_quantize. pre: [..., f], act dtype, contiguous, read only; y: pre's shape and dtype,
/// or empty (not written; the value quantised is still y rounded to pre's dtype); q / q_t as
/// fp8_swiglu_forward (either may be empty, not both); scale, amax as fp8_quantize. Errors:
/// mt::Error on shape, dtype, device or contiguity mismatches, y aliasing pre; CUDA: more than
/// 65535 · 128 rows.
void fp8_gelu_forward(const Tensor& y, const Tensor& q, const Tensor& q_t, const Tensor& pre, const Tensor& scale,
                      const Tensor& amax, const Stream& stream);

/// The GELU's backward for an FP8 linear_fc1 (Transformer Engine's dbias-dGELU with FP8 output), in
/// one pass: d = gelu_backward(dy, pre) (ops/gelu.h: dy · gelu'(pre)) stored in pre's dtype, written
/// to dx; dbias += Σ_rows d (fp32 [f]: fc1's bias gradient, of the stored d); and its FP8 copies
/// fp8_quantize(dq, dq_t, d, scale, amax). dx, dbias and the pair (dq, dq_t) may each be empty (not
/// written), not all three; without dq / dq_t, scale and amax must be empty (the recipes that
/// quantise dL/dpre themselves: the GELU backward and the bias gradient only). dy, pre, dx: [..., f]
/// act dtype, contiguous; dx may alias dy. The bias gradient's summation order depends only on
/// the shape — CUDA: per 128-row tile (8 row lanes of 16 rows each, in row order, added lane by
/// lane), then the tiles' partial rows in add_column_partials' order (ops/cuda/column_partials.cuh);
/// CPU: row order — so the fused call and the unfused one (dx, no FP8 copies) give the same bits on
/// a backend. Errors: as fp8_gelu_forward; dq / dq_t [f, rows] as fp8_swiglu_backward's.
void fp8_gelu_backward(const Tensor& dx, const Tensor& dq, const Tensor& dq_t, const Tensor& dbias, const Tensor& dy,
                       const Tensor& pre, const Tensor& scale, const Tensor& amax, const Stream& stream);

MT_OP_BACKENDS(fp8_rmsnorm_forward)
MT_OP_BACKENDS(fp8_swiglu_forward)
MT_OP_BACKENDS(fp8_swiglu_backward)
MT_OP_BACKENDS(fp8_gelu_forward)
MT_OP_BACKENDS(fp8_gelu_backward)

}  // namespace mt
