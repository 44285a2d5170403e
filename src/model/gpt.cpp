#include "model/gpt.h"

#include <cmath>

#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gelu.h"
#include "ops/layernorm.h"
#include "ops/matmul.h"

namespace mt {

// Shapes below: s_l = local sequence (s / tp with sequence parallelism, else s); n_l, f_l, V_l
// = heads, ffn and vocabulary on this TP rank.
//
// Saved activations of one decoder layer (what its backward reads).
struct GptModel::LayerActs {
  Tensor ln1_out, ln1_mean, ln1_rstd;  // [s_l, b, h], fp32 [s_l·b] x2
  Tensor ln1_full;                     // [s, b, h]: ln1_out all-gathered (== ln1_out without SP)
  Tensor ctx;                          // attention context [s, b, n_l·d]
  Tensor resid1;                       // x + attention branch [s_l, b, h]
  Tensor ln2_out, ln2_mean, ln2_rstd;  // [s_l, b, h], fp32 [s_l·b] x2
  Tensor ln2_full;                     // [s, b, h]
  Tensor fc1_pre, fc1_out;             // [s, b, f_l] before / after GELU
  Tensor out;                          // layer output [s_l, b, h]
  AttentionBuffers attn;               // q, k, v, probs saved; scratch, dq, dk, dv shared
};

// Scratch shared by all layers and the head.
struct GptModel::Workspace {
  Tensor emb_full;                      // word + position embedding [s, b, h] (partial over TP)
  Tensor emb_out;                       // layer 0 input [s_l, b, h]
  Tensor qkv;                           // [s, b, 3·n_l·d]
  Tensor tmp_full;                      // row-parallel outputs before the TP reduction [s, b, h]
  Tensor tmp_h;                         // after the reduction [s_l, b, h] (== tmp_full without SP)
  Tensor attn_scratch, dq, dk, dv;
  Tensor d_resid, d_h;                  // [s_l, b, h]
  Tensor d_h_full;                      // [s, b, h] (== d_h without SP)
  Tensor d_ln_full;                     // [s, b, h]
  Tensor d_ln;                          // [s_l, b, h] (== d_ln_full without SP)
  Tensor d_ctx;                         // [s, b, n_l·d]
  Tensor d_qkv;                         // [s, b, 3·n_l·d]
  Tensor d_fc1;                         // [s, b, f_l]
  Tensor lnf_out, lnf_mean, lnf_rstd;   // final norm [s_l, b, h]
  Tensor lnf_full;                      // [s, b, h]
  Tensor ce_max, ce_local_max, ce_sumexp, ce_target, losses;  // fp32 [s·b]
};

namespace {
std::string layer_prefix(int64_t l) { return fmt::format("decoder.layers.{}.", l); }

ParamSpec column_parallel(std::string name, int64_t rows, int64_t cols, float std, int tp, int r, bool wd) {
  ParamSpec p{std::move(name), {rows / tp, cols}, InitKind::kNormal, std, wd};
  p.global_shape = {rows, cols};
  p.shard = {r * (rows / tp), 0, cols};
  p.tensor_parallel = tp > 1;
  return p;
}
ParamSpec row_parallel(std::string name, int64_t rows, int64_t cols, float std, int tp, int r) {
  ParamSpec p{std::move(name), {rows, cols / tp}, InitKind::kNormal, std, true};
  p.global_shape = {rows, cols};
  p.shard = {0, r * (cols / tp), cols};
  p.tensor_parallel = tp > 1;
  return p;
}
ParamSpec column_bias(std::string name, int64_t n, int tp, int r) {
  ParamSpec p{std::move(name), {n / tp}, InitKind::kZeros, 0.f, false};
  p.global_shape = {n};
  p.shard = {0, r * (n / tp), n};
  p.tensor_parallel = tp > 1;
  return p;
}
ParamSpec replicated(std::string name, int64_t n, InitKind init) {
  ParamSpec p{std::move(name), {n}, init, 0.f, false};
  p.sequence_parallel_grad = true;
  return p;
}
}  // namespace

std::vector<ParamSpec> GptModel::param_specs(const GptConfig& c, int tp, int r) {
  const int64_t h = c.hidden_size, f = c.ffn(), V = c.padded_vocab_size(tp), P = c.max_positions();
  const float std = c.init_method_std;
  const float out_std = std / std::sqrt(2.0f * static_cast<float>(c.num_layers));
  std::vector<ParamSpec> s;
  // Order: per layer TP-split weights, TP-split biases, then replicated parameters, so AdamW and
  // the gradient norm see few runs.
  s.push_back(column_parallel("embedding.word_embeddings.weight", V, h, std, tp, r, true));
  s.push_back({"embedding.position_embeddings.weight", {P, h}, InitKind::kNormal, std, true});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = layer_prefix(l);
    s.push_back(column_parallel(p + "self_attention.linear_qkv.weight", 3 * h, h, std, tp, r, true));
    s.push_back(row_parallel(p + "self_attention.linear_proj.weight", h, h, out_std, tp, r));
    s.push_back(column_parallel(p + "mlp.linear_fc1.weight", f, h, std, tp, r, true));
    s.push_back(row_parallel(p + "mlp.linear_fc2.weight", h, f, out_std, tp, r));
    s.push_back(column_bias(p + "self_attention.linear_qkv.bias", 3 * h, tp, r));
    s.push_back(column_bias(p + "mlp.linear_fc1.bias", f, tp, r));
    s.push_back(replicated(p + "input_layernorm.weight", h, InitKind::kOnes));
    s.push_back(replicated(p + "input_layernorm.bias", h, InitKind::kZeros));
    s.push_back(replicated(p + "self_attention.linear_proj.bias", h, InitKind::kZeros));
    s.push_back(replicated(p + "pre_mlp_layernorm.weight", h, InitKind::kOnes));
    s.push_back(replicated(p + "pre_mlp_layernorm.bias", h, InitKind::kZeros));
    s.push_back(replicated(p + "mlp.linear_fc2.bias", h, InitKind::kZeros));
  }
  s.push_back(replicated("decoder.final_layernorm.weight", h, InitKind::kOnes));
  s.push_back(replicated("decoder.final_layernorm.bias", h, InitKind::kZeros));
  return s;
}

