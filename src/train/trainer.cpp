#include "train/trainer.h"

#include <atomic>
#include <chrono>
#include <cmath>

#include "core/logging.h"
#include "ops/elementwise.h"
#include "train/megatron_compat.h"

namespace mt {

namespace {
std::atomic<bool> g_training_started{false};

ExitPolicyOptions exit_options(const PretrainArgs& args) {
  ExitPolicyOptions o;
  o.exit_interval = args.exit_interval;
  o.exit_duration_in_mins = args.exit_duration_in_mins;
  if (args.exit_signal_handler) o.received_signal = &ExitSignalHandler::received;
  return o;
}
}  // namespace

bool training_started() { return g_training_started.load(); }

Trainer::Trainer(TrainingSetup& setup)
    : setup_(setup),
      signal_handler_(setup.args().exit_signal_handler ? std::make_optional<ExitSignalHandler>() : std::nullopt),
      exit_policy_(exit_options(setup.args()), setup.world(), setup.stream()),
      logger_(setup),
      steps_(setup.model_setup(), setup.args().cuda_graph, setup.args().seed, &logger_.timers(), setup.stream()),
      checkpointer_(setup),
      eval_loss_(setup.device(), 4) {}

Trainer::~Trainer() = default;

TrainingResult Trainer::train() {
  TrainingSetup& s = setup_;
  const PretrainArgs& args = s.args();
  const LrScheduleConfig schedule = args.lr_schedule();
  const LrScheduleConfig decoupled_schedule = args.optim.decoupled_lr ? args.decoupled_lr_schedule() : schedule;
  TrainingResult result;
  int64_t iteration = s.start_iteration(), consumed = s.start_consumed_samples();
  log_info("> training {} iterations from iteration {}: global batch {} = {} micro-batches of {}, seq {}",
           args.train_iters, iteration, args.global_batch_size, s.num_microbatches(), args.micro_batch_size,
           args.model.seq_length);
  if (!args.batch_schedule.is_constant())
    log_info("> {}: global batch {} at {} consumed samples", args.batch_schedule.describe(),
             args.batch_schedule.at(consumed), consumed);
  const int64_t per_micro = args.micro_batch_size * args.data_parallel_size;
  int64_t batch = args.batch_schedule.at(consumed);  // this iteration's global batch size
  // Validation before the first iteration of a fresh run gives the starting point of the curve.
  if (!s.resumed())
    if (const auto r = evaluate(0, consumed)) result.validation[0] = *r;
  logger_.restart_clock();
  const auto loop_start = std::chrono::steady_clock::now();
  const int64_t first_iteration = iteration;
  g_training_started.store(true);
  ProfileWindow profile(args, s.world().rank(), s.device().is_cuda());
  while (iteration < args.train_iters) {
    const float lr = static_cast<float>(learning_rate(schedule, args.lr_step(iteration, consumed)));
    const float decoupled_lr =
        args.optim.decoupled_lr ? static_cast<float>(learning_rate(decoupled_schedule, args.lr_step(iteration, consumed)))
                                : 0.f;
    profile.before_step(iteration);
    const int64_t next_batch = args.batch_schedule.at(consumed + batch);
    s.stager().stage(*s.data().train, {consumed, batch / per_micro},
                     iteration + 1 < args.train_iters ? BatchStager::Batch{consumed + batch, next_batch / per_micro}
                                                      : BatchStager::Batch{},
                     s.stream());
    steps_.step(iteration, lr, s.stager().micro_batches(), logger_.loss_slot(), checkpointer_.take_snapshot_pending(),
                decoupled_lr);
    ++iteration;
    consumed += batch;
    profile.after_step(iteration);
    logger_.step_done(iteration, steps_.take_host_issue_ms(), consumed - batch, batch);
    const bool batch_changes = next_batch != batch;
    batch = next_batch;
    if (logger_.due(iteration)) {
      TrainLogRecord& r = result.log.emplace_back(logger_.log(iteration, consumed, lr));
      for (size_t i = 0; i < r.losses.size(); ++i)
        result.losses[iteration - static_cast<int64_t>(r.losses.size() - i) + 1] = r.losses[i];
    }
    bool restart_clock = false;
    if (iteration % args.eval_interval == 0 || iteration == args.train_iters) {
      logger_.clear_progress();
      if (const auto r = evaluate(iteration, consumed)) result.validation[iteration] = *r;
      restart_clock = true;
    }
    const std::string exit_reason = exit_policy_.check(iteration);
    // Megatron-LM saves a checkpoint before the first iteration of a new number of micro-batches.
    if (checkpointer_.due(iteration, !exit_reason.empty()) || (batch_changes && !args.save.empty())) {
      logger_.clear_progress();
      logger_.check_nan(iteration);  // never save what a NaN produced
      checkpointer_.save(iteration, consumed);
      restart_clock = true;
    }
    if (restart_clock) logger_.restart_clock();
    if (!exit_reason.empty() && iteration < args.train_iters) {
      log_info("exiting program at iteration {} ({})", iteration, exit_reason);
      result.exit_reason = exit_reason;
      break;
    }
  }
  log_loop_time(iteration - first_iteration, loop_start);
  checkpointer_.finish(iteration);
  s.world().barrier();
  logger_.finish();
  result.iteration = iteration;
  result.consumed_samples = consumed;
  return result;
}

// The whole loop's time per iteration, everything included (logging, validation, checkpoints and
// their effect on the steps; not the wait for the last --async-save): what
// bench/checkpoint_bench.sh compares with and without saving.
void Trainer::log_loop_time(int64_t iterations, std::chrono::steady_clock::time_point start) const {
  setup_.stream().synchronize();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (iterations > 0)
    log_info("> training loop: {} iterations in {:.3f} s: {:.2f} ms per iteration (logging, validation and "
             "checkpoints included)", iterations, s, 1e3 * s / static_cast<double>(iterations));
}

std::optional<EvalResult> Trainer::evaluate(int64_t iteration, int64_t consumed) {
  TrainingSetup& s = setup_;
  const PretrainArgs& args = s.args();
  if (!s.data().valid || args.eval_iters == 0) return std::nullopt;  // Megatron: no validation
  const Stream& stream = s.stream();
  ModelSetup& parts = s.model_setup();
  const ProcessGroups& g = s.groups();
  parts.grad_sync().finish_param_sync(stream);  // the last step's parameter all-gather is complete
  const Tensor eval_loss = eval_loss_.as(DType::kF32, {1});
  fill(eval_loss, 0.f, stream);
  const uint64_t* device_iteration = steps_.begin_validation(iteration);
  for (int64_t e = 0; e < args.eval_iters; ++e) {
    s.stager().stage(*s.data().valid, {e * args.global_batch_size, s.num_microbatches()}, {}, stream);
    const std::vector<MicroBatch> mbs = s.stager().micro_batches();
    steps_.validation_forward([&] {
      const RunContext rc{args.seed, iteration, g.dp->rank(), g.dp->size(), false, device_iteration};
      parts.executor().run(parts.eval_plan(), mbs, rc, eval_loss, 1.f / static_cast<float>(args.eval_iters), Tensor(),
                           stream);
    });
  }
  // The loss lives on the last pipeline stage; sum over DP and CP, then over PP (other stages add 0).
  g.dp_cp->all_reduce(eval_loss, ReduceOp::kSum, stream);
  g.pp->all_reduce(eval_loss, ReduceOp::kSum, stream);
  float host = 0;
  copy_bytes(&host, Device::cpu(), eval_loss.data(), s.device(), 4, stream);
  stream.synchronize();
  const EvalResult r{host, std::exp(std::min<double>(host, 20.0))};
  logger_.validation(iteration, consumed, r);
  return r;
}

int run_pretrain(PretrainArgs args) {
  const std::unique_ptr<TrainingSetup> setup = TrainingSetup::launch(std::move(args));
  Trainer trainer(*setup);
  trainer.train();
  setup->stream().synchronize();
  setup->log_memory_report();
  return 0;
}

}  // namespace mt
