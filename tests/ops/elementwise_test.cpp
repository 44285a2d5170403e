// CPU element-wise ops: cast/add/scale/fill against exact host arithmetic, and the counter-RNG
// dropout ops (bias_dropout_add_*, dropout_forward) against a mask computed here directly from
// the contract: element g is kept iff dropout_bits4(seed, stream_id, iteration, microbatch,
// g >> 2).v[g & 3] >= dropout_threshold(p).
#include <gtest/gtest.h>

#include <cmath>

#include "core/rng.h"
#include "ops/elementwise.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;
const Device kCpu = Device::cpu();

bool keep_ref(const DropoutKey& k, float p, uint64_t g) {
  return dropout_bits4(k.seed, k.stream_id, k.iteration, k.microbatch, g >> 2).v[g & 3] >= dropout_threshold(p);
}

DropoutKey random_key() {
  auto& rng = testing::test_rng();
  DropoutKey k;
  k.seed = rng();
  k.iteration = rng() % 100000;
  k.microbatch = static_cast<uint32_t>(rng() % 64);
  k.stream_id = static_cast<uint32_t>(rng() % 1000);
  return k;
}

/// Random values bounded away from zero, so that "output == 0" identifies a dropped element.
std::vector<float> randn_nonzero(int64_t n) {
  auto v = testing::randn(n);
  for (auto& x : v) {
    if (std::fabs(x) < 1e-2f) x = x < 0 ? -0.5f : 0.5f;
  }
  return v;
}

// ---- cast / add / scale / fill ------------------------------------------------------------------

TEST(Cast, AllFloatPairsRoundToNearestEven) {
  Stream st;
  const int64_t n = 1001;
  auto v = testing::randn(n, 100.f);
  v[0] = 1.0f + 1.0f / 256;  // bf16 tie -> even
  v[1] = 70000.f;            // fp16 overflow -> inf
  v[2] = 3e-6f;              // fp16 subnormal
  const DType types[] = {DType::kF32, DType::kBF16, DType::kF16};
  for (DType from : types) {
    auto src = testing::make_tensor(v, from, kCpu, {n}, st);
    std::vector<float> src_vals = testing::to_host(src, st);
    for (DType to : types) {
      OwnedTensor dst(to, kCpu, {7, 143});  // same numel, different shape is allowed
      testing::poison(dst, st);
      cast(dst, src, st);
      auto got = testing::to_host(dst, st);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(got[i], round_through(to, src_vals[i])) << dtype_name(from) << "->" << dtype_name(to) << " i=" << i;
      }
    }
  }
  OwnedTensor a(DType::kF32, kCpu, {4}), b(DType::kF32, kCpu, {5}), c(DType::kI32, kCpu, {4});
  EXPECT_THROW(cast(a, b, st), Error);
  EXPECT_THROW(cast(a, c, st), Error);
}

TEST(Add, MatchesHostArithmeticAndAliases) {
  Stream st;
  const int64_t n = 517;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    auto a = testing::make_tensor(testing::randn(n), t, kCpu, {n}, st);
    auto b = testing::make_tensor(testing::randn(n), t, kCpu, {n}, st);
    auto av = testing::to_host(a, st), bv = testing::to_host(b, st);
    OwnedTensor y(t, kCpu, {n});
    testing::poison(y, st);
    add(y, a, b, st);
    auto yv = testing::to_host(y, st);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(yv[i], round_through(t, av[i] + bv[i])) << i;
    add(a, a, b, st);  // y aliases a
    EXPECT_EQ(testing::to_host(a, st), yv);
  }
  OwnedTensor a(DType::kF32, kCpu, {4}), b(DType::kF32, kCpu, {2, 2}), c(DType::kBF16, kCpu, {4});
  EXPECT_THROW(add(a, a, b, st), Error);  // shape
  EXPECT_THROW(add(a, a, c, st), Error);  // dtype
}

