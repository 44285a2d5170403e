// CPU tests of ops/matmul.h against float64 references: matmul (all transposes, batched, beta),
// linear_forward (bias, GELU with pre_gelu, flattened leading dims), linear_backward (dx, dw and
// dbias accumulation), and the documented errors.
#include <gtest/gtest.h>

#include <cmath>

#include "ops/elementwise.h"
#include "ops/matmul.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::cpu_stream;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::poison;
using testing::randn;
using testing::rel_err;
using testing::to_host;

/// C = alpha op(A) op(B) + beta C0, float64, row-major, batched.
std::vector<double> ref_matmul(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& c0,
                               int64_t batch, int64_t m, int64_t n, int64_t k, bool ta, bool tb, double alpha,
                               double beta) {
  std::vector<double> c(batch * m * n);
  for (int64_t z = 0; z < batch; ++z) {
    const float* A = a.data() + z * m * k;
    const float* B = b.data() + z * k * n;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t p = 0; p < k; ++p) {
          double av = ta ? A[p * m + i] : A[i * k + p];
          double bv = tb ? B[j * k + p] : B[p * n + j];
          acc += av * bv;
        }
        const int64_t idx = z * m * n + i * n + j;
        c[idx] = alpha * acc + (beta != 0 ? beta * c0[idx] : 0.0);
      }
    }
  }
  return c;
}

double gelu_ref(double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }

void run_matmul_case(int64_t batch, int64_t m, int64_t n, int64_t k, bool ta, bool tb, float alpha, float beta) {
  const Stream& st = cpu_stream();
  std::vector<int64_t> sa = ta ? std::vector<int64_t>{k, m} : std::vector<int64_t>{m, k};
  std::vector<int64_t> sb = tb ? std::vector<int64_t>{n, k} : std::vector<int64_t>{k, n};
  std::vector<int64_t> sc{m, n};
  if (batch > 0) {
    sa.insert(sa.begin(), batch);
    sb.insert(sb.begin(), batch);
    sc.insert(sc.begin(), batch);
  }
  const int64_t nb = batch > 0 ? batch : 1;
  auto ha = randn(nb * m * k), hb = randn(nb * k * n), hc = randn(nb * m * n);
  auto a = make_tensor(ha, DType::kF32, Device::cpu(), sa, st);
  auto b = make_tensor(hb, DType::kF32, Device::cpu(), sb, st);
  auto c = make_tensor(hc, DType::kF32, Device::cpu(), sc, st);
  if (beta == 0.f) poison(c, st);  // beta = 0 must overwrite (NaN-safe)
  matmul(c, a, b, ta, tb, alpha, beta, st);
  auto ref = ref_matmul(ha, hb, hc, nb, m, n, k, ta, tb, alpha, beta);
  EXPECT_LT(rel_err(to_host(c, st), ref), 1e-5) << "batch=" << batch << " m=" << m << " n=" << n << " k=" << k
                                                << " ta=" << ta << " tb=" << tb << " beta=" << beta;
}

TEST(Matmul, AllTransposes2D) {
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) run_matmul_case(0, 7, 5, 9, ta, tb, 0.7f, 0.f);
}

TEST(Matmul, BatchedWithBeta) {
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      run_matmul_case(3, 6, 11, 13, ta, tb, 1.3f, 0.5f);
      run_matmul_case(2, 33, 17, 40, ta, tb, 1.f, 0.f);
      run_matmul_case(2, 4, 5, 6, ta, tb, -0.5f, 1.f);
    }
  }
}

TEST(Matmul, EmptyInnerDimScalesC) {
  run_matmul_case(0, 3, 4, 0, false, false, 1.f, 0.5f);  // k = 0: C = beta C
  run_matmul_case(2, 3, 4, 0, true, true, 1.f, 0.f);     // beta = 0 overwrites NaN with 0
}

