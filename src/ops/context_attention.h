// Blockwise attention for context parallelism (Liu et al. 2023, "Ring Attention", arXiv:2310.01889;
// Megatron-Core / TransformerEngine's context-parallel attention, transformer_engine/pytorch/
// attention.py AttnFuncWithCPAndKVP2P): the queries of one sequence shard against one block of
// keys/values, with the mask given by the tokens' *global* positions, and the partial results of
// several blocks merged through their softmax log-sum-exp (LSE). The ring (--cp-comm-type p2p),
// all-gather, all-to-all and hierarchical layouts of model/layers/cp_attention.h are built from
// these few ops.
//
// CUDA: the FlashAttention-2 kernels of ops/flash_attention.h with a global-position mask
// (ops/cuda/flash_attention_kernels.cuh, flash::PositionMask): bf16/fp16 with head_dim 64 or 128
// and 16-byte aligned tensors on the tensor cores (mma.sync, fp32 accumulation), everything else
// on simple CUDA-core kernels (fp32 math). A block whose mask the caller declares plain
// (ContextAttentionConfig::block: causal or full, as every block of the load-balanced ring is)
// runs cuDNN's fused attention instead when ContextAttentionConfig::cudnn asks for it and cuDNN
// covers the case (ops/cuda/cudnn_attention.h: bf16/fp16, head_dim % 8 == 0 and <= 128, no
// document mask, no dropout, not deterministic), as TransformerEngine runs Megatron-Core's CP
// blocks through cuDNN: the block's output and softmax statistics come from cuDNN and are merged
// by the LSE here; the backward gives cuDNN the merged output and LSE.
//
// Layouts (Megatron-Core's per-query-group QKV, see ops/attention.h):
//   qkv: [sq, b, g, qpg + 2, d]  only the query heads are read (the key/value heads are ignored)
//   kv:  [sk, b, g, 2, d]        per (key row, sample, group): the key head, then the value head
//   out: [sq, b, n, d]           act dtype, n = g·qpg; query head h uses group h / qpg
//   lse: [sq, b, n]              fp32, natural log of Σ_visible exp(scale · q·k)
// Visibility of key j to query i of sample b (positions are global token indices in the full
// sequence, int32): k_pos[j] <= q_pos[i] (causal) and, with doc_start, k_pos[j] >= doc_start[b, i]
// (--reset-attention-mask; doc_start holds global positions). Softmax in fp32.
//
// Dropout (dropout_p > 0) on the probabilities, keyed by the *global* element exactly as the
// one-rank attention keys it (ops/attention.h, ops/flash_attention.h), so that every CP layout draws
// the mask of one rank: element (sample b, query head h of this call, query i, key j) has the global
// index G = ((b·total_heads + head_offset + h)·S + q_pos[i])·S + k_pos[j], S = seq_length (the full
// sequence), and is kept iff dropout_bits4(key.seed, key.stream_id, key.iteration, key.microbatch,
// G >> 2).v[G & 3] >= dropout_threshold(p); kept values are scaled by 1/(1−p). head_offset is the
// global index of this call's first query head (TP rank's first head plus, under a2a, the a2a
// rank's head shard). The LSE is that of the undropped softmax, so the LSE merge of blocks is
// unchanged: out = Σ_blocks e^(lse_blk − lse)·Σ_j dropout(P_blk,ij)·v_j.
#pragma once
#include <cstddef>
#include <vector>

#include "core/rng.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// What the caller knows about a block's mask in local indices (beyond the positions, which must
/// agree with it: the CPU checks them, the CUDA backend trusts them).
enum class ContextBlockMask : uint8_t {
  kPositions,  ///< only the positions (and doc_start) say which keys a query sees
  kCausal,     ///< sq == sk, q_pos == k_pos ascending: local key j visible to local query i iff j <= i
  kFull,       ///< every key visible to every query: max(k_pos) <= min(q_pos)
};

