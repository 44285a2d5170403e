// Shared pieces of the Muon tests (muon_test, muon_cuda_test): float64 references of the
// Newton-Schulz iteration and of singular values, a decoder layer's parameter list with
// tensor-parallel shards, and layout-invariant gradients.
#pragma once
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "model/layers/parallel_params.h"
#include "optim/muon.h"
#include "optim/optimizer.h"
#include "testing/testing.h"

namespace mt::muon_test {

using Mat = std::vector<double>;  // row-major

// ---- float64 references ----------------------------------------------------------------------

// C[m, n] = A[m, k] B[k, n]
inline Mat mm(const Mat& a, const Mat& b, int64_t m, int64_t k, int64_t n) {
  Mat c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < n; ++j) c[i * n + j] += a[i * k + p] * b[p * n + j];
  return c;
}
inline Mat transpose(const Mat& a, int64_t r, int64_t c) {
  Mat t(a.size());
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) t[j * r + i] = a[i * c + j];
  return t;
}

// Newton-Schulz in float64, written from the definition (always on the wide orientation).
inline Mat ns_ref(Mat x, int64_t r, int64_t c, const std::vector<NsCoeff>& co) {
  const bool tall = r > c;
  if (tall) {
    x = transpose(x, r, c);
    std::swap(r, c);
  }
  double ss = 0;
  for (double v : x) ss += v * v;
  const double inv = 1.0 / std::max(std::sqrt(ss), 1e-7);
  for (double& v : x) v *= inv;
  for (const NsCoeff& s : co) {
    const Mat a = mm(x, transpose(x, r, c), r, c, r);
    const Mat a2 = mm(a, a, r, r, r);
    Mat b(a.size());
    for (size_t i = 0; i < b.size(); ++i) b[i] = s.b * a[i] + s.c * a2[i];
    const Mat bx = mm(b, x, r, r, c);
    for (size_t i = 0; i < x.size(); ++i) x[i] = s.a * x[i] + bx[i];
  }
  return tall ? transpose(x, r, c) : x;
}

// Eigenvalues of a symmetric [n, n] matrix (cyclic Jacobi), ascending.
inline std::vector<double> sym_eig(Mat a, int64_t n) {
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = i + 1; j < n; ++j) off += a[i * n + j] * a[i * n + j];
    if (off < 1e-30) break;
    for (int64_t p = 0; p < n; ++p)
      for (int64_t q = p + 1; q < n; ++q) {
        const double apq = a[p * n + q];
        if (std::abs(apq) < 1e-300) continue;
        const double th = (a[q * n + q] - a[p * n + p]) / (2 * apq);
        const double t = (th >= 0 ? 1 : -1) / (std::abs(th) + std::sqrt(th * th + 1));
        const double cs = 1 / std::sqrt(t * t + 1), sn = t * cs;
        for (int64_t k = 0; k < n; ++k) {  // columns p, q
          const double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = cs * akp - sn * akq;
          a[k * n + q] = sn * akp + cs * akq;
        }
        for (int64_t k = 0; k < n; ++k) {  // rows p, q
          const double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = cs * apk - sn * aqk;
          a[q * n + k] = sn * apk + cs * aqk;
        }
      }
  }
  std::vector<double> e(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) e[i] = a[i * n + i];
  std::sort(e.begin(), e.end());
  return e;
}

// Singular values of [r, c] (ascending), from the Gram matrix of the shorter side.
inline std::vector<double> singular_values(const Mat& x, int64_t r, int64_t c) {
  const bool wide = r <= c;
  const Mat g = wide ? mm(x, transpose(x, r, c), r, c, r) : mm(transpose(x, r, c), x, c, r, c);
  std::vector<double> e = sym_eig(g, wide ? r : c);
  for (double& v : e) v = std::sqrt(std::max(v, 0.0));
  return e;
}

inline Mat to_double(const std::vector<float>& v) { return Mat(v.begin(), v.end()); }

constexpr int64_t kH = 16, kHeads = 4, kGroups = 2, kD = 4, kF = 24, kV = 40, kE = 2;

