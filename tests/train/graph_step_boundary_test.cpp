// CUDA graphs of the whole step under Megatron-FSDP (docs/fsdp.md "CUDA graphs of the whole
// step"): the host-side facts a replay relies on, on CPU thread ranks (a graph cannot run here;
// tests/train/cuda_graph_cuda_test.cpp and tests/parallel/parallel_layouts_cuda_dist_test.cpp run
// the graphs on GPUs). For optim_grads and optim_grads_params, each with and without
// --overlap-grad-reduce, and the distributed optimizer (optim) as a control, at DP 2 with 2
// micro-batches per rank and several buckets:
//  * every step boundary holds nothing live (GradSync::live_host_state: no slot bound, nothing in
//    flight, no gather owed a wait): after finish_grad_sync, after the optimizer step
//    (start_param_sync) and after a validation forward (StepRunner::validation_forward);
//  * two steps after the warm-up call the same hooks in the same order with the same host state
//    after each (the slots each bucket is bound to included), also with a validation forward
//    between them: so a graph captured in one step replays the decisions of every later one;
//  * a simulated replay (the host code of the step skipped) followed by mark_replayed_grad_sync
//    leaves the state the eager step's finish_grad_sync left, and the optimizer step then reduces
//    nothing again (negative control: without the hook, finish_grad_sync would launch every
//    reduction a second time); with mark_replayed_param_sync, the state of the eager optimizer step;
//  * mark_replayed_grad_sync refuses a state that is not a step boundary's (a unit left open).
// Also the argument rules: --cuda-graph-impl full_iteration (with and without
// --cuda-graph-include-optimizer and --overlap-grad-reduce) is accepted with optim_grads and
// optim_grads_params, the per-layer scopes are refused naming why.
#include <gtest/gtest.h>

#include <random>
#include <utility>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/thread_comm.h"
#include "ops/elementwise.h"
#include "testing/testing.h"
#include "train/step_runner.h"
#include "train/train_step.h"
#include "train/trainer_testing.h"

namespace mt {
namespace {

// Forwards every hook to GradSync and records each call with GradSync's host state after it.
class RecordingHooks final : public ParamGradHooks {
 public:
  explicit RecordingHooks(GradSync& sync) : sync_(sync) {}
  void params_needed(size_t first, size_t end, const Stream& st) override {
    sync_.params_needed(first, end, st);
    note(fmt::format("params_needed {} {}", first, end));
  }
  void grads_ready(size_t first, size_t end, const Stream& st) override {
    sync_.grads_ready(first, end, st);
    note(fmt::format("grads_ready {} {}", first, end));
  }
  bool grads_every_backward() const override { return sync_.grads_every_backward(); }
  bool params_every_use() const override { return sync_.params_every_use(); }
  void params_begin(size_t first, size_t end, bool backward, size_t next_first, size_t next_end,
                    const Stream& st) override {
    sync_.params_begin(first, end, backward, next_first, next_end, st);
    note(fmt::format("params_begin {} {} {} next {} {}", first, end, backward, next_first, next_end));
  }
  void params_end(size_t first, size_t end, bool backward, const Stream& st) override {
    sync_.params_end(first, end, backward, st);
    note(fmt::format("params_end {} {} {}", first, end, backward));
  }
  std::vector<std::string> take() { return std::exchange(trace_, {}); }

