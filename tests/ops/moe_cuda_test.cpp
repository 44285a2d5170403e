// CUDA MoE ops (ops/cuda/moe.cu) against the CPU reference (ops/cpu/moe.cpp), each backend called
// directly (mt::cpu::op, mt::cuda::op) on the same random inputs. Routing: the selected experts
// identical (including exact ties, which go to the lower expert index), probs / scores / gradients
// to 1e-6; loss values and their gradients to 1e-5 with a device loss scale, for one token group
// and for G per-sequence groups; token counts and the expert-bias update identical; routing map
// identical (device maps, device and host counts) for local expert ranges inside E and for the
// multi-block scan path (N·k = 2^17 and more); permute / unpermute forward and backward in fp32 to
// 1e-6 and in bf16 / fp16 against the CPU fp32 result on the same rounded inputs. Every CUDA op runs
// twice and must give bitwise identical outputs (determinism). Outputs are poisoned before each
// call. With fp64 logits (--moe-router-dtype fp64) the routing, its losses and the fp64 router GEMM
// match the CPU to double precision.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "ops/elementwise.h"
#include "ops/moe.h"
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

std::vector<int32_t> ints(const Tensor& t, const Stream& s) { return testing::to_host_ints(t, s); }

void fill_ints(const Tensor& t, int32_t v, const Stream& s) {
  std::vector<int32_t> h(static_cast<size_t>(t.numel()), v);
  copy_bytes(t.data(), t.device(), h.data(), kCpu, h.size() * 4, s);
  s.synchronize();
}

/// Bitwise equality of two host vectors (NaNs included).
template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// Distinct experts per token (as the router produces): top [N, k] over E experts.
std::vector<int32_t> random_top(int64_t N, int64_t k, int64_t E) {
  std::vector<int32_t> top(static_cast<size_t>(N * k)), perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < N; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), testing::test_rng());
    std::copy(perm.begin(), perm.begin() + k, top.begin() + t * k);
  }
  return top;
}

// ---- routing -------------------------------------------------------------------------------------

struct RouteCase {
  int64_t E, k;
  bool sigmoid, pre_softmax, bias;
  int64_t groups, group_topk;
  float scaling;
  bool ties;  ///< logits on a coarse grid: many exact ties
  std::string str() const {
    return fmt::format("E={} k={} {}{}{} groups={}/{} scaling={} ties={}", E, k, sigmoid ? "sigmoid" : "softmax",
                       pre_softmax ? " pre" : "", bias ? " bias" : "", groups, group_topk, scaling, ties);
  }
};

struct RouteOut {
  std::vector<float> probs, aux, d_logits;
  std::vector<int32_t> top;
};

RouteOut run_routing(Device dev, const RouteCase& c, const MoeRouterOptions& o, const std::vector<float>& logits,
                     const std::vector<float>& bias, const std::vector<float>& d_probs, int64_t T) {
  Stream s(dev);
  auto l = make_tensor(logits, DType::kF32, dev, {T, c.E}, s);
  OwnedTensor b;
  if (c.bias) b = make_tensor(bias, DType::kF32, dev, {c.E}, s);
  auto dp = make_tensor(d_probs, DType::kF32, dev, {T, c.k}, s);
  OwnedTensor probs(DType::kF32, dev, {T, c.k}), top(DType::kI32, dev, {T, c.k}), aux(DType::kF32, dev, {T, c.E}),
      dl(DType::kF32, dev, {T, c.E});
  poison(probs, s);
  poison(aux, s);
  poison(dl, s);
  fill_ints(top, -7, s);
  const Tensor bias_t = c.bias ? b.t : Tensor();
  if (dev.is_cpu()) {
    cpu::moe_topk_routing(probs, top, aux, l, bias_t, o, s);
    cpu::moe_topk_routing_backward(dl, dp, l, top, o, s);
  } else {
    cuda::moe_topk_routing(probs, top, aux, l, bias_t, o, s);
    cuda::moe_topk_routing_backward(dl, dp, l, top, o, s);
  }
  return {to_host(probs, s), to_host(aux, s), to_host(dl, s), ints(top, s)};
}

TEST(MoeCuda, TopkRoutingMatchesCpu) {
  MT_REQUIRE_CUDA();
  const RouteCase cases[] = {
      {64, 8, false, false, false, 0, 0, 1.f, false},  // softmax after top-k
      {8, 2, false, false, false, 0, 0, 1.f, false},
      {8, 1, false, false, false, 0, 0, 1.f, false},   // k = 1
      {64, 8, false, true, false, 0, 0, 1.f, false},   // pre-softmax
      {8, 2, false, true, false, 0, 0, 2.5f, false},
      {64, 8, true, false, false, 0, 0, 1.f, false},   // sigmoid
      {64, 8, true, false, true, 0, 0, 2.5f, false},   // sigmoid + expert bias, scaling
      {8, 1, true, false, true, 0, 0, 1.f, false},     // sigmoid k = 1: not normalised
      {8, 2, true, false, true, 0, 0, 1.f, false},
      {64, 8, true, false, true, 8, 4, 2.5f, false},   // group-limited (DeepSeek-V3 style)
      {256, 8, true, false, true, 8, 4, 2.5f, false},  // DeepSeek-V3's shape
      {64, 6, false, true, false, 4, 2, 1.f, false},   // group-limited pre-softmax
      {64, 8, false, false, false, 16, 4, 1.f, false}, // group-limited softmax on logits
      {64, 8, false, false, false, 0, 0, 1.f, true},   // exact ties
      {64, 8, false, true, false, 0, 0, 1.f, true},
      {64, 8, true, false, true, 8, 4, 1.f, true},
      {40, 6, false, true, false, 0, 0, 1.f, false},   // E not a multiple of 32
      {300, 3, true, false, false, 0, 0, 1.f, false},
      {64, 40, false, false, false, 0, 0, 1.f, false}, // k > 32
      {8, 8, true, false, true, 0, 0, 1.f, false},     // k = E
      {2048, 4, false, true, false, 0, 0, 1.f, false}, // large E: fewer warps per block
  };
  const int64_t T = 517;
  for (const RouteCase& c : cases) {
    SCOPED_TRACE(c.str());
    MoeRouterOptions o;
    o.topk = c.k;
    o.sigmoid = c.sigmoid;
    o.pre_softmax = c.pre_softmax;
    o.scaling_factor = c.scaling;
    o.num_groups = c.groups;
    o.group_topk = c.group_topk;
    auto logits = testing::randn(T * c.E, 2.f);
    if (c.ties)
      for (auto& v : logits) v = std::round(v * 2.f) / 2.f;  // a few distinct values per row
    auto bias = testing::randn(c.E, 0.1f);
    if (c.ties)
      for (auto& v : bias) v = 0.f;
    const auto d_probs = testing::randn(T * c.k);
    const RouteOut ref = run_routing(kCpu, c, o, logits, bias, d_probs, T);
    const RouteOut got = run_routing(Device::cuda(), c, o, logits, bias, d_probs, T);
    const RouteOut again = run_routing(Device::cuda(), c, o, logits, bias, d_probs, T);
    EXPECT_EQ(got.top, ref.top);
    EXPECT_LT(rel_err(got.probs, ref.probs), 1e-6);
    EXPECT_LT(rel_err(got.aux, ref.aux), 1e-6);
    EXPECT_LT(rel_err(got.d_logits, ref.d_logits), 1e-6);
    EXPECT_TRUE(testing::all_finite(got.d_logits));
    EXPECT_TRUE(same_bits(got.probs, again.probs) && same_bits(got.top, again.top) &&
                same_bits(got.aux, again.aux) && same_bits(got.d_logits, again.d_logits));
  }
}

