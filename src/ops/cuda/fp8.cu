// CUDA FP8 quantisation ops (ops/fp8.h). Every scale and amax is read from and written to device
// memory (no host synchronisation; capturable). Conversions fp32 -> FP8 use the hardware's
// cvt.rn.satfinite (round to nearest even, saturating to the largest finite value: the rule of
// core/dtype.h's host conversion, which the CPU reference runs), NaN inputs write
// fp8_math::kNaNCode, so that the two backends agree bit for bit.
//
// Cast + transpose: one kernel for every recipe. A CTA of 256 threads owns a 128 x 128 tile of x
// (thread (warp w, lane l) holds rows w + 8i, i < 16, and columns l + 32j, j < 4, in registers:
// every load instruction reads 32 consecutive elements), computes what its recipe needs — the
// 1x128 row amaxes by warp shuffles, the column amaxes (the transpose's 1x128 blocks) through
// shared memory, the 128x128 block amax — writes q straight from registers and stages the
// transposed bytes in shared memory (row pitch 132: conflict-free writes) for 128-byte row
// stores of q_t.
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "ops/cuda/column_partials.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/fp8_out.cuh"
#include "ops/fp8.h"
#include "ops/fp8_fused.h"
#include "ops/cuda/fp8_fused_chunks.h"
#include "ops/gelu_math.h"
#include "ops/swiglu_math.h"

namespace mt::cuda {
namespace {

using fp8_math::abs_bits_for_max;
using fp8_math::kBlock;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerThread = static_cast<int>(kBlock) / kWarps;  // 16
constexpr int kPitch = static_cast<int>(kBlock) + 4;               // staging row pitch (bytes)

/// Calls f(bool_constant<e4m3>) for an FP8 dtype.
template <typename F>
void dispatch_fp8(DType t, F&& f) {
  if (t == DType::kF8E4M3) {
    f(std::true_type{});
  } else {
    MT_CHECK(t == DType::kF8E5M2, "fp8: unsupported dtype {}", dtype_name(t));
    f(std::false_type{});
  }
}

int num_sms(const Stream& s) {
  const CudaStreamResources* r = s.cuda();
  return r && r->num_sms > 0 ? r->num_sms : 132;
}

// ---------------------------------------------------------------------------------------------
// amax: grid-stride max of |x| as ordered float bits, then an atomic max into the (zeroed) amax.

template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(uint32_t* amax, const T* x, int64_t n, bool vec) {
  constexpr int kV = 16 / sizeof(T);
  uint32_t m = 0;
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (vec) {
    const int64_t nv = n / kV;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    auto take = [&](const uint4& u) {
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int j = 0; j < kV; ++j) m = max(m, abs_bits_for_max(to_f(e[j])));
    };
    // four independent 16-byte loads in flight per thread (one at a time left the kernel at about
    // half the memory bandwidth: latency-bound at 4 CTAs per SM)
    constexpr int kU = 4;
    int64_t i = tid;
    for (; i + (kU - 1) * stride < nv; i += kU * stride) {
      uint4 u[kU];
#pragma unroll
      for (int k = 0; k < kU; ++k) u[k] = xv[i + k * stride];
#pragma unroll
      for (int k = 0; k < kU; ++k) take(u[k]);
    }
    for (; i < nv; i += stride) take(xv[i]);
    done = nv * kV;
  }
  for (int64_t i = done + tid; i < n; i += stride) m = max(m, abs_bits_for_max(to_f(x[i])));
  __shared__ uint32_t sh[kWarps];
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) m = max(m, sh[w]);
    atomicMax(amax, m);
  }
}

// ---------------------------------------------------------------------------------------------
// Scales.

__global__ void scale_from_amax_kernel(float* scale, float* scale_inv, const float* amax, int64_t n, float fmax,
                                       bool pow2, float epsilon) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float s = fp8_math::scale_from_amax(amax[i], fmax, pow2, epsilon);
  scale[i] = s;
  scale_inv[i] = 1.f / s;
}

