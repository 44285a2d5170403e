// Core attention under context parallelism (Megatron-Core with TransformerEngine's
// context-parallel DotProductAttention; --cp-comm-type). The layer's tokens are this CP rank's
// load-balanced share of every sequence (parallel/context_parallel.h); queries, keys and values
// come from those tokens, and keys/values of the other ranks arrive over the CP group:
//   p2p        ring over the CP group: N steps; at step i this rank attends to the K/V block of CP
//              rank (r − i) mod N while the ring's own (high-priority) stream passes the block on
//              (the exchange overlaps the block attention); partial outputs merged by their LSE.
//              Causal skipping (load balance, cp_ring_step): for a block of an earlier rank only
//              its first chunk is visible (all of it, to both local chunks); for a later rank only
//              the second local chunk sees it (all of it): half a block each. Backward: the same
//              ring, dK/dV travel with their block and arrive back at the owner after N steps; a
//              block's sum so far is received while this rank computes its part, and sent on during
//              the next step, so only the last exchange is not overlapped. The exchanges are NCCL
//              send/recv, or copy-engine transfers with ContextParallelOptions::ring_copy_engine
//              (comm/nccl/peer_ring.h; kv_ and dkv_recv_ registered at plan(); not while captured).
//   allgather  K/V all-gathered (rank order), one attention call; dK/dV reduce-scattered.
//   a2a        Ulysses (Jacobs et al. 2023): all-to-all from [s/N, b, g_l] to [s, b, g_l/N] query
//              groups (qkv), full-sequence attention over the local heads, all-to-all back.
//   a2a+p2p    a2a inside groups of A consecutive CP ranks, then the p2p ring across the P groups,
//              between ranks holding the same heads (N = A·P).
// After the all-to-all of the a2a levels the tokens are put in ascending positions
// (cp_a2a_sort_order), which is the load-balanced layout of a P-rank ring with chunks of A·s/(2N)
// tokens: a2a attends once, causally, over the whole sequence; a2a+p2p skips half-blocks as p2p.
// Every block of p2p, a2a and a2a+p2p is then causal (the diagonal step) or full (ContextBlockMask),
// the cases cuDNN's fused attention computes: with `cudnn` (--attention-backend fused or auto, as
// TransformerEngine's CP attention in Megatron-Core) the blocks run on cuDNN where it applies
// (ops/context_attention.h), else on the FlashAttention-2 kernels (document masks, dropout,
// --deterministic-mode, allgather's rank-ordered keys, fp32).
// Masks use the global positions of the tokens (and the document starts of --reset-attention-mask),
// so every layout computes the attention of one rank (tests/parallel/context_parallel_test.cpp).
// Attention dropout (--attention-dropout) draws the one-rank mask: each element is keyed by its
// global (sample, head, query position, key position) (ops/context_attention.h), the head being
// the global one (TP rank and, under a2a, the a2a rank's head shard).
#pragma once
#include <vector>

#include "model/layers/attention.h"
#include "ops/context_attention.h"
#include "parallel/context_parallel.h"

namespace mt {

class ContextParallelAttention final : public CoreAttention {
 public:
  /// The same heads and groups as the other core attentions (split over TP); layer: the global
  /// layer number (dropout key); cp: the CP region (kept by reference; outlives the module);
  /// cudnn: the blocks on cuDNN's fused attention where it applies (the resolved
  /// --attention-backend is fused).
  ContextParallelAttention(const TransformerConfig& config, int64_t layer, const TensorParallelRegion& tp,
                           const ContextParallelRegion& cp, bool cudnn);
  /// s: the local sequence s/N.
  void plan(BufferPlanner& planner, int64_t s, int64_t b) override;
  bool reads_inputs_in_backward() const override { return false; }  // saves its own copies
  void forward(const Tensor& context, const Tensor& qkv, const StepContext& ctx) override;
  void backward(const Tensor& dqkv, const Tensor& dcontext, const Tensor& context, const Tensor& qkv,
                const StepContext& ctx) override;

 private:
  struct Saved {
    Tensor qkv;   // [A·s_l, b, g_a, qpg + 2, d]: the attention's input (after the a2a, sorted)
    Tensor out;   // [A·s_l, b, n_a, d] (a2a levels only, sorted; otherwise the caller's context)
    Tensor lse;   // fp32 [A·s_l, b, n_a]
    Tensor doc;   // int32 [b, A·s_l] (a2a levels only, sorted): the document starts of the queries
  };
  ContextAttentionConfig op_config(const Tensor& q_pos, const Tensor& k_pos, const Tensor& doc,
                                   ContextBlockMask block, const StepContext& ctx) const;
  /// One step of the ring (or, allgather, the whole gathered K/V).
  void block_forward(const CpRingStep& step, const Saved& sv, const Tensor& out, const Tensor& kv, const Tensor& doc,
                     bool merge, const StepContext& ctx) const;
  void block_backward(const CpRingStep& step, const Saved& sv, const Tensor& out, const Tensor& dout,
                      const Tensor& dq, const Tensor& kv, const Tensor& dkv, const Tensor& doc,
                      const StepContext& ctx) const;
  /// The p2p ring (p2p_ > 1 steps, or the one step of a2a): forward and backward.
  void ring_forward(const Saved& sv, const Tensor& out, const Tensor& doc, const StepContext& ctx);
  void ring_backward(const Saved& sv, const Tensor& out, const Tensor& dout, const Tensor& dq, const Tensor& doc,
                     const StepContext& ctx);
  /// One ring step on the p2p ring's stream (ContextParallelRegion::Ring), after the work queued
  /// on `st`: send → next rank and recv ← previous rank, for each pair given (empty = skipped); by
  /// NCCL send/recv, or by copy engines where the region has them (ring_uses_copy_engine: the
  /// receive buffers kv_ and dkv_recv_ were registered by plan(); the same bytes arrive).
  void exchange(const Tensor& send, const Tensor& recv, const Tensor& dsend, const Tensor& drecv,
                const Stream& st) const;
  void exchange_wait(const Stream& st) const;  ///< `st` waits for the last exchange
  /// a2a levels: x [s_l·b, A, ...] (this rank's tokens, A head parts) to `sorted` [A·s_l, b, ...]
  /// (the group's tokens in ascending positions, this rank's head part), and back.
  void a2a_in(const Tensor& sorted, const Tensor& x, const Stream& st) const;
  void a2a_out(const Tensor& x, const Tensor& sorted, const Stream& st) const;

  const TransformerConfig& config_;
  int64_t layer_;
  const ContextParallelRegion& cp_;
  bool cudnn_;  // cuDNN for the ring's blocks (not for allgather, attention dropout, deterministic mode)
  int64_t qpg_, groups_a_, heads_a_, d_, sl_ = 0, b_ = 0;
  int a2a_, p2p_, outer_;  // level sizes and this rank's index in the ring
  int64_t head_offset_;    // global index of the first query head this rank attends with (dropout key)
  std::vector<int> sort_;  // cp_a2a_sort_order(a2a_)
  std::vector<Saved> saved_;
  Tensor kv_[2], dkv_[2];   // scratch [A·s_l, b, g_a, 2, d] (allgather: [s, b, g_l, 2, d])
  Tensor dkv_recv_;         // p2p: the running dK/dV sum of a block received from the previous holder
  Tensor a2a_send_, a2a_recv_, dqkv_a_, dout_a_, doc_gather_, doc_rows_;  // a2a scratch
  Tensor workspace_;  // context_attention_forward's and _backward's (tensor-core kernels, cuDNN)
};

}  // namespace mt