// ---- --moe-router-dtype fp64 ---------------------------------------------------------------------

/// ||a - b|| / ||b|| in double.
double rel_err_d(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

/// fp64 logits with bits below fp32's resolution (an fp32 round trip would show at 1e-12).
std::vector<double> fp64_values(int64_t n, float stddev) {
  const auto a = testing::randn(n, stddev), b = testing::randn(n);
  std::vector<double> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(a[i]) + 1e-9 * static_cast<double>(b[i]);
  return v;
}

// Routing, its backward, the aux-loss scores' gradient and the z-loss with fp64 logits: CUDA
// against the CPU (the same double formulas; exp / log differ by an ulp at most), the selections
// identical, repeat runs bitwise equal.
TEST(MoeCuda, Fp64RoutingMatchesCpu) {
  MT_REQUIRE_CUDA();
  const RouteCase cases[] = {
      {64, 8, false, false, false, 0, 0, 1.f, false}, {8, 1, false, false, false, 0, 0, 1.f, false},
      {64, 8, false, true, false, 0, 0, 2.5f, false}, {64, 8, true, false, true, 0, 0, 2.5f, false},
      {8, 1, true, false, true, 0, 0, 1.f, false},    {256, 8, true, false, true, 8, 4, 2.5f, false},
      {64, 8, false, false, false, 16, 4, 1.f, false}, {64, 8, false, true, false, 0, 0, 1.f, true},
      {64, 40, false, false, false, 0, 0, 1.f, false}, {2048, 4, false, true, false, 0, 0, 1.f, false},
  };
  const int64_t T = 517;
  for (const RouteCase& c : cases) {
    SCOPED_TRACE(c.str());
    MoeRouterOptions o;
    o.topk = c.k;
    o.sigmoid = c.sigmoid;
    o.pre_softmax = c.pre_softmax;
    o.scaling_factor = c.scaling;
    o.num_groups = c.groups;
    o.group_topk = c.group_topk;
    auto logits = fp64_values(T * c.E, 2.f);
    if (c.ties)
      for (auto& v : logits) v = std::round(v * 2.0) / 2.0;
    const auto bias = testing::randn(c.E, 0.1f);
    const auto d_probs = testing::randn(T * c.k);
    auto tpe = testing::randu(c.E, 0.f, 50.f);
    for (auto& v : tpe) v = std::round(v);
    const auto dl0 = fp64_values(T * c.E, 1.f);
    struct Out {
      std::vector<float> probs, aux_loss, z_loss;
      std::vector<int32_t> top;
      std::vector<double> aux, d_logits, d_losses;
    };
    auto run = [&](Device dev) {
      Stream s(dev);
      auto l = testing::make_tensor_f64(logits, dev, {T, c.E}, s);
      OwnedTensor b;
      if (c.bias) b = make_tensor(bias, DType::kF32, dev, {c.E}, s);
      auto dp = make_tensor(d_probs, DType::kF32, dev, {T, c.k}, s);
      auto tp = make_tensor(tpe, DType::kF32, dev, {c.E}, s);
      auto lsc = make_tensor({512.f}, DType::kF32, dev, {1}, s);
      auto la = make_tensor({0.25f}, DType::kF32, dev, {1}, s);
      auto lz = make_tensor({0.5f}, DType::kF32, dev, {1}, s);
      auto dls = testing::make_tensor_f64(dl0, dev, {T, c.E}, s);
      OwnedTensor probs(DType::kF32, dev, {T, c.k}), top(DType::kI32, dev, {T, c.k}), aux(DType::kF64, dev, {T, c.E}),
          dl(DType::kF64, dev, {T, c.E});
      poison(probs, s);
      poison(aux, s);
      poison(dl, s);
      fill_ints(top, -7, s);
      const Tensor bias_t = c.bias ? b.t : Tensor();
      const float scale = 0.37f / static_cast<float>(T);
      if (dev.is_cpu()) {
        cpu::moe_topk_routing(probs, top, aux, l, bias_t, o, s);
        cpu::moe_topk_routing_backward(dl, dp, l, top, o, s);
        cpu::moe_aux_loss(la, aux, tp, scale, s);
        cpu::moe_aux_scores_backward(dls, l, tp, scale, lsc, c.sigmoid, s);
        cpu::moe_z_loss(lz, dls, l, scale, lsc, s);
      } else {
        cuda::moe_topk_routing(probs, top, aux, l, bias_t, o, s);
        cuda::moe_topk_routing_backward(dl, dp, l, top, o, s);
        cuda::moe_aux_loss(la, aux, tp, scale, s);
        cuda::moe_aux_scores_backward(dls, l, tp, scale, lsc, c.sigmoid, s);
        cuda::moe_z_loss(lz, dls, l, scale, lsc, s);
      }
      return Out{to_host(probs, s),
                 to_host(la, s),
                 to_host(lz, s),
                 ints(top, s),
                 testing::to_host_f64(aux, s),
                 testing::to_host_f64(dl, s),
                 testing::to_host_f64(dls, s)};
    };
    const Out ref = run(kCpu), got = run(Device::cuda()), again = run(Device::cuda());
    EXPECT_EQ(got.top, ref.top);
    EXPECT_LT(rel_err(got.probs, ref.probs), 1e-7);  // the double probabilities rounded once to fp32
    EXPECT_LT(rel_err_d(got.aux, ref.aux), 1e-13);
    EXPECT_LT(rel_err_d(got.d_logits, ref.d_logits), 1e-13);
    EXPECT_LT(rel_err_d(got.d_losses, ref.d_losses), 1e-13);
    EXPECT_LT(rel_err(got.aux_loss, ref.aux_loss), 1e-6);  // double sums stored in fp32
    EXPECT_LT(rel_err(got.z_loss, ref.z_loss), 1e-6);
    EXPECT_TRUE(same_bits(got.probs, again.probs) && same_bits(got.top, again.top) && same_bits(got.aux, again.aux) &&
                same_bits(got.d_logits, again.d_logits) && same_bits(got.d_losses, again.d_losses) &&
                same_bits(got.aux_loss, again.aux_loss) && same_bits(got.z_loss, again.z_loss));
  }
}

// The fp64 router GEMM and its backward: CUDA (fp32, bf16 and fp16 inputs) against the CPU on the
// same rounded values; sums in double in the same order, so equal to ~1e-15.
TEST(MoeCuda, Fp64RouterGemmMatchesCpu) {
  MT_REQUIRE_CUDA();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const auto& [T, h, E] : {std::tuple<int64_t, int64_t, int64_t>{517, 64, 8}, {40, 4096, 64}, {3, 17, 5}}) {
      SCOPED_TRACE(fmt::format("{} T={} h={} E={}", dtype_name(dt), T, h, E));
      const auto xv = testing::rounded(testing::randn(T * h), dt), wv = testing::rounded(testing::randn(E * h, 0.1f), dt);
      const auto dxv = testing::rounded(testing::randn(T * h), dt), dwv = testing::randn(E * h);
      const auto dl = fp64_values(T * E, 1e-3f);
      struct Out {
        std::vector<double> logits;
        std::vector<float> dx, dw;
      };
      auto run = [&](Device dev, DType t) {
        Stream s(dev);
        auto x = make_tensor(xv, t, dev, {T, h}, s);
        auto w = make_tensor(wv, t, dev, {E, h}, s);
        auto dx = make_tensor(dxv, t, dev, {T, h}, s);
        auto dw = make_tensor(dwv, DType::kF32, dev, {E, h}, s);
        auto dlt = testing::make_tensor_f64(dl, dev, {T, E}, s);
        OwnedTensor logits(DType::kF64, dev, {T, E});
        poison(logits, s);
        if (dev.is_cpu()) {
          cpu::moe_router_logits_fp64(logits, x, w, s);
          cpu::moe_router_logits_fp64_backward(dx, dw, dlt, x, w, s);
        } else {
          cuda::moe_router_logits_fp64(logits, x, w, s);
          cuda::moe_router_logits_fp64_backward(dx, dw, dlt, x, w, s);
        }
        return Out{testing::to_host_f64(logits, s), to_host(dx, s), to_host(dw, s)};
      };
      const Out ref = run(kCpu, DType::kF32), got = run(Device::cuda(), dt), again = run(Device::cuda(), dt);
      EXPECT_LT(rel_err_d(got.logits, ref.logits), 1e-14);
      // dx is rounded once to its dtype (the CPU's to fp32), dw once to fp32
      EXPECT_LT(rel_err(got.dx, testing::rounded(ref.dx, dt)), dt == DType::kF32 ? 1e-7 : 4e-3);
      EXPECT_LT(rel_err(got.dw, ref.dw), 1e-7);
      EXPECT_TRUE(same_bits(got.logits, again.logits) && same_bits(got.dx, again.dx) && same_bits(got.dw, again.dw));
    }
  }
}

