// CUDA ECHO planner and rerouting (ops/cuda/moe_echo.cu) against the CPU reference
// (ops/cpu/moe_echo.cpp): identical integers on random counts (skewed, with exact ties, zeros,
// the worked example of moe_echo_test) for EP sizes 1..64, 1..64 local experts and 1..64 echo
// slots per rank, sources of an expert TP x EP grid (G·ep count rows), including the multi-chunk
// path of the rerouting (up to 2^19 slots) and quota rows that exceed the selection's slots. Every
// CUDA call runs twice (bitwise identical: no nondeterminism), outputs are poisoned first, and one
// test replays both ops from a captured CUDA graph with new counts (no host synchronisation inside).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/cuda_resources.h"
#include "ops/moe_echo.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::make_int_tensor;
using testing::OwnedTensor;
const Device kCpu = Device::cpu();

std::vector<int32_t> ints(const Tensor& t, const Stream& s) { return testing::to_host_ints(t, s); }

void fill_ints(const Tensor& t, int32_t v, const Stream& s) {
  std::vector<int32_t> h(static_cast<size_t>(t.numel()), v);
  copy_bytes(t.data(), t.device(), h.data(), kCpu, h.size() * 4, s);
  s.synchronize();
}

/// counts [ep, E]: per source rank, a power law over a random expert order (skew), values on a
/// coarse grid when `ties` (many exact ties), some zeros.
std::vector<int32_t> random_counts(int64_t ep, int64_t E, double skew, bool ties) {
  auto& rng = testing::test_rng();
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int64_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int32_t> c(static_cast<size_t>(ep * E));
  for (int64_t r = 0; r < ep; ++r)
    for (int64_t i = 0; i < E; ++i) {
      const double w = 2000.0 * std::pow(i + 1.0, -skew) * (0.5 + u(rng));
      int32_t v = static_cast<int32_t>(w);
      if (ties) v = (v / 50) * 50;
      if (u(rng) < 0.05) v = 0;
      c[static_cast<size_t>(r * E + order[static_cast<size_t>(i)])] = v;
    }
  return c;
}

struct PlanOut {
  std::vector<int32_t> clone_expert, clone_quota, quota;
  bool operator==(const PlanOut&) const = default;
};

// counts [G·ep, E]: G source rows per EP rank (G = the expert TP size; 1 = the EP ranks themselves).
PlanOut plan_on(Device dev, const std::vector<int32_t>& counts, int64_t ep, int64_t E, int64_t S, int64_t G = 1) {
  const Stream& st = dev.is_cpu() ? testing::cpu_stream() : testing::cuda_stream();
  auto c = make_int_tensor(counts, dev, {G * ep, E}, st);
  OwnedTensor ce(DType::kI32, dev, {ep * S}), cq(DType::kI32, dev, {ep * S}),
      q(DType::kI32, dev, {G * ep, ep * S});
  fill_ints(ce, 12345, st);
  fill_ints(cq, 12345, st);
  fill_ints(q, 12345, st);
  moe_echo_plan(ce, cq, q, c, ep, S, st);
  return {ints(ce, st), ints(cq, st), ints(q, st)};
}

TEST(MoeEchoCuda, PlanMatchesCpu) {
  MT_REQUIRE_CUDA();
  struct Case {
    int64_t ep, L, S;
  };
  const std::vector<Case> cases = {{1, 4, 1},  {2, 1, 1},   {2, 4, 2},    {4, 2, 1},  {4, 2, 2},
                                   {8, 8, 1},  {8, 8, 4},   {16, 4, 2},   {32, 8, 2}, {64, 4, 1},
                                   {64, 4, 4}, {8, 128, 8}, {64, 64, 64}, {3, 5, 7}};
  for (const Case& c : cases) {
    for (bool ties : {false, true}) {
      for (double skew : {0.3, 1.0, 2.0}) {
        const int64_t E = c.ep * c.L;
        SCOPED_TRACE(fmt::format("ep={} E={} S={} ties={} skew={}", c.ep, E, c.S, ties, skew));
        const auto counts = random_counts(c.ep, E, skew, ties);
        const PlanOut cpu = plan_on(kCpu, counts, c.ep, E, c.S);
        const PlanOut gpu = plan_on(Device::cuda(), counts, c.ep, E, c.S);
        EXPECT_EQ(gpu.clone_expert, cpu.clone_expert);
        EXPECT_EQ(gpu.clone_quota, cpu.clone_quota);
        EXPECT_EQ(gpu.quota, cpu.quota);
        EXPECT_TRUE(plan_on(Device::cuda(), counts, c.ep, E, c.S) == gpu);  // deterministic
      }
    }
  }
}

