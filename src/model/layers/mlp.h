// MLP block (Megatron-Core transformer/mlp.py MLP; Shoeybi et al. 2019 §3): linear_fc1
// (ColumnParallelLinear, f/tp columns per rank; 2·f/tp for the gated SwiGLU variant, gate then up)
// -> activation (GELU tanh, or SiLU(gate) ∘ up: the config's MlpActivationKind, model/variants.h)
// -> linear_fc2 (RowParallelLinear). Saved per area:
// the fc1 output before the activation [s, b, (2)f/tp] and, as linear_fc2's input, the activation
// output [s, b, f/tp] (with FP8 its quantised transpose instead). Selective recompute
// (--recompute-modules) drops some of them: Recompute. Under delayed-scaling FP8 with SwiGLU the
// activation writes fc2's FP8 input, and its backward fc1's FP8 output gradient (docs/fp8.md
// "Fused quantisation").
#pragma once
#include <vector>

#include "model/layers/linear.h"
#include "model/transformer_config.h"

namespace mt {

/// What fills the MLP slot of a TransformerLayer (model/specs.h MlpKind): the dense MLP or the
/// MoE layer (model/moe/moe_layer.h). Input and output are the layer's [s_l, b, h] activations.
class MlpSlot {
 public:
  virtual ~MlpSlot() = default;
  virtual void plan(BufferPlanner& planner, int64_t s, int64_t b) = 0;
  /// Where the pre-MLP layernorm writes the block's input [s_l, b, h] for `area`.
  virtual Tensor input(int area) const = 0;
  /// Whether the input is not saved (--recompute-modules layernorm): before backward the
  /// pre-MLP layernorm must write input() again and restore_input() must run.
  virtual bool recomputes_input() const { return false; }
  virtual void restore_input(const StepContext&) {}
  /// The linear whose FP8 input the pre-MLP layernorm writes in its own pass in a forward of
  /// `rows` (= s·b) rows (ColumnParallelLinear::fuses_fp8_input; docs/fp8.md "Fused
  /// quantisation"), or nullptr (the MoE layer: its router reads the input too).
  virtual ColumnParallelLinear* fp8_input_linear(int64_t /*rows*/) { return nullptr; }
  /// Returns the block's output [s_l, b, h] before its output bias (a scratch view). With `add`
  /// (only when fuses_residual()): returns add->out = add->residual + (output + bias) instead.
  virtual Tensor forward(const StepContext& ctx, const ResidualAdd* add = nullptr) = 0;
  /// Whether forward takes a ResidualAdd.
  virtual bool fuses_residual() const { return false; }
  /// From dy [s_l, b, h]: returns dL/d(input) [s_l, b, h] (a scratch view). With `defer`, weight
  /// gradients whose inputs stay intact may be held back there.
  virtual Tensor backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) = 0;
  /// The output bias fused into bias-dropout-add (unbound when there is none).
  virtual const ParamRef& output_bias() const = 0;
};

/// The MLP activation outside a GEMM epilogue: act [rows, f] = swiglu(pre) (gated: pre [rows, 2f],
/// gate then up; ops/swiglu.h) or gelu(pre) (pre [rows, f]; ops/gelu.h): the forward of
/// mlp_activation_kind(mlp_activation_of(gated)) (model/variants.h). Used by the experts' forward
/// and by their activation recompute.
void mlp_activation(const Tensor& act, const Tensor& pre, bool gated, const Stream& stream);

/// What an MLP does not save and recomputes in the backward (TransformerConfig::RecomputeModules).
struct MlpRecompute {
  bool input = false;  ///< layernorm: the block's input (the producer writes it again)
  bool mlp = false;    ///< mlp: fc1's output and the activation (fc1 and the activation again)
  bool act = false;    ///< mlp_act: the activation output (from the kept fc1 output)
};

class MLP final : public MlpSlot {
 public:
  using Recompute = MlpRecompute;
  /// The layer's MLP: prefix "decoder.layers.<layer>.mlp", ffn = config.ffn(), recompute as
  /// config.selective_recompute() says for the dense MLP.
  MLP(const TransformerConfig& config, int64_t layer, const TensorParallelRegion& tp, ParamRegistry& registry);
  /// An MLP of another role (the MoE layer's shared experts: "<...>.mlp.shared_experts", ffn =
  /// --moe-shared-expert-intermediate-size), with biases as config.add_bias_linear.
  MLP(const TransformerConfig& config, const std::string& prefix, int64_t ffn, const TensorParallelRegion& tp,
      ParamRegistry& registry, Recompute recompute = {});
  MLP(const MLP&) = delete;
  MLP& operator=(const MLP&) = delete;

  void plan(BufferPlanner& planner, int64_t s, int64_t b) override;
  Tensor input(int area) const override { return linear_fc1_.input(area); }
  bool recomputes_input() const override { return linear_fc1_.recomputes_input(); }
  void restore_input(const StepContext& ctx) override { linear_fc1_.restore_input(ctx); }
  ColumnParallelLinear* fp8_input_linear(int64_t rows) override {
    return linear_fc1_.fuses_fp8_input(rows) ? &linear_fc1_ : nullptr;
  }
  /// fc1, the activation and fc2; under delayed-scaling FP8 the SwiGLU (or the GELU) writes fc2's
  /// FP8 input and its saved transpose in its own pass, no bf16 output
  /// (RowParallelLinear::fuses_fp8_input; ops/fp8_fused.h).
  Tensor forward(const StepContext& ctx, const ResidualAdd* add = nullptr) override;
  bool fuses_residual() const override { return linear_fc2_.fuses_residual(); }
  /// linear_fc1's weight gradient may be deferred (linear_fc2's is computed at once: its gathered
  /// output gradient is shared with the attention block's linear_proj). Under delayed-scaling FP8
  /// the SwiGLU's (or the GELU's, with fc1's bias gradient) backward writes fc1's FP8 output
  /// gradient and its transpose, no bf16 gradient (ColumnParallelLinear::fuses_fp8_grad).
  Tensor backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) override;
  const ParamRef& output_bias() const override { return linear_fc2_.bias(); }

 private:
  /// fc1 (gather: see ColumnParallelLinear::forward) and the activation into linear_fc2's input.
  void forward_fc1(const StepContext& ctx, bool gather);
  const MlpActivationKind& act_;
  Recompute recompute_;
  int64_t local_ffn_;
  ColumnParallelLinear linear_fc1_;
  RowParallelLinear linear_fc2_;
  std::vector<Tensor> pre_;  // per area: fc1 output before the activation [s, b, parts·f_l] (mlp: one scratch)
  Tensor d_pre_;             // without the GELU epilogue: scratch [s, b, parts·f_l]
};

}  // namespace mt
