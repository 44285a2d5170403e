// CUDA embedding against the CPU reference on the same (dtype-rounded) tables: output fp32 rel.
// 1e-5, bf16/fp16 rel. 2e-2; fp32 main grads rel. 1e-5 in every dtype (same inputs; only the
// summation order differs), with the atomic backward and the deterministic one (sorted by id,
// --deterministic-mode), which must also give the same bits twice. Vocab-parallel masking,
// explicit and default positions, vectorised and scalar paths, long runs of one id.
#include <gtest/gtest.h>

#include "ops/embedding.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::rounded;
using testing::OwnedTensor;
const Device kCpu = Device::cpu();

double tol(DType t) { return t == DType::kF32 ? 1e-5 : 2e-2; }

struct Case {
  int64_t s, b, h, v_local, vocab_start, v_total, p_rows;
  bool with_wpe, with_positions, misaligned;
};

TEST(EmbeddingCuda, ForwardBackwardMatchCpu) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  const Case cases[] = {
      {37, 3, 768, 50, 20, 100, 64, true, false, false},    // vectorised, default positions
      {37, 3, 768, 50, 20, 100, 64, true, true, false},     // explicit positions
      {13, 4, 100, 30, 0, 60, 13, true, false, false},      // fp32 vectorised, bf16/fp16 scalar
      {9, 2, 7, 11, 5, 20, 12, false, false, false},        // scalar, no wpe
      {9, 2, 7, 11, 5, 20, 12, true, true, false},          // scalar, explicit positions
      {16, 2, 768, 40, 10, 80, 16, true, false, true},      // unaligned tables: scalar path
      {256, 8, 1024, 50, 25, 100, 256, true, false, false}, // large: grid-stride, many repeats
  };
  for (const bool det : {false, true}) {
    for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (const Case& c : cases) {
        const std::string what = fmt::format("{} s={} b={} h={} vocab_start={} wpe={} pos={} misaligned={} det={}",
                                             dtype_name(t), c.s, c.b, c.h, c.vocab_start, c.with_wpe,
                                             c.with_positions, c.misaligned, det);
        const int64_t n_tok = c.s * c.b;
        auto ids = testing::randint(n_tok, 0, static_cast<int32_t>(c.v_total));
        ids[0] = static_cast<int32_t>(c.vocab_start);
        ids[1] = static_cast<int32_t>(c.vocab_start + c.v_local - 1);
        const auto pos = testing::randint(n_tok, 0, static_cast<int32_t>(c.p_rows));
        const auto wte_v = testing::randn(c.v_local * c.h), wpe_v = testing::randn(c.p_rows * c.h);
        const auto dout_v = testing::randn(n_tok * c.h);
        const auto dwte0 = testing::randn(c.v_local * c.h), dwpe0 = testing::randn(c.p_rows * c.h);

        // CPU reference on rounded inputs.
        auto ids_c = testing::make_int_tensor(ids, kCpu, {c.s, c.b}, cs);
        auto pos_c = testing::make_int_tensor(pos, kCpu, {c.s, c.b}, cs);
        auto wte_c = testing::make_tensor(rounded(wte_v, t), DType::kF32, kCpu, {c.v_local, c.h}, cs);
        auto wpe_c = testing::make_tensor(rounded(wpe_v, t), DType::kF32, kCpu, {c.p_rows, c.h}, cs);
        auto dout_c = testing::make_tensor(rounded(dout_v, t), DType::kF32, kCpu, {c.s, c.b, c.h}, cs);
        auto dwte_c = testing::make_tensor(dwte0, DType::kF32, kCpu, {c.v_local, c.h}, cs);
        auto dwpe_c = testing::make_tensor(dwpe0, DType::kF32, kCpu, {c.p_rows, c.h}, cs);
        OwnedTensor out_c(DType::kF32, kCpu, {c.s, c.b, c.h});
        const Tensor none;
        embedding_forward(out_c, ids_c, wte_c, c.with_wpe ? wpe_c.t : none, c.with_positions ? pos_c.t : none,
                          c.vocab_start, cs);
        embedding_backward(dwte_c, c.with_wpe ? dwpe_c.t : none, dout_c, ids_c, c.with_positions ? pos_c.t : none,
                           c.vocab_start, det, cs);

        // GPU. Misaligned: tables start one element into their buffers.
        const int64_t shift = c.misaligned ? 1 : 0;
        auto ids_g = testing::make_int_tensor(ids, gpu, {c.s, c.b}, gs);
        auto pos_g = testing::make_int_tensor(pos, gpu, {c.s, c.b}, gs);
        std::vector<float> wte_buf(shift, 0.f), wpe_buf(shift, 0.f);
        wte_buf.insert(wte_buf.end(), wte_v.begin(), wte_v.end());
        wpe_buf.insert(wpe_buf.end(), wpe_v.begin(), wpe_v.end());
        auto wte_gb = testing::make_tensor(wte_buf, t, gpu, {shift + c.v_local * c.h}, gs);
        auto wpe_gb = testing::make_tensor(wpe_buf, t, gpu, {shift + c.p_rows * c.h}, gs);
        const Tensor wte_g = wte_gb.t.flat_range(shift, c.v_local * c.h).view({c.v_local, c.h});
        const Tensor wpe_g = wpe_gb.t.flat_range(shift, c.p_rows * c.h).view({c.p_rows, c.h});
        auto dout_g = testing::make_tensor(dout_v, t, gpu, {c.s, c.b, c.h}, gs);
        auto dwte_g = testing::make_tensor(dwte0, DType::kF32, gpu, {c.v_local, c.h}, gs);
        auto dwpe_g = testing::make_tensor(dwpe0, DType::kF32, gpu, {c.p_rows, c.h}, gs);
        OwnedTensor out_g(t, gpu, {c.s, c.b, c.h});
        testing::poison(out_g, gs);
        embedding_forward(out_g, ids_g, wte_g, c.with_wpe ? wpe_g : none, c.with_positions ? pos_g.t : none,
                          c.vocab_start, gs);
        embedding_backward(dwte_g, c.with_wpe ? dwpe_g.t : none, dout_g, ids_g, c.with_positions ? pos_g.t : none,
                           c.vocab_start, det, gs);

        const auto out = testing::to_host(out_g, gs);
        ASSERT_TRUE(testing::all_finite(out)) << what;
        EXPECT_LT(testing::rel_err(out, testing::to_host(out_c, cs)), tol(t)) << what;
        const auto dwte = testing::to_host(dwte_g, gs);
        EXPECT_LT(testing::rel_err(dwte, testing::to_host(dwte_c, cs)), 1e-5) << what;
        EXPECT_LT(testing::rel_err(testing::to_host(dwpe_g, gs), testing::to_host(dwpe_c, cs)), 1e-5) << what;

        // Rows of this vocab shard that no id selects get no gradient (bit-exact).
        std::vector<bool> used(c.v_local, false);
        for (int32_t id : ids) {
          if (id >= c.vocab_start && id < c.vocab_start + c.v_local) used[id - c.vocab_start] = true;
        }
        for (int64_t r = 0; r < c.v_local; ++r) {
          if (used[r]) continue;
          for (int64_t k = 0; k < c.h; ++k) ASSERT_EQ(dwte[r * c.h + k], dwte0[r * c.h + k]) << what << " row " << r;
        }

        // Default positions: the dwpe kernel is deterministic (no atomics): same bits twice.
        if (c.with_wpe && !c.with_positions) {
          auto a = testing::make_tensor(dwpe0, DType::kF32, gpu, {c.p_rows, c.h}, gs);
          auto b = testing::make_tensor(dwpe0, DType::kF32, gpu, {c.p_rows, c.h}, gs);
          auto scratch = testing::make_tensor(dwte0, DType::kF32, gpu, {c.v_local, c.h}, gs);
          embedding_backward(scratch, a, dout_g, ids_g, none, c.vocab_start, det, gs);
          embedding_backward(scratch, b, dout_g, ids_g, none, c.vocab_start, det, gs);
          EXPECT_EQ(testing::to_host(a, gs), testing::to_host(b, gs)) << what;
        }
        // Deterministic: dwte (and dwpe with explicit positions) the same bits on a second run.
        if (det) {
          auto a = testing::make_tensor(dwte0, DType::kF32, gpu, {c.v_local, c.h}, gs);
          auto pa = testing::make_tensor(dwpe0, DType::kF32, gpu, {c.p_rows, c.h}, gs);
          embedding_backward(a, c.with_wpe ? pa.t : none, dout_g, ids_g, c.with_positions ? pos_g.t : none,
                             c.vocab_start, true, gs);
          EXPECT_EQ(testing::to_host(a, gs), dwte) << what;
          EXPECT_EQ(testing::to_host(pa, gs), testing::to_host(dwpe_g, gs)) << what;
        }
      }
    }
  }
}

