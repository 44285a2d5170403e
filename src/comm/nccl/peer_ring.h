// The ring exchange of context parallelism's p2p ring (model/layers/cp_attention.h) by copy-engine
// transfers between the GPUs of one host, instead of NCCL's send/recv kernels: the copies take no
// SMs, so an exchange issued beside the attention's blocks is not held back by them (NCCL's p2p
// kernels were measured not to hide on 2 x H200, docs/benchmarks.md "Context parallelism at long
// sequences"). Built on the IPC and flag machinery of comm/nccl/peer_ipc.h, as PeerCopyGroup
// (comm/nccl/peer_copy.h) is for the gradient reduce-scatter.
//
// Protocol (ring rank r sends to next = r + 1 and receives from prev = r − 1, mod N; every rank
// issues the same sequence of exchanges, so the sequence number k of an exchange, counted on the
// host, agrees on all ranks). Each rank owns two 32-bit flags that its neighbours write:
//   free     written by next: next's receive buffers may be overwritten for exchange k;
//   arrived  written by prev: prev's copies of exchange k into this rank's buffers have landed.
// Exchange k, all on the caller's (ring) stream, which the caller made wait for every earlier
// read of this rank's receive buffers (ContextParallelRegion::Ring's `ready` event):
//   1. write free = k into prev's flags           (our receive buffers may be overwritten)
//   2. wait until our free >= k                   (next's receive buffers may be overwritten)
//   3. cudaMemcpyAsync send -> next's receive buffer, for each transfer (copy engine, NVLink)
//   4. write arrived = k into next's flags        (fenced: after the copies)
//   5. wait until our arrived >= k                (prev's copies into our buffers landed)
// The waits are cuStreamWaitValue32 (the GPU's front end waits, no SM spins). A sender can thus
// never overwrite a receive buffer its next rank still reads, and the caller's compute stream
// reads what arrived only after step 5 (the region's `done` event). Every exchange is handed to
// the NCCL watchdog under the ring's NCCL communicator: a peer that dies leaves a wait
// unsatisfied and the watchdog ends the process after the timeout, naming the group.
//
// Placement: the receive buffers are the caller's own (the CP attention's K/V and dK/dV receive
// scratch, which the BufferPlanner places in its one cudaMalloc allocation); create() registers
// the allocations holding them for CUDA IPC, and a sender writes its next rank's buffer at the
// offset its own buffer of the same role has in its own allocation (checked equal on all ranks at
// create for the buffers given). The send buffers need no registration. The only memory this
// class allocates is its flags (a 256-byte cudaMalloc).
//
// Not capturable: the flags carry host-counted sequence numbers, which a replayed CUDA graph
// would repeat; exchange() on a capturing stream is an error (the CP region keeps NCCL there).
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/nccl/nccl_communicator.h"
#include "comm/nccl/peer_ipc.h"

namespace mt {

class PeerRingExchange {
 public:
  static constexpr int kMaxRanks = peer_ipc::kMaxRanks;

  /// Collective over `comm` (the ring: its ranks in ring order, one GPU each on comm.device()).
  /// recv: this rank's receive buffers (device pointers anywhere inside cudaMalloc allocations;
  /// the allocations holding them are registered, whole). Every rank passes the same count.
  /// Returns nullptr on every rank, with the reason in *why_not, when the ring cannot use
  /// copy-engine transfers: one rank or more than kMaxRanks, ranks on different hosts, memory
  /// that cannot be mapped (no peer access, IPC refused), a driver without stream memory
  /// operations, or receive buffers whose offset in their allocation or whose allocation size
  /// differs between ranks. The decision is agreed over the group. Errors (mt::Error): recv
  /// counts that differ between ranks, a null pointer, CUDA errors other than IPC refusals.
  static std::unique_ptr<PeerRingExchange> create(const std::shared_ptr<NcclCommunicator>& comm,
                                                  const std::vector<const void*>& recv,
                                                  std::string* why_not = nullptr);
  ~PeerRingExchange();
  PeerRingExchange(const PeerRingExchange&) = delete;
  PeerRingExchange& operator=(const PeerRingExchange&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// Exchanges issued by this object (the last sequence number).
  uint32_t exchanges() const { return seq_; }
  /// Exchanges issued by every PeerRingExchange of the process (tests: which path ran).
  static int64_t issued_total() { return issued_total_.load(); }

  /// One transfer of an exchange: `bytes` bytes from `send` (any device memory of this rank) into
  /// the next rank's buffer that corresponds to this rank's `recv` (in a registered allocation);
  /// symmetrically `recv` receives the previous rank's bytes.
  struct Transfer {
    const void* send = nullptr;
    void* recv = nullptr;
    size_t bytes = 0;
  };
  /// One ring step (the protocol above), ordered on `stream`; returns without waiting. The
  /// caller orders `stream` after the writes of every `send` and the reads of every `recv`'s
  /// previous contents, and orders readers of `recv` and writers of `send` after it (events on
  /// `stream`). Every rank passes transfers of the same sizes in the same order.
  /// Errors (mt::Error): a `recv` range outside the registered allocations; `stream` being
  /// captured into a CUDA graph.
  void exchange(std::span<const Transfer> transfers, cudaStream_t stream);
  /// Whether [p, p + bytes) lies in a registered allocation.
  bool registered(const void* p, size_t bytes) const;

 private:
  PeerRingExchange() = default;
  struct Flags {
    uint32_t free;     // written by next
    uint32_t arrived;  // written by prev
  };
  std::shared_ptr<NcclCommunicator> watch_;
  int rank_ = 0, size_ = 1, device_ = 0, next_ = 0, prev_ = 0;
  std::vector<std::pair<const char*, size_t>> local_;  // registered allocations here: base, bytes
  peer_ipc::PeerMappings mappings_;                    // 0: flags; 1..: the registered allocations
  void* own_flags_ = nullptr;                          // cudaMalloc'd here (Flags)
  uint32_t seq_ = 0;
  static std::atomic<int64_t> issued_total_;
};

}  // namespace mt
