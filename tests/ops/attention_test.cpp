// CPU tests of ops/attention.h: forward against a float64 naive reference (with and without
// dropout, with and without a document mask), backward against central finite differences of that
// reference, dropout-mask layout invariance over a head split (tensor parallelism), the document
// mask's exact zeros (worked example of the header), and the documented errors.
#include <gtest/gtest.h>

#include <cmath>

#include "core/rng.h"
#include "data/masks.h"
#include "ops/attention.h"
#include "ops/attention_test_util.h"
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

using Dims = testing::AttnDims;
using Bufs = testing::AttnBufs;

AttentionConfig make_cfg(Dims z, float p, uint64_t seed) {
  AttentionConfig c;
  c.seq = z.s;
  c.batch = z.b;
  c.heads = z.n;
  c.groups = z.g;
  c.head_dim = z.d;
  c.softmax_scale = 1.f / std::sqrt(static_cast<float>(z.d));
  c.dropout_p = p;
  c.dropout_key = DropoutKey{seed, 17, 3, 5};
  return c;
}

/// The header's mask, written out independently of the implementation.
bool ref_keep(const AttentionConfig& c, uint64_t g) {
  Philox4 r = dropout_bits4(c.dropout_key.seed, c.dropout_key.stream_id, c.dropout_key.iteration,
                            c.dropout_key.microbatch, g >> 2);
  return r.v[g & 3] >= dropout_threshold(c.dropout_p);
}

struct RefFwd {
  std::vector<double> out, probs, dropped;
};

/// Random document starts doc_start [b, s] (ops/attention.h): in every sample but the last (which,
/// for b > 1, is one document = plain causal) each position starts a new document with
/// probability 1/4, plus a document of length 1 in the middle and one at the last position.
/// Needs s >= 4.
std::vector<int32_t> random_doc_start(int64_t s, int64_t b) { return testing::random_doc_start(s, b, 4); }

/// float64 naive attention: qkv [s, b, g, qpg + 2, d] -> out [s, b, n, d], probs/dropped [b, n, s, s];
/// query head h reads component h % qpg of group h / qpg, key and value components qpg, qpg + 1.
/// doc: doc_start [b, s] or empty (plain causal); query i of sample b sees keys doc[b, i] .. i.
RefFwd ref_forward(const std::vector<double>& qkv, const AttentionConfig& c, const std::vector<int32_t>& doc = {}) {
  const int64_t s = c.seq, B = c.batch, n = c.heads, d = c.head_dim;
  const int64_t total = c.total_heads > 0 ? c.total_heads : n;
  RefFwd r{std::vector<double>(s * B * n * d, 0.0), std::vector<double>(B * n * s * s, 0.0),
           std::vector<double>(B * n * s * s, 0.0)};
  const int64_t g = c.groups > 0 ? c.groups : n, qpg = n / g;
  // w: 0 query, 1 key, 2 value of query head h.
  auto at = [&](int64_t i, int64_t b, int64_t h, int64_t w, int64_t e) {
    const int64_t comp = w == 0 ? h % qpg : qpg + w - 1;
    return qkv[(((i * B + b) * g + h / qpg) * (qpg + 2) + comp) * d + e];
  };
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < n; ++h) {
      for (int64_t i = 0; i < s; ++i) {
        const int64_t j0 = doc.empty() ? 0 : doc[b * s + i];
        std::vector<double> sc(i + 1);
        double mx = -INFINITY;
        for (int64_t j = j0; j <= i; ++j) {
          double acc = 0;
          for (int64_t e = 0; e < d; ++e) acc += at(i, b, h, 0, e) * at(j, b, h, 1, e);
          sc[j] = c.softmax_scale * acc;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (int64_t j = j0; j <= i; ++j) sum += std::exp(sc[j] - mx);
        const int64_t row = ((b * n + h) * s + i) * s;
        const uint64_t g0 = static_cast<uint64_t>(((b * total + c.head_offset + h) * s + i) * s);
        for (int64_t j = j0; j <= i; ++j) {
          const double p = std::exp(sc[j] - mx) / sum;
          r.probs[row + j] = p;
          r.dropped[row + j] = c.dropout_p > 0 ? (ref_keep(c, g0 + j) ? p / (1.0 - c.dropout_p) : 0.0) : p;
        }
        for (int64_t e = 0; e < d; ++e) {
          double acc = 0;
          for (int64_t j = j0; j <= i; ++j) acc += r.dropped[row + j] * at(j, b, h, 2, e);
          r.out[((i * B + b) * n + h) * d + e] = acc;
        }
      }
    }
  }
  return r;
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

