// DeepseekV3ForCausalLM and DeepseekV2ForCausalLM interchange (model/hf/hf_deepseek.h) on tiny
// checkpoints the test writes (DeepseekV2: config mapping, bitwise round trips, logits against its
// softmax-routed forward, errors, at the end). DeepseekV3:
// the config mapping, the weight mapping element by element (with and without rope_interleave),
// import -> export bitwise round trips (with and without MTP, q_lora_rank set and null, fp32 and
// bf16), megatron.cpp's logits of the imported model against a float64 re-implementation of
// transformers' DeepseekV3 forward written here from its modeling file's semantics (MLA with
// YaRN and the interleaved / rotate-half RoPE, sigmoid group-limited routing with
// e_score_correction_bias, shared experts), and the documented errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>

#include <nlohmann/json.hpp>

#include "model/gpt_model.h"
#include "model/hf/hf_convert.h"
#include "testing/testing.h"
#include "train/checkpoint.h"
#include "train/generate.h"
#include "train/hf_commands.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

/// The fixture's sizes and options: 3 layers (layer 0 dense), 2 heads of d_n 4 + d_r 4 (query and
/// key) and d_v 6, 8 experts in 4 groups, top-4 from the best 2 groups (4 = 2 · 2, DeepSeek-V3's
/// rule), one shared expert, YaRN with both mscales (so that cos/sin and the softmax scale move).
struct Ds {
  int64_t h = 16, n = 2, dn = 4, dr = 4, dv = 6, rq = 8, rkv = 6, L = 3, dense = 1, E = 8, k = 4, groups = 4,
          group_topk = 2, fe = 6, shared = 1, f = 20, V = 37, P = 64, mtp = 0, original = 16;
  bool interleave = true, yarn = true, tied = false, hf5_rope = false;
  double theta = 10000, factor = 4, mscale = 0.9, mscale_all = 0.7, scaling = 2.5;
  // DeepseekV2ForCausalLM (ds_v2()): softmax routing, 'greedy' or 'group_limited_greedy'
  bool v2 = false, group_limited = false;
};

/// A DeepseekV2 fixture: 8 experts, top-2 ('greedy'; with group_limited 'group_limited_greedy' of
/// 4 groups, the best 2 compete: top-k = topk_group), two shared experts, routed_scaling_factor
/// 1.5, YaRN with mscale = mscale_all_dim (DeepSeek-V2's released configs: cos and sin unscaled,
/// the softmax by get_mscale(factor, mscale_all_dim)²).
Ds ds_v2(bool group_limited) {
  Ds d;
  d.v2 = true;
  d.group_limited = group_limited;
  d.k = 2;
  d.shared = 2;
  d.scaling = 1.5;
  d.mscale = d.mscale_all = 0.707;
  return d;
}

fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / fmt::format("mt_hfds_{}_{}_{}", name, getpid(), testing::test_seed());
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

json ds_config(const Ds& d) {
  json j = {{"architectures", {"DeepseekV3ForCausalLM"}}, {"model_type", "deepseek_v3"}, {"hidden_size", d.h},
            {"num_hidden_layers", d.L}, {"num_attention_heads", d.n}, {"num_key_value_heads", d.n},
            {"intermediate_size", d.f}, {"moe_intermediate_size", d.fe}, {"n_routed_experts", d.E},
            {"n_shared_experts", d.shared}, {"num_experts_per_tok", d.k}, {"n_group", d.groups},
            {"topk_group", d.group_topk}, {"routed_scaling_factor", d.scaling}, {"norm_topk_prob", true},
            {"first_k_dense_replace", d.dense}, {"scoring_func", "sigmoid"}, {"topk_method", "noaux_tc"},
            {"q_lora_rank", d.rq > 0 ? json(d.rq) : json(nullptr)}, {"kv_lora_rank", d.rkv},
            {"qk_nope_head_dim", d.dn}, {"qk_rope_head_dim", d.dr}, {"v_head_dim", d.dv},
            {"max_position_embeddings", d.P}, {"rms_norm_eps", 1e-6}, {"vocab_size", d.V}, {"hidden_act", "silu"},
            {"tie_word_embeddings", d.tied}, {"rope_interleave", d.interleave}, {"attention_bias", false},
            {"bos_token_id", 0}, {"eos_token_id", 1}, {"aux_loss_alpha", 0.001}, {"seq_aux", true}};
  if (d.mtp > 0) j["num_nextn_predict_layers"] = d.mtp;
  if (d.v2) {
    j["architectures"] = {"DeepseekV2ForCausalLM"};
    j["model_type"] = "deepseek_v2";
    j["scoring_func"] = "softmax";
    j["topk_method"] = d.group_limited ? "group_limited_greedy" : "greedy";
    j["norm_topk_prob"] = false;
    if (!d.group_limited) j["n_group"] = j["topk_group"] = nullptr;
    j.erase("rope_interleave");
  }
  json rope = json::object();
  if (d.yarn)
    rope = {{"factor", d.factor}, {"original_max_position_embeddings", d.original}, {"beta_fast", 32},
            {"beta_slow", 1}, {"mscale", d.mscale}, {"mscale_all_dim", d.mscale_all}};
  if (d.hf5_rope) {  // transformers 5's save_pretrained: rope_parameters with rope_theta inside
    rope["rope_type"] = d.yarn ? "yarn" : "default";
    rope["rope_theta"] = d.theta;
    j["rope_parameters"] = rope;
  } else {  // DeepSeek's released config.json
    j["rope_theta"] = d.theta;
    if (d.yarn) rope["type"] = "yarn";
    j["rope_scaling"] = d.yarn ? rope : json(nullptr);
  }
  return j;
}

struct Fixture {
  Ds d;
  fs::path dir;
  std::map<std::string, std::vector<float>> w;
  std::map<std::string, std::vector<int64_t>> shapes;
};

