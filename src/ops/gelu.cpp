// Argument validation and backend dispatch for ops/gelu.h.
#include "ops/gelu.h"

#include "ops/dispatch.h"
#include "ops/gelu_impl.h"

namespace mt {
namespace {

void check_act(const Tensor& t, const char* fn, const char* name) {
  const DType d = t.dtype();
  MT_CHECK(d == DType::kF32 || d == DType::kBF16 || d == DType::kF16, "{}: {} must be fp32/bf16/fp16, got {}", fn,
           name, t.str());
  MT_CHECK(!t.device().is_cpu() || d == DType::kF32, "{}: {} on CPU must be fp32, got {}", fn, name, t.str());
  MT_CHECK(t.is_contiguous(), "{}: {} must be contiguous, got {}", fn, name, t.str());
}

void check_like(const Tensor& t, const Tensor& ref, const char* fn, const char* name, const char* ref_name) {
  MT_CHECK(t.shape() == ref.shape() && t.dtype() == ref.dtype(), "{}: {} {} must match {} {} (shape and dtype)", fn,
           name, t.str(), ref_name, ref.str());
}

}  // namespace

void gelu_forward(const Tensor& y, const Tensor& x, const Stream& stream) {
  check_act(x, "gelu_forward", "x");
  check_act(y, "gelu_forward", "y");
  check_like(y, x, "gelu_forward", "y", "x");
  check_same_device({&y, &x});
  MT_CHECK(stream.device().type == x.device().type, "gelu_forward: stream on {} but x {}", stream.device().str(),
           x.str());
  MT_DISPATCH(x.device(), gelu_forward, y, x, stream);
}

void gelu_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const Stream& stream) {
  check_act(x, "gelu_backward", "x");
  check_act(dy, "gelu_backward", "dy");
  check_act(dx, "gelu_backward", "dx");
  check_like(dy, x, "gelu_backward", "dy", "x");
  check_like(dx, x, "gelu_backward", "dx", "x");
  check_same_device({&dx, &dy, &x});
  MT_CHECK(stream.device().type == x.device().type, "gelu_backward: stream on {} but x {}", stream.device().str(),
           x.str());
  MT_DISPATCH(x.device(), gelu_backward, dx, dy, x, stream);
}

}  // namespace mt
