// CPU reference of ops/mla.h (fp32).
#include <cstring>

#include "ops/mla.h"

namespace mt::cpu {

void mla_qkv_pack(const Tensor& qkv, const Tensor& q, const Tensor& kv, const Tensor& k_pe, const Stream&) {
  const int64_t n = qkv.size(-3), D = qkv.size(-1), dr = k_pe.size(-1);
  const int64_t dn = q.size(-1) - dr, dv = kv.size(-1) - dn, T = k_pe.numel() / dr;
  float* o = qkv.data_as<float>();
  const float* pq = q.data_as<float>();
  const float* pkv = kv.data_as<float>();
  const float* pk = k_pe.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < n; ++h) {
      float* oq = o + ((t * n + h) * 3) * D;
      float* ok = oq + D;
      float* ov = ok + D;
      const float* sq = pq + (t * n + h) * (dn + dr);
      const float* skv = pkv + (t * n + h) * (dn + dv);
      std::memset(oq, 0, static_cast<size_t>(3 * D) * sizeof(float));
      std::memcpy(oq, sq + dn, static_cast<size_t>(dr) * sizeof(float));      // q_pe
      std::memcpy(oq + dr, sq, static_cast<size_t>(dn) * sizeof(float));      // q_nope
      std::memcpy(ok, pk + t * dr, static_cast<size_t>(dr) * sizeof(float));  // k_pe (shared)
      std::memcpy(ok + dr, skv, static_cast<size_t>(dn) * sizeof(float));     // k_nope
      std::memcpy(ov, skv + dn, static_cast<size_t>(dv) * sizeof(float));     // v
    }
  }
}

void mla_qkv_unpack_grad(const Tensor& dq, const Tensor& dkv, const Tensor& dk_pe, const Tensor& dqkv, const Stream&) {
  const int64_t n = dqkv.size(-3), D = dqkv.size(-1), dr = dk_pe.size(-1);
  const int64_t dn = dq.size(-1) - dr, dv = dkv.size(-1) - dn, T = dk_pe.numel() / dr;
  const float* g = dqkv.data_as<float>();
  float* pq = dq.data_as<float>();
  float* pkv = dkv.data_as<float>();
  float* pk = dk_pe.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* kpe = pk + t * dr;
    for (int64_t c = 0; c < dr; ++c) kpe[c] = 0.f;
    for (int64_t h = 0; h < n; ++h) {
      const float* gq = g + ((t * n + h) * 3) * D;
      const float* gk = gq + D;
      const float* gv = gk + D;
      float* sq = pq + (t * n + h) * (dn + dr);
      float* skv = pkv + (t * n + h) * (dn + dv);
      std::memcpy(sq + dn, gq, static_cast<size_t>(dr) * sizeof(float));
      std::memcpy(sq, gq + dr, static_cast<size_t>(dn) * sizeof(float));
      std::memcpy(skv, gk + dr, static_cast<size_t>(dn) * sizeof(float));
      std::memcpy(skv + dn, gv, static_cast<size_t>(dv) * sizeof(float));
      for (int64_t c = 0; c < dr; ++c) kpe[c] += gk[c];
    }
  }
}

void mla_context_unpack(const Tensor& out, const Tensor& context, int64_t heads, bool pad, const Stream&) {
  const int64_t dv = out.size(-1) / heads, D = context.size(-1) / heads, rows = out.numel() / dv;  // rows = T·n
  float* o = out.data_as<float>();
  float* c = context.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    if (pad) {
      std::memcpy(c + r * D, o + r * dv, static_cast<size_t>(dv) * sizeof(float));
      for (int64_t j = dv; j < D; ++j) c[r * D + j] = 0.f;
    } else {
      std::memcpy(o + r * dv, c + r * D, static_cast<size_t>(dv) * sizeof(float));
    }
  }
}

void mla_latent_append(const Tensor& ckv_cache, const Tensor& kpe_cache, const Tensor& c_kv, const Tensor& qkv,
                       int64_t offset, const Stream&) {
  const int64_t s = qkv.size(0), b = qkv.size(1), n = qkv.size(2), D = qkv.size(4);
  const int64_t B = ckv_cache.size(1), r = ckv_cache.size(2), dr = kpe_cache.size(2);
  for (int64_t i = 0; i < s; ++i)
    for (int64_t j = 0; j < b; ++j) {
      std::memcpy(ckv_cache.data_as<float>() + ((offset + i) * B + j) * r, c_kv.data_as<float>() + (i * b + j) * r,
                  static_cast<size_t>(r) * sizeof(float));
      const float* k = qkv.data_as<float>() + (((i * b + j) * n) * 3 + 1) * D;  // head 0's key
      std::memcpy(kpe_cache.data_as<float>() + ((offset + i) * B + j) * dr, k, static_cast<size_t>(dr) * sizeof(float));
    }
}

void mla_latent_expand(const Tensor& key, const Tensor& value, const Tensor& kv_up, const Tensor& kpe_cache,
                       int64_t count, int64_t qk_head_dim, const Stream&) {
  const int64_t b = key.size(0), n = key.size(1), S = key.size(2), D = key.size(3);
  const int64_t B = kv_up.size(1), w = kv_up.size(3), dr = kpe_cache.size(2), dn = qk_head_dim, dv = w - dn;
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < b; ++j)
    for (int64_t h = 0; h < n; ++h)
      for (int64_t p = 0; p < count; ++p) {
        float* k = key.data_as<float>() + ((j * n + h) * S + p) * D;
        float* v = value.data_as<float>() + ((j * n + h) * S + p) * D;
        const float* up = kv_up.data_as<float>() + ((p * B + j) * n + h) * w;
        for (int64_t c = 0; c < D; ++c) k[c] = v[c] = 0.f;
        std::memcpy(k, kpe_cache.data_as<float>() + (p * B + j) * dr, static_cast<size_t>(dr) * sizeof(float));
        std::memcpy(k + dr, up, static_cast<size_t>(dn) * sizeof(float));
        std::memcpy(v, up + dn, static_cast<size_t>(dv) * sizeof(float));
      }
}

}  // namespace mt::cpu
