#include "model/layers/cp_attention.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "ops/elementwise.h"

namespace mt {

ContextParallelAttention::ContextParallelAttention(const TransformerConfig& c, int64_t layer,
                                                   const TensorParallelRegion& tp, const ContextParallelRegion& cp,
                                                   bool cudnn)
    : config_(c),
      layer_(layer),
      cp_(cp),
      // cuDNN never runs allgather's rank-ordered keys, dropout or --deterministic-mode blocks:
      // then its workspace parts are not planned either.
      cudnn_(cudnn && cp.comm_type() != CpCommType::kAllGather && c.attention_dropout == 0.f && !c.deterministic_mode),
      qpg_(c.num_attention_heads / c.query_groups()),
      d_(c.head_dim()),
      a2a_(cp.a2a_size()),
      p2p_(cp.p2p_size()),
      outer_(cp.p2p_group().rank()),
      sort_(cp_a2a_sort_order(cp.a2a_size())) {
  const int64_t groups_local = c.query_groups() / tp.size();
  MT_REQUIRE(groups_local % a2a_ == 0, "--cp-comm-type {}: {} query groups per TP rank do not split over {} ranks",
             cp_comm_type_name(cp.comm_type()), groups_local, a2a_);
  groups_a_ = groups_local / a2a_;
  heads_a_ = groups_a_ * qpg_;
  // TP rank t holds heads [t·n/tp, (t + 1)·n/tp); a2a rank j of those the query groups
  // [j·g_a, (j + 1)·g_a) (the all-to-all of forward sends part j to rank j).
  head_offset_ = tp.rank() * (c.num_attention_heads / tp.size()) + cp.a2a_group().rank() * heads_a_;
}

void ContextParallelAttention::plan(BufferPlanner& p, int64_t s, int64_t b) {
  const DType t = p.act_dtype();
  sl_ = s;
  b_ = b;
  const int64_t sa = a2a_ * s, w = qpg_ + 2;
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  Saved& sv = saved_[a];
  sv.qkv = p.saved(t, {sa, b, groups_a_, w, d_}, "cp attention qkv");
  sv.lse = p.saved(DType::kF32, {sa, b, heads_a_}, "cp attention softmax lse");
  if (a2a_ > 1) {
    sv.out = p.saved(t, {sa, b, heads_a_, d_}, "cp attention output (a2a layout)");
    sv.doc = p.saved(DType::kI32, {b, sa}, "cp attention document starts");
    a2a_send_ = p.scratch("cp_attention.a2a_send", t, {s * b * a2a_ * groups_a_ * w * d_});
    a2a_recv_ = p.scratch("cp_attention.a2a_recv", t, {s * b * a2a_ * groups_a_ * w * d_});
    dqkv_a_ = p.scratch("cp_attention.dqkv", t, {sa, b, groups_a_, w, d_});
    dout_a_ = p.scratch("cp_attention.dout", t, {sa, b, heads_a_, d_});
    doc_gather_ = p.scratch("cp_attention.doc_gather", DType::kI32, {a2a_, b, s});
    doc_rows_ = p.scratch("cp_attention.doc_rows", DType::kI32, {b, sa});
  }
  const bool all = cp_.comm_type() == CpCommType::kAllGather;
  {
    ContextAttentionConfig c;
    c.batch = b;
    c.groups = groups_a_;
    c.queries_per_group = qpg_;
    c.head_dim = d_;
    c.cudnn = cudnn_;
    const size_t bytes = std::max(context_attention_workspace_bytes(c, sa, all ? cp_.seq_length() : sa),
                                  context_attention_forward_workspace_bytes(c, sa));
    workspace_ = p.scratch("cp_attention.workspace", DType::kU8, {static_cast<int64_t>(bytes)});
  }
  for (int k = 0; k < 2; ++k) {
    const int64_t rows = all && k == 1 ? cp_.seq_length() : sa;
    kv_[k] = p.scratch(fmt::format("cp_attention.kv{}", k), t, {rows, b, groups_a_, 2, d_});
    dkv_[k] = p.scratch(fmt::format("cp_attention.dkv{}", k), t, {rows, b, groups_a_, 2, d_});
  }
  if (!all && p2p_ > 1) {
    dkv_recv_ = p.scratch("cp_attention.dkv_recv", t, {sa, b, groups_a_, 2, d_});
    // The ring's receive buffers (kv_ alternate as send and receive buffers): registered for the
    // copy-engine exchange where asked for (collective over the ring on the region's first call).
    if (p.placing()) cp_.ring_register({kv_[0], kv_[1], dkv_recv_});
  }
}

ContextAttentionConfig ContextParallelAttention::op_config(const Tensor& q_pos, const Tensor& k_pos,
                                                           const Tensor& doc, ContextBlockMask block,
                                                           const StepContext& ctx) const {
  ContextAttentionConfig c;
  c.batch = b_;
  c.groups = groups_a_;
  c.queries_per_group = qpg_;
  c.head_dim = d_;
  c.softmax_scale = config_.softmax_scale();
  c.q_pos = q_pos;
  c.k_pos = k_pos;
  c.doc_start = doc;
  c.dropout_p = ctx.dropout.training ? config_.attention_dropout : 0.f;
  c.dropout_key = dropout_key(ctx.dropout, layer_, kSiteAttentionProbs);  // as DotProductAttention's
  c.seq_length = cp_.seq_length();
  c.head_offset = head_offset_;
  c.total_heads = config_.num_attention_heads;
  c.deterministic = config_.deterministic_mode;
  c.block = block;
  c.cudnn = cudnn_;
  return c;
}

// The queries of this rank (its a2a group's tokens, sorted: chunks o and 2P−1−o of C = A·s_l/2
// rows) against the keys of ring step `step` (cp_ring_step): the diagonal block causally, the
// first chunk of an earlier rank's block to every query, a later rank's whole block to the second
// local chunk. allgather: every key, rank-ordered, through the positions.
void ContextParallelAttention::block_forward(const CpRingStep& step, const Saved& sv, const Tensor& out,
                                             const Tensor& kv, const Tensor& doc, bool merge,
                                             const StepContext& ctx) const {
  const Stream& st = ctx.stream;
  if (cp_.comm_type() == CpCommType::kAllGather) {
    const ContextAttentionConfig c =
        op_config(cp_.positions(cp_.rank(), 1), cp_.positions(0, cp_.size()), doc, ContextBlockMask::kPositions, ctx);
    context_attention_forward(out, sv.lse, sv.qkv, kv, workspace_, c, merge, st);
    return;
  }
  const Tensor q_pos = cp_.ring_positions(outer_), k_pos = cp_.ring_positions(step.src);
  const int64_t c = sv.qkv.size(0) / 2;
  switch (step.kind) {
    case CpBlockKind::kDiagonal:
      context_attention_forward(out, sv.lse, sv.qkv, kv, workspace_,
                                op_config(q_pos, k_pos, doc, ContextBlockMask::kCausal, ctx), merge, st);
      break;
    case CpBlockKind::kEarlier:
      context_attention_forward(out, sv.lse, sv.qkv, kv.slice0(0, c), workspace_,
                                op_config(q_pos, k_pos.flat_range(0, c), doc, ContextBlockMask::kFull, ctx), merge,
                                st);
      break;
    case CpBlockKind::kLater:
      context_attention_forward(out.slice0(c, 2 * c), sv.lse.slice0(c, 2 * c), sv.qkv.slice0(c, 2 * c), kv,
                                workspace_,
                                op_config(q_pos.flat_range(c, c), k_pos, doc.empty() ? doc : doc.slice(1, c, 2 * c),
                                          ContextBlockMask::kFull, ctx),
                                merge, st);
      break;
  }
}

void ContextParallelAttention::block_backward(const CpRingStep& step, const Saved& sv, const Tensor& out,
                                              const Tensor& dout, const Tensor& dq, const Tensor& kv,
                                              const Tensor& dkv, const Tensor& doc, const StepContext& ctx) const {
  const Stream& st = ctx.stream;
  if (cp_.comm_type() == CpCommType::kAllGather) {
    const ContextAttentionConfig c =
        op_config(cp_.positions(cp_.rank(), 1), cp_.positions(0, cp_.size()), doc, ContextBlockMask::kPositions, ctx);
    context_attention_backward(dq, dkv, dout, out, sv.lse, sv.qkv, kv, workspace_, c, st);
    return;
  }
  const Tensor q_pos = cp_.ring_positions(outer_), k_pos = cp_.ring_positions(step.src);
  const int64_t c = sv.qkv.size(0) / 2;
  switch (step.kind) {
    case CpBlockKind::kDiagonal:
      context_attention_backward(dq, dkv, dout, out, sv.lse, sv.qkv, kv, workspace_,
                                 op_config(q_pos, k_pos, doc, ContextBlockMask::kCausal, ctx), st);
      break;
    case CpBlockKind::kEarlier:
      context_attention_backward(dq, dkv.slice0(0, c), dout, out, sv.lse, sv.qkv, kv.slice0(0, c), workspace_,
                                 op_config(q_pos, k_pos.flat_range(0, c), doc, ContextBlockMask::kFull, ctx), st);
      break;
    case CpBlockKind::kLater: {
      auto h = [&](const Tensor& t) { return t.slice0(c, 2 * c); };
      context_attention_backward(h(dq), dkv, h(dout), h(out), h(sv.lse), h(sv.qkv), kv, workspace_,
                                 op_config(q_pos.flat_range(c, c), k_pos, doc.empty() ? doc : doc.slice(1, c, 2 * c),
                                           ContextBlockMask::kFull, ctx),
                                 st);
      break;
    }
  }
}

void ContextParallelAttention::exchange(const Tensor& send, const Tensor& recv, const Tensor& dsend,
                                        const Tensor& drecv, const Stream& st) const {
  ContextParallelRegion::Ring& ring = cp_.ring();
  Communicator& group = cp_.p2p_group();
  const int n = group.size(), r = group.rank();
  const bool copy_engine = cp_.ring_uses_copy_engine(st);  // not while `st` is captured
  ring.ready.record(st);
  ring.ready.wait(ring.stream);
  CpRingTrace* trace = cp_.trace();
  const int span = trace ? trace->begin(CpRingTrace::Kind::kExchange, ring.stream) : -1;
  const std::pair<Tensor, Tensor> pairs[2] = {{send, recv}, {dsend, drecv}};
  if (copy_engine) {
    cp_.ring_copy_exchange(pairs);
  } else {
    group.group_start();
    for (const auto& [out, in] : pairs) {
      if (out.empty()) continue;
      group.send(out, (r + 1) % n, ring.stream);
      group.recv(in, (r + n - 1) % n, ring.stream);
    }
    group.group_end();
  }
  if (trace) trace->end(span, ring.stream);
  ring.done.record(ring.stream);
  if (cp_.ring_serialised()) ring.done.wait(st);  // the benchmarks' negative control: before the blocks
}

void ContextParallelAttention::exchange_wait(const Stream& st) const { cp_.ring().done.wait(st); }

void ContextParallelAttention::a2a_in(const Tensor& sorted, const Tensor& x, const Stream& st) const {
  // [s_l·b, A, X] -> [A, s_l·b, X]: part j (query groups j·g_a ..) goes to a2a rank j, which
  // receives [A (source rank), s_l, b, X] = 2A chunks in source order, then sorts them.
  Communicator& a2a = cp_.a2a_group();
  const Tensor send = a2a_send_.flat_range(0, x.numel()), recv = a2a_recv_.flat_range(0, x.numel());
  transpose_blocks(send, x, sl_ * b_, a2a_, st);
  a2a.all_to_all(recv, send, st);
  permute_blocks(sorted, recv, 1, sort_, false, st);
}

void ContextParallelAttention::a2a_out(const Tensor& x, const Tensor& sorted, const Stream& st) const {
  // The sorted rows back in source order ([A, s_l·b, X]: rows of a2a rank j go back to j), and
  // head part i, arriving from rank i, to [s_l·b, A, X].
  Communicator& a2a = cp_.a2a_group();
  const Tensor send = a2a_send_.flat_range(0, x.numel()), recv = a2a_recv_.flat_range(0, x.numel());
  permute_blocks(send, sorted, 1, sort_, true, st);
  a2a.all_to_all(recv, send, st);
  transpose_blocks(x, recv, a2a_, sl_ * b_, st);
}

void ContextParallelAttention::ring_forward(const Saved& sv, const Tensor& out, const Tensor& doc,
                                            const StepContext& ctx) {
  // Step i attends to block `cur` while the ring stream passes it on into `nxt` (step i + 1's).
  const Stream& st = ctx.stream;
  CpRingTrace* trace = cp_.trace();
  Tensor cur = kv_[0], nxt = kv_[1];
  kv_pack(cur, sv.qkv, qpg_, st);
  for (int i = 0; i < p2p_; ++i) {
    const bool pass = i + 1 < p2p_;
    if (pass) exchange(cur, nxt, Tensor(), Tensor(), st);
    const int span = trace ? trace->begin(CpRingTrace::Kind::kCompute, st) : -1;
    block_forward(cp_ring_step(p2p_, outer_, i), sv, out, cur, doc, i > 0, ctx);
    if (trace) trace->end(span, st);
    if (pass) exchange_wait(st);
    std::swap(cur, nxt);
  }
}

void ContextParallelAttention::ring_backward(const Saved& sv, const Tensor& out, const Tensor& dout,
                                             const Tensor& dq, const Tensor& doc, const StepContext& ctx) {
  // dK/dV of a block travel with it: step i computes this rank's part for block src into
  // dkv_[i % 2] while the ring stream brings the block's sum so far from the previous holder
  // (into dkv_recv_) and passes on the sum of step i − 1; the part plus the received sum is
  // then the block's sum, passed on during step i + 1. After the last step a final exchange
  // brings every block's gradient home.
  const Stream& st = ctx.stream;
  CpRingTrace* trace = cp_.trace();
  Tensor cur = kv_[0], nxt = kv_[1];
  kv_pack(cur, sv.qkv, qpg_, st);
  for (int i = 0; i < p2p_; ++i) {
    const Tensor& dpart = dkv_[i % 2];
    const bool pass_kv = i + 1 < p2p_, pass_dkv = i > 0;
    if (pass_kv || pass_dkv)
      exchange(pass_kv ? cur : Tensor(), pass_kv ? nxt : Tensor(), pass_dkv ? dkv_[(i + 1) % 2] : Tensor(),
               pass_dkv ? dkv_recv_ : Tensor(), st);
    fill(dpart, 0.f, st);
    const int span = trace ? trace->begin(CpRingTrace::Kind::kCompute, st) : -1;
    block_backward(cp_ring_step(p2p_, outer_, i), sv, out, dout, dq, cur, dpart, doc, ctx);
    if (trace) trace->end(span, st);
    if (pass_kv || pass_dkv) exchange_wait(st);
    if (pass_dkv) add(dpart, dpart, dkv_recv_, st);
    std::swap(cur, nxt);
  }
  const Tensor& dlast = dkv_[(p2p_ - 1) % 2];
  if (p2p_ > 1) {
    exchange(Tensor(), Tensor(), dlast, dkv_recv_, st);
    exchange_wait(st);
  }
  kv_unpack(dq, p2p_ > 1 ? dkv_recv_ : dlast, qpg_, st);
}

void ContextParallelAttention::forward(const Tensor& context, const Tensor& qkv, const StepContext& ctx) {
  const Saved& sv = saved_.at(static_cast<size_t>(ctx.slot));
  const Stream& st = ctx.stream;
  const Tensor& doc_local = ctx.batch.doc_start;  // [b, s_l] global document starts, or empty
  Tensor doc = doc_local, out = context.view({sl_, b_, heads_a_ * a2a_, d_});
  if (a2a_ == 1) {
    copy(sv.qkv, qkv, st);
  } else {
    a2a_in(sv.qkv, qkv, st);
    if (!doc_local.empty()) {
      cp_.a2a_group().all_gather(doc_gather_, doc_local, st);     // [A, b, s_l]
      transpose_blocks(doc_rows_, doc_gather_, a2a_, b_, st);     // [b, A·s_l] in source order
      permute_blocks(sv.doc, doc_rows_, b_, sort_, false, st);    // sorted along the sequence
      doc = sv.doc;
    }
    out = sv.out;
  }
  if (cp_.comm_type() == CpCommType::kAllGather) {
    kv_pack(kv_[0], sv.qkv, qpg_, st);
    cp_.group().all_gather(kv_[1], kv_[0], st);
    block_forward(CpRingStep{0, CpBlockKind::kDiagonal}, sv, out, kv_[1], doc, false, ctx);
  } else {
    ring_forward(sv, out, doc, ctx);
  }
  if (a2a_ > 1) a2a_out(context, sv.out, st);
}

void ContextParallelAttention::backward(const Tensor& dqkv, const Tensor& dcontext, const Tensor& context,
                                        const Tensor&, const StepContext& ctx) {
  const Saved& sv = saved_.at(static_cast<size_t>(ctx.slot));
  const Stream& st = ctx.stream;
  const int64_t n_local = heads_a_ * a2a_;
  Tensor doc = ctx.batch.doc_start, out = context.view({sl_, b_, n_local, d_}),
         dout = dcontext.view({sl_, b_, n_local, d_}), dq = dqkv;
  if (a2a_ > 1) {
    a2a_in(dout_a_, dcontext, st);
    out = sv.out;
    dout = dout_a_;
    dq = dqkv_a_;
    if (!doc.empty()) doc = sv.doc;
  }
  fill(dq, 0.f, st);
  if (cp_.comm_type() == CpCommType::kAllGather) {
    kv_pack(kv_[0], sv.qkv, qpg_, st);
    cp_.group().all_gather(kv_[1], kv_[0], st);
    fill(dkv_[1], 0.f, st);
    block_backward(CpRingStep{0, CpBlockKind::kDiagonal}, sv, out, dout, dq, kv_[1], dkv_[1], doc, ctx);
    cp_.group().reduce_scatter(dkv_[0], dkv_[1], ReduceOp::kSum, st);
    kv_unpack(dq, dkv_[0], qpg_, st);
  } else {
    ring_backward(sv, out, dout, dq, doc, ctx);
  }
  if (a2a_ > 1) a2a_out(dqkv, dqkv_a_, st);
}

}  // namespace mt
