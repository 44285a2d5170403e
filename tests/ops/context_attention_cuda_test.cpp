// CUDA tests of ops/context_attention.h against the CPU backend on the same (dtype-rounded) random
// inputs: a two-block forward with the LSE merge (out, lse), the backward of each block (dqkv and
// dkv accumulated on top of random values), with global positions in the load-balanced CP order
// or scrambled, a document mask given as a strided column slice, and attention dropout (the
// one-rank mask by global positions and heads); kv_pack / kv_unpack and transpose_blocks
// bit-exact. fp32 (rel. err < 1e-5; the simple kernels) and bf16/fp16 (< 2e-2): head_dim 64/128
// run the tensor-core kernels (with the backward's workspace; without it the simple ones), other
// head dims the simple ones; GQA and MHA, ragged sizes (sq, sk not multiples of the tiles), tiles
// skipped by position (ordered keys) and partly masked. The deterministic backward
// (ContextAttentionConfig::deterministic: dQ by its own kernel) gives the same bits on every run,
// matches the CPU, and equals the atomic path within rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "ops/context_attention.h"
#include "ops/elementwise.h"
#include "parallel/context_parallel.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;

struct Case {
  int64_t sq, sk, b, g, qpg, d;
  DType t;
  float p = 0.f;         // attention dropout
  bool ordered = false;  // keys at positions 0 .. sk-1 and queries at the end of them (tiles skipped)
  bool workspace = true;
  bool deterministic = false;
};

struct Out {
  std::vector<float> out, lse, dqkv, dkv;
};

Out run(const Case& z, Device dev, const Stream& st, const std::vector<float>& hq, const std::vector<float>& hkv,
        const std::vector<float>& hdo, const std::vector<float>& hdq0, const std::vector<float>& hdkv0,
        const std::vector<int32_t>& qp, const std::vector<int32_t>& kp, const std::vector<int32_t>& doc) {
  const DType t = dev.is_cpu() ? DType::kF32 : z.t;
  const int64_t n = z.g * z.qpg;
  OwnedTensor qkv = testing::make_tensor(hq, t, dev, {z.sq, z.b, z.g, z.qpg + 2, z.d}, st);
  OwnedTensor kv = testing::make_tensor(hkv, t, dev, {z.sk, z.b, z.g, 2, z.d}, st);
  OwnedTensor dout = testing::make_tensor(hdo, t, dev, {z.sq, z.b, n, z.d}, st);
  OwnedTensor dqkv = testing::make_tensor(hdq0, t, dev, {z.sq, z.b, z.g, z.qpg + 2, z.d}, st);
  OwnedTensor dkv = testing::make_tensor(hdkv0, t, dev, {z.sk, z.b, z.g, 2, z.d}, st);
  OwnedTensor q_pos = testing::make_int_tensor(qp, dev, {z.sq}, st);
  OwnedTensor k_pos = testing::make_int_tensor(kp, dev, {z.sk}, st);
  OwnedTensor docs = testing::make_int_tensor(doc, dev, {z.b, z.sq + 3}, st);
  OwnedTensor out(t, dev, {z.sq, z.b, n, z.d}), lse(DType::kF32, dev, {z.sq, z.b, n});
  testing::poison(out, st);
  testing::poison(lse, st);
  ContextAttentionConfig c;
  c.batch = z.b;
  c.groups = z.g;
  c.queries_per_group = z.qpg;
  c.head_dim = z.d;
  c.softmax_scale = 1.f / std::sqrt(static_cast<float>(z.d));
  c.q_pos = q_pos.t;
  c.doc_start = docs.t.slice(1, 3, 3 + z.sq);  // strided rows
  c.dropout_p = z.p;
  c.dropout_key = DropoutKey{1234567, 5, 3, 8};
  c.seq_length = 2 * z.sq + z.sk;  // the positions below are < max(2·sq, sk) (ordered: < sq + sk)
  c.head_offset = n;                        // the heads of TP rank 1 of 3
  c.total_heads = 3 * n;
  c.deterministic = z.deterministic;
  const int64_t h = z.sk / 2;
  ContextAttentionConfig c1 = c, c2 = c;
  c1.k_pos = k_pos.t.flat_range(0, h);
  c2.k_pos = k_pos.t.flat_range(h, z.sk - h);
  context_attention_forward(out, lse, qkv, kv.t.slice0(0, h), c1, false, st);
  context_attention_forward(out, lse, qkv, kv.t.slice0(h, z.sk), c2, true, st);
  OwnedTensor ws;
  if (z.workspace)
    ws = OwnedTensor(DType::kU8, dev, {static_cast<int64_t>(context_attention_workspace_bytes(c, z.sq))});
  context_attention_backward(dqkv, dkv.t.slice0(0, h), dout, out, lse, qkv, kv.t.slice0(0, h), ws.t, c1, st);
  context_attention_backward(dqkv, dkv.t.slice0(h, z.sk), dout, out, lse, qkv, kv.t.slice0(h, z.sk), ws.t, c2, st);
  std::vector<float> l = testing::to_host(lse, st);
  for (float& x : l)
    if (x == -INFINITY) x = 0.f;  // rows with no visible key (on both backends, else a mismatch)
  return {testing::to_host(out, st), l, testing::to_host(dqkv, st), testing::to_host(dkv, st)};
}

