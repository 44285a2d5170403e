// CPU tests of ops/optimizer.h: gradient sum of squares / found-inf / clipping, Megatron's
// DynamicGradScaler state machine, and AdamW against a float64 reference over several steps
// (weight decay, bias correction, clipping, loss-scale unscaling, a skipped overflow step and
// the bf16/fp16 model-parameter copy).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "ops/optimizer.h"
#include "ops/optimizer_test_util.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::make_tensor;
using testing::OwnedTensor;
using testing::ScalarsTensor;
using testing::static_scaler;
using testing::rel_err;
using testing::to_host;

const Device kCpu = Device::cpu();

TEST(OptimizerCpu, InitialScalars) {
  LossScalerConfig cfg;
  cfg.dynamic = true;
  cfg.initial_scale = 4294967296.f;
  cfg.hysteresis = 3;
  const OptimizerScalars s = initial_optimizer_scalars(cfg);
  EXPECT_EQ(s.loss_scale, 4294967296.f);
  EXPECT_EQ(s.hysteresis_tracker, 3);
  EXPECT_EQ(s.clip_coeff, 1.f);
  EXPECT_EQ(s.grad_sumsq, 0.f);
  EXPECT_EQ(s.grad_norm, 0.f);
  EXPECT_EQ(s.found_inf, 0);
  EXPECT_EQ(s.step, 0);
  EXPECT_EQ(s.growth_tracker, 0);
  EXPECT_EQ(s.skipped_iters, 0);
  LossScalerConfig bad;
  bad.initial_scale = 0.f;
  EXPECT_THROW(initial_optimizer_scalars(bad), Error);
}

TEST(OptimizerCpu, GradSumsqPrepareAndClip) {
  Stream s(kCpu);
  ScalarsTensor sc(kCpu);
  const float scale = 8.f;
  sc.write(initial_optimizer_scalars(static_scaler(scale)), s);
  // Two gradient chunks, accumulated one after the other.
  auto g1 = testing::randn(1000, 3.f * scale);
  auto g2 = testing::randn(333, 3.f * scale);
  auto t1 = make_tensor(g1, DType::kF32, kCpu, {1000}, s);
  auto t2 = make_tensor(g2, DType::kF32, kCpu, {333}, s);
  grad_sumsq_accumulate(sc.t, t1, s);
  grad_sumsq_accumulate(sc.t, t2, s);
  double ref = 0;
  for (float g : g1) ref += (g / 8.0) * (g / 8.0);
  for (float g : g2) ref += (g / 8.0) * (g / 8.0);
  OptimizerScalars o = sc.read(s);
  EXPECT_NEAR(o.grad_sumsq, ref, 1e-6 * ref);

  // Clipping active: norm ~ 3 sqrt(1333) ~ 110 > clip_grad = 1.
  optimizer_prepare(sc.t, 1.f, s);
  o = sc.read(s);
  const double norm = std::sqrt(ref);
  EXPECT_NEAR(o.grad_norm, norm, 1e-6 * norm);
  EXPECT_NEAR(o.clip_coeff, 1.0 / (norm + 1e-6), 1e-6 / norm);
  EXPECT_EQ(o.found_inf, 0);
  EXPECT_EQ(o.step, 1);
  // clip_grad = 0 disables clipping; a large clip_grad gives 1.
  optimizer_prepare(sc.t, 0.f, s);
  EXPECT_EQ(sc.read(s).clip_coeff, 1.f);
  EXPECT_EQ(sc.read(s).step, 2);
  optimizer_prepare(sc.t, 1e6f, s);
  EXPECT_EQ(sc.read(s).clip_coeff, 1.f);
  EXPECT_EQ(sc.read(s).step, 3);
  EXPECT_THROW(optimizer_prepare(sc.t, -1.f, s), Error);
}

TEST(OptimizerCpu, NonFiniteGradientsSetFoundInf) {
  Stream s(kCpu);
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    ScalarsTensor sc(kCpu);
    sc.write(initial_optimizer_scalars(static_scaler(1024.f)), s);
    auto g = testing::randn(777, 100.f);
    g[431] = bad;
    auto ok = make_tensor(testing::randn(50), DType::kF32, kCpu, {50}, s);
    auto gt = make_tensor(g, DType::kF32, kCpu, {777}, s);
    grad_sumsq_accumulate(sc.t, ok, s);
    grad_sumsq_accumulate(sc.t, gt, s);
    optimizer_prepare(sc.t, 1.f, s);
    const OptimizerScalars o = sc.read(s);
    EXPECT_EQ(o.found_inf, 1) << bad;
    EXPECT_EQ(o.step, 0) << bad;
    if (std::isnan(bad)) {
      EXPECT_TRUE(std::isnan(o.grad_norm));
    } else {
      EXPECT_EQ(o.grad_norm, INFINITY);  // (+-inf)^2 summed: +inf
    }
    loss_scaler_update(sc.t, static_scaler(1024.f), s);
    const OptimizerScalars u = sc.read(s);
    EXPECT_EQ(u.skipped_iters, 1);
    EXPECT_EQ(u.grad_sumsq, 0.f);
    EXPECT_EQ(u.loss_scale, 1024.f);  // static scaler: unchanged
  }
}