TEST(Matmul, Errors) {
  const Stream& st = cpu_stream();
  OwnedTensor a(DType::kF32, Device::cpu(), {4, 3}), b(DType::kF32, Device::cpu(), {3, 5}),
      c(DType::kF32, Device::cpu(), {4, 5});
  OwnedTensor bad_b(DType::kF32, Device::cpu(), {2, 5}), bad_c(DType::kF32, Device::cpu(), {4, 4});
  OwnedTensor a3(DType::kF32, Device::cpu(), {2, 4, 3}), b3(DType::kF32, Device::cpu(), {3, 3, 5}),
      c3(DType::kF32, Device::cpu(), {2, 4, 5});
  OwnedTensor ah(DType::kBF16, Device::cpu(), {4, 3}), bh(DType::kBF16, Device::cpu(), {3, 5}),
      ch(DType::kBF16, Device::cpu(), {4, 5}), cf16(DType::kF16, Device::cpu(), {4, 5});
  EXPECT_NO_THROW(matmul(c, a, b, false, false, 1.f, 0.f, st));
  EXPECT_THROW(matmul(c, a, bad_b, false, false, 1.f, 0.f, st), Error);  // inner dims
  EXPECT_THROW(matmul(bad_c, a, b, false, false, 1.f, 0.f, st), Error);  // output shape
  EXPECT_THROW(matmul(c, a, b, true, false, 1.f, 0.f, st), Error);       // op(a) is [3, 4]
  EXPECT_THROW(matmul(c3, a3, b, false, false, 1.f, 0.f, st), Error);    // mixed ranks
  EXPECT_THROW(matmul(c3, a3, b3, false, false, 1.f, 0.f, st), Error);   // batch sizes differ
  EXPECT_THROW(matmul(c, a, bh, false, false, 1.f, 0.f, st), Error);     // a/b dtypes differ
  EXPECT_THROW(matmul(cf16, ah, bh, false, false, 1.f, 0.f, st), Error); // c neither bf16 nor fp32
  EXPECT_THROW(matmul(ch, ah, bh, false, false, 1.f, 0.f, st), Error);   // CPU is fp32-only
}

struct LinearRef {
  std::vector<double> pre, y;
};
LinearRef ref_linear(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>* bias,
                     int64_t m, int64_t n, int64_t k) {
  LinearRef r{std::vector<double>(m * n), std::vector<double>(m * n)};
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = bias ? (*bias)[j] : 0.0;
      for (int64_t p = 0; p < k; ++p) acc += static_cast<double>(x[i * k + p]) * w[j * k + p];
      r.pre[i * n + j] = acc;
      r.y[i * n + j] = gelu_ref(acc);
    }
  }
  return r;
}

TEST(Linear, ForwardBiasAndGelu) {
  const Stream& st = cpu_stream();
  const int64_t b0 = 2, b1 = 3, m = b0 * b1, n = 6, k = 10;
  auto hx = randn(m * k), hw = randn(n * k, 0.3f), hb = randn(n);
  auto x = make_tensor(hx, DType::kF32, Device::cpu(), {b0, b1, k}, st);
  auto w = make_tensor(hw, DType::kF32, Device::cpu(), {n, k}, st);
  auto bias = make_tensor(hb, DType::kF32, Device::cpu(), {n}, st);
  OwnedTensor y(DType::kF32, Device::cpu(), {b0, b1, n}), pre(DType::kF32, Device::cpu(), {b0, b1, n});
  auto with_bias = ref_linear(hx, hw, &hb, m, n, k);
  auto no_bias = ref_linear(hx, hw, nullptr, m, n, k);

  poison(y, st);
  linear_forward(y, x, w, bias, Tensor(), st);
  EXPECT_LT(rel_err(to_host(y, st), with_bias.pre), 1e-5);

  poison(y, st);
  linear_forward(y, x, w, Tensor(), Tensor(), st);
  EXPECT_LT(rel_err(to_host(y, st), no_bias.pre), 1e-5);

  poison(y, st);
  poison(pre, st);
  linear_forward(y, x, w, bias, pre, st);
  EXPECT_LT(rel_err(to_host(pre, st), with_bias.pre), 1e-5);
  EXPECT_LT(rel_err(to_host(y, st), with_bias.y), 1e-5);

  poison(y, st);
  poison(pre, st);
  linear_forward(y, x, w, Tensor(), pre, st);
  EXPECT_LT(rel_err(to_host(pre, st), no_bias.pre), 1e-5);
  EXPECT_LT(rel_err(to_host(y, st), no_bias.y), 1e-5);
}

