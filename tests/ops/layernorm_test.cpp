// CPU LayerNorm against a float64 reference (forward) and central finite differences of that
// reference (backward).
#include <gtest/gtest.h>

#include <cmath>

#include "ops/elementwise.h"
#include "ops/layernorm.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;
constexpr float kEps = 1e-5f;

/// Row r of the float64 reference: y, and optionally mean / rstd.
void ln_row_ref(const double* x, const double* w, const double* b, int64_t h, double eps, double* y,
                double* mean = nullptr, double* rstd = nullptr) {
  double m = 0;
  for (int64_t c = 0; c < h; ++c) m += x[c];
  m /= h;
  double v = 0;
  for (int64_t c = 0; c < h; ++c) v += (x[c] - m) * (x[c] - m);
  v /= h;
  const double rs = 1.0 / std::sqrt(v + eps);
  for (int64_t c = 0; c < h; ++c) y[c] = (x[c] - m) * rs * w[c] + b[c];
  if (mean) *mean = m;
  if (rstd) *rstd = rs;
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

struct LnInputs {
  std::vector<float> x, w, b;
};

/// x ~ N(3, 2^2) (an offset mean exercises the centred variance), weight ~ 1 + N(0, 0.1^2),
/// bias ~ N(0, 0.1^2).
LnInputs make_inputs(int64_t n, int64_t h) {
  LnInputs in;
  in.x = testing::randn(n * h, 2.f);
  for (auto& v : in.x) v += 3.f;
  in.w = testing::randn(h, 0.1f);
  for (auto& v : in.w) v += 1.f;
  in.b = testing::randn(h, 0.1f);
  return in;
}

TEST(LayerNorm, ForwardMatchesFloat64Reference) {
  Stream st;
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{6, 7}, {5, 100}, {4, 768}, {3, 8192}};
  for (auto [n, h] : sizes) {
    LnInputs in = make_inputs(n, h);
    auto x = testing::make_tensor(in.x, DType::kF32, Device::cpu(), {n, 1, h}, st);  // leading dims flattened
    auto w = testing::make_tensor(in.w, DType::kF32, Device::cpu(), {h}, st);
    auto b = testing::make_tensor(in.b, DType::kF32, Device::cpu(), {h}, st);
    OwnedTensor y(DType::kF32, Device::cpu(), {n, 1, h}), mean(DType::kF32, Device::cpu(), {n}),
        rstd(DType::kF32, Device::cpu(), {n});
    for (auto* t : {&y, &mean, &rstd}) testing::poison(*t, st);
    layernorm_forward(y, mean, rstd, x, w, b, kEps, st);

    auto xd = to_double(in.x), wd = to_double(in.w), bd = to_double(in.b);
    std::vector<double> yr(n * h), mr(n), rr(n);
    for (int64_t r = 0; r < n; ++r) ln_row_ref(&xd[r * h], wd.data(), bd.data(), h, kEps, &yr[r * h], &mr[r], &rr[r]);
    EXPECT_LT(testing::rel_err(testing::to_host(y, st), yr), 1e-5) << "n=" << n << " h=" << h;
    EXPECT_LT(testing::rel_err(testing::to_host(mean, st), mr), 1e-5) << "n=" << n << " h=" << h;
    EXPECT_LT(testing::rel_err(testing::to_host(rstd, st), rr), 1e-5) << "n=" << n << " h=" << h;
  }
}

