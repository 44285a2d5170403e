// Batch-size ramp-up (train/batch_schedule.h): the global batch of each iteration follows
// Megatron-Core's calculators (RampupBatchsizeNumMicroBatchesCalculator for --rampup-batch-size,
// StepBatchsizeNumMicroBatchesCalculator for --step-batch-size-schedule; values worked out from
// their Python); a ramp run on DP x PP CPU ranks equals, iteration by iteration, runs at a
// constant --global-batch-size of that iteration's batch chained through checkpoints; a resume in
// the middle of the ramp is bitwise; bad input is an error naming the value.
#include <gtest/gtest.h>

#include <bit>

#include "testing/testing.h"
#include "train/megatron_compat.h"
#include "train/trainer_testing.h"

namespace mt {
namespace {

using testing::CorpusFixture;
using testing::expect_error;
using testing::parse_pretrain_args;
using testing::train_in_process;

std::vector<int64_t> batches(const BatchSizeSchedule& s, int iterations) {
  std::vector<int64_t> out;
  int64_t consumed = 0;
  for (int i = 0; i < iterations; ++i) {
    out.push_back(s.at(consumed));
    consumed += out.back();
  }
  return out;
}

TEST(BatchSizeSchedule, RampupFollowsMegatronsIncrements) {
  // --rampup-batch-size 16 16 5859375 --global-batch-size 1536 (the GPT-3 175B example before
  // April 2026): 95 increments of 61677.63... samples each.
  const BatchSizeSchedule g = BatchSizeSchedule::rampup({16, 16, 5859375}, 1536);
  EXPECT_EQ(g.at(0), 16);
  EXPECT_EQ(g.at(61677), 16);
  EXPECT_EQ(g.at(61678), 32);             // int(61678 / 61677.63) = 1
  EXPECT_EQ(g.at(5859375), 16 + 95 * 16);  // int(5859375 / 61677.63...) = 95: the last step reaches 1536
  EXPECT_EQ(g.at(5859376), 1536);          // consumed > ramp samples
  EXPECT_EQ(g.final_batch_size(), 1536);
  // 4 4 8 with 12: two increments of 4 samples: 0 -> 4, 4 -> 8, 12 -> 12.
  const BatchSizeSchedule s = BatchSizeSchedule::rampup({4, 4, 8}, 12);
  EXPECT_EQ(batches(s, 5), (std::vector<int64_t>{4, 8, 12, 12, 12}));
  EXPECT_EQ(s.sizes_used(100), (std::vector<int64_t>{4, 8, 12}));
  EXPECT_EQ(s.sizes_used(2), (std::vector<int64_t>{4, 8}));
  // update_train_iters: ramp iterations while consumed <= 8 (4, 12: two), then (40 - 12) // 12 = 2.
  EXPECT_EQ(s.train_iters(40), 4);
  EXPECT_EQ(s.train_iters(3), 1);  // the ramp loop stops once consumed > train samples
  // 10 2 7 with 16: 3 increments of 7/3 samples: int(c / 2.333): 0 -> 10, 10 -> 14 (int(4.29) = 4 caps at 16)
  const BatchSizeSchedule t = BatchSizeSchedule::rampup({10, 2, 7}, 16);
  EXPECT_EQ(t.at(0), 10);
  EXPECT_EQ(t.at(2), 10);
  EXPECT_EQ(t.at(3), 12);
  EXPECT_EQ(t.at(5), 14);
  EXPECT_EQ(t.at(7), 16);
  EXPECT_EQ(batches(t, 3), (std::vector<int64_t>{10, 16, 16}));
}

TEST(BatchSizeSchedule, StepScheduleFollowsMegatron) {
  // The GPT-3 175B example's schedule, thresholds in tokens, --seq-length 2048 (as split by bash).
  const BatchSizeSchedule g = BatchSizeSchedule::steps({"0:16", "2.4B:320", "4.8B:624", "7.2B:928", "9.6B:1232",
                                                        "12B:1536"}, 2048);
  EXPECT_EQ(g.at(0), 16);
  EXPECT_EQ(g.at(1171874), 16);  // 2.4e9 // 2048 = 1171875
  EXPECT_EQ(g.at(1171875), 320);
  EXPECT_EQ(g.at(5859374), 1232);
  EXPECT_EQ(g.at(5859375), 1536);
  EXPECT_EQ(g.final_batch_size(), 1536);
  // One quoted word, ',' separators, lower-case suffix, unsorted: the same schedule.
  const BatchSizeSchedule h = BatchSizeSchedule::steps({"12b:1536,0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232"}, 2048);
  for (int64_t c : {0, 1171874, 1171875, 3515625, 5859375, 9000000}) EXPECT_EQ(h.at(c), g.at(c)) << c;
  // 0:4 128:8 384:12 at seq 32: thresholds 0, 4, 12 samples: the ramp 4 4 8 / 12 above.
  const BatchSizeSchedule s = BatchSizeSchedule::steps({"0:4 128:8 384:12"}, 32);
  EXPECT_EQ(batches(s, 5), (std::vector<int64_t>{4, 8, 12, 12, 12}));
  // update_train_iters: while consumed < 40: 4, 12, 24, 36, 48 -> 5 (the last batch overshoots).
  EXPECT_EQ(s.train_iters(40), 5);
  EXPECT_EQ(s.train_iters(36), 4);
  EXPECT_EQ(s.train_iters(1), 1);
}

TEST(BatchSizeSchedule, BadInputIsAnError) {
  expect_error([] { BatchSizeSchedule::rampup({4, 4}, 12); }, "--rampup-batch-size takes 3 values");
  expect_error([] { BatchSizeSchedule::rampup({0, 4, 8}, 12); }, "start batch size should be positive, got 0");
  expect_error([] { BatchSizeSchedule::rampup({4, 0, 8}, 12); }, "increment should be positive, got 0");
  expect_error([] { BatchSizeSchedule::rampup({4, 4, 0}, 12); }, "ramp-up samples should be positive, got 0");
  expect_error([] { BatchSizeSchedule::rampup({16, 4, 8}, 12); }, "greater than or equal to the start batch size (16)");
  expect_error([] { BatchSizeSchedule::rampup({4, 3, 8}, 12); }, "interval 12 - 4 = 8 is not divisible by the increment 3");
  expect_error([] { BatchSizeSchedule::rampup({12, 4, 8}, 12); }, "nothing to ramp");
  expect_error([] { BatchSizeSchedule::steps({"0:4", "100"}, 32); }, "invalid entry '100'");
  expect_error([] { BatchSizeSchedule::steps({"0:4", "1X:8"}, 32); }, "'1X' in entry '1X:8' is not a number");
  expect_error([] { BatchSizeSchedule::steps({"32:4"}, 32); }, "first entry must have threshold 0, got 1 samples");
  expect_error([] { BatchSizeSchedule::steps({"0:4 10:8"}, 32); }, "strictly increasing");   // 10 // 32 = 0
  expect_error([] { BatchSizeSchedule::steps({"0:8 64:4"}, 32); }, "must not decrease");
  expect_error([] { BatchSizeSchedule::steps({"0:0"}, 32); }, "batch size must be positive, got 0");
  expect_error([] { BatchSizeSchedule::steps({","}, 32); }, "at least one entry");
}

// validate_pretrain_args with `world` ranks of data parallelism.
PretrainArgs validated(const std::string& flags, int dp) {
  PretrainArgs a = parse_pretrain_args(flags);
  a.data_parallel_size = dp;
  a.model.vocab_size = 96;
  validate_pretrain_args(a);
  return a;
}

TEST(BatchSizeSchedule, Arguments) {
  const std::string base = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
                           "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3 --lr-decay-style cosine --mock-data ";
  const std::string iters = "--lr-decay-iters 6 --lr-warmup-iters 1 ";
  {
    const PretrainArgs a = validated(base + iters + "--train-iters 6 --global-batch-size 12 --rampup-batch-size 4 4 8", 2);
    EXPECT_EQ(a.microbatch_counts(), (std::vector<int64_t>{1, 2, 3}));
    EXPECT_EQ(a.num_microbatches(), 3);
    // Megatron's scheduler counts samples: the iteration lengths times the final global batch.
    const LrScheduleConfig s = a.lr_schedule();
    EXPECT_EQ(s.decay_steps, 72);
    EXPECT_EQ(s.warmup_steps, 12);
    EXPECT_TRUE(a.lr_counts_samples());
    EXPECT_EQ(a.lr_step(2, 12), 12);
  }
  {  // the step schedule sets the global batch; its train iterations by update_train_iters
    const PretrainArgs a = validated(base + "--train-samples 40 --step-batch-size-schedule 0:4 128:8 384:12", 2);
    EXPECT_EQ(a.global_batch_size, 12);
    EXPECT_EQ(a.train_iters, 5);
    EXPECT_EQ(a.microbatch_counts(), (std::vector<int64_t>{1, 2, 3}));
    const PretrainArgs b = validated(base + "--train-samples 40 --global-batch-size 12 --step-batch-size-schedule "
                                            "0:4,128:8,384:12", 2);
    EXPECT_EQ(b.train_iters, 5);
  }
  expect_error([&] { validated(base + "--train-iters 6 --global-batch-size 12 --rampup-batch-size 4 4 8 "
                                      "--step-batch-size-schedule 0:4", 2); },
               "Cannot specify both --step-batch-size-schedule and --rampup-batch-size");
  expect_error([&] { validated(base + "--train-iters 6 --global-batch-size 16 --step-batch-size-schedule 0:4 128:12", 2); },
               "--global-batch-size 16 with --step-batch-size-schedule, whose final batch size is 12");
  // 6 is reached (6 // (2 x 2) is not whole)
  expect_error([&] { validated(base + "--train-iters 6 --global-batch-size 12 --rampup-batch-size 6 6 6", 2); },
               "the global batch size 6 is not divisible by --micro-batch-size 2 times data-parallel size 2");
  expect_error([&] { validated(base + "--train-iters 6 --global-batch-size 12 --rampup-batch-size 4 4 8 "
                                      "--cuda-graph-impl local --cuda-graph-scope full_iteration", 2); },
               "--cuda-graph-scope full_iteration with batch-size ramp-up");
}

class BatchRampRun : public CorpusFixture {};

// DP 2 x PP 2 on 4 thread ranks, micro-batches of 2: the ramp 4 4 8 to 12 runs 1, 2, 3, 3
// micro-batches per data-parallel rank. A constant learning rate, so that the chained constant
// runs (whose schedules count iterations) see the same rates.
std::string ramp_flags(const std::string& extra) {
  return "--pipeline-model-parallel-size 2 --nproc-per-node 4 --lr-decay-style constant --lr-warmup-iters 0 "
         "--eval-iters 0 " + extra;
}

void expect_bitwise(const std::map<int64_t, float>& a, const std::map<int64_t, float>& b, int64_t from, int64_t to,
                    const std::string& what) {
  for (int64_t i = from; i <= to; ++i) {
    ASSERT_TRUE(a.count(i) && b.count(i)) << what << " iteration " << i;
    EXPECT_EQ(std::bit_cast<uint32_t>(a.at(i)), std::bit_cast<uint32_t>(b.at(i)))
        << what << " iteration " << i << ": " << a.at(i) << " vs " << b.at(i);
  }
}

TEST_F(BatchRampRun, EqualsChainedConstantRunsAndResumesBitwise) {
  const std::string ramp = flags(ramp_flags("--train-iters 4 --global-batch-size 12 --rampup-batch-size 4 4 8"));
  const TrainingResult r = train_in_process(ramp);
  ASSERT_EQ(r.log.size(), 4u);
  std::vector<int64_t> used, consumed;
  for (const TrainLogRecord& l : r.log) {
    used.push_back(l.point.batch_size);
    consumed.push_back(l.point.consumed_samples);
  }
  EXPECT_EQ(used, (std::vector<int64_t>{4, 8, 12, 12}));
  EXPECT_EQ(consumed, (std::vector<int64_t>{4, 12, 24, 36}));
  EXPECT_EQ(r.consumed_samples, 36);
  for (const auto& [i, l] : r.losses) EXPECT_TRUE(std::isfinite(l)) << i;

  // The same iterations as constant-batch runs, each resuming the previous one's checkpoint.
  std::map<int64_t, float> chained;
  const int64_t sizes[] = {4, 8, 12, 12};
  for (int it = 1; it <= 4; ++it) {
    const std::string ck = dir("chain" + std::to_string(it));
    std::string f = ramp_flags(fmt::format("--train-iters {} --global-batch-size {} --save {}", it, sizes[it - 1], ck));
    if (it > 1) f += " --load " + dir("chain" + std::to_string(it - 1));
    const TrainingResult c = train_in_process(flags(f));
    ASSERT_EQ(c.losses.size(), 1u) << it;
    chained[it] = c.losses.begin()->second;
    EXPECT_EQ(c.losses.begin()->first, it);
  }
  expect_bitwise(r.losses, chained, 1, 4, "ramp vs chained constant runs");

  // Interrupted after 2 iterations (in the ramp: the next batch is 12), resumed to 4.
  const std::string ck = dir("resume");
  const TrainingResult first = train_in_process(ramp + " --save " + ck + " --exit-interval 2");
  EXPECT_EQ(first.iteration, 2);
  const TrainingResult rest = train_in_process(ramp + " --load " + ck);
  EXPECT_EQ(rest.iteration, 4);
  EXPECT_EQ(rest.consumed_samples, 36);
  expect_bitwise(r.losses, first.losses, 1, 2, "before the interruption");
  expect_bitwise(r.losses, rest.losses, 3, 4, "after the resume");

  // Megatron-LM saves a checkpoint before each new number of micro-batches (iterations 1 and 2).
  const std::string saves = dir("saves");
  train_in_process(ramp + " --save " + saves + " --save-interval 100");
  for (const char* it : {"iter_0000001", "iter_0000002", "iter_0000004"})
    EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(saves) / it)) << it;
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(saves) / "iter_0000003"));

  // --step-batch-size-schedule with the same batches (thresholds 0, 4, 12 samples) trains the same.
  const TrainingResult steps = train_in_process(
      flags(ramp_flags("--train-iters 4 --global-batch-size 12 --step-batch-size-schedule 0:4 128:8 384:12")));
  EXPECT_EQ(steps.consumed_samples, 36);
  expect_bitwise(r.losses, steps.losses, 1, 4, "step schedule vs ramp-up");
}

}  // namespace
}  // namespace mt