/// Writes config.json and model.safetensors with random weights (stored as `dtype`; the expert
/// biases in fp32, as DeepSeek and transformers keep them).
Fixture make_fixture(const Ds& d, const std::string& name, DType dtype = DType::kF32) {
  Fixture fx{d, temp_dir(name), {}, {}};
  auto add = [&](const std::string& n, std::vector<int64_t> shape, float scale, float offset = 0.f) {
    int64_t k = 1;
    for (auto s : shape) k *= s;
    std::vector<float> v = testing::randn(k, scale);
    for (float& x : v) x += offset;
    fx.w[n] = testing::rounded(v, dtype);
    fx.shapes[n] = shape;
  };
  auto add_layer = [&](const std::string& p, bool moe) {
    const std::string a = p + "self_attn.";
    add(p + "input_layernorm.weight", {d.h}, 0.1f, 1.f);
    if (d.rq > 0) {
      add(a + "q_a_proj.weight", {d.rq, d.h}, 0.3f);
      add(a + "q_a_layernorm.weight", {d.rq}, 0.1f, 1.f);
      add(a + "q_b_proj.weight", {d.n * (d.dn + d.dr), d.rq}, 0.3f);
    } else {
      add(a + "q_proj.weight", {d.n * (d.dn + d.dr), d.h}, 0.3f);
    }
    add(a + "kv_a_proj_with_mqa.weight", {d.rkv + d.dr, d.h}, 0.3f);
    add(a + "kv_a_layernorm.weight", {d.rkv}, 0.1f, 1.f);
    add(a + "kv_b_proj.weight", {d.n * (d.dn + d.dv), d.rkv}, 0.3f);
    add(a + "o_proj.weight", {d.h, d.n * d.dv}, 0.3f);
    add(p + "post_attention_layernorm.weight", {d.h}, 0.1f, 1.f);
    auto mlp = [&](const std::string& m, int64_t f) {
      add(m + "gate_proj.weight", {f, d.h}, 0.3f);
      add(m + "up_proj.weight", {f, d.h}, 0.3f);
      add(m + "down_proj.weight", {d.h, f}, 0.3f);
    };
    if (!moe) return mlp(p + "mlp.", d.f);
    add(p + "mlp.gate.weight", {d.E, d.h}, 1.f);  // well separated router logits
    // Non-negative biases keep every score + bias > 0 (transformers masks the other groups with 0);
    // as large as the sigmoid scores' range, so that they move the selection. DeepSeek-V2 has none.
    if (!d.v2) {
      // (up to 4, beyond the sigmoid scores' (0, 1): the bias decides the choice, so the negative
      // control that drops it always routes differently; with biases below 1 some seeds routed
      // the few test tokens the same way with and without them)
      fx.w[p + "mlp.gate.e_score_correction_bias"] = testing::randu(d.E, 0.f, 4.f);
      fx.shapes[p + "mlp.gate.e_score_correction_bias"] = {d.E};
    }
    for (int64_t e = 0; e < d.E; ++e) mlp(fmt::format("{}mlp.experts.{}.", p, e), d.fe);
    mlp(p + "mlp.shared_experts.", d.fe * d.shared);
  };
  add("model.embed_tokens.weight", {d.V, d.h}, 1.f);
  for (int64_t l = 0; l < d.L; ++l) add_layer(fmt::format("model.layers.{}.", l), l >= d.dense);
  add("model.norm.weight", {d.h}, 0.1f, 1.f);
  if (!d.tied) add("lm_head.weight", {d.V, d.h}, 0.3f);
  for (int64_t m = 0; m < d.mtp; ++m) {
    const std::string p = fmt::format("model.layers.{}.", d.L + m);
    add(p + "enorm.weight", {d.h}, 0.1f, 1.f);
    add(p + "hnorm.weight", {d.h}, 0.1f, 1.f);
    add(p + "eh_proj.weight", {d.h, 2 * d.h}, 0.3f);
    add(p + "shared_head.norm.weight", {d.h}, 0.1f, 1.f);
    fx.w[p + "embed_tokens.weight"] = fx.w.at("model.embed_tokens.weight");
    fx.w[p + "shared_head.head.weight"] = fx.w.at(d.tied ? "model.embed_tokens.weight" : "lm_head.weight");
    fx.shapes[p + "embed_tokens.weight"] = fx.shapes[p + "shared_head.head.weight"] = {d.V, d.h};
    add_layer(p, d.L - 1 >= d.dense);
  }
  std::vector<hf::TensorToWrite> t;
  for (const auto& [n, v] : fx.w)
    t.push_back({n, n.ends_with("e_score_correction_bias") ? DType::kF32 : dtype, fx.shapes.at(n), v});
  hf::write_safetensors((fx.dir / "model.safetensors").string(), t);
  std::ofstream(fx.dir / "config.json") << ds_config(d).dump(2);
  return fx;
}

// --- transformers' DeepseekV3 forward in float64 ------------------------------------------------

using Vec = std::vector<double>;

double get_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

/// modeling_deepseek_v3.py's forward for one sequence, every operation in double, written from
/// its semantics (not from megatron.cpp's code). `margin` receives the smallest gap between a
/// selected and a rejected score of any routing decision (expert or group).
struct HfReference {
  const Ds& d;
  const std::map<std::string, std::vector<float>>& w;
  bool interleave;
  bool with_bias = true;
  // yarn_apply_mscale (below); false: transformers <= 5.16's DeepseekV2, which left it out (a
  // negative control)
  bool softmax_mscale = true;
  double margin = 1e30;