/// Host model of Megatron's DynamicGradScaler.update (written independently of the op).
struct ScalerModel {
  double scale;
  int growth = 0, hyst, skipped = 0, steps = 0;
  void update(const LossScalerConfig& c, bool inf) {
    if (inf) {
      ++skipped;
      growth = 0;
      if (--hyst <= 0) scale = std::max(scale * c.backoff_factor, static_cast<double>(c.min_scale));
    } else {
      ++steps;
      if (++growth == c.growth_interval) {
        growth = 0;
        hyst = c.hysteresis;
        scale *= c.growth_factor;
      }
    }
  }
};

/// One scaler step with a chosen overflow outcome: grad_sumsq set to inf or a finite value.
void scaler_step(const ScalarsTensor& sc, const LossScalerConfig& cfg, bool inf, const Stream& s) {
  OptimizerScalars o = sc.read(s);
  o.grad_sumsq = inf ? INFINITY : 4.f;
  sc.write(o, s);
  optimizer_prepare(sc.t, 1.f, s);
  loss_scaler_update(sc.t, cfg, s);
}

TEST(OptimizerCpu, DynamicLossScalerWorkedSequence) {
  Stream s(kCpu);
  LossScalerConfig cfg;
  cfg.dynamic = true;
  cfg.initial_scale = 1024.f;
  cfg.min_scale = 256.f;
  cfg.growth_interval = 3;
  cfg.hysteresis = 2;
  ScalarsTensor sc(kCpu);
  sc.write(initial_optimizer_scalars(cfg), s);
  struct Expect {
    bool inf;
    float scale;
    int growth, hyst, skipped, step;
  };
  const Expect seq[] = {
      {true, 1024, 0, 1, 1, 0},   // 1st overflow: hysteresis 2 -> 1, scale kept, step skipped
      {false, 1024, 1, 1, 1, 1},  // clean: the overflow count is not reset
      {true, 512, 0, 0, 2, 1},    // 2nd overflow (accumulated): back off
      {true, 256, 0, -1, 3, 1},   // every further overflow backs off
      {true, 256, 0, -2, 4, 1},   // 128 clamped to min_scale 256
      {false, 256, 1, -2, 4, 2},
      {false, 256, 2, -2, 4, 3},
      {false, 512, 0, 2, 4, 4},   // growth_interval clean steps: grow, hysteresis reset
      {true, 512, 0, 1, 5, 4},    // hysteresis again absorbs one overflow
      {false, 512, 1, 1, 5, 5},
      {false, 512, 2, 1, 5, 6},
      {false, 1024, 0, 2, 5, 7},
  };
  int i = 0;
  for (const Expect& e : seq) {
    scaler_step(sc, cfg, e.inf, s);
    const OptimizerScalars o = sc.read(s);
    EXPECT_EQ(o.found_inf, e.inf ? 1 : 0) << "step " << i;
    EXPECT_EQ(o.loss_scale, e.scale) << "step " << i;
    EXPECT_EQ(o.growth_tracker, e.growth) << "step " << i;
    EXPECT_EQ(o.hysteresis_tracker, e.hyst) << "step " << i;
    EXPECT_EQ(o.skipped_iters, e.skipped) << "step " << i;
    EXPECT_EQ(o.step, e.step) << "step " << i;
    EXPECT_EQ(o.grad_sumsq, 0.f) << "step " << i;
    ++i;
  }
}

