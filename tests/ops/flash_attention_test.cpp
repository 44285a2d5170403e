// CPU tests of ops/flash_attention.h: forward (out and LSE) against a float64 naive reference
// (multi-head, grouped-query and multi-query; with and without dropout and a document mask),
// backward against central finite differences of that reference in float64, equality with the
// unfused op (ops/attention.h: same dropout masks), invariance under a tensor-parallel split of
// the query groups (bitwise), the document-mask worked example, and the documented errors.
#include <gtest/gtest.h>

#include <cmath>

#include "core/rng.h"
#include "ops/attention.h"
#include "ops/attention_test_util.h"
#include "ops/flash_attention.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::cpu_stream;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::poison;
using testing::randn;
using testing::rel_err;
using testing::to_host;

/// s, b, g key/value heads, qpg queries per group, d.
struct Dims {
  int64_t s, b, g, qpg, d;
  int64_t n() const { return g * qpg; }
  std::vector<int64_t> qkv_shape() const { return {s, b, g, qpg + 2, d}; }
  std::vector<int64_t> out_shape() const { return {s, b, n(), d}; }
  int64_t qkv_numel() const { return s * b * g * (qpg + 2) * d; }
  int64_t out_numel() const { return s * b * n() * d; }
  std::string str() const { return fmt::format("s={} b={} g={} qpg={} d={}", s, b, g, qpg, d); }
};

FlashAttentionConfig make_cfg(Dims z, float p, uint64_t seed) {
  FlashAttentionConfig c;
  c.seq = z.s;
  c.batch = z.b;
  c.groups = z.g;
  c.queries_per_group = z.qpg;
  c.head_dim = z.d;
  c.softmax_scale = 1.f / std::sqrt(static_cast<float>(z.d));
  c.dropout_p = p;
  c.dropout_key = DropoutKey{seed, 17, 3, 5};
  return c;
}

/// The header's mask, written out independently of the implementation.
bool ref_keep(const FlashAttentionConfig& c, uint64_t g) {
  const Philox4 r = dropout_bits4(c.dropout_key.seed, c.dropout_key.stream_id, c.dropout_key.iteration,
                                  c.dropout_key.microbatch, g >> 2);
  return r.v[g & 3] >= dropout_threshold(c.dropout_p);
}

struct RefFwd {
  std::vector<double> out, lse;
};

/// float64 naive attention on qkv [s, b, g, qpg + 2, d]: out [s, b, n, d], lse [b, n, s].
RefFwd ref_forward(const std::vector<double>& qkv, const FlashAttentionConfig& c, const std::vector<int32_t>& doc) {
  const int64_t s = c.seq, B = c.batch, G = c.groups, qpg = c.queries_per_group, n = G * qpg, d = c.head_dim;
  const int64_t total = c.total_heads > 0 ? c.total_heads : n;
  RefFwd r{std::vector<double>(s * B * n * d, 0.0), std::vector<double>(B * n * s, 0.0)};
  auto at = [&](int64_t i, int64_t b, int64_t grp, int64_t w, int64_t e) {
    return qkv[(((i * B + b) * G + grp) * (qpg + 2) + w) * d + e];
  };
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < n; ++h) {
      const int64_t grp = h / qpg, qi = h % qpg;
      for (int64_t i = 0; i < s; ++i) {
        const int64_t j0 = doc.empty() ? 0 : doc[b * s + i];
        std::vector<double> sc(i + 1);
        double mx = -INFINITY;
        for (int64_t j = j0; j <= i; ++j) {
          double acc = 0;
          for (int64_t e = 0; e < d; ++e) acc += at(i, b, grp, qi, e) * at(j, b, grp, qpg, e);
          sc[j] = c.softmax_scale * acc;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (int64_t j = j0; j <= i; ++j) sum += std::exp(sc[j] - mx);
        r.lse[(b * n + h) * s + i] = mx + std::log(sum);
        const uint64_t g0 = static_cast<uint64_t>(((b * total + c.head_offset + h) * s + i) * s);
        for (int64_t j = j0; j <= i; ++j) {
          double p = std::exp(sc[j] - mx) / sum;
          if (c.dropout_p > 0) p = ref_keep(c, g0 + j) ? p / (1.0 - c.dropout_p) : 0.0;
          for (int64_t e = 0; e < d; ++e) r.out[((i * B + b) * n + h) * d + e] += p * at(j, b, grp, qpg + 1, e);
        }
      }
    }
  }
  return r;
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

