// CUDA tests of ops/attention.h against the CPU backend on the same (dtype-rounded) random
// inputs: forward (out, probs, dropped probabilities) and backward (dqkv), with and without
// dropout, fp32 (rel. err < 1e-5) and bf16/fp16 (< 2e-2). The dropout masks must be
// bit-identical on both backends (checked element by element on the dropped probabilities).
#include <gtest/gtest.h>

#include <cmath>

#include "ops/attention.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::make_tensor;
using testing::OwnedTensor;
using testing::poison;
using testing::randn;
using testing::rel_err;
using testing::to_host;

const Stream& cpu() {
  static Stream s(Device::cpu());
  return s;
}
const Stream& gpu() {
  static Stream s(Device::cuda(0));
  return s;
}
std::vector<float> rounded(std::vector<float> v, DType t) {
  for (auto& x : v) x = round_through(t, x);
  return v;
}

struct Dims {
  int64_t s, b, n, d;
};

struct Bufs {
  OwnedTensor q, k, v, probs, scratch, dq, dk, dv;
  Bufs(Dims z, DType t, Device dev) {
    const std::vector<int64_t> nd{z.b, z.n, z.s, z.d}, ns{z.b, z.n, z.s, z.s};
    q = OwnedTensor(t, dev, nd);
    k = OwnedTensor(t, dev, nd);
    v = OwnedTensor(t, dev, nd);
    dq = OwnedTensor(t, dev, nd);
    dk = OwnedTensor(t, dev, nd);
    dv = OwnedTensor(t, dev, nd);
    probs = OwnedTensor(t, dev, ns);
    scratch = OwnedTensor(t, dev, ns);
  }
  AttentionBuffers view() const { return {q.t, k.t, v.t, probs.t, scratch.t, dq.t, dk.t, dv.t}; }
  void poison_all(const Stream& st) const {
    for (const OwnedTensor* o : {&q, &k, &v, &probs, &scratch, &dq, &dk, &dv}) poison(*o, st);
  }
};

