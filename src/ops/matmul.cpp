// Argument validation and backend dispatch for ops/matmul.h.
#include "ops/matmul.h"

#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

/// Rows of a [..., cols] tensor (all leading dims flattened).
int64_t flat_rows(const Tensor& t, int64_t cols, const char* op, const char* name) {
  MT_CHECK(t.ndim() >= 1 && t.size(-1) == cols, "{}: {} has shape {}, expected last dim {}", op, name, t.shape_str(),
           cols);
  MT_CHECK(t.is_contiguous(), "{}: {} ({}) must be contiguous", op, name, t.str());
  int64_t rows = 1;
  for (int d = 0; d + 1 < t.ndim(); ++d) rows *= t.size(d);
  return rows;
}

}  // namespace

void matmul(const Tensor& c, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, float alpha, float beta,
            const Stream& stream) {
  MT_CHECK(a.ndim() == b.ndim() && a.ndim() == c.ndim() && (a.ndim() == 2 || a.ndim() == 3),
           "matmul: a {}, b {}, c {} must all be 2-D or all 3-D", a.str(), b.str(), c.str());
  MT_CHECK(a.dtype() == b.dtype() && op_checks::is_float(a.dtype()), "matmul: a {} and b {} need one float dtype", a.str(),
           b.str());
  MT_CHECK(c.dtype() == a.dtype() || c.dtype() == DType::kF32, "matmul: c {} must be {} or fp32", c.str(),
           dtype_name(a.dtype()));
  MT_CHECK(a.is_contiguous() && b.is_contiguous() && c.is_contiguous(), "matmul: a {}, b {}, c {} must be contiguous",
           a.str(), b.str(), c.str());
  check_same_device({&c, &a, &b});
  op_checks::check_stream(stream, c, "matmul");
  const int r = a.ndim();
  if (r == 3) {
    MT_CHECK(a.size(0) == b.size(0) && a.size(0) == c.size(0), "matmul: batch sizes differ: a {}, b {}, c {}",
             a.shape_str(), b.shape_str(), c.shape_str());
  }
  const int64_t m = trans_a ? a.size(r - 1) : a.size(r - 2);
  const int64_t ka = trans_a ? a.size(r - 2) : a.size(r - 1);
  const int64_t kb = trans_b ? b.size(r - 1) : b.size(r - 2);
  const int64_t n = trans_b ? b.size(r - 2) : b.size(r - 1);
  MT_CHECK(ka == kb, "matmul: inner dims differ: op(a) {} (trans_a={}) has k={}, op(b) {} (trans_b={}) has k={}",
           a.shape_str(), trans_a, ka, b.shape_str(), trans_b, kb);
  MT_CHECK(c.size(r - 2) == m && c.size(r - 1) == n, "matmul: c {} expected [{}, {}] (a {}, b {}, trans {} {})",
           c.shape_str(), m, n, a.shape_str(), b.shape_str(), trans_a, trans_b);
  MT_DISPATCH(c.device(), matmul, c, a, b, trans_a, trans_b, alpha, beta, stream);
}

namespace {
/// linear_forward's argument checks (`fn` names the op in the errors).
void linear_forward_checks(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias,
                           const Tensor& pre_gelu, const Stream& stream, const char* fn) {
  MT_CHECK(w.ndim() == 2 && w.is_contiguous(), "{}: w {} must be a contiguous [n, k]", fn, w.str());
  const int64_t n = w.size(0), k = w.size(1);
  MT_CHECK(op_checks::is_float(w.dtype()), "{}: w {} needs a float dtype", fn, w.str());
  MT_CHECK(x.dtype() == w.dtype() && y.dtype() == w.dtype(), "{}: x {}, w {}, y {} need one dtype", fn, x.str(),
           w.str(), y.str());
  const int64_t m = flat_rows(x, k, fn, "x");
  const int64_t my = flat_rows(y, n, fn, "y");
  MT_CHECK(m == my, "{}: x {} has {} rows but y {} has {}", fn, x.shape_str(), m, y.shape_str(), my);
  if (!bias.empty()) {
    MT_CHECK(bias.ndim() == 1 && bias.size(0) == n && bias.dtype() == w.dtype() && bias.is_contiguous(),
             "{}: bias {} expected {}[{}]", fn, bias.str(), dtype_name(w.dtype()), n);
  }
  if (!pre_gelu.empty()) {
    MT_CHECK(pre_gelu.shape() == y.shape() && pre_gelu.dtype() == y.dtype() && pre_gelu.is_contiguous(),
             "{}: pre_gelu {} must match y {}", fn, pre_gelu.str(), y.str());
    MT_CHECK(pre_gelu.data() != y.data(), "{}: pre_gelu must not alias y", fn);
  }
  check_same_device({&y, &x, &w, &bias, &pre_gelu});
  op_checks::check_stream(stream, y, fn);
}
}  // namespace

void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& pre_gelu,
                    const Stream& stream) {
  linear_forward_checks(y, x, w, bias, pre_gelu, stream, "linear_forward");
  MT_DISPATCH(y.device(), linear_forward, y, x, w, bias, pre_gelu, stream);
}

