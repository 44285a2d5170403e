// The parameters, mask policies and dropout draws of the FlashAttention-2 kernel family
// (ops/cuda/flash_attention_kernels.cuh), the part in which its two ops differ:
//   CausalMask    ops/flash_attention.h: query i and key j are positions i and j of one sequence
//                 (sq = sk = s). Key tiles after the diagonal and before the smallest document start
//                 of a query tile are skipped by index; results overwrite out, lse and dqkv.
//   PositionMask  ops/context_attention.h: rows carry global positions (Params::q_pos [sq], k_pos
//                 [sk]). Tiles with no visible element are skipped by their position ranges, tiles
//                 visible to every row are not masked; results accumulate: (out, lse) merged with an
//                 earlier block's by the LSE (Params::merge), dQ, dK, dV added.
// Visibility of key j to query i of sample b, both policies: kpos(j) <= qpos(i) and, with a
// document mask (Params::doc, --reset-attention-mask), kpos(j) >= doc_start[b, i]. Dropout keys
// element (b, head, i, j) by (qpos(i), kpos(j)) (AttnDropout, ops/attention_impl.h), so both ops
// draw the one-rank mask of ops/attention.h. The document mask and dropout are runtime parts of
// either policy (a null pointer, AttnDropout::enabled: warp-uniform branches in one kernel), so
// that one instantiation serves all four combinations.
//
// Only included by ops/cuda/flash_attention_kernels.cuh.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops/attention_impl.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/mma_sm80.cuh"

// Internal linkage (an unnamed namespace): each including .cu file has its own instantiations.
namespace mt::cuda::flash {
namespace {

using namespace mma;  // NOLINT: the tensor-core building blocks

constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

/// Everything the kernels need, by value. Rows of (out, lse, delta, dq_accum) are addressed by
/// (bh = b·n + h, i): out / dout at i·o_rs() + bh·d, the fp32 ones at row(bh, i) (·d for dq_accum).
struct Params {
  const void* q = nullptr;         ///< qkv [sq, b, g, qpg + 2, d]: the query heads are read
  const void* kv = nullptr;        ///< key head of (b, grp) at kv + j·kv_rs() + kv_base(b, grp), value head + d
  void* out = nullptr;             ///< [sq, b, n, d]
  float* lse = nullptr;            ///< row(bh, i)
  const void* dout = nullptr;      ///< as out
  void* dq = nullptr;              ///< dqkv, the layout of q: its query heads are written
  void* dkv = nullptr;             ///< the layout of kv
  float* delta = nullptr;          ///< row(bh, i)
  float* dq_accum = nullptr;       ///< row(bh, i)·d
  const int32_t* q_pos = nullptr;  ///< PositionMask: [sq]
  const int32_t* k_pos = nullptr;  ///< PositionMask: [sk]
  const int32_t* doc = nullptr;    ///< document starts of sample b at doc + b·doc_stride; null: none
  int64_t doc_stride = 0;
  int64_t sq = 0, sk = 0, B = 0, G = 0, qpg = 0, n = 0, d = 0;
  int64_t kv_heads = 2;  ///< heads per (b, grp) in a kv row: qpg + 2 (kv is qkv) or 2
  int64_t kv_first = 0;  ///< index of the key head among them: qpg or 0
  int64_t row_bh = 0, row_i = 0;  ///< row(bh, i) = bh·row_bh + i·row_i
  float scale = 0, scale_log2 = 0;
  bool merge = false;  ///< PositionMask forward: merge into (out, lse) instead of overwriting
  AttnDropout drop;

