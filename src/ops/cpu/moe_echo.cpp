// CPU reference of ops/moe_echo.h: the ECHO planner written as its steps (sorts, cumulative sums,
// interval overlaps, as in the source's description), in int64, and the rerouting as a walk over
// the slots in order. The CUDA backend computes the same integers another way (ranks by counting).
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "ops/moe_echo.h"

namespace mt {
namespace echo {
namespace {

// Indices 0..n-1 stably sorted by `before(a, b)`.
template <typename Less>
std::vector<int64_t> order_by(int64_t n, Less before) {
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), before);
  return idx;
}

int64_t overlap(int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
  return std::max<int64_t>(0, std::min(a1, b1) - std::max(a0, b0));
}

}  // namespace

std::vector<int64_t> spillover(const std::vector<int64_t>& tokens, int64_t avg) {
  const auto n = static_cast<int64_t>(tokens.size());
  const auto idx = order_by(n, [&](int64_t a, int64_t b) { return tokens[size_t(a)] < tokens[size_t(b)]; });
  std::vector<int64_t> spill(tokens.size(), 0);
  int64_t cum = 0, prev = 0;  // cumulative sum, and its clamped excess over avg so far
  for (int64_t e : idx) {
    cum += tokens[size_t(e)];
    const int64_t excess = std::max<int64_t>(0, cum - avg);
    spill[size_t(e)] = excess - prev;
    prev = excess;
  }
  return spill;
}

Intermediate gen_intermediate(const std::vector<int64_t>& tok, int64_t ep) {
  const auto E = static_cast<int64_t>(tok.size());
  MT_CHECK(ep >= 1 && E % ep == 0, "echo::gen_intermediate: {} experts over {} EP ranks", E, ep);
  const int64_t L = E / ep;
  Intermediate out;
  out.load.assign(size_t(ep), 0);
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    out.load[size_t(e / L)] += tok[size_t(e)];
    total += tok[size_t(e)];
  }
  out.avg = total / ep;
  out.spare.resize(size_t(ep));
  for (int64_t p = 0; p < ep; ++p) out.spare[size_t(p)] = std::max<int64_t>(0, out.avg - out.load[size_t(p)]);
  out.spill.resize(size_t(E));
  for (int64_t p = 0; p < ep; ++p) {
    const std::vector<int64_t> local(tok.begin() + p * L, tok.begin() + (p + 1) * L);
    const auto s = spillover(local, out.avg);
    std::copy(s.begin(), s.end(), out.spill.begin() + p * L);
  }
  return out;
}

std::vector<int64_t> one_shot_greedy_assignment(const std::vector<int64_t>& chunks,
                                                const std::vector<int64_t>& buckets) {
  const size_t C = chunks.size(), B = buckets.size();
  std::vector<int64_t> out(C * B, 0);
  int64_t c0 = 0;
  for (size_t c = 0; c < C; ++c) {
    MT_CHECK(chunks[c] >= 0, "echo::one_shot_greedy_assignment: negative chunk {}", chunks[c]);
    int64_t b0 = 0;
    for (size_t b = 0; b < B; ++b) {
      MT_CHECK(buckets[b] >= 0, "echo::one_shot_greedy_assignment: negative bucket {}", buckets[b]);
      out[c * B + b] = overlap(c0, c0 + chunks[c], b0, b0 + buckets[b]);
      b0 += buckets[b];
    }
    c0 += chunks[c];
  }
  return out;
}

std::vector<int64_t> assignment(const std::vector<int64_t>& spill, const std::vector<int64_t>& spare) {
  const auto E = static_cast<int64_t>(spill.size()), ep = static_cast<int64_t>(spare.size());
  const auto ei = order_by(E, [&](int64_t a, int64_t b) { return spill[size_t(a)] > spill[size_t(b)]; });
  const auto pi = order_by(ep, [&](int64_t a, int64_t b) { return spare[size_t(a)] > spare[size_t(b)]; });
  std::vector<int64_t> chunks, buckets;
  for (int64_t e : ei) chunks.push_back(spill[size_t(e)]);
  for (int64_t p : pi) buckets.push_back(spare[size_t(p)]);
  const auto sorted = one_shot_greedy_assignment(chunks, buckets);
  std::vector<int64_t> a(size_t(E * ep), 0);
  for (int64_t i = 0; i < E; ++i)
    for (int64_t j = 0; j < ep; ++j) a[size_t(ei[size_t(i)] * ep + pi[size_t(j)])] = sorted[size_t(i * ep + j)];
  return a;
}

std::vector<int64_t> split_quota(const std::vector<int64_t>& src, const std::vector<int64_t>& quotas) {
  const auto R = static_cast<int64_t>(src.size()), n = static_cast<int64_t>(quotas.size());
  const int64_t tot = std::accumulate(src.begin(), src.end(), int64_t{0});
  const int64_t want = std::accumulate(quotas.begin(), quotas.end(), int64_t{0});
  MT_CHECK(want <= tot, "echo::split_quota: quotas sum to {} but the sources hold {}", want, tot);
  std::vector<int64_t> out(size_t(R * n), 0), left(src), need(quotas);
  // Breadth-first: proportional floors.
  for (int64_t s = 0; s < n; ++s)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t f = tot > 0 ? src[size_t(r)] * quotas[size_t(s)] / tot : 0;
      out[size_t(r * n + s)] = f;
      left[size_t(r)] -= f;
      need[size_t(s)] -= f;
    }
  // Depth-first: the remainders from the leftovers, by interval overlap.
  const auto extra = one_shot_greedy_assignment(left, need);
  for (size_t i = 0; i < out.size(); ++i) out[i] += extra[i];
  return out;
}

