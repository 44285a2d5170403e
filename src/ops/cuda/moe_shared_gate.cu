// CUDA kernels of ops/moe.h moe_shared_gate_forward / _backward (--moe-shared-expert-gate). Rows:
// one warp per token — the gate logit x·w in per-lane double sums reduced by a warp butterfly, the
// gate sigmoid(l) in double rounded to fp32 (the CPU's), the row update in fp32 math; the backward's
// dot product <dy, ys> the same way. The gate weight's gradient: one thread per channel summing
// the tokens in order in double (as the CPU). No atomics: deterministic; CPU and CUDA agree to
// rounding (the CPU sums each row in element order).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/moe.h"  // first: ops/cuda/elementwise_common.cuh needs Tensor, Stream, DType

#include "core/cuda_check.h"
#include "ops/cuda/elementwise_common.cuh"

namespace mt::cuda {
namespace {

using ew::from_f32;
using ew::raw;
using ew::to_f32;

constexpr int kWarps = 8;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ double gate_of(float l) { return 1.0 / (1.0 + exp(-static_cast<double>(l))); }

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    shared_gate_forward_kernel(T* __restrict__ y, float* __restrict__ logits, const T* __restrict__ ys,
                               const T* __restrict__ x, const T* __restrict__ w, int64_t rows, int64_t h) {
  const int lane = threadIdx.x & 31;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); t < rows;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    double l = 0;
    for (int64_t i = lane; i < h; i += 32)
      l += static_cast<double>(to_f32(x[t * h + i])) * static_cast<double>(to_f32(w[i]));
    const float lf = static_cast<float>(warp_sum_d(l));
    if (lane == 0) logits[t] = lf;
    const float g = static_cast<float>(gate_of(lf));
    for (int64_t i = lane; i < h; i += 32) y[t * h + i] = from_f32<T>(to_f32(y[t * h + i]) + g * to_f32(ys[t * h + i]));
  }
}

/// One row of dx += d_logit · w, the lanes of a warp over the channels (one expression for the whole
/// backward and its dx part alone: bitwise alike).
template <typename T>
__device__ __forceinline__ void gate_dx_row(T* __restrict__ dx, float dl, const T* __restrict__ w, int64_t h,
                                            int lane) {
  for (int64_t i = lane; i < h; i += 32) dx[i] = from_f32<T>(to_f32(dx[i]) + dl * to_f32(w[i]));
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    shared_gate_backward_rows_kernel(T* __restrict__ d_ys, float* __restrict__ d_logits, T* __restrict__ dx,
                                     const T* __restrict__ dy, const T* __restrict__ ys, const T* __restrict__ w,
                                     const float* __restrict__ logits, int64_t rows, int64_t h) {
  const int lane = threadIdx.x & 31;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); t < rows;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    const double g = gate_of(logits[t]);
    const float gf = static_cast<float>(g);
    double dot = 0;
    for (int64_t i = lane; i < h; i += 32) {
      const float d = to_f32(dy[t * h + i]);
      dot += static_cast<double>(d) * static_cast<double>(to_f32(ys[t * h + i]));
      d_ys[t * h + i] = from_f32<T>(gf * d);
    }
    const float dl = static_cast<float>(g * (1.0 - g) * warp_sum_d(dot));
    if (lane == 0) d_logits[t] = dl;
    if (dx != nullptr) gate_dx_row(dx + t * h, dl, w, h, lane);
  }
}

/// dx[t, :] += d_logits[t] · w alone (moe_shared_gate_backward_dx): the rows kernel's expression.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    shared_gate_backward_dx_kernel(T* __restrict__ dx, const float* __restrict__ d_logits, const T* __restrict__ w,
                                   int64_t rows, int64_t h) {
  const int lane = threadIdx.x & 31;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); t < rows;
       t += static_cast<int64_t>(gridDim.x) * kWarps)
    gate_dx_row(dx + t * h, d_logits[t], w, h, lane);
}

/// dw[i] += Σ_t d_logits[t]·x[t, i] in token order (one thread per channel: coalesced over i).
template <typename T>
__global__ void shared_gate_wgrad_kernel(float* __restrict__ dw, const float* __restrict__ d_logits,
                                         const T* __restrict__ x, int64_t rows, int64_t h) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= h) return;
  double s = 0;
  for (int64_t t = 0; t < rows; ++t) s += static_cast<double>(d_logits[t]) * static_cast<double>(to_f32(x[t * h + i]));
  dw[i] = static_cast<float>(static_cast<double>(dw[i]) + s);
}

}  // namespace

void moe_shared_gate_forward(const Tensor& y, const Tensor& logits, const Tensor& ys, const Tensor& x, const Tensor& w,
                             const Stream& stream) {
  const int64_t T = ys.size(0), h = ys.size(1);
  if (T == 0) return;
  ew::dispatch_float(ys.dtype(), "moe_shared_gate_forward", [&](auto tag) {
    using A = typename decltype(tag)::type;
    shared_gate_forward_kernel<A><<<ew::grid_for(T, kWarps, stream), kWarps * 32, 0, raw(stream)>>>(
        y.data_as<A>(), logits.data_as<float>(), ys.data_as<A>(), x.data_as<A>(), w.data_as<A>(), T, h);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_shared_gate_backward(const Tensor& d_ys, const Tensor& d_logits, const Tensor& dx, const Tensor& dw,
                              const Tensor& dy, const Tensor& ys, const Tensor& x, const Tensor& w,
                              const Tensor& logits, const Stream& stream) {
  const int64_t T = ys.size(0), h = ys.size(1);
  if (T == 0) return;
  ew::dispatch_float(ys.dtype(), "moe_shared_gate_backward", [&](auto tag) {
    using A = typename decltype(tag)::type;
    shared_gate_backward_rows_kernel<A><<<ew::grid_for(T, kWarps, stream), kWarps * 32, 0, raw(stream)>>>(
        d_ys.data_as<A>(), d_logits.data_as<float>(), dx.empty() ? nullptr : dx.data_as<A>(), dy.data_as<A>(), ys.data_as<A>(),
        w.data_as<A>(), logits.data_as<float>(), T, h);
    MT_CUDA_CHECK_LAUNCH();
    constexpr int kThreads = 128;
    shared_gate_wgrad_kernel<A><<<static_cast<unsigned>((h + kThreads - 1) / kThreads), kThreads, 0, raw(stream)>>>(
        dw.data_as<float>(), d_logits.data_as<float>(), x.data_as<A>(), T, h);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_shared_gate_backward_dx(const Tensor& dx, const Tensor& d_logits, const Tensor& w, const Stream& stream) {
  const int64_t T = dx.size(0), h = dx.size(1);
  if (T == 0) return;
  ew::dispatch_float(dx.dtype(), "moe_shared_gate_backward_dx", [&](auto tag) {
    using A = typename decltype(tag)::type;
    shared_gate_backward_dx_kernel<A><<<ew::grid_for(T, kWarps, stream), kWarps * 32, 0, raw(stream)>>>(
        dx.data_as<A>(), d_logits.data_as<float>(), w.data_as<A>(), T, h);
  });
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
