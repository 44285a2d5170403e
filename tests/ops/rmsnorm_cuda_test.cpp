// CUDA RMSNorm against the CPU reference on the same (dtype-rounded) inputs: activations fp32
// rel. 1e-5, bf16/fp16 rel. 2e-2; fp32 rstd and fp32 main grads rel. 1e-5 in every dtype (same
// inputs, only the summation order differs). Contiguous rows (vectorised and scalar paths, rows
// per thread group 4..32), strided query-head views of a fused QKV buffer (in place, dx aliasing
// dy), unaligned views, and device errors. dweight is deterministic: bitwise the same on every
// call, on each kernel path (many blocks, so an order of float atomics would show).
#include <gtest/gtest.h>

#include "ops/rmsnorm.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;
using testing::rounded;
const Device kCpu = Device::cpu();
constexpr float kEps = 1e-5f;

double tol(DType t) { return t == DType::kF32 ? 1e-5 : 2e-2; }

std::vector<float> make_x(int64_t n) {
  auto x = testing::randn(n, 2.f);
  for (auto& v : x) v += 0.5f;
  return x;
}
std::vector<float> make_w(int64_t h) {
  auto w = testing::randn(h, 0.1f);
  for (auto& v : w) v += 1.f;
  return w;
}

TEST(RmsNormCuda, ForwardBackwardMatchCpu) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  // h: 1, 3, 7, 130 (scalar; 130 is vectorised for no dtype), 64/128 (4- and 8-thread groups per
  // row for bf16), 1000 (vectorised in every dtype), 768, 4096, 8192 (rows held in registers,
  // up to 512 threads per row; fp32 8192 takes the long-row path), 1030 (scalar, long-row path),
  // 16384 (long-row path in every dtype); rows 1, 5, 1000 and 20000 (more rows than one pass of
  // the capped grid).
  const std::vector<std::pair<int64_t, int64_t>> sizes = {
      {1, 1},     {5, 3},     {1000, 7}, {13, 130}, {5, 1000}, {37, 768},  {20000, 64},
      {1000, 128}, {3, 4096}, {4, 8192}, {1, 1000}, {3, 1030}, {2, 16384}};
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (auto [n, h] : sizes) {
      for (bool accumulate : {false, true}) {
        const std::string what = fmt::format("{} n={} h={} acc={}", dtype_name(t), n, h, accumulate);
        const auto xv = make_x(n * h), wv = make_w(h);
        const auto dyv = testing::randn(n * h), dx0 = testing::randn(n * h), dw0 = testing::randn(h);

        // CPU reference (fp32) on rounded inputs.
        auto xc = testing::make_tensor(rounded(xv, t), DType::kF32, kCpu, {n, h}, cs);
        auto wc = testing::make_tensor(rounded(wv, t), DType::kF32, kCpu, {h}, cs);
        auto dyc = testing::make_tensor(rounded(dyv, t), DType::kF32, kCpu, {n, h}, cs);
        auto dxc = testing::make_tensor(rounded(dx0, t), DType::kF32, kCpu, {n, h}, cs);
        auto dwc = testing::make_tensor(dw0, DType::kF32, kCpu, {h}, cs);
        OwnedTensor yc(DType::kF32, kCpu, {n, h}), rc(DType::kF32, kCpu, {n});
        rmsnorm_forward(yc, rc, xc, wc, kEps, cs);
        rmsnorm_backward(dxc, dwc, dyc, xc, wc, rc, accumulate, cs);
        const auto rstd_ref = testing::to_host(rc, cs);

        // GPU.
        auto xg = testing::make_tensor(xv, t, gpu, {n, h}, gs);
        auto wg = testing::make_tensor(wv, t, gpu, {h}, gs);
        auto dyg = testing::make_tensor(dyv, t, gpu, {n, h}, gs);
        auto dxg = testing::make_tensor(dx0, t, gpu, {n, h}, gs);
        if (!accumulate) testing::poison(dxg, gs);
        auto dwg = testing::make_tensor(dw0, DType::kF32, gpu, {h}, gs);
        OwnedTensor yg(t, gpu, {n, h}), rg(DType::kF32, gpu, {n});
        testing::poison(yg, gs);
        testing::poison(rg, gs);
        rmsnorm_forward(yg, rg, xg, wg, kEps, gs);
        const auto y = testing::to_host(yg, gs);
        ASSERT_TRUE(testing::all_finite(y)) << what;
        EXPECT_LT(testing::rel_err(y, testing::to_host(yc, cs)), tol(t)) << what;
        EXPECT_LT(testing::rel_err(testing::to_host(rg, gs), rstd_ref), 1e-5) << what;

        // Backward from the CPU statistics (identical inputs on both sides).
        testing::upload(rg, rstd_ref, gs);
        rmsnorm_backward(dxg, dwg, dyg, xg, wg, rg, accumulate, gs);
        const auto dx = testing::to_host(dxg, gs);
        ASSERT_TRUE(testing::all_finite(dx)) << what;
        // h = 1: dx = rstd * g * eps / (x^2 + eps) is pure cancellation (~1e-6 of g); a relative
        // comparison of rounding noise is meaningless there (the accumulated dx0 still is not).
        if (h > 1 || accumulate) {
          EXPECT_LT(testing::rel_err(dx, testing::to_host(dxc, cs)), tol(t)) << what;
        }
        // fp32 main grads: summation order only; 1e-4 for the long reductions.
        const double gtol = n >= 1000 ? 1e-4 : 1e-5;
        const auto dw_ref = testing::to_host(dwc, cs);
        EXPECT_LT(testing::rel_err(testing::to_host(dwg, gs), dw_ref), gtol) << what;

        if (!accumulate) {
          // dx aliasing dy: the dweight kernel reads dy before dx overwrites it; the dx kernel is
          // deterministic.
          auto dwg2 = testing::make_tensor(dw0, DType::kF32, gpu, {h}, gs);
          rmsnorm_backward(dyg, dwg2, dyg, xg, wg, rg, false, gs);
          EXPECT_EQ(testing::to_host(dyg, gs), dx) << what;
          EXPECT_LT(testing::rel_err(testing::to_host(dwg2, gs), dw_ref), gtol) << what;
          // y aliasing x (in place): the same values as out of place.
          rmsnorm_forward(xg, rg, xg, wg, kEps, gs);
          EXPECT_EQ(testing::to_host(xg, gs), y) << what;
        }
      }
    }
  }
}

