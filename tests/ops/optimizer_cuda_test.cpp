// CUDA vs CPU tests of ops/optimizer.h: the gradient sum of squares (fp32 1e-5, deterministic
// bitwise, found-inf on inf/nan), optimizer_prepare + loss_scaler_update bitwise identical to
// the CPU on a random overflow sequence, and AdamW (fp32 1e-5; the bf16/fp16 model copy equal
// to the rounded main parameter; a skipped step writes nothing), and the fp32 main parameters as
// (bf16, int16 remainder) pairs (--use-precision-aware-optimizer) bitwise equal to the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
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
const Device kGpu = Device::cuda();

/// grad_sumsq after accumulating `chunks` (host values) on `dev` with the given loss scale.
float sumsq_on(Device dev, const std::vector<std::vector<float>>& chunks, float loss_scale, int offset = 0) {
  Stream s(dev);
  ScalarsTensor sc(dev);
  sc.write(initial_optimizer_scalars(static_scaler(loss_scale)), s);
  std::vector<OwnedTensor> bufs;
  for (const auto& c : chunks) {
    // Optionally place the chunk at an element offset (unaligned for the vector path).
    std::vector<float> padded(offset, 0.f);
    padded.insert(padded.end(), c.begin(), c.end());
    bufs.push_back(make_tensor(padded, DType::kF32, dev, {static_cast<int64_t>(padded.size())}, s));
    grad_sumsq_accumulate(sc.t, bufs.back().t.flat_range(offset, static_cast<int64_t>(c.size())), s);
  }
  return sc.read(s).grad_sumsq;
}

TEST(OptimizerCuda, GradSumsqMatchesCpuAndIsDeterministic) {
  MT_REQUIRE_CUDA();
  const float scale = 1024.f;
  for (int64_t n : {1, 1000, 4097, (1 << 20) + 3}) {
    for (int offset : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " offset=" << offset);
      std::vector<std::vector<float>> chunks = {testing::randn(n, scale), testing::randn(n / 3 + 1, 0.1f * scale)};
      const float cpu = sumsq_on(kCpu, chunks, scale, offset);
      const float gpu1 = sumsq_on(kGpu, chunks, scale, offset);
      const float gpu2 = sumsq_on(kGpu, chunks, scale, offset);
      EXPECT_EQ(gpu1, gpu2);
      EXPECT_LT(std::fabs(gpu1 - cpu), 1e-5 * cpu);
    }
  }
}

TEST(OptimizerCuda, NonFiniteGradientsSetFoundInf) {
  MT_REQUIRE_CUDA();
  Stream s(kGpu);
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    for (int64_t where : {0, 5000, 99999}) {
      ScalarsTensor sc(kGpu);
      sc.write(initial_optimizer_scalars(static_scaler(1.f)), s);
      auto g = testing::randn(100000);
      g[where] = bad;
      auto gt = make_tensor(g, DType::kF32, kGpu, {100000}, s);
      grad_sumsq_accumulate(sc.t, gt, s);
      optimizer_prepare(sc.t, 1.f, s);
      const OptimizerScalars o = sc.read(s);
      EXPECT_EQ(o.found_inf, 1) << bad << " at " << where;
      EXPECT_EQ(o.step, 0);
      loss_scaler_update(sc.t, static_scaler(1.f), s);
      EXPECT_EQ(sc.read(s).skipped_iters, 1);
      EXPECT_EQ(sc.read(s).grad_sumsq, 0.f);
    }
  }
}

