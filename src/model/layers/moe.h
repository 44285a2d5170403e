// Mixture-of-experts block in the MLP slot (Megatron-Core transformer/moe/moe_layer.py MoELayer with
// TopKRouter, the allgather or alltoall token dispatcher and SequentialMLP experts; Shazeer et al.
// 2017, Fedus et al. 2021 for the load-balancing loss, Zoph et al. 2022 for the z-loss; docs/moe.md).
//
// Forward of the T_l = s_l·b tokens of this rank (x [s_l, b, h], sequence-parallel shard when TP > 1):
//   router:      logits [T_l, E] = x W_rᵀ (fp32, or fp64 with --moe-router-dtype fp64: the GEMM and
//                the routing math in double), top-k selection and probs (fp32; ops/moe.h)
//   dispatch:    the token dispatcher (model/layers/moe_dispatcher.h) brings the rows routed to
//                this rank's experts here, ordered by local expert: all-gather over the dispatch
//                group G (the expert tensor × expert model parallel group; the TP group while
//                EP = 1), or all-to-all over EP (+ all-gather over ETP)
//   experts:     the rows of each local expert through linear_fc1 -> GELU or SwiGLU -> linear_fc2
//                of that expert (its ETP shard)
//   combine:     y[t] = Σ over t's slots of prob · expert output, returned to the token's rank by
//                the dispatcher (reduce-scatter over G, or the reverse all-to-all)
//   shared experts (optional): a dense MLP on x (Megatron's SharedExpertMLP), added to y; with
//                --moe-shared-expert-gate scaled per token by sigmoid(x · w_gate) first (w_gate
//                [1, h], replicated, its gradient a partial sum over TP under sequence parallelism).
// Backward mirrors it: the dispatcher's combine backward (row gradients and d probs), the experts'
// backward, the dispatch backward (token gradients), then the router backward with the
// load-balancing loss and the z-loss added to the logits' gradient.
//
// Token dropping (--moe-expert-capacity-factor, Megatron's apply_router_token_dropping): after the
// router each rank keeps at most ceil(T_l·k/E · factor) of its slots per expert (moe_capacity_drop)
// and dispatches only those; a dropped slot adds nothing to its token's output and its probability
// gets no gradient. The load-balancing losses count the routed slots (before the drop, as
// Megatron's compute_routing_scores_for_aux_loss); the logged token counts and the expert-bias
// counts count the kept ones.
//
// Auxiliary losses (Megatron's TopKRouter): with --moe-router-load-balancing-type aux_loss the
// switch loss coeff·E/(k·N²)·Σ_e P_e·c_e (P_e: this rank's sum of the softmax (or normalised
// sigmoid) scores of expert e, c_e: tokens routed to e summed over the TP × CP group (Megatron's
// tp_cp_group: with context parallelism each CP rank holds other tokens of the same sequences),
// N = s·b the tokens of that group); with --moe-z-loss-coeff the z-loss (coeff/(tp·cp))·mean_t
// logsumexp(logits_t)² over this rank's tokens. Each rank's losses are its share, summing over
// TP × CP to the micro-batch's loss (seq_aux_loss: per sequence, its counts summed over the TP × CP
// group's pieces of it, s the whole sequence); their gradients are weighted by
// MicroBatch::aux_loss_weight (1/(micro-batches·DP), Megatron's MoEAuxLossAutoScaler scale with
// data-parallel averaging) times the loss scale. Their values (weighted the same way) are added
// to a per-layer statistics tensor for the log (MoELayer::stats).
// With --moe-router-load-balancing-type global_aux_loss (Megatron's TopKRouter._apply_global_aux_loss,
// Qiu et al. 2025, arXiv:2501.11873) the switch loss uses the token counts of the global batch so
// far: each training forward sums the TP × CP-summed counts over the data-parallel group too, adds
// them to a per-step accumulator (Megatron's global_tokens_per_expert, ga_steps) and uses their mean
// over the step's forwards so far, c̄_e, with N_g = s·b·DP (the tokens of the micro-batch over the
// TP × CP × DP group, Megatron's tp_dp_cp_group): coeff·E/(k·N_g²)·Σ_e P_e·c̄_e per rank, summing
// over TP × CP × DP to the loss of the
// global micro-batch. Its gradient weight is aux_loss_weight·DP = 1/micro-batches (Megatron's
// 1/(micro-batches·DP) leaves the gradient DP times weaker than aux_loss's, issue NVIDIA/Megatron-LM#3672;
// here N ranks equal one rank running the union of the DP ranks' micro-batches). The accumulator is
// zeroed on the device once per step after the last backward (reset_global_tokens; Megatron's
// reset_global_aux_loss_tracker in finalize_model_grads).
// Several types at once (Megatron's list, e.g. --moe-router-load-balancing-type aux_loss
// seq_aux_loss with --moe-aux-loss-coeff 1e-2 1e-3): each type with its own coefficient computes
// its loss as above from the same scores; the losses (and their gradients) add up, and each is
// logged under its own name.
//
// Buffers: planned for the worst case of the dropless routing, R_max = |G|·T_l·min(k, E_local)
// expert rows per micro-batch (exactly |G|·T_l·k when every expert is local).
//
// Experts: by default (Megatron's SequentialMLP) one linear_forward / linear_backward per local
// expert over its rows, whose counts the dispatcher reads on the host. With --moe-grouped-gemm
// (Megatron's GroupedMLP / TE GroupedLinear) the counts stay on the device and each projection is
// one grouped GEMM over all R_max planned rows (ops/grouped_matmul.h): no host synchronisation in
// the allgather path (CUDA-graph capturable). Rows [R, R_max) beyond the routed ones: the expert
// input's are stale (never read: the GEMMs stop at each group's rows), the grouped forward and
// dgrad write zeros to their outputs' tail, so the activation (GELU / SwiGLU and their backward,
// run over all R_max rows) sees zeros there and gives zeros (no NaN can arise from stale data),
// the weight gradients sum over each group's rows only, and the combine (forward and backward)
// and the dispatch backward address rows through slot_row, which never points past R.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "core/buffer.h"
#include "model/layers/mlp.h"
#include "model/layers/moe_dispatcher.h"
#include "ops/grouped_matmul.h"
#include "ops/moe.h"

