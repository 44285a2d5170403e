// CPU reference of ops/gelu.h (fp32).
#include "ops/gelu_math.h"
#include "ops/gelu.h"

namespace mt::cpu {

void gelu_forward(const Tensor& y, const Tensor& x, const Stream& stream) {
  const int64_t n = x.numel();
  float* py = y.data_as<float>();
  const float* px = x.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) py[i] = gelu_math::gelu(px[i]);
}

void gelu_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const Stream& stream) {
  const int64_t n = x.numel();
  float* pdx = dx.data_as<float>();
  const float* pdy = dy.data_as<float>();
  const float* px = x.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) pdx[i] = pdy[i] * gelu_math::gelu_grad(px[i]);
}

}  // namespace mt::cpu
