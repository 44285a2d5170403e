// CPU reference of ops/moe.h (act-dtype fp32 rows). The routing math runs in the logits' dtype R:
// fp32 (Megatron's --moe-router-dtype fp32; sums in double, as before) or fp64 (--moe-router-dtype
// fp64: every score, probability, loss and gradient in double; the probabilities handed to the
// dispatcher are rounded to fp32 once, at the end).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "ops/moe.h"

namespace mt::cpu {
namespace {

// Megatron's denominator guard for the sigmoid normalisation (1e-20 in the routing dtype).
template <typename R>
constexpr R kEps = static_cast<R>(1e-20);

template <typename R>
R sigmoid(R x) {
  return R(1) / (R(1) + std::exp(-x));
}

template <typename R>
void softmax_row(const R* x, R* y, int64_t n) {
  R m = -std::numeric_limits<R>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(static_cast<double>(x[i] - m));
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<R>(std::exp(static_cast<double>(x[i] - m)) / s);
}

// Indices of the k largest of v (descending; ties: lower index first) among `allowed`.
template <typename R>
void topk_indices(const std::vector<R>& v, int64_t k, std::vector<int64_t>& out) {
  std::vector<int64_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return v[static_cast<size_t>(a)] > v[static_cast<size_t>(b)]; });
  out.assign(idx.begin(), idx.begin() + k);
}

// Selection of one token: the experts chosen from `scores` (group-limited when configured).
template <typename R>
void select(const std::vector<R>& scores, const MoeRouterOptions& o, std::vector<int64_t>& top) {
  const int64_t E = static_cast<int64_t>(scores.size());
  if (o.num_groups <= 0) {
    topk_indices(scores, o.topk, top);
    return;
  }
  const int64_t G = o.num_groups, per = E / G, kg = o.topk / o.group_topk;
  std::vector<R> group_score(static_cast<size_t>(G));
  std::vector<int64_t> best;
  for (int64_t g = 0; g < G; ++g) {
    std::vector<R> part(scores.begin() + g * per, scores.begin() + (g + 1) * per);
    topk_indices(part, kg, best);
    double s = 0;
    for (int64_t i : best) s += part[static_cast<size_t>(i)];
    group_score[static_cast<size_t>(g)] = static_cast<R>(s);
  }
  std::vector<int64_t> groups;
  topk_indices(group_score, o.group_topk, groups);
  std::vector<R> masked(static_cast<size_t>(E), -std::numeric_limits<R>::infinity());
  for (int64_t g : groups)
    for (int64_t e = g * per; e < (g + 1) * per; ++e) masked[static_cast<size_t>(e)] = scores[static_cast<size_t>(e)];
  topk_indices(masked, o.topk, top);
}

