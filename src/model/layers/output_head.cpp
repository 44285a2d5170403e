#include "model/layers/output_head.h"

#include <algorithm>

#include "ops/cross_entropy.h"

namespace mt {

namespace {
/// Opens the head's registry group before its members declare their parameters.
ParamRegistry& head_group(ParamRegistry& reg) {
  reg.begin_group(/*sort_by_sharding=*/false);
  return reg;
}

ColumnParallelLinear::Options output_options(const TransformerConfig& c, int tp, const ParamRef* tied) {
  ColumnParallelLinear::Options o;
  // The last stage's copy of a tied embedding keeps the embedding's name (checkpoints and the
  // embedding-group all-reduce find it by name).
  o.prefix = c.tied_output() ? "embedding.word_embeddings" : "output_layer";
  o.in = c.hidden_size;
  o.out = c.padded_vocab_size(tp);
  o.bias = false;
  o.init_std = c.init_method_std;
  o.shared_weight = tied;
  o.shared_embedding_copy = c.tied_output() && tied == nullptr;
  o.vocab_rows = c.vocab_size;
  return o;
}
}  // namespace

LanguageModelHead::LanguageModelHead(const TransformerConfig& c, const TensorParallelRegion& tp, ParamRegistry& reg,
                                     const ParamRef* tied_weight)
    : config_(c),
      tp_(tp),
      group_((head_group(reg), reg.num_groups() - 1)),
      vocab_start_(tp.rank() * (c.padded_vocab_size(tp.size()) / tp.size())),
      valid_cols_(std::clamp<int64_t>(c.vocab_size - vocab_start_, 0, c.padded_vocab_size(tp.size()) / tp.size())),
      final_layernorm_(c, "decoder.final_layernorm", c.hidden_size, TpGradSum::kSequenceParallel, reg),
      output_layer_(output_options(c, tp.size(), c.tied_output() ? tied_weight : nullptr), tp, reg) {
  MT_CHECK(tied_weight == nullptr || c.tied_output(), "an untied output layer was given the word embedding");
}

void LanguageModelHead::plan(BufferPlanner& p, int64_t s, int64_t b) {
  const int64_t T = s * b;
  final_layernorm_.plan(p, tp_.local_seq(s) * b);
  output_layer_.plan(p, s, b);
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  saved_[a].ce_max = p.saved(DType::kF32, {T}, "ce_max");
  saved_[a].ce_sumexp = p.saved(DType::kF32, {T}, "ce_sumexp");
  saved_[a].logits = p.saved(p.act_dtype(), {T, output_layer_.local_out()}, "logits");
  ce_local_max_ = p.scratch("head.ce_local_max", DType::kF32, {T});
  ce_target_ = p.scratch("head.ce_target", DType::kF32, {T});
  losses_ = p.scratch("head.losses", DType::kF32, {T});
}

void LanguageModelHead::forward(const Tensor& x, const Tensor& loss_accum, float loss_weight, bool compute_loss,
                                const StepContext& ctx) {
  const Saved& H = saved_.at(static_cast<size_t>(ctx.slot));
  final_layernorm_.forward(rows(output_layer_.input(ctx.slot)), rows(x), ctx);
  output_layer_.forward(H.logits, ctx);
  if (!compute_loss) return;
  const int64_t T = H.logits.size(0);
  const MicroBatch& mb = ctx.batch;
  check_tensor(mb.labels, DType::kI32, {mb.tokens.size(0), mb.tokens.size(1)}, "labels");
  const Tensor labels = mb.labels.view({T});
  const Tensor mask = mb.loss_mask.empty() ? Tensor() : mb.loss_mask.view({T});
  if (tp_.size() == 1) {
    cross_entropy_stats(H.ce_max, H.ce_sumexp, ce_target_, H.logits, labels, 0, valid_cols_, ctx.stream);
  } else {
    // Vocab-parallel cross entropy: three all-reduces of s·b values, never of s·b·V.
    Communicator& tp = tp_.group();
    cross_entropy_stats(ce_local_max_, H.ce_sumexp, ce_target_, H.logits, labels, vocab_start_, valid_cols_,
                        ctx.stream);
    copy(H.ce_max, ce_local_max_, ctx.stream);
    tp.all_reduce(H.ce_max, ReduceOp::kMax, ctx.stream);
    cross_entropy_rescale_sumexp(H.ce_sumexp, ce_local_max_, H.ce_max, ctx.stream);
    tp.all_reduce(H.ce_sumexp, ReduceOp::kSum, ctx.stream);
    tp.all_reduce(ce_target_, ReduceOp::kSum, ctx.stream);
  }
  cross_entropy_loss(losses_, H.ce_max, H.ce_sumexp, ce_target_, mask, ctx.stream);
  sum_accumulate(loss_accum, losses_, loss_weight, ctx.stream);
}

void LanguageModelHead::backward(const Tensor& dx, const Tensor& x, float grad_scale, const Tensor& loss_scale,
                                 const StepContext& ctx) {
  const Saved& H = saved_.at(static_cast<size_t>(ctx.slot));
  const int64_t T = H.logits.size(0);
  const MicroBatch& mb = ctx.batch;
  const Tensor labels = mb.labels.view({T});
  const Tensor mask = mb.loss_mask.empty() ? Tensor() : mb.loss_mask.view({T});
  cross_entropy_backward_inplace(H.logits, labels, H.ce_max, H.ce_sumexp, mask, vocab_start_, valid_cols_, grad_scale,
                                 loss_scale, ctx.stream);
  const Tensor d_ln = output_layer_.backward(H.logits, ctx);
  final_layernorm_.backward(rows(dx), rows(d_ln), rows(x), /*accumulate_dx=*/false, ctx);
}

}  // namespace mt
