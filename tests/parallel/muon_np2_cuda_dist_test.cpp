// --optimizer muon over NCCL on 2 GPUs (mpiexec -np 2, one rank per GPU; ctest runs it so, the
// _np2_ in the name): the distributed optimizer's pipelined Muon step (docs/optimizer.md
// "Pipelining Muon's traffic": the all-gathers of U and the broadcasts of the orthogonalised
// matrices on GradSync's communication stream beside the Newton-Schulz batches) gives what one
// GPU gives, and so does TP 2 with --muon-tp-mode duplicated (± sequence parallelism).
//
// A four-layer Llama-style model (GQA: 4 heads in 2 query groups, so the Q/K/V split runs;
// SwiGLU; RMSNorm; RoPE; untied output layer), bf16, three iterations of 8 micro-batches of 2,
// the one-GPU reference computed on every rank from the same data (rank 0's, broadcast).
// Layouts: DP 2 with the distributed optimizer in small buckets (many all-gathers to pipeline;
// the caller's DP communicator on the communication stream), the same with --overlap-grad-reduce
// --overlap-param-gather (GradSync's own communicator), TP 2 and TP 2 + SP (duplicated: the TP
// all-gather inside the batches, no DP traffic).
//
// Tolerance, as tests/parallel/parallel_layouts_cuda_dist_test.cpp: the loss within 2e-3
// relative, each weight matrix's bf16 parameters within 2e-2 and all of this rank's within 1e-2.
// Those bounds see the sum of many small updates on top of the initial weights, so the Muon
// update itself is also compared: the fp32 main parameters' change over the run (gather_main),
// per Muon matrix, within max(0.1, 3 × the bf16 noise of that change: one GPU bf16 against one GPU
// fp32 model). A matrix not broadcast, broadcast from the wrong rank, read before its broadcast
// landed or orthogonalised from a half-gathered U is off by O(1) there.
//
// Races: DP 2 with the distributed optimizer under --deterministic-mode is run twice eagerly and
// once as a full-iteration CUDA graph with the optimizer (captured after one eager step; Muon's
// communication stream forks from and joins the captured stream; without --overlap-grad-reduce,
// so that Muon is the only user of that stream, and without --overlap-param-gather, which CUDA
// graphs refuse): the three runs' losses and parameters are bitwise equal.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "comm/bootstrap.h"
#include "model/gpt_model.h"
#include "ops/elementwise.h"
#include "optim/grad_sync.h"
#include "optim/muon.h"
#include "parallel/process_groups.h"
#include "testing/gpu_world.h"
#include "testing/testing.h"
#include "train/step_runner.h"
#include "train/train_step.h"
#include "train/training_setup.h"