/// The inputs of one case: random values rounded to its dtype; queries at the positions of CP rank 1
/// of 2 over a sequence of 2·sq (sq even) or consecutive ones; keys at every position below 2·sq in
/// an order mixing blocks (or in order); document starts per sample.
struct Inputs {
  std::vector<float> hq, hkv, hdo, hdq0, hdkv0;
  std::vector<int32_t> qp, kp, doc;
};
Inputs make_inputs(const Case& z) {
  const int64_t n = z.g * z.qpg;
  auto r = [&](int64_t k) { return testing::rounded(testing::randn(k), z.t); };
  Inputs in{r(z.sq * z.b * z.g * (z.qpg + 2) * z.d), r(z.sk * z.b * z.g * 2 * z.d), r(z.sq * z.b * n * z.d),
            r(z.sq * z.b * z.g * (z.qpg + 2) * z.d), r(z.sk * z.b * z.g * 2 * z.d), std::vector<int32_t>(z.sq),
            std::vector<int32_t>(z.sk), std::vector<int32_t>(z.b * (z.sq + 3), 0)};
  for (int64_t i = 0; i < z.sq; ++i)
    in.qp[i] = static_cast<int32_t>(z.ordered ? z.sk / 2 + i
                                              : z.sq % 2 == 0 ? cp_global_position(2 * z.sq, 2, 1, i) : z.sq + i);
  for (int64_t j = 0; j < z.sk; ++j) in.kp[j] = static_cast<int32_t>(z.ordered ? j : (j * 5) % z.sk);
  for (int64_t b = 0; b < z.b; ++b)
    for (int64_t i = 0; i < z.sq; ++i)
      in.doc[b * (z.sq + 3) + 3 + i] = b == 0 ? 0 : in.qp[i] / 3 * 3 - (b == 2 ? 6 : 0);
  return in;
}

Out run(const Case& z, Device dev, const Inputs& in) {
  const Stream& st = dev.is_cpu() ? testing::cpu_stream() : testing::cuda_stream();
  return run(z, dev, st, in.hq, in.hkv, in.hdo, in.hdq0, in.hdkv0, in.qp, in.kp, in.doc);
}

