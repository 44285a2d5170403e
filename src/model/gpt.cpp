#include "model/gpt.h"

#include <cmath>

#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gelu.h"
#include "ops/layernorm.h"
#include "ops/matmul.h"

namespace mt {

// Saved activations of one decoder layer (what its backward reads).
struct GptModel::LayerActs {
  Tensor ln1_out, ln1_mean, ln1_rstd;  // [s, b, h], fp32 [s·b] x2
  Tensor ctx;                          // attention context [s, b, h]
  Tensor resid1;                       // x + attention branch [s, b, h]
  Tensor ln2_out, ln2_mean, ln2_rstd;  // [s, b, h], fp32 [s·b] x2
  Tensor fc1_pre, fc1_out;             // [s, b, f] before / after GELU
  Tensor out;                          // layer output [s, b, h]
  AttentionBuffers attn;               // q, k, v, probs saved; scratch, dq, dk, dv shared
};

// Scratch shared by all layers and the head.
struct GptModel::Workspace {
  Tensor emb_out;                       // embedding output = layer 0 input [s, b, h]
  Tensor qkv;                           // [s, b, 3h]
  Tensor tmp_h;                         // linear outputs before bias-dropout-add [s, b, h]
  Tensor attn_scratch, dq, dk, dv;
  Tensor d_resid, d_h, d_ln, d_ctx;     // [s, b, h]
  Tensor d_qkv;                         // [s, b, 3h]
  Tensor d_fc1;                         // [s, b, f]
  Tensor lnf_out, lnf_mean, lnf_rstd;   // final norm
  Tensor ce_max, ce_sumexp, ce_target, losses;  // fp32 [s·b]
};

namespace {
std::string layer_prefix(int64_t l) { return fmt::format("decoder.layers.{}.", l); }
}  // namespace

std::vector<ParamSpec> GptModel::param_specs(const GptConfig& c) {
  const int64_t h = c.hidden_size, f = c.ffn(), V = c.padded_vocab_size(), P = c.max_positions();
  const float std = c.init_method_std;
  const float out_std = std / std::sqrt(2.0f * static_cast<float>(c.num_layers));
  std::vector<ParamSpec> s;
  // Order: per module weights first, then biases/norms, so AdamW sees few weight-decay runs.
  s.push_back({"embedding.word_embeddings.weight", {V, h}, InitKind::kNormal, std, true});
  s.push_back({"embedding.position_embeddings.weight", {P, h}, InitKind::kNormal, std, true});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = layer_prefix(l);
    s.push_back({p + "self_attention.linear_qkv.weight", {3 * h, h}, InitKind::kNormal, std, true});
    s.push_back({p + "self_attention.linear_proj.weight", {h, h}, InitKind::kNormal, out_std, true});
    s.push_back({p + "mlp.linear_fc1.weight", {f, h}, InitKind::kNormal, std, true});
    s.push_back({p + "mlp.linear_fc2.weight", {h, f}, InitKind::kNormal, out_std, true});
    s.push_back({p + "input_layernorm.weight", {h}, InitKind::kOnes, 0.f, false});
    s.push_back({p + "input_layernorm.bias", {h}, InitKind::kZeros, 0.f, false});
    s.push_back({p + "self_attention.linear_qkv.bias", {3 * h}, InitKind::kZeros, 0.f, false});
    s.push_back({p + "self_attention.linear_proj.bias", {h}, InitKind::kZeros, 0.f, false});
    s.push_back({p + "pre_mlp_layernorm.weight", {h}, InitKind::kOnes, 0.f, false});
    s.push_back({p + "pre_mlp_layernorm.bias", {h}, InitKind::kZeros, 0.f, false});
    s.push_back({p + "mlp.linear_fc1.bias", {f}, InitKind::kZeros, 0.f, false});
    s.push_back({p + "mlp.linear_fc2.bias", {h}, InitKind::kZeros, 0.f, false});
  }
  s.push_back({"decoder.final_layernorm.weight", {h}, InitKind::kOnes, 0.f, false});
  s.push_back({"decoder.final_layernorm.bias", {h}, InitKind::kZeros, 0.f, false});
  return s;
}

