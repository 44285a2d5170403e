// The contract every model part (submodule) follows (docs/architecture.md principle 7,
// "Modules"). A module
//   * declares its parameters at construction (ParamRegistry::declare: name, local shape, init,
//     tensor-parallel sharding) and reads them through ParamRefs bound once the ParamStore exists,
//   * declares its buffers in plan(BufferPlanner&): tensors saved from forward to backward (one
//     copy per activation slot) and scratch shared with other modules,
//   * has an explicit forward and backward; weight gradients accumulate (+=) into the fp32 main
//     gradients, activation gradients overwrite (=) unless a function says otherwise,
//   * communicates for tensor/sequence parallelism only through parallel/mappings.h.
// Nothing is allocated during a step: every tensor a module touches comes from the planner.
#pragma once
#include <map>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "core/rng.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "model/params.h"
#include "ops/matmul.h"

namespace mt {

class InferenceContext;  // model/inference_context.h
class Fp8Model;          // model/fp8/fp8_model.h

/// One micro-batch on the model's device. tokens, labels: int32 [s, b]; loss_mask: fp32 [s, b]
/// or empty (all ones); position_ids: int32 [s, b] or empty (0..s-1, --reset-position-ids fills
/// it); doc_start: int32 [b, s] or empty (plain causal; --reset-attention-mask: query i attends
/// to keys doc_start[b, i] .. i). loss_weight: weight of one unmasked token's loss in the
/// iteration's loss (1 / (unmasked tokens of the micro-batch · micro-batches · DP), Megatron's
/// per-micro-batch mean averaged over micro-batches and DP ranks).
/// aux_loss_weight: weight of the micro-batch's auxiliary losses (MoE load balancing, z-loss) in
/// the iteration's loss: 1 / (micro-batches · DP), Megatron's MoEAuxLossAutoScaler scale
/// (1 / num_microbatches) with the data-parallel gradient averaging.
struct MicroBatch {
  Tensor tokens, labels, loss_mask;
  Tensor position_ids, doc_start;
  float loss_weight = 1.f;
  float aux_loss_weight = 1.f;
  /// Multi-token prediction (--mtp-num-layers D > 0; training forwards of the loss chunk, model/
  /// layers/multi_token_prediction.h): [D, s, b] with depth k = 1..D at index k − 1: the tokens and
  /// labels rolled k positions left along s with zeros shifted in (Megatron's roll_tensor) int32,
  /// and the loss weights fp32 (make_mtp_inputs: loss_mask rolled likewise, times unmasked / unmasked
  /// after the roll).
  Tensor mtp_tokens, mtp_labels, mtp_loss_mask;
  /// Inference (generation) only: the key/value cache the self-attention layers append to and
  /// attend over, and the position of the first token (model/inference_context.h); nullptr in
  /// training and plain evaluation.
  const InferenceContext* inference = nullptr;
};

/// Where in training a forward/backward runs; keys the dropout masks (docs/architecture.md principle 4).
struct DropoutContext {
  uint64_t seed = 0;
  uint64_t iteration = 0;
  uint32_t microbatch = 0;
  bool training = true;  ///< false: no dropout (evaluation, generation)
  /// When set: `iteration` is read from here (fp64-sized uint64 on the model's device) when the
  /// kernels run (StepValues, train/train_step.h; needed by CUDA graph replay).
  const uint64_t* iteration_ptr = nullptr;
  /// When set: `microbatch` is read from here (uint32 on the model's device) when the kernels
  /// run: the activation slot's key, written before the micro-batch's forward (per-layer CUDA
  /// graphs replay one graph for every micro-batch that uses the slot).
  const uint32_t* microbatch_ptr = nullptr;
  /// Context parallelism: set by the model (GPTModel) for the element-wise dropout of its
  /// [s/N, b, h] activations (DropoutKey::cp_global); 1 / 0 / 0 without CP.
  int32_t cp_size = 1;
  int32_t cp_rank = 0;
  int64_t cp_chunk_elems = 0;  ///< s/(2N)·b·h
};

/// Dropout sites: the Philox stream id of a site is (layer + 1) · 8 + site (layer −1: embedding).
enum DropoutSite : uint32_t { kSiteAttentionProbs = 0, kSiteAttentionOut = 1, kSiteMlpOut = 2, kSiteEmbedding = 3 };
inline DropoutKey dropout_key(const DropoutContext& dc, int64_t layer, DropoutSite site) {
  DropoutKey k{dc.seed,           dc.iteration, dc.microbatch, static_cast<uint32_t>((layer + 1) * 8 + site),
               dc.iteration_ptr, dc.microbatch_ptr};
  k.cp_chunk_elems = dc.cp_chunk_elems;
  k.cp_size = dc.cp_size;
  k.cp_rank = dc.cp_rank;
  return k;
}

/// What a module's forward/backward reads besides its tensors.
class LayerGraphs;  // model/layer_graphs.h

struct StepContext {
  const MicroBatch& batch;
  const DropoutContext& dropout;
  int slot;  ///< the area (activation slot or head slot) holding the module's saved tensors
  const Stream& stream;
  Tensor loss_scale = Tensor();  ///< backward: fp32 [1] loss scale (mixed precision) or empty = 1
  /// Per-layer CUDA graphs (--cuda-graph-impl local with layer scopes), or nullptr: the
  /// TransformerLayer runs its scoped regions through them.
  LayerGraphs* graphs = nullptr;
  /// Activation recompute (--recompute-granularity full): this forward re-runs, before its
  /// backward, a forward already run for the same micro-batch. Modules must compute the same
  /// tensors and must not count step statistics again (the MoE router's loss values and token
  /// counts, the dispatchers' counters).
  bool recompute = false;
};

/// A declared parameter: its index in the model's ParamStore once bound (ParamRegistry::bind).
struct ParamRef {
  size_t index = ParamStore::kNoParam;
  ParamStore* store = nullptr;
  bool bound() const { return store != nullptr && index != ParamStore::kNoParam; }
  Tensor value() const { return store->param(index); }  ///< model dtype
  Tensor grad() const { return store->grad(index); }    ///< fp32 main gradient
  /// The gradient's address without binding a staging slot (ParamStore::grad_view).
  Tensor grad_view() const { return store->grad_view(index); }
  /// Whether this write of the gradient is the step's first to a grad_overwrite parameter
  /// (ParamStore::take_first_grad_write, consumed by this call): write it, else add to it.
  GradWrite grad_write() const {
    return store->take_first_grad_write(index) ? GradWrite::kOverwrite : GradWrite::kAccumulate;
  }
};

/// Collects the parameter declarations of a model's modules in order, grouped (a layer, the
/// embedding, the head); within a group declared with sort_by_sharding, the order is stable-sorted
/// so that tensor-parallel matrices come first, then tensor-parallel vectors, then replicated
/// parameters, then expert parameters (few contiguous runs for the optimizer, one range of
/// replicated parameters per layer for the sequence-parallel gradient all-reduce, and the MoE
/// experts in gradient buckets of their own). ParamStore indices follow that order.
class ParamRegistry {
 public:
  /// Starts a group; parameters declared until the next begin_group belong to it.
  void begin_group(bool sort_by_sharding);
  /// Declares a parameter; `ref` (owned by the module, which must not move afterwards) receives
  /// its index at bind(). Errors: mt::Error on a duplicate name.
  void declare(ParamSpec spec, ParamRef* ref);
  /// The specs in ParamStore order.
  std::vector<ParamSpec> specs() const;
  /// Parameter index range [first, end) of group k (in begin_group order).
  std::pair<size_t, size_t> group_range(size_t k) const;
  size_t num_groups() const { return groups_.size(); }
  /// Fills every declared ParamRef from the store built from specs().
  void bind(ParamStore& store);
  /// Until clear_rename(): a name declared with the prefix `from` gets the prefix `to` instead (the
  /// MTP layers are TransformerLayers, which name their parameters decoder.layers.<L>.*; Megatron
  /// names them mtp.layers.<k>.transformer_layer.*).
  void set_rename(std::string from, std::string to) { rename_ = {std::move(from), std::move(to)}; }
  void clear_rename() { rename_ = {}; }
  /// Parameters declared from now on belong to model chunk `c` (ParamSpec::model_chunk).
  void set_model_chunk(int c) { chunk_ = c; }
  /// FP8 training (--fp8-format): the model-wide FP8 state the linear layers register an
  /// Fp8Linear with (model/fp8/fp8_model.h); nullptr when FP8 is off.
  void set_fp8(Fp8Model* fp8) { fp8_ = fp8; }
  Fp8Model* fp8() const { return fp8_; }