TEST(OptimizerCuda, ScalerStateMachineBitwiseEqualToCpu) {
  MT_REQUIRE_CUDA();
  LossScalerConfig cfg;
  cfg.dynamic = true;
  cfg.initial_scale = 4294967296.f;
  cfg.min_scale = 1.f;
  cfg.growth_interval = 4;
  cfg.hysteresis = 3;
  Stream cs(kCpu), gs(kGpu);
  ScalarsTensor c(kCpu), g(kGpu);
  c.write(initial_optimizer_scalars(cfg), cs);
  g.write(initial_optimizer_scalars(cfg), gs);
  auto u = testing::randu(400, 0.f, 1.f);
  auto sumsq = testing::randu(400, 0.01f, 100.f);
  for (int i = 0; i < 400; ++i) {
    // Phases with mostly overflows (scale falls to the clamp) and mostly clean steps (growth).
    const float p_inf = (i / 100) % 2 == 0 ? 0.7f : 0.15f;
    const float value = u[i] < p_inf ? (u[i] < p_inf / 2 ? INFINITY : NAN) : sumsq[i];
    const float clip = (i % 3 == 0) ? 0.f : 1.f;
    for (auto [sc, s] : {std::pair{&c, &cs}, std::pair{&g, &gs}}) {
      OptimizerScalars o = sc->read(*s);
      o.grad_sumsq = value;
      sc->write(o, *s);
      optimizer_prepare(sc->t, clip, *s);
      loss_scaler_update(sc->t, cfg, *s);
    }
    const OptimizerScalars a = c.read(cs), b = g.read(gs);
    ASSERT_EQ(std::memcmp(&a, &b, sizeof(a)), 0)
        << "step " << i << ": cpu scale " << a.loss_scale << " gpu " << b.loss_scale << ", norm " << a.grad_norm
        << " vs " << b.grad_norm << ", clip " << a.clip_coeff << " vs " << b.clip_coeff << ", skipped "
        << a.skipped_iters << " vs " << b.skipped_iters;
  }
  const OptimizerScalars a = c.read(cs);
  EXPECT_GT(a.skipped_iters, 0);
  EXPECT_GT(a.step, 0);
}

std::vector<uint8_t> device_bytes(const Tensor& t, const Stream& s) {
  if (t.empty()) return {};
  std::vector<uint8_t> b(t.nbytes());
  copy_bytes(b.data(), kCpu, t.data(), t.device(), b.size(), s);
  s.synchronize();
  return b;
}

struct AdamState {
  OwnedTensor p, m, v, grad, model;
  Tensor model_view;
  ScalarsTensor sc;
  AdamState(Device d, DType model_dtype, const std::vector<float>& p0, const std::vector<float>& m0,
            const std::vector<float>& v0, const LossScalerConfig& cfg, const Stream& s)
      : sc(d) {
    const int64_t n = static_cast<int64_t>(p0.size());
    p = make_tensor(p0, DType::kF32, d, {n}, s);
    m = make_tensor(m0, DType::kF32, d, {n}, s);
    v = make_tensor(v0, DType::kF32, d, {n}, s);
    grad = OwnedTensor(DType::kF32, d, {n});
    if (model_dtype != DType::kF32) {
      model = OwnedTensor(model_dtype, d, {n});
      testing::poison(model, s);
      model_view = model.t;
    }
    sc.write(initial_optimizer_scalars(cfg), s);
  }
  void step(const std::vector<float>& g, const AdamWHyper& h, float clip, const LossScalerConfig& cfg,
            const Stream& s) {
    testing::upload(grad, g, s);
    grad_sumsq_accumulate(sc.t, grad, s);
    optimizer_prepare(sc.t, clip, s);
    adamw_step(p, grad, m, v, model_view, h, sc.t, s);
    loss_scaler_update(sc.t, cfg, s);
  }
};

