// CPU reference of ops/fp8_grouped.h: plain loops over each group's rows with the scalar formulas
// of ops/fp8_math.h (those of fp8_amax / fp8_quantize, so a group's bytes are fp8_quantize's of
// its rows with its scale).
#include "ops/fp8_grouped.h"

#include <algorithm>
#include <cstdint>

#include "core/dtype.h"
#include "ops/cpu/group_offsets.h"
#include "ops/fp8_math.h"

namespace mt::cpu {
namespace {

uint32_t rows_amax_bits(const float* x, int64_t r0, int64_t r1, int64_t k) {
  uint32_t m = 0;
  for (int64_t i = r0 * k; i < r1 * k; ++i) m = std::max(m, fp8_math::abs_bits_for_max(x[i]));
  return m;
}

}  // namespace

void fp8_grouped_amax(const Tensor& amax, const Tensor& x, const Tensor& counts, const Stream&) {
  const int64_t G = counts.size(0), k = x.size(1);
  const std::vector<int64_t> off = group_offsets(counts, x.size(0), "fp8_grouped_amax");
  const int64_t as = fp8_grouped::value_stride(amax, G, "fp8_grouped_amax", "amax");
  for (int64_t g = 0; g < G; ++g)
    amax.data_as<float>()[g * as] =
        bits_to_f32(rows_amax_bits(x.data_as<float>(), off[static_cast<size_t>(g)], off[static_cast<size_t>(g + 1)], k));
}

void fp8_grouped_quantize(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale,
                          const Tensor& record, const Tensor& counts, const Stream&) {
  const char* fn = "fp8_grouped_quantize";
  const int64_t G = counts.size(0), R = x.size(0), k = x.size(1);
  const std::vector<int64_t> off = group_offsets(counts, R, fn);
  const int64_t ss = fp8_grouped::value_stride(scale, G, fn, "scale");
  const DType t = q.empty() ? q_t.dtype() : q.dtype();
  const float* xv = x.data_as<float>();
  uint8_t* qv = q.empty() ? nullptr : q.data_as<uint8_t>();
  uint8_t* qt = q_t.empty() ? nullptr : q_t.data_as<uint8_t>();
  const int64_t rt = q_t.empty() ? 0 : q_t.size(1);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t r0 = off[static_cast<size_t>(g)], r1 = off[static_cast<size_t>(g + 1)];
    const float s = scale.data_as<float>()[g * ss];
#pragma omp parallel for schedule(static)
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        const uint8_t b = fp8_math::quantize_value(t, xv[r * k + c], s);
        if (qv) qv[r * k + c] = b;
        if (qt) qt[c * rt + r] = b;
      }
    }
    if (!record.empty() && r1 > r0) {
      const int64_t rs = fp8_grouped::value_stride(record, G, fn, "record");
      float* a = record.data_as<float>() + g * rs;
      *a = bits_to_f32(std::max(f32_to_bits(*a), rows_amax_bits(xv, r0, r1, k)));
    }
  }
  const int64_t used = off.back();
  if (qv) std::fill(qv + used * k, qv + R * k, uint8_t{0});
  if (qt)
    for (int64_t c = 0; c < k; ++c) std::fill(qt + c * rt + used, qt + (c + 1) * rt, uint8_t{0});
}

}  // namespace mt::cpu
