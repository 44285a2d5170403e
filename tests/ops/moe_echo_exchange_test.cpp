// ECHO's fixed-size weight dispatch and gradient return (ops/moe_echo_exchange.h) on the CPU: the
// block maps worked by hand for every rank of two small placements; a simulated round trip over
// P ranks (every rank's maps, send buffers gathered from its experts, the equal-split all_to_all
// done by the test, the clones gathered from the receive buffers; then the clones' gradients back
// the same way and accumulated) on placements planned by moe_echo_plan from random skewed counts
// and on arbitrary valid tables, checking that each clone equals its home expert bitwise and each
// home gradient equals its own value plus its clones' gradients; the gathers' untouched rows; the
// accumulation's ascending order with values where fp32 order matters; the documented errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "ops/moe_echo.h"
#include "ops/moe_echo_exchange.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::make_int_tensor;
using testing::make_tensor;
using testing::OwnedTensor;
using I = std::vector<int32_t>;
const Device kCpu = Device::cpu();

I ints(const Tensor& t) { return {t.data_as<int32_t>(), t.data_as<int32_t>() + t.numel()}; }

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return {p, p + t.nbytes()};
}

struct Maps {
  I w_send, w_recv, g_send, g_acc;
};

Maps run_index(const I& clone_expert, int64_t me, int64_t L, int64_t S) {
  const Stream& cs = testing::cpu_stream();
  const auto NS = static_cast<int64_t>(clone_expert.size());
  auto ce = make_int_tensor(clone_expert, kCpu, {NS}, cs);
  OwnedTensor ws(DType::kI32, kCpu, {NS}), wr(DType::kI32, kCpu, {S}), gs(DType::kI32, kCpu, {NS}),
      ga(DType::kI32, kCpu, {NS});
  for (const OwnedTensor* t : {&ws, &wr, &gs, &ga}) std::fill_n(t->t.data_as<int32_t>(), t->t.numel(), 777);
  moe_echo_exchange_index(ws, wr, gs, ga, ce, me, L, S, cs);
  return {ints(ws), ints(wr), ints(gs), ints(ga)};
}

// ---- the maps, by hand ------------------------------------------------------------------------------

// P = 4 ranks, L = 2 experts each (e0 e1 | e2 e3 | e4 e5 | e6 e7), S = 1 slot each:
// clone_expert = [−1, 0, 7, 1]: slot 0 (rank 0) unused; slot 1 (rank 1) = e0 (home 0, local 0);
// slot 2 (rank 2) = e7 (home 3, local 1); slot 3 (rank 3) = e1 (home 0, local 1).
// The all_to_all moves send block p·S + j of rank r to receive block r·S + j of rank p.
TEST(MoeEchoExchange, IndexWorkedExampleOneSlot) {
  const I ce = {-1, 0, 7, 1};
  // Rank 0 is home of e0 and e1: it sends e0 to rank 1 (block 1) and e1 to rank 3 (block 3); its
  // slot is unused (nothing received, no gradient sent); it adds received block 1 (slot 1's
  // gradient, from rank 1) to e0 and block 3 (from rank 3) to e1.
  const Maps r0 = run_index(ce, 0, 2, 1);
  EXPECT_EQ(r0.w_send, (I{-1, 0, -1, 1}));
  EXPECT_EQ(r0.w_recv, (I{-1}));
  EXPECT_EQ(r0.g_send, (I{-1, -1, -1, -1}));
  EXPECT_EQ(r0.g_acc, (I{-1, 0, -1, 1}));
  // Rank 1 (e2, e3: nobody's clone) holds a clone of e0: weights arrive from rank 0 in block
  // 0·1 + 0 = 0, its gradient goes back in send block 0 (to rank 0).
  const Maps r1 = run_index(ce, 1, 2, 1);
  EXPECT_EQ(r1.w_send, (I{-1, -1, -1, -1}));
  EXPECT_EQ(r1.w_recv, (I{0}));
  EXPECT_EQ(r1.g_send, (I{0, -1, -1, -1}));
  EXPECT_EQ(r1.g_acc, (I{-1, -1, -1, -1}));
  // Rank 2 (e4, e5) holds a clone of e7: from rank 3, receive block 3; gradient to send block 3.
  const Maps r2 = run_index(ce, 2, 2, 1);
  EXPECT_EQ(r2.w_send, (I{-1, -1, -1, -1}));
  EXPECT_EQ(r2.w_recv, (I{3}));
  EXPECT_EQ(r2.g_send, (I{-1, -1, -1, 0}));
  EXPECT_EQ(r2.g_acc, (I{-1, -1, -1, -1}));
  // Rank 3 (e6, e7) sends e7 (local 1) to rank 2 (block 2) and adds slot 2's gradient to it; its
  // own clone of e1 comes from rank 0 (block 0) and its gradient goes to rank 0 (send block 0).
  const Maps r3 = run_index(ce, 3, 2, 1);
  EXPECT_EQ(r3.w_send, (I{-1, -1, 1, -1}));
  EXPECT_EQ(r3.w_recv, (I{0}));
  EXPECT_EQ(r3.g_send, (I{0, -1, -1, -1}));
  EXPECT_EQ(r3.g_acc, (I{-1, -1, 1, -1}));
}

