// CUDA LayerNorm against the CPU reference on the same (dtype-rounded) inputs: activations fp32
// rel. 1e-5, bf16/fp16 rel. 2e-2; fp32 statistics and fp32 main grads rel. 1e-5 in every dtype
// (same inputs, only the summation order differs). dweight and dbias are deterministic: bitwise
// the same on every call.
#include <gtest/gtest.h>

#include "ops/layernorm.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::rounded;
using testing::OwnedTensor;
const Device kCpu = Device::cpu();
constexpr float kEps = 1e-5f;

double tol(DType t) { return t == DType::kF32 ? 1e-5 : 2e-2; }

TEST(LayerNormCuda, ForwardBackwardMatchCpu) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  // h = 768 and 8192 (vectorised), 100 (vectorised for fp32 only), 7 and 3 (scalar);
  // n = 10000 is more rows than one pass of the capped grid. (h = 1 and 2 are left out: there
  // the exact dx is 0 or ~eps, and a relative comparison of rounding noise is meaningless.)
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{37, 768}, {13, 100}, {5, 7}, {4, 8192}, {10000, 40},
                                                          {6, 3}};
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (auto [n, h] : sizes) {
      for (bool accumulate : {false, true}) {
        const std::string what = fmt::format("{} n={} h={} acc={}", dtype_name(t), n, h, accumulate);
        auto xv = testing::randn(n * h, 2.f);
        for (auto& v : xv) v += 3.f;
        auto wv = testing::randn(h, 0.1f), bv = testing::randn(h, 0.1f);
        for (auto& v : wv) v += 1.f;
        const auto dyv = testing::randn(n * h), dx0 = testing::randn(n * h);
        const auto dw0 = testing::randn(h), db0 = testing::randn(h);

        // CPU reference (fp32) on rounded inputs.
        auto xc = testing::make_tensor(rounded(xv, t), DType::kF32, kCpu, {n, h}, cs);
        auto wc = testing::make_tensor(rounded(wv, t), DType::kF32, kCpu, {h}, cs);
        auto bc = testing::make_tensor(rounded(bv, t), DType::kF32, kCpu, {h}, cs);
        auto dyc = testing::make_tensor(rounded(dyv, t), DType::kF32, kCpu, {n, h}, cs);
        auto dxc = testing::make_tensor(rounded(dx0, t), DType::kF32, kCpu, {n, h}, cs);
        auto dwc = testing::make_tensor(dw0, DType::kF32, kCpu, {h}, cs);
        auto dbc = testing::make_tensor(db0, DType::kF32, kCpu, {h}, cs);
        OwnedTensor yc(DType::kF32, kCpu, {n, h}), mc(DType::kF32, kCpu, {n}), rc(DType::kF32, kCpu, {n});
        layernorm_forward(yc, mc, rc, xc, wc, bc, kEps, cs);
        layernorm_backward(dxc, dwc, dbc, dyc, xc, wc, mc, rc, accumulate, cs);
        const auto mean_ref = testing::to_host(mc, cs), rstd_ref = testing::to_host(rc, cs);

        // GPU.
        auto xg = testing::make_tensor(xv, t, gpu, {n, h}, gs);
        auto wg = testing::make_tensor(wv, t, gpu, {h}, gs);
        auto bg = testing::make_tensor(bv, t, gpu, {h}, gs);
        auto dyg = testing::make_tensor(dyv, t, gpu, {n, h}, gs);
        auto dxg = testing::make_tensor(dx0, t, gpu, {n, h}, gs);
        if (!accumulate) testing::poison(dxg, gs);
        auto dwg = testing::make_tensor(dw0, DType::kF32, gpu, {h}, gs);
        auto dbg = testing::make_tensor(db0, DType::kF32, gpu, {h}, gs);
        OwnedTensor yg(t, gpu, {n, h}), mg(DType::kF32, gpu, {n}), rg(DType::kF32, gpu, {n});
        for (auto* o : {&yg, &mg, &rg}) testing::poison(*o, gs);
        layernorm_forward(yg, mg, rg, xg, wg, bg, kEps, gs);
        EXPECT_LT(testing::rel_err(testing::to_host(yg, gs), testing::to_host(yc, cs)), tol(t)) << what;
        EXPECT_LT(testing::rel_err(testing::to_host(mg, gs), mean_ref), 1e-5) << what;
        EXPECT_LT(testing::rel_err(testing::to_host(rg, gs), rstd_ref), 1e-5) << what;

        // Backward from the CPU statistics (identical inputs on both sides).
        testing::upload(mg, mean_ref, gs);
        testing::upload(rg, rstd_ref, gs);
        layernorm_backward(dxg, dwg, dbg, dyg, xg, wg, mg, rg, accumulate, gs);
        const auto dx = testing::to_host(dxg, gs);
        ASSERT_TRUE(testing::all_finite(dx)) << what;
        EXPECT_LT(testing::rel_err(dx, testing::to_host(dxc, cs)), tol(t)) << what;
        // fp32 main grads: summation order only; 1e-4 for the 10000-row reduction.
        const double gtol = n > 1000 ? 1e-4 : 1e-5;
        EXPECT_LT(testing::rel_err(testing::to_host(dwg, gs), testing::to_host(dwc, cs)), gtol) << what;
        EXPECT_LT(testing::rel_err(testing::to_host(dbg, gs), testing::to_host(dbc, cs)), gtol) << what;

        if (!accumulate) {
          // dx aliasing dy: the dweight/dbias kernel reads dy before dx overwrites it.
          auto dwg2 = testing::make_tensor(dw0, DType::kF32, gpu, {h}, gs);
          auto dbg2 = testing::make_tensor(db0, DType::kF32, gpu, {h}, gs);
          layernorm_backward(dyg, dwg2, dbg2, dyg, xg, wg, mg, rg, false, gs);
          EXPECT_EQ(testing::to_host(dyg, gs), dx) << what;  // dx kernel is deterministic
          EXPECT_LT(testing::rel_err(testing::to_host(dwg2, gs), testing::to_host(dwc, cs)), gtol) << what;
          EXPECT_LT(testing::rel_err(testing::to_host(dbg2, gs), testing::to_host(dbc, cs)), gtol) << what;
        }
      }
    }
  }
}

