// The interface through which the trainer reads training samples, and the common types of the
// Megatron-compatible datasets (GPTDataset, BlendedDataset, MockGPTDataset).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace mt::data {

/// Megatron's pad token id for partial samples (megatron_dataset.py _PAD_TOKEN_ID). Only the last
/// sample of an index built with drop_last_partial_sequence = false can contain it.
inline constexpr int32_t kPadTokenId = -1;

/// A finite, random-access sequence of training samples. Thread-safe for concurrent get().
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  /// Number of samples; valid indices are [0, size()).
  virtual int64_t size() const = 0;
  /// Tokens per sample written by get(): seq_length + 1 (Megatron's add_extra_token_to_sequence).
  virtual int64_t sample_tokens() const = 0;
  /// Writes sample i (sample_tokens() int32 values; inputs = [0, s), labels = [1, s]) to out.
  /// Error (mt::Error): i outside [0, size()).
  virtual void get(int64_t i, int32_t* out) const = 0;
  /// Short description for logs, e.g. "GPTDataset(train, data/x_text_document, 1000 samples)".
  virtual std::string name() const = 0;
};

/// Megatron's Split enum: train = 0, valid = 1, test = 2.
enum class Split : int { kTrain = 0, kValid = 1, kTest = 2 };
/// "train", "valid", "test".
std::string_view split_enum_name(Split s);

}  // namespace mt::data
