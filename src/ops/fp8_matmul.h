// FP8 matrix product of a linear layer's three GEMMs (docs/fp8.md): both operands FP8 and K-major
// (Hopper's FP8 tensor cores take only the "TN" layout), their dequantisation scales read from
// device memory, fp32 accumulation. CUDA: cuBLASLt (ops/cuda/cublaslt_gemm.h: the shared plan
// cache) with CUBLASLT_MATMUL_DESC_{A,B}_SCALE_POINTER and the scale modes SCALAR_32F,
// VEC128_32F, BLK128x128_32F (cuBLAS >= 12.9, sm_90). CPU: the emulation — the FP8 values are
// exact in fp32, products accumulate in fp32 (OpenBLAS sgemm per 128-wide k block or over all of
// k), then the scales apply as cuBLASLt applies them.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"
#include "ops/fp8.h"

namespace mt {

/// One operand of fp8_matmul: data [rows, k] (rows = m for a, n for b), kF8E4M3 or kF8E5M2,
/// contiguous; scale_inv: fp32, the dequantisation scales (value = data * scale_inv) of
/// fp8_scale_shape(scaling, rows, k) — one element for kTensor.
struct Fp8Operand {
  Tensor data;
  Tensor scale_inv;
  Fp8Scaling scaling = Fp8Scaling::kTensor;
};

/// d[m, n] = sum_k deq(a)[i, k] * deq(b)[j, k], i.e. D = A · Bᵀ with both operands K-major:
///   fprop  y[m, n]  = x[m, k]   · w[n, k]ᵀ      (a = x,    b = w)
///   dgrad  dx[m, k] = dy[m, n]  · (wᵀ)[k, n]ᵀ   (a = dy,   b = w_t, the transposed weight)
///   wgrad  dw[n, k] += (dyᵀ)[n, m] · (xᵀ)[k, m]ᵀ (a = dy_t, b = x_t, accumulate into main_grad)
/// Tensorwise: d = (sa · sb) · Σ_k a·b; blockwise: d = Σ_kb (Σ_{k in kb} a·b) · sa(i, kb) · sb(j, kb)
/// (fused multiply-add per 128-wide k block). Products accumulate in fp32. accumulate: d += the
/// product (beta = 1: the fp32 main gradient, or — tensorwise only — a bf16 d holding the residual:
/// one rounding of d + product), else d is written without being read.
/// fast_accum: cuBLASLt's CUBLASLT_MATMUL_DESC_FAST_ACCUM (TE uses it for the tensorwise fprop
/// GEMM; no promotion of the tensor cores' partial sums; the CPU ignores it), tensorwise only.
/// c: with accumulate, the addend when it is not d itself (cuBLASLt's C ≠ D): d = c + product in
/// one rounding, c only read — [m, n] contiguous, d's dtype, 16-byte aligned (forward_add's
/// residual, saving the copy of it into d). Empty: the addend is d.
/// bias: [n] of d's dtype, contiguous, or empty: d = product (+ c or d) + bias[j] in the same one
/// rounding (cuBLASLt's BIAS epilogue: the linear layers' biases, which otherwise take a pass of
/// their own; the CPU adds it in fp32 last). Tensorwise only. CUDA: the epilogue for a bf16 / fp16
/// d and a 16-byte aligned bias (fp8_bias_epilogue); otherwise, or where cuBLASLt offers no bias
/// kernel for the problem, the bias is added after the GEMM (for a bf16 d a second rounding).
/// m = 0 or n = 0 does nothing; k = 0 gives d = 0 (d unchanged, or = c, with accumulate), + bias.
/// d: [m, n] contiguous, fp32 (CPU) or fp32/bf16 (CUDA). Requirements (cuBLASLt's FP8 rules on
/// sm_90, checked on every backend so that a CPU run catches what a GPU run would reject): m, n, k
/// multiples of 16; 16-byte aligned data pointers; not both operands e5m2; both tensorwise, or both
/// blockwise and not both 128x128 (cuBLASLt has no 2D x 2D kernel; TE's recipe: 1x128 activations
/// and gradients, 128x128 weights). Errors: mt::Error for any violation, or when cuBLASLt offers no
/// algorithm (e.g. block scaling on a GPU or cuBLAS without it).
void fp8_matmul(const Tensor& d, const Fp8Operand& a, const Fp8Operand& b, bool accumulate, bool fast_accum,
                const Stream& stream, const Tensor& c = Tensor(), const Tensor& bias = Tensor());

/// Whether fp8_matmul on CUDA adds `bias` in cuBLASLt's epilogue: a bf16 / fp16 d (cuBLASLt's FP8
/// bias type rules) and a 16-byte aligned bias (its bias kernels' loads).
bool fp8_bias_epilogue(const Tensor& d, const Tensor& bias);
namespace cuda {
struct GemmDesc;
}
/// The cuBLASLt problem fp8_matmul runs on CUDA for these arguments (row-major TN: a [m, k], b
/// [n, k], d [m, n], beta = accumulate, the scales and their modes, the bias epilogue). fp8_matmul checks it with
/// cuda::check_gemm_desc on every backend, so a CPU run rejects what cuBLASLt would (e.g. a scale
/// pointer not 16-byte aligned). Host-only: reads no data.
cuda::GemmDesc fp8_gemm_desc(const Tensor& d, const Fp8Operand& a, const Fp8Operand& b, bool accumulate,
                             bool fast_accum, const Tensor& c = Tensor(), const Tensor& bias = Tensor());

MT_OP_BACKENDS(fp8_matmul)

}  // namespace mt
