// The language-model head of the last pipeline stage (Megatron-Core GPTModel's post_process):
// decoder.final_layernorm -> output_layer (ColumnParallelLinear over the padded vocabulary, its
// weight tied to the word embedding or its own output_layer.weight with
// --untie-embeddings-and-output-weights) -> vocab-parallel cross entropy (Megatron's
// _VocabParallelCrossEntropy: three all-reduces of s·b values, never of logits).
// Saved per head area: the final norm's statistics, its gathered output [s, b, h], the logits
// [s·b, V/tp] (overwritten by their gradient in the backward) and the softmax statistics.
// Vocabulary padding (columns beyond the tokenizer's vocabulary) takes no probability mass and no
// gradient, so losses do not depend on the padding (docs/architecture.md, "Vocabulary padding").
#pragma once
#include <vector>

#include "model/layers/linear.h"
#include "model/layers/norm.h"

namespace mt {

class LanguageModelHead {
 public:
  /// tied_weight: the word embedding on this rank when the output layer shares it and this rank
  /// holds the embedding; nullptr otherwise (then, when tied, this head declares the last stage's
  /// copy embedding.word_embeddings.weight, flagged shared_embedding_copy; when untied,
  /// output_layer.weight). One registry group.
  LanguageModelHead(const TransformerConfig& config, const TensorParallelRegion& tp, ParamRegistry& registry,
                    const ParamRef* tied_weight);
  LanguageModelHead(const LanguageModelHead&) = delete;
  LanguageModelHead& operator=(const LanguageModelHead&) = delete;

  size_t param_group() const { return group_; }
  /// The output layer's weight (this rank's vocabulary shard [V/tp, h]).
  const ParamRef& output_weight() const { return output_layer_.weight(); }
  /// Plans the open head area and the head's scratch.
  void plan(BufferPlanner& planner, int64_t s, int64_t b);
  /// From the last layer's output x [s_l, b, h]: logits (kept in the area), and with compute_loss
  /// the per-token losses, accumulating loss_accum[0] += loss_weight · Σ losses (fp32 [1]).
  void forward(const Tensor& x, const Tensor& loss_accum, float loss_weight, bool compute_loss, const StepContext& ctx);
  /// dx [s_l, b, h] (overwrite) of grad_scale · loss_scale[0] · Σ loss_mask · losses; x is the
  /// forward's input. loss_scale: fp32 [1] on the device or empty (1).
  void backward(const Tensor& dx, const Tensor& x, float grad_scale, const Tensor& loss_scale, const StepContext& ctx);
  /// Logits [s·b, V/tp] of `area` (row = i_s·b + i_b; this rank's vocabulary shard).
  Tensor logits(int area) const { return saved_.at(static_cast<size_t>(area)).logits; }

 private:
  struct Saved {
    Tensor logits, ce_max, ce_sumexp;
  };
  const TransformerConfig& config_;
  const TensorParallelRegion& tp_;
  size_t group_;
  int64_t vocab_start_;
  int64_t valid_cols_;  // this rank's columns that are real vocabulary (the rest is padding)
  Norm final_layernorm_;
  ColumnParallelLinear output_layer_;
  std::vector<Saved> saved_;
  Tensor ce_local_max_, ce_target_, losses_;  // scratch fp32 [s·b]
};

}  // namespace mt
