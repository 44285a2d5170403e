#include "train/training_logger.h"

#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "core/logging.h"
#include "ops/elementwise.h"

namespace mt {

namespace {

std::string timestamp() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", std::localtime(&t));
  return buf;
}

}  // namespace

TrainingLogger::TrainingLogger(TrainingSetup& setup)
    : setup_(setup),
      args_(setup.args()),
      schedule_(args_.lr_schedule()),
      losses_(setup.device(), static_cast<size_t>(args_.log_interval) * 4),
      found_inf_(setup.device(), static_cast<size_t>(args_.log_interval) * 4),
      timers_(args_.timing_log_level, setup.device()),
      timing_option_(parse_timing_log_option(args_.timing_log_option)),
      progress_enabled_(args_.progress && isatty(STDERR_FILENO)) {
  const Stream& stream = setup.stream();
  fill(losses_.as(DType::kF32, {args_.log_interval}), 0.f, stream);
  fill(found_inf_.as(DType::kI32, {args_.log_interval}), 0.f, stream);
  if (setup.world().rank() == 0 && (!args_.tensorboard_dir.empty() || !args_.metrics_file.empty()))
    metrics_ = std::make_unique<MetricsLog>(MetricsLogOptions{
        args_.tensorboard_dir, args_.tensorboard_log_interval, args_.log_timers_to_tensorboard,
        args_.log_memory_to_tensorboard, args_.log_validation_ppl_to_tensorboard, args_.log_loss_scale_to_tensorboard,
        args_.metrics_file});
  last_skipped_ = setup.optimizer().read_scalars_sync(stream).skipped_iters;
  t_last_ = std::chrono::steady_clock::now();
}

TrainingLogger::~TrainingLogger() = default;

Tensor TrainingLogger::loss_slot() const {
  return losses_.as(DType::kF32, {args_.log_interval}).flat_range(iters_since_log_, 1);
}

void TrainingLogger::step_done(int64_t iteration, double host_issue_ms, int64_t consumed_before, int64_t batch) {
  steps_since_log_.push_back({consumed_before, batch});
  const Device device = setup_.device();
  copy_bytes(found_inf_.as(DType::kI32, {args_.log_interval}).flat_range(iters_since_log_, 1).data(), device,
             static_cast<const char*>(setup_.optimizer().scalars().data()) + offsetof(OptimizerScalars, found_inf),
             device, 4, setup_.stream());
  ++iters_since_log_;
  host_issue_ms_ += host_issue_ms;
  update_progress(iteration);
}

bool TrainingLogger::due(int64_t iteration) const {
  return iteration % args_.log_interval == 0 || iteration == args_.train_iters;
}