// Sources of the expert TP x EP grid (counts [G·ep, E], quota [G·ep, ep·S]: the rows of ECHO under
// expert tensor parallelism G): the same integers as the CPU.
TEST(MoeEchoCuda, PlanOverTheExpertTensorParallelGridMatchesCpu) {
  MT_REQUIRE_CUDA();
  struct Case {
    int64_t G, ep, L, S;
  };
  for (const Case& c : std::vector<Case>{{2, 2, 2, 1}, {2, 4, 2, 2}, {4, 8, 4, 2}, {2, 64, 4, 4}, {8, 16, 8, 3}}) {
    for (double skew : {0.3, 2.0}) {
      const int64_t E = c.ep * c.L;
      SCOPED_TRACE(fmt::format("G={} ep={} E={} S={} skew={}", c.G, c.ep, E, c.S, skew));
      const auto counts = random_counts(c.G * c.ep, E, skew, false);
      const PlanOut cpu = plan_on(kCpu, counts, c.ep, E, c.S, c.G);
      const PlanOut gpu = plan_on(Device::cuda(), counts, c.ep, E, c.S, c.G);
      EXPECT_EQ(gpu.clone_expert, cpu.clone_expert);
      EXPECT_EQ(gpu.clone_quota, cpu.clone_quota);
      EXPECT_EQ(gpu.quota, cpu.quota);
      EXPECT_TRUE(plan_on(Device::cuda(), counts, c.ep, E, c.S, c.G) == gpu);  // deterministic
    }
  }
}

TEST(MoeEchoCuda, PlanWorkedExampleAndEdgeCases) {
  MT_REQUIRE_CUDA();
  const std::vector<int32_t> worked = {40, 60, 25, 20, 30, 30, 25, 100, 40, 100, 25, 20, 30, 30, 25, 90,
                                       40, 40, 25, 20, 30, 30, 25, 50,  30, 40,  25, 20, 30, 30, 25, 50};
  for (int64_t S : {1, 2, 3}) EXPECT_TRUE(plan_on(Device::cuda(), worked, 4, 8, S) == plan_on(kCpu, worked, 4, 8, S));
  const auto two = plan_on(Device::cuda(), worked, 4, 8, 2);
  EXPECT_EQ(two.clone_expert, (std::vector<int32_t>{-1, -1, 1, 7, 7, -1, -1, -1}));
  EXPECT_EQ(two.clone_quota, (std::vector<int32_t>{0, 0, 90, 30, 60, 0, 0, 0}));
  // All zeros, all equal, one hot expert.
  std::vector<int32_t> hot(4 * 16, 0);
  hot[5] = 1000;
  hot[16 + 5] = 999;
  for (const auto& counts : {std::vector<int32_t>(64, 0), std::vector<int32_t>(64, 7), hot})
    for (int64_t S : {1, 2}) EXPECT_TRUE(plan_on(Device::cuda(), counts, 4, 16, S) == plan_on(kCpu, counts, 4, 16, S));
}

/// Distinct experts per token, skewed (keys u^(1/w)), ~3% dropped slots (-1).
std::vector<int32_t> random_top(int64_t T, int64_t k, int64_t E, double skew) {
  auto& rng = testing::test_rng();
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> w(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) w[static_cast<size_t>(e)] = std::pow(e + 1.0, -skew);
  std::vector<int32_t> top(static_cast<size_t>(T * k));
  std::vector<std::pair<double, int32_t>> keys(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e)
      keys[static_cast<size_t>(e)] = {std::pow(u(rng), 1.0 / w[static_cast<size_t>(e)]), static_cast<int32_t>(e)};
    std::partial_sort(keys.begin(), keys.begin() + k, keys.end(), std::greater<>());
    for (int64_t j = 0; j < k; ++j)
      top[static_cast<size_t>(t * k + j)] = u(rng) < 0.03 ? -1 : keys[static_cast<size_t>(j)].second;
  }
  return top;
}

