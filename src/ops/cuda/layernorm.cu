// CUDA LayerNorm (ops/layernorm.h): a warp per row for the forward. Backward: rows that fit in
// registers (h <= 8192 bf16/fp16, 4096 fp32 with 16-byte vectors) take the fused kernel shared
// with RMSNorm (ops/cuda/norm_backward_cached.cuh: dx and the dweight / dbias partial rows in one
// pass over x and dy); longer rows a column-parallel dweight / dbias kernel, then a warp per row
// for dx. Either way the partial rows are added in a fixed order (ops/cuda/column_partials.cuh).
#include <cstdlib>

#include "ops/cuda/elementwise_common.cuh"
#include "ops/layernorm.h"
#include "ops/cuda/column_partials.cuh"
#include "ops/cuda/norm_backward_cached.cuh"

namespace mt::cuda {
namespace {

using ew::from_f32;
using ew::raw;
using ew::to_f32;
using ew::Vec;
using ew::warp_sum;

constexpr int kWarpsPerBlock = 8;
constexpr int kRowThreads = 32 * kWarpsPerBlock;

template <int V, typename T>
__device__ __forceinline__ Vec<T, V> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, V>*>(p);
}
template <int V, typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, V>& v) {
  *reinterpret_cast<Vec<T, V>*>(p) = v;
}

template <int V, typename T>
__global__ void __launch_bounds__(kRowThreads)
    layernorm_forward_kernel(T* y, float* mean, float* rstd, const T* x, const T* w, const T* b, int64_t n, int h,
                             float eps, bool zc) {
  const int lane = threadIdx.x & 31;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); r < n; r += warp_stride) {
    const T* xr = x + r * h;
    T* yr = y + r * h;
    float s = 0.f;
    for (int c = lane * V; c < h; c += 32 * V) {
      const Vec<T, V> v = load_vec<V>(xr + c);
#pragma unroll
      for (int k = 0; k < V; ++k) s += to_f32(v.v[k]);
    }
    const float m = warp_sum(s) / static_cast<float>(h);
    float q = 0.f;
    for (int c = lane * V; c < h; c += 32 * V) {
      const Vec<T, V> v = load_vec<V>(xr + c);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float d = to_f32(v.v[k]) - m;
        q += d * d;
      }
    }
    const float rs = 1.0f / sqrtf(warp_sum(q) / static_cast<float>(h) + eps);
    for (int c = lane * V; c < h; c += 32 * V) {
      const Vec<T, V> v = load_vec<V>(xr + c);
      const Vec<T, V> vw = load_vec<V>(w + c);
      const Vec<T, V> vb = load_vec<V>(b + c);
      Vec<T, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        out.v[k] = from_f32<T>((to_f32(v.v[k]) - m) * rs * norm_cached::gamma_f32(vw.v[k], zc) + to_f32(vb.v[k]));
      }
      store_vec<V>(yr + c, out);
    }
    if (lane == 0) {
      mean[r] = m;
      rstd[r] = rs;
    }
  }
}

/// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w; warp per row.
template <int V, typename T>
__global__ void __launch_bounds__(kRowThreads)
    layernorm_backward_dx_kernel(T* dx, const T* dy, const T* x, const T* w, const float* mean, const float* rstd,
                                 int64_t n, int h, bool accumulate, bool zc) {
  const int lane = threadIdx.x & 31;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); r < n; r += warp_stride) {
    const T* xr = x + r * h;
    const T* dyr = dy + r * h;
    T* dxr = dx + r * h;
    const float m = mean[r], rs = rstd[r];
    float sg = 0.f, sgx = 0.f;
    for (int c = lane * V; c < h; c += 32 * V) {
      const Vec<T, V> vx = load_vec<V>(xr + c);
      const Vec<T, V> vdy = load_vec<V>(dyr + c);
      const Vec<T, V> vw = load_vec<V>(w + c);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float g = to_f32(vdy.v[k]) * norm_cached::gamma_f32(vw.v[k], zc);
        sg += g;
        sgx += g * ((to_f32(vx.v[k]) - m) * rs);
      }
    }
    const float mg = warp_sum(sg) / static_cast<float>(h);
    const float mgx = warp_sum(sgx) / static_cast<float>(h);
    for (int c = lane * V; c < h; c += 32 * V) {
      const Vec<T, V> vx = load_vec<V>(xr + c);
      const Vec<T, V> vdy = load_vec<V>(dyr + c);
      const Vec<T, V> vw = load_vec<V>(w + c);
      Vec<T, V> old;
      if (accumulate) old = load_vec<V>(dxr + c);
      Vec<T, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float xhat = (to_f32(vx.v[k]) - m) * rs;
        float v = rs * (to_f32(vdy.v[k]) * norm_cached::gamma_f32(vw.v[k], zc) - mg - xhat * mgx);
        if (accumulate) v += to_f32(old.v[k]);
        out.v[k] = from_f32<T>(v);
      }
      store_vec<V>(dxr + c, out);
    }
  }
}

/// Partial column sums of row group blockIdx.y: part_w[blockIdx.y, c] = Σ_r dy[r, c] · xhat[r, c],
/// part_b[blockIdx.y, c] = Σ_r dy[r, c] over the rows r = blockIdx.y · 8 + threadIdx.y + k · 8 ·
/// gridDim.y (overwrite; add_column_partials adds them to dweight / dbias). Block (32, 8): the 8
/// row lanes of each column are added in shared memory in a fixed order.
template <typename T>
__global__ void layernorm_backward_dwdb_kernel(float* part_w, float* part_b, const T* dy, const T* x,
                                               const float* mean, const float* rstd, int64_t n, int h) {
  __shared__ float red_w[8][33];
  __shared__ float red_b[8][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float acc_w = 0.f, acc_b = 0.f;
  if (c < h) {
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * 8 + threadIdx.y; r < n; r += 8ll * gridDim.y) {
      const int64_t l = r * h + c;
      const float d = to_f32(dy[l]);
      acc_w += d * ((to_f32(x[l]) - mean[r]) * rstd[r]);
      acc_b += d;
    }
  }
  red_w[threadIdx.y][threadIdx.x] = acc_w;
  red_b[threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  if (threadIdx.y == 0 && c < h) {
    float sw = 0.f, sb = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      sw += red_w[i][threadIdx.x];
      sb += red_b[i][threadIdx.x];
    }
    part_w[static_cast<int64_t>(blockIdx.y) * h + c] = sw;
    part_b[static_cast<int64_t>(blockIdx.y) * h + c] = sb;
  }
}

unsigned row_grid(int64_t n, const Stream& s) {
  return ew::grid_for(n, kWarpsPerBlock, s, /*per_sm=*/8);
}

}  // namespace

void layernorm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& weight, const Tensor& bias, float eps, const Stream& stream,
                       bool zero_centered_gamma) {
  const int64_t h64 = x.size(-1);
  MT_CHECK(h64 <= (int64_t{1} << 30), "layernorm_forward: h={} too large for the CUDA kernel", h64);
  const int h = static_cast<int>(h64);
  const int64_t n = x.numel() / h;
  if (n == 0) return;
  ew::dispatch_float(x.dtype(), "layernorm_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = ew::kVec16<T>;
    T* py = static_cast<T*>(y.data());
    const T* px = static_cast<const T*>(x.data());
    const T* pw = static_cast<const T*>(weight.data());
    const T* pb = static_cast<const T*>(bias.data());
    const bool vec = h % V == 0 && ew::aligned16(py) && ew::aligned16(px) && ew::aligned16(pw) && ew::aligned16(pb);
    const unsigned grid = row_grid(n, stream);
    if (vec) {
      layernorm_forward_kernel<V><<<grid, kRowThreads, 0, raw(stream)>>>(py, mean.data_as<float>(),
                                                                         rstd.data_as<float>(), px, pw, pb, n, h, eps,
                                                                         zero_centered_gamma);
    } else {
      layernorm_forward_kernel<1><<<grid, kRowThreads, 0, raw(stream)>>>(py, mean.data_as<float>(),
                                                                         rstd.data_as<float>(), px, pw, pb, n, h, eps,
                                                                         zero_centered_gamma);
    }
    MT_CUDA_CHECK_LAUNCH();
  });
}

void layernorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                        const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                        bool accumulate_dx, const Stream& stream, bool zero_centered_gamma) {
  const int64_t h64 = x.size(-1);
  MT_CHECK(h64 <= (int64_t{1} << 30), "layernorm_backward: h={} too large for the CUDA kernel", h64);
  const int h = static_cast<int>(h64);
  const int64_t n = x.numel() / h;
  if (n == 0) return;
  ew::dispatch_float(x.dtype(), "layernorm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = ew::kVec16<T>;
    T* pdx = static_cast<T*>(dx.data());
    const T* pdy = static_cast<const T*>(dy.data());
    const T* px = static_cast<const T*>(x.data());
    const T* pw = static_cast<const T*>(weight.data());
    const float* pm = mean.data_as<float>();
    const float* pr = rstd.data_as<float>();
    const char* fn = "layernorm_backward";
    const bool vec = h % V == 0 && ew::aligned16(pdx) && ew::aligned16(pdy) && ew::aligned16(px) &&
                     ew::aligned16(pw);

    // Rows that fit in registers: one fused kernel (MT_LAYERNORM_BWD_VARIANT=1 keeps the two-kernel
    // path for comparison, bench/deterministic_ops_bench.cpp).
    static const bool two_kernels = [] {
      const char* v = std::getenv("MT_LAYERNORM_BWD_VARIANT");
      return v != nullptr && std::atoi(v) == 1;
    }();
    const RowMap rows{n, 1, h, h};
    auto cached = [&](auto vtag) {
      return norm_cached::launch<true, decltype(vtag)::value>(pdx, rows, dweight.data_as<float>(),
                                                              dbias.data_as<float>(), pdy, rows, px, rows, pw, pm, pr,
                                                              n, h, accumulate_dx, stream, fn, zero_centered_gamma);
    };
    if (!two_kernels &&
        (vec ? cached(std::integral_constant<int, V>{}) : cached(std::integral_constant<int, 1>{})))
      return;

    // Long rows. (1) dweight / dbias (reads dy before (2) may overwrite it through an alias):
    // partial sums per row group, then added in a fixed order (deterministic).
    const int64_t gx = (h64 + 31) / 32;
    const int64_t gy = column_partials_grid_rows(n, 8, gx, h64, 2, stream, fn);
    float* part_w = column_partials_scratch(stream, fn);
    float* part_b = part_w + gy * h64;
    layernorm_backward_dwdb_kernel<<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), dim3(32, 8), 0,
                                     raw(stream)>>>(part_w, part_b, pdy, px, pm, pr, n, h);
    MT_CUDA_CHECK_LAUNCH();
    add_column_partials(dweight.data_as<float>(), part_w, dbias.data_as<float>(), part_b, gy, h64, stream);

    // (2) dx.
    const unsigned grid = row_grid(n, stream);
    if (vec) {
      layernorm_backward_dx_kernel<V><<<grid, kRowThreads, 0, raw(stream)>>>(pdx, pdy, px, pw, pm, pr, n, h,
                                                                             accumulate_dx, zero_centered_gamma);
    } else {
      layernorm_backward_dx_kernel<1><<<grid, kRowThreads, 0, raw(stream)>>>(pdx, pdy, px, pw, pm, pr, n, h,
                                                                             accumulate_dx, zero_centered_gamma);
    }
    MT_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mt::cuda
