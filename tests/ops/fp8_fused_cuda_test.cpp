// Fused FP8 quantisation on CUDA (ops/fp8_fused.h) against the unfused CUDA path and the CPU
// reference: for RMSNorm (with and without zero-centred gamma), SwiGLU (with and without its bf16
// output, with the transposed bytes), SwiGLU's backward, GELU (with and without y) and GELU's
// backward (with and without dx and the bias gradient), fp32 / bf16 / fp16
// activations, e4m3 / e5m2, ragged shapes (scalar and 16-byte vector kernels), with and without
// the amax record:
//  * the fused kernel equals the unfused CUDA composition (the op, then fp8_quantize)
//    bit for bit — y, rstd, the FP8 bytes, their transpose and the amax record (what wiring it into the layers
//    needs: the FP8 layouts' results do not move);
//  * its FP8 bytes and amax are the CPU quantiser's (fp8_quantize, the emulation) of its own y,
//    bit for bit;
//  * its y agrees with the CPU forward op within the op's CPU / CUDA tolerance (the reductions
//    and expf differ in the last bits between the backends);
//  * the GELU backward's bias gradient: bit for bit that of fp8_gelu_backward without FP8 outputs
//    (the model's unfused path), within fp32 summation order of the unfused column sum.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "fp8_fused_util.h"
#include "ops/cuda/fp8_fused_chunks.h"

