// Megatron-Core's GPTDataset (megatron/core/datasets/gpt_dataset.py + helpers.cpp), with the same
// document, sample and shuffle indices, so that for the same data, --split, --seq-length, sample
// count and --seed the samples come in the order Megatron-LM produces.
//
// Terms (Megatron's): the low-level dataset is a list of token sequences (one per document as
// preprocess-data writes them, several with --split-sentences); a split is a range of *sequence*
// indices [begin, end) (GPTDataset.numel_low_level_dataset counts sequences). For a split with T
// tokens ("tokens per epoch"), sequence length s and extra token x = 1 (add_extra_token_to_sequence):
//   num_epochs  = smallest E >= 1 with E*T >= num_samples*s + x (1 when num_samples is unset);
//   separate_final_epoch (E > 1): with S' = ((E-1)*T - x) // s samples before the last epoch and
//     P = (T - x) // s samples per epoch, the last epoch is shuffled separately iff
//     num_samples - S' < int(0.80 * P);
//   rng = numpy.random.RandomState(seed);
//   document_index = the split's sequence ids repeated E times, shuffled with rng (when separated:
//     the first E-1 epochs shuffled together, then the last epoch alone, same rng);
//   sample_index[k] = (position in document_index, offset) where sample k starts (helpers.cpp
//     build_sample_idx): samples of s + x tokens over the concatenated documents, consecutive
//     samples sharing x tokens; (E*T - x) // s samples (ceil with float32 arithmetic when
//     drop_last_partial_sequence is false);
//   shuffle_index = rng.shuffle(arange(n)) (when separated: arange(S') and arange(S', n) shuffled
//     one after the other);
//   sample i = tokens from sample_index[shuffle_index[i]] to sample_index[shuffle_index[i] + 1] + x.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "data/index_cache.h"
#include "data/indexed_dataset.h"
#include "data/numpy_random.h"
#include "data/sample_source.h"

namespace mt::data {

/// Megatron's "low-level dataset": token sequences with known lengths. Thread-safe reads.
class TokenSequences {
 public:
  virtual ~TokenSequences() = default;
  virtual int64_t num_sequences() const = 0;
  /// All sequence lengths (int32, as Megatron's sequence_lengths).
  virtual std::span<const int32_t> sequence_lengths() const = 0;
  /// Tokens [offset, offset + count) of sequence i, as int32. Errors: out-of-range arguments.
  virtual void read(int64_t i, int64_t offset, int64_t count, int32_t* out) const = 0;
  /// Path prefix (for descriptions and messages); "" for synthetic data.
  virtual std::string path() const = 0;
};

/// TokenSequences over a Megatron indexed dataset (.bin/.idx).
class IndexedTokenSequences final : public TokenSequences {
 public:
  explicit IndexedTokenSequences(std::shared_ptr<const IndexedDataset> dataset) : dataset_(std::move(dataset)) {}
  int64_t num_sequences() const override { return dataset_->num_sequences(); }
  std::span<const int32_t> sequence_lengths() const override { return dataset_->sequence_lengths(); }
  void read(int64_t i, int64_t offset, int64_t count, int32_t* out) const override {
    dataset_->read(i, offset, count, out);
  }
  std::string path() const override { return dataset_->prefix(); }
  const IndexedDataset& dataset() const { return *dataset_; }

