// ECHO expert dispatch (docs/echo.md, "Integration", steps 4 and 6): the home experts' weights sent
// to the EP ranks holding their clones, and the clones' weight gradients sent back and added to the
// home experts' main gradients. Standalone functions over the EP group's Communicator, not yet
// used by MoELayer.
//
// A plan (ops/moe_echo.h moe_echo_plan) places a clone of home expert clone_expert[s] in spare
// slot s (s in [0, ep·S)) on EP rank s / S; the expert's home rank is e / L (L = E / ep). A slot is
// never on its home rank, because a rank that spills has no spare capacity. Each expert is a list
// of W tensors (e.g. linear_fc1, linear_fc2: this ETP rank's shards), the same shapes for every
// expert. Transfers are batched point-to-point sends/receives in one group (NCCL group semantics;
// messages between one pair are matched in slot, then tensor order), and they need the placement
// on the host.
#pragma once
#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace mt {

/// The clone→home mapping of a plan, on the host.
struct EchoPlacement {
  int64_t num_experts = 0;            ///< E
  int64_t ep = 0;                     ///< EP ranks
  int64_t num_echo = 0;               ///< S, spare slots per EP rank
  std::vector<int64_t> clone_expert;  ///< [ep·S] home expert of each spare slot, −1 = unused

  int64_t local_experts() const { return num_experts / ep; }
  int64_t clone_rank(int64_t s) const { return s / num_echo; }
  int64_t home_rank(int64_t s) const { return clone_expert[static_cast<size_t>(s)] / local_experts(); }
  bool used(int64_t s) const { return clone_expert[static_cast<size_t>(s)] >= 0; }
  /// Checks the sizes (E % ep == 0, ep·S slots) and every used slot (expert in [0, E), not on its
  /// home rank). Errors: mt::Error naming the slot and values.
  void validate() const;
};

/// Reads moe_echo_plan's clone_expert (int32 [ep·S], any device) to the host: copies, synchronises
/// the stream (hence the name) and validates.
EchoPlacement echo_placement_sync(const Tensor& clone_expert, int64_t num_experts, int64_t ep, const Stream& stream);

/// Weight dispatch: for every used slot s, the home rank sends its local expert
/// clone_expert[s] mod L (local[·][w], w < W) and the clone rank receives it into
/// clones[s mod S][w]. local: [L][W] this rank's experts; clones: [S][W] this rank's static clone
/// buffers (same shapes and dtypes as the experts' tensors; unused slots are not written).
/// Collective over ep_group (size ep, rank = this EP rank). Errors: mt::Error on list sizes, shapes
/// or dtypes that differ between an expert and its clone buffer, or a group size other than ep.
void echo_dispatch_weights(Communicator& ep_group, const EchoPlacement& placement,
                           const std::vector<std::vector<Tensor>>& local,
                           const std::vector<std::vector<Tensor>>& clones, const Stream& stream);

/// Gradient return: for every used slot s, the clone rank sends clone_grads[s mod S][w] and the
/// home rank adds it to main_grads[clone_expert[s] mod L][w] (+=, fp32), the slots in ascending
/// order, so the sum is deterministic. clone_grads: [S][W] fp32; main_grads: [L][W] fp32 (the
/// home experts' main gradients, before the expert-data-parallel reduction); scratch: a contiguous
/// fp32 tensor of at least Σ_w numel(w) elements (one expert's gradients). The incoming gradients
/// of a home rank are received in rounds of as many experts as scratch holds. Collective over
/// ep_group. Errors: mt::Error on sizes, dtypes, or scratch too small for one expert.
void echo_return_gradients(Communicator& ep_group, const EchoPlacement& placement,
                           const std::vector<std::vector<Tensor>>& clone_grads,
                           const std::vector<std::vector<Tensor>>& main_grads, const Tensor& scratch,
                           const Stream& stream);

}  // namespace mt
