// Causal multi-head self-attention core (Vaswani et al. 2017; Megatron's DotProductAttention
// with the "local" implementation): batched GEMMs plus a fused scale/mask/softmax(/dropout)
// kernel on CUDA. Flash attention replaces this in a later issue.
//
// The fused QKV projection output uses Megatron's per-head interleaved layout, so that a
// column-parallel split over heads keeps each head's q, k, v together:
//   qkv: [s, b, n, 3, d]  (i.e. [s, b, 3h] with h = n·d, per head: q then k then v)
#pragma once
#include "core/rng.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace mt {

struct AttentionConfig {
  int64_t seq = 0;          ///< s
  int64_t batch = 0;        ///< b
  int64_t heads = 0;        ///< n, heads on this rank
  int64_t head_dim = 0;     ///< d
  float softmax_scale = 0;  ///< usually 1/sqrt(d)
  float dropout_p = 0;      ///< attention dropout on the probabilities
  DropoutKey dropout_key{};
  int64_t head_offset = 0;  ///< global index of this rank's first head (TP), for layout-invariant dropout
  int64_t total_heads = 0;  ///< global head count (0 = heads)
};

/// Saved activations and scratch, planned by the caller from the static arena.
/// q, k, v: [b, n, s, d] (act dtype); probs: [b, n, s, s] (act dtype, softmax output before
/// dropout, saved for backward); scratch: [b, n, s, s] (act dtype; used for the dropped
/// probabilities when dropout_p > 0 and as dS in backward); dq, dk, dv: [b, n, s, d] (backward
/// scratch).
struct AttentionBuffers {
  Tensor q, k, v, probs, scratch;
  Tensor dq, dk, dv;
};

/// out[s, b, n·d] = softmax(scale · q k^T + causal mask) v, per (b, head).
/// Dropout (if p > 0) on the probabilities; the mask of element (b, head, i, j) is keyed by the
/// global flat index ((b·total_heads + head_offset + head)·s + i)·s + j.
void attention_forward(const Tensor& out, const Tensor& qkv, const AttentionBuffers& buf, const AttentionConfig& cfg,
                       const Stream& stream);

/// dqkv[s, b, n, 3, d] (overwrite) from dout[s, b, n·d] and the saved buffers.
void attention_backward(const Tensor& dqkv, const Tensor& dout, const AttentionBuffers& buf,
                        const AttentionConfig& cfg, const Stream& stream);

}  // namespace mt