// Loss L = sum_{r,c} g[r,c] * y[r,c] with fixed random g; the op's gradients are compared with
// central differences of the float64 reference. Tolerance 1e-4: the fp32 op is accurate to ~1e-6
// and the differences (eps 1e-5 in float64) to ~1e-9, but dx involves cancellation between
// three terms of similar size.
TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  Stream st;
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{6, 7}, {5, 100}, {3, 768}};
  for (auto [n, h] : sizes) {
    for (bool accumulate : {false, true}) {
      LnInputs in = make_inputs(n, h);
      auto g = testing::randn(n * h);
      auto x = testing::make_tensor(in.x, DType::kF32, Device::cpu(), {n, h}, st);
      auto w = testing::make_tensor(in.w, DType::kF32, Device::cpu(), {h}, st);
      auto b = testing::make_tensor(in.b, DType::kF32, Device::cpu(), {h}, st);
      OwnedTensor y(DType::kF32, Device::cpu(), {n, h}), mean(DType::kF32, Device::cpu(), {n}),
          rstd(DType::kF32, Device::cpu(), {n});
      layernorm_forward(y, mean, rstd, x, w, b, kEps, st);

      auto dy = testing::make_tensor(g, DType::kF32, Device::cpu(), {n, h}, st);
      auto dx0 = testing::randn(n * h), dw0 = testing::randn(h), db0 = testing::randn(h);
      OwnedTensor dx(DType::kF32, Device::cpu(), {n, h});
      if (accumulate) {
        testing::upload(dx, dx0, st);
      } else {
        testing::poison(dx, st);
      }
      auto dw = testing::make_tensor(dw0, DType::kF32, Device::cpu(), {h}, st);
      auto db = testing::make_tensor(db0, DType::kF32, Device::cpu(), {h}, st);
      layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, accumulate, st);

      auto xd = to_double(in.x), wd = to_double(in.w), bd = to_double(in.b);
      std::vector<double> yrow(h);
      auto row_loss = [&](int64_t r) {
        ln_row_ref(&xd[r * h], wd.data(), bd.data(), h, kEps, yrow.data());
        double l = 0;
        for (int64_t c = 0; c < h; ++c) l += g[r * h + c] * yrow[c];
        return l;
      };
      auto loss = [&] {
        double l = 0;
        for (int64_t r = 0; r < n; ++r) l += row_loss(r);
        return l;
      };
      std::vector<double> dx_ref(n * h), dw_ref(h), db_ref(h);
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = 0; c < h; ++c) {
          // Only row r depends on x[r, c].
          dx_ref[r * h + c] = (accumulate ? dx0[r * h + c] : 0.0) +
                              testing::finite_diff([&] { return row_loss(r); }, xd, r * h + c);
        }
      }
      for (int64_t c = 0; c < h; ++c) {
        dw_ref[c] = dw0[c] + testing::finite_diff(loss, wd, c);
        db_ref[c] = db0[c] + testing::finite_diff(loss, bd, c);
      }
      EXPECT_LT(testing::rel_err(testing::to_host(dx, st), dx_ref), 1e-4) << "n=" << n << " h=" << h;
      EXPECT_LT(testing::rel_err(testing::to_host(dw, st), dw_ref), 1e-4) << "n=" << n << " h=" << h;
      EXPECT_LT(testing::rel_err(testing::to_host(db, st), db_ref), 1e-4) << "n=" << n << " h=" << h;
    }
  }
}