TEST(OptimizerCpu, DynamicLossScalerRandomSequenceMatchesModel) {
  Stream s(kCpu);
  LossScalerConfig cfg;
  cfg.dynamic = true;
  cfg.initial_scale = 65536.f;
  cfg.min_scale = 2.f;
  cfg.growth_interval = 5;
  cfg.hysteresis = 3;
  ScalarsTensor sc(kCpu);
  sc.write(initial_optimizer_scalars(cfg), s);
  ScalerModel model{65536.0, 0, 3};
  auto u = testing::randu(500, 0.f, 1.f);
  for (int i = 0; i < 500; ++i) {
    const bool inf = u[i] < 0.3f;
    scaler_step(sc, cfg, inf, s);
    model.update(cfg, inf);
    const OptimizerScalars o = sc.read(s);
    ASSERT_EQ(o.loss_scale, model.scale) << "step " << i;
    ASSERT_EQ(o.growth_tracker, model.growth) << "step " << i;
    ASSERT_EQ(o.hysteresis_tracker, model.hyst) << "step " << i;
    ASSERT_EQ(o.skipped_iters, model.skipped) << "step " << i;
    ASSERT_EQ(o.step, model.steps) << "step " << i;
  }
}

TEST(OptimizerCpu, StaticLossScalerCountsSkips) {
  Stream s(kCpu);
  const LossScalerConfig cfg = static_scaler(128.f);
  ScalarsTensor sc(kCpu);
  sc.write(initial_optimizer_scalars(cfg), s);
  const bool seq[] = {true, true, true, false, true, false, false, false};
  int skipped = 0;
  for (bool inf : seq) {
    scaler_step(sc, cfg, inf, s);
    skipped += inf;
    const OptimizerScalars o = sc.read(s);
    EXPECT_EQ(o.loss_scale, 128.f);
    EXPECT_EQ(o.skipped_iters, skipped);
    EXPECT_EQ(o.grad_sumsq, 0.f);
  }
}

/// Float64 AdamW reference state.
struct AdamRef {
  std::vector<double> p, m, v;
  int t = 0;
  /// One step; returns false (and changes nothing) on a non-finite gradient.
  bool step(const std::vector<float>& grad, double loss_scale, double clip_grad, const AdamWHyper& h) {
    double sumsq = 0;
    for (float g : grad) sumsq += (g / loss_scale) * (g / loss_scale);
    if (!std::isfinite(sumsq)) return false;
    const double norm = std::sqrt(sumsq);
    const double clip = clip_grad > 0 ? std::min(1.0, clip_grad / (norm + 1e-6)) : 1.0;
    ++t;
    const double b1 = h.beta1, b2 = h.beta2;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = grad[i] / loss_scale * clip;
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      p[i] -= static_cast<double>(h.lr) * ((m[i] / bc1) / (std::sqrt(v[i] / bc2) + h.eps) + h.weight_decay * p[i]);
    }
    return true;
  }
};

std::vector<uint8_t> bytes_of(const Tensor& t) {
  if (t.empty()) return {};
  std::vector<uint8_t> b(t.nbytes());
  std::memcpy(b.data(), t.data(), b.size());
  return b;
}

void run_adamw_vs_reference(DType model_dtype) {
  Stream s(kCpu);
  const int64_t n = 1001;
  const float loss_scale = 64.f;
  const LossScalerConfig cfg = static_scaler(loss_scale);
  ScalarsTensor sc(kCpu);
  sc.write(initial_optimizer_scalars(cfg), s);
  auto p0 = testing::randn(n);
  auto m0 = testing::randn(n, 0.01f);
  auto v0 = testing::randu(n, 1e-5f, 1e-3f);
  auto p = make_tensor(p0, DType::kF32, kCpu, {n}, s);
  auto m = make_tensor(m0, DType::kF32, kCpu, {n}, s);
  auto v = make_tensor(v0, DType::kF32, kCpu, {n}, s);
  auto grad = make_tensor(std::vector<float>(n, 1.f), DType::kF32, kCpu, {n}, s);
  OwnedTensor model;
  Tensor model_view;
  if (model_dtype != DType::kF32) {
    model = OwnedTensor(model_dtype, kCpu, {n});
    testing::poison(model, s);
    model_view = model.t;
  }
  AdamRef ref{{p0.begin(), p0.end()}, {m0.begin(), m0.end()}, {v0.begin(), v0.end()}};
  for (int k = 1; k <= 7; ++k) {
    AdamWHyper h;
    h.lr = 1e-3f * static_cast<float>(k);
    h.beta1 = 0.9f;
    h.beta2 = 0.95f;
    h.eps = 1e-8f;
    h.weight_decay = 0.1f;
    const float clip_grad = (k % 2 == 1) ? 1.f : 0.f;  // alternate clipping on/off
    // Unscaled grads ~N(0, 0.05^2): norm ~1.6 > clip_grad, so clipping is active when enabled.
    auto g = testing::randn(n, 0.05f * loss_scale);
    const bool overflow = (k == 4);
    if (overflow) g[123] = INFINITY;
    testing::upload(grad, g, s);
    const auto before = std::vector<std::vector<uint8_t>>{bytes_of(p), bytes_of(m), bytes_of(v), bytes_of(model_view)};
    const int step_before = sc.read(s).step;

    grad_sumsq_accumulate(sc.t, grad, s);
    optimizer_prepare(sc.t, clip_grad, s);
    adamw_step(p, grad, m, v, model_view, h, sc.t, s);
    loss_scaler_update(sc.t, cfg, s);

    const bool applied = ref.step(g, loss_scale, clip_grad, h);
    ASSERT_EQ(applied, !overflow);
    const OptimizerScalars o = sc.read(s);
    EXPECT_EQ(o.step, ref.t) << "step " << k;
    if (overflow) {
      // A skipped step leaves every tensor bitwise unchanged.
      EXPECT_EQ(bytes_of(p), before[0]);
      EXPECT_EQ(bytes_of(m), before[1]);
      EXPECT_EQ(bytes_of(v), before[2]);
      EXPECT_EQ(bytes_of(model_view), before[3]);
      EXPECT_EQ(o.step, step_before);
      EXPECT_EQ(o.skipped_iters, 1);
      continue;
    }
    EXPECT_LT(rel_err(to_host(p, s), ref.p), 1e-5) << "step " << k;
    EXPECT_LT(rel_err(to_host(m, s), ref.m), 1e-5) << "step " << k;
    EXPECT_LT(rel_err(to_host(v, s), ref.v), 1e-5) << "step " << k;
    if (model_dtype != DType::kF32) {
      // The model copy is the fp32 main parameter rounded to nearest even.
      auto pm = to_host(p, s);
      auto mm = to_host(model, s);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(mm[i], round_through(model_dtype, pm[i])) << "i=" << i;
    }
  }
}