  Vec lin(const std::string& name, const Vec& x, int64_t rows) const {
    const auto& a = w.at(name);
    const int64_t cols = static_cast<int64_t>(x.size());
    Vec y(static_cast<size_t>(rows), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) y[r] += static_cast<double>(a[r * cols + c]) * x[c];
    return y;
  }
  Vec norm(const Vec& x, const std::string& name) const {  // DeepseekV3RMSNorm, eps 1e-6
    double ms = 0;
    for (double v : x) ms += v * v;
    const double r = 1.0 / std::sqrt(ms / static_cast<double>(x.size()) + 1e-6);
    Vec y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * r * w.at(name)[i];
    return y;
  }
  Vec mlp(const std::string& p, const Vec& x, int64_t f) const {
    const Vec g = lin(p + "gate_proj.weight", x, f), u = lin(p + "up_proj.weight", x, f);
    Vec a(static_cast<size_t>(f));
    for (int64_t i = 0; i < f; ++i) a[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
    return lin(p + "down_proj.weight", a, d.h);
  }
  /// modeling_rope_utils._compute_yarn_parameters (or the default inverse frequencies) and the
  /// attention_factor: dim = config.head_dim, which DeepseekV2Config / DeepseekV3Config set to
  /// qk_rope_head_dim; the correction range from original_max_position_embeddings (truncated);
  /// attention_factor get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) when both are set, else
  /// get_mscale(f).
  std::pair<Vec, double> rope_parameters() const {
    const int64_t dim = d.dr;
    Vec inv(static_cast<size_t>(dim / 2));
    for (int64_t i = 0; i < dim / 2; ++i) inv[i] = 1.0 / std::pow(d.theta, 2.0 * i / dim);
    if (!d.yarn) return {inv, 1.0};
    auto corr = [&](double rot) {
      return dim * std::log(static_cast<double>(d.original) / (rot * 2 * M_PI)) / (2 * std::log(d.theta));
    };
    const double low = std::max(std::floor(corr(32)), 0.0);
    double high = std::min(std::ceil(corr(1)), static_cast<double>(dim - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < dim / 2; ++i) {
      const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0), extra = 1 - ramp;
      inv[i] = inv[i] / d.factor * (1 - extra) + inv[i] * extra;
    }
    const double att = d.mscale != 0 && d.mscale_all != 0 ? get_mscale(d.factor, d.mscale) / get_mscale(d.factor, d.mscale_all)
                                                          : get_mscale(d.factor, 1);
    return {inv, att};
  }
  /// DeepseekV3: apply_rotary_pos_emb_interleave (rope_interleave) or apply_rotary_pos_emb on the
  /// d_r channels, cos and sin times attention_factor. DeepseekV2 (modeling_deepseek_v2.py
  /// apply_rotary_emb, DeepseekV2RotaryEmbedding.forward): the channels as complex numbers
  /// x[2i] + i·x[2i+1], times torch.polar(1, pos · inv_freq[i]) · attention_factor, kept in place
  /// (`interleave` false: the rotate-half pairs instead, a negative control).
  Vec rotate(const Vec& x, int64_t pos) const {
    const auto [inv, att] = rope_parameters();
    const int64_t half = d.dr / 2;
    if (d.v2 && interleave) {
      Vec out(static_cast<size_t>(d.dr));
      for (int64_t i = 0; i < half; ++i) {
        const double ang = static_cast<double>(pos) * inv[i], c = std::cos(ang) * att, s = std::sin(ang) * att;
        out[2 * i] = x[2 * i] * c - x[2 * i + 1] * s;
        out[2 * i + 1] = x[2 * i + 1] * c + x[2 * i] * s;
      }
      return out;
    }
    Vec y = x;
    if (interleave)
      for (int64_t j = 0; j < half; ++j) {
        y[j] = x[2 * j];
        y[j + half] = x[2 * j + 1];
      }
    Vec out(static_cast<size_t>(d.dr));
    for (int64_t i = 0; i < d.dr; ++i) {
      const double ang = static_cast<double>(pos) * inv[i % half];
      const double rh = i < half ? -y[i + half] : y[i - half];
      out[i] = y[i] * std::cos(ang) * att + rh * std::sin(ang) * att;
    }
    return out;
  }
  std::vector<Vec> attention(const std::string& p, const std::vector<Vec>& x) const {
    const int64_t T = static_cast<int64_t>(x.size()), qd = d.dn + d.dr;
    const std::string a = p + "self_attn.";
    std::vector<Vec> q(T), k_rot(T), kv(T);
    for (int64_t t = 0; t < T; ++t) {
      q[t] = d.rq > 0 ? lin(a + "q_b_proj.weight", norm(lin(a + "q_a_proj.weight", x[t], d.rq), a + "q_a_layernorm.weight"),
                            d.n * qd)
                      : lin(a + "q_proj.weight", x[t], d.n * qd);
      const Vec ckv = lin(a + "kv_a_proj_with_mqa.weight", x[t], d.rkv + d.dr);
      kv[t] = lin(a + "kv_b_proj.weight", norm(Vec(ckv.begin(), ckv.begin() + d.rkv), a + "kv_a_layernorm.weight"),
                  d.n * (d.dn + d.dv));
      k_rot[t] = rotate(Vec(ckv.begin() + d.rkv, ckv.end()), t);
    }
    // yarn_apply_mscale(rope_parameters, qk_head_dim^-0.5): times get_mscale(factor, mscale_all_dim)²
    // when rope_type is not default and mscale_all_dim is set; DeepseekV3Attention.__init__, and
    // DeepseekV2Attention.__init__ since transformers 5.17 (huggingface/transformers#47435; DeepSeek's
    // own modeling_deepseek.py for V2 always did).
    double scaling = 1.0 / std::sqrt(static_cast<double>(qd));
    if (d.yarn && d.mscale_all != 0 && softmax_mscale)
      scaling *= get_mscale(d.factor, d.mscale_all) * get_mscale(d.factor, d.mscale_all);
    std::vector<Vec> out(T);
    for (int64_t t = 0; t < T; ++t) {
      Vec ctx(static_cast<size_t>(d.n * d.dv), 0.0);
      for (int64_t hd = 0; hd < d.n; ++hd) {
        const double* qh = q[t].data() + hd * qd;
        const Vec q_rot = rotate(Vec(qh + d.dn, qh + qd), t);
        Vec s(static_cast<size_t>(t + 1));
        for (int64_t u = 0; u <= t; ++u) {
          const double* kh = kv[u].data() + hd * (d.dn + d.dv);
          double dot = 0;
          for (int64_t i = 0; i < d.dn; ++i) dot += qh[i] * kh[i];
          for (int64_t i = 0; i < d.dr; ++i) dot += q_rot[i] * k_rot[u][i];
          s[u] = dot * scaling;
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double z = 0;
        for (double& v : s) z += (v = std::exp(v - mx));
        for (int64_t u = 0; u <= t; ++u)
          for (int64_t i = 0; i < d.dv; ++i) ctx[hd * d.dv + i] += s[u] / z * kv[u][hd * (d.dn + d.dv) + d.dn + i];
      }
      out[t] = lin(a + "o_proj.weight", ctx, d.h);
    }
    return out;
  }
  /// Indices of the k largest (descending); records the gap to the first rejected one.
  std::vector<int64_t> topk(const Vec& v, int64_t k) {
    std::vector<int64_t> idx(v.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return v[a] > v[b]; });
    if (k < static_cast<int64_t>(v.size())) margin = std::min(margin, v[idx[k - 1]] - v[idx[k]]);
    idx.resize(static_cast<size_t>(k));
    return idx;
  }
  /// DeepseekV2Moe.route_tokens_to_experts: softmax over all experts, the top-k probabilities
  /// ('greedy') or those of the best topk_group groups scored by their best probability
  /// ('group_limited_greedy', the others masked with 0), times routed_scaling_factor.
  std::vector<std::pair<int64_t, double>> route_v2(const Vec& logits) {
    const double mx = *std::max_element(logits.begin(), logits.end());
    Vec p(d.E);
    double z = 0;
    for (int64_t e = 0; e < d.E; ++e) z += (p[e] = std::exp(logits[e] - mx));
    for (double& v : p) v /= z;
    Vec masked = p;
    if (d.group_limited) {
      const int64_t per = d.E / d.groups;
      Vec group_score(d.groups);
      for (int64_t g = 0; g < d.groups; ++g)
        group_score[g] = *std::max_element(p.begin() + g * per, p.begin() + (g + 1) * per);
      std::fill(masked.begin(), masked.end(), 0.0);
      for (int64_t g : topk(group_score, d.group_topk))
        for (int64_t e = g * per; e < (g + 1) * per; ++e) masked[e] = p[e];
    }
    std::vector<std::pair<int64_t, double>> out;
    for (int64_t e : topk(masked, d.k)) out.emplace_back(e, p[e] * d.scaling);
    return out;
  }
  /// DeepseekV3MoE: route_tokens_to_experts, the experts, the shared experts (DeepseekV2Moe with
  /// route_v2).
  Vec moe(const std::string& p, const Vec& x) {
    const Vec logits = lin(p + "mlp.gate.weight", x, d.E);
    if (d.v2) {
      Vec y = mlp(p + "mlp.shared_experts.", x, d.fe * d.shared);
      for (const auto& [e, wgt] : route_v2(logits)) {
        const Vec o = mlp(fmt::format("{}mlp.experts.{}.", p, e), x, d.fe);
        for (int64_t i = 0; i < d.h; ++i) y[i] += wgt * o[i];
      }
      return y;
    }
    const auto& bias = w.at(p + "mlp.gate.e_score_correction_bias");
    Vec s(d.E), choice(d.E);
    for (int64_t e = 0; e < d.E; ++e) {
      s[e] = 1 / (1 + std::exp(-logits[e]));
      choice[e] = s[e] + (with_bias ? bias[e] : 0.0);
    }
    const int64_t per = d.E / d.groups;
    Vec group_score(d.groups);
    for (int64_t g = 0; g < d.groups; ++g) {
      Vec part(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::sort(part.rbegin(), part.rend());
      group_score[g] = part[0] + part[1];  // .topk(2).sum()
    }
    Vec masked(d.E, 0.0);  // masked_fill(~score_mask, 0.0)
    for (int64_t g : topk(group_score, d.group_topk))
      for (int64_t e = g * per; e < (g + 1) * per; ++e) masked[e] = choice[e];
    const std::vector<int64_t> top = topk(masked, d.k);
    double sum = 0;
    for (int64_t e : top) sum += s[e];
    Vec y = mlp(p + "mlp.shared_experts.", x, d.fe * d.shared);
    for (int64_t e : top) {
      const Vec o = mlp(fmt::format("{}mlp.experts.{}.", p, e), x, d.fe);
      const double wgt = s[e] / (sum + 1e-20) * d.scaling;
      for (int64_t i = 0; i < d.h; ++i) y[i] += wgt * o[i];
    }
    return y;
  }
  /// Logits [T][V].
  std::vector<Vec> forward(const std::vector<int32_t>& tokens) {
    const auto& emb = w.at("model.embed_tokens.weight");
    std::vector<Vec> x;
    for (int32_t t : tokens) x.emplace_back(emb.begin() + t * d.h, emb.begin() + (t + 1) * d.h);
    for (int64_t l = 0; l < d.L; ++l) {
      const std::string p = fmt::format("model.layers.{}.", l);
      std::vector<Vec> normed;
      for (const Vec& v : x) normed.push_back(norm(v, p + "input_layernorm.weight"));
      const std::vector<Vec> att = attention(p, normed);
      for (size_t t = 0; t < x.size(); ++t) {
        for (int64_t i = 0; i < d.h; ++i) x[t][i] += att[t][i];
        const Vec hn = norm(x[t], p + "post_attention_layernorm.weight");
        const Vec m = l >= d.dense ? moe(p, hn) : mlp(p + "mlp.", hn, d.f);
        for (int64_t i = 0; i < d.h; ++i) x[t][i] += m[i];
      }
    }
    std::vector<Vec> logits;
    for (const Vec& v : x)
      logits.push_back(lin(d.tied ? "model.embed_tokens.weight" : "lm_head.weight", norm(v, "model.norm.weight"), d.V));
    return logits;
  }
};

/// max |a - b| / max |b| over [T][V].
double max_rel_diff(const std::vector<float>& ours, const std::vector<Vec>& ref) {
  double diff = 0, scale = 0;
  const size_t V = ref[0].size();
  for (size_t t = 0; t < ref.size(); ++t)
    for (size_t v = 0; v < V; ++v) {
      diff = std::max(diff, std::abs(static_cast<double>(ours[t * V + v]) - ref[t][v]));
      scale = std::max(scale, std::abs(ref[t][v]));
    }
  return diff / scale;
}

/// Every tensor of an HF directory, with its dtype string and raw bytes.
std::map<std::string, std::pair<std::string, std::vector<uint8_t>>> raw_tensors(const fs::path& dir) {
  const auto ck = hf::SafetensorsCheckpoint::open(dir.string());
  std::map<std::string, std::pair<std::string, std::vector<uint8_t>>> out;
  for (const auto& n : ck.names()) out[n] = {ck.info(n).dtype, ck.file_of(n).read_bytes(n)};
  return out;
}

std::string import(const Fixture& fx, const std::string& name) {
  const fs::path ck = fx.dir / name;
  ImportHfArgs ia;
  ia.hf_dir = fx.dir.string();
  ia.save = ck.string();
  ia.make_vocab_size_divisible_by = 8;
  EXPECT_EQ(run_import_hf(ia), 0);
  return ck.string();
}

TEST(HfDeepseekV3, ConfigMapsToTransformerConfig) {
  Ds d;
  d.mtp = 1;
  const Fixture fx = make_fixture(d, "config");
  const hf::HfModel m = hf::read_hf_config(fx.dir.string(), 0, 8);
  const TransformerConfig& c = m.config;
  EXPECT_EQ(m.arch, hf::HfArchitecture::kDeepseekV3);
  EXPECT_EQ(hf::infer_architecture(c), hf::HfArchitecture::kDeepseekV3);
  EXPECT_TRUE(c.multi_latent_attention);
  EXPECT_EQ(c.hidden_size, d.h);
  EXPECT_EQ(c.num_layers, d.L);
  EXPECT_EQ(c.num_attention_heads, d.n);
  EXPECT_EQ(c.q_lora_rank, d.rq);
  EXPECT_EQ(c.kv_lora_rank, d.rkv);
  EXPECT_EQ(c.qk_head_dim, d.dn);
  EXPECT_EQ(c.qk_pos_emb_head_dim, d.dr);
  EXPECT_EQ(c.v_head_dim, d.dv);
  EXPECT_EQ(c.ffn(), d.f);
  EXPECT_EQ(c.moe_ffn(), d.fe);
  EXPECT_EQ(c.num_moe_experts, d.E);
  EXPECT_EQ(c.moe_router_topk, d.k);
  EXPECT_EQ(c.moe_shared_expert_intermediate_size, d.fe * d.shared);
  EXPECT_FALSE(c.moe_shared_expert_gate);
  EXPECT_EQ(c.moe_router_score_function, MoeScoreFunction::kSigmoid);
  EXPECT_TRUE(c.moe_router_enable_expert_bias);
  EXPECT_EQ(c.moe_router_num_groups, d.groups);
  EXPECT_EQ(c.moe_router_group_topk, d.group_topk);
  EXPECT_FLOAT_EQ(c.moe_router_topk_scaling_factor, 2.5f);
  EXPECT_FLOAT_EQ(c.moe_aux_coeff(MoeLoadBalancing::kSeqAuxLoss), 0.001f);  // aux_loss_alpha with seq_aux
  for (int64_t l = 0; l < d.L; ++l) EXPECT_EQ(c.is_moe_layer(l), l >= d.dense) << l;
  EXPECT_EQ(c.mtp_num_layers, 1);
  EXPECT_EQ(c.rope_type, RopeType::kYarn);
  EXPECT_FLOAT_EQ(c.rotary_base, 10000.f);
  EXPECT_FLOAT_EQ(c.rotary_scaling_factor, 4.f);
  EXPECT_EQ(c.original_max_position_embeddings, d.original);
  EXPECT_FLOAT_EQ(c.mscale, 0.9f);
  EXPECT_FLOAT_EQ(c.mscale_all_dim, 0.7f);
  EXPECT_FLOAT_EQ(c.beta_fast, 32.f);
  EXPECT_FLOAT_EQ(c.beta_slow, 1.f);
  EXPECT_TRUE(c.untie_embeddings_and_output_weights);
  // The softmax scale is transformers' (d_n + d_r)^-1/2 · get_mscale(factor, mscale_all_dim)².
  const double m2 = get_mscale(4, 0.7) * get_mscale(4, 0.7);
  EXPECT_NEAR(c.softmax_scale(), m2 / std::sqrt(8.0), 1e-6);
  // The expert-bias state names are the model's own (GPTModel::persistent_state).
  GPTModel model(c, 1, DType::kF32, Device::cpu(), ProcessGroups::single());
  std::vector<std::string> names;
  for (const auto& [name, t] : model.persistent_state(testing::cpu_stream())) names.push_back(name);
  EXPECT_EQ(names, hf::expert_bias_state_names(c));
  EXPECT_EQ(names.size(), 3u);  // layers 1, 2 and the MTP layer
  // Without q_lora_rank (null): a full query projection; no YaRN: plain RoPE.
  d.rq = 0;
  d.yarn = false;
  d.hf5_rope = true;
  std::ofstream(fx.dir / "config.json") << ds_config(d).dump();
  const hf::HfModel m2c = hf::read_hf_config(fx.dir.string(), 0, 8);
  EXPECT_EQ(m2c.config.q_lora_rank, 0);
  EXPECT_EQ(m2c.config.rope_type, RopeType::kRope);
  EXPECT_NEAR(m2c.config.softmax_scale(), 1 / std::sqrt(8.0), 1e-7);
  fs::remove_all(fx.dir);
}

// Element by element: attention rows copied in order with rope_interleave (DeepSeek's layout),
// the rope rows permuted (ours 2j <- HF j, 2j+1 <- HF j + d_r/2) without it; experts, shared
// experts, the expert bias, the MTP layer.
TEST(HfDeepseekV3, WeightMappingLayouts) {
  for (bool interleave : {true, false}) {
    SCOPED_TRACE(interleave ? "rope_interleave" : "rotate-half");
    Ds d;
    d.mtp = 1;
    d.interleave = interleave;
    const Fixture fx = make_fixture(d, "map");
    const hf::HfModel m = hf::read_hf_config(fx.dir.string(), 0, 8);
    const hf::GlobalTensors t = hf::hf_to_megatron(m, hf::SafetensorsCheckpoint::open(fx.dir.string()));
    for (const ParamSpec& p : GPTModel::param_specs(m.config)) ASSERT_TRUE(t.count(p.name)) << p.name;
    for (const std::string& s : hf::expert_bias_state_names(m.config)) ASSERT_TRUE(t.count(s)) << s;
    const auto& w = fx.w;
    const int64_t qd = d.dn + d.dr, half = d.dr / 2;
    auto rope_src = [&](int64_t i) { return interleave ? i : i % 2 == 0 ? i / 2 : i / 2 + half; };  // ours i <- HF
    for (const auto& [hf, mt] : {std::pair<std::string, std::string>{"model.layers.1.", "decoder.layers.1."},
                                 {"model.layers.3.", "mtp.layers.0.transformer_layer."}}) {
      const auto& qb = w.at(hf + "self_attn.q_b_proj.weight");
      const auto& up = t.at(mt + "self_attention.linear_q_up_proj.weight");
      for (int64_t hd = 0; hd < d.n; ++hd)
        for (int64_t i = 0; i < qd; ++i) {
          const int64_t src = i < d.dn ? i : d.dn + rope_src(i - d.dn);
          for (int64_t c = 0; c < d.rq; ++c)
            ASSERT_EQ(up[(hd * qd + i) * d.rq + c], qb[(hd * qd + src) * d.rq + c]) << hd << " " << i;
        }
      const auto& kva = w.at(hf + "self_attn.kv_a_proj_with_mqa.weight");
      const auto& down = t.at(mt + "self_attention.linear_kv_down_proj.weight");
      for (int64_t r = 0; r < d.rkv + d.dr; ++r) {
        const int64_t src = r < d.rkv ? r : d.rkv + rope_src(r - d.rkv);
        for (int64_t c = 0; c < d.h; ++c) ASSERT_EQ(down[r * d.h + c], kva[src * d.h + c]) << r;
      }
      EXPECT_EQ(t.at(mt + "self_attention.linear_kv_up_proj.weight"), w.at(hf + "self_attn.kv_b_proj.weight"));
      EXPECT_EQ(t.at(mt + "self_attention.linear_q_down_proj.weight"), w.at(hf + "self_attn.q_a_proj.weight"));
      EXPECT_EQ(t.at(mt + "self_attention.q_layernorm.weight"), w.at(hf + "self_attn.q_a_layernorm.weight"));
      EXPECT_EQ(t.at(mt + "self_attention.kv_layernorm.weight"), w.at(hf + "self_attn.kv_a_layernorm.weight"));
      EXPECT_EQ(t.at(mt + "self_attention.linear_proj.weight"), w.at(hf + "self_attn.o_proj.weight"));
      EXPECT_EQ(t.at(mt + "mlp.router.weight"), w.at(hf + "mlp.gate.weight"));
      EXPECT_EQ(t.at(mt + "mlp.router.expert_bias"), w.at(hf + "mlp.gate.e_score_correction_bias"));
      const auto& fc1 = t.at(mt + "mlp.experts.local_experts.5.linear_fc1.weight");
      EXPECT_EQ(std::vector<float>(fc1.begin(), fc1.begin() + d.fe * d.h), w.at(hf + "mlp.experts.5.gate_proj.weight"));
      EXPECT_EQ(std::vector<float>(fc1.begin() + d.fe * d.h, fc1.end()), w.at(hf + "mlp.experts.5.up_proj.weight"));
      EXPECT_EQ(t.at(mt + "mlp.experts.local_experts.5.linear_fc2.weight"), w.at(hf + "mlp.experts.5.down_proj.weight"));
      EXPECT_EQ(t.at(mt + "mlp.shared_experts.linear_fc2.weight"), w.at(hf + "mlp.shared_experts.down_proj.weight"));
    }
    EXPECT_EQ(t.at("decoder.layers.0.mlp.linear_fc2.weight"), w.at("model.layers.0.mlp.down_proj.weight"));
    EXPECT_EQ(t.at("mtp.layers.0.enorm.weight"), w.at("model.layers.3.enorm.weight"));
    EXPECT_EQ(t.at("mtp.layers.0.hnorm.weight"), w.at("model.layers.3.hnorm.weight"));
    EXPECT_EQ(t.at("mtp.layers.0.eh_proj.weight"), w.at("model.layers.3.eh_proj.weight"));
    EXPECT_EQ(t.at("mtp.layers.0.final_layernorm.weight"), w.at("model.layers.3.shared_head.norm.weight"));
    fs::remove_all(fx.dir);
  }
}

// import-hf -> export-hf returns the same tensors, bit for bit, and config.json's fields
// unchanged: with and without MTP, q_lora_rank set and null, tied, rope_interleave false,
// transformers 5's rope_parameters, fp32 and bf16 (sharded).
TEST(HfDeepseekV3, ImportExportRoundTripIsBitwise) {
  struct Case {
    const char* name;
    std::function<void(Ds&)> set;
  };
  const Case cases[] = {{"mtp", [](Ds& d) { d.mtp = 1; }},
                        {"no-mtp-no-q-lora", [](Ds& d) { d.rq = 0; }},
                        {"mtp2-tied-rotate-half", [](Ds& d) { d.mtp = 2; d.tied = true; d.interleave = false; }},
                        {"hf5-rope-default", [](Ds& d) { d.yarn = false; d.hf5_rope = true; d.mtp = 1; d.rq = 0; }}};
  for (const Case& cs : cases) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(fmt::format("{} {}", cs.name, dtype_name(dtype)));
      Ds d;
      cs.set(d);
      const Fixture fx = make_fixture(d, "rt", dtype);
      const std::string ck = import(fx, "ck");
      const CheckpointState st = read_checkpoint_state(ck);
      EXPECT_EQ(st.model.mtp_num_layers, d.mtp);
      const fs::path out = fx.dir / "out";
      ExportHfArgs ea;
      ea.load = ck;
      ea.hf_dir = out.string();
      ea.dtype = dtype == DType::kBF16 ? "bf16" : "fp32";
      ea.max_shard_bytes = dtype == DType::kBF16 ? 8192 : 0;
      ASSERT_EQ(run_export_hf(ea), 0);
      EXPECT_EQ(raw_tensors(out), raw_tensors(fx.dir));
      const hf::HfModel back = hf::read_hf_config(out.string(), 0, 8);
      EXPECT_EQ(back.arch, hf::HfArchitecture::kDeepseekV3);
      EXPECT_EQ(back.config.summary(), st.model.summary());
      const json in = ds_config(d);  // every field comes back unchanged
      for (const auto& [k, v] : in.items()) EXPECT_EQ(back.config_json.at(k), v) << k;
      // A config written from scratch (no imported one) describes the same model too.
      const json fresh = hf::make_hf_config(hf::HfArchitecture::kDeepseekV3, st.model, json(), dtype);
      const fs::path fresh_dir = fx.dir / "fresh";
      fs::create_directories(fresh_dir);
      std::ofstream(fresh_dir / "config.json") << fresh.dump();
      TransformerConfig again = hf::read_hf_config(fresh_dir.string(), 0, 8).config;
      EXPECT_EQ(again.summary(), st.model.summary());
      EXPECT_EQ(again.mtp_num_layers, st.model.mtp_num_layers);
      EXPECT_EQ(again.moe_router_num_groups, st.model.moe_router_num_groups);
      fs::remove_all(fx.dir);
    }
  }
}

