// A simple GPT pretraining dataset over a Megatron indexed dataset: the documents of one split are
// concatenated (in document order) into one token stream, cut into windows of seq_length + 1 tokens
// that overlap by one token (sample i = tokens [i*s, i*s + s + 1): inputs are its first s tokens,
// labels its last s). Plus Megatron's --split parsing / document split rule and a deterministic,
// resumable batch order.
//
// This is not Megatron's GPTDataset (which builds shuffled document/sample index files); it is the
// plain sequential variant, fully determined by (split, seq_length, seed).
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "data/indexed_dataset.h"

namespace mt::data {

/// Parses Megatron's --split string, e.g. "969,30,1" or "98/2/0": up to 3 non-negative numbers
/// separated by ',' or '/' (spaces allowed), missing ones = 0, normalised to sum 1
/// (megatron/core/datasets/blended_megatron_dataset_config.py: parse_and_normalize_split).
/// Errors: empty string, a token that is not a number, a negative value, more than 3 values, all zero.
std::array<double, 3> parse_split(std::string_view split);

/// Document ranges [begin, end) of train/valid/test for `num_documents` documents, as Megatron-Core
/// does it: bookends c = [0, f0, f0+f1, f0+f1+f2] (cumulative sums in double, in that order), split i =
/// [round(c[i]*D), round(c[i+1]*D)) with Python's round (half to even); a split with f_i == 0 is
/// empty. The last end is set to D (it already is unless the fractions do not sum to 1 exactly).
std::array<std::pair<int64_t, int64_t>, 3> split_document_ranges(const std::array<double, 3>& fractions,
                                                                 int64_t num_documents);

/// Names of the splits, for messages: "train", "valid", "test".
std::string_view split_name(int i);

class GptWindowDataset {
 public:
  /// The documents [doc_begin, doc_end) of `dataset` as one stream. `name` is used in messages.
  /// Errors: bad document range; seq_length < 1; fewer than seq_length + 1 tokens in the split
  /// (message names the split, its documents and token count).
  GptWindowDataset(std::shared_ptr<const IndexedDataset> dataset, int64_t doc_begin, int64_t doc_end,
                   int64_t seq_length, std::string name = "train");

  /// floor((tokens - 1) / seq_length) >= 1.
  int64_t num_samples() const { return num_samples_; }
  int64_t seq_length() const { return seq_length_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t doc_begin() const { return doc_begin_; }
  int64_t doc_end() const { return doc_end_; }
  const std::string& name() const { return name_; }
  const IndexedDataset& dataset() const { return *dataset_; }

  /// Writes sample i (seq_length + 1 tokens, int32) to out. Error: i out of range.
  void get(int64_t i, int32_t* out) const;

  /// Scans every token of the split once. Error: the first token id < 0 or >= vocab_size, naming the
  /// id, its position in the split's stream, its document and sequence.
  void check_token_range(int64_t vocab_size) const;

 private:
  std::shared_ptr<const IndexedDataset> dataset_;
  int64_t doc_begin_, doc_end_, seq_begin_, seq_end_;
  int64_t seq_length_;
  std::string name_;
  std::vector<int64_t> cum_tokens_;  // cum_tokens_[k] = tokens in sequences [seq_begin_, seq_begin_ + k)
  int64_t num_tokens_ = 0;
  int64_t num_samples_ = 0;

  void copy_tokens(int64_t pos, int64_t count, int32_t* out) const;
};

/// Sample order: global sample index g = consumed_samples + b (b = row of the batch) lies in epoch
/// e = g / num_samples at position p = g % num_samples; the sample is p without shuffling, perm_e[p]
/// with shuffling. perm_e is a Fisher-Yates shuffle of 0..n-1 (for i = n-1 down to 1: swap(i, j) with
/// j uniform in [0, i] by rejection sampling from 64-bit draws: draw x, reject while
/// x >= 2^64 - (2^64 mod (i+1)), j = x mod (i+1)) driven by std::mt19937_64 seeded with
/// splitmix64(splitmix64(seed) ^ e), where splitmix64 is Vigna's SplitMix64 finaliser of
/// x + 0x9E3779B97F4A7C15. Both engines are fully specified, so the order is portable and resuming
/// from consumed_samples continues the exact sequence.
class GptSampler {
 public:
  GptSampler(const GptWindowDataset& dataset, uint64_t seed, bool shuffle);
  /// Index of the sample at global position g (g >= 0). Caches the current epoch's permutation.
  int64_t sample_index(int64_t global_index);
  /// out: [batch_size, seq_length + 1] int32, rows = global samples consumed_samples .. + batch_size.
  void get_batch(int64_t consumed_samples, int64_t batch_size, int32_t* out);

 private:
  const GptWindowDataset& dataset_;
  uint64_t seed_;
  bool shuffle_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> perm_;
};

/// One-shot form of GptSampler::get_batch (recomputes the permutation; use GptSampler in a loop).
void get_batch(const GptWindowDataset& dataset, int64_t consumed_samples, int64_t batch_size, uint64_t seed,
               bool shuffle, int32_t* out);

/// SplitMix64 finaliser of x + 0x9E3779B97F4A7C15 (Steele, Lea, Flood 2014; Vigna's constants).
uint64_t splitmix64(uint64_t x);
/// The permutation of epoch `epoch` (see GptSampler).
std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch);

}  // namespace mt::data
