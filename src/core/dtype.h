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
/// (--use-precision-aware-optimizer, ops/optimizer.h split_param_remainders); kF8E4M3 / kF8E5M2
/// are the FP8 storage types of FP8 training (OCP FP8: e4m3 "fn" with no infinities, largest
/// finite 448; e5m2 IEEE-like, largest finite 57344), read and written only by the FP8 ops
/// (ops/fp8.h, ops/fp8_matmul.h; docs/fp8.md); the other ops take fp32/bf16/fp16.
enum class DType : uint8_t {
  kF32 = 0,
  kBF16 = 1,
  kF16 = 2,
  kI32 = 3,
  kI64 = 4,
  kU8 = 5,
  kF64 = 6,
  kI16 = 7,
  kF8E4M3 = 8,
  kF8E5M2 = 9
};

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
    case DType::kF8E4M3: return 1;
    case DType::kF8E5M2: return 1;
  }
  return 0;
}

constexpr bool is_fp8(DType t) { return t == DType::kF8E4M3 || t == DType::kF8E5M2; }

std::string_view dtype_name(DType t);
/// Parses "fp32"/"float32", "bf16"/"bfloat16", "fp16"/"float16", "int32", "int64", "uint8",
/// "fp64"/"float64", "int16", "fp8_e4m3"/"float8_e4m3fn", "fp8_e5m2"/"float8_e5m2".
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

// FP8 (OCP 8-bit floating point, as CUDA's __nv_fp8_e4m3 / __nv_fp8_e5m2). e4m3: bias 7, 3
// mantissa bits, no infinities, NaN = S.1111.111, largest finite 448 (S.1111.110), smallest
// subnormal 2^-9. e5m2: bias 15, 2 mantissa bits, infinities S.11111.00, NaN S.11111.{01,10,11},
// largest finite 57344 (S.11110.11), smallest subnormal 2^-16.
constexpr float kFp8E4M3Max = 448.f;
constexpr float kFp8E5M2Max = 57344.f;

/// The bits of a float and back (host and device).
MT_HD uint32_t f32_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
MT_HD float bits_to_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

namespace fp8_detail {
/// fp32 -> fp8 bits with kMan mantissa bits and exponent bias kBias: round to nearest even,
/// saturating: |f| >= the largest finite value `max_bits` encodes (f32 bits max_f32_bits) gives
/// +-max, infinities too (CUDA's __NV_SATFINITE: RNE then clamp is the same map, since every
/// value above the largest finite rounds to it or beyond); +-0 and underflow keep the sign.
/// NaN is handled by the callers.
template <int kMan, int kBias>
MT_HD uint8_t f32_to_fp8_finite(uint32_t u, uint32_t max_f32_bits, uint8_t max_bits) {
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= max_f32_bits) return static_cast<uint8_t>(sign | max_bits);
  const int biased = static_cast<int>(a >> 23);
  if (biased == 0) return sign;  // fp32 zero or subnormal: far below fp8's smallest subnormal
  const int e = biased - 127;    // unbiased exponent
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;  // 24-bit significand
  // Code before rounding = mant >> shift (normal: exponent field and mantissa; subnormal: the
  // subnormal mantissa, which carries into the smallest normal's encoding when it rounds up).
  uint32_t code;
  int shift;
  if (e >= 1 - kBias) {  // fp8 normal range
    shift = 23 - kMan;
    code = (static_cast<uint32_t>(e + kBias) << kMan) | ((mant >> shift) & ((1u << kMan) - 1u));
  } else {
    shift = 23 - kMan + (1 - kBias - e);
    if (shift > 24) return sign;  // below half the smallest subnormal
    code = mant >> shift;
  }
  const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (code & 1u))) ++code;
  return static_cast<uint8_t>(sign | code);
}
}  // namespace fp8_detail

/// fp32 -> e4m3 bits: round to nearest even, saturating to +-448 (infinities too), NaN -> S.1111.111
/// (CUDA's __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3)).
MT_HD uint8_t f32_to_e4m3_bits(float f) {
  const uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint8_t>(((u >> 24) & 0x80u) | 0x7fu);
  return fp8_detail::f32_to_fp8_finite<3, 7>(u, 0x43e00000u /* 448 */, 0x7eu);
}
/// fp32 -> e5m2 bits: round to nearest even, saturating to +-57344 (infinities too), NaN -> a NaN
/// S.11111.1m with m the input's first dropped mantissa bit below the quiet bit (CUDA's
/// __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E5M2) on the host).
MT_HD uint8_t f32_to_e5m2_bits(float f) {
  const uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint8_t>(((u >> 24) & 0x80u) | 0x7eu | ((u >> 21) & 0x3u));
  }
  return fp8_detail::f32_to_fp8_finite<2, 15>(u, 0x47600000u /* 57344 */, 0x7bu);
}
/// e4m3 bits -> fp32 (exact); NaN codes give a quiet NaN with their sign.
MT_HD float e4m3_bits_to_f32(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xfu, man = b & 0x7u;
  uint32_t u;
  if (exp == 0xfu && man == 0x7u) {
    u = sign | 0x7fc00000u;
  } else if (exp == 0) {  // subnormal: man * 2^-9, exact in fp32
    u = sign | f32_to_bits(static_cast<float>(man) * 0.001953125f);
  } else {
    u = sign | ((exp - 7u + 127u) << 23) | (man << 20);
  }
  return bits_to_f32(u);
}
/// e5m2 bits -> fp32 (exact); S.11111.00 is +-inf, the NaN codes give a quiet NaN with their sign.
MT_HD float e5m2_bits_to_f32(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 2) & 0x1fu, man = b & 0x3u;
  uint32_t u;
  if (exp == 0x1fu) {
    u = sign | (man == 0 ? 0x7f800000u : 0x7fc00000u);
  } else if (exp == 0) {  // subnormal: man * 2^-16
    u = sign | f32_to_bits(static_cast<float>(man) * 1.52587890625e-05f);
  } else {
    u = sign | ((exp - 15u + 127u) << 23) | (man << 21);
  }
  return bits_to_f32(u);
}
/// fp32 -> fp8 bits of `t` (kF8E4M3 or kF8E5M2) and back.
MT_HD uint8_t f32_to_fp8_bits(DType t, float f) {
  return t == DType::kF8E4M3 ? f32_to_e4m3_bits(f) : f32_to_e5m2_bits(f);
}
MT_HD float fp8_bits_to_f32(DType t, uint8_t b) { return t == DType::kF8E4M3 ? e4m3_bits_to_f32(b) : e5m2_bits_to_f32(b); }
/// Largest finite value of an FP8 dtype (448 or 57344); 0 for other dtypes.
constexpr float fp8_max(DType t) {
  return t == DType::kF8E4M3 ? kFp8E4M3Max : t == DType::kF8E5M2 ? kFp8E5M2Max : 0.f;
}

/// Rounds a float through the given storage dtype (identity for fp32; FP8 saturates as above).
inline float round_through(DType t, float f) {
  if (t == DType::kBF16) return bf16_bits_to_f32(f32_to_bf16_bits(f));
  if (t == DType::kF16) return f16_bits_to_f32(f32_to_f16_bits(f));
  if (is_fp8(t)) return fp8_bits_to_f32(t, f32_to_fp8_bits(t, f));
  return f;
}

}  // namespace mt