// One CTA per history column: fp8_math::delayed_update with the len-long roll and max spread over
// the CTA's threads (a thread per column walked the 1024 rows of TE's history serially: 0.37 ms
// per layer block on an H200). The roll goes in chunks of blockDim rows, every read of a chunk
// before any of its writes (row j takes old row j + 1; later chunks read rows no chunk before them
// wrote). fmaxf passes NaN entries over, as the serial loop's `a > amax`; max is exact in any order.
__global__ void delayed_update_kernel(float* hist, int64_t len, int64_t n, float* scale, float* scale_inv,
                                      float scaled_max, fp8_math::AmaxAlgo algo) {
  __shared__ float warp_amax[32];
  const int64_t col = blockIdx.x;
  float* h = hist + col;
  const float last = h[0];
  float amax = 0.f;
  if (last != 0.f) {  // uniform over the CTA
    for (int64_t j0 = 0; j0 < len; j0 += blockDim.x) {
      const int64_t j = j0 + threadIdx.x;
      float a = 0.f;
      if (j < len) a = j < len - 1 ? h[(j + 1) * n] : last;
      amax = fmaxf(amax, a);
      __syncthreads();
      if (j > 0 && j < len) h[j * n] = a;
    }
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = amax;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (unsigned w = 1; w < (blockDim.x + 31) / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
      h[0] = 0.f;
      if (algo == fp8_math::AmaxAlgo::kMostRecent) amax = last;
    }
  }
  if (threadIdx.x != 0) return;
  float s = scale[col];
  if (amax > 0.f && amax <= FLT_MAX) s = scaled_max / amax;
  if (s > FLT_MAX) s = FLT_MAX;
  scale[col] = s;
  scale_inv[col] = 1.f / s;
}

// ---------------------------------------------------------------------------------------------
// Cast (+ transpose) of one 128 x 128 tile.

/// The block's staged transposed bytes tq (row tc: source column c0 + tc, byte r: source row
/// r0 + r) stored into q_t [cols, rows]: one warp per row of q_t, 4 bytes per lane (one 4-byte
/// store when `full`: the whole 128 rows exist and q_t rows are 4-byte aligned).
__device__ __forceinline__ void store_transposed_tile(const uint8_t (*tq)[kPitch], uint8_t* qt, int64_t rows,
                                                      int64_t cols, int64_t r0, int64_t c0, bool full) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int tc = warp; tc < kBlock; tc += kWarps) {
    const int64_t c = c0 + tc;
    if (c >= cols) break;
    uint8_t* dst = qt + c * rows + r0;
    const int rr = lane * 4;
    if (full) {
      *reinterpret_cast<uint32_t*>(dst + rr) = *reinterpret_cast<const uint32_t*>(&tq[tc][rr]);
    } else {
      for (int b = 0; b < 4; ++b) {
        if (r0 + rr + b < rows) dst[rr + b] = tq[tc][rr + b];
      }
    }
  }
}

/// The CTA's amax record of an activation tile kernel: each warp's max of m into warp_red, one
/// barrier (which also publishes the shared memory every thread wrote before the call), then thread
/// 0 max-accumulates the CTA's into *amax (null: no record; the barrier still runs).
__device__ __forceinline__ void cta_amax_record(uint32_t m, uint32_t* warp_red, uint32_t* amax) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (amax != nullptr) {
    m = warp_max(m);
    if (lane == 0) warp_red[warp] = m;
  }
  __syncthreads();
  if (amax != nullptr && threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) m = max(m, warp_red[w]);
    atomicMax(amax, m);
  }
}

/// The 128 x 128 tiles of a [rows, cols] activation (grid.x: column tiles, grid.y: row tiles).
/// Errors: mt::Error naming `fn` beyond 65535 row tiles (the grid's y limit).
struct TileGrid {
  int64_t row_tiles, col_tiles;
};
TileGrid tile_grid(int64_t rows, int64_t cols, const char* fn) {
  const TileGrid g{(rows + kBlock - 1) / kBlock, (cols + kBlock - 1) / kBlock};
  MT_CHECK(g.row_tiles <= 65535, "{}: {} rows exceed the CUDA kernel's 65535 x 128", fn, rows);
  return g;
}
/// Whether q_t [cols, rows] takes store_transposed_tile's 4-byte stores.
bool qt_vectorised(const uint8_t* qt, int64_t rows) {
  return qt != nullptr && rows % 4 == 0 && reinterpret_cast<uintptr_t>(qt) % 4 == 0;
}

struct TileArgs {
  const void* x;
  int64_t rows, cols;
  uint8_t* q;          // [rows, cols] or null
  uint8_t* qt;         // [cols, rows] or null
  const float* scale;  // Fp8Scaling::kTensor: the quantisation scale
  uint32_t* amax;      // Fp8Scaling::kTensor: max-accumulated amax bits, or null
  float* s_inv;        // block modes: q's scale layout
  float* st_inv;       // block modes: q_t's scale layout
  bool pow2;
  bool qt_vec;  // q_t rows may be stored 4 bytes at a time (rows % 4 == 0, aligned)
};

