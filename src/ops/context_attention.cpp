// Argument validation and backend dispatch for ops/context_attention.h.
#include "ops/context_attention.h"

#include <cstdint>

#include <fmt/ranges.h>

#include "ops/attention_checks.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

void check_shape(const Tensor& t, const std::vector<int64_t>& shape, const char* fn, const char* name) {
  MT_CHECK(!t.empty(), "{}: {} is missing", fn, name);
  MT_CHECK(t.is_contiguous(), "{}: {} must be contiguous, got {}", fn, name, t.str());
  int64_t n = 1;
  for (int64_t x : shape) n *= x;
  MT_CHECK(t.numel() == n && t.ndim() >= 1 && t.size(0) == shape[0], "{}: {} has shape {}, expected {} ({} elements)",
           fn, name, t.shape_str(), fmt::join(shape, "x"), n);
}

void check_args(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                const ContextAttentionConfig& c, const char* fn) {
  MT_CHECK(c.groups > 0 && c.queries_per_group > 0, "{}: groups={} and queries_per_group={} must be positive", fn,
           c.groups, c.queries_per_group);
  MT_CHECK(qkv.ndim() >= 1 && kv.ndim() >= 1, "{}: qkv {} and kv {} need a sequence dimension", fn, qkv.str(),
           kv.str());
  const attention_checks::AttentionSpec spec{fn,         c.batch,         qkv.size(0), c.heads(),     c.groups,
                                             c.head_dim, c.softmax_scale, c.dropout_p, c.head_offset, c.total_heads};
  attention_checks::check_spec(spec);
  attention_checks::check_fused_head_dim(spec, qkv.device());
  op_checks::check_act(qkv, fn, "qkv");
  const int64_t sq = qkv.size(0), sk = kv.size(0), b = c.batch, g = c.groups, w = c.queries_per_group + 2,
                d = c.head_dim;
  check_shape(qkv, {sq, b, g, w, d}, fn, "qkv");
  check_shape(kv, {sk, b, g, 2, d}, fn, "kv");
  check_shape(out, {sq, b, c.heads(), d}, fn, "out");
  check_shape(lse, {sq, b, c.heads()}, fn, "lse");
  MT_CHECK(kv.dtype() == qkv.dtype() && out.dtype() == qkv.dtype(), "{}: kv {} and out {} must have qkv's dtype {}",
           fn, kv.str(), out.str(), qkv.str());
  MT_CHECK(lse.dtype() == DType::kF32, "{}: lse must be fp32, got {}", fn, lse.str());
  auto pos = [&](const Tensor& p, int64_t n, const char* name) {
    MT_CHECK(!p.empty() && p.dtype() == DType::kI32 && p.is_contiguous() && p.numel() == n,
             "{}: {} must be a contiguous int32 tensor of {} positions, got {}", fn, name, n, p.empty() ? "none" : p.str());
    MT_CHECK(p.device() == qkv.device(), "{}: {} on {} but qkv on {}", fn, name, p.device().str(), qkv.device().str());
  };
  pos(c.q_pos, sq, "q_pos");
  pos(c.k_pos, sk, "k_pos");
  attention_checks::check_doc_start(c.doc_start, b, sq, qkv.device(), true, false, fn);
  if (c.dropout_p > 0.f) {
    MT_CHECK(c.seq_length >= 1 && sq <= c.seq_length && sk <= c.seq_length,
             "{}: with dropout seq_length={} (the full sequence) must be >= 1 and hold sq={} and sk={}", fn,
             c.seq_length, sq, sk);
  }
  for (const Tensor* t : {&out, &lse, &kv})
    MT_CHECK(t->device() == qkv.device(), "{}: {} on another device than qkv {}", fn, t->str(), qkv.str());
}

}  // namespace

void context_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                               const ContextAttentionConfig& cfg, bool merge, const Stream& stream) {
  constexpr const char* fn = "context_attention_forward";
  check_args(out, lse, qkv, kv, cfg, fn);
  op_checks::check_stream(stream, qkv, fn);
  MT_DISPATCH(qkv.device(), context_attention_forward, out, lse, qkv, kv, cfg, merge, stream);
}

size_t context_attention_dq_accum_offset(const ContextAttentionConfig& cfg, int64_t sq) {
  const size_t rows = static_cast<size_t>(sq * cfg.batch * cfg.heads());
  return (rows * sizeof(float) + 255) / 256 * 256;
}