TEST(LayerNormCuda, UnalignedRowsUseScalarPath) {
  // x/y views starting one element into their buffers: not 16-byte aligned.
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  const int64_t n = 9, h = 768;
  for (DType t : {DType::kF32, DType::kBF16}) {
    auto xv = testing::randn(n * h + 1);
    auto wv = testing::randn(h), bv = testing::randn(h);
    auto xc = testing::make_tensor(rounded(std::vector<float>(xv.begin() + 1, xv.end()), t), DType::kF32, kCpu,
                                   {n, h}, cs);
    auto wc = testing::make_tensor(rounded(wv, t), DType::kF32, kCpu, {h}, cs);
    auto bc = testing::make_tensor(rounded(bv, t), DType::kF32, kCpu, {h}, cs);
    OwnedTensor yc(DType::kF32, kCpu, {n, h}), mc(DType::kF32, kCpu, {n}), rc(DType::kF32, kCpu, {n});
    layernorm_forward(yc, mc, rc, xc, wc, bc, kEps, cs);

    auto xbuf = testing::make_tensor(xv, t, gpu, {n * h + 1}, gs);
    auto wg = testing::make_tensor(wv, t, gpu, {h}, gs);
    auto bg = testing::make_tensor(bv, t, gpu, {h}, gs);
    OwnedTensor ybuf(t, gpu, {n * h + 1}), mg(DType::kF32, gpu, {n}), rg(DType::kF32, gpu, {n});
    testing::poison(ybuf, gs);
    const Tensor x = xbuf.t.flat_range(1, n * h).view({n, h});
    const Tensor y = ybuf.t.flat_range(1, n * h).view({n, h});
    layernorm_forward(y, mg, rg, x, wg, bg, kEps, gs);
    EXPECT_LT(testing::rel_err(testing::to_host(y, gs), testing::to_host(yc, cs)), tol(t)) << dtype_name(t);
    EXPECT_LT(testing::rel_err(testing::to_host(rg, gs), testing::to_host(rc, cs)), 1e-5) << dtype_name(t);
  }
}

