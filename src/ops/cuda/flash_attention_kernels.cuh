// The FlashAttention-2 kernel family (Dao 2023, arXiv:2307.08691, Algorithms 1 and 2) of the two
// fused attention ops: ops/flash_attention.h (causal self-attention over one sequence) and
// ops/context_attention.h (the queries of a context-parallel shard against one block of keys at
// global positions). Every kernel is a template over a mask policy (flash::CausalMask,
// flash::PositionMask: ops/cuda/flash_attention_masks.cuh), the one thing the ops differ in; the
// document mask and dropout are runtime parts of either policy.
//
// Tensor-core path (16-bit T, head_dim D = 64 or 128, 16-byte aligned tensors): mma.sync.m16n8k16
// with fp32 accumulation, ldmatrix from padded shared memory (row stride D + 8: conflict-free
// ldmatrix) filled by cp.async (ops/cuda/mma_sm80.cuh).
//   fwd_mma       one block per (query tile of 16·MW·W rows, b·n); each warp owns 16·MW query rows
//                 (O accumulator in registers; Q fragments in registers or re-read from shared
//                 memory) and walks the visible key tiles (BC keys, double-buffered K/V, one barrier
//                 per tile) with the online softmax (Algorithm 1).
//   bwd_pre       D_i = rowsum(dO ∘ O) into the workspace, and dq_accum zeroed for the atomics.
//   bwd_mma       one block per (key tile of 16·W keys, b·g): each warp owns 16 keys and sums their
//                 dK and dV in registers over the qpg query heads of the group and the visible query
//                 tiles (Algorithm 2); with kDq, dS goes through shared memory for dQ = dS K, added
//                 to dq_accum with fp32 atomics, then bwd_dq_finish writes scale · dq_accum.
//   bwd_dq_mma    --deterministic-mode: bwd_mma without dQ, then one block per (query tile of 16·W
//                 rows, b·n) walking the key tiles in order, recomputing S, P, dP and dS with the
//                 same element formula, masks and dropout bits, dQ = dS K in registers: no atomics,
//                 the same bits on every run (S and dP recomputed: about 1.4x the FLOPs).
// Simple path (fp32, other head dims, misaligned tensors): one warp per query row (forward, dQ) or
// key row (dK, dV), 32 keys / queries at a time, one per lane, fp32 math with expf; head_dim up to
// 1024 (attention_checks::kMaxFusedHeadDim: 4·d floats of shared memory per warp).
// Entry points: forward<Mask>() and backward<Mask>() (at the end).
//
// Tuning (benchmarks only): MT_FLASH_ATTN_FWD_VARIANT / MT_FLASH_ATTN_BWD_VARIANT (0 default, 1 the
// runner-up tile shapes, see launch_fwd_mma / launch_bwd_mma), read once per process.
//
// Only included by ops/cuda/flash_attention.cu and ops/cuda/context_attention.cu.
#pragma once
#include <cstdlib>
#include <initializer_list>
#include <type_traits>

#include "core/cuda_check.h"
#include "ops/cuda/flash_attention_masks.cuh"

namespace mt::cuda::flash {
namespace {

// ---------------------------------------------------------------------------------------------
// Tensor-core forward.
// ---------------------------------------------------------------------------------------------

template <class Mask, int D, int W, int BC, int MW>
constexpr int fwd_smem_bytes() {
  return (16 * MW * W + 4 * BC) * (D + 8) * 2 + (Mask::kPositions ? 2 * BC * 4 : 0);
}

/// One warp: the ROWS x D tile staged in shared memory (row stride D + 8) into rows row0 .. of dst
/// (row stride rs elements; rows >= lim skipped), 16-byte stores.
template <int D, int ROWS, typename T>
__device__ __forceinline__ void store_staged(T* dst, int64_t rs, const T* staged, int64_t row0, int64_t lim, int lane) {
#pragma unroll
  for (int k = 0; k < ROWS * (D / 8) / 32; ++k) {
    const int c = lane + 32 * k, r = c / (D / 8), col = (c % (D / 8)) * 8;
    if (row0 + r < lim) {
      *reinterpret_cast<uint4*>(dst + (row0 + r) * rs + col) =
          *reinterpret_cast<const uint4*>(staged + r * (D + 8) + col);
    }
  }
}

/// Online-softmax step of one key tile for a warp's 16·MW rows (Algorithm 1): running max m, sum
/// l (of the undropped probabilities) and O rescaled; sc (masked scores, −inf) becomes P.
template <int D, int BC, int MW>
__device__ __forceinline__ void online_softmax(float (&sc)[MW][BC / 8][4], float (&o)[MW][D / 8][4],
                                               float (&m_r)[MW][2], float (&l_r)[MW][2], float sl2) {
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
}

/// Forward epilogue, CausalMask: normalise, write the LSE, stage O in this warp's rows of sQ (read
/// by no other warp), 16-byte stores into out.
template <typename T, int D, int MW>
__device__ __forceinline__ void fwd_store(const Params& p, T* sQ, const float (&o)[MW][D / 8][4],
                                          const float (&m_r)[MW][2], const float (&l_r)[MW][2], int64_t bh,
                                          int64_t wrow, int warp, int lane) {
  constexpr int WR = 16 * MW, SD = D + 8;
  const int g = lane >> 2, t4 = lane & 3;
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
      if (t4 == 0 && i < p.sq) p.lse[p.row(bh, i)] = m_r[mi][r] * p.scale + logf(l);
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt)
        *reinterpret_cast<uint32_t*>(sO + (mi * 16 + g + 8 * r) * SD + nt * 8 + 2 * t4) =
            pack2<T>(o[mi][nt][2 * r] * inv, o[mi][nt][2 * r + 1] * inv);
    }
  }
  __syncwarp();
  store_staged<D, WR>(static_cast<T*>(p.out) + bh * D, p.o_rs(), sO, wrow, p.sq, lane);
}

