#include "comm/nccl/peer_ipc.h"

#include <cuda.h>
#include <unistd.h>

#include <cstring>

#include "core/check.h"
#include "core/cuda_check.h"

namespace mt::peer_ipc {

namespace {

using WaitValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// The driver functions, through the runtime's entry-point query (no binary links libcuda: the
// CPU-only machines have none).
struct DriverOps {
  WaitValue32 wait = nullptr;
  WriteValue32 write = nullptr;
  GetAddressRange range = nullptr;
  std::string missing;  // empty when all were found
  static const DriverOps& get() {
    static const DriverOps ops = [] {
      DriverOps o;
      auto load = [&](const char* name, void** fn) {
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSuccess;
        if (cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess || *fn == nullptr) {
          cudaGetLastError();
          *fn = nullptr;
          o.missing += o.missing.empty() ? name : std::string(", ") + name;
        }
      };
      load("cuStreamWaitValue32", reinterpret_cast<void**>(&o.wait));
      load("cuStreamWriteValue32", reinterpret_cast<void**>(&o.write));
      load("cuMemGetAddressRange", reinterpret_cast<void**>(&o.range));
      return o;
    }();
    return ops;
  }
};

void check_cu(CUresult r, const char* what) {
  MT_REQUIRE(r == CUDA_SUCCESS, "CUDA driver error {} in {}", static_cast<int>(r), what);
}

// The driver's function `fn` (a member of DriverOps), or an error naming what is missing.
template <typename F>
F op(F DriverOps::*fn) {
  const DriverOps& o = DriverOps::get();
  MT_REQUIRE(o.*fn != nullptr, "the CUDA driver has no {}", o.missing);
  return o.*fn;
}

}  // namespace

void wait_flag(cudaStream_t s, const uint32_t* flag, uint32_t value) {
  check_cu(op(&DriverOps::wait)(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), value,
                      CU_STREAM_WAIT_VALUE_GEQ),
           "cuStreamWaitValue32");
}

// No CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER: the write is preceded by a memory fence.
void write_flag(cudaStream_t s, uint32_t* flag, uint32_t value) {
  check_cu(op(&DriverOps::write)(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), value,
                       CU_STREAM_WRITE_VALUE_DEFAULT),
           "cuStreamWriteValue32");
}

bool stream_mem_ops_available(std::string* why) {
  const DriverOps& o = DriverOps::get();
  if (o.wait && o.write) return true;
  if (why) *why = "the CUDA driver has no cuStreamWaitValue32 / cuStreamWriteValue32";
  return false;
}

bool is_capturing(cudaStream_t s) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  MT_CUDA_CHECK(cudaStreamIsCapturing(s, &cs));
  return cs != cudaStreamCaptureStatusNone;
}

void require_not_capturing(cudaStream_t s, const char* what) {
  MT_REQUIRE(!is_capturing(s),
             "{} on a stream being captured into a CUDA graph: the flag values are sequence numbers counted on "
             "the host, so a replayed graph would wait for values already seen",
             what);
}

bool all_ok(NcclCommunicator& comm, bool ok, const Stream& stream) {
  const char mine = ok ? 1 : 0;
  const std::vector<char> all = all_gather_host(comm, &mine, 1, stream);
  for (char c : all)
    if (!c) return false;
  return true;
}

std::string other_host(NcclCommunicator& comm, const Stream& stream) {
  char mine[64] = {};
  gethostname(mine, sizeof(mine) - 1);
  const std::vector<char> all = all_gather_host(comm, mine, sizeof(mine), stream);
  for (int r = 0; r < comm.size(); ++r) {
    const char* h = all.data() + r * sizeof(mine);
    if (std::strncmp(h, mine, sizeof(mine)) != 0)
      return fmt::format("rank {} runs on host '{}', rank {} on '{}'", comm.rank(), mine, r,
                         std::string(h, strnlen(h, sizeof(mine))));
  }
  return {};
}

std::pair<void*, size_t> allocation_of(const void* p) {
  CUdeviceptr base = 0;
  size_t bytes = 0;
  check_cu(op(&DriverOps::range)(&base, &bytes, reinterpret_cast<CUdeviceptr>(p)), "cuMemGetAddressRange");
  return {reinterpret_cast<void*>(base), bytes};
}

bool PeerMappings::map(NcclCommunicator& comm, const std::vector<void*>& local, const Stream& stream,
                       std::string* why) {
  close();
  const int n = comm.size(), me = comm.rank();
  MT_REQUIRE(n <= kMaxRanks, "PeerMappings: {} ranks (at most {})", n, kMaxRanks);
  std::vector<cudaIpcMemHandle_t> handles(local.size());
  bool ok = true;
  std::string reason;
  for (size_t k = 0; k < local.size() && ok; ++k) {
    if (cudaIpcGetMemHandle(&handles[k], local[k]) != cudaSuccess) {
      reason = fmt::format("cudaIpcGetMemHandle refused: {}", cudaGetErrorString(cudaGetLastError()));
      ok = false;
    }
  }
  if (!all_ok(comm, ok, stream)) {
    if (why) *why = reason.empty() ? "a peer could not export its memory" : reason;
    return false;
  }
  const std::vector<char> all =
      local.empty() ? std::vector<char>()
                    : all_gather_host(comm, handles.data(), handles.size() * sizeof(cudaIpcMemHandle_t), stream);
  base_.assign(local.size(), {});
  for (int r = 0; r < n && ok; ++r) {
    for (size_t k = 0; k < local.size(); ++k) {
      void* p = local[k];
      if (r != me) {
        cudaIpcMemHandle_t h;
        std::memcpy(&h, all.data() + (r * local.size() + k) * sizeof(cudaIpcMemHandle_t), sizeof(h));
        if (cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
          reason = fmt::format("cudaIpcOpenMemHandle of rank {}'s memory refused: {}", r,
                               cudaGetErrorString(cudaGetLastError()));
          ok = false;
          break;
        }
        opened_.push_back(p);
      }
      base_[k][static_cast<size_t>(r)] = p;
    }
  }
  if (!all_ok(comm, ok, stream)) {
    close();
    if (why) *why = reason.empty() ? "a peer could not map this rank's memory" : reason;
    return false;
  }
  return true;
}

void PeerMappings::close() {
  for (void* p : opened_) cudaIpcCloseMemHandle(p);
  opened_.clear();
  base_.clear();
}

}  // namespace mt::peer_ipc
