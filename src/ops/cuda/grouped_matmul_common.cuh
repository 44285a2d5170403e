// Shared by the CUDA grouped GEMMs (ops/cuda/grouped_matmul.cu: mma.sync and SIMT kernels;
// ops/cuda/grouped_matmul_sm90.cu: the Hopper wgmma kernel): the per-block group tables built on
// the device from the counts, and the once-per-kernel shared-memory opt-in.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <set>
#include <utility>

#include "core/check.h"
#include "core/cuda_check.h"

namespace mt::cuda::grouped {

constexpr int kMaxGroups = 1024;  // the shared-memory group tables

__device__ __forceinline__ long long warp_inclusive_scan(long long v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const long long u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

/// Work tiles of a group of `rows` rows: ceil(rows / bm) row tiles times `n_tiles` column tiles
/// (bm = 0: none).
struct RowTiles {
  int bm, n_tiles;
  __device__ int operator()(int rows) const { return bm > 0 ? (rows + bm - 1) / bm * n_tiles : 0; }
};

/// Work tiles of a group: `tiles` when it has rows, none when it is empty (the weight gradient's
/// tiles cover the fixed [n, k] output of every non-empty group).
struct FixedTiles {
  int tiles;
  __device__ int operator()(int rows) const { return rows > 0 ? tiles : 0; }
};

/// off[g] = first row of group g clipped at R (g <= G; off[G] = min(Σc, R)) and tile[g] = work
/// tiles before group g (tiles_of(rows of each group); tile[G] = all). Warp 0 computes, then the
/// block synchronises (every thread of the block must call it). Negative counts count as 0.
template <typename TilesOf>
__device__ void group_tables(const int32_t* __restrict__ counts, int G, int R, TilesOf tiles_of, int* off,
                             int* tile) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int per = (G + 31) / 32, g0 = min(lane * per, G), g1 = min(g0 + per, G);
    long long sum = 0;
    for (int g = g0; g < g1; ++g) sum += max(counts[g], 0);
    long long run = warp_inclusive_scan(sum) - sum;
    for (int g = g0; g < g1; ++g) {
      off[g] = static_cast<int>(min(run, static_cast<long long>(R)));
      run += max(counts[g], 0);
    }
    if (lane == 31) off[G] = static_cast<int>(min(run, static_cast<long long>(R)));
    __syncwarp();
    long long t = 0;
    for (int g = g0; g < g1; ++g) t += tiles_of(off[g + 1] - off[g]);
    long long trun = warp_inclusive_scan(t) - t;
    for (int g = g0; g < g1; ++g) {
      tile[g] = static_cast<int>(trun);
      trun += tiles_of(off[g + 1] - off[g]);
    }
    if (lane == 31) tile[G] = static_cast<int>(trun);
  }
  __syncthreads();
}

/// The group whose tiles include tile b (tile[g] <= b < tile[g + 1]; never an empty group), or -1
/// when b >= tile[G].
__device__ __forceinline__ int find_group(const int* tile, int G, int b) {
  if (b >= tile[G]) return -1;
  int lo = 0, hi = G - 1;  // the last g with tile[g] <= b
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

/// Opts `kernel` in to `smem` bytes of dynamic shared memory (once per device and kernel; it also
/// has `static_smem` bytes of static shared memory). Errors: mt::Error when the device has less.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t smem, size_t static_smem, const char* fn) {
  // Every instantiation has the same function-pointer type, so the key is the kernel's address.
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  int dev = 0;
  MT_CUDA_CHECK(cudaGetDevice(&dev));
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), dev};
  std::lock_guard<std::mutex> lock(mu);
  if (done.count(key)) return;
  int max_optin = 0;
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  MT_CHECK(smem + static_smem <= static_cast<size_t>(max_optin),
           "{}: the kernel needs {} bytes of shared memory, more than the device's {}", fn, smem + static_smem,
           max_optin);
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  done.insert(key);
}

}  // namespace mt::cuda::grouped
