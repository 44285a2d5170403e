// The summation kernel of the copy-engine reduce-scatter (comm/nccl/peer_copy.h).
#include <cstdint>

#include "comm/nccl/peer_copy.h"
#include "core/cuda_check.h"

namespace mt {

namespace {

struct Sources {
  const float* p[PeerCopyGroup::kMaxRanks];
};

// out[k] = src[0][k] + src[1][k] + ... in rank order. Vectorised by 4 when every pointer is
// 16-byte aligned (the caller's offsets are multiples of ParamStore::kAlign elements), else scalar.
template <int kVec>
__global__ void sum_ranks_kernel(float* out, Sources src, int n, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if constexpr (kVec == 4) {
    const int64_t nv = count / 4;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nv; i += stride) {
      float4 acc = reinterpret_cast<const float4*>(src.p[0])[i];
      for (int r = 1; r < n; ++r) {
        const float4 v = reinterpret_cast<const float4*>(src.p[r])[i];
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
      }
      reinterpret_cast<float4*>(out)[i] = acc;
    }
    for (int64_t i = nv * 4 + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
      float acc = src.p[0][i];
      for (int r = 1; r < n; ++r) acc += src.p[r][i];
      out[i] = acc;
    }
  } else {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
      float acc = src.p[0][i];
      for (int r = 1; r < n; ++r) acc += src.p[r][i];
      out[i] = acc;
    }
  }
}

}  // namespace

void launch_sum_ranks_f32(float* out, const std::array<const float*, PeerCopyGroup::kMaxRanks>& src, int n,
                          size_t count, cudaStream_t stream) {
  MT_REQUIRE(n >= 1 && n <= PeerCopyGroup::kMaxRanks, "launch_sum_ranks_f32: {} sources", n);
  if (count == 0) return;
  Sources s{};
  bool aligned = reinterpret_cast<uintptr_t>(out) % 16 == 0;
  for (int r = 0; r < n; ++r) {
    s.p[r] = src[r];
    aligned = aligned && reinterpret_cast<uintptr_t>(src[r]) % 16 == 0;
  }
  // A memory-bound pass: a few waves of 256-thread blocks are enough to reach HBM bandwidth, and
  // a small grid leaves SMs to the compute it overlaps with.
  constexpr int kThreads = 256;
  const int64_t work = aligned ? static_cast<int64_t>(count / 4 + 1) : static_cast<int64_t>(count);
  const int blocks = static_cast<int>(std::min<int64_t>((work + kThreads - 1) / kThreads, 264));
  if (aligned) sum_ranks_kernel<4><<<blocks, kThreads, 0, stream>>>(out, s, n, static_cast<int64_t>(count));
  else sum_ranks_kernel<1><<<blocks, kThreads, 0, stream>>>(out, s, n, static_cast<int64_t>(count));
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt
