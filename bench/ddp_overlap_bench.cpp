// Where the data-parallel gradient reduction runs relative to the backward: a timeline from CUDA
// events. One process per GPU (mpiexec -np 2 build/ddp_overlap_bench). GPT-2 124M shape, bf16,
// micro-batch 16, random tokens. For --overlap-grad-reduce off and on it times one training step
// (forward + backward through the executor, then the optimizer step) and records an event before
// and after every bucket collective (a Communicator decorator around the DP group, also around
// the communicator GradSync splits off for overlap). Printed per collective, in ms from the
// step's start: start, end, and whether it ran inside the forward+backward window; and the
// window's length against the no-overlap run (a longer backward under overlap = the collectives
// slow the compute down).
#include <fmt/format.h>

#include <memory>
#include <vector>

#include "comm/bootstrap.h"
#include "model/gpt_model.h"
#include "core/device.h"
#include "ops/elementwise.h"
#include "optim/grad_sync.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include "train/pipeline.h"
#include "train/train_step.h"

namespace {

using namespace mt;

// Records a CUDA event before and after each collective of more than one element.
class TimedCommunicator final : public ForwardingCommunicator {
 public:
  struct Op {
    std::string what;
    std::unique_ptr<Event> begin, end;
  };
  TimedCommunicator(std::shared_ptr<Communicator> inner, std::shared_ptr<std::vector<Op>> log)
      : ForwardingCommunicator(std::move(inner)), log_(std::move(log)) {}
  void all_reduce(const Tensor& t, ReduceOp op, const Stream& s) override {
    timed(fmt::format("all_reduce {:.0f} MB", t.nbytes() / 1e6), t.numel(), s, [&] { inner().all_reduce(t, op, s); });
  }
  void all_gather(const Tensor& out, const Tensor& in, const Stream& s) override {
    timed(fmt::format("all_gather {:.0f} MB", out.nbytes() / 1e6), out.numel(), s,
          [&] { inner().all_gather(out, in, s); });
  }
  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, const Stream& s) override {
    timed(fmt::format("reduce_scatter {:.0f} MB", in.nbytes() / 1e6), in.numel(), s,
          [&] { inner().reduce_scatter(out, in, op, s); });
  }

 protected:
  std::shared_ptr<Communicator> wrap(std::shared_ptr<Communicator> split) override {
    return std::make_shared<TimedCommunicator>(std::move(split), log_);
  }

 private:
  template <typename F>
  void timed(std::string what, int64_t n, const Stream& s, F&& f) {
    if (n <= 1) return f();
    Op op{std::move(what), std::make_unique<Event>(s.device()), std::make_unique<Event>(s.device())};
    op.begin->record(s);
    f();
    op.end->record(s);
    log_->push_back(std::move(op));
  }
  std::shared_ptr<std::vector<Op>> log_;
};

int bench_main() {
  const LaunchEnv env = read_launch_env();
  const Device device = local_device(DeviceType::kCUDA, env);
  set_current_device(device);
  auto world = init_world(device, env, 10.0);
  TransformerConfig c;
  c.num_layers = 12;
  c.hidden_size = 768;
  c.num_attention_heads = 12;
  c.seq_length = 1024;
  c.vocab_size = 50257;
  c.hidden_dropout = c.attention_dropout = 0.f;
  const int64_t mb = 16, S = c.seq_length;
  ParallelConfig pc;
  validate_and_derive(pc, world->size());
  ProcessGroups g = build_process_groups(world, pc);
  auto log = std::make_shared<std::vector<TimedCommunicator::Op>>();
  g.dp = std::make_shared<TimedCommunicator>(g.dp, log);
  double base_window = 0;
  for (const bool overlap : {false, true}) {
    pipeline::ScheduleConfig sc;
    sc.num_microbatches = 1;
    const auto chunks = pipeline::layers_of(0, pipeline::PipelineLayout{c.num_layers});
    const PipelinePlan plan = plan_pipeline(sc, 0, chunks);
    Stream st(device);
    GPTModel model(c, mb, DType::kBF16, device, g, false, ParamLayout(pc.dp, overlap ? 40000000 : 0),
                   model_layout(chunks, {&plan}));
    PipelineExecutor exec(model, g.pp, {&plan});
    GradSync sync(model.params(), g.dp, DdpConfig{overlap, false, false});
    AdamWOptimizer opt(sync, OptimizerConfig{}, st, {nullptr, g.mp, 0});
    model.set_hooks(&sync);
    model.params().initialize(1, st);
    Buffer data(device, static_cast<size_t>(2 * S * mb) * 4);
    const Tensor tok(data.data(), DType::kI32, device, {S, mb});
    const Tensor lab(static_cast<char*>(data.data()) + S * mb * 4, DType::kI32, device, {S, mb});
    memset_tensor(tok, 0, st);
    memset_tensor(lab, 0, st);
    MicroBatch b{tok, lab, Tensor()};
    b.loss_weight = 1.f / static_cast<float>(S * mb * pc.dp);
    Buffer lb(device, 4);
    const Tensor loss = lb.as(DType::kF32, {1});
    Event t0(device), t1(device), t2(device);
    for (int it = 0; it < 6; ++it) {
      log->clear();
      world->barrier();
      t0.record(st);
      sync.zero_grad_buffer(st);
      exec.run(plan, {b}, {1, it, world->rank(), pc.dp, true}, loss, 1.f, opt.loss_scale_tensor(), st);
      t1.record(st);
      opt.step(1e-4f, st);
      t2.record(st);
      st.synchronize();
      if (it < 5 || world->rank() != 0) continue;
      const double window = t1.elapsed_ms_since(t0), step = t2.elapsed_ms_since(t0);
      if (!overlap) base_window = window;
      fmt::print("overlap {}: forward+backward {:.2f} ms ({:+.2f} vs no overlap), step {:.2f} ms, {} buckets\n",
                 overlap, window, window - base_window, step, model.params().buckets().size());
      for (const auto& op : *log)
        fmt::print("   {:<22} {:8.2f} .. {:8.2f} ms ({:.2f} ms){}\n", op.what, op.begin->elapsed_ms_since(t0),
                   op.end->elapsed_ms_since(t0), op.end->elapsed_ms_since(*op.begin),
                   op.end->elapsed_ms_since(t1) <= 0 ? "  inside forward+backward" : "");
    }
  }
  return 0;
}

}  // namespace

int main() {
  try {
    return bench_main();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_overlap_bench: %s\n", e.what());
    return 1;
  }
}
