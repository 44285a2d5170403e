#include "model/layer_graphs.h"

#include <tuple>

#include "core/check.h"

namespace mt {

LayerGraphs::LayerGraphs(bool attention, bool mlp, bool moe, bool moe_router, bool moe_preprocess)
    : on_{attention, mlp, moe, moe_router, moe_preprocess} {
  MT_REQUIRE(!moe_preprocess || moe_router,
             "--cuda-graph-scope moe_preprocess needs moe_router as well (the preprocessing is captured with the "
             "router, as in Megatron-Core)");
}

bool LayerGraphs::Key::operator<(const Key& o) const {
  return std::tie(layer, region, backward, training, slot, inputs) <
         std::tie(o.layer, o.region, o.backward, o.training, o.slot, o.inputs);
}

void LayerGraphs::run(int64_t layer, Region region, bool backward, bool training, int slot, const Inputs& inputs,
                      const Stream& stream, const std::function<void()>& body) {
  if (!capturing_ || !scoped(region) || !stream.device().is_cuda() || in_capture_) {
    body();
    return;
  }
  const Key key{layer, static_cast<int>(region), backward ? 1 : 0, training ? 1 : 0, slot, inputs};
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    auto g = std::make_unique<CudaGraph>();
    const uint64_t allocs = buffer_allocation_count(), syncs = host_sync_count();
    in_capture_ = true;
    try {
      g->capture(stream, body);
    } catch (...) {
      in_capture_ = false;
      throw;
    }
    in_capture_ = false;
    MT_CHECK(buffer_allocation_count() == allocs && host_sync_count() == syncs,
             "the captured region of layer {} allocated ({}) or synchronised ({})", layer,
             buffer_allocation_count() - allocs, host_sync_count() - syncs);
    it = graphs_.emplace(key, std::move(g)).first;
  }
  it->second->launch(stream);
}

size_t LayerGraphs::nodes() const {
  size_t n = 0;
  for (const auto& [k, g] : graphs_) n += g->num_nodes();
  return n;
}

}  // namespace mt
