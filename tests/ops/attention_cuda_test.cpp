// CUDA tests of ops/attention.h against the CPU backend on the same (dtype-rounded) random
// inputs: forward (out, probs, dropped probabilities) and backward (dqkv), with and without
// dropout, with and without a document mask (doc_start), fp32 (rel. err < 1e-5) and bf16/fp16
// (< 2e-2). The dropout masks must be bit-identical on both backends (checked element by element
// on the dropped probabilities); masked probabilities must be exactly zero.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "ops/attention.h"
#include "ops/attention_test_util.h"
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

using Dims = testing::AttnDims;
using Bufs = testing::AttnBufs;

/// Random document starts doc_start [b, s] (ops/attention.h): in every sample but the last (which,
/// for b > 1, is one document) each position starts a document with probability 1/8, plus a
/// document of length 1 in the middle and one at the last position. Needs s >= 4.
std::vector<int32_t> random_doc_start(int64_t s, int64_t b) { return testing::random_doc_start(s, b, 8); }

void check_attention(Dims z, float p, DType t, double tol, int64_t head_offset = 0, int64_t total_heads = 0,
                     bool docs = false) {
  AttentionConfig cfg;
  cfg.seq = z.s;
  cfg.batch = z.b;
  cfg.heads = z.n;
  cfg.groups = z.g;
  cfg.head_dim = z.d;
  cfg.softmax_scale = 1.f / std::sqrt(static_cast<float>(z.d));
  cfg.dropout_p = p;
  cfg.dropout_key = DropoutKey{testing::test_seed(), 1234, 7, 42};
  cfg.head_offset = head_offset;
  cfg.total_heads = total_heads;
  const std::string what = fmt::format("{} s={} b={} n={} d={} p={} head_offset={} total_heads={} docs={}",
                                       dtype_name(t), z.s, z.b, z.n, z.d, p, head_offset, total_heads, docs);
  // doc_start: the same values on both devices (each backend reads its own copy); all zeros
  // (= no restriction beyond causal) when docs is false, so that j0 below is valid either way.
  const std::vector<int32_t> hdoc = docs ? random_doc_start(z.s, z.b) : std::vector<int32_t>(z.b * z.s, 0);
  OwnedTensor cdoc, gdoc;
  AttentionConfig ccfg = cfg, gcfg = cfg;
  if (docs) {
    cdoc = testing::make_int_tensor(hdoc, Device::cpu(), {z.b, z.s}, cpu_stream());
    gdoc = testing::make_int_tensor(hdoc, Device::cuda(0), {z.b, z.s}, cuda_stream());
    ccfg.doc_start = cdoc.t;
    gcfg.doc_start = gdoc.t;
  }
  const std::vector<int64_t> sqkv = z.qkv_shape(), sout{z.s, z.b, z.n * z.d};
  auto hqkv = rounded(randn(z.qkv_numel()), t);
  auto hg = rounded(randn(z.s * z.b * z.n * z.d), t);

  // CPU reference (fp32 on the rounded values).
  auto cqkv = make_tensor(hqkv, DType::kF32, Device::cpu(), sqkv, cpu_stream());
  auto cdout = make_tensor(hg, DType::kF32, Device::cpu(), sout, cpu_stream());
  OwnedTensor cout_(DType::kF32, Device::cpu(), sout), cdqkv(DType::kF32, Device::cpu(), sqkv);
  Bufs cb(z, DType::kF32, Device::cpu());
  attention_forward(cout_, cqkv, cb.view(), ccfg, cpu_stream());
  auto c_dropped = to_host(cb.scratch, cpu_stream());
  attention_backward(cdqkv, cdout, cb.view(), ccfg, cpu_stream());

  // CUDA.
  auto gqkv = make_tensor(hqkv, t, Device::cuda(0), sqkv, cuda_stream());
  auto gdout = make_tensor(hg, t, Device::cuda(0), sout, cuda_stream());
  OwnedTensor gout(t, Device::cuda(0), sout), gdqkv(t, Device::cuda(0), sqkv);
  Bufs gb(z, t, Device::cuda(0));
  gb.poison_all(cuda_stream());
  poison(gout, cuda_stream());
  attention_forward(gout, gqkv, gb.view(), gcfg, cuda_stream());
  EXPECT_LT(rel_err(to_host(gout, cuda_stream()), to_host(cout_, cpu_stream())), tol) << what;
  auto g_probs = to_host(gb.probs, cuda_stream()), c_probs = to_host(cb.probs, cpu_stream());
  EXPECT_LT(rel_err(g_probs, c_probs), tol) << what;
  EXPECT_EQ(to_host(gb.q, cuda_stream()), to_host(cb.q, cpu_stream())) << what;  // pure permutes: exact
  EXPECT_EQ(to_host(gb.v, cuda_stream()), to_host(cb.v, cpu_stream())) << what;
  // Masked probabilities (j < doc_start[b, i] or j > i) are exactly zero on the GPU.
  int64_t nonzero_masked = 0;
  for (int64_t r = 0; r < z.b * z.n * z.s; ++r) {
    const int64_t i = r % z.s, j0 = hdoc[(r / (z.n * z.s)) * z.s + i];
    for (int64_t j = 0; j < z.s; ++j)
      if (j < j0 || j > i) nonzero_masked += g_probs[r * z.s + j] != 0.f;
  }
  EXPECT_EQ(nonzero_masked, 0) << what;
  if (p > 0) {
    auto g_dropped = to_host(gb.scratch, cuda_stream());
    EXPECT_LT(rel_err(g_dropped, c_dropped), tol) << what;
    // Bit-identical masks: an element is dropped on the GPU iff it is dropped on the CPU
    // (probabilities are far from underflow for these inputs, so 0 <=> dropped or masked).
    int64_t mismatches = 0, dropped = 0, unmasked = 0, dropped_masked = 0;
    for (int64_t r = 0; r < z.b * z.n * z.s; ++r) {
      const int64_t i = r % z.s, j0 = hdoc[(r / (z.n * z.s)) * z.s + i];
      for (int64_t j = 0; j < j0; ++j) dropped_masked += g_dropped[r * z.s + j] != 0.f;
      for (int64_t j = j0; j <= i; ++j) {
        const int64_t e = r * z.s + j;
        ASSERT_GT(c_probs[e], 0.f) << what;
        mismatches += (g_dropped[e] == 0.f) != (c_dropped[e] == 0.f);
        dropped += c_dropped[e] == 0.f;
        ++unmasked;
      }
    }
    EXPECT_EQ(mismatches, 0) << what;
    EXPECT_EQ(dropped_masked, 0) << what;
    // Binomial: 5 standard deviations, at least 0.05 (document masks leave few draws per row).
    const double sd = std::sqrt(static_cast<double>(p) * (1.0 - p) / static_cast<double>(unmasked));
    EXPECT_NEAR(static_cast<double>(dropped) / unmasked, p, std::max(0.05, 5.0 * sd)) << what << " draws " << unmasked;
  }

  // Backward: everything but the saved q, k, v, probs is poisoned first.
  for (const OwnedTensor* o : {&gb.scratch, &gb.dq, &gb.dk, &gb.dv, &gdqkv}) poison(*o, cuda_stream());
  attention_backward(gdqkv, gdout, gb.view(), gcfg, cuda_stream());
  auto g_dqkv = to_host(gdqkv, cuda_stream()), c_dqkv = to_host(cdqkv, cpu_stream());
  EXPECT_LT(rel_err(g_dqkv, c_dqkv), tol) << what;
  // Per component (queries, key, value), so that a small one cannot hide behind the others.
  const int64_t W = z.n / z.groups() + 2;
  for (int64_t w = 0; w < 3; ++w) {
    std::vector<float> gw, cw;
    for (int64_t r = 0; r < z.s * z.b * z.groups(); ++r)
      for (int64_t c = 0; c < W; ++c) {
        if ((w == 0 && c >= W - 2) || (w == 1 && c != W - 2) || (w == 2 && c != W - 1)) continue;
        for (int64_t e = 0; e < z.d; ++e) {
          gw.push_back(g_dqkv[(r * W + c) * z.d + e]);
          cw.push_back(c_dqkv[(r * W + c) * z.d + e]);
        }
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

// Grouped-query and multi-query attention.
TEST(AttentionCuda, GroupedQuery) {
  MT_REQUIRE_CUDA();
  for (const Dims& z : {Dims{64, 2, 4, 16, 2}, Dims{37, 1, 6, 24, 1}, Dims{128, 2, 8, 64, 2}}) {
    check_attention(z, 0.f, DType::kF32, 1e-5);
    check_attention(z, 0.1f, DType::kF32, 1e-5, 0, 0, true);
    check_attention(z, 0.1f, DType::kBF16, 2e-2, 0, 0, true);
  }
}

TEST(AttentionCuda, DocumentMaskFp32) {
  MT_REQUIRE_CUDA();
  for (const Dims& z : kSizes) {
    check_attention(z, 0.f, DType::kF32, 1e-5, 0, 0, true);
    check_attention(z, 0.1f, DType::kF32, 1e-5, 0, 0, true);
  }
  check_attention({33, 3, 3, 8}, 0.3f, DType::kF32, 1e-5, 2, 7, true);  // heads 2..4 of 7
}

TEST(AttentionCuda, DocumentMaskBf16) {
  MT_REQUIRE_CUDA();
  for (const Dims& z : kSizes) {
    check_attention(z, 0.f, DType::kBF16, 2e-2, 0, 0, true);
    check_attention(z, 0.1f, DType::kBF16, 2e-2, 0, 0, true);
  }
}

TEST(AttentionCuda, DocumentMaskFp16) {
  MT_REQUIRE_CUDA();
  check_attention({37, 2, 2, 24}, 0.2f, DType::kF16, 2e-2, 0, 0, true);
}

/// On the GPU too, an all-zero doc_start (one document per sample) is plain causal, bit for bit.
TEST(AttentionCuda, DocumentMaskOneDocumentIsCausalBitwise) {
  MT_REQUIRE_CUDA();
  const Dims z{45, 2, 3, 16};
  for (DType t : {DType::kF32, DType::kBF16}) {
    AttentionConfig cfg;
    cfg.seq = z.s;
    cfg.batch = z.b;
    cfg.heads = z.n;
    cfg.head_dim = z.d;
    cfg.softmax_scale = 1.f / std::sqrt(static_cast<float>(z.d));
    cfg.dropout_p = 0.2f;
    cfg.dropout_key = DropoutKey{testing::test_seed(), 99, 1, 3};
    const std::vector<int64_t> sqkv{z.s, z.b, z.n, 3, z.d}, sout{z.s, z.b, z.n * z.d};
    auto qkv = make_tensor(randn(z.s * z.b * z.n * 3 * z.d), t, Device::cuda(0), sqkv, cuda_stream());
    auto dout = make_tensor(randn(z.s * z.b * z.n * z.d), t, Device::cuda(0), sout, cuda_stream());
    auto zeros = testing::make_int_tensor(std::vector<int32_t>(z.b * z.s, 0), Device::cuda(0), {z.b, z.s}, cuda_stream());
    std::vector<std::vector<float>> res[2];
    for (int with_doc = 0; with_doc < 2; ++with_doc) {
      AttentionConfig c = cfg;
      if (with_doc) c.doc_start = zeros.t;
      OwnedTensor out(t, Device::cuda(0), sout), dqkv(t, Device::cuda(0), sqkv);
      Bufs b(z, t, Device::cuda(0));
      b.poison_all(cuda_stream());
      poison(out, cuda_stream());
      poison(dqkv, cuda_stream());
      attention_forward(out, qkv, b.view(), c, cuda_stream());
      res[with_doc].push_back(to_host(out, cuda_stream()));
      res[with_doc].push_back(to_host(b.probs, cuda_stream()));
      res[with_doc].push_back(to_host(b.scratch, cuda_stream()));
      attention_backward(dqkv, dout, b.view(), c, cuda_stream());
      res[with_doc].push_back(to_host(dqkv, cuda_stream()));
    }
    for (size_t k = 0; k < res[0].size(); ++k) EXPECT_EQ(res[1][k], res[0][k]) << dtype_name(t) << " output " << k;
  }
}

/// On CUDA only the shape, dtype and device of doc_start are validated (values are trusted).
TEST(AttentionCuda, DocumentMaskErrors) {
  MT_REQUIRE_CUDA();
  const Dims z{6, 2, 2, 4};
  AttentionConfig cfg;
  cfg.seq = z.s;
  cfg.batch = z.b;
  cfg.heads = z.n;
  cfg.head_dim = z.d;
  cfg.softmax_scale = 0.5f;
  const DType t = DType::kF32;
  auto qkv = make_tensor(randn(z.s * z.b * z.n * 3 * z.d), t, Device::cuda(0), {z.s, z.b, z.n, 3, z.d}, cuda_stream());
  OwnedTensor out(t, Device::cuda(0), {z.s, z.b, z.n * z.d}), dqkv(t, Device::cuda(0), {z.s, z.b, z.n, 3, z.d});
  Bufs b(z, t, Device::cuda(0));
  const std::vector<int32_t> good{0, 0, 2, 2, 2, 5, 0, 1, 1, 3, 3, 3};
  auto fwd = [&](const Tensor& doc) {
    AttentionConfig c = cfg;
    c.doc_start = doc;
    attention_forward(out, qkv, b.view(), c, cuda_stream());
    cuda_stream().synchronize();
  };
  auto bwd = [&](const Tensor& doc) {
    AttentionConfig c = cfg;
    c.doc_start = doc;
    attention_backward(dqkv, out, b.view(), c, cuda_stream());
    cuda_stream().synchronize();
  };
  auto ok = testing::make_int_tensor(good, Device::cuda(0), {z.b, z.s}, cuda_stream());
  EXPECT_NO_THROW(fwd(ok));
  EXPECT_NO_THROW(bwd(ok));
  EXPECT_THROW(fwd(testing::make_int_tensor(good, Device::cuda(0), {z.s, z.b}, cuda_stream())), Error);
  EXPECT_THROW(bwd(testing::make_int_tensor(good, Device::cuda(0), {z.s, z.b}, cuda_stream())), Error);
  EXPECT_THROW(fwd(testing::make_int_tensor(good, Device::cuda(0), {z.b * z.s}, cuda_stream())), Error);
  EXPECT_THROW(fwd(make_tensor(std::vector<float>(z.b * z.s, 0.f), DType::kF32, Device::cuda(0), {z.b, z.s}, cuda_stream())),
               Error);
  EXPECT_THROW(fwd(testing::make_int_tensor(good, Device::cpu(), {z.b, z.s}, cpu_stream())), Error);  // wrong device
  EXPECT_THROW(bwd(testing::make_int_tensor(good, Device::cpu(), {z.b, z.s}, cpu_stream())), Error);
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
