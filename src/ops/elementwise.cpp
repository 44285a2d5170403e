// Argument validation and backend dispatch for ops/elementwise.h.
#include "ops/elementwise.h"

#include <algorithm>

#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

using op_checks::check_act;
using op_checks::check_float;
using op_checks::check_stream;
using op_checks::is_float;

void check_same_shape(const Tensor& a, const Tensor& b, const char* fn, const char* na, const char* nb) {
  MT_CHECK(a.shape() == b.shape(), "{}: {} {} and {} {} must have the same shape", fn, na, a.str(), nb, b.str());
}

void check_dropout_args(float p, int64_t global_offset, const char* fn) {
  MT_CHECK(p >= 0.f && p < 1.f, "{}: dropout probability p={} must be in [0, 1)", fn, p);
  MT_CHECK(global_offset >= 0, "{}: global_offset={} must be >= 0", fn, global_offset);
}

/// Validates bias [h] against x [..., h]; returns h (1 when bias is empty: then no row structure).
int64_t check_bias(const Tensor& bias, const Tensor& x, DType dtype, const char* fn, const char* name) {
  if (bias.empty()) return 1;
  MT_CHECK(x.ndim() >= 1, "{}: x {} must have a last dimension when {} is given", fn, x.str(), name);
  int64_t h = x.size(-1);
  check_tensor(bias, dtype, {h}, name);
  return h;
}

/// Context parallelism (DropoutKey::cp_global): the flat index range [offset, offset + n) of a
/// CP rank's [s/N, b, h] activations covers up to two ranges that are contiguous in the full
/// tensor (the rank's two chunks). Calls run(begin, count, full_offset, key) once per piece
/// (local elements [begin, begin + count), their index in the full tensor starting at
/// full_offset; key without the CP fields). `row` (the bias width, 1 without one) must divide the
/// split so that every piece keeps whole rows. Without CP (or p = 0: nothing is drawn): one call.
template <typename Run>
void for_each_cp_piece(const DropoutKey& key, float p, int64_t offset, int64_t n, int64_t row, const char* fn,
                       Run&& run) {
  if (!key.cp_split() || p == 0.f || n == 0) {
    run(int64_t{0}, n, offset, key);
    return;
  }
  const int64_t E = key.cp_chunk_elems;
  MT_CHECK(offset + n <= 2 * E, "{}: elements [{}, {}) exceed the two context-parallel chunks of {} elements", fn,
           offset, offset + n, E);
  DropoutKey plain = key;
  plain.cp_size = 1;
  plain.cp_rank = 0;
  plain.cp_chunk_elems = 0;
  const int64_t first = offset < E ? std::min(n, E - offset) : 0;
  MT_CHECK(first % row == 0, "{}: the context-parallel chunk boundary (element {}) splits a row of {}", fn, E, row);
  if (first > 0) run(int64_t{0}, first, key.cp_global(offset), plain);
  if (first < n) run(first, n - first, key.cp_global(offset + first), plain);
}

/// Elements [begin, begin + count) of a contiguous tensor, as rows of `row` elements when row > 1.
Tensor piece(const Tensor& t, int64_t begin, int64_t count, int64_t row) {
  if (t.empty()) return t;
  const Tensor f = t.flat_range(begin, count);
  return row > 1 ? f.view({count / row, row}) : f;
}

}  // namespace

void cast(const Tensor& dst, const Tensor& src, const Stream& stream) {
  check_float(dst, "cast", "dst");
  check_float(src, "cast", "src");
  MT_CHECK(dst.numel() == src.numel(), "cast: dst {} and src {} must have the same number of elements", dst.str(),
           src.str());
  check_same_device({&dst, &src});
  check_stream(stream, dst, "cast");
  MT_DISPATCH(dst.device(), cast, dst, src, stream);
}

void add(const Tensor& y, const Tensor& a, const Tensor& b, const Stream& stream) {
  check_float(y, "add", "y");
  check_float(a, "add", "a");
  check_float(b, "add", "b");
  check_same_shape(y, a, "add", "y", "a");
  check_same_shape(y, b, "add", "y", "b");
  MT_CHECK(y.dtype() == a.dtype() && y.dtype() == b.dtype(), "add: dtypes differ: y {} a {} b {}", y.str(), a.str(),
           b.str());
  check_same_device({&y, &a, &b});
  check_stream(stream, y, "add");
  MT_DISPATCH(y.device(), add, y, a, b, stream);
}

void scale_inplace(const Tensor& x, float alpha, const Stream& stream) {
  check_float(x, "scale_inplace", "x");
  check_stream(stream, x, "scale_inplace");
  MT_DISPATCH(x.device(), scale_inplace, x, alpha, stream);
}

