// ECHO's used-slot transfers (docs/echo.md "Only the used slots", issue 39 item 3): the clone
// weights and the clone gradients are written straight into the memory of the EP rank that needs
// them, and only for the spare slots the plan uses, instead of the fixed all-to-alls of every
// P·S expert block (ops/moe_echo_exchange.h), most of which carry nothing. Which slots are used is
// read on the device from the plan (moe_echo_exchange_index's maps), so nothing is read on the host
// and the transfers stay capturable in a CUDA graph.
//
// Every EP rank holds one buffer, the same layout on all of them, which every rank of the group
// can write:
//   clone weights    [S, n1, k1] and [S, n2, k2] (act dtype): this rank's clones, written by their
//                    home ranks (put_weights), read by the experts' GEMMs;
//   clone gradients  [P·S, n1, k1] and [P·S, n2, k2] (fp32): block s = spare slot s's gradients when
//                    this rank is the slot's home, written by the slot's rank (put_grads), added to
//                    the home experts' main gradients in slot order (moe_echo_accumulate_experts).
// A transfer is: a barrier of the group (every rank is done with the previous contents), the
// copies, a barrier (every copy is visible). The bytes each rank writes are counted on the device.
//
// Backends:
//   * thread ranks of one process (CPU tensors; the tests): the peers' buffers are plain host
//     memory, their addresses exchanged once; the group's host barrier;
//   * NCCL ranks of one NVLink domain (CUDA): an NCCL 2.28 symmetric memory window
//     (ncclMemAlloc + ncclCommWindowRegister) over the EP group's communicator and the device
//     API's LSA barrier: one kernel per transfer (barrier, copies of the used slots into the peers'
//     windows through ncclGetPeerPointer, barrier), its barrier epochs in device memory, so a
//     graph replays it.
// Elsewhere (MPI ranks in separate processes, NCCL groups that span hosts, builds without NCCL)
// available() says no and EchoClones keeps the fixed all-to-alls. The buffer is allocated outside
// the model's buffer plan, at the first transfer (an eager step: CUDA graphs capture later).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "core/stream.h"
#include "core/tensor.h"
#include "model/moe/token_dispatcher.h"
#include "ops/grouped_matmul.h"

namespace mt {

class EchoPeers {
 public:
  /// The expert tensors (every expert's two tensors have these shapes): w1 [n1, k1], w2 [n2, k2] in
  /// the act dtype; num_echo: S spare slots per EP rank.
  struct Sizes {
    int64_t num_echo = 0, n1 = 0, k1 = 0, n2 = 0, k2 = 0;
    DType act = DType::kF32;
    bool operator==(const Sizes&) const = default;
  };

  /// Whether the group's ranks can write into each other's memory (see the file comment), decided
  /// locally — no communication, the same answer on every rank of the group: CPU ranks that are not
  /// MPI processes (thread ranks); CUDA ranks of an NCCL group within one LSA team. The reason in
  /// *why_not when not.
  static bool available(const ExpertParallel& ep, Device device, std::string* why_not);
  /// Collective over ep.ep_group (P ranks; every rank calls it at the same point, outside a CUDA
  /// graph capture): allocates this rank's buffer and maps every rank's on every rank. Errors:
  /// mt::Error when available() is false, on sizes < 1, a missing group, ranks that turn out to be
  /// separate processes, NCCL or CUDA errors of the window's setup.
  static std::unique_ptr<EchoPeers> create(const ExpertParallel& ep, Device device, const Sizes& sizes);
  virtual ~EchoPeers() = default;
  EchoPeers(const EchoPeers&) = delete;
  EchoPeers& operator=(const EchoPeers&) = delete;

  const Sizes& sizes() const { return sizes_; }
  /// This rank's clone weights, [S, n1, k1] and [S, n2, k2] (act dtype): written by put_weights.
  Tensor clone_w1() const { return clone_w1_; }
  Tensor clone_w2() const { return clone_w2_; }
  /// This rank's received clone gradients, [P·S, n1, k1] and [P·S, n2, k2] (fp32): block s is
  /// written by put_grads when this rank is spare slot s's home; other blocks are stale.
  Tensor grads_in1() const { return grads_in1_; }
  Tensor grads_in2() const { return grads_in2_; }