// T: x's element type; R: the type each element is rounded through when loaded (float: none;
// __nv_bfloat16: fp8_quantize_bf16_rounded), so that everything after the load — amaxes, scales,
// bytes — is what the kernel gives for x rounded to R.
template <typename T, typename R, bool kE4M3, Fp8Scaling kMode>
__global__ void __launch_bounds__(kThreads) quantize_tile_kernel(TileArgs p) {
  __shared__ __align__(16) uint8_t tq[kBlock][kPitch];  // transposed FP8 bytes
  __shared__ uint32_t red[kWarps][kBlock];              // per-warp column amaxes
  __shared__ float col_scale[kBlock];
  __shared__ uint32_t warp_red[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBlock, c0 = static_cast<int64_t>(blockIdx.x) * kBlock;
  const int64_t rows = p.rows, cols = p.cols;
  const float fmax = kE4M3 ? kFp8E4M3Max : kFp8E5M2Max;
  const T* x = static_cast<const T*>(p.x);

  // This thread's elements (r0 + warp + 8i, c0 + lane + 32j) sit at base + i * rstride + 32j.
  const int64_t base = (r0 + warp) * cols + c0 + lane, rstride = kWarps * cols;
  const int64_t rows_left = rows - (r0 + warp), cols_left = cols - (c0 + lane);
  const bool interior = r0 + kBlock <= rows && c0 + kBlock <= cols;
  auto in_range = [&](int i, int j) { return interior || (kWarps * i < rows_left && 32 * j < cols_left); };
  float v[kRowsPerThread][4];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[i][j] = in_range(i, j) ? to_f(from_f<R>(to_f(x[base + i * rstride + 32 * j]))) : 0.f;
    }
  }

  float srow[kRowsPerThread] = {};  // the quantisation scale of each held row (for q)
  float scol[4] = {};               // ... of each held column (for q_t)
  if constexpr (kMode == Fp8Scaling::kTensor || kMode == Fp8Scaling::kBlock128x128) {
    float s = 0.f;
    if constexpr (kMode == Fp8Scaling::kTensor) s = *p.scale;
    if (kMode == Fp8Scaling::kBlock128x128 || p.amax) {
      uint32_t m = 0;
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) m = max(m, abs_bits_for_max(v[i][j]));
      }
      m = warp_max(m);
      if (lane == 0) warp_red[warp] = m;
      __syncthreads();
#pragma unroll
      for (int w = 0; w < kWarps; ++w) m = max(m, warp_red[w]);
      if constexpr (kMode == Fp8Scaling::kTensor) {
        if (threadIdx.x == 0) atomicMax(p.amax, m);
      } else {
        s = fp8_math::scale_from_amax(bits_to_f32(m), fmax, p.pow2, 0.f);
        if (threadIdx.x == 0) {
          const int64_t nrb = (rows + kBlock - 1) / kBlock, ncb = (cols + kBlock - 1) / kBlock;
          const int64_t rb = blockIdx.y, cb = blockIdx.x;
          if (p.q) {
            p.s_inv[rb * fp8_math::pad4(ncb) + cb] = 1.f / s;
            if (cb == ncb - 1) {
              for (int64_t e = ncb; e < fp8_math::pad4(ncb); ++e) p.s_inv[rb * fp8_math::pad4(ncb) + e] = 0.f;
            }
          }
          if (p.qt) {
            p.st_inv[cb * fp8_math::pad4(nrb) + rb] = 1.f / s;
            if (rb == nrb - 1) {
              for (int64_t e = nrb; e < fp8_math::pad4(nrb); ++e) p.st_inv[cb * fp8_math::pad4(nrb) + e] = 0.f;
            }
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) srow[i] = s;
#pragma unroll
    for (int j = 0; j < 4; ++j) scol[j] = s;
  } else {  // 1x128
    if (p.q) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        uint32_t m = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) m = max(m, abs_bits_for_max(v[i][j]));
        m = warp_max(m);
        srow[i] = fp8_math::scale_from_amax(bits_to_f32(m), fmax, p.pow2, 0.f);
        const int64_t r = r0 + warp + kWarps * i;
        if (lane == 0 && r < fp8_math::pad4(rows)) {
          p.s_inv[fp8_math::scale_index(Fp8Scaling::kBlock1x128, r, c0, rows, cols)] = r < rows ? 1.f / srow[i] : 0.f;
        }
      }
    }
    if (p.qt) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t m = 0;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) m = max(m, abs_bits_for_max(v[i][j]));
        red[warp][lane + 32 * j] = m;
      }
      __syncthreads();
      if (threadIdx.x < kBlock) {
        uint32_t m = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) m = max(m, red[w][threadIdx.x]);
        const float s = fp8_math::scale_from_amax(bits_to_f32(m), fmax, p.pow2, 0.f);
        col_scale[threadIdx.x] = s;
        const int64_t c = c0 + threadIdx.x;  // a row of x^T [cols, rows]
        if (c < fp8_math::pad4(cols)) {
          p.st_inv[fp8_math::scale_index(Fp8Scaling::kBlock1x128, c, r0, cols, rows)] = c < cols ? 1.f / s : 0.f;
        }
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < 4; ++j) scol[j] = col_scale[lane + 32 * j];
    }
  }

  if (p.q) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (in_range(i, j)) p.q[base + i * rstride + 32 * j] = to_fp8<kE4M3>(v[i][j], srow[i]);
      }
    }
  }
  if (p.qt) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) tq[lane + 32 * j][warp + kWarps * i] = to_fp8<kE4M3>(v[i][j], scol[j]);
    }
    __syncthreads();
    store_transposed_tile(tq, p.qt, rows, cols, r0, c0, p.qt_vec && r0 + kBlock <= rows);
  }
}

