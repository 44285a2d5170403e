// CPU reference of ops/cross_entropy.h: one row at a time (OpenMP over rows), fp32 math with
// double accumulation of the exp-sums. Logits may be fp32, bf16 or fp16 (converted on load,
// rounded on store).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "ops/cpu/dtype_codec.h"
#include "ops/cross_entropy.h"

namespace mt::cpu {
namespace {

/// Fixed-order sum of x[0, n) in double: fixed chunks summed in parallel, chunk sums added in
/// index order, so the result does not depend on the number of threads.
double deterministic_sum(const float* x, int64_t n) {
  constexpr int64_t kChunk = 4096;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    double s = 0;
    const int64_t end = std::min(n, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; ++i) s += x[i];
    part[c] = s;
  }
  double total = 0;
  for (double p : part) total += p;
  return total;
}

}  // namespace

void cross_entropy_stats(const Tensor& row_max, const Tensor& row_sumexp, const Tensor& target_logit,
                         const Tensor& logits, const Tensor& targets, int64_t vocab_start, int64_t valid_cols,
                         const Stream&) {
  const int64_t m = logits.size(0), v = logits.size(1), nv = valid_cols;
  float* mx_out = row_max.data_as<float>();
  float* se_out = row_sumexp.data_as<float>();
  float* tl_out = target_logit.data_as<float>();
  const int32_t* tg = targets.data_as<int32_t>();
  dispatch_codec(logits.dtype(), "cross_entropy logits", [&](auto io) {
    using Io = decltype(io);
    const auto* x = logits.data_as<typename Io::storage>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      const auto* row = x + r * v;
      float mx = -INFINITY;
      for (int64_t j = 0; j < nv; ++j) mx = std::max(mx, Io::load(row[j]));
      double se = 0;
      for (int64_t j = 0; j < nv; ++j) se += std::exp(Io::load(row[j]) - mx);
      const int64_t t = static_cast<int64_t>(tg[r]) - vocab_start;
      mx_out[r] = mx;
      se_out[r] = static_cast<float>(se);
      tl_out[r] = (t >= 0 && t < nv) ? Io::load(row[t]) : 0.f;
    }
  });
}

void cross_entropy_rescale_sumexp(const Tensor& row_sumexp, const Tensor& local_max, const Tensor& global_max,
                                  const Stream&) {
  const int64_t m = row_sumexp.numel();
  float* se = row_sumexp.data_as<float>();
  const float* lm = local_max.data_as<float>();
  const float* gm = global_max.data_as<float>();
  for (int64_t r = 0; r < m; ++r) se[r] = se[r] == 0.f ? 0.f : se[r] * std::exp(lm[r] - gm[r]);
}

void cross_entropy_loss(const Tensor& losses, const Tensor& row_max, const Tensor& row_sumexp,
                        const Tensor& target_logit, const Tensor& loss_mask, const Stream&) {
  const int64_t m = losses.numel();
  float* out = losses.data_as<float>();
  const float* mx = row_max.data_as<float>();
  const float* se = row_sumexp.data_as<float>();
  const float* tl = target_logit.data_as<float>();
  const float* mask = loss_mask.empty() ? nullptr : loss_mask.data_as<float>();
  for (int64_t r = 0; r < m; ++r) {
    const float l = std::log(se[r]) + mx[r] - tl[r];
    out[r] = mask ? l * mask[r] : l;
  }
}

void cross_entropy_backward_inplace(const Tensor& logits, const Tensor& targets, const Tensor& row_max,
                                    const Tensor& row_sumexp, const Tensor& loss_mask, int64_t vocab_start,
                                    int64_t valid_cols, float grad_scale, const Tensor& device_scale, const Stream&) {
  if (!device_scale.empty()) grad_scale *= device_scale.data_as<float>()[0];
  const int64_t m = logits.size(0), v = logits.size(1);
  const int32_t* tg = targets.data_as<int32_t>();
  const float* mxp = row_max.data_as<float>();
  const float* sep = row_sumexp.data_as<float>();
  const float* mask = loss_mask.empty() ? nullptr : loss_mask.data_as<float>();
  dispatch_codec(logits.dtype(), "cross_entropy logits", [&](auto io) {
    using Io = decltype(io);
    auto* x = logits.data_as<typename Io::storage>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      auto* row = x + r * v;
      const float mx = mxp[r];
      const float inv = 1.f / sep[r];
      const float scale = mask ? grad_scale * mask[r] : grad_scale;
      const int64_t t = static_cast<int64_t>(tg[r]) - vocab_start;
      for (int64_t j = 0; j < valid_cols; ++j) {
        const float p = std::exp(Io::load(row[j]) - mx) * inv;
        row[j] = Io::store((p - (j == t ? 1.f : 0.f)) * scale);
      }
      for (int64_t j = valid_cols; j < v; ++j) row[j] = Io::store(0.f);
    }
  });
}

void cross_entropy_forward_backward_inplace(const Tensor& row_max, const Tensor& row_sumexp,
                                            const Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                                            const Tensor& loss_mask, int64_t valid_cols, float grad_scale,
                                            const Tensor& device_scale, const Stream& stream) {
  cpu::cross_entropy_stats(row_max, row_sumexp, target_logit, logits, targets, 0, valid_cols, stream);
  cpu::cross_entropy_backward_inplace(logits, targets, row_max, row_sumexp, loss_mask, 0, valid_cols, grad_scale,
                                 device_scale, stream);
}

void sum_accumulate(const Tensor& out, const Tensor& x, float alpha, const Stream&) {
  const float s = static_cast<float>(deterministic_sum(x.data_as<float>(), x.numel()));
  out.data_as<float>()[0] += alpha * s;
}

}  // namespace mt::cpu
