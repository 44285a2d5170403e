// CUDA element-wise ops against the CPU reference on the same inputs. cast/add/scale/fill are
// bit-exact (both round the same fp32 value to nearest even). Dropout masks must be
// bit-identical between CPU and CUDA (layout invariance across devices), values within fp32
// rel. 1e-5 / bf16, fp16 rel. 2e-2.
#include <gtest/gtest.h>

#include <cmath>

#include "core/rng.h"
#include "ops/elementwise.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::rounded;
using testing::OwnedTensor;
const Device kCpu = Device::cpu();
const DType kFloatTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

double tol(DType t) { return t == DType::kF32 ? 1e-5 : 2e-2; }

DropoutKey random_key() {
  auto& rng = testing::test_rng();
  DropoutKey k;
  k.seed = rng();
  k.iteration = rng() % 100000;
  k.microbatch = static_cast<uint32_t>(rng() % 64);
  k.stream_id = static_cast<uint32_t>(rng() % 1000);
  return k;
}

/// Values bounded away from zero (also after bf16/fp16 rounding and scaling by 1/(1-p)), so that
/// an exact 0 in the output identifies a dropped element.
std::vector<float> randn_nonzero(int64_t n) {
  auto v = testing::randn(n);
  for (auto& x : v) {
    if (std::fabs(x) < 1e-2f) x = x < 0 ? -0.5f : 0.5f;
  }
  return v;
}

std::vector<bool> zero_mask(const std::vector<float>& v) {
  std::vector<bool> m(v.size());
  for (size_t i = 0; i < v.size(); ++i) m[i] = v[i] == 0.f;
  return m;
}

// ---- cast / add / scale / fill ----------------------------------------------------------------

TEST(ElementwiseCuda, CastAllPairsBitExact) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  const int64_t n = 100003;
  auto v = testing::randn(n, 100.f);
  const float specials[] = {1.0f + 1.0f / 256, 70000.f, -70000.f, 3e-6f, -1e-7f, 1e-39f, 0.f, 65504.f, 3.3895e38f};
  for (size_t i = 0; i < std::size(specials); ++i) v[i] = specials[i];
  for (DType from : kFloatTypes) {
    auto src_c = testing::make_tensor(v, from, kCpu, {n}, cs);
    auto src_g = testing::make_tensor(v, from, gpu, {n}, gs);
    for (DType to : kFloatTypes) {
      OwnedTensor dc(to, kCpu, {n}), dg(to, gpu, {n});
      testing::poison(dg, gs);
      cast(dc, src_c, cs);
      cast(dg, src_g, gs);
      const auto a = testing::to_host(dg, gs), b = testing::to_host(dc, cs);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_TRUE(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))
            << dtype_name(from) << "->" << dtype_name(to) << " i=" << i << " gpu=" << a[i] << " cpu=" << b[i];
      }
    }
  }
}