/// dweight, dbias (and dx) the same bits on three calls from the same inputs, with many row groups
/// (n = 16384: an order of float atomics would show), vectorised (768, 4096) and scalar (h = 1001).
TEST(LayerNormCuda, DweightDbiasBitwiseRepeatable) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  for (auto [t, n, h] : std::vector<std::tuple<DType, int64_t, int64_t>>{
           {DType::kBF16, 16384, 768}, {DType::kF32, 2048, 4096}, {DType::kF16, 5000, 1001}}) {
    const std::string what = fmt::format("{} n={} h={}", dtype_name(t), n, h);
    auto xv = testing::randn(n * h, 2.f);
    for (auto& v : xv) v += 3.f;
    auto wv = testing::randn(h, 0.1f), bv = testing::randn(h, 0.1f);
    for (auto& v : wv) v += 1.f;
    const auto dyv = testing::randn(n * h), dw0 = testing::randn(h), db0 = testing::randn(h);
    auto xg = testing::make_tensor(xv, t, gpu, {n, h}, gs);
    auto wg = testing::make_tensor(wv, t, gpu, {h}, gs);
    auto bg = testing::make_tensor(bv, t, gpu, {h}, gs);
    auto dyg = testing::make_tensor(dyv, t, gpu, {n, h}, gs);
    OwnedTensor yg(t, gpu, {n, h}), mg(DType::kF32, gpu, {n}), rg(DType::kF32, gpu, {n}), dxg(t, gpu, {n, h});
    layernorm_forward(yg, mg, rg, xg, wg, bg, kEps, gs);
    std::vector<float> dw1, db1, dx1;
    for (int k = 0; k < 3; ++k) {
      auto dwg = testing::make_tensor(dw0, DType::kF32, gpu, {h}, gs);
      auto dbg = testing::make_tensor(db0, DType::kF32, gpu, {h}, gs);
      testing::poison(dxg, gs);
      layernorm_backward(dxg, dwg, dbg, dyg, xg, wg, mg, rg, false, gs);
      const auto dw = testing::to_host(dwg, gs), db = testing::to_host(dbg, gs), dx = testing::to_host(dxg, gs);
      if (k == 0) {
        dw1 = dw;
        db1 = db;
        dx1 = dx;
        auto xc = testing::make_tensor(rounded(xv, t), DType::kF32, kCpu, {n, h}, cs);
        auto wc = testing::make_tensor(rounded(wv, t), DType::kF32, kCpu, {h}, cs);
        auto dyc = testing::make_tensor(rounded(dyv, t), DType::kF32, kCpu, {n, h}, cs);
        auto mc = testing::make_tensor(testing::to_host(mg, gs), DType::kF32, kCpu, {n}, cs);
        auto rc = testing::make_tensor(testing::to_host(rg, gs), DType::kF32, kCpu, {n}, cs);
        auto dwc = testing::make_tensor(dw0, DType::kF32, kCpu, {h}, cs);
        auto dbc = testing::make_tensor(db0, DType::kF32, kCpu, {h}, cs);
        OwnedTensor dxc(DType::kF32, kCpu, {n, h});
        layernorm_backward(dxc, dwc, dbc, dyc, xc, wc, mc, rc, false, cs);
        EXPECT_LT(testing::rel_err(dw, testing::to_host(dwc, cs)), 1e-4) << what;
        EXPECT_LT(testing::rel_err(db, testing::to_host(dbc, cs)), 1e-4) << what;
      } else {
        EXPECT_EQ(dw, dw1) << what << " call " << k;
        EXPECT_EQ(db, db1) << what << " call " << k;
        EXPECT_EQ(dx, dx1) << what << " call " << k;
      }
    }
  }
}

