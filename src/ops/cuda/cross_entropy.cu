#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/cuda_check.h"
#include "ops/cuda/common.cuh"
#include "ops/cross_entropy.h"

namespace mt::cuda {
namespace {

constexpr int kRowThreads = 512;   // threads per row block
constexpr int kSumThreads = 1024;  // the single block of sum_accumulate
constexpr int kVecBytes = 16;



/// Merges the online-softmax state (m, s) with (om, os): same max, rescaled sums.
__device__ __forceinline__ void merge_ms(float& m, float& s, float om, float os) {
  const float nm = fmaxf(m, om);
  if (nm == -INFINITY) return;  // both empty
  s = s * expf(m - nm) + os * expf(om - nm);
  m = nm;
}

/// Block-wide online-softmax reduction; the result is valid in thread 0. Fixed order.
__device__ void block_reduce_ms(float& m, float& s) {
  __shared__ float sm[32], ss[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) merge_ms(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    const int nw = (blockDim.x + 31) >> 5;
    m = lane < nw ? sm[lane] : -INFINITY;
    s = lane < nw ? ss[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1)
      merge_ms(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  }
}


/// Adds element x to the online-softmax state.
__device__ __forceinline__ void online_add(float& m, float& s, float x) {
  if (x > m) {
    s = s * expf(m - x) + 1.f;
    m = x;
  } else {
    s += expf(x - m);
  }
}

/// True when rows of `v` elements of T starting at p can be read as 16-byte vectors.
template <typename T>
bool can_vectorize(const void* p, int64_t v) {
  constexpr int64_t kN = kVecBytes / sizeof(T);
  return reinterpret_cast<uintptr_t>(p) % kVecBytes == 0 && v % kN == 0;
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(kRowThreads)
    stats_kernel(float* __restrict__ row_max, float* __restrict__ row_sumexp, float* __restrict__ target_logit,
                 const T* __restrict__ logits, const int32_t* __restrict__ targets, int64_t v, int64_t vocab_start,
                 int64_t valid) {
  // Only the first `valid` columns are vocabulary (the rest is padding).
  const int64_t r = blockIdx.x;
  const T* row = logits + r * v;
  float m = -INFINITY, s = 0.f;
  if constexpr (kVec) {
    constexpr int kN = kVecBytes / sizeof(T);
    const uint4* row4 = reinterpret_cast<const uint4*>(row);
    const int64_t nv = valid / kN;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      const uint4 raw = row4[i];
      const T* e = reinterpret_cast<const T*>(&raw);
      float x[kN];
      float lm = -INFINITY;
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        x[k] = to_f(e[k]);
        lm = fmaxf(lm, x[k]);
      }
      if (lm > m) {
        s *= expf(m - lm);
        m = lm;
      }
#pragma unroll
      for (int k = 0; k < kN; ++k) s += expf(x[k] - m);
    }
    for (int64_t i = nv * kN + threadIdx.x; i < valid; i += blockDim.x) online_add(m, s, to_f(row[i]));  // tail
  } else {
    for (int64_t i = threadIdx.x; i < valid; i += blockDim.x) online_add(m, s, to_f(row[i]));
  }
  block_reduce_ms(m, s);
  if (threadIdx.x == 0) {
    const int64_t t = static_cast<int64_t>(targets[r]) - vocab_start;
    row_max[r] = m;
    row_sumexp[r] = s;
    target_logit[r] = (t >= 0 && t < valid) ? to_f(row[t]) : 0.f;
  }
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(kRowThreads)
    backward_kernel(T* __restrict__ logits, const int32_t* __restrict__ targets, const float* __restrict__ row_max,
                    const float* __restrict__ row_sumexp, const float* __restrict__ mask, int64_t v,
                    int64_t vocab_start, int64_t valid, float grad_scale, const float* __restrict__ device_scale) {
  if (device_scale) grad_scale *= *device_scale;
  const int64_t r = blockIdx.x;
  T* row = logits + r * v;
  const float mx = row_max[r];
  const float inv = 1.f / row_sumexp[r];
  const float scale = mask ? grad_scale * mask[r] : grad_scale;
  const int64_t t = static_cast<int64_t>(targets[r]) - vocab_start;
  if constexpr (kVec) {
    constexpr int kN = kVecBytes / sizeof(T);
    uint4* row4 = reinterpret_cast<uint4*>(row);
    const int64_t nv = v / kN;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      uint4 raw = row4[i];
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const int64_t j = i * kN + k;
        const float p = expf(to_f(e[k]) - mx) * inv;
        e[k] = from_f<T>(j < valid ? (p - (j == t ? 1.f : 0.f)) * scale : 0.f);
      }
      row4[i] = raw;
    }
  } else {
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
      const float p = expf(to_f(row[j]) - mx) * inv;
      row[j] = from_f<T>(j < valid ? (p - (j == t ? 1.f : 0.f)) * scale : 0.f);
    }
  }
}

__global__ void rescale_kernel(float* __restrict__ se, const float* __restrict__ lm, const float* __restrict__ gm,
                               int64_t m) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < m; r += int64_t(gridDim.x) * blockDim.x)
    se[r] = se[r] == 0.f ? 0.f : se[r] * expf(lm[r] - gm[r]);  // a shard of padding only: 0
}

