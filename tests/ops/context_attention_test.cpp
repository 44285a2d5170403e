// Argument validation of ops/context_attention.h on the CPU (the shared attention validation,
// ops/attention_checks.h): a test per documented error of context_attention_forward / _backward.
// (The op's numerics: tests/parallel/context_parallel_test.cpp, and on CUDA
// tests/ops/context_attention_cuda_test.cpp.)
#include "ops/context_attention.h"

#include <gtest/gtest.h>

#include <cmath>

#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;

TEST(ContextAttention, Errors) {
  const Stream& st = testing::cpu_stream();
  const Device cpu = Device::cpu();
  const int64_t sq = 4, sk = 6, b = 2, g = 2, qpg = 2, d = 8, n = g * qpg;
  auto make = [&](const std::vector<int64_t>& shape) {
    int64_t k = 1;
    for (int64_t x : shape) k *= x;
    return testing::make_tensor(testing::randn(k), DType::kF32, cpu, shape, st);
  };
  OwnedTensor qkv = make({sq, b, g, qpg + 2, d}), kv = make({sk, b, g, 2, d}), dout = make({sq, b, n, d});
  OwnedTensor dqkv = make({sq, b, g, qpg + 2, d}), dkv = make({sk, b, g, 2, d});
  OwnedTensor out(DType::kF32, cpu, {sq, b, n, d}), lse(DType::kF32, cpu, {sq, b, n});
  OwnedTensor q_pos = testing::make_int_tensor({8, 9, 10, 11}, cpu, {sq}, st);
  OwnedTensor k_pos = testing::make_int_tensor({0, 1, 2, 3, 4, 5}, cpu, {sk}, st);
  // Document starts as a strided column slice of [b, sq + 2] (accepted), and ones of other shapes.
  OwnedTensor docs = testing::make_int_tensor(std::vector<int32_t>(b * (sq + 2), 0), cpu, {b, sq + 2}, st);
  OwnedTensor docs_t = testing::make_int_tensor(std::vector<int32_t>(b * sq, 0), cpu, {sq, b}, st);
  ContextAttentionConfig good;
  good.batch = b;
  good.groups = g;
  good.queries_per_group = qpg;
  good.head_dim = d;
  good.softmax_scale = 1.f / std::sqrt(static_cast<float>(d));
  good.q_pos = q_pos.t;
  good.k_pos = k_pos.t;
  good.doc_start = docs.t.slice(1, 1, 1 + sq);
  good.dropout_p = 0.1f;
  good.seq_length = 12;
  good.head_offset = n;
  good.total_heads = 2 * n;
  auto fwd = [&](const ContextAttentionConfig& c, const Tensor& q = Tensor(), const Tensor& o = Tensor()) {
    context_attention_forward(o.empty() ? out.t : o, lse, q.empty() ? qkv.t : q, kv, Tensor(), c, false, st);
  };
  auto bwd = [&](const ContextAttentionConfig& c, const Tensor& ws = Tensor()) {
    context_attention_backward(dqkv, dkv, dout, out, lse, qkv, kv, ws, c, st);
  };
  EXPECT_NO_THROW(fwd(good));
  EXPECT_NO_THROW(bwd(good));  // the CPU needs no workspace
  auto bad = [&](auto mutate) {
    ContextAttentionConfig c = good;
    mutate(c);
    EXPECT_THROW(fwd(c), Error);
    EXPECT_THROW(bwd(c), Error);
  };
  bad([](auto& c) { c.batch = 0; });
  bad([](auto& c) { c.groups = 0; });
  bad([](auto& c) { c.queries_per_group = 0; });
  bad([](auto& c) { c.head_dim = 4; });  // shapes no longer match
  bad([](auto& c) { c.softmax_scale = 0.f; });
  bad([](auto& c) { c.softmax_scale = -1.f; });
  bad([](auto& c) { c.softmax_scale = INFINITY; });
  bad([](auto& c) { c.dropout_p = 1.f; });
  bad([](auto& c) { c.dropout_p = -0.1f; });
  bad([](auto& c) { c.seq_length = 5; });  // shorter than the key block (sk = 6)
  bad([](auto& c) { c.seq_length = 0; });
  bad([](auto& c) { c.head_offset = n + 1; });  // heads 5..8 of 8
  bad([](auto& c) { c.total_heads = n - 1; });
  bad([&](auto& c) { c.q_pos = k_pos.t; });                    // sq positions expected
  bad([](auto& c) { c.k_pos = Tensor(); });                    // missing
  bad([&](auto& c) { c.doc_start = docs_t.t; });               // [sq, b]
  bad([&](auto& c) { c.doc_start = docs.t; });                 // [b, sq + 2]
  bad([&](auto& c) { c.doc_start = docs.t.slice(0, 0, 1); });  // [1, sq + 2]
  // Tensors: shapes, dtypes (the CPU is fp32 only), a workspace that is too small.
  OwnedTensor out_bad(DType::kF32, cpu, {sq, b, n, d + 1});
  OwnedTensor qkv_bf16(DType::kBF16, cpu, {sq, b, g, qpg + 2, d});
  OwnedTensor qkv_3(DType::kF32, cpu, {sq, b, g, 3, d});
  EXPECT_THROW(fwd(good, Tensor(), out_bad), Error);
  EXPECT_THROW(fwd(good, qkv_bf16), Error);
  EXPECT_THROW(fwd(good, qkv_3), Error);
  OwnedTensor small(DType::kU8, cpu, {static_cast<int64_t>(context_attention_workspace_bytes(good, sq, sk)) - 1});
  EXPECT_THROW(bwd(good, small), Error);
  // The declared block mask against the positions (q 8..11, k 0..5): full holds, causal does not
  // (sq != sk, and positions that differ); a full block with a key after a query is refused.
  ContextAttentionConfig full = good;
  full.block = ContextBlockMask::kFull;
  EXPECT_NO_THROW(fwd(full));
  EXPECT_NO_THROW(bwd(full));
  bad([](auto& c) { c.block = ContextBlockMask::kCausal; });
  OwnedTensor late_k = testing::make_int_tensor({0, 1, 2, 3, 4, 9}, cpu, {sk}, st);
  bad([&](auto& c) {
    c.block = ContextBlockMask::kFull;
    c.k_pos = late_k.t;
  });
  // cuDNN asked for: both workspaces are required, with the cuDNN parts (also on the CPU).
  ContextAttentionConfig cud = good;
  cud.cudnn = true;
  EXPECT_THROW(fwd(cud), Error);
  EXPECT_THROW(bwd(cud), Error);
  EXPECT_THROW(bwd(cud, small), Error);
  OwnedTensor fws(DType::kU8, cpu, {static_cast<int64_t>(context_attention_forward_workspace_bytes(cud, sq))});
  OwnedTensor bws(DType::kU8, cpu, {static_cast<int64_t>(context_attention_workspace_bytes(cud, sq, sk))});
  EXPECT_NO_THROW(context_attention_forward(out.t, lse, qkv.t, kv, fws, cud, false, st));
  EXPECT_NO_THROW(bwd(cud, bws));
}