void check_forward(Dims z, float p, int64_t head_offset = 0, int64_t total_heads = 0, bool docs = false) {
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
  auto hqkv = randn(z.qkv_numel());
  auto qkv = make_tensor(hqkv, DType::kF32, Device::cpu(), z.qkv_shape(), st);
  OwnedTensor out(DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d});
  Bufs buf(z, DType::kF32, Device::cpu());
  buf.poison_all(st);
  poison(out, st);
  attention_forward(out, qkv, buf.view(), cfg, st);
  auto ref = ref_forward(to_double(hqkv), cfg, hdoc);
  const std::string what =
      fmt::format("s={} b={} n={} g={} d={} p={} head_offset={} total_heads={} docs={}", z.s, z.b, z.n, z.groups(),
                  z.d, p, head_offset, total_heads, docs);
  EXPECT_LT(rel_err(to_host(out, st), ref.out), 1e-5) << what;
  EXPECT_LT(rel_err(to_host(buf.probs, st), ref.probs), 1e-5) << what;
  if (p > 0) {
    EXPECT_LT(rel_err(to_host(buf.scratch, st), ref.dropped), 1e-5) << what;
  }
  // Masked probabilities are exactly zero (the reference has exact zeros there).
  auto hp = to_host(buf.probs, st);
  for (size_t e = 0; e < hp.size(); ++e) {
    if (ref.probs[e] == 0.0) ASSERT_EQ(hp[e], 0.f) << what << " element " << e;
  }
  // q [b, n, s, d], k, v [b, g, s, d] are the head-major copies of qkv [s, b, g, qpg + 2, d].
  auto hq = to_host(buf.q, st), hk = to_host(buf.k, st), hv = to_host(buf.v, st);
  const int64_t G = z.groups(), qpg = z.n / G;
  for (int64_t b = 0; b < z.b; ++b)
    for (int64_t gi = 0; gi < G; ++gi)
      for (int64_t i = 0; i < z.s; ++i)
        for (int64_t e = 0; e < z.d; ++e) {
          const int64_t src = (((i * z.b + b) * G + gi) * (qpg + 2)) * z.d + e;
          for (int64_t c = 0; c < qpg; ++c)
            ASSERT_EQ(hq[((b * z.n + gi * qpg + c) * z.s + i) * z.d + e], hqkv[src + c * z.d]);
          ASSERT_EQ(hk[((b * G + gi) * z.s + i) * z.d + e], hqkv[src + qpg * z.d]);
          ASSERT_EQ(hv[((b * G + gi) * z.s + i) * z.d + e], hqkv[src + (qpg + 1) * z.d]);
        }
}

TEST(Attention, ForwardMatchesReference) {
  for (float p : {0.f, 0.25f}) {
    check_forward({7, 2, 3, 4}, p);
    check_forward({16, 1, 2, 8}, p);
    check_forward({33, 2, 1, 5}, p);
  }
  check_forward({9, 2, 3, 4}, 0.5f, 1, 5);  // heads 1..3 of 5 (a tensor-parallel shard)
}

// Grouped-query (g < n) and multi-query (g = 1) attention.
TEST(Attention, GroupedQueryForwardMatchesReference) {
  for (float p : {0.f, 0.25f}) {
    check_forward({7, 2, 4, 4, 2}, p);
    check_forward({9, 1, 6, 3, 1}, p);
    check_forward({12, 2, 6, 5, 3}, p, 0, 0, true);
  }
  check_forward({9, 2, 4, 4, 2}, 0.5f, 4, 8);  // heads 4..7 of 8, groups 2..3 of 4
}

TEST(Attention, DocumentMaskForwardMatchesReference) {
  for (float p : {0.f, 0.25f}) {
    check_forward({7, 2, 3, 4}, p, 0, 0, true);
    check_forward({16, 1, 2, 8}, p, 0, 0, true);
    check_forward({33, 3, 1, 5}, p, 0, 0, true);
  }
  check_forward({9, 2, 3, 4}, 0.5f, 1, 5, true);
}