TEST(LayerNorm, BackwardAnalyticFloat64AndAliasing) {
  // Tighter check against the analytic float64 gradient, and dx aliasing dy.
  Stream st;
  const int64_t n = 9, h = 100;
  LnInputs in = make_inputs(n, h);
  auto g = testing::randn(n * h);
  auto x = testing::make_tensor(in.x, DType::kF32, Device::cpu(), {n, h}, st);
  auto w = testing::make_tensor(in.w, DType::kF32, Device::cpu(), {h}, st);
  auto b = testing::make_tensor(in.b, DType::kF32, Device::cpu(), {h}, st);
  OwnedTensor y(DType::kF32, Device::cpu(), {n, h}), mean(DType::kF32, Device::cpu(), {n}),
      rstd(DType::kF32, Device::cpu(), {n});
  layernorm_forward(y, mean, rstd, x, w, b, kEps, st);
  auto dy = testing::make_tensor(g, DType::kF32, Device::cpu(), {n, h}, st);
  OwnedTensor dx(DType::kF32, Device::cpu(), {n, h});
  testing::poison(dx, st);
  auto dw = testing::make_tensor(std::vector<float>(h, 0.f), DType::kF32, Device::cpu(), {h}, st);
  auto db = testing::make_tensor(std::vector<float>(h, 0.f), DType::kF32, Device::cpu(), {h}, st);
  layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, false, st);

  std::vector<double> dx_ref(n * h), dw_ref(h, 0.0), db_ref(h, 0.0);
  for (int64_t r = 0; r < n; ++r) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < h; ++c) m += in.x[r * h + c];
    m /= h;
    for (int64_t c = 0; c < h; ++c) v += (in.x[r * h + c] - m) * (in.x[r * h + c] - m);
    const double rs = 1.0 / std::sqrt(v / h + kEps);
    double sg = 0, sgx = 0;
    for (int64_t c = 0; c < h; ++c) {
      const double xh = (in.x[r * h + c] - m) * rs, gg = double(g[r * h + c]) * in.w[c];
      sg += gg;
      sgx += gg * xh;
      dw_ref[c] += g[r * h + c] * xh;
      db_ref[c] += g[r * h + c];
    }
    for (int64_t c = 0; c < h; ++c) {
      const double xh = (in.x[r * h + c] - m) * rs;
      dx_ref[r * h + c] = rs * (double(g[r * h + c]) * in.w[c] - sg / h - xh * sgx / h);
    }
  }
  auto dxv = testing::to_host(dx, st);
  EXPECT_LT(testing::rel_err(dxv, dx_ref), 1e-5);
  EXPECT_LT(testing::rel_err(testing::to_host(dw, st), dw_ref), 1e-5);
  EXPECT_LT(testing::rel_err(testing::to_host(db, st), db_ref), 1e-5);

  // dx aliasing dy: identical result.
  auto dw2 = testing::make_tensor(std::vector<float>(h, 0.f), DType::kF32, Device::cpu(), {h}, st);
  auto db2 = testing::make_tensor(std::vector<float>(h, 0.f), DType::kF32, Device::cpu(), {h}, st);
  layernorm_backward(dy, dw2, db2, dy, x, w, mean, rstd, false, st);
  EXPECT_EQ(testing::to_host(dy, st), dxv);
  EXPECT_EQ(testing::to_host(dw2, st), testing::to_host(dw, st));
}

// --apply-layernorm-1p: with zero_centered_gamma the op scales by 1 + w (the 1 added in fp32).
// Forward against the float64 reference with weight 1 + w; forward and backward bitwise equal to
// the plain op given the fp32 weight 1 + w (the gradient dweight is the same expression), and not
// to the plain op given w.
TEST(LayerNorm, ZeroCenteredGammaIsOnePlusWeight) {
  Stream st;
  const Device cpu = Device::cpu();
  const int64_t n = 5, h = 100;
  LnInputs in = make_inputs(n, h);
  std::vector<float> w0 = testing::randn(h, 0.1f), w1(w0);  // zero-centred weight, and 1 + it
  for (auto& v : w1) v += 1.f;
  auto x = testing::make_tensor(in.x, DType::kF32, cpu, {n, h}, st);
  auto b = testing::make_tensor(in.b, DType::kF32, cpu, {h}, st);
  auto dy = testing::make_tensor(testing::randn(n * h, 1.f), DType::kF32, cpu, {n, h}, st);
  struct Out {
    std::vector<float> y, dx, dw, db;
  };
  auto run = [&](const std::vector<float>& wv, bool zc) {
    auto w = testing::make_tensor(wv, DType::kF32, cpu, {h}, st);
    OwnedTensor y(DType::kF32, cpu, {n, h}), mean(DType::kF32, cpu, {n}), rstd(DType::kF32, cpu, {n}),
        dx(DType::kF32, cpu, {n, h}), dw(DType::kF32, cpu, {h}), db(DType::kF32, cpu, {h});
    fill(dw, 0.f, st);
    fill(db, 0.f, st);
    layernorm_forward(y, mean, rstd, x, w, b, kEps, st, zc);
    layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, false, st, zc);
    return Out{testing::to_host(y, st), testing::to_host(dx, st), testing::to_host(dw, st), testing::to_host(db, st)};
  };
  const Out zc = run(w0, true), plain = run(w1, false), wrong = run(w0, false);
  EXPECT_EQ(zc.y, plain.y);
  EXPECT_EQ(zc.dx, plain.dx);
  EXPECT_EQ(zc.dw, plain.dw);
  EXPECT_EQ(zc.db, plain.db);
  EXPECT_NE(zc.y, wrong.y);
  EXPECT_NE(zc.dx, wrong.dx);
  auto xd = to_double(in.x), wd = to_double(w0), bd = to_double(in.b);
  for (auto& v : wd) v += 1.0;
  std::vector<double> yr(n * h);
  for (int64_t r = 0; r < n; ++r) ln_row_ref(&xd[r * h], wd.data(), bd.data(), h, kEps, &yr[r * h]);
  EXPECT_LT(testing::rel_err(zc.y, yr), 1e-5);
}

