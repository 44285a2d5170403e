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
// up to 128 (up to 256 on Hopper and newer, cuDNN's support matrix: "d <= 256", its MLA case
// d_qk = 192 with d_v = 128), FlashAttentionConfig::v_head_dim a multiple of 8 up to head_dim, no
// document mask (--reset-attention-mask), no attention dropout (cuDNN's Philox stream
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
// Context-parallel blocks (ops/context_attention.h with ContextAttentionConfig::cudnn): the same
// graphs with sq query rows against sk key rows, the causal mask for a kCausal block (sq == sk,
// the ring's diagonal step) and none for a kFull one (its half-block steps), K and V read in place
// from the block kv [sk, b, g, 2, d], Q from qkv [sq, b, g, qpg + 2, d] (gathered with grouped
// queries). Forward: O straight into out (merge = false) or into the workspace, the statistics
// [b, n, sq] into the workspace, then one kernel writes lse [sq, b, n] or merges (out, lse) with
// the block by the LSE. Backward: the merged lse transposed into the statistics, cuDNN's dQ and
// dK/dV (overwritten by cuDNN) into the workspace and then added to dqkv's query slots and to dkv
// (the op accumulates). Workspace parts: ops/context_attention_impl.h ContextAttentionWorkspace.
//
// Plans are built on first use per (direction, dtype, b, n, g, sq, sk, d, mask, where Q / K / V
// live, scale, device) — building compiles the engine's kernels (NVRTC, up to seconds) — and
// cached for the process; execution allocates nothing and does not synchronise with the host
// (capturable in CUDA graphs once built). A launch sets the shared handle's stream under a lock
// (threads driving one GPU). Errors: mt::Error naming the cuDNN call and cuDNN's last error message
// when a call fails or no engine supports the one-GPU graph (a context-parallel block without an
// engine falls back instead, see cudnn_context_forward).
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/context_attention.h"
#include "ops/flash_attention.h"

namespace mt::cuda {

/// cuDNN attention executions (forward and backward plans run) in this process: how tests see that
/// the cuDNN path, not the fallback, ran.
int64_t cudnn_attention_executions();

/// True when this build has cuDNN's graph API (MT_WITH_CUDNN) and cfg/tensors are in the supported
/// set above (dtype is qkv's).
bool cudnn_attention_applies(const FlashAttentionConfig& cfg, DType dtype, std::initializer_list<const void*> ptrs);

/// As flash_attention_forward (out, lse overwritten). Precondition: cudnn_attention_applies.
/// With v_head_dim < head_dim (MLA: values zero-padded to the query/key head dim) cuDNN computes
/// P·V over the first v_head_dim channels only and the others of out are zeroed. Returns false,
/// having done nothing, when no cuDNN engine supports a head dim over 128 or v_head_dim < head_dim
/// (logged once per shape; the caller runs the FlashAttention-2 kernels); other cases without an
/// engine are an error.
bool cudnn_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const FlashAttentionConfig& cfg,
                             const Stream& stream);

/// As flash_attention_backward (dqkv overwritten; workspace of flash_attention_workspace_bytes(cfg)).
/// Precondition: cudnn_attention_applies. With v_head_dim < head_dim only the first v_head_dim
/// channels of dout and out are read, dV's others are zeroed. Returns false as the forward does.
bool cudnn_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& qkv, const Tensor& workspace, const FlashAttentionConfig& cfg,
                              const Stream& stream);

/// True when this build has cuDNN's graph API, cfg.cudnn is set, cfg.block is kCausal (with
/// sq == sk) or kFull, and the rest of the case is in the supported set above (dtype is qkv's; no
/// doc_start, no dropout, not deterministic; the pointers 16-byte aligned).
bool cudnn_context_applies(const ContextAttentionConfig& cfg, DType dtype, int64_t sq, int64_t sk,
                           std::initializer_list<const void*> ptrs);

/// As context_attention_forward (merge or overwrite). Precondition: cudnn_context_applies and a
/// workspace of context_attention_forward_workspace_bytes(cfg, sq). Returns false, having done
/// nothing, when no cuDNN engine supports the block (logged once per shape): the caller runs the
/// FlashAttention-2 kernels instead.
bool cudnn_context_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                           const Tensor& workspace, const ContextAttentionConfig& cfg, bool merge,
                           const Stream& stream);

/// As context_attention_backward (dQ, dK, dV accumulated). Precondition: cudnn_context_applies and a
/// workspace of context_attention_workspace_bytes(cfg, sq, sk). Returns false as the forward.
bool cudnn_context_backward(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout, const Tensor& out,
                            const Tensor& lse, const Tensor& qkv, const Tensor& kv, const Tensor& workspace,
                            const ContextAttentionConfig& cfg, const Stream& stream);

}  // namespace mt::cuda