/// Forward epilogue, PositionMask: each row's (out, lse) of this key block, written (no visible
/// key: out 0, lse −inf) or, with p.merge, merged with the caller's by their LSE.
template <typename T, int D, int MW>
__device__ __forceinline__ void fwd_merge(const Params& p, const float (&o)[MW][D / 8][4], const float (&m_r)[MW][2],
                                          const float (&l_r)[MW][2], int64_t bh, int64_t wrow, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
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
      l_old[mi][r] = p.merge && i < p.sq ? p.lse[p.row(bh, i)] : -INFINITY;
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
      if (i >= p.sq) continue;
      const float l = l_tot[mi][r], old = l_old[mi][r];
      T* orow = out + i * ors + bh * D;
      float* lp = p.lse + p.row(bh, i);
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

/// One step of the double-buffered K/V pipeline of the query-major kernels (fwd_mma, bwd_dq_mma),
/// before the block works on tile t (buffer half buf): one barrier per tile — t has landed for
/// everyone and every warp is done with the previous tile, whose buffer the prefetch of the next
/// visible tile (returned) then overwrites.
template <class KeyTiles>
__device__ __forceinline__ Tile kv_pipeline_step(const KeyTiles& tiles, Tile t, int buf) {
  cp_async_wait<0>();
  __syncthreads();
  const Tile tn = tiles.next(t);
  if (!tiles.done(tn)) tiles.load(tn, buf ^ 1);
  cp_async_commit();
  return tn;
}

/// W warps, each owning MW groups of 16 consecutive query rows (16·MW·W rows per block); BC keys
/// per tile. Every K/V fragment loaded from shared memory feeds MW row groups. QR: the Q fragments
/// stay in registers for the whole loop (else they are re-read from shared memory per key tile,
/// which frees registers for MW = 2 at d = 128, as FlashAttention-2 does).
template <typename T, class Mask, int D, int W, int BC, int MW, bool QR>
__global__ void __launch_bounds__(W * 32) fwd_mma(const Params p) {
  constexpr int WR = 16 * MW, BR = WR * W, SD = D + 8, NT = 32 * W;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);                    // [BR][SD]; CausalMask: later the output staging
  T* sK = sQ + BR * SD;                                  // [2][BC][SD]
  T* sV = sK + 2 * BC * SD;                              // [2][BC][SD]
  int* sKp = reinterpret_cast<int*>(sV + 2 * BC * SD);  // PositionMask: [2][BC] key positions
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t bh = blockIdx.x, b = bh / p.n, h = bh % p.n, grp = h / p.qpg, qi = h % p.qpg;
  const int64_t row0 = Mask::query_tile(blockIdx.y, gridDim.y) * BR;
  const T* qg = static_cast<const T*>(p.q) + p.q_base(b, grp, qi);
  const T* kg = static_cast<const T*>(p.kv) + p.kv_base(b, grp);
  const T* vg = kg + D;
  const int32_t* doc = p.doc ? p.doc + b * p.doc_stride : nullptr;
  const typename Mask::template KeyTiles<T, BR, BC, D, NT> tiles(p, doc, row0, sK, sV, sKp, kg, vg, tid, lane);
  const int64_t wrow = row0 + warp * WR;  // this warp's first query row; row (mi, r): wrow + mi·16 + g + 8r
  int qp_r[MW][2], ds_r[MW][2];
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) Mask::query_row(p, doc, wrow + mi * 16 + g + 8 * r, qp_r[mi][r], ds_r[mi][r]);
  }

  Tile t = tiles.first();
  load_tile<BR, D, NT>(sQ, qg, row0, p.q_rs(), p.sq, tid);
  if (!tiles.done(t)) tiles.load(t, 0);
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
  while (!tiles.done(t)) {
    const Tile tn = kv_pipeline_step(tiles, t, buf);
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

    // Mask: key position <= query position, >= the query's document start.
    if (tiles.masked(t, wrow)) {
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int kp = tiles.key_pos(t, buf, nt * 8 + 2 * t4 + (e & 1)), r = e >> 1;
            if (kp > qp_r[mi][r] || kp < ds_r[mi][r]) sc[mi][nt][e] = -INFINITY;
          }
        }
      }
    }

    // Online softmax (rows g and g + 8 of each row group; a row is spread over a quad's 4 lanes).
    online_softmax<D, BC, MW>(sc, o, m_r, l_r, sl2);

    // Dropout on the probabilities that multiply V (the normaliser l keeps the undropped ones).
    if (p.drop.enabled) {
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
        const uint64_t keep = keep_bits_rows<BC>(p.drop, bh, qp_r[mi][0], qp_r[mi][1], tiles, t, buf, t4);
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
    t = tn;
    buf ^= 1;
  }
  cp_async_wait<0>();
  if constexpr (Mask::kAccumulate) fwd_merge<T, D, MW>(p, o, m_r, l_r, bh, wrow, lane);
  else fwd_store<T, D, MW>(p, sQ, o, m_r, l_r, bh, wrow, warp, lane);
}

// ---------------------------------------------------------------------------------------------
// Tensor-core backward.
// ---------------------------------------------------------------------------------------------

template <class Mask, int D, int W, int BR, bool kDq>
constexpr int bwd_smem_bytes() {
  constexpr int BC = 16 * W;
  return (2 * BC * (D + 8) + 4 * BR * (D + 8) + (kDq ? BC * (BR + 8) : 0)) * 2 +
         2 * BR * (Mask::kPositions ? 4 : 3) * 4;
}

