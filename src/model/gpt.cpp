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

// Saved activations of the final norm, LM head and loss (the loss chunk), per slot.
struct GptModel::HeadActs {
  Tensor lnf_out, lnf_mean, lnf_rstd;   // final norm [s_l, b, h], fp32 [s_l·b] x2
  Tensor lnf_full;                      // [s, b, h]
  Tensor ce_max, ce_sumexp;             // fp32 [s·b]
  Tensor logits;                        // [s·b, V_l]; overwritten in place by its gradient
};

// One model chunk: its layer range, parameter indices and per-slot activations.
struct GptModel::ChunkState {
  pipeline::LayerRange range;
  std::vector<LayerParamIndex> params;        // per local layer
  std::vector<Tensor> input;                  // input buffers [s_l, b, h]
  std::vector<HeadActs> head;                 // per head slot (loss chunk only)
  std::vector<ParamStore::Range> sp_ranges;   // per local layer: replicated params (SP all-reduce)
  std::vector<ParamStore::Range> head_sp_ranges;  // final norm
};

// Scratch shared by all chunks, layers and the head.
struct GptModel::Workspace {
  Tensor emb_full;                      // word + position embedding [s, b, h] (partial over TP)
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
  Tensor ce_local_max, ce_target, losses;  // fp32 [s·b]
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

namespace {
std::vector<pipeline::LayerRange> whole_model(const GptConfig& c) {
  pipeline::LayerRange r;
  r.begin = 0;
  r.end = c.num_layers;
  r.has_embedding = r.has_loss = true;
  return {r};
}
}  // namespace

std::vector<ParamSpec> GptModel::param_specs(const GptConfig& c, int tp, int r,
                                             const std::vector<pipeline::LayerRange>& chunk_ranges) {
  const std::vector<pipeline::LayerRange> chunks = chunk_ranges.empty() ? whole_model(c) : chunk_ranges;
  const int64_t h = c.hidden_size, f = c.ffn(), V = c.padded_vocab_size(tp), P = c.max_positions();
  const float std = c.init_method_std;
  const float out_std = std / std::sqrt(2.0f * static_cast<float>(c.num_layers));
  bool has_embedding = false, has_loss = false;
  for (const auto& ch : chunks) {
    has_embedding |= ch.has_embedding;
    has_loss |= ch.has_loss;
  }
  std::vector<ParamSpec> s;
  // Order: per layer TP-split weights, TP-split biases, then replicated parameters, so AdamW and
  // the gradient norm see few runs.
  if (has_embedding) {
    s.push_back(column_parallel("embedding.word_embeddings.weight", V, h, std, tp, r, true));
    s.push_back({"embedding.position_embeddings.weight", {P, h}, InitKind::kNormal, std, true});
  }
  for (const auto& ch : chunks)
  for (int64_t l = ch.begin; l < ch.end; ++l) {
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
  if (has_loss) {
    s.push_back(replicated("decoder.final_layernorm.weight", h, InitKind::kOnes));
    s.push_back(replicated("decoder.final_layernorm.bias", h, InitKind::kZeros));
    if (!has_embedding) {  // the last pipeline stage's copy of the tied output embedding
      s.push_back(column_parallel("embedding.word_embeddings.weight", V, h, std, tp, r, true));
      s.back().shared_embedding_copy = true;
    }
  }
  return s;
}

GptModel::GptModel(const GptConfig& config, int64_t micro_batch, DType dtype, Device device, ProcessGroups groups,
                   bool sequence_parallel, ParamLayout param_layout, ModelLayout layout)
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
  std::vector<ModelChunk>& chunks = layout.chunks;
  if (chunks.empty()) chunks.push_back({whole_model(config_)[0], 1, 1});
  MT_REQUIRE(layout.activation_slots >= 1, "the model needs at least one activation slot, got {}",
             layout.activation_slots);
  activation_slots_ = layout.activation_slots;
  std::vector<pipeline::LayerRange> ranges;
  int64_t prev_end = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const auto& r = chunks[c].layers;
    MT_REQUIRE(r.begin >= 0 && r.begin <= r.end && r.end <= config_.num_layers && (c == 0 || r.begin >= prev_end),
               "model chunk {} holds layers [{}, {}): expected increasing, non-overlapping ranges within [0, {})", c,
               r.begin, r.end, config_.num_layers);
    MT_REQUIRE(chunks[c].inputs >= 1 && chunks[c].loss_slots >= 1,
               "model chunk {} needs at least one input buffer and loss slot, got {} and {}", c, chunks[c].inputs,
               chunks[c].loss_slots);
    prev_end = r.end;
    ranges.push_back(r);
  }
  chunk_specs_ = chunks;
  params_ = std::make_unique<ParamStore>(param_specs(config_, tp_, tp_rank_, ranges), dtype, device, param_layout);
  // Parameter indices resolved once, so the step does no name lookups.
  const ParamStore& P = *params_;
  gix_ = {P.find("embedding.word_embeddings.weight"), P.find("embedding.position_embeddings.weight"),
          P.find("decoder.final_layernorm.weight"), P.find("decoder.final_layernorm.bias")};
  auto sp_range = [&](size_t first, size_t end) {
    // The replicated parameters of [first, end) whose gradients are partial sums under SP.
    std::vector<ParamStore::Range> rs = P.ranges([&](const ParamInfo& p) {
      const size_t i = static_cast<size_t>(&p - P.infos().data());
      return i >= first && i < end && p.sequence_parallel_grad;
    });
    MT_CHECK(rs.size() <= 1, "replicated parameters of one layer are expected to be consecutive");
    return rs.empty() ? ParamStore::Range{0, 0} : rs[0];
  };
  chunks_.resize(chunks.size());
  for (size_t c = 0; c < chunks.size(); ++c) {
    ChunkState& ch = chunks_[c];
    ch.range = chunks[c].layers;
    for (int64_t l = ch.range.begin; l < ch.range.end; ++l) {
      const std::string p = layer_prefix(l);
      auto at = [&](const char* n) { return P.index(p + n); };
      LayerParamIndex ix{at("input_layernorm.weight"), at("input_layernorm.bias"),
                         at("self_attention.linear_qkv.weight"), at("self_attention.linear_qkv.bias"),
                         at("self_attention.linear_proj.weight"), at("self_attention.linear_proj.bias"),
                         at("pre_mlp_layernorm.weight"), at("pre_mlp_layernorm.bias"),
                         at("mlp.linear_fc1.weight"), at("mlp.linear_fc1.bias"), at("mlp.linear_fc2.weight"),
                         at("mlp.linear_fc2.bias"), 0, 0};
      ix.first = ix.qkv_w;
      ix.end = ix.fc2_b + 1;
      ch.params.push_back(ix);
      ch.sp_ranges.push_back(sp_range(ix.first, ix.end));
    }
    if (ch.range.has_loss) ch.head_sp_ranges.push_back(sp_range(gix_.lnf_w, gix_.lnf_b + 1));
  }
  ws_ = std::make_unique<Workspace>();
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
  bool any_embedding = false;
  int64_t max_layers = 0;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    ChunkState& ch = chunks_[c];
    any_embedding |= ch.range.has_embedding;
    max_layers = std::max(max_layers, ch.range.size());
    ch.input.assign(static_cast<size_t>(chunk_specs_[c].inputs), Tensor());
    for (auto& in : ch.input) in = a.alloc(t, {sl_, b_, h_}, "chunk_input");
    ch.head.assign(ch.range.has_loss ? static_cast<size_t>(chunk_specs_[c].loss_slots) : 0, HeadActs());
    for (HeadActs& H : ch.head) {
      H.lnf_full = a.alloc(t, {s_, b_, h_}, "lnf_full");
      H.lnf_out = local_or_full(H.lnf_full, "lnf_out");
      H.lnf_mean = a.alloc(f32, {Tl}, "lnf_mean");
      H.lnf_rstd = a.alloc(f32, {Tl}, "lnf_rstd");
      H.ce_max = a.alloc(f32, {T}, "ce_max");
      H.ce_sumexp = a.alloc(f32, {T}, "ce_sumexp");
      H.logits = a.alloc(t, {T, Vl_}, "logits");
    }
  }
  acts_.assign(static_cast<size_t>(activation_slots_), std::vector<LayerActs>(static_cast<size_t>(max_layers)));
  for (auto& slot : acts_) {
    for (auto& L : slot) {
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
  }
  // The embedding's [s, b, h] partial sum with SP (also the all-gather target of its gradient).
  w.emb_full = any_embedding && sp_ ? a.alloc(t, {s_, b_, h_}, "emb_full") : Tensor();
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
  w.ce_local_max = a.alloc(f32, {T}, "ce_local_max");
  w.ce_target = a.alloc(f32, {T}, "ce_target");
  w.losses = a.alloc(f32, {T}, "losses");
  for (auto& slot : acts_)
    for (auto& L : slot) {
      L.attn.scratch = w.attn_scratch;
      L.attn.dq = w.dq;
      L.attn.dk = w.dk;
      L.attn.dv = w.dv;
    }
}

