// CPU tests of FP8 training's foundation: the e4m3 / e5m2 storage types (core/dtype.h: every code
// round-trips, round-to-nearest-even ties, saturation, NaN, against a brute-force nearest-value
// reference), the scaling logic of ops/fp8_math.h and ops/fp8.h against hand-worked numbers
// (current scaling, the delayed-scaling amax history with max / most_recent and a margin), the
// blockwise scale layouts, the quantisers, and the emulated FP8 GEMM of ops/fp8_matmul.h against a
// float64 reference of the dequantised operands; the documented errors.
#include "ops/fp8.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>

#include "fp8_test_util.h"
#include "ops/fp8_matmul.h"
#include "testing/testing.h"

namespace mt {
namespace {

using fp8_math::AmaxAlgo;
using fp8_test::bytes_tensor;
using fp8_test::to_bytes;
using testing::cpu_stream;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::randn;
using testing::to_host;

const Device kCpu = Device::cpu();

// ------------------------------------------------------------------------------------------------
// Storage types.

struct Format {
  DType t;
  int man;    // mantissa bits
  int bias;   // exponent bias
  float max;  // largest finite
};
const Format kE4M3{DType::kF8E4M3, 3, 7, 448.f};
const Format kE5M2{DType::kF8E5M2, 2, 15, 57344.f};

/// The value of a code from the format's definition, in double (NaN / inf per OCP).
double code_value(const Format& f, int c) {
  const int sign = c >> 7, exp = (c >> f.man) & ((1 << (7 - f.man)) - 1), man = c & ((1 << f.man) - 1);
  const int emax = (1 << (7 - f.man)) - 1;
  if (f.t == DType::kF8E4M3 && exp == emax && man == (1 << f.man) - 1) return NAN;
  if (f.t == DType::kF8E5M2 && exp == emax) return man == 0 ? (sign ? -INFINITY : INFINITY) : NAN;
  const double v =
      exp == 0 ? std::ldexp(man, 1 - f.bias - f.man) : std::ldexp(1.0 + std::ldexp(man, -f.man), exp - f.bias);
  return sign ? -v : v;
}

/// Brute force: the finite code nearest to v (ties to the even code), saturating to +-max.
uint8_t nearest_code(const Format& f, float v) {
  if (std::fabs(v) >= f.max) return static_cast<uint8_t>((std::signbit(v) ? 0x80 : 0) | f32_to_fp8_bits(f.t, f.max));
  int best = -1;
  double best_d = 0;
  for (int c = 0; c < 256; ++c) {
    const double cv = code_value(f, c);
    if (!std::isfinite(cv) || std::signbit(cv) != std::signbit(v)) continue;
    const double d = std::fabs(cv - static_cast<double>(v));
    if (best < 0 || d < best_d || (d == best_d && (c & 1) == 0 && (best & 1) == 1)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best);
}

void check_all_codes(const Format& f) {
  int finite = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = fp8_bits_to_f32(f.t, static_cast<uint8_t>(c));
    const double want = code_value(f, c);
    SCOPED_TRACE(::testing::Message() << dtype_name(f.t) << " code 0x" << std::hex << c);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(v));
      const uint8_t back = f32_to_fp8_bits(f.t, v);  // a NaN code of the same sign
      EXPECT_TRUE(std::isnan(code_value(f, back))) << int(back);
      EXPECT_EQ(back & 0x80, c & 0x80);
    } else if (std::isinf(want)) {  // e5m2 +-inf saturate to +-57344 (SATFINITE)
      ASSERT_EQ(v, static_cast<float>(want));
      EXPECT_EQ(f32_to_fp8_bits(f.t, v), (c & 0x80) | 0x7b);
    } else {
      ++finite;
      ASSERT_EQ(static_cast<double>(v), want);
      EXPECT_EQ(std::signbit(v), (c & 0x80) != 0);  // -0 is 0x80
      EXPECT_EQ(f32_to_fp8_bits(f.t, v), c);        // every finite code round-trips
    }
  }
  EXPECT_EQ(finite, f.t == DType::kF8E4M3 ? 254 : 248);
}

TEST(Fp8DType, EveryCodeRoundTrips) {
  check_all_codes(kE4M3);
  check_all_codes(kE5M2);
}

TEST(Fp8DType, NamesSizesAndLimits) {
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kF8E5M2), 1u);
  EXPECT_EQ(dtype_name(DType::kF8E4M3), "fp8_e4m3");
  EXPECT_EQ(dtype_name(DType::kF8E5M2), "fp8_e5m2");
  EXPECT_EQ(parse_dtype("fp8_e4m3"), DType::kF8E4M3);
  EXPECT_EQ(parse_dtype("float8_e5m2"), DType::kF8E5M2);
  EXPECT_EQ(fp8_max(DType::kF8E4M3), 448.f);
  EXPECT_EQ(fp8_max(DType::kF8E5M2), 57344.f);
  EXPECT_EQ(e4m3_bits_to_f32(0x7e), 448.f);
  EXPECT_EQ(e5m2_bits_to_f32(0x7b), 57344.f);
  EXPECT_EQ(e4m3_bits_to_f32(0x01), std::ldexp(1.f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_bits_to_f32(0x08), std::ldexp(1.f, -6));  // smallest normal
  EXPECT_EQ(e5m2_bits_to_f32(0x01), std::ldexp(1.f, -16));
  EXPECT_EQ(e5m2_bits_to_f32(0x04), std::ldexp(1.f, -14));
  EXPECT_EQ(e4m3_bits_to_f32(0x38), 1.f);
  EXPECT_EQ(e5m2_bits_to_f32(0x3c), 1.f);
  EXPECT_TRUE(std::isinf(e5m2_bits_to_f32(0xfc)) && e5m2_bits_to_f32(0xfc) < 0);
  EXPECT_TRUE(is_fp8(DType::kF8E4M3) && !is_fp8(DType::kU8));
}