/// The cast + transpose kernel for x's dtype and `fp8`; round_bf16: fp32 x rounded to bf16 on load.
template <Fp8Scaling kMode>
void launch_tile(const Tensor& x, TileArgs p, DType fp8, const Stream& stream, bool round_bf16 = false) {
  const TileGrid tg = tile_grid(p.rows, p.cols, "fp8 quantize");
  p.qt_vec = qt_vectorised(p.qt, p.rows);
  const dim3 grid(static_cast<unsigned>(tg.col_tiles), static_cast<unsigned>(tg.row_tiles));
  if (round_bf16) {
    MT_CHECK(x.dtype() == DType::kF32, "fp8 quantize: bf16 rounding of {} (fp32 only)", x.str());
    dispatch_fp8(fp8, [&](auto e4m3) {
      quantize_tile_kernel<float, __nv_bfloat16, decltype(e4m3)::value, kMode><<<grid, kThreads, 0, cu(stream)>>>(p);
      MT_CUDA_CHECK_LAUNCH();
    });
    return;
  }
  dispatch_float(x.dtype(), "fp8 quantize", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dispatch_fp8(fp8, [&](auto e4m3) {
      quantize_tile_kernel<T, float, decltype(e4m3)::value, kMode><<<grid, kThreads, 0, cu(stream)>>>(p);
      MT_CUDA_CHECK_LAUNCH();
    });
  });
}

TileArgs tile_args(const Tensor& q, const Tensor& q_t, const Tensor& x) {
  TileArgs p{};
  p.x = x.data();
  p.cols = x.size(-1);
  p.rows = x.numel() / p.cols;
  p.q = q.empty() ? nullptr : q.data_as<uint8_t>();
  p.qt = q_t.empty() ? nullptr : q_t.data_as<uint8_t>();
  return p;
}

/// fp8_quantize (round_bf16: fp8_quantize_bf16_rounded).
void quantize_tensorwise(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale, const Tensor& amax,
                         const Stream& stream, bool round_bf16) {
  TileArgs p = tile_args(q, q_t, x);
  if (p.rows == 0) return;
  p.scale = scale.data_as<float>();
  p.amax = amax.empty() ? nullptr : amax.data_as<uint32_t>();
  launch_tile<Fp8Scaling::kTensor>(x, p, q.empty() ? q_t.dtype() : q.dtype(), stream, round_bf16);
}

// ---------------------------------------------------------------------------------------------
// The fused SwiGLU quantisers (ops/fp8_fused.h): the tensorwise cast + transpose of the SwiGLU's
// output (forward, [rows, f]) or of its input gradient (backward, [rows, 2f]: the gate half and the
// linear half), each value computed where the kernel loads its inputs. A CTA owns 128 rows x 128
// of the f columns j (the backward: column j of both halves, from one load of x[r, j], x[r, f + j]
// and dy[r, j]). The thread layout is the cast kernel's (rows warp + 8i, columns lane + 32j), row
// by row: each row's inputs loaded, computed, quantised and staged for the transposed stores.
// Occupancy is what pays here (fp8_gemm_bench, H200, 8192 x 8192, 2026-11-29): rows loaded one at a
// time and 4 CTAs per SM (<= 64 registers) ran the forward in 0.158 ms and the backward in
// 0.247 ms; loading 4 rows ahead (more independent loads, 97-118 registers) 0.164-0.170 and
// 0.272-0.367 ms, 8 rows 0.203 and 0.422 ms; the unfused ops 0.206 and 0.364 ms.

template <typename T>
struct SwigluFp8Args {
  const T* x;    // [rows, 2f]: gate half, then linear half
  const T* dy;   // backward: [rows, f]
  T* y;          // forward: [rows, f] or null (not written)
  uint8_t* q;    // [rows, f] (forward) / [rows, 2f] (backward) or null
  uint8_t* qt;   // its transpose or null
  const float* scale;
  uint32_t* amax;  // or null
  int64_t rows, f;
  bool qt_vec;
};

