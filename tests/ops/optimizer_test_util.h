// Helpers shared by the CPU and CUDA tests of ops/optimizer.h.
#pragma once
#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "ops/optimizer.h"
#include "testing/testing.h"

namespace mt::testing {

/// The uint8 [sizeof(OptimizerScalars)] tensor the ops take, in its own buffer on `d`.
struct ScalarsTensor {
  Buffer buffer;
  Tensor t;
  explicit ScalarsTensor(Device d) : buffer(d, sizeof(OptimizerScalars)) {
    t = Tensor(buffer.data(), DType::kU8, d, {static_cast<int64_t>(sizeof(OptimizerScalars))});
  }
  OptimizerScalars read(const Stream& s) const {
    OptimizerScalars o;
    copy_bytes(&o, Device::cpu(), t.data(), t.device(), sizeof(o), s);
    s.synchronize();
    return o;
  }
  void write(const OptimizerScalars& o, const Stream& s) const {
    copy_bytes(t.data(), t.device(), &o, Device::cpu(), sizeof(o), s);
    s.synchronize();
  }
};

/// A scaler that never changes its scale.
inline LossScalerConfig static_scaler(float scale) {
  LossScalerConfig c;
  c.dynamic = false;
  c.initial_scale = scale;
  return c;
}

/// The runs adamw_multi_step is tested on: decay and no-decay runs, a run shorter than 4, runs
/// spanning several chunks with unaligned offsets, a gap of elements owned by no run, and (when
/// `sharded`) main parameters indexed by state index as the distributed optimizer does.
inline std::vector<AdamWRun> test_adamw_runs(bool sharded) {
  std::vector<AdamWRun> runs;
  int64_t param = 0, state = 0;
  const int64_t sizes[] = {20000, 3, 17001, 1, 2 * kAdamWChunk + 5, 12996};
  int k = 0;
  for (int64_t n : sizes) {
    param += (k == 3) ? 7 : 0;  // an unowned gap before the fourth run
    runs.push_back({param, sharded ? state : param, state, n, k % 2 == 0 ? 1 : 0, 0});
    param += n;
    state += n;
    ++k;
  }
  return runs;
}

/// Buffers of one multi-tensor AdamW test: flat params/grads/model copy of `param_n`, main
/// parameters of `main_n`, moments of `state_n`, filled from fixed seeds.
struct AdamWBuffers {
  OwnedTensor p, g, m, v, model;
  AdamWBuffers(Device d, DType model_dtype, int64_t param_n, int64_t main_n, int64_t state_n, const Stream& s) {
    p = make_tensor(randn(main_n), DType::kF32, d, {main_n}, s);
    g = make_tensor(randn(param_n, 0.05f), DType::kF32, d, {param_n}, s);
    m = make_tensor(randn(state_n, 0.01f), DType::kF32, d, {state_n}, s);
    v = make_tensor(randu(state_n, 1e-5f, 1e-3f), DType::kF32, d, {state_n}, s);
    if (model_dtype != DType::kF32) {
      model = OwnedTensor(model_dtype, d, {param_n});
      poison(model, s);
    }
  }
  /// A copy on another device (same bytes).
  AdamWBuffers(const AdamWBuffers& o, Device d, const Stream& s) {
    for (auto [dst, src] : {std::pair{&p, &o.p}, std::pair{&g, &o.g}, std::pair{&m, &o.m}, std::pair{&v, &o.v},
                            std::pair{&model, &o.model}}) {
      if (src->t.empty()) continue;
      *dst = OwnedTensor(src->t.dtype(), d, src->t.shape());
      copy(dst->t, src->t, s);
    }
    s.synchronize();
  }
  Tensor model_view() const { return model.t.empty() ? Tensor() : model.t; }
};

}  // namespace mt::testing
