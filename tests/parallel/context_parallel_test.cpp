// Context parallelism (parallel/context_parallel.h, model/layers/cp_attention.h): the load-balanced
// chunk assignment and the per-rank position ids against hand-worked examples; the flag checks
// (errors before any communication); and N ranks == 1 rank (ranks as threads, CPU, fp32): CP 2 and
// 4 x --cp-comm-type {p2p, allgather, a2a, a2a+p2p} x {GPT (MHA, learned positions), Llama style
// (GQA, RoPE)} x {causal, document masks with reset position ids}, and CP with TP + SP, PP (+VPP),
// DP (+ the distributed optimizer over dp-cp); MoE with CP (the router's token counts and N over the
// TP × CP group: aux_loss with the allgather and alltoall dispatchers, EP, TP + SP, DP; seq_aux_loss
// with the sigmoid router, expert bias and shared experts; global_aux_loss, with DP against one rank
// running the DP ranks' micro-batches as one; the z-loss), experts reduced over the
// expert-data-parallel group (CP folds into EP / EDP). Three training iterations each; the losses of every
// iteration, the gradients of the last one and the parameters after it equal the single-rank run
// (rel. 1e-5).
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <random>

#include "comm/thread_comm.h"
#include "model/gpt_model.h"
#include "ops/context_attention.h"
#include "ops/elementwise.h"
#include "ops/flash_attention.h"
#include "optim/grad_sync.h"
#include "parallel/context_parallel.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include "shard_gather.h"
#include "testing/testing.h"
#include "train/pipeline.h"
#include "train/train_step.h"
#include "train/training_setup.h"

