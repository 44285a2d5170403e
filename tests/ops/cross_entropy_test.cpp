// CPU tests of ops/cross_entropy.h against float64 references: forward (log-softmax), backward
// (central finite differences of the float64 loss), the vocab-parallel composition with emulated
// all-reduces, sum_accumulate, and argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/cross_entropy.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::make_int_tensor;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::poison;
using testing::rel_err;
using testing::to_host;

const Device kCpu = Device::cpu();

/// Float64 per-row loss: logsumexp(x_r) - x_r[t_r] (t_r in [0, V)).
std::vector<double> ref_losses(const std::vector<double>& x, const std::vector<int32_t>& t, int64_t m, int64_t v) {
  std::vector<double> out(m);
  for (int64_t r = 0; r < m; ++r) {
    const double* row = x.data() + r * v;
    const double mx = *std::max_element(row, row + v);
    double se = 0;
    for (int64_t j = 0; j < v; ++j) se += std::exp(row[j] - mx);
    out[r] = std::log(se) + mx - row[t[r]];
  }
  return out;
}

/// Float64 objective of the backward: sum_r grad_scale * mask_r * loss_r.
double ref_objective(const std::vector<double>& x, const std::vector<int32_t>& t, const std::vector<float>& mask,
                     int64_t m, int64_t v, double grad_scale) {
  auto l = ref_losses(x, t, m, v);
  double s = 0;
  for (int64_t r = 0; r < m; ++r) s += grad_scale * mask[r] * l[r];
  return s;
}

/// Float64 analytic gradient of ref_objective.
std::vector<double> ref_grad(const std::vector<double>& x, const std::vector<int32_t>& t,
                             const std::vector<float>& mask, int64_t m, int64_t v, double grad_scale) {
  std::vector<double> g(m * v);
  for (int64_t r = 0; r < m; ++r) {
    const double* row = x.data() + r * v;
    const double mx = *std::max_element(row, row + v);
    double se = 0;
    for (int64_t j = 0; j < v; ++j) se += std::exp(row[j] - mx);
    for (int64_t j = 0; j < v; ++j)
      g[r * v + j] = grad_scale * mask[r] * (std::exp(row[j] - mx) / se - (j == t[r] ? 1.0 : 0.0));
  }
  return g;
}

std::vector<double> to_double(const std::vector<float>& a) { return {a.begin(), a.end()}; }

/// Mask with exact zeros (every 4th row) and positive weights elsewhere.
std::vector<float> make_mask(int64_t m) {
  auto w = testing::randu(m, 0.5f, 1.5f);
  for (int64_t r = 0; r < m; r += 4) w[r] = 0.f;
  return w;
}

struct CeOutputs {
  std::vector<float> row_max, row_sumexp, target_logit, losses, grads;
};

/// Runs stats -> loss -> backward_inplace on CPU for fp32 logits (host values).
CeOutputs run_cpu(const std::vector<float>& x, const std::vector<int32_t>& t, const std::vector<float>* mask,
                  int64_t m, int64_t v, int64_t vocab_start, float grad_scale) {
  Stream s(kCpu);
  auto logits = make_tensor(x, DType::kF32, kCpu, {m, v}, s);
  auto targets = make_int_tensor(t, kCpu, {m}, s);
  OwnedTensor mx(DType::kF32, kCpu, {m}), se(DType::kF32, kCpu, {m}), tl(DType::kF32, kCpu, {m});
  OwnedTensor loss(DType::kF32, kCpu, {m});
  OwnedTensor mask_t;
  Tensor mask_view;
  if (mask) {
    mask_t = make_tensor(*mask, DType::kF32, kCpu, {m}, s);
    mask_view = mask_t.t;
  }
  for (const Tensor* o : {&mx.t, &se.t, &tl.t, &loss.t}) poison(*o, s);
  cross_entropy_stats(mx, se, tl, logits, targets, vocab_start, -1, s);
  cross_entropy_loss(loss, mx, se, tl, mask_view, s);
  // Half of the scale from the host argument, the other factor from a device scalar (as the
  // dynamic loss scale is passed); a power of two, so the product is exact.
  auto dev_scale = make_tensor({4.f}, DType::kF32, kCpu, {1}, s);
  cross_entropy_backward_inplace(logits, targets, mx, se, mask_view, vocab_start, -1, grad_scale / 4, dev_scale, s);
  return {to_host(mx, s), to_host(se, s), to_host(tl, s), to_host(loss, s), to_host(logits, s)};
}

