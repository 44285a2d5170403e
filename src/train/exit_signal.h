// --exit-signal-handler (Megatron's DistributedSignalHandler, megatron/training/dist_signal_handler.py):
// SIGTERM and SIGINT set a flag instead of killing the process; the training loop reads it at the
// end of each iteration, saves a checkpoint and returns exit status 0.
#pragma once

namespace mt {

/// Installs the handlers for SIGTERM, SIGINT and SIGUSR1 (sigaction; async-signal-safe: the
/// handler only stores the signal number). SIGUSR1 is how the local launcher passes a SIGTERM or
/// SIGINT through mpiexec (comm/launcher.h). The previous handlers are restored by the destructor.
class ExitSignalHandler {
 public:
  ExitSignalHandler();
  ~ExitSignalHandler();
  ExitSignalHandler(const ExitSignalHandler&) = delete;
  ExitSignalHandler& operator=(const ExitSignalHandler&) = delete;
  /// The signal received since installation (SIGTERM, SIGINT or SIGUSR1), or 0.
  static int received();
};

}  // namespace mt
