// Hugging Face interchange (model/hf/hf_convert.h, train/hf_commands.h) on hand-built fixtures:
// for each architecture a tiny config.json and safetensors file written by the test, the
// per-layer mapping checked element by element against the layouts the header documents,
// import -> export round trips bitwise (fp32 and bf16, single file and sharded), the imported
// checkpoint loads as a model, and every documented error.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
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
// vocabulary 37, 12 positions.
constexpr int64_t kH = 16, kN = 4, kG = 2, kD = 4, kF = 24, kL = 2, kV = 37, kP = 12;

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
  return j;
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
      if (a == HfArchitecture::kQwen2) {
        add(s + "self_attn.q_proj.bias", {kN * kD});
        add(s + "self_attn.k_proj.bias", {kG * kD});
        add(s + "self_attn.v_proj.bias", {kG * kD});
      }
      if (a == HfArchitecture::kQwen3) {
        add(s + "self_attn.q_norm.weight", {kD});
        add(s + "self_attn.k_norm.weight", {kD});
      }
      add(s + "self_attn.o_proj.weight", {kH, kN * kD});
      add(s + "post_attention_layernorm.weight", {kH});
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

const HfArchitecture kAll[] = {HfArchitecture::kGpt2, HfArchitecture::kLlama, HfArchitecture::kQwen2,
                               HfArchitecture::kQwen3};

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
    EXPECT_EQ(c.add_qkv_bias, a == HfArchitecture::kQwen2);
    EXPECT_EQ(c.qk_layernorm, a == HfArchitecture::kQwen3);
    EXPECT_EQ(c.tied_output(), gpt2 || a == HfArchitecture::kQwen2);
    if (!gpt2) EXPECT_EQ(c.rotary_base, 500000.f);
    EXPECT_EQ(hf::infer_architecture(c), a == HfArchitecture::kQwen2 ? HfArchitecture::kQwen2 : a);
    fs::remove_all(fx.dir);
  }
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
      // linear_fc1 [2, f, h] = [gate; up].
      const auto& fc1 = t.at(o + "mlp.linear_fc1.weight");
      const auto& gate = hfw.at("model.layers.1.mlp.gate_proj.weight");
      const auto& up = hfw.at("model.layers.1.mlp.up_proj.weight");
      EXPECT_EQ(std::vector<float>(fc1.begin(), fc1.begin() + kF * kH), gate);
      EXPECT_EQ(std::vector<float>(fc1.begin() + kF * kH, fc1.end()), up);
      EXPECT_EQ(t.at(o + "self_attention.linear_proj.weight"), hfw.at(s + "o_proj.weight"));
      if (a == HfArchitecture::kQwen2) {
        const auto& b = t.at(o + "self_attention.linear_qkv.bias");
        for (int64_t g = 0; g < kG; ++g)
          for (int64_t e = 0; e < kD; ++e)
            ASSERT_EQ(b[(g * (qpg + 2) + qpg) * kD + e], hfw.at(s + "k_proj.bias")[g * kD + e]);
      }
      if (a == HfArchitecture::kQwen3)
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
      for (const auto& d : {fx.dir, ck, out}) fs::remove_all(d);
    }
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

/// Runs the megatron binary (MT_MEGATRON_BIN) with `args`; returns {exit code, output}.
std::pair<int, std::string> run_binary(const std::string& args) {
  const char* bin = std::getenv("MT_MEGATRON_BIN");
  std::string cmd = std::string(bin ? bin : "megatron") + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  return {WEXITSTATUS(pclose(p)), out};
}

// The user's path through the binary: import-hf, continue training from the imported weights
// (--finetune: weights only, iteration 0), save, generate from the result, export it again.
TEST(HfConvert, ImportFinetuneGenerateExportThroughTheBinary) {
  if (!std::getenv("MT_MEGATRON_BIN")) GTEST_SKIP() << "MT_MEGATRON_BIN not set (run through ctest)";
  const Fixture fx = make_fixture(HfArchitecture::kQwen3, "cli");
  const fs::path ck = fx.dir / "ck", ck2 = fx.dir / "ck2", out = fx.dir / "out";
  auto [rc, log] = run_binary("import-hf --hf-dir " + fx.dir.string() + " --save " + ck.string());
  ASSERT_EQ(rc, 0) << log;
  // Without --finetune the missing optimizer state is a clear error.
  const std::string train = "pretrain --use-checkpoint-args --mock-data --tokenizer-type NullTokenizer --vocab-size " +
                            std::to_string(kV) + " --seq-length 12 --micro-batch-size 2 --global-batch-size 2 "
                            "--train-iters 3 --lr 1e-3 --log-interval 1 --eval-interval 3 --eval-iters 1 --device cpu "
                            "--no-progress --load " + ck.string();
  std::tie(rc, log) = run_binary(train + " --save " + ck2.string());
  EXPECT_NE(rc, 0);
  EXPECT_NE(log.find("holds no optimizer state"), std::string::npos) << log;
  std::tie(rc, log) = run_binary(train + " --finetune --save " + ck2.string());
  ASSERT_EQ(rc, 0) << log;
  EXPECT_NE(log.find("for finetuning: starting at iteration 0"), std::string::npos) << log;
  EXPECT_NE(log.find("QK-norm, untied output layer"), std::string::npos) << log;  // the imported architecture
  EXPECT_NE(log.find("iteration        3/       3"), std::string::npos) << log;
  std::tie(rc, log) = run_binary("generate --load " + ck2.string() +
                                 " --tokenizer-type NullTokenizer --prompt \"1 2 3\" --out-seq-length 4 --greedy "
                                 "--device cpu");
  ASSERT_EQ(rc, 0) << log;
  EXPECT_NE(log.find("----- sample 0 -----"), std::string::npos) << log;
  std::tie(rc, log) = run_binary("export-hf --load " + ck2.string() + " --hf-dir " + out.string());
  ASSERT_EQ(rc, 0) << log;
  const hf::HfModel back = hf::read_hf_config(out.string());
  EXPECT_EQ(back.arch, HfArchitecture::kQwen3);
  // The finetuned weights differ from the imported ones.
  EXPECT_NE(raw_tensors(out).at("model.norm.weight"), raw_tensors(fx.dir).at("model.norm.weight"));
  fs::remove_all(fx.dir);
}

void expect_error(const std::function<void()>& f, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << what << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
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
  rewrite_config([](json& j) { j["architectures"] = {"MixtralForCausalLM"}; });
  expect_error(import, "unsupported Hugging Face architecture 'MixtralForCausalLM'");
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
