// Shared cuBLASLt GEMM wrapper for the CUDA ops (matmul, linear, attention). Only included by
// .cu files. Row-major problems are mapped onto column-major cuBLASLt by swapping the operands
// (C^T = op(B)^T op(A)^T). Matmul descriptors, matrix layouts and the heuristic's algorithm are
// cached per problem key (shape, dtypes, transposes, epilogue, batch, strides, leading dims,
// pointer alignment, cublasLt handle); the cache is process-wide and guarded by a mutex.
// Compute type CUBLAS_COMPUTE_32F (no TF32, so fp32 GEMMs match the CPU to ~1e-6), scale type
// fp32; split-K reductions are restricted to the compute type for 16-bit outputs.
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/stream.h"

namespace mt::cuda {

enum class GemmEpilogue : uint8_t {
  kNone,      ///< D = alpha op(A) op(B) + beta C
  kBias,      ///< ... + bias[n] broadcast over rows (CUBLASLT_EPILOGUE_BIAS)
  kGeluAux,   ///< aux = alpha op(A) op(B) (+ bias[n] if given); D = gelu(aux) (GELU_AUX[_BIAS])
  kBgradA,    ///< D as kNone; bias_grad[i] = Σ_kk op(A)[i, kk], fp32 [m], overwritten (BGRADB)
  kDGelu,     ///< D = gelu'(aux) ∘ (alpha op(A) op(B)) (DGELU; aux as kGeluAux's, the pre-activation).
              ///< (DGELU_BGRAD is not used: on an H100 it took 3x the GEMM's time, and it takes
              ///< no fp32 bias gradient with 16-bit D.)
};

/// How cuBLASLt reads an FP8 operand's dequantisation scales (cublasLtMatmulMatrixScale_t):
/// kScalar one fp32 value (SCALAR_32F), kVec128 one per row and 128-wide k block (VEC128_32F),
/// kBlk128x128 one per 128 x 128 block (BLK128x128_32F); layouts in ops/fp8_math.h.
enum class GemmScaleMode : uint8_t { kScalar, kVec128, kBlk128x128 };

/// The FP8 part of a GemmDesc (ab_type kF8E4M3/kF8E5M2): B's element type (hybrid FP8 multiplies
/// e5m2 gradients by e4m3 operands; kF32 = ab_type), the operands' dequantisation scales (device
/// fp32, required), their modes, and CUBLASLT_MATMUL_DESC_FAST_ACCUM. The requirements (cuBLASLt's
/// FP8 rules on sm_90, checked by check_gemm_desc): trans_a = false, trans_b = true (both operands
/// K-major: cuBLASLt's "TN", the only FP8 layout on sm_90); batch 1; no epilogue but kBias (scalar
/// scales, a 16-byte aligned bias of a bf16 / fp16 C), no aux; C
/// (= D) fp32/bf16/fp16; m, n, k multiples of 16; A, B, C, D and both scale pointers 16-byte
/// aligned (a scale at a 4-byte offset into a state buffer is rejected by cublasLtMatmul with
/// CUBLAS_STATUS_NOT_SUPPORTED although the heuristic offered an algorithm; cuBLAS >= 12.9);
/// scale modes both scalar or both block, not both 128x128; fast_accum with scalar scales only.
struct GemmFp8 {
  DType b_type = DType::kF32;
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  GemmScaleMode a_mode = GemmScaleMode::kScalar, b_mode = GemmScaleMode::kScalar;
  bool fast_accum = false;
};

/// One row-major (optionally strided-batched) GEMM: for each batch i,
///   C_i[m, n] = alpha · op(A_i) · op(B_i) + beta · C_i   (then the epilogue)
/// A_i is [m, k] (or [k, m] when trans_a) with row stride lda, batch stride stride_a (elements);
/// likewise B_i [k, n] / [n, k] and C_i [m, n] with ldc, stride_c. A and B share ab_type
/// (fp32/bf16/fp16; or FP8, see GemmFp8); C is c_type (ab_type or fp32). bias: [n] of c_type. aux: row-major [m, ld_aux]
/// of c_type, ld_aux % 8 == 0 (cuBLASLt's requirement for the GELU input matrix). bias_grad: fp32,
/// 16-byte aligned. C may not alias A or B. Requires m, n, k >= 1. (cuBLASLt is column-major: our
/// A is its B, so kBgradA is its BGRADB epilogue.)
struct GemmDesc {
  int64_t m = 0, n = 0, k = 0, batch = 1;
  bool trans_a = false, trans_b = false;
  DType ab_type = DType::kF32, c_type = DType::kF32;
  const void* a = nullptr;
  int64_t lda = 0, stride_a = 0;
  const void* b = nullptr;
  int64_t ldb = 0, stride_b = 0;
  void* c = nullptr;
  int64_t ldc = 0, stride_c = 0;
  /// The output when it is not C (same layout as C; C is then only read, with beta): D = alpha
  /// op(A) op(B) + beta C. nullptr: D is C.
  void* d = nullptr;
  float alpha = 1.f, beta = 0.f;
  GemmEpilogue epilogue = GemmEpilogue::kNone;
  const void* bias = nullptr;
  void* aux = nullptr;
  int64_t ld_aux = 0;
  float* bias_grad = nullptr;  ///< kBgradA's output
  GemmFp8 fp8;                 ///< FP8 operands only
};

/// Host-side validation of a GemmDesc against what cuBLASLt can run (no GPU needed; the CUDA
/// GEMM calls it before planning, fp8_matmul on every backend): sizes, leading dimensions,
/// epilogue operands, and for FP8 every rule listed at GemmFp8. Errors: mt::Error naming the
/// violated requirement and the problem (describe_gemm).
void check_gemm_desc(const GemmDesc& g);
/// One line describing the problem (sizes, transposes, dtypes, leading dimensions, epilogue, FP8
/// modes), for error messages.
std::string describe_gemm(const GemmDesc& g);
/// B's element type: GemmFp8::b_type for an FP8 GEMM that sets it, else ab_type.
DType gemm_b_type(const GemmDesc& g);

/// Enqueues the GEMM on `stream`. Returns false (enqueueing nothing) when cuBLASLt offers no
/// algorithm for this problem (possible with epilogues and odd alignments); throws mt::Error on
/// any other cuBLASLt failure.
bool try_gemm(const GemmDesc& g, const Stream& stream);
/// As try_gemm, but throws mt::Error (with the problem's description) when no algorithm exists.
void gemm(const GemmDesc& g, const Stream& stream);

/// Convenience: contiguous row-major batched GEMM (lda/ldb/ldc and strides from the shapes).
GemmDesc contiguous_gemm(int64_t batch, int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, DType ab_type,
                         DType c_type, const void* a, const void* b, void* c, float alpha, float beta);

}  // namespace mt::cuda
