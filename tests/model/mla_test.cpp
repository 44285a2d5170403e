// Multi-latent attention on the CPU (docs/mla.md): YaRN's frequencies and concentration factor
// against values computed by hand, the YaRN rotation against a float64 reference, the packing op
// (ops/mla.h) against a naive float64 copy and its backward as its exact adjoint, the softmax scale,
// and the configuration errors. The layer's forward/backward is checked against finite
// differences in tests/model/gpt_test.cpp (Gpt.Mla*) and under every parallel layout in
// tests/parallel/parallel_layouts_test.cpp (Mla/ParallelLayouts.*).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "model/transformer_config.h"
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
