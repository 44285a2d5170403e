// Streams and events. A CPU stream runs work inline (every op has completed when it returns);
// a CUDA stream wraps cudaStream_t plus the per-stream cuBLASLt handle and workspace that the
// matmul op uses. Every launcher and collective takes an explicit Stream.
#pragma once
#include <memory>

#include "core/device.h"
#include "core/tensor.h"

namespace mt {

struct CudaStreamResources;  // defined in core/stream.cpp (cudaStream_t, cublasLt handle, workspace)

/// CUDA stream priority: kHigh for communication that runs beside compute kernels (the context-
/// parallel ring), so that the GPU's block scheduler starts its kernels as soon as an SM frees
/// instead of after every queued block of the compute kernel. No effect on the CPU.
enum class StreamPriority : uint8_t { kNormal, kHigh };

class Stream {
 public:
  /// Creates a new stream on `device` (CUDA: a non-blocking stream with its own cuBLASLt handle,
  /// at the device's greatest priority for kHigh).
  explicit Stream(Device device = Device::cpu(), StreamPriority priority = StreamPriority::kNormal);
  ~Stream();
  Stream(Stream&&) noexcept;
  Stream& operator=(Stream&&) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  Device device() const { return device_; }
  bool is_cpu() const { return device_.is_cpu(); }
  /// cudaStream_t as void* (nullptr for CPU).
  void* cuda_stream() const;
  CudaStreamResources* cuda() const { return cuda_.get(); }
  /// Blocks the host until all work queued on the stream has finished.
  void synchronize() const;

 private:
  Device device_;
  std::unique_ptr<CudaStreamResources> cuda_;
};

/// Copies src into dst (same numel and dtype, both contiguous; any device pair), ordered on
/// `stream`. Host<->device copies with pageable memory may block.
void copy(const Tensor& dst, const Tensor& src, const Stream& stream);
/// dst[r, :] = src[r, :] for 2-D views [rows, cols] of one device whose rows are contiguous
/// (stride(1) == 1) at any row stride, e.g. a column block of a matrix (x.slice(1, c0, c1)); same
/// dtype and shape. CUDA: one cudaMemcpy2DAsync (capturable). Errors: mt::Error otherwise.
void copy_rows(const Tensor& dst, const Tensor& src, const Stream& stream);
/// Raw byte copy between devices, ordered on `stream`.
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n, const Stream& stream);
/// Fills the bytes of `t` with `byte` (memset), ordered on `stream`.
void memset_tensor(const Tensor& t, int byte, const Stream& stream);

/// Host-side timing event (cudaEvent on CUDA, steady clock on CPU).
class Event {
 public:
  explicit Event(Device device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(const Stream& stream);
  /// Makes `stream` wait for this event (no host block).
  void wait(const Stream& stream) const;
  void synchronize() const;
  /// Whether the work recorded before the event has completed (does not block; CPU: true).
  bool query() const;
  /// Milliseconds from `start` to this event; both must have completed (call synchronize()).
  float elapsed_ms_since(const Event& start) const;

 private:
  Device device_;
  void* event_ = nullptr;
  double host_ms_ = 0.0;
};

}  // namespace mt
