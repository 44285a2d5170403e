// ops/grouped_matmul.h's FP8 ops on the CPU (the per-group fp8_matmul emulation) against a float64
// reference of the FP8 values: ragged, empty and skewed counts, hybrid (e5m2 x e4m3) operands,
// one or per-group row-operand scales, the tail rows zeroed, tail inputs (NaN codes) never read,
// empty groups' gradients unchanged, exact results for small-integer operands with power-of-two
// scales, and the documented errors.
#include <gtest/gtest.h>

#include <cmath>

#include "ops/grouped_fp8_test_util.h"

namespace mt {
namespace {

using grouped_fp8_test::Case;
using testing::cpu_stream;
using testing::OwnedTensor;
const Device kCpu = Device::cpu();

/// |got - ref| within fp32 accumulation of the products (k terms) for random operands, 0 for ints.
void expect_close(const std::vector<float>& got, const grouped_fp8_test::Ref& r, int64_t terms, bool exact,
                  const char* what) {
  ASSERT_EQ(got.size(), r.ref.size());
  const double tol = exact ? 0.0 : 2.0 * static_cast<double>(terms + 2) * std::ldexp(1.0, -24);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << " at " << i;
    ASSERT_LE(std::fabs(double(got[i]) - r.ref[i]), tol * r.bound[i] + (exact ? 0.0 : 1e-30))
        << what << " at " << i << ": " << got[i] << " vs " << r.ref[i];
  }
}

OwnedTensor scale_tensor(const std::vector<float>& s, Device device, const Stream& stream) {
  return testing::make_tensor(s, DType::kF32, device, {static_cast<int64_t>(s.size())}, stream);
}

void check_forward(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "R=" << c.R << " N=" << c.N << " K=" << c.K << " G=" << c.groups());
  const grouped_fp8_test::Rows d = grouped_fp8_test::make_rows(c);
  auto a = fp8_test::bytes_tensor(d.a, c.a_dt, kCpu, {c.R, c.K}, cpu_stream());
  auto sa = scale_tensor(d.sa, kCpu, cpu_stream()), sw = scale_tensor(d.sw, kCpu, cpu_stream());
  auto w = grouped_fp8_test::fp8_group(d.w, c.b_dt, c.N, c.K, kCpu, cpu_stream());
  auto counts = testing::make_int_tensor(c.counts, kCpu, {c.groups()}, cpu_stream());
  OwnedTensor y(DType::kF32, kCpu, {c.R, c.N});
  testing::poison(y, cpu_stream());
  grouped_fp8_linear_forward(y, a, sa, w.weights, sw, counts, cpu_stream());
  expect_close(testing::to_host(y, cpu_stream()), grouped_fp8_test::rows_ref(c, d), c.K, c.ints, "y");
}

void check_wgrad(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "R=" << c.R << " N=" << c.N << " K=" << c.K << " G=" << c.groups());
  const grouped_fp8_test::Cols d = grouped_fp8_test::make_cols(c);
  auto dyt = fp8_test::bytes_tensor(d.dyt, c.a_dt, kCpu, {c.N, c.R}, cpu_stream());
  auto xt = fp8_test::bytes_tensor(d.xt, c.b_dt, kCpu, {c.K, c.R}, cpu_stream());
  auto sdy = scale_tensor(d.sdy, kCpu, cpu_stream()), sx = scale_tensor(d.sx, kCpu, cpu_stream());
  auto dw = grouped_fp8_test::f32_group(d.dw0, c.N, c.K, kCpu, cpu_stream());
  auto counts = testing::make_int_tensor(c.counts, kCpu, {c.groups()}, cpu_stream());
  grouped_fp8_linear_wgrad(dw.weights, dyt, sdy, xt, sx, counts, cpu_stream());
  for (int64_t g = 0; g < c.groups(); ++g) {
    const std::vector<float> got = testing::to_host(dw.store[size_t(g)], cpu_stream());
    if (c.counts[size_t(g)] == 0) {
      EXPECT_TRUE(testing::same_bits(got, d.dw0[size_t(g)])) << "empty group " << g << " changed its gradient";
      continue;
    }
    SCOPED_TRACE(::testing::Message() << "group " << g);
    expect_close(got, grouped_fp8_test::cols_ref(c, d, g), c.counts[size_t(g)], c.ints, "dw");
  }
}

void check_both(Case c) {
  check_forward(c);
  check_wgrad(c);
  c.ints = true;
  check_forward(c);
  check_wgrad(c);
}