std::vector<int32_t> reroute_on(Device dev, const std::vector<int32_t>& top, int64_t T, int64_t k,
                                const std::vector<int32_t>& ce, const std::vector<int32_t>& row, int64_t E) {
  const Stream& st = dev.is_cpu() ? testing::cpu_stream() : testing::cuda_stream();
  const auto NS = static_cast<int64_t>(ce.size());
  auto t = make_int_tensor(top, dev, {T, k}, st);
  auto c = make_int_tensor(ce, dev, {NS}, st);
  auto q = make_int_tensor(row, dev, {NS}, st);
  OwnedTensor out(DType::kI32, dev, {T, k});
  fill_ints(out, 12345, st);
  moe_echo_reroute(out, t, c, q, E, st);
  return ints(out, st);
}

TEST(MoeEchoCuda, RerouteMatchesCpu) {
  MT_REQUIRE_CUDA();
  struct Case {
    int64_t T, k, E, ep, S;
  };
  // T·k from one chunk (4096 slots) to 2^19 (128 chunks).
  const std::vector<Case> cases = {{1, 1, 4, 2, 1},        {100, 2, 8, 4, 2},     {2048, 2, 8, 4, 2},
                                   {2049, 2, 16, 8, 2},    {8192, 8, 64, 8, 4},   {16384, 8, 128, 16, 2},
                                   {65536, 8, 64, 64, 16}, {3000, 6, 256, 32, 32}};
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("T={} k={} E={} ep={} S={}", c.T, c.k, c.E, c.ep, c.S));
    const int64_t NS = c.ep * c.S;
    const auto top = random_top(c.T, c.k, c.E, 1.2);
    // A plan whose rank-0 row fits this selection: counts of rank 0 from it, other ranks random.
    auto counts = random_counts(c.ep, c.E, 1.2, false);
    std::fill(counts.begin(), counts.begin() + c.E, 0);
    for (int32_t e : top)
      if (e >= 0) ++counts[static_cast<size_t>(e)];
    const PlanOut p = plan_on(kCpu, counts, c.ep, c.E, c.S);
    const std::vector<int32_t> row(p.quota.begin(), p.quota.begin() + NS);
    const auto cpu = reroute_on(kCpu, top, c.T, c.k, p.clone_expert, row, c.E);
    const auto gpu = reroute_on(Device::cuda(), top, c.T, c.k, p.clone_expert, row, c.E);
    EXPECT_EQ(gpu, cpu);
    EXPECT_EQ(reroute_on(Device::cuda(), top, c.T, c.k, p.clone_expert, row, c.E), gpu);
    // Arbitrary clone tables: several clones per expert, quotas from 0 to beyond the slots, ids
    // outside [0, E).
    std::vector<int32_t> ce(static_cast<size_t>(NS)), q(static_cast<size_t>(NS));
    const auto e_of = testing::randint(NS, -2, static_cast<int32_t>(std::min<int64_t>(c.E, 6)));
    const auto q_of = testing::randint(NS, -1, static_cast<int32_t>(c.T * c.k / 4 + 2));
    for (int64_t s = 0; s < NS; ++s) {
      ce[static_cast<size_t>(s)] =
          e_of[static_cast<size_t>(s)] == -2 ? static_cast<int32_t>(c.E + 3) : e_of[static_cast<size_t>(s)];
      q[static_cast<size_t>(s)] = q_of[static_cast<size_t>(s)];
    }
    EXPECT_EQ(reroute_on(Device::cuda(), top, c.T, c.k, ce, q, c.E), reroute_on(kCpu, top, c.T, c.k, ce, q, c.E));
  }
}

