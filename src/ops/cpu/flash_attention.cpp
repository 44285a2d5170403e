// CPU reference of ops/flash_attention.h: plain (not blockwise) softmax per query row in fp32,
// which also yields the LSE; the backward recomputes the probabilities from the saved LSE as the
// FA2 backward does. OpenMP over (b, head) in the forward and over (b, group) in the backward (the
// key/value gradients of a group sum over its query heads). The workspace is not used.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/attention_impl.h"
#include "ops/cpu/attention_common.h"
#include "ops/flash_attention.h"

namespace mt::cpu {

using attn::dot;

void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const FlashAttentionConfig& cfg,
                             const Stream& stream) {
  const int64_t s = cfg.seq, B = cfg.batch, n = cfg.heads(), qpg = cfg.queries_per_group, d = cfg.head_dim;
  const attn::Layout L = attn::qkv_layout(B, cfg.groups, qpg, d);
  const float scale = cfg.softmax_scale;
  const AttnDropout drop = flash_attention_dropout(cfg);
  const float* x = qkv.data_as<float>();
  float* o = out.data_as<float>();
  float* lo = lse.data_as<float>();
  const int32_t* doc = cfg.doc_start.empty() ? nullptr : cfg.doc_start.data_as<int32_t>();

#pragma omp parallel
  {
    std::vector<float> p(s);
#pragma omp for schedule(static)
    for (int64_t bn = 0; bn < B * n; ++bn) {
      const int64_t b = bn / n, h = bn % n, grp = h / qpg, qi = h % qpg;
      for (int64_t i = 0; i < s; ++i) {
        const int64_t j0 = doc ? doc[b * s + i] : 0;  // keys j0 .. i
        const float* q = x + L.q(i, b, grp, qi);
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = j0; j <= i; ++j) {
          p[j] = scale * dot(q, x + L.k(j, b, grp), d);
          mx = std::max(mx, p[j]);
        }
        float sum = 0.f;
        for (int64_t j = j0; j <= i; ++j) {
          p[j] = std::exp(p[j] - mx);
          sum += p[j];
        }
        lo[bn * s + i] = mx + std::log(sum);
        const float inv = 1.f / sum;
        const uint64_t g0 = drop.enabled ? drop.row_start(bn, i) : 0;
        for (int64_t j = j0; j <= i; ++j) {
          p[j] *= inv;
          if (drop.enabled) p[j] = drop.keep(g0 + j) ? p[j] * drop.inv_keep : 0.f;
        }
        float* oi = o + L.o(i, b, h);
        std::fill(oi, oi + d, 0.f);
        for (int64_t j = j0; j <= i; ++j) {
          const float* v = x + L.v(j, b, grp);
          for (int64_t e = 0; e < d; ++e) oi[e] += p[j] * v[e];
        }
      }
    }
  }
}

void flash_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& qkv, const Tensor& workspace, const FlashAttentionConfig& cfg,
                              const Stream& stream) {
  const int64_t s = cfg.seq, B = cfg.batch, G = cfg.groups, n = cfg.heads(), qpg = cfg.queries_per_group;
  const int64_t d = cfg.head_dim;
  const attn::Layout L = attn::qkv_layout(B, G, qpg, d);
  const float scale = cfg.softmax_scale;
  const AttnDropout drop = flash_attention_dropout(cfg);
  const float* x = qkv.data_as<float>();
  const float* go = dout.data_as<float>();
  const float* o = out.data_as<float>();
  const float* lo = lse.data_as<float>();
  float* gx = dqkv.data_as<float>();
  const int32_t* doc = cfg.doc_start.empty() ? nullptr : cfg.doc_start.data_as<int32_t>();

#pragma omp parallel
  {
    std::vector<float> dk(s * d), dv(s * d), dq(d), pd(s), ds(s);
#pragma omp for schedule(static)
    for (int64_t bg = 0; bg < B * G; ++bg) {
      const int64_t b = bg / G, grp = bg % G;
      std::fill(dk.begin(), dk.end(), 0.f);
      std::fill(dv.begin(), dv.end(), 0.f);
      for (int64_t qi = 0; qi < qpg; ++qi) {
        const int64_t h = grp * qpg + qi, bn = b * n + h;
        for (int64_t i = 0; i < s; ++i) {
          const int64_t j0 = doc ? doc[b * s + i] : 0;
          const float* q = x + L.q(i, b, grp, qi);
          const float* g = go + L.o(i, b, h);
          const float delta = dot(g, o + L.o(i, b, h), d);  // D_i = rowsum(dO ∘ O)
          const float li = lo[bn * s + i];
          const uint64_t g0 = drop.enabled ? drop.row_start(bn, i) : 0;
          for (int64_t j = j0; j <= i; ++j) {
            const float p = std::exp(scale * dot(q, x + L.k(j, b, grp), d) - li);
            const float m = drop.enabled ? (drop.keep(g0 + j) ? drop.inv_keep : 0.f) : 1.f;
            const float dp = dot(g, x + L.v(j, b, grp), d) * m;  // dP of the undropped P
            pd[j] = p * m;
            ds[j] = p * (dp - delta);
          }
          std::fill(dq.begin(), dq.end(), 0.f);
          for (int64_t j = j0; j <= i; ++j) {
            const float* k = x + L.k(j, b, grp);
            for (int64_t e = 0; e < d; ++e) {
              dq[e] += ds[j] * k[e];
              dk[j * d + e] += ds[j] * q[e];
              dv[j * d + e] += pd[j] * g[e];
            }
          }
          float* gq = gx + L.q(i, b, grp, qi);
          for (int64_t e = 0; e < d; ++e) gq[e] = scale * dq[e];
        }
      }
      for (int64_t j = 0; j < s; ++j) {
        float* gk = gx + L.k(j, b, grp);
        float* gv = gx + L.v(j, b, grp);
        for (int64_t e = 0; e < d; ++e) {
          gk[e] = scale * dk[j * d + e];
          gv[e] = dv[j * d + e];
        }
      }
    }
  }
}

}  // namespace mt::cpu
