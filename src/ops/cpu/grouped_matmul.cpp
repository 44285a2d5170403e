// CPU reference of ops/grouped_matmul.h: fp32, one OpenBLAS sgemm per non-empty group, the
// counts read from host memory.
#include <cblas.h>

#include <algorithm>
#include <vector>

#include "ops/grouped_matmul.h"

namespace mt::cpu {
namespace {

void require_f32(const char* fn, const Tensor& t) {
  MT_CHECK(t.dtype() == DType::kF32, "{}: the CPU backend supports fp32 only, got {}", fn, t.str());
}

// The groups' first rows (G + 1 entries, the last = Σc), checked against the R rows.
std::vector<int64_t> offsets(const Tensor& counts, int64_t R, const char* fn) {
  const int32_t* c = counts.data_as<int32_t>();
  const int64_t G = counts.numel();
  std::vector<int64_t> off(static_cast<size_t>(G + 1), 0);
  for (int64_t g = 0; g < G; ++g) {
    MT_CHECK(c[g] >= 0, "{}: count {} of group {} is negative", fn, c[g], g);
    off[static_cast<size_t>(g + 1)] = off[static_cast<size_t>(g)] + c[g];
  }
  MT_CHECK(off.back() <= R, "{}: the counts sum to {} rows, more than the {} planned", fn, off.back(), R);
  return off;
}

blasint bi(int64_t v) { return static_cast<blasint>(v); }

}  // namespace

void grouped_linear_forward(const Tensor& y, const Tensor& x, const GroupedWeights& w, const Tensor& counts,
                            const Stream&) {
  const char* fn = "grouped_linear_forward";
  require_f32(fn, x);
  const int64_t R = x.size(0), n = w.rows(), k = w.cols();
  const std::vector<int64_t> off = offsets(counts, R, fn);
  const float* X = x.data_as<float>();
  float* Y = y.data_as<float>();
  for (int64_t g = 0; g < w.groups(); ++g) {
    const int64_t m = off[static_cast<size_t>(g + 1)] - off[static_cast<size_t>(g)];
    float* yg = Y + off[static_cast<size_t>(g)] * n;
    if (m == 0 || n == 0) continue;
    if (k == 0) {
      std::fill(yg, yg + m * n, 0.f);
      continue;
    }
    // y_g[m, n] = x_g[m, k] · W_g[n, k]ᵀ
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bi(m), bi(n), bi(k), 1.f, X + off[static_cast<size_t>(g)] * k,
                bi(k), w[g].data_as<float>(), bi(k), 0.f, yg, bi(n));
  }
  std::fill(Y + off.back() * n, Y + R * n, 0.f);
}

void grouped_linear_dgrad(const Tensor& dx, const Tensor& dy, const GroupedWeights& w, const Tensor& counts,
                          const Stream&) {
  const char* fn = "grouped_linear_dgrad";
  require_f32(fn, dy);
  const int64_t R = dy.size(0), n = w.rows(), k = w.cols();
  const std::vector<int64_t> off = offsets(counts, R, fn);
  const float* DY = dy.data_as<float>();
  float* DX = dx.data_as<float>();
  for (int64_t g = 0; g < w.groups(); ++g) {
    const int64_t m = off[static_cast<size_t>(g + 1)] - off[static_cast<size_t>(g)];
    float* dxg = DX + off[static_cast<size_t>(g)] * k;
    if (m == 0 || k == 0) continue;
    if (n == 0) {
      std::fill(dxg, dxg + m * k, 0.f);
      continue;
    }
    // dx_g[m, k] = dy_g[m, n] · W_g[n, k]
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, bi(m), bi(k), bi(n), 1.f,
                DY + off[static_cast<size_t>(g)] * n, bi(n), w[g].data_as<float>(), bi(k), 0.f, dxg, bi(k));
  }
  std::fill(DX + off.back() * k, DX + R * k, 0.f);
}

void grouped_linear_wgrad(const GroupedWeights& dw, const Tensor& dy, const Tensor& x, const Tensor& counts,
                          const Stream&) {
  const char* fn = "grouped_linear_wgrad";
  require_f32(fn, x);
  const int64_t R = x.size(0), n = dw.rows(), k = dw.cols();
  const std::vector<int64_t> off = offsets(counts, R, fn);
  const float* DY = dy.data_as<float>();
  const float* X = x.data_as<float>();
  for (int64_t g = 0; g < dw.groups(); ++g) {
    const int64_t m = off[static_cast<size_t>(g + 1)] - off[static_cast<size_t>(g)];
    if (m == 0 || n == 0 || k == 0) continue;
    // dW_g[n, k] += dy_g[m, n]ᵀ · x_g[m, k]
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, bi(n), bi(k), bi(m), 1.f,
                DY + off[static_cast<size_t>(g)] * n, bi(n), X + off[static_cast<size_t>(g)] * k, bi(k), 1.f,
                dw[g].data_as<float>(), bi(k));
  }
}

}  // namespace mt::cpu
