// Generation with the key/value cache (train/inference.h): greedy decoding with the cache gives
// the tokens of the reference path that recomputes the whole prefix for every token, for a batch
// of prompts of different lengths (GPT-2 style and Llama style: RoPE, GQA, SwiGLU, RMSNorm); and
// TP 2, PP 2 and TP 2 x PP 2 (CPU ranks as threads) give the tokens of one rank. Also the
// kv_cache_attention op against ops/attention.h in one shot and token by token.
#include <gtest/gtest.h>

#include <mutex>
#include <set>

#include "comm/thread_comm.h"
#include "model/inference_context.h"
#include "ops/attention.h"
#include "ops/elementwise.h"
#include "ops/kv_cache_attention.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include "testing/testing.h"
#include "train/inference.h"

namespace mt {
namespace {

using testing::OwnedTensor;

TEST(KvCacheAttention, EqualsCausalAttentionInOneShotAndStepByStep) {
  const int64_t s = 7, b = 2, g = 2, qpg = 2, d = 8, smax = 9;
  Stream st(Device::cpu());
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(s * b * g * (qpg + 2) * d));
  for (auto& v : x) v = nd(rng);
  OwnedTensor qkv(DType::kF32, Device::cpu(), {s, b, g, qpg + 2, d});
  std::copy(x.begin(), x.end(), qkv.t.data_as<float>());
  // Reference: ops/attention.h causal attention (no dropout).
  OwnedTensor ref(DType::kF32, Device::cpu(), {s, b, g * qpg * d});
  OwnedTensor q(DType::kF32, Device::cpu(), {b, g * qpg, s, d}), k(DType::kF32, Device::cpu(), {b, g, s, d}),
      v(DType::kF32, Device::cpu(), {b, g, s, d}), probs(DType::kF32, Device::cpu(), {b, g * qpg, s, s}),
      dq(DType::kF32, Device::cpu(), {b, g * qpg, s, d});
  AttentionBuffers buf;
  buf.q = q.t;
  buf.k = k.t;
  buf.v = v.t;
  buf.probs = probs.t;
  buf.dq = dq.t;
  AttentionConfig ac;
  ac.seq = s;
  ac.batch = b;
  ac.heads = g * qpg;
  ac.groups = g;
  ac.head_dim = d;
  ac.softmax_scale = 0.3f;
  attention_forward(ref.t, qkv.t, buf, ac, st);
  const float* r = ref.t.data_as<float>();
  for (int split : {0, 1}) {
    OwnedTensor kc(DType::kF32, Device::cpu(), {b, g, smax, d}), vc(DType::kF32, Device::cpu(), {b, g, smax, d});
    OwnedTensor out(DType::kF32, Device::cpu(), {s, b, g * qpg * d});
    fill(out.t, std::nanf(""), st);
    KvCacheAttentionConfig kcfg;
    kcfg.softmax_scale = 0.3f;
    if (split == 0) {
      kv_cache_attention_forward(out.t, qkv.t, kc.t, vc.t, kcfg, st);
    } else {  // a prefill of 3 tokens, then one token at a time
      kv_cache_attention_forward(out.t.slice0(0, 3), qkv.t.slice0(0, 3), kc.t, vc.t, kcfg, st);
      for (int64_t i = 3; i < s; ++i) {
        kcfg.offset = i;
        kv_cache_attention_forward(out.t.slice0(i, i + 1), qkv.t.slice0(i, i + 1), kc.t, vc.t, kcfg, st);
      }
    }
    const float* o = out.t.data_as<float>();
    for (int64_t i = 0; i < out.t.numel(); ++i) ASSERT_NEAR(o[i], r[i], 1e-5f) << "split " << split << " at " << i;
  }
  OwnedTensor small(DType::kF32, Device::cpu(), {b, g, 3, d});
  OwnedTensor out(DType::kF32, Device::cpu(), {s, b, g * qpg * d});
  KvCacheAttentionConfig kcfg;
  kcfg.softmax_scale = 0.3f;
  EXPECT_THROW(kv_cache_attention_forward(out.t, qkv.t, small.t, small.t, kcfg, st), Error);  // s > S_max
}

/// 0: GPT-2 style; 1: Llama style; 2: Llama style with multi-latent attention (query latent, YaRN
/// beyond the original context, value heads padded to d_n + d_r).
TransformerConfig config(int arch) {
  const bool llama = arch > 0;
  TransformerConfig c;
  c.num_layers = 4;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.seq_length = 24;
  c.vocab_size = 61;
  c.make_vocab_size_divisible_by = 8;
  c.hidden_dropout = c.attention_dropout = 0.f;
  c.init_method_std = 0.3f;  // spread logits: no near-ties in the argmax
  if (llama) {
    c.num_query_groups = 2;
    c.ffn_hidden_size = 48;
    c.gated_linear_unit = true;
    c.normalization = Normalization::kRMSNorm;
    c.position_embedding_type = PositionEmbeddingType::kRope;
    c.untie_embeddings_and_output_weights = true;
    c.add_bias_linear = false;
  }
  if (arch == 2) {
    c.num_query_groups = 0;
    c.multi_latent_attention = true;
    c.q_lora_rank = 12;
    c.kv_lora_rank = 8;
    c.qk_head_dim = 6;
    c.qk_pos_emb_head_dim = 4;
    c.v_head_dim = 5;
    c.rotary_scaling_factor = 4.f;
    c.original_max_position_embeddings = 8;
    c.mscale_all_dim = 0.5f;
  }
  return c;
}

const std::vector<std::vector<int32_t>> kPrompts = {{3, 14, 15, 9, 2, 6}, {5}, {35, 8, 9, 7}};

/// Generates greedily from kPrompts on tp x pp thread ranks; returns rank 0's result (and checks
/// that every rank returned the same tokens).
GenerationResult run(int arch, int tp, int pp, bool cache, int64_t max_new = 12, int32_t eod = -1) {
  const TransformerConfig c = config(arch);
  GenerationResult out;
  std::mutex mu;
  std::vector<std::vector<std::vector<int32_t>>> all(static_cast<size_t>(tp * pp));
  run_thread_ranks(tp * pp, [&](int rank, std::shared_ptr<Communicator> world) {
    ParallelConfig pc;
    pc.tp = tp;
    pc.pp = pp;
    validate_and_derive(pc, tp * pp);
    const ProcessGroups g = build_process_groups(world, pc);
    pipeline::PipelineLayout layout;
    layout.num_layers = c.num_layers;
    layout.pp = pp;
    ModelLayout ml;
    for (const auto& r : pipeline::layers_of(g.pp->rank(), layout)) ml.chunks.push_back({r, 1, 1});
    Stream st(Device::cpu());
    GPTModel model(c, 1, DType::kF32, Device::cpu(), g, false, ParamLayout{}, ml);
    model.params().initialize(99, st);
    TextGenerator gen(model, 3, c.seq_length, st);
    GenerationOptions o;
    o.max_new_tokens = max_new;
    o.sampling.greedy = true;
    o.use_cache = cache;
    o.eod = eod;
    GenerationResult r = gen.generate(kPrompts, o);
    std::lock_guard<std::mutex> lock(mu);
    all[static_cast<size_t>(rank)] = r.tokens;
    if (rank == 0) out = r;
  });
  for (const auto& r : all) EXPECT_EQ(r, out.tokens);
  return out;
}

class Generation : public ::testing::TestWithParam<int> {};

TEST_P(Generation, KvCacheEqualsRecomputation) {
  const GenerationResult ref = run(GetParam(), 1, 1, false), kv = run(GetParam(), 1, 1, true);
  ASSERT_EQ(ref.tokens.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(ref.tokens[i].size(), kPrompts[i].size() + 12);
    EXPECT_TRUE(std::equal(kPrompts[i].begin(), kPrompts[i].end(), kv.tokens[i].begin()));
  }
  EXPECT_EQ(kv.tokens, ref.tokens);
  EXPECT_EQ(kv.generated_tokens, 36);
  std::set<int32_t> distinct;  // a non-degenerate continuation (the comparison has something to catch)
  for (size_t i = 0; i < 3; ++i) distinct.insert(kv.tokens[i].begin() + static_cast<std::ptrdiff_t>(kPrompts[i].size()), kv.tokens[i].end());
  EXPECT_GE(distinct.size(), 4u);
}

TEST_P(Generation, TensorAndPipelineParallelEqualOneRank) {
  const GenerationResult one = run(GetParam(), 1, 1, true);
  EXPECT_EQ(run(GetParam(), 2, 1, true).tokens, one.tokens);
  EXPECT_EQ(run(GetParam(), 1, 2, true).tokens, one.tokens);
  EXPECT_EQ(run(GetParam(), 2, 2, true).tokens, one.tokens);
}

INSTANTIATE_TEST_SUITE_P(Arch, Generation, ::testing::Values(0, 1, 2), [](const auto& info) {
  return info.param == 2 ? "Mla" : info.param == 1 ? "Llama" : "Gpt";
});

TEST(Generation, StopsAtEodAndAtTheContext) {
  const GenerationResult ref = run(0, 1, 1, true);
  // Take the 3rd generated token of prompt 1 as the end-of-document token: prompt 1 stops there
  // (the eod included); the others stop at it too if they produce it, else at max_new_tokens.
  const int32_t eod = ref.tokens[1][kPrompts[1].size() + 2];
  const GenerationResult r = run(0, 1, 1, true, 12, eod);
  for (size_t i = 0; i < 3; ++i) {
    const auto& full = ref.tokens[i];
    auto it = std::find(full.begin() + static_cast<std::ptrdiff_t>(kPrompts[i].size()), full.end(), eod);
    const size_t expect = it == full.end() ? full.size() : static_cast<size_t>(it - full.begin()) + 1;
    EXPECT_EQ(r.tokens[i].size(), expect) << "prompt " << i;
    EXPECT_TRUE(std::equal(r.tokens[i].begin(), r.tokens[i].end(), full.begin()));
  }
  // max_new_tokens beyond the context (24): every sequence ends at 24 tokens.
  const GenerationResult longer = run(0, 1, 1, true, 100);
  for (const auto& t : longer.tokens) EXPECT_EQ(t.size(), 24u);
}

TEST(Generation, BadRequests) {
  const TransformerConfig c = config(0);
  Stream st(Device::cpu());
  GPTModel model(c, 1, DType::kF32, Device::cpu(), ProcessGroups::single());
  model.params().initialize(1, st);
  TextGenerator gen(model, 2, c.seq_length, st);
  GenerationOptions o;
  o.sampling.greedy = true;
  EXPECT_THROW(gen.generate({}, o), Error);
  EXPECT_THROW(gen.generate({{1}, {2}, {3}}, o), Error);         // more prompts than the batch
  EXPECT_THROW(gen.generate({{}}, o), Error);                      // empty prompt
  EXPECT_THROW(gen.generate({std::vector<int32_t>(24, 1)}, o), Error);  // no room for a new token
  EXPECT_THROW(gen.generate({{1, 61}}, o), Error);                 // outside the vocabulary
  o.sampling.greedy = false;
  o.sampling.temperature = 0.f;
  EXPECT_THROW(gen.generate({{1}}, o), Error);
  o.sampling.temperature = 1.f;
  o.sampling.top_p = 2.f;
  EXPECT_THROW(gen.generate({{1}}, o), Error);
  // Sampling is reproducible for a seed.
  o.sampling.top_p = 0.9f;
  o.sampling.top_k = 5;
  EXPECT_EQ(gen.generate({{1, 2}, {3}}, o).tokens, gen.generate({{1, 2}, {3}}, o).tokens);
}

}  // namespace
}  // namespace mt