// q/k normalisation in a fused QKV buffer [R, qpg + 2, d]: the query heads (a strided view)
// normalised in place, the key head into a contiguous output; the backward with strided x / dy
// and dx aliasing dy. d = 128 and 64 take the vectorised path (row strides are multiples of the
// vector width), d = 7 and 130 the scalar one, d = 4104 the long-row path for fp32; compared with
// the CPU doing the same on the same rounded values. Also a 4-D view [2, groups, qpg + 2, d]
// sliced in dim 2.
TEST(RmsNormCuda, StridedQkvViewsMatchCpu) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (auto [groups, qpg, d] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {500, 4, 128}, {3, 1, 64}, {250, 2, 7}, {9, 3, 130}, {2, 1, 4104}}) {
      for (int rank : {3, 4}) {
        const std::string what = fmt::format("{} groups={} qpg={} d={} rank={}", dtype_name(t), groups, qpg, d, rank);
        const int64_t heads = qpg + 2, R = 2 * groups, total = R * heads * d;
        const auto qkv_v = make_x(total), wv = make_w(d), gv = testing::randn(total);
        auto q_of = [&](const Tensor& buf) {
          const Tensor f = rank == 3 ? buf : buf.view({2, groups, heads, d});
          return f.slice(rank - 2, 0, qpg);
        };
        auto k_of = [&](const Tensor& buf) {
          const Tensor f = rank == 3 ? buf : buf.view({2, groups, heads, d});
          return f.slice(rank - 2, qpg, qpg + 1);
        };
        std::vector<int64_t> kshape = rank == 3 ? std::vector<int64_t>{R, 1, d} : std::vector<int64_t>{2, groups, 1, d};

        // CPU: forward in place on the queries, key into ky; backward of the queries in place on dy.
        auto qkv_c = testing::make_tensor(rounded(qkv_v, t), DType::kF32, kCpu, {R, heads, d}, cs);
        auto x_c = testing::make_tensor(rounded(qkv_v, t), DType::kF32, kCpu, {R, heads, d}, cs);
        auto g_c = testing::make_tensor(rounded(gv, t), DType::kF32, kCpu, {R, heads, d}, cs);
        auto w_c = testing::make_tensor(rounded(wv, t), DType::kF32, kCpu, {d}, cs);
        OwnedTensor ky_c(DType::kF32, kCpu, kshape), rq_c(DType::kF32, kCpu, {R * qpg}), rk_c(DType::kF32, kCpu, {R});
        auto dw_c = testing::make_tensor(std::vector<float>(d, 0.f), DType::kF32, kCpu, {d}, cs);
        rmsnorm_forward(q_of(qkv_c), rq_c, q_of(qkv_c), w_c, kEps, cs);
        rmsnorm_forward(ky_c, rk_c, k_of(qkv_c), w_c, kEps, cs);
        rmsnorm_backward(q_of(g_c), dw_c, q_of(g_c), q_of(x_c), w_c, rq_c, false, cs);

        auto qkv_g = testing::make_tensor(qkv_v, t, gpu, {R, heads, d}, gs);
        auto x_g = testing::make_tensor(qkv_v, t, gpu, {R, heads, d}, gs);
        auto g_g = testing::make_tensor(gv, t, gpu, {R, heads, d}, gs);
        auto w_g = testing::make_tensor(wv, t, gpu, {d}, gs);
        OwnedTensor ky_g(t, gpu, kshape), rq_g(DType::kF32, gpu, {R * qpg}), rk_g(DType::kF32, gpu, {R});
        testing::poison(ky_g, gs);
        testing::poison(rq_g, gs);
        auto dw_g = testing::make_tensor(std::vector<float>(d, 0.f), DType::kF32, gpu, {d}, gs);
        rmsnorm_forward(q_of(qkv_g), rq_g, q_of(qkv_g), w_g, kEps, gs);
        rmsnorm_forward(ky_g, rk_g, k_of(qkv_g), w_g, kEps, gs);
        const auto rq = testing::to_host(rq_c, cs);
        testing::upload(rq_g, rq, gs);  // backward from identical statistics
        rmsnorm_backward(q_of(g_g), dw_g, q_of(g_g), q_of(x_g), w_g, rq_g, false, gs);

        const auto qkv = testing::to_host(qkv_g, gs), grad = testing::to_host(g_g, gs);
        ASSERT_TRUE(testing::all_finite(qkv) && testing::all_finite(grad)) << what;
        EXPECT_LT(testing::rel_err(qkv, testing::to_host(qkv_c, cs)), tol(t)) << what;
        EXPECT_LT(testing::rel_err(grad, testing::to_host(g_c, cs)), tol(t)) << what;
        EXPECT_LT(testing::rel_err(testing::to_host(ky_g, gs), testing::to_host(ky_c, cs)), tol(t)) << what;
        EXPECT_LT(testing::rel_err(testing::to_host(rk_g, gs), testing::to_host(rk_c, cs)), 1e-5) << what;
        EXPECT_LT(testing::rel_err(testing::to_host(dw_g, gs), testing::to_host(dw_c, cs)), 1e-4) << what;
        // Key and value heads untouched, bitwise (in the forward and in the gradient buffer).
        const auto qkv_in = rounded(qkv_v, t), g_in = rounded(gv, t);
        for (int64_t r = 0; r < R; ++r) {
          for (int64_t c = (r * heads + qpg) * d; c < (r + 1) * heads * d; ++c) {
            ASSERT_EQ(qkv[c], qkv_in[c]) << what << " r=" << r;
            ASSERT_EQ(grad[c], g_in[c]) << what << " r=" << r;
          }
        }
      }
    }
  }
}

