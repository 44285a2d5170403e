// cuDNN fused attention (--attention-backend fused): the causal self-attention of
// ops/flash_attention.h computed by cuDNN's fused flash-attention engines (cuDNN 9, Hopper: FA3-class
// kernels) through the backend graph API, as Megatron-Core reaches it through Transformer Engine's
// FusedAttention (NVTE_FUSED_ATTN, "F16_arbitrary_seqlen"). Host-only declarations.
//
// Same tensors and semantics as flash_attention_forward / flash_attention_backward (layouts there:
// qkv [s, b, g, qpg + 2, d], out [s, b, n, d], lse [b, n, s] fp32 natural-log log-sum-exp of the
// scaled scores, which is cuDNN's softmax "Stats"), so the two backends are interchangeable
// between the forward and the backward and the model does not see which one ran.
//
// Applies (cudnn_attention_applies) to: bf16/fp16 tensors, 16-byte aligned, head_dim a multiple of 8
// up to 128, no document mask (--reset-attention-mask), no attention dropout (cuDNN's Philox stream
// is not ours, and the mask must not depend on the backend), not --deterministic-mode (cuDNN's dQ
// uses atomics). The caller falls back to the FlashAttention-2 kernels otherwise. Grouped queries
// (queries_per_group > 1): cuDNN's 4-D tensors cannot address the query slots of Megatron's
// [g, qpg + 2] layout with one head stride, so Q is gathered into [s, b, n, d] first (and dQ
// scattered back), through a staging buffer the plan owns (forward b·n·s·d 16-bit elements,
// backward twice that); K and V are read in place and cuDNN sums dK, dV over each group's heads.

// Graphs (the operation patterns of cuDNN's fused SDPA engines, as cudnn-frontend's SDPA nodes
// lower them): forward S = Q·Kᵀ · scale, causal mask (GEN_INDEX row >= col, else -inf), softmax
// with Stats = max + log Σ exp, O = P·V; backward the FlashAttention-2 backward (softmax_sum =
// rowsum(dO ∘ O), P = exp(S − Stats), dV = Pᵀ·dO, dS = P ∘ (dO·Vᵀ − softmax_sum) · scale,
// dK = dSᵀ·Q, dQ = dS·K through an fp32 dQ accumulator). The backward's fp32 softmax_sum and dQ
// accumulator live in the caller's flash-attention workspace (same sizes as the FlashAttention-2
// kernels' delta and dq_accum); the engine's own workspace (often 0 bytes) is allocated once per
// plan, when the plan is built.
//
// Plans are built on first use per (direction, dtype, b, n, s, d, scale, device) — building
// compiles the engine's kernels (NVRTC, up to seconds) — and cached for the process; execution
// allocates nothing and does not synchronise with the host (capturable in CUDA graphs once built).
// Errors: mt::Error naming the cuDNN call and cuDNN's last error message when no engine supports
// the graph or a call fails.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/flash_attention.h"

namespace mt::cuda {

/// cuDNN attention executions (forward and backward plans run) in this process: how tests see that
/// the cuDNN path, not the fallback, ran.
int64_t cudnn_attention_executions();

/// True when this build has cuDNN's graph API (MT_WITH_CUDNN) and cfg/tensors are in the supported
/// set above (dtype is qkv's).
bool cudnn_attention_applies(const FlashAttentionConfig& cfg, DType dtype, std::initializer_list<const void*> ptrs);

/// As flash_attention_forward (out, lse overwritten). Precondition: cudnn_attention_applies.
void cudnn_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const FlashAttentionConfig& cfg,
                             const Stream& stream);

/// As flash_attention_backward (dqkv overwritten; workspace of flash_attention_workspace_bytes(cfg)).
/// Precondition: cudnn_attention_applies.
void cudnn_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& qkv, const Tensor& workspace, const FlashAttentionConfig& cfg,
                              const Stream& stream);

}  // namespace mt::cuda