// transformers drops DeepSeek's MTP layers, but its save_pretrained keeps num_nextn_predict_layers:
// such a directory imports without MTP (the checkpoint is the judge), and an MTP copy of the
// embedding that differs from the shared one is refused.
TEST(HfDeepseekV3, MtpLayersFollowTheCheckpoint) {
  Ds d;
  d.mtp = 1;
  Fixture fx = make_fixture(d, "mtp");
  std::vector<hf::TensorToWrite> t;
  for (const auto& [n, v] : fx.w)
    if (!n.starts_with("model.layers.3.")) t.push_back({n, DType::kF32, fx.shapes.at(n), v});
  hf::write_safetensors((fx.dir / "model.safetensors").string(), t);
  EXPECT_EQ(read_checkpoint_state(import(fx, "ck")).model.mtp_num_layers, 0);
  t.clear();
  for (auto [n, v] : fx.w) {
    if (n == "model.layers.3.embed_tokens.weight") v[7] += 1.f;
    t.push_back({n, DType::kF32, fx.shapes.at(n), v});
  }
  hf::write_safetensors((fx.dir / "model.safetensors").string(), t);
  ImportHfArgs ia;
  ia.hf_dir = fx.dir.string();
  ia.save = (fx.dir / "ck2").string();
  testing::expect_error([&] { run_import_hf(ia); },
                        "'model.layers.3.embed_tokens.weight' in '" + fx.dir.string() + "' differs from");
  fs::remove_all(fx.dir);
}

