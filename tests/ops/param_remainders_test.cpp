// CPU tests of the fp32 main parameters stored as bf16 parameters plus int16 remainders
// (--use-precision-aware-optimizer; Megatron's store_param_remainders, TransformerEngine's
// FusedAdam): split_param_remainders / merge_param_remainders round-trip every fp32 bit pattern
// exactly and round to nearest with ties away from zero (the round-to-nearest-even cast only
// differs at exact ties), and AdamW on (bf16, remainder) pairs gives bitwise the fp32 main
// parameters and moments of the fp32-main path over several steps (weight decay and no-decay
// runs, a skipped overflow step, sharded and flat main indexing).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "ops/optimizer.h"
#include "ops/optimizer_math.h"
#include "ops/optimizer_test_util.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;
using testing::ScalarsTensor;
using testing::static_scaler;

const Device kCpu = Device::cpu();

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

template <typename T>
OwnedTensor raw_tensor(const std::vector<T>& host, DType dtype, const Stream& s) {
  OwnedTensor t(dtype, kCpu, {static_cast<int64_t>(host.size())});
  copy_bytes(t.t.data(), kCpu, host.data(), kCpu, host.size() * sizeof(T), s);
  return t;
}

template <typename T>
std::vector<T> raw_host(const Tensor& t, const Stream& s) {
  std::vector<T> out(static_cast<size_t>(t.numel()));
  copy_bytes(out.data(), kCpu, t.data(), t.device(), out.size() * sizeof(T), s);
  s.synchronize();
  return out;
}

bool is_nan_bits(uint32_t u) { return (u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0; }

/// fp32 bit patterns: +-0, subnormals, the extreme normals, +-inf, every low half under a few high
/// halves (ties 0x8000 under even and odd high halves, 0xFFFF carrying into the exponent, the
/// sign boundary), values of several magnitudes, random finite patterns, and (with_nan) NaNs,
/// including the two whose rounded high half wraps (0x7FFF8000 -> 0x8000, 0xFFFF8000 -> 0x0000).
std::vector<uint32_t> test_patterns(bool with_nan) {
  std::vector<uint32_t> u = {0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u, 0x00008000u, 0x80008000u,
                             0x00007FFFu, 0x0000FFFFu, 0x007FFFFFu, 0x00800000u, 0x7F7FFFFFu, 0xFF7FFFFFu,
                             0x7F7F8000u, 0x7F800000u, 0xFF800000u, 0x3F800000u, 0x3F808000u, 0x3F818000u,
                             0xBF808000u, 0xBF818000u, 0x3F80FFFFu, 0x3FFFFFFFu, 0x807FFFFFu};
  for (uint32_t hi : {0x0000u, 0x3F80u, 0x3F81u, 0xBC23u, 0x8001u, 0x7F7Fu, 0xFF7Fu})
    for (uint32_t lo = 0; lo <= 0xFFFFu; ++lo) u.push_back(hi << 16 | lo);
  for (float scale : {1e-38f, 1e-20f, 0.02f, 1.f, 3e4f, 1e30f})
    for (float x : testing::randn(20000, scale)) u.push_back(bits_of(x));
  std::uniform_int_distribution<uint32_t> any;
  for (int k = 0; k < 200000; ++k) {
    const uint32_t x = any(testing::test_rng());
    if (!is_nan_bits(x)) u.push_back(x);
  }
  if (with_nan) {
    for (uint32_t x : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0x7FFF8000u, 0xFFFF8000u, 0x7FFFFFFFu, 0xFFFFFFFFu,
                       0x7FBF8000u})
      u.push_back(x);
  }
  return u;
}

