// CUDA RoPE against the CPU reference on the same (dtype-rounded) inputs: fp32 rel. 1e-5,
// bf16/fp16 rel. 2e-2; vectorised paths (non-interleaved: rotary_dim/2 and d multiples of the
// vector width; interleaved: rotary_dim and d multiples of it) and scalar ones (ragged sizes,
// unaligned views); value heads and pass-through channels bitwise untouched; device errors.
#include <gtest/gtest.h>

#include "ops/rope.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;
using testing::rounded;
const Device kCpu = Device::cpu();

double tol(DType t) { return t == DType::kF32 ? 1e-5 : 2e-2; }

struct Case {
  int64_t s, b, g, qpg, d, rotary_dim;
  float base;
  int32_t max_pos;  // > 0: explicit positions drawn from [0, max_pos); 0: default positions
};

std::string str(const Case& c, DType t, bool inter) {
  return fmt::format("{} s={} b={} g={} qpg={} d={} rd={} base={} max_pos={} inter={}", dtype_name(t), c.s, c.b, c.g,
                     c.qpg, c.d, c.rotary_dim, c.base, c.max_pos, inter);
}

TEST(RopeCuda, ForwardBackwardMatchCpu) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  const std::vector<Case> cases = {
      {256, 2, 4, 4, 128, 128, 10000.f, 0},       // Llama-like GQA, vectorised
      {64, 3, 2, 1, 128, 64, 10000.f, 4096},      // partial rotary (rotary_dim/2 = 32), positions
      {33, 2, 3, 2, 64, 64, 500000.f, 131072},    // long-context positions, Llama-3 base
      {5, 1, 1, 1, 10, 6, 10000.f, 0},            // rotary_dim/2 = 3, d = 10: scalar
      {7, 5, 2, 3, 7, 2, 10000.f, 100},           // d = 7, a single pair: scalar
      {1, 1, 1, 1, 256, 256, 10000.f, 0},         // one token, head dim 256
      {100, 4, 1, 8, 96, 96, 10000.f, 1000},      // 9 rotated heads per group: a partial head chunk
  };
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const Case& c : cases) {
      for (bool inter : {false, true}) {
        const std::string what = str(c, t, inter);
        RopeConfig cfg;
        cfg.queries_per_group = c.qpg;
        cfg.rotary_dim = c.rotary_dim;
        cfg.base = c.base;
        cfg.interleaved = inter;
        const std::vector<int64_t> shape = {c.s, c.b, c.g, c.qpg + 2, c.d};
        const int64_t n = c.s * c.b * c.g * (c.qpg + 2) * c.d;
        const auto xv = rounded(testing::randn(n), t), gv = rounded(testing::randn(n), t);
        OwnedTensor pos_c, pos_g;
        if (c.max_pos > 0) {
          const auto pv = testing::randint(c.s * c.b, 0, c.max_pos);
          pos_c = testing::make_int_tensor(pv, kCpu, {c.s, c.b}, cs);
          pos_g = testing::make_int_tensor(pv, gpu, {c.s, c.b}, gs);
        }
        auto xc = testing::make_tensor(xv, DType::kF32, kCpu, shape, cs);
        auto gc = testing::make_tensor(gv, DType::kF32, kCpu, shape, cs);
        rope_forward(xc, pos_c, cfg, cs);
        rope_backward(gc, pos_c, cfg, cs);
        auto xg = testing::make_tensor(xv, t, gpu, shape, gs);
        auto gg = testing::make_tensor(gv, t, gpu, shape, gs);
        rope_forward(xg, pos_g, cfg, gs);
        rope_backward(gg, pos_g, cfg, gs);
        const auto y = testing::to_host(xg, gs), dx = testing::to_host(gg, gs);
        ASSERT_TRUE(testing::all_finite(y) && testing::all_finite(dx)) << what;
        EXPECT_LT(testing::rel_err(y, testing::to_host(xc, cs)), tol(t)) << what;
        EXPECT_LT(testing::rel_err(dx, testing::to_host(gc, cs)), tol(t)) << what;
        // Value heads and channels >= rotary_dim: bitwise untouched.
        for (int64_t e = 0; e < n; ++e) {
          const int64_t ch = e % c.d, head = (e / c.d) % (c.qpg + 2);
          if (head == c.qpg + 1 || ch >= c.rotary_dim) {
            ASSERT_EQ(y[e], xv[e]) << what << " e=" << e;
            ASSERT_EQ(dx[e], gv[e]) << what << " e=" << e;
          }
        }
        // backward(forward(x)) == x to rounding (one extra rounding per pass in bf16/fp16).
        rope_backward(xg, pos_g, cfg, gs);
        EXPECT_LT(testing::rel_err(testing::to_host(xg, gs), xv), t == DType::kF32 ? 1e-6 : 2e-2) << what;
      }
    }
  }
}

TEST(RopeCuda, UnalignedViewUsesScalarPath) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  const int64_t s = 16, b = 2, g = 2, qpg = 2, d = 64;
  const int64_t n = s * b * g * (qpg + 2) * d;
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (bool inter : {false, true}) {
      RopeConfig cfg;
      cfg.queries_per_group = qpg;
      cfg.rotary_dim = d;
      cfg.interleaved = inter;
      const auto xv = rounded(testing::randn(n + 1), t);
      auto xc = testing::make_tensor(std::vector<float>(xv.begin() + 1, xv.end()), DType::kF32, kCpu,
                                     {s, b, g, qpg + 2, d}, cs);
      rope_forward(xc, Tensor(), cfg, cs);
      auto buf = testing::make_tensor(xv, t, gpu, {n + 1}, gs);
      const Tensor x = buf.t.flat_range(1, n).view({s, b, g, qpg + 2, d});
      rope_forward(x, Tensor(), cfg, gs);
      const auto all = testing::to_host(buf, gs);
      EXPECT_EQ(all[0], xv[0]);  // the element before the view is not touched
      EXPECT_LT(testing::rel_err(testing::to_host(x, gs), testing::to_host(xc, cs)), tol(t))
          << dtype_name(t) << " inter=" << inter;
    }
  }
}

TEST(RopeCuda, BadInputThrows) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  const int64_t s = 3, b = 2, g = 1, qpg = 1, d = 8;
  OwnedTensor qkv(DType::kBF16, gpu, {s, b, g, qpg + 2, d});
  testing::upload(qkv, testing::randn(s * b * g * (qpg + 2) * d), gs);
  auto pos_gpu = testing::make_int_tensor(testing::randint(s * b, 0, 10), gpu, {s, b}, gs);
  auto pos_cpu = testing::make_int_tensor(testing::randint(s * b, 0, 10), kCpu, {s, b}, cs);
  RopeConfig cfg;
  cfg.queries_per_group = qpg;
  cfg.rotary_dim = d;
  EXPECT_NO_THROW(rope_forward(qkv, pos_gpu, cfg, gs));
  gs.synchronize();
  EXPECT_THROW(rope_forward(qkv, pos_cpu, cfg, gs), Error);   // positions on another device
  EXPECT_THROW(rope_backward(qkv, pos_cpu, cfg, gs), Error);
  EXPECT_THROW(rope_forward(qkv, pos_gpu, cfg, cs), Error);   // CPU stream, CUDA tensors
  RopeConfig odd = cfg;
  odd.rotary_dim = 3;
  EXPECT_THROW(rope_forward(qkv, pos_gpu, odd, gs), Error);   // odd rotary_dim
}

}  // namespace
}  // namespace mt