 private:
  struct Entry {
    ParamSpec spec;
    ParamRef* ref;
  };
  struct Group {
    std::vector<Entry> entries;
    bool sort = false;
  };
  std::vector<Group> ordered() const;
  std::vector<Group> groups_;
  std::unordered_set<std::string> names_;  // every declared name (duplicates found in O(1))
  std::pair<std::string, std::string> rename_;  // set_rename: (from, to); from empty = none
  Fp8Model* fp8_ = nullptr;
  int chunk_ = 0;  // set_model_chunk
};

/// Static buffer planning (docs/architecture.md principle 1). The model calls its modules' plan() twice: a
/// measuring pass (tensors come back with null data) and, after materialize(), a placing pass that
/// must make the same requests. Three kinds of memory:
///   * areas: a family of interchangeable regions, e.g. the activation slots (one forward's saved
///     tensors each) or the loss head's slots. The model opens area (family, index) and the
///     modules planned inside it request saved tensors; each region of a family is as large as the
///     largest set of requests made in any of its openings (different chunks may fill a slot
///     differently), and requests restart at the region's start on every opening.
///   * scratch: temporaries of one forward/backward call, shared by every module asking for the
///     same key (the largest request wins); valid only until the next use of that key, and never
///     beyond the call that wrote it. Keys requested only inside loss-head areas (kHead) and keys
///     requested only inside layer areas (kActivations, kRecompute) share memory: the model runs
///     the head and a transformer layer in separate calls, one after the other in stream order, so
///     the loss head's logits chunks reuse the layers' temporaries. Keys requested in both kinds of
///     area or outside any area (the model's running residual gradient, the embedding's) get their
///     own memory.
///   * persistent: live as long as the model (pipeline input buffers).
class BufferPlanner {
 public:
  /// kRecompute: the saved tensors of the layers of one full-recompute group (one region, shared
  /// by every group and micro-batch: a group's tensors live from its re-run forward to its backward).
  enum class Family { kActivations, kHead, kRecompute };
  /// act: the activation dtype modules plan their tensors in.
  BufferPlanner(Device device, DType act);
  Device device() const { return device_; }
  DType act_dtype() const { return act_; }
  bool placing() const { return placing_; }