// Both ops captured once in a CUDA graph and replayed with counts and a selection changed in place:
// the replay gives the CPU's results for the new inputs.
TEST(MoeEchoCuda, CapturedGraphReplaysWithNewCounts) {
  MT_REQUIRE_CUDA();
  const Stream& gs = testing::cuda_stream();
  const int64_t ep = 8, E = 32, S = 2, NS = ep * S, T = 3000, k = 4;
  auto counts = random_counts(ep, E, 1.0, false);
  auto top = random_top(T, k, E, 1.0);
  auto c = make_int_tensor(counts, Device::cuda(), {ep, E}, gs);
  auto t = make_int_tensor(top, Device::cuda(), {T, k}, gs);
  OwnedTensor ce(DType::kI32, Device::cuda(), {NS}), cq(DType::kI32, Device::cuda(), {NS}),
      q(DType::kI32, Device::cuda(), {ep, NS}), out(DType::kI32, Device::cuda(), {T, k});
  const auto step = [&] {
    moe_echo_plan(ce, cq, q, c, ep, S, gs);
    moe_echo_reroute(out, t, ce, q->slice0(0, 1).view({NS}), E, gs);
  };
  step();  // warm-up outside the capture (kernel attributes)
  gs.synchronize();
  cudaStream_t s = gs.cuda()->stream;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  step();
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int rep = 0; rep < 2; ++rep) {
    counts = random_counts(ep, E, 1.5, rep == 1);
    top = random_top(T, k, E, 1.5);
    std::fill(counts.begin(), counts.begin() + E, 0);
    for (int32_t e : top)
      if (e >= 0) ++counts[static_cast<size_t>(e)];
    copy_bytes(c->data(), Device::cuda(), counts.data(), kCpu, counts.size() * 4, gs);
    copy_bytes(t->data(), Device::cuda(), top.data(), kCpu, top.size() * 4, gs);
    fill_ints(out, 12345, gs);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    const PlanOut want = plan_on(kCpu, counts, ep, E, S);
    EXPECT_EQ(ints(ce, gs), want.clone_expert);
    EXPECT_EQ(ints(q, gs), want.quota);
    const std::vector<int32_t> row(want.quota.begin(), want.quota.begin() + NS);
    EXPECT_EQ(ints(out, gs), reroute_on(kCpu, top, T, k, want.clone_expert, row, E));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST(MoeEchoCuda, Limits) {
  MT_REQUIRE_CUDA();
  const Stream& gs = testing::cuda_stream();
  auto c = make_int_tensor(std::vector<int32_t>(8192, 1), Device::cuda(), {1, 8192}, gs);
  OwnedTensor ce(DType::kI32, Device::cuda(), {1}), cq(DType::kI32, Device::cuda(), {1}),
      q(DType::kI32, Device::cuda(), {1, 1});
  EXPECT_THROW(moe_echo_plan(ce, cq, q, c, 1, 1, gs), Error);  // E > 4096
}

// The virtual expert ids: the CUDA kernel equals the CPU on random ids (home experts, clone
// slots, dropped slots), in place and out of place.
TEST(MoeEchoVirtualExpertsCuda, MatchesCpu) {
  auto& rng = testing::test_rng();
  for (const auto& [E, ep, S, n] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{8, 4, 1, 1000},
                                    {64, 8, 3, 1 << 17}, {4096, 64, 2, 5000}}) {
    std::uniform_int_distribution<int32_t> id(-1, static_cast<int32_t>(E + ep * S - 1));
    std::vector<int32_t> in(static_cast<size_t>(n));
    for (auto& v : in) v = id(rng);
    const Stream cs(kCpu), gs(Device::cuda());
    OwnedTensor a = make_int_tensor(in, kCpu, {n}, cs), b(DType::kI32, kCpu, {n});
    moe_echo_virtual_experts(b.t, a.t, E, ep, S, cs);
    OwnedTensor ga = make_int_tensor(in, Device::cuda(), {n}, gs), gb(DType::kI32, Device::cuda(), {n});
    moe_echo_virtual_experts(gb.t, ga.t, E, ep, S, gs);
    const std::vector<int32_t> want = ints(b.t, cs);
    EXPECT_EQ(ints(gb.t, gs), want) << "E " << E << " ep " << ep << " S " << S;
    moe_echo_virtual_experts(ga.t, ga.t, E, ep, S, gs);
    EXPECT_EQ(ints(ga.t, gs), want) << "in place";
  }
}

}  // namespace
}  // namespace mt
