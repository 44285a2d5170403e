// Device helpers shared by the CUDA kernels of elementwise, gelu, layernorm and embedding
// (vectorised loads, element-wise maps, grid sizing; nvcc only).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/stream.h"
#include "core/cuda_resources.h"

namespace mt::cuda::ew {

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

/// V elements of T loaded/stored as one (up to 128-bit) transaction.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};
/// Elements per 128-bit vector.
template <typename T>
inline constexpr int kVec16 = static_cast<int>(16 / sizeof(T));

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

inline cudaStream_t raw(const Stream& s) { return static_cast<cudaStream_t>(s.cuda_stream()); }

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

/// Blocks for a grid-stride loop over `work` items with `threads` threads per block: enough to
/// cover the work, at most `per_sm` blocks per SM.
inline unsigned grid_for(int64_t work, int threads, const Stream& s, int per_sm = 16) {
  int sms = (s.cuda() && s.cuda()->num_sms > 0) ? s.cuda()->num_sms : 132;
  int64_t need = (work + threads - 1) / threads;
  int64_t cap = static_cast<int64_t>(sms) * per_sm;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(need, cap)));
}

template <typename T>
struct TypeTag {
  using type = T;
};

/// Calls f(TypeTag<T>{}) with T = float, __nv_bfloat16 or __half for the given dtype.
template <typename F>
void dispatch_float(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::kF32: f(TypeTag<float>{}); break;
    case DType::kBF16: f(TypeTag<__nv_bfloat16>{}); break;
    case DType::kF16: f(TypeTag<__half>{}); break;
    default: MT_FAIL("{}: unsupported dtype {} on CUDA (fp32/bf16/fp16)", what, dtype_name(t));
  }
}

// ---- generic element-wise maps: y[i] = op(a[i]) or op(a[i], b[i]), fp32 math ----------------
// Vectorised (V elements per load) over the first n/V*V elements, scalar tail; y may alias a/b.

template <int V, typename T, typename Op>
__global__ void unary_map_kernel(T* y, const T* a, int64_t n, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nv = n / V;
  for (int64_t i = tid; i < nv; i += stride) {
    Vec<T, V> va = reinterpret_cast<const Vec<T, V>*>(a)[i];
    Vec<T, V> vy;
#pragma unroll
    for (int k = 0; k < V; ++k) vy.v[k] = from_f32<T>(op(to_f32(va.v[k])));
    reinterpret_cast<Vec<T, V>*>(y)[i] = vy;
  }
  for (int64_t i = nv * V + tid; i < n; i += stride) y[i] = from_f32<T>(op(to_f32(a[i])));
}

template <int V, typename T, typename Op>
__global__ void binary_map_kernel(T* y, const T* a, const T* b, int64_t n, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nv = n / V;
  for (int64_t i = tid; i < nv; i += stride) {
    Vec<T, V> va = reinterpret_cast<const Vec<T, V>*>(a)[i];
    Vec<T, V> vb = reinterpret_cast<const Vec<T, V>*>(b)[i];
    Vec<T, V> vy;
#pragma unroll
    for (int k = 0; k < V; ++k) vy.v[k] = from_f32<T>(op(to_f32(va.v[k]), to_f32(vb.v[k])));
    reinterpret_cast<Vec<T, V>*>(y)[i] = vy;
  }
  for (int64_t i = nv * V + tid; i < n; i += stride) y[i] = from_f32<T>(op(to_f32(a[i]), to_f32(b[i])));
}

template <typename T, typename Op>
void launch_unary_map(T* y, const T* a, int64_t n, Op op, const Stream& s) {
  if (n == 0) return;
  constexpr int kThreads = 256;
  constexpr int V = kVec16<T>;
  if (aligned16(y) && aligned16(a)) {
    unary_map_kernel<V><<<grid_for(std::max<int64_t>(n / V, 1), kThreads, s), kThreads, 0, raw(s)>>>(y, a, n, op);
  } else {
    unary_map_kernel<1><<<grid_for(n, kThreads, s), kThreads, 0, raw(s)>>>(y, a, n, op);
  }
  MT_CUDA_CHECK_LAUNCH();
}

template <typename T, typename Op>
void launch_binary_map(T* y, const T* a, const T* b, int64_t n, Op op, const Stream& s) {
  if (n == 0) return;
  constexpr int kThreads = 256;
  constexpr int V = kVec16<T>;
  if (aligned16(y) && aligned16(a) && aligned16(b)) {
    binary_map_kernel<V><<<grid_for(std::max<int64_t>(n / V, 1), kThreads, s), kThreads, 0, raw(s)>>>(y, a, b, n,
                                                                                                       op);
  } else {
    binary_map_kernel<1><<<grid_for(n, kThreads, s), kThreads, 0, raw(s)>>>(y, a, b, n, op);
  }
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda::ew
