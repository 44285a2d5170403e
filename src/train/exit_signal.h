// When `megatron pretrain` stops before --train-iters (Megatron's checks in train(): --exit-interval,
// --exit-duration-in-mins, --exit-signal-handler with DistributedSignalHandler,
// megatron/training/dist_signal_handler.py): the loop saves a checkpoint and returns exit status 0.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "comm/communicator.h"

namespace mt {

/// --exit-signal-handler: installs the handlers for SIGTERM, SIGINT and SIGUSR1 (sigaction;
/// async-signal-safe: the handler only stores the signal number), so that they set a flag instead
/// of killing the process; the training loop reads it at the end of each iteration. SIGUSR1 is how
/// the local launcher passes a SIGTERM or SIGINT through mpiexec (comm/launcher.h). The previous
/// handlers are restored by the destructor.
class ExitSignalHandler {
 public:
  ExitSignalHandler();
  ~ExitSignalHandler();
  ExitSignalHandler(const ExitSignalHandler&) = delete;
  ExitSignalHandler& operator=(const ExitSignalHandler&) = delete;
  /// The signal received since installation (SIGTERM, SIGINT or SIGUSR1), or 0.
  static int received();
};

struct ExitPolicyOptions {
  int64_t exit_interval = 0;         ///< --exit-interval: stop when iteration % N == 0 (0 = off)
  double exit_duration_in_mins = 0;  ///< --exit-duration-in-mins: stop once this wall time has passed (0 = off)
  /// The signal this rank received (0 = none): ExitSignalHandler::received with
  /// --exit-signal-handler; empty = no signal handling.
  std::function<int()> received_signal;
};

/// Whether the loop stops after an iteration, agreed by every rank.
class ExitPolicy {
 public:
  /// The duration counts from construction.
  ExitPolicy(ExitPolicyOptions options, Communicator& world, const Stream& stream);
  /// After `iteration` steps: why the run stops there ("--exit-interval 3", "received signal
  /// SIGTERM (--exit-signal-handler)", "--exit-duration-in-mins 10 reached"), or "" to go on.
  /// With a signal source or a duration, collective over the world at every iteration (Megatron:
  /// the ranks agree by an all-gather): a signal or the duration seen by any rank stops every rank;
  /// a signal is named before the duration, both before the interval.
  std::string check(int64_t iteration) const;

 private:
  ExitPolicyOptions options_;
  Communicator& world_;
  const Stream& stream_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace mt
