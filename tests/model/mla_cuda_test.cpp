// Multi-latent attention, CUDA against CPU (docs/mla.md): the ops of ops/mla.h and the YaRN
// rotation in fp32 (bitwise: copies and the same fp32 expressions) and bf16, the packing copies
// bitwise at every access width of their kernels (ragged token counts, several head counts and
// head dims, a misaligned input), and a whole MLA model
// (query latent, YaRN, padded value heads; dropout) with the local and the flash core attention:
// loss and every gradient; greedy generation with the latent cache on the GPU equals generation
// without a cache and the CPU's tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include <fmt/format.h>

#include "model/gpt_model.h"
#include "ops/cuda/cudnn_attention.h"
#include "ops/cuda/mla_widths.h"
#include "ops/elementwise.h"
#include "ops/mla.h"
#include "ops/rope.h"
#include "testing/testing.h"
#include "train/inference.h"

namespace mt {
namespace {

using testing::OwnedTensor;

OwnedTensor on(const std::vector<float>& v, DType t, Device d, const std::vector<int64_t>& shape) {
  return testing::make_tensor(v, t, d, shape, d.is_cpu() ? testing::cpu_stream() : testing::cuda_stream());
}

TEST(MlaCuda, OpsMatchCpu) {
  MT_REQUIRE_CUDA();
  const Stream &cs = testing::cpu_stream(), &gs = testing::cuda_stream();
  const int64_t s = 5, b = 3, n = 4, dn = 6, dr = 4, dv = 5, D = 10, S = 8, B = 4, r = 7;
  const std::vector<float> q = testing::randn(s * b * n * (dn + dr)), kv = testing::randn(s * b * n * (dn + dv)),
                           kpe = testing::randn(s * b * dr), g = testing::randn(s * b * n * 3 * D),
                           ckv = testing::randn(s * b * r), up = testing::randn(S * B * n * (dn + dv));
  for (DType t : {DType::kF32, DType::kBF16}) {
    const double tol = t == DType::kF32 ? 0 : 1e-2;  // copies are exact; bf16: the head sum and RoPE round once
    // pack + RoPE (YaRN), on the GPU in t, on the CPU in fp32 from the same rounded inputs
    auto rt = [&](const std::vector<float>& v) { return testing::rounded(v, t); };
    OwnedTensor cq = on(rt(q), DType::kF32, Device::cpu(), {s * b, n, dn + dr}),
                gq = on(q, t, Device::cuda(0), {s * b, n, dn + dr});
    OwnedTensor ckv_t = on(rt(kv), DType::kF32, Device::cpu(), {s * b, n, dn + dv}),
                gkv_t = on(kv, t, Device::cuda(0), {s * b, n, dn + dv});
    OwnedTensor ck = on(rt(kpe), DType::kF32, Device::cpu(), {s * b, dr}), gk = on(kpe, t, Device::cuda(0), {s * b, dr});
    OwnedTensor cqkv(DType::kF32, Device::cpu(), {s, b, n, 3, D}), gqkv(t, Device::cuda(0), {s, b, n, 3, D});
    testing::poison(gqkv, gs);
    mla_qkv_pack(cqkv.t.view({s * b, n, 3, D}), cq, ckv_t, ck, cs);
    mla_qkv_pack(gqkv.t.view({s * b, n, 3, D}), gq, gkv_t, gk, gs);
    RopeConfig rc;
    rc.rotary_dim = dr;
    rc.interleaved = true;
    rc.yarn.on = true;
    rc.yarn.factor = 4;
    rc.yarn.original_max_positions = 2;
    rc.yarn.beta_fast = 4;
    rc.yarn.mscale_all_dim = 0.3;
    rope_forward(cqkv, Tensor(), rc, cs);
    rope_forward(gqkv, Tensor(), rc, gs);
    EXPECT_LE(testing::rel_err(testing::to_host(gqkv, gs), testing::to_host(cqkv, cs)), tol + 1e-6) << "pack + rope";
    // the backward pieces
    OwnedTensor cg = on(rt(g), DType::kF32, Device::cpu(), {s * b, n, 3, D}), gg = on(g, t, Device::cuda(0), {s * b, n, 3, D});
    mla_qkv_unpack_grad(cq, ckv_t, ck, cg, cs);
    testing::poison(gq, gs);
    testing::poison(gk, gs);
    mla_qkv_unpack_grad(gq, gkv_t, gk, gg, gs);
    EXPECT_LE(testing::rel_err(testing::to_host(gq, gs), testing::to_host(cq, cs)), tol) << "dq";
    EXPECT_LE(testing::rel_err(testing::to_host(gkv_t, gs), testing::to_host(ckv_t, cs)), tol) << "dkv";
    EXPECT_LE(testing::rel_err(testing::to_host(gk, gs), testing::to_host(ck, cs)), tol + 1e-6) << "dk_pe";
    // context unpack (the first d_v channels of each head)
    const std::vector<float> ctx(g.begin(), g.begin() + s * b * n * D);
    OwnedTensor cctx = on(rt(ctx), DType::kF32, Device::cpu(), {s * b, n * D}), gctx = on(ctx, t, Device::cuda(0), {s * b, n * D});
    OwnedTensor co(DType::kF32, Device::cpu(), {s * b, n * dv}), go(t, Device::cuda(0), {s * b, n * dv});
    mla_context_unpack(co, cctx, n, false, cs);
    mla_context_unpack(go, gctx, n, false, gs);
    EXPECT_LE(testing::rel_err(testing::to_host(go, gs), testing::to_host(co, cs)), tol + 1e-6) << "context";
    mla_context_unpack(co, cctx, n, true, cs);
    mla_context_unpack(go, gctx, n, true, gs);
    EXPECT_LE(testing::rel_err(testing::to_host(gctx, gs), testing::to_host(cctx, cs)), tol + 1e-6) << "padded";
    // latent append / expand
    OwnedTensor cc = on(rt(ckv), DType::kF32, Device::cpu(), {s, b, r}), gc = on(ckv, t, Device::cuda(0), {s, b, r});
    OwnedTensor ccache(DType::kF32, Device::cpu(), {S, B, r}), gcache(t, Device::cuda(0), {S, B, r});
    OwnedTensor cpe(DType::kF32, Device::cpu(), {S, B, dr}), gpe(t, Device::cuda(0), {S, B, dr});
    fill(ccache, 0.f, cs);
    fill(gcache, 0.f, gs);
    fill(cpe, 0.f, cs);
    fill(gpe, 0.f, gs);
    mla_latent_append(ccache, cpe, cc, cqkv, 2, cs);
    mla_latent_append(gcache, gpe, gc, gqkv, 2, gs);
    EXPECT_LE(testing::rel_err(testing::to_host(gcache, gs), testing::to_host(ccache, cs)), tol) << "c_kv cache";
    EXPECT_LE(testing::rel_err(testing::to_host(gpe, gs), testing::to_host(cpe, cs)), tol + 1e-6) << "k_pe cache";
    OwnedTensor cu = on(rt(up), DType::kF32, Device::cpu(), {S, B, n, dn + dv}), gu = on(up, t, Device::cuda(0), {S, B, n, dn + dv});
    OwnedTensor ckey(DType::kF32, Device::cpu(), {b, n, S, D}), cval(DType::kF32, Device::cpu(), {b, n, S, D});
    OwnedTensor gkey(t, Device::cuda(0), {b, n, S, D}), gval(t, Device::cuda(0), {b, n, S, D});
    for (auto* x : {&ckey, &cval}) fill(*x, 0.f, cs);
    for (auto* x : {&gkey, &gval}) fill(*x, 0.f, gs);
    mla_latent_expand(ckey, cval, cu, cpe, 7, dn, cs);
    mla_latent_expand(gkey, gval, gu, gpe, 7, dn, gs);
    EXPECT_LE(testing::rel_err(testing::to_host(gkey, gs), testing::to_host(ckey, cs)), tol + 1e-6) << "keys";
    EXPECT_LE(testing::rel_err(testing::to_host(gval, gs), testing::to_host(cval, cs)), tol) << "values";
  }
}

/// `host` as a [shape] tensor of `t` on the GPU, starting one element past an allocation (so off
/// 16-byte alignment) when `shifted`; the view is returned, `own` keeps the memory.
Tensor gpu_view(OwnedTensor& own, const std::vector<float>& host, DType t, const std::vector<int64_t>& shape,
                bool shifted) {
  std::vector<float> h = host;
  if (shifted) h.insert(h.begin(), 0.f);
  own = on(h, t, Device::cuda(0), {static_cast<int64_t>(h.size())});
  return own.t.slice0(shifted ? 1 : 0, static_cast<int64_t>(h.size())).view(shape);
}

/// mla_qkv_pack, mla_qkv_unpack_grad and mla_context_unpack (both directions) bitwise against the
/// CPU reference on the same rounded inputs (copies are exact; dk_pe's fp32 head sum, in head
/// order, rounds once on both), through the ops and at every access width of the kernels
/// (ops/cuda/mla_widths.h: 16, 8, 4, 2 bytes), outputs poisoned before each call: ragged token
/// counts, 1 to 16 heads, DeepSeek-V3's head dims (16-byte words in bf16), dims that allow only
/// 8-byte words or single elements, d_v > d_n + d_r, and a query one element off alignment.
TEST(MlaCuda, PackBitwiseMatchesCpu) {
  MT_REQUIRE_CUDA();
  const Stream &cs = testing::cpu_stream(), &gs = testing::cuda_stream();
  struct Case {
    int64_t T, n, dn, dr, dv, D;
    bool shifted;  // q one element past 16-byte alignment
  };
  const Case cases[] = {{37, 16, 128, 64, 128, 192, false}, {37, 3, 128, 64, 128, 192, true},
                        {5, 1, 24, 8, 16, 32, false},       {11, 4, 12, 4, 8, 16, false},
                        {13, 2, 6, 4, 5, 10, false},        {9, 5, 8, 8, 24, 24, false}};
  for (const Case& k : cases) {
    const int64_t T = k.T, n = k.n, dq_w = k.dn + k.dr, dkv_w = k.dn + k.dv, D = k.D;
    const std::vector<float> q = testing::randn(T * n * dq_w), kv = testing::randn(T * n * dkv_w),
                             kpe = testing::randn(T * k.dr), g = testing::randn(T * n * 3 * D),
                             ctx = testing::randn(T * n * D), out = testing::randn(T * n * k.dv);
    for (DType t : {DType::kBF16, DType::kF32}) {
      auto cpu = [&](const std::vector<float>& v, const std::vector<int64_t>& shape) {
        return on(testing::rounded(v, t), DType::kF32, Device::cpu(), shape);
      };
      // the CPU reference, its results rounded to t (exact: they are values t holds, or dk_pe's sum)
      OwnedTensor cq = cpu(q, {T, n, dq_w}), ckv = cpu(kv, {T, n, dkv_w}), ck = cpu(kpe, {T, k.dr});
      OwnedTensor cg = cpu(g, {T, n, 3, D}), cctx = cpu(ctx, {T, n * D}), cout = cpu(out, {T, n * k.dv});
      OwnedTensor cqkv(DType::kF32, Device::cpu(), {T, n, 3, D}), cdq(DType::kF32, Device::cpu(), {T, n, dq_w}),
          cdkv(DType::kF32, Device::cpu(), {T, n, dkv_w}), cdk(DType::kF32, Device::cpu(), {T, k.dr}),
          cpad(DType::kF32, Device::cpu(), {T, n * D}), cunpad(DType::kF32, Device::cpu(), {T, n * k.dv});
      mla_qkv_pack(cqkv, cq, ckv, ck, cs);
      mla_qkv_unpack_grad(cdq, cdkv, cdk, cg, cs);
      mla_context_unpack(cunpad, cctx, n, false, cs);
      mla_context_unpack(cout, cpad, n, true, cs);
      auto want = [&](const Tensor& x) { return testing::rounded(testing::to_host(x, cs), t); };
      const std::vector<float> w_qkv = want(cqkv), w_dq = want(cdq), w_dkv = want(cdkv), w_dk = want(cdk),
                               w_pad = want(cpad), w_unpad = want(cunpad);
      OwnedTensor own_q, own_kv, own_k, own_g, own_ctx, own_out;
      const Tensor gq = gpu_view(own_q, q, t, {T, n, dq_w}, k.shifted),
                   gkv = gpu_view(own_kv, kv, t, {T, n, dkv_w}, false),
                   gk = gpu_view(own_k, kpe, t, {T, k.dr}, false), gg = gpu_view(own_g, g, t, {T, n, 3, D}, false),
                   gctx = gpu_view(own_ctx, ctx, t, {T, n * D}, false),
                   gout = gpu_view(own_out, out, t, {T, n * k.dv}, false);
      OwnedTensor gqkv(t, Device::cuda(0), {T, n, 3, D}), gdq(t, Device::cuda(0), {T, n, dq_w}),
          gdkv(t, Device::cuda(0), {T, n, dkv_w}), gdk(t, Device::cuda(0), {T, k.dr}),
          gpad(t, Device::cuda(0), {T, n * D}), gunpad(t, Device::cuda(0), {T, n * k.dv});
      for (int width : {0, 16, 8, 4, 2}) {  // 0: the ops of ops/mla.h
        const std::string what = fmt::format("T {} n {} d_n {} d_r {} d_v {} D {}{} {} width {}", T, n, k.dn, k.dr,
                                             k.dv, D, k.shifted ? " (q misaligned)" : "", dtype_name(t), width);
        for (const Tensor* x : {&gqkv.t, &gdq.t, &gdkv.t, &gdk.t, &gpad.t, &gunpad.t}) testing::poison(*x, gs);
        if (width == 0) {
          mla_qkv_pack(gqkv, gq, gkv, gk, gs);
          mla_qkv_unpack_grad(gdq, gdkv, gdk, gg, gs);
          mla_context_unpack(gunpad, gctx, n, false, gs);
          mla_context_unpack(gout, gpad, n, true, gs);
        } else {
          cuda::mla_qkv_pack(gqkv, gq, gkv, gk, gs, width);
          cuda::mla_qkv_unpack_grad(gdq, gdkv, gdk, gg, gs, width);
          cuda::mla_context_unpack(gunpad, gctx, n, false, gs, width);
          cuda::mla_context_unpack(gout, gpad, n, true, gs, width);
        }
        EXPECT_TRUE(testing::same_bits(testing::to_host(gqkv, gs), w_qkv)) << "qkv, " << what;
        EXPECT_TRUE(testing::same_bits(testing::to_host(gdq, gs), w_dq)) << "dq, " << what;
        EXPECT_TRUE(testing::same_bits(testing::to_host(gdkv, gs), w_dkv)) << "dkv, " << what;
        EXPECT_TRUE(testing::same_bits(testing::to_host(gdk, gs), w_dk)) << "dk_pe, " << what;
        EXPECT_TRUE(testing::same_bits(testing::to_host(gunpad, gs), w_unpad)) << "context, " << what;
        EXPECT_TRUE(testing::same_bits(testing::to_host(gpad, gs), w_pad)) << "padded context, " << what;
      }
    }
  }
}

/// The Llama-style layer (SwiGLU, RMSNorm, RoPE, untied, no biases) with MLA: query latent 12,
/// kv latent 8, d_n 6, d_r 4, d_v 5 (value heads padded), YaRN x4 beyond 8 original positions.
TransformerConfig tiny_mla(int64_t layers, int64_t hidden, int64_t ffn, int64_t seq, int64_t vocab, int64_t divisible) {
  TransformerConfig c;
  c.num_layers = layers;
  c.hidden_size = hidden;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = ffn;
  c.gated_linear_unit = true;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  c.seq_length = seq;
  c.vocab_size = vocab;
  c.make_vocab_size_divisible_by = divisible;
  c.multi_latent_attention = true;
  c.q_lora_rank = 12;
  c.kv_lora_rank = 8;
  c.qk_head_dim = 6;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 5;
  c.rotary_scaling_factor = 4.f;
  c.original_max_position_embeddings = 8;
  return c;
}

/// A two-layer MLA model on the GPU (dtype, core attention `backend`) against the CPU model (fp32,
/// local attention) with the same (rounded) weights and batch: loss and every gradient. deepseek:
/// DeepSeek-V3's head dims (d_n 128, d_r 64, d_v 128: D = 192).
void compare(DType dtype, AttentionBackend backend, double tol, float dropout, bool deepseek = false) {
  TransformerConfig c = tiny_mla(2, 64, 0, 32, 500, 64);  // SwiGLU default ffn: int(8·64/3 / 64)·64 = 128
  c.q_lora_rank = 24;
  c.kv_lora_rank = 16;
  c.qk_head_dim = deepseek ? 128 : 24;
  c.qk_pos_emb_head_dim = deepseek ? 64 : 8;
  c.v_head_dim = deepseek ? 128 : 16;  // D = 32 (192): the value heads padded
  c.mscale_all_dim = 0.7f;
  c.hidden_dropout = c.attention_dropout = dropout;
  const int64_t b = 3;
  Stream cs(Device::cpu()), gs(Device::cuda(0));
  TransformerConfig cc = c, gc = c;
  cc.attention_backend = AttentionBackend::kLocal;
  gc.attention_backend = backend;
  GPTModel cpu(cc, b, DType::kF32, Device::cpu(), ProcessGroups::single());
  GPTModel gpu(gc, b, dtype, Device::cuda(0), ProcessGroups::single());
  cpu.params().initialize(testing::test_seed(), cs);
  std::vector<float> w = testing::to_host(cpu.params().main_flat(), cs);
  for (auto& x : w) x = round_through(dtype, x);
  testing::upload(cpu.params().main_flat(), w, cs);
  testing::upload(gpu.params().main_flat(), w, gs);
  gpu.params().sync_model_from_main(gs);
  auto tok = testing::randint(c.seq_length * b, 0, 500), lab = testing::randint(c.seq_length * b, 0, 500);
  OwnedTensor ct = testing::make_int_tensor(tok, Device::cpu(), {c.seq_length, b}, cs);
  OwnedTensor cl = testing::make_int_tensor(lab, Device::cpu(), {c.seq_length, b}, cs);
  OwnedTensor gt = testing::make_int_tensor(tok, Device::cuda(0), {c.seq_length, b}, gs);
  OwnedTensor gl = testing::make_int_tensor(lab, Device::cuda(0), {c.seq_length, b}, gs);
  MicroBatch cmb{ct.t, cl.t, Tensor()}, gmb{gt.t, gl.t, Tensor()};
  OwnedTensor closs(DType::kF32, Device::cpu(), {1}), gloss(DType::kF32, Device::cuda(0), {1});
  fill(closs, 0.f, cs);
  fill(gloss, 0.f, gs);
  const DropoutContext dc{7, 11, 2, true};
  const float wgt = 1.0f / (c.seq_length * b);
  cpu.params().zero_grads(cs);
  gpu.params().zero_grads(gs);
  cpu.forward(cmb, dc, closs, wgt, cs);
  gpu.forward(gmb, dc, gloss, wgt, gs);
  cpu.backward(cmb, dc, wgt, Tensor(), cs);
  gpu.backward(gmb, dc, wgt, Tensor(), gs);
  const double lc = testing::to_host(closs, cs)[0], lg = testing::to_host(gloss, gs)[0];
  EXPECT_NEAR(lg, lc, tol * std::fabs(lc)) << "loss";
  for (size_t i = 0; i < cpu.params().size(); ++i)
    EXPECT_LT(testing::rel_err(testing::to_host(gpu.params().grad(i), gs), testing::to_host(cpu.params().grad(i), cs)),
              tol)
        << cpu.params().info(i).name;
}

TEST(MlaCuda, Fp32LocalMatchesCpu) {
  MT_REQUIRE_CUDA();
  compare(DType::kF32, AttentionBackend::kLocal, 1e-5, 0.1f);
}
TEST(MlaCuda, Fp32FlashMatchesCpu) {
  MT_REQUIRE_CUDA();
  compare(DType::kF32, AttentionBackend::kFlash, 1e-5, 0.f);
}
TEST(MlaCuda, Bf16LocalMatchesCpu) {
  MT_REQUIRE_CUDA();
  compare(DType::kBF16, AttentionBackend::kLocal, 3e-2, 0.f);
}
TEST(MlaCuda, Bf16FlashMatchesCpu) {
  MT_REQUIRE_CUDA();
  compare(DType::kBF16, AttentionBackend::kFlash, 3e-2, 0.f);
}
/// --attention-backend fused: cuDNN with FlashAttentionConfig::v_head_dim = d_v (P·V on the real
/// value channels only; DeepSeek-V3's d_qk 192 / d_v 128 on Hopper), or the fallback kernels where
/// no cuDNN engine takes the shape; either way the CPU's loss and gradients. Prints which ran.
TEST(MlaCuda, Bf16FusedMatchesCpu) {
  MT_REQUIRE_CUDA();
  for (bool deepseek : {false, true}) {
    const int64_t before = cuda::cudnn_attention_executions();
    compare(DType::kBF16, AttentionBackend::kFused, 3e-2, 0.f, deepseek);
    std::printf("[MlaCuda.Bf16FusedMatchesCpu] D=%d d_v=%d: %lld cuDNN executions (4 = cuDNN forward and backward "
                "in both layers)\n", deepseek ? 192 : 32, deepseek ? 128 : 16,
                static_cast<long long>(cuda::cudnn_attention_executions() - before));
  }
}

TEST(MlaCuda, LatentCacheGenerationMatchesRecomputationAndCpu) {
  MT_REQUIRE_CUDA();
  TransformerConfig c = tiny_mla(3, 32, 48, 24, 61, 8);
  c.hidden_dropout = c.attention_dropout = 0.f;
  c.init_method_std = 0.3f;
  const std::vector<std::vector<int32_t>> prompts = {{3, 14, 15, 9, 2, 6}, {5}, {35, 8, 9, 7}};
  std::vector<float> weights;  // the CPU model's, uploaded to the GPU model
  {
    GPTModel cpu(c, 1, DType::kF32, Device::cpu(), ProcessGroups::single());
    cpu.params().initialize(99, testing::cpu_stream());
    weights = testing::to_host(cpu.params().main_flat(), testing::cpu_stream());
  }
  auto run = [&](Device d, bool cache) {
    Stream st(d);
    GPTModel model(c, 1, DType::kF32, d, ProcessGroups::single());
    testing::upload(model.params().main_flat(), weights, st);
    model.params().sync_model_from_main(st);
    TextGenerator gen(model, 3, c.seq_length, st);
    GenerationOptions o;
    o.max_new_tokens = 12;
    o.sampling.greedy = true;
    o.use_cache = cache;
    return gen.generate(prompts, o).tokens;
  };
  const auto gpu_cached = run(Device::cuda(0), true);
  EXPECT_EQ(gpu_cached, run(Device::cuda(0), false));
  EXPECT_EQ(gpu_cached, run(Device::cpu(), true));
}

}  // namespace
}  // namespace mt
