// The check of ops/fp8_grouped.h shared by the CPU and CUDA tests: on `device`, ragged groups
// (an empty one, one of a single row), per-group magnitudes, NaN and infinity elements, scales
// and records at a stride of 4 (as Fp8Model's state), transposes padded beyond R; the op's
// amaxes, bytes, records and zero tails against fp8_amax / fp8_quantize of each group's rows on
// the CPU, bit for bit.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "fp8_test_util.h"
#include "ops/fp8.h"
#include "ops/fp8_grouped.h"
#include "testing/testing.h"

namespace mt::fp8_grouped_test {

using testing::OwnedTensor;

inline void check_against_per_group(Device device, DType x_dtype, DType fp8, const Stream& stream) {
  const Stream cs(Device::cpu());
  const std::vector<int32_t> counts = {7, 0, 33, 1, 20};
  const int64_t G = 5, R = 70, k = 48, rt = 80, used = 61, sv = 4;  // values at stride 4
  std::vector<float> x = testing::randn(R * k);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < k; ++c) x[static_cast<size_t>(r * k + c)] *= std::ldexp(1.f, static_cast<int>(r % 7) - 3);
  x[3 * k + 5] = std::nanf("");
  x[40 * k + 2] = INFINITY;  // group 2: amax inf, its elements saturate
  for (float& v : x) v = round_through(x_dtype, v);
  const std::vector<float> scales = {3.f, 1.f, 0.5f, 224.f, 0.125f}, record0 = {0.5f, 2.f, 0.f, 1000.f, 0.f};
  std::vector<float> sbuf(static_cast<size_t>(G * sv), -1.f), rbuf(sbuf);
  for (int64_t g = 0; g < G; ++g) {
    sbuf[static_cast<size_t>(g * sv)] = scales[static_cast<size_t>(g)];
    rbuf[static_cast<size_t>(g * sv)] = record0[static_cast<size_t>(g)];
  }
  OwnedTensor xt = testing::make_tensor(x, x_dtype, device, {R, k}, stream);
  OwnedTensor ct = testing::make_int_tensor(counts, device, {G}, stream);
  OwnedTensor st = testing::make_tensor(sbuf, DType::kF32, device, {G, sv}, stream);
  OwnedTensor rec = testing::make_tensor(rbuf, DType::kF32, device, {G, sv}, stream);
  OwnedTensor amax = testing::make_tensor(std::vector<float>(static_cast<size_t>(G * sv), -1.f), DType::kF32, device,
                                          {G, sv}, stream);
  OwnedTensor q(fp8, device, {R, k}), q_t(fp8, device, {k, rt});
  fp8_test::poison_bytes(q.t, stream);
  fp8_test::poison_bytes(q_t.t, stream);
  const Tensor scale = st.t.slice(1, 0, 1), record = rec.t.slice(1, 0, 1), amax_v = amax.t.slice(1, 0, 1);
  fp8_grouped_amax(amax_v, xt.t, ct.t, stream);
  fp8_grouped_quantize(q.t, q_t.t, xt.t, scale, record, ct.t, stream);
  const std::vector<float> got_amax = testing::to_host(amax.t, stream), got_rec = testing::to_host(rec.t, stream);
  const std::vector<uint8_t> gq = fp8_test::to_bytes(q.t, stream), gqt = fp8_test::to_bytes(q_t.t, stream);

  std::vector<float> xr(x);  // the CPU reference per group
  int64_t off = 0;
  for (int64_t g = 0; g < G; ++g) {
    SCOPED_TRACE(::testing::Message() << "group " << g);
    const int64_t n = counts[static_cast<size_t>(g)];
    std::vector<float> xg(xr.begin() + off * k, xr.begin() + (off + n) * k);
    OwnedTensor xgt = testing::make_tensor(xg, DType::kF32, Device::cpu(), {n, k}, cs);
    OwnedTensor a(DType::kF32, Device::cpu(), {1}), s = testing::make_tensor({scales[static_cast<size_t>(g)]},
                                                                               DType::kF32, Device::cpu(), {1}, cs);
    OwnedTensor r1 = testing::make_tensor({record0[static_cast<size_t>(g)]}, DType::kF32, Device::cpu(), {1}, cs);
    OwnedTensor qg(fp8, Device::cpu(), {n, k}), qgt(fp8, Device::cpu(), {k, n});
    fp8_amax(a.t, xgt.t, cs);
    EXPECT_EQ(f32_to_bits(got_amax[static_cast<size_t>(g * sv)]), f32_to_bits(testing::to_host(a.t, cs)[0]));
    EXPECT_EQ(got_amax[static_cast<size_t>(g * sv + 1)], -1.f) << "written off its stride";
    if (n > 0) {
      fp8_quantize(qg.t, qgt.t, xgt.t, s.t, r1.t, cs);
      const std::vector<uint8_t> rq = fp8_test::to_bytes(qg.t, cs), rqt = fp8_test::to_bytes(qgt.t, cs);
      for (int64_t i = 0; i < n * k; ++i) ASSERT_EQ(gq[static_cast<size_t>(off * k + i)], rq[static_cast<size_t>(i)]) << i;
      for (int64_t c = 0; c < k; ++c)
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(gqt[static_cast<size_t>(c * rt + off + i)], rqt[static_cast<size_t>(c * n + i)]) << c << " " << i;
    }
    EXPECT_EQ(f32_to_bits(got_rec[static_cast<size_t>(g * sv)]), f32_to_bits(testing::to_host(r1.t, cs)[0]))
        << "the record: max of the old value and the group's amax";
    off += n;
  }
  ASSERT_EQ(off, used);
  for (int64_t i = used * k; i < R * k; ++i) ASSERT_EQ(gq[static_cast<size_t>(i)], 0) << "q tail " << i;
  for (int64_t c = 0; c < k; ++c)
    for (int64_t r = used; r < rt; ++r) ASSERT_EQ(gqt[static_cast<size_t>(c * rt + r)], 0) << "q_t tail " << c << " " << r;
}

}  // namespace mt::fp8_grouped_test
