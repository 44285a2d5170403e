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
#pragma once
#include <memory>

#include "comm/communicator.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace mt {

class TensorParallelRegion {
 public:
  /// tp: the tensor-parallel group (a one-rank communicator when TP = 1). sequence_parallel is
  /// ignored (treated as off) when the group has one rank.
  TensorParallelRegion(std::shared_ptr<Communicator> tp, bool sequence_parallel);
  /// A region that only knows its size and this rank (planning parameter shapes without a
  /// communicator, e.g. the specs of other ranks for a checkpoint's metadata). Its collectives are
  /// errors.
  static TensorParallelRegion layout_only(int size, int rank, bool sequence_parallel = false);

  Communicator& group() const;
  int size() const { return size_; }
  int rank() const { return rank_; }
  bool sequence_parallel() const { return sp_; }
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

 private:
  std::shared_ptr<Communicator> tp_;
  int size_, rank_;
  bool sp_;
};

}  // namespace mt