TEST(ParamRemainders, SplitMergeRoundTripIsExact) {
  Stream s(kCpu);
  const std::vector<uint32_t> pattern = test_patterns(/*with_nan=*/true);
  const auto n = static_cast<int64_t>(pattern.size());
  OwnedTensor x = raw_tensor(pattern, DType::kF32, s);
  OwnedTensor hi = raw_tensor(std::vector<uint16_t>(pattern.size(), 0xABCDu), DType::kBF16, s);
  OwnedTensor rem = raw_tensor(std::vector<int16_t>(pattern.size(), 0x5A5A), DType::kI16, s);
  OwnedTensor back(DType::kF32, kCpu, {n});
  testing::poison(back, s);
  split_param_remainders(x, hi, rem, s);
  merge_param_remainders(back, hi, rem, s);
  const auto h = raw_host<uint16_t>(hi, s);
  const auto r = raw_host<int16_t>(rem, s);
  const auto y = raw_host<uint32_t>(back, s);
  int64_t ties = 0, rne_differs = 0, bad = 0, bad_split = 0, bad_rounding = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = pattern[i], lo = u & 0xFFFFu;
    if (y[i] != u) ++bad;  // NaN payloads included: the pair holds the bits
    // The remainder is the low half; the high half is rounded up exactly when it is negative.
    if (static_cast<uint16_t>(r[i]) != lo || h[i] != static_cast<uint16_t>((u >> 16) + (lo >= 0x8000u ? 1 : 0)))
      ++bad_split;
    if (is_nan_bits(u)) continue;
    float xf;
    std::memcpy(&xf, &u, 4);
    const uint16_t rne = f32_to_bf16_bits(xf);
    if (lo == 0x8000u) {  // exact tie: away from zero, where round-to-nearest-even keeps an even hi
      ++ties;
      rne_differs += rne != h[i];
      if ((rne != h[i]) != (((u >> 16) & 1u) == 0)) ++bad_rounding;
    } else if (h[i] != rne) {
      ++bad_rounding;
    }
  }
  EXPECT_EQ(bad, 0) << "round trips not bit-exact";
  EXPECT_EQ(bad_split, 0) << "(bf16, remainder) not the rounded high half and the low half";
  EXPECT_EQ(bad_rounding, 0) << "bf16 differs from the round-to-nearest-even cast other than at even ties";
  EXPECT_GE(ties, 7);
  EXPECT_GT(rne_differs, 0);
  // Without remainders the split writes the same bf16 parameters.
  OwnedTensor hi2 = raw_tensor(std::vector<uint16_t>(pattern.size(), 0xABCDu), DType::kBF16, s);
  split_param_remainders(x, hi2, Tensor(), s);
  EXPECT_EQ(raw_host<uint16_t>(hi2, s), h);
}

TEST(ParamRemainders, BitFunctionsMatchOps) {
  // The host/device bit functions against the ops on a few values (the ops are tested above).
  for (float x : {0.f, -0.f, 1.f, -1.5f, 3.14159f, 1e-40f, -2e38f}) {
    uint16_t h;
    int16_t r;
    detail::split_f32_remainder(x, h, r);
    EXPECT_EQ(bits_of(detail::merge_f32_remainder(h, r)), bits_of(x)) << x;
  }
}

TEST(ParamRemainders, RejectsBadArguments) {
  Stream s(kCpu);
  const int64_t n = 16;
  OwnedTensor x(DType::kF32, kCpu, {n}), hi(DType::kBF16, kCpu, {n}), rem(DType::kI16, kCpu, {n}),
      half(DType::kF16, kCpu, {n}), rem_short(DType::kI16, kCpu, {n - 1}), rem_f32(DType::kF32, kCpu, {n});
  memset_tensor(x, 0, s);
  EXPECT_NO_THROW(split_param_remainders(x, hi, rem, s));
  EXPECT_THROW(split_param_remainders(x, half, rem, s), Error);       // model must be bf16
  EXPECT_THROW(split_param_remainders(x, hi, rem_short, s), Error);   // size
  EXPECT_THROW(split_param_remainders(x, hi, rem_f32, s), Error);     // remainders int16
  EXPECT_THROW(split_param_remainders(hi, hi, rem, s), Error);        // main fp32
  EXPECT_THROW(merge_param_remainders(x, hi, Tensor(), s), Error);    // remainders needed
  EXPECT_THROW(merge_param_remainders(x, hi, rem_short, s), Error);
  // AdamW with int16 main parameters needs the bf16 model parameters.
  ScalarsTensor sc(kCpu);
  sc.write(initial_optimizer_scalars(static_scaler(1.f)), s);
  optimizer_prepare(sc.t, 0.f, s);
  OwnedTensor g(DType::kF32, kCpu, {n}), m(DType::kF32, kCpu, {n}), v(DType::kF32, kCpu, {n});
  memset_tensor(g, 0, s);
  memset_tensor(m, 0, s);
  memset_tensor(v, 0, s);
  AdamWHyper h;
  h.lr = 1e-3f;
  EXPECT_NO_THROW(adamw_step(rem, g, m, v, hi, h, sc.t, s));
  EXPECT_THROW(adamw_step(rem, g, m, v, Tensor(), h, sc.t, s), Error);
  EXPECT_THROW(adamw_step(rem, g, m, v, half, h, sc.t, s), Error);
  const AdamWPlan plan({{0, 0, 0, n, 1, 0}}, kCpu, s);
  EXPECT_NO_THROW(adamw_multi_step(rem, g, m, v, hi, plan, h, sc.t, s));
  EXPECT_THROW(adamw_multi_step(rem, g, m, v, Tensor(), plan, h, sc.t, s), Error);
  EXPECT_THROW(adamw_multi_step(rem_short, g, m, v, hi, plan, h, sc.t, s), Error);  // shorter than the plan
}

