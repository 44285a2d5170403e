// Fused FP8 quantisation on the CPU (ops/fp8_fused.h): RMSNorm, SwiGLU, SwiGLU's backward, GELU and
// GELU's backward with FP8 output equal the unfused composition (the op, then fp8_quantize of its
// output) bit for bit — y, rstd, pre left unchanged, the bias gradient, the FP8 bytes (and their
// transpose) and the amax record — at ragged shapes, for both formats, with saturation, a NaN and a
// previous record above and below the tensor's amax; the bytes are the host conversion of y ·
// scale element by element; every documented error.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "fp8_fused_util.h"

namespace mt {
namespace {

using fp8_fused_test::Inputs;
using fp8_fused_test::Op;
using fp8_fused_test::Outputs;
using fp8_fused_test::run;
using testing::cpu_stream;
using testing::expect_error;

const Device kCpu = Device::cpu();

TEST(Fp8Fused, EqualsUnfusedComposition) {
  for (const Op op : {Op::kRmsNorm, Op::kSwiglu, Op::kSwigluGrad, Op::kGelu, Op::kGeluGrad})
    for (const DType fp8 : {DType::kF8E4M3, DType::kF8E5M2})
      for (const auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 16}, {7, 34}, {33, 256}})
        for (const float amax0 : {-1.f, 0.f, 1e6f}) {
          SCOPED_TRACE(fmt::format("{} {} [{}, {}] amax0 {}", fp8_fused_test::op_name(op), dtype_name(fp8), rows,
                                   cols, amax0));
          const Inputs in = fp8_fused_test::inputs(rows, cols, fp8, amax0, /*nan_row=*/true);
          const Outputs f = run(op, true, in, rows, cols, DType::kF32, fp8, kCpu, cpu_stream(), rows == 7);
          const Outputs u = run(op, false, in, rows, cols, DType::kF32, fp8, kCpu, cpu_stream(), rows == 7);
          if (op != Op::kSwigluGrad) EXPECT_TRUE(testing::same_bits(f.y, u.y));  // the backward writes no dx
          EXPECT_TRUE(testing::same_bits(f.rstd, u.rstd));
          EXPECT_TRUE(testing::same_bits(f.pre, u.pre));
          if (op == Op::kGelu) EXPECT_TRUE(testing::same_bits(f.pre, in.x)) << "pre is read only";
          EXPECT_TRUE(testing::same_bits(f.dbias, u.dbias));
          EXPECT_EQ(f.dbias.empty(), !fp8_fused_test::is_gelu(op) || rows == 7 || op == Op::kGelu);
          EXPECT_EQ(f.q, u.q);
          EXPECT_EQ(f.qt, u.qt);
          EXPECT_TRUE(testing::same_bits(f.amax, u.amax));
          if (op != Op::kRmsNorm && op != Op::kSwigluGrad) {  // without y (dx): the same bytes and record
            const Outputs n = run(op, true, in, rows, cols, DType::kF32, fp8, kCpu, cpu_stream(), rows == 7, false);
            EXPECT_TRUE(n.y.empty());
            EXPECT_TRUE(testing::same_bits(n.dbias, u.dbias));
            EXPECT_EQ(n.q, u.q);
            EXPECT_EQ(n.qt, u.qt);
            EXPECT_TRUE(testing::same_bits(n.amax, u.amax));
          }
          // the bytes: the host conversion of y · scale (NaN -> 0x7f), q_t their transpose; the
          // record: max(amax0, max |y|)
          float m = 0.f;
          bool saturated = false;
          const size_t ycols = u.y.size() / static_cast<size_t>(rows);
          for (size_t i = 0; i < u.y.size(); ++i) {
            const float v = u.y[i];
            EXPECT_EQ(f.q[i], std::isnan(v) ? 0x7f : f32_to_fp8_bits(fp8, v * in.scale)) << i;
            if (op != Op::kRmsNorm) EXPECT_EQ(f.qt[(i % ycols) * rows + i / ycols], f.q[i]) << i;
            if (!std::isnan(v)) m = std::max(m, std::fabs(v));
            saturated = saturated || (std::fabs(v * in.scale) > fp8_max(fp8));
          }
          EXPECT_TRUE(saturated || rows == 1) << "no element saturates: the case tests less than it says";
          EXPECT_EQ(f.amax[0], amax0 < 0 ? 0.f : std::max(amax0, m));
        }
}

