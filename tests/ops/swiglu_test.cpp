// CPU SwiGLU against a float64 reference (forward) and central finite differences of it
// (backward); a test per documented error.
#include <gtest/gtest.h>

#include <cmath>

#include "ops/swiglu.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;
const Device kCpu = Device::cpu();

double silu_ref(double a) { return a / (1.0 + std::exp(-a)); }
double swiglu_ref(double a, double b) { return silu_ref(a) * b; }

/// Shapes [..., 2f] with f = 1, 3, 7, 130, 1000 and several leading shapes.
const std::vector<std::vector<int64_t>>& shapes() {
  static const std::vector<std::vector<int64_t>> s = {{1, 2}, {5, 6}, {3, 2, 14}, {1000, 260}, {4, 2000}, {2}};
  return s;
}

std::vector<int64_t> halved(std::vector<int64_t> s) {
  s.back() /= 2;
  return s;
}
int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (auto v : s) n *= v;
  return n;
}

TEST(SwiGlu, ForwardMatchesFloat64Reference) {
  Stream st;
  for (const auto& shape : shapes()) {
    const int64_t f = shape.back() / 2, n = numel(shape) / (2 * f);
    const auto xv = testing::randn(n * 2 * f, 2.f);
    auto x = testing::make_tensor(xv, DType::kF32, kCpu, shape, st);
    OwnedTensor y(DType::kF32, kCpu, halved(shape));
    testing::poison(y, st);
    swiglu_forward(y, x, st);
    std::vector<double> ref(n * f);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < f; ++j) ref[r * f + j] = swiglu_ref(xv[r * 2 * f + j], xv[r * 2 * f + f + j]);
    }
    const auto yv = testing::to_host(y, st);
    if (n * f >= 1000) {
      EXPECT_LT(testing::rel_err(yv, ref), 1e-6) << "f=" << f << " n=" << n;
    }
    // silu(a) * b has no cancellation: every element to a few fp32 ulps.
    for (size_t i = 0; i < yv.size(); ++i) {
      ASSERT_LE(std::fabs(yv[i] - ref[i]), 1e-6 * std::fabs(ref[i]) + 1e-30) << "f=" << f << " i=" << i;
    }
  }
}

// L = sum g * y: dL/dx[r, j] and dL/dx[r, f + j] only depend on (x[r, j], x[r, f + j]), so each
// is a central difference of g[r, j] * swiglu_ref(a, b). Element-wise tolerance 1e-5 relative plus
// an absolute slack for the cancellation in silu'(a) = s (1 + a (1 - s)) near its root
// a ~ -1.28 (fp32 error ~ 1e-7 |a| |g b|).
TEST(SwiGlu, BackwardMatchesFiniteDifferences) {
  Stream st;
  for (const auto& shape : shapes()) {
    const int64_t f = shape.back() / 2, n = numel(shape) / (2 * f);
    const auto xv = testing::randn(n * 2 * f, 2.f), gv = testing::randn(n * f);
    auto x = testing::make_tensor(xv, DType::kF32, kCpu, shape, st);
    auto dy = testing::make_tensor(gv, DType::kF32, kCpu, halved(shape), st);
    OwnedTensor dx(DType::kF32, kCpu, shape);
    testing::poison(dx, st);
    swiglu_backward(dx, dy, x, st);
    std::vector<double> xd(xv.begin(), xv.end()), ref(n * 2 * f), slack(n * 2 * f);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < f; ++j) {
        const int64_t ia = r * 2 * f + j, ib = ia + f;
        const double g = gv[r * f + j];
        auto l = [&] { return g * swiglu_ref(xd[ia], xd[ib]); };
        ref[ia] = testing::finite_diff(l, xd, ia);
        ref[ib] = testing::finite_diff(l, xd, ib);
        slack[ia] = 1e-6 * std::fabs(g * xv[ib]) * (1.0 + std::fabs(xv[ia]));
        slack[ib] = 1e-6 * std::fabs(g) * (1.0 + std::fabs(xv[ia]));
      }
    }
    const auto dxv = testing::to_host(dx, st);
    if (n * f >= 1000) {
      EXPECT_LT(testing::rel_err(dxv, ref), 1e-5) << "f=" << f << " n=" << n;
    }
    for (size_t i = 0; i < dxv.size(); ++i) {
      ASSERT_LE(std::fabs(dxv[i] - ref[i]), 1e-5 * std::fabs(ref[i]) + slack[i]) << "f=" << f << " i=" << i;
    }
  }
}

