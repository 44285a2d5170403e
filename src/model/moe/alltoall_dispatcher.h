// MoEAlltoAllTokenDispatcher (Megatron-Core transformer/moe/token_dispatcher.py,
// --moe-token-dispatcher-type alltoall) and its static-block variant for
// --moe-received-token-capacity.
//
// MoEAlltoAllTokenDispatcher: each rank sorts its own T·k slots by expert ("permutation 1"), the
// per-expert counts are all-gathered over the EP and ETP groups (small fixed-size collectives,
// then one device-to-host copy: the split sizes live on the host, as Megatron's .cpu() sync), an
// all_to_allv over the EP group sends every slot's row to the rank holding its expert, with expert
// tensor parallelism > 1 an all-gather of unequal sizes over the ETP group follows, and the
// received chunks are regrouped from [ETP source][EP source][local expert] to [local expert][ETP
// source][EP source] order ("permutation 2", moe_sort_chunks). The combine is the exact reverse
// (regroup, reduce-scatter of unequal sizes over ETP, all_to_allv back), and the probs are applied
// on the source rank (moe_unpermute), so they never travel. The backward runs the same exchanges
// in the other direction.
//   preprocess(): with ECHO the plan and the rerouting (EchoRouter, model/moe/echo.h), the routing
//   map over all experts, permutation 1 of x into the send rows, the all-gather of the per-expert
//   counts over EP and ETP; dispatch() copies those counts to the host (and with ECHO the
//   placement) and runs the all_to_allv. preprocess_backward(): permutation 1's backward.
//   The exchanges run per chunk of local expert slots (MoeDispatchSizes::chunks; one chunk by
//   default): a chunk's rows are pieces of the send rows and land on a run of the expert rows, so
//   any chunking moves the same rows to the same places (--overlap-moe-expert-parallel-comm
//   pipelines the chunks with the experts, model/moe/moe_layer.h). With
//   --moe-permute-fusion permutation 2 is done by the messages themselves: every (source, local
//   slot) piece is sent from, and received into, its final rows (point-to-point messages in one
//   group per exchange; own pieces copied), with no staging buffer and no moe_sort_chunks copies.
//
// MoEStaticAlltoAllTokenDispatcher (--moe-received-token-capacity C, capturable): every EP pair
// exchanges a fixed block of B = ceil(C / P) rows, so the all-to-all has constant split sizes and
// nothing is read on the host. Permutation 1 sorts this rank's slots by (virtual) expert; the first
// B slots of each destination's run fill its block (ops/moe_block.h moe_block_send_layout), the
// others overflow: they are dropped like capacity-dropped slots (no output, no probability
// gradient) and counted on the device. The kept counts are all-gathered (fixed size), and the
// receiver builds permutation 2 from them on the device (moe_block_receive_layout). Expert TP
// all-gathers / reduce-scatters the equal blocks. The experts see R_max = Q·P·B rows with device
// counts (--moe-grouped-gemm).
//   preprocess(): the same up to permutation 1 into the fixed send blocks (overflow counted), the
//   kept counts' all-gather and the receive layout (permutation 2's maps, the local expert counts);
//   dispatch() is the all-to-all and permutation 2. preprocess_backward(): permutation 1's backward.
#pragma once
#include <vector>

#include "core/buffer.h"
#include "model/moe/echo.h"
#include "model/moe/token_dispatcher.h"

namespace mt {

/// What both alltoall dispatchers share: the groups, the expert slots a dispatch routes to (with
/// ECHO the S clones are local expert slots E_l .. E_l + S − 1 of every EP rank) and the rerouting.
/// Errors: mt::Error when ECHO is on and E != ep·E_l.
class MoEAlltoAllDispatcherBase : public MoeTokenDispatcher {
 protected:
  MoEAlltoAllDispatcherBase(const ExpertParallel& ep, const MoeDispatchSizes& sizes);

  ExpertParallel ep_;
  MoeDispatchSizes s_;
  int64_t P_, Q_;  // EP and ETP group sizes
  // ECHO spare slots per EP rank (0: off), and the dispatch's expert layout: Lv_ = E_l + S local
  // expert slots per EP rank, Ev_ = P·Lv_ in all, this rank's first at firstv_ (without ECHO the
  // experts themselves)
  int64_t S_, Lv_, Ev_, firstv_;
  EchoRouter echo_;
};

class MoEAlltoAllTokenDispatcher final : public MoEAlltoAllDispatcherBase {
 public:
  MoEAlltoAllTokenDispatcher(const ExpertParallel& ep, const MoeDispatchSizes& sizes)
      : MoEAlltoAllDispatcherBase(ep, sizes) {}

