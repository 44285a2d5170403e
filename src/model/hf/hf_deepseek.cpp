#include "model/hf/hf_deepseek.h"

#include <fmt/format.h>

#include "core/logging.h"
#include "ops/rope_math.h"

namespace mt::hf::detail {

namespace {

using json = nlohmann::json;

bool v2(HfArchitecture a) { return a == HfArchitecture::kDeepseekV2; }

// --- RoPE -----------------------------------------------------------------------------------

/// What config.json's RoPE fields mean, as megatron.cpp's MLA settings.
struct Rope {
  float theta = 10000.f;
  bool yarn = false;
  float factor = 1.f;
  int64_t original = 4096;
  float beta_fast = 32.f, beta_slow = 1.f, mscale = 1.f, mscale_all_dim = 0.f;
  bool operator==(const Rope&) const = default;
};

/// transformers 5 (configuration_deepseek_v3.py convert_rope_params_to_dict): rope_scaling when
/// given, else rope_parameters; rope_theta inside it, else the top-level rope_theta. YaRN as
/// modeling_rope_utils._compute_yarn_parameters: factor defaults to max_position_embeddings /
/// original_max_position_embeddings, beta_fast / beta_slow to 32 / 1 (also when 0), cos and sin
/// scaled by get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are
/// non-zero, else by get_mscale(factor); the softmax scale by get_mscale(factor, mscale_all_dim)²
/// when rope_type is not default (yarn_apply_mscale in DeepseekV3Attention.__init__, and in
/// DeepseekV2Attention.__init__ since transformers 5.17, huggingface/transformers#47435: DeepSeek's
/// own V2 code always did; transformers <= 5.16's DeepseekV2 used 1/sqrt(d_n + d_r) alone).
/// Both families alike. Megatron's YaRN scales cos and sin by the ratio always, so mscale 1 is
/// HF's "else" branch, exact unless mscale_all_dim is set without mscale (an error).
Rope parse_rope(const Fields& f, int64_t max_positions, HfArchitecture arch) {
  const char* arch_name = architecture_name(arch);
  Rope r;
  const char* key = f.has("rope_scaling") ? "rope_scaling" : f.has("rope_parameters") ? "rope_parameters" : nullptr;
  const json empty = json::object();
  const json& d = key ? f.j.at(key) : empty;
  MT_REQUIRE(d.is_object(), "{}: field '{}' must be an object, got {}", f.file, key ? key : "", d.dump());
  const Fields rf{d, fmt::format("{} ({})", f.file, key ? key : "rope")};
  r.theta = rf.has("rope_theta") ? rf.get<float>("rope_theta") : f.get_or<float>("rope_theta", 10000.f);
  const std::string type = rf.get_or<std::string>("rope_type", rf.get_or<std::string>("type", "default"));
  MT_REQUIRE(rf.get_or<float>("partial_rotary_factor", 1.f) == 1.f && f.get_or<float>("partial_rotary_factor", 1.f) == 1.f,
             "{}: partial_rotary_factor is not supported for {} (MLA rotates all qk_rope_head_dim channels)", f.file,
             arch_name);
  if (type == "default") return r;
  MT_REQUIRE(type == "yarn", "{}: rope_type '{}' is not supported for {}: 'default' or 'yarn'", f.file, type, arch_name);
  r.yarn = true;
  r.original = rf.get_or<int64_t>("original_max_position_embeddings", max_positions);
  MT_REQUIRE(r.original > 0, "{}: original_max_position_embeddings must be > 0, got {}", rf.file, r.original);
  r.factor = rf.has("factor") ? rf.get<float>("factor")
                              : static_cast<float>(static_cast<double>(max_positions) / static_cast<double>(r.original));
  MT_REQUIRE(!rf.has("attention_factor"), "{}: YaRN's attention_factor {} is not supported (megatron.cpp scales cos "
             "and sin by mscale / mscale_all_dim only)", rf.file, rf.j.at("attention_factor").dump());
  MT_REQUIRE(rf.get_or<bool>("truncate", true), "{}: YaRN with truncate false is not supported (the correction "
             "range is rounded to whole channels, as DeepSeek-V3)", rf.file);
  const float bf = rf.get_or<float>("beta_fast", 0.f), bs = rf.get_or<float>("beta_slow", 0.f);
  r.beta_fast = bf != 0.f ? bf : 32.f;
  r.beta_slow = bs != 0.f ? bs : 1.f;
  const float ms = rf.get_or<float>("mscale", 0.f), msa = rf.get_or<float>("mscale_all_dim", 0.f);
  MT_REQUIRE(ms != 0.f || msa == 0.f || r.factor <= 1.f,
             "{}: mscale_all_dim {} without mscale is not supported: transformers then scales cos and sin by "
             "get_mscale(factor), which megatron.cpp's YaRN (get_mscale(factor, mscale) / get_mscale(factor, "
             "mscale_all_dim)) cannot express; set mscale too",
             rf.file, msa);
  r.mscale = ms != 0.f && msa != 0.f ? ms : 1.f;
  r.mscale_all_dim = msa;
  return r;
}

Rope rope_of(const TransformerConfig& c) {
  Rope r;
  r.theta = c.rotary_base;
  if (c.rope_type != RopeType::kYarn) return r;
  r.yarn = true;
  r.factor = c.rotary_scaling_factor;
  r.original = c.original_max_position_embeddings;
  r.beta_fast = c.beta_fast;
  r.beta_slow = c.beta_slow;
  r.mscale = c.mscale;
  r.mscale_all_dim = c.mscale_all_dim;
  return r;
}

/// The rope fields of a fresh config.json for `r` (transformers 5's rope_parameters and, for
/// transformers 4 and DeepSeek's code, rope_scaling); the same for both families.
void put_rope(const Rope& r, json& j) {
  json params = {{"rope_type", r.yarn ? "yarn" : "default"}, {"rope_theta", decimal(r.theta)}};
  if (r.yarn)
    params.update({{"factor", decimal(r.factor)}, {"original_max_position_embeddings", r.original},
                   {"beta_fast", decimal(r.beta_fast)}, {"beta_slow", decimal(r.beta_slow)},
                   {"mscale", decimal(r.mscale)}, {"mscale_all_dim", decimal(r.mscale_all_dim)}});
  j["rope_theta"] = decimal(r.theta);
  j["rope_parameters"] = params;
  json scaling = nullptr;
  if (r.yarn) {
    scaling = params;
    scaling.erase("rope_theta");
    scaling["type"] = "yarn";
  }
  j["rope_scaling"] = scaling;
}

void set_rope(const Rope& r, TransformerConfig& c) {
  c.rotary_base = r.theta;
  c.rope_type = r.yarn ? RopeType::kYarn : RopeType::kRope;
  if (!r.yarn) return;
  c.rotary_scaling_factor = r.factor;
  c.original_max_position_embeddings = r.original;
  c.beta_fast = r.beta_fast;
  c.beta_slow = r.beta_slow;
  c.mscale = r.mscale;
  c.mscale_all_dim = r.mscale_all_dim;
}

/// The rows [r0, r0 + dr) of a [rows, cols] matrix between transformers' rotate-half pairs
/// (j, j + dr/2) and megatron.cpp's interleaved pairs (2j, 2j + 1).
void permute_rope_rows(std::vector<float>& w, int64_t r0, int64_t dr, int64_t cols, bool to_interleaved) {
  const std::vector<float> old(w.begin() + r0 * cols, w.begin() + (r0 + dr) * cols);
  for (int64_t j = 0; j < dr / 2; ++j)
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t ours = 2 * j + half, theirs = j + half * dr / 2;
      const int64_t from = to_interleaved ? theirs : ours, to = to_interleaved ? ours : theirs;
      std::copy(old.begin() + from * cols, old.begin() + (from + 1) * cols, w.begin() + (r0 + to) * cols);
    }
}

/// HF's rope_interleave (default true): whether the checkpoint's rope rows are DeepSeek's
/// interleaved pairs. DeepseekV2 always rotates interleaved pairs (its apply_rotary_emb: complex
/// numbers of channels (2i, 2i+1)).
bool rope_interleave(const json& config, HfArchitecture arch) {
  return v2(arch) || !(config.is_object() && config.contains("rope_interleave") && config.at("rope_interleave").is_boolean() &&
           !config.at("rope_interleave").get<bool>());
}

// --- MoE ------------------------------------------------------------------------------------

/// DeepSeek's training-only fields (its released config.json; transformers ignores them):
/// aux_loss_alpha with seq_aux -> the sequence-level or the batch aux loss, else none.
void load_balancing(const Fields& f, TransformerConfig& c) {
  const float alpha = f.get_or<float>("aux_loss_alpha", 0.f);
  if (alpha > 0.f)
    c.set_moe_load_balancing(f.get_or<bool>("seq_aux", true) ? MoeLoadBalancing::kSeqAuxLoss : MoeLoadBalancing::kAuxLoss,
                             alpha);
  else
    c.set_moe_load_balancing(MoeLoadBalancing::kNone, 0.f);
}

/// The routing fields: transformers' DeepseekV3MoE.route_tokens_to_experts (sigmoid scores s,
/// selection on s + e_score_correction_bias, group score = sum of a group's best 2, the best
/// topk_group groups compete, weights s[top] normalised when norm_topk_prob, times
/// routed_scaling_factor) against Megatron's sigmoid router with expert bias (normalised when
/// k > 1; a group's score is the sum of its best k / group_topk).
void moe_routing(const Fields& f, TransformerConfig& c) {
  const char* arch_name = "DeepseekV3ForCausalLM";
  const std::string scoring = f.get_or<std::string>("scoring_func", "sigmoid");
  const std::string method = f.get_or<std::string>("topk_method", "noaux_tc");
  MT_REQUIRE(scoring == "sigmoid", "{}: scoring_func '{}' is not supported for {}: transformers' DeepseekV3 (and "
             "topk_method '{}') route with sigmoid scores", f.file, scoring, arch_name, method);
  MT_REQUIRE(method == "noaux_tc", "{}: topk_method '{}' is not supported: {} routes as DeepSeek-V3's 'noaux_tc' "
             "(sigmoid scores plus e_score_correction_bias, group-limited); DeepSeek-V2's 'greedy' / "
             "'group_limited_greedy' are DeepseekV2ForCausalLM's", f.file, method, arch_name);
  const int64_t k = c.moe_router_topk, E = c.num_moe_experts;
  c.moe_router_score_function = MoeScoreFunction::kSigmoid;
  c.moe_router_enable_expert_bias = true;
  c.moe_router_topk_scaling_factor = f.get_or<float>("routed_scaling_factor", 2.5f);
  const bool norm = f.get_or<bool>("norm_topk_prob", true);
  MT_REQUIRE(norm == (k > 1), "{}: norm_topk_prob {} with num_experts_per_tok {} is not supported: Megatron's sigmoid "
             "router normalises the selected scores exactly when top-k > 1", f.file, norm, k);
  const int64_t groups = f.get_or<int64_t>("n_group", 8), group_topk = f.get_or<int64_t>("topk_group", 4);
  MT_REQUIRE(groups >= 1 && group_topk >= 1 && group_topk <= groups && E % groups == 0 && E / groups >= 2,
             "{}: n_group {} / topk_group {} with n_routed_experts {}: expected 1 <= topk_group <= n_group, n_group "
             "dividing the experts into groups of at least 2", f.file, groups, group_topk, E);
  if (group_topk < groups) {  // the groups restrict the choice
    MT_REQUIRE(k == 2 * group_topk, "{}: n_group {} / topk_group {} with num_experts_per_tok {}: transformers scores "
               "a group by its best 2 experts, Megatron by its best num_experts_per_tok / topk_group = {}; only "
               "num_experts_per_tok = 2 · topk_group (DeepSeek-V3: 8 = 2 · 4) routes the same",
               f.file, groups, group_topk, k, static_cast<double>(k) / static_cast<double>(group_topk));
    c.moe_router_num_groups = groups;
    c.moe_router_group_topk = group_topk;
  }
  load_balancing(f, c);
}

/// DeepseekV2MoE.route_tokens_to_experts: softmax over all experts (fp32), then topk_method
/// 'greedy' (the top-k probabilities) or 'group_limited_greedy' (a group scored by its best
/// probability, the best topk_group groups compete, the others masked with 0), the weights the
/// selected probabilities times routed_scaling_factor, never renormalised (norm_topk_prob is not
/// read). Megatron: softmax before top-k (--moe-router-pre-softmax), --moe-router-topk-scaling-factor,
/// a group scored by the sum of its best top-k / group-topk: the same only for top-k = topk_group.
void moe_routing_v2(const Fields& f, TransformerConfig& c) {
  const char* arch_name = "DeepseekV2ForCausalLM";
  const std::string scoring = f.get_or<std::string>("scoring_func", "softmax");
  const std::string method = f.get_or<std::string>("topk_method", "greedy");
  MT_REQUIRE(scoring == "softmax", "{}: scoring_func '{}' is not supported for {}: it routes with softmax scores "
             "(DeepSeek-V3's sigmoid routing is DeepseekV3ForCausalLM)", f.file, scoring, arch_name);
  MT_REQUIRE(method == "greedy" || method == "group_limited_greedy", "{}: topk_method '{}' is not supported for {}: "
             "'greedy' or 'group_limited_greedy'", f.file, method, arch_name);
  const int64_t k = c.moe_router_topk, E = c.num_moe_experts;
  c.moe_router_score_function = MoeScoreFunction::kSoftmax;
  c.moe_router_pre_softmax = true;
  c.moe_router_enable_expert_bias = false;
  c.moe_router_topk_scaling_factor = f.get_or<float>("routed_scaling_factor", 1.f);
  MT_REQUIRE(!f.get_or<bool>("norm_topk_prob", false) || k == 1, "{}: norm_topk_prob true with num_experts_per_tok "
             "{} is not supported: transformers' {} never renormalises the selected probabilities (DeepSeek's own "
             "code does), so the model is not defined by its config", f.file, k, arch_name);
  if (method == "group_limited_greedy") {
    MT_REQUIRE(f.has("n_group") && f.has("topk_group"), "{}: topk_method 'group_limited_greedy' needs n_group and "
               "topk_group", f.file);
    const int64_t groups = f.get<int64_t>("n_group"), group_topk = f.get<int64_t>("topk_group");
    MT_REQUIRE(groups >= 1 && group_topk >= 1 && group_topk <= groups && E % groups == 0 && group_topk * (E / groups) >= k,
               "{}: n_group {} / topk_group {} with n_routed_experts {} and num_experts_per_tok {}: expected 1 <= "
               "topk_group <= n_group, n_group dividing the experts, and the chosen groups holding top-k experts",
               f.file, groups, group_topk, E, k);
    if (group_topk < groups) {  // the groups restrict the choice
      MT_REQUIRE(k == group_topk, "{}: group_limited_greedy with topk_group {} and num_experts_per_tok {}: transformers "
                 "scores a group by its best expert, Megatron by the sum of its best num_experts_per_tok / topk_group "
                 "= {}; only num_experts_per_tok = topk_group routes the same (DeepSeek-V2's 6 of 3 groups does not)",
                 f.file, group_topk, k, static_cast<double>(k) / static_cast<double>(group_topk));
      c.moe_router_num_groups = groups;
      c.moe_router_group_topk = group_topk;
    }
  }
  load_balancing(f, c);
}

/// The families' defaults (configuration_deepseek_v2.py / configuration_deepseek_v3.py).
void moe_config(const Fields& f, HfArchitecture arch, TransformerConfig& c) {
  const int64_t L = c.num_layers, dense = f.get_or<int64_t>("first_k_dense_replace", v2(arch) ? 0 : 3);
  const int64_t E = f.get_or<int64_t>("n_routed_experts", v2(arch) ? 64 : 256);
  MT_REQUIRE(dense >= 0 && E >= 0, "{}: first_k_dense_replace {} and n_routed_experts {} must be >= 0", f.file, dense, E);
  MT_REQUIRE(f.get_or<int64_t>("moe_layer_freq", 1) == 1, "{}: moe_layer_freq {} is not supported (transformers' "
             "DeepSeek models ignore it: every layer from first_k_dense_replace is MoE)", f.file, f.get<int64_t>("moe_layer_freq"));
  MT_REQUIRE(dense != L || E == 0 || c.mtp_num_layers == 0,
             "{}: first_k_dense_replace {} = num_hidden_layers with num_nextn_predict_layers {}: DeepSeek's MTP layer "
             "(index {}) would be a MoE layer after dense ones, megatron.cpp's MTP layer takes the last decoder "
             "layer's kind", f.file, dense, c.mtp_num_layers, L);
  if (E == 0 || dense >= L) return;  // a dense model
  c.num_moe_experts = E;
  c.moe_layer_pattern.assign(static_cast<size_t>(L), 1);
  std::fill(c.moe_layer_pattern.begin(), c.moe_layer_pattern.begin() + dense, 0);
  c.moe_ffn_hidden_size = f.get<int64_t>("moe_intermediate_size");
  c.moe_router_topk = f.get<int64_t>("num_experts_per_tok");
  MT_REQUIRE(!v2(arch) || f.has("n_shared_experts") || !f.j.contains("n_shared_experts"),
             "{}: n_shared_experts null is not supported: transformers' DeepseekV2 always adds the shared experts", f.file);
  const int64_t shared = f.get_or<int64_t>("n_shared_experts", v2(arch) ? 2 : 1);
  MT_REQUIRE(shared >= 0, "{}: n_shared_experts must be >= 0, got {}", f.file, shared);
  c.moe_shared_expert_intermediate_size = shared * c.moe_ffn_hidden_size;
  if (v2(arch))
    moe_routing_v2(f, c);
  else
    moe_routing(f, c);
}

int64_t first_moe_layer(const TransformerConfig& c) {
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (c.is_moe_layer(l)) return l;
  return c.num_layers;
}

// --- tensors --------------------------------------------------------------------------------

/// A layer's attention sizes, and its rope rows between the checkpoint's layout and ours.
struct MlaDims {
  int64_t h, n, dn, dr, dv, rq, rkv, nq;
  bool interleave;  ///< the checkpoint's rope_interleave
  MlaDims(const TransformerConfig& c, bool interleave_)
      : h(c.hidden_size), n(c.num_attention_heads), dn(c.qk_head_dim), dr(c.qk_pos_emb_head_dim), dv(c.v_head_dim),
        rq(c.q_lora_rank), rkv(c.kv_lora_rank), nq(n * (dn + dr)), interleave(interleave_) {}
  /// q_b_proj / q_proj (`query`: the rope rows of every head) or kv_a_proj_with_mqa (its last d_r
  /// rows), [rows, cols], permuted when the checkpoint rotates halves.
  std::vector<float> rope_rows(std::vector<float> w, int64_t cols, bool query, bool to_interleaved) const {
    if (!interleave)
      for (int64_t head = 0; head < (query ? n : 1); ++head)
        permute_rope_rows(w, query ? head * (dn + dr) + dn : rkv, dr, cols, to_interleaved);
    return w;
  }
};

/// One decoder (or MTP) layer: HF names under `hf` ("model.layers.l."), ours under `mt`.
void layer_to_megatron(const SafetensorsCheckpoint& ck, const TransformerConfig& c, bool interleave,
                       const std::string& hf, const std::string& mt, bool moe, GlobalTensors& t) {
  const MlaDims d(c, interleave);
  const int64_t h = d.h, rq = d.rq, rkv = d.rkv, dr = d.dr;
  const std::string a = hf + "self_attn.", o = mt + "self_attention.";
  t[mt + "input_layernorm.weight"] = read(ck, hf + "input_layernorm.weight", {h});
  if (rq > 0) {
    t[o + "linear_q_down_proj.weight"] = read(ck, a + "q_a_proj.weight", {rq, h});
    t[o + "q_layernorm.weight"] = read(ck, a + "q_a_layernorm.weight", {rq});
    t[o + "linear_q_up_proj.weight"] = d.rope_rows(read(ck, a + "q_b_proj.weight", {d.nq, rq}), rq, true, true);
  } else {
    t[o + "linear_q_proj.weight"] = d.rope_rows(read(ck, a + "q_proj.weight", {d.nq, h}), h, true, true);
  }
  t[o + "linear_kv_down_proj.weight"] =
      d.rope_rows(read(ck, a + "kv_a_proj_with_mqa.weight", {rkv + dr, h}), h, false, true);
  t[o + "kv_layernorm.weight"] = read(ck, a + "kv_a_layernorm.weight", {rkv});
  t[o + "linear_kv_up_proj.weight"] = read(ck, a + "kv_b_proj.weight", {d.n * (d.dn + d.dv), rkv});
  t[o + "linear_proj.weight"] = read(ck, a + "o_proj.weight", {h, d.n * d.dv});
  t[mt + "pre_mlp_layernorm.weight"] = read(ck, hf + "post_attention_layernorm.weight", {h});
  if (!moe) {
    swiglu_to_megatron(ck, hf + "mlp.", mt + "mlp.", c.ffn(), h, t);
    return;
  }
  const int64_t E = c.num_moe_experts;
  routed_experts_to_megatron(ck, hf + "mlp.", hf + "mlp.", mt + "mlp.", E, c.moe_ffn(), h, t);
  if (c.moe_router_enable_expert_bias)  // DeepSeek-V3's (DeepSeek-V2 has none)
    t[mt + "mlp.router.expert_bias"] = read(ck, hf + "mlp.gate.e_score_correction_bias", {E});
  if (const int64_t fs = c.moe_shared_expert_intermediate_size; fs > 0)
    swiglu_to_megatron(ck, hf + "mlp.shared_experts.", mt + "mlp.shared_experts.", fs, h, t);
}

void layer_to_hf(const TransformerConfig& c, HfArchitecture arch, bool interleave, const GetTensor& get,
                 const PutTensor& put, const PutTensor& put_f32, const std::string& mt, const std::string& hf,
                 bool moe) {
  const MlaDims d(c, interleave);
  const int64_t h = d.h, rq = d.rq, rkv = d.rkv, dr = d.dr;
  const std::string a = hf + "self_attn.", o = mt + "self_attention.";
  put(hf + "input_layernorm.weight", {h}, get(mt + "input_layernorm.weight"));
  if (rq > 0) {
    put(a + "q_a_proj.weight", {rq, h}, get(o + "linear_q_down_proj.weight"));
    put(a + "q_a_layernorm.weight", {rq}, get(o + "q_layernorm.weight"));
    put(a + "q_b_proj.weight", {d.nq, rq}, d.rope_rows(get(o + "linear_q_up_proj.weight"), rq, true, false));
  } else {
    put(a + "q_proj.weight", {d.nq, h}, d.rope_rows(get(o + "linear_q_proj.weight"), h, true, false));
  }
  put(a + "kv_a_proj_with_mqa.weight", {rkv + dr, h},
      d.rope_rows(get(o + "linear_kv_down_proj.weight"), h, false, false));
  put(a + "kv_a_layernorm.weight", {rkv}, get(o + "kv_layernorm.weight"));
  put(a + "kv_b_proj.weight", {d.n * (d.dn + d.dv), rkv}, get(o + "linear_kv_up_proj.weight"));
  put(a + "o_proj.weight", {h, d.n * d.dv}, get(o + "linear_proj.weight"));
  put(hf + "post_attention_layernorm.weight", {h}, get(mt + "pre_mlp_layernorm.weight"));
  if (!moe) {
    swiglu_to_hf(get, put, mt + "mlp.", hf + "mlp.", c.ffn(), h);
    return;
  }
  const int64_t E = c.num_moe_experts;
  routed_experts_to_hf(get, put, mt + "mlp.", hf + "mlp.", E, c.moe_ffn(), h);
  // A model trained without --moe-router-enable-expert-bias routes as a zero bias (DeepSeek-V3).
  if (!v2(arch))
    put_f32(hf + "mlp.gate.e_score_correction_bias", {E},
          c.moe_router_enable_expert_bias ? get(mt + "mlp.router.expert_bias") : std::vector<float>(E, 0.f));
  if (const int64_t fs = c.moe_shared_expert_intermediate_size; fs > 0)
    swiglu_to_hf(get, put, mt + "mlp.shared_experts.", hf + "mlp.shared_experts.", fs, h);
}

/// An MTP layer's copy of a shared tensor must equal it (DeepSeek-V3 §2.2: the embedding and the
/// output head are shared with the main model).
void require_shared_copy(const SafetensorsCheckpoint& ck, const std::string& copy, const std::string& shared,
                         const std::vector<int64_t>& shape) {
  if (!ck.has(copy)) return;
  MT_REQUIRE(read(ck, copy, shape) == read(ck, shared, shape),
             "'{}' in '{}' differs from '{}': megatron.cpp's multi-token prediction shares the embedding and the "
             "output layer with the main model (DeepSeek-V3 §2.2), a separate copy cannot be imported",
             copy, ck.dir(), shared);
}

}  // namespace