TEST(GroupedFp8Matmul, RaggedGroups) {
  check_both({64, 32, 48, {7, 0, 13, 1, 0, 11}});  // 32 of 64 rows: a tail of 32
}

TEST(GroupedFp8Matmul, SkewedAndAllInOneGroup) {
  check_both({48, 16, 32, {0, 45, 0, 1}});
  check_both({32, 48, 16, {32}});
}

TEST(GroupedFp8Matmul, AllEmpty) { check_both({16, 16, 16, {0, 0, 0}}); }

TEST(GroupedFp8Matmul, HybridAndPerGroupScales) {
  // hybrid: the gradient dy in e5m2 (the forward's row operand here plays dgrad's dy against wᵀ)
  Case c{80, 32, 64, {17, 30, 0, 9, 20}, DType::kF8E5M2, DType::kF8E4M3, /*per_group_a=*/true};
  check_both(c);
  c.a_dt = DType::kF8E4M3;
  c.b_dt = DType::kF8E5M2;
  c.per_group_a = false;
  check_both(c);
}

TEST(GroupedFp8Matmul, Errors) {
  const Stream& s = cpu_stream();
  OwnedTensor a(DType::kF8E4M3, kCpu, {32, 16}), y(DType::kF32, kCpu, {32, 16});
  OwnedTensor w0(DType::kF8E4M3, kCpu, {16, 16}), w5(DType::kF8E5M2, kCpu, {16, 16});
  OwnedTensor s1(DType::kF32, kCpu, {1}), s2(DType::kF32, kCpu, {2}), s3(DType::kF32, kCpu, {3});
  testing::upload(s1, {1.f}, s);
  testing::upload(s2, {1.f, 1.f}, s);
  GroupedWeights w({w0.t, w0.t}, s);
  auto ok = testing::make_int_tensor({10, 20}, kCpu, {2}, s);
  auto too_many = testing::make_int_tensor({20, 20}, kCpu, {2}, s);
  memset_tensor(a, 0, s);
  memset_tensor(w0, 0, s);
  grouped_fp8_linear_forward(y, a, s1, w, s2, ok, s);  // the valid call runs
  EXPECT_EQ(testing::to_host(y, s), std::vector<float>(32 * 16, 0.f));
  testing::expect_error([&] { grouped_fp8_linear_forward(y, a, s1, w, s2, too_many, s); }, "more than the 32");
  testing::expect_error([&] { grouped_fp8_linear_forward(y, a, s3, w, s2, ok, s); }, "1 or G = 2");
  OwnedTensor a5(DType::kF8E5M2, kCpu, {32, 16});
  GroupedWeights w55({w5.t, w5.t}, s);
  testing::expect_error([&] { grouped_fp8_linear_forward(y, a5, s1, w55, s2, ok, s); }, "both operands are fp8_e5m2");
  OwnedTensor w8(DType::kF8E4M3, kCpu, {8, 16}), y8(DType::kF32, kCpu, {32, 8});
  GroupedWeights wn8({w8.t, w8.t}, s);
  testing::expect_error([&] { grouped_fp8_linear_forward(y8, a, s1, wn8, s2, ok, s); }, "multiples of 16");
  OwnedTensor ybf(DType::kBF16, kCpu, {32, 16});
  testing::expect_error([&] { grouped_fp8_linear_forward(ybf, a, s1, w, s2, ok, s); }, "must be a contiguous fp32");
  OwnedTensor af(DType::kF32, kCpu, {32, 16});
  testing::expect_error([&] { grouped_fp8_linear_forward(y, af, s1, w, s2, ok, s); }, "fp8_e4m3/fp8_e5m2");
  // wgrad: dw fp32, R a multiple of 16, the transposes' shapes
  OwnedTensor g0(DType::kF32, kCpu, {16, 16});
  GroupedWeights dw({g0.t, g0.t}, s);
  OwnedTensor t24(DType::kF8E4M3, kCpu, {16, 24});
  testing::expect_error([&] { grouped_fp8_linear_wgrad(dw, t24, s1, t24, s2, ok, s); }, "multiple of 16");
  OwnedTensor t32(DType::kF8E4M3, kCpu, {16, 32}), t32b(DType::kF8E4M3, kCpu, {32, 32});
  testing::expect_error([&] { grouped_fp8_linear_wgrad(dw, t32b, s1, t32, s2, ok, s); }, "must have 16 rows");
  testing::expect_error([&] { grouped_fp8_linear_wgrad(w, t32, s1, t32, s2, ok, s); }, "fp32 main gradients");
}

}  // namespace
}  // namespace mt
