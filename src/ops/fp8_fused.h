// Fused FP8 quantisation (docs/fp8.md "Fused quantisation"): the producer of an FP8 GEMM's input
// — RMSNorm before linear_qkv / linear_fc1, SwiGLU before linear_fc2 — writes the tensor's FP8
// bytes and records its amax in the pass that computes it, instead of a second pass
// (fp8_quantize) over its output (Transformer Engine's norm and activation kernels with FP8
// output). The scale must be known before the pass: delayed scaling's scale of the step. Current
// scaling needs the amax of the whole output (all-reduced over its shards) before any element is
// quantised, and blockwise scaling is out of this op's scope, so those recipes keep the separate
// pass (as TE's current scaling does).
//
// The SwiGLU's backward writes linear_fc1's FP8 output gradient the same way.
//
// The result is defined as the unfused composition on the same backend, bit for bit:
//   op(y, ..., x)                               (rmsnorm_forward / swiglu_forward / swiglu_backward:
//                                                y in the act dtype)
//   fp8_quantize(q, q_t, y, scale, amax)        (q = fp8(y · scale) of the STORED y; amax record)
// i.e. the value quantised is y after its rounding to the act dtype, the value the unfused
// quantiser reads back. The CPU backend runs that composition (the reference). On CUDA the RMSNorm
// is the forward kernel of ops/cuda/rmsnorm.cu with an FP8 epilogue; the SwiGLU ops are
// fp8_quantize's cast + transpose kernel (ops/cuda/fp8.cu) computing the activation (or its
// gradient) where it loads its input; y, rstd, dx are those of the unfused CUDA op and q, q_t, amax
// those of the CPU quantiser applied to them (tests/ops/fp8_fused_cuda_test.cpp).
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

MT_OP_BACKENDS(fp8_rmsnorm_forward)
MT_OP_BACKENDS(fp8_swiglu_forward)
MT_OP_BACKENDS(fp8_swiglu_backward)

}  // namespace mt
