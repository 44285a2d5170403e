// The fused backward of the row norms (RMSNorm, ops/rmsnorm.h; LayerNorm, ops/layernorm.h) for
// rows that fit in registers: one kernel computes dx and the weight (and LayerNorm bias) gradient
// partials. A group of TPR threads per row (TPR a power of two in [4, 512]; 256- or 512-thread
// blocks, grid-stride over rows) keeps x and dy of its row in registers (kIters vectors per
// thread), so each is read once; each thread owns fixed columns, so it also keeps its weight in
// registers and accumulates its dweight (dbias) partial sums over all the rows it visits; the
// block adds its groups' partials in shared memory (fixed order) and writes one partial row per
// block, which add_column_partials (ops/cuda/column_partials.cuh) adds in a fixed order: no float
// atomics, deterministic. On an H100 30-35% faster than a separate dx kernel and column-parallel
// dweight kernel for RMSNorm (h = 64..8192).
// Only included by .cu files (after ops/cuda/elementwise_common.cuh's prerequisites).
#pragma once
#include <algorithm>
#include <type_traits>

#include "ops/cuda/column_partials.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/elementwise_common.cuh"
#include "ops/row_map.h"

namespace mt::cuda::norm_cached {

/// The norm's scale from a weight element: the weight, or 1 + weight in fp32 with
/// zero_centered_gamma (--apply-layernorm-1p; ops/layernorm.h, ops/rmsnorm.h).
template <typename T>
__device__ __forceinline__ float gamma_f32(T w, bool zero_centered_gamma) {
  return zero_centered_gamma ? ew::to_f32(w) + 1.f : ew::to_f32(w);
}

constexpr int kIters = 2;  // vectors of a row held in registers per thread
constexpr int kMaxTpr = 512;

/// Threads per block for a row group of TPR threads: 256 (several rows per block) or TPR.
template <int TPR>
constexpr int block_threads() {
  return TPR > 256 ? TPR : 256;
}

/// Sum over the TPR threads of a row group (consecutive threads; TPR a power of two). Groups
/// wider than a warp add their warps' sums through `smem` (BLOCK / 32 floats) in a fixed order.
/// Every thread of the block must call it.
template <int TPR>
__device__ __forceinline__ float group_reduce(float v, float* smem) {
  constexpr int kW = TPR < 32 ? TPR : 32;
#pragma unroll
  for (int o = kW / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if constexpr (TPR > 32) {
    constexpr int kWarps = TPR / 32;
    if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = v;
    __syncthreads();
    const int first = static_cast<int>(threadIdx.x / TPR) * kWarps;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) s += smem[first + i];
    __syncthreads();  // smem is reused by the next call
    v = s;
  }
  return v;
}

/// group_reduce of two values at once (one pass through shared memory instead of two); `smem`
/// holds 2 · BLOCK / 32 floats.
template <int TPR>
__device__ __forceinline__ float2 group_reduce2(float a, float b, float* smem) {
  constexpr int kW = TPR < 32 ? TPR : 32;
#pragma unroll
  for (int o = kW / 2; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  if constexpr (TPR > 32) {
    constexpr int kWarps = TPR / 32;
    if ((threadIdx.x & 31) == 0) {
      smem[2 * (threadIdx.x >> 5)] = a;
      smem[2 * (threadIdx.x >> 5) + 1] = b;
    }
    __syncthreads();
    const int first = static_cast<int>(threadIdx.x / TPR) * kWarps;
    float sa = 0.f, sb = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) {
      sa += smem[2 * (first + i)];
      sb += smem[2 * (first + i) + 1];
    }
    __syncthreads();  // smem is reused by the next call
    a = sa;
    b = sb;
  }
  return make_float2(a, b);
}

/// Writes the block's partial row prow[c] = Σ over the block's row groups of acc (fixed order).
template <int V, int TPR>
__device__ __forceinline__ void write_partial_row(float* prow, const float (&acc)[kIters][V], float* red, int h) {
  constexpr int kBlock = block_threads<TPR>();
  constexpr int kRows = kBlock / TPR;
  const int lane = threadIdx.x % TPR;
  if constexpr (kRows == 1) {
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int c = (it * TPR + lane) * V;
      if (c < h) {
#pragma unroll
        for (int k = 0; k < V; ++k) prow[c + k] = acc[it][k];
      }
    }
  } else {
    const int grp = threadIdx.x / TPR;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
#pragma unroll
      for (int k = 0; k < V; ++k) red[grp * TPR * V + lane * V + k] = acc[it][k];
      __syncthreads();
      for (int j = threadIdx.x; j < TPR * V; j += kBlock) {
        const int col = it * TPR * V + j;
        if (col < h) {
          float s = 0.f;
#pragma unroll
          for (int g = 0; g < kRows; ++g) s += red[g * TPR * V + j];
          prow[col] = s;
        }
      }
      __syncthreads();
    }
  }
}