namespace mt {

/// Megatron-Core's TopKRouter options from the config.
MoeRouterOptions moe_router_options(const TransformerConfig& config);

class MoELayer final : public MlpSlot {
 public:
  /// prefix "decoder.layers.<layer>.mlp". Declares the router weight [E, h] (replicated; the
  /// gradient is a partial sum over TP under sequence parallelism), for each local expert i
  /// (global index ep_rank·E/ep + i) "experts.local_experts.<global>.linear_fc1.weight" [(2)f_e/etp,
  /// h] and ".linear_fc2.weight" [h, f_e/etp] sharded over the expert TP group like the dense
  /// MLP's (init σ and σ/√(2L)) and flagged expert (reduced over EDP), and the shared experts'
  /// MLP; builds the token dispatcher of --moe-token-dispatcher-type. TP > 1 needs sequence
  /// parallelism (checked by GPTModel: Megatron's requirement for MoE), so that every rank of the
  /// dispatch group holds distinct tokens. Errors: mt::Error when --num-experts is not divisible
  /// by EP or --moe-ffn-hidden-size by ETP, or the groups do not match the sizes.
  MoELayer(const TransformerConfig& config, int64_t layer, const TensorParallelRegion& tp, const ExpertParallel& ep,
           ParamRegistry& registry);
  MoELayer(const MoELayer&) = delete;
  MoELayer& operator=(const MoELayer&) = delete;

