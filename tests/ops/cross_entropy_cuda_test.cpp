// CUDA vs CPU tests of ops/cross_entropy.h on the same random inputs: fp32 logits to 1e-5,
// bf16/fp16 logits against the CPU fp32 result computed from the same rounded inputs (fp32
// statistics to 1e-5; the gradient, stored in the logits dtype, to 2e-2 / 2e-3). Row lengths
// cover the vectorised path (V a multiple of the 16-byte vector), the scalar path, V smaller
// than the block, and targets outside this rank's vocabulary range.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <vector>

#include "core/cuda_check.h"
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

struct CeResult {
  std::vector<float> row_max, row_sumexp, target_logit, losses, grads;
};

/// stats -> loss -> backward_inplace on `device` with logits stored as `dtype`.
CeResult run(Device device, DType dtype, const std::vector<float>& x, const std::vector<int32_t>& t,
             const std::vector<float>& mask, int64_t m, int64_t v, int64_t vocab_start, float grad_scale) {
  Stream s(device);
  auto logits = make_tensor(x, dtype, device, {m, v}, s);
  auto targets = make_int_tensor(t, device, {m}, s);
  auto mask_t = make_tensor(mask, DType::kF32, device, {m}, s);
  OwnedTensor mx(DType::kF32, device, {m}), se(DType::kF32, device, {m}), tl(DType::kF32, device, {m}),
      loss(DType::kF32, device, {m});
  for (const Tensor* o : {&mx.t, &se.t, &tl.t, &loss.t}) poison(*o, s);
  cross_entropy_stats(mx, se, tl, logits, targets, vocab_start, -1, s);
  cross_entropy_loss(loss, mx, se, tl, mask_t, s);
  auto dev_scale = make_tensor({4.f}, DType::kF32, device, {1}, s);  // device-side loss scale factor
  cross_entropy_backward_inplace(logits, targets, mx, se, mask_t, vocab_start, -1, grad_scale / 4, dev_scale, s);
  return {to_host(mx, s), to_host(se, s), to_host(tl, s), to_host(loss, s), to_host(logits, s)};
}

struct Case {
  int64_t m, v, vocab_start;
};

TEST(CrossEntropyCuda, MatchesCpu) {
  MT_REQUIRE_CUDA();
  const Case cases[] = {
      {7, 37, 0},        // V < block, scalar path
      {33, 1001, 0},     // odd V: scalar path
      {5, 4100, 0},      // fp32 vectorised (4100 % 4 == 0), bf16/fp16 scalar (4100 % 8 != 0)
      {16, 50304, 0},    // GPT-2 padded vocabulary: vectorised for every dtype
      {9, 1024, 3000},   // a vocab-parallel shard: most targets fall outside [3000, 4024)
  };
  for (const Case& c : cases) {
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(::testing::Message() << "m=" << c.m << " V=" << c.v << " vocab_start=" << c.vocab_start
                                        << " dtype=" << dtype_name(dt));
      auto x = testing::randn(c.m * c.v, 3.f);
      for (auto& e : x) e = round_through(dt, e);
      const int32_t lo = static_cast<int32_t>(c.vocab_start == 0 ? 0 : c.vocab_start - 500);
      auto t = testing::randint(c.m, lo, static_cast<int32_t>(c.vocab_start + c.v + (c.vocab_start ? 500 : 0)));
      t[0] = static_cast<int32_t>(c.vocab_start);  // at least one in range: first column
      if (c.m > 1) t[1] = static_cast<int32_t>(c.vocab_start + c.v - 1);  // and the last
      auto mask = testing::randu(c.m, 0.5f, 1.5f);
      mask[c.m - 1] = 0.f;
      const float grad_scale = 0.75f;
      const CeResult cpu = run(Device::cpu(), DType::kF32, x, t, mask, c.m, c.v, c.vocab_start, grad_scale);
      const CeResult gpu = run(Device::cuda(), dt, x, t, mask, c.m, c.v, c.vocab_start, grad_scale);
      EXPECT_EQ(gpu.row_max, cpu.row_max);            // max of the same values: exact
      EXPECT_EQ(gpu.target_logit, cpu.target_logit);  // a copy of one value (or 0): exact
      EXPECT_LT(rel_err(gpu.row_sumexp, cpu.row_sumexp), 1e-5);
      EXPECT_LT(rel_err(gpu.losses, cpu.losses), 1e-5);
      const double tol = dt == DType::kF32 ? 1e-5 : (dt == DType::kBF16 ? 2e-2 : 2e-3);
      EXPECT_LT(rel_err(gpu.grads, cpu.grads), tol);
      EXPECT_TRUE(testing::all_finite(gpu.grads));
    }
  }
}