/// g = dy * w, xhat = (x - mean) * rstd (kLayerNorm) or x * rstd (RMSNorm);
/// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) (LayerNorm) or rstd * (g - xhat * mean(g *
/// xhat)) (RMSNorm), overwritten or (accumulate) added; dx may alias dy (the row is in registers).
/// part_w[blockIdx.x, c] = the block's Σ dy · xhat, part_b[blockIdx.x, c] = its Σ dy (LayerNorm
/// only), overwritten. mean: LayerNorm only.
template <bool kLayerNorm, int V, int TPR, typename T>
__global__ void __launch_bounds__(block_threads<TPR>())
    backward_kernel(T* dx, RowMap mdx, float* part_w, float* part_b, const T* dy, RowMap mdy, const T* x, RowMap mx,
                    const T* w, const float* mean, const float* rstd, int64_t n, int h, bool accumulate,
                    bool zero_centered_gamma) {
  using ew::from_f32;
  using ew::to_f32;
  using ew::Vec;
  constexpr int kBlock = block_threads<TPR>();
  constexpr int kRows = kBlock / TPR;
  __shared__ float red[2 * (kBlock / 32)];
  __shared__ float red_w[kRows > 1 ? kBlock * V : 1];
  const int lane = threadIdx.x % TPR;
  const float inv_h = 1.0f / static_cast<float>(h);
  Vec<T, V> wv[kIters];
  float acc_w[kIters][V], acc_b[kIters][V];
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int c = (it * TPR + lane) * V;
    if (c < h) wv[it] = *reinterpret_cast<const Vec<T, V>*>(w + c);
#pragma unroll
    for (int k = 0; k < V; ++k) acc_w[it][k] = acc_b[it][k] = 0.f;
  }
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRows; r0 < n; r0 += static_cast<int64_t>(gridDim.x) * kRows) {
    const int64_t r = r0 + threadIdx.x / TPR;
    const bool active = r < n;
    const T* xr = x + (active ? mx.offset(r) : 0);
    const T* dyr = dy + (active ? mdy.offset(r) : 0);
    const float rs = active ? rstd[r] : 0.f;
    const float m = kLayerNorm && active ? mean[r] : 0.f;
    T* dxr = dx + (active ? mdx.offset(r) : 0);
    Vec<T, V> xv[kIters], dyv[kIters], old[kIters];
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int c = (it * TPR + lane) * V;
      if (active && c < h) {
        xv[it] = *reinterpret_cast<const Vec<T, V>*>(xr + c);
        dyv[it] = *reinterpret_cast<const Vec<T, V>*>(dyr + c);
        // The accumulated gradient is loaded with the row (not after the reductions): its latency
        // hides behind them. dx may alias dy: its row is this group's alone.
        if (accumulate) old[it] = *reinterpret_cast<const Vec<T, V>*>(dxr + c);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float d = to_f32(dyv[it].v[k]), xs = (to_f32(xv[it].v[k]) - m) * rs;
          const float g = d * gamma_f32(wv[it].v[k], zero_centered_gamma);
          sgx += g * xs;
          acc_w[it][k] += d * xs;
          if constexpr (kLayerNorm) {
            sg += g;
            acc_b[it][k] += d;
          }
        }
      }
    }
    if constexpr (kLayerNorm) {
      const float2 sums = group_reduce2<TPR>(sgx, sg, red);
      sgx = sums.x;
      sg = sums.y;
    } else {
      sgx = group_reduce<TPR>(sgx, red);
    }
    if (active) {
      const float mgx = sgx * inv_h, mg = sg * inv_h;  // mg = 0 for RMSNorm
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int c = (it * TPR + lane) * V;
        if (c < h) {
          Vec<T, V> out;
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const float xs = (to_f32(xv[it].v[k]) - m) * rs;
            float v = rs * (to_f32(dyv[it].v[k]) * gamma_f32(wv[it].v[k], zero_centered_gamma) - mg - xs * mgx);
            if (accumulate) v += to_f32(old[it].v[k]);
            out.v[k] = from_f32<T>(v);
          }
          *reinterpret_cast<Vec<T, V>*>(dxr + c) = out;
        }
      }
    }
  }
  write_partial_row<V, TPR>(part_w + static_cast<int64_t>(blockIdx.x) * h, acc_w, red_w, h);
  if constexpr (kLayerNorm) write_partial_row<V, TPR>(part_b + static_cast<int64_t>(blockIdx.x) * h, acc_b, red_w, h);
}