// --moe-shared-expert-gate: the gate's forward (logits, y) and backward (d ys, d logits, dx, dw),
// CUDA (fp32, bf16, fp16) against the CPU on the same rounded inputs; repeat runs bitwise equal.
TEST(MoeCuda, SharedGateMatchesCpu) {
  MT_REQUIRE_CUDA();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const auto& [T, h] : {std::pair<int64_t, int64_t>{517, 64}, {33, 4096}, {5, 7}}) {
      SCOPED_TRACE(fmt::format("{} T={} h={}", dtype_name(dt), T, h));
      const auto y0 = testing::rounded(testing::randn(T * h), dt), ys = testing::rounded(testing::randn(T * h), dt),
                 dy = testing::rounded(testing::randn(T * h), dt), xv = testing::rounded(testing::randn(T * h), dt),
                 wv = testing::rounded(testing::randn(h, 0.1f), dt), dx0 = testing::rounded(testing::randn(T * h), dt),
                 dw0 = testing::randn(h);
      struct Out {
        std::vector<float> y, l, d_ys, d_l, dx, dw;
      };
      auto run = [&](Device dev, DType t) {
        Stream s(dev);
        auto y = make_tensor(y0, t, dev, {T, h}, s);
        auto yst = make_tensor(ys, t, dev, {T, h}, s);
        auto dyt = make_tensor(dy, t, dev, {T, h}, s);
        auto x = make_tensor(xv, t, dev, {T, h}, s);
        auto w = make_tensor(wv, t, dev, {1, h}, s);
        auto dx = make_tensor(dx0, t, dev, {T, h}, s);
        auto dw = make_tensor(dw0, DType::kF32, dev, {1, h}, s);
        OwnedTensor l(DType::kF32, dev, {T}), dys(t, dev, {T, h}), dl(DType::kF32, dev, {T});
        poison(l, s);
        poison(dys, s);
        poison(dl, s);
        if (dev.is_cpu()) {
          cpu::moe_shared_gate_forward(y, l, yst, x, w, s);
          cpu::moe_shared_gate_backward(dys, dl, dx, dw, dyt, yst, x, w, l, s);
        } else {
          cuda::moe_shared_gate_forward(y, l, yst, x, w, s);
          cuda::moe_shared_gate_backward(dys, dl, dx, dw, dyt, yst, x, w, l, s);
        }
        return Out{to_host(y, s), to_host(l, s), to_host(dys, s), to_host(dl, s), to_host(dx, s), to_host(dw, s)};
      };
      const Out ref = run(kCpu, DType::kF32), got = run(Device::cuda(), dt), again = run(Device::cuda(), dt);
      const double tol = dt == DType::kF32 ? 1e-6 : 1e-2;  // bf16 / fp16: one rounding of the outputs
      EXPECT_LT(rel_err(got.l, ref.l), 1e-6);              // from the same rounded inputs, sums in double
      EXPECT_LT(rel_err(got.y, ref.y), tol);
      EXPECT_LT(rel_err(got.d_ys, ref.d_ys), tol);
      EXPECT_LT(rel_err(got.d_l, ref.d_l), 1e-6);
      EXPECT_LT(rel_err(got.dx, ref.dx), tol);
      EXPECT_LT(rel_err(got.dw, ref.dw), 1e-6);
      EXPECT_TRUE(same_bits(got.y, again.y) && same_bits(got.l, again.l) && same_bits(got.d_ys, again.d_ys) &&
                  same_bits(got.d_l, again.d_l) && same_bits(got.dx, again.dx) && same_bits(got.dw, again.dw));
      // --moe-shared-expert-overlap's split: the backward without dx, then its dx part alone, gives the
      // whole backward's bits
      {
        Stream s(Device::cuda());
        auto yst = make_tensor(ys, dt, Device::cuda(), {T, h}, s);
        auto dyt = make_tensor(dy, dt, Device::cuda(), {T, h}, s);
        auto x = make_tensor(xv, dt, Device::cuda(), {T, h}, s);
        auto w = make_tensor(wv, dt, Device::cuda(), {1, h}, s);
        auto dx = make_tensor(dx0, dt, Device::cuda(), {T, h}, s);
        auto dw = make_tensor(dw0, DType::kF32, Device::cuda(), {1, h}, s);
        auto l = make_tensor(got.l, DType::kF32, Device::cuda(), {T}, s);
        OwnedTensor dys(dt, Device::cuda(), {T, h}), dl(DType::kF32, Device::cuda(), {T});
        moe_shared_gate_backward(dys, dl, Tensor(), dw, dyt, yst, x, w, l, s);
        moe_shared_gate_backward_dx(dx, dl, w, s);
        EXPECT_TRUE(same_bits(to_host(dys, s), got.d_ys) && same_bits(to_host(dl, s), got.d_l) &&
                    same_bits(to_host(dx, s), got.dx) && same_bits(to_host(dw, s), got.dw))
            << "the split backward differs from the whole";
      }
    }
  }
}