struct ContextAttentionConfig {
  int64_t batch = 0;              ///< b
  int64_t groups = 0;             ///< g, key/value heads in qkv and kv
  int64_t queries_per_group = 1;  ///< qpg
  int64_t head_dim = 0;           ///< d
  float softmax_scale = 0;        ///< > 0, usually 1/sqrt(d)
  Tensor q_pos;                   ///< int32 [sq], contiguous, on the device of qkv
  Tensor k_pos;                   ///< int32 [sk], contiguous
  /// int32 [b, sq] (a view whose rows may be strided: stride(1) == 1, stride(0) >= sq) or empty.
  /// Values are trusted (not read on the host on CUDA).
  Tensor doc_start;
  float dropout_p = 0;      ///< attention dropout on the probabilities, in [0, 1)
  DropoutKey dropout_key{};  ///< seed/iteration/micro-batch/site (its cp_* fields are not read)
  int64_t seq_length = 0;    ///< S, the full sequence (positions < S); required when dropout_p > 0
  int64_t head_offset = 0;   ///< global index of this call's first query head (dropout key)
  int64_t total_heads = 0;   ///< global query-head count (0 = heads())
  /// --deterministic-mode: the CUDA tensor-core backward computes dQ in its own kernel (one block
  /// per query tile, the key tiles in order) instead of fp32 atomics over key tiles, so dQ is
  /// bitwise the same on every run. Ignored by the forward, the simple kernels and the CPU (all
  /// deterministic).
  bool deterministic = false;
  /// The block's mask when it is plain (before doc_start, which applies on top).
  ContextBlockMask block = ContextBlockMask::kPositions;
  /// --attention-backend fused / auto: on CUDA a kCausal or kFull block runs cuDNN's fused attention
  /// where it applies (see the top of this file), else the FlashAttention-2 kernels. The
  /// workspaces must then have the sizes below with cudnn set (also on the CPU, which ignores it).
  bool cudnn = false;
  int64_t heads() const { return groups * queries_per_group; }
};

/// Attention of the query heads of qkv [sq, b, g, qpg+2, d] against kv [sk, b, g, 2, d].
/// merge = false: out [sq, b, n, d] and lse [sq, b, n] are overwritten with this block's result
/// (rows with no visible key: out 0, lse −inf). merge = true: (out, lse) already hold the result of
/// other key blocks and are replaced by the attention over the union:
/// lse' = log(e^lse + e^lse_blk), out' = out·e^(lse−lse') + out_blk·e^(lse_blk−lse').
/// workspace: with cfg.cudnn at least context_attention_forward_workspace_bytes(cfg, sq) bytes,
/// 16-byte aligned, on the device of qkv (cuDNN's block output and statistics, the gathered
/// queries); otherwise unused (may be empty).
/// Errors (mt::Error; ops/attention_checks.h): shapes, dtypes (act fp32 on CPU; fp32/bf16/fp16 on
/// CUDA; lse fp32; positions int32), devices, a scale that is not finite and > 0, dropout_p outside
/// [0, 1), head_offset + heads() > total_heads, a doc_start not int32 [b, sq] with unit stride
/// along the sequence, on CUDA head_dim > 1024, with dropout seq_length < max(1, sq, sk)
/// (positions are trusted to be < S), a cfg.block the positions contradict (checked where the
/// positions are on the host), and with cfg.cudnn a missing or too small workspace.
void context_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                               const Tensor& workspace, const ContextAttentionConfig& cfg, bool merge,
                               const Stream& stream);

/// Bytes of the forward's workspace for sq query rows: 0 unless cfg.cudnn; then (16-bit elements,
/// each part padded to 256 bytes) cuDNN's block output [sq, b, n, d], its fp32 statistics
/// [b, n, sq] and, with grouped queries, the gathered queries [sq, b, n, d].
size_t context_attention_forward_workspace_bytes(const ContextAttentionConfig& cfg, int64_t sq);

