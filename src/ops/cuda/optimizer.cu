#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/cuda_check.h"
#include "ops/cuda/common.cuh"
#include "ops/optimizer_math.h"
#include "ops/optimizer.h"

namespace mt::cuda {
namespace {

constexpr int kSumsqThreads = 256;
constexpr int kAdamThreads = 256;
static_assert(kGradSumsqBlocks % 32 == 0 && kGradSumsqBlocks <= 1024, "final reduction runs in one block");

OptimizerScalars* scalars_ptr(const Tensor& t) { return static_cast<OptimizerScalars*>(t.data()); }


/// Level 1: block b writes the sum over its fixed grid-stride share of (g * (1/loss_scale))^2.
template <bool kVec>
__global__ void __launch_bounds__(kSumsqThreads) sumsq_partial_kernel(OptimizerScalars* s, const float* __restrict__ g,
                                                                      int64_t n) {
  const float inv = 1.f / s->loss_scale;
  const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  float acc = 0.f;
  int64_t tail_begin = 0;
  if constexpr (kVec) {
    const float4* g4 = reinterpret_cast<const float4*>(g);
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      const float4 q = g4[i];
      const float a = q.x * inv, b = q.y * inv, c = q.z * inv, d = q.w * inv;
      acc += a * a;
      acc += b * b;
      acc += c * c;
      acc += d * d;
    }
    tail_begin = n4 * 4;
  }
  for (int64_t i = tail_begin + tid; i < n; i += stride) {
    const float a = g[i] * inv;
    acc += a * a;
  }
  acc = block_reduce_sum(acc);
  if (threadIdx.x == 0) s->sumsq_partials[blockIdx.x] = acc;
}

/// Level 2: one block of kGradSumsqBlocks threads adds the partials (fixed tree) to grad_sumsq.
__global__ void __launch_bounds__(kGradSumsqBlocks) sumsq_final_kernel(OptimizerScalars* s) {
  const float total = block_reduce_sum(s->sumsq_partials[threadIdx.x]);
  if (threadIdx.x == 0) s->grad_sumsq += total;
}

__global__ void prepare_kernel(OptimizerScalars* s, float clip_grad) { detail::optimizer_prepare_state(*s, clip_grad); }

__global__ void scaler_kernel(OptimizerScalars* s, LossScalerConfig cfg) { detail::loss_scaler_update_state(*s, cfg); }

template <typename P>
__device__ __forceinline__ void store_model(P* model, int64_t i, float x) {
  if constexpr (std::is_same_v<P, __nv_bfloat16>) {
    model[i] = __float2bfloat16_rn(x);
  } else if constexpr (std::is_same_v<P, __half>) {
    model[i] = __float2half_rn(x);
  }
}

/// The AdamW update of elements [0, n) of one run, strided over threads `tid` (step `stride`).
/// kVec: p, g, m, v 16-byte aligned and the model copy 8-byte aligned, so each thread moves four
/// elements per access (float4 loads/stores, four 16-bit values in one 8-byte store); the
/// arithmetic per element is the scalar path's (identical results). The tail (n mod 4) is scalar.
template <typename P, bool kVec>  // P: void (no model copy), __nv_bfloat16 or __half
__device__ __forceinline__ void adamw_range(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                                            float* __restrict__ v, P* __restrict__ model, int64_t n,
                                            const AdamWHyper& h, const detail::AdamWCoeffs& c, int64_t tid,
                                            int64_t stride) {
  int64_t tail_begin = 0;
  if constexpr (kVec) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      float4 pi = reinterpret_cast<const float4*>(p)[i];
      const float4 gi = reinterpret_cast<const float4*>(g)[i];
      float4 mi = reinterpret_cast<const float4*>(m)[i];
      float4 vi = reinterpret_cast<const float4*>(v)[i];
      detail::adamw_element(pi.x, gi.x, mi.x, vi.x, h, c);
      detail::adamw_element(pi.y, gi.y, mi.y, vi.y, h, c);
      detail::adamw_element(pi.z, gi.z, mi.z, vi.z, h, c);
      detail::adamw_element(pi.w, gi.w, mi.w, vi.w, h, c);
      reinterpret_cast<float4*>(p)[i] = pi;
      reinterpret_cast<float4*>(m)[i] = mi;
      reinterpret_cast<float4*>(v)[i] = vi;
      if constexpr (std::is_same_v<P, __nv_bfloat16>) {
        const __nv_bfloat162 a = __floats2bfloat162_rn(pi.x, pi.y), b = __floats2bfloat162_rn(pi.z, pi.w);
        uint2 packed;
        packed.x = *reinterpret_cast<const uint32_t*>(&a);
        packed.y = *reinterpret_cast<const uint32_t*>(&b);
        reinterpret_cast<uint2*>(model)[i] = packed;
      } else if constexpr (std::is_same_v<P, __half>) {
        const __half2 a = __floats2half2_rn(pi.x, pi.y), b = __floats2half2_rn(pi.z, pi.w);
        uint2 packed;
        packed.x = *reinterpret_cast<const uint32_t*>(&a);
        packed.y = *reinterpret_cast<const uint32_t*>(&b);
        reinterpret_cast<uint2*>(model)[i] = packed;
      }
    }
    tail_begin = n4 * 4;
  }
  for (int64_t i = tail_begin + tid; i < n; i += stride) {
    float pi = p[i], mi = m[i], vi = v[i];
    detail::adamw_element(pi, g[i], mi, vi, h, c);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    store_model(model, i, pi);
  }
}