  void plan(BufferPlanner& planner, int64_t s, int64_t b) override;
  Tensor input(int area) const override { return saved_.at(static_cast<size_t>(area)).x; }
  /// (no ResidualAdd: fuses_residual() is false)
  Tensor forward(const StepContext& ctx, const ResidualAdd* add = nullptr) override;
  Tensor backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) override;
  const ParamRef& output_bias() const override { return no_bias_; }

  /// The statistics accumulated on the device since the last reset_stats(), copied to the host
  /// (synchronises `stream`): kMoeStatLosses + E values (model/transformer_config.h): the
  /// load-balancing loss of each type at static_cast<int>(type) ([0] aux_loss, [1] seq_aux_loss,
  /// [2] global_aux_loss; 0 for the types that are off), [kMoeStatZLoss] the z-loss, each weighted by
  /// the micro-batch's aux_loss_weight (so the sum over the ranks of the world is the mean over
  /// micro-batches and data-parallel ranks), then [kMoeStatLosses + e] the tokens routed to expert e summed over the training
  /// forwards (counted over the TP × CP group: the sum over the world is TP·CP times the total). Zeros
  /// before the first forward.
  std::vector<double> stats(const Stream& stream) const;
  /// Zeroes the statistics now (ordered on `stream`, outside any step), so that the forwards
  /// never do (a step captured in a CUDA graph replays without a reset inside).
  void reset_stats(const Stream& stream);
  /// The token dispatcher's statistics since reset_stats() (ECHO rerouted slots, the most rows an
  /// EP rank received in one dispatch, the slots overflowed at --moe-received-token-capacity; zeros
  /// for the allgather dispatcher). May synchronise `stream`.
  MoeDispatchStats dispatch_stats(const Stream& stream) const { return dispatcher_->stats(stream); }

  /// Aux-loss-free balancing (--moe-router-enable-expert-bias), once per step after the last
  /// backward (Megatron's finalize_model_grads): sums the step's token counts of the training
  /// forwards over `dp` (the data-parallel group; nullptr = 1 rank; the counts are already summed
  /// over TP × CP: Megatron's tp_dp_cp all-reduce), moves the expert bias by moe_expert_bias_update and restarts the counts. No-op
  /// without the option. Collective over dp.
  void update_expert_bias(Communicator* dp, const Stream& stream);
  /// global_aux_loss: the data-parallel group over which the token counts are summed (nullptr = 1
  /// rank; the counts are already summed over TP × CP). Set by the model before the first forward.
  void set_data_parallel(Communicator* dp) { dp_ = dp; }
  /// Context parallelism: the TP × CP group (Megatron's tp_cp_group) over which the token counts
  /// are summed and whose tokens N counts (each CP rank holds other tokens of the same sequences);
  /// nullptr (CP 1) = the TP group; this rank's CP size and rank (the 2·CP chunk split of the
  /// sequence, for the random logits of --moe-router-force-load-balancing). Set by the model
  /// before the first forward.
  void set_context_parallel(Communicator* tp_cp, int cp_size, int cp_rank) {
    tp_cp_ = tp_cp;
    cp_size_ = cp_size;
    cp_rank_ = cp_rank;
  }
  /// global_aux_loss: zeroes the step's token-count accumulator on the device (ordered on `stream`,
  /// no host synchronisation, so a captured step stays valid); once per step after the last
  /// backward (Megatron's reset_global_aux_loss_tracker). No-op for the other types.
  void reset_global_tokens(const Stream& stream);
  /// The expert bias, fp32 [E] on the model's device, zero-initialised on first use (ordered on
  /// `stream`); empty without the option. Writable: a checkpoint load overwrites it in place.
  Tensor expert_bias(const Stream& stream);
  int64_t layer() const { return layer_; }

