// ECHO planner and rerouting (ops/moe_echo.h) on the CPU: the worked numbers of the planner's
// description (gen_intermediate's spillover and spare capacities, one_shot_greedy_assignment, the
// 8-expert assignment, the 30/50/20 source split of 80 and 83 tokens), a whole plan worked out by
// hand, properties of plans and reroutings of random skewed selections over simulated EP ranks
// (quotas add up and respect the sources, clones stay within spare capacity and never sit on the
// home rank, every rank's load afterwards is at most max(avg, its load before), every routed slot
// lands at its home expert or a clone exactly as the quotas say), plans over the sources of an
// expert TP x EP grid (worked by hand, and random: the placement of the ETP-summed counts, the
// quotas split over every source in proportion), and the documented errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "ops/moe_echo.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::make_int_tensor;
using testing::OwnedTensor;
using V = std::vector<int64_t>;
const Device kCpu = Device::cpu();

std::vector<int32_t> ints(const Tensor& t) { return {t.data_as<int32_t>(), t.data_as<int32_t>() + t.numel()}; }
V wide(const std::vector<int32_t>& v) { return {v.begin(), v.end()}; }

// ---- the description's worked numbers -------------------------------------------------------------

TEST(MoeEcho, SpilloverOfOneRank) {
  // Sorted [50, 100, 150, 200], avg 250: cumsum [50, 150, 300, 500] - 250, clamped [0, 0, 50, 250],
  // difference [0, 0, 50, 200] (Σ = 250 = the rank's excess, not the 262.5 of per-expert excesses).
  EXPECT_EQ(echo::spillover({50, 100, 150, 200}, 250), (V{0, 0, 50, 200}));
  // Unsorted input: sorted first, so the light experts keep their tokens; original order back.
  EXPECT_EQ(echo::spillover({200, 50, 150, 100}, 250), (V{200, 0, 50, 0}));
  EXPECT_EQ(echo::spillover({10, 20}, 100), (V{0, 0}));
  // Ties: the lower index is taken first (keeps its tokens).
  EXPECT_EQ(echo::spillover({60, 60}, 100), (V{0, 20}));
}

TEST(MoeEcho, SpareCapacityPerRank) {
  // The description's picture: loads [500, 200, 300, 400], avg 350 -> spare [0, 150, 50, 0],
  // spillover 150 and 50 (one expert per rank).
  const auto im = echo::gen_intermediate({500, 200, 300, 400}, 4);
  EXPECT_EQ(im.avg, 350);
  EXPECT_EQ(im.load, (V{500, 200, 300, 400}));
  EXPECT_EQ(im.spare, (V{0, 150, 50, 0}));
  EXPECT_EQ(im.spill, (V{150, 0, 0, 50}));
  // Floor division: loads 500 and 503, avg 501; rank 1's excess 2 comes from its last expert in
  // ascending order (150 and 150 tie: expert 7 comes after expert 6).
  const auto im2 = echo::gen_intermediate({50, 100, 150, 200, 100, 103, 150, 150}, 2);
  EXPECT_EQ(im2.avg, 501);
  EXPECT_EQ(im2.spare, (V{1, 0}));
  EXPECT_EQ(im2.spill, (V{0, 0, 0, 0, 0, 0, 0, 2}));
  const auto im3 = echo::gen_intermediate({50, 100, 150, 200, 1, 1, 1, 0}, 2);
  EXPECT_EQ(im3.avg, 251);
  EXPECT_EQ(im3.spare, (V{0, 248}));
  EXPECT_EQ(im3.spill, (V{0, 0, 49, 200, 0, 0, 0, 0}));
}

TEST(MoeEcho, OneShotGreedyAssignment) {
  // chunks [100, 150] = [0,100), [100,250); buckets [80, 120] = [0,80), [80,200). The
  // description's matrix prints [[80, 0], [0, 100]], but its own formula (min of the ends minus max
  // of the starts, clamped) gives chunk 0 ∩ bucket 1 = [80,100) = 20: [[80, 20], [0, 100]], which
  // fills both buckets (200 = Σ buckets ≤ Σ chunks). The formula is what the code computes.
  EXPECT_EQ(echo::one_shot_greedy_assignment({100, 150}, {80, 120}), (V{80, 20, 0, 100}));
  // The 8-expert example, sorted: spillovers [100, 80, 50, 30, 0, 0, 0, 0] into [120, 60, 0, 0].
  const V a = echo::one_shot_greedy_assignment({100, 80, 50, 30, 0, 0, 0, 0}, {120, 60, 0, 0});
  V want(32, 0);
  want[0] = 100;           // chunk 0 -> bucket 0
  want[4] = 20;            // chunk 1 -> bucket 0
  want[5] = 60;            // chunk 1 -> bucket 1
  EXPECT_EQ(a, want);      // chunks 2, 3 (230 - 180 = 80 tokens) find no capacity
}