void deepseek_config(const Fields& f, HfArchitecture arch, TransformerConfig& c) {
  const char* arch_name = architecture_name(arch);
  if (f.has("quantization_config")) {
    const json& q = f.j.at("quantization_config");
    MT_FAIL("{}: quantization_config (quant_method {}) is not supported: import-hf reads fp32, bf16 and fp16 weights "
            "(dequantize DeepSeek-V3's FP8 checkpoint to bf16 first)",
            f.file, q.is_object() && q.contains("quant_method") ? q.at("quant_method").dump() : std::string("?"));
  }
  c.hidden_size = f.get<int64_t>("hidden_size");
  c.num_layers = f.get<int64_t>("num_hidden_layers");
  c.num_attention_heads = f.get<int64_t>("num_attention_heads");
  const int64_t kv_heads = f.get_or<int64_t>("num_key_value_heads", c.num_attention_heads);
  MT_REQUIRE(kv_heads == c.num_attention_heads, "{}: num_key_value_heads {} != num_attention_heads {} is not "
             "supported: multi-latent attention gives every head its own key and value", f.file, kv_heads,
             c.num_attention_heads);
  c.ffn_hidden_size = f.get<int64_t>("intermediate_size");
  c.max_position_embeddings = f.get<int64_t>("max_position_embeddings");
  c.norm_epsilon = f.get_or<float>("rms_norm_eps", 1e-6f);
  if (c.norm_epsilon != 1e-6f)
    log_warn("{}: rms_norm_eps {} is used for every norm; transformers' {} (and DeepSeek's code) normalise "
             "the latents (q_a_layernorm, kv_a_layernorm) with eps 1e-6: logits differ slightly", f.file,
             c.norm_epsilon, arch_name);
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.gated_linear_unit = true;
  const std::string act = f.get_or<std::string>("hidden_act", "silu");
  MT_REQUIRE(act == "silu", "{}: hidden_act '{}' is not supported (SwiGLU needs silu)", f.file, act);
  MT_REQUIRE(!f.get_or<bool>("attention_bias", false), "{}: attention_bias (biases on q_a_proj, kv_a_proj_with_mqa "
             "and o_proj) is not supported for {}", f.file, arch_name);
  MT_REQUIRE(!f.get_or<bool>("mlp_bias", false), "{}: mlp_bias is not supported for {}", f.file, arch_name);
  c.add_bias_linear = false;
  c.multi_latent_attention = true;
  MT_REQUIRE(f.j.contains("q_lora_rank"), "{}: field 'q_lora_rank' is missing (null for a full query projection)",
             f.file);
  c.q_lora_rank = f.has("q_lora_rank") ? f.get<int64_t>("q_lora_rank") : 0;
  MT_REQUIRE(!f.has("q_lora_rank") || c.q_lora_rank > 0,
             "{}: q_lora_rank {}: expected a positive rank or null (a full query projection)", f.file, c.q_lora_rank);
  c.kv_lora_rank = f.get<int64_t>("kv_lora_rank");
  c.qk_head_dim = f.get<int64_t>("qk_nope_head_dim");
  c.qk_pos_emb_head_dim = f.get<int64_t>("qk_rope_head_dim");
  c.v_head_dim = f.get<int64_t>("v_head_dim");
  set_rope(parse_rope(f, c.max_position_embeddings, arch), c);
  c.untie_embeddings_and_output_weights = !f.get_or<bool>("tie_word_embeddings", false);
  c.hidden_dropout = 0.f;
  c.attention_dropout = f.get_or<float>("attention_dropout", 0.f);
  c.init_method_std = f.get_or<float>("initializer_range", 0.02f);
  c.mtp_num_layers = f.get_or<int64_t>("num_nextn_predict_layers", 0);
  MT_REQUIRE(c.mtp_num_layers >= 0, "{}: num_nextn_predict_layers must be >= 0, got {}", f.file, c.mtp_num_layers);
  MT_REQUIRE(!v2(arch) || c.mtp_num_layers == 0, "{}: num_nextn_predict_layers {} is not supported for {} (it has "
             "no multi-token prediction layers; DeepseekV3ForCausalLM holds them)", f.file, c.mtp_num_layers, arch_name);
  moe_config(f, arch, c);
}

