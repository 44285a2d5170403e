// NCCL backend of the Communicator (CUDA tensors on one GPU per process). Built only when CMake
// finds NCCL (MT_WITH_NCCL). Every operation is enqueued on the given Stream's cudaStream_t and
// returns without waiting. Groups come from ncclCommSplit (NCCL >= 2.18). all_to_all is a
// grouped ncclSend/ncclRecv. group_start/group_end are ncclGroupStart/ncclGroupEnd (they batch
// operations of every communicator of the calling thread, as in NCCL).
// Timeouts: the process-wide NCCL watchdog (comm/nccl/nccl_watchdog.h) ends the process with a
// message naming the operation, group and rank when an operation has not completed within the
// timeout or NCCL reports an asynchronous error. NCCL_NVLS_ENABLE is set to 0 unless already set
// (NVLink multicast stays off on our machines).
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <array>
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace mt {

class NcclCommunicator final : public Communicator {
 public:
  /// The bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES = 128); made by one rank, handed to all.
  using UniqueId = std::array<char, 128>;
  static UniqueId make_unique_id();

  /// Collective over the `size` ranks that share `id`: creates the communicator on CUDA `device`
  /// (made current). timeout_s <= 0: no timeout. Errors: mt::Error naming the group and rank.
  NcclCommunicator(const UniqueId& id, int rank, int size, Device device, std::string name, double timeout_s);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  Device device() const { return device_; }
  double timeout_s() const { return timeout_s_; }
  /// The NCCL communicator (benchmarks compare against raw NCCL calls on it).
  ncclComm_t raw() const { return comm_; }

  void all_reduce(const Tensor& t, ReduceOp op, const Stream& stream) override;
  void all_gather(const Tensor& out, const Tensor& in, const Stream& stream) override;
  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, const Stream& stream) override;
  void broadcast(const Tensor& t, int root, const Stream& stream) override;
  void all_to_all(const Tensor& out, const Tensor& in, const Stream& stream) override;
  /// Grouped ncclSend/ncclRecv of the non-empty pieces (peers with a zero count are skipped).
  void all_to_allv(const Tensor& out, const AllToAllvSplits& recv, const Tensor& in, const AllToAllvSplits& send,
                   const Stream& stream) override;
  void send(const Tensor& t, int peer, const Stream& stream) override;
  void recv(const Tensor& t, int peer, const Stream& stream) override;
  void group_start() override;
  void group_end() override;
  /// All-reduce of one int on an internal stream, then a host wait for it (watched).
  void barrier() override;
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override;

 private:
  NcclCommunicator(ncclComm_t comm, Device device, std::string name, double timeout_s);  // from split
  void init_common();
  void check(ncclResult_t r, const char* call) const;
  /// Runs `call`, an NCCL call that can block on the host (connecting to peers, a full proxy
  /// queue), under a nccl_detail::HostCallGuard: the watchdog turns a block longer than the
  /// timeout into an error naming `op` and this group. guarded returns the call's result;
  /// checked also check()s it. Defined in the .cpp, the only user.
  template <class Call>
  ncclResult_t guarded(const char* op, Call&& call) const;
  template <class Call>
  void checked(const char* op, Call&& call) const;
  cudaStream_t stream_of(const Stream& s, const char* op) const;
  void require_device(const Tensor& t, const char* op) const;
  /// Hands the operation to the watchdog (deferred to the outermost group_end inside a group).
  void enqueued(cudaStream_t s, const char* op);

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  Device device_;
  std::string name_;
  std::string desc_;
  double timeout_s_ = 0;
  int* barrier_buf_ = nullptr;
  cudaStream_t barrier_stream_ = nullptr;
};

}  // namespace mt
