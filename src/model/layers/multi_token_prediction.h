// Multi-token prediction (DeepSeek-V3, arXiv:2412.19437 §2.2; Megatron-Core
// transformer/multi_token_prediction.py MultiTokenPredictionBlock / MultiTokenPredictionLayer),
// after the decoder on the last pipeline stage (Megatron's placement without a custom layout).
// Depth k = 1..D (index d = k − 1) predicts the token k + 1 positions ahead of each position i:
//   e_k   = dropout(Emb(t_{i+k}))                 the shared word embedding of the tokens rolled k
//   h'_k  = eh_proj([enorm(e_k); hnorm(h_{k−1})])  eh_proj [h, 2h] (ColumnParallelLinear, no bias)
//   h_k   = final_layernorm_k(TransformerLayer_k(h'_k))
//   L_k   = CE(output_layer(h_k), labels rolled k)  the shared output layer, vocab-parallel
// with h_0 the decoder's final-norm output (Megatron-Core applies decoder.final_layernorm inside the
// decoder, so the MTP reads the normalised hidden state) and the MTP loss λ/D · Σ_k L_k added to
// the LM loss for the backward (λ = --mtp-loss-scaling-factor). The transformer layer has the
// last decoder layer's spec (dense or MoE). Rolled positions at the end of a sequence get token 0
// and weight 0 (the labels are not known there).
//
// Shapes: s_l = s/tp with sequence parallelism (else s), b micro-batch, h hidden. Tensor
// parallelism: eh_proj is split by output rows as Megatron's ([h/tp, 2h]); its [s, b, h/tp] output
// is gathered along h (Megatron's gather_from_tensor_model_parallel_region, then the SP scatter) as
// the TP region's reduction of the output placed in its column block of zeros — exactly the
// gather, at an all-reduce's (reduce-scatter's) cost. Parameter names (Megatron-Core):
// mtp.layers.<d>.{enorm,hnorm,final_layernorm}.weight (+ .bias for LayerNorm),
// mtp.layers.<d>.eh_proj.weight, mtp.layers.<d>.transformer_layer.* (the decoder layer's names);
// the layer is numbered num_layers + d for dropout keys and MoE statistics (Megatron's MTP
// router numbering). Saved per head area and depth: the embedding output, the layer input and
// what eh_proj, the layer and the depth's head save.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "model/layers/linear.h"
#include "model/layers/norm.h"
#include "model/layers/output_head.h"
#include "model/layers/transformer_layer.h"

namespace mt {

/// The MTP inputs of one micro-batch (MicroBatch::mtp_*), on the host, [D, s, b] (s-major, as the
/// model's [s, b]): for depth k (index k − 1) tokens[k−1][i] = tokens[i + k], labels[k−1][i] =
/// labels[i + k] (0 for i + k >= s; Megatron's roll_tensor, shifts −1, applied k times) and
/// loss_mask[k−1][i] = m[i + k] · n_0 / n_k (0 for i + k >= s), where m is the micro-batch's
/// loss_mask (nullptr: 1 everywhere), n_0 its nonzero entries and n_k those of m rolled k: the
/// main loss weighs a token m[i], Megatron's depth-k loss its rolled mask / n_k against the main
/// loss's / n_0. Errors: mt::Error for depths < 1 or s, b < 1.
struct MtpInputs {
  std::vector<int32_t> tokens, labels;
  std::vector<float> loss_mask;
};
MtpInputs make_mtp_inputs(int64_t depths, int64_t s, int64_t b, const int32_t* tokens, const int32_t* labels,
                          const float* loss_mask);

class MultiTokenPrediction {
 public:
  /// spec: the last decoder layer's; word_embedding: this rank's vocabulary shard [V/tp, h] of the
  /// word embedding (the embedding's, or the last stage's copy of a tied one, the output layer's
  /// weight), or nullptr: an untied model's last pipeline stage, where the MTP declares the copy
  /// itself (embedding.word_embeddings.weight flagged shared_embedding_copy, in depth 0's group;
  /// Megatron-Core's post-process embedding for MTP, its gradient all-reduced with the first
  /// stage's over the embedding group); output_weight: the main head's output layer weight.
  /// Declares, per depth, a registry group (norms, eh_proj, final norm) and the layer's group.
  MultiTokenPrediction(const TransformerConfig& config, const LayerSpec& spec, const TensorParallelRegion& tp,
                       const ExpertParallel& ep, ParamRegistry& registry, const ParamRef* word_embedding,
                       const ParamRef& output_weight);
  ~MultiTokenPrediction();
  MultiTokenPrediction(const MultiTokenPrediction&) = delete;
  MultiTokenPrediction& operator=(const MultiTokenPrediction&) = delete;

