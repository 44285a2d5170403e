// CUDA implementation of ops/context_attention.h.
//
// Tensor-core path (bf16/fp16, head_dim 64 or 128, 16-byte aligned tensors; the backward also
// needs the workspace): FlashAttention-2 kernels (ca_fwd_mma, ca_bwd_mma; see below) for one
// (query shard, key block) pair. Simple path (fp32, other head dims, misaligned tensors, no
// workspace, or MT_CONTEXT_ATTN_SIMPLE=1 for comparisons): CUDA-core kernels with fp32 math (one
// thread per query row for the forward and dQ, one thread per key row for dK/dV, no atomics,
// deterministic), head_dim up to 256. The tensor-core backward sums dQ with fp32 atomics (may
// differ in the last bits between runs), or, with ContextAttentionConfig::deterministic
// (--deterministic-mode), computes it in a kernel of its own per query tile (same bits every run).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "ops/context_attention.h"
#include "ops/context_attention_impl.h"
#include "core/cuda_check.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/mma_sm80.cuh"

namespace mt::cuda {
namespace {

using namespace mma;  // NOLINT: the tensor-core building blocks (ops/cuda/mma_sm80.cuh)

constexpr int kMaxD = 256;
constexpr int kBlock = 128;

struct Dims {
  int64_t sq, sk, B, g, qpg, d;
  float scale;
  const int32_t* qp;
  const int32_t* kp;
  const int32_t* ds;  // doc_start or null
  int64_t ds_stride;
  __device__ int64_t qoff(int64_t i, int64_t b, int64_t grp, int64_t qi) const {
    return (((i * B + b) * g + grp) * (qpg + 2) + qi) * d;
  }
  __device__ int64_t koff(int64_t j, int64_t b, int64_t grp) const { return (((j * B + b) * g + grp) * 2) * d; }
  __device__ int64_t ooff(int64_t i, int64_t b, int64_t h) const { return ((i * B + b) * g * qpg + h) * d; }
  __device__ int64_t loff(int64_t i, int64_t b, int64_t h) const { return (i * B + b) * g * qpg + h; }
  __device__ bool visible(int64_t i, int64_t j, int64_t b) const {
    const int32_t k = kp[j];
    return k <= qp[i] && (ds == nullptr || k >= ds[b * ds_stride + i]);
  }
};

Dims dims_of(const Tensor& qkv, const Tensor& kv, const ContextAttentionConfig& c) {
  return {qkv.size(0), kv.size(0), c.batch, c.groups, c.queries_per_group, c.head_dim, c.softmax_scale,
          c.q_pos.data_as<int32_t>(), c.k_pos.data_as<int32_t>(),
          c.doc_start.empty() ? nullptr : c.doc_start.data_as<int32_t>(),
          c.doc_start.empty() ? 0 : c.doc_start.stride(0)};
}

template <typename T>
__device__ float dot(const T* a, const T* b, int64_t d) {
  float s = 0.f;
  for (int64_t e = 0; e < d; ++e) s += to_f(a[e]) * to_f(b[e]);
  return s;
}

// One thread per (i, b, h): online softmax over the visible keys, merged into (out, lse).
template <typename T>
__global__ void forward_kernel(T* out, float* lse, const T* qkv, const T* kv, Dims x, bool merge, AttnDropout drop) {
  const int64_t n = x.g * x.qpg, rows = x.sq * x.B * n;
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = r % n, b = (r / n) % x.B, i = r / (n * x.B), grp = h / x.qpg, qi = h % x.qpg;
    const uint64_t g0 = drop.enabled ? drop.row_start(b * n + h, x.qp[i]) : 0;
    const T* q = qkv + x.qoff(i, b, grp, qi);
    float acc[kMaxD];
    for (int64_t e = 0; e < x.d; ++e) acc[e] = 0.f;
    float m = -INFINITY, sum = 0.f;
    for (int64_t j = 0; j < x.sk; ++j) {
      if (!x.visible(i, j, b)) continue;
      const T* k = kv + x.koff(j, b, grp);
      const float s = x.scale * dot(q, k, x.d);
      const float mn = fmaxf(m, s), c = expf(m - mn), p = expf(s - mn);
      sum = sum * c + p;  // undropped: the LSE
      const float pv = drop.enabled ? (drop.keep(g0 + static_cast<uint64_t>(x.kp[j])) ? p * drop.inv_keep : 0.f) : p;
      for (int64_t e = 0; e < x.d; ++e) acc[e] = acc[e] * c + pv * to_f(k[x.d + e]);
      m = mn;
    }
    T* o = out + x.ooff(i, b, h);
    float& l = lse[x.loff(i, b, h)];
    if (m == -INFINITY) {
      if (!merge) {
        for (int64_t e = 0; e < x.d; ++e) o[e] = from_f<T>(0.f);
        l = -INFINITY;
      }
      continue;
    }
    const float lb = m + logf(sum);
    if (!merge || l == -INFINITY) {
      for (int64_t e = 0; e < x.d; ++e) o[e] = from_f<T>(acc[e] / sum);
      l = lb;
    } else {
      const float ln = fmaxf(l, lb) + log1pf(expf(-fabsf(l - lb)));
      const float wo = expf(l - ln), wb = expf(lb - ln) / sum;
      for (int64_t e = 0; e < x.d; ++e) o[e] = from_f<T>(to_f(o[e]) * wo + acc[e] * wb);
      l = ln;
    }
  }
}

// One thread per query row (i, b, h): dQ += Σ_j dS_ij k_j.
template <typename T>
__global__ void dq_kernel(T* dqkv, const T* dout, const T* out, const float* lse, const T* qkv, const T* kv, Dims x,
                          AttnDropout drop) {
  const int64_t n = x.g * x.qpg, rows = x.sq * x.B * n;
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = r % n, b = (r / n) % x.B, i = r / (n * x.B), grp = h / x.qpg, qi = h % x.qpg;
    const float l = lse[x.loff(i, b, h)];
    if (!isfinite(l)) continue;
    const uint64_t g0 = drop.enabled ? drop.row_start(b * n + h, x.qp[i]) : 0;
    const T* q = qkv + x.qoff(i, b, grp, qi);
    const T* go = dout + x.ooff(i, b, h);
    const float D = dot(go, out + x.ooff(i, b, h), x.d);
    float acc[kMaxD];
    for (int64_t e = 0; e < x.d; ++e) acc[e] = 0.f;
    for (int64_t j = 0; j < x.sk; ++j) {
      if (!x.visible(i, j, b)) continue;
      const T* k = kv + x.koff(j, b, grp);
      const float p = expf(x.scale * dot(q, k, x.d) - l);
      const float m = drop.enabled ? (drop.keep(g0 + static_cast<uint64_t>(x.kp[j])) ? drop.inv_keep : 0.f) : 1.f;
      const float ds = p * (dot(go, k + x.d, x.d) * m - D) * x.scale;
      for (int64_t e = 0; e < x.d; ++e) acc[e] += ds * to_f(k[e]);
    }
    T* dq = dqkv + x.qoff(i, b, grp, qi);
    for (int64_t e = 0; e < x.d; ++e) dq[e] = from_f<T>(to_f(dq[e]) + acc[e]);
  }
}

