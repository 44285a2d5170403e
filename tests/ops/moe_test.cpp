// MoE routing and permutation ops (ops/moe.h) on the CPU against a float64 reference written
// here from Megatron-Core's definitions (topk_routing_with_score_function, group_limited_topk,
// the aux-loss scores, z_loss_func), and their backward against central finite differences of it;
// the same with fp64 logits (--moe-router-dtype fp64) at double-precision tolerances, and the fp64
// router GEMM.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "ops/elementwise.h"
#include "ops/moe.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;
const Device kCpu = Device::cpu();

std::vector<int> topk_ref(const std::vector<double>& v, int64_t k) {
  std::vector<int> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return v[a] > v[b]; });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

std::vector<double> softmax_ref(const std::vector<double>& x) {
  const double m = *std::max_element(x.begin(), x.end());
  double s = 0;
  for (double v : x) s += std::exp(v - m);
  std::vector<double> y;
  for (double v : x) y.push_back(std::exp(v - m) / s);
  return y;
}

double sigmoid_ref(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Selection of one token (group-limited when configured).
std::vector<int> select_ref(const std::vector<double>& s, const MoeRouterOptions& o) {
  if (o.num_groups == 0) return topk_ref(s, o.topk);
  const int64_t E = static_cast<int64_t>(s.size()), per = E / o.num_groups;
  std::vector<double> gs;
  for (int64_t g = 0; g < o.num_groups; ++g) {
    std::vector<double> part(s.begin() + g * per, s.begin() + (g + 1) * per);
    double sum = 0;
    for (int i : topk_ref(part, o.topk / o.group_topk)) sum += part[static_cast<size_t>(i)];
    gs.push_back(sum);
  }
  std::vector<double> masked(s.size(), -std::numeric_limits<double>::infinity());
  for (int g : topk_ref(gs, o.group_topk))
    for (int64_t e = g * per; e < (g + 1) * per; ++e) masked[static_cast<size_t>(e)] = s[static_cast<size_t>(e)];
  return topk_ref(masked, o.topk);
}

// probs of one token for a given selection `sel` (if empty: selects), per Megatron's definitions.
std::vector<double> probs_ref(const std::vector<double>& l, const std::vector<double>& bias, const MoeRouterOptions& o,
                              std::vector<int>& sel) {
  std::vector<double> p;
  if (!o.sigmoid) {
    if (o.pre_softmax) {
      const auto s = softmax_ref(l);
      if (sel.empty()) sel = select_ref(s, o);
      for (int e : sel) p.push_back(s[static_cast<size_t>(e)]);
    } else {
      if (sel.empty()) sel = select_ref(l, o);
      std::vector<double> v;
      for (int e : sel) v.push_back(l[static_cast<size_t>(e)]);
      p = softmax_ref(v);
    }
  } else {
    std::vector<double> s, r;
    for (size_t e = 0; e < l.size(); ++e) {
      s.push_back(sigmoid_ref(l[e]));
      r.push_back(s.back() + (bias.empty() ? 0.0 : bias[e]));
    }
    if (sel.empty()) sel = select_ref(r, o);
    double sum = 0;
    for (int e : sel) sum += s[static_cast<size_t>(e)];
    for (int e : sel) p.push_back(o.topk > 1 ? s[static_cast<size_t>(e)] / (sum + 1e-20) : s[static_cast<size_t>(e)]);
  }
  for (double& v : p) v *= o.scaling_factor;
  return p;
}

std::vector<double> aux_scores_ref(const std::vector<double>& l, bool sigmoid) {
  if (!sigmoid) return softmax_ref(l);
  std::vector<double> s;
  double sum = 0;
  for (double v : l) {
    s.push_back(sigmoid_ref(v));
    sum += s.back();
  }
  for (double& v : s) v /= sum + 1e-20;
  return s;
}

struct Case {
  const char* name;
  MoeRouterOptions o;
  bool bias;
};

std::vector<Case> cases() {
  std::vector<Case> c;
  MoeRouterOptions o;
  o.topk = 2;
  c.push_back({"softmax top-2", o, false});
  o.pre_softmax = true;
  c.push_back({"pre-softmax top-2", o, false});
  o.pre_softmax = false;
  o.topk = 1;
  c.push_back({"softmax top-1", o, false});
  o.topk = 3;
  o.scaling_factor = 2.5f;
  c.push_back({"softmax top-3 scaled", o, false});
  MoeRouterOptions s;
  s.sigmoid = true;
  s.topk = 2;
  c.push_back({"sigmoid top-2", s, false});
  c.push_back({"sigmoid top-2 with expert bias", s, true});
  s.topk = 1;
  c.push_back({"sigmoid top-1", s, false});
  s.topk = 4;
  s.num_groups = 4;
  s.group_topk = 2;
  s.scaling_factor = 2.5f;
  c.push_back({"sigmoid group-limited (DeepSeek-V3 style)", s, true});
  MoeRouterOptions g;
  g.topk = 2;
  g.num_groups = 2;
  g.group_topk = 1;
  c.push_back({"softmax group-limited", g, false});
  return c;
}

TEST(MoeRouting, ForwardMatchesFloat64Reference) {
  const Stream& st = testing::cpu_stream();
  const int64_t T = 37, E = 8;
  for (const Case& cs : cases()) {
    const MoeRouterOptions& o = cs.o;
    const auto lv = testing::randn(T * E, 1.5f);
    const auto bv = testing::randn(E, 0.3f);
    auto logits = testing::make_tensor(lv, DType::kF32, kCpu, {T, E}, st);
    auto bias = testing::make_tensor(bv, DType::kF32, kCpu, {E}, st);
    OwnedTensor probs(DType::kF32, kCpu, {T, o.topk}), top(DType::kI32, kCpu, {T, o.topk}),
        aux(DType::kF32, kCpu, {T, E});
    testing::poison(probs, st);
    moe_topk_routing(probs, top, aux, logits, cs.bias ? bias.t : Tensor(), o, st);
    const auto pv = testing::to_host(probs, st), av = testing::to_host(aux, st);
    const int32_t* iv = top.t.data_as<int32_t>();
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> l(lv.begin() + t * E, lv.begin() + (t + 1) * E), b;
      if (cs.bias) b.assign(bv.begin(), bv.end());
      std::vector<int> sel;
      const auto p = probs_ref(l, b, o, sel);
      const auto a = aux_scores_ref(l, o.sigmoid);
      for (int64_t j = 0; j < o.topk; ++j) {
        ASSERT_EQ(iv[t * o.topk + j], sel[static_cast<size_t>(j)]) << cs.name << " token " << t << " slot " << j;
        EXPECT_NEAR(pv[t * o.topk + j], p[static_cast<size_t>(j)], 1e-6 * std::max(1.0, std::fabs(p[static_cast<size_t>(j)])))
            << cs.name;
      }
      for (int64_t e = 0; e < E; ++e) EXPECT_NEAR(av[t * E + e], a[static_cast<size_t>(e)], 1e-6) << cs.name;
    }
    // Group-limited routing only ever picks experts of group_topk groups.
    if (o.num_groups > 0) {
      const int64_t per = E / o.num_groups;
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int> groups;
        for (int64_t j = 0; j < o.topk; ++j) groups.push_back(iv[t * o.topk + j] / static_cast<int>(per));
        std::sort(groups.begin(), groups.end());
        groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
        EXPECT_LE(static_cast<int64_t>(groups.size()), o.group_topk) << cs.name;
      }
    }
  }
}

