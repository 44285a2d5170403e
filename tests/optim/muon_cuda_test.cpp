// Muon on CUDA against the CPU reference (optim/muon.h, ops/muon.h): the element-wise ops
// (momentum bitwise: one shared formula), the bf16 Newton-Schulz against the fp32 CPU one for every
// coefficient set, and a whole optimizer step (Muon + AdamW) on a decoder layer's parameters.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>

#include "ops/muon.h"
#include "ops/optimizer_test_util.h"
#include "optim/muon_test_util.h"

namespace mt {
namespace {

using namespace muon_test;  // NOLINT
using testing::OwnedTensor;
using testing::to_host;

const Device kGpu = Device::cuda();

TEST(MuonCuda, ElementwiseOpsMatchCpu) {
  const int64_t n = 100003;
  const std::vector<float> g = testing::randn(n), m0 = testing::randn(n);
  OptimizerScalars s;
  s.loss_scale = 4.f;
  s.clip_coeff = 0.25f;
  std::vector<std::vector<float>> u(2), m(2), y(2);
  float sumsq[2] = {0, 0};
  for (int d = 0; d < 2; ++d) {
    const Device dev = d == 0 ? Device::cpu() : kGpu;
    Stream st(dev);
    testing::ScalarsTensor sc(dev);
    sc.write(s, st);
    auto gt = testing::make_tensor(g, DType::kF32, dev, {n}, st);
    auto mt = testing::make_tensor(m0, DType::kF32, dev, {n}, st);
    OwnedTensor ut(DType::kF32, dev, {n}), yt(DType::kF32, dev, {n}), scratch(DType::kF32, dev, {kMuonNormScratch});
    testing::poison(ut.t, st);
    muon_momentum(ut.t, gt.t, mt.t, 0.95f, true, sc.t, st);
    muon_sumsq(scratch.t, gt.t, st);
    muon_normalize(yt.t, gt.t, scratch.t, 1e-7f, st);
    u[d] = to_host(ut.t, st);
    m[d] = to_host(mt.t, st);
    y[d] = to_host(yt.t, st);
    sumsq[d] = to_host(scratch.t, st)[0];
  }
  EXPECT_TRUE(testing::same_bits(u[0], u[1]));
  EXPECT_TRUE(testing::same_bits(m[0], m[1]));
  EXPECT_NEAR(sumsq[1], sumsq[0], 1e-5 * sumsq[0]);
  EXPECT_LT(testing::rel_err(y[1], y[0]), 1e-6);
}

TEST(MuonCuda, Copy2dMatchesCpu) {
  const std::vector<float> src = testing::randn(7 * 20);
  std::vector<std::vector<float>> out(2);
  for (int d = 0; d < 2; ++d) {
    const Device dev = d == 0 ? Device::cpu() : kGpu;
    Stream st(dev);
    auto s = testing::make_tensor(src, DType::kF32, dev, {7 * 20}, st);
    auto t = testing::make_tensor(std::vector<float>(5 * 12, -1.f), DType::kF32, dev, {5 * 12}, st);
    muon_copy_2d(t.t, 12, s.t, 20, 5, 9, st);
    out[d] = to_host(t.t, st);
  }
  EXPECT_EQ(out[0], out[1]);
  EXPECT_EQ(out[0][12 + 3], src[20 + 3]);
}

// bf16 GEMMs with fp32 accumulation against the fp32 CPU iteration: the result and the range of
// its singular values (printed, for the record).
TEST(MuonCuda, NewtonSchulzBf16MatchesCpu) {
  for (const auto& [type, steps] : std::vector<std::pair<std::string, int>>{
           {"simple", 5}, {"quintic", 5}, {"polar_express", 8}, {"aol", 4}}) {
    const auto co = ns_coefficients(parse_muon_coefficient_type(type), steps);
    for (const auto& [r, c] : {std::pair<int64_t, int64_t>{96, 256}, {256, 96}, {512, 512}}) {
      const std::vector<float> g = testing::randn(r * c);
      std::vector<std::vector<float>> o(2);
      for (int d = 0; d < 2; ++d) {
        const Device dev = d == 0 ? Device::cpu() : kGpu;
        Stream st(dev);
        auto gt = testing::make_tensor(g, DType::kF32, dev, {r * c}, st);
        OwnedTensor out(DType::kF32, dev, {r * c});
        testing::poison(out.t, st);
        NewtonSchulz ns(dev, d == 0 ? DType::kF32 : DType::kBF16, r * c, std::min(r, c) * std::min(r, c), st);
        ns.run(out.t, gt.t, r, c, co, st);
        o[d] = to_host(out.t, st);
      }
      const double err = testing::rel_err(o[1], o[0]);
      const std::vector<double> sv = singular_values(to_double(o[1]), r, c);
      std::printf("%s %ldx%ld: cuda bf16 vs cpu fp32 rel err %.3e, cuda singular values in [%.4f, %.4f]\n",
                  type.c_str(), static_cast<long>(r), static_cast<long>(c), err, sv.front(), sv.back());
      EXPECT_LT(err, 3e-2) << type << " " << r << "x" << c;
      EXPECT_TRUE(testing::all_finite(o[1]));
    }
  }
}

// One whole optimizer step (Muon + AdamW, bf16 model) on CUDA and on the CPU: the parameter
// updates agree to bf16 precision.
TEST(MuonCuda, OptimizerStepMatchesCpu) {
  const auto specs = layer_specs(1, 0);
  std::vector<std::vector<float>> delta(2);
  for (int d = 0; d < 2; ++d) {
    const Device dev = d == 0 ? Device::cpu() : kGpu;
    Stream st(dev);
    ParamStore P(specs, DType::kF32, dev);
    P.initialize(21, st);
    AdamWOptimizer opt(P, opt_config(), st);
    const std::vector<float> w0 = to_host(P.params_flat(), st);
    set_grads(P, 0, 1.f, st);
    opt.step(0.02f, st);
    const std::vector<float> w1 = to_host(P.params_flat(), st);
    delta[d].resize(w0.size());
    for (size_t i = 0; i < w0.size(); ++i) delta[d][i] = w1[i] - w0[i];
  }
  const double err = testing::rel_err(delta[1], delta[0]);
  std::printf("Muon + AdamW step: cuda vs cpu update rel err %.3e\n", err);
  EXPECT_LT(err, 3e-2);
}

}  // namespace
}  // namespace mt
