// CPU reference of ops/context_attention.h: per query row, a max pass and an exp-sum pass over the
// visible keys in fp32 (no storage of the scores); the backward recomputes the probabilities from
// the final LSE (FlashAttention-2's backward). Dropout draws the one-rank mask by global positions
// (ops/context_attention_impl.h). OpenMP over (sample, group): the key/value rows a
// group's queries update belong to that (sample, group) only.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ops/context_attention.h"
#include "ops/context_attention_impl.h"
#include "ops/cpu/attention_common.h"

namespace mt::cpu {
namespace {

using attn::dot;

struct Visible {
  const int32_t* kp;
  int32_t qp, lo;
  bool operator()(int64_t j) const { return kp[j] <= qp && kp[j] >= lo; }
};

/// Calls row(b, grp, i, qi, h, vis, g0) for every query row of the call, OpenMP over (b, grp) (each
/// thread in order over i, then the group's query heads qi); g0: the row's first dropout element.
template <typename F>
void for_each_row(const ContextAttentionConfig& c, int64_t sq, const AttnDropout& drop, F&& row) {
  const int32_t* qpos = c.q_pos.data_as<int32_t>();
  const int32_t* kpos = c.k_pos.data_as<int32_t>();
  const int32_t* ds = c.doc_start.empty() ? nullptr : c.doc_start.data_as<int32_t>();
  const int64_t ds_stride = c.doc_start.empty() ? 0 : c.doc_start.stride(0), qpg = c.queries_per_group;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t grp = 0; grp < c.groups; ++grp) {
      for (int64_t i = 0; i < sq; ++i) {
        const Visible vis{kpos, qpos[i], ds ? ds[b * ds_stride + i] : std::numeric_limits<int32_t>::min()};
        for (int64_t qi = 0; qi < qpg; ++qi) {
          const int64_t h = grp * qpg + qi;
          row(b, grp, i, qi, h, vis, drop.enabled ? drop.row_start(b * c.heads() + h, qpos[i]) : uint64_t{0});
        }
      }
    }
  }
}

}  // namespace

void context_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                               const Tensor&, const ContextAttentionConfig& c, bool merge, const Stream&) {
  const int64_t sk = kv.size(0), d = c.head_dim;
  const attn::Layout x = attn::kv_layout(c.batch, c.groups, c.queries_per_group, d);
  const float* Q = qkv.data_as<float>();
  const float* KV = kv.data_as<float>();
  float* O = out.data_as<float>();
  float* L = lse.data_as<float>();
  const float scale = c.softmax_scale, ninf = -std::numeric_limits<float>::infinity();
  const AttnDropout drop = context_attention_dropout(c);
  for_each_row(c, qkv.size(0), drop, [&](int64_t b, int64_t grp, int64_t i, int64_t qi, int64_t h, const Visible& vis,
                                         uint64_t g0) {
    const float* q = Q + x.q(i, b, grp, qi);
    float* o = O + x.o(i, b, h);
    float& l = L[x.row(i, b, h)];
    float m = ninf;
    for (int64_t j = 0; j < sk; ++j)
      if (vis(j)) m = std::max(m, scale * dot(q, KV + x.k(j, b, grp), d));
    if (m == ninf) {  // no visible key in this block
      if (!merge) {
        std::memset(o, 0, static_cast<size_t>(d) * sizeof(float));
        l = ninf;
      }
      return;
    }
    thread_local std::vector<float> acc_buf;
    acc_buf.assign(static_cast<size_t>(d), 0.f);
    float* acc = acc_buf.data();
    float sum = 0.f;
    for (int64_t j = 0; j < sk; ++j) {
      if (!vis(j)) continue;
      const float p = std::exp(scale * dot(q, KV + x.k(j, b, grp), d) - m);
      sum += p;  // the LSE is that of the undropped softmax
      const float pv =
          drop.enabled ? (drop.keep(g0 + static_cast<uint64_t>(vis.kp[j])) ? p * drop.inv_keep : 0.f) : p;
      const float* v = KV + x.v(j, b, grp);
      for (int64_t e = 0; e < d; ++e) acc[e] += pv * v[e];
    }
    const float lb = m + std::log(sum);
    if (!merge || l == ninf) {
      for (int64_t e = 0; e < d; ++e) o[e] = acc[e] / sum;
      l = lb;
    } else {
      const float ln = std::max(l, lb) + std::log1p(std::exp(-std::fabs(l - lb)));
      const float wo = std::exp(l - ln), wb = std::exp(lb - ln) / sum;
      for (int64_t e = 0; e < d; ++e) o[e] = o[e] * wo + acc[e] * wb;
      l = ln;
    }
  });
}

