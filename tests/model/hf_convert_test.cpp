// Hugging Face interchange (model/hf/hf_convert.h, train/hf_commands.h) on hand-built fixtures:
// for each architecture a tiny config.json and safetensors file written by the test, the
// per-layer mapping checked element by element against the layouts the header documents,
// import -> export round trips bitwise (fp32 and bf16, single file and sharded), the imported
// checkpoint loads as a model, and every documented error.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include <nlohmann/json.hpp>

#include "model/gpt_model.h"
#include "model/hf/hf_convert.h"
#include "testing/testing.h"
#include "train/checkpoint.h"
#include "train/hf_commands.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using hf::HfArchitecture;

// Tiny sizes: hidden 16, 4 heads of 4 (2 key/value groups for Llama/Qwen), ffn 24, 2 layers,
// vocabulary 37, 12 positions; MoE: 4 experts, top-2, Mixtral's experts of ffn 24, Qwen 3 MoE's of
// 8 with layer 0 dense (mlp_only_layers [0]).
constexpr int64_t kH = 16, kN = 4, kG = 2, kD = 4, kF = 24, kL = 2, kV = 37, kP = 12;
constexpr int64_t kE = 4, kK = 2, kFe = 8, kFs = 12;  // kFs: Qwen 2 MoE's shared expert

bool moe(HfArchitecture a) {
  return a == HfArchitecture::kMixtral || a == HfArchitecture::kQwen3Moe || a == HfArchitecture::kQwen2Moe;
}
bool qwen_moe(HfArchitecture a) { return a == HfArchitecture::kQwen3Moe || a == HfArchitecture::kQwen2Moe; }
bool qkv_bias(HfArchitecture a) { return a == HfArchitecture::kQwen2 || a == HfArchitecture::kQwen2Moe; }
// Whether layer l of the fixture is a MoE layer.
bool moe_layer(HfArchitecture a, int64_t l) { return a == HfArchitecture::kMixtral || (qwen_moe(a) && l != 0); }
// The experts' hidden size of the fixture.
int64_t expert_ffn(HfArchitecture a) { return a == HfArchitecture::kMixtral ? kF : kFe; }

struct Fixture {
  fs::path dir;
  std::map<std::string, std::vector<float>> tensors;
  std::map<std::string, std::vector<int64_t>> shapes;
};

fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / fmt::format("mt_hf_{}_{}_{}", name, getpid(), testing::test_seed());
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

json config_json(HfArchitecture a) {
  if (a == HfArchitecture::kGpt2)
    return {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"n_embd", kH}, {"n_layer", kL},
            {"n_head", kN}, {"n_positions", kP}, {"n_inner", kF}, {"vocab_size", kV},
            {"layer_norm_epsilon", 1e-5}, {"activation_function", "gelu_new"}, {"bos_token_id", 5}};
  json j = {{"architectures", {hf::architecture_name(a)}}, {"hidden_size", kH}, {"num_hidden_layers", kL},
            {"num_attention_heads", kN}, {"num_key_value_heads", kG}, {"head_dim", kD}, {"intermediate_size", kF},
            {"max_position_embeddings", kP}, {"rms_norm_eps", 1e-6}, {"rope_theta", 500000.0},
            {"vocab_size", kV}, {"hidden_act", "silu"}, {"tie_word_embeddings", a == HfArchitecture::kQwen2}};
  if (a == HfArchitecture::kMixtral) {
    j.update({{"model_type", "mixtral"}, {"num_local_experts", kE}, {"num_experts_per_tok", kK},
              {"router_aux_loss_coef", 0.02}, {"output_router_logits", false}, {"sliding_window", nullptr},
              {"router_jitter_noise", 0.0}});
  } else if (a == HfArchitecture::kQwen3Moe) {
    j.update({{"model_type", "qwen3_moe"}, {"num_experts", kE}, {"num_experts_per_tok", kK},
              {"moe_intermediate_size", kFe}, {"norm_topk_prob", true}, {"decoder_sparse_step", 1},
              {"mlp_only_layers", {0}}, {"router_aux_loss_coef", 0.001}, {"output_router_logits", false},
              {"attention_bias", false}, {"use_sliding_window", false}});
  } else if (a == HfArchitecture::kQwen2Moe) {  // Qwen1.5-MoE-style: not renormalised, a gated shared expert
    j.update({{"model_type", "qwen2_moe"}, {"num_experts", kE}, {"num_experts_per_tok", kK},
              {"moe_intermediate_size", kFe}, {"shared_expert_intermediate_size", kFs}, {"norm_topk_prob", false},
              {"decoder_sparse_step", 1}, {"mlp_only_layers", {0}}, {"router_aux_loss_coef", 0.001},
              {"output_router_logits", false}, {"use_sliding_window", false}, {"sliding_window", 4096},
              {"max_window_layers", 2}});
  }
  return j;
}

/// The MoE tensors of layer l (transformers' Hub names: per expert).
void add_moe_layer(HfArchitecture a, int64_t l, const std::function<void(const std::string&, std::vector<int64_t>)>& add) {
  const bool mixtral = a == HfArchitecture::kMixtral;
  const std::string p = fmt::format("model.layers.{}.{}", l, mixtral ? "block_sparse_moe." : "mlp.");
  const int64_t f = expert_ffn(a);
  add(p + "gate.weight", {kE, kH});
  for (int64_t e = 0; e < kE; ++e) {
    const std::string x = fmt::format("{}experts.{}.", p, e);
    add(x + (mixtral ? "w1" : "gate_proj") + ".weight", {f, kH});
    add(x + (mixtral ? "w3" : "up_proj") + ".weight", {f, kH});
    add(x + (mixtral ? "w2" : "down_proj") + ".weight", {kH, f});
  }
  if (a == HfArchitecture::kQwen2Moe) {
    add(p + "shared_expert.gate_proj.weight", {kFs, kH});
    add(p + "shared_expert.up_proj.weight", {kFs, kH});
    add(p + "shared_expert.down_proj.weight", {kH, kFs});
    add(p + "shared_expert_gate.weight", {1, kH});
  }
}

