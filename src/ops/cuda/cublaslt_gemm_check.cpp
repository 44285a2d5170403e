// The host-side parts of ops/cuda/cublaslt_gemm.h (validation, description, contiguous_gemm): compiled
// in every build, so the CPU backend checks the FP8 GEMMs a GPU run would issue (fp8_matmul) and a problem
// cuBLASLt cannot run fails with the violated rule named instead of a bare cuBLAS status.
// FP8 rules (sm_90): cuBLAS documentation, cublasLtMatmul(), "To use FP8 kernels, the following set
// of requirements must be satisfied: all matrix pointers must be 16-byte aligned; A must be
// transposed and B non-transposed (the TN format); compute type CUBLAS_COMPUTE_32F; scale type
// CUDA_R_32F", and its FP8 type table (C = D fp32/bf16/fp16 for a high-precision output; no e5m2 x
// e5m2). The scale pointers' 16-byte alignment is not in that list but enforced by cublasLtMatmul
// since cuBLAS 12.9 (CUBLAS_STATUS_NOT_SUPPORTED at the enqueue while the heuristic succeeds:
// NVIDIA/TransformerEngine#1925 "cuBLAS requires at least 16B alignment" of each scaling factor's
// pointer for FP8 on Hopper; pytorch/pytorch#159957, confirmed by the cuBLAS team).
#include <cstdint>

#include "core/check.h"
#include "ops/cuda/cublaslt_gemm.h"

namespace mt::cuda {
namespace {

constexpr uintptr_t kFp8Align = 16;  // bytes: cuBLASLt's FP8 pointer alignment
constexpr int64_t kFp8Dim = 16;      // m, n, k multiples of 16 (K-major FP8 rows of 16 bytes)

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kFp8Align == 0; }

bool is_block(GemmScaleMode m) { return m != GemmScaleMode::kScalar; }

void check_fp8(const GemmDesc& g) {
  const DType bt = gemm_b_type(g);
  MT_CHECK(is_fp8(bt) && !(g.ab_type == DType::kF8E5M2 && bt == DType::kF8E5M2),
           "{}: FP8 GEMMs take e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3 (cuBLASLt has no e5m2 x e5m2)",
           describe_gemm(g));
  MT_CHECK(!g.trans_a && g.trans_b,
           "{}: FP8 GEMMs need both operands K-major (trans_a = false, trans_b = true: cuBLASLt's TN format, the "
           "only FP8 layout on sm_90)",
           describe_gemm(g));
  MT_CHECK(g.batch == 1, "{}: FP8 GEMMs are unbatched here (batch {})", describe_gemm(g), g.batch);
  MT_CHECK((g.epilogue == GemmEpilogue::kNone || (g.epilogue == GemmEpilogue::kBias && !is_block(g.fp8.a_mode))) &&
               (g.bias != nullptr) == (g.epilogue == GemmEpilogue::kBias) && g.aux == nullptr &&
               g.bias_grad == nullptr,
           "{}: FP8 GEMMs take the bias epilogue (tensorwise scaling) and no other epilogue, aux or bias gradient "
           "here (the GELU and blockwise scaling's bias run after the GEMM: fp8_bias_gelu)",
           describe_gemm(g));
  MT_CHECK(g.bias == nullptr || (aligned(g.bias) && g.c_type != DType::kF32),
           "{}: an FP8 GEMM's bias must be 16-byte aligned and of a bf16 / fp16 d (got bias={}); fp8_matmul adds "
           "any other after the GEMM",
           describe_gemm(g), g.bias);
  MT_CHECK(g.c_type == DType::kF32 || g.c_type == DType::kBF16 || g.c_type == DType::kF16,
           "{}: an FP8 GEMM writes fp32, bf16 or fp16 (C = D of that type: cuBLASLt's FP8 type table)",
           describe_gemm(g));
  MT_CHECK(g.m % kFp8Dim == 0 && g.n % kFp8Dim == 0 && g.k % kFp8Dim == 0,
           "{}: FP8 GEMMs need m={}, n={}, k={} multiples of 16 (cuBLASLt's FP8 alignment; pad the rows)",
           describe_gemm(g), g.m, g.n, g.k);
  const int64_t cs = static_cast<int64_t>(dtype_size(g.c_type));
  MT_CHECK(g.lda % kFp8Dim == 0 && g.ldb % kFp8Dim == 0 && (g.ldc * cs) % kFp8Dim == 0,
           "{}: FP8 GEMMs need leading dimensions of 16-byte multiples (lda={} and ldb={} FP8 elements, ldc={} x {} "
           "bytes)",
           describe_gemm(g), g.lda, g.ldb, g.ldc, cs);
  MT_CHECK(aligned(g.a) && aligned(g.b) && aligned(g.c) && (g.d == nullptr || aligned(g.d)),
           "{}: FP8 GEMMs need 16-byte aligned matrices (cuBLASLt's FP8 rule), got a={} b={} c={} d={}",
           describe_gemm(g), g.a, g.b, static_cast<const void*>(g.c), static_cast<const void*>(g.d));
  MT_CHECK(g.fp8.a_scale != nullptr && g.fp8.b_scale != nullptr, "{}: FP8 operands need their scales",
           describe_gemm(g));
  MT_CHECK(aligned(g.fp8.a_scale) && aligned(g.fp8.b_scale),
           "{}: FP8 scale pointers must be 16-byte aligned (cublasLtMatmul returns CUBLAS_STATUS_NOT_SUPPORTED "
           "otherwise, cuBLAS >= 12.9), got a_scale={} b_scale={}: keep each scale_inv in its own aligned slot, "
           "not at an offset into a packed state buffer",
           describe_gemm(g), static_cast<const void*>(g.fp8.a_scale), static_cast<const void*>(g.fp8.b_scale));
  MT_CHECK(is_block(g.fp8.a_mode) == is_block(g.fp8.b_mode),
           "{}: FP8 scale modes must be both scalar or both block (cuBLASLt has no mixed kernel)", describe_gemm(g));
  MT_CHECK(!(g.fp8.a_mode == GemmScaleMode::kBlk128x128 && g.fp8.b_mode == GemmScaleMode::kBlk128x128),
           "{}: FP8 operands both 128x128-block scaled (cuBLASLt has no 2D x 2D kernel)", describe_gemm(g));
  MT_CHECK(!g.fp8.fast_accum || !is_block(g.fp8.a_mode),
           "{}: fast accumulation applies to scalar FP8 scales only (block-scaled GEMMs always promote)",
           describe_gemm(g));
}

}  // namespace

