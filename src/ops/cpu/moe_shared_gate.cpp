// CPU reference of ops/moe.h moe_shared_gate_forward / _backward (--moe-shared-expert-gate).
#include <cmath>

#include "ops/moe.h"

namespace mt::cpu {
namespace {
double sigmoid(float x) { return 1.0 / (1.0 + std::exp(-static_cast<double>(x))); }
// dx[i] += d_logit · w[i]: one expression for the whole backward and its dx part alone (bitwise alike)
void gate_dx_row(float* dx, float d_logit, const float* w, int64_t h) {
  for (int64_t i = 0; i < h; ++i) dx[i] += d_logit * w[i];
}
}  // namespace

void moe_shared_gate_forward(const Tensor& y, const Tensor& logits, const Tensor& ys, const Tensor& x, const Tensor& w,
                             const Stream&) {
  const int64_t T = ys.size(0), h = ys.size(1);
  float* Y = y.data_as<float>();  // the CPU's act dtype is fp32 (ops/op_checks.h)
  float* L = logits.data_as<float>();
  const float* S = ys.data_as<float>();
  const float* X = x.data_as<float>();
  const float* W = w.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    double l = 0;
    for (int64_t i = 0; i < h; ++i) l += static_cast<double>(X[t * h + i]) * W[i];
    L[t] = static_cast<float>(l);
    const float g = static_cast<float>(sigmoid(L[t]));
    for (int64_t i = 0; i < h; ++i) Y[t * h + i] += g * S[t * h + i];
  }
}

void moe_shared_gate_backward(const Tensor& d_ys, const Tensor& d_logits, const Tensor& dx, const Tensor& dw,
                              const Tensor& dy, const Tensor& ys, const Tensor& x, const Tensor& w,
                              const Tensor& logits, const Stream&) {
  const int64_t T = ys.size(0), h = ys.size(1);
  float* dS = d_ys.data_as<float>();
  float* dL = d_logits.data_as<float>();
  float* dX = dx.empty() ? nullptr : dx.data_as<float>();
  float* dW = dw.data_as<float>();
  const float* dY = dy.data_as<float>();
  const float* S = ys.data_as<float>();
  const float* X = x.data_as<float>();
  const float* W = w.data_as<float>();
  const float* L = logits.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const double g = sigmoid(L[t]);
    const float gf = static_cast<float>(g);
    double dot = 0;
    for (int64_t i = 0; i < h; ++i) {
      dot += static_cast<double>(dY[t * h + i]) * S[t * h + i];
      dS[t * h + i] = gf * dY[t * h + i];
    }
    dL[t] = static_cast<float>(g * (1.0 - g) * dot);
    if (dX) gate_dx_row(dX + t * h, dL[t], W, h);
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < h; ++i) {
    double s = 0;
    for (int64_t t = 0; t < T; ++t) s += static_cast<double>(dL[t]) * X[t * h + i];
    dW[i] = static_cast<float>(static_cast<double>(dW[i]) + s);
  }
}

void moe_shared_gate_backward_dx(const Tensor& dx, const Tensor& d_logits, const Tensor& w, const Stream&) {
  const int64_t T = dx.size(0), h = dx.size(1);
  float* dX = dx.data_as<float>();
  const float* dL = d_logits.data_as<float>();
  const float* W = w.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) gate_dx_row(dX + t * h, dL[t], W, h);
}

}  // namespace mt::cpu