template <typename R>
void topk_routing(const Tensor& probs, const Tensor& top, const Tensor& scores_for_aux, const Tensor& logits,
                  const Tensor& expert_bias, const MoeRouterOptions& o) {
  const int64_t T = logits.size(0), E = logits.size(1), k = o.topk;
  const R* L = logits.data_as<R>();
  const float* bias = !expert_bias.empty() ? expert_bias.data_as<float>() : nullptr;
  float* P = probs.data_as<float>();
  int32_t* I = top.data_as<int32_t>();
  R* A = !scores_for_aux.empty() ? scores_for_aux.data_as<R>() : nullptr;
  const R scaling = static_cast<R>(o.scaling_factor);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const R* l = L + t * E;
    std::vector<R> s(static_cast<size_t>(E)), sel(static_cast<size_t>(E)), pv(static_cast<size_t>(k));
    std::vector<int64_t> chosen;
    if (!o.sigmoid) {
      if (o.pre_softmax) {
        softmax_row(l, s.data(), E);
        select(s, o, chosen);
        for (int64_t j = 0; j < k; ++j) pv[static_cast<size_t>(j)] = s[static_cast<size_t>(chosen[static_cast<size_t>(j)])];
      } else {
        std::copy(l, l + E, sel.begin());
        select(sel, o, chosen);
        std::vector<R> v(static_cast<size_t>(k));
        for (int64_t j = 0; j < k; ++j) v[static_cast<size_t>(j)] = l[chosen[static_cast<size_t>(j)]];
        softmax_row(v.data(), pv.data(), k);
      }
      if (A) softmax_row(l, A + t * E, E);
    } else {
      for (int64_t e = 0; e < E; ++e) {
        s[static_cast<size_t>(e)] = sigmoid(l[e]);
        sel[static_cast<size_t>(e)] = s[static_cast<size_t>(e)] + (bias ? static_cast<R>(bias[e]) : R(0));
      }
      select(sel, o, chosen);
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += s[static_cast<size_t>(chosen[static_cast<size_t>(j)])];
      for (int64_t j = 0; j < k; ++j) {
        const R v = s[static_cast<size_t>(chosen[static_cast<size_t>(j)])];
        pv[static_cast<size_t>(j)] = k > 1 ? static_cast<R>(v / (sum + kEps<R>)) : v;
      }
      if (A) {
        double all = 0;
        for (int64_t e = 0; e < E; ++e) all += s[static_cast<size_t>(e)];
        for (int64_t e = 0; e < E; ++e) A[t * E + e] = static_cast<R>(s[static_cast<size_t>(e)] / (all + kEps<R>));
      }
    }
    for (int64_t j = 0; j < k; ++j) {  // scaled in R, rounded to the fp32 probabilities once
      P[t * k + j] = static_cast<float>(pv[static_cast<size_t>(j)] * scaling);
      I[t * k + j] = static_cast<int32_t>(chosen[static_cast<size_t>(j)]);
    }
  }
}

template <typename R>
void topk_routing_backward(const Tensor& d_logits, const Tensor& d_probs, const Tensor& logits, const Tensor& top,
                           const MoeRouterOptions& o) {
  const int64_t T = logits.size(0), E = logits.size(1), k = o.topk;
  const R* L = logits.data_as<R>();
  const float* dP = d_probs.data_as<float>();
  const int32_t* I = top.data_as<int32_t>();
  R* dL = d_logits.data_as<R>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const R* l = L + t * E;
    R* dl = dL + t * E;
    std::fill(dl, dl + E, R(0));
    std::vector<double> g(static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) g[static_cast<size_t>(j)] = static_cast<double>(dP[t * k + j]) * o.scaling_factor;
    const int32_t* sel = I + t * k;
    if (!o.sigmoid && !o.pre_softmax) {
      // probs = softmax(l[sel]): d l[sel_j] = p_j (g_j - Σ_i p_i g_i)
      std::vector<R> v(static_cast<size_t>(k)), p(static_cast<size_t>(k));
      for (int64_t j = 0; j < k; ++j) v[static_cast<size_t>(j)] = l[sel[j]];
      softmax_row(v.data(), p.data(), k);
      double dot = 0;
      for (int64_t j = 0; j < k; ++j) dot += p[static_cast<size_t>(j)] * g[static_cast<size_t>(j)];
      for (int64_t j = 0; j < k; ++j)
        dl[sel[j]] += static_cast<R>(p[static_cast<size_t>(j)] * (g[static_cast<size_t>(j)] - dot));
    } else if (!o.sigmoid) {
      // probs_j = s[sel_j], s = softmax(l): d l = s ⊙ (G - <s, G>), G scattered from g
      std::vector<R> s(static_cast<size_t>(E));
      softmax_row(l, s.data(), E);
      std::vector<double> G(static_cast<size_t>(E), 0.0);
      for (int64_t j = 0; j < k; ++j) G[static_cast<size_t>(sel[j])] += g[static_cast<size_t>(j)];
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += s[static_cast<size_t>(e)] * G[static_cast<size_t>(e)];
      for (int64_t e = 0; e < E; ++e)
        dl[e] = static_cast<R>(s[static_cast<size_t>(e)] * (G[static_cast<size_t>(e)] - dot));
    } else {
      // probs_j = σ_j / (S + eps) (k > 1) or σ_j; dσ_j = g_j / S' - Σ_i g_i σ_i / S'²
      std::vector<double> sg(static_cast<size_t>(k));
      double S = 0;
      for (int64_t j = 0; j < k; ++j) {
        sg[static_cast<size_t>(j)] = sigmoid(l[sel[j]]);
        S += sg[static_cast<size_t>(j)];
      }
      const double Sp = S + kEps<R>;
      double dot = 0;
      for (int64_t j = 0; j < k; ++j) dot += g[static_cast<size_t>(j)] * sg[static_cast<size_t>(j)];
      for (int64_t j = 0; j < k; ++j) {
        const double ds = k > 1 ? g[static_cast<size_t>(j)] / Sp - dot / (Sp * Sp) : g[static_cast<size_t>(j)];
        const double sj = sg[static_cast<size_t>(j)];
        dl[sel[j]] += static_cast<R>(ds * sj * (1.0 - sj));
      }
    }
  }
}