TEST(ElementwiseCuda, AddScaleFillBitExact) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  // 3M elements: more than one pass of the capped grid-stride loops.
  for (int64_t n : {int64_t{1}, int64_t{1001}, (int64_t{3} << 20) + 3}) {
    for (DType t : kFloatTypes) {
      const auto av = testing::randn(n), bv = testing::randn(n);
      auto ac = testing::make_tensor(av, t, kCpu, {n}, cs), bc = testing::make_tensor(bv, t, kCpu, {n}, cs);
      auto ag = testing::make_tensor(av, t, gpu, {n}, gs), bg = testing::make_tensor(bv, t, gpu, {n}, gs);
      OwnedTensor yc(t, kCpu, {n}), yg(t, gpu, {n});
      testing::poison(yg, gs);
      add(yc, ac, bc, cs);
      add(yg, ag, bg, gs);
      const auto y_ref = testing::to_host(yc, cs);
      EXPECT_EQ(testing::to_host(yg, gs), y_ref) << "add " << dtype_name(t) << " n=" << n;
      if (n > 1) {  // unaligned views: scalar path
        OwnedTensor yg2(t, gpu, {n});
        add(yg2.t.flat_range(1, n - 1), ag.t.flat_range(1, n - 1), bg.t.flat_range(1, n - 1), gs);
        const auto y2 = testing::to_host(yg2.t.flat_range(1, n - 1), gs);
        EXPECT_TRUE(std::equal(y2.begin(), y2.end(), y_ref.begin() + 1)) << "unaligned add " << dtype_name(t);
      }
      add(ag, ag, bg, gs);  // alias
      EXPECT_EQ(testing::to_host(ag, gs), y_ref) << "aliased add " << dtype_name(t);

      scale_inplace(yc, -0.37f, cs);
      scale_inplace(yg, -0.37f, gs);
      EXPECT_EQ(testing::to_host(yg, gs), testing::to_host(yc, cs)) << "scale " << dtype_name(t) << " n=" << n;
      if (n > 1) {  // unaligned: element 0 untouched
        scale_inplace(yg.t.flat_range(1, n - 1), 2.f, gs);
        scale_inplace(yc.t.flat_range(1, n - 1), 2.f, cs);
        EXPECT_EQ(testing::to_host(yg, gs), testing::to_host(yc, cs)) << "unaligned scale " << dtype_name(t);
      }

      fill(yc, 1.7f, cs);
      fill(yg, 1.7f, gs);
      EXPECT_EQ(testing::to_host(yg, gs), testing::to_host(yc, cs)) << "fill " << dtype_name(t);
    }
    OwnedTensor ic(DType::kI32, kCpu, {n}), ig(DType::kI32, gpu, {n});
    fill(ic, -123456.f, cs);
    fill(ig, -123456.f, gs);
    EXPECT_EQ(testing::to_host(ig, gs), testing::to_host(ic, cs)) << "fill int32";
  }
}

// ---- dropout ----------------------------------------------------------------------------------

TEST(DropoutCuda, MaskBitIdenticalToCpu) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  for (int64_t n : {int64_t{1}, int64_t{1001}, (int64_t{3} << 20) + 5}) {
    for (DType t : kFloatTypes) {
      for (float p : {0.1f, 0.5f}) {
        for (int64_t offset : {int64_t{0}, int64_t{5}, (int64_t{1} << 33) + 3}) {
          const DropoutKey key = random_key();
          const auto x = randn_nonzero(n);
          auto xc = testing::make_tensor(rounded(x, t), DType::kF32, kCpu, {n}, cs);
          auto xg = testing::make_tensor(x, t, gpu, {n}, gs);
          OwnedTensor yc(DType::kF32, kCpu, {n}), yg(t, gpu, {n});
          testing::poison(yg, gs);
          dropout_forward(yc, xc, p, key, offset, cs);
          dropout_forward(yg, xg, p, key, offset, gs);
          const auto y = testing::to_host(yg, gs), y_ref = testing::to_host(yc, cs);
          ASSERT_TRUE(testing::all_finite(y));
          EXPECT_TRUE(zero_mask(y) == zero_mask(y_ref))
              << dtype_name(t) << " n=" << n << " p=" << p << " offset=" << offset;
          EXPECT_LT(testing::rel_err(y, y_ref), tol(t)) << dtype_name(t) << " n=" << n;
          if (n > 1000 && offset == 0) {  // keep fraction ~ 1 - p
            int64_t kept = 0;
            for (float v : y) kept += v != 0.f;
            EXPECT_NEAR(double(kept) / n, 1.0 - p, 6 * std::sqrt(p * (1.0 - p) / n));
          }
          // In place on the GPU.
          dropout_forward(xg, xg, p, key, offset, gs);
          EXPECT_EQ(testing::to_host(xg, gs), y);
        }
      }
    }
  }
}

