// Rows of a row-wise op (norms): a tensor [..., h] whose last dimension is contiguous (stride 1)
// and whose rows are addressed through the strides of at most two leading dimensions, so that an
// op can work in place on a strided view — e.g. the query heads of the fused QKV output
// [s·b·g, qpg + 2, d] sliced to [s·b·g, qpg, d] (q/k layernorm) — without copies.
#pragma once
#include <cstdint>

#include "core/check.h"
#include "core/dtype.h"  // MT_HD
#include "core/tensor.h"

namespace mt {

struct RowMap {
  int64_t rows = 0;          ///< number of rows
  int64_t inner = 1;         ///< rows per outer step (the second-to-last dimension's size)
  int64_t outer_stride = 0;  ///< element stride between outer steps
  int64_t inner_stride = 0;  ///< element stride between rows of one outer step
  /// Element offset of row r.
  MT_HD int64_t offset(int64_t r) const { return (r / inner) * outer_stride + (r % inner) * inner_stride; }
  bool contiguous(int64_t h) const { return inner_stride == h && (rows <= inner || outer_stride == inner * h); }
};

/// The RowMap of x [..., h]: dimensions before the last two must be mergeable into one stride.
/// Errors: mt::Error naming `fn` and x when the last dimension is not contiguous or the leading
/// dimensions cannot be addressed with two strides.
inline RowMap row_map(const Tensor& x, const char* fn) {
  MT_CHECK(x.ndim() >= 1 && x.stride(-1) == 1, "{}: the last dimension of {} must be contiguous", fn, x.str());
  RowMap m;
  const int nd = x.ndim();
  m.rows = x.numel() / (x.size(-1) > 0 ? x.size(-1) : 1);
  if (nd == 1) {
    m.inner = 1;
    m.inner_stride = m.outer_stride = x.size(0);
    return m;
  }
  m.inner = x.size(nd - 2);
  m.inner_stride = x.stride(nd - 2);
  if (nd == 2) {
    m.outer_stride = m.inner * m.inner_stride;
    return m;
  }
  // Dimensions 0 .. nd-3 must form one uniformly strided run.
  m.outer_stride = x.stride(nd - 3);
  int64_t expect = m.outer_stride;
  for (int d = nd - 3; d >= 0; --d) {
    MT_CHECK(x.size(d) == 1 || x.stride(d) == expect,
             "{}: the leading dimensions of {} cannot be addressed as rows (dim {} has stride {}, expected {})", fn,
             x.str(), d, x.stride(d), expect);
    expect *= x.size(d);
  }
  return m;
}

}  // namespace mt