// One thread per key row (j, b, grp): dK, dV += Σ over the group's query rows.
template <typename T>
__global__ void dkv_kernel(T* dkv, const T* dout, const T* out, const float* lse, const T* qkv, const T* kv, Dims x,
                           AttnDropout drop) {
  const int64_t rows = x.sk * x.B * x.g;
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    const int64_t grp = r % x.g, b = (r / x.g) % x.B, j = r / (x.g * x.B);
    const T* k = kv + x.koff(j, b, grp);
    float dk[kMaxD], dv[kMaxD];
    for (int64_t e = 0; e < x.d; ++e) dk[e] = dv[e] = 0.f;
    for (int64_t i = 0; i < x.sq; ++i) {
      if (!x.visible(i, j, b)) continue;
      for (int64_t qi = 0; qi < x.qpg; ++qi) {
        const int64_t h = grp * x.qpg + qi;
        const float l = lse[x.loff(i, b, h)];
        if (!isfinite(l)) continue;
        const T* q = qkv + x.qoff(i, b, grp, qi);
        const T* go = dout + x.ooff(i, b, h);
        const float D = dot(go, out + x.ooff(i, b, h), x.d);
        const float p = expf(x.scale * dot(q, k, x.d) - l);
        const float m =
            drop.enabled ? (drop.keep(drop.row_start(b * x.g * x.qpg + h, x.qp[i]) + static_cast<uint64_t>(x.kp[j]))
                                ? drop.inv_keep
                                : 0.f)
                         : 1.f;
        const float ds = p * (dot(go, k + x.d, x.d) * m - D) * x.scale;
        for (int64_t e = 0; e < x.d; ++e) {
          dv[e] += p * m * to_f(go[e]);
          dk[e] += ds * to_f(q[e]);
        }
      }
    }
    T* t = dkv + x.koff(j, b, grp);
    for (int64_t e = 0; e < x.d; ++e) {
      t[e] = from_f<T>(to_f(t[e]) + dk[e]);
      t[x.d + e] = from_f<T>(to_f(t[x.d + e]) + dv[e]);
    }
  }
}

__global__ void move_kv_kernel(char* t, const char* s, int64_t R, int64_t w, int64_t qpg, int64_t head, bool pack) {
  const int64_t total = R * 2 * head;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = k / (2 * head), off = k % (2 * head);
    const int64_t wide = (i * w + qpg) * head + off, narrow = i * 2 * head + off;
    if (pack) t[narrow] = s[wide];
    else t[wide] = s[narrow];
  }
}

__global__ void transpose_kernel(char* y, const char* x, int64_t a, int64_t b, int64_t c) {
  const int64_t total = a * b * c;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = k % c, j = (k / c) % b, i = k / (b * c);
    y[(j * a + i) * c + e] = x[k];
  }
}


// ---------------------------------------------------------------------------------------------
// Tensor-core path (bf16/fp16, head_dim 64 or 128, 16-byte aligned tensors): FlashAttention-2
// (Dao 2023, arXiv:2307.08691) on mma.sync.m16n8k16 with fp32 accumulation, the patterns of
// ops/cuda/flash_attention.cu with the masks of this op (global positions, document starts),
// arbitrary sq and sk, and the LSE merge / accumulation into the caller's results.
//   forward  (ca_fwd_mma): one block per (query tile of 16·MW·W rows, b·n); each warp owns 16·MW
//            query rows and walks the visible key tiles (double-buffered K/V by cp.async, online
//            softmax); key tiles with no visible key for any row of the query tile (by the tile's
//            min/max positions and document starts) are skipped, tiles visible to every row are
//            not masked. Epilogue: the block's (out, lse) written, or merged into the caller's.
//   backward: ca_bwd_pre (D_i = rowsum(dO ∘ O) into the workspace, dq_accum zeroed), ca_bwd_mma
//            (one block per (key tile of 16·W keys, b·g): dK, dV in registers over the qpg heads
//            and the visible query tiles; dQ = dS K added to dq_accum with fp32 atomics; dK, dV
//            added to dkv), ca_bwd_dq_add (dqkv query slots += scale · dq_accum).
//   deterministic backward: ca_bwd_pre (D_i only), ca_bwd_mma without dQ, then ca_bwd_dq_mma (one
//            block per (query tile of 16·W rows, b·n): each warp owns 16 query rows, walks the
//            visible key tiles in order recomputing S, P, dP and dS with the dK/dV kernel's element
//            formula, masks and dropout bits, dQ = dS K in registers, then dqkv += scale · dQ).
// ---------------------------------------------------------------------------------------------

constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

struct CaParams {
  const void* qkv = nullptr;  // [sq, b, g, qpg + 2, d]
  const void* kv = nullptr;   // [sk, b, g, 2, d]
  void* out = nullptr;        // [sq, b, n, d]
  float* lse = nullptr;       // [sq, b, n]
  const void* dout = nullptr;
  void* dqkv = nullptr;
  void* dkv = nullptr;
  float* delta = nullptr;     // [sq, b, n]
  float* dq_accum = nullptr;  // [sq, b, n, d]
  const int32_t* qp = nullptr;
  const int32_t* kp = nullptr;
  const int32_t* doc = nullptr;  // [b, doc_stride] or null
  int64_t doc_stride = 0;
  int64_t sq = 0, sk = 0, B = 0, G = 0, qpg = 0, n = 0, d = 0;
  float scale = 0, scale_log2 = 0;
  bool merge = false;
  AttnDropout drop;

  __host__ __device__ int64_t q_rs() const { return B * G * (qpg + 2) * d; }
  __host__ __device__ int64_t kv_rs() const { return B * G * 2 * d; }
  __host__ __device__ int64_t o_rs() const { return B * n * d; }
  __host__ __device__ int64_t q_base(int64_t b, int64_t grp, int64_t qi) const {
    return ((b * G + grp) * (qpg + 2) + qi) * d;
  }
  __host__ __device__ int64_t kv_base(int64_t b, int64_t grp) const { return (b * G + grp) * 2 * d; }
  /// Row of (query i, sample b, head h) in out / lse / delta / dq_accum.
  __host__ __device__ int64_t row(int64_t i, int64_t b, int64_t h) const { return (i * B + b) * n + h; }
};

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  T x[2];
  memcpy(x, &v, sizeof(v));
  return make_float2(to_f(x[0]), to_f(x[1]));
}

/// Keep decisions of the elements of one row at key positions k0 and k1 (one Philox call for two
/// consecutive positions in one group of four).
__device__ __forceinline__ void keep_pair(const AttnDropout& drop, uint64_t row_start, int32_t k0, int32_t k1,
                                          bool& a, bool& c) {
  const uint64_t G = row_start + static_cast<uint64_t>(k0);
  if (k1 == k0 + 1 && (G & 3u) != 3u) {
    const Philox4 r = drop.bits4(G >> 2);
    const uint32_t e = static_cast<uint32_t>(G & 3u);
    const uint32_t v0 = e == 0 ? r.v[0] : e == 1 ? r.v[1] : r.v[2];
    const uint32_t v1 = e == 0 ? r.v[1] : e == 1 ? r.v[2] : r.v[3];
    a = v0 >= drop.threshold;
    c = v1 >= drop.threshold;
  } else {
    a = drop.keep(G);
    c = drop.keep(row_start + static_cast<uint64_t>(k1));
  }
}

