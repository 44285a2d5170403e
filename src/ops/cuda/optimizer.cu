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
  if (kVec && r.param % 4 == 0 && r.main % 4 == 0 && r.state % 4 == 0) {
    adamw_range<P, true>(p + r.main, g + r.param, m + r.state, v + r.state, mo, r.n, h, c, threadIdx.x, blockDim.x);
  } else {
    adamw_range<P, false>(p + r.main, g + r.param, m + r.state, v + r.state, mo, r.n, h, c, threadIdx.x, blockDim.x);
  }
}

/// The kVec condition of adamw_range: p, g, m, v 16-byte aligned, the model copy 8-byte aligned.
bool vectorisable(const void* p, const void* g, const void* m, const void* v, const void* model) {
  auto aligned = [](const void* q, uintptr_t a) { return reinterpret_cast<uintptr_t>(q) % a == 0; };
  return aligned(p, 16) && aligned(g, 16) && aligned(m, 16) && aligned(v, 16) && aligned(model, 8);
}

template <typename P>
void launch_adamw(float* p, const float* g, float* m, float* v, P* model, int64_t n, const AdamWHyper& h,
                  const OptimizerScalars* s, cudaStream_t st) {
  const bool vec = vectorisable(p, g, m, v, model);
  const int64_t work = vec ? (n + 3) / 4 : n;
  // enough threads in flight to saturate HBM (16 blocks of 256 per SM), fewer for small runs
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((work + kAdamThreads - 1) / kAdamThreads, 132 * 16)));
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
  with_model_copy(model_param, [&](auto* model) {
    launch_adamw(main_param.data_as<float>(), grad.data_as<float>(), exp_avg.data_as<float>(),
                 exp_avg_sq.data_as<float>(), model, main_param.numel(), hyper, scalars_ptr(scalars), cu(stream));
  });
  MT_CUDA_CHECK_LAUNCH();
}

void adamw_multi_step(const Tensor& main_param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                      const Tensor& model_param, const AdamWPlan& plan, const AdamWHyper& hyper,
                      const Tensor& scalars, const Stream& stream) {
  with_model_copy(model_param, [&](auto* model) {
    launch_adamw_multi(main_param.data_as<float>(), grad.data_as<float>(), exp_avg.data_as<float>(),
                       exp_avg_sq.data_as<float>(), model, plan, hyper, scalars_ptr(scalars), cu(stream));
  });
  MT_CUDA_CHECK_LAUNCH();
}

void loss_scaler_update(const Tensor& scalars, const LossScalerConfig& cfg, const Stream& stream) {
  scaler_kernel<<<1, 1, 0, cu(stream)>>>(scalars_ptr(scalars), cfg);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
