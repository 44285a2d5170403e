// cuda::check_gemm_desc (ops/cuda/cublaslt_gemm.h) on the host, no GPU: an FP8 GEMM description as
// fp8_matmul builds it (row-major TN, 16-byte aligned matrices and scales) passes, and each of
// cuBLASLt's FP8 requirements, violated alone, is an mt::Error naming that requirement — among
// them the scale pointer at a 4-byte offset (what Fp8Linear passed before its scale_inv slots:
// CUBLAS_STATUS_NOT_SUPPORTED from cublasLtMatmul on an H200). Also fp8_matmul on the CPU applies
// the same check, so the CPU runs of FP8 training exercise it.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>

#include "ops/cuda/cublaslt_gemm.h"
#include "ops/elementwise.h"
#include "ops/fp8_matmul.h"
#include "testing/testing.h"

namespace mt {
namespace {

using cuda::GemmDesc;
using cuda::GemmEpilogue;
using cuda::GemmScaleMode;

// Host memory standing in for device buffers (never dereferenced): 256-byte aligned.
alignas(256) uint8_t g_a[256 * 64], g_b[256 * 64];
alignas(256) float g_c[64 * 64];
alignas(256) float g_scales[64];

/// fprop of a [64, 48] x [32, 48]ᵀ FP8 GEMM into fp32 d [64, 32], tensorwise.
GemmDesc valid_fp8() {
  GemmDesc g = cuda::contiguous_gemm(1, 64, 32, 48, false, true, DType::kF8E4M3, DType::kF32, g_a, g_b, g_c, 1.f, 0.f);
  g.fp8.b_type = DType::kF8E4M3;
  g.fp8.a_scale = &g_scales[0];
  g.fp8.b_scale = &g_scales[4];
  return g;
}

void expect_rejected(const std::function<void(GemmDesc&)>& edit, const std::string& needle) {
  GemmDesc g = valid_fp8();
  edit(g);
  testing::expect_error([&] { cuda::check_gemm_desc(g); }, needle);
}

TEST(CublasLtGemmCheck, ValidFp8DescriptionsPass) {
  EXPECT_NO_THROW(cuda::check_gemm_desc(valid_fp8()));
  GemmDesc g = valid_fp8();
  g.c_type = DType::kBF16;
  g.fp8.b_type = DType::kF8E5M2;  // hybrid: e4m3 x e5m2 (and e5m2 x e4m3 below)
  g.fp8.fast_accum = true;
  EXPECT_NO_THROW(cuda::check_gemm_desc(g));
  g.ab_type = DType::kF8E5M2;
  g.fp8.b_type = DType::kF8E4M3;
  g.beta = 1.f;
  EXPECT_NO_THROW(cuda::check_gemm_desc(g));
  g.epilogue = GemmEpilogue::kBias;  // the linear layers' bias, tensorwise
  g.bias = g_c;
  EXPECT_NO_THROW(cuda::check_gemm_desc(g));
  g = valid_fp8();
  g.fp8.a_mode = GemmScaleMode::kVec128;
  g.fp8.b_mode = GemmScaleMode::kBlk128x128;
  EXPECT_NO_THROW(cuda::check_gemm_desc(g));
  g.fp8.a_mode = GemmScaleMode::kBlk128x128;
  g.fp8.b_mode = GemmScaleMode::kVec128;
  EXPECT_NO_THROW(cuda::check_gemm_desc(g));
}

TEST(CublasLtGemmCheck, EachFp8RequirementIsNamed) {
  // the root cause seen on an H200: a scale_inv at a 4-byte offset into a packed state buffer
  expect_rejected([](GemmDesc& g) { g.fp8.b_scale = &g_scales[1]; }, "FP8 scale pointers must be 16-byte aligned");
  expect_rejected([](GemmDesc& g) { g.fp8.a_scale = &g_scales[6]; }, "FP8 scale pointers must be 16-byte aligned");
  expect_rejected([](GemmDesc& g) { g.fp8.a_scale = nullptr; }, "FP8 operands need their scales");
  expect_rejected([](GemmDesc& g) { g.trans_a = true; }, "cuBLASLt's TN format");
  expect_rejected([](GemmDesc& g) { g.trans_b = false; }, "cuBLASLt's TN format");
  expect_rejected([](GemmDesc& g) { g.batch = 2; }, "FP8 GEMMs are unbatched");
  expect_rejected(
      [](GemmDesc& g) {
        g.epilogue = GemmEpilogue::kBias;
        g.bias = g_c;
        g.fp8.a_mode = GemmScaleMode::kVec128;
        g.fp8.b_mode = GemmScaleMode::kBlk128x128;
      },
      "FP8 GEMMs take the bias epilogue (tensorwise scaling) and no other epilogue");
  expect_rejected(
      [](GemmDesc& g) {
        g.epilogue = GemmEpilogue::kGeluAux;
        g.aux = g_c;
        g.ld_aux = 32;
      },
      "FP8 GEMMs take the bias epilogue (tensorwise scaling) and no other epilogue");
  expect_rejected([](GemmDesc& g) { g.c_type = DType::kF8E4M3; }, "an FP8 GEMM writes fp32, bf16 or fp16");
  expect_rejected(
      [](GemmDesc& g) {
        g.ab_type = DType::kF8E5M2;
        g.fp8.b_type = DType::kF8E5M2;
      },
      "cuBLASLt has no e5m2 x e5m2");
  expect_rejected([](GemmDesc& g) { g.m = 24; }, "m=24, n=32, k=48 multiples of 16");
  expect_rejected(
      [](GemmDesc& g) {
        g.k = 40;
        g.lda = g.ldb = 40;
      },
      "k=40 multiples of 16");
  expect_rejected([](GemmDesc& g) { g.lda = 56; }, "leading dimensions of 16-byte multiples (lda=56");
  expect_rejected(
      [](GemmDesc& g) {
        g.c_type = DType::kBF16;
        g.ldc = 36;
      },
      "leading dimensions of 16-byte multiples");
  expect_rejected([](GemmDesc& g) { g.a = g_a + 8; }, "FP8 GEMMs need 16-byte aligned matrices");
  expect_rejected([](GemmDesc& g) { g.b = g_b + 4; }, "FP8 GEMMs need 16-byte aligned matrices");
  expect_rejected([](GemmDesc& g) { g.c = g_c + 2; }, "FP8 GEMMs need 16-byte aligned matrices");
  expect_rejected([](GemmDesc& g) { g.fp8.a_mode = GemmScaleMode::kVec128; }, "both scalar or both block");
  expect_rejected(
      [](GemmDesc& g) {
        g.fp8.a_mode = GemmScaleMode::kBlk128x128;
        g.fp8.b_mode = GemmScaleMode::kBlk128x128;
      },
      "no 2D x 2D kernel");
  expect_rejected(
      [](GemmDesc& g) {
        g.fp8.a_mode = g.fp8.b_mode = GemmScaleMode::kVec128;
        g.fp8.fast_accum = true;
      },
      "fast accumulation applies to scalar FP8 scales only");
}

// fp8_matmul's description of its cuBLASLt problem, checked on the CPU too: a scale view at a
// 4-byte offset (one element of a packed state buffer) is refused before any work.
TEST(CublasLtGemmCheck, Fp8MatmulChecksItsDescriptionOnTheCpu) {
  const Stream& st = testing::cpu_stream();
  testing::OwnedTensor a(DType::kF8E4M3, Device::cpu(), {32, 16}), b(DType::kF8E4M3, Device::cpu(), {16, 16});
  testing::OwnedTensor d(DType::kF32, Device::cpu(), {32, 16}), state(DType::kF32, Device::cpu(), {8});
  fill(state.t, 1.f, st);
  const Tensor s0 = state.t.flat_range(0, 1), s1 = state.t.flat_range(1, 1), s4 = state.t.flat_range(4, 1);
  const GemmDesc g = fp8_gemm_desc(d.t, {a.t, s0}, {b.t, s4}, true, false);
  EXPECT_EQ(g.m, 32);
  EXPECT_EQ(g.n, 16);
  EXPECT_EQ(g.k, 16);
  EXPECT_TRUE(!g.trans_a && g.trans_b);
  EXPECT_EQ(g.beta, 1.f);
  EXPECT_EQ(g.fp8.b_scale, s4.data_as<float>());
  std::memset(a.t.data(), 0, static_cast<size_t>(a.t.nbytes()));
  std::memset(b.t.data(), 0, static_cast<size_t>(b.t.nbytes()));
  EXPECT_NO_THROW(fp8_matmul(d.t, {a.t, s0}, {b.t, s4}, false, false, st));
  testing::expect_error([&] { fp8_matmul(d.t, {a.t, s0}, {b.t, s1}, false, false, st); },
                        "FP8 scale pointers must be 16-byte aligned");
}

}  // namespace
}  // namespace mt