TEST(RmsNormCuda, UnalignedRowsUseScalarPath) {
  // x / y / dy / dx views starting one element into their buffers: not 16-byte aligned.
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  const int64_t n = 9, h = 768;
  for (DType t : {DType::kF32, DType::kBF16}) {
    const auto xv = make_x(n * h + 1), wv = make_w(h), gv = testing::randn(n * h + 1);
    auto tail = [&](const std::vector<float>& v) { return rounded(std::vector<float>(v.begin() + 1, v.end()), t); };
    auto xc = testing::make_tensor(tail(xv), DType::kF32, kCpu, {n, h}, cs);
    auto dyc = testing::make_tensor(tail(gv), DType::kF32, kCpu, {n, h}, cs);
    auto wc = testing::make_tensor(rounded(wv, t), DType::kF32, kCpu, {h}, cs);
    OwnedTensor yc(DType::kF32, kCpu, {n, h}), rc(DType::kF32, kCpu, {n}), dxc(DType::kF32, kCpu, {n, h});
    auto dwc = testing::make_tensor(std::vector<float>(h, 0.f), DType::kF32, kCpu, {h}, cs);
    rmsnorm_forward(yc, rc, xc, wc, kEps, cs);
    rmsnorm_backward(dxc, dwc, dyc, xc, wc, rc, false, cs);

    auto xbuf = testing::make_tensor(xv, t, gpu, {n * h + 1}, gs);
    auto gbuf = testing::make_tensor(gv, t, gpu, {n * h + 1}, gs);
    auto wg = testing::make_tensor(wv, t, gpu, {h}, gs);
    OwnedTensor ybuf(t, gpu, {n * h + 1}), dxbuf(t, gpu, {n * h + 1}), rg(DType::kF32, gpu, {n});
    testing::poison(ybuf, gs);
    testing::poison(dxbuf, gs);
    auto dwg = testing::make_tensor(std::vector<float>(h, 0.f), DType::kF32, gpu, {h}, gs);
    const Tensor x = xbuf.t.flat_range(1, n * h).view({n, h});
    const Tensor y = ybuf.t.flat_range(1, n * h).view({n, h});
    const Tensor dy = gbuf.t.flat_range(1, n * h).view({n, h});
    const Tensor dx = dxbuf.t.flat_range(1, n * h).view({n, h});
    rmsnorm_forward(y, rg, x, wg, kEps, gs);
    EXPECT_LT(testing::rel_err(testing::to_host(y, gs), testing::to_host(yc, cs)), tol(t)) << dtype_name(t);
    EXPECT_LT(testing::rel_err(testing::to_host(rg, gs), testing::to_host(rc, cs)), 1e-5) << dtype_name(t);
    testing::upload(rg, testing::to_host(rc, cs), gs);
    rmsnorm_backward(dx, dwg, dy, x, wg, rg, false, gs);
    EXPECT_LT(testing::rel_err(testing::to_host(dx, gs), testing::to_host(dxc, cs)), tol(t)) << dtype_name(t);
    EXPECT_LT(testing::rel_err(testing::to_host(dwg, gs), testing::to_host(dwc, cs)), 1e-5) << dtype_name(t);
  }
}