namespace mt {
namespace {

using testing::OwnedTensor;
using testing::place;

// ---------------------------------------------------------------------------------------------
// Layout: hand-worked examples (docs/parallelism.md "Context parallelism").
// ---------------------------------------------------------------------------------------------

TEST(ContextParallelLayout, ChunkAssignmentHandWorked) {
  // s = 16, CP 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_EQ(cp_positions(16, 2, 0), (std::vector<int32_t>{0, 1, 2, 3, 12, 13, 14, 15}));
  EXPECT_EQ(cp_positions(16, 2, 1), (std::vector<int32_t>{4, 5, 6, 7, 8, 9, 10, 11}));
  // s = 16, CP 4: chunks of 2; rank r holds chunks r and 7 - r.
  EXPECT_EQ(cp_positions(16, 4, 0), (std::vector<int32_t>{0, 1, 14, 15}));
  EXPECT_EQ(cp_positions(16, 4, 1), (std::vector<int32_t>{2, 3, 12, 13}));
  EXPECT_EQ(cp_positions(16, 4, 2), (std::vector<int32_t>{4, 5, 10, 11}));
  EXPECT_EQ(cp_positions(16, 4, 3), (std::vector<int32_t>{6, 7, 8, 9}));
  EXPECT_EQ(cp_global_position(8, 1, 0, 5), 5);  // CP 1: the identity
  EXPECT_THROW(cp_global_position(12, 4, 0, 0), Error);  // 12 not divisible by 8
  EXPECT_THROW(cp_global_position(16, 2, 2, 0), Error);  // rank out of range
}

// The a2a levels' sorted layout: after the all-to-all a rank holds 2A chunks of c tokens in source
// order; sorting them gives the load-balanced layout of a P-rank ring with chunks of A·c.
TEST(ContextParallelLayout, A2aSortOrderHandWorked) {
  EXPECT_EQ(cp_a2a_sort_order(1), (std::vector<int>{0, 1}));
  EXPECT_EQ(cp_a2a_sort_order(2), (std::vector<int>{0, 2, 3, 1}));
  EXPECT_EQ(cp_a2a_sort_order(4), (std::vector<int>{0, 2, 4, 6, 7, 5, 3, 1}));
  EXPECT_THROW(cp_a2a_sort_order(0), Error);
  // s = 32, N = 8 (c = 2), A = 4, P = 2: group o holds CP ranks 4o .. 4o + 3; sorted, they are
  // the CP 2 layout of ring rank o (chunks of 8 tokens).
  const int64_t s = 32;
  const int n = 8, a = 4, p = 2;
  for (int o = 0; o < p; ++o) {
    std::vector<int32_t> received;  // source order
    for (int j = 0; j < a; ++j) {
      const auto pj = cp_positions(s, n, o * a + j);
      received.insert(received.end(), pj.begin(), pj.end());
    }
    std::vector<int32_t> sorted;
    for (int k : cp_a2a_sort_order(a))
      sorted.insert(sorted.end(), received.begin() + 2 * k, received.begin() + 2 * k + 2);
    EXPECT_EQ(sorted, cp_positions(s, p, o)) << "ring rank " << o;
  }
  // Pure a2a (P = 1): the whole sequence in order.
  std::vector<int32_t> received, sorted;
  for (int j = 0; j < 4; ++j) {
    const auto pj = cp_positions(16, 4, j);
    received.insert(received.end(), pj.begin(), pj.end());
  }
  for (int k : cp_a2a_sort_order(4)) sorted.insert(sorted.end(), received.begin() + 2 * k, received.begin() + 2 * k + 2);
  EXPECT_EQ(sorted, cp_positions(16, 1, 0));
}

// The ring's schedule: which block each step attends to and which part of it (causal skipping).
TEST(ContextParallelLayout, RingStepsHandWorked) {
  using K = CpBlockKind;
  auto steps = [](int p, int r) {
    std::vector<std::pair<int, K>> v;
    for (int i = 0; i < p; ++i) {
      const CpRingStep st = cp_ring_step(p, r, i);
      v.emplace_back(st.src, st.kind);
    }
    return v;
  };
  // CP 2: rank 0 sees its own block, then rank 1's (later: its second chunk sees all of it);
  // rank 1 its own, then rank 0's (earlier: the first chunk of it, to both local chunks).
  EXPECT_EQ(steps(2, 0), (std::vector<std::pair<int, K>>{{0, K::kDiagonal}, {1, K::kLater}}));
  EXPECT_EQ(steps(2, 1), (std::vector<std::pair<int, K>>{{1, K::kDiagonal}, {0, K::kEarlier}}));
  // CP 4, rank 2: blocks 2, 1, 0, 3.
  EXPECT_EQ(steps(4, 2),
            (std::vector<std::pair<int, K>>{{2, K::kDiagonal}, {1, K::kEarlier}, {0, K::kEarlier}, {3, K::kLater}}));
  EXPECT_EQ(steps(1, 0), (std::vector<std::pair<int, K>>{{0, K::kDiagonal}}));
  // The kinds are the causal mask: with s = 16, CP 4 (chunks of 2), rank 2 holds 4, 5, 10, 11;
  // block 1 (2, 3, 12, 13) is visible through its first chunk to both local chunks, block 3
  // (6, 7, 8, 9) in full to the second local chunk only.
  const auto q = cp_positions(16, 4, 2);
  for (int src : {1, 3}) {
    const auto k = cp_positions(16, 4, src);
    const K kind = cp_ring_step(4, 2, (2 - src + 4) % 4).kind;
    for (size_t i = 0; i < q.size(); ++i)
      for (size_t j = 0; j < k.size(); ++j) {
        const bool part = kind == K::kEarlier ? j < 2 : i >= 2;  // the block's part the step computes
        EXPECT_EQ(k[j] <= q[i], part) << "src " << src << " q " << q[i] << " k " << k[j];
      }
  }
  EXPECT_THROW(cp_ring_step(4, 4, 0), Error);
  EXPECT_THROW(cp_ring_step(4, 0, 4), Error);
  EXPECT_THROW(cp_ring_step(0, 0, 0), Error);
}

// The overlap measure of the ring trace (bench/cp_ring_bench.cpp asserts on it): exchange time
// outside every compute span is exposed.
TEST(ContextParallelLayout, OverlapOfTraceSpans) {
  using K = CpRingTrace::Kind;
  // Compute [0, 4] and [5, 9]; exchanges [1, 3] (hidden), [3.5, 6] (1.5 exposed of 2.5), [9, 10].
  const CpOverlap o = cp_overlap({{K::kCompute, 0, 4}, {K::kExchange, 1, 3}, {K::kCompute, 5, 9},
                                  {K::kExchange, 3.5f, 6}, {K::kExchange, 9, 10}});
  EXPECT_DOUBLE_EQ(o.compute_ms, 8);
  EXPECT_DOUBLE_EQ(o.exchange_ms, 5.5);
  EXPECT_DOUBLE_EQ(o.exposed_ms, 2);
  // Overlapping compute spans count once; an exchange that outlasts its compute is exposed by
  // the difference (a ring serialised behind the compute: its transfer after the compute's end).
  const CpOverlap p = cp_overlap({{K::kCompute, 0, 4}, {K::kCompute, 2, 6}, {K::kExchange, 1, 7}});
  EXPECT_DOUBLE_EQ(p.exposed_ms, 1);
  EXPECT_DOUBLE_EQ(cp_overlap({{K::kCompute, 0, 1}}).exposed_ms, 0.0);
  EXPECT_THROW(cp_overlap({{K::kExchange, 2, 1}}), Error);
}

TEST(ContextParallelLayout, ShardsTokensPositionsAndDocumentStarts) {
  // [s = 8, b = 2] tokens t = 10·i + b; CP 2 rank 1 holds positions 2, 3, 4, 5.
  std::vector<int32_t> full(16), local(8);
  for (int i = 0; i < 8; ++i)
    for (int b = 0; b < 2; ++b) full[i * 2 + b] = 10 * i + b;
  cp_shard_rows(local.data(), full.data(), 8, 2, 2, 1);
  EXPECT_EQ(local, (std::vector<int32_t>{20, 21, 30, 31, 40, 41, 50, 51}));
  // Position ids reset at a document starting at 3 (--reset-position-ids): 0 1 2 0 1 2 3 4.
  const std::vector<int32_t> pos = {0, 1, 2, 0, 1, 2, 3, 4};
  std::vector<int32_t> pos_local(4);
  cp_shard_rows(pos_local.data(), pos.data(), 8, 1, 2, 0);  // rank 0: positions 0, 1, 6, 7
  EXPECT_EQ(pos_local, (std::vector<int32_t>{0, 1, 3, 4}));
  // doc_start [b = 1, s = 8] = 0 0 0 3 3 3 3 3 (global positions), rank 0 keeps columns 0, 1, 6, 7.
  const std::vector<int32_t> doc = {0, 0, 0, 3, 3, 3, 3, 3};
  std::vector<int32_t> doc_local(4);
  cp_shard_columns(doc_local.data(), doc.data(), 1, 8, 2, 0);
  EXPECT_EQ(doc_local, (std::vector<int32_t>{0, 0, 3, 3}));
}

TEST(ContextParallelLayout, BadInputClearErrors) {
  ContextParallelOptions o;
  o.size = 4;
  auto msg = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // Sequence length not divisible by 2·CP.
  EXPECT_NE(msg([&] { validate_context_parallel(o, 12, 8, 8, 1); }).find("--seq-length 12"), std::string::npos);
  validate_context_parallel(o, 16, 8, 8, 1);  // fine
  // a2a with heads (per TP rank) not divisible by CP.
  o.comm_type = CpCommType::kA2A;
  EXPECT_NE(msg([&] { validate_context_parallel(o, 16, 6, 6, 1); }).find("--num-attention-heads 6"), std::string::npos);
  EXPECT_THROW(validate_context_parallel(o, 16, 8, 8, 4), Error);  // 2 heads per TP rank, CP 4
  EXPECT_THROW(validate_context_parallel(o, 16, 8, 2, 1), Error);  // 2 query groups, CP 4
  validate_context_parallel(o, 16, 8, 4, 1);
  // Hierarchical sizes that do not multiply to CP, missing, or without a2a+p2p.
  o.comm_type = CpCommType::kA2AP2P;
  o.hierarchical_sizes = {2, 3};
  EXPECT_NE(msg([&] { validate_context_parallel(o, 16, 8, 8, 1); }).find("2 x 3 = 6"), std::string::npos);
  o.hierarchical_sizes = {};
  EXPECT_THROW(validate_context_parallel(o, 16, 8, 8, 1), Error);
  o.hierarchical_sizes = {2, 2};
  validate_context_parallel(o, 16, 8, 8, 1);
  EXPECT_THROW(validate_context_parallel(o, 16, 8, 2, 2), Error);  // 1 group per TP rank, a2a level 2
  o.comm_type = CpCommType::kP2P;
  EXPECT_THROW(validate_context_parallel(o, 16, 8, 8, 1), Error);
  EXPECT_THROW(parse_cp_comm_type("ring"), Error);
  EXPECT_EQ(parse_cp_comm_type("a2a+p2p"), CpCommType::kA2AP2P);
  EXPECT_EQ(parse_cp_comm_type("allgather"), CpCommType::kAllGather);
}

TEST(ContextParallelLayout, ModelRejectsBadConfigBeforeCommunication) {
  // Every rank throws in the GPTModel constructor (validation precedes the group split).
  // (Dropout is accepted under CP: the DropoutUnderCp layouts below.)
  for (const auto& [seq, type] : {std::tuple{10, "p2p"}, std::tuple{16, "ring"}}) {
    int errors = 0;
    std::mutex mu;
    run_thread_ranks(2, [&](int, std::shared_ptr<Communicator> world) {
      ParallelConfig pc;
      pc.cp = 2;
      validate_and_derive(pc, 2);
      const ProcessGroups g = build_process_groups(world, pc);
      TransformerConfig c;
      c.num_layers = 1;
      c.hidden_size = 16;
      c.num_attention_heads = 4;
      c.seq_length = seq;
      c.vocab_size = 32;
      c.hidden_dropout = c.attention_dropout = 0.f;
      c.cp_comm_type = type;
      try {
        GPTModel m(c, 1, DType::kF32, Device::cpu(), g);
      } catch (const Error&) {
        std::lock_guard<std::mutex> lock(mu);
        ++errors;
      }
    });
    EXPECT_EQ(errors, 2) << seq << " " << type;
  }
}

// ---------------------------------------------------------------------------------------------
// The blockwise op: merging two key blocks by their LSE equals one call over all keys.
// ---------------------------------------------------------------------------------------------

TEST(ContextAttentionOp, MergedBlocksEqualOneCall) {
  const int64_t sq = 5, sk = 7, b = 2, g = 2, qpg = 2, d = 4, n = g * qpg;
  const Stream& st = testing::cpu_stream();
  OwnedTensor qkv = testing::make_tensor(testing::randn(sq * b * g * (qpg + 2) * d), DType::kF32, Device::cpu(),
                                         {sq, b, g, qpg + 2, d}, st);
  OwnedTensor kv = testing::make_tensor(testing::randn(sk * b * g * 2 * d), DType::kF32, Device::cpu(),
                                        {sk, b, g, 2, d}, st);
  OwnedTensor qp = testing::make_int_tensor({3, 4, 8, 9, 10}, Device::cpu(), {sq}, st);
  OwnedTensor kp = testing::make_int_tensor({0, 1, 2, 3, 4, 9, 10}, Device::cpu(), {sk}, st);
  OwnedTensor doc = testing::make_int_tensor({0, 0, 0, 9, 9, 1, 4, 4, 4, 4}, Device::cpu(), {b, sq}, st);
  ContextAttentionConfig c;
  c.batch = b;
  c.groups = g;
  c.queries_per_group = qpg;
  c.head_dim = d;
  c.softmax_scale = 0.5f;
  c.q_pos = qp.t;
  c.k_pos = kp.t;
  c.doc_start = doc.t;
  OwnedTensor out(DType::kF32, Device::cpu(), {sq, b, n, d}), lse(DType::kF32, Device::cpu(), {sq, b, n});
  OwnedTensor out2(DType::kF32, Device::cpu(), {sq, b, n, d}), lse2(DType::kF32, Device::cpu(), {sq, b, n});
  testing::poison(out.t, st);
  testing::poison(out2.t, st);
  context_attention_forward(out.t, lse.t, qkv.t, kv.t, Tensor(), c, false, st);
  // Keys [0, 3) then [3, 7).
  ContextAttentionConfig c1 = c, c2 = c;
  c1.k_pos = kp.t.flat_range(0, 3);
  c2.k_pos = kp.t.flat_range(3, 4);
  context_attention_forward(out2.t, lse2.t, qkv.t, kv.t.slice0(0, 3), Tensor(), c1, false, st);
  context_attention_forward(out2.t, lse2.t, qkv.t, kv.t.slice0(3, 7), Tensor(), c2, true, st);
  EXPECT_LT(testing::rel_err(testing::to_host(out2.t, st), testing::to_host(out.t, st)), 1e-6);
  EXPECT_LT(testing::rel_err(testing::to_host(lse2.t, st), testing::to_host(lse.t, st)), 1e-6);
  // A float64 reference of one query row: sample 1, query 2 (position 8, doc start 4), head 3.
  const auto hq = testing::to_host(qkv.t, st), hkv = testing::to_host(kv.t, st), ho = testing::to_host(out.t, st);
  const int64_t i = 2, bi = 1, h = 3, grp = h / qpg, qi = h % qpg;
  const std::vector<int> kpos = {0, 1, 2, 3, 4, 9, 10};
  std::vector<double> w(sk, 0.0);
  double mx = -1e30, sum = 0;
  for (int64_t j = 0; j < sk; ++j) {
    if (kpos[j] > 8 || kpos[j] < 4) continue;
    double s = 0;
    for (int64_t e = 0; e < d; ++e)
      s += hq[(((i * b + bi) * g + grp) * (qpg + 2) + qi) * d + e] * hkv[(((j * b + bi) * g + grp) * 2) * d + e];
    w[j] = 0.5 * s;
    mx = std::max(mx, w[j]);
  }
  for (int64_t j = 0; j < sk; ++j) w[j] = (kpos[j] > 8 || kpos[j] < 4) ? 0 : std::exp(w[j] - mx), sum += w[j];
  for (int64_t e = 0; e < d; ++e) {
    double o = 0;
    for (int64_t j = 0; j < sk; ++j) o += w[j] / sum * hkv[(((j * b + bi) * g + grp) * 2 + 1) * d + e];
    EXPECT_NEAR(ho[((i * b + bi) * n + h) * d + e], o, 1e-5);
  }
}

// Attention dropout: every query shard of CP 2 against every key block (merged by LSE) equals the
// one-rank attention with the same dropout (ops/flash_attention.h, CPU) on those rows, forward
// (out, lse) and backward (dQ of the shard's rows, dK/dV summed over the query shards), with
// documents and a head offset (a TP rank's heads of a larger model: the mask keys global heads).
TEST(ContextAttentionOp, DropoutBlocksEqualFullAttention) {
  const int64_t S = 16, b = 2, g = 2, qpg = 2, d = 8, n = g * qpg, w = qpg + 2, N = 2, sl = S / N;
  const Stream& st = testing::cpu_stream();
  const Device cpu = Device::cpu();
  const float scale = 1.f / std::sqrt(static_cast<float>(d)), p = 0.3f;
  const DropoutKey key{testing::test_seed(), 11, 3, 17};
  const auto hq = testing::randn(S * b * g * w * d), hdo = testing::randn(S * b * n * d);
  std::vector<int32_t> doc(b * S);
  for (int64_t i = 0; i < S; ++i) {
    doc[i] = 0;
    doc[S + i] = i < 5 ? 0 : i < 11 ? 5 : 11;
  }
  OwnedTensor qkv = testing::make_tensor(hq, DType::kF32, cpu, {S, b, g, w, d}, st);
  OwnedTensor dout = testing::make_tensor(hdo, DType::kF32, cpu, {S, b, n, d}, st);
  OwnedTensor docs = testing::make_int_tensor(doc, cpu, {b, S}, st);
  OwnedTensor out(DType::kF32, cpu, {S, b, n, d}), lse(DType::kF32, cpu, {b, n, S}),
      dqkv(DType::kF32, cpu, {S, b, g, w, d});
  FlashAttentionConfig fc;
  fc.seq = S;
  fc.batch = b;
  fc.groups = g;
  fc.queries_per_group = qpg;
  fc.head_dim = d;
  fc.softmax_scale = scale;
  fc.dropout_p = p;
  fc.dropout_key = key;
  fc.head_offset = n;  // TP rank 1 of 2
  fc.total_heads = 2 * n;
  fc.doc_start = docs.t;
  OwnedTensor ws(DType::kU8, cpu, {static_cast<int64_t>(flash_attention_workspace_bytes(fc)) + 16});
  flash_attention_forward(out, lse, qkv, fc, st);
  flash_attention_backward(dqkv, dout, out, lse, qkv, ws, fc, st);
  const auto fo = testing::to_host(out, st), fl = testing::to_host(lse, st), fdq = testing::to_host(dqkv, st);
  {  // the mask does something: without dropout the output differs
    FlashAttentionConfig f0 = fc;
    f0.dropout_p = 0.f;
    OwnedTensor o0(DType::kF32, cpu, {S, b, n, d});
    flash_attention_forward(o0, lse, qkv, f0, st);
    ASSERT_GT(testing::rel_err(testing::to_host(o0, st), fo), 0.05);
    flash_attention_forward(out, lse, qkv, fc, st);
  }
  // Per CP rank: its rows of qkv / dout / doc, its K/V block.
  std::vector<OwnedTensor> q_r, do_r, kv_r, dkv_r, pos_r, doc_r;
  for (int r = 0; r < N; ++r) {
    const std::vector<int32_t> pos = cp_positions(S, N, r);
    std::vector<float> lq(sl * b * g * w * d), ldo(sl * b * n * d);
    cp_shard_rows(lq.data(), hq.data(), S, b * g * w * d, N, r);
    cp_shard_rows(ldo.data(), hdo.data(), S, b * n * d, N, r);
    std::vector<int32_t> ld(b * sl);
    cp_shard_columns(ld.data(), doc.data(), b, S, N, r);
    q_r.push_back(testing::make_tensor(lq, DType::kF32, cpu, {sl, b, g, w, d}, st));
    do_r.push_back(testing::make_tensor(ldo, DType::kF32, cpu, {sl, b, n, d}, st));
    kv_r.emplace_back(DType::kF32, cpu, std::vector<int64_t>{sl, b, g, 2, d});
    kv_pack(kv_r.back(), q_r.back(), qpg, st);
    dkv_r.emplace_back(DType::kF32, cpu, std::vector<int64_t>{sl, b, g, 2, d});
    fill(dkv_r.back(), 0.f, st);
    pos_r.push_back(testing::make_int_tensor(pos, cpu, {sl}, st));
    doc_r.push_back(testing::make_int_tensor(ld, cpu, {b, sl}, st));
  }
  for (int r = 0; r < N; ++r) {
    ContextAttentionConfig c;
    c.batch = b;
    c.groups = g;
    c.queries_per_group = qpg;
    c.head_dim = d;
    c.softmax_scale = scale;
    c.q_pos = pos_r[r].t;
    c.doc_start = doc_r[r].t;
    c.dropout_p = p;
    c.dropout_key = key;
    c.seq_length = S;
    c.head_offset = n;
    c.total_heads = 2 * n;
    OwnedTensor o(DType::kF32, cpu, {sl, b, n, d}), l(DType::kF32, cpu, {sl, b, n}),
        dq(DType::kF32, cpu, {sl, b, g, w, d});
    testing::poison(o, st);
    testing::poison(l, st);
    fill(dq, 0.f, st);
    for (int k = 0; k < N; ++k) {  // this rank's block first, as the ring
      const int src = (r - k + N) % N;
      c.k_pos = pos_r[src].t;
      context_attention_forward(o, l, q_r[r], kv_r[src], Tensor(), c, k > 0, st);
    }
    for (int src = 0; src < N; ++src) {
      c.k_pos = pos_r[src].t;
      context_attention_backward(dq, dkv_r[src], do_r[r], o, l, q_r[r], kv_r[src], Tensor(), c, st);
    }
    const auto ho = testing::to_host(o, st), hl = testing::to_host(l, st), hdq = testing::to_host(dq, st);
    const std::vector<int32_t> pos = cp_positions(S, N, r);
    std::vector<float> eo, el, edq, go, gl, gdq;
    for (int64_t t = 0; t < sl; ++t)
      for (int64_t bi = 0; bi < b; ++bi)
        for (int64_t h = 0; h < n; ++h) {
          for (int64_t e = 0; e < d; ++e) {
            eo.push_back(fo[((pos[t] * b + bi) * n + h) * d + e]);
            go.push_back(ho[((t * b + bi) * n + h) * d + e]);
            const int64_t grp = h / qpg, qi = h % qpg;
            edq.push_back(fdq[(((pos[t] * b + bi) * g + grp) * w + qi) * d + e]);
            gdq.push_back(hdq[(((t * b + bi) * g + grp) * w + qi) * d + e]);
          }
          el.push_back(fl[(bi * n + h) * S + pos[t]]);
          gl.push_back(hl[(t * b + bi) * n + h]);
        }
    EXPECT_LT(testing::rel_err(go, eo), 1e-5) << "out, rank " << r;
    EXPECT_LT(testing::rel_err(gl, el), 1e-5) << "lse, rank " << r;
    EXPECT_LT(testing::rel_err(gdq, edq), 1e-5) << "dq, rank " << r;
  }
  for (int r = 0; r < N; ++r) {  // dK/dV of block r, summed over both query shards
    const auto hk = testing::to_host(dkv_r[r], st);
    const std::vector<int32_t> pos = cp_positions(S, N, r);
    std::vector<float> e_kv, g_kv;
    for (int64_t t = 0; t < sl; ++t)
      for (int64_t x = 0; x < b * g * 2 * d; ++x) {
        const int64_t grp_row = x / (2 * d), kvi = (x / d) % 2, e = x % d;  // grp_row = bi·g + grp
        g_kv.push_back(hk[t * b * g * 2 * d + x]);
        e_kv.push_back(fdq[((pos[t] * b * g + grp_row) * w + qpg + kvi) * d + e]);
      }
    EXPECT_LT(testing::rel_err(g_kv, e_kv), 1e-5) << "dkv, block " << r;
  }
}

// Hidden dropout under CP (DropoutKey::cp_global): a CP rank's [s/N, b, h] rows, or a TP shard of
// them (global_offset; one straddling the chunk boundary), draw the masks of the full [s, b, h]
// tensor: bias_dropout_add forward and backward (dx; dbias summed over the ranks) and dropout_forward.
TEST(ContextParallelDropout, ElementwiseMasksKeyGlobalRows) {
  const int64_t S = 16, b = 2, h = 6;  // h = 6: rows not aligned to the Philox groups of 4
  const Stream& st = testing::cpu_stream();
  const Device cpu = Device::cpu();
  const float p = 0.25f;
  DropoutKey key{testing::test_seed(), 3, 1, 2 * 8 + 1};
  const auto hx = testing::randn(S * b * h), hr = testing::randn(S * b * h), hb = testing::randn(h);
  OwnedTensor bias = testing::make_tensor(hb, DType::kF32, cpu, {h}, st);
  auto run = [&](const std::vector<float>& x, const std::vector<float>& r, int64_t rows, int64_t off,
                 const DropoutKey& k, std::vector<float>& dbias) {
    OwnedTensor tx = testing::make_tensor(x, DType::kF32, cpu, {rows, h}, st);
    OwnedTensor tr = testing::make_tensor(r, DType::kF32, cpu, {rows, h}, st);
    OwnedTensor out(DType::kF32, cpu, {rows, h}), dx(DType::kF32, cpu, {rows, h}), y(DType::kF32, cpu, {rows, h});
    OwnedTensor db = testing::make_tensor(dbias, DType::kF32, cpu, {h}, st);
    testing::poison(out, st);
    bias_dropout_add_forward(out, tx, bias, tr, p, k, off, st);
    bias_dropout_add_backward(dx, db, tr, p, k, off, st);
    dropout_forward(y, tx, p, k, off, st);
    dbias = testing::to_host(db, st);
    return std::tuple{testing::to_host(out, st), testing::to_host(dx, st), testing::to_host(y, st)};
  };
  std::vector<float> db_full(h, 0.f);
  const auto [fo, fdx, fy] = run(hx, hr, S * b, 0, key, db_full);
  for (int N : {2, 4}) {
    const int64_t sl = S / N, row = b * h;
    std::vector<float> db_sum(h, 0.f);
    for (int r = 0; r < N; ++r) {
      const std::vector<int32_t> pos = cp_positions(S, N, r);
      std::vector<float> lx(sl * row), lr(sl * row);
      cp_shard_rows(lx.data(), hx.data(), S, row, N, r);
      cp_shard_rows(lr.data(), hr.data(), S, row, N, r);
      DropoutKey k = key;
      k.cp_size = N;
      k.cp_rank = r;
      k.cp_chunk_elems = sl / 2 * row;
      // The whole local tensor, and local rows [1, sl - 1) at offset 1 (straddling the chunks).
      for (const auto [first, count] : {std::pair<int64_t, int64_t>{0, sl}, std::pair<int64_t, int64_t>{1, sl - 2}}) {
        std::vector<float> db(h, 0.f);
        const std::vector<float> sx(lx.begin() + first * row, lx.begin() + (first + count) * row),
            sr(lr.begin() + first * row, lr.begin() + (first + count) * row);
        const auto [o, dx, y] = run(sx, sr, count * b, first * row, k, db);
        if (first == 0)
          for (int64_t e = 0; e < h; ++e) db_sum[e] += db[e];
        std::vector<float> eo, edx, ey;
        for (int64_t t = first; t < first + count; ++t)
          for (int64_t e = 0; e < row; ++e) {
            eo.push_back(fo[pos[t] * row + e]);
            edx.push_back(fdx[pos[t] * row + e]);
            ey.push_back(fy[pos[t] * row + e]);
          }
        EXPECT_EQ(o, eo) << "N=" << N << " r=" << r << " first=" << first;
        EXPECT_EQ(dx, edx) << "N=" << N << " r=" << r << " first=" << first;
        EXPECT_EQ(y, ey) << "N=" << N << " r=" << r << " first=" << first;
      }
    }
    EXPECT_LT(testing::rel_err(db_sum, db_full), 1e-5) << "dbias N=" << N;
  }
  // A row split by the chunk boundary is an error (the bias rows must stay whole).
  DropoutKey bad = key;
  bad.cp_size = 2;
  bad.cp_rank = 0;
  bad.cp_chunk_elems = 9;  // not a multiple of h
  std::vector<float> db(h, 0.f);
  const std::vector<float> x2(hx.begin(), hx.begin() + 2 * h), r2(hr.begin(), hr.begin() + 2 * h);
  EXPECT_THROW(run(x2, r2, 2, 0, bad, db), Error);
}

// ---------------------------------------------------------------------------------------------
// N ranks == 1 rank.
// ---------------------------------------------------------------------------------------------

constexpr int kIters = 3;
constexpr int64_t kSeq = 16;

// kMoe: the Llama style with MoE in layers 1 and 3 (4 experts, top-2, aux_loss and z-loss);
// kMoeSigmoid: MoE in every layer, DeepSeek-style router (sigmoid, groups), seq_aux_loss, expert bias
// and a shared expert; kMoeGlobal: kMoe with global_aux_loss; kMoeForced: kMoe with
// --moe-router-force-load-balancing (random logits keyed by the token's row in the [s, b] layout).
// kMla: the Llama style with multi-latent attention (query latent, YaRN, value heads padded; the
// CP ranks rotate their chunks' positions, k_pe travels with the packed keys).
enum class Arch { kGpt, kLlama, kMoe, kMoeSigmoid, kMoeGlobal, kMoeForced, kMla };

bool is_moe(Arch a) {
  return a == Arch::kMoe || a == Arch::kMoeSigmoid || a == Arch::kMoeGlobal || a == Arch::kMoeForced;
}

TransformerConfig config(Arch arch) {
  TransformerConfig c;
  c.num_layers = 4;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.seq_length = kSeq;
  c.vocab_size = 61;
  c.make_vocab_size_divisible_by = 8;
  c.hidden_dropout = 0.f;
  c.attention_dropout = 0.f;
  c.init_method_std = 0.1f;
  if (arch != Arch::kGpt) {
    c.hidden_size = 32;
    c.num_attention_heads = 8;
    c.num_query_groups = 4;
    c.ffn_hidden_size = 48;
    c.gated_linear_unit = true;
    c.normalization = Normalization::kRMSNorm;
    c.position_embedding_type = PositionEmbeddingType::kRope;
    c.rotary_percent = 0.5f;
    c.untie_embeddings_and_output_weights = true;
    c.add_bias_linear = false;
  }
  if (arch == Arch::kMla) {
    c.num_attention_heads = 4;
    c.num_query_groups = 0;
    c.rotary_percent = 1.f;
    c.multi_latent_attention = true;
    c.q_lora_rank = 12;
    c.kv_lora_rank = 8;
    c.qk_head_dim = 6;
    c.qk_pos_emb_head_dim = 4;
    c.v_head_dim = 5;
    c.rotary_scaling_factor = 4.f;
    c.original_max_position_embeddings = 8;  // < kSeq
    c.mscale_all_dim = 0.5f;
  }
  if (is_moe(arch)) {
    c.num_moe_experts = 4;
    c.moe_ffn_hidden_size = 24;
    c.moe_router_topk = 2;
    c.moe_aux_loss_coeff = {0.1f};
    c.moe_z_loss_coeff = 0.01f;
    if (arch == Arch::kMoeSigmoid) {
      c.moe_router_load_balancing_type = {MoeLoadBalancing::kSeqAuxLoss};
      c.moe_router_enable_expert_bias = true;
      c.moe_router_bias_update_rate = 0.05f;
      c.moe_router_score_function = MoeScoreFunction::kSigmoid;
      c.moe_router_num_groups = 2;
      c.moe_router_group_topk = 1;
      c.moe_router_topk_scaling_factor = 2.f;
      c.moe_shared_expert_intermediate_size = 16;
    } else {
      c.moe_layer_pattern = parse_moe_layer_freq("[0,1]*2", c.num_layers);
      if (arch == Arch::kMoeGlobal) c.moe_router_load_balancing_type = {MoeLoadBalancing::kGlobalAuxLoss};
      c.moe_router_force_load_balancing = arch == Arch::kMoeForced;
    }
  }
  return c;
}

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::kGpt: return "gpt_";
    case Arch::kLlama: return "llama_";
    case Arch::kMoe: return "moe_";
    case Arch::kMoeSigmoid: return "moe_sigmoid_";
    case Arch::kMoeGlobal: return "moe_global_";
    case Arch::kMoeForced: return "moe_forced_";
    case Arch::kMla: return "mla_";
  }
  return "";
}

