// Argument validation and backend dispatch for ops/attention.h.
#include "ops/attention.h"

#include <cmath>

#include "ops/attention_impl.h"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

void check_config(const AttentionConfig& c, const char* op) {
  MT_CHECK(c.seq > 0 && c.batch > 0 && c.heads > 0 && c.head_dim > 0,
           "{}: seq={} batch={} heads={} head_dim={} must be positive", op, c.seq, c.batch, c.heads, c.head_dim);
  MT_CHECK(c.groups >= 0 && (c.groups == 0 || c.heads % c.groups == 0),
           "{}: groups={} (key/value heads) must divide heads={}", op, c.groups, c.heads);
  MT_CHECK(std::isfinite(c.softmax_scale) && c.softmax_scale != 0.f, "{}: softmax_scale={} must be finite, non-zero",
           op, c.softmax_scale);
  MT_CHECK(c.dropout_p >= 0.f && c.dropout_p < 1.f, "{}: dropout_p={} must be in [0, 1)", op, c.dropout_p);
  const int64_t total = c.total_heads > 0 ? c.total_heads : c.heads;
  MT_CHECK(c.total_heads >= 0 && c.head_offset >= 0 && c.head_offset + c.heads <= total,
           "{}: head_offset={} + heads={} exceeds total_heads={}", op, c.head_offset, c.heads, c.total_heads);
}

/// qkv-like ([s, b, g, qpg + 2, d] or [s, b, (n + 2g)·d]; qkv = true) or out-like ([s, b, n, d] or
/// [s, b, n·d]) tensor.
void check_sb_tensor(const Tensor& t, DType act, const AttentionConfig& c, bool qkv, const char* op,
                     const char* name) {
  MT_CHECK(!t.empty(), "{}: {} is missing", op, name);
  MT_CHECK(t.dtype() == act && t.is_contiguous(), "{}: {} {} must be contiguous {}", op, name, t.str(),
           dtype_name(act));
  const int64_t s = c.seq, b = c.batch, n = c.heads, d = c.head_dim, g = c.groups > 0 ? c.groups : n;
  const int64_t w = qkv ? n / g + 2 : 1, lead = qkv ? g : n;
  bool ok = t.ndim() >= 3 && t.size(0) == s && t.size(1) == b;
  if (ok && t.ndim() == 3) ok = t.size(2) == lead * w * d;
  else if (ok && t.ndim() == 4) ok = !qkv && t.size(2) == n && t.size(3) == d;
  else if (ok && t.ndim() == 5) ok = qkv && t.size(2) == g && t.size(3) == w && t.size(4) == d;
  else ok = false;
  if (qkv) {
    MT_CHECK(ok, "{}: {} has shape {}, expected [s={}, b={}, g={}, qpg+2={}, d={}] or [s, b, {}] (heads={})", op, name,
             t.shape_str(), s, b, g, w, d, g * w * d, n);
  } else {
    MT_CHECK(ok, "{}: {} has shape {}, expected [s={}, b={}, n={}, d={}] or [s, b, {}]", op, name, t.shape_str(), s,
             b, n, d, n * d);
  }
}

void check_buffer(const Tensor& t, DType act, int64_t numel, const char* shape, const char* op, const char* name) {
  MT_CHECK(!t.empty(), "{}: buffer {} ({}) is missing", op, name, shape);
  MT_CHECK(t.dtype() == act && t.is_contiguous() && t.numel() == numel,
           "{}: buffer {} is {}, expected a contiguous {} {} with {} elements", op, name, t.str(), dtype_name(act),
           shape, numel);
}

