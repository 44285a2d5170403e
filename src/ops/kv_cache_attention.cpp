// Argument validation and backend dispatch for ops/kv_cache_attention.h.
#include "ops/kv_cache_attention.h"

#include "ops/attention_checks.h"
#include "ops/op_checks.h"

namespace mt {

void kv_cache_attention_forward(const Tensor& out, const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                                const KvCacheAttentionConfig& cfg, const Stream& stream) {
  constexpr const char* fn = "kv_cache_attention_forward";
  op_checks::check_act(qkv, fn, "qkv");
  op_checks::check_stream(stream, qkv, fn);
  MT_CHECK(qkv.ndim() == 5 && qkv.size(3) >= 3 && qkv.is_contiguous(),
           "{}: qkv {} must be a contiguous [s, b, g, qpg + 2, d] tensor", fn, qkv.str());
  const int64_t s = qkv.size(0), b = qkv.size(1), g = qkv.size(2), qpg = qkv.size(3) - 2, d = qkv.size(4);
  attention_checks::check_spec({fn, b, s, g * qpg, g, d, cfg.softmax_scale});
  for (const Tensor* c : {&k_cache, &v_cache}) {
    MT_CHECK(c->dtype() == qkv.dtype() && c->device() == qkv.device(), "{}: cache {} must have the dtype and device "
             "of qkv {}", fn, c->str(), qkv.str());
    MT_CHECK(c->ndim() == 4 && c->size(0) == b && c->size(1) == g && c->size(3) == d && c->is_contiguous(),
             "{}: cache {} must be a contiguous [b, g, S_max, d] = [{}, {}, S_max, {}] tensor", fn, c->str(), b, g, d);
  }
  MT_CHECK(k_cache.size(2) == v_cache.size(2), "{}: k_cache {} and v_cache {} differ", fn, k_cache.str(),
           v_cache.str());
  MT_CHECK(cfg.offset >= 0 && cfg.offset + s <= k_cache.size(2),
           "{}: offset {} + {} new tokens outside the cache of {} positions", fn, cfg.offset, s, k_cache.size(2));
  MT_CHECK(out.dtype() == qkv.dtype() && out.device() == qkv.device(), "{}: out {} must have the dtype and device of "
           "qkv {}", fn, out.str(), qkv.str());
  MT_CHECK(out.numel() == s * b * g * qpg * d && out.is_contiguous(), "{}: out {} must be a contiguous [s, b, n·d] = "
           "[{}, {}, {}] tensor", fn, out.str(), s, b, g * qpg * d);
  MT_DISPATCH(qkv.device(), kv_cache_attention_forward, out, qkv, k_cache, v_cache, cfg, stream);
}

}  // namespace mt
