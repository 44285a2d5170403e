// Megatron's training timers (--timing-log-level, --timing-log-option; megatron/core/timers.py
// and the timers(...) calls of megatron/training/training.py), measured with events recorded on
// the compute stream. They add no host synchronization: a timer's time is the stream time
// between its start and its stop, which includes the time the stream waits for other ranks
// inside collectives (so on a fast rank "all-grads-sync" includes waiting for the slowest one,
// and the spread of "forward-backward" across ranks is the spread of the GPUs' compute speed).
//
// Level 1 (the only level with timers here; 0 = off):
//   forward-backward             the pipeline schedule (forward and backward of every micro-batch)
//   embedding-grads-all-reduce   tied word-embedding gradient over the embedding group
//   all-grads-sync               GradSync::finish_grad_sync (what of the DP reduction is still
//                                pending or running once the backward has ended)
//   optimizer-clip-main-grad     gradient norm (its all-reduces included), clip factor, found_inf
//   optimizer-inner-step         AdamW on the owned elements
//   params-all-gather            distributed optimizer: the parameter all-gather (its launch only
//                                under --overlap-param-gather, where it overlaps the next forward)
//   optimizer                    the whole optimizer step (the three above and the scaler update)
// The trainer reports them every --log-interval iterations (train/timing_log.h).
#pragma once
#include <array>
#include <memory>
#include <string>
#include <vector>

#include "core/stream.h"

namespace mt {

class Timers {
 public:
  enum Name : int {
    kForwardBackward,
    kEmbeddingGradsAllReduce,
    kAllGradsSync,
    kOptimizerClipMainGrad,
    kOptimizerInnerStep,
    kParamsAllGather,
    kOptimizer,
    kCount
  };
  /// Megatron's name of a timer ("forward-backward", ...).
  static const char* name(Name n);

  /// log_level: --timing-log-level, 0 (off) or 1 (check_level). Events are created on `device`.
  Timers(int log_level, Device device);
  /// Throws mt::Error naming `log_level` unless it is 0 or 1 (Megatron's level 2, per-micro-batch
  /// compute timers, is not implemented).
  static void check_level(int log_level);
  Timers(const Timers&) = delete;
  Timers& operator=(const Timers&) = delete;

  bool active() const { return level_ >= 1; }
  /// Records the start / stop event of timer `n` on `stream` (no-ops when inactive). Errors:
  /// starting a running timer, stopping one that is not running.
  void start(Name n, const Stream& stream);
  void stop(Name n, const Stream& stream);

  /// Per timer t: [2t] its start-stop intervals since the last call summed and divided by
  /// `iterations` (ms per iteration), [2t + 1] how many intervals were recorded. Synchronizes
  /// `stream` (the events must have completed), then forgets the intervals. Errors: iterations
  /// not positive.
  std::array<float, 2 * kCount> take(const Stream& stream, int64_t iterations);

 private:
  struct Interval {
    std::unique_ptr<Event> begin, end;
  };
  int level_;
  Device device_;
  std::array<std::vector<Interval>, kCount> intervals_;  // events, reused from one report to the next
  std::array<size_t, kCount> used_{};                     // intervals recorded since the last report
  std::array<bool, kCount> running_{};
};

/// Starts timer `n` on construction and stops it on destruction; does nothing when `timers` is
/// null.
class ScopedTimer {
 public:
  ScopedTimer(Timers* timers, Timers::Name n, const Stream& stream) : timers_(timers), n_(n), stream_(stream) {
    if (timers_) timers_->start(n_, stream_);
  }
  ~ScopedTimer() {
    if (timers_) timers_->stop(n_, stream_);
  }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  Timers* timers_;
  Timers::Name n_;
  const Stream& stream_;
};

}  // namespace mt
