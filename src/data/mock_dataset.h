// Megatron-Core's mock GPT data (gpt_dataset.py MockGPTLowLevelDataset / MockGPTDataset), used with
// --mock-data for benchmarks: no files, deterministic synthetic tokens.
//
// The low-level dataset has 100,000 sequences; their lengths are
// numpy.random.default_rng(0).integers(1, 4096, size=100000, dtype=int32) (reproduced bit-exactly,
// data/numpy_random.h), and sequence i is the tokens (1, 2, ..., L_i - 1) mod vocab_size followed by
// the EOD token. MockGPTDataset is a GPTDataset over it: split "1,1,1" of the 100,000 sequences
// (Megatron sets this split for mock data), shuffled with --seed like real data, never cached.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/gpt_dataset.h"

namespace mt::data {

class MockTokenSequences final : public TokenSequences {
 public:
  static constexpr int64_t kSize = 100000;
  static constexpr int32_t kMaxSequenceLength = 4096;
  static constexpr uint64_t kSeed = 0;

  /// Errors: vocab_size < 2, eod outside [0, vocab_size).
  MockTokenSequences(int64_t vocab_size, int32_t eod);
  int64_t num_sequences() const override { return kSize; }
  std::span<const int32_t> sequence_lengths() const override { return lengths_; }
  void read(int64_t i, int64_t offset, int64_t count, int32_t* out) const override;
  std::string path() const override { return ""; }

 private:
  int64_t vocab_size_;
  int32_t eod_;
  std::vector<int32_t> lengths_;
};

/// The three MockGPTDataset splits (train, valid, test) with the requested sample counts (< 0: one
/// epoch). Config.cache is ignored (mock indices are never cached, as in Megatron).
std::array<std::shared_ptr<GptDataset>, 3> build_mock_gpt_datasets(int64_t vocab_size, int32_t eod,
                                                                    const std::array<int64_t, 3>& num_samples,
                                                                    GptDatasetConfig config);

}  // namespace mt::data
