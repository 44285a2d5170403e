// FP8 training on 2 GPUs over NCCL (mpiexec -np 2, one rank per GPU) against one GPU (docs/fp8.md
// "Layout invariance"): TP 2 with sequence parallelism, per recipe, the same model and data on
// every rank. The amaxes of every linear layer's x, w and dy after the first step — each
// all-reduced (MAX) over the ranks holding the tensor's shards, over NCCL — and delayed scaling's
// histories and scales must be the one-GPU values up to bf16 noise; the losses and gradients
// within the noise of FP8 itself, measured: the one-GPU FP8 run against the one-GPU bf16 run.
// With --tp-comm-overlap (the sequence-parallel collectives pipelined with the FP8 GEMMs block by
// block) the losses and gradients are those of TP 2 + SP without it, bit for bit (the same GEMM
// calls; NCCL's two-rank sums are the rank-order sum). The CPU emulation checks the same layouts
// to fp32 rounding (tests/train/fp8_training_test.cpp); this test is the NCCL / cuBLASLt path of it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "comm/bootstrap.h"
#include "model/fp8/fp8_model.h"
#include "model/gpt_model.h"
#include "ops/elementwise.h"
#include "optim/grad_sync.h"
#include "testing/testing.h"
#include "train/pipeline.h"
#include "train/train_step.h"
#include "train/training_setup.h"

