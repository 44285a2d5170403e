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
#include "model/params.h"
#include "ops/attention.h"

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
  /// pad_multiple: the flat parameter buffer is padded to a multiple of it (data-parallel size).
  GptModel(const GptConfig& config, int64_t micro_batch, DType dtype, Device device, ProcessGroups groups,
           bool sequence_parallel = false, int64_t pad_multiple = 1);
  ~GptModel();

  /// Megatron-Core parameter names, local shapes and shards of TP rank `tp_rank` of `tp`
  /// (weights [out, in]; the vocabulary padded for tp).
  static std::vector<ParamSpec> param_specs(const GptConfig& config, int tp = 1, int tp_rank = 0);
  /// After backward with sequence parallelism: all-reduce over TP the gradients that each rank
  /// computed from its sequence shard only (Megatron's sequence-parallel grad all-reduce).
  void allreduce_sequence_parallel_grads(const Stream& stream);
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

  /// Forward of one micro-batch. Computes per-token losses and accumulates
  /// loss_accum[0] += loss_weight * sum(losses) (fp32 [1] on the device). With compute_loss =
  /// false only the logits are produced (generation).
  void forward(const MicroBatch& mb, const DropoutContext& dc, const Tensor& loss_accum, float loss_weight,
               const Stream& stream, bool compute_loss = true);
  /// Backward of the micro-batch whose forward ran last: accumulates (+=) into the fp32 main
  /// gradients the gradient of  grad_scale * loss_scale[0] * sum(loss_mask * losses),
  /// loss_scale being a device fp32 [1] tensor (the dynamic loss scale) or empty (1).
  void backward(const MicroBatch& mb, const DropoutContext& dc, float grad_scale, const Tensor& loss_scale,
                const Stream& stream);
  /// Logits of the last forward: [s·b, V/tp] (row = i_s·b + i_b; this rank's vocabulary
  /// shard), activation dtype.
  Tensor logits() const { return logits_; }

 private:
  struct LayerActs;
  struct Workspace;
  void plan(Arena& arena);
  void layer_forward(int64_t l, const Tensor& x, LayerActs& a, const DropoutContext& dc, const Stream& stream);
  void layer_backward(int64_t l, const Tensor& x, LayerActs& a, const Tensor& d_resid, const DropoutContext& dc,
                      const Stream& stream);
  AttentionConfig attention_config(int64_t layer, const DropoutContext& dc) const;

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
  std::vector<LayerActs> layers_;
  std::unique_ptr<Workspace> ws_;
  Tensor logits_;
  Tensor doc_start_;  // of the micro-batch whose forward ran last (backward uses the same)
  std::vector<ParamStore::Range> sp_grad_ranges_;  // gradients all-reduced over TP with SP
  struct LayerParamIndex {
    size_t ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b;
  };
  struct GlobalParamIndex {
    size_t wte, wpe, lnf_w, lnf_b;
  };
  std::vector<LayerParamIndex> layer_params_;
  GlobalParamIndex gix_{};
};

/// Dropout stream ids (the Philox key half of a dropout site): (layer + 1) * 8 + site.
enum DropoutSite : uint32_t { kSiteAttentionProbs = 0, kSiteAttentionOut = 1, kSiteMlpOut = 2, kSiteEmbedding = 3 };
inline uint32_t dropout_stream_id(int64_t layer, DropoutSite site) {
  return static_cast<uint32_t>((layer + 1) * 8 + site);
}

}  // namespace mt