struct Layout {
  Arch arch = Arch::kGpt;
  int cp = 1;
  std::string type = "p2p";
  std::vector<int> hier;
  bool docs = false;  // --reset-attention-mask + --reset-position-ids
  int tp = 1, pp = 1, dp = 1, vpp = 0;
  bool sp = false, zero = false;
  int ep = 1;             // MoE: expert model parallel size (expert TP = TP)
  bool alltoall = false;  // MoE: --moe-token-dispatcher-type alltoall (the reference is allgather)
  // Reference only: each micro-batch is the union (along b) of `merge` consecutive sample groups,
  // i.e. of the DP ranks' micro-batches of one step (global_aux_loss: the global micro-batch).
  int merge = 1;
  float dropout = 0.f;  // --attention-dropout and --hidden-dropout
  std::string name() const {
    std::string t = type == "a2a+p2p" ? fmt::format("a2a{}p2p{}", hier[0], hier[1]) : type;
    std::string s = fmt::format("{}cp{}_{}{}_tp{}_pp{}_dp{}", arch_name(arch), cp, t, docs ? "_docs" : "", tp, pp, dp);
    if (ep > 1) s += fmt::format("_ep{}", ep);
    if (alltoall) s += "_alltoall";
    if (vpp > 0) s += fmt::format("_vpp{}", vpp);
    if (sp) s += "_sp";
    if (zero) s += "_distopt";
    if (dropout > 0.f) s += "_dropout";
    return s;
  }
};