TEST(MoeEcho, AssignmentInExpertAndRankOrder) {
  // spillovers [0, 80, 0, 0, 50, 100, 0, 30] over experts, spare [0, 120, 60, 0] over EP ranks:
  // sorted [100 (e5), 80 (e1), 50 (e4), 30 (e7)] into [120 (r1), 60 (r2)].
  const V a = echo::assignment({0, 80, 0, 0, 50, 100, 0, 30}, {0, 120, 60, 0});
  V want(32, 0);
  want[5 * 4 + 1] = 100;
  want[1 * 4 + 1] = 20;
  want[1 * 4 + 2] = 60;
  EXPECT_EQ(a, want);
  // Ties: the lower expert and the lower rank first.
  EXPECT_EQ(echo::assignment({30, 30}, {0, 40, 40}), (V{0, 30, 0, 0, 10, 20}));
}

TEST(MoeEcho, SplitQuotaOverSources) {
  // Sources 30 / 50 / 20 of one expert, a clone of 80: proportional floors 24 / 40 / 16, exact.
  EXPECT_EQ(echo::split_quota({30, 50, 20}, {80}), (V{24, 40, 16}));
  // 83: floors [24.9, 41.5, 16.6] -> 24 / 41 / 16 = 81; the remaining 2 from the leftovers
  // [6, 9, 4] in rank order: EP0 gives both -> 26 / 41 / 16.
  EXPECT_EQ(echo::split_quota({30, 50, 20}, {83}), (V{26, 41, 16}));
  // Two clones of one expert: floors [24, 41, 16] and [3, 5, 2] (need 2 and 0), leftovers
  // [3, 4, 2]: 83's remainder [0, 2) from EP0.
  EXPECT_EQ(echo::split_quota({30, 50, 20}, {83, 10}), (V{26, 3, 41, 5, 16, 2}));
  // Leftovers exhausted in rank order: everything taken.
  EXPECT_EQ(echo::split_quota({1, 1, 1}, {3}), (V{1, 1, 1}));
  EXPECT_EQ(echo::split_quota({3, 0, 5}, {7}), (V{3, 0, 4}));  // floors 2 / 0 / 4, +1 from EP0
}

// A 4-rank, 8-expert example worked by hand. Expert totals [150, 240, 100, 80, 120, 120, 100, 290]:
// loads [390, 180, 240, 390], avg 300, spare [0, 120, 60, 0]; spillover e1 = 90 (rank 0: sorted
// [150, 240], cumsum [150, 390] - 300 -> [0, 90]) and e7 = 90 (rank 3: [100, 290]); sorted chunks
// e1 [0, 90), e7 [90, 180); buckets r1 [0, 120), r2 [120, 180): A[e1, r1] = 90, A[e7, r1] = 30,
// A[e7, r2] = 60.
const std::vector<int32_t> kCounts = {
    // e0  e1   e2  e3  e4  e5  e6   e7      source rank
    40, 60, 25, 20, 30, 30, 25, 100,  // 0
    40, 100, 25, 20, 30, 30, 25, 90,  // 1
    40, 40, 25, 20, 30, 30, 25, 50,   // 2
    30, 40, 25, 20, 30, 30, 25, 50,   // 3
};

struct PlanOut {
  std::vector<int32_t> clone_expert, clone_quota, quota;
};

// counts [G·ep, E]: G source rows per EP rank (G = the expert TP size; 1 = the EP ranks themselves).
PlanOut run_plan(const std::vector<int32_t>& counts, int64_t ep, int64_t E, int64_t S, int64_t G = 1) {
  const Stream& cs = testing::cpu_stream();
  const int64_t R = G * ep;
  auto c = make_int_tensor(counts, kCpu, {R, E}, cs);
  OwnedTensor ce(DType::kI32, kCpu, {ep * S}), cq(DType::kI32, kCpu, {ep * S}), q(DType::kI32, kCpu, {R, ep * S});
  std::fill_n(ce->data_as<int32_t>(), ep * S, 777);  // poison
  std::fill_n(cq->data_as<int32_t>(), ep * S, 777);
  std::fill_n(q->data_as<int32_t>(), R * ep * S, 777);
  moe_echo_plan(ce, cq, q, c, ep, S, cs);
  return {ints(ce), ints(cq), ints(q)};
}