TEST(CrossEntropyCpu, ForwardMatchesFloat64LogSoftmax) {
  const int64_t m = 37, v = 101;
  auto x = testing::randn(m * v, 3.f);
  auto t = testing::randint(m, 0, static_cast<int32_t>(v));
  auto mask = make_mask(m);
  auto out = run_cpu(x, t, &mask, m, v, 0, 1.f);
  auto xd = to_double(x);
  auto ref = ref_losses(xd, t, m, v);
  std::vector<double> ref_masked(m), ref_se(m);
  for (int64_t r = 0; r < m; ++r) {
    const float mx = *std::max_element(x.begin() + r * v, x.begin() + (r + 1) * v);
    EXPECT_EQ(out.row_max[r], mx) << "row " << r;
    EXPECT_EQ(out.target_logit[r], x[r * v + t[r]]) << "row " << r;
    double se = 0;
    for (int64_t j = 0; j < v; ++j) se += std::exp(xd[r * v + j] - mx);
    ref_se[r] = se;
    ref_masked[r] = ref[r] * mask[r];
    if (mask[r] == 0.f) EXPECT_EQ(out.losses[r], 0.f);
  }
  EXPECT_LT(rel_err(out.row_sumexp, ref_se), 1e-5);
  EXPECT_LT(rel_err(out.losses, ref_masked), 1e-5);

  // Without a mask: the plain per-row losses.
  auto out2 = run_cpu(x, t, nullptr, m, v, 0, 1.f);
  EXPECT_LT(rel_err(out2.losses, ref), 1e-5);
}

TEST(CrossEntropyCpu, StableForLargeLogits) {
  // A common offset of 1000 must not overflow exp; compare to float64 on the same fp32 inputs.
  const int64_t m = 6, v = 64;
  auto x = testing::randn(m * v, 2.f);
  for (auto& e : x) e += 1000.f;
  auto t = testing::randint(m, 0, static_cast<int32_t>(v));
  auto out = run_cpu(x, t, nullptr, m, v, 0, 1.f);
  ASSERT_TRUE(testing::all_finite(out.losses));
  ASSERT_TRUE(testing::all_finite(out.grads));
  // log(sumexp) + max - target: the sum of two ~1000 terms rounds at ~6e-5 absolute in fp32.
  auto ref = ref_losses(to_double(x), t, m, v);
  for (int64_t r = 0; r < m; ++r) EXPECT_NEAR(out.losses[r], ref[r], 2e-4) << "row " << r;
}

TEST(CrossEntropyCpu, BackwardMatchesFiniteDifferences) {
  const int64_t m = 6, v = 13;
  const float grad_scale = 0.37f;
  auto x = testing::randn(m * v, 2.f);
  auto t = testing::randint(m, 0, static_cast<int32_t>(v));
  auto mask = make_mask(m);  // rows 0 and 4 masked out
  auto out = run_cpu(x, t, &mask, m, v, 0, grad_scale);
  std::vector<double> xd = to_double(x);
  std::vector<double> fd(m * v);
  auto f = [&] { return ref_objective(xd, t, mask, m, v, grad_scale); };
  for (int64_t i = 0; i < m * v; ++i) fd[i] = testing::finite_diff(f, xd, static_cast<size_t>(i), 1e-5);
  // Central differences in float64 with eps 1e-5: truncation ~1e-10, rounding ~1e-11; the op
  // computes in fp32 (~1e-7 relative), so 1e-5 leaves a wide margin.
  EXPECT_LT(rel_err(out.grads, fd), 1e-5);
  for (int64_t r = 0; r < m; ++r) {
    if (mask[r] != 0.f) continue;
    for (int64_t j = 0; j < v; ++j) EXPECT_EQ(out.grads[r * v + j], 0.f) << "masked row " << r;
  }
}

