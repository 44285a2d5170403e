// Argument validation and backend dispatch for ops/fp8_fused.h.
#include "ops/fp8_fused.h"

#include <vector>

#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

using op_checks::check_act;
using op_checks::check_like;
using op_checks::check_stats;

/// q: the FP8 copy of y; scale: fp32 [1]; amax: fp32 [1] or empty (op_checks, as fp8_quantize).
void check_fp8_out(const Tensor& q, const Tensor& y, const Tensor& scale, const Tensor& amax, const char* fn) {
  op_checks::check_fp8_like(q, y, fn, "q", "y");
  op_checks::check_fp8_scale_amax(scale, amax, fn);
}

}  // namespace

void fp8_rmsnorm_forward(const Tensor& y, const Tensor& q, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                         float eps, const Tensor& scale, const Tensor& amax, const Stream& stream,
                         bool zero_centered_gamma) {
  const char* fn = "fp8_rmsnorm_forward";
  check_act(x, fn, "x");
  check_act(y, fn, "y");
  check_like(y, x, fn, "y", "x");
  const auto [n, h] = op_checks::rows_of(x, fn);
  check_tensor(weight, x.dtype(), {h}, "fp8_rmsnorm_forward: weight");
  check_stats(rstd, n, fn, "rstd");
  MT_CHECK(eps >= 0.f, "{}: eps={} must be >= 0", fn, eps);
  check_fp8_out(q, y, scale, amax, fn);
  check_same_device({&y, &q, &rstd, &x, &weight, &scale, &amax});
  op_checks::check_stream(stream, x, fn);
  MT_DISPATCH(x.device(), fp8_rmsnorm_forward, y, q, rstd, x, weight, eps, scale, amax, stream, zero_centered_gamma);
}

void fp8_swiglu_forward(const Tensor& y, const Tensor& q, const Tensor& x, const Tensor& scale, const Tensor& amax,
                        const Stream& stream) {
  const char* fn = "fp8_swiglu_forward";
  check_act(x, fn, "x");
  check_act(y, fn, "y");
  MT_CHECK(x.ndim() >= 1 && x.size(-1) >= 2 && x.size(-1) % 2 == 0,
           "{}: the last dimension of x {} must be even and >= 2 (gate half, then linear half)", fn, x.str());
  std::vector<int64_t> half = x.shape();
  half.back() /= 2;
  MT_CHECK(y.shape() == half && y.dtype() == x.dtype(), "{}: y {} must be x {} with the last dimension halved", fn,
           y.str(), x.str());
  check_fp8_out(q, y, scale, amax, fn);
  check_same_device({&y, &q, &x, &scale, &amax});
  op_checks::check_stream(stream, x, fn);
  MT_DISPATCH(x.device(), fp8_swiglu_forward, y, q, x, scale, amax, stream);
}

}  // namespace mt
