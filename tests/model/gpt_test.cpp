// Whole-model tests on CPU: gradient check of the explicit backward on a tiny GPT (directional
// central differences per parameter tensor), determinism, and configuration errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "model/gpt_model.h"
#include "model/layer_graphs.h"
#include "model/layers/multi_token_prediction.h"
#include "ops/elementwise.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;

TransformerConfig tiny_config(float dropout) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.seq_length = 5;
  c.max_position_embeddings = 7;
  c.vocab_size = 37;
  c.make_vocab_size_divisible_by = 8;  // padded to 40
  c.hidden_dropout = dropout;
  c.attention_dropout = dropout;
  c.init_method_std = 0.15f;  // large enough that every path matters
  return c;
}

/// Llama style: grouped-query attention (4 heads, 2 groups), RoPE on half the channels, SwiGLU,
/// RMSNorm, untied output layer, no biases. qwen3: plus QKV bias and QK-norm.
TransformerConfig tiny_llama_config(float dropout, bool qwen3 = false) {
  TransformerConfig c = tiny_config(dropout);
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.ffn_hidden_size = 12;
  c.gated_linear_unit = true;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.rotary_percent = 0.5f;
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  c.add_qkv_bias = qwen3;
  c.qk_layernorm = qwen3;
  return c;
}

/// Multi-latent attention on the Llama layer (model/layers/mla_attention.h): a query latent,
/// YaRN beyond its original 2 positions with both mscales, value heads padded (d_v 4 < d_n + d_r
/// 5); or (no_lora) a full query projection, plain RoPE, query/key heads padded (d_v 7).
TransformerConfig tiny_mla_config(float dropout, bool no_lora = false) {
  TransformerConfig c = tiny_llama_config(dropout);
  c.num_query_groups = 0;
  c.rotary_percent = 1.f;
  c.multi_latent_attention = true;
  c.kv_lora_rank = 5;
  c.qk_head_dim = 3;
  c.qk_pos_emb_head_dim = 2;
  if (no_lora) {
    c.rope_type = RopeType::kRope;
    c.v_head_dim = 7;
  } else {
    c.q_lora_rank = 6;
    c.v_head_dim = 4;
    c.rotary_scaling_factor = 3.f;
    c.original_max_position_embeddings = 2;
    c.beta_fast = 2.f;
    c.mscale = 0.8f;
    c.mscale_all_dim = 0.6f;
  }
  return c;
}

/// Mixtral / DeepSeek style MoE on the Llama layer: 4 experts, the first layer dense
/// (--moe-layer-freq [0,1]), load-balancing loss and z-loss large enough to matter.
TransformerConfig tiny_moe_config(bool sigmoid_router) {
  TransformerConfig c = tiny_llama_config(0.f);
  c.num_moe_experts = 4;
  c.moe_layer_pattern = {0, 1};
  c.moe_ffn_hidden_size = 6;
  c.moe_router_topk = 2;
  c.moe_aux_loss_coeff = {0.3f};
  c.moe_z_loss_coeff = 0.05f;
  if (sigmoid_router) {
    c.moe_router_score_function = MoeScoreFunction::kSigmoid;
    c.moe_router_num_groups = 2;
    c.moe_router_group_topk = 1;
    c.moe_router_topk_scaling_factor = 2.f;
    c.moe_shared_expert_intermediate_size = 8;
    c.moe_router_load_balancing_type = {MoeLoadBalancing::kSeqAuxLoss};  // per-sequence loss (micro-batch 2)
  }
  return c;
}

struct Harness {
  Stream stream{Device::cpu()};
  GPTModel model;
  OwnedTensor tokens, labels, loss;
  OwnedTensor positions, doc_start, loss_mask;  // set by with_documents()
  OwnedTensor mtp_tokens, mtp_labels, mtp_mask;  // --mtp-num-layers: make_mtp_inputs of the above
  Harness(const TransformerConfig& c, int64_t b, uint64_t seed = testing::test_seed())
      : model(c, b, DType::kF32, Device::cpu(), ProcessGroups::single()),
        tokens(testing::make_int_tensor(testing::randint(c.seq_length * b, 0, static_cast<int32_t>(c.vocab_size)),
                                        Device::cpu(), {c.seq_length, b}, stream)),
        labels(testing::make_int_tensor(testing::randint(c.seq_length * b, 0, static_cast<int32_t>(c.vocab_size)),
                                        Device::cpu(), {c.seq_length, b}, stream)),
        loss(DType::kF32, Device::cpu(), {1}) {
    model.params().initialize(seed, stream);
    make_mtp();
  }
  void make_mtp() {
    const int64_t D = model.config().mtp_num_layers, S = model.config().seq_length, B = model.micro_batch();
    if (D == 0) return;
    const std::vector<int32_t> t = testing::to_host_ints(tokens.t, stream), l = testing::to_host_ints(labels.t, stream);
    const std::vector<float> m = loss_mask.t.empty() ? std::vector<float>() : testing::to_host(loss_mask.t, stream);
    const MtpInputs in = make_mtp_inputs(D, S, B, t.data(), l.data(), m.empty() ? nullptr : m.data());
    mtp_tokens = testing::make_int_tensor(in.tokens, Device::cpu(), {D, S, B}, stream);
    mtp_labels = testing::make_int_tensor(in.labels, Device::cpu(), {D, S, B}, stream);
    mtp_mask = testing::make_tensor(in.loss_mask, DType::kF32, Device::cpu(), {D, S, B}, stream);
  }
  MicroBatch mb() const {
    MicroBatch m{tokens.t, labels.t, loss_mask.t};
    m.position_ids = positions.t;
    m.doc_start = doc_start.t;
    m.mtp_tokens = mtp_tokens.t;
    m.mtp_labels = mtp_labels.t;
    m.mtp_loss_mask = mtp_mask.t;
    return m;
  }
  // λ/D · Σ_k of the MTP losses accumulated since the last call (then zeroed): the MTP's part of
  // the objective.
  double take_mtp_loss() {
    const TransformerConfig& c = model.config();
    if (c.mtp_num_layers == 0) return 0;
    double sum = 0;
    for (float v : testing::to_host(model.mtp_losses(), stream)) sum += v;
    fill(model.mtp_losses(), 0.f, stream);
    return c.mtp_loss_scaling_factor / static_cast<double>(c.mtp_num_layers) * sum;
  }
  // Two documents per sample (boundary after position 1 of 5): position ids restart, attention
  // stays inside a document, and the loss of the first position is masked.
  void with_documents() {
    const int64_t S = model.config().seq_length, B = model.micro_batch();
    std::vector<int32_t> pos(S * B), ds(B * S);
    std::vector<float> mask(S * B, 1.f);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < S; ++i) {
        const int64_t start = i < 2 ? 0 : 2;
        pos[i * B + b] = static_cast<int32_t>(i - start);
        ds[b * S + i] = static_cast<int32_t>(start);
      }
      mask[0 * B + b] = 0.f;
    }
    positions = testing::make_int_tensor(pos, Device::cpu(), {S, B}, stream);
    doc_start = testing::make_int_tensor(ds, Device::cpu(), {B, S}, stream);
    loss_mask = testing::make_tensor(mask, DType::kF32, Device::cpu(), {S, B}, stream);
    make_mtp();
  }
  // One training forward and backward from zero gradients (dropout key {7, 2, 1}): returns the
  // objective (loss_value) and appends every parameter's gradient to `grads`.
  double loss_and_grads(std::vector<std::vector<float>>& grads) {
    const DropoutContext dc{7, 2, 1, true};
    model.params().zero_grads(stream);
    const double l = loss_value(dc);
    model.backward(mb(), dc, 1.f, Tensor(), stream);
    for (size_t i = 0; i < model.params().size(); ++i) grads.push_back(testing::to_host(model.params().grad(i), stream));
    return l;
  }
  // The objective whose gradient backward computes: the LM loss plus the MoE auxiliary losses
  // (weighted by MicroBatch::aux_loss_weight = 1 here).
  double loss_value(const DropoutContext& dc) {
    fill(loss, 0.f, stream);
    const auto& c = model.config();
    model.reset_moe_stats(stream);
    model.reset_global_aux_loss_tracker(stream);  // global_aux_loss: each evaluation is a step's first forward
    model.forward(mb(), dc, loss, 1.0f / (c.seq_length * model.micro_batch()), stream);
    double aux = 0;  // the two losses of each layer, not the token counts after them
    const std::vector<double> st = model.moe_loss_stats(stream);
    const size_t per = static_cast<size_t>(kMoeStatLosses + c.num_moe_experts);
    for (size_t i = 0; i < st.size(); ++i)
      if (i % per < kMoeStatLosses) aux += st[i];
    return testing::to_host(loss, stream)[0] + aux + take_mtp_loss();
  }
};