// P = 3 ranks, L = 1 (e0 | e1 | e2), S = 2: clone_expert = [1, 2, −1, 0, 0, 1]: rank 0's clones
// are e1 (slot 0) and e2 (slot 1); rank 1's are unused (slot 2) and e0 (slot 3); rank 2's are e0
// (slot 4) and e1 (slot 5). e0 and e1 have two clones each.
TEST(MoeEchoExchange, IndexWorkedExampleTwoSlots) {
  const I ce = {1, 2, -1, 0, 0, 1};
  // Rank 0 (e0) sends e0 to rank 1's clone 1 (block 1·2 + 1 = 3) and rank 2's clone 0 (block 4);
  // its clone 0 (e1) reads block 1·2 + 0 = 2 (from rank 1), clone 1 (e2) block 2·2 + 1 = 5; it
  // returns clone 0's gradient in block 2 (to rank 1) and clone 1's in block 5 (to rank 2).
  const Maps r0 = run_index(ce, 0, 1, 2);
  EXPECT_EQ(r0.w_send, (I{-1, -1, -1, 0, 0, -1}));
  EXPECT_EQ(r0.w_recv, (I{2, 5}));
  EXPECT_EQ(r0.g_send, (I{-1, -1, 0, -1, -1, 1}));
  EXPECT_EQ(r0.g_acc, (I{-1, -1, -1, 0, 0, -1}));  // slots 3 then 4 into e0
  // Rank 1 (e1) sends e1 to rank 0's clone 0 (block 0) and rank 2's clone 1 (block 5); its clone 1
  // (e0) reads block 0·2 + 1 = 1 and returns its gradient in block 1.
  const Maps r1 = run_index(ce, 1, 1, 2);
  EXPECT_EQ(r1.w_send, (I{0, -1, -1, -1, -1, 0}));
  EXPECT_EQ(r1.w_recv, (I{-1, 1}));
  EXPECT_EQ(r1.g_send, (I{-1, 1, -1, -1, -1, -1}));
  EXPECT_EQ(r1.g_acc, (I{0, -1, -1, -1, -1, 0}));  // slots 0 then 5 into e1
  // Rank 2 (e2) sends e2 to rank 0's clone 1 (block 1); clone 0 (e0) reads block 0, clone 1 (e1)
  // block 1·2 + 1 = 3; gradients in blocks 0 and 3.
  const Maps r2 = run_index(ce, 2, 1, 2);
  EXPECT_EQ(r2.w_send, (I{-1, 0, -1, -1, -1, -1}));
  EXPECT_EQ(r2.w_recv, (I{0, 3}));
  EXPECT_EQ(r2.g_send, (I{0, -1, -1, 1, -1, -1}));
  EXPECT_EQ(r2.g_acc, (I{-1, 0, -1, -1, -1, -1}));
  // No clones at all: every map is −1.
  const Maps none = run_index(I(6, -1), 1, 1, 2);
  EXPECT_EQ(none.w_send, I(6, -1));
  EXPECT_EQ(none.w_recv, I(2, -1));
  EXPECT_EQ(none.g_send, I(6, -1));
  EXPECT_EQ(none.g_acc, I(6, -1));
}

