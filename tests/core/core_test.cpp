#include <gtest/gtest.h>

#include <cmath>
#include <thread>

#include "core/buffer.h"
#include "core/cuda_graph.h"
#include "core/stream.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "testing/testing.h"

namespace mt {
namespace {

TEST(Philox, KnownAnswerRandom123) {
  // Random123 kat_vectors: philox4x32 10 rounds.
  Philox4 r = philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
  Philox4 s = philox4x32_10(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
  EXPECT_EQ(s.v[0], 0x408f276du);
  EXPECT_EQ(s.v[1], 0x41c83b0eu);
  EXPECT_EQ(s.v[2], 0xa20bc7c6u);
  EXPECT_EQ(s.v[3], 0x6d5451fdu);
  Philox4 t = philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(t.v[0], 0xd16cfe09u);
  EXPECT_EQ(t.v[1], 0x94fdccebu);
  EXPECT_EQ(t.v[2], 0x5001e420u);
  EXPECT_EQ(t.v[3], 0x24126ea1u);
}

TEST(Philox, NormalMoments) {
  const int n = 200000;
  double s = 0, s2 = 0;
  uint64_t seed = testing::test_seed();
  for (int i = 0; i < n; ++i) {
    double z = philox_normal(seed, 7, i);
    s += z;
    s2 += z * z;
  }
  EXPECT_NEAR(s / n, 0.0, 0.01);
  EXPECT_NEAR(s2 / n, 1.0, 0.02);
  // Pure function of (seed, id, index): same value twice, different ids differ.
  EXPECT_EQ(philox_normal(seed, 7, 12345), philox_normal(seed, 7, 12345));
  EXPECT_NE(philox_normal(seed, 7, 12345), philox_normal(seed, 8, 12345));
}

TEST(DType, Bf16RoundToNearestEven) {
  EXPECT_EQ(f32_to_bf16_bits(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(bf16_bits_to_f32(f32_to_bf16_bits(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(bf16_bits_to_f32(f32_to_bf16_bits(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(std::nanf("")))));
  for (float x : testing::randn(1000, 10.f)) {
    float r = bf16_bits_to_f32(f32_to_bf16_bits(x));
    EXPECT_LE(std::fabs(r - x), std::fabs(x) * (1.0f / 256));
  }
}

TEST(DType, Fp16Conversions) {
  EXPECT_EQ(f32_to_f16_bits(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16_bits(65504.f), 0x7bff);
  EXPECT_EQ(f32_to_f16_bits(1e6f), 0x7c00);               // overflow to inf
  EXPECT_EQ(f16_bits_to_f32(0x0001), std::ldexp(1.f, -24));  // smallest subnormal
  for (float x : testing::randn(1000, 100.f)) {
    float r = f16_bits_to_f32(f32_to_f16_bits(x));
    EXPECT_LE(std::fabs(r - x), std::max(std::fabs(x) * (1.0f / 1024), 6e-8f)) << x;
  }
  EXPECT_THROW(parse_dtype("fp8"), Error);
}

TEST(Tensor, ViewsAndErrors) {
  Buffer b(Device::cpu(), 24 * 4);
  Tensor t = b.as(DType::kF32, {2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.stride(0), 12);
  Tensor v = t.view({6, 4});
  EXPECT_EQ(v.size(0), 6);
  Tensor s = v.slice0(2, 5);
  EXPECT_EQ(s.data_as<float>(), t.data_as<float>() + 8);
  EXPECT_THROW(t.view({5, 5}), Error);
  EXPECT_THROW(v.slice0(4, 7), Error);
  try {
    check_tensor(t, DType::kBF16, {2, 3, 4}, "x");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x: dtype fp32 expected bf16"), std::string::npos) << e.what();
  }
}

TEST(Arena, PlanThenMaterialize) {
  Arena a = Arena::planning(Device::cpu());
  auto plan = [&] {
    a.reset();
    Tensor x = a.alloc(DType::kF32, {10}, "x");
    Tensor y = a.alloc(DType::kBF16, {3, 5}, "y");
    return std::pair{x, y};
  };
  auto [x0, y0] = plan();
  EXPECT_EQ(x0.data(), nullptr);
  EXPECT_EQ(a.used(), 512u);
  a.materialize();
  auto [x, y] = plan();
  ASSERT_NE(x.data(), nullptr);
  EXPECT_EQ(static_cast<char*>(y.data()) - static_cast<char*>(x.data()), 256);
  EXPECT_THROW(a.alloc(DType::kF32, {1000}, "too big"), Error);
}

// The counters the CUDA graph capture checks read (trainer: a captured step neither allocates nor
// synchronises): each call counts once, on the calling thread only.
TEST(CaptureCounters, CountSynchronisationsAndAllocationsOfThisThread) {
  const uint64_t s0 = host_sync_count(), a0 = buffer_allocation_count();
  Stream st(Device::cpu());
  st.synchronize();
  Event ev(Device::cpu());
  ev.synchronize();
  EXPECT_EQ(host_sync_count(), s0 + 2);
  Buffer b(Device::cpu(), 64);
  Buffer empty(Device::cpu(), 0);  // nothing allocated
  EXPECT_EQ(buffer_allocation_count(), a0 + 1);
  std::thread([] {
    Stream other(Device::cpu());
    other.synchronize();
    Buffer c(Device::cpu(), 16);
  }).join();
  EXPECT_EQ(host_sync_count(), s0 + 2);
  EXPECT_EQ(buffer_allocation_count(), a0 + 1);
  // Without a CUDA stream there is nothing to capture: a clear error, and the body never runs.
  CudaGraph g;
  bool ran = false;
  EXPECT_THROW(g.capture(st, [&] { ran = true; }), Error);
  EXPECT_FALSE(ran);
  EXPECT_FALSE(g.captured());
  EXPECT_THROW(g.launch(st), Error);
}

}  // namespace
}  // namespace mt