void check_attention(Dims z, float p, DType t, double tol, int64_t head_offset = 0, int64_t total_heads = 0) {
  AttentionConfig cfg;
  cfg.seq = z.s;
  cfg.batch = z.b;
  cfg.heads = z.n;
  cfg.head_dim = z.d;
  cfg.softmax_scale = 1.f / std::sqrt(static_cast<float>(z.d));
  cfg.dropout_p = p;
  cfg.dropout_key = DropoutKey{testing::test_seed(), 1234, 7, 42};
  cfg.head_offset = head_offset;
  cfg.total_heads = total_heads;
  const std::string what = fmt::format("{} s={} b={} n={} d={} p={} head_offset={} total_heads={}", dtype_name(t), z.s,
                                       z.b, z.n, z.d, p, head_offset, total_heads);
  const std::vector<int64_t> sqkv{z.s, z.b, z.n, 3, z.d}, sout{z.s, z.b, z.n * z.d};
  auto hqkv = rounded(randn(z.s * z.b * z.n * 3 * z.d), t);
  auto hg = rounded(randn(z.s * z.b * z.n * z.d), t);

  // CPU reference (fp32 on the rounded values).
  auto cqkv = make_tensor(hqkv, DType::kF32, Device::cpu(), sqkv, cpu());
  auto cdout = make_tensor(hg, DType::kF32, Device::cpu(), sout, cpu());
  OwnedTensor cout_(DType::kF32, Device::cpu(), sout), cdqkv(DType::kF32, Device::cpu(), sqkv);
  Bufs cb(z, DType::kF32, Device::cpu());
  attention_forward(cout_, cqkv, cb.view(), cfg, cpu());
  auto c_dropped = to_host(cb.scratch, cpu());
  attention_backward(cdqkv, cdout, cb.view(), cfg, cpu());

  // CUDA.
  auto gqkv = make_tensor(hqkv, t, Device::cuda(0), sqkv, gpu());
  auto gdout = make_tensor(hg, t, Device::cuda(0), sout, gpu());
  OwnedTensor gout(t, Device::cuda(0), sout), gdqkv(t, Device::cuda(0), sqkv);
  Bufs gb(z, t, Device::cuda(0));
  gb.poison_all(gpu());
  poison(gout, gpu());
  attention_forward(gout, gqkv, gb.view(), cfg, gpu());
  EXPECT_LT(rel_err(to_host(gout, gpu()), to_host(cout_, cpu())), tol) << what;
  auto g_probs = to_host(gb.probs, gpu()), c_probs = to_host(cb.probs, cpu());
  EXPECT_LT(rel_err(g_probs, c_probs), tol) << what;
  EXPECT_EQ(to_host(gb.q, gpu()), to_host(cb.q, cpu())) << what;  // pure permutes: exact
  EXPECT_EQ(to_host(gb.v, gpu()), to_host(cb.v, cpu())) << what;
  if (p > 0) {
    auto g_dropped = to_host(gb.scratch, gpu());
    EXPECT_LT(rel_err(g_dropped, c_dropped), tol) << what;
    // Bit-identical masks: an element is dropped on the GPU iff it is dropped on the CPU
    // (probabilities are far from underflow for these inputs, so 0 <=> dropped or masked).
    int64_t mismatches = 0, dropped = 0, unmasked = 0;
    for (int64_t r = 0; r < z.b * z.n * z.s; ++r) {
      const int64_t i = r % z.s;
      for (int64_t j = 0; j <= i; ++j) {
        const int64_t e = r * z.s + j;
        ASSERT_GT(c_probs[e], 0.f) << what;
        mismatches += (g_dropped[e] == 0.f) != (c_dropped[e] == 0.f);
        dropped += c_dropped[e] == 0.f;
        ++unmasked;
      }
    }
    EXPECT_EQ(mismatches, 0) << what;
    EXPECT_NEAR(static_cast<double>(dropped) / unmasked, p, 0.05) << what;
  }

  // Backward: everything but the saved q, k, v, probs is poisoned first.
  for (const OwnedTensor* o : {&gb.scratch, &gb.dq, &gb.dk, &gb.dv, &gdqkv}) poison(*o, gpu());
  attention_backward(gdqkv, gdout, gb.view(), cfg, gpu());
  auto g_dqkv = to_host(gdqkv, gpu()), c_dqkv = to_host(cdqkv, cpu());
  EXPECT_LT(rel_err(g_dqkv, c_dqkv), tol) << what;
  // Per component (q, k, v), so that a small one cannot hide behind the others.
  for (int64_t w = 0; w < 3; ++w) {
    std::vector<float> gw, cw;
    for (int64_t r = 0; r < z.s * z.b * z.n; ++r)
      for (int64_t e = 0; e < z.d; ++e) {
        gw.push_back(g_dqkv[(r * 3 + w) * z.d + e]);
        cw.push_back(c_dqkv[(r * 3 + w) * z.d + e]);
      }
    EXPECT_LT(rel_err(gw, cw), tol) << what << " component " << "qkv"[w];
  }
}

const Dims kSizes[] = {{64, 2, 3, 16}, {128, 1, 12, 64}, {37, 2, 2, 24}, {37, 1, 3, 13}};

TEST(AttentionCuda, Fp32) {
  MT_REQUIRE_CUDA();
  for (const Dims& z : kSizes) {
    check_attention(z, 0.f, DType::kF32, 1e-5);
    check_attention(z, 0.1f, DType::kF32, 1e-5);
  }
  check_attention({33, 2, 3, 8}, 0.3f, DType::kF32, 1e-5, 2, 7);  // heads 2..4 of 7
}

TEST(AttentionCuda, Bf16) {
  MT_REQUIRE_CUDA();
  for (const Dims& z : kSizes) {
    check_attention(z, 0.f, DType::kBF16, 2e-2);
    check_attention(z, 0.1f, DType::kBF16, 2e-2);
  }
}

TEST(AttentionCuda, Fp16) {
  MT_REQUIRE_CUDA();
  check_attention({64, 2, 3, 16}, 0.f, DType::kF16, 2e-2);
  check_attention({37, 2, 2, 24}, 0.2f, DType::kF16, 2e-2);
}

}  // namespace
}  // namespace mt