void check_deepseek_representable(HfArchitecture arch, const TransformerConfig& c) {
  const char* arch_name = architecture_name(arch);
  auto need = [&](bool ok, const std::string& what) {
    MT_REQUIRE(ok, "the model cannot be exported as {}: {}", arch_name, what);
  };
  need(c.multi_latent_attention, "multi-latent attention is required (--multi-latent-attention)");
  need(c.normalization == Normalization::kRMSNorm, "RMSNorm is required (--normalization RMSNorm)");
  need(c.activation() == MlpActivation::kSwiGLU, "a SwiGLU MLP is required (--swiglu)");
  need(!c.add_bias_linear, "no biases on the projections (--disable-bias-linear)");
  const Rope r = rope_of(c);
  need(!v2(arch) || c.mtp_num_layers == 0, fmt::format("it has {} multi-token prediction layers (--mtp-num-layers), "
                                                       "which only DeepseekV3ForCausalLM holds", c.mtp_num_layers));
  need(!r.yarn || r.mscale_all_dim != 0.f || r.mscale == 1.f || r.factor <= 1.f,
       fmt::format("--mscale {} without --mscale-all-dim: transformers ignores mscale unless mscale_all_dim is set",
                   r.mscale));
  // Megatron scales the softmax by get_mscale(s, --mscale-all-dim)² under plain RoPE too;
  // transformers' yarn_apply_mscale only when rope_type is not default.
  need(r.yarn || rope_math::yarn_get_mscale(c.rotary_scaling_factor, c.mscale_all_dim) == 1.0,
       fmt::format("--mscale-all-dim {} with --rotary-scaling-factor {} scales the softmax under --rope-type rope, "
                   "which transformers does only for YaRN (--rope-type yarn)", c.mscale_all_dim,
                   c.rotary_scaling_factor));
  if (c.num_moe_experts == 0) return;
  const int64_t first = first_moe_layer(c), k = c.moe_router_topk;
  for (int64_t l = first; l < c.num_layers; ++l)
    need(c.is_moe_layer(l), fmt::format("its MoE layers must follow its dense ones (first_k_dense_replace): layer {} "
                                        "is dense after MoE layer {}", l, first));
  if (v2(arch)) {
    need(c.moe_router_score_function == MoeScoreFunction::kSoftmax && c.moe_router_pre_softmax,
         "a softmax router taking the top-k of the probabilities is required (--moe-router-score-function softmax "
         "--moe-router-pre-softmax)");
    need(!c.moe_router_enable_expert_bias, "no expert bias (--moe-router-enable-expert-bias)");
    need(c.moe_router_num_groups == 0 || k == c.moe_router_group_topk,
         fmt::format("--moe-router-group-topk {} with --moe-router-topk {}: transformers scores a group by its best "
                     "expert, i.e. top-k = group-topk", c.moe_router_group_topk, k));
  } else {
    need(c.moe_router_score_function == MoeScoreFunction::kSigmoid, "a sigmoid router is required "
         "(--moe-router-score-function sigmoid)");
    need(c.moe_router_num_groups == 0 || k == 2 * c.moe_router_group_topk,
         fmt::format("--moe-router-group-topk {} with --moe-router-topk {}: transformers scores a group by its best 2 "
                     "experts, i.e. top-k = 2 · group-topk", c.moe_router_group_topk, k));
  }
  const int64_t f = c.moe_ffn(), fs = c.moe_shared_expert_intermediate_size;
  need(fs % f == 0 && !c.moe_shared_expert_gate,
       fmt::format("shared experts must be ungated, of n_shared_experts · {} channels (got {}{})", f, fs,
                   c.moe_shared_expert_gate ? ", gated" : ""));
}