TEST(Attention, DropoutDropsAndScales) {
  const Stream& st = cpu_stream();
  const Dims z{64, 2, 2, 8};
  const float p = 0.3f;
  auto cfg = make_cfg(z, p, testing::test_seed());
  auto qkv = make_tensor(randn(z.s * z.b * z.n * 3 * z.d), DType::kF32, Device::cpu(), {z.s, z.b, z.n, 3, z.d}, st);
  OwnedTensor out(DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d});
  Bufs buf(z, DType::kF32, Device::cpu());
  attention_forward(out, qkv, buf.view(), cfg, st);
  auto probs = to_host(buf.probs, st), dropped = to_host(buf.scratch, st);
  int64_t total = 0, zeros = 0;
  for (int64_t r = 0; r < z.b * z.n * z.s; ++r) {
    const int64_t i = r % z.s;
    for (int64_t j = 0; j < z.s; ++j) {
      const float pr = probs[r * z.s + j], dr = dropped[r * z.s + j];
      if (j > i) {
        ASSERT_EQ(pr, 0.f);
        ASSERT_EQ(dr, 0.f);
        continue;
      }
      ++total;
      if (dr == 0.f) {
        ++zeros;
      } else {
        ASSERT_NEAR(dr, pr / (1.f - p), 1e-6f * std::fabs(dr));
      }
    }
  }
  EXPECT_NEAR(static_cast<double>(zeros) / total, p, 0.03);  // 4160 draws: 3 sigma ~ 0.021
}

/// Backward vs central finite differences of L = sum(out · G) through the float64 reference.
void check_backward_fd(Dims z, float p, bool docs = false) {
  const Stream& st = cpu_stream();
  auto cfg = make_cfg(z, p, testing::test_seed() + 1);
  const std::vector<int32_t> hdoc = docs ? random_doc_start(z.s, z.b) : std::vector<int32_t>{};
  OwnedTensor doc;
  if (docs) {
    doc = testing::make_int_tensor(hdoc, Device::cpu(), {z.b, z.s}, st);
    cfg.doc_start = doc.t;
  }
  const int64_t nqkv = z.qkv_numel(), nout = z.s * z.b * z.n * z.d;
  auto hqkv = randn(nqkv), hg = randn(nout);
  auto qkv = make_tensor(hqkv, DType::kF32, Device::cpu(), z.qkv_shape(), st);
  auto dout = make_tensor(hg, DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d}, st);
  OwnedTensor out(DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d});
  OwnedTensor dqkv(DType::kF32, Device::cpu(), z.qkv_shape());
  Bufs buf(z, DType::kF32, Device::cpu());
  attention_forward(out, qkv, buf.view(), cfg, st);
  poison(buf.scratch, st);  // backward must not depend on the forward's scratch
  poison(buf.dq, st);
  poison(buf.dk, st);
  poison(buf.dv, st);
  poison(dqkv, st);
  attention_backward(dqkv, dout, buf.view(), cfg, st);
  auto got = to_host(dqkv, st);

  std::vector<double> x = to_double(hqkv);
  auto loss = [&]() {
    auto r = ref_forward(x, cfg, hdoc);
    double l = 0;
    for (int64_t i = 0; i < nout; ++i) l += r.out[i] * hg[i];
    return l;
  };
  std::vector<double> fd(nqkv);
  for (int64_t i = 0; i < nqkv; ++i) fd[i] = testing::finite_diff(loss, x, i, 1e-6);
  // float64 central differences (eps 1e-6) are accurate to ~1e-9 here, so the error is the fp32
  // rounding of the implementation under test (observed ~1e-7).
  EXPECT_LT(rel_err(got, fd), 1e-5) << "s=" << z.s << " b=" << z.b << " n=" << z.n << " g=" << z.groups()
                                    << " d=" << z.d << " p=" << p << " docs=" << docs;
}

TEST(Attention, GroupedQueryBackwardFiniteDifferences) {
  check_backward_fd({5, 2, 4, 3, 2}, 0.f);
  check_backward_fd({5, 2, 4, 3, 2}, 0.4f);
  check_backward_fd({6, 1, 3, 2, 1}, 0.2f, true);
}