/// Writes config.json and model.safetensors (random values) for architecture `a`.
Fixture make_fixture(HfArchitecture a, const std::string& name, DType dtype = DType::kF32) {
  Fixture fx;
  fx.dir = temp_dir(name);
  auto add = [&](const std::string& n, std::vector<int64_t> shape) {
    int64_t k = 1;
    for (auto d : shape) k *= d;
    fx.tensors[n] = testing::rounded(testing::randn(k), dtype);
    fx.shapes[n] = shape;
  };
  if (a == HfArchitecture::kGpt2) {
    const std::string p = "transformer.";
    add(p + "wte.weight", {kV, kH});
    add(p + "wpe.weight", {kP, kH});
    for (int l = 0; l < kL; ++l) {
      const std::string s = p + fmt::format("h.{}.", l);
      add(s + "ln_1.weight", {kH});
      add(s + "ln_1.bias", {kH});
      add(s + "attn.c_attn.weight", {kH, 3 * kH});
      add(s + "attn.c_attn.bias", {3 * kH});
      add(s + "attn.c_proj.weight", {kH, kH});
      add(s + "attn.c_proj.bias", {kH});
      add(s + "ln_2.weight", {kH});
      add(s + "ln_2.bias", {kH});
      add(s + "mlp.c_fc.weight", {kH, kF});
      add(s + "mlp.c_fc.bias", {kF});
      add(s + "mlp.c_proj.weight", {kF, kH});
      add(s + "mlp.c_proj.bias", {kH});
    }
    add(p + "ln_f.weight", {kH});
    add(p + "ln_f.bias", {kH});
  } else {
    add("model.embed_tokens.weight", {kV, kH});
    for (int l = 0; l < kL; ++l) {
      const std::string s = fmt::format("model.layers.{}.", l);
      add(s + "input_layernorm.weight", {kH});
      add(s + "self_attn.q_proj.weight", {kN * kD, kH});
      add(s + "self_attn.k_proj.weight", {kG * kD, kH});
      add(s + "self_attn.v_proj.weight", {kG * kD, kH});
      if (qkv_bias(a)) {
        add(s + "self_attn.q_proj.bias", {kN * kD});
        add(s + "self_attn.k_proj.bias", {kG * kD});
        add(s + "self_attn.v_proj.bias", {kG * kD});
      }
      if (a == HfArchitecture::kQwen3 || a == HfArchitecture::kQwen3Moe) {
        add(s + "self_attn.q_norm.weight", {kD});
        add(s + "self_attn.k_norm.weight", {kD});
      }
      add(s + "self_attn.o_proj.weight", {kH, kN * kD});
      add(s + "post_attention_layernorm.weight", {kH});
      if (moe_layer(a, l)) {
        add_moe_layer(a, l, add);
        continue;
      }
      add(s + "mlp.gate_proj.weight", {kF, kH});
      add(s + "mlp.up_proj.weight", {kF, kH});
      add(s + "mlp.down_proj.weight", {kH, kF});
    }
    add("model.norm.weight", {kH});
    if (a != HfArchitecture::kQwen2) add("lm_head.weight", {kV, kH});  // Qwen 2 fixture: tied
  }
  std::vector<hf::TensorToWrite> w;
  for (const auto& [n, v] : fx.tensors) w.push_back({n, dtype, fx.shapes[n], v});
  hf::write_safetensors(fx.dir / "model.safetensors", w);
  std::ofstream(fx.dir / "config.json") << config_json(a).dump(2);
  std::ofstream(fx.dir / "tokenizer_config.json") << "{\"model_max_length\": 12}";
  return fx;
}

const HfArchitecture kAll[] = {HfArchitecture::kGpt2,    HfArchitecture::kLlama,    HfArchitecture::kQwen2,
                               HfArchitecture::kQwen3,   HfArchitecture::kMixtral,  HfArchitecture::kQwen3Moe,
                               HfArchitecture::kQwen2Moe};

TEST(HfConvert, ConfigMapsToTransformerConfig) {
  for (HfArchitecture a : kAll) {
    const Fixture fx = make_fixture(a, "config");
    const hf::HfModel m = hf::read_hf_config(fx.dir.string(), 0, 8);
    const TransformerConfig& c = m.config;
    SCOPED_TRACE(hf::architecture_name(a));
    EXPECT_EQ(m.arch, a);
    EXPECT_EQ(c.hidden_size, kH);
    EXPECT_EQ(c.num_layers, kL);
    EXPECT_EQ(c.num_attention_heads, kN);
    EXPECT_EQ(c.ffn(), kF);
    EXPECT_EQ(c.vocab_size, kV);
    EXPECT_EQ(c.padded_vocab_size(), 40);
    EXPECT_EQ(c.seq_length, kP);  // min(max positions, 4096)
    const bool gpt2 = a == HfArchitecture::kGpt2;
    EXPECT_EQ(c.query_groups(), gpt2 ? kN : kG);
    EXPECT_EQ(c.normalization, gpt2 ? Normalization::kLayerNorm : Normalization::kRMSNorm);
    EXPECT_EQ(c.position_embedding_type, gpt2 ? PositionEmbeddingType::kLearnedAbsolute : PositionEmbeddingType::kRope);
    EXPECT_EQ(c.gated_linear_unit, !gpt2);
    EXPECT_EQ(c.add_bias_linear, gpt2);
    EXPECT_EQ(c.add_qkv_bias, qkv_bias(a));
    EXPECT_EQ(c.qk_layernorm, a == HfArchitecture::kQwen3 || a == HfArchitecture::kQwen3Moe);
    EXPECT_EQ(c.tied_output(), gpt2 || a == HfArchitecture::kQwen2);
    if (!gpt2) EXPECT_EQ(c.rotary_base, 500000.f);
    EXPECT_EQ(hf::infer_architecture(c), a == HfArchitecture::kQwen2 ? HfArchitecture::kQwen2 : a);
    EXPECT_EQ(c.num_moe_experts, moe(a) ? kE : 0);
    if (moe(a)) {
      EXPECT_EQ(c.moe_router_topk, kK);
      EXPECT_EQ(c.moe_ffn(), expert_ffn(a));
      EXPECT_EQ(c.moe_router_score_function, MoeScoreFunction::kSoftmax);
      // renormalised top-k = softmax over the selected logits; Qwen 2 MoE's fixture: not renormalised
      EXPECT_EQ(c.moe_router_pre_softmax, a == HfArchitecture::kQwen2Moe);
      EXPECT_EQ(c.moe_shared_expert_intermediate_size, a == HfArchitecture::kQwen2Moe ? kFs : 0);
      EXPECT_EQ(c.moe_shared_expert_gate, a == HfArchitecture::kQwen2Moe);
      for (int64_t l = 0; l < kL; ++l) EXPECT_EQ(c.is_moe_layer(l), moe_layer(a, l)) << "layer " << l;
      EXPECT_FLOAT_EQ(c.moe_aux_coeff(MoeLoadBalancing::kAuxLoss), a == HfArchitecture::kMixtral ? 0.02f : 0.001f);
    }
    fs::remove_all(fx.dir);
  }
}

