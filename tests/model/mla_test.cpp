// Multi-latent attention on the CPU (docs/mla.md): YaRN's frequencies and concentration factor
// against values computed by hand, the YaRN rotation against a float64 reference, the packing op
// (ops/mla.h) against a naive float64 copy and its backward as its exact adjoint, the softmax scale,
// a one-layer MLA model's loss against a float64 implementation of the formulas, and the
// configuration errors. The layer's forward/backward is checked against finite
// differences in tests/model/gpt_test.cpp (Gpt.Mla*) and under every parallel layout in
// tests/parallel/parallel_layouts_test.cpp (Mla/ParallelLayouts.*).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "model/gpt_model.h"
#include "model/transformer_config.h"
#include "ops/elementwise.h"
#include "ops/mla.h"
#include "ops/rope.h"
#include "ops/rope_math.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::expect_error;

/// rotary_dim 8, base 10^4, s = 4, L_orig = 64, beta_fast 8, beta_slow 1:
///   c(8) = 8·ln(64 / (2π·8)) / (2 ln 10^4) = 0.1049 -> low = 0;  c(1) = 1.0080 -> high = 2;
///   ramp = (0, 0.5, 1, 1); p = (1, 10, 100, 1000); extra = 1/p, inter = 1/(4p);
///   inv_freq = inter·ramp + extra·(1 - ramp) = (1, 0.0625, 0.0025, 0.00025).
rope_math::Yarn hand_yarn() {
  rope_math::Yarn y;
  y.on = true;
  y.factor = 4.0;
  y.original_max_positions = 64;
  y.beta_fast = 8.0;
  y.beta_slow = 1.0;
  y.mscale = 1.0;
  y.mscale_all_dim = 0.0;
  return y;
}

