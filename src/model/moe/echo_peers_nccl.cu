// The NCCL backend of EchoPeers (model/moe/echo_peers.h): every EP rank's buffer is an NCCL
// symmetric memory window (ncclMemAlloc + ncclCommWindowRegister over the EP group's communicator,
// NCCL 2.28's device API), and a transfer is one kernel of kBlocks CTAs: an LSA barrier (every rank
// has reached this transfer in stream order, so it is done with the previous contents), the
// copies of the used slots straight into the peers' windows (ncclGetPeerPointer over NVLink; each
// CTA copies its share of every message, 16-byte units when aligned), the bytes counted, and an
// LSA barrier with release / acquire ordering (every copy is visible before any rank's next
// kernel reads it). The barrier epochs live in NCCL's device resources, so a captured graph
// replays the kernel. The window must lie within one LSA team (the GPUs of one host over NVLink):
// available() says no otherwise.
#ifdef MT_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <fmt/format.h>

#include <cstring>
#include <string>
#include <vector>

#include "comm/nccl/nccl_communicator.h"
#include "core/buffer.h"
#include "core/cuda_check.h"
#include "model/moe/echo_peers.h"

namespace mt {
namespace {

constexpr int kBlocks = 16;    // CTAs of a transfer (one LSA barrier each)
constexpr int kThreads = 512;

#define MT_NCCL_ECHO_CHECK(call)                                                                         \
  do {                                                                                                   \
    const ncclResult_t r_ = (call);                                                                      \
    MT_CHECK(r_ == ncclSuccess, "EchoPeers (NCCL window): {} failed: {}", #call, ncclGetErrorString(r_)); \
  } while (0)

struct KernelArgs {
  const void* const* table1;
  const void* const* table2;
  const char* base1;
  const char* base2;
  size_t bytes1, bytes2, offset1, offset2;
  const int32_t* index;
  int messages, S, groups, block_base;
  unsigned long long* counter;
};

// dst[i] = src[i] for `bytes` bytes in units U, the CTAs of the grid striding over the units.
template <typename U>
__device__ void copy_units(char* dst, const char* src, size_t bytes) {
  const size_t n = bytes / sizeof(U);
  U* d = reinterpret_cast<U*>(dst);
  const U* s = reinterpret_cast<const U*>(src);
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    d[i] = s[i];
}

template <typename U>
__global__ void __launch_bounds__(kThreads) put_kernel(ncclDevComm dev_comm, ncclWindow_t win, KernelArgs a) {
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dev_comm, ncclTeamLsa(dev_comm), dev_comm.lsaBarrier,
                                         blockIdx.x};
  bar.sync(ncclCoopCta(), ::cuda::memory_order_relaxed);  // every rank is done with the previous contents
  for (int m = 0; m < a.messages; ++m) {
    const int g = a.index[m];
    if (g < 0 || g >= a.groups) continue;
    const int peer = m / a.S;
    const size_t block = static_cast<size_t>(a.block_base + m % a.S);
    const char* s1 = a.table1 ? static_cast<const char*>(a.table1[g]) : a.base1 + static_cast<size_t>(g) * a.bytes1;
    const char* s2 = a.table2 ? static_cast<const char*>(a.table2[g]) : a.base2 + static_cast<size_t>(g) * a.bytes2;
    copy_units<U>(static_cast<char*>(ncclGetPeerPointer(win, a.offset1 + block * a.bytes1, peer)), s1, a.bytes1);
    copy_units<U>(static_cast<char*>(ncclGetPeerPointer(win, a.offset2 + block * a.bytes2, peer)), s2, a.bytes2);
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(a.counter, static_cast<unsigned long long>(a.bytes1 + a.bytes2));
  }
  bar.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel);  // every copy is visible to its reader
}

class NcclEchoPeers final : public EchoPeers {
 public:
  NcclEchoPeers(const ExpertParallel& ep, Device device, const Sizes& sizes)
      : EchoPeers(ep, sizes),
        group_(ep.ep_group),
        comm_(dynamic_cast<const NcclCommunicator&>(*ep.ep_group).raw()),
        counter_(device, sizeof(unsigned long long)) {
    bytes_ = layout().bytes;
    MT_NCCL_ECHO_CHECK(ncclMemAlloc(&buffer_, bytes_));
    MT_CUDA_CHECK(cudaMemset(buffer_, 0, bytes_));
    MT_NCCL_ECHO_CHECK(ncclCommWindowRegister(comm_, buffer_, bytes_, &window_, NCCL_WIN_COLL_SYMMETRIC));
    // a communicator without symmetric-memory support registers no window and still succeeds: the
    // kernel's ncclGetPeerPointer would then read through a null window
    MT_CHECK(window_ != nullptr,
             "EchoPeers (NCCL window): ncclCommWindowRegister of {} bytes returned no window (the EP "
             "communicator has no symmetric-memory support)",
             bytes_);
    ncclDevCommRequirements reqs;
    std::memset(&reqs, 0, sizeof(reqs));
    reqs.lsaBarrierCount = kBlocks;
    MT_NCCL_ECHO_CHECK(ncclDevCommCreate(comm_, &reqs, &dev_comm_));
    MT_CUDA_CHECK(cudaMemset(counter_.data(), 0, sizeof(unsigned long long)));
    set_views(buffer_, device);
  }
  ~NcclEchoPeers() override {
    cudaDeviceSynchronize();  // no transfer may still run (destructors do not throw)
    ncclDevCommDestroy(comm_, &dev_comm_);
    ncclCommWindowDeregister(comm_, window_);
    ncclMemFree(buffer_);
  }
  int64_t bytes_sent_sync(const Stream& stream) const override {
    unsigned long long v = 0;
    copy_bytes(&v, Device::cpu(), counter_.data(), counter_.device(), sizeof(v), stream);
    stream.synchronize();
    return static_cast<int64_t>(v);
  }
  void reset_bytes(const Stream& stream) override {
    MT_CUDA_CHECK(cudaMemsetAsync(counter_.data(), 0, sizeof(unsigned long long),
                                  static_cast<cudaStream_t>(stream.cuda_stream())));
  }