TEST(MoeRouting, BackwardMatchesFiniteDifferences) {
  const Stream& st = testing::cpu_stream();
  const int64_t T = 9, E = 8;
  for (const Case& cs : cases()) {
    const MoeRouterOptions& o = cs.o;
    const auto lv = testing::randn(T * E, 1.5f);
    const auto bv = testing::randn(E, 0.3f);
    const auto gv = testing::randn(T * o.topk);
    auto logits = testing::make_tensor(lv, DType::kF32, kCpu, {T, E}, st);
    auto bias = testing::make_tensor(bv, DType::kF32, kCpu, {E}, st);
    auto dprobs = testing::make_tensor(gv, DType::kF32, kCpu, {T, o.topk}, st);
    OwnedTensor probs(DType::kF32, kCpu, {T, o.topk}), top(DType::kI32, kCpu, {T, o.topk}),
        dlog(DType::kF32, kCpu, {T, E});
    moe_topk_routing(probs, top, Tensor(), logits, cs.bias ? bias.t : Tensor(), o, st);
    testing::poison(dlog, st);
    moe_topk_routing_backward(dlog, dprobs, logits, top, o, st);
    const auto dv = testing::to_host(dlog, st);
    const int32_t* iv = top.t.data_as<int32_t>();
    // f(logits of token t) = Σ_j g_j probs_j with the selection fixed (the gradient of the op).
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> x(lv.begin() + t * E, lv.begin() + (t + 1) * E), b;
      if (cs.bias) b.assign(bv.begin(), bv.end());
      std::vector<int> fixed(iv + t * o.topk, iv + (t + 1) * o.topk);
      auto f = [&] {
        std::vector<int> sel = fixed;
        const auto p = probs_ref(x, b, o, sel);
        double s = 0;
        for (int64_t j = 0; j < o.topk; ++j) s += gv[t * o.topk + j] * p[static_cast<size_t>(j)];
        return s;
      };
      for (int64_t e = 0; e < E; ++e) {
        const double num = testing::finite_diff(f, x, static_cast<size_t>(e), 1e-6);
        EXPECT_NEAR(dv[t * E + e], num, 1e-5 * std::max(1.0, std::fabs(num))) << cs.name << " t " << t << " e " << e;
      }
    }
  }
}

TEST(MoeRouting, AuxScoresBackwardAndZLossMatchFiniteDifferences) {
  const Stream& st = testing::cpu_stream();
  const int64_t T = 7, E = 6;
  for (bool sigmoid : {false, true}) {
    const auto lv = testing::randn(T * E, 2.f);
    const auto cv = testing::randn(E);
    auto logits = testing::make_tensor(lv, DType::kF32, kCpu, {T, E}, st);
    // coef[e] = scale · loss_scale · tokens_per_expert[e] = cv[e]
    const float scale = 0.5f, ls = 4.f;
    std::vector<float> tv(cv.size());
    for (size_t e = 0; e < cv.size(); ++e) tv[e] = cv[e] / (scale * ls);
    auto tpe = testing::make_tensor(tv, DType::kF32, kCpu, {E}, st);
    auto loss_scale = testing::make_tensor({ls}, DType::kF32, kCpu, {1}, st);
    const auto base = testing::randn(T * E);
    auto dlog = testing::make_tensor(base, DType::kF32, kCpu, {T, E}, st);
    moe_aux_scores_backward(dlog, logits, tpe, scale, loss_scale, sigmoid, st);
    const float zscale = 0.37f;
    // the gradient accumulates on top (scaled by the loss scale); the value separately
    moe_z_loss(Tensor(), dlog, logits, zscale / ls, loss_scale, st);
    auto zacc = testing::make_tensor({1.f}, DType::kF32, kCpu, {1}, st);
    moe_z_loss(zacc, Tensor(), logits, 2.f, Tensor(), st);
    const double z = (testing::to_host(zacc, st)[0] - 1.0) / 2.0;
    // the load-balancing loss value: 3 · Σ_t Σ_e scores · tokens_per_expert
    OwnedTensor scores(DType::kF32, kCpu, {T, E}), probs(DType::kF32, kCpu, {T, 1}), top(DType::kI32, kCpu, {T, 1});
    MoeRouterOptions o;
    o.topk = 1;
    o.sigmoid = sigmoid;
    moe_topk_routing(probs, top, scores, logits, Tensor(), o, st);
    auto aacc = testing::make_tensor({0.f}, DType::kF32, kCpu, {1}, st);
    moe_aux_loss(aacc, scores, tpe, 3.f, st);
    double aref = 0;
    const auto dv = testing::to_host(dlog, st);
    double zref = 0;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> x(lv.begin() + t * E, lv.begin() + (t + 1) * E);
      auto f = [&] {
        const auto s = aux_scores_ref(x, sigmoid);
        double v = 0, m = *std::max_element(x.begin(), x.end()), sum = 0;
        for (int64_t e = 0; e < E; ++e) v += cv[static_cast<size_t>(e)] * s[static_cast<size_t>(e)];
        for (double a : x) sum += std::exp(a - m);
        const double lse = m + std::log(sum);
        return v + zscale * lse * lse;
      };
      {
        double m = *std::max_element(x.begin(), x.end()), sum = 0;
        for (double a : x) sum += std::exp(a - m);
        zref += (m + std::log(sum)) * (m + std::log(sum));
        const auto s = aux_scores_ref(x, sigmoid);
        for (int64_t e = 0; e < E; ++e) aref += 3.0 * s[static_cast<size_t>(e)] * tv[static_cast<size_t>(e)];
      }
      for (int64_t e = 0; e < E; ++e) {
        const double num = testing::finite_diff(f, x, static_cast<size_t>(e), 1e-6);
        EXPECT_NEAR(dv[t * E + e] - base[t * E + e], num, 1e-5 * std::max(1.0, std::fabs(num))) << sigmoid;
      }
    }
    EXPECT_NEAR(z, zref, 1e-5 * zref);  // the differences l - max are taken in fp32; the sum is stored in fp32
    EXPECT_NEAR(testing::to_host(aacc, st)[0], aref, 1e-5 * std::fabs(aref)) << sigmoid;
  }
}

