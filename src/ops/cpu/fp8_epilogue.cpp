// CPU reference of ops/fp8_epilogue.h (fp32).
#include "ops/fp8_epilogue.h"

#include "ops/gelu_math.h"

namespace mt::cpu {

void fp8_bias_gelu(const Tensor& y, const Tensor& bias, const Tensor& act, const Stream&) {
  const int64_t n = y.size(-1), rows = y.numel() / n;
  float* pv = y.data_as<float>();
  const float* b = bias.empty() ? nullptr : bias.data_as<float>();
  float* a = act.empty() ? nullptr : act.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      float v = pv[r * n + c];
      if (b) pv[r * n + c] = v = v + b[c];
      if (a) a[r * n + c] = gelu_math::gelu(v);
    }
  }
}

}  // namespace mt::cpu