GptModel::GptModel(const GptConfig& config, int64_t micro_batch, DType dtype, Device device, ProcessGroups groups,
                   bool sequence_parallel, int64_t pad_multiple)
    : config_(config),
      b_(micro_batch),
      s_(config.seq_length),
      h_(config.hidden_size),
      n_(config.num_attention_heads),
      d_(config.head_dim()),
      f_(config.ffn()),
      dtype_(dtype),
      device_(device),
      groups_(std::move(groups)),
      arena_(Arena::planning(device)) {
  tp_ = groups_.tp->size();
  tp_rank_ = groups_.tp->rank();
  sp_ = sequence_parallel && tp_ > 1;
  config_.validate(tp_);
  V_ = config_.padded_vocab_size(tp_);
  MT_REQUIRE(!sp_ || s_ % tp_ == 0, "--sequence-parallel needs --seq-length {} divisible by tensor parallel size {}",
             s_, tp_);
  sl_ = sp_ ? s_ / tp_ : s_;
  nl_ = n_ / tp_;
  fl_ = f_ / tp_;
  Vl_ = V_ / tp_;
  MT_REQUIRE(micro_batch > 0, "--micro-batch-size must be positive, got {}", micro_batch);
  MT_REQUIRE(device.is_cuda() || dtype == DType::kF32, "{} training needs --device cuda (the CPU backend is fp32)",
             dtype_name(dtype));
  params_ = std::make_unique<ParamStore>(param_specs(config_, tp_, tp_rank_), dtype, device, pad_multiple);
  if (sp_) sp_grad_ranges_ = params_->ranges([](const ParamInfo& p) { return p.sequence_parallel_grad; });
  // Parameter indices resolved once, so the step does no name lookups.
  const ParamStore& P = *params_;
  gix_ = {P.index("embedding.word_embeddings.weight"), P.index("embedding.position_embeddings.weight"),
          P.index("decoder.final_layernorm.weight"), P.index("decoder.final_layernorm.bias")};
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    const std::string p = layer_prefix(l);
    auto at = [&](const char* n) { return P.index(p + n); };
    layer_params_.push_back({at("input_layernorm.weight"), at("input_layernorm.bias"),
                             at("self_attention.linear_qkv.weight"), at("self_attention.linear_qkv.bias"),
                             at("self_attention.linear_proj.weight"), at("self_attention.linear_proj.bias"),
                             at("pre_mlp_layernorm.weight"), at("pre_mlp_layernorm.bias"),
                             at("mlp.linear_fc1.weight"), at("mlp.linear_fc1.bias"), at("mlp.linear_fc2.weight"),
                             at("mlp.linear_fc2.bias")});
  }
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
  const int64_t T = s_ * b_, Tl = sl_ * b_;
  auto& w = *ws_;
  // Without sequence parallelism the "full" and local tensors are the same memory.
  auto local_or_full = [&](const Tensor& full, const char* what) {
    return sp_ ? a.alloc(t, {sl_, b_, h_}, what) : full;
  };
  w.emb_full = a.alloc(t, {s_, b_, h_}, "emb_full");
  w.emb_out = local_or_full(w.emb_full, "emb_out");
  for (auto& L : layers_) {
    L.ln1_full = a.alloc(t, {s_, b_, h_}, "ln1_full");
    L.ln1_out = local_or_full(L.ln1_full, "ln1_out");
    L.ln1_mean = a.alloc(f32, {Tl}, "ln1_mean");
    L.ln1_rstd = a.alloc(f32, {Tl}, "ln1_rstd");
    L.ctx = a.alloc(t, {s_, b_, nl_ * d_}, "ctx");
    L.resid1 = a.alloc(t, {sl_, b_, h_}, "resid1");
    L.ln2_full = a.alloc(t, {s_, b_, h_}, "ln2_full");
    L.ln2_out = local_or_full(L.ln2_full, "ln2_out");
    L.ln2_mean = a.alloc(f32, {Tl}, "ln2_mean");
    L.ln2_rstd = a.alloc(f32, {Tl}, "ln2_rstd");
    L.fc1_pre = a.alloc(t, {s_, b_, fl_}, "fc1_pre");
    L.fc1_out = a.alloc(t, {s_, b_, fl_}, "fc1_out");
    L.out = a.alloc(t, {sl_, b_, h_}, "out");
    L.attn.q = a.alloc(t, {b_, nl_, s_, d_}, "q");
    L.attn.k = a.alloc(t, {b_, nl_, s_, d_}, "k");
    L.attn.v = a.alloc(t, {b_, nl_, s_, d_}, "v");
    L.attn.probs = a.alloc(t, {b_, nl_, s_, s_}, "probs");
  }
  w.qkv = a.alloc(t, {s_, b_, 3 * nl_ * d_}, "qkv");
  w.tmp_full = a.alloc(t, {s_, b_, h_}, "tmp_full");
  w.tmp_h = local_or_full(w.tmp_full, "tmp_h");
  w.attn_scratch = a.alloc(t, {b_, nl_, s_, s_}, "attn_scratch");
  w.dq = a.alloc(t, {b_, nl_, s_, d_}, "dq");
  w.dk = a.alloc(t, {b_, nl_, s_, d_}, "dk");
  w.dv = a.alloc(t, {b_, nl_, s_, d_}, "dv");
  w.d_resid = a.alloc(t, {sl_, b_, h_}, "d_resid");
  w.d_h_full = a.alloc(t, {s_, b_, h_}, "d_h_full");
  w.d_h = local_or_full(w.d_h_full, "d_h");
  w.d_ln_full = a.alloc(t, {s_, b_, h_}, "d_ln_full");
  w.d_ln = local_or_full(w.d_ln_full, "d_ln");
  w.d_ctx = a.alloc(t, {s_, b_, nl_ * d_}, "d_ctx");
  w.d_qkv = a.alloc(t, {s_, b_, 3 * nl_ * d_}, "d_qkv");
  w.d_fc1 = a.alloc(t, {s_, b_, fl_}, "d_fc1");
  w.lnf_full = a.alloc(t, {s_, b_, h_}, "lnf_full");
  w.lnf_out = local_or_full(w.lnf_full, "lnf_out");
  w.lnf_mean = a.alloc(f32, {Tl}, "lnf_mean");
  w.lnf_rstd = a.alloc(f32, {Tl}, "lnf_rstd");
  w.ce_max = a.alloc(f32, {T}, "ce_max");
  w.ce_local_max = a.alloc(f32, {T}, "ce_local_max");
  w.ce_sumexp = a.alloc(f32, {T}, "ce_sumexp");
  w.ce_target = a.alloc(f32, {T}, "ce_target");
  w.losses = a.alloc(f32, {T}, "losses");
  logits_ = a.alloc(t, {T, Vl_}, "logits");
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
  c.heads = nl_;
  c.head_dim = d_;
  c.softmax_scale = 1.0f / std::sqrt(static_cast<float>(d_));
  c.dropout_p = dc.training ? config_.attention_dropout : 0.f;
  c.dropout_key = {dc.seed, dc.iteration, dc.microbatch, dropout_stream_id(layer, kSiteAttentionProbs)};
  c.head_offset = tp_rank_ * nl_;
  c.total_heads = n_;
  c.doc_start = doc_start_;
  return c;
}

