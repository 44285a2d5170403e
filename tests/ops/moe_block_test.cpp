// Index maps of the static-buffer MoE dispatch (ops/moe_block.h) on the CPU: an example of each op
// worked by hand; random selections (dropped slots, experts nobody picks, 1..8 destinations, blocks
// of 0 rows, blocks that overflow and blocks that do not) against a host simulation written here
// from the definitions (the slots of each destination listed expert by expert, the received rows
// sorted by (local expert, source, row)); the overflow counter accumulating; a round trip over D
// simulated EP ranks (permute by send_index, all_to_all, receive layout, gather, an "expert" that
// scales each row by its expert id + 1, scatter, all_to_all back, unpermute, and the backward with
// zero gradients on the padding rows) checking where every row lands; and the documented errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "ops/moe.h"
#include "ops/moe_block.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::make_int_tensor;
using testing::OwnedTensor;
using I = std::vector<int32_t>;
const Device kCpu = Device::cpu();
const Stream& st() { return testing::cpu_stream(); }

I ints(const Tensor& t) { return {t.data_as<int32_t>(), t.data_as<int32_t>() + t.numel()}; }
void fill_ints(const Tensor& t, int32_t v) { std::fill_n(t.data_as<int32_t>(), t.numel(), v); }

/// The routing map over all experts, as the dispatcher computes it (moe_routing_map_device).
struct Routing {
  I row_index, counts;
};
Routing route(const I& top, int64_t N, int64_t k, int64_t Ev) {
  auto t = make_int_tensor(top, kCpu, {N, k}, st());
  OwnedTensor ri(DType::kI32, kCpu, {N * k}), sr(DType::kI32, kCpu, {N * k}), c(DType::kI32, kCpu, {Ev});
  moe_routing_map_device(ri, sr, c, t, 0, Ev, st());
  return {ints(ri), ints(c)};
}

struct Send {
  I send_index, slot_send, sent;
  float overflow = 0.f;
};

/// moe_block_send_layout on the CPU, outputs poisoned first; overflow starts at `overflow0`.
Send send_layout(const Routing& r, int64_t D, int64_t B, float overflow0 = 0.f) {
  const auto n = static_cast<int64_t>(r.row_index.size()), Ev = static_cast<int64_t>(r.counts.size());
  auto ri = make_int_tensor(r.row_index, kCpu, {n}, st());
  auto c = make_int_tensor(r.counts, kCpu, {Ev}, st());
  OwnedTensor si(DType::kI32, kCpu, {D * B}), ss(DType::kI32, kCpu, {n}), sent(DType::kI32, kCpu, {Ev}),
      of(DType::kF32, kCpu, {1});
  fill_ints(si, 12345);
  fill_ints(ss, 12345);
  fill_ints(sent, 12345);
  of->data_as<float>()[0] = overflow0;
  moe_block_send_layout(si, ss, sent, of, c, ri, D, B, st());
  return {ints(si), ints(ss), ints(sent), of->data_as<float>()[0]};
}

/// The definition, from the selection itself: destination m's slots are its experts' slots, expert
/// by expert, each in flat slot order; the first B of them are sent, as rows m·B + 0, 1, ...
Send send_ref(const I& top, int64_t Ev, int64_t D, int64_t B) {
  const auto n = static_cast<int64_t>(top.size());
  const int64_t Lv = Ev / D;
  Send s{I(static_cast<size_t>(D * B), -1), I(static_cast<size_t>(n), -1), I(static_cast<size_t>(Ev), 0), 0.f};
  int64_t dropped = 0;
  for (int64_t m = 0; m < D; ++m) {
    std::vector<std::pair<int64_t, int64_t>> run;  // (slot, expert)
    for (int64_t e = m * Lv; e < (m + 1) * Lv; ++e)
      for (int64_t i = 0; i < n; ++i)
        if (top[static_cast<size_t>(i)] == e) run.emplace_back(i, e);
    for (size_t o = 0; o < run.size(); ++o) {
      if (static_cast<int64_t>(o) >= B) {
        ++dropped;
        continue;
      }
      const auto [i, e] = run[o];
      s.send_index[static_cast<size_t>(m * B) + o] = static_cast<int32_t>(i);
      s.slot_send[static_cast<size_t>(i)] = static_cast<int32_t>(m * B + static_cast<int64_t>(o));
      ++s.sent[static_cast<size_t>(e)];
    }
  }
  s.overflow = static_cast<float>(dropped);
  return s;
}

struct Recv {
  I gather, scatter, local_counts;
};