template <typename R>
void aux_loss(const Tensor& loss, const Tensor& scores, const Tensor& tokens_per_expert, float scale) {
  const int64_t T = scores.size(0), E = scores.size(1), G = tokens_per_expert.numel() / E;
  const R* S = scores.data_as<R>();
  const float* C = tokens_per_expert.data_as<float>();
  double total = 0;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = C + (t % G) * E;
    for (int64_t e = 0; e < E; ++e) total += static_cast<double>(S[t * E + e]) * c[e];
  }
  loss.data_as<float>()[0] += static_cast<float>(scale * total);
}

float scale_of(const Tensor& loss_scale) { return loss_scale.empty() ? 1.f : loss_scale.data_as<float>()[0]; }

template <typename R>
void aux_scores_backward(const Tensor& d_logits, const Tensor& logits, const Tensor& tokens_per_expert, float scale,
                         const Tensor& loss_scale, bool sigmoid_scores) {
  const int64_t T = logits.size(0), E = logits.size(1), G = tokens_per_expert.numel() / E;
  const R* L = logits.data_as<R>();
  const float* tpe = tokens_per_expert.data_as<float>();
  const R cs = static_cast<R>(scale) * static_cast<R>(scale_of(loss_scale));
  std::vector<R> coef(static_cast<size_t>(G * E));
  for (int64_t i = 0; i < G * E; ++i) coef[static_cast<size_t>(i)] = cs * static_cast<R>(tpe[i]);
  R* dL = d_logits.data_as<R>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const R* c = coef.data() + (t % G) * E;
    const R* l = L + t * E;
    R* dl = dL + t * E;
    if (!sigmoid_scores) {
      std::vector<R> s(static_cast<size_t>(E));
      softmax_row(l, s.data(), E);
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += static_cast<double>(s[static_cast<size_t>(e)]) * c[e];
      for (int64_t e = 0; e < E; ++e) dl[e] += static_cast<R>(s[static_cast<size_t>(e)] * (c[e] - dot));
    } else {
      std::vector<double> s(static_cast<size_t>(E));
      double S = 0, dot = 0;
      for (int64_t e = 0; e < E; ++e) {
        s[static_cast<size_t>(e)] = sigmoid(l[e]);
        S += s[static_cast<size_t>(e)];
        dot += s[static_cast<size_t>(e)] * c[e];
      }
      const double Sp = S + kEps<R>;
      for (int64_t e = 0; e < E; ++e) {
        const double se = s[static_cast<size_t>(e)];
        dl[e] += static_cast<R>((c[e] / Sp - dot / (Sp * Sp)) * se * (1.0 - se));
      }
    }
  }
}

