#include "model/moe/alltoall_dispatcher.h"

#include <algorithm>
#include <numeric>

#include "model/moe/moe_utils.h"
#include "ops/elementwise.h"
#include "ops/moe.h"
#include "ops/moe_block.h"

namespace mt {

MoEAlltoAllDispatcherBase::MoEAlltoAllDispatcherBase(const ExpertParallel& ep, const MoeDispatchSizes& s)
    : ep_(ep),
      s_(s),
      P_(group_size(ep.ep_group)),
      Q_(group_size(ep.etp_group)),
      S_(s.num_echo),
      Lv_(s.num_local + s.num_echo),
      Ev_(P_ * Lv_),
      firstv_(static_cast<int64_t>(ep.ep_rank) * Lv_),
      echo_(ep, s.num_experts, s.num_echo) {
  MT_REQUIRE(S_ == 0 || !ep.ep_group || P_ * s.num_local == s.num_experts,
             "--moe-enable-echo: {} experts over {} EP ranks of {} local experts", s.num_experts, P_, s.num_local);
}

// ---------------------------------------------------------------------------------------------
// MoEAlltoAllTokenDispatcher
// ---------------------------------------------------------------------------------------------

int64_t MoEAlltoAllTokenDispatcher::plan(BufferPlanner& p, int64_t tokens, int64_t h) {
  const DType t = p.act_dtype();
  const int64_t k = s_.topk;
  tokens_ = tokens;
  hidden_ = h;
  // Dropless bounds: each source token brings at most min(k, E_l (+ S)) rows to this rank's
  // expert slots (a token's slots name distinct experts, and distinct experts' clones are distinct).
  // With an expert capacity C each source sends at most C rows per expert slot (a clone's rows are
  // its home expert's, which the source kept at most C of).
  max_ep_rows_ = P_ * tokens * std::min(k, Lv_);
  if (s_.capacity_factor > 0)
    max_ep_rows_ = std::min(max_ep_rows_, P_ * Lv_ * moe_expert_capacity(tokens, k, s_.num_experts, s_.capacity_factor));
  const int64_t max_rows = Q_ * max_ep_rows_;
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  Saved& sv = saved_[a];
  sv.top = p.saved(DType::kI32, {tokens, k}, "routing");
  sv.probs = p.saved(DType::kF32, {tokens, k}, "routing probs");
  sv.row_index = p.saved(DType::kI32, {tokens * k}, "slots sorted by expert");
  sv.slot_row = p.saved(DType::kI32, {tokens * k}, "sorted position of each slot");
  sv.back = p.saved(t, {tokens * k, h}, "expert outputs returned to their tokens");
  if (s_.device_counts) sv.local_counts = p.saved(DType::kI32, {Lv_}, "tokens per local expert");
  counts_ = p.scratch("moe.a2a.counts", DType::kI32, {Ev_});
  counts_ep_ = p.scratch("moe.a2a.counts_ep", DType::kI32, {P_ * Ev_});
  counts_all_ = p.scratch("moe.a2a.counts_all", DType::kI32, {Q_ * P_ * Ev_});
  send_ = p.scratch("moe.a2a.send", t, {tokens * k, h});
  if (P_ > 1 && Q_ > 1) ep_rows_ = p.scratch("moe.a2a.ep", t, {max_ep_rows_, h});
  if (Q_ > 1) etp_chunks_ = p.scratch("moe.a2a.etp_chunks", t, {Q_ * max_ep_rows_, h});
  // permutation 2's stage (none with --moe-permute-fusion: the pieces travel to their rows)
  if (Lv_ > 1 && !s_.permute_fusion) stage_ = p.scratch("moe.a2a.stage", t, {max_rows, h});
  if (S_ > 0) {
    sv.top_v = p.saved(DType::kI32, {tokens, k}, "ECHO rerouted routing (virtual expert ids)");
    sv.clone_expert = p.saved(DType::kI32, {P_ * S_}, "ECHO clone placement");
    echo_.plan(p, tokens * k);
  }
  return max_rows;
}

void MoEAlltoAllTokenDispatcher::preprocess(const Tensor& x, int slot, const Stream& st) {
  Saved& sv = saved_.at(static_cast<size_t>(slot));
  Tensor top = sv.top;
  if (S_ > 0) {  // the plan and the rerouting on the device (the placement is read by dispatch())
    echo_.reroute(sv.top_v, sv.clone_expert, sv.top, st);
    top = sv.top_v;
  }
  // Permutation 1: this rank's slots sorted by (global) expert, i.e. by destination EP rank
  // (S = T·k of them, fewer when a capacity dropped some: their expert is -1; row_index is -1
  // from S on and those send rows are left untouched). The permute kernel writes the rows
  // straight into the all-to-all's send buffer.
  moe_routing_map_device(sv.row_index, sv.slot_row, counts_, top, 0, Ev_, st);
  moe_permute(send_, x, sv.row_index, s_.topk, st);
  // the counts of every rank of the ETP × EP grid (fixed sizes), read on the host by dispatch()
  if (P_ > 1) ep_.ep_group->all_gather(counts_ep_, counts_, st);
  if (Q_ > 1) ep_.etp_group->all_gather(counts_all_, P_ > 1 ? counts_ep_ : counts_, st);
}

MoeExpertCounts MoEAlltoAllTokenDispatcher::dispatch(const Tensor& xp, const Tensor& x, int slot, const Stream& st) {
  (void)x;  // permuted into the send rows by preprocess()
  MoeExpertCounts out = plan_dispatch(xp, slot, st);
  for (int64_t c = 0; c < num_chunks(slot); ++c) dispatch_chunk(xp, slot, c, st);
  return out;
}

MoeExpertCounts MoEAlltoAllTokenDispatcher::plan_dispatch(const Tensor& xp, int slot, const Stream& st) {
  Saved& sv = saved_.at(static_cast<size_t>(slot));
  if (S_ > 0) sv.placement = echo_placement_sync(sv.clone_expert, s_.num_experts, P_, st);
  sv.plan = exchange_counts(st);
  const Plan& pl = sv.plan;
  MT_CHECK(pl.rows() <= xp.size(0), "MoE alltoall dispatch: {} expert rows exceed the planned {}", pl.rows(),
           xp.size(0));
  MoeExpertCounts out;
  out.host = pl.local_counts;
  if (s_.device_counts) {  // the host counts uploaded (from the plan, which outlives the copy)
    sv.plan.local_counts32.assign(pl.local_counts.begin(), pl.local_counts.end());
    copy_bytes(sv.local_counts.data(), sv.local_counts.device(), sv.plan.local_counts32.data(), Device::cpu(),
               sv.plan.local_counts32.size() * sizeof(int32_t), st);
    out.device = sv.local_counts;
  }
  return out;
}

int64_t MoEAlltoAllTokenDispatcher::num_chunks(int slot) const {
  return static_cast<int64_t>(saved_.at(static_cast<size_t>(slot)).plan.chunks.size());
}

MoEAlltoAllTokenDispatcher::ChunkRange MoEAlltoAllTokenDispatcher::chunk(int slot, int64_t c) const {
  return saved_.at(static_cast<size_t>(slot)).plan.chunks.at(static_cast<size_t>(c)).range;
}

void MoEAlltoAllTokenDispatcher::dispatch_chunk(const Tensor& xp, int slot, int64_t c, const Stream& st) {
  const Plan& pl = saved_.at(static_cast<size_t>(slot)).plan;
  const Chunk& ch = pl.chunks.at(static_cast<size_t>(c));
  const Tensor send = row_range(send_, 0, pl.slots());
  if (s_.permute_fusion) {
    to_experts_fused(xp, send, pl, ch, st);
  } else {
    to_experts(xp, send, pl, ch, st);
  }
}

void MoEAlltoAllTokenDispatcher::combine(const Tensor& y, const Tensor& out, int slot, const Stream& st) {
  for (int64_t c = 0; c < num_chunks(slot); ++c) combine_chunk(out, slot, c, st);
  combine_finish(y, slot, st);
}

void MoEAlltoAllTokenDispatcher::combine_chunk(const Tensor& out, int slot, int64_t c, const Stream& st) {
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  const Plan& pl = sv.plan;
  // permutation 2 undone, ETP reduce-scatter, EP all-to-all back
  from_experts(row_range(sv.back, 0, pl.slots()), out, pl, pl.chunks.at(static_cast<size_t>(c)), st);
}

void MoEAlltoAllTokenDispatcher::combine_finish(const Tensor& y, int slot, const Stream& st) {
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  // Permutation 1 undone, weighted by this rank's probs.
  moe_unpermute(y, row_range(sv.back, 0, sv.plan.slots()), sv.probs, sv.slot_row, st);
}

void MoEAlltoAllTokenDispatcher::combine_backward(const Tensor& d_out, const Tensor& d_probs, const Tensor& dy,
                                                  const Tensor& out, int slot, const Stream& st) {
  (void)out;  // the probs' gradient uses the rows returned to this rank (sv.back)
  combine_backward_start(d_probs, dy, slot, st);
  for (int64_t c = 0; c < num_chunks(slot); ++c) combine_backward_chunk(d_out, slot, c, st);
}

void MoEAlltoAllTokenDispatcher::combine_backward_start(const Tensor& d_probs, const Tensor& dy, int slot,
                                                        const Stream& st) {
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  const int64_t S = sv.plan.slots();
  moe_unpermute_backward(row_range(send_, 0, S), d_probs, dy, row_range(sv.back, 0, S), sv.probs, sv.row_index,
                         sv.slot_row, st);
}

void MoEAlltoAllTokenDispatcher::combine_backward_chunk(const Tensor& d_out, int slot, int64_t c, const Stream& st) {
  dispatch_chunk(d_out, slot, c, st);  // the gradient rows travel like the tokens (from the send rows)
}

void MoEAlltoAllTokenDispatcher::dispatch_backward(const Tensor& dx, const Tensor& d_xp, int slot, const Stream& st) {
  (void)dx;  // written by preprocess_backward
  for (int64_t c = 0; c < num_chunks(slot); ++c) dispatch_backward_chunk(d_xp, slot, c, st);
}

void MoEAlltoAllTokenDispatcher::dispatch_backward_chunk(const Tensor& d_xp, int slot, int64_t c, const Stream& st) {
  const Plan& pl = saved_.at(static_cast<size_t>(slot)).plan;
  // the input gradients return like the outputs, into the send rows
  from_experts(row_range(send_, 0, pl.slots()), d_xp, pl, pl.chunks.at(static_cast<size_t>(c)), st);
}

void MoEAlltoAllTokenDispatcher::preprocess_backward(const Tensor& dx, int slot, const Stream& st) {
  // permutation 1 undone: the slot rows of each token summed (send rows [0, S) of dispatch_backward)
  moe_permute_backward(dx, send_, saved_.at(static_cast<size_t>(slot)).slot_row, s_.topk, st);
}

// The counts of every rank of the ETP × EP grid (all-gathered over EP, then over ETP by
// preprocess()) and this rank's own, copied to the host with one synchronisation; the plan.
MoEAlltoAllTokenDispatcher::Plan MoEAlltoAllTokenDispatcher::exchange_counts(const Stream& st) {
  // over the local expert slots (E_l, plus the S clones with ECHO) in the virtual layout
  const int64_t E = Ev_, El = Lv_;
  const Tensor all = Q_ > 1 ? counts_all_ : (P_ > 1 ? counts_ep_ : counts_);
  Plan pl;
  pl.grid.resize(static_cast<size_t>(Q_ * P_ * E));
  std::vector<int32_t> mine(static_cast<size_t>(E));
  copy_bytes(pl.grid.data(), Device::cpu(), all.data(), all.device(), pl.grid.size() * sizeof(int32_t), st);
  if (P_ * Q_ > 1)
    copy_bytes(mine.data(), Device::cpu(), counts_.data(), counts_.device(), mine.size() * sizeof(int32_t), st);
  st.synchronize();  // the split sizes of the exchanges
  if (P_ * Q_ == 1) mine = pl.grid;
  auto C = [&](int64_t i, int64_t j, int64_t x) {  // rows source (i, j) sends to virtual expert x
    return static_cast<int64_t>(pl.grid[static_cast<size_t>((i * P_ + j) * E + x)]);
  };
  const int qi = etp_rank(), pj = ep_rank();
  for (int64_t x = 0; x < E; ++x)
    MT_CHECK(C(qi, pj, x) == mine[static_cast<size_t>(x)],
             "MoE alltoall dispatch: exchanged count {} of expert {} differs from this rank's {}", C(qi, pj, x), x,
             mine[static_cast<size_t>(x)]);
  pl.send_offset.assign(static_cast<size_t>(E + 1), 0);
  for (int64_t x = 0; x < E; ++x)
    pl.send_offset[static_cast<size_t>(x + 1)] = pl.send_offset[static_cast<size_t>(x)] + C(qi, pj, x);
  pl.local_counts.assign(static_cast<size_t>(El), 0);
  pl.expert_rows.assign(static_cast<size_t>(El * Q_ * P_), 0);
  for (int64_t e = 0, row = 0; e < El; ++e)
    for (int64_t i = 0; i < Q_; ++i)
      for (int64_t j = 0; j < P_; ++j) {
        pl.expert_rows[static_cast<size_t>((e * Q_ + i) * P_ + j)] = row;
        row += C(i, j, firstv_ + e);
        pl.local_counts[static_cast<size_t>(e)] += C(i, j, firstv_ + e);
      }
  const int64_t nc = std::min(s_.chunks, El);
  for (int64_t c = 0, ep_begin = 0; c < nc; ++c) {
    pl.chunks.push_back(make_chunk(pl, c * El / nc, (c + 1) * El / nc, ep_begin));
    ep_begin += pl.chunks.back().ep_rows;
  }
  // statistics: every EP rank's received rows (this ETP slice's, all of them with ETP 1) and
  // the slots sent to clones
  for (int64_t m = 0; m < P_ && counting_; ++m) {
    int64_t rows = 0;
    for (int64_t i = 0; i < Q_; ++i)
      for (int64_t j = 0; j < P_; ++j)
        for (int64_t v = 0; v < El; ++v) {
          const int64_t n = C(i, j, m * El + v);
          rows += n;
          if (v >= s_.num_local && i == qi) stats_.rerouted += n;
        }
    stats_.max_received = std::max(stats_.max_received, rows);
  }
  if (counting_) ++stats_.dispatches;
  return pl;
}

// The layout of the chunk of local slots [a, b): with [0, E_l + S), the whole exchange.
MoEAlltoAllTokenDispatcher::Chunk MoEAlltoAllTokenDispatcher::make_chunk(const Plan& pl, int64_t a, int64_t b,
                                                                       int64_t ep_begin) const {
  const int64_t qi = etp_rank(), n = b - a;
  auto count = [&](int64_t i, int64_t j, int64_t e) { return pl.count(i, j, e, P_, Ev_, firstv_); };
  Chunk ch;
  ch.range.first = a;
  ch.range.last = b;
  ch.range.row_begin = pl.expert_row(a, 0, 0, Q_, P_);
  for (int64_t e = a; e < b; ++e) ch.range.rows += pl.local_counts[static_cast<size_t>(e)];
  ch.send_offsets.assign(static_cast<size_t>(P_), 0);
  ch.send_rows.assign(static_cast<size_t>(P_), 0);
  ch.recv_rows.assign(static_cast<size_t>(P_), 0);
  ch.etp_rows.assign(static_cast<size_t>(Q_), 0);
  for (int64_t m = 0; m < P_; ++m) {
    const int64_t first = pl.send_offset[static_cast<size_t>(m * Lv_ + a)];
    ch.send_offsets[static_cast<size_t>(m)] = first;
    ch.send_rows[static_cast<size_t>(m)] = pl.send_offset[static_cast<size_t>(m * Lv_ + b)] - first;
  }
  for (int64_t i = 0; i < Q_; ++i)
    for (int64_t j = 0; j < P_; ++j)
      for (int64_t e = a; e < b; ++e) {
        const int64_t r = count(i, j, e);
        ch.chunk_sizes.push_back(r);
        ch.etp_rows[static_cast<size_t>(i)] += r;
        if (i == qi) ch.recv_rows[static_cast<size_t>(j)] += r;
      }
  for (int64_t e = 0; e < n; ++e)
    for (int64_t i = 0; i < Q_; ++i)
      for (int64_t j = 0; j < P_; ++j) ch.order.push_back((i * P_ + j) * n + e);
  ch.ep_begin = ep_begin;
  ch.ep_rows = std::accumulate(ch.recv_rows.begin(), ch.recv_rows.end(), int64_t{0});
  return ch;
}

// Splits of `rows` rows each, in elements of width h: packed, or at the given row offsets.
AllToAllvSplits MoEAlltoAllTokenDispatcher::splits(const std::vector<int64_t>& rows,
                                                   const std::vector<int64_t>* offsets) const {
  AllToAllvSplits s;
  for (int64_t r : rows) s.counts.push_back(r * hidden_);
  if (offsets)
    for (int64_t o : *offsets) s.offsets.push_back(o * hidden_);
  return s;
}

// All-gather of unequal sizes over ETP (Megatron's gather_from_sequence_parallel_region with
// output_split_sizes): every rank sends its rows to all, out = the ranks' rows in rank order.
void MoEAlltoAllTokenDispatcher::etp_gather(const Tensor& out, const Tensor& in, const Chunk& ch,
                                            const Stream& st) const {
  AllToAllvSplits send;
  send.counts.assign(static_cast<size_t>(Q_), in.numel());
  send.offsets.assign(static_cast<size_t>(Q_), 0);
  ep_.etp_group->all_to_allv(out, splits(ch.etp_rows), in, send, st);
}

// Reduce-scatter of unequal sizes over ETP (reduce_scatter_to_sequence_parallel_region with
// input_split_sizes): piece i of `in` goes to ETP rank i; out = the sum over ranks, in rank order,
// of the pieces this rank receives.
void MoEAlltoAllTokenDispatcher::etp_reduce_scatter(const Tensor& out, const Tensor& in, const Plan& pl,
                                                    const Chunk& ch, bool fused, const Stream& st) const {
  const int64_t n = out.size(0);
  const Tensor chunks = row_range(etp_chunks_, 0, Q_ * n);
  if (!fused) {
    AllToAllvSplits recv;
    recv.counts.assign(static_cast<size_t>(Q_), n * hidden_);
    ep_.etp_group->all_to_allv(chunks, recv, in, splits(ch.etp_rows), st);
  } else {
    // The pieces of the expert rows `in` sent as they lie: ETP rank i's piece is, in [EP source j]
    // [slot] order, the rows of source (i, j) of every slot of the chunk (permutation 2 undone by
    // the messages; this rank's own piece copied).
    const int64_t qi = etp_rank();
    auto count = [&](int64_t i, int64_t j, int64_t e) { return pl.count(i, j, e, P_, Ev_, firstv_); };
    Communicator& g = *ep_.etp_group;
    g.group_start();
    for (int64_t i = 0; i < Q_; ++i) {
      int64_t pos = 0;  // in ETP rank i's piece
      for (int64_t j = 0; j < P_; ++j)
        for (int64_t e = ch.range.first; e < ch.range.last; ++e) {
          const int64_t r = count(i, j, e);
          if (r > 0) {
            const Tensor src = row_range(in, pl.expert_row(e, i, j, Q_, P_), r);
            if (i == qi) {
              copy(row_range(chunks, qi * n + pos, r), src, st);
            } else {
              g.send(src, static_cast<int>(i), st);
            }
          }
          pos += r;
        }
    }
    for (int64_t i = 0; i < Q_; ++i) {
      if (i == qi) continue;
      for (int64_t j = 0, pos = 0; j < P_; ++j)
        for (int64_t e = ch.range.first; e < ch.range.last; ++e) {
          const int64_t r = count(qi, j, e);
          if (r > 0) g.recv(row_range(chunks, i * n + pos, r), static_cast<int>(i), st);
          pos += r;
        }
    }
    g.group_end();
  }
  copy(out, row_range(chunks, 0, n), st);
  for (int64_t i = 1; i < Q_; ++i) add(out, out, row_range(chunks, i * n, n), st);
}

// Source side -> expert side for one chunk (see the declaration).
void MoEAlltoAllTokenDispatcher::to_experts(const Tensor& dst, const Tensor& send, const Plan& pl, const Chunk& ch,
                                            const Stream& st) const {
  (void)pl;
  const int64_t R0 = ch.range.row_begin, R = ch.range.rows;
  Tensor cur;
  if (P_ > 1) {
    const Tensor next = Q_ > 1 ? row_range(ep_rows_, ch.ep_begin, ch.ep_rows) : row_range(stage_or(dst), R0, R);
    ep_.ep_group->all_to_allv(next, splits(ch.recv_rows), send, splits(ch.send_rows, &ch.send_offsets), st);
    cur = next;
  } else {
    cur = row_range(send, ch.send_offsets[0], ch.send_rows[0]);
  }
  if (Q_ > 1) {
    const Tensor next = row_range(stage_or(dst), R0, R);
    etp_gather(next, cur, ch, st);
    cur = next;
  }
  const Tensor out = row_range(dst, R0, R);
  if (Lv_ > 1) {
    moe_sort_chunks(out, cur, ch.chunk_sizes, ch.order, st);
  } else if (cur.data() != out.data()) {
    copy(out, cur, st);
  }
}

// --moe-permute-fusion: every (source, slot) piece straight to its expert rows. The EP messages
// bring this ETP rank's pieces ((e, qi, j) for every source j), then the ETP messages give every
// ETP rank the others' pieces. A pair of ranks matches its messages in issue order: (slot, or EP
// source then slot) ascending on both sides; empty pieces are not sent. Own pieces are copied.
void MoEAlltoAllTokenDispatcher::to_experts_fused(const Tensor& dst, const Tensor& send, const Plan& pl,
                                                  const Chunk& ch, const Stream& st) const {
  const int64_t qi = etp_rank(), pj = ep_rank(), a = ch.range.first, b = ch.range.last;
  auto count = [&](int64_t i, int64_t j, int64_t e) { return pl.count(i, j, e, P_, Ev_, firstv_); };
  auto piece = [&](int64_t i, int64_t j, int64_t e) {  // source (i, j)'s rows of slot e in dst
    return row_range(dst, pl.expert_row(e, i, j, Q_, P_), count(i, j, e));
  };
  if (P_ > 1) ep_.ep_group->group_start();
  for (int64_t m = 0; m < P_; ++m)
    for (int64_t e = a; e < b; ++e) {
      const int64_t x = m * Lv_ + e, r = pl.send_offset[static_cast<size_t>(x + 1)] - pl.send_offset[static_cast<size_t>(x)];
      if (r == 0) continue;
      const Tensor src = row_range(send, pl.send_offset[static_cast<size_t>(x)], r);
      if (m == pj) {
        copy(piece(qi, pj, e), src, st);
      } else {
        ep_.ep_group->send(src, static_cast<int>(m), st);
      }
    }
  for (int64_t j = 0; j < P_; ++j)
    for (int64_t e = a; e < b && j != pj; ++e)
      if (count(qi, j, e) > 0) ep_.ep_group->recv(piece(qi, j, e), static_cast<int>(j), st);
  if (P_ > 1) ep_.ep_group->group_end();
  if (Q_ == 1) return;
  Communicator& g = *ep_.etp_group;
  g.group_start();
  for (int64_t i = 0; i < Q_; ++i)
    for (int64_t j = 0; j < P_ && i != qi; ++j)
      for (int64_t e = a; e < b; ++e)
        if (count(qi, j, e) > 0) g.send(piece(qi, j, e), static_cast<int>(i), st);
  for (int64_t i = 0; i < Q_; ++i)
    for (int64_t j = 0; j < P_ && i != qi; ++j)
      for (int64_t e = a; e < b; ++e)
        if (count(i, j, e) > 0) g.recv(piece(i, j, e), static_cast<int>(i), st);
  g.group_end();
}

// Expert side -> source side for one chunk, the exact reverse of to_experts (see the declaration).
void MoEAlltoAllTokenDispatcher::from_experts(const Tensor& dst, const Tensor& rows_in, const Plan& pl,
                                              const Chunk& ch, const Stream& st) const {
  const int64_t R0 = ch.range.row_begin, R = ch.range.rows, pj = ep_rank();
  const bool fused = s_.permute_fusion;
  Tensor cur = row_range(rows_in, R0, R);
  if (Lv_ > 1 && !fused) {
    const auto [sizes, order] = moe_sort_chunks_inverse(ch.chunk_sizes, ch.order);
    const Tensor un = row_range(stage_, R0, R);
    moe_sort_chunks(un, cur, sizes, order, st);
    cur = un;
  }
  const Tensor mine = row_range(dst, ch.send_offsets[0], ch.send_rows[0]);  // with P = 1: the chunk's rows
  if (Q_ > 1) {
    const Tensor red = P_ > 1 ? row_range(ep_rows_, ch.ep_begin, ch.ep_rows) : mine;
    etp_reduce_scatter(red, fused ? rows_in : cur, pl, ch, fused, st);
    cur = red;
  } else if (fused && P_ > 1) {
    // every (slot, EP source j) piece of the expert rows straight back to source j's send rows
    const int64_t a = ch.range.first, b = ch.range.last;
    Communicator& g = *ep_.ep_group;
    g.group_start();
    for (int64_t j = 0; j < P_; ++j)
      for (int64_t e = a; e < b; ++e) {
        const int64_t r = pl.count(0, j, e, P_, Ev_, firstv_);
        if (r == 0) continue;
        const Tensor src = row_range(rows_in, pl.expert_row(e, 0, j, Q_, P_), r);
        if (j == pj) {
          copy(row_range(dst, pl.send_offset[static_cast<size_t>(pj * Lv_ + e)], r), src, st);
        } else {
          g.send(src, static_cast<int>(j), st);
        }
      }
    for (int64_t m = 0; m < P_; ++m)
      for (int64_t e = a; e < b && m != pj; ++e) {
        const size_t x = static_cast<size_t>(m * Lv_ + e);
        const int64_t r = pl.send_offset[x + 1] - pl.send_offset[x];
        if (r > 0) g.recv(row_range(dst, pl.send_offset[x], r), static_cast<int>(m), st);
      }
    g.group_end();
    return;
  }
  if (P_ > 1) {
    ep_.ep_group->all_to_allv(dst, splits(ch.send_rows, &ch.send_offsets), cur, splits(ch.recv_rows), st);
    return;
  }
  if (cur.data() != mine.data()) copy(mine, cur, st);
}

int64_t MoEAlltoAllTokenDispatcher::Plan::rows() const {
  return std::accumulate(local_counts.begin(), local_counts.end(), int64_t{0});
}

// ---------------------------------------------------------------------------------------------
// MoEStaticAlltoAllTokenDispatcher (--moe-received-token-capacity)
// ---------------------------------------------------------------------------------------------

MoEStaticAlltoAllTokenDispatcher::MoEStaticAlltoAllTokenDispatcher(const ExpertParallel& ep, const MoeDispatchSizes& s)
    : MoEAlltoAllDispatcherBase(ep, s), B_((s.received_capacity + P_ - 1) / P_) {
  MT_REQUIRE(s.received_capacity >= 1, "--moe-received-token-capacity must be >= 1, got {}", s.received_capacity);
  MT_REQUIRE(s.device_counts,
             "--moe-received-token-capacity needs --moe-grouped-gemm (the experts read the "
             "received counts on the device)");
}

int64_t MoEStaticAlltoAllTokenDispatcher::plan(BufferPlanner& p, int64_t tokens, int64_t h) {
  const DType t = p.act_dtype();
  const int64_t k = s_.topk, blocks = P_ * B_, max_rows = Q_ * blocks;
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  Saved& sv = saved_[a];
  sv.top = p.saved(DType::kI32, {tokens, k}, "routing");
  sv.probs = p.saved(DType::kF32, {tokens, k}, "routing probs");
  sv.slot_send = p.saved(DType::kI32, {tokens * k}, "send row of each slot (-1: overflowed)");
  sv.send_index = p.saved(DType::kI32, {blocks}, "slot of each send row (-1: padding)");
  sv.gather_index = p.saved(DType::kI32, {max_rows}, "received row of each expert row");
  sv.scatter_index = p.saved(DType::kI32, {max_rows}, "expert row of each received row");
  sv.local_counts = p.saved(DType::kI32, {Lv_}, "tokens per local expert slot");
  sv.back = p.saved(t, {blocks, h}, "expert outputs returned to their tokens");
  if (S_ > 0) {
    sv.top_v = p.saved(DType::kI32, {tokens, k}, "ECHO rerouted routing (virtual expert ids)");
    sv.clone_expert = p.saved(DType::kI32, {P_ * S_}, "ECHO clone placement");
    echo_.plan(p, tokens * k);
  }
  row_index_ = p.scratch("moe.a2a.row_index", DType::kI32, {tokens * k});
  slot_row_ = p.scratch("moe.a2a.slot_row", DType::kI32, {tokens * k});
  counts_ = p.scratch("moe.a2a.counts", DType::kI32, {Ev_});
  sent_ = p.scratch("moe.a2a.sent", DType::kI32, {Ev_});
  sent_ep_ = p.scratch("moe.a2a.sent_ep", DType::kI32, {P_ * Ev_});
  sent_all_ = p.scratch("moe.a2a.sent_all", DType::kI32, {Q_ * P_, Ev_});
  send_ = p.scratch("moe.a2a.send", t, {blocks, h});
  recv_ = p.scratch("moe.a2a.recv", t, {blocks, h});
  if (Q_ > 1) recv_all_ = p.scratch("moe.a2a.recv_all", t, {max_rows, h});
  if (p.placing() && overflow_buffer_.bytes() == 0) {  // not while the model is only measured
    overflow_buffer_ = Buffer(p.device(), sizeof(float));
    overflow_ = overflow_buffer_.as(DType::kF32, {1});
  }
  return max_rows;
}

MoeDispatchStats MoEStaticAlltoAllTokenDispatcher::stats(const Stream& st) const {
  MoeDispatchStats out;
  if (!overflow_zeroed_) return out;
  float v = 0;
  copy_bytes(&v, Device::cpu(), overflow_.data(), overflow_.device(), sizeof(float), st);
  st.synchronize();
  out.overflowed = static_cast<int64_t>(v);
  return out;
}

void MoEStaticAlltoAllTokenDispatcher::reset_stats(const Stream& st) {
  if (overflow_zeroed_) fill(overflow_, 0.f, st);
}

void MoEStaticAlltoAllTokenDispatcher::preprocess(const Tensor& x, int slot, const Stream& st) {
  Saved& sv = saved_.at(static_cast<size_t>(slot));
  if (!overflow_zeroed_) {  // first use (an eager step: CUDA graphs capture after warm-up)
    fill(overflow_, 0.f, st);
    overflow_zeroed_ = true;
  }
  Tensor top = sv.top;
  if (S_ > 0) {
    echo_.reroute(sv.top_v, sv.clone_expert, sv.top, st);
    top = sv.top_v;
  }
  // permutation 1 into the fixed blocks; the overflow dropped and counted
  moe_routing_map_device(row_index_, slot_row_, counts_, top, 0, Ev_, st);
  moe_block_send_layout(sv.send_index, sv.slot_send, sent_, counting_ ? overflow_ : Tensor(), counts_, row_index_, P_,
                        B_, st);
  moe_permute(send_, x, sv.send_index, s_.topk, st);
  // the kept counts of every source, in received-block order [ETP rank][EP rank]
  Tensor all = sent_;
  if (P_ > 1) {
    ep_.ep_group->all_gather(sent_ep_, sent_, st);
    all = sent_ep_;
  }
  if (Q_ > 1) {
    ep_.etp_group->all_gather(sent_all_.view({Q_ * P_ * Ev_}), all, st);
  } else {
    copy(sent_all_.view({P_ * Ev_}), all, st);
  }
  moe_block_receive_layout(sv.gather_index, sv.scatter_index, sv.local_counts, sent_all_, firstv_, Lv_, B_, st);
}

MoeExpertCounts MoEStaticAlltoAllTokenDispatcher::dispatch(const Tensor& xp, const Tensor& x, int slot,
                                                           const Stream& st) {
  (void)x;  // in the send blocks since preprocess()
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  to_experts(xp, send_, sv, st);
  MoeExpertCounts out;
  out.device = sv.local_counts;
  return out;
}

void MoEStaticAlltoAllTokenDispatcher::combine(const Tensor& y, const Tensor& out, int slot, const Stream& st) {
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  from_experts(sv.back, out, sv, st);
  moe_unpermute(y, sv.back, sv.probs, sv.slot_send, st);
}

void MoEStaticAlltoAllTokenDispatcher::combine_backward(const Tensor& d_out, const Tensor& d_probs, const Tensor& dy,
                                                        const Tensor& out, int slot, const Stream& st) {
  (void)out;  // the probs' gradient uses the rows returned to this rank (sv.back)
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  moe_unpermute_backward(send_, d_probs, dy, sv.back, sv.probs, sv.send_index, sv.slot_send, st);
  to_experts(d_out, send_, sv, st);
}

void MoEStaticAlltoAllTokenDispatcher::dispatch_backward(const Tensor& dx, const Tensor& d_xp, int slot,
                                                         const Stream& st) {
  (void)dx;  // written by preprocess_backward
  from_experts(send_, d_xp, saved_.at(static_cast<size_t>(slot)), st);
}

void MoEStaticAlltoAllTokenDispatcher::preprocess_backward(const Tensor& dx, int slot, const Stream& st) {
  moe_permute_backward(dx, send_, saved_.at(static_cast<size_t>(slot)).slot_send, s_.topk, st);
}

// send-layout rows [P·B, h] -> expert rows [Q·P·B, h] (rows beyond the counts untouched)
void MoEStaticAlltoAllTokenDispatcher::to_experts(const Tensor& dst, const Tensor& rows_in, const Saved& sv,
                                                  const Stream& st) const {
  Tensor cur = rows_in;
  if (P_ > 1) {
    ep_.ep_group->all_to_all(recv_, cur, st);
    cur = recv_;
  }
  if (Q_ > 1) {
    ep_.etp_group->all_gather(recv_all_, cur, st);
    cur = recv_all_;
  }
  moe_permute(dst, cur, sv.gather_index, 1, st);
}

// expert rows [Q·P·B, h] -> send-layout rows [P·B, h] (padding rows stale: never read)
void MoEStaticAlltoAllTokenDispatcher::from_experts(const Tensor& dst, const Tensor& rows_in, const Saved& sv,
                                                    const Stream& st) const {
  const Tensor blocks = Q_ > 1 ? recv_all_ : (P_ > 1 ? recv_ : dst);
  moe_permute(blocks, rows_in, sv.scatter_index, 1, st);
  Tensor cur = blocks;
  if (Q_ > 1) {
    const Tensor red = P_ > 1 ? recv_ : dst;
    ep_.etp_group->reduce_scatter(red, cur, ReduceOp::kSum, st);
    cur = red;
  }
  if (P_ > 1) ep_.ep_group->all_to_all(dst, cur, st);
}

}  // namespace mt
