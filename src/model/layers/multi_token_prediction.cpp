#include "model/layers/multi_token_prediction.h"

#include "core/check.h"
#include "model/layers/embedding.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"

namespace mt {

MtpInputs make_mtp_inputs(int64_t depths, int64_t s, int64_t b, const int32_t* tokens, const int32_t* labels,
                          const float* loss_mask) {
  MT_REQUIRE(depths >= 1 && s >= 1 && b >= 1, "make_mtp_inputs: depths {}, sequence {} and batch {} must be >= 1",
             depths, s, b);
  const int64_t n = s * b;
  MtpInputs out;
  out.tokens.assign(static_cast<size_t>(depths * n), 0);
  out.labels.assign(out.tokens.size(), 0);
  out.loss_mask.assign(out.tokens.size(), 0.f);
  auto mask = [&](int64_t e) { return loss_mask ? loss_mask[e] : 1.f; };
  int64_t n0 = 0;
  for (int64_t e = 0; e < n; ++e) n0 += mask(e) != 0.f ? 1 : 0;
  for (int64_t k = 1; k <= depths; ++k) {
    // [s, b] rows i take row i + k: a shift by k·b elements of the s-major layout
    const int64_t kept = (s - std::min(k, s)) * b, base = (k - 1) * n;
    int64_t nk = 0;
    for (int64_t e = 0; e < kept; ++e) nk += mask(e + k * b) != 0.f ? 1 : 0;
    const double ratio = nk > 0 ? static_cast<double>(n0) / static_cast<double>(nk) : 0.0;
    for (int64_t e = 0; e < kept; ++e) {
      const size_t o = static_cast<size_t>(base + e), src = static_cast<size_t>(e + k * b);
      out.tokens[o] = tokens[src];
      out.labels[o] = labels[src];
      out.loss_mask[o] = static_cast<float>(static_cast<double>(mask(static_cast<int64_t>(src))) * ratio);
    }
  }
  return out;
}

struct MultiTokenPrediction::Depth {
  size_t group = 0;
  std::unique_ptr<Norm> enorm, hnorm;
  std::unique_ptr<ColumnParallelLinear> eh_proj;
  std::unique_ptr<LanguageModelHead> head;  // final_layernorm + the shared output layer + CE
  std::unique_ptr<TransformerLayer> layer;
};

namespace {
ColumnParallelLinear::Options eh_proj_options(const TransformerConfig& c, const std::string& prefix) {
  ColumnParallelLinear::Options o;
  o.prefix = prefix;
  o.in = 2 * c.hidden_size;
  o.out = c.hidden_size;
  o.bias = false;  // Megatron: bias=False
  o.init_std = c.init_method_std;
  return o;
}
}  // namespace

MultiTokenPrediction::MultiTokenPrediction(const TransformerConfig& c, const LayerSpec& spec,
                                           const TensorParallelRegion& tp, const ExpertParallel& ep,
                                           ParamRegistry& reg, const ParamRef* word_embedding,
                                           const ParamRef& output_weight)
    : config_(c), tp_(tp), word_(word_embedding ? word_embedding : &word_copy_),
      vocab_start_(tp.rank() * (c.padded_vocab_size(tp.size()) / tp.size())) {
  const int64_t h = c.hidden_size;
  MT_REQUIRE(h % tp.size() == 0, "multi-token prediction: --hidden-size {} is not divisible by tensor parallel size {} "
             "(eh_proj is split by output rows)", h, tp.size());
  for (int64_t d = 0; d < c.mtp_num_layers; ++d) {
    auto dp = std::make_unique<Depth>();
    const std::string p = fmt::format("mtp.layers.{}.", d);
    reg.begin_group(/*sort_by_sharding=*/true);
    dp->group = reg.num_groups() - 1;
    if (d == 0 && word_embedding == nullptr) {  // the first stage's embedding, copied (same name and init)
      ParamSpec word = word_embedding_spec(c, tp);
      word.shared_embedding_copy = true;
      reg.declare(std::move(word), &word_copy_);
    }
    dp->enorm = std::make_unique<Norm>(c, p + "enorm", h, TpGradSum::kSequenceParallel, reg);
    dp->hnorm = std::make_unique<Norm>(c, p + "hnorm", h, TpGradSum::kSequenceParallel, reg);
    dp->eh_proj = std::make_unique<ColumnParallelLinear>(eh_proj_options(c, p + "eh_proj"), tp, reg);
    dp->head = std::make_unique<LanguageModelHead>(c, tp, reg, p + "final_layernorm", &output_weight);
    // The layer numbered after the decoder's (dropout keys, MoE statistics), named as Megatron's.
    const int64_t number = c.num_layers + d;
    reg.set_rename(fmt::format("decoder.layers.{}.", number), p + "transformer_layer.");
    dp->layer = std::make_unique<TransformerLayer>(c, spec, number, tp, ep, reg);
    reg.clear_rename();
    depth_.push_back(std::move(dp));
  }
}

MultiTokenPrediction::~MultiTokenPrediction() = default;

size_t MultiTokenPrediction::param_group(int64_t d) const { return depth_.at(static_cast<size_t>(d))->group; }
TransformerLayer& MultiTokenPrediction::layer(int64_t d) const { return *depth_.at(static_cast<size_t>(d))->layer; }

void MultiTokenPrediction::plan(BufferPlanner& p, int64_t s, int64_t b, const HeadOptions& options) {
  const DType t = p.act_dtype();
  const int64_t h = config_.hidden_size, sl = tp_.local_seq(s);
  seq_ = s;
  seq_local_ = sl;
  batch_ = b;
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  saved_[a].resize(depth_.size());
  for (size_t d = 0; d < depth_.size(); ++d) {
    Depth& dp = *depth_[d];
    saved_[a][d].embedding = p.saved(t, {sl, b, h}, "mtp embedding");
    dp.enorm->plan(p, sl * b);
    dp.hnorm->plan(p, sl * b);
    dp.eh_proj->plan(p, s, b);
    saved_[a][d].layer_in = p.saved(t, {sl, b, h}, "mtp layer input");
    dp.layer->plan(p, s, b);
    dp.head->plan(p, s, b, options);
  }
  norm_e_ = p.scratch("mtp.enorm_out", t, {sl * b, h});
  norm_h_ = p.scratch("mtp.hnorm_out", t, {sl * b, h});
  if (tp_.size() > 1) {
    proj_out_ = p.scratch("mtp.eh_proj_out", t, {s * b, h / tp_.size()});
    if (tp_.sequence_parallel()) proj_full_ = p.scratch("mtp.eh_proj_full", t, {s * b, h});
  }
  embed_full_ = tp_.sequence_parallel() ? p.scratch("mtp.embedding_full", t, {s, b, h}) : Tensor();
  grad_ = p.scratch("mtp.grad", t, {sl, b, h});
  hidden_grad_ = p.scratch("mtp.hidden_grad", t, {sl, b, h});
  embed_grad_ = p.scratch("mtp.embedding_grad", t, {sl, b, h});
}

MicroBatch MultiTokenPrediction::depth_batch(const MicroBatch& mb, int64_t d) const {
  const int64_t D = depths(), sl = mb.tokens.size(0), b = mb.tokens.size(1), n = sl * b;
  MT_REQUIRE(!mb.mtp_tokens.empty() && !mb.mtp_labels.empty() && !mb.mtp_loss_mask.empty(),
             "multi-token prediction (--mtp-num-layers {}) needs the micro-batch's mtp_tokens, mtp_labels and "
             "mtp_loss_mask (make_mtp_inputs)",
             D);
  check_tensor(mb.mtp_tokens, DType::kI32, {D, sl, b}, "mtp_tokens");
  check_tensor(mb.mtp_labels, DType::kI32, {D, sl, b}, "mtp_labels");
  check_tensor(mb.mtp_loss_mask, DType::kF32, {D, sl, b}, "mtp_loss_mask");
  MicroBatch m = mb;
  m.tokens = mb.mtp_tokens.flat_range(d * n, n).view({sl, b});
  m.labels = mb.mtp_labels.flat_range(d * n, n).view({sl, b});
  m.loss_mask = mb.mtp_loss_mask.flat_range(d * n, n).view({sl, b});
  return m;
}

void MultiTokenPrediction::embed(const Depth&, const MicroBatch& mb, int64_t d, const Tensor& out,
                                 const StepContext& ctx) {
  // LanguageModelEmbedding's forward on the rolled tokens (no position table: MTP needs rope or
  // none), with the dropout site of this depth's layer number.
  const Tensor full = tp_.sequence_parallel() ? embed_full_ : out;
  embedding_forward(full, mb.tokens, word_->value(), Tensor(), Tensor(), vocab_start_, ctx.stream);
  tp_.exit_forward(out, full, ctx.stream);
  if (ctx.dropout.training && config_.hidden_dropout > 0.f)
    dropout_forward(out, out, config_.hidden_dropout, dropout_key(ctx.dropout, config_.num_layers + d, kSiteEmbedding),
                    tp_.sequence_parallel() ? tp_.rank() * seq_local_ * batch_ * config_.hidden_size : 0, ctx.stream);
}

void MultiTokenPrediction::embed_backward(int64_t d, const MicroBatch& mb, const Tensor& d_out,
                                          const StepContext& ctx) {
  if (ctx.dropout.training && config_.hidden_dropout > 0.f)
    dropout_forward(d_out, d_out, config_.hidden_dropout,
                    dropout_key(ctx.dropout, config_.num_layers + d, kSiteEmbedding),
                    tp_.sequence_parallel() ? tp_.rank() * seq_local_ * batch_ * config_.hidden_size : 0, ctx.stream);
  const Tensor d_full = tp_.sequence_parallel() ? embed_full_ : d_out;
  tp_.exit_backward(d_full, d_out, ctx.stream);
  // The last stage's copy of a tied embedding is declared by the output layer (grad_overwrite),
  // whose GEMMs write it first; should this be the step's first write, start from zero.
  if (word_->grad_write() == GradWrite::kOverwrite) fill(word_->grad(), 0.f, ctx.stream);
  embedding_backward(word_->grad(), Tensor(), d_full, mb.tokens, Tensor(), vocab_start_, config_.deterministic_mode,
                     ctx.stream);
}

void MultiTokenPrediction::forward(const Tensor& h0, const Tensor& losses, float loss_weight, const HeadGrad* grad,
                                   const StepContext& ctx) {
  check_tensor(losses, DType::kF32, {depths()}, "MTP losses");
  const int64_t h = config_.hidden_size, D = depths();
  const float scale = config_.mtp_loss_scaling_factor / static_cast<float>(D);
  Tensor hidden = h0;  // [s_l·b, h]: h_{k−1}
  for (int64_t d = 0; d < D; ++d) {
    Depth& dp = *depth_[static_cast<size_t>(d)];
    const Saved& S = saved_.at(static_cast<size_t>(ctx.slot)).at(static_cast<size_t>(d));
    const MicroBatch mb = depth_batch(ctx.batch, d);
    StepContext dctx{mb, ctx.dropout, ctx.slot, ctx.stream, ctx.loss_scale, nullptr};
    dctx.recompute = ctx.recompute;
    use(d, Use::kEmbedding, false, true, ctx.stream);
    embed(dp, mb, d, S.embedding, dctx);
    use(d, Use::kEmbedding, false, false, ctx.stream);
    use(d, Use::kInput, false, true, ctx.stream);
    dp.enorm->forward(norm_e_, rows(S.embedding), dctx);
    dp.hnorm->forward(norm_h_, hidden, dctx);
    const Tensor in = rows(dp.eh_proj->input(ctx.slot));  // [s_l·b, 2h]: [enorm(e); hnorm(h)]
    copy_rows(in.slice(1, 0, h), norm_e_, ctx.stream);
    copy_rows(in.slice(1, h, 2 * h), norm_h_, ctx.stream);
    if (tp_.size() == 1) {
      dp.eh_proj->forward(S.layer_in, dctx);
    } else {  // gather the [s·b, h/tp] column blocks: each placed among zeros, then the region's reduction
      dp.eh_proj->forward(proj_out_, dctx);
      const Tensor full = tp_.sequence_parallel() ? proj_full_ : rows(S.layer_in);
      const int64_t w = h / tp_.size();
      memset_tensor(full, 0, ctx.stream);
      copy_rows(full.slice(1, tp_.rank() * w, (tp_.rank() + 1) * w), proj_out_, ctx.stream);
      tp_.exit_forward(S.layer_in, full.view({seq_, batch_, h}), ctx.stream);  // without SP: in place
    }
    use(d, Use::kInput, false, false, ctx.stream);
    use(d, Use::kLayer, false, true, ctx.stream);
    const Tensor out = dp.layer->forward(S.layer_in, dctx);
    use(d, Use::kLayer, false, false, ctx.stream);
    const HeadGrad g = grad ? HeadGrad{grad->grad_scale * scale, grad->loss_scale} : HeadGrad{};
    use(d, Use::kHead, false, true, ctx.stream);
    dp.head->forward(out, losses.flat_range(d, 1), loss_weight, /*compute_loss=*/true, grad ? &g : nullptr, dctx);
    use(d, Use::kHead, false, false, ctx.stream);
    hidden = dp.head->norm_output(ctx.slot);
  }
}

Tensor MultiTokenPrediction::backward(const Tensor& h0, float grad_scale, const Tensor& loss_scale,
                                      const StepContext& ctx, const std::function<void(size_t)>& done) {
  const int64_t h = config_.hidden_size, D = depths();
  const float scale = config_.mtp_loss_scaling_factor / static_cast<float>(D);
  Tensor next;  // dL/dh_k from depth k + 1 (none for the last depth)
  for (int64_t d = D - 1; d >= 0; --d) {
    Depth& dp = *depth_[static_cast<size_t>(d)];
    const Saved& S = saved_.at(static_cast<size_t>(ctx.slot)).at(static_cast<size_t>(d));
    const MicroBatch mb = depth_batch(ctx.batch, d);
    StepContext dctx{mb, ctx.dropout, ctx.slot, ctx.stream, loss_scale, nullptr};
    use(d, Use::kHead, true, true, ctx.stream);
    dp.head->backward(grad_, dp.layer->output(ctx.slot), grad_scale * scale, loss_scale, dctx, next);
    use(d, Use::kHead, true, false, ctx.stream);
    use(d, Use::kLayer, true, true, ctx.stream);
    dp.layer->backward(S.layer_in, grad_, dctx);  // grad_: dL/d(layer input)
    use(d, Use::kLayer, true, false, ctx.stream);
    use(d, Use::kInput, true, true, ctx.stream);
    Tensor dy = grad_;
    if (tp_.size() > 1) {  // the gather's backward: this rank's column block of the full gradient
      const Tensor full = tp_.sequence_parallel() ? proj_full_ : rows(grad_);
      if (tp_.sequence_parallel())
        tp_.exit_backward(full.view({seq_, batch_, h}), grad_, ctx.stream);
      const int64_t w = h / tp_.size();
      copy_rows(proj_out_, full.slice(1, tp_.rank() * w, (tp_.rank() + 1) * w), ctx.stream);
      dy = proj_out_;
    }
    const Tensor dx = rows(dp.eh_proj->backward(dy, dctx));  // [s_l·b, 2h]
    copy_rows(norm_e_, dx.slice(1, 0, h), ctx.stream);
    copy_rows(norm_h_, dx.slice(1, h, 2 * h), ctx.stream);
    dp.enorm->backward(rows(embed_grad_), norm_e_, rows(S.embedding), /*accumulate_dx=*/false, dctx);
    const Tensor hidden = d == 0 ? h0 : depth_[static_cast<size_t>(d - 1)]->head->norm_output(ctx.slot);
    dp.hnorm->backward(rows(hidden_grad_), norm_h_, hidden, /*accumulate_dx=*/false, dctx);
    use(d, Use::kInput, true, false, ctx.stream);
    embed_backward(d, mb, embed_grad_, dctx);  // reads no parameter: no use
    next = hidden_grad_;
    done(dp.group);
    done(dp.layer->param_group());
  }
  return hidden_grad_;
}

}  // namespace mt
