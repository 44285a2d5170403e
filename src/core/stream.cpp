#include "core/stream.h"

#include <atomic>
#include <chrono>
#include <cstring>

#include "core/buffer.h"
#include "core/cuda_graph.h"
#ifdef MT_WITH_CUDA
#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#else
namespace mt {
struct CudaStreamResources {};  // no CUDA backend: never instantiated
}  // namespace mt
#endif

namespace mt {

Stream::Stream(Device device, StreamPriority priority) : device_(device) {
  if (device.is_cuda()) {
#ifdef MT_WITH_CUDA
    set_current_device(device);
    cuda_ = std::make_unique<CudaStreamResources>(device, priority == StreamPriority::kHigh);
#else
    MT_FAIL("device {} requested but this binary was built without CUDA", device.str());
#endif
  }
}

Stream::~Stream() = default;
Stream::Stream(Stream&&) noexcept = default;
Stream& Stream::operator=(Stream&&) noexcept = default;

void* Stream::cuda_stream() const {
#ifdef MT_WITH_CUDA
  return cuda_ ? static_cast<void*>(cuda_->stream) : nullptr;
#else
  return nullptr;
#endif
}

namespace {
thread_local uint64_t g_host_syncs = 0;  // statistics for the CUDA graph checks (per thread)
}  // namespace

uint64_t host_sync_count() { return g_host_syncs; }

void Stream::synchronize() const {
  ++g_host_syncs;
#ifdef MT_WITH_CUDA
  if (cuda_) MT_CUDA_CHECK(cudaStreamSynchronize(cuda_->stream));
#endif
}

void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n, const Stream& stream) {
  if (n == 0) return;
  if (dst_dev.is_cpu() && src_dev.is_cpu()) {
    std::memcpy(dst, src, n);
    return;
  }
#ifdef MT_WITH_CUDA
  MT_CHECK(stream.is_cpu() == false, "copy between {} and {} needs a CUDA stream", dst_dev.str(), src_dev.str());
  MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, static_cast<cudaStream_t>(stream.cuda_stream())));
#else
  MT_FAIL("copy to {} from {} needs CUDA, this binary was built without it", dst_dev.str(), src_dev.str());
#endif
}

void copy(const Tensor& dst, const Tensor& src, const Stream& stream) {
  MT_CHECK(dst.dtype() == src.dtype(), "copy dtype mismatch {} <- {}", dst.str(), src.str());
  MT_CHECK(dst.numel() == src.numel(), "copy numel mismatch {} <- {}", dst.str(), src.str());
  MT_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy needs contiguous tensors");
  copy_bytes(dst.data(), dst.device(), src.data(), src.device(), dst.nbytes(), stream);
}

void copy_rows(const Tensor& dst, const Tensor& src, const Stream& stream) {
  MT_CHECK(dst.dtype() == src.dtype() && dst.ndim() == 2 && src.ndim() == 2 && dst.size(0) == src.size(0) &&
               dst.size(1) == src.size(1) && dst.stride(1) == 1 && src.stride(1) == 1 &&
               dst.device() == src.device(),
           "copy_rows needs two 2-D views of one device with contiguous rows and the same shape and dtype, got {} <- {}",
           dst.str(), src.str());
  const size_t es = dtype_size(dst.dtype()), width = static_cast<size_t>(dst.size(1)) * es;
  const int64_t rows = dst.size(0);
  if (rows == 0 || width == 0) return;
  const size_t dpitch = static_cast<size_t>(dst.stride(0)) * es, spitch = static_cast<size_t>(src.stride(0)) * es;
  if (dst.device().is_cpu()) {
    char* d = static_cast<char*>(dst.data());
    const char* s = static_cast<const char*>(src.data());
    for (int64_t r = 0; r < rows; ++r) std::memcpy(d + r * dpitch, s + r * spitch, width);
    return;
  }
#ifdef MT_WITH_CUDA
  MT_CUDA_CHECK(cudaMemcpy2DAsync(dst.data(), dpitch, src.data(), spitch, width, static_cast<size_t>(rows),
                                  cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream.cuda_stream())));
#else
  MT_FAIL("copy_rows on {} needs CUDA, this binary was built without it", dst.device().str());
#endif
}

void memset_tensor(const Tensor& t, int byte, const Stream& stream) {
  MT_CHECK(t.is_contiguous(), "memset needs a contiguous tensor {}", t.str());
  if (t.nbytes() == 0) return;
  if (t.device().is_cpu()) {
    std::memset(t.data(), byte, t.nbytes());
    return;
  }
#ifdef MT_WITH_CUDA
  MT_CUDA_CHECK(cudaMemsetAsync(t.data(), byte, t.nbytes(), static_cast<cudaStream_t>(stream.cuda_stream())));
#endif
}

Event::Event(Device device) : device_(device) {
#ifdef MT_WITH_CUDA
  if (device.is_cuda()) {
    cudaEvent_t e;
    MT_CUDA_CHECK(cudaEventCreate(&e));
    event_ = e;
  }
#endif
}

Event::~Event() {
#ifdef MT_WITH_CUDA
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
#endif
}

void Event::record(const Stream& stream) {
  if (device_.is_cpu()) {
    host_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
    return;
  }
#ifdef MT_WITH_CUDA
  MT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream.cuda_stream())));
#endif
}

void Event::wait(const Stream& stream) const {
#ifdef MT_WITH_CUDA
  if (event_)
    MT_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.cuda_stream()), static_cast<cudaEvent_t>(event_)));
#endif
}

void Event::synchronize() const {
  ++g_host_syncs;
#ifdef MT_WITH_CUDA
  if (event_) MT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)));
#endif
}

bool Event::query() const {
#ifdef MT_WITH_CUDA
  if (event_) {
    const cudaError_t rc = cudaEventQuery(static_cast<cudaEvent_t>(event_));
    if (rc == cudaErrorNotReady) return false;
    MT_CUDA_CHECK(rc);
  }
#endif
  return true;
}

float Event::elapsed_ms_since(const Event& start) const {
  if (device_.is_cpu()) return static_cast<float>(host_ms_ - start.host_ms_);
  float ms = 0.f;
#ifdef MT_WITH_CUDA
  MT_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.event_), static_cast<cudaEvent_t>(event_)));
#endif
  return ms;
}

}  // namespace mt
