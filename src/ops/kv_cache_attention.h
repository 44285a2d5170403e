// Causal self-attention of new tokens against a key/value cache (incremental decoding, as
// Megatron-Core's inference path with its InferenceParams / key_value_memory_dict): the keys and
// values of the s new tokens are written into the cache at positions [offset, offset + s), then
// each new query i (global position offset + i) attends to the cached keys 0 .. offset + i.
// With offset 0 and s tokens this is exactly ops/attention.h's causal attention without dropout;
// with s = 1 it is one decoding step.
//
// Layouts (act dtype: fp32 on the CPU, fp32/bf16/fp16 on CUDA; all contiguous):
//   qkv:      [s, b, g, qpg + 2, d]  Megatron-Core's per-query-group fused QKV (ops/attention.h)
//   k_cache,
//   v_cache:  [b, g, S_max, d]       this rank's key/value heads; positions >= offset + s untouched
//   out:      [s, b, n·d]            n = g·qpg query heads, head-major
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

struct KvCacheAttentionConfig {
  int64_t offset = 0;       ///< tokens already in the cache (global position of the first new token)
  float softmax_scale = 0;  ///< usually 1/sqrt(d)
};

/// Appends the new keys/values of qkv to the caches at [offset, offset + s) and writes
/// out[i, b, h·d..] = Σ_j softmax_j(scale · q_i · k_j) v_j over j in [0, offset + i] (query head h
/// uses key/value group h / qpg). Softmax and accumulation in fp32.
/// Errors: mt::Error for shapes, dtypes or devices that do not match the layouts above, an empty
/// dimension, offset < 0, offset + s > S_max, a softmax_scale that is not finite and > 0
/// (ops/attention_checks.h).
void kv_cache_attention_forward(const Tensor& out, const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                                const KvCacheAttentionConfig& cfg, const Stream& stream);

MT_OP_BACKENDS(kv_cache_attention_forward)

}  // namespace mt
