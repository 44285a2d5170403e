#include "model/hf/hf_convert.h"

#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/check.h"

namespace mt::hf {

namespace fs = std::filesystem;
using json = nlohmann::json;

const char* architecture_name(HfArchitecture a) {
  switch (a) {
    case HfArchitecture::kGpt2: return "GPT2LMHeadModel";
    case HfArchitecture::kLlama: return "LlamaForCausalLM";
    case HfArchitecture::kQwen2: return "Qwen2ForCausalLM";
    case HfArchitecture::kQwen3: return "Qwen3ForCausalLM";
  }
  return "?";
}

HfArchitecture parse_architecture(const std::string& name) {
  for (HfArchitecture a : {HfArchitecture::kGpt2, HfArchitecture::kLlama, HfArchitecture::kQwen2, HfArchitecture::kQwen3})
    if (name == architecture_name(a)) return a;
  MT_FAIL("unsupported Hugging Face architecture '{}': expected GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM "
          "or Qwen3ForCausalLM",
          name);
}

namespace {

// --- config.json fields ---------------------------------------------------------------------

struct Fields {
  const json& j;
  std::string file;
  bool has(const char* k) const { return j.contains(k) && !j.at(k).is_null(); }
  template <typename T>
  T get(const char* k) const {
    MT_REQUIRE(has(k), "{}: field '{}' is missing", file, k);
    try {
      return j.at(k).get<T>();
    } catch (const json::exception&) {
      MT_FAIL("{}: field '{}' has the wrong type ({})", file, k, j.at(k).dump());
    }
  }
  template <typename T>
  T get_or(const char* k, T dflt) const {
    return has(k) ? get<T>(k) : dflt;
  }
};

/// RoPE base from rope_theta (transformers 4) or rope_parameters.rope_theta (transformers 5);
/// scaled RoPE variants are not implemented.
float rope_theta(const Fields& f) {
  for (const char* k : {"rope_parameters", "rope_scaling"}) {
    if (!f.has(k)) continue;
    const json& r = f.j.at(k);
    MT_REQUIRE(r.is_object(), "{}: field '{}' must be an object, got {}", f.file, k, r.dump());
    const std::string type = r.value("rope_type", r.value("type", std::string("default")));
    MT_REQUIRE(type == "default", "{}: {}.rope_type '{}' (scaled RoPE) is not supported; only 'default'", f.file, k,
               type);
    if (r.contains("rope_theta")) return r.at("rope_theta").get<float>();
  }
  return f.get_or<float>("rope_theta", 10000.f);
}

void gpt2_config(const Fields& f, TransformerConfig& c) {
  c.hidden_size = f.get<int64_t>("n_embd");
  c.num_layers = f.get<int64_t>("n_layer");
  c.num_attention_heads = f.get<int64_t>("n_head");
  c.max_position_embeddings = f.get<int64_t>("n_positions");
  c.ffn_hidden_size = f.get_or<int64_t>("n_inner", 4 * c.hidden_size);
  c.norm_epsilon = f.get_or<float>("layer_norm_epsilon", 1e-5f);
  c.normalization = Normalization::kLayerNorm;
  c.position_embedding_type = PositionEmbeddingType::kLearnedAbsolute;
  const std::string act = f.get_or<std::string>("activation_function", "gelu_new");
  MT_REQUIRE(act == "gelu_new" || act == "gelu_pytorch_tanh", "{}: activation_function '{}' is not supported "
             "(megatron.cpp's GELU is the tanh approximation: gelu_new or gelu_pytorch_tanh)", f.file, act);
  MT_REQUIRE(!f.get_or<bool>("scale_attn_by_inverse_layer_idx", false) && !f.get_or<bool>("reorder_and_upcast_attn", false),
             "{}: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported", f.file);
  MT_REQUIRE(f.get_or<bool>("tie_word_embeddings", true), "{}: GPT-2 with untied embeddings is not supported",
             f.file);
  c.untie_embeddings_and_output_weights = false;
  c.add_bias_linear = true;
  c.hidden_dropout = f.get_or<float>("resid_pdrop", 0.1f);
  c.attention_dropout = f.get_or<float>("attn_pdrop", 0.1f);
  c.init_method_std = f.get_or<float>("initializer_range", 0.02f);
}

void llama_like_config(const Fields& f, HfArchitecture arch, TransformerConfig& c) {
  c.hidden_size = f.get<int64_t>("hidden_size");
  c.num_layers = f.get<int64_t>("num_hidden_layers");
  c.num_attention_heads = f.get<int64_t>("num_attention_heads");
  c.num_query_groups = f.get_or<int64_t>("num_key_value_heads", c.num_attention_heads);
  c.kv_channels = f.get_or<int64_t>("head_dim", c.hidden_size / c.num_attention_heads);
  c.ffn_hidden_size = f.get<int64_t>("intermediate_size");
  c.max_position_embeddings = f.get<int64_t>("max_position_embeddings");
  c.norm_epsilon = f.get_or<float>("rms_norm_eps", 1e-6f);
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.rotary_base = rope_theta(f);
  c.rotary_percent = f.get_or<float>("partial_rotary_factor", 1.0f);
  c.rotary_interleaved = false;
  c.gated_linear_unit = true;
  const std::string act = f.get_or<std::string>("hidden_act", "silu");
  MT_REQUIRE(act == "silu", "{}: hidden_act '{}' is not supported (SwiGLU needs silu)", f.file, act);
  c.add_bias_linear = false;
  MT_REQUIRE(!f.get_or<bool>("mlp_bias", false), "{}: mlp_bias is not supported", f.file);
  const bool attention_bias = f.get_or<bool>("attention_bias", false);
  MT_REQUIRE(!attention_bias, "{}: attention_bias (biases on q/k/v and o_proj) is not supported; Qwen 2's q/k/v "
             "biases are", f.file);
  c.add_qkv_bias = arch == HfArchitecture::kQwen2;
  c.qk_layernorm = arch == HfArchitecture::kQwen3;
  MT_REQUIRE(!f.get_or<bool>("use_sliding_window", false), "{}: use_sliding_window is not supported", f.file);
  c.untie_embeddings_and_output_weights = !f.get_or<bool>("tie_word_embeddings", false);
  c.hidden_dropout = 0.f;
  c.attention_dropout = f.get_or<float>("attention_dropout", 0.f);
  c.init_method_std = f.get_or<float>("initializer_range", 0.02f);
}

}  // namespace

HfModel read_hf_config(const std::string& dir, int64_t seq_length, int64_t make_vocab_size_divisible_by) {
  const fs::path path = fs::path(dir) / "config.json";
  MT_REQUIRE(fs::is_regular_file(path), "--hf-dir '{}' holds no config.json", dir);
  std::ifstream in(path);
  MT_REQUIRE(in.good(), "cannot read '{}'", path.string());
  HfModel m;
  try {
    m.config_json = json::parse(in);
  } catch (const json::exception& e) {
    MT_FAIL("'{}' is not valid JSON: {}", path.string(), e.what());
  }
  const Fields f{m.config_json, path.string()};
  MT_REQUIRE(f.has("architectures") && m.config_json.at("architectures").is_array() &&
                 m.config_json.at("architectures").size() == 1,
             "{}: field 'architectures' must list one architecture", path.string());
  m.arch = parse_architecture(m.config_json.at("architectures")[0].get<std::string>());
  TransformerConfig& c = m.config;
  if (m.arch == HfArchitecture::kGpt2) {
    gpt2_config(f, c);
  } else {
    llama_like_config(f, m.arch, c);
  }
  c.vocab_size = f.get<int64_t>("vocab_size");
  c.make_vocab_size_divisible_by = make_vocab_size_divisible_by;
  c.seq_length = seq_length > 0 ? seq_length : std::min<int64_t>(c.max_position_embeddings, 4096);
  try {
    c.validate();
  } catch (const Error& e) {
    MT_FAIL("{} describes a model megatron.cpp cannot build: {}", path.string(), e.what());
  }
  return m;
}

void check_representable(HfArchitecture arch, const TransformerConfig& c) {
  const char* name = architecture_name(arch);
  auto need = [&](bool ok, const char* what) { MT_REQUIRE(ok, "the model cannot be exported as {}: {}", name, what); };
  if (arch == HfArchitecture::kGpt2) {
    need(c.normalization == Normalization::kLayerNorm, "GPT-2 uses LayerNorm");
    need(c.position_embedding_type == PositionEmbeddingType::kLearnedAbsolute, "GPT-2 uses learned positions");
    need(!c.gated_linear_unit, "GPT-2 uses a GELU MLP, not SwiGLU");
    need(c.add_bias_linear, "GPT-2 has biases");
    need(c.query_groups() == c.num_attention_heads, "GPT-2 has no grouped-query attention");
    need(c.head_dim() * c.num_attention_heads == c.hidden_size, "GPT-2 has head dim = hidden / heads");
    need(!c.qk_layernorm, "GPT-2 has no QK-norm");
    need(c.tied_output(), "GPT-2 ties the output layer to the embedding");
    return;
  }
  need(c.normalization == Normalization::kRMSNorm, "RMSNorm is required");
  need(c.position_embedding_type == PositionEmbeddingType::kRope, "RoPE is required");
  need(!c.rotary_interleaved, "transformers' RoPE rotates halves (no --rotary-interleaved)");
  need(c.gated_linear_unit, "a SwiGLU MLP is required");
  need(!c.add_bias_linear, "no biases on the projections");
  need(c.add_qkv_bias == (arch == HfArchitecture::kQwen2), "a QKV bias exactly for Qwen2ForCausalLM");
  need(c.qk_layernorm == (arch == HfArchitecture::kQwen3), "QK-norm exactly for Qwen3ForCausalLM");
}

HfArchitecture infer_architecture(const TransformerConfig& c) {
  if (c.position_embedding_type == PositionEmbeddingType::kLearnedAbsolute) return HfArchitecture::kGpt2;
  if (c.qk_layernorm) return HfArchitecture::kQwen3;
  if (c.add_qkv_bias && !c.add_bias_linear) return HfArchitecture::kQwen2;
  return HfArchitecture::kLlama;
}

json make_hf_config(HfArchitecture arch, const TransformerConfig& c, const json& base, DType dtype) {
  check_representable(arch, c);
  json j = base.is_object() ? base : json::object();
  // Drop fields of another architecture a base config may carry.
  for (const char* k : {"n_embd", "n_layer", "n_head", "n_positions", "n_ctx", "n_inner", "hidden_size",
                        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                        "intermediate_size", "rope_theta", "rope_parameters", "rope_scaling"})
    j.erase(k);
  j["architectures"] = {architecture_name(arch)};
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_positions();
  j["torch_dtype"] = dtype == DType::kBF16 ? "bfloat16" : dtype == DType::kF16 ? "float16" : "float32";
  if (arch == HfArchitecture::kGpt2) {
    j.erase("max_position_embeddings");
    j["model_type"] = "gpt2";
    j["n_embd"] = c.hidden_size;
    j["n_layer"] = c.num_layers;
    j["n_head"] = c.num_attention_heads;
    j["n_positions"] = c.max_positions();
    j["n_inner"] = c.ffn();
    j["layer_norm_epsilon"] = c.norm_epsilon;
    j["activation_function"] = "gelu_new";
    j["tie_word_embeddings"] = true;
    if (!j.contains("initializer_range")) j["initializer_range"] = c.init_method_std;
    return j;
  }
  j["model_type"] = arch == HfArchitecture::kLlama ? "llama" : arch == HfArchitecture::kQwen2 ? "qwen2" : "qwen3";
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.query_groups();
  j["head_dim"] = c.head_dim();
  j["intermediate_size"] = c.ffn();
  j["rms_norm_eps"] = c.norm_epsilon;
  j["hidden_act"] = "silu";
  j["rope_theta"] = c.rotary_base;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c.rotary_base}};
  if (c.rotary_percent != 1.f) j["partial_rotary_factor"] = c.rotary_percent;
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["tie_word_embeddings"] = c.tied_output();
  if (arch != HfArchitecture::kLlama) j["use_sliding_window"] = false;
  if (!j.contains("initializer_range")) j["initializer_range"] = c.init_method_std;
  return j;
}