// The pointers are also parameters of their own, __restrict__: no store aliases a load, so the next
// row's loads may be issued before this row's stores.
template <typename T, bool kE4M3, bool kGrad>
__global__ void __launch_bounds__(kThreads, 4)
    swiglu_fp8_tile_kernel(SwigluFp8Args<T> p, const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ y,
                           uint8_t* __restrict__ q) {
  constexpr int kOut = kGrad ? 2 : 1;  // outputs per input column: the backward's two halves
  __shared__ __align__(16) uint8_t tq[kOut][kBlock][kPitch];
  __shared__ uint32_t warp_red[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBlock, c0 = static_cast<int64_t>(blockIdx.x) * kBlock;
  const int64_t rows = p.rows, f = p.f, qcols = kOut * f;
  const float s = *p.scale;
  const bool interior = r0 + kBlock <= rows && c0 + kBlock <= f;
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t r = r0 + warp + kWarps * i;
    const T* xr = x + r * 2 * f;
    float va[4], vb[4], vg[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = c0 + lane + 32 * j;
      const bool ok = interior || (r < rows && c < f);
      va[j] = ok ? to_f(xr[c]) : 0.f;
      vb[j] = ok ? to_f(xr[f + c]) : 0.f;
      if constexpr (kGrad) vg[j] = ok ? to_f(dy[r * f + c]) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = c0 + lane + 32 * j;
      const bool ok = interior || (r < rows && c < f);
      float d[kOut];
      if constexpr (kGrad) {
        d[0] = swiglu_math::swiglu_grad_gate(vg[j], va[j], vb[j]);
        d[kOut - 1] = swiglu_math::swiglu_grad_linear(vg[j], va[j]);
      } else {
        d[0] = swiglu_math::swiglu(va[j], vb[j]);
      }
#pragma unroll
      for (int h = 0; h < kOut; ++h) {
        const T t = from_f<T>(d[h]);  // the stored value: what the unfused quantiser reads back
        const float v = ok ? to_f(t) : 0.f;
        if constexpr (!kGrad) {
          if (ok && y != nullptr) y[r * f + c] = t;
        }
        m = max(m, abs_bits_for_max(v));
        const uint8_t b = to_fp8<kE4M3>(v, s);
        if (ok && q != nullptr) q[r * qcols + h * f + c] = b;
        tq[h][lane + 32 * j][warp + kWarps * i] = b;
      }
    }
  }
  cta_amax_record(m, warp_red, p.amax);  // also the barrier before the staged bytes are read
  if (p.qt == nullptr) return;
  const bool full = p.qt_vec && r0 + kBlock <= rows;
#pragma unroll
  for (int h = 0; h < kOut; ++h) store_transposed_tile(tq[h], p.qt + h * f * rows, rows, f, r0, c0, full);
}

/// fp8_swiglu_forward (kGrad false: y may be empty) / fp8_swiglu_backward (dy).
template <bool kGrad>
void launch_swiglu_fp8(const Tensor& y, const Tensor& dy, const Tensor& q, const Tensor& q_t, const Tensor& x,
                       const Tensor& scale, const Tensor& amax, const Stream& stream, const char* fn) {
  const int64_t f = x.size(-1) / 2, rows = x.numel() / x.size(-1);
  if (rows == 0) return;
  const TileGrid tg = tile_grid(rows, f, fn);
  const dim3 grid(static_cast<unsigned>(tg.col_tiles), static_cast<unsigned>(tg.row_tiles));
  uint8_t* qt = q_t.empty() ? nullptr : q_t.data_as<uint8_t>();
  dispatch_float(x.dtype(), fn, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    SwigluFp8Args<T> a{x.data_as<T>(),
                       kGrad ? dy.data_as<T>() : nullptr,
                       y.empty() ? nullptr : y.data_as<T>(),
                       q.empty() ? nullptr : q.data_as<uint8_t>(),
                       qt,
                       scale.data_as<float>(),
                       amax.empty() ? nullptr : amax.data_as<uint32_t>(),
                       rows,
                       f,
                       qt_vectorised(qt, rows)};
    dispatch_fp8(q.empty() ? q_t.dtype() : q.dtype(), [&](auto e4m3) {
      swiglu_fp8_tile_kernel<T, decltype(e4m3)::value, kGrad>
          <<<grid, kThreads, 0, cu(stream)>>>(a, a.x, a.dy, a.y, a.q);
      MT_CUDA_CHECK_LAUNCH();
    });
  });
}