TEST(MoeEcho, PlanWorkedExampleOneEchoSlot) {
  const PlanOut p = run_plan(kCounts, 4, 8, 1);
  // Rank 1's one slot takes e1 (90 > 30: e7's 30 stay home), rank 2's takes e7 (60).
  EXPECT_EQ(p.clone_expert, (std::vector<int32_t>{-1, 1, 7, -1}));
  EXPECT_EQ(p.clone_quota, (std::vector<int32_t>{0, 90, 60, 0}));
  // e1 (sources 60 / 100 / 40 / 40 of 240) -> 90: floors 22 / 37 / 15 / 15 = 89, +1 from rank 0.
  // e7 (100 / 90 / 50 / 50 of 290) -> 60: floors 20 / 18 / 10 / 10 = 58, +2 from rank 0.
  EXPECT_EQ(p.quota, (std::vector<int32_t>{0, 23, 22, 0,  //
                                           0, 37, 18, 0,  //
                                           0, 15, 10, 0,  //
                                           0, 15, 10, 0}));
}

TEST(MoeEcho, PlanWorkedExampleTwoEchoSlots) {
  const PlanOut p = run_plan(kCounts, 4, 8, 2);
  // Rank 1: e1 (90) then e7 (30); rank 2: e7 (60), one slot unused.
  EXPECT_EQ(p.clone_expert, (std::vector<int32_t>{-1, -1, 1, 7, 7, -1, -1, -1}));
  EXPECT_EQ(p.clone_quota, (std::vector<int32_t>{0, 0, 90, 30, 60, 0, 0, 0}));
  // e7's clones in slot order, 30 then 60: floors [10, 9, 5, 5] (need 1) and [20, 18, 10, 10]
  // (need 2); leftovers [70, 63, 35, 35]: both remainders from rank 0.
  EXPECT_EQ(p.quota, (std::vector<int32_t>{0, 0, 23, 11, 22, 0, 0, 0,  //
                                           0, 0, 37, 9, 18, 0, 0, 0,   //
                                           0, 0, 15, 5, 10, 0, 0, 0,   //
                                           0, 0, 15, 5, 10, 0, 0, 0}));
  // Loads afterwards: 390 - 90, 180 + 120, 240 + 60, 390 - 90: all at the average.
}

TEST(MoeEcho, PlanBalancedLoadHasNoClones) {
  const PlanOut p = run_plan(std::vector<int32_t>(16, 5), 2, 8, 2);
  EXPECT_EQ(p.clone_expert, (std::vector<int32_t>{-1, -1, -1, -1}));
  EXPECT_EQ(p.clone_quota, (std::vector<int32_t>(4, 0)));
  EXPECT_EQ(p.quota, (std::vector<int32_t>(8, 0)));
  const PlanOut z = run_plan(std::vector<int32_t>(16, 0), 4, 4, 1);  // no tokens at all
  EXPECT_EQ(z.clone_expert, (std::vector<int32_t>(4, -1)));
}

// Expert tensor parallelism 2 over EP 2 (E = 4, L = 2, S = 1): the sources are the four ranks of
// the grid, row i·ep + j = ETP rank i of EP rank j. Totals [100, 40, 20, 20] (e0 from the rows
// 41 / 29 / 20 / 10), loads [140, 40], avg 90: e0 spills 50 into rank 1's spare 50. The split runs
// over all four sources: floors 20 / 14 / 10 / 5 = 49, the remaining 1 from row 0's leftover.
TEST(MoeEcho, PlanWorkedExampleOverTheExpertTensorParallelGrid) {
  const std::vector<int32_t> grid = {41, 10, 5, 5,   // ETP 0, EP 0
                                     29, 10, 5, 5,   // ETP 0, EP 1
                                     20, 10, 5, 5,   // ETP 1, EP 0
                                     10, 10, 5, 5};  // ETP 1, EP 1
  const PlanOut p = run_plan(grid, 2, 4, 1, /*G=*/2);
  EXPECT_EQ(p.clone_expert, (std::vector<int32_t>{-1, 0}));
  EXPECT_EQ(p.clone_quota, (std::vector<int32_t>{0, 50}));
  EXPECT_EQ(p.quota, (std::vector<int32_t>{0, 21,  //
                                           0, 14,  //
                                           0, 10,  //
                                           0, 5}));
  // The placement is that of the counts summed over each EP rank's ETP ranks; only the split differs.
  const PlanOut summed = run_plan({61, 20, 10, 10, 39, 20, 10, 10}, 2, 4, 1);
  EXPECT_EQ(summed.clone_expert, p.clone_expert);
  EXPECT_EQ(summed.clone_quota, p.clone_quota);
  EXPECT_EQ(summed.quota, (std::vector<int32_t>{0, 31, 0, 19}));  // floors 30 / 19, +1 from EP 0
}