const ModelChunk& GptModel::chunk(int c) const {
  MT_REQUIRE(c >= 0 && c < num_chunks(), "model chunk {} requested; this rank has {}", c, num_chunks());
  return chunk_specs_[static_cast<size_t>(c)];
}

Tensor GptModel::chunk_input(int c, int input) const {
  MT_REQUIRE(input >= 0 && input < chunk(c).inputs, "input buffer {} of model chunk {} requested; it has {}", input,
             c, chunk(c).inputs);
  return chunks_[static_cast<size_t>(c)].input[static_cast<size_t>(input)];
}

void GptModel::check_buffers(int c, const ChunkBuffers& buf) const {
  chunk_input(c, buf.input);  // checks c and the input buffer
  MT_REQUIRE(buf.slot >= 0 && buf.slot < activation_slots_, "activation slot {} requested; the model has {}",
             buf.slot, activation_slots_);
  MT_REQUIRE(!chunks_[static_cast<size_t>(c)].range.has_loss || (buf.head >= 0 && buf.head < chunk(c).loss_slots),
             "loss slot {} of model chunk {} requested; it has {}", buf.head, c, chunk(c).loss_slots);
}

Tensor GptModel::chunk_output(int c, const ChunkBuffers& buf) const {
  check_buffers(c, buf);
  const ChunkState& ch = chunks_[static_cast<size_t>(c)];
  if (ch.range.size() == 0) return ch.input[static_cast<size_t>(buf.input)];
  return acts_[static_cast<size_t>(buf.slot)][static_cast<size_t>(ch.range.size() - 1)].out;
}