namespace {
DropoutKey key_for(const DropoutContext& dc, int64_t layer, DropoutSite site) {
  return {dc.seed, dc.iteration, dc.microbatch, dropout_stream_id(layer, site)};
}
Tensor rows(const Tensor& t) { return t.view({t.numel() / t.size(-1), t.size(-1)}); }
}  // namespace

// The conjugate TP operators (Megatron tensor_parallel/mappings.py). Without sequence
// parallelism: f = identity forward / all-reduce backward, g = all-reduce forward / identity
// backward. With it: all-gather along s before a TP region, reduce-scatter after it.
namespace {
void gather_to_tp_region(Communicator& tp, bool sp, const Tensor& full, const Tensor& local, const Stream& st) {
  if (sp) tp.all_gather(full, local, st);  // else full and local are the same memory
}
void reduce_from_tp_region(Communicator& tp, bool sp, const Tensor& local, const Tensor& full, const Stream& st) {
  if (sp) {
    tp.reduce_scatter(local, full, ReduceOp::kSum, st);
  } else {
    tp.all_reduce(full, ReduceOp::kSum, st);
  }
}
}  // namespace

void GptModel::layer_forward(int64_t l, const Tensor& x, LayerActs& a, const DropoutContext& dc,
                             const Stream& st) {
  const ParamStore& P = *params_;
  const LayerParamIndex& ix = layer_params_[static_cast<size_t>(l)];
  const float pd = dc.training ? config_.hidden_dropout : 0.f;
  const int64_t drop_off = sp_ ? tp_rank_ * sl_ * b_ * h_ : 0;  // global index of this shard
  Communicator& tp = *groups_.tp;
  auto& w = *ws_;
  // --- self-attention block ---
  layernorm_forward(rows(a.ln1_out), a.ln1_mean, a.ln1_rstd, rows(x), P.param(ix.ln1_w),
                    P.param(ix.ln1_b), config_.layernorm_epsilon, st);
  gather_to_tp_region(tp, sp_, a.ln1_full, a.ln1_out, st);
  // ColumnParallelLinear.
  linear_forward(rows(w.qkv), rows(a.ln1_full), P.param(ix.qkv_w),
                 P.param(ix.qkv_b), Tensor(), st);
  attention_forward(a.ctx, w.qkv, a.attn, attention_config(l, dc), st);
  // RowParallelLinear with skip_bias_add: the bias is added once, after the reduction.
  linear_forward(rows(w.tmp_full), rows(a.ctx), P.param(ix.proj_w), Tensor(), Tensor(),
                 st);
  reduce_from_tp_region(tp, sp_, w.tmp_h, w.tmp_full, st);
  bias_dropout_add_forward(rows(a.resid1), rows(w.tmp_h), P.param(ix.proj_b), rows(x),
                           pd, key_for(dc, l, kSiteAttentionOut), drop_off, st);
  // --- MLP block ---
  layernorm_forward(rows(a.ln2_out), a.ln2_mean, a.ln2_rstd, rows(a.resid1), P.param(ix.ln2_w),
                    P.param(ix.ln2_b), config_.layernorm_epsilon, st);
  gather_to_tp_region(tp, sp_, a.ln2_full, a.ln2_out, st);
  linear_forward(rows(a.fc1_out), rows(a.ln2_full), P.param(ix.fc1_w),
                 P.param(ix.fc1_b), rows(a.fc1_pre), st);
  linear_forward(rows(w.tmp_full), rows(a.fc1_out), P.param(ix.fc2_w), Tensor(), Tensor(), st);
  reduce_from_tp_region(tp, sp_, w.tmp_h, w.tmp_full, st);
  bias_dropout_add_forward(rows(a.out), rows(w.tmp_h), P.param(ix.fc2_b), rows(a.resid1), pd,
                           key_for(dc, l, kSiteMlpOut), drop_off, st);
}