// Random counts of G·ep sources: the placement equals the plan of the counts summed over each EP
// rank's G rows; every clone's quota is split over all G·ep sources, proportionally (at least each
// source's floor) and within each source's tokens; the op equals the pure-function plan.
TEST(MoeEcho, PlanOverTheExpertTensorParallelGridProperties) {
  auto& rng = testing::test_rng();
  std::uniform_int_distribution<int32_t> small(0, 20);
  std::uniform_int_distribution<int32_t> hot(50, 400);
  struct GridCase {
    int64_t G, ep, L, S;
  };
  int64_t plans_with_clones = 0;
  for (const GridCase& c : std::vector<GridCase>{{2, 2, 2, 1}, {2, 4, 2, 2}, {4, 4, 1, 1}, {2, 8, 2, 3}, {3, 3, 2, 2}})
    for (int rep = 0; rep < 4; ++rep) {
      const int64_t G = c.G, ep = c.ep, E = ep * c.L, S = c.S, NS = ep * S, R = G * ep;
      SCOPED_TRACE(testing::test_seed());
      SCOPED_TRACE(fmt::format("G={} ep={} E={} S={} rep={}", G, ep, E, S, rep));
      std::vector<int32_t> grid(static_cast<size_t>(R * E));
      for (int64_t r = 0; r < R; ++r)  // expert e hot on a few sources: the ETP rows differ
        for (int64_t e = 0; e < E; ++e)
          grid[static_cast<size_t>(r * E + e)] = (r + e + rep) % 3 == 0 && e < E / 2 + 1 ? hot(rng) : small(rng);
      std::vector<int32_t> summed(static_cast<size_t>(ep * E), 0);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t e = 0; e < E; ++e)
          summed[static_cast<size_t>((r % ep) * E + e)] += grid[static_cast<size_t>(r * E + e)];
      const PlanOut p = run_plan(grid, ep, E, S, G);
      const PlanOut ps = run_plan(summed, ep, E, S);
      EXPECT_EQ(p.clone_expert, ps.clone_expert);
      EXPECT_EQ(p.clone_quota, ps.clone_quota);
      const echo::Plan ref = echo::plan(wide(grid), ep, E, S);
      EXPECT_EQ(wide(p.quota), ref.quota);
      EXPECT_EQ(p.quota.size(), static_cast<size_t>(R * NS));
      plans_with_clones += std::any_of(p.clone_expert.begin(), p.clone_expert.end(), [](int32_t e) { return e >= 0; });
      V tok(static_cast<size_t>(E), 0);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t e = 0; e < E; ++e) tok[static_cast<size_t>(e)] += grid[static_cast<size_t>(r * E + e)];
      for (int64_t s = 0; s < NS; ++s) {
        const int32_t e = p.clone_expert[static_cast<size_t>(s)];
        const int64_t q = p.clone_quota[static_cast<size_t>(s)];
        int64_t col = 0;
        for (int64_t r = 0; r < R; ++r) {
          const int64_t v = p.quota[static_cast<size_t>(r * NS + s)];
          col += v;
          if (e < 0) continue;
          const int64_t floor = grid[static_cast<size_t>(r * E + e)] * q / tok[static_cast<size_t>(e)];
          EXPECT_GE(v, floor) << "slot " << s << " source " << r;
        }
        EXPECT_EQ(col, q) << "slot " << s;
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t e = 0; e < E; ++e) {
          int64_t taken = 0;
          for (int64_t s = 0; s < NS; ++s)
            if (p.clone_expert[static_cast<size_t>(s)] == e) taken += p.quota[static_cast<size_t>(r * NS + s)];
          EXPECT_LE(taken, grid[static_cast<size_t>(r * E + e)]) << "source " << r << " expert " << e;
        }
    }
  EXPECT_GE(plans_with_clones, 10);
}

// ---- rerouting ------------------------------------------------------------------------------------