struct Data {
  int64_t mb = 2;
  int micro_total = 0;
  std::vector<int32_t> tokens, labels, positions;  // per global micro-batch: [S, mb]
  std::vector<int32_t> doc;                         // per global micro-batch: [mb, S]
};

struct Result {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> grads, params;
};

Result run_layout(const Layout& L, const Data& D) {
  TransformerConfig c = config(L.arch);
  c.attention_dropout = c.hidden_dropout = L.dropout;
  c.cp_comm_type = L.type;
  c.hierarchical_context_parallel_sizes = L.hier;
  if (L.alltoall) c.moe_token_dispatcher_type = MoeDispatcher::kAllToAll;
  const int64_t S = kSeq, mb = D.mb, sl = S / L.cp;
  const int world_size = L.tp * L.cp * L.pp * L.dp;
  const int M = D.micro_total / (L.dp * L.merge);
  const int64_t B = mb * L.merge;  // the micro-batch size
  Result out;
  out.losses.assign(kIters, 0.0);
  std::mutex mu;
  run_thread_ranks(world_size, [&](int, std::shared_ptr<Communicator> world) {
    ModelSetupOptions o;
    o.model = c;
    o.parallel.tp = L.tp;
    o.parallel.cp = L.cp;
    o.parallel.pp = L.pp;
    o.parallel.vpp = L.vpp;
    o.parallel.ep = L.ep;
    o.num_microbatches = M;
    o.micro_batch_size = B;
    o.sequence_parallel = L.sp;
    // Gradients reduced over dp-cp (Megatron), the distributed optimizer sharded over dp-cp; the
    // experts' over the expert-data-parallel group (world / (etp·ep·pp): CP folds into EP / EDP).
    o.ddp = DdpConfig{false, false, L.zero};
    o.optim.weight_decay = 0.1f;
    o.optim.clip_grad = 0.05f;
    o.optim.eps = 1e-3f;
    Stream st(Device::cpu());
    ModelSetup setup(world, o, st);
    const ProcessGroups& g = setup.groups();
    const PipelinePlan& plan = setup.train_plan();
    GPTModel& model = setup.model();
    PipelineExecutor& executor = setup.executor();
    GradSync& sync = setup.grad_sync();
    AdamWOptimizer& opt = setup.optimizer();
    EXPECT_EQ(model.local_seq_length(), sl);
    EXPECT_EQ(g.edp->size(), L.cp * L.dp * L.tp / (L.tp * L.ep));
    EXPECT_EQ(model.params().layout().data_parallel_size, g.dp_cp->size());
    model.params().initialize(1234, st);
    const int d = g.dp->rank(), cpr = g.cp->rank();
    std::vector<OwnedTensor> own;
    std::vector<MicroBatch> mbs;
    for (int m = 0; m < M; ++m) {
      const int64_t gm = static_cast<int64_t>(m) * L.dp + d;
      std::vector<int32_t> t(sl * B), l(sl * B), p(sl * B), ds(B * sl);
      std::vector<int32_t> tq(sl * mb), lq(sl * mb), pq(sl * mb);
      for (int64_t q = 0; q < L.merge; ++q) {  // sample group gm·merge + q at columns [q·mb, (q + 1)·mb)
        const int64_t off = (gm * L.merge + q) * S * mb;
        cp_shard_rows(tq.data(), D.tokens.data() + off, S, mb, L.cp, cpr);
        cp_shard_rows(lq.data(), D.labels.data() + off, S, mb, L.cp, cpr);
        cp_shard_rows(pq.data(), D.positions.data() + off, S, mb, L.cp, cpr);
        cp_shard_columns(ds.data() + q * mb * sl, D.doc.data() + off, mb, S, L.cp, cpr);
        for (int64_t i = 0; i < sl; ++i)
          for (int64_t j = 0; j < mb; ++j) {
            t[i * B + q * mb + j] = tq[i * mb + j];
            l[i * B + q * mb + j] = lq[i * mb + j];
            p[i * B + q * mb + j] = pq[i * mb + j];
          }
      }
      own.push_back(testing::make_int_tensor(t, Device::cpu(), {sl, B}, st));
      own.push_back(testing::make_int_tensor(l, Device::cpu(), {sl, B}, st));
      own.push_back(testing::make_int_tensor(p, Device::cpu(), {sl, B}, st));
      own.push_back(testing::make_int_tensor(ds, Device::cpu(), {B, sl}, st));
    }
    for (int m = 0; m < M; ++m) {
      MicroBatch b{own[4 * m].t, own[4 * m + 1].t, Tensor()};
      b.position_ids = own[4 * m + 2].t;
      if (L.docs) b.doc_start = own[4 * m + 3].t;
      b.loss_weight = 1.0f / static_cast<float>(S * B * M * L.dp);  // unmasked tokens of the whole sequence
      b.aux_loss_weight = 1.0f / static_cast<float>(M * L.dp);        // the trainer's
      mbs.push_back(b);
    }
    OwnedTensor loss(DType::kF32, Device::cpu(), {1});
    for (int it = 0; it < kIters; ++it) {
      fill(loss, 0.f, st);
      train_step(model, executor, plan, opt, mbs, {77, it, 1e-2f, d, L.dp}, loss, st);
      std::lock_guard<std::mutex> lock(mu);
      if (g.tp->rank() == 0) out.losses[it] += loss.t.data_as<float>()[0];  // sum over CP, DP (last stage)
    }
    // With EP the ranks of a DP × CP replica hold different experts: every rank reports.
    const bool report_params = (d == 0 && cpr == 0) || L.ep > 1;
    if (!report_params && !L.zero) return;
    const ParamStore& P = model.params();
    sync.finish_param_sync(st);
    const std::vector<ParamStore::Range>* owned = L.zero ? &opt.owned_ranges() : nullptr;
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < P.size(); ++i) {
      const auto& info = P.info(i);
      if (info.shared_embedding_copy) continue;
      int64_t gnumel = 1;
      for (auto x : info.global_shape) gnumel *= x;
      auto& gg = out.grads[info.name];
      auto& gp = out.params[info.name];
      gg.resize(gnumel, NAN);
      gp.resize(gnumel, NAN);
      place(gg, info, testing::to_host(P.grad(i), st), owned);
      if (report_params) place(gp, info, testing::to_host(P.main(i), st));
    }
  });
  return out;
}

