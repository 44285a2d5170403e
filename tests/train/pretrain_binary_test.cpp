// `megatron pretrain` end to end through the binary on CPU: the local launcher (--nproc-per-node,
// mpiexec for CPU ranks, the MPI communicator), the Megatron log lines, checkpoints written by one
// set of processes and read by another, errors printed once by rank 0. The trainer's layouts,
// checkpoints and MoE statistics are tested in-process in trainer_layouts_test.cpp; here the point
// is the binary and its launcher (a 96-token NullTokenizer corpus written by the test keeps each
// run about a second).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <regex>

#include "testing/testing.h"
#include "train/trainer_testing.h"

namespace mt {
namespace {

using testing::RunResult;
using testing::run_megatron;

std::map<int, double> losses(const std::string& out) {
  std::map<int, double> v;
  std::regex re("iteration +([0-9]+)/ *[0-9]+ .*lm loss: ([0-9.E+-]+)");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    v[std::stoi((*it)[1].str())] = std::stod((*it)[2].str());
  return v;
}

std::map<int, double> val_losses(const std::string& out) {
  std::map<int, double> v;
  std::regex re("validation loss at iteration ([0-9]+) \\| lm loss value: ([0-9.E+-]+)");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    v[std::stoi((*it)[1].str())] = std::stod((*it)[2].str());
  return v;
}

void expect_same(const std::map<int, double>& a, const std::map<int, double>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [it, l] : b) EXPECT_NEAR(a.at(it), l, 2e-5 * l) << what << " iteration " << it;
}

class PretrainBinary : public testing::CorpusFixture {
 protected:
  static RunResult pretrain(const std::string& extra) { return run_megatron("pretrain " + flags(extra)); }
};

// Ranks started by the launcher (MPI) train the one-rank model: TP 2 with SP, PP 2, an MoE with the
// alltoall dispatcher and ECHO over EP 2 (all_to_allv over MPI); the log shows the parallel layout
// and the MoE statistics.
TEST_F(PretrainBinary, LaunchedRanksMatchOneRank) {
  RunResult ref = pretrain("--train-iters 4");
  ASSERT_EQ(ref.rc, 0) << ref.out;
  ASSERT_EQ(losses(ref.out).size(), 4u) << ref.out;
  ASSERT_EQ(val_losses(ref.out).size(), 3u) << ref.out;  // iterations 0, 2, 4
  for (const std::string layout : {"--nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel",
                                   "--nproc-per-node 2 --pipeline-model-parallel-size 2"}) {
    RunResult r = pretrain("--train-iters 4 " + layout);
    ASSERT_EQ(r.rc, 0) << layout << "\n" << r.out;
    EXPECT_NE(r.out.find("parallel layout"), std::string::npos) << r.out;
    expect_same(losses(r.out), losses(ref.out), layout);
    expect_same(val_losses(r.out), val_losses(ref.out), layout + " (validation)");
  }
  const std::string moe =
      " --swiglu --ffn-hidden-size 64 --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
      "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-layer-freq [0,1]*2 "
      "--moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3";
  RunResult one = pretrain("--train-iters 4" + moe);
  ASSERT_EQ(one.rc, 0) << one.out;
  EXPECT_NE(one.out.find("MoE in 2 of 4 layers: 8 experts, top-2 softmax router"), std::string::npos) << one.out;
  EXPECT_NE(one.out.find("load_balancing_loss: "), std::string::npos) << one.out;
  EXPECT_NE(one.out.find("/64.0 | expert imbalance: "), std::string::npos) << one.out;
  RunResult ep = pretrain("--train-iters 4 --nproc-per-node 2 --expert-model-parallel-size 2 "
                          "--moe-token-dispatcher-type alltoall --moe-enable-echo --moe-num-echo-experts 1" +
                          moe);
  ASSERT_EQ(ep.rc, 0) << ep.out;
  EXPECT_NE(ep.out.find("max tokens received per EP rank: "), std::string::npos) << ep.out;
  EXPECT_NE(ep.out.find("ECHO rerouted tokens per layer: "), std::string::npos) << ep.out;
  expect_same(losses(ep.out), losses(one.out), "MoE EP 2 alltoall ECHO");
}

// A checkpoint written by two processes (PP 2, --exit-interval) resumes in one process on the
// uninterrupted curve.
TEST_F(PretrainBinary, CheckpointResumesInAnotherLaunch) {
  RunResult full = pretrain("--train-iters 6");
  ASSERT_EQ(full.rc, 0) << full.out;
  const std::string ck = dir("ck");
  RunResult first =
      pretrain("--train-iters 6 --exit-interval 3 --save " + ck + " --nproc-per-node 2 --pipeline-model-parallel-size 2");
  ASSERT_EQ(first.rc, 0) << first.out;
  EXPECT_NE(first.out.find("exiting program at iteration 3 (--exit-interval 3)"), std::string::npos) << first.out;
  RunResult second = pretrain("--train-iters 6 --load " + ck);
  ASSERT_EQ(second.rc, 0) << second.out;
  ASSERT_NE(second.out.find("> loaded checkpoint from " + ck + " at iteration 3"), std::string::npos) << second.out;
  std::map<int, double> curve = losses(first.out);
  ASSERT_EQ(losses(second.out).count(1), 0u) << second.out;  // resumed, not restarted
  for (auto [k, v] : losses(second.out)) curve[k] = v;
  expect_same(curve, losses(full.out), "pp2 -> 1 rank");
}

// --grad-reduce-in-bf16 under mpiexec (MPI sums bf16 in fp32 and rounds once): the losses stay
// within 1e-4 of the one-rank run (bf16 rounding of the gradients, which Adam mostly normalises
// away); --ddp-copy-engine on CPU falls back with its reason.
TEST_F(PretrainBinary, GradReduceInBf16StaysClose) {
  RunResult ref = pretrain("--train-iters 4");
  ASSERT_EQ(ref.rc, 0) << ref.out;
  const auto ref_losses = losses(ref.out);
  RunResult r = pretrain("--train-iters 4 --nproc-per-node 2 --use-distributed-optimizer "
                         "--grad-reduce-in-bf16 --ddp-copy-engine");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("gradient reduction in bf16"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("copy engine unavailable"), std::string::npos) << r.out;
  const auto l = losses(r.out);
  ASSERT_EQ(l.size(), ref_losses.size()) << r.out;
  double worst = 0;
  for (const auto& [it, v] : ref_losses) {
    EXPECT_NEAR(l.at(it), v, 1e-4 * v) << "iteration " << it;
    worst = std::max(worst, std::abs(l.at(it) - v) / v);
  }
  std::printf("[grad-reduce-in-bf16] largest relative loss difference to one rank: %.2e\n", worst);
}

// An error found before training is the same on every rank: printed by rank 0, non-zero exit (the
// other layout errors: trainer_layouts_test.cpp BadLayoutErrors).
TEST_F(PretrainBinary, LayoutErrorsUnderTheLauncher) {
  const RunResult r = pretrain("--train-iters 2 --nproc-per-node 2 --tensor-model-parallel-size 3");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("world size 2 is not divisible by tp (3)"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace mt
