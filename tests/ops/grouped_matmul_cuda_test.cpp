// CUDA tests of ops/grouped_matmul.h against the CPU backend on the same (dtype-rounded) random
// inputs: fp32 (SIMT kernel, rel. err < 1e-5), bf16/fp16 (< 2e-2) on the mma.sync tensor-core
// kernel (n, k multiples of 8, pointers 16-byte aligned; else the SIMT fallback) and, on Hopper,
// the wgmma kernel (ops/cuda/grouped_matmul_sm90.cu, forced with both tile widths, the ping-pong
// schedule and every wgrad epilogue) over ragged shapes that are not multiples of the tiles,
// uneven counts (empty groups, one group with every row, skewed, 64 small experts), a tail
// beyond Σ counts (zeroed outputs that were poisoned with NaN; NaN tail inputs never read),
// accumulation into the fp32 gradients (empty groups untouched), bitwise repeatability, and
// capture of all three calls in a CUDA graph replayed with counts that change between replays
// (including counts clipped at row R).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <numeric>

#include "ops/cuda/grouped_matmul_sm90.cuh"
#include "ops/grouped_matmul.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::cpu_stream;
using testing::cuda_stream;
using testing::make_int_tensor;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::poison;
using testing::randn;
using testing::rel_err;
using testing::rounded;
using testing::to_host;
using Kernel = cuda::grouped_sm90::Kernel;
using WgradEpilogue = cuda::grouped_sm90::WgradEpilogue;
const Device kCpu = Device::cpu();

using cuda::grouped_sm90::KernelScope;

/// The wgrad epilogues beside the default read-modify-write (each tile kind, bf16).
constexpr WgradEpilogue kOtherEpilogues[] = {WgradEpilogue::kReadModifyWriteL2Prefetch, WgradEpilogue::kPreload,
                                             WgradEpilogue::kPreloadL2Prefetch};

/// cuda:0 has compute capability 9.0 (the wgmma kernel's device).
bool hopper_device() {
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  return major == 9 && minor == 0;
}

#define MT_REQUIRE_HOPPER()                                                                                 \
  do {                                                                                                      \
    MT_REQUIRE_CUDA();                                                                                      \
    if (!hopper_device()) GTEST_SKIP() << "cuda:0 is not a compute capability 9.0 device (the wgmma kernel)"; \
    ASSERT_TRUE(cuda::grouped_sm90::device_ready(cuda_stream()))                                            \
        << "a Hopper device, but the driver did not load this binary's sm_90a code";                        \
  } while (0)

struct Case {
  int64_t R, n, k;
  std::vector<int32_t> counts;
};

struct Result {
  std::vector<float> y, dx;
  std::vector<std::vector<float>> dw;
};

/// Views of `rows` x `cols` elements at `offset` elements into their own buffer (offset > 0:
/// misaligned for the tensor-core path).
struct Side {
  std::vector<OwnedTensor> keep;
  Tensor make(const std::vector<float>& v, DType dt, Device dev, int64_t rows, int64_t cols, int64_t offset,
              const Stream& s) {
    std::vector<float> buf(static_cast<size_t>(offset) + v.size(), 0.f);
    std::copy(v.begin(), v.end(), buf.begin() + offset);
    keep.push_back(make_tensor(buf, dt, dev, {static_cast<int64_t>(buf.size())}, s));
    return keep.back().t.flat_range(offset, rows * cols).view({rows, cols});
  }
};

