// Argument validation and backend dispatch for ops/gelu.h.
#include "ops/gelu.h"

#include "ops/dispatch.h"
#include "ops/op_checks.h"
#include "ops/gelu_math.h"

namespace mt {
namespace {

using op_checks::check_act;
using op_checks::check_like;

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
