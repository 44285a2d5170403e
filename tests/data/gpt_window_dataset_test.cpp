// Windowed GPT dataset: --split parsing, Megatron-Core's document split rule (worked examples
// computed with a transcription of blended_megatron_dataset_config.py / _build_megatron_dataset_splits),
// windows against a naive concatenation, token range checks, and the resumable sample order.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <optional>

#include "data/gpt_window_dataset.h"
#include "data/indexed_dataset.h"
#include "data_test_util.h"
#include "testing/testing.h"

namespace mt::data {
namespace {

using testing::expect_error;
using testing::TempDir;

TEST(Split, Parse) {
  auto near = [](std::array<double, 3> a, std::array<double, 3> b) {
    for (int i = 0; i < 3; ++i) EXPECT_NEAR(a[i], b[i], 1e-15) << i;
  };
  near(parse_split("969,30,1"), {0.969, 0.03, 0.001});
  near(parse_split("98/2/0"), {0.98, 0.02, 0.0});
  near(parse_split("1"), {1.0, 0.0, 0.0});
  near(parse_split(" 80, 20 "), {0.8, 0.2, 0.0});
  near(parse_split("99.5,0.5"), {0.995, 0.005, 0.0});
  near(parse_split("1,1,2"), {0.25, 0.25, 0.5});
  expect_error([] { parse_split(""); }, {"empty"});
  expect_error([] { parse_split("a,b"); }, {"\"a\"", "not a non-negative number"});
  expect_error([] { parse_split("1,2,3,4"); }, {"more than 3"});
  expect_error([] { parse_split("0,0,0"); }, {"all weights are zero"});
  expect_error([] { parse_split("-1,2"); }, {"-1"});
  expect_error([] { parse_split("1,,2"); }, {"1,,2"});
  expect_error([] { parse_split("1.2.3"); }, {"1.2.3"});
  expect_error([] { parse_split("1e3"); }, {"1e3"});
}

TEST(Split, DocumentRangesMatchMegatronCore) {
  using R = std::pair<int64_t, int64_t>;
  struct Case {
    const char* split;
    int64_t n;
    std::array<R, 3> expected;
  };
  // Values from the Python transcription of Megatron-Core (int(round(bookend * n)), round half even).
  const std::vector<Case> cases = {
      {"969,30,1", 1000, {R{0, 969}, R{969, 999}, R{999, 1000}}},
      {"969,30,1", 10, {R{0, 10}, R{10, 10}, R{10, 10}}},
      {"969,30,1", 234, {R{0, 227}, R{227, 234}, R{234, 234}}},
      {"50,50", 5, {R{0, 2}, R{2, 5}, R{5, 5}}},  // 2.5 rounds to 2 (half to even)
      {"50,50", 7, {R{0, 4}, R{4, 7}, R{7, 7}}},  // 3.5 rounds to 4
      {"98/2/0", 234, {R{0, 229}, R{229, 234}, R{234, 234}}},
      {"1,1,1", 10, {R{0, 3}, R{3, 7}, R{7, 10}}},
      {"1,1,1", 100, {R{0, 33}, R{33, 67}, R{67, 100}}},
      {"0,1,0", 9, {R{0, 0}, R{0, 9}, R{9, 9}}},
      {"949,50,1", 1, {R{0, 1}, R{1, 1}, R{1, 1}}},
      {"2,1,1", 6, {R{0, 3}, R{3, 4}, R{4, 6}}},
      {"99.5,0.5", 3, {R{0, 3}, R{3, 3}, R{3, 3}}},
      {"1,1,2", 2, {R{0, 0}, R{0, 1}, R{1, 2}}},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(split_document_ranges(parse_split(c.split), c.n), c.expected) << c.split << " n=" << c.n;
  }
  // Ranges always tile [0, n).
  for (int64_t n : {0, 1, 2, 3, 17, 1001}) {
    for (const char* s : {"969,30,1", "1,1,1", "0,0,1", "3,0,7"}) {
      const auto r = split_document_ranges(parse_split(s), n);
      EXPECT_EQ(r[0].first, 0);
      EXPECT_EQ(r[0].second, r[1].first);
      EXPECT_EQ(r[1].second, r[2].first);
      EXPECT_EQ(r[2].second, n) << s << " n=" << n;
    }
  }
  EXPECT_EQ(split_name(1), "valid");
}

// A dataset of random documents (some empty) written with the builder; returns the documents.
std::vector<std::vector<int32_t>> make_dataset(const std::string& prefix, int num_docs, int32_t vocab,
                                               std::mt19937_64& rng) {
  std::vector<std::vector<int32_t>> docs(num_docs);
  IndexedDatasetBuilder b(prefix, IndexDType::kUInt16);
  for (auto& d : docs) {
    const int len = rng() % 5 == 0 ? 0 : 1 + static_cast<int>(rng() % 40);
    for (int k = 0; k < len; ++k) d.push_back(static_cast<int32_t>(rng() % vocab));
    b.add_document(d);
  }
  b.finalize();
  return docs;
}

TEST(GptWindowDataset, WindowsMatchConcatenation) {
  auto& rng = mt::testing::test_rng();
  TempDir dir;
  const auto docs = make_dataset(dir.file("ds"), 60, 1000, rng);
  auto ds = std::make_shared<const IndexedDataset>(dir.file("ds"));
  const auto ranges = split_document_ranges(parse_split("80,15,5"), ds->num_documents());
  for (int64_t seq : {1, 7, 16}) {
    for (int s = 0; s < 2; ++s) {  // train and valid
      const auto [b, e] = ranges[s];
      std::vector<int32_t> stream;
      for (int64_t d = b; d < e; ++d) stream.insert(stream.end(), docs[d].begin(), docs[d].end());
      if (static_cast<int64_t>(stream.size()) < seq + 1) continue;
      GptWindowDataset w(ds, b, e, seq, std::string(split_name(s)));
      EXPECT_EQ(w.num_tokens(), static_cast<int64_t>(stream.size()));
      EXPECT_EQ(w.num_samples(), (static_cast<int64_t>(stream.size()) - 1) / seq);
      std::vector<int32_t> out(seq + 1);
      for (int64_t i = 0; i < w.num_samples(); ++i) {
        std::fill(out.begin(), out.end(), -7);
        w.get(i, out.data());
        ASSERT_EQ(out, std::vector<int32_t>(stream.begin() + i * seq, stream.begin() + i * seq + seq + 1))
            << "sample " << i << " seq " << seq;
      }
      expect_error([&] { w.get(w.num_samples(), out.data()); }, {"out of range"});
      EXPECT_NO_THROW(w.check_token_range(1000));
    }
  }
}

TEST(GptWindowDataset, Errors) {
  TempDir dir;
  {
    IndexedDatasetBuilder b(dir.file("small"), IndexDType::kInt32);
    b.add_document(std::vector<int32_t>{1, 2, 3});
    b.add_document(std::vector<int32_t>{});
    b.add_document(std::vector<int32_t>{4, 50257, 6});
    b.finalize();
  }
  auto ds = std::make_shared<const IndexedDataset>(dir.file("small"));
  expect_error([&] { GptWindowDataset w(ds, 0, 2, 3, "valid"); }, {"valid split", "3 tokens", "4"});
  expect_error([&] { GptWindowDataset w(ds, 2, 4, 3); }, {"[2, 4)"});
  expect_error([&] { GptWindowDataset w(ds, 0, 3, 0); }, {"seq_length"});
  GptWindowDataset w(ds, 0, 3, 2);
  EXPECT_EQ(w.num_samples(), 2);
  expect_error([&] { w.check_token_range(50257); }, {"token id 50257", "position 4", "document 2", "sequence 1"});
  EXPECT_NO_THROW(w.check_token_range(50258));
  GptWindowDataset first(ds, 0, 1, 2);
  EXPECT_NO_THROW(first.check_token_range(4));
  expect_error([&] { first.check_token_range(3); }, {"token id 3", "position 2"});
}

TEST(Sampler, SplitMixAndPermutations) {
  EXPECT_EQ(splitmix64(0), 0xE220A8397B1DCDAFull);  // first output of SplitMix64 seeded with 0
  const auto p = epoch_permutation(10, 1234, 0);
  std::vector<int64_t> sorted = p;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> iota(10);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_EQ(sorted, iota);
  // Pinned value: the order is fully specified (SplitMix64 + std::mt19937_64 + our Fisher-Yates), so
  // it is the same on every platform and must not change between versions.
  EXPECT_EQ(p, (std::vector<int64_t>{4, 2, 3, 1, 9, 5, 6, 8, 0, 7}));  // also from a Python transcription
  EXPECT_NE(epoch_permutation(10, 1234, 1), p);
  EXPECT_NE(epoch_permutation(10, 1235, 0), p);
  EXPECT_EQ(epoch_permutation(10, 1234, 0), p);
  EXPECT_TRUE(epoch_permutation(0, 1, 0).empty());
  EXPECT_EQ(epoch_permutation(1, 1, 0), std::vector<int64_t>{0});
}

// Uniformity smoke test of the shuffle: position of element 0 over many epochs of n = 4.
TEST(Sampler, ShuffleIsRoughlyUniform) {
  std::array<int, 4> count{};
  const int epochs = 8000;
  for (int e = 0; e < epochs; ++e) {
    const auto p = epoch_permutation(4, 99, e);
    count[std::find(p.begin(), p.end(), 0) - p.begin()]++;
  }
  for (int c : count) EXPECT_NEAR(c, epochs / 4, 200);  // ~ 5 sigma
}

TEST(Sampler, OrderEpochsAndResume) {
  auto& rng = mt::testing::test_rng();
  TempDir dir;
  make_dataset(dir.file("ds"), 80, 500, rng);
  auto ds = std::make_shared<const IndexedDataset>(dir.file("ds"));
  GptWindowDataset w(ds, 0, ds->num_documents(), 8);
  const int64_t n = w.num_samples(), row = 9;
  ASSERT_GE(n, 20);
  for (bool shuffle : {false, true}) {
    GptSampler sampler(w, 42, shuffle);
    // Each epoch visits every sample exactly once.
    for (int64_t e = 0; e < 3; ++e) {
      std::vector<int64_t> seen;
      for (int64_t p = 0; p < n; ++p) seen.push_back(sampler.sample_index(e * n + p));
      if (!shuffle) {
        std::vector<int64_t> iota(n);
        std::iota(iota.begin(), iota.end(), 0);
        EXPECT_EQ(seen, iota);
      }
      std::sort(seen.begin(), seen.end());
      EXPECT_EQ(std::unique(seen.begin(), seen.end()) - seen.begin(), n);
    }
    // A long run of batches equals batches fetched after "resuming" at any consumed count.
    const int64_t batch = 5, steps = (3 * n) / batch;
    std::vector<int32_t> all(steps * batch * row);
    for (int64_t s = 0; s < steps; ++s) sampler.get_batch(s * batch, batch, all.data() + s * batch * row);
    for (int64_t resume : {int64_t{0}, int64_t{5}, n - 2, n + 3, 2 * n - 1}) {
      const int64_t count = std::min<int64_t>(7, steps * batch - resume);
      std::vector<int32_t> got(count * row);
      get_batch(w, resume, count, 42, shuffle, got.data());  // fresh sampler, as after a restart
      EXPECT_EQ(got, std::vector<int32_t>(all.begin() + resume * row, all.begin() + (resume + count) * row))
          << "resume at " << resume << " shuffle " << shuffle;
    }
    // Rows are the samples of the order.
    std::vector<int32_t> sample(row);
    w.get(sampler.sample_index(n + 1), sample.data());
    EXPECT_EQ(std::vector<int32_t>(all.begin() + (n + 1) * row, all.begin() + (n + 2) * row), sample);
  }
  // Different seeds give different shuffled orders.
  GptSampler a(w, 1, true), b(w, 2, true);
  std::vector<int64_t> oa, ob;
  for (int64_t p = 0; p < n; ++p) {
    oa.push_back(a.sample_index(p));
    ob.push_back(b.sample_index(p));
  }
  EXPECT_NE(oa, ob);
}

}  // namespace
}  // namespace mt::data