TEST(Fp8DType, RoundToNearestEvenAtHandWorkedTies) {
  // e4m3 around 1: spacing 1/8. 1.0625 is halfway 1.0 (0x38, even) / 1.125 (0x39): -> 1.0.
  EXPECT_EQ(f32_to_e4m3_bits(1.0625f), 0x38);
  EXPECT_EQ(f32_to_e4m3_bits(std::nextafter(1.0625f, 2.f)), 0x39);
  // 1.1875 halfway 1.125 (0x39, odd) / 1.25 (0x3a, even): -> 1.25.
  EXPECT_EQ(f32_to_e4m3_bits(1.1875f), 0x3a);
  EXPECT_EQ(f32_to_e4m3_bits(-1.1875f), 0xba);
  // e5m2 around 1: spacing 1/4. 1.125 -> 1.0 (0x3c); 1.375 halfway 1.25 (0x3d) / 1.5 (0x3e) -> 1.5.
  EXPECT_EQ(f32_to_e5m2_bits(1.125f), 0x3c);
  EXPECT_EQ(f32_to_e5m2_bits(1.375f), 0x3e);
  // Subnormals (e4m3 unit 2^-9): half a unit ties to 0 (+-0 keeps the sign), 1.5 units to 2.
  EXPECT_EQ(f32_to_e4m3_bits(std::ldexp(1.f, -10)), 0x00);
  EXPECT_EQ(f32_to_e4m3_bits(-std::ldexp(1.f, -10)), 0x80);
  EXPECT_EQ(f32_to_e4m3_bits(std::nextafter(std::ldexp(1.f, -10), 1.f)), 0x01);
  EXPECT_EQ(f32_to_e4m3_bits(3 * std::ldexp(1.f, -10)), 0x02);
  EXPECT_EQ(f32_to_e4m3_bits(-std::ldexp(1.f, -30)), 0x80);
  EXPECT_EQ(f32_to_e4m3_bits(1e-45f), 0x00);  // an fp32 subnormal
  // 7.5 units: halfway 7 (0x07) / 8 = the smallest normal (0x08, even): the carry into the exponent.
  EXPECT_EQ(f32_to_e4m3_bits(7.5f * std::ldexp(1.f, -9)), 0x08);
  EXPECT_EQ(f32_to_e5m2_bits(3.5f * std::ldexp(1.f, -16)), 0x04);
}

TEST(Fp8DType, SaturatesToTheLargestFiniteValue) {
  for (float v : {448.f, 449.f, 463.99f, 464.f, 480.f, 1e6f, FLT_MAX, INFINITY}) {
    EXPECT_EQ(f32_to_e4m3_bits(v), 0x7e) << v;
    EXPECT_EQ(f32_to_e4m3_bits(-v), 0xfe) << v;
  }
  EXPECT_EQ(f32_to_e4m3_bits(432.f), 0x7e);  // halfway 416 (0x7d, odd) / 448 (0x7e, even) -> 448
  EXPECT_EQ(f32_to_e4m3_bits(431.f), 0x7d);  // nearer 416
  for (float v : {57344.f, 57345.f, 61439.f, 61440.f, 65536.f, 1e9f, INFINITY}) {
    EXPECT_EQ(f32_to_e5m2_bits(v), 0x7b) << v;
    EXPECT_EQ(f32_to_e5m2_bits(-v), 0xfb) << v;
  }
}

TEST(Fp8DType, NaNAsCudaSatfinite) {
  EXPECT_EQ(f32_to_e4m3_bits(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(f32_to_e4m3_bits(-std::numeric_limits<float>::quiet_NaN()), 0xff);
  EXPECT_EQ(f32_to_e5m2_bits(bits_to_f32(0x7fc00000u)), 0x7e);
  EXPECT_EQ(f32_to_e5m2_bits(bits_to_f32(0x7fe00000u)), 0x7f);
  EXPECT_EQ(f32_to_e5m2_bits(bits_to_f32(0xffc00000u)), 0xfe);
  EXPECT_EQ(f32_to_e5m2_bits(bits_to_f32(0x7f800001u)), 0x7e);  // a signalling NaN stays a NaN
}

/// Random fp32 values of every magnitude, the exact midpoints between neighbouring codes and the
/// floats beside them, against the brute-force nearest code.
TEST(Fp8DType, MatchesBruteForceNearestEven) {
  for (const Format& f : {kE4M3, kE5M2}) {
    std::vector<float> vals;
    for (int c = 0; c < 0x7f; ++c) {
      const double a = code_value(f, c), b = code_value(f, c + 1);
      if (!std::isfinite(a) || !std::isfinite(b)) continue;
      const float mid = static_cast<float>((a + b) / 2);  // exact: 5 significant bits
      for (float v : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, INFINITY), static_cast<float>(a)}) {
        vals.push_back(v);
        vals.push_back(-v);
      }
    }
    std::uniform_real_distribution<float> mant(1.f, 2.f);
    std::uniform_int_distribution<int> ex(-24, 18);
    for (int i = 0; i < 20000; ++i) {
      const float v = std::ldexp(mant(testing::test_rng()), ex(testing::test_rng()));
      vals.push_back(i % 2 ? v : -v);
    }
    for (float v : vals) ASSERT_EQ(f32_to_fp8_bits(f.t, v), nearest_code(f, v)) << dtype_name(f.t) << " " << v;
  }
}

// ------------------------------------------------------------------------------------------------
// Scales.

TEST(Fp8Scaling, ScaleFromAmaxHandWorked) {
  using fp8_math::scale_from_amax;
  EXPECT_EQ(scale_from_amax(2.f, 448.f, false, 0.f), 224.f);
  EXPECT_EQ(scale_from_amax(3.f, 448.f, false, 0.f), 448.f / 3.f);
  EXPECT_EQ(scale_from_amax(3.f, 448.f, true, 0.f), 128.f);       // 149.33 -> 2^7
  EXPECT_EQ(scale_from_amax(0.5f, 57344.f, true, 0.f), 65536.f);  // 114688 -> 2^16
  EXPECT_EQ(scale_from_amax(0.f, 448.f, false, 0.f), 1.f);
  EXPECT_EQ(scale_from_amax(INFINITY, 448.f, false, 0.f), 1.f);
  EXPECT_EQ(scale_from_amax(NAN, 448.f, false, 0.f), 1.f);
  EXPECT_EQ(scale_from_amax(1e-40f, 448.f, false, 0.f), FLT_MAX);  // 4.5e42 overflows fp32
  EXPECT_EQ(scale_from_amax(1e-40f, 448.f, true, 0.f), std::ldexp(1.f, 127));
  EXPECT_EQ(scale_from_amax(1e-3f, 448.f, false, 1.f), 448.f);  // amax raised to epsilon
  EXPECT_EQ(scale_from_amax(0.f, 448.f, false, 2.f), 224.f);
}