// ---- losses --------------------------------------------------------------------------------------

// global_aux_loss's count accumulator: three forwards' counts, the running mean, bitwise as the CPU.
TEST(MoeCuda, GlobalTokensPerExpertMatchesCpu) {
  const int64_t E = 37;
  std::vector<std::vector<float>> result;
  for (const Device dev : {Device::cpu(), Device::cuda()}) {
    Stream s(dev);
    OwnedTensor acc(DType::kF32, dev, {E + 1}), avg(DType::kF32, dev, {E});
    fill(acc.t, 0.f, s);
    std::vector<float> all;
    for (int f = 0; f < 3; ++f) {
      std::vector<float> counts(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) counts[static_cast<size_t>(e)] = static_cast<float>((e * 7 + f * 13) % 29);
      auto c = make_tensor(counts, DType::kF32, dev, {E}, s);
      moe_global_tokens_per_expert(avg.t, acc.t, c.t, s);
      const auto a = to_host(avg.t, s);
      all.insert(all.end(), a.begin(), a.end());
    }
    const auto a = to_host(acc.t, s);
    all.insert(all.end(), a.begin(), a.end());
    result.push_back(all);
  }
  ASSERT_EQ(result[0].size(), result[1].size());
  for (size_t i = 0; i < result[0].size(); ++i) EXPECT_EQ(result[0][i], result[1][i]) << i;
  EXPECT_EQ(result[1].back(), 3.f);  // forwards counted
}

TEST(MoeCuda, AuxLossAndZLossMatchCpu) {
  MT_REQUIRE_CUDA();
  for (int64_t T : {1, 333, 20000, 336}) {
    for (int64_t E : {8, 64, 100}) {
      for (bool sigmoid : {false, true}) {
        for (bool with_scale : {false, true}) {
          // G = 4 token groups (the per-sequence counts of sequence_load_balancing_loss_func) when T allows.
          const int64_t G = T % 4 == 0 ? 4 : 1;
          SCOPED_TRACE(fmt::format("T={} E={} G={} sigmoid={} loss_scale={}", T, E, G, sigmoid, with_scale));
          const auto logits = testing::randn(T * E, 2.f);
          auto scores = testing::randu(T * E, 0.f, 1.f);
          auto tpe = testing::randu(G * E, 0.f, 50.f);
          for (auto& v : tpe) v = std::round(v);
          const auto loss0 = testing::randu(2, 0.5f, 1.5f);
          const auto dl0 = testing::randn(T * E);
          const float scale = 0.37f / static_cast<float>(T), ls = 1024.f;
          struct Out {
            std::vector<float> aux_loss, z_loss, d_aux, d_z, d_both, z_both;
          };
          auto run = [&](Device dev) {
            Stream s(dev);
            auto l = make_tensor(logits, DType::kF32, dev, {T, E}, s);
            auto sc = make_tensor(scores, DType::kF32, dev, {T, E}, s);
            auto c = make_tensor(tpe, DType::kF32, dev, G == 1 ? std::vector<int64_t>{E} : std::vector<int64_t>{G, E}, s);
            auto lsc = make_tensor({ls}, DType::kF32, dev, {1}, s);
            const Tensor lst = with_scale ? lsc.t : Tensor();
            auto la = make_tensor({loss0[0]}, DType::kF32, dev, {1}, s);
            auto lz = make_tensor({loss0[1]}, DType::kF32, dev, {1}, s);
            auto lz2 = make_tensor({loss0[1]}, DType::kF32, dev, {1}, s);
            auto da = make_tensor(dl0, DType::kF32, dev, {T, E}, s);
            auto dz = make_tensor(dl0, DType::kF32, dev, {T, E}, s);
            auto db = make_tensor(dl0, DType::kF32, dev, {T, E}, s);
            if (dev.is_cpu()) {
              cpu::moe_aux_loss(la, sc, c, scale, s);
              cpu::moe_aux_scores_backward(da, l, c, scale, lst, sigmoid, s);
              cpu::moe_z_loss(lz, Tensor(), l, scale, lst, s);
              cpu::moe_z_loss(Tensor(), dz, l, scale, lst, s);
              cpu::moe_z_loss(lz2, db, l, scale, lst, s);
            } else {
              cuda::moe_aux_loss(la, sc, c, scale, s);
              cuda::moe_aux_scores_backward(da, l, c, scale, lst, sigmoid, s);
              cuda::moe_z_loss(lz, Tensor(), l, scale, lst, s);
              cuda::moe_z_loss(Tensor(), dz, l, scale, lst, s);
              cuda::moe_z_loss(lz2, db, l, scale, lst, s);
            }
            return Out{to_host(la, s), to_host(lz, s), to_host(da, s), to_host(dz, s), to_host(db, s),
                       to_host(lz2, s)};
          };
          const Out ref = run(kCpu), got = run(Device::cuda()), again = run(Device::cuda());
          EXPECT_LT(rel_err(got.aux_loss, ref.aux_loss), 1e-5);
          EXPECT_LT(rel_err(got.z_loss, ref.z_loss), 1e-5);
          EXPECT_LT(rel_err(got.z_both, ref.z_both), 1e-5);
          // The gradients accumulate into random d_logits (the increments alone: the next test).
          EXPECT_LT(rel_err(got.d_aux, ref.d_aux), 1e-5);
          EXPECT_LT(rel_err(got.d_z, ref.d_z), 1e-5);
          EXPECT_TRUE(same_bits(got.d_z, got.d_both));
          EXPECT_TRUE(same_bits(got.aux_loss, again.aux_loss) && same_bits(got.z_loss, again.z_loss) &&
                      same_bits(got.d_aux, again.d_aux) && same_bits(got.d_z, again.d_z) &&
                      same_bits(got.z_both, again.z_both));
        }
      }
    }
  }
}