/// dweight (and dx) the same bits on three calls from the same inputs, on the fused kernel with
/// several row groups per block (h = 64, 768) and one per block (bf16 h = 4096: 256 threads per
/// row; 8192: 512), on the long-row path (fp32 h = 8192, h = 16384) and the scalar path (h = 1030);
/// and within the long-reduction tolerance of the CPU.
TEST(RmsNormCuda, DweightBitwiseRepeatable) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  const std::vector<std::tuple<DType, int64_t, int64_t>> cases = {
      {DType::kBF16, 20000, 64}, {DType::kBF16, 8192, 768}, {DType::kBF16, 1024, 4096}, {DType::kBF16, 512, 8192},
      {DType::kF32, 512, 8192},  {DType::kBF16, 256, 16384}, {DType::kF16, 3000, 1030}};
  for (auto [t, n, h] : cases) {
    const std::string what = fmt::format("{} n={} h={}", dtype_name(t), n, h);
    const auto xv = make_x(n * h), wv = make_w(h), dyv = testing::randn(n * h), dw0 = testing::randn(h);
    auto xg = testing::make_tensor(xv, t, gpu, {n, h}, gs);
    auto wg = testing::make_tensor(wv, t, gpu, {h}, gs);
    auto dyg = testing::make_tensor(dyv, t, gpu, {n, h}, gs);
    OwnedTensor yg(t, gpu, {n, h}), rg(DType::kF32, gpu, {n}), dxg(t, gpu, {n, h});
    rmsnorm_forward(yg, rg, xg, wg, kEps, gs);
    std::vector<float> dw_first, dx_first;
    for (int k = 0; k < 3; ++k) {
      auto dwg = testing::make_tensor(dw0, DType::kF32, gpu, {h}, gs);
      testing::poison(dxg, gs);
      rmsnorm_backward(dxg, dwg, dyg, xg, wg, rg, false, gs);
      const auto dw = testing::to_host(dwg, gs), dx = testing::to_host(dxg, gs);
      if (k == 0) {
        dw_first = dw;
        dx_first = dx;
        // Against the CPU from the same rounded inputs and statistics.
        auto xc = testing::make_tensor(rounded(xv, t), DType::kF32, kCpu, {n, h}, cs);
        auto wc = testing::make_tensor(rounded(wv, t), DType::kF32, kCpu, {h}, cs);
        auto dyc = testing::make_tensor(rounded(dyv, t), DType::kF32, kCpu, {n, h}, cs);
        auto rc = testing::make_tensor(testing::to_host(rg, gs), DType::kF32, kCpu, {n}, cs);
        auto dwc = testing::make_tensor(dw0, DType::kF32, kCpu, {h}, cs);
        OwnedTensor dxc(DType::kF32, kCpu, {n, h});
        rmsnorm_backward(dxc, dwc, dyc, xc, wc, rc, false, cs);
        EXPECT_LT(testing::rel_err(dw, testing::to_host(dwc, cs)), 1e-4) << what;
      } else {
        EXPECT_EQ(dw, dw_first) << what << " call " << k;
        EXPECT_EQ(dx, dx_first) << what << " call " << k;
      }
    }
  }
}

