// get_ltor_masks_and_position_ids: the worked example of the issue, a float-free naive transcription
// of Megatron's loop (attention_mask[0, i+1:, :i+1] = 0, position_ids[i+1:] -= i + 1 - prev) on random
// batches, and the pad handling of GPTDataset.__getitem__.
#include "data/masks.h"

#include <gtest/gtest.h>

#include <random>

#include "core/check.h"

namespace mt::data {
namespace {

TEST(Masks, WorkedExample) {
  constexpr int32_t A = 10, B = 11, C = 12, E = 0, D = 13, EE = 14, F = 15, G = 16, H = 17;  // E = EOD
  const std::vector<int32_t> t = {A, B, C, E, D, EE, F, E, G, H};
  LtorOptions o{E, true, true, true};
  std::vector<float> loss(10, -1);
  std::vector<int32_t> pos(10, -1), start(10, -1);
  get_ltor_masks_and_position_ids(t.data(), 1, 10, o, loss.data(), pos.data(), start.data());
  EXPECT_EQ(start, (std::vector<int32_t>{0, 0, 0, 0, 4, 4, 4, 4, 8, 8}));
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
  EXPECT_EQ(loss, (std::vector<float>{1, 1, 1, 0, 1, 1, 1, 0, 1, 1}));
  const auto m = dense_attention_mask(start.data(), 10);
  // D (position 4) sees only itself; E (5) sees D and E; H (9) sees G, H.
  for (int k = 0; k < 10; ++k) EXPECT_EQ(m[4 * 10 + k], k == 4);
  for (int k = 0; k < 10; ++k) EXPECT_EQ(m[5 * 10 + k], k == 4 || k == 5);
  for (int k = 0; k < 10; ++k) EXPECT_EQ(m[9 * 10 + k], k == 8 || k == 9);
  for (int k = 0; k < 10; ++k) EXPECT_EQ(m[3 * 10 + k], k <= 3);  // the EOD belongs to its document
  // Without the flags: plain causal, positions 0..9, loss everywhere.
  get_ltor_masks_and_position_ids(t.data(), 1, 10, LtorOptions{E}, loss.data(), pos.data(), start.data());
  EXPECT_EQ(start, std::vector<int32_t>(10, 0));
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(loss, std::vector<float>(10, 1));
}

TEST(Masks, MatchesMegatronLoopOnRandomBatches) {
  std::mt19937 g(std::random_device{}());
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t b = 1 + g() % 3, s = 1 + g() % 40;
    std::vector<int32_t> t(b * s);
    for (auto& x : t) x = static_cast<int32_t>(g() % 4);  // EOD = 0 often
    const LtorOptions o{0, (g() & 1) != 0, (g() & 1) != 0, (g() & 1) != 0};
    std::vector<float> loss(b * s);
    std::vector<int32_t> pos(b * s), start(b * s);
    get_ltor_masks_and_position_ids(t.data(), b, s, o, loss.data(), pos.data(), start.data());
    for (int64_t r = 0; r < b; ++r) {
      // Megatron's loop, dense.
      std::vector<int> mask(s * s);  // 1 = may attend
      std::vector<int64_t> p(s);
      for (int64_t q = 0; q < s; ++q) {
        p[q] = q;
        for (int64_t k = 0; k < s; ++k) mask[q * s + k] = k <= q;
      }
      int64_t prev = 0;
      for (int64_t i = 0; i < s; ++i) {
        if (t[r * s + i] != 0) continue;
        if (o.reset_attention_mask) {
          for (int64_t q = i + 1; q < s; ++q) {
            for (int64_t k = 0; k <= i; ++k) mask[q * s + k] = 0;
          }
        }
        if (o.reset_position_ids) {
          for (int64_t q = i + 1; q < s; ++q) p[q] -= i + 1 - prev;
          prev = i + 1;
        }
      }
      const auto m = dense_attention_mask(start.data() + r * s, s);
      for (int64_t q = 0; q < s; ++q) {
        ASSERT_EQ(pos[r * s + q], p[q]);
        ASSERT_EQ(loss[r * s + q], (o.eod_mask_loss && t[r * s + q] == 0) ? 0.f : 1.f);
        for (int64_t k = 0; k < s; ++k) ASSERT_EQ(m[q * s + k], mask[q * s + k]) << q << " " << k;
      }
    }
  }
}

TEST(Masks, PrepareBatchHandlesPadding) {
  // One sample [s + 1] = 5 tokens + 2 pads (a partial last sample).
  const std::vector<int32_t> sample = {5, 6, 0, 7, 8, -1, -1};
  std::vector<int32_t> tokens(6), labels(6), pos(6), start(6);
  std::vector<float> loss(6);
  prepare_ltor_batch(sample.data(), 1, 6, LtorOptions{0, true, true, false}, tokens.data(), labels.data(), loss.data(),
                     pos.data(), start.data());
  EXPECT_EQ(tokens, (std::vector<int32_t>{5, 6, 0, 7, 8, 0}));
  EXPECT_EQ(labels, (std::vector<int32_t>{6, 0, 7, 8, 0, 0}));
  EXPECT_EQ(loss, (std::vector<float>{1, 1, 1, 1, 0, 0}));
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 0, 1, 2}));
  EXPECT_THROW(get_ltor_masks_and_position_ids(nullptr, -1, 3, LtorOptions{}, nullptr, nullptr, nullptr), mt::Error);
}

}  // namespace
}  // namespace mt::data
