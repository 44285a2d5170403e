#include "data/numpy_random.h"

#include "core/check.h"

namespace mt::data {

// ------------------------------------------------------------------------------------------------
// RandomState / MT19937 (Matsumoto & Nishimura 1998; NumPy src/mt19937/mt19937.{h,c})
// ------------------------------------------------------------------------------------------------

NumpyRandomState::NumpyRandomState(uint64_t seed) {
  MT_REQUIRE(seed <= 0xFFFFFFFFull, "numpy RandomState: seed {} is not in [0, 2**32 - 1] (as NumPy requires)",
             seed);
  // mt19937_seed == init_genrand: Knuth's multiplier 1812433253.
  uint32_t s = static_cast<uint32_t>(seed);
  for (int i = 0; i < 624; ++i) {
    key_[i] = s;
    s = 1812433253u * (s ^ (s >> 30)) + static_cast<uint32_t>(i + 1);
  }
  pos_ = 624;
}

void NumpyRandomState::generate() {
  constexpr int kN = 624, kM = 397;
  constexpr uint32_t kMatrixA = 0x9908b0dfu, kUpper = 0x80000000u, kLower = 0x7fffffffu;
  auto twist = [&](int i, int next, int far) {
    const uint32_t y = (key_[i] & kUpper) | (key_[next] & kLower);
    key_[i] = key_[far] ^ (y >> 1) ^ ((0u - (y & 1u)) & kMatrixA);
  };
  int i = 0;
  for (; i < kN - kM; ++i) twist(i, i + 1, i + kM);
  for (; i < kN - 1; ++i) twist(i, i + 1, i + kM - kN);
  twist(kN - 1, 0, kM - 1);
  pos_ = 0;
}

uint32_t NumpyRandomState::next_uint32() {
  if (pos_ == 624) generate();
  uint32_t y = key_[pos_++];
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= y >> 18;
  return y;
}

uint64_t NumpyRandomState::next_uint64() {
  const uint64_t hi = next_uint32();
  return (hi << 32) | next_uint32();
}

uint64_t NumpyRandomState::random_interval(uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  uint64_t value;
  if (max <= 0xFFFFFFFFull) {
    while ((value = (next_uint32() & mask)) > max) {
    }
  } else {
    while ((value = (next_uint64() & mask)) > max) {
    }
  }
  return value;
}

std::vector<int64_t> NumpyRandomState::permutation(int64_t n) {
  MT_REQUIRE(n >= 0, "numpy RandomState.permutation: negative size {}", n);
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[i] = i;
  shuffle(p);
  return p;
}

// ------------------------------------------------------------------------------------------------
// SeedSequence (O'Neill's seed_seq design as NumPy implements it, bit_generator.pyx)
// ------------------------------------------------------------------------------------------------

namespace {
constexpr uint32_t kInitA = 0x43b0d7e5u, kMultA = 0x931e8875u, kInitB = 0x8b51f9ddu, kMultB = 0x58f38dedu;
constexpr uint32_t kMixMultL = 0xca01f9ddu, kMixMultR = 0x4973f715u;
constexpr int kXShift = 16, kPoolSize = 4;

uint32_t hashmix(uint32_t value, uint32_t* hash_const) {
  value ^= *hash_const;
  *hash_const *= kMultA;
  value *= *hash_const;
  value ^= value >> kXShift;
  return value;
}
uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t r = kMixMultL * x - kMixMultR * y;
  r ^= r >> kXShift;
  return r;
}
}  // namespace

