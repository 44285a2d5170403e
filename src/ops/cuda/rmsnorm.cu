// CUDA RMSNorm (ops/rmsnorm.h).
// Forward: a group of TPR threads per row (TPR the smallest power of two in [4, 32] covering the
// row's vectors; 256-thread blocks, grid-stride over rows), two passes over the row (sum of
// squares, then the scaled store; the second pass mostly from L1/L2). Measured on one H100 (bf16,
// 64 M elements): 2.5 TB/s for h = 64..128, 1.8 TB/s for h = 4096..8192; a variant that held the
// row in registers (one DRAM pass, up to 512 threads per row) was slower in every case.
// Backward, rows of up to 2 · 512 vectors (h <= 8192 bf16/fp16 and 4096 fp32 with 16-byte
// vectors, 1024 on the scalar path): one fused kernel shared with LayerNorm
// (ops/cuda/norm_backward_cached.cuh; 30-35% faster than the two-kernel path below on an H100 for
// h = 64..8192, measured with per-block atomics). Longer rows: the dx kernel mirrors the forward, after a separate
// column-parallel dweight kernel (run first so that dx may alias dy) that writes one partial row
// per row group. Either way the partial rows are added to dweight in a fixed order by
// add_column_partials (ops/cuda/column_partials.cuh): no float atomics, deterministic.
// Vector (16-byte) loads when h is a multiple of the vector width and every row start (base
// pointers and RowMap strides) is 16-byte aligned, else scalar.
#include <type_traits>

#include "ops/rmsnorm.h"  // first: ops/cuda/elementwise_common.cuh needs Tensor, Stream, DType

#include "ops/fp8_fused.h"

#include "ops/cuda/column_partials.cuh"
#include "ops/cuda/elementwise_common.cuh"
#include "ops/cuda/fp8_out.cuh"
#include "ops/cuda/norm_backward_cached.cuh"
#include "ops/row_map.h"

namespace mt::cuda {
namespace {

using ew::from_f32;
using ew::raw;
using ew::to_f32;
using ew::Vec;

constexpr int kThreads = 256;

template <int V, typename T>
__device__ __forceinline__ Vec<T, V> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, V>*>(p);
}
template <int V, typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, V>& v) {
  *reinterpret_cast<Vec<T, V>*>(p) = v;
}

/// Sum over the TPR consecutive lanes of a row group (TPR a power of two <= 32); every lane of
/// the warp must call it.
template <int TPR>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = TPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/// kQ != 0 (fp8_rmsnorm_forward; contiguous rows): also q[r, c] = fp8(y[r, c] · scale) of the stored
/// y and the amax record (ops/cuda/fp8_out.cuh); y and rstd are the same either way.
template <int V, int TPR, int kQ, typename T>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_forward_loop_kernel(T* y, RowMap my, float* rstd, const T* x, RowMap mx, const T* w, int64_t n, int h,
                           float eps, bool zc, Fp8Out fo) {
  constexpr int kRowsPerBlock = kThreads / TPR;
  Fp8Epilogue<kQ> ep(fo);
  const int lane = threadIdx.x % TPR;
  const float inv_h = 1.0f / static_cast<float>(h);
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; r0 < n;
       r0 += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t r = r0 + threadIdx.x / TPR;
    const bool active = r < n;  // the loop bound is block-uniform: every lane reaches the shuffles
    const T* xr = x + (active ? mx.offset(r) : 0);
    float ss = 0.f;
    if (active) {
      for (int c = lane * V; c < h; c += TPR * V) {
        const Vec<T, V> v = load_vec<V>(xr + c);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float f = to_f32(v.v[k]);
          ss += f * f;
        }
      }
    }
    ss = group_sum<TPR>(ss);
    if (!active) continue;
    const float rs = 1.0f / sqrtf(ss * inv_h + eps);
    T* yr = y + my.offset(r);  // may alias xr: each lane rewrites exactly the elements it reads
    for (int c = lane * V; c < h; c += TPR * V) {
      const Vec<T, V> v = load_vec<V>(xr + c);
      const Vec<T, V> vw = load_vec<V>(w + c);
      Vec<T, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = from_f32<T>(to_f32(v.v[k]) * rs * norm_cached::gamma_f32(vw.v[k], zc));
      store_vec<V>(yr + c, out);
      if constexpr (kQ != 0) {
#pragma unroll
        for (int k = 0; k < V; ++k) fo.q[r * h + c + k] = ep.put(to_f32(out.v[k]));
      }
    }
    if (lane == 0) rstd[r] = rs;
  }
  ep.finish(fo.amax);
}

/// dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x * rstd.
template <int V, int TPR, typename T>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_backward_dx_loop_kernel(T* dx, RowMap mdx, const T* dy, RowMap mdy, const T* x, RowMap mx, const T* w,
                               const float* rstd, int64_t n, int h, bool accumulate, bool zc) {
  constexpr int kRowsPerBlock = kThreads / TPR;
  const int lane = threadIdx.x % TPR;
  const float inv_h = 1.0f / static_cast<float>(h);
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; r0 < n;
       r0 += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t r = r0 + threadIdx.x / TPR;
    const bool active = r < n;
    const T* xr = x + (active ? mx.offset(r) : 0);
    const T* dyr = dy + (active ? mdy.offset(r) : 0);
    const float rs = active ? rstd[r] : 0.f;
    float sgx = 0.f;
    if (active) {
      for (int c = lane * V; c < h; c += TPR * V) {
        const Vec<T, V> vx = load_vec<V>(xr + c);
        const Vec<T, V> vdy = load_vec<V>(dyr + c);
        const Vec<T, V> vw = load_vec<V>(w + c);
#pragma unroll
        for (int k = 0; k < V; ++k) sgx += (to_f32(vdy.v[k]) * norm_cached::gamma_f32(vw.v[k], zc)) * (to_f32(vx.v[k]) * rs);
      }
    }
    sgx = group_sum<TPR>(sgx);
    if (!active) continue;
    const float mgx = sgx * inv_h;
    T* dxr = dx + mdx.offset(r);  // may alias dyr: each lane rewrites exactly the elements it reads
    for (int c = lane * V; c < h; c += TPR * V) {
      const Vec<T, V> vx = load_vec<V>(xr + c);
      const Vec<T, V> vdy = load_vec<V>(dyr + c);
      const Vec<T, V> vw = load_vec<V>(w + c);
      Vec<T, V> old;
      if (accumulate) old = load_vec<V>(dxr + c);
      Vec<T, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float v = rs * (to_f32(vdy.v[k]) * norm_cached::gamma_f32(vw.v[k], zc) - (to_f32(vx.v[k]) * rs) * mgx);
        if (accumulate) v += to_f32(old.v[k]);
        out.v[k] = from_f32<T>(v);
      }
      store_vec<V>(dxr + c, out);
    }
  }
}

