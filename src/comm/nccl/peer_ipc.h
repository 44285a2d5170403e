// The machinery shared by the copy-engine transfers between the GPUs of one host
// (comm/nccl/peer_copy.h: the gradient reduce-scatter and parameter all-gather;
// comm/nccl/peer_ring.h: the context-parallel ring exchange): 32-bit flags written and waited for
// by the GPUs' front ends (cuStreamWriteValue32 / cuStreamWaitValue32, no SM work), CUDA IPC
// mappings of whole cudaMalloc allocations on every rank of an NCCL group, and the host-side
// agreement of the ranks on whether the copy-engine path can be used. Setup functions are
// collective over the group (host all-gathers through NCCL); flag functions are stream-ordered.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "comm/nccl/nccl_communicator.h"
#include "core/stream.h"

namespace mt::peer_ipc {

/// The most ranks a copy-engine group spans (one GPU each, all linked directly).
constexpr int kMaxRanks = 8;

/// `s` waits until (int32_t)(*flag − value) >= 0 (cyclic comparison: sequence numbers may wrap);
/// the GPU's front end waits, no SM spins. Errors: mt::Error on a driver error.
void wait_flag(cudaStream_t s, const uint32_t* flag, uint32_t value);
/// `s` writes `value` into *flag (local or IPC-mapped peer memory) after a memory fence: a peer
/// that sees the value also sees every copy enqueued on `s` before it.
void write_flag(cudaStream_t s, uint32_t* flag, uint32_t value);
/// Whether the driver offers the stream memory operations (cuStreamWaitValue32 /
/// cuStreamWriteValue32, taken through the runtime's entry-point query so that no binary links
/// libcuda); the reason in *why when not.
bool stream_mem_ops_available(std::string* why);
/// Errors (mt::Error naming `what`) when `s` is being captured into a CUDA graph: the flags carry
/// sequence numbers counted on the host, which a replayed graph would repeat.
void require_not_capturing(cudaStream_t s, const char* what);
/// Whether `s` is being captured into a CUDA graph (cudaStreamIsCapturing).
bool is_capturing(cudaStream_t s);

/// Whether every rank passes `ok` (a host all-gather of one byte each; collective).
bool all_ok(NcclCommunicator& comm, bool ok, const Stream& stream);
/// Collective: empty when every rank of `comm` runs on this host, else a sentence naming two
/// ranks and their hosts.
std::string other_host(NcclCommunicator& comm, const Stream& stream);

/// The cudaMalloc allocation holding device pointer p: its base and size in bytes
/// (cuMemGetAddressRange). Errors: mt::Error when p is not device memory of this context.
std::pair<void*, size_t> allocation_of(const void* p);

/// Allocations of every rank of a group, mapped here by CUDA IPC (peer access over NVLink).
class PeerMappings {
 public:
  PeerMappings() = default;
  ~PeerMappings() { close(); }
  PeerMappings(const PeerMappings&) = delete;
  PeerMappings& operator=(const PeerMappings&) = delete;
  /// Collective over `comm`: exports the allocations whose bases are `local` (the same count on
  /// every rank; bases of cudaMalloc allocations) and maps every peer's. Returns false on every
  /// rank, with the reason in *why, when a rank could not export or map (no peer access, IPC
  /// refused); then nothing stays mapped.
  bool map(NcclCommunicator& comm, const std::vector<void*>& local, const Stream& stream, std::string* why);
  /// Allocation k of rank r as mapped here (r = this rank: the local pointer).
  void* at(size_t k, int r) const { return base_[k][static_cast<size_t>(r)]; }
  /// Closes the mappings of the peers' memory (idempotent).
  void close();

 private:
  std::vector<std::array<void*, kMaxRanks>> base_;
  std::vector<void*> opened_;
};

}  // namespace mt::peer_ipc
