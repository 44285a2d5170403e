// GPTModel (Megatron-Core models/gpt/gpt_model.py): a decoder-only language model composed of
// declared parts (docs/architecture.md principle 7): LanguageModelEmbedding on the first
// pipeline stage, TransformerLayers built from the layer specs of the TransformerConfig
// (model/specs.h), and the LanguageModelHead (final norm, output layer, vocab-parallel cross
// entropy) on the last stage. One class covers GPT-2 and the Llama / Qwen family; the parameter
// list, the activation plan, gradient buckets and checkpoints all come from the parts'
// declarations.
//
// Tensor parallelism (Shoeybi et al. 2019, §3) over groups.tp: attention split by query groups,
// MLP column then row, vocab-parallel embedding and cross entropy; sequence_parallel (Korthikanti
// et al. 2022): activations outside the TP regions sharded along s (parallel/mappings.h).
// Pipeline parallelism: this rank's chunks (ModelLayout) with their buffers.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/language_model.h"
#include "model/moe/token_dispatcher.h"
#include "parallel/context_parallel.h"
#include "parallel/mappings.h"

namespace mt {

class Fp8Model;
class LanguageModelEmbedding;
class LanguageModelHead;
class TransformerLayer;
class MoELayer;

/// What a GPTModel would allocate, measured without allocating (GPTModel::memory_plan): the
/// ParamStore's flat buffers (elements) and the buffer plan (bytes): activation slots (one
/// forward's saved tensors each), the full-recompute area, the loss head's slots, scratch and the
/// persistent pipeline input buffers. The model's one activation buffer is buffer_bytes().
struct ModelMemoryPlan {
  ParamStore::Plan params;
  size_t activation_slot_bytes = 0;
  int activation_slots = 0;
  size_t recompute_bytes = 0;
  size_t head_slot_bytes = 0;
  int head_slots = 0;
  size_t scratch_bytes = 0, persistent_bytes = 0;
  size_t fp8_bytes = 0;  ///< of persistent_bytes: FP8 weight copies and scaling state (--fp8-format)
  std::vector<std::string> fp8_weights;  ///< the FP8 linears' weight names (Fp8Model::weight_names)
  size_t boundary_bytes = 0;  ///< one pipeline boundary tensor (boundary_shape(), activation dtype)
  size_t buffer_bytes() const {
    return persistent_bytes + activation_slot_bytes * static_cast<size_t>(activation_slots) + recompute_bytes +
           head_slot_bytes * static_cast<size_t>(head_slots) + scratch_bytes;
  }
};

class GPTModel final : public LanguageModel {
 public:
  /// The sizes the constructor with these arguments would allocate (ModelMemoryPlan), without
  /// allocating them (small per-layer state of MoE / CP regions aside). Errors: as the constructor.
  static ModelMemoryPlan memory_plan(const TransformerConfig& config, int64_t micro_batch, DType dtype, Device device,
                                     ProcessGroups groups, bool sequence_parallel = false,
                                     ParamLayout param_layout = {}, ModelLayout layout = {});
  /// Builds parameters (uninitialised: call params().initialize(seed) or load a checkpoint) and
  /// plans activations for `micro_batch` sequences of config.seq_length tokens.
  /// dtype: activations and model parameters (fp32 on CPU; fp32/bf16/fp16 on CUDA).
  /// param_layout: data-parallel size and gradient bucket size of the flat buffers (params.h).
  /// layout: this rank's model chunks and buffers; empty = the whole model as one chunk with one
  /// of each buffer. Errors: mt::Error for an invalid configuration (TransformerConfig::validate),
  /// chunks that overlap or lie outside [0, num_layers), counts < 1, a non-fp32 dtype on the CPU,
  /// and out-of-memory.
  GPTModel(const TransformerConfig& config, int64_t micro_batch, DType dtype, Device device, ProcessGroups groups,
           bool sequence_parallel = false, ParamLayout param_layout = {}, ModelLayout layout = {});
  ~GPTModel() override;
  /// A model with the same chunks and the same parameters as this one (shared, not copied: it
  /// reads this model's ParamStore, which must outlive it), planned for `micro_batch` sequences of
  /// `seq_length` tokens, one activation slot, without sequence parallelism. For inference: a
  /// prefill model (prompt length) and a decode model (1 token) beside the training-shaped one
  /// (train/inference.h). The persistent state (MoE expert biases) is copied on `stream`.
  /// Errors: as the constructor (e.g. seq_length beyond the learned positions).
  std::unique_ptr<GPTModel> planned_for(int64_t seq_length, int64_t micro_batch, const Stream& stream) const;
  GPTModel(const GPTModel&) = delete;
  GPTModel& operator=(const GPTModel&) = delete;