void check_buffers(const AttentionBuffers& buf, DType act, const AttentionConfig& c, bool backward, const char* op) {
  const int64_t bn = c.batch * c.heads, bg = c.batch * (c.groups > 0 ? c.groups : c.heads);
  const int64_t nd = bn * c.seq * c.head_dim, gd = bg * c.seq * c.head_dim, ns = bn * c.seq * c.seq;
  check_buffer(buf.q, act, nd, "[b, n, s, d]", op, "q");
  check_buffer(buf.k, act, gd, "[b, g, s, d]", op, "k");
  check_buffer(buf.v, act, gd, "[b, g, s, d]", op, "v");
  check_buffer(buf.probs, act, ns, "[b, n, s, s]", op, "probs");
  if (backward || c.dropout_p > 0.f) check_buffer(buf.scratch, act, ns, "[b, n, s, s]", op, "scratch");
  check_buffer(buf.dq, act, nd, "[b, n, s, d]", op, "dq");
  if (backward) {
    check_buffer(buf.dk, act, gd, "[b, g, s, d]", op, "dk");
    check_buffer(buf.dv, act, gd, "[b, g, s, d]", op, "dv");
  }
}

/// cfg.doc_start (optional): contiguous int32 [b, s] on the device of `like`; on the CPU also
/// 0 <= doc_start[b, i] <= i (on CUDA the values are trusted: checking them would need a copy).
void check_doc_start(const AttentionConfig& c, const Tensor& like, const char* op) {
  const Tensor& t = c.doc_start;
  if (t.empty()) return;
  MT_CHECK(t.dtype() == DType::kI32 && t.is_contiguous() && t.ndim() == 2 && t.size(0) == c.batch &&
               t.size(1) == c.seq,
           "{}: doc_start is {}, expected a contiguous int32 [b={}, s={}]", op, t.str(), c.batch, c.seq);
  MT_CHECK(t.device() == like.device(), "{}: doc_start on {} but tensors on {}", op, t.device().str(),
           like.device().str());
  if (!t.device().is_cpu()) return;
  const int32_t* ds = t.data_as<int32_t>();
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < c.seq; ++i) {
      const int32_t v = ds[b * c.seq + i];
      MT_CHECK(v >= 0 && v <= i, "{}: doc_start[{}, {}] = {} must be in [0, {}]", op, b, i, v, i);
    }
  }
}

void check_devices(const Tensor& a, const Tensor& b, const AttentionBuffers& buf, const Stream& stream,
                   const char* op) {
  check_same_device({&a, &b, &buf.q, &buf.k, &buf.v, &buf.probs, &buf.scratch, &buf.dq, &buf.dk, &buf.dv});
  MT_CHECK(stream.device() == a.device(), "{}: stream on {} but tensors on {}", op, stream.device().str(),
           a.device().str());
}

}  // namespace

void attention_forward(const Tensor& out, const Tensor& qkv, const AttentionBuffers& buf, const AttentionConfig& cfg,
                       const Stream& stream) {
  const char* op = "attention_forward";
  check_config(cfg, op);
  const DType act = qkv.dtype();
  MT_CHECK(op_checks::is_float(act), "{}: act dtype {} must be fp32/bf16/fp16", op, dtype_name(act));
  check_sb_tensor(qkv, act, cfg, true, op, "qkv");
  check_sb_tensor(out, act, cfg, false, op, "out");
  check_buffers(buf, act, cfg, false, op);
  check_devices(out, qkv, buf, stream, op);
  check_doc_start(cfg, qkv, op);
  MT_DISPATCH(out.device(), attention_forward, out, qkv, buf, cfg, stream);
}

void attention_backward(const Tensor& dqkv, const Tensor& dout, const AttentionBuffers& buf,
                        const AttentionConfig& cfg, const Stream& stream) {
  const char* op = "attention_backward";
  check_config(cfg, op);
  const DType act = dout.dtype();
  MT_CHECK(op_checks::is_float(act), "{}: act dtype {} must be fp32/bf16/fp16", op, dtype_name(act));
  check_sb_tensor(dqkv, act, cfg, true, op, "dqkv");
  check_sb_tensor(dout, act, cfg, false, op, "dout");
  check_buffers(buf, act, cfg, true, op);
  check_devices(dqkv, dout, buf, stream, op);
  check_doc_start(cfg, dout, op);
  MT_DISPATCH(dout.device(), attention_backward, dqkv, dout, buf, cfg, stream);
}

}  // namespace mt