void context_attention_backward(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout, const Tensor& out,
                                const Tensor& lse, const Tensor& qkv, const Tensor& kv, const Tensor&,
                                const ContextAttentionConfig& c, const Stream&) {
  const int64_t sk = kv.size(0), d = c.head_dim;
  const attn::Layout x = attn::kv_layout(c.batch, c.groups, c.queries_per_group, d);
  const float* Q = qkv.data_as<float>();
  const float* KV = kv.data_as<float>();
  const float* O = out.data_as<float>();
  const float* dO = dout.data_as<float>();
  const float* L = lse.data_as<float>();
  float* dQ = dqkv.data_as<float>();
  float* dKV = dkv.data_as<float>();
  const float scale = c.softmax_scale;
  const AttnDropout drop = context_attention_dropout(c);
  for_each_row(c, qkv.size(0), drop, [&](int64_t b, int64_t grp, int64_t i, int64_t qi, int64_t h, const Visible& vis,
                                         uint64_t g0) {
    const float l = L[x.row(i, b, h)];
    if (!std::isfinite(l)) return;
    const float* q = Q + x.q(i, b, grp, qi);
    const float* go = dO + x.o(i, b, h);
    const float D = dot(go, O + x.o(i, b, h), d);
    float* dq = dQ + x.q(i, b, grp, qi);
    for (int64_t j = 0; j < sk; ++j) {
      if (!vis(j)) continue;
      const float* k = KV + x.k(j, b, grp);
      const float* v = KV + x.v(j, b, grp);
      const float p = std::exp(scale * dot(q, k, d) - l);
      // Dropout: M = 1/(1-p) kept, 0 dropped; dP of the undropped P is M·(dout·v).
      const float m = drop.enabled ? (drop.keep(g0 + static_cast<uint64_t>(vis.kp[j])) ? drop.inv_keep : 0.f) : 1.f;
      const float ds = p * (dot(go, v, d) * m - D) * scale;
      const float pm = p * m;
      float* dk = dKV + x.k(j, b, grp);
      float* dv = dKV + x.v(j, b, grp);
      for (int64_t e = 0; e < d; ++e) {
        dv[e] += pm * go[e];
        dq[e] += ds * k[e];
        dk[e] += ds * q[e];
      }
    }
  });
}

namespace {
/// Copies the key/value pair of every row between [R, w, dim] (heads at index qpg, qpg + 1) and
/// [R, 2, dim], by element size.
void move_kv(char* t, const char* s, int64_t R, int64_t w, int64_t qpg, size_t head, bool pack) {
  for (int64_t i = 0; i < R; ++i) {
    char* wide = const_cast<char*>(pack ? s : t) + static_cast<size_t>(i * w + qpg) * head;
    char* narrow = (pack ? t : const_cast<char*>(s)) + static_cast<size_t>(i * 2) * head;
    if (pack) std::memcpy(narrow, wide, 2 * head);
    else std::memcpy(wide, narrow, 2 * head);
  }
}
}  // namespace

void kv_pack(const Tensor& kv, const Tensor& qkv, int64_t qpg, const Stream&) {
  const int64_t dim = qkv.size(-1), R = qkv.numel() / ((qpg + 2) * dim);
  move_kv(static_cast<char*>(kv.data()), static_cast<const char*>(qkv.data()), R, qpg + 2, qpg,
          static_cast<size_t>(dim) * dtype_size(qkv.dtype()), true);
}

void kv_unpack(const Tensor& dqkv, const Tensor& dkv, int64_t qpg, const Stream&) {
  const int64_t dim = dqkv.size(-1), R = dqkv.numel() / ((qpg + 2) * dim);
  move_kv(static_cast<char*>(dqkv.data()), static_cast<const char*>(dkv.data()), R, qpg + 2, qpg,
          static_cast<size_t>(dim) * dtype_size(dqkv.dtype()), false);
}

void transpose_blocks(const Tensor& y, const Tensor& x, int64_t a, int64_t b, const Stream&) {
  const size_t c = static_cast<size_t>(x.numel() / (a * b)) * dtype_size(x.dtype());
  const char* s = static_cast<const char*>(x.data());
  char* t = static_cast<char*>(y.data());
  for (int64_t i = 0; i < a; ++i)
    for (int64_t j = 0; j < b; ++j) std::memcpy(t + (j * a + i) * c, s + (i * b + j) * c, c);
}

void permute_blocks(const Tensor& y, const Tensor& x, int64_t outer, const std::vector<int>& perm, bool inverse,
                    const Stream&) {
  const int64_t k = static_cast<int64_t>(perm.size());
  const size_t c = static_cast<size_t>(x.numel() / (outer * k)) * dtype_size(x.dtype());
  const char* s = static_cast<const char*>(x.data());
  char* t = static_cast<char*>(y.data());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t from = inverse ? j : perm[static_cast<size_t>(j)], to = inverse ? perm[static_cast<size_t>(j)] : j;
      std::memcpy(t + static_cast<size_t>(o * k + to) * c, s + static_cast<size_t>(o * k + from) * c, c);
    }
}

}  // namespace mt::cpu
