// The epilogue of an FP8 linear layer's forward GEMM that runs after fp8_matmul: fc1's GELU (the
// bf16 GEMMs fuse it into cuBLASLt's epilogue, ops/matmul.h linear_forward) and the bias where the
// GEMM did not add it (blockwise scaling; fp8_matmul's fallback). docs/fp8.md "What runs in FP8".
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// y[r, c] += bias[c] for every row r (bias empty: nothing added), then, when act is given,
/// act = gelu(y) (ops/gelu.h's tanh form, of the stored y). y: [..., n] viewed as rows of n;
/// bias: [n] or empty; act: y's shape or empty; all of the act dtype (fp32 on the CPU; fp32, bf16
/// or fp16 on CUDA), contiguous, one device; act must not alias y. fp32 math, one rounding per
/// stored value (bit-identical CPU and CUDA in fp32). Errors: mt::Error on mismatched shapes,
/// dtypes, devices, or when neither bias nor act is given.
void fp8_bias_gelu(const Tensor& y, const Tensor& bias, const Tensor& act, const Stream& stream);

MT_OP_BACKENDS(fp8_bias_gelu)

}  // namespace mt
