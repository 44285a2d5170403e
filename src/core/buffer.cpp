#include "core/buffer.h"

#include "core/cuda_graph.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

#ifdef MT_WITH_CUDA
#include "core/cuda_check.h"
#endif

namespace mt {

namespace {
std::atomic<size_t> g_bytes[2];  // [cpu, cuda] -- statistics only
thread_local uint64_t g_allocations = 0;  // statistics for the CUDA graph checks (per thread)
}

size_t device_bytes_allocated(Device device) { return g_bytes[device.is_cuda() ? 1 : 0].load(); }
uint64_t buffer_allocation_count() { return g_allocations; }

Buffer::Buffer(Device device, size_t bytes, HostMemory host) : bytes_(bytes), device_(device), host_(host) {
  if (bytes == 0) return;
  ++g_allocations;
  if (device.is_cpu()) {
    if (host == HostMemory::kPinned) {
#ifdef MT_WITH_CUDA
      // Without a usable driver (CPU-only machines) fall back to pageable memory.
      if (cudaMallocHost(&data_, bytes) != cudaSuccess) {
        cudaGetLastError();
        data_ = nullptr;
        host_ = HostMemory::kPageable;
      }
#else
      host_ = HostMemory::kPageable;
#endif
    }
    if (!data_) {
      size_t rounded = (bytes + 63) / 64 * 64;
      data_ = std::aligned_alloc(64, rounded);
      MT_REQUIRE(data_ != nullptr, "out of host memory allocating {} bytes", bytes);
    }
  } else {
#ifdef MT_WITH_CUDA
    set_current_device(device);
    cudaError_t err = cudaMalloc(&data_, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      MT_FAIL("out of GPU memory on {}: requested {:.1f} MiB, free {:.1f} MiB of {:.1f} MiB ({})", device.str(),
              bytes / 1048576.0, free_b / 1048576.0, total_b / 1048576.0, cudaGetErrorString(err));
    }
#else
    MT_FAIL("device {} requested but this binary was built without CUDA", device.str());
#endif
  }
  g_bytes[device.is_cuda() ? 1 : 0] += bytes;
}

void Buffer::release() {
  if (!data_) return;
  g_bytes[device_.is_cuda() ? 1 : 0] -= bytes_;
  if (device_.is_cpu()) {
#ifdef MT_WITH_CUDA
    if (host_ == HostMemory::kPinned) {
      cudaFreeHost(data_);
      data_ = nullptr;
      return;
    }
#endif
    std::free(data_);
  } else {
#ifdef MT_WITH_CUDA
    cudaFree(data_);
#endif
  }
  data_ = nullptr;
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& o) noexcept
    : data_(o.data_), bytes_(o.bytes_), device_(o.device_), host_(o.host_) {
  o.data_ = nullptr;
  o.bytes_ = 0;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = o.data_;
    bytes_ = o.bytes_;
    device_ = o.device_;
    host_ = o.host_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

Tensor Buffer::as(DType dtype, const std::vector<int64_t>& shape) const {
  Tensor t(data_, dtype, device_, shape);
  MT_CHECK(t.nbytes() <= bytes_, "buffer of {} bytes too small for {}", bytes_, t.str());
  return t;
}

void Arena::materialize(size_t bytes) {
  size_t n = std::max(bytes, peak_);
  buffer_ = Buffer(device_, n == 0 ? 256 : n);
  used_ = 0;
}

Tensor Arena::alloc(DType dtype, const std::vector<int64_t>& shape, const char* what) {
  Tensor probe(nullptr, dtype, device_, shape);
  size_t bytes = (probe.nbytes() + 255) / 256 * 256;
  size_t off = used_;
  used_ += bytes;
  peak_ = std::max(peak_, used_);
  if (!buffer_.data()) return probe;  // planning pass
  MT_CHECK(used_ <= buffer_.bytes(), "arena on {} exhausted allocating {} ({} bytes; capacity {})", device_.str(),
           what, bytes, buffer_.bytes());
  return Tensor(static_cast<char*>(buffer_.data()) + off, dtype, device_, shape);
}

}  // namespace mt

namespace mt {
namespace {
// cudaMemGetInfo of a CUDA device: {free, total} bytes.
std::pair<size_t, size_t> memory_info(Device device) {
  size_t free_b = 0, total_b = 0;
#ifdef MT_WITH_CUDA
  set_current_device(device);
  MT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
#else
  (void)device;
#endif
  return {free_b, total_b};
}
}  // namespace

size_t device_memory_in_use(Device device) {
  if (!device.is_cuda()) return 0;
  const auto [free_b, total_b] = memory_info(device);
  return total_b - free_b;
}

size_t device_memory_free(Device device) { return device.is_cuda() ? memory_info(device).first : SIZE_MAX; }
}  // namespace mt
