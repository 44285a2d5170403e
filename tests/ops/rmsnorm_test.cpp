// CPU RMSNorm against a float64 reference (forward) and central finite differences of that
// reference (backward); strided row views (q/k normalisation inside a fused QKV buffer), in place
// and aliasing; a test per documented error.
#include <gtest/gtest.h>

#include <cmath>

#include "ops/elementwise.h"
#include "ops/rmsnorm.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;
const Device kCpu = Device::cpu();
constexpr float kEps = 1e-5f;

/// Row of the float64 reference: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
void rms_row_ref(const double* x, const double* w, int64_t h, double eps, double* y, double* rstd = nullptr) {
  double ss = 0;
  for (int64_t c = 0; c < h; ++c) ss += x[c] * x[c];
  const double rs = 1.0 / std::sqrt(ss / h + eps);
  for (int64_t c = 0; c < h; ++c) y[c] = x[c] * rs * w[c];
  if (rstd) *rstd = rs;
}

/// Analytic float64 gradients of one row: dx = rs (g - xhat mean(g xhat)), g = dy w; dw += dy xhat.
void rms_row_grad_ref(const double* x, const double* w, const double* dy, int64_t h, double eps, double* dx,
                      double* dw) {
  double ss = 0;
  for (int64_t c = 0; c < h; ++c) ss += x[c] * x[c];
  const double rs = 1.0 / std::sqrt(ss / h + eps);
  double sgx = 0;
  for (int64_t c = 0; c < h; ++c) sgx += dy[c] * w[c] * x[c] * rs;
  for (int64_t c = 0; c < h; ++c) {
    dx[c] = rs * (dy[c] * w[c] - x[c] * rs * sgx / h);
    dw[c] += dy[c] * x[c] * rs;
  }
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

/// x ~ N(0.5, 2^2) (a non-zero mean: RMSNorm does not centre), weight ~ 1 + N(0, 0.1^2).
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

TEST(RmsNorm, ForwardMatchesFloat64Reference) {
  Stream st;
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{6, 7}, {5, 100}, {4, 768}, {3, 8192}, {2, 1}};
  for (auto [n, h] : sizes) {
    auto xv = make_x(n * h), wv = make_w(h);
    auto x = testing::make_tensor(xv, DType::kF32, kCpu, {n, 1, h}, st);  // leading dims flattened
    auto w = testing::make_tensor(wv, DType::kF32, kCpu, {h}, st);
    OwnedTensor y(DType::kF32, kCpu, {n, 1, h}), rstd(DType::kF32, kCpu, {n});
    testing::poison(y, st);
    testing::poison(rstd, st);
    rmsnorm_forward(y, rstd, x, w, kEps, st);

    auto xd = to_double(xv), wd = to_double(wv);
    std::vector<double> yr(n * h), rr(n);
    for (int64_t r = 0; r < n; ++r) rms_row_ref(&xd[r * h], wd.data(), h, kEps, &yr[r * h], &rr[r]);
    const auto yv = testing::to_host(y, st);
    EXPECT_LT(testing::rel_err(yv, yr), 1e-5) << "n=" << n << " h=" << h;
    EXPECT_LT(testing::rel_err(testing::to_host(rstd, st), rr), 1e-5) << "n=" << n << " h=" << h;

    // In place (y aliases x): the same values.
    rmsnorm_forward(x, rstd, x, w, kEps, st);
    EXPECT_EQ(testing::to_host(x, st), yv) << "n=" << n << " h=" << h;
  }
}