TEST(Attention, BackwardFiniteDifferences) {
  check_backward_fd({5, 2, 2, 3}, 0.f);
  check_backward_fd({5, 2, 2, 3}, 0.4f);
  check_backward_fd({9, 1, 3, 4}, 0.2f);
}

TEST(Attention, DocumentMaskBackwardFiniteDifferences) {
  check_backward_fd({6, 2, 2, 3}, 0.f, true);
  check_backward_fd({6, 2, 2, 3}, 0.4f, true);
  check_backward_fd({9, 1, 3, 4}, 0.2f, true);
}

/// The worked example of ops/attention.h: tokens A B C EOD D E F EOD G H, doc_start from the data
/// pipeline (data/masks.h). Probabilities (and dropped probabilities) are exactly zero where
/// masked and positive elsewhere; gradients do not cross document boundaries.
TEST(Attention, DocumentMaskWorkedExample) {
  const Stream& st = cpu_stream();
  const std::vector<int32_t> tokens{1, 2, 3, 0, 4, 5, 6, 0, 7, 8};  // EOD = 0
  data::LtorOptions opt;
  opt.eod = 0;
  opt.reset_attention_mask = true;
  std::vector<int32_t> hdoc(tokens.size(), -1);
  data::get_ltor_masks_and_position_ids(tokens.data(), 1, 10, opt, nullptr, nullptr, hdoc.data());
  ASSERT_EQ(hdoc, (std::vector<int32_t>{0, 0, 0, 0, 4, 4, 4, 4, 8, 8}));
  const std::vector<uint8_t> dense = data::dense_attention_mask(hdoc.data(), 10);
  const Dims z{10, 1, 2, 4};
  auto doc = testing::make_int_tensor(hdoc, Device::cpu(), {1, 10}, st);
  for (float p : {0.f, 0.3f}) {
    auto cfg = make_cfg(z, p, testing::test_seed() + 3);
    cfg.doc_start = doc.t;
    auto qkv = make_tensor(randn(z.s * z.b * z.n * 3 * z.d), DType::kF32, Device::cpu(), {z.s, z.b, z.n, 3, z.d}, st);
    OwnedTensor out(DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d});
    OwnedTensor dqkv(DType::kF32, Device::cpu(), {z.s, z.b, z.n, 3, z.d});
    Bufs buf(z, DType::kF32, Device::cpu());
    buf.poison_all(st);
    attention_forward(out, qkv, buf.view(), cfg, st);
    const auto probs = to_host(buf.probs, st), dropped = to_host(buf.scratch, st);
    for (int64_t h = 0; h < z.n; ++h) {
      for (int64_t i = 0; i < z.s; ++i) {
        double sum = 0;
        for (int64_t j = 0; j < z.s; ++j) {
          const int64_t e = (h * z.s + i) * z.s + j;
          const bool visible = j >= hdoc[i] && j <= i;
          ASSERT_EQ(visible, dense[i * z.s + j] != 0) << "i=" << i << " j=" << j;
          if (visible) {
            EXPECT_GT(probs[e], 0.f) << "p=" << p << " h=" << h << " i=" << i << " j=" << j;
          } else {
            EXPECT_EQ(probs[e], 0.f) << "p=" << p << " h=" << h << " i=" << i << " j=" << j;
            if (p > 0) EXPECT_EQ(dropped[e], 0.f) << "p=" << p << " h=" << h << " i=" << i << " j=" << j;
          }
          sum += probs[e];
        }
        EXPECT_NEAR(sum, 1.0, 1e-6) << "i=" << i;
      }
      EXPECT_EQ(probs[(h * z.s + 4) * z.s + 4], 1.f);  // D sees only itself
      EXPECT_EQ(probs[(h * z.s + 8) * z.s + 8], 1.f);  // so does G
    }
    // dout only on the second document (D E F EOD, positions 4..7): every gradient outside it
    // is exactly zero, and dS (scratch after the backward) is zero wherever masked.
    std::vector<float> hg = randn(z.s * z.b * z.n * z.d);
    for (int64_t i = 0; i < z.s; ++i)
      if (i < 4 || i > 7)
        for (int64_t c = 0; c < z.n * z.d; ++c) hg[i * z.n * z.d + c] = 0.f;
    auto dout = make_tensor(hg, DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d}, st);
    poison(dqkv, st);
    poison(buf.scratch, st);
    attention_backward(dqkv, dout, buf.view(), cfg, st);
    const auto g = to_host(dqkv, st), ds = to_host(buf.scratch, st);
    const int64_t per_pos = z.n * 3 * z.d;
    for (int64_t i = 0; i < z.s; ++i) {
      double norm = 0;
      for (int64_t c = 0; c < per_pos; ++c) {
        const float v = g[i * per_pos + c];
        norm += static_cast<double>(v) * v;
        if (i < 4 || i > 7) ASSERT_EQ(v, 0.f) << "p=" << p << " position " << i << " component " << c;
      }
      if (i >= 4 && i <= 7) EXPECT_GT(norm, 0.0) << "p=" << p << " position " << i;
    }
    for (int64_t h = 0; h < z.n; ++h)
      for (int64_t i = 0; i < z.s; ++i)
        for (int64_t j = 0; j < z.s; ++j)
          if (j < hdoc[i] || j > i) ASSERT_EQ(ds[(h * z.s + i) * z.s + j], 0.f) << "dS i=" << i << " j=" << j;
  }
}