/// Four 16-bit values of one 8-byte word pair (element k in the low half of word k / 2), and back.
__device__ __forceinline__ void unpack4(uint2 q, uint16_t (&e)[4]) {
  e[0] = static_cast<uint16_t>(q.x & 0xFFFFu);
  e[1] = static_cast<uint16_t>(q.x >> 16);
  e[2] = static_cast<uint16_t>(q.y & 0xFFFFu);
  e[3] = static_cast<uint16_t>(q.y >> 16);
}
__device__ __forceinline__ uint2 pack4(const uint16_t (&e)[4]) {
  uint2 q;
  q.x = static_cast<uint32_t>(e[0]) | (static_cast<uint32_t>(e[1]) << 16);
  q.y = static_cast<uint32_t>(e[2]) | (static_cast<uint32_t>(e[3]) << 16);
  return q;
}

/// adamw_range with remainder storage: the fp32 main parameter of element i is merged from the
/// bf16 bits model[i] and the int16 remainder rem[i], updated by the same adamw_element, and split
/// back into both (ops/optimizer_math.h). kVec: g, m, v 16-byte aligned, model and rem 8-byte
/// aligned: per thread and iteration four elements, 8-byte loads/stores of the 16-bit arrays
/// (~28 bytes of traffic per element instead of ~30 with a separate fp32 copy).
template <bool kVec>
__device__ __forceinline__ void adamw_rem_range(uint16_t* __restrict__ model, int16_t* __restrict__ rem,
                                                const float* __restrict__ g, float* __restrict__ m,
                                                float* __restrict__ v, int64_t n, const AdamWHyper& h,
                                                const detail::AdamWCoeffs& c, int64_t tid, int64_t stride) {
  int64_t tail_begin = 0;
  if constexpr (kVec) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      uint16_t hi[4], lo[4];
      unpack4(reinterpret_cast<const uint2*>(model)[i], hi);
      unpack4(reinterpret_cast<const uint2*>(rem)[i], lo);
      const float4 gi = reinterpret_cast<const float4*>(g)[i];
      float4 mi = reinterpret_cast<const float4*>(m)[i];
      float4 vi = reinterpret_cast<const float4*>(v)[i];
      float p[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) p[k] = detail::merge_f32_remainder(hi[k], static_cast<int16_t>(lo[k]));
      detail::adamw_element(p[0], gi.x, mi.x, vi.x, h, c);
      detail::adamw_element(p[1], gi.y, mi.y, vi.y, h, c);
      detail::adamw_element(p[2], gi.z, mi.z, vi.z, h, c);
      detail::adamw_element(p[3], gi.w, mi.w, vi.w, h, c);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        int16_t r;
        detail::split_f32_remainder(p[k], hi[k], r);
        lo[k] = static_cast<uint16_t>(r);
      }
      reinterpret_cast<float4*>(m)[i] = mi;
      reinterpret_cast<float4*>(v)[i] = vi;
      reinterpret_cast<uint2*>(model)[i] = pack4(hi);
      reinterpret_cast<uint2*>(rem)[i] = pack4(lo);
    }
    tail_begin = n4 * 4;
  }
  for (int64_t i = tail_begin + tid; i < n; i += stride) {
    float pi = detail::merge_f32_remainder(model[i], rem[i]), mi = m[i], vi = v[i];
    detail::adamw_element(pi, g[i], mi, vi, h, c);
    m[i] = mi;
    v[i] = vi;
    detail::split_f32_remainder(pi, model[i], rem[i]);
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kAdamThreads)
    adamw_rem_kernel(uint16_t* __restrict__ model, int16_t* __restrict__ rem, const float* __restrict__ g,
                     float* __restrict__ m, float* __restrict__ v, int64_t n, AdamWHyper h,
                     const OptimizerScalars* s) {
  if (s->found_inf) return;
  const detail::AdamWCoeffs c = detail::adamw_coeffs(h, *s);
  adamw_rem_range<kVec>(model, rem, g, m, v, n, h, c, blockIdx.x * int64_t(blockDim.x) + threadIdx.x,
                        int64_t(gridDim.x) * blockDim.x);
}

