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

// The distributed optimizer's overlapped gradient reduce-scatter and parameter all-gather
// (--overlap-grad-reduce --overlap-param-gather, several buckets) leave Muon's step bitwise
// unchanged (the same collectives in the same order on CPU ranks): every loss, grad norm and
// validation loss (the one after the last step reads the final parameters), DP 2 and DP 2 x TP 2.
TEST_F(MuonLayouts, OverlapIsBitwiseTheSame) {
  for (const std::string layout :
       {"--nproc-per-node 2 --use-distributed-optimizer --ddp-bucket-size 20000",
        "--nproc-per-node 4 --tensor-model-parallel-size 2 --use-distributed-optimizer --ddp-bucket-size 20000",
        "--nproc-per-node 4 --tensor-model-parallel-size 2 --use-distributed-optimizer --ddp-bucket-size 20000 "
        "--muon-tp-mode distributed"}) {
    SCOPED_TRACE(layout);
    const TrainingResult plain = train(layout);
    const TrainingResult overlap = train(layout + " --overlap-grad-reduce --overlap-param-gather");
    ASSERT_EQ(plain.losses.size(), 4u);
    EXPECT_EQ(overlap.losses, plain.losses);
    ASSERT_EQ(overlap.log.size(), plain.log.size());
    for (size_t i = 0; i < plain.log.size(); ++i) {
      const std::string norm = testing::logged(plain.log[i].line, "grad norm");
      EXPECT_FALSE(norm.empty()) << plain.log[i].line;
      EXPECT_EQ(testing::logged(overlap.log[i].line, "grad norm"), norm) << i;
    }
    ASSERT_EQ(overlap.validation.size(), plain.validation.size());
    ASSERT_TRUE(plain.validation.count(4));
    for (const auto& [it, v] : plain.validation) EXPECT_EQ(overlap.validation.at(it).loss, v.loss) << it;
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