// A decoder layer's parameters at tensor-parallel size tp (rank `rank`): embeddings, norms and
// biases (AdamW), QKV (GQA: 4 heads, 2 groups), proj, gated fc1, fc2, a router and two experts.
inline std::vector<ParamSpec> layer_specs(int tp, int rank) {
  std::vector<ParamSpec> s;
  const std::string L = "decoder.layers.0.";
  s.push_back(column_parallel_weight("embedding.word_embeddings.weight", kV, kH, 0.02f, tp, rank));
  s.back().vocab_rows = kV;
  s.push_back(replicated_param(L + "input_layernorm.weight", {kH}, InitKind::kOnes, 0.f, TpGradSum::kNone));
  s.push_back(column_parallel_weight(L + "self_attention.linear_qkv.weight", (kHeads + 2 * kGroups) * kD, kH, 0.02f,
                                     tp, rank));
  s.push_back(column_parallel_bias(L + "self_attention.linear_qkv.bias", (kHeads + 2 * kGroups) * kD, tp, rank));
  s.push_back(row_parallel_weight(L + "self_attention.linear_proj.weight", kH, kHeads * kD, 0.02f, tp, rank));
  s.push_back(column_parallel_weight(L + "mlp.linear_fc1.weight", kF, kH, 0.02f, tp, rank, 2));
  s.push_back(row_parallel_weight(L + "mlp.linear_fc2.weight", kH, kF, 0.02f, tp, rank));
  s.push_back(replicated_param(L + "mlp.router.weight", {kE, kH}, InitKind::kNormal, 0.02f, TpGradSum::kNone));
  for (int e = 0; e < kE; ++e) {
    s.push_back(column_parallel_weight(L + "mlp.experts.local_experts." + std::to_string(e) + ".linear_fc1.weight", kF,
                                       kH, 0.02f, tp, rank));
    s.back().expert = true;
  }
  s.push_back(column_parallel_weight("output_layer.weight", kV, kH, 0.02f, tp, rank));
  s.back().vocab_rows = kV;
  return s;
}

inline MuonConfig muon_config(const std::string& tp_mode = "duplicated") {
  MuonConfig m;
  m.momentum = 0.9f;
  m.nesterov = true;
  m.coefficient_type = MuonCoefficientType::kQuintic;
  m.tp_mode = parse_muon_tp_mode(tp_mode);
  m.extra_scale_factor = 0.2f;
  m.qkv_q_rows = kHeads / kGroups * kD;
  m.qkv_kv_rows = kD;
  return m;
}

inline OptimizerConfig opt_config(const std::string& tp_mode = "duplicated") {
  OptimizerConfig oc;
  oc.optimizer = "muon";
  oc.weight_decay = 0.1f;
  oc.clip_grad = 1.0f;
  oc.muon = muon_config(tp_mode);
  return oc;
}

// The global gradient of element gi of parameter `name` at `step` (salted by the test seed).
inline float grad_at(int step, const std::string& name, int64_t gi) {
  uint64_t x = testing::test_seed() * 0x9e3779b97f4a7c15ULL ^ (static_cast<uint64_t>(step) << 56) ^
               static_cast<uint64_t>(gi);
  for (char c : name) x = (x ^ static_cast<uint8_t>(c)) * 0x100000001b3ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return static_cast<float>(static_cast<double>(x >> 40) / static_cast<double>(1ULL << 24) * 2.0 - 1.0);
}

inline void set_grads(const ParamStore& P, int step, float factor, const Stream& st) {
  for (size_t i = 0; i < P.size(); ++i) {
    const ParamInfo& p = P.info(i);
    std::vector<float> g(static_cast<size_t>(p.numel));
    for (int64_t e = 0; e < p.numel; ++e) g[e] = grad_at(step, p.name, p.box.global_index(e)) * factor;
    testing::upload(P.grad(i), g, st);
  }
}

// The Muon update of one [r, c] momentum matrix, float64.
inline Mat muon_update(const Mat& u, int64_t r, int64_t c, const MuonConfig& m) {
  Mat o = ns_ref(u, r, c, ns_coefficients(m.coefficient_type, m.num_ns_steps));
  const double s = muon_scale_factor(m.scale_mode, r, c) * m.extra_scale_factor;
  for (double& v : o) v *= s;
  return o;
}

}  // namespace mt::muon_test
