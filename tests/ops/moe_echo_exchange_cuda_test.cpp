// CUDA ECHO exchange ops (ops/cuda/moe_echo_exchange.cu) against the CPU reference
// (ops/cpu/moe_echo_exchange.cpp): the block maps on planned and arbitrary placements for every
// rank (P·S up to 5120 slots, several blocks of threads; ids outside [0, P·L) act as unused), the
// gathers bitwise for fp32 / bf16 / fp16 with every unit width (experts at offsets that make the
// addresses 2-, 4-, 8- or 16-byte aligned, block sizes that are and are not multiples of 16
// bytes) and the accumulation bitwise (float4 and scalar paths, several blocks per expert, skipped
// entries). Every CUDA call runs twice with the same result; outputs start from the same random
// bytes on both backends, so untouched rows are compared too. One test captures a whole simulated
// exchange of 4 ranks (the maps, the gathers, the all_to_alls as fixed block copies, the
// accumulation) in a CUDA graph and replays it with new clone_expert tables.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "ops/moe_echo.h"
#include "ops/moe_echo_exchange.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::make_int_tensor;
using testing::OwnedTensor;
using I = std::vector<int32_t>;
using Bytes = std::vector<uint8_t>;
const Device kCpu = Device::cpu();

const Stream& stream_of(Device d) { return d.is_cpu() ? testing::cpu_stream() : testing::cuda_stream(); }

Bytes bytes_of(const Tensor& t, const Stream& s) {
  Bytes out(t.nbytes());
  copy_bytes(out.data(), kCpu, t.data(), t.device(), out.size(), s);
  s.synchronize();
  return out;
}

I ints(const Tensor& t, const Stream& s) {
  I out(static_cast<size_t>(t.numel()));
  copy_bytes(out.data(), kCpu, t.data(), t.device(), out.size() * 4, s);
  s.synchronize();
  return out;
}

void fill_ints(const Tensor& t, int32_t v, const Stream& s) {
  const I h(static_cast<size_t>(t.numel()), v);
  copy_bytes(t.data(), t.device(), h.data(), kCpu, h.size() * 4, s);
  s.synchronize();
}

/// A view of `shape` at element offset `off` of a flat pool.
Tensor at(const OwnedTensor& pool, int64_t off, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return pool->flat_range(off, n).view(shape);
}

// ---- the maps ---------------------------------------------------------------------------------------

struct Maps {
  I w_send, w_recv, g_send, g_acc;
  bool operator==(const Maps&) const = default;
};

Maps maps_on(Device dev, const I& ce, int64_t me, int64_t L, int64_t S) {
  const Stream& st = stream_of(dev);
  const auto NS = static_cast<int64_t>(ce.size());
  auto c = make_int_tensor(ce, dev, {NS}, st);
  OwnedTensor ws(DType::kI32, dev, {NS}), wr(DType::kI32, dev, {S}), gs(DType::kI32, dev, {NS}),
      ga(DType::kI32, dev, {NS});
  for (const OwnedTensor* t : {&ws, &wr, &gs, &ga}) fill_ints(*t, 12345, st);
  moe_echo_exchange_index(ws, wr, gs, ga, c, me, L, S, st);
  return {ints(ws, st), ints(wr, st), ints(gs, st), ints(ga, st)};
}

/// Skewed random counts [ep, E] (power law over a random expert order).
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

I planned_table(int64_t P, int64_t L, int64_t S, double skew) {
  const I counts = random_counts(P, P * L, skew);
  const auto plan = echo::plan(std::vector<int64_t>(counts.begin(), counts.end()), P, P * L, S);
  return I(plan.clone_expert.begin(), plan.clone_expert.end());
}

/// Each slot unused (1 in 4) or any expert not homed on the slot's rank.
I random_table(int64_t P, int64_t L, int64_t S) {
  auto& rng = testing::test_rng();
  std::uniform_int_distribution<int64_t> pick(0, P * L - 1);
  std::uniform_int_distribution<int> unused(0, 3);
  I ce(static_cast<size_t>(P * S), -1);
  for (int64_t s = 0; s < P * S && P >= 2; ++s) {
    if (unused(rng) == 0) continue;
    int64_t e;
    do e = pick(rng);
    while (e / L == s / S);
    ce[static_cast<size_t>(s)] = static_cast<int32_t>(e);
  }
  return ce;
}