/// The (bf16, remainder) pairs of the fp32 main parameters `p` of `runs`: the bf16 half at the
/// param index, the remainder at the main index (as the optimizer lays them out).
void split_runs(const Tensor& p, const Tensor& model, const Tensor& rem, const std::vector<AdamWRun>& runs,
                const Stream& s) {
  for (const AdamWRun& r : runs)
    split_param_remainders(p.flat_range(r.main, r.n), model.flat_range(r.param, r.n), rem.flat_range(r.main, r.n), s);
}

/// The fp32 main parameters merged back from the pairs, at the main index (elements outside the
/// runs: 0).
std::vector<uint32_t> merged_runs(const Tensor& model, const Tensor& rem, int64_t main_n,
                                  const std::vector<AdamWRun>& runs, const Stream& s) {
  OwnedTensor out(DType::kF32, kCpu, {main_n});
  memset_tensor(out, 0, s);
  for (const AdamWRun& r : runs)
    merge_param_remainders(out->flat_range(r.main, r.n), model.flat_range(r.param, r.n), rem.flat_range(r.main, r.n),
                           s);
  return raw_host<uint32_t>(out, s);
}

std::vector<uint32_t> main_bits_of_runs(const Tensor& p, const std::vector<AdamWRun>& runs, const Stream& s) {
  std::vector<uint32_t> all = raw_host<uint32_t>(p, s), out(all.size(), 0u);
  for (const AdamWRun& r : runs)
    for (int64_t i = 0; i < r.n; ++i) out[r.main + i] = all[r.main + i];
  return out;
}

