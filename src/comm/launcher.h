// The local launcher behind `megatron pretrain --nproc-per-node N ...`: starts N ranks of this
// executable on this machine and waits for them (torchrun --standalone's role).
#pragma once
#include <string>
#include <utility>
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
///         stops the others. The ranks get the OpenMP settings of cpu_rank_omp_environment
///         (printed on stderr when the launcher sets any).
/// Children die with the launcher (PR_SET_PDEATHSIG). Returns 0 when every rank succeeded.
/// Errors: mt::Error when nproc < 1 or a process cannot be started.
int launch_local(int nproc, int argc, char** argv, Device device);

/// The CPU cores this process may run on (its affinity mask; hardware_concurrency() if that cannot
/// be read), at least 1.
int usable_cpu_cores();

/// The OpenMP variables the CPU path sets for its ranks, which share this machine's `cores`
/// cores (torchrun likewise sets OMP_NUM_THREADS=1 per rank). Only unset variables are set
/// (`omp_num_threads`, `omp_wait_policy`: their current values, nullptr = unset):
///   OMP_NUM_THREADS = max(1, cores / nproc): every rank a share of the cores, not all of them;
///   OMP_WAIT_POLICY = passive when nproc · threads > cores (the value given, or the one set
///       here; a value that does not start with a positive number counts as 1): with more
///       threads than cores, OpenMP threads that spin while they wait take the cores from the
///       threads doing the work.
/// Measured on the 2-core development machine, DP 2 of a small GPT: 2593 ms/iter with OpenMP's
/// defaults (all cores per rank), 1839–1873 ms/iter with these (docs/benchmarks.md).
/// Returns the (name, value) pairs to add. Errors: mt::Error when nproc < 1 or cores < 1.
std::vector<std::pair<std::string, std::string>> cpu_rank_omp_environment(int nproc, int cores,
                                                                         const char* omp_num_threads,
                                                                         const char* omp_wait_policy);

/// argv[1..argc) without `--nproc-per-node N` and `--nproc-per-node=N`.
std::vector<std::string> strip_nproc_flag(int argc, char** argv);

/// The command the CPU path runs (for tests and messages): mpiexec and its arguments.
std::vector<std::string> mpiexec_command(int nproc, const std::string& exe, const std::vector<std::string>& args);

}  // namespace mt
