#ifdef MT_WITH_CUDA
#include "core/cuda_resources.h"

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

}  // namespace mt
#endif
