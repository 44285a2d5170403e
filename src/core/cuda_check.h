// CUDA / cuBLAS error macros (only in translation units that see the CUDA headers).
#pragma once
#ifdef MT_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/check.h"

#define MT_CUDA_CHECK(call)                                                                      \
  do {                                                                                           \
    cudaError_t mt_err_ = (call);                                                                \
    if (mt_err_ != cudaSuccess) [[unlikely]] {                                                   \
      ::mt::throw_error(__FILE__, __LINE__, fmt::format("CUDA error {} ({}) in {}",              \
                                                        cudaGetErrorName(mt_err_),               \
                                                        cudaGetErrorString(mt_err_), #call));    \
    }                                                                                            \
  } while (0)

/// After a kernel launch: reports launch-configuration errors (asynchronous faults surface at
/// the next synchronising call).
#define MT_CUDA_CHECK_LAUNCH() MT_CUDA_CHECK(cudaGetLastError())

#define MT_CUBLAS_CHECK(call)                                                                    \
  do {                                                                                           \
    cublasStatus_t mt_st_ = (call);                                                              \
    if (mt_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                                          \
      ::mt::throw_error(__FILE__, __LINE__,                                                      \
                        fmt::format("cuBLAS error {} in {}", static_cast<int>(mt_st_), #call));  \
    }                                                                                            \
  } while (0)
#endif
