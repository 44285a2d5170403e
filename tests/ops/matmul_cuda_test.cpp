// CUDA tests of ops/matmul.h against the CPU backend on the same (dtype-rounded) random inputs:
// fp32 (rel. err < 1e-5, which also proves TF32 is off: TF32 would give ~1e-3 at k = 1024),
// bf16/fp16 (< 2e-2), bf16 A/B with fp32 C (beta = 1 accumulate), misaligned pointers, k = 0,
// linear with bias / GELU epilogue (fused and fallback paths), linear_backward.
#include <gtest/gtest.h>

#include "ops/matmul.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::cpu_stream;
using testing::cuda_stream;
using testing::rounded;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::poison;
using testing::randn;
using testing::rel_err;
using testing::to_host;

std::vector<int64_t> with_batch(int64_t batch, std::vector<int64_t> s) {
  if (batch > 0) s.insert(s.begin(), batch);
  return s;
}

/// A tensor on the GPU whose data pointer is offset by `offset` elements from an allocation
/// (offset 1 gives a 2- or 4-byte aligned pointer).
struct OffsetTensor {
  OwnedTensor storage;
  Tensor t;
  OffsetTensor(const std::vector<float>& host, DType dtype, const std::vector<int64_t>& shape, int64_t offset) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    storage = OwnedTensor(dtype, Device::cuda(0), {n + offset});
    t = storage.t.flat_range(offset, n).view(shape);
    testing::upload(t, host, cuda_stream());
  }
};

struct MatmulCase {
  int64_t batch, m, n, k;
  bool ta, tb;
  float alpha, beta;
};

/// Runs one product on the GPU (ab / c dtypes) and on the CPU (fp32 from the same rounded
/// values) and returns the relative error. `offset` > 0 misaligns all three GPU pointers.
double matmul_err(DType ab, DType ct, MatmulCase c, int64_t offset = 0) {
  const int64_t nb = c.batch > 0 ? c.batch : 1;
  auto ha = rounded(randn(nb * c.m * c.k), ab), hb = rounded(randn(nb * c.k * c.n), ab);
  auto hc = rounded(randn(nb * c.m * c.n), ct);
  auto sa = with_batch(c.batch, c.ta ? std::vector<int64_t>{c.k, c.m} : std::vector<int64_t>{c.m, c.k});
  auto sb = with_batch(c.batch, c.tb ? std::vector<int64_t>{c.n, c.k} : std::vector<int64_t>{c.k, c.n});
  auto sc = with_batch(c.batch, {c.m, c.n});
  auto ca = make_tensor(ha, DType::kF32, Device::cpu(), sa, cpu_stream());
  auto cb = make_tensor(hb, DType::kF32, Device::cpu(), sb, cpu_stream());
  auto cc = make_tensor(hc, DType::kF32, Device::cpu(), sc, cpu_stream());
  matmul(cc, ca, cb, c.ta, c.tb, c.alpha, c.beta, cpu_stream());
  OffsetTensor ga(ha, ab, sa, offset), gb(hb, ab, sb, offset), gc(hc, ct, sc, offset);
  if (c.beta == 0.f) poison(gc.t, cuda_stream());
  matmul(gc.t, ga.t, gb.t, c.ta, c.tb, c.alpha, c.beta, cuda_stream());
  return rel_err(to_host(gc.t, cuda_stream()), to_host(cc, cpu_stream()));
}

std::string describe(DType ab, DType ct, MatmulCase c) {
  return fmt::format("ab={} c={} batch={} m={} n={} k={} ta={} tb={} alpha={} beta={}", dtype_name(ab),
                     dtype_name(ct), c.batch, c.m, c.n, c.k, c.ta, c.tb, c.alpha, c.beta);
}

void all_transposes(DType ab, DType ct, MatmulCase base, double tol, int64_t offset = 0) {
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      MatmulCase c = base;
      c.ta = ta;
      c.tb = tb;
      for (int rep = 0; rep < 2; ++rep) {  // the second run hits the plan cache
        EXPECT_LT(matmul_err(ab, ct, c, offset), tol) << describe(ab, ct, c) << " offset=" << offset;
      }
    }
  }
}

TEST(MatmulCuda, Fp32AllTransposes) {
  MT_REQUIRE_CUDA();
  all_transposes(DType::kF32, DType::kF32, {0, 37, 29, 45, false, false, 0.7f, 0.f}, 1e-5);
  all_transposes(DType::kF32, DType::kF32, {3, 64, 96, 128, false, false, 1.f, 0.f}, 1e-5);
  all_transposes(DType::kF32, DType::kF32, {2, 33, 17, 1024, false, false, 1.f, 0.5f}, 1e-5);  // TF32 would fail
  all_transposes(DType::kF32, DType::kF32, {2, 40, 24, 56, false, false, -1.f, 1.f}, 1e-5);    // accumulate
}