TEST(Yarn, FrequenciesByHand) {
  const std::vector<float> f = rope_math::yarn_inv_freq(8, 10000.f, hand_yarn());
  const double want[] = {1.0, 0.0625, 0.0025, 0.00025};
  ASSERT_EQ(f.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(f[i], want[i], 1e-6 * want[i]) << i;
  // factor <= 1: no interpolation at all (extra = inter), the plain frequencies
  rope_math::Yarn one = hand_yarn();
  one.factor = 1.0;
  EXPECT_EQ(rope_math::yarn_inv_freq(8, 10000.f, one), rope_math::inv_freq(8, 10000.f));
  EXPECT_EQ(rope_math::rope_inv_freq(8, 10000.f, rope_math::Yarn{}), rope_math::inv_freq(8, 10000.f));
}

TEST(Yarn, ConcentrationAndSoftmaxScaleByHand) {
  rope_math::Yarn y = hand_yarn();
  // (0.1·1·ln 4 + 1) / 1 (mscale_all_dim 0: get_mscale = 1)
  EXPECT_NEAR(rope_math::yarn_concentration(y), 1.1386294361, 1e-7);
  y.mscale_all_dim = 1.0;  // DeepSeek-V3: mscale = mscale_all_dim -> 1
  EXPECT_FLOAT_EQ(rope_math::yarn_concentration(y), 1.f);
  EXPECT_FLOAT_EQ(rope_math::yarn_concentration(rope_math::Yarn{}), 1.f);
  TransformerConfig c;
  c.multi_latent_attention = true;
  c.qk_head_dim = 6;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 5;
  c.rotary_scaling_factor = 4.f;
  c.mscale_all_dim = 0.7f;
  // m = 0.1·0.7·ln 4 + 1 = 1.0970406; m² / sqrt(10) = 1.2034981 / 3.1622777 = 0.3805795
  EXPECT_NEAR(c.softmax_scale(), 0.3805795, 1e-6);
  EXPECT_EQ(c.head_dim(), 10);  // max(6 + 4, 5)
  c.v_head_dim = 12;
  EXPECT_EQ(c.head_dim(), 12);
  c.multi_latent_attention = false;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  EXPECT_FLOAT_EQ(c.softmax_scale(), 0.25f);  // 1 / sqrt(16)
}

// The YaRN rotation of rope_forward / rope_backward against float64: x' = m·R(θ)x per pair, the
// backward m·R(-θ), with the hand frequencies above (interleaved pairs, as MLA uses them).
TEST(Yarn, RopeForwardBackwardAgainstFloat64) {
  const Stream& st = testing::cpu_stream();
  const int64_t s = 5, b = 2, g = 3, d = 10;  // rotary_dim 8 of 10 channels; qpg 1
  RopeConfig cfg;
  cfg.queries_per_group = 1;
  cfg.rotary_dim = 8;
  cfg.base = 10000.f;
  cfg.interleaved = true;
  cfg.yarn = hand_yarn();
  const double m = 1.0 + 0.1 * std::log(4.0), inv[] = {1.0, 0.0625, 0.0025, 0.00025};
  const std::vector<float> x = testing::randn(s * b * g * 3 * d);
  for (int dir : {+1, -1}) {
    testing::OwnedTensor t = testing::make_tensor(x, DType::kF32, Device::cpu(), {s, b, g, 3, d}, st);
    if (dir > 0) {
      rope_forward(t, Tensor(), cfg, st);
    } else {
      rope_backward(t, Tensor(), cfg, st);
    }
    const std::vector<float> y = testing::to_host(t, st);
    std::vector<double> want(x.begin(), x.end());
    for (int64_t i = 0; i < s; ++i)
      for (int64_t j = 0; j < b * g; ++j)
        for (int64_t h = 0; h < 2; ++h) {  // the query and key heads; value heads untouched
          const int64_t base = ((i * b * g + j) * 3 + h) * d;
          for (int p = 0; p < 4; ++p) {
            const double a = static_cast<double>(i) * inv[p], c = m * std::cos(a), sn = dir * m * std::sin(a);
            const double x1 = x[base + 2 * p], x2 = x[base + 2 * p + 1];
            want[base + 2 * p] = x1 * c - x2 * sn;
            want[base + 2 * p + 1] = x2 * c + x1 * sn;
          }
        }
    EXPECT_LT(testing::rel_err(y, want), 1e-6) << (dir > 0 ? "forward" : "backward");
  }
}

TEST(MlaOps, PackAgainstNaiveAndAdjoint) {
  const Stream& st = testing::cpu_stream();
  for (const auto& [dn, dr, dv, D] : {std::tuple{6, 4, 5, 10}, std::tuple{6, 4, 12, 12}, std::tuple{3, 2, 5, 7}}) {
    const int64_t T = 6, n = 3;
    const std::vector<float> q = testing::randn(T * n * (dn + dr)), kv = testing::randn(T * n * (dn + dv)),
                             kpe = testing::randn(T * dr), g = testing::randn(T * n * 3 * D);
    auto Q = testing::make_tensor(q, DType::kF32, Device::cpu(), {T, n, dn + dr}, st);
    auto KV = testing::make_tensor(kv, DType::kF32, Device::cpu(), {T, n, dn + dv}, st);
    auto K = testing::make_tensor(kpe, DType::kF32, Device::cpu(), {T, dr}, st);
    testing::OwnedTensor qkv(DType::kF32, Device::cpu(), {T, n, 3, D});
    testing::poison(qkv, st);
    mla_qkv_pack(qkv, Q, KV, K, st);
    const std::vector<float> out = testing::to_host(qkv, st);
    std::vector<float> want(out.size(), 0.f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < n; ++h) {
        float* w = want.data() + (t * n + h) * 3 * D;
        const float* sq = q.data() + (t * n + h) * (dn + dr);
        const float* skv = kv.data() + (t * n + h) * (dn + dv);
        for (int c = 0; c < dr; ++c) w[c] = sq[dn + c], w[D + c] = kpe[t * dr + c];
        for (int c = 0; c < dn; ++c) w[dr + c] = sq[c], w[D + dr + c] = skv[c];
        for (int c = 0; c < dv; ++c) w[2 * D + c] = skv[dn + c];
      }
    EXPECT_TRUE(testing::same_bits(out, want)) << dn << " " << dr << " " << dv << " " << D;
    // <pack(q, kv, k_pe), g> == <(q, kv, k_pe), unpack_grad(g)> (the backward is the adjoint)
    auto G = testing::make_tensor(g, DType::kF32, Device::cpu(), {T, n, 3, D}, st);
    testing::poison(Q, st);
    testing::poison(KV, st);
    testing::poison(K, st);
    mla_qkv_unpack_grad(Q, KV, K, G, st);
    const std::vector<float> dq = testing::to_host(Q, st), dkv = testing::to_host(KV, st), dk = testing::to_host(K, st);
    double lhs = 0, rhs = 0;
    for (size_t i = 0; i < out.size(); ++i) lhs += static_cast<double>(out[i]) * g[i];
    for (size_t i = 0; i < q.size(); ++i) rhs += static_cast<double>(q[i]) * dq[i];
    for (size_t i = 0; i < kv.size(); ++i) rhs += static_cast<double>(kv[i]) * dkv[i];
    for (size_t i = 0; i < kpe.size(); ++i) rhs += static_cast<double>(kpe[i]) * dk[i];
    EXPECT_NEAR(lhs, rhs, 1e-4 * std::fabs(lhs) + 1e-4);
  }
}

TEST(MlaOps, ContextUnpackAndPad) {
  const Stream& st = testing::cpu_stream();
  const int64_t T = 4, n = 3, dv = 5, D = 8;
  const std::vector<float> c = testing::randn(T * n * D);
  auto C = testing::make_tensor(c, DType::kF32, Device::cpu(), {T, n * D}, st);
  testing::OwnedTensor o(DType::kF32, Device::cpu(), {T, n * dv});
  testing::poison(o, st);
  mla_context_unpack(o, C, n, /*pad=*/false, st);
  const std::vector<float> got = testing::to_host(o, st);
  for (int64_t r = 0; r < T * n; ++r)
    for (int64_t j = 0; j < dv; ++j) ASSERT_EQ(got[r * dv + j], c[r * D + j]);
  testing::poison(C, st);
  mla_context_unpack(o, C, n, /*pad=*/true, st);
  const std::vector<float> padded = testing::to_host(C, st);
  for (int64_t r = 0; r < T * n; ++r)
    for (int64_t j = 0; j < D; ++j) ASSERT_EQ(padded[r * D + j], j < dv ? c[r * D + j] : 0.f);
  expect_error([&] { mla_context_unpack(C, o, n, false, st); }, "d_v <= D");
}

// The latent cache's ops: the appended latents rebuilt into keys and values equal the packed ones
// (kv_up standing in for linear_kv_up_proj's output of the cached rows).
TEST(MlaOps, LatentAppendThenExpandGivesThePackedKeysAndValues) {
  const Stream& st = testing::cpu_stream();
  const int64_t s = 3, b = 2, B = 3, n = 2, dn = 3, dr = 2, dv = 4, D = 5, S = 6, r = 4, off = 1;
  const std::vector<float> q = testing::randn(s * b * n * (dn + dr)), kv = testing::randn(s * b * n * (dn + dv)),
                           kpe = testing::randn(s * b * dr), ckv = testing::randn(s * b * r);
  auto Q = testing::make_tensor(q, DType::kF32, Device::cpu(), {s * b, n, dn + dr}, st);
  auto KV = testing::make_tensor(kv, DType::kF32, Device::cpu(), {s * b, n, dn + dv}, st);
  auto K = testing::make_tensor(kpe, DType::kF32, Device::cpu(), {s * b, dr}, st);
  auto C = testing::make_tensor(ckv, DType::kF32, Device::cpu(), {s, b, r}, st);
  testing::OwnedTensor qkv(DType::kF32, Device::cpu(), {s, b, n, 3, D});
  mla_qkv_pack(qkv.t.view({s * b, n, 3, D}), Q, KV, K, st);
  testing::OwnedTensor ckv_cache(DType::kF32, Device::cpu(), {S, B, r}), kpe_cache(DType::kF32, Device::cpu(), {S, B, dr});
  testing::poison(ckv_cache, st);
  testing::poison(kpe_cache, st);
  mla_latent_append(ckv_cache, kpe_cache, C, qkv, off, st);
  const std::vector<float> cc = testing::to_host(ckv_cache, st), kc = testing::to_host(kpe_cache, st);
  for (int64_t i = 0; i < s; ++i)
    for (int64_t j = 0; j < b; ++j) {
      for (int64_t c = 0; c < r; ++c) ASSERT_EQ(cc[((off + i) * B + j) * r + c], ckv[(i * b + j) * r + c]);
      for (int64_t c = 0; c < dr; ++c) ASSERT_EQ(kc[((off + i) * B + j) * dr + c], kpe[(i * b + j) * dr + c]);
    }
  // kv_up [S, B, n, d_n + d_v]: the tokens' kv at their cache rows, position 0 anything finite
  std::vector<float> up = testing::randn(S * B * n * (dn + dv));
  for (int64_t i = 0; i < s; ++i)
    for (int64_t j = 0; j < b; ++j)
      std::copy_n(kv.begin() + (i * b + j) * n * (dn + dv), n * (dn + dv), up.begin() + ((off + i) * B + j) * n * (dn + dv));
  auto UP = testing::make_tensor(up, DType::kF32, Device::cpu(), {S, B, n, dn + dv}, st);
  testing::OwnedTensor key(DType::kF32, Device::cpu(), {b, n, S, D}), value(DType::kF32, Device::cpu(), {b, n, S, D});
  testing::poison(key, st);
  testing::poison(value, st);
  mla_latent_expand(key, value, UP, kpe_cache, off + s, dn, st);
  const std::vector<float> kk = testing::to_host(key, st), vv = testing::to_host(value, st), pk = testing::to_host(qkv, st);
  for (int64_t j = 0; j < b; ++j)
    for (int64_t h = 0; h < n; ++h)
      for (int64_t p = 0; p < S; ++p)
        for (int64_t c = 0; c < D; ++c) {
          const int64_t at = ((j * n + h) * S + p) * D + c;
          if (p >= off + s) {  // beyond count: untouched
            ASSERT_TRUE(std::isnan(kk[at]) && std::isnan(vv[at])) << p;
          } else if (p >= off) {
            const int64_t src = ((((p - off) * b + j) * n + h) * 3) * D + c;
            ASSERT_EQ(kk[at], pk[src + D]) << j << " " << h << " " << p << " " << c;
            ASSERT_EQ(vv[at], pk[src + 2 * D]) << j << " " << h << " " << p << " " << c;
          }
        }
  expect_error([&] { mla_latent_append(ckv_cache, kpe_cache, C, qkv, S - 1, st); }, "cannot take");
  expect_error([&] { mla_latent_expand(key, value, UP, kpe_cache, S + 1, dn, st); }, "disagree");
}

TEST(MlaOps, BadShapes) {
  const Stream& st = testing::cpu_stream();
  testing::OwnedTensor qkv(DType::kF32, Device::cpu(), {4, 2, 3, 8}), q(DType::kF32, Device::cpu(), {4, 2, 10}),
      kv(DType::kF32, Device::cpu(), {4, 2, 11}), kpe(DType::kF32, Device::cpu(), {4, 4});
  // D = 8 < d_n + d_r = 10
  expect_error([&] { mla_qkv_pack(qkv, q, kv, kpe, st); }, "shapes disagree");
  testing::OwnedTensor kpe3(DType::kF32, Device::cpu(), {3, 4});
  testing::OwnedTensor qkv2(DType::kF32, Device::cpu(), {4, 2, 3, 10});
  expect_error([&] { mla_qkv_pack(qkv2, q, kv, kpe3, st); }, "shapes disagree");
}

// The loss of a one-layer MLA model (query latent, YaRN with both mscales beyond the original
// context, value heads padded) on the CPU against a float64 implementation written from the
// formulas of docs/mla.md with the model's own parameters (read by name): embedding, RMSNorm,
// MLA, SwiGLU MLP, final norm, untied output layer, cross entropy over the real vocabulary.
TEST(MlaModel, LossAgainstFloat64Reference) {
  TransformerConfig c;
  c.num_layers = 1;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 12;
  c.gated_linear_unit = true;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  c.seq_length = 6;
  c.vocab_size = 37;
  c.make_vocab_size_divisible_by = 8;
  c.hidden_dropout = c.attention_dropout = 0.f;
  c.init_method_std = 0.3f;
  c.multi_latent_attention = true;
  c.q_lora_rank = 6;
  c.kv_lora_rank = 5;
  c.qk_head_dim = 3;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 5;
  c.rotary_base = 100.f;
  c.rotary_scaling_factor = 3.f;
  c.original_max_position_embeddings = 3;
  c.beta_fast = 2.f;
  c.beta_slow = 0.5f;
  c.mscale = 0.8f;
  c.mscale_all_dim = 0.6f;
  const int64_t S = c.seq_length, B = 2, h = c.hidden_size, n = c.num_attention_heads, f = c.ffn_hidden_size;
  const int64_t rq = c.q_lora_rank, rkv = c.kv_lora_rank, dn = c.qk_head_dim, dr = c.qk_pos_emb_head_dim;
  const int64_t dv = c.v_head_dim, V = c.vocab_size;
  const Stream& st = testing::cpu_stream();
  GPTModel model(c, B, DType::kF32, Device::cpu(), ProcessGroups::single());
  model.params().initialize(testing::test_seed(), st);
  std::map<std::string, std::vector<double>> P;
  for (size_t i = 0; i < model.params().size(); ++i) {
    const std::vector<float> v = testing::to_host(model.params().main(i), st);
    P[model.params().info(i).name] = std::vector<double>(v.begin(), v.end());
  }
  auto W = [&](const std::string& name) -> const std::vector<double>& {
    const auto it = P.find(name);
    EXPECT_NE(it, P.end()) << name;
    return it->second;
  };
  const std::string a = "decoder.layers.0.self_attention.";
  const std::vector<int32_t> tok = testing::randint(S * B, 0, 37), lab = testing::randint(S * B, 0, 37);
  // float64 reference
  const double eps = c.norm_epsilon;
  auto rms = [&](const double* x, int64_t k, const std::vector<double>& w) {
    double ss = 0;
    for (int64_t i = 0; i < k; ++i) ss += x[i] * x[i];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(k) + eps);
    std::vector<double> y(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) y[i] = x[i] * r * w[i];
    return y;
  };
  auto lin = [](const std::vector<double>& w, const double* x, int64_t out, int64_t in) {  // y = W x, W [out, in]
    std::vector<double> y(static_cast<size_t>(out), 0.0);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) y[o] += w[o * in + i] * x[i];
    return y;
  };
  // YaRN: the formulas of docs/mla.md in double
  const double base = c.rotary_base, s_f = c.rotary_scaling_factor, two_pi = 2 * 3.141592653589793;
  auto cdim = [&](double r) { return dr * std::log(c.original_max_position_embeddings / (r * two_pi)) / (2 * std::log(base)); };
  const double low = std::max(std::floor(cdim(c.beta_fast)), 0.0);
  double high = std::min(std::ceil(cdim(c.beta_slow)), static_cast<double>(dr - 1));
  if (high == low) high += 0.001;
  std::vector<double> inv(static_cast<size_t>(dr / 2));
  for (int64_t p = 0; p < dr / 2; ++p) {
    const double pf = std::pow(base, 2.0 * p / dr), ramp = std::clamp((p - low) / (high - low), 0.0, 1.0);
    inv[p] = ramp / (s_f * pf) + (1 - ramp) / pf;
  }
  auto gm = [&](double m) { return s_f <= 1 ? 1.0 : 0.1 * m * std::log(s_f) + 1.0; };
  const double amp = gm(c.mscale) / gm(c.mscale_all_dim);
  const double scale = gm(c.mscale_all_dim) * gm(c.mscale_all_dim) / std::sqrt(static_cast<double>(dn + dr));
  auto rope = [&](double* x, int64_t pos) {
    for (int64_t p = 0; p < dr / 2; ++p) {
      const double an = pos * inv[p], cs = amp * std::cos(an), sn = amp * std::sin(an);
      const double x1 = x[2 * p], x2 = x[2 * p + 1];
      x[2 * p] = x1 * cs - x2 * sn;
      x[2 * p + 1] = x2 * cs + x1 * sn;
    }
  };
  double loss = 0;
  for (int64_t j = 0; j < B; ++j) {
    std::vector<std::vector<double>> x(S), qn(S), qp(S), kn(S), kp(S), vv(S);
    for (int64_t i = 0; i < S; ++i) {
      const std::vector<double>& E = W("embedding.word_embeddings.weight");
      x[i].assign(E.begin() + tok[i * B + j] * h, E.begin() + (tok[i * B + j] + 1) * h);
      const std::vector<double> xn = rms(x[i].data(), h, W("decoder.layers.0.input_layernorm.weight"));
      const std::vector<double> cq = lin(W(a + "linear_q_down_proj.weight"), xn.data(), rq, h);
      const std::vector<double> cqn = rms(cq.data(), rq, W(a + "q_layernorm.weight"));
      const std::vector<double> q = lin(W(a + "linear_q_up_proj.weight"), cqn.data(), n * (dn + dr), rq);
      const std::vector<double> ckv = lin(W(a + "linear_kv_down_proj.weight"), xn.data(), rkv + dr, h);
      const std::vector<double> ckvn = rms(ckv.data(), rkv, W(a + "kv_layernorm.weight"));
      const std::vector<double> kv = lin(W(a + "linear_kv_up_proj.weight"), ckvn.data(), n * (dn + dv), rkv);
      kp[i].assign(ckv.begin() + rkv, ckv.end());
      rope(kp[i].data(), i);
      for (int64_t hd = 0; hd < n; ++hd) {
        const double* qh = q.data() + hd * (dn + dr);
        const double* kvh = kv.data() + hd * (dn + dv);
        qn[i].insert(qn[i].end(), qh, qh + dn);
        std::vector<double> pe(qh + dn, qh + dn + dr);
        rope(pe.data(), i);
        qp[i].insert(qp[i].end(), pe.begin(), pe.end());
        kn[i].insert(kn[i].end(), kvh, kvh + dn);
        vv[i].insert(vv[i].end(), kvh + dn, kvh + dn + dv);
      }
    }
    for (int64_t i = 0; i < S; ++i) {
      std::vector<double> ctx(static_cast<size_t>(n * dv), 0.0);
      for (int64_t hd = 0; hd < n; ++hd) {
        std::vector<double> sc(static_cast<size_t>(i + 1));
        double mx = -1e300, z = 0;
        for (int64_t k = 0; k <= i; ++k) {
          double d = 0;
          for (int64_t e = 0; e < dn; ++e) d += qn[i][hd * dn + e] * kn[k][hd * dn + e];
          for (int64_t e = 0; e < dr; ++e) d += qp[i][hd * dr + e] * kp[k][e];
          sc[k] = d * scale;
          mx = std::max(mx, sc[k]);
        }
        for (int64_t k = 0; k <= i; ++k) z += std::exp(sc[k] - mx);
        for (int64_t k = 0; k <= i; ++k)
          for (int64_t e = 0; e < dv; ++e) ctx[hd * dv + e] += std::exp(sc[k] - mx) / z * vv[k][hd * dv + e];
      }
      const std::vector<double> o = lin(W(a + "linear_proj.weight"), ctx.data(), h, n * dv);
      std::vector<double> r1(static_cast<size_t>(h));
      for (int64_t e = 0; e < h; ++e) r1[e] = x[i][e] + o[e];
      const std::vector<double> r1n = rms(r1.data(), h, W("decoder.layers.0.pre_mlp_layernorm.weight"));
      const std::vector<double> g = lin(W("decoder.layers.0.mlp.linear_fc1.weight"), r1n.data(), 2 * f, h);
      std::vector<double> act(static_cast<size_t>(f));
      for (int64_t e = 0; e < f; ++e) act[e] = g[e] / (1 + std::exp(-g[e])) * g[f + e];
      const std::vector<double> m = lin(W("decoder.layers.0.mlp.linear_fc2.weight"), act.data(), h, f);
      for (int64_t e = 0; e < h; ++e) r1[e] += m[e];
      const std::vector<double> fin = rms(r1.data(), h, W("decoder.final_layernorm.weight"));
      const std::vector<double> logits = lin(W("output_layer.weight"), fin.data(), V, h);  // the real rows
      const double mx = *std::max_element(logits.begin(), logits.end());
      double z = 0;
      for (double l : logits) z += std::exp(l - mx);
      loss += (std::log(z) + mx - logits[lab[i * B + j]]) / static_cast<double>(S * B);
    }
  }
  testing::OwnedTensor T = testing::make_int_tensor(tok, Device::cpu(), {S, B}, st),
                       L = testing::make_int_tensor(lab, Device::cpu(), {S, B}, st), out(DType::kF32, Device::cpu(), {1});
  fill(out, 0.f, st);
  model.forward(MicroBatch{T.t, L.t, Tensor()}, DropoutContext{1, 0, 0, false}, out, 1.0f / static_cast<float>(S * B), st);
  const double got = testing::to_host(out, st)[0];
  EXPECT_NEAR(got, loss, 2e-6 * std::fabs(loss)) << "float64 reference " << loss;
}

