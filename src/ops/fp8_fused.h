// Fused FP8 quantisation (docs/fp8.md "Fused quantisation"): the producer of an FP8 GEMM's input
// — RMSNorm before linear_qkv / linear_fc1, SwiGLU before linear_fc2 — writes the tensor's FP8
// bytes and records its amax in the pass that computes it, instead of a second pass
// (fp8_quantize) over its output (Transformer Engine's norm and activation kernels with FP8
// output). The scale must be known before the pass: delayed scaling's scale of the step. Current
// scaling needs the amax of the whole output (all-reduced over its shards) before any element is
// quantised, and blockwise scaling is out of this op's scope, so those recipes keep the separate
// pass (as TE's current scaling does).
//
// The result is defined as the unfused composition on the same backend, bit for bit:
//   op_forward(y, ..., x)                       (rmsnorm_forward / swiglu_forward: y in the act dtype)
//   fp8_quantize(q, {}, y, scale, amax)         (q = fp8(y · scale) of the STORED y; amax record)
// i.e. the value quantised is y after its rounding to the act dtype, the value the unfused
// quantiser reads back. The CPU backend runs that composition (the reference); the CUDA kernels
// are the forward kernels of ops/cuda/rmsnorm.cu and swiglu.cu with an FP8 epilogue, so y and rstd
// are those of the unfused CUDA op and q, amax those of the CPU quantiser applied to that y
// (tests/ops/fp8_fused_cuda_test.cpp).
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

/// swiglu_forward(y, x) (ops/swiglu.h) and, in the same pass, q = fp8(y · scale[0]) of the stored y
/// and the amax record, as fp8_rmsnorm_forward. x: [..., 2f], y and q: [..., f]. Errors: as
/// swiglu_forward, and q / scale / amax as fp8_rmsnorm_forward.
void fp8_swiglu_forward(const Tensor& y, const Tensor& q, const Tensor& x, const Tensor& scale, const Tensor& amax,
                        const Stream& stream);

MT_OP_BACKENDS(fp8_rmsnorm_forward)
MT_OP_BACKENDS(fp8_swiglu_forward)

}  // namespace mt
