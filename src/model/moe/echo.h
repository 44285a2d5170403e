// ECHO, elastic cloning of hot experts (docs/echo.md; Megatron-LM's ECHO offloading planner): every
// EP rank has S spare expert slots; per MoE layer and micro-batch a plan from the global token
// counts (ops/moe_echo.h moe_echo_plan) places clones of the hot experts in spare slots of
// under-loaded EP ranks, the tokens above the average load are rerouted to them, the clones compute
// with their home experts' weights and their weight gradients return to the home experts. Three
// parts here:
//
//   EchoRouter (dispatch side, docs/echo.md "Integration" steps 2-3): the per-expert counts of the
//     ETP × EP grid, the plan and this rank's slots rerouted to the clones, all on the device; used
//     by both alltoall token dispatchers (model/moe/alltoall_dispatcher.h).
//   EchoClones (expert side, steps 4 and 6): the clone slots' weights and gradients (scratch) of
//     the MoE experts (model/moe/experts.h), the home experts' weights fetched into them and the
//     clones' gradients added back to the home experts' main gradients — with the placement on the
//     host (the dropless dispatcher) by the point-to-point transfers below, or with it on the
//     device (--moe-received-token-capacity, capturable) by fixed-size all-to-alls of ep·S expert
//     blocks (ops/moe_echo_exchange.h).
//   The host-placement transfers (EchoPlacement, echo_dispatch_weights, echo_return_gradients).
//
// A plan places a clone of home expert clone_expert[s] in spare slot s (s in [0, ep·S)) on EP rank
// s / S; the expert's home rank is e / L (L = E / ep). A slot is never on its home rank, because a
// rank that spills has no spare capacity. Each expert is a list of W tensors (e.g. linear_fc1,
// linear_fc2: this ETP rank's shards), the same shapes for every expert. The host transfers are
// batched point-to-point sends/receives in one group (NCCL group semantics; messages between one
// pair are matched in slot, then tensor order), and they need the placement on the host.
//
// With expert TP > 1 (docs/echo.md "With expert tensor parallelism") the Q ETP ranks of an EP rank
// hold different tokens, and each computes on the rows of all Q·P sources with its own shard of the
// expert (or clone) weights, so the placement must be the same on the whole grid: the counts are
// all-gathered over EP, then over ETP, into the planner's [Q·P, E] sources (row i·P + j: ETP rank i,
// EP rank j), and every rank reroutes its own slots by its row. The weights and gradients travel
// over this rank's EP group, whose ranks share its ETP rank: a clone slot gets the home expert's
// shard of this ETP rank (fc1 rows, fc2 columns [t·f/etp, (t+1)·f/etp)), and its gradient shard
// returns to the same shard of the home expert.
#pragma once
#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "model/moe/echo_peers.h"
#include "model/moe/token_dispatcher.h"

namespace mt {

class MoeExperts;  // model/moe/experts.h

/// The dispatch side of ECHO, shared by both alltoall dispatchers: the per-expert counts of every
/// rank of the ETP × EP grid, the plan (identical on all of them), this rank's slots rerouted to the
/// clones and mapped to the rank-major virtual expert ids. All on the device.
class EchoRouter {
 public:
  /// num_echo: S spare slots per EP rank (0: ECHO off, nothing is planned).
  EchoRouter(const ExpertParallel& ep, int64_t num_experts, int64_t num_echo);
  /// Scratch for `slots` = T·k routed slots.
  void plan(BufferPlanner& planner, int64_t slots);
  /// top_v (int32 [T, k], overwritten): top (int32 [T, k], experts or −1) rerouted, in virtual
  /// expert ids (moe_echo_virtual_experts); clone_expert int32 [P·S] (overwritten): the plan.
  /// Collective over the EP group and (Q > 1) the ETP group. No host synchronisation.
  void reroute(const Tensor& top_v, const Tensor& clone_expert, const Tensor& top, const Stream& stream) const;

