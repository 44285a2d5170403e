// CUDA kernels of ops/flash_attention.h.
//
// Tensor-core path (bf16/fp16, head_dim 64 or 128, 16-byte aligned tensors): FlashAttention-2
// (Dao 2023, arXiv:2307.08691) on mma.sync.m16n8k16 with fp32 accumulation, ldmatrix from padded
// shared memory (row stride d + 8 elements: conflict-free ldmatrix) filled by cp.async.
//   forward  (fa_fwd_mma): one block per (query tile of 16·MW·W rows, b·n); each warp owns 16·MW
//            query rows (O accumulator in registers; Q fragments in registers or re-read from
//            shared memory) and walks the key tiles (BC keys, double-buffered K/V, one barrier per
//            tile) with the online softmax (Algorithm 1). Key tiles after the diagonal and before
//            the smallest doc_start of the query tile are skipped. Defaults (launch_fwd_mma):
//            d = 64: 4 warps x 32 rows, 64 keys; d = 128: 4 warps x 32 rows, 32 keys.
//   backward: fa_bwd_pre_vec (D_i = rowsum(dO ∘ O) into the workspace, dq_accum zeroed), fa_bwd_mma
//            (one block per (key tile of 16·W keys, b·g): each warp owns 16 keys and accumulates
//            their dK and dV in registers over the qpg query heads of the group and every query
//            tile at or after the diagonal (Algorithm 2); dS goes through shared memory for
//            dQ = dS K, added to dq_accum with fp32 atomics), fa_bwd_dq_convert_vec (dq_accum · scale
//            into dqkv). Defaults: d = 64: 4 warps (64 keys per block), d = 128: 8 warps (128
//            keys); 32 queries per tile.
//   deterministic backward (--deterministic-mode, FlashAttentionConfig::deterministic):
//            fa_bwd_pre_vec (D_i only), fa_bwd_mma without dQ (dK, dV only), then fa_bwd_dq_mma
//            (one block per (query tile of 64 rows, b·n): each warp owns 16 query rows, walks the
//            key tiles in order recomputing S, P, dP and dS — the same element formula, masks and
//            dropout bits — and keeps dQ = dS K in registers; written straight into dqkv). No
//            atomics: dQ is the same bits on every run. S and dP are recomputed once more than in
//            the atomic path (about 1.4x its FLOPs).
// Simple path (fp32 or any other case): one warp per query row (forward, dQ) or key row (dK, dV),
// 32 keys/queries at a time, one per lane, fp32 math with expf; head_dim up to 1024.
//
// Tuning (benchmarks only): MT_FLASH_ATTN_FWD_VARIANT / MT_FLASH_ATTN_BWD_VARIANT (0 default,
// 1 the runner-up tile shapes, see launch_fwd_mma / launch_bwd_mma), read once per process.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "core/cuda_check.h"
#include "ops/attention_impl.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/cudnn_attention.h"
#include "ops/cuda/mma_sm80.cuh"
#include "ops/flash_attention.h"

namespace mt::cuda {
namespace {

using namespace mma;  // NOLINT: the tensor-core building blocks

constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

/// Everything the kernels need, by value.
struct FaParams {
  const void* qkv = nullptr;  // [s, b, g, qpg + 2, d]
  void* out = nullptr;        // [s, b, n, d]
  float* lse = nullptr;       // [b, n, s]
  const void* dout = nullptr;
  void* dqkv = nullptr;
  float* delta = nullptr;     // [b, n, s]
  float* dq_accum = nullptr;  // [b, n, s, d]
  const int32_t* doc = nullptr;  // [b, s] or null
  int64_t s = 0, B = 0, G = 0, qpg = 0, n = 0, d = 0;
  float scale = 0, scale_log2 = 0;
  AttnDropout drop;

