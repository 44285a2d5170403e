// CPU token + position embedding against a float64 reference; backward against central finite
// differences of that reference. Vocab-parallel masking: ids outside [vocab_start,
// vocab_start + V_local) give zero word rows and no word gradient.
#include <gtest/gtest.h>

#include "ops/embedding.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;

struct EmbCase {
  int64_t s, b, h, v_local, vocab_start, v_total, p_rows;
  bool with_wpe, with_positions;
};

struct EmbData {
  std::vector<int32_t> ids, pos;
  std::vector<float> wte, wpe;
};

EmbData make_data(const EmbCase& c) {
  EmbData d;
  d.ids = testing::randint(c.s * c.b, 0, static_cast<int32_t>(c.v_total));
  // Force both range edges and both neighbours outside into the batch.
  d.ids[0] = static_cast<int32_t>(c.vocab_start);
  d.ids[1] = static_cast<int32_t>(c.vocab_start + c.v_local - 1);
  if (c.vocab_start > 0) d.ids[2] = static_cast<int32_t>(c.vocab_start - 1);
  if (c.vocab_start + c.v_local < c.v_total) d.ids[3] = static_cast<int32_t>(c.vocab_start + c.v_local);
  d.pos = testing::randint(c.s * c.b, 0, static_cast<int32_t>(c.p_rows));
  d.wte = testing::randn(c.v_local * c.h);
  d.wpe = testing::randn(c.p_rows * c.h);
  return d;
}

/// out = wte row (if in range) + wpe row (if wpe), float64.
std::vector<double> forward_ref(const EmbCase& c, const EmbData& d, const std::vector<double>& wte,
                                const std::vector<double>& wpe) {
  std::vector<double> out(c.s * c.b * c.h, 0.0);
  for (int64_t t = 0; t < c.s * c.b; ++t) {
    const int64_t row = d.ids[t] - c.vocab_start;
    const int64_t p = c.with_positions ? d.pos[t] : t / c.b;
    for (int64_t k = 0; k < c.h; ++k) {
      double v = (row >= 0 && row < c.v_local) ? wte[row * c.h + k] : 0.0;
      if (c.with_wpe) v += wpe[p * c.h + k];
      out[t * c.h + k] = v;
    }
  }
  return out;
}

const std::vector<EmbCase>& cases() {
  static const std::vector<EmbCase> k = {
      {5, 3, 16, 9, 6, 20, 8, true, false},  {5, 3, 16, 9, 6, 20, 8, true, true},
      {5, 3, 7, 9, 6, 20, 5, false, false},  {4, 2, 7, 20, 0, 20, 11, true, true},
      {6, 1, 33, 5, 15, 20, 6, true, false},
  };
  return k;
}

TEST(Embedding, ForwardMatchesFloat64ReferenceWithVocabMasking) {
  Stream st;
  const Device cpu = Device::cpu();
  for (const EmbCase& c : cases()) {
    EmbData d = make_data(c);
    auto ids = testing::make_int_tensor(d.ids, cpu, {c.s, c.b}, st);
    auto pos = testing::make_int_tensor(d.pos, cpu, {c.s, c.b}, st);
    auto wte = testing::make_tensor(d.wte, DType::kF32, cpu, {c.v_local, c.h}, st);
    auto wpe = testing::make_tensor(d.wpe, DType::kF32, cpu, {c.p_rows, c.h}, st);
    OwnedTensor out(DType::kF32, cpu, {c.s, c.b, c.h});
    testing::poison(out, st);
    embedding_forward(out, ids, wte, c.with_wpe ? wpe.t : Tensor{}, c.with_positions ? pos.t : Tensor{},
                      c.vocab_start, st);
    std::vector<double> wte_d(d.wte.begin(), d.wte.end()), wpe_d(d.wpe.begin(), d.wpe.end());
    auto ref = forward_ref(c, d, wte_d, wpe_d);
    auto got = testing::to_host(out, st);
    EXPECT_LT(testing::rel_err(got, ref), 1e-6) << "h=" << c.h << " vocab_start=" << c.vocab_start;
    // Out-of-range ids: the word part is exactly zero (row equals the position row, or 0).
    for (int64_t t = 0; t < c.s * c.b; ++t) {
      const int64_t row = d.ids[t] - c.vocab_start;
      if (row >= 0 && row < c.v_local) continue;
      const int64_t p = c.with_positions ? d.pos[t] : t / c.b;
      for (int64_t k = 0; k < c.h; ++k) {
        ASSERT_EQ(got[t * c.h + k], c.with_wpe ? d.wpe[p * c.h + k] : 0.f) << "t=" << t << " id=" << d.ids[t];
      }
    }
  }
}

