// CPU reference of ops/moe.h moe_router_logits_fp64 and its backward (--moe-router-dtype fp64):
// plain loops in double, every sum in ascending order (the CUDA kernels use the same order).
#include "ops/moe.h"

namespace mt::cpu {

void moe_router_logits_fp64(const Tensor& logits, const Tensor& x, const Tensor& w, const Stream&) {
  const int64_t T = x.size(0), h = x.size(1), E = w.size(0);
  const float* X = x.data_as<float>();  // the CPU's act dtype is fp32 (ops/op_checks.h)
  const float* W = w.data_as<float>();
  double* L = logits.data_as<double>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (int64_t i = 0; i < h; ++i) s += static_cast<double>(X[t * h + i]) * static_cast<double>(W[e * h + i]);
      L[t * E + e] = s;
    }
}

void moe_router_logits_fp64_backward(const Tensor& dx, const Tensor& dw, const Tensor& d_logits, const Tensor& x,
                                     const Tensor& w, const Stream&) {
  const int64_t T = x.size(0), h = x.size(1), E = w.size(0);
  const float* X = x.data_as<float>();
  const float* W = w.data_as<float>();
  const double* dL = d_logits.data_as<double>();
  if (!dx.empty()) {
    float* dX = dx.data_as<float>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < h; ++i) {
        double s = 0;
        for (int64_t e = 0; e < E; ++e) s += dL[t * E + e] * static_cast<double>(W[e * h + i]);
        dX[t * h + i] = static_cast<float>(static_cast<double>(dX[t * h + i]) + s);
      }
  }
  if (!dw.empty()) {
    float* dW = dw.data_as<float>();
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < h; ++i) {
        double s = 0;
        for (int64_t t = 0; t < T; ++t) s += dL[t * E + e] * static_cast<double>(X[t * h + i]);
        dW[e * h + i] = static_cast<float>(static_cast<double>(dW[e * h + i]) + s);
      }
  }
}

}  // namespace mt::cpu