__global__ void loss_kernel(float* __restrict__ out, const float* __restrict__ mx, const float* __restrict__ se,
                            const float* __restrict__ tl, const float* __restrict__ mask, int64_t m) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < m; r += int64_t(gridDim.x) * blockDim.x) {
    const float l = logf(se[r]) + mx[r] - tl[r];
    out[r] = mask ? l * mask[r] : l;
  }
}

/// One block, fixed thread->element assignment and fixed reduction tree: deterministic.
__global__ void __launch_bounds__(kSumThreads) sum_kernel(float* out, const float* __restrict__ x, int64_t n,
                                                          float alpha) {
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
  s = block_reduce_sum(s);
  if (threadIdx.x == 0) out[0] += alpha * s;
}

unsigned elementwise_blocks(int64_t m) {
  return static_cast<unsigned>(std::min<int64_t>((m + 255) / 256, 4096));
}

template <typename T>
void launch_stats(const Tensor& row_max, const Tensor& row_sumexp, const Tensor& target_logit, const Tensor& logits,
                  const Tensor& targets, int64_t vocab_start, int64_t valid, const Stream& stream) {
  const int64_t m = logits.size(0), v = logits.size(1);
  const dim3 grid(static_cast<unsigned>(m));
  auto args = [&](auto kernel) {
    kernel<<<grid, kRowThreads, 0, cu(stream)>>>(row_max.data_as<float>(), row_sumexp.data_as<float>(),
                                                 target_logit.data_as<float>(), logits.data_as<T>(),
                                                 targets.data_as<int32_t>(), v, vocab_start, valid);
  };
  if (can_vectorize<T>(logits.data(), v)) {
    args(stats_kernel<T, true>);
  } else {
    args(stats_kernel<T, false>);
  }
  MT_CUDA_CHECK_LAUNCH();
}

template <typename T>
void launch_backward(const Tensor& logits, const Tensor& targets, const Tensor& row_max, const Tensor& row_sumexp,
                     const Tensor& loss_mask, int64_t vocab_start, int64_t valid, float grad_scale,
                     const Tensor& device_scale, const Stream& stream) {
  const int64_t m = logits.size(0), v = logits.size(1);
  const dim3 grid(static_cast<unsigned>(m));
  const float* mask = loss_mask.empty() ? nullptr : loss_mask.data_as<float>();
  auto args = [&](auto kernel) {
    kernel<<<grid, kRowThreads, 0, cu(stream)>>>(logits.data_as<T>(), targets.data_as<int32_t>(),
                                                 row_max.data_as<float>(), row_sumexp.data_as<float>(), mask, v,
                                                 vocab_start, valid, grad_scale,
                                                 device_scale.empty() ? nullptr : device_scale.data_as<float>());
  };
  if (can_vectorize<T>(logits.data(), v)) {
    args(backward_kernel<T, true>);
  } else {
    args(backward_kernel<T, false>);
  }
  MT_CUDA_CHECK_LAUNCH();
}

void check_rows(int64_t m) {
  MT_CHECK(m <= int64_t{INT32_MAX}, "cross_entropy: {} rows exceed the CUDA grid limit", m);
}

}  // namespace

void cross_entropy_stats(const Tensor& row_max, const Tensor& row_sumexp, const Tensor& target_logit,
                         const Tensor& logits, const Tensor& targets, int64_t vocab_start, int64_t valid_cols,
                         const Stream& stream) {
  check_rows(logits.size(0));
  dispatch_float(logits.dtype(), "cross_entropy_stats logits", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_stats<T>(row_max, row_sumexp, target_logit, logits, targets, vocab_start, valid_cols, stream);
  });
}

void cross_entropy_rescale_sumexp(const Tensor& row_sumexp, const Tensor& local_max, const Tensor& global_max,
                                  const Stream& stream) {
  const int64_t m = row_sumexp.numel();
  rescale_kernel<<<elementwise_blocks(m), 256, 0, cu(stream)>>>(row_sumexp.data_as<float>(), local_max.data_as<float>(),
                                                               global_max.data_as<float>(), m);
  MT_CUDA_CHECK_LAUNCH();
}

void cross_entropy_loss(const Tensor& losses, const Tensor& row_max, const Tensor& row_sumexp,
                        const Tensor& target_logit, const Tensor& loss_mask, const Stream& stream) {
  const int64_t m = losses.numel();
  loss_kernel<<<elementwise_blocks(m), 256, 0, cu(stream)>>>(
      losses.data_as<float>(), row_max.data_as<float>(), row_sumexp.data_as<float>(), target_logit.data_as<float>(),
      loss_mask.empty() ? nullptr : loss_mask.data_as<float>(), m);
  MT_CUDA_CHECK_LAUNCH();
}

void cross_entropy_backward_inplace(const Tensor& logits, const Tensor& targets, const Tensor& row_max,
                                    const Tensor& row_sumexp, const Tensor& loss_mask, int64_t vocab_start,
                                    int64_t valid_cols, float grad_scale, const Tensor& device_scale,
                                    const Stream& stream) {
  check_rows(logits.size(0));
  dispatch_float(logits.dtype(), "cross_entropy_backward_inplace logits", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_backward<T>(logits, targets, row_max, row_sumexp, loss_mask, vocab_start, valid_cols, grad_scale,
                       device_scale, stream);
  });
}

void sum_accumulate(const Tensor& out, const Tensor& x, float alpha, const Stream& stream) {
  sum_kernel<<<1, kSumThreads, 0, cu(stream)>>>(out.data_as<float>(), x.data_as<float>(), x.numel(), alpha);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