TEST(CrossEntropyCpu, BackwardMatchesAnalyticFloat64) {
  const int64_t m = 64, v = 1000;
  const float grad_scale = 1.f / 64;
  auto x = testing::randn(m * v, 3.f);
  auto t = testing::randint(m, 0, static_cast<int32_t>(v));
  auto mask = make_mask(m);
  auto out = run_cpu(x, t, &mask, m, v, 0, grad_scale);
  EXPECT_LT(rel_err(out.grads, ref_grad(to_double(x), t, mask, m, v, grad_scale)), 1e-5);
}

TEST(CrossEntropyCpu, VocabParallelCompositionEqualsUnsplit) {
  // V = 50 split over 3 "ranks" as [0, 17), [17, 34), [34, 50); the all-reduces (MAX of the row
  // max, SUM of the rescaled exp-sums and of the target logits) are emulated on the host.
  const int64_t m = 11, v = 50;
  const std::vector<int64_t> bounds = {0, 17, 34, 50};
  const int shards = 3;
  const float grad_scale = 0.25f;
  auto x = testing::randn(m * v, 3.f);
  auto t = testing::randint(m, 0, static_cast<int32_t>(v));
  t[0] = 0;   // first element of shard 0
  t[1] = 16;  // last of shard 0
  t[2] = 17;  // first of shard 1
  t[3] = 49;  // last of shard 2
  auto mask = make_mask(m);
  auto full = run_cpu(x, t, &mask, m, v, 0, grad_scale);

  Stream s(kCpu);
  auto targets = make_int_tensor(t, kCpu, {m}, s);
  auto mask_t = make_tensor(mask, DType::kF32, kCpu, {m}, s);
  std::vector<OwnedTensor> logits(shards), lmax(shards), sumexp(shards), tlog(shards);
  std::vector<float> gmax(m, -INFINITY), gsum(m, 0.f), gtl(m, 0.f);
  for (int k = 0; k < shards; ++k) {
    const int64_t a = bounds[k], w = bounds[k + 1] - bounds[k];
    std::vector<float> xs(m * w);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < w; ++j) xs[r * w + j] = x[r * v + a + j];
    logits[k] = make_tensor(xs, DType::kF32, kCpu, {m, w}, s);
    lmax[k] = OwnedTensor(DType::kF32, kCpu, {m});
    sumexp[k] = OwnedTensor(DType::kF32, kCpu, {m});
    tlog[k] = OwnedTensor(DType::kF32, kCpu, {m});
    for (const Tensor* o : {&lmax[k].t, &sumexp[k].t, &tlog[k].t}) poison(*o, s);
    cross_entropy_stats(lmax[k], sumexp[k], tlog[k], logits[k], targets, a, -1, s);
    auto lm = to_host(lmax[k], s);
    auto tl = to_host(tlog[k], s);
    for (int64_t r = 0; r < m; ++r) {
      gmax[r] = std::max(gmax[r], lm[r]);  // all-reduce MAX
      const bool mine = t[r] >= a && t[r] < a + w;
      if (!mine) EXPECT_EQ(tl[r], 0.f) << "shard " << k << " row " << r;
    }
  }
  auto gmax_t = make_tensor(gmax, DType::kF32, kCpu, {m}, s);
  for (int k = 0; k < shards; ++k) {
    cross_entropy_rescale_sumexp(sumexp[k], lmax[k], gmax_t, s);
    auto se = to_host(sumexp[k], s);
    auto tl = to_host(tlog[k], s);
    for (int64_t r = 0; r < m; ++r) {
      gsum[r] += se[r];  // all-reduce SUM
      gtl[r] += tl[r];   // all-reduce SUM
    }
  }
  auto gsum_t = make_tensor(gsum, DType::kF32, kCpu, {m}, s);
  auto gtl_t = make_tensor(gtl, DType::kF32, kCpu, {m}, s);
  EXPECT_EQ(gmax, full.row_max);
  EXPECT_EQ(gtl, full.target_logit);
  EXPECT_LT(rel_err(gsum, full.row_sumexp), 1e-6);

  std::vector<float> grads(m * v, NAN);
  for (int k = 0; k < shards; ++k) {
    OwnedTensor loss(DType::kF32, kCpu, {m});
    poison(loss, s);
    cross_entropy_loss(loss, gmax_t, gsum_t, gtl_t, mask_t, s);
    EXPECT_LT(rel_err(to_host(loss, s), full.losses), 1e-6) << "shard " << k;
    cross_entropy_backward_inplace(logits[k], targets, gmax_t, gsum_t, mask_t, bounds[k], -1, grad_scale, Tensor(), s);
    auto g = to_host(logits[k], s);
    const int64_t a = bounds[k], w = bounds[k + 1] - bounds[k];
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < w; ++j) grads[r * v + a + j] = g[r * w + j];
  }
  EXPECT_LT(rel_err(grads, full.grads), 1e-6);
  EXPECT_LT(rel_err(grads, ref_grad(to_double(x), t, mask, m, v, grad_scale)), 1e-5);
}

