// CPU reference of ops/layernorm.h: fp32, two-pass statistics (mean, then centred variance).
#include <algorithm>
#include <cmath>

#include "ops/layernorm.h"

namespace mt::cpu {

void layernorm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& weight, const Tensor& bias, float eps, const Stream& stream,
                       bool zero_centered_gamma) {
  const int64_t h = x.size(-1);
  const int64_t n = x.numel() / h;
  const float* px = x.data_as<float>();
  const float* pw = weight.data_as<float>();
  // The scale of column c: the weight, or 1 + weight (fp32) with zero_centered_gamma.
  const auto w = [pw, zero_centered_gamma](int64_t c) { return zero_centered_gamma ? pw[c] + 1.f : pw[c]; };
  const float* pb = bias.data_as<float>();
  float* py = y.data_as<float>();
  float* pm = mean.data_as<float>();
  float* pr = rstd.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = px + r * h;
    float s = 0.f;
    for (int64_t c = 0; c < h; ++c) s += xr[c];
    const float m = s / static_cast<float>(h);
    float v = 0.f;
    for (int64_t c = 0; c < h; ++c) {
      const float d = xr[c] - m;
      v += d * d;
    }
    const float rs = 1.0f / std::sqrt(v / static_cast<float>(h) + eps);
    float* yr = py + r * h;  // may alias x: each element is read before it is written
    for (int64_t c = 0; c < h; ++c) yr[c] = (xr[c] - m) * rs * w(c) + pb[c];
    pm[r] = m;
    pr[r] = rs;
  }
}

void layernorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                        const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                        bool accumulate_dx, const Stream& stream, bool zero_centered_gamma) {
  const int64_t h = x.size(-1);
  const int64_t n = x.numel() / h;
  const float* px = x.data_as<float>();
  const float* pdy = dy.data_as<float>();
  const float* pw = weight.data_as<float>();
  // The scale of column c: the weight, or 1 + weight (fp32) with zero_centered_gamma.
  const auto w = [pw, zero_centered_gamma](int64_t c) { return zero_centered_gamma ? pw[c] + 1.f : pw[c]; };
  const float* pm = mean.data_as<float>();
  const float* pr = rstd.data_as<float>();
  float* pdx = dx.data_as<float>();
  float* pdw = dweight.data_as<float>();
  float* pdb = dbias.data_as<float>();

  // 1) dweight += sum_r dy * xhat, dbias += sum_r dy. Threads split the columns (deterministic);
  //    done before dx is written so that dx may alias dy.
  constexpr int64_t kBlock = 64;
  const int64_t nblocks = (h + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t cb = 0; cb < nblocks; ++cb) {
    const int64_t c0 = cb * kBlock, c1 = std::min(h, c0 + kBlock);
    float acc_w[kBlock] = {};
    float acc_b[kBlock] = {};
    for (int64_t r = 0; r < n; ++r) {
      const float* xr = px + r * h;
      const float* dyr = pdy + r * h;
      const float m = pm[r], rs = pr[r];
      for (int64_t c = c0; c < c1; ++c) {
        acc_w[c - c0] += dyr[c] * ((xr[c] - m) * rs);
        acc_b[c - c0] += dyr[c];
      }
    }
    for (int64_t c = c0; c < c1; ++c) {
      pdw[c] += acc_w[c - c0];
      pdb[c] += acc_b[c - c0];
    }
  }

  // 2) dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * weight.
  const float inv_h = 1.0f / static_cast<float>(h);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = px + r * h;
    const float* dyr = pdy + r * h;
    const float m = pm[r], rs = pr[r];
    float sum_g = 0.f, sum_gx = 0.f;
    for (int64_t c = 0; c < h; ++c) {
      const float g = dyr[c] * w(c);
      sum_g += g;
      sum_gx += g * ((xr[c] - m) * rs);
    }
    const float mg = sum_g * inv_h, mgx = sum_gx * inv_h;
    float* dxr = pdx + r * h;
    for (int64_t c = 0; c < h; ++c) {
      const float xhat = (xr[c] - m) * rs;
      const float v = rs * (dyr[c] * w(c) - mg - xhat * mgx);
      dxr[c] = accumulate_dx ? dxr[c] + v : v;
    }
  }
}

}  // namespace mt::cpu