GptModel::GptModel(const GptConfig& config, int64_t micro_batch, DType dtype, Device device, ProcessGroups groups)
    : config_(config),
      b_(micro_batch),
      s_(config.seq_length),
      h_(config.hidden_size),
      n_(config.num_attention_heads),
      d_(config.head_dim()),
      f_(config.ffn()),
      V_(config.padded_vocab_size()),
      dtype_(dtype),
      device_(device),
      groups_(std::move(groups)),
      arena_(Arena::planning(device)) {
  config_.validate(1);
  MT_REQUIRE(micro_batch > 0, "--micro-batch-size must be positive, got {}", micro_batch);
  MT_REQUIRE(device.is_cuda() || dtype == DType::kF32, "{} training needs --device cuda (the CPU backend is fp32)",
             dtype_name(dtype));
  params_ = std::make_unique<ParamStore>(param_specs(config_), dtype, device);
  ws_ = std::make_unique<Workspace>();
  layers_.resize(static_cast<size_t>(config_.num_layers));
  plan(arena_);
  arena_bytes_ = arena_.peak();
  arena_.materialize();
  plan(arena_);
}

GptModel::~GptModel() = default;

void GptModel::plan(Arena& a) {
  a.reset();
  const DType t = dtype_;
  const DType f32 = DType::kF32;
  const int64_t T = s_ * b_;
  auto& w = *ws_;
  w.emb_out = a.alloc(t, {s_, b_, h_}, "emb_out");
  for (auto& L : layers_) {
    L.ln1_out = a.alloc(t, {s_, b_, h_}, "ln1_out");
    L.ln1_mean = a.alloc(f32, {T}, "ln1_mean");
    L.ln1_rstd = a.alloc(f32, {T}, "ln1_rstd");
    L.ctx = a.alloc(t, {s_, b_, h_}, "ctx");
    L.resid1 = a.alloc(t, {s_, b_, h_}, "resid1");
    L.ln2_out = a.alloc(t, {s_, b_, h_}, "ln2_out");
    L.ln2_mean = a.alloc(f32, {T}, "ln2_mean");
    L.ln2_rstd = a.alloc(f32, {T}, "ln2_rstd");
    L.fc1_pre = a.alloc(t, {s_, b_, f_}, "fc1_pre");
    L.fc1_out = a.alloc(t, {s_, b_, f_}, "fc1_out");
    L.out = a.alloc(t, {s_, b_, h_}, "out");
    L.attn.q = a.alloc(t, {b_, n_, s_, d_}, "q");
    L.attn.k = a.alloc(t, {b_, n_, s_, d_}, "k");
    L.attn.v = a.alloc(t, {b_, n_, s_, d_}, "v");
    L.attn.probs = a.alloc(t, {b_, n_, s_, s_}, "probs");
  }
  w.qkv = a.alloc(t, {s_, b_, 3 * h_}, "qkv");
  w.tmp_h = a.alloc(t, {s_, b_, h_}, "tmp_h");
  w.attn_scratch = a.alloc(t, {b_, n_, s_, s_}, "attn_scratch");
  w.dq = a.alloc(t, {b_, n_, s_, d_}, "dq");
  w.dk = a.alloc(t, {b_, n_, s_, d_}, "dk");
  w.dv = a.alloc(t, {b_, n_, s_, d_}, "dv");
  w.d_resid = a.alloc(t, {s_, b_, h_}, "d_resid");
  w.d_h = a.alloc(t, {s_, b_, h_}, "d_h");
  w.d_ln = a.alloc(t, {s_, b_, h_}, "d_ln");
  w.d_ctx = a.alloc(t, {s_, b_, h_}, "d_ctx");
  w.d_qkv = a.alloc(t, {s_, b_, 3 * h_}, "d_qkv");
  w.d_fc1 = a.alloc(t, {s_, b_, f_}, "d_fc1");
  w.lnf_out = a.alloc(t, {s_, b_, h_}, "lnf_out");
  w.lnf_mean = a.alloc(f32, {T}, "lnf_mean");
  w.lnf_rstd = a.alloc(f32, {T}, "lnf_rstd");
  w.ce_max = a.alloc(f32, {T}, "ce_max");
  w.ce_sumexp = a.alloc(f32, {T}, "ce_sumexp");
  w.ce_target = a.alloc(f32, {T}, "ce_target");
  w.losses = a.alloc(f32, {T}, "losses");
  logits_ = a.alloc(t, {T, V_}, "logits");
  for (auto& L : layers_) {
    L.attn.scratch = w.attn_scratch;
    L.attn.dq = w.dq;
    L.attn.dk = w.dk;
    L.attn.dv = w.dv;
  }
}

