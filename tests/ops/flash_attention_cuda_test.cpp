// CUDA tests of ops/flash_attention.h against the CPU backend on the same (dtype-rounded) random
// inputs: out, lse and dqkv (per component: query, key, value slots), fp32 (rel. err < 1e-5; the
// simple path) and bf16/fp16 (< 2e-2; tensor cores for head_dim 64/128, the simple path
// otherwise), at ragged lengths (s = 1, 7, 65, 200, 520: not multiples of the tiles), multi-head,
// grouped-query and multi-query, with dropout, a document mask and a tensor-parallel head offset.
// Dropout masks are checked bit-identical to the header's formula with one-hot values, which make
// the forward's output (and dV in the backward) show each kept probability as a non-zero element.
// The deterministic backward (FlashAttentionConfig::deterministic: dQ by its own kernel) gives the
// same bits on every run, matches the CPU, and equals the atomic path within rounding.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/rng.h"
#include "ops/attention_test_util.h"
#include "ops/cuda/cudnn_attention.h"
#include "ops/flash_attention.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::cpu_stream;
using testing::cuda_stream;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::poison;
using testing::randn;
using testing::rel_err;
using testing::rounded;
using testing::to_host;

/// s, b, g key/value heads, qpg queries per group, d.
struct Dims {
  int64_t s, b, g, qpg, d;
  int64_t n() const { return g * qpg; }
  std::vector<int64_t> qkv_shape() const { return {s, b, g, qpg + 2, d}; }
  std::vector<int64_t> out_shape() const { return {s, b, n(), d}; }
  int64_t qkv_numel() const { return s * b * g * (qpg + 2) * d; }
  int64_t out_numel() const { return s * b * n() * d; }
};

FlashAttentionConfig make_cfg(Dims z, float p, int64_t head_offset, int64_t total_heads) {
  FlashAttentionConfig c;
  c.seq = z.s;
  c.batch = z.b;
  c.groups = z.g;
  c.queries_per_group = z.qpg;
  c.head_dim = z.d;
  c.softmax_scale = 1.f / std::sqrt(static_cast<float>(z.d));
  c.dropout_p = p;
  c.dropout_key = DropoutKey{testing::test_seed(), 1234, 7, 42};
  c.head_offset = head_offset;
  c.total_heads = total_heads;
  return c;
}

/// One forward + backward on `dev` (outputs and workspace poisoned first).
struct FaRun {
  std::vector<float> out, lse, dqkv;
};
FaRun run(Dims z, const FlashAttentionConfig& cfg, DType t, Device dev, const Stream& st, const std::vector<float>& hqkv,
        const std::vector<float>& hg) {
  auto qkv = make_tensor(hqkv, t, dev, z.qkv_shape(), st);
  auto dout = make_tensor(hg, t, dev, z.out_shape(), st);
  OwnedTensor out(t, dev, z.out_shape()), lse(DType::kF32, dev, {z.b, z.n(), z.s}), dqkv(t, dev, z.qkv_shape());
  const int64_t ws_floats = static_cast<int64_t>(flash_attention_workspace_bytes(cfg) / 4);
  OwnedTensor ws(DType::kF32, dev, {ws_floats});
  for (const OwnedTensor* o : {&out, &lse, &dqkv, &ws}) poison(*o, st);
  flash_attention_forward(out, lse, qkv, cfg, st);
  flash_attention_backward(dqkv, dout, out, lse, qkv, ws, cfg, st);
  return {to_host(out, st), to_host(lse, st), to_host(dqkv, st)};
}

/// Component w of dqkv: the query slots (w = 0), the key (1) or the value (2) of every group.
std::vector<float> component(const std::vector<float>& dqkv, Dims z, int w) {
  std::vector<float> r;
  const int64_t lo = w == 0 ? 0 : z.qpg + w - 1, hi = w == 0 ? z.qpg : lo + 1;
  for (int64_t x = 0; x < z.s * z.b * z.g; ++x)
    for (int64_t c = lo; c < hi; ++c)
      r.insert(r.end(), dqkv.begin() + (x * (z.qpg + 2) + c) * z.d, dqkv.begin() + (x * (z.qpg + 2) + c + 1) * z.d);
  return r;
}

