// Scalar formulas of the FP8 ops shared by the CPU reference (ops/cpu/fp8.cpp) and the CUDA kernels
// (ops/cuda/fp8.cu), so that both backends compute bit-identical scales and block layouts
// (docs/fp8.md). Sources: Transformer Engine's transformer_engine/common/recipe/recipe_common.cuh
// (compute_scale_from_amax), recipe/delayed_scaling.cu (amax_and_scale_update_after_reduction) and
// pytorch/tensor/float8_blockwise_tensor.py (get_scale_shape, the GEMM-ready scale layout).
#pragma once
#include <cfloat>
#include <cstdint>

#include "core/dtype.h"

namespace mt {

/// Scaling granularity of an FP8 tensor x [rows, cols] quantised along its rows (cols = the
/// GEMM's k): one scale for the tensor (tensorwise current or delayed scaling), one per row and
/// 128 columns (1x128, activations and gradients of the blockwise recipe), one per 128x128 block
/// (weights of the blockwise recipe). DeepSeek-V3 (arXiv:2412.19437, section 3.3) and Transformer
/// Engine's Float8BlockScaling.
enum class Fp8Scaling : uint8_t { kTensor, kBlock1x128, kBlock128x128 };

namespace fp8_math {

constexpr int64_t kBlock = 128;  ///< FP8 block length (1x128 tiles, 128x128 blocks)

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t pad4(int64_t a) { return (a + 3) / 4 * 4; }

/// |x| as ordered bits for an amax: finite values and infinities order as their bits; NaN counts
/// as 0 (ignored, as the fmaxf reductions of Transformer Engine).
MT_HD uint32_t abs_bits_for_max(float x) {
  const uint32_t a = f32_to_bits(x) & 0x7fffffffu;
  return a > 0x7f800000u ? 0u : a;
}

/// What the quantisers write for x * s (x an input element, s its scale): core/dtype.h's
/// conversion (nearest even, saturating) of the fp32 product, and for a NaN x the NaN code 0x7f
/// (a NaN in both formats) whatever its sign and payload — GPU arithmetic returns NaNs with a
/// canonical payload and no sign, so keeping them would make the backends differ.
constexpr uint8_t kNaNCode = 0x7f;
MT_HD uint8_t quantize_value(DType t, float x, float s) { return x != x ? kNaNCode : f32_to_fp8_bits(t, x * s); }

/// The quantisation scale of a tensor or block from its amax (Transformer Engine's
/// compute_scale_from_amax, current and blockwise scaling): scale = fp8_max / max(amax, epsilon),
/// rounded to nearest; amax 0, inf or NaN gives 1; a quotient that overflows fp32 gives FLT_MAX;
/// pow2 keeps only the sign and exponent (rounds down to a power of two, the blockwise default).
/// (TE uses the input type's largest value for the overflow case; with pow2 both give 2^127.)
MT_HD float scale_from_amax(float amax, float fp8_max, bool pow2, float epsilon) {
  if (amax < epsilon) amax = epsilon;
  if (amax == 0.f || !(amax <= FLT_MAX)) return 1.f;  // 0, inf or NaN
  float scale = fp8_max / amax;
  if (scale > FLT_MAX) scale = FLT_MAX;
  if (pow2) scale = bits_to_f32(f32_to_bits(scale) & 0xff800000u);
  return scale;
}

/// How the amax history gives the delayed-scaling amax (Megatron's --fp8-amax-compute-algo).
enum class AmaxAlgo : uint8_t { kMostRecent, kMax };

/// Delayed scaling, one tensor (Transformer Engine's amax_and_scale_update_after_reduction with
/// a per-tensor history column): hist[j * stride], j < len, is the tensor's amax history, hist[0]
/// the amax recorded during this step. When hist[0] != 0 the history rolls — the new hist[j] =
/// old hist[j + 1] for 0 < j < len - 1, the new hist[len - 1] = old hist[0], the new hist[0] = 0
/// (cleared for the next step's recording; the oldest entry, old hist[1], leaves the window) — and
/// amax = old hist[0] (kMostRecent) or the max over the len old entries (kMax); when hist[0] == 0
/// (the tensor was not quantised this step) nothing moves and amax = 0. Then scale = scaled_max /
/// amax (scaled_max = fp8_max * 2^-margin) if amax is finite and > 0, else the scale stays; a
/// quotient that overflows fp32 gives FLT_MAX; scale_inv = 1 / scale.
MT_HD void delayed_update(float* hist, int64_t len, int64_t stride, float* scale, float* scale_inv, float scaled_max,
                          AmaxAlgo algo) {
  const float last = hist[0];
  float amax = 0.f;
  if (last != 0.f) {
    for (int64_t j = 0; j < len; ++j) {
      const float a = j < len - 1 ? hist[(j + 1) * stride] : last;
      if (a > amax) amax = a;  // fmaxf: a NaN entry is passed over
      if (j > 0) hist[j * stride] = a;
    }
    hist[0] = 0.f;
    if (algo == AmaxAlgo::kMostRecent) amax = last;
  }
  float s = *scale;
  if (amax > 0.f && amax <= FLT_MAX) s = scaled_max / amax;
  if (s > FLT_MAX) s = FLT_MAX;
  *scale = s;
  *scale_inv = 1.f / s;
}

/// Layouts of the FP8 scales (the block layouts are what cuBLASLt's
/// CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F and BLK128x128_32F read for a K-major operand;
/// Transformer Engine's GEMM-ready format). A tensor x [rows, cols] quantised along its rows
/// (cols is the GEMM's k):
///  * kTensor: one fp32 [1];
///  * kBlock1x128: one scale per row and 128-column block, fp32 [ceil(cols/128), pad4(rows)],
///    element (row r, block b) at b * pad4(rows) + r (the rows of a block are contiguous);
///  * kBlock128x128: one scale per 128x128 block, fp32 [ceil(rows/128), pad4(ceil(cols/128))],
///    element (row block rb, column block cb) at rb * pad4(ceil(cols/128)) + cb.
/// Padding entries are written as 0 and never read.
MT_HD int64_t scale_rows(Fp8Scaling s, int64_t rows, int64_t cols) {
  return s == Fp8Scaling::kTensor ? 1 : s == Fp8Scaling::kBlock1x128 ? ceil_div(cols, kBlock) : ceil_div(rows, kBlock);
}
MT_HD int64_t scale_cols(Fp8Scaling s, int64_t rows, int64_t cols) {
  return s == Fp8Scaling::kTensor ? 1 : s == Fp8Scaling::kBlock1x128 ? pad4(rows) : pad4(ceil_div(cols, kBlock));
}
/// Index in the scale tensor of the scale of element (r, c).
MT_HD int64_t scale_index(Fp8Scaling s, int64_t r, int64_t c, int64_t rows, int64_t cols) {
  if (s == Fp8Scaling::kTensor) return 0;
  return s == Fp8Scaling::kBlock1x128 ? (c / kBlock) * pad4(rows) + r
                                      : (r / kBlock) * pad4(ceil_div(cols, kBlock)) + c / kBlock;
}

}  // namespace fp8_math
}  // namespace mt