  __host__ __device__ int64_t q_rs() const { return B * G * (qpg + 2) * d; }
  __host__ __device__ int64_t kv_rs() const { return B * G * kv_heads * d; }
  __host__ __device__ int64_t o_rs() const { return B * n * d; }
  /// Offset of row 0 of query head qi (0..qpg-1) of (b, grp) in q (and dq).
  __host__ __device__ int64_t q_base(int64_t b, int64_t grp, int64_t qi) const {
    return ((b * G + grp) * (qpg + 2) + qi) * d;
  }
  /// Offset of row 0 of the key head of (b, grp) in kv (and dkv).
  __host__ __device__ int64_t kv_base(int64_t b, int64_t grp) const {
    return ((b * G + grp) * kv_heads + kv_first) * d;
  }
  __host__ __device__ int64_t row(int64_t bh, int64_t i) const { return bh * row_bh + i * row_i; }
};

// ---------------------------------------------------------------------------------------------
// Helpers.
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

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  T x[2];
  memcpy(x, &v, sizeof(v));
  return make_float2(to_f(x[0]), to_f(x[1]));
}

/// Smallest value of a[r0 .. r0 + rows) (entries < lim), in every lane.
__device__ __forceinline__ int doc_min(const int32_t* a, int64_t r0, int rows, int64_t lim, int lane) {
  int mn = INT_MAX;
  for (int r = lane; r < rows; r += 32)
    if (r0 + r < lim) mn = min(mn, static_cast<int>(a[r0 + r]));
  return __reduce_min_sync(kFull, mn);
}

struct PosRange {
  int lo, hi;
};
/// Min and max of a[r0 .. r0 + rows) (entries < lim), in every lane ({INT_MAX, INT_MIN} when empty).
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
/// {INT_MIN, INT_MIN} without documents): some element visible (return), every element visible
/// (full: also needs both tiles complete).
__device__ __forceinline__ bool tile_visible(PosRange kr, PosRange qr, PosRange dr, bool complete, bool& full) {
  full = complete && kr.hi <= qr.lo && kr.lo >= dr.hi;
  return kr.lo <= qr.hi && kr.hi >= dr.lo;
}

/// Dropout keep decisions of the global elements G and G + 1 (one Philox call, two when G + 1
/// starts the next group of four).
__device__ __forceinline__ void keep_consecutive(const AttnDropout& drop, uint64_t G, bool& k0, bool& k1) {
  const Philox4 r = drop.bits4(G >> 2);
  const uint32_t e = static_cast<uint32_t>(G & 3u);
  const uint32_t v0 = e == 0 ? r.v[0] : e == 1 ? r.v[1] : e == 2 ? r.v[2] : r.v[3];
  const uint32_t v1 = e == 0 ? r.v[1] : e == 1 ? r.v[2] : e == 2 ? r.v[3] : drop.bits4((G >> 2) + 1).v[0];
  k0 = v0 >= drop.threshold;
  k1 = v1 >= drop.threshold;
}

/// Keep decisions of the elements of one row at key positions k0 and k1 (one Philox call for two
/// consecutive positions in one group of four).
__device__ __forceinline__ void keep_pair(const AttnDropout& drop, uint64_t row_start, int32_t k0, int32_t k1, bool& a,
                                          bool& c) {
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

// ---------------------------------------------------------------------------------------------
// Mask policies. A policy gives the position and document start of a row, and two walkers: the
// key tiles of a query tile (query-major kernels: fwd_mma, bwd_dq_mma) and the query tiles of a
// key tile (bwd_mma). A walker yields the visible tiles in order, loads what the masks need, says
// whether a tile needs the element mask, and draws the dropout decisions of two adjacent keys.
// ---------------------------------------------------------------------------------------------

/// One tile of a walk: its index, and whether every element of the tile pair is visible.
struct Tile {
  int i;
  bool full;
};

/// Causal self-attention over one sequence (ops/flash_attention.h): query i and key j are at
/// positions i and j.
struct CausalMask {
  static constexpr bool kAccumulate = false;  ///< out, lse and dqkv are overwritten
  static constexpr bool kEmptyRows = false;   ///< every query sees its own key: the LSE is finite
  static constexpr bool kPositions = false;   ///< no position arrays in shared memory

  /// Query tile of block y of ny: the heavy (late) tiles first.
  __device__ static int64_t query_tile(unsigned y, unsigned ny) { return ny - 1 - y; }
  /// Position and document start (INT_MIN: none) of query row i (rows >= sq are never stored).
  __device__ static void query_row(const Params& p, const int32_t* doc, int64_t i, int& pos, int& ds) {
    pos = static_cast<int>(i);
    ds = doc && i < p.sq ? doc[i] : INT_MIN;
  }
  /// Position of key row j.
  __device__ static int key_row(const Params&, int64_t j) { return static_cast<int>(j); }
  /// bwd_mma: the position of key j0 + 8·r, one of the warp's rows (kp_r: key_row of both).
  __device__ static int warp_key_pos(const int (&)[2], int64_t j0, int r) { return static_cast<int>(j0 + 8 * r); }
  /// Simple kernels: the keys [lo, hi] query row i may see (from its document start to itself),
  /// and the query rows [lo, hi] that may see key j (from j on).
  __device__ static void key_range(const Params&, const int32_t* doc, int64_t i, int64_t& lo, int64_t& hi) {
    lo = doc ? doc[i] : 0;
    hi = i;
  }
  __device__ static void query_range(const Params& p, int64_t j, int64_t& lo, int64_t& hi) {
    lo = j;
    hi = p.sq - 1;
  }

  /// Key tiles of the query rows [row0, row0 + BR): from the tile of their smallest document start
  /// to the tile of the diagonal (each is visible to some row of the query tile).
  template <typename T, int BR, int BC, int D, int NT>
  struct KeyTiles {
    const T* kg;
    const T* vg;
    T* sK;
    T* sV;
    int64_t rs, sk;
    int tid, lo, hi;
    bool doc;
    __device__ KeyTiles(const Params& p, const int32_t* doc_, int64_t row0, T* sK_, T* sV_, int*, const T* kg_,
                        const T* vg_, int tid_, int lane)
        : kg(kg_), vg(vg_), sK(sK_), sV(sV_), rs(p.kv_rs()), sk(p.sk), tid(tid_),
          lo(doc_ ? doc_min(doc_, row0, BR, p.sq, lane) / BC : 0),
          hi(static_cast<int>((min64(row0 + BR, p.sq) - 1) / BC) + 1), doc(doc_ != nullptr) {}
    __device__ Tile first() const { return {lo, false}; }
    __device__ Tile next(Tile t) const { return {t.i + 1, false}; }
    __device__ bool done(Tile t) const { return t.i >= hi; }
    /// K and V of tile t into double-buffer half buf (cp.async; the caller commits).
    __device__ void load(Tile t, int buf) const {
      constexpr int SD = D + 8;
      load_tile<BC, D, NT>(sK + buf * BC * SD, kg, static_cast<int64_t>(t.i) * BC, rs, sk, tid);
      load_tile<BC, D, NT>(sV + buf * BC * SD, vg, static_cast<int64_t>(t.i) * BC, rs, sk, tid);
    }
    /// Whether the rows from wrow on need the element mask in tile t (documents; keys past wrow).
    __device__ bool masked(Tile t, int64_t wrow) const {
      return doc || static_cast<int64_t>(t.i) * BC + BC - 1 > wrow;
    }
    __device__ int key_pos(Tile t, int, int jl) const { return t.i * BC + jl; }
    /// Dropout keep decisions of keys jl, jl + 1 of tile t in the row whose key 0 is global
    /// element row_start.
    __device__ void keep2(const AttnDropout& drop, uint64_t row_start, Tile t, int, int jl, bool& k0, bool& k1) const {
      keep_consecutive(drop, row_start + static_cast<uint64_t>(t.i * BC + jl), k0, k1);
    }
  };

  /// Query tiles (of each of the qpg heads, flattened: it -> head it / per_head) of the keys
  /// [col0, col0 + BC): from the tile of the diagonal on, skipping those whose document starts all
  /// lie after the last key.
  template <int BR, int BC>
  struct QueryTiles {
    const int32_t* doc;
    int64_t sq, last_key;
    int m_lo, per_head, total, lane;
    __device__ QueryTiles(const Params& p, const int32_t* doc_, int64_t col0, int lane_)
        : doc(doc_), sq(p.sq), last_key(min64(col0 + BC, p.sk) - 1), m_lo(static_cast<int>(col0 / BR)),
          per_head(static_cast<int>((p.sq + BR - 1) / BR) - m_lo), total(static_cast<int>(p.qpg) * per_head),
          lane(lane_) {}
    __device__ int head(int it) const { return it / per_head; }
    __device__ int64_t row0(int it) const { return static_cast<int64_t>(m_lo + it % per_head) * BR; }
    /// The first tile from `it` on some of whose queries see a key of the block.
    __device__ Tile scan(int it) const {
      while (it < total && doc && doc_min(doc, row0(it), BR, sq, lane) > last_key) ++it;
      return {it, false};
    }
    __device__ Tile first() const { return scan(0); }
    __device__ Tile next(Tile t) const { return scan(t.i + 1); }
    __device__ bool done(Tile t) const { return t.i >= total; }
    /// Whether the warp's keys from wkey on need the element mask against the tile at row0.
    __device__ bool masked(Tile, int64_t row0, int64_t wkey) const { return doc || row0 < wkey + 15; }
    __device__ int query_pos(const int*, int64_t row0, int ql) const { return static_cast<int>(row0) + ql; }
  };
};

/// A block of keys at global positions (ops/context_attention.h).
struct PositionMask {
  static constexpr bool kAccumulate = true;  ///< (out, lse) merged, dQ / dK / dV added
  static constexpr bool kEmptyRows = true;   ///< a query may see no key of the block (lse −inf)
  static constexpr bool kPositions = true;   ///< key / query positions of a tile in shared memory

  __device__ static int64_t query_tile(unsigned y, unsigned) { return y; }
  __device__ static void query_row(const Params& p, const int32_t* doc, int64_t i, int& pos, int& ds) {
    pos = i < p.sq ? p.q_pos[i] : INT_MIN;
    ds = doc && i < p.sq ? doc[i] : INT_MIN;
  }
  __device__ static int key_row(const Params& p, int64_t j) { return j < p.sk ? p.k_pos[j] : INT_MAX; }
  __device__ static int warp_key_pos(const int (&kp_r)[2], int64_t, int r) { return kp_r[r]; }
  __device__ static void key_range(const Params& p, const int32_t*, int64_t, int64_t& lo, int64_t& hi) {
    lo = 0;
    hi = p.sk - 1;
  }
  __device__ static void query_range(const Params& p, int64_t, int64_t& lo, int64_t& hi) {
    lo = 0;
    hi = p.sq - 1;
  }

  /// The key tiles some query of the tile [row0, row0 + BR) can see (by the tiles' position
  /// ranges and document starts); a tile's K, V and key positions (INT_MAX past sk) are loaded
  /// into double-buffer half buf.
  template <typename T, int BR, int BC, int D, int NT>
  struct KeyTiles {
    const Params& p;
    const int64_t row0, krs;
    T* const sK;
    T* const sV;
    int* const sKp;
    const T* const kg;
    const T* const vg;
    const int tid, lane;
    const PosRange qr, dr;
    const int ntiles;
    __device__ KeyTiles(const Params& p_, const int32_t* doc, int64_t row0_, T* sK_, T* sV_, int* sKp_, const T* kg_,
                        const T* vg_, int tid_, int lane_)
        : p(p_), row0(row0_), krs(p_.kv_rs()), sK(sK_), sV(sV_), sKp(sKp_), kg(kg_), vg(vg_), tid(tid_), lane(lane_),
          qr(pos_range(p_.q_pos, row0_, BR, p_.sq, lane_)),
          dr(doc ? pos_range(doc, row0_, BR, p_.sq, lane_) : PosRange{INT_MIN, INT_MIN}),
          ntiles(static_cast<int>((p_.sk + BC - 1) / BC)) {}
    /// The first visible tile from nb on (ntiles when none).
    __device__ Tile scan(int nb) const {
      bool full = false;
      for (; nb < ntiles; ++nb) {
        const PosRange kr = pos_range(p.k_pos, static_cast<int64_t>(nb) * BC, BC, p.sk, lane);
        if (tile_visible(kr, qr, dr, row0 + BR <= p.sq && static_cast<int64_t>(nb + 1) * BC <= p.sk, full)) break;
      }
      return {nb, full};
    }
    __device__ Tile first() const { return scan(0); }
    __device__ Tile next(Tile t) const { return scan(t.i + 1); }
    __device__ bool done(Tile t) const { return t.i >= ntiles; }
    __device__ void load(Tile t, int buf) const {
      constexpr int SD = D + 8;
      const int64_t c0 = static_cast<int64_t>(t.i) * BC;
      load_tile<BC, D, NT>(sK + buf * BC * SD, kg, c0, krs, p.sk, tid);
      load_tile<BC, D, NT>(sV + buf * BC * SD, vg, c0, krs, p.sk, tid);
      for (int j = tid; j < BC; j += NT) sKp[buf * BC + j] = c0 + j < p.sk ? p.k_pos[c0 + j] : INT_MAX;
    }
    __device__ bool masked(Tile t, int64_t) const { return !t.full; }
    __device__ int key_pos(Tile, int buf, int jl) const { return sKp[buf * BC + jl]; }
    __device__ void keep2(const AttnDropout& drop, uint64_t row_start, Tile, int buf, int jl, bool& k0,
                          bool& k1) const {
      const int* kp = sKp + buf * BC;
      keep_pair(drop, row_start, kp[jl], kp[jl + 1], k0, k1);
    }
  };

  /// The query tiles (of each of the qpg heads, flattened) that can see some key of [col0, col0 + BC).
  template <int BR, int BC>
  struct QueryTiles {
    const Params& p;
    const int32_t* doc;
    PosRange kr;
    bool keys_complete;  // the key tile lies inside sk
    int per_head, total, lane;
    __device__ QueryTiles(const Params& p_, const int32_t* doc_, int64_t col0, int lane_)
        : p(p_), doc(doc_), kr(pos_range(p_.k_pos, col0, BC, p_.sk, lane_)), keys_complete(col0 + BC <= p_.sk),
          per_head(static_cast<int>((p_.sq + BR - 1) / BR)), total(static_cast<int>(p_.qpg) * per_head),
          lane(lane_) {}
    __device__ int head(int it) const { return it / per_head; }
    __device__ int64_t row0(int it) const { return static_cast<int64_t>(it % per_head) * BR; }
    __device__ Tile scan(int it) const {
      bool full = false;
      for (; it < total; ++it) {
        const int64_t r0 = row0(it);
        const PosRange qr = pos_range(p.q_pos, r0, BR, p.sq, lane);
        const PosRange dr = doc ? pos_range(doc, r0, BR, p.sq, lane) : PosRange{INT_MIN, INT_MIN};
        if (tile_visible(kr, qr, dr, r0 + BR <= p.sq && keys_complete, full)) break;
      }
      return {it, full};
    }
    __device__ Tile first() const { return scan(0); }
    __device__ Tile next(Tile t) const { return scan(t.i + 1); }
    __device__ bool done(Tile t) const { return t.i >= total; }
    __device__ bool masked(Tile t, int64_t, int64_t) const { return !t.full; }
    __device__ int query_pos(const int* sQp, int64_t, int ql) const { return sQp[ql]; }
  };
};

/// Dropout keep bits of this lane's elements of a query-major m16n8 accumulator over BC keys (rows
/// at query positions qpos0 and qpos1, the keys of tile t in buffer half buf): element e of
/// fragment nt is bit 2·((e >> 1)·(BC / 8) + nt) + (e & 1). Drawn in a rolled loop (one copy of
/// Philox in the code).
template <int BC, class KeyTiles>
__device__ __forceinline__ uint64_t keep_bits_rows(const AttnDropout& drop, int64_t bh, int qpos0, int qpos1,
                                                   const KeyTiles& tiles, Tile t, int buf, int t4) {
  static_assert(BC <= 128, "64 keep bits");
  uint64_t keep = 0;
#pragma unroll 1
  for (int k = 0; k < BC / 4; ++k) {  // k = r · (BC / 8) + nt: elements (r, nt, 0..1)
    const int r = k / (BC / 8), nt = k % (BC / 8);
    bool k0, k1;
    tiles.keep2(drop, drop.row_start(bh, r == 0 ? qpos0 : qpos1), t, buf, nt * 8 + 2 * t4, k0, k1);
    keep |= (static_cast<uint64_t>(k0) | static_cast<uint64_t>(k1) << 1) << (2 * k);
  }
  return keep;
}
__device__ __forceinline__ bool keep_bit(uint64_t keep, int nt, int e, int tiles) {
  return (keep >> (2 * ((e >> 1) * tiles + nt) + (e & 1))) & 1u;
}

/// lse · log2(e) of a row for the backward's exp2 (+inf for a row past the end or, under a policy
/// with empty rows, one that sees no key: P = 0).
template <class Mask>
__device__ __forceinline__ float lse_log2(const Params& p, int64_t bh, int64_t i) {
  const float l = i < p.sq ? p.lse[p.row(bh, i)] : INFINITY;
  if constexpr (Mask::kEmptyRows) return isfinite(l) ? l * kLog2e : INFINITY;
  return l * kLog2e;
}


}  // namespace
}  // namespace mt::cuda::flash