Result run(Device dev, DType dt, const Case& c, const std::vector<float>& x, const std::vector<float>& dy,
           const std::vector<std::vector<float>>& w, const std::vector<std::vector<float>>& dw0, int64_t offset,
           bool capture) {
  const Stream& s = dev.is_cpu() ? cpu_stream() : cuda_stream();
  const DType at = dev.is_cpu() ? DType::kF32 : dt;
  Side side;
  const Tensor xt = side.make(x, at, dev, c.R, c.k, offset, s), dyt = side.make(dy, at, dev, c.R, c.n, offset, s);
  std::vector<Tensor> wv, dwv;
  for (size_t g = 0; g < w.size(); ++g) {
    wv.push_back(side.make(w[g], at, dev, c.n, c.k, offset, s));
    dwv.push_back(side.make(dw0[g], DType::kF32, dev, c.n, c.k, 0, s));
  }
  GroupedWeights gw(wv, s), gdw(dwv, s);
  auto counts = make_int_tensor(c.counts, dev, {static_cast<int64_t>(c.counts.size())}, s);
  const Tensor y = side.make(std::vector<float>(size_t(c.R * c.n)), at, dev, c.R, c.n, offset, s);
  const Tensor dx = side.make(std::vector<float>(size_t(c.R * c.k)), at, dev, c.R, c.k, offset, s);
  poison(y, s);
  poison(dx, s);
  if (capture) {
    cudaStream_t cs = static_cast<cudaStream_t>(s.cuda_stream());
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal), cudaSuccess);
    grouped_linear_forward(y, xt, gw, counts, s);
    grouped_linear_dgrad(dx, dyt, gw, counts, s);
    grouped_linear_wgrad(gdw, dyt, xt, counts, s);
    EXPECT_EQ(cudaStreamEndCapture(cs, &graph), cudaSuccess) << "a grouped GEMM synchronised with the host";
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(exec, cs), cudaSuccess);
    s.synchronize();
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  } else {
    grouped_linear_forward(y, xt, gw, counts, s);
    grouped_linear_dgrad(dx, dyt, gw, counts, s);
    grouped_linear_wgrad(gdw, dyt, xt, counts, s);
  }
  Result r{to_host(y, s), to_host(dx, s), {}};
  for (const Tensor& t : dwv) r.dw.push_back(to_host(t, s));
  return r;
}

/// got against ref: the groups' rows within tol, the outputs' tails exactly 0, no NaN (the
/// outputs were poisoned, the inputs' tails are NaN), each non-empty group's gradient increment
/// within tol and each empty group's gradient unchanged.
void compare(DType dt, const Case& c, const Result& got, const Result& ref,
             const std::vector<std::vector<float>>& dw0) {
  const int64_t used = std::accumulate(c.counts.begin(), c.counts.end(), int64_t{0});
  const double tol = dt == DType::kF32 ? 1e-5 : 2e-2;
  EXPECT_TRUE(testing::all_finite(got.y) && testing::all_finite(got.dx)) << "NaN read from the tail or not written";
  EXPECT_LT(rel_err(got.y, ref.y), tol);
  EXPECT_LT(rel_err(got.dx, ref.dx), tol);
  for (int64_t i = used * c.n; i < c.R * c.n; ++i) ASSERT_EQ(got.y[size_t(i)], 0.f) << "tail of y";
  for (int64_t i = used * c.k; i < c.R * c.k; ++i) ASSERT_EQ(got.dx[size_t(i)], 0.f) << "tail of dx";
  for (size_t g = 0; g < c.counts.size(); ++g) {
    if (c.counts[g] == 0) {
      EXPECT_EQ(got.dw[g], dw0[g]) << "empty group " << g << " changed";
      continue;
    }
    // The gradient's own scale: compare the increments (dw0 is O(1), the product O(sqrt(rows))).
    std::vector<float> a(got.dw[g]), b(ref.dw[g]);
    for (size_t i = 0; i < a.size(); ++i) {
      a[i] -= dw0[g][i];
      b[i] -= dw0[g][i];
    }
    EXPECT_LT(rel_err(a, b), tol) << "group " << g;
  }
}

/// Random inputs of case c rounded to dt, the rows beyond the first `used` NaN (never read).
struct Inputs {
  std::vector<float> x, dy;
  std::vector<std::vector<float>> w, dw0;
  Inputs(DType dt, const Case& c, int64_t used) {
    x = rounded(randn(c.R * c.k), dt);
    dy = rounded(randn(c.R * c.n), dt);
    for (int64_t i = used * c.k; i < c.R * c.k; ++i) x[size_t(i)] = NAN;
    for (int64_t i = used * c.n; i < c.R * c.n; ++i) dy[size_t(i)] = NAN;
    for (size_t g = 0; g < c.counts.size(); ++g) {
      w.push_back(rounded(randn(c.n * c.k), dt));
      dw0.push_back(randn(c.n * c.k));
    }
  }
};