/// Outputs of one forward + backward.
struct RunResult {
  std::vector<float> out, probs, dropped, dqkv;
};
RunResult run_fwd_bwd(Dims z, const AttentionConfig& cfg, const std::vector<float>& hqkv, const std::vector<float>& hg) {
  const Stream& st = cpu_stream();
  auto qkv = make_tensor(hqkv, DType::kF32, Device::cpu(), {z.s, z.b, z.n, 3, z.d}, st);
  auto dout = make_tensor(hg, DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d}, st);
  OwnedTensor out(DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d});
  OwnedTensor dqkv(DType::kF32, Device::cpu(), {z.s, z.b, z.n, 3, z.d});
  Bufs buf(z, DType::kF32, Device::cpu());
  buf.poison_all(st);
  poison(out, st);
  poison(dqkv, st);
  RunResult r;
  attention_forward(out, qkv, buf.view(), cfg, st);
  r.out = to_host(out, st);
  r.probs = to_host(buf.probs, st);
  r.dropped = cfg.dropout_p > 0 ? to_host(buf.scratch, st) : std::vector<float>{};
  attention_backward(dqkv, dout, buf.view(), cfg, st);
  r.dqkv = to_host(dqkv, st);
  return r;
}

/// Elements of sample bi of a [s, b, rest] or (bn_layout) [b, rest] host tensor.
std::vector<float> sample_slice(const std::vector<float>& v, Dims z, int64_t bi, bool bn_layout) {
  const int64_t rest = static_cast<int64_t>(v.size()) / (bn_layout ? z.b : z.s * z.b);
  std::vector<float> r;
  if (bn_layout) return {v.begin() + bi * rest, v.begin() + (bi + 1) * rest};
  for (int64_t i = 0; i < z.s; ++i) r.insert(r.end(), v.begin() + (i * z.b + bi) * rest, v.begin() + (i * z.b + bi + 1) * rest);
  return r;
}

