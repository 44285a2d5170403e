// CPU reference of ops/optimizer.h: reads and writes the OptimizerScalars struct in place.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/optimizer_math.h"
#include "ops/optimizer.h"

namespace mt::cpu {
namespace {

OptimizerScalars& scalars_of(const Tensor& t) { return *static_cast<OptimizerScalars*>(t.data()); }

}  // namespace

void grad_sumsq_accumulate(const Tensor& scalars, const Tensor& grads, const Stream&) {
  OptimizerScalars& s = scalars_of(scalars);
  const float inv = 1.f / s.loss_scale;
  const float* g = grads.data_as<float>();
  const int64_t n = grads.numel();
  // Fixed chunks summed in parallel, chunk sums added in index order: the result does not
  // depend on the number of threads.
  constexpr int64_t kChunk = 8192;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    double acc = 0;
    const int64_t end = std::min(n, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; ++i) {
      const double a = static_cast<double>(g[i] * inv);
      acc += a * a;
    }
    part[c] = acc;
  }
  double total = 0;
  for (double p : part) total += p;
  s.grad_sumsq += static_cast<float>(total);
}

void optimizer_prepare(const Tensor& scalars, float clip_grad, const Stream&) {
  detail::optimizer_prepare_state(scalars_of(scalars), clip_grad);
}

namespace {
/// The AdamW update of every run (OpenMP over the runs: callers pass runs of at most kAdamWChunk
/// elements); decay = 0 runs take no weight decay.
void adamw_runs(const Tensor& main_param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const Tensor& model_param, const std::vector<AdamWRun>& runs, const AdamWHyper& hyper,
                const Tensor& scalars, const char* fn) {
  const OptimizerScalars& s = scalars_of(scalars);
  if (s.found_inf) return;
  MT_CHECK(s.step >= 1, "{}: step={} (call optimizer_prepare first)", fn, s.step);
  const detail::AdamWCoeffs c = detail::adamw_coeffs(hyper, s);
  // Remainder storage: main_param holds int16 remainders, model_param the bf16 high bits.
  const bool remainders = main_param.dtype() == DType::kI16;
  float* p = remainders ? nullptr : main_param.data_as<float>();
  int16_t* rem = remainders ? main_param.data_as<int16_t>() : nullptr;
  const float* g = grad.data_as<float>();
  float* m = exp_avg.data_as<float>();
  float* v = exp_avg_sq.data_as<float>();
  const DType md = model_param.empty() ? DType::kF32 : model_param.dtype();
  uint16_t* mp = model_param.empty() ? nullptr : model_param.data_as<uint16_t>();
  const int64_t count = static_cast<int64_t>(runs.size());
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < count; ++k) {
    const AdamWRun& r = runs[static_cast<size_t>(k)];
    AdamWHyper h = hyper;
    if (!r.decay) h.weight_decay = 0.f;
    if (remainders) {
      for (int64_t i = 0; i < r.n; ++i) {
        float pi = detail::merge_f32_remainder(mp[r.param + i], rem[r.main + i]);
        detail::adamw_element(pi, g[r.grad + i], m[r.state + i], v[r.state + i], h, c);
        detail::split_f32_remainder(pi, mp[r.param + i], rem[r.main + i]);
      }
      continue;
    }
    for (int64_t i = 0; i < r.n; ++i) {
      float& pi = p[r.main + i];
      detail::adamw_element(pi, g[r.grad + i], m[r.state + i], v[r.state + i], h, c);
      if (mp) mp[r.param + i] = md == DType::kBF16 ? f32_to_bf16_bits(pi) : f32_to_f16_bits(pi);
    }
  }
}
}  // namespace

void adamw_step(const Tensor& main_param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const Tensor& model_param, const AdamWHyper& hyper, const Tensor& scalars, const Stream&) {
  std::vector<AdamWRun> chunks;
  for (int64_t o = 0; o < main_param.numel(); o += kAdamWChunk)
    chunks.push_back({o, o, o, std::min(kAdamWChunk, main_param.numel() - o), 1, 0, o});
  adamw_runs(main_param, grad, exp_avg, exp_avg_sq, model_param, chunks, hyper, scalars, "adamw_step");
}

void adamw_multi_step(const Tensor& main_param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                      const Tensor& model_param, const AdamWPlan& plan, const AdamWHyper& hyper,
                      const Tensor& scalars, const Stream&) {
  adamw_runs(main_param, grad, exp_avg, exp_avg_sq, model_param, plan.chunks(), hyper, scalars, "adamw_multi_step");
}

void split_param_remainders(const Tensor& main_param, const Tensor& model_param, const Tensor& remainders,
                            const Stream&) {
  const float* x = main_param.data_as<float>();
  uint16_t* hi = model_param.data_as<uint16_t>();
  int16_t* rem = remainders.empty() ? nullptr : remainders.data_as<int16_t>();
  const int64_t n = main_param.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    int16_t r;
    detail::split_f32_remainder(x[i], hi[i], r);
    if (rem) rem[i] = r;
  }
}

void merge_param_remainders(const Tensor& main_param, const Tensor& model_param, const Tensor& remainders,
                            const Stream&) {
  float* x = main_param.data_as<float>();
  const uint16_t* hi = model_param.data_as<uint16_t>();
  const int16_t* rem = remainders.data_as<int16_t>();
  const int64_t n = main_param.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] = detail::merge_f32_remainder(hi[i], rem[i]);
}

void loss_scaler_update(const Tensor& scalars, const LossScalerConfig& cfg, const Stream&) {
  detail::loss_scaler_update_state(scalars_of(scalars), cfg);
}

}  // namespace mt::cpu
