// Multi-latent attention (DeepSeek-V2 §2.1, arXiv:2405.04434; DeepSeek-V3; Megatron-Core
// transformer/multi_latent_attention.py MLASelfAttention, local spec). Per token x [h]:
//   query:  c_q = q_layernorm(x W_qdᵀ) [r_q],  q = c_q W_quᵀ [n, d_n + d_r]   (--q-lora-rank r_q)
//           or q = x W_qᵀ (no --q-lora-rank: linear_q_proj)
//   kv:     [c_kv, k_pe] = x W_kvdᵀ [r_kv + d_r],  kv = kv_layernorm(c_kv) W_kvuᵀ [n, d_n + d_v]
//   q = [q_nope, q_pe], kv = [k_nope, v]; RoPE (YaRN with --rope-type yarn) on q_pe and on k_pe,
//   which every head shares; scores (q_nope·k_nope + q_pe·k_pe) · mscale² / sqrt(d_n + d_r);
//   context [n, d_v] → linear_proj (RowParallelLinear).
// Modules and parameter names (prefix decoder.layers.<l>.self_attention.): linear_q_down_proj
// [r_q, h], q_layernorm [r_q], linear_q_up_proj [n(d_n + d_r), r_q] (or linear_q_proj
// [n(d_n + d_r), h]), linear_kv_down_proj [r_kv + d_r, h], kv_layernorm [r_kv], linear_kv_up_proj
// [n(d_n + d_v), r_kv], linear_proj [h, n d_v]. The norms are --normalization's kind.
//
// Tensor parallelism as Megatron's (duplicated down-projections): the down-projections and latent
// norms are replicated on every TP rank and run on the rank's input rows ([s_l, b, h]; with SP its
// sequence shard, their gradients then summed over TP); the up-projections are
// ColumnParallelLinear (heads split, their input entering the TP region: all-gathered along the
// sequence with SP), k_pe enters the region the same way (TensorParallelRegion::enter_*), and
// linear_proj leaves it. Every other parallelism (PP/VPP, DP, CP, EP) sees a self-attention block.
//
// The core attention is the spec's (DotProductAttention, FlashAttention, ContextParallelAttention)
// on the fused layout [s, b, n_l, 3, D] with one key/value head per query head, D =
// TransformerConfig::head_dim() = max(d_n + d_r, d_v): the value heads (or the query/key heads)
// zero-padded (ops/mla.h), the softmax scale TransformerConfig::softmax_scale().
//
// Saved per area: the input [s_l, b, h], the latents before their norms, the norms' statistics,
// k_pe [s, b, d_r] after the region entry, the up-projections' gathered inputs, the packed qkv and
// padded context when the core attention's backward reads them (with --recompute-modules
// mla_up_proj the qkv is not saved: the backward runs the up-projections, RoPE and packing again
// from the kept latents), and what the submodules save.
#pragma once
#include <memory>
#include <vector>

#include "model/inference_context.h"
#include "model/layers/attention.h"

namespace mt {

class MLASelfAttention final : public AttentionSlot {
 public:
  /// Errors: mt::Error from TransformerConfig::validate's MLA rules (not re-checked here).
  MLASelfAttention(const TransformerConfig& config, const LayerSpec& spec, int64_t layer, const TensorParallelRegion& tp,
                   ParamRegistry& registry);
  MLASelfAttention(const MLASelfAttention&) = delete;
  MLASelfAttention& operator=(const MLASelfAttention&) = delete;

  void plan(BufferPlanner& planner, int64_t s, int64_t b) override;
  Tensor input(int area) const override { return x_.at(static_cast<size_t>(area)); }
  /// With ctx.batch.inference (generation) the core attention is the key/value-cache attention
  /// (ops/kv_cache_attention.h) over keys and values rebuilt from the layer's latent cache.
  Tensor forward(const StepContext& ctx, const ResidualAdd* add = nullptr) override;
  bool fuses_residual() const override { return linear_proj_.fuses_residual(); }
  /// Weight gradients: linear_proj's and the up-projections' may be deferred; the replicated
  /// down-projections' accumulate now.
  Tensor backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) override;
  const ParamRef& output_bias() const override { return linear_proj_.bias(); }

 private:
  /// qkv [s, b, n_l, 3, D] from the up-projections' outputs q_, kv_ and k_pe: packed
  /// (ops/mla.h) and rotated (forward, and the mla_up_proj recompute).
  void pack_and_rotate(const Tensor& qkv, const StepContext& ctx);
  /// Generation: the attention of the new tokens' packed qkv [s, b, n_l, 3, D] over the cached
  /// tokens, whose keys and values are rebuilt from the layer's latent cache
  /// (model/inference_context.h) into the cache's shared buffers; then the new tokens' latents
  /// (kv_layernorm's output and the rotated k_pe) are appended to the cache.
  void latent_cache_attention(const Tensor& context, const Tensor& qkv, const InferenceContext& inf,
                              const StepContext& ctx);
  Tensor qkv(int area) const { return qkv_saved_.empty() ? qkv_ : qkv_saved_.at(static_cast<size_t>(area)); }
  Tensor context(int area) const {
    return context_saved_.empty() ? context_ : context_saved_.at(static_cast<size_t>(area));
  }
  const TransformerConfig& config_;
  const TensorParallelRegion& tp_;
  int64_t layer_;
  int64_t heads_;  // n_l = n / tp
  int64_t dn_, dr_, dv_, d_, rq_, rkv_;
  bool recompute_up_;  // --recompute-modules mla_up_proj
  bool context_parallel_;  // the core attention is ContextParallelAttention
  ParamRef q_down_, kv_down_;  // replicated [r_q, h], [r_kv + d_r, h]
  std::unique_ptr<Norm> q_layernorm_, kv_layernorm_;
  std::unique_ptr<ColumnParallelLinear> linear_q_;  // linear_q_up_proj, or linear_q_proj without r_q
  ColumnParallelLinear linear_kv_up_;
  std::unique_ptr<CoreAttention> core_attention_;
  RowParallelLinear linear_proj_;
  // per area (saved)
  std::vector<Tensor> x_;                   // [s_l, b, h]
  std::vector<Tensor> cq_, ckv_;            // latents before their norms [s_l, b, r_q], [s_l, b, r_kv]
  std::vector<Tensor> k_pe_;                // [s, b, d_r] after the region entry (not rotated)
  std::vector<Tensor> qkv_saved_, context_saved_;  // when the core attention reads them in backward
  // scratch
  Tensor k_pe_local_;                       // [s_l, b, d_r] (SP; else a view of k_pe_)
  Tensor q_, kv_;                           // [s, b, n_l, d_n + d_r], [s, b, n_l, d_n + d_v]
  Tensor qkv_, context_;                    // [s, b, n_l, 3, D], [s, b, n_l·D]
  Tensor dcontext_, dqkv_, dq_, dkv_;       // gradients of the same shapes
  Tensor dk_pe_, dk_pe_local_;              // [s, b, d_r], [s_l, b, d_r]
  Tensor dcq_, dckv_, dx_;                  // [s_l, b, r_q], [s_l, b, r_kv], [s_l, b, h]
};

}  // namespace mt