double norm(const std::vector<float>& v) {
  double acc = 0;
  for (float x : v) acc += static_cast<double>(x) * x;
  return std::sqrt(acc);
}

/// ||a - b|| / max(||b||, floor), NaN -> infinity.
double rel_err_floor(const std::vector<float>& a, const std::vector<float>& b, double floor) {
  std::vector<float> diff(a.size());
  for (size_t i = 0; i < a.size(); ++i) diff[i] = a[i] - b[i];
  const double num = norm(diff);
  return std::isnan(num) ? INFINITY : num / std::max({norm(b), floor, 1e-30});
}

void check(Dims z, DType t, double tol, float p = 0.f, bool docs = false, int64_t head_offset = 0,
           int64_t total_heads = 0, bool cudnn = false) {
  auto cfg = make_cfg(z, p, head_offset, total_heads);
  cfg.cudnn = cudnn;
  const std::string what =
      fmt::format("{} s={} b={} g={} qpg={} d={} p={} docs={} head_offset={} total_heads={} cudnn={}", dtype_name(t),
                  z.s, z.b, z.g, z.qpg, z.d, p, docs, head_offset, total_heads, cudnn);
  OwnedTensor cdoc, gdoc;
  auto ccfg = cfg, gcfg = cfg;
  if (docs) {
    const auto hdoc = testing::random_doc_start(z.s, z.b, 8);
    cdoc = testing::make_int_tensor(hdoc, Device::cpu(), {z.b, z.s}, cpu_stream());
    gdoc = testing::make_int_tensor(hdoc, Device::cuda(0), {z.b, z.s}, cuda_stream());
    ccfg.doc_start = cdoc.t;
    gcfg.doc_start = gdoc.t;
  }
  const auto hqkv = rounded(randn(z.qkv_numel()), t), hg = rounded(randn(z.out_numel()), t);
  const FaRun c = run(z, ccfg, DType::kF32, Device::cpu(), cpu_stream(), hqkv, hg);
  const FaRun g = run(z, gcfg, t, Device::cuda(0), cuda_stream(), hqkv, hg);
  EXPECT_TRUE(testing::all_finite(g.out) && testing::all_finite(g.lse) && testing::all_finite(g.dqkv)) << what;
  EXPECT_LT(rel_err(g.out, c.out), tol) << what;
  EXPECT_LT(rel_err(g.lse, c.lse), tol) << what;
  EXPECT_LT(rel_err(g.dqkv, c.dqkv), tol) << what;
  // Per component, so that a small one cannot hide behind the others. At s = 1, dQ and dK are zero
  // in exact arithmetic (P = 1, dS = P (dP - D) = 0) and only rounding noise is left (bf16: D uses
  // the rounded out, as in FlashAttention-2), so there they are measured against the whole gradient.
  const double floor = z.s == 1 ? norm(c.dqkv) : 0.0;
  for (int w = 0; w < 3; ++w)
    EXPECT_LT(rel_err_floor(component(g.dqkv, z, w), component(c.dqkv, z, w), floor), tol)
        << what << " component " << "qkv"[w];
}

// Ragged lengths on purpose: the tensor-core tiles are 64 (forward queries), 64/128 (keys).
const Dims kSmall[] = {{1, 2, 2, 1, 64}, {7, 2, 3, 1, 64}, {65, 1, 2, 2, 64}, {200, 2, 1, 3, 64}};
const Dims kSmall128[] = {{1, 1, 2, 2, 128}, {7, 2, 1, 1, 128}, {65, 2, 2, 1, 128}, {200, 1, 2, 2, 128}};