  __host__ __device__ int64_t qkv_row_stride() const { return B * G * (qpg + 2) * d; }
  __host__ __device__ int64_t out_row_stride() const { return B * n * d; }
  /// Offset of row 0 of component c (0..qpg-1 query heads, qpg key, qpg + 1 value) of (b, grp).
  __host__ __device__ int64_t qkv_base(int64_t b, int64_t grp, int64_t c) const {
    return ((b * G + grp) * (qpg + 2) + c) * d;
  }
};

// ---------------------------------------------------------------------------------------------
// Helpers (the PTX building blocks are in ops/cuda/mma_sm80.cuh).
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

/// Dropout keep decisions of the global elements G and G + 1 (one Philox call, two when G + 1
/// starts the next group of four).
__device__ __forceinline__ void keep2(const AttnDropout& drop, uint64_t G, bool& k0, bool& k1) {
  const Philox4 r = drop.bits4(G >> 2);
  const uint32_t e = static_cast<uint32_t>(G & 3u);
  const uint32_t v0 = e == 0 ? r.v[0] : e == 1 ? r.v[1] : e == 2 ? r.v[2] : r.v[3];
  const uint32_t v1 = e == 0 ? r.v[1] : e == 1 ? r.v[2] : e == 2 ? r.v[3] : drop.bits4((G >> 2) + 1).v[0];
  k0 = v0 >= drop.threshold;
  k1 = v1 >= drop.threshold;
}

/// Smallest doc_start over rows row0 .. row0 + rows - 1 (< s) of one sample, in every lane.
__device__ __forceinline__ int doc_min(const int32_t* doc, int64_t row0, int rows, int64_t s, int lane) {
  int mn = INT_MAX;
  for (int r = lane; r < rows; r += 32)
    if (row0 + r < s) mn = min(mn, static_cast<int>(doc[row0 + r]));
  return __reduce_min_sync(kFull, mn);
}

/// Dropout keep bits of this lane's elements of a query-major m16n8 accumulator over BC keys
/// (rows i0 and i0 + 8, keys col0 + nt·8 + 2·t4 + c): element e of fragment nt is bit
/// 2·((e >> 1)·(BC / 8) + nt) + (e & 1). Drawn in a rolled loop (one copy of Philox in the code).
template <int BC>
__device__ __forceinline__ uint64_t keep_bits_rows(const AttnDropout& drop, int64_t bh, int64_t i0, int64_t col0,
                                                   int t4) {
  static_assert(BC <= 128, "64 keep bits");
  uint64_t keep = 0;
#pragma unroll 1
  for (int k = 0; k < BC / 4; ++k) {  // k = r · (BC / 8) + nt: elements (r, nt, 0..1)
    const int r = k / (BC / 8), nt = k % (BC / 8);
    bool k0, k1;
    keep2(drop, drop.row_start(bh, i0 + 8 * r) + static_cast<uint64_t>(col0 + nt * 8 + 2 * t4), k0, k1);
    keep |= (static_cast<uint64_t>(k0) | static_cast<uint64_t>(k1) << 1) << (2 * k);
  }
  return keep;
}
__device__ __forceinline__ bool keep_bit(uint64_t keep, int nt, int e, int tiles) {
  return (keep >> (2 * ((e >> 1) * tiles + nt) + (e & 1))) & 1u;
}

// ---------------------------------------------------------------------------------------------
// Tensor-core forward.
// ---------------------------------------------------------------------------------------------

template <int D, int W, int BC, int MW>
constexpr int fwd_smem_bytes() {
  return (16 * MW * W + 4 * BC) * (D + 8) * 2;
}

/// W warps, each owning MW groups of 16 consecutive query rows (16·MW·W rows per block); BC keys
/// per tile. Every K/V fragment loaded from shared memory feeds MW row groups. QR: the Q fragments
/// stay in registers for the whole loop (else they are re-read from shared memory per key tile,
/// which frees registers for MW = 2 at d = 128, as FlashAttention-2 does).
/// One step of the double-buffered K/V tile pipeline of the query-major kernels (fa_fwd_mma,
/// fa_bwd_dq_mma), before the block works on tile nb (buffer half `buf`): one barrier per tile —
/// tile nb has landed for everyone and every warp is done with tile nb - 1, whose buffer the
/// prefetch of tile nb + 1 (when nb + 1 < n_hi) then overwrites.
template <int BC, int D, int NT, typename T>
__device__ __forceinline__ void kv_tile_step(T* sK, T* sV, const T* kg, const T* vg, int nb, int n_hi, int buf,
                                             int64_t rs, int64_t s, int tid) {
  constexpr int SD = D + 8;
  cp_async_wait<0>();
  __syncthreads();
  if (nb + 1 < n_hi) {
    load_tile<BC, D, NT>(sK + (buf ^ 1) * BC * SD, kg, static_cast<int64_t>(nb + 1) * BC, rs, s, tid);
    load_tile<BC, D, NT>(sV + (buf ^ 1) * BC * SD, vg, static_cast<int64_t>(nb + 1) * BC, rs, s, tid);
  }
  cp_async_commit();
}

template <typename T, int D, int W, int BC, int MW, bool QR>
__global__ void __launch_bounds__(W * 32) fa_fwd_mma(const FaParams p) {
  constexpr int WR = 16 * MW, BR = WR * W, SD = D + 8, NT = 32 * W;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);  // [BR][SD]; later the output staging
  T* sK = sQ + BR * SD;                // [2][BC][SD]
  T* sV = sK + 2 * BC * SD;            // [2][BC][SD]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t s = p.s;
  const int64_t bh = blockIdx.x, b = bh / p.n, h = bh % p.n, grp = h / p.qpg, qi = h % p.qpg;
  const int64_t row0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * BR;  // heavy tiles first
  const int64_t rs = p.qkv_row_stride();
  const T* qkv = static_cast<const T*>(p.qkv);
  const T* qg = qkv + p.qkv_base(b, grp, qi);
  const T* kg = qkv + p.qkv_base(b, grp, p.qpg);
  const T* vg = kg + D;
  const int64_t last_row = min64(row0 + BR, s) - 1;
  const int n_hi = static_cast<int>(last_row / BC) + 1;
  int n_lo = 0;
  const int32_t* doc = p.doc ? p.doc + b * s : nullptr;
  const int64_t wrow = row0 + warp * WR;  // this warp's first query row; row (mi, r): wrow + mi·16 + g + 8r
  int ds_r[MW][2] = {};
  if (doc) {
    n_lo = doc_min(doc, row0, BR, s, lane) / BC;
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t i = wrow + mi * 16 + g + 8 * r;
        ds_r[mi][r] = i < s ? doc[i] : 0;
      }
    }
  }

  load_tile<BR, D, NT>(sQ, qg, row0, rs, s, tid);
  load_tile<BC, D, NT>(sK, kg, static_cast<int64_t>(n_lo) * BC, rs, s, tid);
  load_tile<BC, D, NT>(sV, vg, static_cast<int64_t>(n_lo) * BC, rs, s, tid);
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
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[mi][nt][0] = o[mi][nt][1] = o[mi][nt][2] = o[mi][nt][3] = 0.f;
  }
  float m_r[MW][2], l_r[MW][2];
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
    m_r[mi][0] = m_r[mi][1] = -INFINITY;
    l_r[mi][0] = l_r[mi][1] = 0.f;
  }
  const float sl2 = p.scale_log2;

  for (int nb = n_lo; nb < n_hi; ++nb) {
    const int buf = (nb - n_lo) & 1;
    kv_tile_step<BC, D, NT>(sK, sV, kg, vg, nb, n_hi, buf, rs, s, tid);
    const T* sKb = sK + buf * BC * SD;
    const T* sVb = sV + buf * BC * SD;

    // S = Q K^T: this warp's 16·MW rows x BC keys.
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

    // Mask: causal (tiles that reach past this warp's first row) and the document start.
    const int64_t col0 = static_cast<int64_t>(nb) * BC;
    if (doc || col0 + BC - 1 > wrow) {
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int64_t j = col0 + nt * 8 + 2 * t4 + (e & 1), i = wrow + mi * 16 + g + 8 * (e >> 1);
            if (j > i || j < ds_r[mi][e >> 1]) sc[mi][nt][e] = -INFINITY;
          }
        }
      }
    }

    // Online softmax (rows g and g + 8 of each row group; a row is spread over a quad's 4 lanes).
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

    // Dropout on the probabilities that multiply V (the normaliser l keeps the undropped ones).
    if (p.drop.enabled) {
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
        const uint64_t keep = keep_bits_rows<BC>(p.drop, bh, wrow + mi * 16 + g, col0, t4);
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (!keep_bit(keep, nt, e, BC / 8)) sc[mi][nt][e] = 0.f;
        }
      }
    }

    // O += P V (P from the S accumulators, converted to A fragments).
    mma_pb_tile<T, D, BC, MW>(o, sc, sVb, lane);
  }

  // Epilogue: normalise, write the LSE, stage O in this warp's rows of sQ (read by no other warp),
  // 16-byte stores.
  T* sO = sQ + warp * WR * SD;
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_r[mi][r];
      l += __shfl_xor_sync(kFull, l, 1);
      l += __shfl_xor_sync(kFull, l, 2);
      const float inv = l > 0.f ? p.drop.inv_keep / l : 0.f;
      const int64_t i = wrow + mi * 16 + g + 8 * r;
      if (t4 == 0 && i < s) p.lse[bh * s + i] = m_r[mi][r] * p.scale + logf(l);
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt)
        *reinterpret_cast<uint32_t*>(sO + (mi * 16 + g + 8 * r) * SD + nt * 8 + 2 * t4) =
            pack2<T>(o[mi][nt][2 * r] * inv, o[mi][nt][2 * r + 1] * inv);
    }
  }
  __syncwarp();
  T* out = static_cast<T*>(p.out);
  const int64_t ors = p.out_row_stride();