TEST(ScaleFill, MatchHostArithmetic) {
  Stream st;
  const int64_t n = 300;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    auto x = testing::make_tensor(testing::randn(n), t, kCpu, {n}, st);
    auto xv = testing::to_host(x, st);
    scale_inplace(x, 0.37f, st);
    auto got = testing::to_host(x, st);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], round_through(t, xv[i] * 0.37f)) << i;
    fill(x, -1.3f, st);
    for (float v : testing::to_host(x, st)) ASSERT_EQ(v, round_through(t, -1.3f));
  }
  OwnedTensor xi(DType::kI32, kCpu, {n});
  fill(xi, -7.f, st);
  for (float v : testing::to_host(xi, st)) ASSERT_EQ(v, -7.f);
  EXPECT_THROW(fill(xi, 2.5f, st), Error);  // not an integer
  OwnedTensor xu(DType::kU8, kCpu, {4});
  EXPECT_THROW(fill(xu, 1.f, st), Error);
  EXPECT_THROW(scale_inplace(xi, 2.f, st), Error);
}

// ---- dropout ------------------------------------------------------------------------------------

TEST(Dropout, MaskFollowsContractAndKeptValuesAreScaled) {
  Stream st;
  const int64_t n = 20011;
  for (float p : {0.1f, 0.5f}) {
    for (int64_t offset : {int64_t{0}, int64_t{5}, (int64_t{1} << 33) + 3}) {
      const DropoutKey key = random_key();
      auto xv = randn_nonzero(n);
      auto x = testing::make_tensor(xv, DType::kF32, kCpu, {n}, st);
      OwnedTensor y(DType::kF32, kCpu, {n});
      testing::poison(y, st);
      dropout_forward(y, x, p, key, offset, st);
      auto yv = testing::to_host(y, st);
      const float scale = 1.0f / (1.0f - p);
      for (int64_t i = 0; i < n; ++i) {
        const bool keep = keep_ref(key, p, static_cast<uint64_t>(offset + i));
        ASSERT_EQ(yv[i], keep ? xv[i] * scale : 0.f) << "i=" << i << " p=" << p << " offset=" << offset;
      }
      // In place (y aliases x).
      dropout_forward(x, x, p, key, offset, st);
      EXPECT_EQ(testing::to_host(x, st), yv);
    }
  }
}

TEST(Dropout, KeepFractionIsOneMinusP) {
  Stream st;
  const int64_t n = 200000;
  auto x = testing::make_tensor(randn_nonzero(n), DType::kF32, kCpu, {n}, st);
  OwnedTensor y(DType::kF32, kCpu, {n});
  for (float p : {0.1f, 0.5f, 0.9f}) {
    dropout_forward(y, x, p, random_key(), 0, st);
    int64_t kept = 0;
    for (float v : testing::to_host(y, st)) kept += v != 0.f;
    const double frac = static_cast<double>(kept) / n;
    const double sigma = std::sqrt(p * (1.0 - p) / n);
    EXPECT_NEAR(frac, 1.0 - p, 6 * sigma) << "p=" << p;
  }
}

TEST(Dropout, PZeroIsIdentity) {
  Stream st;
  const int64_t n = 1003, h = 17;
  auto xv = testing::randn(n * h);
  auto x = testing::make_tensor(xv, DType::kF32, kCpu, {n, h}, st);
  OwnedTensor y(DType::kF32, kCpu, {n, h});
  testing::poison(y, st);
  dropout_forward(y, x, 0.f, random_key(), 3, st);
  EXPECT_EQ(testing::to_host(y, st), xv);
  // bias_dropout_add with p = 0: residual + (x + bias), every element kept.
  auto bv = testing::randn(h), rv = testing::randn(n * h);
  auto bias = testing::make_tensor(bv, DType::kF32, kCpu, {h}, st);
  auto res = testing::make_tensor(rv, DType::kF32, kCpu, {n, h}, st);
  bias_dropout_add_forward(y, x, bias, res, 0.f, random_key(), 0, st);
  auto yv = testing::to_host(y, st);
  for (int64_t i = 0; i < n * h; ++i) ASSERT_EQ(yv[i], (xv[i] + bv[i % h]) + rv[i]) << i;
}