TEST(Fp8Scaling, CurrentScalingOp) {
  auto amax = make_tensor({2.f, 0.f, 3.f, INFINITY}, DType::kF32, kCpu, {4}, cpu_stream());
  OwnedTensor scale(DType::kF32, kCpu, {4}), scale_inv(DType::kF32, kCpu, {4});
  testing::poison(scale, cpu_stream());
  testing::poison(scale_inv, cpu_stream());
  fp8_scale_from_amax(scale, scale_inv, amax, DType::kF8E5M2, false, 0.f, cpu_stream());
  EXPECT_EQ(to_host(scale, cpu_stream()), (std::vector<float>{28672.f, 1.f, 57344.f / 3.f, 1.f}));
  EXPECT_EQ(to_host(scale_inv, cpu_stream()), (std::vector<float>{1.f / 28672.f, 1.f, 1.f / (57344.f / 3.f), 1.f}));
  fp8_scale_from_amax(scale, scale_inv, amax, DType::kF8E4M3, true, 0.f, cpu_stream());
  EXPECT_EQ(to_host(scale, cpu_stream()), (std::vector<float>{128.f, 1.f, 128.f, 1.f}));
}

/// One delayed-scaling column through steps: records[t] is written into row 0, then the update.
struct DelayedStep {
  float record;
  std::vector<float> hist_after;
  float scale_after;
};

void run_delayed(int64_t len, AmaxAlgo algo, int margin, const std::vector<DelayedStep>& steps) {
  // Two columns: the one under test and a column that records nothing (its state must not move).
  OwnedTensor hist(DType::kF32, kCpu, {len, 2}), scale(DType::kF32, kCpu, {2}), scale_inv(DType::kF32, kCpu, {2});
  std::vector<float> h(static_cast<size_t>(len * 2), 0.f);
  h[1] = 0.f;
  for (int64_t j = 1; j < len; ++j) h[static_cast<size_t>(j * 2 + 1)] = 7.f;
  testing::upload(hist, h, cpu_stream());
  testing::upload(scale, {1.f, 5.f}, cpu_stream());
  for (size_t t = 0; t < steps.size(); ++t) {
    SCOPED_TRACE(::testing::Message() << "step " << t + 1 << " len " << len << " algo " << int(algo) << " margin "
                                      << margin);
    h = to_host(hist, cpu_stream());
    h[0] = steps[t].record;
    testing::upload(hist, h, cpu_stream());
    fp8_delayed_scale_update(hist, scale, scale_inv, DType::kF8E4M3, margin, algo, cpu_stream());
    h = to_host(hist, cpu_stream());
    for (int64_t j = 0; j < len; ++j) {
      EXPECT_EQ(h[static_cast<size_t>(j * 2)], steps[t].hist_after[static_cast<size_t>(j)]) << "row " << j;
      EXPECT_EQ(h[static_cast<size_t>(j * 2 + 1)], j == 0 ? 0.f : 7.f) << "idle column row " << j;
    }
    const auto s = to_host(scale, cpu_stream()), si = to_host(scale_inv, cpu_stream());
    EXPECT_EQ(s[0], steps[t].scale_after);
    EXPECT_EQ(si[0], 1.f / steps[t].scale_after);
    EXPECT_EQ(s[1], 5.f);
    EXPECT_EQ(si[1], 1.f / 5.f);
  }
}

TEST(Fp8Scaling, DelayedMaxHistoryHandWorked) {
  // len 3: row 0 = this step's record, rows 1..2 the previous steps' amaxes (oldest first); the
  // scale uses the max over the window of the last 3 records.
  run_delayed(3, AmaxAlgo::kMax, 0,
              {{2.f, {0, 0, 2}, 224.f},                  // max(0, 0, 2) = 2
               {8.f, {0, 2, 8}, 56.f},                   // max(0, 2, 8)
               {1.f, {0, 8, 1}, 56.f},                   // max(2, 8, 1)
               {0.5f, {0, 1, 0.5f}, 56.f},               // max(8, 1, 0.5): the 8 of step 2 is still in
               {0.25f, {0, 0.5f, 0.25f}, 448.f},         // max(1, 0.5, 0.25)
               {0.f, {0, 0.5f, 0.25f}, 448.f},           // nothing recorded: nothing moves
               {INFINITY, {0, 0.25f, INFINITY}, 448.f},  // amax inf: the scale stays
               {1.f, {0, INFINITY, 1.f}, 448.f},
               {2.f, {0, 1.f, 2.f}, 448.f},  // the inf still in the window
               {2.f, {0, 2.f, 2.f}, 224.f}});
}

TEST(Fp8Scaling, DelayedMostRecentAndMargin) {
  run_delayed(3, AmaxAlgo::kMostRecent, 0,
              {{2.f, {0, 0, 2}, 224.f}, {8.f, {0, 2, 8}, 56.f}, {1.f, {0, 8, 1}, 448.f}, {0.f, {0, 8, 1}, 448.f}});
  // margin 2: fp8_max * 2^-2 = 112.
  run_delayed(1, AmaxAlgo::kMostRecent, 2, {{2.f, {0}, 56.f}, {0.5f, {0}, 224.f}, {1e-38f, {0}, FLT_MAX}});
  run_delayed(1, AmaxAlgo::kMax, 1, {{4.f, {0}, 56.f}, {NAN, {0}, 56.f}, {3.5f, {0}, 64.f}});
  run_delayed(2, AmaxAlgo::kMax, 0, {{4.f, {0, 4.f}, 112.f}, {7.f, {0, 7.f}, 64.f}, {1.f, {0, 1.f}, 64.f}});
}

// ------------------------------------------------------------------------------------------------
// amax and quantisation.

TEST(Fp8Quantize, AmaxPassesOverNaN) {
  std::vector<float> x = randn(1000);
  x[17] = -9.5f;
  x[400] = NAN;
  auto xt = make_tensor(x, DType::kF32, kCpu, {10, 100}, cpu_stream());
  auto amax = make_tensor({-1.f}, DType::kF32, kCpu, {1}, cpu_stream());
  fp8_amax(amax, xt, cpu_stream());
  EXPECT_EQ(to_host(amax, cpu_stream())[0], 9.5f);
  x[3] = -INFINITY;
  testing::upload(xt, x, cpu_stream());
  fp8_amax(amax, xt, cpu_stream());
  EXPECT_EQ(to_host(amax, cpu_stream())[0], INFINITY);
}