#pragma unroll
  for (int k = 0; k < WR * (D / 8) / 32; ++k) {
    const int c = lane + 32 * k, r = c / (D / 8), col = (c % (D / 8)) * 8;
    const int64_t i = wrow + r;
    if (i < s)
      *reinterpret_cast<uint4*>(out + i * ors + (b * p.n + h) * D + col) =
          *reinterpret_cast<const uint4*>(sO + r * SD + col);
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core backward.
// ---------------------------------------------------------------------------------------------

template <int D, int W, int BR, bool kDq>
constexpr int bwd_smem_bytes() {
  constexpr int BC = 16 * W;
  return (2 * BC * (D + 8) + 4 * BR * (D + 8) + (kDq ? BC * (BR + 8) : 0)) * 2 + 2 * BR * 3 * 4;
}

/// dK, dV of the block's 16·W keys and, with kDq, their dQ contributions (fp32 atomics into
/// dq_accum); without kDq (--deterministic-mode) dQ is left to fa_bwd_dq_mma.
template <typename T, int D, int W, int BR, bool kDq>
__global__ void __launch_bounds__(W * 32) fa_bwd_mma(const FaParams p) {
  constexpr int BC = 16 * W, SD = D + 8, SR = BR + 8, NT = 32 * W;
  constexpr int R = BR / 16, DC = D * R / W;  // dQ: warp -> 16 query rows x DC dims
  static_assert(W % R == 0 && DC % 16 == 0, "dQ warp partition");
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);  // [BC][SD]
  T* sV = sK + BC * SD;                // [BC][SD]
  T* sQ = sV + BC * SD;                // [2][BR][SD]
  T* sdO = sQ + 2 * BR * SD;           // [2][BR][SD]
  [[maybe_unused]] T* sdS = sdO + 2 * BR * SD;  // [BC][SR]: dS^T (keys x queries); kDq only
  float* sL = reinterpret_cast<float*>(sdS + (kDq ? BC * SR : 0));  // [2][BR] lse · log2(e) (+inf past s)
  float* sDl = sL + 2 * BR;                             // [2][BR] D_i
  int* sDs = reinterpret_cast<int*>(sDl + 2 * BR);      // [2][BR] doc_start
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t s = p.s, n = p.n, qpg = p.qpg;
  const int64_t bg = blockIdx.x, b = bg / p.G, grp = bg % p.G;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * BC;
  const int64_t rs = p.qkv_row_stride(), ors = p.out_row_stride();
  const T* qkv = static_cast<const T*>(p.qkv);
  const T* dout = static_cast<const T*>(p.dout);
  const T* kg = qkv + p.qkv_base(b, grp, qpg);
  const T* vg = kg + D;
  const int32_t* doc = p.doc ? p.doc + b * s : nullptr;
  const float sl2 = p.scale_log2;

  load_tile<BC, D, NT>(sK, kg, col0, rs, s, tid);
  load_tile<BC, D, NT>(sV, vg, col0, rs, s, tid);
  cp_async_commit();

  // Query tiles m_lo .. m_hi - 1 of each of the qpg heads, flattened: it -> (qi, m).
  const int m_lo = static_cast<int>(col0 / BR), m_hi = static_cast<int>((s + BR - 1) / BR);
  const int per_head = m_hi - m_lo, total = static_cast<int>(qpg) * per_head;
  const int64_t last_key = min64(col0 + BC, s) - 1;
  auto skip = [&](int it) {  // no query row of the tile sees a key of this tile (documents)
    return doc && doc_min(doc, static_cast<int64_t>(m_lo + it % per_head) * BR, BR, s, lane) > last_key;
  };
  auto next = [&](int it) {
    while (it < total && skip(it)) ++it;
    return it;
  };
  auto load_q = [&](int it, int buf) {
    const int64_t qh = it / per_head, row0 = static_cast<int64_t>(m_lo + it % per_head) * BR;
    const int64_t bh = b * n + grp * qpg + qh;
    load_tile<BR, D, NT>(sQ + buf * BR * SD, qkv + p.qkv_base(b, grp, qh), row0, rs, s, tid);
    load_tile<BR, D, NT>(sdO + buf * BR * SD, dout + bh * D, row0, ors, s, tid);
    for (int r = tid; r < BR; r += NT) {
      const int64_t i = row0 + r;
      const bool ok = i < s;
      sL[buf * BR + r] = ok ? p.lse[bh * s + i] * kLog2e : INFINITY;
      sDl[buf * BR + r] = ok ? p.delta[bh * s + i] : 0.f;
      sDs[buf * BR + r] = ok && doc ? doc[i] : 0;
    }
  };

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[nt][e] = dv[nt][e] = 0.f;
  }
  const int64_t wkey = col0 + warp * 16;  // this warp's first key
  int it = next(0), buf = 0;
  if (it < total) load_q(it, 0);
  cp_async_commit();
  while (it < total) {
    // Two barriers per tile with kDq, else one: this one (tile `it` has landed; every warp is done
    // with the previous tile, including its dQ reads of sdS, so the prefetch may overwrite the
    // other buffer) and the one between writing dS and computing dQ.
    cp_async_wait<0>();
    __syncthreads();
    const int nit = next(it + 1);
    if (nit < total) load_q(nit, buf ^ 1);
    cp_async_commit();
    const int64_t qh = it / per_head, row0 = static_cast<int64_t>(m_lo + it % per_head) * BR;
    const int64_t h = grp * qpg + qh, bh = b * n + h;
    const T* sQb = sQ + buf * BR * SD;
    const T* sdOb = sdO + buf * BR * SD;
    const float* sLb = sL + buf * BR;
    const float* sDlb = sDl + buf * BR;
    const int* sDsb = sDs + buf * BR;

    // S^T = K Q^T and dP^T = V dO^T: this warp's 16 keys x BR queries.
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

    // P^T = exp(S^T · scale − lse) (masked: 0), dropout, dS^T = P^T ∘ (dP^T − D). Element e of
    // fragment nt: key wkey + g + 8·(e >> 1), query row0 + nt·8 + 2·t4 + (e & 1).
    const bool need_mask = doc || row0 < wkey + 15;
    uint32_t keep = ~0u;  // bit nt·4 + e: dropout keep decision of element (nt, e)
    if (p.drop.enabled) {
      keep = 0;
#pragma unroll 1
      for (int k = 0; k < BR / 2; ++k) {
        const int64_t i = row0 + (k >> 2) * 8 + 2 * t4 + (k & 1), j = wkey + g + 8 * ((k >> 1) & 1);
        keep |= static_cast<uint32_t>(p.drop.keep(p.drop.row_start(bh, i) + static_cast<uint64_t>(j))) << k;
      }
    }
    const float mk = p.drop.inv_keep;
#pragma unroll
    for (int nt = 0; nt < BR / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ql = nt * 8 + 2 * t4 + (e & 1);
        const int64_t i = row0 + ql, j = wkey + g + 8 * (e >> 1);
        const bool kept = (keep >> (nt * 4 + e)) & 1u;
        float pd;  // mk = 1 without dropout
        dpt[nt][e] = bwd_ds_element(st[nt][e], sl2, sLb[ql], !(need_mask && (j > i || j < sDsb[ql])), kept, mk,
                                    dpt[nt][e], sDlb[ql], pd);
        st[nt][e] = pd;
      }
    }

    // dV += P_drop^T dO, dK += dS^T Q; with kDq dS^T -> shared memory, then dQ = dS K over all BC
    // keys, added to dq_accum.
    bwd_dkdv_tile<T, D, BR>(dv, dk, st, dpt, sdOb, sQb, lane);
    if constexpr (kDq) {
      bwd_store_ds<T, BR>(sdS, dpt, warp, lane);
      __syncthreads();
      const int rg = warp % R, cg = warp / R;
      float dq[DC / 8][4];
      bwd_dq_tile<T, D, BR, BC, DC>(dq, sdS, sK, rg, cg, lane);
      float* dqa = p.dq_accum + bh * s * D;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t i = row0 + rg * 16 + g + 8 * r;
        if (i < s) {
#pragma unroll
          for (int nt = 0; nt < DC / 8; ++nt) {
            float* dst = dqa + i * D + cg * DC + nt * 8 + 2 * t4;
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
    buf ^= 1;
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue: dK · scale and dV into this warp's rows of sK / sV, then 16-byte stores into dqkv.
  T* sdk = sK + warp * 16 * SD;
  T* sdv = sV + warp * 16 * SD;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int off = (g + 8 * r) * SD + nt * 8 + 2 * t4;
      *reinterpret_cast<uint32_t*>(sdk + off) = pack2<T>(dk[nt][2 * r] * p.scale, dk[nt][2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(sdv + off) = pack2<T>(dv[nt][2 * r], dv[nt][2 * r + 1]);
    }
  }
  __syncwarp();
  T* dkg = static_cast<T*>(p.dqkv) + p.qkv_base(b, grp, qpg);
#pragma unroll
  for (int k = 0; k < 16 * (D / 8) / 32; ++k) {
    const int c = lane + 32 * k, r = c / (D / 8), col = (c % (D / 8)) * 8;
    const int64_t j = wkey + r;
    if (j < s) {
      *reinterpret_cast<uint4*>(dkg + j * rs + col) = *reinterpret_cast<const uint4*>(sdk + r * SD + col);
      *reinterpret_cast<uint4*>(dkg + j * rs + D + col) = *reinterpret_cast<const uint4*>(sdv + r * SD + col);
    }
  }
}

template <int D, int W, int BC>
constexpr int dq_smem_bytes() {
  return (2 * 16 * W + 4 * BC) * (D + 8) * 2;
}

/// Deterministic dQ (--deterministic-mode; Dao 2023, Algorithm 2 with the loops exchanged for dQ):
/// one block per (query tile of 16·W rows, b·n); each warp owns 16 query rows and walks the key
/// tiles in order — the tiles the forward visits (causal, document starts), double-buffered K/V,
/// one barrier per tile — recomputing S = Q K^T, P, dP = dO V^T and dS with the dK/dV kernel's
/// element formula (bwd_ds_element) and the same masks and dropout bits, and accumulates dQ = dS K
/// in registers. Writes scale · dQ into the query slots of dqkv: no atomics, no dq_accum, so dQ is
/// the same bits on every run.
template <typename T, int D, int W, int BC>
__global__ void __launch_bounds__(W * 32) fa_bwd_dq_mma(const FaParams p) {
  constexpr int BR = 16 * W, SD = D + 8, NT = 32 * W;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);  // [BR][SD]; a warp reads only its 16 rows; later the dQ staging
  T* sdO = sQ + BR * SD;               // [BR][SD]
  T* sK = sdO + BR * SD;               // [2][BC][SD]
  T* sV = sK + 2 * BC * SD;            // [2][BC][SD]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t s = p.s;
  const int64_t bh = blockIdx.x, b = bh / p.n, h = bh % p.n, grp = h / p.qpg, qi = h % p.qpg;
  const int64_t row0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * BR;  // heavy tiles first
  const int64_t rs = p.qkv_row_stride(), ors = p.out_row_stride();
  const T* qkv = static_cast<const T*>(p.qkv);
  const T* kg = qkv + p.qkv_base(b, grp, p.qpg);
  const T* vg = kg + D;
  const int64_t last_row = min64(row0 + BR, s) - 1;
  const int n_hi = static_cast<int>(last_row / BC) + 1;
  const int32_t* doc = p.doc ? p.doc + b * s : nullptr;
  const int n_lo = doc ? doc_min(doc, row0, BR, s, lane) / BC : 0;
  const int64_t wrow = row0 + warp * 16;  // this warp's first query row; element rows wrow + g + 8·r
  float lse2[2], dl[2];
  int dsr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = wrow + g + 8 * r;
    const bool ok = i < s;
    lse2[r] = ok ? p.lse[bh * s + i] * kLog2e : INFINITY;  // as the dK/dV kernel's sL
    dl[r] = ok ? p.delta[bh * s + i] : 0.f;
    dsr[r] = ok && doc ? doc[i] : 0;
  }

  load_tile<BR, D, NT>(sQ, qkv + p.qkv_base(b, grp, qi), row0, rs, s, tid);
  load_tile<BR, D, NT>(sdO, static_cast<const T*>(p.dout) + bh * D, row0, ors, s, tid);
  load_tile<BC, D, NT>(sK, kg, static_cast<int64_t>(n_lo) * BC, rs, s, tid);
  load_tile<BC, D, NT>(sV, vg, static_cast<int64_t>(n_lo) * BC, rs, s, tid);
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

  for (int nb = n_lo; nb < n_hi; ++nb) {
    const int buf = (nb - n_lo) & 1;
    kv_tile_step<BC, D, NT>(sK, sV, kg, vg, nb, n_hi, buf, rs, s, tid);
    const T* sKb = sK + buf * BC * SD;
    const T* sVb = sV + buf * BC * SD;

    // S = Q K^T and dP = dO V^T: this warp's 16 rows x BC keys.
    float sc[1][BC / 8][4], dp[1][BC / 8][4];
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[0][nt][e] = dp[0][nt][e] = 0.f;
    }
    mma_abt_tile<T, D, BC, 1>(sc, q_frag, sKb, lane);
    mma_abt_tile<T, D, BC, 1>(dp, do_frag, sVb, lane);

    // dS (into sc): element e of fragment nt is (row wrow + g + 8·(e >> 1), key col0 + nt·8 + 2·t4 + (e & 1)).
    const int64_t col0 = static_cast<int64_t>(nb) * BC;
    const bool need_mask = doc || col0 + BC - 1 > wrow;
    const uint64_t keep = p.drop.enabled ? keep_bits_rows<BC>(p.drop, bh, wrow + g, col0, t4) : ~uint64_t{0};
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int64_t i = wrow + g + 8 * r, j = col0 + nt * 8 + 2 * t4 + (e & 1);
        float pd;
        sc[0][nt][e] = bwd_ds_element(sc[0][nt][e], sl2, lse2[r], !(need_mask && (j > i || j < dsr[r])),
                                      keep_bit(keep, nt, e, BC / 8), mk, dp[0][nt][e], dl[r], pd);
      }
    }

    // dQ += dS K (dS rounded to T, as the dK/dV kernel's dS tile).
    mma_pb_tile<T, D, BC, 1>(dq, sc, sKb, lane);
  }
  cp_async_wait<0>();

  // Epilogue: scale · dQ staged in this warp's rows of sQ (read by no other warp), 16-byte stores
  // into the query slots of dqkv.
  T* sO = sQ + warp * 16 * SD;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
      *reinterpret_cast<uint32_t*>(sO + (g + 8 * r) * SD + nt * 8 + 2 * t4) =
          pack2<T>(p.scale * dq[0][nt][2 * r], p.scale * dq[0][nt][2 * r + 1]);
  }
  __syncwarp();
  T* dqg = static_cast<T*>(p.dqkv) + p.qkv_base(b, grp, qi);
