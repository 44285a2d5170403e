// CUDA SwiGLU against the CPU reference on the same (dtype-rounded) inputs: fp32 rel. 1e-5,
// bf16/fp16 rel. 2e-2 (norm-wise), plus an element-wise bound; vectorised (f a multiple of the
// vector width) and scalar (ragged f, unaligned views) paths; device errors.
#include <gtest/gtest.h>

#include <cmath>

#include "ops/swiglu.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;
using testing::rounded;
const Device kCpu = Device::cpu();

double tol(DType t) { return t == DType::kF32 ? 1e-5 : 2e-2; }

/// |got - ref| <= rtol |ref| + atol * scale_i + floor element-wise (scale: the magnitude of the
/// terms, so that the cancellation in silu'(a) near its root and CUDA/CPU expf ulp differences
/// pass; floor: the subnormal spacing of the output dtype).
void expect_close(const std::vector<float>& got, const std::vector<float>& ref, double rtol, double atol,
                  const std::vector<double>& scale, double floor, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(double(got[i]) - ref[i]), rtol * std::fabs(ref[i]) + atol * scale[i] + floor)
        << what << " i=" << i << " got=" << got[i] << " ref=" << ref[i];
  }
}

TEST(SwiGluCuda, ForwardAndBackwardMatchCpu) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t rows : {1, 5, 1000}) {
      for (int64_t f : {1, 3, 7, 8, 130, 1000, 4096}) {
        const std::string what = fmt::format("{} rows={} f={}", dtype_name(t), rows, f);
        const auto xv = rounded(testing::randn(rows * 2 * f, 2.f), t), gv = rounded(testing::randn(rows * f), t);
        auto xc = testing::make_tensor(xv, DType::kF32, kCpu, {rows, 2 * f}, cs);
        auto dyc = testing::make_tensor(gv, DType::kF32, kCpu, {rows, f}, cs);
        OwnedTensor yc(DType::kF32, kCpu, {rows, f}), dxc(DType::kF32, kCpu, {rows, 2 * f});
        swiglu_forward(yc, xc, cs);
        swiglu_backward(dxc, dyc, xc, cs);
        const auto y_ref = testing::to_host(yc, cs), dx_ref = testing::to_host(dxc, cs);

        auto xg = testing::make_tensor(xv, t, gpu, {rows, 2 * f}, gs);
        auto dyg = testing::make_tensor(gv, t, gpu, {rows, f}, gs);
        OwnedTensor yg(t, gpu, {rows, f}), dxg(t, gpu, {rows, 2 * f});
        testing::poison(yg, gs);
        testing::poison(dxg, gs);
        swiglu_forward(yg, xg, gs);
        swiglu_backward(dxg, dyg, xg, gs);
        const auto y = testing::to_host(yg, gs), dx = testing::to_host(dxg, gs);
        ASSERT_TRUE(testing::all_finite(y) && testing::all_finite(dx)) << what;
        if (rows * f >= 1000) {
          EXPECT_LT(testing::rel_err(y, y_ref), tol(t)) << what;
          EXPECT_LT(testing::rel_err(dx, dx_ref), tol(t)) << what;
        }
        // Element-wise: fp32 to 1e-5 relative; bf16/fp16 to half an ulp of the output (2^-8 / 2^-11
        // relative) plus slack; absolute slack scaled by the terms' magnitudes.
        const double rt = t == DType::kF32 ? 1e-5 : (t == DType::kBF16 ? 8e-3 : 1e-3);
        std::vector<double> sy(rows * f), sdx(rows * 2 * f);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < f; ++j) {
            const double a = xv[r * 2 * f + j], b = xv[r * 2 * f + f + j], g = gv[r * f + j];
            sy[r * f + j] = std::fabs(a * b);
            sdx[r * 2 * f + j] = std::fabs(g * b) * (1.0 + std::fabs(a));
            sdx[r * 2 * f + f + j] = std::fabs(g * a);
          }
        }
        const double floor = t == DType::kF16 ? 6e-8 : 0.0;  // fp16 subnormal spacing 2^-24
        expect_close(y, y_ref, rt, 1e-6, sy, floor, what + " y");
        expect_close(dx, dx_ref, rt, 1e-6, sdx, floor, what + " dx");
      }
    }
  }
}

