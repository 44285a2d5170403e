#include "data/mock_dataset.h"

#include "core/check.h"
#include "data/gpt_window_dataset.h"
#include "data/numpy_random.h"

namespace mt::data {

MockTokenSequences::MockTokenSequences(int64_t vocab_size, int32_t eod) : vocab_size_(vocab_size), eod_(eod) {
  MT_REQUIRE(vocab_size >= 2, "mock data: vocab size {} must be >= 2", vocab_size);
  MT_REQUIRE(eod >= 0 && eod < vocab_size, "mock data: EOD id {} outside [0, {})", eod, vocab_size);
  lengths_ = NumpyPcg64(kSeed).integers_int32(1, kMaxSequenceLength, kSize);
}

void MockTokenSequences::read(int64_t i, int64_t offset, int64_t count, int32_t* out) const {
  MT_REQUIRE(i >= 0 && i < kSize, "mock data: sequence {} outside [0, {})", i, kSize);
  const int64_t len = lengths_[i];
  MT_REQUIRE(offset >= 0 && count >= 0 && offset + count <= len, "mock data: range [{}, {}) outside sequence {} of {}",
             offset, offset + count, i, len);
  for (int64_t k = 0; k < count; ++k) {
    const int64_t pos = offset + k;
    out[k] = pos == len - 1 ? eod_ : static_cast<int32_t>((pos + 1) % vocab_size_);
  }
}

std::array<std::shared_ptr<GptDataset>, 3> build_mock_gpt_datasets(int64_t vocab_size, int32_t eod,
                                                                    const std::array<int64_t, 3>& num_samples,
                                                                    GptDatasetConfig config) {
  auto seqs = std::make_shared<MockTokenSequences>(vocab_size, eod);
  config.cache = IndexCacheOptions{};
  config.split_string = "1,1,1";
  const auto ranges = split_document_ranges(parse_split("1,1,1"), MockTokenSequences::kSize);
  std::array<std::shared_ptr<GptDataset>, 3> out;
  for (int s = 0; s < 3; ++s) {
    out[s] = std::make_shared<GptDataset>(seqs, ranges[s].first, ranges[s].second, num_samples[s],
                                          static_cast<Split>(s), config);
  }
  return out;
}

}  // namespace mt::data