/// Random document starts (ops/attention.h); s >= 4.
std::vector<int32_t> random_doc_start(int64_t s, int64_t b) { return testing::random_doc_start(s, b, 4); }

/// Outputs of one CPU forward + backward (outputs poisoned first).
struct FaRun {
  std::vector<float> out, lse, dqkv;
};
FaRun run_cpu(Dims z, const FlashAttentionConfig& cfg, const std::vector<float>& hqkv, const std::vector<float>& hg) {
  const Stream& st = cpu_stream();
  auto qkv = make_tensor(hqkv, DType::kF32, Device::cpu(), z.qkv_shape(), st);
  auto dout = make_tensor(hg, DType::kF32, Device::cpu(), z.out_shape(), st);
  OwnedTensor out(DType::kF32, Device::cpu(), z.out_shape()), lse(DType::kF32, Device::cpu(), {z.b, z.n(), z.s});
  OwnedTensor dqkv(DType::kF32, Device::cpu(), z.qkv_shape());
  OwnedTensor ws(DType::kU8, Device::cpu(), {static_cast<int64_t>(flash_attention_workspace_bytes(cfg))});
  poison(out, st);
  poison(lse, st);
  poison(dqkv, st);
  flash_attention_forward(out, lse, qkv, cfg, st);
  flash_attention_backward(dqkv, dout, out, lse, qkv, ws, cfg, st);
  return {to_host(out, st), to_host(lse, st), to_host(dqkv, st)};
}

void check_forward(Dims z, float p, bool docs = false, int64_t head_offset = 0, int64_t total_heads = 0) {
  const Stream& st = cpu_stream();
  auto cfg = make_cfg(z, p, testing::test_seed());
  cfg.head_offset = head_offset;
  cfg.total_heads = total_heads;
  const std::vector<int32_t> hdoc = docs ? random_doc_start(z.s, z.b) : std::vector<int32_t>{};
  OwnedTensor doc;
  if (docs) {
    doc = testing::make_int_tensor(hdoc, Device::cpu(), {z.b, z.s}, st);
    cfg.doc_start = doc.t;
  }
  const auto hqkv = randn(z.qkv_numel());
  auto qkv = make_tensor(hqkv, DType::kF32, Device::cpu(), z.qkv_shape(), st);
  OwnedTensor out(DType::kF32, Device::cpu(), z.out_shape()), lse(DType::kF32, Device::cpu(), {z.b, z.n(), z.s});
  poison(out, st);
  poison(lse, st);
  flash_attention_forward(out, lse, qkv, cfg, st);
  const auto ref = ref_forward(to_double(hqkv), cfg, hdoc);
  const std::string what =
      fmt::format("{} p={} docs={} head_offset={} total_heads={}", z.str(), p, docs, head_offset, total_heads);
  EXPECT_LT(rel_err(to_host(out, st), ref.out), 1e-5) << what;
  EXPECT_LT(rel_err(to_host(lse, st), ref.lse), 1e-5) << what;
}

TEST(FlashAttention, ForwardMatchesReference) {
  for (float p : {0.f, 0.25f}) {
    check_forward({7, 2, 3, 1, 4}, p);    // multi-head
    check_forward({16, 1, 2, 1, 8}, p);
    check_forward({33, 2, 1, 1, 5}, p);
    check_forward({9, 2, 2, 3, 4}, p);    // grouped-query
    check_forward({12, 1, 1, 4, 6}, p);   // multi-query
  }
  check_forward({9, 2, 2, 2, 4}, 0.5f, false, 4, 8);  // heads 4..7 of 8 (a tensor-parallel shard)
}

TEST(FlashAttention, DocumentMaskForwardMatchesReference) {
  for (float p : {0.f, 0.25f}) {
    check_forward({7, 2, 3, 1, 4}, p, true);
    check_forward({33, 3, 1, 1, 5}, p, true);
    check_forward({12, 2, 2, 3, 5}, p, true);
  }
  check_forward({9, 2, 1, 3, 4}, 0.5f, true, 1, 5);
}

