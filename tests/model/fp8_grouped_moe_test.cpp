// FP8 in the grouped expert MLP (--moe-grouped-gemm with --fp8-format; docs/fp8.md "The grouped
// expert MLP"), on the CPU emulation: a 2-layer MoE model whose experts run as grouped FP8 GEMMs
// with per-expert scales (model/moe/grouped_fp8_experts.h) against the same model with the
// sequential FP8 experts (an Fp8Linear per expert projection): same weights, same batch. For
// tensorwise e4m3 and hybrid and delayed scaling (a first step and the history update, then the
// compared step), SwiGLU and GELU experts, a dense layer 0 (so that the experts of the MoE layer 1
// get the same input in both runs), 64 experts with top-1 routing of 64 tokens (so that
// about a third of the experts get no token — checked — and the others ragged counts): the loss,
// every expert weight's gradient and the experts' x / w FP8 state (amaxes, scales, histories) are
// equal within fp32 rounding, mostly bitwise (kLossTol below). The rest differs by fp32 rounding
// only (measured over 5 seeds: gradients ≤ 3e-8,
// the experts' dy amaxes ≤ 8e-8; bound 1e-6): the
// grouped experts take the allgather dispatcher's sync-free path, whose dispatch and combine
// backward sum in another order than the host-count path (bf16 grouped GEMM: the same
// difference, gpt_test's MoEGroupedGemmMatchesPerExpertLoop) — the other parameters' gradients
// (and, with an MoE layer before, the input and dy of the next MoE layer's experts).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "model/fp8/fp8_model.h"
#include "model/gpt_model.h"
#include "ops/elementwise.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;

TransformerConfig moe_config(Fp8Recipe recipe, Fp8Format format, bool gated, bool grouped) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.seq_length = 32;
  c.vocab_size = 500;
  c.make_vocab_size_divisible_by = 64;
  c.hidden_dropout = c.attention_dropout = 0.f;
  c.attention_backend = AttentionBackend::kLocal;
  c.gated_linear_unit = gated;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  c.num_moe_experts = 64;
  c.moe_ffn_hidden_size = 32;
  c.moe_router_topk = 1;
  c.moe_layer_pattern = {0, 1};  // layer 1's experts see the same input in both runs
  c.moe_grouped_gemm = grouped;
  c.fp8 = format;
  c.fp8_recipe = recipe;
  c.fp8_amax_history_len = 2;
  c.validate();
  return c;
}

// The FP8 state of every layer (Fp8Model::layer_state: fwd [H + 3, 2n], bwd [H + 3, n], n = 2 + 2E
// linears in the MoE layer 1: qkv, proj, then each expert's fc1 and fc2; layer 0 is dense): the
// experts' x and w columns (fwd), their dy columns (bwd), and the other linears' columns.
struct StateParts {
  std::vector<float> expert_fwd, expert_bwd, dense;
};
StateParts fp8_state(GPTModel& m, int64_t layers, Stream& s) {
  StateParts p;
  for (int64_t l = 0; l < layers; ++l) {
    const auto [f, b] = m.fp8()->layer_state(l, s);
    const bool moe = l == 1;  // layer 0 is dense: qkv, proj, fc1, fc2
    for (const auto& [t, first, out] : {std::tuple<Tensor, int64_t, std::vector<float>*>{f, moe ? 4 : 8, &p.expert_fwd},
                                        {b, moe ? 2 : 4, &p.expert_bwd}}) {
      const auto v = testing::to_host(t, s);
      const int64_t cols = t.size(1);
      for (size_t i = 0; i < v.size(); ++i) (static_cast<int64_t>(i) % cols >= first ? *out : p.dense).push_back(v[i]);
    }
  }
  return p;
}

struct ModelRun {
  float loss = 0;
  StateParts state;
  std::vector<std::vector<float>> grads;  // per parameter
  std::vector<std::string> names;
  int64_t empty_experts = 0;  // tensorwise: experts whose fc1 input amax is 0 (no token)
};

ModelRun run_model(const TransformerConfig& c) {
  const int64_t b = 2;
  Stream s(Device::cpu());
  GPTModel m(c, b, DType::kF32, Device::cpu(), ProcessGroups::single());
  m.params().initialize(testing::test_seed(), s);
  testing::test_rng().seed(testing::test_seed());
  const auto tok = testing::randint(c.seq_length * b, 0, 500), lab = testing::randint(c.seq_length * b, 0, 500);
  OwnedTensor t = testing::make_int_tensor(tok, Device::cpu(), {c.seq_length, b}, s);
  OwnedTensor l = testing::make_int_tensor(lab, Device::cpu(), {c.seq_length, b}, s);
  OwnedTensor loss(DType::kF32, Device::cpu(), {1});
  const MicroBatch mb{t.t, l.t, Tensor()};
  const DropoutContext dc{7, 11, 0, true};
  const float wgt = 1.0f / static_cast<float>(c.seq_length * b);
  auto step = [&] {
    fill(loss, 0.f, s);
    m.params().zero_grads(s);
    m.forward(mb, dc, loss, wgt, s);
    m.backward(mb, dc, wgt, Tensor(), s);
  };
  if (c.fp8_recipe == Fp8Recipe::kDelayed) {
    step();
    m.finish_step(s);
  }
  step();
  ModelRun r;
  r.loss = testing::to_host(loss, s)[0];
  for (size_t i = 0; i < m.params().size(); ++i) {
    r.grads.push_back(testing::to_host(m.params().grad(i), s));
    r.names.push_back(m.params().info(i).name);
  }
  r.state = fp8_state(m, c.num_layers, s);
  if (c.fp8_recipe == Fp8Recipe::kTensorwise) {
    // layer 1's fwd block [H + 3, 2n] packed, H = 0: row 0 the amaxes; the experts' columns follow
    // qkv's and proj's (2 columns each; the MoE layer has no dense fc1 / fc2)
    const auto [f, bw] = m.fp8()->layer_state(1, s);
    const std::vector<float> v = testing::to_host(f, s);
    const int64_t cols = f.size(1), first = cols - 4 * c.num_moe_experts;
    for (int64_t e = 0; e < c.num_moe_experts; ++e) r.empty_experts += v[static_cast<size_t>(first + 4 * e)] == 0.f;
  }
  return r;
}

