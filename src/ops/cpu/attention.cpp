// CPU reference of causal self-attention (ops/attention.h): straightforward loops, fp32, one
// OpenMP task per (batch, head). Row i of sample b covers keys j0 = doc_start[b, i] (0 without a
// document mask) .. i; everything outside is written as exact zeros.
#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/attention_impl.h"

namespace mt::cpu {
namespace {

void require_f32(const char* op, DType t) {
  MT_CHECK(t == DType::kF32, "{}: the CPU backend supports fp32 only, got {}", op, dtype_name(t));
}

/// Offset of element (i, b, head, e) of a [s, b, n, w, d] tensor, component c (0..w-1).
inline int64_t sbn_index(int64_t i, int64_t bi, int64_t h, int64_t c, int64_t e, int64_t B, int64_t n, int64_t w,
                         int64_t d) {
  return (((i * B + bi) * n + h) * w + c) * d + e;
}

/// doc_start[b, ·] of cfg (validated by ops/attention.cpp), or nullptr for plain causal.
inline const int32_t* doc_start_ptr(const AttentionConfig& cfg) {
  return cfg.doc_start.empty() ? nullptr : cfg.doc_start.data_as<int32_t>();
}

}  // namespace

void attention_forward(const Tensor& out, const Tensor& qkv, const AttentionBuffers& buf, const AttentionConfig& cfg,
                       const Stream& stream) {
  require_f32("attention_forward", qkv.dtype());
  const int64_t s = cfg.seq, B = cfg.batch, n = cfg.heads, d = cfg.head_dim;
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

#pragma omp parallel for schedule(static)
  for (int64_t bn = 0; bn < B * n; ++bn) {
    const int64_t bi = bn / n, h = bn % n;
    const int32_t* doc_row = doc ? doc + bi * s : nullptr;
    float* q = qb + bn * s * d;
    float* k = kb + bn * s * d;
    float* v = vb + bn * s * d;
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t e = 0; e < d; ++e) {
        q[i * d + e] = x[sbn_index(i, bi, h, 0, e, B, n, 3, d)];
        k[i * d + e] = x[sbn_index(i, bi, h, 1, e, B, n, 3, d)];
        v[i * d + e] = x[sbn_index(i, bi, h, 2, e, B, n, 3, d)];
      }
    }
    for (int64_t i = 0; i < s; ++i) {
      const int64_t j0 = doc_row ? doc_row[i] : 0;  // keys j0 .. i
      float* p = pb + (bn * s + i) * s;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = j0; j <= i; ++j) {
        float acc = 0.f;
        for (int64_t e = 0; e < d; ++e) acc += q[i * d + e] * k[j * d + e];
        p[j] = scale * acc;
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
        o[sbn_index(i, bi, h, 0, e, B, n, 1, d)] = acc;
      }
    }
  }
}

void attention_backward(const Tensor& dqkv, const Tensor& dout, const AttentionBuffers& buf,
                        const AttentionConfig& cfg, const Stream& stream) {
  require_f32("attention_backward", dout.dtype());
  const int64_t s = cfg.seq, B = cfg.batch, n = cfg.heads, d = cfg.head_dim;
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
  for (int64_t bn = 0; bn < B * n; ++bn) {
    const int64_t bi = bn / n, h = bn % n;
    const int32_t* doc_row = doc ? doc + bi * s : nullptr;
    const float* q = qb + bn * s * d;
    const float* k = kb + bn * s * d;
    const float* v = vb + bn * s * d;
    float* dq = dqb + bn * s * d;
    float* dk = dkb + bn * s * d;
    float* dv = dvb + bn * s * d;
    std::fill(dk, dk + s * d, 0.f);
    std::fill(dv, dv + s * d, 0.f);
    // Row i: dV += P_drop^T dO, dP = mask(dO V^T) / (1-p), dS = P (dP - rowsum(dP P)) -> scratch.
    for (int64_t i = 0; i < s; ++i) {
      const int64_t j0 = doc_row ? doc_row[i] : 0;  // keys j0 .. i
      const float* p = pb + (bn * s + i) * s;
      float* ds = sb + (bn * s + i) * s;
      const float* g = go + sbn_index(i, bi, h, 0, 0, B, n, 1, d);  // dO row i, d contiguous values
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
    // dQ = scale dS K, dK = scale dS^T Q (dS is 0 outside keys j0 .. i).
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
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t e = 0; e < d; ++e) {
        gx[sbn_index(i, bi, h, 0, e, B, n, 3, d)] = dq[i * d + e];
        gx[sbn_index(i, bi, h, 1, e, B, n, 3, d)] = dk[i * d + e];
        gx[sbn_index(i, bi, h, 2, e, B, n, 3, d)] = dv[i * d + e];
      }
    }
  }
}

}  // namespace mt::cpu
