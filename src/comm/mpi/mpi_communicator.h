// MPI backend of the Communicator (CPU tensors; OpenMPI). Built only when CMake finds MPI
// (MT_WITH_MPI). Every collective is issued as a non-blocking MPI call (MPI_Iallreduce, ...) and
// completed by polling MPI_Test against a deadline, so a peer that never joins turns into an
// mt::Error after the timeout (--distributed-timeout-minutes) instead of a hang. A peer process
// that exits is normally noticed sooner by mpirun, which terminates the job and names the rank.
// bf16/fp16 reductions go through fp32 (MPI has no such types): the tensor is converted into a
// lazily grown fp32 scratch, reduced in fp32 and rounded back once (so the result is the
// correctly rounded fp32 sum, better than NCCL's bf16 pairwise sums).
// send/recv: between group_start() and group_end() they are MPI_Isend/MPI_Irecv completed
// together at group_end (no deadlock in any order); outside a group each completes on return.
#pragma once
// OpenMPI's mpi.h pulls in the deprecated C++ bindings (libmpi_cxx, not linked) unless told not to.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace mt {

/// MPI_Init once per process (thread-safe, idempotent) and MPI_Finalize at exit (when we
/// initialized it). MPI_COMM_WORLD gets MPI_ERRORS_RETURN so that failures become mt::Error.
class MpiRuntime {
 public:
  static void ensure_initialized();
  static bool initialized();
  /// The process is ending with an error: MPI_Finalize is not called at exit. It would wait for
  /// the peers (which may be waiting for this rank), whereas a rank that exits without it is seen
  /// by mpiexec at once, which then stops the others (apps/megatron.cpp's error exit).
  static void skip_finalize();
  /// True when the environment shows an MPI launcher (OpenMPI's OMPI_COMM_WORLD_SIZE, or PMIx /
  /// PMI variables as set by `srun --mpi=pmix`).
  static bool launched_by_mpi();
  static int world_rank();  ///< initializes MPI
  static int world_size();  ///< initializes MPI
};

class MpiCommunicator final : public Communicator {
 public:
  /// A duplicate of MPI_COMM_WORLD named `name`; initializes MPI. timeout_s <= 0: wait forever.
  static std::shared_ptr<MpiCommunicator> world(double timeout_s, const std::string& name = "world");
  /// Takes ownership of `comm` (MPI_Comm_free on destruction).
  MpiCommunicator(MPI_Comm comm, std::string name, double timeout_s);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  double timeout_s() const { return timeout_s_; }
  MPI_Comm raw() const { return comm_; }

  void all_reduce(const Tensor& t, ReduceOp op, const Stream& stream) override;
  void all_gather(const Tensor& out, const Tensor& in, const Stream& stream) override;
  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, const Stream& stream) override;
  void broadcast(const Tensor& t, int root, const Stream& stream) override;
  void all_to_all(const Tensor& out, const Tensor& in, const Stream& stream) override;
  /// MPI_Ialltoallv: counts and offsets are MPI ints; a count, offset or offset + count beyond
  /// INT_MAX elements is an mt::Error naming the peer (before any communication).
  void all_to_allv(const Tensor& out, const AllToAllvSplits& recv, const Tensor& in, const AllToAllvSplits& send,
                   const Stream& stream) override;
  void send(const Tensor& t, int peer, const Stream& stream) override;
  void recv(const Tensor& t, int peer, const Stream& stream) override;
  void group_start() override;
  void group_end() override;
  void barrier() override;
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override;

 private:
  void check(int rc, const char* call) const;
  void require_cpu(const Tensor& t, const char* op) const;
  /// Completes `reqs` by polling; throws mt::Error naming `op` after the timeout.
  void wait_all(std::vector<MPI_Request>& reqs, const char* op);
  void wait_one(MPI_Request req, const char* op);
  /// Scratch `which` (0 or 1) of at least `bytes` bytes, grown on demand and kept.
  void* scratch(int which, size_t bytes);
  void p2p(const Tensor& t, int peer, bool is_send);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::string name_;
  double timeout_s_ = 0.0;
  int group_depth_ = 0;
  std::vector<MPI_Request> pending_;
  std::vector<std::byte> scratch_[2];
};

}  // namespace mt