void gradient_check(const TransformerConfig& c, bool documents = false, uint64_t seed = testing::test_seed()) {
  Harness h_(c, 2, seed);
  if (documents) h_.with_documents();
  const DropoutContext dc{99, 3, 1, true};
  const float w = 1.0f / (c.seq_length * 2);
  // Garbage where the step's first writes must overwrite (zero_grads zeroes only the rest).
  fill(h_.model.params().grads_flat(), std::nanf(""), h_.stream);
  h_.model.params().zero_grads(h_.stream);
  h_.loss_value(dc);
  h_.model.backward(h_.mb(), dc, w, Tensor(), h_.stream);
  ParamStore& P = h_.model.params();
  // Directional derivative along a random direction u restricted to each tensor:
  // (L(p + eps u) - L(p - eps u)) / 2 eps  vs  <grad, u>.
  for (size_t i = 0; i < P.size(); ++i) {
    const auto& info = P.info(i);
    std::vector<float> g = testing::to_host(P.grad(i), h_.stream);
    std::vector<float> p0 = testing::to_host(P.main(i), h_.stream);
    std::vector<float> u = testing::randn(info.numel);
    double analytic = 0, unorm = 0;
    for (int64_t k = 0; k < info.numel; ++k) {
      analytic += static_cast<double>(g[k]) * u[k];
      unorm += static_cast<double>(u[k]) * u[k];
    }
    const double rms = std::sqrt(unorm / info.numel);
    auto shifted = [&](double step) {
      std::vector<float> p(p0);
      for (int64_t k = 0; k < info.numel; ++k) p[k] = static_cast<float>(p0[k] + step * u[k]);
      testing::upload(P.main(i), p, h_.stream);
      return h_.loss_value(dc);
    };
    auto central = [&](double step) { return (shifted(+step) - shifted(-step)) / (2 * step); };
    // Richardson extrapolation of two central differences (truncation O(h^4)) at a few step
    // sizes: large steps keep fp32 rounding of the loss small (~|L|·1e-6 / h), small steps stay
    // inside the region where this tiny, strongly non-linear model is smooth (at some seeds a
    // LayerNorm over h = 8 features has near-zero variance and the loss bends sharply at
    // 1e-2). A correct gradient agrees at one of them to ~1e-4; a wrong one is off by O(1) at all.
    double best = INFINITY, best_numeric = 0;
    for (double h : {1e-2, 3e-3, 1e-3}) {
      const double step = h / rms;
      const double numeric = (4 * central(step / 2) - central(step)) / 3;
      const double err = std::fabs(analytic - numeric) / std::max(1.0, std::fabs(numeric));
      if (err < best) {
        best = err;
        best_numeric = numeric;
      }
      if (best < 1e-4) break;
    }
    testing::upload(P.main(i), p0, h_.stream);
    EXPECT_LT(best, 1e-3) << info.name << ": analytic " << analytic << " vs numeric " << best_numeric;
  }
}

TEST(Gpt, GradientCheckNoDropout) { gradient_check(tiny_config(0.f)); }
TEST(Gpt, GradientCheckWithDropout) { gradient_check(tiny_config(0.2f)); }
TEST(Gpt, GradientCheckWithDocumentsAndLossMask) { gradient_check(tiny_config(0.2f), /*documents=*/true); }
TEST(Gpt, LlamaGradientCheck) { gradient_check(tiny_llama_config(0.f)); }
TEST(Gpt, LlamaGradientCheckWithDropoutAndDocuments) {
  gradient_check(tiny_llama_config(0.2f), /*documents=*/true);  // RoPE follows the reset position ids
}
TEST(Gpt, MlaGradientCheck) { gradient_check(tiny_mla_config(0.f)); }
TEST(Gpt, MlaGradientCheckWithDropoutAndDocuments) { gradient_check(tiny_mla_config(0.2f), /*documents=*/true); }
TEST(Gpt, MlaNoQueryLoraGradientCheck) { gradient_check(tiny_mla_config(0.f, /*no_lora=*/true)); }
TEST(Gpt, MlaFlashAttentionGradientCheck) {
  TransformerConfig c = tiny_mla_config(0.f);
  c.attention_backend = AttentionBackend::kFlash;
  gradient_check(c, /*documents=*/true);
}
TEST(Gpt, MlaUpProjRecomputeGradientCheck) {
  TransformerConfig c = tiny_mla_config(0.2f);
  c.recompute_granularity = RecomputeGranularity::kSelective;
  c.recompute_modules_set = true;
  c.recompute_modules = parse_recompute_modules({"core_attn", "mla_up_proj"});
  gradient_check(c);
}

TEST(Gpt, FlashAttentionGradientCheck) {
  TransformerConfig c = tiny_llama_config(0.2f);
  c.attention_backend = AttentionBackend::kFlash;  // the CPU reference of ops/flash_attention.h
  gradient_check(c, /*documents=*/true);
  c = tiny_config(0.2f);
  c.attention_backend = AttentionBackend::kFlash;
  gradient_check(c);
}

// The two core attentions compute the same model: losses and every gradient agree (fp32), with
// dropout (the same keyed mask), documents and GQA.
TEST(Gpt, FlashAndLocalAttentionAgree) {
  for (bool llama : {false, true}) {
    TransformerConfig c = llama ? tiny_llama_config(0.2f) : tiny_config(0.2f);
    std::vector<std::vector<float>> grads[2];
    double loss[2];
    std::vector<int32_t> tokens, labels;
    for (int k = 0; k < 2; ++k) {
      c.attention_backend = k == 0 ? AttentionBackend::kLocal : AttentionBackend::kFlash;
      Harness h(c, 2);
      h.with_documents();
      if (k == 0) {  // the same batch for both
        tokens.assign(h.tokens.t.data_as<int32_t>(), h.tokens.t.data_as<int32_t>() + h.tokens.t.numel());
        labels.assign(h.labels.t.data_as<int32_t>(), h.labels.t.data_as<int32_t>() + h.labels.t.numel());
      } else {
        std::copy(tokens.begin(), tokens.end(), h.tokens.t.data_as<int32_t>());
        std::copy(labels.begin(), labels.end(), h.labels.t.data_as<int32_t>());
      }
      loss[k] = h.loss_and_grads(grads[k]);
    }
    EXPECT_NEAR(loss[1], loss[0], 1e-6 * std::fabs(loss[0])) << "llama " << llama;
    for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_LT(testing::rel_err(grads[1][i], grads[0][i]), 1e-5) << i;
  }
}

// The loss of an MoE model jumps where a perturbation flips a top-k selection, so a finite
// difference across a near-tie measures the jump, not the gradient. Over seeds 101-120, 5 to 9
// of 20 points had such a jump in these tiny models (hidden 16, every token near a tie at some
// layer), and only tensors upstream of a router ever disagreed: the last layer's experts, the
// final norm and the output layer, which no selection depends on, agreed at every seed. The MoE
// checks therefore run at fixed seeds (inputs and initialisation) without a jump within the
// steps used; the layout tests (random seeds) compare the same gradients across layouts.
void moe_gradient_check(const TransformerConfig& c, bool documents) {
  for (uint64_t seed : {104u, 106u, 109u, 112u, 113u}) {
    SCOPED_TRACE(seed);
    testing::test_rng().seed(seed);
    gradient_check(c, documents, seed);
  }
}
TEST(Gpt, MoEGradientCheck) { moe_gradient_check(tiny_moe_config(false), /*documents=*/true); }
TEST(Gpt, MoEGradientCheckSigmoidGroupLimitedSharedExpert) { moe_gradient_check(tiny_moe_config(true), false); }
// --moe-router-load-balancing-type global_aux_loss: the switch loss over the counts accumulated
// over the step's forwards (one here, one rank: the value equals aux_loss's, through the
// accumulator), both routers.
TEST(Gpt, MoEGlobalAuxLossGradientCheck) {
  for (bool sigmoid : {false, true}) {
    TransformerConfig c = tiny_moe_config(sigmoid);
    c.moe_router_load_balancing_type = {MoeLoadBalancing::kGlobalAuxLoss};
    moe_gradient_check(c, false);
  }
}
// Megatron's list of load-balancing types (--moe-router-load-balancing-type aux_loss seq_aux_loss
// global_aux_loss with one coefficient each): the losses add up; gradients against finite
// differences of the summed objective, both routers.
TEST(Gpt, MoESeveralLoadBalancingTypesGradientCheck) {
  for (bool sigmoid : {false, true}) {
    TransformerConfig c = tiny_moe_config(sigmoid);
    c.moe_router_load_balancing_type = {MoeLoadBalancing::kAuxLoss, MoeLoadBalancing::kSeqAuxLoss,
                                        MoeLoadBalancing::kGlobalAuxLoss};
    c.moe_aux_loss_coeff = {0.3f, 0.2f, 0.1f};
    moe_gradient_check(c, false);
  }
}