// ---- the gathers and the accumulation ---------------------------------------------------------------

TEST(MoeEchoExchange, GatherRowsAndUntouchedRows) {
  const Stream& cs = testing::cpu_stream();
  const int64_t G = 3, n = 2, k = 5, M = 6;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    std::vector<OwnedTensor> ex;
    std::vector<Tensor> views;
    for (int64_t g = 0; g < G; ++g) {
      ex.push_back(make_tensor(testing::randn(n * k), dt, kCpu, {n, k}, cs));
      views.push_back(ex.back().t);
    }
    GroupedWeights w(views, cs);
    auto src = make_tensor(testing::randn(G * n * k), dt, kCpu, {G, n, k}, cs);
    auto index = make_int_tensor({2, -1, 0, 2, 3, -7}, kCpu, {M}, cs);  // duplicates, −1, ≥ G, < −1
    for (int which = 0; which < 2; ++which) {
      OwnedTensor out(dt, kCpu, {M, n, k});
      testing::poison(out, cs);
      const auto before = bytes_of(out);
      if (which == 0) {
        moe_echo_gather_experts(out, w, index, cs);
      } else {
        moe_echo_gather_blocks(out, src, index, cs);
      }
      const auto after = bytes_of(out);
      const size_t bb = static_cast<size_t>(n * k) * dtype_size(dt);
      const I idx = ints(index);
      for (int64_t m = 0; m < M; ++m) {
        const int32_t g = idx[static_cast<size_t>(m)];
        const uint8_t* got = after.data() + m * bb;
        const uint8_t* want = before.data() + m * bb;  // untouched
        if (g >= 0 && g < G)
          want =
              which == 0 ? static_cast<const uint8_t*>(w[g].data()) : static_cast<const uint8_t*>(src->data()) + g * bb;
        EXPECT_EQ(std::memcmp(got, want, bb), 0) << "row " << m << " index " << g << " op " << which;
      }
    }
  }
}

TEST(MoeEchoExchange, AccumulateAddsInAscendingOrder) {
  const Stream& cs = testing::cpu_stream();
  // Expert 0 receives blocks 0, 2 and 4: 2^24, 1, −2^24. In fp32, (2^24 + 1) rounds to 2^24 (ties
  // to even), so ascending order gives 0 + 2^24 + 1 − 2^24 = 0, while 4, 2, 0 would give 1 and
  // 0, 4, 2 would give 1. Expert 1 starts at 1 and receives 2^24 (block 1) then −2^24 (block 3):
  // (1 + 2^24) − 2^24 = 0, the other way 1. Block 5 (index −1) and 6 (index 2 ≥ G) are skipped.
  const float big = 16777216.f;
  auto g0 = make_tensor({0.f, 0.f}, DType::kF32, kCpu, {1, 2}, cs);
  auto g1 = make_tensor({1.f, 3.f}, DType::kF32, kCpu, {1, 2}, cs);
  GroupedWeights grads({g0.t, g1.t}, cs);
  auto src = make_tensor({big, 0.5f, big, 0.25f, 1.f, 0.125f, -big, 0.f, -big, 0.f, 100.f, 100.f, 100.f, 100.f},
                         DType::kF32, kCpu, {7, 1, 2}, cs);
  auto index = make_int_tensor({0, 1, 0, 1, 0, -1, 2}, kCpu, {7}, cs);
  moe_echo_accumulate_experts(grads, src, index, cs);
  EXPECT_EQ(testing::to_host(g0, cs), (std::vector<float>{0.f, 0.5f + 0.125f}));
  EXPECT_EQ(testing::to_host(g1, cs), (std::vector<float>{0.f, 3.f + 0.25f}));
  // The same blocks listed in the other order (4, 3, 2, 1, 0): the sums change, so the order is
  // the index order, not the expert or value order.
  auto h0 = make_tensor({0.f, 0.f}, DType::kF32, kCpu, {1, 2}, cs);
  auto h1 = make_tensor({1.f, 3.f}, DType::kF32, kCpu, {1, 2}, cs);
  GroupedWeights grads2({h0.t, h1.t}, cs);
  auto rev = make_tensor({-big, 0.f, -big, 0.f, 1.f, 0.125f, big, 0.25f, big, 0.5f}, DType::kF32, kCpu, {5, 1, 2}, cs);
  auto rev_index = make_int_tensor({0, 1, 0, 1, 0}, kCpu, {5}, cs);
  moe_echo_accumulate_experts(grads2, rev, rev_index, cs);
  EXPECT_EQ(testing::to_host(h0, cs)[0], 1.f);  // (−2^24 + 1) + 2^24
  EXPECT_EQ(testing::to_host(h1, cs)[0], 1.f);  // (1 − 2^24) + 2^24
}

