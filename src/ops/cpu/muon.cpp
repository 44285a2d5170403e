// CPU reference of ops/muon.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/muon.h"
#include "ops/optimizer.h"

namespace mt::cpu {

void muon_momentum(const Tensor& u, const Tensor& grad, const Tensor& momentum, float beta, bool nesterov,
                   const Tensor& scalars, const Stream&) {
  const auto& s = *static_cast<const OptimizerScalars*>(scalars.data());
  const int64_t n = grad.numel();
  float* out = u.data_as<float>();
  const float* g = grad.data_as<float>();
  float* m = momentum.data_as<float>();
  if (s.found_inf) {
    std::fill(out, out + n, 0.f);
    return;
  }
  const float inv_scale = 1.f / s.loss_scale, clip = s.clip_coeff;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = detail::muon_momentum_element(g[i], m[i], beta, nesterov, inv_scale, clip);
}

void muon_sumsq(const Tensor& scratch, const Tensor& x, const Stream&) {
  // Fixed chunks in parallel, chunk sums added in index order (independent of the thread count).
  const int64_t n = x.numel();
  constexpr int64_t kChunk = 8192;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(static_cast<size_t>(chunks));
  const bool bf16 = x.dtype() == DType::kBF16;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    double acc = 0;
    for (int64_t i = c * kChunk, end = std::min(n, (c + 1) * kChunk); i < end; ++i) {
      const double v = bf16 ? bf16_bits_to_f32(x.data_as<uint16_t>()[i]) : x.data_as<float>()[i];
      acc += v * v;
    }
    part[static_cast<size_t>(c)] = acc;
  }
  double total = 0;
  for (double p : part) total += p;
  scratch.data_as<float>()[0] = static_cast<float>(total);
}

void muon_normalize(const Tensor& y, const Tensor& x, const Tensor& scratch, float eps, const Stream&) {
  const float inv = 1.f / std::max(std::sqrt(scratch.data_as<float>()[0]), eps);
  const int64_t n = x.numel();
  const float* in = x.data_as<float>();
  if (y.dtype() == DType::kF32) {
    float* out = y.data_as<float>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) out[i] = in[i] * inv;
  } else {
    uint16_t* out = y.data_as<uint16_t>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16_bits(in[i] * inv);
  }
}

void muon_copy_2d(const Tensor& dst, int64_t dst_stride, const Tensor& src, int64_t src_stride, int64_t rows,
                  int64_t cols, const Stream&) {
  const size_t es = dtype_size(dst.dtype());
  char* d = static_cast<char*>(dst.data());
  const char* s = static_cast<const char*>(src.data());
  for (int64_t r = 0; r < rows; ++r)
    std::memmove(d + static_cast<size_t>(r * dst_stride) * es, s + static_cast<size_t>(r * src_stride) * es,
                 static_cast<size_t>(cols) * es);
}

}  // namespace mt::cpu