/// adamw_multi_kernel with remainder storage (one block per chunk; remainders indexed by r.main).
template <bool kVec>
__global__ void __launch_bounds__(kAdamThreads)
    adamw_multi_rem_kernel(uint16_t* __restrict__ model, int16_t* __restrict__ rem, const float* __restrict__ g,
                           float* __restrict__ m, float* __restrict__ v, const AdamWRun* __restrict__ chunks,
                           AdamWHyper h, const OptimizerScalars* s) {
  if (s->found_inf) return;
  const AdamWRun r = chunks[blockIdx.x];
  if (!r.decay) h.weight_decay = 0.f;
  const detail::AdamWCoeffs c = detail::adamw_coeffs(h, *s);
  if (kVec && r.param % 4 == 0 && r.grad % 4 == 0 && r.main % 4 == 0 && r.state % 4 == 0) {
    adamw_rem_range<true>(model + r.param, rem + r.main, g + r.grad, m + r.state, v + r.state, r.n, h, c,
                          threadIdx.x, blockDim.x);
  } else {
    adamw_rem_range<false>(model + r.param, rem + r.main, g + r.grad, m + r.state, v + r.state, r.n, h, c,
                           threadIdx.x, blockDim.x);
  }
}

/// split_param_remainders / merge_param_remainders, grid-stride. kVec: the fp32 array 16-byte
/// aligned, the 16-bit ones 8-byte aligned: four elements per access.
template <bool kVec>
__global__ void split_remainders_kernel(const float* __restrict__ x, uint16_t* __restrict__ hi,
                                        int16_t* __restrict__ rem, int64_t n) {
  const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t tail_begin = 0;
  if constexpr (kVec) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      const float4 q = reinterpret_cast<const float4*>(x)[i];
      const float p[4] = {q.x, q.y, q.z, q.w};
      uint16_t h[4], l[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        int16_t r;
        detail::split_f32_remainder(p[k], h[k], r);
        l[k] = static_cast<uint16_t>(r);
      }
      reinterpret_cast<uint2*>(hi)[i] = pack4(h);
      if (rem != nullptr) reinterpret_cast<uint2*>(rem)[i] = pack4(l);
    }
    tail_begin = n4 * 4;
  }
  for (int64_t i = tail_begin + tid; i < n; i += stride) {
    int16_t r;
    detail::split_f32_remainder(x[i], hi[i], r);
    if (rem != nullptr) rem[i] = r;
  }
}