  int64_t depths() const { return static_cast<int64_t>(depth_.size()); }
  /// The parameter uses of a depth, in the order of its forward (the backward runs them in
  /// reverse): the embedding's lookup of the rolled tokens (reads the word embedding), the input
  /// part (enorm, hnorm, eh_proj: the depth's group), the transformer layer (its group), the head
  /// (final_layernorm in the depth's group and the shared output layer). The embedding's backward
  /// reads no parameter (it only accumulates the word embedding's gradient) and is no use.
  enum class Use { kEmbedding, kInput, kLayer, kHead };
  /// Called with begin = true before a use's first kernel is enqueued on `stream` and with begin =
  /// false after its last (backward: in the backward pass), so that sharded parameters
  /// (model/param_hooks.h params_every_use) can be gathered for exactly these uses. Uses do not
  /// nest. Default: none.
  using UseHook = std::function<void(int64_t depth, Use use, bool backward, bool begin, const Stream& stream)>;
  void set_use_hook(UseHook hook) { use_hook_ = std::move(hook); }
  /// The word embedding the depths embed with (the one given, or the copy declared).
  const ParamRef& word_embedding() const { return *word_; }
  /// The registry groups of depth d: its norms, eh_proj and final norm; its transformer layer.
  size_t param_group(int64_t d) const;
  TransformerLayer& layer(int64_t d) const;
  /// Plans depth by depth in the open head area (called for every head area).
  void plan(BufferPlanner& planner, int64_t s, int64_t b, const HeadOptions& options);
  /// Every depth's forward from h0 [s_l·b, h] (the main head's norm_output of ctx.slot; the
  /// micro-batch carries mtp_tokens / mtp_labels / mtp_loss_mask). losses fp32 [D] on the device:
  /// losses[d] += loss_weight · Σ weights · CE of depth d (the logged "mtp_<d+1> loss"). grad: as
  /// LanguageModelHead::forward, with the depths' grad_scale already multiplied by λ/D.
  /// Errors: mt::Error naming a missing or misshapen MTP input.
  void forward(const Tensor& h0, const Tensor& losses, float loss_weight, const HeadGrad* grad,
               const StepContext& ctx);
  /// Every depth's backward, the last first, of grad_scale · λ/D · loss_scale · Σ_d L_d: the weight
  /// gradients accumulate (the shared word embedding's and output layer's too); returns dL/dh0
  /// [s_l, b, h] (scratch, valid until the next MTP call) for the main head's final norm backward.
  /// done(group): called when a registry group's gradients are complete on this rank.
  Tensor backward(const Tensor& h0, float grad_scale, const Tensor& loss_scale, const StepContext& ctx,
                  const std::function<void(size_t)>& done);

 private:
  struct Depth;
  struct Saved {
    Tensor embedding, layer_in;  // [s_l, b, h]
  };
  // The micro-batch of depth d: the rolled tokens, labels and loss weights of ctx.batch.
  MicroBatch depth_batch(const MicroBatch& mb, int64_t d) const;
  void embed(const Depth& dp, const MicroBatch& mb, int64_t d, const Tensor& out, const StepContext& ctx);
  void embed_backward(int64_t d, const MicroBatch& mb, const Tensor& d_out, const StepContext& ctx);
  void use(int64_t d, Use u, bool backward, bool begin, const Stream& stream) const {
    if (use_hook_) use_hook_(d, u, backward, begin, stream);
  }
  const TransformerConfig& config_;
  const TensorParallelRegion& tp_;
  UseHook use_hook_;
  ParamRef word_copy_;     // declared when no word embedding is given (untied, last stage)
  const ParamRef* word_;   // the given word embedding or word_copy_
  int64_t vocab_start_;
  std::vector<std::unique_ptr<Depth>> depth_;
  std::vector<std::vector<Saved>> saved_;  // [area][depth]
  int64_t seq_ = 0, seq_local_ = 0, batch_ = 0;
  // scratch
  Tensor norm_e_, norm_h_;     // [s_l·b, h]: enorm / hnorm outputs (copied into eh_proj's input halves)
  Tensor proj_out_, proj_full_;  // TP > 1: eh_proj's [s·b, h/tp] output and the [s·b, h] placed in its block
  Tensor embed_full_;          // SP: the embedding's [s, b, h] partial sum before the reduce-scatter
  Tensor grad_, hidden_grad_, embed_grad_;  // [s_l, b, h]
};

}  // namespace mt