TEST(Linear, BackwardAccumulates) {
  const Stream& st = cpu_stream();
  const int64_t b0 = 4, b1 = 5, m = b0 * b1, n = 6, k = 7;
  auto hx = randn(m * k), hw = randn(n * k), hdy = randn(m * n), hdw0 = randn(n * k), hdb0 = randn(n);
  auto x = make_tensor(hx, DType::kF32, Device::cpu(), {b0, b1, k}, st);
  auto w = make_tensor(hw, DType::kF32, Device::cpu(), {n, k}, st);
  auto dy = make_tensor(hdy, DType::kF32, Device::cpu(), {b0, b1, n}, st);
  OwnedTensor dx(DType::kF32, Device::cpu(), {b0, b1, k});
  auto dw = make_tensor(hdw0, DType::kF32, Device::cpu(), {n, k}, st);
  auto db = make_tensor(hdb0, DType::kF32, Device::cpu(), {n}, st);

  std::vector<double> rdx(m * k, 0.0), rdw(n * k), rdb(n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < n; ++j) rdx[i * k + p] += static_cast<double>(hdy[i * n + j]) * hw[j * k + p];
  for (int64_t j = 0; j < n; ++j) {
    rdb[j] = hdb0[j];
    for (int64_t i = 0; i < m; ++i) rdb[j] += hdy[i * n + j];
    for (int64_t p = 0; p < k; ++p) {
      double acc = hdw0[j * k + p];
      for (int64_t i = 0; i < m; ++i) acc += static_cast<double>(hdy[i * n + j]) * hx[i * k + p];
      rdw[j * k + p] = acc;
    }
  }
  poison(dx, st);
  linear_backward(dx, dw, db, dy, x, w, st);
  EXPECT_LT(rel_err(to_host(dx, st), rdx), 1e-5);
  EXPECT_LT(rel_err(to_host(dw, st), rdw), 1e-5);
  EXPECT_LT(rel_err(to_host(db, st), rdb), 1e-5);

  // Second call without dx and dbias: dw accumulates again, dbias untouched.
  auto db_before = to_host(db, st);
  for (int64_t i = 0; i < n * k; ++i) rdw[i] += rdw[i] - hdw0[i];
  linear_backward(Tensor(), dw, Tensor(), dy, x, w, st);
  EXPECT_LT(rel_err(to_host(dw, st), rdw), 1e-5);
  EXPECT_EQ(to_host(db, st), db_before);
}