template <bool kVec>
__global__ void merge_remainders_kernel(float* __restrict__ x, const uint16_t* __restrict__ hi,
                                        const int16_t* __restrict__ rem, int64_t n) {
  const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t tail_begin = 0;
  if constexpr (kVec) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      uint16_t h[4], l[4];
      unpack4(reinterpret_cast<const uint2*>(hi)[i], h);
      unpack4(reinterpret_cast<const uint2*>(rem)[i], l);
      float4 q;
      q.x = detail::merge_f32_remainder(h[0], static_cast<int16_t>(l[0]));
      q.y = detail::merge_f32_remainder(h[1], static_cast<int16_t>(l[1]));
      q.z = detail::merge_f32_remainder(h[2], static_cast<int16_t>(l[2]));
      q.w = detail::merge_f32_remainder(h[3], static_cast<int16_t>(l[3]));
      reinterpret_cast<float4*>(x)[i] = q;
    }
    tail_begin = n4 * 4;
  }
  for (int64_t i = tail_begin + tid; i < n; i += stride) x[i] = detail::merge_f32_remainder(hi[i], rem[i]);
}

template <typename P, bool kVec>
__global__ void __launch_bounds__(kAdamThreads)
    adamw_kernel(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
                 P* __restrict__ model, int64_t n, AdamWHyper h, const OptimizerScalars* s) {
  if (s->found_inf) return;  // skipped step: nothing written
  const detail::AdamWCoeffs c = detail::adamw_coeffs(h, *s);
  adamw_range<P, kVec>(p, g, m, v, model, n, h, c, blockIdx.x * int64_t(blockDim.x) + threadIdx.x,
                       int64_t(gridDim.x) * blockDim.x);
}

/// One block per chunk of an AdamWPlan. kVec: the bases are aligned as adamw_kernel's kVec needs;
/// a chunk whose offsets are not multiples of 4 takes the scalar path.
template <typename P, bool kVec>
__global__ void __launch_bounds__(kAdamThreads)
    adamw_multi_kernel(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                       float* __restrict__ v, P* __restrict__ model, const AdamWRun* __restrict__ chunks, AdamWHyper h,
                       const OptimizerScalars* s) {
  if (s->found_inf) return;
  const AdamWRun r = chunks[blockIdx.x];
  if (!r.decay) h.weight_decay = 0.f;
  const detail::AdamWCoeffs c = detail::adamw_coeffs(h, *s);
  P* mo = nullptr;
  if constexpr (!std::is_void_v<P>) mo = model + r.param;
  if (kVec && r.param % 4 == 0 && r.grad % 4 == 0 && r.main % 4 == 0 && r.state % 4 == 0) {
    adamw_range<P, true>(p + r.main, g + r.grad, m + r.state, v + r.state, mo, r.n, h, c, threadIdx.x, blockDim.x);
  } else {
    adamw_range<P, false>(p + r.main, g + r.grad, m + r.state, v + r.state, mo, r.n, h, c, threadIdx.x, blockDim.x);
  }
}

bool aligned(const void* q, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(q) % bytes == 0; }

/// The kVec condition of adamw_range: p, g, m, v 16-byte aligned, the model copy 8-byte aligned.
bool vectorisable(const void* p, const void* g, const void* m, const void* v, const void* model) {
  return aligned(p, 16) && aligned(g, 16) && aligned(m, 16) && aligned(v, 16) && aligned(model, 8);
}

/// Blocks of a grid-stride AdamW launch over `work` items: enough threads in flight to saturate
/// HBM (16 blocks of 256 per SM), fewer for small runs.
unsigned adamw_blocks(int64_t work) {
  return static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((work + kAdamThreads - 1) / kAdamThreads, 132 * 16)));
}

template <typename P>
void launch_adamw(float* p, const float* g, float* m, float* v, P* model, int64_t n, const AdamWHyper& h,
                  const OptimizerScalars* s, cudaStream_t st) {
  const bool vec = vectorisable(p, g, m, v, model);
  const unsigned blocks = adamw_blocks(vec ? (n + 3) / 4 : n);
  if (vec) {
    adamw_kernel<P, true><<<blocks, kAdamThreads, 0, st>>>(p, g, m, v, model, n, h, s);
  } else {
    adamw_kernel<P, false><<<blocks, kAdamThreads, 0, st>>>(p, g, m, v, model, n, h, s);
  }
}