/// A sample with one document is plain causal, bit for bit (forward, dropout, backward).
TEST(Attention, DocumentMaskOneDocumentIsCausalBitwise) {
  const Stream& st = cpu_stream();
  const Dims z{13, 3, 2, 4};
  for (float p : {0.f, 0.3f}) {
    auto cfg = make_cfg(z, p, testing::test_seed() + 4);
    const auto hqkv = randn(z.s * z.b * z.n * 3 * z.d), hg = randn(z.s * z.b * z.n * z.d);
    const RunResult plain = run_fwd_bwd(z, cfg, hqkv, hg);
    // All samples one document: identical to no mask.
    auto zeros = testing::make_int_tensor(std::vector<int32_t>(z.b * z.s, 0), Device::cpu(), {z.b, z.s}, st);
    auto zc = cfg;
    zc.doc_start = zeros.t;
    const RunResult all_one = run_fwd_bwd(z, zc, hqkv, hg);
    EXPECT_EQ(all_one.out, plain.out) << "p=" << p;
    EXPECT_EQ(all_one.probs, plain.probs) << "p=" << p;
    EXPECT_EQ(all_one.dropped, plain.dropped) << "p=" << p;
    EXPECT_EQ(all_one.dqkv, plain.dqkv) << "p=" << p;
    // Random documents in samples 0, 1; sample 2 is one document: its slices equal plain causal.
    const auto hdoc = random_doc_start(z.s, z.b);
    auto doc = testing::make_int_tensor(hdoc, Device::cpu(), {z.b, z.s}, st);
    auto dc = cfg;
    dc.doc_start = doc.t;
    const RunResult mixed = run_fwd_bwd(z, dc, hqkv, hg);
    const int64_t last = z.b - 1;
    EXPECT_EQ(sample_slice(mixed.out, z, last, false), sample_slice(plain.out, z, last, false)) << "p=" << p;
    EXPECT_EQ(sample_slice(mixed.probs, z, last, true), sample_slice(plain.probs, z, last, true)) << "p=" << p;
    EXPECT_EQ(sample_slice(mixed.dqkv, z, last, false), sample_slice(plain.dqkv, z, last, false)) << "p=" << p;
    if (p > 0) {
      EXPECT_EQ(sample_slice(mixed.dropped, z, last, true), sample_slice(plain.dropped, z, last, true)) << "p=" << p;
    }
    // ... and sample 0 (several documents) differs.
    EXPECT_NE(sample_slice(mixed.out, z, 0, false), sample_slice(plain.out, z, 0, false)) << "p=" << p;
  }
}

/// Extracts heads [h0, h0 + nh) of a [s, b, n, w, d] host tensor.
std::vector<float> head_slice(const std::vector<float>& full, Dims z, int64_t w, int64_t h0, int64_t nh) {
  std::vector<float> out;
  for (int64_t i = 0; i < z.s; ++i)
    for (int64_t b = 0; b < z.b; ++b)
      for (int64_t h = h0; h < h0 + nh; ++h)
        for (int64_t c = 0; c < w * z.d; ++c) out.push_back(full[(((i * z.b + b) * z.n + h) * w) * z.d + c]);
  return out;
}
/// Extracts heads [h0, h0 + nh) of a [b, n, rest] host tensor.
std::vector<float> head_slice_bn(const std::vector<float>& full, Dims z, int64_t rest, int64_t h0, int64_t nh) {
  std::vector<float> out;
  for (int64_t b = 0; b < z.b; ++b)
    for (int64_t h = h0; h < h0 + nh; ++h)
      for (int64_t c = 0; c < rest; ++c) out.push_back(full[(b * z.n + h) * rest + c]);
  return out;
}

TEST(Attention, DropoutLayoutInvariantOverHeadSplit) {
  const Stream& st = cpu_stream();
  const Dims z{11, 2, 4, 5};
  const float p = 0.3f;
  auto cfg = make_cfg(z, p, testing::test_seed() + 2);
  auto hqkv = randn(z.s * z.b * z.n * 3 * z.d), hg = randn(z.s * z.b * z.n * z.d);
  auto qkv = make_tensor(hqkv, DType::kF32, Device::cpu(), {z.s, z.b, z.n, 3, z.d}, st);
  auto dout = make_tensor(hg, DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d}, st);
  OwnedTensor out(DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d}), dqkv(DType::kF32, Device::cpu(), {z.s, z.b, z.n, 3, z.d});
  Bufs buf(z, DType::kF32, Device::cpu());
  attention_forward(out, qkv, buf.view(), cfg, st);
  auto full_dropped = to_host(buf.scratch, st);
  attention_backward(dqkv, dout, buf.view(), cfg, st);
  auto full_out = to_host(out, st), full_probs = to_host(buf.probs, st), full_dqkv = to_host(dqkv, st);

  const int64_t nh = z.n / 2;
  const Dims hz{z.s, z.b, nh, z.d};
  for (int64_t part = 0; part < 2; ++part) {
    const int64_t h0 = part * nh;
    AttentionConfig pc = cfg;
    pc.heads = nh;
    pc.head_offset = h0;
    pc.total_heads = z.n;
    auto pqkv = make_tensor(head_slice(hqkv, z, 3, h0, nh), DType::kF32, Device::cpu(), {z.s, z.b, nh, 3, z.d}, st);
    auto pdout = make_tensor(head_slice(hg, z, 1, h0, nh), DType::kF32, Device::cpu(), {z.s, z.b, nh * z.d}, st);
    OwnedTensor pout(DType::kF32, Device::cpu(), {z.s, z.b, nh * z.d}), pdqkv(DType::kF32, Device::cpu(), {z.s, z.b, nh, 3, z.d});
    Bufs pb(hz, DType::kF32, Device::cpu());
    attention_forward(pout, pqkv, pb.view(), pc, st);
    EXPECT_EQ(to_host(pb.scratch, st), head_slice_bn(full_dropped, z, z.s * z.s, h0, nh)) << "part " << part;
    EXPECT_EQ(to_host(pb.probs, st), head_slice_bn(full_probs, z, z.s * z.s, h0, nh)) << "part " << part;
    EXPECT_EQ(to_host(pout, st), head_slice(full_out, z, 1, h0, nh)) << "part " << part;
    attention_backward(pdqkv, pdout, pb.view(), pc, st);
    EXPECT_EQ(to_host(pdqkv, st), head_slice(full_dqkv, z, 3, h0, nh)) << "part " << part;
  }
}