TEST(Fp8Fused, Errors) {
  const auto& st = cpu_stream();
  const testing::OwnedTensor x(DType::kF32, kCpu, {4, 32}), y(DType::kF32, kCpu, {4, 32}), w(DType::kF32, kCpu, {32});
  const testing::OwnedTensor rstd(DType::kF32, kCpu, {4}), q(DType::kF8E4M3, kCpu, {4, 32});
  const testing::OwnedTensor s(DType::kF32, kCpu, {1}), s2(DType::kF32, kCpu, {2}), qb(DType::kBF16, kCpu, {4, 32});
  const testing::OwnedTensor qs(DType::kF8E4M3, kCpu, {4, 16}), ys(DType::kF32, kCpu, {4, 16});
  expect_error([&] { fp8_rmsnorm_forward(y, qb, rstd, x, w, 1e-5f, s, Tensor(), st); },
               "fp8_rmsnorm_forward: q must be fp8_e4m3 or fp8_e5m2, got bf16");
  expect_error([&] { fp8_rmsnorm_forward(y, qs, rstd, x, w, 1e-5f, s, Tensor(), st); }, "must be contiguous with y's shape [4, 32]");
  expect_error([&] { fp8_rmsnorm_forward(y, q, rstd, x, w, 1e-5f, s2, Tensor(), st); },
               "scale must be a contiguous fp32 tensor of 1 element(s), got fp32[2]");
  expect_error([&] { fp8_rmsnorm_forward(y, q, rstd, x, w, 1e-5f, s, s2, st); },
               "amax must be a contiguous fp32 tensor of 1 element(s), got fp32[2]");
  expect_error([&] { fp8_rmsnorm_forward(y, q, rstd, x, w, -1.f, s, Tensor(), st); }, "eps=-1 must be >= 0");
  expect_error([&] { fp8_rmsnorm_forward(y, q, rstd, x.t.slice(1, 0, 16), w, 1e-5f, s, Tensor(), st); },
               "must be contiguous");
  const testing::OwnedTensor xo(DType::kF32, kCpu, {4, 33});
  const testing::OwnedTensor qts(DType::kF8E4M3, kCpu, {16, 4}), qt5(DType::kF8E5M2, kCpu, {16, 4});
  const testing::OwnedTensor qt(DType::kF8E4M3, kCpu, {32, 4});
  expect_error([&] { fp8_swiglu_forward(ys, qs, Tensor(), xo, s, Tensor(), st); },
               "fp8_swiglu_forward: the last dimension of x fp32[4, 33]@cpu must be even");
  expect_error([&] { fp8_swiglu_forward(y, q, Tensor(), x, s, Tensor(), st); },
               "y fp32[4, 32]@cpu must be x fp32[4, 32]@cpu with the last dimension halved");
  expect_error([&] { fp8_swiglu_forward(ys, q, Tensor(), x, s, Tensor(), st); },
               "q fp8_e4m3[4, 32]@cpu must be contiguous of shape [4, 16]");
  expect_error([&] { fp8_swiglu_forward(ys, Tensor(), q, x, s, Tensor(), st); },
               "q_t fp8_e4m3[4, 32]@cpu must be a contiguous [16, 4] (the transpose)");
  expect_error([&] { fp8_swiglu_forward(ys, qs, qt5, x, s, Tensor(), st); }, "need one FP8 dtype");
  expect_error([&] { fp8_swiglu_forward(ys, Tensor(), Tensor(), x, s, Tensor(), st); },
               "q and q_t are both empty: nothing to write");
  fp8_swiglu_forward(ys, qs, qts, x, s, Tensor(), st);        // well-formed
  fp8_swiglu_forward(Tensor(), qs, Tensor(), x, s, s, st);    // without y
  expect_error([&] { fp8_swiglu_backward(q, qt, y, x, s, Tensor(), st); },
               "fp8_swiglu_backward: dy fp32[4, 32]@cpu must be x fp32[4, 32]@cpu with the last dimension halved");
  expect_error([&] { fp8_swiglu_backward(qs, qt, ys, x, s, Tensor(), st); },
               "dq fp8_e4m3[4, 16]@cpu must be contiguous of shape [4, 32]");
  expect_error([&] { fp8_swiglu_backward(q, qts, ys, x, s, Tensor(), st); },
               "dq_t fp8_e4m3[16, 4]@cpu must be a contiguous [32, 4] (the transpose)");
  expect_error([&] { fp8_swiglu_backward(q, qt, ys, x, s2, Tensor(), st); },
               "scale must be a contiguous fp32 tensor of 1 element(s), got fp32[2]");
  fp8_swiglu_backward(q, qt, ys, x, s, Tensor(), st);  // well-formed
  // the GELU ops: pre [4, 32]
  const testing::OwnedTensor pre(DType::kF32, kCpu, {4, 32}), db(DType::kF32, kCpu, {32});
  expect_error([&] { fp8_gelu_forward(pre, q, qt, pre, s, Tensor(), st); },
               "fp8_gelu_forward: y fp32[4, 32]@cpu must not alias pre");
  expect_error([&] { fp8_gelu_forward(ys, q, qt, pre, s, Tensor(), st); }, "y fp32[4, 16]@cpu must match pre");
  expect_error([&] { fp8_gelu_forward(y, qs, Tensor(), pre, s, Tensor(), st); },
               "q fp8_e4m3[4, 16]@cpu must be contiguous of shape [4, 32]");
  expect_error([&] { fp8_gelu_forward(y, Tensor(), Tensor(), pre, s, Tensor(), st); },
               "q and q_t are both empty: nothing to write");
  expect_error([&] { fp8_gelu_forward(y, q, qt, pre, s2, Tensor(), st); },
               "scale must be a contiguous fp32 tensor of 1 element(s), got fp32[2]");
  fp8_gelu_forward(y, q, qt, pre, s, s, st);              // well-formed
  fp8_gelu_forward(Tensor(), Tensor(), qt, pre, s, Tensor(), st);  // no y
  expect_error([&] { fp8_gelu_backward(Tensor(), Tensor(), Tensor(), Tensor(), y, pre, Tensor(), Tensor(), st); },
               "fp8_gelu_backward: dx, dbias, dq and dq_t are all empty: nothing to write");
  expect_error([&] { fp8_gelu_backward(y, Tensor(), Tensor(), db, y, pre, s, Tensor(), st); },
               "given without dq or dq_t");
  expect_error([&] { fp8_gelu_backward(Tensor(), q, qt, s, y, pre, s, Tensor(), st); },
               "dbias must be a contiguous fp32 tensor of 32 element(s), got fp32[1]");
  expect_error([&] { fp8_gelu_backward(Tensor(), q, qt, db, ys, pre, s, Tensor(), st); },
               "dy fp32[4, 16]@cpu must match pre");
  expect_error([&] { fp8_gelu_backward(pre, q, qt, db, y, pre, s, Tensor(), st); },
               "dx fp32[4, 32]@cpu must not alias pre");
  expect_error([&] { fp8_gelu_backward(Tensor(), q, qts, db, y, pre, s, Tensor(), st); },
               "dq_t fp8_e4m3[16, 4]@cpu must be a contiguous [32, 4] (the transpose)");
  expect_error([&] { fp8_gelu_backward(Tensor(), q, qt, db, y, pre, Tensor(), Tensor(), st); },
               "scale must be a contiguous fp32 tensor of 1 element(s)");
  fp8_gelu_backward(y, q, qt, db, y, pre, s, s, st);                      // well-formed, dx aliasing dy
  fp8_gelu_backward(y, Tensor(), Tensor(), db, y, pre, Tensor(), Tensor(), st);  // no FP8 copies
}

}  // namespace
}  // namespace mt