#pragma unroll
  for (int k = 0; k < 16 * (D / 8) / 32; ++k) {
    const int c = lane + 32 * k, r = c / (D / 8), col = (c % (D / 8)) * 8;
    const int64_t i = wrow + r;
    if (i < s) *reinterpret_cast<uint4*>(dqg + i * rs + col) = *reinterpret_cast<const uint4*>(sO + r * SD + col);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward pre/post-processing (every path).
// ---------------------------------------------------------------------------------------------

constexpr int kRowWarps = 8;  // warps per block of the one-warp-per-row kernels

/// delta[bh, i] = Σ_e dout ∘ out (row (b, h, i)); the simple path's pre-processing.
template <typename T>
__global__ void fa_bwd_pre(const FaParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= p.B * p.n * p.s) return;
  const int64_t bh = row / p.s, i = row % p.s, b = bh / p.n, h = bh % p.n;
  const int64_t off = i * p.out_row_stride() + (b * p.n + h) * p.d;
  const T* go = static_cast<const T*>(p.dout) + off;
  const T* o = static_cast<const T*>(p.out) + off;
  float acc = 0.f;
  for (int64_t e = lane; e < p.d; e += 32) acc += to_f(go[e]) * to_f(o[e]);
  acc = warp_sum(acc);
  if (lane == 0) p.delta[row] = acc;
}