TEST(Fp8Quantize, TensorwiseWithTransposeAndAmaxRecord) {
  const int64_t rows = 37, cols = 53;
  std::vector<float> x = randn(rows * cols, 3.f);
  x[5] = 1e6f;  // saturates
  x[6] = -NAN;  // written as 0x7f, the quantisers' one NaN code
  auto xt = make_tensor(x, DType::kF32, kCpu, {rows, cols}, cpu_stream());
  for (DType t : {DType::kF8E4M3, DType::kF8E5M2}) {
    OwnedTensor q(t, kCpu, {rows, cols}), qt(t, kCpu, {cols, rows});
    fp8_test::poison_bytes(q, cpu_stream());
    fp8_test::poison_bytes(qt, cpu_stream());
    auto scale = make_tensor({37.5f}, DType::kF32, kCpu, {1}, cpu_stream());
    auto amax = make_tensor({2.f}, DType::kF32, kCpu, {1}, cpu_stream());
    fp8_quantize(q, qt, xt, scale, amax, cpu_stream());
    const auto qb = to_bytes(q, cpu_stream()), qtb = to_bytes(qt, cpu_stream());
    float m = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float v = x[r * cols + c];
        ASSERT_EQ(qb[r * cols + c], std::isnan(v) ? 0x7f : f32_to_fp8_bits(t, v * 37.5f)) << r << "," << c;
        ASSERT_EQ(qtb[c * rows + r], qb[r * cols + c]) << r << "," << c;
        if (!std::isnan(v)) m = std::max(m, std::fabs(v));
      }
    }
    EXPECT_EQ(qb[5], t == DType::kF8E4M3 ? 0x7e : 0x7b);
    EXPECT_EQ(qb[6], 0x7f);
    EXPECT_EQ(to_host(amax, cpu_stream())[0], m);  // max(2, max |x|) = 1e6
    // Only the transpose.
    fp8_test::poison_bytes(qt, cpu_stream());
    fp8_quantize(Tensor(), qt, xt, scale, Tensor(), cpu_stream());
    EXPECT_EQ(to_bytes(qt, cpu_stream()), qtb);
  }
}

// fp8_quantize_bf16_rounded (the FP8 weight copies kept in the bf16 weights' storage, quantised
// from the fp32 main parameters) against the path it replaces — the values cast to bf16 (widened
// again: the CPU ops are fp32), then fp8_amax / fp8_quantize — bit for bit at ragged shapes, both
// formats, tensorwise (amax, scale, scale_inv, q, q_t) and delayed (the record, q, q_t), on values
// at, above and below bf16 ties and with NaN, infinities, values that saturate FP8 and that round to
// bf16 infinity. Negative control: quantising the fp32 values themselves gives other bytes.
TEST(Fp8Quantize, Bf16RoundedEqualsStagedBf16) {
  const Stream& st = cpu_stream();
  const float delayed = 37.5f;
  const std::pair<int64_t, int64_t> shapes[] = {{37, 53}, {130, 257}, {1, 1000}, {129, 1}};
  int64_t differ = 0;  // the negative control over every case: one case alone may have none (random values)
  for (const auto& [rows, cols] : shapes) {
    for (const DType t : {DType::kF8E4M3, DType::kF8E5M2}) {
      for (const bool specials : {false, true}) {
        for (const float* scale : {static_cast<const float*>(nullptr), &delayed}) {
          SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " " << dtype_name(t) << " specials " << specials
                                            << (scale ? " delayed" : " tensorwise"));
          const std::vector<float> x = fp8_test::bf16_rounding_values(rows * cols, 3.f, specials);
          const auto a = fp8_test::quantize_weight_values(x, rows, cols, t, scale, true, kCpu, st);
          const auto b = fp8_test::quantize_weight_values(x, rows, cols, t, scale, false, kCpu, st);
          EXPECT_EQ(a.amax, b.amax);
          EXPECT_EQ(a.scale, b.scale);
          EXPECT_EQ(a.scale_inv, b.scale_inv);
          EXPECT_EQ(a.q, b.q);
          EXPECT_EQ(a.q_t, b.q_t);
          if (specials) {
            EXPECT_EQ(a.q[0], fp8_math::kNaNCode);
            EXPECT_EQ(a.q[8], t == DType::kF8E4M3 ? 0x7e : 0x7b) << "FLT_MAX: bf16 inf, saturated";
          }
          // negative control: the fp32 values quantised with the same scale
          auto xf = make_tensor(x, DType::kF32, kCpu, {rows, cols}, st);
          auto s = make_tensor(a.scale, DType::kF32, kCpu, {1}, st);
          OwnedTensor q(t, kCpu, {rows, cols});
          fp8_quantize(q, Tensor(), xf, s, Tensor(), st);
          const std::vector<uint8_t> raw = to_bytes(q, st);
          for (size_t i = 0; i < raw.size(); ++i) differ += raw[i] != a.q[i];
        }
      }
    }
  }
  EXPECT_GT(differ, 0) << "no value rounded across an FP8 code through bf16";
}