/// Partial dweight sums of row group blockIdx.y: part[blockIdx.y, c] = Σ_r dy[r, c] · x[r, c] ·
/// rstd[r] (overwrite). Block (tx, kThreads / tx): thread (i, j) owns the V columns
/// blockIdx.x * tx * V + i * V + [0, V) and the rows blockIdx.y * ty + j + k * ty * gridDim.y; the
/// ty partial sums of each column are added in shared memory (fixed order).
template <int V, typename T>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_backward_dw_kernel(float* part, const T* dy, RowMap mdy, const T* x, RowMap mx, const float* rstd,
                               int64_t n, int h) {
  __shared__ float red[kThreads * V];
  const int tx = blockDim.x, ty = blockDim.y;
  const int width = tx * V;
  const int c = blockIdx.x * width + threadIdx.x * V;
  float acc[V];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = 0.f;
  if (c < h) {
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * ty + threadIdx.y; r < n;
         r += static_cast<int64_t>(ty) * gridDim.y) {
      const Vec<T, V> vx = load_vec<V>(x + mx.offset(r) + c);
      const Vec<T, V> vdy = load_vec<V>(dy + mdy.offset(r) + c);
      const float rs = rstd[r];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += to_f32(vdy.v[k]) * (to_f32(vx.v[k]) * rs);
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) red[threadIdx.y * width + threadIdx.x * V + k] = acc[k];
  __syncthreads();
  const int tid = threadIdx.y * tx + threadIdx.x;
  for (int j = tid; j < width; j += tx * ty) {
    const int col = blockIdx.x * width + j;
    if (col >= h) continue;
    float s = 0.f;
    for (int i = 0; i < ty; ++i) s += red[i * width + j];
    part[static_cast<int64_t>(blockIdx.y) * h + col] = s;
  }
}

bool map_aligned(const RowMap& m, int v) { return m.inner_stride % v == 0 && m.outer_stride % v == 0; }

/// Loop path: threads per row, the smallest power of two in [4, 32] that covers h / V vectors.
int threads_per_row(int h, int v) {
  const int vecs = (h + v - 1) / v;
  int t = 4;
  while (t < 32 && t < vecs) t *= 2;
  return t;
}

int checked_h(const Tensor& x, const char* fn) {
  const int64_t h = x.size(-1);
  MT_CHECK(h <= (int64_t{1} << 30), "{}: h={} too large for the CUDA kernel", fn, h);
  return static_cast<int>(h);
}

}  // namespace

