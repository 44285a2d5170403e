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
  max_ep_rows_ = P_ * tokens * std::min(k, Lv_);
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
  if (Lv_ > 1) stage_ = p.scratch("moe.a2a.stage", t, {max_rows, h});
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
  // from S on and those send rows are left untouched).
  moe_routing_map_device(sv.row_index, sv.slot_row, counts_, top, 0, Ev_, st);
  moe_permute(send_, x, sv.row_index, s_.topk, st);
  // the counts of every rank of the ETP × EP grid (fixed sizes), read on the host by dispatch()
  if (P_ > 1) ep_.ep_group->all_gather(counts_ep_, counts_, st);
  if (Q_ > 1) ep_.etp_group->all_gather(counts_all_, P_ > 1 ? counts_ep_ : counts_, st);
}

MoeExpertCounts MoEAlltoAllTokenDispatcher::dispatch(const Tensor& xp, const Tensor& x, int slot, const Stream& st) {
  (void)x;  // permuted into the send rows by preprocess()
  Saved& sv = saved_.at(static_cast<size_t>(slot));
  if (S_ > 0) sv.placement = echo_placement_sync(sv.clone_expert, s_.num_experts, P_, st);
  sv.plan = exchange_counts(st);
  const Plan& pl = sv.plan;
  MT_CHECK(pl.rows() <= xp.size(0), "MoE alltoall dispatch: {} expert rows exceed the planned {}", pl.rows(),
           xp.size(0));
  to_experts(xp, row_range(send_, 0, pl.slots()), pl, st);
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

void MoEAlltoAllTokenDispatcher::combine(const Tensor& y, const Tensor& out, int slot, const Stream& st) {
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  const Plan& pl = sv.plan;
  const Tensor back = row_range(sv.back, 0, pl.slots());
  from_experts(back, out, pl, st);  // permutation 2 undone, ETP reduce-scatter, EP all-to-all back
  // Permutation 1 undone, weighted by this rank's probs.
  moe_unpermute(y, back, sv.probs, sv.slot_row, st);
}

void MoEAlltoAllTokenDispatcher::combine_backward(const Tensor& d_out, const Tensor& d_probs, const Tensor& dy,
                                                  const Tensor& out, int slot, const Stream& st) {
  (void)out;  // the probs' gradient uses the rows returned to this rank (sv.back)
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  const Plan& pl = sv.plan;
  const int64_t S = pl.slots();
  const Tensor d_send = row_range(send_, 0, S);
  moe_unpermute_backward(d_send, d_probs, dy, row_range(sv.back, 0, S), sv.probs, sv.row_index, sv.slot_row, st);
  to_experts(d_out, d_send, pl, st);  // the gradient rows travel like the tokens
}

void MoEAlltoAllTokenDispatcher::dispatch_backward(const Tensor& dx, const Tensor& d_xp, int slot, const Stream& st) {
  (void)dx;  // written by preprocess_backward
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  const Tensor d_send = row_range(send_, 0, sv.plan.slots());
  from_experts(d_send, d_xp, sv.plan, st);  // the input gradients return like the outputs
}

void MoEAlltoAllTokenDispatcher::preprocess_backward(const Tensor& dx, int slot, const Stream& st) {
  // permutation 1 undone: the slot rows of each token summed (send rows [0, S) of dispatch_backward)
  moe_permute_backward(dx, send_, saved_.at(static_cast<size_t>(slot)).slot_row, s_.topk, st);
}

// The counts of every rank of the ETP × EP grid (all-gathered over EP, then over ETP by
// preprocess()) and this rank's own, copied to the host with one synchronisation; the plan.
MoEAlltoAllTokenDispatcher::Plan MoEAlltoAllTokenDispatcher::exchange_counts(const Stream& st) {
  // over the local expert slots (E_l, plus the S clones with ECHO) in the virtual layout
  const int64_t E = Ev_, El = Lv_, first = firstv_;
  const Tensor all = Q_ > 1 ? counts_all_ : (P_ > 1 ? counts_ep_ : counts_);
  std::vector<int32_t> host(static_cast<size_t>(Q_ * P_ * E)), mine(static_cast<size_t>(E));
  copy_bytes(host.data(), Device::cpu(), all.data(), all.device(), host.size() * sizeof(int32_t), st);
  if (P_ * Q_ > 1)
    copy_bytes(mine.data(), Device::cpu(), counts_.data(), counts_.device(), mine.size() * sizeof(int32_t), st);
  st.synchronize();  // the split sizes of the exchanges
  if (P_ * Q_ == 1) mine = host;
  auto C = [&](int64_t i, int64_t j, int64_t e) {
    return static_cast<int64_t>(host[static_cast<size_t>((i * P_ + j) * E + e)]);
  };
  const int qi = etp_rank(), pj = ep_rank();
  for (int64_t e = 0; e < E; ++e)
    MT_CHECK(C(qi, pj, e) == mine[static_cast<size_t>(e)],
             "MoE alltoall dispatch: exchanged count {} of expert {} differs from this rank's {}", C(qi, pj, e), e,
             mine[static_cast<size_t>(e)]);
  Plan pl;
  pl.send_rows.assign(static_cast<size_t>(P_), 0);
  pl.recv_rows.assign(static_cast<size_t>(P_), 0);
  pl.etp_rows.assign(static_cast<size_t>(Q_), 0);
  pl.local_counts.assign(static_cast<size_t>(El), 0);
  for (int64_t m = 0; m < P_; ++m)
    for (int64_t e = m * El; e < (m + 1) * El; ++e) pl.send_rows[static_cast<size_t>(m)] += C(qi, pj, e);
  for (int64_t i = 0; i < Q_; ++i)
    for (int64_t j = 0; j < P_; ++j)
      for (int64_t e = 0; e < El; ++e) {
        const int64_t n = C(i, j, first + e);
        pl.chunk_sizes.push_back(n);
        pl.etp_rows[static_cast<size_t>(i)] += n;
        if (i == qi) pl.recv_rows[static_cast<size_t>(j)] += n;
        pl.local_counts[static_cast<size_t>(e)] += n;
      }
  for (int64_t e = 0; e < El; ++e)
    for (int64_t i = 0; i < Q_; ++i)
      for (int64_t j = 0; j < P_; ++j) pl.order.push_back((i * P_ + j) * El + e);
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

// Packed splits of `rows` rows each, in elements of width h.
AllToAllvSplits MoEAlltoAllTokenDispatcher::splits(const std::vector<int64_t>& rows) const {
  AllToAllvSplits s;
  for (int64_t r : rows) s.counts.push_back(r * hidden_);
  return s;
}

// EP all_to_allv: piece m of `in` (in_rows[m] rows) to EP rank m, piece j of `out` from j.
void MoEAlltoAllTokenDispatcher::ep_exchange(const Tensor& out, const std::vector<int64_t>& out_rows, const Tensor& in,
                                             const std::vector<int64_t>& in_rows, const Stream& st) const {
  ep_.ep_group->all_to_allv(out, splits(out_rows), in, splits(in_rows), st);
}

// All-gather of unequal sizes over ETP (Megatron's gather_from_sequence_parallel_region with
// output_split_sizes): every rank sends its rows to all, out = the ranks' rows in rank order.
void MoEAlltoAllTokenDispatcher::etp_gather(const Tensor& out, const Tensor& in, const Plan& pl,
                                            const Stream& st) const {
  AllToAllvSplits send;
  send.counts.assign(static_cast<size_t>(Q_), in.numel());
  send.offsets.assign(static_cast<size_t>(Q_), 0);
  ep_.etp_group->all_to_allv(out, splits(pl.etp_rows), in, send, st);
}

// Reduce-scatter of unequal sizes over ETP (reduce_scatter_to_sequence_parallel_region with
// input_split_sizes): piece i of `in` goes to ETP rank i; out = the sum over ranks, in rank order,
// of the pieces this rank receives.
void MoEAlltoAllTokenDispatcher::etp_reduce_scatter(const Tensor& out, const Tensor& in, const Plan& pl,
                                                    const Stream& st) const {
  const int64_t n = out.size(0);
  AllToAllvSplits recv;
  recv.counts.assign(static_cast<size_t>(Q_), n * hidden_);
  const Tensor chunks = row_range(etp_chunks_, 0, Q_ * n);
  ep_.etp_group->all_to_allv(chunks, recv, in, splits(pl.etp_rows), st);
  copy(out, row_range(chunks, 0, n), st);
  for (int64_t i = 1; i < Q_; ++i) add(out, out, row_range(chunks, i * n, n), st);
}

// Source side -> expert side, for rows [S, h] in this rank's expert-sorted slot order (tokens,
// or the gradients of the outputs): EP all-to-all, ETP all-gather, permutation 2 into rows
// [0, R) of dst, ordered by local expert.
void MoEAlltoAllTokenDispatcher::to_experts(const Tensor& dst, const Tensor& rows_in, const Plan& pl,
                                            const Stream& st) const {
  const int64_t R = pl.rows();
  Tensor cur = rows_in;
  if (P_ > 1) {
    const Tensor next = row_range(Q_ > 1 ? ep_rows_ : stage_or(dst), 0, pl.ep_rows());
    ep_exchange(next, pl.recv_rows, cur, pl.send_rows, st);
    cur = next;
  }
  if (Q_ > 1) {
    const Tensor next = row_range(stage_or(dst), 0, R);
    etp_gather(next, cur, pl, st);
    cur = next;
  }
  const Tensor out = row_range(dst, 0, R);
  if (Lv_ > 1) {
    moe_sort_chunks(out, cur, pl.chunk_sizes, pl.order, st);
  } else if (cur.data() != out.data()) {
    copy(out, cur, st);
  }
}

// Expert side -> source side, the exact reverse, for expert-side rows [R, h] (outputs, or input
// gradients): permutation 2 undone, ETP reduce-scatter, EP all-to-all back into dst [S, h], in
// this rank's expert-sorted slot order.
void MoEAlltoAllTokenDispatcher::from_experts(const Tensor& dst, const Tensor& rows_in, const Plan& pl,
                                              const Stream& st) const {
  const int64_t R = pl.rows();
  Tensor cur = row_range(rows_in, 0, R);
  if (Lv_ > 1) {
    const auto [sizes, order] = moe_sort_chunks_inverse(pl.chunk_sizes, pl.order);
    const Tensor un = row_range(stage_, 0, R);
    moe_sort_chunks(un, cur, sizes, order, st);
    cur = un;
  }
  if (Q_ > 1) {
    const Tensor red = P_ > 1 ? row_range(ep_rows_, 0, pl.ep_rows()) : dst;
    etp_reduce_scatter(red, cur, pl, st);
    cur = red;
  }
  if (P_ > 1) {
    ep_exchange(dst, pl.send_rows, cur, pl.recv_rows, st);
    cur = dst;
  }
  if (cur.data() != dst.data()) copy(dst, cur, st);
}

int64_t MoEAlltoAllTokenDispatcher::Plan::ep_rows() const {
  return std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
}
int64_t MoEAlltoAllTokenDispatcher::Plan::slots() const {
  return std::accumulate(send_rows.begin(), send_rows.end(), int64_t{0});
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