/// Bytes of the backward's workspace for sq query rows and sk key rows (host function, for static
/// planning): fp32 D_i = Σ dout_i·out_i [sq, b, n], padded to 256 bytes, then fp32 dQ partial sums
/// [sq, b, n, d]; with cfg.cudnn also (16-bit elements, each padded to 256 bytes) the fp32
/// statistics [b, n, sq], cuDNN's dQ [sq, b, n] and dK/dV [sk, b, g, 2, d] before they are added,
/// and with grouped queries the gathered queries [sq, b, n, d]. Nothing in it survives a call; it
/// may be shared with any other temporary.
size_t context_attention_workspace_bytes(const ContextAttentionConfig& cfg, int64_t sq, int64_t sk);
/// Byte offset of the dQ partial sums in that workspace (after D and its padding).
size_t context_attention_dq_accum_offset(const ContextAttentionConfig& cfg, int64_t sq);

/// Backward of the attention of the same queries against one key block, given the *final* out and
/// lse (over all blocks) and dout [sq, b, n, d]: P = exp(scale·q·k − lse), D_i = Σ dout_i·out_i,
/// dS = P ∘ (M∘(dout·vᵀ) − D) with M the dropout mask (kept: 1/(1−p), dropped: 0; M = 1 without
/// dropout), and dV += (M∘P)ᵀ·dout. Accumulates (+=): dQ into the query heads of dqkv [sq, b, g, qpg+2, d]
/// (its key/value heads are untouched) and dK, dV into dkv [sk, b, g, 2, d] (summed over the qpg
/// query heads of a group). workspace: on CUDA at least context_attention_workspace_bytes(cfg, sq, sk)
/// bytes, 16-byte aligned, on the device of qkv (scratch: D and the dQ partial sums, and cuDNN's
/// parts); the CPU does not use it (empty, or as on CUDA).
/// Determinism: the tensor-core kernels sum dQ with fp32 atomics over key tiles (last bits may vary
/// run to run) unless cfg.deterministic, which computes dQ in its own kernel per query tile (key
/// tiles in order: the same bits every run); dK, dV, the simple kernels and the CPU always are.
/// Errors: as the forward, plus a workspace that is missing (CUDA), too small, misaligned or on
/// another device.
void context_attention_backward(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout, const Tensor& out,
                                const Tensor& lse, const Tensor& qkv, const Tensor& kv, const Tensor& workspace,
                                const ContextAttentionConfig& cfg, const Stream& stream);

/// kv [r, 2, d] (overwrite) <- the key and value heads (indices qpg, qpg+1) of qkv [r, qpg+2, d];
/// any leading shape with r rows. Errors: shape/dtype/device mismatch.
void kv_pack(const Tensor& kv, const Tensor& qkv, int64_t queries_per_group, const Stream& stream);
/// The key and value heads of dqkv [r, qpg+2, d] (overwrite) <- dkv [r, 2, d]; query heads untouched.
void kv_unpack(const Tensor& dqkv, const Tensor& dkv, int64_t queries_per_group, const Stream& stream);

/// y [b, a, c] (overwrite) <- x viewed as [a, b, c] (c = numel / (a·b)): swaps the two leading
/// blocks, for the all-to-all of the Ulysses layout. Any dtype (moved by element size); x and y
/// contiguous, same numel, dtype and device, not aliased. Errors: a·b not dividing numel.
void transpose_blocks(const Tensor& y, const Tensor& x, int64_t a, int64_t b, const Stream& stream);

/// x viewed as [outer, k, c] with k = perm.size() blocks (c = numel / (outer·k)): y[o, j, :] =
/// x[o, perm[j], :] (inverse = false) or y[o, perm[j], :] = x[o, j, :] (inverse = true), for the
/// sorted layout of the a2a levels (parallel/context_parallel.h cp_a2a_sort_order). Any dtype;
/// x and y contiguous, same numel, dtype and device, not aliased. Errors: outer·k not dividing
/// numel, perm not a permutation of 0 .. k−1, k > 128.
void permute_blocks(const Tensor& y, const Tensor& x, int64_t outer, const std::vector<int>& perm, bool inverse,
                    const Stream& stream);

MT_OP_BACKENDS(context_attention_forward)
MT_OP_BACKENDS(context_attention_backward)
MT_OP_BACKENDS(kv_pack)
MT_OP_BACKENDS(kv_unpack)
MT_OP_BACKENDS(transpose_blocks)
MT_OP_BACKENDS(permute_blocks)

}  // namespace mt