void GptModel::layer_backward(int64_t l, const Tensor& x, LayerActs& a, const Tensor& d_resid,
                              const DropoutContext& dc, const Stream& st) {
  // On entry d_resid = dL/d(out); on exit d_resid = dL/dx. Activation grads overwrite except
  // the residual stream, into which the LayerNorm backward accumulates.
  const ParamStore& P = *params_;
  const LayerParamIndex& ix = layer_params_[static_cast<size_t>(l)];
  const float pd = dc.training ? config_.hidden_dropout : 0.f;
  const int64_t drop_off = sp_ ? tp_rank_ * sl_ * b_ * h_ : 0;
  Communicator& tp = *groups_.tp;
  auto& w = *ws_;
  // --- MLP block: out = resid1 + dropout(fc2(gelu(fc1(ln2(resid1)))) + b2) ---
  bias_dropout_add_backward(rows(w.d_h), P.grad(ix.fc2_b), rows(d_resid), pd,
                            key_for(dc, l, kSiteMlpOut), drop_off, st);
  gather_to_tp_region(tp, sp_, w.d_h_full, w.d_h, st);  // backward of the reduce-scatter
  linear_backward(rows(w.d_fc1), P.grad(ix.fc2_w), Tensor(), rows(w.d_h_full), rows(a.fc1_out),
                  P.param(ix.fc2_w), st);
  gelu_backward(w.d_fc1, w.d_fc1, a.fc1_pre, st);
  linear_backward(rows(w.d_ln_full), P.grad(ix.fc1_w), P.grad(ix.fc1_b),
                  rows(w.d_fc1), rows(a.ln2_full), P.param(ix.fc1_w), st);
  reduce_from_tp_region(tp, sp_, w.d_ln, w.d_ln_full, st);  // backward of f / the all-gather
  layernorm_backward(rows(d_resid), P.grad(ix.ln2_w), P.grad(ix.ln2_b),
                     rows(w.d_ln), rows(a.resid1), P.param(ix.ln2_w), a.ln2_mean, a.ln2_rstd,
                     /*accumulate_dx=*/true, st);
  // --- attention block: resid1 = x + dropout(proj(attn(qkv(ln1(x)))) + bp) ---
  bias_dropout_add_backward(rows(w.d_h), P.grad(ix.proj_b), rows(d_resid), pd,
                            key_for(dc, l, kSiteAttentionOut), drop_off, st);
  gather_to_tp_region(tp, sp_, w.d_h_full, w.d_h, st);
  linear_backward(rows(w.d_ctx), P.grad(ix.proj_w), Tensor(), rows(w.d_h_full),
                  rows(a.ctx), P.param(ix.proj_w), st);
  attention_backward(w.d_qkv, w.d_ctx, a.attn, attention_config(l, dc), st);
  linear_backward(rows(w.d_ln_full), P.grad(ix.qkv_w),
                  P.grad(ix.qkv_b), rows(w.d_qkv), rows(a.ln1_full),
                  P.param(ix.qkv_w), st);
  reduce_from_tp_region(tp, sp_, w.d_ln, w.d_ln_full, st);
  layernorm_backward(rows(d_resid), P.grad(ix.ln1_w), P.grad(ix.ln1_b),
                     rows(w.d_ln), rows(x), P.param(ix.ln1_w), a.ln1_mean, a.ln1_rstd,
                     /*accumulate_dx=*/true, st);
}

