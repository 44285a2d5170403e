// The summation of a reduce-scatter assembled from point-to-point pieces (the collective matmul of
// --tp-comm-overlap, parallel/mappings.h): each rank receives the other ranks' partial sums of its
// own chunk and adds them up itself.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"

namespace mt {

/// The most pieces rank_order_sum adds (the copy-engine kernel's bound, comm/nccl/peer_copy.h).
inline constexpr int kRankOrderSumMaxPieces = 8;

/// out = pieces[0] + pieces[1] + ... + pieces[n-1], element-wise, accumulated in fp32 in that
/// order and rounded once to out's dtype — the order and rounding of the thread communicator's
/// reduce_scatter (comm/thread_comm.h) and of the copy-engine reduce-scatter's kernel
/// (comm/nccl/peer_copy.h, launch_sum_ranks, which runs it on CUDA), so a reduction made of
/// pieces gives their bits (on two ranks also NCCL's: one fp32 addition, one rounding).
/// out and the n pieces: contiguous, of one numel, dtype (fp32, bf16 or fp16) and device; out may
/// be one of the pieces (same memory), no other overlap. Ordered on `stream` (CPU: done on
/// return). Errors (mt::Error): n outside [1, kRankOrderSumMaxPieces], a piece of another numel,
/// dtype or device, a non-contiguous tensor, another dtype; CUDA tensors in a build without NCCL.
void rank_order_sum(const Tensor& out, const Tensor* pieces, int n, const Stream& stream);

}  // namespace mt