TEST(Dropout, DifferentKeysGiveDifferentMasks) {
  Stream st;
  const int64_t n = 40000;
  const float p = 0.3f;
  auto x = testing::make_tensor(randn_nonzero(n), DType::kF32, kCpu, {n}, st);
  auto mask_of = [&](const DropoutKey& k) {
    OwnedTensor y(DType::kF32, kCpu, {n});
    dropout_forward(y, x, p, k, 0, st);
    auto v = testing::to_host(y, st);
    std::vector<bool> m(n);
    for (int64_t i = 0; i < n; ++i) m[i] = v[i] != 0.f;
    return m;
  };
  const DropoutKey base = random_key();
  const auto m0 = mask_of(base);
  EXPECT_EQ(mask_of(base), m0);  // pure function of the key
  std::vector<DropoutKey> variants(4, base);
  variants[0].iteration += 1;
  variants[1].microbatch += 1;
  variants[2].stream_id += 1;
  variants[3].seed += 1;
  const double expected_diff = 2.0 * p * (1 - p) * n;  // independent masks
  for (size_t v = 0; v < variants.size(); ++v) {
    const auto m = mask_of(variants[v]);
    int64_t diff = 0;
    for (int64_t i = 0; i < n; ++i) diff += m[i] != m0[i];
    EXPECT_GT(diff, 0.8 * expected_diff) << "variant " << v;
    EXPECT_LT(diff, 1.2 * expected_diff) << "variant " << v;
  }
}

TEST(Dropout, LayoutInvariance) {
  // The mask is a function of the global index only: computing a tensor in two pieces with the
  // right global offsets reproduces the whole, for any split point (also mid-Philox-group).
  Stream st;
  const int64_t rows = 37, h = 29, n = rows * h;
  const float p = 0.4f;
  const int64_t base = 1000003;  // global offset of the whole tensor (odd)
  const DropoutKey key = random_key();
  auto xv = randn_nonzero(n), rv = testing::randn(n), bv = testing::randn(h);
  auto x = testing::make_tensor(xv, DType::kF32, kCpu, {rows, h}, st);
  auto res = testing::make_tensor(rv, DType::kF32, kCpu, {rows, h}, st);
  auto bias = testing::make_tensor(bv, DType::kF32, kCpu, {h}, st);
  OwnedTensor whole(DType::kF32, kCpu, {rows, h}), parts(DType::kF32, kCpu, {rows, h});
  dropout_forward(whole, x, p, key, base, st);
  for (int64_t split : {int64_t{1}, int64_t{4}, int64_t{401}, n - 2}) {
    testing::poison(parts, st);
    dropout_forward(parts.t.flat_range(0, split), x.t.flat_range(0, split), p, key, base, st);
    dropout_forward(parts.t.flat_range(split, n - split), x.t.flat_range(split, n - split), p, key, base + split, st);
    EXPECT_EQ(testing::to_host(parts, st), testing::to_host(whole, st)) << "split=" << split;
  }
  // bias_dropout_add split by rows (as sequence parallelism shards [s, b, h]).
  bias_dropout_add_forward(whole, x, bias, res, p, key, base, st);
  const int64_t r0 = 11;
  testing::poison(parts, st);
  bias_dropout_add_forward(parts.t.slice0(0, r0), x.t.slice0(0, r0), bias, res.t.slice0(0, r0), p, key, base, st);
  bias_dropout_add_forward(parts.t.slice0(r0, rows), x.t.slice0(r0, rows), bias, res.t.slice0(r0, rows), p, key,
                           base + r0 * h, st);
  EXPECT_EQ(testing::to_host(parts, st), testing::to_host(whole, st));
}

