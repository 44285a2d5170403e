// CUDA index maps of the static-buffer MoE dispatch (ops/cuda/moe_block.cu) against the CPU
// reference (ops/cpu/moe_block.cpp): identical integers (and the identical fp32 overflow counter)
// on random selections with dropped slots and idle experts, up to 4096 experts, 2^19 slots and 64
// destinations, blocks of 0 rows, overflowing blocks and blocks with room to spare; received
// layouts up to 64 sources and 2^19 received rows; the documented clipping of overfull blocks on
// the receive side (CUDA cannot raise). Every CUDA call runs twice on poisoned outputs and must give
// the same result, and one test captures both ops in a CUDA graph and replays it with new inputs
// written in place (capture fails on any host synchronisation).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/cuda_resources.h"
#include "ops/moe.h"
#include "ops/moe_block.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::make_int_tensor;
using testing::make_tensor;
using testing::OwnedTensor;
using I = std::vector<int32_t>;
const Device kCpu = Device::cpu();

const Stream& stream_of(Device dev) { return dev.is_cpu() ? testing::cpu_stream() : testing::cuda_stream(); }

I ints(const Tensor& t, const Stream& s) {
  I out(static_cast<size_t>(t.numel()));
  copy_bytes(out.data(), kCpu, t.data(), t.device(), out.size() * 4, s);
  s.synchronize();
  return out;
}

void put_ints(const Tensor& t, const I& h, const Stream& s) {
  copy_bytes(t.data(), t.device(), h.data(), kCpu, h.size() * 4, s);
  s.synchronize();
}

void fill_ints(const Tensor& t, int32_t v, const Stream& s) { put_ints(t, I(static_cast<size_t>(t.numel()), v), s); }

/// top [N, k]: distinct experts per token, skewed towards low ids (e = Ev · u^3, so the high ids
/// are often idle), each slot dropped (-1) with probability `drop`. Rejection sampling: fast for
/// thousands of experts.
I random_top(int64_t N, int64_t k, int64_t Ev, double drop) {
  auto& rng = testing::test_rng();
  std::uniform_real_distribution<double> u(0.0, 1.0);
  I top(static_cast<size_t>(N * k));
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < k; ++j) {
      int32_t e;
      bool taken;
      do {
        e = static_cast<int32_t>(std::min<double>(static_cast<double>(Ev) - 1, static_cast<double>(Ev) * std::pow(u(rng), 3.0)));
        taken = std::find(top.begin() + t * k, top.begin() + t * k + j, e) != top.begin() + t * k + j;
      } while (taken);
      top[static_cast<size_t>(t * k + j)] = e;
    }
  for (auto& e : top)
    if (u(rng) < drop) e = -1;
  return top;
}

struct Routing {
  I row_index, counts;
};
/// The routing map over all experts on the CPU (the dispatcher's moe_routing_map_device).
Routing route(const I& top, int64_t N, int64_t k, int64_t Ev) {
  const Stream& s = testing::cpu_stream();
  auto t = make_int_tensor(top, kCpu, {N, k}, s);
  OwnedTensor ri(DType::kI32, kCpu, {N * k}), sr(DType::kI32, kCpu, {N * k}), c(DType::kI32, kCpu, {Ev});
  moe_routing_map_device(ri, sr, c, t, 0, Ev, s);
  return {ints(ri, s), ints(c, s)};
}

struct SendOut {
  I send_index, slot_send, sent;
  float overflow = 0.f;
  bool operator==(const SendOut&) const = default;
};

SendOut send_on(Device dev, const Routing& r, int64_t D, int64_t B, float overflow0) {
  const Stream& s = stream_of(dev);
  const auto n = static_cast<int64_t>(r.row_index.size()), Ev = static_cast<int64_t>(r.counts.size());
  auto ri = make_int_tensor(r.row_index, dev, {n}, s);
  auto c = make_int_tensor(r.counts, dev, {Ev}, s);
  auto of = make_tensor({overflow0}, DType::kF32, dev, {1}, s);
  OwnedTensor si(DType::kI32, dev, {D * B}), ss(DType::kI32, dev, {n}), sent(DType::kI32, dev, {Ev});
  fill_ints(si, 12345, s);
  fill_ints(ss, 12345, s);
  fill_ints(sent, 12345, s);
  moe_block_send_layout(si, ss, sent, of, c, ri, D, B, s);
  return {ints(si, s), ints(ss, s), ints(sent, s), testing::to_host(of, s)[0]};
}

struct RecvOut {
  I gather, scatter, local_counts;
  bool operator==(const RecvOut&) const = default;
};