Recv receive_layout(const I& sent_all, int64_t C, int64_t Ev, int64_t first, int64_t L, int64_t B) {
  auto sa = make_int_tensor(sent_all, kCpu, {C, Ev}, st());
  OwnedTensor g(DType::kI32, kCpu, {C * B}), s(DType::kI32, kCpu, {C * B}), lc(DType::kI32, kCpu, {L});
  fill_ints(g, 12345);
  fill_ints(s, 12345);
  fill_ints(lc, 12345);
  moe_block_receive_layout(g, s, lc, sa, first, L, B, st());
  return {ints(g), ints(s), ints(lc)};
}

/// The definition: label every used received row with (local expert, source, row), sort by the
/// label; gather = the rows in that order, scatter = the inverse.
Recv receive_ref(const I& sent_all, int64_t C, int64_t Ev, int64_t first, int64_t L, int64_t B) {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> rows;  // (expert, source, received row)
  Recv r{I(static_cast<size_t>(C * B), -1), I(static_cast<size_t>(C * B), -1), I(static_cast<size_t>(L), 0)};
  for (int64_t c = 0; c < C; ++c) {
    int64_t o = 0;
    for (int64_t i = 0; i < L; ++i)
      for (int32_t j = 0; j < sent_all[static_cast<size_t>(c * Ev + first + i)]; ++j, ++o) {
        rows.emplace_back(i, c, c * B + o);
        ++r.local_counts[static_cast<size_t>(i)];
      }
  }
  std::sort(rows.begin(), rows.end());
  for (size_t q = 0; q < rows.size(); ++q) {
    const int64_t row = std::get<2>(rows[q]);
    r.gather[q] = static_cast<int32_t>(row);
    r.scatter[static_cast<size_t>(row)] = static_cast<int32_t>(q);
  }
  return r;
}

/// top [N, k]: distinct experts per token drawn from the first `active` of Ev experts in a random
/// order (the others get no slot), each slot dropped (-1) with probability `drop`, skewed so that
/// a few experts take most slots.
I random_top(int64_t N, int64_t k, int64_t Ev, int64_t active, double drop) {
  auto& rng = testing::test_rng();
  std::uniform_real_distribution<double> u(0.0, 1.0);
  I ids(static_cast<size_t>(Ev));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(static_cast<size_t>(active));
  I top(static_cast<size_t>(N * k));
  std::vector<std::pair<double, int32_t>> keys(static_cast<size_t>(active));
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t a = 0; a < active; ++a)
      keys[static_cast<size_t>(a)] = {std::pow(u(rng), 1.0 + static_cast<double>(a)), ids[static_cast<size_t>(a)]};
    std::partial_sort(keys.begin(), keys.begin() + k, keys.end(), std::greater<>());
    for (int64_t j = 0; j < k; ++j)
      top[static_cast<size_t>(t * k + j)] = u(rng) < drop ? -1 : keys[static_cast<size_t>(j)].second;
  }
  return top;
}

// ---- worked by hand ----------------------------------------------------------------------------------

// N = 4 tokens, k = 2, Ev = 4 experts over D = 2 destinations (experts 0, 1 -> rank 0; 2, 3 -> 1).
// top = [[1, 2], [0, 3], [1, -1], [2, 0]]: flat slots 0..7 choose experts 1 2 0 3 1 - 2 0.
// counts = [2, 2, 2, 1] (slot 5 dropped by the router, Σ = 7); row_index sorted by expert, then
// slot = [2, 7 | 0, 4 | 1, 6 | 3 | -1]. Destination 0's run is [2, 7, 0, 4], destination 1's
// [1, 6, 3].
const I kTop = {1, 2, 0, 3, 1, -1, 2, 0};

