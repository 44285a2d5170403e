#include "data/gpt_dataset.h"

#include <algorithm>

#include <chrono>

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/logging.h"
#include "core/host_memory.h"

namespace mt::data {

std::string_view split_enum_name(Split s) {
  switch (s) {
    case Split::kTrain: return "train";
    case Split::kValid: return "valid";
    case Split::kTest: return "test";
  }
  return "?";
}

int64_t gpt_num_epochs(int64_t tokens_per_epoch, int64_t num_samples, int64_t seq_length, int64_t extra_tokens) {
  MT_REQUIRE(tokens_per_epoch >= 1, "GPTDataset: an epoch has {} tokens; need at least 1", tokens_per_epoch);
  if (num_samples < 0) return 1;
  const int64_t requested = num_samples * seq_length + extra_tokens;
  int64_t epochs = 1, tokens = tokens_per_epoch;
  if (tokens < requested) {  // closed form of Megatron's `while num_tokens < requested` loop
    epochs = (requested + tokens_per_epoch - 1) / tokens_per_epoch;
  }
  return epochs;
}

std::vector<int32_t> build_document_index(std::span<const int32_t> documents, int64_t num_epochs,
                                          NumpyRandomState& rng, bool separate_final_epoch) {
  MT_REQUIRE(num_epochs >= 1, "build_document_index: num_epochs = {} < 1", num_epochs);
  if (!separate_final_epoch || num_epochs == 1) {
    std::vector<int32_t> index;
    index.reserve(documents.size() * static_cast<size_t>(num_epochs));
    for (int64_t e = 0; e < num_epochs; ++e) index.insert(index.end(), documents.begin(), documents.end());
    rng.shuffle(index);
    return index;
  }
  std::vector<int32_t> first = build_document_index(documents, num_epochs - 1, rng, false);
  std::vector<int32_t> last = build_document_index(documents, 1, rng, false);
  first.insert(first.end(), last.begin(), last.end());
  return first;
}

std::vector<int64_t> build_sample_index(std::span<const int32_t> sizes, std::span<const int32_t> document_index,
                                        int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch,
                                        bool drop_last_partial_sequence, int64_t extra) {
  MT_REQUIRE(seq_length >= 1, "build_sample_index: seq_length = {} < 1", seq_length);
  MT_REQUIRE(num_epochs >= 1, "build_sample_index: num_epochs = {} < 1", num_epochs);
  MT_REQUIRE(tokens_per_epoch >= 1, "build_sample_index: tokens_per_epoch = {} < 1", tokens_per_epoch);
  MT_REQUIRE(!document_index.empty(), "build_sample_index: empty document index");
  const int64_t total = num_epochs * tokens_per_epoch - extra;
  int64_t num_samples;
  if (drop_last_partial_sequence) {
    num_samples = total / seq_length;
  } else {  // helpers.cpp: ceil(float(...) / seq_length) in single precision
    num_samples = static_cast<int64_t>(std::ceil(static_cast<float>(total) / static_cast<float>(seq_length)));
  }
  MT_REQUIRE(num_samples >= 0, "build_sample_index: negative sample count {}", num_samples);
  std::vector<int64_t> idx(static_cast<size_t>(2 * (num_samples + 1)));
  int64_t sample = 0, doc_pos = 0, doc_offset = 0;
  const int64_t last_pos = static_cast<int64_t>(document_index.size()) - 1;
  idx[0] = 0;
  idx[1] = 0;
  ++sample;
  auto size_of = [&](int64_t pos) {
    const int32_t d = document_index[pos];
    MT_CHECK(d >= 0 && static_cast<size_t>(d) < sizes.size(), "document id {} outside [0, {})", d, sizes.size());
    return static_cast<int64_t>(sizes[d]);
  };
  while (sample <= num_samples) {
    int64_t remaining = seq_length + extra;
    while (remaining != 0) {
      const int64_t doc_len = size_of(doc_pos) - doc_offset;
      remaining -= doc_len;
      if (remaining <= 0) {
        doc_offset += remaining + doc_len - extra;
        remaining = 0;
      } else {
        if (doc_pos == last_pos) {
          MT_CHECK(sample == num_samples, "build_sample_index ran out of documents at sample {} of {}", sample,
                   num_samples);
          doc_offset = size_of(doc_pos) - extra;
          break;
        }
        ++doc_pos;
        doc_offset = 0;
      }
    }
    idx[2 * sample] = doc_pos;
    idx[2 * sample + 1] = doc_offset;
    ++sample;
  }
  return idx;
}

std::vector<int64_t> build_shuffle_index(int64_t num_samples, int64_t total_size, NumpyRandomState& rng) {
  MT_REQUIRE(0 <= num_samples && num_samples <= total_size, "build_shuffle_index: bad sizes {} / {}", num_samples,
             total_size);
  std::vector<int64_t> index(static_cast<size_t>(total_size));
  for (int64_t i = 0; i < total_size; ++i) index[i] = i;
  rng.shuffle(std::span<int64_t>(index.data(), static_cast<size_t>(num_samples)));
  if (num_samples < total_size) {
    rng.shuffle(std::span<int64_t>(index.data() + num_samples, static_cast<size_t>(total_size - num_samples)));
  }
  return index;
}

GptIndices build_gpt_indices(std::span<const int32_t> lengths, int64_t begin, int64_t end, int64_t num_samples,
                             int64_t seq_length, uint64_t seed, bool add_extra_token, bool drop_last) {
  MT_REQUIRE(seq_length >= 1, "GPTDataset: --seq-length must be >= 1, got {}", seq_length);
  MT_REQUIRE(0 <= begin && begin <= end && end <= static_cast<int64_t>(lengths.size()),
             "GPTDataset: sequence range [{}, {}) outside [0, {})", begin, end, lengths.size());
  MT_REQUIRE(end <= INT32_MAX, "GPTDataset: {} sequences exceed Megatron's int32 document ids", end);
  const int64_t x = add_extra_token ? 1 : 0;
  GptIndices r;
  for (int64_t i = begin; i < end; ++i) r.tokens_per_epoch += lengths[i];
  MT_REQUIRE(end > begin, "GPTDataset: the split is empty (sequence range [{}, {}))", begin, end);
  MT_REQUIRE(r.tokens_per_epoch > x, "GPTDataset: the split (sequences [{}, {})) has only {} tokens", begin, end,
             r.tokens_per_epoch);
  r.num_epochs = gpt_num_epochs(r.tokens_per_epoch, num_samples, seq_length, x);
  int64_t samples_sans_final = 0;
  if (r.num_epochs > 1) {
    samples_sans_final = ((r.num_epochs - 1) * r.tokens_per_epoch - x) / seq_length;
    const int64_t from_final = num_samples - samples_sans_final;
    const int64_t per_epoch = (r.tokens_per_epoch - x) / seq_length;
    MT_CHECK(from_final >= 0 && from_final <= per_epoch + 1, "samples from the final epoch {} (per epoch {})",
             from_final, per_epoch);
    r.separate_final_epoch = from_final < static_cast<int64_t>(0.80 * static_cast<double>(per_epoch));
  }
  NumpyRandomState rng(seed);
  std::vector<int32_t> docs(static_cast<size_t>(end - begin));
  for (int64_t i = begin; i < end; ++i) docs[i - begin] = static_cast<int32_t>(i);
  r.document_index = build_document_index(docs, r.num_epochs, rng, r.separate_final_epoch);
  r.sample_index = build_sample_index(lengths, r.document_index, seq_length, r.num_epochs, r.tokens_per_epoch,
                                      drop_last, x);
  const int64_t n = static_cast<int64_t>(r.sample_index.size() / 2) - 1;
  r.shuffle_index = build_shuffle_index(r.separate_final_epoch ? samples_sans_final : n, n, rng);
  return r;
}

GptDataset::GptDataset(std::shared_ptr<const TokenSequences> sequences, int64_t begin, int64_t end,
                       int64_t num_samples, Split split, const GptDatasetConfig& config)
    : sequences_(std::move(sequences)),
      begin_(begin),
      end_(end),
      num_samples_(num_samples < 0 ? -1 : num_samples),
      split_(split),
      config_(config) {
  MT_REQUIRE(sequences_ != nullptr, "GPTDataset: no token sequences");
  const std::span<const int32_t> lengths = sequences_->sequence_lengths();
  const std::string path = sequences_->path().empty() ? "<mock data>" : sequences_->path();
  MT_REQUIRE(0 <= begin && begin <= end && end <= static_cast<int64_t>(lengths.size()),
             "GPTDataset {}: sequence range [{}, {}) outside [0, {})", path, begin, end, lengths.size());
  int64_t tokens = 0;
  for (int64_t i = begin; i < end; ++i) tokens += lengths[i];
  MT_REQUIRE(end > begin && tokens > (config.add_extra_token ? 1 : 0),
             "GPTDataset: the {} split of '{}' is empty: sequences [{}, {}) of {} hold {} tokens (check --split "
             "and the data)",
             split_enum_name(split), path, begin, end, lengths.size(), tokens);
  MT_REQUIRE(config.seed <= 0xFFFFFFFFull, "GPTDataset: --seed {} must be in [0, 2**32 - 1] (numpy RandomState)",
             config.seed);
  // The cache key: everything the indices depend on, plus a fingerprint of the sequence lengths.
  nlohmann::ordered_json d;
  d["class"] = "GPTDataset";
  d["dataset_path"] = sequences_->path();
  d["num_samples"] = num_samples_ < 0 ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(num_samples_);
  d["index_split"] = std::string(split_enum_name(split));
  d["random_seed"] = config.seed;
  d["sequence_length"] = config.seq_length;
  d["split"] = config.split_string;
  d["sequence_range"] = {begin, end};
  d["add_extra_token_to_sequence"] = config.add_extra_token;
  d["drop_last_partial_sequence"] = config.drop_last_partial_sequence;
  d["num_sequences"] = lengths.size();
  d["num_tokens_in_range"] = tokens;
  d["lengths_fnv1a64"] = fmt::format("{:016x}", fnv1a64(lengths.data() + begin, (end - begin) * sizeof(int32_t)));
  description_ = d.dump(4);
  // Before any index is built: what it will take (Megatron's sizes: document index int32 per
  // document per epoch, sample index 2 x int64 and shuffle index int64 per sample) against the
  // memory there is. An absurd --train-iters / --global-batch-size is an error here, not minutes
  // of work and then std::bad_alloc.
  const double x = config.add_extra_token ? 1 : 0;
  const double samples = num_samples_ < 0 ? static_cast<double>(tokens) / static_cast<double>(config.seq_length)
                                          : static_cast<double>(num_samples_);
  const double epochs = std::max(1.0, std::ceil((samples * static_cast<double>(config.seq_length) + x) /
                                                static_cast<double>(tokens)));
  const double index_bytes = static_cast<double>(end - begin) * epochs * 4 + samples * 24;
  const uint64_t avail = available_host_memory_bytes();
  MT_REQUIRE(avail == 0 || index_bytes < 0.8 * static_cast<double>(avail),
             "GPTDataset: the {} split of '{}' has {} tokens; {:.0f} samples of --seq-length {} would take {:.3g} "
             "epochs over it and an index of {:.3g} GiB, more than the {:.1f} GiB of memory available (lower "
             "--train-iters or --global-batch-size, or add data)",
             split_enum_name(split), path, tokens, samples, config.seq_length, epochs, index_bytes / 1073741824.0,
             static_cast<double>(avail) / 1073741824.0);
  const bool long_build = index_bytes > 256.0 * 1048576.0;
  IndexArrays arrays = load_or_build_index_arrays(
      config.cache, description_, fmt::format("GPTDataset-{}", split_enum_name(split)),
      [&] {
        const auto t0 = std::chrono::steady_clock::now();
        if (long_build)
          log_info("> building the {} index of {}: {:.0f} samples over {:.0f} epochs ({:.2f} GiB); this takes a "
                   "while...", split_enum_name(split), path, samples, epochs, index_bytes / 1073741824.0);
        GptIndices g = build_gpt_indices(lengths, begin, end, num_samples_, config.seq_length, config.seed,
                                         config.add_extra_token, config.drop_last_partial_sequence);
        if (long_build)
          log_info("> built the {} index of {} in {:.1f} s", split_enum_name(split), path,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        IndexArrays a;
        a.i32.push_back(std::move(g.document_index));
        a.i64.push_back(std::move(g.sample_index));
        a.i64.push_back(std::move(g.shuffle_index));
        return a;
      },
      &built_);
  MT_REQUIRE(arrays.i32.size() == 1 && arrays.i64.size() == 2 && arrays.i64[0].size() >= 2 &&
                 arrays.i64[0].size() % 2 == 0 && arrays.i64[1].size() == arrays.i64[0].size() / 2 - 1,
             "GPTDataset: malformed cached indices for '{}'", path);
  document_index_ = std::move(arrays.i32[0]);
  sample_index_ = std::move(arrays.i64[0]);
  shuffle_index_ = std::move(arrays.i64[1]);
}

void GptDataset::get(int64_t i, int32_t* out) const {
  MT_REQUIRE(i >= 0 && i < size(), "GPTDataset {}: sample {} outside [0, {})", name(), i, size());
  const int64_t x = config_.add_extra_token ? 1 : 0;
  const int64_t want = config_.seq_length + x;
  const int64_t k = shuffle_index_[i];
  const int64_t b = sample_index_[2 * k], bo = sample_index_[2 * k + 1];
  const int64_t e = sample_index_[2 * k + 2], eo = sample_index_[2 * k + 3];
  const std::span<const int32_t> lengths = sequences_->sequence_lengths();
  int64_t n = 0;
  auto read = [&](int64_t pos, int64_t offset, int64_t count) {
    const int32_t doc = document_index_[pos];
    count = std::min<int64_t>(count, lengths[doc] - offset);  // numpy slicing clamps at the end
    count = std::min<int64_t>(count, want - n);
    if (count > 0) sequences_->read(doc, offset, count, out + n);
    n += std::max<int64_t>(count, 0);
  };
  if (b == e) {
    read(b, bo, eo - bo + x);
  } else {
    for (int64_t p = b; p <= e; ++p) {
      const int64_t offset = p == b ? bo : 0;
      read(p, offset, p < e ? lengths[document_index_[p]] - offset : eo + x);
    }
  }
  for (; n < want; ++n) out[n] = kPadTokenId;
}

std::string GptDataset::name() const {
  return fmt::format("GPTDataset({}, {}, {} samples)", split_enum_name(split_),
                     sequences_->path().empty() ? "<mock>" : sequences_->path(), size());
}

}  // namespace mt::data