RecvOut recv_on(Device dev, const I& sent_all, int64_t C, int64_t Ev, int64_t first, int64_t L, int64_t B) {
  const Stream& s = stream_of(dev);
  auto sa = make_int_tensor(sent_all, dev, {C, Ev}, s);
  OwnedTensor g(DType::kI32, dev, {C * B}), sc(DType::kI32, dev, {C * B}), lc(DType::kI32, dev, {L});
  fill_ints(g, 12345, s);
  fill_ints(sc, 12345, s);
  fill_ints(lc, 12345, s);
  moe_block_receive_layout(g, sc, lc, sa, first, L, B, s);
  return {ints(g, s), ints(sc, s), ints(lc, s)};
}

/// sent_all [C, Ev] as C sources of D = C destinations with Lv experts each would send: per
/// (source, destination) at most B rows (exactly B when `full`), split at random over the
/// destination's experts, many of them 0.
I random_sent_all(int64_t C, int64_t Lv, int64_t B, bool full) {
  auto& rng = testing::test_rng();
  const int64_t Ev = C * Lv;
  I sa(static_cast<size_t>(C * Ev), 0);
  for (int64_t s = 0; s < C; ++s)
    for (int64_t m = 0; m < C; ++m) {
      int64_t left = full ? B : std::uniform_int_distribution<int64_t>(0, B)(rng);
      for (int64_t i = 0; i < Lv && left > 0; ++i) {
        const int64_t v = i + 1 == Lv ? left : std::uniform_int_distribution<int64_t>(0, left / 2)(rng);
        sa[static_cast<size_t>(s * Ev + m * Lv + i)] = static_cast<int32_t>(v);
        left -= v;
      }
    }
  return sa;
}

TEST(MoeBlockCuda, SendLayoutMatchesCpu) {
  MT_REQUIRE_CUDA();
  struct Case {
    int64_t N, k, Ev, D;
  };
  const Case cases[] = {{1, 1, 1, 1},      {0, 2, 8, 4},       {100, 2, 8, 2},     {1000, 4, 64, 8},
                        {2049, 2, 48, 3},   {4096, 8, 256, 64}, {30000, 6, 4096, 1}, {65536, 8, 4096, 64},
                        {20000, 8, 1024, 16}};
  for (const Case& c : cases) {
    const I top = random_top(c.N, c.k, c.Ev, 0.05);
    const Routing r = route(top, c.N, c.k, c.Ev);
    const int64_t Lv = c.Ev / c.D;
    int64_t max_run = 0, routed = 0;
    for (int64_t m = 0; m < c.D; ++m) {
      const int64_t run = std::accumulate(r.counts.begin() + m * Lv, r.counts.begin() + (m + 1) * Lv, int64_t{0});
      max_run = std::max(max_run, run);
      routed += run;
    }
    const int64_t mean = routed / c.D;
    for (int64_t B : {int64_t{0}, int64_t{1}, mean / 2 + 1, mean + 1, max_run, max_run + 3}) {
      SCOPED_TRACE(fmt::format("N={} k={} Ev={} D={} B={} (mean run {}, max run {})", c.N, c.k, c.Ev, c.D, B, mean,
                               max_run));
      const float of0 = 0.375f + static_cast<float>(B);
      const SendOut cpu = send_on(kCpu, r, c.D, B, of0);
      const SendOut gpu = send_on(Device::cuda(), r, c.D, B, of0);
      EXPECT_EQ(gpu.send_index, cpu.send_index);
      EXPECT_EQ(gpu.slot_send, cpu.slot_send);
      EXPECT_EQ(gpu.sent, cpu.sent);
      EXPECT_EQ(gpu.overflow, cpu.overflow);
      EXPECT_TRUE(send_on(Device::cuda(), r, c.D, B, of0) == gpu);  // deterministic
    }
  }
}

TEST(MoeBlockCuda, ReceiveLayoutMatchesCpu) {
  MT_REQUIRE_CUDA();
  struct Case {
    int64_t C, Lv, B;
  };
  const Case cases[] = {{1, 1, 0},    {1, 1, 7},     {2, 3, 5},       {8, 16, 300},  {64, 1, 1},
                        {3, 1365, 1000}, {1, 4096, 100000}, {64, 64, 8192}, {16, 256, 33}, {64, 2, 0}};
  for (const Case& c : cases) {
    const int64_t Ev = c.C * c.Lv;
    for (bool full : {false, true}) {
      const I sa = random_sent_all(c.C, c.Lv, c.B, full);
      for (int64_t m : {int64_t{0}, c.C / 2, c.C - 1}) {
        SCOPED_TRACE(fmt::format("C={} Lv={} B={} full={} rank={}", c.C, c.Lv, c.B, full, m));
        const RecvOut cpu = recv_on(kCpu, sa, c.C, Ev, m * c.Lv, c.Lv, c.B);
        const RecvOut gpu = recv_on(Device::cuda(), sa, c.C, Ev, m * c.Lv, c.Lv, c.B);
        EXPECT_EQ(gpu.local_counts, cpu.local_counts);
        EXPECT_EQ(gpu.gather, cpu.gather);
        EXPECT_EQ(gpu.scatter, cpu.scatter);
        EXPECT_TRUE(recv_on(Device::cuda(), sa, c.C, Ev, m * c.Lv, c.Lv, c.B) == gpu);  // deterministic
      }
    }
  }
}

