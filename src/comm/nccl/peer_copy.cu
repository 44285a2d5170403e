// The summation kernel of the copy-engine reduce-scatter (comm/nccl/peer_copy.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "comm/nccl/peer_copy.h"
#include "core/cuda_check.h"

namespace mt {

namespace {

template <typename T>
struct Sources {
  const T* p[PeerCopyGroup::kMaxRanks];
};

__device__ __forceinline__ float load_f(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float load_f(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ void store_f(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_f(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }

// out[k] = src[0][k] + src[1][k] + ... in rank order, accumulated in fp32. Vectorised by 16 bytes
// (4 fp32 or 8 bf16 / fp16) when every pointer is 16-byte aligned, else element by element.
template <typename T, bool kVec>
__global__ void sum_ranks_kernel(T* out, Sources<T> src, int n, int64_t count) {
  constexpr int kPer = 16 / sizeof(T);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t tail = 0;
  if constexpr (kVec) {
    const int64_t nv = count / kPer;
    tail = nv * kPer;
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < nv; v += stride) {
      float acc[kPer];
      uint4 raw = reinterpret_cast<const uint4*>(src.p[0])[v];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kPer; ++k) acc[k] = load_f(e, k);
      for (int r = 1; r < n; ++r) {
        raw = reinterpret_cast<const uint4*>(src.p[r])[v];
#pragma unroll
        for (int k = 0; k < kPer; ++k) acc[k] += load_f(e, k);
      }
      uint4 res;
      T* o = reinterpret_cast<T*>(&res);
#pragma unroll
      for (int k = 0; k < kPer; ++k) store_f(o, k, acc[k]);
      reinterpret_cast<uint4*>(out)[v] = res;
    }
  }
  for (int64_t i = tail + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    float acc = load_f(src.p[0], i);
    for (int r = 1; r < n; ++r) acc += load_f(src.p[r], i);
    store_f(out, i, acc);
  }
}

template <typename T>
void launch(void* out, const std::array<const void*, PeerCopyGroup::kMaxRanks>& src, int n, size_t count,
            cudaStream_t stream) {
  Sources<T> s{};
  bool aligned = reinterpret_cast<uintptr_t>(out) % 16 == 0;
  for (int r = 0; r < n; ++r) {
    s.p[r] = static_cast<const T*>(src[r]);
    aligned = aligned && reinterpret_cast<uintptr_t>(src[r]) % 16 == 0;
  }
  // A memory-bound pass: a few waves of 256-thread blocks reach HBM bandwidth, and a small grid
  // leaves SMs to the compute it overlaps with.
  constexpr int kThreads = 256;
  const int64_t work = aligned ? static_cast<int64_t>(count / (16 / sizeof(T)) + 1) : static_cast<int64_t>(count);
  const int blocks = static_cast<int>(std::min<int64_t>((work + kThreads - 1) / kThreads, 264));
  if (aligned) sum_ranks_kernel<T, true><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(out), s, n, count);
  else sum_ranks_kernel<T, false><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(out), s, n, count);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_sum_ranks(void* out, const std::array<const void*, PeerCopyGroup::kMaxRanks>& src, int n, size_t count,
                      DType dtype, cudaStream_t stream) {
  MT_REQUIRE(n >= 1 && n <= PeerCopyGroup::kMaxRanks, "launch_sum_ranks: {} sources", n);
  if (count == 0) return;
  switch (dtype) {
    case DType::kF32: launch<float>(out, src, n, count, stream); break;
    case DType::kBF16: launch<__nv_bfloat16>(out, src, n, count, stream); break;
    case DType::kF16: launch<__half>(out, src, n, count, stream); break;
    default: MT_FAIL("launch_sum_ranks: fp32, bf16 or fp16 only, got {}", dtype_name(dtype));
  }
}

}  // namespace mt
