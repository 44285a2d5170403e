// Argument validation and backend dispatch for ops/rmsnorm.h.
#include "ops/rmsnorm.h"

#include "ops/dispatch.h"
#include "ops/op_checks.h"
#include "ops/row_map.h"

namespace mt {
namespace {

using op_checks::check_like;
using op_checks::check_stats;
using op_checks::is_float;
using op_checks::rows_of;

/// An activation addressed by rows (ops/row_map.h): fp32/bf16/fp16 (fp32 on the CPU), last
/// dimension contiguous, leading dimensions addressable with two strides.
void check_rows(const Tensor& t, const char* fn, const char* name) {
  MT_CHECK(is_float(t.dtype()), "{}: {} must be fp32/bf16/fp16, got {}", fn, name, t.str());
  MT_CHECK(!t.device().is_cpu() || t.dtype() == DType::kF32, "{}: {} on CPU must be fp32, got {}", fn, name,
           t.str());
  (void)row_map(t, fn);
}

}  // namespace

void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& weight, float eps,
                     const Stream& stream, bool zero_centered_gamma) {
  const char* fn = "rmsnorm_forward";
  check_rows(x, fn, "x");
  auto [n, h] = rows_of(x, fn);
  check_rows(y, fn, "y");
  check_like(y, x, fn, "y", "x");
  check_tensor(weight, x.dtype(), {h}, "rmsnorm_forward: weight");
  check_stats(rstd, n, fn, "rstd");
  MT_CHECK(eps >= 0.f, "{}: eps={} must be >= 0", fn, eps);
  check_same_device({&y, &rstd, &x, &weight});
  MT_CHECK(stream.device().type == x.device().type, "{}: stream on {} but x {}", fn, stream.device().str(), x.str());
  MT_DISPATCH(x.device(), rmsnorm_forward, y, rstd, x, weight, eps, stream, zero_centered_gamma);
}

void rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dy, const Tensor& x,
                      const Tensor& weight, const Tensor& rstd, bool accumulate_dx, const Stream& stream,
                      bool zero_centered_gamma) {
  const char* fn = "rmsnorm_backward";
  check_rows(x, fn, "x");
  auto [n, h] = rows_of(x, fn);
  check_rows(dx, fn, "dx");
  check_rows(dy, fn, "dy");
  check_like(dx, x, fn, "dx", "x");
  check_like(dy, x, fn, "dy", "x");
  check_tensor(weight, x.dtype(), {h}, "rmsnorm_backward: weight");
  check_tensor(dweight, DType::kF32, {h}, "rmsnorm_backward: dweight");
  check_stats(rstd, n, fn, "rstd");
  check_same_device({&dx, &dweight, &dy, &x, &weight, &rstd});
  MT_CHECK(stream.device().type == x.device().type, "{}: stream on {} but x {}", fn, stream.device().str(), x.str());
  MT_DISPATCH(x.device(), rmsnorm_backward, dx, dweight, dy, x, weight, rstd, accumulate_dx, stream,
              zero_centered_gamma);
}

}  // namespace mt
