// CUDA tests of the FP8 ops (ops/fp8.h, ops/fp8_matmul.h) against the CPU reference. The
// quantisers are bit-identical to the CPU: the fp32 -> FP8 conversion over every code, the
// midpoints between codes, signed zeros, subnormals, saturation, infinities and NaNs; amax, current
// and delayed scales; tensorwise cast + transpose and both blockwise layouts (scales and their
// padding) at ragged shapes, from fp32, bf16 and fp16 inputs, with aligned and unaligned outputs;
// the fused fp32 -> bf16 -> FP8 quantiser of the weights kept in their bf16 storage.
// The FP8 GEMM (cuBLASLt) against the CPU emulation: bit for bit where the products are exact in
// any accumulation order (small-integer operands, power-of-two scales), within an
// accumulation-order tolerance on random operands, for every operand-format / scaling / output
// combination cuBLASLt offers at shapes that meet its FP8 rules (m, n, k multiples of 16); and
// captured in a CUDA graph whose replays see new scales (uploaded, and computed in the graph from
// new data by the current-scaling chain amax -> scale -> quantise -> GEMM). Outputs are poisoned
// before every call; inputs are random, fresh each run (MT_TEST_SEED reproduces one).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <array>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <limits>

#include <fmt/format.h>

#include "core/cuda_graph.h"
#include "fp8_test_util.h"
#include "ops/fp8.h"
#include "ops/fp8_matmul.h"
#include "testing/testing.h"

namespace mt {
namespace {

using fp8_test::bytes_tensor;
using fp8_test::poison_bytes;
using fp8_test::to_bytes;
using testing::cpu_stream;
using testing::cuda_stream;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::poison;
using testing::rounded;
using testing::to_host;

const Device kCpu = Device::cpu(), kGpu = Device::cuda(0);

/// Element-wise bit equality of two float vectors, any NaN equal to any NaN (GPU arithmetic returns
/// a canonical NaN payload).
::testing::AssertionResult same_bits(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "sizes " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i) {
    if (f32_to_bits(got[i]) != f32_to_bits(want[i]) && !(std::isnan(got[i]) && std::isnan(want[i]))) {
      return ::testing::AssertionFailure()
             << "element " << i << ": got " << got[i] << " (0x" << std::hex << f32_to_bits(got[i]) << "), want "
             << want[i] << " (0x" << f32_to_bits(want[i]) << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same_bytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "sizes " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      return ::testing::AssertionFailure()
             << "byte " << i << ": got 0x" << std::hex << int(got[i]) << ", want 0x" << int(want[i]);
    }
  }
  return ::testing::AssertionSuccess();
}

const std::vector<DType> kInputs = {DType::kF32, DType::kBF16, DType::kF16};
const std::vector<DType> kFormats = {DType::kF8E4M3, DType::kF8E5M2};

/// A GPU tensor placed `offset` bytes into its allocation (offset 1: unaligned FP8 rows).
struct OffsetBytes {
  OwnedTensor storage;
  Tensor t;
  OffsetBytes(DType dtype, const std::vector<int64_t>& shape, int64_t offset) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    storage = OwnedTensor(dtype, kGpu, {n + offset});
    t = storage.t.flat_range(offset, n).view(shape);
  }
};

// ------------------------------------------------------------------------------------------------
// The conversion.

/// Every value class the conversion meets: every code's value, the midpoints between codes and the
/// floats beside them, signed zeros, fp32 subnormals, values beyond the range, infinities, NaNs.
std::vector<float> special_values(DType t) {
  std::vector<float> v;
  for (int c = 0; c < 256; ++c) {
    const float a = fp8_bits_to_f32(t, static_cast<uint8_t>(c));
    v.push_back(a);
    if ((c & 0x7f) < 0x7f && std::isfinite(a)) {
      const float b = fp8_bits_to_f32(t, static_cast<uint8_t>(c + 1));
      if (std::isfinite(b)) {
        const float mid = (a + b) / 2;
        v.insert(v.end(), {mid, std::nextafter(mid, 0.f), std::nextafter(mid, INFINITY), -mid});
      }
    }
  }
  const float big = fp8_max(t);
  v.insert(v.end(), {0.f, -0.f, 1e-45f, -1e-45f, 1e-39f, -1e-39f, big, -big, std::nextafter(big, INFINITY), big * 1.07f,
                     big * 1.0625f, -big * 1.1f, 1e30f, -1e30f, FLT_MAX, -FLT_MAX, INFINITY, -INFINITY});
  for (uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7fe00000u, 0xffa00001u, 0x7f800001u, 0x7fffffffu}) {
    v.push_back(bits_to_f32(nan));
  }
  return v;
}