namespace mt {
namespace {

using testing::OwnedTensor;

constexpr int kIters = 3;
constexpr int64_t kMb = 2, kMicro = 8;  // micro-batch size; micro-batches per iteration (all ranks)
constexpr float kLr = 5e-3f;

TransformerConfig config(bool deterministic) {
  TransformerConfig c;
  c.num_layers = 4;
  c.hidden_size = 128;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.ffn_hidden_size = 256;
  c.gated_linear_unit = true;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  c.seq_length = 64;
  c.max_position_embeddings = 64;
  c.vocab_size = 250;
  c.make_vocab_size_divisible_by = 64;
  c.hidden_dropout = 0.f;
  c.attention_dropout = 0.f;
  c.deterministic_mode = deterministic;
  return c;
}

MuonConfig muon_config(const TransformerConfig& c) {
  MuonConfig m;
  m.momentum = 0.95f;
  m.nesterov = true;
  m.extra_scale_factor = 0.2f;
  m.tp_mode = MuonTpMode::kDuplicated;
  const int64_t d = c.hidden_size / c.num_attention_heads;
  m.qkv_q_rows = c.num_attention_heads / c.num_query_groups * d;  // as train/arguments.cpp
  m.qkv_kv_rows = d;
  return m;
}

struct Layout {
  int tp = 1;
  bool sp = false, zero = false, overlap = false;
  bool deterministic = false, graph = false;
  std::string name() const {
    std::string s = fmt::format("muon_tp{}", tp);
    if (sp) s += "_sp";
    if (zero) s += "_distopt";
    if (overlap) s += "_overlap";
    if (deterministic) s += "_deterministic";
    if (graph) s += "_graph";
    return s;
  }
};

struct RunResult {
  std::vector<double> losses;
  std::vector<ParamInfo> infos;                // this rank's parameters
  std::vector<std::vector<float>> params;      // local shards, model dtype
  std::vector<std::vector<float>> main_delta;  // local shards: fp32 main parameters after - before
  bool pipelined = false;                      // a broadcast issued before the last batch (MuonStep::program)
};

// This rank's shard of every parameter in the fp32 main parameters (AdamWOptimizer::gather_main,
// collective).
std::vector<std::vector<float>> main_params(ModelSetup& setup, const Stream& st) {
  const ParamStore& P = setup.model().params();
  OwnedTensor full(DType::kF32, P.device(), {P.total_elements()});
  setup.optimizer().gather_main(full, st);
  const std::vector<float> h = testing::to_host(full, st);
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < P.size(); ++i)
    out.emplace_back(h.begin() + P.info(i).offset, h.begin() + P.info(i).offset + P.info(i).numel);
  return out;
}

bool program_pipelined(const MuonStep& m) {
  int last_batch = -1, first_bcast = -1;
  for (size_t n = 0; n < m.program().size(); ++n) {
    const auto k = m.program()[n].kind;
    if (k == MuonStep::Op::kBatch) last_batch = static_cast<int>(n);
    if (k == MuonStep::Op::kBroadcast && first_bcast < 0) first_bcast = static_cast<int>(n);
  }
  return first_bcast >= 0 && first_bcast < last_batch;
}

RunResult train(const std::shared_ptr<Communicator>& world, const Layout& L, DType dtype, Device dev,
                const std::vector<int32_t>& tokens, const std::vector<int32_t>& labels) {
  const TransformerConfig c = config(L.deterministic);
  const int64_t S = c.seq_length;
  ModelSetupOptions o;
  o.model = c;
  o.parallel.tp = L.tp;
  const int dp = world->size() / L.tp;
  const int M = static_cast<int>(kMicro / dp);
  o.num_microbatches = M;
  o.micro_batch_size = kMb;
  o.sequence_parallel = L.sp;
  o.dtype = dtype;
  o.device = dev;
  o.param_layout.bucket_size = L.zero ? 40000 : 0;  // several buckets: several all-gathers to pipeline
  o.ddp = DdpConfig{L.overlap, L.overlap && L.zero, L.zero};
  o.optim.eps = 1e-5f;
  o.optim.optimizer = "muon";
  o.optim.muon = muon_config(c);
  Stream st(dev);
  ModelSetup setup(world, o, st);
  const ProcessGroups& g = setup.groups();
  const int d = g.dp->rank();
  GPTModel& model = setup.model();
  model.params().initialize(4321, st);
  RunResult r;
  const MuonStep* muon = setup.optimizer().muon();
  EXPECT_NE(muon, nullptr);
  if (muon) r.pipelined = program_pipelined(*muon);
  const std::vector<std::vector<float>> main0 = main_params(setup, st);
  std::vector<OwnedTensor> tok, lab;
  std::vector<MicroBatch> mbs;
  for (int m = 0; m < M; ++m) {
    const int64_t gm = static_cast<int64_t>(m) * dp + d;
    std::vector<int32_t> t(tokens.begin() + gm * S * kMb, tokens.begin() + (gm + 1) * S * kMb);
    std::vector<int32_t> l(labels.begin() + gm * S * kMb, labels.begin() + (gm + 1) * S * kMb);
    tok.push_back(testing::make_int_tensor(t, dev, {S, kMb}, st));
    lab.push_back(testing::make_int_tensor(l, dev, {S, kMb}, st));
  }
  for (int m = 0; m < M; ++m) {
    MicroBatch b{tok[m].t, lab[m].t, Tensor()};
    b.loss_weight = 1.0f / static_cast<float>(S * kMb * M * dp);
    mbs.push_back(b);
  }
  OwnedTensor loss(DType::kF32, dev, {1});
  CudaGraphOptions graphs;  // --cuda-graph-impl local --cuda-graph-scope full_iteration
  graphs.impl = "local";
  graphs.scope = {"full_iteration"};
  graphs.warmup_steps = 1;
  graphs.include_optimizer = true;
  std::unique_ptr<StepRunner> runner;
  if (L.graph) runner = std::make_unique<StepRunner>(setup, graphs, 99, nullptr, st);
  for (int it = 0; it < kIters; ++it) {
    fill(loss, 0.f, st);
    if (runner) {
      runner->step(it, kLr, mbs, loss, nullptr);
    } else {
      train_step(model, setup.executor(), setup.train_plan(), setup.optimizer(), mbs, {99, it, kLr, d, dp}, loss, st);
    }
    g.dp->all_reduce(loss, ReduceOp::kSum, st);
    r.losses.push_back(testing::to_host(loss, st)[0]);
  }
  setup.grad_sync().finish_param_sync(st);
  const std::vector<std::vector<float>> main1 = main_params(setup, st);
  const ParamStore& P = model.params();
  for (size_t i = 0; i < P.size(); ++i) {
    r.infos.push_back(P.info(i));
    r.params.push_back(testing::to_host(P.param(i), st));
    std::vector<float> delta(main1[i].size());
    for (size_t e = 0; e < delta.size(); ++e) delta[e] = main1[i][e] - main0[i][e];
    r.main_delta.push_back(std::move(delta));
  }
  return r;
}

/// The world of the two mpiexec ranks, one GPU each, or why the tests skip.
const testing::GpuWorld& gpu_world() { return testing::gpu_world({2}); }

// Random tokens and labels, the same on every rank (rank 0's, broadcast).
std::pair<std::vector<int32_t>, std::vector<int32_t>> shared_random_batch() {
  const int64_t n = kMicro * kMb * config(false).seq_length;
  std::vector<int32_t> tokens = testing::randint(n, 0, 250), labels = testing::randint(n, 0, 250);
  MPI_Bcast(tokens.data(), static_cast<int>(tokens.size()), MPI_INT32_T, 0, MPI_COMM_WORLD);
  MPI_Bcast(labels.data(), static_cast<int>(labels.size()), MPI_INT32_T, 0, MPI_COMM_WORLD);
  return {tokens, labels};
}

TEST(MuonNccl, LayoutsMatchOneGpu) {
  MT_REQUIRE_CUDA();
  if (!gpu_world().comm) GTEST_SKIP() << gpu_world().skip;
  const Device dev = gpu_world().dev;
  const std::shared_ptr<Communicator>& world = gpu_world().comm;
  const auto [tokens, labels] = shared_random_batch();
  const auto one = std::make_shared<SingleRankCommunicator>("one");
  const RunResult ref = train(one, Layout{}, DType::kBF16, dev, tokens, labels);
  const RunResult ref32 = train(one, Layout{}, DType::kF32, dev, tokens, labels);
  std::map<std::string, size_t> ref_index;
  for (size_t i = 0; i < ref.infos.size(); ++i) ref_index[ref.infos[i].name] = i;
  for (const Layout& L : {Layout{1, false, true, false}, Layout{1, false, true, true}, Layout{2, false},
                          Layout{2, true}}) {
    const RunResult par = train(world, L, DType::kBF16, dev, tokens, labels);
    const std::string name = L.name();
    if (L.zero) EXPECT_TRUE(par.pipelined) << name << ": no broadcast issued before the last batch";
    for (int it = 0; it < kIters; ++it)
      EXPECT_NEAR(par.losses[it], ref.losses[it], 2e-3 * ref.losses[it]) << name << " iteration " << it;
    std::vector<float> all_par, all_ref;
    double worst_update = 0;
    for (size_t i = 0; i < par.infos.size(); ++i) {
      const ParamInfo& info = par.infos[i];
      ASSERT_TRUE(ref_index.count(info.name)) << info.name;
      const size_t j = ref_index.at(info.name);
      const auto rp = testing::shard_slice(ref.params[j], info);
      all_par.insert(all_par.end(), par.params[i].begin(), par.params[i].end());
      all_ref.insert(all_ref.end(), rp.begin(), rp.end());
      if (info.shape.size() != 2) continue;
      if (!is_muon_parameter(info)) {
        EXPECT_LT(testing::rel_err(par.params[i], rp), 2e-2) << name << " param " << info.name;
        continue;
      }
      // A Muon parameter is its (shared) initial value plus the Muon update: checked as the update
      // over the run against one GPU's, within the bf16 noise of that update measured as one GPU's
      // bf16 against its fp32 run. (A fixed bound on the parameter instead failed at TP 2 for the
      // scaled-init linear_proj, whose update is ~30% of its norm: 2.03e-2 with an update error of
      // 7.2e-2, on 2 H200s, 2026-11-29.)
      const auto rd = testing::shard_slice(ref.main_delta[j], info);
      const double noise = testing::rel_err(ref.main_delta[j], ref32.main_delta[j]);
      const double err = testing::rel_err(par.main_delta[i], rd);
      worst_update = std::max(worst_update, err);
      EXPECT_LT(err, std::max(0.1, 3 * noise)) << name << " Muon update of " << info.name << " (bf16 noise " << noise
                                               << ")";
    }
    const double ep = testing::rel_err(all_par, all_ref);
    std::printf("[%s] rank %d: all parameters rel err %.2e, worst Muon update rel err %.2e, loss %.6f vs %.6f\n",
                name.c_str(), world->rank(), ep, worst_update, par.losses.back(), ref.losses.back());
    EXPECT_LT(ep, 1e-2) << name;
  }
}

TEST(MuonNccl, PipelinedStepBitwiseReproducibleAndCapturable) {
  MT_REQUIRE_CUDA();
  if (!gpu_world().comm) GTEST_SKIP() << gpu_world().skip;
  const Device dev = gpu_world().dev;
  const std::shared_ptr<Communicator>& world = gpu_world().comm;
  const auto [tokens, labels] = shared_random_batch();
  Layout L{1, false, true, false};
  L.deterministic = true;
  const RunResult a = train(world, L, DType::kBF16, dev, tokens, labels);
  const RunResult b = train(world, L, DType::kBF16, dev, tokens, labels);
  L.graph = true;
  const RunResult c = train(world, L, DType::kBF16, dev, tokens, labels);
  for (const auto& [what, x] : {std::pair{"eager again", &b}, std::pair{"graph", &c}}) {
    EXPECT_EQ(x->losses, a.losses) << what;
    ASSERT_EQ(x->params.size(), a.params.size());
    size_t differing = 0;
    for (size_t i = 0; i < a.params.size(); ++i) {
      EXPECT_TRUE(testing::same_bits(x->params[i], a.params[i])) << what << " param " << a.infos[i].name;
      EXPECT_TRUE(testing::same_bits(x->main_delta[i], a.main_delta[i])) << what << " main " << a.infos[i].name;
      for (size_t e = 0; e < std::min(x->params[i].size(), a.params[i].size()); ++e)
        differing += std::memcmp(&x->params[i][e], &a.params[i][e], sizeof(float)) != 0;
    }
    std::printf("[%s, %s] rank %d: %zu parameter elements differ from the first eager run, loss %.8f vs %.8f\n",
                L.name().c_str(), what, world->rank(), differing, x->losses.back(), a.losses.back());
  }
}

}  // namespace
}  // namespace mt
