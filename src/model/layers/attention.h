// Self-attention block (Megatron-Core transformer/attention.py SelfAttention;
// Vaswani et al. 2017, Shoeybi et al. 2019 §3): linear_qkv (ColumnParallelLinear, split by query
// groups) -> optional q_layernorm / k_layernorm (per head) -> rotary position embedding -> core
// attention -> linear_proj (RowParallelLinear). Shapes on one TP rank: n_l = n/tp query heads,
// g_l = g/tp key/value heads, d head dim, s sequence, s_l = s/tp with sequence parallelism.
// The fused QKV output is Megatron-Core's per-query-group layout [s, b, g_l, n/g + 2, d].
#pragma once
#include <memory>
#include <vector>

#include "model/layers/linear.h"
#include "model/layers/norm.h"
#include "model/specs.h"
#include "model/transformer_config.h"
#include "ops/attention.h"
#include "ops/flash_attention.h"

namespace mt {

/// The core attention submodule: context = softmax(scale · q kᵀ + causal/document mask) v with
/// attention dropout, from the fused QKV tensor. Implementations: DotProductAttention,
/// FlashAttention, ContextParallelAttention; --attention-backend picks one through its entry of
/// model/variants.h.
class CoreAttention {
 public:
  virtual ~CoreAttention() = default;
  /// Plans saved tensors (open area) and scratch for micro-batch b.
  virtual void plan(BufferPlanner& planner, int64_t s, int64_t b) = 0;
  /// Whether backward reads the forward's qkv and context (then the caller keeps them intact from
  /// the forward to the backward: saved, not scratch).
  virtual bool reads_inputs_in_backward() const = 0;
  /// context [s, b, n_l·d] from qkv [s, b, g_l, qpg + 2, d].
  virtual void forward(const Tensor& context, const Tensor& qkv, const StepContext& ctx) = 0;
  /// dqkv (overwrite) from dcontext, using what the forward saved and (when
  /// reads_inputs_in_backward()) the forward's context and qkv.
  virtual void backward(const Tensor& dqkv, const Tensor& dcontext, const Tensor& context, const Tensor& qkv,
                        const StepContext& ctx) = 0;
};

/// The core attention of the layer spec: ContextParallelAttention under CP, else the entry of
/// --attention-backend (model/variants.h). Shapes from config (head_dim(), query_groups()).
std::unique_ptr<CoreAttention> make_core_attention(const TransformerConfig& config, const LayerSpec& spec,
                                                   int64_t layer, const TensorParallelRegion& tp);

/// Megatron's DotProductAttention ("local"): ops/attention.h, which saves q, k, v and the
/// probabilities [b, n_l, s, s]. With --recompute-granularity selective (Megatron's core_attn
/// recompute) it saves nothing: the caller keeps the qkv input and the backward re-runs the
/// forward into scratch first.
class DotProductAttention final : public CoreAttention {
 public:
  DotProductAttention(const TransformerConfig& config, int64_t layer, const TensorParallelRegion& tp);
  void plan(BufferPlanner& planner, int64_t s, int64_t b) override;
  bool reads_inputs_in_backward() const override { return recompute_; }
  void forward(const Tensor& context, const Tensor& qkv, const StepContext& ctx) override;
  void backward(const Tensor& dqkv, const Tensor& dcontext, const Tensor& context, const Tensor& qkv,
                const StepContext& ctx) override;

 private:
  AttentionConfig attention_config(const StepContext& ctx, int64_t s, int64_t b) const;
  const TransformerConfig& config_;
  int64_t layer_;
  bool recompute_;  // selective recompute
  int64_t heads_, groups_, head_offset_;
  std::vector<AttentionBuffers> saved_;  // per area; scratch, dq, dk, dv shared (with recompute: all scratch)
  Tensor recomputed_context_;            // recompute: the re-run forward's output [s, b, n_l·d] (scratch)
};

/// FlashAttention-2 (ops/flash_attention.h; Megatron's flash / fused backends): the [s, s]
/// probabilities never reach memory. Saves the softmax log-sum-exp [b, n_l, s] (fp32); its backward
/// reads the forward's qkv and context, which the caller keeps. With `cudnn` (--attention-backend
/// fused) the op runs cuDNN's fused attention where it applies (FlashAttentionConfig::cudnn).
class FlashAttention final : public CoreAttention {
 public:
  FlashAttention(const TransformerConfig& config, int64_t layer, const TensorParallelRegion& tp, bool cudnn);
  void plan(BufferPlanner& planner, int64_t s, int64_t b) override;
  bool reads_inputs_in_backward() const override { return true; }
  void forward(const Tensor& context, const Tensor& qkv, const StepContext& ctx) override;
  void backward(const Tensor& dqkv, const Tensor& dcontext, const Tensor& context, const Tensor& qkv,
                const StepContext& ctx) override;

