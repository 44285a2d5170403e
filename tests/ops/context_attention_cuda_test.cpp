// CUDA tests of ops/context_attention.h against the CPU backend on the same (dtype-rounded) random
// inputs: a two-block forward with the LSE merge (out, lse), the backward of each block (dqkv and
// dkv accumulated on top of random values), with global positions in the load-balanced CP order
// or scrambled, with and without a document mask (given as a strided column slice), with and
// without attention dropout (the one-rank mask by global positions and heads); kv_pack / kv_unpack
// and transpose_blocks / permute_blocks bit-exact; cuDNN's fused attention for the ring's plain
// (causal / full) blocks against the FlashAttention-2 kernels. These are the PositionMask instances of the shared kernels
// (ops/cuda/flash_attention_kernels.cuh): every combination of {documents, none} x {dropout, none}
// runs on the tensor cores (bf16/fp16, head_dim 64/128: forward, atomic and deterministic
// backward) and on the simple kernels (fp32, other head dims, misaligned tensors). fp32 rel. err
// < 1e-5, bf16/fp16 < 2e-2; GQA and MHA, ragged sizes (sq, sk not multiples of the tiles), tiles
// skipped by position (ordered keys), partly masked and fully visible. The deterministic backward
// (ContextAttentionConfig::deterministic: dQ by its own kernel) gives the same bits on every run,
// matches the CPU, and equals the atomic path within rounding. Bad arguments on CUDA throw.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "ops/context_attention.h"
#include "ops/cuda/cudnn_attention.h"
#include "ops/elementwise.h"
#include "ops/flash_attention.h"
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
  bool aligned = true;   // false: qkv one element off 16-byte alignment (the simple kernels)
  bool deterministic = false;
  bool docs = true;  // a document mask (sample 0: every row from 0; the others: documents of 3 positions)
};

std::string describe(const Case& z) {
  return fmt::format("sq={} sk={} b={} g={} qpg={} d={} {} p={} ordered={} aligned={} docs={}", z.sq, z.sk, z.b, z.g,
                     z.qpg, z.d, dtype_name(z.t), z.p, z.ordered, z.aligned, z.docs);
}

/// A tensor of `shape` holding `host`; with misalign, a view one element into a larger buffer.
OwnedTensor make_at(const std::vector<float>& host, DType t, Device dev, const std::vector<int64_t>& shape,
                    const Stream& st, bool misalign) {
  if (!misalign) return testing::make_tensor(host, t, dev, shape, st);
  OwnedTensor r(t, dev, {static_cast<int64_t>(host.size()) + 1});
  r.t = r.t.flat_range(1, static_cast<int64_t>(host.size())).view(shape);
  testing::upload(r.t, host, st);
  return r;
}

struct Out {
  std::vector<float> out, lse, dqkv, dkv;
};

