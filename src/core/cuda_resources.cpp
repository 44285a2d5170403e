#ifdef MT_WITH_CUDA
#include "core/cuda_resources.h"

#include <map>
#include <mutex>

#include "core/cuda_check.h"

namespace mt {

CudaStreamResources::CudaStreamResources(Device d, bool high_priority) : device(d) {
  MT_CUDA_CHECK(cudaSetDevice(d.index));
  int least = 0, greatest = 0;
  if (high_priority) MT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  MT_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, high_priority ? greatest : least));
  MT_CUBLAS_CHECK(cublasLtCreate(&lt));
  MT_CUDA_CHECK(cudaMalloc(&workspace, kWorkspaceBytes));
  MT_CUDA_CHECK(cudaMalloc(&bias_grad_scratch, kBiasGradScratch * sizeof(float)));
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, d.index));
}

CudaStreamResources::~CudaStreamResources() {
  if (bias_grad_scratch) cudaFree(bias_grad_scratch);
  if (workspace) cudaFree(workspace);
  if (lt) cublasLtDestroy(lt);
  if (stream) cudaStreamDestroy(stream);
}

int compute_capability(int index) {
  static std::mutex mu;
  static std::map<int, int> known;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = known.find(index); it != known.end()) return it->second;
  int major = 0, minor = 0;
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index));
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index));
  return known.emplace(index, major * 10 + minor).first->second;
}

}  // namespace mt
#endif
