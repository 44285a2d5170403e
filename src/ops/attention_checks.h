// The one validation of the attention ops' configurations (ops/attention.h AttentionConfig,
// ops/flash_attention.h FlashAttentionConfig, ops/context_attention.h ContextAttentionConfig,
// ops/kv_cache_attention.h KvCacheAttentionConfig): each op describes its call as an AttentionSpec
// (sizes, grouped-query heads, softmax scale, dropout and the heads it keys the dropout mask by)
// and checks it, its document mask and its [s, b, ...] tensors here. Every check throws mt::Error
// naming the op (`fn`) and the offending values.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace mt::attention_checks {

/// The fused kernels' largest head dimension (ops/cuda/flash_attention_kernels.cuh: the simple
/// path keeps 4·d floats per warp in shared memory).
constexpr int64_t kMaxFusedHeadDim = 1024;

/// One attention call as the checks see it.
struct AttentionSpec {
  const char* fn = "";
  int64_t batch = 0;     ///< b
  int64_t seq = 0;       ///< s (the query rows)
  int64_t heads = 0;     ///< n query heads on this rank
  int64_t groups = 0;    ///< g key/value heads (query groups), dividing n
  int64_t head_dim = 0;  ///< d
  float softmax_scale = 0;
  float dropout_p = 0;
  int64_t head_offset = 0;  ///< global index of the first query head (dropout mask)
  int64_t total_heads = 0;  ///< global query heads (0 = heads)
  int64_t queries_per_group() const { return heads / groups; }
};

/// b, s, n, g, d positive with g dividing n; softmax_scale finite and > 0; dropout_p in [0, 1);
/// head_offset >= 0 and head_offset + n <= total_heads (0: n).
void check_spec(const AttentionSpec& s);

/// The fused ops on CUDA: head_dim <= kMaxFusedHeadDim.
void check_fused_head_dim(const AttentionSpec& s, const Device& device);

/// The document mask (--reset-attention-mask), when given: int32 [b, rows] on `device` with unit
/// stride along the rows (and, unless strided_rows, contiguous). local: its values are document
/// starts in local positions, 0 <= doc_start[b, i] <= i, checked on the CPU (on CUDA they are
/// trusted: reading them would need a device->host copy).
void check_doc_start(const Tensor& doc, int64_t batch, int64_t rows, const Device& device, bool strided_rows,
                     bool local, const char* fn);

/// qkv-like: [s, b, g, qpg + 2, d] or [s, b, g·(qpg + 2)·d], a contiguous activation (op_checks::
/// check_act) of dtype act.
void check_qkv(const Tensor& t, DType act, const AttentionSpec& s, const char* name);
/// out-like: [s, b, n, d] or [s, b, n·d], a contiguous activation of dtype act.
void check_out(const Tensor& t, DType act, const AttentionSpec& s, const char* name);

}  // namespace mt::attention_checks