TEST(MoeBlock, SendLayoutWorkedExample) {
  const Routing r = route(kTop, 4, 2, 4);
  ASSERT_EQ(r.counts, (I{2, 2, 2, 1}));
  ASSERT_EQ(r.row_index, (I{2, 7, 0, 4, 1, 6, 3, -1}));
  // B = 3: destination 0 sends [2, 7, 0] and loses slot 4 (its 4th); destination 1 sends all 3.
  // sent: expert 0 keeps 2, expert 1 keeps 1 of 2 (3 - 2 rows left), expert 2 keeps 2, expert 3
  // keeps 1 (3 - 2). slot_send: slot 0 -> row 2, 1 -> 3, 2 -> 0, 3 -> 5, 4 -> overflow, 5 ->
  // dropped, 6 -> 4, 7 -> 1. One slot overflows: the counter goes from 2.5 to 3.5.
  const Send s3 = send_layout(r, 2, 3, 2.5f);
  EXPECT_EQ(s3.send_index, (I{2, 7, 0, 1, 6, 3}));
  EXPECT_EQ(s3.slot_send, (I{2, 3, 0, 5, -1, -1, 4, 1}));
  EXPECT_EQ(s3.sent, (I{2, 1, 2, 1}));
  EXPECT_EQ(s3.overflow, 3.5f);
  // B = 2: destination 0 sends [2, 7] (expert 0 only), destination 1 [1, 6] (expert 2 only);
  // 3 slots overflow.
  const Send s2 = send_layout(r, 2, 2);
  EXPECT_EQ(s2.send_index, (I{2, 7, 1, 6}));
  EXPECT_EQ(s2.slot_send, (I{-1, 2, 0, -1, -1, -1, 3, 1}));
  EXPECT_EQ(s2.sent, (I{2, 0, 2, 0}));
  EXPECT_EQ(s2.overflow, 3.f);
  // B = 5: nothing overflows; padding rows 4 and 8, 9 are -1.
  const Send s5 = send_layout(r, 2, 5);
  EXPECT_EQ(s5.send_index, (I{2, 7, 0, 4, -1, 1, 6, 3, -1, -1}));
  EXPECT_EQ(s5.slot_send, (I{2, 5, 0, 7, 3, -1, 6, 1}));
  EXPECT_EQ(s5.sent, r.counts);
  EXPECT_EQ(s5.overflow, 0.f);
  // One destination (D = 1): the first 4 slots of the whole sorted order.
  const Send s1 = send_layout(r, 1, 4);
  EXPECT_EQ(s1.send_index, (I{2, 7, 0, 4}));
  EXPECT_EQ(s1.sent, (I{2, 2, 0, 0}));
  EXPECT_EQ(s1.overflow, 3.f);
  // B = 0: nothing is sent, everything routed overflows.
  const Send s0 = send_layout(r, 2, 0);
  EXPECT_TRUE(s0.send_index.empty());
  EXPECT_EQ(s0.slot_send, I(8, -1));
  EXPECT_EQ(s0.sent, (I{0, 0, 0, 0}));
  EXPECT_EQ(s0.overflow, 7.f);
}