TEST(RmsNormCuda, BadInputThrows) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  const int64_t n = 4, h = 8;
  OwnedTensor x(DType::kBF16, gpu, {n, h}), y(DType::kBF16, gpu, {n, h}), w(DType::kBF16, gpu, {h});
  OwnedTensor rstd(DType::kF32, gpu, {n}), dw(DType::kF32, gpu, {h});
  OwnedTensor w_cpu(DType::kBF16, kCpu, {h}), rstd_cpu(DType::kF32, kCpu, {n}), w_f32(DType::kF32, gpu, {h});
  OwnedTensor dw_bf16(DType::kBF16, gpu, {h}), xi(DType::kI32, gpu, {n, h});
  testing::upload(x, make_x(n * h), gs);
  testing::upload(w, make_w(h), gs);
  EXPECT_NO_THROW(rmsnorm_forward(y, rstd, x, w, kEps, gs));
  gs.synchronize();
  EXPECT_THROW(rmsnorm_forward(y, rstd, x, w_cpu, kEps, gs), Error);     // weight on another device
  EXPECT_THROW(rmsnorm_forward(y, rstd_cpu, x, w, kEps, gs), Error);     // rstd on another device
  EXPECT_THROW(rmsnorm_forward(y, rstd, x, w_f32, kEps, gs), Error);     // weight dtype != act dtype
  EXPECT_THROW(rmsnorm_forward(y, rstd, x, w, kEps, cs), Error);         // CPU stream, CUDA tensors
  EXPECT_THROW(rmsnorm_forward(xi, rstd, xi, w, kEps, gs), Error);       // int dtype
  EXPECT_THROW(rmsnorm_backward(x, dw_bf16, y, x, w, rstd, false, gs), Error);  // dweight not fp32
  EXPECT_THROW(rmsnorm_backward(x, dw, y, x, w, rstd_cpu, false, gs), Error);   // rstd on another device
}

