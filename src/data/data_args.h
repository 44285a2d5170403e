// Megatron-LM's data flags and the one call the trainer makes to build train/valid/test samples,
// mirroring megatron/training (arguments.py _add_data_args, get_blend_and_blend_per_split) and
// megatron/core/datasets/blended_megatron_dataset_builder.py (_build_blended_dataset_splits).
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/sample_source.h"
#include "data/tokenizer.h"

namespace CLI {
class App;
}

namespace mt::data {

struct DataArgs {
  std::vector<std::string> data_path;        ///< --data-path: "p" | "p1 p2 ..." | "w1 p1 w2 p2 ..."
  std::string split;                         ///< --split (default "969, 30, 1" when --data-path is used)
  std::vector<std::string> train_data_path;  ///< --train-data-path (same forms as --data-path)
  std::vector<std::string> valid_data_path;  ///< --valid-data-path
  std::vector<std::string> test_data_path;   ///< --test-data-path
  std::string data_cache_path;               ///< --data-cache-path: index cache directory ("" = no cache)
  bool mock_data = false;                    ///< --mock-data
  bool reset_position_ids = false;           ///< --reset-position-ids
  bool reset_attention_mask = false;         ///< --reset-attention-mask
  bool eod_mask_loss = false;                ///< --eod-mask-loss
  std::string tokenizer_type = "GPT2BPETokenizer";  ///< --tokenizer-type
  std::string vocab_file, merge_file;        ///< --vocab-file, --merge-file (GPT2BPETokenizer)
  std::string tokenizer_model;               ///< --tokenizer-model (HuggingFace / SentencePiece)
  int64_t vocab_size = 0;                    ///< --vocab-size (NullTokenizer, TikTokenizer)
  TikTokenOptions tiktoken;                  ///< --tiktoken-pattern, ... (add_tiktoken_options)
  double mid_level_dataset_surplus = 0.005;  ///< --mid-level-dataset-surplus
  /// Index cache coordination for multi-rank runs: the rank that builds (Megatron: global rank 0)
  /// sets true, the others false and wait for the files (see data/index_cache.h).
  bool build_indices = true;
  double cache_wait_timeout_s = 3600;
};

/// Registers the flags above on `app` with Megatron's names (--data-path, --split,
/// --train-data-path, --valid-data-path, --test-data-path, --data-cache-path, --mock-data,
/// --reset-position-ids, --reset-attention-mask, --eod-mask-loss, --tokenizer-type, --vocab-file,
/// --merge-file, --tokenizer-model, --vocab-size, --mid-level-dataset-surplus).
void add_data_options(CLI::App& app, DataArgs& args);

/// --tiktoken-pattern v1|v2, --tiktoken-num-special-tokens N, --tokenizer-special-tokens (and
/// Megatron-LM's older spelling --tiktoken-special-tokens) into `o` (TikTokenizer).
void add_tiktoken_options(CLI::App& app, TikTokenOptions& o);

/// Builds the tokenizer named by args (make_tokenizer).
std::unique_ptr<Tokenizer> build_tokenizer(const DataArgs& args);

/// The datasets of the three splits; a split that Megatron would not build (weight 0 in --split,
/// no --*-data-path for it) is nullptr.
struct DataSplits {
  std::unique_ptr<SampleSource> train, valid, test;
};

/// Builds the datasets as Megatron's BlendedMegatronDatasetBuilder does for GPTDataset:
///  - --mock-data: MockGPTDataset splits (data/mock_dataset.h);
///  - --data-path with one prefix and no weight: one GPTDataset per split (documents split by --split);
///  - --data-path with several prefixes and/or weights: per prefix, a GPTDataset per split asked for
///    ceil(ceil(n_split * w) * (1 + surplus)) samples, then a BlendedDataset of sum_d ceil(n_split * w_d)
///    samples (weights normalised); without weights, each GPTDataset is one epoch and the blend takes
///    min(n_split, sum of lengths) samples in proportion to the lengths;
///  - --train/valid/test-data-path: each split from its own blend, using all documents.
/// Sample counts (Megatron's get_train_valid_test_num_samples): train = train_iters * global_batch,
/// valid = (train_iters // eval_interval + 1) * eval_iters * global_batch, test = eval_iters *
/// global_batch; a count < 0 means None (one epoch). seed = --seed (< 2^32).
/// Errors (mt::Error): no data source (none of --mock-data, --data-path, --*-data-path), both
/// --data-path and a --*-data-path, a bad --split or blend, the dataset errors.
DataSplits build_gpt_datasets(const DataArgs& args, int64_t seq_length, uint64_t seed, int64_t train_samples,
                              int64_t valid_samples, int64_t test_samples, const Tokenizer& tokenizer);

/// Megatron's get_train_valid_test_num_samples for iteration-based training (no --train-samples).
std::array<int64_t, 3> train_valid_test_num_samples(int64_t train_iters, int64_t global_batch_size,
                                                    int64_t eval_interval, int64_t eval_iters);

}  // namespace mt::data
