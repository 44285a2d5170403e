// The communication points of tensor and sequence parallelism (Megatron-Core
// tensor_parallel/mappings.py; Shoeybi et al. 2019 §3, the conjugate operators f and g;
// Korthikanti et al. 2022, sequence parallelism). Layers never call the communicator for TP
// themselves: they enter and leave the tensor-parallel region through these named mappings.
//
// A TP region is the part of a layer whose activations are split over the TP group by heads or
// ffn columns (between a ColumnParallelLinear and its RowParallelLinear). Outside it, activations
// are replicated on every TP rank ([s, b, h]), or, with sequence parallelism, split along the
// sequence ([s/tp, b, h], rank r holding rows r·s/tp .. (r+1)·s/tp − 1).
//
//   region entry (before a ColumnParallelLinear), forward / backward:
//     without SP: copy_to_tensor_model_parallel_region        identity / all-reduce  (f)
//     with SP:    gather_from_sequence_parallel_region         all-gather / reduce-scatter
//   region exit (after a RowParallelLinear), forward / backward:
//     without SP: reduce_from_tensor_model_parallel_region    all-reduce / identity  (g)
//     with SP:    reduce_scatter_to_sequence_parallel_region  reduce-scatter / all-gather
//
// Buffers: `full` is [s, b, ·] (the region's view), `local` is [s/tp, b, ·] with SP and the same
// memory as `full` without it (so the identity directions cost nothing). All calls are
// stream-ordered collectives on the TP communicator; no host synchronisation.
//
// The linear layers reach the sequence-parallel collectives together with the GEMM beside them
// (all_gather_gemm, gemm_reduce_scatter), so that with --tp-comm-overlap (Megatron's flag;
// Transformer Engine's userbuffers "AG+GEMM" / "GEMM+RS", Wang et al. 2023 "Overlap communication
// with dependent computation via decomposition") the collective is split into one piece per rank
// and pipelined with the GEMM over the same pieces of rows (docs/parallelism.md "Tensor-parallel
// communication overlap").
#pragma once
#include <functional>
#include <memory>

#include "comm/communicator.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace mt {

class TensorParallelRegion {
 public:
  /// The most ranks --tp-comm-overlap pipelines over (the summation kernel's bound).
  static constexpr int kMaxOverlapRanks = 8;

  /// tp: the tensor-parallel group (a one-rank communicator when TP = 1). sequence_parallel is
  /// ignored (treated as off) when the group has one rank. tp_comm_overlap (--tp-comm-overlap):
  /// the collectives of all_gather_gemm / gemm_reduce_scatter in pieces pipelined with the GEMM.
  /// Errors (mt::Error): tp_comm_overlap without sequence parallelism over more than one rank
  /// (Megatron-LM's assertion: the overlap pipelines the sequence-parallel all-gather and
  /// reduce-scatter, and --sequence-parallel is off at TP 1), or over more than
  /// kMaxOverlapRanks ranks.
  TensorParallelRegion(std::shared_ptr<Communicator> tp, bool sequence_parallel, bool tp_comm_overlap = false);
  /// A region that only knows its size and this rank (planning parameter shapes without a
  /// communicator, e.g. the specs of other ranks for a checkpoint's metadata). Its collectives are
  /// errors.
  static TensorParallelRegion layout_only(int size, int rank, bool sequence_parallel = false);

  Communicator& group() const;
  /// False for a layout_only() region (no communicator: group() is an error).
  bool has_group() const { return tp_ != nullptr; }
  int size() const { return size_; }
  int rank() const { return rank_; }
  bool sequence_parallel() const { return sp_; }
  /// --tp-comm-overlap (implies sequence_parallel()).
  bool comm_overlap() const { return overlap_ != nullptr; }
  /// Rows of the local sequence shard: s / tp with SP, else s. Errors: s not divisible by tp
  /// under SP.
  int64_t local_seq(int64_t s) const;