// Loss L = sum_{r,c} g[r,c] * y[r,c] with fixed random g; the op's gradients are compared with
// central differences of the float64 reference (tolerance 1e-4: dx is a difference of two terms).
// h = 1 is left out: there dx = rstd * g * w * eps / (x^2 + eps) is ~1e-6 of its terms, and the
// fp32 result is rounding noise of their difference.
// --apply-layernorm-1p: with zero_centered_gamma the op scales by 1 + w (the 1 added in fp32).
// Forward against the float64 reference with weight 1 + w; forward and backward bitwise equal to
// the plain op given the fp32 weight 1 + w, and not to the plain op given w.
TEST(RmsNorm, ZeroCenteredGammaIsOnePlusWeight) {
  Stream st;
  const int64_t n = 5, h = 100;
  const std::vector<float> xv = make_x(n * h);
  std::vector<float> w0 = testing::randn(h, 0.1f), w1(w0);
  for (auto& v : w1) v += 1.f;
  auto x = testing::make_tensor(xv, DType::kF32, kCpu, {n, h}, st);
  auto dy = testing::make_tensor(testing::randn(n * h, 1.f), DType::kF32, kCpu, {n, h}, st);
  struct Out {
    std::vector<float> y, dx, dw;
  };
  auto run = [&](const std::vector<float>& wv, bool zc) {
    auto w = testing::make_tensor(wv, DType::kF32, kCpu, {h}, st);
    OwnedTensor y(DType::kF32, kCpu, {n, h}), rstd(DType::kF32, kCpu, {n}), dx(DType::kF32, kCpu, {n, h}),
        dw(DType::kF32, kCpu, {h});
    fill(dw, 0.f, st);
    rmsnorm_forward(y, rstd, x, w, kEps, st, zc);
    rmsnorm_backward(dx, dw, dy, x, w, rstd, false, st, zc);
    return Out{testing::to_host(y, st), testing::to_host(dx, st), testing::to_host(dw, st)};
  };
  const Out zc = run(w0, true), plain = run(w1, false), wrong = run(w0, false);
  EXPECT_EQ(zc.y, plain.y);
  EXPECT_EQ(zc.dx, plain.dx);
  EXPECT_EQ(zc.dw, plain.dw);
  EXPECT_NE(zc.y, wrong.y);
  EXPECT_NE(zc.dx, wrong.dx);
  auto xd = to_double(xv), wd = to_double(w0);
  for (auto& v : wd) v += 1.0;
  std::vector<double> yr(n * h);
  for (int64_t r = 0; r < n; ++r) rms_row_ref(&xd[r * h], wd.data(), h, kEps, &yr[r * h]);
  EXPECT_LT(testing::rel_err(zc.y, yr), 1e-5);
}

TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  Stream st;
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{6, 7}, {5, 100}, {3, 256}, {4, 2}};
  for (auto [n, h] : sizes) {
    for (bool accumulate : {false, true}) {
      auto xv = make_x(n * h), wv = make_w(h);
      auto g = testing::randn(n * h);
      auto x = testing::make_tensor(xv, DType::kF32, kCpu, {n, h}, st);
      auto w = testing::make_tensor(wv, DType::kF32, kCpu, {h}, st);
      OwnedTensor y(DType::kF32, kCpu, {n, h}), rstd(DType::kF32, kCpu, {n});
      rmsnorm_forward(y, rstd, x, w, kEps, st);

      auto dy = testing::make_tensor(g, DType::kF32, kCpu, {n, h}, st);
      auto dx0 = testing::randn(n * h), dw0 = testing::randn(h);
      OwnedTensor dx(DType::kF32, kCpu, {n, h});
      if (accumulate) {
        testing::upload(dx, dx0, st);
      } else {
        testing::poison(dx, st);
      }
      auto dw = testing::make_tensor(dw0, DType::kF32, kCpu, {h}, st);
      rmsnorm_backward(dx, dw, dy, x, w, rstd, accumulate, st);

      auto xd = to_double(xv), wd = to_double(wv);
      std::vector<double> yrow(h);
      auto row_loss = [&](int64_t r) {
        rms_row_ref(&xd[r * h], wd.data(), h, kEps, yrow.data());
        double l = 0;
        for (int64_t c = 0; c < h; ++c) l += g[r * h + c] * yrow[c];
        return l;
      };
      auto loss = [&] {
        double l = 0;
        for (int64_t r = 0; r < n; ++r) l += row_loss(r);
        return l;
      };
      std::vector<double> dx_ref(n * h), dw_ref(h);
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = 0; c < h; ++c) {
          dx_ref[r * h + c] = (accumulate ? dx0[r * h + c] : 0.0) +
                              testing::finite_diff([&] { return row_loss(r); }, xd, r * h + c);
        }
      }
      for (int64_t c = 0; c < h; ++c) dw_ref[c] = dw0[c] + testing::finite_diff(loss, wd, c);
      EXPECT_LT(testing::rel_err(testing::to_host(dx, st), dx_ref), 1e-4) << "n=" << n << " h=" << h;
      EXPECT_LT(testing::rel_err(testing::to_host(dw, st), dw_ref), 1e-4) << "n=" << n << " h=" << h;
    }
  }
}

