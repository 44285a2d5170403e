// CPU reference of causal self-attention (ops/attention.h): straightforward loops, fp32. q, k, v
// are first copied out of qkv [s, b, g, qpg + 2, d] into [b, n, s, d] / [b, g, s, d]; then one
// OpenMP task per (batch, query head) for the forward, and per (batch, key/value group) for the
// backward (so that the key/value gradients of a group sum its heads in a fixed order). Row i of
// sample b covers keys j0 = doc_start[b, i] (0 without a document mask) .. i; everything outside is
// written as exact zeros.
#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/attention.h"
#include "ops/attention_impl.h"
#include "ops/cpu/attention_common.h"

namespace mt::cpu {
namespace {

/// Sizes of one call: s, b, n query heads, g groups, qpg = n / g, d; the offsets of qkv and out.
struct Dims {
  int64_t s, B, n, g, qpg, d;
  attn::Layout L;
  explicit Dims(const AttentionConfig& c)
      : s(c.seq), B(c.batch), n(c.heads), g(c.groups > 0 ? c.groups : c.heads), qpg(n / g), d(c.head_dim),
        L(attn::qkv_layout(B, g, qpg, d)) {}
  /// Offset of channel e of component c (0..qpg+1: query heads, key, value) of group gi at
  /// (position i, sample bi) in qkv [s, b, g, qpg + 2, d].
  int64_t qkv_index(int64_t i, int64_t bi, int64_t gi, int64_t c, int64_t e) const { return L.q(i, bi, gi, c) + e; }
  /// Offset of channel e of query head h at (i, bi) in out [s, b, n, d].
  int64_t out_index(int64_t i, int64_t bi, int64_t h, int64_t e) const { return L.o(i, bi, h) + e; }
};

/// doc_start[b, ·] of cfg (validated by ops/attention.cpp), or nullptr for plain causal.
inline const int32_t* doc_start_ptr(const AttentionConfig& cfg) {
  return cfg.doc_start.empty() ? nullptr : cfg.doc_start.data_as<int32_t>();
}

}  // namespace

void attention_forward(const Tensor& out, const Tensor& qkv, const AttentionBuffers& buf, const AttentionConfig& cfg,
                       const Stream& stream) {
  const Dims z(cfg);
  const int64_t s = z.s, d = z.d;
  const float scale = cfg.softmax_scale;
  const AttnDropout drop = make_attn_dropout(cfg);
  const float* x = qkv.data_as<float>();
  float* o = out.data_as<float>();
  float* qb = buf.q.data_as<float>();
  float* kb = buf.k.data_as<float>();
  float* vb = buf.v.data_as<float>();
  float* pb = buf.probs.data_as<float>();
  float* db = drop.enabled ? buf.scratch.data_as<float>() : nullptr;
  const int32_t* doc = doc_start_ptr(cfg);

  // q [b, g, qpg, s, d] = [b, n, s, d]; k, v [b, g, s, d].
#pragma omp parallel for schedule(static)
  for (int64_t bg = 0; bg < z.B * z.g; ++bg) {
    const int64_t bi = bg / z.g, gi = bg % z.g;
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t c = 0; c < z.qpg; ++c)
        for (int64_t e = 0; e < d; ++e) qb[((bg * z.qpg + c) * s + i) * d + e] = x[z.qkv_index(i, bi, gi, c, e)];
      for (int64_t e = 0; e < d; ++e) {
        kb[(bg * s + i) * d + e] = x[z.qkv_index(i, bi, gi, z.qpg, e)];
        vb[(bg * s + i) * d + e] = x[z.qkv_index(i, bi, gi, z.qpg + 1, e)];
      }
    }
  }

#pragma omp parallel for schedule(static)
  for (int64_t bn = 0; bn < z.B * z.n; ++bn) {
    const int64_t bi = bn / z.n, h = bn % z.n, bg = bi * z.g + h / z.qpg;
    const int32_t* doc_row = doc ? doc + bi * s : nullptr;
    const float* q = qb + bn * s * d;
    const float* k = kb + bg * s * d;
    const float* v = vb + bg * s * d;
    for (int64_t i = 0; i < s; ++i) {
      const int64_t j0 = doc_row ? doc_row[i] : 0;  // keys j0 .. i
      float* p = pb + (bn * s + i) * s;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = j0; j <= i; ++j) {
        p[j] = scale * attn::dot(q + i * d, k + j * d, d);
        mx = std::max(mx, p[j]);
      }
      float sum = 0.f;
      for (int64_t j = j0; j <= i; ++j) {
        p[j] = std::exp(p[j] - mx);
        sum += p[j];
      }
      const float inv = 1.f / sum;
      for (int64_t j = j0; j <= i; ++j) p[j] *= inv;
      for (int64_t j = 0; j < j0; ++j) p[j] = 0.f;
      for (int64_t j = i + 1; j < s; ++j) p[j] = 0.f;
      const float* pd = p;  // probabilities used for the context (dropped if p > 0)
      if (drop.enabled) {
        float* dr = db + (bn * s + i) * s;
        const uint64_t g0 = drop.row_start(bn, i);
        for (int64_t j = 0; j < j0; ++j) dr[j] = 0.f;
        for (int64_t j = j0; j <= i; ++j) dr[j] = drop.keep(g0 + j) ? p[j] * drop.inv_keep : 0.f;
        for (int64_t j = i + 1; j < s; ++j) dr[j] = 0.f;
        pd = dr;
      }
      for (int64_t e = 0; e < d; ++e) {
        float acc = 0.f;
        for (int64_t j = j0; j <= i; ++j) acc += pd[j] * v[j * d + e];
        o[z.out_index(i, bi, h, e)] = acc;
      }
    }
  }
}