AttentionConfig GptModel::attention_config(int64_t layer, const DropoutContext& dc) const {
  AttentionConfig c;
  c.seq = s_;
  c.batch = b_;
  c.heads = n_;
  c.head_dim = d_;
  c.softmax_scale = 1.0f / std::sqrt(static_cast<float>(d_));
  c.dropout_p = dc.training ? config_.attention_dropout : 0.f;
  c.dropout_key = {dc.seed, dc.iteration, dc.microbatch, dropout_stream_id(layer, kSiteAttentionProbs)};
  c.head_offset = 0;
  c.total_heads = n_;
  return c;
}

namespace {
DropoutKey key_for(const DropoutContext& dc, int64_t layer, DropoutSite site) {
  return {dc.seed, dc.iteration, dc.microbatch, dropout_stream_id(layer, site)};
}
Tensor rows(const Tensor& t) { return t.view({t.numel() / t.size(-1), t.size(-1)}); }
}  // namespace

void GptModel::layer_forward(int64_t l, const Tensor& x, LayerActs& a, const DropoutContext& dc,
                             const Stream& st) {
  const ParamStore& P = *params_;
  const std::string p = layer_prefix(l);
  const float pd = dc.training ? config_.hidden_dropout : 0.f;
  auto& w = *ws_;
  // --- self-attention block ---
  layernorm_forward(rows(a.ln1_out), a.ln1_mean, a.ln1_rstd, rows(x), P.param(p + "input_layernorm.weight"),
                    P.param(p + "input_layernorm.bias"), config_.layernorm_epsilon, st);
  // ColumnParallelLinear (f = copy_to_tensor_model_parallel_region: identity forward).
  linear_forward(rows(w.qkv), rows(a.ln1_out), P.param(p + "self_attention.linear_qkv.weight"),
                 P.param(p + "self_attention.linear_qkv.bias"), Tensor(), st);
  attention_forward(a.ctx, w.qkv, a.attn, attention_config(l, dc), st);
  // RowParallelLinear with skip_bias_add: bias added once after g (reduce_from_tp_region).
  linear_forward(rows(w.tmp_h), rows(a.ctx), P.param(p + "self_attention.linear_proj.weight"), Tensor(), Tensor(),
                 st);
  groups_.tp->all_reduce(w.tmp_h, ReduceOp::kSum, st);
  bias_dropout_add_forward(rows(a.resid1), rows(w.tmp_h), P.param(p + "self_attention.linear_proj.bias"), rows(x),
                           pd, key_for(dc, l, kSiteAttentionOut), 0, st);
  // --- MLP block ---
  layernorm_forward(rows(a.ln2_out), a.ln2_mean, a.ln2_rstd, rows(a.resid1), P.param(p + "pre_mlp_layernorm.weight"),
                    P.param(p + "pre_mlp_layernorm.bias"), config_.layernorm_epsilon, st);
  linear_forward(rows(a.fc1_out), rows(a.ln2_out), P.param(p + "mlp.linear_fc1.weight"),
                 P.param(p + "mlp.linear_fc1.bias"), rows(a.fc1_pre), st);
  linear_forward(rows(w.tmp_h), rows(a.fc1_out), P.param(p + "mlp.linear_fc2.weight"), Tensor(), Tensor(), st);
  groups_.tp->all_reduce(w.tmp_h, ReduceOp::kSum, st);
  bias_dropout_add_forward(rows(a.out), rows(w.tmp_h), P.param(p + "mlp.linear_fc2.bias"), rows(a.resid1), pd,
                           key_for(dc, l, kSiteMlpOut), 0, st);
}