 private:
  void transfer(const Transfer& t, const Stream& stream) override {
    const KernelArgs a{t.table1,
                       t.table2,
                       static_cast<const char*>(t.base1),
                       static_cast<const char*>(t.base2),
                       t.bytes1,
                       t.bytes2,
                       t.offset1,
                       t.offset2,
                       t.index.data_as<int32_t>(),
                       static_cast<int>(P_ * S_),
                       static_cast<int>(S_),
                       static_cast<int>(t.groups),
                       static_cast<int>(t.block_base),
                       static_cast<unsigned long long*>(counter_.data())};
    const auto st = static_cast<cudaStream_t>(stream.cuda_stream());
    // 16-byte units when every source, size and window offset allows (the offsets are 256-aligned);
    // else the act dtype's (2 bytes) or fp32's element
    if (t.aligned16) {
      put_kernel<uint4><<<kBlocks, kThreads, 0, st>>>(dev_comm_, window_, a);
    } else if (t.bytes1 % 4 == 0 && t.bytes2 % 4 == 0 && t.table1 == nullptr) {
      put_kernel<uint32_t><<<kBlocks, kThreads, 0, st>>>(dev_comm_, window_, a);
    } else {
      put_kernel<uint16_t><<<kBlocks, kThreads, 0, st>>>(dev_comm_, window_, a);
    }
    MT_CUDA_CHECK_LAUNCH();
  }

  std::shared_ptr<Communicator> group_;  // kept alive while its window is registered
  ncclComm_t comm_;
  void* buffer_ = nullptr;
  size_t bytes_ = 0;
  ncclWindow_t window_{};
  ncclDevComm dev_comm_{};
  Buffer counter_;
};

}  // namespace

namespace echo_detail {

bool nccl_device_api_matches(std::string* why_not) {
  int version = 0;
  if (ncclGetVersion(&version) == ncclSuccess && version == NCCL_VERSION_CODE) return true;
  if (why_not)
    *why_not = fmt::format("the NCCL library is version {}, its device API was compiled against {}", version,
                           NCCL_VERSION_CODE);
  return false;
}

bool nccl_echo_peers_available(const ExpertParallel& ep, std::string* why_not) {
  auto no = [&](const char* why) {
    if (why_not) *why_not = why;
    return false;
  };
  const auto* nccl = dynamic_cast<const NcclCommunicator*>(ep.ep_group.get());
  if (nccl == nullptr) return no("the EP group is not an NCCL communicator");
  // the device API's structures (ncclDevComm, the window) are compiled in from the headers: the
  // library must be the same version, or the kernel reads them wrongly (on 2 x H200 a 2.28.3 library
  // under 2.28.9 headers faulted with an illegal address inside the used-slot transfers)
  if (!nccl_device_api_matches(why_not)) return false;
  // every rank of the group sees the same: the group lies within its LSA team or it does not
  if (ncclTeamLsa(nccl->raw()).nRanks != nccl->size())
    return no("the EP group spans more than one NVLink domain (NCCL LSA team)");
  return true;
}

std::unique_ptr<EchoPeers> make_nccl_echo_peers(const ExpertParallel& ep, Device device,
                                                const EchoPeers::Sizes& sizes) {
  return std::make_unique<NcclEchoPeers>(ep, device, sizes);
}

}  // namespace echo_detail
}  // namespace mt
#endif  // MT_WITH_NCCL
