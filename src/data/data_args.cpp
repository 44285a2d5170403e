#include "data/data_args.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <map>
#include <optional>

#include "core/check.h"
#include "core/cli_validators.h"
#include "core/logging.h"
#include "data/blended_dataset.h"
#include "data/gpt_dataset.h"
#include "data/gpt_window_dataset.h"
#include "data/mock_dataset.h"

namespace mt::data {
namespace {

constexpr const char* kLegacyDefaultSplit = "969, 30, 1";

// A unique_ptr face for a shared dataset.
class SharedSource final : public SampleSource {
 public:
  explicit SharedSource(std::shared_ptr<const SampleSource> s) : source_(std::move(s)) {}
  int64_t size() const override { return source_->size(); }
  int64_t sample_tokens() const override { return source_->sample_tokens(); }
  void get(int64_t i, int32_t* out) const override { source_->get(i, out); }
  std::string name() const override { return source_->name(); }

 private:
  std::shared_ptr<const SampleSource> source_;
};

std::unique_ptr<SampleSource> wrap(std::shared_ptr<const SampleSource> s) {
  return s ? std::make_unique<SharedSource>(std::move(s)) : nullptr;
}

using SplitRanges = std::array<std::optional<std::pair<double, double>>, 3>;  // Megatron's split matrix
using GptSplits = std::array<std::shared_ptr<GptDataset>, 3>;

class Builder {
 public:
  Builder(const DataArgs& a, int64_t seq_length, uint64_t seed, std::array<int64_t, 3> sizes)
      : args_(a), sizes_(sizes) {
    config_.seq_length = seq_length;
    config_.seed = seed;
    config_.cache.dir = a.data_cache_path;
    config_.cache.build_if_missing = a.build_indices;
    config_.cache.wait_timeout_s = a.cache_wait_timeout_s;
  }

  // _build_megatron_dataset_splits for one prefix.
  GptSplits build_splits(const std::string& prefix, const SplitRanges& split, const std::array<int64_t, 3>& sizes) {
    auto seqs = open(prefix);
    const auto n = static_cast<double>(seqs->num_sequences());
    GptSplits out;
    for (int i = 0; i < 3; ++i) {
      // A validation/test split nobody asks samples of (e.g. --eval-iters 0) is not built.
      if (!split[i] || (i > 0 && sizes[i] == 0)) continue;
      const auto round_half_even = [](double x) { return static_cast<int64_t>(std::nearbyint(x)); };
      const int64_t b = round_half_even(split[i]->first * n), e = round_half_even(split[i]->second * n);
      if (i == 2 && e <= b) {  // `pretrain` never evaluates the test split: an empty one is not an error
        log_warn("> the test split of {} is empty (--split {} of {} sequences); no test evaluation is run, so "
                 "this is only a warning", prefix, config_.split_string, seqs->num_sequences());
        continue;
      }
      out[i] = std::make_shared<GptDataset>(seqs, b, e, sizes[i], static_cast<Split>(i), config_);
    }
    return out;
  }

  // The blended (or single) datasets of all splits from one blend, as _build_blended_dataset_splits.
  std::array<std::shared_ptr<const SampleSource>, 3> build_blend(const Blend& blend, const SplitRanges& split,
                                                                 const std::array<int64_t, 3>& sizes,
                                                                 std::optional<int> only_split) {
    std::array<std::shared_ptr<const SampleSource>, 3> out;
    const bool single = blend.prefixes.size() == 1 && (!blend.weights || only_split.has_value());
    if (single) {
      GptSplits s = build_splits(blend.prefixes[0], split, sizes);
      for (int i = 0; i < 3; ++i) out[i] = s[i];
      return out;
    }
    std::optional<std::vector<double>> weights;
    std::vector<std::array<int64_t, 3>> targets, buffers;
    std::vector<GptSplits> mids;
    if (blend.weights) {
      weights = normalize_weights(*blend.weights);
      targets = size_per_split_per_dataset(*weights, sizes, 0.0);
      buffers = size_per_split_per_dataset(*weights, sizes, args_.mid_level_dataset_surplus);
    }
    for (size_t d = 0; d < blend.prefixes.size(); ++d) {
      mids.push_back(build_splits(blend.prefixes[d], split, weights ? buffers[d] : std::array<int64_t, 3>{-1, -1, -1}));
    }
    for (int i = 0; i < 3; ++i) {
      if (!split[i] || (i > 0 && sizes[i] == 0)) continue;
      std::vector<std::shared_ptr<const SampleSource>> ds;
      std::vector<std::string> desc;
      if (i == 2 && std::any_of(mids.begin(), mids.end(), [](const GptSplits& m) { return m[2] == nullptr; }))
        continue;  // an empty test split (warned about above)
      for (auto& m : mids) {
        ds.push_back(m[i]);
        desc.push_back(m[i]->description());
      }
      std::vector<double> w;
      int64_t size = -1;
      if (weights) {
        MT_REQUIRE(sizes[i] >= 0, "a weighted blend needs a sample count for the {} split",
                   split_enum_name(static_cast<Split>(i)));
        w = *weights;
        size = 0;
        for (auto& t : targets) size += t[i];
      } else {
        int64_t total = 0;
        for (auto& m : mids) {
          w.push_back(static_cast<double>(m[i]->size()));
          total += m[i]->size();
        }
        size = sizes[i] >= 0 ? std::min(sizes[i], total) : -1;
      }
      out[i] = std::make_shared<BlendedDataset>(ds, desc, w, size, static_cast<Split>(i), config_.cache);
    }
    return out;
  }

