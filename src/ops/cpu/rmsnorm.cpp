// CPU reference of ops/rmsnorm.h: fp32, rows addressed through ops/row_map.h.
#include <algorithm>
#include <cmath>

#include "ops/rmsnorm.h"
#include "ops/row_map.h"

namespace mt::cpu {

void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& weight, float eps,
                     const Stream& stream, bool zero_centered_gamma) {
  const int64_t h = x.size(-1);
  const RowMap mx = row_map(x, "rmsnorm_forward"), my = row_map(y, "rmsnorm_forward");
  const int64_t n = mx.rows;
  const float* px = x.data_as<float>();
  const float* pw = weight.data_as<float>();
  // The scale of column c: the weight, or 1 + weight (fp32) with zero_centered_gamma.
  const auto w = [pw, zero_centered_gamma](int64_t c) { return zero_centered_gamma ? pw[c] + 1.f : pw[c]; };
  float* py = y.data_as<float>();
  float* pr = rstd.data_as<float>();
  const float inv_h = 1.0f / static_cast<float>(h);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = px + mx.offset(r);
    float ss = 0.f;
    for (int64_t c = 0; c < h; ++c) ss += xr[c] * xr[c];
    const float rs = 1.0f / std::sqrt(ss * inv_h + eps);
    float* yr = py + my.offset(r);  // may alias xr: each element is read before it is written
    for (int64_t c = 0; c < h; ++c) yr[c] = xr[c] * rs * w(c);
    pr[r] = rs;
  }
}

void rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dy, const Tensor& x,
                      const Tensor& weight, const Tensor& rstd, bool accumulate_dx, const Stream& stream,
                      bool zero_centered_gamma) {
  const int64_t h = x.size(-1);
  const char* fn = "rmsnorm_backward";
  const RowMap mx = row_map(x, fn), mdx = row_map(dx, fn), mdy = row_map(dy, fn);
  const int64_t n = mx.rows;
  const float* px = x.data_as<float>();
  const float* pdy = dy.data_as<float>();
  const float* pw = weight.data_as<float>();
  // The scale of column c: the weight, or 1 + weight (fp32) with zero_centered_gamma.
  const auto w = [pw, zero_centered_gamma](int64_t c) { return zero_centered_gamma ? pw[c] + 1.f : pw[c]; };
  const float* pr = rstd.data_as<float>();
  float* pdx = dx.data_as<float>();
  float* pdw = dweight.data_as<float>();

  // 1) dweight += sum_r dy * x * rstd. Threads split the columns (deterministic); done before dx
  //    is written so that dx may alias dy.
  constexpr int64_t kBlock = 64;
  const int64_t nblocks = (h + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t cb = 0; cb < nblocks; ++cb) {
    const int64_t c0 = cb * kBlock, c1 = std::min(h, c0 + kBlock);
    float acc[kBlock] = {};
    for (int64_t r = 0; r < n; ++r) {
      const float* xr = px + mx.offset(r);
      const float* dyr = pdy + mdy.offset(r);
      const float rs = pr[r];
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += dyr[c] * (xr[c] * rs);
    }
    for (int64_t c = c0; c < c1; ++c) pdw[c] += acc[c - c0];
  }

  // 2) dx = rstd * (g - xhat * mean(g * xhat)), g = dy * weight, xhat = x * rstd.
  const float inv_h = 1.0f / static_cast<float>(h);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = px + mx.offset(r);
    const float* dyr = pdy + mdy.offset(r);
    const float rs = pr[r];
    float sum_gx = 0.f;
    for (int64_t c = 0; c < h; ++c) sum_gx += (dyr[c] * w(c)) * (xr[c] * rs);
    const float mgx = sum_gx * inv_h;
    float* dxr = pdx + mdx.offset(r);  // may alias dyr: each element is read before it is written
    for (int64_t c = 0; c < h; ++c) {
      const float v = rs * (dyr[c] * w(c) - (xr[c] * rs) * mgx);
      dxr[c] = accumulate_dx ? dxr[c] + v : v;
    }
  }
}

}  // namespace mt::cpu