TEST(Attention, Errors) {
  const Stream& st = cpu_stream();
  const Dims z{6, 2, 2, 4};
  auto cfg = make_cfg(z, 0.1f, 1);
  OwnedTensor qkv(DType::kF32, Device::cpu(), {z.s, z.b, z.n, 3, z.d}), out(DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d});
  OwnedTensor qkv_flat(DType::kF32, Device::cpu(), {z.s, z.b, 3 * z.n * z.d});
  OwnedTensor bad_qkv(DType::kF32, Device::cpu(), {z.s, z.b, z.n, 2, z.d}), bad_out(DType::kF32, Device::cpu(), {z.s, z.b + 1, z.n * z.d});
  auto hq = randn(qkv->numel());
  testing::upload(qkv, hq, st);
  testing::upload(qkv_flat, hq, st);
  Bufs buf(z, DType::kF32, Device::cpu());
  EXPECT_NO_THROW(attention_forward(out, qkv, buf.view(), cfg, st));
  EXPECT_NO_THROW(attention_forward(out, qkv_flat, buf.view(), cfg, st));
  EXPECT_NO_THROW(attention_backward(qkv, out, buf.view(), cfg, st));
  EXPECT_THROW(attention_forward(out, bad_qkv, buf.view(), cfg, st), Error);
  EXPECT_THROW(attention_forward(bad_out, qkv, buf.view(), cfg, st), Error);
  EXPECT_THROW(attention_backward(bad_qkv, out, buf.view(), cfg, st), Error);
  auto bad = cfg;
  bad.dropout_p = 1.f;
  EXPECT_THROW(attention_forward(out, qkv, buf.view(), bad, st), Error);
  bad = cfg;
  bad.dropout_p = -0.1f;
  EXPECT_THROW(attention_forward(out, qkv, buf.view(), bad, st), Error);
  bad = cfg;
  bad.total_heads = 3;
  bad.head_offset = 2;  // heads 2..3 of 3
  EXPECT_THROW(attention_forward(out, qkv, buf.view(), bad, st), Error);
  bad = cfg;
  bad.head_dim = 0;
  EXPECT_THROW(attention_forward(out, qkv, buf.view(), bad, st), Error);
  bad = cfg;
  bad.softmax_scale = 0.f;
  EXPECT_THROW(attention_forward(out, qkv, buf.view(), bad, st), Error);
  bad.softmax_scale = -0.5f;  // as the fused ops (ops/attention_checks.h): finite and > 0
  EXPECT_THROW(attention_forward(out, qkv, buf.view(), bad, st), Error);
  bad = cfg;
  bad.groups = 3;  // does not divide the 2 heads
  EXPECT_THROW(attention_forward(out, qkv, buf.view(), bad, st), Error);
  AttentionBuffers v = buf.view();
  v.scratch = Tensor();  // needed for dropout
  EXPECT_THROW(attention_forward(out, qkv, v, cfg, st), Error);
  auto no_drop = cfg;
  no_drop.dropout_p = 0.f;
  EXPECT_NO_THROW(attention_forward(out, qkv, v, no_drop, st));
  EXPECT_THROW(attention_backward(qkv, out, v, no_drop, st), Error);  // backward always needs scratch
  v = buf.view();
  v.probs = v.probs.flat_range(0, v.probs.numel() - 1);
  EXPECT_THROW(attention_forward(out, qkv, v, cfg, st), Error);
  OwnedTensor qkv_bf16(DType::kBF16, Device::cpu(), {z.s, z.b, z.n, 3, z.d});
  EXPECT_THROW(attention_forward(out, qkv_bf16, buf.view(), cfg, st), Error);  // dtype mismatch
  OwnedTensor out_bf16(DType::kBF16, Device::cpu(), {z.s, z.b, z.n * z.d});
  Bufs hbuf(z, DType::kBF16, Device::cpu());
  EXPECT_THROW(attention_forward(out_bf16, qkv_bf16, hbuf.view(), cfg, st), Error);  // CPU is fp32-only
}

