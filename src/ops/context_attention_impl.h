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

}  // namespace mt
