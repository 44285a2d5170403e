// Checkpoints of sharded optimizer state (distributed optimizer: moments and, for bf16 models,
// the fp32 main parameters stored for the owned elements only): saved under DP 2 with the
// distributed optimizer, loaded under DP 1 without it and under DP 4 with it, and back; every
// parameter, main parameter and moment identical, and the loaded runs continue identically.
// Parameters flagged shared_embedding_copy are not written and are filled from the parameter of
// the same name on load. Extra state (CheckpointExtra, e.g. the MoE expert bias) round-trips
// bit-exactly, written by one rank.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "comm/thread_comm.h"
#include "ops/elementwise.h"
#include "optim/ddp_test_util.h"
#include "optim/optimizer.h"
#include "train/checkpoint.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using ddp_test::Model;
using ddp_test::opt_config;
using ddp_test::Pattern;
using testing::OwnedTensor;

using TensorMap = std::map<std::string, std::vector<float>>;
struct State {
  TensorMap main, param, m, v;  // per parameter name; param = model dtype as floats
  int32_t step = 0;
};

fs::path temp_dir(const std::string& tag) {
  const fs::path d = fs::temp_directory_path() /
                     ("mt_ddp_ckpt_" + tag + "_" + std::to_string(::getpid()) + "_" +
                      std::to_string(testing::test_seed() % 100000));
  fs::remove_all(d);
  return d;
}

// Whole state of a rank by parameter name (collective: gathers sharded state over DP).
State capture(const ParamStore& P, const AdamWOptimizer& opt, const Stream& st) {
  const int64_t total = P.total_elements();
  OwnedTensor main(DType::kF32, Device::cpu(), {total}), m(DType::kF32, Device::cpu(), {total}),
      v(DType::kF32, Device::cpu(), {total});
  opt.gather_main(main, st);
  opt.gather_moments(m, v, st);
  const std::vector<float> hm = testing::to_host(main.t, st), hp = testing::to_host(P.params_flat(), st),
                           h1 = testing::to_host(m.t, st), h2 = testing::to_host(v.t, st);
  State s;
  for (const auto& p : P.infos()) {
    auto slice = [&](const std::vector<float>& x) {
      return std::vector<float>(x.begin() + p.offset, x.begin() + p.offset + p.numel);
    };
    s.main[p.name] = slice(hm);
    s.param[p.name] = slice(hp);
    s.m[p.name] = slice(h1);
    s.v[p.name] = slice(h2);
  }
  s.step = opt.read_scalars_sync(st).step;
  return s;
}

void expect_same(const State& a, const State& b, const std::string& what) {
  EXPECT_EQ(a.step, b.step) << what;
  EXPECT_EQ(a.main.size(), b.main.size()) << what;
  for (const auto& [name, x] : a.main) {
    EXPECT_EQ(x, b.main.at(name)) << what << ": main " << name;
    EXPECT_EQ(a.param.at(name), b.param.at(name)) << what << ": param " << name;
    EXPECT_EQ(a.m.at(name), b.m.at(name)) << what << ": exp_avg " << name;
    EXPECT_EQ(a.v.at(name), b.v.at(name)) << what << ": exp_avg_sq " << name;
  }
}

double max_rel(const State& a, const State& b) {
  double worst = 0;
  for (const auto& [name, x] : a.main) worst = std::max(worst, testing::rel_err(x, b.main.at(name)));
  return worst;
}

struct Run {
  int dp;
  bool distributed;
  DType dtype;
};