TEST(OptimizerCuda, AdamWMatchesCpu) {
  MT_REQUIRE_CUDA();
  const int64_t n = 100003;
  const float loss_scale = 32.f;
  const LossScalerConfig cfg = static_scaler(loss_scale);
  for (DType md : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(md));
    Stream cs(kCpu), gs(kGpu);
    auto p0 = testing::randn(n);
    auto m0 = testing::randn(n, 0.01f);
    auto v0 = testing::randu(n, 1e-5f, 1e-3f);
    AdamState cpu(kCpu, md, p0, m0, v0, cfg, cs);
    AdamState gpu(kGpu, md, p0, m0, v0, cfg, gs);
    for (int k = 1; k <= 4; ++k) {
      AdamWHyper h;
      h.lr = 2e-3f;
      h.beta1 = 0.9f;
      h.beta2 = 0.95f;
      h.weight_decay = 0.1f;
      auto g = testing::randn(n, 0.01f * loss_scale);  // unscaled norm ~3 > clip 1
      const bool overflow = (k == 3);
      if (overflow) g[n / 2] = NAN;
      const auto before = std::vector<std::vector<uint8_t>>{device_bytes(gpu.p, gs), device_bytes(gpu.m, gs),
                                                            device_bytes(gpu.v, gs), device_bytes(gpu.model_view, gs)};
      cpu.step(g, h, 1.f, cfg, cs);
      gpu.step(g, h, 1.f, cfg, gs);
      const OptimizerScalars sg = gpu.sc.read(gs), sc = cpu.sc.read(cs);
      EXPECT_EQ(sg.found_inf, overflow ? 1 : 0);
      EXPECT_EQ(sg.step, sc.step);
      EXPECT_EQ(sg.skipped_iters, sc.skipped_iters);
      if (overflow) {
        EXPECT_EQ(device_bytes(gpu.p, gs), before[0]);
        EXPECT_EQ(device_bytes(gpu.m, gs), before[1]);
        EXPECT_EQ(device_bytes(gpu.v, gs), before[2]);
        EXPECT_EQ(device_bytes(gpu.model_view, gs), before[3]);
        continue;
      }
      EXPECT_LT(std::fabs(sg.grad_norm - sc.grad_norm), 1e-5 * sc.grad_norm);
      EXPECT_LT(rel_err(to_host(gpu.p, gs), to_host(cpu.p, cs)), 1e-5) << "step " << k;
      EXPECT_LT(rel_err(to_host(gpu.m, gs), to_host(cpu.m, cs)), 1e-5) << "step " << k;
      EXPECT_LT(rel_err(to_host(gpu.v, gs), to_host(cpu.v, cs)), 1e-5) << "step " << k;
      if (md != DType::kF32) {
        auto pm = to_host(gpu.p, gs);
        auto mm = to_host(gpu.model, gs);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(mm[i], round_through(md, pm[i])) << "i=" << i;
        EXPECT_LT(rel_err(mm, to_host(cpu.model, cs)), md == DType::kBF16 ? 2e-2 : 2e-3);
      }
    }
  }
}

// The kernel moves four elements per access when every array is aligned, one otherwise: both
// paths compute each element alike, so a run starting one element in (unaligned) updates its
// elements to the same bits as the aligned run over the whole buffer.
TEST(OptimizerCuda, AlignedAndUnalignedRunsAgreeBitwise) {
  MT_REQUIRE_CUDA();
  const int64_t n = 4099;
  const LossScalerConfig cfg = static_scaler(8.f);
  for (DType md : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(md));
    Stream gs(kGpu);
    auto p0 = testing::randn(n), m0 = testing::randn(n, 0.01f), v0 = testing::randu(n, 1e-5f, 1e-3f);
    AdamState a(kGpu, md, p0, m0, v0, cfg, gs), b(kGpu, md, p0, m0, v0, cfg, gs);
    AdamWHyper h;
    h.lr = 1e-3f;
    h.weight_decay = 0.1f;
    const auto g = testing::randn(n, 0.1f);
    a.step(g, h, 1.f, cfg, gs);
    testing::upload(b.grad, g, gs);
    grad_sumsq_accumulate(b.sc.t, b.grad, gs);  // same norm and clip as a
    optimizer_prepare(b.sc.t, 1.f, gs);
    auto tail = [n](const Tensor& t) { return t.empty() ? Tensor() : t.flat_range(1, n - 1); };
    adamw_step(tail(b.p), tail(b.grad), tail(b.m), tail(b.v), tail(b.model_view), h, b.sc.t, gs);
    for (auto [x, y] : {std::pair{&a.p, &b.p}, std::pair{&a.m, &b.m}, std::pair{&a.v, &b.v}}) {
      auto ba = device_bytes(x->t, gs), bb = device_bytes(y->t, gs);
      EXPECT_TRUE(std::equal(ba.begin() + 4, ba.end(), bb.begin() + 4));
    }
    if (md != DType::kF32) {
      auto ba = device_bytes(a.model_view, gs), bb = device_bytes(b.model_view, gs);
      EXPECT_TRUE(std::equal(ba.begin() + 2, ba.end(), bb.begin() + 2));
    }
  }
}