TransformerConfig mla_config() {
  TransformerConfig c;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.add_bias_linear = false;
  c.multi_latent_attention = true;
  c.q_lora_rank = 12;
  c.kv_lora_rank = 8;
  c.qk_head_dim = 6;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 5;
  return c;
}

TEST(MlaConfig, Errors) {
  mla_config().validate(2);
  auto bad = [](auto edit, const std::string& needle, int tp = 1) {
    TransformerConfig c = mla_config();
    edit(c);
    expect_error([&] { c.validate(tp); }, needle);
  };
  bad([](TransformerConfig& c) { c.num_query_groups = 2; }, "mutually exclusive");
  bad([](TransformerConfig& c) { c.kv_channels = 16; }, "--kv-channels 16 with --multi-latent-attention");
  bad([](TransformerConfig& c) { c.qk_pos_emb_head_dim = 5; }, "--qk-pos-emb-head-dim must be even");
  bad([](TransformerConfig& c) { c.kv_lora_rank = 0; }, "--kv-lora-rank must be positive");
  bad([](TransformerConfig& c) { c.v_head_dim = -1; }, "--v-head-dim must be positive");
  bad([](TransformerConfig& c) { c.q_lora_rank = -3; }, "--q-lora-rank must be positive");
  bad([](TransformerConfig& c) { c.position_embedding_type = PositionEmbeddingType::kLearnedAbsolute; },
      "needs --position-embedding-type rope");
  bad([](TransformerConfig& c) { c.rotary_percent = 0.5f; }, "--rotary-percent 0.5");
  bad([](TransformerConfig& c) { c.rotary_interleaved = true; }, "--rotary-interleaved");
  bad([](TransformerConfig& c) { c.qk_layernorm = true; }, "--qk-layernorm");
  bad([](TransformerConfig& c) { c.add_qkv_bias = true; }, "--add-qkv-bias");
  bad([](TransformerConfig& c) { c.fp8 = Fp8Format::kHybrid; }, "--fp8-format");
  bad([](TransformerConfig& c) { c.beta_fast = 0.5f; }, "--yarn-beta-fast");
  bad([](TransformerConfig& c) { c.rotary_scaling_factor = 0.f; }, "--rotary-scaling-factor");
  bad([](TransformerConfig& c) { c.mscale_all_dim = -1.f; }, "--mscale-all-dim");
  bad([](TransformerConfig& c) { c.original_max_position_embeddings = 0; }, "--yarn-original-max-position-embeddings");
  bad([](TransformerConfig& c) { c.num_attention_heads = 6; }, "not divisible by tensor parallel size 4", 4);
  bad(
      [](TransformerConfig& c) {
        c.recompute_granularity = RecomputeGranularity::kSelective;
        c.recompute_modules_set = true;
        c.recompute_modules = parse_recompute_modules({"layernorm"});
      },
      "--recompute-modules layernorm with --multi-latent-attention");
  bad(
      [](TransformerConfig& c) {
        c.multi_latent_attention = false;
        c.recompute_granularity = RecomputeGranularity::kSelective;
        c.recompute_modules_set = true;
        c.recompute_modules = parse_recompute_modules({"mla_up_proj"});
      },
      "mla_up_proj needs --multi-latent-attention");
  bad(
      [](TransformerConfig& c) {
        c.multi_latent_attention = false;
        c.rope_type_set = true;
      },
      "--rope-type yarn applies only to --multi-latent-attention");
  expect_error([] { parse_rope_type("ntk"); }, "--rope-type 'ntk' is not supported");
}

}  // namespace
}  // namespace mt