 private:
  FlashAttentionConfig flash_config(const StepContext& ctx, int64_t s, int64_t b) const;
  const TransformerConfig& config_;
  int64_t layer_;
  bool cudnn_;
  int64_t heads_, groups_, head_offset_;
  std::vector<Tensor> lse_;  // per area: fp32 [b, n_l, s]
  Tensor workspace_;         // scratch for the backward
};

/// The self-attention slot of a transformer layer (Megatron's self_attention submodule): SelfAttention,
/// or MLASelfAttention (model/layers/mla_attention.h) with --multi-latent-attention. Shapes as
/// SelfAttention's.
class AttentionSlot {
 public:
  virtual ~AttentionSlot() = default;
  virtual void plan(BufferPlanner& planner, int64_t s, int64_t b) = 0;
  /// Where the input layernorm writes the block's input [s_l, b, h] for `area`.
  virtual Tensor input(int area) const = 0;
  /// Whether the input is not saved (--recompute-modules layernorm): before backward the input
  /// layernorm must write input() again and restore_input() must run.
  virtual bool recomputes_input() const { return false; }
  virtual void restore_input(const StepContext&) {}
  /// The linear whose FP8 input the input layernorm writes in its own pass in a forward of `rows`
  /// (= s·b) rows (ColumnParallelLinear::fuses_fp8_input; docs/fp8.md "Fused quantisation"), or
  /// nullptr (also when more than one linear reads the input: MLA).
  virtual ColumnParallelLinear* fp8_input_linear(int64_t /*rows*/) { return nullptr; }
  /// Returns the block's output [s_l, b, h] before the output bias (a scratch view); with `add`
  /// (only when fuses_residual()) add->out = add->residual + (output + bias).
  virtual Tensor forward(const StepContext& ctx, const ResidualAdd* add = nullptr) = 0;
  virtual bool fuses_residual() const = 0;
  /// From dy [s_l, b, h]: returns dL/d(input) [s_l, b, h] (a scratch view); with `defer`, weight
  /// gradients whose inputs stay intact may be held back there.
  virtual Tensor backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) = 0;
  /// The output projection's bias (added by the layer's bias-dropout-add), unbound without biases.
  virtual const ParamRef& output_bias() const = 0;
};

class SelfAttention final : public AttentionSlot {
 public:
  /// prefix: "decoder.layers.<layer>.self_attention".
  SelfAttention(const TransformerConfig& config, const LayerSpec& spec, int64_t layer, const TensorParallelRegion& tp,
                ParamRegistry& registry);
  SelfAttention(const SelfAttention&) = delete;
  SelfAttention& operator=(const SelfAttention&) = delete;

  void plan(BufferPlanner& planner, int64_t s, int64_t b) override;
  /// Where the input layernorm writes the block's input [s_l, b, h] for `area`.
  Tensor input(int area) const override { return linear_qkv_.input(area); }
  /// Whether the input is not saved (--recompute-modules layernorm): before backward the input
  /// layernorm must write input() again and restore_input() must run.
  bool recomputes_input() const override { return linear_qkv_.recomputes_input(); }
  void restore_input(const StepContext& ctx) override { linear_qkv_.restore_input(ctx); }
  ColumnParallelLinear* fp8_input_linear(int64_t rows) override {
    return linear_qkv_.fuses_fp8_input(rows) ? &linear_qkv_ : nullptr;
  }
  /// Returns the block's output [s_l, b, h] before the output bias (a scratch view). With
  /// ctx.batch.inference (generation) the core attention is replaced by the key/value-cache
  /// attention (ops/kv_cache_attention.h): the new keys/values are appended to this layer's cache
  /// at the context's offset and the queries attend over the cache (no dropout, no backward).
  Tensor forward(const StepContext& ctx, const ResidualAdd* add = nullptr) override;
  /// linear_proj's fuses_residual(): forward may take a ResidualAdd.
  bool fuses_residual() const override { return linear_proj_.fuses_residual(); }
  /// From dy [s_l, b, h]: returns dL/d(input) [s_l, b, h] (a scratch view). With `defer`, the
  /// weight gradients of linear_proj and linear_qkv are held back there.
  Tensor backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) override;
  /// linear_proj's bias (added by the layer's bias-dropout-add), unbound without biases.
  const ParamRef& output_bias() const override { return linear_proj_.bias(); }

 private:
  /// The query (or key) heads of a QKV tensor [s, b, g_l, qpg + 2, d] as rows [s·b·g_l, count, d].
  Tensor heads(const Tensor& qkv, bool keys) const;
  const TransformerConfig& config_;
  const TensorParallelRegion& tp_;
  int64_t layer_;
  int64_t queries_per_group_, local_groups_, head_dim_;
  bool rope_;
  ColumnParallelLinear linear_qkv_;
  std::unique_ptr<Norm> q_layernorm_, k_layernorm_;
  std::unique_ptr<CoreAttention> core_attention_;
  RowParallelLinear linear_proj_;
  /// The QKV tensor the core attention reads in `area`: scratch, or saved per area when the core
  /// attention's backward reads it.
  Tensor qkv(int area) const;
  std::vector<Tensor> qkv_raw_;  // qk-layernorm: the projection's output per area (norm inputs)
  std::vector<Tensor> qkv_saved_;  // per area when the core attention reads its input in backward
  Tensor qkv_, dqkv_;            // scratch [s, b, g_l, qpg + 2, d]
};

}  // namespace mt
