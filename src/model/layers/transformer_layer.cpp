#include "model/layers/transformer_layer.h"

#include <functional>

#include "model/layer_graphs.h"
#include "model/layers/mla_attention.h"
#include "ops/elementwise.h"

namespace mt {

TransformerLayer::TransformerLayer(const TransformerConfig& c, const LayerSpec& spec, int64_t layer,
                                   const TensorParallelRegion& tp, const ExpertParallel& ep, ParamRegistry& reg)
    : config_(c), tp_(tp), layer_(layer) {
  reg.begin_group(/*sort_by_sharding=*/true);
  group_ = reg.num_groups() - 1;
  const std::string p = fmt::format("decoder.layers.{}.", layer);
  const int64_t h = c.hidden_size;
  input_layernorm_ = std::make_unique<Norm>(c, p + "input_layernorm", h, TpGradSum::kSequenceParallel, reg);
  if (spec.multi_latent_attention) {
    self_attention_ = std::make_unique<MLASelfAttention>(c, spec, layer, tp, reg);
  } else {
    self_attention_ = std::make_unique<SelfAttention>(c, spec, layer, tp, reg);
  }
  pre_mlp_layernorm_ = std::make_unique<Norm>(c, p + "pre_mlp_layernorm", h, TpGradSum::kSequenceParallel, reg);
  if (spec.mlp == MlpKind::kMoE) {
    mlp_ = std::make_unique<MoELayer>(c, layer, tp, ep, reg);
  } else {
    mlp_ = std::make_unique<MLP>(c, layer, tp, reg);
  }
}

void TransformerLayer::plan(BufferPlanner& p, int64_t s, int64_t b) {
  const DType t = p.act_dtype();
  seq_local_ = tp_.local_seq(s);
  batch_ = b;
  const int64_t h = config_.hidden_size, rows = seq_local_ * b;
  input_layernorm_->plan(p, rows);
  self_attention_->plan(p, s, b);
  pre_mlp_layernorm_->plan(p, rows);
  mlp_->plan(p, s, b);
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  saved_[a].resid1 = p.saved(t, {seq_local_, b, h}, "resid1");
  saved_[a].out = p.saved(t, {seq_local_, b, h}, "layer output");
  branch_grad_ = p.scratch("layer.branch_grad", t, {seq_local_, b, h});
}

namespace {
/// Global index of this rank's first element of an [s_l, b, h] tensor (the dropout mask key does
/// not depend on the sequence-parallel split).
int64_t shard_offset(const TensorParallelRegion& tp, int64_t sl, int64_t b, int64_t h) {
  return tp.sequence_parallel() ? tp.rank() * sl * b * h : 0;
}
}  // namespace

namespace {
using Region = LayerGraphs::Region;
// Runs a region of the layer eagerly or through its per-layer CUDA graph (model/layer_graphs.h).
void region(const StepContext& ctx, int64_t layer, Region r, bool backward, const LayerGraphs::Inputs& in,
            const std::function<void()>& body) {
  if (ctx.graphs == nullptr) {
    body();
    return;
  }
  ctx.graphs->run(layer, r, backward, ctx.dropout.training, ctx.slot, in, ctx.stream, body);
}
bool captured(const StepContext& ctx, Region r) {
  return ctx.graphs != nullptr && ctx.graphs->capturing() && ctx.graphs->scoped(r);
}
// y = norm(x), the block's input; under delayed-scaling FP8 an RMSNorm also writes the FP8 input
// of the block's first linear (`fused`, when it takes one) in the same pass (docs/fp8.md "Fused
// quantisation").
void norm_forward(Norm& norm, const Tensor& y, const Tensor& x, ColumnParallelLinear* fused, const StepContext& ctx) {
  if (fused != nullptr && norm.writes_fp8()) {
    const Fp8Linear::FusedInput q = fused->fp8_input(y.size(0), ctx.slot);
    norm.forward_fp8(y, q.xq, q.scale, q.record, x, ctx);
    return;
  }
  norm.forward(y, x, ctx);
}
}  // namespace

Tensor TransformerLayer::forward(const Tensor& x, const StepContext& ctx) {
  const Saved& s = saved_.at(static_cast<size_t>(ctx.slot));
  const float pd = ctx.dropout.training ? config_.hidden_dropout : 0.f;
  const int64_t off = shard_offset(tp_, seq_local_, batch_, config_.hidden_size);
  const LayerGraphs::Inputs attn_in{x.data(), ctx.batch.position_ids.data(), ctx.batch.doc_start.data(), nullptr,
                                    nullptr};
  // Without dropout the residual add (bias-dropout-add) happens in the output projection's GEMM
  // where no tensor-parallel reduction follows it (ResidualAdd).
  region(ctx, layer_, Region::kAttention, false, attn_in, [&] {
    const Tensor ln = rows(self_attention_->input(ctx.slot));
    norm_forward(*input_layernorm_, ln, rows(x), self_attention_->fp8_input_linear(ln.size(0)), ctx);
    if (pd == 0.f && self_attention_->fuses_residual()) {
      const ResidualAdd add{s.resid1, x};
      self_attention_->forward(ctx, &add);
      return;
    }
    const Tensor attn = self_attention_->forward(ctx);
    bias_dropout_add_forward(rows(s.resid1), rows(attn), value_or_empty(self_attention_->output_bias()), rows(x), pd,
                             dropout_key(ctx.dropout, layer_, kSiteAttentionOut), off, ctx.stream);
  });
  region(ctx, layer_, mlp_region(), false, {}, [&] {
    const Tensor ln = rows(mlp_->input(ctx.slot));
    norm_forward(*pre_mlp_layernorm_, ln, rows(s.resid1), mlp_->fp8_input_linear(ln.size(0)), ctx);
    if (pd == 0.f && mlp_->fuses_residual()) {
      const ResidualAdd add{s.out, s.resid1};
      mlp_->forward(ctx, &add);
      return;
    }
    const Tensor mlp = mlp_->forward(ctx);
    bias_dropout_add_forward(rows(s.out), rows(mlp), value_or_empty(mlp_->output_bias()), rows(s.resid1), pd,
                             dropout_key(ctx.dropout, layer_, kSiteMlpOut), off, ctx.stream);
  });
  return s.out;
}

void TransformerLayer::backward(const Tensor& x, const Tensor& d_resid, const StepContext& ctx, WgradDeferral* defer) {
  // Activation gradients overwrite except the residual stream, into which the norms' backward
  // accumulates.
  const Saved& s = saved_.at(static_cast<size_t>(ctx.slot));
  const float pd = ctx.dropout.training ? config_.hidden_dropout : 0.f;
  const int64_t off = shard_offset(tp_, seq_local_, batch_, config_.hidden_size);
  // A captured region computes its weight gradients inline (a deferral is host bookkeeping,
  // which a replay would not repeat).
  // --- MLP block: out = resid1 + dropout(mlp(ln2(resid1)) + b_fc2) ---
  const LayerGraphs::Inputs mlp_in{d_resid.data(), ctx.loss_scale.data(), nullptr, nullptr, nullptr};
  // Without dropout the branch gradient is d_resid itself: it is passed on instead of copied when
  // nothing reads it after the block's norm backward accumulates into d_resid. That excludes a
  // deferred weight gradient of the attention's output projection reading it (without SP; with SP
  // it reads its gathered copy) and the MoE block (its buffers are not audited for this).
  auto branch = [&](const Tensor& dbias, DropoutSite site, bool alias_ok) -> Tensor {
    if (pd == 0.f && alias_ok) {
      bias_dropout_add_backward(Tensor(), dbias, rows(d_resid), 0.f, dropout_key(ctx.dropout, layer_, site), off,
                                ctx.stream);
      return d_resid;
    }
    bias_dropout_add_backward(rows(branch_grad_), dbias, rows(d_resid), pd, dropout_key(ctx.dropout, layer_, site),
                              off, ctx.stream);
    return branch_grad_;
  };
  region(ctx, layer_, mlp_region(), true, mlp_in, [&] {
    if (mlp_->recomputes_input()) {  // --recompute-modules layernorm
      pre_mlp_layernorm_->forward(rows(mlp_->input(ctx.slot)), rows(s.resid1), ctx);
      mlp_->restore_input(ctx);
    }
    const Tensor dy = branch(grad_or_empty(mlp_->output_bias()), kSiteMlpOut, moe() == nullptr);
    const Tensor d_ln = mlp_->backward(dy, ctx, captured(ctx, mlp_region()) ? nullptr : defer);
    pre_mlp_layernorm_->backward(rows(d_resid), rows(d_ln), rows(s.resid1), /*accumulate_dx=*/true, ctx);
  });
  // --- attention block: resid1 = x + dropout(attention(ln1(x)) + b_proj) ---
  const LayerGraphs::Inputs attn_in{x.data(), d_resid.data(), ctx.batch.position_ids.data(),
                                    ctx.batch.doc_start.data(), ctx.loss_scale.data()};
  region(ctx, layer_, Region::kAttention, true, attn_in, [&] {
    if (self_attention_->recomputes_input()) {  // --recompute-modules layernorm
      input_layernorm_->forward(rows(self_attention_->input(ctx.slot)), rows(x), ctx);
      self_attention_->restore_input(ctx);
    }
    WgradDeferral* attn_defer = captured(ctx, Region::kAttention) ? nullptr : defer;
    const Tensor dy = branch(grad_or_empty(self_attention_->output_bias()), kSiteAttentionOut,
                             attn_defer == nullptr || tp_.sequence_parallel());
    const Tensor d_ln = self_attention_->backward(dy, ctx, attn_defer);
    input_layernorm_->backward(rows(d_resid), rows(d_ln), rows(x), /*accumulate_dx=*/true, ctx);
  });
}

}  // namespace mt