TEST(OptimizerCpu, AdamWMatchesFloat64ReferenceFp32) { run_adamw_vs_reference(DType::kF32); }
TEST(OptimizerCpu, AdamWMatchesFloat64ReferenceBf16Copy) { run_adamw_vs_reference(DType::kBF16); }
TEST(OptimizerCpu, AdamWMatchesFloat64ReferenceFp16Copy) { run_adamw_vs_reference(DType::kF16); }

// adamw_multi_step over a plan of runs writes exactly what adamw_step writes run by run, and
// nothing outside the runs.
TEST(OptimizerCpu, MultiStepEqualsStepPerRun) {
  Stream s(kCpu);
  for (bool sharded : {false, true}) {
    for (DType md : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(fmt::format("sharded {} model {}", sharded, dtype_name(md)));
      const std::vector<AdamWRun> runs = testing::test_adamw_runs(sharded);
      const AdamWPlan plan(runs, kCpu, s);
      ASSERT_GT(plan.chunks().size(), runs.size());  // some runs span several chunks
      const int64_t param_n = plan.param_end() + 3, main_n = plan.main_end() + 2, state_n = plan.state_end() + 1;
      testing::AdamWBuffers a(kCpu, md, param_n, main_n, state_n, s);
      testing::AdamWBuffers b(a, kCpu, s);
      const testing::AdamWBuffers before(a, kCpu, s);
      ScalarsTensor sc(kCpu);
      sc.write(initial_optimizer_scalars(static_scaler(4.f)), s);
      optimizer_prepare(sc.t, 0.f, s);
      AdamWHyper h;
      h.lr = 1e-3f;
      h.weight_decay = 0.1f;
      adamw_multi_step(a.p, a.g, a.m, a.v, a.model_view(), plan, h, sc.t, s);
      for (const AdamWRun& r : runs) {
        AdamWHyper hr = h;
        hr.weight_decay = r.decay ? h.weight_decay : 0.f;
        adamw_step(b.p->flat_range(r.main, r.n), b.g->flat_range(r.param, r.n), b.m->flat_range(r.state, r.n),
                   b.v->flat_range(r.state, r.n),
                   b.model_view().empty() ? Tensor() : b.model_view().flat_range(r.param, r.n), hr, sc.t, s);
      }
      EXPECT_EQ(bytes_of(a.p), bytes_of(b.p));
      EXPECT_EQ(bytes_of(a.m), bytes_of(b.m));
      EXPECT_EQ(bytes_of(a.v), bytes_of(b.v));
      EXPECT_EQ(bytes_of(a.model_view()), bytes_of(b.model_view()));
      // every run moved; the elements past the runs did not
      const auto p0 = to_host(before.p, s), p1 = to_host(a.p, s);
      for (const AdamWRun& r : runs) EXPECT_NE(p1[r.main + r.n - 1], p0[r.main + r.n - 1]) << "run at " << r.param;
      for (int64_t i = plan.main_end(); i < main_n; ++i) EXPECT_EQ(p1[i], p0[i]);
    }
  }
}