TEST(RmsNorm, BackwardAnalyticFloat64AndAliasing) {
  // Tighter check against the analytic float64 gradient, and dx aliasing dy.
  Stream st;
  const int64_t n = 9, h = 100;
  auto xv = make_x(n * h), wv = make_w(h), g = testing::randn(n * h);
  auto x = testing::make_tensor(xv, DType::kF32, kCpu, {n, h}, st);
  auto w = testing::make_tensor(wv, DType::kF32, kCpu, {h}, st);
  OwnedTensor y(DType::kF32, kCpu, {n, h}), rstd(DType::kF32, kCpu, {n});
  rmsnorm_forward(y, rstd, x, w, kEps, st);
  auto dy = testing::make_tensor(g, DType::kF32, kCpu, {n, h}, st);
  OwnedTensor dx(DType::kF32, kCpu, {n, h});
  testing::poison(dx, st);
  auto dw = testing::make_tensor(std::vector<float>(h, 0.f), DType::kF32, kCpu, {h}, st);
  rmsnorm_backward(dx, dw, dy, x, w, rstd, false, st);

  auto xd = to_double(xv), wd = to_double(wv), gd = to_double(g);
  std::vector<double> dx_ref(n * h), dw_ref(h, 0.0);
  for (int64_t r = 0; r < n; ++r) {
    rms_row_grad_ref(&xd[r * h], wd.data(), &gd[r * h], h, kEps, &dx_ref[r * h], dw_ref.data());
  }
  const auto dxv = testing::to_host(dx, st);
  EXPECT_LT(testing::rel_err(dxv, dx_ref), 1e-5);
  EXPECT_LT(testing::rel_err(testing::to_host(dw, st), dw_ref), 1e-5);

  // dx aliasing dy: identical result.
  auto dw2 = testing::make_tensor(std::vector<float>(h, 0.f), DType::kF32, kCpu, {h}, st);
  rmsnorm_backward(dy, dw2, dy, x, w, rstd, false, st);
  EXPECT_EQ(testing::to_host(dy, st), dxv);
  EXPECT_EQ(testing::to_host(dw2, st), testing::to_host(dw, st));
}

