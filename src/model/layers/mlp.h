// MLP block (Megatron-Core transformer/mlp.py MLP; Shoeybi et al. 2019 §3): linear_fc1
// (ColumnParallelLinear, f/tp columns per rank; 2·f/tp for the gated SwiGLU variant, gate then up)
// -> activation (GELU tanh, or SiLU(gate) ∘ up) -> linear_fc2 (RowParallelLinear). Saved per area:
// the fc1 output before the activation [s, b, (2)f/tp] and, as linear_fc2's input, the activation
// output [s, b, f/tp].
#pragma once
#include <vector>

#include "model/layers/linear.h"
#include "model/transformer_config.h"

namespace mt {

class MLP {
 public:
  /// prefix: "decoder.layers.<layer>.mlp".
  MLP(const TransformerConfig& config, int64_t layer, const TensorParallelRegion& tp, ParamRegistry& registry);
  MLP(const MLP&) = delete;
  MLP& operator=(const MLP&) = delete;

  void plan(BufferPlanner& planner, int64_t s, int64_t b);
  /// Where the pre-MLP layernorm writes the block's input [s_l, b, h] for `area`.
  Tensor input(int area) const { return linear_fc1_.input(area); }
  /// Returns the block's output [s_l, b, h] before linear_fc2's bias (a scratch view).
  Tensor forward(const StepContext& ctx);
  /// From dy [s_l, b, h]: returns dL/d(input) [s_l, b, h] (a scratch view). With `defer`,
  /// linear_fc1's weight gradient is held back there (linear_fc2's is computed at once: its
  /// gathered output gradient is shared with the attention block's linear_proj).
  Tensor backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer);
  const ParamRef& output_bias() const { return linear_fc2_.bias(); }

 private:
  bool gated_;
  int64_t local_ffn_;
  ColumnParallelLinear linear_fc1_;
  RowParallelLinear linear_fc2_;
  std::vector<Tensor> pre_;  // per area: fc1 output before the activation [s, b, (2)f_l]
  Tensor d_pre_;             // gated: scratch [s, b, 2 f_l]
};

}  // namespace mt
