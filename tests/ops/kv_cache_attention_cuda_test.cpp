// CUDA kv_cache_attention_forward against the CPU reference (ops/kv_cache_attention.h): a prefill
// followed by single-token decoding steps, GQA and MHA, head dims 64 and 80 (ragged for the
// warps), fp32 (rel. < 1e-5) and bf16 / fp16 (inputs rounded to the dtype, rel. < 2e-2); the
// caches' written positions must agree too.
#include <gtest/gtest.h>

#include "ops/kv_cache_attention.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;
using testing::rounded;

struct Case {
  int64_t s, b, g, qpg, d, smax, prefill;
};

void check(const Case& c, DType dt) {
  const Stream& cs = testing::cpu_stream();
  const Stream& gs = testing::cuda_stream();
  const std::vector<float> x = rounded(testing::randn(c.s * c.b * c.g * (c.qpg + 2) * c.d), dt);
  const std::vector<int64_t> qshape{c.s, c.b, c.g, c.qpg + 2, c.d}, cshape{c.b, c.g, c.smax, c.d},
      oshape{c.s, c.b, c.g * c.qpg * c.d};
  OwnedTensor q_cpu = testing::make_tensor(x, DType::kF32, Device::cpu(), qshape, cs);
  OwnedTensor q_gpu = testing::make_tensor(x, dt, Device::cuda(0), qshape, gs);
  OwnedTensor kc_cpu(DType::kF32, Device::cpu(), cshape), vc_cpu(DType::kF32, Device::cpu(), cshape);
  OwnedTensor kc_gpu(dt, Device::cuda(0), cshape), vc_gpu(dt, Device::cuda(0), cshape);
  OwnedTensor o_cpu(DType::kF32, Device::cpu(), oshape), o_gpu(dt, Device::cuda(0), oshape);
  for (const Tensor* t : {&kc_cpu.t, &vc_cpu.t, &o_cpu.t}) testing::upload(*t, std::vector<float>(t->numel(), 0.f), cs);
  for (const Tensor* t : {&kc_gpu.t, &vc_gpu.t, &o_gpu.t}) testing::upload(*t, std::vector<float>(t->numel(), 0.f), gs);
  KvCacheAttentionConfig cfg;
  cfg.softmax_scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  auto run = [&](int64_t i0, int64_t i1) {
    cfg.offset = i0;
    kv_cache_attention_forward(o_cpu.t.slice0(i0, i1), q_cpu.t.slice0(i0, i1), kc_cpu.t, vc_cpu.t, cfg, cs);
    kv_cache_attention_forward(o_gpu.t.slice0(i0, i1), q_gpu.t.slice0(i0, i1), kc_gpu.t, vc_gpu.t, cfg, gs);
  };
  run(0, c.prefill);
  for (int64_t i = c.prefill; i < c.s; ++i) run(i, i + 1);
  const double tol = dt == DType::kF32 ? 1e-5 : 2e-2;
  EXPECT_LT(testing::rel_err(testing::to_host(o_gpu.t, gs), testing::to_host(o_cpu.t, cs)), tol) << dtype_name(dt);
  EXPECT_LT(testing::rel_err(testing::to_host(kc_gpu.t, gs), testing::to_host(kc_cpu.t, cs)), tol) << dtype_name(dt);
  EXPECT_LT(testing::rel_err(testing::to_host(vc_gpu.t, gs), testing::to_host(vc_cpu.t, cs)), tol) << dtype_name(dt);
}

TEST(KvCacheAttentionCuda, MatchesCpu) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    check({9, 2, 2, 3, 64, 16, 5}, dt);    // GQA, prefill 5 then 4 steps
    check({6, 3, 4, 1, 80, 6, 1}, dt);     // MHA, ragged head dim, cache exactly full
    check({300, 1, 1, 4, 64, 320, 200}, dt);  // longer context (scores over many warps)
  }
}

}  // namespace
}  // namespace mt
