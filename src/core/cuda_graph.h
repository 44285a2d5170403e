// CUDA graphs: a region of stream work captured once and replayed with one launch
// (docs/cuda_graphs.md). Capture runs in cudaStreamCaptureModeThreadLocal: a host
// synchronisation or a device allocation issued by the capturing thread inside the region
// invalidates the capture, and capture() reports it as an error instead of recording a graph
// that would replay wrong values. Everything the region's kernels read that changes between
// replays must live in device memory at fixed addresses (docs/architecture.md principle 8).
#pragma once
#include <cstddef>
#include <functional>
#include <memory>

#include "core/stream.h"

namespace mt {

class CudaGraph {
 public:
  CudaGraph();
  ~CudaGraph();
  CudaGraph(CudaGraph&&) noexcept;
  CudaGraph& operator=(CudaGraph&&) noexcept;

  /// Captures the work `body` issues on `stream` (and on streams that join it through events)
  /// and instantiates it; replaces a previous capture. Nothing in `body` runs on the device
  /// during capture. Errors: mt::Error when `stream` is not a CUDA stream, when the binary has
  /// no CUDA, or when the capture fails (the CUDA error, e.g. cudaErrorStreamCaptureUnsupported
  /// for a synchronisation inside the region); the stream is left out of capture mode either way.
  void capture(const Stream& stream, const std::function<void()>& body);
  /// Replays the captured work on `stream`. Errors: mt::Error before a capture.
  void launch(const Stream& stream) const;
  bool captured() const;
  /// Number of nodes (kernels, copies, memsets, ...) of the captured graph.
  size_t num_nodes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Statistics for the capture checks: how many host synchronisations (Stream/Event::synchronize)
/// and how many Buffer allocations the calling thread has made (other threads, e.g. the data
/// loader's, do not count: capture is per thread, cudaStreamCaptureModeThreadLocal).
uint64_t host_sync_count();
uint64_t buffer_allocation_count();

}  // namespace mt