// Qwen 3 MoE's layer pattern and router normalisation from config.json: layer l is MoE unless in
// mlp_only_layers, when (l + 1) % decoder_sparse_step == 0 (transformers' Qwen3MoeDecoderLayer);
// norm_topk_prob false (transformers' default) = --moe-router-pre-softmax. Exported back, the
// fields describe the same model.
TEST(HfConvert, Qwen3MoeLayerPatternAndRouterNormalisation) {
  const Fixture fx = make_fixture(HfArchitecture::kQwen3Moe, "qmoe");
  json j = config_json(HfArchitecture::kQwen3Moe);
  j["num_hidden_layers"] = 6;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  j.erase("norm_topk_prob");
  std::ofstream(fx.dir / "config.json") << j.dump();
  const hf::HfModel m = hf::read_hf_config(fx.dir.string(), 0, 8);
  const std::vector<bool> want = {false, true, false, false, false, true};
  for (int64_t l = 0; l < 6; ++l) EXPECT_EQ(m.config.is_moe_layer(l), want[static_cast<size_t>(l)]) << "layer " << l;
  EXPECT_TRUE(m.config.moe_router_pre_softmax);
  // Exported: the imported decoder_sparse_step / mlp_only_layers are kept (they give the pattern)...
  json out = hf::make_hf_config(HfArchitecture::kQwen3Moe, m.config, m.config_json, DType::kF32);
  EXPECT_EQ(out.at("decoder_sparse_step"), 2);
  EXPECT_EQ(out.at("mlp_only_layers"), json({3}));
  EXPECT_EQ(out.at("norm_topk_prob"), false);
  EXPECT_EQ(out.at("moe_intermediate_size"), kFe);
  EXPECT_EQ(out.at("num_experts"), kE);
  // transformers 5 writes Qwen 3 MoE's num_experts as num_local_experts; read and written back so.
  j.erase("num_experts");
  j["num_local_experts"] = kE;
  std::ofstream(fx.dir / "config.json") << j.dump();
  const hf::HfModel v5 = hf::read_hf_config(fx.dir.string(), 0, 8);
  EXPECT_EQ(v5.config.num_moe_experts, kE);
  out = hf::make_hf_config(HfArchitecture::kQwen3Moe, v5.config, v5.config_json, DType::kF32);
  EXPECT_EQ(out.at("num_local_experts"), kE);
  EXPECT_FALSE(out.contains("num_experts"));
  // ... and a pattern they cannot give is written as decoder_sparse_step 1 + the dense layers.
  TransformerConfig c = m.config;
  c.moe_layer_pattern = {1, 1, 0, 1, 0, 1};
  out = hf::make_hf_config(HfArchitecture::kQwen3Moe, c, m.config_json, DType::kF32);
  EXPECT_EQ(out.at("decoder_sparse_step"), 1);
  EXPECT_EQ(out.at("mlp_only_layers"), json({2, 4}));
  // A Megatron MoE config without an imported one: Mixtral's fields from scratch.
  TransformerConfig x = m.config;
  x.qk_layernorm = false;
  x.moe_layer_pattern.clear();
  x.moe_router_pre_softmax = false;
  EXPECT_EQ(hf::infer_architecture(x), HfArchitecture::kMixtral);
  out = hf::make_hf_config(HfArchitecture::kMixtral, x, json(), DType::kBF16);
  EXPECT_EQ(out.at("model_type"), "mixtral");
  EXPECT_EQ(out.at("num_local_experts"), kE);
  EXPECT_EQ(out.at("num_experts_per_tok"), kK);
  EXPECT_EQ(out.at("intermediate_size"), kFe);
  EXPECT_TRUE(out.at("sliding_window").is_null());
  fs::remove_all(fx.dir);
}