// Runs `steps` steps (global step numbers [first_step, first_step + steps)) under DP r.dp (DP rank
// d adds the gradients of simulated rank d), after loading `load` if given (else a fresh
// initialisation), saving to `save` at the end if given. Returns DP rank 0's whole state.
State run(const Model& model, const Run& r, int first_step, int steps, const fs::path& load, const fs::path& save) {
  State out;
  std::mutex mu;
  run_thread_ranks(r.dp, [&](int rank, std::shared_ptr<Communicator> world) {
    Stream st;
    ParamStore P(model.specs, r.dtype, Device::cpu(), ParamLayout{r.dp, 600});
    DdpConfig dc;
    dc.overlap_grad_reduce = true;
    dc.use_distributed_optimizer = r.distributed;
    dc.overlap_param_gather = r.distributed;
    GradSync sync(P, world, dc);
    AdamWOptimizer opt(sync, opt_config(), st);
    if (!load.empty()) {
      const CheckpointState cs = load_checkpoint(load.string(), P, &opt, st);
      EXPECT_EQ(cs.iteration, first_step);
    } else {
      P.initialize(7, st);
    }
    for (int s = first_step; s < first_step + steps; ++s) {
      sync.zero_grad_buffer(st);
      ddp_test::backward(model, P, sync, Pattern::kInOrder, s, rank, st);
      opt.step(1e-2f, st);
    }
    if (!save.empty()) {
      CheckpointState cs;
      cs.iteration = first_step + steps;
      cs.seed = 7;
      cs.scalars = opt.read_scalars_sync(st);
      const CheckpointWriter w{.world = world, .dp_rank = rank, .edp_rank = rank};
      save_checkpoint(save.string(), cs, P, &opt, w, st);
    }
    State s = capture(P, opt, st);
    if (r.distributed && r.dtype != DType::kF32) {  // the fp32 main copy is sharded
      EXPECT_TRUE(P.main_sharded());
      EXPECT_EQ(P.main_storage_elements() * r.dp, P.total_elements());
    }
    std::lock_guard<std::mutex> lock(mu);
    if (rank == 0) out = std::move(s);
  });
  return out;
}

class DistributedCheckpoint : public ::testing::TestWithParam<DType> {};