TEST(CrossEntropyCuda, UnalignedRowsUseScalarPath) {
  // Logits starting at an odd element offset of a buffer: not 16-byte aligned.
  MT_REQUIRE_CUDA();
  const int64_t m = 6, v = 256;
  auto x = testing::randn(m * v + 1, 2.f);
  auto t = testing::randint(m, 0, static_cast<int32_t>(v));
  std::vector<float> xs(x.begin() + 1, x.end());
  auto mask = testing::randu(m, 0.5f, 1.5f);
  const CeResult cpu = run(Device::cpu(), DType::kF32, xs, t, mask, m, v, 0, 1.f);
  Stream s(Device::cuda());
  auto buf = make_tensor(x, DType::kF32, Device::cuda(), {m * v + 1}, s);
  Tensor logits = buf.t.flat_range(1, m * v).view({m, v});
  auto targets = make_int_tensor(t, Device::cuda(), {m}, s);
  OwnedTensor mx(DType::kF32, Device::cuda(), {m}), se(DType::kF32, Device::cuda(), {m}),
      tl(DType::kF32, Device::cuda(), {m});
  for (const Tensor* o : {&mx.t, &se.t, &tl.t}) poison(*o, s);
  cross_entropy_stats(mx, se, tl, logits, targets, 0, -1, s);
  EXPECT_EQ(to_host(mx, s), cpu.row_max);
  EXPECT_LT(rel_err(to_host(se, s), cpu.row_sumexp), 1e-5);
  cross_entropy_backward_inplace(logits, targets, mx, se, Tensor(), 0, -1, 1.f, Tensor(), s);
  const CeResult cpu_nomask = [&] {
    std::vector<float> ones(m, 1.f);
    return run(Device::cpu(), DType::kF32, xs, t, ones, m, v, 0, 1.f);
  }();
  EXPECT_LT(rel_err(to_host(logits, s), cpu_nomask.grads), 1e-5);
  EXPECT_EQ(to_host(buf.t, s)[0], x[0]);  // the element before the view is untouched
}

TEST(CrossEntropyCuda, RescaleSumexpMatchesCpu) {
  MT_REQUIRE_CUDA();
  const int64_t m = 1000;
  auto se = testing::randu(m, 1.f, 100.f);
  auto lm = testing::randn(m, 3.f);
  std::vector<float> gm(m);
  auto d = testing::randu(m, 0.f, 5.f);
  for (int64_t i = 0; i < m; ++i) gm[i] = lm[i] + d[i];
  std::vector<std::vector<float>> out;
  for (Device dev : {Device::cpu(), Device::cuda()}) {
    Stream s(dev);
    auto se_t = make_tensor(se, DType::kF32, dev, {m}, s);
    auto lm_t = make_tensor(lm, DType::kF32, dev, {m}, s);
    auto gm_t = make_tensor(gm, DType::kF32, dev, {m}, s);
    cross_entropy_rescale_sumexp(se_t, lm_t, gm_t, s);
    out.push_back(to_host(se_t, s));
  }
  EXPECT_LT(rel_err(out[1], out[0]), 1e-5);
}