TEST(MoeBlock, ReceiveLayoutWorkedExample) {
  // C = 3 sources, Ev = 4, this rank holds experts 2 and 3 (first 2, L = 2), blocks of B = 4 rows.
  // sent_all (rows = sources):        e0 e1 e2 e3
  const I sent_all = {1, 0, 2, 1,   // source 0: rows 0, 1 expert 2; row 2 expert 3; row 3 pad
                      2, 2, 0, 3,   // source 1: rows 4, 5, 6 expert 3; row 7 pad
                      0, 1, 1, 0};  // source 2: row 8 expert 2; rows 9-11 pad
  // local_counts = [2 + 0 + 1, 1 + 3 + 0] = [3, 4]; R = 7. Expert-ordered rows: expert 2 from
  // source 0 (received rows 0, 1), then source 2 (row 8); expert 3 from source 0 (row 2), then
  // source 1 (rows 4, 5, 6).
  const Recv r = receive_layout(sent_all, 3, 4, 2, 2, 4);
  EXPECT_EQ(r.local_counts, (I{3, 4}));
  EXPECT_EQ(r.gather, (I{0, 1, 8, 2, 4, 5, 6, -1, -1, -1, -1, -1}));
  // The inverse: row 2 is the 4th expert-ordered row, row 8 the 3rd; padding rows -1.
  EXPECT_EQ(r.scatter, (I{0, 1, 3, -1, 4, 5, 6, -1, 2, -1, -1, -1}));
  // The other rank (experts 0 and 1): sources send 1, 4 and 1 rows.
  const Recv r0 = receive_layout(sent_all, 3, 4, 0, 2, 4);
  EXPECT_EQ(r0.local_counts, (I{3, 3}));
  // expert 0: source 0 row 0, source 1 rows 4, 5; expert 1: source 1 rows 6, 7, source 2 row 8.
  EXPECT_EQ(r0.gather, (I{0, 4, 5, 6, 7, 8, -1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(r0.scatter, (I{0, -1, -1, -1, 1, 2, 3, 4, 5, -1, -1, -1}));
  // Full blocks (n_c = B) and a block of 0 rows.
  const Recv rf = receive_layout({2, 2, 0, 4}, 2, 2, 0, 2, 4);
  EXPECT_EQ(rf.local_counts, (I{2, 6}));
  EXPECT_EQ(rf.gather, (I{0, 1, 2, 3, 4, 5, 6, 7}));
  const Recv rz = receive_layout({0, 0}, 2, 1, 0, 1, 0);
  EXPECT_EQ(rz.local_counts, (I{0}));
  EXPECT_TRUE(rz.gather.empty() && rz.scatter.empty());
}

// ---- random properties ---------------------------------------------------------------------------------

TEST(MoeBlock, SendLayoutMatchesSimulation) {
  struct Case {
    int64_t N, k, D, Lv, active;
  };
  const Case cases[] = {{1, 1, 1, 1, 1},   {7, 2, 2, 2, 3},   {50, 2, 4, 2, 8},  {64, 4, 8, 3, 10},
                        {200, 8, 8, 4, 32}, {33, 1, 3, 5, 2},  {100, 6, 2, 16, 20}};
  for (const Case& c : cases) {
    const int64_t Ev = c.D * c.Lv;
    for (double drop : {0.0, 0.1}) {
      const I top = random_top(c.N, c.k, Ev, std::min(Ev, std::max(c.k, c.active)), drop);
      const Routing r = route(top, c.N, c.k, Ev);
      int64_t max_run = 0, routed = 0;
      for (int64_t m = 0; m < c.D; ++m) {
        int64_t run = 0;
        for (int64_t e = m * c.Lv; e < (m + 1) * c.Lv; ++e) run += r.counts[static_cast<size_t>(e)];
        max_run = std::max(max_run, run);
        routed += run;
      }
      // Blocks of 0 rows, a few rows (overflow), about the mean run, exactly the largest run, more.
      for (int64_t B : {int64_t{0}, int64_t{1}, int64_t{3}, routed / c.D + 1, max_run, max_run + 5}) {
        SCOPED_TRACE(fmt::format("N={} k={} D={} Lv={} drop={} B={} max_run={}", c.N, c.k, c.D, c.Lv, drop, B,
                                 max_run));
        const Send got = send_layout(r, c.D, B, 0.25f);
        const Send want = send_ref(top, Ev, c.D, B);
        EXPECT_EQ(got.send_index, want.send_index);
        EXPECT_EQ(got.slot_send, want.slot_send);
        EXPECT_EQ(got.sent, want.sent);
        EXPECT_EQ(got.overflow, 0.25f + want.overflow);
        if (B >= max_run) {
          EXPECT_EQ(got.sent, r.counts);  // no overflow: everything is sent
        }
        // Every kept slot is sent exactly once, to its expert's destination.
        for (size_t i = 0; i < top.size(); ++i)
          if (got.slot_send[i] >= 0) {
            EXPECT_EQ(got.send_index[static_cast<size_t>(got.slot_send[i])], static_cast<int32_t>(i));
            EXPECT_EQ(got.slot_send[i] / B, top[i] / c.Lv);
          }
      }
    }
  }
}

TEST(MoeBlock, OverflowAccumulatesAndIsOptional) {
  const I top = random_top(300, 4, 16, 16, 0.05);
  const Routing r = route(top, 300, 4, 16);
  const Send want = send_ref(top, 16, 4, 20);
  ASSERT_GT(want.overflow, 0.f);
  auto ri = make_int_tensor(r.row_index, kCpu, {1200}, st());
  auto c = make_int_tensor(r.counts, kCpu, {16}, st());
  OwnedTensor si(DType::kI32, kCpu, {80}), ss(DType::kI32, kCpu, {1200}), sent(DType::kI32, kCpu, {16}),
      of(DType::kF32, kCpu, {1});
  of->data_as<float>()[0] = 1.f;
  moe_block_send_layout(si, ss, sent, of, c, ri, 4, 20, st());
  moe_block_send_layout(si, ss, sent, of, c, ri, 4, 20, st());
  EXPECT_EQ(of->data_as<float>()[0], 1.f + 2.f * want.overflow);
  // Without the counter: the same maps.
  fill_ints(si, 7);
  moe_block_send_layout(si, ss, sent, Tensor(), c, ri, 4, 20, st());
  EXPECT_EQ(ints(si), want.send_index);
  EXPECT_EQ(ints(ss), want.slot_send);
  EXPECT_EQ(ints(sent), want.sent);
}

TEST(MoeBlock, ReceiveLayoutMatchesSimulation) {
  auto& rng = testing::test_rng();
  struct Case {
    int64_t C, Lv, B;
  };
  const Case cases[] = {{1, 1, 0}, {1, 1, 5}, {2, 3, 4}, {4, 2, 16}, {8, 4, 7}, {3, 8, 40}, {16, 1, 3}, {64, 2, 9}};
  for (const Case& c : cases) {
    const int64_t Ev = c.C * c.Lv;
    for (int rep = 0; rep < 3; ++rep) {
      // Each source's row: for each destination, random counts (zeros included) that fill at most
      // B rows; rep 1 fills every block exactly, rep 2 leaves many experts empty.
      I sent_all(static_cast<size_t>(c.C * Ev), 0);
      for (int64_t s = 0; s < c.C; ++s)
        for (int64_t m = 0; m < c.C; ++m) {
          int64_t left = rep == 1 ? c.B : std::uniform_int_distribution<int64_t>(0, c.B)(rng);
          for (int64_t i = 0; i < c.Lv && left > 0; ++i) {
            int64_t v = i + 1 == c.Lv ? left : std::uniform_int_distribution<int64_t>(0, left)(rng);
            if (rep == 2 && std::uniform_int_distribution<int>(0, 2)(rng) > 0) v = 0;
            sent_all[static_cast<size_t>(s * Ev + m * c.Lv + i)] = static_cast<int32_t>(v);
            left -= v;
          }
        }
      for (int64_t m = 0; m < c.C; ++m) {
        SCOPED_TRACE(fmt::format("C={} Lv={} B={} rep={} rank={}", c.C, c.Lv, c.B, rep, m));
        const Recv got = receive_layout(sent_all, c.C, Ev, m * c.Lv, c.Lv, c.B);
        const Recv want = receive_ref(sent_all, c.C, Ev, m * c.Lv, c.Lv, c.B);
        EXPECT_EQ(got.local_counts, want.local_counts);
        EXPECT_EQ(got.gather, want.gather);
        EXPECT_EQ(got.scatter, want.scatter);
      }
      // A range of experts that is not one destination's (first 1, three experts when possible).
      if (Ev >= 4) {
        const Recv got = receive_layout(sent_all, c.C, Ev, 1, 3, 3 * c.B);
        const Recv want = receive_ref(sent_all, c.C, Ev, 1, 3, 3 * c.B);
        EXPECT_EQ(got.gather, want.gather);
        EXPECT_EQ(got.scatter, want.scatter);
        EXPECT_EQ(got.local_counts, want.local_counts);
      }
    }
  }
}

// ---- round trip over simulated EP ranks ------------------------------------------------------------------

// D ranks, each with its own tokens and selection: send layout, permute into the send buffer,
// all_to_all (block c of rank r's receive buffer = block r of rank c's send buffer), receive layout
// from the all-gathered `sent`, gather by expert, an expert that multiplies its rows by (global
// expert id + 1), scatter back to blocks, all_to_all back, unpermute with slot_send; and the
// backward of the unpermute with send_index, whose padding rows get zero gradients.
TEST(MoeBlock, RoundTripOverSimulatedRanks) {
  const int64_t h = 3;
  struct Case {
    int64_t D, Lv, k, B;
  };
  const Case cases[] = {{1, 4, 2, 40}, {2, 2, 2, 5}, {4, 2, 3, 12}, {4, 3, 2, 1000}, {8, 1, 4, 7}, {3, 2, 2, 0}};
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("D={} Lv={} k={} B={}", c.D, c.Lv, c.k, c.B));
    const int64_t D = c.D, Ev = D * c.Lv, k = c.k, B = c.B, rows = D * B;
    std::vector<int64_t> N(static_cast<size_t>(D));
    std::vector<I> top(static_cast<size_t>(D));
    std::vector<std::vector<float>> x(static_cast<size_t>(D)), probs(static_cast<size_t>(D)),
        send(static_cast<size_t>(D));
    std::vector<Send> sl(static_cast<size_t>(D));
    I sent_all;
    for (int64_t r = 0; r < D; ++r) {  // each source rank
      const auto ur = static_cast<size_t>(r);
      N[ur] = 10 + 7 * r;  // ranks hold different numbers of tokens
      top[ur] = random_top(N[ur], k, Ev, std::max(k, Ev - 1), 0.1);
      x[ur] = testing::randn(N[ur] * h);
      probs[ur] = testing::randu(N[ur] * k, 0.1f, 1.f);
      sl[ur] = send_layout(route(top[ur], N[ur], k, Ev), D, B);
      EXPECT_EQ(sl[ur].send_index, send_ref(top[ur], Ev, D, B).send_index);
      auto xt = testing::make_tensor(x[ur], DType::kF32, kCpu, {N[ur], h}, st());
      auto si = make_int_tensor(sl[ur].send_index, kCpu, {rows}, st());
      OwnedTensor sb(DType::kF32, kCpu, {rows, h});
      testing::poison(sb, st());  // padding rows stay NaN: they must never reach a result
      moe_permute(sb, xt, si, k, st());
      send[ur] = testing::to_host(sb, st());
      sent_all.insert(sent_all.end(), sl[ur].sent.begin(), sl[ur].sent.end());
    }
    // Rank r: receive, gather, expert, scatter.
    std::vector<std::vector<float>> blocks(static_cast<size_t>(D));
    for (int64_t r = 0; r < D; ++r) {
      const auto ur = static_cast<size_t>(r);
      const int64_t first = r * c.Lv;
      std::vector<float> recv(static_cast<size_t>(rows * h));
      for (int64_t src = 0; src < D; ++src)  // the all_to_all
        std::copy_n(send[static_cast<size_t>(src)].begin() + (r * B) * h, B * h, recv.begin() + (src * B) * h);
      const Recv rl = receive_layout(sent_all, D, Ev, first, c.Lv, B);
      auto rt = testing::make_tensor(recv, DType::kF32, kCpu, {rows, h}, st());
      auto gi = make_int_tensor(rl.gather, kCpu, {rows}, st());
      OwnedTensor xp(DType::kF32, kCpu, {rows, h});
      testing::poison(xp, st());
      moe_permute(xp, rt, gi, 1, st());
      const auto xpv = testing::to_host(xp, st());
      // Expected expert-ordered rows: per local expert, per source, the source's kept slots of that
      // expert in flat slot order (the first sent[e] of them).
      std::vector<float> out(static_cast<size_t>(rows * h), std::nanf(""));
      int64_t q = 0;
      for (int64_t i = 0; i < c.Lv; ++i) {
        const int64_t e = first + i;
        int64_t rows_i = 0;
        for (int64_t src = 0; src < D; ++src) {
          const auto us = static_cast<size_t>(src);
          int64_t kept = 0;
          for (size_t slot = 0; slot < top[us].size() && kept < sl[us].sent[static_cast<size_t>(e)]; ++slot) {
            if (top[us][slot] != e) continue;
            ++kept;
            const auto t = static_cast<int64_t>(slot) / k;
            for (int64_t j = 0; j < h; ++j) {
              EXPECT_EQ(xpv[static_cast<size_t>(q * h + j)], x[us][static_cast<size_t>(t * h + j)])
                  << "expert row " << q;
              out[static_cast<size_t>(q * h + j)] =
                  xpv[static_cast<size_t>(q * h + j)] * static_cast<float>(e + 1);  // the "expert"
            }
            ++q;
          }
          rows_i += kept;
        }
        EXPECT_EQ(rl.local_counts[static_cast<size_t>(i)], rows_i);
      }
      for (int64_t qq = q; qq < rows; ++qq) EXPECT_TRUE(std::isnan(xpv[static_cast<size_t>(qq * h)])) << qq;
      auto ot = testing::make_tensor(out, DType::kF32, kCpu, {rows, h}, st());
      auto sc = make_int_tensor(rl.scatter, kCpu, {rows}, st());
      OwnedTensor bl(DType::kF32, kCpu, {rows, h});
      testing::poison(bl, st());
      moe_permute(bl, ot, sc, 1, st());
      blocks[ur] = testing::to_host(bl, st());
    }
    // Back to the sources: combine, and the backward of the combine.
    for (int64_t src = 0; src < D; ++src) {
      const auto us = static_cast<size_t>(src);
      std::vector<float> back(static_cast<size_t>(rows * h));
      for (int64_t r = 0; r < D; ++r)  // the all_to_all back
        std::copy_n(blocks[static_cast<size_t>(r)].begin() + (src * B) * h, B * h, back.begin() + (r * B) * h);
      const int64_t n = N[us];
      auto bt = testing::make_tensor(back, DType::kF32, kCpu, {rows, h}, st());
      // probs one element into a buffer that starts with NaN: a read of probs[-1] would show.
      std::vector<float> pbuf = {std::nanf("")};
      pbuf.insert(pbuf.end(), probs[us].begin(), probs[us].end());
      auto pb = testing::make_tensor(pbuf, DType::kF32, kCpu, {n * k + 1}, st());
      const Tensor pt = pb.t.flat_range(1, n * k).view({n, k});
      auto ss = make_int_tensor(sl[us].slot_send, kCpu, {n, k}, st());
      auto si = make_int_tensor(sl[us].send_index, kCpu, {rows}, st());
      OwnedTensor y(DType::kF32, kCpu, {n, h});
      testing::poison(y, st());
      moe_unpermute(y, bt, pt, ss, st());
      const auto yv = testing::to_host(y, st());
      const auto dyv = testing::randn(n * h);
      auto dy = testing::make_tensor(dyv, DType::kF32, kCpu, {n, h}, st());
      OwnedTensor dback(DType::kF32, kCpu, {rows, h}), dp(DType::kF32, kCpu, {n, k});
      testing::poison(dback, st());
      testing::poison(dp, st());
      moe_unpermute_backward(dback, dp, dy, bt, pt, si, ss, st());
      const auto dbv = testing::to_host(dback, st()), dpv = testing::to_host(dp, st());
      std::vector<double> yref(static_cast<size_t>(n * h), 0.0);
      for (int64_t i = 0; i < n * k; ++i) {
        const int32_t row = sl[us].slot_send[static_cast<size_t>(i)];
        if (row < 0) {
          EXPECT_EQ(dpv[static_cast<size_t>(i)], 0.f);
          continue;
        }
        const int64_t t = i / k, e = top[us][static_cast<size_t>(i)];
        EXPECT_EQ(row / std::max<int64_t>(B, 1), e / c.Lv);  // sent to its expert's rank
        double dot = 0;
        for (int64_t j = 0; j < h; ++j) {
          const double v = static_cast<double>(x[us][static_cast<size_t>(t * h + j)]) * static_cast<double>(e + 1);
          EXPECT_NEAR(back[static_cast<size_t>(row * h + j)], v, 1e-6 * std::max(1.0, std::fabs(v)));
          yref[static_cast<size_t>(t * h + j)] += probs[us][static_cast<size_t>(i)] * v;
          dot += static_cast<double>(dyv[static_cast<size_t>(t * h + j)]) * back[static_cast<size_t>(row * h + j)];
          EXPECT_EQ(dbv[static_cast<size_t>(row * h + j)],
                    probs[us][static_cast<size_t>(i)] * dyv[static_cast<size_t>(t * h + j)]);
        }
        EXPECT_NEAR(dpv[static_cast<size_t>(i)], dot, 1e-5 * std::max(1.0, std::fabs(dot)));
      }
      EXPECT_LT(testing::rel_err(yv, yref), 1e-6);
      EXPECT_TRUE(testing::all_finite(yv));
      for (int64_t row = 0; row < rows; ++row) {  // padding rows: zero gradient (not NaN)
        if (sl[us].send_index[static_cast<size_t>(row)] >= 0) continue;
        for (int64_t j = 0; j < h; ++j) EXPECT_EQ(dbv[static_cast<size_t>(row * h + j)], 0.f) << row;
      }
    }
  }
}

// ---- errors ----------------------------------------------------------------------------------------------

TEST(MoeBlock, SendLayoutErrors) {
  const Stream& cs = st();
  const Routing r = route(kTop, 4, 2, 4);
  auto ri = make_int_tensor(r.row_index, kCpu, {8}, cs);
  auto c = make_int_tensor(r.counts, kCpu, {4}, cs);
  OwnedTensor si(DType::kI32, kCpu, {6}), ss(DType::kI32, kCpu, {8}), sent(DType::kI32, kCpu, {4}),
      of(DType::kF32, kCpu, {1});
  EXPECT_NO_THROW(moe_block_send_layout(si, ss, sent, of, c, ri, 2, 3, cs));
  EXPECT_NO_THROW(moe_block_send_layout(si, ss, sent, Tensor(), c, ri, 2, 3, cs));
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, c, ri, 0, 3, cs), Error);   // num_dest < 1
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, c, ri, 3, 2, cs), Error);   // 4 % 3 != 0
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, c, ri, 2, -1, cs), Error);  // block < 0
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, c, ri, 2, 4, cs), Error);   // send_index of 6 != 8
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, c, ri, 2, int64_t{1} << 31, cs), Error);  // beyond int32
  OwnedTensor ss7(DType::kI32, kCpu, {7}), sent3(DType::kI32, kCpu, {3}), si23(DType::kI32, kCpu, {2, 3});
  EXPECT_THROW(moe_block_send_layout(si, ss7, sent, of, c, ri, 2, 3, cs), Error);   // slot_send numel
  EXPECT_THROW(moe_block_send_layout(si, ss, sent3, of, c, ri, 2, 3, cs), Error);   // sent numel
  EXPECT_THROW(moe_block_send_layout(si23, ss, sent, of, c, ri, 2, 3, cs), Error);  // send_index not 1-D
  OwnedTensor of2(DType::kF32, kCpu, {2}), ofi(DType::kI32, kCpu, {1}), cf(DType::kF32, kCpu, {4}),
      c22(DType::kI32, kCpu, {2, 2}), rif(DType::kF32, kCpu, {8});
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of2, c, ri, 2, 3, cs), Error);  // overflow [2]
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, ofi, c, ri, 2, 3, cs), Error);  // overflow int32
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, cf, ri, 2, 3, cs), Error);  // counts fp32
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, c22, ri, 2, 3, cs), Error);  // counts 2-D
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, c, rif, 2, 3, cs), Error);  // row_index fp32
  OwnedTensor wide(DType::kI32, kCpu, {2, 8});
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, c, wide->slice(1, 0, 4), 2, 3, cs), Error);  // strided
  EXPECT_THROW(moe_block_send_layout(si, ri, sent, of, c, ri, 2, 3, cs), Error);  // slot_send aliases row_index
  EXPECT_THROW(moe_block_send_layout(si, ss, c, of, c, ri, 2, 3, cs), Error);     // sent aliases counts
  EXPECT_THROW(moe_block_send_layout(si, ss, si->slice0(0, 4), of, c, ri, 2, 3, cs), Error);  // outputs overlap
  // Values (CPU only): negative counts, counts beyond row_index, row_index entries not fresh slots.
  auto neg = make_int_tensor({2, 2, 3, -1}, kCpu, {4}, cs);
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, neg, ri, 2, 3, cs), Error);
  auto big = make_int_tensor({2, 2, 2, 3}, kCpu, {4}, cs);  // 9 > 8 slots
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, big, ri, 2, 3, cs), Error);
  auto bad = make_int_tensor({2, 7, 0, 4, 1, 6, 8, -1}, kCpu, {8}, cs);  // 8 is not a slot
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, c, bad, 2, 3, cs), Error);
  auto dup = make_int_tensor({2, 7, 0, 4, 1, 6, 2, -1}, kCpu, {8}, cs);  // slot 2 twice
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, c, dup, 2, 3, cs), Error);
  auto unrouted = make_int_tensor({2, 7, 0, 4, 1, 6, -1, -1}, kCpu, {8}, cs);  // -1 below Σ counts
  EXPECT_THROW(moe_block_send_layout(si, ss, sent, of, c, unrouted, 2, 3, cs), Error);
}