template <typename P>
void launch_adamw_multi(float* p, const float* g, float* m, float* v, P* model, const AdamWPlan& plan,
                        const AdamWHyper& h, const OptimizerScalars* s, cudaStream_t st) {
  const bool vec = vectorisable(p, g, m, v, model);
  const unsigned blocks = static_cast<unsigned>(plan.chunks().size());
  const auto* chunks = static_cast<const AdamWRun*>(plan.table().data());
  if (vec) {
    adamw_multi_kernel<P, true><<<blocks, kAdamThreads, 0, st>>>(p, g, m, v, model, chunks, h, s);
  } else {
    adamw_multi_kernel<P, false><<<blocks, kAdamThreads, 0, st>>>(p, g, m, v, model, chunks, h, s);
  }
}

/// The kVec condition of adamw_rem_range: g, m, v 16-byte aligned, model and remainders 8-byte.
bool vectorisable_rem(const void* model, const void* rem, const void* g, const void* m, const void* v) {
  return aligned(model, 8) && aligned(rem, 8) && aligned(g, 16) && aligned(m, 16) && aligned(v, 16);
}

/// split_remainders_kernel / merge_remainders_kernel over n elements: four per thread and access
/// when the fp32 array is 16-byte and the 16-bit ones 8-byte aligned (rem may be null: aligned).
template <typename X, typename H, typename R>
void launch_remainders(void (*vec)(X, H, R, int64_t), void (*scalar)(X, H, R, int64_t), X x, H hi, R rem, int64_t n,
                       const Stream& stream) {
  const bool v4 = aligned(x, 16) && aligned(hi, 8) && aligned(rem, 8);
  const unsigned grid = grid_for(v4 ? (n + 3) / 4 : n, kAdamThreads);
  (v4 ? vec : scalar)<<<grid, kAdamThreads, 0, cu(stream)>>>(x, hi, rem, n);
  MT_CUDA_CHECK_LAUNCH();
}

/// Calls f(model) with the model copy's typed pointer: void* nullptr (fp32 training), bf16 or fp16.
template <typename F>
void with_model_copy(const Tensor& model_param, F&& f) {
  if (model_param.empty()) {
    f(static_cast<void*>(nullptr));
  } else if (model_param.dtype() == DType::kBF16) {
    f(model_param.data_as<__nv_bfloat16>());
  } else {
    f(model_param.data_as<__half>());
  }
}

}  // namespace

void grad_sumsq_accumulate(const Tensor& scalars, const Tensor& grads, const Stream& stream) {
  OptimizerScalars* s = scalars_ptr(scalars);
  const int64_t n = grads.numel();
  const float* g = grads.data_as<float>();
  if (reinterpret_cast<uintptr_t>(g) % 16 == 0) {
    sumsq_partial_kernel<true><<<kGradSumsqBlocks, kSumsqThreads, 0, cu(stream)>>>(s, g, n);
  } else {
    sumsq_partial_kernel<false><<<kGradSumsqBlocks, kSumsqThreads, 0, cu(stream)>>>(s, g, n);
  }
  MT_CUDA_CHECK_LAUNCH();
  sumsq_final_kernel<<<1, kGradSumsqBlocks, 0, cu(stream)>>>(s);
  MT_CUDA_CHECK_LAUNCH();
}

void optimizer_prepare(const Tensor& scalars, float clip_grad, const Stream& stream) {
  prepare_kernel<<<1, 1, 0, cu(stream)>>>(scalars_ptr(scalars), clip_grad);
  MT_CUDA_CHECK_LAUNCH();
}