namespace {

// --- tensors --------------------------------------------------------------------------------

/// Reads an HF tensor, checking its shape against what config.json implies.
std::vector<float> read(const SafetensorsCheckpoint& ck, const std::string& name, const std::vector<int64_t>& shape) {
  MT_REQUIRE(ck.has(name), "Hugging Face checkpoint '{}' has no tensor '{}'", ck.dir(), name);
  const SafetensorsTensorInfo info = ck.info(name);
  MT_REQUIRE(info.shape == shape, "tensor '{}' in '{}' has shape [{}] but config.json implies [{}]", name, ck.dir(),
             fmt::join(info.shape, ", "), fmt::join(shape, ", "));
  return ck.read_f32(name);
}

/// [rows, cols] -> [cols, rows].
std::vector<float> transpose(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<float> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

/// Megatron-Core's per-group QKV rows from q [n·d, w], k [g·d, w], v [g·d, w] (w = row width: h
/// for weights, 1 for biases).
std::vector<float> pack_qkv(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                            int64_t n, int64_t g, int64_t d, int64_t w) {
  const int64_t qpg = n / g, row = d * w;
  std::vector<float> out;
  out.reserve(q.size() + k.size() + v.size());
  for (int64_t gi = 0; gi < g; ++gi) {
    for (int64_t c = 0; c < qpg; ++c) {
      const auto src = q.begin() + (gi * qpg + c) * row;
      out.insert(out.end(), src, src + row);
    }
    out.insert(out.end(), k.begin() + gi * row, k.begin() + (gi + 1) * row);
    out.insert(out.end(), v.begin() + gi * row, v.begin() + (gi + 1) * row);
  }
  return out;
}

/// The inverse of pack_qkv.
void unpack_qkv(const std::vector<float>& qkv, int64_t n, int64_t g, int64_t d, int64_t w, std::vector<float>& q,
                std::vector<float>& k, std::vector<float>& v) {
  const int64_t qpg = n / g, row = d * w;
  q.clear();
  k.clear();
  v.clear();
  for (int64_t gi = 0; gi < g; ++gi) {
    auto at = qkv.begin() + gi * (qpg + 2) * row;
    q.insert(q.end(), at, at + qpg * row);
    k.insert(k.end(), at + qpg * row, at + (qpg + 1) * row);
    v.insert(v.end(), at + (qpg + 1) * row, at + (qpg + 2) * row);
  }
}

/// Vocabulary rows padded with zeros to `padded` rows (rows of width h).
std::vector<float> pad_rows(std::vector<float> a, int64_t padded, int64_t h) {
  a.resize(static_cast<size_t>(padded * h), 0.f);
  return a;
}

std::string layer(int64_t l) { return fmt::format("decoder.layers.{}.", l); }

/// GPT-2 tensor names come with or without the "transformer." prefix (save_pretrained of
/// GPT2LMHeadModel vs. the original hub files).
std::string gpt2_prefix(const SafetensorsCheckpoint& ck) {
  return ck.has("transformer.wte.weight") ? "transformer." : "";
}

}  // namespace

GlobalTensors hf_to_megatron(const HfModel& m, const SafetensorsCheckpoint& ck) {
  const TransformerConfig& c = m.config;
  const int64_t h = c.hidden_size, n = c.num_attention_heads, g = c.query_groups(), d = c.head_dim(), f = c.ffn();
  const int64_t V = c.vocab_size, Vp = c.padded_vocab_size();
  GlobalTensors t;
  if (m.arch == HfArchitecture::kGpt2) {
    const std::string p = gpt2_prefix(ck);
    t["embedding.word_embeddings.weight"] = pad_rows(read(ck, p + "wte.weight", {V, h}), Vp, h);
    t["embedding.position_embeddings.weight"] = read(ck, p + "wpe.weight", {c.max_positions(), h});
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const std::string s = p + fmt::format("h.{}.", l), o = layer(l);
      t[o + "input_layernorm.weight"] = read(ck, s + "ln_1.weight", {h});
      t[o + "input_layernorm.bias"] = read(ck, s + "ln_1.bias", {h});
      // c_attn: Conv1D [h, 3h], columns q | k | v -> [3h, h] rows q | k | v -> per-head q, k, v.
      const std::vector<float> w = transpose(read(ck, s + "attn.c_attn.weight", {h, 3 * h}), h, 3 * h);
      const std::vector<float> b = read(ck, s + "attn.c_attn.bias", {3 * h});
      auto part = [&](const std::vector<float>& a, int64_t i, int64_t width) {
        return std::vector<float>(a.begin() + i * h * width, a.begin() + (i + 1) * h * width);
      };
      t[o + "self_attention.linear_qkv.weight"] = pack_qkv(part(w, 0, h), part(w, 1, h), part(w, 2, h), n, n, d, h);
      t[o + "self_attention.linear_qkv.bias"] = pack_qkv(part(b, 0, 1), part(b, 1, 1), part(b, 2, 1), n, n, d, 1);
      t[o + "self_attention.linear_proj.weight"] = transpose(read(ck, s + "attn.c_proj.weight", {h, h}), h, h);
      t[o + "self_attention.linear_proj.bias"] = read(ck, s + "attn.c_proj.bias", {h});
      t[o + "pre_mlp_layernorm.weight"] = read(ck, s + "ln_2.weight", {h});
      t[o + "pre_mlp_layernorm.bias"] = read(ck, s + "ln_2.bias", {h});
      t[o + "mlp.linear_fc1.weight"] = transpose(read(ck, s + "mlp.c_fc.weight", {h, f}), h, f);
      t[o + "mlp.linear_fc1.bias"] = read(ck, s + "mlp.c_fc.bias", {f});
      t[o + "mlp.linear_fc2.weight"] = transpose(read(ck, s + "mlp.c_proj.weight", {f, h}), f, h);
      t[o + "mlp.linear_fc2.bias"] = read(ck, s + "mlp.c_proj.bias", {h});
    }
    t["decoder.final_layernorm.weight"] = read(ck, p + "ln_f.weight", {h});
    t["decoder.final_layernorm.bias"] = read(ck, p + "ln_f.bias", {h});
    return t;
  }
  t["embedding.word_embeddings.weight"] = pad_rows(read(ck, "model.embed_tokens.weight", {V, h}), Vp, h);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string s = fmt::format("model.layers.{}.", l), o = layer(l);
    t[o + "input_layernorm.weight"] = read(ck, s + "input_layernorm.weight", {h});
    t[o + "self_attention.linear_qkv.weight"] =
        pack_qkv(read(ck, s + "self_attn.q_proj.weight", {n * d, h}), read(ck, s + "self_attn.k_proj.weight", {g * d, h}),
                 read(ck, s + "self_attn.v_proj.weight", {g * d, h}), n, g, d, h);
    if (c.add_qkv_bias)
      t[o + "self_attention.linear_qkv.bias"] =
          pack_qkv(read(ck, s + "self_attn.q_proj.bias", {n * d}), read(ck, s + "self_attn.k_proj.bias", {g * d}),
                   read(ck, s + "self_attn.v_proj.bias", {g * d}), n, g, d, 1);
    if (c.qk_layernorm) {
      t[o + "self_attention.q_layernorm.weight"] = read(ck, s + "self_attn.q_norm.weight", {d});
      t[o + "self_attention.k_layernorm.weight"] = read(ck, s + "self_attn.k_norm.weight", {d});
    }
    t[o + "self_attention.linear_proj.weight"] = read(ck, s + "self_attn.o_proj.weight", {h, n * d});
    t[o + "pre_mlp_layernorm.weight"] = read(ck, s + "post_attention_layernorm.weight", {h});
    std::vector<float> fc1 = read(ck, s + "mlp.gate_proj.weight", {f, h});
    const std::vector<float> up = read(ck, s + "mlp.up_proj.weight", {f, h});
    fc1.insert(fc1.end(), up.begin(), up.end());  // [gate; up] = [2, f, h]
    t[o + "mlp.linear_fc1.weight"] = std::move(fc1);
    t[o + "mlp.linear_fc2.weight"] = read(ck, s + "mlp.down_proj.weight", {h, f});
  }
  t["decoder.final_layernorm.weight"] = read(ck, "model.norm.weight", {h});
  if (c.untie_embeddings_and_output_weights)
    t["output_layer.weight"] = pad_rows(read(ck, "lm_head.weight", {V, h}), Vp, h);
  return t;
}