TEST(MatmulCuda, Bf16Fp16AllTransposes) {
  MT_REQUIRE_CUDA();
  for (DType t : {DType::kBF16, DType::kF16}) {
    all_transposes(t, t, {0, 37, 29, 45, false, false, 0.7f, 0.f}, 2e-2);
    all_transposes(t, t, {3, 64, 96, 128, false, false, 1.f, 0.f}, 2e-2);
    all_transposes(t, t, {2, 31, 33, 77, false, false, 1.f, 1.f}, 2e-2);
  }
}

TEST(MatmulCuda, Bf16InputsFp32Accumulate) {
  MT_REQUIRE_CUDA();
  // Products of bf16 values are exact in fp32 and both sides accumulate in fp32, so the only
  // difference is the summation order: 1e-4 leaves a wide margin over the ~1e-6 expected.
  all_transposes(DType::kBF16, DType::kF32, {0, 48, 40, 300, false, false, 1.f, 1.f}, 1e-4);
  all_transposes(DType::kBF16, DType::kF32, {2, 37, 29, 45, false, false, 1.f, 1.f}, 1e-4);
  all_transposes(DType::kF16, DType::kF32, {0, 16, 24, 64, false, false, 1.f, 0.f}, 1e-4);
}

TEST(MatmulCuda, MisalignedPointers) {
  MT_REQUIRE_CUDA();
  all_transposes(DType::kF32, DType::kF32, {2, 19, 23, 31, false, false, 1.f, 0.f}, 1e-5, 1);
  all_transposes(DType::kBF16, DType::kBF16, {2, 19, 23, 31, false, false, 1.f, 0.f}, 2e-2, 1);
  all_transposes(DType::kBF16, DType::kBF16, {0, 64, 64, 64, false, false, 1.f, 0.f}, 2e-2, 3);
}

TEST(MatmulCuda, EmptyInnerDim) {
  MT_REQUIRE_CUDA();
  EXPECT_LT(matmul_err(DType::kF32, DType::kF32, {0, 5, 7, 0, false, false, 1.f, 0.5f}), 1e-6);
  EXPECT_LT(matmul_err(DType::kBF16, DType::kF32, {2, 5, 7, 0, false, false, 1.f, 0.f}), 1e-6);
}

// ---------------------------------------------------------------------------------------------
// Linear
// ---------------------------------------------------------------------------------------------

struct LinearCase {
  int64_t b0, b1, n, k;
  bool bias, gelu;
};

void check_linear_forward(DType t, LinearCase c, double tol) {
  const int64_t m = c.b0 * c.b1;
  auto hx = rounded(randn(m * c.k), t), hw = rounded(randn(c.n * c.k, 0.2f), t), hb = rounded(randn(c.n), t);
  const std::vector<int64_t> sx{c.b0, c.b1, c.k}, sy{c.b0, c.b1, c.n}, sw{c.n, c.k};
  auto cx = make_tensor(hx, DType::kF32, Device::cpu(), sx, cpu_stream());
  auto cw = make_tensor(hw, DType::kF32, Device::cpu(), sw, cpu_stream());
  auto cb = make_tensor(hb, DType::kF32, Device::cpu(), {c.n}, cpu_stream());
  OwnedTensor cy(DType::kF32, Device::cpu(), sy), cpre(DType::kF32, Device::cpu(), sy);
  linear_forward(cy, cx, cw, c.bias ? cb.t : Tensor(), c.gelu ? cpre.t : Tensor(), cpu_stream());

  auto gx = make_tensor(hx, t, Device::cuda(0), sx, cuda_stream());
  auto gw = make_tensor(hw, t, Device::cuda(0), sw, cuda_stream());
  auto gb = make_tensor(hb, t, Device::cuda(0), {c.n}, cuda_stream());
  OwnedTensor gy(t, Device::cuda(0), sy), gpre(t, Device::cuda(0), sy);
  poison(gy, cuda_stream());
  poison(gpre, cuda_stream());
  linear_forward(gy, gx, gw, c.bias ? gb.t : Tensor(), c.gelu ? gpre.t : Tensor(), cuda_stream());
  const std::string what = fmt::format("{} m={}x{} n={} k={} bias={} gelu={}", dtype_name(t), c.b0, c.b1, c.n, c.k,
                                       c.bias, c.gelu);
  EXPECT_LT(rel_err(to_host(gy, cuda_stream()), to_host(cy, cpu_stream())), tol) << what;
  if (c.gelu) {
    EXPECT_LT(rel_err(to_host(gpre, cuda_stream()), to_host(cpre, cpu_stream())), tol) << what;
  }
}