TEST(MoeEchoExchangeCuda, IndexMatchesCpu) {
  MT_REQUIRE_CUDA();
  struct Case {
    int64_t P, L, S;
  };
  const std::vector<Case> cases = {{2, 1, 1},  {4, 2, 1},   {3, 1, 2},    {8, 2, 3}, {16, 4, 2},
                                   {64, 2, 4}, {64, 4, 64}, {128, 2, 40}, {5, 3, 7}};
  auto& rng = testing::test_rng();
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("P={} L={} S={}", c.P, c.L, c.S));
    const int64_t E = c.P * c.L, NS = c.P * c.S;
    for (int kind = 0; kind < 3; ++kind) {
      const I ce = kind == 0 ? planned_table(c.P, c.L, c.S, 1.5) : random_table(c.P, c.L, c.S);
      // kind 2: some ids made invalid (≥ E or < −1); CUDA treats them as unused, so the CPU's
      // answer on the table with −1 there is the reference.
      I dev_ce = ce, ref_ce = ce;
      if (kind == 2) {
        std::uniform_int_distribution<int64_t> slot(0, NS - 1);
        for (int i = 0; i < 1 + NS / 8; ++i) {
          const auto s = static_cast<size_t>(slot(rng));
          dev_ce[s] = i % 2 == 0 ? static_cast<int32_t>(E + i) : -5;
          ref_ce[s] = -1;
        }
      }
      // Every rank for the small cases; a sample for the large ones.
      std::vector<int64_t> ranks;
      for (int64_t r = 0; r<c.P; r += c.P> 16 ? 7 : 1) ranks.push_back(r);
      ranks.push_back(c.P - 1);
      for (int64_t me : ranks) {
        const Maps cpu = maps_on(kCpu, ref_ce, me, c.L, c.S);
        const Maps gpu = maps_on(Device::cuda(), dev_ce, me, c.L, c.S);
        EXPECT_EQ(gpu.w_send, cpu.w_send) << "kind " << kind << " rank " << me;
        EXPECT_EQ(gpu.w_recv, cpu.w_recv) << "kind " << kind << " rank " << me;
        EXPECT_EQ(gpu.g_send, cpu.g_send) << "kind " << kind << " rank " << me;
        EXPECT_EQ(gpu.g_acc, cpu.g_acc) << "kind " << kind << " rank " << me;
        EXPECT_TRUE(maps_on(Device::cuda(), dev_ce, me, c.L, c.S) == gpu);  // twice
      }
    }
  }
}

// ---- the gathers --------------------------------------------------------------------------------------

struct GatherCase {
  DType dt;
  int64_t G, n, k, M;
  int64_t off_out, off_src, gap;  // element offsets of out and of the sources; gap between experts
};

/// gather_experts (which == 0) or gather_blocks (which == 1) on `dev`: the bytes of out, which
/// starts from `init`.
Bytes gather_on(Device dev, const GatherCase& c, int which, const std::vector<float>& src_vals,
                const std::vector<float>& init, const I& index) {
  const Stream& st = stream_of(dev);
  const int64_t nk = c.n * c.k;
  OwnedTensor src_pool(c.dt, dev, {c.off_src + c.G * (nk + c.gap) + 1}),
      out_pool(c.dt, dev, {c.off_out + c.M * nk + 1});
  const Tensor out = at(out_pool, c.off_out, {c.M, c.n, c.k});
  testing::upload(out, init, st);
  auto idx = make_int_tensor(index, dev, {c.M}, st);
  if (which == 0) {
    std::vector<Tensor> experts;
    for (int64_t g = 0; g < c.G; ++g) {
      experts.push_back(at(src_pool, c.off_src + g * (nk + c.gap), {c.n, c.k}));
      testing::upload(experts.back(), std::vector<float>(src_vals.begin() + g * nk, src_vals.begin() + (g + 1) * nk),
                      st);
    }
    GroupedWeights w(experts, st);
    moe_echo_gather_experts(out, w, idx, st);
  } else {
    const Tensor src = at(src_pool, c.off_src, {c.G, c.n, c.k});
    testing::upload(src, src_vals, st);
    moe_echo_gather_blocks(out, src, idx, st);
  }
  return bytes_of(out, st);
}