// ---- the simulated round trip ------------------------------------------------------------------------

/// Skewed random counts [ep, E] (a power law over a random expert order, some zeros).
I random_counts(int64_t ep, int64_t E, double skew) {
  auto& rng = testing::test_rng();
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int64_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  I c(static_cast<size_t>(ep * E));
  for (int64_t r = 0; r < ep; ++r)
    for (int64_t i = 0; i < E; ++i)
      c[static_cast<size_t>(r * E + order[static_cast<size_t>(i)])] =
          u(rng) < 0.05 ? 0 : static_cast<int32_t>(2000.0 * std::pow(i + 1.0, -skew) * (0.5 + u(rng)));
  return c;
}

/// A valid table that no plan need produce: each slot unused (1 in 4) or any expert not homed on
/// the slot's rank (a rank may clone one expert twice).
I random_table(int64_t P, int64_t L, int64_t S) {
  auto& rng = testing::test_rng();
  std::uniform_int_distribution<int64_t> pick(0, P * L - 1);
  std::uniform_int_distribution<int> unused(0, 3);
  I ce(static_cast<size_t>(P * S), -1);
  if (P < 2) return ce;
  for (int64_t s = 0; s < P * S; ++s) {
    if (unused(rng) == 0) continue;
    int64_t e;
    do e = pick(rng);
    while (e / L == s / S);
    ce[static_cast<size_t>(s)] = static_cast<int32_t>(e);
  }
  return ce;
}

/// Multiples of 1/8 in [−8, 8): sums of a few of them are exact in fp32, whatever the order.
std::vector<float> eighths(int64_t n) {
  const I v = testing::randint(n, -64, 64);
  std::vector<float> out(static_cast<size_t>(n));
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(v[i]) / 8.f;
  return out;
}

/// The equal-split all_to_all of P ranks over blocks of `bb` bytes, S blocks per peer:
/// send block p·S + j of rank r → receive block r·S + j of rank p.
void all_to_all(const std::vector<OwnedTensor>& send, const std::vector<OwnedTensor>& recv, int64_t S, size_t bb) {
  const auto P = static_cast<int64_t>(send.size());
  for (int64_t r = 0; r < P; ++r)
    for (int64_t p = 0; p < P; ++p)
      std::memcpy(static_cast<char*>(recv[static_cast<size_t>(p)]->data()) + r * S * bb,
                  static_cast<const char*>(send[static_cast<size_t>(r)]->data()) + p * S * bb, S * bb);
}