TEST(CrossEntropyCuda, LossWithoutMaskMatchesCpu) {
  MT_REQUIRE_CUDA();
  const int64_t m = 777;
  auto mx = testing::randn(m, 3.f);
  auto se = testing::randu(m, 1.f, 1000.f);
  auto tl = testing::randn(m, 3.f);
  std::vector<std::vector<float>> out;
  for (Device dev : {Device::cpu(), Device::cuda()}) {
    Stream s(dev);
    auto a = make_tensor(mx, DType::kF32, dev, {m}, s);
    auto b = make_tensor(se, DType::kF32, dev, {m}, s);
    auto c = make_tensor(tl, DType::kF32, dev, {m}, s);
    OwnedTensor loss(DType::kF32, dev, {m});
    poison(loss, s);
    cross_entropy_loss(loss, a, b, c, Tensor(), s);
    out.push_back(to_host(loss, s));
  }
  EXPECT_LT(rel_err(out[1], out[0]), 1e-5);
}

TEST(CrossEntropyCuda, SumAccumulateMatchesCpuAndIsDeterministic) {
  MT_REQUIRE_CUDA();
  for (int64_t n : {1, 1000, 1025, 100003}) {
    auto x = testing::randn(n, 2.f);
    for (auto& e : x) e = std::fabs(e);  // like per-token losses: positive
    const float init = testing::randu(1, 1.f, 2.f)[0];
    const float alpha = 1.f / static_cast<float>(n);
    Stream cs(Device::cpu());
    auto out_cpu = make_tensor({init}, DType::kF32, Device::cpu(), {1}, cs);
    sum_accumulate(out_cpu, make_tensor(x, DType::kF32, Device::cpu(), {n}, cs), alpha, cs);
    Stream gs(Device::cuda());
    auto xg = make_tensor(x, DType::kF32, Device::cuda(), {n}, gs);
    auto out1 = make_tensor({init}, DType::kF32, Device::cuda(), {1}, gs);
    auto out2 = make_tensor({init}, DType::kF32, Device::cuda(), {1}, gs);
    sum_accumulate(out1, xg, alpha, gs);
    sum_accumulate(out2, xg, alpha, gs);
    const float a = to_host(out1, gs)[0], b = to_host(out2, gs)[0];
    EXPECT_EQ(a, b) << "n=" << n;  // bitwise deterministic
    EXPECT_LT(rel_err({a}, to_host(out_cpu, cs)), 1e-5) << "n=" << n;
  }
}