/// Backward vs central finite differences of L = sum(out · G) through the float64 reference.
void check_backward_fd(Dims z, float p, bool docs = false) {
  auto cfg = make_cfg(z, p, testing::test_seed() + 1);
  const std::vector<int32_t> hdoc = docs ? random_doc_start(z.s, z.b) : std::vector<int32_t>{};
  OwnedTensor doc;
  if (docs) {
    doc = testing::make_int_tensor(hdoc, Device::cpu(), {z.b, z.s}, cpu_stream());
    cfg.doc_start = doc.t;
  }
  const auto hqkv = randn(z.qkv_numel()), hg = randn(z.out_numel());
  const FaRun got = run_cpu(z, cfg, hqkv, hg);
  std::vector<double> x = to_double(hqkv);
  auto loss = [&]() {
    const auto r = ref_forward(x, cfg, hdoc);
    double l = 0;
    for (int64_t i = 0; i < z.out_numel(); ++i) l += r.out[i] * hg[i];
    return l;
  };
  std::vector<double> fd(z.qkv_numel());
  for (int64_t i = 0; i < z.qkv_numel(); ++i) fd[i] = testing::finite_diff(loss, x, i, 1e-6);
  // float64 central differences (eps 1e-6) are accurate to ~1e-9 here, so the error is the fp32
  // rounding of the implementation under test.
  EXPECT_LT(rel_err(got.dqkv, fd), 1e-5) << z.str() << " p=" << p << " docs=" << docs;
}

TEST(FlashAttention, BackwardFiniteDifferences) {
  check_backward_fd({5, 2, 2, 1, 3}, 0.f);
  check_backward_fd({5, 2, 2, 1, 3}, 0.4f);
  check_backward_fd({9, 1, 3, 1, 4}, 0.2f);
}

TEST(FlashAttention, GroupedQueryBackwardFiniteDifferences) {
  check_backward_fd({5, 2, 2, 2, 3}, 0.f);
  check_backward_fd({5, 2, 2, 2, 3}, 0.4f);
  check_backward_fd({6, 1, 1, 3, 2}, 0.2f, true);  // multi-query with documents
}

TEST(FlashAttention, DocumentMaskBackwardFiniteDifferences) {
  check_backward_fd({6, 2, 2, 1, 3}, 0.f, true);
  check_backward_fd({6, 2, 2, 1, 3}, 0.4f, true);
  check_backward_fd({9, 1, 2, 2, 4}, 0.2f, true);
}

/// The fused op computes the unfused op's function (ops/attention.h), dropout masks included.
TEST(FlashAttention, MatchesUnfusedAttention) {
  const Stream& st = cpu_stream();
  for (bool docs : {false, true}) {
    const Dims z{23, 2, 2, 3, 8};
    auto cfg = make_cfg(z, 0.3f, testing::test_seed() + 2);
    cfg.head_offset = 6;
    cfg.total_heads = 18;
    const std::vector<int32_t> hdoc = random_doc_start(z.s, z.b);
    auto doc = testing::make_int_tensor(hdoc, Device::cpu(), {z.b, z.s}, st);
    if (docs) cfg.doc_start = doc.t;
    const auto hqkv = randn(z.qkv_numel()), hg = randn(z.out_numel());
    const FaRun flash = run_cpu(z, cfg, hqkv, hg);

    AttentionConfig ac;
    ac.seq = z.s;
    ac.batch = z.b;
    ac.heads = z.n();
    ac.groups = z.g;
    ac.head_dim = z.d;
    ac.softmax_scale = cfg.softmax_scale;
    ac.dropout_p = cfg.dropout_p;
    ac.dropout_key = cfg.dropout_key;
    ac.head_offset = cfg.head_offset;
    ac.total_heads = cfg.total_heads;
    ac.doc_start = cfg.doc_start;
    testing::AttnBufs buf({z.s, z.b, z.n(), z.d, z.g}, DType::kF32, Device::cpu());
    auto qkv = make_tensor(hqkv, DType::kF32, Device::cpu(), z.qkv_shape(), st);
    auto dout = make_tensor(hg, DType::kF32, Device::cpu(), z.out_shape(), st);
    OwnedTensor out(DType::kF32, Device::cpu(), z.out_shape()), dqkv(DType::kF32, Device::cpu(), z.qkv_shape());
    attention_forward(out, qkv, buf.view(), ac, st);
    attention_backward(dqkv, dout, buf.view(), ac, st);
    EXPECT_LT(rel_err(flash.out, to_host(out, st)), 1e-5) << "docs=" << docs;
    EXPECT_LT(rel_err(flash.dqkv, to_host(dqkv, st)), 1e-5) << "docs=" << docs;
  }
}