// ---------------------------------------------------------------------------------------------
// The fused GELU quantisers (ops/fp8_fused.h), in the SwiGLU kernel's layout (a CTA owns 128 rows x
// 128 columns, thread (warp w, lane l) rows w + 8i and columns l + 32j, row by row). Forward: y =
// gelu(pre), the FP8 copies of y. Backward: d = dy · gelu'(pre),
// dx = d (may alias dy: read and written by the same thread, dy not __restrict__), the FP8 copies
// of d, and the bias gradient's partial row of the tile: each thread sums its 16 rows in row order,
// the 8 row lanes are added in order through shared memory, one fp32 row per tile into `part`
// (add_column_partials adds the tiles after). kGeluRows = 2 rows are loaded before either is
// computed: fp8_gemm_bench at 8192 x 8192 (H200, 2026-11-29; the forward of an earlier version that
// also added fc1's bias in place, the backward with the bias gradient) ran kGeluRows = 1 / 2 / 4 /
// 8 / 16 in 0.198 / 0.188 / 0.195 / 0.228 / 0.229 ms (forward) and 0.210 / 0.201 / 0.200 / 0.228 /
// 0.270 ms (backward; 8 and 16 at 2 CTAs per SM).
constexpr int kGeluRows = 2;

template <typename T>
struct GeluFp8Args {
  const T* dy;     // backward: [rows, f]
  T* out;          // forward: y; backward: dx; or null (not written)
  uint8_t* qt;     // the transpose of q, or null
  const float* scale;
  uint32_t* amax;  // or null
  float* part;     // backward: [tiles, f] partial column sums (tile t at row t), or null
  int64_t rows, f;
  int64_t tile0;   // the first row tile of this launch (the bias gradient's chunks)
  bool qt_vec;
};

template <typename T, bool kE4M3, bool kGrad>
__global__ void __launch_bounds__(kThreads, 4)
    gelu_fp8_tile_kernel(GeluFp8Args<T> p, const T* __restrict__ pre, uint8_t* __restrict__ q) {
  __shared__ __align__(16) uint8_t tq[kBlock][kPitch];
  __shared__ uint32_t warp_red[kWarps];
  __shared__ float col_red[kGrad ? kWarps : 1][kGrad ? kBlock : 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = (p.tile0 + blockIdx.y) * kBlock, c0 = static_cast<int64_t>(blockIdx.x) * kBlock;
  const int64_t rows = p.rows, f = p.f;
  const bool quant = q != nullptr || p.qt != nullptr;
  const float s = quant ? *p.scale : 0.f;
  const bool interior = r0 + kBlock <= rows && c0 + kBlock <= f;
  float acc[4] = {};
  uint32_t m = 0;
#pragma unroll
  for (int i0 = 0; i0 < kRowsPerThread; i0 += kGeluRows) {
    // kGeluRows rows' inputs loaded before any is computed
    float va[kGeluRows][4], vg[kGeluRows][4];
#pragma unroll
    for (int k = 0; k < kGeluRows; ++k) {
      const int64_t r = r0 + warp + kWarps * (i0 + k);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t c = c0 + lane + 32 * j;
        const bool ok = interior || (r < rows && c < f);
        va[k][j] = ok ? to_f(pre[r * f + c]) : 0.f;
        if constexpr (kGrad) vg[k][j] = ok ? to_f(p.dy[r * f + c]) : 0.f;
      }
    }
#pragma unroll
    for (int k = 0; k < kGeluRows; ++k) {
      const int i = i0 + k;
      const int64_t r = r0 + warp + kWarps * i;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t c = c0 + lane + 32 * j;
        const bool ok = interior || (r < rows && c < f);
        // gelu_backward's / gelu_forward's expression
        const T t = kGrad ? from_f<T>(vg[k][j] * gelu_math::gelu_grad(va[k][j])) : from_f<T>(gelu_math::gelu(va[k][j]));
        if (ok && p.out != nullptr) p.out[r * f + c] = t;
        const float v = ok ? to_f(t) : 0.f;
        if constexpr (kGrad) acc[j] += v;
        if (quant) {
          m = max(m, abs_bits_for_max(v));
          const uint8_t byte = to_fp8<kE4M3>(v, s);
          if (ok && q != nullptr) q[r * f + c] = byte;
          tq[lane + 32 * j][warp + kWarps * i] = byte;
        }
      }
    }
  }
  if constexpr (kGrad) {
#pragma unroll
    for (int j = 0; j < 4; ++j) col_red[warp][lane + 32 * j] = acc[j];
  }
  cta_amax_record(m, warp_red, p.amax);  // also the barrier before the staged bytes are read
  if constexpr (kGrad) {
    if (p.part != nullptr && threadIdx.x < kBlock && c0 + threadIdx.x < f) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += col_red[w][threadIdx.x];
      p.part[static_cast<int64_t>(blockIdx.y) * f + c0 + threadIdx.x] = sum;
    }
  }
  if (p.qt == nullptr) return;
  store_transposed_tile(tq, p.qt, rows, f, r0, c0, p.qt_vec && r0 + kBlock <= rows);
}

