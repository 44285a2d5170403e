// numpy_random: NumPy's legacy RandomState (MT19937 + shuffle) and default_rng(seed).integers
// (SeedSequence + PCG64 + Lemire), bit for bit.
//
// What each check establishes:
//  - Mt19937MatchesReference: the generator is MT19937 with init_genrand seeding (the reference
//    output for seed 5489 from Matsumoto & Nishimura's mt19937ar.c, 3499211612, 581869302, ...; and
//    equality with std::mt19937, which the C++ standard specifies, including its 10000th output
//    4123659995). NumPy's RandomState(int) uses exactly mt19937_seed == init_genrand (_mt19937.pyx
//    _legacy_seeding), so this needs no NumPy.
//  - ShuffleMatchesTransliteration: shuffle/permutation equal a direct transcription of mtrand.pyx
//    _shuffle_raw + distributions.c random_interval written in the test on top of std::mt19937.
//  - KnownNumpyOutputs: values printed by NumPy 1.24.2 (Debian python3-numpy) for a few calls,
//    hard-coded, so the test stands without the fixture files.
//  - MatchesNumpyFixture: many more cases from tests/data/fixtures/megatron_ref/numpy.json
//    (tools/megatron_ref/gen_fixtures.py, real NumPy); skipped when the fixture is absent.
#include "data/numpy_random.h"

#include <gtest/gtest.h>

#include <random>

#include "megatron_ref_util.h"