/// Splitting the query groups over two tensor-parallel ranks (head_offset, total_heads) gives the
/// same outputs and gradients, bit for bit: the dropout mask follows the global head index.
TEST(FlashAttention, TensorParallelSplitIsBitwiseInvariant) {
  const Dims z{17, 2, 4, 2, 4}, half{17, 2, 2, 2, 4};
  const auto cfg = make_cfg(z, 0.3f, testing::test_seed() + 5);
  const auto hqkv = randn(z.qkv_numel()), hg = randn(z.out_numel());
  const FaRun full = run_cpu(z, cfg, hqkv, hg);
  const int64_t wq = (z.qpg + 2) * z.d, wo = z.qpg * z.d;  // per group: qkv and out elements
  for (int64_t r = 0; r < 2; ++r) {
    auto c = make_cfg(half, 0.3f, testing::test_seed() + 5);
    c.head_offset = r * half.n();
    c.total_heads = z.n();
    std::vector<float> q, g;  // this rank's groups r·2 .. r·2 + 1 of every (position, sample)
    for (int64_t sb = 0; sb < z.s * z.b; ++sb) {
      q.insert(q.end(), hqkv.begin() + (sb * z.g + r * half.g) * wq, hqkv.begin() + (sb * z.g + (r + 1) * half.g) * wq);
      g.insert(g.end(), hg.begin() + (sb * z.g + r * half.g) * wo, hg.begin() + (sb * z.g + (r + 1) * half.g) * wo);
    }
    const FaRun part = run_cpu(half, c, q, g);
    for (int64_t sb = 0; sb < z.s * z.b; ++sb) {
      for (int64_t e = 0; e < half.g * wo; ++e)
        ASSERT_EQ(part.out[sb * half.g * wo + e], full.out[(sb * z.g + r * half.g) * wo + e]) << "rank " << r;
      for (int64_t e = 0; e < half.g * wq; ++e)
        ASSERT_EQ(part.dqkv[sb * half.g * wq + e], full.dqkv[(sb * z.g + r * half.g) * wq + e]) << "rank " << r;
    }
    for (int64_t b = 0; b < z.b; ++b)
      for (int64_t h = 0; h < half.n(); ++h)
        for (int64_t i = 0; i < z.s; ++i)
          ASSERT_EQ(part.lse[(b * half.n() + h) * z.s + i], full.lse[(b * z.n() + r * half.n() + h) * z.s + i]);
  }
}