 private:
  struct Expert {
    ParamRef fc1, fc2;  // [(2)f_l, h], [h, f_l]
  };
  // An expert slot's weights and fp32 main gradients: local expert e < E_l, or ECHO clone slot
  // e − E_l (the clone buffers, valid after echo_fetch_weights).
  struct ExpertTensors {
    Tensor w1, w2, g1, g2;
  };
  ExpertTensors expert_tensors(int64_t e) const;
  // ECHO: the home experts' weights sent into the clone slots of area `slot`'s placement, and the
  // clones' gradients returned to (added into) the home experts' main gradients. No-ops without ECHO.
  // With --moe-received-token-capacity (capturable) the placement stays on the device: fixed-size
  // all-to-alls of ep·S expert blocks over EP, packed and unpacked by index (ops/moe_echo_exchange.h);
  // else the placement is read on the host and only the used slots travel (moe_echo_experts.h).
  // With expert TP > 1 both run over this rank's EP group, whose ranks share its ETP rank: a clone
  // slot gets the home expert's shard of this ETP rank (fc1 rows, fc2 columns [t·f/etp, (t+1)·f/etp)),
  // and its gradient shard returns to the same shard of the home expert.
  void echo_fetch_weights(int slot, const Stream& st);
  void echo_return_grads(int slot, const Stream& st);
  void build_tables(const Stream& st);  // the GroupedWeights address tables, once
  struct EchoExchange {  // scratch of the capturable ECHO exchange
    Tensor w_send, w_recv, g_send, g_acc;     // int32 indices (moe_echo_exchange_index)
    Tensor send1, recv1, send2, recv2;        // [ep·S, (2)f_l, h], [ep·S, h, f_l] act dtype
    Tensor gsend1, grecv1, gsend2, grecv2;    // the same in fp32
  };
  EchoExchange echo_x_;
  struct Saved {
    Tensor x;                  // [s_l, b, h]: the block's input (router input)
    Tensor logits;             // [T_l, E] in the routing dtype (fp32 or fp64)
    Tensor tokens_per_expert;  // fp32 [1, E]: over the TP × CP group
    Tensor seq_tokens_per_expert;  // fp32 [b, E]: per sequence, over the TP × CP group (seq_aux_loss)
    Tensor global_tokens;      // fp32 [E]: global_aux_loss's mean counts over TP × CP × DP at this forward
    Tensor top_routed;         // int32 [T_l, k]: the router's selection before a capacity drop
    Tensor xp, pre, act, out;  // [R_max, h], [R_max, (2)f_l], [R_max, f_l], [R_max, h]
    std::vector<int64_t> counts_host;  // the forward's rows per local expert (R = their sum)
    Tensor counts;             // the same, int32 [E_l] on the device (--moe-grouped-gemm)
    Tensor shared_out;         // [T_l, h]: the shared experts' output (--moe-shared-expert-gate)
    Tensor gate_logits;        // fp32 [T_l]: x · w_gate (--moe-shared-expert-gate)
  };
  static constexpr MoeLoadBalancing kAuxTypes[] = {MoeLoadBalancing::kAuxLoss, MoeLoadBalancing::kSeqAuxLoss,
                                                   MoeLoadBalancing::kGlobalAuxLoss};
  bool seq_aux() const { return config_.moe_aux_loss_on(MoeLoadBalancing::kSeqAuxLoss); }
  // The token counts of a load-balancing type's loss: [1, E], per sequence [b, E], or the global mean.
  Tensor aux_counts(const Saved& sv, MoeLoadBalancing type) const;
  bool fp64_router() const { return config_.moe_router_dtype == DType::kF64; }
  bool gated_shared() const { return shared_ != nullptr && config_.moe_shared_expert_gate; }
  bool global_aux() const { return config_.moe_aux_loss_on(MoeLoadBalancing::kGlobalAuxLoss); }
  void random_logits(const Tensor& logits, const StepContext& ctx) const;  // --moe-router-force-load-balancing
  float aux_scale(MoeLoadBalancing type, double weight) const;  // of a type's loss, for a micro-batch weight
  float z_scale(double weight) const;
  bool drops() const { return config_.moe_expert_capacity_set; }
  // The router's selection of area `slot` (before a capacity drop; the dispatcher gets the kept slots).
  Tensor router_top(int slot) const;
  // --moe-grouped-gemm: the experts over all R_max rows with the device counts.
  void grouped_forward(Saved& sv, const Stream& st);
  void grouped_backward(Saved& sv, const Stream& st);
  Tensor finish_forward(Saved& sv, const StepContext& ctx);  // the shared experts, then y
  // The router with the auxiliary losses' values and counts (forward), and their backward into
  // the router weight and dx: the moe_router region of per-layer CUDA graphs (model/layer_graphs.h);
  // with moe_preprocess scoped, the moe_preprocess region: the router and the dispatcher's
  // preprocess() (forward), preprocess_backward() and the router's backward (backward) as one graph.
  void router_forward(Saved& sv, const StepContext& ctx);
  void router_region(const StepContext& ctx, bool backward, const std::function<void()>& body);
  static bool preprocess_captured(const StepContext& ctx);  // moe_preprocess is scoped
  // The preprocessing's and the router's backward, then the shared experts' (after the dispatch
  // backward).
  Tensor router_backward(Saved& sv, const Tensor& dy, const StepContext& ctx, WgradDeferral* defer);