TEST(MoePermute, RoutingMapPermuteUnpermuteAndBackward) {
  const Stream& st = testing::cpu_stream();
  const int64_t N = 23, E = 8, k = 2, h = 5;
  // A selection with distinct experts per token.
  std::vector<int32_t> top(N * k);
  for (int64_t t = 0; t < N; ++t) {
    const auto r = testing::randint(2, 0, static_cast<int32_t>(E));
    top[t * k] = r[0];
    top[t * k + 1] = (r[0] + 1 + r[1] % (E - 1)) % E;
  }
  auto topt = testing::make_int_tensor(top, kCpu, {N, k}, st);
  for (int64_t first : {0, 3}) {
    const int64_t nl = first == 0 ? E : 4;  // all experts, or experts 3..6
    OwnedTensor rows_index(DType::kI32, kCpu, {N * k}), slot_row(DType::kI32, kCpu, {N * k}),
        counts(DType::kI32, kCpu, {nl});
    const std::vector<int64_t> host_counts = moe_routing_map(rows_index, slot_row, counts, topt, first, nl, st);
    const int64_t R = std::accumulate(host_counts.begin(), host_counts.end(), int64_t{0});
    const int32_t* ri = rows_index.t.data_as<int32_t>();
    const int32_t* sr = slot_row.t.data_as<int32_t>();
    const int32_t* ct = counts.t.data_as<int32_t>();
    // Expected: for each local expert in order, the flat slots choosing it, ascending.
    std::vector<int32_t> want;
    for (int64_t e = first; e < first + nl; ++e) {
      int32_t c = 0;
      for (int64_t i = 0; i < N * k; ++i)
        if (top[i] == e) {
          want.push_back(static_cast<int32_t>(i));
          ++c;
        }
      EXPECT_EQ(ct[e - first], c);
      EXPECT_EQ(host_counts[static_cast<size_t>(e - first)], c);
    }
    ASSERT_EQ(R, static_cast<int64_t>(want.size()));
    for (int64_t r = 0; r < R; ++r) EXPECT_EQ(ri[r], want[static_cast<size_t>(r)]);
    for (int64_t i = 0; i < N * k; ++i) {  // the inverse map: slot -> row, -1 for other ranks' experts
      const auto it = std::find(want.begin(), want.end(), static_cast<int32_t>(i));
      EXPECT_EQ(sr[i], it == want.end() ? -1 : static_cast<int32_t>(it - want.begin())) << i;
    }

    const auto xv = testing::randn(N * h), pv = testing::randn(N * k), ov = testing::randn(R * h),
               dyv = testing::randn(N * h);
    auto x = testing::make_tensor(xv, DType::kF32, kCpu, {N, h}, st);
    auto probs = testing::make_tensor(pv, DType::kF32, kCpu, {N, k}, st);
    auto out = testing::make_tensor(ov, DType::kF32, kCpu, {R, h}, st);
    auto dy = testing::make_tensor(dyv, DType::kF32, kCpu, {N, h}, st);
    OwnedTensor xp(DType::kF32, kCpu, {R, h}), y(DType::kF32, kCpu, {N, h}), drows(DType::kF32, kCpu, {R, h}),
        dprobs(DType::kF32, kCpu, {N, k}), dx(DType::kF32, kCpu, {N, h});
    moe_permute(xp, x, rows_index, k, st);
    moe_unpermute(y, out, probs, slot_row, st);
    moe_unpermute_backward(drows, dprobs, dy, out, probs, rows_index, slot_row, st);
    moe_permute_backward(dx, drows, slot_row, k, st);
    const auto xpv = testing::to_host(xp, st), yv = testing::to_host(y, st), drv = testing::to_host(drows, st),
               dpv = testing::to_host(dprobs, st), dxv = testing::to_host(dx, st);
    std::vector<double> yref(N * h, 0.0), dpref(N * k, 0.0), dxref(N * h, 0.0);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = want[static_cast<size_t>(r)], t = i / k;
      for (int64_t c = 0; c < h; ++c) {
        EXPECT_EQ(xpv[r * h + c], xv[t * h + c]);
        yref[t * h + c] += static_cast<double>(pv[i]) * ov[r * h + c];
        const double drow = static_cast<double>(pv[i]) * dyv[t * h + c];
        EXPECT_NEAR(drv[r * h + c], drow, 1e-6 * std::max(1.0, std::fabs(drow)));
        dpref[i] += static_cast<double>(dyv[t * h + c]) * ov[r * h + c];
        dxref[t * h + c] += drow;
      }
    }
    EXPECT_LT(testing::rel_err(yv, yref), 1e-6);
    EXPECT_LT(testing::rel_err(dpv, dpref), 1e-6);
    EXPECT_LT(testing::rel_err(dxv, dxref), 1e-6);
    // Slots routed to other ranks' experts get no probability gradient.
    for (int64_t i = 0; i < N * k; ++i)
      if (top[i] < first || top[i] >= first + nl) EXPECT_EQ(dpv[i], 0.f);

    OwnedTensor tpe(DType::kF32, kCpu, {E});
    moe_tokens_per_expert(tpe, topt, st);
    const auto tv = testing::to_host(tpe, st);
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(tv[e], std::count(top.begin(), top.end(), static_cast<int32_t>(e)));
  }
}

// The sync-free routing map: the same maps and counts as moe_routing_map, row_index -1 beyond the
// routed rows, moe_permute over all planned rows leaves those rows untouched and
// moe_unpermute_backward gives them zero gradients.
TEST(MoePermute, DeviceRoutingMapMarksUnusedRowsAndPermuteSkipsThem) {
  const Stream& st = testing::cpu_stream();
  const int64_t N = 31, E = 6, k = 2, h = 3, first = 1, nl = 3, cap = N * k + 5;
  std::vector<int32_t> top(N * k);
  for (int64_t t = 0; t < N; ++t) {
    const auto r = testing::randint(2, 0, static_cast<int32_t>(E));
    top[t * k] = r[0];
    top[t * k + 1] = t % 5 == 0 ? -1 : (r[0] + 1 + r[1] % (E - 1)) % E;  // some dropped slots
  }
  auto topt = testing::make_int_tensor(top, kCpu, {N, k}, st);
  OwnedTensor ri(DType::kI32, kCpu, {cap}), sr(DType::kI32, kCpu, {N * k}), c(DType::kI32, kCpu, {nl});
  OwnedTensor ri2(DType::kI32, kCpu, {cap}), sr2(DType::kI32, kCpu, {N * k}), c2(DType::kI32, kCpu, {nl});
  const std::vector<int64_t> host = moe_routing_map(ri, sr, c, topt, first, nl, st);
  moe_routing_map_device(ri2, sr2, c2, topt, first, nl, st);
  const int64_t R = std::accumulate(host.begin(), host.end(), int64_t{0});
  ASSERT_LT(R, cap);
  for (int64_t e = 0; e < nl; ++e) EXPECT_EQ(c2.t.data_as<int32_t>()[e], host[static_cast<size_t>(e)]);
  for (int64_t i = 0; i < N * k; ++i) EXPECT_EQ(sr2.t.data_as<int32_t>()[i], sr.t.data_as<int32_t>()[i]) << i;
  for (int64_t r = 0; r < cap; ++r)
    EXPECT_EQ(ri2.t.data_as<int32_t>()[r], r < R ? ri.t.data_as<int32_t>()[r] : -1) << r;
  const auto xv = testing::randn(N * h);
  auto x = testing::make_tensor(xv, DType::kF32, kCpu, {N, h}, st);
  OwnedTensor xp(DType::kF32, kCpu, {cap, h});
  fill(xp, 7.f, st);
  moe_permute(xp, x, ri2, k, st);
  const auto got = testing::to_host(xp, st);
  for (int64_t r = 0; r < cap; ++r)
    for (int64_t j = 0; j < h; ++j) {
      const float want = r < R ? xv[(ri.t.data_as<int32_t>()[r] / k) * h + j] : 7.f;
      EXPECT_EQ(got[r * h + j], want) << r;
    }
  // unpermute_backward over all planned rows: the rows with row_index -1 get zero gradients, the
  // routed ones probs · dy (d_rows poisoned first).
  const auto pv = testing::randu(N * k, 0.1f, 1.f), dyv = testing::randn(N * h);
  // probs as a view one element into a buffer that starts with NaN: a read of probs[-1] would show.
  std::vector<float> pbuf = {std::nanf("")};
  pbuf.insert(pbuf.end(), pv.begin(), pv.end());
  auto pb = testing::make_tensor(pbuf, DType::kF32, kCpu, {N * k + 1}, st);
  const Tensor probs = pb.t.flat_range(1, N * k).view({N, k});
  auto dy = testing::make_tensor(dyv, DType::kF32, kCpu, {N, h}, st);
  OwnedTensor drows(DType::kF32, kCpu, {cap, h}), dprobs(DType::kF32, kCpu, {N, k});
  testing::poison(drows, st);
  moe_unpermute_backward(drows, dprobs, dy, xp, probs, ri2, sr2, st);
  const auto drv = testing::to_host(drows, st);
  for (int64_t r = 0; r < cap; ++r)
    for (int64_t j = 0; j < h; ++j) {
      const int32_t i = ri2.t.data_as<int32_t>()[r];
      EXPECT_EQ(drv[r * h + j], r < R ? pv[i] * dyv[(i / k) * h + j] : 0.f) << r;
    }
  OwnedTensor small(DType::kI32, kCpu, {R - 1});  // too few planned rows: the CPU raises
  EXPECT_THROW(moe_routing_map_device(small, sr2, c2, topt, first, nl, st), Error);
}

