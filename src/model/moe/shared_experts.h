// Shared experts of the MoE layer (Megatron-Core transformer/moe/shared_experts.py SharedExpertMLP):
// a dense tensor-parallel MLP (--moe-shared-expert-intermediate-size) on the layer's input x
// [s_l, b, h], its output added to the routed experts' combined output y. With
// --moe-shared-expert-gate (Megatron's moe_shared_expert_gate, Qwen 2 MoE's shared_expert_gate) the
// output is first scaled per token by sigmoid(x · w_gate), w_gate [1, h] replicated over TP (its
// gradient a partial sum over TP under sequence parallelism); the shared output [T, h] and the gate
// logits [T] are kept for the backward (ops/moe.h moe_shared_gate_forward / _backward).
#pragma once
#include <string>
#include <vector>

#include "model/layers/mlp.h"

namespace mt {

class SharedExpertMLP {
 public:
  /// prefix "decoder.layers.<layer>.mlp.": declares the MLP "shared_experts.linear_fc{1,2}.*" and,
  /// gated, "shared_experts.gate_weight" [1, h].
  SharedExpertMLP(const TransformerConfig& config, const std::string& prefix, const TensorParallelRegion& tp,
                  ParamRegistry& registry);
  SharedExpertMLP(const SharedExpertMLP&) = delete;
  SharedExpertMLP& operator=(const SharedExpertMLP&) = delete;

  void plan(BufferPlanner& planner, int64_t s, int64_t b);
  /// y [s_l, b, h] += the shared experts' output for x [s_l, b, h] (the layer's saved input), area
  /// ctx.slot.
  void forward(const Tensor& y, const Tensor& x, const StepContext& ctx);
  /// dx [s_l, b, h] += the shared branch's input gradient from dy [s_l, b, h]; its weight gradients
  /// accumulate (linear_fc1's may be deferred into `defer`). x: the forward's input.
  void backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const StepContext& ctx, WgradDeferral* defer);

 private:
  struct Saved {
    Tensor shared_out;   // [T_l, h]: the shared experts' output (gated)
    Tensor gate_logits;  // fp32 [T_l]: x · w_gate (gated)
  };
  bool gated() const { return config_.moe_shared_expert_gate; }

  const TransformerConfig& config_;
  const TensorParallelRegion& tp_;
  MLP mlp_;
  ParamRef gate_weight_;  // [1, h] (gated)
  std::vector<Saved> saved_;  // per area
  Tensor d_shared_, d_gate_;  // scratch (gated)
};

}  // namespace mt