// Two types at once give each type's loss value (bitwise: the same computation) and the gradient
// of their sum: (g(aux + seq) − g(none)) = (g(aux) − g(none)) + (g(seq) − g(none)), the router
// weight's and every other parameter's, for both routers.
TEST(Gpt, MoETwoLoadBalancingTypesEqualTheSumOfSingleTypeRuns) {
  for (bool sigmoid : {false, true}) {
    SCOPED_TRACE(sigmoid ? "sigmoid" : "softmax");
    const uint64_t seed = testing::test_seed();
    using LB = MoeLoadBalancing;
    const std::vector<std::pair<std::vector<LB>, std::vector<float>>> runs = {
        {{LB::kAuxLoss, LB::kSeqAuxLoss}, {0.6f, 0.9f}},  // both
        {{LB::kAuxLoss}, {0.6f}},
        {{LB::kSeqAuxLoss}, {0.9f}},
        {{LB::kNone}, {0.f}}};
    std::vector<std::vector<float>> grads[4];
    std::vector<double> stats[4];
    double loss[4];
    std::vector<std::string> names;
    for (size_t r = 0; r < runs.size(); ++r) {
      TransformerConfig c = tiny_moe_config(sigmoid);
      c.moe_z_loss_coeff = 0.f;
      c.moe_router_load_balancing_type = runs[r].first;
      c.moe_aux_loss_coeff = runs[r].second;
      c.validate();
      testing::test_rng().seed(seed);  // the same batch and weights for all
      Harness h(c, 2, seed);
      loss[r] = h.loss_and_grads(grads[r]);
      stats[r] = h.model.moe_loss_stats(h.stream);
      if (r == 0)
        for (size_t i = 0; i < h.model.params().size(); ++i) names.push_back(h.model.params().info(i).name);
    }
    const size_t per = static_cast<size_t>(kMoeStatLosses + 4);
    const size_t a = static_cast<size_t>(LB::kAuxLoss), q = static_cast<size_t>(LB::kSeqAuxLoss);
    for (size_t l = 0; l < 2; ++l) {
      EXPECT_EQ(stats[0][l * per + a], stats[1][l * per + a]) << "layer " << l;
      EXPECT_EQ(stats[0][l * per + q], stats[2][l * per + q]) << "layer " << l;
      EXPECT_EQ(stats[1][l * per + q], 0.0);  // the types that are off
      EXPECT_EQ(stats[2][l * per + a], 0.0);
    }
    EXPECT_GT(stats[0][per + a], 0.0);  // layer 1 is the MoE layer
    EXPECT_GT(stats[0][per + q], 0.0);
    EXPECT_NEAR(loss[0] + loss[3], loss[1] + loss[2], 1e-6 * std::fabs(loss[0]));
    for (size_t i = 0; i < grads[0].size(); ++i) {
      std::vector<float> both(grads[0][i].size()), sum(both.size()), seq_only(both.size());
      double n_both = 0;
      for (size_t j = 0; j < both.size(); ++j) {
        both[j] = grads[0][i][j] - grads[3][i][j];
        seq_only[j] = grads[2][i][j] - grads[3][i][j];
        sum[j] = (grads[1][i][j] - grads[3][i][j]) + seq_only[j];
        n_both += static_cast<double>(both[j]) * both[j];
      }
      if (n_both == 0) continue;  // parameters the router does not reach (the last layer's experts, the head)
      EXPECT_LT(testing::rel_err(both, sum), 1e-3) << names[i];
    }
    // the router weight of the MoE layer: the seq_aux_loss part is a large share of the difference
    bool found = false;
    for (size_t i = 0; i < grads[0].size(); ++i) {
      if (names[i] != "decoder.layers.1.mlp.router.weight") continue;
      found = true;
      std::vector<float> both(grads[0][i].size()), aux_only(both.size()), seq_only(both.size());
      for (size_t j = 0; j < both.size(); ++j) {
        both[j] = grads[0][i][j] - grads[3][i][j];
        aux_only[j] = grads[1][i][j] - grads[3][i][j];
        seq_only[j] = grads[2][i][j] - grads[3][i][j];
      }
      // A type whose gradient here is exactly zero must be explained by balanced routing: with
      // equal token counts per expert, Σ_e count_e · score_te is constant per token (the scores
      // sum to 1), so aux_loss has no gradient (drawn by some seeds in this tiny batch).
      auto norm = [](const std::vector<float>& x) {
        double n = 0;
        for (float v : x) n += static_cast<double>(v) * v;
        return n;
      };
      const double* counts = stats[0].data() + per + kMoeStatLosses;
      const bool balanced = std::all_of(counts, counts + 4, [&](double n) { return n == counts[0]; });
      if (norm(aux_only) > 0 || !balanced)
        EXPECT_GT(testing::rel_err(both, seq_only), 0.05) << "aux_loss left out";
      EXPECT_GT(testing::rel_err(both, aux_only), 0.05) << "seq_aux_loss left out";
    }
    EXPECT_TRUE(found);
  }
}

// --moe-router-dtype fp64: the router GEMM and the routing math in double. Gradients against
// finite differences; loss and gradients equal the fp32 router's to rounding, the gradients not
// bitwise (the path is taken).
TEST(Gpt, MoERouterFp64GradientCheck) {
  for (bool sigmoid : {false, true}) {
    TransformerConfig c = tiny_moe_config(sigmoid);
    c.moe_router_dtype = DType::kF64;
    moe_gradient_check(c, false);
    const uint64_t seed = testing::test_seed();
    double loss[2];
    std::vector<std::vector<float>> g[2];
    for (int k = 0; k < 2; ++k) {
      TransformerConfig ck = c;
      ck.moe_router_dtype = k == 0 ? DType::kF32 : DType::kF64;
      testing::test_rng().seed(seed);
      Harness h(ck, 2, seed);
      loss[k] = h.loss_and_grads(g[k]);
    }
    EXPECT_NEAR(loss[1], loss[0], 1e-5 * std::fabs(loss[0]));
    bool differ = false;  // the gradients through the router differ in their last bits
    for (size_t i = 0; i < g[0].size(); ++i) {
      EXPECT_LT(testing::rel_err(g[1][i], g[0][i]), 1e-5) << i;
      differ = differ || g[1][i] != g[0][i];
    }
    EXPECT_TRUE(differ) << "the fp64 router gave the fp32 router's gradients bitwise";
  }
}

// --moe-shared-expert-gate (Qwen 2 MoE's shared_expert_gate): the shared expert's output scaled by
// sigmoid(x · w_gate); gradients (w_gate's included) against finite differences, both routers.
TEST(Gpt, MoESharedExpertGateGradientCheck) {
  for (bool sigmoid : {false, true}) {
    TransformerConfig c = tiny_moe_config(sigmoid);
    c.moe_shared_expert_intermediate_size = 8;
    c.moe_shared_expert_gate = true;
    moe_gradient_check(c, false);
  }
}

TEST(Gpt, MoEGeluExpertsGradientCheck) {
  TransformerConfig c = tiny_moe_config(false);
  c.gated_linear_unit = false;
  c.moe_layer_pattern.clear();  // every layer
  c.moe_router_pre_softmax = true;
  c.moe_router_topk = 1;
  moe_gradient_check(c, false);
}

