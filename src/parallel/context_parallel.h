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
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace mt {

class PeerRingExchange;  // comm/nccl/peer_ring.h (CUDA + NCCL builds)

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
  /// The p2p ring's exchanges (p2p and the p2p level of a2a+p2p) by copy-engine transfers between
  /// the GPUs of one host (comm/nccl/peer_ring.h: cudaMemcpyAsync over NVLink plus flags, no SMs)
  /// instead of NCCL's send/recv kernels. Megatron has no such flag, so there is no CLI flag:
  /// benchmarks and tests set it, and the environment variable MT_CP_RING=ce (or =nccl) overrides
  /// it in every region (ContextParallelRegion's constructor). Where the ring cannot use copy
  /// engines (other hosts, no peer access, not NCCL, CPU) the region logs why and keeps NCCL;
  /// exchanges issued while the compute stream is captured into a CUDA graph use NCCL too.
  /// Default off: on 2 H200s it hid 35% of the exchanges at 32K (NCCL's −16%) but none at 64K and
  /// made the layer no faster (docs/benchmarks.md "Context parallelism at long sequences").
  bool ring_copy_engine = false;
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

/// The a2a levels (a2a, a2a+p2p) in ascending positions. After the all-to-all of the queries,
/// keys and values, a rank holds the tokens of the A CP ranks of its a2a group in source order:
/// 2A blocks of c = s/(2N) rows, source j's chunks oA + j and 2N−1−oA−j (o: the ring index of the
/// group, N = A·P). Sorted by position these are the load-balanced layout of a P-rank ring with
/// chunks of A·c tokens (cp_positions(s, P, o)): chunks [oA, oA + A) and [2N − (o + 1)A, 2N − oA).
/// Returns perm with sorted block k = received block perm[k]: perm[k] = 2k for k < A, else
/// 2(2A−1−k) + 1. Example A = 2: {0, 2, 3, 1}; A = 1: {0, 1} (p2p: already sorted).
/// Errors: a2a < 1.
std::vector<int> cp_a2a_sort_order(int a2a);

/// The part of one ring step's key/value block that a rank attends to under the causal mask, with
/// the load-balanced layout of a P-rank ring (chunks r and 2P−1−r of C = s/(2P) tokens each; for
/// the a2a levels the sorted layout above).
enum class CpBlockKind : uint8_t {
  kDiagonal,  ///< step 0, the rank's own block: causal in local order (both chunks ascending)
  kEarlier,   ///< a block of an earlier rank: its first chunk only, visible to every local query
  kLater,     ///< a block of a later rank: all of it, visible to the second local chunk only
};
struct CpRingStep {
  int src;  ///< the ring rank whose keys/values this step attends to
  CpBlockKind kind;
};
/// Step i (0 <= i < P) of ring rank r: src = (r − i) mod P; kDiagonal at i = 0, else kEarlier
/// when src < r, kLater when src > r (Megatron-Core / TransformerEngine's AttnFuncWithCPAndKVP2P
/// load-balanced skipping: each later step computes half a block). Every kind is a plain
/// attention block: causal (kDiagonal: local key j visible to local query i iff j <= i) or full.
/// Errors: P < 1, r or i out of [0, P).
CpRingStep cp_ring_step(int p2p_size, int rank, int step);

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

/// Optional timing of the p2p ring (benchmarks only; nothing records in training): CUDA events
/// around every ring exchange (on the ring stream, from the moment its wait for the compute stream
/// is over) and every block computation (on the compute stream). Events are created on first use
/// and reused after clear(); spans_ms() needs the recorded work to have finished (synchronize).
class CpRingTrace {
 public:
  enum class Kind : uint8_t { kExchange, kCompute };
  struct Span {
    Kind kind;
    float begin_ms, end_ms;  ///< from the first event recorded since clear()
  };
  explicit CpRingTrace(Device device) : device_(device) {}
  /// Starts a span on `stream`; returns its handle for end().
  int begin(Kind kind, const Stream& stream);
  void end(int span, const Stream& stream);
  void clear() { used_ = 0; }
  std::vector<Span> spans_ms() const;

 private:
  Device device_;
  std::vector<std::unique_ptr<Event>> events_;  // 2 per span
  std::vector<Kind> kinds_;
  int used_ = 0;
};

/// Copy-engine ring exchanges issued by every CP region of the process (tests: which path ran).
int64_t cp_ring_copy_engine_exchanges();

/// What a trace says about the overlap (pure; tests/parallel/context_parallel_test.cpp):
/// exchange_ms and compute_ms sum the spans of each kind; exposed_ms is the exchange time outside
/// every compute span (exchange spans minus the union of compute spans): the time the ring's
/// communication adds to the attention. An exchange span runs from the ring stream's start to the
/// end of its transfer, so it also covers time its kernels wait for SMs or for the peer: compare
/// exposed_ms with the same exchanges timed alone (bench/cp_ring_bench.cpp) for the fraction hidden.
struct CpOverlap {
  double exchange_ms = 0, compute_ms = 0, exposed_ms = 0;
};
CpOverlap cp_overlap(const std::vector<CpRingTrace::Span>& spans);

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
  /// int32 [A·s/N] on the device: the positions of ring rank p's tokens in the sorted layout of
  /// cp_a2a_sort_order (cp_positions(s, P, p)); with A = 1 the same as positions(p, 1).
  Tensor ring_positions(int p) const;

  /// The p2p ring's own stream (p2p_size() > 1): the K/V and dK/dV sends/receives of ring step
  /// i + 1 run on it while the compute stream attends to the block of step i (TransformerEngine's
  /// overlap of the ring exchange with the blockwise attention). `ready` (recorded on the compute
  /// stream, waited on by the ring stream) orders a step's sends after the buffers are written and
  /// its receives after their previous contents were read; `done` (the other way) orders the
  /// compute that reads a received block after its receive. Every exchange is joined back to the
  /// compute stream within the attention call, so the pattern is capturable in a CUDA graph. On
  /// the CPU streams run inline and events are no-ops: the ring is sequential, the results the
  /// same. One per region, used by the layers in turn. Errors: mt::Error when p2p_size() == 1.
  /// The ring stream has the device's greatest priority (StreamPriority::kHigh), so that NCCL's
  /// kernels get SMs as blocks of the attention retire; measured on H200 the exchange is still not
  /// hidden (docs/benchmarks.md "Context parallelism at long sequences"). With
  /// ContextParallelOptions::ring_copy_engine the exchanges run as copy-engine transfers on the
  /// same stream between the same events (ring_register, ring_copy_exchange below).
  struct Ring {
    Stream stream;
    Event ready, done;
    std::shared_ptr<PeerRingExchange> copy_engine;  // ring_register: created (null: NCCL)
    bool registered = false;                        // ring_register ran (collectively) once
    std::string why_not;                            // why copy_engine is null after ring_register
  };
  Ring& ring() const;
  /// Whether the copy-engine exchange was asked for (ContextParallelOptions::ring_copy_engine or
  /// MT_CP_RING=ce) on a CUDA device with a p2p ring of more than one rank.
  bool ring_copy_engine_requested() const;
  /// The copy-engine exchange's setup: this rank's receive buffers of the ring (a layer's K/V and
  /// dK/dV receive tensors). With ring_copy_engine_requested(), the first call is collective over
  /// the p2p ring: it registers the cudaMalloc allocations holding them (PeerRingExchange::create;
  /// the CP attention calls it from its placing plan(), which every ring rank runs in the same
  /// order, with buffers at the same offsets of the BufferPlanner's allocation), or logs why it
  /// cannot (then every exchange stays on NCCL). Later calls check, locally, that the buffers lie in
  /// the registered allocations. Nothing when not requested. Errors (mt::Error): a later buffer
  /// outside the registered allocations (layers planned in different planners).
  void ring_register(const std::vector<Tensor>& recv) const;
  /// Whether the exchange issued next beside compute stream `st` runs on copy engines: registered
  /// and `st` not being captured into a CUDA graph (captured exchanges use NCCL: the copy-engine
  /// flags carry sequence numbers counted on the host, which a replay would repeat). Every ring rank
  /// gets the same answer as long as all capture the same steps.
  bool ring_uses_copy_engine(const Stream& st) const;
  /// One ring step by copy engines on ring().stream (after the caller's `ready` wait, before its
  /// `done` record): every `send` (any tensor) goes into the next ring rank's tensor corresponding
  /// to this rank's `recv` (same bytes; registered), and `recv` receives the previous rank's.
  /// Empty pairs are skipped. Errors (mt::Error): ring_uses_copy_engine() false; send and recv of
  /// different byte sizes; a recv outside the registered allocations.
  void ring_copy_exchange(std::span<const std::pair<Tensor, Tensor>> send_recv) const;
  /// Why the copy-engine exchange is not in use after ring_register (empty: in use, or not asked).
  std::string ring_copy_engine_why_not() const { return ring_ ? ring_->why_not : std::string(); }
  /// Benchmarks: the trace the layers record into (nullptr: none, the default).
  void set_trace(CpRingTrace* trace) { trace_ = trace; }
  CpRingTrace* trace() const { return trace_; }
  /// Benchmarks: the negative control of the ring's overlap (bench/cp_ring_bench.cpp). When set,
  /// the compute stream waits for each ring exchange right after issuing it, before the blocks it
  /// would overlap, so the ring runs serialised with the compute; the values are unchanged (the
  /// same exchanges and blocks in the same order). Default off.
  void set_ring_serialised(bool serialised) { ring_serialised_ = serialised; }
  bool ring_serialised() const { return ring_serialised_; }

 private:
  std::shared_ptr<Communicator> cp_, a2a_, p2p_;
  std::unique_ptr<Ring> ring_;
  CpRingTrace* trace_ = nullptr;
  bool ring_serialised_ = false;
  ContextParallelOptions opts_;
  int size_, rank_;
  int64_t seq_;
  Buffer positions_, ring_positions_;
  Device device_;
};

}  // namespace mt
