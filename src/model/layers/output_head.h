// The language-model head of the last pipeline stage (Megatron-Core GPTModel's post_process):
// decoder.final_layernorm -> output_layer (ColumnParallelLinear over the padded vocabulary, its
// weight tied to the word embedding or its own output_layer.weight with
// --untie-embeddings-and-output-weights) -> vocab-parallel cross entropy (Megatron's
// _VocabParallelCrossEntropy: three all-reduces of s·b values, never of logits).
//
// Logits in chunks of rows (the "fused linear cross entropy" of Liger-Kernel / torchtune's chunked
// loss): the [s·b, V/tp] logits are never held whole. The rows are cut into the fewest chunks of
// equal rows whose logits fit HeadOptions::chunk_bytes; each chunk's logits live in one shared
// scratch. When the forward is
// told the backward that follows (HeadGrad: the pipeline executor's training forwards), each
// chunk's gradient is made at once: logits, softmax statistics and losses, the logits overwritten
// by their gradient, dx rows = dlogits·W and dW += dlogitsᵀ·x; the head's backward then only runs
// the final norm's backward from the saved dx. Otherwise (evaluation, or a caller that gives its
// scales only to backward) the forward keeps the statistics and the backward recomputes each
// chunk's logits (one more GEMM). Models for inference keep the whole logits (keep_logits; logits()).
// Saved per head area: the final norm's statistics, its gathered output [s, b, h], the softmax
// statistics [s·b] and dL/d(norm output) [s_l·b, h].
// Vocabulary padding (columns beyond the tokenizer's vocabulary) takes no probability mass and no
// gradient, so losses do not depend on the padding (docs/architecture.md, "Vocabulary padding").
#pragma once
#include <string>
#include <vector>

#include "model/layers/linear.h"
#include "model/layers/norm.h"

namespace mt {

/// How the head holds its logits (ModelLayout).
struct HeadOptions {
  /// Keep the whole [s·b, V/tp] logits of each forward (logits(); inference). Training models
  /// (train/pipeline.h model_layout) hold one chunk of rows at a time instead.
  bool keep_logits = true;
  /// Otherwise the logits of one chunk of rows take at most this many bytes (at least one row).
  size_t chunk_bytes = size_t{256} << 20;
};

/// The scales of the backward that follows a forward (PipelineExecutor: grad_scale = the
/// micro-batch's loss weight, loss_scale = the optimizer's dynamic loss scale, fp32 [1] on the
/// device, or empty = 1).
struct HeadGrad {
  float grad_scale = 1.f;
  Tensor loss_scale;
};

class LanguageModelHead {
 public:
  /// tied_weight: the word embedding on this rank when the output layer shares it and this rank
  /// holds the embedding; nullptr otherwise (then, when tied, this head declares the last stage's
  /// copy embedding.word_embeddings.weight, flagged shared_embedding_copy; when untied,
  /// output_layer.weight). One registry group.
  LanguageModelHead(const TransformerConfig& config, const TensorParallelRegion& tp, ParamRegistry& registry,
                    const ParamRef* tied_weight);
  /// The head of a multi-token prediction depth (model/layers/multi_token_prediction.h): its own
  /// final norm <norm_prefix>.weight and the output layer weight `shared_output` of the main head
  /// (tied or not), declared into the registry group open now (no group of its own).
  LanguageModelHead(const TransformerConfig& config, const TensorParallelRegion& tp, ParamRegistry& registry,
                    const std::string& norm_prefix, const ParamRef* shared_output);
  LanguageModelHead(const LanguageModelHead&) = delete;
  LanguageModelHead& operator=(const LanguageModelHead&) = delete;

  size_t param_group() const { return group_; }
  /// The output layer's weight (this rank's vocabulary shard [V/tp, h]).
  const ParamRef& output_weight() const { return output_layer_.weight(); }
  /// Plans the open head area and the head's scratch (the same options for every area).
  void plan(BufferPlanner& planner, int64_t s, int64_t b, const HeadOptions& options);
  /// From the last layer's output x [s_l, b, h]: with compute_loss the per-token losses,
  /// accumulating loss_accum[0] += loss_weight · Σ losses (fp32 [1]); without, only the logits
  /// (keep_logits models). grad: the backward of this micro-batch follows with these scales, and
  /// the head's gradients are made now (weight gradients accumulate into the main gradients here).
  /// Errors: mt::Error for compute_loss = false without keep_logits, or grad without compute_loss.
  void forward(const Tensor& x, const Tensor& loss_accum, float loss_weight, bool compute_loss,
               const HeadGrad* grad, const StepContext& ctx);
  /// dx [s_l, b, h] (overwrite) of grad_scale · loss_scale[0] · Σ loss_mask · losses; x is the
  /// forward's input. loss_scale: fp32 [1] on the device or empty (1). After a forward with
  /// HeadGrad only the final norm's backward runs here. dln_add [s_l, b, h] (or empty): a gradient of
  /// the final norm's output from elsewhere (the MTP's first depth reads it), added before the norm's
  /// backward. Errors: mt::Error when that forward's scales differ from these, or the forward
  /// computed no loss.
  void backward(const Tensor& dx, const Tensor& x, float grad_scale, const Tensor& loss_scale, const StepContext& ctx,
                const Tensor& dln_add = Tensor());
  /// This rank's rows of the final norm's output of `area` after a forward: [s_l·b, h] (a view of
  /// the saved output layer input, valid until the area's next forward).
  Tensor norm_output(int area) const;
  /// Logits [s·b, V/tp] of `area` (row = i_s·b + i_b; this rank's vocabulary shard) after a
  /// forward; keep_logits models only (empty otherwise).
  Tensor logits(int area) const;
  /// Rows per chunk of the planned head (all rows with keep_logits).
  int64_t chunk_rows() const { return chunk_rows_; }

 private:
  struct Saved {
    Tensor logits;  // keep_logits: [s·b, V/tp]
    Tensor ce_max, ce_sumexp;
    Tensor dln;  // [s_l·b, h]: dL/d(final norm output), made by the chunks' dgrad GEMMs
    // Host state of the area's last forward: whether it made the gradients, with which scales.
    bool has_loss = false, has_grad = false;
    float grad_scale = 0.f;
    const void* loss_scale = nullptr;
  };
  /// The chunk loop: each chunk's logits; with `stats` its softmax statistics and losses (added to
  /// loss_accum), else the saved statistics; with `grad` its gradients (dx rows into dx_full, dW).
  /// Where the chunks' dgrad rows go: the output layer's gathered-rows scratch under SP (then
  /// reduce-scattered into H.dln), else H.dln itself (all-reduced in place under TP).
  Tensor dln_full(const Saved& H) const;
  void run_chunks(const Saved& H, bool stats, const Tensor& loss_accum, float loss_weight, const HeadGrad* grad,
                  const Tensor& dx_full, const StepContext& ctx);
  const TransformerConfig& config_;
  const TensorParallelRegion& tp_;
  size_t group_;
  int64_t vocab_start_;
  int64_t valid_cols_;  // this rank's columns that are real vocabulary (the rest is padding)
  Norm final_layernorm_;
  ColumnParallelLinear output_layer_;
  std::vector<Saved> saved_;
  int64_t chunk_rows_ = 0;
  Tensor chunk_logits_;                        // scratch [chunk_rows, V/tp] (without keep_logits)
  Tensor ce_local_max_, ce_target_, losses_;  // scratch fp32 [s·b]
};

}  // namespace mt
