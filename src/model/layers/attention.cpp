#include "model/layers/attention.h"

#include <algorithm>
#include <cmath>

#include "model/layers/cp_attention.h"
#include "model/inference_context.h"
#include "ops/kv_cache_attention.h"
#include "ops/rope.h"

namespace mt {

// ---------------------------------------------------------------------------------------------
// DotProductAttention
// ---------------------------------------------------------------------------------------------

DotProductAttention::DotProductAttention(const TransformerConfig& c, int64_t layer, const TensorParallelRegion& tp)
    : config_(c),
      layer_(layer),
      recompute_(c.selective_recompute().core_attn),
      heads_(c.num_attention_heads / tp.size()),
      groups_(c.query_groups() / tp.size()),
      head_offset_(tp.rank() * (c.num_attention_heads / tp.size())) {}

void DotProductAttention::plan(BufferPlanner& p, int64_t s, int64_t b) {
  const DType t = p.act_dtype();
  const int64_t d = config_.head_dim();
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  AttentionBuffers& buf = saved_[a];
  if (recompute_) {  // selective recompute: nothing of the core attention outlives the forward
    buf.q = p.scratch("core_attention.q", t, {b, heads_, s, d});
    buf.k = p.scratch("core_attention.k", t, {b, groups_, s, d});
    buf.v = p.scratch("core_attention.v", t, {b, groups_, s, d});
    buf.probs = p.scratch("core_attention.probs", t, {b, heads_, s, s});
    recomputed_context_ = p.scratch("core_attention.recomputed_context", t, {s, b, heads_ * d});
  } else {
    buf.q = p.saved(t, {b, heads_, s, d}, "q");
    buf.k = p.saved(t, {b, groups_, s, d}, "k");
    buf.v = p.saved(t, {b, groups_, s, d}, "v");
    buf.probs = p.saved(t, {b, heads_, s, s}, "attention probabilities");
  }
  buf.scratch = p.scratch("core_attention.scratch", t, {b, heads_, s, s});
  buf.dq = p.scratch("core_attention.dq", t, {b, heads_, s, d});
  buf.dk = p.scratch("core_attention.dk", t, {b, groups_, s, d});
  buf.dv = p.scratch("core_attention.dv", t, {b, groups_, s, d});
}

AttentionConfig DotProductAttention::attention_config(const StepContext& ctx, int64_t s, int64_t b) const {
  AttentionConfig c;
  c.seq = s;
  c.batch = b;
  c.heads = heads_;
  c.groups = groups_;
  c.head_dim = config_.head_dim();
  c.softmax_scale = config_.softmax_scale();
  c.dropout_p = ctx.dropout.training ? config_.attention_dropout : 0.f;
  c.dropout_key = dropout_key(ctx.dropout, layer_, kSiteAttentionProbs);
  c.head_offset = head_offset_;
  c.total_heads = config_.num_attention_heads;
  c.doc_start = ctx.batch.doc_start;
  return c;
}

void DotProductAttention::forward(const Tensor& context, const Tensor& qkv, const StepContext& ctx) {
  attention_forward(context, qkv, saved_.at(static_cast<size_t>(ctx.slot)),
                    attention_config(ctx, qkv.size(0), qkv.size(1)), ctx.stream);
}

void DotProductAttention::backward(const Tensor& dqkv, const Tensor& dcontext, const Tensor&, const Tensor& qkv,
                                   const StepContext& ctx) {
  const AttentionBuffers& buf = saved_.at(static_cast<size_t>(ctx.slot));
  const AttentionConfig cfg = attention_config(ctx, dqkv.size(0), dqkv.size(1));
  // Selective recompute: q, k, v and the probabilities again from the kept qkv (same dropout key,
  // same kernels: the same values as the forward's)
  if (recompute_) attention_forward(recomputed_context_.view(dcontext.shape()), qkv, buf, cfg, ctx.stream);
  attention_backward(dqkv, dcontext, buf, cfg, ctx.stream);
}

// ---------------------------------------------------------------------------------------------
// FlashAttention
// ---------------------------------------------------------------------------------------------

FlashAttention::FlashAttention(const TransformerConfig& c, int64_t layer, const TensorParallelRegion& tp, bool cudnn)
    : config_(c),
      layer_(layer),
      cudnn_(cudnn),
      heads_(c.num_attention_heads / tp.size()),
      groups_(c.query_groups() / tp.size()),
      head_offset_(tp.rank() * (c.num_attention_heads / tp.size())) {}

FlashAttentionConfig FlashAttention::flash_config(const StepContext& ctx, int64_t s, int64_t b) const {
  FlashAttentionConfig c;
  c.seq = s;
  c.batch = b;
  c.groups = groups_;
  c.queries_per_group = heads_ / groups_;
  c.head_dim = config_.head_dim();
  c.softmax_scale = config_.softmax_scale();
  c.dropout_p = ctx.dropout.training ? config_.attention_dropout : 0.f;
  c.dropout_key = dropout_key(ctx.dropout, layer_, kSiteAttentionProbs);
  c.head_offset = head_offset_;
  c.total_heads = config_.num_attention_heads;
  c.doc_start = ctx.batch.doc_start;
  c.deterministic = config_.deterministic_mode;
  c.cudnn = cudnn_;
  if (config_.multi_latent_attention) c.v_head_dim = config_.v_head_dim;  // the values' zero padding (ops/mla.h)
  return c;
}

void FlashAttention::plan(BufferPlanner& p, int64_t s, int64_t b) {
  const size_t a = static_cast<size_t>(p.area());
  if (lse_.size() <= a) lse_.resize(a + 1);
  lse_[a] = p.saved(DType::kF32, {b, heads_, s}, "attention softmax lse");
  FlashAttentionConfig c;
  c.seq = s;
  c.batch = b;
  c.groups = groups_;
  c.queries_per_group = heads_ / groups_;
  c.head_dim = config_.head_dim();
  const int64_t bytes = static_cast<int64_t>(flash_attention_workspace_bytes(c));
  workspace_ = p.scratch("core_attention.flash_workspace", DType::kU8, {std::max<int64_t>(bytes, 1)});
}

void FlashAttention::forward(const Tensor& context, const Tensor& qkv, const StepContext& ctx) {
  flash_attention_forward(context, lse_.at(static_cast<size_t>(ctx.slot)), qkv,
                          flash_config(ctx, qkv.size(0), qkv.size(1)), ctx.stream);
}

void FlashAttention::backward(const Tensor& dqkv, const Tensor& dcontext, const Tensor& context, const Tensor& qkv,
                              const StepContext& ctx) {
  flash_attention_backward(dqkv, dcontext, context, lse_.at(static_cast<size_t>(ctx.slot)), qkv, workspace_,
                           flash_config(ctx, qkv.size(0), qkv.size(1)), ctx.stream);
}

// ---------------------------------------------------------------------------------------------
// SelfAttention
// ---------------------------------------------------------------------------------------------

namespace {
std::string attention_prefix(int64_t layer) { return fmt::format("decoder.layers.{}.self_attention", layer); }

ColumnParallelLinear::Options qkv_options(const TransformerConfig& c, int64_t layer) {
  ColumnParallelLinear::Options o;
  o.prefix = attention_prefix(layer) + ".linear_qkv";
  o.in = c.hidden_size;
  o.out = (c.num_attention_heads + 2 * c.query_groups()) * c.head_dim();
  o.bias = c.qkv_bias();
  o.init_std = c.init_method_std;
  o.recompute_input = c.selective_recompute().layernorm;  // input_layernorm's output
  return o;
}

RowParallelLinear::Options proj_options(const TransformerConfig& c, int64_t layer) {
  RowParallelLinear::Options o;
  o.prefix = attention_prefix(layer) + ".linear_proj";
  o.in = c.num_attention_heads * c.head_dim();
  o.out = c.hidden_size;
  o.bias = c.add_bias_linear;
  // Megatron's scaled_init_method_normal: output projections at sigma / sqrt(2 L).
  o.init_std = c.init_method_std / std::sqrt(2.0f * static_cast<float>(c.num_layers));
  return o;
}

}  // namespace

std::unique_ptr<CoreAttention> make_core_attention(const TransformerConfig& c, const LayerSpec& spec, int64_t layer,
                                                   const TensorParallelRegion& tp) {
  if (spec.context_parallel != nullptr)  // the blocks on cuDNN where the resolved backend is fused
    return std::make_unique<ContextParallelAttention>(c, layer, tp, *spec.context_parallel,
                                                      spec.core_attention == AttentionBackend::kFused);
  const AttentionBackendKind& kind = attention_backend_kind(spec.core_attention);
  MT_REQUIRE(kind.make != nullptr, "--attention-backend {} builds no core attention: resolve it first",
             kind.names.name);
  return kind.make(c, layer, tp);
}

SelfAttention::SelfAttention(const TransformerConfig& c, const LayerSpec& spec, int64_t layer,
                             const TensorParallelRegion& tp, ParamRegistry& reg)
    : config_(c),
      tp_(tp),
      layer_(layer),
      queries_per_group_(c.num_attention_heads / c.query_groups()),
      local_groups_(c.query_groups() / tp.size()),
      head_dim_(c.head_dim()),
      rope_(position_embedding_kind(c.position_embedding_type).rotary),
      linear_qkv_(qkv_options(c, layer), tp, reg),
      core_attention_(make_core_attention(c, spec, layer, tp)),
      linear_proj_(proj_options(c, layer), tp, reg) {
  if (spec.qk_layernorm) {
    // Every TP rank normalises its own heads with the shared weights: partial gradients.
    q_layernorm_ = std::make_unique<Norm>(c, attention_prefix(layer) + ".q_layernorm", head_dim_, TpGradSum::kAlways, reg);
    k_layernorm_ = std::make_unique<Norm>(c, attention_prefix(layer) + ".k_layernorm", head_dim_, TpGradSum::kAlways, reg);
  }
}

Tensor SelfAttention::heads(const Tensor& qkv, bool keys) const {
  const Tensor t = qkv.view({qkv.numel() / ((queries_per_group_ + 2) * head_dim_), queries_per_group_ + 2, head_dim_});
  return keys ? t.slice(1, queries_per_group_, queries_per_group_ + 1) : t.slice(1, 0, queries_per_group_);
}

void SelfAttention::plan(BufferPlanner& p, int64_t s, int64_t b) {
  const DType t = p.act_dtype();
  const std::vector<int64_t> shape{s, b, local_groups_, queries_per_group_ + 2, head_dim_};
  linear_qkv_.plan(p, s, b);
  qkv_ = p.scratch("self_attention.qkv", t, shape);
  dqkv_ = p.scratch("self_attention.dqkv", t, shape);
  if (core_attention_->reads_inputs_in_backward()) {
    const size_t a = static_cast<size_t>(p.area());
    if (qkv_saved_.size() <= a) qkv_saved_.resize(a + 1);
    qkv_saved_[a] = p.saved(t, shape, "qkv (attention input)");
  }
  if (q_layernorm_) {
    const size_t a = static_cast<size_t>(p.area());
    if (qkv_raw_.size() <= a) qkv_raw_.resize(a + 1);
    qkv_raw_[a] = p.saved(t, shape, "qkv before q/k layernorm");
    q_layernorm_->plan(p, s * b * local_groups_ * queries_per_group_);
    k_layernorm_->plan(p, s * b * local_groups_);
  }
  core_attention_->plan(p, s, b);
  linear_proj_.plan(p, s, b);
}

namespace {
RopeConfig rope_config(const TransformerConfig& c, int64_t qpg) {
  RopeConfig r;
  r.queries_per_group = qpg;
  r.rotary_dim = c.rotary_dim();
  r.base = c.rotary_base;
  r.interleaved = c.rotary_interleaved;
  return r;
}
}  // namespace

Tensor SelfAttention::qkv(int area) const {
  return qkv_saved_.empty() ? qkv_ : qkv_saved_.at(static_cast<size_t>(area));
}

Tensor SelfAttention::forward(const StepContext& ctx, const ResidualAdd* add) {
  const Tensor qkv_in = qkv(ctx.slot);
  const Tensor raw = q_layernorm_ ? qkv_raw_.at(static_cast<size_t>(ctx.slot)) : qkv_in;
  linear_qkv_.forward(raw, ctx);
  if (q_layernorm_) {
    copy(qkv_in, raw, ctx.stream);  // the value heads; the norms overwrite queries and keys
    q_layernorm_->forward(heads(qkv_in, false), heads(raw, false), ctx);
    k_layernorm_->forward(heads(qkv_in, true), heads(raw, true), ctx);
  }
  if (rope_) rope_forward(qkv_in, ctx.batch.position_ids, rope_config(config_, queries_per_group_), ctx.stream);
  if (const InferenceContext* inf = ctx.batch.inference) {
    const KvCache::Layer& kv = inf->cache().layer(layer_);
    KvCacheAttentionConfig kc;
    kc.offset = inf->sequence_len_offset;
    kc.softmax_scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
    kv_cache_attention_forward(linear_proj_.input(ctx.slot), qkv_in, kv.key.slice(0, 0, qkv_in.size(1)),
                               kv.value.slice(0, 0, qkv_in.size(1)), kc, ctx.stream);
  } else {
    core_attention_->forward(linear_proj_.input(ctx.slot), qkv_in, ctx);
  }
  return linear_proj_.forward(ctx, add);
}

Tensor SelfAttention::backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) {
  const Tensor dcontext = linear_proj_.backward(dy, ctx, defer);
  core_attention_->backward(dqkv_, dcontext, linear_proj_.input(ctx.slot), qkv(ctx.slot), ctx);
  if (rope_) rope_backward(dqkv_, ctx.batch.position_ids, rope_config(config_, queries_per_group_), ctx.stream);
  if (q_layernorm_) {
    const Tensor raw = qkv_raw_.at(static_cast<size_t>(ctx.slot));
    q_layernorm_->backward(heads(dqkv_, false), heads(dqkv_, false), heads(raw, false), false, ctx);
    k_layernorm_->backward(heads(dqkv_, true), heads(dqkv_, true), heads(raw, true), false, ctx);
  }
  return linear_qkv_.backward(dqkv_, ctx, defer);
}

}  // namespace mt
