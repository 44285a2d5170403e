// CUDA kernels of ops/moe.h moe_shared_gate_forward / _backward (--moe-shared-expert-gate): one
// warp per token row; the gate sigmoid(l) in double then rounded to fp32 (the CPU's), the row's
// elements in fp32 math; the backward's dot product in per-lane double sums reduced by a warp
// butterfly (a fixed order: deterministic; the CPU sums in row order, so the two agree to
// rounding).
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

__device__ __forceinline__ double gate_of(float l) { return 1.0 / (1.0 + exp(-static_cast<double>(l))); }

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    shared_gate_forward_kernel(T* __restrict__ y, const T* __restrict__ ys, const float* __restrict__ logits, int64_t rows,
                               int64_t h) {
  const int lane = threadIdx.x & 31;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); t < rows;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    const float g = static_cast<float>(gate_of(logits[t]));
    for (int64_t i = lane; i < h; i += 32) y[t * h + i] = from_f32<T>(to_f32(y[t * h + i]) + g * to_f32(ys[t * h + i]));
  }
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    shared_gate_backward_kernel(T* __restrict__ d_ys, float* __restrict__ d_logits, const T* __restrict__ dy,
                                const T* __restrict__ ys, const float* __restrict__ logits, int64_t rows, int64_t h) {
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
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0) d_logits[t] = static_cast<float>(g * (1.0 - g) * dot);
  }
}

}  // namespace

void moe_shared_gate_forward(const Tensor& y, const Tensor& ys, const Tensor& logits, const Stream& stream) {
  const int64_t T = ys.size(0), h = ys.size(1);
  if (T == 0) return;
  ew::dispatch_float(ys.dtype(), "moe_shared_gate_forward", [&](auto tag) {
    using A = typename decltype(tag)::type;
    shared_gate_forward_kernel<A><<<ew::grid_for(T, kWarps, stream), kWarps * 32, 0, raw(stream)>>>(
        y.data_as<A>(), ys.data_as<A>(), logits.data_as<float>(), T, h);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_shared_gate_backward(const Tensor& d_ys, const Tensor& d_logits, const Tensor& dy, const Tensor& ys,
                              const Tensor& logits, const Stream& stream) {
  const int64_t T = ys.size(0), h = ys.size(1);
  if (T == 0) return;
  ew::dispatch_float(ys.dtype(), "moe_shared_gate_backward", [&](auto tag) {
    using A = typename decltype(tag)::type;
    shared_gate_backward_kernel<A><<<ew::grid_for(T, kWarps, stream), kWarps * 32, 0, raw(stream)>>>(
        d_ys.data_as<A>(), d_logits.data_as<float>(), dy.data_as<A>(), ys.data_as<A>(), logits.data_as<float>(), T,
        h);
  });
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
