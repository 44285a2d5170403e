// Helpers of the in-process trainer tests: a synthetic corpus, `megatron pretrain` flags parsed
// into PretrainArgs, and a training run on --nproc-per-node thread ranks (comm/thread_comm.h)
// through TrainingSetup and Trainer, returning rank 0's TrainingResult.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/thread_comm.h"
#include "core/logging.h"
#include "data/indexed_dataset.h"
#include "train/trainer.h"

namespace mt::testing {

/// Vocabulary of the synthetic corpus (NullTokenizer; EOD = 95).
inline constexpr int kCorpusVocab = 96;

/// Writes <dir>/corpus.{bin,idx}: 600 documents of 8 to 120 tokens of an order-1 Markov chain over
/// kCorpusVocab - 1 tokens (a fixed draw: the losses have something to learn), each ended by the
/// EOD token. Returns the prefix.
inline std::string write_corpus(const std::filesystem::path& dir) {
  const std::string prefix = (dir / "corpus").string();
  data::IndexedDatasetBuilder b(prefix, data::IndexDType::kUInt16);
  std::mt19937_64 rng(20261128);
  std::uniform_int_distribution<int> len(8, 120), step(1, 6);
  for (int d = 0; d < 600; ++d) {
    std::vector<int32_t> doc(static_cast<size_t>(len(rng)));
    int32_t t = static_cast<int32_t>(rng() % (kCorpusVocab - 1));
    for (auto& x : doc) x = t = (t * 7 + step(rng)) % (kCorpusVocab - 1);
    doc.back() = kCorpusVocab - 1;
    b.add_document(doc);
  }
  b.finalize();
  return prefix;
}

/// `megatron pretrain`'s flags (without the subcommand) parsed as the binary parses them.
inline PretrainArgs parse_pretrain_args(const std::string& flags) {
  CLI::App app;
  PretrainArgs args;
  add_pretrain_options(app, args);
  app.parse(flags, false);
  return args;
}

/// What a test may read from rank 0's setup before training.
struct SetupInfo {
  int64_t padded_vocab = 0;
  std::string model_summary;  ///< TransformerConfig::summary()
};

/// Trains with `flags` on --nproc-per-node thread ranks (each its own TrainingSetup and Trainer
/// over a thread communicator, CPU); returns rank 0's result (*info: rank 0's setup). Rethrows the
/// first rank's error.
inline TrainingResult train_in_process(const std::string& flags, SetupInfo* info = nullptr) {
  const int ranks = parse_pretrain_args(flags).nproc_per_node;
  TrainingResult out;
  std::mutex mu;
  run_thread_ranks(ranks, [&](int rank, std::shared_ptr<Communicator> world) {
    TrainingSetup setup(parse_pretrain_args(flags), std::move(world), Device::cpu());
    Trainer trainer(setup);
    TrainingResult r = trainer.train();
    if (rank != 0) return;
    std::lock_guard<std::mutex> lock(mu);
    out = std::move(r);
    if (info) *info = {setup.model().padded_vocab(), setup.model().config().summary()};
  });
  return out;
}

/// The concatenated log lines of a run (the model's statistics included).
inline std::string log_text(const TrainingResult& r) {
  std::string s;
  for (const auto& l : r.log) s += l.line + "\n";
  return s;
}

/// A test suite's temporary directory with the synthetic corpus (written once per suite); logs at
/// warnings only while it runs (every thread rank would print the log lines).
class CorpusFixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    set_log_level(LogLevel::kWarn);
    dir_ = std::filesystem::temp_directory_path() /
           ("mt_" + std::string(::testing::UnitTest::GetInstance()->current_test_suite()->name()) + "_" +
            std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    corpus_ = write_corpus(dir_);
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(dir_);
    set_log_level(LogLevel::kInfo);
  }
  /// A path in the suite's directory.
  static std::string dir(const std::string& name) { return (dir_ / name).string(); }
  /// `megatron pretrain`'s flags (without the subcommand) for a 4-layer GPT (hidden 32, 4 heads,
  /// sequences of 32) on the corpus: global batches of 8 = 4 micro-batches of 2 (per data-parallel
  /// rank: fewer), a cosine schedule over 6 iterations, a log line every iteration, validation on one
  /// batch every 2, dropout on (the masks must not depend on the layout), the vocabulary padded to a
  /// multiple of 64 x TP (128 for TP 1 and 2 alike), then `extra` (a flag given again overrides).
  static std::string flags(const std::string& extra) {
    return "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
           "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
           "--lr-warmup-iters 1 --lr-decay-iters 6 --log-interval 1 --eval-iters 1 --eval-interval 2 --adam-eps 1e-5 "
           "--device cpu --no-progress --make-vocab-size-divisible-by 64 --tokenizer-type NullTokenizer "
           "--vocab-size " + std::to_string(kCorpusVocab) + " --train-data-path " + corpus_ + " --valid-data-path " +
           corpus_ + " " + extra;
  }

 private:
  static inline std::filesystem::path dir_;
  static inline std::string corpus_;
};

/// The value of " <key>: <value> |" in a log line, e.g. "mtp_1 loss" (empty when absent).
inline std::string logged(const std::string& line, const std::string& key) {
  const size_t at = line.find(" " + key + ": ");
  if (at == std::string::npos) return "";
  const size_t begin = at + key.size() + 3;
  return line.substr(begin, line.find(' ', begin) - begin);
}

/// Rel. `tol` agreement of two runs' per-iteration losses and validation losses.
inline void expect_same_losses(const TrainingResult& a, const TrainingResult& b, const std::string& what,
                               double tol = 2e-5) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (const auto& [it, l] : b.losses) {
    ASSERT_TRUE(a.losses.count(it)) << what << " iteration " << it;
    EXPECT_NEAR(a.losses.at(it), l, tol * std::abs(l)) << what << " iteration " << it;
  }
  ASSERT_EQ(a.validation.size(), b.validation.size()) << what;
  for (const auto& [it, v] : b.validation)
    EXPECT_NEAR(a.validation.at(it).loss, v.loss, tol * std::abs(v.loss)) << what << " validation " << it;
}

/// The whole fp32 tensor `name` (stored as one shard) of checkpoint iteration `iter` in `ck`; empty
/// when the checkpoint has no such tensor.
inline std::vector<float> read_whole_tensor(const std::string& ck, int iter, const std::string& name) {
  char it[16];
  std::snprintf(it, sizeof(it), "iter_%07d", iter);
  const std::filesystem::path d = std::filesystem::path(ck) / it;
  std::ifstream meta(d / "metadata.json");
  const nlohmann::json m = nlohmann::json::parse(meta);
  for (const auto& t : m.at("tensors")) {
    if (t.at("name") != name) continue;
    int64_t n = 1;
    for (int64_t v : t.at("global_shape").get<std::vector<int64_t>>()) n *= v;
    const auto& sh = t.at("shards").at(0);
    std::ifstream f(d / sh.at("file").get<std::string>(), std::ios::binary);
    f.seekg(sh.at("offset_bytes").get<std::streamoff>());
    std::vector<float> out(static_cast<size_t>(n));
    f.read(reinterpret_cast<char*>(out.data()), n * 4);
    if (!f.good()) return {};
    return out;
  }
  return {};
}

/// Fails unless `f` throws an mt::Error (or a CLI11 parse error) containing `needle`.
inline void expect_error_text(const std::function<void()>& f, const std::string& needle, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no error; expected one containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
  } catch (const CLI::Error& e) {  // a flag's own validator (as the binary's parser reports it)
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
  }
}

}  // namespace mt::testing