TEST(SwiGluCuda, LeadingDimsAndUnalignedViews) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  const int64_t s = 6, b = 3, f = 256;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (bool unaligned : {false, true}) {
      const std::string what = fmt::format("{} unaligned={}", dtype_name(t), unaligned);
      const int64_t nx = s * b * 2 * f, ny = s * b * f, off = unaligned ? 1 : 0;
      const auto xv = rounded(testing::randn(nx + off, 2.f), t), gv = rounded(testing::randn(ny + off), t);
      auto xc = testing::make_tensor(std::vector<float>(xv.begin() + off, xv.end()), DType::kF32, kCpu, {s, b, 2 * f},
                                     cs);
      auto dyc = testing::make_tensor(std::vector<float>(gv.begin() + off, gv.end()), DType::kF32, kCpu, {s, b, f}, cs);
      OwnedTensor yc(DType::kF32, kCpu, {s, b, f}), dxc(DType::kF32, kCpu, {s, b, 2 * f});
      swiglu_forward(yc, xc, cs);
      swiglu_backward(dxc, dyc, xc, cs);

      auto xbuf = testing::make_tensor(xv, t, gpu, {nx + off}, gs);
      auto gbuf = testing::make_tensor(gv, t, gpu, {ny + off}, gs);
      OwnedTensor ybuf(t, gpu, {ny + off}), dxbuf(t, gpu, {nx + off});
      testing::poison(ybuf, gs);
      testing::poison(dxbuf, gs);
      const Tensor x = xbuf.t.flat_range(off, nx).view({s, b, 2 * f});
      const Tensor dy = gbuf.t.flat_range(off, ny).view({s, b, f});
      const Tensor y = ybuf.t.flat_range(off, ny).view({s, b, f});
      const Tensor dx = dxbuf.t.flat_range(off, nx).view({s, b, 2 * f});
      swiglu_forward(y, x, gs);
      swiglu_backward(dx, dy, x, gs);
      EXPECT_LT(testing::rel_err(testing::to_host(y, gs), testing::to_host(yc, cs)), tol(t)) << what;
      EXPECT_LT(testing::rel_err(testing::to_host(dx, gs), testing::to_host(dxc, cs)), tol(t)) << what;
    }
  }
}

TEST(SwiGluCuda, BadInputThrows) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  OwnedTensor x(DType::kBF16, gpu, {4, 8}), y(DType::kBF16, gpu, {4, 4}), dx(DType::kBF16, gpu, {4, 8});
  OwnedTensor y_cpu(DType::kBF16, kCpu, {4, 4}), y_f32(DType::kF32, gpu, {4, 4}), x_odd(DType::kBF16, gpu, {4, 7});
  OwnedTensor y_odd(DType::kBF16, gpu, {4, 3});
  testing::upload(x, testing::randn(32), gs);
  EXPECT_NO_THROW(swiglu_forward(y, x, gs));
  gs.synchronize();
  EXPECT_THROW(swiglu_forward(y_cpu, x, gs), Error);     // y on another device
  EXPECT_THROW(swiglu_forward(y_f32, x, gs), Error);     // dtype mismatch
  EXPECT_THROW(swiglu_forward(y, x, cs), Error);         // CPU stream, CUDA tensors
  EXPECT_THROW(swiglu_forward(y_odd, x_odd, gs), Error); // odd last dimension
  EXPECT_THROW(swiglu_backward(dx, y_cpu, x, gs), Error);  // dy on another device
  EXPECT_THROW(swiglu_backward(y, y, x, gs), Error);       // dx not like x
}

}  // namespace
}  // namespace mt