TEST(FlashAttentionCuda, Fp32) {
  MT_REQUIRE_CUDA();
  for (const Dims& z : kSmall) check(z, DType::kF32, 1e-5);
  for (const Dims& z : kSmall128) check(z, DType::kF32, 1e-5);
  check({37, 2, 2, 2, 13}, DType::kF32, 1e-5);
  check({65, 2, 2, 2, 32}, DType::kF32, 1e-5, 0.1f, false, 4, 12);  // heads 4..7 of 12
  check({200, 2, 1, 2, 24}, DType::kF32, 1e-5, 0.2f, true);
  check({65, 3, 2, 1, 64}, DType::kF32, 1e-5, 0.f, true);
}

TEST(FlashAttentionCuda, Bf16HeadDim64) {
  MT_REQUIRE_CUDA();
  for (const Dims& z : kSmall) {
    check(z, DType::kBF16, 2e-2);
    check(z, DType::kBF16, 2e-2, 0.1f);
  }
  check({520, 1, 2, 2, 64}, DType::kBF16, 2e-2);
  check({200, 3, 2, 2, 64}, DType::kBF16, 2e-2, 0.f, true);
  check({200, 2, 1, 4, 64}, DType::kBF16, 2e-2, 0.2f, true, 4, 16);
}

TEST(FlashAttentionCuda, Bf16HeadDim128) {
  MT_REQUIRE_CUDA();
  for (const Dims& z : kSmall128) {
    check(z, DType::kBF16, 2e-2);
    check(z, DType::kBF16, 2e-2, 0.1f);
  }
  check({520, 1, 1, 2, 128}, DType::kBF16, 2e-2);
  check({200, 3, 2, 1, 128}, DType::kBF16, 2e-2, 0.f, true);
  check({130, 2, 2, 2, 128}, DType::kBF16, 2e-2, 0.3f, true, 2, 9);
}

/// Other head dims run on the simple path in bf16 too.
TEST(FlashAttentionCuda, Bf16OtherHeadDims) {
  MT_REQUIRE_CUDA();
  check({65, 2, 2, 2, 16}, DType::kBF16, 2e-2);
  check({33, 1, 1, 3, 24}, DType::kBF16, 2e-2, 0.2f, true);
  check({7, 2, 1, 1, 256}, DType::kBF16, 2e-2);
}

TEST(FlashAttentionCuda, Fp16) {
  MT_REQUIRE_CUDA();
  check({65, 2, 2, 2, 64}, DType::kF16, 2e-2, 0.2f);
  check({200, 1, 2, 1, 128}, DType::kF16, 2e-2, 0.f, true);
  check({37, 2, 1, 2, 40}, DType::kF16, 2e-2, 0.1f);
}

/// --attention-backend fused: cuDNN's fused attention against the CPU at ragged lengths, head dims
/// 32, 64, 128, multi-head, grouped-query and multi-query, bf16 and fp16 — checking that cuDNN ran
/// (two executions per forward + backward) — and the cases it does not take (dropout, document
/// masks, fp32) falling back to the FlashAttention-2 kernels with the same results.
TEST(FlashAttentionCuda, CudnnFused) {
  MT_REQUIRE_CUDA();
  if (!flash_attention_cudnn_available()) GTEST_SKIP() << "built without cuDNN";
  const Dims shapes[] = {{1, 2, 2, 1, 64},    {7, 2, 3, 1, 64},   {65, 1, 2, 1, 64},  {200, 2, 3, 1, 64},
                         {520, 1, 2, 1, 64},  {1000, 2, 2, 1, 128}, {65, 2, 2, 1, 128}, {130, 1, 3, 1, 32},
                         {65, 1, 2, 2, 64},   {200, 2, 1, 4, 64},  {130, 2, 2, 2, 128}, {7, 2, 1, 3, 64}};
  for (const Dims& z : shapes) {
    const int64_t before = cuda::cudnn_attention_executions();
    check(z, DType::kBF16, 2e-2, 0.f, false, 0, 0, true);
    EXPECT_EQ(cuda::cudnn_attention_executions() - before, 2) << "s=" << z.s << " d=" << z.d;
  }
  int64_t before = cuda::cudnn_attention_executions();
  check({200, 2, 2, 1, 64}, DType::kF16, 2e-2, 0.f, false, 0, 0, true);
  EXPECT_EQ(cuda::cudnn_attention_executions() - before, 2);
  before = cuda::cudnn_attention_executions();
  check({65, 2, 2, 1, 64}, DType::kBF16, 2e-2, 0.1f, false, 0, 0, true);       // dropout
  check({200, 2, 2, 1, 128}, DType::kBF16, 2e-2, 0.f, true, 0, 0, true);       // documents
  check({65, 2, 2, 1, 64}, DType::kF32, 1e-5, 0.f, false, 0, 0, true);         // fp32
  EXPECT_EQ(cuda::cudnn_attention_executions(), before) << "cuDNN ran on a case it does not support";
}