Out run(const Case& z, Device dev, const Stream& st, const std::vector<float>& hq, const std::vector<float>& hkv,
        const std::vector<float>& hdo, const std::vector<float>& hdq0, const std::vector<float>& hdkv0,
        const std::vector<int32_t>& qp, const std::vector<int32_t>& kp, const std::vector<int32_t>& doc) {
  const DType t = dev.is_cpu() ? DType::kF32 : z.t;
  const int64_t n = z.g * z.qpg;
  OwnedTensor qkv = make_at(hq, t, dev, {z.sq, z.b, z.g, z.qpg + 2, z.d}, st, !z.aligned && !dev.is_cpu());
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
  if (z.docs) c.doc_start = docs.t.slice(1, 3, 3 + z.sq);  // strided rows
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
  context_attention_forward(out, lse, qkv, kv.t.slice0(0, h), Tensor(), c1, false, st);
  context_attention_forward(out, lse, qkv, kv.t.slice0(h, z.sk), Tensor(), c2, true, st);
  OwnedTensor ws(DType::kU8, dev, {static_cast<int64_t>(context_attention_workspace_bytes(c, z.sq, z.sk))});
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
                 Case{256, 256, 1, 1, 2, 64, bf, 0.f, true}, Case{8, 16, 2, 2, 2, 16, DType::kF32, 0.2f},
                 // without a document mask: fully visible tiles (ordered keys), dropout, d = 64 / 128
                 Case{200, 300, 1, 2, 2, 64, bf, 0.f, true, true, false, false},
                 Case{130, 77, 2, 3, 1, 128, bf, 0.1f, false, true, false, false},
                 Case{150, 222, 2, 2, 2, 64, hf, 0.2f, true, true, false, false}}) {
    SCOPED_TRACE(describe(z));
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
                        // the simple kernels in bf16: qkv misaligned (d = 64), another head dim
                        Case{40, 70, 2, 2, 2, 64, bf, 0.1f, false, false}, Case{33, 50, 1, 2, 1, 96, bf},
                        // without a document mask: tensor cores (d = 64 / 128, dropout or not, fully
                        // visible tiles with ordered keys) and the simple kernels (fp32, misaligned)
                        Case{77, 130, 2, 2, 4, 64, bf, 0.f, false, true, false, false},
                        Case{64, 190, 1, 2, 2, 128, bf, 0.1f, true, true, false, false},
                        Case{200, 300, 1, 2, 2, 64, hf, 0.2f, true, true, false, false},
                        Case{8, 16, 2, 2, 2, 16, DType::kF32, 0.f, false, true, false, false},
                        Case{7, 13, 1, 3, 1, 8, DType::kF32, 0.5f, false, true, false, false},
                        Case{40, 70, 2, 2, 2, 64, bf, 0.1f, false, false, false, false}}) {
    const Inputs in = make_inputs(z);
    const Out cpu = run(z, Device::cpu(), in);
    const Out gpu = run(z, Device::cuda(0), in);
    const double tol = z.t == DType::kF32 ? 1e-5 : 2e-2;
    SCOPED_TRACE(describe(z));
    ASSERT_TRUE(testing::all_finite(gpu.out) && testing::all_finite(gpu.dqkv) && testing::all_finite(gpu.dkv));
    EXPECT_LT(testing::rel_err(gpu.out, cpu.out), tol) << "out d=" << z.d << " p=" << z.p;
    EXPECT_LT(testing::rel_err(gpu.lse, cpu.lse), tol) << "lse d=" << z.d << " p=" << z.p;
    EXPECT_LT(testing::rel_err(gpu.dqkv, cpu.dqkv), tol) << "dqkv d=" << z.d << " p=" << z.p;
    EXPECT_LT(testing::rel_err(gpu.dkv, cpu.dkv), tol) << "dkv d=" << z.d << " p=" << z.p;
  }
}

/// Bad arguments on CUDA: the backward's workspace is required (D_i and the dQ partial sums),
/// head_dim <= 1024 (the simple kernels' shared memory), the document mask and positions on the
/// device of qkv, the stream on it too.
TEST(ContextAttentionCuda, Errors) {
  const Case z{8, 16, 1, 1, 2, 64, DType::kBF16};
  const Inputs in = make_inputs(z);
  const Device dev = Device::cuda(0);
  const Stream& st = testing::cuda_stream();
  const int64_t n = z.g * z.qpg;
  OwnedTensor qkv = testing::make_tensor(in.hq, z.t, dev, {z.sq, z.b, z.g, z.qpg + 2, z.d}, st);
  OwnedTensor kv = testing::make_tensor(in.hkv, z.t, dev, {z.sk, z.b, z.g, 2, z.d}, st);
  OwnedTensor dout = testing::make_tensor(in.hdo, z.t, dev, {z.sq, z.b, n, z.d}, st);
  OwnedTensor dqkv = testing::make_tensor(in.hdq0, z.t, dev, {z.sq, z.b, z.g, z.qpg + 2, z.d}, st);
  OwnedTensor dkv = testing::make_tensor(in.hdkv0, z.t, dev, {z.sk, z.b, z.g, 2, z.d}, st);
  OwnedTensor q_pos = testing::make_int_tensor(in.qp, dev, {z.sq}, st);
  OwnedTensor k_pos = testing::make_int_tensor(in.kp, dev, {z.sk}, st);
  OwnedTensor q_pos_cpu = testing::make_int_tensor(in.qp, Device::cpu(), {z.sq}, testing::cpu_stream());
  OwnedTensor doc_cpu = testing::make_int_tensor(std::vector<int32_t>(z.b * z.sq, 0), Device::cpu(), {z.b, z.sq},
                                                 testing::cpu_stream());
  OwnedTensor out(z.t, dev, {z.sq, z.b, n, z.d}), lse(DType::kF32, dev, {z.sq, z.b, n});
  ContextAttentionConfig c;
  c.batch = z.b;
  c.groups = z.g;
  c.queries_per_group = z.qpg;
  c.head_dim = z.d;
  c.softmax_scale = 0.125f;
  c.q_pos = q_pos.t;
  c.k_pos = k_pos.t;
  OwnedTensor ws(DType::kU8, dev, {static_cast<int64_t>(context_attention_workspace_bytes(c, z.sq, z.sk))});
  auto fwd = [&](const ContextAttentionConfig& cc, const Stream& s) {
    context_attention_forward(out, lse, qkv, kv, Tensor(), cc, false, s);
  };
  auto bwd = [&](const ContextAttentionConfig& cc, const Tensor& w) {
    context_attention_backward(dqkv, dkv, dout, out, lse, qkv, kv, w, cc, st);
  };
  EXPECT_NO_THROW(fwd(c, st));
  EXPECT_NO_THROW(bwd(c, ws));
  EXPECT_THROW(bwd(c, Tensor()), Error);                            // no workspace on CUDA
  EXPECT_THROW(bwd(c, ws.t.flat_range(0, ws->numel() - 1)), Error);  // too small
  EXPECT_THROW(fwd(c, testing::cpu_stream()), Error);               // stream on the CPU
  auto bad = c;
  bad.q_pos = q_pos_cpu.t;
  EXPECT_THROW(fwd(bad, st), Error);  // positions on the CPU
  bad = c;
  bad.doc_start = doc_cpu.t;
  EXPECT_THROW(fwd(bad, st), Error);  // document mask on the CPU
  bad = c;
  bad.head_dim = 1032;  // over the fused kernels' limit (the shapes above no longer match either)
  EXPECT_THROW(fwd(bad, st), Error);
  st.synchronize();
}