TEST(DropoutCuda, PZeroKeysAndLayoutInvariance) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu);
  const int64_t rows = 301, h = 77, n = rows * h;
  const float p = 0.3f;
  const int64_t base = 999999;
  for (DType t : kFloatTypes) {
    const auto xv = randn_nonzero(n);
    auto x = testing::make_tensor(xv, t, gpu, {rows, h}, gs);
    OwnedTensor whole(t, gpu, {rows, h}), parts(t, gpu, {rows, h});
    // p = 0: identity.
    dropout_forward(whole, x, 0.f, random_key(), base, gs);
    EXPECT_EQ(testing::to_host(whole, gs), testing::to_host(x, gs)) << dtype_name(t);
    // Different iteration / microbatch / stream id: different masks.
    const DropoutKey key = random_key();
    dropout_forward(whole, x, p, key, base, gs);
    const auto m0 = zero_mask(testing::to_host(whole, gs));
    for (int v = 0; v < 3; ++v) {
      DropoutKey k2 = key;
      if (v == 0) k2.iteration += 1;
      if (v == 1) k2.microbatch += 1;
      if (v == 2) k2.stream_id += 1;
      dropout_forward(parts, x, p, k2, base, gs);
      const auto m = zero_mask(testing::to_host(parts, gs));
      int64_t diff = 0;
      for (int64_t i = 0; i < n; ++i) diff += m[i] != m0[i];
      EXPECT_GT(diff, 0.8 * 2 * p * (1 - p) * n) << "variant " << v;
    }
    // Two pieces with the right global offsets reproduce the whole (split inside a Philox group).
    const auto w = testing::to_host(whole, gs);
    for (int64_t split : {int64_t{1}, int64_t{4099}, n - 3}) {
      testing::poison(parts, gs);
      dropout_forward(parts.t.flat_range(0, split), x.t.flat_range(0, split), p, key, base, gs);
      dropout_forward(parts.t.flat_range(split, n - split), x.t.flat_range(split, n - split), p, key, base + split,
                      gs);
      EXPECT_EQ(testing::to_host(parts, gs), w) << dtype_name(t) << " split=" << split;
    }
  }
}

TEST(BiasDropoutAddCuda, ForwardBackwardMatchCpu) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  struct Case {
    int64_t rows, h;
  };
  // 10000 x 40: more rows than the dbias kernel's capped grid covers in one pass.
  for (Case c : {Case{1, 1}, Case{37, 100}, Case{64, 768}, Case{10000, 40}, Case{5, 1030}}) {
    const int64_t n = c.rows * c.h;
    for (DType t : kFloatTypes) {
      for (float p : {0.f, 0.2f}) {
        for (bool with_bias : {true, false}) {
          const DropoutKey key = random_key();
          const int64_t offset = 4 * c.rows + 1;
          const auto xv = randn_nonzero(n), rv = testing::randn(n), bv = testing::randn(c.h), gv = randn_nonzero(n);
          const auto db0 = testing::randn(c.h);
          // CPU reference on rounded inputs.
          auto xc = testing::make_tensor(rounded(xv, t), DType::kF32, kCpu, {c.rows, c.h}, cs);
          auto rc = testing::make_tensor(rounded(rv, t), DType::kF32, kCpu, {c.rows, c.h}, cs);
          auto bc = testing::make_tensor(rounded(bv, t), DType::kF32, kCpu, {c.h}, cs);
          auto gc = testing::make_tensor(rounded(gv, t), DType::kF32, kCpu, {c.rows, c.h}, cs);
          auto dbc = testing::make_tensor(db0, DType::kF32, kCpu, {c.h}, cs);
          OwnedTensor oc(DType::kF32, kCpu, {c.rows, c.h}), dxc(DType::kF32, kCpu, {c.rows, c.h});
          bias_dropout_add_forward(oc, xc, with_bias ? bc.t : Tensor{}, rc, p, key, offset, cs);
          bias_dropout_add_backward(dxc, with_bias ? dbc.t : Tensor{}, gc, p, key, offset, cs);
          const auto out_ref = testing::to_host(oc, cs), dx_ref = testing::to_host(dxc, cs);
          const auto db_ref = testing::to_host(dbc, cs);

          auto xg = testing::make_tensor(xv, t, gpu, {c.rows, c.h}, gs);
          auto rg = testing::make_tensor(rv, t, gpu, {c.rows, c.h}, gs);
          auto bg = testing::make_tensor(bv, t, gpu, {c.h}, gs);
          auto gg = testing::make_tensor(gv, t, gpu, {c.rows, c.h}, gs);
          auto dbg = testing::make_tensor(db0, DType::kF32, gpu, {c.h}, gs);
          OwnedTensor og(t, gpu, {c.rows, c.h}), dxg(t, gpu, {c.rows, c.h});
          testing::poison(og, gs);
          testing::poison(dxg, gs);
          bias_dropout_add_forward(og, xg, with_bias ? bg.t : Tensor{}, rg, p, key, offset, gs);
          bias_dropout_add_backward(dxg, with_bias ? dbg.t : Tensor{}, gg, p, key, offset, gs);
          const auto out = testing::to_host(og, gs), dx = testing::to_host(dxg, gs);
          const std::string what = fmt::format("{} rows={} h={} p={} bias={}", dtype_name(t), c.rows, c.h, p, with_bias);
          EXPECT_LT(testing::rel_err(out, out_ref), tol(t)) << what;
          EXPECT_LT(testing::rel_err(dx, dx_ref), tol(t)) << what;
          EXPECT_TRUE(zero_mask(dx) == zero_mask(dx_ref)) << what;  // same mask as the CPU
          if (with_bias) {
            // fp32 main grad. fp32: summation order only (1e-4 for the 10000-row reduction);
            // bf16/fp16: the GPU sums dx after rounding it to the activation dtype, the CPU before.
            const double dtol = t != DType::kF32 ? tol(t) : (c.rows > 1000 ? 1e-4 : 1e-5);
            EXPECT_LT(testing::rel_err(testing::to_host(dbg, gs), db_ref), dtol) << what;
            if (p == 0.f) {  // dbias only (no dx): the vectorised column sums where h allows
              auto dbg2 = testing::make_tensor(db0, DType::kF32, gpu, {c.h}, gs);
              bias_dropout_add_backward(Tensor{}, dbg2, gg, p, key, offset, gs);
              EXPECT_LT(testing::rel_err(testing::to_host(dbg2, gs), db_ref), dtol) << what << " dbias only";
            }
          }
          // Backward uses the forward's mask: with residual = 0 and no bias, out == 0 iff dx == 0.
          auto zg = testing::make_tensor(std::vector<float>(n, 0.f), t, gpu, {c.rows, c.h}, gs);
          bias_dropout_add_forward(og, xg, Tensor{}, zg, p, key, offset, gs);
          EXPECT_TRUE(zero_mask(testing::to_host(og, gs)) == zero_mask(dx)) << what;
          // out aliases residual; dx aliases dout (dx is deterministic, with or without the dbias kernel).
          bias_dropout_add_forward(rg, xg, with_bias ? bg.t : Tensor{}, rg, p, key, offset, gs);
          EXPECT_EQ(testing::to_host(rg, gs), out) << what;
          bias_dropout_add_backward(gg, Tensor{}, gg, p, key, offset, gs);
          EXPECT_EQ(testing::to_host(gg, gs), dx) << what;
        }
      }
    }
  }
}