// The multi-tensor launch writes, on the device, exactly what adamw_step writes run by run, and
// agrees with the CPU backend's multi-tensor step.
TEST(OptimizerCuda, MultiStepEqualsStepPerRunAndCpu) {
  MT_REQUIRE_CUDA();
  Stream cs(kCpu), gs(kGpu);
  for (bool sharded : {false, true}) {
    for (DType md : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(fmt::format("sharded {} model {}", sharded, dtype_name(md)));
      const std::vector<AdamWRun> runs = testing::test_adamw_runs(sharded);
      const AdamWPlan gplan(runs, kGpu, gs), cplan(runs, kCpu, cs);
      const int64_t param_n = gplan.param_end() + 3, main_n = gplan.main_end() + 2, state_n = gplan.state_end() + 1;
      testing::AdamWBuffers c(kCpu, md, param_n, main_n, state_n, cs);
      testing::AdamWBuffers a(c, kGpu, gs), b(c, kGpu, gs);
      ScalarsTensor gsc(kGpu), csc(kCpu);
      gsc.write(initial_optimizer_scalars(static_scaler(4.f)), gs);
      csc.write(initial_optimizer_scalars(static_scaler(4.f)), cs);
      optimizer_prepare(gsc.t, 0.f, gs);
      optimizer_prepare(csc.t, 0.f, cs);
      AdamWHyper h;
      h.lr = 1e-3f;
      h.weight_decay = 0.1f;
      adamw_multi_step(a.p, a.g, a.m, a.v, a.model_view(), gplan, h, gsc.t, gs);
      adamw_multi_step(c.p, c.g, c.m, c.v, c.model_view(), cplan, h, csc.t, cs);
      for (const AdamWRun& r : runs) {
        AdamWHyper hr = h;
        hr.weight_decay = r.decay ? h.weight_decay : 0.f;
        adamw_step(b.p->flat_range(r.main, r.n), b.g->flat_range(r.param, r.n), b.m->flat_range(r.state, r.n),
                   b.v->flat_range(r.state, r.n),
                   b.model_view().empty() ? Tensor() : b.model_view().flat_range(r.param, r.n), hr, gsc.t, gs);
      }
      EXPECT_EQ(device_bytes(a.p, gs), device_bytes(b.p, gs));
      EXPECT_EQ(device_bytes(a.m, gs), device_bytes(b.m, gs));
      EXPECT_EQ(device_bytes(a.v, gs), device_bytes(b.v, gs));
      EXPECT_EQ(device_bytes(a.model_view(), gs), device_bytes(b.model_view(), gs));
      EXPECT_LT(rel_err(to_host(a.p, gs), to_host(c.p, cs)), 1e-6);
      EXPECT_LT(rel_err(to_host(a.m, gs), to_host(c.m, cs)), 1e-6);
      EXPECT_LT(rel_err(to_host(a.v, gs), to_host(c.v, cs)), 1e-6);
    }
  }
}

// --use-precision-aware-optimizer: split_param_remainders / merge_param_remainders on the device are
// bitwise the CPU's (aligned, four elements per access, and unaligned views), on every fp32 bit
// pattern class (ties, carries into the exponent, +-0, subnormals, inf, NaN payloads).
TEST(OptimizerCuda, ParamRemaindersSplitMergeMatchCpuBitwise) {
  MT_REQUIRE_CUDA();
  Stream cs(kCpu), gs(kGpu);
  const int64_t n = 100003;
  std::vector<uint32_t> bits(static_cast<size_t>(n));
  std::uniform_int_distribution<uint32_t> any;
  for (auto& u : bits) u = any(testing::test_rng());
  const uint32_t special[] = {0x00000000u, 0x80000000u, 0x00008000u, 0x3F808000u, 0x3F818000u, 0xBF808000u,
                              0x3F80FFFFu, 0x7F7FFFFFu, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7FFF8000u,
                              0xFFFF8000u, 0x00000001u};
  for (size_t k = 0; k < std::size(special); ++k) bits[k * 7] = special[k];
  for (int64_t offset : {0, 1}) {
    SCOPED_TRACE(::testing::Message() << "offset " << offset);
    const int64_t len = n - offset;
    auto make = [&](Device d, const Stream& s) {
      std::array<OwnedTensor, 4> t = {OwnedTensor(DType::kF32, d, {n}), OwnedTensor(DType::kBF16, d, {n}),
                                      OwnedTensor(DType::kI16, d, {n}), OwnedTensor(DType::kF32, d, {n})};
      copy_bytes(t[0].t.data(), d, bits.data(), kCpu, bits.size() * 4, s);
      memset_tensor(t[1], 0xAB, s);
      memset_tensor(t[2], 0xCD, s);
      memset_tensor(t[3], 0xEF, s);
      auto v = [&](const OwnedTensor& x) { return x.t.flat_range(offset, len); };
      split_param_remainders(v(t[0]), v(t[1]), v(t[2]), s);
      merge_param_remainders(v(t[3]), v(t[1]), v(t[2]), s);
      return t;
    };
    const auto c = make(kCpu, cs);
    const auto g = make(kGpu, gs);
    for (int k = 1; k < 4; ++k) EXPECT_EQ(device_bytes(g[k], gs), device_bytes(c[k], cs)) << "tensor " << k;
    const auto back = device_bytes(g[3], gs), orig = device_bytes(g[0], gs);
    EXPECT_TRUE(std::equal(back.begin() + 4 * offset, back.end(), orig.begin() + 4 * offset)) << "round trip";
    // bf16 only (no remainders): the same high halves.
    OwnedTensor hi(DType::kBF16, kGpu, {n});
    memset_tensor(hi, 0xAB, gs);
    split_param_remainders(g[0].t.flat_range(offset, len), hi.t.flat_range(offset, len), Tensor(), gs);
    EXPECT_EQ(device_bytes(hi, gs), device_bytes(c[1], cs));
  }
}