  /// The parameter specs of TP rank `tp_rank` of `tp` for the given chunks (empty = whole model),
  /// in ParamStore order, with Megatron-Core's names (global layer numbers), local shapes and
  /// shard boxes. A rank with the loss but not the embedding of a tied model, or of an untied one
  /// with --mtp-num-layers, holds a copy of the word embedding under the same name, flagged
  /// shared_embedding_copy.
  /// ep, ep_rank: expert parallelism (the experts of EP rank ep_rank; expert TP = TP).
  static std::vector<ParamSpec> param_specs(const TransformerConfig& config, int tp = 1, int tp_rank = 0,
                                            const std::vector<pipeline::LayerRange>& chunks = {}, int ep = 1,
                                            int ep_rank = 0);

  /// The context-parallel checks of a CP size > 1 (none for 1), before any communication:
  /// validate_context_parallel (parallel/context_parallel.h) with config.cp_comm_type and
  /// hierarchical_context_parallel_sizes. Returns the options. Errors: mt::Error naming the
  /// values. Dropout is allowed: the masks are those of one rank (cp_dropout, ops/context_attention.h).
  static ContextParallelOptions validate_context_parallel(const TransformerConfig& config, int cp, int tp);

  // LanguageModel
  const TransformerConfig& config() const override { return config_; }
  ParamStore& params() override { return *params_; }
  const ParamStore& params() const override { return *params_; }
  const ProcessGroups& groups() const override { return groups_; }
  int64_t micro_batch() const override { return micro_batch_; }
  DType dtype() const override { return dtype_; }
  Device device() const override { return device_; }
  int64_t padded_vocab() const override { return config_.padded_vocab_size(tp_.size()); }
  size_t activation_bytes() const override;
  int num_chunks() const override { return static_cast<int>(chunk_specs_.size()); }
  const ModelChunk& chunk(int c) const override;
  int activation_slots() const override { return activation_slots_; }
  std::vector<int64_t> boundary_shape() const override;
  Tensor chunk_input(int c, int input) const override;
  Tensor chunk_output(int c, const ChunkBuffers& buf) const override;
  Tensor forward_chunk(int c, const ChunkBuffers& buf, const MicroBatch& mb, const DropoutContext& dc,
                       const Tensor& loss_accum, float loss_weight, const Stream& stream, bool first_forward = false,
                       bool compute_loss = true, const HeadGrad* head_grad = nullptr) override;
  void backward_chunk(int c, const ChunkBuffers& buf, const MicroBatch& mb, const DropoutContext& dc,
                      const Tensor& grad, float grad_scale, const Tensor& loss_scale, const Stream& stream,
                      bool last_backward) override;
  Tensor logits(int head = 0) const override;
  ParamGradHooks* hooks() const override { return hooks_; }
  void set_hooks(ParamGradHooks* hooks) override { hooks_ = hooks; }
  size_t word_embedding_index() const override { return word_embedding_index_; }
  void set_layer_graphs(LayerGraphs* graphs) override {
    layer_graphs_ = graphs;
    params_->set_grad_overwrite(graphs == nullptr);
  }
  void finish_step(const Stream& stream) override;
  /// The MoE statistics (moe_metrics.h) and, with --mtp-num-layers, Megatron's " mtp_<k> loss" per
  /// depth: the mean over the iterations of the micro-batches' weighted depth-k cross entropy (the
  /// LM loss's weighting; without the scaling factor).
  std::string log_statistics(Communicator& world, int64_t iterations, const Stream& stream) override;
  /// The MTP losses summed since the last log_statistics on this rank (fp32 [D]; empty without MTP
  /// on this rank). For tests.
  Tensor mtp_losses() const { return mtp_losses_; }
  std::vector<std::pair<std::string, Tensor>> persistent_state(const Stream& stream) const override;
  void load_persistent_state(const Stream& stream) override;

