// Megatron GPTDataset: indices and samples against Megatron-LM's own code (fixture gpt.json from
// tools/megatron_ref/gen_fixtures.py: Megatron's gpt_dataset.py functions + compiled helpers.cpp +
// NumPy), plus self-contained checks of the invariants (every sample is a window of seq_length + 1
// tokens of the shuffled document stream; epochs cover the request), the cache and the errors.
#include "data/gpt_dataset.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <numeric>
#include <thread>

#include "data/gpt_window_dataset.h"
#include "megatron_ref_util.h"

namespace mt::data {
namespace {

using testing::expect_error;
using testing::TempDir;

std::shared_ptr<const TokenSequences> open_seqs(const std::string& prefix) {
  return std::make_shared<IndexedTokenSequences>(std::make_shared<IndexedDataset>(prefix));
}

std::pair<int64_t, int64_t> megatron_range(const std::string& split, int index, int64_t n) {
  return split_document_ranges(parse_split(split), n)[index];
}

TEST(GptDataset, MatchesMegatronFixture) {
  const auto j = testing::load_megatron_fixture("gpt.json");
  MT_REQUIRE_FIXTURE(j, "gpt.json");
  TempDir dir;
  std::map<int64_t, std::string> prefixes;
  for (const auto& c : j.at("corpora")) prefixes[c.at("id").get<int64_t>()] = testing::write_fixture_corpus(dir.path(), c);
  int checked = 0;
  for (const auto& c : j.at("gpt")) {
    const auto seqs = open_seqs(prefixes.at(c.at("corpus").get<int64_t>()));
    const int split_index = c.at("split_index").get<int>();
    const auto range = megatron_range(c.at("split").get<std::string>(), split_index, seqs->num_sequences());
    EXPECT_EQ(range.first, c.at("sequence_range")[0].get<int64_t>());
    EXPECT_EQ(range.second, c.at("sequence_range")[1].get<int64_t>());
    GptDatasetConfig cfg;
    cfg.seq_length = c.at("seq_length").get<int64_t>();
    cfg.seed = c.at("seed").get<uint64_t>();
    const int64_t num_samples = c.at("num_samples").is_null() ? -1 : c.at("num_samples").get<int64_t>();
    GptDataset ds(seqs, range.first, range.second, num_samples, static_cast<Split>(split_index), cfg);
    const std::string what = c.dump().substr(0, 120);
    EXPECT_EQ(ds.document_index(), c.at("document_index").get<std::vector<int32_t>>()) << what;
    EXPECT_EQ(ds.sample_index(), c.at("sample_index").get<std::vector<int64_t>>()) << what;
    EXPECT_EQ(ds.shuffle_index(), c.at("shuffle_index").get<std::vector<int64_t>>()) << what;
    std::vector<int32_t> buf(ds.sample_tokens());
    for (const auto& [key, tokens] : c.at("samples").items()) {
      ds.get(std::stoll(key), buf.data());
      EXPECT_EQ(buf, tokens.get<std::vector<int32_t>>()) << what << " sample " << key;
    }
    ++checked;
  }
  EXPECT_GE(checked, 5);
  for (const auto& c : j.at("sample_index")) {
    const auto sizes = c.at("sizes").get<std::vector<int32_t>>();
    const auto doc = c.at("document_index").get<std::vector<int32_t>>();
    EXPECT_EQ(build_sample_index(sizes, doc, c.at("seq_length").get<int64_t>(), c.at("num_epochs").get<int64_t>(),
                                 c.at("tokens_per_epoch").get<int64_t>(), c.at("drop_last").get<bool>(), 1),
              c.at("sample_index").get<std::vector<int64_t>>())
        << c.dump();
  }
}

// A corpus of random documents (fresh each run), one sequence each.
struct Corpus {
  TempDir dir;
  std::string prefix;
  std::vector<std::vector<int32_t>> docs;
  explicit Corpus(int n_docs, int max_len = 40) {
    std::mt19937 g(std::random_device{}());
    prefix = dir.file("c");
    IndexedDatasetBuilder b(prefix, IndexDType::kInt32);
    for (int d = 0; d < n_docs; ++d) {
      std::vector<int32_t> t(1 + g() % max_len);
      for (auto& x : t) x = static_cast<int32_t>(g() % 100000);
      b.add_document(t);
      docs.push_back(t);
    }
    b.finalize();
  }
};

TEST(GptDataset, SamplesAreWindowsOfTheShuffledStream) {
  Corpus c(57);
  const auto seqs = open_seqs(c.prefix);
  for (int64_t seq_length : {1, 7, 64}) {
    for (int64_t num_samples : {int64_t{-1}, int64_t{3}, int64_t{500}}) {
      GptDatasetConfig cfg;
      cfg.seq_length = seq_length;
      cfg.seed = 99;
      GptDataset ds(seqs, 5, 50, num_samples, Split::kTrain, cfg);
      // The stream: documents in document_index order.
      std::vector<int32_t> stream;
      for (int32_t d : ds.document_index()) {
        ASSERT_TRUE(d >= 5 && d < 50);
        stream.insert(stream.end(), c.docs[d].begin(), c.docs[d].end());
      }
      int64_t tokens = 0;
      for (int d = 5; d < 50; ++d) tokens += static_cast<int64_t>(c.docs[d].size());
      const int64_t epochs = static_cast<int64_t>(ds.document_index().size()) / 45;
      EXPECT_EQ(epochs, num_samples < 0 ? 1 : std::max<int64_t>(1, (num_samples * seq_length + 1 + tokens - 1) / tokens));
      EXPECT_EQ(ds.size(), (epochs * tokens - 1) / seq_length);
      if (num_samples >= 0) EXPECT_GE(ds.size(), num_samples);
      // shuffle_index is a permutation; sample k of the unshuffled order is stream[k*s, k*s + s + 1).
      std::vector<int64_t> perm = ds.shuffle_index();
      std::sort(perm.begin(), perm.end());
      for (int64_t i = 0; i < ds.size(); ++i) ASSERT_EQ(perm[i], i);
      std::vector<int32_t> buf(seq_length + 1, -7);
      for (int64_t i = 0; i < ds.size(); ++i) {
        ds.get(i, buf.data());
        const int64_t k = ds.shuffle_index()[i];
        ASSERT_TRUE(std::equal(buf.begin(), buf.end(), stream.begin() + k * seq_length)) << i;
      }
    }
  }
}

TEST(GptDataset, FinalEpochRule) {
  // T tokens per epoch, s = 10: P = (T - 1) // 10 samples per epoch. The last epoch is shuffled
  // separately iff num_samples - ((E-1)*T - 1) // 10 < int(0.8 * P).
  const std::vector<int32_t> lengths(20, 50);  // T = 1000, P = 99
  auto run = [&](int64_t n) { return build_gpt_indices(lengths, 0, 20, n, 10, 3, true, true); };
  const GptIndices a = run(99 + 50);  // E = 2, S' = 99, from final = 50 < 79 -> separate
  EXPECT_EQ(a.num_epochs, 2);
  EXPECT_TRUE(a.separate_final_epoch);
  // Separate: the first 99 samples are a permutation of [0, 99), the rest of [99, n).
  for (int64_t i = 0; i < 99; ++i) EXPECT_LT(a.shuffle_index[i], 99);
  for (size_t i = 99; i < a.shuffle_index.size(); ++i) EXPECT_GE(a.shuffle_index[i], 99);
  // Document index: the last epoch's 20 documents are a permutation of 0..19.
  std::vector<int32_t> last(a.document_index.end() - 20, a.document_index.end());
  std::sort(last.begin(), last.end());
  for (int i = 0; i < 20; ++i) EXPECT_EQ(last[i], i);
  const GptIndices b = run(99 + 90);  // from final = 90 >= 79 -> shuffled together
  EXPECT_EQ(b.num_epochs, 2);
  EXPECT_FALSE(b.separate_final_epoch);
  EXPECT_EQ(run(99).num_epochs, 1);
  EXPECT_EQ(run(100).num_epochs, 2);  // 100 * 10 + 1 > 1000
}

TEST(GptDataset, CacheIsWrittenReusedAndRebuiltWhenCorrupt) {
  Corpus c(30);
  const auto seqs = open_seqs(c.prefix);
  TempDir cache;
  GptDatasetConfig cfg;
  cfg.seq_length = 8;
  cfg.seed = 5;
  cfg.cache.dir = cache.file("idx");  // created on demand
  GptDataset a(seqs, 0, 30, 100, Split::kTrain, cfg);
  EXPECT_TRUE(a.built_indices());
  GptDataset b(seqs, 0, 30, 100, Split::kTrain, cfg);
  EXPECT_FALSE(b.built_indices());
  EXPECT_EQ(a.shuffle_index(), b.shuffle_index());
  EXPECT_EQ(a.sample_index(), b.sample_index());
  EXPECT_EQ(a.document_index(), b.document_index());
  // A different request is a different file.
  GptDataset other(seqs, 0, 30, 101, Split::kTrain, cfg);
  EXPECT_TRUE(other.built_indices());
  // Corrupt the file (flip a byte in the middle; then truncate): rebuilt, same result.
  const std::string path = index_cache_path(cfg.cache.dir, a.description(), "GPTDataset-train");
  ASSERT_TRUE(std::filesystem::exists(path));
  std::string bytes = testing::read_file(path);
  bytes[bytes.size() / 2] ^= 0x5a;
  testing::write_file(path, bytes);
  GptDataset d(seqs, 0, 30, 100, Split::kTrain, cfg);
  EXPECT_TRUE(d.built_indices());
  EXPECT_EQ(d.shuffle_index(), a.shuffle_index());
  testing::write_file(path, bytes.substr(0, 40));
  GptDataset e(seqs, 0, 30, 100, Split::kTrain, cfg);
  EXPECT_TRUE(e.built_indices());
  std::filesystem::remove(path);
  GptDataset f(seqs, 0, 30, 100, Split::kTrain, cfg);
  EXPECT_TRUE(f.built_indices());
  EXPECT_EQ(f.shuffle_index(), a.shuffle_index());
}

TEST(GptDataset, WaitingRankLoadsWhatTheBuilderWrites) {
  Corpus c(30);
  const auto seqs = open_seqs(c.prefix);
  TempDir cache;
  GptDatasetConfig waiter_cfg;
  waiter_cfg.seq_length = 4;
  waiter_cfg.cache.dir = cache.path();
  waiter_cfg.cache.build_if_missing = false;
  waiter_cfg.cache.poll_interval_s = 0.01;
  std::unique_ptr<GptDataset> waited;
  std::thread t([&] { waited = std::make_unique<GptDataset>(seqs, 0, 30, 50, Split::kValid, waiter_cfg); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  GptDatasetConfig builder_cfg = waiter_cfg;
  builder_cfg.cache.build_if_missing = true;
  GptDataset built(seqs, 0, 30, 50, Split::kValid, builder_cfg);
  t.join();
  ASSERT_TRUE(waited);
  EXPECT_FALSE(waited->built_indices());
  EXPECT_EQ(waited->shuffle_index(), built.shuffle_index());
  // Nobody builds: a clear timeout.
  waiter_cfg.cache.wait_timeout_s = 0.05;
  expect_error([&] { GptDataset x(seqs, 0, 30, 51, Split::kValid, waiter_cfg); }, {"timed out", "index cache"});
}

TEST(GptDataset, Errors) {
  Corpus c(10);
  const auto seqs = open_seqs(c.prefix);
  GptDatasetConfig cfg;
  cfg.seq_length = 8;
  expect_error([&] { GptDataset d(seqs, 4, 4, 10, Split::kValid, cfg); }, {"valid split", "is empty", "[4, 4)"});
  expect_error([&] { GptDataset d(seqs, 0, 11, 10, Split::kTrain, cfg); }, {"[0, 11)", "outside"});
  cfg.seed = 1ull << 32;
  expect_error([&] { GptDataset d(seqs, 0, 10, 10, Split::kTrain, cfg); }, {"--seed", "2**32"});
  cfg.seed = 1;
  // Unwritable cache directory: a path below a regular file cannot be created (works as root too).
  TempDir t;
  testing::write_file(t.file("file"), "x");
  cfg.cache.dir = t.file("file") + "/cache";
  expect_error([&] { GptDataset d(seqs, 0, 10, 10, Split::kTrain, cfg); },
               {"cannot create the index cache directory", "--data-cache-path"});
  GptDataset ok(seqs, 0, 10, 10, Split::kTrain, GptDatasetConfig{8, 1, true, true, "", {}});
  std::vector<int32_t> buf(9);
  expect_error([&] { ok.get(ok.size(), buf.data()); }, {"outside"});
  expect_error([&] { ok.get(-1, buf.data()); }, {"outside"});
}

TEST(GptDataset, BadIndexFilesAreClearErrors) {
  Corpus c(5);
  // .idx claiming more tokens than the .bin holds.
  const std::string bin = c.prefix + ".bin";
  const std::string bytes = testing::read_file(bin);
  testing::write_file(bin, bytes.substr(0, bytes.size() - 4));
  expect_error([&] { open_seqs(c.prefix); }, {".bin"});
}

}  // namespace
}  // namespace mt::data