/// Multi-latent attention's core attention with --attention-backend fused: every head its own key
/// and value (qpg 1), query/key head dim D = 192 (DeepSeek-V3: d_n 128 + d_r 64) and the values
/// zero-padded from d_v = 128 to D (ops/mla.h), as MLASelfAttention packs them, with
/// FlashAttentionConfig::v_head_dim = 128 (cuDNN computes P·V on the 128 real channels: its Hopper
/// support matrix lists d_qk = 192, d_v = 128) and without it (cuDNN at d = 192 throughout), and a
/// small MLA shape (D 24, d_v 16) — against the CPU (which ignores v_head_dim) with the padding
/// channels of out and dV zero. Prints whether cuDNN or the fallback kernels ran (on Hopper cuDNN
/// should: 2 executions per case; an older cuDNN without the engine falls back with a warning).
TEST(FlashAttentionCuda, CudnnMlaHeadDims) {
  MT_REQUIRE_CUDA();
  if (!flash_attention_cudnn_available()) GTEST_SKIP() << "built without cuDNN";
  int device = 0, major = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  struct Case {
    Dims z;
    int64_t dv, v_head_dim;
  };
  const Case cases[] = {{{130, 2, 4, 1, 192}, 128, 128}, {{65, 1, 2, 1, 192}, 128, 0}, {{200, 2, 3, 1, 24}, 16, 16},
                        {{1000, 1, 2, 1, 192}, 128, 128}};
  for (const Case& cs : cases) {
    const Dims z = cs.z;
    for (DType t : {DType::kBF16, DType::kF16}) {
      auto cfg = make_cfg(z, 0.f, 0, 0);
      cfg.softmax_scale = 1.f / std::sqrt(192.f);
      cfg.cudnn = true;
      cfg.v_head_dim = cs.v_head_dim;
      const std::string what = fmt::format("{} s={} b={} heads={} D={} d_v={} v_head_dim={}", dtype_name(t), z.s, z.b,
                                           z.g, z.d, cs.dv, cs.v_head_dim);
      std::vector<float> hqkv = rounded(randn(z.qkv_numel()), t), hg = rounded(randn(z.out_numel()), t);
      for (int64_t r = 0; r < z.s * z.b * z.g; ++r)  // value channels >= d_v: MLA's zero padding
        std::fill(hqkv.begin() + (r * 3 + 2) * z.d + cs.dv, hqkv.begin() + (r * 3 + 3) * z.d, 0.f);
      for (int64_t r = 0; r < z.s * z.b * z.g; ++r)  // and of the context's gradient
        std::fill(hg.begin() + r * z.d + cs.dv, hg.begin() + (r + 1) * z.d, 0.f);
      const FaRun c = run(z, cfg, DType::kF32, Device::cpu(), cpu_stream(), hqkv, hg);
      const int64_t before = cuda::cudnn_attention_executions();
      const FaRun g = run(z, cfg, t, Device::cuda(0), cuda_stream(), hqkv, hg);
      const int64_t ran = cuda::cudnn_attention_executions() - before;
      std::printf("[CudnnMlaHeadDims] %s sm%d: cuDNN ran %lld of 2 (%s)\n", what.c_str(), major * 10,
                  static_cast<long long>(ran), ran == 2 ? "fused" : "fallback kernels");
      EXPECT_TRUE(testing::all_finite(g.out) && testing::all_finite(g.dqkv)) << what;
      EXPECT_LT(rel_err(g.out, c.out), 2e-2) << what;
      EXPECT_LT(rel_err(g.lse, c.lse), 2e-2) << what;
      for (int w = 0; w < 3; ++w)
        EXPECT_LT(rel_err_floor(component(g.dqkv, z, w), component(c.dqkv, z, w), 0.0), 2e-2)
            << what << " component " << "qkv"[w];
      for (int64_t r = 0; r < z.s * z.b * z.g; ++r)  // the padding channels of out and dV are exactly zero
        for (int64_t e = cs.dv; e < z.d; ++e) {
          ASSERT_EQ(g.out[r * z.d + e], 0.f) << what << " out row " << r << " channel " << e;
          ASSERT_EQ(g.dqkv[(r * 3 + 2) * z.d + e], 0.f) << what << " dV row " << r << " channel " << e;
        }
      if (major < 9 && z.d > 128) EXPECT_EQ(ran, 0) << what << ": head dim > 128 is Hopper's only";
    }
  }
}