TEST_P(DistributedCheckpoint, ReshardsAcrossDataParallelSizesAndOptimizers) {
  const DType dt = GetParam();
  const Model model = ddp_test::gpt_like(3);
  const fs::path a = temp_dir("a"), b = temp_dir("b");
  // DP 2 with the distributed optimizer: 2 steps, save.
  const State saved = run(model, {2, true, dt}, 0, 2, {}, a);
  ASSERT_EQ(saved.step, 2);
  // Load without the distributed optimizer on one rank, and with it on 4 ranks: identical.
  const State one = run(model, {1, false, dt}, 2, 0, a, {});
  expect_same(one, saved, "DP2 distopt -> DP1");
  const State four = run(model, {4, true, dt}, 2, 0, a, {});
  expect_same(four, saved, "DP2 distopt -> DP4 distopt");
  // bf16 parameters are the rounding of the loaded fp32 main parameters.
  for (const auto& [name, x] : one.main) {
    std::vector<float> rounded = x;
    if (dt != DType::kF32) {
      OwnedTensor t = testing::make_tensor(x, dt, Device::cpu(), {static_cast<int64_t>(x.size())}, Stream());
      rounded = testing::to_host(t.t, Stream());
    }
    EXPECT_EQ(one.param.at(name), rounded) << name;
  }
  // The other direction: written without the distributed optimizer (DP 1, re-saving what it
  // loaded), loaded with it under DP 4; both DP 4 runs then continue identically.
  run(model, {1, false, dt}, 2, 0, a, b);
  const State from_plain = run(model, {4, true, dt}, 2, 1, b, {});
  const State from_dist = run(model, {4, true, dt}, 2, 1, a, {});
  EXPECT_EQ(from_plain.step, 3);
  expect_same(from_plain, from_dist, "DP1 checkpoint -> DP4 distopt vs DP2 distopt checkpoint -> DP4 distopt");
  // Resuming is exact: 2 steps + save + load + 1 step == 3 steps without stopping.
  const State straight = run(model, {2, true, dt}, 0, 3, {}, {});
  const State resumed = run(model, {2, true, dt}, 2, 1, a, {});
  expect_same(resumed, straight, "resumed vs uninterrupted");
  EXPECT_GT(max_rel(straight, saved), 1e-4);  // the third step changed the parameters
  fs::remove_all(a);
  fs::remove_all(b);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DistributedCheckpoint, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// The tied output embedding copy of the last pipeline stage (shared_embedding_copy, same name as
// the first stage's word embedding) is not written; loading fills it from that parameter.
TEST(DistributedCheckpoint, SharedEmbeddingCopySkippedOnSaveFilledOnLoad) {
  const Model first = ddp_test::gpt_like(2);
  Model last = first;  // the embedding moved to the end and flagged as the copy
  std::rotate(last.specs.begin(), last.specs.begin() + 1, last.specs.end());
  last.specs.back().shared_embedding_copy = true;
  const std::string emb = "embedding.word_embeddings.weight";
  ASSERT_EQ(last.specs.back().name, emb);
  const fs::path a = temp_dir("emb_a"), b = temp_dir("emb_b");
  Stream st;
  auto writer = [](const Model&) { return CheckpointWriter{.world = std::make_shared<SingleRankCommunicator>()}; };
  ParamStore S(first.specs, DType::kF32, Device::cpu(), ParamLayout{1, 0});
  S.initialize(11, st);
  AdamWOptimizer so(S, opt_config(), st);
  for (size_t i = 0; i < S.size(); ++i) testing::upload(S.grad(i), ddp_test::local_grad(S, i, 0, 0), st);
  so.step(1e-2f, st);  // non-zero moments
  CheckpointState cs;
  cs.iteration = 1;
  save_checkpoint(a.string(), cs, S, &so, writer(first), st);
  // Load into the last stage: the copy gets the embedding's values.
  ParamStore T(last.specs, DType::kF32, Device::cpu(), ParamLayout{1, 0});
  AdamWOptimizer to(T, opt_config(), st);
  load_checkpoint(a.string(), T, &to, st);
  EXPECT_EQ(testing::to_host(T.param(emb), st), testing::to_host(S.param(emb), st));
  // Saving from the last stage leaves the copy out of the metadata and the data file.
  save_checkpoint(b.string(), cs, T, &to, writer(last), st);
  std::ifstream f(b / "iter_0000001" / "metadata.json");
  const auto meta = nlohmann::json::parse(f);
  for (const auto& t : meta.at("tensors")) EXPECT_EQ(t.at("name").get<std::string>().find(emb), std::string::npos);
  EXPECT_EQ(meta.at("tensors").size(), 3 * (last.specs.size() - 1));
  // What was written is consistent: a store without the copy loads it.
  Model rest = last;
  rest.specs.pop_back();
  ParamStore R(rest.specs, DType::kF32, Device::cpu(), ParamLayout{1, 0});
  AdamWOptimizer ro(R, opt_config(), st);
  load_checkpoint(b.string(), R, &ro, st);
  auto moments = [&](const AdamWOptimizer& o, const ParamStore& P, const std::string& name) {
    const ParamInfo& p = P.info(P.index(name));
    return testing::to_host(o.exp_avg_sq().flat_range(p.offset, p.numel), st);
  };
  for (size_t i = 0; i < R.size(); ++i) {
    const std::string& name = R.info(i).name;
    EXPECT_EQ(testing::to_host(R.param(i), st), testing::to_host(S.param(name), st)) << name;
    EXPECT_EQ(moments(ro, R, name), moments(so, S, name)) << name;
  }
  EXPECT_EQ(moments(to, T, emb), moments(so, S, emb));  // the copy's moments came from the original
  fs::remove_all(a);
  fs::remove_all(b);
}

// Extra state (CheckpointExtra): written whole by DP rank 0 with TP rank 0 only (two ranks of
// one stage here, both DP rank 0 as under TP 2), restored bit-exactly in place; --async-save
// snapshots it at save(); a tensor the checkpoint lacks keeps its value; a shape mismatch names
// the tensor and both shapes.
TEST(DistributedCheckpoint, ExtraStateRoundTripsWrittenOnce) {
  const Model model = ddp_test::gpt_like(2);
  const std::string bias = "decoder.layers.1.mlp.router.expert_bias", other = "some.state";
  const std::vector<float> b0 = testing::randn(8), o0 = testing::randn(6);
  const fs::path a = temp_dir("extra_a"), b = temp_dir("extra_b");
  run_thread_ranks(2, [&](int rank, std::shared_ptr<Communicator> world) {
    Stream st;
    ParamStore P(model.specs, DType::kF32, Device::cpu(), ParamLayout{1, 0});
    P.initialize(3, st);
    OwnedTensor tb = testing::make_tensor(b0, DType::kF32, Device::cpu(), {8}, st);
    OwnedTensor to = testing::make_tensor(o0, DType::kF32, Device::cpu(), {2, 3}, st);
    CheckpointState cs;
    cs.iteration = 1;
    const CheckpointWriter w{.world = world, .dp_rank = 0, .tp_rank = rank, .edp_rank = 0};
    save_checkpoint(a.string(), cs, P, nullptr, w, st, {{bias, tb.t}, {other, to.t}});
  });
  std::ifstream f(a / "iter_0000001" / "metadata.json");
  const auto meta = nlohmann::json::parse(f);
  int found = 0;
  for (const auto& t : meta.at("tensors")) {
    const std::string name = t.at("name").get<std::string>();
    if (name.rfind("state/", 0) != 0) continue;
    ++found;
    ASSERT_EQ(t.at("shards").size(), 1u) << t.dump();
    EXPECT_EQ(t.at("shards")[0].at("file"), "rank_00000.bin") << name;
    EXPECT_EQ(t.at("global_shape"), name == "state/" + bias ? nlohmann::json({8}) : nlohmann::json({2, 3}));
  }
  EXPECT_EQ(found, 2);
  // Rank 1 (TP rank 1) wrote the replicated parameters but not the state: 14 floats fewer.
  EXPECT_EQ(fs::file_size(a / "iter_0000001" / "rank_00000.bin"),
            fs::file_size(a / "iter_0000001" / "rank_00001.bin") + 14 * 4);
  Stream st;
  ParamStore P(model.specs, DType::kF32, Device::cpu(), ParamLayout{1, 0});
  std::vector<float> zeros8(8, 0.f), zeros6(6, 0.f);
  OwnedTensor tb = testing::make_tensor(zeros8, DType::kF32, Device::cpu(), {8}, st);
  OwnedTensor to = testing::make_tensor(zeros6, DType::kF32, Device::cpu(), {2, 3}, st);
  load_checkpoint(a.string(), P, nullptr, st, {}, {{bias, tb.t}, {other, to.t}});
  EXPECT_EQ(testing::to_host(tb.t, st), b0);  // bit-exact
  EXPECT_EQ(testing::to_host(to.t, st), o0);
  // Asynchronous save: the values at save() are stored, not those written after it.
  {
    AsyncCheckpointSaver saver;
    CheckpointState cs;
    cs.iteration = 2;
    const CheckpointWriter w{.world = std::make_shared<SingleRankCommunicator>()};
    saver.save(b.string(), cs, P, nullptr, w, st, {{bias, tb.t}});
    fill(tb.t, 5.f, st);
    saver.wait();
  }
  load_checkpoint(b.string(), P, nullptr, st, {}, {{bias, tb.t}, {other, to.t}});
  EXPECT_EQ(testing::to_host(tb.t, st), b0);
  // A tensor the checkpoint lacks ("other" was not saved in b) keeps its value (with a warning).
  EXPECT_EQ(testing::to_host(to.t, st), o0);
  fill(to.t, 2.f, st);
  load_checkpoint(b.string(), P, nullptr, st, {}, {{other, to.t}});
  EXPECT_EQ(testing::to_host(to.t, st), std::vector<float>(6, 2.f));
  // Another shape: an error naming the tensor and both shapes.
  OwnedTensor wrong = testing::make_tensor(zeros6, DType::kF32, Device::cpu(), {6}, st);
  try {
    load_checkpoint(b.string(), P, nullptr, st, {}, {{bias, wrong.t}});
    ADD_FAILURE() << "no error for a shape mismatch";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'state/" + bias + "' has shape [8] in the checkpoint but [6] in the model"),
              std::string::npos) << e.what();
  }
  fs::remove_all(a);
  fs::remove_all(b);
}

}  // namespace
}  // namespace mt
