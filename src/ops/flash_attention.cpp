// Argument validation and backend dispatch for ops/flash_attention.h.
#include "ops/flash_attention.h"

#include "ops/attention_checks.h"
#include "ops/attention_impl.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

/// The configuration, qkv, out and lse (forward and backward alike), the stream and the document mask.
attention_checks::AttentionSpec check_call(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                           const FlashAttentionConfig& cfg, const Stream& stream, const char* fn) {
  MT_CHECK(cfg.groups > 0 && cfg.queries_per_group > 0, "{}: groups={} and queries_per_group={} must be positive", fn,
           cfg.groups, cfg.queries_per_group);
  const attention_checks::AttentionSpec s{
      fn,           cfg.batch,         cfg.seq,       cfg.heads(),     cfg.groups,
      cfg.head_dim, cfg.softmax_scale, cfg.dropout_p, cfg.head_offset, cfg.total_heads};
  attention_checks::check_spec(s);
  const DType act = qkv.dtype();
  attention_checks::check_qkv(qkv, act, s, "qkv");
  attention_checks::check_out(out, act, s, "out");
  MT_CHECK(!lse.empty(), "{}: lse is missing", fn);
  op_checks::check_stats(lse, s.batch * s.heads * s.seq, fn, "lse [b, n, s]");
  op_checks::check_stream(stream, qkv, fn);
  attention_checks::check_doc_start(cfg.doc_start, s.batch, s.seq, qkv.device(), false, true, fn);
  attention_checks::check_fused_head_dim(s, qkv.device());
  return s;
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
  check_call(out, lse, qkv, cfg, stream, fn);
  check_same_device({&out, &lse, &qkv});
  MT_DISPATCH(qkv.device(), flash_attention_forward, out, lse, qkv, cfg, stream);
}

void flash_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& qkv, const Tensor& workspace, const FlashAttentionConfig& cfg,
                              const Stream& stream) {
  const char* fn = "flash_attention_backward";
  const attention_checks::AttentionSpec s = check_call(out, lse, qkv, cfg, stream, fn);
  attention_checks::check_qkv(dqkv, qkv.dtype(), s, "dqkv");
  attention_checks::check_out(dout, qkv.dtype(), s, "dout");
  const size_t need = flash_attention_workspace_bytes(cfg);
  MT_CHECK(!workspace.empty() && workspace.is_contiguous() && workspace.nbytes() >= need,
           "{}: workspace {} must be contiguous with at least {} bytes (flash_attention_workspace_bytes)", fn,
           workspace.str(), need);
  MT_CHECK(reinterpret_cast<uintptr_t>(workspace.data()) % 16 == 0, "{}: workspace {} at {} must be 16-byte aligned",
           fn, workspace.str(), workspace.data());
  check_same_device({&dqkv, &dout, &out, &lse, &qkv, &workspace});
  MT_DISPATCH(qkv.device(), flash_attention_backward, dqkv, dout, out, lse, qkv, workspace, cfg, stream);
}

}  // namespace mt