// Tensor-core path (16-bit T, d = D in {64, 128}, 16-byte aligned tensors): kLanes = D / 8
// threads per row, each with 8 consecutive elements in 16-byte accesses.

/// delta of row (b, h, i) as fa_bwd_pre, and (kZeroDq) the row of dq_accum zeroed for fa_bwd_mma's
/// atomics.
template <typename T, int D, bool kZeroDq>
__global__ void __launch_bounds__(256) fa_bwd_pre_vec(const FaParams p) {
  constexpr int kLanes = D / 8;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
  const int sub = static_cast<int>(threadIdx.x % kLanes);
  const bool ok = row < p.B * p.n * p.s;
  float acc = 0.f;
  if (ok) {
    const int64_t bh = row / p.s, i = row % p.s;
    const int64_t off = i * p.out_row_stride() + bh * D + sub * 8;
    const uint4 go = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + off);
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.out) + off);
    const T* a = reinterpret_cast<const T*>(&go);
    const T* c = reinterpret_cast<const T*>(&o);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += to_f(a[e]) * to_f(c[e]);
    if constexpr (kZeroDq) {
      float4* dq = reinterpret_cast<float4*>(p.dq_accum + row * D + sub * 8);
      dq[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      dq[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(kFull, acc, o);
  if (ok && sub == 0) p.delta[row] = acc;
}

/// dqkv query slots = scale · dq_accum; threads walk the rows of dqkv ([s, b, n] order).
template <typename T, int D>
__global__ void __launch_bounds__(256) fa_bwd_dq_convert_vec(const FaParams p) {
  constexpr int kLanes = D / 8;
  const int64_t rows = p.s * p.B * p.n;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = t / kLanes;
  if (r >= rows) return;
  const int sub = static_cast<int>(t % kLanes);
  const int64_t h = r % p.n, b = (r / p.n) % p.B, i = r / (p.n * p.B);
  const float4* src = reinterpret_cast<const float4*>(p.dq_accum + ((b * p.n + h) * p.s + i) * D + sub * 8);
  const float4 x = src[0], y = src[1];
  uint4 packed;
  packed.x = pack2<T>(p.scale * x.x, p.scale * x.y);
  packed.y = pack2<T>(p.scale * x.z, p.scale * x.w);
  packed.z = pack2<T>(p.scale * y.x, p.scale * y.y);
  packed.w = pack2<T>(p.scale * y.z, p.scale * y.w);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.dqkv) + i * p.qkv_row_stride() + p.qkv_base(b, h / p.qpg, h % p.qpg) +
                            sub * 8) = packed;
}