json deepseek_hf_config(HfArchitecture arch, const TransformerConfig& c, const json& base, DType dtype) {
  check_deepseek_representable(arch, c);
  json j = base.is_object() ? base : json::object();
  for (const char* k : {"n_embd", "n_layer", "n_head", "n_positions", "n_ctx", "n_inner", "num_local_experts",
                        "num_experts", "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size",
                        "router_jitter_noise", "router_aux_loss_coef", "output_router_logits", "sliding_window",
                        "use_sliding_window", "partial_rotary_factor", "mlp_bias", "qkv_bias"})
    j.erase(k);
  j["architectures"] = {architecture_name(arch)};
  j["model_type"] = v2(arch) ? "deepseek_v2" : "deepseek_v3";
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_positions();
  j["torch_dtype"] = dtype == DType::kBF16 ? "bfloat16" : dtype == DType::kF16 ? "float16" : "float32";
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_attention_heads;
  j["intermediate_size"] = c.ffn();
  j["rms_norm_eps"] = decimal(c.norm_epsilon);
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["tie_word_embeddings"] = c.tied_output();
  if (!j.contains("initializer_range")) j["initializer_range"] = decimal(c.init_method_std);
  j["q_lora_rank"] = c.q_lora_rank > 0 ? json(c.q_lora_rank) : json(nullptr);
  j["kv_lora_rank"] = c.kv_lora_rank;
  j["qk_nope_head_dim"] = c.qk_head_dim;
  j["qk_rope_head_dim"] = c.qk_pos_emb_head_dim;
  j["v_head_dim"] = c.v_head_dim;
  if (j.contains("head_dim")) j["head_dim"] = c.qk_pos_emb_head_dim;  // DeepseekV2/V3Config's own attributes
  if (j.contains("qk_head_dim")) j["qk_head_dim"] = c.q_head_dim();
  if (!j.contains("rope_interleave") && !v2(arch)) j["rope_interleave"] = true;
  // RoPE: the imported fields when they describe this model, else fresh ones.
  bool same = false;
  try {
    same = base.is_object() && parse_rope(Fields{base, "config.json"}, c.max_positions(), arch) == rope_of(c);
  } catch (const Error&) {
    same = false;
  }
  if (!same) put_rope(rope_of(c), j);
  const int64_t L = c.num_layers, D = c.mtp_num_layers;
  if (D > 0 || j.contains("num_nextn_predict_layers")) j["num_nextn_predict_layers"] = D;
  j.erase("moe_layer_freq");
  if (c.num_moe_experts == 0) {  // dense: no layer (MTP included) reaches first_k_dense_replace
    j["first_k_dense_replace"] = L + D;
    return j;
  }
  const int64_t k = c.moe_router_topk;
  j["n_routed_experts"] = c.num_moe_experts;
  j["num_experts_per_tok"] = k;
  j["moe_intermediate_size"] = c.moe_ffn();
  j["n_shared_experts"] = c.moe_shared_expert_intermediate_size / c.moe_ffn();
  j["first_k_dense_replace"] = first_moe_layer(c);
  j["routed_scaling_factor"] = decimal(c.moe_router_topk_scaling_factor > 0 ? c.moe_router_topk_scaling_factor : 1.f);
  j["norm_topk_prob"] = !v2(arch) && k > 1;
  j["scoring_func"] = v2(arch) ? "softmax" : "sigmoid";
  j["topk_method"] = !v2(arch) ? "noaux_tc" : c.moe_router_num_groups > 0 ? "group_limited_greedy" : "greedy";
  // Groups: an imported trivial grouping (n_group 1, or topk_group = n_group) is kept.
  auto int_or_0 = [&](const char* key) {
    return j.contains(key) && j.at(key).is_number_integer() ? j.at(key).get<int64_t>() : int64_t{0};
  };
  const int64_t bg = int_or_0("n_group"), btg = int_or_0("topk_group");
  const bool trivial = bg >= 1 && btg >= 1 && (bg == 1 || btg == bg) && c.num_moe_experts % bg == 0 &&
                       c.num_moe_experts / bg >= 2;
  j["n_group"] = c.moe_router_num_groups > 0 ? c.moe_router_num_groups : trivial ? bg : 1;
  j["topk_group"] = c.moe_router_num_groups > 0 ? c.moe_router_group_topk : trivial ? btg : 1;
  if (v2(arch) && c.moe_router_num_groups == 0 && !trivial) {  // greedy: DeepseekV2Config's nulls
    j["n_group"] = nullptr;
    j["topk_group"] = nullptr;
  }
  const float seq = c.moe_aux_coeff(MoeLoadBalancing::kSeqAuxLoss), aux = c.moe_aux_coeff(MoeLoadBalancing::kAuxLoss);
  if (seq > 0 || aux > 0 || j.contains("aux_loss_alpha")) {
    j["aux_loss_alpha"] = decimal(seq > 0 ? seq : aux);
    j["seq_aux"] = seq > 0 || (aux == 0 && !(j.contains("seq_aux") && j.at("seq_aux").is_boolean() &&
                                             !j.at("seq_aux").get<bool>()));
  }
  return j;
}

