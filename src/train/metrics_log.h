// Where `megatron pretrain` reports besides its log lines (rank 0 only):
//   --tensorboard-dir D   TensorBoard event files (train/tensorboard.h) with Megatron-LM's tag names
//                         (megatron/training/training.py training_log, evaluate_and_print_results);
//                         the tags are listed in docs/flags.md "TensorBoard".
//   --metrics-file F      JSON lines appended to F: one object per --log-interval ("type": "train")
//                         and per evaluation ("type": "validation"); non-finite numbers are null.
#pragma once
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "train/tensorboard.h"

namespace mt {

/// The values of one training log point (Megatron's training_log arguments).
struct TrainLogPoint {
  int64_t iteration = 0;          ///< iterations done
  int64_t consumed_samples = 0;   ///< after `iteration`
  double lm_loss = 0;             ///< mean over the log interval's finite losses (NaN when none)
  double learning_rate = 0;
  int64_t batch_size = 0;         ///< global batch size
  double grad_norm = 0;
  double loss_scale = 1;
  int world_size = 1;
  double iteration_time_s = 0;    ///< elapsed time per iteration
  double tflops_per_gpu = 0;      ///< Megatron's "throughput"
  double tokens_per_s = 0;
  int64_t skipped_iterations = 0, nan_iterations = 0;  ///< in this log interval
  std::optional<double> mem_allocated_bytes, mem_reserved_bytes;  ///< --log-memory-to-tensorboard
  std::vector<std::pair<std::string, float>> timers_max_ms;       ///< --timing-log-level timers
};

struct MetricsLogOptions {
  std::string tensorboard_dir;     ///< "" = no event file
  int64_t tensorboard_log_interval = 1;
  bool log_timers = false;         ///< --log-timers-to-tensorboard
  bool log_memory = false;         ///< --log-memory-to-tensorboard
  bool log_validation_ppl = false; ///< --log-validation-ppl-to-tensorboard
  bool log_loss_scale = true;      ///< off with --no-log-loss-scale-to-tensorboard
  std::string metrics_file;        ///< "" = none
};

/// Writes TensorBoard scalars and JSON lines. Construct on the logging rank only. Errors:
/// mt::Error naming the directory or file when it cannot be created or written.
class MetricsLog {
 public:
  explicit MetricsLog(const MetricsLogOptions& opt);
  /// Per-iteration values of a log interval: "lm loss" and "learning-rate" (+ "vs samples") at
  /// every iteration that is a multiple of --tensorboard-log-interval.
  void iteration_loss(int64_t iteration, int64_t consumed_samples, double loss, double lr, int64_t batch_size);
  /// The log point (TensorBoard: grad norm, loss scale, world size, timers, memory, at
  /// log iterations that are multiples of --tensorboard-log-interval; the metrics file always).
  void train_point(const TrainLogPoint& p);
  /// "lm loss validation" (+ " vs samples", + " ppl" with --log-validation-ppl-to-tensorboard).
  void validation(int64_t iteration, int64_t consumed_samples, double loss, double ppl);
  /// Hands buffered records to the OS.
  void flush();
  bool active() const { return tb_ != nullptr || metrics_.is_open(); }

 private:
  void line(const std::string& json_text);
  MetricsLogOptions opt_;
  std::unique_ptr<TensorBoardWriter> tb_;
  std::ofstream metrics_;
};

}  // namespace mt
