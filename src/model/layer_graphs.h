// Per-layer (partial) CUDA graphs: --cuda-graph-impl local with --cuda-graph-scope attn / mlp / moe /
// moe_router / moe_preprocess (Megatron-Core's per-layer capture, transformer/cuda_graphs.py and TE
// make_graphed_callables; docs/cuda_graphs.md "Per-layer capture").
//
// A scoped region of a TransformerLayer (the attention block: input norm, self-attention,
// bias-dropout-add; the MLP or MoE block likewise; the MoE router with its auxiliary losses, for
// MoE blocks whose dispatch reads counts on the host; with moe_preprocess the router together with
// the token dispatcher's preprocessing, up to its first host read: MoeTokenDispatcher::preprocess)
// is captured once per activation slot for its
// forward and once for its backward, and replayed for every micro-batch that uses the slot. The
// model's activation slots are the static buffer sets: a slot is free for a later forward once its
// backward ran (plan_pipeline walks the schedule), so the number of graphs grows with the
// schedule's in-flight bound, not with the number of micro-batches. A region reads everything that
// changes between its replays from device memory: the iteration (StepValues) and the micro-batch
// of its slot (the executor writes it before the micro-batch's forward) key the dropout. What it
// reads by address outside the slot (the layer input of a chunk's first layer, the pipeline
// gradient buffer, the micro-batch's position ids and document starts) is part of the graph's key:
// another address gets (and keeps) a graph of its own. Graphs have no memory pool of their own:
// they replay on the model's static buffers.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>

#include "core/cuda_graph.h"
#include "core/stream.h"

namespace mt {

class LayerGraphs {
 public:
  /// kMoePreprocess: the MoE router and the dispatcher's preprocessing as one graph (it replaces
  /// kMoeRouter for a layer when moe_preprocess is scoped; MoELayer picks the region).
  enum class Region { kAttention = 0, kMlp = 1, kMoe = 2, kMoeRouter = 3, kMoePreprocess = 4 };
  static constexpr int kRegions = 5;
  /// The address-valued inputs a region reads besides its slot (nullptr where unused).
  using Inputs = std::array<const void*, 5>;

  /// Regions to capture (--cuda-graph-scope attn / mlp / moe / moe_router / moe_preprocess). A
  /// region inside one being captured (the router inside the MoE block) runs as part of the outer
  /// graph. Errors: mt::Error when moe_preprocess is given without moe_router (Megatron-Core's rule:
  /// the preprocessing extends the router's graph).
  LayerGraphs(bool attention, bool mlp, bool moe, bool moe_router, bool moe_preprocess = false);
  bool scoped(Region r) const { return on_[static_cast<int>(r)]; }
  /// Captures may start (after the warm-up steps: first-use initialisation must not be captured).
  void set_capturing(bool on) { capturing_ = on; }
  bool capturing() const { return capturing_; }

  /// Runs `body` (the region's work on `stream`) eagerly on a CPU stream, before set_capturing,
  /// or when the region is not scoped; otherwise launches the graph of (layer, region, backward,
  /// training, slot, inputs), capturing it first when new. Errors: mt::Error from the capture
  /// (core/cuda_graph.h), or when the region synchronised with the host or allocated.
  void run(int64_t layer, Region region, bool backward, bool training, int slot, const Inputs& inputs,
           const Stream& stream, const std::function<void()>& body);

  size_t graphs() const { return graphs_.size(); }
  size_t nodes() const;  ///< summed over the graphs

 private:
  struct Key {
    int64_t layer;
    int region, backward, training, slot;
    Inputs inputs;
    bool operator<(const Key& o) const;
  };
  bool on_[kRegions];
  bool capturing_ = false;
  bool in_capture_ = false;  // a region's capture is running (nested regions join it)
  std::map<Key, std::unique_ptr<CudaGraph>> graphs_;
};

}  // namespace mt
