// CPU tests of ops/attention.h: forward against a float64 naive reference (with and without
// dropout), backward against central finite differences of that reference, dropout-mask layout
// invariance over a head split (tensor parallelism), and the documented errors.
#include <gtest/gtest.h>

#include <cmath>

#include "core/rng.h"
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

const Stream& cpu_stream() {
  static Stream s(Device::cpu());
  return s;
}

struct Dims {
  int64_t s, b, n, d;
};

AttentionConfig make_cfg(Dims z, float p, uint64_t seed) {
  AttentionConfig c;
  c.seq = z.s;
  c.batch = z.b;
  c.heads = z.n;
  c.head_dim = z.d;
  c.softmax_scale = 1.f / std::sqrt(static_cast<float>(z.d));
  c.dropout_p = p;
  c.dropout_key = DropoutKey{seed, 17, 3, 5};
  return c;
}

/// The buffers of one call, owned.
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

/// The header's mask, written out independently of the implementation.
bool ref_keep(const AttentionConfig& c, uint64_t g) {
  Philox4 r = dropout_bits4(c.dropout_key.seed, c.dropout_key.stream_id, c.dropout_key.iteration,
                            c.dropout_key.microbatch, g >> 2);
  return r.v[g & 3] >= dropout_threshold(c.dropout_p);
}

struct RefFwd {
  std::vector<double> out, probs, dropped;
};

/// float64 naive attention: qkv [s, b, n, 3, d] -> out [s, b, n, d], probs/dropped [b, n, s, s].
RefFwd ref_forward(const std::vector<double>& qkv, const AttentionConfig& c) {
  const int64_t s = c.seq, B = c.batch, n = c.heads, d = c.head_dim;
  const int64_t total = c.total_heads > 0 ? c.total_heads : n;
  RefFwd r{std::vector<double>(s * B * n * d, 0.0), std::vector<double>(B * n * s * s, 0.0),
           std::vector<double>(B * n * s * s, 0.0)};
  auto at = [&](int64_t i, int64_t b, int64_t h, int64_t w, int64_t e) { return qkv[(((i * B + b) * n + h) * 3 + w) * d + e]; };
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < n; ++h) {
      for (int64_t i = 0; i < s; ++i) {
        std::vector<double> sc(i + 1);
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double acc = 0;
          for (int64_t e = 0; e < d; ++e) acc += at(i, b, h, 0, e) * at(j, b, h, 1, e);
          sc[j] = c.softmax_scale * acc;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(sc[j] - mx);
        const int64_t row = ((b * n + h) * s + i) * s;
        const uint64_t g0 = static_cast<uint64_t>(((b * total + c.head_offset + h) * s + i) * s);
        for (int64_t j = 0; j <= i; ++j) {
          const double p = std::exp(sc[j] - mx) / sum;
          r.probs[row + j] = p;
          r.dropped[row + j] = c.dropout_p > 0 ? (ref_keep(c, g0 + j) ? p / (1.0 - c.dropout_p) : 0.0) : p;
        }
        for (int64_t e = 0; e < d; ++e) {
          double acc = 0;
          for (int64_t j = 0; j <= i; ++j) acc += r.dropped[row + j] * at(j, b, h, 2, e);
          r.out[((i * B + b) * n + h) * d + e] = acc;
        }
      }
    }
  }
  return r;
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

void check_forward(Dims z, float p, int64_t head_offset = 0, int64_t total_heads = 0) {
  const Stream& st = cpu_stream();
  auto cfg = make_cfg(z, p, testing::test_seed());
  cfg.head_offset = head_offset;
  cfg.total_heads = total_heads;
  auto hqkv = randn(z.s * z.b * z.n * 3 * z.d);
  auto qkv = make_tensor(hqkv, DType::kF32, Device::cpu(), {z.s, z.b, z.n, 3, z.d}, st);
  OwnedTensor out(DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d});
  Bufs buf(z, DType::kF32, Device::cpu());
  buf.poison_all(st);
  poison(out, st);
  attention_forward(out, qkv, buf.view(), cfg, st);
  auto ref = ref_forward(to_double(hqkv), cfg);
  const std::string what =
      fmt::format("s={} b={} n={} d={} p={} head_offset={} total_heads={}", z.s, z.b, z.n, z.d, p, head_offset,
                  total_heads);
  EXPECT_LT(rel_err(to_host(out, st), ref.out), 1e-5) << what;
  EXPECT_LT(rel_err(to_host(buf.probs, st), ref.probs), 1e-5) << what;
  if (p > 0) {
    EXPECT_LT(rel_err(to_host(buf.scratch, st), ref.dropped), 1e-5) << what;
  }
  // q, k, v are the head-major copies of qkv.
  auto hq = to_host(buf.q, st), hk = to_host(buf.k, st), hv = to_host(buf.v, st);
  for (int64_t b = 0; b < z.b; ++b)
    for (int64_t h = 0; h < z.n; ++h)
      for (int64_t i = 0; i < z.s; ++i)
        for (int64_t e = 0; e < z.d; ++e) {
          const int64_t src = (((i * z.b + b) * z.n + h) * 3) * z.d + e, dst = ((b * z.n + h) * z.s + i) * z.d + e;
          ASSERT_EQ(hq[dst], hqkv[src]);
          ASSERT_EQ(hk[dst], hqkv[src + z.d]);
          ASSERT_EQ(hv[dst], hqkv[src + 2 * z.d]);
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
void check_backward_fd(Dims z, float p) {
  const Stream& st = cpu_stream();
  auto cfg = make_cfg(z, p, testing::test_seed() + 1);
  const int64_t nqkv = z.s * z.b * z.n * 3 * z.d, nout = z.s * z.b * z.n * z.d;
  auto hqkv = randn(nqkv), hg = randn(nout);
  auto qkv = make_tensor(hqkv, DType::kF32, Device::cpu(), {z.s, z.b, z.n, 3, z.d}, st);
  auto dout = make_tensor(hg, DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d}, st);
  OwnedTensor out(DType::kF32, Device::cpu(), {z.s, z.b, z.n * z.d});
  OwnedTensor dqkv(DType::kF32, Device::cpu(), {z.s, z.b, z.n, 3, z.d});
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
    auto r = ref_forward(x, cfg);
    double l = 0;
    for (int64_t i = 0; i < nout; ++i) l += r.out[i] * hg[i];
    return l;
  };
  std::vector<double> fd(nqkv);
  for (int64_t i = 0; i < nqkv; ++i) fd[i] = testing::finite_diff(loss, x, i, 1e-6);
  // float64 central differences (eps 1e-6) are accurate to ~1e-9 here, so the error is the fp32
  // rounding of the implementation under test (observed ~1e-7).
  EXPECT_LT(rel_err(got, fd), 1e-5) << "s=" << z.s << " b=" << z.b << " n=" << z.n << " d=" << z.d << " p=" << p;
}

TEST(Attention, BackwardFiniteDifferences) {
  check_backward_fd({5, 2, 2, 3}, 0.f);
  check_backward_fd({5, 2, 2, 3}, 0.4f);
  check_backward_fd({9, 1, 3, 4}, 0.2f);
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

}  // namespace
}  // namespace mt