  GptDatasetConfig config_;

 private:
  std::shared_ptr<const TokenSequences> open(const std::string& prefix) {
    auto it = opened_.find(prefix);
    if (it != opened_.end()) return it->second;
    auto seqs = std::make_shared<IndexedTokenSequences>(std::make_shared<IndexedDataset>(prefix));
    opened_[prefix] = seqs;
    return seqs;
  }
  const DataArgs& args_;
  std::array<int64_t, 3> sizes_;
  std::map<std::string, std::shared_ptr<const TokenSequences>> opened_;
};

SplitRanges split_matrix(const std::string& split) {
  const std::array<double, 3> f = parse_split(split);
  SplitRanges r;
  double c = 0;
  for (int i = 0; i < 3; ++i) {  // convert_split_vector_to_split_matrix: cumulative bookends
    const double next = c + f[i];
    if (next > c) r[i] = std::make_pair(c, next);
    c = next;
  }
  return r;
}

}  // namespace

void add_data_options(CLI::App& app, DataArgs& a) {
  app.add_option("--data-path", a.data_path,
                 "Dataset prefixes with optional weights: 'prefix', 'p1 p2 ...' or 'w1 p1 w2 p2 ...'")
      ->expected(1, -1);
  app.add_option("--split", a.split, "Train/valid/test proportions, e.g. '969,30,1' (default with --data-path)");
  app.add_option("--train-data-path", a.train_data_path, "Weights and prefixes of a separate train dataset")
      ->expected(1, -1);
  app.add_option("--valid-data-path", a.valid_data_path, "Weights and prefixes of a separate validation dataset")
      ->expected(1, -1);
  app.add_option("--test-data-path", a.test_data_path, "Weights and prefixes of a separate test dataset")
      ->expected(1, -1);
  app.add_option("--data-cache-path", a.data_cache_path, "Directory for the cached dataset indices");
  app.add_flag("--mock-data", a.mock_data, "Synthetic data (Megatron's MockGPTDataset), no files");
  app.add_flag("--reset-position-ids", a.reset_position_ids, "Restart position ids after each EOD token");
  app.add_flag("--reset-attention-mask", a.reset_attention_mask, "Attend only within the current document");
  app.add_flag("--eod-mask-loss", a.eod_mask_loss, "Zero the loss mask at EOD tokens");
  app.add_option("--tokenizer-type", a.tokenizer_type, "GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer, ...")
      ->capture_default_str();
  app.add_option("--vocab-file", a.vocab_file, "GPT-2 vocab.json / encoder.json");
  app.add_option("--merge-file", a.merge_file, "GPT-2 merges.txt / vocab.bpe");
  app.add_option("--tokenizer-model", a.tokenizer_model, "tokenizer.json (or its directory) / SentencePiece model");
  app.add_option("--vocab-size", a.vocab_size, "Vocabulary size of the NullTokenizer (TikTokenizer: ids in all)")
      ->check(positive_integer());
  add_tiktoken_options(app, a.tiktoken);
  app.add_option("--mid-level-dataset-surplus", a.mid_level_dataset_surplus,
                 "Sample surplus of the per-dataset indices of a weighted blend")
      ->check(number_range(0, kNoMax))
      ->capture_default_str();
}

void add_tiktoken_options(CLI::App& app, TikTokenOptions& o) {
  app.add_option("--tiktoken-pattern", o.pattern, "TikTokenizer's pre-tokenizer pattern (Megatron-LM's v1 or v2)")
      ->check(CLI::IsMember({"v1", "v2"}))
      ->capture_default_str();
  app.add_option("--tiktoken-num-special-tokens", o.num_special_tokens,
                 "TikTokenizer: ids reserved for special tokens before the ranks")
      ->check(integer_range(0))
      ->capture_default_str();
  app.add_option("--tokenizer-special-tokens,--tiktoken-special-tokens", o.special_tokens,
                 "TikTokenizer's special tokens (must include <unk> <s> </s> <mask> <pad> <cls> <sep>)")
      ->expected(1, -1);
}

std::unique_ptr<Tokenizer> build_tokenizer(const DataArgs& a) {
  return make_tokenizer(a.tokenizer_type, a.vocab_file, a.merge_file, a.tokenizer_model, a.vocab_size, a.tiktoken);
}

std::array<int64_t, 3> train_valid_test_num_samples(int64_t train_iters, int64_t global_batch_size,
                                                    int64_t eval_interval, int64_t eval_iters) {
  MT_REQUIRE(train_iters >= 0 && global_batch_size > 0 && eval_interval > 0 && eval_iters >= 0,
             "bad sample count arguments: train_iters={} global_batch_size={} eval_interval={} eval_iters={}",
             train_iters, global_batch_size, eval_interval, eval_iters);
  std::array<int64_t, 3> n{};
  const bool overflow = __builtin_mul_overflow(train_iters, global_batch_size, &n[0]) ||
                        __builtin_mul_overflow(eval_iters, global_batch_size, &n[2]) ||
                        __builtin_mul_overflow(train_iters / eval_interval + 1, n[2], &n[1]);
  MT_REQUIRE(!overflow,
             "--train-iters {}, --global-batch-size {}, --eval-interval {} and --eval-iters {} ask for more than 2^63 "
             "samples",
             train_iters, global_batch_size, eval_interval, eval_iters);
  return n;
}

DataSplits build_gpt_datasets(const DataArgs& a, int64_t seq_length, uint64_t seed, int64_t train_samples,
                              int64_t valid_samples, int64_t test_samples, const Tokenizer& tokenizer) {
  const std::array<int64_t, 3> sizes{train_samples, valid_samples, test_samples};
  const bool per_split = !a.train_data_path.empty() || !a.valid_data_path.empty() || !a.test_data_path.empty();
  DataSplits out;
  auto assign = [&](std::array<std::shared_ptr<const SampleSource>, 3> s) {
    out.train = wrap(s[0]);
    out.valid = wrap(s[1]);
    out.test = wrap(s[2]);
  };
  Builder builder(a, seq_length, seed, sizes);
  if (a.mock_data) {
    MT_REQUIRE(a.data_path.empty() && !per_split, "--mock-data cannot be combined with --data-path / --*-data-path");
    auto m = build_mock_gpt_datasets(tokenizer.vocab_size(), tokenizer.eod(), sizes, builder.config_);
    assign({m[0], m[1], m[2]});
    return out;
  }
  MT_REQUIRE(!(per_split && !a.data_path.empty()),
             "--data-path cannot be combined with --train-data-path / --valid-data-path / --test-data-path");
  if (!a.data_path.empty()) {
    const std::string split = a.split.empty() ? kLegacyDefaultSplit : a.split;
    builder.config_.split_string = split;
    assign(builder.build_blend(parse_blend(a.data_path), split_matrix(split), sizes, std::nullopt));
    return out;
  }
  MT_REQUIRE(per_split, "no training data: give --data-path, --train-data-path/--valid-data-path/--test-data-path, "
                        "or --mock-data");
  MT_REQUIRE(a.split.empty(), "--split cannot be used with --train-data-path / --valid-data-path / --test-data-path");
  const std::array<const std::vector<std::string>*, 3> paths{&a.train_data_path, &a.valid_data_path, &a.test_data_path};
  std::array<std::shared_ptr<const SampleSource>, 3> result;
  for (int i = 0; i < 3; ++i) {
    if (paths[i]->empty()) continue;
    SplitRanges spoof;
    spoof[i] = std::make_pair(0.0, 1.0);
    std::array<int64_t, 3> sizes_spoof{0, 0, 0};
    sizes_spoof[i] = sizes[i];
    result[i] = builder.build_blend(parse_blend(*paths[i]), spoof, sizes_spoof, i)[i];
  }
  assign(result);
  return out;
}

}  // namespace mt::data
