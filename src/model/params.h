// Parameters and gradients in contiguous buffers (DESIGN.md principle 1; Megatron's
// ParamAndGradBuffer): one flat model-dtype parameter buffer, one flat fp32 main-parameter
// buffer (the same memory when the model dtype is fp32) and one flat fp32 gradient buffer.
// Each parameter starts at a multiple of kAlign elements so kernels may vectorise.
#pragma once
#include <string>
#include <unordered_map>
#include <vector>

#include "core/buffer.h"
#include "core/stream.h"
#include "ops/init.h"

namespace mt {

enum class InitKind : uint8_t { kNormal, kZeros, kOnes };

/// One parameter tensor (this rank's shard). name uses Megatron-Core's module names, e.g.
/// "decoder.layers.3.self_attention.linear_qkv.weight".
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;         ///< local shape
  InitKind init = InitKind::kNormal;
  float init_std = 0.02f;
  bool weight_decay = true;           ///< Megatron: no decay for biases and 1-D (norm) params
  std::vector<int64_t> global_shape;  ///< empty = shape (no sharding)
  ShardOffset shard{};
  /// Split over the tensor-parallel group (column/row/vocab-parallel). Otherwise replicated on
  /// every TP rank: counted once in the gradient norm, and with sequence parallelism its
  /// gradient is a partial sum to be all-reduced over TP (sequence_parallel_grad).
  bool tensor_parallel = false;
  /// Replicated parameter whose gradient, under sequence parallelism, each TP rank computes from
  /// its own sequence shard only (norms, biases added after a row-parallel layer).
  bool sequence_parallel_grad = false;
  /// Duplicates a parameter of another pipeline stage (the tied output word embedding on the last
  /// stage): excluded from the gradient norm (counted on the first stage) and from checkpoints
  /// (filled from the parameter of the same name on load).
  bool shared_embedding_copy = false;
};

struct ParamInfo : ParamSpec {
  int64_t offset = 0;  ///< element offset in the flat buffers
  int64_t numel = 0;
};

class ParamStore {
 public:
  static constexpr int64_t kAlign = 64;

  /// Lays out and allocates (uninitialised) buffers on `device`. model_dtype: fp32, bf16 or fp16.
  /// The flat length is padded to a multiple of kAlign * pad_multiple (the data-parallel size,
  /// so the distributed optimizer can shard it evenly).
  ParamStore(std::vector<ParamSpec> specs, DType model_dtype, Device device, int64_t pad_multiple = 1);

  size_t size() const { return infos_.size(); }
  const ParamInfo& info(size_t i) const { return infos_[i]; }
  const std::vector<ParamInfo>& infos() const { return infos_; }
  /// Index of a parameter by name; throws mt::Error naming it when absent.
  size_t index(const std::string& name) const;
  DType model_dtype() const { return model_dtype_; }
  Device device() const { return device_; }
  bool has_separate_main() const { return model_dtype_ != DType::kF32; }

  Tensor param(size_t i) const;  ///< model dtype, local shape
  Tensor main(size_t i) const;   ///< fp32 main parameter (== param when fp32)
  Tensor grad(size_t i) const;   ///< fp32 main gradient
  Tensor param(const std::string& n) const { return param(index(n)); }
  Tensor grad(const std::string& n) const { return grad(index(n)); }
  Tensor params_flat() const;    ///< model dtype [total]
  Tensor main_flat() const;      ///< fp32 [total]
  Tensor grads_flat() const;     ///< fp32 [total]
  int64_t total_elements() const { return total_; }
  int64_t num_parameters() const;  ///< sum of numel (no alignment padding)

  /// Initialises main parameters (layout-invariant Philox init, see ops/init.h) and copies
  /// them into the model-dtype parameters; zeroes the padding and the gradients.
  void initialize(uint64_t seed, const Stream& stream);
  /// Casts main -> model parameters (after loading main parameters).
  void sync_model_from_main(const Stream& stream);
  void zero_grads(const Stream& stream);

  /// Flat element ranges [begin, end) covering the parameters for which pred(info) holds,
  /// consecutive parameters merged into one range (the alignment padding between them, whose
  /// gradients stay zero, included), so an op or collective runs once per range instead of once
  /// per tensor. Computed once by the caller, outside the training step.
  struct Range {
    int64_t begin, end;
  };
  template <typename Pred>
  std::vector<Range> ranges(Pred pred) const {
    std::vector<Range> out;
    for (size_t i = 0; i < infos_.size(); ++i) {
      if (!pred(infos_[i])) continue;
      const int64_t b = infos_[i].offset, e = i + 1 < infos_.size() ? infos_[i + 1].offset : total_;
      if (!out.empty() && out.back().end == b) {
        out.back().end = e;
      } else {
        out.push_back({b, e});
      }
    }
    return out;
  }

 private:
  std::vector<ParamInfo> infos_;
  std::unordered_map<std::string, size_t> by_name_;
  DType model_dtype_;
  Device device_;
  int64_t total_ = 0;
  Buffer params_, main_, grads_;
};

}  // namespace mt
