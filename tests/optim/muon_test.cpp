// The Muon optimizer (optim/muon.h): Newton-Schulz against a float64 reference and the scalar
// polynomial on the singular values, the Muon step against a hand-written float64 update, the
// loss scale undone, MoE experts orthogonalised one by one, tensor-parallel modes (duplicated and
// distributed == one rank, blockwise == its definition), the distributed optimizer == one rank,
// bad input, and a CLI resume that is bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <regex>
#include <sstream>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include "comm/thread_comm.h"
#include "train/arguments.h"
#include "model/layers/parallel_params.h"
#include "ops/muon.h"
#include "optim/muon.h"
#include "optim/optimizer.h"
#include "testing/testing.h"
#include "optim/muon_test_util.h"

namespace mt {
namespace {

using testing::to_host;
using testing::upload;
using testing::OwnedTensor;
using namespace muon_test;  // NOLINT

// ---- Newton-Schulz ---------------------------------------------------------------------------

struct NsCase {
  std::string type;
  int steps;
};

class NewtonSchulzTest : public ::testing::TestWithParam<NsCase> {};

// The CPU iteration against float64: the result, and its singular values against the scalar
// polynomial iteration sigma -> a sigma + b sigma^3 + c sigma^5 applied to the input's normalised
// singular values (NS acts on each singular value alone). Wide, tall and square matrices.
TEST_P(NewtonSchulzTest, MatchesFloat64AndThePolynomialOnSingularValues) {
  const NsCase nc = GetParam();
  const std::vector<NsCoeff> co = ns_coefficients(parse_muon_coefficient_type(nc.type), nc.steps);
  const Stream& st = testing::cpu_stream();
  for (const auto& [r, c] : {std::pair<int64_t, int64_t>{24, 40}, {40, 24}, {32, 32}}) {
    const std::vector<float> g = testing::randn(r * c);
    auto gt = testing::make_tensor(g, DType::kF32, Device::cpu(), {r * c}, testing::cpu_stream());
    OwnedTensor out(DType::kF32, Device::cpu(), {r * c});
    testing::poison(out.t, st);
    NewtonSchulz ns(Device::cpu(), DType::kF32, r * c, std::min(r, c) * std::min(r, c), st);
    ns.run(out.t, gt.t, r, c, co, st);
    const std::vector<float> o = to_host(out.t, st);
    const Mat ref = ns_ref(to_double(g), r, c, co);
    EXPECT_LT(testing::rel_err(o, ref), 2e-5) << nc.type << " " << r << "x" << c;
    // Singular values: the polynomial on the normalised input's singular values.
    std::vector<double> s_in = singular_values(to_double(g), r, c);
    double fro = 0;
    for (double v : s_in) fro += v * v;
    for (double& v : s_in) {
      v /= std::sqrt(fro);
      for (const NsCoeff& k : co) v = k.a * v + k.b * v * v * v + k.c * v * v * v * v * v;
    }
    std::sort(s_in.begin(), s_in.end());
    const std::vector<double> s_out = singular_values(to_double(o), r, c);
    double worst = 0, lo = 1e9, hi = 0;
    for (size_t i = 0; i < s_out.size(); ++i) {
      worst = std::max(worst, std::abs(s_out[i] - s_in[i]));
      lo = std::min(lo, s_out[i]);
      hi = std::max(hi, s_out[i]);
    }
    EXPECT_LT(worst, 1e-4) << nc.type << " " << r << "x" << c;
    // The orthogonality the sets reach on a rectangular Gaussian matrix (well conditioned): every
    // singular value near 1 (the classic quintic trades accuracy for speed: about [0.68, 1.13]). A
    // square one has singular values near 0 (a Gaussian square matrix's smallest one may be
    // arbitrarily small: with 1 seed in ~7 polar_express leaves one below 0.99), so there only
    // the upper bound of polar_express (the per-value polynomial is checked above for all).
    const bool precise = nc.type == "polar_express";
    if (r != c) EXPECT_GT(lo, precise ? 0.99 : (nc.type == "simple" ? 0.6 : 0.95)) << nc.type << " " << r << "x" << c;
    if (r != c || precise)
      EXPECT_LT(hi, precise ? 1.01 : (nc.type == "simple" ? 1.2 : 1.05)) << nc.type << " " << r << "x" << c;
    std::printf("%s %s %ldx%ld: singular values in [%.4f, %.4f]\n", nc.type.c_str(), "cpu", static_cast<long>(r),
                static_cast<long>(c), lo, hi);
  }
}

INSTANTIATE_TEST_SUITE_P(Sets, NewtonSchulzTest,
                         ::testing::Values(NsCase{"simple", 5}, NsCase{"quintic", 5}, NsCase{"polar_express", 8},
                                           NsCase{"polar_express", 10}, NsCase{"aol", 4}),
                         [](const auto& info) { return info.param.type + "_" + std::to_string(info.param.steps); });

TEST(NewtonSchulz, CoefficientSetsAndErrors) {
  const auto simple = ns_coefficients(MuonCoefficientType::kSimple, 3);
  ASSERT_EQ(simple.size(), 3u);
  EXPECT_EQ(simple[2].a, 3.4445f);
  EXPECT_EQ(simple[2].b, -4.7750f);
  EXPECT_EQ(simple[2].c, 2.0315f);
  const auto pe = ns_coefficients(MuonCoefficientType::kPolarExpress, 10);
  ASSERT_EQ(pe.size(), 10u);
  EXPECT_EQ(pe[0].a, 8.2051f);
  EXPECT_EQ(pe[9].a, pe[7].a);  // the last step repeated
  EXPECT_EQ(ns_coefficients(MuonCoefficientType::kQuintic, 10).size(), 10u);
  testing::expect_error([] { parse_muon_coefficient_type("cubic"); },
                        "--muon-coefficient-type 'cubic' is not one of simple, quintic, polar_express, aol");
  testing::expect_error([] { ns_coefficients(MuonCoefficientType::kQuintic, 4); }, "multiple of 5");
  testing::expect_error([] { ns_coefficients(MuonCoefficientType::kPolarExpress, 5); }, ">= 8");
  testing::expect_error([] { ns_coefficients(MuonCoefficientType::kSimple, 0); }, "--muon-num-ns-steps must be >= 1");
  EXPECT_DOUBLE_EQ(muon_scale_factor(MuonScaleMode::kSpectral, 16, 64), 8.0);
  EXPECT_DOUBLE_EQ(muon_scale_factor(MuonScaleMode::kUnitRmsNorm, 64, 16), 2.0);
  EXPECT_DOUBLE_EQ(muon_scale_factor(MuonScaleMode::kShapeScaling, 16, 64), 1.0);
  testing::expect_error([] { parse_muon_scale_mode("rms"); },
                        "--muon-scale-mode 'rms' is not one of spectral, unit_rms_norm, shape_scaling");
  testing::expect_error([] { parse_muon_tp_mode("sharded"); },
                        "--muon-tp-mode 'sharded' is not one of duplicated, blockwise, distributed");
  // Every spelling round-trips through its enum.
  for (const char* n : {"spectral", "unit_rms_norm", "shape_scaling"})
    EXPECT_STREQ(muon_scale_mode_name(parse_muon_scale_mode(n)), n);
  for (const char* n : {"simple", "quintic", "polar_express", "aol"})
    EXPECT_STREQ(muon_coefficient_type_name(parse_muon_coefficient_type(n)), n);
  for (const char* n : {"duplicated", "blockwise", "distributed"})
    EXPECT_STREQ(muon_tp_mode_name(parse_muon_tp_mode(n)), n);
  MuonConfig c;
  c.momentum = 1.f;
  testing::expect_error([&] { validate_muon_config(c); }, "--muon-momentum");
  OptimizerConfig oc;
  oc.optimizer = "sgd";
  ParamSpec w{"decoder.layers.0.mlp.linear_fc2.weight", {4, 4}};
  ParamStore P({w}, DType::kF32, Device::cpu());
  testing::expect_error([&] { AdamWOptimizer(P, oc, testing::cpu_stream()); }, "--optimizer 'sgd'");
}

// ---- The Muon step ---------------------------------------------------------------------------

// Two steps of Muon + AdamW on one rank against a float64 reference written from the definitions:
// clipping over all gradients, Nesterov momentum, Q/K/V orthogonalised apart, the gated fc1 whole,
// experts one by one, decoupled weight decay; AdamW parameters bitwise those of AdamW alone.
TEST(MuonStep, MatchesHandWrittenReference) {
  const Stream& st = testing::cpu_stream();
  const auto specs = layer_specs(1, 0);
  ParamStore P(specs, DType::kF32, Device::cpu());
  P.initialize(7, st);
  ParamStore A(specs, DType::kF32, Device::cpu());  // AdamW everywhere
  A.initialize(7, st);
  const OptimizerConfig oc = opt_config();
  OptimizerConfig ac = oc;
  ac.optimizer = "adam";
  AdamWOptimizer opt(P, oc, st), adam(A, ac, st);
  ASSERT_NE(opt.muon(), nullptr);
  const float lr = 0.02f;
  // reference state
  std::vector<Mat> w(P.size()), m(P.size());
  for (size_t i = 0; i < P.size(); ++i) {
    w[i] = to_double(to_host(P.param(i), st));
    m[i].assign(w[i].size(), 0.0);
  }
  for (int step = 0; step < 2; ++step) {
    set_grads(P, step, 1.f, st);
    set_grads(A, step, 1.f, st);
    double ss = 0;
    std::vector<Mat> g(P.size());
    for (size_t i = 0; i < P.size(); ++i) {
      g[i] = to_double(to_host(P.grad(i), st));
      for (double v : g[i]) ss += v * v;
    }
    const double clip = std::min(1.0, oc.clip_grad / (std::sqrt(ss) + 1e-6));
    ASSERT_LT(clip, 0.5) << "clipping must be active";
    opt.step(lr, st);
    adam.step(lr, st);
    for (size_t i = 0; i < P.size(); ++i) {
      const ParamInfo& p = P.info(i);
      if (!is_muon_parameter(p)) continue;
      const double beta = oc.muon.momentum;
      Mat u(g[i].size());
      for (size_t e = 0; e < u.size(); ++e) {
        const double gg = g[i][e] * clip;
        m[i][e] = beta * m[i][e] + (1 - beta) * gg;
        u[e] = (1 - beta) * gg + beta * m[i][e];
      }
      const int64_t r = p.shape[0], c = p.shape[1];
      Mat o(u.size());
      if (p.name.find("linear_qkv") != std::string::npos) {  // [groups, 2 d + 2 d, h] -> Q, K, V
        const int64_t q = kHeads / kGroups * kD, per = q + 2 * kD;
        for (const auto& [row0, n] : {std::pair<int64_t, int64_t>{0, q}, {q, kD}, {q + kD, kD}}) {
          Mat part;
          for (int64_t gi = 0; gi < kGroups; ++gi)
            part.insert(part.end(), u.begin() + (gi * per + row0) * c, u.begin() + (gi * per + row0 + n) * c);
          const Mat op = muon_update(part, kGroups * n, c, oc.muon);
          for (int64_t gi = 0; gi < kGroups; ++gi)
            std::copy(op.begin() + gi * n * c, op.begin() + (gi + 1) * n * c, o.begin() + (gi * per + row0) * c);
        }
      } else {
        o = muon_update(u, r, c, oc.muon);
      }
      for (size_t e = 0; e < o.size(); ++e) w[i][e] -= lr * (o[e] + oc.weight_decay * w[i][e]);
      EXPECT_LT(testing::rel_err(to_host(P.param(i), st), w[i]), 2e-5) << p.name << " step " << step;
    }
  }
  // AdamW parameters: bitwise the AdamW-only run; Muon ones moved differently; moments.
  // One buffer for Muon's matrices: exp_avg_sq holds the AdamW elements only.
  int64_t muon_elements = 0;
  for (size_t i = 0; i < P.size(); ++i) muon_elements += is_muon_parameter(P.info(i)) ? P.info(i).numel : 0;
  EXPECT_EQ(opt.adamw_state_elements(), P.total_elements() - muon_elements);
  EXPECT_EQ(opt.state_bytes(), 4 * (2 * P.total_elements() - muon_elements));
  EXPECT_EQ(adam.state_bytes(), 8 * A.total_elements());
  EXPECT_FALSE(opt.moments_flat());
  OwnedTensor fm(DType::kF32, Device::cpu(), {P.total_elements()}), fv(DType::kF32, Device::cpu(), {P.total_elements()});
  testing::poison(fv.t, st);
  opt.gather_moments(fm.t, fv.t, st);
  const std::vector<float> em = to_host(fm.t, st), ev = to_host(fv.t, st);
  // ... and AdamW's moments where AdamW steps: bitwise the AdamW-only run's
  OwnedTensor am(DType::kF32, Device::cpu(), {A.total_elements()}), av(DType::kF32, Device::cpu(), {A.total_elements()});
  adam.gather_moments(am.t, av.t, st);
  const std::vector<float> aem = to_host(am.t, st), aev = to_host(av.t, st);
  for (size_t i = 0; i < P.size(); ++i) {
    const ParamInfo& p = P.info(i);
    const std::vector<float> a = to_host(A.param(i), st), b = to_host(P.param(i), st);
    if (is_muon_parameter(p)) {
      EXPECT_NE(a, b) << p.name;
      for (int64_t e = 0; e < p.numel; ++e) ASSERT_EQ(ev[p.offset + e], 0.f) << p.name << " has an exp_avg_sq";
      std::vector<float> mom(em.begin() + p.offset, em.begin() + p.offset + p.numel);
      EXPECT_LT(testing::rel_err(mom, m[i]), 1e-6) << p.name << " momentum";
    } else {
      EXPECT_TRUE(testing::same_bits(a, b)) << p.name << " (AdamW parameter) differs from AdamW alone";
      for (int64_t e = 0; e < p.numel; ++e) {
        ASSERT_EQ(em[p.offset + e], aem[p.offset + e]) << p.name;
        ASSERT_EQ(ev[p.offset + e], aev[p.offset + e]) << p.name;
      }
    }
  }
  for (const char* n : {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.layers.0.mlp.router.weight",
                        "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.self_attention.linear_qkv.bias"})
    EXPECT_FALSE(is_muon_parameter(P.info(P.index(n)))) << n;
}

// The momentum op against its formula, found_inf leaving the momentum alone (CPU).
TEST(MuonMomentum, FormulaAndSkippedStep) {
  const Stream& st = testing::cpu_stream();
  const int64_t n = 1000;
  const std::vector<float> g = testing::randn(n), m0 = testing::randn(n);
  auto gt = testing::make_tensor(g, DType::kF32, Device::cpu(), {n}, testing::cpu_stream());
  auto mt = testing::make_tensor(m0, DType::kF32, Device::cpu(), {n}, testing::cpu_stream());
  OwnedTensor u(DType::kF32, Device::cpu(), {n});
  OwnedTensor sc(DType::kU8, Device::cpu(), {static_cast<int64_t>(sizeof(OptimizerScalars))});
  OptimizerScalars s;
  s.loss_scale = 8.f;
  s.clip_coeff = 0.5f;
  std::memcpy(sc.t.data(), &s, sizeof(s));
  muon_momentum(u.t, gt.t, mt.t, 0.95f, true, sc.t, st);
  const std::vector<float> uu = to_host(u.t, st), mm1 = to_host(mt.t, st);
  for (int64_t i = 0; i < n; ++i) {
    const double gg = g[i] / 8.0 * 0.5, m = 0.95 * m0[i] + 0.05 * gg;
    ASSERT_NEAR(mm1[i], m, 1e-6);
    ASSERT_NEAR(uu[i], 0.05 * gg + 0.95 * m, 1e-6);
  }
  s.found_inf = 1;
  std::memcpy(sc.t.data(), &s, sizeof(s));
  muon_momentum(gt.t, gt.t, mt.t, 0.95f, false, sc.t, st);
  EXPECT_EQ(to_host(mt.t, st), mm1);
  EXPECT_EQ(to_host(gt.t, st), std::vector<float>(n, 0.f));
  testing::expect_error([&] { muon_momentum(mt.t, gt.t, mt.t, 0.9f, false, sc.t, st); }, "alias");
  testing::expect_error([&] { muon_momentum(u.t, gt.t, mt.t, 1.f, false, sc.t, st); }, "beta");
}

// --fp16: the loss scale is undone before the momentum and Newton-Schulz: an fp16 model whose
// gradients carry a static loss scale of 1024 takes the same steps as the fp32 model without one
// (the main parameters bitwise: scaling by a power of two is exact).
TEST(MuonStep, LossScaleUndone) {
  const Stream& st = testing::cpu_stream();
  const auto specs = layer_specs(1, 0);
  ParamStore P(specs, DType::kF32, Device::cpu()), H(specs, DType::kF16, Device::cpu());
  P.initialize(3, st);
  H.initialize(3, st);
  OptimizerConfig oc = opt_config(), hc = opt_config();
  hc.scaler.initial_scale = 1024.f;
  AdamWOptimizer po(P, oc, st), ho(H, hc, st);
  for (int step = 0; step < 2; ++step) {
    set_grads(P, step, 1.f, st);
    set_grads(H, step, 1024.f, st);
    po.step(0.02f, st);
    ho.step(0.02f, st);
  }
  EXPECT_EQ(ho.read_scalars_sync(st).loss_scale, 1024.f);
  OwnedTensor a(DType::kF32, Device::cpu(), {P.total_elements()}), b(DType::kF32, Device::cpu(), {H.total_elements()});
  po.gather_main(a.t, st);
  ho.gather_main(b.t, st);
  EXPECT_TRUE(testing::same_bits(to_host(a.t, st), to_host(b.t, st)));
}

// MoE: each expert's matrix is orthogonalised on its own: changing expert 1's gradient leaves
// expert 0's update bitwise unchanged, and each expert's update has the singular values of an
// orthogonalised matrix of its own shape.
TEST(MuonStep, ExpertsOrthogonalisedOneByOne) {
  const Stream& st = testing::cpu_stream();
  const auto specs = layer_specs(1, 0);
  std::vector<std::vector<float>> after(2);
  for (int run = 0; run < 2; ++run) {
    ParamStore P(specs, DType::kF32, Device::cpu());
    P.initialize(5, st);
    OptimizerConfig oc = opt_config();
    oc.weight_decay = 0.f;
    AdamWOptimizer opt(P, oc, st);
    set_grads(P, 0, 1.f, st);
    const size_t e1 = P.index("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight");
    if (run == 1) upload(P.grad(e1), testing::randn(P.info(e1).numel), st);
    const size_t e0 = P.index("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight");
    const std::vector<float> w0 = to_host(P.param(e0), st);
    opt.step(0.02f, st);
    const std::vector<float> w1 = to_host(P.param(e0), st);
    after[static_cast<size_t>(run)].resize(w0.size());
    for (size_t i = 0; i < w0.size(); ++i) after[run][i] = (w0[i] - w1[i]) / 0.02f;
  }
  // Clipping couples the experts through the global norm, and the orthogonalisation removes a
  // common scale: the update of expert 0 is the same up to rounding.
  EXPECT_LT(testing::rel_err(after[0], after[1]), 1e-5);
  const double s = muon_scale_factor(MuonScaleMode::kSpectral, kF, kH) * 0.2;
  Mat o = to_double(after[0]);
  for (double& v : o) v /= s;
  for (double sv : singular_values(o, kF, kH)) {
    EXPECT_GT(sv, 0.6);
    EXPECT_LT(sv, 1.25);
  }
}

// ---- Parallel layouts ------------------------------------------------------------------------

// The global parameters after `steps` steps: gathered from every TP rank's shards (boxes).
std::vector<std::vector<float>> global_params(const ParamStore& P, const Stream& st) {
  std::vector<std::vector<float>> out(P.size());
  for (size_t i = 0; i < P.size(); ++i) out[i] = to_host(P.param(i), st);
  return out;
}

// One rank's reference: every parameter's global tensor after `steps` steps.
std::vector<std::vector<float>> one_rank(const OptimizerConfig& oc, int steps) {
  const Stream& st = testing::cpu_stream();
  ParamStore P(layer_specs(1, 0), DType::kF32, Device::cpu());
  P.initialize(11, st);
  AdamWOptimizer opt(P, oc, st);
  for (int s = 0; s < steps; ++s) {
    set_grads(P, s, 1.f, st);
    opt.step(0.02f, st);
  }
  return global_params(P, st);
}

// Compares a shard with the global reference through its box.
double shard_err(const ParamInfo& p, const std::vector<float>& local, const std::vector<float>& global) {
  std::vector<float> expect(local.size());
  for (int64_t e = 0; e < p.numel; ++e) expect[e] = global[static_cast<size_t>(p.box.global_index(e))];
  return testing::rel_err(local, expect);
}

class MuonTensorParallel : public ::testing::TestWithParam<std::string> {};

// TP 2 (dense and expert TP groups = the two ranks): duplicated and distributed give one rank's
// update (distributed within rounding of a different summation order).
TEST_P(MuonTensorParallel, MatchesOneRank) {
  const std::string mode = GetParam();
  const OptimizerConfig oc = opt_config(mode);
  const auto ref = one_rank(oc, 2);
  run_thread_ranks(2, [&](int rank, std::shared_ptr<Communicator> world) {
    Stream st;
    ParamStore P(layer_specs(2, rank), DType::kF32, Device::cpu());
    P.initialize(11, st);
    OptimizerGroups g;
    g.mp = g.expert_mp = g.tp = g.etp = world;
    g.tp_rank = rank;
    AdamWOptimizer opt(P, oc, st, g);
    for (int s = 0; s < 2; ++s) {
      set_grads(P, s, 1.f, st);
      opt.step(0.02f, st);
    }
    for (size_t i = 0; i < P.size(); ++i) {
      const double err = shard_err(P.info(i), to_host(P.param(i), st), ref[i]);
      EXPECT_LT(err, mode == "duplicated" ? 1e-6 : 2e-4) << P.info(i).name << " rank " << rank;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Modes, MuonTensorParallel, ::testing::Values("duplicated", "distributed"));

// blockwise: each TP shard orthogonalised alone, scaled by its own shape (Megatron's
// partition_dim None): rank r's step is one-rank Muon on its shards taken as whole matrices
// (clipping off, so that the global gradient norm does not enter).
TEST(MuonTensorParallel, BlockwiseIsEachShardAlone) {
  OptimizerConfig oc = opt_config("blockwise");
  oc.clip_grad = 0.f;
  run_thread_ranks(2, [&](int rank, std::shared_ptr<Communicator> world) {
    Stream st;
    const auto specs = layer_specs(2, rank);
    ParamStore P(specs, DType::kF32, Device::cpu());
    P.initialize(11, st);
    OptimizerGroups g;
    g.mp = g.expert_mp = g.tp = g.etp = world;
    g.tp_rank = rank;
    AdamWOptimizer opt(P, oc, st, g);
    // The definition: the same shards as unsplit parameters of one rank.
    std::vector<ParamSpec> alone = specs;
    for (ParamSpec& s : alone) s.tensor_parallel = false;
    ParamStore Q(alone, DType::kF32, Device::cpu());
    for (size_t i = 0; i < P.size(); ++i) copy(Q.param(i), P.param(i), st);
    AdamWOptimizer qo(Q, oc, st);
    for (int step = 0; step < 2; ++step) {
      set_grads(P, step, 1.f, st);
      for (size_t i = 0; i < P.size(); ++i) copy(Q.grad(i), P.grad(i), st);
      opt.step(0.02f, st);
      qo.step(0.02f, st);
    }
    int checked = 0;
    for (size_t i = 0; i < P.size(); ++i) {
      if (!is_muon_parameter(P.info(i))) continue;
      EXPECT_TRUE(testing::same_bits(to_host(P.param(i), st), to_host(Q.param(i), st)))
          << P.info(i).name << " rank " << rank;
      ++checked;
    }
    EXPECT_EQ(checked, 6);
  });
}

// --use-distributed-optimizer over DP 2: whole matrices assigned to ranks (balanced), the momentum
// in the owned slices, the updates broadcast: the parameters equal one rank's.
TEST(MuonDataParallel, DistributedOptimizerMatchesOneRank) {
  const OptimizerConfig oc = opt_config();
  const auto ref = one_rank(oc, 3);
  run_thread_ranks(2, [&](int rank, std::shared_ptr<Communicator> world) {
    Stream st;
    ParamStore P(layer_specs(1, 0), DType::kF32, Device::cpu(), ParamLayout{2, 300});
    P.initialize(11, st);
    DdpConfig dc;
    dc.use_distributed_optimizer = true;
    GradSync sync(P, world, dc);
    AdamWOptimizer opt(sync, oc, st, {});
    ASSERT_NE(opt.muon(), nullptr);
    // both ranks own matrices; each Muon matrix on exactly one rank
    EXPECT_FALSE(opt.muon()->owned_matrices().empty()) << "rank " << rank;
    for (int s = 0; s < 3; ++s) {
      // each rank half the gradient (the sum is the one-rank gradient, exact: halving is exact)
      set_grads(P, s, 0.5f, st);
      opt.step(0.02f, st);
    }
    sync.finish_param_sync(st);
    for (size_t i = 0; i < P.size(); ++i)
      EXPECT_LT(testing::rel_err(to_host(P.param(i), st), ref[i]), 1e-6) << P.info(i).name << " rank " << rank;
  });
}


// `layers` decoder layers of layer_specs (the embedding first, the output layer last), with or
// without the experts.
std::vector<ParamSpec> multi_layer_specs(int layers, bool experts) {
  const std::vector<ParamSpec> one = layer_specs(1, 0);
  std::vector<ParamSpec> s{one.front()};
  for (int l = 0; l < layers; ++l)
    for (size_t i = 1; i + 1 < one.size(); ++i) {
      ParamSpec p = one[i];
      if (p.expert && !experts) continue;
      p.name = "decoder.layers." + std::to_string(l) + p.name.substr(std::string("decoder.layers.0").size());
      s.push_back(p);
    }
  s.push_back(one.back());
  return s;
}

// The checks of PipelinedProgram (below) on one parameter list.
void expect_pipelined_program(const std::vector<ParamSpec>& specs) {
  const OptimizerConfig oc = opt_config();
  std::vector<std::vector<float>> ref;
  {
    const Stream& st = testing::cpu_stream();
    ParamStore P(specs, DType::kF32, Device::cpu());
    P.initialize(11, st);
    AdamWOptimizer opt(P, oc, st);
    for (int s = 0; s < 2; ++s) {
      set_grads(P, s, 1.f, st);
      opt.step(0.02f, st);
    }
    ref = global_params(P, st);
  }
  for (const int dp : {2, 4}) {
    SCOPED_TRACE("DP " + std::to_string(dp));
    std::vector<std::vector<std::string>> collectives(static_cast<size_t>(dp));
    std::vector<size_t> computed(specs.size(), 0);
    std::mutex mu;
    run_thread_ranks(dp, [&](int rank, std::shared_ptr<Communicator> world) {
      Stream st;
      ParamStore P(specs, DType::kF32, Device::cpu(), ParamLayout{dp, 400});
      P.initialize(11, st);
      DdpConfig dc;
      dc.use_distributed_optimizer = true;
      dc.overlap_grad_reduce = true;
      GradSync sync(P, world, dc);
      AdamWOptimizer opt(sync, oc, st, {});
      const MuonStep& m = *opt.muon();
      const auto& bks = P.buckets();
      std::vector<int> gather_pos(bks.size(), -1), done_at(P.size(), -1);
      std::vector<std::string>& seq = collectives[static_cast<size_t>(rank)];
      int gathered = 0, gather_waited = -1, batch_waited = -1, batches = 0, last_batch_op = -1, first_bcast_op = -1;
      int last_read_prev = -1, first_wait = -1;
      size_t prev_bucket = 0;
      for (size_t n = 0; n < m.program().size(); ++n) {
        const MuonStep::Op& op = m.program()[n];
        switch (op.kind) {
          case MuonStep::Op::kAllGather: {
            EXPECT_EQ(batches, 0) << "all-gather after a batch";
            if (gathered > 0) EXPECT_LT(op.index, prev_bucket) << "all-gathers not in descending bucket order";
            prev_bucket = op.index;
            bool muon = false;
            for (size_t i = bks[op.index].param_begin; i < bks[op.index].param_end; ++i)
              muon = muon || is_muon_parameter(P.info(i));
            EXPECT_TRUE(muon) << "bucket " << op.index;
            gather_pos[op.index] = gathered++;
            seq.push_back("ag " + std::to_string(op.index));
            break;
          }
          case MuonStep::Op::kComputeWaitsGather:
            ASSERT_GE(gather_pos[op.index], 0);
            EXPECT_GT(gather_pos[op.index], gather_waited);
            gather_waited = gather_pos[op.index];
            if (first_wait < 0) first_wait = gather_waited;
            break;
          case MuonStep::Op::kBatch: {
            EXPECT_EQ(static_cast<int>(op.index), batches) << "batches out of order";
            int last_read = -1;
            for (size_t i : m.batch_params(op.index)) {
              const int pos = gather_pos[P.bucket_of(i)];
              EXPECT_LE(pos, gather_waited) << P.info(i).name << ": batch before its all-gather was waited for";
              last_read = std::max(last_read, pos);
              done_at[i] = batches;
              std::lock_guard<std::mutex> lock(mu);
              ++computed[i];  // once per unit: Q, K and V of linear_qkv
            }
            EXPECT_GE(last_read, last_read_prev) << "batch " << op.index;
            last_read_prev = last_read;
            last_batch_op = static_cast<int>(n);
            ++batches;
            break;
          }
          case MuonStep::Op::kCommWaitsBatch:
            EXPECT_LT(static_cast<int>(op.index), batches) << "waits for a batch not issued";
            EXPECT_GT(static_cast<int>(op.index), batch_waited);
            batch_waited = static_cast<int>(op.index);
            break;
          case MuonStep::Op::kBroadcast: {
            const MuonStep::Broadcast& g = m.broadcasts()[op.index];
            std::string s = fmt::format("bc {} {}", g.expert, g.root);
            for (size_t i : g.params) {
              EXPECT_EQ(m.owner_of(i), g.root);
              EXPECT_EQ(P.info(i).expert, g.expert);
              if (g.root == (g.expert ? sync.edp() : sync.dp())->rank()) {
                EXPECT_GE(done_at[i], 0) << P.info(i).name << " broadcast before its batch";
                EXPECT_LE(done_at[i], batch_waited) << P.info(i).name << " broadcast before waiting for its batch";
              }
              s += " " + std::to_string(i);
            }
            if (first_bcast_op < 0) first_bcast_op = static_cast<int>(n);
            seq.push_back(s);
            break;
          }
        }
      }
      EXPECT_GT(gathered, 2);
      EXPECT_GT(batches, 1);
      EXPECT_LT(first_wait, gathered - 1) << "the first batch waits for every all-gather";
      EXPECT_LT(first_bcast_op, last_batch_op) << "no broadcast issued before the last batch";
      for (int s = 0; s < 2; ++s) {
        set_grads(P, s, 1.f / static_cast<float>(dp), st);
        opt.step(0.02f, st);
      }
      sync.finish_param_sync(st);
      for (size_t i = 0; i < P.size(); ++i)
        EXPECT_LT(testing::rel_err(to_host(P.param(i), st), ref[i]), 1e-6) << P.info(i).name << " rank " << rank;
    });
    for (int r = 1; r < dp; ++r) EXPECT_EQ(collectives[static_cast<size_t>(r)], collectives[0]) << "rank " << r;
    // every Muon matrix broadcast once, computed in one rank's batches (linear_qkv as Q, K and V)
    size_t broadcast = 0;
    for (const std::string& c : collectives[0])
      if (c.rfind("bc", 0) == 0) broadcast += static_cast<size_t>(std::count(c.begin(), c.end(), ' ') - 2);
    size_t muon = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
      ParamInfo p;
      static_cast<ParamSpec&>(p) = specs[i];
      if (!is_muon_parameter(p)) continue;
      ++muon;
      EXPECT_EQ(computed[i], specs[i].name.find("linear_qkv") == std::string::npos ? 1u : 3u) << specs[i].name;
    }
    EXPECT_EQ(broadcast, muon);
  }
}

// The pipelined program of the distributed optimizer (MuonStep::program, docs/optimizer.md
// "Pipelining Muon's traffic") over DP 2 and DP 4, four layers in many buckets, with experts
// (dense and expert buckets) and without:
// every all-gather first, in descending bucket order, each bucket holding a Muon matrix; each batch
// after the compute stream waited for the all-gather of every bucket it reads (the last one read
// non-decreasing along the batches); each broadcast of this rank's matrices after the
// communication stream waited for the batches computing them; every Muon matrix orthogonalised
// once over the group and broadcast once; the collectives in the same order on every rank; and
// the pipeline overlaps (the first batch waits for fewer than all all-gathers, broadcasts are
// issued between batches). The parameters equal one rank's (the same bound as above).
TEST(MuonDataParallel, PipelinedProgram) {
  for (const bool experts : {true, false}) {
    SCOPED_TRACE(experts ? "experts" : "dense");
    expect_pipelined_program(multi_layer_specs(4, experts));
  }
}

// ---- The binary: resume, optimizer switch, bad flags -------------------------------------------

namespace fs = std::filesystem;

std::vector<std::string> loss_values(const std::string& out) {
  std::vector<std::string> v;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (auto p = line.find("lm loss: "); p != std::string::npos) v.push_back(line.substr(p, 22));
  return v;
}

std::string file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::string pretrain(const std::string& flags) {
  return "pretrain --num-layers 2 --hidden-size 16 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --seq-length 16 --micro-batch-size 2 --lr 1e-2 --log-interval 1 --eval-iters 0 "
         "--device cpu --no-progress --mock-data --tokenizer-type NullTokenizer --vocab-size 64 " + flags;
}

// Checkpoints carry the momentum: 4 iterations straight == 2, save, load, 2 (losses and the
// final checkpoint's bytes). The optimizer is recorded: loading Muon state into AdamW is refused,
// --finetune switches.
TEST(MuonCli, ResumeBitwiseAndOptimizerSwitch) {
  const fs::path dir = fs::temp_directory_path() / ("mt_muon_test_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const std::string muon = " --optimizer muon --muon-nesterov --muon-coefficient-type polar_express "
                           "--muon-num-ns-steps 8 --train-iters 4 ";
  const auto full = testing::run_megatron(pretrain(muon + "--save " + (dir / "a").string() + " --save-interval 4"));
  ASSERT_EQ(full.rc, 0) << full.out;
  const auto first = testing::run_megatron(pretrain(muon + "--exit-interval 2 --save " + (dir / "b").string()));
  ASSERT_EQ(first.rc, 0) << first.out;
  const auto second = testing::run_megatron(
      pretrain(muon + "--save " + (dir / "b").string() + " --load " + (dir / "b").string()));
  ASSERT_EQ(second.rc, 0) << second.out;
  auto l = loss_values(first.out);
  const auto l2 = loss_values(second.out);
  l.insert(l.end(), l2.begin(), l2.end());
  ASSERT_EQ(loss_values(full.out).size(), 4u) << full.out;
  EXPECT_EQ(l, loss_values(full.out)) << first.out << second.out;
  const std::string fa = file_bytes(dir / "a" / "iter_0000004" / "rank_00000.bin");
  ASSERT_FALSE(fa.empty());
  EXPECT_TRUE(fa == file_bytes(dir / "b" / "iter_0000004" / "rank_00000.bin")) << "resumed Muon run diverged";
  // AdamW from Muon's state: refused; with --finetune (weights only): trains.
  const auto bad = testing::run_megatron(pretrain("--train-iters 6 --load " + (dir / "a").string()));
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("holds the state of --optimizer muon, this run uses --optimizer adam"), std::string::npos)
      << bad.out;
  const auto ft = testing::run_megatron(pretrain("--train-iters 2 --finetune --load " + (dir / "a").string()));
  EXPECT_EQ(ft.rc, 0) << ft.out;
  EXPECT_EQ(loss_values(ft.out).size(), 2u) << ft.out;
  fs::remove_all(dir);
}

// The memory estimate knows Muon's state (one momentum buffer for its matrices, the Newton-Schulz
// workspace): within 2% of what the run allocates, as AdamW's.
TEST(MuonCli, MemoryEstimateMatchesTheAllocation) {
  for (const std::string flags : {"", "--optimizer muon", "--optimizer muon --hidden-size 64 --num-layers 1"}) {
    const auto r = testing::run_megatron(pretrain("--train-iters 1 " + flags));
    ASSERT_EQ(r.rc, 0) << r.out;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.out, m, std::regex("memory estimate ([0-9.]+) MiB of buffers, ([+-][0-9.]+)% "
                                                        "from the ([0-9.]+) MiB allocated")))
        << r.out;
    EXPECT_LT(std::fabs(std::stod(m[2].str())), 2.0) << flags << "\n" << r.out;
    if (!flags.empty()) EXPECT_NE(r.out.find("Muon Newton-Schulz workspace"), std::string::npos) << r.out;
  }
}

// Megatron's flag names reach MuonConfig (and the QKV split rows come from the model's GQA shape).
TEST(MuonCli, FlagsParse) {
  CLI::App app;
  PretrainArgs a;
  add_pretrain_options(app, a);
  app.parse("--num-layers 1 --hidden-size 64 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
            "--seq-length 16 --micro-batch-size 1 --lr 1e-3 --train-iters 1 --mock-data --optimizer muon "
            "--muon-momentum 0.95 --muon-use-nesterov --muon-num-ns-steps 10 --muon-scale-mode unit_rms_norm "
            "--muon-extra-scale-factor 0.2 --muon-coefficient-type polar_express --muon-tp-mode distributed "
            "--muon-no-split-qkv",
            false);
  validate_pretrain_args(a);
  const MuonConfig& m = a.optim.muon;
  EXPECT_EQ(a.optim.optimizer, "muon");
  EXPECT_EQ(m.momentum, 0.95f);
  EXPECT_TRUE(m.nesterov);
  EXPECT_EQ(m.num_ns_steps, 10);
  EXPECT_EQ(m.scale_mode, MuonScaleMode::kUnitRmsNorm);
  EXPECT_EQ(m.extra_scale_factor, 0.2f);
  EXPECT_EQ(m.tp_mode, MuonTpMode::kDistributed);
  EXPECT_EQ(m.coefficient_type, MuonCoefficientType::kPolarExpress);
  EXPECT_FALSE(m.split_qkv);
  EXPECT_EQ(m.qkv_q_rows, 4 * 8);  // 8 heads / 2 groups x head dim 8
  EXPECT_EQ(m.qkv_kv_rows, 8);
  CLI::App app2;
  PretrainArgs b;
  add_pretrain_options(app2, b);
  app2.parse("--seq-length 16 --micro-batch-size 1 --lr 1e-3 --train-iters 1 --mock-data", false);
  EXPECT_EQ(b.optim.optimizer, "adam");
  EXPECT_TRUE(b.optim.muon.split_qkv);
  EXPECT_FALSE(b.optim.muon.nesterov);
  EXPECT_EQ(b.optim.muon.momentum, 0.9f);
}

TEST(MuonCli, BadFlags) {
  for (const auto& [flags, needle] : std::vector<std::pair<std::string, std::string>>{
           {"--optimizer sgd", "--optimizer 'sgd' is not one of adam, muon"},
           {"--optimizer muon --muon-tp-mode sharded",
            "--muon-tp-mode 'sharded' is not one of duplicated, blockwise, distributed"},
           {"--optimizer muon --muon-coefficient-type cubic",
            "--muon-coefficient-type 'cubic' is not one of simple, quintic, polar_express, aol"},
           {"--optimizer muon --muon-coefficient-type polar_express", ">= 8"},
           {"--optimizer muon --muon-scale-mode rms",
            "--muon-scale-mode 'rms' is not one of spectral, unit_rms_norm, shape_scaling"}}) {
    const auto r = testing::run_megatron(pretrain("--train-iters 1 " + flags));
    EXPECT_NE(r.rc, 0) << flags;
    EXPECT_NE(r.out.find(needle), std::string::npos) << flags << "\n" << r.out;
  }
}

}  // namespace
}  // namespace mt