TrainLogRecord TrainingLogger::log(int64_t iteration, int64_t consumed, float lr) {
  const Stream& stream = setup_.stream();
  const Tensor losses = losses_.as(DType::kF32, {args_.log_interval});
  check_nan(iteration);
  TrainLogRecord r;
  r.losses.resize(static_cast<size_t>(iters_since_log_));
  setup_.groups().dp_cp->all_reduce(losses, ReduceOp::kSum, stream);
  setup_.groups().pp->all_reduce(losses, ReduceOp::kSum, stream);  // only the last stage has a loss
  copy_bytes(r.losses.data(), Device::cpu(), losses.data(), setup_.device(), r.losses.size() * 4, stream);
  const OptimizerScalars sc = setup_.optimizer().read_scalars_sync(stream);  // synchronizes
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_last_).count() / iters_since_log_;
  double loss_sum = 0;
  int64_t n_ok = 0, n_nan = 0;
  for (float l : r.losses) {
    if (std::isfinite(l)) {
      loss_sum += l;
      ++n_ok;
    } else {
      ++n_nan;
    }
  }
  TrainLogPoint& p = r.point;
  p.iteration = iteration;
  p.consumed_samples = consumed;
  p.lm_loss = n_ok ? loss_sum / n_ok : NAN;
  p.learning_rate = lr;
  // The samples and FLOPs of the interval's iterations (their batches differ during a ramp-up).
  double samples = 0, flops = 0;
  for (const Step& st : steps_since_log_) {
    samples += static_cast<double>(st.batch);
    flops += setup_.model().config().flops_per_iteration(st.batch, args_.tensor_model_parallel_size);
  }
  const double n_steps = static_cast<double>(std::max<size_t>(steps_since_log_.size(), 1));
  p.batch_size = steps_since_log_.empty() ? args_.global_batch_size : steps_since_log_.back().batch;
  p.grad_norm = sc.grad_norm;
  p.loss_scale = sc.loss_scale;
  p.world_size = setup_.world().size();
  p.iteration_time_s = ms / 1e3;
  p.tokens_per_s = samples / n_steps * static_cast<double>(args_.model.seq_length) / (ms / 1e3);
  p.tflops_per_gpu = flops / n_steps / (ms / 1e3) / 1e12 / setup_.world().size();  // per GPU
  p.skipped_iterations = sc.skipped_iters - last_skipped_;
  p.nan_iterations = n_nan;
  p.mem_allocated_bytes = static_cast<double>(device_bytes_allocated(setup_.device()));
  if (setup_.device().is_cuda()) p.mem_reserved_bytes = static_cast<double>(device_memory_in_use(setup_.device()));
  clear_progress();
  r.line = line(p, ms, lr, sc);
  r.line += setup_.model().log_statistics(setup_.world(), iters_since_log_, stream);  // e.g. MoE losses, loads
  log_info("{}", r.line);
  const std::string timing =
      timing_report(timers_, timing_option_, setup_.world(), stream, iters_since_log_, &p.timers_max_ms);
  if (!timing.empty()) log_info("{}", timing);
  if (metrics_) write_metrics(r);
  last_skipped_ = sc.skipped_iters;
  iters_since_log_ = 0;
  steps_since_log_.clear();
  host_issue_ms_ = 0;
  fill(losses, 0.f, stream);
  fill(found_inf_.as(DType::kI32, {args_.log_interval}), 0.f, stream);
  restart_clock();
  return r;
}

// The Megatron log line (training_log's format).
std::string TrainingLogger::line(const TrainLogPoint& p, double ms, float lr, const OptimizerScalars& sc) const {
  return fmt::format(
      " [{}] iteration {:8d}/{:8d} | consumed samples: {:12d} | elapsed time per iteration (ms): {:.1f} | "
      "throughput per GPU (TFLOP/s/GPU): {:.1f} |{} tokens per second: {:.0f} | learning rate: {:.6E} | "
      "global batch size: {:5d} | lm loss: {:.6E} | loss scale: {:.1f} | grad norm: {:.3f} | "
      "number of skipped iterations: {:3d} | number of nan iterations: {:3d} | host time per iteration (ms): "
      "{:.2f} |",
      timestamp(), p.iteration, args_.train_iters, p.consumed_samples, ms, p.tflops_per_gpu,
      // MFU against the dense bf16 peak (docs/flags.md), on GPUs only
      setup_.device().is_cuda() ? fmt::format(" MFU: {:.1f}% |", 100.0 * p.tflops_per_gpu / kMfuPeakTflops) : "",
      p.tokens_per_s, lr,
      p.batch_size, p.lm_loss, sc.loss_scale, sc.grad_norm, p.skipped_iterations, p.nan_iterations,
      host_issue_ms_ / static_cast<double>(iters_since_log_));
}

void TrainingLogger::write_metrics(const TrainLogRecord& r) {
  const int64_t iteration = r.point.iteration, n = static_cast<int64_t>(r.losses.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = iteration - n + 1 + i;
    const Step& st = steps_since_log_.at(static_cast<size_t>(i));
    metrics_->iteration_loss(k, st.consumed_before + st.batch, r.losses[static_cast<size_t>(i)],
                             learning_rate(schedule_, args_.lr_step(k - 1, st.consumed_before)), st.batch);
  }
  metrics_->train_point(r.point);
}

