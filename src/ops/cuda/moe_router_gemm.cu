// CUDA kernels of ops/moe.h moe_router_logits_fp64 and its backward (--moe-router-dtype fp64).
// One tiled double-precision kernel for the three products: C[m, n] (=, or +=) Σ_k A(m, k)·B(k, n)
// with A and B addressed through strides, 16×16 output tiles per block, 16-deep k tiles staged in
// shared memory as double, one thread per output summing k in ascending order — the CPU
// reference's order (ops/cpu/moe_router_gemm.cpp), no atomics: deterministic, and equal to the
// CPU's to rounding (the kernel never fuses a product into its sum; a host compiler may). fp64 runs on the FP64 units (no tensor
// cores); the router GEMM is [T, h] × [h, E], small against the experts'.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/moe.h"  // first: ops/cuda/elementwise_common.cuh needs Tensor, Stream, DType

#include "core/cuda_check.h"
#include "ops/cuda/elementwise_common.cuh"

namespace mt::cuda {
namespace {

using ew::raw;

constexpr int kTile = 16;

__device__ __forceinline__ double to_f64(double v) { return v; }
__device__ __forceinline__ double to_f64(float v) { return static_cast<double>(v); }
__device__ __forceinline__ double to_f64(__nv_bfloat16 v) { return static_cast<double>(__bfloat162float(v)); }
__device__ __forceinline__ double to_f64(__half v) { return static_cast<double>(__half2float(v)); }

template <typename T>
__device__ __forceinline__ T from_f64(double v);
template <>
__device__ __forceinline__ double from_f64<double>(double v) { return v; }
template <>
__device__ __forceinline__ float from_f64<float>(double v) { return __double2float_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f64<__nv_bfloat16>(double v) { return __double2bfloat16(v); }
template <>
__device__ __forceinline__ __half from_f64<__half>(double v) { return __double2half(v); }

/// Strided operand: element (r, c) at p[r·sr + c·sc].
template <typename T>
struct Operand {
  const T* p;
  int64_t sr, sc;
  __device__ __forceinline__ double at(int64_t r, int64_t c) const { return to_f64(p[r * sr + c * sc]); }
};

/// C[m, n] = (kAccumulate ? C[m, n] : 0) + Σ_{k ascending} A(m, k)·B(k, n), rounded once to TC.
/// C is contiguous [M, N]. Block (16, 16): threadIdx.x walks n, threadIdx.y walks m.
template <typename TA, typename TB, typename TC, bool kAccumulate>
__global__ void __launch_bounds__(kTile* kTile)
    gemm_f64_kernel(TC* __restrict__ c, Operand<TA> a, Operand<TB> b, int64_t M, int64_t N, int64_t K) {
  __shared__ double as[kTile][kTile + 1];  // [m][k]
  __shared__ double bs[kTile][kTile + 1];  // [k][n]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t m = static_cast<int64_t>(blockIdx.y) * kTile + ty, n = static_cast<int64_t>(blockIdx.x) * kTile + tx;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile, n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  double acc = 0;
  for (int64_t k0 = 0; k0 < K; k0 += kTile) {
    // as[ty][tx] = A(m0 + ty, k0 + tx); bs[ty][tx] = B(k0 + ty, n0 + tx)
    as[ty][tx] = (m0 + ty < M && k0 + tx < K) ? a.at(m0 + ty, k0 + tx) : 0.0;
    bs[ty][tx] = (k0 + ty < K && n0 + tx < N) ? b.at(k0 + ty, n0 + tx) : 0.0;
    __syncthreads();
    const int kk = static_cast<int>(K - k0 < kTile ? K - k0 : kTile);
    for (int q = 0; q < kk; ++q) acc = __dadd_rn(acc, __dmul_rn(as[ty][q], bs[q][tx]));  // s += a·b, not fused
    __syncthreads();
  }
  if (m < M && n < N) {
    TC* out = c + m * N + n;
    *out = from_f64<TC>(kAccumulate ? to_f64(*out) + acc : acc);
  }
}

template <typename TA, typename TB, typename TC, bool kAccumulate>
void launch_gemm(TC* c, Operand<TA> a, Operand<TB> b, int64_t M, int64_t N, int64_t K, const Stream& stream) {
  if (M == 0 || N == 0) return;
  MT_CHECK((M + kTile - 1) / kTile <= 65535, "moe_router_logits_fp64: {} rows exceed the kernel's grid", M);
  const dim3 grid(static_cast<unsigned>((N + kTile - 1) / kTile), static_cast<unsigned>((M + kTile - 1) / kTile));
  gemm_f64_kernel<TA, TB, TC, kAccumulate><<<grid, dim3(kTile, kTile), 0, raw(stream)>>>(c, a, b, M, N, K);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void moe_router_logits_fp64(const Tensor& logits, const Tensor& x, const Tensor& w, const Stream& stream) {
  const int64_t T = x.size(0), h = x.size(1), E = w.size(0);
  ew::dispatch_float(x.dtype(), "moe_router_logits_fp64", [&](auto tag) {
    using A = typename decltype(tag)::type;
    // logits[t, e] = Σ_i x[t, i]·w[e, i]: A(t, i) = x[t·h + i], B(i, e) = w[e·h + i]
    launch_gemm<A, A, double, false>(logits.data_as<double>(), Operand<A>{x.data_as<A>(), h, 1},
                                     Operand<A>{w.data_as<A>(), 1, h}, T, E, h, stream);
  });
}

void moe_router_logits_fp64_backward(const Tensor& dx, const Tensor& dw, const Tensor& d_logits, const Tensor& x,
                                     const Tensor& w, const Stream& stream) {
  const int64_t T = x.size(0), h = x.size(1), E = w.size(0);
  const double* dl = d_logits.data_as<double>();
  ew::dispatch_float(x.dtype(), "moe_router_logits_fp64_backward", [&](auto tag) {
    using A = typename decltype(tag)::type;
    if (!dx.empty())  // dx[t, i] += Σ_e dl[t, e]·w[e, i]
      launch_gemm<double, A, A, true>(dx.data_as<A>(), Operand<double>{dl, E, 1}, Operand<A>{w.data_as<A>(), h, 1}, T,
                                      h, E, stream);
    if (!dw.empty())  // dw[e, i] += Σ_t dl[t, e]·x[t, i]
      launch_gemm<double, A, float, true>(dw.data_as<float>(), Operand<double>{dl, 1, E},
                                          Operand<A>{x.data_as<A>(), h, 1}, E, h, T, stream);
  });
}

}  // namespace mt::cuda