/// Dropout masks, element by element: q = 0 makes the probabilities uniform over the visible keys
/// and v_j = e_j (one-hot) puts probability (i, j) into out[i, ..., e = j]; with dout_i = e_i, dV_j
/// [e = i] is the dropped probability (i, j) (qpg = 1, so no sum over heads). Non-zero iff visible
/// and kept by the header's formula (computed here independently); s <= d.
void check_masks(DType t, bool docs) {
  const Dims z{100, 2, 3, 1, 128};
  const float p = 0.3f;
  const auto cfg = make_cfg(z, p, 2, 11);
  const std::string what = fmt::format("{} docs={}", dtype_name(t), docs);
  const auto hdoc = docs ? testing::random_doc_start(z.s, z.b, 8) : std::vector<int32_t>(z.b * z.s, 0);
  OwnedTensor gdoc;
  auto gcfg = cfg;
  if (docs) {
    gdoc = testing::make_int_tensor(hdoc, Device::cuda(0), {z.b, z.s}, cuda_stream());
    gcfg.doc_start = gdoc.t;
  }
  auto hqkv = randn(z.qkv_numel());
  std::vector<float> hg(z.out_numel(), 0.f);
  for (int64_t i = 0; i < z.s; ++i) {
    for (int64_t b = 0; b < z.b; ++b) {
      for (int64_t grp = 0; grp < z.g; ++grp) {
        float* x = hqkv.data() + ((i * z.b + b) * z.g + grp) * 3 * z.d;
        for (int64_t e = 0; e < z.d; ++e) {
          x[e] = 0.f;                      // q
          x[2 * z.d + e] = e == i ? 1.f : 0.f;  // v_i = e_i
        }
        hg[((i * z.b + b) * z.n() + grp) * z.d + i] = 1.f;  // dout_i = e_i
      }
    }
  }
  const FaRun g = run(z, gcfg, t, Device::cuda(0), cuda_stream(), hqkv, hg);
  int64_t mismatches = 0, kept = 0, visible = 0;
  for (int64_t b = 0; b < z.b; ++b) {
    for (int64_t h = 0; h < z.n(); ++h) {
      for (int64_t i = 0; i < z.s; ++i) {
        for (int64_t j = 0; j < z.d; ++j) {
          const bool vis = j < z.s && j <= i && j >= hdoc[b * z.s + i];
          bool keep = false;
          if (vis) {
            const uint64_t gi = static_cast<uint64_t>(((b * cfg.total_heads + cfg.head_offset + h) * z.s + i) * z.s + j);
            const Philox4 r = dropout_bits4(cfg.dropout_key.seed, cfg.dropout_key.stream_id, cfg.dropout_key.iteration,
                                            cfg.dropout_key.microbatch, gi >> 2);
            keep = r.v[gi & 3] >= dropout_threshold(p);
          }
          visible += vis;
          kept += keep;
          const float o = g.out[((i * z.b + b) * z.n() + h) * z.d + j];
          mismatches += (o != 0.f) != keep;
          if (j < z.s) {  // dV of key j, dimension i
            const float dv = g.dqkv[(((j * z.b + b) * z.g + h) * 3 + 2) * z.d + i];
            mismatches += (dv != 0.f) != keep;
          }
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << what;
  const double sd = std::sqrt(p * (1.0 - p) / static_cast<double>(visible));
  EXPECT_NEAR(1.0 - static_cast<double>(kept) / visible, p, 5 * sd) << what;
}

TEST(FlashAttentionCuda, DropoutMasksBitIdentical) {
  MT_REQUIRE_CUDA();
  for (DType t : {DType::kBF16, DType::kF32, DType::kF16})
    for (bool docs : {false, true}) check_masks(t, docs);
}

/// --deterministic-mode: dqkv the same bits on two runs; against the CPU per component as check();
/// against the atomic path: dQ within rounding (the atomics' order, S recomputed query-major, dS
/// rounded to 16 bits), dK and dV within 1e-3 (the same kernel without its dQ part: normally equal;
/// the margin allows a different FMA contraction); the forward is untouched by the flag (bitwise).
void check_deterministic(Dims z, DType t, float p, bool docs, int64_t head_offset = 0, int64_t total_heads = 0) {
  auto cfg = make_cfg(z, p, head_offset, total_heads);
  const std::string what = fmt::format("{} s={} b={} g={} qpg={} d={} p={} docs={}", dtype_name(t), z.s, z.b, z.g,
                                       z.qpg, z.d, p, docs);
  OwnedTensor cdoc, gdoc;
  auto ccfg = cfg, gcfg = cfg;
  if (docs) {
    const auto hdoc = testing::random_doc_start(z.s, z.b, 8);
    cdoc = testing::make_int_tensor(hdoc, Device::cpu(), {z.b, z.s}, cpu_stream());
    gdoc = testing::make_int_tensor(hdoc, Device::cuda(0), {z.b, z.s}, cuda_stream());
    ccfg.doc_start = cdoc.t;
    gcfg.doc_start = gdoc.t;
  }
  auto dcfg = gcfg;
  dcfg.deterministic = true;
  const auto hqkv = rounded(randn(z.qkv_numel()), t), hg = rounded(randn(z.out_numel()), t);
  const FaRun c = run(z, ccfg, DType::kF32, Device::cpu(), cpu_stream(), hqkv, hg);
  const FaRun d1 = run(z, dcfg, t, Device::cuda(0), cuda_stream(), hqkv, hg);
  const FaRun d2 = run(z, dcfg, t, Device::cuda(0), cuda_stream(), hqkv, hg);
  const FaRun at = run(z, gcfg, t, Device::cuda(0), cuda_stream(), hqkv, hg);
  ASSERT_TRUE(testing::all_finite(d1.dqkv)) << what;
  EXPECT_EQ(d1.dqkv, d2.dqkv) << what;
  EXPECT_EQ(d1.out, at.out) << what;
  EXPECT_EQ(d1.lse, at.lse) << what;
  const double tol = t == DType::kF32 ? 1e-5 : 2e-2;
  for (int w = 0; w < 3; ++w) {
    const auto dc = component(d1.dqkv, z, w);
    EXPECT_LT(rel_err_floor(dc, component(c.dqkv, z, w), 0.0), tol) << what << " component " << "qkv"[w];
    EXPECT_LT(rel_err_floor(dc, component(at.dqkv, z, w), 0.0), w == 0 ? (t == DType::kF32 ? 1e-6 : 5e-3) : 1e-3)
        << what << " deterministic vs atomic, component " << "qkv"[w];
  }
}

TEST(FlashAttentionCuda, DeterministicBackwardBitwise) {
  MT_REQUIRE_CUDA();
  // Tensor cores: d = 64 (key tiles of 64) and 128 (32), ragged lengths (partial query and key
  // tiles), several query tiles per head, GQA / MQA, dropout, documents, a TP head offset, fp16.
  check_deterministic({65, 2, 2, 2, 64}, DType::kBF16, 0.f, false);
  check_deterministic({520, 1, 2, 2, 64}, DType::kBF16, 0.1f, false);
  check_deterministic({200, 3, 2, 1, 64}, DType::kBF16, 0.f, true);
  check_deterministic({200, 2, 1, 4, 64}, DType::kBF16, 0.2f, true, 4, 16);
  check_deterministic({7, 2, 1, 1, 128}, DType::kBF16, 0.f, false);
  check_deterministic({300, 2, 2, 2, 128}, DType::kBF16, 0.1f, false);
  check_deterministic({130, 2, 2, 2, 128}, DType::kBF16, 0.3f, true, 2, 9);
  check_deterministic({200, 1, 2, 1, 128}, DType::kF16, 0.f, true);
  check_deterministic({150, 2, 1, 3, 64}, DType::kF16, 0.2f, false);
  // The simple path (fp32, other head dims) is deterministic either way.
  check_deterministic({65, 2, 2, 2, 32}, DType::kF32, 0.1f, true);
  check_deterministic({33, 1, 1, 3, 24}, DType::kBF16, 0.2f, true);
}

TEST(FlashAttentionCuda, Errors) {
  MT_REQUIRE_CUDA();
  const Dims z{6, 2, 1, 1, 8};
  const auto cfg = make_cfg(z, 0.f, 0, 0);
  auto qkv = make_tensor(randn(z.qkv_numel()), DType::kBF16, Device::cuda(0), z.qkv_shape(), cuda_stream());
  OwnedTensor out(DType::kBF16, Device::cuda(0), z.out_shape()), lse(DType::kF32, Device::cuda(0), {z.b, z.n(), z.s});
  OwnedTensor lse_cpu(DType::kF32, Device::cpu(), {z.b, z.n(), z.s});
  EXPECT_NO_THROW(flash_attention_forward(out, lse, qkv, cfg, cuda_stream()));
  EXPECT_THROW(flash_attention_forward(out, lse_cpu, qkv, cfg, cuda_stream()), Error);  // mixed devices
  EXPECT_THROW(flash_attention_forward(out, lse, qkv, cfg, cpu_stream()), Error);       // stream device
  auto c = cfg;
  auto doc_cpu = testing::make_int_tensor(std::vector<int32_t>(z.b * z.s, 0), Device::cpu(), {z.b, z.s}, cpu_stream());
  c.doc_start = doc_cpu.t;
  EXPECT_THROW(flash_attention_forward(out, lse, qkv, c, cuda_stream()), Error);  // doc_start on the CPU
  const Dims big{2, 1, 1, 1, 1032};
  auto cb = make_cfg(big, 0.f, 0, 0);
  auto qkv_big = make_tensor(randn(big.qkv_numel()), DType::kF32, Device::cuda(0), big.qkv_shape(), cuda_stream());
  OwnedTensor out_big(DType::kF32, Device::cuda(0), big.out_shape()), lse_big(DType::kF32, Device::cuda(0), {1, 1, 2});
  EXPECT_THROW(flash_attention_forward(out_big, lse_big, qkv_big, cb, cuda_stream()), Error);  // d > 1024
  cuda_stream().synchronize();
}

}  // namespace
}  // namespace mt
