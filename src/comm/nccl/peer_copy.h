// Copy-engine collectives between the GPUs of one host (the data-parallel gradient reduce-scatter
// and parameter all-gather of optim/grad_sync.h), moving data with cudaMemcpyAsync between
// CUDA-IPC-mapped buffers over NVLink instead of NCCL kernels. The transfers run on the GPUs' copy
// engines and take no SMs, so a reduction overlapped with the backward does not slow its GEMMs
// (an overlapped 0.65 ms NCCL all-reduce made GPT-2 124M's backward 0.48 ms longer,
// docs/benchmarks.md); the only SM work is one memory-bound summation kernel per piece.
// Measured on 4×H200: ~70% of NCCL's bus bandwidth (one copy per peer), faster than NCCL only
// when overlapped.
//
// Protocol (per group, all ranks issue the same sequence of operations; every pair of GPUs is
// linked directly, e.g. NVLink all-to-all or NVSwitch):
//   reduce_scatter_sum: rank i's chunk j is copied by rank i's copy engine into a staging slot on
//     rank j (one slot per sender, two generations so consecutive pieces pipeline), then a 32-bit
//     flag on rank j is written with the operation's sequence number (cuStreamWriteValue32, which
//     fences the copy before it). Rank j's stream waits for the flags of all senders
//     (cuStreamWaitValue32: the GPU's front end waits, no SM spins), sums the N contributions in
//     rank order (deterministic and independent of timing), and writes an acknowledgement flag on
//     every sender; a sender waits for the acknowledgement of the operation two before before it
//     reuses a generation. Chunks longer than the staging slot are done in pieces.
//   all_gather: rank i's chunk is copied straight into the same offset of every peer's buffer,
//     then a flag is written there; each rank waits for the flags of all peers. There is no
//     staging and no acknowledgement: the caller guarantees that no rank reads or writes a peer's
//     chunk of the destination between its own previous use of it and this all-gather (GradSync:
//     a rank gathers step t's parameters only after every peer finished step t's backward, because
//     its reduce-scatter needed their gradients).
// The copies to different peers go on one stream per peer (so all NVLink links are used at once),
// forked from and joined back into the caller's stream. Each operation is handed to the NCCL
// watchdog under `watch` (the NCCL communicator of the same group): a peer that dies leaves the
// flag waits unsatisfied, and the watchdog ends the process after the timeout, naming the group.
// The IPC mappings and flag operations are comm/nccl/peer_ipc.h's, shared with the
// context-parallel ring exchange (comm/nccl/peer_ring.h).
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "comm/nccl/nccl_communicator.h"
#include "comm/nccl/peer_ipc.h"
#include "core/dtype.h"
#include "core/stream.h"

namespace mt {

class PeerCopyGroup {
 public:
  static constexpr int kMaxRanks = peer_ipc::kMaxRanks;
  /// A registered buffer: the base of a cudaMalloc allocation (CUDA IPC exports whole
  /// allocations) and its size in bytes; every rank registers buffers of the same sizes.
  struct Region {
    void* base = nullptr;
    size_t bytes = 0;
  };