namespace mt::data {
namespace {

TEST(NumpyRandom, Mt19937MatchesReference) {
  NumpyRandomState rs(5489);
  const uint32_t expected[] = {3499211612u, 581869302u, 3890346734u, 3586334585u, 545404204u};
  for (uint32_t e : expected) EXPECT_EQ(rs.next_uint32(), e);
  for (uint64_t seed : {0ull, 1ull, 1234ull, 5489ull, 4294967295ull}) {
    NumpyRandomState a(seed);
    std::mt19937 b(static_cast<uint32_t>(seed));
    for (int i = 0; i < 5000; ++i) ASSERT_EQ(a.next_uint32(), b()) << "seed " << seed << " draw " << i;
  }
  NumpyRandomState d(5489);
  uint32_t v = 0;
  for (int i = 0; i < 10000; ++i) v = d.next_uint32();
  EXPECT_EQ(v, 4123659995u);  // [rand.predef]: the 10000th invocation of a default-constructed mt19937
  NumpyRandomState e(3);
  std::mt19937 f(3);
  const uint64_t hi = f(), lo = f();
  EXPECT_EQ(e.next_uint64(), (hi << 32) | lo);
}

// Transcription of NumPy's legacy shuffle for the test: for i in reversed(range(1, n)):
// j = random_interval(i) (mask = next power of two - 1, reject > i, 32-bit draws); swap.
std::vector<int64_t> reference_shuffle(uint32_t seed, int64_t n) {
  std::mt19937 g(seed);
  std::vector<int64_t> a(n);
  for (int64_t i = 0; i < n; ++i) a[i] = i;
  for (int64_t i = n - 1; i >= 1; --i) {
    uint64_t mask = static_cast<uint64_t>(i);
    for (int s = 1; s < 64; s <<= 1) mask |= mask >> s;
    uint64_t j;
    do {
      j = g() & mask;
    } while (j > static_cast<uint64_t>(i));
    std::swap(a[i], a[j]);
  }
  return a;
}

TEST(NumpyRandom, ShuffleMatchesTransliteration) {
  for (uint32_t seed : {0u, 7u, 1234u, 4294967295u}) {
    for (int64_t n : {0, 1, 2, 3, 17, 1000}) {
      NumpyRandomState rs(seed);
      EXPECT_EQ(rs.permutation(n), reference_shuffle(seed, n)) << seed << " " << n;
    }
  }
}

TEST(NumpyRandom, KnownNumpyOutputs) {
  // numpy 1.24.2: rs = np.random.RandomState(1234); a = np.arange(20, dtype=np.int32); rs.shuffle(a)
  NumpyRandomState rs(1234);
  std::vector<int32_t> a(20);
  for (int i = 0; i < 20; ++i) a[i] = i;
  rs.shuffle(a);
  EXPECT_EQ(a, (std::vector<int32_t>{3, 13, 2, 16, 14, 5, 4, 0, 8, 18, 17, 11, 10, 9, 7, 1, 19, 12, 6, 15}));
  // np.random.RandomState(7).permutation(10)
  EXPECT_EQ(NumpyRandomState(7).permutation(10), (std::vector<int64_t>{8, 5, 0, 2, 1, 9, 7, 3, 6, 4}));
  // np.random.default_rng(0).integers(1, 4096, size=10, dtype=np.int32)
  EXPECT_EQ(NumpyPcg64(0).integers_int32(1, 4096, 10),
            (std::vector<int32_t>{3484, 2609, 2094, 1105, 1261, 168, 309, 68, 718, 3331}));
  // np.random.default_rng(12345678901234).integers(-5, 100000, size=10, dtype=np.int32)
  EXPECT_EQ(NumpyPcg64(12345678901234ull).integers_int32(-5, 100000, 10),
            (std::vector<int32_t>{49794, 40634, 88192, 2615, 32325, 62058, 27333, 3239, 21340, 13801}));
}

TEST(NumpyRandom, MatchesNumpyFixture) {
  const auto j = testing::load_megatron_fixture("numpy.json");
  MT_REQUIRE_FIXTURE(j, "numpy.json");
  for (const auto& c : j.at("shuffles")) {
    NumpyRandomState rs(c.at("seed").get<uint64_t>());
    std::vector<int32_t> a(c.at("n").get<size_t>());
    for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<int32_t>(i);
    rs.shuffle(a);
    EXPECT_EQ(a, c.at("result").get<std::vector<int32_t>>()) << c.at("seed") << " " << c.at("n");
  }
  for (const auto& c : j.at("random_interval")) {
    NumpyRandomState rs(c.at("seed").get<uint64_t>());
    for (uint64_t v : c.at("result").get<std::vector<uint64_t>>()) {
      EXPECT_EQ(rs.random_interval(c.at("max").get<uint64_t>()), v) << c.at("seed");
    }
  }
  for (const auto& c : j.at("integers_int32")) {
    const auto expected = c.at("result").get<std::vector<int32_t>>();
    EXPECT_EQ(NumpyPcg64(c.at("seed").get<uint64_t>())
                  .integers_int32(c.at("low").get<int32_t>(), c.at("high").get<int32_t>(),
                                  static_cast<int64_t>(expected.size())),
              expected)
        << c.at("seed");
  }
  const auto lengths = NumpyPcg64(0).integers_int32(1, 4096, 100000);
  const auto& m = j.at("mock_lengths");
  int64_t sum = 0;
  for (int32_t v : lengths) sum += v;
  EXPECT_EQ(sum, m.at("sum").get<int64_t>());
  const auto first = m.at("first").get<std::vector<int32_t>>();
  EXPECT_EQ(std::vector<int32_t>(lengths.begin(), lengths.begin() + static_cast<std::ptrdiff_t>(first.size())), first);
  const auto last = m.at("last").get<std::vector<int32_t>>();
  EXPECT_EQ(std::vector<int32_t>(lengths.end() - static_cast<std::ptrdiff_t>(last.size()), lengths.end()), last);
}

TEST(NumpyRandom, Errors) {
  testing::expect_error([] { NumpyRandomState rs(1ull << 32); }, {"2**32 - 1"});
  testing::expect_error([] { NumpyPcg64(0).integers_int32(5, 5, 1); }, {"low 5 >= high 5"});
}

}  // namespace
}  // namespace mt::data