TEST(MoeCuda, AuxLossGradientIncrementsMatchCpu) {
  // The increments alone (d_logits starting at 0), at the 1e-5 of the op contract.
  MT_REQUIRE_CUDA();
  const int64_t T = 1000, E = 64;
  for (bool sigmoid : {false, true}) {
    SCOPED_TRACE(sigmoid ? "sigmoid" : "softmax");
    const auto logits = testing::randn(T * E, 2.f);
    auto tpe = testing::randu(E, 0.f, 200.f);
    std::vector<std::vector<float>> out;
    for (Device dev : {kCpu, Device::cuda()}) {
      Stream s(dev);
      auto l = make_tensor(logits, DType::kF32, dev, {T, E}, s);
      auto c = make_tensor(tpe, DType::kF32, dev, {E}, s);
      auto lsc = make_tensor({8.f}, DType::kF32, dev, {1}, s);
      auto da = make_tensor(std::vector<float>(T * E, 0.f), DType::kF32, dev, {T, E}, s);
      auto dz = make_tensor(std::vector<float>(T * E, 0.f), DType::kF32, dev, {T, E}, s);
      if (dev.is_cpu()) {
        cpu::moe_aux_scores_backward(da, l, c, 1e-3f, lsc, sigmoid, s);
        cpu::moe_z_loss(Tensor(), dz, l, 1e-3f, lsc, s);
      } else {
        cuda::moe_aux_scores_backward(da, l, c, 1e-3f, lsc, sigmoid, s);
        cuda::moe_z_loss(Tensor(), dz, l, 1e-3f, lsc, s);
      }
      out.push_back(to_host(da, s));
      out.push_back(to_host(dz, s));
    }
    EXPECT_LT(rel_err(out[2], out[0]), 1e-5);
    EXPECT_LT(rel_err(out[3], out[1]), 1e-5);
  }
}

TEST(MoeCuda, TokensPerExpertMatchesCpu) {
  MT_REQUIRE_CUDA();
  struct Case {
    int64_t E, G;
  };
  for (const Case& c : {Case{8, 1}, Case{64, 1}, Case{256, 1}, Case{20000, 1}, Case{64, 4}, Case{256, 12}}) {
    const int64_t N = 3000, k = std::min<int64_t>(8, c.E);
    const auto top = random_top(N, k, c.E);
    const std::vector<int64_t> shape = c.G == 1 ? std::vector<int64_t>{c.E} : std::vector<int64_t>{c.G, c.E};
    std::vector<std::vector<float>> out;
    for (Device dev : {kCpu, Device::cuda(), Device::cuda()}) {
      Stream s(dev);
      auto t = make_int_tensor(top, dev, {N, k}, s);
      OwnedTensor counts(DType::kF32, dev, shape);
      poison(counts, s);
      if (dev.is_cpu()) {
        cpu::moe_tokens_per_expert(counts, t, s);
      } else {
        cuda::moe_tokens_per_expert(counts, t, s);
      }
      out.push_back(to_host(counts, s));
    }
    EXPECT_EQ(out[1], out[0]) << "E=" << c.E << " G=" << c.G;
    EXPECT_TRUE(same_bits(out[1], out[2])) << "E=" << c.E << " G=" << c.G;
  }
}

TEST(MoeCuda, ExpertBiasUpdateMatchesCpu) {
  MT_REQUIRE_CUDA();
  for (int64_t E : {8, 64, 256, 1000}) {
    auto tpe = testing::randu(E, 0.f, 100.f);
    for (auto& v : tpe) v = std::round(v);
    // Some experts exactly at the mean: sign 0, the bias stays.
    const float mean = std::accumulate(tpe.begin(), tpe.end(), 0.0) / static_cast<double>(E);
    if (mean == std::round(mean)) tpe[1] = mean;
    const auto bias = testing::randn(E, 0.1f);
    std::vector<std::vector<float>> out;
    for (Device dev : {kCpu, Device::cuda(), Device::cuda()}) {
      Stream s(dev);
      auto b = make_tensor(bias, DType::kF32, dev, {E}, s);
      auto c = make_tensor(tpe, DType::kF32, dev, {E}, s);
      if (dev.is_cpu()) {
        cpu::moe_expert_bias_update(b, c, 1e-3f, s);
      } else {
        cuda::moe_expert_bias_update(b, c, 1e-3f, s);
      }
      out.push_back(to_host(b, s));
    }
    EXPECT_TRUE(same_bits(out[1], out[0])) << "E=" << E;  // the same float operations
    EXPECT_TRUE(same_bits(out[1], out[2])) << "E=" << E;
  }
}

// ---- routing map ---------------------------------------------------------------------------------

struct MapOut {
  std::vector<int64_t> host;
  std::vector<int32_t> row_index, slot_row, counts;
};

MapOut run_map(Device dev, const std::vector<int32_t>& top, int64_t N, int64_t k, int64_t first, int64_t L,
               int64_t cap) {
  Stream s(dev);
  auto t = make_int_tensor(top, dev, {N, k}, s);
  OwnedTensor ri(DType::kI32, dev, {cap}), sr(DType::kI32, dev, {N * k}), c(DType::kI32, dev, {L});
  fill_ints(ri, -5, s);
  fill_ints(sr, -5, s);
  fill_ints(c, -5, s);
  MapOut o;
  o.host = dev.is_cpu() ? cpu::moe_routing_map(ri, sr, c, t, first, L, s) : cuda::moe_routing_map(ri, sr, c, t, first, L, s);
  o.row_index = ints(ri, s);
  o.slot_row = ints(sr, s);
  o.counts = ints(c, s);
  return o;
}

TEST(MoeCuda, RoutingMapMatchesCpu) {
  MT_REQUIRE_CUDA();
  struct Case {
    int64_t N, k, E, first, L;
  };
  const Case cases[] = {
      {1000, 2, 8, 0, 8},         // all experts local
      {1000, 2, 8, 2, 3},         // a local range inside E
      {5, 2, 64, 0, 64},          // fewer slots than local experts (single fused block)
      {2048, 2, 16, 4, 4},        // exactly one chunk
      {2049, 2, 16, 4, 4},        // one slot more: the multi-block path
      {16384, 8, 64, 16, 16},     // N·k = 2^17: the scan path
      {16384, 8, 256, 0, 256},    // 2^17 slots over 256 local experts
      {32768, 4, 64, 63, 1},      // one local expert
      {40000, 6, 384, 100, 300},  // ragged sizes
      {3000, 2, 4000, 0, 4000},   // local experts beyond the default shared memory
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("N={} k={} E={} local=[{}, {})", c.N, c.k, c.E, c.first, c.first + c.L));
    const auto top = random_top(c.N, c.k, c.E);
    const int64_t cap = c.N * c.k;
    const MapOut ref = run_map(kCpu, top, c.N, c.k, c.first, c.L, cap);
    const MapOut got = run_map(Device::cuda(), top, c.N, c.k, c.first, c.L, cap);
    const MapOut again = run_map(Device::cuda(), top, c.N, c.k, c.first, c.L, cap);
    const int64_t R = std::accumulate(ref.host.begin(), ref.host.end(), int64_t{0});
    EXPECT_EQ(got.host, ref.host);
    EXPECT_EQ(got.counts, ref.counts);
    EXPECT_EQ(got.slot_row, ref.slot_row);
    EXPECT_TRUE(std::equal(got.row_index.begin(), got.row_index.begin() + R, ref.row_index.begin()));
    EXPECT_TRUE(same_bits(got.row_index, again.row_index) && same_bits(got.slot_row, again.slot_row) &&
                same_bits(got.counts, again.counts));
  }
}