void linear_forward_add(const Tensor& out, const Tensor& x, const Tensor& w, const Tensor& bias,
                        const Tensor& residual, const Stream& stream) {
  linear_forward_checks(out, x, w, bias, Tensor(), stream, "linear_forward_add");
  MT_CHECK(residual.shape() == out.shape() && residual.dtype() == out.dtype() && residual.is_contiguous(),
           "linear_forward_add: residual {} must match out {}", residual.str(), out.str());
  MT_CHECK(out.data() != residual.data() && out.data() != x.data(),
           "linear_forward_add: out may not alias x or residual");
  check_same_device({&out, &residual});
  MT_DISPATCH(out.device(), linear_forward_add, out, x, w, bias, residual, stream);
}

namespace {
/// linear_backward's argument checks (`fn` names the op in the errors).
void linear_backward_checks(const Tensor& dx, const Tensor& dw, const Tensor& dbias, const Tensor& dy,
                            const Tensor& x, const Tensor& w, const Stream& stream, const char* fn) {
  MT_CHECK(w.ndim() == 2 && w.is_contiguous(), "{}: w {} must be a contiguous [n, k]", fn, w.str());
  const int64_t n = w.size(0), k = w.size(1);
  MT_CHECK(op_checks::is_float(w.dtype()), "{}: w {} needs a float dtype", fn, w.str());
  MT_CHECK(x.dtype() == w.dtype() && dy.dtype() == w.dtype(), "{}: dy {}, x {}, w {} need one dtype", fn, dy.str(),
           x.str(), w.str());
  const int64_t m = flat_rows(x, k, fn, "x");
  const int64_t my = flat_rows(dy, n, fn, "dy");
  MT_CHECK(m == my, "{}: x {} has {} rows but dy {} has {}", fn, x.shape_str(), m, dy.shape_str(), my);
  if (!dx.empty()) {
    MT_CHECK(dx.shape() == x.shape() && dx.dtype() == x.dtype() && dx.is_contiguous(), "{}: dx {} must match x {}",
             fn, dx.str(), x.str());
  }
  if (!dw.empty()) {
    MT_CHECK(dw.dtype() == DType::kF32 && dw.ndim() == 2 && dw.size(0) == n && dw.size(1) == k && dw.is_contiguous(),
             "{}: dw {} expected fp32[{}, {}] (fp32 main grad)", fn, dw.str(), n, k);
  }
  if (!dbias.empty()) {
    MT_CHECK(dbias.dtype() == DType::kF32 && dbias.ndim() == 1 && dbias.size(0) == n && dbias.is_contiguous(),
             "{}: dbias {} expected fp32[{}]", fn, dbias.str(), n);
  }
  check_same_device({&dx, &dw, &dbias, &dy, &x, &w});
  op_checks::check_stream(stream, dy, fn);
}
}  // namespace

void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor& dbias, const Tensor& dy, const Tensor& x,
                     const Tensor& w, const Stream& stream, GradWrite dw_write) {
  linear_backward_checks(dx, dw, dbias, dy, x, w, stream, "linear_backward");
  MT_DISPATCH(dy.device(), linear_backward, dx, dw, dbias, dy, x, w, stream, dw_write);
}

void gelu_linear_backward(const Tensor& dpre, const Tensor& dpre_bias, const Tensor& dw, const Tensor& dbias,
                          const Tensor& dy, const Tensor& x, const Tensor& pre, const Tensor& w, const Stream& stream,
                          GradWrite dw_write) {
  MT_CHECK(pre.shape() == x.shape() && pre.dtype() == x.dtype() && pre.is_contiguous(),
           "gelu_linear_backward: pre {} must match x {}", pre.str(), x.str());
  MT_CHECK(dpre.shape() == x.shape() && dpre.dtype() == x.dtype() && dpre.is_contiguous(),
           "gelu_linear_backward: dpre {} must match x {}", dpre.str(), x.str());
  MT_CHECK(dpre.data() != dy.data() && dpre.data() != x.data() && dpre.data() != pre.data(),
           "gelu_linear_backward: dpre may not alias dy, x or pre");
  const int64_t k = w.ndim() == 2 ? w.size(1) : -1;
  if (!dpre_bias.empty()) {
    MT_CHECK(dpre_bias.dtype() == DType::kF32 && dpre_bias.ndim() == 1 && dpre_bias.size(0) == k &&
                 dpre_bias.is_contiguous(),
             "gelu_linear_backward: dpre_bias {} expected fp32[{}]", dpre_bias.str(), k);
  }
  check_same_device({&dpre, &dpre_bias, &pre});
  linear_backward_checks(dpre, dw, dbias, dy, x, w, stream, "gelu_linear_backward");
  MT_DISPATCH(dy.device(), gelu_linear_backward, dpre, dpre_bias, dw, dbias, dy, x, pre, w, stream, dw_write);
}

}  // namespace mt
