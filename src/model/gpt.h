// GPT model with the GPT-2 architecture (Radford et al. 2019; Megatron-Core GPTModel with
// --transformer-impl local): pre-LayerNorm decoder layers, learned absolute position
// embeddings, tied input/output word embedding, biases everywhere, GELU MLP.
// Explicit forward and backward (DESIGN.md principle 1): activations live in an arena planned
// once for (config, micro-batch, dtype); nothing is allocated per step.
//
// Shapes (Megatron's [s, b, h] order): s = seq_length, b = micro-batch, h = hidden,
// n = heads, d = h / n, f = ffn hidden, V = padded vocabulary.
#pragma once
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "model/config.h"
#include "model/param_hooks.h"
#include "model/params.h"
#include "ops/attention.h"
#include "parallel/pipeline/layer_split.h"

namespace mt {

/// One micro-batch on the model's device. tokens, labels: int32 [s, b]; loss_mask: fp32 [s, b]
/// or empty (all ones); position_ids: int32 [s, b] or empty (0..s-1, --reset-position-ids fills
/// it); doc_start: int32 [b, s] or empty (plain causal; --reset-attention-mask: query i attends
/// to keys doc_start[b, i] .. i). loss_weight: weight of one unmasked token's loss in the
/// iteration's loss (1 / (unmasked tokens of the micro-batch · micro-batches · DP), Megatron's
/// per-micro-batch mean averaged over micro-batches and DP ranks).
struct MicroBatch {
  Tensor tokens, labels, loss_mask;
  Tensor position_ids, doc_start;
  float loss_weight = 1.f;
};

/// Where in training a forward/backward runs; keys the dropout masks (DESIGN.md principle 4).
struct DropoutContext {
  uint64_t seed = 0;
  uint64_t iteration = 0;
  uint32_t microbatch = 0;
  bool training = true;  ///< false: no dropout (evaluation, generation)
};

/// One model chunk of this rank (pipeline parallelism, Megatron's model[vp_stage]): the layers
/// [layers.begin, layers.end) in global numbering, whether it holds the embedding (pipeline stage
/// 0, Megatron pre_process) and/or the final norm + LM head + loss (the last stage,
/// post_process), and its buffer counts (train/pipeline.h computes them from the schedule).
struct ModelChunk {
  pipeline::LayerRange layers;
  int inputs = 1;      ///< input buffers [s_l, b, h]: inputs held, including received ones not yet forwarded
  int loss_slots = 1;  ///< loss chunk: saved head activations (final norm, logits) of forwarded micro-batches
};
/// This rank's chunks and its activation slots. A slot holds the saved activations of one
/// forward of any chunk (sized for the chunk with the most layers), so the slots alive at once
/// are the schedule's forwarded-not-yet-backwarded micro-batches over all chunks (Megatron's
/// bound), not a per-chunk sum. Empty chunks = the whole model as one chunk.
struct ModelLayout {
  std::vector<ModelChunk> chunks;
  int activation_slots = 1;
};
/// Which buffers one forward/backward of a chunk uses (ModelChunk / ModelLayout).
struct ChunkBuffers {
  int slot = 0;   ///< activation slot
  int input = 0;  ///< the chunk's input buffer
  int head = 0;   ///< the loss chunk's head slot
};

class GptModel {
 public:
  /// Builds parameters (uninitialised: call params().initialize(seed) or load a checkpoint)
  /// and plans activations for `micro_batch` sequences of config.seq_length tokens.
  /// dtype: activations and model parameters (fp32 on CPU; fp32/bf16/fp16 on CUDA).
  /// Errors: mt::Error for invalid configurations (GptConfig::validate) and out-of-memory.
  /// Tensor parallelism (Shoeybi et al. 2019, §3) over groups.tp: attention split by heads
  /// (QKV column-parallel, output projection row-parallel), MLP column then row, vocab-parallel
  /// embedding and cross entropy. sequence_parallel (Korthikanti et al. 2022): activations
  /// outside the TP regions sharded along s, all-gather / reduce-scatter instead of all-reduce.
  /// param_layout: data-parallel size and gradient bucket size of the flat buffers (params.h;
  /// an integer converts to one bucket padded for that data-parallel size).
  /// layout: this rank's model chunks and buffers (pipeline parallelism); empty = the whole
  /// model as one chunk with one of each buffer. Errors: mt::Error for an invalid configuration
  /// (GptConfig::validate), chunks that overlap or lie outside [0, num_layers), counts < 1.
  GptModel(const GptConfig& config, int64_t micro_batch, DType dtype, Device device, ProcessGroups groups,
           bool sequence_parallel = false, ParamLayout param_layout = {}, ModelLayout layout = {});
  ~GptModel();

