// CUDA tests of ops/fp8_grouped.h: the grouped amax and quantisation (fp32 and bf16 inputs, both
// FP8 formats) bit for bit against fp8_amax / fp8_quantize of each group's rows on the CPU
// (fp8_grouped_test_util.h: ragged and empty groups, NaN / infinity, strided scales and records,
// zero tails of q and of the padded q_t).
#include <gtest/gtest.h>

#include "fp8_grouped_test_util.h"

namespace mt {
namespace {

TEST(Fp8GroupedCuda, EqualsCpuPerGroupQuantisation) {
  MT_REQUIRE_CUDA();
  const Stream s(Device::cuda(0));
  for (DType x : {DType::kF32, DType::kBF16})
    for (DType fp8 : {DType::kF8E4M3, DType::kF8E5M2}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(x) << " " << dtype_name(fp8));
      fp8_grouped_test::check_against_per_group(Device::cuda(0), x, fp8, s);
    }
}

}  // namespace
}  // namespace mt
