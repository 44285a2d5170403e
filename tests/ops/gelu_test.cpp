// CPU GELU (tanh approximation) against a float64 reference and central finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "ops/gelu.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;

double gelu_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

// Tolerances. Norm-wise relative error < 1e-5 for n >= 1000. Element-wise, 1 + tanh(u) cancels
// for x << 0 (gelu(x) and gelu'(x) tend to 0 while the fp32 error of tanh stays ~6e-8 absolute),
// so each element is checked against 1e-5 relative plus an absolute slack of that size:
// forward 1e-6 (|x| <~ 10 times 6e-8), backward 1e-5 * |dy| (the x (1 - t^2) term, <~ 10).
void expect_close_elementwise(const std::vector<float>& got, const std::vector<double>& ref,
                              const std::vector<double>& abs_slack) {
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(got[i] - ref[i]), 1e-5 * std::fabs(ref[i]) + abs_slack[i]) << "i=" << i << " ref=" << ref[i];
  }
}

TEST(Gelu, ForwardMatchesFloat64Reference) {
  Stream st;
  for (int64_t n : {1, 7, 1000, 4099}) {
    auto xv = testing::randn(n, 2.f);
    auto x = testing::make_tensor(xv, DType::kF32, Device::cpu(), {n}, st);
    OwnedTensor y(DType::kF32, Device::cpu(), {n});
    testing::poison(y, st);
    gelu_forward(y, x, st);
    std::vector<double> ref(n);
    for (int64_t i = 0; i < n; ++i) ref[i] = gelu_ref(xv[i]);
    auto yv = testing::to_host(y, st);
    if (n >= 1000) EXPECT_LT(testing::rel_err(yv, ref), 1e-5) << "n=" << n;
    expect_close_elementwise(yv, ref, std::vector<double>(n, 1e-6));
    // In place (y aliases x) gives the same values.
    gelu_forward(x, x, st);
    EXPECT_EQ(testing::to_host(x, st), yv);
  }
}

TEST(Gelu, BackwardMatchesFiniteDifferences) {
  Stream st;
  for (int64_t n : {1, 33, 2000, 5}) {
    auto xv = testing::randn(n, 2.f);
    auto dyv = testing::randn(n);
    auto x = testing::make_tensor(xv, DType::kF32, Device::cpu(), {n}, st);
    OwnedTensor dyo = testing::make_tensor(dyv, DType::kF32, Device::cpu(), {n}, st);
    OwnedTensor dx(DType::kF32, Device::cpu(), {n});
    testing::poison(dx, st);
    gelu_backward(dx, dyo, x, st);
    // dx_i = dy_i * d gelu(x_i)/dx_i; central differences of the float64 reference (eps 1e-5:
    // truncation and rounding errors ~1e-10, far below the fp32 tolerance 1e-5).
    std::vector<double> xd(xv.begin(), xv.end()), ref(n);
    for (int64_t i = 0; i < n; ++i) {
      ref[i] = dyv[i] * testing::finite_diff([&] { return gelu_ref(xd[i]); }, xd, i);
    }
    auto dxv = testing::to_host(dx, st);
    if (n >= 1000) EXPECT_LT(testing::rel_err(dxv, ref), 1e-5) << "n=" << n;
    std::vector<double> slack(n);
    for (int64_t i = 0; i < n; ++i) slack[i] = 1e-5 * std::fabs(dyv[i]);
    expect_close_elementwise(dxv, ref, slack);
    // dx may alias dy.
    gelu_backward(dyo, dyo, x, st);
    EXPECT_EQ(testing::to_host(dyo, st), dxv);
  }
}

TEST(Gelu, BadInputThrows) {
  Stream st;
  auto x = testing::make_tensor(testing::randn(8), DType::kF32, Device::cpu(), {8}, st);
  OwnedTensor y9(DType::kF32, Device::cpu(), {9});
  OwnedTensor y24(DType::kF32, Device::cpu(), {2, 4});
  OwnedTensor ybf(DType::kBF16, Device::cpu(), {8});
  OwnedTensor xi(DType::kI32, Device::cpu(), {8});
  EXPECT_THROW(gelu_forward(y9, x, st), Error);   // size mismatch
  EXPECT_THROW(gelu_forward(y24, x, st), Error);  // shape mismatch
  EXPECT_THROW(gelu_forward(ybf, x, st), Error);  // dtype mismatch / bf16 on CPU
  EXPECT_THROW(gelu_forward(xi, xi, st), Error);  // int dtype
  auto xbf = testing::make_tensor(testing::randn(8), DType::kBF16, Device::cpu(), {8}, st);
  EXPECT_THROW(gelu_forward(ybf, xbf, st), Error);  // CPU is fp32 only
  OwnedTensor dx(DType::kF32, Device::cpu(), {8});
  EXPECT_THROW(gelu_backward(dx, y9, x, st), Error);
  EXPECT_THROW(gelu_backward(y9, x, x, st), Error);
}

}  // namespace
}  // namespace mt
