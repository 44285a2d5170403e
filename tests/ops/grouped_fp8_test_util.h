// Helpers of the grouped FP8 GEMM tests (grouped_fp8_matmul_test.cpp on the CPU,
// grouped_matmul_cuda_test.cpp on CUDA): random or small-integer FP8 operands of ragged groups, the
// float64 references of grouped_fp8_linear_forward / _wgrad with their accumulation bounds, and
// the operands as device tensors.
#pragma once
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "ops/fp8_test_util.h"
#include "ops/grouped_matmul.h"
#include "testing/testing.h"

namespace mt::grouped_fp8_test {

using testing::OwnedTensor;

/// A grouped problem: R planned rows, the forward's y [R, N] = a [R, K] · w_g [N, K]ᵀ (or the
/// wgrad's dW_g [N, K] from dy [R, N] and x [R, K]); a_dt: the row operand's FP8 type (x or dy),
/// b_dt: the other's; per_group_a: G scales for the row operand (else one); ints: small-integer
/// codes and power-of-two scales (every product and sum exact: backends agree bitwise).
struct Case {
  int64_t R, N, K;
  std::vector<int32_t> counts;
  DType a_dt = DType::kF8E4M3, b_dt = DType::kF8E4M3;
  bool per_group_a = false;
  bool ints = false;
  int64_t groups() const { return static_cast<int64_t>(counts.size()); }
  int64_t used() const { return std::accumulate(counts.begin(), counts.end(), int64_t{0}); }
  int64_t first_row(int64_t g) const {
    return std::accumulate(counts.begin(), counts.begin() + g, int64_t{0});
  }
};

inline std::vector<uint8_t> codes(const Case& c, int64_t n, DType t) {
  return c.ints ? fp8_test::integer_codes(n, t, 4) : fp8_test::random_codes(n, t, 8.f);
}

inline std::vector<float> scales(const Case& c, int64_t n) {
  std::vector<float> s;
  for (int64_t i = 0; i < n; ++i)
    s.push_back(fp8_test::random_scales(Fp8Scaling::kTensor, 1, 16, /*pow2=*/c.ints, /*max_exp=*/3)[0]);
  return s;
}

/// The row operand's scale of group g (1 or G entries).
inline double scale_of(const std::vector<float>& s, size_t g) { return s.size() == 1 ? s[0] : s[g]; }

/// The float64 result and Σ|products| (for tolerances) of every output element.
struct Ref {
  std::vector<double> ref, bound;
};

/// grouped_fp8_linear_forward's operands: a [R, K] (tail rows NaN codes: never read), G weights
/// [N, K], scales sa (1 or G) and sw (G).
struct Rows {
  std::vector<uint8_t> a;
  std::vector<std::vector<uint8_t>> w;
  std::vector<float> sa, sw;
};

inline Rows make_rows(const Case& c) {
  Rows d;
  d.a = codes(c, c.R * c.K, c.a_dt);
  for (int64_t i = c.used() * c.K; i < c.R * c.K; ++i) d.a[static_cast<size_t>(i)] = fp8_math::kNaNCode;
  for (int64_t g = 0; g < c.groups(); ++g) d.w.push_back(codes(c, c.N * c.K, c.b_dt));
  d.sa = scales(c, c.per_group_a ? c.groups() : 1);
  d.sw = scales(c, c.groups());
  return d;
}

/// y [R, N]; the tail rows 0.
inline Ref rows_ref(const Case& c, const Rows& d) {
  Ref r{std::vector<double>(static_cast<size_t>(c.R * c.N), 0.0), std::vector<double>(static_cast<size_t>(c.R * c.N), 0.0)};
  for (int64_t g = 0; g < c.groups(); ++g) {
    const double s = scale_of(d.sa, size_t(g)) * d.sw[size_t(g)];
    for (int64_t i = c.first_row(g); i < c.first_row(g) + c.counts[size_t(g)]; ++i)
      for (int64_t j = 0; j < c.N; ++j) {
        double sum = 0, sabs = 0;
        for (int64_t k = 0; k < c.K; ++k) {
          const double p = double(fp8_bits_to_f32(c.a_dt, d.a[size_t(i * c.K + k)])) *
                           fp8_bits_to_f32(c.b_dt, d.w[size_t(g)][size_t(j * c.K + k)]);
          sum += p;
          sabs += std::fabs(p);
        }
        r.ref[size_t(i * c.N + j)] = s * sum;
        r.bound[size_t(i * c.N + j)] = s * sabs;
      }
  }
  return r;
}

/// grouped_fp8_linear_wgrad's operands: dy [R, N] (type a_dt) and x [R, K] (b_dt) as the
/// transposes dyt [N, R], xt [K, R] (columns >= Σc NaN codes: never read), scales sdy (1 or G)
/// and sx (G), and the gradients' initial values dw0 (G x [N, K]).
struct Cols {
  std::vector<uint8_t> dyt, xt;
  std::vector<float> sdy, sx;
  std::vector<std::vector<float>> dw0;
};

inline std::vector<uint8_t> transpose_bytes(const std::vector<uint8_t>& m, int64_t rows, int64_t cols) {
  std::vector<uint8_t> t(m.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = m[size_t(r * cols + c)];
  return t;
}

inline Cols make_cols(const Case& c) {
  Cols d;
  std::vector<uint8_t> dy = codes(c, c.R * c.N, c.a_dt), x = codes(c, c.R * c.K, c.b_dt);
  for (int64_t i = c.used() * c.N; i < c.R * c.N; ++i) dy[size_t(i)] = fp8_math::kNaNCode;
  for (int64_t i = c.used() * c.K; i < c.R * c.K; ++i) x[size_t(i)] = fp8_math::kNaNCode;
  d.dyt = transpose_bytes(dy, c.R, c.N);
  d.xt = transpose_bytes(x, c.R, c.K);
  d.sdy = scales(c, c.per_group_a ? c.groups() : 1);
  d.sx = scales(c, c.groups());
  for (int64_t g = 0; g < c.groups(); ++g) {
    std::vector<float> w = testing::randn(c.N * c.K);
    if (c.ints)
      for (float& v : w) v = std::round(v * 4.f);
    d.dw0.push_back(w);
  }
  return d;
}

/// dW_g [N, K] = dw0_g + the group's product.
inline Ref cols_ref(const Case& c, const Cols& d, int64_t g) {
  Ref r{std::vector<double>(d.dw0[size_t(g)].begin(), d.dw0[size_t(g)].end()),
        std::vector<double>(static_cast<size_t>(c.N * c.K), 0.0)};
  const double s = scale_of(d.sdy, size_t(g)) * d.sx[size_t(g)];
  const int64_t r0 = c.first_row(g), r1 = r0 + c.counts[size_t(g)];
  for (int64_t i = 0; i < c.N; ++i)
    for (int64_t j = 0; j < c.K; ++j) {
      double sum = 0, sabs = 0;
      for (int64_t t = r0; t < r1; ++t) {
        const double p = double(fp8_bits_to_f32(c.a_dt, d.dyt[size_t(i * c.R + t)])) *
                         fp8_bits_to_f32(c.b_dt, d.xt[size_t(j * c.R + t)]);
        sum += p;
        sabs += std::fabs(p);
      }
      r.ref[size_t(i * c.K + j)] += s * sum;
      r.bound[size_t(i * c.K + j)] = s * sabs + std::fabs(d.dw0[size_t(g)][size_t(i * c.K + j)]);
    }
  return r;
}

/// G tensors on `device` (FP8 bytes or fp32 values) and their GroupedWeights.
struct Group {
  std::vector<OwnedTensor> store;
  GroupedWeights weights;
};

inline Group fp8_group(const std::vector<std::vector<uint8_t>>& host, DType t, int64_t rows, int64_t cols,
                       Device device, const Stream& stream) {
  Group o;
  std::vector<Tensor> views;
  for (const auto& h : host) {
    o.store.push_back(fp8_test::bytes_tensor(h, t, device, {rows, cols}, stream));
    views.push_back(o.store.back().t);
  }
  o.weights = GroupedWeights(views, stream);
  return o;
}

inline Group f32_group(const std::vector<std::vector<float>>& host, int64_t rows, int64_t cols, Device device,
                       const Stream& stream) {
  Group o;
  std::vector<Tensor> views;
  for (const auto& h : host) {
    o.store.push_back(testing::make_tensor(h, DType::kF32, device, {rows, cols}, stream));
    views.push_back(o.store.back().t);
  }
  o.weights = GroupedWeights(views, stream);
  return o;
}

}  // namespace mt::grouped_fp8_test
