// CPU reference of ops/swiglu.h (fp32).
#include "ops/swiglu.h"
#include "ops/swiglu_math.h"

namespace mt::cpu {

void swiglu_forward(const Tensor& y, const Tensor& x, const Stream& stream) {
  const int64_t f = y.size(-1);
  const int64_t n = f > 0 ? y.numel() / f : 0;
  const float* px = x.data_as<float>();
  float* py = y.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* a = px + r * 2 * f;
    const float* b = a + f;
    float* yr = py + r * f;
    for (int64_t j = 0; j < f; ++j) yr[j] = swiglu_math::swiglu(a[j], b[j]);
  }
}

void swiglu_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const Stream& stream) {
  const int64_t f = dy.size(-1);
  const int64_t n = f > 0 ? dy.numel() / f : 0;
  const float* px = x.data_as<float>();
  const float* pdy = dy.data_as<float>();
  float* pdx = dx.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* a = px + r * 2 * f;
    const float* b = a + f;
    const float* g = pdy + r * f;
    float* da = pdx + r * 2 * f;
    float* db = da + f;
    for (int64_t j = 0; j < f; ++j) {
      da[j] = swiglu_math::swiglu_grad_gate(g[j], a[j], b[j]);
      db[j] = swiglu_math::swiglu_grad_linear(g[j], a[j]);
    }
  }
}

}  // namespace mt::cpu