void check(DType dt, const Case& c, int64_t offset = 0, bool capture = false) {
  const size_t G = c.counts.size();
  SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " R=" << c.R << " n=" << c.n << " k=" << c.k << " G=" << G
                                    << " offset=" << offset);
  const Inputs in(dt, c, std::accumulate(c.counts.begin(), c.counts.end(), int64_t{0}));
  const Result ref = run(kCpu, dt, c, in.x, in.dy, in.w, in.dw0, 0, false);
  const Result got = run(Device::cuda(), dt, c, in.x, in.dy, in.w, in.dw0, offset, capture);
  compare(dt, c, got, ref, in.dw0);
  if (!capture) {  // bitwise repeatable
    const Result again = run(Device::cuda(), dt, c, in.x, in.dy, in.w, in.dw0, offset, false);
    EXPECT_EQ(0, std::memcmp(again.y.data(), got.y.data(), got.y.size() * 4));
    EXPECT_EQ(0, std::memcmp(again.dx.data(), got.dx.data(), got.dx.size() * 4));
    for (size_t g = 0; g < G; ++g) {
      EXPECT_EQ(0, std::memcmp(again.dw[g].data(), got.dw[g].data(), got.dw[g].size() * 4));
    }
  }
}

/// The three calls captured once in a CUDA graph over R rows, replayed with each counts set in
/// turn (written into the captured counts tensor between replays; outputs poisoned with NaN and
/// gradients reset before each replay), against the CPU on the same counts clipped at row R (the
/// CUDA kernels clip, the CPU requires Σc <= R). Input rows beyond every set's used rows are NaN.
void check_replays(DType dt, int64_t R, int64_t n, int64_t k, const std::vector<std::vector<int32_t>>& sets) {
  const Stream& s = cuda_stream();
  const Device dev = Device::cuda();
  const size_t G = sets.front().size();
  std::vector<std::vector<int32_t>> clipped;
  int64_t max_used = 0;
  for (const auto& set : sets) {
    std::vector<int32_t> c(set);
    int64_t left = R;
    for (int32_t& v : c) {
      v = static_cast<int32_t>(std::min<int64_t>(v, left));
      left -= v;
    }
    max_used = std::max(max_used, R - left);
    clipped.push_back(c);
  }
  const Inputs in(dt, {R, n, k, sets.front()}, max_used);
  Side side;
  const Tensor xt = side.make(in.x, dt, dev, R, k, 0, s), dyt = side.make(in.dy, dt, dev, R, n, 0, s);
  std::vector<Tensor> wv, dwv;
  for (size_t g = 0; g < G; ++g) {
    wv.push_back(side.make(in.w[g], dt, dev, n, k, 0, s));
    dwv.push_back(side.make(in.dw0[g], DType::kF32, dev, n, k, 0, s));
  }
  const GroupedWeights gw(wv, s), gdw(dwv, s);
  const auto counts = make_int_tensor(sets.front(), dev, {static_cast<int64_t>(G)}, s);
  const Tensor y = side.make(std::vector<float>(size_t(R * n)), dt, dev, R, n, 0, s);
  const Tensor dx = side.make(std::vector<float>(size_t(R * k)), dt, dev, R, k, 0, s);
  auto calls = [&] {
    grouped_linear_forward(y, xt, gw, counts, s);
    grouped_linear_dgrad(dx, dyt, gw, counts, s);
    grouped_linear_wgrad(gdw, dyt, xt, counts, s);
  };
  calls();  // eager first: kernel attributes are set once, outside the capture
  s.synchronize();
  cudaStream_t cs = static_cast<cudaStream_t>(s.cuda_stream());
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal), cudaSuccess);
  calls();
  ASSERT_EQ(cudaStreamEndCapture(cs, &graph), cudaSuccess) << "a grouped GEMM synchronised with the host";
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (size_t i = 0; i < sets.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " R=" << R << " n=" << n << " k=" << k << " replay " << i);
    copy_bytes(counts->data(), dev, sets[i].data(), kCpu, G * sizeof(int32_t), s);
    poison(y, s);
    poison(dx, s);
    for (size_t g = 0; g < G; ++g) testing::upload(dwv[g], in.dw0[g], s);
    ASSERT_EQ(cudaGraphLaunch(exec, cs), cudaSuccess);
    Result got{to_host(y, s), to_host(dx, s), {}};
    for (const Tensor& t : dwv) got.dw.push_back(to_host(t, s));
    const Case c{R, n, k, clipped[i]};
    compare(dt, c, got, run(kCpu, dt, c, in.x, in.dy, in.w, in.dw0, 0, false), in.dw0);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {300, 72, 40, {100, 0, 57, 1, 130}},       // ragged: n, k not multiples of the tiles; a tail of 12
      {256, 128, 64, {0, 256, 0}},               // one group holds every row
      {1000, 200, 136, {129, 255, 0, 128, 300}},  // tile boundaries ±1
      {64, 16, 8, {0, 0, 0, 0, 0, 0, 0, 0}},     // all empty: only the zeroed tail
      {777, 264, 520, {333, 0, 0, 444}},          // several K tiles, odd row counts
  };
  return c;
}

