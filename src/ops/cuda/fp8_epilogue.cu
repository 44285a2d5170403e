// CUDA ops/fp8_epilogue.h: one grid-stride element-wise kernel, fp32 math.
#include "ops/cuda/elementwise_common.cuh"
#include "ops/fp8_epilogue.h"
#include "ops/gelu_math.h"

namespace mt::cuda {
namespace {

template <typename T>
__global__ void bias_gelu_kernel(T* y, const T* bias, T* act, int64_t total, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    float v = ew::to_f32(y[i]);
    if (bias != nullptr) {
      const T r = ew::from_f32<T>(v + ew::to_f32(bias[i % n]));
      y[i] = r;
      v = ew::to_f32(r);  // the GELU of the stored value, as the CPU computes it
    }
    if (act != nullptr) act[i] = ew::from_f32<T>(gelu_math::gelu(v));
  }
}

}  // namespace

void fp8_bias_gelu(const Tensor& y, const Tensor& bias, const Tensor& act, const Stream& stream) {
  const int64_t total = y.numel(), n = y.size(-1);
  if (total == 0) return;
  ew::dispatch_float(y.dtype(), "fp8_bias_gelu", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* b = bias.empty() ? nullptr : static_cast<const T*>(bias.data());
    T* a = act.empty() ? nullptr : static_cast<T*>(act.data());
    bias_gelu_kernel<T><<<ew::grid_for(total, 256, stream), 256, 0, ew::raw(stream)>>>(static_cast<T*>(y.data()), b, a,
                                                                                       total, n);
    MT_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mt::cuda
