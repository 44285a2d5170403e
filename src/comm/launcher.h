// The local launcher behind `megatron pretrain --nproc-per-node N ...`: starts N ranks of this
// executable on this machine and waits for them (torchrun --standalone's role).
#pragma once
#include <string>
#include <vector>

#include "core/device.h"

namespace mt {

/// Runs `nproc` copies of this executable (/proc/self/exe) with argv[1..] minus
/// `--nproc-per-node N` / `--nproc-per-node=N`, and returns when they have all ended:
///   CUDA: fork/exec with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1
///         and MASTER_PORT (a free port) set, as torchrun does. When a rank fails (non-zero exit
///         or a signal) the launcher prints which rank failed, sends SIGTERM to the others
///         (SIGKILL after 5 s) and returns that rank's status (128 + signal for a signal).
///   CPU:  runs `mpiexec -np N --oversubscribe --bind-to none [--allow-run-as-root] <exe> args`
///         (the MPI backend) and returns mpiexec's status; mpiexec names a failed rank and
///         stops the others.
/// Children die with the launcher (PR_SET_PDEATHSIG). Returns 0 when every rank succeeded.
/// Errors: mt::Error when nproc < 1 or a process cannot be started.
int launch_local(int nproc, int argc, char** argv, Device device);

/// argv[1..argc) without `--nproc-per-node N` and `--nproc-per-node=N`.
std::vector<std::string> strip_nproc_flag(int argc, char** argv);

/// The command the CPU path runs (for tests and messages): mpiexec and its arguments.
std::vector<std::string> mpiexec_command(int nproc, const std::string& exe, const std::vector<std::string>& args);

}  // namespace mt