// Per-sequence counts (seq_aux_loss): token t of a [s, b] layout counts in row t mod b; the loss
// and its gradient read each token's own row. Expert bias update: sign of (mean load - load).
TEST(MoeRouting, SequenceGroupedCountsLossAndExpertBiasUpdate) {
  const Stream& st = testing::cpu_stream();
  const int64_t T = 12, E = 5, k = 2, G = 3;
  std::vector<int32_t> top(T * k);
  for (int64_t t = 0; t < T; ++t) {
    top[t * k] = static_cast<int32_t>(t % E);
    top[t * k + 1] = static_cast<int32_t>((t * 3 + 1) % E == t % E ? (t + 1) % E : (t * 3 + 1) % E);
  }
  auto topt = testing::make_int_tensor(top, kCpu, {T, k}, st);
  OwnedTensor counts(DType::kF32, kCpu, {G, E});
  moe_tokens_per_expert(counts, topt, st);
  const auto cv = testing::to_host(counts, st);
  std::vector<double> want(G * E, 0.0);
  for (int64_t i = 0; i < T * k; ++i) want[((i / k) % G) * E + top[i]] += 1;
  for (int64_t i = 0; i < G * E; ++i) EXPECT_EQ(cv[i], want[i]) << i;

  const auto lv = testing::randn(T * E, 1.5f);
  auto logits = testing::make_tensor(lv, DType::kF32, kCpu, {T, E}, st);
  for (bool sigmoid : {false, true}) {
    OwnedTensor scores(DType::kF32, kCpu, {T, E}), probs(DType::kF32, kCpu, {T, k}), tp(DType::kI32, kCpu, {T, k});
    MoeRouterOptions o;
    o.sigmoid = sigmoid;
    moe_topk_routing(probs, tp, scores, logits, Tensor(), o, st);
    auto acc = testing::make_tensor({0.f}, DType::kF32, kCpu, {1}, st);
    moe_aux_loss(acc, scores, counts, 0.5f, st);
    const auto sv = testing::to_host(scores, st);
    double ref = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) ref += 0.5 * sv[t * E + e] * want[(t % G) * E + e];
    EXPECT_NEAR(testing::to_host(acc, st)[0], ref, 1e-5 * ref);
    // gradient against finite differences of the same objective
    OwnedTensor dlog(DType::kF32, kCpu, {T, E});
    fill(dlog, 0.f, st);
    moe_aux_scores_backward(dlog, logits, counts, 0.5f, Tensor(), sigmoid, st);
    const auto dv = testing::to_host(dlog, st);
    for (int64_t t = 0; t < T; t += 5) {
      std::vector<double> x(lv.begin() + t * E, lv.begin() + (t + 1) * E);
      auto f = [&] {
        const auto s = aux_scores_ref(x, sigmoid);
        double v = 0;
        for (int64_t e = 0; e < E; ++e) v += 0.5 * s[static_cast<size_t>(e)] * want[(t % G) * E + e];
        return v;
      };
      for (int64_t e = 0; e < E; ++e) {
        const double num = testing::finite_diff(f, x, static_cast<size_t>(e), 1e-6);
        EXPECT_NEAR(dv[t * E + e], num, 1e-5 * std::max(1.0, std::fabs(num))) << sigmoid << " " << t << " " << e;
      }
    }
  }

  // mean load 4: experts above it move down by the rate, below it up, equal stays
  auto bias = testing::make_tensor({0.f, 0.1f, -0.2f, 0.f, 1.f}, DType::kF32, kCpu, {E}, st);
  auto load = testing::make_tensor({4.f, 9.f, 0.f, 3.f, 4.f}, DType::kF32, kCpu, {E}, st);
  moe_expert_bias_update(bias, load, 0.01f, st);
  const auto bv = testing::to_host(bias, st);
  const std::vector<float> bw = {0.f, 0.1f - 0.01f, -0.2f + 0.01f, 0.01f, 1.f};
  for (int64_t e = 0; e < E; ++e) EXPECT_FLOAT_EQ(bv[e], bw[e]) << e;
  OwnedTensor wrong(DType::kF32, kCpu, {E + 1});
  EXPECT_THROW(moe_expert_bias_update(bias, wrong, 0.01f, st), Error);
  OwnedTensor odd(DType::kF32, kCpu, {5, E});  // 5 groups do not divide 12 tokens
  EXPECT_THROW(moe_tokens_per_expert(odd, topt, st), Error);
}

