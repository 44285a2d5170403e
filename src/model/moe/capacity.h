// Token dropping at an expert capacity (--moe-expert-capacity-factor; Megatron-Core
// transformer/moe/moe_utils.py get_capacity and apply_router_token_dropping, called by the
// TopKRouter; docs/moe.md "Token dropping"). After the router each rank keeps at most
// C = ceil(T_l·k/E · factor) of its slots per expert (moe_capacity_drop: by probs or by position,
// --moe-token-drop-policy) and dispatches only those; a dropped slot (expert −1 in the dispatcher's
// selection) adds nothing to its token's output and its probability gets no gradient. The
// load-balancing losses count the routed slots (before the drop, as Megatron's
// compute_routing_scores_for_aux_loss); the logged token counts and the expert-bias counts count
// the kept ones (kept_counts()).
#pragma once
#include <vector>

#include "model/module.h"
#include "model/transformer_config.h"

namespace mt {

class ExpertCapacity {
 public:
  explicit ExpertCapacity(const TransformerConfig& config) : config_(config) {}
  /// Whether tokens are dropped (--moe-expert-capacity-factor given).
  bool on() const { return config_.moe_expert_capacity_set; }
  /// With on(): the capacity C for T = `tokens` tokens, the area's routed selection int32 [T, k]
  /// (saved) and the kept counts fp32 [E] (scratch). Errors: mt::Error from moe_expert_capacity.
  void plan(BufferPlanner& planner, int64_t tokens, int64_t topk, int64_t num_experts);
  /// Where the router writes area `slot`'s selection before the drop (the load-balancing losses'
  /// and the router backward's).
  Tensor routed(int slot) const { return routed_.at(static_cast<size_t>(slot)); }
  /// kept int32 [T, k] (overwritten; the token dispatcher's selection) = routed(slot) with the
  /// slots beyond each expert's capacity set to −1; kept_counts() = the kept slots per expert.
  /// probs fp32 [T, k]: the routing probabilities (the drop policy probs keeps the highest).
  void drop(const Tensor& kept, const Tensor& probs, int slot, const Stream& stream) const;
  /// fp32 [E]: the kept slots per expert of the last drop (this rank's; scratch).
  const Tensor& kept_counts() const { return kept_counts_; }

 private:
  const TransformerConfig& config_;
  int64_t capacity_ = 0;
  std::vector<Tensor> routed_;  // per area
  Tensor kept_counts_;
};

}  // namespace mt
