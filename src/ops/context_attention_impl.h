// The attention-probability dropout of ops/context_attention.h in the form the attention kernels
// use (AttnDropout, ops/attention_impl.h), shared by the CPU and CUDA backends so that both draw
// the mask of the one-rank attention: element (b, h, i, j) of a call is the global element
// (b, head_offset + h, q_pos[i], k_pos[j]) of the [b, total_heads, S, S] probabilities.
#pragma once
#include "ops/attention_impl.h"
#include "ops/context_attention.h"

namespace mt {

inline AttnDropout context_attention_dropout(const ContextAttentionConfig& c) {
  return make_attn_dropout(c.dropout_key, c.dropout_p, c.heads(), c.total_heads, c.head_offset, c.seq_length);
}

/// Byte offsets of the parts of the workspaces of ops/context_attention.h (the size functions and
/// the CUDA backend read the same layout). kNone: the part is absent.
struct ContextAttentionWorkspace {
  static constexpr size_t kNone = ~size_t{0};
  // backward: D and the dQ partial sums (the FlashAttention-2 kernels; cuDNN's softmax_sum and dQ
  // accumulator, of the same sizes)
  size_t delta = kNone, dq_accum = kNone;
  // cuDNN: statistics [b, n, sq] fp32, the block output (forward) or dQ [sq, b, n, d] (backward),
  // dK/dV [sk, b, g, 2, d] (backward), the gathered queries [sq, b, n, d] (grouped queries)
  size_t stats = kNone, out = kNone, dq = kNone, dkv = kNone, q = kNone;
  size_t bytes = 0;
};
ContextAttentionWorkspace context_attention_forward_layout(const ContextAttentionConfig& c, int64_t sq);
ContextAttentionWorkspace context_attention_backward_layout(const ContextAttentionConfig& c, int64_t sq, int64_t sk);

}  // namespace mt