/// dK, dV of the block's 16·W keys and, with kDq, their dQ contributions (fp32 atomics into
/// dq_accum); without kDq (--deterministic-mode) dQ is left to bwd_dq_mma.
template <typename T, class Mask, int D, int W, int BR, bool kDq>
__global__ void __launch_bounds__(W * 32) bwd_mma(const Params p) {
  constexpr int BC = 16 * W, SD = D + 8, SR = BR + 8, NT = 32 * W;
  constexpr int R = BR / 16, DC = D * R / W;  // dQ: warp -> 16 query rows x DC dims
  static_assert(W % R == 0 && DC % 16 == 0, "dQ warp partition");
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);  // [BC][SD]
  T* sV = sK + BC * SD;                // [BC][SD]
  T* sQ = sV + BC * SD;                // [2][BR][SD]
  T* sdO = sQ + 2 * BR * SD;           // [2][BR][SD]
  [[maybe_unused]] T* sdS = sdO + 2 * BR * SD;                       // [BC][SR]: dS^T (keys x queries); kDq only
  float* sL = reinterpret_cast<float*>(sdS + (kDq ? BC * SR : 0));  // [2][BR] lse · log2(e) (lse_log2)
  float* sDl = sL + 2 * BR;                                          // [2][BR] D_i
  int* sDs = reinterpret_cast<int*>(sDl + 2 * BR);                   // [2][BR] document start
  [[maybe_unused]] int* sQp = sDs + 2 * BR;                          // [2][BR] query position; PositionMask
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t sq = p.sq, sk = p.sk, n = p.n, qpg = p.qpg;
  const int64_t bg = blockIdx.x, b = bg / p.G, grp = bg % p.G;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * BC;
  const int64_t qrs = p.q_rs(), krs = p.kv_rs(), ors = p.o_rs();
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);
  const T* kg = static_cast<const T*>(p.kv) + p.kv_base(b, grp);
  const T* vg = kg + D;
  const int32_t* doc = p.doc ? p.doc + b * p.doc_stride : nullptr;
  const float sl2 = p.scale_log2;

  load_tile<BC, D, NT>(sK, kg, col0, krs, sk, tid);
  load_tile<BC, D, NT>(sV, vg, col0, krs, sk, tid);
  cp_async_commit();

  const typename Mask::template QueryTiles<BR, BC> tiles(p, doc, col0, lane);
  const int64_t wkey = col0 + warp * 16;  // this warp's first key
  int kp_r[2];                            // positions of its keys wkey + g + 8·r