std::vector<int32_t> run_reroute(const std::vector<int32_t>& top, int64_t T, int64_t k,
                                 const std::vector<int32_t>& clone_expert, const std::vector<int32_t>& quota_row,
                                 int64_t E) {
  const Stream& cs = testing::cpu_stream();
  const auto NS = static_cast<int64_t>(clone_expert.size());
  auto t = make_int_tensor(top, kCpu, {T, k}, cs);
  auto ce = make_int_tensor(clone_expert, kCpu, {NS}, cs);
  auto q = make_int_tensor(quota_row, kCpu, {NS}, cs);
  OwnedTensor out(DType::kI32, kCpu, {T, k});
  std::fill_n(out->data_as<int32_t>(), T * k, 777);
  moe_echo_reroute(out, t, ce, q, E, cs);
  return ints(out);
}

TEST(MoeEcho, RerouteFirstSlotsInTokenOrder) {
  // E = 4; clones: slot 0 of expert 2 (quota 2), slot 1 unused, slot 2 of expert 2 (quota 1),
  // slot 3 of expert 0 (quota 5, more than the 2 slots of expert 0: both go).
  const std::vector<int32_t> top = {2, 1,   //
                                    0, 2,   //
                                    -1, 2,  //
                                    3, 2,   //
                                    2, 0,   //
                                    1, 3};
  const auto out = run_reroute(top, 6, 2, {2, -1, 2, 0}, {2, 0, 1, 5}, 4);
  EXPECT_EQ(out, (std::vector<int32_t>{4, 1,   //
                                       7, 4,   //
                                       -1, 6,  //
                                       3, 2,   //
                                       2, 7,   //
                                       1, 3}));
  // No clones: a copy.
  EXPECT_EQ(run_reroute(top, 6, 2, {-1, -1}, {0, 0}, 4), top);
  // A quota of 0 sends nothing; the next clone of the expert takes over.
  const auto skip = run_reroute(top, 6, 2, {2, 2}, {0, 3}, 4);
  EXPECT_EQ(skip, (std::vector<int32_t>{5, 1, 0, 5, -1, 5, 3, 2, 2, 0, 1, 3}));
}

// Skewed random selections of `ep` ranks (distinct experts per token, a few dropped slots):
// weighted sampling without replacement (keys u^(1/w)), weights from a power law over a random
// expert order, so that some experts and ranks are hot.
std::vector<std::vector<int32_t>> random_selections(int64_t ep, int64_t T, int64_t k, int64_t E, double skew) {
  auto& rng = testing::test_rng();
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int64_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<double> w(static_cast<size_t>(E));
  for (int64_t i = 0; i < E; ++i) w[static_cast<size_t>(order[static_cast<size_t>(i)])] = std::pow(i + 1.0, -skew);
  std::vector<std::vector<int32_t>> tops(static_cast<size_t>(ep));
  for (auto& top : tops) {
    top.resize(static_cast<size_t>(T * k));
    std::vector<std::pair<double, int32_t>> keys(static_cast<size_t>(E));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e)
        keys[static_cast<size_t>(e)] = {std::pow(u(rng), 1.0 / w[static_cast<size_t>(e)]), static_cast<int32_t>(e)};
      std::partial_sort(keys.begin(), keys.begin() + k, keys.end(), std::greater<>());
      for (int64_t j = 0; j < k; ++j)
        top[static_cast<size_t>(t * k + j)] = u(rng) < 0.03 ? -1 : keys[static_cast<size_t>(j)].second;
    }
  }
  return tops;
}

struct Case {
  int64_t ep, L, S, T, k;
  double skew;
};

