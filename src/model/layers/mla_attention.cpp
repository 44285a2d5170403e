#include "model/layers/mla_attention.h"

#include <cmath>

#include "model/inference_context.h"
#include "model/layers/parallel_params.h"
#include "ops/kv_cache_attention.h"
#include "ops/matmul.h"
#include "ops/mla.h"
#include "ops/rope.h"

namespace mt {
namespace {

std::string mla_prefix(int64_t layer) { return fmt::format("decoder.layers.{}.self_attention", layer); }

ColumnParallelLinear::Options up_options(const TransformerConfig& c, int64_t layer, const char* name, int64_t in,
                                         int64_t out) {
  ColumnParallelLinear::Options o;
  o.prefix = mla_prefix(layer) + "." + name;
  o.in = in;
  o.out = out;
  o.bias = false;  // Megatron's MLA projections have no bias
  o.init_std = c.init_method_std;
  return o;
}

RowParallelLinear::Options mla_proj_options(const TransformerConfig& c, int64_t layer) {
  RowParallelLinear::Options o;
  o.prefix = mla_prefix(layer) + ".linear_proj";
  o.in = c.num_attention_heads * c.v_head_dim;
  o.out = c.hidden_size;
  o.bias = c.add_bias_linear;
  o.init_std = c.init_method_std / std::sqrt(2.0f * static_cast<float>(c.num_layers));  // scaled_init_method_normal
  return o;
}

/// RoPE of the d_r rotated channels at the front of each packed query/key head (ops/mla.h): pairs
/// (2i, 2i+1), as Megatron's MLA (mla_rotary_interleaved: channels de-interleaved, then rotated by
/// halves; the same scores) and DeepSeek-V3's apply_rotary_pos_emb_interleave.
RopeConfig mla_rope_config(const TransformerConfig& c) {
  RopeConfig r;
  r.queries_per_group = 1;
  r.rotary_dim = c.qk_pos_emb_head_dim;
  r.base = c.rotary_base;
  r.interleaved = true;
  if (c.rope_type == RopeType::kYarn) {
    r.yarn.on = true;
    r.yarn.factor = c.rotary_scaling_factor;
    r.yarn.original_max_positions = c.original_max_position_embeddings;
    r.yarn.beta_fast = c.beta_fast;
    r.yarn.beta_slow = c.beta_slow;
    r.yarn.mscale = c.mscale;
    r.yarn.mscale_all_dim = c.mscale_all_dim;
  }
  return r;
}

}  // namespace

MLASelfAttention::MLASelfAttention(const TransformerConfig& c, const LayerSpec& spec, int64_t layer,
                                   const TensorParallelRegion& tp, ParamRegistry& reg)
    : config_(c),
      tp_(tp),
      layer_(layer),
      heads_(c.num_attention_heads / tp.size()),
      dn_(c.qk_head_dim),
      dr_(c.qk_pos_emb_head_dim),
      dv_(c.v_head_dim),
      d_(c.head_dim()),
      rq_(c.q_lora_rank),
      rkv_(c.kv_lora_rank),
      recompute_up_(c.selective_recompute().mla_up_proj),
      context_parallel_(spec.context_parallel != nullptr),
      linear_kv_up_(up_options(c, layer, "linear_kv_up_proj", c.kv_lora_rank,
                               c.num_attention_heads * (c.qk_head_dim + c.v_head_dim)),
                    tp, reg),
      core_attention_(make_core_attention(c, spec, layer, tp)),
      linear_proj_(mla_proj_options(c, layer), tp, reg) {
  const std::string p = mla_prefix(layer);
  const int64_t h = c.hidden_size, nq = c.num_attention_heads * c.q_head_dim();
  // Replicated (Megatron's duplicated TELinear): each TP rank's gradient covers its own rows under
  // SP (summed over TP then), all rows otherwise.
  if (rq_ > 0) {
    reg.declare(replicated_param(p + ".linear_q_down_proj.weight", {rq_, h}, InitKind::kNormal, c.init_method_std,
                                 TpGradSum::kSequenceParallel),
                &q_down_);
    q_layernorm_ = std::make_unique<Norm>(c, p + ".q_layernorm", rq_, TpGradSum::kSequenceParallel, reg);
    linear_q_ = std::make_unique<ColumnParallelLinear>(up_options(c, layer, "linear_q_up_proj", rq_, nq), tp, reg);
  } else {
    linear_q_ = std::make_unique<ColumnParallelLinear>(up_options(c, layer, "linear_q_proj", h, nq), tp, reg);
  }
  reg.declare(replicated_param(p + ".linear_kv_down_proj.weight", {rkv_ + dr_, h}, InitKind::kNormal,
                               c.init_method_std, TpGradSum::kSequenceParallel),
              &kv_down_);
  kv_layernorm_ = std::make_unique<Norm>(c, p + ".kv_layernorm", rkv_, TpGradSum::kSequenceParallel, reg);
}

void MLASelfAttention::plan(BufferPlanner& p, int64_t s, int64_t b) {
  const DType t = p.act_dtype();
  const int64_t s_l = tp_.local_seq(s), h = config_.hidden_size;
  const size_t a = static_cast<size_t>(p.area());
  auto grow = [a](std::vector<Tensor>& v) {
    if (v.size() <= a) v.resize(a + 1);
    return &v[a];
  };
  *grow(x_) = p.saved(t, {s_l, b, h}, "MLA input");
  if (rq_ > 0) {
    *grow(cq_) = p.saved(t, {s_l, b, rq_}, "MLA query latent");
    q_layernorm_->plan(p, s_l * b);
  }
  *grow(ckv_) = p.saved(t, {s_l, b, rkv_}, "MLA key/value latent");
  kv_layernorm_->plan(p, s_l * b);
  *grow(k_pe_) = p.saved(t, {s, b, dr_}, "MLA k_pe");
  linear_q_->plan(p, s, b);
  linear_kv_up_.plan(p, s, b);
  const std::vector<int64_t> packed{s, b, heads_, 3, d_};
  if (core_attention_->reads_inputs_in_backward() && !recompute_up_) {
    *grow(qkv_saved_) = p.saved(t, packed, "MLA packed qkv (attention input)");
  }
  // The padded context outlives the forward when the core attention's backward reads it: flash's
  // and (without a2a, from the context the caller keeps) ContextParallelAttention's.
  if (core_attention_->reads_inputs_in_backward() || context_parallel_) {
    *grow(context_saved_) = p.saved(t, {s, b, heads_ * d_}, "MLA padded context");
  }
  core_attention_->plan(p, s, b);
  linear_proj_.plan(p, s, b);
  k_pe_local_ = p.scratch("mla.k_pe_local", t, {s_l, b, dr_});
  q_ = p.scratch("mla.q", t, {s, b, heads_ * (dn_ + dr_)});
  kv_ = p.scratch("mla.kv", t, {s, b, heads_ * (dn_ + dv_)});
  qkv_ = p.scratch("mla.qkv", t, packed);
  context_ = p.scratch("mla.context", t, {s, b, heads_ * d_});
  dcontext_ = p.scratch("mla.dcontext", t, {s, b, heads_ * d_});
  dqkv_ = p.scratch("mla.dqkv", t, packed);
  dq_ = p.scratch("mla.dq", t, {s, b, heads_ * (dn_ + dr_)});
  dkv_ = p.scratch("mla.dkv", t, {s, b, heads_ * (dn_ + dv_)});
  dk_pe_ = p.scratch("mla.dk_pe", t, {s, b, dr_});
  dk_pe_local_ = p.scratch("mla.dk_pe_local", t, {s_l, b, dr_});
  if (rq_ > 0) dcq_ = p.scratch("mla.dcq", t, {s_l, b, rq_});
  dckv_ = p.scratch("mla.dckv", t, {s_l, b, rkv_});
  dx_ = p.scratch("mla.dx", t, {s_l, b, h});
}

void MLASelfAttention::pack_and_rotate(const Tensor& qkv, const StepContext& ctx) {
  const int64_t tokens = q_.size(0) * q_.size(1);
  mla_qkv_pack(qkv, q_.view({tokens, heads_, dn_ + dr_}), kv_.view({tokens, heads_, dn_ + dv_}),
               k_pe_.at(static_cast<size_t>(ctx.slot)), ctx.stream);
  rope_forward(qkv, ctx.batch.position_ids, mla_rope_config(config_), ctx.stream);
}

Tensor MLASelfAttention::forward(const StepContext& ctx, const ResidualAdd* add) {
  const size_t a = static_cast<size_t>(ctx.slot);
  const Stream& st = ctx.stream;
  const Tensor x = x_.at(a);
  // Down-projections and latent norms on this rank's rows (replicated weights). Each latent goes
  // through its up-projection before the next is written: with SP the column-parallel layers share
  // the scratch their producer writes (model/layers/linear.h).
  if (rq_ > 0) {
    linear_forward(cq_.at(a), x, q_down_.value(), Tensor(), Tensor(), st);
    q_layernorm_->forward(rows(linear_q_->input(ctx.slot)), rows(cq_.at(a)), ctx);
  } else {
    copy(linear_q_->input(ctx.slot), x, st);
  }
  linear_q_->forward(q_, ctx);
  const Tensor w_kv = kv_down_.value();
  linear_forward(ckv_.at(a), x, w_kv.slice0(0, rkv_), Tensor(), Tensor(), st);
  const Tensor k_pe_local = tp_.sequence_parallel() ? k_pe_local_ : k_pe_.at(a);
  linear_forward(k_pe_local, x, w_kv.slice0(rkv_, rkv_ + dr_), Tensor(), Tensor(), st);
  tp_.enter_forward(k_pe_.at(a), k_pe_local, st);  // with SP: all-gather along the sequence
  kv_layernorm_->forward(rows(linear_kv_up_.input(ctx.slot)), rows(ckv_.at(a)), ctx);
  linear_kv_up_.forward(kv_, ctx);
  const Tensor qkv_in = qkv(ctx.slot);
  pack_and_rotate(qkv_in, ctx);
  const Tensor ctx_pad = context(ctx.slot);
  if (const InferenceContext* inf = ctx.batch.inference) {
    latent_cache_attention(ctx_pad, qkv_in, *inf, ctx);
  } else {
    core_attention_->forward(ctx_pad, qkv_in, ctx);
  }
  mla_context_unpack(linear_proj_.input(ctx.slot), ctx_pad, heads_, /*pad=*/false, st);
  return linear_proj_.forward(ctx, add);
}

void MLASelfAttention::latent_cache_attention(const Tensor& context, const Tensor& qkv, const InferenceContext& inf,
                                              const StepContext& ctx) {
  MT_REQUIRE(!tp_.sequence_parallel(), "generation with multi-latent attention runs without sequence parallelism");
  const Stream& st = ctx.stream;
  const KvCache::Layer& cache = inf.cache().layer(layer_);
  const KvCache::MlaExpanded& ex = inf.cache().mla_expanded();
  const int64_t b = qkv.size(1), off = inf.sequence_len_offset;
  const int64_t B = cache.ckv.size(1), S = cache.ckv.size(0);
  const Tensor key = ex.key.slice(0, 0, b), value = ex.value.slice(0, 0, b);
  if (off > 0) {  // the cached tokens' keys and values from their latents (linear_kv_up_proj again)
    const Tensor up = ex.kv_up.view({S * B, heads_ * (dn_ + dv_)}).slice0(0, off * B);
    linear_forward(up, cache.ckv.view({S * B, rkv_}).slice0(0, off * B), linear_kv_up_.weight().value(), Tensor(),
                   Tensor(), st);
    mla_latent_expand(key, value, up.view({off, B, heads_, dn_ + dv_}), cache.kpe, off, dn_, st);
  }
  KvCacheAttentionConfig kc;
  kc.offset = off;
  kc.softmax_scale = config_.softmax_scale();
  kv_cache_attention_forward(context, qkv, key, value, kc, st);  // appends the new keys/values there
  mla_latent_append(cache.ckv, cache.kpe, linear_kv_up_.input(ctx.slot), qkv, off, st);
}

Tensor MLASelfAttention::backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) {
  const size_t a = static_cast<size_t>(ctx.slot);
  const Stream& st = ctx.stream;
  const Tensor dcontext = linear_proj_.backward(dy, ctx, defer);  // [s, b, n_l·d_v]
  mla_context_unpack(dcontext, dcontext_, heads_, /*pad=*/true, st);
  const Tensor qkv_in = qkv(ctx.slot);
  if (recompute_up_ && core_attention_->reads_inputs_in_backward()) {  // the same GEMMs on the kept latents
    linear_q_->forward(q_, ctx, Tensor(), /*gather=*/false);
    linear_kv_up_.forward(kv_, ctx, Tensor(), /*gather=*/false);
    pack_and_rotate(qkv_in, ctx);
  }
  core_attention_->backward(dqkv_, dcontext_, context(ctx.slot), qkv_in, ctx);
  rope_backward(dqkv_, ctx.batch.position_ids, mla_rope_config(config_), st);
  const int64_t tokens = dq_.size(0) * dq_.size(1);
  mla_qkv_unpack_grad(dq_.view({tokens, heads_, dn_ + dr_}), dkv_.view({tokens, heads_, dn_ + dv_}), dk_pe_, dqkv_,
                      st);
  // up-projections (their input gradients leave as [s_l, b, ·], reduced over TP), latent norms
  const Tensor d_ckv_norm = linear_kv_up_.backward(dkv_, ctx, defer);
  kv_layernorm_->backward(rows(dckv_), rows(d_ckv_norm), rows(ckv_.at(a)), false, ctx);
  const Tensor d_q_in = linear_q_->backward(dq_, ctx, defer);
  if (rq_ > 0) q_layernorm_->backward(rows(dcq_), rows(d_q_in), rows(cq_.at(a)), false, ctx);
  const Tensor dk_pe_local = tp_.sequence_parallel() ? dk_pe_local_ : dk_pe_;
  tp_.enter_backward(dk_pe_local, dk_pe_, st);  // reduce-scatter with SP, all-reduce without
  // down-projections: dx = Σ dlatent · W (into dx_), dW += dlatentᵀ x (this rank's rows)
  const Tensor x = rows(x_.at(a)), dx = rows(dx_);
  const Tensor w_kv = kv_down_.value(), g_kv = kv_down_.grad();
  if (rq_ > 0) {
    linear_backward(dx, q_down_.grad(), Tensor(), rows(dcq_), x, q_down_.value(), st);
  } else {
    copy(dx_, d_q_in, st);
  }
  linear_backward(Tensor(), g_kv.slice0(0, rkv_), Tensor(), rows(dckv_), x, w_kv.slice0(0, rkv_), st);
  matmul(dx, rows(dckv_), w_kv.slice0(0, rkv_), false, false, 1.f, 1.f, st);
  linear_backward(Tensor(), g_kv.slice0(rkv_, rkv_ + dr_), Tensor(), rows(dk_pe_local), x,
                  w_kv.slice0(rkv_, rkv_ + dr_), st);
  matmul(dx, rows(dk_pe_local), w_kv.slice0(rkv_, rkv_ + dr_), false, false, 1.f, 1.f, st);
  return dx_;
}

}  // namespace mt