// The per-layer mapping, element by element, against the layouts of model/hf/hf_convert.h.
TEST(HfConvert, WeightMappingLayouts) {
  for (HfArchitecture a : kAll) {
    SCOPED_TRACE(hf::architecture_name(a));
    const Fixture fx = make_fixture(a, "map");
    const hf::HfModel m = hf::read_hf_config(fx.dir.string(), 0, 8);
    const hf::GlobalTensors t = hf::hf_to_megatron(m, hf::SafetensorsCheckpoint::open(fx.dir.string()));
    // Every parameter of the model is produced, with its global size.
    for (const ParamSpec& p : GPTModel::param_specs(m.config)) {
      ASSERT_TRUE(t.count(p.name)) << p.name;
      int64_t n = 1;
      for (auto d : p.global_shape.empty() ? p.shape : p.global_shape) n *= d;
      EXPECT_EQ(static_cast<int64_t>(t.at(p.name).size()), n) << p.name;
    }
    const auto& hfw = fx.tensors;
    const std::string o = "decoder.layers.1.";
    const auto& qkv = t.at(o + "self_attention.linear_qkv.weight");
    const auto& emb = t.at("embedding.word_embeddings.weight");
    // Vocabulary: real rows copied, padding rows zero.
    const std::string wte = a == HfArchitecture::kGpt2 ? "transformer.wte.weight" : "model.embed_tokens.weight";
    for (int64_t e = 0; e < kV * kH; ++e) ASSERT_EQ(emb[e], hfw.at(wte)[e]);
    for (int64_t e = kV * kH; e < 40 * kH; ++e) ASSERT_EQ(emb[e], 0.f);
    if (a == HfArchitecture::kGpt2) {
      // c_attn [h, 3h] (Conv1D, in x out; columns q | k | v) -> per head [q; k; v] rows of [3h, h].
      const auto& c_attn = hfw.at("transformer.h.1.attn.c_attn.weight");
      for (int64_t head = 0; head < kN; ++head)
        for (int64_t comp = 0; comp < 3; ++comp)
          for (int64_t e = 0; e < kD; ++e)
            for (int64_t i = 0; i < kH; ++i)
              ASSERT_EQ(qkv[((head * 3 + comp) * kD + e) * kH + i], c_attn[i * 3 * kH + comp * kH + head * kD + e]);
      const auto& fc1 = t.at(o + "mlp.linear_fc1.weight");
      const auto& c_fc = hfw.at("transformer.h.1.mlp.c_fc.weight");
      for (int64_t r = 0; r < kF; ++r)
        for (int64_t i = 0; i < kH; ++i) ASSERT_EQ(fc1[r * kH + i], c_fc[i * kF + r]);
    } else {
      // q [n·d, h], k, v [g·d, h] -> per group: its 2 query heads, its key, its value.
      const std::string s = "model.layers.1.self_attn.";
      const int64_t qpg = kN / kG;
      for (int64_t g = 0; g < kG; ++g)
        for (int64_t e = 0; e < kD * kH; ++e) {
          for (int64_t c = 0; c < qpg; ++c)
            ASSERT_EQ(qkv[((g * (qpg + 2) + c) * kD) * kH + e], hfw.at(s + "q_proj.weight")[(g * qpg + c) * kD * kH + e]);
          ASSERT_EQ(qkv[((g * (qpg + 2) + qpg) * kD) * kH + e], hfw.at(s + "k_proj.weight")[g * kD * kH + e]);
          ASSERT_EQ(qkv[((g * (qpg + 2) + qpg + 1) * kD) * kH + e], hfw.at(s + "v_proj.weight")[g * kD * kH + e]);
        }
      if (moe_layer(a, 1)) {
        // Router = gate [E, h]; expert e: linear_fc1 [2, f, h] = [w1 | gate_proj; w3 | up_proj],
        // linear_fc2 = w2 | down_proj.
        const bool mixtral = a == HfArchitecture::kMixtral;
        const std::string p = mixtral ? "model.layers.1.block_sparse_moe." : "model.layers.1.mlp.";
        const int64_t f = expert_ffn(a);
        EXPECT_EQ(t.at(o + "mlp.router.weight"), hfw.at(p + "gate.weight"));
        for (int64_t e = 0; e < kE; ++e) {
          const std::string x = fmt::format("{}experts.{}.", p, e);
          const std::string me = fmt::format("{}mlp.experts.local_experts.{}.", o, e);
          const auto& fc1 = t.at(me + "linear_fc1.weight");
          ASSERT_EQ(static_cast<int64_t>(fc1.size()), 2 * f * kH);
          EXPECT_EQ(std::vector<float>(fc1.begin(), fc1.begin() + f * kH), hfw.at(x + (mixtral ? "w1" : "gate_proj") + ".weight"));
          EXPECT_EQ(std::vector<float>(fc1.begin() + f * kH, fc1.end()), hfw.at(x + (mixtral ? "w3" : "up_proj") + ".weight"));
          EXPECT_EQ(t.at(me + "linear_fc2.weight"), hfw.at(x + (mixtral ? "w2" : "down_proj") + ".weight"));
        }
        EXPECT_FALSE(t.count(o + "mlp.linear_fc1.weight"));
        if (a == HfArchitecture::kQwen2Moe) {
          // shared expert: linear_fc1 [2, f_s, h] = [gate_proj; up_proj], linear_fc2 = down_proj,
          // gate_weight [1, h] = shared_expert_gate
          const auto& fc1 = t.at(o + "mlp.shared_experts.linear_fc1.weight");
          ASSERT_EQ(static_cast<int64_t>(fc1.size()), 2 * kFs * kH);
          EXPECT_EQ(std::vector<float>(fc1.begin(), fc1.begin() + kFs * kH), hfw.at(p + "shared_expert.gate_proj.weight"));
          EXPECT_EQ(std::vector<float>(fc1.begin() + kFs * kH, fc1.end()), hfw.at(p + "shared_expert.up_proj.weight"));
          EXPECT_EQ(t.at(o + "mlp.shared_experts.linear_fc2.weight"), hfw.at(p + "shared_expert.down_proj.weight"));
          EXPECT_EQ(t.at(o + "mlp.shared_experts.gate_weight"), hfw.at(p + "shared_expert_gate.weight"));
        }
      } else {
        // linear_fc1 [2, f, h] = [gate; up].
        const auto& fc1 = t.at(o + "mlp.linear_fc1.weight");
        const auto& gate = hfw.at("model.layers.1.mlp.gate_proj.weight");
        const auto& up = hfw.at("model.layers.1.mlp.up_proj.weight");
        EXPECT_EQ(std::vector<float>(fc1.begin(), fc1.begin() + kF * kH), gate);
        EXPECT_EQ(std::vector<float>(fc1.begin() + kF * kH, fc1.end()), up);
      }
      if (qwen_moe(a))  // its dense layer 0
        EXPECT_EQ(t.at("decoder.layers.0.mlp.linear_fc2.weight"), hfw.at("model.layers.0.mlp.down_proj.weight"));
      EXPECT_EQ(t.at(o + "self_attention.linear_proj.weight"), hfw.at(s + "o_proj.weight"));
      if (qkv_bias(a)) {
        const auto& b = t.at(o + "self_attention.linear_qkv.bias");
        for (int64_t g = 0; g < kG; ++g)
          for (int64_t e = 0; e < kD; ++e)
            ASSERT_EQ(b[(g * (qpg + 2) + qpg) * kD + e], hfw.at(s + "k_proj.bias")[g * kD + e]);
      }
      if (a == HfArchitecture::kQwen3 || a == HfArchitecture::kQwen3Moe)
        EXPECT_EQ(t.at(o + "self_attention.q_layernorm.weight"), hfw.at(s + "q_norm.weight"));
      if (m.config.untie_embeddings_and_output_weights) {
        const auto& out = t.at("output_layer.weight");
        EXPECT_EQ(std::vector<float>(out.begin(), out.begin() + kV * kH), hfw.at("lm_head.weight"));
      }
    }
    fs::remove_all(fx.dir);
  }
}