TEST(MoeBlock, ReceiveLayoutErrors) {
  const Stream& cs = st();
  auto sa = make_int_tensor({1, 0, 2, 1, 2, 2, 0, 3, 0, 1, 1, 0}, kCpu, {3, 4}, cs);
  OwnedTensor g(DType::kI32, kCpu, {12}), s(DType::kI32, kCpu, {12}), lc(DType::kI32, kCpu, {2});
  EXPECT_NO_THROW(moe_block_receive_layout(g, s, lc, sa, 2, 2, 4, cs));
  EXPECT_THROW(moe_block_receive_layout(g, s, lc, sa, -1, 2, 4, cs), Error);  // first < 0
  EXPECT_THROW(moe_block_receive_layout(g, s, lc, sa, 2, 0, 4, cs), Error);   // num_local < 1
  EXPECT_THROW(moe_block_receive_layout(g, s, lc, sa, 3, 2, 4, cs), Error);   // first + num_local > Ev
  EXPECT_THROW(moe_block_receive_layout(g, s, lc, sa, 2, 2, -4, cs), Error);  // block < 0
  EXPECT_THROW(moe_block_receive_layout(g, s, lc, sa, 2, 2, 5, cs), Error);   // maps of 12 != 15
  EXPECT_THROW(moe_block_receive_layout(g, s, lc, sa, 2, 2, int64_t{1} << 30, cs), Error);  // beyond int32
  OwnedTensor g11(DType::kI32, kCpu, {11}), lc3(DType::kI32, kCpu, {3}), gf(DType::kF32, kCpu, {12});
  EXPECT_THROW(moe_block_receive_layout(g11, s, lc, sa, 2, 2, 4, cs), Error);  // gather numel
  EXPECT_THROW(moe_block_receive_layout(g, g11, lc, sa, 2, 2, 4, cs), Error);  // scatter numel
  EXPECT_THROW(moe_block_receive_layout(g, s, lc3, sa, 2, 2, 4, cs), Error);  // local_counts numel
  EXPECT_THROW(moe_block_receive_layout(gf, s, lc, sa, 2, 2, 4, cs), Error);  // gather fp32
  EXPECT_THROW(moe_block_receive_layout(g, g, lc, sa, 2, 2, 4, cs), Error);   // outputs alias
  EXPECT_THROW(moe_block_receive_layout(g, s, lc, sa->view({12}), 2, 2, 4, cs), Error);  // sent_all 1-D
  auto saf = testing::make_tensor(std::vector<float>(12, 1.f), DType::kF32, kCpu, {3, 4}, cs);
  EXPECT_THROW(moe_block_receive_layout(g, s, lc, saf, 2, 2, 4, cs), Error);  // sent_all fp32
  OwnedTensor gs(DType::kI32, kCpu, {24});
  EXPECT_THROW(moe_block_receive_layout(gs->slice0(0, 12), gs->slice0(12, 24), lc, gs->slice0(0, 12).view({3, 4}),
                                        2, 2, 4, cs),
               Error);  // output aliases sent_all
  // Values (CPU only): a block holding more than B rows, negative entries.
  OwnedTensor g6(DType::kI32, kCpu, {6}), s6(DType::kI32, kCpu, {6});
  EXPECT_THROW(moe_block_receive_layout(g6, s6, lc, sa, 2, 2, 2, cs), Error);  // sources 0, 1 send 3 > 2 rows
  auto neg = make_int_tensor({1, 0, 2, 1, 2, 2, -1, 3, 0, 1, 1, 0}, kCpu, {3, 4}, cs);
  EXPECT_THROW(moe_block_receive_layout(g, s, lc, neg, 2, 2, 4, cs), Error);  // negative entry
  OwnedTensor lc1(DType::kI32, kCpu, {1});
  EXPECT_NO_THROW(moe_block_receive_layout(g, s, lc1, neg, 0, 1, 4, cs));  // outside the local experts
}

}  // namespace
}  // namespace mt