TEST(MoeCuda, RoutingMapRejectsTooFewRows) {
  MT_REQUIRE_CUDA();
  const int64_t N = 5000, k = 2, E = 8;
  const auto top = random_top(N, k, E);
  for (Device dev : {kCpu, Device::cuda()}) {
    EXPECT_THROW(run_map(dev, top, N, k, 0, E, N * k - 1), Error) << dev.str();
    EXPECT_NO_THROW(run_map(dev, top, N, k, 0, E, N * k)) << dev.str();
  }
}

// The sync-free routing map: the CUDA maps equal the CPU's, the unused planned rows -1 on both,
// and moe_permute leaves those rows untouched; the CUDA call is captured in a CUDA graph
// (capture fails on any host synchronisation).
TEST(MoeCuda, DeviceRoutingMapMatchesCpuAndIsCapturable) {
  MT_REQUIRE_CUDA();
  struct Case {
    int64_t N, k, E, first, L;
  };
  const Case cases[] = {{5, 2, 64, 0, 64}, {1000, 2, 8, 2, 3}, {2049, 2, 16, 4, 4}, {16384, 8, 64, 16, 16}};
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("N={} k={} E={} local=[{}, {})", c.N, c.k, c.E, c.first, c.first + c.L));
    const auto top = random_top(c.N, c.k, c.E);
    const int64_t cap = c.N * c.k + 77;
    MapOut o[2];
    for (int d = 0; d < 2; ++d) {
      const Device dev = d == 0 ? kCpu : Device::cuda();
      Stream s(dev);
      auto t = make_int_tensor(top, dev, {c.N, c.k}, s);
      OwnedTensor ri(DType::kI32, dev, {cap}), sr(DType::kI32, dev, {c.N * c.k}), cn(DType::kI32, dev, {c.L});
      fill_ints(ri, -5, s);
      fill_ints(sr, -5, s);
      fill_ints(cn, -5, s);
      if (dev.is_cpu()) {
        cpu::moe_routing_map_device(ri, sr, cn, t, c.first, c.L, s);
      } else {
        cudaStream_t cs = static_cast<cudaStream_t>(s.cuda_stream());
        cudaGraph_t graph = nullptr;
        ASSERT_EQ(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal), cudaSuccess);
        cuda::moe_routing_map_device(ri, sr, cn, t, c.first, c.L, s);
        ASSERT_EQ(cudaStreamEndCapture(cs, &graph), cudaSuccess) << "the routing map synchronised with the host";
        cudaGraphExec_t exec = nullptr;
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        ASSERT_EQ(cudaGraphLaunch(exec, cs), cudaSuccess);
        s.synchronize();
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      }
      o[d].row_index = ints(ri, s);
      o[d].slot_row = ints(sr, s);
      o[d].counts = ints(cn, s);
      // permute over all cap rows: the -1 rows keep their poison
      const auto xv = testing::randn(c.N * 8);
      auto x = make_tensor(xv, DType::kBF16, dev, {c.N, 8}, s);
      OwnedTensor xp(DType::kBF16, dev, {cap, 8});
      poison(xp, s);
      if (dev.is_cpu()) continue;  // the CPU backend is fp32 only (the CPU permute: moe_test)
      cuda::moe_permute(xp, x, ri, c.k, s);
      const auto got = to_host(xp, s), xr = to_host(x, s);
      int64_t R = 0;
      for (int32_t v : o[d].counts) R += v;
      for (int64_t r = 0; r < cap; ++r) {
        if (r < R) {
          const int64_t tok = o[d].row_index[static_cast<size_t>(r)] / c.k;
          ASSERT_EQ(got[r * 8], xr[tok * 8]) << r;
        } else {
          ASSERT_TRUE(std::isnan(got[r * 8])) << "row " << r << " beyond the routed " << R << " was written";
        }
      }
    }
    EXPECT_EQ(o[1].counts, o[0].counts);
    EXPECT_EQ(o[1].slot_row, o[0].slot_row);
    EXPECT_EQ(o[1].row_index, o[0].row_index);
  }
}

// ---- permutation ---------------------------------------------------------------------------------

struct PermOut {
  std::vector<float> rows, dx, y, d_rows, d_probs;
};

/// permute, unpermute (rows = expert outputs), unpermute_backward, permute_backward with maps from
/// the CPU routing map; activations of `dt` (the CPU reference: fp32 on the same rounded values).
PermOut run_perm(Device dev, DType dt, const std::vector<int32_t>& row_index, const std::vector<int32_t>& slot_row,
                 int64_t R, int64_t N, int64_t k, int64_t h, const std::vector<float>& x,
                 const std::vector<float>& out, const std::vector<float>& probs, const std::vector<float>& dy,
                 const std::vector<float>& d_rows_in, int64_t offset) {
  Stream s(dev);
  auto ri = make_int_tensor(row_index, dev, {static_cast<int64_t>(row_index.size())}, s);
  auto sr = make_int_tensor(slot_row, dev, {N * k}, s);
  auto p = make_tensor(probs, DType::kF32, dev, {N, k}, s);
  // Activations as views at `offset` elements into their buffers (offset 1: not 16-byte aligned).
  std::vector<OwnedTensor> keep;
  auto act = [&](const std::vector<float>& v, int64_t rows) {
    std::vector<float> buf(static_cast<size_t>(offset), 0.f);
    buf.insert(buf.end(), v.begin(), v.end());
    if (buf.empty()) buf.push_back(0.f);
    keep.push_back(make_tensor(buf, dt, dev, {static_cast<int64_t>(buf.size())}, s));
    return keep.back().t.flat_range(offset, rows * h).view({rows, h});
  };
  auto blank = [&](int64_t rows) {
    keep.emplace_back(dt, dev, std::vector<int64_t>{rows * h + offset + 1});
    poison(keep.back(), s);
    return keep.back().t.flat_range(offset, rows * h).view({rows, h});
  };
  const Tensor xt = act(x, N), ot = act(out, R), dyt = act(dy, N), drin = act(d_rows_in, R);
  const Tensor rows = blank(R), y = blank(N), d_rows = blank(R), dx = blank(N);
  OwnedTensor dp(DType::kF32, dev, {N, k});
  poison(dp, s);
  if (dev.is_cpu()) {
    cpu::moe_permute(rows, xt, ri, k, s);
    cpu::moe_unpermute(y, ot, p, sr, s);
    cpu::moe_unpermute_backward(d_rows, dp, dyt, ot, p, ri, sr, s);
    cpu::moe_permute_backward(dx, drin, sr, k, s);
  } else {
    cuda::moe_permute(rows, xt, ri, k, s);
    cuda::moe_unpermute(y, ot, p, sr, s);
    cuda::moe_unpermute_backward(d_rows, dp, dyt, ot, p, ri, sr, s);
    cuda::moe_permute_backward(dx, drin, sr, k, s);
  }
  return {to_host(rows, s), to_host(dx, s), to_host(y, s), to_host(d_rows, s), to_host(dp, s)};
}

