// The global batch size as a function of the samples consumed: Megatron-Core's number-of-
// micro-batches calculators (megatron/core/num_microbatches_calculator.py).
//   constant   --global-batch-size throughout (ConstantNumMicroBatchesCalculator);
//   ramp-up    --rampup-batch-size <start> <increment> <ramp samples>: the batch starts at `start`
//              and grows by `increment` every ramp_samples / ((global - start) / increment)
//              consumed samples until it reaches --global-batch-size, which it keeps once more
//              than `ramp samples` samples are consumed (RampupBatchsizeNumMicroBatchesCalculator,
//              Megatron-LM until April 2026; Megatron-LM main now ignores the flag with a
//              deprecation warning);
//   steps      --step-batch-size-schedule "T0:B0 T1:B1 ...": batch B_k from T_k consumed tokens on
//              (K/M/B/T suffixes = 1e3/1e6/1e9/1e12; the tokens become samples T_k // seq_length,
//              as pretrain_gpt.py passes --seq-length; StepBatchsizeNumMicroBatchesCalculator).
// The batch of an iteration is at(samples consumed before it); the micro-batch size is fixed, so
// the number of micro-batches per data-parallel rank is at(c) / (micro · dp).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mt {

class BatchSizeSchedule {
 public:
  /// A constant global batch of `global_batch_size` samples (the default).
  BatchSizeSchedule() = default;
  explicit BatchSizeSchedule(int64_t global_batch_size);
  /// --rampup-batch-size start increment ramp_samples with --global-batch-size `global_batch_size`.
  /// Errors (mt::Error naming the values): not three values, start / increment / ramp samples not
  /// positive, start > global, (global - start) not a multiple of increment, start == global
  /// (no ramp: Megatron divides by zero increments).
  static BatchSizeSchedule rampup(const std::vector<int64_t>& values, int64_t global_batch_size);
  /// --step-batch-size-schedule's words (one quoted string or the words it splits into; ',' also
  /// separates), thresholds in tokens converted with `seq_length` (> 0). Errors: an entry without
  /// ':', a value that is not a number, no entries, a first threshold (in samples) other than 0,
  /// thresholds not strictly increasing, a batch size not positive or smaller than the one before
  /// (Megatron's loop asserts that the micro-batches never decrease).
  static BatchSizeSchedule steps(const std::vector<std::string>& words, int64_t seq_length);

  /// Global batch size of the iteration that starts after `consumed_samples` samples.
  int64_t at(int64_t consumed_samples) const;
  /// The batch size once the schedule has ended (the largest).
  int64_t final_batch_size() const { return final_; }
  bool is_constant() const { return kind_ == Kind::kConstant; }
  /// Iterations of a run of `train_samples` samples (Megatron's update_train_iters): constant:
  /// floor(train_samples / batch); ramp-up: the iterations until more than the ramp samples (or
  /// train samples) are consumed, then floor of the rest / global batch; steps: iterations until at
  /// least train_samples are consumed.
  int64_t train_iters(int64_t train_samples) const;
  /// The batch sizes of iterations [0, iterations) of a run from 0 samples, in order, each once.
  std::vector<int64_t> sizes_used(int64_t iterations) const;
  /// One line for the log, e.g. "ramp-up from 16 by 16 every 61035.16 samples to 1536 over 5859375 samples".
  std::string describe() const;

 private:
  enum class Kind { kConstant, kRampup, kSteps };
  Kind kind_ = Kind::kConstant;
  int64_t final_ = 1;
  int64_t start_ = 0, increment_ = 0, ramp_samples_ = 0;
  double samples_per_increment_ = 0;
  std::vector<std::pair<int64_t, int64_t>> steps_;  // (threshold in samples, batch size), increasing
};

}  // namespace mt
