// --optimizer muon through the trainer (TrainingSetup, Trainer) on thread ranks: every parallel
// layout gives the one-rank losses (TP 2 in both same-update modes, DP 2 with and without the
// distributed optimizer, PP 2, and combinations; a GQA + SwiGLU model so that the Q/K/V split and
// the gated fc1 are exercised, and a MoE model whose experts are split over EP), and Muon really
// changes the training (the losses differ from AdamW's).
#include <gtest/gtest.h>

#include <string>

#include "testing/testing.h"
#include "train/trainer_testing.h"

namespace mt {
namespace {

using testing::expect_same_losses;
using testing::train_in_process;

class MuonLayouts : public testing::CorpusFixture {
 protected:
  static TrainingResult train(const std::string& extra) {
    return train_in_process(flags("--train-iters 4 --group-query-attention --num-query-groups 2 --swiglu "
                                  "--optimizer muon --muon-nesterov --muon-extra-scale-factor 0.2 " + extra));
  }
};

TEST_F(MuonLayouts, ParallelLayoutsMatchOneRank) {
  const TrainingResult ref = train("");
  ASSERT_EQ(ref.losses.size(), 4u);
  const TrainingResult adam = train("--optimizer adam");
  EXPECT_NE(adam.losses.at(4), ref.losses.at(4)) << "Muon trained exactly as AdamW";
  for (const std::string layout :
       {"--nproc-per-node 2 --tensor-model-parallel-size 2",
        "--nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel --muon-tp-mode distributed",
        "--nproc-per-node 2", "--nproc-per-node 2 --use-distributed-optimizer",
        "--nproc-per-node 2 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
        "--ddp-bucket-size 20000",
        "--nproc-per-node 2 --pipeline-model-parallel-size 2",
        "--nproc-per-node 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
        "--use-distributed-optimizer",
        "--nproc-per-node 4 --tensor-model-parallel-size 2 --use-distributed-optimizer --muon-tp-mode distributed"}) {
    SCOPED_TRACE(layout);
    expect_same_losses(train(layout), ref, layout, layout.find("distributed") != std::string::npos ? 1e-4 : 2e-5);
  }
}

TEST_F(MuonLayouts, MixtureOfExpertsMatchesOneRank) {
  const std::string moe = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --disable-bias-linear ";
  const TrainingResult ref = train(moe);
  ASSERT_EQ(ref.losses.size(), 4u);
  for (const std::string layout : {"--nproc-per-node 2 --expert-model-parallel-size 2",
                                   "--nproc-per-node 2 --expert-model-parallel-size 2 --use-distributed-optimizer",
                                   "--nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel"}) {
    SCOPED_TRACE(layout);
    expect_same_losses(train(moe + layout), ref, layout);
  }
}

}  // namespace
}  // namespace mt