// L = sum(g * out): dL/dwte and dL/dwpe by central differences of the float64 reference (L is
// linear in the tables, so the differences are exact up to rounding ~1e-10).
TEST(Embedding, BackwardMatchesFiniteDifferences) {
  Stream st;
  const Device cpu = Device::cpu();
  for (const EmbCase& c : cases()) {
    EmbData d = make_data(c);
    auto g = testing::randn(c.s * c.b * c.h);
    auto ids = testing::make_int_tensor(d.ids, cpu, {c.s, c.b}, st);
    auto pos = testing::make_int_tensor(d.pos, cpu, {c.s, c.b}, st);
    auto dout = testing::make_tensor(g, DType::kF32, cpu, {c.s, c.b, c.h}, st);
    // Gradients accumulate (+=): start from random values.
    auto dwte0 = testing::randn(c.v_local * c.h), dwpe0 = testing::randn(c.p_rows * c.h);
    auto dwte = testing::make_tensor(dwte0, DType::kF32, cpu, {c.v_local, c.h}, st);
    auto dwpe = testing::make_tensor(dwpe0, DType::kF32, cpu, {c.p_rows, c.h}, st);
    embedding_backward(dwte, c.with_wpe ? dwpe.t : Tensor{}, dout, ids, c.with_positions ? pos.t : Tensor{},
                       c.vocab_start, false, st);

    std::vector<double> wte_d(d.wte.begin(), d.wte.end()), wpe_d(d.wpe.begin(), d.wpe.end());
    auto loss = [&] {
      auto out = forward_ref(c, d, wte_d, wpe_d);
      double l = 0;
      for (size_t i = 0; i < out.size(); ++i) l += g[i] * out[i];
      return l;
    };
    std::vector<double> dwte_ref(c.v_local * c.h), dwpe_ref(c.p_rows * c.h);
    for (size_t i = 0; i < dwte_ref.size(); ++i) dwte_ref[i] = dwte0[i] + testing::finite_diff(loss, wte_d, i);
    for (size_t i = 0; i < dwpe_ref.size(); ++i) {
      dwpe_ref[i] = dwpe0[i] + (c.with_wpe ? testing::finite_diff(loss, wpe_d, i) : 0.0);
    }
    auto got_wte = testing::to_host(dwte, st);
    EXPECT_LT(testing::rel_err(got_wte, dwte_ref), 1e-5) << "h=" << c.h << " vocab_start=" << c.vocab_start;
    EXPECT_LT(testing::rel_err(testing::to_host(dwpe, st), dwpe_ref), 1e-5) << "h=" << c.h;

    // Rows of this shard that no in-range id selects get no gradient at all (bit-exact).
    std::vector<bool> used(c.v_local, false);
    for (int32_t id : d.ids) {
      if (id >= c.vocab_start && id < c.vocab_start + c.v_local) used[id - c.vocab_start] = true;
    }
    for (int64_t r = 0; r < c.v_local; ++r) {
      if (used[r]) continue;
      for (int64_t k = 0; k < c.h; ++k) ASSERT_EQ(got_wte[r * c.h + k], dwte0[r * c.h + k]) << "row " << r;
    }
  }
}

TEST(Embedding, VocabParallelShardsSumToFullTable) {
  // Two vocab shards (as with TP = 2) each produce a partial output; their sum (the all-reduce)
  // equals the unsharded embedding. wpe is passed on shard 0 only.
  Stream st;
  const Device cpu = Device::cpu();
  const int64_t s = 6, b = 2, h = 12, v = 16, p = 6;
  auto ids_v = testing::randint(s * b, 0, v);
  auto wte_v = testing::randn(v * h), wpe_v = testing::randn(p * h);
  auto ids = testing::make_int_tensor(ids_v, cpu, {s, b}, st);
  auto wte = testing::make_tensor(wte_v, DType::kF32, cpu, {v, h}, st);
  auto wpe = testing::make_tensor(wpe_v, DType::kF32, cpu, {p, h}, st);
  OwnedTensor full(DType::kF32, cpu, {s, b, h}), part0(DType::kF32, cpu, {s, b, h}), part1(DType::kF32, cpu, {s, b, h});
  embedding_forward(full, ids, wte, wpe, Tensor{}, 0, st);
  embedding_forward(part0, ids, wte.t.slice0(0, v / 2), wpe, Tensor{}, 0, st);
  embedding_forward(part1, ids, wte.t.slice0(v / 2, v), Tensor{}, Tensor{}, v / 2, st);
  auto f = testing::to_host(full, st), a = testing::to_host(part0, st), c = testing::to_host(part1, st);
  for (size_t i = 0; i < f.size(); ++i) ASSERT_EQ(a[i] + c[i], f[i]) << i;  // one of the two is exactly 0 + wpe
}