TEST(CrossEntropyCuda, ForwardBackwardInplaceMatchesCpu) {
  // The one-pass op against the CPU's stats + backward on the same rounded inputs: rows that take
  // the one-kernel path (GPT-2's padded vocabulary with padding columns, a Llama-2-sized row, a
  // short row, ragged row counts) and rows that fall back to the two kernels (odd V; fp32 rows
  // too long to fit twice in shared memory).
  MT_REQUIRE_CUDA();
  struct FbCase {
    int64_t m, v, valid;
  };
  const FbCase cases[] = {{3, 50304, 50257}, {129, 50304, 50257}, {17, 32000, 32000}, {5, 4096, 4000},
                          {31, 1001, 1001}, {2, 64, 1}};
  int cc_major = 0;
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, 0));
  if (cc_major >= 9) {  // sm_90: 228 KiB of shared memory per multiprocessor
    EXPECT_TRUE(cuda::cross_entropy_fused_row_fits(50304, DType::kBF16, Device::cuda()));
    EXPECT_TRUE(cuda::cross_entropy_fused_row_fits(16000, DType::kF32, Device::cuda()));
  }
  EXPECT_FALSE(cuda::cross_entropy_fused_row_fits(1001, DType::kBF16, Device::cuda()));  // not whole vectors
  EXPECT_FALSE(cuda::cross_entropy_fused_row_fits(1 << 20, DType::kBF16, Device::cuda()));
  EXPECT_FALSE(cuda::cross_entropy_fused_row_fits(4096, DType::kBF16, Device::cpu()));
  for (const FbCase& c : cases) {
    for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
      SCOPED_TRACE(::testing::Message() << "m=" << c.m << " V=" << c.v << " valid=" << c.valid
                                        << " dtype=" << dtype_name(dt) << " one kernel="
                                        << cuda::cross_entropy_fused_row_fits(c.v, dt, Device::cuda()));
      auto x = testing::randn(c.m * c.v, 3.f);
      for (auto& e : x) e = round_through(dt, e);
      auto t = testing::randint(c.m, 0, static_cast<int32_t>(c.valid));
      t[0] = static_cast<int32_t>(c.valid - 1);                          // the last valid column
      if (c.m > 1) t[1] = static_cast<int32_t>(c.v + 5);                 // outside the vocabulary
      auto mask = testing::randu(c.m, 0.5f, 1.5f);
      mask[c.m - 1] = 0.f;
      const float grad_scale = 0.6f;
      std::vector<std::vector<float>> out[2];
      for (int d = 0; d < 2; ++d) {
        const Device dev = d == 0 ? Device::cpu() : Device::cuda();
        Stream s(dev);
        auto logits = make_tensor(x, d == 0 ? DType::kF32 : dt, dev, {c.m, c.v}, s);
        auto targets = make_int_tensor(t, dev, {c.m}, s);
        auto mask_t = make_tensor(mask, DType::kF32, dev, {c.m}, s);
        auto dev_scale = make_tensor({2.f}, DType::kF32, dev, {1}, s);
        OwnedTensor mx(DType::kF32, dev, {c.m}), se(DType::kF32, dev, {c.m}), tl(DType::kF32, dev, {c.m});
        for (const Tensor* o : {&mx.t, &se.t, &tl.t}) poison(*o, s);
        cross_entropy_forward_backward_inplace(mx, se, tl, logits, targets, mask_t, c.valid, grad_scale / 2,
                                               dev_scale, s);
        out[d] = {to_host(mx, s), to_host(se, s), to_host(tl, s), to_host(logits, s)};
      }
      EXPECT_EQ(out[1][0], out[0][0]);  // row max: exact
      EXPECT_LT(rel_err(out[1][1], out[0][1]), 1e-5);
      EXPECT_EQ(out[1][2], out[0][2]);  // target logit: a copy (or 0 outside the vocabulary)
      const double tol = dt == DType::kF32 ? 1e-5 : (dt == DType::kBF16 ? 2e-2 : 2e-3);
      EXPECT_LT(rel_err(out[1][3], out[0][3]), tol);
      for (int64_t r = 0; r < c.m; ++r)  // padding columns: gradient exactly 0
        for (int64_t j = c.valid; j < c.v; ++j) ASSERT_EQ(out[1][3][r * c.v + j], 0.f) << "row " << r << " col " << j;
    }
  }
}

TEST(CrossEntropyCuda, RejectsMixedDevices) {
  MT_REQUIRE_CUDA();
  Stream gs(Device::cuda());
  const int64_t m = 4, v = 8;
  auto logits = make_tensor(testing::randn(m * v), DType::kF32, Device::cuda(), {m, v}, gs);
  auto targets = make_int_tensor(testing::randint(m, 0, 8), Device::cuda(), {m}, gs);
  OwnedTensor mx(DType::kF32, Device::cuda(), {m}), se(DType::kF32, Device::cuda(), {m}),
      tl_cpu(DType::kF32, Device::cpu(), {m});
  EXPECT_THROW(cross_entropy_stats(mx, se, tl_cpu, logits, targets, 0, -1, gs), Error);
  Stream cs(Device::cpu());
  OwnedTensor tl(DType::kF32, Device::cuda(), {m});
  EXPECT_THROW(cross_entropy_stats(mx, se, tl, logits, targets, 0, -1, cs), Error);  // CPU stream
}

}  // namespace
}  // namespace mt
