// Bit-exact reproductions of the NumPy random streams that Megatron-LM's data pipeline consumes.
//
// 1. numpy.random.RandomState(seed) (the "legacy" generator; numpy/random/mtrand.pyx, _mt19937.pyx,
//    src/mt19937/mt19937.c, src/distributions/distributions.c), used by Megatron-Core's GPTDataset
//    for the document and shuffle indices:
//      - seeding with a Python int in [0, 2^32 - 1] is MT19937's init_genrand(seed) (mt19937_seed),
//        i.e. the same state as std::mt19937(seed);
//      - next_uint32 = tempered MT19937 output; next_uint64 = (first << 32) | second;
//      - random_interval(max): mask = smallest 2^k - 1 >= max; draw (next_uint32 & mask) while
//        > max (next_uint64 when max > 2^32 - 1);
//      - shuffle(x) (1-D arrays, any dtype): for i = n-1 down to 1: j = random_interval(i);
//        swap(x[i], x[j]);  permutation(n) = shuffle(arange(n)).
// 2. numpy.random.default_rng(seed).integers(low, high, size, dtype=int32) (PCG64 seeded through
//    SeedSequence; numpy/random/bit_generator.pyx, src/pcg64/pcg64.{h,c}, _bounded_integers.pyx,
//    src/distributions/distributions.c: buffered_bounded_lemire_uint32), used by Megatron's
//    MockGPTLowLevelDataset for its sequence lengths.
//
// Both are verified against NumPy's own output in tests/data/numpy_random_test.cpp.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <vector>

namespace mt::data {

/// numpy.random.RandomState (MT19937) restricted to what Megatron's datasets use.
class NumpyRandomState {
 public:
  /// RandomState(seed) for an integer seed. Error (mt::Error): seed > 2^32 - 1 (NumPy raises
  /// "Seed must be between 0 and 2**32 - 1").
  explicit NumpyRandomState(uint64_t seed);

  /// One tempered MT19937 output (NumPy's next_uint32 / random_uint32).
  uint32_t next_uint32();
  /// (next_uint32() << 32) | next_uint32().
  uint64_t next_uint64();
  /// NumPy's random_interval(max): uniform in [0, max] by masked rejection.
  uint64_t random_interval(uint64_t max);

  /// RandomState.shuffle on a 1-D array (in place).
  template <typename T>
  void shuffle(std::span<T> x) {
    for (int64_t i = static_cast<int64_t>(x.size()) - 1; i >= 1; --i) {
      const auto j = static_cast<int64_t>(random_interval(static_cast<uint64_t>(i)));
      std::swap(x[i], x[j]);
    }
  }
  template <typename T>
  void shuffle(std::vector<T>& x) {
    shuffle(std::span<T>(x.data(), x.size()));
  }
  /// RandomState.permutation(n): shuffle(arange(n)).
  std::vector<int64_t> permutation(int64_t n);

 private:
  std::array<uint32_t, 624> key_{};
  int pos_ = 624;
  void generate();
};

/// numpy.random.SeedSequence(entropy).generate_state(n_words, uint32) for a non-negative integer
/// entropy < 2^64 (pool size 4, no spawn key).
std::vector<uint32_t> numpy_seed_sequence_state(uint64_t entropy, int n_words);

/// numpy.random.Generator(PCG64(SeedSequence(seed))) = numpy.random.default_rng(seed), restricted
/// to integers(low, high, dtype=int32).
class NumpyPcg64 {
 public:
  explicit NumpyPcg64(uint64_t seed);
  /// PCG64 next_uint64 (XSL-RR output of the stepped 128-bit LCG state).
  uint64_t next_uint64();
  /// PCG64 next_uint32: the low half of a 64-bit draw, the high half on the next call.
  uint32_t next_uint32();
  /// Generator.integers(low, high, size=n, dtype=numpy.int32) (high exclusive; Lemire's method).
  /// Error: low >= high.
  std::vector<int32_t> integers_int32(int32_t low, int32_t high, int64_t n);

 private:
  unsigned __int128 state_ = 0, inc_ = 0;
  bool has_uint32_ = false;
  uint32_t uinteger_ = 0;
};

}  // namespace mt::data
