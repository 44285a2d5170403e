#include "data/gpt_window_dataset.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <random>

#include "core/check.h"

namespace mt::data {

std::array<double, 3> parse_split(std::string_view split) {
  std::array<double, 3> v{0.0, 0.0, 0.0};
  // Quotes kept by a launch script's word splitting ("--split '99,1,0'" inside a bash array, as in
  // Megatron-LM's Llama 3 example): Megatron reads the numbers only, so a quoted list is accepted.
  if (split.size() >= 2 && (split.front() == '\'' || split.front() == '"') && split.back() == split.front())
    split = split.substr(1, split.size() - 2);
  std::string_view rest = split;
  auto trim = [](std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
  };
  MT_REQUIRE(!trim(split).empty(), "--split: empty string (expected e.g. \"969,30,1\" or \"98/2/0\")");
  int count = 0;
  while (true) {
    const size_t sep = rest.find_first_of(",/");
    const std::string_view token = trim(rest.substr(0, sep));
    MT_REQUIRE(count < 3, "--split \"{}\": more than 3 values (train, valid, test)", split);
    MT_REQUIRE(!token.empty() && token.find_first_not_of("0123456789.") == std::string_view::npos,
               "--split \"{}\": \"{}\" is not a non-negative number (expected e.g. \"969,30,1\" or \"98/2/0\")",
               split, token);
    double x = 0;
    auto [ptr, ec] = std::from_chars(token.data(), token.data() + token.size(), x);
    MT_REQUIRE(ec == std::errc() && ptr == token.data() + token.size() && std::isfinite(x),
               "--split \"{}\": \"{}\" is not a number", split, token);
    v[count++] = x;
    if (sep == std::string_view::npos) break;
    rest = rest.substr(sep + 1);
  }
  const double sum = v[0] + v[1] + v[2];
  MT_REQUIRE(sum > 0, "--split \"{}\": all weights are zero", split);
  for (double& x : v) x /= sum;  // Megatron's normalize(): w / sum(w) in float64
  return v;
}

std::array<std::pair<int64_t, int64_t>, 3> split_document_ranges(const std::array<double, 3>& f,
                                                                 int64_t num_documents) {
  MT_REQUIRE(num_documents >= 0, "split_document_ranges: num_documents = {} < 0", num_documents);
  for (int i = 0; i < 3; ++i) {
    MT_REQUIRE(f[i] >= 0 && std::isfinite(f[i]), "split_document_ranges: fraction {} = {} is invalid", i, f[i]);
  }
  const double d = static_cast<double>(num_documents);
  std::array<double, 4> bookend{0.0, 0.0, 0.0, 0.0};
  for (int i = 0; i < 3; ++i) bookend[i + 1] = bookend[i] + f[i];
  // std::nearbyint rounds half to even in the default rounding mode, as Python's round().
  auto at = [&](double c) { return std::clamp<int64_t>(static_cast<int64_t>(std::nearbyint(c * d)), 0, num_documents); };
  std::array<std::pair<int64_t, int64_t>, 3> r;
  int last = -1;
  for (int i = 0; i < 3; ++i) {
    if (bookend[i + 1] <= bookend[i]) {  // Megatron: no split (None)
      r[i] = {at(bookend[i]), at(bookend[i])};
    } else {
      r[i] = {at(bookend[i]), at(bookend[i + 1])};
      last = i;
    }
  }
  if (last >= 0) r[last].second = num_documents;
  return r;
}

std::string_view split_name(int i) {
  static constexpr std::string_view kNames[3] = {"train", "valid", "test"};
  return i >= 0 && i < 3 ? kNames[i] : std::string_view("?");
}

// -------------------------------------------------------------------------------------------------
// GptWindowDataset
// -------------------------------------------------------------------------------------------------

GptWindowDataset::GptWindowDataset(std::shared_ptr<const IndexedDataset> dataset, int64_t doc_begin,
                                   int64_t doc_end, int64_t seq_length, std::string name)
    : dataset_(std::move(dataset)), doc_begin_(doc_begin), doc_end_(doc_end), seq_length_(seq_length),
      name_(std::move(name)) {
  MT_REQUIRE(dataset_ != nullptr, "GptWindowDataset ({} split): null dataset", name_);
  const int64_t docs = dataset_->num_documents();
  MT_REQUIRE(doc_begin >= 0 && doc_begin <= doc_end && doc_end <= docs,
             "GptWindowDataset ({} split): document range [{}, {}) is invalid for '{}' with {} documents", name_,
             doc_begin, doc_end, dataset_->prefix(), docs);
  MT_REQUIRE(seq_length >= 1, "GptWindowDataset ({} split): seq_length must be >= 1, got {}", name_, seq_length);
  const auto& di = dataset_->document_indices();
  seq_begin_ = di[doc_begin];
  seq_end_ = di[doc_end];
  const auto& lengths = dataset_->sequence_lengths();
  cum_tokens_.resize(static_cast<size_t>(seq_end_ - seq_begin_ + 1));
  cum_tokens_[0] = 0;
  for (int64_t s = seq_begin_; s < seq_end_; ++s) {
    cum_tokens_[s - seq_begin_ + 1] = cum_tokens_[s - seq_begin_] + lengths[s];
  }
  num_tokens_ = cum_tokens_.back();
  MT_REQUIRE(num_tokens_ >= seq_length + 1,
             "GptWindowDataset: the {} split (documents [{}, {}) of '{}') has {} tokens, fewer than one sample "
             "needs (seq_length + 1 = {})",
             name_, doc_begin, doc_end, dataset_->prefix(), num_tokens_, seq_length + 1);
  num_samples_ = (num_tokens_ - 1) / seq_length;
}

void GptWindowDataset::copy_tokens(int64_t pos, int64_t count, int32_t* out) const {
  // Last k with cum_tokens_[k] <= pos: the sequence containing pos (empty sequences are skipped).
  size_t k = static_cast<size_t>(std::upper_bound(cum_tokens_.begin(), cum_tokens_.end(), pos) - cum_tokens_.begin()) - 1;
  while (count > 0) {
    const int64_t seq = seq_begin_ + static_cast<int64_t>(k);
    const int64_t off = pos - cum_tokens_[k];
    const int64_t take = std::min<int64_t>(count, cum_tokens_[k + 1] - pos);
    if (take > 0) {
      dataset_->read(seq, off, take, out);
      out += take;
      pos += take;
      count -= take;
    }
    ++k;
  }
}

void GptWindowDataset::get(int64_t i, int32_t* out) const {
  MT_REQUIRE(i >= 0 && i < num_samples_, "GptWindowDataset ({} split): sample {} out of range [0, {})", name_, i,
             num_samples_);
  copy_tokens(i * seq_length_, seq_length_ + 1, out);
}

void GptWindowDataset::check_token_range(int64_t vocab_size) const {
  constexpr int64_t kChunk = 1 << 16;
  std::vector<int32_t> buf(kChunk);
  int64_t pos = 0;
  const auto& di = dataset_->document_indices();
  for (int64_t s = seq_begin_; s < seq_end_; ++s) {
    const int64_t len = dataset_->sequence_length(s);
    for (int64_t off = 0; off < len; off += kChunk) {
      const int64_t n = std::min(kChunk, len - off);
      dataset_->read(s, off, n, buf.data());
      for (int64_t t = 0; t < n; ++t) {
        const int32_t id = buf[t];
        if (id < 0 || id >= vocab_size) [[unlikely]] {
          // Document containing sequence s: last k with di[k] <= s (and di[k+1] > s).
          const int64_t doc = static_cast<int64_t>(std::upper_bound(di.begin(), di.end(), s) - di.begin()) - 1;
          MT_FAIL(
              "dataset '{}' ({} split): token id {} at position {} of the split (document {}, sequence {}, "
              "offset {}) is outside the vocabulary [0, {})",
              dataset_->prefix(), name_, id, pos + off + t, doc, s, off + t, vocab_size);
        }
      }
    }
    pos += len;
  }
}

// -------------------------------------------------------------------------------------------------
// Sample order
// -------------------------------------------------------------------------------------------------

uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  MT_REQUIRE(n >= 0 && epoch >= 0, "epoch_permutation: n = {}, epoch = {} must be >= 0", n, epoch);
  std::vector<int64_t> perm(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) perm[i] = i;
  std::mt19937_64 rng(splitmix64(splitmix64(seed) ^ static_cast<uint64_t>(epoch)));
  for (int64_t i = n - 1; i >= 1; --i) {
    const uint64_t bound = static_cast<uint64_t>(i) + 1;
    // Largest multiple of bound that fits in 2^64: 2^64 - (2^64 mod bound).
    const uint64_t rem = (~uint64_t{0} % bound + 1) % bound;  // 2^64 mod bound
    uint64_t x;
    do {
      x = rng();
    } while (rem != 0 && x >= uint64_t{0} - rem);  // 0 - rem == 2^64 - rem (mod 2^64)
    std::swap(perm[i], perm[static_cast<int64_t>(x % bound)]);
  }
  return perm;
}

