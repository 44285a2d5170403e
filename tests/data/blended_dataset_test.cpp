// BlendedDataset, blend parsing, and build_gpt_datasets: blending choice sequences, per-dataset
// sample counts and the resulting samples against Megatron-LM's own code (fixture blend.json from
// tools/megatron_ref/gen_fixtures.py), plus self-contained properties and the documented errors.
#include "data/blended_dataset.h"

#include <gtest/gtest.h>

#include <CLI/CLI.hpp>

#include "data/data_args.h"
#include "data/mock_dataset.h"
#include "megatron_ref_util.h"

namespace mt::data {
namespace {

using testing::expect_error;
using testing::TempDir;

TEST(Blend, Parse) {
  Blend b = parse_blend({"30", "a", "70", "b"});
  EXPECT_EQ(b.prefixes, (std::vector<std::string>{"a", "b"}));
  ASSERT_TRUE(b.weights);
  EXPECT_EQ(*b.weights, (std::vector<double>{30, 70}));
  b = parse_blend({"a b c"});
  EXPECT_EQ(b.prefixes, (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_FALSE(b.weights);
  b = parse_blend({"data/x_text_document"});
  EXPECT_FALSE(b.weights);
  b = parse_blend({"0.5 x 1e-1 y"});
  EXPECT_EQ(*b.weights, (std::vector<double>{0.5, 0.1}));
  expect_error([] { parse_blend({}); }, {"no dataset prefixes"});
  expect_error([] { parse_blend({"30", "a", "seventy", "b"}); }, {"weight 'seventy'", "does not parse"});
  expect_error([] { parse_blend({"30", "a", "70"}); }, {"3 entries", "pairs"});
  expect_error([] { parse_blend({"-1", "a", "2", "b"}); }, {"'-1'", "positive"});
  expect_error([] { parse_blend({"0", "a", "2", "b"}); }, {"'0'", "positive"});
  expect_error([] { parse_blend({"nan", "a", "2", "b"}); }, {"positive finite"});
}

TEST(Blend, SizesAndGreedyOrder) {
  // ceil(ceil(n * w) * 1.005)
  const auto s = size_per_split_per_dataset({0.3, 0.7}, {1000, 10, 0}, 0.005);
  EXPECT_EQ(s[0], (std::array<int64_t, 3>{302, 4, 0}));
  EXPECT_EQ(s[1], (std::array<int64_t, 3>{704, 8, 0}));
  std::vector<int16_t> di;
  std::vector<int64_t> dsi;
  build_blending_indices({0.25, 0.75}, 8, &di, &dsi);
  // k=0: errors .25,.75 -> 1; k=1: .25, -.25 -> 0; k=2: .5-1, 1.5-1 -> 1; ...
  EXPECT_EQ(di, (std::vector<int16_t>{1, 0, 1, 1, 0, 1, 1, 1}));
  EXPECT_EQ(dsi, (std::vector<int64_t>{0, 0, 1, 2, 1, 3, 4, 5}));
  // Proportions hold to within two samples at every prefix (greedy on the largest deficit).
  std::mt19937 g(std::random_device{}());
  std::vector<double> w(5);
  for (auto& x : w) x = 0.1 + (g() % 1000) / 100.0;
  w = normalize_weights(w);
  build_blending_indices(w, 5000, &di, &dsi);
  std::vector<int64_t> count(5, 0);
  for (int64_t k = 0; k < 5000; ++k) {
    ++count[di[k]];
    for (int d = 0; d < 5; ++d) ASSERT_LE(std::abs(count[d] - w[d] * (k + 1)), 2.0);
  }
}

TEST(Blend, MatchesMegatronFixture) {
  const auto j = testing::load_megatron_fixture("blend.json");
  MT_REQUIRE_FIXTURE(j, "blend.json");
  // numpy.sum-based normalisation of 300 weights, bit-exact.
  EXPECT_EQ(normalize_weights(j.at("weights300").get<std::vector<double>>()),
            j.at("normalized300").get<std::vector<double>>());
  for (const auto& c : j.at("exhaustive")) {
    std::vector<int16_t> di;
    std::vector<int64_t> dsi;
    build_exhaustive_blending_indices(c.at("sizes").get<std::vector<int64_t>>(), &di, &dsi);
    EXPECT_EQ(di, c.at("dataset_index").get<std::vector<int16_t>>());
    EXPECT_EQ(dsi, c.at("dataset_sample_index").get<std::vector<int64_t>>());
  }
  TempDir dir;
  std::map<std::string, std::string> prefixes;
  for (const auto& c : j.at("corpora")) {
    prefixes[c.at("name").get<std::string>()] = testing::write_fixture_corpus(dir.path(), c);
  }
  const NullTokenizer tok(50257);
  for (const auto& c : j.at("blends")) {
    DataArgs a;
    for (const auto& w : c.at("data_path")) {
      const std::string s = w.get<std::string>();
      a.data_path.push_back(prefixes.count(s) ? prefixes[s] : s);
    }
    a.split = c.at("split").get<std::string>();
    const auto sizes = c.at("sizes").get<std::vector<int64_t>>();
    DataSplits ds = build_gpt_datasets(a, c.at("seq_length").get<int64_t>(), c.at("seed").get<uint64_t>(), sizes[0],
                                       sizes[1], sizes[2], tok);
    const std::array<SampleSource*, 3> got{ds.train.get(), ds.valid.get(), ds.test.get()};
    for (int i = 0; i < 3; ++i) {
      const auto& ref = c.at("splits")[i];
      if (ref.is_null()) {
        EXPECT_EQ(got[i], nullptr);
        continue;
      }
      ASSERT_NE(got[i], nullptr) << c.dump().substr(0, 100);
      EXPECT_EQ(got[i]->size(), ref.at("size").get<int64_t>());
      // The choice sequence, through the public interface: sample k = dataset_index[k]'s sample
      // dataset_sample_index[k]; compare the samples recorded and rebuild the sequence from sizes.
      std::vector<int32_t> buf(got[i]->sample_tokens());
      for (const auto& [key, tokens] : ref.at("samples").items()) {
        got[i]->get(std::stoll(key), buf.data());
        EXPECT_EQ(buf, tokens.get<std::vector<int32_t>>()) << a.split << " split " << i << " sample " << key;
      }
      std::vector<int16_t> di;
      std::vector<int64_t> dsi;
      build_blending_indices(ref.at("weights").get<std::vector<double>>(), ref.at("size").get<int64_t>(), &di, &dsi);
      EXPECT_EQ(di, ref.at("dataset_index").get<std::vector<int16_t>>());
      EXPECT_EQ(dsi, ref.at("dataset_sample_index").get<std::vector<int64_t>>());
      // Megatron's per-dataset requests (ceil(ceil(n*w)*1.005)) are reproduced.
      if (c.at("normalized_weights").is_array()) {
        const auto w = c.at("normalized_weights").get<std::vector<double>>();
        const auto s = size_per_split_per_dataset(w, {sizes[0], sizes[1], sizes[2]}, 0.005);
        for (size_t d = 0; d < w.size(); ++d) EXPECT_EQ(s[d][i], ref.at("mid_num_samples")[d].get<int64_t>());
      }
    }
  }
}

TEST(BuildGptDatasets, SourcesAndErrors) {
  const NullTokenizer tok(1000);
  DataArgs a;
  expect_error([&] { build_gpt_datasets(a, 8, 1, 10, 10, 10, tok); }, {"no training data"});
  a.mock_data = true;
  DataSplits m = build_gpt_datasets(a, 16, 1234, 100, 10, 5, tok);
  ASSERT_TRUE(m.train && m.valid && m.test);
  EXPECT_GE(m.train->size(), 100);
  std::vector<int32_t> buf(17);
  m.train->get(0, buf.data());
  for (int32_t t : buf) EXPECT_TRUE(t >= 0 && t < 1000);
  // Mock sequences are (1, 2, ..., L-1) % V followed by EOD = V - 1.
  MockTokenSequences seqs(1000, 999);
  std::vector<int32_t> s(seqs.sequence_lengths()[0]);
  seqs.read(0, 0, static_cast<int64_t>(s.size()), s.data());
  EXPECT_EQ(s.back(), 999);
  if (s.size() > 1) EXPECT_EQ(s[0], 1);
  a.mock_data = false;
  a.data_path = {"1", "x"};
  a.train_data_path = {"y"};
  expect_error([&] { build_gpt_datasets(a, 8, 1, 10, 10, 10, tok); }, {"cannot be combined"});
  a.train_data_path.clear();
  a.data_path = {"3", "p1", "x", "p2"};
  expect_error([&] { build_gpt_datasets(a, 8, 1, 10, 10, 10, tok); }, {"weight 'x'"});
  a.data_path = {"p"};
  a.split = "1,a";
  expect_error([&] { build_gpt_datasets(a, 8, 1, 10, 10, 10, tok); }, {"not a non-negative number"});
}

TEST(BuildGptDatasets, PerSplitPathsAndEmptySplit) {
  TempDir dir;
  nlohmann::json corpus = {{"id", 4}, {"name", "d"}, {"lengths", std::vector<int>(10, 20)}};
  const std::string p = testing::write_fixture_corpus(dir.path(), corpus);
  const NullTokenizer tok(50257);
  DataArgs a;
  a.train_data_path = {p};
  a.test_data_path = {"2", p, "1", p};
  DataSplits d = build_gpt_datasets(a, 8, 3, 30, 10, 12, tok);
  ASSERT_TRUE(d.train && d.test);
  EXPECT_EQ(d.valid, nullptr);
  EXPECT_GE(d.train->size(), 30);
  EXPECT_EQ(d.test->size(), 8 + 4);  // sum of ceil(12 * w)
  // "969,30,1" of 10 documents leaves valid/test empty: a clear error instead of Megatron's hang.
  DataArgs b;
  b.data_path = {p};
  expect_error([&] { build_gpt_datasets(b, 8, 3, 30, 10, 12, tok); }, {"valid split", "is empty"});
  // Parse the flags through CLI11.
  CLI::App app;
  DataArgs c;
  add_data_options(app, c);
  std::vector<std::string> argv = {"prog", "--data-path", "0.3", "a", "0.7", "b", "--split", "98,2,0",
                                   "--reset-attention-mask", "--eod-mask-loss", "--data-cache-path", "/tmp/x",
                                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"};
  std::vector<char*> ptrs;
  for (auto& s : argv) ptrs.push_back(s.data());
  app.parse(static_cast<int>(ptrs.size()), ptrs.data());
  EXPECT_EQ(c.data_path, (std::vector<std::string>{"0.3", "a", "0.7", "b"}));
  EXPECT_EQ(c.split, "98,2,0");
  EXPECT_TRUE(c.reset_attention_mask && c.eod_mask_loss && !c.reset_position_ids);
  EXPECT_EQ(build_tokenizer(c)->eod(), 127);
  EXPECT_EQ(train_valid_test_num_samples(100, 8, 10, 2), (std::array<int64_t, 3>{800, 11 * 2 * 8, 16}));
}

}  // namespace
}  // namespace mt::data