// The data of a layout is a function of its name (`key`), not of the run's MT_TEST_SEED: an MoE
// router's top-k can flip a near-tied selection after rounding-level weight differences for rare
// data; a fixed draw per layout keeps each comparison reproducible.
Data make_data(int micro_total, const std::string& key) {
  Data D;
  D.micro_total = micro_total;
  const int64_t S = kSeq, mb = D.mb;
  std::mt19937_64 rng(std::hash<std::string>{}(key));
  auto randint = [&rng](int64_t n, int32_t lo, int32_t hi) {
    std::uniform_int_distribution<int32_t> d(lo, hi - 1);
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = d(rng);
    return v;
  };
  D.tokens = randint(micro_total * mb * S, 0, 61);
  D.labels = randint(micro_total * mb * S, 0, 61);
  D.positions.resize(D.tokens.size());
  D.doc.resize(D.tokens.size());
  for (int m = 0; m < micro_total; ++m)
    for (int64_t b = 0; b < mb; ++b) {
      // Documents of random lengths 1..7 (some cross the CP chunk boundaries).
      int32_t start = 0;
      auto len = randint(S, 1, 8);
      int32_t next = len[0];
      for (int64_t i = 0, k = 1; i < S; ++i) {
        if (i == next) {
          start = next;
          next += len[k++];
        }
        D.doc[(m * mb + b) * S + i] = start;
      }
    }
  return D;
}