// Plans from the counts of simulated ranks' selections, each rank's selection rerouted by its row:
// the invariants of docs/echo.md.
TEST(MoeEcho, PlanAndRerouteProperties) {
  const std::vector<Case> cases = {{2, 2, 1, 64, 2, 1.0},  {4, 2, 1, 50, 2, 1.2},  {4, 2, 2, 50, 2, 1.2},
                                   {4, 4, 2, 33, 3, 2.0},  {8, 1, 1, 40, 2, 1.5},  {8, 2, 2, 40, 4, 1.0},
                                   {8, 4, 1, 25, 2, 0.5},  {3, 3, 2, 47, 2, 1.7},  {8, 2, 16, 40, 2, 1.3},
                                   {1, 4, 2, 20, 2, 1.0},  {16, 1, 2, 30, 1, 1.1}};
  int64_t plans_with_clones = 0, multi_clone_experts = 0;
  for (const Case& c : cases) {
    for (int rep = 0; rep < 3; ++rep) {
      const int64_t ep = c.ep, L = c.L, E = ep * L, S = c.S, NS = ep * S, T = c.T, k = std::min(c.k, E);
      SCOPED_TRACE(testing::test_seed());
      SCOPED_TRACE(fmt::format("ep={} L={} S={} T={} k={} rep={}", ep, L, S, T, k, rep));
      const auto tops = random_selections(ep, T, k, E, c.skew);
      std::vector<int32_t> counts(static_cast<size_t>(ep * E), 0);
      for (int64_t r = 0; r < ep; ++r)
        for (int32_t e : tops[static_cast<size_t>(r)])
          if (e >= 0) ++counts[static_cast<size_t>(r * E + e)];
      const PlanOut p = run_plan(counts, ep, E, S);
      // The op equals the pure-function plan.
      const echo::Plan ref = echo::plan(wide(counts), ep, E, S);
      EXPECT_EQ(wide(p.clone_expert), ref.clone_expert);
      EXPECT_EQ(wide(p.clone_quota), ref.clone_quota);
      EXPECT_EQ(wide(p.quota), ref.quota);

      V tok(static_cast<size_t>(E), 0);
      for (int64_t r = 0; r < ep; ++r)
        for (int64_t e = 0; e < E; ++e) tok[static_cast<size_t>(e)] += counts[static_cast<size_t>(r * E + e)];
      const auto im = echo::gen_intermediate(tok, ep);
      V cloned(static_cast<size_t>(E), 0), received(static_cast<size_t>(ep), 0), sent(static_cast<size_t>(ep), 0);
      for (int64_t s = 0; s < NS; ++s) {
        const int32_t e = p.clone_expert[static_cast<size_t>(s)];
        const int64_t q = p.clone_quota[static_cast<size_t>(s)], p_rank = s / S;
        int64_t col = 0;
        for (int64_t r = 0; r < ep; ++r) {
          const int64_t v = p.quota[static_cast<size_t>(r * NS + s)];
          EXPECT_GE(v, 0);
          col += v;
        }
        EXPECT_EQ(col, q) << "slot " << s;  // Σ_src quota == clone quota
        if (e < 0) {
          EXPECT_EQ(q, 0);
          continue;
        }
        EXPECT_GT(q, 0);
        EXPECT_NE(e / L, p_rank) << "a clone on its home rank";
        if (s % S > 0) {  // a rank's clones: descending quotas, distinct experts
          EXPECT_LE(q, p.clone_quota[static_cast<size_t>(s - 1)]);
          for (int64_t s2 = p_rank * S; s2 < s; ++s2) EXPECT_NE(p.clone_expert[static_cast<size_t>(s2)], e);
        }
        cloned[static_cast<size_t>(e)] += q;
        received[static_cast<size_t>(p_rank)] += q;
        sent[static_cast<size_t>(e / L)] += q;
      }
      plans_with_clones += std::any_of(p.clone_expert.begin(), p.clone_expert.end(), [](int32_t e) { return e >= 0; });
      for (int64_t e = 0; e < E; ++e) {
        multi_clone_experts += std::count(p.clone_expert.begin(), p.clone_expert.end(), static_cast<int32_t>(e)) > 1;
        EXPECT_LE(cloned[static_cast<size_t>(e)], im.spill[static_cast<size_t>(e)]) << "expert " << e;
        for (int64_t r = 0; r < ep; ++r) {  // per source: Σ over e's clones ≤ the source's tokens
          int64_t taken = 0;
          for (int64_t s = 0; s < NS; ++s)
            if (p.clone_expert[static_cast<size_t>(s)] == e) taken += p.quota[static_cast<size_t>(r * NS + s)];
          EXPECT_LE(taken, counts[static_cast<size_t>(r * E + e)]);
        }
      }
      int64_t total_received = 0, total_spare = 0;
      for (int64_t r = 0; r < ep; ++r) {
        EXPECT_LE(received[static_cast<size_t>(r)], im.spare[static_cast<size_t>(r)]) << "rank " << r;
        const int64_t before = im.load[static_cast<size_t>(r)];
        const int64_t after = before - sent[static_cast<size_t>(r)] + received[static_cast<size_t>(r)];
        EXPECT_LE(after, std::max(im.avg, before)) << "rank " << r;
        total_received += received[static_cast<size_t>(r)];
        total_spare += im.spare[static_cast<size_t>(r)];
      }
      // With a slot for every expert nothing is dropped: all spare capacity is used (Σ spill ≥ Σ spare).
      if (S >= E) EXPECT_EQ(total_received, total_spare);

      // Reroute every rank's selection by its row: each clone gets exactly its quota from each
      // source, the first slots of the expert in token order; the rest stays.
      V at(static_cast<size_t>(E + NS), 0);
      for (int64_t r = 0; r < ep; ++r) {
        const auto& top = tops[static_cast<size_t>(r)];
        const std::vector<int32_t> row(p.quota.begin() + r * NS, p.quota.begin() + (r + 1) * NS);
        const auto out = run_reroute(top, T, k, p.clone_expert, row, E);
        std::vector<int64_t> seen_home(static_cast<size_t>(E), 0);  // slots of e kept so far
        V got(static_cast<size_t>(NS), 0);
        for (size_t i = 0; i < top.size(); ++i) {
          const int32_t e = top[i], o = out[i];
          if (e < 0) {
            EXPECT_EQ(o, e);
            continue;
          }
          if (o == e) {
            ++seen_home[static_cast<size_t>(e)];
          } else {
            ASSERT_GE(o, E);
            ASSERT_LT(o, E + NS);
            EXPECT_EQ(p.clone_expert[static_cast<size_t>(o - E)], e);
            EXPECT_EQ(seen_home[static_cast<size_t>(e)], 0) << "a rerouted slot after a kept one";
            ++got[static_cast<size_t>(o - E)];
          }
          ++at[static_cast<size_t>(o)];
        }
        for (int64_t s = 0; s < NS; ++s) EXPECT_EQ(got[static_cast<size_t>(s)], row[static_cast<size_t>(s)]);
      }
      for (int64_t e = 0; e < E; ++e)
        EXPECT_EQ(at[static_cast<size_t>(e)], tok[static_cast<size_t>(e)] - cloned[static_cast<size_t>(e)]);
      for (int64_t s = 0; s < NS; ++s)
        EXPECT_EQ(at[static_cast<size_t>(E + s)], p.clone_quota[static_cast<size_t>(s)]);
    }
  }
  // The random cases exercise the planner: most plans clone, some experts have several clones.
  EXPECT_GE(plans_with_clones, 25);
  EXPECT_GE(multi_clone_experts, 3);
}