/// A fixture of `d` whose routing is at least 1e-3 away from a tie (so that fp32 and fp64 agree on
/// every choice; a few draws at most), imported and run through `megatron logits` on the CPU:
/// our logits of `tokens` and transformers' forward re-implemented in float64 (RoPE pairs
/// interleaved or rotate-half).
struct ImportedLogits {
  Fixture fx;
  std::vector<Vec> ref;
  std::vector<float> ours;
};

void imported_logits(const Ds& d, const std::string& tag, bool interleave, const std::vector<int32_t>& tokens,
                     ImportedLogits& out) {
  for (int attempt = 0;; ++attempt) {
    ASSERT_LT(attempt, 20) << "no fixture without a routing near-tie";
    out.fx = make_fixture(d, tag);
    HfReference r{d, out.fx.w, interleave};
    out.ref = r.forward(tokens);
    if (r.margin > 1e-3) break;
    fs::remove_all(out.fx.dir);
  }
  const std::string ck = import(out.fx, "ck");
  LogitsArgs la;
  la.load = ck;
  for (int32_t t : tokens) la.token_ids += (la.token_ids.empty() ? "" : " ") + std::to_string(t);
  la.output = (out.fx.dir / "logits.bin").string();
  la.device = "cpu";
  ASSERT_EQ(run_logits(la), 0);
  out.ours.assign(tokens.size() * static_cast<size_t>(d.V), 0.f);
  std::ifstream(la.output, std::ios::binary).read(reinterpret_cast<char*>(out.ours.data()), out.ours.size() * 4);
}

