// What `megatron pretrain` reports while it trains (Megatron's training_log and
// evaluate_and_print_results, megatron/training/training.py): the per-iteration losses and the
// optimizer's found_inf stay on the device until a log point, where they are reduced over the
// data × context parallel and pipeline groups and read once; the Megatron log line (iteration,
// consumed samples, time, throughput, learning rate, loss, loss scale, grad norm, skipped and NaN
// iterations) with the model's part (LanguageModel::log_statistics: the MoE losses and loads);
// the --timing-log-level report; --check-for-nan-in-loss-and-grad; the validation line; the
// metrics file and TensorBoard (train/metrics_log.h, rank 0); the terminal progress line.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/timers.h"
#include "optim/lr_schedule.h"
#include "train/metrics_log.h"
#include "train/timing_log.h"
#include "train/training_setup.h"

namespace mt {

/// Result of one evaluation (for logs and tests).
struct EvalResult {
  double loss = 0;
  double ppl = 0;
};

/// What one log point reported.
struct TrainLogRecord {
  TrainLogPoint point;
  /// The losses of the iterations (point.iteration - losses.size(), point.iteration] (summed over
  /// the data-parallel and pipeline ranks: the global batch's loss).
  std::vector<float> losses;
  std::string line;  ///< the log line as printed
};

class TrainingLogger {
 public:
  /// The device buffers for --log-interval iterations, the timers, the metrics file and
  /// TensorBoard writer (rank 0; errors: mt::Error naming a directory or file that cannot be
  /// written).
  explicit TrainingLogger(TrainingSetup& setup);
  ~TrainingLogger();
  TrainingLogger(const TrainingLogger&) = delete;
  TrainingLogger& operator=(const TrainingLogger&) = delete;

  /// --timing-log-level's timers (for the step runner).
  Timers& timers() { return timers_; }
  /// fp32 [1] on the device: where the next training step adds its loss.
  Tensor loss_slot() const;
  /// After training step `iteration` - 1 (`iteration` steps done), which started after
  /// `consumed_before` samples and trained on `batch` (its global batch size): keeps its found_inf
  /// (a device copy), the host's time to issue it and its batch; advances the progress line.
  void step_done(int64_t iteration, double host_issue_ms, int64_t consumed_before, int64_t batch);
  /// A log line is due after `iteration` steps (every --log-interval, and at --train-iters).
  bool due(int64_t iteration) const;
  /// The log point after `iteration` steps (consumed samples, the last step's learning rate):
  /// checks for NaN (check_nan), reduces and prints the losses since the last log point, the
  /// model's statistics and the timers, writes the metrics. Collective over the world.
  TrainLogRecord log(int64_t iteration, int64_t consumed, float lr);
  /// --check-for-nan-in-loss-and-grad: the iterations since the last log point (their losses and
  /// found_inf still on the device) are checked on every rank; all ranks stop together. Collective
  /// over the world. Errors: mt::Error naming the first bad iteration, what was not finite and the
  /// learning rate there (with fp16's dynamic loss scaling a non-finite gradient is a skipped
  /// step, not an error).
  void check_nan(int64_t iteration);
  /// The validation line and metrics of the evaluation after `iteration` steps.
  void validation(int64_t iteration, int64_t consumed, const EvalResult& result);
  /// Restarts the clock of "elapsed time per iteration" (after validation and checkpoints).
  void restart_clock();
  /// Clears the progress line (before other output).
  void clear_progress();
  /// Flushes the metrics file and TensorBoard; clears the progress line.
  void finish();

 private:
  std::string line(const TrainLogPoint& p, double ms, float lr, const OptimizerScalars& sc) const;
  void write_metrics(const TrainLogRecord& record);
  void update_progress(int64_t iteration);

  TrainingSetup& setup_;
  const PretrainArgs& args_;
  LrScheduleConfig schedule_;
  Buffer losses_, found_inf_;  // fp32 / int32 [log_interval]
  Timers timers_;
  TimingLogOption timing_option_;
  std::unique_ptr<MetricsLog> metrics_;  // rank 0 with --tensorboard-dir / --metrics-file
  int64_t iters_since_log_ = 0;
  struct Step {
    int64_t consumed_before, batch;
  };
  std::vector<Step> steps_since_log_;  // the iterations since the last log point
  int64_t last_skipped_ = 0;
  double host_issue_ms_ = 0;
  std::chrono::steady_clock::time_point t_last_;
  bool progress_enabled_ = false, progress_dirty_ = false;
};

}  // namespace mt