void adamw_step(const Tensor& main_param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const Tensor& model_param, const AdamWHyper& hyper, const Tensor& scalars, const Stream& stream) {
  if (main_param.dtype() == DType::kI16) {  // remainder storage (model_param bf16, checked)
    auto* model = model_param.data_as<uint16_t>();
    auto* rem = main_param.data_as<int16_t>();
    const float* g = grad.data_as<float>();
    float *m = exp_avg.data_as<float>(), *v = exp_avg_sq.data_as<float>();
    const int64_t n = main_param.numel();
    const bool vec = vectorisable_rem(model, rem, g, m, v);
    const unsigned blocks = adamw_blocks(vec ? (n + 3) / 4 : n);
    if (vec) {
      adamw_rem_kernel<true><<<blocks, kAdamThreads, 0, cu(stream)>>>(model, rem, g, m, v, n, hyper,
                                                                      scalars_ptr(scalars));
    } else {
      adamw_rem_kernel<false><<<blocks, kAdamThreads, 0, cu(stream)>>>(model, rem, g, m, v, n, hyper,
                                                                       scalars_ptr(scalars));
    }
    MT_CUDA_CHECK_LAUNCH();
    return;
  }
  with_model_copy(model_param, [&](auto* model) {
    launch_adamw(main_param.data_as<float>(), grad.data_as<float>(), exp_avg.data_as<float>(),
                 exp_avg_sq.data_as<float>(), model, main_param.numel(), hyper, scalars_ptr(scalars), cu(stream));
  });
  MT_CUDA_CHECK_LAUNCH();
}

void adamw_multi_step(const Tensor& main_param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                      const Tensor& model_param, const AdamWPlan& plan, const AdamWHyper& hyper,
                      const Tensor& scalars, const Stream& stream) {
  if (main_param.dtype() == DType::kI16) {  // remainder storage (model_param bf16, checked)
    auto* model = model_param.data_as<uint16_t>();
    auto* rem = main_param.data_as<int16_t>();
    const float* g = grad.data_as<float>();
    float *m = exp_avg.data_as<float>(), *v = exp_avg_sq.data_as<float>();
    const unsigned blocks = static_cast<unsigned>(plan.chunks().size());
    const auto* chunks = static_cast<const AdamWRun*>(plan.table().data());
    if (vectorisable_rem(model, rem, g, m, v)) {
      adamw_multi_rem_kernel<true><<<blocks, kAdamThreads, 0, cu(stream)>>>(model, rem, g, m, v, chunks, hyper,
                                                                            scalars_ptr(scalars));
    } else {
      adamw_multi_rem_kernel<false><<<blocks, kAdamThreads, 0, cu(stream)>>>(model, rem, g, m, v, chunks, hyper,
                                                                             scalars_ptr(scalars));
    }
    MT_CUDA_CHECK_LAUNCH();
    return;
  }
  with_model_copy(model_param, [&](auto* model) {
    launch_adamw_multi(main_param.data_as<float>(), grad.data_as<float>(), exp_avg.data_as<float>(),
                       exp_avg_sq.data_as<float>(), model, plan, hyper, scalars_ptr(scalars), cu(stream));
  });
  MT_CUDA_CHECK_LAUNCH();
}

void split_param_remainders(const Tensor& main_param, const Tensor& model_param, const Tensor& remainders,
                            const Stream& stream) {
  launch_remainders(split_remainders_kernel<true>, split_remainders_kernel<false>, main_param.data_as<const float>(),
                    model_param.data_as<uint16_t>(), remainders.empty() ? nullptr : remainders.data_as<int16_t>(),
                    main_param.numel(), stream);
}

void merge_param_remainders(const Tensor& main_param, const Tensor& model_param, const Tensor& remainders,
                            const Stream& stream) {
  launch_remainders(merge_remainders_kernel<true>, merge_remainders_kernel<false>, main_param.data_as<float>(),
                    model_param.data_as<const uint16_t>(), remainders.data_as<const int16_t>(), main_param.numel(),
                    stream);
}

void loss_scaler_update(const Tensor& scalars, const LossScalerConfig& cfg, const Stream& stream) {
  scaler_kernel<<<1, 1, 0, cu(stream)>>>(scalars_ptr(scalars), cfg);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
