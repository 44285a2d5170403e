// Fused causal self-attention for training: FlashAttention-2 (Dao 2023, arXiv:2307.08691,
// Algorithms 1 and 2): tiles of queries against tiles of keys with an online softmax, so that the
// [s, s] probabilities never reach device memory; the forward saves the softmax log-sum-exp (LSE)
// per query instead, and the backward recomputes the probabilities from q, k and the LSE.
// Megatron-Core reaches the same computation through TEDotProductAttention (cuDNN / flash-attn).
//
// Layout (Megatron-Core's SelfAttention with query groups, linear_qkv output before the split):
//   qkv:  [s, b, g, qpg + 2, d]   per (position, sample, group): the qpg query heads, then the
//                                  group's key head, then its value head (GQA; g = kv heads on this
//                                  rank, qpg = queries per group, n = g·qpg query heads; plain
//                                  multi-head attention is g = n, qpg = 1, i.e. [s, b, n, 3, d]).
//   out:  [s, b, n, d]             act dtype (= [s, b, n·d], the input of the output projection).
//   lse:  [b, n, s]                fp32; query head h uses key/value group h / qpg.
//
// Semantics, per (sample b, query head h), with scores S_ij = scale · q_i · k_j (fp32):
//   keys j visible to query i: j <= i (causal, always on) and, with cfg.doc_start, j >= doc_start[b, i]
//   (Megatron --reset-attention-mask; block-diagonal causal; see ops/attention.h for an example).
//   P_ij = exp(S_ij − lse_i), lse_i = log Σ_{visible j} exp(S_ij) (natural log of the scaled scores),
//   out_i = Σ_j dropout(P_ij) v_j.
// Dropout (p > 0) acts on the probabilities and is bit-identical to ops/attention.h, so that the
// masks do not depend on the kernel or on the tensor-parallel split: element (b, head, i, j) has the
// global index G = ((b·total_heads + head_offset + head)·s + i)·s + j and is kept iff
// dropout_bits4(key.seed, key.stream_id, key.iteration, key.microbatch, G >> 2).v[G & 3] >=
// dropout_threshold(p) (core/rng.h); kept values are scaled by 1/(1-p). The LSE is that of the
// undropped softmax.
//
// Precision: fp32 on the CPU (the reference); fp32, bf16 or fp16 on CUDA. bf16/fp16 run on the
// tensor cores (mma.sync m16n8k16) with fp32 accumulation and an fp32 softmax for head_dim 64 and
// 128; every other case (fp32, other head dims, misaligned pointers) takes a simple CUDA-core path
// with fp32 math (slow; meant for tests and odd shapes). The CUDA kernels are those of
// ops/context_attention.h with the causal mask (ops/cuda/flash_attention_kernels.cuh).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/rng.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

struct AttnDropout;  // ops/attention_impl.h

struct FlashAttentionConfig {
  int64_t seq = 0;                ///< s
  int64_t batch = 0;              ///< b (micro-batch)
  int64_t groups = 0;             ///< g, key/value heads (query groups) on this rank
  int64_t queries_per_group = 1;  ///< qpg; n = g·qpg query heads on this rank
  int64_t head_dim = 0;           ///< d
  float softmax_scale = 0;        ///< > 0, usually 1/sqrt(d)
  float dropout_p = 0;            ///< attention dropout on the probabilities, in [0, 1)
  DropoutKey dropout_key{};
  int64_t head_offset = 0;  ///< global index of this rank's first query head (TP), for the dropout mask
  int64_t total_heads = 0;  ///< global query-head count (0 = n)
  /// Optional document mask: contiguous int32 [b, s] on the device of qkv; empty = plain causal.
  /// 0 <= doc_start[b, i] <= i is checked on the CPU and trusted on CUDA (reading it would need a
  /// device->host copy; out-of-range values give garbage). A view: the caller keeps it alive.
  Tensor doc_start;
  /// --deterministic-mode: the CUDA tensor-core backward computes dQ in its own kernel (one block
  /// per query tile of a head, the key tiles in order, S, P, dP and dS recomputed) instead of fp32
  /// atomics over key tiles, so dQ is bitwise the same on every run. Ignored by the forward, the
  /// simple kernels and the CPU (all deterministic).
  bool deterministic = false;
  /// --attention-backend fused (and auto): on CUDA, cuDNN's fused attention (ops/cuda/cudnn_attention.h)
  /// where it applies (bf16/fp16, head_dim % 8 == 0 and <= 128, <= 256 on Hopper, no doc_start, no
  /// dropout, not deterministic) and an engine exists, else the FlashAttention-2 kernels. Same outputs within bf16
  /// rounding; the LSE has the same meaning, so either backward accepts either forward's outputs.
  /// Ignored on the CPU.
  bool cudnn = false;
  /// The value head dim when smaller than head_dim (0 = head_dim): only the first v_head_dim
  /// channels of each value head are real, the others zero (multi-latent attention's padding,
  /// ops/mla.h). cuDNN's engines then skip the padding (ops/cuda/cudnn_attention.h); the other
  /// backends compute every channel (zero context and value-gradient channels there).
  int64_t v_head_dim = 0;