void attention_backward(const Tensor& dqkv, const Tensor& dout, const AttentionBuffers& buf,
                        const AttentionConfig& cfg, const Stream& stream) {
  const Dims z(cfg);
  const int64_t s = z.s, d = z.d;
  const float scale = cfg.softmax_scale;
  const AttnDropout drop = make_attn_dropout(cfg);
  const float* go = dout.data_as<float>();
  float* gx = dqkv.data_as<float>();
  const float* qb = buf.q.data_as<float>();
  const float* kb = buf.k.data_as<float>();
  const float* vb = buf.v.data_as<float>();
  const float* pb = buf.probs.data_as<float>();
  float* sb = buf.scratch.data_as<float>();
  float* dqb = buf.dq.data_as<float>();
  float* dkb = buf.dk.data_as<float>();
  float* dvb = buf.dv.data_as<float>();
  const int32_t* doc = doc_start_ptr(cfg);

#pragma omp parallel for schedule(static)
  for (int64_t bg = 0; bg < z.B * z.g; ++bg) {
    const int64_t bi = bg / z.g, gi = bg % z.g;
    const int32_t* doc_row = doc ? doc + bi * s : nullptr;
    const float* k = kb + bg * s * d;
    const float* v = vb + bg * s * d;
    float* dk = dkb + bg * s * d;
    float* dv = dvb + bg * s * d;
    std::fill(dk, dk + s * d, 0.f);
    std::fill(dv, dv + s * d, 0.f);
    for (int64_t c = 0; c < z.qpg; ++c) {  // the group's query heads, in order
      const int64_t h = gi * z.qpg + c, bn = bi * z.n + h;
      const float* q = qb + bn * s * d;
      float* dq = dqb + bn * s * d;
      // Row i: dV += P_drop^T dO, dP = mask(dO V^T) / (1-p), dS = P (dP - rowsum(dP P)) -> scratch.
      for (int64_t i = 0; i < s; ++i) {
        const int64_t j0 = doc_row ? doc_row[i] : 0;  // keys j0 .. i
        const float* p = pb + (bn * s + i) * s;
        float* ds = sb + (bn * s + i) * s;
        const float* g = go + z.out_index(i, bi, h, 0);  // dO row i, d contiguous values
        const uint64_t g0 = drop.enabled ? drop.row_start(bn, i) : 0;
        float dot = 0.f;
        for (int64_t j = j0; j <= i; ++j) {
          const float m = drop.enabled ? (drop.keep(g0 + j) ? drop.inv_keep : 0.f) : 1.f;
          const float pd = p[j] * m;
          float dpd = 0.f;
          for (int64_t e = 0; e < d; ++e) {
            dv[j * d + e] += pd * g[e];
            dpd += g[e] * v[j * d + e];
          }
          ds[j] = dpd * m;  // dP
          dot += ds[j] * p[j];
        }
        for (int64_t j = j0; j <= i; ++j) ds[j] = p[j] * (ds[j] - dot);
        for (int64_t j = 0; j < j0; ++j) ds[j] = 0.f;
        for (int64_t j = i + 1; j < s; ++j) ds[j] = 0.f;
      }
      // dQ = scale dS K, dK += scale dS^T Q (dS is 0 outside keys j0 .. i).
      for (int64_t i = 0; i < s; ++i) {
        const int64_t j0 = doc_row ? doc_row[i] : 0;
        const float* ds = sb + (bn * s + i) * s;
        for (int64_t e = 0; e < d; ++e) {
          float acc = 0.f;
          for (int64_t j = j0; j <= i; ++j) acc += ds[j] * k[j * d + e];
          dq[i * d + e] = scale * acc;
        }
        for (int64_t j = j0; j <= i; ++j) {
          const float w = scale * ds[j];
          for (int64_t e = 0; e < d; ++e) dk[j * d + e] += w * q[i * d + e];
        }
      }
      for (int64_t i = 0; i < s; ++i)
        for (int64_t e = 0; e < d; ++e) gx[z.qkv_index(i, bi, gi, c, e)] = dq[i * d + e];
    }
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t e = 0; e < d; ++e) {
        gx[z.qkv_index(i, bi, gi, z.qpg, e)] = dk[i * d + e];
        gx[z.qkv_index(i, bi, gi, z.qpg + 1, e)] = dv[i * d + e];
      }
    }
  }
}

}  // namespace mt::cpu
