// CPU reference of ops/kv_cache_attention.h (fp32): copy the new keys/values into the cache, then
// per (new token, sample, query head) a softmax over the cached keys up to the token's position.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/cpu/attention_common.h"
#include "ops/kv_cache_attention.h"

namespace mt::cpu {

void kv_cache_attention_forward(const Tensor& out, const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                                const KvCacheAttentionConfig& cfg, const Stream&) {
  const int64_t s = qkv.size(0), b = qkv.size(1), g = qkv.size(2), qpg = qkv.size(3) - 2, d = qkv.size(4);
  const int64_t smax = k_cache.size(2), off = cfg.offset;
  const float* x = qkv.data_as<float>();
  float* kc = k_cache.data_as<float>();
  float* vc = v_cache.data_as<float>();
  float* o = out.data_as<float>();
  const attn::Layout L = attn::qkv_layout(b, g, qpg, d);
  auto head = [&](int64_t i, int64_t bi, int64_t gi, int64_t hi) { return x + L.q(i, bi, gi, hi); };
  for (int64_t i = 0; i < s; ++i)
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t gi = 0; gi < g; ++gi) {
        const int64_t row = ((bi * g + gi) * smax + off + i) * d;
        std::memcpy(kc + row, head(i, bi, gi, qpg), static_cast<size_t>(d) * 4);
        std::memcpy(vc + row, head(i, bi, gi, qpg + 1), static_cast<size_t>(d) * 4);
      }
#pragma omp parallel
  {
    std::vector<float> p(static_cast<size_t>(off + s));
    std::vector<float> acc(static_cast<size_t>(d));
#pragma omp for collapse(3) schedule(static)
    for (int64_t i = 0; i < s; ++i)
      for (int64_t bi = 0; bi < b; ++bi)
        for (int64_t h = 0; h < g * qpg; ++h) {
          const int64_t gi = h / qpg, keys = off + i + 1;
          const float* q = head(i, bi, gi, h % qpg);
          const float* kb = kc + (bi * g + gi) * smax * d;
          const float* vb = vc + (bi * g + gi) * smax * d;
          float mx = -INFINITY;
          for (int64_t j = 0; j < keys; ++j) {
            p[j] = attn::dot(q, kb + j * d, d) * cfg.softmax_scale;
            mx = std::max(mx, p[j]);
          }
          float z = 0;
          for (int64_t j = 0; j < keys; ++j) z += (p[j] = std::exp(p[j] - mx));
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t j = 0; j < keys; ++j)
            for (int64_t c = 0; c < d; ++c) acc[c] += p[j] * vb[j * d + c];
          float* dst = o + L.o(i, bi, h);
          for (int64_t c = 0; c < d; ++c) dst[c] = acc[c] / z;
        }
  }
}

}  // namespace mt::cpu