TEST(OptimizerCpu, AdamWPlanRejectsBadRuns) {
  Stream s(kCpu);
  EXPECT_THROW(AdamWPlan({{0, 0, 0, -1, 1, 0}}, kCpu, s), Error);
  EXPECT_THROW(AdamWPlan({{-4, 0, 0, 8, 1, 0}}, kCpu, s), Error);
  EXPECT_THROW(AdamWPlan({{0, 0, 0, 8, 1, 0}, {8, 4, 8, 8, 0, 0}}, kCpu, s), Error);  // main ranges overlap
  const AdamWPlan plan({{0, 0, 0, 8, 1, 0}, {10, 8, 8, 6, 0, 0}}, kCpu, s);
  EXPECT_EQ(plan.param_end(), 16);
  EXPECT_EQ(plan.main_end(), 14);
  ScalarsTensor sc(kCpu);
  sc.write(initial_optimizer_scalars(static_scaler(1.f)), s);
  optimizer_prepare(sc.t, 0.f, s);
  OwnedTensor p(DType::kF32, kCpu, {14}), g(DType::kF32, kCpu, {16}), g_short(DType::kF32, kCpu, {15}),
      m(DType::kF32, kCpu, {14}), v(DType::kF32, kCpu, {14}), bf_short(DType::kBF16, kCpu, {15});
  AdamWHyper h;
  h.lr = 1e-3f;
  EXPECT_THROW(adamw_multi_step(p, g_short, m, v, Tensor(), plan, h, sc.t, s), Error);
  EXPECT_THROW(adamw_multi_step(p, g, m, v, bf_short, plan, h, sc.t, s), Error);
}

TEST(OptimizerCpu, RejectsBadArguments) {
  Stream s(kCpu);
  ScalarsTensor sc(kCpu);
  sc.write(initial_optimizer_scalars(static_scaler(1.f)), s);
  const int64_t n = 16;
  OwnedTensor p(DType::kF32, kCpu, {n}), g(DType::kF32, kCpu, {n}), m(DType::kF32, kCpu, {n}),
      v(DType::kF32, kCpu, {n}), short_v(DType::kF32, kCpu, {n - 1}), f32_model(DType::kF32, kCpu, {n}),
      bf16_grad(DType::kBF16, kCpu, {n}), bf16_short(DType::kBF16, kCpu, {n + 1});
  OwnedTensor small_scalars(DType::kU8, kCpu, {8}), f32_scalars(DType::kF32, kCpu, {static_cast<int64_t>(sizeof(OptimizerScalars) / 4)});
  AdamWHyper h;
  h.lr = 1e-3f;
  EXPECT_THROW(grad_sumsq_accumulate(small_scalars, g, s), Error);
  EXPECT_THROW(grad_sumsq_accumulate(f32_scalars, g, s), Error);
  EXPECT_THROW(grad_sumsq_accumulate(sc.t, bf16_grad, s), Error);
  EXPECT_THROW(optimizer_prepare(small_scalars, 1.f, s), Error);
  EXPECT_THROW(loss_scaler_update(small_scalars, LossScalerConfig{}, s), Error);
  // step = 0: adamw_step before optimizer_prepare.
  EXPECT_THROW(adamw_step(p, g, m, v, Tensor(), h, sc.t, s), Error);
  optimizer_prepare(sc.t, 0.f, s);
  EXPECT_NO_THROW(adamw_step(p, g, m, v, Tensor(), h, sc.t, s));
  EXPECT_THROW(adamw_step(p, g, short_v, v, Tensor(), h, sc.t, s), Error);
  EXPECT_THROW(adamw_step(p, bf16_grad, m, v, Tensor(), h, sc.t, s), Error);
  EXPECT_THROW(adamw_step(p, g, m, v, f32_model, h, sc.t, s), Error);
  EXPECT_THROW(adamw_step(p, g, m, v, bf16_short, h, sc.t, s), Error);
  AdamWHyper bad = h;
  bad.beta2 = 1.f;
  EXPECT_THROW(adamw_step(p, g, m, v, Tensor(), bad, sc.t, s), Error);
  LossScalerConfig bad_cfg;
  bad_cfg.dynamic = true;
  bad_cfg.growth_interval = 0;
  EXPECT_THROW(loss_scaler_update(sc.t, bad_cfg, s), Error);
}

}  // namespace
}  // namespace mt
