#include "model/layers/embedding.h"

#include "model/layers/linear.h"
#include "model/layers/parallel_params.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"

namespace mt {

ParamSpec word_embedding_spec(const TransformerConfig& c, const TensorParallelRegion& tp) {
  ParamSpec word = column_parallel_weight("embedding.word_embeddings.weight", c.padded_vocab_size(tp.size()),
                                          c.hidden_size, c.init_method_std, tp.size(), tp.rank());
  word.vocab_rows = c.vocab_size;
  return word;
}

LanguageModelEmbedding::LanguageModelEmbedding(const TransformerConfig& c, const TensorParallelRegion& tp,
                                               ParamRegistry& reg)
    : config_(c), tp_(tp), vocab_start_(tp.rank() * (c.padded_vocab_size(tp.size()) / tp.size())) {
  reg.begin_group(/*sort_by_sharding=*/false);
  group_ = reg.num_groups() - 1;
  reg.declare(word_embedding_spec(c, tp), &word_);
  if (position_embedding_kind(c.position_embedding_type).learned_table)
    reg.declare(replicated_param("embedding.position_embeddings.weight", {c.max_positions(), c.hidden_size},
                                 InitKind::kNormal, c.init_method_std, TpGradSum::kNone),
                &position_);
}

void LanguageModelEmbedding::plan(BufferPlanner& p, int64_t s, int64_t b) {
  seq_local_ = tp_.local_seq(s);
  batch_ = b;
  full_ = tp_.sequence_parallel() ? p.scratch("embedding.full", p.act_dtype(), {s, b, config_.hidden_size}) : Tensor();
}

void LanguageModelEmbedding::forward(const Tensor& out, const StepContext& ctx) {
  const int64_t s = ctx.batch.tokens.size(0);
  check_tensor(ctx.batch.tokens, DType::kI32, {s, batch_}, "tokens");
  // Without SP, out is [s, b, h] already; the position embedding is added on TP rank 0 only, so
  // the reduction over TP adds it once.
  const Tensor full = tp_.sequence_parallel() ? full_ : out;
  const Tensor wpe = tp_.rank() == 0 ? value_or_empty(position_) : Tensor();
  embedding_forward(full, ctx.batch.tokens, word_.value(), wpe, ctx.batch.position_ids, vocab_start_, ctx.stream);
  tp_.exit_forward(out, full, ctx.stream);
  if (ctx.dropout.training && config_.hidden_dropout > 0.f)
    dropout_forward(out, out, config_.hidden_dropout, dropout_key(ctx.dropout, -1, kSiteEmbedding),
                    tp_.sequence_parallel() ? tp_.rank() * seq_local_ * batch_ * config_.hidden_size : 0, ctx.stream);
}

void LanguageModelEmbedding::backward(const Tensor& d_out, const StepContext& ctx) {
  if (ctx.dropout.training && config_.hidden_dropout > 0.f)
    dropout_forward(d_out, d_out, config_.hidden_dropout, dropout_key(ctx.dropout, -1, kSiteEmbedding),
                    tp_.sequence_parallel() ? tp_.rank() * seq_local_ * batch_ * config_.hidden_size : 0, ctx.stream);
  // Backward of the reduction: the gradient is replicated (all-gathered with SP, into full_,
  // which the forward no longer needs). Every TP rank computes the replicated position-embedding
  // gradient in full.
  const Tensor d_full = tp_.sequence_parallel() ? full_ : d_out;
  tp_.exit_backward(d_full, d_out, ctx.stream);
  embedding_backward(word_.grad(), grad_or_empty(position_), d_full, ctx.batch.tokens, ctx.batch.position_ids,
                     vocab_start_, config_.deterministic_mode, ctx.stream);
}

}  // namespace mt
