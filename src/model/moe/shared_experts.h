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
  /// ctx.slot: compute(), then add_output().
  void forward(const Tensor& y, const Tensor& x, const StepContext& ctx);
  /// The shared experts' MLP on x: returns their output ys [s_l, b, h] (a scratch view, valid until
  /// the next MLP forward). With --moe-shared-expert-overlap it runs on a side stream (ctx.stream)
  /// while the dispatcher exchanges; it touches only the MLP's buffers and the TP group.
  Tensor compute(const Tensor& x, const StepContext& ctx);
  /// y += ys, or with the gate y += sigmoid(x · w_gate) · ys per token (on the layer's stream).
  void add_output(const Tensor& y, const Tensor& ys, const Tensor& x, const StepContext& ctx);
  /// dx [s_l, b, h] += the shared branch's input gradient from dy [s_l, b, h]; its weight gradients
  /// accumulate (linear_fc1's may be deferred into `defer`). x: the forward's input.
  /// backward_compute(), then finish_backward().
  void backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const StepContext& ctx, WgradDeferral* defer);
  /// The branch's backward up to its input gradient (side stream with the overlap): the gate's
  /// d ys, d logits and weight gradient, the MLP's backward; returns the MLP's input gradient
  /// (a scratch view).
  Tensor backward_compute(const Tensor& dy, const Tensor& x, const StepContext& ctx, WgradDeferral* defer);
  /// dx += the gate's part (d logits · w_gate), then dx += d_mlp (backward_compute's result): the
  /// additions into dx in backward()'s order (on the layer's stream).
  void finish_backward(const Tensor& dx, const Tensor& d_mlp, const StepContext& ctx);

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
