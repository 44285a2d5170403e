// The model interface the pipeline executor, the trainer, checkpoints and generation work against
// (docs/architecture.md "Modules"): one rank's model chunks (pipeline stages, Megatron's
// model[vp_stage]) with explicit forward and backward per chunk, their activation buffers, and the
// parameter store. GPTModel (model/gpt_model.h) implements it for every decoder-only architecture
// its TransformerConfig describes.
#pragma once
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/layers/output_head.h"
#include "model/module.h"
#include "model/param_hooks.h"
#include "model/params.h"
#include "model/transformer_config.h"
#include "parallel/pipeline/layer_split.h"

namespace mt {

/// One model chunk of this rank: the layers [layers.begin, layers.end) in global numbering,
/// whether it holds the embedding (pipeline stage 0, Megatron pre_process) and/or the final norm +
/// LM head + loss (the last stage, post_process), and its buffer counts (train/pipeline.h computes
/// them from the schedule).
struct ModelChunk {
  pipeline::LayerRange layers;
  int inputs = 1;      ///< input buffers [s_l, b, h]: inputs held, including received ones not yet forwarded
  int loss_slots = 1;  ///< loss chunk: saved head activations (final norm, logits) of forwarded micro-batches
};
/// This rank's chunks and its activation slots. A slot holds the saved activations of one
/// forward of any chunk (sized for the chunk that needs the most), so the slots alive at once are
/// the schedule's forwarded-not-yet-backwarded micro-batches over all chunks (Megatron's bound),
/// not a per-chunk sum. Empty chunks = the whole model as one chunk.
struct ModelLayout {
  std::vector<ModelChunk> chunks;
  int activation_slots = 1;
  /// The loss chunk's logits: whole (the default; inference: logits()) or in chunks of rows
  /// (training, model_layout in train/pipeline.h).
  HeadOptions head;
};
/// Which buffers one forward/backward of a chunk uses (ModelChunk / ModelLayout).
struct ChunkBuffers {
  int slot = 0;   ///< activation slot
  int input = 0;  ///< the chunk's input buffer
  int head = 0;   ///< the loss chunk's head slot
};

class LanguageModel {
 public:
  virtual ~LanguageModel() = default;

  virtual const TransformerConfig& config() const = 0;
  virtual ParamStore& params() = 0;
  virtual const ParamStore& params() const = 0;
  virtual const ProcessGroups& groups() const = 0;
  virtual int64_t micro_batch() const = 0;
  virtual DType dtype() const = 0;
  virtual Device device() const = 0;
  /// Vocabulary padded for this model's tensor-parallel size.
  virtual int64_t padded_vocab() const = 0;
  /// Bytes of the planned activation and workspace memory.
  virtual size_t activation_bytes() const = 0;

  // --- model chunks (pipeline parallelism; train/pipeline.h drives them) ---
  virtual int num_chunks() const = 0;
  virtual const ModelChunk& chunk(int c) const = 0;
  virtual int activation_slots() const = 0;
  /// Activation shape of one stage boundary: [s_l, b, h].
  virtual std::vector<int64_t> boundary_shape() const = 0;
  /// Input buffer `input` [s_l, b, h] of chunk c: the receive buffer of a chunk without the
  /// embedding (the previous stage's output lands here and stays until the backward that reads
  /// it); written by the embedding otherwise.
  virtual Tensor chunk_input(int c, int input) const = 0;
  /// Output [s_l, b, h] of chunk c after forward_chunk with these buffers (what the next stage
  /// receives).
  virtual Tensor chunk_output(int c, const ChunkBuffers& buf) const = 0;
  /// Forward of micro-batch mb through chunk c, saving activations in buf.slot (and buf.head for
  /// the loss chunk); its input must be in chunk_input(c, buf.input) unless the chunk has the
  /// embedding, which writes it there. Returns the chunk's output [s_l, b, h] (valid until the slot
  /// is reused; empty for the loss chunk, which instead accumulates loss_accum[0] +=
  /// loss_weight · Σ losses). first_forward: the chunk's first forward of the step (params_needed
  /// hooks are called). compute_loss = false: the loss chunk only produces logits (generation;
  /// models planned with ModelLayout::head.keep_logits). head_grad (loss chunk): this micro-batch's
  /// backward_chunk follows with these scales, so the head makes its gradients in the forward
  /// (model/layers/output_head.h); nullptr: the backward recomputes the logits.
  virtual Tensor forward_chunk(int c, const ChunkBuffers& buf, const MicroBatch& mb, const DropoutContext& dc,
                               const Tensor& loss_accum, float loss_weight, const Stream& stream,
                               bool first_forward = false, bool compute_loss = true,
                               const HeadGrad* head_grad = nullptr) = 0;
  /// Backward of micro-batch mb through chunk c from the buffers its forward used. grad
  /// [s_l, b, h] (activation dtype): on entry dL/d(output) (ignored by the loss chunk), on exit
  /// dL/d(input) (unspecified for the embedding chunk); empty = internal scratch (chunks with both
  /// embedding and loss). Weight gradients accumulate (+=) into the fp32 main gradients, of
  /// grad_scale · loss_scale[0] · Σ loss_mask · losses (loss_scale: fp32 [1] or empty = 1).
  /// last_backward: the chunk's last backward of the step: after each layer (and the head and the
  /// embedding) the TP all-reduce of partial replicated gradients runs and
  /// hooks()->grads_ready is called (param_hooks.h).
  virtual void backward_chunk(int c, const ChunkBuffers& buf, const MicroBatch& mb, const DropoutContext& dc,
                              const Tensor& grad, float grad_scale, const Tensor& loss_scale, const Stream& stream,
                              bool last_backward) = 0;
  /// Logits [s·b, V/tp] of the loss chunk's head slot `head` after its forward (row = i_s·b +
  /// i_b; this rank's vocabulary shard); empty without a loss chunk.
  virtual Tensor logits(int head = 0) const = 0;

