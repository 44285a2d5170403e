// Mixture-of-experts block in the MLP slot (Megatron-Core transformer/moe/moe_layer.py MoELayer;
// docs/moe.md): a thin composition of the parts in model/moe/, each in its own file as
// Megatron-Core keeps them.
//
// Forward of the T_l = s_l·b tokens of this rank (x [s_l, b, h], sequence-parallel shard when TP > 1):
//   router:      TopKRouter (router.h): logits, top-k selection and probs, the capacity drop
//                (capacity.h), the auxiliary losses' values and the token counts
//   dispatch:    the token dispatcher (token_dispatcher.h: allgather, alltoall, with ECHO's
//                rerouting, echo.h) brings the rows routed to this rank's experts here, ordered by
//                local expert: all-gather over the dispatch group G (the expert tensor × expert
//                model parallel group; the TP group while EP = 1), or all-to-all over EP (+
//                all-gather over ETP)
//   experts:     the rows of each local expert (and ECHO clone) through linear_fc1 -> GELU or
//                SwiGLU -> linear_fc2 of that expert's ETP shard (experts.h: SequentialMLP, or
//                GroupedMLP with --moe-grouped-gemm)
//   combine:     y[t] = Σ over t's slots of prob · expert output, returned to the token's rank by
//                the dispatcher (reduce-scatter over G, or the reverse all-to-all)
//   shared experts (optional): SharedExpertMLP (shared_experts.h) on x, added to y.
// Backward mirrors it: the dispatcher's combine backward (row gradients and d probs), the experts'
// backward, the dispatch backward (token gradients), then the router backward with the
// load-balancing loss and the z-loss added to the logits' gradient, then the shared experts'.
//
// Buffers: planned for the worst case of the dropless routing, R_max = |G|·T_l·min(k, E_local)
// expert rows per micro-batch (exactly |G|·T_l·k when every expert is local); with
// --moe-received-token-capacity the dispatcher's fixed blocks.
//
// Communication beside computation (docs/moe.md "Overlapped communication"; the same operations on
// the same data, so bitwise the same results):
//   --moe-shared-expert-overlap: the shared experts' MLP runs on a side stream (MoeShared::shared_stream)
//     from after the dispatcher's preprocessing to the combine (forward), and from the start of the
//     backward to the router's backward; their output and input gradient are added on the layer's
//     stream where the sequential order adds them.
//   --overlap-moe-expert-parallel-comm: the dropless alltoall dispatcher's exchanges run in chunks
//     of local expert slots on the exchange stream (MoeShared::comm_stream), the experts of chunk c on the
//     layer's stream as soon as its rows are in, and its combine as soon as they are computed:
//       exchange stream:  dispatch 0, dispatch 1, ..., combine 0, combine 1, ...
//       layer stream:     (wait d0) experts 0 (wait d1) experts 1 ...  (wait the combines) unpermute
//     The backward likewise (the output gradients in chunks, each chunk's input gradients back as
//     soon as computed); with --delay-wgrad-compute the experts' weight gradients run after every
//     chunk's input gradients, beside the last chunks' exchanges (Megatron's delay_wgrad_compute).
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "model/layers/mlp.h"
#include "model/moe/alltoall_dispatcher.h"
#include "model/moe/experts.h"
#include "model/moe/router.h"
#include "model/moe/shared_experts.h"
#include "model/moe/token_dispatcher.h"

namespace mt {

class MoELayer final : public MlpSlot {
 public:
  /// The chunks of --overlap-moe-expert-parallel-comm's pipeline (fewer with fewer local expert slots).
  static constexpr int64_t kOverlapChunks = 4;

  /// prefix "decoder.layers.<layer>.mlp". Declares the router weight [E, h] (TopKRouter), the local
  /// experts' linear_fc1 / linear_fc2 (MoeExperts) and the shared experts' MLP (SharedExpertMLP);
  /// builds the token dispatcher of --moe-token-dispatcher-type. TP > 1 needs sequence
  /// parallelism (checked by GPTModel: Megatron's requirement for MoE), so that every rank of the
  /// dispatch group holds distinct tokens. Errors: mt::Error when --num-experts is not divisible
  /// by EP or --moe-ffn-hidden-size by ETP, ECHO runs without EP > 1, or the groups do not match
  /// the sizes.
  MoELayer(const TransformerConfig& config, int64_t layer, const TensorParallelRegion& tp, const ExpertParallel& ep,
           ParamRegistry& registry);
  MoELayer(const MoELayer&) = delete;
  MoELayer& operator=(const MoELayer&) = delete;

  void plan(BufferPlanner& planner, int64_t s, int64_t b) override;
  Tensor input(int area) const override { return x_.at(static_cast<size_t>(area)); }
  /// (no ResidualAdd: fuses_residual() is false)
  Tensor forward(const StepContext& ctx, const ResidualAdd* add = nullptr) override;
  Tensor backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) override;
  const ParamRef& output_bias() const override { return no_bias_; }