TEST(Fp8Quantize, ScaleShapesAndIndicesHandWorked) {
  EXPECT_EQ(fp8_scale_shape(Fp8Scaling::kTensor, 7, 9), (std::vector<int64_t>{1}));
  EXPECT_EQ(fp8_scale_shape(Fp8Scaling::kBlock1x128, 300, 200), (std::vector<int64_t>{2, 300}));
  EXPECT_EQ(fp8_scale_shape(Fp8Scaling::kBlock1x128, 301, 256), (std::vector<int64_t>{2, 304}));
  EXPECT_EQ(fp8_scale_shape(Fp8Scaling::kBlock1x128, 301, 257), (std::vector<int64_t>{3, 304}));
  EXPECT_EQ(fp8_scale_shape(Fp8Scaling::kBlock128x128, 300, 200), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(fp8_scale_shape(Fp8Scaling::kBlock128x128, 129, 1025), (std::vector<int64_t>{2, 12}));
  EXPECT_EQ(fp8_scale_shape(Fp8Scaling::kBlock128x128, 4096, 4096), (std::vector<int64_t>{32, 32}));
  using fp8_math::scale_index;
  EXPECT_EQ(scale_index(Fp8Scaling::kBlock1x128, 5, 130, 301, 300), 1 * 304 + 5);
  EXPECT_EQ(scale_index(Fp8Scaling::kBlock1x128, 300, 0, 301, 300), 300);
  EXPECT_EQ(scale_index(Fp8Scaling::kBlock128x128, 200, 700, 300, 1025), 1 * 12 + 5);
  EXPECT_EQ(scale_index(Fp8Scaling::kTensor, 200, 700, 300, 1025), 0);
}

/// x [rows, cols] with small values and one planted value per block (1 row x 128 or 128 x 128)
/// of magnitude 2^(b % 9 - 3) * 1.5; returns x and the planted amax of each block.
std::vector<float> planted(int64_t rows, int64_t cols, int64_t brows, std::vector<float>* block_amax) {
  std::vector<float> x = testing::randu(rows * cols, -0.1f, 0.1f);
  const int64_t nrb = (rows + brows - 1) / brows, ncb = (cols + 127) / 128;
  block_amax->assign(static_cast<size_t>(nrb * ncb), 0.f);
  std::uniform_int_distribution<int64_t> dr(0, brows - 1), dc(0, 127);
  for (int64_t rb = 0; rb < nrb; ++rb) {
    for (int64_t cb = 0; cb < ncb; ++cb) {
      const int64_t b = rb * ncb + cb;
      const int64_t r = std::min(rows - 1, rb * brows + dr(testing::test_rng()));
      const int64_t c = std::min(cols - 1, cb * 128 + dc(testing::test_rng()));
      const float v = std::ldexp(1.5f, static_cast<int>(b % 9) - 3);
      x[r * cols + c] = b % 2 ? -v : v;
      (*block_amax)[b] = v;
    }
  }
  return x;
}

TEST(Fp8Quantize, Blockwise1x128HandWorkedScales) {
  const int64_t rows = 6, cols = 300;  // 3 column blocks, the last of 44
  std::vector<float> amax;
  const std::vector<float> x = planted(rows, cols, 1, &amax);
  auto xt = make_tensor(x, DType::kF32, kCpu, {rows, cols}, cpu_stream());
  OwnedTensor q(DType::kF8E4M3, kCpu, {rows, cols}), s(DType::kF32, kCpu, {3, 8});
  OwnedTensor qt(DType::kF8E4M3, kCpu, {cols, rows}), st(DType::kF32, kCpu, {1, 300});
  testing::poison(s, cpu_stream());
  testing::poison(st, cpu_stream());
  fp8_quantize_blockwise(q, s, qt, st, xt, Fp8Scaling::kBlock1x128, true, cpu_stream());
  const auto sv = to_host(s, cpu_stream());
  const auto qb = to_bytes(q, cpu_stream());
  for (int64_t r = 0; r < 8; ++r) {
    for (int64_t cb = 0; cb < 3; ++cb) {
      const float got = sv[static_cast<size_t>(cb * 8 + r)];
      if (r >= rows) {
        EXPECT_EQ(got, 0.f) << "padding row " << r;
        continue;
      }
      // amax 1.5 * 2^e: 448 / amax = 298.67 * 2^-e -> power of two 256 * 2^-e; scale_inv its inverse.
      const float a = amax[static_cast<size_t>(r * 3 + cb)];
      const float want_scale = std::ldexp(256.f, -static_cast<int>(std::log2(a / 1.5f)));
      EXPECT_EQ(got, 1.f / want_scale) << r << "," << cb;
      for (int64_t c = cb * 128; c < std::min(cols, cb * 128 + 128); ++c) {
        ASSERT_EQ(qb[r * cols + c], f32_to_e4m3_bits(x[r * cols + c] * want_scale));
      }
    }
  }
  // The transpose's blocks run down the columns: 6 rows of x, one block per column.
  const auto stv = to_host(st, cpu_stream());
  const auto qtb = to_bytes(qt, cpu_stream());
  for (int64_t c = 0; c < cols; ++c) {
    float m = 0;
    for (int64_t r = 0; r < rows; ++r) m = std::max(m, std::fabs(x[r * cols + c]));
    const float sc = fp8_math::scale_from_amax(m, 448.f, true, 0.f);
    ASSERT_EQ(stv[static_cast<size_t>(c)], 1.f / sc) << c;
    for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(qtb[c * rows + r], f32_to_e4m3_bits(x[r * cols + c] * sc));
  }
}

TEST(Fp8Quantize, Blockwise128x128HandWorkedScalesAndTranspose) {
  const int64_t rows = 200, cols = 300;  // 2 x 3 blocks
  std::vector<float> amax;
  const std::vector<float> x = planted(rows, cols, 128, &amax);
  auto xt = make_tensor(x, DType::kF32, kCpu, {rows, cols}, cpu_stream());
  for (bool pow2 : {true, false}) {
    OwnedTensor q(DType::kF8E5M2, kCpu, {rows, cols}), s(DType::kF32, kCpu, {2, 4});
    OwnedTensor qt(DType::kF8E5M2, kCpu, {cols, rows}), st(DType::kF32, kCpu, {3, 4});
    testing::poison(s, cpu_stream());
    testing::poison(st, cpu_stream());
    fp8_quantize_blockwise(q, s, qt, st, xt, Fp8Scaling::kBlock128x128, pow2, cpu_stream());
    const auto sv = to_host(s, cpu_stream()), stv = to_host(st, cpu_stream());
    const auto qb = to_bytes(q, cpu_stream()), qtb = to_bytes(qt, cpu_stream());
    for (int64_t rb = 0; rb < 2; ++rb) {
      for (int64_t cb = 0; cb < 4; ++cb) {
        if (cb == 3) {
          EXPECT_EQ(sv[static_cast<size_t>(rb * 4 + cb)], 0.f);
          continue;
        }
        const float a = amax[static_cast<size_t>(rb * 3 + cb)];
        const float want = pow2 ? std::ldexp(32768.f, -static_cast<int>(std::log2(a / 1.5f))) : 57344.f / a;
        EXPECT_EQ(sv[static_cast<size_t>(rb * 4 + cb)], 1.f / want) << rb << "," << cb;
        EXPECT_EQ(stv[static_cast<size_t>(cb * 4 + rb)], 1.f / want) << rb << "," << cb;  // transposed blocks
      }
    }
    for (int64_t cb = 0; cb < 3; ++cb) {
      for (int64_t rb = 2; rb < 4; ++rb) EXPECT_EQ(stv[static_cast<size_t>(cb * 4 + rb)], 0.f);
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(qtb[c * rows + r], qb[r * cols + c]) << r << "," << c;
    }
  }
}

TEST(Fp8Quantize, DequantizeInvertsWithinHalfAnUlp) {
  const int64_t rows = 130, cols = 260;
  const std::vector<float> x = randn(rows * cols, 2.f);
  auto xt = make_tensor(x, DType::kF32, kCpu, {rows, cols}, cpu_stream());
  OwnedTensor y(DType::kF32, kCpu, {rows, cols});
  for (Fp8Scaling sc : {Fp8Scaling::kTensor, Fp8Scaling::kBlock1x128, Fp8Scaling::kBlock128x128}) {
    OwnedTensor q(DType::kF8E4M3, kCpu, {rows, cols}), s(DType::kF32, kCpu, fp8_scale_shape(sc, rows, cols));
    if (sc == Fp8Scaling::kTensor) {
      auto amax = make_tensor({0.f}, DType::kF32, kCpu, {1}, cpu_stream());
      OwnedTensor scale(DType::kF32, kCpu, {1});
      fp8_amax(amax, xt, cpu_stream());
      fp8_scale_from_amax(scale, s, amax, DType::kF8E4M3, false, 0.f, cpu_stream());
      fp8_quantize(q, Tensor(), xt, scale, Tensor(), cpu_stream());
    } else {
      fp8_quantize_blockwise(q, s, Tensor(), Tensor(), xt, sc, true, cpu_stream());
    }
    testing::poison(y, cpu_stream());
    fp8_dequantize(y, q, s, sc, cpu_stream());
    const auto yv = to_host(y, cpu_stream()), sv = to_host(s, cpu_stream());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const double si = fp8_test::scale_at(sv, sc, r, c, rows, cols);
        const double v = x[r * cols + c], err = std::fabs(yv[r * cols + c] - v);
        // e4m3: relative half-ulp 2^-4 in the normal range, 2^-10 (scaled) below it.
        ASSERT_LE(err, std::max(std::fabs(v) * 0.0625, std::ldexp(1.0, -10) * si) * (1 + 1e-6)) << r << "," << c;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The emulated FP8 GEMM.

struct GemmCase {
  int64_t m, n, k;
  DType at, bt;
  Fp8Scaling sa, sb;
  bool pow2, accumulate;
};

void check_gemm_vs_f64(const GemmCase& g) {
  SCOPED_TRACE(::testing::Message() << "m=" << g.m << " n=" << g.n << " k=" << g.k << " a=" << dtype_name(g.at)
                                    << " b=" << dtype_name(g.bt) << " scalings " << int(g.sa) << "," << int(g.sb)
                                    << " accumulate=" << g.accumulate);
  const auto a = fp8_test::random_codes(g.m * g.k, g.at, 64.f), b = fp8_test::random_codes(g.n * g.k, g.bt, 64.f);
  const auto sa = fp8_test::random_scales(g.sa, g.m, g.k, g.pow2), sb = fp8_test::random_scales(g.sb, g.n, g.k, g.pow2);
  const std::vector<float> c0 = randn(g.m * g.n, 100.f);
  auto at = bytes_tensor(a, g.at, kCpu, {g.m, g.k}, cpu_stream());
  auto bt = bytes_tensor(b, g.bt, kCpu, {g.n, g.k}, cpu_stream());
  auto sat = make_tensor(sa, DType::kF32, kCpu, fp8_scale_shape(g.sa, g.m, g.k), cpu_stream());
  auto sbt = make_tensor(sb, DType::kF32, kCpu, fp8_scale_shape(g.sb, g.n, g.k), cpu_stream());
  auto d = make_tensor(c0, DType::kF32, kCpu, {g.m, g.n}, cpu_stream());
  if (!g.accumulate) testing::poison(d, cpu_stream());
  fp8_matmul(d, {at, sat, g.sa}, {bt, sbt, g.sb}, g.accumulate, false, cpu_stream());
  const auto ref =
      fp8_test::gemm_ref(a, g.at, sa, g.sa, b, g.bt, sb, g.sb, g.m, g.n, g.k, g.accumulate ? &c0 : nullptr);
  const auto dv = to_host(d, cpu_stream());
  const double eps = std::ldexp(1.0, -24);
  for (size_t i = 0; i < dv.size(); ++i) {
    // fp32 accumulation of k products (and the scale and C additions): |err| <= (k + 4) eps Σ|p|.
    ASSERT_LE(std::fabs(dv[i] - ref.ref[i]), (g.k + 4) * eps * ref.bound[i] + 1e-30) << "element " << i;
  }
}

TEST(Fp8Matmul, TensorwiseMatchesFloat64) {
  check_gemm_vs_f64(
      {48, 80, 272, DType::kF8E4M3, DType::kF8E4M3, Fp8Scaling::kTensor, Fp8Scaling::kTensor, false, false});
  check_gemm_vs_f64(
      {32, 16, 64, DType::kF8E5M2, DType::kF8E4M3, Fp8Scaling::kTensor, Fp8Scaling::kTensor, false, true});
  check_gemm_vs_f64({16, 48, 96, DType::kF8E4M3, DType::kF8E5M2, Fp8Scaling::kTensor, Fp8Scaling::kTensor, true, true});
}

TEST(Fp8Matmul, BlockwiseMatchesFloat64) {
  // Activation x weight (1x128 x 128x128), gradient x transposed weight, and the 1x128 x 1x128 wgrad.
  check_gemm_vs_f64(
      {144, 160, 400, DType::kF8E4M3, DType::kF8E4M3, Fp8Scaling::kBlock1x128, Fp8Scaling::kBlock128x128, true, false});
  check_gemm_vs_f64(
      {64, 272, 144, DType::kF8E5M2, DType::kF8E4M3, Fp8Scaling::kBlock1x128, Fp8Scaling::kBlock128x128, false, false});
  check_gemm_vs_f64(
      {160, 48, 336, DType::kF8E4M3, DType::kF8E4M3, Fp8Scaling::kBlock128x128, Fp8Scaling::kBlock1x128, true, true});
  check_gemm_vs_f64(
      {96, 112, 272, DType::kF8E5M2, DType::kF8E4M3, Fp8Scaling::kBlock1x128, Fp8Scaling::kBlock1x128, false, true});
}

TEST(Fp8Matmul, HandWorkedProduct) {
  // a = 1.5 everywhere (e4m3 0x3c), b = -2 (e5m2 0xc0), scales 0.5 and 4, k = 32:
  // d = 32 * (1.5 * 0.5) * (-2 * 4) = -192; accumulate onto 8 -> -184.
  auto a = bytes_tensor(std::vector<uint8_t>(16 * 32, 0x3c), DType::kF8E4M3, kCpu, {16, 32}, cpu_stream());
  auto b = bytes_tensor(std::vector<uint8_t>(32 * 32, 0xc0), DType::kF8E5M2, kCpu, {32, 32}, cpu_stream());
  auto sa = make_tensor({0.5f}, DType::kF32, kCpu, {1}, cpu_stream());
  auto sb = make_tensor({4.f}, DType::kF32, kCpu, {1}, cpu_stream());
  auto d = make_tensor(std::vector<float>(16 * 32, 8.f), DType::kF32, kCpu, {16, 32}, cpu_stream());
  fp8_matmul(d, {a, sa}, {b, sb}, true, false, cpu_stream());
  EXPECT_EQ(to_host(d, cpu_stream()), std::vector<float>(16 * 32, -184.f));
  fp8_matmul(d, {a, sa}, {b, sb}, false, false, cpu_stream());
  EXPECT_EQ(to_host(d, cpu_stream()), std::vector<float>(16 * 32, -192.f));
  // C != D: the addend 8 read from c (left as it is) into a poisoned d
  auto c = make_tensor(std::vector<float>(16 * 32, 8.f), DType::kF32, kCpu, {16, 32}, cpu_stream());
  testing::poison(d, cpu_stream());
  fp8_matmul(d, {a, sa}, {b, sb}, true, false, cpu_stream(), c);
  EXPECT_EQ(to_host(d, cpu_stream()), std::vector<float>(16 * 32, -184.f));
  EXPECT_EQ(to_host(c, cpu_stream()), std::vector<float>(16 * 32, 8.f));
  testing::expect_error([&] { fp8_matmul(d, {a, sa}, {b, sb}, false, false, cpu_stream(), c); }, "needs accumulate");
  auto c_wrong = make_tensor(std::vector<float>(16 * 16, 8.f), DType::kF32, kCpu, {16, 16}, cpu_stream());
  testing::expect_error([&] { fp8_matmul(d, {a, sa}, {b, sb}, true, false, cpu_stream(), c_wrong); }, "like d");
  // the bias epilogue: d = (product + c) + bias[j], column j's bias 0.25 j
  std::vector<float> bias(32);
  for (int j = 0; j < 32; ++j) bias[static_cast<size_t>(j)] = 0.25f * static_cast<float>(j);
  auto bt = make_tensor(bias, DType::kF32, kCpu, {32}, cpu_stream());
  fp8_matmul(d, {a, sa}, {b, sb}, false, false, cpu_stream(), Tensor(), bt);
  std::vector<float> want(16 * 32), want_c(16 * 32);
  for (size_t i = 0; i < want.size(); ++i) {
    want[i] = -192.f + bias[i % 32];
    want_c[i] = -184.f + bias[i % 32];
  }
  EXPECT_EQ(to_host(d, cpu_stream()), want);
  fp8_matmul(d, {a, sa}, {b, sb}, true, false, cpu_stream(), c, bt);
  EXPECT_EQ(to_host(d, cpu_stream()), want_c);
  auto bias_wrong = make_tensor(std::vector<float>(16, 1.f), DType::kF32, kCpu, {16}, cpu_stream());
  testing::expect_error([&] { fp8_matmul(d, {a, sa}, {b, sb}, false, false, cpu_stream(), Tensor(), bias_wrong); },
                        "fp8_matmul: bias fp32[16]@cpu must be a contiguous [32] of d's dtype fp32");
}

TEST(Fp8Matmul, QuantisedLinearApproximatesFp32) {
  // The three GEMMs of a linear layer from quantised fp32 operands (current scaling; hybrid:
  // e5m2 gradient) against the fp32 products: the FP8 rounding error (~2^-4 relative per
  // operand), not garbage.
  const int64_t m = 64, n = 48, k = 96;
  const std::vector<float> x = randn(m * k), w = randn(n * k, 0.05f), dy = randn(m * n, 1e-3f);
  auto quant = [&](const std::vector<float>& v, int64_t rows, int64_t cols, DType t, OwnedTensor& q, OwnedTensor& qt,
                   OwnedTensor& s_inv) {
    auto vt = make_tensor(v, DType::kF32, kCpu, {rows, cols}, cpu_stream());
    OwnedTensor amax(DType::kF32, kCpu, {1}), scale(DType::kF32, kCpu, {1});
    q = OwnedTensor(t, kCpu, {rows, cols});
    qt = OwnedTensor(t, kCpu, {cols, rows});
    s_inv = OwnedTensor(DType::kF32, kCpu, {1});
    fp8_amax(amax, vt, cpu_stream());
    fp8_scale_from_amax(scale, s_inv, amax, t, false, 0.f, cpu_stream());
    fp8_quantize(q, qt, vt, scale, Tensor(), cpu_stream());
  };
  OwnedTensor xq, xqt, xs, wq, wqt, ws, gq, gqt, gs;
  quant(x, m, k, DType::kF8E4M3, xq, xqt, xs);
  quant(w, n, k, DType::kF8E4M3, wq, wqt, ws);
  quant(dy, m, n, DType::kF8E5M2, gq, gqt, gs);
  OwnedTensor y(DType::kF32, kCpu, {m, n}), dx(DType::kF32, kCpu, {m, k}), dw(DType::kF32, kCpu, {n, k});
  fp8_matmul(y, {xq, xs}, {wq, ws}, false, false, cpu_stream());
  fp8_matmul(dx, {gq, gs}, {wqt, ws}, false, false, cpu_stream());
  fp8_matmul(dw, {gqt, gs}, {xqt, xs}, false, false, cpu_stream());
  auto prod = [](const std::vector<float>& a, const std::vector<float>& b, int64_t M, int64_t N, int64_t K, bool ta,
                 bool tb) {
    std::vector<float> c(static_cast<size_t>(M * N));
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t kk = 0; kk < K; ++kk)
          s += double(ta ? a[kk * M + i] : a[i * K + kk]) * (tb ? b[j * K + kk] : b[kk * N + j]);
        c[static_cast<size_t>(i * N + j)] = static_cast<float>(s);
      }
    }
    return c;
  };
  EXPECT_LT(testing::rel_err(to_host(y, cpu_stream()), prod(x, w, m, n, k, false, true)), 0.08);
  EXPECT_LT(testing::rel_err(to_host(dx, cpu_stream()), prod(dy, w, m, k, n, false, false)), 0.12);
  EXPECT_LT(testing::rel_err(to_host(dw, cpu_stream()), prod(dy, x, n, k, m, true, false)), 0.12);
}