// d = 8, 2, 1 fp32 values per block: the copy kernels' 16-, 8- and 4-byte words.
TEST(ContextAttentionCuda, PackUnpackTransposeExact) {
  const int64_t R = 37, qpg = 3;
  for (const int64_t d : {8, 2, 1})
  for (Device dev : {Device::cpu(), Device::cuda(0)}) {
    SCOPED_TRACE("d " + std::to_string(d) + (dev.is_cpu() ? " on cpu" : " on cuda"));
    const auto h = testing::randn(R * (qpg + 2) * d);
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
    // permute_blocks: [R, w, d] as outer R, w = 5 blocks of d; forward, then back (inverse).
    const std::vector<int> perm{3, 0, 4, 2, 1};
    OwnedTensor z(DType::kF32, dev, {R * (qpg + 2) * d});
    permute_blocks(y, qkv, R, perm, false, st);
    const auto hp = testing::to_host(y, st);
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < qpg + 2; ++j)
        for (int64_t e = 0; e < d; ++e) ASSERT_EQ(hp[(i * (qpg + 2) + j) * d + e], h[(i * (qpg + 2) + perm[j]) * d + e]);
    permute_blocks(z, y, R, perm, true, st);
    ASSERT_EQ(testing::to_host(z, st), h);
  }
}