GptSampler::GptSampler(const GptWindowDataset& dataset, uint64_t seed, bool shuffle)
    : dataset_(dataset), seed_(seed), shuffle_(shuffle) {}

int64_t GptSampler::sample_index(int64_t g) {
  MT_REQUIRE(g >= 0, "GptSampler: negative global sample index {}", g);
  const int64_t n = dataset_.num_samples();
  const int64_t epoch = g / n, p = g % n;
  if (!shuffle_) return p;
  if (epoch != cached_epoch_) {
    perm_ = epoch_permutation(n, seed_, epoch);
    cached_epoch_ = epoch;
  }
  return perm_[p];
}

void GptSampler::get_batch(int64_t consumed_samples, int64_t batch_size, int32_t* out) {
  MT_REQUIRE(consumed_samples >= 0 && batch_size >= 1, "get_batch: consumed_samples = {} and batch_size = {}",
             consumed_samples, batch_size);
  const int64_t row = dataset_.seq_length() + 1;
  for (int64_t b = 0; b < batch_size; ++b) dataset_.get(sample_index(consumed_samples + b), out + b * row);
}

void get_batch(const GptWindowDataset& dataset, int64_t consumed_samples, int64_t batch_size, uint64_t seed,
               bool shuffle, int32_t* out) {
  GptSampler sampler(dataset, seed, shuffle);
  sampler.get_batch(consumed_samples, batch_size, out);
}

}  // namespace mt::data