void TrainingLogger::check_nan(int64_t iteration) {
  const int64_t n = iters_since_log_;
  if (!args_.check_for_nan_in_loss_and_grad || n == 0) return;
  const Stream& stream = setup_.stream();
  std::vector<float> l(static_cast<size_t>(n));
  std::vector<int32_t> inf(static_cast<size_t>(n));
  copy_bytes(l.data(), Device::cpu(), losses_.data(), setup_.device(), l.size() * 4, stream);
  copy_bytes(inf.data(), Device::cpu(), found_inf_.data(), setup_.device(), inf.size() * 4, stream);
  stream.synchronize();
  const bool dynamic_scaling = args_.optim.scaler.dynamic;  // fp16: overflowed steps are skipped, not errors
  int64_t bad[2] = {-1, 0};  // first bad iteration, what (1 loss, 2 gradient)
  for (int64_t i = 0; i < n && bad[0] < 0; ++i) {
    if (!std::isfinite(l[i])) bad[0] = iteration - n + 1 + i, bad[1] = 1;
    else if (inf[i] != 0 && !dynamic_scaling) bad[0] = iteration - n + 1 + i, bad[1] = 2;
  }
  Communicator& world = setup_.world();
  const std::vector<char> all = all_gather_host(world, bad, sizeof(bad), stream);
  for (int r = 0; r < world.size(); ++r) {
    int64_t b[2];
    std::memcpy(b, all.data() + r * sizeof(bad), sizeof(bad));
    if (b[0] >= 0 && (bad[0] < 0 || b[0] < bad[0])) bad[0] = b[0], bad[1] = b[1];
  }
  const int64_t consumed_before_bad =
      bad[0] < 0 ? 0 : steps_since_log_.at(static_cast<size_t>(bad[0] - (iteration - n + 1))).consumed_before;
  MT_REQUIRE(bad[0] < 0,
             "iteration {}: the {} is NaN or Inf; stopping before anything more is saved "
             "(--check-for-nan-in-loss-and-grad; learning rate there {:.3E}: is --lr {} too high?). "
             "--no-check-for-nan-in-loss-and-grad skips such iterations instead",
             bad[0], bad[1] == 1 ? "loss" : "gradient norm",
             learning_rate(schedule_, args_.lr_step(bad[0] - 1, consumed_before_bad)), args_.lr);
}

void TrainingLogger::validation(int64_t iteration, int64_t consumed, const EvalResult& r) {
  if (metrics_) metrics_->validation(iteration, consumed, r.loss, r.ppl);
  const std::string line = fmt::format(
      " validation loss at iteration {} | lm loss value: {:.6E} | lm loss PPL: {:.6E} | ", iteration, r.loss, r.ppl);
  const std::string bar(line.size(), '-');
  log_info("{}\n{}\n{}", bar, line, bar);
}

void TrainingLogger::restart_clock() { t_last_ = std::chrono::steady_clock::now(); }

void TrainingLogger::update_progress(int64_t iteration) {
  if (!progress_enabled_) return;
  const int width = 30;
  const int64_t total = args_.train_iters;
  const int done = static_cast<int>(width * iteration / std::max<int64_t>(total, 1));
  std::fprintf(stderr, "\r[%.*s%*s] %lld/%lld", done, "##############################", width - done, "",
               static_cast<long long>(iteration), static_cast<long long>(total));
  std::fflush(stderr);
  progress_dirty_ = true;
}

void TrainingLogger::clear_progress() {
  if (progress_enabled_ && progress_dirty_) std::fprintf(stderr, "\r%*s\r", 60, "");
  progress_dirty_ = false;
}

void TrainingLogger::finish() {
  if (metrics_) metrics_->flush();
  clear_progress();
}

}  // namespace mt