/// --deterministic-mode on the tensor cores: dqkv and dkv the same bits on two runs, and against
/// the CPU; against the atomic path dqkv within rounding (dQ sums in another order) and dkv within
/// 1e-3 (the same kernel without its dQ part: normally equal); out / lse untouched by the flag.
TEST(ContextAttentionCuda, DeterministicBackwardBitwise) {
  const DType bf = DType::kBF16, hf = DType::kF16;
  for (Case z : {Case{77, 130, 2, 2, 4, 64, bf}, Case{200, 300, 1, 2, 2, 64, bf, 0.f, true},
                 Case{130, 77, 2, 3, 1, 128, bf}, Case{96, 250, 1, 1, 4, 128, hf, 0.f, true},
                 Case{150, 222, 2, 2, 2, 64, hf, 0.2f}, Case{64, 190, 1, 2, 2, 128, bf, 0.1f, true},
                 Case{256, 256, 1, 1, 2, 64, bf, 0.f, true}, Case{8, 16, 2, 2, 2, 16, DType::kF32, 0.2f}}) {
    SCOPED_TRACE(::testing::Message() << "sq=" << z.sq << " sk=" << z.sk << " b=" << z.b << " g=" << z.g
                                      << " qpg=" << z.qpg << " d=" << z.d << " " << dtype_name(z.t) << " p=" << z.p);
    const Inputs in = make_inputs(z);
    const Out cpu = run(z, Device::cpu(), in);
    const Out atomic = run(z, Device::cuda(0), in);
    z.deterministic = true;
    const Out d1 = run(z, Device::cuda(0), in), d2 = run(z, Device::cuda(0), in);
    ASSERT_TRUE(testing::all_finite(d1.dqkv) && testing::all_finite(d1.dkv));
    EXPECT_EQ(d1.dqkv, d2.dqkv);
    EXPECT_EQ(d1.dkv, d2.dkv);
    EXPECT_EQ(d1.out, atomic.out);
    EXPECT_EQ(d1.lse, atomic.lse);
    const double tol = z.t == DType::kF32 ? 1e-5 : 2e-2;
    EXPECT_LT(testing::rel_err(d1.dqkv, cpu.dqkv), tol);
    EXPECT_LT(testing::rel_err(d1.dkv, cpu.dkv), tol);
    EXPECT_LT(testing::rel_err(d1.dqkv, atomic.dqkv), z.t == DType::kF32 ? 1e-6 : 5e-3);
    EXPECT_LT(testing::rel_err(d1.dkv, atomic.dkv), 1e-3);
  }
}

TEST(ContextAttentionCuda, MatchesCpu) {
  const DType bf = DType::kBF16, hf = DType::kF16;
  for (const Case& z : {Case{8, 16, 2, 2, 2, 16, DType::kF32}, Case{7, 13, 1, 3, 1, 8, DType::kF32},
                        Case{32, 64, 2, 2, 4, 64, bf}, Case{16, 32, 3, 4, 1, 128, bf},
                        // attention dropout (the one-rank mask by global positions and heads)
                        Case{8, 16, 2, 2, 2, 16, DType::kF32, 0.2f}, Case{7, 13, 1, 3, 1, 8, DType::kF32, 0.5f},
                        Case{32, 64, 2, 2, 4, 64, bf, 0.1f},
                        // tensor cores: ragged sizes, several tiles, GQA, fp16, ordered keys, dropout
                        Case{77, 130, 2, 2, 4, 64, bf}, Case{200, 300, 1, 2, 2, 64, bf, 0.f, true},
                        Case{130, 77, 2, 3, 1, 128, bf}, Case{96, 250, 1, 1, 4, 128, hf, 0.f, true},
                        Case{150, 222, 2, 2, 2, 64, hf, 0.2f}, Case{64, 190, 1, 2, 2, 128, bf, 0.1f, true},
                        Case{256, 256, 1, 1, 2, 64, bf, 0.f, true},
                        // bf16 d = 64 without the backward's workspace: the simple kernels
                        Case{40, 70, 2, 2, 2, 64, bf, 0.1f, false, false}, Case{33, 50, 1, 2, 1, 96, bf}}) {
    const int64_t n = z.g * z.qpg;
    auto r = [&](int64_t k) { return testing::rounded(testing::randn(k), z.t); };
    const auto hq = r(z.sq * z.b * z.g * (z.qpg + 2) * z.d), hkv = r(z.sk * z.b * z.g * 2 * z.d),
               hdo = r(z.sq * z.b * n * z.d), hdq0 = r(z.sq * z.b * z.g * (z.qpg + 2) * z.d),
               hdkv0 = r(z.sk * z.b * z.g * 2 * z.d);
    // Queries: positions of CP rank 1 of 2 over a sequence of 2·sq (sq even) or consecutive ones;
    // keys: every position below 2·sq in an order mixing blocks.
    std::vector<int32_t> qp(z.sq), kp(z.sk), doc(z.b * (z.sq + 3), 0);
    for (int64_t i = 0; i < z.sq; ++i)
      qp[i] = static_cast<int32_t>(z.ordered ? z.sk / 2 + i
                                             : z.sq % 2 == 0 ? cp_global_position(2 * z.sq, 2, 1, i) : z.sq + i);
    for (int64_t j = 0; j < z.sk; ++j) kp[j] = static_cast<int32_t>(z.ordered ? j : (j * 5) % z.sk);
    for (int64_t b = 0; b < z.b; ++b)
      for (int64_t i = 0; i < z.sq; ++i) doc[b * (z.sq + 3) + 3 + i] = b == 0 ? 0 : qp[i] / 3 * 3 - (b == 2 ? 6 : 0);
    const Out cpu = run(z, Device::cpu(), testing::cpu_stream(), hq, hkv, hdo, hdq0, hdkv0, qp, kp, doc);
    const Out gpu = run(z, Device::cuda(0), testing::cuda_stream(), hq, hkv, hdo, hdq0, hdkv0, qp, kp, doc);
    const double tol = z.t == DType::kF32 ? 1e-5 : 2e-2;
    SCOPED_TRACE(::testing::Message() << "sq=" << z.sq << " sk=" << z.sk << " b=" << z.b << " g=" << z.g
                                      << " qpg=" << z.qpg << " d=" << z.d << " " << dtype_name(z.t));
    ASSERT_TRUE(testing::all_finite(gpu.out) && testing::all_finite(gpu.dqkv) && testing::all_finite(gpu.dkv));
    EXPECT_LT(testing::rel_err(gpu.out, cpu.out), tol) << "out d=" << z.d << " p=" << z.p;
    EXPECT_LT(testing::rel_err(gpu.lse, cpu.lse), tol) << "lse d=" << z.d << " p=" << z.p;
    EXPECT_LT(testing::rel_err(gpu.dqkv, cpu.dqkv), tol) << "dqkv d=" << z.d << " p=" << z.p;
    EXPECT_LT(testing::rel_err(gpu.dkv, cpu.dkv), tol) << "dkv d=" << z.d << " p=" << z.p;
  }
}

