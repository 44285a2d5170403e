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
constexpr int kFusedThreads = 512;  // threads per row block of the one-pass kernel
constexpr int kFusedLoads = 4;      // 16-byte loads in flight per thread there



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

/// The gradient of the 16-byte vector `raw` of logits holding columns [j0, j0 + kN) of a row:
/// (softmax - onehot(t)) * scale on the valid columns, 0 on the padding.
/// kFast: exp by the hardware's ex2.approx (__expf: ~2 ulp near 0, relative error < 2e-6 for the
/// softmax's arguments x - max <= 0), else the accurate expf.
template <typename T, bool kFast = false>
__device__ __forceinline__ uint4 grad_vector(uint4 raw, int64_t j0, int64_t valid, int64_t t, float mx, float inv,
                                             float scale) {
  constexpr int kN = kVecBytes / sizeof(T);
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const int64_t j = j0 + k;
    const float p = (kFast ? __expf(to_f(e[k]) - mx) : expf(to_f(e[k]) - mx)) * inv;
    e[k] = from_f<T>(j < valid ? (p - (j == t ? 1.f : 0.f)) * scale : 0.f);
  }
  return raw;
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
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) row4[i] = grad_vector<T>(row4[i], i * kN, valid, t, mx, inv, scale);
  } else {
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
      const float p = expf(to_f(row[j]) - mx) * inv;
      row[j] = from_f<T>(j < valid ? (p - (j == t ? 1.f : 0.f)) * scale : 0.f);
    }
  }
}


/// cross_entropy_forward_backward_inplace, one block per row: the row is read once from device
/// memory into shared memory (kFusedLoads 16-byte loads in flight per thread) while each thread
/// keeps the online-softmax state of its vectors; after the block reduction the gradient is
/// computed from shared memory and written over the logits. Two blocks per multiprocessor, so
/// that one block's loads overlap the other's stores. The exponentials use the hardware's
/// ex2.approx (__expf): with the accurate expf the kernel was bound by its instruction issue
/// (1.68 ms per GPT-2 step on an H100 against 1.83 ms for the two kernels). Requires 16-byte aligned rows with v a
/// multiple of the vector (cross_entropy_fused_row_fits).
template <typename T>
__global__ void __launch_bounds__(kFusedThreads, 2)
    fused_kernel(float* __restrict__ row_max, float* __restrict__ row_sumexp, float* __restrict__ target_logit,
                 T* __restrict__ logits, const int32_t* __restrict__ targets, const float* __restrict__ mask,
                 int64_t v, int64_t valid, float grad_scale, const float* __restrict__ device_scale) {
  extern __shared__ uint4 srow[];
  __shared__ float stat[2];
  constexpr int kN = kVecBytes / sizeof(T);
  const int64_t r = blockIdx.x;
  uint4* row4 = reinterpret_cast<uint4*>(logits + r * v);
  const int nv = static_cast<int>(v / kN);
  float m = -INFINITY, s = 0.f;
  for (int base = threadIdx.x; base < nv; base += kFusedLoads * kFusedThreads) {
    uint4 raw[kFusedLoads];
#pragma unroll
    for (int u = 0; u < kFusedLoads; ++u) {
      const int i = base + u * kFusedThreads;
      if (i < nv) raw[u] = row4[i];
    }
#pragma unroll
    for (int u = 0; u < kFusedLoads; ++u) {
      const int i = base + u * kFusedThreads;
      if (i >= nv) break;
      srow[i] = raw[u];
      const T* e = reinterpret_cast<const T*>(&raw[u]);
      float x[kN];
      float lm = -INFINITY;
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        x[k] = static_cast<int64_t>(i) * kN + k < valid ? to_f(e[k]) : -INFINITY;  // padding: no mass
        lm = fmaxf(lm, x[k]);
      }
      if (lm == -INFINITY) continue;  // all padding
      if (lm > m) {
        s *= __expf(m - lm);
        m = lm;
      }
#pragma unroll
      for (int k = 0; k < kN; ++k) s += __expf(x[k] - m);
    }
  }
  block_reduce_ms(m, s);  // synchronises the block: the whole row is in shared memory afterwards
  const int64_t t = static_cast<int64_t>(targets[r]);
  if (threadIdx.x == 0) {
    const float tl = (t >= 0 && t < valid) ? to_f(reinterpret_cast<const T*>(srow)[t]) : 0.f;
    row_max[r] = m;
    row_sumexp[r] = s;
    target_logit[r] = tl;
    stat[0] = m;
    stat[1] = s;
  }
  __syncthreads();
  const float mx = stat[0], inv = 1.f / stat[1];
  if (device_scale) grad_scale *= *device_scale;
  const float scale = mask ? grad_scale * mask[r] : grad_scale;
  for (int i = threadIdx.x; i < nv; i += kFusedThreads)
    row4[i] = grad_vector<T, true>(srow[i], static_cast<int64_t>(i) * kN, valid, t, mx, inv, scale);
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

