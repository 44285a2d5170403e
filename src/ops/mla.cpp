// Argument validation and backend dispatch for ops/mla.h.
#include "ops/mla.h"

#include <algorithm>

#include "ops/op_checks.h"

namespace mt {
namespace {

using op_checks::check_act;

/// The packed sizes, checked: T tokens, n heads, D, d_n, d_r, d_v.
struct PackShape {
  int64_t tokens, heads, d, dn, dr, dv;
};

PackShape check_pack(const Tensor& qkv, const Tensor& q, const Tensor& kv, const Tensor& k_pe, const Stream& stream,
                     const char* fn) {
  for (const Tensor* t : {&qkv, &q, &kv, &k_pe}) {
    check_act(*t, fn, "tensor");
    MT_CHECK(t->is_contiguous() && t->dtype() == qkv.dtype() && t->device() == qkv.device(),
             "{}: {} must be contiguous with qkv's dtype and device ({})", fn, t->str(), qkv.str());
  }
  MT_CHECK(qkv.ndim() >= 3 && qkv.size(-2) == 3 && q.ndim() >= 2 && kv.ndim() >= 2 && k_pe.ndim() >= 1,
           "{}: qkv {} must be [T, n, 3, D], q {} [T, n, d_n + d_r], kv {} [T, n, d_n + d_v], k_pe {} [T, d_r]", fn,
           qkv.str(), q.str(), kv.str(), k_pe.str());
  PackShape p{};
  p.d = qkv.size(-1);
  p.heads = qkv.size(-3);
  p.dr = k_pe.size(-1);
  p.tokens = p.heads > 0 ? qkv.numel() / (3 * p.heads * std::max<int64_t>(p.d, 1)) : 0;
  p.dn = q.size(-1) - p.dr;
  p.dv = kv.size(-1) - p.dn;
  MT_CHECK(p.dn > 0 && p.dv > 0 && p.dr > 0 && q.size(-2) == p.heads && kv.size(-2) == p.heads &&
               q.numel() == p.tokens * p.heads * (p.dn + p.dr) && kv.numel() == p.tokens * p.heads * (p.dn + p.dv) &&
               k_pe.numel() == p.tokens * p.dr && p.d >= p.dn + p.dr && p.d >= p.dv,
           "{}: shapes disagree: qkv {} ([T, n, 3, D], D >= d_n + d_r and >= d_v), q {} ([T, n, d_n + d_r]), kv {} "
           "([T, n, d_n + d_v]), k_pe {} ([T, d_r])",
           fn, qkv.str(), q.str(), kv.str(), k_pe.str());
  MT_CHECK(stream.device().type == qkv.device().type, "{}: stream on {} but qkv {}", fn, stream.device().str(),
           qkv.str());
  return p;
}

}  // namespace

void mla_qkv_pack(const Tensor& qkv, const Tensor& q, const Tensor& kv, const Tensor& k_pe, const Stream& stream) {
  check_pack(qkv, q, kv, k_pe, stream, "mla_qkv_pack");
  MT_DISPATCH(qkv.device(), mla_qkv_pack, qkv, q, kv, k_pe, stream);
}

void mla_qkv_unpack_grad(const Tensor& dq, const Tensor& dkv, const Tensor& dk_pe, const Tensor& dqkv,
                         const Stream& stream) {
  check_pack(dqkv, dq, dkv, dk_pe, stream, "mla_qkv_unpack_grad");
  MT_DISPATCH(dqkv.device(), mla_qkv_unpack_grad, dq, dkv, dk_pe, dqkv, stream);
}

void mla_context_unpack(const Tensor& out, const Tensor& context, int64_t heads, bool pad, const Stream& stream) {
  const char* fn = "mla_context_unpack";
  check_act(out, fn, "out");
  check_act(context, fn, "context");
  MT_CHECK(out.is_contiguous() && context.is_contiguous() && out.dtype() == context.dtype() &&
               out.device() == context.device(),
           "{}: out {} and context {} must be contiguous, same dtype and device", fn, out.str(), context.str());
  MT_CHECK(heads > 0 && out.ndim() >= 1 && context.ndim() >= 1 && out.size(-1) % heads == 0 &&
               context.size(-1) % heads == 0 && out.size(-1) / heads <= context.size(-1) / heads &&
               out.numel() / out.size(-1) == context.numel() / context.size(-1),
           "{}: out {} must be [T, n·d_v] and context {} [T, n·D] with n = {} heads, d_v <= D", fn, out.str(),
           context.str(), heads);
  MT_CHECK(stream.device().type == out.device().type, "{}: stream on {} but out {}", fn, stream.device().str(),
           out.str());
  MT_DISPATCH(out.device(), mla_context_unpack, out, context, heads, pad, stream);
}

void mla_latent_append(const Tensor& ckv_cache, const Tensor& kpe_cache, const Tensor& c_kv, const Tensor& qkv,
                       int64_t offset, const Stream& stream) {
  const char* fn = "mla_latent_append";
  for (const Tensor* t : {&ckv_cache, &kpe_cache, &c_kv, &qkv}) {
    check_act(*t, fn, "tensor");
    MT_CHECK(t->is_contiguous() && t->dtype() == qkv.dtype() && t->device() == qkv.device(),
             "{}: {} must be contiguous with qkv's dtype and device ({})", fn, t->str(), qkv.str());
  }
  MT_CHECK(ckv_cache.ndim() == 3 && kpe_cache.ndim() == 3 && c_kv.ndim() == 3 && qkv.ndim() == 5 &&
               qkv.size(3) == 3 && c_kv.size(0) == qkv.size(0) && c_kv.size(1) == qkv.size(1) &&
               ckv_cache.size(2) == c_kv.size(2) && kpe_cache.size(0) == ckv_cache.size(0) &&
               kpe_cache.size(1) == ckv_cache.size(1) && kpe_cache.size(2) <= qkv.size(4) &&
               qkv.size(1) <= ckv_cache.size(1) && offset >= 0 && offset + qkv.size(0) <= ckv_cache.size(0),
           "{}: ckv_cache {} [S_max, B, r_kv] and kpe_cache {} [S_max, B, d_r] cannot take c_kv {} [s, b, r_kv] and "
           "qkv {} [s, b, n, 3, D] at offset {}",
           fn, ckv_cache.str(), kpe_cache.str(), c_kv.str(), qkv.str(), offset);
  MT_CHECK(stream.device().type == qkv.device().type, "{}: stream on {} but qkv {}", fn, stream.device().str(),
           qkv.str());
  MT_DISPATCH(qkv.device(), mla_latent_append, ckv_cache, kpe_cache, c_kv, qkv, offset, stream);
}

void mla_latent_expand(const Tensor& key, const Tensor& value, const Tensor& kv_up, const Tensor& kpe_cache,
                       int64_t count, int64_t qk_head_dim, const Stream& stream) {
  const char* fn = "mla_latent_expand";
  for (const Tensor* t : {&key, &value, &kv_up, &kpe_cache}) {
    check_act(*t, fn, "tensor");
    MT_CHECK(t->is_contiguous() && t->dtype() == key.dtype() && t->device() == key.device(),
             "{}: {} must be contiguous with key's dtype and device ({})", fn, t->str(), key.str());
  }
  MT_CHECK(key.ndim() == 4 && value.shape() == key.shape() && kv_up.ndim() == 4 && kpe_cache.ndim() == 3 &&
               kv_up.size(2) == key.size(1) && kv_up.size(1) == kpe_cache.size(1) && key.size(0) <= kv_up.size(1) &&
               kpe_cache.size(0) == key.size(2) && count >= 0 && count <= kv_up.size(0) && count <= key.size(2),
           "{}: key/value {} [b, n, S_max, D], kv_up {} [P, B, n, d_n + d_v] and kpe_cache {} [S_max, B, d_r] "
           "disagree (count {})",
           fn, key.str(), kv_up.str(), kpe_cache.str(), count);
  const int64_t D = key.size(3), dr = kpe_cache.size(2), dn = qk_head_dim, dv = kv_up.size(3) - qk_head_dim;
  MT_CHECK(dn > 0 && dv > 0 && dn + dr <= D && dv <= D,
           "{}: head dims disagree: D {}, d_r {}, d_n {}, d_v {} (need d_n + d_r <= D, d_v <= D)", fn, D, dr, dn, dv);
  MT_CHECK(stream.device().type == key.device().type, "{}: stream on {} but key {}", fn, stream.device().str(),
           key.str());
  MT_DISPATCH(key.device(), mla_latent_expand, key, value, kv_up, kpe_cache, count, qk_head_dim, stream);
}

}  // namespace mt