TEST(MoeEchoExchangeCuda, GatherMatchesCpu) {
  MT_REQUIRE_CUDA();
  using D = DType;
  // Units: 16 bytes (aligned, n·k·size % 16 == 0), 8, 4, 2 (bf16 at odd offsets), and the widest
  // unit bounded by the block size (fp32 [3, 5]: 60 bytes → 4; bf16 [1, 3]: 6 bytes → 2).
  const std::vector<GatherCase> cases = {
      {D::kF32, 4, 16, 24, 6, 0, 0, 0},     {D::kBF16, 3, 64, 128, 8, 0, 0, 0},  {D::kF16, 5, 32, 40, 12, 0, 0, 0},
      {D::kF32, 4, 16, 24, 6, 2, 0, 2},     {D::kF32, 4, 16, 24, 6, 1, 3, 0},    {D::kBF16, 3, 8, 16, 5, 1, 0, 0},
      {D::kBF16, 3, 8, 16, 5, 0, 1, 1},     {D::kF16, 2, 1, 3, 7, 0, 0, 0},      {D::kF32, 3, 3, 5, 4, 0, 0, 0},
      {D::kBF16, 8, 256, 384, 24, 0, 0, 8}, {D::kF32, 16, 128, 96, 40, 4, 4, 4}, {D::kF32, 1, 1, 1, 3, 0, 0, 0}};
  for (const GatherCase& c : cases) {
    SCOPED_TRACE(fmt::format("{} G={} n={} k={} M={} offsets {} {} gap {}", dtype_name(c.dt), c.G, c.n, c.k, c.M,
                             c.off_out, c.off_src, c.gap));
    const auto src_vals = testing::randn(c.G * c.n * c.k);
    const auto init = testing::randn(c.M * c.n * c.k);
    // Duplicates, −1, < −1 and ≥ G entries.
    const I index = testing::randint(c.M, -2, static_cast<int32_t>(c.G + 2));
    for (int which = 0; which < 2; ++which) {
      const Bytes cpu = gather_on(kCpu, c, which, src_vals, init, index);
      const Bytes gpu = gather_on(Device::cuda(), c, which, src_vals, init, index);
      EXPECT_TRUE(gpu == cpu) << (which == 0 ? "gather_experts" : "gather_blocks");
      EXPECT_TRUE(gather_on(Device::cuda(), c, which, src_vals, init, index) == gpu) << "twice";
    }
  }
}

// gather_blocks copies any dtype: int32 and uint8 blocks (the 1-byte unit: a 7-byte block).
TEST(MoeEchoExchangeCuda, GatherBlocksOfOtherDtypes) {
  MT_REQUIRE_CUDA();
  auto& rng = testing::test_rng();
  for (const auto& [dt, G, n, k, M] : {std::tuple<DType, int64_t, int64_t, int64_t, int64_t>{DType::kU8, 3, 1, 7, 5},
                                       {DType::kU8, 4, 16, 32, 9},
                                       {DType::kI32, 5, 3, 4, 6}}) {
    SCOPED_TRACE(fmt::format("{} G={} n={} k={} M={}", dtype_name(dt), G, n, k, M));
    const size_t es = dtype_size(dt);
    Bytes src_b(static_cast<size_t>(G * n * k) * es), init_b(static_cast<size_t>(M * n * k) * es);
    for (auto& b : src_b) b = static_cast<uint8_t>(rng());
    for (auto& b : init_b) b = static_cast<uint8_t>(rng());
    const I index = testing::randint(M, -1, static_cast<int32_t>(G + 1));
    std::vector<Bytes> got;
    for (Device dev : {kCpu, Device::cuda(), Device::cuda()}) {
      const Stream& st = stream_of(dev);
      OwnedTensor src(dt, dev, {G, n, k}), out(dt, dev, {M, n, k});
      copy_bytes(src->data(), dev, src_b.data(), kCpu, src_b.size(), st);
      copy_bytes(out->data(), dev, init_b.data(), kCpu, init_b.size(), st);
      auto idx = make_int_tensor(index, dev, {M}, st);
      moe_echo_gather_blocks(out, src, idx, st);
      got.push_back(bytes_of(out, st));
    }
    EXPECT_TRUE(got[1] == got[0]);
    EXPECT_TRUE(got[2] == got[1]) << "twice";
  }
}

// ---- the accumulation -----------------------------------------------------------------------------------

