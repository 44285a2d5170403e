// CPU reference of the FP8 quantisation ops (ops/fp8.h): fp32 inputs, plain loops, the scalar
// formulas of ops/fp8_math.h and core/dtype.h that the CUDA kernels share (bit-identical results).
#include "ops/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace mt::cpu {
namespace {

using fp8_math::abs_bits_for_max;
using fp8_math::kBlock;

/// An input element as the quantisers read it: as it is, or rounded to bf16 (kRoundBf16:
/// fp8_quantize_bf16_rounded).
template <bool kRoundBf16>
float load(float x) {
  if constexpr (kRoundBf16) return bf16_bits_to_f32(f32_to_bf16_bits(x));
  return x;
}

/// Max of abs_bits_for_max over load<kRoundBf16>(x[i]), i < n.
template <bool kRoundBf16 = false>
uint32_t amax_bits(const float* x, int64_t n) {
  uint32_t m = 0;
#pragma omp parallel for reduction(max : m) schedule(static)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, abs_bits_for_max(load<kRoundBf16>(x[i])));
  return m;
}

/// Blockwise quantisation of x [rows, cols] along its rows into q (bytes) and the
/// block layout of `scaling` (see fp8_math.h), padding entries 0.
void quantize_blocks(uint8_t* q, float* scale_inv, const float* x, int64_t rows, int64_t cols, Fp8Scaling scaling,
                     DType t, bool pow2) {
  const float fmax = fp8_max(t);
  const int64_t srows = fp8_math::scale_rows(scaling, rows, cols), scols = fp8_math::scale_cols(scaling, rows, cols);
  std::fill(scale_inv, scale_inv + srows * scols, 0.f);
  const int64_t brows = scaling == Fp8Scaling::kBlock1x128 ? 1 : kBlock;
  const int64_t nrb = (rows + brows - 1) / brows, ncb = (cols + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t rb = 0; rb < nrb; ++rb) {
    const int64_t r0 = rb * brows, r1 = std::min(rows, r0 + brows);
    for (int64_t cb = 0; cb < ncb; ++cb) {
      const int64_t c0 = cb * kBlock, c1 = std::min(cols, c0 + kBlock);
      uint32_t m = 0;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) m = std::max(m, abs_bits_for_max(x[r * cols + c]));
      }
      const float s = fp8_math::scale_from_amax(bits_to_f32(m), fmax, pow2, 0.f);
      scale_inv[fp8_math::scale_index(scaling, r0, c0, rows, cols)] = 1.f / s;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = fp8_math::quantize_value(t, x[r * cols + c], s);
      }
    }
  }
}

std::vector<float> transposed(const float* x, int64_t rows, int64_t cols) {
  std::vector<float> xt(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) xt[static_cast<size_t>(c * rows + r)] = x[r * cols + c];
  }
  return xt;
}

/// Rows and columns of x viewed as [rows, cols] (cols = last dim).
std::pair<int64_t, int64_t> rows_cols(const Tensor& x) {
  const int64_t cols = x.size(-1);
  return {cols == 0 ? 0 : x.numel() / cols, cols};
}

void require_f32(const Tensor& t, const char* fn, const char* name) {
  MT_CHECK(t.dtype() == DType::kF32, "{}: the CPU backend takes fp32 {}, got {}", fn, name, t.str());
}

/// Tensorwise cast + transpose of x (fp8_quantize; kRoundBf16: fp8_quantize_bf16_rounded).
template <bool kRoundBf16>
void quantize_tensorwise(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale,
                         const Tensor& amax) {
  const auto [rows, cols] = rows_cols(x);
  const DType t = q.empty() ? q_t.dtype() : q.dtype();
  const float s = *scale.data_as<float>();
  const float* xv = x.data_as<float>();
  uint8_t* qv = q.empty() ? nullptr : q.data_as<uint8_t>();
  uint8_t* qt = q_t.empty() ? nullptr : q_t.data_as<uint8_t>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t b = fp8_math::quantize_value(t, load<kRoundBf16>(xv[r * cols + c]), s);
      if (qv) qv[r * cols + c] = b;
      if (qt) qt[c * rows + r] = b;
    }
  }
  if (!amax.empty()) {
    float* a = amax.data_as<float>();
    const uint32_t m = std::max(f32_to_bits(*a), amax_bits<kRoundBf16>(xv, x.numel()));
    *a = bits_to_f32(m);
  }
}

}  // namespace

