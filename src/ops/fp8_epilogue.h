// The epilogue of an FP8 linear layer's forward GEMM, run after fp8_matmul (which writes the bare
// product): the bias add and the GELU that the bf16 GEMMs fuse into cuBLASLt's epilogues
// (ops/matmul.h linear_forward). docs/fp8.md "What runs in FP8".
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