/// The whole exchange for one placement; returns the number of used slots.
int64_t round_trip(const I& ce, int64_t P, int64_t L, int64_t S, int64_t n, int64_t k, DType wdt) {
  const Stream& cs = testing::cpu_stream();
  const int64_t NS = P * S;
  const size_t wbb = static_cast<size_t>(n * k) * dtype_size(wdt), gbb = static_cast<size_t>(n * k) * 4;
  std::vector<Maps> maps;
  for (int64_t r = 0; r < P; ++r) maps.push_back(run_index(ce, r, L, S));

  // Weights: each rank's L experts, its send buffer, the all_to_all, its clones.
  std::vector<std::vector<OwnedTensor>> experts(static_cast<size_t>(P));
  std::vector<GroupedWeights> local;
  std::vector<OwnedTensor> send, recv, clones;
  std::vector<std::vector<uint8_t>> send_before, clones_before;
  for (int64_t r = 0; r < P; ++r) {
    std::vector<Tensor> views;
    for (int64_t l = 0; l < L; ++l) {
      experts[size_t(r)].push_back(make_tensor(testing::randn(n * k), wdt, kCpu, {n, k}, cs));
      views.push_back(experts[size_t(r)].back().t);
    }
    local.emplace_back(views, cs);
    send.emplace_back(wdt, kCpu, std::vector<int64_t>{NS, n, k});
    recv.emplace_back(wdt, kCpu, std::vector<int64_t>{NS, n, k});
    clones.emplace_back(wdt, kCpu, std::vector<int64_t>{S, n, k});
    testing::poison(send.back(), cs);
    testing::poison(clones.back(), cs);
    send_before.push_back(bytes_of(send.back()));
    clones_before.push_back(bytes_of(clones.back()));
    auto idx = make_int_tensor(maps[size_t(r)].w_send, kCpu, {NS}, cs);
    moe_echo_gather_experts(send.back(), local.back(), idx, cs);
  }
  all_to_all(send, recv, S, wbb);
  for (int64_t r = 0; r < P; ++r) {
    auto idx = make_int_tensor(maps[size_t(r)].w_recv, kCpu, {S}, cs);
    moe_echo_gather_blocks(clones[size_t(r)], recv[size_t(r)], idx, cs);
  }
  int64_t used = 0;
  for (int64_t s = 0; s < NS; ++s) {
    const int64_t r = s / S, j = s % S, e = ce[size_t(s)];
    const auto* got = static_cast<const uint8_t*>(clones[size_t(r)]->data()) + j * wbb;
    if (e < 0) {  // unused: untouched
      EXPECT_EQ(std::memcmp(got, clones_before[size_t(r)].data() + j * wbb, wbb), 0) << "unused slot " << s;
      continue;
    }
    ++used;
    const Tensor& home = experts[size_t(e / L)][size_t(e % L)].t;
    EXPECT_EQ(std::memcmp(got, home.data(), wbb), 0) << "slot " << s << " expert " << e;
  }
  for (int64_t r = 0; r < P; ++r)  // send blocks nobody reads are untouched
    for (int64_t b = 0; b < NS; ++b)
      if (maps[size_t(r)].w_send[size_t(b)] < 0) {
        EXPECT_EQ(std::memcmp(static_cast<const uint8_t*>(send[size_t(r)]->data()) + b * wbb,
                              send_before[size_t(r)].data() + b * wbb, wbb),
                  0);
      }

  // Gradients: each rank's S clone gradients [S, n, k] back to the homes' main gradients.
  std::vector<OwnedTensor> cgrad, gsend, grecv;
  std::vector<std::vector<OwnedTensor>> mains(static_cast<size_t>(P));
  std::vector<std::vector<double>> want(static_cast<size_t>(P * L));  // per global expert
  for (int64_t r = 0; r < P; ++r) {
    cgrad.push_back(make_tensor(eighths(S * n * k), DType::kF32, kCpu, {S, n, k}, cs));
    gsend.emplace_back(DType::kF32, kCpu, std::vector<int64_t>{NS, n, k});
    grecv.emplace_back(DType::kF32, kCpu, std::vector<int64_t>{NS, n, k});
    testing::poison(gsend.back(), cs);  // NaN: a block added by mistake shows
    for (int64_t l = 0; l < L; ++l) {
      const auto v = eighths(n * k);
      mains[size_t(r)].push_back(make_tensor(v, DType::kF32, kCpu, {n, k}, cs));
      want[size_t(r * L + l)].assign(v.begin(), v.end());
    }
    auto idx = make_int_tensor(maps[size_t(r)].g_send, kCpu, {NS}, cs);
    moe_echo_gather_blocks(gsend.back(), cgrad.back(), idx, cs);
  }
  for (int64_t s = 0; s < NS; ++s) {
    const int64_t e = ce[size_t(s)];
    if (e < 0) continue;
    const float* g = cgrad[size_t(s / S)]->data_as<float>() + (s % S) * n * k;
    for (int64_t i = 0; i < n * k; ++i) want[size_t(e)][size_t(i)] += g[i];
  }
  all_to_all(gsend, grecv, S, gbb);
  for (int64_t r = 0; r < P; ++r) {
    std::vector<Tensor> views;
    for (const auto& t : mains[size_t(r)]) views.push_back(t.t);
    GroupedWeights grads(views, cs);
    auto idx = make_int_tensor(maps[size_t(r)].g_acc, kCpu, {NS}, cs);
    moe_echo_accumulate_experts(grads, grecv[size_t(r)], idx, cs);
    for (int64_t l = 0; l < L; ++l) {
      const float* got = mains[size_t(r)][size_t(l)]->data_as<float>();
      const auto& w = want[size_t(r * L + l)];
      int64_t bad = 0;
      for (int64_t i = 0; i < n * k; ++i) bad += static_cast<double>(got[i]) != w[size_t(i)];
      EXPECT_EQ(bad, 0) << "rank " << r << " local expert " << l;
    }
  }
  return used;
}