// megatron.cpp's logits of the imported model (`megatron logits` on the CPU) against transformers'
// DeepseekV3 forward re-implemented above in float64. The negative controls show the check would
// catch a wrong RoPE pairing and an expert bias that was not loaded.
TEST(HfDeepseekV3, LogitsMatchTransformersSemantics) {
  struct Case {
    const char* name;
    std::function<void(Ds&)> set;
  };
  const Case cases[] = {{"q-lora, interleaved, yarn, mtp", [](Ds& d) { d.mtp = 1; }},
                        {"no q-lora, rotate-half", [](Ds& d) { d.rq = 0; d.interleave = false; }},
                        {"default rope, tied", [](Ds& d) { d.yarn = false; d.tied = true; }}};
  const std::vector<int32_t> tokens = {3, 17, 0, 36, 11, 5};
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.name);
    Ds d;
    cs.set(d);
    ImportedLogits il;
    ASSERT_NO_FATAL_FAILURE(imported_logits(d, "logits", d.interleave, tokens, il));
    const Fixture& fx = il.fx;
    const std::vector<float>& ours = il.ours;
    const std::vector<Vec>& ref = il.ref;
    const double err = max_rel_diff(ours, ref);
    std::printf("[%s] max |ours - transformers (fp64)| / max |logit| = %.3g\n", cs.name, err);
    EXPECT_LT(err, 2e-5);
    HfReference swapped{d, fx.w, !d.interleave};  // the other RoPE pairing
    EXPECT_GT(max_rel_diff(ours, swapped.forward(tokens)), 1e-3);
    HfReference no_bias{d, fx.w, d.interleave, /*with_bias=*/false};
    EXPECT_GT(max_rel_diff(ours, no_bias.forward(tokens)), 1e-3);
    fs::remove_all(fx.dir);
  }
}

