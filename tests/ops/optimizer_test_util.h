// Helpers shared by the CPU and CUDA tests of ops/optimizer.h.
#pragma once
#include "core/buffer.h"
#include "ops/optimizer.h"

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

}  // namespace mt::testing