void fill(const Tensor& x, float value, const Stream& stream) {
  MT_CHECK(is_float(x.dtype()) || x.dtype() == DType::kI32, "fill: x must be fp32/bf16/fp16/int32, got {}",
           x.str());
  MT_CHECK(x.is_contiguous(), "fill: x must be contiguous, got {}", x.str());
  if (x.dtype() == DType::kI32) {
    MT_CHECK(value >= -2147483648.f && value < 2147483648.f &&
                 value == static_cast<float>(static_cast<int32_t>(value)),
             "fill: value {} is not an int32 for int32 tensor {}", value, x.str());
  }
  check_stream(stream, x, "fill");
  MT_DISPATCH(x.device(), fill, x, value, stream);
}

void bias_dropout_add_forward(const Tensor& out, const Tensor& x, const Tensor& bias, const Tensor& residual,
                              float p, const DropoutKey& key, int64_t global_offset, const Stream& stream) {
  const char* fn = "bias_dropout_add_forward";
  check_act(out, fn, "out");
  check_act(x, fn, "x");
  check_act(residual, fn, "residual");
  check_same_shape(out, x, fn, "out", "x");
  check_same_shape(out, residual, fn, "out", "residual");
  MT_CHECK(out.dtype() == x.dtype() && out.dtype() == residual.dtype(), "{}: dtypes differ: out {} x {} residual {}",
           fn, out.str(), x.str(), residual.str());
  check_bias(bias, x, x.dtype(), fn, "bias");
  check_dropout_args(p, global_offset, fn);
  check_same_device({&out, &x, &bias, &residual});
  check_stream(stream, out, fn);
  const int64_t row = bias.empty() ? 1 : bias.numel();
  for_each_cp_piece(key, p, global_offset, out.numel(), row, fn,
                    [&](int64_t b, int64_t n, int64_t off, const DropoutKey& k) {
                      if (n == out.numel()) {
                        MT_DISPATCH(out.device(), bias_dropout_add_forward, out, x, bias, residual, p, k, off, stream);
                      } else {
                        MT_DISPATCH(out.device(), bias_dropout_add_forward, piece(out, b, n, row), piece(x, b, n, row),
                                    bias, piece(residual, b, n, row), p, k, off, stream);
                      }
                    });
}

void bias_dropout_add_backward(const Tensor& dx, const Tensor& dbias, const Tensor& dout, float p,
                               const DropoutKey& key, int64_t global_offset, const Stream& stream) {
  const char* fn = "bias_dropout_add_backward";
  check_act(dout, fn, "dout");
  MT_CHECK(!dx.empty() || p == 0.f, "{}: dx may only be empty without dropout (p = 0), got p = {}", fn, p);
  if (!dx.empty()) {
    check_act(dx, fn, "dx");
    check_same_shape(dx, dout, fn, "dx", "dout");
    MT_CHECK(dx.dtype() == dout.dtype(), "{}: dtypes differ: dx {} dout {}", fn, dx.str(), dout.str());
  }
  check_bias(dbias, dout, DType::kF32, fn, "dbias");
  check_dropout_args(p, global_offset, fn);
  check_same_device({&dx, &dbias, &dout});
  check_stream(stream, dout, fn);
  if (dx.empty() && dbias.empty()) return;
  const int64_t row = dbias.empty() ? 1 : dbias.numel();
  for_each_cp_piece(key, p, global_offset, dout.numel(), row, fn,
                    [&](int64_t b, int64_t n, int64_t off, const DropoutKey& k) {
                      if (n == dout.numel()) {
                        MT_DISPATCH(dout.device(), bias_dropout_add_backward, dx, dbias, dout, p, k, off, stream);
                      } else {  // dbias accumulates (+=) over the pieces
                        MT_DISPATCH(dout.device(), bias_dropout_add_backward, piece(dx, b, n, row), dbias,
                                    piece(dout, b, n, row), p, k, off, stream);
                      }
                    });
}

void dropout_forward(const Tensor& y, const Tensor& x, float p, const DropoutKey& key, int64_t global_offset,
                     const Stream& stream) {
  const char* fn = "dropout_forward";
  check_act(y, fn, "y");
  check_act(x, fn, "x");
  check_same_shape(y, x, fn, "y", "x");
  MT_CHECK(y.dtype() == x.dtype(), "{}: dtypes differ: y {} x {}", fn, y.str(), x.str());
  check_dropout_args(p, global_offset, fn);
  check_same_device({&y, &x});
  check_stream(stream, y, fn);
  for_each_cp_piece(key, p, global_offset, y.numel(), 1, fn,
                    [&](int64_t b, int64_t n, int64_t off, const DropoutKey& k) {
                      if (n == y.numel()) {
                        MT_DISPATCH(y.device(), dropout_forward, y, x, p, k, off, stream);
                      } else {
                        MT_DISPATCH(y.device(), dropout_forward, piece(y, b, n, 1), piece(x, b, n, 1), p, k, off,
                                    stream);
                      }
                    });
}

}  // namespace mt
