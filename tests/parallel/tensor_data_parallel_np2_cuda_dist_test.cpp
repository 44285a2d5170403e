// N GPUs produce what 1 GPU produces, in bf16 over NCCL (2 ranks under mpiexec, one per GPU):
// TP 2, TP 2 + sequence parallelism and DP 2 against a single-GPU run of the same model and data
// computed on each rank. Every rank compares its own shards with the matching slices of the
// reference. Tolerance: bf16 activations round to 2^-8 relative and the TP/DP layouts sum in a
// different order, so gradients agree to ~1e-2 relative (the op-level bf16 bound, 2e-2) and the
// loss to ~2e-3; a missing reduction or a wrong shard is off by O(1). Weight matrices are compared
// per tensor; biases and norm parameters (sums over tokens with cancellation; the key bias has an
// exactly-zero gradient) only within the global vector of all gradients / parameters.
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <mpi.h>

#include "comm/bootstrap.h"
#include "model/gpt.h"
#include "ops/elementwise.h"
#include "parallel/process_groups.h"
#include "testing/testing.h"
#include "train/train_step.h"

namespace mt {
namespace {

using testing::OwnedTensor;

constexpr int kIters = 2;

struct RunResult {
  std::vector<double> losses;
  std::vector<std::vector<float>> grads, params;  // local shards, in ParamStore order
  std::vector<ParamInfo> infos;
};

GptConfig config() {
  GptConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.seq_length = 32;
  c.vocab_size = 256;  // padded to 256 for TP 1 and 2 with divisible-by 64
  c.make_vocab_size_divisible_by = 64;
  c.hidden_dropout = 0.1f;
  c.attention_dropout = 0.1f;
  return c;
}

RunResult train(const ProcessGroups& g, bool sp, Device dev, const std::vector<int32_t>& tokens,
          const std::vector<int32_t>& labels, int64_t mb, int64_t num_micro_total) {
  const GptConfig c = config();
  const int64_t S = c.seq_length;
  const int dp = g.dp->size(), d = g.dp->rank();
  const int64_t M = num_micro_total / dp;
  Stream st(dev);
  GptModel model(c, mb, DType::kBF16, dev, g, sp, dp);
  model.params().initialize(4321, st);
  OptimizerConfig oc;
  oc.eps = 1e-5f;
  AdamWOptimizer opt(model.params(), oc, st, {g.dp, g.mp, g.tp->rank()});
  std::vector<OwnedTensor> tok, lab;
  std::vector<MicroBatch> mbs;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t gm = m * dp + d;
    std::vector<int32_t> t(tokens.begin() + gm * S * mb, tokens.begin() + (gm + 1) * S * mb);
    std::vector<int32_t> l(labels.begin() + gm * S * mb, labels.begin() + (gm + 1) * S * mb);
    tok.push_back(testing::make_int_tensor(t, dev, {S, mb}, st));
    lab.push_back(testing::make_int_tensor(l, dev, {S, mb}, st));
  }
  for (int64_t m = 0; m < M; ++m) {
    MicroBatch b{tok[m].t, lab[m].t, Tensor()};
    b.loss_weight = 1.0f / static_cast<float>(S * mb * M * dp);
    mbs.push_back(b);
  }
  OwnedTensor loss(DType::kF32, dev, {1});
  RunResult r;
  for (int it = 0; it < kIters; ++it) {
    fill(loss, 0.f, st);
    train_step(model, opt, mbs, {99, it, 1e-3f, d, dp}, loss, st);
    g.dp->all_reduce(loss, ReduceOp::kSum, st);
    r.losses.push_back(testing::to_host(loss, st)[0]);
  }
  const ParamStore& P = model.params();
  for (size_t i = 0; i < P.size(); ++i) {
    r.infos.push_back(P.info(i));
    r.grads.push_back(testing::to_host(P.grad(i), st));
    r.params.push_back(testing::to_host(P.main(i), st));
  }
  return r;
}

// The slice of a full (reference) tensor that a shard covers.
std::vector<float> slice(const std::vector<float>& full, const ParamInfo& shard) {
  const int64_t rows = shard.shape.size() == 2 ? shard.shape[0] : 1, cols = shard.numel / rows;
  std::vector<float> out(static_cast<size_t>(shard.numel));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = full[(shard.shard.row_offset + r) * shard.shard.global_cols + shard.shard.col_offset + c];
  return out;
}

TEST(TensorDataParallelNccl, Bf16LayoutsMatchOneGpu) {
  MT_REQUIRE_CUDA();
  const LaunchEnv env = read_launch_env();
  if (env.world_size != 2 || env.launcher != LaunchEnv::kMpirun) GTEST_SKIP() << "run under mpiexec -np 2";
  int gpus = 0;
  cudaGetDeviceCount(&gpus);
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  const Device dev = local_device(DeviceType::kCUDA, env);
  set_current_device(dev);
  auto world = init_world(dev, env, 5.0);
  const GptConfig c = config();
  const int64_t mb = 2, num_micro = 4;
  std::vector<int32_t> tokens = testing::randint(num_micro * mb * c.seq_length, 0, 256);
  std::vector<int32_t> labels = testing::randint(num_micro * mb * c.seq_length, 0, 256);
  MPI_Bcast(tokens.data(), static_cast<int>(tokens.size()), MPI_INT32_T, 0, MPI_COMM_WORLD);
  MPI_Bcast(labels.data(), static_cast<int>(labels.size()), MPI_INT32_T, 0, MPI_COMM_WORLD);
  const RunResult ref = train(ProcessGroups::single(), false, dev, tokens, labels, mb, num_micro);
  struct Layout {
    int tp;
    bool sp;
    const char* name;
  };
  for (const Layout& L : {Layout{2, false, "tp2"}, Layout{2, true, "tp2+sp"}, Layout{1, false, "dp2"}}) {
    ParallelConfig pc;
    pc.tp = L.tp;
    validate_and_derive(pc, world->size());
    const RunResult par = train(build_process_groups(world, pc), L.sp, dev, tokens, labels, mb, num_micro);
    for (int it = 0; it < kIters; ++it)
      EXPECT_NEAR(par.losses[it], ref.losses[it], 2e-3 * ref.losses[it]) << L.name << " iteration " << it;
    // Per tensor for the weight matrices; biases and norms (sums over tokens with cancellation,
    // the key bias's gradient is exactly zero analytically) only through the global vector.
    std::vector<float> all_par_g, all_ref_g, all_par_p, all_ref_p;
    for (size_t i = 0; i < par.infos.size(); ++i) {
      const auto& info = par.infos[i];
      const auto rg = slice(ref.grads[i], info), rp = slice(ref.params[i], info);
      all_par_g.insert(all_par_g.end(), par.grads[i].begin(), par.grads[i].end());
      all_ref_g.insert(all_ref_g.end(), rg.begin(), rg.end());
      all_par_p.insert(all_par_p.end(), par.params[i].begin(), par.params[i].end());
      all_ref_p.insert(all_ref_p.end(), rp.begin(), rp.end());
      if (info.shape.size() != 2) continue;
      EXPECT_LT(testing::rel_err(par.grads[i], rg), 2e-2) << L.name << " grad " << info.name;
      EXPECT_LT(testing::rel_err(par.params[i], rp), 2e-2) << L.name << " param " << info.name;
    }
    const double eg = testing::rel_err(all_par_g, all_ref_g), ep = testing::rel_err(all_par_p, all_ref_p);
    std::printf("[%s] rank %d: all gradients rel err %.2e, all parameters %.2e\n", L.name, world->rank(), eg, ep);
    // Measured on 2x H200 (2026-11-21): TP2 and TP2+SP gradients 1.4e-2, parameters 5.4e-4;
    // DP2 4.5e-8 and 8e-9 (only the fp32 gradient all-reduce differs).
    EXPECT_LT(eg, 2e-2) << L.name;
    EXPECT_LT(ep, 1e-2) << L.name;
  }
}

}  // namespace
}  // namespace mt