  /// The weight dispatch. w_send int32 [P·S] (moe_echo_exchange_index's): w_send[p·S + j] = the
  /// local expert that EP rank p's clone j copies, or −1. For every m with w_send[m] = l ≥ 0 this
  /// rank copies w1[l], w2[l] (its local experts, act dtype, [n1, k1] / [n2, k2]) into rank m / S's
  /// clone block m mod S. Collective over the group (barrier, copies, barrier); ordered on `stream`,
  /// no host read. Errors: mt::Error on shapes, dtypes, devices.
  void put_weights(const GroupedWeights& w1, const GroupedWeights& w2, const Tensor& w_send, const Stream& stream);
  /// The gradient return. g1 [S, n1, k1], g2 [S, n2, k2] fp32: this rank's clones' gradients;
  /// g_send int32 [P·S] (moe_echo_exchange_index's): g_send[h·S + j] = j when this rank's clone j
  /// has its home on rank h, else −1. Each such clone's gradients go to rank h's gradient block
  /// me·S + j (me: this EP rank). Collective over the group; ordered on `stream`, no host read.
  /// Errors: mt::Error on shapes, dtypes, devices.
  void put_grads(const Tensor& g1, const Tensor& g2, const Tensor& g_send, const Stream& stream);
  /// The bytes this rank has written into the group's buffers since the last reset_bytes() (a
  /// device counter: copied to the host, synchronising `stream`).
  virtual int64_t bytes_sent_sync(const Stream& stream) const = 0;
  virtual void reset_bytes(const Stream& stream) = 0;

 protected:
  EchoPeers(const ExpertParallel& ep, const Sizes& sizes);
  /// The copies of one transfer (see put_weights / put_grads): for m in [0, P·S) with index[m] = g
  /// in [0, G), block g of the source (table[g], or base + g·bytes) into rank m / S's block
  /// block_base + m mod S of the region at `offset`; both tensors of a message (1, 2).
  struct Transfer {
    const void* const* table1 = nullptr;  // device (CUDA) or host (CPU) address tables
    const void* const* table2 = nullptr;
    const void* base1 = nullptr;  // or contiguous sources
    const void* base2 = nullptr;
    size_t bytes1 = 0, bytes2 = 0;    // per block
    size_t offset1 = 0, offset2 = 0;  // the destination regions in the buffer
    int64_t groups = 0;               // G
    int64_t block_base = 0;
    bool aligned16 = false;  // every source and size 16-byte aligned
    Tensor index;            // int32 [P·S]
  };
  virtual void transfer(const Transfer& t, const Stream& stream) = 0;
  /// The regions' byte offsets in every rank's buffer and its size.
  struct Layout {
    size_t w1 = 0, w2 = 0, g1 = 0, g2 = 0, bytes = 0;
  };
  Layout layout() const;
  /// Sets the four tensors as views of this rank's buffer at `base`.
  void set_views(void* base, Device device);

  int64_t P_, S_, me_;
  Sizes sizes_;

 private:
  Tensor clone_w1_, clone_w2_, grads_in1_, grads_in2_;
};

namespace echo_detail {
/// The NCCL backend (model/moe/echo_peers_nccl.cu; CUDA builds with NCCL): whether the group is an
/// NCCL communicator within one LSA team, and the window over it.
bool nccl_echo_peers_available(const ExpertParallel& ep, std::string* why_not);
/// Whether the NCCL library loaded at run time is the version whose headers compiled the device API
/// in (ncclGetVersion == NCCL_VERSION_CODE): the kernels read ncclDevComm and the window through
/// those headers' layouts, so a different library leaves the used-slot transfers off. False in a
/// build without NCCL; why_not names both versions (or the missing NCCL).
bool nccl_device_api_matches(std::string* why_not);
std::unique_ptr<EchoPeers> make_nccl_echo_peers(const ExpertParallel& ep, Device device,
                                                const EchoPeers::Sizes& sizes);
}  // namespace echo_detail

}  // namespace mt