  /// Region entry, forward: full <- all-gather(local) with SP; nothing without (same memory).
  void enter_forward(const Tensor& full, const Tensor& local, const Stream& stream) const;
  /// Region entry, backward: the gradient of the region's input. With SP: local <- reduce-scatter
  /// (full); without: full (== local) all-reduced in place.
  void enter_backward(const Tensor& local, const Tensor& full, const Stream& stream) const;
  /// Region exit, forward: with SP local <- reduce-scatter(full); without: full (== local)
  /// all-reduced in place.
  void exit_forward(const Tensor& local, const Tensor& full, const Stream& stream) const;
  /// Region exit, backward: full <- all-gather(local) with SP; nothing without.
  void exit_backward(const Tensor& full, const Tensor& local, const Stream& stream) const;
  /// Gradients of replicated parameters that are partial sums over TP: all-reduce (Megatron's
  /// _allreduce_non_tensor_model_parallel_grads); no-op on one rank.
  void all_reduce_grads(const Tensor& grads, const Stream& stream) const;

  /// A GEMM over a block of consecutive rows of the [s·b, ·] view of `full`: gemm(rows, first)
  /// computes the output rows [first, first + rows.size(0)) of the layer. For all_gather_gemm,
  /// `rows` is that block of the gathered input (a view of `full`, or of `local` for this rank's
  /// block: the same values); for gemm_reduce_scatter, where the block's partial result goes.
  ///
  /// With sequence parallelism the GEMM runs once per TP block of s_l·b rows (rank j's sequence
  /// shard), with or without --tp-comm-overlap, so that the overlap changes no bit: a GEMM's row
  /// depends on the row count it was computed with (OpenBLAS's kernels by the row's place in the
  /// register blocking; cuBLASLt's algorithm by the problem size), and both paths make the same
  /// calls on the same pointers. Without SP, one GEMM over all rows.
  using RowGemm = std::function<void(const Tensor& rows, int64_t first)>;

  /// enter_forward (exit_backward) followed by the consumer's GEMM: full [s, b, n] <- all-gather of
  /// local [s_l, b, n], then gemm per block: this rank's (from local), then those of ranks r − 1,
  /// r − 2, ... (mod tp). With --tp-comm-overlap, the collective matmul: on the region's
  /// communication stream, in TP − 1 steps, this rank's block is sent to rank (r + i) % tp while
  /// the block of rank (r − i) % tp is received (batched send/recv, an event per step), then this
  /// rank's block is copied into full; gemm runs on `stream`, this rank's block at once (from
  /// local), each other block after its step's event, so each step's transfer overlaps the GEMM of
  /// the block before; `stream` waits for the copy at the end. Without SP (full == local) just
  /// gemm(full). No host synchronisation; capturable in a CUDA graph.
  void all_gather_gemm(const Tensor& full, const Tensor& local, const RowGemm& gemm, const Stream& stream) const;
  /// The producer's GEMM followed by exit_forward (enter_backward): gemm writes every block of
  /// full [s, b, n] (partial sums over TP; the blocks of ranks r + 1, r + 2, ... (mod tp), this
  /// rank's last), then `tail` (e.g. the weight gradient; may be empty) runs on `stream`, then
  /// local [s_l, b, n] <- reduce-scatter of full (the all-reduce of full in place without SP: one
  /// GEMM). With --tp-comm-overlap (GEMM + reduce-scatter in pieces): the block of rank
  /// (r + i) % tp is sent to it while the next block is computed (send/recv of step i on the
  /// communication stream after an event of `stream`), and rank (r − i) % tp's partial block of
  /// this rank's rows is received into local (step 1) or the block sent in the step before; `tail`
  /// runs while the last transfer is in flight (Megatron's wgrad overlapped with the dgrad's
  /// reduce-scatter); then local = the rank-order sum of the partial blocks (comm/rank_order_sum.h:
  /// fp32 accumulation in rank order, one rounding — the thread communicator's reduce_scatter bit
  /// for bit, and NCCL's and MPI's on two ranks; they sum more ranks in their own orders, so with
  /// TP > 2 on GPUs or MPI processes the two paths differ by rounding). full's other blocks are
  /// consumed. No host synchronisation; capturable in a CUDA graph.
  void gemm_reduce_scatter(const Tensor& local, const Tensor& full, const RowGemm& gemm,
                           const std::function<void()>& tail, const Stream& stream) const;

 private:
  struct Overlap;  // the communication stream and events of --tp-comm-overlap
  /// The overlap state, its stream and events created on `stream`'s device at first use (the
  /// eager warm-up step of a CUDA-graph run: they are not memory of the buffer plan).
  Overlap& overlap(const Stream& stream) const;

  std::shared_ptr<Communicator> tp_;
  int size_, rank_;
  bool sp_;
  std::shared_ptr<Overlap> overlap_;  // --tp-comm-overlap; shared by copies of the region
};

}  // namespace mt