 private:
  ExpertParallel ep_;
  int64_t E_, S_, P_, Q_;
  Tensor row_index_, slot_row_, counts_, counts_ep_, counts_grid_, clone_quota_, quota_, rerouted_;
};

/// The expert side of ECHO: the S clone slots of this rank's experts (local expert slots
/// E_l .. E_l + S − 1), their weights fetched from the home experts per use and their fp32 weight
/// gradients returned to the home experts' main gradients. The clone buffers are scratch shared
/// by the MoE layers: valid from fetch_weights() to the end of the layer's forward or backward.
class EchoClones {
 public:
  /// num_local: E_l; num_echo: S >= 1; device_exchange: the placement stays on the device
  /// (--moe-received-token-capacity, CUDA-graph capturable): the used slots' weights and gradients
  /// are written straight into the EP ranks' memory where the group allows it (EchoPeers,
  /// model/moe/echo_peers.h), else fixed all-to-alls of all P·S blocks.
  EchoClones(const ExpertParallel& ep, int64_t num_local, int64_t num_echo, bool device_exchange);
  /// Scratch: S clones of fc1 [f1, h] and fc2 [h, f2] (act dtype), their fp32 gradients, the
  /// transfer scratch. With the device exchange, whether the used-slot transfers run is decided
  /// here (EchoPeers::available); their buffers, shared by the model's MoE layers, are made by the
  /// first transfer (EchoPeers::create, collective over the EP group).
  void plan(BufferPlanner& planner, int64_t f1, int64_t f2, int64_t h);
  /// The used-slot transfers (nullptr: the host placement, the fixed all-to-alls, or before the
  /// first transfer).
  const EchoPeers* peers() const { return peers_.get(); }
  /// Clone slot j's weights (act dtype) and fp32 gradients: [f1, h], [h, f2].
  Tensor w1(int64_t j) const { return one(w1_, j); }
  Tensor w2(int64_t j) const { return one(w2_, j); }
  Tensor g1(int64_t j) const { return one(g1_, j); }
  Tensor g2(int64_t j) const { return one(g2_, j); }
  /// The home experts' weights into the clone slots of area `slot`'s placement (the dispatcher's
  /// echo_clone_expert() on the device, else its echo_placement() on the host; nothing without
  /// one). Collective over the EP group.
  void fetch_weights(const MoeTokenDispatcher& dispatcher, int slot, MoeExperts& experts, const Stream& stream);
  /// Zeroes the clones' gradients (before the backward's expert GEMMs accumulate into them).
  void zero_grads(const Stream& stream);
  /// The clones' gradients added (+=, slots in ascending order: deterministic) to their home
  /// experts' main gradients, by the placement fetch_weights() used for this slot. Collective over
  /// the EP group.
  void return_grads(const MoeTokenDispatcher& dispatcher, int slot, MoeExperts& experts, const Stream& stream);

 private:
  static Tensor one(const Tensor& t, int64_t j) { return t.slice0(j, j + 1).view({t.size(1), t.size(2)}); }
  struct Exchange {  // scratch of the device exchange
    Tensor w_send, w_recv, g_send, g_acc;   // int32 indices (moe_echo_exchange_index)
    Tensor send1, recv1, send2, recv2;      // [ep·S, f1, h], [ep·S, h, f2] act dtype
    Tensor gsend1, grecv1, gsend2, grecv2;  // the same in fp32
  };

  ExpertParallel ep_;
  int64_t num_local_, num_echo_;
  // the used-slot transfers (shared by the model's MoE layers), set up by the first fetch
  void ensure_peers();

  bool device_exchange_;
  bool use_peers_ = false;
  EchoPeers::Sizes sizes_;
  Device device_{};
  std::shared_ptr<EchoPeers> peers_;
  Tensor w1_, w2_, g1_, g2_;  // [S, f1, h], [S, h, f2]; the gradients fp32 (with peers_, w1_ / w2_ are theirs)
  Tensor ret_;                // fp32 [f1·h + h·f2]: one expert's returned gradients (host placement)
  Exchange x_;
};

// ---- Host-placement transfers (EchoClones with the dropless dispatcher) ----

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