std::vector<uint32_t> numpy_seed_sequence_state(uint64_t entropy, int n_words) {
  // _coerce_to_uint32_array(int): little-endian 32-bit words, [0] for 0.
  std::vector<uint32_t> ent;
  if (entropy == 0) ent.push_back(0);
  for (uint64_t e = entropy; e != 0; e >>= 32) ent.push_back(static_cast<uint32_t>(e));
  std::array<uint32_t, kPoolSize> pool{};
  uint32_t hc = kInitA;
  for (int i = 0; i < kPoolSize; ++i) pool[i] = hashmix(i < static_cast<int>(ent.size()) ? ent[i] : 0u, &hc);
  for (int s = 0; s < kPoolSize; ++s) {
    for (int d = 0; d < kPoolSize; ++d) {
      if (s != d) pool[d] = mix(pool[d], hashmix(pool[s], &hc));
    }
  }
  for (size_t s = kPoolSize; s < ent.size(); ++s) {
    for (int d = 0; d < kPoolSize; ++d) pool[d] = mix(pool[d], hashmix(ent[s], &hc));
  }
  std::vector<uint32_t> out(static_cast<size_t>(n_words));
  uint32_t hb = kInitB;
  for (int i = 0; i < n_words; ++i) {
    uint32_t v = pool[i % kPoolSize];
    v ^= hb;
    hb *= kMultB;
    v *= hb;
    v ^= v >> kXShift;
    out[i] = v;
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// PCG64 (O'Neill 2014, XSL-RR 128/64; NumPy src/pcg64)
// ------------------------------------------------------------------------------------------------

namespace {
constexpr unsigned __int128 kPcgMult =
    (static_cast<unsigned __int128>(2549297995355413924ull) << 64) | 4865540595714422341ull;
}

NumpyPcg64::NumpyPcg64(uint64_t seed) {
  // PCG64(SeedSequence(seed)): generate_state(4, uint64) = 8 uint32 words viewed as little-endian
  // uint64; seed = (w[0] << 64) | w[1], inc = (w[2] << 64) | w[3]; pcg_setseq_128_srandom_r.
  const std::vector<uint32_t> w32 = numpy_seed_sequence_state(seed, 8);
  uint64_t w[4];
  for (int i = 0; i < 4; ++i) w[i] = static_cast<uint64_t>(w32[2 * i]) | (static_cast<uint64_t>(w32[2 * i + 1]) << 32);
  const unsigned __int128 init_state = (static_cast<unsigned __int128>(w[0]) << 64) | w[1];
  const unsigned __int128 init_seq = (static_cast<unsigned __int128>(w[2]) << 64) | w[3];
  state_ = 0;
  inc_ = (init_seq << 1) | 1u;
  state_ = state_ * kPcgMult + inc_;
  state_ += init_state;
  state_ = state_ * kPcgMult + inc_;
}

uint64_t NumpyPcg64::next_uint64() {
  state_ = state_ * kPcgMult + inc_;
  const uint64_t x = static_cast<uint64_t>(state_ >> 64) ^ static_cast<uint64_t>(state_);
  const unsigned rot = static_cast<unsigned>(state_ >> 122);
  return (x >> rot) | (x << ((64u - rot) & 63u));
}

uint32_t NumpyPcg64::next_uint32() {
  if (has_uint32_) {
    has_uint32_ = false;
    return uinteger_;
  }
  const uint64_t next = next_uint64();
  has_uint32_ = true;
  uinteger_ = static_cast<uint32_t>(next >> 32);
  return static_cast<uint32_t>(next & 0xFFFFFFFFu);
}

std::vector<int32_t> NumpyPcg64::integers_int32(int32_t low, int32_t high, int64_t n) {
  MT_REQUIRE(low < high, "numpy Generator.integers: low {} >= high {}", low, high);
  MT_REQUIRE(n >= 0, "numpy Generator.integers: negative size {}", n);
  const uint32_t rng = static_cast<uint32_t>(static_cast<int64_t>(high) - 1 - low);  // closed range width
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    uint32_t v;
    if (rng == 0) {
      v = 0;
    } else if (rng == 0xFFFFFFFFu) {
      v = next_uint32();
    } else {  // buffered_bounded_lemire_uint32
      const uint32_t rng_excl = rng + 1;
      uint64_t m = static_cast<uint64_t>(next_uint32()) * rng_excl;
      uint32_t leftover = static_cast<uint32_t>(m);
      if (leftover < rng_excl) {
        const uint32_t threshold = (0xFFFFFFFFu - rng) % rng_excl;
        while (leftover < threshold) {
          m = static_cast<uint64_t>(next_uint32()) * rng_excl;
          leftover = static_cast<uint32_t>(m);
        }
      }
      v = static_cast<uint32_t>(m >> 32);
    }
    out[i] = static_cast<int32_t>(static_cast<uint32_t>(low) + v);
  }
  return out;
}

}  // namespace mt::data