#pragma unroll
  for (int r = 0; r < 2; ++r) kp_r[r] = Mask::key_row(p, wkey + g + 8 * r);
  auto load_q = [&](int it, int buf) {
    const int64_t qh = tiles.head(it), row0 = tiles.row0(it), bh = b * n + grp * qpg + qh;
    load_tile<BR, D, NT>(sQ + buf * BR * SD, q + p.q_base(b, grp, qh), row0, qrs, sq, tid);
    load_tile<BR, D, NT>(sdO + buf * BR * SD, dout + bh * D, row0, ors, sq, tid);
    for (int r = tid; r < BR; r += NT) {
      const int64_t i = row0 + r;
      int pos, ds;
      Mask::query_row(p, doc, i, pos, ds);
      sL[buf * BR + r] = lse_log2<Mask>(p, bh, i);
      sDl[buf * BR + r] = i < sq ? p.delta[p.row(bh, i)] : 0.f;
      sDs[buf * BR + r] = ds;
      if constexpr (Mask::kPositions) sQp[buf * BR + r] = pos;
    }
  };

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[nt][e] = dv[nt][e] = 0.f;
  }
  Tile t = tiles.first();
  int buf = 0;
  if (!tiles.done(t)) load_q(t.i, 0);
  cp_async_commit();
  while (!tiles.done(t)) {
    // Two barriers per tile with kDq, else one: this one (tile t has landed; every warp is done
    // with the previous tile, including its dQ reads of sdS, so the prefetch may overwrite the
    // other buffer) and the one between writing dS and computing dQ.
    cp_async_wait<0>();
    __syncthreads();
    const Tile tn = tiles.next(t);
    if (!tiles.done(tn)) load_q(tn.i, buf ^ 1);
    cp_async_commit();
    const int64_t row0 = tiles.row0(t.i), bh = b * n + grp * qpg + tiles.head(t.i);
    const T* sQb = sQ + buf * BR * SD;
    const T* sdOb = sdO + buf * BR * SD;
    const float* sLb = sL + buf * BR;
    const float* sDlb = sDl + buf * BR;
    const int* sDsb = sDs + buf * BR;
    const int* sQpb = sQp + buf * BR;

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
    const bool need_mask = tiles.masked(t, row0, wkey);
    uint32_t keep = ~0u;  // bit nt·4 + e: dropout keep decision of element (nt, e)
    if (p.drop.enabled) {
      keep = 0;
#pragma unroll 1
      for (int k = 0; k < BR / 2; ++k) {
        const int ql = (k >> 2) * 8 + 2 * t4 + (k & 1), kp = Mask::warp_key_pos(kp_r, wkey + g, (k >> 1) & 1);
        keep |= static_cast<uint32_t>(p.drop.keep(p.drop.row_start(bh, tiles.query_pos(sQpb, row0, ql)) +
                                                  static_cast<uint64_t>(kp)))
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
        const bool visible = !(need_mask && (kp > tiles.query_pos(sQpb, row0, ql) || kp < sDsb[ql]));
        float pd;  // mk = 1 without dropout
        dpt[nt][e] = bwd_ds_element(st[nt][e], sl2, sLb[ql], visible, kept, mk, dpt[nt][e], sDlb[ql], pd);
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
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t i = row0 + rg * 16 + g + 8 * r;
        if (i < sq) {
          float* dqa = p.dq_accum + p.row(bh, i) * D;
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
    t = tn;
    buf ^= 1;
  }
  cp_async_wait<0>();

  T* dkg = static_cast<T*>(p.dkv) + p.kv_base(b, grp);
  if constexpr (Mask::kAccumulate) {
    // dkv (+=) dK · scale and dV of this warp's 16 keys, straight from the accumulators.
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
  } else {
    // dK · scale and dV into this warp's rows of sK / sV, then 16-byte stores.
    __syncthreads();
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
    store_staged<D, 16>(dkg, krs, sdk, wkey, sk, lane);
    store_staged<D, 16>(dkg + D, krs, sdv, wkey, sk, lane);
  }
}

template <class Mask, int D, int W, int BC>
constexpr int dq_smem_bytes() {
  return (2 * 16 * W + 4 * BC) * (D + 8) * 2 + (Mask::kPositions ? 2 * BC * 4 : 0);
}

/// Deterministic dQ (--deterministic-mode; Dao 2023, Algorithm 2 with the loops exchanged for dQ):
/// one block per (query tile of 16·W rows, b·n); each warp owns 16 query rows and walks the key
/// tiles in order — the tiles the forward visits, double-buffered K/V, one barrier per tile —
/// recomputing S = Q K^T, P, dP = dO V^T and dS with bwd_mma's element formula (bwd_ds_element) and
/// the same masks and dropout bits, and accumulates dQ = dS K in registers; then scale · dQ into
/// the query slots of dqkv (CausalMask: written, PositionMask: added). No atomics, no dq_accum:
/// the same bits on every run.
template <typename T, class Mask, int D, int W, int BC>
__global__ void __launch_bounds__(W * 32) bwd_dq_mma(const Params p) {
  constexpr int BR = 16 * W, SD = D + 8, NT = 32 * W;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);                    // [BR][SD]; a warp reads only its 16 rows
  T* sdO = sQ + BR * SD;                                 // [BR][SD]
  T* sK = sdO + BR * SD;                                 // [2][BC][SD]
  T* sV = sK + 2 * BC * SD;                              // [2][BC][SD]
  int* sKp = reinterpret_cast<int*>(sV + 2 * BC * SD);  // PositionMask: [2][BC] key positions
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t sq = p.sq;
  const int64_t bh = blockIdx.x, b = bh / p.n, h = bh % p.n, grp = h / p.qpg, qi = h % p.qpg;
  const int64_t row0 = Mask::query_tile(blockIdx.y, gridDim.y) * BR;
  const int64_t qrs = p.q_rs(), ors = p.o_rs();
  const T* q = static_cast<const T*>(p.q);
  const T* kg = static_cast<const T*>(p.kv) + p.kv_base(b, grp);
  const T* vg = kg + D;
  const int32_t* doc = p.doc ? p.doc + b * p.doc_stride : nullptr;
  const typename Mask::template KeyTiles<T, BR, BC, D, NT> tiles(p, doc, row0, sK, sV, sKp, kg, vg, tid, lane);
  const int64_t wrow = row0 + warp * 16;  // this warp's first query row; element rows wrow + g + 8·r
  float lse2[2], dl[2];
  int qp_r[2], ds_r[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // as bwd_mma's sL, sDl, sQp, sDs
    const int64_t i = wrow + g + 8 * r;
    lse2[r] = lse_log2<Mask>(p, bh, i);
    dl[r] = i < sq ? p.delta[p.row(bh, i)] : 0.f;
    Mask::query_row(p, doc, i, qp_r[r], ds_r[r]);
  }

  Tile t = tiles.first();
  load_tile<BR, D, NT>(sQ, q + p.q_base(b, grp, qi), row0, qrs, sq, tid);
  load_tile<BR, D, NT>(sdO, static_cast<const T*>(p.dout) + bh * D, row0, ors, sq, tid);
  if (!tiles.done(t)) tiles.load(t, 0);
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
  while (!tiles.done(t)) {
    const Tile tn = kv_pipeline_step(tiles, t, buf);
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

    // dS (into sc): element e of fragment nt is (row wrow + g + 8·(e >> 1), key nt·8 + 2·t4 + (e & 1)
    // of the tile).
    const bool need_mask = tiles.masked(t, wrow);
    const uint64_t keep =
        p.drop.enabled ? keep_bits_rows<BC>(p.drop, bh, qp_r[0], qp_r[1], tiles, t, buf, t4) : ~uint64_t{0};
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, kp = tiles.key_pos(t, buf, nt * 8 + 2 * t4 + (e & 1));
        float pd;
        sc[0][nt][e] = bwd_ds_element(sc[0][nt][e], sl2, lse2[r], !(need_mask && (kp > qp_r[r] || kp < ds_r[r])),
                                      keep_bit(keep, nt, e, BC / 8), mk, dp[0][nt][e], dl[r], pd);
      }
    }

    // dQ += dS K (dS rounded to T, as bwd_mma's dS tile).
    mma_pb_tile<T, D, BC, 1>(dq, sc, sKb, lane);
    t = tn;
    buf ^= 1;
  }
  cp_async_wait<0>();

  T* dqg = static_cast<T*>(p.dq) + p.q_base(b, grp, qi);
  if constexpr (Mask::kAccumulate) {
    // dqkv query slots (+=) scale · dQ, straight from the accumulators.
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
  } else {
    // scale · dQ staged in this warp's rows of sQ (read by no other warp), 16-byte stores.
    T* sO = sQ + warp * 16 * SD;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt)
        *reinterpret_cast<uint32_t*>(sO + (g + 8 * r) * SD + nt * 8 + 2 * t4) =
            pack2<T>(p.scale * dq[0][nt][2 * r], p.scale * dq[0][nt][2 * r + 1]);
    }
    __syncwarp();
    store_staged<D, 16>(dqg, qrs, sO, wrow, sq, lane);
  }
}