// ---------------------------------------------------------------------------------------------
// Simple path: one warp per row, fp32 math, per-warp rows of shared memory (dynamic, 4 · d floats).
// ---------------------------------------------------------------------------------------------

constexpr int kSimpleWarps = 4;

template <typename T>
__device__ __forceinline__ float dot_sf(const float* a, const T* b, int64_t d) {
  float acc = 0.f;
  for (int64_t e = 0; e < d; ++e) acc += a[e] * to_f(b[e]);
  return acc;
}

template <typename T>
__global__ void fa_fwd_simple(const FaParams p) {
  extern __shared__ float sm_simple[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSimpleWarps + warp;
  if (row >= p.B * p.n * p.s) return;
  const int64_t s = p.s, d = p.d, bh = row / s, i = row % s, b = bh / p.n, h = bh % p.n;
  const int64_t grp = h / p.qpg, rs = p.qkv_row_stride();
  const T* qkv = static_cast<const T*>(p.qkv);
  const T* q = qkv + i * rs + p.qkv_base(b, grp, h % p.qpg);
  const T* kb = qkv + p.qkv_base(b, grp, p.qpg);
  const T* vb = kb + d;
  float* sq = sm_simple + warp * 4 * d;
  float* so = sq + d;
  for (int64_t e = lane; e < d; e += 32) {
    sq[e] = to_f(q[e]);
    so[e] = 0.f;
  }
  __syncwarp();
  const int64_t j0 = p.doc ? p.doc[b * s + i] : 0;
  const uint64_t row_g = p.drop.enabled ? p.drop.row_start(bh, i) : 0;
  float m = -INFINITY, l = 0.f;
  for (int64_t jb = j0; jb <= i; jb += 32) {
    const int64_t j = jb + lane;
    const bool valid = j <= i;
    const float sc = valid ? p.scale * dot_sf(sq, kb + j * rs, d) : -INFINITY;
    const float m_new = fmaxf(m, warp_max(sc));  // finite: lane 0 is valid
    const float alpha = expf(m - m_new);
    float pv = valid ? expf(sc - m_new) : 0.f;
    l = l * alpha + warp_sum(pv);
    if (p.drop.enabled && valid && !p.drop.keep(row_g + static_cast<uint64_t>(j))) pv = 0.f;
    const int nj = static_cast<int>(min64(32, i - jb + 1));
    for (int64_t e = lane; e < d; e += 32) so[e] *= alpha;
    for (int jj = 0; jj < nj; ++jj) {
      const float pj = __shfl_sync(kFull, pv, jj);
      const T* v = vb + (jb + jj) * rs;
      for (int64_t e = lane; e < d; e += 32) so[e] += pj * to_f(v[e]);
    }
    m = m_new;
  }
  const float inv = p.drop.inv_keep / l;
  T* out = static_cast<T*>(p.out) + i * p.out_row_stride() + (b * p.n + h) * d;
  for (int64_t e = lane; e < d; e += 32) out[e] = from_f<T>(so[e] * inv);
  if (lane == 0) p.lse[row] = m + logf(l);
}

/// dQ of query row (b, h, i): Σ_j dS_ij k_j · scale, straight into dqkv.
template <typename T>
__global__ void fa_bwd_dq_simple(const FaParams p) {
  extern __shared__ float sm_simple[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSimpleWarps + warp;
  if (row >= p.B * p.n * p.s) return;
  const int64_t s = p.s, d = p.d, bh = row / s, i = row % s, b = bh / p.n, h = bh % p.n;
  const int64_t grp = h / p.qpg, rs = p.qkv_row_stride();
  const T* qkv = static_cast<const T*>(p.qkv);
  const int64_t qoff = i * rs + p.qkv_base(b, grp, h % p.qpg);
  const T* kb = qkv + p.qkv_base(b, grp, p.qpg);
  const T* vb = kb + d;
  const T* go = static_cast<const T*>(p.dout) + i * p.out_row_stride() + (b * p.n + h) * d;
  float* sq = sm_simple + warp * 4 * d;
  float* sg = sq + d;
  float* sdq = sg + d;
  for (int64_t e = lane; e < d; e += 32) {
    sq[e] = to_f(qkv[qoff + e]);
    sg[e] = to_f(go[e]);
    sdq[e] = 0.f;
  }
  __syncwarp();
  const int64_t j0 = p.doc ? p.doc[b * s + i] : 0;
  const uint64_t row_g = p.drop.enabled ? p.drop.row_start(bh, i) : 0;
  const float li = p.lse[row], delta = p.delta[row];
  for (int64_t jb = j0; jb <= i; jb += 32) {
    const int64_t j = jb + lane;
    float ds = 0.f;
    if (j <= i) {
      const float pv = expf(p.scale * dot_sf(sq, kb + j * rs, d) - li);
      float dp = dot_sf(sg, vb + j * rs, d);
      if (p.drop.enabled) dp = p.drop.keep(row_g + static_cast<uint64_t>(j)) ? dp * p.drop.inv_keep : 0.f;
      ds = pv * (dp - delta);
    }
    const int nj = static_cast<int>(min64(32, i - jb + 1));
    for (int jj = 0; jj < nj; ++jj) {
      const float dsj = __shfl_sync(kFull, ds, jj);
      const T* k = kb + (jb + jj) * rs;
      for (int64_t e = lane; e < d; e += 32) sdq[e] += dsj * to_f(k[e]);
    }
  }
  T* dq = static_cast<T*>(p.dqkv) + qoff;
  for (int64_t e = lane; e < d; e += 32) dq[e] = from_f<T>(p.scale * sdq[e]);
}

/// dK and dV of key row (b, grp, j), summed over the qpg query heads of the group.
template <typename T>
__global__ void fa_bwd_dkdv_simple(const FaParams p) {
  extern __shared__ float sm_simple[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSimpleWarps + warp;
  if (row >= p.B * p.G * p.s) return;
  const int64_t s = p.s, d = p.d, bg = row / s, j = row % s, b = bg / p.G, grp = bg % p.G;
  const int64_t rs = p.qkv_row_stride(), ors = p.out_row_stride();
  const T* qkv = static_cast<const T*>(p.qkv);
  const int64_t koff = j * rs + p.qkv_base(b, grp, p.qpg);
  float* sk = sm_simple + warp * 4 * d;
  float* sv = sk + d;
  float* sdk = sv + d;
  float* sdv = sdk + d;
  for (int64_t e = lane; e < d; e += 32) {
    sk[e] = to_f(qkv[koff + e]);
    sv[e] = to_f(qkv[koff + d + e]);
    sdk[e] = sdv[e] = 0.f;
  }
  __syncwarp();
  for (int64_t qh = 0; qh < p.qpg; ++qh) {
    const int64_t h = grp * p.qpg + qh, bh = b * p.n + h;
    const T* qb = qkv + p.qkv_base(b, grp, qh);
    const T* gb = static_cast<const T*>(p.dout) + bh * d;
    for (int64_t ib = j; ib < s; ib += 32) {
      const int64_t i = ib + lane;
      float pd = 0.f, ds = 0.f;
      if (i < s && (!p.doc || p.doc[b * s + i] <= j)) {
        const float pv = expf(p.scale * dot_sf(sk, qb + i * rs, d) - p.lse[bh * s + i]);
        float dp = dot_sf(sv, gb + i * ors, d), mk = 1.f;
        if (p.drop.enabled) mk = p.drop.keep(p.drop.row_start(bh, i) + static_cast<uint64_t>(j)) ? p.drop.inv_keep : 0.f;
        dp *= mk;
        pd = pv * mk;
        ds = pv * (dp - p.delta[bh * s + i]);
      }
      const int ni = static_cast<int>(min64(32, s - ib));
      for (int ii = 0; ii < ni; ++ii) {
        const float pdi = __shfl_sync(kFull, pd, ii), dsi = __shfl_sync(kFull, ds, ii);
        if (pdi == 0.f && dsi == 0.f) continue;  // warp-uniform (shuffled values)
        const T* q = qb + (ib + ii) * rs;
        const T* go = gb + (ib + ii) * ors;
        for (int64_t e = lane; e < d; e += 32) {
          sdv[e] += pdi * to_f(go[e]);
          sdk[e] += dsi * to_f(q[e]);
        }
      }
    }
  }
  T* dk = static_cast<T*>(p.dqkv) + koff;
  for (int64_t e = lane; e < d; e += 32) {
    dk[e] = from_f<T>(p.scale * sdk[e]);
    dk[d + e] = from_f<T>(sdv[e]);
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers.
// ---------------------------------------------------------------------------------------------

FaParams make_params(const FlashAttentionConfig& cfg) {
  FaParams p;
  p.s = cfg.seq;
  p.B = cfg.batch;
  p.G = cfg.groups;
  p.qpg = cfg.queries_per_group;
  p.n = cfg.heads();
  p.d = cfg.head_dim;
  p.scale = cfg.softmax_scale;
  p.scale_log2 = cfg.softmax_scale * kLog2e;
  p.drop = flash_attention_dropout(cfg);
  p.doc = cfg.doc_start.empty() ? nullptr : cfg.doc_start.data_as<int32_t>();
  return p;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

int env_variant(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : 0;
}

template <typename K>
void set_smem(K kernel, int bytes) {
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

unsigned simple_blocks(int64_t rows) { return static_cast<unsigned>((rows + kSimpleWarps - 1) / kSimpleWarps); }
int simple_smem(int64_t d) { return static_cast<int>(kSimpleWarps * 4 * d * sizeof(float)); }

template <typename T, int D, int W, int BC, int MW = 1, bool QR = true>
void fwd_mma(const FaParams& p, cudaStream_t st) {
  constexpr int kBytes = fwd_smem_bytes<D, W, BC, MW>(), kRows = 16 * MW * W;
  const auto kernel = fa_fwd_mma<T, D, W, BC, MW, QR>;
  set_smem(kernel, kBytes);
  const dim3 grid(static_cast<unsigned>(p.B * p.n), static_cast<unsigned>((p.s + kRows - 1) / kRows));
  kernel<<<grid, W * 32, kBytes, st>>>(p);
  MT_CUDA_CHECK_LAUNCH();
}

template <typename T, int D, int W, int BR, bool kDq>
void bwd_mma(const FaParams& p, cudaStream_t st) {
  constexpr int kBytes = bwd_smem_bytes<D, W, BR, kDq>();
  const auto kernel = fa_bwd_mma<T, D, W, BR, kDq>;
  set_smem(kernel, kBytes);
  const dim3 grid(static_cast<unsigned>(p.B * p.G), static_cast<unsigned>((p.s + 16 * W - 1) / (16 * W)));
  kernel<<<grid, W * 32, kBytes, st>>>(p);
  MT_CUDA_CHECK_LAUNCH();
}

template <typename T, int D, int W, int BC>
void dq_mma(const FaParams& p, cudaStream_t st) {
  constexpr int kBytes = dq_smem_bytes<D, W, BC>();
  const auto kernel = fa_bwd_dq_mma<T, D, W, BC>;
  set_smem(kernel, kBytes);
  const dim3 grid(static_cast<unsigned>(p.B * p.n), static_cast<unsigned>((p.s + 16 * W - 1) / (16 * W)));
  kernel<<<grid, W * 32, kBytes, st>>>(p);
  MT_CUDA_CHECK_LAUNCH();
}

/// Tile shapes, measured on an H100 with bench/flash_attention_bench.cpp (causal bf16, s = 1024 ..
/// 8192). Forward fwd_mma<T, d, W warps, BC keys per tile, MW row groups of 16 per warp, Q in
/// registers>; backward bwd_mma<T, d, W warps (16·W keys per block), BR queries per tile, dQ by
/// atomics>; the deterministic dQ kernel dq_mma<T, d, W warps (16·W queries per block), BC keys per
/// tile> (not tuned: the forward's key tiles).
/// Variant 1 (MT_FLASH_ATTN_*_VARIANT=1) keeps the runner-up for comparison: forward with 16 rows
/// per warp (d = 64: -14..-26%, d = 128: -9..-29%); backward d = 64 with 8 warps (-1..-23%),
/// d = 128 with 4 warps (-20..+5%).
template <typename T>
void launch_fwd_mma(const FaParams& p, cudaStream_t st) {
  static const int variant = env_variant("MT_FLASH_ATTN_FWD_VARIANT");
  if (p.d == 64) {
    if (variant == 1) fwd_mma<T, 64, 4, 64>(p, st);
    else fwd_mma<T, 64, 4, 64, 2>(p, st);
  } else {
    if (variant == 1) fwd_mma<T, 128, 4, 64>(p, st);
    else fwd_mma<T, 128, 4, 32, 2, false>(p, st);
  }
}

template <typename T, bool kDq>
void launch_bwd_mma(const FaParams& p, cudaStream_t st) {
  static const int variant = env_variant("MT_FLASH_ATTN_BWD_VARIANT");
  if (p.d == 64) {
    if (variant == 1) bwd_mma<T, 64, 8, 32, kDq>(p, st);
    else bwd_mma<T, 64, 4, 32, kDq>(p, st);
  } else {
    if (variant == 1) bwd_mma<T, 128, 4, 32, kDq>(p, st);
    else bwd_mma<T, 128, 8, 32, kDq>(p, st);
  }
}

template <typename T>
void launch_dq_mma(const FaParams& p, cudaStream_t st) {
  if (p.d == 64) dq_mma<T, 64, 4, 64>(p, st);
  else dq_mma<T, 128, 4, 32>(p, st);
}

/// The tensor-core path applies: bf16/fp16, d in {64, 128}, 16-byte aligned tensors.
template <typename T>
bool use_mma(const FaParams& p, std::initializer_list<const void*> ptrs) {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    if (p.d != 64 && p.d != 128) return false;
    for (const void* q : ptrs)
      if (!aligned16(q)) return false;
    return true;
  }
}

}  // namespace

void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const FlashAttentionConfig& cfg,
                             const Stream& stream) {
  if (cfg.cudnn && cudnn_attention_applies(cfg, qkv.dtype(), {qkv.data(), out.data()})) {
    cudnn_attention_forward(out, lse, qkv, cfg, stream);
    return;
  }
  FaParams p = make_params(cfg);
  p.qkv = qkv.data();
  p.out = out.data();
  p.lse = lse.data_as<float>();
  const cudaStream_t st = cu(stream);
  MT_CHECK((p.s + 15) / 16 < 65536, "flash_attention_forward: seq={} too long for the grid", p.s);
  dispatch_float(qkv.dtype(), "flash_attention_forward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (!std::is_same_v<T, float>) {
      if (use_mma<T>(p, {p.qkv, p.out})) {
        launch_fwd_mma<T>(p, st);
        return;
      }
    }
    const int bytes = simple_smem(p.d);
    set_smem(fa_fwd_simple<T>, bytes);
    fa_fwd_simple<T><<<simple_blocks(p.B * p.n * p.s), kSimpleWarps * 32, bytes, st>>>(p);
    MT_CUDA_CHECK_LAUNCH();
  });
}

void flash_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& qkv, const Tensor& workspace, const FlashAttentionConfig& cfg,
                              const Stream& stream) {
  if (cfg.cudnn && cudnn_attention_applies(cfg, qkv.dtype(), {qkv.data(), out.data(), dout.data(), dqkv.data()})) {
    cudnn_attention_backward(dqkv, dout, out, lse, qkv, workspace, cfg, stream);
    return;
  }
  FaParams p = make_params(cfg);
  p.qkv = qkv.data();
  p.out = out.data();
  p.lse = lse.data_as<float>();
  p.dout = dout.data();
  p.dqkv = dqkv.data();
  const int64_t rows = p.B * p.n * p.s;
  unsigned char* ws = static_cast<unsigned char*>(workspace.data());
  p.delta = reinterpret_cast<float*>(ws);
  p.dq_accum = reinterpret_cast<float*>(ws + flash_attention_dq_accum_offset(cfg));
  const cudaStream_t st = cu(stream);
  MT_CHECK((p.s + 15) / 16 < 65536, "flash_attention_backward: seq={} too long for the grid", p.s);
  dispatch_float(qkv.dtype(), "flash_attention_backward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (!std::is_same_v<T, float>) {
      if (use_mma<T>(p, {p.qkv, p.out, p.dout, p.dqkv})) {
        const unsigned blocks = static_cast<unsigned>((rows * (p.d / 8) + 255) / 256);
        if (cfg.deterministic) {  // dK, dV; then dQ by its own kernel (no atomics, no dq_accum)
          if (p.d == 64) fa_bwd_pre_vec<T, 64, false><<<blocks, 256, 0, st>>>(p);
          else fa_bwd_pre_vec<T, 128, false><<<blocks, 256, 0, st>>>(p);
          MT_CUDA_CHECK_LAUNCH();
          launch_bwd_mma<T, false>(p, st);
          launch_dq_mma<T>(p, st);
          return;
        }
        if (p.d == 64) fa_bwd_pre_vec<T, 64, true><<<blocks, 256, 0, st>>>(p);
        else fa_bwd_pre_vec<T, 128, true><<<blocks, 256, 0, st>>>(p);
        MT_CUDA_CHECK_LAUNCH();
        launch_bwd_mma<T, true>(p, st);
        if (p.d == 64) fa_bwd_dq_convert_vec<T, 64><<<blocks, 256, 0, st>>>(p);
        else fa_bwd_dq_convert_vec<T, 128><<<blocks, 256, 0, st>>>(p);
        MT_CUDA_CHECK_LAUNCH();
        return;
      }
    }
    fa_bwd_pre<T><<<static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps), kRowWarps * 32, 0, st>>>(p);
    MT_CUDA_CHECK_LAUNCH();
    const int bytes = simple_smem(p.d);
    set_smem(fa_bwd_dq_simple<T>, bytes);
    set_smem(fa_bwd_dkdv_simple<T>, bytes);
    fa_bwd_dq_simple<T><<<simple_blocks(rows), kSimpleWarps * 32, bytes, st>>>(p);
    MT_CUDA_CHECK_LAUNCH();
    fa_bwd_dkdv_simple<T><<<simple_blocks(p.B * p.G * p.s), kSimpleWarps * 32, bytes, st>>>(p);
    MT_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mt::cuda