std::vector<TensorToWrite> megatron_to_hf(const HfModel& m, const GlobalTensors& t, DType dtype) {
  const TransformerConfig& c = m.config;
  check_representable(m.arch, c);
  const int64_t h = c.hidden_size, n = c.num_attention_heads, g = c.query_groups(), d = c.head_dim(), f = c.ffn();
  const int64_t V = c.vocab_size;
  auto get = [&](const std::string& name) -> const std::vector<float>& {
    auto it = t.find(name);
    MT_REQUIRE(it != t.end(), "the checkpoint has no tensor '{}' (needed for {})", name, architecture_name(m.arch));
    return it->second;
  };
  std::vector<TensorToWrite> out;
  auto put = [&](std::string name, std::vector<int64_t> shape, std::vector<float> data) {
    out.push_back({std::move(name), dtype, std::move(shape), std::move(data)});
  };
  auto vocab = [&](const std::string& name) {
    const auto& a = get(name);
    return std::vector<float>(a.begin(), a.begin() + V * h);  // without the padding rows
  };
  std::vector<float> q, k, v;
  if (m.arch == HfArchitecture::kGpt2) {
    const std::string p = "transformer.";
    put(p + "wte.weight", {V, h}, vocab("embedding.word_embeddings.weight"));
    put(p + "wpe.weight", {c.max_positions(), h}, get("embedding.position_embeddings.weight"));
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const std::string s = p + fmt::format("h.{}.", l), o = layer(l);
      put(s + "ln_1.weight", {h}, get(o + "input_layernorm.weight"));
      put(s + "ln_1.bias", {h}, get(o + "input_layernorm.bias"));
      unpack_qkv(get(o + "self_attention.linear_qkv.weight"), n, n, d, h, q, k, v);
      std::vector<float> w = q;
      w.insert(w.end(), k.begin(), k.end());
      w.insert(w.end(), v.begin(), v.end());
      put(s + "attn.c_attn.weight", {h, 3 * h}, transpose(w, 3 * h, h));
      unpack_qkv(get(o + "self_attention.linear_qkv.bias"), n, n, d, 1, q, k, v);
      std::vector<float> b = q;
      b.insert(b.end(), k.begin(), k.end());
      b.insert(b.end(), v.begin(), v.end());
      put(s + "attn.c_attn.bias", {3 * h}, std::move(b));
      put(s + "attn.c_proj.weight", {h, h}, transpose(get(o + "self_attention.linear_proj.weight"), h, h));
      put(s + "attn.c_proj.bias", {h}, get(o + "self_attention.linear_proj.bias"));
      put(s + "ln_2.weight", {h}, get(o + "pre_mlp_layernorm.weight"));
      put(s + "ln_2.bias", {h}, get(o + "pre_mlp_layernorm.bias"));
      put(s + "mlp.c_fc.weight", {h, f}, transpose(get(o + "mlp.linear_fc1.weight"), f, h));
      put(s + "mlp.c_fc.bias", {f}, get(o + "mlp.linear_fc1.bias"));
      put(s + "mlp.c_proj.weight", {f, h}, transpose(get(o + "mlp.linear_fc2.weight"), h, f));
      put(s + "mlp.c_proj.bias", {h}, get(o + "mlp.linear_fc2.bias"));
    }
    put(p + "ln_f.weight", {h}, get("decoder.final_layernorm.weight"));
    put(p + "ln_f.bias", {h}, get("decoder.final_layernorm.bias"));
    return out;
  }
  put("model.embed_tokens.weight", {V, h}, vocab("embedding.word_embeddings.weight"));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string s = fmt::format("model.layers.{}.", l), o = layer(l);
    put(s + "input_layernorm.weight", {h}, get(o + "input_layernorm.weight"));
    unpack_qkv(get(o + "self_attention.linear_qkv.weight"), n, g, d, h, q, k, v);
    put(s + "self_attn.q_proj.weight", {n * d, h}, q);
    put(s + "self_attn.k_proj.weight", {g * d, h}, k);
    put(s + "self_attn.v_proj.weight", {g * d, h}, v);
    if (c.add_qkv_bias) {
      unpack_qkv(get(o + "self_attention.linear_qkv.bias"), n, g, d, 1, q, k, v);
      put(s + "self_attn.q_proj.bias", {n * d}, q);
      put(s + "self_attn.k_proj.bias", {g * d}, k);
      put(s + "self_attn.v_proj.bias", {g * d}, v);
    }
    if (c.qk_layernorm) {
      put(s + "self_attn.q_norm.weight", {d}, get(o + "self_attention.q_layernorm.weight"));
      put(s + "self_attn.k_norm.weight", {d}, get(o + "self_attention.k_layernorm.weight"));
    }
    put(s + "self_attn.o_proj.weight", {h, n * d}, get(o + "self_attention.linear_proj.weight"));
    put(s + "post_attention_layernorm.weight", {h}, get(o + "pre_mlp_layernorm.weight"));
    const auto& fc1 = get(o + "mlp.linear_fc1.weight");
    put(s + "mlp.gate_proj.weight", {f, h}, std::vector<float>(fc1.begin(), fc1.begin() + f * h));
    put(s + "mlp.up_proj.weight", {f, h}, std::vector<float>(fc1.begin() + f * h, fc1.end()));
    put(s + "mlp.down_proj.weight", {h, f}, get(o + "mlp.linear_fc2.weight"));
  }
  put("model.norm.weight", {h}, get("decoder.final_layernorm.weight"));
  if (c.untie_embeddings_and_output_weights) put("lm_head.weight", {V, h}, vocab("output_layer.weight"));
  return out;
}

}  // namespace mt::hf
