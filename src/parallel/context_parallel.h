// Context parallelism (Megatron-Core: --context-parallel-size, --cp-comm-type,
// --hierarchical-context-parallel-sizes; megatron/training/utils.py get_batch_on_this_cp_rank and
// TransformerEngine's context-parallel attention). Every rank of a CP group of size N holds s/N
// tokens of every sequence, load-balanced for causal attention: the sequence is cut into 2N chunks
// of c = s/(2N) tokens and CP rank r holds chunks r and 2N−1−r (in that order). Example, s = 16,
// N = 2 (chunks of 4): rank 0 holds positions 0-3 and 12-15, rank 1 holds 4-7 and 8-11.
// Everything outside the core attention is per token and runs on the local tokens unchanged; the
// core attention (model/layers/cp_attention.h) exchanges keys and values over the CP group.
// This file: the layout (pure functions, tested against hand-worked examples), the validation of
// the flags, host-side sharding of a batch, and the CP region (the group, its a2a / p2p
// sub-groups and the global positions of every rank's tokens on the device).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace mt {

/// --cp-comm-type (Megatron's spellings "p2p", "allgather", "a2a", "a2a+p2p").
enum class CpCommType : uint8_t {
  kP2P,        ///< ring: K/V blocks passed around the CP group, partial outputs merged by LSE
  kAllGather,  ///< K/V all-gathered over the CP group, dK/dV reduce-scattered
  kA2A,        ///< Ulysses: all-to-all from a sequence shard to a head shard and back
  kA2AP2P,     ///< a2a inside groups of --hierarchical-context-parallel-sizes[0], p2p ring across them
};
/// Errors: mt::Error naming the value and the accepted ones.
CpCommType parse_cp_comm_type(const std::string& s);
const char* cp_comm_type_name(CpCommType t);

struct ContextParallelOptions {
  int size = 1;                        ///< --context-parallel-size (N)
  CpCommType comm_type = CpCommType::kP2P;
  /// --hierarchical-context-parallel-sizes [a2a, p2p] (a2a+p2p only): a2a · p2p = N; the a2a
  /// groups are a2a consecutive CP ranks, the p2p rings the ranks with the same index in them.
  std::vector<int> hierarchical_sizes;
  /// Sizes of the two levels: {a2a, p2p} ({1, N} for p2p, {N, 1} for a2a; {1, N} for allgather).
  std::pair<int, int> levels() const;
};

/// Checks the CP flags against the model; each error names the values (before any communication):
///  - size < 1; seq_length not divisible by 2·size (load-balanced chunks);
///  - hierarchical sizes given without a2a+p2p, not two positive values, or not multiplying to size;
///  - a2a / a2a+p2p: the a2a level not dividing the attention heads and the query groups of one TP
///    rank (num_attention_heads / tp, num_query_groups / tp).
void validate_context_parallel(const ContextParallelOptions& o, int64_t seq_length, int64_t num_attention_heads,
                               int64_t num_query_groups, int tp);

/// Global position (0 .. s−1) of local token t (0 <= t < s/N) of CP rank r.
/// Errors: s not divisible by 2N, r or t out of range.
int64_t cp_global_position(int64_t seq_length, int cp, int rank, int64_t t);
/// The global positions of all local tokens of rank r, in local order.
std::vector<int32_t> cp_positions(int64_t seq_length, int cp, int rank);

/// Host-side get_batch_on_this_cp_rank: local[t, :] = full[pos(t), :] for rows of `row` elements
/// ([s, ...] -> [s/N, ...]).
template <typename T>
void cp_shard_rows(T* local, const T* full, int64_t seq_length, int64_t row, int cp, int rank) {
  const std::vector<int32_t> pos = cp_positions(seq_length, cp, rank);
  for (size_t t = 0; t < pos.size(); ++t)
    for (int64_t e = 0; e < row; ++e) local[static_cast<int64_t>(t) * row + e] = full[pos[t] * row + e];
}
/// The same along the last dimension of [b, s] (doc_start): [b, s] -> [b, s/N].
void cp_shard_columns(int32_t* local, const int32_t* full, int64_t batch, int64_t seq_length, int cp, int rank);

/// The CP group of this rank with what the core attention needs. Construction is collective over
/// `cp` when a2a+p2p splits it.
class ContextParallelRegion {
 public:
  /// cp: the CP group (size N); opts validated (validate_context_parallel); positions are placed
  /// on `device`. Errors: opts.size != cp->size().
  ContextParallelRegion(std::shared_ptr<Communicator> cp, const ContextParallelOptions& opts, int64_t seq_length,
                        Device device);
  int size() const { return size_; }
  int rank() const { return rank_; }
  CpCommType comm_type() const { return opts_.comm_type; }
  int64_t seq_length() const { return seq_; }
  int64_t local_seq() const { return seq_ / size_; }
  Communicator& group() const { return *cp_; }
  /// The a2a level (size levels().first; the whole CP group for a2a) and the p2p ring (size
  /// levels().second); one-rank groups where a level has size 1.
  Communicator& a2a_group() const { return *a2a_; }
  Communicator& p2p_group() const { return *p2p_; }
  int a2a_size() const { return opts_.levels().first; }
  int p2p_size() const { return opts_.levels().second; }
  /// int32 [N·s/N] on the device: row r (s/N values) = the global positions of CP rank r's tokens.
  /// Positions of CP ranks [first, first + count): a contiguous range of it.
  Tensor positions(int first, int count) const;

  /// The p2p ring's own stream (p2p_size() > 1): the K/V and dK/dV sends/receives of ring step
  /// i + 1 run on it while the compute stream attends to the block of step i (TransformerEngine's
  /// overlap of the ring exchange with the blockwise attention). `ready` (recorded on the compute
  /// stream, waited on by the ring stream) orders a step's sends after the buffers are written and
  /// its receives after their previous contents were read; `done` (the other way) orders the
  /// compute that reads a received block after its receive. Every exchange is joined back to the
  /// compute stream within the attention call, so the pattern is capturable in a CUDA graph. On
  /// the CPU streams run inline and events are no-ops: the ring is sequential, the results the
  /// same. One per region, used by the layers in turn. Errors: mt::Error when p2p_size() == 1.
  struct Ring {
    Stream stream;
    Event ready, done;
  };
  Ring& ring() const;

 private:
  std::shared_ptr<Communicator> cp_, a2a_, p2p_;
  std::unique_ptr<Ring> ring_;
  ContextParallelOptions opts_;
  int size_, rank_;
  int64_t seq_;
  Buffer positions_;
  Device device_;
};

}  // namespace mt