// --apply-layernorm-1p: zero_centered_gamma on the GPU (weight w in the activation dtype, the 1
// added in fp32) against the CPU op with the fp32 weight 1 + w, on each kernel path: scalar,
// rows in registers (vectorised, one fused backward), long rows (two kernels).
TEST(LayerNormCuda, ZeroCenteredGammaMatchesCpuOnePlusWeight) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (auto [n, h] : std::vector<std::pair<int64_t, int64_t>>{{5, 7}, {37, 1024}, {2, 16384}}) {
      const std::string what = fmt::format("{} n={} h={}", dtype_name(t), n, h);
      auto xv = testing::randn(n * h, 2.f);
      for (auto& v : xv) v += 3.f;
      const auto w0 = testing::randn(h, 0.1f), bv = testing::randn(h, 0.1f), dyv = testing::randn(n * h);
      std::vector<float> w1 = rounded(w0, t);
      for (auto& v : w1) v += 1.f;
      auto xc = testing::make_tensor(rounded(xv, t), DType::kF32, kCpu, {n, h}, cs);
      auto wc = testing::make_tensor(w1, DType::kF32, kCpu, {h}, cs);
      auto bc = testing::make_tensor(rounded(bv, t), DType::kF32, kCpu, {h}, cs);
      auto dyc = testing::make_tensor(rounded(dyv, t), DType::kF32, kCpu, {n, h}, cs);
      OwnedTensor yc(DType::kF32, kCpu, {n, h}), mc(DType::kF32, kCpu, {n}), rc(DType::kF32, kCpu, {n}),
          dxc(DType::kF32, kCpu, {n, h}), dwc(DType::kF32, kCpu, {h}), dbc(DType::kF32, kCpu, {h});
      const std::vector<float> zeros(static_cast<size_t>(h), 0.f);
      testing::upload(dwc, zeros, cs);
      testing::upload(dbc, zeros, cs);
      layernorm_forward(yc, mc, rc, xc, wc, bc, kEps, cs);
      layernorm_backward(dxc, dwc, dbc, dyc, xc, wc, mc, rc, false, cs);

      auto xg = testing::make_tensor(xv, t, gpu, {n, h}, gs);
      auto wg = testing::make_tensor(w0, t, gpu, {h}, gs);
      auto bg = testing::make_tensor(bv, t, gpu, {h}, gs);
      auto dyg = testing::make_tensor(dyv, t, gpu, {n, h}, gs);
      OwnedTensor yg(t, gpu, {n, h}), mg(DType::kF32, gpu, {n}), rg(DType::kF32, gpu, {n}), dxg(t, gpu, {n, h}),
          dwg(DType::kF32, gpu, {h}), dbg(DType::kF32, gpu, {h});
      testing::upload(dwg, zeros, gs);
      testing::upload(dbg, zeros, gs);
      layernorm_forward(yg, mg, rg, xg, wg, bg, kEps, gs, true);
      EXPECT_LT(testing::rel_err(testing::to_host(yg, gs), testing::to_host(yc, cs)), tol(t)) << what;
      testing::upload(mg, testing::to_host(mc, cs), gs);
      testing::upload(rg, testing::to_host(rc, cs), gs);
      layernorm_backward(dxg, dwg, dbg, dyg, xg, wg, mg, rg, false, gs, true);
      EXPECT_LT(testing::rel_err(testing::to_host(dxg, gs), testing::to_host(dxc, cs)), tol(t)) << what;
      EXPECT_LT(testing::rel_err(testing::to_host(dwg, gs), testing::to_host(dwc, cs)), 1e-4) << what;
      EXPECT_LT(testing::rel_err(testing::to_host(dbg, gs), testing::to_host(dbc, cs)), 1e-4) << what;
    }
  }
}

}  // namespace
}  // namespace mt