// The global load-balancing loss (--moe-router-load-balancing-type global_aux_loss; Megatron's
// _apply_global_aux_loss): over the micro-batches of a step the counts (here this rank's plus
// another data-parallel rank's, as the all-reduce gives them) are accumulated and averaged over the
// forwards so far (global_tokens_per_expert / ga_steps); the switch loss of each micro-batch
// reads that mean, and its gradient treats it as a constant. Value and gradient against a float64
// reference and finite differences of it; a reset restarts the mean.
TEST(MoeRouting, GlobalTokensPerExpertLossAndGradient) {
  const Stream& st = testing::cpu_stream();
  const int64_t T = 8, E = 5, k = 2, M = 3;
  const float scale = 0.3f;
  for (bool sigmoid : {false, true}) {
    OwnedTensor acc(DType::kF32, kCpu, {E + 1}), avg(DType::kF32, kCpu, {E}), counts(DType::kF32, kCpu, {E});
    fill(acc, 0.f, st);
    std::vector<double> sum(E, 0.0);
    for (int64_t m = 0; m < M; ++m) {
      const auto lv = testing::randn(T * E, 1.5f);
      auto logits = testing::make_tensor(lv, DType::kF32, kCpu, {T, E}, st);
      OwnedTensor scores(DType::kF32, kCpu, {T, E}), probs(DType::kF32, kCpu, {T, k}), top(DType::kI32, kCpu, {T, k});
      MoeRouterOptions o;
      o.topk = k;
      o.sigmoid = sigmoid;
      moe_topk_routing(probs, top, scores, logits, Tensor(), o, st);
      moe_tokens_per_expert(counts, top, st);
      const auto tv = testing::to_host(top, st);
      const auto other = testing::randint(E, 0, 9);  // another DP rank's counts
      auto other_t = testing::make_tensor(std::vector<float>(other.begin(), other.end()), DType::kF32, kCpu, {E}, st);
      add(counts, counts, other_t, st);  // the all-reduce's sum
      for (int64_t e = 0; e < E; ++e) sum[e] += other[e];
      for (int64_t i = 0; i < T * k; ++i) sum[tv[i]] += 1;
      moe_global_tokens_per_expert(avg, acc, counts, st);
      const auto av = testing::to_host(avg, st), accv = testing::to_host(acc, st);
      std::vector<double> mean(E);
      for (int64_t e = 0; e < E; ++e) {
        mean[e] = sum[e] / static_cast<double>(m + 1);
        EXPECT_EQ(accv[e], sum[e]) << e;
        EXPECT_FLOAT_EQ(av[e], static_cast<float>(mean[e])) << sigmoid << " m " << m << " e " << e;
      }
      EXPECT_EQ(accv[E], static_cast<float>(m + 1));
      // the loss value: scale · Σ_t Σ_e scores · mean counts
      auto loss = testing::make_tensor({0.f}, DType::kF32, kCpu, {1}, st);
      moe_aux_loss(loss, scores, avg, scale, st);
      double ref = 0;
      for (int64_t t = 0; t < T; ++t) {
        const auto sc = aux_scores_ref(std::vector<double>(lv.begin() + t * E, lv.begin() + (t + 1) * E), sigmoid);
        for (int64_t e = 0; e < E; ++e) ref += scale * sc[static_cast<size_t>(e)] * mean[e];
      }
      EXPECT_NEAR(testing::to_host(loss, st)[0], ref, 1e-5 * ref) << sigmoid << " m " << m;
      // its gradient, the mean counts constant
      OwnedTensor dlog(DType::kF32, kCpu, {T, E});
      fill(dlog, 0.f, st);
      moe_aux_scores_backward(dlog, logits, avg, scale, Tensor(), sigmoid, st);
      const auto dv = testing::to_host(dlog, st);
      for (int64_t t = 0; t < T; t += 3) {
        std::vector<double> x(lv.begin() + t * E, lv.begin() + (t + 1) * E);
        auto f = [&] {
          const auto sc = aux_scores_ref(x, sigmoid);
          double v = 0;
          for (int64_t e = 0; e < E; ++e) v += scale * sc[static_cast<size_t>(e)] * mean[e];
          return v;
        };
        for (int64_t e = 0; e < E; ++e) {
          const double num = testing::finite_diff(f, x, static_cast<size_t>(e), 1e-6);
          EXPECT_NEAR(dv[t * E + e], num, 1e-5 * std::max(1.0, std::fabs(num))) << sigmoid << " " << t << " " << e;
        }
      }
    }
    // the step boundary: zeroed, the next forward's mean is its own counts
    fill(acc, 0.f, st);
    auto c = testing::make_tensor({3.f, 0.f, 7.f, 1.f, 5.f}, DType::kF32, kCpu, {E}, st);
    moe_global_tokens_per_expert(avg, acc, c, st);
    EXPECT_EQ(testing::to_host(avg, st), testing::to_host(c, st));
  }
  OwnedTensor a(DType::kF32, kCpu, {E}), c(DType::kF32, kCpu, {E}), bad(DType::kF32, kCpu, {E});
  EXPECT_THROW(moe_global_tokens_per_expert(a, bad, c, st), Error);  // accumulator must be [E + 1]
  OwnedTensor c2(DType::kF32, kCpu, {E + 1}), acc2(DType::kF32, kCpu, {E + 1});
  EXPECT_THROW(moe_global_tokens_per_expert(a, acc2, c2, st), Error);
}

// Chunks of rows regrouped by a permutation (Megatron's sort_chunks_by_idxs), against a float64
// reference; the inverse sizes/order restore the input; zero-size chunks; fp32 and bf16.
TEST(MoeSortChunks, MatchesReferenceAndInverts) {
  const Stream& st = testing::cpu_stream();
  const int64_t h = 7;
  // [source 3][local expert 4] chunks with some empty ones, sorted to [local expert][source].
  const int64_t S = 3, El = 4, C = S * El;
  std::vector<int64_t> sizes(C);
  const auto r = testing::randint(C, 0, 4);
  for (int64_t c = 0; c < C; ++c) sizes[c] = c % 5 == 2 ? 0 : r[c];
  std::vector<int64_t> order;
  for (int64_t e = 0; e < El; ++e)
    for (int64_t src = 0; src < S; ++src) order.push_back(src * El + e);
  const int64_t R = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  ASSERT_GT(R, 0);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const auto xv = testing::rounded(testing::randn(R * h), dt);
    auto x = testing::make_tensor(xv, dt, kCpu, {R, h}, st);
    OwnedTensor y(dt, kCpu, {R, h}), back(dt, kCpu, {R, h});
    testing::poison(y, st);
    testing::poison(back, st);
    moe_sort_chunks(y, x, sizes, order, st);
    // Reference in float64: chunk starts, then the chunks in `order`.
    std::vector<int64_t> start(C, 0);
    for (int64_t c = 1; c < C; ++c) start[c] = start[c - 1] + sizes[c - 1];
    std::vector<double> want;
    for (int64_t c : order)
      for (int64_t i = start[c] * h; i < (start[c] + sizes[c]) * h; ++i) want.push_back(xv[i]);
    const auto yv = testing::to_host(y, st);
    ASSERT_EQ(yv.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(static_cast<double>(yv[i]), want[i]) << i;
    const auto [isizes, iorder] = moe_sort_chunks_inverse(sizes, order);
    moe_sort_chunks(back, y, isizes, iorder, st);
    EXPECT_EQ(testing::to_host(back, st), xv);
  }
  // A single chunk and all-empty chunks.
  OwnedTensor a(DType::kF32, kCpu, {0, h}), b(DType::kF32, kCpu, {0, h});
  moe_sort_chunks(b, a, {0, 0}, {1, 0}, st);
  // Errors: sizes not summing to R, not a permutation, negative size, shape mismatch, aliasing.
  OwnedTensor p(DType::kF32, kCpu, {5, h}), q(DType::kF32, kCpu, {5, h}), w(DType::kF32, kCpu, {5, h + 1});
  EXPECT_THROW(moe_sort_chunks(q, p, {2, 2}, {1, 0}, st), Error);
  EXPECT_THROW(moe_sort_chunks(q, p, {2, 3}, {1, 1}, st), Error);
  EXPECT_THROW(moe_sort_chunks(q, p, {6, -1}, {1, 0}, st), Error);
  EXPECT_THROW(moe_sort_chunks(q, p, {2, 3}, {0}, st), Error);
  EXPECT_THROW(moe_sort_chunks(w, p, {2, 3}, {1, 0}, st), Error);
  EXPECT_THROW(moe_sort_chunks(p, p, {2, 3}, {1, 0}, st), Error);
}