TEST(LayerNorm, BadInputThrows) {
  Stream st;
  const int64_t n = 4, h = 8;
  const Device cpu = Device::cpu();
  auto x = testing::make_tensor(testing::randn(n * h), DType::kF32, cpu, {n, h}, st);
  OwnedTensor y(DType::kF32, cpu, {n, h}), mean(DType::kF32, cpu, {n}), rstd(DType::kF32, cpu, {n});
  OwnedTensor w(DType::kF32, cpu, {h}), b(DType::kF32, cpu, {h});
  OwnedTensor w_bad(DType::kF32, cpu, {h + 1}), b_bf16(DType::kBF16, cpu, {h});
  OwnedTensor mean_bad(DType::kF32, cpu, {n + 1}), rstd_bf16(DType::kBF16, cpu, {n});
  OwnedTensor y_bad(DType::kF32, cpu, {n, h + 1}), x_bf16(DType::kBF16, cpu, {n, h}), y_bf16(DType::kBF16, cpu, {n, h});
  EXPECT_NO_THROW(layernorm_forward(y, mean, rstd, x, w, b, kEps, st));
  EXPECT_THROW(layernorm_forward(y, mean, rstd, x, w_bad, b, kEps, st), Error);
  EXPECT_THROW(layernorm_forward(y, mean, rstd, x, w, b_bf16, kEps, st), Error);
  EXPECT_THROW(layernorm_forward(y, mean_bad, rstd, x, w, b, kEps, st), Error);
  EXPECT_THROW(layernorm_forward(y, mean, rstd_bf16, x, w, b, kEps, st), Error);
  EXPECT_THROW(layernorm_forward(y_bad, mean, rstd, x, w, b, kEps, st), Error);
  EXPECT_THROW(layernorm_forward(y_bf16, mean, rstd, x_bf16, w, b, kEps, st), Error);  // CPU is fp32 only
  EXPECT_THROW(layernorm_forward(y, mean, rstd, x, w, b, -1.f, st), Error);
  OwnedTensor dx(DType::kF32, cpu, {n, h}), dw(DType::kF32, cpu, {h}), db(DType::kF32, cpu, {h});
  OwnedTensor dw_bf16(DType::kBF16, cpu, {h}), db_bad(DType::kF32, cpu, {h - 1});
  EXPECT_NO_THROW(layernorm_backward(dx, dw, db, y, x, w, mean, rstd, false, st));
  EXPECT_THROW(layernorm_backward(dx, dw_bf16, db, y, x, w, mean, rstd, false, st), Error);
  EXPECT_THROW(layernorm_backward(dx, dw, db_bad, y, x, w, mean, rstd, false, st), Error);
  EXPECT_THROW(layernorm_backward(dx, dw, db, y_bad, x, w, mean, rstd, false, st), Error);
  EXPECT_THROW(layernorm_backward(dx, dw, db, y, x, w, mean_bad, rstd, false, st), Error);
  EXPECT_THROW(layernorm_backward(dx, dw, db, y, x, w_bad, mean, rstd, false, st), Error);
}

}  // namespace
}  // namespace mt