template <typename R>
void z_loss(const Tensor& loss, const Tensor& d_logits, const Tensor& logits, float scale, const Tensor& loss_scale) {
  const int64_t T = logits.size(0), E = logits.size(1);
  const R* L = logits.data_as<R>();
  R* dL = !d_logits.empty() ? d_logits.data_as<R>() : nullptr;
  const double gs = static_cast<double>(scale) * scale_of(loss_scale);
  double total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total)
  for (int64_t t = 0; t < T; ++t) {
    const R* l = L + t * E;
    R m = -std::numeric_limits<R>::infinity();
    for (int64_t e = 0; e < E; ++e) m = std::max(m, l[e]);
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += std::exp(static_cast<double>(l[e] - m));
    const double lse = m + std::log(s);
    total += lse * lse;
    if (dL) {
      for (int64_t e = 0; e < E; ++e)
        dL[t * E + e] += static_cast<R>(gs * 2.0 * lse * std::exp(static_cast<double>(l[e]) - lse));
    }
  }
  if (!loss.empty()) loss.data_as<float>()[0] += static_cast<float>(scale * total);
}

bool is_f64(const Tensor& t) { return t.dtype() == DType::kF64; }

}  // namespace

void moe_topk_routing(const Tensor& probs, const Tensor& top, const Tensor& scores_for_aux, const Tensor& logits,
                      const Tensor& expert_bias, const MoeRouterOptions& o, const Stream&) {
  if (is_f64(logits)) {
    topk_routing<double>(probs, top, scores_for_aux, logits, expert_bias, o);
  } else {
    topk_routing<float>(probs, top, scores_for_aux, logits, expert_bias, o);
  }
}

void moe_topk_routing_backward(const Tensor& d_logits, const Tensor& d_probs, const Tensor& logits, const Tensor& top,
                               const MoeRouterOptions& o, const Stream&) {
  if (is_f64(logits)) {
    topk_routing_backward<double>(d_logits, d_probs, logits, top, o);
  } else {
    topk_routing_backward<float>(d_logits, d_probs, logits, top, o);
  }
}

void moe_aux_loss(const Tensor& loss, const Tensor& scores, const Tensor& tokens_per_expert, float scale,
                  const Stream&) {
  if (is_f64(scores)) {
    aux_loss<double>(loss, scores, tokens_per_expert, scale);
  } else {
    aux_loss<float>(loss, scores, tokens_per_expert, scale);
  }
}

void moe_aux_scores_backward(const Tensor& d_logits, const Tensor& logits, const Tensor& tokens_per_expert,
                             float scale, const Tensor& loss_scale, bool sigmoid, const Stream&) {
  if (is_f64(logits)) {
    aux_scores_backward<double>(d_logits, logits, tokens_per_expert, scale, loss_scale, sigmoid);
  } else {
    aux_scores_backward<float>(d_logits, logits, tokens_per_expert, scale, loss_scale, sigmoid);
  }
}

void moe_z_loss(const Tensor& loss, const Tensor& d_logits, const Tensor& logits, float scale,
                const Tensor& loss_scale, const Stream&) {
  if (is_f64(logits)) {
    z_loss<double>(loss, d_logits, logits, scale, loss_scale);
  } else {
    z_loss<float>(loss, d_logits, logits, scale, loss_scale);
  }
}

void moe_tokens_per_expert(const Tensor& counts, const Tensor& top, const Stream&) {
  const int64_t n = top.numel(), k = top.size(-1), E = counts.size(-1), G = counts.numel() / E;
  const int32_t* I = top.data_as<int32_t>();
  float* c = counts.data_as<float>();
  std::fill(c, c + counts.numel(), 0.f);
  for (int64_t i = 0; i < n; ++i) c[((i / k) % G) * E + I[i]] += 1.f;
}

void moe_global_tokens_per_expert(const Tensor& average, const Tensor& accumulator, const Tensor& counts,
                                  const Stream&) {
  const int64_t E = average.numel();
  const float* c = counts.data_as<float>();
  float* acc = accumulator.data_as<float>();
  float* avg = average.data_as<float>();
  acc[E] += 1.f;
  for (int64_t e = 0; e < E; ++e) {
    acc[e] += c[e];
    avg[e] = acc[e] / acc[E];
  }
}