// Expert capacity (Megatron's get_capacity with num_tokens = T·k) and token dropping against a
// reference written here: per expert, the routed slots ranked by prob (ties: earlier slot) or by
// position, the first `capacity` kept; kept counts; capacity 0 drops everything.
TEST(MoeCapacity, DropMatchesReference) {
  EXPECT_EQ(moe_expert_capacity(16, 2, 4, 1.0), 8);
  EXPECT_EQ(moe_expert_capacity(16, 2, 4, 0.5), 4);
  EXPECT_EQ(moe_expert_capacity(10, 2, 8, 1.0), 3);    // ceil(2.5)
  EXPECT_EQ(moe_expert_capacity(12, 1, 5, 1.25), 3);   // ceil(3.0)
  EXPECT_THROW(moe_expert_capacity(16, 2, 4, 0.0), Error);
  EXPECT_THROW(moe_expert_capacity(16, 2, 4, -1.0), Error);
  const Stream& st = testing::cpu_stream();
  const int64_t T = 29, E = 5, k = 2;
  std::vector<int32_t> top(T * k);
  for (int64_t t = 0; t < T; ++t) {
    const auto r = testing::randint(2, 0, static_cast<int32_t>(E));
    top[t * k] = r[0];
    top[t * k + 1] = (r[0] + 1 + r[1] % (E - 1)) % E;
  }
  auto pv = testing::randu(T * k, 0.f, 1.f);
  pv[3] = pv[7] = pv[11] = 0.5f;  // ties
  pv[5] = pv[9] = pv[20] = pv[33] = std::nanf("");  // a NaN ranks below every number (never over capacity)
  auto topt = testing::make_int_tensor(top, kCpu, {T, k}, st);
  auto probs = testing::make_tensor(pv, DType::kF32, kCpu, {T, k}, st);
  for (bool by_probs : {true, false}) {
    for (int64_t cap : {int64_t{0}, int64_t{3}, int64_t{6}, int64_t{T}}) {
      OwnedTensor kept(DType::kI32, kCpu, {T, k}), counts(DType::kF32, kCpu, {E});
      moe_capacity_drop(kept, counts, topt, probs, cap, by_probs, st);
      std::vector<int32_t> want(T * k, -1);
      for (int64_t e = 0; e < E; ++e) {
        std::vector<int64_t> slots;
        for (int64_t i = 0; i < T * k; ++i)
          if (top[i] == e) slots.push_back(i);
        if (by_probs)
          std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) {
            const double ka = std::isnan(pv[a]) ? -1e300 : pv[a], kb = std::isnan(pv[b]) ? -1e300 : pv[b];
            return ka > kb || (ka == kb && a < b);
          });
        const int64_t keep = std::min<int64_t>(cap, static_cast<int64_t>(slots.size()));
        for (int64_t r = 0; r < keep; ++r) want[slots[r]] = static_cast<int32_t>(e);
        EXPECT_EQ(counts.t.data_as<float>()[e], static_cast<float>(keep)) << e;
      }
      const int32_t* kv = kept.t.data_as<int32_t>();
      EXPECT_EQ(std::vector<int32_t>(kv, kv + T * k), want) << "by_probs " << by_probs << " capacity " << cap;
    }
  }
  OwnedTensor kept(DType::kI32, kCpu, {T, k}), counts(DType::kF32, kCpu, {E}), wrong(DType::kI32, kCpu, {T, k + 1});
  EXPECT_THROW(moe_capacity_drop(kept, counts, topt, probs, -1, true, st), Error);
  EXPECT_THROW(moe_capacity_drop(wrong, counts, topt, probs, 3, true, st), Error);
  EXPECT_THROW(moe_capacity_drop(topt, counts, topt, probs, 3, true, st), Error);  // in place
}

// --moe-router-dtype fp64: fp64 logits carrying bits below fp32's resolution (a silent fp32
// round trip would show at the 1e-12 tolerances), the routing math in double.
std::vector<double> fp64_logits(int64_t n, float stddev) {
  const auto a = testing::randn(n, stddev), b = testing::randn(n);
  std::vector<double> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(a[i]) + 1e-9 * static_cast<double>(b[i]);
  return v;
}

TEST(MoeRoutingFp64, ForwardMatchesFloat64Reference) {
  const Stream& st = testing::cpu_stream();
  const int64_t T = 37, E = 8;
  for (const Case& cs : cases()) {
    const MoeRouterOptions& o = cs.o;
    const auto lv = fp64_logits(T * E, 1.5f);
    const auto bv = testing::randn(E, 0.3f);
    auto logits = testing::make_tensor_f64(lv, kCpu, {T, E}, st);
    auto bias = testing::make_tensor(bv, DType::kF32, kCpu, {E}, st);
    OwnedTensor probs(DType::kF32, kCpu, {T, o.topk}), top(DType::kI32, kCpu, {T, o.topk}),
        aux(DType::kF64, kCpu, {T, E});
    testing::poison(probs, st);
    testing::poison(aux, st);
    moe_topk_routing(probs, top, aux, logits, cs.bias ? bias.t : Tensor(), o, st);
    const auto pv = testing::to_host(probs, st);
    const auto av = testing::to_host_f64(aux, st);
    const int32_t* iv = top.t.data_as<int32_t>();
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> l(lv.begin() + t * E, lv.begin() + (t + 1) * E), b;
      if (cs.bias) b.assign(bv.begin(), bv.end());
      std::vector<int> sel;
      const auto p = probs_ref(l, b, o, sel);
      const auto a = aux_scores_ref(l, o.sigmoid);
      for (int64_t j = 0; j < o.topk; ++j) {
        ASSERT_EQ(iv[t * o.topk + j], sel[static_cast<size_t>(j)]) << cs.name << " token " << t << " slot " << j;
        // the double probability rounded once to fp32: within half an fp32 ulp (+ double noise)
        const double want = p[static_cast<size_t>(j)];
        EXPECT_NEAR(pv[t * o.topk + j], want, 6.0e-8 * std::fabs(want) + 1e-14) << cs.name;
      }
      for (int64_t e = 0; e < E; ++e) EXPECT_NEAR(av[t * E + e], a[static_cast<size_t>(e)], 1e-14) << cs.name;
    }
  }
}

TEST(MoeRoutingFp64, BackwardMatchesFiniteDifferences) {
  const Stream& st = testing::cpu_stream();
  const int64_t T = 9, E = 8;
  for (const Case& cs : cases()) {
    const MoeRouterOptions& o = cs.o;
    const auto lv = fp64_logits(T * E, 1.5f);
    const auto bv = testing::randn(E, 0.3f);
    const auto gv = testing::randn(T * o.topk);
    auto logits = testing::make_tensor_f64(lv, kCpu, {T, E}, st);
    auto bias = testing::make_tensor(bv, DType::kF32, kCpu, {E}, st);
    auto dprobs = testing::make_tensor(gv, DType::kF32, kCpu, {T, o.topk}, st);
    OwnedTensor probs(DType::kF32, kCpu, {T, o.topk}), top(DType::kI32, kCpu, {T, o.topk}),
        dlog(DType::kF64, kCpu, {T, E});
    moe_topk_routing(probs, top, Tensor(), logits, cs.bias ? bias.t : Tensor(), o, st);
    testing::poison(dlog, st);
    moe_topk_routing_backward(dlog, dprobs, logits, top, o, st);
    const auto dv = testing::to_host_f64(dlog, st);
    const int32_t* iv = top.t.data_as<int32_t>();
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> x(lv.begin() + t * E, lv.begin() + (t + 1) * E), b;
      if (cs.bias) b.assign(bv.begin(), bv.end());
      std::vector<int> fixed(iv + t * o.topk, iv + (t + 1) * o.topk);
      auto f = [&] {
        std::vector<int> sel = fixed;
        const auto p = probs_ref(x, b, o, sel);
        double s = 0;
        for (int64_t j = 0; j < o.topk; ++j) s += gv[t * o.topk + j] * p[static_cast<size_t>(j)];
        return s;
      };
      for (int64_t e = 0; e < E; ++e) {  // fp32 routing is only good to ~1e-7 here
        const double num = testing::finite_diff(f, x, static_cast<size_t>(e), 1e-5);
        EXPECT_NEAR(dv[t * E + e], num, 1e-8 * std::max(1.0, std::fabs(num))) << cs.name << " t " << t << " e " << e;
      }
    }
  }
}

