// CUDA FP8 GEMM (ops/fp8_matmul.h) through the shared cuBLASLt plan cache (ops/cuda/cublaslt_gemm.h):
// row-major D[m, n] = A[m, k] · B[n, k]^T is cuBLASLt's column-major "TN" problem, the only FP8
// layout Hopper runs; the scales are device pointers read when the GEMM runs (capturable), with
// the SCALAR_32F, VEC128_32F or BLK128x128_32F scale modes.
#include "core/cuda_check.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/cublaslt_gemm.h"
#include "ops/fp8_epilogue.h"
#include "ops/fp8_matmul.h"

namespace mt::cuda {

void fp8_matmul(const Tensor& d, const Fp8Operand& a, const Fp8Operand& b, bool accumulate, bool fast_accum,
                const Stream& stream, const Tensor& c, const Tensor& bias) {
  const int64_t m = a.data.size(0), n = b.data.size(0), k = a.data.size(1);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate)
      MT_CUDA_CHECK(cudaMemsetAsync(d.data(), 0, d.nbytes(), cu(stream)));
    else if (!c.empty() && c.data() != d.data())
      MT_CUDA_CHECK(cudaMemcpyAsync(d.data(), c.data(), d.nbytes(), cudaMemcpyDeviceToDevice, cu(stream)));
    if (!bias.empty()) cuda::fp8_bias_gelu(d, bias, Tensor(), stream);
    return;
  }
  if (fp8_bias_epilogue(d, bias) && try_gemm(mt::fp8_gemm_desc(d, a, b, accumulate, fast_accum, c, bias), stream))
    return;
  // no bias, or none in the epilogue (an fp32 d, a misaligned bias, no bias kernel for this
  // problem): the product, then the bias in a pass of its own
  gemm(mt::fp8_gemm_desc(d, a, b, accumulate, fast_accum, c), stream);
  if (!bias.empty()) cuda::fp8_bias_gelu(d, bias, Tensor(), stream);
}

}  // namespace mt::cuda
