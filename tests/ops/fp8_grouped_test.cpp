// CPU tests of ops/fp8_grouped.h (the per-expert FP8 quantisation of the grouped expert MLP):
// the grouped amax and quantisation equal fp8_amax / fp8_quantize of each group's rows bit for bit
// (fp8_grouped_test_util.h), both FP8 formats; the documented errors.
#include <gtest/gtest.h>

#include "fp8_grouped_test_util.h"
#include "ops/elementwise.h"

namespace mt {
namespace {

TEST(Fp8Grouped, EqualsPerGroupQuantisation) {
  const Stream s(Device::cpu());
  for (DType fp8 : {DType::kF8E4M3, DType::kF8E5M2}) {
    SCOPED_TRACE(dtype_name(fp8));
    fp8_grouped_test::check_against_per_group(Device::cpu(), DType::kF32, fp8, s);
  }
}

TEST(Fp8Grouped, Errors) {
  const Stream s(Device::cpu());
  testing::OwnedTensor x(DType::kF32, Device::cpu(), {8, 16}), q(DType::kF8E4M3, Device::cpu(), {8, 16}),
      qt(DType::kF8E4M3, Device::cpu(), {16, 4}), sc(DType::kF32, Device::cpu(), {2}),
      bad_sc(DType::kF32, Device::cpu(), {3});
  testing::OwnedTensor counts = testing::make_int_tensor({5, 4}, Device::cpu(), {2}, s);
  fill(x.t, 1.f, s);
  fill(sc.t, 1.f, s);
  testing::expect_error([&] { fp8_grouped_quantize(q.t, Tensor(), x.t, sc.t, Tensor(), counts.t, s); },
                        "the counts sum to 9 rows, more than the 8 planned");
  testing::expect_error([&] { fp8_grouped_amax(sc.t, x.t, counts.t, s); }, "the counts sum to 9 rows");
  testing::OwnedTensor ok = testing::make_int_tensor({5, 3}, Device::cpu(), {2}, s);
  testing::expect_error([&] { fp8_grouped_quantize(q.t, Tensor(), x.t, bad_sc.t, Tensor(), ok.t, s); },
                        "scale fp32[3]@cpu must be fp32 [2] contiguous or [2, 1] (one value per group)");
  testing::expect_error([&] { fp8_grouped_quantize(Tensor(), qt.t, x.t, sc.t, Tensor(), ok.t, s); },
                        "must be a contiguous FP8 [16, >= 8]");
  testing::expect_error([&] { fp8_grouped_quantize(Tensor(), Tensor(), x.t, sc.t, Tensor(), ok.t, s); },
                        "neither q nor q_t given");
}

}  // namespace
}  // namespace mt
