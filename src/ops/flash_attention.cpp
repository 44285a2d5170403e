// Argument validation and backend dispatch for ops/flash_attention.h.
#include "ops/flash_attention.h"

#include <cmath>

#include "ops/attention_impl.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

void check_config(const FlashAttentionConfig& c, const char* fn) {
  MT_CHECK(c.seq > 0 && c.batch > 0 && c.groups > 0 && c.queries_per_group > 0 && c.head_dim > 0,
           "{}: seq={} batch={} groups={} queries_per_group={} head_dim={} must be positive", fn, c.seq, c.batch,
           c.groups, c.queries_per_group, c.head_dim);
  MT_CHECK(std::isfinite(c.softmax_scale) && c.softmax_scale > 0.f, "{}: softmax_scale={} must be finite and > 0", fn,
           c.softmax_scale);
  MT_CHECK(c.dropout_p >= 0.f && c.dropout_p < 1.f, "{}: dropout_p={} must be in [0, 1)", fn, c.dropout_p);
  const int64_t n = c.heads(), total = c.total_heads > 0 ? c.total_heads : n;
  MT_CHECK(c.total_heads >= 0 && c.head_offset >= 0 && c.head_offset + n <= total,
           "{}: head_offset={} + heads={} (groups={} x queries_per_group={}) exceeds total_heads={}", fn,
           c.head_offset, n, c.groups, c.queries_per_group, c.total_heads);
}

/// qkv-like: [s, b, g, qpg + 2, d] or [s, b, g·(qpg+2)·d]; out-like: [s, b, n, d] or [s, b, n·d].
void check_sb(const Tensor& t, DType act, const FlashAttentionConfig& c, bool is_qkv, const char* fn,
              const char* name) {
  MT_CHECK(!t.empty(), "{}: {} is missing", fn, name);
  op_checks::check_act(t, fn, name);
  MT_CHECK(t.dtype() == act, "{}: {} {} must have the act dtype {}", fn, name, t.str(), dtype_name(act));
  const int64_t s = c.seq, b = c.batch, g = c.groups, w = c.queries_per_group + 2, n = c.heads(), d = c.head_dim;
  const int64_t row = is_qkv ? g * w * d : n * d;
  bool ok = t.ndim() >= 3 && t.size(0) == s && t.size(1) == b;
  if (ok && t.ndim() == 3) ok = t.size(2) == row;
  else if (ok && t.ndim() == 4) ok = !is_qkv && t.size(2) == n && t.size(3) == d;
  else if (ok && t.ndim() == 5) ok = is_qkv && t.size(2) == g && t.size(3) == w && t.size(4) == d;
  else ok = false;
  if (is_qkv) {
    MT_CHECK(ok, "{}: {} has shape {}, expected [s={}, b={}, g={}, qpg+2={}, d={}] or [s, b, {}]", fn, name,
             t.shape_str(), s, b, g, w, d, row);
  } else {
    MT_CHECK(ok, "{}: {} has shape {}, expected [s={}, b={}, n={}, d={}] or [s, b, {}]", fn, name, t.shape_str(), s,
             b, n, d, row);
  }
}

void check_lse(const Tensor& lse, const FlashAttentionConfig& c, const char* fn) {
  MT_CHECK(!lse.empty(), "{}: lse is missing", fn);
  op_checks::check_stats(lse, c.batch * c.heads() * c.seq, fn, "lse [b, n, s]");
}

/// cfg.doc_start (optional): contiguous int32 [b, s] on the device of `like`; on the CPU also
/// 0 <= doc_start[b, i] <= i (on CUDA the values are trusted: checking them would need a copy).
void check_doc_start(const FlashAttentionConfig& c, const Tensor& like, const char* fn) {
  const Tensor& t = c.doc_start;
  if (t.empty()) return;
  MT_CHECK(t.dtype() == DType::kI32 && t.is_contiguous() && t.ndim() == 2 && t.size(0) == c.batch &&
               t.size(1) == c.seq,
           "{}: doc_start is {}, expected a contiguous int32 [b={}, s={}]", fn, t.str(), c.batch, c.seq);
  MT_CHECK(t.device() == like.device(), "{}: doc_start on {} but tensors on {}", fn, t.device().str(),
           like.device().str());
  if (!t.device().is_cpu()) return;
  const int32_t* ds = t.data_as<int32_t>();
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < c.seq; ++i) {
      const int32_t v = ds[b * c.seq + i];
      MT_CHECK(v >= 0 && v <= i, "{}: doc_start[{}, {}] = {} must be in [0, {}]", fn, b, i, v, i);
    }
  }
}

