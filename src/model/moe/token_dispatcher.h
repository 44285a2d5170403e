// Token dispatchers of the MoE layer (Megatron-Core transformer/moe/token_dispatcher.py): how the
// tokens a rank routes reach the experts that other ranks hold, and how the experts' outputs come
// back. One interface, MoeTokenDispatcher, and its implementations, picked by
// --moe-token-dispatcher-type (make_moe_token_dispatcher):
//
//   allgather: MoEAllGatherTokenDispatcher (model/moe/allgather_dispatcher.h), all-gather and
//     reduce-scatter over the dispatch group;
//   alltoall:  MoEAlltoAllTokenDispatcher (model/moe/alltoall_dispatcher.h), all_to_allv over EP
//     with host split sizes, or with --moe-received-token-capacity MoEStaticAlltoAllTokenDispatcher,
//     fixed blocks and nothing read on the host; both with ECHO's rerouting (model/moe/echo.h).
//
// The MoE layer (model/moe/moe_layer.h) runs the router into top(slot) / probs(slot), calls
// preprocess() (Megatron's dispatcher preprocess / dispatch_preprocess: the routing metadata on the
// device, no host read), then dispatch() (the host read of the counts, where there is one, then
// the token exchange), runs its local experts (model/moe/experts.h) on rows [0, R) of the
// expert-input buffer (ordered by local expert), then combine(); backward: combine_backward(), the
// experts' backward, dispatch_backward(), preprocess_backward(). The router and preprocess()
// (forward) and preprocess_backward() and the router's backward are the moe_preprocess region of
// per-layer CUDA graphs (model/layer_graphs.h). Like Megatron with moe_preprocess in the scope, the
// device-to-host point is always after the preprocessing, before the token exchange (one host
// synchronisation per dispatch for the alltoall dispatcher, plus ECHO's placement read).
// With --moe-grouped-gemm the counts stay on the device (MoeExpertCounts::device) and the layer
// passes the whole planned [R_max, h] buffers: the allgather path then has no host read at all.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/stream.h"
#include "model/module.h"
#include "model/transformer_config.h"

namespace mt {

struct EchoPlacement;  // model/moe/echo.h

class EchoPeers;  // model/moe/echo_peers.h

/// What the MoE layers of one model share, created on first use (at plan time, never inside a
/// step): the side streams (--moe-shared-expert-overlap: the shared experts'; --overlap-moe-expert-
/// parallel-comm: the exchanges') — a CUDA stream carries its own cuBLASLt handle and 33 MiB of
/// workspace (core/cuda_resources.h) — and ECHO's used-slot transfer buffers (EchoClones creates
/// them). On the CPU a stream runs its work inline, so the overlapped schedules run in their issue
/// order there.
class MoeShared {
 public:
  /// The shared experts' stream on `device` (created on the first call).
  const Stream& shared_stream(Device device);
  /// The exchanges' stream on `device` (created on the first call; high priority, as the context-
  /// parallel ring's: its NCCL kernels start as soon as an SM frees, beside the experts' GEMMs).
  const Stream& comm_stream(Device device);
  /// ECHO's used-slot transfers (model/moe/echo_peers.h) for every MoE layer: null until the first
  /// layer's first transfer creates them.
  std::shared_ptr<EchoPeers> echo_peers;