  const TransformerConfig& config_;
  const TensorParallelRegion& tp_;
  ExpertParallel ep_;
  int64_t layer_;
  int64_t num_experts_, topk_, num_local_, first_expert_, local_ffn_;
  bool gated_;
  bool recompute_act_;  // --recompute-modules moe_act: sv.act is scratch, recomputed in the backward
  MoeRouterOptions router_;
  ParamRef router_weight_, no_bias_;
  ParamRef gate_weight_;  // the shared experts' gate [1, h] (--moe-shared-expert-gate)
  std::vector<Expert> experts_;
  std::unique_ptr<MLP> shared_;
  std::unique_ptr<MoeTokenDispatcher> dispatcher_;
  std::vector<Saved> saved_;  // per area
  // --moe-grouped-gemm: the local experts' weights and main gradients as address tables on the
  // device, built on the first forward / backward (the ParamStore's addresses are fixed).
  GroupedWeights fc1_w_, fc2_w_, fc1_g_, fc2_g_;
  int64_t tokens_ = 0, max_rows_ = 0;  // T_l, R_max
  int64_t num_echo_ = 0;               // ECHO spare expert slots per EP rank (0: off)
  Tensor echo_w1_, echo_w2_, echo_g1_, echo_g2_, echo_ret_;  // ECHO clone weights / gradients (scratch)
  int64_t capacity_ = 0;               // per expert with --moe-expert-capacity-factor
  // scratch
  Tensor y_, d_out_, d_act_, d_pre_, d_xp_, dx_, d_probs_, d_logits_, d_logits_act_, scores_aux_, kept_counts_;
  Tensor d_shared_, d_gate_;  // --moe-shared-expert-gate
  Buffer stats_buffer_;  // fp32 [2 + E] on the model's device (see stats())
  Tensor stats_;
  bool stats_zeroed_ = false;
  Buffer bias_buffer_;     // fp32 [2, E]: the expert bias, then the step's token counts
  Tensor expert_bias_, bias_counts_;
  bool bias_zeroed_ = false;
  int64_t batch_ = 1;      // b of the planned [s_l, b] token layout
  Communicator* dp_ = nullptr;  // global_aux_loss: the data-parallel group
  Communicator* tp_cp_ = nullptr;  // the TP × CP group with CP > 1 (else the TP group counts)
  int cp_size_ = 1, cp_rank_ = 0;
  int token_group_size() const;  // |TP × CP|: the ranks whose tokens the counts sum
  void sum_token_group(const Tensor& t, const Stream& st) const;  // all-reduce over TP × CP
  Buffer global_buffer_;   // fp32 [E + 1]: global_aux_loss's step accumulator (counts, forwards)
  Tensor global_acc_, global_counts_;  // the accumulator; scratch fp32 [E] (counts summed over DP)
  bool global_zeroed_ = false;
};

}  // namespace mt
