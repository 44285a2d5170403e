#include "model/hf/hf_convert.h"

#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/check.h"
#include "core/logging.h"
#include "model/hf/hf_deepseek.h"
#include "model/hf/hf_mapping.h"

namespace mt::hf {

namespace fs = std::filesystem;
using json = nlohmann::json;
using detail::decimal;
using detail::Fields;
using detail::layer;
using detail::pad_rows;
using detail::read;

const char* architecture_name(HfArchitecture a) {
  switch (a) {
    case HfArchitecture::kGpt2: return "GPT2LMHeadModel";
    case HfArchitecture::kLlama: return "LlamaForCausalLM";
    case HfArchitecture::kQwen2: return "Qwen2ForCausalLM";
    case HfArchitecture::kQwen3: return "Qwen3ForCausalLM";
    case HfArchitecture::kMixtral: return "MixtralForCausalLM";
    case HfArchitecture::kQwen3Moe: return "Qwen3MoeForCausalLM";
    case HfArchitecture::kQwen2Moe: return "Qwen2MoeForCausalLM";
    case HfArchitecture::kDeepseekV3: return "DeepseekV3ForCausalLM";
    case HfArchitecture::kDeepseekV2: return "DeepseekV2ForCausalLM";
  }
  return "?";
}

HfArchitecture parse_architecture(const std::string& name) {
  for (HfArchitecture a : {HfArchitecture::kGpt2, HfArchitecture::kLlama, HfArchitecture::kQwen2, HfArchitecture::kQwen3,
                           HfArchitecture::kMixtral, HfArchitecture::kQwen3Moe, HfArchitecture::kQwen2Moe,
                           HfArchitecture::kDeepseekV3, HfArchitecture::kDeepseekV2})
    if (name == architecture_name(a)) return a;
  MT_FAIL("unsupported Hugging Face architecture '{}': expected GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, "
          "Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, DeepseekV3ForCausalLM or "
          "DeepseekV2ForCausalLM",
          name);
}

bool is_moe(HfArchitecture a) {
  return a == HfArchitecture::kMixtral || a == HfArchitecture::kQwen3Moe || a == HfArchitecture::kQwen2Moe;
}

namespace {

/// The kinds of model/variants.h a Hugging Face family fixes: set on import, required on export.
struct FamilyKinds {
  Normalization normalization;
  PositionEmbeddingType positions;
  MlpActivation activation;
};

FamilyKinds family_kinds(HfArchitecture a) {
  if (a == HfArchitecture::kGpt2)
    return {Normalization::kLayerNorm, PositionEmbeddingType::kLearnedAbsolute, MlpActivation::kGelu};
  return {Normalization::kRMSNorm, PositionEmbeddingType::kRope, MlpActivation::kSwiGLU};  // Llama, Qwen, Mixtral
}

void set_family_kinds(HfArchitecture a, TransformerConfig& c) {
  const FamilyKinds k = family_kinds(a);
  c.normalization = k.normalization;
  c.position_embedding_type = k.positions;
  c.gated_linear_unit = k.activation == MlpActivation::kSwiGLU;  // Megatron's --swiglu
}

// --- config.json fields ---------------------------------------------------------------------

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
  set_family_kinds(HfArchitecture::kGpt2, c);
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

/// Qwen 3 MoE's layer pattern: layer l is MoE unless listed in mlp_only_layers, when (l + 1) is a
/// multiple of decoder_sparse_step (transformers' Qwen3MoeDecoderLayer).
std::vector<uint8_t> qwen3_moe_pattern(int64_t num_layers, int64_t sparse_step, const std::vector<int64_t>& mlp_only) {
  std::vector<uint8_t> p(static_cast<size_t>(num_layers), 0);
  for (int64_t l = 0; l < num_layers; ++l)
    p[static_cast<size_t>(l)] =
        std::find(mlp_only.begin(), mlp_only.end(), l) == mlp_only.end() && sparse_step > 0 && (l + 1) % sparse_step == 0;
  return p;
}

/// The MoE fields of Mixtral and Qwen 3 MoE (facts from transformers' modeling_mixtral.py and
/// modeling_qwen3_moe.py): the router is a bias-free linear [E, h]; its softmax over all experts,
/// top-k, and (Mixtral always, Qwen 3 MoE with norm_topk_prob) renormalisation over the selection
/// equal Megatron's softmax over the selected logits; without renormalisation it is Megatron's
/// --moe-router-pre-softmax. Experts are SwiGLU MLPs without biases.
void moe_config(const Fields& f, HfArchitecture arch, TransformerConfig& c) {
  c.moe_router_score_function = MoeScoreFunction::kSoftmax;
  c.moe_router_topk = f.get<int64_t>("num_experts_per_tok");
  c.set_moe_load_balancing(MoeLoadBalancing::kAuxLoss, f.get_or<float>("router_aux_loss_coef", 0.f));
  if (arch == HfArchitecture::kQwen2Moe) {  // the shared expert, scaled by sigmoid(shared_expert_gate(x))
    c.moe_shared_expert_intermediate_size = f.get<int64_t>("shared_expert_intermediate_size");
    MT_REQUIRE(c.moe_shared_expert_intermediate_size > 0, "{}: shared_expert_intermediate_size must be > 0, got {}",
               f.file, c.moe_shared_expert_intermediate_size);
    c.moe_shared_expert_gate = true;
  } else {
    MT_REQUIRE(f.get_or<int64_t>("shared_expert_intermediate_size", 0) == 0,
               "{}: shared experts (shared_expert_intermediate_size) are not supported for {}", f.file,
               architecture_name(arch));
  }
  if (arch == HfArchitecture::kMixtral) {
    c.num_moe_experts = f.get<int64_t>("num_local_experts");
    c.moe_ffn_hidden_size = c.ffn_hidden_size;  // intermediate_size is the experts' size; every layer is MoE
    c.moe_layer_pattern.clear();
    c.moe_router_pre_softmax = false;
    MT_REQUIRE(f.get_or<float>("router_jitter_noise", 0.f) == 0.f,
               "{}: router_jitter_noise {} is not supported (megatron.cpp's router has no input jitter)", f.file,
               f.get<float>("router_jitter_noise"));
    return;
  }
  // The released configs say num_experts; transformers 5 writes num_local_experts (its alias).
  c.num_moe_experts = f.get<int64_t>(f.has("num_experts") || !f.has("num_local_experts") ? "num_experts"
                                                                                        : "num_local_experts");
  c.moe_ffn_hidden_size = f.get<int64_t>("moe_intermediate_size");
  // transformers' Qwen3MoeConfig defaults norm_topk_prob to false (the released models set true).
  c.moe_router_pre_softmax = !f.get_or<bool>("norm_topk_prob", false);
  const int64_t step = f.get_or<int64_t>("decoder_sparse_step", 1);
  MT_REQUIRE(step >= 1, "{}: decoder_sparse_step must be >= 1, got {}", f.file, step);
  const auto mlp_only = f.get_or<std::vector<int64_t>>("mlp_only_layers", {});
  c.moe_layer_pattern = qwen3_moe_pattern(c.num_layers, step, mlp_only);
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
  set_family_kinds(arch, c);
  c.rotary_base = rope_theta(f);
  c.rotary_percent = f.get_or<float>("partial_rotary_factor", 1.0f);
  c.rotary_interleaved = false;
  const std::string act = f.get_or<std::string>("hidden_act", "silu");
  MT_REQUIRE(act == "silu", "{}: hidden_act '{}' is not supported (SwiGLU needs silu)", f.file, act);
  c.add_bias_linear = false;
  MT_REQUIRE(!f.get_or<bool>("mlp_bias", false), "{}: mlp_bias is not supported", f.file);
  const bool attention_bias = f.get_or<bool>("attention_bias", false);
  MT_REQUIRE(!attention_bias, "{}: attention_bias (biases on q/k/v and o_proj) is not supported; Qwen 2's q/k/v "
             "biases are", f.file);
  c.add_qkv_bias = arch == HfArchitecture::kQwen2 || arch == HfArchitecture::kQwen2Moe;
  MT_REQUIRE(!c.add_qkv_bias || f.get_or<bool>("qkv_bias", true),
             "{}: qkv_bias false is not supported for {} (its q/k/v biases are mapped)", f.file, architecture_name(arch));
  c.qk_layernorm = arch == HfArchitecture::kQwen3 || arch == HfArchitecture::kQwen3Moe;
  MT_REQUIRE(!f.get_or<bool>("use_sliding_window", false), "{}: use_sliding_window is not supported", f.file);
  if (arch == HfArchitecture::kMixtral && f.has("sliding_window")) {  // Mistral's window: inert if it spans every position
    const int64_t w = f.get<int64_t>("sliding_window");
    MT_REQUIRE(w >= c.max_position_embeddings,
               "{}: sliding_window {} (shorter than max_position_embeddings {}) is not supported", f.file, w,
               c.max_position_embeddings);
  }
  c.untie_embeddings_and_output_weights = !f.get_or<bool>("tie_word_embeddings", false);
  c.hidden_dropout = 0.f;
  c.attention_dropout = f.get_or<float>("attention_dropout", 0.f);
  c.init_method_std = f.get_or<float>("initializer_range", 0.02f);
  if (is_moe(arch)) moe_config(f, arch, c);
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
  } else if (detail::is_deepseek(m.arch)) {
    detail::deepseek_config(f, m.arch, c);
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
  if (detail::is_deepseek(arch)) {
    detail::check_deepseek_representable(arch, c);
    return;
  }
  const char* name = architecture_name(arch);
  auto need = [&](bool ok, const std::string& what) {
    MT_REQUIRE(ok, "the model cannot be exported as {}: {}", name, what);
  };
  need(c.mtp_num_layers == 0, fmt::format("it has {} multi-token prediction layers (--mtp-num-layers), which only "
                                          "DeepseekV3ForCausalLM holds", c.mtp_num_layers));
  if (!is_moe(arch)) need(c.num_moe_experts == 0, "it has mixture-of-experts layers (MixtralForCausalLM, "
                                                  "Qwen3MoeForCausalLM or Qwen2MoeForCausalLM can hold them)");
  need(!c.multi_latent_attention, "it has multi-latent attention (DeepseekV3ForCausalLM or DeepseekV2ForCausalLM holds it)");
  const FamilyKinds k = family_kinds(arch);
  need(c.normalization == k.normalization, fmt::format("{} is required (--normalization, got {})",
                                                       normalization_name(k.normalization),
                                                       normalization_name(c.normalization)));
  need(c.position_embedding_type == k.positions,
       fmt::format("{} positions are required (--position-embedding-type, got {})",
                   position_embedding_type_name(k.positions), position_embedding_type_name(c.position_embedding_type)));
  need(c.activation() == k.activation, fmt::format("a {} MLP is required (got {})", mlp_activation_name(k.activation),
                                                   mlp_activation_name(c.activation())));
  if (arch == HfArchitecture::kGpt2) {
    need(c.add_bias_linear, "GPT-2 has biases");
    need(c.query_groups() == c.num_attention_heads, "GPT-2 has no grouped-query attention");
    need(c.head_dim() * c.num_attention_heads == c.hidden_size, "GPT-2 has head dim = hidden / heads");
    need(!c.qk_layernorm, "GPT-2 has no QK-norm");
    need(c.tied_output(), "GPT-2 ties the output layer to the embedding");
    return;
  }
  need(!c.rotary_interleaved, "transformers' RoPE rotates halves (no --rotary-interleaved)");
  need(!c.add_bias_linear, "no biases on the projections");
  need(c.add_qkv_bias == (arch == HfArchitecture::kQwen2 || arch == HfArchitecture::kQwen2Moe),
       "a QKV bias exactly for Qwen2ForCausalLM and Qwen2MoeForCausalLM");
  need(c.qk_layernorm == (arch == HfArchitecture::kQwen3 || arch == HfArchitecture::kQwen3Moe),
       "QK-norm exactly for Qwen3ForCausalLM and Qwen3MoeForCausalLM");
  if (!is_moe(arch)) return;
  need(c.num_moe_experts > 0, "mixture-of-experts layers are required (--num-experts)");
  if (arch == HfArchitecture::kQwen2Moe) {
    need(c.moe_shared_expert_intermediate_size > 0 && c.moe_shared_expert_gate,
         "a gated shared expert (--moe-shared-expert-intermediate-size with --moe-shared-expert-gate)");
  } else {
    need(c.moe_shared_expert_intermediate_size == 0, "no shared experts (--moe-shared-expert-intermediate-size)");
  }
  need(c.moe_router_score_function == MoeScoreFunction::kSoftmax, "a softmax router is required");
  need(c.moe_router_topk_scaling_factor == 1.f, "no --moe-router-topk-scaling-factor");
  need(c.moe_router_num_groups == 0, "no group-limited routing (--moe-router-num-groups)");
  if (arch == HfArchitecture::kMixtral) {
    need(c.num_moe_layers() == c.num_layers, "every layer must be a MoE layer (--moe-layer-freq 1)");
    need(!c.moe_router_pre_softmax, "Mixtral renormalises the top-k probabilities (no --moe-router-pre-softmax)");
  }
}

HfArchitecture infer_architecture(const TransformerConfig& c) {
  if (c.multi_latent_attention)  // DeepSeek-V2 routes with softmax scores, V3 with sigmoid ones
    return c.num_moe_experts > 0 && c.moe_router_score_function == MoeScoreFunction::kSoftmax
               ? HfArchitecture::kDeepseekV2
               : HfArchitecture::kDeepseekV3;
  if (c.num_moe_experts > 0) {
    if (c.qk_layernorm) return HfArchitecture::kQwen3Moe;
    return c.moe_shared_expert_intermediate_size > 0 || c.add_qkv_bias ? HfArchitecture::kQwen2Moe
                                                                      : HfArchitecture::kMixtral;
  }
  if (c.position_embedding_type == family_kinds(HfArchitecture::kGpt2).positions) return HfArchitecture::kGpt2;
  if (c.qk_layernorm) return HfArchitecture::kQwen3;
  if (c.add_qkv_bias && !c.add_bias_linear) return HfArchitecture::kQwen2;
  return HfArchitecture::kLlama;
}

namespace {

const char* model_type(HfArchitecture a) {
  switch (a) {
    case HfArchitecture::kGpt2: return "gpt2";
    case HfArchitecture::kLlama: return "llama";
    case HfArchitecture::kQwen2: return "qwen2";
    case HfArchitecture::kQwen3: return "qwen3";
    case HfArchitecture::kMixtral: return "mixtral";
    case HfArchitecture::kQwen3Moe: return "qwen3_moe";
    case HfArchitecture::kQwen2Moe: return "qwen2_moe";
    case HfArchitecture::kDeepseekV3: return "deepseek_v3";
    case HfArchitecture::kDeepseekV2: return "deepseek_v2";
  }
  return "?";
}

// The MoE fields of a Mixtral / Qwen 3 MoE config.json `j`. The training-only router fields
// (router_aux_loss_coef, output_router_logits) of `j` (from the imported config) are kept, and so
// are the imported config's (`base`) decoder_sparse_step / mlp_only_layers when they give this
// model's layer pattern.
void moe_hf_config(HfArchitecture arch, const TransformerConfig& c, const json& base, json& j) {
  j["num_experts_per_tok"] = c.moe_router_topk;
  if (!j.contains("router_aux_loss_coef")) j["router_aux_loss_coef"] = decimal(c.moe_aux_coeff(MoeLoadBalancing::kAuxLoss));
  if (!j.contains("output_router_logits")) j["output_router_logits"] = false;
  if (arch == HfArchitecture::kMixtral) {
    j["num_local_experts"] = c.num_moe_experts;
    j["intermediate_size"] = c.moe_ffn();
    j["router_jitter_noise"] = 0.0;
    if (!j.contains("sliding_window")) j["sliding_window"] = nullptr;
    return;
  }
  // The imported config's name for the number of experts (transformers 5 writes num_local_experts).
  const bool v5 = base.is_object() && base.contains("num_local_experts") && !base.contains("num_experts");
  j[v5 ? "num_local_experts" : "num_experts"] = c.num_moe_experts;
  j["moe_intermediate_size"] = c.moe_ffn();
  if (arch == HfArchitecture::kQwen2Moe) j["shared_expert_intermediate_size"] = c.moe_shared_expert_intermediate_size;
  j["norm_topk_prob"] = !c.moe_router_pre_softmax;
  std::vector<uint8_t> want(static_cast<size_t>(c.num_layers));
  std::vector<int64_t> dense;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    want[static_cast<size_t>(l)] = c.is_moe_layer(l) ? 1 : 0;
    if (!c.is_moe_layer(l)) dense.push_back(l);
  }
  bool same = false;
  try {
    same = base.is_object() && base.contains("decoder_sparse_step") && base.contains("mlp_only_layers") &&
           qwen3_moe_pattern(c.num_layers, base.at("decoder_sparse_step").get<int64_t>(),
                             base.at("mlp_only_layers").get<std::vector<int64_t>>()) == want;
  } catch (const json::exception&) {
    same = false;
  }
  j["decoder_sparse_step"] = same ? base.at("decoder_sparse_step") : json(1);
  j["mlp_only_layers"] = same ? base.at("mlp_only_layers") : json(dense);
}

}  // namespace

json make_hf_config(HfArchitecture arch, const TransformerConfig& c, const json& base, DType dtype) {
  if (detail::is_deepseek(arch)) return detail::deepseek_hf_config(arch, c, base, dtype);
  check_representable(arch, c);
  json j = base.is_object() ? base : json::object();
  // Drop fields of another architecture a base config may carry.
  for (const char* k : {"n_embd", "n_layer", "n_head", "n_positions", "n_ctx", "n_inner", "hidden_size",
                        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                        "intermediate_size", "rope_theta", "rope_parameters", "rope_scaling", "num_local_experts",
                        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                        "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size",
                        "router_jitter_noise"})
    j.erase(k);
  if (!is_moe(arch))
    for (const char* k : {"router_aux_loss_coef", "output_router_logits", "sliding_window"}) j.erase(k);
  j["architectures"] = {architecture_name(arch)};
  j["model_type"] = model_type(arch);
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_positions();
  j["torch_dtype"] = dtype == DType::kBF16 ? "bfloat16" : dtype == DType::kF16 ? "float16" : "float32";
  if (arch == HfArchitecture::kGpt2) {
    j.erase("max_position_embeddings");
    j["n_embd"] = c.hidden_size;
    j["n_layer"] = c.num_layers;
    j["n_head"] = c.num_attention_heads;
    j["n_positions"] = c.max_positions();
    j["n_inner"] = c.ffn();
    j["layer_norm_epsilon"] = decimal(c.norm_epsilon);
    j["activation_function"] = "gelu_new";
    j["tie_word_embeddings"] = true;
    if (!j.contains("initializer_range")) j["initializer_range"] = decimal(c.init_method_std);
    return j;
  }
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.query_groups();
  j["head_dim"] = c.head_dim();
  j["intermediate_size"] = c.ffn();
  j["rms_norm_eps"] = decimal(c.norm_epsilon);
  j["hidden_act"] = "silu";
  j["rope_theta"] = decimal(c.rotary_base);
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", decimal(c.rotary_base)}};
  if (c.rotary_percent != 1.f) j["partial_rotary_factor"] = decimal(c.rotary_percent);
  if (arch != HfArchitecture::kMixtral && arch != HfArchitecture::kQwen2Moe) {
    j["attention_bias"] = false;
    if (arch != HfArchitecture::kQwen3Moe) j["mlp_bias"] = false;
  }
  j["tie_word_embeddings"] = c.tied_output();
  if (arch == HfArchitecture::kQwen2 || arch == HfArchitecture::kQwen3 || arch == HfArchitecture::kQwen3Moe ||
      arch == HfArchitecture::kQwen2Moe)
    j["use_sliding_window"] = false;
  if (!j.contains("initializer_range")) j["initializer_range"] = decimal(c.init_method_std);
  if (is_moe(arch)) moe_hf_config(arch, c, base, j);
  return j;
}

namespace {

// --- tensors --------------------------------------------------------------------------------

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

/// GPT-2 tensor names come with or without the "transformer." prefix (save_pretrained of
/// GPT2LMHeadModel vs. the original hub files).
std::string gpt2_prefix(const SafetensorsCheckpoint& ck) {
  return ck.has("transformer.wte.weight") ? "transformer." : "";
}

// --- mixture of experts ---------------------------------------------------------------------
//
// Per layer l (transformers' on-disk "Hub" names; Mixtral's module is block_sparse_moe, Qwen 3
// MoE's mlp): the router and routed experts of hf_mapping.h's routed_experts_to_megatron, with
// Mixtral's w1 / w3 / w2 for gate_proj / up_proj / down_proj. transformers 5 models hold the
// experts fused under model.layers.l.mlp; both are read, the Hub names are written.

struct MoeNames {
  std::string prefix;  // ends with '.'
  detail::SwigluNames expert;
};
MoeNames moe_names(HfArchitecture a, int64_t l) {
  if (a == HfArchitecture::kMixtral) return {fmt::format("model.layers.{}.block_sparse_moe.", l), {"w1", "w3", "w2"}};
  return {fmt::format("model.layers.{}.mlp.", l), {}};
}

// Qwen 2 MoE's shared expert and its gate (the same names in transformers 4 and 5):
//   <prefix>.shared_expert.{gate_proj,up_proj}.weight [f_s, h] -> mlp.shared_experts.linear_fc1.weight [2, f_s, h]
//   <prefix>.shared_expert.down_proj.weight [h, f_s]           -> mlp.shared_experts.linear_fc2.weight [h, f_s]
//   <prefix>.shared_expert_gate.weight [1, h]                  -> mlp.shared_experts.gate_weight [1, h]
void moe_to_megatron(const HfModel& m, const SafetensorsCheckpoint& ck, int64_t l, GlobalTensors& t) {
  const TransformerConfig& c = m.config;
  const int64_t h = c.hidden_size;
  const MoeNames n = moe_names(m.arch, l);
  const std::string o = layer(l) + "mlp.";
  if (const int64_t fs = c.moe_shared_expert_intermediate_size; fs > 0) {
    detail::swiglu_to_megatron(ck, n.prefix + "shared_expert.", o + "shared_experts.", fs, h, t);
    if (c.moe_shared_expert_gate) t[o + "shared_experts.gate_weight"] = read(ck, n.prefix + "shared_expert_gate.weight", {1, h});
  }
  detail::routed_experts_to_megatron(ck, n.prefix, fmt::format("model.layers.{}.mlp.", l), o, c.num_moe_experts,
                                     c.moe_ffn(), h, t, n.expert);
}

void moe_to_hf(const HfModel& m, int64_t l, const detail::GetTensor& get, const detail::PutTensor& put) {
  const TransformerConfig& c = m.config;
  const int64_t h = c.hidden_size;
  const MoeNames n = moe_names(m.arch, l);
  const std::string o = layer(l) + "mlp.";
  if (const int64_t fs = c.moe_shared_expert_intermediate_size; fs > 0) {
    detail::swiglu_to_hf(get, put, o + "shared_experts.", n.prefix + "shared_expert.", fs, h);
    if (c.moe_shared_expert_gate) put(n.prefix + "shared_expert_gate.weight", {1, h}, get(o + "shared_experts.gate_weight"));
  }
  detail::routed_experts_to_hf(get, put, o, n.prefix, c.num_moe_experts, c.moe_ffn(), h, n.expert);
}

// --apply-layernorm-1p (TransformerConfig::layernorm_zero_centered_gamma): every norm weight
// (names ending in "norm.weight": input, pre-MLP, final, q / k, MLA's latent norms, MTP's enorm /
// hnorm) stored as the scale minus 1. delta -1: HF scale -> stored weight; +1: back. Nothing
// without the flag.
void shift_norm_weights(GlobalTensors& t, const TransformerConfig& c, float delta) {
  if (!c.layernorm_zero_centered_gamma) return;
  const std::string suffix = "norm.weight";
  for (auto& [name, v] : t)
    if (name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      for (float& x : v) x += delta;
}

}  // namespace

std::vector<std::string> expert_bias_state_names(const TransformerConfig& c) {
  std::vector<std::string> names;
  if (c.num_moe_experts == 0 || !c.moe_router_enable_expert_bias) return names;
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (c.is_moe_layer(l)) names.push_back(fmt::format("decoder.layers.{}.mlp.router.expert_bias", l));
  if (c.is_moe_layer(c.num_layers - 1))  // the MTP layers take the last decoder layer's kind
    for (int64_t d = 0; d < c.mtp_num_layers; ++d)
      names.push_back(fmt::format("mtp.layers.{}.transformer_layer.mlp.router.expert_bias", d));
  return names;
}

void drop_absent_mtp_layers(HfModel& m, const SafetensorsCheckpoint& ck) {
  TransformerConfig& c = m.config;
  if (m.arch != HfArchitecture::kDeepseekV3 || c.mtp_num_layers == 0) return;
  const std::string first = fmt::format("model.layers.{}.eh_proj.weight", c.num_layers);
  if (ck.has(first)) return;
  log_info("> {} holds no '{}': importing without the {} multi-token prediction layer(s) of "
           "num_nextn_predict_layers (transformers does not keep them)", ck.dir(), first, c.mtp_num_layers);
  c.mtp_num_layers = 0;
}

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
    shift_norm_weights(t, c, -1.f);
    return t;
  }
  if (detail::is_deepseek(m.arch)) {
    detail::deepseek_to_megatron(m, ck, t);
    shift_norm_weights(t, c, -1.f);
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
    if (c.is_moe_layer(l)) {
      moe_to_megatron(m, ck, l, t);
      continue;
    }
    detail::swiglu_to_megatron(ck, s + "mlp.", o + "mlp.", f, h, t);
  }
  t["decoder.final_layernorm.weight"] = read(ck, "model.norm.weight", {h});
  if (c.untie_embeddings_and_output_weights)
    t["output_layer.weight"] = pad_rows(read(ck, "lm_head.weight", {V, h}), Vp, h);
  shift_norm_weights(t, c, -1.f);
  return t;
}