void moe_expert_bias_update(const Tensor& expert_bias, const Tensor& tokens_per_expert, float rate, const Stream&) {
  const int64_t E = expert_bias.numel();
  const float* c = tokens_per_expert.data_as<float>();
  float* b = expert_bias.data_as<float>();
  double sum = 0;  // in expert order, as the CUDA kernel
  for (int64_t e = 0; e < E; ++e) sum += c[e];
  const float mean = static_cast<float>(sum / static_cast<double>(E));
  for (int64_t e = 0; e < E; ++e) {
    const float d = mean - c[e];
    b[e] += rate * static_cast<float>((d > 0.f) - (d < 0.f));
  }
}

std::vector<int64_t> moe_routing_map(const Tensor& row_index, const Tensor& slot_row, const Tensor& counts,
                                     const Tensor& top, int64_t first_expert, int64_t num_local, const Stream&) {
  const int64_t n = top.numel();
  const int32_t* I = top.data_as<int32_t>();
  int32_t* rows = row_index.data_as<int32_t>();
  int32_t* inv = slot_row.data_as<int32_t>();
  int32_t* cnt = counts.data_as<int32_t>();
  std::fill(cnt, cnt + num_local, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = I[i] - first_expert;
    if (e >= 0 && e < num_local) ++cnt[e];
  }
  std::vector<int64_t> next(static_cast<size_t>(num_local), 0);
  for (int64_t e = 1; e < num_local; ++e) next[static_cast<size_t>(e)] = next[static_cast<size_t>(e - 1)] + cnt[e - 1];
  const int64_t R = next.back() + cnt[num_local - 1];
  MT_CHECK(R <= row_index.numel(), "moe_routing_map: {} rows exceed the planned {}", R, row_index.numel());
  for (int64_t i = 0; i < n; ++i) {  // flat slot order = token, then slot: stable within an expert
    const int64_t e = I[i] - first_expert;
    inv[i] = -1;
    if (e >= 0 && e < num_local) {
      const int64_t r = next[static_cast<size_t>(e)]++;
      rows[r] = static_cast<int32_t>(i);
      inv[i] = static_cast<int32_t>(r);
    }
  }
  return std::vector<int64_t>(cnt, cnt + num_local);
}

void moe_routing_map_device(const Tensor& row_index, const Tensor& slot_row, const Tensor& counts, const Tensor& top,
                            int64_t first_expert, int64_t num_local, const Stream& stream) {
  // On the CPU the "device" is host memory: the same map, and the unused rows marked -1.
  const std::vector<int64_t> c = cpu::moe_routing_map(row_index, slot_row, counts, top, first_expert, num_local, stream);
  int64_t R = 0;
  for (int64_t v : c) R += v;
  int32_t* rows = row_index.data_as<int32_t>();
  std::fill(rows + R, rows + row_index.numel(), -1);
}

void moe_permute(const Tensor& rows, const Tensor& x, const Tensor& row_index, int64_t topk, const Stream&) {
  const int64_t R = rows.size(0), h = rows.size(1);
  const float* X = x.data_as<float>();
  const int32_t* idx = row_index.data_as<int32_t>();
  float* Y = rows.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    if (idx[r] < 0) continue;  // beyond the routed rows (moe_routing_map_device)
    std::copy(X + (idx[r] / topk) * h, X + (idx[r] / topk + 1) * h, Y + r * h);
  }
}

void moe_permute_backward(const Tensor& dx, const Tensor& d_rows, const Tensor& slot_row, int64_t topk,
                          const Stream&) {
  const int64_t N = dx.size(0), h = dx.size(1);
  const float* D = d_rows.data_as<float>();
  const int32_t* inv = slot_row.data_as<int32_t>();
  float* X = dx.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    float* xt = X + t * h;
    std::fill(xt, xt + h, 0.f);
    for (int64_t j = 0; j < topk; ++j) {
      const int32_t r = inv[t * topk + j];
      if (r < 0) continue;
      const float* dr = D + static_cast<int64_t>(r) * h;
      for (int64_t c = 0; c < h; ++c) xt[c] += dr[c];
    }
  }
}

