// Matrix products. CPU: OpenBLAS sgemm (fp32). CUDA: cuBLASLt with cached matmul
// descriptors/layouts/heuristics per shape, fp32 accumulation, bias and GELU epilogues.
// Row-major semantics throughout; weights are [out, in] as in Megatron/PyTorch.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// Batched strided product, row-major: for each batch i,
///   C_i = alpha * op(A_i) · op(B_i) + beta * C_i
/// A: [batch, m, k] (or [batch, k, m] when trans_a), B: [batch, k, n] (or [batch, n, k] when
/// trans_b), C: [batch, m, n]; batch may be omitted (all three 2-D). A and B share a dtype
/// (fp32/bf16/fp16); C is that dtype or fp32 (fp32 accumulation always; no TF32). beta = 0
/// overwrites C without reading it; k = 0 gives C = beta * C. All contiguous, same device; C must
/// not alias A or B. CPU: fp32 only (OpenBLAS sgemm per batch). Errors: mt::Error for mismatched
/// ranks/shapes/batches/dtypes/devices (and non-fp32 on CPU).
void matmul(const Tensor& c, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, float alpha, float beta,
            const Stream& stream);

/// Linear layer forward (Megatron ColumnParallelLinear/RowParallelLinear's local GEMM):
/// y[m, n] = x[m, k] · w[n, k]^T (+ bias[n]); bias may be empty.
/// With `pre_gelu` given ([m, n], same shape and dtype as y, not aliasing y): pre_gelu = x·w^T +
/// bias and y = gelu(pre_gelu), GELU in its tanh form (ops/gelu.h). x, w, bias, y share the act
/// dtype. Any leading dims of x / y are flattened into m. CUDA: cuBLASLt BIAS epilogue, and the
/// GELU_AUX(_BIAS) epilogue for bf16/fp16 when n % 8 == 0 (cuBLASLt's aux leading-dimension
/// rule) and y/pre_gelu are 16-byte aligned; otherwise (and always for fp32, to match the CPU to
/// 1e-5) GEMM (+ bias epilogue) followed by a GELU kernel. Errors: mt::Error on shape/dtype/device
/// mismatch.
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& pre_gelu,
                    const Stream& stream);

/// Linear layer forward with the residual add of a transformer block when there is no dropout
/// (Megatron's bias-dropout-add at p = 0, fused into the output projection): out[m, n] =
/// residual + (x · w^T + bias). bias may be empty; residual, out [m, n] (any leading dims of x /
/// out / residual flattened), all in the act dtype; out may not alias x or residual. CPU: the
/// GEMM, then residual + (y + bias) element-wise (bit-identical to linear_forward followed by
/// bias_dropout_add_forward with p = 0). CUDA: one GEMM with C = residual, beta = 1 and the bias
/// epilogue, D = out (one rounding instead of two); without an algorithm, GEMM then the add.
/// Errors: as linear_forward, and a residual or out of another shape or dtype.
void linear_forward_add(const Tensor& out, const Tensor& x, const Tensor& w, const Tensor& bias,
                        const Tensor& residual, const Stream& stream);

/// How a weight gradient reaches the fp32 main gradient: added to it (+=, Megatron's
/// main_grad accumulation), or written over it (=; the parameter's first gradient write of the
/// step, ParamStore::take_first_grad_write, so that the buffer need not be zeroed before).
enum class GradWrite { kAccumulate, kOverwrite };

/// Linear layer backward. dx[m, k] = dy · w (overwrite; skipped when dx is empty; same shape as x);
/// dw[n, k] += dy^T · x (fp32 main grad; = with dw_write kOverwrite, then also for m = 0; skipped
/// when empty); dbias[n] += sum_m dy (fp32, accumulate, skipped when empty). dy [..., n],
/// x [..., k], w [n, k] in the act dtype.
/// CUDA: dw via a beta = 1 GEMM with fp32 C (beta = 0, C not read, to overwrite); for bf16/fp16 with dw, dbias from the same GEMM's
/// BGRADB epilogue into the stream's fp32 scratch (CudaStreamResources::bias_grad_scratch; the
/// epilogue overwrites) and then added, else (fp32, no dw, no algorithm, n beyond the scratch) a
/// deterministic column-sum kernel. Errors: mt::Error on shape/dtype/device mismatch, dw/dbias
/// not fp32.
void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor& dbias, const Tensor& dy, const Tensor& x,
                     const Tensor& w, const Stream& stream, GradWrite dw_write = GradWrite::kAccumulate);

/// linear_backward of a linear layer whose input x was gelu(pre) (an MLP's fc2 after fc1 and the
/// GELU; Megatron's bias_gelu fusion, backward): dpre[m, k] = gelu'(pre) ∘ (dy · w) (overwrite;
/// the gradient of pre, not of x), dpre_bias[k] += Σ_m dpre (fp32; fc1's bias gradient; skipped
/// when empty), and dw (as dw_write says), dbias as linear_backward (skipped when empty). pre and dpre: x's shape and
/// dtype; dpre may not alias dy, x or pre. CPU: linear_backward, gelu_backward and a column sum.
/// CUDA bf16/fp16 (k % 8 == 0, 16-byte aligned pre and dpre): the dgrad GEMM's DGELU epilogue (the
/// product not rounded before the derivative multiplies it), then the column sum of dpre; otherwise
/// GEMM, GELU backward kernel, column sum. Errors: as linear_backward, and pre / dpre / dpre_bias
/// of the wrong shape or dtype.
void gelu_linear_backward(const Tensor& dpre, const Tensor& dpre_bias, const Tensor& dw, const Tensor& dbias,
                          const Tensor& dy, const Tensor& x, const Tensor& pre, const Tensor& w, const Stream& stream,
                          GradWrite dw_write = GradWrite::kAccumulate);

MT_OP_BACKENDS(matmul)
MT_OP_BACKENDS(linear_forward)
MT_OP_BACKENDS(linear_forward_add)
MT_OP_BACKENDS(linear_backward)
MT_OP_BACKENDS(gelu_linear_backward)

}  // namespace mt