  int64_t plan(BufferPlanner& planner, int64_t tokens, int64_t hidden) override;
  Tensor top(int slot) const override { return saved_.at(static_cast<size_t>(slot)).top; }
  Tensor probs(int slot) const override { return saved_.at(static_cast<size_t>(slot)).probs; }
  const EchoPlacement* echo_placement(int slot) const override {
    return S_ > 0 ? &saved_.at(static_cast<size_t>(slot)).placement : nullptr;
  }
  MoeDispatchStats stats(const Stream&) const override { return stats_; }
  void reset_stats(const Stream&) override { stats_ = {}; }
  void preprocess(const Tensor& x, int slot, const Stream& stream) override;
  /// plan_dispatch(), then every chunk's dispatch_chunk() on `stream`.
  MoeExpertCounts dispatch(const Tensor& xp, const Tensor& x, int slot, const Stream& stream) override;
  /// Every chunk's combine_chunk() on `stream`, then combine_finish().
  void combine(const Tensor& y, const Tensor& out, int slot, const Stream& stream) override;
  void combine_backward(const Tensor& d_out, const Tensor& d_probs, const Tensor& dy, const Tensor& out, int slot,
                        const Stream& stream) override;
  bool combine_backward_reads_output() const override { return false; }  // the returned rows (back)
  void dispatch_backward(const Tensor& dx, const Tensor& d_xp, int slot, const Stream& stream) override;
  void preprocess_backward(const Tensor& dx, int slot, const Stream& stream) override;

  // --- The exchange in chunks of local expert slots (--overlap-moe-expert-parallel-comm: the MoE
  // layer runs the chunks' exchanges on a side stream, pipelined with the experts of the chunks
  // already here; model/moe/moe_layer.h). The rows of a chunk travel exactly as they do in one
  // exchange and land on the same rows, so the results are bitwise those of dispatch() /
  // combine(). Each function is collective over the EP and ETP groups; all ranks issue the chunks
  // in the same order. ---

  /// The local expert slots [first, last) of a chunk and their expert rows [row_begin, row_begin +
  /// rows) (rows ordered by slot, as dispatch() lays them out).
  struct ChunkRange {
    int64_t first = 0, last = 0, row_begin = 0, rows = 0;
  };
  /// dispatch() without the exchange: the host read of the counts (one synchronisation of
  /// `stream`; with ECHO also the placement) and the layout of every chunk; returns the counts.
  /// xp: the expert input [R_max, h] (its size is checked against the rows). Collective: none.
  MoeExpertCounts plan_dispatch(const Tensor& xp, int slot, const Stream& stream);
  /// The chunks of area `slot`'s last plan_dispatch(): min(MoeDispatchSizes::chunks, E_l (+ S)).
  int64_t num_chunks(int slot) const;
  ChunkRange chunk(int slot, int64_t c) const;
  /// The forward exchange of chunk c: its rows [row_begin, row_begin + rows) of xp written.
  void dispatch_chunk(const Tensor& xp, int slot, int64_t c, const Stream& stream);
  /// The combine's exchange of chunk c: out's rows of the chunk returned to their source ranks
  /// (into the saved returned rows); out [≥ R, h] as for combine().
  void combine_chunk(const Tensor& out, int slot, int64_t c, const Stream& stream);
  /// After every combine_chunk(): y [T, h] (overwritten) = the probability-weighted sum per token.
  void combine_finish(const Tensor& y, int slot, const Stream& stream);
  /// combine_backward() before its exchange: d_probs fp32 [T, k] (overwritten) and the gradient of
  /// every slot's row, in the send layout (scratch read by combine_backward_chunk()).
  void combine_backward_start(const Tensor& d_probs, const Tensor& dy, int slot, const Stream& stream);
  /// The exchange of chunk c of combine_backward(): d_out's rows of the chunk written.
  void combine_backward_chunk(const Tensor& d_out, int slot, int64_t c, const Stream& stream);
  /// The exchange of chunk c of dispatch_backward(): d_xp's rows of the chunk returned to the send
  /// layout (read by preprocess_backward() once every chunk is back).
  void dispatch_backward_chunk(const Tensor& d_xp, int slot, int64_t c, const Stream& stream);