void check_cuda_head_dim(const FlashAttentionConfig& c, const Tensor& like, const char* fn) {
  MT_CHECK(like.device().is_cpu() || c.head_dim <= 1024, "{}: head_dim={} exceeds the CUDA limit of 1024", fn,
           c.head_dim);
}

}  // namespace

size_t flash_attention_dq_accum_offset(const FlashAttentionConfig& cfg) {
  const size_t rows = static_cast<size_t>(cfg.batch * cfg.heads() * cfg.seq);
  return (rows * sizeof(float) + 255) / 256 * 256;
}

size_t flash_attention_workspace_bytes(const FlashAttentionConfig& cfg) {
  const size_t rows = static_cast<size_t>(cfg.batch * cfg.heads() * cfg.seq);
  return flash_attention_dq_accum_offset(cfg) + rows * static_cast<size_t>(cfg.head_dim) * sizeof(float);
}

bool flash_attention_cudnn_available() {
#ifdef MT_WITH_CUDNN
  return true;
#else
  return false;
#endif
}

AttnDropout flash_attention_dropout(const FlashAttentionConfig& cfg) {
  return make_attn_dropout(cfg.dropout_key, cfg.dropout_p, cfg.heads(), cfg.total_heads, cfg.head_offset, cfg.seq);
}

void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const FlashAttentionConfig& cfg,
                             const Stream& stream) {
  const char* fn = "flash_attention_forward";
  check_config(cfg, fn);
  const DType act = qkv.dtype();
  check_sb(qkv, act, cfg, true, fn, "qkv");
  check_sb(out, act, cfg, false, fn, "out");
  check_lse(lse, cfg, fn);
  check_same_device({&out, &lse, &qkv});
  op_checks::check_stream(stream, qkv, fn);
  check_doc_start(cfg, qkv, fn);
  check_cuda_head_dim(cfg, qkv, fn);
  MT_DISPATCH(qkv.device(), flash_attention_forward, out, lse, qkv, cfg, stream);
}

void flash_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& qkv, const Tensor& workspace, const FlashAttentionConfig& cfg,
                              const Stream& stream) {
  const char* fn = "flash_attention_backward";
  check_config(cfg, fn);
  const DType act = qkv.dtype();
  check_sb(qkv, act, cfg, true, fn, "qkv");
  check_sb(dqkv, act, cfg, true, fn, "dqkv");
  check_sb(out, act, cfg, false, fn, "out");
  check_sb(dout, act, cfg, false, fn, "dout");
  check_lse(lse, cfg, fn);
  const size_t need = flash_attention_workspace_bytes(cfg);
  MT_CHECK(!workspace.empty() && workspace.is_contiguous() && workspace.nbytes() >= need,
           "{}: workspace {} must be contiguous with at least {} bytes (flash_attention_workspace_bytes)", fn,
           workspace.str(), need);
  MT_CHECK(reinterpret_cast<uintptr_t>(workspace.data()) % 16 == 0, "{}: workspace {} at {} must be 16-byte aligned",
           fn, workspace.str(), workspace.data());
  check_same_device({&dqkv, &dout, &out, &lse, &qkv, &workspace});
  op_checks::check_stream(stream, qkv, fn);
  check_doc_start(cfg, qkv, fn);
  check_cuda_head_dim(cfg, qkv, fn);
  MT_DISPATCH(qkv.device(), flash_attention_backward, dqkv, dout, out, lse, qkv, workspace, cfg, stream);
}

}  // namespace mt