TEST(Fp8Matmul, EmptyDims) {
  OwnedTensor a(DType::kF8E4M3, kCpu, {16, 0}), b(DType::kF8E4M3, kCpu, {32, 0});
  auto s = make_tensor({1.f}, DType::kF32, kCpu, {1}, cpu_stream());
  auto d = make_tensor(std::vector<float>(16 * 32, 3.f), DType::kF32, kCpu, {16, 32}, cpu_stream());
  fp8_matmul(d, {a, s}, {b, s}, true, false, cpu_stream());
  EXPECT_EQ(to_host(d, cpu_stream()), std::vector<float>(16 * 32, 3.f));
  fp8_matmul(d, {a, s}, {b, s}, false, false, cpu_stream());
  EXPECT_EQ(to_host(d, cpu_stream()), std::vector<float>(16 * 32, 0.f));
}

// ------------------------------------------------------------------------------------------------
// Errors.

TEST(Fp8Errors, Matmul) {
  auto s = make_tensor({1.f}, DType::kF32, kCpu, {1}, cpu_stream());
  OwnedTensor a(DType::kF8E4M3, kCpu, {32, 64}), b(DType::kF8E4M3, kCpu, {48, 64}), d(DType::kF32, kCpu, {32, 48});
  OwnedTensor a5(DType::kF8E5M2, kCpu, {32, 64}), b5(DType::kF8E5M2, kCpu, {48, 64});
  OwnedTensor odd(DType::kF8E4M3, kCpu, {40, 64}), dodd(DType::kF32, kCpu, {40, 48});
  OwnedTensor d16(DType::kBF16, kCpu, {32, 48});
  const Stream& st = cpu_stream();
  testing::expect_error([&] { fp8_matmul(dodd, {odd, s}, {b, s}, false, false, st); }, "multiples of 16");
  testing::expect_error([&] { fp8_matmul(d, {a5, s}, {b5, s}, false, false, st); }, "both fp8_e5m2");
  testing::expect_error([&] { fp8_matmul(d16, {a, s}, {b, s}, false, false, st); }, "must be fp32");
  EXPECT_NO_THROW(fp8_matmul(d, {a, s}, {b, s}, false, false, st));
}