  /// Megatron-Core parameter names (global layer numbers), local shapes and shards of TP rank
  /// `tp_rank` of `tp` (weights [out, in]; the vocabulary padded for tp) for the given chunks
  /// (empty = whole model). A rank with the loss but not the embedding (the last pipeline stage)
  /// holds a copy of the word embedding under the same name, flagged shared_embedding_copy (its
  /// gradient is all-reduced over the embedding group; layout-invariant init makes the copies
  /// start equal).
  static std::vector<ParamSpec> param_specs(const GptConfig& config, int tp = 1, int tp_rank = 0,
                                            const std::vector<pipeline::LayerRange>& chunks = {});
  const ProcessGroups& groups() const { return groups_; }
  bool sequence_parallel() const { return sp_; }

  const GptConfig& config() const { return config_; }
  ParamStore& params() { return *params_; }
  const ParamStore& params() const { return *params_; }
  int64_t micro_batch() const { return b_; }
  int64_t padded_vocab() const { return V_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  size_t activation_bytes() const { return arena_bytes_; }

  /// Whole model on one pipeline stage (one chunk with embedding and loss), slot 0.
  /// Forward of one micro-batch. Computes per-token losses and accumulates
  /// loss_accum[0] += loss_weight * sum(losses) (fp32 [1] on the device). With compute_loss =
  /// false only the logits are produced (generation).
  void forward(const MicroBatch& mb, const DropoutContext& dc, const Tensor& loss_accum, float loss_weight,
               const Stream& stream, bool compute_loss = true);
  /// Backward of the micro-batch whose forward ran last: accumulates (+=) into the fp32 main
  /// gradients the gradient of  grad_scale * loss_scale[0] * sum(loss_mask * losses),
  /// loss_scale being a device fp32 [1] tensor (the dynamic loss scale) or empty (1).
  /// last_backward: see backward_chunk.
  void backward(const MicroBatch& mb, const DropoutContext& dc, float grad_scale, const Tensor& loss_scale,
                const Stream& stream, bool last_backward = true);
  /// Logits of the last forward of the loss chunk's slot 0: [s·b, V/tp] (row = i_s·b + i_b;
  /// this rank's vocabulary shard), activation dtype.
  Tensor logits() const;

  // --- Model chunks (pipeline parallelism; train/pipeline.h drives them) ---
  int num_chunks() const { return static_cast<int>(chunk_specs_.size()); }
  const ModelChunk& chunk(int c) const;
  int activation_slots() const { return activation_slots_; }
  /// Input buffer `input` [s_l, b, h] (activation dtype) of chunk c: the receive buffer of a
  /// chunk without the embedding (the previous stage's output lands here and stays until the
  /// backward that reads it); written by the embedding otherwise.
  Tensor chunk_input(int c, int input) const;
  /// Output activation [s_l, b, h] of chunk c after forward_chunk(c, slot, input, ...) (the last
  /// layer's output in the slot; the input for a chunk without layers). What the next stage
  /// receives.
  Tensor chunk_output(int c, const ChunkBuffers& buf) const;
  /// Hooks set with set_hooks (nullptr = none).
  ParamGradHooks* hooks() const { return hooks_; }
  /// Forward of micro-batch mb through chunk c, saving activations in buf.slot (and buf.head for
  /// the loss chunk); its input must be in chunk_input(c, buf.input) unless the chunk has the
  /// embedding, which writes it there. Returns the chunk's output
  /// [s_l, b, h] (valid until the slot is reused; empty for the loss chunk, which instead
  /// accumulates its loss as forward() does). first_forward: the chunk's first forward of the
  /// step (params_needed hooks are called).
  Tensor forward_chunk(int c, const ChunkBuffers& buf, const MicroBatch& mb, const DropoutContext& dc, const Tensor& loss_accum,
                       float loss_weight, const Stream& stream, bool first_forward = false);
  /// Backward of micro-batch mb through chunk c from the buffers its forward used. grad [s_l, b, h] (activation
  /// dtype): on entry dL/d(output) (ignored by the loss chunk), on exit dL/d(input) (unspecified
  /// for the embedding chunk); empty = internal scratch (chunks with both embedding and loss).
  /// Gradients accumulate (+=) into the fp32 main gradients (scaled as in backward()).
  /// last_backward: the chunk's last backward of the step — after each layer (and the head and
  /// embedding) the sequence-parallel TP all-reduce of its replicated parameters runs and
  /// hooks()->grads_ready is called (param_hooks.h).
  void backward_chunk(int c, const ChunkBuffers& buf, const MicroBatch& mb, const DropoutContext& dc, const Tensor& grad,
                      float grad_scale, const Tensor& loss_scale, const Stream& stream, bool last_backward);
  /// Hooks called by forward_chunk / backward_chunk (not owned; nullptr = none).
  void set_hooks(ParamGradHooks* hooks) { hooks_ = hooks; }
  /// Index of the word embedding (or its copy on the last stage) in params(); ParamStore::kNoParam if this
  /// rank holds neither.
  size_t word_embedding_index() const { return gix_.wte; }
  /// Activation shape of one stage boundary: [s_l, b, h].
  std::vector<int64_t> boundary_shape() const { return {sl_, b_, h_}; }

 private:
  struct LayerActs;
  struct HeadActs;
  struct ChunkState;
  struct Workspace;
  struct LayerParamIndex {
    size_t ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b;
    size_t first, end;  // the layer's parameters are [first, end) in the ParamStore
  };
  struct GlobalParamIndex {
    size_t wte, wpe, lnf_w, lnf_b;  // ParamStore::kNoParam when this rank does not hold it
  };
  void plan(Arena& arena);
  void layer_forward(int64_t l, const LayerParamIndex& ix, const Tensor& x, LayerActs& a, const DropoutContext& dc,
                     const Stream& stream);
  // A weight-gradient GEMM (and its bias gradient) held back by layer_backward: the arguments
  // of linear_backward without dx.
  struct DeferredWgrad {
    Tensor dw, dbias, dy, x, w;
  };
  /// deferred: when given, the weight gradients of fc1, proj and qkv (whose inputs stay intact
  /// until the end of the backward) are appended there instead of computed; fc2's is computed
  /// (its output gradient buffer is reused by the attention block).
  void layer_backward(int64_t l, const LayerParamIndex& ix, const Tensor& x, LayerActs& a, const Tensor& d_resid,
                      const DropoutContext& dc, const Stream& stream, std::vector<DeferredWgrad>* deferred = nullptr);
  void grads_final(size_t first, size_t end, const Stream& stream);
  bool embedding_shared_across_stages() const;
  void check_buffers(int c, const ChunkBuffers& buf) const;  // errors naming an index out of range
  AttentionConfig attention_config(int64_t layer, const DropoutContext& dc) const;
  void embedding_forward_into(const Tensor& out, const MicroBatch& mb, const DropoutContext& dc, const Stream& st);
  Tensor head_forward(ChunkState& ch, int head, const Tensor& x, const MicroBatch& mb, const Tensor& loss_accum,
                      float loss_weight, bool compute_loss, const Stream& st);

  GptConfig config_;
  int64_t b_, s_, h_, n_, d_, f_, V_;
  int tp_, tp_rank_;
  bool sp_;
  int64_t sl_;           // local sequence length: s / tp with sequence parallelism, else s
  int64_t nl_, fl_, Vl_;  // local heads, ffn, vocabulary
  DType dtype_;
  Device device_;
  ProcessGroups groups_;
  std::unique_ptr<ParamStore> params_;
  Arena arena_;
  size_t arena_bytes_ = 0;
  std::vector<ModelChunk> chunk_specs_;
  int activation_slots_ = 1;
  std::vector<ChunkState> chunks_;
  std::vector<std::vector<LayerActs>> acts_;  // [slot][local layer of the chunk using it]
  std::unique_ptr<Workspace> ws_;
  Tensor doc_start_;  // of the micro-batch running now (attention_config reads it)
  ParamGradHooks* hooks_ = nullptr;
  std::vector<DeferredWgrad> deferred_;  // backward_chunk's held-back GEMMs (kept: no per-step allocation)
  GlobalParamIndex gix_{};
};

/// Dropout stream ids (the Philox key half of a dropout site): (layer + 1) * 8 + site.
enum DropoutSite : uint32_t { kSiteAttentionProbs = 0, kSiteAttentionOut = 1, kSiteMlpOut = 2, kSiteEmbedding = 3 };
inline uint32_t dropout_stream_id(int64_t layer, DropoutSite site) {
  return static_cast<uint32_t>((layer + 1) * 8 + site);
}

}  // namespace mt