 private:
  std::shared_ptr<const IndexedDataset> dataset_;
};

// ---- The index-building steps, exactly as Megatron (exposed for tests against reference data) ----

/// GPTDataset._get_num_epochs. num_samples < 0 means None (one epoch). Error: tokens_per_epoch < 1.
int64_t gpt_num_epochs(int64_t tokens_per_epoch, int64_t num_samples, int64_t seq_length, int64_t extra_tokens);

/// gpt_dataset.py _build_document_index: `documents` repeated num_epochs times, shuffled with rng
/// (the last epoch separately when separate_final_epoch and num_epochs > 1).
std::vector<int32_t> build_document_index(std::span<const int32_t> documents, int64_t num_epochs,
                                          NumpyRandomState& rng, bool separate_final_epoch);

/// helpers.cpp build_sample_idx: returns [(num_samples + 1) * 2] (document_index position, offset)
/// pairs. Errors: seq_length < 1, tokens_per_epoch < 1, num_epochs < 1, an index inconsistent with
/// the sizes (Megatron's asserts).
std::vector<int64_t> build_sample_index(std::span<const int32_t> sizes, std::span<const int32_t> document_index,
                                        int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch,
                                        bool drop_last_partial_sequence, int64_t extra_tokens);

/// gpt_dataset.py _build_shuffle_index: arange(num_samples) shuffled, then (if total_size >
/// num_samples) arange(num_samples, total_size) shuffled, with the same rng.
std::vector<int64_t> build_shuffle_index(int64_t num_samples, int64_t total_size, NumpyRandomState& rng);

struct GptIndices {
  std::vector<int32_t> document_index;
  std::vector<int64_t> sample_index;  ///< flattened pairs
  std::vector<int64_t> shuffle_index;
  int64_t num_epochs = 0;
  int64_t tokens_per_epoch = 0;
  bool separate_final_epoch = false;
};

/// GPTDataset._build_document_sample_shuffle_indices (without caching) for sequences [begin, end).
/// num_samples < 0 = None. Errors: an empty split or one without tokens (Megatron would loop forever),
/// seq_length < 1, a seed outside [0, 2^32).
GptIndices build_gpt_indices(std::span<const int32_t> sequence_lengths, int64_t begin, int64_t end,
                             int64_t num_samples, int64_t seq_length, uint64_t seed, bool add_extra_token,
                             bool drop_last_partial_sequence);

struct GptDatasetConfig {
  int64_t seq_length = 0;                  ///< --seq-length
  uint64_t seed = 1234;                    ///< --seed (Megatron's default 1234); must be < 2^32
  bool add_extra_token = true;             ///< Megatron's add_extra_token_to_sequence (always true in pretrain_gpt)
  bool drop_last_partial_sequence = true;  ///< Megatron: true except valid with drop_last_partial_validation_sequence=false
  std::string split_string;                ///< --split as given (part of the cache key only)
  IndexCacheOptions cache;                 ///< --data-cache-path (empty: no cache)
};

/// Megatron's GPTDataset over sequences [begin, end) of `sequences`.
class GptDataset final : public SampleSource {
 public:
  /// num_samples < 0 means None (one epoch). Builds the indices or loads them from the cache.
  /// Errors: bad range, empty split ("the train split of <path> has no sequences ..."), see
  /// build_gpt_indices and load_or_build_index_arrays.
  GptDataset(std::shared_ptr<const TokenSequences> sequences, int64_t begin, int64_t end, int64_t num_samples,
             Split split, const GptDatasetConfig& config);

  int64_t size() const override { return static_cast<int64_t>(sample_index_.size() / 2) - 1; }
  int64_t sample_tokens() const override { return config_.seq_length + (config_.add_extra_token ? 1 : 0); }
  /// Sample i, padded with kPadTokenId when partial (only possible without drop_last_partial_sequence).
  void get(int64_t i, int32_t* out) const override;
  std::string name() const override;

  const std::vector<int32_t>& document_index() const { return document_index_; }
  const std::vector<int64_t>& sample_index() const { return sample_index_; }
  const std::vector<int64_t>& shuffle_index() const { return shuffle_index_; }
  int64_t num_samples_requested() const { return num_samples_; }
  Split split() const { return split_; }
  /// The cache key description (JSON).
  const std::string& description() const { return description_; }
  /// True when this instance built the indices (false when they came from the cache).
  bool built_indices() const { return built_; }
  const TokenSequences& sequences() const { return *sequences_; }

 private:
  std::shared_ptr<const TokenSequences> sequences_;
  int64_t begin_, end_, num_samples_;
  Split split_;
  GptDatasetConfig config_;
  std::string description_;
  bool built_ = false;
  std::vector<int32_t> document_index_;
  std::vector<int64_t> sample_index_;
  std::vector<int64_t> shuffle_index_;
};

}  // namespace mt::data
