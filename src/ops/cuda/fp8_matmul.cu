// CUDA FP8 GEMM (ops/fp8_matmul.h) through the shared cuBLASLt plan cache (ops/cuda/cublaslt_gemm.h):
// row-major D[m, n] = A[m, k] · B[n, k]^T is cuBLASLt's column-major "TN" problem, the only FP8
// layout Hopper runs; the scales are device pointers read when the GEMM runs (capturable), with
// the SCALAR_32F, VEC128_32F or BLK128x128_32F scale modes.
#include "core/cuda_check.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/cublaslt_gemm.h"
#include "ops/fp8_matmul.h"

namespace mt::cuda {
namespace {

GemmScaleMode scale_mode(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::kTensor: return GemmScaleMode::kScalar;
    case Fp8Scaling::kBlock1x128: return GemmScaleMode::kVec128;
    case Fp8Scaling::kBlock128x128: return GemmScaleMode::kBlk128x128;
  }
  MT_FAIL("fp8_matmul: unknown scaling {}", static_cast<int>(s));
}

}  // namespace

void fp8_matmul(const Tensor& d, const Fp8Operand& a, const Fp8Operand& b, bool accumulate, bool fast_accum,
                const Stream& stream) {
  const int64_t m = a.data.size(0), n = b.data.size(0), k = a.data.size(1);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) MT_CUDA_CHECK(cudaMemsetAsync(d.data(), 0, d.nbytes(), cu(stream)));
    return;
  }
  GemmDesc g = contiguous_gemm(1, m, n, k, /*trans_a=*/false, /*trans_b=*/true, a.data.dtype(), d.dtype(),
                               a.data.data(), b.data.data(), d.data(), 1.f, accumulate ? 1.f : 0.f);
  g.fp8.b_type = b.data.dtype();
  g.fp8.a_scale = a.scale_inv.data_as<float>();
  g.fp8.b_scale = b.scale_inv.data_as<float>();
  g.fp8.a_mode = scale_mode(a.scaling);
  g.fp8.b_mode = scale_mode(b.scaling);
  g.fp8.fast_accum = fast_accum;
  gemm(g, stream);
}

}  // namespace mt::cuda