Tensor GptModel::logits() const {
  for (const auto& ch : chunks_)
    if (ch.range.has_loss) return ch.head[0].logits;
  return Tensor();
}

bool GptModel::embedding_shared_across_stages() const {
  return groups_.embedding && groups_.embedding->size() > 1;
}

void GptModel::grads_final(size_t first, size_t end, const Stream& st) {
  if (hooks_ != nullptr && first < end) hooks_->grads_ready(first, end, st);
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

void GptModel::layer_forward(int64_t l, const LayerParamIndex& ix, const Tensor& x, LayerActs& a,
                             const DropoutContext& dc, const Stream& st) {
  const ParamStore& P = *params_;
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

void GptModel::layer_backward(int64_t l, const LayerParamIndex& ix, const Tensor& x, LayerActs& a,
                              const Tensor& d_resid, const DropoutContext& dc, const Stream& st,
                              std::vector<DeferredWgrad>* deferred) {
  // On entry d_resid = dL/d(out); on exit d_resid = dL/dx. Activation grads overwrite except
  // the residual stream, into which the LayerNorm backward accumulates.
  const ParamStore& P = *params_;
  const float pd = dc.training ? config_.hidden_dropout : 0.f;
  const int64_t drop_off = sp_ ? tp_rank_ * sl_ * b_ * h_ : 0;
  Communicator& tp = *groups_.tp;
  auto& w = *ws_;
  // dgrad now; the weight gradient now or (deferred) at the end of the backward.
  auto linear_bwd = [&](const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy, const Tensor& in,
                        const Tensor& weight) {
    if (!deferred) return linear_backward(dx, dw, db, dy, in, weight, st);
    linear_backward(dx, Tensor(), Tensor(), dy, in, weight, st);
    deferred->push_back({dw, db, dy, in, weight});
  };
  // --- MLP block: out = resid1 + dropout(fc2(gelu(fc1(ln2(resid1)))) + b2) ---
  bias_dropout_add_backward(rows(w.d_h), P.grad(ix.fc2_b), rows(d_resid), pd,
                            key_for(dc, l, kSiteMlpOut), drop_off, st);
  gather_to_tp_region(tp, sp_, w.d_h_full, w.d_h, st);  // backward of the reduce-scatter
  linear_backward(rows(w.d_fc1), P.grad(ix.fc2_w), Tensor(), rows(w.d_h_full), rows(a.fc1_out),
                  P.param(ix.fc2_w), st);
  gelu_backward(w.d_fc1, w.d_fc1, a.fc1_pre, st);
  linear_bwd(rows(w.d_ln_full), P.grad(ix.fc1_w), P.grad(ix.fc1_b), rows(w.d_fc1), rows(a.ln2_full),
             P.param(ix.fc1_w));
  reduce_from_tp_region(tp, sp_, w.d_ln, w.d_ln_full, st);  // backward of f / the all-gather
  layernorm_backward(rows(d_resid), P.grad(ix.ln2_w), P.grad(ix.ln2_b),
                     rows(w.d_ln), rows(a.resid1), P.param(ix.ln2_w), a.ln2_mean, a.ln2_rstd,
                     /*accumulate_dx=*/true, st);
  // --- attention block: resid1 = x + dropout(proj(attn(qkv(ln1(x)))) + bp) ---
  bias_dropout_add_backward(rows(w.d_h), P.grad(ix.proj_b), rows(d_resid), pd,
                            key_for(dc, l, kSiteAttentionOut), drop_off, st);
  gather_to_tp_region(tp, sp_, w.d_h_full, w.d_h, st);
  linear_bwd(rows(w.d_ctx), P.grad(ix.proj_w), Tensor(), rows(w.d_h_full), rows(a.ctx), P.param(ix.proj_w));
  attention_backward(w.d_qkv, w.d_ctx, a.attn, attention_config(l, dc), st);
  linear_bwd(rows(w.d_ln_full), P.grad(ix.qkv_w), P.grad(ix.qkv_b), rows(w.d_qkv), rows(a.ln1_full),
             P.param(ix.qkv_w));
  reduce_from_tp_region(tp, sp_, w.d_ln, w.d_ln_full, st);
  layernorm_backward(rows(d_resid), P.grad(ix.ln1_w), P.grad(ix.ln1_b),
                     rows(w.d_ln), rows(x), P.param(ix.ln1_w), a.ln1_mean, a.ln1_rstd,
                     /*accumulate_dx=*/true, st);
}

void GptModel::forward(const MicroBatch& mb, const DropoutContext& dc, const Tensor& loss_accum, float loss_weight,
                       const Stream& st, bool compute_loss) {
  MT_REQUIRE(num_chunks() == 1 && chunks_[0].range.has_embedding && chunks_[0].range.has_loss,
             "GptModel::forward needs the whole model on this rank (use forward_chunk with pipeline parallelism)");
  ChunkState& ch = chunks_[0];
  doc_start_ = mb.doc_start;
  Tensor x = ch.input[0];
  embedding_forward_into(x, mb, dc, st);
  for (int64_t i = 0; i < ch.range.size(); ++i) {
    layer_forward(ch.range.begin + i, ch.params[i], x, acts_[0][i], dc, st);
    x = acts_[0][i].out;
  }
  head_forward(ch, 0, x, mb, loss_accum, loss_weight, compute_loss, st);
}

void GptModel::embedding_forward_into(const Tensor& out, const MicroBatch& mb, const DropoutContext& dc,
                                      const Stream& st) {
  check_tensor(mb.tokens, DType::kI32, {s_, b_}, "tokens");
  const ParamStore& P = *params_;
  auto& w = *ws_;
  // VocabParallelEmbedding: rows outside this rank's vocabulary shard are zero; the position
  // embedding is added on TP rank 0 only, so the reduction over TP adds it once.
  const Tensor full = sp_ ? w.emb_full : out;  // without SP, out is [s, b, h] already
  embedding_forward(full, mb.tokens, P.param(gix_.wte), tp_rank_ == 0 ? P.param(gix_.wpe) : Tensor(),
                    mb.position_ids, tp_rank_ * Vl_, st);
  reduce_from_tp_region(*groups_.tp, sp_, out, full, st);
  if (dc.training && config_.hidden_dropout > 0.f)
    dropout_forward(out, out, config_.hidden_dropout, key_for(dc, -1, kSiteEmbedding),
                    sp_ ? tp_rank_ * sl_ * b_ * h_ : 0, st);
}

Tensor GptModel::head_forward(ChunkState& ch, int head, const Tensor& x, const MicroBatch& mb,
                              const Tensor& loss_accum, float loss_weight, bool compute_loss, const Stream& st) {
  const ParamStore& P = *params_;
  Communicator& tp = *groups_.tp;
  auto& w = *ws_;
  HeadActs& H = ch.head[static_cast<size_t>(head)];
  const int64_t vocab_start = tp_rank_ * Vl_;
  layernorm_forward(rows(H.lnf_out), H.lnf_mean, H.lnf_rstd, rows(x), P.param(gix_.lnf_w), P.param(gix_.lnf_b),
                    config_.layernorm_epsilon, st);
  gather_to_tp_region(tp, sp_, H.lnf_full, H.lnf_out, st);
  // Output layer tied to the word embedding (column-parallel over the vocabulary).
  linear_forward(H.logits, rows(H.lnf_full), P.param(gix_.wte), Tensor(), Tensor(), st);
  if (!compute_loss) return Tensor();
  check_tensor(mb.labels, DType::kI32, {s_, b_}, "labels");
  const Tensor labels = mb.labels.view({s_ * b_});
  const Tensor mask = mb.loss_mask.empty() ? Tensor() : mb.loss_mask.view({s_ * b_});
  if (tp_ == 1) {
    cross_entropy_stats(H.ce_max, H.ce_sumexp, w.ce_target, H.logits, labels, 0, st);
  } else {
    // Vocab-parallel cross entropy: three all-reduces of s·b values, never of s·b·V.
    cross_entropy_stats(w.ce_local_max, H.ce_sumexp, w.ce_target, H.logits, labels, vocab_start, st);
    copy(H.ce_max, w.ce_local_max, st);
    tp.all_reduce(H.ce_max, ReduceOp::kMax, st);
    cross_entropy_rescale_sumexp(H.ce_sumexp, w.ce_local_max, H.ce_max, st);
    tp.all_reduce(H.ce_sumexp, ReduceOp::kSum, st);
    tp.all_reduce(w.ce_target, ReduceOp::kSum, st);
  }
  cross_entropy_loss(w.losses, H.ce_max, H.ce_sumexp, w.ce_target, mask, st);
  sum_accumulate(loss_accum, w.losses, loss_weight, st);
  return Tensor();
}

Tensor GptModel::forward_chunk(int c, const ChunkBuffers& buf, const MicroBatch& mb, const DropoutContext& dc,
                               const Tensor& loss_accum, float loss_weight, const Stream& st, bool first_forward) {
  check_buffers(c, buf);
  const Tensor in = chunk_input(c, buf.input);
  std::vector<LayerActs>& acts = acts_[static_cast<size_t>(buf.slot)];
  ChunkState& ch = chunks_[static_cast<size_t>(c)];
  doc_start_ = mb.doc_start;
  auto needed = [&](size_t first, size_t end) {
    if (first_forward && hooks_ != nullptr && first < end) hooks_->params_needed(first, end, st);
  };
  if (ch.range.has_embedding) {
    needed(gix_.wte, gix_.wte + 1);
    needed(gix_.wpe, gix_.wpe + 1);
    embedding_forward_into(in, mb, dc, st);
  }
  Tensor x = in;
  for (int64_t i = 0; i < ch.range.size(); ++i) {
    needed(ch.params[i].first, ch.params[i].end);
    layer_forward(ch.range.begin + i, ch.params[i], x, acts[i], dc, st);
    x = acts[i].out;
  }
  if (!ch.range.has_loss) return x;
  needed(gix_.lnf_w, gix_.lnf_b + 1);
  if (!ch.range.has_embedding) needed(gix_.wte, gix_.wte + 1);
  return head_forward(ch, buf.head, x, mb, loss_accum, loss_weight, /*compute_loss=*/true, st);
}

void GptModel::backward(const MicroBatch& mb, const DropoutContext& dc, float grad_scale, const Tensor& loss_scale,
                        const Stream& st, bool last_backward) {
  MT_REQUIRE(num_chunks() == 1 && chunks_[0].range.has_embedding && chunks_[0].range.has_loss,
             "GptModel::backward needs the whole model on this rank (use backward_chunk with pipeline parallelism)");
  backward_chunk(0, ChunkBuffers{}, mb, dc, Tensor(), grad_scale, loss_scale, st, last_backward);
}

void GptModel::backward_chunk(int c, const ChunkBuffers& buf, const MicroBatch& mb, const DropoutContext& dc,
                              const Tensor& grad, float grad_scale, const Tensor& loss_scale, const Stream& st,
                              bool last_backward) {
  check_buffers(c, buf);
  const Tensor in = chunk_input(c, buf.input);
  std::vector<LayerActs>& acts = acts_[static_cast<size_t>(buf.slot)];
  ChunkState& ch = chunks_[static_cast<size_t>(c)];
  ParamStore& P = *params_;
  Communicator& tp = *groups_.tp;
  auto& w = *ws_;
  const int64_t vocab_start = tp_rank_ * Vl_;
  const Tensor g = grad.empty() ? w.d_resid : grad;  // running dL/d(residual stream)
  if (!grad.empty()) check_tensor(grad, dtype_, {sl_, b_, h_}, "pipeline gradient buffer");
  doc_start_ = mb.doc_start;
  // SP all-reduce of replicated parameters' partial gradients (Megatron's
  // _allreduce_layernorm_grads), once their last contribution of the step is in.
  auto finalize = [&](const ParamStore::Range& r) {
    if (last_backward && sp_ && r.end > r.begin)
      tp.all_reduce(P.grads_flat().flat_range(r.begin, r.end - r.begin), ReduceOp::kSum, st);
  };
  const int64_t nlayers = ch.range.size();
  auto layer_input = [&](int64_t i) { return i == 0 ? in : acts[i - 1].out; };
  if (ch.range.has_loss) {
    HeadActs& H = ch.head[static_cast<size_t>(buf.head)];
    const Tensor labels = mb.labels.view({s_ * b_});
    const Tensor mask = mb.loss_mask.empty() ? Tensor() : mb.loss_mask.view({s_ * b_});
    cross_entropy_backward_inplace(H.logits, labels, H.ce_max, H.ce_sumexp, mask, vocab_start, grad_scale, loss_scale,
                                   st);
    const Tensor wte = P.param(gix_.wte);
    linear_backward(rows(w.d_ln_full), P.grad(gix_.wte), Tensor(), H.logits, rows(H.lnf_full), wte, st);
    reduce_from_tp_region(tp, sp_, w.d_ln, w.d_ln_full, st);
    layernorm_backward(rows(g), P.grad(gix_.lnf_w), P.grad(gix_.lnf_b), rows(w.d_ln), rows(layer_input(nlayers)),
                       P.param(gix_.lnf_w), H.lnf_mean, H.lnf_rstd, /*accumulate_dx=*/false, st);
    if (last_backward) {
      finalize(ch.head_sp_ranges[0]);
      grads_final(gix_.lnf_w, gix_.lnf_b + 1, st);
      // The last stage's embedding copy: final here unless the embedding group reduces it first.
      if (!ch.range.has_embedding && !embedding_shared_across_stages()) grads_final(gix_.wte, gix_.wte + 1, st);
    }
  }
  // The chunk's last backward with the embedding: the first layer's weight gradients wait until
  // the embedding backward has made the word embedding's gradient final, so that its reduction
  // (the largest bucket, the last one to complete otherwise) runs beside them instead of after
  // the backward. Same operations on the same buffers, only later: bitwise identical gradients.
  deferred_.clear();
  const bool defer_first = last_backward && ch.range.has_embedding && nlayers > 0;
  auto finish_layer = [&](int64_t i) {
    if (!last_backward) return;
    finalize(ch.sp_ranges[i]);
    grads_final(ch.params[i].first, ch.params[i].end, st);
  };
  for (int64_t i = nlayers - 1; i >= 0; --i) {
    const bool defer = defer_first && i == 0;
    layer_backward(ch.range.begin + i, ch.params[i], layer_input(i), acts[i], g, dc, st, defer ? &deferred_ : nullptr);
    if (!defer) finish_layer(i);
  }
  if (!ch.range.has_embedding) return;
  if (dc.training && config_.hidden_dropout > 0.f)
    dropout_forward(g, g, config_.hidden_dropout, key_for(dc, -1, kSiteEmbedding), sp_ ? tp_rank_ * sl_ * b_ * h_ : 0,
                    st);
  // Backward of the embedding's reduction: the gradient is replicated (or all-gathered with SP,
  // into emb_full, which the forward no longer needs).
  const Tensor d_emb = sp_ ? w.emb_full : g;
  gather_to_tp_region(tp, sp_, d_emb, g, st);
  // Every TP rank computes the (replicated) position-embedding gradient in full.
  embedding_backward(P.grad(gix_.wte), P.grad(gix_.wpe), d_emb, mb.tokens, mb.position_ids, vocab_start, st);
  if (last_backward) {
    grads_final(gix_.wpe, gix_.wpe + 1, st);
    if (!embedding_shared_across_stages()) grads_final(gix_.wte, gix_.wte + 1, st);
  }
  if (!defer_first) return;
  for (const DeferredWgrad& d : deferred_) linear_backward(Tensor(), d.dw, d.dbias, d.dy, d.x, d.w, st);
  finish_layer(0);
}

}  // namespace mt