  // --- the MoE statistics and per-step pieces the hooks above compose (also for tests) ---
  /// The MoE statistics of this rank's MoE layers accumulated by the training forwards since
  /// reset_moe_stats(), copied from the device (synchronises `stream`): per global layer l the
  /// P = kMoeStatLosses + num_moe_experts values at [l·P, (l + 1)·P) — the load-balancing loss of
  /// each type at static_cast<int>(type) (aux_loss, seq_aux_loss, global_aux_loss; 0 when off;
  /// global_aux_loss's weighted by aux_loss_weight·DP, so that the sum over the world is Megatron's
  /// global_load_balancing_loss: the mean over micro-batches of the global micro-batch's loss), the
  /// z-loss at kMoeStatZLoss (each weighted by its micro-batch's aux_loss_weight), then tokens
  /// routed per expert counted over the TP × CP group — zeros for dense layers and layers of other
  /// ranks. Summed over every rank of the world the losses are the step's mean per layer
  /// (Megatron's load_balancing_loss / z_loss before the average over layers) and the counts TP·CP
  /// times the tokens routed.
  std::vector<double> moe_loss_stats(const Stream& stream) const;
  /// The token dispatchers' statistics of this rank's MoE layers since reset_moe_stats()
  /// (MoELayer::dispatch_stats; may synchronise `stream`): rerouted, overflowed and dispatches
  /// summed over the layers, max_received the largest of any layer.
  MoeDispatchStats moe_dispatch_stats(const Stream& stream) const;
  void reset_moe_stats(const Stream& stream);
  /// finish_step's parts: the expert-bias update (MoELayer::update_expert_bias over the
  /// data-parallel group; collective over DP) and the restart of the global_aux_loss token counts
  /// (MoELayer::reset_global_tokens; no host synchronisation). Each a no-op without its option.
  void update_expert_bias(const Stream& stream);
  void reset_global_aux_loss_tracker(const Stream& stream);

  bool sequence_parallel() const { return tp_.sequence_parallel(); }
  /// The FP8 state of this rank's linear layers (--fp8-format; model/fp8/fp8_model.h), or nullptr.
  const Fp8Model* fp8() const { return fp8_.get(); }
  Fp8Model* fp8() { return fp8_.get(); }
  /// Context-parallel size (the CP group of `groups`) and the tokens of a sequence on this rank:
  /// seq_length / cp (parallel/context_parallel.h). Micro-batches then carry this rank's tokens
  /// ([s/cp, b]) and, always, their global position_ids.
  int context_parallel_size() const { return cp_ ? cp_->size() : 1; }
  int64_t local_seq_length() const { return config_.seq_length / context_parallel_size(); }
  /// The core attention the layers use (--attention-backend resolved by resolve_attention_backend,
  /// model/variants.h): "fused" (cuDNN's fused attention where it applies, ops/cuda/cudnn_attention.h,
  /// the FlashAttention-2 kernels elsewhere), "flash" (the FlashAttention-2 kernels) or "local" (unfused).
  const char* attention_backend() const { return attention_backend_name(attention_backend_); }
  /// Whole model on this rank (one chunk with embedding and loss), slot 0: forward of one
  /// micro-batch (see forward_chunk).
  void forward(const MicroBatch& mb, const DropoutContext& dc, const Tensor& loss_accum, float loss_weight,
               const Stream& stream, bool compute_loss = true);
  /// Backward of the micro-batch whose forward ran last (see backward_chunk).
  void backward(const MicroBatch& mb, const DropoutContext& dc, float grad_scale, const Tensor& loss_scale,
                const Stream& stream, bool last_backward = true);