// q/k normalisation in a fused QKV buffer: qkv [R, qpg + 2, d]; the query heads
// qkv.slice(1, 0, qpg) ([R, qpg, d], rows strided) are normalised in place, and the key head
// qkv.slice(1, qpg, qpg + 1) into a separate contiguous output. Also a 4-D view
// [s·b, g, qpg + 2, d] sliced in dim 2 (leading dims merged into one stride), and the backward
// with strided dy / dx (dx aliasing dy in place).
TEST(RmsNorm, StridedRowViews) {
  Stream st;
  for (auto [groups, qpg, d] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{7, 3, 16}, {5, 1, 7}, {3, 2, 64}}) {
    const int64_t heads = qpg + 2, R = 2 * groups;  // as [R] and as [2, groups]
    const int64_t total = R * heads * d;
    const auto qkv_v = make_x(total), wv = make_w(d);
    auto w = testing::make_tensor(wv, DType::kF32, kCpu, {d}, st);
    auto xd = to_double(qkv_v), wd = to_double(wv);
    auto at = [&](int64_t r, int64_t head) { return (r * heads + head) * d; };

    for (int view_rank : {3, 4}) {
      auto qkv = testing::make_tensor(qkv_v, DType::kF32, kCpu, {R, heads, d}, st);
      const Tensor full = view_rank == 3 ? qkv.t : qkv.t.view({2, groups, heads, d});
      const Tensor q = full.slice(view_rank - 2, 0, qpg);
      const Tensor k = full.slice(view_rank - 2, qpg, qpg + 1);
      OwnedTensor rq(DType::kF32, kCpu, {R * qpg}), rk(DType::kF32, kCpu, {R});
      std::vector<int64_t> kshape = k.shape();
      OwnedTensor ky(DType::kF32, kCpu, kshape);
      testing::poison(ky, st);
      testing::poison(rq, st);
      rmsnorm_forward(q, rq, q, w, kEps, st);   // in place, strided
      rmsnorm_forward(ky, rk, k, w, kEps, st);  // strided in, contiguous out

      std::vector<double> want(qkv_v.begin(), qkv_v.end()), want_k(R * d), want_rq(R * qpg), want_rk(R);
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t hq = 0; hq < qpg; ++hq) {
          rms_row_ref(&xd[at(r, hq)], wd.data(), d, kEps, &want[at(r, hq)], &want_rq[r * qpg + hq]);
        }
        rms_row_ref(&xd[at(r, qpg)], wd.data(), d, kEps, &want_k[r * d], &want_rk[r]);
      }
      const auto got = testing::to_host(qkv, st);
      EXPECT_LT(testing::rel_err(got, want), 1e-5) << "rank " << view_rank;
      for (int64_t r = 0; r < R; ++r) {  // key and value heads untouched, bitwise
        for (int64_t c = at(r, qpg); c < at(r, qpg) + 2 * d; ++c) ASSERT_EQ(got[c], qkv_v[c]) << "r=" << r;
      }
      EXPECT_LT(testing::rel_err(testing::to_host(ky, st), want_k), 1e-5) << "rank " << view_rank;
      EXPECT_LT(testing::rel_err(testing::to_host(rq, st), want_rq), 1e-5) << "rank " << view_rank;
      EXPECT_LT(testing::rel_err(testing::to_host(rk, st), want_rk), 1e-5) << "rank " << view_rank;

      // Backward of the query-head normalisation: x = the original query heads (strided view of a
      // fresh copy), dy strided in another fused buffer, dx written over dy in place.
      auto xbuf = testing::make_tensor(qkv_v, DType::kF32, kCpu, {R, heads, d}, st);
      const auto gv = testing::randn(total);
      auto gbuf = testing::make_tensor(gv, DType::kF32, kCpu, {R, heads, d}, st);
      auto view_of = [&](const Tensor& t) {
        const Tensor f = view_rank == 3 ? t : t.view({2, groups, heads, d});
        return f.slice(view_rank - 2, 0, qpg);
      };
      const Tensor xq = view_of(xbuf), dyq = view_of(gbuf);
      auto dw = testing::make_tensor(std::vector<float>(d, 0.f), DType::kF32, kCpu, {d}, st);
      testing::upload(rq, std::vector<float>(want_rq.begin(), want_rq.end()), st);
      rmsnorm_backward(dyq, dw, dyq, xq, w, rq, false, st);
      std::vector<double> want_dx(gv.begin(), gv.end()), want_dw(d, 0.0), gd = to_double(gv);
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t hq = 0; hq < qpg; ++hq) {
          rms_row_grad_ref(&xd[at(r, hq)], wd.data(), &gd[at(r, hq)], d, kEps, &want_dx[at(r, hq)], want_dw.data());
        }
      }
      const auto got_dx = testing::to_host(gbuf, st);
      EXPECT_LT(testing::rel_err(got_dx, want_dx), 1e-5) << "rank " << view_rank;
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t c = at(r, qpg); c < at(r, qpg) + 2 * d; ++c) ASSERT_EQ(got_dx[c], gv[c]) << "r=" << r;
      }
      EXPECT_LT(testing::rel_err(testing::to_host(dw, st), want_dw), 1e-5) << "rank " << view_rank;
    }
  }
}