namespace mt {
namespace {

using testing::OwnedTensor;

constexpr int kIters = 3;

TransformerConfig config(Fp8Format format, Fp8Recipe recipe) {
  TransformerConfig c;
  c.num_layers = 4;
  c.hidden_size = 128;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.gated_linear_unit = true;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  c.seq_length = 64;
  c.vocab_size = 250;
  c.make_vocab_size_divisible_by = 64;
  c.hidden_dropout = c.attention_dropout = 0.f;
  c.fp8 = format;
  c.fp8_recipe = recipe;
  c.fp8_amax_history_len = 4;
  return c;
}

struct RunResult {
  std::vector<double> losses;
  std::vector<ParamInfo> infos;
  std::vector<std::vector<float>> grads;
  std::vector<std::vector<float>> state;  // per layer: the FP8 state after the first step (fwd, bwd)
};

RunResult train(const std::shared_ptr<Communicator>& world, TransformerConfig c, int tp, bool sp, Device dev,
                const std::vector<int32_t>& tokens, const std::vector<int32_t>& labels, int64_t mb, int M,
                bool tp_comm_overlap = false, double perturb = 0) {
  const int64_t S = c.seq_length;
  c.tp_comm_overlap = tp_comm_overlap;
  ModelSetupOptions o;
  o.model = c;
  o.parallel.tp = tp;
  o.num_microbatches = M;
  o.micro_batch_size = mb;
  o.sequence_parallel = sp;
  o.dtype = DType::kBF16;
  o.device = dev;
  o.optim.eps = 1e-5f;
  Stream st(dev);
  ModelSetup setup(world, o, st);
  GPTModel& model = setup.model();
  model.params().initialize(4321, st);
  if (perturb > 0) {  // every weight times (1 + perturb * u), u uniform in [-1, 1] (the noise reference)
    std::vector<float> w = testing::to_host(model.params().main_flat(), st);
    const auto u = testing::randu(static_cast<int64_t>(w.size()), -1.f, 1.f);
    for (size_t i = 0; i < w.size(); ++i) w[i] = float(w[i] * (1.0 + perturb * u[i]));
    testing::upload(model.params().main_flat(), w, st);
    model.params().sync_model_from_main(st);
  }
  std::vector<OwnedTensor> tok, lab;
  std::vector<MicroBatch> mbs;
  for (int m = 0; m < M; ++m) {
    std::vector<int32_t> t(tokens.begin() + m * S * mb, tokens.begin() + (m + 1) * S * mb);
    std::vector<int32_t> l(labels.begin() + m * S * mb, labels.begin() + (m + 1) * S * mb);
    tok.push_back(testing::make_int_tensor(t, dev, {S, mb}, st));
    lab.push_back(testing::make_int_tensor(l, dev, {S, mb}, st));
  }
  for (int m = 0; m < M; ++m) {
    MicroBatch b{tok[m].t, lab[m].t, Tensor()};
    b.loss_weight = 1.0f / static_cast<float>(S * mb * M);
    mbs.push_back(b);
  }
  OwnedTensor loss(DType::kF32, dev, {1});
  RunResult r;
  for (int it = 0; it < kIters; ++it) {
    fill(loss, 0.f, st);
    train_step(model, setup.executor(), setup.train_plan(), setup.optimizer(), mbs, {99, it, 1e-3f, 0, 1}, loss, st);
    r.losses.push_back(testing::to_host(loss, st)[0]);
    if (it == 0 && model.fp8()) {
      for (int64_t l = 0; l < c.num_layers; ++l) {
        const auto [f, b] = model.fp8()->layer_state(l, st);
        std::vector<float> v = testing::to_host(f, st), w = testing::to_host(b, st);
        v.insert(v.end(), w.begin(), w.end());
        r.state.push_back(std::move(v));
      }
    }
  }
  const ParamStore& P = model.params();
  for (size_t i = 0; i < P.size(); ++i) {
    r.infos.push_back(P.info(i));
    r.grads.push_back(testing::to_host(P.grad(i), st));
  }
  return r;
}

/// The largest element-wise relative difference of two runs' FP8 states (same sizes).
double state_rel(const RunResult& a, const RunResult& r) {
  double d = 0;
  for (size_t l = 0; l < r.state.size(); ++l)
    for (size_t i = 0; i < r.state[l].size(); ++i) {
      const double m = std::max(std::fabs(double(r.state[l][i])), std::fabs(double(a.state[l][i])));
      if (m > 0) d = std::max(d, std::fabs(double(a.state[l][i]) - r.state[l][i]) / m);
    }
  return d;
}

TEST(Fp8LayoutsNccl, TensorParallelMatchesOneGpu) {
  MT_REQUIRE_CUDA();
  const LaunchEnv env = read_launch_env();
  if (env.world_size != 2 || env.launcher != LaunchEnv::kMpirun) GTEST_SKIP() << "run under mpiexec -np 2";
  int gpus = 0;
  cudaGetDeviceCount(&gpus);
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  const Device dev = local_device(DeviceType::kCUDA, env);
  set_current_device(dev);
  auto world = init_world(dev, env, 5.0);
  const int64_t mb = 2;
  const int M = 4;
  const int64_t S = config(Fp8Format::kE4M3, Fp8Recipe::kTensorwise).seq_length;
  std::vector<int32_t> tokens = testing::randint(M * mb * S, 0, 250), labels = testing::randint(M * mb * S, 0, 250);
  MPI_Bcast(tokens.data(), static_cast<int>(tokens.size()), MPI_INT32_T, 0, MPI_COMM_WORLD);
  MPI_Bcast(labels.data(), static_cast<int>(labels.size()), MPI_INT32_T, 0, MPI_COMM_WORLD);
  const auto one = std::make_shared<SingleRankCommunicator>("one");
  const RunResult bf16 = train(one, config(Fp8Format::kNone, Fp8Recipe::kDelayed), 1, false, dev, tokens, labels, mb, M);
  for (const auto& [format, recipe] : {std::pair{Fp8Format::kE4M3, Fp8Recipe::kTensorwise},
                                       {Fp8Format::kHybrid, Fp8Recipe::kDelayed},
                                       {Fp8Format::kE4M3, Fp8Recipe::kBlockwise}}) {
    const TransformerConfig c = config(format, recipe);
    const std::string name = std::string(fp8_format_name(format)) + " " + fp8_recipe_name(recipe);
    const RunResult ref = train(one, c, 1, false, dev, tokens, labels, mb, M);
    std::vector<float> all16, all8;
    for (size_t j = 0; j < ref.grads.size(); ++j) {
      all8.insert(all8.end(), ref.grads[j].begin(), ref.grads[j].end());
      all16.insert(all16.end(), bf16.grads[j].begin(), bf16.grads[j].end());
    }
    const double noise = testing::rel_err(all8, all16);  // FP8 itself, one GPU
    // The FP8 state's noise: one GPU again with every weight perturbed by half a bf16 ulp. FP8 is
    // chaotic (an element on the neighbouring FP8 code perturbs a row of the next GEMM, which moves
    // more elements across rounding boundaries), so the amaxes after a step differ by a few per cent
    // between runs whose inputs differ by bf16 rounding (measured on H200 ×2, 2026-11-28: hybrid
    // delayed TP 2 against one GPU 4.0e-2); a wrong amax reduction or scale is off by O(1).
    const RunResult ref2 = train(one, c, 1, false, dev, tokens, labels, mb, M, false, std::ldexp(1.0, -9));
    const double state_noise = state_rel(ref2, ref);
    std::map<std::string, size_t> ref_index;
    for (size_t i = 0; i < ref.infos.size(); ++i) ref_index[ref.infos[i].name] = i;
    for (const bool sp : {false, true}) {
      const RunResult par = train(world, c, 2, sp, dev, tokens, labels, mb, M);
      if (sp) {  // --tp-comm-overlap: bitwise the plain TP 2 + SP run
        const RunResult over = train(world, c, 2, sp, dev, tokens, labels, mb, M, /*tp_comm_overlap=*/true);
        EXPECT_EQ(over.losses, par.losses) << name << " tp2 sp --tp-comm-overlap";
        ASSERT_EQ(over.grads.size(), par.grads.size());
        for (size_t i = 0; i < par.grads.size(); ++i)
          EXPECT_EQ(over.grads[i], par.grads[i]) << name << " --tp-comm-overlap gradient " << par.infos[i].name;
      }
      const std::string what = name + (sp ? " tp2 sp" : " tp2");
      for (int it = 0; it < kIters; ++it)
        EXPECT_NEAR(par.losses[it], ref.losses[it], 5e-3 * ref.losses[it]) << what << " iteration " << it;
      std::vector<float> pg, rg;
      for (size_t i = 0; i < par.infos.size(); ++i) {
        const size_t j = ref_index.at(par.infos[i].name);
        const auto r = testing::shard_slice(ref.grads[j], par.infos[i]);
        pg.insert(pg.end(), par.grads[i].begin(), par.grads[i].end());
        rg.insert(rg.end(), r.begin(), r.end());
      }
      const double eg = testing::rel_err(pg, rg);
      ASSERT_EQ(par.state.size(), ref.state.size()) << what;
      for (size_t l = 0; l < ref.state.size(); ++l)
        ASSERT_EQ(par.state[l].size(), ref.state[l].size()) << what << " layer " << l;
      const double es = state_rel(par, ref);
      std::printf("[%s] rank %d: loss %.6f vs %.6f, gradients rel %.2e (FP8 vs bf16 on one GPU %.2e), FP8 state max "
                  "rel %.2e (noise %.2e)\n",
                  what.c_str(), world->rank(), par.losses.back(), ref.losses.back(), eg, noise, es, state_noise);
      EXPECT_LT(eg, std::max(3e-2, 2 * noise)) << what << " gradients";
      if (recipe != Fp8Recipe::kBlockwise) EXPECT_LT(es, std::max(3e-2, 3 * state_noise)) << what << " FP8 state";
    }
  }
}

}  // namespace
}  // namespace mt