 private:
  std::unique_ptr<Stream> shared_, comm_;
};

/// This rank's place in the expert grid (MoE parallel folding, arXiv:2504.14960): expert
/// parallelism splits the experts (EP rank r holds experts [r·E/ep, (r+1)·E/ep)), expert tensor
/// parallelism splits each expert's MLP like the dense one. `dispatch` is the expert tensor ×
/// expert model parallel group (Megatron's expert_tensor_and_model_parallel_group, etp·ep ranks)
/// over which the allgather dispatcher gathers tokens; `ep_group` (ep ranks, rank = ep_rank) and
/// `etp_group` (etp ranks, rank = etp_rank) are the ones the alltoall dispatcher exchanges over.
/// nullptr groups count as groups of one rank; all nullptr for a layout-only model (parameter specs).
struct ExpertParallel {
  int ep_size = 1, ep_rank = 0, etp_size = 1, etp_rank = 0;
  std::shared_ptr<Communicator> dispatch;
  std::shared_ptr<Communicator> ep_group, etp_group;
  /// What the MoE layers share (side streams, ECHO's transfer buffers), shared by the copies of
  /// this value (every MoE layer of a model).
  std::shared_ptr<MoeShared> shared = std::make_shared<MoeShared>();
};

/// The static sizes a dispatcher is built for.
struct MoeDispatchSizes {
  int64_t num_experts = 0;   ///< E
  int64_t topk = 0;          ///< k
  int64_t num_local = 0;     ///< E_l = E / ep
  int64_t first_expert = 0;  ///< ep_rank · E_l
  /// The layer reads the expert row counts on the device (--moe-grouped-gemm): dispatch() returns
  /// them in MoeExpertCounts::device. The allgather dispatcher then reads nothing on the host (its
  /// dispatch() does not synchronise: moe_routing_map_device); the alltoall one still needs the
  /// host counts for its all_to_allv split sizes and copies them to the device as well.
  bool device_counts = false;
  /// ECHO (--moe-enable-echo, alltoall only; docs/echo.md): S spare expert slots per EP rank (0 =
  /// off). dispatch() then plans the clones from the per-expert counts of every EP rank (with expert
  /// TP > 1 the selections of its ETP ranks together: the same plan on the whole ETP × EP grid),
  /// reroutes this rank's slots (ops/moe_echo.h) and sends the rerouted ones to the clones' ranks:
  /// every rank has E_l + S local expert slots, the last S of them clones (echo_placement()), which
  /// compute with this ETP rank's shard of their home expert.
  int64_t num_echo = 0;
  /// --moe-received-token-capacity (alltoall, needs device_counts): C rows received per EP rank
  /// and micro-batch, as fixed blocks of ceil(C / ep) rows per EP pair (constant all-to-all sizes,
  /// nothing read on the host: CUDA-graph capturable); the slots beyond a block are dropped and
  /// counted (MoeDispatchStats::overflowed). 0 = off (the host-synchronised dropless dispatch).
  int64_t received_capacity = 0;
  /// --moe-expert-capacity-factor (0 = dropless): the router keeps at most C = moe_expert_capacity(T,
  /// k, E, factor) slots per expert on every source rank (moe/capacity.h), so a rank receives at
  /// most C rows per local expert slot from each source: the dispatchers bound their expert rows
  /// (plan()'s R_max) by sources · local slots · C where that is below the dropless bound.
  double capacity_factor = 0;
  /// --overlap-moe-expert-parallel-comm (the dropless alltoall dispatcher): the local expert slots
  /// are exchanged in this many chunks (MoEAlltoAllTokenDispatcher::chunk), so that the experts of
  /// one chunk compute while the next chunk's rows travel; 1 = one exchange.
  int64_t chunks = 1;
  /// --moe-permute-fusion (the dropless alltoall dispatcher): permutation 2 fused into the
  /// exchanges: every (source rank, local expert) piece travels straight to its row of the expert
  /// input, and back from the expert output, instead of through a staging buffer and
  /// moe_sort_chunks' copies.
  bool permute_fusion = false;
};

/// Host-side dispatch statistics since the last reset (alltoall dispatcher; the allgather one
/// reports zeros): from the exchanged counts, so identical on every rank of an EP group.
struct MoeDispatchStats {
  int64_t rerouted = 0;      ///< slots sent to ECHO clones instead of their home experts (sum over micro-batches)
  int64_t max_received = 0;  ///< the most expert rows any EP rank received in one dispatch
  int64_t dispatches = 0;    ///< dispatch() calls counted
  /// --moe-received-token-capacity: slots dropped because their EP pair's block was full, summed
  /// over the dispatches of this rank (read from the device; rerouted / max_received stay 0 there)
  int64_t overflowed = 0;
  /// ECHO with the used-slot transfers (EchoPeers, model/moe/echo_peers.h): the bytes of clone
  /// weights and gradients this rank wrote into the EP ranks' memory (read from the device)
  int64_t echo_bytes = 0;
};

/// The rows of each local expert slot brought by one dispatch() (R = their sum, rows [0, R) of the
/// expert-input buffer, ordered by local expert slot: the E_l local experts, then with ECHO the S
/// clones).
struct MoeExpertCounts {
  /// int32 [E_l (+ S)] on the model's device, valid in stream order: always for the allgather
  /// dispatcher, for the alltoall one with MoeDispatchSizes::device_counts; else empty.
  Tensor device;
  /// The same on the host (E_l (+ S) entries); empty when the dispatcher read nothing on the host
  /// (allgather with device_counts).
  std::vector<int64_t> host;
};

class MoeTokenDispatcher {
 public:
  virtual ~MoeTokenDispatcher() = default;
  /// Plans the saved tensors of the open area (the routing, index maps) and the scratch for T
  /// tokens of width h in dtype `act`. Returns R_max, the most expert rows one micro-batch can
  /// bring to this rank (dropless worst case |G|·T·min(k, E_l) for both dispatchers; min(k, E_l + S) with ECHO).
  virtual int64_t plan(BufferPlanner& planner, int64_t tokens, int64_t hidden) = 0;
  /// Where the router writes the selection of area `slot`'s micro-batch: int32 [T, k] and fp32 [T, k].
  virtual Tensor top(int slot) const = 0;
  virtual Tensor probs(int slot) const = 0;
  /// Dispatch preprocessing of x [T, h] (act dtype) with the routing in top(slot) / probs(slot):
  /// the routing metadata of area `slot` (see the file comment per dispatcher) computed on the
  /// device. Never reads anything on the host and allocates nothing (CUDA-graph capturable); every
  /// value it leaves for dispatch() lives in the slot's saved tensors or the dispatcher's static
  /// scratch. Collective over the dispatcher's groups (small fixed-size all-gathers). Must be
  /// followed by dispatch() of the same slot before the next preprocess() (they share scratch).
  virtual void preprocess(const Tensor& x, int slot, const Stream& stream) = 0;
  /// Forward dispatch of x [T, h] after preprocess(): writes the local experts' input rows into
  /// rows [0, R) of xp [R_max, h], ordered by local expert (rows [R, R_max) are left untouched),
  /// and returns the rows of each local expert (MoeExpertCounts). Collective over the
  /// dispatcher's groups. Synchronises `stream` once to read the counts on the host (the expert
  /// GEMM shapes, the all_to_allv split sizes; with host ECHO a second time for the placement),
  /// except the allgather dispatcher built with device_counts and the static alltoall one, which
  /// never do. Errors: mt::Error when the exchanged counts are inconsistent or exceed R_max.
  virtual MoeExpertCounts dispatch(const Tensor& xp, const Tensor& x, int slot, const Stream& stream) = 0;
  /// y [T, h] (overwritten) = for each token the prob-weighted sum of its experts' outputs, from
  /// out [≥ R, h], the local experts' output rows in dispatch() order (rows beyond R not read;
  /// without host counts the layer passes all R_max rows).
  virtual void combine(const Tensor& y, const Tensor& out, int slot, const Stream& stream) = 0;
  /// Backward of combine from dy [T, h]: d_out [≥ R, h] (rows [0, R) overwritten, the others
  /// untouched), the gradient of the local experts' output rows, and d_probs fp32 [T, k]
  /// (overwritten), the gradient of this rank's probs. out: the forward's expert output rows where
  /// combine_backward_reads_output(), else an empty tensor (the MoE layer passes none).
  virtual void combine_backward(const Tensor& d_out, const Tensor& d_probs, const Tensor& dy, const Tensor& out,
                                int slot, const Stream& stream) = 0;
  /// Whether combine_backward() reads `out`, the forward's expert output rows (the probs' gradient
  /// from them): the experts then keep them until the backward (saved per activation slot); else
  /// they are a temporary of the forward (scratch shared by the layers). The alltoall dispatchers
  /// take the probs' gradient from the rows returned to this rank instead.
  virtual bool combine_backward_reads_output() const { return true; }
  /// Backward of dispatch from d_xp [≥ R, h], the gradient of the expert input rows (rows beyond R
  /// not read): the allgather dispatcher writes dx [T, h] (overwritten); the alltoall ones return
  /// the rows to this rank's send layout (scratch) and leave dx to preprocess_backward().
  virtual void dispatch_backward(const Tensor& dx, const Tensor& d_xp, int slot, const Stream& stream) = 0;
  /// Backward of preprocess (after dispatch_backward of the same slot): completes dx [T, h]
  /// (alltoall: overwritten by permutation 1's backward; allgather: nothing to do). No host read.
  virtual void preprocess_backward(const Tensor& dx, int slot, const Stream& stream) = 0;
  /// With ECHO: the clone placement of area `slot`'s last dispatch() (which home expert each spare
  /// slot of the EP group holds; this rank's clones are its local expert slots E_l .. E_l + S − 1,
  /// in slot order). nullptr without ECHO.
  virtual const EchoPlacement* echo_placement(int slot) const {
    (void)slot;
    return nullptr;
  }
  /// With ECHO: the plan's clone placement of area `slot` on the device (int32 [ep·S], the
  /// capturable path; valid in stream order after dispatch()); empty without ECHO.
  virtual Tensor echo_clone_expert(int slot) const {
    (void)slot;
    return Tensor();
  }
  /// The statistics since reset_stats(); may synchronise `stream` (a device counter).
  virtual MoeDispatchStats stats(const Stream& stream) const {
    (void)stream;
    return {};
  }
  /// Restarts the statistics (ordered on `stream`, outside any step).
  virtual void reset_stats(const Stream& stream) { (void)stream; }
  /// Whether the next dispatches count in the statistics (off for a recomputed forward,
  /// StepContext::recompute: the first forward counted them).
  void count_stats(bool on) { counting_ = on; }

 protected:
  bool counting_ = true;
};

/// What a moe_preprocess graph holds beyond the router for the dispatcher of `kind` with `sizes`
/// (received_capacity, num_echo): a short description for the graph summary log line.
std::string moe_preprocess_region(MoeDispatcher kind, const MoeDispatchSizes& sizes);

/// The dispatcher of `kind` for this rank. Errors: mt::Error when the groups do not match the sizes
/// (dispatch group != etp·ep ranks, ep/etp group sizes != ep/etp).
std::unique_ptr<MoeTokenDispatcher> make_moe_token_dispatcher(MoeDispatcher kind, const ExpertParallel& ep,
                                                              const MoeDispatchSizes& sizes);

}  // namespace mt
