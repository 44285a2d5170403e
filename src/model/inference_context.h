// Inference state handed down to the self-attention layers through MicroBatch::inference
// (Megatron-Core's InferenceParams / StaticInferenceContext): a key/value cache per transformer
// layer of this rank, allocated once for `max_batch` sequences of up to `max_sequence_length`
// tokens, and the position at which the current forward's tokens start. A prefill forward of s
// tokens at offset 0 fills positions [0, s); each decoding step of 1 token at offset p writes
// position p and attends over [0, p]. The caller advances the offset between forwards.
#pragma once
#include <map>
#include <vector>

#include "core/buffer.h"
#include "core/tensor.h"
#include "model/transformer_config.h"
#include "parallel/pipeline/layer_split.h"

namespace mt {

class KvCache {
 public:
  /// The key and value tensors of one layer: [b, g_l, S_max, d] in the activation dtype, g_l = this
  /// tensor-parallel rank's key/value heads (query groups / tp).
  struct Layer {
    Tensor key, value;
    /// Multi-latent attention (--multi-latent-attention; key and value empty): the compressed
    /// latent of every cached token, c_kv after kv_layernorm [S_max, b, r_kv] and the rotated
    /// k_pe [S_max, b, d_r] (replicated over TP, as Megatron's cache_mla_latents): r_kv + d_r
    /// elements per token and layer instead of 2 · g_l · d.
    Tensor ckv, kpe;
  };
  /// MLA: buffers shared by the layers of this rank for the keys and values a layer rebuilds
  /// from its latents at each forward: key, value [b, n_l, S_max, D] (the layout of
  /// ops/kv_cache_attention.h) and the up-projected latents kv_up [S_max, b, n_l · (d_n + d_v)].
  struct MlaExpanded {
    Tensor key, value, kv_up;
  };
  /// Allocates the caches of the layers in `chunks` (this rank's pipeline chunks) in one buffer.
  /// Errors: mt::Error for max_batch or max_sequence_length < 1, query groups not divisible by tp,
  /// and out-of-memory (the message gives the bytes).
  KvCache(const TransformerConfig& config, int tp, const std::vector<pipeline::LayerRange>& chunks, int64_t max_batch,
          int64_t max_sequence_length, DType dtype, Device device);
  /// The cache of global layer `layer`. Errors: mt::Error if this rank does not hold that layer.
  const Layer& layer(int64_t layer) const;
  /// MLA's shared buffers (empty tensors without MLA).
  const MlaExpanded& mla_expanded() const { return mla_; }
  /// Bytes the cache keeps per token and layer on this rank: 2 · g_l · d · dtype size, with MLA
  /// (r_kv + d_r) · dtype size.
  static size_t bytes_per_token(const TransformerConfig& config, int tp, DType dtype);
  int64_t max_batch() const { return max_batch_; }
  int64_t max_sequence_length() const { return max_seq_; }
  size_t bytes() const { return buffer_.bytes(); }

 private:
  int64_t max_batch_, max_seq_;
  Buffer buffer_;
  std::map<int64_t, Layer> layers_;
  MlaExpanded mla_;
};

class InferenceContext {
 public:
  explicit InferenceContext(KvCache& cache) : cache_(&cache) {}
  KvCache& cache() const { return *cache_; }
  /// Tokens already in the cache: the global position of the current forward's first token.
  int64_t sequence_len_offset = 0;

 private:
  KvCache* cache_;
};

}  // namespace mt
