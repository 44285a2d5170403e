// TopKRouter of the MoE layer (Megatron-Core transformer/moe/router.py; Shazeer et al. 2017, Fedus
// et al. 2021 for the load-balancing loss, Zoph et al. 2022 for the z-loss; docs/moe.md).
//
// Forward of the T_l = s_l·b tokens of this rank (x [T_l, h], the sequence-parallel shard when
// TP > 1): logits [T_l, E] = x W_rᵀ (fp32, or fp64 with --moe-router-dtype fp64: the GEMM and the
// routing math in double; with --moe-router-force-load-balancing standard normal values instead),
// top-k selection and probs (fp32; ops/moe.h: softmax or sigmoid scores, expert groups, the expert
// bias in the selection), written into the token dispatcher's top / probs. With
// --moe-expert-capacity-factor the selection goes through the capacity drop first (ExpertCapacity,
// model/moe/capacity.h).
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
// to a per-layer statistics tensor for the log (stats()).
// With --moe-router-load-balancing-type global_aux_loss (Megatron's TopKRouter._apply_global_aux_loss,
// Qiu et al. 2025, arXiv:2501.11873) the switch loss uses the token counts of the global batch so
// far: each training forward sums the TP × CP-summed counts over the data-parallel group too, adds
// them to a per-step accumulator (Megatron's global_tokens_per_expert, ga_steps) and uses their mean
// over the step's forwards so far, c̄_e, with N_g = s·b·DP (the tokens of the micro-batch over the
// TP × CP × DP group, Megatron's tp_dp_cp_group): coeff·E/(k·N_g²)·Σ_e P_e·c̄_e per rank, summing
// over TP × CP × DP to the loss of the global micro-batch. Its gradient weight is
// aux_loss_weight·DP = 1/micro-batches (Megatron's 1/(micro-batches·DP) leaves the gradient DP times
// weaker than aux_loss's, issue NVIDIA/Megatron-LM#3672; here N ranks equal one rank running the
// union of the DP ranks' micro-batches). The accumulator is zeroed on the device once per step
// after the last backward (reset_global_tokens; Megatron's reset_global_aux_loss_tracker in
// finalize_model_grads).
// Several types at once (Megatron's list, e.g. --moe-router-load-balancing-type aux_loss
// seq_aux_loss with --moe-aux-loss-coeff 1e-2 1e-3): each type with its own coefficient computes
// its loss as above from the same scores; the losses (and their gradients) add up, and each is
// logged under its own name.
//
// Backward: the probs' gradient (from the dispatcher's combine backward) back to the logits, plus
// the load-balancing losses' and the z-loss's gradients, then dW_r += d_logitsᵀ x and dx += d_logits
// W_r.
#pragma once
#include <string>
#include <vector>

#include "core/buffer.h"
#include "model/module.h"
#include "model/moe/capacity.h"
#include "model/transformer_config.h"
#include "ops/moe.h"
#include "parallel/mappings.h"

namespace mt {

/// Megatron-Core's TopKRouter options from the config.
MoeRouterOptions moe_router_options(const TransformerConfig& config);

class TopKRouter {
 public:
  /// prefix "decoder.layers.<layer>.mlp.": declares "router.weight" [E, h] (replicated; the
  /// gradient is a partial sum over TP under sequence parallelism).
  TopKRouter(const TransformerConfig& config, int64_t layer, const TensorParallelRegion& tp, const std::string& prefix,
             ParamRegistry& registry);
  TopKRouter(const TopKRouter&) = delete;
  TopKRouter& operator=(const TopKRouter&) = delete;

  /// Plans the open area's saved tensors (logits, token counts) and the scratch for T = `tokens`
  /// tokens in the [s_l, b] layout of `batch` sequences.
  void plan(BufferPlanner& planner, int64_t tokens, int64_t batch);
  /// Routes x [T, h] (act dtype) of area ctx.slot: writes the selection into top int32 [T, k] and
  /// the probs into probs fp32 [T, k] (the token dispatcher's; with a capacity the kept slots, the
  /// dropped ones −1), and in a training forward adds the auxiliary losses' values and the kept
  /// token counts to the statistics (and the expert-bias and global_aux_loss counts). A recomputed
  /// forward (ctx.recompute) counts nothing again. No host synchronisation.
  void forward(const Tensor& x, const Tensor& top, const Tensor& probs, const StepContext& ctx);
  /// fp32 [T, k]: where the token dispatcher's combine_backward writes the probs' gradient.
  const Tensor& d_probs() const { return d_probs_; }
  /// Backward of forward() for area ctx.slot from d_probs(): dx [T, h] += the input gradient
  /// (probs, load-balancing losses, z-loss), the router weight's main gradient +=. x: the forward's
  /// input; top: the selection forward() wrote.
  void backward(const Tensor& dx, const Tensor& x, const Tensor& top, const StepContext& ctx);