class ContextParallelLayouts : public ::testing::TestWithParam<Layout> {};

TEST_P(ContextParallelLayouts, MatchesSingleRank) {
  const Layout L = GetParam();
  Data D = make_data(2 * L.pp * L.dp, L.name());
  const int64_t S = kSeq, mb = D.mb;
  for (int m = 0; m < D.micro_total; ++m)
    for (int64_t i = 0; i < S; ++i)
      for (int64_t b = 0; b < mb; ++b)  // reset position ids with documents, else 0..S-1
        D.positions[(m * S + i) * mb + b] =
            static_cast<int32_t>(L.docs ? i - D.doc[(m * mb + b) * S + i] : i);
  Layout one;
  one.arch = L.arch;
  one.docs = L.docs;
  one.dropout = L.dropout;  // the ordinary attention with the same masks
  if (L.arch == Arch::kMoeGlobal) one.merge = L.dp;  // the global micro-batch (moe.h)
  const Result ref = run_layout(one, D);
  const Result par = run_layout(L, D);
  for (int it = 0; it < kIters; ++it) EXPECT_NEAR(par.losses[it], ref.losses[it], 1e-5 * ref.losses[it]) << it;
  ASSERT_EQ(par.grads.size(), ref.grads.size());
  for (const auto& [name, gref] : ref.grads) {
    ASSERT_TRUE(par.grads.count(name)) << name << " missing";
    ASSERT_TRUE(testing::all_finite(par.grads.at(name))) << name << " not fully gathered";
    EXPECT_LT(testing::rel_err(par.grads.at(name), gref), 1e-5) << "grad " << name;
    EXPECT_LT(testing::rel_err(par.params.at(name), ref.params.at(name)), 1e-5) << "param " << name;
  }
}