TEST(SwiGlu, SaturatedGatesStayFinite) {
  // exp(-a) overflows for a < -88: sigmoid -> 0, silu -> -0, no NaN; large positive a: silu = a.
  Stream st;
  const std::vector<float> xv = {-1000.f, -90.f, 90.f, 1000.f, 2.f, 3.f, -4.f, 5.f};  // gates, then linears
  auto x = testing::make_tensor(xv, DType::kF32, kCpu, {1, 8}, st);
  auto dy = testing::make_tensor({1.f, 1.f, 1.f, 1.f}, DType::kF32, kCpu, {1, 4}, st);
  OwnedTensor y(DType::kF32, kCpu, {1, 4}), dx(DType::kF32, kCpu, {1, 8});
  swiglu_forward(y, x, st);
  swiglu_backward(dx, dy, x, st);
  const auto yv = testing::to_host(y, st), dxv = testing::to_host(dx, st);
  ASSERT_TRUE(testing::all_finite(yv) && testing::all_finite(dxv));
  EXPECT_EQ(yv[0], 0.f);
  EXPECT_EQ(yv[3], 5000.f);
  EXPECT_FLOAT_EQ(yv[2], 90.f * -4.f);
  EXPECT_FLOAT_EQ(dxv[3], 5.f);      // d/da = b * silu'(a) = b for a >> 0
  EXPECT_FLOAT_EQ(dxv[7], 1000.f);   // d/db = silu(a) = a
  EXPECT_EQ(dxv[0], 0.f);
}

TEST(SwiGlu, BadInputThrows) {
  Stream st;
  auto x = testing::make_tensor(testing::randn(4 * 8), DType::kF32, kCpu, {4, 8}, st);
  OwnedTensor y(DType::kF32, kCpu, {4, 4});
  EXPECT_NO_THROW(swiglu_forward(y, x, st));
  OwnedTensor y8(DType::kF32, kCpu, {4, 8}), y_rows(DType::kF32, kCpu, {3, 4}), y_flat(DType::kF32, kCpu, {16});
  OwnedTensor y_bf16(DType::kBF16, kCpu, {4, 4}), x_bf16(DType::kBF16, kCpu, {4, 8}), xi(DType::kI32, kCpu, {4, 8});
  OwnedTensor yi(DType::kI32, kCpu, {4, 4});
  OwnedTensor x_odd(DType::kF32, kCpu, {4, 7}), y_odd(DType::kF32, kCpu, {4, 3});
  OwnedTensor x_empty(DType::kF32, kCpu, {4, 0}), y_empty(DType::kF32, kCpu, {4, 0});
  OwnedTensor big(DType::kF32, kCpu, {4, 3, 8}), y_nc(DType::kF32, kCpu, {4, 2, 4});
  const Tensor x_nc = big.t.slice(1, 0, 2);  // [4, 2, 8], not contiguous
  EXPECT_THROW(swiglu_forward(y8, x, st), Error);        // y not half of x
  EXPECT_THROW(swiglu_forward(y_rows, x, st), Error);    // leading shape differs
  EXPECT_THROW(swiglu_forward(y_flat, x, st), Error);    // same numel, other shape
  EXPECT_THROW(swiglu_forward(y_bf16, x, st), Error);    // dtype mismatch
  EXPECT_THROW(swiglu_forward(y_bf16, x_bf16, st), Error);  // CPU is fp32 only
  EXPECT_THROW(swiglu_forward(yi, xi, st), Error);       // int dtype
  EXPECT_THROW(swiglu_forward(y_odd, x_odd, st), Error); // odd last dimension
  EXPECT_THROW(swiglu_forward(y_empty, x_empty, st), Error);  // empty last dimension
  EXPECT_THROW(swiglu_forward(y_nc, x_nc, st), Error);   // non-contiguous x

  OwnedTensor dx(DType::kF32, kCpu, {4, 8});
  auto dy = testing::make_tensor(testing::randn(16), DType::kF32, kCpu, {4, 4}, st);
  EXPECT_NO_THROW(swiglu_backward(dx, dy, x, st));
  OwnedTensor dx_small(DType::kF32, kCpu, {4, 4}), dx_bf16(DType::kBF16, kCpu, {4, 8});
  EXPECT_THROW(swiglu_backward(dx_small, dy, x, st), Error);  // dx not like x
  EXPECT_THROW(swiglu_backward(dx_bf16, dy, x, st), Error);   // dx dtype
  EXPECT_THROW(swiglu_backward(dx, y8, x, st), Error);        // dy not half of x
  EXPECT_THROW(swiglu_backward(dx, dy, x_odd, st), Error);    // odd last dimension
  EXPECT_THROW(swiglu_backward(big.t.slice(1, 0, 2), y_nc, x_nc, st), Error);  // non-contiguous
}

}  // namespace
}  // namespace mt