void deepseek_to_megatron(const HfModel& m, const SafetensorsCheckpoint& ck, GlobalTensors& t) {
  const TransformerConfig& c = m.config;
  const int64_t h = c.hidden_size, V = c.vocab_size, Vp = c.padded_vocab_size(), L = c.num_layers;
  const bool interleave = rope_interleave(m.config_json, m.arch);
  t["embedding.word_embeddings.weight"] = pad_rows(read(ck, "model.embed_tokens.weight", {V, h}), Vp, h);
  for (int64_t l = 0; l < L; ++l)
    layer_to_megatron(ck, c, interleave, fmt::format("model.layers.{}.", l), layer(l), c.is_moe_layer(l), t);
  t["decoder.final_layernorm.weight"] = read(ck, "model.norm.weight", {h});
  const std::string head = c.untie_embeddings_and_output_weights ? "lm_head.weight" : "model.embed_tokens.weight";
  if (c.untie_embeddings_and_output_weights) t["output_layer.weight"] = pad_rows(read(ck, head, {V, h}), Vp, h);
  for (int64_t d = 0; d < c.mtp_num_layers; ++d) {
    const std::string hf = fmt::format("model.layers.{}.", L + d), mt = fmt::format("mtp.layers.{}.", d);
    t[mt + "enorm.weight"] = read(ck, hf + "enorm.weight", {h});
    t[mt + "hnorm.weight"] = read(ck, hf + "hnorm.weight", {h});
    t[mt + "eh_proj.weight"] = read(ck, hf + "eh_proj.weight", {h, 2 * h});
    t[mt + "final_layernorm.weight"] = read(ck, hf + "shared_head.norm.weight", {h});
    layer_to_megatron(ck, c, interleave, hf, mt + "transformer_layer.", c.is_moe_layer(L - 1), t);
    require_shared_copy(ck, hf + "embed_tokens.weight", "model.embed_tokens.weight", {V, h});
    require_shared_copy(ck, hf + "shared_head.head.weight", head, {V, h});
  }
}