 private:
  struct Parts;  // the modules and their registry
  GPTModel(const TransformerConfig& config, int64_t micro_batch, DType dtype, Device device, ProcessGroups groups,
           bool sequence_parallel, ParamLayout param_layout, ModelLayout layout, std::shared_ptr<ParamStore> shared,
           bool measure_only = false);
  struct ChunkState;
  void plan(BufferPlanner& planner);
  void check_buffers(int c, const ChunkBuffers& buf) const;  // errors naming an index out of range
  bool embedding_shared_across_stages() const;
  void grads_final(size_t first, size_t end, const Stream& stream);
  // Calls f on each MoE layer of this rank, in layer order.
  void for_each_moe(const std::function<void(MoELayer&)>& f) const;
  // ECHO's used-slot transfers, shared by this rank's MoE layers (null: none, or not made yet).
  EchoPeers* echo_peers() const;
  void finish_group(size_t group, const Stream& stream);  // TP all-reduce of partial grads + grads_ready
  // Sharded parameters (param_hooks.h params_every_use): params_begin of parameter group
  // `group`'s use (prefetching group `next`'s parameters; kNoGroup: none) and params_end, with the
  // tied word embedding's range when `head` reads it; nothing otherwise.
  static constexpr size_t kNoGroup = SIZE_MAX;
  void params_begin(size_t group, size_t next, bool head, bool backward, const Stream& stream);
  void params_end(size_t group, bool head, bool backward, const Stream& stream);
  // The multi-token prediction's uses (MultiTokenPrediction::UseHook): params_begin (begin) or
  // params_end of the parameters depth d's use reads, without a next range; nothing unless the
  // hooks bracket every use.
  void mtp_use(int64_t d, int use, bool backward, bool begin, const Stream& stream);
  // Depth d's group without the last stage's copy of the word embedding it may hold (depth 0 of
  // an untied model's last stage, first in the group): the input part's and the head's norms and
  // eh_proj.
  std::pair<size_t, size_t> mtp_depth_range(int64_t d) const;
  // The " mtp_<k> loss: ... |" part of log_statistics (collective over the world; restarts the sums).
  std::string mtp_statistics(Communicator& world, int64_t iterations, const Stream& stream);
  // Full recompute: the output of layer i of a chunk for activation slot `slot` (its own saved
  // output, the checkpoint of the group it ends, or its output in the recompute area).
  Tensor layer_output(const ChunkState& ch, size_t i, int slot) const;
  // The dropout context of this rank's layers: with CP, the chunk layout of its [s/N, b, h]
  // activations (DropoutContext::cp_*), so that the element-wise dropout masks are one rank's.
  DropoutContext cp_dropout(const DropoutContext& dc) const;
  // Full recompute: the layers [first, last] of a chunk forward again into the recompute area.
  void recompute_forward(const ChunkState& ch, size_t first, size_t last, const Tensor& in, int slot,
                         const MicroBatch& mb, const DropoutContext& dc, const Stream& stream);

  TransformerConfig config_;
  int64_t micro_batch_;
  DType dtype_;
  Device device_;
  ProcessGroups groups_;
  TensorParallelRegion tp_;
  std::unique_ptr<ContextParallelRegion> cp_;  // CP > 1 only
  std::unique_ptr<Fp8Model> fp8_;              // --fp8-format only (before parts_: the linears register with it)
  std::unique_ptr<Parts> parts_;
  std::shared_ptr<ParamStore> params_;  // shared with the models planned_for() makes
  std::unique_ptr<BufferPlanner> planner_;
  std::vector<ModelChunk> chunk_specs_;
  std::vector<ChunkState> chunks_;
  int activation_slots_ = 1;
  HeadOptions head_options_;
  Tensor residual_grad_;  // [s_l, b, h]: the running dL/d(residual stream) when no grad is given
  // --mtp-num-layers: fp32 [D], each depth's weighted CE summed over the training forwards since the
  // last log_statistics (persistent); per loss slot, whether its forward ran the MTP
  Tensor mtp_losses_;
  std::vector<bool> mtp_forwarded_;
  ParamGradHooks* hooks_ = nullptr;
  AttentionBackend attention_backend_ = AttentionBackend::kLocal;  ///< resolved: never kAuto
  WgradDeferral deferred_;
  LayerGraphs* layer_graphs_ = nullptr;  // per-layer CUDA graphs (set_layer_graphs), not owned
  size_t word_embedding_index_ = ParamStore::kNoParam;
  std::vector<std::vector<ParamStore::Range>> tp_partial_;  // per registry group: grads to all-reduce over TP
  ModelMemoryPlan memory_plan_;  // measure_only construction
};

}  // namespace mt