// The reverse direction on a trained model, through the binary: import-hf -> pretrain --finetune
// (3 steps: the weights, the MTP layer and the expert biases move) -> export-hf; the exported
// tensors, read as transformers would (the float64 forward above), give megatron.cpp's logits of
// the trained checkpoint, and the MTP and bias tensors differ from the imported ones.
TEST(HfDeepseekV3, FinetunedCheckpointExportsWhatItComputes) {
  if (!std::getenv("MT_MEGATRON_BIN")) GTEST_SKIP() << "MT_MEGATRON_BIN not set (run through ctest)";
  Ds d;
  d.mtp = 1;
  const Fixture fx = make_fixture(d, "ft");
  const fs::path ck = fx.dir / "ck", ck2 = fx.dir / "ck2", out = fx.dir / "out";
  testing::RunResult r = testing::run_megatron("import-hf --hf-dir " + fx.dir.string() + " --save " + ck.string() +
                                               " --make-vocab-size-divisible-by 8");
  ASSERT_EQ(r.rc, 0) << r.out;
  r = testing::run_megatron(
      "pretrain --use-checkpoint-args --finetune --mock-data --tokenizer-type NullTokenizer --vocab-size " +
      std::to_string(d.V) + " --seq-length 16 --micro-batch-size 2 --global-batch-size 2 --train-iters 3 --lr 1e-2 "
      "--moe-router-bias-update-rate 0.05 --log-interval 1 --eval-interval 3 --eval-iters 1 --device cpu --no-progress "
      "--load " + ck.string() + " --save " + ck2.string());
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("mtp_1 loss"), std::string::npos) << r.out;
  // the checkpoint's architecture (expert bias on) with the command line's training choice (rate)
  EXPECT_NE(r.out.find("expert bias (rate 0.05)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("iteration        3/       3"), std::string::npos) << r.out;
  r = testing::run_megatron("export-hf --load " + ck2.string() + " --hf-dir " + out.string());
  ASSERT_EQ(r.rc, 0) << r.out;
  r = testing::run_megatron("logits --load " + ck2.string() + " --token-ids \"3 17 0 36 11 5\" --device cpu --output " +
                            (fx.dir / "ours.bin").string());
  ASSERT_EQ(r.rc, 0) << r.out;
  std::map<std::string, std::vector<float>> w;
  const auto exported = hf::SafetensorsCheckpoint::open(out.string());
  for (const std::string& n : exported.names()) w[n] = exported.read_f32(n);
  for (const char* n : {"model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.3.eh_proj.weight",
                        "model.layers.3.mlp.gate.e_score_correction_bias", "model.norm.weight"})
    EXPECT_NE(w.at(n), fx.w.at(n)) << n << " did not change in training";
  EXPECT_EQ(w.at("model.layers.3.embed_tokens.weight"), w.at("model.embed_tokens.weight"));
  const std::vector<int32_t> tokens = {3, 17, 0, 36, 11, 5};
  HfReference ref{d, w, d.interleave};
  const std::vector<Vec> want = ref.forward(tokens);
  std::vector<float> ours(tokens.size() * static_cast<size_t>(d.V));
  std::ifstream(fx.dir / "ours.bin", std::ios::binary).read(reinterpret_cast<char*>(ours.data()), ours.size() * 4);
  if (ref.margin > 1e-4) EXPECT_LT(max_rel_diff(ours, want), 2e-5);  // else a routing near-tie: nothing to compare
  std::printf("trained checkpoint: max |ours - exported (fp64 transformers forward)| / max |logit| = %.3g (routing "
              "margin %.2g)\n", max_rel_diff(ours, want), ref.margin);
  fs::remove_all(fx.dir);
}

// What DeepseekV3ForCausalLM and megatron.cpp cannot both express is refused with the field named.
TEST(HfDeepseekV3, BadConfigErrors) {
  const Ds d;
  const Fixture fx = make_fixture(d, "bad");
  auto expect = [&](const std::function<void(json&)>& edit, const std::string& needle) {
    json j = ds_config(d);
    edit(j);
    std::ofstream(fx.dir / "config.json") << j.dump();
    testing::expect_error([&] { hf::read_hf_config(fx.dir.string(), 0, 8); }, needle);
  };
  expect([](json& j) { j["scoring_func"] = "softmax"; },
         "scoring_func 'softmax' is not supported for DeepseekV3ForCausalLM");
  expect([](json& j) { j["topk_method"] = "group_limited_greedy"; }, "topk_method 'group_limited_greedy' is not supported");
  expect([](json& j) { j["norm_topk_prob"] = false; }, "norm_topk_prob false with num_experts_per_tok 4");
  expect([](json& j) { j["topk_group"] = 1; }, "n_group 4 / topk_group 1 with num_experts_per_tok 4");
  expect([](json& j) { j["n_group"] = 3; }, "n_group 3 / topk_group 2 with n_routed_experts 8");
  expect([](json& j) { j["rope_scaling"]["type"] = "linear"; }, "rope_type 'linear' is not supported");
  expect([](json& j) { j["rope_scaling"]["attention_factor"] = 1.2; }, "attention_factor 1.2 is not supported");
  expect([](json& j) { j["rope_scaling"].erase("mscale"); }, "mscale_all_dim 0.7 without mscale is not supported");
  expect([](json& j) { j["num_key_value_heads"] = 1; }, "num_key_value_heads 1 != num_attention_heads 2");
  expect([](json& j) { j["quantization_config"] = {{"quant_method", "fp8"}}; }, "quantization_config");
  expect([](json& j) { j["moe_layer_freq"] = 2; }, "moe_layer_freq 2 is not supported");
  expect([](json& j) { j["attention_bias"] = true; }, "attention_bias");
  expect([](json& j) { j.erase("q_lora_rank"); }, "field 'q_lora_rank' is missing");
  expect([](json& j) { j["first_k_dense_replace"] = 3; j["num_nextn_predict_layers"] = 1; },
         "first_k_dense_replace 3 = num_hidden_layers");
  // Export: what the architecture cannot hold.
  json j = ds_config(d);
  std::ofstream(fx.dir / "config.json") << j.dump();
  const TransformerConfig c = hf::read_hf_config(fx.dir.string(), 0, 8).config;
  auto refuse = [&](const std::function<void(TransformerConfig&)>& edit, hf::HfArchitecture a, const std::string& needle) {
    TransformerConfig x = c;
    edit(x);
    testing::expect_error([&] { hf::check_representable(a, x); }, needle);
  };
  refuse([](TransformerConfig& x) { x.moe_router_score_function = MoeScoreFunction::kSoftmax; },
         hf::HfArchitecture::kDeepseekV3, "a sigmoid router is required");
  refuse([](TransformerConfig& x) { x.moe_router_group_topk = 1; }, hf::HfArchitecture::kDeepseekV3,
         "--moe-router-group-topk 1 with --moe-router-topk 4");
  refuse([](TransformerConfig& x) { x.moe_layer_pattern = {1, 0, 1}; }, hf::HfArchitecture::kDeepseekV3,
         "layer 1 is dense after MoE layer 0");
  refuse([](TransformerConfig& x) { x.mscale_all_dim = 0.f; }, hf::HfArchitecture::kDeepseekV3,
         "--mscale 0.9 without --mscale-all-dim");
  refuse([](TransformerConfig& x) { x.rope_type = RopeType::kRope; }, hf::HfArchitecture::kDeepseekV3,
         "--mscale-all-dim 0.7 with --rotary-scaling-factor 4 scales the softmax under --rope-type rope");
  refuse([](TransformerConfig& x) { x.moe_shared_expert_intermediate_size = 7; }, hf::HfArchitecture::kDeepseekV3,
         "shared experts must be ungated");
  refuse([](TransformerConfig&) {}, hf::HfArchitecture::kMixtral, "multi-latent attention (DeepseekV3ForCausalLM or");
  refuse([](TransformerConfig& x) { x.multi_latent_attention = false; x.mtp_num_layers = 1; },
         hf::HfArchitecture::kMixtral, "only DeepseekV3ForCausalLM holds");
  fs::remove_all(fx.dir);
}

// --- DeepseekV2ForCausalLM -----------------------------------------------------------------------

// DeepseekV2's config.json: a softmax router taking the top-k probabilities (--moe-router-pre-softmax)
// times routed_scaling_factor, groups only for 'group_limited_greedy', no expert bias; YaRN as
// DeepSeek-V3: mscale = mscale_all_dim leaves cos and sin unscaled and scales the softmax by
// get_mscale(factor, mscale_all_dim)² (transformers >= 5.17, DeepSeek's code; the import before
// this test's revision mapped it to --mscale 0 --mscale-all-dim 0, no softmax factor), mscale
// alone: get_mscale(factor) on cos and sin, no softmax factor (--mscale 1 --mscale-all-dim 0).
TEST(HfDeepseekV2, ConfigMapsToTransformerConfig) {
  for (bool group_limited : {false, true}) {
    SCOPED_TRACE(group_limited ? "group_limited_greedy" : "greedy");
    const Ds d = ds_v2(group_limited);
    const Fixture fx = make_fixture(d, "v2config");
    const hf::HfModel m = hf::read_hf_config(fx.dir.string(), 0, 8);
    const TransformerConfig& c = m.config;
    EXPECT_EQ(m.arch, hf::HfArchitecture::kDeepseekV2);
    EXPECT_EQ(hf::infer_architecture(c), hf::HfArchitecture::kDeepseekV2);
    EXPECT_TRUE(c.multi_latent_attention);
    EXPECT_EQ(c.q_lora_rank, d.rq);
    EXPECT_EQ(c.num_moe_experts, d.E);
    EXPECT_EQ(c.moe_router_topk, 2);
    EXPECT_EQ(c.moe_shared_expert_intermediate_size, 2 * d.fe);
    EXPECT_EQ(c.moe_router_score_function, MoeScoreFunction::kSoftmax);
    EXPECT_TRUE(c.moe_router_pre_softmax);
    EXPECT_FALSE(c.moe_router_enable_expert_bias);
    EXPECT_TRUE(hf::expert_bias_state_names(c).empty());
    EXPECT_FLOAT_EQ(c.moe_router_topk_scaling_factor, 1.5f);
    EXPECT_EQ(c.moe_router_num_groups, group_limited ? d.groups : 0);
    EXPECT_EQ(c.moe_router_group_topk, group_limited ? d.group_topk : 0);
    EXPECT_EQ(c.mtp_num_layers, 0);
    for (int64_t l = 0; l < d.L; ++l) EXPECT_EQ(c.is_moe_layer(l), l >= d.dense) << l;
    EXPECT_EQ(c.rope_type, RopeType::kYarn);
    EXPECT_FLOAT_EQ(c.rotary_scaling_factor, 4.f);
    EXPECT_FLOAT_EQ(c.mscale, 0.707f);
    EXPECT_FLOAT_EQ(c.mscale_all_dim, 0.707f);
    const double m2 = get_mscale(4, 0.707) * get_mscale(4, 0.707);  // 1.2056
    EXPECT_NEAR(c.softmax_scale(), m2 / std::sqrt(8.0), 1e-6);
    fs::remove_all(fx.dir);
  }
  Ds d = ds_v2(false);
  d.mscale_all = 0;  // mscale alone: transformers' "else" branch, cos and sin by get_mscale(factor)
  const Fixture fx = make_fixture(d, "v2config2");
  const TransformerConfig c = hf::read_hf_config(fx.dir.string(), 0, 8).config;
  EXPECT_EQ(c.mscale, 1.f);
  EXPECT_EQ(c.mscale_all_dim, 0.f);
  EXPECT_NEAR(c.softmax_scale(), 1 / std::sqrt(8.0), 1e-7);
  // mscale != mscale_all_dim: their ratio on cos and sin (an error before)
  d.mscale = 0.9;
  d.mscale_all = 0.7;
  std::ofstream(fx.dir / "config.json") << ds_config(d).dump();
  const TransformerConfig c2 = hf::read_hf_config(fx.dir.string(), 0, 8).config;
  EXPECT_FLOAT_EQ(c2.mscale, 0.9f);
  EXPECT_FLOAT_EQ(c2.mscale_all_dim, 0.7f);
  fs::remove_all(fx.dir);
}

// import-hf -> export-hf: the same tensors bit for bit (no e_score_correction_bias written) and
// config.json's fields unchanged; a fresh config.json describes the same model.
TEST(HfDeepseekV2, ImportExportRoundTripIsBitwise) {
  struct Case {
    const char* name;
    bool group_limited;
    std::function<void(Ds&)> set;
  };
  const Case cases[] = {{"greedy, q-lora, yarn", false, [](Ds&) {}},
                        {"group-limited, no q-lora, hf5 rope, mscale alone", true,
                         [](Ds& d) { d.rq = 0; d.hf5_rope = true; d.mscale_all = 0; }},
                        {"greedy, default rope, tied", false, [](Ds& d) { d.yarn = false; d.tied = true; }},
                        {"greedy, yarn mscale 0.9 / mscale_all_dim 0.7", false,
                         [](Ds& d) { d.mscale = 0.9; d.mscale_all = 0.7; }}};
  for (const Case& cs : cases) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(fmt::format("{} {}", cs.name, dtype_name(dtype)));
      Ds d = ds_v2(cs.group_limited);
      cs.set(d);
      const Fixture fx = make_fixture(d, "v2rt", dtype);
      const std::string ck = import(fx, "ck");
      const CheckpointState st = read_checkpoint_state(ck);
      const fs::path out = fx.dir / "out";
      ExportHfArgs ea;
      ea.load = ck;
      ea.hf_dir = out.string();
      ea.dtype = dtype == DType::kBF16 ? "bf16" : "fp32";
      ea.max_shard_bytes = dtype == DType::kBF16 ? 8192 : 0;
      ASSERT_EQ(run_export_hf(ea), 0);
      EXPECT_EQ(raw_tensors(out), raw_tensors(fx.dir));
      const hf::HfModel back = hf::read_hf_config(out.string(), 0, 8);
      EXPECT_EQ(back.arch, hf::HfArchitecture::kDeepseekV2);
      EXPECT_EQ(back.config.summary(), st.model.summary());
      const json in = ds_config(d);
      for (const auto& [k, v] : in.items()) EXPECT_EQ(back.config_json.at(k), v) << k;
      EXPECT_FALSE(back.config_json.contains("rope_interleave"));
      const json fresh = hf::make_hf_config(hf::HfArchitecture::kDeepseekV2, st.model, json(), dtype);
      const fs::path fresh_dir = fx.dir / "fresh";
      fs::create_directories(fresh_dir);
      std::ofstream(fresh_dir / "config.json") << fresh.dump();
      const TransformerConfig again = hf::read_hf_config(fresh_dir.string(), 0, 8).config;
      EXPECT_EQ(again.summary(), st.model.summary());
      EXPECT_EQ(again.moe_router_num_groups, st.model.moe_router_num_groups);
      EXPECT_EQ(again.mscale, st.model.mscale);
      EXPECT_EQ(again.mscale_all_dim, st.model.mscale_all_dim);
      EXPECT_TRUE(again.moe_router_pre_softmax);
      fs::remove_all(fx.dir);
    }
  }
}

