// Helpers shared by the CPU attention references (ops/cpu/attention.cpp, flash_attention.cpp,
// context_attention.cpp, kv_cache_attention.cpp): element offsets in Megatron-Core's per-query-group
// layouts and the fp32 dot product they all accumulate scores with (the same order everywhere: e =
// 0 .. d-1).
#pragma once
#include <cstdint>

namespace mt::cpu::attn {

/// Element offsets (channel 0) of one call's rows, sample b, key/value group grp, query head h:
///   q:  qkv [s, b, g, qpg + 2, d], query head qi (0 .. qpg-1) of grp
///   k, v: a key/value tensor whose rows hold kv_heads heads per (b, grp), the key at kv_first and
///       the value after it: qkv itself (kv_heads = qpg + 2, kv_first = qpg) or kv [s, b, g, 2, d]
///   o:  out / dout [s, b, n, d];  row: the row (i, b, h) of [s, b, n] (the context-parallel lse)
struct Layout {
  int64_t B, g, qpg, n, d, kv_heads, kv_first;
  int64_t q(int64_t i, int64_t b, int64_t grp, int64_t qi) const {
    return (((i * B + b) * g + grp) * (qpg + 2) + qi) * d;
  }
  int64_t k(int64_t j, int64_t b, int64_t grp) const { return (((j * B + b) * g + grp) * kv_heads + kv_first) * d; }
  int64_t v(int64_t j, int64_t b, int64_t grp) const { return k(j, b, grp) + d; }
  int64_t o(int64_t i, int64_t b, int64_t h) const { return ((i * B + b) * n + h) * d; }
  int64_t row(int64_t i, int64_t b, int64_t h) const { return (i * B + b) * n + h; }
};

/// Keys and values inside qkv [s, b, g, qpg + 2, d].
inline Layout qkv_layout(int64_t B, int64_t g, int64_t qpg, int64_t d) { return {B, g, qpg, g * qpg, d, qpg + 2, qpg}; }
/// Keys and values in their own kv [s, b, g, 2, d].
inline Layout kv_layout(int64_t B, int64_t g, int64_t qpg, int64_t d) { return {B, g, qpg, g * qpg, d, 2, 0}; }

/// Σ_e a[e]·b[e], e = 0 .. d-1, in fp32.
inline float dot(const float* a, const float* b, int64_t d) {
  float acc = 0.f;
  for (int64_t e = 0; e < d; ++e) acc += a[e] * b[e];
  return acc;
}

}  // namespace mt::cpu::attn