  // --- data-parallel hooks and the tied embedding ---
  virtual ParamGradHooks* hooks() const = 0;
  virtual void set_hooks(ParamGradHooks* hooks) = 0;
  /// Index in params() of the word embedding (or the last stage's copy of it) when the last stage
  /// holds it too (a tied output layer, or multi-token prediction); ParamStore::kNoParam otherwise
  /// or when this rank holds neither.
  virtual size_t word_embedding_index() const = 0;

  // --- per-layer CUDA graphs ---
  /// The layers run their scoped regions through `graphs` (model/layer_graphs.h; nullptr: eager).
  /// The caller owns it and keeps it alive while the model runs. With graphs the step's first
  /// weight-gradient writes no longer overwrite (ParamStore::set_grad_overwrite(false)): a
  /// captured backward replays for every micro-batch.
  virtual void set_layer_graphs(LayerGraphs* graphs) = 0;

  // --- per-step hooks of the training loop (train/train_step.h, train/training_logger.h) ---
  /// Once per training step, after the last backward, the tied embedding's reduction and the end of
  /// the data-parallel gradient reduction, before the optimizer step (inside the captured region
  /// of a full-iteration CUDA graph): the model's own per-step state updates, ordered on `stream`
  /// without host synchronisation. GPTModel: per MoE layer, the aux-loss-free expert-bias update
  /// over the data-parallel group (--moe-router-enable-expert-bias; collective over DP) and the
  /// restart of the step's global_aux_loss token counts (Megatron's finalize_model_grads and
  /// reset_global_aux_loss_tracker); nothing for a dense model.
  virtual void finish_step(const Stream& stream) = 0;
  /// The model's part of the training log line over the `iterations` since the previous call (for
  /// MoE models Megatron's track_moe_metrics: model/moe/moe_metrics.h; "" for a dense model), then
  /// restarts the statistics. Collective over `world` (every rank calls it at the same log points);
  /// synchronises `stream`.
  virtual std::string log_statistics(Communicator& world, int64_t iterations, const Stream& stream) = 0;
  /// Model state that is not a parameter but belongs in checkpoints (Megatron's persistent
  /// buffers). GPTModel: for each MoE layer of this rank with --moe-router-enable-expert-bias,
  /// ("decoder.layers.<L>.mlp.router.expert_bias", fp32 [E] on the device), replicated over
  /// TP, DP and EP; with FP8 delayed scaling each layer's fp8_meta blocks (model/fp8/fp8_model.h).
  /// The tensors may be written in place (checkpoint load: then call load_persistent_state).
  /// Ordered on `stream` (may synchronise it).
  virtual std::vector<std::pair<std::string, Tensor>> persistent_state(const Stream& stream) const = 0;
  /// After a checkpoint load wrote persistent_state's tensors: the model takes them over (the FP8
  /// state is stored packed and used in a 16-byte strided layout). Ordered on `stream` (may
  /// synchronise it).
  virtual void load_persistent_state(const Stream& stream) = 0;
};

}  // namespace mt
