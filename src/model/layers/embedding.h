// Input embedding (Megatron-Core models/common/embeddings/language_model_embedding.py
// LanguageModelEmbedding): word embedding (VocabParallelEmbedding: rank r holds vocabulary rows
// [r·V/tp, (r+1)·V/tp), ids outside contribute 0 and the partial sums leave the TP region like a
// row-parallel output) plus, for learned_absolute positions, a position embedding added on TP rank
// 0 only; embedding dropout. Output [s_l, b, h]. Parameters: embedding.word_embeddings.weight
// [V/tp, h], embedding.position_embeddings.weight [P, h] (replicated), one registry group.
#pragma once
#include "model/module.h"
#include "model/transformer_config.h"
#include "parallel/mappings.h"

namespace mt {

/// The declaration of embedding.word_embeddings.weight: this rank's vocabulary shard [V/tp, h] of
/// the padded [V, h] table (vocab_rows = V), N(0, --init-method-std). Also declared, flagged
/// shared_embedding_copy, by the last pipeline stage's multi-token prediction of an untied model
/// (model/layers/multi_token_prediction.h). Errors: the padded vocabulary not divisible by tp.
ParamSpec word_embedding_spec(const TransformerConfig& config, const TensorParallelRegion& tp);

class LanguageModelEmbedding {
 public:
  LanguageModelEmbedding(const TransformerConfig& config, const TensorParallelRegion& tp, ParamRegistry& registry);
  LanguageModelEmbedding(const LanguageModelEmbedding&) = delete;
  LanguageModelEmbedding& operator=(const LanguageModelEmbedding&) = delete;

  size_t param_group() const { return group_; }
  void plan(BufferPlanner& planner, int64_t s, int64_t b);
  /// out [s_l, b, h] = dropout(reduce_TP(word(tokens) + position(positions))).
  void forward(const Tensor& out, const StepContext& ctx);
  /// From d_out [s_l, b, h] (modified in place by the dropout backward): accumulates the word
  /// (and position) embedding gradients.
  void backward(const Tensor& d_out, const StepContext& ctx);
  const ParamRef& word_embeddings() const { return word_; }
  /// The position embedding (unbound without learned absolute positions).
  const ParamRef& position_embeddings() const { return position_; }

 private:
  const TransformerConfig& config_;
  const TensorParallelRegion& tp_;
  size_t group_;
  int64_t vocab_start_;
  ParamRef word_, position_;
  Tensor full_;  // SP: the [s, b, h] partial sum before the reduce-scatter (and its gradient)
  int64_t seq_local_ = 0, batch_ = 0;
};

}  // namespace mt