  int64_t heads() const { return groups * queries_per_group; }  ///< n
  int64_t v_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
};

/// Bytes of the backward's workspace (host function, for static memory planning). Layout, from the
/// start of the workspace (which must be 16-byte aligned):
///   delta:    fp32 [b, n, s]     D_i = Σ_e dout_ie · out_ie (FA2 backward preprocessing)
///   (padding to a multiple of 256 bytes)
///   dq_accum: fp32 [b, n, s, d]  dQ / scale, accumulated with atomics over key tiles (bf16/fp16
///                                 tensor-core path without cfg.deterministic only; the other paths
///                                 leave it untouched)
/// Nothing in it survives the call; it may be shared with any other temporary.
size_t flash_attention_workspace_bytes(const FlashAttentionConfig& cfg);
/// Byte offset of dq_accum in that workspace (after delta and its padding).
size_t flash_attention_dq_accum_offset(const FlashAttentionConfig& cfg);

/// Forward: out[s, b, n, d] (overwrite, act dtype of qkv) and lse[b, n, s] (fp32, overwrite) from
/// qkv[s, b, g, qpg + 2, d] (or [s, b, g·(qpg+2)·d]); out may also be given as [s, b, n·d], lse as any
/// contiguous fp32 tensor of b·n·s elements. Fully masked key tiles are skipped (causal, and the
/// tiles before the document start of every query of a query tile).
/// Errors (mt::Error; ops/attention_checks.h): non-positive sizes, softmax_scale not finite and > 0, dropout_p outside
/// [0, 1), head_offset + n > total_heads, shape/dtype/device mismatches, non-contiguous tensors, a
/// CPU tensor that is not fp32, doc_start not a contiguous int32 [b, s] on the device of qkv, on
/// the CPU a doc_start[b, i] outside [0, i], on CUDA head_dim > 1024.
void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const FlashAttentionConfig& cfg,
                             const Stream& stream);

/// Backward: dqkv[s, b, g, qpg + 2, d] (overwrite, act dtype) from dout[s, b, n, d] and the forward's
/// out, lse and qkv with the same cfg (same dropout key: the mask is recomputed). Key and value
/// gradients sum over the qpg query heads of their group. workspace: any dtype, contiguous, at
/// least flash_attention_workspace_bytes(cfg) bytes, 16-byte aligned, on the device of qkv; its
/// contents are scratch (see above). No allocation and no host synchronisation on CUDA.
/// Errors: as flash_attention_forward, plus a workspace that is too small or misaligned.
/// Determinism: the CPU, the CUDA simple path and every forward are deterministic. The CUDA
/// tensor-core backward sums dQ with fp32 atomics over key tiles, so dQ may differ in the last bits
/// between runs (dK, dV are deterministic), unless cfg.deterministic: then a separate kernel per
/// query tile sums dQ over the key tiles in order (the same bits every run, for a given GPU; equal
/// to the atomic path within rounding; about 1.4x the backward's tensor-core FLOPs).
void flash_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& qkv, const Tensor& workspace, const FlashAttentionConfig& cfg,
                              const Stream& stream);

/// True when this build has cuDNN's fused attention (FlashAttentionConfig::cudnn can take effect).
bool flash_attention_cudnn_available();

MT_OP_BACKENDS(flash_attention_forward)
MT_OP_BACKENDS(flash_attention_backward)

/// The dropout of one call in the form the kernels of ops/attention.h use (AttnDropout, defined in
/// ops/attention_impl.h; heads = n): the same mask as the unfused op by construction.
AttnDropout flash_attention_dropout(const FlashAttentionConfig& cfg);

}  // namespace mt
