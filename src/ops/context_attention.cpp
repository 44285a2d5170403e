// Argument validation and backend dispatch for ops/context_attention.h.
#include "ops/context_attention.h"

#include <algorithm>
#include <cstdint>

#include <fmt/ranges.h>

#include "ops/attention_checks.h"
#include "ops/context_attention_impl.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

void check_block(const ContextAttentionConfig& c, int64_t sq, int64_t sk, const char* fn);

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
  if (c.block != ContextBlockMask::kPositions && qkv.device().is_cpu()) check_block(c, sq, sk, fn);
}

/// The caller's ContextBlockMask against the positions (host memory only: the CUDA backend trusts it).
void check_block(const ContextAttentionConfig& c, int64_t sq, int64_t sk, const char* fn) {
  const int32_t* q = c.q_pos.data_as<int32_t>();
  const int32_t* k = c.k_pos.data_as<int32_t>();
  if (c.block == ContextBlockMask::kCausal) {
    MT_CHECK(sq == sk, "{}: a causal block needs as many keys as queries, got sq={} sk={}", fn, sq, sk);
    for (int64_t i = 0; i < sq; ++i)
      MT_CHECK(q[i] == k[i] && (i == 0 || q[i] > q[i - 1]),
               "{}: a causal block needs equal, ascending query and key positions; at row {}: q_pos {} k_pos {} "
               "(previous q_pos {})",
               fn, i, q[i], k[i], i > 0 ? q[i - 1] : -1);
    return;
  }
  int32_t qmin = q[0], kmax = k[0];
  for (int64_t i = 1; i < sq; ++i) qmin = std::min(qmin, q[i]);
  for (int64_t j = 1; j < sk; ++j) kmax = std::max(kmax, k[j]);
  MT_CHECK(kmax <= qmin, "{}: a full block needs every key at or before every query, got key position {} after query "
           "position {}", fn, kmax, qmin);
}

/// A workspace of at least `need` bytes, 16-byte aligned, on the device of qkv.
void check_workspace(const Tensor& ws, size_t need, const Tensor& qkv, const char* fn) {
  const size_t have = ws.empty() ? 0 : static_cast<size_t>(ws.numel()) * dtype_size(ws.dtype());
  MT_CHECK(!ws.empty() && ws.is_contiguous() && have >= need && reinterpret_cast<uintptr_t>(ws.data()) % 16 == 0 &&
               ws.device() == qkv.device(),
           "{}: workspace {} must be contiguous, 16-byte aligned, on {} and hold {} bytes (has {})", fn,
           ws.empty() ? std::string("none") : ws.str(), qkv.device().str(), need, have);
}

size_t pad256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

ContextAttentionWorkspace context_attention_forward_layout(const ContextAttentionConfig& c, int64_t sq) {
  ContextAttentionWorkspace w;
  if (!c.cudnn) return w;
  const size_t rows = static_cast<size_t>(sq * c.batch * c.heads()), d = static_cast<size_t>(c.head_dim);
  w.out = 0;
  w.stats = pad256(rows * d * 2);
  w.bytes = w.stats + pad256(rows * sizeof(float));
  if (c.queries_per_group > 1) {
    w.q = w.bytes;
    w.bytes += pad256(rows * d * 2);
  }
  return w;
}

ContextAttentionWorkspace context_attention_backward_layout(const ContextAttentionConfig& c, int64_t sq,
                                                            int64_t sk) {
  ContextAttentionWorkspace w;
  const size_t rows = static_cast<size_t>(sq * c.batch * c.heads()), d = static_cast<size_t>(c.head_dim);
  w.delta = 0;
  w.dq_accum = pad256(rows * sizeof(float));
  w.bytes = w.dq_accum + rows * d * sizeof(float);
  if (!c.cudnn) return w;
  w.stats = pad256(w.bytes);
  w.dq = w.stats + pad256(rows * sizeof(float));
  w.dkv = w.dq + pad256(rows * d * 2);
  w.bytes = w.dkv + pad256(static_cast<size_t>(sk * c.batch * c.groups * 2) * d * 2);
  if (c.queries_per_group > 1) {
    w.q = w.bytes;
    w.bytes += pad256(rows * d * 2);
  }
  return w;
}

void context_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                               const Tensor& workspace, const ContextAttentionConfig& cfg, bool merge,
                               const Stream& stream) {
  constexpr const char* fn = "context_attention_forward";
  check_args(out, lse, qkv, kv, cfg, fn);
  if (cfg.cudnn) check_workspace(workspace, context_attention_forward_workspace_bytes(cfg, qkv.size(0)), qkv, fn);
  op_checks::check_stream(stream, qkv, fn);
  MT_DISPATCH(qkv.device(), context_attention_forward, out, lse, qkv, kv, workspace, cfg, merge, stream);
}

size_t context_attention_forward_workspace_bytes(const ContextAttentionConfig& cfg, int64_t sq) {
  return context_attention_forward_layout(cfg, sq).bytes;
}

size_t context_attention_dq_accum_offset(const ContextAttentionConfig& cfg, int64_t sq) {
  return context_attention_backward_layout(cfg, sq, 0).dq_accum;
}

size_t context_attention_workspace_bytes(const ContextAttentionConfig& cfg, int64_t sq, int64_t sk) {
  return context_attention_backward_layout(cfg, sq, sk).bytes;
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
  if (!workspace.empty() || !qkv.device().is_cpu() || cfg.cudnn)  // CUDA: required (D_i, dQ sums); CPU: unused
    check_workspace(workspace, context_attention_workspace_bytes(cfg, qkv.size(0), kv.size(0)), qkv, fn);
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

void permute_blocks(const Tensor& y, const Tensor& x, int64_t outer, const std::vector<int>& perm, bool inverse,
                    const Stream& stream) {
  constexpr const char* fn = "permute_blocks";
  const int64_t k = static_cast<int64_t>(perm.size());
  MT_CHECK(k >= 1 && k <= 128 && outer >= 1 && x.numel() % (outer * k) == 0,
           "{}: outer={} x {} blocks (at most 128) must divide the {} elements of x {}", fn, outer, k, x.numel(),
           x.str());
  std::vector<bool> seen(static_cast<size_t>(k), false);
  for (int p : perm) {
    MT_CHECK(p >= 0 && p < k && !seen[static_cast<size_t>(p)], "{}: perm [{}] is not a permutation of 0..{}", fn,
             fmt::join(perm, ", "), k - 1);
    seen[static_cast<size_t>(p)] = true;
  }
  MT_CHECK(y.numel() == x.numel() && y.dtype() == x.dtype() && y.device() == x.device() && x.is_contiguous() &&
               y.is_contiguous() && x.data() != y.data(),
           "{}: y {} and x {} must be contiguous, distinct, of the same numel, dtype and device", fn, y.str(), x.str());
  op_checks::check_stream(stream, x, fn);
  MT_DISPATCH(x.device(), permute_blocks, y, x, outer, perm, inverse, stream);
}

}  // namespace mt
