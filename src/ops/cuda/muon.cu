// CUDA kernels of ops/muon.h: grid-stride element-wise kernels reading the optimizer's device
// scalars, and a two-level fixed-grid sum of squares (deterministic; no atomics).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/cuda_check.h"
#include "ops/cuda/common.cuh"
#include "ops/muon.h"
#include "ops/optimizer.h"

namespace mt::cuda {
namespace {

constexpr int kThreads = 256;
static_assert(kMuonNormBlocks <= 1024 && kMuonNormBlocks % 32 == 0, "the final reduction runs in one block");

__global__ void momentum_kernel(float* u, const float* g, float* __restrict__ m, int64_t n, float beta,
                                bool nesterov, const OptimizerScalars* s) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if (s->found_inf) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) u[i] = 0.f;
    return;
  }
  const float inv_scale = 1.f / s->loss_scale, clip = s->clip_coeff;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    float mi = m[i];
    const float ui = detail::muon_momentum_element(g[i], mi, beta, nesterov, inv_scale, clip);
    m[i] = mi;
    u[i] = ui;
  }
}

__device__ __forceinline__ float load_f32(const float* x, int64_t i) { return x[i]; }
__device__ __forceinline__ float load_f32(const __nv_bfloat16* x, int64_t i) { return __bfloat162float(x[i]); }

/// Level 1: block b writes its fixed grid-stride share of sum x^2 to partials[b].
template <typename T>
__global__ void __launch_bounds__(kThreads) sumsq_partial_kernel(float* partials, const T* __restrict__ x,
                                                                 int64_t n) {
  float acc = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = load_f32(x, i);
    acc = fmaf(v, v, acc);
  }
  acc = block_reduce_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

/// Level 2: one block of kMuonNormBlocks threads adds the partials into scratch[0].
__global__ void __launch_bounds__(kMuonNormBlocks) sumsq_final_kernel(float* scratch) {
  const float total = block_reduce_sum(scratch[1 + threadIdx.x]);
  if (threadIdx.x == 0) scratch[0] = total;
}

template <typename T>
__global__ void normalize_kernel(T* y, const float* x, int64_t n, const float* scratch, float eps) {
  const float inv = 1.f / fmaxf(sqrtf(scratch[0]), eps);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, float>) {
      y[i] = x[i] * inv;
    } else {
      y[i] = __float2bfloat16_rn(x[i] * inv);
    }
  }
}

}  // namespace

void muon_momentum(const Tensor& u, const Tensor& grad, const Tensor& momentum, float beta, bool nesterov,
                   const Tensor& scalars, const Stream& stream) {
  const int64_t n = grad.numel();
  momentum_kernel<<<grid_for(n, kThreads), kThreads, 0, cu(stream)>>>(
      u.data_as<float>(), grad.data_as<float>(), momentum.data_as<float>(), n, beta, nesterov,
      static_cast<const OptimizerScalars*>(scalars.data()));
  MT_CUDA_CHECK_LAUNCH();
}

void muon_sumsq(const Tensor& scratch, const Tensor& x, const Stream& stream) {
  float* sc = scratch.data_as<float>();
  const int64_t n = x.numel();
  if (x.dtype() == DType::kF32) {
    sumsq_partial_kernel<float><<<kMuonNormBlocks, kThreads, 0, cu(stream)>>>(sc + 1, x.data_as<float>(), n);
  } else {
    sumsq_partial_kernel<__nv_bfloat16><<<kMuonNormBlocks, kThreads, 0, cu(stream)>>>(
        sc + 1, static_cast<const __nv_bfloat16*>(x.data()), n);
  }
  MT_CUDA_CHECK_LAUNCH();
  sumsq_final_kernel<<<1, kMuonNormBlocks, 0, cu(stream)>>>(sc);
  MT_CUDA_CHECK_LAUNCH();
}

void muon_normalize(const Tensor& y, const Tensor& x, const Tensor& scratch, float eps, const Stream& stream) {
  const int64_t n = x.numel();
  if (y.dtype() == DType::kF32) {
    normalize_kernel<float><<<grid_for(n, kThreads), kThreads, 0, cu(stream)>>>(
        y.data_as<float>(), x.data_as<float>(), n, scratch.data_as<float>(), eps);
  } else {
    normalize_kernel<__nv_bfloat16><<<grid_for(n, kThreads), kThreads, 0, cu(stream)>>>(
        static_cast<__nv_bfloat16*>(y.data()), x.data_as<float>(), n, scratch.data_as<float>(), eps);
  }
  MT_CUDA_CHECK_LAUNCH();
}

void muon_copy_2d(const Tensor& dst, int64_t dst_stride, const Tensor& src, int64_t src_stride, int64_t rows,
                  int64_t cols, const Stream& stream) {
  const size_t es = dtype_size(dst.dtype());
  MT_CUDA_CHECK(cudaMemcpy2DAsync(dst.data(), static_cast<size_t>(dst_stride) * es, src.data(),
                                  static_cast<size_t>(src_stride) * es, static_cast<size_t>(cols) * es,
                                  static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, cu(stream)));
}

}  // namespace mt::cuda