/// The deterministic backward against the CPU and the atomic path, and bitwise run to run, where the
/// atomics' order matters most: long runs of one id (60% of 8192 tokens), ids of other vocab shards
/// (sorted last and skipped), explicit positions with repeats, bf16 with vectors and fp32 scalar.
TEST(EmbeddingCuda, DeterministicLongRunsBitwise) {
  MT_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Stream gs(gpu), cs;
  const Tensor none;
  for (const auto& [t, h] : {std::pair{DType::kBF16, int64_t{1024}}, std::pair{DType::kF32, int64_t{333}}}) {
    const int64_t s = 1024, b = 8, n_tok = s * b, v_local = 300, vocab_start = 100, v_total = 500, p_rows = 64;
    const std::string what = fmt::format("{} h={}", dtype_name(t), h);
    auto ids = testing::randint(n_tok, 0, static_cast<int32_t>(v_total));
    const auto coin = testing::randint(n_tok, 0, 10);
    for (int64_t i = 0; i < n_tok; ++i)
      if (coin[i] < 6) ids[i] = 217;  // one hot id of this shard
    const auto pos = testing::randint(n_tok, 0, static_cast<int32_t>(p_rows));
    const auto dout_v = rounded(testing::randn(n_tok * h), t);
    const auto dwte0 = testing::randn(v_local * h), dwpe0 = testing::randn(p_rows * h);

    auto ids_c = testing::make_int_tensor(ids, kCpu, {s, b}, cs);
    auto pos_c = testing::make_int_tensor(pos, kCpu, {s, b}, cs);
    auto dout_c = testing::make_tensor(dout_v, DType::kF32, kCpu, {s, b, h}, cs);
    auto dwte_c = testing::make_tensor(dwte0, DType::kF32, kCpu, {v_local, h}, cs);
    auto dwpe_c = testing::make_tensor(dwpe0, DType::kF32, kCpu, {p_rows, h}, cs);
    embedding_backward(dwte_c, dwpe_c, dout_c, ids_c, pos_c, vocab_start, true, cs);
    const auto ref_te = testing::to_host(dwte_c, cs), ref_pe = testing::to_host(dwpe_c, cs);

    auto ids_g = testing::make_int_tensor(ids, gpu, {s, b}, gs);
    auto pos_g = testing::make_int_tensor(pos, gpu, {s, b}, gs);
    auto dout_g = testing::make_tensor(dout_v, t, gpu, {s, b, h}, gs);
    auto run = [&](bool det) {
      auto te = testing::make_tensor(dwte0, DType::kF32, gpu, {v_local, h}, gs);
      auto pe = testing::make_tensor(dwpe0, DType::kF32, gpu, {p_rows, h}, gs);
      embedding_backward(te, pe, dout_g, ids_g, pos_g, vocab_start, det, gs);
      return std::pair{testing::to_host(te, gs), testing::to_host(pe, gs)};
    };
    const auto d1 = run(true), d2 = run(true), at = run(false);
    EXPECT_EQ(d1.first, d2.first) << what;
    EXPECT_EQ(d1.second, d2.second) << what;
    EXPECT_LT(testing::rel_err(d1.first, ref_te), 1e-5) << what;
    EXPECT_LT(testing::rel_err(d1.second, ref_pe), 1e-5) << what;
    EXPECT_LT(testing::rel_err(d1.first, at.first), 1e-5) << what;
    EXPECT_LT(testing::rel_err(d1.second, at.second), 1e-5) << what;
    // The hot row alone (its sum has ~4900 terms): relative error against the CPU.
    const std::vector<float> hot(d1.first.begin() + (217 - vocab_start) * h, d1.first.begin() + (218 - vocab_start) * h);
    const std::vector<float> hot_ref(ref_te.begin() + (217 - vocab_start) * h, ref_te.begin() + (218 - vocab_start) * h);
    EXPECT_LT(testing::rel_err(hot, hot_ref), 1e-5) << what;
  }
}

}  // namespace
}  // namespace mt