/// fp8_gelu_forward (kGrad false: pre, y) / fp8_gelu_backward (pre, dy, dx, dbias). The bias
/// gradient runs in chunks of row tiles whose partial rows fit the stream's workspace, each chunk's
/// added to dbias in turn (the order depends on the shape only).
template <bool kGrad>
void launch_gelu_fp8(const Tensor& out, const Tensor& dy, const Tensor& q, const Tensor& q_t, const Tensor& pre,
                     const Tensor& dbias, const Tensor& scale, const Tensor& amax, const Stream& stream,
                     const char* fn, int64_t max_chunk_tiles = 0) {
  const int64_t f = pre.size(-1), rows = pre.numel() / f;
  if (rows == 0) return;
  const TileGrid tg = tile_grid(rows, f, fn);
  const int64_t row_tiles = tg.row_tiles;
  uint8_t* qt = q_t.empty() ? nullptr : q_t.data_as<uint8_t>();
  const bool quant = !q.empty() || qt != nullptr;
  float* part = dbias.empty() ? nullptr : column_partials_scratch(stream, fn);
  int64_t chunk = part ? column_partials_rows(row_tiles, f, 1, fn) : row_tiles;
  if (max_chunk_tiles > 0) chunk = std::min(chunk, max_chunk_tiles);
  dispatch_float(pre.dtype(), fn, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    GeluFp8Args<T> a{kGrad ? dy.data_as<T>() : nullptr,
                     out.empty() ? nullptr : out.data_as<T>(),
                     qt,
                     quant ? scale.data_as<float>() : nullptr,
                     amax.empty() ? nullptr : amax.data_as<uint32_t>(),
                     part,
                     rows,
                     f,
                     0,
                     qt_vectorised(qt, rows)};
    uint8_t* qp = q.empty() ? nullptr : q.data_as<uint8_t>();
    dispatch_fp8(quant ? (q.empty() ? q_t.dtype() : q.dtype()) : DType::kF8E4M3, [&](auto e4m3) {
      for (int64_t t0 = 0; t0 < row_tiles; t0 += chunk) {
        const int64_t tiles = std::min(chunk, row_tiles - t0);
        a.tile0 = t0;
        const dim3 grid(static_cast<unsigned>(tg.col_tiles), static_cast<unsigned>(tiles));
        gelu_fp8_tile_kernel<T, decltype(e4m3)::value, kGrad>
            <<<grid, kThreads, 0, cu(stream)>>>(a, pre.data_as<T>(), qp);
        MT_CUDA_CHECK_LAUNCH();
        if (part) add_column_partials(dbias.data_as<float>(), part, nullptr, nullptr, tiles, f, stream);
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------
// Dequantisation.

template <typename T, bool kE4M3>
__global__ void dequantize_kernel(T* y, const uint8_t* q, const float* s_inv, int64_t rows, int64_t cols,
                                  Fp8Scaling scaling) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float s =
        s_inv[scaling == Fp8Scaling::kTensor ? 0 : fp8_math::scale_index(scaling, i / cols, i % cols, rows, cols)];
    const float f = kE4M3 ? e4m3_bits_to_f32(q[i]) : e5m2_bits_to_f32(q[i]);
    y[i] = from_f<T>(f * s);
  }
}

}  // namespace

void fp8_swiglu_forward(const Tensor& y, const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale,
                        const Tensor& amax, const Stream& stream) {
  launch_swiglu_fp8<false>(y, Tensor(), q, q_t, x, scale, amax, stream, "fp8_swiglu_forward");
}

void fp8_swiglu_backward(const Tensor& dq, const Tensor& dq_t, const Tensor& dy, const Tensor& x, const Tensor& scale,
                         const Tensor& amax, const Stream& stream) {
  launch_swiglu_fp8<true>(Tensor(), dy, dq, dq_t, x, scale, amax, stream, "fp8_swiglu_backward");
}

void fp8_gelu_forward(const Tensor& y, const Tensor& q, const Tensor& q_t, const Tensor& pre, const Tensor& scale,
                      const Tensor& amax, const Stream& stream) {
  launch_gelu_fp8<false>(y, Tensor(), q, q_t, pre, Tensor(), scale, amax, stream, "fp8_gelu_forward");
}

void fp8_gelu_backward(const Tensor& dx, const Tensor& dq, const Tensor& dq_t, const Tensor& dbias, const Tensor& dy,
                       const Tensor& pre, const Tensor& scale, const Tensor& amax, const Stream& stream) {
  launch_gelu_fp8<true>(dx, dy, dq, dq_t, pre, dbias, scale, amax, stream, "fp8_gelu_backward");
}

void fp8_gelu_backward_in_chunks(const Tensor& dx, const Tensor& dq, const Tensor& dq_t, const Tensor& dbias,
                                 const Tensor& dy, const Tensor& pre, const Tensor& scale, const Tensor& amax,
                                 int64_t chunk_tiles, const Stream& stream) {
  MT_CHECK(chunk_tiles >= 1, "fp8_gelu_backward_in_chunks: chunk_tiles={} must be >= 1", chunk_tiles);
  launch_gelu_fp8<true>(dx, dy, dq, dq_t, pre, dbias, scale, amax, stream, "fp8_gelu_backward", chunk_tiles);
}

void fp8_amax(const Tensor& amax, const Tensor& x, const Stream& stream) {
  MT_CUDA_CHECK(cudaMemsetAsync(amax.data(), 0, sizeof(float), cu(stream)));
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_float(x.dtype(), "fp8_amax", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vec = reinterpret_cast<uintptr_t>(x.data()) % 16 == 0;
    const int64_t per_block = static_cast<int64_t>(kThreads) * (16 / sizeof(T));
    const int64_t blocks = std::min<int64_t>((n + per_block - 1) / per_block, 4 * num_sms(stream));
    amax_kernel<T>
        <<<static_cast<unsigned>(blocks), kThreads, 0, cu(stream)>>>(amax.data_as<uint32_t>(), x.data_as<T>(), n, vec);
    MT_CUDA_CHECK_LAUNCH();
  });
}

void fp8_scale_from_amax(const Tensor& scale, const Tensor& scale_inv, const Tensor& amax, DType fp8, bool pow2,
                         float epsilon, const Stream& stream) {
  const int64_t n = amax.numel();
  scale_from_amax_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, cu(stream)>>>(
      scale.data_as<float>(), scale_inv.data_as<float>(), amax.data_as<float>(), n, fp8_max(fp8), pow2, epsilon);
  MT_CUDA_CHECK_LAUNCH();
}

void fp8_delayed_scale_update(const Tensor& amax_history, const Tensor& scale, const Tensor& scale_inv, DType fp8,
                              int margin, fp8_math::AmaxAlgo algo, const Stream& stream) {
  const int64_t len = amax_history.size(0), n = amax_history.size(1);
  const float scaled_max = fp8_max(fp8) * std::ldexp(1.f, -margin);
  if (n == 0) return;
  const unsigned threads = static_cast<unsigned>(std::min<int64_t>(256, (len + 31) / 32 * 32));
  delayed_update_kernel<<<static_cast<unsigned>(n), threads, 0, cu(stream)>>>(
      amax_history.data_as<float>(), len, n, scale.data_as<float>(), scale_inv.data_as<float>(), scaled_max, algo);
  MT_CUDA_CHECK_LAUNCH();
}

void fp8_quantize(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale, const Tensor& amax,
                  const Stream& stream) {
  quantize_tensorwise(q, q_t, x, scale, amax, stream, /*round_bf16=*/false);
}

void fp8_quantize_bf16_rounded(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale,
                               const Tensor& amax, const Stream& stream) {
  quantize_tensorwise(q, q_t, x, scale, amax, stream, /*round_bf16=*/true);
}

void fp8_quantize_blockwise(const Tensor& q, const Tensor& q_scale_inv, const Tensor& q_t, const Tensor& q_t_scale_inv,
                            const Tensor& x, Fp8Scaling scaling, bool pow2, const Stream& stream) {
  TileArgs p = tile_args(q, q_t, x);
  if (p.rows == 0) return;
  p.s_inv = q.empty() ? nullptr : q_scale_inv.data_as<float>();
  p.st_inv = q_t.empty() ? nullptr : q_t_scale_inv.data_as<float>();
  p.pow2 = pow2;
  const DType t = q.empty() ? q_t.dtype() : q.dtype();
  if (scaling == Fp8Scaling::kBlock1x128) {
    launch_tile<Fp8Scaling::kBlock1x128>(x, p, t, stream);
  } else {
    launch_tile<Fp8Scaling::kBlock128x128>(x, p, t, stream);
  }
}

void fp8_dequantize(const Tensor& y, const Tensor& q, const Tensor& scale_inv, Fp8Scaling scaling,
                    const Stream& stream) {
  const int64_t cols = q.size(-1), rows = q.numel() / cols;
  if (rows == 0) return;
  dispatch_float(y.dtype(), "fp8_dequantize", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dispatch_fp8(q.dtype(), [&](auto e4m3) {
      constexpr bool kE = decltype(e4m3)::value;
      const unsigned grid = grid_for(rows * cols, 256);
      const float* s = scale_inv.data_as<float>();
      T* yv = y.data_as<T>();
      const uint8_t* qv = q.data_as<uint8_t>();
      dequantize_kernel<T, kE><<<grid, 256, 0, cu(stream)>>>(yv, qv, s, rows, cols, scaling);
      MT_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace mt::cuda