TEST(LinearCuda, ForwardBias) {
  MT_REQUIRE_CUDA();
  for (bool bias : {false, true}) {
    check_linear_forward(DType::kF32, {2, 37, 96, 80, bias, false}, 1e-5);
    check_linear_forward(DType::kF32, {1, 13, 45, 31, bias, false}, 1e-5);
    check_linear_forward(DType::kBF16, {2, 37, 96, 80, bias, false}, 2e-2);
    check_linear_forward(DType::kBF16, {1, 13, 45, 31, bias, false}, 2e-2);
    check_linear_forward(DType::kF16, {3, 11, 64, 48, bias, false}, 2e-2);
  }
}

TEST(LinearCuda, ForwardGelu) {
  MT_REQUIRE_CUDA();
  for (bool bias : {false, true}) {
    check_linear_forward(DType::kF32, {2, 37, 96, 80, bias, true}, 1e-5);   // fp32: GEMM + own GELU kernel
    check_linear_forward(DType::kF32, {1, 13, 45, 31, bias, true}, 1e-5);
    check_linear_forward(DType::kBF16, {2, 37, 96, 80, bias, true}, 2e-2);  // n % 8 == 0: GELU_AUX epilogue
    check_linear_forward(DType::kBF16, {1, 13, 45, 31, bias, true}, 2e-2);  // n % 8 != 0: fallback
    check_linear_forward(DType::kF16, {3, 11, 64, 48, bias, true}, 2e-2);
  }
}

void check_linear_backward(DType t, int64_t b0, int64_t b1, int64_t n, int64_t k, bool with_dx, bool with_db,
                           double tol_act, double tol_main) {
  const int64_t m = b0 * b1;
  auto hx = rounded(randn(m * k), t), hw = rounded(randn(n * k), t), hdy = rounded(randn(m * n), t);
  auto hdw0 = randn(n * k), hdb0 = randn(n);
  const std::vector<int64_t> sx{b0, b1, k}, sy{b0, b1, n}, sw{n, k};
  auto cx = make_tensor(hx, DType::kF32, Device::cpu(), sx, cpu_stream());
  auto cw = make_tensor(hw, DType::kF32, Device::cpu(), sw, cpu_stream());
  auto cdy = make_tensor(hdy, DType::kF32, Device::cpu(), sy, cpu_stream());
  OwnedTensor cdx(DType::kF32, Device::cpu(), sx);
  auto cdw = make_tensor(hdw0, DType::kF32, Device::cpu(), sw, cpu_stream());
  auto cdb = make_tensor(hdb0, DType::kF32, Device::cpu(), {n}, cpu_stream());
  linear_backward(cdx, cdw, cdb, cdy, cx, cw, cpu_stream());

  auto gx = make_tensor(hx, t, Device::cuda(0), sx, cuda_stream());
  auto gw = make_tensor(hw, t, Device::cuda(0), sw, cuda_stream());
  auto gdy = make_tensor(hdy, t, Device::cuda(0), sy, cuda_stream());
  OwnedTensor gdx(t, Device::cuda(0), sx);
  auto gdw = make_tensor(hdw0, DType::kF32, Device::cuda(0), sw, cuda_stream());
  auto gdb = make_tensor(hdb0, DType::kF32, Device::cuda(0), {n}, cuda_stream());
  poison(gdx, cuda_stream());
  linear_backward(with_dx ? gdx.t : Tensor(), gdw, with_db ? gdb.t : Tensor(), gdy, gx, gw, cuda_stream());
  const std::string what = fmt::format("{} m={}x{} n={} k={} dx={} dbias={}", dtype_name(t), b0, b1, n, k, with_dx,
                                       with_db);
  if (with_dx) {
    EXPECT_LT(rel_err(to_host(gdx, cuda_stream()), to_host(cdx, cpu_stream())), tol_act) << what;
  }
  EXPECT_LT(rel_err(to_host(gdw, cuda_stream()), to_host(cdw, cpu_stream())), tol_main) << what;
  if (with_db) {
    EXPECT_LT(rel_err(to_host(gdb, cuda_stream()), to_host(cdb, cpu_stream())), tol_main) << what;
  } else {
    EXPECT_EQ(to_host(gdb, cuda_stream()), hdb0) << what;
  }
}