/// ops/attention.h's worked example (tokens A B C EOD D E F EOD G H): gradients do not cross
/// document boundaries, and an all-zero doc_start is plain causal, bit for bit.
TEST(FlashAttention, DocumentMaskWorkedExample) {
  const Stream& st = cpu_stream();
  const Dims z{10, 1, 2, 2, 4};
  const std::vector<int32_t> hdoc{0, 0, 0, 0, 4, 4, 4, 4, 8, 8};
  auto doc = testing::make_int_tensor(hdoc, Device::cpu(), {1, 10}, st);
  auto zeros = testing::make_int_tensor(std::vector<int32_t>(10, 0), Device::cpu(), {1, 10}, st);
  for (float p : {0.f, 0.3f}) {
    auto cfg = make_cfg(z, p, testing::test_seed() + 3);
    const auto hqkv = randn(z.qkv_numel());
    auto hg = randn(z.out_numel());
    const FaRun plain = run_cpu(z, cfg, hqkv, hg);
    auto zc = cfg;
    zc.doc_start = zeros.t;
    const FaRun one_doc = run_cpu(z, zc, hqkv, hg);
    EXPECT_EQ(one_doc.out, plain.out) << "p=" << p;
    EXPECT_EQ(one_doc.lse, plain.lse) << "p=" << p;
    EXPECT_EQ(one_doc.dqkv, plain.dqkv) << "p=" << p;
    // dout only on the second document (positions 4..7): every other gradient is exactly zero.
    for (int64_t i = 0; i < z.s; ++i)
      if (i < 4 || i > 7)
        for (int64_t c = 0; c < z.n() * z.d; ++c) hg[i * z.n() * z.d + c] = 0.f;
    cfg.doc_start = doc.t;
    const FaRun r = run_cpu(z, cfg, hqkv, hg);
    const int64_t per_pos = z.g * (z.qpg + 2) * z.d;
    for (int64_t i = 0; i < z.s; ++i) {
      double norm = 0;
      for (int64_t c = 0; c < per_pos; ++c) {
        const float v = r.dqkv[i * per_pos + c];
        norm += static_cast<double>(v) * v;
        if (i < 4 || i > 7) ASSERT_EQ(v, 0.f) << "p=" << p << " position " << i << " component " << c;
      }
      if (i >= 4 && i <= 7) EXPECT_GT(norm, 0.0) << "p=" << p << " position " << i;
    }
    // D (position 4) and G (position 8) see only themselves: lse = their own scaled score.
    for (int64_t h = 0; h < z.n(); ++h) {
      for (int64_t i : {4, 8}) {
        const int64_t grp = h / z.qpg, qi = h % z.qpg;
        double acc = 0;
        for (int64_t e = 0; e < z.d; ++e)
          acc += static_cast<double>(hqkv[(i * z.g + grp) * (z.qpg + 2) * z.d + qi * z.d + e]) *
                 hqkv[(i * z.g + grp) * (z.qpg + 2) * z.d + z.qpg * z.d + e];
        EXPECT_NEAR(r.lse[h * z.s + i], cfg.softmax_scale * acc, 1e-5) << "h=" << h << " i=" << i;
      }
    }
  }
}

TEST(FlashAttention, WorkspaceBytes) {
  auto c = make_cfg({100, 3, 2, 4, 64}, 0.f, 1);
  const size_t rows = 3 * 8 * 100;
  EXPECT_EQ(flash_attention_workspace_bytes(c), (rows * 4 + 255) / 256 * 256 + rows * 64 * 4);
}