/// d/dx of GELU's tanh form, in double (Hendrycks & Gimpel 2016).
double gelu_grad_ref(double x) {
  const double c = std::sqrt(2.0 / M_PI), a = 0.044715, t = std::tanh(c * (x + a * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * a * x * x);
}

// The fc2 backward with fc1's GELU folded in: dpre, fc1's bias gradient and fc2's dw / dbias
// against a float64 reference, accumulating where the contract says so.
TEST(Linear, GeluLinearBackward) {
  const Stream& st = cpu_stream();
  const int64_t b0 = 3, b1 = 7, m = b0 * b1, n = 6, k = 9;
  auto hpre = randn(m * k), hw = randn(n * k), hdy = randn(m * n), hdw0 = randn(n * k), hdb0 = randn(n),
       hdpb0 = randn(k);
  std::vector<float> hx(m * k);
  for (int64_t i = 0; i < m * k; ++i) {  // x = gelu(pre), as fc1's epilogue wrote it
    const double p = hpre[i];
    hx[i] = static_cast<float>(0.5 * p * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (p + 0.044715 * p * p * p))));
  }
  auto x = make_tensor(hx, DType::kF32, Device::cpu(), {b0, b1, k}, st);
  auto pre = make_tensor(hpre, DType::kF32, Device::cpu(), {b0, b1, k}, st);
  auto w = make_tensor(hw, DType::kF32, Device::cpu(), {n, k}, st);
  auto dy = make_tensor(hdy, DType::kF32, Device::cpu(), {b0, b1, n}, st);
  OwnedTensor dpre(DType::kF32, Device::cpu(), {b0, b1, k});
  auto dw = make_tensor(hdw0, DType::kF32, Device::cpu(), {n, k}, st);
  auto db = make_tensor(hdb0, DType::kF32, Device::cpu(), {n}, st);
  auto dpb = make_tensor(hdpb0, DType::kF32, Device::cpu(), {k}, st);

  std::vector<double> rdpre(m * k, 0.0), rdpb(hdpb0.begin(), hdpb0.end()), rdw(n * k), rdb(n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t p = 0; p < k; ++p) {
      double acc = 0.0;
      for (int64_t j = 0; j < n; ++j) acc += static_cast<double>(hdy[i * n + j]) * hw[j * k + p];
      rdpre[i * k + p] = acc * gelu_grad_ref(hpre[i * k + p]);
      rdpb[p] += rdpre[i * k + p];
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    rdb[j] = hdb0[j];
    for (int64_t i = 0; i < m; ++i) rdb[j] += hdy[i * n + j];
    for (int64_t p = 0; p < k; ++p) {
      double acc = hdw0[j * k + p];
      for (int64_t i = 0; i < m; ++i) acc += static_cast<double>(hdy[i * n + j]) * hx[i * k + p];
      rdw[j * k + p] = acc;
    }
  }
  poison(dpre, st);
  gelu_linear_backward(dpre, dpb, dw, db, dy, x, pre, w, st);
  EXPECT_LT(rel_err(to_host(dpre, st), rdpre), 1e-5);
  EXPECT_LT(rel_err(to_host(dpb, st), rdpb), 1e-5);
  EXPECT_LT(rel_err(to_host(dw, st), rdw), 1e-5);
  EXPECT_LT(rel_err(to_host(db, st), rdb), 1e-5);
  // without the gradients: dpre only, the accumulators untouched
  const auto dw1 = to_host(dw, st), dpb1 = to_host(dpb, st);
  poison(dpre, st);
  gelu_linear_backward(dpre, Tensor(), Tensor(), Tensor(), dy, x, pre, w, st);
  EXPECT_LT(rel_err(to_host(dpre, st), rdpre), 1e-5);
  EXPECT_EQ(to_host(dw, st), dw1);
  EXPECT_EQ(to_host(dpb, st), dpb1);
  // errors: dpre aliasing dy's memory, pre of the wrong shape, dpre_bias of the wrong size
  OwnedTensor bad_pre(DType::kF32, Device::cpu(), {b0, b1, k + 1}), bad_dpb(DType::kF32, Device::cpu(), {k + 1});
  EXPECT_THROW(gelu_linear_backward(dpre, dpb, dw, db, dy, x, bad_pre, w, st), Error);
  EXPECT_THROW(gelu_linear_backward(dpre, bad_dpb, dw, db, dy, x, pre, w, st), Error);
  EXPECT_THROW(gelu_linear_backward(pre, dpb, dw, db, dy, x, pre, w, st), Error);
}

