// Host storage codecs of the CPU ops: the storage type of fp32/bf16/fp16 and load/store through
// fp32 (round to nearest even, core/dtype.h), with a dispatch on the runtime dtype.
#pragma once
#include <cstdint>

#include "core/check.h"
#include "core/dtype.h"

namespace mt::cpu {

struct F32Codec {
  using storage = float;
  static float load(float v) { return v; }
  static float store(float f) { return f; }
};
struct BF16Codec {
  using storage = uint16_t;
  static float load(uint16_t v) { return bf16_bits_to_f32(v); }
  static uint16_t store(float f) { return f32_to_bf16_bits(f); }
};
struct F16Codec {
  using storage = uint16_t;
  static float load(uint16_t v) { return f16_bits_to_f32(v); }
  static uint16_t store(float f) { return f32_to_f16_bits(f); }
};

/// Calls f(Codec{}) for the float dtype t. Errors: mt::Error naming `what` for other dtypes.
template <typename F>
void dispatch_codec(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::kF32: f(F32Codec{}); break;
    case DType::kBF16: f(BF16Codec{}); break;
    case DType::kF16: f(F16Codec{}); break;
    default: MT_FAIL("{}: unsupported dtype {}", what, dtype_name(t));
  }
}

}  // namespace mt::cpu