TEST(FlashAttention, Errors) {
  const Stream& st = cpu_stream();
  const Dims z{6, 2, 2, 2, 4};
  const auto good = make_cfg(z, 0.1f, 1);
  auto qkv = make_tensor(randn(z.qkv_numel()), DType::kF32, Device::cpu(), z.qkv_shape(), st);
  auto dout = make_tensor(randn(z.out_numel()), DType::kF32, Device::cpu(), z.out_shape(), st);
  OwnedTensor out(DType::kF32, Device::cpu(), z.out_shape()), lse(DType::kF32, Device::cpu(), {z.b, z.n(), z.s});
  OwnedTensor dqkv(DType::kF32, Device::cpu(), z.qkv_shape());
  const auto wsb = static_cast<int64_t>(flash_attention_workspace_bytes(good));
  OwnedTensor ws(DType::kU8, Device::cpu(), {wsb + 16});
  auto fwd = [&](const FlashAttentionConfig& c, const Tensor& o, const Tensor& l, const Tensor& x) {
    flash_attention_forward(o, l, x, c, st);
  };
  auto bwd = [&](const FlashAttentionConfig& c, const Tensor& w, const Tensor& dx = Tensor()) {
    flash_attention_backward(dx.empty() ? dqkv.t : dx, dout, out, lse, qkv, w, c, st);
  };
  EXPECT_NO_THROW(fwd(good, out, lse, qkv));
  EXPECT_NO_THROW(bwd(good, ws));
  // Flat [s, b, ...] views are accepted too.
  EXPECT_NO_THROW(fwd(good, out->view({z.s, z.b, z.n() * z.d}), lse->view({z.b * z.n() * z.s}),
                      qkv->view({z.s, z.b, z.g * (z.qpg + 2) * z.d})));
  auto bad = [&](auto mutate) {
    auto c = good;
    mutate(c);
    EXPECT_THROW(fwd(c, out, lse, qkv), Error);
    EXPECT_THROW(bwd(c, ws), Error);
  };
  bad([](auto& c) { c.seq = 0; });
  bad([](auto& c) { c.groups = 0; });
  bad([](auto& c) { c.queries_per_group = 0; });
  bad([](auto& c) { c.head_dim = -1; });
  bad([](auto& c) { c.softmax_scale = 0.f; });
  bad([](auto& c) { c.softmax_scale = -0.5f; });
  bad([](auto& c) { c.softmax_scale = NAN; });
  bad([](auto& c) { c.dropout_p = 1.f; });
  bad([](auto& c) { c.dropout_p = -0.1f; });
  bad([](auto& c) { c.head_offset = 1; });  // 1 + 4 > 4
  bad([](auto& c) { c.total_heads = 3; });
  bad([](auto& c) { c.queries_per_group = 1; });  // qkv/out shapes no longer match
  bad([](auto& c) { c.batch = 1; });
  // Tensors: shapes, dtypes, missing.
  OwnedTensor out_bad(DType::kF32, Device::cpu(), {z.s, z.b, z.n(), z.d + 1});
  OwnedTensor lse_bad(DType::kF32, Device::cpu(), {z.b, z.n(), z.s + 1});
  OwnedTensor qkv_bf16(DType::kBF16, Device::cpu(), z.qkv_shape()), out_bf16(DType::kBF16, Device::cpu(), z.out_shape());
  OwnedTensor qkv_3(DType::kF32, Device::cpu(), {z.s, z.b, z.g, 3, z.d});
  EXPECT_THROW(fwd(good, out_bad, lse, qkv), Error);
  EXPECT_THROW(fwd(good, out, lse_bad, qkv), Error);
  EXPECT_THROW(fwd(good, out, lse, qkv_3), Error);
  EXPECT_THROW(fwd(good, out_bf16, lse, qkv_bf16), Error);  // CPU is fp32 only
  EXPECT_THROW(fwd(good, out, Tensor(), qkv), Error);
  EXPECT_THROW(fwd(good, Tensor(), lse, qkv), Error);
  EXPECT_THROW(bwd(good, ws, out), Error);  // dqkv with the out shape
  // Workspace: too small, misaligned.
  OwnedTensor small(DType::kU8, Device::cpu(), {wsb - 1});
  EXPECT_THROW(bwd(good, small), Error);
  EXPECT_THROW(bwd(good, ws->flat_range(4, wsb)), Error);
  EXPECT_THROW(bwd(good, Tensor()), Error);
  // doc_start: shape, dtype, values.
  auto with_doc = [&](const Tensor& d) {
    auto c = good;
    c.doc_start = d;
    return c;
  };
  auto doc_ok = testing::make_int_tensor({0, 1, 1, 3, 3, 3, 0, 0, 0, 0, 4, 5}, Device::cpu(), {z.b, z.s}, st);
  EXPECT_NO_THROW(fwd(with_doc(doc_ok), out, lse, qkv));
  EXPECT_NO_THROW(bwd(with_doc(doc_ok), ws));
  auto doc_shape = testing::make_int_tensor(std::vector<int32_t>(z.b * z.s, 0), Device::cpu(), {z.s, z.b}, st);
  auto doc_f32 = make_tensor(std::vector<float>(z.b * z.s, 0.f), DType::kF32, Device::cpu(), {z.b, z.s}, st);
  auto doc_late = testing::make_int_tensor({0, 2, 1, 3, 3, 3, 0, 0, 0, 0, 4, 5}, Device::cpu(), {z.b, z.s}, st);
  auto doc_neg = testing::make_int_tensor({0, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0}, Device::cpu(), {z.b, z.s}, st);
  for (const OwnedTensor* d : {&doc_shape, &doc_f32, &doc_late, &doc_neg}) {
    EXPECT_THROW(fwd(with_doc(*d), out, lse, qkv), Error);
    EXPECT_THROW(bwd(with_doc(*d), ws), Error);
  }
}

}  // namespace
}  // namespace mt
