// CPU reference of the fused FP8 quantisation (ops/fp8_fused.h): by definition the unfused
// composition — the op, then fp8_quantize of its stored output with the amax record.
#include "ops/fp8_fused.h"

#include <vector>

#include "ops/elementwise.h"
#include "ops/fp8.h"
#include "ops/fp8_epilogue.h"
#include "ops/gelu.h"
#include "ops/rmsnorm.h"
#include "ops/swiglu.h"

namespace mt::cpu {

namespace {
/// A host fp32 tensor of `shape`: the stored output the quantiser reads when the caller does not
/// keep it, in a per-thread buffer that only grows (the first step's size; no allocation after).
Tensor host_f32(const std::vector<int64_t>& shape, Device dev) {
  thread_local std::vector<float> buf;
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  if (buf.size() < static_cast<size_t>(n)) buf.resize(static_cast<size_t>(n));
  return Tensor(buf.data(), DType::kF32, dev, shape);
}
}  // namespace

void fp8_rmsnorm_forward(const Tensor& y, const Tensor& q, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                         float eps, const Tensor& scale, const Tensor& amax, const Stream& stream,
                         bool zero_centered_gamma) {
  cpu::rmsnorm_forward(y, rstd, x, weight, eps, stream, zero_centered_gamma);
  cpu::fp8_quantize(q, Tensor(), y, scale, amax, stream);
}

void fp8_swiglu_forward(const Tensor& y, const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale,
                        const Tensor& amax, const Stream& stream) {
  std::vector<int64_t> half = x.shape();
  half.back() /= 2;
  const Tensor out = y.empty() ? host_f32(half, x.device()) : y;
  cpu::swiglu_forward(out, x, stream);
  cpu::fp8_quantize(q, q_t, out, scale, amax, stream);
}

void fp8_swiglu_backward(const Tensor& dq, const Tensor& dq_t, const Tensor& dy, const Tensor& x, const Tensor& scale,
                         const Tensor& amax, const Stream& stream) {
  const Tensor dx = host_f32(x.shape(), x.device());
  cpu::swiglu_backward(dx, dy, x, stream);
  cpu::fp8_quantize(dq, dq_t, dx, scale, amax, stream);
}

void fp8_gelu_forward(const Tensor& y, const Tensor& q, const Tensor& q_t, const Tensor& pre, const Tensor& scale,
                      const Tensor& amax, const Stream& stream) {
  const Tensor out = y.empty() ? host_f32(pre.shape(), pre.device()) : y;
  cpu::fp8_bias_gelu(pre, Tensor(), out, stream);
  cpu::fp8_quantize(q, q_t, out, scale, amax, stream);
}

void fp8_gelu_backward(const Tensor& dx, const Tensor& dq, const Tensor& dq_t, const Tensor& dbias, const Tensor& dy,
                       const Tensor& pre, const Tensor& scale, const Tensor& amax, const Stream& stream) {
  const Tensor d = dx.empty() ? host_f32(pre.shape(), pre.device()) : dx;
  cpu::gelu_backward(d, dy, pre, stream);
  if (!dbias.empty()) cpu::bias_dropout_add_backward(Tensor(), dbias, d, 0.f, DropoutKey{}, 0, stream);
  if (!dq.empty() || !dq_t.empty()) cpu::fp8_quantize(dq, dq_t, d, scale, amax, stream);
}

}  // namespace mt::cpu