// --moe-grouped-gemm (the experts as grouped GEMMs over the planned rows with device-side counts,
// the allgather dispatcher without host counts) computes the same model as the per-expert loop:
// the loss and every gradient agree (fp32), for SwiGLU and GELU experts, the sigmoid router with
// shared experts, and token dropping.
TEST(Gpt, MoEGroupedGemmMatchesPerExpertLoop) {
  std::vector<TransformerConfig> configs = {tiny_moe_config(false), tiny_moe_config(true)};
  configs.push_back(tiny_moe_config(false));
  configs.back().gated_linear_unit = false;
  configs.back().moe_layer_pattern.clear();
  configs.push_back(tiny_moe_config(false));
  configs.back().moe_expert_capacity_set = true;
  configs.back().moe_expert_capacity_factor = 0.75;
  for (size_t ci = 0; ci < configs.size(); ++ci) {
    SCOPED_TRACE(ci);
    std::vector<std::vector<float>> grads[2];
    double loss[2];
    const uint64_t seed = testing::test_seed() + ci;
    for (int k = 0; k < 2; ++k) {
      TransformerConfig c = configs[ci];
      c.moe_grouped_gemm = k == 1;
      testing::test_rng().seed(seed);  // the same batch and weights for both
      Harness h(c, 2, seed);
      loss[k] = h.loss_and_grads(grads[k]);
    }
    EXPECT_NEAR(loss[1], loss[0], 1e-6 * std::fabs(loss[0]));
    for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_LT(testing::rel_err(grads[1][i], grads[0][i]), 1e-5) << i;
  }
}

// Activation recompute (--recompute-granularity selective|full, --recompute-method uniform|block,
// --recompute-modules) recomputes the same tensors: the loss, every gradient and the MoE
// statistics (counted once) are bitwise those without recompute, with dropout and documents, for
// uneven groups, block recompute, the local and the flash attention, MoE layers (token dropping,
// shared expert), and each selective module (the norms, the dense MLP or its GELU / SwiGLU, the
// experts' activation in the looped and the grouped experts); the planned activations shrink
// where they can.
TEST(Gpt, RecomputeMatchesNoRecompute) {
  struct Case {
    const char* name;
    TransformerConfig config;
    RecomputeGranularity granularity;
    RecomputeMethod method;
    int64_t layers;
    RecomputeModules modules = {};  // selective granularity
  };
  auto four = [](TransformerConfig c) {
    c.num_layers = 4;
    if (c.num_moe_experts > 0) c.moe_layer_pattern = {0, 1, 1, 0};
    return c;
  };
  using G = RecomputeGranularity;
  using M = RecomputeMethod;
  TransformerConfig gpt = four(tiny_config(0.2f)), llama = four(tiny_llama_config(0.2f));
  gpt.attention_backend = llama.attention_backend = AttentionBackend::kLocal;
  TransformerConfig flash = llama, moe = four(tiny_moe_config(true)), drops = four(tiny_moe_config(false));
  flash.attention_backend = AttentionBackend::kFlash;
  drops.moe_expert_capacity_set = true;
  drops.moe_expert_capacity_factor = 0.75;
  TransformerConfig grouped = moe;
  grouped.moe_grouped_gemm = true;
  auto modules = [](bool layernorm, bool mlp, bool mlp_act, bool moe_act) {
    return RecomputeModules{/*core_attn=*/false, layernorm, mlp, mlp_act, moe_act};
  };
  const std::vector<Case> cases = {
      {"gpt layernorm mlp_act", gpt, G::kSelective, M::kUniform, 0, modules(true, false, true, false)},
      {"gpt mlp", gpt, G::kSelective, M::kUniform, 0, modules(false, true, false, false)},
      {"flash layernorm mlp", flash, G::kSelective, M::kUniform, 0, modules(true, true, false, false)},
      {"flash mlp_act", flash, G::kSelective, M::kUniform, 0, modules(false, false, true, false)},
      {"moe layernorm moe_act", moe, G::kSelective, M::kUniform, 0, modules(true, false, true, true)},
      {"grouped moe_act", grouped, G::kSelective, M::kUniform, 0, modules(false, false, false, true)},
      {"gpt selective", gpt, G::kSelective, M::kUniform, 0},   {"gpt uniform 1", gpt, G::kFull, M::kUniform, 1},
      {"llama uniform 3", llama, G::kFull, M::kUniform, 3},    {"llama block 1", llama, G::kFull, M::kBlock, 1},
      {"llama block 4", llama, G::kFull, M::kBlock, 4},        {"flash uniform 2", flash, G::kFull, M::kUniform, 2},
      {"moe uniform 2", moe, G::kFull, M::kUniform, 2},        {"moe drops block 3", drops, G::kFull, M::kBlock, 3},
  };
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.name);
    std::vector<std::vector<float>> grads[2];
    std::vector<double> stats[2];
    double loss[2];
    size_t bytes[2];
    const uint64_t seed = testing::test_seed();
    for (int k = 0; k < 2; ++k) {
      TransformerConfig c = cs.config;
      if (k == 1) {
        c.recompute_granularity = cs.granularity;
        c.recompute_method = cs.method;
        c.recompute_method_set = cs.granularity == G::kFull;
        c.recompute_num_layers = cs.layers;
        if (cs.granularity == G::kSelective) c.recompute_modules = cs.modules;
      }
      testing::test_rng().seed(seed);  // the same batch and weights for both
      Harness h(c, 2, seed);
      h.with_documents();
      loss[k] = h.loss_and_grads(grads[k]);
      stats[k] = h.model.moe_loss_stats(h.stream);
      bytes[k] = h.model.activation_bytes();
    }
    EXPECT_EQ(loss[1], loss[0]);
    EXPECT_EQ(stats[1], stats[0]);
    for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_EQ(grads[1][i], grads[0][i]) << "parameter " << i;
    // one activation slot: recomputing a single layer of four (block 1) keeps that layer's
    // tensors in the recompute area plus its output, so only the larger groups save memory
    if (cs.layers != 1 || cs.method != M::kBlock) EXPECT_LT(bytes[1], bytes[0]);
  }
}

// Token dropping at an expert capacity of ceil(T·k/E · 0.75): the dropped slots' outputs and
// probability gradients are zero; position policy (the drop depends on the selection only, so it
// adds no discontinuity of its own).
TEST(Gpt, MoECapacityDropGradientCheck) {
  TransformerConfig c = tiny_moe_config(false);
  c.moe_expert_capacity_set = true;
  c.moe_expert_capacity_factor = 0.75;
  c.moe_token_drop_policy = MoeTokenDropPolicy::kPosition;
  moe_gradient_check(c, false);
}

TEST(Gpt, Qwen3GradientCheck) { gradient_check(tiny_llama_config(0.2f, /*qwen3=*/true), /*documents=*/true); }

// The last backward reports every parameter once, and the word embedding before the first
// layer: layer 0's weight gradients are computed after the embedding backward, so that the
// embedding's (large) gradient reduction can start first (GPTModel::backward_chunk).
TEST(Gpt, GradsReadyOrderEmbeddingBeforeFirstLayer) {
  struct Recorder final : ParamGradHooks {
    std::vector<size_t> order;
    void params_needed(size_t, size_t, const Stream&) override {}
    void grads_ready(size_t first, size_t end, const Stream&) override {
      for (size_t i = first; i < end; ++i) order.push_back(i);
    }
  } rec;
  const TransformerConfig c = tiny_config(0.f);
  Harness h(c, 2);
  h.model.set_hooks(&rec);
  const DropoutContext dc{1, 0, 0, true};
  h.model.params().zero_grads(h.stream);
  h.loss_value(dc);
  h.model.backward(h.mb(), dc, 1.f, Tensor(), h.stream);
  const ParamStore& P = h.model.params();
  std::vector<size_t> sorted = rec.order;
  std::sort(sorted.begin(), sorted.end());
  std::vector<size_t> all(P.size());
  std::iota(all.begin(), all.end(), size_t{0});
  EXPECT_EQ(sorted, all);  // each parameter exactly once
  auto pos = [&](const std::string& name) {
    for (size_t k = 0; k < rec.order.size(); ++k)
      if (P.info(rec.order[k]).name == name) return k;
    ADD_FAILURE() << name << " not reported";
    return size_t{0};
  };
  const size_t wte = pos("embedding.word_embeddings.weight");
  EXPECT_LT(wte, pos("decoder.layers.0.self_attention.linear_qkv.weight"));
  EXPECT_LT(wte, pos("decoder.layers.0.mlp.linear_fc1.weight"));
  EXPECT_GT(wte, pos("decoder.layers.1.self_attention.linear_qkv.weight"));
}

