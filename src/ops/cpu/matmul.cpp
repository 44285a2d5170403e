// CPU matrix products: OpenBLAS sgemm (fp32, row-major), bias/GELU/column sums with OpenMP.
#include <cblas.h>

#include <cmath>

#include "ops/matmul.h"
#include "ops/gelu.h"
#include "ops/gelu_math.h"

namespace mt::cpu {
namespace {

void require_f32(const char* op, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (t->empty()) continue;
    MT_CHECK(t->dtype() == DType::kF32, "{}: the CPU backend supports fp32 only, got {}", op, t->str());
  }
}

/// C[m, n] = alpha op(A) op(B) + beta C for one matrix, row-major, via sgemm. k == 0 scales C.
void sgemm(float* c, const float* a, const float* b, int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b,
           float alpha, float beta) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // BLAS would do this too, but some builds reject k = 0 with lda = 0
    for (int64_t i = 0; i < m * n; ++i) c[i] = beta == 0.f ? 0.f : beta * c[i];
    return;
  }
  const int64_t lda = trans_a ? m : k;
  const int64_t ldb = trans_b ? k : n;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(n));
}

}  // namespace

void matmul(const Tensor& c, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, float alpha, float beta,
            const Stream& stream) {
  require_f32("matmul", {&c, &a, &b});
  const int r = a.ndim();
  const int64_t batch = r == 3 ? a.size(0) : 1;
  const int64_t m = c.size(r - 2), n = c.size(r - 1);
  const int64_t k = trans_a ? a.size(r - 2) : a.size(r - 1);
  for (int64_t i = 0; i < batch; ++i) {
    sgemm(c.data_as<float>() + i * m * n, a.data_as<float>() + i * m * k, b.data_as<float>() + i * k * n, m, n, k,
          trans_a, trans_b, alpha, beta);
  }
}

void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& pre_gelu,
                    const Stream& stream) {
  require_f32("linear_forward", {&y, &x, &w, &bias, &pre_gelu});
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t m = n == 0 ? 0 : y.numel() / n;
  const bool gelu = !pre_gelu.empty();
  float* out = gelu ? pre_gelu.data_as<float>() : y.data_as<float>();
  sgemm(out, x.data_as<float>(), w.data_as<float>(), m, n, k, false, true, 1.f, 0.f);
  if (bias.empty() && !gelu) return;
  const float* bv = bias.empty() ? nullptr : bias.data_as<float>();
  float* yv = y.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    float* row = out + i * n;
    for (int64_t j = 0; j < n; ++j) {
      float v = row[j] + (bv ? bv[j] : 0.f);
      row[j] = v;
      if (gelu) yv[i * n + j] = gelu_math::gelu(v);
    }
  }
}

namespace {
/// out[j] += Σ_i x[i, j] (x row-major [m, n]), accumulated in double: a long reduction over tokens.
void column_sum_add(float* out, const float* x, int64_t m, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    double acc = 0.0;
    for (int64_t i = 0; i < m; ++i) acc += x[i * n + j];
    out[j] += static_cast<float>(acc);
  }
}
}  // namespace

void linear_forward_add(const Tensor& out, const Tensor& x, const Tensor& w, const Tensor& bias,
                        const Tensor& residual, const Stream& stream) {
  require_f32("linear_forward_add", {&out, &x, &w, &bias, &residual});
  cpu::linear_forward(out, x, w, Tensor(), Tensor(), stream);
  const int64_t n = w.size(0), total = out.numel();
  float* o = out.data_as<float>();
  const float* r = residual.data_as<float>();
  const float* b = bias.empty() ? nullptr : bias.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < total; ++i) o[i] = r[i] + (b ? o[i] + b[i % n] : o[i]);  // as bias_dropout_add, p = 0
}

void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor& dbias, const Tensor& dy, const Tensor& x,
                     const Tensor& w, const Stream& stream, GradWrite dw_write) {
  require_f32("linear_backward", {&dx, &dw, &dbias, &dy, &x, &w});
  const int64_t n = w.size(0), k = w.size(1);
  int64_t m = 1;
  for (int d = 0; d + 1 < x.ndim(); ++d) m *= x.size(d);
  // dx[m, k] = dy[m, n] · w[n, k]
  if (!dx.empty()) sgemm(dx.data_as<float>(), dy.data_as<float>(), w.data_as<float>(), m, k, n, false, false, 1.f, 0.f);
  // dw[n, k] += dy^T[n, m] · x[m, k]  (= when overwriting; m = 0 then writes zeros)
  if (!dw.empty())
    sgemm(dw.data_as<float>(), dy.data_as<float>(), x.data_as<float>(), n, k, m, true, false, 1.f,
          dw_write == GradWrite::kOverwrite ? 0.f : 1.f);
  if (!dbias.empty()) column_sum_add(dbias.data_as<float>(), dy.data_as<float>(), m, n);
}

void gelu_linear_backward(const Tensor& dpre, const Tensor& dpre_bias, const Tensor& dw, const Tensor& dbias,
                          const Tensor& dy, const Tensor& x, const Tensor& pre, const Tensor& w, const Stream& stream,
                          GradWrite dw_write) {
  require_f32("gelu_linear_backward", {&dpre, &dpre_bias, &pre});
  cpu::linear_backward(dpre, dw, dbias, dy, x, w, stream, dw_write);
  cpu::gelu_backward(dpre, dpre, pre, stream);
  if (!dpre_bias.empty()) {
    const int64_t k = w.size(1);
    column_sum_add(dpre_bias.data_as<float>(), dpre.data_as<float>(), dpre.numel() / k, k);
  }
}

}  // namespace mt::cpu
