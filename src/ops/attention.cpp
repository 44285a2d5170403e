// Argument validation and backend dispatch for ops/attention.h.
#include "ops/attention.h"

#include "ops/attention_checks.h"
#include "ops/attention_impl.h"
#include "ops/dispatch.h"

namespace mt {
namespace {

void check_buffer(const Tensor& t, DType act, int64_t numel, const char* shape, const char* op, const char* name) {
  MT_CHECK(!t.empty(), "{}: buffer {} ({}) is missing", op, name, shape);
  MT_CHECK(t.dtype() == act && t.is_contiguous() && t.numel() == numel,
           "{}: buffer {} is {}, expected a contiguous {} {} with {} elements", op, name, t.str(), dtype_name(act),
           shape, numel);
}

void check_buffers(const AttentionBuffers& buf, DType act, const attention_checks::AttentionSpec& c, bool backward,
                   bool dropout) {
  const char* op = c.fn;
  const int64_t bn = c.batch * c.heads, bg = c.batch * c.groups;
  const int64_t nd = bn * c.seq * c.head_dim, gd = bg * c.seq * c.head_dim, ns = bn * c.seq * c.seq;
  check_buffer(buf.q, act, nd, "[b, n, s, d]", op, "q");
  check_buffer(buf.k, act, gd, "[b, g, s, d]", op, "k");
  check_buffer(buf.v, act, gd, "[b, g, s, d]", op, "v");
  check_buffer(buf.probs, act, ns, "[b, n, s, s]", op, "probs");
  if (backward || dropout) check_buffer(buf.scratch, act, ns, "[b, n, s, s]", op, "scratch");
  check_buffer(buf.dq, act, nd, "[b, n, s, d]", op, "dq");
  if (backward) {
    check_buffer(buf.dk, act, gd, "[b, g, s, d]", op, "dk");
    check_buffer(buf.dv, act, gd, "[b, g, s, d]", op, "dv");
  }
}

/// Everything of one call: `sb` is qkv (forward) or dqkv (backward), `o` out or dout.
void check_call(const Tensor& sb, const Tensor& o, const AttentionBuffers& buf, const AttentionConfig& cfg,
                bool backward, const Stream& stream) {
  const attention_checks::AttentionSpec s{backward ? "attention_backward" : "attention_forward", cfg.batch, cfg.seq,
                                          cfg.heads, cfg.groups == 0 ? cfg.heads : cfg.groups, cfg.head_dim,
                                          cfg.softmax_scale, cfg.dropout_p, cfg.head_offset, cfg.total_heads};
  attention_checks::check_spec(s);
  const DType act = backward ? o.dtype() : sb.dtype();
  attention_checks::check_qkv(sb, act, s, backward ? "dqkv" : "qkv");
  attention_checks::check_out(o, act, s, backward ? "dout" : "out");
  check_buffers(buf, act, s, backward, cfg.dropout_p > 0.f);
  check_same_device({&sb, &o, &buf.q, &buf.k, &buf.v, &buf.probs, &buf.scratch, &buf.dq, &buf.dk, &buf.dv});
  MT_CHECK(stream.device() == o.device(), "{}: stream on {} but tensors on {}", s.fn, stream.device().str(),
           o.device().str());
  attention_checks::check_doc_start(cfg.doc_start, s.batch, s.seq, o.device(), false, true, s.fn);
}

}  // namespace

void attention_forward(const Tensor& out, const Tensor& qkv, const AttentionBuffers& buf, const AttentionConfig& cfg,
                       const Stream& stream) {
  check_call(qkv, out, buf, cfg, false, stream);
  MT_DISPATCH(out.device(), attention_forward, out, qkv, buf, cfg, stream);
}

void attention_backward(const Tensor& dqkv, const Tensor& dout, const AttentionBuffers& buf,
                        const AttentionConfig& cfg, const Stream& stream) {
  check_call(dqkv, dout, buf, cfg, true, stream);
  MT_DISPATCH(dout.device(), attention_backward, dqkv, dout, buf, cfg, stream);
}

}  // namespace mt