/// transpose_blocks of one-byte elements (the FP8 transposes: x_t of the fused producers, wᵀ after
/// --fp8-param-gather): the tiled 16-byte kernel (a, b multiples of 16, aligned pointers; partial
/// 64 x 64 tiles) and the element-wise fallback (ragged sizes, a misaligned pointer) bitwise the CPU.
TEST(ContextAttentionCuda, ByteTransposeMatchesCpu) {
  std::mt19937 rng(7);
  struct Case {
    int64_t a, b, offset;
  };
  for (const Case cs : {Case{16, 16, 0}, Case{48, 80, 0}, Case{144, 400, 0}, Case{4096, 2048, 0}, Case{2048, 8192, 0},
                        Case{37, 53, 0}, Case{64, 48, 1}}) {
    SCOPED_TRACE(::testing::Message() << cs.a << " x " << cs.b << " offset " << cs.offset);
    const int64_t n = cs.a * cs.b;
    std::vector<uint8_t> h(static_cast<size_t>(n));
    for (auto& v : h) v = static_cast<uint8_t>(rng());
    std::vector<std::vector<uint8_t>> out;
    for (Device dev : {Device::cpu(), Device::cuda(0)}) {
      const Stream& st = dev.is_cpu() ? testing::cpu_stream() : testing::cuda_stream();
      OwnedTensor xs(DType::kU8, dev, {n + 16}), ys(DType::kU8, dev, {n + 16});
      const Tensor x = xs.t.flat_range(cs.offset, n), y = ys.t.flat_range(cs.offset, n);
      std::vector<uint8_t> r(static_cast<size_t>(n), 0xAB);
      if (dev.is_cpu()) {
        std::memcpy(x.data(), h.data(), h.size());
        std::memcpy(y.data(), r.data(), r.size());
      } else {
        ASSERT_EQ(cudaMemcpy(x.data(), h.data(), h.size(), cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(y.data(), r.data(), r.size(), cudaMemcpyHostToDevice), cudaSuccess);
      }
      transpose_blocks(y, x, cs.a, cs.b, st);
      st.synchronize();
      if (dev.is_cpu())
        std::memcpy(r.data(), y.data(), r.size());
      else
        ASSERT_EQ(cudaMemcpy(r.data(), y.data(), r.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      out.push_back(r);
    }
    for (int64_t i = 0; i < cs.a; ++i)
      for (int64_t j = 0; j < cs.b; ++j)
        ASSERT_EQ(out[0][static_cast<size_t>(j * cs.a + i)], h[static_cast<size_t>(i * cs.b + j)]) << i << "," << j;
    ASSERT_TRUE(out[1] == out[0]) << "the CUDA transpose differs from the CPU's";
  }
}

/// cuDNN's fused attention for the plain blocks of the ring (ContextAttentionConfig::cudnn with
/// kCausal: equal ascending positions, the diagonal step; kFull: every key before every query, the
/// half-block steps): out and lse (written, or merged into an earlier block's result) and dqkv,
/// dkv (accumulated on top of random values) equal the FlashAttention-2 kernels' within bf16/fp16
/// rounding (2e-2), MHA and GQA, d 64 and 128, ragged and CP-shaped sizes, and cuDNN ran: two
/// executions per case (forward, backward). With a document mask or dropout the same config
/// falls back to the kernels (no execution).
TEST(ContextAttentionCuda, CudnnBlocksMatchKernels) {
  if (!flash_attention_cudnn_available()) GTEST_SKIP() << "this build has no cuDNN (MT_WITH_CUDNN off)";
  struct Blk {
    int64_t sq, sk, b, g, qpg, d;
    DType t;
    ContextBlockMask mask;
    bool merge;
    bool fallback = false;  // with a document mask (and dropout): the kernels must run
  };
  const DType bf = DType::kBF16, hf = DType::kF16;
  const auto causal = ContextBlockMask::kCausal, full = ContextBlockMask::kFull;
  const Device dev = Device::cuda(0);
  const Stream& st = testing::cuda_stream();
  for (const Blk& z : {Blk{256, 256, 1, 2, 4, 64, bf, causal, false}, Blk{200, 200, 2, 3, 1, 128, bf, causal, false},
                       Blk{128, 256, 1, 2, 4, 64, bf, full, true}, Blk{256, 128, 2, 1, 2, 64, hf, full, true},
                       Blk{130, 77, 1, 2, 1, 128, bf, full, true}, Blk{96, 96, 1, 4, 2, 64, hf, causal, true},
                       Blk{128, 128, 1, 2, 2, 64, bf, causal, false, true}}) {
    SCOPED_TRACE(fmt::format("sq={} sk={} b={} g={} qpg={} d={} {} {} merge={} fallback={}", z.sq, z.sk, z.b, z.g,
                             z.qpg, z.d, dtype_name(z.t), z.mask == causal ? "causal" : "full", z.merge, z.fallback));
    const int64_t n = z.g * z.qpg;
    auto r = [&](int64_t k) { return testing::rounded(testing::randn(k), z.t); };
    const auto hq = r(z.sq * z.b * z.g * (z.qpg + 2) * z.d), hkv = r(z.sk * z.b * z.g * 2 * z.d),
               hdo = r(z.sq * z.b * n * z.d), hdq0 = r(z.sq * z.b * z.g * (z.qpg + 2) * z.d),
               hdkv0 = r(z.sk * z.b * z.g * 2 * z.d), ho0 = r(z.sq * z.b * n * z.d);
    std::vector<float> hl0 = testing::randn(z.sq * z.b * n);
    for (float& x : hl0) x += 4.f;  // an earlier block's LSE, comparable to this block's
    std::vector<int32_t> qp(z.sq), kp(z.sk), doc(z.b * z.sq);
    for (int64_t i = 0; i < z.sq; ++i)  // causal: chunks 0 and 3 of a CP 2 layout; full: after every key
      qp[i] = static_cast<int32_t>(z.mask == causal ? cp_global_position(2 * z.sq, 2, 0, i) : z.sk + 3 + i);
    for (int64_t j = 0; j < z.sk; ++j) kp[j] = z.mask == causal ? qp[j] : static_cast<int32_t>(j);
    for (int64_t b = 0; b < z.b; ++b)
      for (int64_t i = 0; i < z.sq; ++i) doc[b * z.sq + i] = qp[i] / 50 * 50;
    auto run_blk = [&](bool cudnn) {
      OwnedTensor qkv = testing::make_tensor(hq, z.t, dev, {z.sq, z.b, z.g, z.qpg + 2, z.d}, st);
      OwnedTensor kv = testing::make_tensor(hkv, z.t, dev, {z.sk, z.b, z.g, 2, z.d}, st);
      OwnedTensor dout = testing::make_tensor(hdo, z.t, dev, {z.sq, z.b, n, z.d}, st);
      OwnedTensor dqkv = testing::make_tensor(hdq0, z.t, dev, {z.sq, z.b, z.g, z.qpg + 2, z.d}, st);
      OwnedTensor dkv = testing::make_tensor(hdkv0, z.t, dev, {z.sk, z.b, z.g, 2, z.d}, st);
      OwnedTensor out = testing::make_tensor(ho0, z.t, dev, {z.sq, z.b, n, z.d}, st);
      OwnedTensor lse = testing::make_tensor(hl0, DType::kF32, dev, {z.sq, z.b, n}, st);
      OwnedTensor q_pos = testing::make_int_tensor(qp, dev, {z.sq}, st);
      OwnedTensor k_pos = testing::make_int_tensor(kp, dev, {z.sk}, st);
      OwnedTensor docs = testing::make_int_tensor(doc, dev, {z.b, z.sq}, st);
      if (!z.merge) {
        testing::poison(out, st);
        testing::poison(lse, st);
      }
      ContextAttentionConfig c;
      c.batch = z.b;
      c.groups = z.g;
      c.queries_per_group = z.qpg;
      c.head_dim = z.d;
      c.softmax_scale = 1.f / std::sqrt(static_cast<float>(z.d));
      c.q_pos = q_pos.t;
      c.k_pos = k_pos.t;
      c.block = z.mask;
      c.cudnn = cudnn;
      if (z.fallback) {
        c.doc_start = docs.t;
        c.dropout_p = 0.1f;
        c.seq_length = 4 * z.sq + z.sk;
        c.dropout_key = DropoutKey{99, 1, 2, 3};
      }
      OwnedTensor fws(DType::kU8, dev, {std::max<int64_t>(16, context_attention_forward_workspace_bytes(c, z.sq))});
      OwnedTensor bws(DType::kU8, dev, {static_cast<int64_t>(context_attention_workspace_bytes(c, z.sq, z.sk))});
      testing::poison(fws, st);
      testing::poison(bws, st);
      const int64_t before = cuda::cudnn_attention_executions();
      context_attention_forward(out, lse, qkv, kv, fws, c, z.merge, st);
      context_attention_backward(dqkv, dkv, dout, out, lse, qkv, kv, bws, c, st);
      st.synchronize();
      return std::tuple{Out{testing::to_host(out, st), testing::to_host(lse, st), testing::to_host(dqkv, st),
                            testing::to_host(dkv, st)},
                        cuda::cudnn_attention_executions() - before};
    };
    const auto [want, none] = run_blk(false);
    const auto [got, ran] = run_blk(true);
    EXPECT_EQ(none, 0);
    EXPECT_EQ(ran, z.fallback ? 0 : 2);
    ASSERT_TRUE(testing::all_finite(got.out) && testing::all_finite(got.lse) && testing::all_finite(got.dqkv) &&
                testing::all_finite(got.dkv));
    EXPECT_LT(testing::rel_err(got.out, want.out), 2e-2) << "out";
    EXPECT_LT(testing::rel_err(got.lse, want.lse), 1e-4) << "lse";
    EXPECT_LT(testing::rel_err(got.dqkv, want.dqkv), 2e-2) << "dqkv";
    EXPECT_LT(testing::rel_err(got.dkv, want.dkv), 2e-2) << "dkv";
  }
}

}  // namespace
}  // namespace mt