/// dbias the same bits on three calls (with and without dropout, dx written or not), many row groups
/// (16384 rows: an order of float atomics would show), and within the fp32 tolerance of the CPU.
TEST(BiasDropoutAddCuda, DbiasBitwiseRepeatable) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  const int64_t rows = 16384, h = 1024, n = rows * h;
  const auto gv = randn_nonzero(n), db0 = testing::randn(h);
  auto gc = testing::make_tensor(rounded(gv, DType::kF32), DType::kF32, kCpu, {rows, h}, cs);
  auto gg = testing::make_tensor(gv, DType::kF32, gpu, {rows, h}, gs);
  for (float p : {0.f, 0.1f}) {
    const DropoutKey key = random_key();
    auto dbc = testing::make_tensor(db0, DType::kF32, kCpu, {h}, cs);
    OwnedTensor dxc(DType::kF32, kCpu, {rows, h}), dxg(DType::kF32, gpu, {rows, h});
    bias_dropout_add_backward(dxc, dbc, gc, p, key, 0, cs);
    // Calls 0, 1 write dx; with p = 0 calls 2, 3 compute dbias only (the column-sum kernel, another
    // summation order): each pair bitwise equal, each within the fp32 tolerance of the CPU.
    std::vector<float> first;
    for (int k = 0; k < 4; ++k) {
      auto dbg = testing::make_tensor(db0, DType::kF32, gpu, {h}, gs);
      const bool dbias_only = p == 0.f && k >= 2;
      bias_dropout_add_backward(dbias_only ? Tensor{} : dxg.t, dbg, gg, p, key, 0, gs);
      const auto db = testing::to_host(dbg, gs);
      if (k % 2 == 0) {
        first = db;
        EXPECT_LT(testing::rel_err(db, testing::to_host(dbc, cs)), 1e-4) << "p=" << p << " call " << k;
      } else {
        EXPECT_EQ(db, first) << "p=" << p << " call " << k;
      }
    }
  }
}

}  // namespace
}  // namespace mt