// The CPU raises on an overfull block or a negative entry; CUDA clips as documented: negative
// entries count as 0 and each block's rows stop at B, i.e. the CPU's result for the clipped counts.
TEST(MoeBlockCuda, ReceiveLayoutClipsOverfullBlocks) {
  MT_REQUIRE_CUDA();
  const int64_t C = 8, Lv = 6, Ev = C * Lv, B = 20;
  for (int rep = 0; rep < 4; ++rep) {
    I sa = random_sent_all(C, Lv, 2 * B, false);  // up to twice the block
    for (size_t i = 0; i < sa.size(); i += 7) sa[i] = -3;
    for (int64_t m = 0; m < C; ++m) {
      SCOPED_TRACE(fmt::format("rep={} rank={}", rep, m));
      I clipped = sa;
      for (int64_t s = 0; s < C; ++s) {
        int64_t run = 0, kept = 0;
        for (int64_t i = 0; i < Lv; ++i) {
          auto& v = clipped[static_cast<size_t>(s * Ev + m * Lv + i)];
          run += std::max(0, v);
          const int64_t end = std::min(run, B);
          v = static_cast<int32_t>(end - kept);
          kept = end;
        }
      }
      EXPECT_TRUE(recv_on(Device::cuda(), sa, C, Ev, m * Lv, Lv, B) == recv_on(kCpu, clipped, C, Ev, m * Lv, Lv, B));
    }
  }
}

// Both ops captured once in a CUDA graph, replayed with a new selection's counts and row_index and
// new sent_all written in place: each replay gives the CPU's maps for the new inputs, and the
// overflow counter accumulates over the replays.
TEST(MoeBlockCuda, CapturedGraphReplaysWithNewInputs) {
  MT_REQUIRE_CUDA();
  const Stream& gs = testing::cuda_stream();
  const int64_t N = 3000, k = 4, Ev = 64, D = 8, Lv = Ev / D, B = 200, first = 3 * Lv;
  Routing r = route(random_top(N, k, Ev, 0.05), N, k, Ev);
  I sa = random_sent_all(D, Lv, B, false);
  auto ri = make_int_tensor(r.row_index, Device::cuda(), {N * k}, gs);
  auto c = make_int_tensor(r.counts, Device::cuda(), {Ev}, gs);
  auto sat = make_int_tensor(sa, Device::cuda(), {D, Ev}, gs);
  auto of = make_tensor({0.5f}, DType::kF32, Device::cuda(), {1}, gs);
  OwnedTensor si(DType::kI32, Device::cuda(), {D * B}), ss(DType::kI32, Device::cuda(), {N * k}),
      sent(DType::kI32, Device::cuda(), {Ev}), g(DType::kI32, Device::cuda(), {D * B}),
      sc(DType::kI32, Device::cuda(), {D * B}), lc(DType::kI32, Device::cuda(), {Lv});
  const auto step = [&] {
    moe_block_send_layout(si, ss, sent, of, c, ri, D, B, gs);
    moe_block_receive_layout(g, sc, lc, sat, first, Lv, B, gs);
  };
  step();  // warm-up outside the capture
  gs.synchronize();
  cudaStream_t s = gs.cuda()->stream;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  step();
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess) << "the ops synchronised with the host";
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  testing::upload(of, {0.25f}, gs);
  float want_overflow = 0.25f;
  for (int rep = 0; rep < 3; ++rep) {
    SCOPED_TRACE(fmt::format("replay {}", rep));
    r = route(random_top(N, k, Ev, rep == 1 ? 0.0 : 0.2), N, k, Ev);
    sa = random_sent_all(D, Lv, B, rep == 2);
    put_ints(ri, r.row_index, gs);
    put_ints(c, r.counts, gs);
    put_ints(sat, sa, gs);
    for (const Tensor* t : {&si.t, &ss.t, &sent.t, &g.t, &sc.t, &lc.t}) fill_ints(*t, 12345, gs);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    const SendOut want = send_on(kCpu, r, D, B, want_overflow);
    want_overflow = want.overflow;
    EXPECT_EQ(ints(si, gs), want.send_index);
    EXPECT_EQ(ints(ss, gs), want.slot_send);
    EXPECT_EQ(ints(sent, gs), want.sent);
    EXPECT_EQ(testing::to_host(of, gs)[0], want.overflow);
    const RecvOut rwant = recv_on(kCpu, sa, D, Ev, first, Lv, B);
    EXPECT_EQ(ints(g, gs), rwant.gather);
    EXPECT_EQ(ints(sc, gs), rwant.scatter);
    EXPECT_EQ(ints(lc, gs), rwant.local_counts);
  }
  EXPECT_GT(want_overflow, 0.25f);  // some replay overflowed (B = 200 < the ~1,500 slots per destination)
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

}  // namespace
}  // namespace mt