// The output projection with the block's residual add: bit-identical to linear_forward followed
// by bias_dropout_add_forward at p = 0, which it replaces.
TEST(Linear, ForwardAddMatchesBiasDropoutAdd) {
  const Stream& st = cpu_stream();
  for (bool bias : {true, false}) {
    const int64_t b0 = 3, b1 = 5, m = b0 * b1, n = 12, k = 7;
    auto x = make_tensor(randn(m * k), DType::kF32, Device::cpu(), {b0, b1, k}, st);
    auto w = make_tensor(randn(n * k), DType::kF32, Device::cpu(), {n, k}, st);
    auto b = make_tensor(randn(n), DType::kF32, Device::cpu(), {n}, st);
    auto r = make_tensor(randn(m * n), DType::kF32, Device::cpu(), {b0, b1, n}, st);
    OwnedTensor out(DType::kF32, Device::cpu(), {b0, b1, n}), y(DType::kF32, Device::cpu(), {b0, b1, n}),
        ref(DType::kF32, Device::cpu(), {b0, b1, n});
    poison(out, st);
    linear_forward_add(out, x, w, bias ? b.t : Tensor(), r, st);
    linear_forward(y, x, w, Tensor(), Tensor(), st);
    bias_dropout_add_forward(ref, y, bias ? b.t : Tensor(), r, 0.f, DropoutKey{}, 0, st);
    EXPECT_EQ(to_host(out, st), to_host(ref, st)) << "bias " << bias;
  }
  OwnedTensor x(DType::kF32, Device::cpu(), {4, 3}), w(DType::kF32, Device::cpu(), {5, 3}),
      out(DType::kF32, Device::cpu(), {4, 5}), bad_r(DType::kF32, Device::cpu(), {4, 4});
  EXPECT_THROW(linear_forward_add(out, x, w, Tensor(), bad_r, st), Error);
  EXPECT_THROW(linear_forward_add(out, x, w, Tensor(), out, st), Error);  // out aliases the residual
}

TEST(Linear, Errors) {
  const Stream& st = cpu_stream();
  auto f32 = [](std::vector<int64_t> s) { return OwnedTensor(DType::kF32, Device::cpu(), s); };
  OwnedTensor x = f32({4, 3}), w = f32({5, 3}), y = f32({4, 5}), bias = f32({5}), pre = f32({4, 5});
  OwnedTensor bad_x = f32({4, 2}), bad_y = f32({3, 5}), bad_bias = f32({4}), bad_pre = f32({4, 4});
  OwnedTensor dw = f32({5, 3}), db = f32({5}), dx = f32({4, 3}), dy = f32({4, 5});
  OwnedTensor dw_bf16(DType::kBF16, Device::cpu(), {5, 3}), bad_dw = f32({3, 5}), bad_db = f32({3});
  OwnedTensor xh(DType::kBF16, Device::cpu(), {4, 3}), wh(DType::kBF16, Device::cpu(), {5, 3}),
      yh(DType::kBF16, Device::cpu(), {4, 5});
  EXPECT_NO_THROW(linear_forward(y, x, w, bias, pre, st));
  EXPECT_THROW(linear_forward(y, bad_x, w, bias, Tensor(), st), Error);
  EXPECT_THROW(linear_forward(bad_y, x, w, bias, Tensor(), st), Error);
  EXPECT_THROW(linear_forward(y, x, w, bad_bias, Tensor(), st), Error);
  EXPECT_THROW(linear_forward(y, x, w, bias, bad_pre, st), Error);
  EXPECT_THROW(linear_forward(y, x, w, bias, y, st), Error);  // pre_gelu aliases y
  EXPECT_THROW(linear_forward(yh, xh, w, Tensor(), Tensor(), st), Error);
  EXPECT_THROW(linear_forward(yh, xh, wh, Tensor(), Tensor(), st), Error);  // CPU is fp32-only
  EXPECT_NO_THROW(linear_backward(dx, dw, db, dy, x, w, st));
  EXPECT_THROW(linear_backward(dx, dw_bf16, db, dy, x, w, st), Error);  // main grad must be fp32
  EXPECT_THROW(linear_backward(dx, bad_dw, db, dy, x, w, st), Error);
  EXPECT_THROW(linear_backward(dx, dw, bad_db, dy, x, w, st), Error);
  EXPECT_THROW(linear_backward(bad_x, dw, db, dy, x, w, st), Error);
  EXPECT_THROW(linear_backward(dx, dw, db, dy, bad_x, w, st), Error);
}

}  // namespace
}  // namespace mt