/// Dropout keep bits of this lane's elements of a query-major m16n8 accumulator over BC keys (rows
/// of query positions qp0 and qp1, the key tile's positions kp [BC]): element e of fragment nt is
/// bit 2·((e >> 1)·(BC / 8) + nt) + (e & 1). Drawn in a rolled loop (one copy of Philox in the code).
template <int BC>
__device__ __forceinline__ uint64_t keep_bits_rows(const AttnDropout& drop, int64_t bh, int qp0, int qp1,
                                                   const int* kp, int t4) {
  static_assert(BC <= 128, "64 keep bits");
  uint64_t keep = 0;
#pragma unroll 1
  for (int k = 0; k < BC / 4; ++k) {  // k = r · (BC / 8) + nt: elements (r, nt, 0..1)
    const int r = k / (BC / 8), nt = k % (BC / 8), j = nt * 8 + 2 * t4;
    bool k0, k1;
    keep_pair(drop, drop.row_start(bh, r == 0 ? qp0 : qp1), kp[j], kp[j + 1], k0, k1);
    keep |= (static_cast<uint64_t>(k0) | static_cast<uint64_t>(k1) << 1) << (2 * k);
  }
  return keep;
}
__device__ __forceinline__ bool keep_bit(uint64_t keep, int nt, int e, int tiles) {
  return (keep >> (2 * ((e >> 1) * tiles + nt) + (e & 1))) & 1u;
}

struct PosRange {
  int lo, hi;
};
/// Min and max of a[r0 .. r0 + rows) (entries < lim), in every lane of the warp ({INT_MAX,
/// INT_MIN} when empty).
__device__ __forceinline__ PosRange pos_range(const int32_t* a, int64_t r0, int rows, int64_t lim, int lane) {
  int mn = INT_MAX, mx = INT_MIN;
  for (int r = lane; r < rows; r += 32)
    if (r0 + r < lim) {
      const int v = a[r0 + r];
      mn = min(mn, v);
      mx = max(mx, v);
    }
  return {__reduce_min_sync(kFull, mn), __reduce_max_sync(kFull, mx)};
}

/// Visibility of a key tile (positions kr) to a query tile (positions qr, document starts dr;
/// dr = {INT_MIN, INT_MIN} without documents): some element visible (return), every element
/// visible (full: also needs both tiles complete).
__device__ __forceinline__ bool tile_visible(PosRange kr, PosRange qr, PosRange dr, bool complete, bool& full) {
  full = complete && kr.hi <= qr.lo && kr.lo >= dr.hi;
  return kr.lo <= qr.hi && kr.hi >= dr.lo;
}

/// The key tiles that one tile of query rows [row0, row0 + BR) walks in the forward and the
/// deterministic dQ kernels (ca_fwd_mma, ca_bwd_dq_mma): the next tile some query can see (by the
/// tiles' global positions and document starts; `full`: every element visible), and a tile's K, V
/// and key positions (INT_MAX past sk) loaded into double-buffer half `buf` with cp.async.
template <typename T, int BR, int BC, int D, int NT>
struct KeyTiles {
  static constexpr int SD = D + 8;
  const CaParams& p;
  const int64_t row0, krs;
  T* const sK;
  T* const sV;
  int* const sKp;
  const T* const kg;
  const T* const vg;
  const int tid, lane;
  const PosRange qr, dr;
  const int ntiles;
  __device__ KeyTiles(const CaParams& p_, const int32_t* doc, int64_t row0_, T* sK_, T* sV_, int* sKp_, const T* kg_,
                      const T* vg_, int64_t krs_, int tid_, int lane_)
      : p(p_), row0(row0_), krs(krs_), sK(sK_), sV(sV_), sKp(sKp_), kg(kg_), vg(vg_), tid(tid_), lane(lane_),
        qr(pos_range(p_.qp, row0_, BR, p_.sq, lane_)),
        dr(doc ? pos_range(doc, row0_, BR, p_.sq, lane_) : PosRange{INT_MIN, INT_MIN}),
        ntiles(static_cast<int>((p_.sk + BC - 1) / BC)) {}
  /// The first visible tile from nb on (ntiles when none).
  __device__ __forceinline__ int next(int nb, bool& full) const {
    for (; nb < ntiles; ++nb) {
      const PosRange kr = pos_range(p.kp, static_cast<int64_t>(nb) * BC, BC, p.sk, lane);
      if (tile_visible(kr, qr, dr, row0 + BR <= p.sq && static_cast<int64_t>(nb + 1) * BC <= p.sk, full)) break;
    }
    return nb;
  }
  __device__ __forceinline__ void load(int nb, int buf) const {
    const int64_t c0 = static_cast<int64_t>(nb) * BC;
    load_tile<BC, D, NT>(sK + buf * BC * SD, kg, c0, krs, p.sk, tid);
    load_tile<BC, D, NT>(sV + buf * BC * SD, vg, c0, krs, p.sk, tid);
    for (int j = tid; j < BC; j += NT) sKp[buf * BC + j] = c0 + j < p.sk ? p.kp[c0 + j] : INT_MAX;
  }
};

template <int D, int W, int BC, int MW>
constexpr int ca_fwd_smem_bytes() {
  return (16 * MW * W + 4 * BC) * (D + 8) * 2 + 2 * BC * 4;
}

