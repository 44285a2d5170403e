// The memory check from the configuration alone (train/memory_estimate.h): its weight count is a
// lower bound of what the model declares (GPTModel::param_specs, the modules' own declarations)
// and close to it, for dense, Llama-style and MoE models under TP, PP and EP; it refuses an
// absurd model at once naming the flags, and never overflows.
#include <gtest/gtest.h>

#include <chrono>

#include "model/gpt_model.h"
#include "testing/testing.h"
#include "train/memory_estimate.h"

namespace mt {
namespace {

struct Layout {
  int tp = 1, pp = 1, ep = 1;
};

// The weights of the most loaded stage as the modules declare them (TP rank 0, EP rank 0):
// every element, and those of expert parameters.
std::pair<long double, long double> declared_largest(const TransformerConfig& c, const Layout& l) {
  pipeline::PipelineLayout layout;
  layout.num_layers = c.num_layers;
  layout.pp = l.pp;
  long double best = 0, best_expert = 0;
  for (int r = 0; r < l.pp; ++r) {
    long double all = 0, expert = 0;
    for (const ParamSpec& p : GPTModel::param_specs(c, l.tp, 0, pipeline::layers_of(r, layout), l.ep, 0)) {
      long double n = 1;
      for (int64_t d : p.shape) n *= static_cast<long double>(d);
      all += n;
      if (p.expert) expert += n;
    }
    if (all > best) best = all, best_expert = expert;
  }
  return {best, best_expert};
}

StageWeights estimated(const TransformerConfig& c, const Layout& l) {
  pipeline::PipelineLayout layout;
  layout.num_layers = c.num_layers;
  layout.pp = l.pp;
  return largest_stage_weights(c, l.tp, l.ep, layout);
}

TransformerConfig gpt() {
  TransformerConfig c;
  c.num_layers = 4;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.seq_length = 32;
  c.max_position_embeddings = 128;
  c.vocab_size = 1000;
  return c;
}

TransformerConfig llama() {
  TransformerConfig c = gpt();
  c.gated_linear_unit = true;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.num_attention_heads = 8;
  c.num_query_groups = 2;
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  return c;
}

TransformerConfig moe() {
  TransformerConfig c = llama();
  c.num_moe_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 48;
  c.moe_shared_expert_intermediate_size = 32;
  c.moe_layer_pattern = {0, 1, 1, 0};
  return c;
}

TEST(MemoryFromConfig, WeightsAreALowerBoundOfTheDeclaredParameters) {
  const std::vector<std::pair<TransformerConfig, Layout>> cases = {
      {gpt(), {}},          {gpt(), {2, 2, 1}},   {llama(), {}}, {llama(), {2, 2, 1}},
      {moe(), {1, 1, 1}},   {moe(), {1, 2, 2}},   {moe(), {2, 2, 2}},
  };
  for (const auto& [c, l] : cases) {
    SCOPED_TRACE(::testing::Message() << c.summary() << " tp " << l.tp << " pp " << l.pp << " ep " << l.ep);
    const auto [declared, declared_expert] = declared_largest(c, l);
    const StageWeights w = estimated(c, l);
    EXPECT_LE(w.total(), declared);
    EXPECT_GE(w.total(), 0.95L * declared);  // only norms and biases are left out
    EXPECT_EQ(w.expert, declared_expert);   // experts have no biases: exact
  }
  // Multi-token prediction of an untied model under PP: the last stage also holds a copy of the
  // word embedding (padded to 1024 rows), the most loaded stage then.
  TransformerConfig with_mtp = llama();
  with_mtp.mtp_num_layers = 1;
  EXPECT_EQ(estimated(with_mtp, {1, 2, 1}).total() - estimated(llama(), {1, 2, 1}).total(), 1024.0L * 64);
  EXPECT_GT(declared_largest(with_mtp, {1, 2, 1}).first - declared_largest(llama(), {1, 2, 1}).first, 1024.0L * 64);
  // Before --moe-layer-freq is parsed (an empty pattern) each layer counts as the lighter kind.
  TransformerConfig unparsed = moe();
  unparsed.moe_layer_pattern.clear();
  TransformerConfig all_moe = moe(), all_dense = moe();
  all_moe.moe_layer_pattern = {1, 1, 1, 1};
  all_dense.moe_layer_pattern = {0, 0, 0, 0};
  EXPECT_EQ(estimated(unparsed, {}).total(),
            std::min(estimated(all_moe, {}).total(), estimated(all_dense, {}).total()));
}

TEST(MemoryFromConfig, AbsurdModelRefusedAtOnceNamingTheFlags) {
  TransformerConfig c = gpt();
  c.num_layers = 100000;
  c.hidden_size = 1024;
  c.num_attention_heads = 16;
  pipeline::PipelineLayout layout;
  layout.num_layers = c.num_layers;
  ConfigMemoryOptions o;
  const auto t0 = std::chrono::steady_clock::now();
  testing::expect_error([&] { check_config_memory(c, 1, 1, layout, o, Device::cpu()); },
                        "training cannot fit: the weights, gradients and optimizer state of the model (--num-layers "
                        "100000, --hidden-size 1024");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.1);
  // Sizes whose products overflow 64-bit integers are still counted (long double), and refused.
  c.num_layers = 4'000'000'000'000'000'000;
  c.hidden_size = 3'000'000'000;
  layout.num_layers = c.num_layers;
  testing::expect_error([&] { check_config_memory(c, 1, 1, layout, o, Device::cpu()); }, "--num-layers 4000000000000000000");
  // A small model fits.
  pipeline::PipelineLayout small;
  small.num_layers = gpt().num_layers;
  check_config_memory(gpt(), 1, 1, small, o, Device::cpu());
}

}  // namespace
}  // namespace mt