TEST(LinearCuda, Backward) {
  MT_REQUIRE_CUDA();
  check_linear_backward(DType::kF32, 2, 37, 96, 80, true, true, 1e-5, 1e-5);
  check_linear_backward(DType::kF32, 3, 101, 45, 31, true, true, 1e-5, 1e-5);
  check_linear_backward(DType::kF32, 1, 9, 33, 17, false, false, 1e-5, 1e-5);
  // bf16/fp16 inputs: dx is rounded to 16 bits (2e-2); dw and dbias accumulate exact products in
  // fp32 (1e-4, see Bf16InputsFp32Accumulate).
  check_linear_backward(DType::kBF16, 2, 37, 96, 80, true, true, 2e-2, 1e-4);
  check_linear_backward(DType::kBF16, 3, 101, 45, 31, true, true, 2e-2, 1e-4);
  check_linear_backward(DType::kBF16, 1, 9, 33, 17, false, false, 2e-2, 1e-4);
  check_linear_backward(DType::kF16, 4, 64, 64, 48, true, true, 2e-2, 1e-4);
}

/// linear_forward_add on the GPU (the residual in the GEMM's C, bias epilogue) against the CPU.
void check_linear_forward_add(DType t, int64_t b0, int64_t b1, int64_t n, int64_t k, bool bias, double tol) {
  const int64_t m = b0 * b1;
  auto hx = rounded(randn(m * k), t), hw = rounded(randn(n * k, 0.2f), t), hb = rounded(randn(n), t),
       hr = rounded(randn(m * n), t);
  const std::vector<int64_t> sx{b0, b1, k}, sy{b0, b1, n}, sw{n, k};
  const Device c = Device::cpu(), g = Device::cuda(0);
  auto cx = make_tensor(hx, DType::kF32, c, sx, cpu_stream()), cw = make_tensor(hw, DType::kF32, c, sw, cpu_stream()),
       cb = make_tensor(hb, DType::kF32, c, {n}, cpu_stream()), cr = make_tensor(hr, DType::kF32, c, sy, cpu_stream());
  OwnedTensor cy(DType::kF32, c, sy);
  linear_forward_add(cy, cx, cw, bias ? cb.t : Tensor(), cr, cpu_stream());
  auto gx = make_tensor(hx, t, g, sx, cuda_stream()), gw = make_tensor(hw, t, g, sw, cuda_stream()),
       gb = make_tensor(hb, t, g, {n}, cuda_stream()), gr = make_tensor(hr, t, g, sy, cuda_stream());
  OwnedTensor gy(t, g, sy);
  poison(gy, cuda_stream());
  linear_forward_add(gy, gx, gw, bias ? gb.t : Tensor(), gr, cuda_stream());
  EXPECT_LT(rel_err(to_host(gy, cuda_stream()), to_host(cy, cpu_stream())), tol)
      << fmt::format("{} m={}x{} n={} k={} bias={}", dtype_name(t), b0, b1, n, k, bias);
  EXPECT_EQ(to_host(gr, cuda_stream()), to_host(cr, cpu_stream()));  // the residual is only read
}

TEST(LinearCuda, ForwardAdd) {
  MT_REQUIRE_CUDA();
  for (bool bias : {true, false}) {
    check_linear_forward_add(DType::kF32, 2, 37, 96, 80, bias, 1e-5);
    check_linear_forward_add(DType::kBF16, 2, 37, 96, 80, bias, 1e-2);
    check_linear_forward_add(DType::kBF16, 4, 512, 768, 3072, bias, 1e-2);  // GPT-2's fc2
    check_linear_forward_add(DType::kBF16, 1, 13, 45, 31, bias, 1e-2);      // ragged
    check_linear_forward_add(DType::kF16, 3, 11, 64, 48, bias, 1e-2);
  }
}

