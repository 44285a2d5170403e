// CPU reference of ops/elementwise.h: fp32 math; cast/add/scale/fill also handle bf16/fp16
// storage (round to nearest even through core/dtype.h). Dropout ops are fp32 (validated).
#include <algorithm>
#include <cstring>

#include "core/rng.h"
#include "ops/cpu/dtype_codec.h"
#include "ops/elementwise.h"

namespace mt::cpu {
namespace {

/// Shared core of the dropout ops. For every local flat index l < n (global g = offset + l):
///   v = x[l] (+ bias[l % h]);  v = keep(g) ? v * scale : 0;  (+ residual[l]);  out[l] = v.
/// One Philox call per group of 4 global indices (g >> 2), exactly as the CUDA kernel.
void dropout_core(float* out, const float* x, const float* bias, int64_t h, const float* residual, int64_t n,
                  float p, const DropoutKey& key, int64_t offset) {
  if (n == 0) return;
  if (p == 0.f) {  // identity: draws nothing
#pragma omp parallel for schedule(static)
    for (int64_t l = 0; l < n; ++l) {
      float v = x[l];
      if (bias) v += bias[l % h];
      if (residual) v += residual[l];
      out[l] = v;
    }
    return;
  }
  const uint32_t threshold = dropout_threshold(p);
  const float scale = 1.0f / (1.0f - p);
  const int64_t g_first = offset >> 2;
  const int64_t g_last = (offset + n - 1) >> 2;
  const uint64_t iteration = key.current_iteration();
  const uint32_t microbatch = key.current_microbatch();
#pragma omp parallel for schedule(static)
  for (int64_t grp = g_first; grp <= g_last; ++grp) {
    const Philox4 r = dropout_bits4(key.seed, key.stream_id, iteration, microbatch, static_cast<uint64_t>(grp));
    for (int j = 0; j < 4; ++j) {
      const int64_t l = grp * 4 + j - offset;
      if (l < 0 || l >= n) continue;
      float v = x[l];
      if (bias) v += bias[l % h];
      v = r.v[j] >= threshold ? v * scale : 0.f;
      if (residual) v += residual[l];
      out[l] = v;
    }
  }
}

/// dst[c] += sum_r src[r, c] over src [n, h], fp32; deterministic (fixed order, independent of
/// the thread count: threads split the columns).
void column_sum_accumulate(float* dst, const float* src, int64_t n, int64_t h) {
  constexpr int64_t kBlock = 64;
  const int64_t nblocks = (h + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t cb = 0; cb < nblocks; ++cb) {
    const int64_t c0 = cb * kBlock, c1 = std::min(h, c0 + kBlock);
    float acc[kBlock] = {};
    for (int64_t r = 0; r < n; ++r) {
      const float* row = src + r * h;
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += row[c];
    }
    for (int64_t c = c0; c < c1; ++c) dst[c] += acc[c - c0];
  }
}

}  // namespace

void cast(const Tensor& dst, const Tensor& src, const Stream& stream) {
  const int64_t n = dst.numel();
  if (dst.dtype() == src.dtype()) {
    if (n > 0 && dst.data() != src.data()) std::memmove(dst.data(), src.data(), dst.nbytes());
    return;
  }
  dispatch_codec(dst.dtype(), "cast", [&](auto dc) {
    using D = decltype(dc);
    dispatch_codec(src.dtype(), "cast", [&](auto sc) {
      using S = decltype(sc);
      auto* d = static_cast<typename D::storage*>(dst.data());
      const auto* s = static_cast<const typename S::storage*>(src.data());
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) d[i] = D::store(S::load(s[i]));
    });
  });
}

void add(const Tensor& y, const Tensor& a, const Tensor& b, const Stream& stream) {
  const int64_t n = y.numel();
  dispatch_codec(y.dtype(), "add", [&](auto codec) {
    using C = decltype(codec);
    using S = typename C::storage;
    auto* py = static_cast<S*>(y.data());
    const auto* pa = static_cast<const S*>(a.data());
    const auto* pb = static_cast<const S*>(b.data());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) py[i] = C::store(C::load(pa[i]) + C::load(pb[i]));
  });
}

void scale_inplace(const Tensor& x, float alpha, const Stream& stream) {
  const int64_t n = x.numel();
  dispatch_codec(x.dtype(), "scale_inplace", [&](auto codec) {
    using C = decltype(codec);
    auto* px = static_cast<typename C::storage*>(x.data());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) px[i] = C::store(C::load(px[i]) * alpha);
  });
}

void fill(const Tensor& x, float value, const Stream& stream) {
  const int64_t n = x.numel();
  if (x.dtype() == DType::kI32) {
    std::fill_n(x.data_as<int32_t>(), n, static_cast<int32_t>(value));
    return;
  }
  dispatch_codec(x.dtype(), "fill", [&](auto codec) {
    using C = decltype(codec);
    std::fill_n(static_cast<typename C::storage*>(x.data()), n, C::store(value));
  });
}

void bias_dropout_add_forward(const Tensor& out, const Tensor& x, const Tensor& bias, const Tensor& residual,
                              float p, const DropoutKey& key, int64_t global_offset, const Stream& stream) {
  const int64_t h = bias.empty() ? 1 : bias.numel();
  dropout_core(out.data_as<float>(), x.data_as<float>(), bias.empty() ? nullptr : bias.data_as<float>(), h,
               residual.data_as<float>(), out.numel(), p, key, global_offset);
}

void bias_dropout_add_backward(const Tensor& dx, const Tensor& dbias, const Tensor& dout, float p,
                               const DropoutKey& key, int64_t global_offset, const Stream& stream) {
  // dx = mask(dout) (dx may alias dout: element-wise), then dbias += column sums of dx (of dout
  // when dx is empty: p = 0, dx would equal dout).
  if (!dx.empty())
    dropout_core(dx.data_as<float>(), dout.data_as<float>(), nullptr, 1, nullptr, dx.numel(), p, key, global_offset);
  const Tensor& g = dx.empty() ? dout : dx;
  if (!dbias.empty() && g.numel() > 0) {
    const int64_t h = dbias.numel();
    column_sum_accumulate(dbias.data_as<float>(), g.data_as<float>(), g.numel() / h, h);
  }
}

void dropout_forward(const Tensor& y, const Tensor& x, float p, const DropoutKey& key, int64_t global_offset,
                     const Stream& stream) {
  dropout_core(y.data_as<float>(), x.data_as<float>(), nullptr, 1, nullptr, y.numel(), p, key, global_offset);
}

}  // namespace mt::cpu
