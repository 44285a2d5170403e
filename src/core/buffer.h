// Owning memory: Buffer (one allocation, CPU 64-byte aligned or cudaMalloc; pinned host
// optional) and Arena (a bump allocator over one Buffer, planned once per configuration so
// that no allocation happens inside a training step).
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mt {

enum class HostMemory : uint8_t { kPageable, kPinned };

/// RAII allocation on one device. Move-only. Errors: mt::Error on allocation failure, naming
/// the size and device.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Device device, size_t bytes, HostMemory host = HostMemory::kPageable);
  ~Buffer();
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  /// Whole buffer as a typed contiguous tensor of the given shape (bytes must suffice).
  Tensor as(DType dtype, const std::vector<int64_t>& shape) const;

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_{};
  HostMemory host_ = HostMemory::kPageable;
};

/// Bump allocator. Plan once: create with Arena::planning(device), run the allocation sequence
/// (tensors come back with null data), then materialize() and run the same sequence again.
/// Every allocation is 256-byte aligned.
class Arena {
 public:
  static Arena planning(Device device) { return Arena(device); }
  /// Allocates the planned size (or `bytes` if larger) and resets the cursor.
  void materialize(size_t bytes = 0);
  Tensor alloc(DType dtype, const std::vector<int64_t>& shape, const char* what = "");
  void reset() { used_ = 0; }
  size_t used() const { return used_; }
  size_t peak() const { return peak_; }
  bool planned() const { return !buffer_.data() && buffer_.bytes() == 0; }
  Device device() const { return device_; }

 private:
  explicit Arena(Device device) : device_(device) {}
  Device device_;
  Buffer buffer_;
  size_t used_ = 0;
  size_t peak_ = 0;
};

/// Bytes currently allocated on the device by this process's Buffers (for memory reports).
size_t device_bytes_allocated(Device device);

}  // namespace mt

namespace mt {
/// Bytes in use on a CUDA device by all processes and contexts (cudaMemGetInfo: total - free);
/// 0 for the CPU.
size_t device_memory_in_use(Device device);
/// Bytes free on a CUDA device (cudaMemGetInfo); SIZE_MAX for the CPU.
size_t device_memory_free(Device device);
}  // namespace mt