TEST(ContextAttentionCuda, PackUnpackTransposeExact) {
  const int64_t R = 37, qpg = 3, d = 8;
  const auto h = testing::randn(R * (qpg + 2) * d);
  for (Device dev : {Device::cpu(), Device::cuda(0)}) {
    const Stream& st = dev.is_cpu() ? testing::cpu_stream() : testing::cuda_stream();
    OwnedTensor qkv = testing::make_tensor(h, DType::kF32, dev, {R, qpg + 2, d}, st);
    OwnedTensor kv(DType::kF32, dev, {R, 2, d}), back = testing::make_tensor(h, DType::kF32, dev, {R, qpg + 2, d}, st);
    kv_pack(kv, qkv, qpg, st);
    const auto hk = testing::to_host(kv, st);
    for (int64_t i = 0; i < R; ++i)
      for (int64_t e = 0; e < 2 * d; ++e) ASSERT_EQ(hk[i * 2 * d + e], h[(i * (qpg + 2) + qpg) * d + e]);
    fill(back.t.view({R * (qpg + 2) * d}), 0.f, st);
    kv_unpack(back, kv, qpg, st);
    const auto hb = testing::to_host(back, st);
    for (int64_t i = 0; i < R; ++i)
      for (int64_t w = 0; w < qpg + 2; ++w)
        for (int64_t e = 0; e < d; ++e)
          ASSERT_EQ(hb[(i * (qpg + 2) + w) * d + e], w < qpg ? 0.f : h[(i * (qpg + 2) + w) * d + e]);
    OwnedTensor y(DType::kF32, dev, {R * (qpg + 2) * d});
    transpose_blocks(y, qkv, R, qpg + 2, st);  // [R, w, d] -> [w, R, d]
    const auto hy = testing::to_host(y, st);
    for (int64_t i = 0; i < R; ++i)
      for (int64_t w = 0; w < qpg + 2; ++w)
        for (int64_t e = 0; e < d; ++e) ASSERT_EQ(hy[(w * R + i) * d + e], h[(i * (qpg + 2) + w) * d + e]);
  }
}

}  // namespace
}  // namespace mt