template <typename T, int D, int W, int BC, int MW, bool QR>
__global__ void __launch_bounds__(W * 32) ca_fwd_mma(const CaParams p) {
  constexpr int WR = 16 * MW, BR = WR * W, SD = D + 8, NT = 32 * W;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);                    // [BR][SD]
  T* sK = sQ + BR * SD;                                  // [2][BC][SD]
  T* sV = sK + 2 * BC * SD;                              // [2][BC][SD]
  int* sKp = reinterpret_cast<int*>(sV + 2 * BC * SD);  // [2][BC] key positions (INT_MAX past sk)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t sq = p.sq;
  const int64_t bh = blockIdx.x, b = bh / p.n, h = bh % p.n, grp = h / p.qpg, qi = h % p.qpg;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * BR;
  const int64_t qrs = p.q_rs(), krs = p.kv_rs();
  const T* qg = static_cast<const T*>(p.qkv) + p.q_base(b, grp, qi);
  const T* kg = static_cast<const T*>(p.kv) + p.kv_base(b, grp);
  const T* vg = kg + D;
  const int32_t* doc = p.doc ? p.doc + b * p.doc_stride : nullptr;
  const KeyTiles<T, BR, BC, D, NT> tiles(p, doc, row0, sK, sV, sKp, kg, vg, krs, tid, lane);
  const int ntiles = tiles.ntiles;
  auto next = [&](int nb, bool& full) { return tiles.next(nb, full); };
  auto load_kv = [&](int nb, int buf) { tiles.load(nb, buf); };
  const int64_t wrow = row0 + warp * WR;  // row (mi, r): wrow + mi·16 + g + 8r
  int qp_r[MW][2], ds_r[MW][2];
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = wrow + mi * 16 + g + 8 * r;
      qp_r[mi][r] = i < sq ? p.qp[i] : INT_MIN;
      ds_r[mi][r] = doc && i < sq ? doc[i] : INT_MIN;
    }
  }

  bool full = false;
  int nb = next(0, full);
  load_tile<BR, D, NT>(sQ, qg, row0, qrs, sq, tid);
  if (nb < ntiles) load_kv(nb, 0);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  auto q_addr = [&](int mi, int kk) {
    return smem_u32(sQ + (warp * WR + mi * 16 + (lane & 15)) * SD + kk * 16 + (lane >> 4) * 8);
  };
  uint32_t qf[QR ? MW : 1][QR ? D / 16 : 1][4];
  if constexpr (QR) {
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) ldsm_x4(qf[mi][kk], q_addr(mi, kk));
    }
  }
  float o[MW][D / 8][4];
  float m_r[MW][2], l_r[MW][2];
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[mi][nt][0] = o[mi][nt][1] = o[mi][nt][2] = o[mi][nt][3] = 0.f;
    m_r[mi][0] = m_r[mi][1] = -INFINITY;
    l_r[mi][0] = l_r[mi][1] = 0.f;
  }
  const float sl2 = p.scale_log2;
  int buf = 0;
  while (nb < ntiles) {
    cp_async_wait<0>();
    __syncthreads();
    bool full_next = false;
    const int nnb = next(nb + 1, full_next);
    if (nnb < ntiles) load_kv(nnb, buf ^ 1);
    cp_async_commit();
    const T* sKb = sK + buf * BC * SD;
    const T* sVb = sV + buf * BC * SD;
    const int* sKpb = sKp + buf * BC;

    float sc[MW][BC / 8][4];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) sc[mi][nt][0] = sc[mi][nt][1] = sc[mi][nt][2] = sc[mi][nt][3] = 0.f;
    }
    mma_abt_tile<T, D, BC, MW>(
        sc,
        [&](int mi, int kk, uint32_t(&a)[4]) {
          if constexpr (QR) {
#pragma unroll
            for (int x = 0; x < 4; ++x) a[x] = qf[mi][kk][x];
          } else {
            ldsm_x4(a, q_addr(mi, kk));
          }
        },
        sKb, lane);

    if (!full) {  // key position <= query position, >= the query's document start
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int kp = sKpb[nt * 8 + 2 * t4 + (e & 1)], r = e >> 1;
            if (kp > qp_r[mi][r] || kp < ds_r[mi][r]) sc[mi][nt][e] = -INFINITY;
          }
        }
      }
    }

#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = m_r[mi][r];
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) mx = fmaxf(mx, fmaxf(sc[mi][nt][2 * r], sc[mi][nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
        const float ms = mx == -INFINITY ? 0.f : mx * sl2;
        const float alpha = exp2f(m_r[mi][r] * sl2 - ms);
        m_r[mi][r] = mx;
        l_r[mi][r] *= alpha;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
          o[mi][nt][2 * r] *= alpha;
          o[mi][nt][2 * r + 1] *= alpha;
        }
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float pv = exp2f(fmaf(sc[mi][nt][2 * r + c], sl2, -ms));
            sc[mi][nt][2 * r + c] = pv;
            l_r[mi][r] += pv;
          }
        }
      }
    }

    // Dropout on the probabilities that multiply V (l keeps the undropped ones).
    if (p.drop.enabled) {
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
        const uint64_t keep = keep_bits_rows<BC>(p.drop, bh, qp_r[mi][0], qp_r[mi][1], sKpb, t4);
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (!keep_bit(keep, nt, e, BC / 8)) sc[mi][nt][e] = 0.f;
        }
      }
    }

    mma_pb_tile<T, D, BC, MW>(o, sc, sVb, lane);
    nb = nnb;
    full = full_next;
    buf ^= 1;
  }
  cp_async_wait<0>();

  // Epilogue: this block's (out, lse) of each row, or merged with the caller's by their LSE.
  float l_tot[MW][2], l_old[MW][2];
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_r[mi][r];
      l += __shfl_xor_sync(kFull, l, 1);
      l += __shfl_xor_sync(kFull, l, 2);
      l_tot[mi][r] = l;
      const int64_t i = wrow + mi * 16 + g + 8 * r;
      l_old[mi][r] = p.merge && i < sq ? p.lse[p.row(i, b, h)] : -INFINITY;
    }
  }
  __syncwarp();  // every lane of a quad has read the old LSE before lane 0 replaces it
  T* out = static_cast<T*>(p.out);
  const int64_t ors = p.o_rs();
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = wrow + mi * 16 + g + 8 * r;
      if (i >= sq) continue;
      const float l = l_tot[mi][r], old = l_old[mi][r];
      T* orow = out + i * ors + (b * p.n + h) * D;
      float* lp = p.lse + p.row(i, b, h);
      if (l == 0.f) {  // no visible key in this block
        if (!p.merge) {
#pragma unroll
          for (int nt = 0; nt < D / 8; ++nt) *reinterpret_cast<uint32_t*>(orow + nt * 8 + 2 * t4) = pack2<T>(0.f, 0.f);
          if (t4 == 0) *lp = -INFINITY;
        }
        continue;
      }
      const float lb = m_r[mi][r] * p.scale + logf(l);
      float ln = lb, wo = 0.f, wb = p.drop.inv_keep / l;
      if (old != -INFINITY) {
        ln = fmaxf(old, lb) + log1pf(expf(-fabsf(old - lb)));
        wo = expf(old - ln);
        wb = expf(lb - ln) * p.drop.inv_keep / l;
      }
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        uint32_t* dst = reinterpret_cast<uint32_t*>(orow + nt * 8 + 2 * t4);
        float x0 = o[mi][nt][2 * r] * wb, x1 = o[mi][nt][2 * r + 1] * wb;
        if (wo != 0.f) {
          const float2 prev = unpack2<T>(*dst);
          x0 = fmaf(prev.x, wo, x0);
          x1 = fmaf(prev.y, wo, x1);
        }
        *dst = pack2<T>(x0, x1);
      }
      if (t4 == 0) *lp = ln;
    }
  }
}

template <int D, int W, int BR, bool kDq>
constexpr int ca_bwd_smem_bytes() {
  constexpr int BC = 16 * W;
  return (2 * BC * (D + 8) + 4 * BR * (D + 8) + (kDq ? BC * (BR + 8) : 0)) * 2 + 2 * BR * 4 * 4;
}