// The first weight-gradient write of a step overwrites instead of adding to zeros
// (ParamSpec::grad_overwrite, ParamStore::zero_grads): with two micro-batches accumulated into a
// buffer holding NaN where zero_grads left it alone, every gradient equals, bitwise, the one of
// zeroed buffers and adding writes (set_grad_overwrite(false)).
TEST(Gpt, FirstGradientWritesOverwrite) {
  for (const TransformerConfig& c : {tiny_config(0.2f), tiny_llama_config(0.2f), tiny_moe_config(true)}) {
    Harness h(c, 2);
    ParamStore& P = h.model.params();
    auto two_micro_batches = [&](bool overwrite) {
      P.set_grad_overwrite(overwrite);
      fill(P.grads_flat(), std::nanf(""), h.stream);
      P.zero_grads(h.stream);
      for (int k = 0; k < 2; ++k) {
        const DropoutContext dc{7, 2, static_cast<uint32_t>(k), true};
        h.loss_value(dc);
        h.model.backward(h.mb(), dc, 0.5f, Tensor(), h.stream, /*last_backward=*/k == 1);
      }
      EXPECT_EQ(P.untaken_first_write(), ParamStore::kNoParam);
      std::vector<std::vector<float>> g;
      for (size_t i = 0; i < P.size(); ++i) g.push_back(testing::to_host(P.grad(i), h.stream));
      return g;
    };
    const auto added = two_micro_batches(false), overwritten = two_micro_batches(true);
    size_t marked = 0;
    for (size_t i = 0; i < P.size(); ++i) {
      marked += P.info(i).grad_overwrite;
      EXPECT_EQ(overwritten[i], added[i]) << P.info(i).name;
      EXPECT_TRUE(std::all_of(added[i].begin(), added[i].end(), [](float x) { return std::isfinite(x); }))
          << P.info(i).name;
    }
    EXPECT_TRUE(P.info(P.index("decoder.layers.0.mlp.linear_fc1.weight")).grad_overwrite);
    EXPECT_FALSE(P.info(P.index("embedding.word_embeddings.weight")).grad_overwrite);
    EXPECT_GE(marked, 4u * static_cast<size_t>(c.num_layers) - (c.num_moe_experts > 0 ? 2u : 0u));
    // A step whose backward never ran leaves the marks: the first one names a linear weight.
    P.zero_grads(h.stream);
    const size_t left = P.untaken_first_write();
    ASSERT_NE(left, ParamStore::kNoParam);
    EXPECT_TRUE(P.info(left).grad_overwrite) << P.info(left).name;
  }
}

TEST(Gpt, DeterministicAndDropoutKeyed) {
  const TransformerConfig c = tiny_config(0.2f);
  Harness h(c, 3);
  const double a = h.loss_value({1, 5, 0, true});
  EXPECT_EQ(a, h.loss_value({1, 5, 0, true}));    // same key: bitwise the same
  EXPECT_NE(a, h.loss_value({1, 6, 0, true}));    // another iteration: another mask
  EXPECT_NE(a, h.loss_value({1, 5, 0, false}));   // evaluation: no dropout
  // Initial loss of a random model is close to log(V).
  EXPECT_NEAR(h.loss_value({1, 5, 0, false}), std::log(40.0), 1.5);
}

TEST(Gpt, ParameterCountAndNames) {
  TransformerConfig c;  // GPT-2 124M
  c.vocab_size = 50257;
  EXPECT_EQ(c.padded_vocab_size(), 50304);
  EXPECT_EQ(c.num_parameters(), 124475904);  // 124M with the padded vocabulary, tied embedding
  auto specs = GPTModel::param_specs(c);
  int64_t n = 0;
  for (auto& s : specs) {
    int64_t k = 1;
    for (auto d : s.shape) k *= d;
    n += k;
    if (s.name.find(".bias") != std::string::npos || s.shape.size() == 1) EXPECT_FALSE(s.weight_decay) << s.name;
  }
  EXPECT_EQ(n, c.num_parameters());
  EXPECT_EQ(specs[2].name, "decoder.layers.0.self_attention.linear_qkv.weight");
}