TEST(BiasDropoutAdd, ForwardMatchesFloat64Reference) {
  Stream st;
  const int64_t rows = 23, h = 37, n = rows * h;
  for (bool with_bias : {true, false}) {
    const float p = 0.25f;
    const int64_t offset = 7;
    const DropoutKey key = random_key();
    auto xv = testing::randn(n), rv = testing::randn(n), bv = testing::randn(h);
    auto x = testing::make_tensor(xv, DType::kF32, kCpu, {rows, h}, st);
    auto res = testing::make_tensor(rv, DType::kF32, kCpu, {rows, h}, st);
    auto bias = testing::make_tensor(bv, DType::kF32, kCpu, {h}, st);
    OwnedTensor out(DType::kF32, kCpu, {rows, h});
    testing::poison(out, st);
    bias_dropout_add_forward(out, x, with_bias ? bias.t : Tensor{}, res, p, key, offset, st);
    std::vector<double> ref(n);
    for (int64_t i = 0; i < n; ++i) {
      const double v = double(xv[i]) + (with_bias ? bv[i % h] : 0.0);
      ref[i] = rv[i] + (keep_ref(key, p, offset + i) ? v / (1.0 - p) : 0.0);
    }
    auto got = testing::to_host(out, st);
    EXPECT_LT(testing::rel_err(got, ref), 1e-6) << "bias=" << with_bias;
    // out aliases residual.
    bias_dropout_add_forward(res, x, with_bias ? bias.t : Tensor{}, res, p, key, offset, st);
    EXPECT_EQ(testing::to_host(res, st), got);
  }
}

// L = sum(g * out(x, bias)); for a fixed key the mask does not depend on x, so dL/dx = dx and
// dL/dbias = dbias are checked against central differences of the float64 reference (exact up to
// rounding, L being linear).
TEST(BiasDropoutAdd, BackwardMatchesFiniteDifferencesAndForwardMask) {
  Stream st;
  const int64_t rows = 6, h = 10, n = rows * h;
  for (float p : {0.f, 0.35f}) {
    const int64_t offset = 13;
    const DropoutKey key = random_key();
    auto xv = randn_nonzero(n), bv = testing::randn(h), rv = testing::randn(n), g = randn_nonzero(n);
    std::vector<double> xd(xv.begin(), xv.end()), bd(bv.begin(), bv.end());
    auto loss = [&] {
      double l = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double v = xd[i] + bd[i % h];
        l += g[i] * (rv[i] + (keep_ref(key, p, offset + i) ? v / (1.0 - p) : 0.0));
      }
      return l;
    };
    std::vector<double> dx_ref(n), db_ref(h);
    auto db0 = testing::randn(h);
    for (int64_t i = 0; i < n; ++i) dx_ref[i] = testing::finite_diff(loss, xd, i);
    for (int64_t c = 0; c < h; ++c) db_ref[c] = db0[c] + testing::finite_diff(loss, bd, c);

    auto dout = testing::make_tensor(g, DType::kF32, kCpu, {rows, h}, st);
    auto dbias = testing::make_tensor(db0, DType::kF32, kCpu, {h}, st);
    OwnedTensor dx(DType::kF32, kCpu, {rows, h});
    testing::poison(dx, st);
    bias_dropout_add_backward(dx, dbias, dout, p, key, offset, st);
    auto dxv = testing::to_host(dx, st);
    EXPECT_LT(testing::rel_err(dxv, dx_ref), 1e-6) << "p=" << p;
    EXPECT_LT(testing::rel_err(testing::to_host(dbias, st), db_ref), 1e-5) << "p=" << p;

    // Same mask as the forward: dx == 0 exactly where the forward dropped.
    auto x = testing::make_tensor(xv, DType::kF32, kCpu, {rows, h}, st);
    auto zero = testing::make_tensor(std::vector<float>(n, 0.f), DType::kF32, kCpu, {rows, h}, st);
    OwnedTensor out(DType::kF32, kCpu, {rows, h});
    bias_dropout_add_forward(out, x, Tensor{}, zero, p, key, offset, st);
    auto ov = testing::to_host(out, st);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(ov[i] == 0.f, dxv[i] == 0.f) << i;
    // Without dbias, and with dx aliasing dout.
    bias_dropout_add_backward(dout, Tensor{}, dout, p, key, offset, st);
    EXPECT_EQ(testing::to_host(dout, st), dxv);
  }
}