// ---- errors ---------------------------------------------------------------------------------------

TEST(MoeEcho, Errors) {
  const Stream& cs = testing::cpu_stream();
  auto counts = make_int_tensor(kCounts, kCpu, {4, 8}, cs);
  OwnedTensor ce(DType::kI32, kCpu, {4}), cq(DType::kI32, kCpu, {4}), q(DType::kI32, kCpu, {4, 4});
  EXPECT_NO_THROW(moe_echo_plan(ce, cq, q, counts, 4, 1, cs));
  EXPECT_THROW(moe_echo_plan(ce, cq, q, counts, 4, 0, cs), Error);  // num_echo < 1
  EXPECT_THROW(moe_echo_plan(ce, cq, q, counts, 4, 2, cs), Error);  // shapes of another num_echo
  auto odd = make_int_tensor(std::vector<int32_t>(24, 1), kCpu, {3, 8}, cs);  // 8 % 3 != 0
  OwnedTensor ce3(DType::kI32, kCpu, {3}), cq3(DType::kI32, kCpu, {3}), q3(DType::kI32, kCpu, {3, 3});
  EXPECT_THROW(moe_echo_plan(ce3, cq3, q3, odd, 3, 1, cs), Error);
  OwnedTensor qf(DType::kF32, kCpu, {4, 4});
  EXPECT_THROW(moe_echo_plan(ce, cq, qf, counts, 4, 1, cs), Error);  // dtype
  OwnedTensor qt(DType::kI32, kCpu, {2, 8});
  EXPECT_THROW(moe_echo_plan(ce, cq, qt, counts, 4, 1, cs), Error);  // quota not [ep, NS]
  std::vector<int32_t> neg = kCounts;
  neg[5] = -1;
  auto negt = make_int_tensor(neg, kCpu, {4, 8}, cs);
  EXPECT_THROW(moe_echo_plan(ce, cq, q, negt, 4, 1, cs), Error);  // negative counts (CPU)
  EXPECT_THROW(moe_echo_plan(ce, cq, q, counts, 0, 1, cs), Error);  // ep < 1
  // sources of a grid: a multiple of ep rows, quota [rows, NS]
  auto grid = make_int_tensor(std::vector<int32_t>(48, 1), kCpu, {6, 8}, cs);
  OwnedTensor q6(DType::kI32, kCpu, {6, 4}), ce2(DType::kI32, kCpu, {2}), cq2(DType::kI32, kCpu, {2}),
      q62(DType::kI32, kCpu, {6, 2});
  EXPECT_THROW(moe_echo_plan(ce, cq, q6, grid, 4, 1, cs), Error);  // 6 rows over 4 EP ranks
  EXPECT_NO_THROW(moe_echo_plan(ce2, cq2, q62, grid, 2, 1, cs));   // 3 rows per EP rank
  EXPECT_THROW(moe_echo_plan(ce2, cq2, q, counts, 2, 1, cs), Error);  // quota [4, 4], not [4, 2]
  EXPECT_THROW(echo::plan(V(24, 1), 2, 8, 1), Error);  // 24 counts: not a multiple of ep·E = 16

  auto top = make_int_tensor({0, 1, 2, 3}, kCpu, {2, 2}, cs);
  OwnedTensor out(DType::kI32, kCpu, {2, 2}), row(DType::kI32, kCpu, {4}), row3(DType::kI32, kCpu, {3});
  std::fill_n(ce->data_as<int32_t>(), 4, -1);
  std::fill_n(row->data_as<int32_t>(), 4, 0);
  EXPECT_NO_THROW(moe_echo_reroute(out, top, ce, row, 4, cs));
  EXPECT_THROW(moe_echo_reroute(top, top, ce, row, 4, cs), Error);   // aliasing
  EXPECT_THROW(moe_echo_reroute(out, top, ce, row3, 4, cs), Error);  // row size
  EXPECT_THROW(moe_echo_reroute(out, top, ce, row, 0, cs), Error);   // num_experts
  OwnedTensor out41(DType::kI32, kCpu, {4, 1});
  EXPECT_THROW(moe_echo_reroute(out41, top, ce, row, 4, cs), Error);  // shape

  EXPECT_THROW(echo::split_quota({1, 2}, {4}), Error);  // more than the sources hold
  EXPECT_THROW(echo::gen_intermediate({1, 2, 3}, 2), Error);
}

