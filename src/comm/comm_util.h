// Argument checks shared by the collective backends (MPI, NCCL): every message names the group
// and the rank ("group 'tp' (rank 1 of 4)"), the tensors and the sizes involved.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"

namespace mt::comm_detail {

/// "group 'tp' (rank 1 of 4)".
std::string describe(const Communicator& c);
const char* reduce_op_name(ReduceOp op);

/// True when the byte ranges of a and b overlap.
bool overlaps(const Tensor& a, const Tensor& b);

/// all_reduce: contiguous, dtype fp32/bf16/fp16/int32/int64.
void check_all_reduce(const Communicator& c, const Tensor& t);
/// all_gather: same dtype, out.numel == size * in.numel; `in` may only alias this rank's slice of
/// `out`. Returns true for that in-place case.
bool check_all_gather(const Communicator& c, const Tensor& out, const Tensor& in);
/// reduce_scatter: reducible dtype, in.numel == size * out.numel; `out` may only alias this
/// rank's chunk of `in`. Returns true for that in-place case.
bool check_reduce_scatter(const Communicator& c, const Tensor& out, const Tensor& in);
/// broadcast: contiguous, 0 <= root < size.
void check_broadcast(const Communicator& c, const Tensor& t, int root);
/// all_to_all: same dtype and numel, numel divisible by size, no overlap (not in place).
void check_all_to_all(const Communicator& c, const Tensor& out, const Tensor& in);
/// all_to_allv: same dtype, both contiguous, counts (and offsets when given) with one entry per
/// rank, non-negative, every piece inside its tensor, receive pieces pairwise disjoint, in and out
/// disjoint. Returns the resolved offsets (recv, send).
std::pair<std::vector<int64_t>, std::vector<int64_t>> check_all_to_allv(const Communicator& c, const Tensor& out,
                                                                        const AllToAllvSplits& recv, const Tensor& in,
                                                                        const AllToAllvSplits& send);
/// send/recv: contiguous, 0 <= peer < size, peer != rank.
void check_p2p(const Communicator& c, const Tensor& t, int peer, const char* op);

}  // namespace mt::comm_detail