// A causal block: sq == sk, equal ascending positions; anything else is refused.
TEST(ContextAttention, CausalBlockChecksPositions) {
  const Device cpu = Device::cpu();
  const Stream& st = testing::cpu_stream();
  const int64_t s = 4, b = 1, g = 1, qpg = 1, d = 8;
  OwnedTensor qkv = testing::make_tensor(testing::randn(s * b * g * 3 * d), DType::kF32, cpu, {s, b, g, 3, d}, st);
  OwnedTensor kv(DType::kF32, cpu, {s, b, g, 2, d}), out(DType::kF32, cpu, {s, b, 1, d}), lse(DType::kF32, cpu, {s, b, 1});
  kv_pack(kv, qkv, qpg, st);
  OwnedTensor pos = testing::make_int_tensor({0, 1, 6, 7}, cpu, {s}, st);  // chunks 0 and 3 of CP 2, s = 8
  OwnedTensor unsorted = testing::make_int_tensor({0, 1, 7, 6}, cpu, {s}, st);
  ContextAttentionConfig c;
  c.batch = b;
  c.groups = g;
  c.queries_per_group = qpg;
  c.head_dim = d;
  c.softmax_scale = 0.3f;
  c.q_pos = pos.t;
  c.k_pos = pos.t;
  c.block = ContextBlockMask::kCausal;
  EXPECT_NO_THROW(context_attention_forward(out, lse, qkv, kv, Tensor(), c, false, st));
  c.q_pos = c.k_pos = unsorted.t;
  EXPECT_THROW(context_attention_forward(out, lse, qkv, kv, Tensor(), c, false, st), Error);
  c.q_pos = pos.t;
  EXPECT_THROW(context_attention_forward(out, lse, qkv, kv, Tensor(), c, false, st), Error);
}

TEST(ContextAttention, WorkspaceBytes) {
  ContextAttentionConfig c;
  c.batch = 3;
  c.groups = 2;
  c.queries_per_group = 4;
  c.head_dim = 64;
  const size_t rows = 100 * 3 * 8;
  EXPECT_EQ(context_attention_dq_accum_offset(c, 100), (rows * 4 + 255) / 256 * 256);
  EXPECT_EQ(context_attention_workspace_bytes(c, 100, 100), (rows * 4 + 255) / 256 * 256 + rows * 64 * 4);
  EXPECT_EQ(context_attention_forward_workspace_bytes(c, 100), 0u);
  // cuDNN's parts (16-bit elements, each padded to 256 bytes): forward block output, statistics and
  // the gathered queries; backward also the statistics, dQ, dK/dV of sk = 60 rows and the queries.
  c.cudnn = true;
  auto pad = [](size_t n) { return (n + 255) / 256 * 256; };
  EXPECT_EQ(context_attention_forward_workspace_bytes(c, 100), pad(rows * 64 * 2) + pad(rows * 4) + pad(rows * 64 * 2));
  const size_t own = (rows * 4 + 255) / 256 * 256 + rows * 64 * 4;
  EXPECT_EQ(context_attention_workspace_bytes(c, 100, 60),
            pad(own) + pad(rows * 4) + pad(rows * 64 * 2) + pad(60 * 3 * 2 * 2 * 64 * 2) + pad(rows * 64 * 2));
  c.queries_per_group = 1;  // no gathered queries: Q is read in place
  const size_t rows1 = 100 * 3 * 2;
  EXPECT_EQ(context_attention_forward_workspace_bytes(c, 100), pad(rows1 * 64 * 2) + pad(rows1 * 4));
}

}  // namespace
}  // namespace mt