// Largest element-wise relative difference (both zero: equal).
double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double m = std::max(std::fabs(double(a[i])), std::fabs(double(b[i])));
    if (m > 0) d = std::max(d, std::fabs(double(a[i]) - b[i]) / m);
  }
  return d;
}

// Tolerances: fp32 rounding. Bitwise equality held for the seeds first tried but not for all: in
// 48 runs (12 seeds x 4 cases, CPU, 2026-11-29) the loss was always equal, 3 runs had an expert
// x / w FP8 state entry off by <= 9e-8 relative and 2 had 1-2 expert gradients off by <= 1.8e-7
// (relative L2), the rest bitwise (the source of the last-bit difference is not found yet). An FP8
// scale, operand or per-expert scaling mistake is off by O(1e-2) or more.
constexpr double kLossTol = 1e-6, kStateTol = 1e-6, kExpertGradTol = 1e-6;

TEST(Fp8GroupedMoe, GroupedEqualsSequentialExperts) {
  struct Case {
    Fp8Recipe recipe;
    Fp8Format format;
    bool gated;
  };
  for (const Case& cs : {Case{Fp8Recipe::kTensorwise, Fp8Format::kE4M3, true},
                         Case{Fp8Recipe::kTensorwise, Fp8Format::kHybrid, false},
                         Case{Fp8Recipe::kDelayed, Fp8Format::kHybrid, true},
                         Case{Fp8Recipe::kDelayed, Fp8Format::kE4M3, false}}) {
    SCOPED_TRACE(::testing::Message() << fp8_recipe_name(cs.recipe) << " " << fp8_format_name(cs.format)
                                      << (cs.gated ? " swiglu" : " gelu"));
    const ModelRun seq = run_model(moe_config(cs.recipe, cs.format, cs.gated, false));
    const ModelRun grp = run_model(moe_config(cs.recipe, cs.format, cs.gated, true));
    std::printf("  loss sequential %.9g grouped %.9g; empty experts %lld / %lld\n", seq.loss, grp.loss,
                static_cast<long long>(seq.empty_experts), static_cast<long long>(grp.empty_experts));
    const double dloss = std::fabs(grp.loss - seq.loss) / std::fabs(seq.loss),
                 dfwd = max_rel(grp.state.expert_fwd, seq.state.expert_fwd);
    EXPECT_LE(dloss, kLossTol);
    EXPECT_LE(dfwd, kStateTol) << "the experts' x and w FP8 state";
    // the experts' dy arrives through the combine backward
    const double dbwd = max_rel(grp.state.expert_bwd, seq.state.expert_bwd),
                 dother = max_rel(grp.state.dense, seq.state.dense);
    std::printf("  loss rel %.3g; FP8 state: experts' x, w within rel %.3g, dy %.3g; other linears' %.3g\n", dloss,
                dfwd, dbwd, dother);
    EXPECT_LE(dbwd, kStateTol) << "the experts' dy FP8 state";
    EXPECT_LE(dother, kStateTol) << "the other linears' FP8 state";
    int64_t expert_tensors = 0, bitwise = 0;
    double other = 0, expert = 0;
    for (size_t i = 0; i < seq.names.size(); ++i) {
      if (seq.names[i].find(".experts.") != std::string::npos) {
        ++expert_tensors;
        bitwise += grp.grads[i] == seq.grads[i];
        expert = std::max(expert, testing::rel_err(grp.grads[i], seq.grads[i]));
      } else {
        other = std::max(other, testing::rel_err(grp.grads[i], seq.grads[i]));
      }
    }
    std::printf("  expert gradients: %lld of %lld tensors bitwise, worst rel %.3g; the other gradients within rel %.3g\n",
                static_cast<long long>(bitwise), static_cast<long long>(expert_tensors), expert, other);
    EXPECT_LE(expert, kExpertGradTol);
    EXPECT_EQ(expert_tensors, 2 * 64);
    EXPECT_LT(other, 1e-6);
    if (cs.recipe == Fp8Recipe::kTensorwise) {
      EXPECT_GT(grp.empty_experts, 0) << "no expert without tokens: the test misses the empty groups";
      EXPECT_EQ(grp.empty_experts, seq.empty_experts);
    }
  }
}

}  // namespace
}  // namespace mt