// adamw_multi_step on (bf16, int16 remainder) pairs == the fp32-main path, bitwise, step after
// step: the same fp32 main parameters (merged), moments, and a skipped step writes nothing.
TEST(ParamRemainders, AdamWMultiStepMatchesFp32MainBitwise) {
  Stream s(kCpu);
  for (bool sharded : {false, true}) {
    SCOPED_TRACE(sharded ? "main by state index" : "main by flat index");
    const std::vector<AdamWRun> runs = testing::test_adamw_runs(sharded);
    const AdamWPlan plan(runs, kCpu, s);
    const int64_t param_n = plan.param_end() + 3, main_n = plan.main_end() + 2, state_n = plan.state_end() + 1;
    // fp32 path: a.p fp32 main, a.model the bf16 copy.
    testing::AdamWBuffers a(kCpu, DType::kBF16, param_n, main_n, state_n, s);
    testing::AdamWBuffers b(a, kCpu, s);  // b.m, b.v: the remainder path's moments
    OwnedTensor model(DType::kBF16, kCpu, {param_n}), rem(DType::kI16, kCpu, {main_n});
    memset_tensor(model, 0, s);
    memset_tensor(rem, 0, s);
    split_runs(a.p, model, rem, runs, s);
    ASSERT_EQ(merged_runs(model, rem, main_n, runs, s), main_bits_of_runs(a.p, runs, s));
    ScalarsTensor sc(kCpu);
    const LossScalerConfig cfg = static_scaler(8.f);
    sc.write(initial_optimizer_scalars(cfg), s);
    AdamWHyper h;
    h.beta2 = 0.95f;
    h.weight_decay = 0.1f;  // runs alternate decay / no decay
    for (int step = 0; step < 5; ++step) {
      SCOPED_TRACE(::testing::Message() << "step " << step);
      h.lr = 1e-3f * static_cast<float>(step + 1);
      std::vector<float> g = testing::randn(param_n, 0.05f * 8.f);
      const bool overflow = step == 2;
      if (overflow) g[runs[1].param] = INFINITY;
      testing::upload(a.g, g, s);
      const auto model_before = raw_host<uint16_t>(model, s);
      const auto rem_before = raw_host<int16_t>(rem, s);
      grad_sumsq_accumulate(sc.t, a.g, s);
      optimizer_prepare(sc.t, step % 2 == 0 ? 1.f : 0.f, s);
      adamw_multi_step(a.p, a.g, a.m, a.v, a.model_view(), plan, h, sc.t, s);
      adamw_multi_step(rem, a.g, b.m, b.v, model, plan, h, sc.t, s);
      loss_scaler_update(sc.t, cfg, s);
      if (overflow) {
        EXPECT_EQ(raw_host<uint16_t>(model, s), model_before);
        EXPECT_EQ(raw_host<int16_t>(rem, s), rem_before);
      }
      EXPECT_EQ(merged_runs(model, rem, main_n, runs, s), main_bits_of_runs(a.p, runs, s));
      EXPECT_EQ(raw_host<uint32_t>(a.m, s), raw_host<uint32_t>(b.m, s));
      EXPECT_EQ(raw_host<uint32_t>(a.v, s), raw_host<uint32_t>(b.v, s));
      // The bf16 halves are the fp32-path copy (round to nearest even) except at exact ties.
      const auto pm = raw_host<uint32_t>(a.p, s);
      const auto m16 = raw_host<uint16_t>(model, s), c16 = raw_host<uint16_t>(a.model, s);
      for (const AdamWRun& r : runs)
        for (int64_t i = 0; i < r.n; ++i)
          if ((pm[r.main + i] & 0xFFFFu) != 0x8000u) {
            ASSERT_EQ(m16[r.param + i], c16[r.param + i]) << r.param + i;
          }
    }
    const OptimizerScalars o = sc.read(s);
    EXPECT_EQ(o.step, 4);
    EXPECT_EQ(o.skipped_iters, 1);
  }
}

// adamw_step with remainders (unaligned views, odd length) == adamw_step on fp32 main parameters.
TEST(ParamRemainders, AdamWStepMatchesFp32MainBitwise) {
  Stream s(kCpu);
  const int64_t n = 1001;
  OwnedTensor p = testing::make_tensor(testing::randn(n + 1), DType::kF32, kCpu, {n + 1}, s);
  OwnedTensor g = testing::make_tensor(testing::randn(n + 1, 0.1f), DType::kF32, kCpu, {n + 1}, s);
  OwnedTensor m1 = testing::make_tensor(testing::randn(n + 1, 0.01f), DType::kF32, kCpu, {n + 1}, s);
  OwnedTensor v1 = testing::make_tensor(testing::randu(n + 1, 1e-5f, 1e-3f), DType::kF32, kCpu, {n + 1}, s);
  OwnedTensor m2(DType::kF32, kCpu, {n + 1}), v2(DType::kF32, kCpu, {n + 1});
  copy(m2, m1, s);
  copy(v2, v1, s);
  OwnedTensor model(DType::kBF16, kCpu, {n + 1}), rem(DType::kI16, kCpu, {n + 1});
  split_param_remainders(p, model, rem, s);
  ScalarsTensor sc(kCpu);
  sc.write(initial_optimizer_scalars(static_scaler(1.f)), s);
  AdamWHyper h;
  h.lr = 1e-2f;
  h.weight_decay = 0.1f;
  auto view = [n](const Tensor& t) { return t.flat_range(1, n); };
  for (int step = 0; step < 3; ++step) {
    optimizer_prepare(sc.t, 0.f, s);
    adamw_step(view(p), view(g), view(m1), view(v1), Tensor(), h, sc.t, s);
    adamw_step(view(rem), view(g), view(m2), view(v2), view(model), h, sc.t, s);
  }
  OwnedTensor back(DType::kF32, kCpu, {n + 1});
  merge_param_remainders(back, model, rem, s);
  EXPECT_EQ(raw_host<uint32_t>(back, s), raw_host<uint32_t>(p, s));
  EXPECT_EQ(raw_host<uint32_t>(m1, s), raw_host<uint32_t>(m2, s));
  EXPECT_EQ(raw_host<uint32_t>(v1, s), raw_host<uint32_t>(v2, s));
}

}  // namespace
}  // namespace mt
