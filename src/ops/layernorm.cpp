// Argument validation and backend dispatch for ops/layernorm.h.
#include "ops/layernorm.h"

#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

using op_checks::check_act;
using op_checks::check_stats;
using op_checks::rows_of;

}  // namespace

void layernorm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& weight, const Tensor& bias, float eps, const Stream& stream,
                       bool zero_centered_gamma) {
  const char* fn = "layernorm_forward";
  check_act(x, fn, "x");
  auto [n, h] = rows_of(x, fn);
  check_act(y, fn, "y");
  MT_CHECK(y.shape() == x.shape() && y.dtype() == x.dtype(), "{}: y {} must match x {}", fn, y.str(), x.str());
  check_tensor(weight, x.dtype(), {h}, "layernorm_forward: weight");
  check_tensor(bias, x.dtype(), {h}, "layernorm_forward: bias");
  check_stats(mean, n, fn, "mean");
  check_stats(rstd, n, fn, "rstd");
  MT_CHECK(eps >= 0.f, "{}: eps={} must be >= 0", fn, eps);
  check_same_device({&y, &mean, &rstd, &x, &weight, &bias});
  MT_CHECK(stream.device().type == x.device().type, "{}: stream on {} but x {}", fn, stream.device().str(), x.str());
  MT_DISPATCH(x.device(), layernorm_forward, y, mean, rstd, x, weight, bias, eps, stream, zero_centered_gamma);
}

void layernorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                        const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                        bool accumulate_dx, const Stream& stream, bool zero_centered_gamma) {
  const char* fn = "layernorm_backward";
  check_act(x, fn, "x");
  auto [n, h] = rows_of(x, fn);
  check_act(dx, fn, "dx");
  check_act(dy, fn, "dy");
  MT_CHECK(dx.shape() == x.shape() && dx.dtype() == x.dtype(), "{}: dx {} must match x {}", fn, dx.str(), x.str());
  MT_CHECK(dy.shape() == x.shape() && dy.dtype() == x.dtype(), "{}: dy {} must match x {}", fn, dy.str(), x.str());
  check_tensor(weight, x.dtype(), {h}, "layernorm_backward: weight");
  check_tensor(dweight, DType::kF32, {h}, "layernorm_backward: dweight");
  check_tensor(dbias, DType::kF32, {h}, "layernorm_backward: dbias");
  check_stats(mean, n, fn, "mean");
  check_stats(rstd, n, fn, "rstd");
  check_same_device({&dx, &dweight, &dbias, &dy, &x, &weight, &mean, &rstd});
  MT_CHECK(stream.device().type == x.device().type, "{}: stream on {} but x {}", fn, stream.device().str(), x.str());
  MT_DISPATCH(x.device(), layernorm_backward, dx, dweight, dbias, dy, x, weight, mean, rstd, accumulate_dx, stream,
              zero_centered_gamma);
}

}  // namespace mt