TEST(MoeEchoExchange, RoundTripOnPlannedPlacements) {
  struct Case {
    int64_t P, L, S, n, k;
  };
  const std::vector<Case> cases = {{2, 2, 1, 3, 4}, {3, 2, 2, 2, 5}, {4, 2, 1, 4, 4}, {4, 3, 3, 1, 7},
                                   {5, 1, 2, 3, 3}, {8, 2, 2, 2, 8}, {8, 3, 3, 3, 2}, {8, 1, 3, 1, 1}};
  int64_t used = 0, multi = 0;
  for (const Case& c : cases)
    for (double skew : {0.8, 1.5, 2.5})
      for (DType dt : {DType::kF32, DType::kBF16}) {
        SCOPED_TRACE(testing::test_seed());
        SCOPED_TRACE(fmt::format("P={} L={} S={} skew={} {}", c.P, c.L, c.S, skew, dtype_name(dt)));
        const int64_t E = c.P * c.L;
        const I counts = random_counts(c.P, E, skew);
        const auto plan = echo::plan(std::vector<int64_t>(counts.begin(), counts.end()), c.P, E, c.S);
        const I ce(plan.clone_expert.begin(), plan.clone_expert.end());
        used += round_trip(ce, c.P, c.L, c.S, c.n, c.k, dt);
        for (int64_t e = 0; e < E; ++e) multi += std::count(ce.begin(), ce.end(), static_cast<int32_t>(e)) > 1;
      }
  EXPECT_GE(used, 40);  // the plans clone
  EXPECT_GE(multi, 1);  // some expert has several clones
}