/// Every tensor of an HF directory, with its dtype string and raw bytes.
std::map<std::string, std::pair<std::string, std::vector<uint8_t>>> raw_tensors(const fs::path& dir) {
  const auto ck = hf::SafetensorsCheckpoint::open(dir.string());
  std::map<std::string, std::pair<std::string, std::vector<uint8_t>>> out;
  for (const auto& n : ck.names()) out[n] = {ck.info(n).dtype, ck.file_of(n).read_bytes(n)};
  return out;
}

// import-hf -> export-hf gives back the same tensors, bit for bit (fp32 and bf16 files, one
// file and sharded), plus the tokenizer files; the exported config.json describes the same model.
TEST(HfConvert, ImportExportRoundTripIsBitwise) {
  for (HfArchitecture a : kAll) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(fmt::format("{} {}", hf::architecture_name(a), dtype_name(dtype)));
      const Fixture fx = make_fixture(a, "rt", dtype);
      const fs::path ck = temp_dir("rt_ck"), out = temp_dir("rt_out");
      ImportHfArgs ia;
      ia.hf_dir = fx.dir.string();
      ia.save = ck.string();
      ia.make_vocab_size_divisible_by = 8;
      ASSERT_EQ(run_import_hf(ia), 0);
      EXPECT_TRUE(fs::exists(ck / "hf" / "tokenizer_config.json"));
      const CheckpointState st = read_checkpoint_state(ck.string());
      EXPECT_FALSE(st.has_optimizer);
      EXPECT_EQ(st.model.summary(), hf::read_hf_config(fx.dir.string(), 0, 8).config.summary());
      ExportHfArgs ea;
      ea.load = ck.string();
      ea.hf_dir = out.string();
      ea.dtype = dtype == DType::kBF16 ? "bf16" : "fp32";
      ea.max_shard_bytes = dtype == DType::kBF16 ? 4096 : 0;  // sharded with an index
      ASSERT_EQ(run_export_hf(ea), 0);
      EXPECT_EQ(fs::exists(out / "model.safetensors.index.json"), dtype == DType::kBF16);
      EXPECT_TRUE(fs::exists(out / "tokenizer_config.json"));
      EXPECT_EQ(raw_tensors(out), raw_tensors(fx.dir));
      const hf::HfModel back = hf::read_hf_config(out.string(), 0, 8);
      EXPECT_EQ(back.arch, a);
      EXPECT_EQ(back.config.summary(), st.model.summary());
      if (a == HfArchitecture::kGpt2) EXPECT_EQ(back.config_json.at("bos_token_id"), 5);  // kept from the import
      const json in = config_json(a);  // every field of config.json comes back unchanged
      for (const auto& [k, v] : in.items()) EXPECT_EQ(back.config_json.at(k), v) << k;
      for (int64_t l = 0; l < kL; ++l) EXPECT_EQ(back.config.is_moe_layer(l), moe_layer(a, l)) << "layer " << l;
      for (const auto& d : {fx.dir, ck, out}) fs::remove_all(d);
    }
  }
}

// import-hf --apply-layernorm-1p stores every norm weight as the HF weight minus 1 (fp32) and
// records the flag in the checkpoint's config; export-hf adds the 1 back. Other tensors unchanged.
TEST(HfConvert, ApplyLayernorm1pShiftsNormWeights) {
  for (HfArchitecture a : {HfArchitecture::kGpt2, HfArchitecture::kQwen3}) {  // LayerNorm; RMSNorm with q/k norms
    SCOPED_TRACE(hf::architecture_name(a));
    const Fixture fx = make_fixture(a, "onep");
    const fs::path ck = temp_dir("onep_ck"), out = temp_dir("onep_out");
    ImportHfArgs ia;
    ia.hf_dir = fx.dir.string();
    ia.save = ck.string();
    ia.make_vocab_size_divisible_by = 8;
    ia.apply_layernorm_1p = true;
    ASSERT_EQ(run_import_hf(ia), 0);
    const CheckpointState st = read_checkpoint_state(ck.string());
    EXPECT_TRUE(st.model.layernorm_zero_centered_gamma);
    hf::HfModel m = hf::read_hf_config(fx.dir.string(), 0, 8);
    const hf::GlobalTensors plain = hf::hf_to_megatron(m, hf::SafetensorsCheckpoint::open(fx.dir.string()));
    m.config.layernorm_zero_centered_gamma = true;
    const hf::GlobalTensors shifted = hf::hf_to_megatron(m, hf::SafetensorsCheckpoint::open(fx.dir.string()));
    int norms = 0;
    for (const auto& [name, v] : plain) {
      const bool norm = name.ends_with("layernorm.weight");
      norms += norm;
      std::vector<float> want = v;
      if (norm)
        for (float& x : want) x -= 1.f;
      EXPECT_EQ(shifted.at(name), want) << name;
    }
    EXPECT_EQ(norms, 2 * kL + 1 + (a == HfArchitecture::kQwen3 ? 2 * kL : 0));
    ExportHfArgs ea;
    ea.load = ck.string();
    ea.hf_dir = out.string();
    ea.dtype = "fp32";
    ASSERT_EQ(run_export_hf(ea), 0);
    const hf::GlobalTensors back =
        hf::hf_to_megatron(hf::read_hf_config(out.string(), 0, 8), hf::SafetensorsCheckpoint::open(out.string()));
    for (const auto& [name, v] : shifted) {
      std::vector<float> want = v;
      if (name.ends_with("layernorm.weight"))
        for (float& x : want) x += 1.f;
      EXPECT_EQ(back.at(name), want) << name;
    }
    for (const auto& d : {fx.dir, ck, out}) fs::remove_all(d);
  }
}