struct AccCase {
  int64_t G, n, k, M;
  int64_t off_src, gap;
};

/// The bytes of the G gradients after the accumulation on `dev`, from `grad_vals`.
Bytes accumulate_on(Device dev, const AccCase& c, const std::vector<float>& grad_vals,
                    const std::vector<float>& src_vals, const I& index) {
  const Stream& st = stream_of(dev);
  const int64_t nk = c.n * c.k;
  OwnedTensor grad_pool(DType::kF32, dev, {c.G * (nk + c.gap) + 1}),
      src_pool(DType::kF32, dev, {c.off_src + c.M * nk + 1});
  std::vector<Tensor> grads;
  for (int64_t g = 0; g < c.G; ++g) {
    grads.push_back(at(grad_pool, g * (nk + c.gap), {c.n, c.k}));
    testing::upload(grads.back(), std::vector<float>(grad_vals.begin() + g * nk, grad_vals.begin() + (g + 1) * nk), st);
  }
  GroupedWeights w(grads, st);
  const Tensor src = at(src_pool, c.off_src, {c.M, c.n, c.k});
  testing::upload(src, src_vals, st);
  auto idx = make_int_tensor(index, dev, {c.M}, st);
  moe_echo_accumulate_experts(w, src, idx, st);
  Bytes out;
  for (const Tensor& g : grads) {
    const Bytes b = bytes_of(g, st);
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

TEST(MoeEchoExchangeCuda, AccumulateMatchesCpu) {
  MT_REQUIRE_CUDA();
  // float4 path (aligned, n·k % 4 == 0), and scalar paths: an odd gap between the gradients, src at
  // an offset, n·k odd. Many blocks for few experts (the sums run over several m per element).
  const std::vector<AccCase> cases = {{2, 16, 32, 8, 0, 0},    {4, 64, 96, 32, 0, 4}, {3, 16, 32, 12, 0, 1},
                                      {3, 16, 32, 12, 1, 0},   {5, 7, 9, 20, 0, 0},   {1, 1, 1, 5, 0, 0},
                                      {8, 256, 512, 64, 0, 0}, {2, 33, 65, 16, 3, 5}};
  for (const AccCase& c : cases) {
    SCOPED_TRACE(fmt::format("G={} n={} k={} M={} off {} gap {}", c.G, c.n, c.k, c.M, c.off_src, c.gap));
    // Values with a wide range of magnitudes, so that the summation order shows in the bits.
    auto grad_vals = testing::randn(c.G * c.n * c.k);
    auto src_vals = testing::randn(c.M * c.n * c.k);
    const auto scale = testing::randint(c.M * c.n * c.k, -12, 12);
    for (size_t i = 0; i < src_vals.size(); ++i) src_vals[i] = std::ldexp(src_vals[i], scale[i]);
    const I index = testing::randint(c.M, -1, static_cast<int32_t>(c.G + 1));  // −1 and G are skipped
    const Bytes cpu = accumulate_on(kCpu, c, grad_vals, src_vals, index);
    const Bytes gpu = accumulate_on(Device::cuda(), c, grad_vals, src_vals, index);
    EXPECT_TRUE(gpu == cpu);
    EXPECT_TRUE(accumulate_on(Device::cuda(), c, grad_vals, src_vals, index) == gpu) << "twice";
  }
}

TEST(MoeEchoExchangeCuda, DeviceErrors) {
  MT_REQUIRE_CUDA();
  const Stream& gs = testing::cuda_stream();
  const Stream& cs = testing::cpu_stream();
  auto ce = make_int_tensor({-1, 0, 7, 1}, Device::cuda(), {4}, gs);
  OwnedTensor ws(DType::kI32, Device::cuda(), {4}), wr(DType::kI32, Device::cuda(), {1}),
      gsend(DType::kI32, Device::cuda(), {4}), ga(DType::kI32, Device::cuda(), {4}), ws_cpu(DType::kI32, kCpu, {4});
  EXPECT_NO_THROW(moe_echo_exchange_index(ws, wr, gsend, ga, ce, 0, 2, 1, gs));
  EXPECT_THROW(moe_echo_exchange_index(ws_cpu, wr, gsend, ga, ce, 0, 2, 1, gs), Error);  // device
  EXPECT_THROW(moe_echo_exchange_index(ws, wr, gsend, ga, ce, 0, 2, 1, cs), Error);      // stream
  OwnedTensor a(DType::kF32, Device::cuda(), {2, 3}), out(DType::kF32, Device::cuda(), {2, 2, 3}),
      out_cpu(DType::kF32, kCpu, {2, 2, 3});
  GroupedWeights w({a.t}, gs);
  auto idx = make_int_tensor({0, -1}, Device::cuda(), {2}, gs);
  auto idx_cpu = make_int_tensor({0, -1}, kCpu, {2}, cs);
  EXPECT_NO_THROW(moe_echo_gather_experts(out, w, idx, gs));
  EXPECT_THROW(moe_echo_gather_experts(out_cpu, w, idx, gs), Error);  // out on the CPU
  EXPECT_THROW(moe_echo_gather_experts(out, w, idx_cpu, gs), Error);  // index on the CPU
  EXPECT_THROW(moe_echo_gather_blocks(out_cpu, out, idx, gs), Error);
  EXPECT_THROW(moe_echo_accumulate_experts(w, out, idx, cs), Error);  // stream
  EXPECT_NO_THROW(moe_echo_accumulate_experts(w, out, idx, gs));
  gs.synchronize();
}

// ---- a captured exchange --------------------------------------------------------------------------------

/// One device holding P simulated EP ranks: their experts, maps, buffers and main gradients.
struct Sim {
  int64_t P, L, S, n, k, NS;
  OwnedTensor ce;
  std::vector<OwnedTensor> experts, ws, wr, gsend_idx, ga, send, recv, clones, cgrad, gsend, grecv, mains;
  std::vector<GroupedWeights> local, grads;
  std::vector<std::vector<float>> cgrad_vals;

  Sim(int64_t P_, int64_t L_, int64_t S_, int64_t n_, int64_t k_, const Stream& st)
      : P(P_), L(L_), S(S_), n(n_), k(k_), NS(P_ * S_), ce(DType::kI32, Device::cuda(), {P_ * S_}) {
    const Device d = Device::cuda();
    for (int64_t r = 0; r < P; ++r) {
      std::vector<Tensor> ex, gr;
      for (int64_t l = 0; l < L; ++l) {
        experts.push_back(testing::make_tensor(testing::randn(n * k), DType::kBF16, d, {n, k}, st));
        ex.push_back(experts.back().t);
        mains.emplace_back(DType::kF32, d, std::vector<int64_t>{n, k});
        gr.push_back(mains.back().t);
      }
      local.emplace_back(ex, st);
      grads.emplace_back(gr, st);
      ws.emplace_back(DType::kI32, d, std::vector<int64_t>{NS});
      wr.emplace_back(DType::kI32, d, std::vector<int64_t>{S});
      gsend_idx.emplace_back(DType::kI32, d, std::vector<int64_t>{NS});
      ga.emplace_back(DType::kI32, d, std::vector<int64_t>{NS});
      send.emplace_back(DType::kBF16, d, std::vector<int64_t>{NS, n, k});
      recv.emplace_back(DType::kBF16, d, std::vector<int64_t>{NS, n, k});
      clones.emplace_back(DType::kBF16, d, std::vector<int64_t>{S, n, k});
      cgrad_vals.emplace_back();
      const I v = testing::randint(S * n * k, -64, 64);  // multiples of 1/8: exact sums
      for (int32_t x : v) cgrad_vals.back().push_back(static_cast<float>(x) / 8.f);
      cgrad.push_back(testing::make_tensor(cgrad_vals.back(), DType::kF32, d, {S, n, k}, st));
      gsend.emplace_back(DType::kF32, d, std::vector<int64_t>{NS, n, k});
      grecv.emplace_back(DType::kF32, d, std::vector<int64_t>{NS, n, k});
    }
  }

  /// The equal-split all_to_all as P·P fixed block copies on the stream.
  void all_to_all(const std::vector<OwnedTensor>& snd, const std::vector<OwnedTensor>& rcv, size_t bb,
                  const Stream& st) const {
    for (int64_t r = 0; r < P; ++r)
      for (int64_t p = 0; p < P; ++p)
        copy_bytes(static_cast<char*>(rcv[size_t(p)]->data()) + r * S * bb, Device::cuda(),
                   static_cast<const char*>(snd[size_t(r)]->data()) + p * S * bb, Device::cuda(), S * bb, st);
  }

  void step(const Stream& st) const {
    for (int64_t r = 0; r < P; ++r)
      moe_echo_exchange_index(ws[size_t(r)], wr[size_t(r)], gsend_idx[size_t(r)], ga[size_t(r)], ce, r, L, S, st);
    for (int64_t r = 0; r < P; ++r) moe_echo_gather_experts(send[size_t(r)], local[size_t(r)], ws[size_t(r)], st);
    all_to_all(send, recv, static_cast<size_t>(n * k) * 2, st);
    for (int64_t r = 0; r < P; ++r) moe_echo_gather_blocks(clones[size_t(r)], recv[size_t(r)], wr[size_t(r)], st);
    for (int64_t r = 0; r < P; ++r)
      moe_echo_gather_blocks(gsend[size_t(r)], cgrad[size_t(r)], gsend_idx[size_t(r)], st);
    all_to_all(gsend, grecv, static_cast<size_t>(n * k) * 4, st);
    for (int64_t r = 0; r < P; ++r) moe_echo_accumulate_experts(grads[size_t(r)], grecv[size_t(r)], ga[size_t(r)], st);
  }
};

TEST(MoeEchoExchangeCuda, CapturedExchangeReplaysWithNewPlacements) {
  MT_REQUIRE_CUDA();
  const Stream& gs = testing::cuda_stream();
  const int64_t P = 4, L = 2, S = 2, n = 8, k = 12, NS = P * S, nk = n * k;
  Sim sim(P, L, S, n, k, gs);
  copy_bytes(sim.ce->data(), Device::cuda(), I(NS, -1).data(), kCpu, NS * 4, gs);
  sim.step(gs);  // warm-up outside the capture
  gs.synchronize();
  const auto s = static_cast<cudaStream_t>(gs.cuda_stream());
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  sim.step(gs);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  // Placements: a plan, a table with several clones of one expert, none, another plan.
  const std::vector<I> tables = {planned_table(P, L, S, 2.0), I{2, 2, 0, 0, 0, 1, 0, 3}, I(NS, -1),
                                 planned_table(P, L, S, 1.0)};
  for (size_t rep = 0; rep < tables.size(); ++rep) {
    SCOPED_TRACE(fmt::format("replay {}", rep));
    const I& ce = tables[rep];
    copy_bytes(sim.ce->data(), Device::cuda(), ce.data(), kCpu, NS * 4, gs);
    std::vector<std::vector<double>> want(static_cast<size_t>(P * L));
    for (int64_t e = 0; e < P * L; ++e) {  // fresh main gradients, and the expected sums
      const I v = testing::randint(nk, -64, 64);
      std::vector<float> f(v.size());
      for (size_t i = 0; i < v.size(); ++i) f[i] = static_cast<float>(v[i]) / 8.f;
      testing::upload(sim.mains[size_t(e)], f, gs);
      want[size_t(e)].assign(f.begin(), f.end());
    }
    for (int64_t sl = 0; sl < NS; ++sl) {
      const int32_t e = ce[size_t(sl)];
      if (e < 0) continue;
      for (int64_t i = 0; i < nk; ++i)
        want[size_t(e)][size_t(i)] += sim.cgrad_vals[size_t(sl / S)][size_t((sl % S) * nk + i)];
    }
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    for (int64_t sl = 0; sl < NS; ++sl) {  // each used clone holds its home expert's bits
      const int32_t e = ce[size_t(sl)];
      if (e < 0) continue;
      const Bytes clones = bytes_of(sim.clones[size_t(sl / S)], gs);
      const Bytes home = bytes_of(sim.experts[size_t(e)], gs);  // experts are stored rank-major: e = r·L + l
      EXPECT_TRUE(std::equal(home.begin(), home.end(), clones.begin() + (sl % S) * nk * 2)) << "slot " << sl;
    }
    for (int64_t e = 0; e < P * L; ++e) {
      const auto got = testing::to_host(sim.mains[size_t(e)], gs);
      int64_t bad = 0;
      for (int64_t i = 0; i < nk; ++i) bad += static_cast<double>(got[size_t(i)]) != want[size_t(e)][size_t(i)];
      EXPECT_EQ(bad, 0) << "expert " << e;
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

}  // namespace
}  // namespace mt