TEST(MoeCuda, PermuteUnpermuteMatchCpu) {
  MT_REQUIRE_CUDA();
  const int64_t N = 300, k = 4, E = 16, first = 4, L = 8;
  const auto top = random_top(N, k, E);
  const MapOut map = run_map(kCpu, top, N, k, first, L, N * k);
  const int64_t R = std::accumulate(map.host.begin(), map.host.end(), int64_t{0});
  ASSERT_GT(R, 0);
  ASSERT_LT(R, N * k);  // some slots belong to other experts
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t h : {64, 1000, 1001, 4096}) {
      for (int64_t offset : {0, 1}) {
        SCOPED_TRACE(fmt::format("{} h={} offset={}", dtype_name(dt), h, offset));
        const auto x = testing::rounded(testing::randn(N * h), dt);
        const auto out = testing::rounded(testing::randn(R * h), dt);
        const auto dy = testing::rounded(testing::randn(N * h), dt);
        const auto d_rows_in = testing::rounded(testing::randn(R * h), dt);
        const auto probs = testing::randu(N * k, 0.05f, 1.f);
        const PermOut ref = run_perm(kCpu, DType::kF32, map.row_index, map.slot_row, R, N, k, h, x, out, probs, dy,
                                     d_rows_in, offset);
        const PermOut got = run_perm(Device::cuda(), dt, map.row_index, map.slot_row, R, N, k, h, x, out, probs, dy,
                                     d_rows_in, offset);
        const PermOut again = run_perm(Device::cuda(), dt, map.row_index, map.slot_row, R, N, k, h, x, out, probs,
                                       dy, d_rows_in, offset);
        EXPECT_EQ(got.rows, ref.rows);  // a copy: exact in every dtype
        const double tol = dt == DType::kF32 ? 1e-6 : (dt == DType::kBF16 ? 1e-2 : 2e-3);
        EXPECT_LT(rel_err(got.dx, ref.dx), tol);
        EXPECT_LT(rel_err(got.y, ref.y), tol);
        EXPECT_LT(rel_err(got.d_rows, ref.d_rows), tol);
        // d_probs is fp32 from the same (rounded) inputs in every dtype.
        EXPECT_LT(rel_err(got.d_probs, ref.d_probs), 1e-5);
        EXPECT_TRUE(testing::all_finite(got.dx) && testing::all_finite(got.y) && testing::all_finite(got.d_rows) &&
                    testing::all_finite(got.d_probs));
        EXPECT_TRUE(same_bits(got.rows, again.rows) && same_bits(got.dx, again.dx) && same_bits(got.y, again.y) &&
                    same_bits(got.d_rows, again.d_rows) && same_bits(got.d_probs, again.d_probs));
      }
    }
  }
}

// Rows that no slot maps to (row_index -1: the tail of the device routing map, the padding rows of
// a block layout) get zero gradients from moe_unpermute_backward in every dtype and vector width
// (d_rows poisoned first); the mapped rows and d_probs match the CPU.
TEST(MoeCuda, UnpermuteBackwardZeroesUnmappedRows) {
  MT_REQUIRE_CUDA();
  const int64_t N = 200, k = 2, E = 8, first = 2, L = 4;
  const auto top = random_top(N, k, E);
  const MapOut map = run_map(kCpu, top, N, k, first, L, N * k);
  const int64_t R0 = std::accumulate(map.host.begin(), map.host.end(), int64_t{0});
  // The routed rows with a -1 row before every third of them, and a -1 tail.
  std::vector<int32_t> ri, sr(static_cast<size_t>(N * k), -1);
  for (int64_t r = 0; r < R0; ++r) {
    if (r % 3 == 0) ri.push_back(-1);
    sr[static_cast<size_t>(map.row_index[static_cast<size_t>(r)])] = static_cast<int32_t>(ri.size());
    ri.push_back(map.row_index[static_cast<size_t>(r)]);
  }
  ri.insert(ri.end(), 9, -1);
  const auto R = static_cast<int64_t>(ri.size());
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t h : {64, 3, 1001}) {
      for (int64_t offset : {0, 1}) {
        SCOPED_TRACE(fmt::format("{} h={} offset={}", dtype_name(dt), h, offset));
        const auto rows = testing::rounded(testing::randn(R * h), dt);
        const auto dy = testing::rounded(testing::randn(N * h), dt);
        const auto probs = testing::randu(N * k, 0.05f, 1.f);
        std::vector<float> d_rows[2], d_probs[2];
        for (int d = 0; d < 2; ++d) {
          const Device dev = d == 0 ? kCpu : Device::cuda();
          const DType t = d == 0 ? DType::kF32 : dt;
          const int64_t off = d == 0 ? 0 : offset;
          Stream s(dev);
          auto rit = make_int_tensor(ri, dev, {R}, s);
          auto srt = make_int_tensor(sr, dev, {N * k}, s);
          auto rt = make_tensor(rows, t, dev, {R, h}, s);
          auto dyt = make_tensor(dy, t, dev, {N, h}, s);
          auto pt = make_tensor(probs, DType::kF32, dev, {N, k}, s);
          OwnedTensor drb(t, dev, {R * h + 1}), dp(DType::kF32, dev, {N, k});
          poison(drb, s);
          poison(dp, s);
          const Tensor dr = drb.t.flat_range(off, R * h).view({R, h});
          if (dev.is_cpu()) {
            cpu::moe_unpermute_backward(dr, dp, dyt, rt, pt, rit, srt, s);
          } else {
            cuda::moe_unpermute_backward(dr, dp, dyt, rt, pt, rit, srt, s);
          }
          d_rows[d] = to_host(dr, s);
          d_probs[d] = to_host(dp, s);
        }
        for (int64_t r = 0; r < R; ++r) {
          if (ri[static_cast<size_t>(r)] >= 0) continue;
          for (int64_t j = 0; j < h; ++j) ASSERT_EQ(d_rows[1][static_cast<size_t>(r * h + j)], 0.f) << r;
        }
        const double tol = dt == DType::kF32 ? 1e-6 : (dt == DType::kBF16 ? 1e-2 : 2e-3);
        EXPECT_LT(rel_err(d_rows[1], d_rows[0]), tol);
        EXPECT_LT(rel_err(d_probs[1], d_probs[0]), 1e-5);
        EXPECT_TRUE(testing::all_finite(d_rows[1]) && testing::all_finite(d_probs[1]));
      }
    }
  }
}

