// FP8 in the grouped expert MLP (--moe-grouped-gemm with --fp8-format; docs/fp8.md "The MoE
// experts' grouped GEMM"), on the CPU emulation: a 2-layer MoE model whose experts run as grouped
// FP8 GEMMs with per-expert scales (model/moe/grouped_fp8_experts.h) against the same model with
// the sequential FP8 experts (an Fp8Linear per expert projection): same weights, same batch; the
// loss, every gradient and the FP8 scaling state agree — for tensorwise e4m3 and hybrid and for
// delayed scaling (a first step and the history update, then the compared step), SwiGLU and GELU
// experts, with 32 experts and top-1 routing of 64 tokens, so that some experts get no token
// (checked) and the others ragged counts.
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
  c.num_moe_experts = 32;
  c.moe_ffn_hidden_size = 32;
  c.moe_router_topk = 1;
  c.moe_layer_pattern = {1, 1};
  c.moe_grouped_gemm = grouped;
  c.fp8 = format;
  c.fp8_recipe = recipe;
  c.fp8_amax_history_len = 2;
  c.validate();
  return c;
}

std::vector<float> fp8_state(GPTModel& m, int64_t layers, Stream& s) {
  std::vector<float> out;
  for (int64_t l = 0; l < layers; ++l) {
    const auto [f, b] = m.fp8()->layer_state(l, s);
    for (const Tensor& t : {f, b}) {
      const auto v = testing::to_host(t, s);
      out.insert(out.end(), v.begin(), v.end());
    }
  }
  return out;
}

struct Run {
  float loss = 0;
  std::vector<float> grads, state;
  int64_t empty_experts = 0;  // tensorwise: experts whose fc1 input amax is 0 (no token) in layer 0
};

Run run(const TransformerConfig& c) {
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
  Run r;
  r.loss = testing::to_host(loss, s)[0];
  r.grads = testing::to_host(m.params().grads_flat(), s);
  r.state = fp8_state(m, c.num_layers, s);
  if (c.fp8_recipe == Fp8Recipe::kTensorwise) {
    // layer 0's fwd block [H + 3, 2n] packed, H = 0: row 0 the amaxes; the experts' columns follow
    // the four dense linears' (qkv, proj: 2 columns each; the MoE layer has no dense fc1 / fc2)
    const auto [f, bw] = m.fp8()->layer_state(0, s);
    const std::vector<float> v = testing::to_host(f, s);
    const int64_t cols = f.size(1), first = cols - 4 * c.num_moe_experts;
    for (int64_t e = 0; e < c.num_moe_experts; ++e) r.empty_experts += v[static_cast<size_t>(first + 4 * e)] == 0.f;
  }
  return r;
}

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
    const Run seq = run(moe_config(cs.recipe, cs.format, cs.gated, false));
    const Run grp = run(moe_config(cs.recipe, cs.format, cs.gated, true));
    std::printf("  loss sequential %.9g grouped %.9g; gradients rel %.3g; empty experts %lld / %lld\n", seq.loss,
                grp.loss, testing::rel_err(grp.grads, seq.grads), static_cast<long long>(seq.empty_experts),
                static_cast<long long>(grp.empty_experts));
    EXPECT_EQ(grp.loss, seq.loss);
    EXPECT_EQ(grp.grads, seq.grads);
    EXPECT_EQ(grp.state, seq.state);
    if (cs.recipe == Fp8Recipe::kTensorwise) {
      EXPECT_GT(grp.empty_experts, 0) << "no expert without tokens: the test misses the empty groups";
      EXPECT_EQ(grp.empty_experts, seq.empty_experts);
    }
  }
}

}  // namespace
}  // namespace mt
