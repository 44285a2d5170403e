// CUDA tests of ops/grouped_matmul.h against the CPU backend on the same (dtype-rounded) random
// inputs: fp32 (SIMT kernel, rel. err < 1e-5), bf16/fp16 (tensor-core kernel when n, k are
// multiples of 8 and pointers 16-byte aligned, else the SIMT fallback; < 2e-2) over ragged shapes
// that are not multiples of the tiles, uneven counts (empty groups, one group with every row), a
// tail beyond Σ counts (zeroed outputs; NaN tail inputs never read), accumulation into the fp32
// gradients, bitwise repeatability, and capture of all three calls in a CUDA graph (no host sync).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>

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
const Device kCpu = Device::cpu();

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
    std::vector<float> buf(static_cast<size_t>(offset), 0.f);
    buf.insert(buf.end(), v.begin(), v.end());
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

void check(DType dt, const Case& c, int64_t offset = 0, bool capture = false) {
  const size_t G = c.counts.size();
  SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " R=" << c.R << " n=" << c.n << " k=" << c.k << " G=" << G
                                    << " offset=" << offset);
  const int64_t used = std::accumulate(c.counts.begin(), c.counts.end(), int64_t{0});
  auto x = rounded(randn(c.R * c.k), dt), dy = rounded(randn(c.R * c.n), dt);
  for (int64_t i = used * c.k; i < c.R * c.k; ++i) x[size_t(i)] = NAN;  // never read
  for (int64_t i = used * c.n; i < c.R * c.n; ++i) dy[size_t(i)] = NAN;
  std::vector<std::vector<float>> w, dw0;
  for (size_t g = 0; g < G; ++g) {
    w.push_back(rounded(randn(c.n * c.k), dt));
    dw0.push_back(randn(c.n * c.k));
  }
  const Result ref = run(kCpu, dt, c, x, dy, w, dw0, 0, false);
  const Result got = run(Device::cuda(), dt, c, x, dy, w, dw0, offset, capture);
  const double tol = dt == DType::kF32 ? 1e-5 : 2e-2;
  EXPECT_TRUE(testing::all_finite(got.y) && testing::all_finite(got.dx)) << "NaN read from the tail";
  EXPECT_LT(rel_err(got.y, ref.y), tol);
  EXPECT_LT(rel_err(got.dx, ref.dx), tol);
  for (int64_t i = used * c.n; i < c.R * c.n; ++i) ASSERT_EQ(got.y[size_t(i)], 0.f) << "tail of y";
  for (int64_t i = used * c.k; i < c.R * c.k; ++i) ASSERT_EQ(got.dx[size_t(i)], 0.f) << "tail of dx";
  for (size_t g = 0; g < G; ++g) {
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
  if (!capture) {  // bitwise repeatable
    const Result again = run(Device::cuda(), dt, c, x, dy, w, dw0, offset, false);
    EXPECT_EQ(0, std::memcmp(again.y.data(), got.y.data(), got.y.size() * 4));
    EXPECT_EQ(0, std::memcmp(again.dx.data(), got.dx.data(), got.dx.size() * 4));
    for (size_t g = 0; g < G; ++g) EXPECT_EQ(0, std::memcmp(again.dw[g].data(), got.dw[g].data(), got.dw[g].size() * 4));
  }
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
  for (DType dt : {DType::kBF16, DType::kF16})
    for (const Case& c : cases()) check(dt, c);
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

}  // namespace
}  // namespace mt