void GptModel::layer_backward(int64_t l, const Tensor& x, LayerActs& a, const Tensor& d_resid,
                              const DropoutContext& dc, const Stream& st) {
  // On entry d_resid = dL/d(out); on exit d_resid = dL/dx. Activation grads overwrite except
  // the residual stream, into which the LayerNorm backward accumulates.
  const ParamStore& P = *params_;
  const std::string p = layer_prefix(l);
  const float pd = dc.training ? config_.hidden_dropout : 0.f;
  auto& w = *ws_;
  // --- MLP block: out = resid1 + dropout(fc2(gelu(fc1(ln2(resid1)))) + b2) ---
  bias_dropout_add_backward(rows(w.d_h), P.grad(p + "mlp.linear_fc2.bias"), rows(d_resid), pd,
                            key_for(dc, l, kSiteMlpOut), 0, st);
  linear_backward(rows(w.d_fc1), P.grad(p + "mlp.linear_fc2.weight"), Tensor(), rows(w.d_h), rows(a.fc1_out),
                  P.param(p + "mlp.linear_fc2.weight"), st);
  gelu_backward(w.d_fc1, w.d_fc1, a.fc1_pre, st);
  linear_backward(rows(w.d_ln), P.grad(p + "mlp.linear_fc1.weight"), P.grad(p + "mlp.linear_fc1.bias"),
                  rows(w.d_fc1), rows(a.ln2_out), P.param(p + "mlp.linear_fc1.weight"), st);
  groups_.tp->all_reduce(w.d_ln, ReduceOp::kSum, st);  // f backward
  layernorm_backward(rows(d_resid), P.grad(p + "pre_mlp_layernorm.weight"), P.grad(p + "pre_mlp_layernorm.bias"),
                     rows(w.d_ln), rows(a.resid1), P.param(p + "pre_mlp_layernorm.weight"), a.ln2_mean, a.ln2_rstd,
                     /*accumulate_dx=*/true, st);
  // --- attention block: resid1 = x + dropout(proj(attn(qkv(ln1(x)))) + bp) ---
  bias_dropout_add_backward(rows(w.d_h), P.grad(p + "self_attention.linear_proj.bias"), rows(d_resid), pd,
                            key_for(dc, l, kSiteAttentionOut), 0, st);
  linear_backward(rows(w.d_ctx), P.grad(p + "self_attention.linear_proj.weight"), Tensor(), rows(w.d_h), rows(a.ctx),
                  P.param(p + "self_attention.linear_proj.weight"), st);
  attention_backward(w.d_qkv, w.d_ctx, a.attn, attention_config(l, dc), st);
  linear_backward(rows(w.d_ln), P.grad(p + "self_attention.linear_qkv.weight"),
                  P.grad(p + "self_attention.linear_qkv.bias"), rows(w.d_qkv), rows(a.ln1_out),
                  P.param(p + "self_attention.linear_qkv.weight"), st);
  groups_.tp->all_reduce(w.d_ln, ReduceOp::kSum, st);
  layernorm_backward(rows(d_resid), P.grad(p + "input_layernorm.weight"), P.grad(p + "input_layernorm.bias"),
                     rows(w.d_ln), rows(x), P.param(p + "input_layernorm.weight"), a.ln1_mean, a.ln1_rstd,
                     /*accumulate_dx=*/true, st);
}