std::vector<Layout> layouts() {
  std::vector<Layout> v;
  auto add = [&](Arch arch, int cp, const char* type, std::vector<int> hier, bool docs) {
    Layout L;
    L.arch = arch;
    L.cp = cp;
    L.type = type;
    L.hier = std::move(hier);
    L.docs = docs;
    v.push_back(L);
    return &v.back();
  };
  // Every comm type at CP 2 and 4, causal and with documents, GPT (MHA) and Llama style (GQA, RoPE).
  for (Arch arch : {Arch::kGpt, Arch::kLlama})
    for (bool docs : {false, true}) {
      for (int cp : {2, 4})
        for (const char* type : {"p2p", "allgather", "a2a"}) add(arch, cp, type, {}, docs);
      add(arch, 4, "a2a+p2p", {2, 2}, docs);
    }
  // With tensor (+ sequence) parallelism, pipeline (+ interleaving) and data parallelism.
  Layout* l = add(Arch::kLlama, 2, "p2p", {}, true);
  l->tp = 2;
  l->sp = true;
  l = add(Arch::kLlama, 2, "a2a", {}, false);
  l->tp = 2;
  l = add(Arch::kGpt, 2, "allgather", {}, true);
  l->tp = 2;
  l->sp = true;
  l = add(Arch::kGpt, 2, "p2p", {}, true);
  l->pp = 2;
  l = add(Arch::kLlama, 2, "p2p", {}, false);
  l->pp = 2;
  l->vpp = 2;
  l = add(Arch::kGpt, 2, "p2p", {}, false);
  l->dp = 2;
  l->zero = true;
  l = add(Arch::kLlama, 2, "a2a", {}, true);
  l->dp = 2;
  l = add(Arch::kLlama, 2, "p2p", {}, true);  // TP2 · CP2 · PP2 = 8 ranks
  l->tp = 2;
  l->sp = true;
  l->pp = 2;
  l = add(Arch::kGpt, 4, "a2a+p2p", {2, 2}, true);
  l->dp = 2;
  l->zero = true;
  // MoE with CP: the allgather dispatcher (expert TP = TP), EP over the CP ranks (allgather and
  // alltoall), TP + SP, DP × EP, seq_aux_loss (+ expert bias), global_aux_loss.
  add(Arch::kMoe, 2, "p2p", {}, true);
  add(Arch::kMoe, 4, "a2a", {}, false);
  l = add(Arch::kMoe, 2, "p2p", {}, false);
  l->ep = 2;
  l = add(Arch::kMoe, 2, "allgather", {}, false);
  l->ep = 2;
  l->alltoall = true;
  l = add(Arch::kMoe, 2, "p2p", {}, true);
  l->tp = 2;
  l->sp = true;
  l = add(Arch::kMoe, 2, "p2p", {}, false);
  l->dp = 2;
  l->ep = 2;
  l->alltoall = true;
  l = add(Arch::kMoe, 2, "p2p", {}, false);  // the distributed optimizer: experts sharded over EDP
  l->dp = 2;
  l->zero = true;
  l = add(Arch::kMoe, 2, "p2p", {}, true);
  l->pp = 2;
  add(Arch::kMoeSigmoid, 2, "p2p", {}, true);
  l = add(Arch::kMoeSigmoid, 2, "a2a", {}, false);
  l->tp = 2;
  l->sp = true;
  l = add(Arch::kMoeSigmoid, 2, "p2p", {}, false);  // expert-bias counts over TP × CP, then DP
  l->dp = 2;
  add(Arch::kMoeGlobal, 2, "p2p", {}, false);
  l = add(Arch::kMoeGlobal, 2, "p2p", {}, false);
  l->tp = 2;
  l->sp = true;
  l = add(Arch::kMoeGlobal, 2, "p2p", {}, true);  // counts over TP × CP × DP (reference: the union)
  l->dp = 2;
  l->ep = 2;
  l->alltoall = true;
  // Attention dropout (masks keyed by global query/key positions and global heads) and hidden
  // dropout (embedding, attention and MLP outputs: the CP rank's two chunks keyed by their rows in
  // the unsplit [s, b, h] layout): every comm type, CP 2 and 4, causal and with documents, MHA and
  // GQA; with TP + SP (a TP shard of the chunks, the TP rank's heads) and a2a under TP (the a2a
  // rank's head shard of the TP rank's heads); with DP and PP.
  for (Arch arch : {Arch::kGpt, Arch::kLlama})
    for (bool docs : {false, true}) {
      for (int cp : {2, 4})
        for (const char* type : {"p2p", "allgather", "a2a"}) add(arch, cp, type, {}, docs)->dropout = 0.1f;
      add(arch, 4, "a2a+p2p", {2, 2}, docs)->dropout = 0.1f;
    }
  l = add(Arch::kLlama, 2, "p2p", {}, true);
  l->tp = 2;
  l->sp = true;
  l->dropout = 0.1f;
  l = add(Arch::kLlama, 2, "a2a", {}, false);
  l->tp = 2;
  l->dropout = 0.1f;
  l = add(Arch::kGpt, 2, "allgather", {}, true);  // TP 4 + SP: a TP shard inside one chunk
  l->tp = 4;
  l->sp = true;
  l->dropout = 0.1f;
  l = add(Arch::kGpt, 2, "p2p", {}, false);
  l->dp = 2;
  l->dropout = 0.1f;
  l = add(Arch::kLlama, 2, "p2p", {}, true);
  l->pp = 2;
  l->dropout = 0.1f;
  add(Arch::kMoe, 2, "p2p", {}, true)->dropout = 0.1f;
  // --moe-router-force-load-balancing: each CP rank's two chunks (and their TP shards) keyed by
  // their rows in the unsplit sequence.
  add(Arch::kMoeForced, 2, "p2p", {}, false);
  add(Arch::kMoeForced, 4, "a2a", {}, false);
  l = add(Arch::kMoeForced, 2, "p2p", {}, false);
  l->tp = 2;
  l->sp = true;
  l = add(Arch::kMoeForced, 2, "p2p", {}, false);  // TP 4: a TP shard inside one chunk
  l->tp = 4;
  l->sp = true;
  // Multi-latent attention (the packed, padded qkv through every comm type; TP + SP; dropout).
  for (const char* type : {"p2p", "allgather", "a2a"}) add(Arch::kMla, 2, type, {}, true);
  l = add(Arch::kMla, 2, "p2p", {}, false);
  l->tp = 2;
  l->sp = true;
  l->dropout = 0.1f;
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, ContextParallelLayouts, ::testing::ValuesIn(layouts()),
                         [](const auto& info) { return info.param.name(); });

}  // namespace
}  // namespace mt