TEST(Fp8Cuda, ConversionIsBitIdenticalToTheHost) {
  MT_REQUIRE_CUDA();
  for (DType t : kFormats) {
    std::vector<float> v = special_values(t);
    const int64_t cols = 97, rows = (static_cast<int64_t>(v.size()) + cols - 1) / cols;
    v.resize(static_cast<size_t>(rows * cols), 0.5f);
    auto x = make_tensor(v, DType::kF32, kGpu, {rows, cols}, cuda_stream());
    auto one = make_tensor({1.f}, DType::kF32, kGpu, {1}, cuda_stream());
    OwnedTensor q(t, kGpu, {rows, cols}), qt(t, kGpu, {cols, rows});
    poison_bytes(q, cuda_stream(), 0x55);
    poison_bytes(qt, cuda_stream(), 0x55);
    fp8_quantize(q, qt, x, one, Tensor(), cuda_stream());
    const auto qb = to_bytes(q, cuda_stream()), qtb = to_bytes(qt, cuda_stream());
    for (int64_t i = 0; i < rows * cols; ++i) {
      const uint8_t want = fp8_math::quantize_value(t, v[static_cast<size_t>(i)], 1.f);
      ASSERT_EQ(qb[static_cast<size_t>(i)], want) << dtype_name(t) << " value " << v[static_cast<size_t>(i)] << " (0x"
                                                  << std::hex << f32_to_bits(v[static_cast<size_t>(i)]) << ")";
      ASSERT_EQ(qtb[static_cast<size_t>((i % cols) * rows + i / cols)], want);
    }
    // Dequantisation: every code back to fp32, bit for bit (NaN codes to a NaN).
    std::vector<uint8_t> codes(256);
    for (int c = 0; c < 256; ++c) codes[static_cast<size_t>(c)] = static_cast<uint8_t>(c);
    auto qc = bytes_tensor(codes, t, kGpu, {16, 16}, cuda_stream());
    OwnedTensor y(DType::kF32, kGpu, {16, 16});
    poison(y, cuda_stream());
    fp8_dequantize(y, qc, one, Fp8Scaling::kTensor, cuda_stream());
    std::vector<float> want(256);
    for (int c = 0; c < 256; ++c) want[static_cast<size_t>(c)] = fp8_bits_to_f32(t, static_cast<uint8_t>(c));
    EXPECT_TRUE(same_bits(to_host(y, cuda_stream()), want)) << dtype_name(t);
  }
}

// ------------------------------------------------------------------------------------------------
// amax and scales.

TEST(Fp8Cuda, AmaxMatchesCpu) {
  MT_REQUIRE_CUDA();
  for (DType dt : kInputs) {
    for (int64_t n : {1, 7, 1000, 4099, 1 << 20}) {
      for (int64_t offset : {0, 1}) {  // offset 1: the unvectorised path
        std::vector<float> v = testing::randn(n, 3.f);
        if (n > 10) {
          v[3] = NAN;
          v[static_cast<size_t>(n / 2)] = dt == DType::kF32 ? -1e30f : -60000.f;
        }
        v = rounded(v, dt);  // the values the GPU tensor holds
        OwnedTensor store(dt, kGpu, {n + offset});
        const Tensor x = store.t.flat_range(offset, n);
        testing::upload(x, v, cuda_stream());
        auto ga = make_tensor({-5.f}, DType::kF32, kGpu, {1}, cuda_stream());
        auto ca = make_tensor({-5.f}, DType::kF32, kCpu, {1}, cpu_stream());
        fp8_amax(ga, x, cuda_stream());
        fp8_amax(ca, make_tensor(v, DType::kF32, kCpu, {n}, cpu_stream()), cpu_stream());
        EXPECT_TRUE(same_bits(to_host(ga, cuda_stream()), to_host(ca, cpu_stream())))
            << dtype_name(dt) << " n=" << n << " offset=" << offset;
      }
    }
  }
}