TEST(RmsNorm, BadInputThrows) {
  Stream st;
  const int64_t n = 4, h = 8;
  auto x = testing::make_tensor(testing::randn(n * h), DType::kF32, kCpu, {n, h}, st);
  OwnedTensor y(DType::kF32, kCpu, {n, h}), rstd(DType::kF32, kCpu, {n}), w(DType::kF32, kCpu, {h});
  OwnedTensor w_bad(DType::kF32, kCpu, {h + 1}), w_bf16(DType::kBF16, kCpu, {h});
  OwnedTensor rstd_bad(DType::kF32, kCpu, {n + 1}), rstd_bf16(DType::kBF16, kCpu, {n});
  OwnedTensor y_bad(DType::kF32, kCpu, {n, h + 1}), x_bf16(DType::kBF16, kCpu, {n, h}), y_bf16(DType::kBF16, kCpu, {n, h});
  OwnedTensor xi(DType::kI32, kCpu, {n, h});
  testing::upload(w, make_w(h), st);
  EXPECT_NO_THROW(rmsnorm_forward(y, rstd, x, w, kEps, st));
  EXPECT_THROW(rmsnorm_forward(y, rstd, x, w_bad, kEps, st), Error);         // weight shape
  EXPECT_THROW(rmsnorm_forward(y, rstd, x, w_bf16, kEps, st), Error);        // weight dtype
  EXPECT_THROW(rmsnorm_forward(y, rstd_bad, x, w, kEps, st), Error);         // rstd size
  EXPECT_THROW(rmsnorm_forward(y, rstd_bf16, x, w, kEps, st), Error);        // rstd dtype
  EXPECT_THROW(rmsnorm_forward(y_bad, rstd, x, w, kEps, st), Error);         // y shape
  EXPECT_THROW(rmsnorm_forward(y_bf16, rstd, x_bf16, w_bf16, kEps, st), Error);  // CPU is fp32 only
  EXPECT_THROW(rmsnorm_forward(xi, rstd, xi, w, kEps, st), Error);           // int dtype
  EXPECT_THROW(rmsnorm_forward(y, rstd, x, w, -1.f, st), Error);             // eps < 0
  // Leading dimensions that are not one uniform stride: [2, 3, 2, h] sliced in dim 1.
  OwnedTensor x4(DType::kF32, kCpu, {2, 3, 2, h});
  const Tensor bad_rows = x4.t.slice(1, 0, 2);
  OwnedTensor rstd8(DType::kF32, kCpu, {8}), y8(DType::kF32, kCpu, {2, 2, 2, h});
  EXPECT_THROW(rmsnorm_forward(y8, rstd8, bad_rows, w, kEps, st), Error);
  EXPECT_THROW(rmsnorm_forward(bad_rows, rstd8, y8, w, kEps, st), Error);

  OwnedTensor dx(DType::kF32, kCpu, {n, h}), dw(DType::kF32, kCpu, {h});
  OwnedTensor dw_bf16(DType::kBF16, kCpu, {h}), dw_bad(DType::kF32, kCpu, {h - 1});
  EXPECT_NO_THROW(rmsnorm_backward(dx, dw, y, x, w, rstd, false, st));
  EXPECT_THROW(rmsnorm_backward(dx, dw_bf16, y, x, w, rstd, false, st), Error);  // dweight dtype
  EXPECT_THROW(rmsnorm_backward(dx, dw_bad, y, x, w, rstd, false, st), Error);   // dweight shape
  EXPECT_THROW(rmsnorm_backward(dx, dw, y_bad, x, w, rstd, false, st), Error);   // dy shape
  EXPECT_THROW(rmsnorm_backward(y_bad, dw, y, x, w, rstd, false, st), Error);    // dx shape
  EXPECT_THROW(rmsnorm_backward(dx, dw, y, x, w, rstd_bad, false, st), Error);   // rstd size
  EXPECT_THROW(rmsnorm_backward(dx, dw, y, x, w_bad, rstd, false, st), Error);   // weight shape
  EXPECT_THROW(rmsnorm_backward(y8, dw, y8, bad_rows, w, rstd8, false, st), Error);  // x rows
}

}  // namespace
}  // namespace mt