// megatron.cpp's logits of an imported DeepseekV2 against transformers' DeepseekV2 forward (the
// float64 re-implementation above: complex-pair RoPE, route_v2, the softmax mscale²). Negative
// controls: the rotate-half pairing, and the softmax without get_mscale(factor, mscale_all_dim)²
// (transformers <= 5.16's DeepseekV2, which the import followed before: the first and last cases
// failed then).
TEST(HfDeepseekV2, LogitsMatchTransformersSemantics) {
  struct Case {
    const char* name;
    bool group_limited;
    std::function<void(Ds&)> set;
  };
  const Case cases[] = {{"greedy, q-lora, yarn mscale = mscale_all_dim", false, [](Ds&) {}},
                        {"group-limited, no q-lora, yarn mscale alone", true, [](Ds& d) { d.rq = 0; d.mscale_all = 0; }},
                        {"group-limited, default rope, tied", true, [](Ds& d) { d.yarn = false; d.tied = true; }},
                        {"greedy, no q-lora, yarn mscale 0.9 / mscale_all_dim 0.7", false,
                         [](Ds& d) { d.rq = 0; d.mscale = 0.9; d.mscale_all = 0.7; }}};
  const std::vector<int32_t> tokens = {3, 17, 0, 36, 11, 5};
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.name);
    Ds d = ds_v2(cs.group_limited);
    cs.set(d);
    ImportedLogits il;
    ASSERT_NO_FATAL_FAILURE(imported_logits(d, "v2logits", true, tokens, il));
    const Fixture& fx = il.fx;
    const std::vector<float>& ours = il.ours;
    const std::vector<Vec>& ref = il.ref;
    const double err = max_rel_diff(ours, ref);
    std::printf("[v2 %s] max |ours - transformers (fp64)| / max |logit| = %.3g\n", cs.name, err);
    EXPECT_LT(err, 2e-5);
    HfReference swapped{d, fx.w, false};
    EXPECT_GT(max_rel_diff(ours, swapped.forward(tokens)), 1e-3);
    if (d.yarn && d.mscale_all != 0) {
      HfReference old_v2{d, fx.w, true};
      old_v2.softmax_mscale = false;
      const double old_err = max_rel_diff(ours, old_v2.forward(tokens));
      std::printf("[v2 %s] without the softmax mscale^2 (transformers <= 5.16): %.3g\n", cs.name, old_err);
      EXPECT_GT(old_err, 1e-3);
    }
    fs::remove_all(fx.dir);
  }
}

// What DeepseekV2ForCausalLM and megatron.cpp cannot both express is refused with the field named.
TEST(HfDeepseekV2, BadConfigErrors) {
  const Ds d = ds_v2(true);
  const Fixture fx = make_fixture(d, "v2bad");
  auto expect = [&](const std::function<void(json&)>& edit, const std::string& needle) {
    json j = ds_config(d);
    edit(j);
    std::ofstream(fx.dir / "config.json") << j.dump();
    testing::expect_error([&] { hf::read_hf_config(fx.dir.string(), 0, 8); }, needle);
  };
  expect([](json& j) { j["scoring_func"] = "sigmoid"; }, "scoring_func 'sigmoid' is not supported for DeepseekV2ForCausalLM");
  expect([](json& j) { j["topk_method"] = "noaux_tc"; }, "topk_method 'noaux_tc' is not supported for DeepseekV2ForCausalLM");
  expect([](json& j) { j["norm_topk_prob"] = true; }, "norm_topk_prob true with num_experts_per_tok 2");
  expect([](json& j) { j["topk_group"] = 1; }, "group_limited_greedy with topk_group 1 and num_experts_per_tok 2");
  expect([](json& j) { j["topk_group"] = nullptr; }, "needs n_group and topk_group");
  expect([](json& j) { j["n_shared_experts"] = nullptr; }, "n_shared_experts null is not supported");
  expect([](json& j) { j["num_nextn_predict_layers"] = 1; }, "num_nextn_predict_layers 1 is not supported for DeepseekV2");
  expect([](json& j) { j["rope_scaling"].erase("mscale"); }, "mscale_all_dim 0.707 without mscale is not supported");
  expect([](json& j) { j["mlp_bias"] = true; }, "mlp_bias is not supported for DeepseekV2ForCausalLM");
  expect([](json& j) { j["rope_scaling"]["attention_factor"] = 1.2; }, "attention_factor 1.2 is not supported");
  // Export: what DeepseekV2ForCausalLM cannot hold.
  std::ofstream(fx.dir / "config.json") << ds_config(d).dump();
  const TransformerConfig c = hf::read_hf_config(fx.dir.string(), 0, 8).config;
  auto refuse = [&](const std::function<void(TransformerConfig&)>& edit, const std::string& needle) {
    TransformerConfig x = c;
    edit(x);
    testing::expect_error([&] { hf::check_representable(hf::HfArchitecture::kDeepseekV2, x); }, needle);
  };
  refuse([](TransformerConfig& x) { x.moe_router_pre_softmax = false; }, "--moe-router-pre-softmax");
  refuse([](TransformerConfig& x) { x.moe_router_enable_expert_bias = true; }, "no expert bias");
  refuse([](TransformerConfig& x) { x.moe_router_group_topk = 1; }, "--moe-router-group-topk 1 with --moe-router-topk 2");
  refuse([](TransformerConfig& x) { x.mscale_all_dim = 0.f; }, "--mscale 0.707 without --mscale-all-dim");
  refuse([](TransformerConfig& x) { x.rope_type = RopeType::kRope; },
         "--mscale-all-dim 0.707 with --rotary-scaling-factor 4 scales the softmax under --rope-type rope");
  refuse([](TransformerConfig& x) { x.mtp_num_layers = 1; }, "only DeepseekV3ForCausalLM holds");
  fs::remove_all(fx.dir);
}

}  // namespace
}  // namespace mt