void GptModel::forward(const MicroBatch& mb, const DropoutContext& dc, const Tensor& loss_accum, float loss_weight,
                       const Stream& st, bool compute_loss) {
  check_tensor(mb.tokens, DType::kI32, {s_, b_}, "tokens");
  const ParamStore& P = *params_;
  Communicator& tp = *groups_.tp;
  auto& w = *ws_;
  const int64_t vocab_start = tp_rank_ * Vl_;
  const Tensor wte = P.param(gix_.wte);
  // VocabParallelEmbedding: rows outside this rank's vocabulary shard are zero; the position
  // embedding is added on TP rank 0 only, so the reduction over TP adds it once.
  embedding_forward(w.emb_full, mb.tokens, wte, tp_rank_ == 0 ? P.param(gix_.wpe) : Tensor(),
                    mb.position_ids, vocab_start, st);
  doc_start_ = mb.doc_start;
  reduce_from_tp_region(tp, sp_, w.emb_out, w.emb_full, st);
  if (dc.training && config_.hidden_dropout > 0.f)
    dropout_forward(w.emb_out, w.emb_out, config_.hidden_dropout, key_for(dc, -1, kSiteEmbedding),
                    sp_ ? tp_rank_ * sl_ * b_ * h_ : 0, st);
  Tensor x = w.emb_out;
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    layer_forward(l, x, layers_[l], dc, st);
    x = layers_[l].out;
  }
  layernorm_forward(rows(w.lnf_out), w.lnf_mean, w.lnf_rstd, rows(x), P.param(gix_.lnf_w),
                    P.param(gix_.lnf_b), config_.layernorm_epsilon, st);
  gather_to_tp_region(tp, sp_, w.lnf_full, w.lnf_out, st);
  // Output layer tied to the word embedding (column-parallel over the vocabulary).
  linear_forward(logits_, rows(w.lnf_full), wte, Tensor(), Tensor(), st);
  if (!compute_loss) return;
  check_tensor(mb.labels, DType::kI32, {s_, b_}, "labels");
  const Tensor labels = mb.labels.view({s_ * b_});
  const Tensor mask = mb.loss_mask.empty() ? Tensor() : mb.loss_mask.view({s_ * b_});
  if (tp_ == 1) {
    cross_entropy_stats(w.ce_max, w.ce_sumexp, w.ce_target, logits_, labels, 0, st);
  } else {
    // Vocab-parallel cross entropy: three all-reduces of s·b values, never of s·b·V.
    cross_entropy_stats(w.ce_local_max, w.ce_sumexp, w.ce_target, logits_, labels, vocab_start, st);
    copy(w.ce_max, w.ce_local_max, st);
    tp.all_reduce(w.ce_max, ReduceOp::kMax, st);
    cross_entropy_rescale_sumexp(w.ce_sumexp, w.ce_local_max, w.ce_max, st);
    tp.all_reduce(w.ce_sumexp, ReduceOp::kSum, st);
    tp.all_reduce(w.ce_target, ReduceOp::kSum, st);
  }
  cross_entropy_loss(w.losses, w.ce_max, w.ce_sumexp, w.ce_target, mask, st);
  sum_accumulate(loss_accum, w.losses, loss_weight, st);
}