  /// MoELayer::stats: kMoeStatLosses + E values accumulated since reset_stats(), copied to the host
  /// (synchronises `stream`; zeros before the first forward).
  std::vector<double> stats(const Stream& stream) const;
  /// Zeroes the statistics (ordered on `stream`, outside any step).
  void reset_stats(const Stream& stream);
  /// MoELayer::update_expert_bias (collective over dp; no-op without the option).
  void update_expert_bias(Communicator* dp, const Stream& stream);
  /// global_aux_loss: the data-parallel group over which the token counts are summed (nullptr = 1).
  void set_data_parallel(Communicator* dp) { dp_ = dp; }
  /// The TP × CP group (nullptr with CP 1: the TP group) and this rank's CP size and rank.
  void set_context_parallel(Communicator* tp_cp, int cp_size, int cp_rank);
  /// global_aux_loss: zeroes the step's token-count accumulator on the device (no-op otherwise).
  void reset_global_tokens(const Stream& stream);
  /// The expert bias, fp32 [E], zero-initialised on first use; empty without the option.
  Tensor expert_bias(const Stream& stream);

 private:
  struct Saved {
    Tensor logits;             // [T_l, E] in the routing dtype (fp32 or fp64)
    Tensor tokens_per_expert;  // fp32 [1, E]: over the TP × CP group
    Tensor seq_tokens_per_expert;  // fp32 [b, E]: per sequence, over the TP × CP group (seq_aux_loss)
    Tensor global_tokens;      // fp32 [E]: global_aux_loss's mean counts over TP × CP × DP at this forward
  };
  static constexpr MoeLoadBalancing kAuxTypes[] = {MoeLoadBalancing::kAuxLoss, MoeLoadBalancing::kSeqAuxLoss,
                                                   MoeLoadBalancing::kGlobalAuxLoss};
  bool seq_aux() const { return config_.moe_aux_loss_on(MoeLoadBalancing::kSeqAuxLoss); }
  bool global_aux() const { return config_.moe_aux_loss_on(MoeLoadBalancing::kGlobalAuxLoss); }
  bool fp64() const { return config_.moe_router_dtype == DType::kF64; }
  // The token counts of a load-balancing type's loss: [1, E], per sequence [b, E], or the global mean.
  Tensor aux_counts(const Saved& sv, MoeLoadBalancing type) const;
  float aux_scale(MoeLoadBalancing type, double weight) const;  // of a type's loss, for a micro-batch weight
  float z_scale(double weight) const;
  void random_logits(const Tensor& logits, const StepContext& ctx) const;  // --moe-router-force-load-balancing
  // A training forward's token counts (of the routed selection, over TP × CP; with global_aux_loss
  // over DP and into the step's accumulator) and, unless recomputed, its loss values and the kept
  // counts into the statistics and the expert-bias counts.
  void record_training_forward(Saved& sv, const Tensor& routed, const StepContext& ctx);
  int token_group_size() const;  // |TP × CP|: the ranks whose tokens the counts sum
  void sum_token_group(const Tensor& t, const Stream& st) const;  // all-reduce over TP × CP

  const TransformerConfig& config_;
  const TensorParallelRegion& tp_;
  int64_t layer_, num_experts_, topk_;
  MoeRouterOptions options_;
  ParamRef weight_;
  ExpertCapacity capacity_;
  std::vector<Saved> saved_;  // per area
  int64_t tokens_ = 0, batch_ = 1;  // T_l, and b of the planned [s_l, b] token layout
  // scratch
  Tensor d_probs_, d_logits_, d_logits_act_, scores_aux_;
  Buffer stats_buffer_;  // fp32 [kMoeStatLosses + E] on the model's device (see stats())
  Tensor stats_;
  bool stats_zeroed_ = false;
  Buffer bias_buffer_;  // fp32 [2, E]: the expert bias, then the step's token counts
  Tensor expert_bias_, bias_counts_;
  bool bias_zeroed_ = false;
  Communicator* dp_ = nullptr;     // global_aux_loss: the data-parallel group
  Communicator* tp_cp_ = nullptr;  // the TP × CP group with CP > 1 (else the TP group counts)
  int cp_size_ = 1, cp_rank_ = 0;
  Buffer global_buffer_;  // fp32 [E + 1]: global_aux_loss's step accumulator (counts, forwards)
  Tensor global_acc_, global_counts_;  // the accumulator; scratch fp32 [E] (counts summed over DP)
  bool global_zeroed_ = false;
};

}  // namespace mt