TEST(CrossEntropyCpu, HalfPrecisionLogits) {
  // The CPU backend also accepts bf16/fp16 logits: statistics in fp32 from the rounded values,
  // gradient rounded to the logits dtype.
  const int64_t m = 9, v = 77;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    auto x = testing::randn(m * v, 2.f);
    for (auto& e : x) e = round_through(dt, e);
    auto t = testing::randint(m, 0, static_cast<int32_t>(v));
    auto ref = run_cpu(x, t, nullptr, m, v, 0, 0.5f);
    Stream s(kCpu);
    auto logits = make_tensor(x, dt, kCpu, {m, v}, s);
    auto targets = make_int_tensor(t, kCpu, {m}, s);
    OwnedTensor mx(DType::kF32, kCpu, {m}), se(DType::kF32, kCpu, {m}), tl(DType::kF32, kCpu, {m});
    for (const Tensor* o : {&mx.t, &se.t, &tl.t}) poison(*o, s);
    cross_entropy_stats(mx, se, tl, logits, targets, 0, -1, s);
    EXPECT_EQ(to_host(mx, s), ref.row_max);
    EXPECT_EQ(to_host(tl, s), ref.target_logit);
    EXPECT_LT(rel_err(to_host(se, s), ref.row_sumexp), 1e-6);
    cross_entropy_backward_inplace(logits, targets, mx, se, Tensor(), 0, -1, 0.5f, Tensor(), s);
    EXPECT_LT(rel_err(to_host(logits, s), ref.grads), dt == DType::kBF16 ? 1e-2 : 2e-3) << dtype_name(dt);
  }
}

TEST(CrossEntropyCpu, SumAccumulate) {
  Stream s(kCpu);
  for (int64_t n : {1, 1000, 12345}) {
    auto x = testing::randn(n, 2.f);
    const float init = testing::randn(1)[0];
    const float alpha = 0.37f;
    auto out = make_tensor({init}, DType::kF32, kCpu, {1}, s);
    auto xt = make_tensor(x, DType::kF32, kCpu, {n}, s);
    sum_accumulate(out, xt, alpha, s);
    double ref = 0;
    for (float e : x) ref += e;
    ref = init + alpha * ref;
    const float got = to_host(out, s)[0];
    EXPECT_NEAR(got, ref, 1e-6 * (std::fabs(ref) + std::sqrt(static_cast<double>(n)))) << "n=" << n;
    // Deterministic: the same inputs give the same bits.
    auto out2 = make_tensor({init}, DType::kF32, kCpu, {1}, s);
    sum_accumulate(out2, xt, alpha, s);
    EXPECT_EQ(to_host(out2, s)[0], got);
  }
}