// Without dropout the caller may pass no dx (the branch gradient is dout itself): only dbias is
// accumulated, to the value it gets with dx; with dropout an empty dx is an error.
TEST(BiasDropoutAdd, BackwardWithoutDxAccumulatesOnlyTheBias) {
  Stream st;
  const int64_t rows = 7, h = 9, n = rows * h;
  const DropoutKey key = random_key();
  auto g = testing::randn(n), db0 = testing::randn(h);
  auto dout = testing::make_tensor(g, DType::kF32, kCpu, {rows, h}, st);
  auto db_a = testing::make_tensor(db0, DType::kF32, kCpu, {h}, st);
  auto db_b = testing::make_tensor(db0, DType::kF32, kCpu, {h}, st);
  OwnedTensor dx(DType::kF32, kCpu, {rows, h});
  bias_dropout_add_backward(dx, db_a, dout, 0.f, key, 0, st);
  bias_dropout_add_backward(Tensor{}, db_b, dout, 0.f, key, 0, st);
  EXPECT_EQ(testing::to_host(db_b, st), testing::to_host(db_a, st));
  EXPECT_NE(testing::to_host(db_b, st), db0);
  EXPECT_EQ(testing::to_host(dout, st), g);  // dout untouched
  EXPECT_THROW(bias_dropout_add_backward(Tensor{}, db_b, dout, 0.1f, key, 0, st), Error);
}

TEST(Dropout, BadInputThrows) {
  Stream st;
  const int64_t rows = 4, h = 6;
  const DropoutKey key;
  auto x = testing::make_tensor(testing::randn(rows * h), DType::kF32, kCpu, {rows, h}, st);
  OwnedTensor y(DType::kF32, kCpu, {rows, h}), y_bad(DType::kF32, kCpu, {rows, h + 1}),
      y_bf(DType::kBF16, kCpu, {rows, h}), bias(DType::kF32, kCpu, {h}), bias_bad(DType::kF32, kCpu, {h + 1}),
      dbias_bf(DType::kBF16, kCpu, {h});
  EXPECT_NO_THROW(dropout_forward(y, x, 0.5f, key, 0, st));
  EXPECT_THROW(dropout_forward(y, x, 1.0f, key, 0, st), Error);
  EXPECT_THROW(dropout_forward(y, x, -0.1f, key, 0, st), Error);
  EXPECT_THROW(dropout_forward(y, x, 0.1f, key, -4, st), Error);
  EXPECT_THROW(dropout_forward(y_bad, x, 0.1f, key, 0, st), Error);
  EXPECT_THROW(dropout_forward(y_bf, x, 0.1f, key, 0, st), Error);
  EXPECT_NO_THROW(bias_dropout_add_forward(y, x, bias, x, 0.1f, key, 0, st));
  EXPECT_THROW(bias_dropout_add_forward(y, x, bias_bad, x, 0.1f, key, 0, st), Error);
  EXPECT_THROW(bias_dropout_add_forward(y, x, bias, y_bad, 0.1f, key, 0, st), Error);
  EXPECT_THROW(bias_dropout_add_forward(y, x, bias, x, 1.5f, key, 0, st), Error);
  EXPECT_NO_THROW(bias_dropout_add_backward(y, bias, x, 0.1f, key, 0, st));
  EXPECT_THROW(bias_dropout_add_backward(y, dbias_bf, x, 0.1f, key, 0, st), Error);
  EXPECT_THROW(bias_dropout_add_backward(y, bias_bad, x, 0.1f, key, 0, st), Error);
  EXPECT_THROW(bias_dropout_add_backward(y_bad, bias, x, 0.1f, key, 0, st), Error);
}

}  // namespace
}  // namespace mt