void fp8_amax(const Tensor& amax, const Tensor& x, const Stream&) {
  require_f32(x, "fp8_amax", "x");
  *amax.data_as<float>() = bits_to_f32(amax_bits(x.data_as<float>(), x.numel()));
}

void fp8_scale_from_amax(const Tensor& scale, const Tensor& scale_inv, const Tensor& amax, DType fp8, bool pow2,
                         float epsilon, const Stream&) {
  const float* a = amax.data_as<float>();
  float* s = scale.data_as<float>();
  float* si = scale_inv.data_as<float>();
  for (int64_t i = 0; i < amax.numel(); ++i) {
    s[i] = fp8_math::scale_from_amax(a[i], fp8_max(fp8), pow2, epsilon);
    si[i] = 1.f / s[i];
  }
}

void fp8_delayed_scale_update(const Tensor& amax_history, const Tensor& scale, const Tensor& scale_inv, DType fp8,
                              int margin, fp8_math::AmaxAlgo algo, const Stream&) {
  const int64_t len = amax_history.size(0), n = amax_history.size(1);
  const float scaled_max = fp8_max(fp8) * std::ldexp(1.f, -margin);
  for (int64_t i = 0; i < n; ++i) {
    fp8_math::delayed_update(amax_history.data_as<float>() + i, len, n, scale.data_as<float>() + i,
                             scale_inv.data_as<float>() + i, scaled_max, algo);
  }
}

void fp8_quantize(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale, const Tensor& amax,
                  const Stream&) {
  require_f32(x, "fp8_quantize", "x");
  quantize_tensorwise<false>(q, q_t, x, scale, amax);
}

void fp8_quantize_bf16_rounded(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale,
                               const Tensor& amax, const Stream&) {
  quantize_tensorwise<true>(q, q_t, x, scale, amax);
}

void fp8_quantize_blockwise(const Tensor& q, const Tensor& q_scale_inv, const Tensor& q_t, const Tensor& q_t_scale_inv,
                            const Tensor& x, Fp8Scaling scaling, bool pow2, const Stream&) {
  require_f32(x, "fp8_quantize_blockwise", "x");
  const auto [rows, cols] = rows_cols(x);
  const float* xv = x.data_as<float>();
  if (!q.empty()) {
    quantize_blocks(q.data_as<uint8_t>(), q_scale_inv.data_as<float>(), xv, rows, cols, scaling, q.dtype(), pow2);
  }
  if (!q_t.empty()) {  // by definition: the rowwise quantisation of x^T
    const std::vector<float> xt = transposed(xv, rows, cols);
    quantize_blocks(q_t.data_as<uint8_t>(), q_t_scale_inv.data_as<float>(), xt.data(), cols, rows, scaling, q_t.dtype(),
                    pow2);
  }
}

void fp8_dequantize(const Tensor& y, const Tensor& q, const Tensor& scale_inv, Fp8Scaling scaling, const Stream&) {
  require_f32(y, "fp8_dequantize", "y");
  const auto [rows, cols] = rows_cols(q);
  const DType t = q.dtype();
  const uint8_t* qv = q.data_as<uint8_t>();
  const float* s = scale_inv.data_as<float>();
  float* yv = y.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float sc = s[fp8_math::scale_index(scaling, r, c, rows, cols)];
      yv[r * cols + c] = fp8_bits_to_f32(t, qv[r * cols + c]) * sc;
    }
  }
}

}  // namespace mt::cpu
