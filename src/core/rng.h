// Philox4x32-10 counter-based RNG (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11), usable on host and device with bit-identical output. Layout invariance (docs/architecture.md
// principle 4): every random number is a pure function of (key, counter), where key = (seed,
// stream id) and the counter carries the global element index and, for dropout, the iteration
// and micro-batch. Nothing is stateful, so recompute and any sharding reproduce the same bits.
#pragma once
#include <cmath>
#include <cstdint>
#include <string_view>

#include "core/dtype.h"  // MT_HD

namespace mt {

struct Philox4 {
  uint32_t v[4];
};

MT_HD uint32_t philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

/// Philox4x32 with 10 rounds. Known-answer: counter 0, key 0 ->
/// {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8} (Random123 kat_vectors).
MT_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    uint32_t lo0 = philox_mulhilo(kM0, c0, &hi0);
    uint32_t lo1 = philox_mulhilo(kM1, c2, &hi1);
    uint32_t n0 = hi1 ^ c1 ^ k0;
    uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

/// Uniform in (0, 1] with 24 random bits (never 0, so log() is safe).
MT_HD float uint_to_unit_float(uint32_t x) { return (static_cast<float>(x >> 8) + 1.0f) * (1.0f / 16777216.0f); }

/// Standard normal for global element index `i` of the tensor with stream id `tensor_id`
/// (Box-Muller in double precision, so host and device agree to the last float bit in practice).
MT_HD float philox_normal(uint64_t seed, uint32_t tensor_id, uint64_t i) {
  Philox4 r = philox4x32_10(static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), 0x1717u, 0u,
                            static_cast<uint32_t>(seed) ^ static_cast<uint32_t>(seed >> 32) * 0x9E3779B9u,
                            tensor_id);
  double u1 = (static_cast<double>(r.v[0]) + 1.0) * (1.0 / 4294967296.0);
  double u2 = static_cast<double>(r.v[1]) * (1.0 / 4294967296.0);
  return static_cast<float>(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/// Dropout keep decision for global element `i` at site (iteration, micro-batch, stream id):
/// keep iff the 32-bit draw >= threshold, threshold = round(p * 2^32). One Philox call gives
/// the draws of 4 consecutive elements (i & ~3 .. i | 3).
MT_HD uint32_t dropout_threshold(float p) {
  double t = static_cast<double>(p) * 4294967296.0;
  return t >= 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t);
}
MT_HD Philox4 dropout_bits4(uint64_t seed, uint32_t stream_id, uint64_t iteration, uint32_t microbatch,
                            uint64_t group) {
  return philox4x32_10(static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32),
                       static_cast<uint32_t>(iteration), microbatch,
                       static_cast<uint32_t>(seed) ^ static_cast<uint32_t>(seed >> 32) * 0x9E3779B9u,
                       stream_id ^ 0x80000000u);
}

/// The iteration a dropout draw uses: *ptr when set (device memory read when the kernel runs,
/// so a captured CUDA graph sees each step's value), else the host value baked into the call.
MT_HD uint64_t dropout_iteration(const uint64_t* ptr, uint64_t value) { return ptr != nullptr ? *ptr : value; }
/// The micro-batch a dropout draw uses: *ptr when set (the slot's key of a per-layer CUDA graph,
/// replayed for every micro-batch that uses the slot), else the host value.
MT_HD uint32_t dropout_microbatch(const uint32_t* ptr, uint32_t value) { return ptr != nullptr ? *ptr : value; }

/// Key for the dropout of one site: everything that identifies where the mask is used.
struct DropoutKey {
  uint64_t seed = 0;
  uint64_t iteration = 0;
  uint32_t microbatch = 0;
  uint32_t stream_id = 0;  ///< e.g. layer * 8 + site (model/module.h dropout_key)
  /// When set, the iteration is read from here (device memory of the tensors' device; CPU: host
  /// memory) when the kernel runs instead of `iteration`, so that a captured step (CUDA graph)
  /// draws each step's masks (docs/architecture.md principle 8).
  const uint64_t* iteration_ptr = nullptr;
  /// When set, the micro-batch is read from here when the kernel runs (per-layer CUDA graphs).
  const uint32_t* microbatch_ptr = nullptr;
  MT_HD uint64_t current_iteration() const { return dropout_iteration(iteration_ptr, iteration); }
  MT_HD uint32_t current_microbatch() const { return dropout_microbatch(microbatch_ptr, microbatch); }
  /// Context parallelism (parallel/context_parallel.h), read by the element-wise dropout ops
  /// (ops/elementwise.h) only: with cp_size N > 1 their flat indices (global_offset + local index)
  /// address this CP rank's [s/N, b, h] activations, i.e. two chunks of cp_chunk_elems
  /// E = s/(2N)·b·h elements of the full [s, b, h] tensor, chunk cp_rank then chunk 2N−1−cp_rank.
  /// cp_global maps such an index to the full tensor's, so the mask is that of one rank. The
  /// attention ops ignore these fields (they key by the tokens' global positions).
  int64_t cp_chunk_elems = 0;
  int32_t cp_size = 1;
  int32_t cp_rank = 0;
  MT_HD bool cp_split() const { return cp_size > 1 && cp_chunk_elems > 0; }
  MT_HD int64_t cp_global(int64_t i) const {
    if (!cp_split()) return i;
    return i < cp_chunk_elems ? i + cp_rank * cp_chunk_elems
                              : i - cp_chunk_elems + (2 * int64_t(cp_size) - 1 - cp_rank) * cp_chunk_elems;
  }
};

/// Stable 32-bit id of a named tensor (FNV-1a), used as the Philox key half for its init.
constexpr uint32_t tensor_stream_id(std::string_view name) {
  uint32_t h = 2166136261u;
  for (char c : name) {
    h ^= static_cast<uint8_t>(c);
    h *= 16777619u;
  }
  return h & 0x7fffffffu;  // top bit reserved for dropout streams
}

}  // namespace mt