std::vector<TensorToWrite> megatron_to_hf(const HfModel& m, const GlobalTensors& tensors, DType dtype) {
  const TransformerConfig& c = m.config;
  check_representable(m.arch, c);
  GlobalTensors shifted;  // --apply-layernorm-1p: the HF norm weight is the scale 1 + weight
  if (c.layernorm_zero_centered_gamma) {
    shifted = tensors;
    shift_norm_weights(shifted, c, 1.f);
  }
  const GlobalTensors& t = c.layernorm_zero_centered_gamma ? shifted : tensors;
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
  if (detail::is_deepseek(m.arch)) {
    detail::deepseek_to_hf(m, get, put, [&](std::string name, std::vector<int64_t> shape, std::vector<float> data) {
      out.push_back({std::move(name), DType::kF32, std::move(shape), std::move(data)});
    });
    return out;
  }
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
    if (c.is_moe_layer(l)) {
      moe_to_hf(m, l, get, put);
      continue;
    }
    detail::swiglu_to_hf(get, put, o + "mlp.", s + "mlp.", f, h);
  }
  put("model.norm.weight", {h}, get("decoder.final_layernorm.weight"));
  if (c.untie_embeddings_and_output_weights) put("lm_head.weight", {V, h}, vocab("output_layer.weight"));
  return out;
}

}  // namespace mt::hf
