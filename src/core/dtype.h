// Element types and host-side conversions. bf16/fp16 are stored as raw uint16 on the host;
// conversions round to nearest even (as CUDA's __float2bfloat16_rn / __float2half_rn).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "core/check.h"

#if defined(__CUDACC__)
#define MT_HD __host__ __device__ __forceinline__
#else
#define MT_HD inline
#endif

namespace mt {

/// kF64 holds the float64 routing math of --moe-router-dtype fp64 (router logits, scores and their
/// gradients); kI16 the int16 remainders of fp32 main parameters stored beside bf16 ones
/// (--use-precision-aware-optimizer, ops/optimizer.h split_param_remainders); the other ops take
/// fp32/bf16/fp16.
enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2, kI32 = 3, kI64 = 4, kU8 = 5, kF64 = 6, kI16 = 7 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU8: return 1;
    case DType::kF64: return 8;
    case DType::kI16: return 2;
  }
  return 0;
}

std::string_view dtype_name(DType t);
/// Parses "fp32"/"float32", "bf16"/"bfloat16", "fp16"/"float16", "int32", "int64", "uint8",
/// "fp64"/"float64", "int16".
/// Throws mt::Error naming the value otherwise.
DType parse_dtype(std::string_view s);

/// fp32 -> bf16 bits, round to nearest even; NaN stays NaN.
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_bits_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
/// fp32 -> IEEE half bits, round to nearest even, overflow to inf.
uint16_t f32_to_f16_bits(float f);
float f16_bits_to_f32(uint16_t h);

/// Rounds a float through the given storage dtype (identity for fp32).
inline float round_through(DType t, float f) {
  if (t == DType::kBF16) return bf16_bits_to_f32(f32_to_bf16_bits(f));
  if (t == DType::kF16) return f16_bits_to_f32(f32_to_f16_bits(f));
  return f;
}

}  // namespace mt
