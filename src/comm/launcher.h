// The local launcher behind `megatron pretrain --nproc-per-node N ...`: starts N ranks of this
// executable on this machine and waits for them (torchrun --standalone's role).
#pragma once
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/device.h"

namespace mt {

/// Exit status of a rank that has printed its own error message (apps/megatron.cpp returns it
/// after "error: ..."). The launchers stop the other ranks without a report of their own for it:
/// the rank's message is the whole report ("print once, cleanly"). Any other non-zero status, or
/// death by a signal, is reported naming the rank (a crash prints nothing itself).
inline constexpr int kReportedErrorExitStatus = 1;

/// Runs `nproc` copies of this executable (/proc/self/exe) with argv[1..] minus
/// `--nproc-per-node N` / `--nproc-per-node=N`, and returns when they have all ended:
///   CUDA: fork/exec with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1
///         and MASTER_PORT (a free port) set, as torchrun does. When a rank fails (non-zero exit
///         or a signal) the launcher sends SIGTERM to the others (SIGKILL after 5 s), prints which
///         rank failed and how ("rank 1 (of 2) was killed by signal 9 (Killed)") unless it exited
///         with kReportedErrorExitStatus, and returns that rank's status (128 + signal for a signal).
///   CPU:  runs `mpiexec -np N --oversubscribe --bind-to none [--allow-run-as-root] <exe> args`
///         (the MPI backend) and returns mpiexec's status; mpiexec names a failed rank and
///         stops the others. mpiexec's stderr passes through MpiexecStderrFilter (its boilerplate
///         about a rank that exited with kReportedErrorExitStatus is dropped; its reports of
///         crashes, signals and other statuses are kept), and a status of mpiexec other than 0
///         and kReportedErrorExitStatus is named by the launcher. The ranks get the OpenMP
///         settings of cpu_rank_omp_environment (printed on stderr when the launcher sets any).
/// Children die with the launcher: each child (a rank, or mpiexec) gets SIGKILL from the kernel
/// when the launcher dies (PR_SET_PDEATHSIG, set between fork and exec with a check of getppid()
/// for a launcher that died before it was set); a rank of the fork path also finds the launcher's
/// pid in MT_LAUNCHER_PID (guard_parent_death). Returns 0 when every rank succeeded.
/// Errors: mt::Error when nproc < 1 or a process cannot be started.
int launch_local(int nproc, int argc, char** argv, Device device);

/// Ranks that cannot outlive their launcher (docs/distributed.md "When the launcher dies"), called
/// by every process started by a launcher (torchrun, mpiexec, srun or ours) before anything else:
/// records the parent process (the launcher: torchrun's agent, mpiexec or its orted, slurmstepd,
/// `megatron --nproc-per-node`), asks the kernel for parent_death_signal() when the parent dies
/// (PR_SET_PDEATHSIG) and handles it by ending the process at once (_exit: no checkpoint, no
/// cleanup; one line on stderr naming the rank and the parent) if the parent process is gone. The
/// kernel also sends it when only the parent's thread that started this process exits; the
/// handler then finds the same parent (getppid) and ignores it. A parent that died before the
/// guard was set: with MT_LAUNCHER_PID (our launcher's fork path) a parent other than that pid
/// ends the process at once; under other launchers such a rank fails to reach its launcher
/// (MPI_Init, the TCP store) instead. Test hook: MT_TEST_NO_PARENT_DEATH_SIGNAL=1 records the
/// parent and disarms every parent-death signal, the launcher's SIGKILL included (launcher_alive()
/// alone then stops a publication).
void guard_parent_death(int rank);

/// The real-time signal of guard_parent_death (SIGRTMIN + 3).
int parent_death_signal();

/// False once the parent recorded by guard_parent_death is gone (this process was re-parented);
/// true when no guard is installed (a process started without a launcher). Checked before a
/// checkpoint is published (train/checkpoint.h): nothing is published after the launcher died.
bool launcher_alive();

/// The parent process guard_parent_death recorded; 0 without a guard.
int guarded_parent_pid();

/// The launcher's filter of mpiexec's stderr (OpenMPI 4). mpiexec's messages are "help" blocks
/// between two lines of 74 dashes. Two of them are dropped:
///   "Primary job  terminated normally, but 1 process returned a non-zero exit code. ..."
///       (always: it names no rank; the block that follows it, or the launcher, says which and why);
///   "mpiexec detected that one or more processes exited with non-zero status ... Process name:
///       [[job,1],rank]  Exit code: N" when N == kReportedErrorExitStatus (that rank printed its
///       own error).
/// Everything else passes unchanged and in order: the ranks' stderr (which mpiexec relays), the
/// same block with another exit code, "mpiexec noticed that process rank 1 ... exited on signal
/// 11 (Segmentation fault)", and any other block. Only a dash line followed by one of the two
/// openings is held back, so ranks' own output is never delayed by more than a line and a line of
/// dashes in it is printed as is. Pure (no I/O): feed() returns the text to print now.
class MpiexecStderrFilter {
 public:
  /// Consumes the next bytes of mpiexec's stderr; returns those that are to be printed now.
  std::string feed(std::string_view chunk);
  /// End of the stream: returns whatever is still held (an unterminated block is printed as is).
  std::string finish();

 private:
  void line(std::string l, std::string& out);  // one complete line, with its '\n'
  std::string partial_;      // the start of a line not yet complete (held only when it may be dashes)
  bool mid_line_ = false;    // the current line's start was printed: the rest passes until '\n'
  std::string held_dash_;    // a dash line that may open a block to drop
  std::string block_;        // the block being read (from its opening dash line)
  bool in_block_ = false;
};

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