size_t context_attention_workspace_bytes(const ContextAttentionConfig& cfg, int64_t sq) {
  const size_t rows = static_cast<size_t>(sq * cfg.batch * cfg.heads());
  return context_attention_dq_accum_offset(cfg, sq) + rows * static_cast<size_t>(cfg.head_dim) * sizeof(float);
}

void context_attention_backward(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout, const Tensor& out,
                                const Tensor& lse, const Tensor& qkv, const Tensor& kv, const Tensor& workspace,
                                const ContextAttentionConfig& cfg, const Stream& stream) {
  constexpr const char* fn = "context_attention_backward";
  check_args(out, lse, qkv, kv, cfg, fn);
  op_checks::check_like(dqkv, qkv, fn, "dqkv", "qkv");
  MT_CHECK(dkv.numel() == kv.numel() && dkv.dtype() == kv.dtype() && dkv.is_contiguous(),
           "{}: dkv {} must match kv {}", fn, dkv.str(), kv.str());
  MT_CHECK(dout.numel() == out.numel() && dout.dtype() == out.dtype() && dout.is_contiguous(),
           "{}: dout {} must match out {}", fn, dout.str(), out.str());
  if (!workspace.empty() || !qkv.device().is_cpu()) {  // CUDA: required (D_i, dQ partial sums); CPU: unused
    const size_t need = context_attention_workspace_bytes(cfg, qkv.size(0));
    const size_t have = static_cast<size_t>(workspace.numel()) * dtype_size(workspace.dtype());
    MT_CHECK(!workspace.empty() && workspace.is_contiguous() && have >= need &&
                 reinterpret_cast<uintptr_t>(workspace.data()) % 16 == 0 && workspace.device() == qkv.device(),
             "{}: workspace {} must be contiguous, 16-byte aligned, on {} and hold {} bytes (has {})", fn,
             workspace.str(), qkv.device().str(), need, have);
  }
  op_checks::check_stream(stream, qkv, fn);
  MT_DISPATCH(qkv.device(), context_attention_backward, dqkv, dkv, dout, out, lse, qkv, kv, workspace, cfg, stream);
}

namespace {
void check_pack(const Tensor& kv, const Tensor& qkv, int64_t qpg, const char* fn) {
  MT_CHECK(qpg >= 1, "{}: queries_per_group={} must be >= 1", fn, qpg);
  op_checks::check_float(kv, fn, "kv");
  op_checks::check_float(qkv, fn, "qkv");
  MT_CHECK(kv.dtype() == qkv.dtype() && kv.device() == qkv.device(), "{}: kv {} and qkv {} differ in dtype or device",
           fn, kv.str(), qkv.str());
  MT_CHECK(kv.ndim() >= 1 && qkv.ndim() >= 1 && kv.size(-1) == qkv.size(-1),
           "{}: kv {} and qkv {} must end with the same head dimension", fn, kv.str(), qkv.str());
  MT_CHECK(kv.numel() % 2 == 0 && qkv.numel() % (qpg + 2) == 0 && kv.numel() / 2 == qkv.numel() / (qpg + 2),
           "{}: kv {} ([r, 2, d]) and qkv {} ([r, qpg+2={}, d]) do not have matching rows", fn, kv.str(), qkv.str(),
           qpg + 2);
}
}  // namespace

void kv_pack(const Tensor& kv, const Tensor& qkv, int64_t qpg, const Stream& stream) {
  check_pack(kv, qkv, qpg, "kv_pack");
  MT_DISPATCH(qkv.device(), kv_pack, kv, qkv, qpg, stream);
}

void kv_unpack(const Tensor& dqkv, const Tensor& dkv, int64_t qpg, const Stream& stream) {
  check_pack(dkv, dqkv, qpg, "kv_unpack");
  MT_DISPATCH(dqkv.device(), kv_unpack, dqkv, dkv, qpg, stream);
}

void transpose_blocks(const Tensor& y, const Tensor& x, int64_t a, int64_t b, const Stream& stream) {
  constexpr const char* fn = "transpose_blocks";
  MT_CHECK(a >= 1 && b >= 1 && x.numel() % (a * b) == 0, "{}: a={} x b={} must divide the {} elements of x {}", fn, a,
           b, x.numel(), x.str());
  MT_CHECK(y.numel() == x.numel() && y.dtype() == x.dtype() && y.device() == x.device() && x.is_contiguous() &&
               y.is_contiguous() && x.data() != y.data(),
           "{}: y {} and x {} must be contiguous, distinct, of the same numel, dtype and device", fn, y.str(), x.str());
  MT_DISPATCH(x.device(), transpose_blocks, y, x, a, b, stream);
}

}  // namespace mt