namespace {

/// rmsnorm_forward's launch; with kQ != 0 the FP8 epilogue of fp8_rmsnorm_forward.
template <int kQ>
void launch_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& weight, float eps,
                    const Stream& stream, bool zero_centered_gamma, const Fp8Out& fo, const char* fn) {
  const int h = checked_h(x, fn);
  const RowMap mx = row_map(x, fn), my = row_map(y, fn);
  const int64_t n = mx.rows;
  if (n == 0) return;
  ew::dispatch_float(x.dtype(), fn, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = ew::kVec16<T>;
    T* py = static_cast<T*>(y.data());
    const T* px = static_cast<const T*>(x.data());
    const T* pw = static_cast<const T*>(weight.data());
    float* pr = rstd.data_as<float>();
    const bool vec = h % V == 0 && ew::aligned16(py) && ew::aligned16(px) && ew::aligned16(pw) &&
                     map_aligned(mx, V) && map_aligned(my, V);
    auto launch = [&](auto vtag) {
      constexpr int VV = decltype(vtag)::value;
      norm_cached::dispatch_tpr<32>(threads_per_row(h, VV), [&](auto ttag) {
        constexpr int TPR = decltype(ttag)::value;
        const unsigned grid = ew::grid_for(n, kThreads / TPR, stream, /*per_sm=*/8);
        rmsnorm_forward_loop_kernel<VV, TPR, kQ><<<grid, kThreads, 0, raw(stream)>>>(py, my, pr, px, mx, pw, n, h, eps,
                                                                                      zero_centered_gamma, fo);
        MT_CUDA_CHECK_LAUNCH();
      });
    };
    if (vec) {
      launch(std::integral_constant<int, V>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace

void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& weight, float eps,
                     const Stream& stream, bool zero_centered_gamma) {
  launch_forward<0>(y, rstd, x, weight, eps, stream, zero_centered_gamma, Fp8Out{}, "rmsnorm_forward");
}

void fp8_rmsnorm_forward(const Tensor& y, const Tensor& q, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                         float eps, const Tensor& scale, const Tensor& amax, const Stream& stream,
                         bool zero_centered_gamma) {
  const Fp8Out fo{q.data_as<uint8_t>(), scale.data_as<float>(), amax.empty() ? nullptr : amax.data_as<uint32_t>()};
  dispatch_fp8_out(q.dtype(), [&](auto qtag) {
    launch_forward<decltype(qtag)::value>(y, rstd, x, weight, eps, stream, zero_centered_gamma, fo,
                                          "fp8_rmsnorm_forward");
  });
}

void rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dy, const Tensor& x,
                      const Tensor& weight, const Tensor& rstd, bool accumulate_dx, const Stream& stream,
                      bool zero_centered_gamma) {
  const char* fn = "rmsnorm_backward";
  const int h = checked_h(x, fn);
  const RowMap mx = row_map(x, fn), mdx = row_map(dx, fn), mdy = row_map(dy, fn);
  const int64_t n = mx.rows;
  if (n == 0) return;
  ew::dispatch_float(x.dtype(), fn, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = ew::kVec16<T>;
    T* pdx = static_cast<T*>(dx.data());
    const T* pdy = static_cast<const T*>(dy.data());
    const T* px = static_cast<const T*>(x.data());
    const T* pw = static_cast<const T*>(weight.data());
    const float* pr = rstd.data_as<float>();
    float* pdw = dweight.data_as<float>();
    const bool vec_in = h % V == 0 && ew::aligned16(pdy) && ew::aligned16(px) && map_aligned(mx, V) &&
                        map_aligned(mdy, V);
    const bool vec = vec_in && ew::aligned16(pdx) && ew::aligned16(pw) && map_aligned(mdx, V);

    // Rows that fit in registers: one fused kernel (dx and dweight; ops/cuda/norm_backward_cached.cuh).
    auto cached = [&](auto vtag) {
      return norm_cached::launch<false, decltype(vtag)::value>(pdx, mdx, pdw, nullptr, pdy, mdy, px, mx, pw, nullptr,
                                                               pr, n, h, accumulate_dx, stream, fn,
                                                               zero_centered_gamma);
    };
    if (vec ? cached(std::integral_constant<int, V>{}) : cached(std::integral_constant<int, 1>{})) return;
    float* part = column_partials_scratch(stream, fn);

    // Long rows. (1) dweight (reads dy before (2) may overwrite it through an alias).
    auto launch_dw = [&](auto vtag) {
      constexpr int VV = decltype(vtag)::value;
      const int tx = threads_per_row(h, VV);
      const int ty = kThreads / tx;
      const int64_t gx = (h + int64_t{tx} * VV - 1) / (int64_t{tx} * VV);
      const int64_t gy = column_partials_grid_rows(n, ty, gx, h, 1, stream, fn);
      rmsnorm_backward_dw_kernel<VV><<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), dim3(tx, ty), 0,
                                       raw(stream)>>>(part, pdy, mdy, px, mx, pr, n, h);
      MT_CUDA_CHECK_LAUNCH();
      add_column_partials(pdw, part, nullptr, nullptr, gy, h, stream);
    };
    if (vec_in) {
      launch_dw(std::integral_constant<int, V>{});
    } else {
      launch_dw(std::integral_constant<int, 1>{});
    }

    // (2) dx.
    auto launch_dx = [&](auto vtag) {
      constexpr int VV = decltype(vtag)::value;
      norm_cached::dispatch_tpr<32>(threads_per_row(h, VV), [&](auto ttag) {
        constexpr int TPR = decltype(ttag)::value;
        const unsigned grid = ew::grid_for(n, kThreads / TPR, stream, /*per_sm=*/8);
        rmsnorm_backward_dx_loop_kernel<VV, TPR><<<grid, kThreads, 0, raw(stream)>>>(pdx, mdx, pdy, mdy, px, mx, pw,
                                                                                     pr, n, h, accumulate_dx,
                                                                                     zero_centered_gamma);
        MT_CUDA_CHECK_LAUNCH();
      });
    };
    if (vec) {
      launch_dx(std::integral_constant<int, V>{});
    } else {
      launch_dx(std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace mt::cuda