 private:
  void note(const std::string& call) { trace_.push_back(call + " -> " + sync_.host_state()); }
  GradSync& sync_;
  std::vector<std::string> trace_;
};

struct Strategy {
  const char* name;
  bool shard_grads, shard_params, overlap;
};

// One rank's run of `strategy` (see the file comment); checks on every rank.
void check_step_boundaries(const Strategy& s, int rank, std::shared_ptr<Communicator> world) {
  ModelSetupOptions o;
  o.model.num_layers = 3;
  o.model.hidden_size = 32;
  o.model.num_attention_heads = 4;
  o.model.seq_length = 16;
  o.model.vocab_size = 50;
  o.model.make_vocab_size_divisible_by = 8;
  o.model.hidden_dropout = o.model.attention_dropout = 0.1f;
  o.num_microbatches = 2;
  o.micro_batch_size = 2;
  o.param_layout.bucket_size = 3000;  // several buckets, some shared by two layers
  o.param_layout.split_model_chunks = s.shard_grads;
  o.ddp = DdpConfig{s.overlap, false, true};
  o.ddp.shard_grads = s.shard_grads;
  o.ddp.shard_params = s.shard_params;
  Stream st(Device::cpu());
  ModelSetup setup(std::move(world), o, st);
  setup.model().params().initialize(11, st);
  GradSync& sync = setup.grad_sync();
  ASSERT_GT(sync.buckets().size(), 3u) << s.name;
  RecordingHooks rec(sync);
  setup.model().set_hooks(&rec);
  StepRunner runner(setup, CudaGraphOptions{}, 5, nullptr, st);  // eager: its validation forward
  std::mt19937 rng(3 + rank);
  std::vector<testing::OwnedTensor> data;
  std::vector<MicroBatch> mbs;
  for (int m = 0; m < 2; ++m) {
    std::vector<int32_t> t(32), l(32);
    for (auto& x : t) x = static_cast<int32_t>(rng() % 50);
    for (auto& x : l) x = static_cast<int32_t>(rng() % 50);
    data.push_back(testing::make_int_tensor(t, Device::cpu(), {16, 2}, st));
    data.push_back(testing::make_int_tensor(l, Device::cpu(), {16, 2}, st));
    MicroBatch b{data[2 * m].t, data[2 * m + 1].t, Tensor()};
    b.loss_weight = 1.f / 128;
    mbs.push_back(b);
  }
  testing::OwnedTensor loss(DType::kF32, Device::cpu(), {1}), eval_loss(DType::kF32, Device::cpu(), {1});
  const int dp = setup.groups().dp->size();
  const auto validate = [&](int64_t it) {
    const uint64_t* device_iteration = runner.begin_validation(it);
    runner.validation_forward([&] {
      const RunContext rc{5, it, rank, dp, false, device_iteration};
      setup.executor().run(setup.eval_plan(), mbs, rc, eval_loss.t, 1.f, Tensor(), st);
    });
    EXPECT_EQ(sync.live_host_state(), "") << s.name << ": after the validation forward of iteration " << it;
  };
  struct StepTrace {
    std::vector<std::string> hooks;
    std::string after_grads, after_optimizer;
  };
  const auto step = [&](int64_t it) {
    StepTrace t;
    fill(loss, 0.f, st);
    const StepOptions so{5, it, 1e-2f, rank, dp};
    forward_backward_step(setup.model(), setup.executor(), setup.train_plan(), setup.optimizer(), mbs, so, loss.t, st);
    t.hooks = rec.take();
    t.after_grads = sync.host_state();
    EXPECT_EQ(sync.live_host_state(), "") << s.name << ": after finish_grad_sync of iteration " << it;
    EXPECT_EQ(sync.grad_reductions_launched(), sync.buckets().size()) << s.name;
    setup.optimizer().step(1e-2f, st);
    t.after_optimizer = sync.host_state();
    EXPECT_EQ(sync.live_host_state(), "") << s.name << ": after the optimizer step of iteration " << it;
    return t;
  };
  step(0);  // the warm-up: GradSync learns which parameters the backward brackets
  validate(0);
  const StepTrace a = step(1);
  validate(1);
  const StepTrace b = step(2);  // a validation forward before, as before the first
  ASSERT_FALSE(a.hooks.empty()) << s.name;
  ASSERT_EQ(a.hooks.size(), b.hooks.size()) << s.name;
  for (size_t k = 0; k < a.hooks.size(); ++k) EXPECT_EQ(a.hooks[k], b.hooks[k]) << s.name << " hook " << k;
  EXPECT_EQ(a.after_grads, b.after_grads) << s.name;
  EXPECT_EQ(a.after_optimizer, b.after_optimizer) << s.name;
  EXPECT_NE(a.after_grads, a.after_optimizer) << s.name;  // (finished / reset: the comparison can fail)

  // A simulated replay without the optimizer: the host code of forward_backward_step skipped, the
  // hook sets what it left; the optimizer step's finish_grad_sync then reduces nothing.
  ASSERT_EQ(sync.host_state(), b.after_optimizer);
  EXPECT_EQ(sync.grad_reductions_launched(), 0u) << s.name << ": without the hook the step would reduce again";
  sync.mark_replayed_grad_sync();
  EXPECT_EQ(sync.host_state(), b.after_grads) << s.name;
  sync.finish_grad_sync(st);  // (AdamWOptimizer::step's first call)
  EXPECT_EQ(sync.host_state(), b.after_grads) << s.name << ": finish_grad_sync after the replay did something";
  setup.optimizer().step(1e-2f, st);
  EXPECT_EQ(sync.host_state(), b.after_optimizer) << s.name;
  EXPECT_TRUE(rec.take().empty());
  // With the optimizer in the graph.
  sync.mark_replayed_grad_sync();
  sync.mark_replayed_param_sync();
  EXPECT_EQ(sync.host_state(), b.after_optimizer) << s.name;
  // The next eager step after replays (and a validation forward) takes the same decisions.
  validate(3);
  const StepTrace c = step(4);
  EXPECT_EQ(c.hooks, b.hooks) << s.name;
  EXPECT_EQ(c.after_grads, b.after_grads) << s.name;

  // Not a step boundary: a unit left open (a backward bracket: every strategy here but plain optim
  // brackets its uses).
  if (sync.params_every_use()) {
    sync.params_begin(0, 1, true, 0, 0, st);
    EXPECT_NE(sync.live_host_state(), "") << s.name;
    testing::expect_error_text([&] { sync.mark_replayed_grad_sync(); }, "not a step boundary's", s.name);
    sync.params_end(0, 1, true, st);
  }
  setup.model().set_hooks(&sync);
}

TEST(GraphStepBoundary, ShardedStrategiesReplayTheCapturedDecisions) {
  for (const Strategy& s : {Strategy{"optim (control)", false, false, true}, Strategy{"optim_grads", true, false, false},
                            Strategy{"optim_grads overlapped", true, false, true},
                            Strategy{"optim_grads_params", true, true, false},
                            Strategy{"optim_grads_params overlapped", true, true, true}}) {
    SCOPED_TRACE(s.name);
    run_thread_ranks(2, [&](int rank, std::shared_ptr<Communicator> world) {
      check_step_boundaries(s, rank, std::move(world));
    });
  }
}

// The argument rules (train/arguments.cpp resolve_megatron_fsdp).
TEST(GraphStepBoundary, FullIterationAcceptedPerLayerRefused) {
  const std::string base =
      "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
      "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --tokenizer-type NullTokenizer "
      "--vocab-size 64 --mock-data --use-megatron-fsdp --data-parallel-sharding-strategy ";
  for (const std::string strategy : {"optim_grads", "optim_grads_params"}) {
    for (const std::string graph :
         {"--cuda-graph-impl full_iteration", "--cuda-graph-impl local --cuda-graph-scope full_iteration",
          "--cuda-graph-impl full_iteration --cuda-graph-include-optimizer",
          "--cuda-graph-impl local --cuda-graph-scope full_iteration --cuda-graph-include-optimizer "
          "--overlap-grad-reduce"}) {
      PretrainArgs a = testing::parse_pretrain_args(base + strategy + " " + graph);
      EXPECT_NO_THROW(validate_pretrain_args(a)) << strategy << " " << graph;
      EXPECT_TRUE(a.cuda_graph.full_iteration());
    }
    for (const std::string graph : {"--cuda-graph-impl local", "--cuda-graph-impl local --cuda-graph-scope attn mlp",
                                    "--cuda-graph-impl transformer_engine --cuda-graph-scope attn"}) {
      testing::expect_error_text(
          [&] {
            PretrainArgs a = testing::parse_pretrain_args(base + strategy + " " + graph);
            validate_pretrain_args(a);
          },
          "--data-parallel-sharding-strategy " + strategy + " with per-layer CUDA graphs", graph);
    }
  }
}

}  // namespace
}  // namespace mt
