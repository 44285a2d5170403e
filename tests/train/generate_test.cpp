// Sampling rules of `megatron generate` (train/generate.h): greedy, temperature, top-k, top-p.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "train/generate.h"

namespace mt {
namespace {

std::map<int32_t, int> histogram(const std::vector<float>& logits, bool greedy, float t, int64_t k, float p,
                                 int n = 4000) {
  std::mt19937_64 rng(42);
  std::map<int32_t, int> h;
  for (int i = 0; i < n; ++i) h[sample_token(logits, greedy, t, k, p, rng)]++;
  return h;
}

TEST(SampleToken, GreedyTakesArgmax) {
  EXPECT_EQ(histogram({0.1f, 3.f, 2.f, -1.f}, true, 1.f, 0, 0.f, 10), (std::map<int32_t, int>{{1, 10}}));
}

TEST(SampleToken, TopKRestrictsSupport) {
  const std::vector<float> l{1.f, 0.5f, 2.f, 0.f, 1.5f};
  auto h = histogram(l, false, 1.f, 2, 0.f);
  EXPECT_EQ(h.size(), 2u);
  EXPECT_TRUE(h.count(2) && h.count(4));
  // Renormalised softmax over {2.0, 1.5}: p(2) = 1 / (1 + e^-0.5) = 0.6225.
  EXPECT_NEAR(h[2] / 4000.0, 0.6225, 0.03);
}

TEST(SampleToken, TopPKeepsSmallestNucleus) {
  // Probabilities ~ [0.665, 0.245, 0.090]: top-p 0.6 keeps only the first, 0.8 the first two.
  const std::vector<float> l{2.f, 1.f, 0.f};
  EXPECT_EQ(histogram(l, false, 1.f, 0, 0.6f).size(), 1u);
  auto h = histogram(l, false, 1.f, 0, 0.8f);
  EXPECT_EQ(h.size(), 2u);
  EXPECT_FALSE(h.count(2));
}

TEST(SampleToken, TemperatureSharpensAndFlattens) {
  const std::vector<float> l{1.f, 0.f};
  auto cold = histogram(l, false, 0.1f, 0, 0.f), hot = histogram(l, false, 10.f, 0, 0.f);
  EXPECT_GT(cold[0], 3990);                      // p = 1 / (1 + e^-10)
  EXPECT_NEAR(hot[0] / 4000.0, 0.525, 0.03);     // p = 1 / (1 + e^-0.1)
}

// The vocabulary padding is never sampled, however large its logits are.
TEST(SampleToken, PaddedVocabularyIsNeverSampled) {
  std::vector<float> padded{0.5f, 1.f, 0.f, 100.f, 200.f};  // 3 real tokens, 2 padded entries
  const std::vector<float> real = vocab_logits(padded.data(), 5, 3);
  ASSERT_EQ(real.size(), 3u);
  std::mt19937_64 rng(7);
  for (int i = 0; i < 2000; ++i) {
    const int32_t t = sample_token(real, i % 2 == 0, 2.f, 0, 0.f, rng);
    ASSERT_GE(t, 0);
    ASSERT_LT(t, 3);
  }
  EXPECT_EQ(sample_token(real, true, 1.f, 0, 0.f, rng), 1);
  EXPECT_THROW(vocab_logits(padded.data(), 5, 6), Error);
}

TEST(SampleToken, RefusesNonFiniteLogits) {
  std::mt19937_64 rng(1);
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    std::vector<float> l = {0.5f, 1.f, bad, 0.f};
    for (bool greedy : {true, false}) {
      try {
        mt::sample_token(l, greedy, 1.f, 0, 0.f, rng);
        ADD_FAILURE() << "accepted " << bad;
      } catch (const mt::Error& e) {
        EXPECT_NE(std::string(e.what()).find("non-finite logit"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("token 2"), std::string::npos) << e.what();
      }
    }
  }
}

TEST(SampleToken, BadArguments) {
  std::mt19937_64 rng(1);
  EXPECT_THROW(sample_token({1.f}, false, 0.f, 0, 0.f, rng), Error);
  EXPECT_THROW(sample_token({1.f}, false, 1.f, -1, 0.f, rng), Error);
  EXPECT_THROW(sample_token({1.f}, false, 1.f, 0, 1.5f, rng), Error);
  EXPECT_THROW(sample_token({}, true, 1.f, 0, 0.f, rng), Error);
}

}  // namespace
}  // namespace mt