/// dK, dV of the block's 16·W keys (added to dkv) and, with kDq, their dQ contributions (fp32
/// atomics into dq_accum); without kDq (--deterministic-mode) dQ is left to ca_bwd_dq_mma.
template <typename T, int D, int W, int BR, bool kDq>
__global__ void __launch_bounds__(W * 32) ca_bwd_mma(const CaParams p) {
  constexpr int BC = 16 * W, SD = D + 8, SR = BR + 8, NT = 32 * W;
  constexpr int R = BR / 16, DC = D * R / W;  // dQ: warp -> 16 query rows x DC dims
  static_assert(W % R == 0 && DC % 16 == 0, "dQ warp partition");
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);  // [BC][SD]
  T* sV = sK + BC * SD;                // [BC][SD]
  T* sQ = sV + BC * SD;                // [2][BR][SD]
  T* sdO = sQ + 2 * BR * SD;           // [2][BR][SD]
  [[maybe_unused]] T* sdS = sdO + 2 * BR * SD;  // [BC][SR]: dS^T; kDq only
  float* sL = reinterpret_cast<float*>(sdS + (kDq ? BC * SR : 0));  // [2][BR] lse · log2(e) (+inf: no key / past sq)
  float* sDl = sL + 2 * BR;                             // [2][BR] D_i
  int* sDs = reinterpret_cast<int*>(sDl + 2 * BR);      // [2][BR] document start
  int* sQp = sDs + 2 * BR;                              // [2][BR] query position
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t sq = p.sq, sk = p.sk, n = p.n, qpg = p.qpg;
  const int64_t bg = blockIdx.x, b = bg / p.G, grp = bg % p.G;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * BC;
  const int64_t qrs = p.q_rs(), krs = p.kv_rs(), ors = p.o_rs();
  const T* qkv = static_cast<const T*>(p.qkv);
  const T* dout = static_cast<const T*>(p.dout);
  const T* kg = static_cast<const T*>(p.kv) + p.kv_base(b, grp);
  const T* vg = kg + D;
  const int32_t* doc = p.doc ? p.doc + b * p.doc_stride : nullptr;
  const float sl2 = p.scale_log2;

  load_tile<BC, D, NT>(sK, kg, col0, krs, sk, tid);
  load_tile<BC, D, NT>(sV, vg, col0, krs, sk, tid);
  cp_async_commit();

  const PosRange kr = pos_range(p.kp, col0, BC, sk, lane);
  const int64_t wkey = col0 + warp * 16;  // this warp's first key
  int kp_r[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) kp_r[r] = wkey + g + 8 * r < sk ? p.kp[wkey + g + 8 * r] : INT_MAX;
  const int per_head = static_cast<int>((sq + BR - 1) / BR), total = static_cast<int>(qpg) * per_head;
  auto next = [&](int it, bool& full) {
    for (; it < total; ++it) {
      const int64_t row0 = static_cast<int64_t>(it % per_head) * BR;
      const PosRange qr = pos_range(p.qp, row0, BR, sq, lane);
      const PosRange dr = doc ? pos_range(doc, row0, BR, sq, lane) : PosRange{INT_MIN, INT_MIN};
      if (tile_visible(kr, qr, dr, row0 + BR <= sq && col0 + BC <= sk, full)) break;
    }
    return it;
  };
  auto load_q = [&](int it, int buf) {
    const int64_t qh = it / per_head, row0 = static_cast<int64_t>(it % per_head) * BR, h = grp * qpg + qh;
    load_tile<BR, D, NT>(sQ + buf * BR * SD, qkv + p.q_base(b, grp, qh), row0, qrs, sq, tid);
    load_tile<BR, D, NT>(sdO + buf * BR * SD, dout + (b * n + h) * D, row0, ors, sq, tid);
    for (int r = tid; r < BR; r += NT) {
      const int64_t i = row0 + r;
      const bool ok = i < sq;
      const float l = ok ? p.lse[p.row(i, b, h)] : INFINITY;
      sL[buf * BR + r] = isfinite(l) ? l * kLog2e : INFINITY;
      sDl[buf * BR + r] = ok ? p.delta[p.row(i, b, h)] : 0.f;
      sDs[buf * BR + r] = ok && doc ? doc[i] : INT_MIN;
      sQp[buf * BR + r] = ok ? p.qp[i] : INT_MIN;
    }
  };

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[nt][e] = dv[nt][e] = 0.f;
  }
  bool full = false;
  int it = next(0, full), buf = 0;
  if (it < total) load_q(it, 0);
  cp_async_commit();
  while (it < total) {
    cp_async_wait<0>();
    __syncthreads();
    bool full_next = false;
    const int nit = next(it + 1, full_next);
    if (nit < total) load_q(nit, buf ^ 1);
    cp_async_commit();
    const int64_t qh = it / per_head, row0 = static_cast<int64_t>(it % per_head) * BR;
    const int64_t h = grp * qpg + qh, bh = b * n + h;
    const T* sQb = sQ + buf * BR * SD;
    const T* sdOb = sdO + buf * BR * SD;
    const float* sLb = sL + buf * BR;
    const float* sDlb = sDl + buf * BR;
    const int* sDsb = sDs + buf * BR;
    const int* sQpb = sQp + buf * BR;

    float st[BR / 8][4], dpt[BR / 8][4];
#pragma unroll
    for (int nt = 0; nt < BR / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[4], va[4];
      ldsm_x4(ka, smem_u32(sK + (warp * 16 + (lane & 15)) * SD + kk * 16 + (lane >> 4) * 8));
      ldsm_x4(va, smem_u32(sV + (warp * 16 + (lane & 15)) * SD + kk * 16 + (lane >> 4) * 8));
#pragma unroll
      for (int nn = 0; nn < BR / 16; ++nn) {
        const int off = (nn * 16 + (lane & 7) + ((lane >> 4) << 3)) * SD + kk * 16 + ((lane >> 3) & 1) * 8;
        uint32_t bq[4], bo[4];
        ldsm_x4(bq, smem_u32(sQb + off));
        mma16816<T>(st[2 * nn], ka, bq[0], bq[1]);
        mma16816<T>(st[2 * nn + 1], ka, bq[2], bq[3]);
        ldsm_x4(bo, smem_u32(sdOb + off));
        mma16816<T>(dpt[2 * nn], va, bo[0], bo[1]);
        mma16816<T>(dpt[2 * nn + 1], va, bo[2], bo[3]);
      }
    }

    // Element e of fragment nt: key wkey + g + 8·(e >> 1), query row0 + nt·8 + 2·t4 + (e & 1).
    uint32_t keep = ~0u;
    if (p.drop.enabled) {
      keep = 0;
#pragma unroll 1
      for (int k = 0; k < BR / 2; ++k) {
        const int ql = (k >> 2) * 8 + 2 * t4 + (k & 1);
        keep |= static_cast<uint32_t>(p.drop.keep(p.drop.row_start(bh, sQpb[ql]) +
                                                  static_cast<uint64_t>(kp_r[(k >> 1) & 1])))
                << k;
      }
    }
    const float mk = p.drop.inv_keep;
#pragma unroll
    for (int nt = 0; nt < BR / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ql = nt * 8 + 2 * t4 + (e & 1), kp = kp_r[e >> 1];
        const bool kept = (keep >> (nt * 4 + e)) & 1u;
        float pd;
        dpt[nt][e] = bwd_ds_element(st[nt][e], sl2, sLb[ql], !(!full && (kp > sQpb[ql] || kp < sDsb[ql])), kept, mk,
                                    dpt[nt][e], sDlb[ql], pd);
        st[nt][e] = pd;
      }
    }

    bwd_dkdv_tile<T, D, BR>(dv, dk, st, dpt, sdOb, sQb, lane);
    if constexpr (kDq) {
      bwd_store_ds<T, BR>(sdS, dpt, warp, lane);
      __syncthreads();
      const int rg = warp % R, cg = warp / R;
      float dq[DC / 8][4];
      bwd_dq_tile<T, D, BR, BC, DC>(dq, sdS, sK, rg, cg, lane);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t i = row0 + rg * 16 + g + 8 * r;
        if (i < sq) {
          float* dqa = p.dq_accum + p.row(i, b, h) * D;
#pragma unroll
          for (int nt = 0; nt < DC / 8; ++nt) {
            float* dst = dqa + cg * DC + nt * 8 + 2 * t4;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            atomicAdd(reinterpret_cast<float2*>(dst), make_float2(dq[nt][2 * r], dq[nt][2 * r + 1]));
#else
            atomicAdd(dst, dq[nt][2 * r]);
            atomicAdd(dst + 1, dq[nt][2 * r + 1]);
#endif
          }
        }
      }
    }
    it = nit;
    full = full_next;
    buf ^= 1;
  }
  cp_async_wait<0>();

  // Epilogue: dkv (+=) dK · scale and dV of this warp's 16 keys, straight from the accumulators.
  T* dkg = static_cast<T*>(p.dkv) + p.kv_base(b, grp);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t j = wkey + g + 8 * r;
    if (j >= sk) continue;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      uint32_t* pk = reinterpret_cast<uint32_t*>(dkg + j * krs + nt * 8 + 2 * t4);
      uint32_t* pv = reinterpret_cast<uint32_t*>(dkg + j * krs + D + nt * 8 + 2 * t4);
      const float2 ok = unpack2<T>(*pk), ov = unpack2<T>(*pv);
      *pk = pack2<T>(fmaf(dk[nt][2 * r], p.scale, ok.x), fmaf(dk[nt][2 * r + 1], p.scale, ok.y));
      *pv = pack2<T>(ov.x + dv[nt][2 * r], ov.y + dv[nt][2 * r + 1]);
    }
  }
}

