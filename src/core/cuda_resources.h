// Per-stream CUDA resources (only with the CUDA backend): the stream, a cuBLASLt handle, a
// 32 MiB workspace and a 1 MiB fp32 scratch for GEMM epilogues' bias gradients, created together
// and destroyed together (RAII).
#pragma once
#ifdef MT_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/device.h"

namespace mt {

struct CudaStreamResources {
  /// high_priority: the stream at the device's greatest priority (cudaDeviceGetStreamPriorityRange).
  explicit CudaStreamResources(Device device, bool high_priority = false);
  ~CudaStreamResources();
  CudaStreamResources(const CudaStreamResources&) = delete;
  CudaStreamResources& operator=(const CudaStreamResources&) = delete;

  static constexpr size_t kWorkspaceBytes = 32u << 20;
  Device device;
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  /// fp32 [kBiasGradScratch]: where a cuBLASLt bias-gradient epilogue (which overwrites) writes
  /// before the result is added to an accumulated gradient; used in stream order only.
  static constexpr size_t kBiasGradScratch = 1u << 18;
  float* bias_grad_scratch = nullptr;
  int num_sms = 0;
};

}  // namespace mt
#endif