void deepseek_to_hf(const HfModel& m, const GetTensor& get, const PutTensor& put, const PutTensor& put_f32) {
  const TransformerConfig& c = m.config;
  const int64_t h = c.hidden_size, V = c.vocab_size, L = c.num_layers;
  const bool interleave = rope_interleave(m.config_json, m.arch);
  auto vocab = [&](const std::string& name) {
    const auto& a = get(name);
    return std::vector<float>(a.begin(), a.begin() + V * h);  // without the padding rows
  };
  const std::vector<float> embedding = vocab("embedding.word_embeddings.weight");
  const std::vector<float> output = c.untie_embeddings_and_output_weights ? vocab("output_layer.weight") : embedding;
  put("model.embed_tokens.weight", {V, h}, embedding);
  for (int64_t l = 0; l < L; ++l)
    layer_to_hf(c, m.arch, interleave, get, put, put_f32, layer(l), fmt::format("model.layers.{}.", l), c.is_moe_layer(l));
  put("model.norm.weight", {h}, get("decoder.final_layernorm.weight"));
  if (c.untie_embeddings_and_output_weights) put("lm_head.weight", {V, h}, output);
  for (int64_t d = 0; d < c.mtp_num_layers; ++d) {
    const std::string hf = fmt::format("model.layers.{}.", L + d), mt = fmt::format("mtp.layers.{}.", d);
    put(hf + "enorm.weight", {h}, get(mt + "enorm.weight"));
    put(hf + "hnorm.weight", {h}, get(mt + "hnorm.weight"));
    put(hf + "eh_proj.weight", {h, 2 * h}, get(mt + "eh_proj.weight"));
    put(hf + "shared_head.norm.weight", {h}, get(mt + "final_layernorm.weight"));
    put(hf + "embed_tokens.weight", {V, h}, embedding);
    put(hf + "shared_head.head.weight", {V, h}, output);
    layer_to_hf(c, m.arch, interleave, get, put, put_f32, mt + "transformer_layer.", hf, c.is_moe_layer(L - 1));
  }
}

}  // namespace mt::hf::detail