void moe_unpermute(const Tensor& y, const Tensor& rows, const Tensor& probs, const Tensor& slot_row,
                   const Stream&) {
  const int64_t N = y.size(0), h = y.size(1), k = probs.size(1);
  const float* Rw = rows.data_as<float>();
  const float* P = probs.data_as<float>();
  const int32_t* inv = slot_row.data_as<int32_t>();
  float* Y = y.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    float* yt = Y + t * h;
    std::fill(yt, yt + h, 0.f);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = inv[t * k + j];
      if (r < 0) continue;
      const float p = P[t * k + j];
      const float* rr = Rw + static_cast<int64_t>(r) * h;
      for (int64_t c = 0; c < h; ++c) yt[c] += p * rr[c];
    }
  }
}

void moe_unpermute_backward(const Tensor& d_rows, const Tensor& d_probs, const Tensor& dy, const Tensor& rows,
                            const Tensor& probs, const Tensor& row_index, const Tensor& slot_row, const Stream&) {
  const int64_t R = rows.size(0), h = rows.size(1), k = probs.size(1), n = d_probs.numel();
  const float* Rw = rows.data_as<float>();
  const float* P = probs.data_as<float>();
  const float* DY = dy.data_as<float>();
  const int32_t* idx = row_index.data_as<int32_t>();
  const int32_t* inv = slot_row.data_as<int32_t>();
  float* DR = d_rows.data_as<float>();
  float* DP = d_probs.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    float* dr = DR + r * h;
    if (idx[r] < 0) {  // a row no slot maps to (padding of a block layout): zero gradient
      std::fill(dr, dr + h, 0.f);
      continue;
    }
    const float* g = DY + (idx[r] / k) * h;
    const float p = P[idx[r]];
    for (int64_t c = 0; c < h; ++c) dr[c] = p * g[c];
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const int32_t r = inv[i];
    if (r < 0) {
      DP[i] = 0.f;
      continue;
    }
    const float* g = DY + (i / k) * h;
    const float* rr = Rw + static_cast<int64_t>(r) * h;
    double dot = 0;
    for (int64_t c = 0; c < h; ++c) dot += static_cast<double>(g[c]) * rr[c];
    DP[i] = static_cast<float>(dot);
  }
}

void moe_capacity_drop(const Tensor& kept, const Tensor& kept_counts, const Tensor& top, const Tensor& probs,
                       int64_t capacity, bool by_probs, const Stream&) {
  const int64_t n = top.numel(), E = kept_counts.numel();
  const int32_t* I = top.data_as<int32_t>();
  const float* P = probs.data_as<float>();
  int32_t* K = kept.data_as<int32_t>();
  float* C = kept_counts.data_as<float>();
  std::fill(K, K + n, -1);
#pragma omp parallel for schedule(dynamic)
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> slots;  // flat slots routed to e, in token order
    for (int64_t i = 0; i < n; ++i)
      if (I[i] == e) slots.push_back(i);
    // a NaN probability ranks last (as −inf; the CUDA kernel's order): a strict weak order
    const auto key = [&](int64_t s) { return std::isnan(P[s]) ? -std::numeric_limits<float>::infinity() : P[s]; };
    if (by_probs && static_cast<int64_t>(slots.size()) > capacity)
      std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return key(a) > key(b); });
    const int64_t keep = std::min<int64_t>(capacity, static_cast<int64_t>(slots.size()));
    for (int64_t r = 0; r < keep; ++r) K[slots[static_cast<size_t>(r)]] = static_cast<int32_t>(e);
    C[e] = static_cast<float>(keep);
  }
}

}  // namespace mt::cpu
