// Whole model, CUDA against CPU: same weights, same batch; loss and every gradient.
#include <gtest/gtest.h>

#include "model/gpt_model.h"
#include "ops/elementwise.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;

/// llama: the Llama-style layer (GQA 4/2, RoPE, SwiGLU, RMSNorm, untied, no bias); flash: the GPU
/// model uses FlashAttention (head dim 64: the tensor-core kernels for bf16), the CPU one the
/// local attention.
void compare(DType dtype, float dropout, double tol, bool documents = false, bool llama = false, bool flash = false) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = flash ? 256 : 64;
  c.num_attention_heads = 4;
  if (llama) {
    c.num_query_groups = 2;
    c.gated_linear_unit = true;
    c.normalization = Normalization::kRMSNorm;
    c.position_embedding_type = PositionEmbeddingType::kRope;
    c.untie_embeddings_and_output_weights = true;
    c.add_bias_linear = false;
  }
  c.seq_length = 32;
  c.vocab_size = 500;
  c.make_vocab_size_divisible_by = 64;
  c.hidden_dropout = dropout;
  c.attention_dropout = dropout;
  const int64_t b = 3;
  Stream cs(Device::cpu()), gs(Device::cuda(0));
  TransformerConfig cc = c, gc = c;
  cc.attention_backend = AttentionBackend::kLocal;
  gc.attention_backend = flash ? AttentionBackend::kFlash : AttentionBackend::kLocal;
  GPTModel cpu(cc, b, DType::kF32, Device::cpu(), ProcessGroups::single());
  GPTModel gpu(gc, b, dtype, Device::cuda(0), ProcessGroups::single());
  ASSERT_STREQ(gpu.attention_backend(), flash ? "flash" : "local");
  cpu.params().initialize(testing::test_seed(), cs);
  // Same weights: the GPU model's fp32 main params are the CPU's (rounded through the dtype so
  // both sides compute with identical weights).
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
  // Optional documents: position ids restart and attention stays inside a document after
  // position 9, and the loss of position 0 is masked.
  std::vector<int32_t> pos(c.seq_length * b), ds(b * c.seq_length);
  std::vector<float> mask(c.seq_length * b, 1.f);
  for (int64_t j = 0; j < b; ++j) {
    for (int64_t i = 0; i < c.seq_length; ++i) {
      const int64_t start = i < 10 ? 0 : 10;
      pos[i * b + j] = static_cast<int32_t>(i - start);
      ds[j * c.seq_length + i] = static_cast<int32_t>(start);
    }
    mask[j] = 0.f;
  }
  OwnedTensor cp = testing::make_int_tensor(pos, Device::cpu(), {c.seq_length, b}, cs);
  OwnedTensor gp = testing::make_int_tensor(pos, Device::cuda(0), {c.seq_length, b}, gs);
  OwnedTensor cd = testing::make_int_tensor(ds, Device::cpu(), {b, c.seq_length}, cs);
  OwnedTensor gd = testing::make_int_tensor(ds, Device::cuda(0), {b, c.seq_length}, gs);
  OwnedTensor cm = testing::make_tensor(mask, DType::kF32, Device::cpu(), {c.seq_length, b}, cs);
  OwnedTensor gm = testing::make_tensor(mask, DType::kF32, Device::cuda(0), {c.seq_length, b}, gs);
  MicroBatch cmb{ct.t, cl.t, Tensor()}, gmb{gt.t, gl.t, Tensor()};
  if (documents) {
    cmb = {ct.t, cl.t, cm.t, cp.t, cd.t};
    gmb = {gt.t, gl.t, gm.t, gp.t, gd.t};
  }
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
  for (size_t i = 0; i < cpu.params().size(); ++i) {
    auto a = testing::to_host(gpu.params().grad(i), gs);
    auto r = testing::to_host(cpu.params().grad(i), cs);
    EXPECT_LT(testing::rel_err(a, r), tol) << cpu.params().info(i).name;
  }
}

TEST(GptCuda, Fp32MatchesCpu) {
  MT_REQUIRE_CUDA();
  compare(DType::kF32, 0.f, 1e-5);
}
TEST(GptCuda, Fp32WithDropoutMatchesCpu) {
  MT_REQUIRE_CUDA();
  compare(DType::kF32, 0.1f, 1e-5);
}
TEST(GptCuda, Fp32WithDocumentsMatchesCpu) {
  MT_REQUIRE_CUDA();
  compare(DType::kF32, 0.1f, 1e-5, /*documents=*/true);
}
TEST(GptCuda, Bf16MatchesCpu) {
  MT_REQUIRE_CUDA();
  compare(DType::kBF16, 0.1f, 2e-2);
}
TEST(GptCuda, LlamaMatchesCpu) {
  MT_REQUIRE_CUDA();
  compare(DType::kF32, 0.1f, 1e-5, /*documents=*/true, /*llama=*/true);
  compare(DType::kBF16, 0.1f, 2e-2, /*documents=*/true, /*llama=*/true);
}
TEST(GptCuda, FlashAttentionMatchesCpu) {
  MT_REQUIRE_CUDA();
  compare(DType::kF32, 0.1f, 1e-5, /*documents=*/true, /*llama=*/false, /*flash=*/true);
  compare(DType::kBF16, 0.1f, 2e-2, /*documents=*/true, /*llama=*/false, /*flash=*/true);
  compare(DType::kBF16, 0.1f, 2e-2, /*documents=*/true, /*llama=*/true, /*flash=*/true);
}

}  // namespace
}  // namespace mt