TEST(MoeEchoExchange, RoundTripOnArbitraryTables) {
  for (int64_t P : {2, 3, 4, 8})
    for (int64_t L : {1, 2, 3})
      for (int64_t S : {1, 2, 3}) {
        SCOPED_TRACE(testing::test_seed());
        SCOPED_TRACE(fmt::format("P={} L={} S={}", P, L, S));
        round_trip(random_table(P, L, S), P, L, S, 2, 3, DType::kF32);
      }
  // Hand-made: every slot of ranks 1..3 clones expert 0 (four ranks, L = 1, S = 2).
  round_trip({-1, -1, 0, 0, 0, 0, 0, 0}, 4, 1, 2, 3, 3, DType::kF32);
  // The worked examples.
  round_trip({-1, 0, 7, 1}, 4, 2, 1, 2, 2, DType::kBF16);
  round_trip({1, 2, -1, 0, 0, 1}, 3, 1, 2, 2, 2, DType::kF32);
}

// ---- errors ---------------------------------------------------------------------------------------------

TEST(MoeEchoExchange, IndexErrors) {
  const Stream& cs = testing::cpu_stream();
  const int64_t S = 1, NS = 4;
  auto ce = make_int_tensor({-1, 0, 7, 1}, kCpu, {NS}, cs);
  OwnedTensor ws(DType::kI32, kCpu, {NS}), wr(DType::kI32, kCpu, {S}), gs(DType::kI32, kCpu, {NS}),
      ga(DType::kI32, kCpu, {NS}), wr2(DType::kI32, kCpu, {2}), ws3(DType::kI32, kCpu, {3}),
      wsf(DType::kF32, kCpu, {NS}), ws2d(DType::kI32, kCpu, {2, 2});
  EXPECT_NO_THROW(moe_echo_exchange_index(ws, wr, gs, ga, ce, 0, 2, S, cs));
  EXPECT_THROW(moe_echo_exchange_index(ws, wr, gs, ga, ce, -1, 2, S, cs), Error);   // ep_rank < 0
  EXPECT_THROW(moe_echo_exchange_index(ws, wr, gs, ga, ce, 4, 2, S, cs), Error);    // ep_rank ≥ P
  EXPECT_THROW(moe_echo_exchange_index(ws, wr, gs, ga, ce, 0, 0, S, cs), Error);    // num_local < 1
  EXPECT_THROW(moe_echo_exchange_index(ws, wr, gs, ga, ce, 0, 2, 0, cs), Error);    // num_echo < 1
  EXPECT_THROW(moe_echo_exchange_index(ws, wr, gs, ga, ce, 0, 2, 3, cs), Error);    // 4 % 3 != 0
  EXPECT_THROW(moe_echo_exchange_index(ws, wr2, gs, ga, ce, 0, 2, S, cs), Error);   // w_recv size
  EXPECT_THROW(moe_echo_exchange_index(ws3, wr, gs, ga, ce, 0, 2, S, cs), Error);   // w_send size
  EXPECT_THROW(moe_echo_exchange_index(wsf, wr, gs, ga, ce, 0, 2, S, cs), Error);   // w_send dtype
  EXPECT_THROW(moe_echo_exchange_index(ws, wr, ws2d, ga, ce, 0, 2, S, cs), Error);  // g_send 2-D
  EXPECT_THROW(moe_echo_exchange_index(ws, wr, gs, ws3, ce, 0, 2, S, cs), Error);   // g_acc size
  EXPECT_THROW(moe_echo_exchange_index(ws, wr, gs, ga, wsf, 0, 2, S, cs), Error);   // clone_expert dtype
  // Expert id 8 with 4 ranks of 2 experts.
  auto big = make_int_tensor({-1, 0, 8, 1}, kCpu, {NS}, cs);
  EXPECT_THROW(moe_echo_exchange_index(ws, wr, gs, ga, big, 0, 2, S, cs), Error);
  // Slot 2 (rank 2) holds e5, whose home is rank 2 — raised on every rank, not just rank 2.
  auto home = make_int_tensor({-1, 0, 5, 1}, kCpu, {NS}, cs);
  for (int64_t me = 0; me < 4; ++me) EXPECT_THROW(moe_echo_exchange_index(ws, wr, gs, ga, home, me, 2, S, cs), Error);
}

