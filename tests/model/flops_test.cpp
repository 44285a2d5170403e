// TransformerConfig::flops_per_iteration against Megatron-Core's num_floating_point_operations
// (megatron/training/training.py, transformer_flops) evaluated by hand — in exact integer
// arithmetic, outside this code — for GPT-2 124M, a Llama-3-8B-style model (GQA, SwiGLU), a
// Mixtral-style MoE (every layer, top-2 of 8 experts) and an MoE with dense layers and a shared
// expert. Per token and iteration: 6 × (L·(h·(n·d + 2·g·d) + n·d·s + n·d·h) + h·c·F + h·V), with
// the causal attention counting half of the s² term.
#include <gtest/gtest.h>

#include "model/transformer_config.h"

namespace mt {
namespace {

void expect_flops(const TransformerConfig& c, int64_t batch, int tp, double hand) {
  EXPECT_NEAR(c.flops_per_iteration(batch, tp) / hand, 1.0, 1e-13) << c.summary();
}

/// A Llama-style model: GQA, SwiGLU, RMSNorm, RoPE, no biases, untied output layer.
TransformerConfig llama_style(int64_t layers, int64_t hidden, int64_t heads, int64_t groups, int64_t ffn, int64_t seq,
                              int64_t vocab) {
  TransformerConfig c;
  c.num_layers = layers;
  c.hidden_size = hidden;
  c.num_attention_heads = heads;
  c.num_query_groups = groups;
  c.ffn_hidden_size = ffn;
  c.gated_linear_unit = true;
  c.seq_length = seq;
  c.vocab_size = vocab;
  c.add_bias_linear = false;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.untie_embeddings_and_output_weights = true;
  return c;
}

TEST(Flops, Gpt2Small) {
  TransformerConfig c;  // the GPT-2 defaults: 12 layers, h 768, 12 heads, f 3072, GELU
  c.vocab_size = 50257;
  c.seq_length = 1024;
  // 6·8·1024·(12·(768·2304 + 768·1024 + 768·768) + 2·768·3072·12 + 768·50304)
  expect_flops(c, 8, 1, 6537477095424.0);
  // at TP 2 the vocabulary is padded to 50432 (a multiple of 128·2), as Megatron counts it
  expect_flops(c, 8, 2, 6542308933632.0);
}

TEST(Flops, LlamaGqaSwiglu) {
  // Llama 3 8B: 32 layers, h 4096, 32 heads, 8 key/value groups, SwiGLU 14336, seq 8192
  expect_flops(llama_style(32, 4096, 32, 8, 14336, 8192, 128256), 4, 1, 1686582117531648.0);
}

TEST(Flops, MoeTopK) {
  // Mixtral 8x7B: 32 MoE layers, top-2 of 8 experts of 14336, GQA 8, seq 4096
  TransformerConfig c = llama_style(32, 4096, 32, 8, 14336, 4096, 32000);
  c.num_moe_experts = 8;
  c.moe_router_topk = 2;
  expect_flops(c, 2, 1, 652955288076288.0);

  // a dense first layer (f 2816), then MoE layers of top-4 of 16 experts of 512 and a shared 1024
  TransformerConfig m = llama_style(4, 1024, 16, 4, 2816, 2048, 32000);
  m.num_moe_experts = 16;
  m.moe_layer_pattern = parse_moe_layer_freq("[0,1,1,1]", 4);
  m.moe_ffn_hidden_size = 512;
  m.moe_router_topk = 4;
  m.moe_shared_expert_intermediate_size = 1024;
  expect_flops(m, 16, 1, 17420387352576.0);
}

// Multi-latent attention (Megatron's MLA branch of transformer_flops), per token and layer
// 6·(q_term + r_kv·(h + n·(d_n + d_v) + 1) + h·d_r + n·d_v·h) + 6·s·(n·(d_n + d_r)/2 + n·d_v/2),
// q_term = h·n·(d_n + d_r) without a query latent, r_q·(h + n·(d_n + d_r) + 1) with one. The
// DeepSeek-V3-shaped model of issue 43: 16 layers, h 2048, 16 heads, d_n 128, d_r 64, d_v 128,
// kv-lora 512, the first layer dense (SwiGLU 10944), then 64 experts of 1408 top-6 and a shared
// 1408, s 4096, vocabulary 129280, 8 sequences (hand values in exact integer arithmetic).
TEST(Flops, MultiLatentAttention) {
  TransformerConfig c = llama_style(16, 2048, 16, 0, 10944, 4096, 129280);
  c.multi_latent_attention = true;
  c.kv_lora_rank = 512;
  c.qk_head_dim = 128;
  c.qk_pos_emb_head_dim = 64;
  c.v_head_dim = 128;
  c.num_moe_experts = 64;
  c.moe_layer_pattern = parse_moe_layer_freq("[0]+[1]*15", 16);
  c.moe_ffn_hidden_size = 1408;
  c.moe_router_topk = 6;
  c.moe_shared_expert_intermediate_size = 1408;
  expect_flops(c, 8, 1, 320139882921984.0);
  c.q_lora_rank = 1536;
  expect_flops(c, 8, 1, 325092517085184.0);
}

// The count before issue 41 took the attention scores in full (1 + g/n + s/h instead of
// 1 + g/n + s/(2h)): for the 7B-class Llama of the issue (32 layers, h 4096, MHA, SwiGLU 11008,
// s 4096, GPT-2's vocabulary) the TFLOP/s it printed are 1/0.93078 of today's (docs/flags.md).
TEST(Flops, RatioToTheFullAttentionCount) {
  const TransformerConfig c = llama_style(32, 4096, 32, 32, 11008, 4096, 50257);
  const double s = 4096, h = 4096, L = 32, f = 11008, V = 50304, B = 1;
  const double full = 12 * B * s * L * h * h * ((2 + s / h) + f / h * 1.5 + V / (2 * L * h));
  EXPECT_NEAR(c.flops_per_iteration(1) / full, 0.9307780707, 1e-9);
}

}  // namespace
}  // namespace mt