namespace mt {
namespace {

using fp8_fused_test::Inputs;
using fp8_fused_test::Op;
using fp8_fused_test::Outputs;
using fp8_fused_test::run;
using testing::cpu_stream;
using testing::cuda_stream;

const Device kCpu = Device::cpu(), kGpu = Device::cuda(0);

/// The CPU quantiser's bytes and record for values y (fp32, exact copies of the GPU's stored y).
std::pair<std::vector<uint8_t>, float> cpu_quantize(const std::vector<float>& y, int64_t rows, DType fp8, float scale,
                                                    float amax0) {
  const auto& st = cpu_stream();
  const int64_t cols = static_cast<int64_t>(y.size()) / rows;
  const testing::OwnedTensor t = testing::make_tensor(y, DType::kF32, kCpu, {rows, cols}, st);
  const testing::OwnedTensor q(fp8, kCpu, {rows, cols});
  const testing::OwnedTensor s = testing::make_tensor({scale}, DType::kF32, kCpu, {1}, st);
  const testing::OwnedTensor a = testing::make_tensor({amax0 < 0 ? 0.f : amax0}, DType::kF32, kCpu, {1}, st);
  fp8_quantize(q, Tensor(), t, s, amax0 < 0 ? Tensor() : a.t, st);
  return {fp8_test::to_bytes(q, st), testing::to_host(a, st)[0]};
}

/// The GELU backward's bias gradient (from 0.5 per column): the fused call's equals
/// fp8_gelu_backward's without FP8 outputs bit for bit (dx too), and the unfused column sum of
/// the same dx within fp32 summation order (NaN columns NaN in all three).
void expect_gelu_dbias(const Outputs& f, const Outputs& u, const Inputs& in, int64_t rows, int64_t cols, DType act) {
  const auto& st = cuda_stream();
  const testing::OwnedTensor pre = testing::make_tensor(in.x, act, kGpu, {rows, cols}, st);
  const testing::OwnedTensor dy = testing::make_tensor(in.dy, act, kGpu, {rows, cols}, st);
  const testing::OwnedTensor db =
      testing::make_tensor(std::vector<float>(static_cast<size_t>(cols), 0.5f), DType::kF32, kGpu, {cols}, st);
  // dx aliasing dy, as the model's unfused path calls it
  fp8_gelu_backward(dy, Tensor(), Tensor(), db, dy, pre, Tensor(), Tensor(), st);
  EXPECT_TRUE(testing::same_bits(testing::to_host(dy, st), f.y)) << "dx without FP8 outputs";
  const std::vector<float> plain = testing::to_host(db, st);
  EXPECT_TRUE(testing::same_bits(plain, f.dbias)) << "bias gradient without FP8 outputs";
  ASSERT_EQ(f.dbias.size(), u.dbias.size());
  double worst = 0;
  for (size_t c = 0; c < f.dbias.size(); ++c) {
    if (std::isnan(u.dbias[c])) {
      EXPECT_TRUE(std::isnan(f.dbias[c])) << c;
      continue;
    }
    double mag = 1.0;  // the sum's scale: Σ |dx| of the column
    for (int64_t r = 0; r < rows; ++r) mag += std::fabs(double(u.y[static_cast<size_t>(r * cols) + c]));
    worst = std::max(worst, std::fabs(double(f.dbias[c]) - u.dbias[c]) / mag);
  }
  EXPECT_LT(worst, 1e-6) << "bias gradient against the unfused column sum";
}

TEST(Fp8FusedCuda, EqualsUnfusedAndCpuQuantizer) {
  for (const Op op : {Op::kRmsNorm, Op::kSwiglu, Op::kSwigluGrad, Op::kGelu, Op::kGeluGrad})
    for (const DType act : {DType::kF32, DType::kBF16, DType::kF16})
      for (const DType fp8 : {DType::kF8E4M3, DType::kF8E5M2})
        for (const auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 16}, {7, 34}, {33, 256}, {300, 4096}})
          for (const float amax0 : {-1.f, 0.f}) {
            const bool zc = rows == 7;
            SCOPED_TRACE(fmt::format("{} {} {} [{}, {}] amax0 {} zc {}", fp8_fused_test::op_name(op),
                                     dtype_name(act), dtype_name(fp8), rows, cols, amax0, zc));
            Inputs in = fp8_fused_test::inputs(rows, cols, fp8, amax0, /*nan_row=*/true);
            in.x = testing::rounded(in.x, act);
            in.weight = testing::rounded(in.weight, act);
            in.dy = testing::rounded(in.dy, act);
            const Outputs f = run(op, true, in, rows, cols, act, fp8, kGpu, cuda_stream(), zc);
            const Outputs u = run(op, false, in, rows, cols, act, fp8, kGpu, cuda_stream(), zc);
            if (op != Op::kSwigluGrad) EXPECT_TRUE(testing::same_bits(f.y, u.y)) << "y";  // the backward writes no dx
            EXPECT_TRUE(testing::same_bits(f.rstd, u.rstd)) << "rstd";
            EXPECT_TRUE(testing::same_bits(f.pre, u.pre)) << "pre (read only)";
            EXPECT_EQ(f.q, u.q) << "FP8 bytes";
            EXPECT_EQ(f.qt, u.qt) << "transposed FP8 bytes";
            EXPECT_TRUE(testing::same_bits(f.amax, u.amax)) << "amax record";
            if (op == Op::kGeluGrad && !zc) expect_gelu_dbias(f, u, in, rows, cols, act);
            if (op != Op::kRmsNorm && op != Op::kSwigluGrad) {  // without y (dx): the same bytes and record
              const Outputs n = run(op, true, in, rows, cols, act, fp8, kGpu, cuda_stream(), zc, false);
              EXPECT_TRUE(testing::same_bits(n.dbias, f.dbias)) << "bias gradient without dx";
              EXPECT_EQ(n.q, u.q) << "FP8 bytes without y";
              EXPECT_EQ(n.qt, u.qt) << "transposed FP8 bytes without y";
              EXPECT_TRUE(testing::same_bits(n.amax, u.amax)) << "amax record without y";
            }
            const auto [cq, camax] = cpu_quantize(u.y, rows, fp8, in.scale, amax0);
            EXPECT_EQ(f.q, cq) << "FP8 bytes against the CPU quantiser of the same y";
            EXPECT_EQ(f.amax[0], camax) << "amax against the CPU";
            if (op != Op::kRmsNorm) {
              const size_t ycols = f.q.size() / static_cast<size_t>(rows);
              size_t bad = 0;
              for (size_t i = 0; i < f.q.size(); ++i) bad += f.qt[(i % ycols) * rows + i / ycols] != f.q[i];
              EXPECT_EQ(bad, 0u) << "q_t is not the transpose of q";
            }
            // y against the CPU op (fp32 reference on the act-rounded inputs), NaN rows excluded
            const Outputs c = run(op, false, in, rows, cols, DType::kF32, fp8, kCpu, cpu_stream(), zc);
            double worst = 0;
            for (size_t i = 0; i < c.y.size(); ++i) {
              if (std::isnan(c.y[i])) {
                EXPECT_TRUE(std::isnan(u.y[i])) << i;
                continue;
              }
              worst = std::max(worst, std::fabs(double(u.y[i]) - c.y[i]) / std::max(1.0, std::fabs(double(c.y[i]))));
            }
            EXPECT_LT(worst, act == DType::kF32 ? 1e-5 : 1e-2) << "y against the CPU op";
          }
}