// The imported checkpoint is a model: its parameters load into GPTModel (here split over two
// tensor-parallel shards' worth of specs through load_checkpoint) and equal the mapped tensors.
TEST(HfConvert, ImportedCheckpointLoadsAsModel) {
  const Fixture fx = make_fixture(HfArchitecture::kLlama, "load");
  const fs::path ck = temp_dir("load_ck");
  ImportHfArgs ia;
  ia.hf_dir = fx.dir.string();
  ia.save = ck.string();
  ASSERT_EQ(run_import_hf(ia), 0);  // default padding: 37 -> 128 rows
  const CheckpointState st = read_checkpoint_state(ck.string());
  const hf::GlobalTensors t = hf::hf_to_megatron(hf::read_hf_config(fx.dir.string()), hf::SafetensorsCheckpoint::open(fx.dir.string()));
  Stream s(Device::cpu());
  TransformerConfig c = st.model;
  c.make_vocab_size_divisible_by = 64;  // another padding (64 rows): the checkpoint does not depend on it
  for (int rank = 0; rank < 2; ++rank) {
    ParamStore p(GPTModel::param_specs(c, 2, rank), DType::kF32, Device::cpu());
    load_checkpoint(ck.string(), p, nullptr, s);
    for (size_t i = 0; i < p.size(); ++i) {
      const ParamInfo& info = p.info(i);
      const std::vector<float> local = testing::to_host(p.main(i), s);
      const auto& full = t.at(info.name);
      for (int64_t e = 0; e < info.numel; ++e) {
        const int64_t g = info.box.global_index(e);
        const bool padding = info.vocab_rows > 0 && g / kH >= kV;
        ASSERT_EQ(local[e], padding ? 0.f : full[g]) << info.name << " rank " << rank << " element " << e;
      }
    }
  }
  fs::remove_all(fx.dir);
  fs::remove_all(ck);
}

// transformers 5 holds a layer's experts fused (model.layers.l.mlp.experts.gate_up_proj
// [E, 2f, h] with the gate rows first, experts.down_proj [E, h, f], router mlp.gate.weight); such
// a checkpoint imports to the same tensors as the per-expert Hub names.
TEST(HfConvert, FusedExpertTensorsOfTransformers5Import) {
  for (HfArchitecture a : {HfArchitecture::kMixtral, HfArchitecture::kQwen3Moe, HfArchitecture::kQwen2Moe}) {
    SCOPED_TRACE(hf::architecture_name(a));
    const Fixture fx = make_fixture(a, "fused");
    const hf::HfModel m = hf::read_hf_config(fx.dir.string(), 0, 8);
    const hf::GlobalTensors want = hf::hf_to_megatron(m, hf::SafetensorsCheckpoint::open(fx.dir.string()));
    const bool mixtral = a == HfArchitecture::kMixtral;
    const int64_t f = expert_ffn(a);
    std::vector<hf::TensorToWrite> w;
    for (const auto& [n, v] : fx.tensors)
      if (n.find(".experts.") == std::string::npos && n.find(".gate.weight") == std::string::npos)
        w.push_back({n, DType::kF32, fx.shapes.at(n), v});
    for (int64_t l = 0; l < kL; ++l) {
      if (!moe_layer(a, l)) continue;
      const std::string hub = fmt::format("model.layers.{}.{}", l, mixtral ? "block_sparse_moe." : "mlp.");
      const std::string v5 = fmt::format("model.layers.{}.mlp.", l);
      std::vector<float> gate_up, down;
      for (int64_t e = 0; e < kE; ++e) {
        const std::string x = fmt::format("{}experts.{}.", hub, e);
        for (const char* part : {mixtral ? "w1" : "gate_proj", mixtral ? "w3" : "up_proj"}) {
          const auto& v = fx.tensors.at(x + part + ".weight");
          gate_up.insert(gate_up.end(), v.begin(), v.end());
        }
        const auto& d = fx.tensors.at(x + (mixtral ? "w2" : "down_proj") + ".weight");
        down.insert(down.end(), d.begin(), d.end());
      }
      w.push_back({v5 + "gate.weight", DType::kF32, {kE, kH}, fx.tensors.at(hub + "gate.weight")});
      w.push_back({v5 + "experts.gate_up_proj", DType::kF32, {kE, 2 * f, kH}, gate_up});
      w.push_back({v5 + "experts.down_proj", DType::kF32, {kE, kH, f}, down});
    }
    hf::write_safetensors(fx.dir / "model.safetensors", w);
    EXPECT_EQ(hf::hf_to_megatron(m, hf::SafetensorsCheckpoint::open(fx.dir.string())), want);
    fs::remove_all(fx.dir);
  }
}