void GptModel::forward(const MicroBatch& mb, const DropoutContext& dc, const Tensor& loss_accum, float loss_weight,
                       const Stream& st, bool compute_loss) {
  check_tensor(mb.tokens, DType::kI32, {s_, b_}, "tokens");
  const ParamStore& P = *params_;
  auto& w = *ws_;
  const Tensor wte = P.param("embedding.word_embeddings.weight");
  embedding_forward(w.emb_out, mb.tokens, wte, P.param("embedding.position_embeddings.weight"), Tensor(), 0, st);
  if (dc.training && config_.hidden_dropout > 0.f)
    dropout_forward(w.emb_out, w.emb_out, config_.hidden_dropout, key_for(dc, -1, kSiteEmbedding), 0, st);
  Tensor x = w.emb_out;
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    layer_forward(l, x, layers_[l], dc, st);
    x = layers_[l].out;
  }
  layernorm_forward(rows(w.lnf_out), w.lnf_mean, w.lnf_rstd, rows(x), P.param("decoder.final_layernorm.weight"),
                    P.param("decoder.final_layernorm.bias"), config_.layernorm_epsilon, st);
  // Output layer tied to the word embedding: logits = lnf_out · wte^T.
  linear_forward(logits_, rows(w.lnf_out), wte, Tensor(), Tensor(), st);
  if (!compute_loss) return;
  check_tensor(mb.labels, DType::kI32, {s_, b_}, "labels");
  const Tensor labels = mb.labels.view({s_ * b_});
  const Tensor mask = mb.loss_mask.empty() ? Tensor() : mb.loss_mask.view({s_ * b_});
  cross_entropy_stats(w.ce_max, w.ce_sumexp, w.ce_target, logits_, labels, 0, st);
  cross_entropy_loss(w.losses, w.ce_max, w.ce_sumexp, w.ce_target, mask, st);
  sum_accumulate(loss_accum, w.losses, loss_weight, st);
}

void GptModel::backward(const MicroBatch& mb, const DropoutContext& dc, float grad_scale, const Tensor& loss_scale,
                        const Stream& st) {
  ParamStore& P = *params_;
  auto& w = *ws_;
  const Tensor labels = mb.labels.view({s_ * b_});
  const Tensor mask = mb.loss_mask.empty() ? Tensor() : mb.loss_mask.view({s_ * b_});
  cross_entropy_backward_inplace(logits_, labels, w.ce_max, w.ce_sumexp, mask, 0, grad_scale, loss_scale, st);
  const Tensor dlogits = logits_;
  const Tensor wte = P.param("embedding.word_embeddings.weight");
  const Tensor dwte = P.grad("embedding.word_embeddings.weight");
  linear_backward(rows(w.d_ln), dwte, Tensor(), dlogits, rows(w.lnf_out), wte, st);
  const Tensor x_last = layers_.back().out;
  layernorm_backward(rows(w.d_resid), P.grad("decoder.final_layernorm.weight"), P.grad("decoder.final_layernorm.bias"),
                     rows(w.d_ln), rows(x_last), P.param("decoder.final_layernorm.weight"), w.lnf_mean, w.lnf_rstd,
                     /*accumulate_dx=*/false, st);
  for (int64_t l = config_.num_layers - 1; l >= 0; --l) {
    const Tensor x = l == 0 ? w.emb_out : layers_[l - 1].out;
    layer_backward(l, x, layers_[l], w.d_resid, dc, st);
  }
  if (dc.training && config_.hidden_dropout > 0.f)
    dropout_forward(w.d_resid, w.d_resid, config_.hidden_dropout, key_for(dc, -1, kSiteEmbedding), 0, st);
  embedding_backward(dwte, P.grad("embedding.position_embeddings.weight"), w.d_resid, mb.tokens, Tensor(), 0, st);
}

}  // namespace mt
