// Argument validation and backend dispatch for ops/fp8_fused.h.
#include "ops/fp8_fused.h"

#include <fmt/ranges.h>

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

/// x: [..., 2f] (gate half, then linear half); returns [..., f].
std::vector<int64_t> halved(const Tensor& x, const char* fn) {
  check_act(x, fn, "x");
  MT_CHECK(x.ndim() >= 1 && x.size(-1) >= 2 && x.size(-1) % 2 == 0,
           "{}: the last dimension of x {} must be even and >= 2 (gate half, then linear half)", fn, x.str());
  std::vector<int64_t> half = x.shape();
  half.back() /= 2;
  return half;
}

/// The FP8 copies of a tensor of `shape` ([..., cols], rows = the product of the rest): q (its
/// shape, contiguous) and q_t ([cols, rows]), either empty but not both, one FP8 dtype.
void check_fp8_pair(const Tensor& q, const Tensor& q_t, const std::vector<int64_t>& shape, const char* fn,
                    const char* qname, const char* tname) {
  MT_CHECK(!q.empty() || !q_t.empty(), "{}: {} and {} are both empty: nothing to write", fn, qname, tname);
  const int64_t cols = shape.back();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  if (!q.empty()) {
    op_checks::check_fp8_dtype(q.dtype(), fn, qname);
    MT_CHECK(q.shape() == shape && q.is_contiguous(), "{}: {} {} must be contiguous of shape [{}]", fn, qname,
             q.str(), fmt::join(shape, ", "));
  }
  if (!q_t.empty()) {
    op_checks::check_fp8_dtype(q_t.dtype(), fn, tname);
    MT_CHECK(q_t.ndim() == 2 && q_t.size(0) == cols && q_t.size(1) == rows && q_t.is_contiguous(),
             "{}: {} {} must be a contiguous [{}, {}] (the transpose)", fn, tname, q_t.str(), cols, rows);
    MT_CHECK(q.empty() || q.dtype() == q_t.dtype(), "{}: {} {} and {} {} need one FP8 dtype", fn, qname, q.str(),
             tname, q_t.str());
  }
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

void fp8_swiglu_forward(const Tensor& y, const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale,
                        const Tensor& amax, const Stream& stream) {
  const char* fn = "fp8_swiglu_forward";
  const std::vector<int64_t> half = halved(x, fn);
  if (!y.empty()) {
    check_act(y, fn, "y");
    MT_CHECK(y.shape() == half && y.dtype() == x.dtype(), "{}: y {} must be x {} with the last dimension halved", fn,
             y.str(), x.str());
  }
  check_fp8_pair(q, q_t, half, fn, "q", "q_t");
  op_checks::check_fp8_scale_amax(scale, amax, fn);
  check_same_device({&y, &q, &q_t, &x, &scale, &amax});
  op_checks::check_stream(stream, x, fn);
  MT_DISPATCH(x.device(), fp8_swiglu_forward, y, q, q_t, x, scale, amax, stream);
}

void fp8_swiglu_backward(const Tensor& dq, const Tensor& dq_t, const Tensor& dy, const Tensor& x, const Tensor& scale,
                         const Tensor& amax, const Stream& stream) {
  const char* fn = "fp8_swiglu_backward";
  const std::vector<int64_t> half = halved(x, fn);
  check_act(dy, fn, "dy");
  MT_CHECK(dy.shape() == half && dy.dtype() == x.dtype(), "{}: dy {} must be x {} with the last dimension halved", fn,
           dy.str(), x.str());
  check_fp8_pair(dq, dq_t, x.shape(), fn, "dq", "dq_t");
  op_checks::check_fp8_scale_amax(scale, amax, fn);
  check_same_device({&dq, &dq_t, &dy, &x, &scale, &amax});
  op_checks::check_stream(stream, x, fn);
  MT_DISPATCH(x.device(), fp8_swiglu_backward, dq, dq_t, dy, x, scale, amax, stream);
}

void fp8_gelu_forward(const Tensor& y, const Tensor& q, const Tensor& q_t, const Tensor& pre, const Tensor& scale,
                      const Tensor& amax, const Stream& stream) {
  const char* fn = "fp8_gelu_forward";
  check_act(pre, fn, "pre");
  op_checks::rows_of(pre, fn);
  if (!y.empty()) {
    check_act(y, fn, "y");
    check_like(y, pre, fn, "y", "pre");
    MT_CHECK(y.data() != pre.data(), "{}: y {} must not alias pre", fn, y.str());
  }
  check_fp8_pair(q, q_t, pre.shape(), fn, "q", "q_t");
  op_checks::check_fp8_scale_amax(scale, amax, fn);
  check_same_device({&y, &q, &q_t, &pre, &scale, &amax});
  op_checks::check_stream(stream, pre, fn);
  MT_DISPATCH(pre.device(), fp8_gelu_forward, y, q, q_t, pre, scale, amax, stream);
}

void fp8_gelu_backward(const Tensor& dx, const Tensor& dq, const Tensor& dq_t, const Tensor& dbias, const Tensor& dy,
                       const Tensor& pre, const Tensor& scale, const Tensor& amax, const Stream& stream) {
  const char* fn = "fp8_gelu_backward";
  check_act(pre, fn, "pre");
  check_act(dy, fn, "dy");
  check_like(dy, pre, fn, "dy", "pre");
  const int64_t f = op_checks::rows_of(pre, fn).second;
  if (!dx.empty()) {
    check_act(dx, fn, "dx");
    check_like(dx, pre, fn, "dx", "pre");
    MT_CHECK(dx.data() != pre.data(), "{}: dx {} must not alias pre", fn, dx.str());
  }
  if (!dbias.empty()) check_stats(dbias, f, fn, "dbias");
  const bool quantised = !dq.empty() || !dq_t.empty();
  MT_CHECK(quantised || !dx.empty() || !dbias.empty(), "{}: dx, dbias, dq and dq_t are all empty: nothing to write",
           fn);
  if (quantised) {
    check_fp8_pair(dq, dq_t, pre.shape(), fn, "dq", "dq_t");
    op_checks::check_fp8_scale_amax(scale, amax, fn);
  } else {
    MT_CHECK(scale.empty() && amax.empty(), "{}: scale {} / amax {} given without dq or dq_t", fn, scale.str(),
             amax.str());
  }
  check_same_device({&dx, &dq, &dq_t, &dbias, &dy, &pre, &scale, &amax});
  op_checks::check_stream(stream, pre, fn);
  MT_DISPATCH(pre.device(), fp8_gelu_backward, dx, dq, dq_t, dbias, dy, pre, scale, amax, stream);
}

}  // namespace mt