// --apply-layernorm-1p: zero_centered_gamma on the GPU (weight w in the activation dtype, the 1
// added in fp32) against the CPU op with the fp32 weight 1 + w, on each kernel path: scalar,
// rows in registers (vectorised), long rows (the column-parallel dweight kernel).
TEST(RmsNormCuda, ZeroCenteredGammaMatchesCpuOnePlusWeight) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (auto [n, h] : std::vector<std::pair<int64_t, int64_t>>{{5, 7}, {37, 1024}, {2, 16384}}) {
      const std::string what = fmt::format("{} n={} h={}", dtype_name(t), n, h);
      const auto xv = make_x(n * h), w0 = testing::randn(h, 0.1f), dyv = testing::randn(n * h);
      std::vector<float> w1 = rounded(w0, t);
      for (auto& v : w1) v += 1.f;
      auto xc = testing::make_tensor(rounded(xv, t), DType::kF32, kCpu, {n, h}, cs);
      auto wc = testing::make_tensor(w1, DType::kF32, kCpu, {h}, cs);
      auto dyc = testing::make_tensor(rounded(dyv, t), DType::kF32, kCpu, {n, h}, cs);
      OwnedTensor yc(DType::kF32, kCpu, {n, h}), rc(DType::kF32, kCpu, {n}), dxc(DType::kF32, kCpu, {n, h}),
          dwc(DType::kF32, kCpu, {h});
      testing::upload(dwc, std::vector<float>(static_cast<size_t>(h), 0.f), cs);
      rmsnorm_forward(yc, rc, xc, wc, kEps, cs);
      rmsnorm_backward(dxc, dwc, dyc, xc, wc, rc, false, cs);

      auto xg = testing::make_tensor(xv, t, gpu, {n, h}, gs);
      auto wg = testing::make_tensor(w0, t, gpu, {h}, gs);
      auto dyg = testing::make_tensor(dyv, t, gpu, {n, h}, gs);
      OwnedTensor yg(t, gpu, {n, h}), rg(DType::kF32, gpu, {n}), dxg(t, gpu, {n, h}), dwg(DType::kF32, gpu, {h});
      testing::upload(dwg, std::vector<float>(static_cast<size_t>(h), 0.f), gs);
      rmsnorm_forward(yg, rg, xg, wg, kEps, gs, true);
      EXPECT_LT(testing::rel_err(testing::to_host(yg, gs), testing::to_host(yc, cs)), tol(t)) << what;
      testing::upload(rg, testing::to_host(rc, cs), gs);
      rmsnorm_backward(dxg, dwg, dyg, xg, wg, rg, false, gs, true);
      EXPECT_LT(testing::rel_err(testing::to_host(dxg, gs), testing::to_host(dxc, cs)), tol(t)) << what;
      EXPECT_LT(testing::rel_err(testing::to_host(dwg, gs), testing::to_host(dwc, cs)), 1e-4) << what;
    }
  }
}

}  // namespace
}  // namespace mt