 private:
  // One chunk of the exchange of one micro-batch, from the counts of every rank of the ETP × EP grid.
  struct Chunk {
    ChunkRange range;
    int64_t ep_begin = 0, ep_rows = 0;  // this rank's EP-received rows of the chunk: their place in the staging
    std::vector<int64_t> send_offsets;  // [P]: the first send row (this rank's expert-sorted slots) to EP rank m
    std::vector<int64_t> send_rows;     // [P]: rows this rank sends to EP rank m
    std::vector<int64_t> recv_rows;     // [P]: rows this rank receives from EP rank j
    std::vector<int64_t> etp_rows;      // [Q]: rows ETP rank i received over EP (its all-gather piece)
    std::vector<int64_t> chunk_sizes;   // [Q·P·slots] in received order [ETP i][EP j][slot]
    std::vector<int64_t> order;         // permutation 2: [slot][i][j] order of those pieces
  };
  // The host-side layout of one micro-batch's exchange.
  struct Plan {
    std::vector<int32_t> grid;            // [Q·P·Ev]: the counts of every rank of the grid, (i·P + j)·Ev + x
    std::vector<int64_t> send_offset;     // [Ev + 1]: this rank's send row of each (virtual) expert's first slot
    std::vector<int64_t> local_counts;    // [E_l + S]: rows per local expert slot
    std::vector<int32_t> local_counts32;  // the same, the source of the device copy (device_counts)
    std::vector<int64_t> expert_rows;     // [(E_l + S)·Q·P]: the first expert row of source (i, j)'s piece of slot e
    std::vector<Chunk> chunks;
    int64_t slots() const { return send_offset.back(); }
    int64_t rows() const;
    int64_t expert_row(int64_t e, int64_t i, int64_t j, int64_t Q, int64_t P) const {
      return expert_rows[static_cast<size_t>((e * Q + i) * P + j)];
    }
    // rows source (i, j) sends to local slot e
    int64_t count(int64_t i, int64_t j, int64_t e, int64_t P, int64_t Ev, int64_t first) const {
      return grid[static_cast<size_t>((i * P + j) * Ev + first + e)];
    }
  };
  struct Saved {
    Tensor top;        // int32 [T, k]
    Tensor probs;      // fp32 [T, k]
    Tensor row_index;  // int32 [T·k]: the flat slot at each position of the expert-sorted order
    Tensor slot_row;   // int32 [T·k]: its inverse
    Tensor back;       // [T·k, h]: the expert outputs returned to this rank (probs' gradient)
    Tensor local_counts;  // int32 [E_l + S] on the device (device_counts only)
    Plan plan;
    // ECHO
    Tensor top_v;          // int32 [T, k]: the rerouted selection in virtual expert ids
    Tensor clone_expert;   // int32 [ep·S]: the plan's placement
    EchoPlacement placement;
  };

  int etp_rank() const { return ep_.etp_group ? ep_.etp_group->rank() : 0; }
  int ep_rank() const { return ep_.ep_group ? ep_.ep_group->rank() : 0; }
  // The stage buffer of permutation 2, or `direct` when there is no regrouping (one local expert).
  Tensor stage_or(const Tensor& direct) const { return Lv_ > 1 ? stage_ : direct; }
  // The counts of every rank of the ETP × EP grid (all-gathered over EP, then over ETP by
  // preprocess()) and this rank's own, copied to the host with one synchronisation; the plan.
  Plan exchange_counts(const Stream& st);
  // The layout of the chunk of local slots [a, b) (ep_begin: its EP-received rows' first row).
  Chunk make_chunk(const Plan& pl, int64_t a, int64_t b, int64_t ep_begin) const;
  // Packed splits of `rows` rows each, in elements of width h (with row offsets when given).
  AllToAllvSplits splits(const std::vector<int64_t>& rows, const std::vector<int64_t>* offsets = nullptr) const;
  // All-gather of unequal sizes over ETP (Megatron's gather_from_sequence_parallel_region with
  // output_split_sizes): every rank sends its rows to all, out = the ranks' rows in rank order.
  void etp_gather(const Tensor& out, const Tensor& in, const Chunk& ch, const Stream& st) const;
  // Reduce-scatter of unequal sizes over ETP (reduce_scatter_to_sequence_parallel_region with
  // input_split_sizes): piece i of `in` goes to ETP rank i; out = the sum over ranks, in rank order,
  // of the pieces this rank receives. With `fused` the pieces are sent straight from the expert
  // rows `in` [≥ R, h] (permutation 2 undone by the messages).
  void etp_reduce_scatter(const Tensor& out, const Tensor& in, const Plan& pl, const Chunk& ch, bool fused,
                          const Stream& st) const;
  // Source side -> expert side for one chunk, from send [S, h] (this rank's expert-sorted slot rows:
  // tokens, or the gradients of the outputs): EP all-to-all, ETP all-gather, permutation 2 into
  // the chunk's rows of dst [≥ R, h]; or, with permute fusion, every piece straight to its row.
  void to_experts(const Tensor& dst, const Tensor& send, const Plan& pl, const Chunk& ch, const Stream& st) const;
  void to_experts_fused(const Tensor& dst, const Tensor& send, const Plan& pl, const Chunk& ch,
                        const Stream& st) const;
  // Expert side -> source side, the exact reverse, from the chunk's rows of rows_in [≥ R, h]
  // (outputs, or input gradients) into their rows of dst [S, h], this rank's expert-sorted slot order.
  void from_experts(const Tensor& dst, const Tensor& rows_in, const Plan& pl, const Chunk& ch,
                    const Stream& st) const;