/// The smallest power of two TPR in [4, kMaxTpr] with kIters * TPR * V >= h, or 0 when the row
/// is too long to be held in registers.
inline int threads_per_row(int h, int v) {
  const int vecs = (h + v - 1) / v;
  int t = 4;
  while (t < kMaxTpr && t * kIters < vecs) t *= 2;
  return t * kIters >= vecs ? t : 0;
}

/// Calls f(std::integral_constant<int, T>) for the smallest power of two T in [4, kMax] with
/// T >= tpr (kMax for larger tpr). Also the RMSNorm loop kernels' dispatch (kMax 32).
template <int kMax, int T = 4, typename F>
void dispatch_tpr(int tpr, F&& f) {
  if constexpr (T >= kMax) {
    f(std::integral_constant<int, T>{});
  } else if (tpr <= T) {
    f(std::integral_constant<int, T>{});
  } else {
    dispatch_tpr<kMax, 2 * T>(tpr, f);
  }
}

/// Runs the fused backward with vectors of VV elements when the row fits (returns false, doing
/// nothing, otherwise): backward_kernel on few blocks (about 1024 threads per SM), then
/// add_column_partials into dweight (and dbias for LayerNorm). Weight and bias gradients
/// accumulate (+=).
template <bool kLayerNorm, int VV, typename T>
bool launch(T* dx, RowMap mdx, float* dweight, float* dbias, const T* dy, RowMap mdy, const T* x, RowMap mx,
            const T* w, const float* mean, const float* rstd, int64_t n, int h, bool accumulate, const Stream& stream,
            const char* fn, bool zero_centered_gamma) {
  const int tpr = threads_per_row(h, VV);
  if (tpr == 0) return false;
  float* part = column_partials_scratch(stream, fn);
  dispatch_tpr<kMaxTpr>(tpr, [&](auto ttag) {
    constexpr int TPR = decltype(ttag)::value;
    constexpr int kBlock = block_threads<TPR>();
    // One wave of the blocks that fit on the SMs (registers bound it: ~124 per thread for
    // LayerNorm at h = 768), each striding over rows; at most ~1024 threads per SM.
    const int resident = cached_per_device(stream.device().index, [] {
      int blocks = 0;
      MT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, backward_kernel<kLayerNorm, VV, TPR, T>,
                                                                  kBlock, 0));
      return blocks;
    });
    const int per_sm = std::clamp(resident, 1, std::max(1, 1024 / kBlock));
    const int64_t grid = column_partials_rows(ew::grid_for(n, kBlock / TPR, stream, per_sm), h, kLayerNorm ? 2 : 1, fn);
    float* part_b = kLayerNorm ? part + grid * h : nullptr;
    backward_kernel<kLayerNorm, VV, TPR><<<static_cast<unsigned>(grid), kBlock, 0, ew::raw(stream)>>>(
        dx, mdx, part, part_b, dy, mdy, x, mx, w, mean, rstd, n, h, accumulate, zero_centered_gamma);
    MT_CUDA_CHECK_LAUNCH();
    add_column_partials(dweight, part, dbias, part_b, grid, h, stream);
  });
  return true;
}

}  // namespace mt::cuda::norm_cached
