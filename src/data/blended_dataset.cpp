#include "data/blended_dataset.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/check.h"

namespace mt::data {
namespace {

// Python float(): optional surrounding whitespace, decimal/exponent forms, inf/nan. false if the
// whole string is not a number.
bool parse_python_float(const std::string& s, double* v) {
  const char* b = s.c_str();
  while (std::isspace(static_cast<unsigned char>(*b))) ++b;
  if (*b == '\0') return false;
  char* end = nullptr;
  errno = 0;
  *v = std::strtod(b, &end);
  if (end == b) return false;
  while (std::isspace(static_cast<unsigned char>(*end))) ++end;
  if (*end != '\0') return false;
  // strtod accepts hex floats ("0x1p3"), Python does not.
  return s.find_first_of("xX") == std::string::npos;
}

std::vector<std::string> split_words(const std::vector<std::string>& words) {
  std::vector<std::string> out;
  for (const std::string& w : words) {
    size_t i = 0;
    while (i < w.size()) {
      while (i < w.size() && std::isspace(static_cast<unsigned char>(w[i]))) ++i;
      size_t j = i;
      while (j < w.size() && !std::isspace(static_cast<unsigned char>(w[j]))) ++j;
      if (j > i) out.push_back(w.substr(i, j - i));
      i = j;
    }
  }
  return out;
}

}  // namespace

Blend parse_blend(const std::vector<std::string>& raw) {
  const std::vector<std::string> words = split_words(raw);
  MT_REQUIRE(!words.empty(), "data path: no dataset prefixes given");
  std::vector<bool> numeric(words.size());
  std::vector<double> values(words.size(), 0.0);
  bool any_weight = false;
  for (size_t i = 0; i < words.size(); i += 2) {
    numeric[i] = parse_python_float(words[i], &values[i]);
    any_weight = any_weight || numeric[i];
  }
  Blend b;
  if (!any_weight || words.size() == 1) {
    b.prefixes = words;
    return b;
  }
  MT_REQUIRE(words.size() % 2 == 0,
             "data path: {} entries with weights; expected pairs 'weight prefix weight prefix ...' (the last, '{}', "
             "has no weight or no prefix)",
             words.size(), words.back());
  std::vector<double> weights;
  for (size_t i = 0; i < words.size(); i += 2) {
    MT_REQUIRE(numeric[i],
               "data path: weight '{}' (entry {}) does not parse as a number; expected 'weight prefix weight prefix "
               "...' or only prefixes",
               words[i], i + 1);
    MT_REQUIRE(std::isfinite(values[i]) && values[i] > 0,
               "data path: weight '{}' for '{}' must be a positive finite number", words[i], words[i + 1]);
    weights.push_back(values[i]);
    b.prefixes.push_back(words[i + 1]);
  }
  b.weights = std::move(weights);
  return b;
}

std::vector<double> normalize_weights(const std::vector<double>& w) {
  MT_REQUIRE(!w.empty(), "normalize: no weights");
  // numpy.sum: the reduction starts from w[0] and adds the pairwise sum of w[1:] (numpy's
  // DOUBLE_pairwise_sum: sequential below 8 values, 8 partial sums up to 128, halving above).
  std::function<double(const double*, size_t)> pairwise = [&](const double* a, size_t n) -> double {
    if (n < 8) {
      double s = 0.;
      for (size_t i = 0; i < n; ++i) s += a[i];
      return s;
    }
    if (n <= 128) {
      double r[8];
      for (int k = 0; k < 8; ++k) r[k] = a[k];
      size_t i = 8;
      for (; i < n - n % 8; i += 8) {
        for (int k = 0; k < 8; ++k) r[k] += a[i + k];
      }
      double s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
      for (; i < n; ++i) s += a[i];
      return s;
    }
    size_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise(a, n2) + pairwise(a + n2, n - n2);
  };
  const double sum = w[0] + pairwise(w.data() + 1, w.size() - 1);
  MT_REQUIRE(sum > 0 && std::isfinite(sum), "normalize: weights sum to {}", sum);
  std::vector<double> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = w[i] / sum;
  return out;
}

std::vector<std::array<int64_t, 3>> size_per_split_per_dataset(const std::vector<double>& weights,
                                                                 const std::array<int64_t, 3>& sizes,
                                                                 double surplus) {
  double total = 0;
  for (double w : weights) total += w;
  MT_REQUIRE(std::fabs(total - 1.0) <= 1e-8 + 1e-5, "blend weights are not normalised (sum {})", total);
  std::vector<std::array<int64_t, 3>> out(weights.size());
  for (size_t d = 0; d < weights.size(); ++d) {
    for (int s = 0; s < 3; ++s) {
      MT_REQUIRE(sizes[s] >= 0, "blend with weights needs a sample count for every split (split {} has none)", s);
      out[d][s] = static_cast<int64_t>(
          std::ceil(std::ceil(static_cast<double>(sizes[s]) * weights[d]) * (1.0 + surplus)));
    }
  }
  return out;
}

void build_blending_indices(const std::vector<double>& weights, int64_t size, std::vector<int16_t>* dataset_index,
                            std::vector<int64_t>* dataset_sample_index) {
  const size_t n = weights.size();
  MT_REQUIRE(n >= 1 && n < 32767, "build_blending_indices: {} datasets", n);
  dataset_index->assign(static_cast<size_t>(size), 0);
  dataset_sample_index->assign(static_cast<size_t>(size), 0);
  std::vector<int64_t> current(n, 0);
  for (int64_t k = 0; k < size; ++k) {
    const double kd = std::max(static_cast<double>(k), 1.0);
    size_t best = 0;
    double best_err = weights[0] * kd - static_cast<double>(current[0]);
    for (size_t d = 1; d < n; ++d) {
      const double err = weights[d] * kd - static_cast<double>(current[d]);
      if (err > best_err) {
        best_err = err;
        best = d;
      }
    }
    (*dataset_index)[k] = static_cast<int16_t>(best);
    (*dataset_sample_index)[k] = current[best]++;
  }
}

void build_exhaustive_blending_indices(const std::vector<int64_t>& sizes, std::vector<int16_t>* dataset_index,
                                       std::vector<int64_t>* dataset_sample_index) {
  const size_t n = sizes.size();
  MT_REQUIRE(n >= 1 && n < 32767, "build_exhaustive_blending_indices: {} datasets", n);
  int64_t total = 0;
  for (int64_t s : sizes) {
    MT_REQUIRE(s > 0, "build_exhaustive_blending_indices: dataset size {} must be positive", s);
    total += s;
  }
  std::vector<double> w(n);
  for (size_t d = 0; d < n; ++d) w[d] = static_cast<double>(sizes[d]) / static_cast<double>(total);
  std::vector<int64_t> counts(n, 0);
  std::vector<bool> unspent(n, true);
  size_t num_unspent = n;
  dataset_index->assign(static_cast<size_t>(total), 0);
  dataset_sample_index->assign(static_cast<size_t>(total), 0);
  int64_t k = 0;
  while (num_unspent > 0) {
    const double kd = std::max(static_cast<double>(k), 1.0);
    int64_t best = -1;
    double best_err = std::numeric_limits<double>::lowest();
    for (size_t d = 0; d < n; ++d) {  // std::set<int32_t> iterates in increasing order
      if (!unspent[d]) continue;
      const double err = w[d] * kd - static_cast<double>(counts[d]);
      if (err > best_err) {
        best = static_cast<int64_t>(d);
        best_err = err;
      }
    }
    MT_CHECK(best >= 0, "no dataset left at sample {}", k);
    (*dataset_index)[k] = static_cast<int16_t>(best);
    (*dataset_sample_index)[k] = counts[best]++;
    if (counts[best] == sizes[best]) {
      unspent[best] = false;
      --num_unspent;
    }
    ++k;
  }
}

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const SampleSource>> datasets,
                               std::vector<std::string> description_parts, std::vector<double> weights, int64_t size,
                               Split split, const IndexCacheOptions& cache)
    : datasets_(std::move(datasets)), split_(split) {
  MT_REQUIRE(!datasets_.empty(), "BlendedDataset: no datasets");
  MT_REQUIRE(datasets_.size() == weights.size(), "BlendedDataset: {} datasets but {} weights", datasets_.size(),
             weights.size());
  MT_REQUIRE(datasets_.size() < 32767, "BlendedDataset: {} datasets (at most 32766)", datasets_.size());
  for (size_t d = 0; d < datasets_.size(); ++d) {
    MT_REQUIRE(datasets_[d] != nullptr, "BlendedDataset: dataset {} is missing", d);
    MT_REQUIRE(weights[d] > 0 && std::isfinite(weights[d]), "BlendedDataset: weight {} of dataset {} must be positive",
               weights[d], d);
    MT_REQUIRE(datasets_[d]->sample_tokens() == datasets_[0]->sample_tokens(),
               "BlendedDataset: dataset {} has {} tokens per sample, dataset 0 has {}", d,
               datasets_[d]->sample_tokens(), datasets_[0]->sample_tokens());
  }
  std::vector<int64_t> counts;
  if (size >= 0) {
    weights_ = normalize_weights(weights);
  } else {
    for (double w : weights) {
      MT_REQUIRE(w == std::floor(w), "BlendedDataset: without a size the weights must be sample counts, got {}", w);
      counts.push_back(static_cast<int64_t>(w));
    }
    weights_ = weights;
  }
  nlohmann::ordered_json d;
  d["class"] = "BlendedDataset";
  d["datasets"] = description_parts;
  d["split"] = std::string(split_enum_name(split));
  d["weights"] = weights_;
  d["size"] = size < 0 ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(size);
  description_ = d.dump(4);
  IndexArrays a = load_or_build_index_arrays(cache, description_, fmt::format("BlendedDataset-{}", split_enum_name(split)),
                                             [&] {
                                               std::vector<int16_t> di;
                                               std::vector<int64_t> dsi;
                                               if (size >= 0) {
                                                 build_blending_indices(weights_, size, &di, &dsi);
                                               } else {
                                                 build_exhaustive_blending_indices(counts, &di, &dsi);
                                               }
                                               IndexArrays r;
                                               r.i32.emplace_back(di.begin(), di.end());
                                               r.i64.push_back(std::move(dsi));
                                               return r;
                                             });
  MT_REQUIRE(a.i32.size() == 1 && a.i64.size() == 1 && a.i32[0].size() == a.i64[0].size(),
             "BlendedDataset: malformed cached indices");
  dataset_index_.assign(a.i32[0].begin(), a.i32[0].end());
  dataset_sample_index_ = std::move(a.i64[0]);
  std::vector<int64_t> used(datasets_.size(), 0);
  for (int16_t x : dataset_index_) {
    MT_REQUIRE(x >= 0 && static_cast<size_t>(x) < datasets_.size(), "BlendedDataset: bad cached dataset id {}", x);
    ++used[x];
  }
  for (size_t k = 0; k < datasets_.size(); ++k) {
    MT_REQUIRE(used[k] <= datasets_[k]->size(),
               "The {} blend oversamples the contributing datasets: it requests {} samples from dataset {} ({}) in "
               "excess of its size {} (Megatron's mid_level_dataset_surplus margin is too small for this blend)",
               split_enum_name(split), used[k], k, datasets_[k]->name(), datasets_[k]->size());
  }
}

void BlendedDataset::get(int64_t i, int32_t* out) const {
  MT_REQUIRE(i >= 0 && i < size(), "BlendedDataset({}): sample {} outside [0, {})", split_enum_name(split_), i, size());
  datasets_[dataset_index_[i]]->get(dataset_sample_index_[i], out);
}

std::string BlendedDataset::name() const {
  return fmt::format("BlendedDataset({}, {} datasets, {} samples)", split_enum_name(split_), datasets_.size(), size());
}

}  // namespace mt::data
