// Megatron-LM's pretraining flags beyond the model and parallel ones: sample-based training and
// schedules (--train-samples, --lr-*-samples, --lr-warmup-fraction, --lr-warmup-init, the WSD
// flags), --profile, and the flags that only select an implementation in Megatron-LM (accepted
// without effect) or a feature not built here (refused with the reason). One table of the
// latter, megatron_compat_flags(), is what docs/flags.md "Megatron-LM flags" lists: a Megatron-LM
// launch script (pretrain_gpt.py's arguments: the examples' flags and the common ones of
// arguments.py) runs as it is, or stops before training with a message naming the feature.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace CLI {
class App;
}

namespace mt {

struct PretrainArgs;

/// How a Megatron-LM flag without an implementation of its own is handled.
enum class CompatHandling {
  kNoOp,     ///< accepted, no effect: what it selects is always on here, or has no meaning here
  kRefused,  ///< an error before training: the feature it asks for is not built
};

/// What follows a compat flag on the command line.
enum class CompatValue {
  kSwitch,       ///< nothing
  kText,         ///< one value, any text
  kChoice,       ///< one value out of `choices` ('|'-separated)
  kNonNegative,  ///< one integer >= 0
  kNumber,       ///< one number
  kList,         ///< one or more values (a quoted list split into words by the shell)
};

struct CompatFlag {
  const char* name;        ///< Megatron-LM's spelling(s), ','-separated, e.g. "--use-mcore-models"
  CompatValue value;
  const char* choices;     ///< kChoice: the values Megatron-LM accepts, '|'-separated; else nullptr
  CompatHandling handling;
  const char* reason;      ///< no-op: why it changes nothing; refused: the feature that is not built
};

/// Every Megatron-LM flag accepted without effect or refused (in docs/flags.md's order).
std::span<const CompatFlag> megatron_compat_flags();

/// Registers the table's flags and the implemented compat flags (sample-based training and
/// schedules, --profile*, --no-position-embedding) on `app`, writing into `args`.
void add_megatron_compat_options(CLI::App& app, PretrainArgs& args);

/// Throws mt::Error for a refused flag given (the message names the flag, the feature that is not
/// built and what to use instead) and for the combinations Megatron-LM refuses (iteration- and
/// sample-based flags mixed, --no-position-embedding with learned positions, --profile-step-end
/// <= --profile-step-start, --tokenizer-type TikTokenizer). Called by validate_pretrain_args and
/// first thing in TrainingSetup (before any rank is set up).
void check_megatron_compat(const PretrainArgs& args);

/// The no-op flags given, in one info line (no line when none was given); call on one rank.
void log_megatron_compat(const PretrainArgs& args);

/// --rampup-batch-size / --step-batch-size-schedule into args.batch_schedule (train/batch_schedule.h;
/// a constant one without them); with the step schedule the global batch size becomes its final
/// batch. Needs the micro-batch and data-parallel sizes and (without a schedule) the global batch
/// size resolved. Errors (mt::Error naming the values): both flags; the schedule's own errors;
/// --global-batch-size other than the step schedule's final batch; a batch the run reaches that is
/// not a multiple of micro-batch size x data-parallel size; --cuda-graph-scope full_iteration (one
/// captured iteration has one number of micro-batches).
void resolve_batch_schedule(PretrainArgs& args);

/// Sample-based training (Megatron's update_train_iters): with --train-samples, --train-iters =
/// BatchSizeSchedule::train_iters(train-samples) (constant batch:
/// floor of train-samples / global-batch-size; an error when that is 0). Needs the global batch size
/// resolved. Without --train-samples nothing changes.
void resolve_sample_based_training(PretrainArgs& args);

/// --profile's window (Megatron's training loop): the CUDA profiler (cudaProfilerStart, for nsys
/// --capture-range=cudaProfilerApi) starts before the step of 0-based index profile-step-start and
/// stops after the step that makes the iteration count profile-step-end, on the ranks of
/// --profile-ranks (none given: every rank). A no-op on CPU devices (warned once).
class ProfileWindow {
 public:
  ProfileWindow(const PretrainArgs& args, int rank, bool cuda);
  ~ProfileWindow();  // stops a range still open (a run that ended inside the window)
  ProfileWindow(const ProfileWindow&) = delete;
  ProfileWindow& operator=(const ProfileWindow&) = delete;
  /// Before the step that starts from `iteration` completed iterations.
  void before_step(int64_t iteration);
  /// After the step that made the count `iteration`.
  void after_step(int64_t iteration);
  bool active() const { return active_; }
  /// Starts and stops seen so far (tests).
  int starts() const { return starts_; }
  int stops() const { return stops_; }

 private:
  void stop();
  bool enabled_ = false, cuda_ = false, active_ = false;
  int64_t start_ = 0, end_ = 0;
  int starts_ = 0, stops_ = 0;
};

}  // namespace mt