TEST(Fp8Cuda, CurrentAndDelayedScalesMatchCpu) {
  MT_REQUIRE_CUDA();
  const std::vector<float> amax = {0.f, 1.f, 3.f, 1e-40f, INFINITY, NAN, 1e-3f, 448.f, 57344.f, 7.25f, 1e30f};
  const int64_t n = static_cast<int64_t>(amax.size());
  for (DType t : kFormats) {
    for (bool pow2 : {false, true}) {
      for (float eps : {0.f, 0.01f}) {
        OwnedTensor gs(DType::kF32, kGpu, {n}), gsi(DType::kF32, kGpu, {n}), cs(DType::kF32, kCpu, {n}),
            csi(DType::kF32, kCpu, {n});
        poison(gs, cuda_stream());
        poison(gsi, cuda_stream());
        fp8_scale_from_amax(gs, gsi, make_tensor(amax, DType::kF32, kGpu, {n}, cuda_stream()), t, pow2, eps,
                            cuda_stream());
        fp8_scale_from_amax(cs, csi, make_tensor(amax, DType::kF32, kCpu, {n}, cpu_stream()), t, pow2, eps,
                            cpu_stream());
        EXPECT_TRUE(same_bits(to_host(gs, cuda_stream()), to_host(cs, cpu_stream())));
        EXPECT_TRUE(same_bits(to_host(gsi, cuda_stream()), to_host(csi, cpu_stream())));
      }
    }
  }
  // Delayed: 300 tensors (more than one CTA), history 5, several steps with fresh records (some 0,
  // some inf / NaN / tiny), both algorithms, a margin.
  for (auto algo : {fp8_math::AmaxAlgo::kMax, fp8_math::AmaxAlgo::kMostRecent}) {
    const int64_t len = 5, cols = 300;
    std::vector<float> h(static_cast<size_t>(len * cols), 0.f);
    auto gh = make_tensor(h, DType::kF32, kGpu, {len, cols}, cuda_stream());
    auto ch = make_tensor(h, DType::kF32, kCpu, {len, cols}, cpu_stream());
    auto gs = make_tensor(std::vector<float>(cols, 1.f), DType::kF32, kGpu, {cols}, cuda_stream());
    auto cs = make_tensor(std::vector<float>(cols, 1.f), DType::kF32, kCpu, {cols}, cpu_stream());
    OwnedTensor gsi(DType::kF32, kGpu, {cols}), csi(DType::kF32, kCpu, {cols});
    for (int step = 0; step < 8; ++step) {
      std::vector<float> rec = testing::randu(cols, 0.f, 10.f);
      for (int64_t i = 0; i < cols; i += 7) rec[static_cast<size_t>(i)] = 0.f;
      rec[1] = step == 2 ? INFINITY : rec[1];
      rec[2] = step == 3 ? NAN : rec[2];
      rec[4] = 1e-39f;
      h = to_host(ch, cpu_stream());
      std::copy(rec.begin(), rec.end(), h.begin());  // row 0
      testing::upload(ch, h, cpu_stream());
      testing::upload(gh, h, cuda_stream());
      poison(gsi, cuda_stream());
      fp8_delayed_scale_update(gh, gs, gsi, DType::kF8E5M2, 1, algo, cuda_stream());
      fp8_delayed_scale_update(ch, cs, csi, DType::kF8E5M2, 1, algo, cpu_stream());
      EXPECT_TRUE(same_bits(to_host(gh, cuda_stream()), to_host(ch, cpu_stream()))) << "step " << step;
      EXPECT_TRUE(same_bits(to_host(gs, cuda_stream()), to_host(cs, cpu_stream()))) << "step " << step;
      EXPECT_TRUE(same_bits(to_host(gsi, cuda_stream()), to_host(csi, cpu_stream()))) << "step " << step;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Quantisers.

const std::vector<std::pair<int64_t, int64_t>> kShapes = {{1, 1},     {3, 5},    {127, 129}, {128, 128},
                                                          {130, 260}, {257, 33}, {64, 1000}, {515, 384}};

/// x [rows, cols] random (with a few outliers), rounded through the input dtype.
std::vector<float> random_input(int64_t rows, int64_t cols, DType dt) {
  std::vector<float> v = testing::randn(rows * cols, 2.f);
  std::uniform_int_distribution<int64_t> d(0, rows * cols - 1);
  for (int i = 0; i < 4; ++i) v[static_cast<size_t>(d(testing::test_rng()))] *= 100.f;
  return rounded(v, dt);
}

TEST(Fp8Cuda, TensorwiseCastTransposeMatchesCpu) {
  MT_REQUIRE_CUDA();
  for (const auto& [rows, cols] : kShapes) {
    for (DType dt : kInputs) {
      for (DType t : kFormats) {
        for (int64_t offset : {0, 1}) {
          SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " " << dtype_name(dt) << " -> " << dtype_name(t)
                                            << " offset " << offset);
          const std::vector<float> v = random_input(rows, cols, dt);
          auto gx = make_tensor(v, dt, kGpu, {rows, cols}, cuda_stream());
          auto cx = make_tensor(v, DType::kF32, kCpu, {rows, cols}, cpu_stream());
          const float s = std::ldexp(testing::randu(1, 1.f, 2.f)[0], 3);
          auto gs = make_tensor({s}, DType::kF32, kGpu, {1}, cuda_stream());
          auto cs = make_tensor({s}, DType::kF32, kCpu, {1}, cpu_stream());
          auto ga = make_tensor({0.5f}, DType::kF32, kGpu, {1}, cuda_stream());
          auto ca = make_tensor({0.5f}, DType::kF32, kCpu, {1}, cpu_stream());
          OffsetBytes gq(t, {rows, cols}, offset), gqt(t, {cols, rows}, offset);
          OwnedTensor cq(t, kCpu, {rows, cols}), cqt(t, kCpu, {cols, rows});
          poison_bytes(gq.t, cuda_stream());
          poison_bytes(gqt.t, cuda_stream());
          fp8_quantize(gq.t, gqt.t, gx, gs, ga, cuda_stream());
          fp8_quantize(cq, cqt, cx, cs, ca, cpu_stream());
          EXPECT_TRUE(same_bytes(to_bytes(gq.t, cuda_stream()), to_bytes(cq, cpu_stream())));
          EXPECT_TRUE(same_bytes(to_bytes(gqt.t, cuda_stream()), to_bytes(cqt, cpu_stream())));
          EXPECT_TRUE(same_bits(to_host(ga, cuda_stream()), to_host(ca, cpu_stream())));
          // One output at a time.
          poison_bytes(gqt.t, cuda_stream());
          fp8_quantize(Tensor(), gqt.t, gx, gs, Tensor(), cuda_stream());
          EXPECT_TRUE(same_bytes(to_bytes(gqt.t, cuda_stream()), to_bytes(cqt, cpu_stream())));
          poison_bytes(gq.t, cuda_stream());
          fp8_quantize(gq.t, Tensor(), gx, gs, Tensor(), cuda_stream());
          EXPECT_TRUE(same_bytes(to_bytes(gq.t, cuda_stream()), to_bytes(cq, cpu_stream())));
        }
      }
    }
  }
}

// fp8_quantize_bf16_rounded (the weights kept in their bf16 storage, quantised from the fp32 main
// parameters): the CUDA kernel bit for bit the CPU's at ragged shapes, both formats, tensorwise (amax
// rounded to bf16, scale, scale_inv, q, q_t) and delayed (the record, q, q_t), on values at and
// around bf16 ties, NaN, infinities and values that saturate or round to bf16 infinity; and the
// GPU path it replaced (the fp32 values cast to bf16, then fp8_amax / fp8_quantize of the bf16).
TEST(Fp8Cuda, Bf16RoundedQuantizeMatchesCpuAndStagedBf16) {
  MT_REQUIRE_CUDA();
  const float delayed = 37.5f;
  for (const auto& [rows, cols] : kShapes) {
    for (DType t : kFormats) {
      for (const bool specials : {false, true}) {
        for (const float* scale : {static_cast<const float*>(nullptr), &delayed}) {
          if (specials && rows * cols < 12) continue;
          SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " " << dtype_name(t) << " specials " << specials
                                            << (scale ? " delayed" : " tensorwise"));
          const std::vector<float> x = fp8_test::bf16_rounding_values(rows * cols, 3.f, specials);
          const auto g = fp8_test::quantize_weight_values(x, rows, cols, t, scale, true, kGpu, cuda_stream());
          for (const auto& want :
               {fp8_test::quantize_weight_values(x, rows, cols, t, scale, true, kCpu, cpu_stream()),
                fp8_test::quantize_weight_values(x, rows, cols, t, scale, false, kGpu, cuda_stream())}) {
            EXPECT_TRUE(same_bits(g.amax, want.amax));
            EXPECT_TRUE(same_bits(g.scale, want.scale));
            EXPECT_TRUE(same_bits(g.scale_inv, want.scale_inv));
            EXPECT_TRUE(same_bytes(g.q, want.q));
            EXPECT_TRUE(same_bytes(g.q_t, want.q_t));
          }
        }
      }
    }
  }
}

TEST(Fp8Cuda, BlockwiseQuantizeMatchesCpu) {
  MT_REQUIRE_CUDA();
  for (const auto& [rows, cols] : kShapes) {
    for (Fp8Scaling sc : {Fp8Scaling::kBlock1x128, Fp8Scaling::kBlock128x128}) {
      for (DType dt : kInputs) {
        for (DType t : kFormats) {
          for (bool pow2 : {true, false}) {
            SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " scaling " << int(sc) << " " << dtype_name(dt)
                                              << " -> " << dtype_name(t) << " pow2 " << pow2);
            const std::vector<float> v = random_input(rows, cols, dt);
            auto gx = make_tensor(v, dt, kGpu, {rows, cols}, cuda_stream());
            auto cx = make_tensor(v, DType::kF32, kCpu, {rows, cols}, cpu_stream());
            const auto ss = fp8_scale_shape(sc, rows, cols), sst = fp8_scale_shape(sc, cols, rows);
            OwnedTensor gq(t, kGpu, {rows, cols}), gqt(t, kGpu, {cols, rows}), gs(DType::kF32, kGpu, ss),
                gst(DType::kF32, kGpu, sst);
            OwnedTensor cq(t, kCpu, {rows, cols}), cqt(t, kCpu, {cols, rows}), cs(DType::kF32, kCpu, ss),
                cst(DType::kF32, kCpu, sst);
            for (const Tensor* p : {&gq.t, &gqt.t}) poison_bytes(*p, cuda_stream());
            poison(gs, cuda_stream());
            poison(gst, cuda_stream());
            fp8_quantize_blockwise(gq, gs, gqt, gst, gx, sc, pow2, cuda_stream());
            fp8_quantize_blockwise(cq, cs, cqt, cst, cx, sc, pow2, cpu_stream());
            EXPECT_TRUE(same_bytes(to_bytes(gq, cuda_stream()), to_bytes(cq, cpu_stream())));
            EXPECT_TRUE(same_bytes(to_bytes(gqt, cuda_stream()), to_bytes(cqt, cpu_stream())));
            EXPECT_TRUE(same_bits(to_host(gs, cuda_stream()), to_host(cs, cpu_stream())));  // padding included
            EXPECT_TRUE(same_bits(to_host(gst, cuda_stream()), to_host(cst, cpu_stream())));
            // The transpose alone, then the rows alone.
            poison_bytes(gqt, cuda_stream());
            poison(gst, cuda_stream());
            fp8_quantize_blockwise(Tensor(), Tensor(), gqt, gst, gx, sc, pow2, cuda_stream());
            EXPECT_TRUE(same_bytes(to_bytes(gqt, cuda_stream()), to_bytes(cqt, cpu_stream())));
            EXPECT_TRUE(same_bits(to_host(gst, cuda_stream()), to_host(cst, cpu_stream())));
            poison_bytes(gq, cuda_stream());
            poison(gs, cuda_stream());
            fp8_quantize_blockwise(gq, gs, Tensor(), Tensor(), gx, sc, pow2, cuda_stream());
            EXPECT_TRUE(same_bytes(to_bytes(gq, cuda_stream()), to_bytes(cq, cpu_stream())));
            EXPECT_TRUE(same_bits(to_host(gs, cuda_stream()), to_host(cs, cpu_stream())));
            // Dequantisation of both, into fp32 (bit for bit) and bf16 (the fp32 value rounded).
            for (DType yt : {DType::kF32, DType::kBF16}) {
              OwnedTensor gy(yt, kGpu, {rows, cols}), cy(DType::kF32, kCpu, {rows, cols});
              poison(gy, cuda_stream());
              fp8_dequantize(gy, gq, gs, sc, cuda_stream());
              fp8_dequantize(cy, cq, cs, sc, cpu_stream());
              EXPECT_TRUE(same_bits(to_host(gy, cuda_stream()), rounded(to_host(cy, cpu_stream()), yt)));
            }
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The FP8 GEMM.

bool block_scaling_supported() {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return false;
  return p.major == 9;  // cuBLASLt's VEC128 / BLK128x128 FP8 kernels are Hopper's
}

struct GemmCase {
  int64_t m, n, k;
  DType at, bt;
  Fp8Scaling sa, sb;
  DType out;
  bool accumulate, fast_accum;
};

std::string describe(const GemmCase& g) {
  return fmt::format("m={} n={} k={} a={} b={} scalings=({}, {}) out={} accumulate={} fast_accum={}", g.m, g.n, g.k,
                     dtype_name(g.at), dtype_name(g.bt), int(g.sa), int(g.sb), dtype_name(g.out), g.accumulate,
                     g.fast_accum);
}

/// Operands of one case on both devices: FP8 codes (and their absolute values, for the error
/// bound) and scales.
struct GemmOperands {
  std::vector<uint8_t> a, b;
  std::vector<float> sa, sb, c0;
};

GemmOperands make_operands(const GemmCase& g, bool exact) {
  GemmOperands o;
  o.a = exact ? fp8_test::integer_codes(g.m * g.k, g.at, 3) : fp8_test::random_codes(g.m * g.k, g.at, 64.f);
  o.b = exact ? fp8_test::integer_codes(g.n * g.k, g.bt, 3) : fp8_test::random_codes(g.n * g.k, g.bt, 64.f);
  // Power-of-two scales for the blockwise recipe (its default) and for exact products; exact
  // blockwise sums need the scaled block partials within fp32's 24 bits of each other: 2^-2..2^2.
  const bool pow2 = exact || g.sa != Fp8Scaling::kTensor;
  o.sa = fp8_test::random_scales(g.sa, g.m, g.k, pow2, exact ? 2 : 6);
  o.sb = fp8_test::random_scales(g.sb, g.n, g.k, pow2, exact ? 2 : 6);
  o.c0 = rounded(testing::randn(g.m * g.n, 4.f), exact ? DType::kBF16 : DType::kF32);
  if (exact) {
    for (auto& c : o.c0) c = std::round(c);
  }
  return o;
}

/// Runs the case on `dev` (out dtype g.out on CUDA, fp32 on the CPU) with codes `a`, `b`;
/// separate_c (with accumulate): the addend c0 in its own tensor (cuBLASLt's C != D), d poisoned,
/// c checked unchanged.
std::vector<float> run_gemm(const GemmCase& g, const GemmOperands& o, const std::vector<uint8_t>& a,
                            const std::vector<uint8_t>& b, const std::vector<float>& c0, Device dev,
                            bool separate_c = false, const std::vector<float>& bias = {}) {
  const Stream& st = dev.is_cpu() ? cpu_stream() : cuda_stream();
  auto at = bytes_tensor(a, g.at, dev, {g.m, g.k}, st);
  auto bt = bytes_tensor(b, g.bt, dev, {g.n, g.k}, st);
  auto sat = make_tensor(o.sa, DType::kF32, dev, fp8_scale_shape(g.sa, g.m, g.k), st);
  auto sbt = make_tensor(o.sb, DType::kF32, dev, fp8_scale_shape(g.sb, g.n, g.k), st);
  auto d = make_tensor(c0, dev.is_cpu() ? DType::kF32 : g.out, dev, {g.m, g.n}, st);
  OwnedTensor c;
  std::vector<float> c_before;
  if (separate_c) {
    c = make_tensor(c0, dev.is_cpu() ? DType::kF32 : g.out, dev, {g.m, g.n}, st);
    c_before = to_host(c, st);
    poison(d, st);
  }
  if (!g.accumulate) poison(d, st);
  OwnedTensor bt_bias;
  if (!bias.empty()) bt_bias = make_tensor(bias, dev.is_cpu() ? DType::kF32 : g.out, dev, {g.n}, st);
  fp8_matmul(d, {at, sat, g.sa}, {bt, sbt, g.sb}, g.accumulate, g.fast_accum, st, separate_c ? c.t : Tensor(),
             bias.empty() ? Tensor() : bt_bias.t);
  if (separate_c) EXPECT_EQ(to_host(c, st), c_before) << "the addend c was written";
  return to_host(d, st);
}

/// Largest |gpu - cpu| / Σ|products| seen, per accumulation mode (printed at the end, to tighten
/// the tolerances from a GPU run).
double g_worst_split = 0, g_worst_fast = 0;

void check_gemm_result(const GemmCase& g, const GemmOperands& o, const std::vector<float>& c0,
                       const std::vector<float>& cpu, const std::vector<float>& gpu, bool exact);

void check_gemm(const GemmCase& g, bool exact) {
  SCOPED_TRACE(describe(g) + (exact ? " exact" : " random"));
  const GemmOperands o = make_operands(g, exact);
  const std::vector<float> c0 = g.accumulate ? o.c0 : std::vector<float>(static_cast<size_t>(g.m * g.n), 0.f);
  const std::vector<float> gpu_in_place = run_gemm(g, o, o.a, o.b, c0, kGpu);
  const std::vector<float> cpu = run_gemm(g, o, o.a, o.b, c0, kCpu);
  // with accumulate, also C != D (forward_add's residual read from its own tensor)
  for (bool separate_c : {false, true}) {
    if (separate_c && !g.accumulate) break;
    SCOPED_TRACE(separate_c ? "C != D" : "C = D");
    check_gemm_result(g, o, c0, cpu, separate_c ? run_gemm(g, o, o.a, o.b, c0, kGpu, true) : gpu_in_place, exact);
  }
}

void check_gemm_result(const GemmCase& g, const GemmOperands& o, const std::vector<float>& c0,
                       const std::vector<float>& cpu, const std::vector<float>& gpu, bool exact) {
  ASSERT_TRUE(testing::all_finite(gpu));
  if (exact) {  // exact in any order: fp32 bit for bit, bf16 within its rounding (one ulp)
    // A bf16 C: cuBLASLt rounds D = AB + C once, or (some of its FP8 algorithms, seen on an H200
    // for e5m2 x e4m3) rounds AB to bf16 before adding C — what the unfused GEMM + add computes.
    std::vector<float> twice;
    if (g.out == DType::kBF16 && g.accumulate) {
      twice = rounded(run_gemm(g, o, o.a, o.b, std::vector<float>(cpu.size(), 0.f), kCpu), DType::kBF16);
      for (size_t i = 0; i < twice.size(); ++i) twice[i] += c0[i];
      twice = rounded(twice, DType::kBF16);
    }
    for (size_t i = 0; i < cpu.size(); ++i) {
      if (g.out == DType::kF32) {
        ASSERT_EQ(gpu[i], cpu[i]) << "element " << i;
      } else if (twice.empty() || gpu[i] != twice[i]) {
        ASSERT_LE(std::fabs(gpu[i] - cpu[i]), std::ldexp(std::fabs(cpu[i]), -7))
            << "element " << i << (twice.empty() ? "" : fmt::format(" (rounded twice: {})", twice[i]));
      }
    }
    return;
  }
  // Tolerance: the accumulation order and the FP8 tensor cores' reduced-precision partial sums
  // (about 14 bits between promotions, DeepSeek-V3 §3.3; never promoted with fast accumulation)
  // against Σ|products|, plus the rounding of a bf16 output. Loose on purpose: a wrong scale or
  // layout is what the exact cases above catch, bit for bit; these check random FP8 values.
  std::vector<uint8_t> aa = o.a, ba = o.b;
  for (auto& c : aa) c &= 0x7f;
  for (auto& c : ba) c &= 0x7f;
  std::vector<float> c0abs = c0;
  for (auto& c : c0abs) c = std::fabs(c);
  GemmCase gabs = g;
  gabs.out = DType::kF32;
  const std::vector<float> bound = run_gemm(gabs, o, aa, ba, c0abs, kCpu);
  const double rel = g.fast_accum ? std::ldexp(1.0, -5) : std::ldexp(1.0, -8);
  const double out_rel = g.out == DType::kBF16 ? std::ldexp(1.0, -8) : 0.0;
  double worst = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double err = std::fabs(static_cast<double>(gpu[i]) - cpu[i]);
    worst = std::max(worst, (err - out_rel * std::fabs(cpu[i])) / (bound[i] + 1e-30));
    ASSERT_LE(err, rel * bound[i] + out_rel * std::fabs(cpu[i]) + 1e-30)
        << "element " << i << ": gpu " << gpu[i] << " cpu " << cpu[i] << " sum|p| " << bound[i];
  }
  double& w = g.fast_accum ? g_worst_fast : g_worst_split;
  w = std::max(w, worst);
}

const std::vector<std::array<int64_t, 3>> kGemmShapes = {{16, 16, 16},     {48, 80, 272},   {144, 160, 400},
                                                         {272, 336, 1040}, {512, 768, 256}, {64, 2304, 768}};

TEST(Fp8Cuda, TensorwiseGemmMatchesCpuEmulation) {
  MT_REQUIRE_CUDA();
  const std::vector<std::pair<DType, DType>> formats = {
      {DType::kF8E4M3, DType::kF8E4M3}, {DType::kF8E5M2, DType::kF8E4M3}, {DType::kF8E4M3, DType::kF8E5M2}};
  for (const auto& [m, n, k] : kGemmShapes) {
    for (const auto& [at, bt] : formats) {
      for (DType out : {DType::kBF16, DType::kF32}) {
        for (bool acc : {false, true}) {
          for (bool fast : {false, true}) {
            const GemmCase g{m, n, k, at, bt, Fp8Scaling::kTensor, Fp8Scaling::kTensor, out, acc, fast};
            if (!fast) check_gemm(g, /*exact=*/true);
            check_gemm(g, /*exact=*/false);
          }
        }
      }
    }
  }
  std::printf("[fp8] tensorwise GEMM: worst |gpu - cpu| / sum|p| = %.3g (split accumulator), %.3g (fast)\n",
              g_worst_split, g_worst_fast);
}

// The bias epilogue (tensorwise; the linear layers' biases): d = product (+ c) + bias on the GPU
// (cuBLASLt's BIAS epilogue for a bf16 d, the pass after the GEMM for an fp32 d) against the CPU
// emulation, on exact operands: fp32 d bit for bit, bf16 d within its rounding; with C = D, C != D
// and without accumulation; the bias large enough that a missing or misplaced one fails the bound.
// Without C the bf16 d is the exact value rounded once — the epilogue's; the fallback (the product
// rounded, then the bias added and rounded again) differs from it in some elements, checked.
TEST(Fp8Cuda, GemmBiasEpilogueMatchesCpuEmulation) {
  MT_REQUIRE_CUDA();
  for (const DType out : {DType::kBF16, DType::kF32})
    for (const bool accumulate : {false, true})
      for (const bool separate_c : {false, true}) {
        if (separate_c && !accumulate) continue;
        const GemmCase g{48, 80, 96, DType::kF8E4M3, DType::kF8E4M3, Fp8Scaling::kTensor, Fp8Scaling::kTensor, out,
                         accumulate, false};
        SCOPED_TRACE(describe(g) + (separate_c ? " C != D" : ""));
        GemmOperands o = make_operands(g, /*exact=*/true);
        // integers up to 16: sums of 96 products need more bits than bf16's 8, so rounding the
        // product before the bias (the fallback) differs from the epilogue's one rounding
        o.a = fp8_test::integer_codes(g.m * g.k, g.at, 16);
        o.b = fp8_test::integer_codes(g.n * g.k, g.bt, 16);
        const std::vector<float> c0 = accumulate ? o.c0 : std::vector<float>(static_cast<size_t>(g.m * g.n), 0.f);
        std::vector<float> bias = rounded(testing::randn(g.n, 64.f), DType::kBF16);
        for (auto& b : bias) b = std::round(b);
        const std::vector<float> cpu = run_gemm(g, o, o.a, o.b, c0, kCpu, false, bias);
        const std::vector<float> nobias = run_gemm(g, o, o.a, o.b, c0, kCpu);
        const std::vector<float> gpu = run_gemm(g, o, o.a, o.b, c0, kGpu, separate_c, bias);
        ASSERT_TRUE(testing::all_finite(gpu));
        const std::vector<float> once = rounded(cpu, DType::kBF16);
        std::vector<float> twice = rounded(nobias, DType::kBF16);
        for (size_t i = 0; i < twice.size(); ++i) twice[i] += bias[i % static_cast<size_t>(g.n)];
        twice = rounded(twice, DType::kBF16);
        size_t differ = 0;
        for (size_t i = 0; i < cpu.size(); ++i) {
          ASSERT_EQ(cpu[i], (nobias[i]) + bias[i % static_cast<size_t>(g.n)]) << "CPU: (product + c) + bias, " << i;
          differ += once[i] != twice[i];
          if (out == DType::kF32) {
            ASSERT_EQ(gpu[i], cpu[i]) << "element " << i;
          } else if (!accumulate) {
            ASSERT_EQ(gpu[i], once[i]) << "element " << i << " (rounded twice: " << twice[i] << ")";
          } else {
            ASSERT_LE(std::fabs(gpu[i] - cpu[i]), std::ldexp(std::fabs(cpu[i]), -7)) << "element " << i;
          }
        }
        if (out == DType::kBF16 && !accumulate) EXPECT_GT(differ, 0u) << "the case cannot tell one rounding from two";
      }
}

TEST(Fp8Cuda, BlockwiseGemmMatchesCpuEmulation) {
  MT_REQUIRE_CUDA();
  if (!block_scaling_supported()) GTEST_SKIP() << "cuBLASLt's FP8 block scaling runs on sm_90 only";
  const std::vector<std::pair<Fp8Scaling, Fp8Scaling>> scalings = {
      {Fp8Scaling::kBlock1x128, Fp8Scaling::kBlock128x128},  // fprop x·wᵀ, dgrad dy·(wᵀ)ᵀ
      {Fp8Scaling::kBlock128x128, Fp8Scaling::kBlock1x128},
      {Fp8Scaling::kBlock1x128, Fp8Scaling::kBlock1x128}};  // wgrad dyᵀ·(xᵀ)ᵀ
  for (const auto& [m, n, k] : kGemmShapes) {
    for (const auto& [sa, sb] : scalings) {
      for (const auto& [at, bt] :
           {std::pair{DType::kF8E4M3, DType::kF8E4M3}, std::pair{DType::kF8E5M2, DType::kF8E4M3}}) {
        for (DType out : {DType::kBF16, DType::kF32}) {
          for (bool acc : {false, true}) {
            if (acc && out != DType::kF32) continue;  // refused: cuBLASLt rounds twice (fp8_matmul)
            const GemmCase g{m, n, k, at, bt, sa, sb, out, acc, false};
            check_gemm(g, true);
            check_gemm(g, false);
          }
        }
      }
    }
  }
  std::printf("[fp8] blockwise GEMM: worst |gpu - cpu| / sum|p| = %.3g\n", g_worst_split);
}

// ------------------------------------------------------------------------------------------------
// CUDA graphs: no host synchronisation, scales read at replay.

TEST(Fp8Cuda, GemmInAGraphReadsNewScalesAtEveryReplay) {
  MT_REQUIRE_CUDA();
  const GemmCase g{64,          96,    256,  DType::kF8E4M3, DType::kF8E5M2, Fp8Scaling::kTensor, Fp8Scaling::kTensor,
                   DType::kF32, false, false};
  const GemmOperands o = make_operands(g, true);
  const Stream& st = cuda_stream();
  auto at = bytes_tensor(o.a, g.at, kGpu, {g.m, g.k}, st);
  auto bt = bytes_tensor(o.b, g.bt, kGpu, {g.n, g.k}, st);
  OwnedTensor sa(DType::kF32, kGpu, {1}), sb(DType::kF32, kGpu, {1}), d(DType::kF32, kGpu, {g.m, g.n});
  testing::upload(sa, {1.f}, st);
  testing::upload(sb, {1.f}, st);
  fp8_matmul(d, {at, sa}, {bt, sb}, false, false, st);  // warm-up: the plan is built outside the capture
  st.synchronize();
  CudaGraph graph;
  graph.capture(st, [&] { fp8_matmul(d, {at, sa}, {bt, sb}, false, false, st); });
  for (float s : {0.5f, 8.f, 0.03125f}) {
    GemmOperands oo = o;
    oo.sa = {s};
    oo.sb = {2.f * s};
    testing::upload(sa, oo.sa, st);
    testing::upload(sb, oo.sb, st);
    poison(d, st);
    graph.launch(st);
    const auto want = run_gemm(g, oo, o.a, o.b, std::vector<float>(static_cast<size_t>(g.m * g.n), 0.f), kCpu);
    EXPECT_TRUE(same_bits(to_host(d, st), want)) << "scales " << s << ", " << 2 * s;
  }
}

/// The current-scaling chain of a linear layer's forward (amax -> scale -> cast + transpose of x
/// and w -> FP8 GEMM), or the blockwise one (quantise -> GEMM), captured once and replayed on new
/// x and w: the graph computes the new scales on the device.
void check_chain_graph(bool blockwise) {
  const int64_t m = 128, n = 144, k = 384;
  const Stream& st = cuda_stream();
  const Fp8Scaling sx = blockwise ? Fp8Scaling::kBlock1x128 : Fp8Scaling::kTensor;
  const Fp8Scaling sw = blockwise ? Fp8Scaling::kBlock128x128 : Fp8Scaling::kTensor;
  struct Side {
    OwnedTensor x, w, xq, xqt, wq, wqt, xs, xts, ws, wts, xamax, wamax, xscale, wscale, y;
  };
  auto make_side = [&](Device dev, DType act) {
    Side s;
    s.x = OwnedTensor(act, dev, {m, k});
    s.w = OwnedTensor(act, dev, {n, k});
    s.xq = OwnedTensor(DType::kF8E4M3, dev, {m, k});
    s.xqt = OwnedTensor(DType::kF8E4M3, dev, {k, m});
    s.wq = OwnedTensor(DType::kF8E4M3, dev, {n, k});
    s.wqt = OwnedTensor(DType::kF8E4M3, dev, {k, n});
    s.xs = OwnedTensor(DType::kF32, dev, fp8_scale_shape(sx, m, k));
    s.xts = OwnedTensor(DType::kF32, dev, fp8_scale_shape(sx, k, m));
    s.ws = OwnedTensor(DType::kF32, dev, fp8_scale_shape(sw, n, k));
    s.wts = OwnedTensor(DType::kF32, dev, fp8_scale_shape(sw, k, n));
    for (OwnedTensor* t : {&s.xamax, &s.wamax, &s.xscale, &s.wscale}) *t = OwnedTensor(DType::kF32, dev, {1});
    s.y = OwnedTensor(DType::kF32, dev, {m, n});
    return s;
  };
  auto forward = [&](Side& s, const Stream& stream) {
    if (blockwise) {
      fp8_quantize_blockwise(s.xq, s.xs, s.xqt, s.xts, s.x, sx, true, stream);
      fp8_quantize_blockwise(s.wq, s.ws, s.wqt, s.wts, s.w, sw, true, stream);
    } else {
      fp8_amax(s.xamax, s.x, stream);
      fp8_amax(s.wamax, s.w, stream);
      fp8_scale_from_amax(s.xscale, s.xs, s.xamax, DType::kF8E4M3, false, 0.f, stream);
      fp8_scale_from_amax(s.wscale, s.ws, s.wamax, DType::kF8E4M3, false, 0.f, stream);
      fp8_quantize(s.xq, s.xqt, s.x, s.xscale, Tensor(), stream);
      fp8_quantize(s.wq, s.wqt, s.w, s.wscale, Tensor(), stream);
    }
    fp8_matmul(s.y, {s.xq, s.xs, sx}, {s.wq, s.ws, sw}, false, false, stream);
  };
  Side gpu = make_side(kGpu, DType::kBF16), cpu = make_side(kCpu, DType::kF32);
  testing::upload(gpu.x, rounded(testing::randn(m * k), DType::kBF16), st);
  testing::upload(gpu.w, rounded(testing::randn(n * k, 0.02f), DType::kBF16), st);
  forward(gpu, st);  // warm-up outside the capture
  st.synchronize();
  CudaGraph graph;
  graph.capture(st, [&] { forward(gpu, st); });
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE(::testing::Message() << (blockwise ? "blockwise" : "tensorwise") << " replay " << replay);
    const float mag = std::ldexp(1.f, 3 * replay - 2);  // new magnitudes: new scales
    const auto xv = rounded(testing::randn(m * k, mag), DType::kBF16);
    const auto wv = rounded(testing::randn(n * k, 0.02f / mag), DType::kBF16);
    testing::upload(gpu.x, xv, st);
    testing::upload(gpu.w, wv, st);
    testing::upload(cpu.x, xv, cpu_stream());
    testing::upload(cpu.w, wv, cpu_stream());
    for (const Tensor* t : {&gpu.xq.t, &gpu.xqt.t, &gpu.wq.t, &gpu.wqt.t}) poison_bytes(*t, st);
    for (const Tensor* t : {&gpu.xs.t, &gpu.ws.t, &gpu.y.t}) poison(*t, st);
    graph.launch(st);
    forward(cpu, cpu_stream());
    EXPECT_TRUE(same_bytes(to_bytes(gpu.xq, st), to_bytes(cpu.xq, cpu_stream())));
    EXPECT_TRUE(same_bytes(to_bytes(gpu.xqt, st), to_bytes(cpu.xqt, cpu_stream())));
    EXPECT_TRUE(same_bytes(to_bytes(gpu.wqt, st), to_bytes(cpu.wqt, cpu_stream())));
    EXPECT_TRUE(same_bits(to_host(gpu.xs, st), to_host(cpu.xs, cpu_stream())));
    EXPECT_TRUE(same_bits(to_host(gpu.ws, st), to_host(cpu.ws, cpu_stream())));
    // FP8 tensor cores accumulate with fewer bits than fp32 between promotions: 1e-3 norm-wise
    // (a wrong scale or layout is O(1)).
    EXPECT_LT(testing::rel_err(to_host(gpu.y, st), to_host(cpu.y, cpu_stream())), 1e-3);
  }
}

TEST(Fp8Cuda, CurrentScalingChainInAGraph) {
  MT_REQUIRE_CUDA();
  check_chain_graph(false);
}

TEST(Fp8Cuda, BlockwiseChainInAGraph) {
  MT_REQUIRE_CUDA();
  if (!block_scaling_supported()) GTEST_SKIP() << "cuBLASLt's FP8 block scaling runs on sm_90 only";
  check_chain_graph(true);
}

TEST(Fp8Cuda, ErrorsBeforeAnyWork) {
  MT_REQUIRE_CUDA();
  const Stream& st = cuda_stream();
  OwnedTensor a(DType::kF8E4M3, kGpu, {32, 64}), b(DType::kF8E4M3, kGpu, {48, 64}), s(DType::kF32, kGpu, {1});
  OwnedTensor d16(DType::kBF16, kGpu, {32, 48}), d_misaligned_store(DType::kF8E4M3, kGpu, {32 * 64 + 1});
  const Tensor a_mis = d_misaligned_store.t.flat_range(1, 32 * 64).view({32, 64});
  testing::expect_error([&] { fp8_matmul(d16, {a_mis, s}, {b, s}, false, false, st); }, "16-byte aligned");
  OwnedTensor sa(DType::kF32, kGpu, fp8_scale_shape(Fp8Scaling::kBlock1x128, 32, 64)),
      sb(DType::kF32, kGpu, fp8_scale_shape(Fp8Scaling::kBlock128x128, 48, 64));
  testing::expect_error(
      [&] {
        fp8_matmul(d16, {a, sa, Fp8Scaling::kBlock1x128}, {b, sb, Fp8Scaling::kBlock128x128}, true, false, st);
      },
      "accumulate into a bf16 d needs tensorwise scaling");
  OwnedTensor x(DType::kBF16, kGpu, {4, 8}), q(DType::kF8E4M3, kCpu, {4, 8});
  testing::expect_error([&] { fp8_quantize(q, Tensor(), x, s, Tensor(), st); }, "device");
}

}  // namespace
}  // namespace mt
