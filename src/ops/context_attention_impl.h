// The attention-probability dropout of ops/context_attention.h in the form the attention kernels
// use (AttnDropout, ops/attention_impl.h), shared by the CPU and CUDA backends so that both draw
// the mask of the one-rank attention: element (b, h, i, j) of a call is the global element
// (b, head_offset + h, q_pos[i], k_pos[j]) of the [b, total_heads, S, S] probabilities.
#pragma once
#include "ops/attention_impl.h"
#include "ops/context_attention.h"

namespace mt {

inline AttnDropout context_attention_dropout(const ContextAttentionConfig& c) {
  AttnDropout d;
  d.seed = c.dropout_key.seed;
  d.iteration = c.dropout_key.iteration;
  d.iteration_ptr = c.dropout_key.iteration_ptr;
  d.microbatch = c.dropout_key.microbatch;
  d.microbatch_ptr = c.dropout_key.microbatch_ptr;
  d.stream_id = c.dropout_key.stream_id;
  d.enabled = c.dropout_p > 0.f;
  d.threshold = d.enabled ? dropout_threshold(c.dropout_p) : 0u;
  d.inv_keep = d.enabled ? 1.f / (1.f - c.dropout_p) : 1.f;
  d.heads = c.heads();
  d.total_heads = c.total_heads > 0 ? c.total_heads : c.heads();
  d.head_offset = c.head_offset;
  d.seq = c.seq_length;
  return d;
}

}  // namespace mt