TEST(Fp8Errors, MatmulScalings) {
  const Stream& st = cpu_stream();
  auto s = make_tensor({1.f}, DType::kF32, kCpu, {1}, cpu_stream());
  OwnedTensor a(DType::kF8E4M3, kCpu, {32, 256}), b(DType::kF8E4M3, kCpu, {48, 256}), d(DType::kF32, kCpu, {32, 48});
  OwnedTensor a1(DType::kF32, kCpu, fp8_scale_shape(Fp8Scaling::kBlock1x128, 32, 256));
  OwnedTensor a2(DType::kF32, kCpu, fp8_scale_shape(Fp8Scaling::kBlock128x128, 32, 256));
  OwnedTensor b2(DType::kF32, kCpu, fp8_scale_shape(Fp8Scaling::kBlock128x128, 48, 256));
  testing::expect_error(
      [&] {
        fp8_matmul(d, {a, a2, Fp8Scaling::kBlock128x128}, {b, b2, Fp8Scaling::kBlock128x128}, false, false, st);
      },
      "both 128x128");
  testing::expect_error(
      [&] {
        fp8_matmul(d, {a, a1, Fp8Scaling::kBlock1x128}, {b, s}, false, false, st);
      },
      "both tensorwise or both blockwise");
  testing::expect_error(
      [&] {
        fp8_matmul(d, {a, a1, Fp8Scaling::kBlock1x128}, {b, b2, Fp8Scaling::kBlock128x128}, false, true, st);
      },
      "fast_accum");
  testing::expect_error(
      [&] {
        fp8_matmul(d, {a, a2, Fp8Scaling::kBlock1x128}, {b, b2, Fp8Scaling::kBlock128x128}, false, false, st);
      },
      "a.scale_inv");
  testing::expect_error([&] { fp8_matmul(d, {a, a1, Fp8Scaling::kTensor}, {b, s}, false, false, st); }, "a.scale_inv");
  OwnedTensor bias(DType::kF32, kCpu, {48});
  testing::expect_error(
      [&] {
        fp8_matmul(d, {a, a1, Fp8Scaling::kBlock1x128}, {b, b2, Fp8Scaling::kBlock128x128}, false, false, st, Tensor(),
                   bias);
      },
      "fp8_matmul: a bias epilogue needs tensorwise scaling, got 1x128 x 128x128");
}