TEST(Embedding, BadInputThrows) {
  Stream st;
  const Device cpu = Device::cpu();
  const int64_t s = 4, b = 2, h = 8, v = 10, p = 4;
  auto ids = testing::make_int_tensor(testing::randint(s * b, 0, v), cpu, {s, b}, st);
  auto ids_f = testing::make_tensor(testing::randn(s * b), DType::kF32, cpu, {s, b}, st);
  auto wte = testing::make_tensor(testing::randn(v * h), DType::kF32, cpu, {v, h}, st);
  auto wpe = testing::make_tensor(testing::randn(p * h), DType::kF32, cpu, {p, h}, st);
  auto wpe_short = testing::make_tensor(testing::randn((s - 1) * h), DType::kF32, cpu, {s - 1, h}, st);
  auto wte_h = testing::make_tensor(testing::randn(v * (h + 1)), DType::kF32, cpu, {v, h + 1}, st);
  std::vector<int32_t> bad_pos(s * b, 0);
  bad_pos[3] = static_cast<int32_t>(p);
  auto pos_bad = testing::make_int_tensor(bad_pos, cpu, {s, b}, st);
  auto pos_shape = testing::make_int_tensor(std::vector<int32_t>(s * b, 0), cpu, {b, s}, st);
  OwnedTensor out(DType::kF32, cpu, {s, b, h}), out_b(DType::kF32, cpu, {s, b + 1, h}), out_bf(DType::kBF16, cpu, {s, b, h});
  EXPECT_NO_THROW(embedding_forward(out, ids, wte, wpe, Tensor{}, 0, st));
  EXPECT_THROW(embedding_forward(out, ids_f, wte, wpe, Tensor{}, 0, st), Error);       // ids dtype
  EXPECT_THROW(embedding_forward(out_b, ids, wte, wpe, Tensor{}, 0, st), Error);       // out shape
  EXPECT_THROW(embedding_forward(out, ids, wte_h, wpe, Tensor{}, 0, st), Error);       // hidden size
  EXPECT_THROW(embedding_forward(out, ids, wte, wpe_short, Tensor{}, 0, st), Error);   // P < s
  EXPECT_THROW(embedding_forward(out, ids, wte, wpe, pos_bad, 0, st), Error);          // position >= P
  EXPECT_THROW(embedding_forward(out, ids, wte, wpe, pos_shape, 0, st), Error);        // positions shape
  EXPECT_THROW(embedding_forward(out, ids, wte, wpe, Tensor{}, -1, st), Error);        // vocab_start
  EXPECT_THROW(embedding_forward(out_bf, ids, wte, wpe, Tensor{}, 0, st), Error);      // bf16 on CPU / mismatch
  OwnedTensor dwte(DType::kF32, cpu, {v, h}), dwpe(DType::kF32, cpu, {p, h}), dwte_bf(DType::kBF16, cpu, {v, h});
  EXPECT_NO_THROW(embedding_backward(dwte, dwpe, out, ids, Tensor{}, 0, false, st));
  EXPECT_THROW(embedding_backward(dwte_bf, dwpe, out, ids, Tensor{}, 0, false, st), Error);   // grads are fp32
  EXPECT_THROW(embedding_backward(dwte, dwpe, out_b, ids, Tensor{}, 0, false, st), Error);    // dout shape
  EXPECT_THROW(embedding_backward(dwte, dwpe, out, ids, pos_bad, 0, false, st), Error);       // position >= P
  EXPECT_THROW(embedding_backward(dwte, wpe_short, out, ids, Tensor{}, 0, false, st), Error); // P < s
}

}  // namespace
}  // namespace mt
