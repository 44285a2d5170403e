// The attention ops' shared validation (ops/attention_checks.h).
#include "ops/attention_checks.h"

#include <cmath>

#include "ops/op_checks.h"

namespace mt::attention_checks {

void check_spec(const AttentionSpec& s) {
  MT_CHECK(s.batch > 0 && s.seq > 0 && s.heads > 0 && s.groups > 0 && s.head_dim > 0,
           "{}: batch={} seq={} heads={} groups={} head_dim={} must be positive", s.fn, s.batch, s.seq, s.heads,
           s.groups, s.head_dim);
  MT_CHECK(s.heads % s.groups == 0, "{}: groups={} (key/value heads) must divide heads={}", s.fn, s.groups, s.heads);
  MT_CHECK(std::isfinite(s.softmax_scale) && s.softmax_scale > 0.f, "{}: softmax_scale={} must be finite and > 0", s.fn,
           s.softmax_scale);
  MT_CHECK(s.dropout_p >= 0.f && s.dropout_p < 1.f, "{}: dropout_p={} must be in [0, 1)", s.fn, s.dropout_p);
  const int64_t total = s.total_heads > 0 ? s.total_heads : s.heads;
  MT_CHECK(s.total_heads >= 0 && s.head_offset >= 0 && s.head_offset + s.heads <= total,
           "{}: head_offset={} + heads={} exceeds total_heads={}", s.fn, s.head_offset, s.heads, s.total_heads);
}

void check_fused_head_dim(const AttentionSpec& s, const Device& device) {
  MT_CHECK(device.is_cpu() || s.head_dim <= kMaxFusedHeadDim, "{}: head_dim={} exceeds the CUDA limit of {}", s.fn,
           s.head_dim, kMaxFusedHeadDim);
}

void check_doc_start(const Tensor& doc, int64_t batch, int64_t rows, const Device& device, bool strided_rows,
                     bool local, const char* fn) {
  if (doc.empty()) return;
  const bool layout = doc.ndim() == 2 && doc.size(0) == batch && doc.size(1) == rows &&
                      (strided_rows ? doc.stride(1) == 1 && doc.stride(0) >= rows : doc.is_contiguous());
  MT_CHECK(doc.dtype() == DType::kI32 && layout, "{}: doc_start is {}, expected a{} int32 [b={}, s={}]{}", fn,
           doc.str(), strided_rows ? "n" : " contiguous", batch, rows,
           strided_rows ? " with unit stride along the sequence" : "");
  MT_CHECK(doc.device() == device, "{}: doc_start on {} but tensors on {}", fn, doc.device().str(), device.str());
  if (!local || !doc.device().is_cpu()) return;
  const int32_t* ds = doc.data_as<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < rows; ++i) {
      const int32_t v = ds[b * doc.stride(0) + i];
      MT_CHECK(v >= 0 && v <= i, "{}: doc_start[{}, {}] = {} must be in [0, {}]", fn, b, i, v, i);
    }
  }
}

namespace {

/// [s, b, lead, w, d] (w > 1: qkv), [s, b, lead, d] (w == 1: out) or the flat [s, b, lead·w·d].
bool sb_shape_ok(const Tensor& t, const AttentionSpec& s, int64_t lead, int64_t w) {
  if (t.ndim() < 3 || t.size(0) != s.seq || t.size(1) != s.batch) return false;
  if (t.ndim() == 3) return t.size(2) == lead * w * s.head_dim;
  if (t.ndim() == 4) return w == 1 && t.size(2) == lead && t.size(3) == s.head_dim;
  if (t.ndim() == 5) return w > 1 && t.size(2) == lead && t.size(3) == w && t.size(4) == s.head_dim;
  return false;
}

void check_act_like(const Tensor& t, DType act, const char* fn, const char* name) {
  MT_CHECK(!t.empty(), "{}: {} is missing", fn, name);
  op_checks::check_act(t, fn, name);
  MT_CHECK(t.dtype() == act, "{}: {} {} must have the act dtype {}", fn, name, t.str(), dtype_name(act));
}

}  // namespace

void check_qkv(const Tensor& t, DType act, const AttentionSpec& s, const char* name) {
  check_act_like(t, act, s.fn, name);
  const int64_t w = s.queries_per_group() + 2;
  MT_CHECK(sb_shape_ok(t, s, s.groups, w),
           "{}: {} has shape {}, expected [s={}, b={}, g={}, qpg+2={}, d={}] or [s, b, {}]", s.fn, name, t.shape_str(),
           s.seq, s.batch, s.groups, w, s.head_dim, s.groups * w * s.head_dim);
}

void check_out(const Tensor& t, DType act, const AttentionSpec& s, const char* name) {
  check_act_like(t, act, s.fn, name);
  MT_CHECK(sb_shape_ok(t, s, s.heads, 1), "{}: {} has shape {}, expected [s={}, b={}, n={}, d={}] or [s, b, {}]", s.fn,
           name, t.shape_str(), s.seq, s.batch, s.heads, s.head_dim, s.heads * s.head_dim);
}

}  // namespace mt::attention_checks