TEST(MoeEchoExchange, GatherAndAccumulateErrors) {
  const Stream& cs = testing::cpu_stream();
  const int64_t n = 2, k = 3;
  OwnedTensor a(DType::kF32, kCpu, {n, k}), b(DType::kF32, kCpu, {n, k}), hb(DType::kBF16, kCpu, {n, k});
  GroupedWeights w({a.t, b.t}, cs), wb({hb.t}, cs);
  auto index = make_int_tensor({1, -1, 0}, kCpu, {3}, cs);
  OwnedTensor out(DType::kF32, kCpu, {3, n, k}), out_bf(DType::kBF16, kCpu, {3, n, k}),
      out_shape(DType::kF32, kCpu, {3, k, n}), out_2d(DType::kF32, kCpu, {3, n * k}),
      out_m(DType::kF32, kCpu, {2, n, k}), src(DType::kF32, kCpu, {2, n, k}), src_2d(DType::kF32, kCpu, {2, n * k});
  OwnedTensor fidx(DType::kF32, kCpu, {3});
  auto index2d = make_int_tensor({1, -1, 0, 0}, kCpu, {2, 2}, cs);
  EXPECT_NO_THROW(moe_echo_gather_experts(out, w, index, cs));
  EXPECT_THROW(moe_echo_gather_experts(out_bf, w, index, cs), Error);              // dtype
  EXPECT_THROW(moe_echo_gather_experts(out_shape, w, index, cs), Error);           // [M, k, n]
  EXPECT_THROW(moe_echo_gather_experts(out_2d, w, index, cs), Error);              // not 3-D
  EXPECT_THROW(moe_echo_gather_experts(out_m, w, index, cs), Error);               // M != index size
  EXPECT_THROW(moe_echo_gather_experts(out, w, fidx, cs), Error);                  // index dtype
  EXPECT_THROW(moe_echo_gather_experts(out, w, index2d, cs), Error);               // index 2-D
  EXPECT_THROW(moe_echo_gather_experts(out, GroupedWeights(), index, cs), Error);  // no experts
  // out overlapping an expert: experts are views into one buffer that out also covers.
  OwnedTensor pool(DType::kF32, kCpu, {4, n, k});
  GroupedWeights wp({pool->slice0(0, 1).view({n, k}), pool->slice0(1, 2).view({n, k})}, cs);
  EXPECT_THROW(moe_echo_gather_experts(pool->slice0(1, 4), wp, index, cs), Error);
  EXPECT_NO_THROW(moe_echo_gather_experts(pool->slice0(2, 4), wp, index->slice0(0, 2), cs));

  EXPECT_NO_THROW(moe_echo_gather_blocks(out, src, index, cs));
  EXPECT_THROW(moe_echo_gather_blocks(out, src_2d, index, cs), Error);                             // src not 3-D
  EXPECT_THROW(moe_echo_gather_blocks(out_bf, src, index, cs), Error);                             // dtype
  EXPECT_THROW(moe_echo_gather_blocks(out_shape, src, index, cs), Error);                          // block shape
  EXPECT_THROW(moe_echo_gather_blocks(out_m, src, index, cs), Error);                              // M
  EXPECT_THROW(moe_echo_gather_blocks(pool->slice0(0, 3), pool->slice0(2, 4), index, cs), Error);  // overlap

  EXPECT_NO_THROW(moe_echo_accumulate_experts(w, out, index, cs));
  EXPECT_THROW(moe_echo_accumulate_experts(wb, out_bf, index, cs), Error);              // bf16 gradients
  EXPECT_THROW(moe_echo_accumulate_experts(w, out_bf, index, cs), Error);               // src dtype
  EXPECT_THROW(moe_echo_accumulate_experts(w, out_shape, index, cs), Error);            // src shape
  EXPECT_THROW(moe_echo_accumulate_experts(w, out_m, index, cs), Error);                // M
  EXPECT_THROW(moe_echo_accumulate_experts(wp, pool->slice0(1, 4), index, cs), Error);  // overlap
}

}  // namespace
}  // namespace mt