/// Two blocks of the one-pass kernel per multiprocessor of CUDA device `dev` (each with its row,
/// its static shared memory and the 1 KiB the hardware reserves per block). The device's limits
/// are queried once.
bool fused_fits(size_t row_bytes, int dev) {
  const int per_sm = cached_per_device(dev, [dev] {
    int v = 0;
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
    return v;
  });
  const int per_block = cached_per_device(dev, [dev] {
    int v = 0;
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return v;
  });
  const size_t block = row_bytes + 1024 + 512;  // 512: a bound on the kernel's static shared memory
  return row_bytes + 512 <= static_cast<size_t>(per_block) && 2 * block <= static_cast<size_t>(per_sm);
}

template <typename T>
void launch_forward_backward(const Tensor& row_max, const Tensor& row_sumexp, const Tensor& target_logit,
                             const Tensor& logits, const Tensor& targets, const Tensor& loss_mask, int64_t valid,
                             float grad_scale, const Tensor& device_scale, const Stream& stream) {
  const int64_t m = logits.size(0), v = logits.size(1);
  const size_t smem = static_cast<size_t>(v) * sizeof(T);  // one row
  const int dev = logits.device().index;
  // The kernel may take up to the device's opt-in shared memory per block less its static shared
  // memory as dynamic shared memory (set once per device; fused_fits bounds what a launch asks for).
  cached_per_device(dev, [dev] {
    int optin = 0;
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    cudaFuncAttributes attr{};
    MT_CUDA_CHECK(cudaFuncGetAttributes(&attr, fused_kernel<T>));
    const int dynamic = optin - static_cast<int>(attr.sharedSizeBytes);
    MT_CUDA_CHECK(cudaFuncSetAttribute(fused_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic));
    return dynamic;
  });
  fused_kernel<T><<<static_cast<unsigned>(m), kFusedThreads, smem, cu(stream)>>>(
      row_max.data_as<float>(), row_sumexp.data_as<float>(), target_logit.data_as<float>(), logits.data_as<T>(),
      targets.data_as<int32_t>(), loss_mask.empty() ? nullptr : loss_mask.data_as<float>(), v, valid, grad_scale,
      device_scale.empty() ? nullptr : device_scale.data_as<float>());
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

bool cross_entropy_fused_row_fits(int64_t v, DType dtype, Device device) {
  if (!device.is_cuda() || v <= 0 || v * static_cast<int64_t>(dtype_size(dtype)) % kVecBytes != 0) return false;
  return v <= INT32_MAX / 2 && fused_fits(static_cast<size_t>(v) * dtype_size(dtype), device.index);
}

void cross_entropy_forward_backward_inplace(const Tensor& row_max, const Tensor& row_sumexp,
                                            const Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                                            const Tensor& loss_mask, int64_t valid_cols, float grad_scale,
                                            const Tensor& device_scale, const Stream& stream) {
  check_rows(logits.size(0));
  const bool aligned = reinterpret_cast<uintptr_t>(logits.data()) % kVecBytes == 0;
  if (!aligned || !cross_entropy_fused_row_fits(logits.size(1), logits.dtype(), logits.device())) {
    cuda::cross_entropy_stats(row_max, row_sumexp, target_logit, logits, targets, 0, valid_cols, stream);
    cuda::cross_entropy_backward_inplace(logits, targets, row_max, row_sumexp, loss_mask, 0, valid_cols, grad_scale,
                                   device_scale, stream);
    return;
  }
  dispatch_float(logits.dtype(), "cross_entropy_forward_backward_inplace logits", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_forward_backward<T>(row_max, row_sumexp, target_logit, logits, targets, loss_mask, valid_cols, grad_scale,
                               device_scale, stream);
  });
}

void sum_accumulate(const Tensor& out, const Tensor& x, float alpha, const Stream& stream) {
  sum_kernel<<<1, kSumThreads, 0, cu(stream)>>>(out.data_as<float>(), x.data_as<float>(), x.numel(), alpha);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