void GptModel::backward(const MicroBatch& mb, const DropoutContext& dc, float grad_scale, const Tensor& loss_scale,
                        const Stream& st) {
  ParamStore& P = *params_;
  Communicator& tp = *groups_.tp;
  auto& w = *ws_;
  const int64_t vocab_start = tp_rank_ * Vl_;
  const Tensor labels = mb.labels.view({s_ * b_});
  const Tensor mask = mb.loss_mask.empty() ? Tensor() : mb.loss_mask.view({s_ * b_});
  cross_entropy_backward_inplace(logits_, labels, w.ce_max, w.ce_sumexp, mask, vocab_start, grad_scale, loss_scale,
                                 st);
  const Tensor dlogits = logits_;
  const Tensor wte = P.param(gix_.wte);
  const Tensor dwte = P.grad(gix_.wte);
  linear_backward(rows(w.d_ln_full), dwte, Tensor(), dlogits, rows(w.lnf_full), wte, st);
  reduce_from_tp_region(tp, sp_, w.d_ln, w.d_ln_full, st);
  const Tensor x_last = layers_.back().out;
  layernorm_backward(rows(w.d_resid), P.grad(gix_.lnf_w), P.grad(gix_.lnf_b),
                     rows(w.d_ln), rows(x_last), P.param(gix_.lnf_w), w.lnf_mean, w.lnf_rstd,
                     /*accumulate_dx=*/false, st);
  for (int64_t l = config_.num_layers - 1; l >= 0; --l) {
    const Tensor x = l == 0 ? w.emb_out : layers_[l - 1].out;
    layer_backward(l, x, layers_[l], w.d_resid, dc, st);
  }
  if (dc.training && config_.hidden_dropout > 0.f)
    dropout_forward(w.d_resid, w.d_resid, config_.hidden_dropout, key_for(dc, -1, kSiteEmbedding),
                    sp_ ? tp_rank_ * sl_ * b_ * h_ : 0, st);
  // Backward of the embedding's reduction: the gradient is replicated (or all-gathered with SP,
  // into emb_full, which the forward no longer needs).
  const Tensor d_emb = sp_ ? w.emb_full : w.d_resid;
  gather_to_tp_region(tp, sp_, d_emb, w.d_resid, st);
  // Every TP rank computes the (replicated) position-embedding gradient in full.
  embedding_backward(dwte, P.grad(gix_.wpe), d_emb, mb.tokens, mb.position_ids,
                     vocab_start, st);
}

void GptModel::allreduce_sequence_parallel_grads(const Stream& st) {
  // One all-reduce per run of consecutive such parameters (per layer), not per tensor.
  for (const auto& r : sp_grad_ranges_)
    groups_.tp->all_reduce(params_->grads_flat().flat_range(r.begin, r.end - r.begin), ReduceOp::kSum, st);
}

}  // namespace mt