TEST(Fp8Errors, QuantizeAndScales) {
  const Stream& st = cpu_stream();
  auto x = make_tensor(randn(6 * 10), DType::kF32, kCpu, {6, 10}, cpu_stream());
  auto s = make_tensor({1.f}, DType::kF32, kCpu, {1}, cpu_stream());
  OwnedTensor q(DType::kF8E4M3, kCpu, {6, 10}), qt_bad(DType::kF8E4M3, kCpu, {6, 10}),
      q5t(DType::kF8E5M2, kCpu, {10, 6});
  OwnedTensor qi(DType::kI32, kCpu, {6, 10}), s2(DType::kF32, kCpu, {2});
  testing::expect_error([&] { fp8_quantize(Tensor(), Tensor(), x, s, Tensor(), st); }, "both empty");
  testing::expect_error([&] { fp8_quantize(q, qt_bad, x, s, Tensor(), st); }, "q_t");
  testing::expect_error([&] { fp8_quantize(q, q5t, x, s, Tensor(), st); }, "one FP8 dtype");
  testing::expect_error([&] { fp8_quantize(qi, Tensor(), x, s, Tensor(), st); }, "fp8_e4m3 or fp8_e5m2");
  testing::expect_error([&] { fp8_quantize(q, Tensor(), x, s2, Tensor(), st); }, "scale");
  OwnedTensor xb(DType::kBF16, kCpu, {6, 10});
  testing::expect_error([&] { fp8_quantize_bf16_rounded(q, Tensor(), xb, s, Tensor(), st); }, "must be fp32");
  testing::expect_error([&] { fp8_quantize_bf16_rounded(q, qt_bad, x, s, Tensor(), st); }, "q_t");
  testing::expect_error([&] { fp8_quantize_blockwise(q, s, Tensor(), Tensor(), x, Fp8Scaling::kTensor, true, st); },
                        "1x128 or 128x128");
  testing::expect_error([&] { fp8_quantize_blockwise(q, s, Tensor(), Tensor(), x, Fp8Scaling::kBlock1x128, true, st); },
                        "q_scale_inv");
  testing::expect_error(
      [&] { fp8_quantize_blockwise(q, Tensor(), Tensor(), Tensor(), x, Fp8Scaling::kBlock1x128, true, st); }, "pairs");
  OwnedTensor hist(DType::kF32, kCpu, {4, 2}), sc(DType::kF32, kCpu, {2}), si(DType::kF32, kCpu, {2});
  testing::expect_error([&] { fp8_delayed_scale_update(hist, sc, si, DType::kF8E4M3, -1, AmaxAlgo::kMax, st); },
                        "margin");
  testing::expect_error([&] { fp8_delayed_scale_update(hist, s, si, DType::kF8E4M3, 0, AmaxAlgo::kMax, st); }, "scale");
  testing::expect_error([&] { fp8_delayed_scale_update(hist, sc, si, DType::kBF16, 0, AmaxAlgo::kMax, st); },
                        "fp8_e4m3 or fp8_e5m2");
  testing::expect_error([&] { fp8_scale_from_amax(sc, si, s2, DType::kF8E4M3, false, -1.f, st); }, "epsilon");
  testing::expect_error([&] { fp8_scale_from_amax(s, si, s2, DType::kF8E4M3, false, 0.f, st); }, "scale");
  testing::expect_error([&] { fp8_amax(s2, x, st); }, "amax");
}

}  // namespace
}  // namespace mt