// The GELU backward's bias gradient in chunks of row tiles (what the op does when the tiles' partial
// rows outgrow the stream's workspace, at ~1G elements): chunks of 1 and 2 of 3 tiles give the
// unchunked call's dx, FP8 bytes and amax bit for bit and its bias gradient within fp32 summation
// order; a chunk of 3 (all tiles) its bias gradient bit for bit.
TEST(Fp8FusedCuda, GeluBiasGradientInChunks) {
  const auto& st = cuda_stream();
  const int64_t rows = 300, f = 4096;
  const std::vector<float> pre = testing::rounded(testing::randn(rows * f, 2.f), DType::kBF16);
  const std::vector<float> dy = testing::rounded(testing::randn(rows * f, 1.f), DType::kBF16);
  const testing::OwnedTensor tp = testing::make_tensor(pre, DType::kBF16, kGpu, {rows, f}, st);
  const testing::OwnedTensor td = testing::make_tensor(dy, DType::kBF16, kGpu, {rows, f}, st);
  const testing::OwnedTensor scale = testing::make_tensor({16.f}, DType::kF32, kGpu, {1}, st);
  struct Out {
    std::vector<float> dx, dbias, amax;
    std::vector<uint8_t> q, qt;
  };
  auto run = [&](int64_t chunk) {
    const testing::OwnedTensor dx(DType::kBF16, kGpu, {rows, f}), q(DType::kF8E5M2, kGpu, {rows, f}),
        qt(DType::kF8E5M2, kGpu, {f, rows});
    const testing::OwnedTensor db =
        testing::make_tensor(std::vector<float>(static_cast<size_t>(f), 0.5f), DType::kF32, kGpu, {f}, st);
    const testing::OwnedTensor amax = testing::make_tensor({0.f}, DType::kF32, kGpu, {1}, st);
    testing::poison(dx, st);
    if (chunk == 0) {
      fp8_gelu_backward(dx, q, qt, db, td, tp, scale, amax, st);
    } else {
      cuda::fp8_gelu_backward_in_chunks(dx, q, qt, db, td, tp, scale, amax, chunk, st);
    }
    return Out{testing::to_host(dx, st), testing::to_host(db, st), testing::to_host(amax, st),
               fp8_test::to_bytes(q, st), fp8_test::to_bytes(qt, st)};
  };
  const Out ref = run(0);
  for (const int64_t chunk : {1, 2, 3}) {
    SCOPED_TRACE(chunk);
    const Out o = run(chunk);
    EXPECT_TRUE(testing::same_bits(o.dx, ref.dx));
    EXPECT_EQ(o.q, ref.q);
    EXPECT_EQ(o.qt, ref.qt);
    EXPECT_TRUE(testing::same_bits(o.amax, ref.amax));
    if (chunk == 3) {
      EXPECT_TRUE(testing::same_bits(o.dbias, ref.dbias));
      continue;
    }
    double worst = 0;
    for (int64_t c = 0; c < f; ++c) {
      double mag = 1.0;
      for (int64_t r = 0; r < rows; ++r) mag += std::fabs(double(ref.dx[static_cast<size_t>(r * f + c)]));
      const size_t ci = static_cast<size_t>(c);
      worst = std::max(worst, std::fabs(double(o.dbias[ci]) - ref.dbias[ci]) / mag);
    }
    EXPECT_LT(worst, 1e-6);
    EXPECT_GT(worst, 0.0) << "the chunked sums should differ somewhere in the last bits: the chunking did not run";
  }
  EXPECT_ANY_THROW(cuda::fp8_gelu_backward_in_chunks(Tensor(), Tensor(), Tensor(), Tensor(), td, tp, Tensor(),
                                                     Tensor(), 0, st));
}

}  // namespace
}  // namespace mt
