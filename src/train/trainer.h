// `megatron pretrain`: the training loop in the shape of Megatron's pretrain()
// (megatron/training/training.py) and torchtitan's Trainer, built from components:
//   TrainingSetup   (train/training_setup.h)   groups, plans, model, optimizer, data, resume
//   StepRunner      (train/step_runner.h)      eager / per-layer graphs / full-iteration graph
//   TrainingLogger  (train/training_logger.h)  loss reduction, NaN check, log line, metrics
//   Checkpointer    (train/checkpointer.h)     sync / async saves
//   ExitPolicy      (train/exit_signal.h)      --exit-interval, --exit-duration-in-mins, signals
// Iterations of gradient accumulation over micro-batches and an optimizer step, Megatron-format
// log lines every --log-interval, evaluation every --eval-interval, checkpoints every
// --save-interval. No host synchronisation inside an iteration except at log, eval and save
// points (docs/architecture.md principle 5).
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "train/arguments.h"
#include "train/checkpointer.h"
#include "train/exit_signal.h"
#include "train/step_runner.h"
#include "train/training_logger.h"
#include "train/training_setup.h"

namespace mt {

/// What a training run did (for tests; the binary prints it).
struct TrainingResult {
  int64_t iteration = 0;         ///< iterations done (the checkpoint's included)
  int64_t consumed_samples = 0;
  std::vector<TrainLogRecord> log;           ///< every log point
  std::map<int64_t, float> losses;           ///< per iteration of this run: the global batch's loss
  std::map<int64_t, EvalResult> validation;  ///< per iteration evaluated (0: before the first step)
  std::string exit_reason;                   ///< why it stopped before --train-iters; "" otherwise
};

class Trainer {
 public:
  /// The components over `setup` (which must outlive the trainer); installs the
  /// --exit-signal-handler handlers.
  explicit Trainer(TrainingSetup& setup);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// Trains from setup.start_iteration() to --train-iters or an exit (ExitPolicy). Collective over
  /// the world. Errors: mt::Error for data errors, a NaN stop (--check-for-nan-in-loss-and-grad),
  /// checkpoint write errors.
  TrainingResult train();

 private:
  /// The validation over --eval-iters batches after `iteration` steps (nullopt: no validation data
  /// or --eval-iters 0). Collective.
  std::optional<EvalResult> evaluate(int64_t iteration, int64_t consumed);
  void log_loop_time(int64_t iterations, std::chrono::steady_clock::time_point start) const;

  TrainingSetup& setup_;
  std::optional<ExitSignalHandler> signal_handler_;
  ExitPolicy exit_policy_;
  TrainingLogger logger_;
  StepRunner steps_;
  Checkpointer checkpointer_;
  Buffer eval_loss_;  // fp32 [1]
};

/// Runs pretraining (TrainingSetup::launch, then Trainer::train and the memory report); returns
/// the process exit code. Errors: mt::Error for invalid arguments, data or checkpoints (the caller
/// prints them and exits non-zero).
int run_pretrain(PretrainArgs args);

/// True once a Trainer has entered its training loop in this process (errors before that point
/// are the same on every rank; apps/megatron.cpp prints them on rank 0 only).
bool training_started();

}  // namespace mt