DType gemm_b_type(const GemmDesc& g) {
  return is_fp8(g.ab_type) && g.fp8.b_type != DType::kF32 ? g.fp8.b_type : g.ab_type;
}

std::string describe_gemm(const GemmDesc& g) {
  return fmt::format(
      "gemm m={} n={} k={} batch={} trans_a={} trans_b={} ab={} c={} lda={} ldb={} ldc={} strides=({}, {}, {}) "
      "epilogue={} bias={} bias_grad={} ld_aux={}{}",
      g.m, g.n, g.k, g.batch, g.trans_a, g.trans_b, dtype_name(g.ab_type), dtype_name(g.c_type), g.lda, g.ldb, g.ldc,
      g.stride_a, g.stride_b, g.stride_c, static_cast<int>(g.epilogue), g.bias != nullptr, g.bias_grad != nullptr,
      g.ld_aux,
      is_fp8(g.ab_type) ? fmt::format(" fp8 b={} scale_modes=({}, {}) fast_accum={}", dtype_name(gemm_b_type(g)),
                                      static_cast<int>(g.fp8.a_mode), static_cast<int>(g.fp8.b_mode), g.fp8.fast_accum)
                        : std::string());
}

void check_gemm_desc(const GemmDesc& g) {
  MT_CHECK(g.m > 0 && g.n > 0 && g.k > 0 && g.batch > 0, "{}: sizes must be positive", describe_gemm(g));
  if (is_fp8(g.ab_type)) {
    check_fp8(g);
  } else {
    MT_CHECK(g.c_type == g.ab_type || g.c_type == DType::kF32, "{}: c must be the a/b dtype or fp32",
             describe_gemm(g));
  }
  MT_CHECK(g.lda >= (g.trans_a ? g.m : g.k) && g.ldb >= (g.trans_b ? g.k : g.n) && g.ldc >= g.n,
           "{}: leading dimensions too small", describe_gemm(g));
  MT_CHECK(g.m <= INT32_MAX && g.n <= INT32_MAX && g.k <= INT32_MAX && g.batch <= INT32_MAX,
           "{}: sizes exceed int32", describe_gemm(g));
  if (g.epilogue == GemmEpilogue::kBias)
    MT_CHECK(g.bias != nullptr, "{}: bias epilogue without bias", describe_gemm(g));
  if (g.epilogue == GemmEpilogue::kGeluAux || g.epilogue == GemmEpilogue::kDGelu) {
    MT_CHECK(g.aux != nullptr && g.ld_aux >= g.n && g.ld_aux % 8 == 0,
             "{}: the GELU epilogues need an aux matrix with ld_aux >= n and ld_aux % 8 == 0", describe_gemm(g));
  }
  const bool bgrad = g.epilogue == GemmEpilogue::kBgradA;
  MT_CHECK(bgrad == (g.bias_grad != nullptr) && (!bgrad || g.batch == 1),
           "{}: bias_grad goes with the bias-gradient epilogues (unbatched) only", describe_gemm(g));
}

GemmDesc contiguous_gemm(int64_t batch, int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, DType ab_type,
                         DType c_type, const void* a, const void* b, void* c, float alpha, float beta) {
  GemmDesc g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.batch = batch;
  g.trans_a = trans_a;
  g.trans_b = trans_b;
  g.ab_type = ab_type;
  g.c_type = c_type;
  g.a = a;
  g.lda = trans_a ? m : k;
  g.stride_a = m * k;
  g.b = b;
  g.ldb = trans_b ? k : n;
  g.stride_b = k * n;
  g.c = c;
  g.ldc = n;
  g.stride_c = m * n;
  g.alpha = alpha;
  g.beta = beta;
  return g;
}

}  // namespace mt::cuda
