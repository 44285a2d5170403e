// Causal multi-head self-attention core (Vaswani et al. 2017; Megatron's DotProductAttention
// with the "local" implementation): batched GEMMs plus a fused scale/mask/softmax(/dropout)
// kernel on CUDA. Flash attention replaces this in a later issue.
//
// Optional document-aware causal mask (Megatron --reset-attention-mask, the attention_mask of
// get_ltor_masks_and_position_ids; computed here as data::get_ltor_masks_and_position_ids's
// doc_start, data/masks.h): query i of sample b attends to keys j with doc_start[b, i] <= j <= i
// (block-diagonal causal); without doc_start to all j <= i (plain causal).
// Example: tokens A B C EOD D E F EOD G H (the EOD belongs to the document it ends) give
// doc_start = 0 0 0 0 4 4 4 4 8 8: D (position 4) sees only itself, E sees D and E, G sees G.
//
// The fused QKV projection output uses Megatron-Core's per-query-group layout, so that a
// column-parallel split over query groups keeps each group's heads together:
//   qkv: [s, b, g, qpg + 2, d]  (per (position, sample, group): the qpg = n/g query heads, then the
//        key head, then the value head; query head h uses key/value group h / qpg)
// Multi-head attention is g = n ([s, b, n, 3, d]: per head q, k, v); grouped-query attention
// (Ainslie et al. 2023) 1 < g < n; multi-query attention g = 1.
#pragma once
#include "core/rng.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

struct AttentionConfig {
  int64_t seq = 0;          ///< s
  int64_t batch = 0;        ///< b
  int64_t heads = 0;        ///< n, query heads on this rank
  int64_t groups = 0;       ///< g, key/value heads (query groups) on this rank, dividing n; 0 = n
  int64_t head_dim = 0;     ///< d
  float softmax_scale = 0;  ///< usually 1/sqrt(d)
  float dropout_p = 0;      ///< attention dropout on the probabilities
  DropoutKey dropout_key{};
  int64_t head_offset = 0;  ///< global index of this rank's first head (TP), for layout-invariant dropout
  int64_t total_heads = 0;  ///< global head count (0 = heads)
  /// Optional document mask: int32 [b, s], contiguous, on the device of qkv; empty = plain causal.
  /// doc_start[b, i] is the first key position query i may attend to (0 <= doc_start[b, i] <= i).
  /// Values are checked on the CPU backend; on CUDA they are trusted (only shape/dtype/device are
  /// validated: reading them would need a device->host copy), out-of-range values give garbage.
  /// A view only: the caller keeps the memory alive for the forward and the backward.
  Tensor doc_start;
};

/// Saved activations and temporaries, planned by the caller from the static arena. All in the act
/// dtype of qkv and contiguous; only the element count is checked, so e.g. [b·n, s, d] is fine.
///   q: [b, n, s, d] (= [b, g, qpg, s, d]), k, v: [b, g, s, d]  saved: written by forward, read by
///            backward.
///   probs:   [b, n, s, s]  saved: softmax output before dropout (exactly 0 where masked: j > i or
///            j < doc_start[b, i]).
///   scratch: [b, n, s, s]  temporary, need not survive from forward to backward (may be shared
///            between layers). Forward, only when dropout_p > 0: the dropped probabilities.
///            Backward (always required): the dropped probabilities (recomputed from probs and
///            the dropout key), then dP, then dS.
///   dq: [b, n, s, d], dk, dv: [b, g, s, d]  temporaries, required by forward (dq) and backward
///            (all).
///            Forward: dq holds the context [b, n, s, d] before it is permuted into out (CUDA).
///            Backward: dq first holds dout permuted to [b, n, s, d] (CUDA), then dQ; dk and dv
///            hold dK and dV before they are interleaved into dqkv.
struct AttentionBuffers {
  Tensor q, k, v, probs, scratch;
  Tensor dq, dk, dv;
};

/// out[s, b, n·d] = softmax(scale · q k^T + causal mask) v, per (b, head); qkv [s, b, g, qpg+2, d]
/// or [s, b, (n + 2g)·d], out [s, b, n·d] or [s, b, n, d]; fp32 (CPU, CUDA), bf16/fp16 (CUDA). Causal:
/// key j > query i is masked, and with cfg.doc_start also j < doc_start[b, i] (masked
/// probabilities are exactly 0, in the forward and in the backward's gradients). Softmax in fp32. Dropout (if p > 0) on the probabilities: element
/// (b, head, i, j) has the global flat index g = ((b·total_heads + head_offset + head)·s + i)·s + j
/// and is kept iff dropout_bits4(key.seed, key.stream_id, key.iteration, key.microbatch, g >> 2)
/// .v[g & 3] >= dropout_threshold(p) (core/rng.h); kept values are scaled by 1/(1-p). The mask
/// thus does not depend on how heads are split over ranks.
/// The dropout draws do not depend on doc_start (masked elements simply stay 0).
/// Errors (ops/attention_checks.h): mt::Error for non-positive sizes, groups not dividing heads, a
/// softmax_scale that is not finite and > 0, inconsistent shapes/dtypes/devices (the CPU: fp32
/// only), p outside [0, 1), head_offset + n > total_heads, a missing buffer (scratch only needed when p > 0), doc_start not a contiguous int32
/// [b, s] on the device of qkv, and (CPU only) a doc_start[b, i] outside [0, i].
void attention_forward(const Tensor& out, const Tensor& qkv, const AttentionBuffers& buf, const AttentionConfig& cfg,
                       const Stream& stream);

/// dqkv[s, b, g, qpg+2, d] (overwrite) from dout[s, b, n·d] and the saved buffers (q, k, v, probs
/// from the forward with the same cfg); the dropout mask is recomputed from the key. The key and
/// value gradients of a group sum over its qpg query heads.
/// Errors: as attention_forward; every buffer is required.
void attention_backward(const Tensor& dqkv, const Tensor& dout, const AttentionBuffers& buf,
                        const AttentionConfig& cfg, const Stream& stream);

MT_OP_BACKENDS(attention_forward)
MT_OP_BACKENDS(attention_backward)

}  // namespace mt