TEST(Attention, DocumentMaskErrors) {
  const Stream& st = cpu_stream();
  const Dims z{6, 2, 2, 4};
  auto cfg = make_cfg(z, 0.1f, 1);
  OwnedTensor qkv(DType::kF32, Device::cpu(), {z.s, z.b, z.n, 3, z.d}), out(DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d});
  testing::upload(qkv, randn(qkv->numel()), st);
  Bufs buf(z, DType::kF32, Device::cpu());
  const std::vector<int32_t> good{0, 0, 2, 2, 2, 5, /* sample 1 */ 0, 1, 1, 3, 3, 3};
  auto run = [&](const Tensor& doc) {
    auto c = cfg;
    c.doc_start = doc;
    attention_forward(out, qkv, buf.view(), c, st);
  };
  auto run_bwd = [&](const Tensor& doc) {
    auto c = cfg;
    c.doc_start = doc;
    attention_backward(qkv, out, buf.view(), c, st);
  };
  auto ok = testing::make_int_tensor(good, Device::cpu(), {z.b, z.s}, st);
  EXPECT_NO_THROW(run(ok));
  EXPECT_NO_THROW(run_bwd(ok));
  // Shape: [s, b], [b, s + 1], flat [b·s].
  EXPECT_THROW(run(testing::make_int_tensor(good, Device::cpu(), {z.s, z.b}, st)), Error);
  EXPECT_THROW(run(testing::make_int_tensor(std::vector<int32_t>(z.b * (z.s + 1), 0), Device::cpu(), {z.b, z.s + 1}, st)),
               Error);
  EXPECT_THROW(run(testing::make_int_tensor(good, Device::cpu(), {z.b * z.s}, st)), Error);
  EXPECT_THROW(run_bwd(testing::make_int_tensor(good, Device::cpu(), {z.s, z.b}, st)), Error);
  // Dtype: fp32 and int64.
  EXPECT_THROW(run(make_tensor(std::vector<float>(z.b * z.s, 0.f), DType::kF32, Device::cpu(), {z.b, z.s}, st)), Error);
  OwnedTensor i64(DType::kI64, Device::cpu(), {z.b, z.s});
  EXPECT_THROW(run(i64), Error);
  // Values: doc_start[b, i] > i and < 0, forward and backward.
  auto bad = good;
  bad[6 + 1] = 2;  // doc_start[1, 1] = 2 > 1
  EXPECT_THROW(run(testing::make_int_tensor(bad, Device::cpu(), {z.b, z.s}, st)), Error);
  EXPECT_THROW(run_bwd(testing::make_int_tensor(bad, Device::cpu(), {z.b, z.s}, st)), Error);
  bad = good;
  bad[0] = 1;  // doc_start[0, 0] = 1 > 0
  EXPECT_THROW(run(testing::make_int_tensor(bad, Device::cpu(), {z.b, z.s}, st)), Error);
  bad = good;
  bad[3] = -1;
  EXPECT_THROW(run(testing::make_int_tensor(bad, Device::cpu(), {z.b, z.s}, st)), Error);
  EXPECT_THROW(run_bwd(testing::make_int_tensor(bad, Device::cpu(), {z.b, z.s}, st)), Error);
}

}  // namespace
}  // namespace mt