Plan plan(const std::vector<int64_t>& counts, int64_t ep, int64_t E, int64_t S) {
  const auto n = static_cast<int64_t>(counts.size());
  MT_CHECK(ep >= 1 && E >= 1 && E % ep == 0 && S >= 1 && n >= ep * E && n % (ep * E) == 0,
           "echo::plan: counts of {} values for ep {}, {} experts, {} echo slots (expected a multiple of ep x E)",
           counts.size(), ep, E, S);
  const int64_t R = n / E;  // source ranks
  std::vector<int64_t> tok(size_t(E), 0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t e = 0; e < E; ++e) {
      const int64_t c = counts[size_t(r * E + e)];
      MT_CHECK(c >= 0, "moe_echo_plan: counts[{}, {}] = {} is negative", r, e, c);
      tok[size_t(e)] += c;
    }
  const Intermediate im = gen_intermediate(tok, ep);
  const auto a = assignment(im.spill, im.spare);
  const int64_t NS = ep * S;
  Plan out;
  out.clone_expert.assign(size_t(NS), -1);
  out.clone_quota.assign(size_t(NS), 0);
  out.quota.assign(size_t(R * NS), 0);
  for (int64_t p = 0; p < ep; ++p) {  // the S largest positive entries of column p
    const auto ei = order_by(E, [&](int64_t x, int64_t y) { return a[size_t(x * ep + p)] > a[size_t(y * ep + p)]; });
    for (int64_t j = 0; j < S && j < E; ++j) {
      const int64_t e = ei[size_t(j)], v = a[size_t(e * ep + p)];
      if (v <= 0) break;
      out.clone_expert[size_t(p * S + j)] = e;
      out.clone_quota[size_t(p * S + j)] = v;
    }
  }
  for (int64_t e = 0; e < E; ++e) {  // the source split, per home expert over its clones
    std::vector<int64_t> slots, quotas, src(static_cast<size_t>(R));
    for (int64_t s = 0; s < NS; ++s)
      if (out.clone_expert[size_t(s)] == e) {
        slots.push_back(s);
        quotas.push_back(out.clone_quota[size_t(s)]);
      }
    if (slots.empty()) continue;
    for (int64_t r = 0; r < R; ++r) src[size_t(r)] = counts[size_t(r * E + e)];
    const auto q = split_quota(src, quotas);
    const auto m = static_cast<int64_t>(slots.size());
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < m; ++i) out.quota[size_t(r * NS + slots[size_t(i)])] = q[size_t(r * m + i)];
  }
  return out;
}

}  // namespace echo

namespace cpu {

void moe_echo_plan(const Tensor& clone_expert, const Tensor& clone_quota, const Tensor& quota, const Tensor& counts,
                   int64_t ep, int64_t num_echo, const Stream&) {
  const int64_t E = counts.size(1);
  const int32_t* c = counts.data_as<int32_t>();
  const echo::Plan p = echo::plan(std::vector<int64_t>(c, c + counts.numel()), ep, E, num_echo);
  const auto put = [](const Tensor& t, const std::vector<int64_t>& v) {
    std::transform(v.begin(), v.end(), t.data_as<int32_t>(), [](int64_t x) { return static_cast<int32_t>(x); });
  };
  put(clone_expert, p.clone_expert);
  put(clone_quota, p.clone_quota);
  put(quota, p.quota);
}

void moe_echo_reroute(const Tensor& rerouted, const Tensor& top, const Tensor& clone_expert, const Tensor& quota_row,
                      int64_t num_experts, const Stream&) {
  const int64_t n = top.numel(), NS = clone_expert.numel(), E = num_experts;
  const int32_t* in = top.data_as<int32_t>();
  const int32_t* ce = clone_expert.data_as<int32_t>();
  const int32_t* q = quota_row.data_as<int32_t>();
  int32_t* out = rerouted.data_as<int32_t>();
  // Per expert: its clones in slot order (next_clone chains them), and the clone being filled.
  std::vector<int64_t> first(size_t(E), -1), next(size_t(NS), -1), cur(size_t(E), -1), used(size_t(E), 0);
  for (int64_t s = NS - 1; s >= 0; --s) {
    const int64_t e = ce[s];
    if (e < 0 || e >= E) continue;
    next[size_t(s)] = first[size_t(e)];
    first[size_t(e)] = s;
  }
  cur = first;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = in[i];
    out[i] = e;
    if (e < 0 || e >= E) continue;
    int64_t& s = cur[size_t(e)];
    while (s >= 0 && used[size_t(e)] >= q[s]) {  // this clone is full: the next one
      used[size_t(e)] = 0;
      s = next[size_t(s)];
    }
    if (s < 0) continue;
    out[i] = static_cast<int32_t>(E + s);
    ++used[size_t(e)];
  }
}

void moe_echo_virtual_experts(const Tensor& out, const Tensor& in, int64_t num_experts, int64_t ep, int64_t num_echo,
                              const Stream&) {
  const int64_t n = in.numel(), E = num_experts, L = E / ep, S = num_echo;
  const int32_t* x = in.data_as<int32_t>();
  int32_t* y = out.data_as<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = x[i];
    MT_CHECK(e < E + ep * S, "moe_echo_virtual_experts: expert id {} at {} is not below {} experts + {} spare slots", e,
             i, E, ep * S);
    if (e < 0) {
      y[i] = static_cast<int32_t>(e);
    } else if (e < E) {
      y[i] = static_cast<int32_t>((e / L) * (L + S) + e % L);
    } else {
      const int64_t s = e - E;
      y[i] = static_cast<int32_t>((s / S) * (L + S) + L + s % S);
    }
  }
}

}  // namespace cpu
}  // namespace mt