template <int D, int W, int BC>
constexpr int ca_dq_smem_bytes() {
  return (2 * 16 * W + 4 * BC) * (D + 8) * 2 + 2 * BC * 4;
}

/// Deterministic dQ (--deterministic-mode): one block per (query tile of 16·W rows, b·n); each warp
/// owns 16 query rows and walks the visible key tiles in order (the forward's tile skipping by
/// positions and document starts; double-buffered K/V and key positions, one barrier per tile),
/// recomputing S = Q K^T, P, dP = dO V^T and dS with ca_bwd_mma's element formula
/// (bwd_ds_element), masks and dropout bits, and accumulates dQ = dS K in registers; then the
/// query slots of dqkv += scale · dQ. No atomics: the same bits on every run.
template <typename T, int D, int W, int BC>
__global__ void __launch_bounds__(W * 32) ca_bwd_dq_mma(const CaParams p) {
  constexpr int BR = 16 * W, SD = D + 8, NT = 32 * W;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);                    // [BR][SD]
  T* sdO = sQ + BR * SD;                                 // [BR][SD]
  T* sK = sdO + BR * SD;                                 // [2][BC][SD]
  T* sV = sK + 2 * BC * SD;                              // [2][BC][SD]
  int* sKp = reinterpret_cast<int*>(sV + 2 * BC * SD);  // [2][BC] key positions (INT_MAX past sk)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t sq = p.sq;
  const int64_t bh = blockIdx.x, b = bh / p.n, h = bh % p.n, grp = h / p.qpg, qi = h % p.qpg;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * BR;
  const int64_t qrs = p.q_rs(), krs = p.kv_rs(), ors = p.o_rs();
  const T* qkv = static_cast<const T*>(p.qkv);
  const T* kg = static_cast<const T*>(p.kv) + p.kv_base(b, grp);
  const T* vg = kg + D;
  const int32_t* doc = p.doc ? p.doc + b * p.doc_stride : nullptr;
  const KeyTiles<T, BR, BC, D, NT> tiles(p, doc, row0, sK, sV, sKp, kg, vg, krs, tid, lane);
  const int ntiles = tiles.ntiles;
  auto next = [&](int nb, bool& full) { return tiles.next(nb, full); };
  auto load_kv = [&](int nb, int buf) { tiles.load(nb, buf); };
  const int64_t wrow = row0 + warp * 16;  // this warp's first query row; element rows wrow + g + 8·r
  float lse2[2], dl[2];
  int qp_r[2], ds_r[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // as ca_bwd_mma's sL, sDl, sQp, sDs
    const int64_t i = wrow + g + 8 * r;
    const bool ok = i < sq;
    const float l = ok ? p.lse[p.row(i, b, h)] : INFINITY;
    lse2[r] = isfinite(l) ? l * kLog2e : INFINITY;
    dl[r] = ok ? p.delta[p.row(i, b, h)] : 0.f;
    qp_r[r] = ok ? p.qp[i] : INT_MIN;
    ds_r[r] = ok && doc ? doc[i] : INT_MIN;
  }

  bool full = false;
  int nb = next(0, full);
  load_tile<BR, D, NT>(sQ, qkv + p.q_base(b, grp, qi), row0, qrs, sq, tid);
  load_tile<BR, D, NT>(sdO, static_cast<const T*>(p.dout) + bh * D, row0, ors, sq, tid);
  if (nb < ntiles) load_kv(nb, 0);
  cp_async_commit();
  const auto q_frag = [&](int, int kk, uint32_t(&a)[4]) {
    ldsm_x4(a, smem_u32(sQ + (warp * 16 + (lane & 15)) * SD + kk * 16 + (lane >> 4) * 8));
  };
  const auto do_frag = [&](int, int kk, uint32_t(&a)[4]) {
    ldsm_x4(a, smem_u32(sdO + (warp * 16 + (lane & 15)) * SD + kk * 16 + (lane >> 4) * 8));
  };
  float dq[1][D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) dq[0][nt][0] = dq[0][nt][1] = dq[0][nt][2] = dq[0][nt][3] = 0.f;
  const float sl2 = p.scale_log2, mk = p.drop.inv_keep;
  int buf = 0;
  while (nb < ntiles) {
    cp_async_wait<0>();
    __syncthreads();
    bool full_next = false;
    const int nnb = next(nb + 1, full_next);
    if (nnb < ntiles) load_kv(nnb, buf ^ 1);
    cp_async_commit();
    const T* sKb = sK + buf * BC * SD;
    const T* sVb = sV + buf * BC * SD;
    const int* sKpb = sKp + buf * BC;

    float sc[1][BC / 8][4], dp[1][BC / 8][4];
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[0][nt][e] = dp[0][nt][e] = 0.f;
    }
    mma_abt_tile<T, D, BC, 1>(sc, q_frag, sKb, lane);
    mma_abt_tile<T, D, BC, 1>(dp, do_frag, sVb, lane);

    // dS (into sc): element e of fragment nt is (row wrow + g + 8·(e >> 1), key nt·8 + 2·t4 + (e & 1)
    // of the tile).
    const uint64_t keep =
        p.drop.enabled ? keep_bits_rows<BC>(p.drop, bh, qp_r[0], qp_r[1], sKpb, t4) : ~uint64_t{0};
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, kp = sKpb[nt * 8 + 2 * t4 + (e & 1)];
        float pd;
        sc[0][nt][e] = bwd_ds_element(sc[0][nt][e], sl2, lse2[r], !(!full && (kp > qp_r[r] || kp < ds_r[r])),
                                      keep_bit(keep, nt, e, BC / 8), mk, dp[0][nt][e], dl[r], pd);
      }
    }
    mma_pb_tile<T, D, BC, 1>(dq, sc, sKb, lane);
    nb = nnb;
    full = full_next;
    buf ^= 1;
  }
  cp_async_wait<0>();

  // Epilogue: dqkv query slots (+=) scale · dQ, straight from the accumulators.
  T* dqg = static_cast<T*>(p.dqkv) + p.q_base(b, grp, qi);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = wrow + g + 8 * r;
    if (i >= sq) continue;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      uint32_t* dst = reinterpret_cast<uint32_t*>(dqg + i * qrs + nt * 8 + 2 * t4);
      const float2 old = unpack2<T>(*dst);
      *dst = pack2<T>(fmaf(p.scale, dq[0][nt][2 * r], old.x), fmaf(p.scale, dq[0][nt][2 * r + 1], old.y));
    }
  }
}