// adamw_multi_step and adamw_step on (bf16, int16 remainder) pairs on the device: bitwise the CPU
// backend's, and the merged main parameters bitwise the device's fp32-main path, over several
// steps (decay and no-decay runs, aligned and unaligned chunks, a skipped overflow step).
TEST(OptimizerCuda, AdamWRemaindersMatchCpuBitwise) {
  MT_REQUIRE_CUDA();
  Stream cs(kCpu), gs(kGpu);
  for (bool sharded : {false, true}) {
    SCOPED_TRACE(sharded ? "main by state index" : "main by flat index");
    const std::vector<AdamWRun> runs = testing::test_adamw_runs(sharded);
    const AdamWPlan gplan(runs, kGpu, gs), cplan(runs, kCpu, cs);
    const int64_t param_n = gplan.param_end() + 3, main_n = gplan.main_end() + 2, state_n = gplan.state_end() + 1;
    testing::AdamWBuffers c(kCpu, DType::kBF16, param_n, main_n, state_n, cs);
    testing::AdamWBuffers a(c, kGpu, gs), f(c, kGpu, gs);  // a: remainders on the device, f: fp32 main
    // (bf16, remainder) pairs of the main parameters: bf16 at the param index, remainder at the main one.
    OwnedTensor cmodel(DType::kBF16, kCpu, {param_n}), crem(DType::kI16, kCpu, {main_n});
    memset_tensor(cmodel, 0, cs);
    memset_tensor(crem, 0, cs);
    for (const AdamWRun& r : runs)
      split_param_remainders(c.p->flat_range(r.main, r.n), cmodel.t.flat_range(r.param, r.n),
                             crem.t.flat_range(r.main, r.n), cs);
    OwnedTensor gmodel(DType::kBF16, kGpu, {param_n}), grem(DType::kI16, kGpu, {main_n});
    copy(gmodel, cmodel, gs);
    copy(grem, crem, gs);
    ScalarsTensor gsc(kGpu), csc(kCpu);
    const LossScalerConfig cfg = static_scaler(4.f);
    gsc.write(initial_optimizer_scalars(cfg), gs);
    csc.write(initial_optimizer_scalars(cfg), cs);
    AdamWHyper h;
    h.beta2 = 0.95f;
    h.weight_decay = 0.1f;
    for (int step = 0; step < 4; ++step) {
      SCOPED_TRACE(::testing::Message() << "step " << step);
      h.lr = 1e-3f * static_cast<float>(step + 1);
      std::vector<float> g = testing::randn(param_n, 0.2f);
      if (step == 2) g[runs[0].param + 5] = INFINITY;  // skipped: nothing written
      testing::upload(c.g, g, cs);
      testing::upload(a.g, g, gs);
      testing::upload(f.g, g, gs);
      const auto before = device_bytes(grem, gs);
      grad_sumsq_accumulate(csc.t, c.g, cs);
      grad_sumsq_accumulate(gsc.t, a.g, gs);
      // No clipping: the CPU and CUDA gradient norms are sums in different orders, so a clip
      // coefficient could differ in its last bit (and with it every update).
      optimizer_prepare(csc.t, 0.f, cs);
      optimizer_prepare(gsc.t, 0.f, gs);
      adamw_multi_step(crem, c.g, c.m, c.v, cmodel, cplan, h, csc.t, cs);
      adamw_multi_step(grem, a.g, a.m, a.v, gmodel, gplan, h, gsc.t, gs);
      adamw_multi_step(f.p, f.g, f.m, f.v, f.model_view(), gplan, h, gsc.t, gs);
      loss_scaler_update(csc.t, cfg, cs);
      loss_scaler_update(gsc.t, cfg, gs);
      if (step == 2) {
        EXPECT_EQ(device_bytes(grem, gs), before);
      }
      EXPECT_EQ(device_bytes(gmodel, gs), device_bytes(cmodel, cs));
      EXPECT_EQ(device_bytes(grem, gs), device_bytes(crem, cs));
      EXPECT_EQ(device_bytes(a.m, gs), device_bytes(c.m, cs));
      EXPECT_EQ(device_bytes(a.v, gs), device_bytes(c.v, cs));
      EXPECT_EQ(device_bytes(a.m, gs), device_bytes(f.m, gs));
      // merged == the fp32-main path's main parameters, run by run
      OwnedTensor merged(DType::kF32, kGpu, {main_n});
      memset_tensor(merged, 0, gs);
      OwnedTensor expect(DType::kF32, kGpu, {main_n});
      memset_tensor(expect, 0, gs);
      for (const AdamWRun& r : runs) {
        merge_param_remainders(merged.t.flat_range(r.main, r.n), gmodel.t.flat_range(r.param, r.n),
                               grem.t.flat_range(r.main, r.n), gs);
        copy(expect.t.flat_range(r.main, r.n), f.p->flat_range(r.main, r.n), gs);
      }
      EXPECT_EQ(device_bytes(merged, gs), device_bytes(expect, gs));
    }
    // adamw_step on an unaligned view (scalar path) updates its elements to the same bits as on
    // the whole, aligned buffer (vector path).
    const int64_t n = 4099;
    const std::vector<float> p0 = testing::randn(n), g0 = testing::randn(n, 0.1f), m0 = testing::randn(n, 0.01f),
                             v0 = testing::randu(n, 1e-5f, 1e-3f);
    std::array<OwnedTensor, 2> pt, model, rem, gt, mo, vo;
    for (int k = 0; k < 2; ++k) {
      pt[k] = make_tensor(p0, DType::kF32, kGpu, {n}, gs);
      model[k] = OwnedTensor(DType::kBF16, kGpu, {n});
      rem[k] = OwnedTensor(DType::kI16, kGpu, {n});
      split_param_remainders(pt[k], model[k], rem[k], gs);
      gt[k] = make_tensor(g0, DType::kF32, kGpu, {n}, gs);
      mo[k] = make_tensor(m0, DType::kF32, kGpu, {n}, gs);
      vo[k] = make_tensor(v0, DType::kF32, kGpu, {n}, gs);
    }
    gs.synchronize();
    auto tail = [n](const OwnedTensor& t) { return t.t.flat_range(1, n - 1); };
    adamw_step(rem[0], gt[0], mo[0], vo[0], model[0], h, gsc.t, gs);
    adamw_step(tail(rem[1]), tail(gt[1]), tail(mo[1]), tail(vo[1]), tail(model[1]), h, gsc.t, gs);
    for (auto* t : {&model, &rem, &mo, &vo}) {
      const auto b0 = device_bytes((*t)[0], gs), b1 = device_bytes((*t)[1], gs);
      const size_t es = b0.size() / static_cast<size_t>(n);
      EXPECT_TRUE(std::equal(b0.begin() + es, b0.end(), b1.begin() + es));
    }
  }
}

TEST(OptimizerCuda, RejectsMixedDevices) {
  MT_REQUIRE_CUDA();
  Stream gs(kGpu);
  ScalarsTensor sc(kGpu);
  sc.write(initial_optimizer_scalars(static_scaler(1.f)), gs);
  OwnedTensor g_cpu(DType::kF32, kCpu, {8});
  EXPECT_THROW(grad_sumsq_accumulate(sc.t, g_cpu, gs), Error);
  Stream cs(kCpu);
  EXPECT_THROW(optimizer_prepare(sc.t, 1.f, cs), Error);  // CPU stream for device scalars
}

}  // namespace
}  // namespace mt
