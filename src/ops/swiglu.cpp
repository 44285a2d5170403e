// Argument validation and backend dispatch for ops/swiglu.h.
#include "ops/swiglu.h"

#include <vector>

#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

using op_checks::check_act;

/// x: [..., 2f] and a tensor half-shaped like it ([..., f], same dtype).
void check_halves(const Tensor& x, const Tensor& half, const char* fn, const char* xname, const char* hname) {
  check_act(x, fn, xname);
  check_act(half, fn, hname);
  MT_CHECK(x.ndim() >= 1 && x.size(-1) >= 2 && x.size(-1) % 2 == 0,
           "{}: the last dimension of {} {} must be even and >= 2 (gate half, then linear half)", fn, xname, x.str());
  std::vector<int64_t> want = x.shape();
  want.back() /= 2;
  MT_CHECK(half.shape() == want && half.dtype() == x.dtype(), "{}: {} {} must be {} with the last dimension halved",
           fn, hname, half.str(), x.str());
}

}  // namespace

void swiglu_forward(const Tensor& y, const Tensor& x, const Stream& stream) {
  const char* fn = "swiglu_forward";
  check_halves(x, y, fn, "x", "y");
  check_same_device({&y, &x});
  MT_CHECK(stream.device().type == x.device().type, "{}: stream on {} but x {}", fn, stream.device().str(), x.str());
  MT_DISPATCH(x.device(), swiglu_forward, y, x, stream);
}

void swiglu_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const Stream& stream) {
  const char* fn = "swiglu_backward";
  check_halves(x, dy, fn, "x", "dy");
  check_act(dx, fn, "dx");
  MT_CHECK(dx.shape() == x.shape() && dx.dtype() == x.dtype(), "{}: dx {} must match x {}", fn, dx.str(), x.str());
  check_same_device({&dx, &dy, &x});
  MT_CHECK(stream.device().type == x.device().type, "{}: stream on {} but x {}", fn, stream.device().str(), x.str());
  MT_DISPATCH(x.device(), swiglu_backward, dx, dy, x, stream);
}

}  // namespace mt