TEST(Gpt, ConfigErrors) {
  TransformerConfig c = tiny_config(0);
  c.num_attention_heads = 3;
  EXPECT_THROW(c.validate(), Error);
  c = tiny_config(0);
  c.seq_length = 8;  // > max positions 7
  try {
    c.validate();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--seq-length 8 exceeds --max-position-embeddings 7"), std::string::npos);
  }
  c = tiny_config(0);
  c.hidden_dropout = 1.0f;
  EXPECT_THROW(c.validate(), Error);
  // Llama-family options.
  auto expect_message = [](const TransformerConfig& bad, int tp, const std::string& what) {
    try {
      bad.validate(tp);
      ADD_FAILURE() << "no error; expected '" << what << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  c = tiny_llama_config(0);
  c.num_query_groups = 3;
  expect_message(c, 1, "--num-attention-heads 4 is not divisible by --num-query-groups 3");
  c = tiny_llama_config(0);
  expect_message(c, 4, "--num-query-groups 2 is not divisible by tensor parallel size 4");
  c = tiny_llama_config(0);
  c.rotary_percent = 1.5f;
  expect_message(c, 1, "--rotary-percent must be in (0, 1], got 1.5");
  c = tiny_llama_config(0, /*qwen3=*/true);
  c.normalization = Normalization::kLayerNorm;
  expect_message(c, 1, "--qk-layernorm is implemented with --normalization RMSNorm only");
  // Token dropping options.
  c = tiny_moe_config(false);
  c.moe_expert_capacity_set = true;
  c.moe_expert_capacity_factor = 0;
  expect_message(c, 1, "--moe-expert-capacity-factor must be a positive number, got 0");
  c.moe_expert_capacity_factor = -1.5;
  expect_message(c, 1, "--moe-expert-capacity-factor must be a positive number, got -1.5");
  c = tiny_moe_config(false);
  c.moe_pad_expert_input_to_capacity = true;
  expect_message(c, 1, "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor");
  // Activation recompute (Megatron's rules).
  c = tiny_config(0);
  c.recompute_granularity = RecomputeGranularity::kFull;
  expect_message(c, 1, "--recompute-granularity full needs --recompute-method uniform or block");
  c.recompute_method_set = true;
  expect_message(c, 1, "--recompute-granularity full needs --recompute-num-layers >= 1, got 0");
  c.recompute_num_layers = 3;
  expect_message(c, 1, "--recompute-num-layers 3 exceeds --num-layers 2 (--recompute-method uniform)");
  c.recompute_granularity = RecomputeGranularity::kSelective;
  expect_message(c, 1, "--recompute-method uniform needs --recompute-granularity full (got selective)");
  c.recompute_method_set = false;
  expect_message(c, 1, "--recompute-num-layers 3 needs --recompute-granularity full (got selective)");
  c = tiny_moe_config(false);
  c.recompute_granularity = RecomputeGranularity::kFull;
  c.recompute_method_set = true;
  c.recompute_num_layers = 1;
  c.moe_router_load_balancing_type = {MoeLoadBalancing::kGlobalAuxLoss};
  expect_message(c, 1, "global_aux_loss with --recompute-granularity full is not supported");
  EXPECT_THROW(parse_recompute_granularity("partial"), Error);
  EXPECT_THROW(parse_recompute_method("random"), Error);
  EXPECT_THROW(parse_moe_token_drop_policy("random"), Error);
  EXPECT_THROW(parse_normalization("BatchNorm"), Error);
  EXPECT_THROW(parse_position_embedding_type("alibi"), Error);
  EXPECT_THROW(GPTModel(tiny_config(0), 1, DType::kBF16, Device::cpu(), ProcessGroups::single()), Error);
}

// Megatron-Core's rule: moe_preprocess extends the router's graph, so it needs moe_router.
TEST(LayerGraphs, MoePreprocessNeedsMoeRouter) {
  try {
    LayerGraphs graphs(true, false, false, /*moe_router=*/false, /*moe_preprocess=*/true);
    ADD_FAILURE() << "moe_preprocess without moe_router was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("moe_preprocess needs moe_router"), std::string::npos) << e.what();
  }
  const LayerGraphs graphs(false, false, false, true, true);
  EXPECT_TRUE(graphs.scoped(LayerGraphs::Region::kMoeRouter));
  EXPECT_TRUE(graphs.scoped(LayerGraphs::Region::kMoePreprocess));
  EXPECT_FALSE(graphs.scoped(LayerGraphs::Region::kMoe));
  EXPECT_FALSE(LayerGraphs(false, false, false, true).scoped(LayerGraphs::Region::kMoePreprocess));
}

TEST(Gpt, FlopsFormula) {
  TransformerConfig c;
  c.vocab_size = 50257;
  // 72·B·s·L·h²·(1 + s/(12h) + V/(12·L·h)) for f = 4h (Megatron training.py; causal attention
  // counts half of the s² term).
  const double B = 16, s = 1024, L = 12, h = 768, V = 50304;
  const double expect = 72 * B * s * L * h * h * (1 + s / (12 * h) + V / (12 * L * h));
  EXPECT_NEAR(c.flops_per_iteration(16) / expect, 1.0, 1e-12);
}

// Megatron's initialisation (Shoeybi et al. 2019, §3 / Megatron-Core init_method_normal and
// scaled_init_method_normal): weights N(0, sigma), the output projections of attention
// (linear_proj) and MLP (linear_fc2) N(0, sigma / sqrt(2 L)), norm weights 1, biases 0; for every
// layer kind of the GPT-2 and Llama / Qwen architectures.
TEST(Gpt, InitialisationStatistics) {
  for (bool llama : {false, true}) {
    TransformerConfig c = llama ? tiny_llama_config(0.f, /*qwen3=*/true) : tiny_config(0.f);
    c.num_layers = 3;
    c.hidden_size = 64;
    c.num_attention_heads = 4;
    c.ffn_hidden_size = llama ? 96 : 0;
    c.vocab_size = 1000;
    c.init_method_std = 0.02f;
    Stream st(Device::cpu());
    GPTModel model(c, 1, DType::kF32, Device::cpu(), ProcessGroups::single());
    model.params().initialize(testing::test_seed(), st);
    const double sigma = c.init_method_std, scaled = sigma / std::sqrt(2.0 * c.num_layers);
    const ParamStore& P = model.params();
    int normal = 0, scaled_count = 0, ones = 0, zeros = 0;
    for (size_t i = 0; i < P.size(); ++i) {
      const ParamInfo& p = P.info(i);
      const std::vector<float> v = testing::to_host(P.main(i), st);
      double mean = 0, sq = 0;
      for (float x : v) mean += x;
      mean /= static_cast<double>(v.size());
      for (float x : v) sq += (x - mean) * (x - mean);
      const double sd = std::sqrt(sq / static_cast<double>(v.size()));
      const bool is_norm = p.name.find("layernorm.weight") != std::string::npos;
      const bool is_bias = p.name.size() > 5 && p.name.compare(p.name.size() - 5, 5, ".bias") == 0;
      if (is_norm) {
        EXPECT_EQ(v, std::vector<float>(v.size(), 1.f)) << p.name;
        ++ones;
      } else if (is_bias) {
        EXPECT_EQ(v, std::vector<float>(v.size(), 0.f)) << p.name;
        ++zeros;
      } else {
        const bool out_proj = p.name.find("linear_proj.weight") != std::string::npos ||
                              p.name.find("linear_fc2.weight") != std::string::npos;
        const double want = out_proj ? scaled : sigma;
        // The sample standard deviation of n normals is within ~1/sqrt(2n) relative (n >= 4096).
        EXPECT_NEAR(sd / want, 1.0, 6.0 / std::sqrt(2.0 * static_cast<double>(v.size()))) << p.name;
        EXPECT_NEAR(mean, 0.0, 6.0 * want / std::sqrt(static_cast<double>(v.size()))) << p.name;
        (out_proj ? scaled_count : normal)++;
      }
    }
    EXPECT_EQ(scaled_count, 2 * c.num_layers) << "llama " << llama;
    // qkv, fc1 per layer, the word embedding, and the position embedding or the output layer.
    EXPECT_EQ(normal, 2 * c.num_layers + 2) << "llama " << llama;
    EXPECT_EQ(ones, llama ? 4 * c.num_layers + 1 : 2 * c.num_layers + 1) << "llama " << llama;
    EXPECT_EQ(zeros, llama ? c.num_layers : 2 * c.num_layers + 1 + 4 * c.num_layers) << "llama " << llama;
  }
}

// Megatron-Core's parameter names and shapes for a Llama / Qwen 3 style layer, and the parameter
// count of the configuration.
// The elements of `specs` and each parameter's global shape by name.
std::pair<int64_t, std::map<std::string, std::vector<int64_t>>> count_params(const std::vector<ParamSpec>& specs) {
  int64_t n = 0;
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& s : specs) {
    int64_t k = 1;
    for (auto d : s.shape) k *= d;
    n += k;
    shapes[s.name] = s.global_shape.empty() ? s.shape : s.global_shape;
  }
  return {n, shapes};
}

TEST(Gpt, LlamaParameterNamesAndCount) {
  const TransformerConfig c = tiny_llama_config(0.f, /*qwen3=*/true);
  const auto specs = GPTModel::param_specs(c);
  const auto [n, shapes] = count_params(specs);
  EXPECT_EQ(n, c.num_parameters());
  const int64_t h = 16, d = 4, qkv = (4 + 2 * 2) * d;
  EXPECT_EQ(shapes.at("decoder.layers.1.self_attention.linear_qkv.weight"), (std::vector<int64_t>{qkv, h}));
  EXPECT_EQ(shapes.at("decoder.layers.1.self_attention.linear_qkv.bias"), (std::vector<int64_t>{qkv}));
  EXPECT_EQ(shapes.at("decoder.layers.1.self_attention.q_layernorm.weight"), (std::vector<int64_t>{d}));
  EXPECT_EQ(shapes.at("decoder.layers.1.self_attention.k_layernorm.weight"), (std::vector<int64_t>{d}));
  EXPECT_EQ(shapes.at("decoder.layers.1.self_attention.linear_proj.weight"), (std::vector<int64_t>{h, 4 * d}));
  EXPECT_EQ(shapes.at("decoder.layers.1.mlp.linear_fc1.weight"), (std::vector<int64_t>{2, 12, h}));  // [gate; up]
  EXPECT_EQ(shapes.at("decoder.layers.1.mlp.linear_fc2.weight"), (std::vector<int64_t>{h, 12}));
  EXPECT_EQ(shapes.at("output_layer.weight"), (std::vector<int64_t>{40, h}));
  EXPECT_EQ(shapes.count("embedding.position_embeddings.weight"), 0u);
  EXPECT_EQ(shapes.count("decoder.layers.1.mlp.linear_fc1.bias"), 0u);
  EXPECT_EQ(shapes.count("decoder.layers.1.input_layernorm.bias"), 0u);  // RMSNorm: weight only
}

// Megatron's --ffn-hidden-size default with --swiglu and its FLOP count for GQA and SwiGLU.
TEST(Gpt, LlamaDefaultsAndFlops) {
  TransformerConfig c;
  c.hidden_size = 2048;
  c.gated_linear_unit = true;
  EXPECT_EQ(c.ffn(), 5440);  // int(4 * 2048 * 2 / 3 / 64) * 64
  c.num_layers = 16;
  c.num_attention_heads = 32;
  c.num_query_groups = 8;
  c.ffn_hidden_size = 8192;
  c.seq_length = 2048;
  c.vocab_size = 50257;
  const double B = 8, s = 2048, L = 16, h = 2048, V = 50304;
  const double expect =
      12 * B * s * L * h * h * ((1 + 8.0 / 32 + s / (2 * h)) * 1.0 + (8192 / h) * 1.5 + V / (2 * L * h));
  EXPECT_NEAR(c.flops_per_iteration(8) / expect, 1.0, 1e-12);
}

// The LM head in chunks of rows (model/layers/output_head.h): with the gradients made in the forward
// (HeadGrad, the pipeline executor's way) and with the logits recomputed in the backward, the loss
// and every gradient equal those of the whole-logits head (keep_logits), for 3-row chunks of the 10
// rows (3, 3, 3, 1), tied (GPT) and untied (Llama), with a loss mask. A chunked model refuses to
// produce logits, and a backward whose scales differ from those its forward used.
TEST(Gpt, HeadInChunksEqualsWholeLogits) {
  for (const bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama" : "gpt");
    const TransformerConfig c = llama ? tiny_llama_config(0.f) : tiny_config(0.f);
    const int64_t B = 2, T = c.seq_length * B;
    const float w = 1.0f / static_cast<float>(T);
    Stream st(Device::cpu());
    const auto tok = testing::randint(T, 0, static_cast<int32_t>(c.vocab_size));
    const auto lab = testing::randint(T, 0, static_cast<int32_t>(c.vocab_size));
    std::vector<float> mask(static_cast<size_t>(T), 1.f);
    mask[1] = mask[6] = 0.f;
    OwnedTensor tokens = testing::make_int_tensor(tok, Device::cpu(), {c.seq_length, B}, st);
    OwnedTensor labels = testing::make_int_tensor(lab, Device::cpu(), {c.seq_length, B}, st);
    OwnedTensor lmask = testing::make_tensor(mask, DType::kF32, Device::cpu(), {c.seq_length, B}, st);
    const MicroBatch mb{tokens.t, labels.t, lmask.t};
    const DropoutContext dc{7, 2, 1, true};
    const uint64_t seed = testing::test_seed();
    struct Run {
      double loss;
      std::vector<std::vector<float>> grads;
    };
    // mode 0: whole logits; 1: chunks, gradients in the forward; 2: chunks, recomputed in the backward.
    auto run = [&](int mode) {
      ModelLayout ml;
      if (mode > 0) {
        ml.head.keep_logits = false;
        ml.head.chunk_bytes = static_cast<size_t>(3 * c.padded_vocab_size(1)) * 4;
      }
      GPTModel m(c, B, DType::kF32, Device::cpu(), ProcessGroups::single(), false, ParamLayout{}, ml);
      m.params().initialize(seed, st);
      OwnedTensor loss(DType::kF32, Device::cpu(), {1});
      const HeadGrad hg{w, Tensor()};
      const HeadGrad* grad = mode == 1 ? &hg : nullptr;
      if (mode > 0) {  // the refusals first
        try {
          m.forward_chunk(0, ChunkBuffers{}, mb, dc, loss.t, w, st, false, /*compute_loss=*/false);
          ADD_FAILURE() << "a chunked head produced logits";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("keep_logits"), std::string::npos) << e.what();
        }
        if (mode == 1) {  // the forward's scales bind its backward
          m.forward_chunk(0, ChunkBuffers{}, mb, dc, loss.t, w, st, false, true, grad);
          EXPECT_THROW(m.backward(mb, dc, 2 * w, Tensor(), st), Error);
        }
      }
      m.params().zero_grads(st);
      fill(loss.t, 0.f, st);
      m.forward_chunk(0, ChunkBuffers{}, mb, dc, loss.t, w, st, false, true, grad);
      m.backward(mb, dc, w, Tensor(), st);
      Run r{testing::to_host(loss.t, st)[0], {}};
      for (size_t i = 0; i < m.params().size(); ++i) r.grads.push_back(testing::to_host(m.params().grad(i), st));
      return r;
    };
    const Run ref = run(0);
    for (int mode : {1, 2}) {
      SCOPED_TRACE(mode == 1 ? "gradients in the forward" : "recomputed in the backward");
      const Run got = run(mode);
      EXPECT_NEAR(got.loss, ref.loss, 1e-6 * std::abs(ref.loss));
      ASSERT_EQ(got.grads.size(), ref.grads.size());
      for (size_t i = 0; i < ref.grads.size(); ++i) EXPECT_LT(testing::rel_err(got.grads[i], ref.grads[i]), 1e-5) << i;
    }
  }
}