/// gelu_linear_backward on the GPU against the CPU backend (fp32 from the same rounded values).
void check_gelu_linear_backward(DType t, int64_t b0, int64_t b1, int64_t n, int64_t k, bool with_dpb,
                                double tol_act, double tol_bias) {
  const int64_t m = b0 * b1;
  auto hpre = rounded(randn(m * k), t), hw = rounded(randn(n * k, 0.3f), t), hdy = rounded(randn(m * n), t);
  auto hx = rounded(randn(m * k), t);  // any x: the wgrad only reads it
  auto hdw0 = randn(n * k), hdb0 = randn(n), hdpb0 = randn(k);
  const std::vector<int64_t> sx{b0, b1, k}, sy{b0, b1, n}, sw{n, k};
  auto on = [&](Device d, DType dt, const std::vector<float>& h, const std::vector<int64_t>& shape) {
    return make_tensor(h, dt, d, shape, d.is_cpu() ? cpu_stream() : cuda_stream());
  };
  const Device c = Device::cpu(), g = Device::cuda(0);
  auto cx = on(c, DType::kF32, hx, sx), cpre = on(c, DType::kF32, hpre, sx), cw = on(c, DType::kF32, hw, sw),
       cdy = on(c, DType::kF32, hdy, sy), cdw = on(c, DType::kF32, hdw0, sw), cdb = on(c, DType::kF32, hdb0, {n}),
       cdpb = on(c, DType::kF32, hdpb0, {k});
  OwnedTensor cdpre(DType::kF32, c, sx);
  gelu_linear_backward(cdpre, with_dpb ? cdpb.t : Tensor(), cdw, cdb, cdy, cx, cpre, cw, cpu_stream());
  auto gx = on(g, t, hx, sx), gpre = on(g, t, hpre, sx), gw = on(g, t, hw, sw), gdy = on(g, t, hdy, sy),
       gdw = on(g, DType::kF32, hdw0, sw), gdb = on(g, DType::kF32, hdb0, {n}), gdpb = on(g, DType::kF32, hdpb0, {k});
  OwnedTensor gdpre(t, g, sx);
  poison(gdpre, cuda_stream());
  gelu_linear_backward(gdpre, with_dpb ? gdpb.t : Tensor(), gdw, gdb, gdy, gx, gpre, gw, cuda_stream());
  const std::string what = fmt::format("{} m={}x{} n={} k={} dpre_bias={}", dtype_name(t), b0, b1, n, k, with_dpb);
  EXPECT_LT(rel_err(to_host(gdpre, cuda_stream()), to_host(cdpre, cpu_stream())), tol_act) << what;
  EXPECT_LT(rel_err(to_host(gdpb, cuda_stream()), to_host(cdpb, cpu_stream())), tol_bias) << what;
  EXPECT_LT(rel_err(to_host(gdw, cuda_stream()), to_host(cdw, cpu_stream())), 1e-4) << what;
  EXPECT_LT(rel_err(to_host(gdb, cuda_stream()), to_host(cdb, cpu_stream())), 1e-4) << what;
}

TEST(LinearCuda, GeluLinearBackward) {
  MT_REQUIRE_CUDA();
  for (bool dpb : {true, false}) {
    check_gelu_linear_backward(DType::kF32, 2, 37, 96, 80, dpb, 1e-5, 1e-5);       // GEMM + kernels
    check_gelu_linear_backward(DType::kBF16, 2, 37, 96, 80, dpb, 2e-2, 2e-2);      // DGELU epilogue
    check_gelu_linear_backward(DType::kBF16, 4, 256, 768, 3072, dpb, 2e-2, 2e-2);  // GPT-2's fc2
    check_gelu_linear_backward(DType::kBF16, 3, 101, 45, 31, dpb, 2e-2, 2e-2);     // k % 8 != 0: fallback
    check_gelu_linear_backward(DType::kF16, 1, 129, 64, 48, dpb, 2e-2, 2e-2);
  }
}

// The weight gradient's GEMM also yields the bias gradient (BGRADB) at a transformer's sizes; it
// must equal the column sums, accumulated onto the previous value.
TEST(LinearCuda, BackwardBiasFromTheWgradGemm) {
  MT_REQUIRE_CUDA();
  check_linear_backward(DType::kBF16, 4, 256, 2304, 768, false, true, 2e-2, 1e-4);
  check_linear_backward(DType::kBF16, 2, 512, 3072, 768, true, true, 2e-2, 1e-4);
  check_linear_backward(DType::kF16, 8, 128, 768, 768, false, true, 2e-2, 1e-4);
}

TEST(LinearCuda, Errors) {
  MT_REQUIRE_CUDA();
  OwnedTensor x(DType::kBF16, Device::cuda(0), {4, 3}), w(DType::kBF16, Device::cuda(0), {5, 3}),
      y(DType::kBF16, Device::cuda(0), {4, 5});
  OwnedTensor dw_bf16(DType::kBF16, Device::cuda(0), {5, 3}), x_cpu(DType::kBF16, Device::cpu(), {4, 3});
  EXPECT_THROW(linear_forward(y, x_cpu, w, Tensor(), Tensor(), cuda_stream()), Error);  // mixed devices
  EXPECT_THROW(linear_forward(y, x, w, Tensor(), Tensor(), cpu_stream()), Error);      // CPU stream, GPU tensors
  EXPECT_THROW(linear_backward(Tensor(), dw_bf16, Tensor(), y, x, w, cuda_stream()), Error);  // dw must be fp32
}

}  // namespace
}  // namespace mt