  /// The statistics accumulated on the device since the last reset_stats(), copied to the host
  /// (synchronises `stream`): kMoeStatLosses + E values (model/transformer_config.h): the
  /// load-balancing loss of each type at static_cast<int>(type) ([0] aux_loss, [1] seq_aux_loss,
  /// [2] global_aux_loss; 0 for the types that are off), [kMoeStatZLoss] the z-loss, each weighted by
  /// the micro-batch's aux_loss_weight (so the sum over the ranks of the world is the mean over
  /// micro-batches and data-parallel ranks), then [kMoeStatLosses + e] the tokens routed to expert e
  /// summed over the training forwards (counted over the TP × CP group: the sum over the world is
  /// TP·CP times the total). Zeros before the first forward.
  std::vector<double> stats(const Stream& stream) const { return router_->stats(stream); }
  /// Zeroes the statistics now (ordered on `stream`, outside any step), so that the forwards
  /// never do (a step captured in a CUDA graph replays without a reset inside).
  void reset_stats(const Stream& stream);
  /// The token dispatcher's statistics since reset_stats() (ECHO rerouted slots, the most rows an
  /// EP rank received in one dispatch, the slots overflowed at --moe-received-token-capacity; zeros
  /// for the allgather dispatcher). May synchronise `stream`.
  MoeDispatchStats dispatch_stats(const Stream& stream) const { return dispatcher_->stats(stream); }
  /// What this layer shares with the model's other MoE layers (side streams, ECHO's transfers).
  const MoeShared& shared_resources() const { return *shared_res_; }

  /// Aux-loss-free balancing (--moe-router-enable-expert-bias), once per step after the last
  /// backward (Megatron's finalize_model_grads): sums the step's token counts of the training
  /// forwards over `dp` (the data-parallel group; nullptr = 1 rank; the counts are already summed
  /// over TP × CP: Megatron's tp_dp_cp all-reduce), moves the expert bias by moe_expert_bias_update
  /// and restarts the counts. No-op without the option. Collective over dp.
  void update_expert_bias(Communicator* dp, const Stream& stream) { router_->update_expert_bias(dp, stream); }
  /// global_aux_loss: the data-parallel group over which the token counts are summed (nullptr = 1
  /// rank; the counts are already summed over TP × CP). Set by the model before the first forward.
  void set_data_parallel(Communicator* dp) { router_->set_data_parallel(dp); }
  /// Context parallelism: the TP × CP group (Megatron's tp_cp_group) over which the token counts
  /// are summed and whose tokens N counts (each CP rank holds other tokens of the same sequences);
  /// nullptr (CP 1) = the TP group; this rank's CP size and rank (the 2·CP chunk split of the
  /// sequence, for the random logits of --moe-router-force-load-balancing). Set by the model
  /// before the first forward.
  void set_context_parallel(Communicator* tp_cp, int cp_size, int cp_rank) {
    router_->set_context_parallel(tp_cp, cp_size, cp_rank);
  }
  /// global_aux_loss: zeroes the step's token-count accumulator on the device (ordered on `stream`,
  /// no host synchronisation, so a captured step stays valid); once per step after the last
  /// backward (Megatron's reset_global_aux_loss_tracker). No-op for the other types.
  void reset_global_tokens(const Stream& stream) { router_->reset_global_tokens(stream); }
  /// The expert bias, fp32 [E] on the model's device, zero-initialised on first use (ordered on
  /// `stream`); empty without the option. Writable: a checkpoint load overwrites it in place.
  Tensor expert_bias(const Stream& stream) { return router_->expert_bias(stream); }
  int64_t layer() const { return layer_; }

 private:
  // The router (forward: with the auxiliary losses' values and counts; backward: into the router
  // weight and dx) runs as the moe_router region of per-layer CUDA graphs (model/layer_graphs.h);
  // with moe_preprocess scoped, the moe_preprocess region holds the router and the dispatcher's
  // preprocess() (forward), preprocess_backward() and the router's backward (backward) as one graph.
  void router_region(const StepContext& ctx, bool backward, const std::function<void()>& body);
  static bool preprocess_captured(const StepContext& ctx);  // moe_preprocess is scoped
  // The preprocessing's and the router's backward, then the shared experts'.
  Tensor router_backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer);
  // --overlap-moe-expert-parallel-comm: the chunked dispatch, experts and combine (forward), and
  // the chunked combine backward, experts' backward and dispatch backward.
  void pipelined_forward(const StepContext& ctx);
  void pipelined_backward(const Tensor& dy, const StepContext& ctx);
  // A StepContext like ctx on another stream.
  static StepContext on_stream(const StepContext& ctx, const Stream& stream);

  // The events of the overlapped schedules (created at plan time).
  struct Events {
    Events(Device device, int64_t chunks);
    Event shared_fork, shared_join, start, end;
    std::vector<std::unique_ptr<Event>> ready, done;  // per chunk: rows in; rows computed
  };

  const TensorParallelRegion& tp_;
  int64_t layer_, hidden_;
  ParamRef no_bias_;
  std::unique_ptr<MoeTokenDispatcher> dispatcher_;
  std::unique_ptr<TopKRouter> router_;
  std::unique_ptr<MoeExperts> experts_;
  std::unique_ptr<SharedExpertMLP> shared_;  // --moe-shared-expert-intermediate-size > 0
  std::shared_ptr<MoeShared> shared_res_;
  bool overlap_shared_ = false;  // --moe-shared-expert-overlap (and a TP group other than the dispatcher's)
  MoEAlltoAllTokenDispatcher* chunked_ = nullptr;  // --overlap-moe-expert-parallel-comm: the dispatcher
  bool delay_wgrad_ = false;     // --delay-wgrad-compute
  const Stream* shared_stream_ = nullptr;
  const Stream* comm_stream_ = nullptr;
  std::unique_ptr<Events> events_;
  Tensor shared_out_, shared_dx_;  // the side stream's results (views of the MLP's scratch)
  std::vector<Tensor> x_;  // per area: the block's input [s_l, b, h] (router input), saved
  Tensor y_, dx_;          // scratch [s_l, b, h]
};

}  // namespace mt