// An imported MoE checkpoint loads under expert parallelism: each EP rank reads its own experts
// (global expert indices in the names), cut into expert-TP shards.
TEST(HfConvert, ImportedMoeCheckpointLoadsUnderExpertParallelism) {
  const Fixture fx = make_fixture(HfArchitecture::kQwen3Moe, "moe_load");
  const fs::path ck = temp_dir("moe_load_ck");
  ImportHfArgs ia;
  ia.hf_dir = fx.dir.string();
  ia.save = ck.string();
  ia.make_vocab_size_divisible_by = 8;
  ASSERT_EQ(run_import_hf(ia), 0);
  const CheckpointState st = read_checkpoint_state(ck.string());
  const hf::GlobalTensors t =
      hf::hf_to_megatron(hf::read_hf_config(fx.dir.string(), 0, 8), hf::SafetensorsCheckpoint::open(fx.dir.string()));
  Stream s(Device::cpu());
  for (int ep_rank = 0; ep_rank < 2; ++ep_rank) {
    for (int tp_rank = 0; tp_rank < 2; ++tp_rank) {
      ParamStore p(GPTModel::param_specs(st.model, 2, tp_rank, {}, 2, ep_rank), DType::kF32, Device::cpu());
      load_checkpoint(ck.string(), p, nullptr, s);
      int experts = 0;
      for (size_t i = 0; i < p.size(); ++i) {
        const ParamInfo& info = p.info(i);
        experts += info.expert ? 1 : 0;
        const std::vector<float> local = testing::to_host(p.main(i), s);
        const auto& full = t.at(info.name);
        for (int64_t e = 0; e < info.numel; ++e) {
          const int64_t g = info.box.global_index(e);
          const bool padding = info.vocab_rows > 0 && g / kH >= kV;
          ASSERT_EQ(local[e], padding ? 0.f : full[g]) << info.name << " ep " << ep_rank << " tp " << tp_rank;
        }
      }
      EXPECT_EQ(experts, 2 * (kE / 2));  // fc1 and fc2 of the kE / 2 experts of this EP rank (one MoE layer)
      EXPECT_EQ(p.find(fmt::format("decoder.layers.1.mlp.experts.local_experts.{}.linear_fc1.weight", 2 * ep_rank)) !=
                    ParamStore::kNoParam,
                true);
    }
  }
  fs::remove_all(fx.dir);
  fs::remove_all(ck);
}

// The user's path through the binary: import-hf, continue training from the imported weights
// (--finetune: weights only, iteration 0), save, generate from the result, export it again.
TEST(HfConvert, ImportFinetuneGenerateExportThroughTheBinary) {
  if (!std::getenv("MT_MEGATRON_BIN")) GTEST_SKIP() << "MT_MEGATRON_BIN not set (run through ctest)";
  const Fixture fx = make_fixture(HfArchitecture::kQwen3, "cli");
  const fs::path ck = fx.dir / "ck", ck2 = fx.dir / "ck2", out = fx.dir / "out";
  testing::RunResult r = testing::run_megatron("import-hf --hf-dir " + fx.dir.string() + " --save " + ck.string());
  ASSERT_EQ(r.rc, 0) << r.out;
  // Without --finetune the missing optimizer state is a clear error.
  const std::string train = "pretrain --use-checkpoint-args --mock-data --tokenizer-type NullTokenizer --vocab-size " +
                            std::to_string(kV) + " --seq-length 12 --micro-batch-size 2 --global-batch-size 2 "
                            "--train-iters 3 --lr 1e-3 --log-interval 1 --eval-interval 3 --eval-iters 1 --device cpu "
                            "--no-progress --load " + ck.string();
  r = testing::run_megatron(train + " --save " + ck2.string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("holds no optimizer state"), std::string::npos) << r.out;
  r = testing::run_megatron(train + " --finetune --save " + ck2.string());
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("for finetuning: starting at iteration 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("QK-norm, untied output layer"), std::string::npos) << r.out;  // the imported architecture
  EXPECT_NE(r.out.find("iteration        3/       3"), std::string::npos) << r.out;
  r = testing::run_megatron("generate --load " + ck2.string() +
                            " --tokenizer-type NullTokenizer --prompt \"1 2 3\" --out-seq-length 4 --greedy "
                            "--device cpu");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("----- sample 0 -----"), std::string::npos) << r.out;
  r = testing::run_megatron("export-hf --load " + ck2.string() + " --hf-dir " + out.string());
  ASSERT_EQ(r.rc, 0) << r.out;
  const hf::HfModel back = hf::read_hf_config(out.string());
  EXPECT_EQ(back.arch, HfArchitecture::kQwen3);
  // The finetuned weights differ from the imported ones.
  EXPECT_NE(raw_tensors(out).at("model.norm.weight"), raw_tensors(fx.dir).at("model.norm.weight"));
  fs::remove_all(fx.dir);
}

using ::mt::testing::expect_error;