TEST(CrossEntropyCpu, RejectsBadArguments) {
  Stream s(kCpu);
  const int64_t m = 4, v = 10;
  auto logits = make_tensor(testing::randn(m * v), DType::kF32, kCpu, {m, v}, s);
  auto targets = make_int_tensor(testing::randint(m, 0, 10), kCpu, {m}, s);
  OwnedTensor mx(DType::kF32, kCpu, {m}), se(DType::kF32, kCpu, {m}), tl(DType::kF32, kCpu, {m});
  OwnedTensor short_vec(DType::kF32, kCpu, {m - 1}), ftargets(DType::kF32, kCpu, {m});
  OwnedTensor i32_stats(DType::kI32, kCpu, {m}), flat(DType::kF32, kCpu, {m * v});
  OwnedTensor empty_vocab(DType::kF32, kCpu, {m, 0}), out2(DType::kF32, kCpu, {2});
  EXPECT_THROW(cross_entropy_stats(short_vec, se, tl, logits, targets, 0, -1, s), Error);
  EXPECT_THROW(cross_entropy_stats(mx, se, tl, logits, ftargets, 0, -1, s), Error);
  EXPECT_THROW(cross_entropy_stats(mx, i32_stats, tl, logits, targets, 0, -1, s), Error);
  EXPECT_THROW(cross_entropy_stats(mx, se, tl, flat, targets, 0, -1, s), Error);
  EXPECT_THROW(cross_entropy_stats(mx, se, tl, empty_vocab, targets, 0, -1, s), Error);
  EXPECT_THROW(cross_entropy_stats(mx, se, tl, logits, targets, -1, -1, s), Error);
  EXPECT_THROW(cross_entropy_stats(mx, se, tl, targets, targets, 0, -1, s), Error);
  EXPECT_THROW(cross_entropy_rescale_sumexp(se, short_vec, mx, s), Error);
  EXPECT_THROW(cross_entropy_loss(tl, mx, se, tl, short_vec, s), Error);
  EXPECT_THROW(cross_entropy_loss(short_vec, mx, se, tl, Tensor(), s), Error);
  EXPECT_THROW(cross_entropy_backward_inplace(logits, targets, mx, short_vec, Tensor(), 0, -1, 1.f, Tensor(), s), Error);
  EXPECT_THROW(cross_entropy_backward_inplace(logits, targets, mx, se, i32_stats, 0, -1, 1.f, Tensor(), s), Error);
  EXPECT_THROW(sum_accumulate(out2, mx, 1.f, s), Error);
  EXPECT_THROW(sum_accumulate(mx.t.slice0(0, 1), i32_stats, 1.f, s), Error);
  EXPECT_THROW(cross_entropy_forward_backward_inplace(mx, short_vec, tl, logits, targets, Tensor(), -1, 1.f, Tensor(), s),
               Error);
  EXPECT_THROW(cross_entropy_forward_backward_inplace(mx, se, tl, logits, targets, Tensor(), v + 1, 1.f, Tensor(), s),
               Error);
  EXPECT_THROW(cross_entropy_forward_backward_inplace(mx, se, tl, logits, targets, short_vec, -1, 1.f, Tensor(), s),
               Error);
}

TEST(CrossEntropyCpu, ForwardBackwardInplaceEqualsStatsThenBackward) {
  // The one-pass op's contract: exactly cross_entropy_stats followed by backward_inplace.
  Stream s(kCpu);
  const int64_t m = 6, v = 40, valid = 37;
  const auto x = testing::randn(m * v, 2.f);
  const auto t = testing::randint(m, 0, static_cast<int32_t>(valid));
  const auto mask = testing::randu(m, 0.5f, 1.5f);
  std::vector<std::vector<float>> out[2];
  for (int fused = 0; fused < 2; ++fused) {
    auto logits = make_tensor(x, DType::kBF16, kCpu, {m, v}, s);
    auto targets = make_int_tensor(t, kCpu, {m}, s);
    auto mask_t = make_tensor(mask, DType::kF32, kCpu, {m}, s);
    OwnedTensor mx(DType::kF32, kCpu, {m}), se(DType::kF32, kCpu, {m}), tl(DType::kF32, kCpu, {m});
    if (fused) {
      cross_entropy_forward_backward_inplace(mx, se, tl, logits, targets, mask_t, valid, 0.5f, Tensor(), s);
    } else {
      cross_entropy_stats(mx, se, tl, logits, targets, 0, valid, s);
      cross_entropy_backward_inplace(logits, targets, mx, se, mask_t, 0, valid, 0.5f, Tensor(), s);
    }
    out[fused] = {to_host(mx, s), to_host(se, s), to_host(tl, s), to_host(logits, s)};
  }
  EXPECT_EQ(out[1], out[0]);
  EXPECT_NE(out[1][3], std::vector<float>(m * v, 0.f));
}

}  // namespace
}  // namespace mt