TEST(GroupedMatmulCuda, Fp32MatchesCpu) {
  MT_REQUIRE_CUDA();
  for (const Case& c : cases()) check(DType::kF32, c);
}

TEST(GroupedMatmulCuda, Bf16Fp16TensorCoresMatchCpu) {
  MT_REQUIRE_CUDA();
  for (Kernel k : {Kernel::kMmaSync, Kernel::kAuto}) {  // mma.sync also on Hopper; auto: wgmma there
    const KernelScope scope(k);
    for (DType dt : {DType::kBF16, DType::kF16})
      for (const Case& c : cases()) check(dt, c);
  }
}

TEST(GroupedMatmulCuda, UnalignedShapesAndPointersUseTheFallback) {
  MT_REQUIRE_CUDA();
  check(DType::kBF16, {90, 30, 21, {40, 0, 33}});         // n, k not multiples of 8
  check(DType::kF16, {300, 72, 40, {100, 0, 57, 1, 130}}, 1);  // misaligned pointers
}

TEST(GroupedMatmulCuda, MoeSizedAndCapturedInAGraph) {
  MT_REQUIRE_CUDA();
  // 8 experts of uneven load, h = 512, f = 768 (both projections' shapes), and a 1/8 tail.
  Case c{9000, 768, 512, {1500, 700, 0, 1300, 900, 1100, 1400, 1000}};
  check(DType::kBF16, c);  // warm-up outside the capture (kernel attributes are set once)
  check(DType::kBF16, c, 0, /*capture=*/true);
  check(DType::kF32, {500, 40, 24, {100, 0, 300}}, 0, /*capture=*/true);
}

// The counts sets of the replay tests over R = 1500 rows and 6 groups: balanced, skewed with
// empty groups, all empty, every row (no tail), and Σc = 1900 > R (the last groups clipped).
const std::vector<std::vector<int32_t>> kReplaySets = {
    {250, 250, 250, 250, 250, 250}, {0, 1, 1300, 0, 63, 129}, {0, 0, 0, 0, 0, 0},
    {64, 128, 65, 1000, 200, 43},   {600, 0, 500, 300, 300, 200},
};

TEST(GroupedMatmulCuda, CapturedGraphReplaysWithChangingCounts) {
  MT_REQUIRE_CUDA();
  check_replays(DType::kBF16, 1500, 200, 136, kReplaySets);  // mma.sync / wgmma by device
  check_replays(DType::kF32, 700, 40, 24, {{100, 0, 300}, {0, 700, 0}, {0, 0, 5}});
}

/// The wgmma kernel's cases: those above and skewed counts (a hot expert beside tiny and empty
/// ones), groups at the 64-row stage boundaries +-1 with k over 16 stages, 64 small experts of
/// n = 1408 (DeepSeek-like: 11 column tiles of 128).
const std::vector<Case>& wgmma_cases() {
  static const std::vector<Case> c = [] {
    std::vector<Case> v = cases();
    v.push_back({2400, 328, 200, {1, 0, 1900, 3, 0, 129, 200}});
    v.push_back({640, 72, 1032, {64, 128, 0, 65, 191, 192}});
    Case ds{4000, 1408, 256, {}};
    for (int g = 0; g < 64; ++g) ds.counts.push_back(g % 5 == 0 ? 0 : (g * 37) % 97);
    v.push_back(ds);
    return v;
  }();
  return c;
}

