// The group offsets of the CPU grouped ops (ops/grouped_matmul.h, ops/fp8_grouped.h): counts are
// host memory on the CPU backend.
#pragma once
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "core/tensor.h"

namespace mt::cpu {

/// The groups' first rows (G + 1 entries, the last = Σc) of int32 counts [G], checked against the
/// R rows. Errors: mt::Error naming `fn` for a negative count or Σc > R.
inline std::vector<int64_t> group_offsets(const Tensor& counts, int64_t R, const char* fn) {
  const int32_t* c = counts.data_as<int32_t>();
  const int64_t G = counts.numel();
  std::vector<int64_t> off(static_cast<size_t>(G + 1), 0);
  for (int64_t g = 0; g < G; ++g) {
    MT_CHECK(c[g] >= 0, "{}: count {} of group {} is negative", fn, c[g], g);
    off[static_cast<size_t>(g + 1)] = off[static_cast<size_t>(g)] + c[g];
  }
  MT_CHECK(off.back() <= R, "{}: the counts sum to {} rows, more than the {} planned", fn, off.back(), R);
  return off;
}

}  // namespace mt::cpu