/// delta of row r (= (i·b + b)·n + h) = Σ_e dout ∘ out, and (kZeroDq) dq_accum's row zeroed; D / 8
/// threads per row, 16-byte accesses.
template <typename T, int D, bool kZeroDq>
__global__ void __launch_bounds__(256) ca_bwd_pre(const CaParams p) {
  constexpr int kLanes = D / 8;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
  const int sub = static_cast<int>(threadIdx.x % kLanes);
  const bool ok = row < p.sq * p.B * p.n;
  float acc = 0.f;
  if (ok) {
    const int64_t off = row * D + sub * 8;
    const uint4 go = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + off);
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.out) + off);
    const T* a = reinterpret_cast<const T*>(&go);
    const T* c = reinterpret_cast<const T*>(&o);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += to_f(a[e]) * to_f(c[e]);
    if constexpr (kZeroDq) {
      float4* dq = reinterpret_cast<float4*>(p.dq_accum + off);
      dq[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      dq[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(kFull, acc, o);
  if (ok && sub == 0) p.delta[row] = acc;
}

/// dqkv query slots += scale · dq_accum (rows (i, b, h)).
template <typename T, int D>
__global__ void __launch_bounds__(256) ca_bwd_dq_add(const CaParams p) {
  constexpr int kLanes = D / 8;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = t / kLanes;
  if (r >= p.sq * p.B * p.n) return;
  const int sub = static_cast<int>(t % kLanes);
  const int64_t h = r % p.n, b = (r / p.n) % p.B, i = r / (p.n * p.B);
  const float4* src = reinterpret_cast<const float4*>(p.dq_accum + r * D + sub * 8);
  const float4 x = src[0], y = src[1];
  uint4* dst = reinterpret_cast<uint4*>(static_cast<T*>(p.dqkv) + i * p.q_rs() + p.q_base(b, h / p.qpg, h % p.qpg) +
                                        sub * 8);
  uint4 v = *dst;
  const float2 a = unpack2<T>(v.x), c = unpack2<T>(v.y), e = unpack2<T>(v.z), f = unpack2<T>(v.w);
  v.x = pack2<T>(fmaf(p.scale, x.x, a.x), fmaf(p.scale, x.y, a.y));
  v.y = pack2<T>(fmaf(p.scale, x.z, c.x), fmaf(p.scale, x.w, c.y));
  v.z = pack2<T>(fmaf(p.scale, y.x, e.x), fmaf(p.scale, y.y, e.y));
  v.w = pack2<T>(fmaf(p.scale, y.z, f.x), fmaf(p.scale, y.w, f.y));
  *dst = v;
}

template <typename K>
void set_smem(K kernel, int bytes) {
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

/// MT_CONTEXT_ATTN_SIMPLE=1: always the simple kernels (benchmarks: old vs new), read once.
bool force_simple() {
  static const bool v = [] {
    const char* e = std::getenv("MT_CONTEXT_ATTN_SIMPLE");
    return e != nullptr && std::atoi(e) != 0;
  }();
  return v;
}

CaParams make_params(const Tensor& qkv, const Tensor& kv, const ContextAttentionConfig& c) {
  CaParams p;
  p.qkv = qkv.data();
  p.kv = kv.data();
  p.qp = c.q_pos.data_as<int32_t>();
  p.kp = c.k_pos.data_as<int32_t>();
  p.doc = c.doc_start.empty() ? nullptr : c.doc_start.data_as<int32_t>();
  p.doc_stride = c.doc_start.empty() ? 0 : c.doc_start.stride(0);
  p.sq = qkv.size(0);
  p.sk = kv.size(0);
  p.B = c.batch;
  p.G = c.groups;
  p.qpg = c.queries_per_group;
  p.n = c.heads();
  p.d = c.head_dim;
  p.scale = c.softmax_scale;
  p.scale_log2 = c.softmax_scale * kLog2e;
  p.drop = context_attention_dropout(c);
  return p;
}

/// The tensor-core path applies: bf16/fp16, d in {64, 128}, 16-byte aligned tensors, not forced off.
template <typename T>
bool use_mma(const CaParams& p, std::initializer_list<const void*> ptrs) {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    if (force_simple() || (p.d != 64 && p.d != 128)) return false;
    for (const void* q : ptrs)
      if (!aligned16(q)) return false;
    return true;
  }
}

/// Tile shapes of ops/cuda/flash_attention.cu's defaults (measured there on an H100): forward
/// <d, W warps, BC keys per tile, MW row groups per warp, Q in registers>, backward <d, W warps
/// (16·W keys per block), BR queries per tile>.
template <typename T, int D, int W, int BC, int MW, bool QR>
void fwd_mma(const CaParams& p, cudaStream_t st) {
  constexpr int kBytes = ca_fwd_smem_bytes<D, W, BC, MW>(), kRows = 16 * MW * W;
  const auto kernel = ca_fwd_mma<T, D, W, BC, MW, QR>;
  set_smem(kernel, kBytes);
  const dim3 grid(static_cast<unsigned>(p.B * p.n), static_cast<unsigned>((p.sq + kRows - 1) / kRows));
  kernel<<<grid, W * 32, kBytes, st>>>(p);
  MT_CUDA_CHECK(cudaGetLastError());
}

template <typename T, int D, int W, int BR, bool kDq>
void bwd_mma(const CaParams& p, cudaStream_t st) {
  constexpr int kBytes = ca_bwd_smem_bytes<D, W, BR, kDq>();
  const auto kernel = ca_bwd_mma<T, D, W, BR, kDq>;
  set_smem(kernel, kBytes);
  const dim3 grid(static_cast<unsigned>(p.B * p.G), static_cast<unsigned>((p.sk + 16 * W - 1) / (16 * W)));
  kernel<<<grid, W * 32, kBytes, st>>>(p);
  MT_CUDA_CHECK(cudaGetLastError());
}

/// The deterministic dQ kernel <d, W warps (16·W queries per block), BC keys per tile> (the
/// forward's key tiles).
template <typename T, int D, int W, int BC>
void dq_mma(const CaParams& p, cudaStream_t st) {
  constexpr int kBytes = ca_dq_smem_bytes<D, W, BC>();
  const auto kernel = ca_bwd_dq_mma<T, D, W, BC>;
  set_smem(kernel, kBytes);
  const dim3 grid(static_cast<unsigned>(p.B * p.n), static_cast<unsigned>((p.sq + 16 * W - 1) / (16 * W)));
  kernel<<<grid, W * 32, kBytes, st>>>(p);
  MT_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void launch_fwd_mma(const CaParams& p, cudaStream_t st) {
  if (p.d == 64) fwd_mma<T, 64, 4, 64, 2, true>(p, st);
  else fwd_mma<T, 128, 4, 32, 2, false>(p, st);
}

template <typename T>
void launch_bwd_mma(const CaParams& p, bool deterministic, cudaStream_t st) {
  const int64_t rows = p.sq * p.B * p.n;
  const unsigned blocks = static_cast<unsigned>((rows * (p.d / 8) + 255) / 256);
  if (deterministic) {  // dK, dV; then dQ by its own kernel (no atomics, no dq_accum)
    if (p.d == 64) {
      ca_bwd_pre<T, 64, false><<<blocks, 256, 0, st>>>(p);
      MT_CUDA_CHECK(cudaGetLastError());
      bwd_mma<T, 64, 4, 32, false>(p, st);
      dq_mma<T, 64, 4, 64>(p, st);
    } else {
      ca_bwd_pre<T, 128, false><<<blocks, 256, 0, st>>>(p);
      MT_CUDA_CHECK(cudaGetLastError());
      bwd_mma<T, 128, 8, 32, false>(p, st);
      dq_mma<T, 128, 4, 32>(p, st);
    }
    return;
  }
  if (p.d == 64) {
    ca_bwd_pre<T, 64, true><<<blocks, 256, 0, st>>>(p);
    MT_CUDA_CHECK(cudaGetLastError());
    bwd_mma<T, 64, 4, 32, true>(p, st);
    ca_bwd_dq_add<T, 64><<<blocks, 256, 0, st>>>(p);
  } else {
    ca_bwd_pre<T, 128, true><<<blocks, 256, 0, st>>>(p);
    MT_CUDA_CHECK(cudaGetLastError());
    bwd_mma<T, 128, 8, 32, true>(p, st);
    ca_bwd_dq_add<T, 128><<<blocks, 256, 0, st>>>(p);
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void context_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                               const ContextAttentionConfig& c, bool merge, const Stream& stream) {
  MT_CHECK(c.head_dim <= kMaxD, "context_attention_forward: head_dim={} exceeds {} on CUDA", c.head_dim, kMaxD);
  const Dims x = dims_of(qkv, kv, c);
  const AttnDropout drop = context_attention_dropout(c);
  const int64_t rows = x.sq * x.B * c.heads();
  CaParams p = make_params(qkv, kv, c);
  p.out = out.data();
  p.lse = lse.data_as<float>();
  p.merge = merge;
  MT_CHECK((p.sq + 15) / 16 < 65536, "context_attention_forward: sq={} too long for the grid", p.sq);
  dispatch_float(qkv.dtype(), "context_attention_forward", [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (!std::is_same_v<T, float>) {
      if (use_mma<T>(p, {p.qkv, p.kv, p.out})) {
        launch_fwd_mma<T>(p, cu(stream));
        return;
      }
    }
    forward_kernel<T><<<grid_for(rows, kBlock), kBlock, 0, cu(stream)>>>(
        out.data_as<T>(), lse.data_as<float>(), qkv.data_as<T>(), kv.data_as<T>(), x, merge, drop);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void context_attention_backward(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout, const Tensor& out,
                                const Tensor& lse, const Tensor& qkv, const Tensor& kv, const Tensor& workspace,
                                const ContextAttentionConfig& c, const Stream& stream) {
  MT_CHECK(c.head_dim <= kMaxD, "context_attention_backward: head_dim={} exceeds {} on CUDA", c.head_dim, kMaxD);
  const Dims x = dims_of(qkv, kv, c);
  const AttnDropout drop = context_attention_dropout(c);
  CaParams p = make_params(qkv, kv, c);
  p.out = out.data();
  p.lse = lse.data_as<float>();
  p.dout = dout.data();
  p.dqkv = dqkv.data();
  p.dkv = dkv.data();
  const bool have_ws = !workspace.empty();
  if (have_ws) {
    const int64_t rows = p.sq * p.B * p.n;
    unsigned char* ws = static_cast<unsigned char*>(workspace.data());
    p.delta = reinterpret_cast<float*>(ws);
    p.dq_accum = reinterpret_cast<float*>(ws + (static_cast<size_t>(rows) * sizeof(float) + 255) / 256 * 256);
  }
  MT_CHECK((p.sk + 15) / 16 < 65536, "context_attention_backward: sk={} too long for the grid", p.sk);
  dispatch_float(qkv.dtype(), "context_attention_backward", [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (!std::is_same_v<T, float>) {
      if (have_ws && use_mma<T>(p, {p.qkv, p.kv, p.out, p.dout, p.dqkv, p.dkv, workspace.data()})) {
        launch_bwd_mma<T>(p, c.deterministic, cu(stream));
        return;
      }
    }
    const int64_t qrows = x.sq * x.B * c.heads(), krows = x.sk * x.B * x.g;
    dq_kernel<T><<<grid_for(qrows, kBlock), kBlock, 0, cu(stream)>>>(dqkv.data_as<T>(), dout.data_as<T>(),
                                                                      out.data_as<T>(), lse.data_as<float>(),
                                                                      qkv.data_as<T>(), kv.data_as<T>(), x, drop);
    dkv_kernel<T><<<grid_for(krows, kBlock), kBlock, 0, cu(stream)>>>(dkv.data_as<T>(), dout.data_as<T>(),
                                                                       out.data_as<T>(), lse.data_as<float>(),
                                                                       qkv.data_as<T>(), kv.data_as<T>(), x, drop);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void kv_pack(const Tensor& kv, const Tensor& qkv, int64_t qpg, const Stream& stream) {
  const int64_t dim = qkv.size(-1), R = qkv.numel() / ((qpg + 2) * dim);
  const int64_t head = dim * static_cast<int64_t>(dtype_size(qkv.dtype()));
  move_kv_kernel<<<grid_for(R * 2 * head, 256), 256, 0, cu(stream)>>>(
      static_cast<char*>(kv.data()), static_cast<const char*>(qkv.data()), R, qpg + 2, qpg, head, true);
  MT_CUDA_CHECK(cudaGetLastError());
}

void kv_unpack(const Tensor& dqkv, const Tensor& dkv, int64_t qpg, const Stream& stream) {
  const int64_t dim = dqkv.size(-1), R = dqkv.numel() / ((qpg + 2) * dim);
  const int64_t head = dim * static_cast<int64_t>(dtype_size(dqkv.dtype()));
  move_kv_kernel<<<grid_for(R * 2 * head, 256), 256, 0, cu(stream)>>>(
      static_cast<char*>(dqkv.data()), static_cast<const char*>(dkv.data()), R, qpg + 2, qpg, head, false);
  MT_CUDA_CHECK(cudaGetLastError());
}

void transpose_blocks(const Tensor& y, const Tensor& x, int64_t a, int64_t b, const Stream& stream) {
  const int64_t c = x.numel() / (a * b) * static_cast<int64_t>(dtype_size(x.dtype()));
  transpose_kernel<<<grid_for(a * b * c, 256), 256, 0, cu(stream)>>>(static_cast<char*>(y.data()),
                                                                     static_cast<const char*>(x.data()), a, b, c);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mt::cuda
