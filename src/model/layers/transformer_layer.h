// One decoder layer (Megatron-Core transformer/transformer_layer.py TransformerLayer), pre-norm:
//   resid1 = x + dropout(self_attention(input_layernorm(x)) + b_proj)     (self_attn_bda)
//   out    = resid1 + dropout(mlp(pre_mlp_layernorm(resid1)) + b_fc2)     (mlp_bda)
// x, resid1, out: [s_l, b, h] (s_l = s/tp with sequence parallelism). Saved per activation area:
// resid1 and out (the next layer's input), plus what the submodules save. With
// --recompute-modules layernorm the norms' outputs are not saved: the backward runs each norm's
// forward again from x / resid1 (the same kernels on the same inputs: the same values). The submodules are
// chosen by the LayerSpec (model/specs.h). Dropout keys: model/module.h (sites of layer `layer`).
#pragma once
#include <memory>
#include <vector>

#include "model/layer_graphs.h"
#include "model/layers/attention.h"
#include "model/layers/mlp.h"
#include "model/layers/norm.h"
#include "model/moe/moe_layer.h"

namespace mt {

class TransformerLayer {
 public:
  /// layer: global layer number (0-based; parameter names decoder.layers.<layer>.*). Declares its
  /// parameters as one registry group sorted by sharding.
  /// ep: the expert-parallel layout for an MoE layer (model/moe/token_dispatcher.h ExpertParallel).
  TransformerLayer(const TransformerConfig& config, const LayerSpec& spec, int64_t layer,
                   const TensorParallelRegion& tp, const ExpertParallel& ep, ParamRegistry& registry);
  TransformerLayer(const TransformerLayer&) = delete;
  TransformerLayer& operator=(const TransformerLayer&) = delete;

  int64_t number() const { return layer_; }
  /// Registry group index of this layer's parameters.
  size_t param_group() const { return group_; }
  void plan(BufferPlanner& planner, int64_t s, int64_t b);
  /// The layer's output [s_l, b, h] saved in `area` (valid after forward).
  Tensor output(int area) const { return saved_.at(static_cast<size_t>(area)).out; }
  /// Returns the layer's output [s_l, b, h] (saved in the area ctx.slot) for input x.
  Tensor forward(const Tensor& x, const StepContext& ctx);
  /// d_resid [s_l, b, h]: on entry dL/d(out), on exit dL/dx (the forward's input x is needed).
  /// Weight gradients accumulate; with `defer`, those of linear_fc1, linear_proj and linear_qkv are
  /// held back there (their inputs stay intact until the end of the backward).
  void backward(const Tensor& x, const Tensor& d_resid, const StepContext& ctx, WgradDeferral* defer = nullptr);
  /// The MoE block of this layer, or nullptr for a dense MLP.
  MoELayer* moe() const { return dynamic_cast<MoELayer*>(mlp_.get()); }
  /// The per-layer CUDA graph region of the MLP slot (moe for an MoE block, else mlp).
  LayerGraphs::Region mlp_region() const { return moe() ? LayerGraphs::Region::kMoe : LayerGraphs::Region::kMlp; }

 private:
  struct Saved {
    Tensor resid1, out;  // [s_l, b, h]
  };
  const TransformerConfig& config_;
  const TensorParallelRegion& tp_;
  int64_t layer_;
  size_t group_;
  std::unique_ptr<Norm> input_layernorm_;
  std::unique_ptr<AttentionSlot> self_attention_;  // SelfAttention or MLASelfAttention
  std::unique_ptr<Norm> pre_mlp_layernorm_;
  std::unique_ptr<MlpSlot> mlp_;  // MLP or MoELayer (LayerSpec::mlp)
  std::vector<Saved> saved_;
  Tensor branch_grad_;  // scratch [s_l, b, h]: dL/d(branch output) from bias-dropout-add
  int64_t seq_local_ = 0, batch_ = 0;
};

}  // namespace mt
