// Per-phase timing of the MoE layers (MT_MOE_PHASE_TIMING; model/moe/moe_phase_timer.h, docs/moe.md
// "Per-phase timing"), on the CPU where the events are the host's steady clock:
//   - the timer alone: phases that sleep known times are measured at least that long, the gap
//     between them lands in "between phases", the phases sum to at most the layer's time, warm-up
//     and evaluation passes are left out, the averages are per measured iteration;
//   - the environment switch: off when unset or 0, clear errors for other values;
//   - the MoE layer in training (one rank, allgather, shared experts; and EP 2 alltoall with
//     --overlap-moe-expert-parallel-comm and --moe-shared-expert-overlap on thread ranks): the table
//     has every phase the configuration runs, forward and backward, and they sum to at most the
//     layers' time.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "comm/thread_comm.h"
#include "model/moe/moe_phase_timer.h"
#include "ops/elementwise.h"
#include "testing/testing.h"
#include "train/train_step.h"
#include "train/training_setup.h"

namespace mt {
namespace {

using testing::OwnedTensor;

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// The phases' sum per pass direction must not exceed the layer's time (disjoint intervals inside it).
void expect_phases_within_layer(const MoePhaseTimes& t) {
  double f = 0, b = 0;
  for (int p = 0; p < kMoePhases; ++p) {
    EXPECT_GE(t.forward_ms[p], 0.0) << moe_phase_name(static_cast<MoePhase>(p));
    EXPECT_GE(t.backward_ms[p], 0.0) << moe_phase_name(static_cast<MoePhase>(p));
    f += t.forward_ms[p];
    b += t.backward_ms[p];
  }
  EXPECT_GT(t.layer_forward_ms, 0.0);
  EXPECT_GT(t.layer_backward_ms, 0.0);
  EXPECT_LE(f, t.layer_forward_ms);
  EXPECT_LE(b, t.layer_backward_ms);
}

TEST(MoePhaseTimer, MeasuresPhasesAndGapsOnTheHostClock) {
  MoePhaseTimer timer(/*warmup_iterations=*/1);
  Stream st(Device::cpu());
  const MicroBatch mb{};
  for (uint64_t it = 5; it < 8; ++it) {  // iteration 5 is the warm-up
    const DropoutContext train{0, it, 0, true};
    const StepContext ctx{mb, train, 0, st};
    {
      MoePhasePass fwd(&timer, ctx, /*backward=*/false, /*layer=*/3);
      {
        const auto t = fwd.phase(MoePhase::kRouter);
        sleep_ms(2);
      }
      sleep_ms(3);  // between phases
      const auto t = fwd.phase(MoePhase::kExperts);
      sleep_ms(4);
    }
    {
      MoePhasePass bwd(&timer, ctx, /*backward=*/true, /*layer=*/3);
      const auto t = bwd.phase(MoePhase::kCombine);
      sleep_ms(1);
    }
    const DropoutContext eval{0, it, 0, false};  // evaluation: not measured
    MoePhasePass ev(&timer, StepContext{mb, eval, 0, st}, false, 3);
    const auto t = ev.phase(MoePhase::kDispatch);
    sleep_ms(5);
  }
  const MoePhaseTimes t = timer.times();
  EXPECT_EQ(t.iterations, 2);
  EXPECT_EQ(t.layers, 1);
  EXPECT_EQ(t.forward_passes, 2);
  EXPECT_EQ(t.backward_passes, 2);
  // per iteration: at least the sleeps; loose upper bounds (a loaded machine oversleeps)
  EXPECT_GE(t.forward_ms[static_cast<int>(MoePhase::kRouter)], 2.0);
  EXPECT_GE(t.forward_ms[static_cast<int>(MoePhase::kExperts)], 4.0);
  EXPECT_GE(t.backward_ms[static_cast<int>(MoePhase::kCombine)], 1.0);
  EXPECT_LT(t.forward_ms[static_cast<int>(MoePhase::kRouter)], 2.0 + 50.0);
  EXPECT_EQ(t.forward_ms[static_cast<int>(MoePhase::kDispatch)], 0.0);  // only the evaluation ran it
  EXPECT_GE(t.layer_forward_ms - t.forward_ms[static_cast<int>(MoePhase::kRouter)] -
                t.forward_ms[static_cast<int>(MoePhase::kExperts)],
            3.0);  // the gap
  expect_phases_within_layer(t);
  const std::string r = timer.report();
  for (const char* want : {"router", "experts", "combine", "between phases", "MoE layers (total)",
                           "2 iteration(s) measured after 1 warm-up", "2 forward / 2 backward"})
    EXPECT_NE(r.find(want), std::string::npos) << want << " missing from\n" << r;
  EXPECT_EQ(r.find("dispatch"), std::string::npos) << r;  // a phase that did not run has no row
}

TEST(MoePhaseTimer, NothingMeasuredGivesNoReport) {
  MoePhaseTimer timer(0);
  EXPECT_EQ(timer.report(), "");
  Stream st(Device::cpu());
  const MicroBatch mb{};
  const DropoutContext train{};
  {
    MoePhasePass off(nullptr, StepContext{mb, train, 0, st}, false, 0);
    const auto t = off.phase(MoePhase::kRouter);  // inactive: records nothing
  }
  EXPECT_EQ(timer.report(), "");
}

TEST(MoePhaseTimer, EnvironmentSwitch) {
  unsetenv("MT_MOE_PHASE_TIMING");
  EXPECT_EQ(MoePhaseTimer::from_environment(), nullptr);
  setenv("MT_MOE_PHASE_TIMING", "0", 1);
  EXPECT_EQ(MoePhaseTimer::from_environment(), nullptr);
  setenv("MT_MOE_PHASE_TIMING", "1", 1);
  EXPECT_NE(MoePhaseTimer::from_environment(), nullptr);
  setenv("MT_MOE_PHASE_TIMING", "yes", 1);
  testing::expect_error([] { MoePhaseTimer::from_environment(); }, "MT_MOE_PHASE_TIMING=yes: expected 0 or 1");
  setenv("MT_MOE_PHASE_TIMING", "1", 1);
  setenv("MT_MOE_PHASE_TIMING_WARMUP", "-2", 1);
  testing::expect_error([] { MoePhaseTimer::from_environment(); },
                        "MT_MOE_PHASE_TIMING_WARMUP=-2: expected a non-negative integer");
  setenv("MT_MOE_PHASE_TIMING_WARMUP", "3x", 1);
  testing::expect_error([] { MoePhaseTimer::from_environment(); }, "MT_MOE_PHASE_TIMING_WARMUP=3x");
  unsetenv("MT_MOE_PHASE_TIMING_WARMUP");
  unsetenv("MT_MOE_PHASE_TIMING");
}

// ---------------------------------------------------------------------------------------------
// The MoE layer in training
// ---------------------------------------------------------------------------------------------

struct TrainRun {
  int world = 1, ep = 1;
  bool alltoall = false, overlap = false;
};

constexpr int kIters = 3, kMicro = 2, kLayers = 2;

// Trains kIters iterations on every rank, each rank's MoE layers timed by a timer of its own;
// returns rank 0's times.
MoePhaseTimes train(const TrainRun& R) {
  TransformerConfig c;
  c.num_layers = kLayers;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.seq_length = 16;
  c.vocab_size = 61;
  c.make_vocab_size_divisible_by = 8;
  c.ffn_hidden_size = 48;
  c.gated_linear_unit = true;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  c.num_moe_experts = 8;
  c.moe_ffn_hidden_size = 16;
  c.moe_router_topk = 2;
  c.moe_shared_expert_intermediate_size = 24;
  c.moe_token_dispatcher_type = R.alltoall ? MoeDispatcher::kAllToAll : MoeDispatcher::kAllGather;
  c.moe_shared_expert_overlap = R.overlap;
  c.overlap_moe_expert_parallel_comm = R.overlap;
  MoePhaseTimes times;
  const int64_t S = c.seq_length, mb = 2;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> draw(0, 60);
  std::vector<int32_t> tokens(static_cast<size_t>(kMicro * R.world * S * mb));
  for (auto& t : tokens) t = draw(rng);
  run_thread_ranks(R.world, [&](int rank, std::shared_ptr<Communicator> world) {
    ModelSetupOptions o;
    o.model = c;
    o.parallel.ep = R.ep;
    o.num_microbatches = kMicro;
    o.micro_batch_size = mb;
    Stream st(Device::cpu());
    ModelSetup setup(world, o, st);
    GPTModel& model = setup.model();
    model.params().initialize(321, st);
    const int d = setup.groups().dp->rank(), dp = setup.groups().dp->size();
    std::vector<OwnedTensor> tok;
    std::vector<MicroBatch> mbs;
    for (int m = 0; m < kMicro; ++m) {
      const int64_t gm = static_cast<int64_t>(m) * dp + d;
      tok.push_back(testing::make_int_tensor(
          std::vector<int32_t>(tokens.begin() + gm * S * mb, tokens.begin() + (gm + 1) * S * mb), Device::cpu(),
          {S, mb}, st));
    }
    for (int m = 0; m < kMicro; ++m) {
      MicroBatch b;
      b.tokens = b.labels = tok[m].t;
      b.loss_weight = 1.0f / static_cast<float>(S * mb * kMicro * dp);
      b.aux_loss_weight = 1.0f / static_cast<float>(kMicro * dp);
      mbs.push_back(b);
    }
    OwnedTensor loss(DType::kF32, Device::cpu(), {1});
    MoePhaseTimer timer(/*warmup_iterations=*/1);
    {
      const MoePhaseTimer::ScopedForTesting use(&timer);  // this rank's layers time into `timer`
      for (int it = 0; it < kIters; ++it) {
        fill(loss, 0.f, st);
        train_step(model, setup.executor(), setup.train_plan(), setup.optimizer(), mbs, {5, it, 1e-2f, d, dp}, loss,
                   st);
      }
    }
    if (rank == 0) times = timer.times();
  });
  return times;
}

void expect_phases(const MoePhaseTimes& t, const std::vector<MoePhase>& ran, const std::vector<MoePhase>& absent) {
  EXPECT_EQ(t.iterations, kIters - 1);  // after one warm-up iteration
  EXPECT_EQ(t.layers, kLayers);
  EXPECT_EQ(t.forward_passes, (kIters - 1) * kMicro * kLayers);
  EXPECT_EQ(t.backward_passes, (kIters - 1) * kMicro * kLayers);
  for (MoePhase p : ran) {
    EXPECT_GT(t.forward_ms[static_cast<int>(p)], 0.0) << moe_phase_name(p);
    EXPECT_GT(t.backward_ms[static_cast<int>(p)], 0.0) << moe_phase_name(p);
  }
  for (MoePhase p : absent) {
    EXPECT_EQ(t.forward_ms[static_cast<int>(p)], 0.0) << moe_phase_name(p);
    EXPECT_EQ(t.backward_ms[static_cast<int>(p)], 0.0) << moe_phase_name(p);
  }
  expect_phases_within_layer(t);
}

TEST(MoePhaseTimer, EveryPhaseOfTheLayerInTraining) {
  const MoePhaseTimes t = train(TrainRun{});
  expect_phases(t,
                {MoePhase::kRouter, MoePhase::kPermute, MoePhase::kDispatch, MoePhase::kExperts, MoePhase::kCombine,
                 MoePhase::kSharedExperts},
                {MoePhase::kPipelined});
}

TEST(MoePhaseTimer, OverlappedExpertParallelPhases) {
  const MoePhaseTimes t = train(TrainRun{2, 2, true, true});  // EP 2, alltoall, both overlap flags
  // the experts compute inside the pipelined phase (the backward's kExperts is prepare_backward)
  expect_phases(t, {MoePhase::kRouter, MoePhase::kPermute, MoePhase::kPipelined, MoePhase::kSharedExperts},
                {MoePhase::kDispatch, MoePhase::kCombine});
  EXPECT_EQ(t.forward_ms[static_cast<int>(MoePhase::kExperts)], 0.0);
}

}  // namespace
}  // namespace mt