TEST(GroupedMatmulCuda, WgmmaMatchesCpu) {
  MT_REQUIRE_HOPPER();
  for (Kernel k : {Kernel::kWgmma128, Kernel::kWgmma256, Kernel::kWgmmaPingPong}) {
    const KernelScope scope(k);
    for (DType dt : {DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(::testing::Message() << "kernel " << static_cast<int>(k) << " (3: 128, 4: 256, 5: ping-pong)");
      for (const Case& c : wgmma_cases()) check(dt, c);
    }
  }
}

TEST(GroupedMatmulCuda, WgmmaWgradEpiloguesMatchCpu) {
  MT_REQUIRE_HOPPER();
  for (Kernel k : {Kernel::kWgmma128, Kernel::kWgmma256, Kernel::kWgmmaPingPong}) {
    for (WgradEpilogue e : kOtherEpilogues) {
      const KernelScope scope(k, e);
      SCOPED_TRACE(::testing::Message() << "kernel " << static_cast<int>(k) << " (3: 128, 4: 256, 5: ping-pong), wgrad "
                                        << "epilogue " << static_cast<int>(e) << " (1: rmw+l2pf, 2: preload, 3: both)");
      for (const Case& c : wgmma_cases()) check(DType::kBF16, c);
    }
  }
}

TEST(GroupedMatmulCuda, WgmmaWgradEpiloguesCapturedReplaysWithChangingCounts) {
  MT_REQUIRE_HOPPER();
  for (Kernel k : {Kernel::kWgmma128, Kernel::kWgmma256, Kernel::kWgmmaPingPong}) {
    for (WgradEpilogue e : kOtherEpilogues) {
      const KernelScope scope(k, e);
      SCOPED_TRACE(::testing::Message() << "kernel " << static_cast<int>(k) << ", wgrad epilogue "
                                        << static_cast<int>(e));
      check_replays(DType::kBF16, 1500, 200, 136, kReplaySets);
      check_replays(DType::kF16, 1500, 264, 520, kReplaySets);
    }
  }
}

TEST(GroupedMatmulCuda, WgmmaCapturedGraphReplaysWithChangingCounts) {
  MT_REQUIRE_HOPPER();
  for (Kernel k : {Kernel::kWgmma128, Kernel::kWgmma256, Kernel::kWgmmaPingPong}) {
    const KernelScope scope(k);
    check_replays(DType::kBF16, 1500, 200, 136, kReplaySets);
    check_replays(DType::kF16, 1500, 264, 520, kReplaySets);
  }
  const KernelScope scope(Kernel::kWgmma);  // MoE-sized, the automatic tile width
  check_replays(DType::kBF16, 9000, 768, 512,
                {{1500, 700, 0, 1300, 900, 1100, 1400, 1000},
                 {0, 0, 9000, 0, 0, 0, 0, 0},
                 {8000, 0, 0, 0, 0, 0, 0, 2000}});
}

TEST(GroupedMatmulCuda, ForcedWgmmaNamesWhyItCannotRun) {
  MT_REQUIRE_HOPPER();
  const KernelScope scope(Kernel::kWgmma);
  const Stream& s = cuda_stream();
  const auto x = make_tensor(randn(64 * 24), DType::kF32, Device::cuda(), {64, 24}, s);
  const auto y = make_tensor(randn(64 * 40), DType::kF32, Device::cuda(), {64, 40}, s);
  const auto w = make_tensor(randn(40 * 24), DType::kF32, Device::cuda(), {40, 24}, s);
  const auto counts = make_int_tensor({64}, Device::cuda(), {1}, s);
  const GroupedWeights gw({w.t}, s);
  testing::expect_error([&] { grouped_linear_forward(y, x, gw, counts, s); }, "the wgmma kernel was requested");
}

}  // namespace
}  // namespace mt
