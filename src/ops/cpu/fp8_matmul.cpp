// CPU emulation of the FP8 GEMM (ops/fp8_matmul.h): the FP8 operands decode exactly to fp32, their
// products accumulate in fp32 through OpenBLAS sgemm — over all of k (tensorwise) or per 128-wide
// k block (blockwise) — and the scales apply as cuBLASLt applies them: d = (sa * sb) * acc, or
// acc = fma(partial_kb, sa(i, kb) * sb(j, kb), acc) block after block; accumulate adds the old d.
#include "ops/fp8_matmul.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace mt::cpu {
namespace {

std::vector<float> decode(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  const uint8_t* b = t.data_as<uint8_t>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < t.numel(); ++i) out[static_cast<size_t>(i)] = fp8_bits_to_f32(t.dtype(), b[i]);
  return out;
}

/// p[m, n] = a[:, k0:k0+kk] · b[:, k0:k0+kk]^T (row-major, a [m, k], b [n, k]).
void partial_product(float* p, const float* a, const float* b, int64_t m, int64_t n, int64_t k, int64_t k0,
                     int64_t kk) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(kk), 1.f, a + k0, static_cast<blasint>(k), b + k0, static_cast<blasint>(k), 0.f, p,
              static_cast<blasint>(n));
}

}  // namespace

void fp8_matmul(const Tensor& d, const Fp8Operand& a, const Fp8Operand& b, bool accumulate, bool fast_accum,
                const Stream&, const Tensor& c, const Tensor& bias) {
  const int64_t m = a.data.size(0), n = b.data.size(0), k = a.data.size(1);
  if (m == 0 || n == 0) return;
  float* dv = d.data_as<float>();
  const float* bv = bias.empty() ? nullptr : bias.data_as<float>();
  if (accumulate && !c.empty() && c.data() != d.data()) std::copy_n(c.data_as<float>(), m * n, dv);  // d = c + ...
  if (k == 0) {
    if (!accumulate) std::fill(dv, dv + m * n, 0.f);
    if (bv)
      for (int64_t i = 0; i < m * n; ++i) dv[i] += bv[i % n];
    return;
  }
  const std::vector<float> av = decode(a.data), bq = decode(b.data);
  std::vector<float> acc(static_cast<size_t>(m * n), 0.f);
  if (a.scaling == Fp8Scaling::kTensor) {
    partial_product(acc.data(), av.data(), bq.data(), m, n, k, 0, k);
    const float s = *a.scale_inv.data_as<float>() * *b.scale_inv.data_as<float>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m * n; ++i) acc[static_cast<size_t>(i)] *= s;
  } else {
    const float* sa = a.scale_inv.data_as<float>();
    const float* sb = b.scale_inv.data_as<float>();
    std::vector<float> p(static_cast<size_t>(m * n));
    for (int64_t k0 = 0; k0 < k; k0 += fp8_math::kBlock) {
      partial_product(p.data(), av.data(), bq.data(), m, n, k, k0, std::min(fp8_math::kBlock, k - k0));
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < m; ++i) {
        const float si = sa[fp8_math::scale_index(a.scaling, i, k0, m, k)];
        for (int64_t j = 0; j < n; ++j) {
          const size_t e = static_cast<size_t>(i * n + j);
          acc[e] = std::fma(p[e], si * sb[fp8_math::scale_index(b.scaling, j, k0, n, k)], acc[e]);
        }
      }
    }
  }
  // cuBLASLt's order: alpha · product + beta · C, then the bias epilogue
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m * n; ++i) {
    const float v = accumulate ? acc[static_cast<size_t>(i)] + dv[i] : acc[static_cast<size_t>(i)];
    dv[i] = bv ? v + bv[i % n] : v;
  }
}

}  // namespace mt::cpu
