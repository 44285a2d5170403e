// The NCCL watchdog (one thread per process; PyTorch ProcessGroupNCCL's watchdog role). It turns
// a dead or stuck peer into a clear error instead of a hang:
//   - after every NCCL operation a CUDA event is recorded on its stream (deferred to the
//     outermost group_end inside a group; skipped while the stream is being captured into a
//     CUDA graph); an event that has not completed `timeout_s` after it was enqueued,
//   - an error reported by ncclCommGetAsyncError (e.g. a peer's connection closed), or
//   - a blocking host call (communicator init, split, destroy) that has not returned in time
// makes the watchdog print the operation, the group and the rank to stderr, abort every NCCL
// communicator of the process (ncclCommAbort, bounded to 10 s) and end the process with
// std::_Exit(1). Exiting is deliberate: the main thread may be blocked in a CUDA call
// (cudaStreamSynchronize on a kernel waiting for a dead peer) that no exception can interrupt,
// and a rank cannot continue training after a failed collective anyway; the launcher (torchrun,
// mpirun, srun, `megatron pretrain --nproc-per-node`) then stops the remaining ranks.
// The thread runs in cudaStreamCaptureModeRelaxed so that its event queries never invalidate a
// CUDA graph capture running on another thread.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <string>

namespace mt::nccl_detail {

class Watchdog {
 public:
  static Watchdog& instance();
  /// Starts watching `comm` (async errors; its operations get `timeout_s`, <= 0: no timeout).
  /// `desc` names it in messages, e.g. "group 'tp' (rank 1 of 4)".
  void add_comm(ncclComm_t comm, const std::string& desc, double timeout_s, int device);
  /// Stops watching `comm` and forgets its outstanding operations.
  void remove_comm(ncclComm_t comm);
  /// Call right after an operation on `comm` was enqueued on `stream` (outside any NCCL group).
  void enqueued(ncclComm_t comm, cudaStream_t stream, const char* op);
  /// A blocking host call that must return within timeout_s (<= 0: not watched).
  uint64_t host_begin(const std::string& what, double timeout_s);
  /// The same, described lazily as "NCCL <op> on <*desc>" (no formatting unless it times out;
  /// `desc` must outlive the call). Used around every NCCL call that can block on a peer: since
  /// NCCL 2.22 a communicator connects to its peers at its first collective of each kind
  /// (NCCL_RUNTIME_CONNECT), inside the host call, so a peer that never joins blocks the host
  /// there before anything is enqueued for the event watch.
  uint64_t host_begin(const char* op, const std::string* desc, double timeout_s);
  void host_end(uint64_t id);

  ~Watchdog();

 private:
  Watchdog() = default;
  struct State;
  State* state();
  State* state_ = nullptr;
};

/// RAII wrapper of Watchdog::host_begin / host_end.
class HostCallGuard {
 public:
  HostCallGuard(const std::string& what, double timeout_s) : id_(Watchdog::instance().host_begin(what, timeout_s)) {}
  HostCallGuard(const char* op, const std::string* desc, double timeout_s)
      : id_(Watchdog::instance().host_begin(op, desc, timeout_s)) {}
  ~HostCallGuard() { Watchdog::instance().host_end(id_); }
  HostCallGuard(const HostCallGuard&) = delete;
  HostCallGuard& operator=(const HostCallGuard&) = delete;

 private:
  uint64_t id_;
};

}  // namespace mt::nccl_detail