TEST(MoeRoutingFp64, AuxScoresBackwardAndZLossMatchFiniteDifferences) {
  const Stream& st = testing::cpu_stream();
  const int64_t T = 7, E = 6;
  for (bool sigmoid : {false, true}) {
    const auto lv = fp64_logits(T * E, 2.f);
    const auto tv = testing::randn(E);  // tokens_per_expert (any values: the op is linear in them)
    auto logits = testing::make_tensor_f64(lv, kCpu, {T, E}, st);
    const float scale = 0.5f, ls = 4.f, zscale = 0.37f;
    auto tpe = testing::make_tensor(tv, DType::kF32, kCpu, {E}, st);
    auto loss_scale = testing::make_tensor({ls}, DType::kF32, kCpu, {1}, st);
    std::vector<double> base(static_cast<size_t>(T * E));
    for (size_t i = 0; i < base.size(); ++i) base[i] = lv[i] * 0.25;  // accumulates on top of this
    auto dlog = testing::make_tensor_f64(base, kCpu, {T, E}, st);
    moe_aux_scores_backward(dlog, logits, tpe, scale, loss_scale, sigmoid, st);
    moe_z_loss(Tensor(), dlog, logits, zscale, loss_scale, st);
    const auto dv = testing::to_host_f64(dlog, st);
    OwnedTensor scores(DType::kF64, kCpu, {T, E}), probs(DType::kF32, kCpu, {T, 1}), top(DType::kI32, kCpu, {T, 1});
    MoeRouterOptions o;
    o.topk = 1;
    o.sigmoid = sigmoid;
    moe_topk_routing(probs, top, scores, logits, Tensor(), o, st);
    auto aacc = testing::make_tensor({0.f}, DType::kF32, kCpu, {1}, st);
    moe_aux_loss(aacc, scores, tpe, 3.f, st);
    auto zacc = testing::make_tensor({0.f}, DType::kF32, kCpu, {1}, st);
    moe_z_loss(zacc, Tensor(), logits, 2.f, Tensor(), st);
    double aref = 0, zref = 0;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> x(lv.begin() + t * E, lv.begin() + (t + 1) * E);
      auto lse_of = [&] {
        const double m = *std::max_element(x.begin(), x.end());
        double sum = 0;
        for (double a : x) sum += std::exp(a - m);
        return m + std::log(sum);
      };
      auto f = [&] {  // scale·ls·Σ_e s_e·tpe_e + zscale·ls·lse²
        const auto s = aux_scores_ref(x, sigmoid);
        double v = 0;
        for (int64_t e = 0; e < E; ++e) v += s[static_cast<size_t>(e)] * tv[static_cast<size_t>(e)];
        const double lse = lse_of();
        return static_cast<double>(scale) * ls * v + static_cast<double>(zscale) * ls * lse * lse;
      };
      const auto s = aux_scores_ref(x, sigmoid);
      for (int64_t e = 0; e < E; ++e) aref += 3.0 * s[static_cast<size_t>(e)] * tv[static_cast<size_t>(e)];
      zref += 2.0 * lse_of() * lse_of();
      for (int64_t e = 0; e < E; ++e) {
        const double num = testing::finite_diff(f, x, static_cast<size_t>(e), 1e-5);
        const size_t i = static_cast<size_t>(t * E + e);
        // central differences at h = 1e-5 carry ~eps·|f|/h of rounding (up to ~2e-9 here); an fp32
        // path would be off by ~1e-7
        EXPECT_NEAR(dv[i] - base[i], num, 1e-8 * std::max(1.0, std::fabs(num))) << sigmoid << " t " << t << " e " << e;
      }
    }
    // the values: double sums stored in the fp32 accumulators
    EXPECT_NEAR(testing::to_host(aacc, st)[0], aref, 1e-6 * std::fabs(aref) + 1e-7) << sigmoid;
    EXPECT_NEAR(testing::to_host(zacc, st)[0], zref, 1e-6 * zref) << sigmoid;
  }
}

TEST(MoeRoutingFp64, RouterGemmMatchesFloat64Reference) {
  const Stream& st = testing::cpu_stream();
  const int64_t T = 13, h = 24, E = 5;
  const auto xv = testing::randn(T * h), wv = testing::randn(E * h), dxv = testing::randn(T * h),
             dwv = testing::randn(E * h);
  const auto dl = fp64_logits(T * E, 1.f);
  auto x = testing::make_tensor(xv, DType::kF32, kCpu, {T, h}, st);
  auto w = testing::make_tensor(wv, DType::kF32, kCpu, {E, h}, st);
  auto dlog = testing::make_tensor_f64(dl, kCpu, {T, E}, st);
  auto dx = testing::make_tensor(dxv, DType::kF32, kCpu, {T, h}, st);
  auto dw = testing::make_tensor(dwv, DType::kF32, kCpu, {E, h}, st);
  OwnedTensor logits(DType::kF64, kCpu, {T, E});
  testing::poison(logits, st);
  moe_router_logits_fp64(logits, x, w, st);
  moe_router_logits_fp64_backward(dx, dw, dlog, x, w, st);
  const auto lv = testing::to_host_f64(logits, st);
  const auto gx = testing::to_host(dx, st), gw = testing::to_host(dw, st);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      long double r = 0;  // a wider reference
      for (int64_t i = 0; i < h; ++i) r += static_cast<long double>(xv[t * h + i]) * wv[e * h + i];
      // products of two fp32 values are exact in double: only the sum rounds
      EXPECT_NEAR(lv[t * E + e], static_cast<double>(r), 1e-14) << t << " " << e;
    }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < h; ++i) {
      double r = dxv[t * h + i];
      for (int64_t e = 0; e < E; ++e) r += dl[t * E + e] * wv[e * h + i];
      EXPECT_NEAR(gx[t * h + i], r, 6e-8 * std::fabs(r) + 1e-12) << "dx " << t << " " << i;  // rounded once
    }
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < h; ++i) {
      double r = dwv[e * h + i];
      for (int64_t t = 0; t < T; ++t) r += dl[t * E + e] * xv[t * h + i];
      EXPECT_NEAR(gw[e * h + i], r, 6e-8 * std::fabs(r) + 1e-12) << "dw " << e << " " << i;
    }
  // errors: fp32 logits, a mismatched weight
  OwnedTensor l32(DType::kF32, kCpu, {T, E}), w2(DType::kF32, kCpu, {E, h + 1});
  EXPECT_THROW(moe_router_logits_fp64(l32, x, w, st), Error);
  EXPECT_THROW(moe_router_logits_fp64(logits, x, w2, st), Error);
  EXPECT_THROW(moe_router_logits_fp64_backward(dx, dw, l32, x, w, st), Error);
  // the routing ops take fp32 or fp64 logits, and d_logits / scores of the same dtype
  OwnedTensor probs(DType::kF32, kCpu, {T, 2}), top(DType::kI32, kCpu, {T, 2}), aux32(DType::kF32, kCpu, {T, E});
  MoeRouterOptions o;
  EXPECT_THROW(moe_topk_routing(probs, top, aux32, logits, Tensor(), o, st), Error);
  EXPECT_THROW(moe_topk_routing_backward(l32, probs, logits, top, o, st), Error);
  OwnedTensor li(DType::kI32, kCpu, {T, E});
  EXPECT_THROW(moe_topk_routing(probs, top, Tensor(), li, Tensor(), o, st), Error);
}