  /// Collective over `comm` (its ranks, one GPU each, on comm.device()). Registers `regions`
  /// (mapped on every peer) and allocates the staging memory: 2 · N · stage_elems fp32 values
  /// (stage_elems >= 1). Returns nullptr on every rank when the group cannot use copy-engine
  /// transfers: a group of one rank or of more than kMaxRanks, ranks on different hosts, or a
  /// peer whose memory cannot be mapped (no peer access, IPC refused); the reason is in
  /// *why_not when given. The decision is agreed over the group, so either every rank gets a
  /// group or none does. Errors (mt::Error): regions that differ in count or size between ranks,
  /// CUDA errors other than IPC refusals.
  static std::unique_ptr<PeerCopyGroup> create(const std::shared_ptr<NcclCommunicator>& comm,
                                               const std::vector<Region>& regions, size_t stage_elems,
                                               std::string* why_not = nullptr);
  ~PeerCopyGroup();
  PeerCopyGroup(const PeerCopyGroup&) = delete;
  PeerCopyGroup& operator=(const PeerCopyGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t stage_elems() const { return stage_elems_; }

  /// In place in fp32 region `region`: for the N·m elements starting at element `offset`,
  /// this rank's chunk [offset + rank·m, offset + (rank+1)·m) becomes the sum over ranks of that
  /// chunk, summed in rank order (x_0 + x_1 + ... + x_{N-1}, fp32). Other chunks are left as they
  /// were (they are read by the copies). Ordered on `stream` (returns without waiting).
  /// Errors: a range outside the region; a stream being captured into a CUDA graph (the flags
  /// carry host-counted sequence numbers, which a replay would repeat).
  void reduce_scatter_sum_f32(int region, size_t offset, size_t m, const Stream& stream) {
    reduce_scatter_sum(region, offset, m, DType::kF32, stream);
  }
  /// The same for fp32 or bf16 elements (offset and m counted in elements of `dtype`). bf16 sums
  /// are accumulated in fp32 in rank order and rounded once (round to nearest even). Errors: as
  /// above; another dtype.
  void reduce_scatter_sum(int region, size_t offset, size_t m, DType dtype, const Stream& stream);
  /// In place in region `region`: for the N·chunk_bytes bytes starting at byte `offset`, every
  /// rank's chunk [offset + r·chunk_bytes, ...) is copied into the same place on every rank.
  /// Ordered on `stream`. Errors: a range outside the region; a capturing stream.
  void all_gather(int region, size_t offset, size_t chunk_bytes, const Stream& stream);

 private:
  PeerCopyGroup() = default;
  // Flags on every rank, written by peers: data[i] (reduce-scatter piece from rank i arrived),
  // ack[j] (rank j consumed our piece), gather[i] (all-gather chunk from rank i arrived).
  struct Flags {
    uint32_t data[kMaxRanks];
    uint32_t ack[kMaxRanks];
    uint32_t gather[kMaxRanks];
  };
  void fork(cudaStream_t s);
  void join(cudaStream_t s);
  void check_stream(cudaStream_t s, const char* op) const;
  void check_range(int region, size_t offset_bytes, size_t bytes, const char* op) const;
  void reduce_scatter_piece(int region, size_t offset, size_t m, size_t p0, size_t len, DType dtype, cudaStream_t s);
  // On peer j's stream: copy `bytes` from src (here) to dst (mapped peer memory), then write
  // `value` into the peer's `flag` (fenced after the copy).
  void push(int j, void* dst, const void* src, size_t bytes, uint32_t* flag, uint32_t value);

  std::shared_ptr<NcclCommunicator> watch_;
  int rank_ = 0, size_ = 1, device_ = 0;
  size_t stage_elems_ = 0;
  std::vector<Region> regions_;
  // peer_base_[region][r]: region's base as mapped here (own rank: the local pointer).
  std::vector<std::array<void*, kMaxRanks>> peer_base_;
  std::array<Flags*, kMaxRanks> flags_{};    // flags_[r]: rank r's flags, mapped here
  std::array<float*, kMaxRanks> staging_{};  // staging_[r]: rank r's staging, mapped here (slots of stage_elems_ fp32)
  void* own_flags_ = nullptr;                // cudaMalloc'd here (Flags)
  void* own_staging_ = nullptr;              // cudaMalloc'd here (2 · N · stage_elems fp32)
  peer_ipc::PeerMappings mappings_;          // flags, staging, then the regions of every rank
  std::array<cudaStream_t, kMaxRanks> peer_streams_{};
  cudaEvent_t fork_ev_ = nullptr;
  std::array<cudaEvent_t, kMaxRanks> join_ev_{};
  uint32_t rs_seq_ = 0, ag_seq_ = 0;  // operations issued so far (the flags' values)
};

/// out[k] = Σ_{r < n} src[r][k] for k < count, summed in r order in fp32 and stored as `dtype`
/// (fp32, bf16 or fp16, round to nearest even); out may alias a src. Launched on `stream`
/// (peer_copy.cu).
void launch_sum_ranks(void* out, const std::array<const void*, PeerCopyGroup::kMaxRanks>& src, int n, size_t count,
                      DType dtype, cudaStream_t stream);

}  // namespace mt
