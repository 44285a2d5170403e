// CUDA GELU against the CPU reference on the same (dtype-rounded) inputs: fp32 rel. 1e-5,
// bf16/fp16 rel. 2e-2; vectorised and unaligned (scalar) paths, grid-stride sizes, aliasing.
#include <gtest/gtest.h>

#include <cmath>

#include "ops/gelu.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::rounded;
using testing::OwnedTensor;

double tol(DType t) { return t == DType::kF32 ? 1e-5 : 2e-2; }

/// Element-wise |got - ref| <= rtol |ref| + atol_i. The absolute part covers the cancellation in
/// 1 + tanh(u) for x << 0, where CPU and CUDA tanhf may differ by an ulp of ~1 (see gelu_test).
void expect_close(const std::vector<float>& got, const std::vector<float>& ref, double rtol,
                  const std::vector<double>& atol, const char* what) {
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(double(got[i]) - ref[i]), rtol * std::fabs(ref[i]) + atol[i]) << what << " i=" << i;
  }
}

TEST(GeluCuda, ForwardAndBackwardMatchCpu) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{4099}, (int64_t{3} << 20) + 3}) {
      const auto x = testing::randn(n, 2.f), dy = testing::randn(n);
      const auto xr = rounded(x, t), dyr = rounded(dy, t);
      // CPU reference (fp32) on the rounded inputs.
      auto xc = testing::make_tensor(xr, DType::kF32, Device::cpu(), {n}, cs);
      auto dyc = testing::make_tensor(dyr, DType::kF32, Device::cpu(), {n}, cs);
      OwnedTensor yc(DType::kF32, Device::cpu(), {n}), dxc(DType::kF32, Device::cpu(), {n});
      gelu_forward(yc, xc, cs);
      gelu_backward(dxc, dyc, xc, cs);
      const auto y_ref = testing::to_host(yc, cs), dx_ref = testing::to_host(dxc, cs);

      auto xg = testing::make_tensor(x, t, gpu, {n}, gs);
      auto dyg = testing::make_tensor(dy, t, gpu, {n}, gs);
      OwnedTensor yg(t, gpu, {n}), dxg(t, gpu, {n});
      testing::poison(yg, gs);
      testing::poison(dxg, gs);
      gelu_forward(yg, xg, gs);
      gelu_backward(dxg, dyg, xg, gs);
      const auto y = testing::to_host(yg, gs), dx = testing::to_host(dxg, gs);
      ASSERT_TRUE(testing::all_finite(y) && testing::all_finite(dx));
      if (n >= 1000) {
        EXPECT_LT(testing::rel_err(y, y_ref), tol(t)) << dtype_name(t) << " n=" << n;
        EXPECT_LT(testing::rel_err(dx, dx_ref), tol(t)) << dtype_name(t) << " n=" << n;
      }
      std::vector<double> atol_y(n, 1e-6), atol_dx(n);
      // Per element, an absolute allowance of 1e-4·|dy|: for x << 0, gelu'(x) comes out of the
      // cancellation in 1 + tanh(u), where CPU and CUDA tanhf differ by a few ulp of 1 (seen on an
      // H200: 2.3e-8 off at |dy| = 6.5e-4). The aggregate check above stays at 1e-5.
      // Plus one fp16 subnormal spacing (2^-24 ~ 6e-8): fp16 outputs below 6e-5 are subnormal
      // and carry that absolute rounding (seen on an H100: 2.5e-8 off at |dy| = 5e-5).
      const double sub = t == DType::kF16 ? 6e-8 : 0.0;
      for (int64_t i = 0; i < n; ++i) atol_dx[i] = 1e-4 * std::fabs(dyr[i]) + sub;
      expect_close(y, y_ref, tol(t), atol_y, "y");
      expect_close(dx, dx_ref, tol(t), atol_dx, "dx");

      if (n < 2) continue;
      // Unaligned views (scalar path): elements [1, n).
      OwnedTensor yg2(t, gpu, {n});
      testing::poison(yg2, gs);
      gelu_forward(yg2.t.flat_range(1, n - 1), xg.t.flat_range(1, n - 1), gs);
      const auto y2 = testing::to_host(yg2.t.flat_range(1, n - 1), gs);
      // Same per-element formula as the vectorised kernel; compared with a tolerance of about one
      // ulp rather than bitwise, in case the compiler contracts the two instantiations differently.
      expect_close(y2, std::vector<float>(y.begin() + 1, y.end()), t == DType::kF32 ? 1e-6 : 1e-2,
                   std::vector<double>(n - 1, 1e-7), "unaligned y");
      EXPECT_TRUE(std::isnan(testing::to_host(yg2, gs)[0])) << "element 0 (poisoned) must be untouched";
      // Aliasing: dx = dy in place, y = x in place.
      gelu_backward(dyg, dyg, xg, gs);
      EXPECT_EQ(testing::to_host(dyg, gs), dx) << dtype_name(t) << " n=" << n;
      gelu_forward(xg, xg, gs);
      EXPECT_EQ(testing::to_host(xg, gs), y) << dtype_name(t) << " n=" << n;
    }
  }
}

}  // namespace
}  // namespace mt