  int64_t tokens_ = 0, hidden_ = 0, max_ep_rows_ = 0;
  std::vector<Saved> saved_;  // per area
  Tensor counts_, counts_ep_, counts_all_, send_, ep_rows_, etp_chunks_, stage_;
  MoeDispatchStats stats_;
};

/// The capturable variant (--moe-received-token-capacity; file comment). Errors: mt::Error when
/// the capacity is < 1 or the experts do not read device counts (--moe-grouped-gemm).
class MoEStaticAlltoAllTokenDispatcher final : public MoEAlltoAllDispatcherBase {
 public:
  MoEStaticAlltoAllTokenDispatcher(const ExpertParallel& ep, const MoeDispatchSizes& sizes);

  int64_t plan(BufferPlanner& planner, int64_t tokens, int64_t hidden) override;
  Tensor top(int slot) const override { return saved_.at(static_cast<size_t>(slot)).top; }
  Tensor probs(int slot) const override { return saved_.at(static_cast<size_t>(slot)).probs; }
  const EchoPlacement* echo_placement(int) const override { return nullptr; }  // device-side only
  Tensor echo_clone_expert(int slot) const override {
    return S_ > 0 ? saved_.at(static_cast<size_t>(slot)).clone_expert : Tensor();
  }
  MoeDispatchStats stats(const Stream& stream) const override;
  void reset_stats(const Stream& stream) override;
  void preprocess(const Tensor& x, int slot, const Stream& stream) override;
  MoeExpertCounts dispatch(const Tensor& xp, const Tensor& x, int slot, const Stream& stream) override;
  void combine(const Tensor& y, const Tensor& out, int slot, const Stream& stream) override;
  void combine_backward(const Tensor& d_out, const Tensor& d_probs, const Tensor& dy, const Tensor& out, int slot,
                        const Stream& stream) override;
  bool combine_backward_reads_output() const override { return false; }  // the returned rows (back)
  void dispatch_backward(const Tensor& dx, const Tensor& d_xp, int slot, const Stream& stream) override;
  void preprocess_backward(const Tensor& dx, int slot, const Stream& stream) override;

 private:
  struct Saved {
    Tensor top, probs;       // int32 / fp32 [T, k]
    Tensor slot_send;        // int32 [T·k]
    Tensor send_index;       // int32 [P·B]
    Tensor gather_index, scatter_index;  // int32 [Q·P·B]
    Tensor local_counts;     // int32 [E_l + S]
    Tensor back;             // [P·B, h]
    Tensor top_v, clone_expert;  // ECHO
  };
  // send-layout rows [P·B, h] -> expert rows [Q·P·B, h] (rows beyond the counts untouched)
  void to_experts(const Tensor& dst, const Tensor& rows_in, const Saved& sv, const Stream& st) const;
  // expert rows [Q·P·B, h] -> send-layout rows [P·B, h] (padding rows stale: never read)
  void from_experts(const Tensor& dst, const Tensor& rows_in, const Saved& sv, const Stream& st) const;

  int64_t B_;  // rows of each EP pair's block
  std::vector<Saved> saved_;  // per area
  Tensor row_index_, slot_row_, counts_, sent_, sent_ep_, sent_all_, send_, recv_, recv_all_;
  Buffer overflow_buffer_;  // fp32 [1]: slots dropped at the block capacity since the last reset
  Tensor overflow_;
  bool overflow_zeroed_ = false;
};

}  // namespace mt
