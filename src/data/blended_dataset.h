// Megatron-Core's BlendedDataset (megatron/core/datasets/blended_dataset.py, helpers.cpp
// build_blending_indices / build_exhaustive_blending_indices) and the blend parsing and per-dataset
// sample counts of megatron/core/datasets/utils.py (get_blend_from_list, normalize) and
// blended_megatron_dataset_builder.py (_get_size_per_split_per_dataset).
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/index_cache.h"
#include "data/sample_source.h"

namespace mt::data {

/// A --data-path style blend: prefixes and optional weights (not normalised).
struct Blend {
  std::vector<std::string> prefixes;
  std::optional<std::vector<double>> weights;
};

/// Parses "--data-path" words (get_blend_from_list): "w1 p1 w2 p2 ..." (weighted) or "p1 p2 ..."
/// (weights inferred from dataset lengths). A single string containing spaces is split on
/// whitespace first. Errors (mt::Error), stricter than Megatron where it would silently misread:
/// no entries; an even-position entry that parses as a number while others do not ("weight 'x' does
/// not parse"); an odd number of entries where weights are present; a weight that is negative, zero,
/// NaN or infinite.
Blend parse_blend(const std::vector<std::string>& words);

/// utils.normalize: w / sum(w) in float64. Error: an empty list or a non-positive sum.
std::vector<double> normalize_weights(const std::vector<double>& weights);

/// _get_size_per_split_per_dataset: result[d][s] = ceil(ceil(size[s] * w[d]) * (1 + surplus)), all in
/// float64 (Megatron's mid_level_dataset_surplus defaults to 0.005). A size < 0 (None) is an error.
std::vector<std::array<int64_t, 3>> size_per_split_per_dataset(const std::vector<double>& normalized_weights,
                                                                 const std::array<int64_t, 3>& sizes,
                                                                 double surplus = 0.0);

/// helpers.cpp build_blending_indices: for sample k, the dataset d maximising
/// w[d] * max(k, 1) - count[d] (first on ties) is chosen; dataset_sample_index[k] = count[d]++.
void build_blending_indices(const std::vector<double>& weights, int64_t size, std::vector<int16_t>* dataset_index,
                            std::vector<int64_t>* dataset_sample_index);
/// helpers.cpp build_exhaustive_blending_indices: exactly sizes[d] samples from each dataset, in the
/// same greedy order over the datasets not yet exhausted.
void build_exhaustive_blending_indices(const std::vector<int64_t>& sizes, std::vector<int16_t>* dataset_index,
                                       std::vector<int64_t>* dataset_sample_index);

/// BlendedDataset: sample k = datasets[dataset_index[k]].get(dataset_sample_index[k]).
class BlendedDataset final : public SampleSource {
 public:
  /// weights: positive; with size >= 0 they are normalised and build_blending_indices draws `size`
  /// samples; with size < 0 (None) they must be integers (sample counts) and the exhaustive order is
  /// used. Errors: no datasets, count mismatch, more than 32766 datasets, non-positive weights,
  /// datasets with different sample_tokens(), a dataset asked for more samples than it has (Megatron's
  /// "blend oversamples" error). `description_parts` are the datasets' cache descriptions (for the
  /// cache key); `split` names the split.
  BlendedDataset(std::vector<std::shared_ptr<const SampleSource>> datasets, std::vector<std::string> description_parts,
                 std::vector<double> weights, int64_t size, Split split, const IndexCacheOptions& cache);

  int64_t size() const override { return static_cast<int64_t>(dataset_index_.size()); }
  int64_t sample_tokens() const override { return datasets_[0]->sample_tokens(); }
  void get(int64_t i, int32_t* out) const override;
  std::string name() const override;

  const std::vector<int16_t>& dataset_index() const { return dataset_index_; }
  const std::vector<int64_t>& dataset_sample_index() const { return dataset_sample_index_; }
  const std::vector<double>& weights() const { return weights_; }
  const std::string& description() const { return description_; }

 private:
  std::vector<std::shared_ptr<const SampleSource>> datasets_;
  std::vector<double> weights_;
  Split split_;
  std::string description_;
  std::vector<int16_t> dataset_index_;
  std::vector<int64_t> dataset_sample_index_;
};

}  // namespace mt::data