// --moe-shared-expert-gate: l = x·w, y += sigmoid(l)·ys per row; the backward (d ys, dx, dw)
// against float64 finite differences of f = Σ dy·(y0 + sigmoid(x·w)·ys) in x and w, d ys exactly.
TEST(MoeSharedGate, ForwardMatchesReferenceBackwardMatchesFiniteDifferences) {
  const Stream& st = testing::cpu_stream();
  const int64_t T = 11, h = 7;
  const auto y0 = testing::randn(T * h), ysv = testing::randn(T * h), xv = testing::randn(T * h),
             wv = testing::randn(h, 0.5f), dyv = testing::randn(T * h), dx0 = testing::randn(T * h),
             dw0 = testing::randn(h);
  auto y = testing::make_tensor(y0, DType::kF32, kCpu, {T, h}, st);
  auto ys = testing::make_tensor(ysv, DType::kF32, kCpu, {T, h}, st);
  auto x = testing::make_tensor(xv, DType::kF32, kCpu, {T, h}, st);
  auto w = testing::make_tensor(wv, DType::kF32, kCpu, {1, h}, st);
  auto dy = testing::make_tensor(dyv, DType::kF32, kCpu, {T, h}, st);
  auto dx = testing::make_tensor(dx0, DType::kF32, kCpu, {T, h}, st);  // accumulated into
  auto dw = testing::make_tensor(dw0, DType::kF32, kCpu, {1, h}, st);
  OwnedTensor l(DType::kF32, kCpu, {T}), dys(DType::kF32, kCpu, {T, h}), dl(DType::kF32, kCpu, {T});
  testing::poison(l, st);
  moe_shared_gate_forward(y, l, ys, x, w, st);
  testing::poison(dys, st);
  testing::poison(dl, st);
  moe_shared_gate_backward(dys, dl, dx, dw, dy, ys, x, w, l, st);
  const auto yv = testing::to_host(y, st), lv = testing::to_host(l, st), dysv = testing::to_host(dys, st),
             dxv = testing::to_host(dx, st), dwv = testing::to_host(dw, st);
  std::vector<double> xd(xv.begin(), xv.end()), wd(wv.begin(), wv.end());
  auto f = [&] {  // Σ_t Σ_i dy·sigmoid(x_t·w)·ys
    double v = 0;
    for (int64_t t = 0; t < T; ++t) {
      double z = 0;
      for (int64_t i = 0; i < h; ++i) z += xd[t * h + i] * wd[i];
      const double g = 1.0 / (1.0 + std::exp(-z));
      for (int64_t i = 0; i < h; ++i) v += dyv[t * h + i] * g * ysv[t * h + i];
    }
    return v;
  };
  for (int64_t t = 0; t < T; ++t) {
    double z = 0;
    for (int64_t i = 0; i < h; ++i) z += static_cast<double>(xv[t * h + i]) * wv[i];
    const double g = 1.0 / (1.0 + std::exp(-z));
    EXPECT_NEAR(lv[t], z, 1e-6 * std::max(1.0, std::fabs(z))) << t;
    for (int64_t i = 0; i < h; ++i) {
      EXPECT_NEAR(yv[t * h + i], y0[t * h + i] + g * ysv[t * h + i], 1e-6) << t << " " << i;
      EXPECT_NEAR(dysv[t * h + i], g * dyv[t * h + i], 1e-6) << t << " " << i;
      const double num = testing::finite_diff(f, xd, static_cast<size_t>(t * h + i), 1e-6);
      EXPECT_NEAR(dxv[t * h + i] - dx0[t * h + i], num, 1e-5 * std::max(1.0, std::fabs(num))) << t << " " << i;
    }
  }
  for (int64_t i = 0; i < h; ++i) {
    const double num = testing::finite_diff(f, wd, static_cast<size_t>(i), 1e-6);
    EXPECT_NEAR(dwv[i] - dw0[i], num, 1e-5 * std::max(1.0, std::fabs(num))) << i;
  }
  OwnedTensor l2(DType::kF32, kCpu, {T, 1}), bad(DType::kF32, kCpu, {T, h + 1}), w2(DType::kF32, kCpu, {h});
  EXPECT_THROW(moe_shared_gate_forward(y, l2, ys, x, w, st), Error);   // logits must be [T]
  EXPECT_THROW(moe_shared_gate_forward(bad, l, ys, x, w, st), Error);  // shapes differ
  EXPECT_THROW(moe_shared_gate_forward(ys, l, ys, x, w, st), Error);   // y aliases ys
  EXPECT_THROW(moe_shared_gate_forward(y, l, ys, x, w2, st), Error);   // w must be [1, h]
  EXPECT_THROW(moe_shared_gate_backward(dys, l2, dx, dw, dy, ys, x, w, l, st), Error);
  EXPECT_THROW(moe_shared_gate_backward_dx(bad, dl, w, st), Error);  // w must be [1, h] of dx's width
  EXPECT_THROW(moe_shared_gate_backward_dx(dx, l2, w, st), Error);   // d_logits must be [T]
}

// --moe-shared-expert-overlap splits the gate's backward: everything but dx (dx empty), then
// moe_shared_gate_backward_dx. The same bits as the whole backward, every output.
TEST(MoeSharedGate, BackwardWithoutDxThenItsDxPartIsBitwiseTheWholeBackward) {
  const Stream& st = testing::cpu_stream();
  const int64_t T = 13, h = 9;
  const auto ysv = testing::randn(T * h), xv = testing::randn(T * h), wv = testing::randn(h, 0.5f),
             dyv = testing::randn(T * h), dx0 = testing::randn(T * h), dw0 = testing::randn(h), lv = testing::randn(T);
  auto run = [&](bool split) {
    auto ys = testing::make_tensor(ysv, DType::kF32, kCpu, {T, h}, st);
    auto x = testing::make_tensor(xv, DType::kF32, kCpu, {T, h}, st);
    auto w = testing::make_tensor(wv, DType::kF32, kCpu, {1, h}, st);
    auto dy = testing::make_tensor(dyv, DType::kF32, kCpu, {T, h}, st);
    auto dx = testing::make_tensor(dx0, DType::kF32, kCpu, {T, h}, st);
    auto dw = testing::make_tensor(dw0, DType::kF32, kCpu, {1, h}, st);
    auto l = testing::make_tensor(lv, DType::kF32, kCpu, {T}, st);
    OwnedTensor dys(DType::kF32, kCpu, {T, h}), dl(DType::kF32, kCpu, {T});
    testing::poison(dys, st);
    testing::poison(dl, st);
    if (split) {
      moe_shared_gate_backward(dys, dl, Tensor(), dw, dy, ys, x, w, l, st);
      EXPECT_EQ(testing::to_host(dx, st), dx0) << "dx written by the backward without dx";
      moe_shared_gate_backward_dx(dx, dl, w, st);
    } else {
      moe_shared_gate_backward(dys, dl, dx, dw, dy, ys, x, w, l, st);
    }
    return std::vector<std::vector<float>>{testing::to_host(dys, st), testing::to_host(dl, st),
                                           testing::to_host(dx, st), testing::to_host(dw, st)};
  };
  const auto whole = run(false), split = run(true);
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_EQ(split[i], whole[i]) << "output " << i;
  EXPECT_NE(whole[2], dx0);  // dx did change
}

TEST(MoeRouting, Errors) {
  const Stream& st = testing::cpu_stream();
  OwnedTensor logits(DType::kF32, kCpu, {4, 6}), probs(DType::kF32, kCpu, {4, 7}), top(DType::kI32, kCpu, {4, 7});
  MoeRouterOptions o;
  o.topk = 7;
  EXPECT_THROW(moe_topk_routing(probs, top, Tensor(), logits, Tensor(), o, st), Error);  // top-k > E
  OwnedTensor p2(DType::kF32, kCpu, {4, 2}), t2(DType::kI32, kCpu, {4, 2});
  o.topk = 2;
  o.num_groups = 4;  // does not divide 6
  o.group_topk = 1;
  EXPECT_THROW(moe_topk_routing(p2, t2, Tensor(), logits, Tensor(), o, st), Error);
  o.num_groups = 0;
  OwnedTensor bias(DType::kF32, kCpu, {6});
  EXPECT_THROW(moe_topk_routing(p2, t2, Tensor(), logits, bias, o, st), Error);  // bias needs sigmoid
  OwnedTensor wrong(DType::kF32, kCpu, {4, 3});
  EXPECT_THROW(moe_topk_routing(wrong, t2, Tensor(), logits, Tensor(), o, st), Error);
}

}  // namespace
}  // namespace mt