// --- multi-token prediction (--mtp-num-layers; model/layers/multi_token_prediction.h) ---

TransformerConfig tiny_mtp_config(float dropout, int64_t depths) {
  TransformerConfig c = tiny_llama_config(dropout);
  c.mtp_num_layers = depths;
  c.mtp_loss_scaling_factor = 0.5f;  // large enough that the MTP gradients matter
  return c;
}

// Megatron's roll_tensor applied k times, and the weights m[i + k] · n0 / n_k, by hand: s = 3,
// b = 2, the mask zero at (i 0, b 1) and (i 2, b 0).
TEST(Mtp, InputsRollAndReweight) {
  const std::vector<int32_t> tok = {10, 11, 12, 13, 14, 15}, lab = {20, 21, 22, 23, 24, 25};
  const std::vector<float> mask = {1, 0, 1, 1, 0, 1};  // n0 = 4
  const MtpInputs in = make_mtp_inputs(2, 3, 2, tok.data(), lab.data(), mask.data());
  EXPECT_EQ(in.tokens, (std::vector<int32_t>{12, 13, 14, 15, 0, 0, /*k 2*/ 14, 15, 0, 0, 0, 0}));
  EXPECT_EQ(in.labels, (std::vector<int32_t>{22, 23, 24, 25, 0, 0, 24, 25, 0, 0, 0, 0}));
  // k 1: rolled mask {1, 1, 0, 1, 0, 0}, n_1 = 3 -> weights 4/3; k 2: {0, 1, 0, ...}, n_2 = 1 -> 4
  const float a = 4.f / 3.f;
  EXPECT_EQ(in.loss_mask, (std::vector<float>{a, a, 0, a, 0, 0, 0, 4, 0, 0, 0, 0}));
  const MtpInputs ones = make_mtp_inputs(1, 3, 2, tok.data(), lab.data(), nullptr);  // no mask: 6 / 4
  EXPECT_EQ(ones.loss_mask, (std::vector<float>{1.5f, 1.5f, 1.5f, 1.5f, 0, 0}));
  EXPECT_THROW(make_mtp_inputs(0, 3, 2, tok.data(), lab.data(), nullptr), Error);
}

TEST(Mtp, GradientCheck) { gradient_check(tiny_mtp_config(0.f, 2)); }
TEST(Mtp, GradientCheckTiedWithDropoutAndDocuments) {
  TransformerConfig c = tiny_mtp_config(0.2f, 1);
  c.untie_embeddings_and_output_weights = false;
  gradient_check(c, /*documents=*/true);
}
TEST(Mtp, GradientCheckLayerNormGelu) {  // LayerNorm (norm bias) and the GELU MLP with biases, RoPE
  TransformerConfig c = tiny_config(0.f);
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.mtp_num_layers = 1;
  gradient_check(c);
}
// The MTP layer is an MoE layer (the last layer's kind), its load-balancing and z-losses counted.
// Routing to every expert (top-4 of 4) leaves no selection to flip: the loss is smooth at any seed.
// DeepSeek's router (sigmoid, groups, a shared expert) at the fixed seeds of moe_gradient_check
// where no selection flips within the steps (the MTP's router adds near-ties of its own: at seeds
// 104 and 113 only tensors upstream of a router disagreed, the signature of a jump).
TEST(Mtp, MoEGradientCheck) {
  TransformerConfig c = tiny_moe_config(false);
  c.moe_router_topk = 4;
  c.mtp_num_layers = 1;
  c.mtp_loss_scaling_factor = 0.5f;
  gradient_check(c, /*documents=*/true);
  c = tiny_moe_config(true);
  c.mtp_num_layers = 1;
  c.mtp_loss_scaling_factor = 0.5f;
  for (uint64_t seed : {106u, 109u, 112u}) {
    SCOPED_TRACE(seed);
    testing::test_rng().seed(seed);
    gradient_check(c, false, seed);
  }
}

double rms_norm_row(const float* x, const float* w, int64_t h, double eps, double* out) {
  double ss = 0;
  for (int64_t k = 0; k < h; ++k) ss += static_cast<double>(x[k]) * x[k];
  const double r = 1.0 / std::sqrt(ss / static_cast<double>(h) + eps);
  for (int64_t k = 0; k < h; ++k) out[k] = x[k] * r * w[k];
  return r;
}