TEST(HfConvert, MoeBadInputErrors) {
  Fixture fx = make_fixture(HfArchitecture::kMixtral, "moe_bad");
  const std::string dir = fx.dir.string();
  auto import = [&](HfArchitecture a, const std::function<void(json&)>& edit) {
    return [&, a, edit] {
      json j = config_json(a);
      edit(j);
      std::ofstream(fx.dir / "config.json") << j.dump();
      ImportHfArgs ia;
      ia.hf_dir = dir;
      ia.save = (fx.dir / "ck").string();
      run_import_hf(ia);
    };
  };
  using A = HfArchitecture;
  expect_error(import(A::kMixtral, [](json& j) { j["architectures"] = {"Qwen2MoeForCausalLM"}; }),
               "field 'shared_expert_intermediate_size' is missing");
  expect_error(import(A::kQwen2Moe, [](json& j) { j["shared_expert_intermediate_size"] = 0; }),
               "shared_expert_intermediate_size must be > 0, got 0");
  expect_error(import(A::kQwen2Moe, [](json& j) { j["qkv_bias"] = false; }),
               "qkv_bias false is not supported for Qwen2MoeForCausalLM");
  expect_error(import(A::kMixtral, [](json& j) { j["architectures"] = {"Qwen9MoeForCausalLM"}; }),
               "unsupported Hugging Face architecture 'Qwen9MoeForCausalLM'");
  expect_error(import(A::kMixtral, [](json& j) { j["router_jitter_noise"] = 0.01; }), "router_jitter_noise 0.01");
  expect_error(import(A::kMixtral, [](json& j) { j["sliding_window"] = 4; }), "sliding_window 4");
  expect_error(import(A::kMixtral, [](json& j) { j.erase("num_local_experts"); }), "field 'num_local_experts' is missing");
  expect_error(import(A::kMixtral, [](json& j) { j["num_experts_per_tok"] = 5; }), "--moe-router-topk 5 must be in [1, --num-experts 4]");
  expect_error(import(A::kMixtral, [](json& j) { j["num_local_experts"] = 3; }),
               "has shape [4, 16] but config.json implies [3, 16]");
  expect_error(import(A::kQwen3Moe, [](json& j) { j["shared_expert_intermediate_size"] = 8; }),
               "shared experts (shared_expert_intermediate_size) are not supported");
  // A missing expert tensor.
  {
    std::vector<hf::TensorToWrite> w;
    for (const auto& [n, v] : fx.tensors)
      if (n != "model.layers.1.block_sparse_moe.experts.3.w3.weight") w.push_back({n, DType::kF32, fx.shapes[n], v});
    hf::write_safetensors(fx.dir / "model.safetensors", w);
  }
  expect_error(import(A::kMixtral, [](json&) {}), "has no tensor 'model.layers.1.block_sparse_moe.experts.3.w3.weight'");
  // Exports the architectures cannot represent.
  Fixture q = make_fixture(HfArchitecture::kQwen3Moe, "moe_bad2");
  ImportHfArgs ia;
  ia.hf_dir = q.dir.string();
  ia.save = (q.dir / "ck").string();
  ASSERT_EQ(run_import_hf(ia), 0);
  ExportHfArgs ea;
  ea.load = ia.save;
  ea.hf_dir = (q.dir / "out").string();
  ea.architecture = "Qwen3ForCausalLM";
  expect_error([&] { run_export_hf(ea); }, "cannot be exported as Qwen3ForCausalLM: it has mixture-of-experts layers");
  ea.architecture = "MixtralForCausalLM";
  expect_error([&] { run_export_hf(ea); }, "cannot be exported as MixtralForCausalLM: QK-norm exactly for");
  const TransformerConfig c = read_checkpoint_state(ia.save).model;
  TransformerConfig x = c;
  x.qk_layernorm = false;
  expect_error([&] { hf::check_representable(HfArchitecture::kMixtral, x); }, "every layer must be a MoE layer");
  x.moe_layer_pattern.clear();
  x.moe_router_pre_softmax = true;
  expect_error([&] { hf::check_representable(HfArchitecture::kMixtral, x); }, "renormalises the top-k");
  x = c;
  x.moe_shared_expert_intermediate_size = 16;
  expect_error([&] { hf::check_representable(HfArchitecture::kQwen3Moe, x); }, "no shared experts");
  x = c;
  x.mtp_num_layers = 1;  // MTP weights: no supported architecture holds them yet
  expect_error([&] { hf::check_representable(HfArchitecture::kQwen3Moe, x); },
               "it has 1 multi-token prediction layers (--mtp-num-layers)");
  x = c;
  x.moe_shared_expert_intermediate_size = 16;
  x.moe_shared_expert_gate = true;
  x.add_qkv_bias = true;
  x.qk_layernorm = false;
  EXPECT_EQ(hf::infer_architecture(x), HfArchitecture::kQwen2Moe);
  hf::check_representable(HfArchitecture::kQwen2Moe, x);
  x.moe_shared_expert_gate = false;  // Qwen 2 MoE's shared expert is always gated
  expect_error([&] { hf::check_representable(HfArchitecture::kQwen2Moe, x); }, "a gated shared expert");
  x = c;
  x.moe_router_score_function = MoeScoreFunction::kSigmoid;
  expect_error([&] { hf::check_representable(HfArchitecture::kQwen3Moe, x); }, "a softmax router is required");
  fs::remove_all(fx.dir);
  fs::remove_all(q.dir);
}

TEST(HfConvert, BadInputErrors) {
  Fixture fx = make_fixture(HfArchitecture::kLlama, "bad");
  const std::string dir = fx.dir.string();
  auto rewrite_config = [&](const std::function<void(json&)>& edit) {
    json j = config_json(HfArchitecture::kLlama);
    edit(j);
    std::ofstream(fx.dir / "config.json") << j.dump();
  };
  auto import = [&] {
    ImportHfArgs ia;
    ia.hf_dir = dir;
    ia.save = (fx.dir / "ck").string();
    run_import_hf(ia);
  };
  rewrite_config([](json& j) { j["architectures"] = {"GemmaForCausalLM"}; });
  expect_error(import, "unsupported Hugging Face architecture 'GemmaForCausalLM'");
  rewrite_config([](json& j) { j.erase("hidden_size"); });
  expect_error(import, "field 'hidden_size' is missing");
  rewrite_config([](json& j) { j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}}; });
  expect_error(import, "scaled RoPE");
  rewrite_config([](json& j) { j["intermediate_size"] = 20; });  // disagrees with the tensors
  expect_error(import, "has shape [24, 16] but config.json implies [20, 16]");
  rewrite_config([](json&) {});
  // A missing tensor.
  {
    std::vector<hf::TensorToWrite> w;
    for (const auto& [n, v] : fx.tensors)
      if (n != "model.layers.1.mlp.up_proj.weight") w.push_back({n, DType::kF32, fx.shapes[n], v});
    hf::write_safetensors(fx.dir / "model.safetensors", w);
  }
  expect_error(import, "has no tensor 'model.layers.1.mlp.up_proj.weight'");
  // A truncated safetensors header.
  {
    std::ofstream f(fx.dir / "model.safetensors", std::ios::binary | std::ios::trunc);
    const uint64_t n = 1000;
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << "{\"a\":";
  }
  expect_error(import, "model.safetensors");
  // No config.json at all.
  fs::remove(fx.dir / "config.json");
  expect_error(import, "holds no config.json");
  // Export to an architecture that cannot represent the model.
  Fixture g = make_fixture(HfArchitecture::kGpt2, "bad2");
  ImportHfArgs ia;
  ia.hf_dir = g.dir.string();
  ia.save = (g.dir / "ck").string();
  ASSERT_EQ(run_import_hf(ia), 0);
  ExportHfArgs ea;
  ea.load = ia.save;
  ea.hf_dir = (g.dir / "out").string();
  ea.architecture = "LlamaForCausalLM";
  expect_error([&] { run_export_hf(ea); }, "cannot be exported as LlamaForCausalLM: RMSNorm is required");
  ea.architecture = "";
  ea.dtype = "fp8";
  expect_error([&] { run_export_hf(ea); }, "--hf-dtype 'fp8'");
  fs::remove_all(fx.dir);
  fs::remove_all(g.dir);
}

}  // namespace
}  // namespace mt
