// Helpers shared by the CUDA op implementations (nvcc only): element conversions with fp32 math,
// dtype dispatch to the storage type, the raw stream, grid sizing for grid-stride loops.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <mutex>
#include <unordered_map>

#include "core/check.h"
#include "core/dtype.h"
#include "core/stream.h"

namespace mt::cuda {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

/// Calls f(T*) (a null pointer of the storage type) for the float dtype t: float, __nv_bfloat16
/// or __half. Errors: mt::Error naming `what` and the dtype for other dtypes.
template <typename F>
void dispatch_float(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::kF32: f(static_cast<float*>(nullptr)); break;
    case DType::kBF16: f(static_cast<__nv_bfloat16*>(nullptr)); break;
    case DType::kF16: f(static_cast<__half*>(nullptr)); break;
    default: MT_FAIL("{}: unsupported dtype {}", what, dtype_name(t));
  }
}

/// Block-wide sum in a fixed order (deterministic); the result is valid in thread 0. Every
/// thread of the block must call it; at most 1024 threads.
__device__ __forceinline__ float block_reduce_sum(float v) {
  __shared__ float sh[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int nw = (blockDim.x + 31) >> 5;
    v = lane < nw ? sh[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

/// query() computed once per CUDA device `device` and served from a cache afterwards: for the
/// device attributes, occupancy figures and kernel attributes a launch needs, which are the same
/// on every call (not worth a runtime query per launch in the training step). Each call site (each
/// lambda type, so each template instantiation of the caller) has its own cache; query() must
/// depend on nothing but the device and compile-time constants.
template <typename F>
int cached_per_device(int device, F&& query) {
  static std::mutex mu;
  static std::unordered_map<int, int> values;
  std::lock_guard<std::mutex> lock(mu);
  auto it = values.find(device);
  if (it == values.end()) it = values.emplace(device, query()).first;
  return it->second;
}

inline cudaStream_t cu(const Stream& s) { return static_cast<cudaStream_t>(s.cuda_stream()); }

/// Blocks for a grid-stride loop over n elements (capped; the loop covers the rest).
inline unsigned grid_for(int64_t n, int block) {
  const int64_t g = (n + block - 1) / block;
  return static_cast<unsigned>(g < 65535 * 32 ? g : 65535 * 32);
}

}  // namespace mt::cuda