// The MTP loss against a float64 reference made by hand from the model's parameters: with every
// layer's output projections (linear_proj, linear_fc2) zero, each transformer layer is the identity,
// so h_0 = final_norm(E[t]) and, per depth, h_k = final_norm_k(W_eh [enorm(E[t rolled k]);
// hnorm(h_{k−1})]); the losses are the weighted cross entropies of h_k W_outᵀ over the real
// vocabulary against the rolled labels (documents: a loss mask, so the weights n0 / n_k matter).
TEST(Mtp, LossEqualsHandReference) {
  const TransformerConfig c = tiny_mtp_config(0.f, 2);
  Harness h(c, 2);
  h.with_documents();
  ParamStore& P = h.model.params();
  std::map<std::string, std::vector<float>> w;
  for (size_t i = 0; i < P.size(); ++i) {
    const std::string& name = P.info(i).name;
    if (name.find("linear_proj.weight") != std::string::npos || name.find("linear_fc2.weight") != std::string::npos)
      testing::upload(P.main(i), std::vector<float>(static_cast<size_t>(P.info(i).numel), 0.f), h.stream);
    w[name] = testing::to_host(P.main(i), h.stream);
  }
  const int64_t S = c.seq_length, B = 2, H = c.hidden_size, V = c.vocab_size, D = c.mtp_num_layers;
  const float lw = 1.0f / static_cast<float>(S * B);
  fill(h.loss, 0.f, h.stream);
  h.model.forward(h.mb(), {1, 0, 0, true}, h.loss, lw, h.stream);
  const double main_loss = testing::to_host(h.loss.t, h.stream)[0];
  const std::vector<float> mtp = testing::to_host(h.model.mtp_losses(), h.stream);
  const std::vector<int32_t> tok = testing::to_host_ints(h.tokens.t, h.stream), lab = testing::to_host_ints(h.labels.t, h.stream);
  const std::vector<int32_t> mtok = testing::to_host_ints(h.mtp_tokens.t, h.stream),
                             mlab = testing::to_host_ints(h.mtp_labels.t, h.stream);
  const std::vector<float> mask = testing::to_host(h.loss_mask.t, h.stream), mmask = testing::to_host(h.mtp_mask.t, h.stream);
  const std::vector<float>& E = w.at("embedding.word_embeddings.weight");
  const std::vector<float>& W = w.at("output_layer.weight");
  auto ce = [&](const std::vector<double>& x, int32_t label) {  // over the real vocabulary
    std::vector<double> z(static_cast<size_t>(V));
    double mx = -INFINITY;
    for (int64_t v = 0; v < V; ++v) {
      double dot = 0;
      for (int64_t k = 0; k < H; ++k) dot += x[k] * W[v * H + k];
      z[v] = dot;
      mx = std::max(mx, dot);
    }
    double se = 0;
    for (double v : z) se += std::exp(v - mx);
    return mx + std::log(se) - z[label];
  };
  const double eps = c.norm_epsilon;
  std::vector<std::vector<double>> hidden(static_cast<size_t>(S * B), std::vector<double>(H));
  double ref_main = 0;
  std::vector<float> row(H);
  for (int64_t t = 0; t < S * B; ++t) {
    rms_norm_row(&E[tok[t] * H], w.at("decoder.final_layernorm.weight").data(), H, eps, hidden[t].data());
    ref_main += lw * mask[t] * ce(hidden[t], lab[t]);
  }
  EXPECT_NEAR(main_loss, ref_main, 1e-5 * ref_main);
  for (int64_t d = 0; d < D; ++d) {
    const std::string p = fmt::format("mtp.layers.{}.", d);
    const std::vector<float>& Weh = w.at(p + "eh_proj.weight");  // [h, 2h]
    double ref = 0;
    for (int64_t t = 0; t < S * B; ++t) {
      std::vector<double> cat(2 * H), x(H), y(H);
      rms_norm_row(&E[mtok[d * S * B + t] * H], w.at(p + "enorm.weight").data(), H, eps, cat.data());
      for (int64_t k = 0; k < H; ++k) row[k] = static_cast<float>(hidden[t][k]);
      rms_norm_row(row.data(), w.at(p + "hnorm.weight").data(), H, eps, cat.data() + H);
      for (int64_t r = 0; r < H; ++r)
        for (int64_t k = 0; k < 2 * H; ++k) x[r] += Weh[r * 2 * H + k] * cat[k];
      for (int64_t k = 0; k < H; ++k) row[k] = static_cast<float>(x[k]);
      rms_norm_row(row.data(), w.at(p + "final_layernorm.weight").data(), H, eps, y.data());
      hidden[t] = y;
      ref += lw * mmask[d * S * B + t] * ce(y, mlab[d * S * B + t]);
    }
    EXPECT_GT(ref, 0.5);
    EXPECT_NEAR(mtp[d], ref, 1e-5 * ref) << "depth " << d + 1;
  }
  // Evaluation forwards run no MTP (the validation loss is the LM loss) and leave the sums alone.
  h.model.forward(h.mb(), {1, 0, 0, false}, h.loss, lw, h.stream);
  EXPECT_EQ(testing::to_host(h.model.mtp_losses(), h.stream), mtp);
}

TEST(Mtp, ParameterNamesCountAndFlops) {
  TransformerConfig c = tiny_mtp_config(0.f, 2);
  const auto [n, shapes] = count_params(GPTModel::param_specs(c));
  EXPECT_EQ(n, c.num_parameters());
  EXPECT_EQ(shapes.at("mtp.layers.1.eh_proj.weight"), (std::vector<int64_t>{16, 32}));
  for (const char* name : {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.1.final_layernorm.weight",
                           "mtp.layers.1.transformer_layer.self_attention.linear_qkv.weight",
                           "mtp.layers.0.transformer_layer.mlp.linear_fc2.weight"})
    EXPECT_TRUE(shapes.count(name)) << name;
  EXPECT_FALSE(shapes.count("decoder.layers.2.self_attention.linear_qkv.weight"));
  // Megatron's num_floating_point_operations by hand: B 1, s 5, h 8, n·d 8, f 32 (GELU), V 40,
  // L 2, D 1: per token attention 8·24 + 8·5 + 8·8 = 296 per layer (3 layers with the MTP's),
  // MLP 2·8·32 per layer, MTP norms and eh_proj 3·8 + 2·64 = 152, logits 2 · 8·40.
  TransformerConfig f = tiny_config(0.f);
  f.ffn_hidden_size = 32;
  const double base = 6.0 * 5 * (2 * 296 + 2 * 2 * 8 * 32 + 8 * 40);
  EXPECT_DOUBLE_EQ(f.flops_per_iteration(1), base);
  f.mtp_num_layers = 1;
  EXPECT_DOUBLE_EQ(f.flops_per_iteration(1), 6.0 * 5 * (3 * 296 + 3 * 2 * 8 * 32 + 152 + 2 * 8 * 40));
  // an MoE last layer makes the MTP layer an MoE one: top-2 of experts of 6 (SwiGLU: 3·h·f)
  TransformerConfig m = tiny_moe_config(false);
  const double without = m.flops_per_iteration(1);
  m.mtp_num_layers = 1;
  const double h = 16, s = 5, attention = h * (16 + 2 * 8) + 16 * s + 16 * h, V = 40;
  EXPECT_NEAR(m.flops_per_iteration(1) - without,
              6 * s * (attention + 3 * h * (6 * 2) + 3 * h + 2 * h * h + h * V), 1e-6 * without);
}

TEST(Mtp, ConfigErrors) {
  auto expect_message = [](const TransformerConfig& bad, const std::string& what) {
    try {
      bad.validate();
      ADD_FAILURE() << "no error; expected '" << what << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  TransformerConfig c = tiny_mtp_config(0.f, -1);
  expect_message(c, "--mtp-num-layers must be >= 0, got -1");
  c = tiny_mtp_config(0.f, 1);
  c.mtp_loss_scaling_factor = -0.5f;
  expect_message(c, "--mtp-loss-scaling-factor must be a finite number >= 0, got -0.5");
  c = tiny_config(0.f);
  c.mtp_num_layers = 1;
  expect_message(c, "--mtp-num-layers 1 with --position-embedding-type learned_absolute is not supported");
  c = tiny_mtp_config(0.f, 1);
  c.fp8 = Fp8Format::kHybrid;
  expect_message(c, "--mtp-num-layers 1 with --fp8-format hybrid is not supported yet");
  // The last stage of an untied model declares its own copy of the word embedding for the MTP
  // tokens (shared with the first stage's over the embedding group), beside the output layer.
  c = tiny_mtp_config(0.f, 1);
  pipeline::LayerRange last;
  last.begin = 1;
  last.end = 2;
  last.has_loss = true;
  const auto names_of = [](const std::vector<ParamSpec>& specs) {
    std::vector<std::string> n;
    for (const ParamSpec& s : specs) n.push_back(s.name + (s.shared_embedding_copy ? " (copy)" : ""));
    return n;
  };
  const std::vector<std::string> untied = names_of(GPTModel::param_specs(c, 1, 0, {last}));
  EXPECT_NE(std::find(untied.begin(), untied.end(), "embedding.word_embeddings.weight (copy)"), untied.end());
  EXPECT_NE(std::find(untied.begin(), untied.end(), "output_layer.weight"), untied.end());
  c.untie_embeddings_and_output_weights = false;  // tied: the last stage's copy is the MTP embedding
  EXPECT_NO_THROW(GPTModel::param_specs(c, 1, 0, {last}));
  // A training forward without the MTP inputs.
  Harness h(tiny_mtp_config(0.f, 1), 2);
  MicroBatch mb = h.mb();
  mb.mtp_tokens = Tensor();
  try {
    h.model.forward(mb, {1, 0, 0, true}, h.loss, 1.f, h.stream);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs the micro-batch's mtp_tokens"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mt