/// delta of out row r ([sq, b, n] order: bh = r mod b·n, i = r div b·n) = Σ_e dout ∘ out, and
/// (kZeroDq) its row of dq_accum zeroed for bwd_mma's atomics; D / 8 threads per row, 16-byte
/// accesses.
template <typename T, int D, bool kZeroDq>
__global__ void __launch_bounds__(256) bwd_pre(const Params p) {
  constexpr int kLanes = D / 8;
  const int64_t bn = p.B * p.n;
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
  const int sub = static_cast<int>(threadIdx.x % kLanes);
  const bool ok = r < p.sq * bn;
  const int64_t row = ok ? p.row(r % bn, r / bn) : 0;
  float acc = 0.f;
  if (ok) {
    const int64_t off = r * D + sub * 8;
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

/// The query slots of dqkv = scale · dq_accum (CausalMask) or += it (PositionMask); threads walk the
/// rows of dqkv ([sq, b, n] order).
template <typename T, class Mask, int D>
__global__ void __launch_bounds__(256) bwd_dq_finish(const Params p) {
  constexpr int kLanes = D / 8;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = t / kLanes;
  if (r >= p.sq * p.B * p.n) return;
  const int sub = static_cast<int>(t % kLanes);
  const int64_t h = r % p.n, b = (r / p.n) % p.B, i = r / (p.n * p.B);
  const float4* src = reinterpret_cast<const float4*>(p.dq_accum + p.row(b * p.n + h, i) * D + sub * 8);
  const float4 x = src[0], y = src[1];
  uint4* dst = reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + i * p.q_rs() + p.q_base(b, h / p.qpg, h % p.qpg) +
                                        sub * 8);
  uint4 v;
  if constexpr (Mask::kAccumulate) {
    v = *dst;
    const float2 a = unpack2<T>(v.x), c = unpack2<T>(v.y), e = unpack2<T>(v.z), f = unpack2<T>(v.w);
    v.x = pack2<T>(fmaf(p.scale, x.x, a.x), fmaf(p.scale, x.y, a.y));
    v.y = pack2<T>(fmaf(p.scale, x.z, c.x), fmaf(p.scale, x.w, c.y));
    v.z = pack2<T>(fmaf(p.scale, y.x, e.x), fmaf(p.scale, y.y, e.y));
    v.w = pack2<T>(fmaf(p.scale, y.z, f.x), fmaf(p.scale, y.w, f.y));
  } else {
    v.x = pack2<T>(p.scale * x.x, p.scale * x.y);
    v.y = pack2<T>(p.scale * x.z, p.scale * x.w);
    v.z = pack2<T>(p.scale * y.x, p.scale * y.y);
    v.w = pack2<T>(p.scale * y.z, p.scale * y.w);
  }
  *dst = v;
}


// ---------------------------------------------------------------------------------------------
// Simple path: one warp per row, fp32 math, per-warp rows of shared memory (dynamic, 4 · d floats).
// Key j is visible to query i iff it lies in the row's range (Mask::key_range / query_range) and
// kpos(j) <= qpos(i), kpos(j) >= doc_start(i) (always true inside a CausalMask range).
// ---------------------------------------------------------------------------------------------

constexpr int kSimpleWarps = 4;
constexpr int kRowWarps = 8;  // warps per block of bwd_pre_simple

template <typename T>
__device__ __forceinline__ float dot_sf(const float* a, const T* b, int64_t d) {
  float acc = 0.f;
  for (int64_t e = 0; e < d; ++e) acc += a[e] * to_f(b[e]);
  return acc;
}

/// Query row (b, h, i) of row index `row` ([b, n, sq] order), or false past the end.
struct SimpleRow {
  int64_t bh, i, b, h, grp;
};
__device__ __forceinline__ bool simple_row(const Params& p, int64_t row, SimpleRow& r) {
  if (row >= p.B * p.n * p.sq) return false;
  r.bh = row / p.sq;
  r.i = row % p.sq;
  r.b = r.bh / p.n;
  r.h = r.bh % p.n;
  r.grp = r.h / p.qpg;
  return true;
}

/// The keys of query row x in the query-major simple kernels: the range [lo, hi]
/// (Mask::key_range), the row's position and document start, its first dropout element.
template <class Mask>
struct SimpleKeys {
  int qpos, ds;
  int64_t lo, hi;
  uint64_t row_g;
  __device__ SimpleKeys(const Params& p, const SimpleRow& x) {
    const int32_t* doc = p.doc ? p.doc + x.b * p.doc_stride : nullptr;
    Mask::query_row(p, doc, x.i, qpos, ds);
    Mask::key_range(p, doc, x.i, lo, hi);
    row_g = p.drop.enabled ? p.drop.row_start(x.bh, qpos) : 0;
  }
  /// Key j (position kp) of the range is visible to the row.
  __device__ bool visible(int64_t j, int kp) const { return j <= hi && kp <= qpos && kp >= ds; }
};

/// Forward of query row (b, h, i): online softmax over its keys, 32 at a time.
template <typename T, class Mask>
__global__ void fwd_simple(const Params p) {
  extern __shared__ float sm_simple[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  SimpleRow x;
  if (!simple_row(p, static_cast<int64_t>(blockIdx.x) * kSimpleWarps + warp, x)) return;
  const int64_t d = p.d, krs = p.kv_rs();
  const T* q = static_cast<const T*>(p.q) + x.i * p.q_rs() + p.q_base(x.b, x.grp, x.h % p.qpg);
  const T* kb = static_cast<const T*>(p.kv) + p.kv_base(x.b, x.grp);
  const T* vb = kb + d;
  float* sq = sm_simple + warp * 4 * d;
  float* so = sq + d;
  for (int64_t e = lane; e < d; e += 32) {
    sq[e] = to_f(q[e]);
    so[e] = 0.f;
  }
  __syncwarp();
  const SimpleKeys<Mask> keys(p, x);
  float m = -INFINITY, l = 0.f;
  for (int64_t jb = keys.lo; jb <= keys.hi; jb += 32) {
    const int64_t j = jb + lane;
    const int kp = j <= keys.hi ? Mask::key_row(p, j) : 0;
    const bool valid = keys.visible(j, kp);
    const float sc = valid ? p.scale * dot_sf(sq, kb + j * krs, d) : -INFINITY;
    const float m_new = fmaxf(m, warp_max(sc));  // CausalMask: finite (lane 0 is valid)
    float alpha;
    if constexpr (Mask::kEmptyRows) alpha = m_new == -INFINITY ? 1.f : expf(m - m_new);
    else alpha = expf(m - m_new);
    float pv = valid ? expf(sc - m_new) : 0.f;
    l = l * alpha + warp_sum(pv);
    if (p.drop.enabled && valid && !p.drop.keep(keys.row_g + static_cast<uint64_t>(kp))) pv = 0.f;
    const int nj = static_cast<int>(min64(32, keys.hi - jb + 1));
    for (int64_t e = lane; e < d; e += 32) so[e] *= alpha;
    for (int jj = 0; jj < nj; ++jj) {
      const float pj = __shfl_sync(kFull, pv, jj);
      const T* v = vb + (jb + jj) * krs;
      for (int64_t e = lane; e < d; e += 32) so[e] += pj * to_f(v[e]);
    }
    m = m_new;
  }
  T* out = static_cast<T*>(p.out) + x.i * p.o_rs() + x.bh * d;
  float* lp = p.lse + p.row(x.bh, x.i);
  if constexpr (Mask::kAccumulate) {  // as fwd_merge
    const float old = p.merge ? *lp : -INFINITY;
    __syncwarp();  // every lane has read the old LSE before lane 0 replaces it
    if (l == 0.f) {  // no visible key in this block
      if (!p.merge) {
        for (int64_t e = lane; e < d; e += 32) out[e] = from_f<T>(0.f);
        if (lane == 0) *lp = -INFINITY;
      }
      return;
    }
    const float lb = m + logf(l);
    float ln = lb, wo = 0.f, wb = p.drop.inv_keep / l;
    if (old != -INFINITY) {
      ln = fmaxf(old, lb) + log1pf(expf(-fabsf(old - lb)));
      wo = expf(old - ln);
      wb = expf(lb - ln) * p.drop.inv_keep / l;
    }
    for (int64_t e = lane; e < d; e += 32) {
      float y = so[e] * wb;
      if (wo != 0.f) y = fmaf(to_f(out[e]), wo, y);
      out[e] = from_f<T>(y);
    }
    if (lane == 0) *lp = ln;
  } else {
    const float inv = p.drop.inv_keep / l;
    for (int64_t e = lane; e < d; e += 32) out[e] = from_f<T>(so[e] * inv);
    if (lane == 0) *lp = m + logf(l);
  }
}

/// delta of query row (b, h, i) = Σ_e dout ∘ out: the simple backward's pre-processing.
template <typename T>
__global__ void bwd_pre_simple(const Params p) {
  const int lane = threadIdx.x & 31;
  SimpleRow x;
  if (!simple_row(p, static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5), x)) return;
  const int64_t off = x.i * p.o_rs() + x.bh * p.d;
  const T* go = static_cast<const T*>(p.dout) + off;
  const T* o = static_cast<const T*>(p.out) + off;
  float acc = 0.f;
  for (int64_t e = lane; e < p.d; e += 32) acc += to_f(go[e]) * to_f(o[e]);
  acc = warp_sum(acc);
  if (lane == 0) p.delta[p.row(x.bh, x.i)] = acc;
}

/// dQ of query row (b, h, i): Σ_j dS_ij k_j · scale, into (CausalMask) or added to (PositionMask)
/// the query slot of dqkv.
template <typename T, class Mask>
__global__ void bwd_dq_simple(const Params p) {
  extern __shared__ float sm_simple[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  SimpleRow x;
  if (!simple_row(p, static_cast<int64_t>(blockIdx.x) * kSimpleWarps + warp, x)) return;
  const float li = p.lse[p.row(x.bh, x.i)], delta = p.delta[p.row(x.bh, x.i)];
  if constexpr (Mask::kEmptyRows) {
    if (!isfinite(li)) return;  // the row sees no key (in any block): dQ += 0
  }
  const int64_t d = p.d, krs = p.kv_rs();
  const int64_t qoff = x.i * p.q_rs() + p.q_base(x.b, x.grp, x.h % p.qpg);
  const T* kb = static_cast<const T*>(p.kv) + p.kv_base(x.b, x.grp);
  const T* vb = kb + d;
  const T* go = static_cast<const T*>(p.dout) + x.i * p.o_rs() + x.bh * d;
  float* sq = sm_simple + warp * 4 * d;
  float* sg = sq + d;
  float* sdq = sg + d;
  for (int64_t e = lane; e < d; e += 32) {
    sq[e] = to_f(static_cast<const T*>(p.q)[qoff + e]);
    sg[e] = to_f(go[e]);
    sdq[e] = 0.f;
  }
  __syncwarp();
  const SimpleKeys<Mask> keys(p, x);
  for (int64_t jb = keys.lo; jb <= keys.hi; jb += 32) {
    const int64_t j = jb + lane;
    const int kp = j <= keys.hi ? Mask::key_row(p, j) : 0;
    float dsv = 0.f;
    if (keys.visible(j, kp)) {
      const float pv = expf(p.scale * dot_sf(sq, kb + j * krs, d) - li);
      float dp = dot_sf(sg, vb + j * krs, d);
      if (p.drop.enabled) dp = p.drop.keep(keys.row_g + static_cast<uint64_t>(kp)) ? dp * p.drop.inv_keep : 0.f;
      dsv = pv * (dp - delta);
    }
    const int nj = static_cast<int>(min64(32, keys.hi - jb + 1));
    for (int jj = 0; jj < nj; ++jj) {
      const float dsj = __shfl_sync(kFull, dsv, jj);
      const T* k = kb + (jb + jj) * krs;
      for (int64_t e = lane; e < d; e += 32) sdq[e] += dsj * to_f(k[e]);
    }
  }
  T* dq = static_cast<T*>(p.dq) + qoff;
  for (int64_t e = lane; e < d; e += 32) {
    if constexpr (Mask::kAccumulate) dq[e] = from_f<T>(fmaf(p.scale, sdq[e], to_f(dq[e])));
    else dq[e] = from_f<T>(p.scale * sdq[e]);
  }
}

/// dK and dV of key row (b, grp, j) ([b, g, sk] order), summed over the qpg query heads of the
/// group, into (CausalMask) or added to (PositionMask) dkv.
template <typename T, class Mask>
__global__ void bwd_dkdv_simple(const Params p) {
  extern __shared__ float sm_simple[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSimpleWarps + warp;
  if (row >= p.B * p.G * p.sk) return;
  const int64_t d = p.d, bg = row / p.sk, j = row % p.sk, b = bg / p.G, grp = bg % p.G;
  const int64_t qrs = p.q_rs(), ors = p.o_rs();
  const T* q = static_cast<const T*>(p.q);
  const int64_t koff = j * p.kv_rs() + p.kv_base(b, grp);
  const T* kv = static_cast<const T*>(p.kv);
  float* sk = sm_simple + warp * 4 * d;
  float* sv = sk + d;
  float* sdk = sv + d;
  float* sdv = sdk + d;
  for (int64_t e = lane; e < d; e += 32) {
    sk[e] = to_f(kv[koff + e]);
    sv[e] = to_f(kv[koff + d + e]);
    sdk[e] = sdv[e] = 0.f;
  }
  __syncwarp();
  const int32_t* doc = p.doc ? p.doc + b * p.doc_stride : nullptr;
  const int kp = Mask::key_row(p, j);
  int64_t lo, hi;
  Mask::query_range(p, j, lo, hi);
  for (int64_t qh = 0; qh < p.qpg; ++qh) {
    const int64_t bh = b * p.n + grp * p.qpg + qh;
    const T* qb = q + p.q_base(b, grp, qh);
    const T* gb = static_cast<const T*>(p.dout) + bh * d;
    for (int64_t ib = lo; ib <= hi; ib += 32) {
      const int64_t i = ib + lane;
      int qpos = INT_MIN, ds = INT_MIN;
      if (i <= hi) Mask::query_row(p, doc, i, qpos, ds);
      float pd = 0.f, dsv = 0.f;
      if (i <= hi && kp <= qpos && kp >= ds) {
        const float pv = expf(p.scale * dot_sf(sk, qb + i * qrs, d) - p.lse[p.row(bh, i)]);
        float dp = dot_sf(sv, gb + i * ors, d), mk = 1.f;
        if (p.drop.enabled)
          mk = p.drop.keep(p.drop.row_start(bh, qpos) + static_cast<uint64_t>(kp)) ? p.drop.inv_keep : 0.f;
        dp *= mk;
        pd = pv * mk;
        dsv = pv * (dp - p.delta[p.row(bh, i)]);
      }
      const int ni = static_cast<int>(min64(32, hi - ib + 1));
      for (int ii = 0; ii < ni; ++ii) {
        const float pdi = __shfl_sync(kFull, pd, ii), dsi = __shfl_sync(kFull, dsv, ii);
        if (pdi == 0.f && dsi == 0.f) continue;  // warp-uniform (shuffled values)
        const T* qr = qb + (ib + ii) * qrs;
        const T* go = gb + (ib + ii) * ors;
        for (int64_t e = lane; e < d; e += 32) {
          sdv[e] += pdi * to_f(go[e]);
          sdk[e] += dsi * to_f(qr[e]);
        }
      }
    }
  }
  T* dk = static_cast<T*>(p.dkv) + koff;
  for (int64_t e = lane; e < d; e += 32) {
    if constexpr (Mask::kAccumulate) {
      dk[e] = from_f<T>(fmaf(p.scale, sdk[e], to_f(dk[e])));
      dk[d + e] = from_f<T>(to_f(dk[d + e]) + sdv[e]);
    } else {
      dk[e] = from_f<T>(p.scale * sdk[e]);
      dk[d + e] = from_f<T>(sdv[e]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers.
// ---------------------------------------------------------------------------------------------

template <typename K>
void set_smem(K kernel, int bytes) {
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

/// The tensor-core path applies (for a 16-bit dtype): head_dim 64 or 128 and 16-byte aligned tensors.
inline bool mma_applies(int64_t d, std::initializer_list<const void*> ptrs) {
  if (d != 64 && d != 128) return false;
  for (const void* q : ptrs)
    if (!aligned16(q)) return false;
  return true;
}

/// MT_FLASH_ATTN_FWD_VARIANT / MT_FLASH_ATTN_BWD_VARIANT (benchmarks only): 0 the default tile
/// shapes, 1 the runner-up ones (launch_fwd_mma, launch_bwd_mma).
inline int env_variant(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : 0;
}

template <typename T, class Mask, int D, int W, int BC, int MW = 1, bool QR = true>
void fwd_mma_launch(const Params& p, cudaStream_t st) {
  constexpr int kBytes = fwd_smem_bytes<Mask, D, W, BC, MW>(), kRows = 16 * MW * W;
  const auto kernel = fwd_mma<T, Mask, D, W, BC, MW, QR>;
  set_smem(kernel, kBytes);
  const dim3 grid(static_cast<unsigned>(p.B * p.n), static_cast<unsigned>((p.sq + kRows - 1) / kRows));
  kernel<<<grid, W * 32, kBytes, st>>>(p);
  MT_CUDA_CHECK_LAUNCH();
}

template <typename T, class Mask, int D, int W, int BR, bool kDq>
void bwd_mma_launch(const Params& p, cudaStream_t st) {
  constexpr int kBytes = bwd_smem_bytes<Mask, D, W, BR, kDq>();
  const auto kernel = bwd_mma<T, Mask, D, W, BR, kDq>;
  set_smem(kernel, kBytes);
  const dim3 grid(static_cast<unsigned>(p.B * p.G), static_cast<unsigned>((p.sk + 16 * W - 1) / (16 * W)));
  kernel<<<grid, W * 32, kBytes, st>>>(p);
  MT_CUDA_CHECK_LAUNCH();
}

template <typename T, class Mask, int D, int W, int BC>
void dq_mma_launch(const Params& p, cudaStream_t st) {
  constexpr int kBytes = dq_smem_bytes<Mask, D, W, BC>();
  const auto kernel = bwd_dq_mma<T, Mask, D, W, BC>;
  set_smem(kernel, kBytes);
  const dim3 grid(static_cast<unsigned>(p.B * p.n), static_cast<unsigned>((p.sq + 16 * W - 1) / (16 * W)));
  kernel<<<grid, W * 32, kBytes, st>>>(p);
  MT_CUDA_CHECK_LAUNCH();
}

/// Tile shapes, measured on an H100 with bench/flash_attention_bench.cpp (causal bf16, s = 1024 ..
/// 8192). Forward fwd_mma<T, d, W warps, BC keys per tile, MW row groups of 16 per warp, Q in
/// registers>; backward bwd_mma<T, d, W warps (16·W keys per block), BR queries per tile, dQ by
/// atomics>; the deterministic dQ kernel bwd_dq_mma<T, d, W warps (16·W queries per block), BC keys
/// per tile> (not tuned: the forward's key tiles).
/// Variant 1 keeps the runner-up for comparison: forward with 16 rows per warp (d = 64: -14..-26%,
/// d = 128: -9..-29%); backward d = 64 with 8 warps (-1..-23%), d = 128 with 4 warps (-20..+5%).
template <typename T, class Mask>
void launch_fwd_mma(const Params& p, cudaStream_t st) {
  static const int variant = env_variant("MT_FLASH_ATTN_FWD_VARIANT");
  if (p.d == 64) {
    if (variant == 1) fwd_mma_launch<T, Mask, 64, 4, 64>(p, st);
    else fwd_mma_launch<T, Mask, 64, 4, 64, 2>(p, st);
  } else {
    if (variant == 1) fwd_mma_launch<T, Mask, 128, 4, 64>(p, st);
    else fwd_mma_launch<T, Mask, 128, 4, 32, 2, false>(p, st);
  }
}

template <typename T, class Mask, bool kDq>
void launch_bwd_mma(const Params& p, cudaStream_t st) {
  static const int variant = env_variant("MT_FLASH_ATTN_BWD_VARIANT");
  if (p.d == 64) {
    if (variant == 1) bwd_mma_launch<T, Mask, 64, 8, 32, kDq>(p, st);
    else bwd_mma_launch<T, Mask, 64, 4, 32, kDq>(p, st);
  } else {
    if (variant == 1) bwd_mma_launch<T, Mask, 128, 4, 32, kDq>(p, st);
    else bwd_mma_launch<T, Mask, 128, 8, 32, kDq>(p, st);
  }
}

inline unsigned simple_blocks(int64_t rows) { return static_cast<unsigned>((rows + kSimpleWarps - 1) / kSimpleWarps); }
inline int simple_smem(int64_t d) { return static_cast<int>(kSimpleWarps * 4 * d * sizeof(float)); }

/// The forward of one call on the stream: the tensor-core kernels when `mma` (bf16/fp16 only; see
/// mma_applies), else the simple ones. Errors: mt::Error for a dtype other than fp32/bf16/fp16 and
/// query rows beyond the grid.
template <class Mask>
void forward(const Params& p, DType dtype, bool mma, cudaStream_t st, const char* fn) {
  MT_CHECK((p.sq + 15) / 16 < 65536, "{}: {} query rows are too many for the grid", fn, p.sq);
  dispatch_float(dtype, fn, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (!std::is_same_v<T, float>) {
      if (mma) {
        launch_fwd_mma<T, Mask>(p, st);
        return;
      }
    }
    const int bytes = simple_smem(p.d);
    set_smem(fwd_simple<T, Mask>, bytes);
    fwd_simple<T, Mask><<<simple_blocks(p.B * p.n * p.sq), kSimpleWarps * 32, bytes, st>>>(p);
    MT_CUDA_CHECK_LAUNCH();
  });
}

/// The backward of one call (p.delta and, on the tensor cores without `deterministic`, p.dq_accum
/// point into the workspace): bwd_pre, bwd_mma and bwd_dq_finish (dQ by atomics) or bwd_pre,
/// bwd_mma without dQ and bwd_dq_mma (--deterministic-mode); the simple path otherwise.
template <class Mask>
void backward(const Params& p, DType dtype, bool mma, bool deterministic, cudaStream_t st, const char* fn) {
  MT_CHECK((p.sq + 15) / 16 < 65536 && (p.sk + 15) / 16 < 65536, "{}: sq={} / sk={} rows are too many for the grid",
           fn, p.sq, p.sk);
  const int64_t rows = p.sq * p.B * p.n;
  dispatch_float(dtype, fn, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (!std::is_same_v<T, float>) {
      if (mma) {
        const unsigned blocks = static_cast<unsigned>((rows * (p.d / 8) + 255) / 256);
        if (deterministic) {  // dK, dV; then dQ by its own kernel (no atomics, no dq_accum)
          if (p.d == 64) bwd_pre<T, 64, false><<<blocks, 256, 0, st>>>(p);
          else bwd_pre<T, 128, false><<<blocks, 256, 0, st>>>(p);
          MT_CUDA_CHECK_LAUNCH();
          launch_bwd_mma<T, Mask, false>(p, st);
          if (p.d == 64) dq_mma_launch<T, Mask, 64, 4, 64>(p, st);
          else dq_mma_launch<T, Mask, 128, 4, 32>(p, st);
          return;
        }
        if (p.d == 64) bwd_pre<T, 64, true><<<blocks, 256, 0, st>>>(p);
        else bwd_pre<T, 128, true><<<blocks, 256, 0, st>>>(p);
        MT_CUDA_CHECK_LAUNCH();
        launch_bwd_mma<T, Mask, true>(p, st);
        if (p.d == 64) bwd_dq_finish<T, Mask, 64><<<blocks, 256, 0, st>>>(p);
        else bwd_dq_finish<T, Mask, 128><<<blocks, 256, 0, st>>>(p);
        MT_CUDA_CHECK_LAUNCH();
        return;
      }
    }
    bwd_pre_simple<T><<<static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps), kRowWarps * 32, 0, st>>>(p);
    MT_CUDA_CHECK_LAUNCH();
    const int bytes = simple_smem(p.d);
    set_smem(bwd_dq_simple<T, Mask>, bytes);
    set_smem(bwd_dkdv_simple<T, Mask>, bytes);
    bwd_dq_simple<T, Mask><<<simple_blocks(rows), kSimpleWarps * 32, bytes, st>>>(p);
    MT_CUDA_CHECK_LAUNCH();
    bwd_dkdv_simple<T, Mask><<<simple_blocks(p.B * p.G * p.sk), kSimpleWarps * 32, bytes, st>>>(p);
    MT_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace
}  // namespace mt::cuda::flash
