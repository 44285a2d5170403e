// Matrix products. CPU: OpenBLAS sgemm (fp32). CUDA: cuBLASLt with cached matmul
// descriptors/layouts/heuristics per shape, fp32 accumulation, bias and GELU epilogues.
// Row-major semantics throughout; weights are [out, in] as in Megatron/PyTorch.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"

namespace mt {

/// Batched strided product, row-major: for each batch i,
///   C_i = alpha * op(A_i) · op(B_i) + beta * C_i
/// A: [batch, m, k] (or [batch, k, m] when trans_a), B: [batch, k, n] (or [batch, n, k] when
/// trans_b), C: [batch, m, n]; batch may be omitted (2-D tensors). A and B share a dtype
/// (fp32/bf16/fp16); C is that dtype or fp32 (fp32 accumulation always).
void matmul(const Tensor& c, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, float alpha, float beta,
            const Stream& stream);

/// Linear layer forward: y[m, n] = x[m, k] · w[n, k]^T (+ bias[n]).
/// With `pre_gelu` given ([m, n], same dtype as y): pre_gelu = x·w^T + bias and y = gelu(pre_gelu)
/// (cuBLASLt GELU_AUX epilogue on CUDA). x, w, bias, y share the act dtype. Any leading dims of
/// x / y are flattened into m.
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& pre_gelu,
                    const Stream& stream);

/// Linear layer backward. dx[m, k] = dy · w (overwrite; skipped when dx is empty);
/// dw[n, k] += dy^T · x (fp32 main grad, accumulate); dbias[n] += sum_m dy (fp32, skipped when
/// empty). dy, x, w in the act dtype.
void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor& dbias, const Tensor& dy, const Tensor& x,
                     const Tensor& w, const Stream& stream);

}  // namespace mt