TEST(MoeCuda, EndToEndFromRoutingMatchesCpu) {
  // The ops chained as the MoE layer uses them: routing on the device, counts, map, permute,
  // unpermute; the maps and outputs identical to the CPU's from the same logits.
  MT_REQUIRE_CUDA();
  const int64_t T = 4096, E = 64, k = 8, h = 256, first = 16, L = 32;
  MoeRouterOptions o;
  o.topk = k;
  o.sigmoid = true;
  o.num_groups = 8;
  o.group_topk = 4;
  o.scaling_factor = 2.5f;
  const auto logits = testing::randn(T * E, 2.f);
  const auto bias = testing::randn(E, 0.1f);
  const auto x = testing::randn(T * h);
  struct Out {
    std::vector<int32_t> top, row_index, slot_row;
    std::vector<int64_t> counts;
    std::vector<float> tpe, rows, y;
  };
  auto run = [&](Device dev) {
    Stream s(dev);
    auto l = make_tensor(logits, DType::kF32, dev, {T, E}, s);
    auto b = make_tensor(bias, DType::kF32, dev, {E}, s);
    auto xt = make_tensor(x, DType::kF32, dev, {T, h}, s);
    OwnedTensor probs(DType::kF32, dev, {T, k}), top(DType::kI32, dev, {T, k}), tpe(DType::kF32, dev, {E}),
        ri(DType::kI32, dev, {T * k}), sr(DType::kI32, dev, {T * k}), c(DType::kI32, dev, {L});
    Out r;
    if (dev.is_cpu()) {
      cpu::moe_topk_routing(probs, top, Tensor(), l, b, o, s);
      cpu::moe_tokens_per_expert(tpe, top, s);
      r.counts = cpu::moe_routing_map(ri, sr, c, top, first, L, s);
    } else {
      cuda::moe_topk_routing(probs, top, Tensor(), l, b, o, s);
      cuda::moe_tokens_per_expert(tpe, top, s);
      r.counts = cuda::moe_routing_map(ri, sr, c, top, first, L, s);
    }
    const int64_t R = std::accumulate(r.counts.begin(), r.counts.end(), int64_t{0});
    OwnedTensor rows(DType::kF32, dev, {R, h}), y(DType::kF32, dev, {T, h});
    poison(y, s);
    if (dev.is_cpu()) {
      cpu::moe_permute(rows, xt, ri, k, s);
      cpu::moe_unpermute(y, rows, probs, sr, s);
    } else {
      cuda::moe_permute(rows, xt, ri, k, s);
      cuda::moe_unpermute(y, rows, probs, sr, s);
    }
    r.top = ints(top, s);
    r.row_index = ints(ri, s);
    r.row_index.resize(static_cast<size_t>(R));
    r.slot_row = ints(sr, s);
    r.tpe = to_host(tpe, s);
    r.rows = to_host(rows, s);
    r.y = to_host(y, s);
    return r;
  };
  const Out ref = run(kCpu), got = run(Device::cuda());
  EXPECT_EQ(got.top, ref.top);
  EXPECT_EQ(got.tpe, ref.tpe);
  EXPECT_EQ(got.counts, ref.counts);
  EXPECT_EQ(got.row_index, ref.row_index);
  EXPECT_EQ(got.slot_row, ref.slot_row);
  EXPECT_EQ(got.rows, ref.rows);
  EXPECT_LT(rel_err(got.y, ref.y), 1e-6);
}

// moe_sort_chunks (one device-to-device copy per chunk) regroups bf16 rows on the GPU exactly as on
// the CPU, empty chunks included.
TEST(MoeCuda, SortChunksMatchesCpu) {
  const Stream& cs = testing::cpu_stream();
  const Stream& gs = testing::cuda_stream();
  const int64_t h = 33, C = 12;
  std::vector<int64_t> sizes(C), order(C);
  const auto r = testing::randint(C, 0, 50);
  for (int64_t c = 0; c < C; ++c) sizes[c] = c % 4 == 1 ? 0 : r[c];
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), testing::test_rng());
  const int64_t R = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  const auto xv = testing::rounded(testing::randn(R * h), DType::kBF16);
  auto xc = make_tensor(xv, DType::kBF16, kCpu, {R, h}, cs);
  auto xg = make_tensor(xv, DType::kBF16, Device::cuda(), {R, h}, gs);
  OwnedTensor yc(DType::kBF16, kCpu, {R, h}), yg(DType::kBF16, Device::cuda(), {R, h});
  poison(yc, cs);
  poison(yg, gs);
  moe_sort_chunks(yc, xc, sizes, order, cs);
  moe_sort_chunks(yg, xg, sizes, order, gs);
  EXPECT_TRUE(same_bits(to_host(yg, gs), to_host(yc, cs)));
}

// Token dropping (ops/cuda/moe_capacity.cu): both policies, probabilities with exact ties (the
// earlier slot wins) and NaNs (ranked last: never more than the capacity kept), capacities of 0, below and above the loads: the kept selection and counts
// identical to the CPU's, and the number kept is Σ_e min(capacity, load_e).
TEST(MoeCuda, CapacityDropMatchesCpu) {
  const Stream& cs = testing::cpu_stream();
  const Stream& gs = testing::cuda_stream();
  const int64_t T = 1000, k = 2, E = 8;
  const std::vector<int32_t> top = random_top(T, k, E);
  auto probs = testing::randu(T * k, 0.f, 1.f);
  for (int64_t i = 0; i < T * k; i += 7) probs[i] = 0.5f;
  for (int64_t i = 3; i < T * k; i += 11) probs[i] = std::nanf("");  // NaN ranks last (as the CPU's)
  auto ct = make_int_tensor(top, kCpu, {T, k}, cs);
  auto gt = make_int_tensor(top, Device::cuda(), {T, k}, gs);
  auto cp = make_tensor(probs, DType::kF32, kCpu, {T, k}, cs);
  auto gp = make_tensor(probs, DType::kF32, Device::cuda(), {T, k}, gs);
  for (int64_t capacity : {int64_t{0}, int64_t{100}, int64_t{250}, T * k}) {
    for (bool by_probs : {false, true}) {
      SCOPED_TRACE("capacity " + std::to_string(capacity) + (by_probs ? " probs" : " position"));
      OwnedTensor ck(DType::kI32, kCpu, {T, k}), gk(DType::kI32, Device::cuda(), {T, k});
      OwnedTensor cc(DType::kF32, kCpu, {E}), gc(DType::kF32, Device::cuda(), {E});
      fill_ints(gk, 12345, gs);
      poison(gc, gs);
      moe_capacity_drop(ck, cc, ct, cp, capacity, by_probs, cs);
      moe_capacity_drop(gk, gc, gt, gp, capacity, by_probs, gs);
      const auto kept = ints(gk, gs);
      EXPECT_EQ(kept, ints(ck, cs));
      EXPECT_TRUE(same_bits(to_host(gc, gs), to_host(cc, cs)));
      const int64_t n_kept = std::count_if(kept.begin(), kept.end(), [](int32_t v) { return v >= 0; });
      int64_t want = 0;
      for (int64_t e = 0; e < E; ++e)
        want += std::min<int64_t>(capacity, std::count(top.begin(), top.end(), static_cast<int32_t>(e)));
      EXPECT_EQ(n_kept, want);
    }
  }
}

}  // namespace
}  // namespace mt