// The virtual expert ids of the alltoall dispatch: 4 EP ranks of 2 experts and 1 spare slot each
// lay out as rank 0 [e0 e1 s0], rank 1 [e2 e3 s1], ... = ids 0..11.
TEST(MoeEchoVirtualExperts, RankMajorLayout) {
  const Stream st(Device::cpu());
  const std::vector<int32_t> in = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, -1};
  const std::vector<int32_t> want = {0, 1, 3, 4, 6, 7, 9, 10, 2, 5, 8, 11, -1};
  testing::OwnedTensor a(DType::kI32, Device::cpu(), {13}), b(DType::kI32, Device::cpu(), {13});
  std::copy(in.begin(), in.end(), a.t.data_as<int32_t>());
  moe_echo_virtual_experts(b.t, a.t, 8, 4, 1, st);
  EXPECT_EQ(std::vector<int32_t>(b.t.data_as<int32_t>(), b.t.data_as<int32_t>() + 13), want);
  // two spare slots per rank: rank r holds [e2r, e2r+1, s2r, s2r+1]
  moe_echo_virtual_experts(b.t, a.t, 8, 4, 2, st);
  const std::vector<int32_t> want2 = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10};  // ids 8..11 = slots 0..3
  EXPECT_EQ(std::vector<int32_t>(b.t.data_as<int32_t>(), b.t.data_as<int32_t>() + 12),
            std::vector<int32_t>(want2.begin(), want2.begin() + 12));
  moe_echo_virtual_experts(a.t, a.t, 8, 4, 1, st);  // in place
  EXPECT_EQ(std::vector<int32_t>(a.t.data_as<int32_t>(), a.t.data_as<int32_t>() + 13), want);
  a.t.data_as<int32_t>()[3] = 12;  // beyond E + ep·S
  EXPECT_THROW(moe_echo_virtual_experts(b.t, a.t, 8, 4, 1, st), Error);
  EXPECT_THROW(moe_echo_virtual_experts(b.t, a.t, 8, 3, 1, st), Error);  // 8 % 3
  EXPECT_THROW(moe_echo_virtual_experts(b.t, a.t, 8, 4, 0, st), Error);  // S < 1
}

}  // namespace
}  // namespace mt