  // --- for the model ---
  /// Starts a pass (measure first, then place after materialize()).
  void begin_pass();
  /// Requests until the next open_area go to region `index` of `family`.
  void open_area(Family family, int index);
  void close_area();
  /// After the measuring pass: allocates one buffer for everything.
  void materialize();
  size_t bytes() const { return total_; }
  /// Bytes of one region of a family, of all scratch, of persistent tensors (after measuring).
  size_t area_bytes(Family f) const;
  int area_count(Family f) const;
  size_t scratch_bytes() const;
  size_t persistent_bytes() const { return persistent_; }

  // --- for modules ---
  /// Index of the open area (the `slot` of the StepContext the module will run with).
  int area() const;
  /// A tensor saved from forward to backward, in the open area.
  Tensor saved(DType dtype, const std::vector<int64_t>& shape, const char* what);
  /// A temporary shared under `key`.
  Tensor scratch(const std::string& key, DType dtype, const std::vector<int64_t>& shape);
  /// A tensor that lives as long as the model.
  Tensor persistent(DType dtype, const std::vector<int64_t>& shape, const char* what);

 private:
  struct FamilyState {
    size_t region = 0;  // bytes of one region (max over openings)
    int count = 0;      // regions (max index + 1)
    size_t base = 0;    // offset of region 0 (placing)
  };
  static size_t aligned(size_t n) { return (n + 255) / 256 * 256; }
  Tensor at(size_t offset, DType dtype, const std::vector<int64_t>& shape) const;
  Device device_;
  DType act_;
  bool placing_ = false;
  Buffer buffer_;
  size_t total_ = 0;
  FamilyState families_[3];
  bool area_open_ = false;
  Family open_family_ = Family::kActivations;
  int open_index_ = 0;
  size_t cursor_ = 0;        // within the open region
  size_t persistent_ = 0;    // measured size; placing cursor below
  size_t persistent_cursor_ = 0;
  /// Which areas asked for a scratch key: the head's, the layers', or both / none (shared).
  enum class ScratchPhase { kLayers = 0, kHead = 1, kShared = 2 };
  ScratchPhase current_phase() const;
  /// Bytes of all scratch, laid out from `base`: the shared keys, then the layers' and the head's
  /// keys from one offset. Fills *offsets (key -> byte offset) when given.
  size_t scratch_layout(size_t base, std::map<std::string, size_t>* offsets) const;
  std::map<std::string, size_t> scratch_size_, scratch_offset_;
  std::map<std::string, ScratchPhase> scratch_phase_;
};

/// Weight-gradient GEMMs held back by a backward (see GPTModel::backward_chunk): the arguments
/// of linear_backward without dx. Their inputs must stay intact until run().
class WgradDeferral {
 public:
  void clear() { list_.clear(); }
  /// dw_write: taken from the weight when its backward ran (ParamRef::grad_write); nothing else
  /// writes dw until run().
  void add(const Tensor& dw, const Tensor& dbias, const Tensor& dy, const Tensor& x, const Tensor& w,
           GradWrite dw_write) {
    list_.push_back({dw, dbias, dy, x, w, dw_write});
  }
  /// Runs the held-back GEMMs in order and clears the list.
  void run(const Stream& stream);

 private:
  struct Item {
    Tensor dw, dbias, dy, x, w;
    GradWrite dw_write;
  };
  std::vector<Item> list_;  // capacity kept across steps: no per-step allocation after the first
};

/// [..., n] viewed as rows [numel / n, n].
inline Tensor rows(const Tensor& t) { return t.view({t.numel() / t.size(-1), t.size(-1)}); }

}  // namespace mt
