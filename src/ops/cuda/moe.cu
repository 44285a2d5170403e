// CUDA kernels of ops/moe.h (Megatron-Core TopKRouter, moe_utils.py). They follow the CPU reference
// (ops/cpu/moe.cpp) operation by operation, so that the selections are identical and the values
// agree to rounding.
//
// The routing kernels (routing, its backward, the loss values and gradients) are templated on the
// routing dtype R: float, or double for --moe-router-dtype fp64 (64-bit order keys and shuffles
// in the top-k; the CPU's double formulas).
// Routing (moe_topk_routing, _backward, moe_aux_scores_backward): one warp per token row (4 warps
// per block, fewer when E is large; shared memory opted in beyond 48 KiB), the row's scores in
// per-warp shared memory. Top-k: k rounds of a warp argmax under the total order (score
// descending, index ascending): round j takes the largest score key after pick j-1 in that order
// (__reduce_max_sync, then __reduce_min_sync for the lowest index among equal keys), so ties go to
// the lower expert index as in the CPU's stable sort and no "taken" flags are needed; any k <= E.
// Group-limited routing: the same selection per group (group score = the sum of its best
// k/group_topk in pick order, in double), over the groups, then over the masked row. Softmax and
// normalisation sums in double with exp in double, sigmoid = 1 / (1 + float(exp(-x))), as the CPU
// computes them (its expf is correctly rounded): the scores are the same floats and the selections
// the same experts.
// Loss values (moe_aux_loss, moe_z_loss): pass 1, one warp per token row (256-thread blocks, a
// grid that depends on T only, at most 1024 blocks) writes one double partial per block to
// scratch; pass 2, one block adds the partials in a fixed order into loss[0]. The z-loss gradient
// comes from the same pass-1 kernel. Scratch = the stream's cuBLASLt workspace (32 MiB): every
// user of it runs in the stream's order, so nothing else touches it meanwhile.
// moe_tokens_per_expert: per-block shared-memory histograms of the G·E bins, integer atomics into
// counts viewed as int32 (exact in any order), then converted to float in place.
// moe_global_tokens_per_expert: one block; each expert's sum and IEEE division (__fdiv_rn), as the CPU.
// moe_expert_bias_update: one block; the mean count summed in expert order in double, as the CPU.
// moe_routing_map: a stable counting sort of the flat slots by local expert. Blocks own chunks of
// 4096 slots (8 warps x 16 rounds x 32 lanes): (1) per-chunk expert counts into scratch
// [expert][chunk]; (2) one block per expert scans them (exclusive) and writes counts; (3) each
// block ranks its slots (rounds in slot order, __match_any_sync groups the lanes of one expert,
// warps in order) and writes row_index[base(expert) + chunk prefix + warp prefix + rank] = slot;
// one fused block when N·k <= 4096. The counts then go to the host (cudaMemcpyAsync +
// cudaStreamSynchronize: the one host synchronisation in this file), and (4) slot_row is written
// (the inverse of row_index, -1 for the slots of other experts). moe_routing_map_device skips the
// host copy: row_index and slot_row are preset to -1 (memset), steps (1)-(3) run as above, and
// slot_row is written from every placed row of the planned capacity. Up to ~6,000 local experts (the
// shared memory of step 3).
// moe_permute / _backward, moe_unpermute / _backward: one warp per row (8 warps per block), 16-byte
// vectors when h and the pointers allow (permute copies raw words of up to 16 bytes, any dtype),
// fp32 accumulation in slot order j = 0..k-1. unpermute_backward runs one warp per slot i and
// writes d_rows[slot_row[i]] and d_probs[i] (a per-lane fp32 sum, then a warp butterfly): with the
// maps of moe_routing_map this is d_rows[r] for every routed row r; a second kernel (one warp per
// row) zeroes the rows with row_index[r] < 0 (the unrouted tail, the padding of a block layout).
// Determinism: no floating-point atomics; every sum is taken in an order fixed by the shapes, so
// repeated calls give bitwise identical results.
// Measured on one H100 (T = 16384 tokens): routing forward 31-42 us for E = 64, k = 8 and 126 us for
// E = 256, k = 8 with 8 groups (instruction-bound: one warp per token); routing map of 2^20 slots
// 72 us including the host round trip; permute / unpermute and their backward at 2.9-3.9 TB/s
// (bf16, h = 4096).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops/moe.h"  // first: ops/cuda/elementwise_common.cuh needs Tensor, Stream, DType

#include "core/cuda_check.h"
#include "ops/cuda/elementwise_common.cuh"

namespace mt::cuda {
namespace {

using ew::from_f32;
using ew::raw;
using ew::to_f32;
using ew::Vec;

constexpr unsigned kFull = 0xffffffffu;
constexpr int kRowWarps = 8;           // warps per block of the row kernels (permute, losses)
constexpr int kRowThreads = kRowWarps * 32;
constexpr int kMaxPartials = 1024;     // pass-1 blocks of the loss reductions
constexpr int kMapWarps = 8;           // routing map: warps per block
constexpr int kMapItems = 16;          // routing map: slots per lane per block
constexpr int kMapThreads = kMapWarps * 32;
constexpr int kMapChunk = kMapThreads * kMapItems;  // slots per block
constexpr size_t kDefaultSmem = 48 * 1024;

// ---- warp and block helpers ------------------------------------------------------------------

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}
__device__ __forceinline__ float rmax(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double rmax(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ double warp_max(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

/// Butterfly sum: every lane ends with the same value (a + b == b + a at each level).
__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

/// The CPU's sigmoidf, 1.f / (1.f + expf(-x)), with expf correctly rounded through double.
__device__ __forceinline__ float sigmoid_cpu(float x) {
  return 1.f / (1.f + static_cast<float>(exp(static_cast<double>(-x))));
}
/// The sigmoid in the routing dtype R (fp64: 1 / (1 + exp(-x)) in double, as the CPU).
__device__ __forceinline__ float route_sigmoid(float x) { return sigmoid_cpu(x); }
__device__ __forceinline__ double route_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
/// Megatron's 1e-20 guard in the routing dtype (fp32: the CPU's 1e-20f).
template <typename R>
__device__ __forceinline__ double route_eps() {
  return static_cast<double>(static_cast<R>(1e-20));
}

/// Block-wide sum of doubles in a fixed order; valid in thread 0. All threads call it.
__device__ double block_sum_d(double v) {
  __shared__ double sh[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum_d(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  double s = 0;
  if (threadIdx.x == 0) {
    const int nw = (blockDim.x + 31) >> 5;
    for (int w = 0; w < nw; ++w) s += sh[w];
  }
  return s;
}

/// Exclusive prefix of v across the block (in thread order); *total gets the block's sum. All
/// threads call it (it synchronises).
__device__ int block_exclusive_scan(int v, int* total) {
  __shared__ int wsum[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) wsum[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < nw ? wsum[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFull, s, o);
      if (lane >= o) s += y;
    }
    wsum[lane] = s;
  }
  __syncthreads();
  const int prefix = (warp > 0 ? wsum[warp - 1] : 0) + x - v;
  *total = wsum[nw - 1];
  __syncthreads();  // wsum is reused by the next call
  return prefix;
}

/// A 32-bit key with the order of the float scores (-0 and +0 equal, as the CPU compares them).
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = __float_as_uint(v + 0.f);  // -0 + 0 = +0
  return (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
}
/// The same for the double scores of the fp64 routing (a 64-bit key).
__device__ __forceinline__ unsigned long long order_key(double v) {
  const auto u = static_cast<unsigned long long>(__double_as_longlong(v + 0.0));
  return (u >> 63) != 0ull ? ~u : (u | (1ull << 63));
}

/// The k largest of value(e), e < n, in descending order with ties to the lower index (the CPU's
/// stable sort): round j takes the best element after pick j-1 in that total order (largest key,
/// then lowest index; a warp max and min reduction per round). Lane 0 writes the indices to
/// out[0..k) (out may be null). Returns the sum of the picked values in pick order (double), the
/// same in every lane. All lanes of the warp call it.
template <typename Value>
__device__ double warp_topk(Value value, int n, int k, int* out, int lane) {
  constexpr int kNone = 0x7fffffff;
  using Key = decltype(order_key(value(0)));  // 32-bit for fp32 scores, 64-bit for fp64
  Key pk = 0;
  int pi = -1;
  double sum = 0;
  for (int j = 0; j < k; ++j) {
    Key bk = 0;
    int bi = kNone;
    for (int e = lane; e < n; e += 32) {  // e ascends in a lane: ties keep the lower index
      const Key key = order_key(value(e));
      const bool after = pi < 0 || key < pk || (key == pk && e > pi);
      if (after && (bi == kNone || key > bk)) {
        bk = key;
        bi = e;
      }
    }
    Key wk = bk;
    int wi = bi;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (sizeof(Key) == 4) {
      wk = __reduce_max_sync(kFull, bk);
      wi = __reduce_min_sync(kFull, bk == wk ? bi : kNone);
    } else
#endif
    {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const Key ok = __shfl_xor_sync(kFull, wk, o);
        const int oi = __shfl_xor_sync(kFull, wi, o);
        if (ok > wk || (ok == wk && oi < wi)) {
          wk = ok;
          wi = oi;
        }
      }
    }
    if (wi == kNone) wi = 0;  // only when NaN scores leave nothing in order: stay in bounds
    const auto v = value(wi);
    if (out != nullptr && lane == 0) out[j] = wi;
    sum += static_cast<double>(v);
    pk = order_key(v);
    pi = wi;
  }
  __syncwarp();
  return sum;
}

constexpr int kSoftmaxCache = 8;  // exp values a lane keeps in registers (E <= 256 computes each once)

/// A row's max m (in the routing dtype R) and the exp(double(x[e] − m)) of the lane-strided
/// elements e = lane + 32·q, the first kSoftmaxCache of them kept in registers, and their warp sum s
/// in a fixed order (the CPU's softmax_row / logsumexp). All lanes call it.
template <typename R>
struct RowExp {
  R m;
  double s;
  double ex[kSoftmaxCache];
};

template <typename R>
__device__ void warp_row_exp(const R* x, int n, int lane, RowExp<R>& r) {
  R m = -INFINITY;
  for (int e = lane; e < n; e += 32) m = rmax(m, x[e]);
  r.m = warp_max(m);
  double s = 0;
#pragma unroll
  for (int q = 0; q < kSoftmaxCache; ++q) {
    const int e = lane + 32 * q;
    r.ex[q] = e < n ? exp(static_cast<double>(x[e] - r.m)) : 0.0;
    s += r.ex[q];
  }
  for (int e = lane + 32 * kSoftmaxCache; e < n; e += 32) s += exp(static_cast<double>(x[e] - r.m));
  r.s = warp_sum_d(s);
}

/// f(e, exp(double(x[e] − m))) for this lane's elements, from the registers where kept.
template <typename R, typename F>
__device__ __forceinline__ void for_each_exp(const RowExp<R>& r, const R* x, int n, int lane, F f) {
#pragma unroll
  for (int q = 0; q < kSoftmaxCache; ++q) {
    const int e = lane + 32 * q;
    if (e < n) f(e, r.ex[q]);
  }
  for (int e = lane + 32 * kSoftmaxCache; e < n; e += 32) f(e, exp(static_cast<double>(x[e] - r.m)));
}

/// out[e] = softmax(x)[e] as the CPU's softmax_row: each value exp / sum rounded once. All lanes
/// call it; out is written lane-strided.
template <typename R>
__device__ void warp_softmax(const R* x, R* out, int n, int lane) {
  RowExp<R> r;
  warp_row_exp(x, n, lane, r);
  for_each_exp(r, x, n, lane, [&](int e, double v) { out[e] = static_cast<R>(v / r.s); });
}

// ---- routing ---------------------------------------------------------------------------------
// The kernels are templated on the routing dtype R (float, or double for --moe-router-dtype fp64):
// logits, scores, d_logits and the per-warp shared rows are R; probs and d_probs stay fp32.

struct RouteArgs {
  int64_t T;
  int E, k;
  bool sigmoid, pre_softmax;
  float scaling;
  int G, gk;  ///< groups (0: off), group top-k
};

/// Bytes of per-warp shared memory of the forward kernel: s[E], sel[E], gsc[G] (R), chosen[k],
/// gsel[gk] (int), rounded up to 8 so that every warp's rows stay aligned.
template <typename R>
__host__ __device__ size_t route_bytes(const RouteArgs& a) {
  const size_t b = (2 * static_cast<size_t>(a.E) + static_cast<size_t>(a.G)) * sizeof(R) +
                   (static_cast<size_t>(a.k) + static_cast<size_t>(a.gk)) * sizeof(int);
  return (b + 7) / 8 * 8;
}
/// The backward kernel's: s[E], val[k] (R), pos[E] (int), rounded up to 8.
template <typename R>
__host__ __device__ size_t route_backward_bytes(const RouteArgs& a) {
  const size_t b = (static_cast<size_t>(a.E) + static_cast<size_t>(a.k)) * sizeof(R) + static_cast<size_t>(a.E) * sizeof(int);
  return (b + 7) / 8 * 8;
}

/// The selection of one token from sel[E] (overwritten with -inf outside the chosen groups when
/// group-limited) into chosen[k].
template <typename R>
__device__ void warp_select(R* sel, const RouteArgs& a, R* gsc, int* gsel, int* chosen, int lane) {
  if (a.G > 0) {
    const int per = a.E / a.G, kg = a.k / a.gk;
    for (int g = 0; g < a.G; ++g) {
      const R* part = sel + g * per;
      const double s = warp_topk([part](int e) { return part[e]; }, per, kg, nullptr, lane);
      if (lane == 0) gsc[g] = static_cast<R>(s);
    }
    __syncwarp();
    warp_topk([gsc](int g) { return gsc[g]; }, a.G, a.gk, gsel, lane);
    for (int e = lane; e < a.E; e += 32) {
      const int g = e / per;
      bool keep = false;
      for (int q = 0; q < a.gk; ++q) keep |= gsel[q] == g;
      if (!keep) sel[e] = -INFINITY;
    }
    __syncwarp();
  }
  warp_topk([sel](int e) { return sel[e]; }, a.E, a.k, chosen, lane);
}

template <typename R>
__global__ void topk_routing_kernel(float* __restrict__ probs, int32_t* __restrict__ top, R* __restrict__ aux,
                                    const R* __restrict__ logits, const float* __restrict__ bias, RouteArgs a) {
  extern __shared__ __align__(8) unsigned char route_smem[];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int E = a.E, k = a.k;
  R* s = reinterpret_cast<R*>(route_smem + static_cast<size_t>(wib) * route_bytes<R>(a));
  R* sel = s + E;
  R* gsc = sel + E;
  int* chosen = reinterpret_cast<int*>(gsc + a.G);
  int* gsel = chosen + k;
  const R scaling = static_cast<R>(a.scaling);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * nw + wib; t < a.T; t += static_cast<int64_t>(gridDim.x) * nw) {
    const R* l = logits + t * E;
    // Scores s and selection scores sel.
    if (!a.sigmoid) {
      if (a.pre_softmax || aux != nullptr) warp_softmax(l, s, E, lane);
      __syncwarp();
      const R* src = a.pre_softmax ? s : l;
      for (int e = lane; e < E; e += 32) sel[e] = src[e];
    } else {
      for (int e = lane; e < E; e += 32) {
        const R v = route_sigmoid(l[e]);
        s[e] = v;
        sel[e] = v + (bias != nullptr ? static_cast<R>(bias[e]) : R(0));
      }
    }
    __syncwarp();
    warp_select(sel, a, gsc, gsel, chosen, lane);
    // probs of the selected experts, in selection order (scaled in R, rounded to fp32 once).
    float* p = probs + t * k;
    int32_t* idx = top + t * k;
    if (!a.sigmoid && a.pre_softmax) {
      for (int j = lane; j < k; j += 32) p[j] = static_cast<float>(s[chosen[j]] * scaling);
    } else if (!a.sigmoid) {
      R m = -INFINITY;
      for (int j = lane; j < k; j += 32) m = rmax(m, l[chosen[j]]);
      m = warp_max(m);
      double sum = 0;
      for (int j = lane; j < k; j += 32) sum += exp(static_cast<double>(l[chosen[j]] - m));
      sum = warp_sum_d(sum);
      for (int j = lane; j < k; j += 32) {
        const R v = static_cast<R>(exp(static_cast<double>(l[chosen[j]] - m)) / sum);
        p[j] = static_cast<float>(v * scaling);
      }
    } else {
      double sum = 0;
      for (int j = lane; j < k; j += 32) sum += static_cast<double>(s[chosen[j]]);
      sum = warp_sum_d(sum);
      for (int j = lane; j < k; j += 32) {
        const R v = s[chosen[j]];
        const R q = k > 1 ? static_cast<R>(v / (sum + route_eps<R>())) : v;
        p[j] = static_cast<float>(q * scaling);
      }
    }
    for (int j = lane; j < k; j += 32) idx[j] = chosen[j];
    // Scores of the load-balancing loss.
    if (aux != nullptr) {
      R* A = aux + t * E;
      if (!a.sigmoid) {
        for (int e = lane; e < E; e += 32) A[e] = s[e];
      } else {
        double all = 0;
        for (int e = lane; e < E; e += 32) all += static_cast<double>(s[e]);
        all = warp_sum_d(all);
        for (int e = lane; e < E; e += 32) A[e] = static_cast<R>(s[e] / (all + route_eps<R>()));
      }
    }
    __syncwarp();  // the next token reuses this warp's shared memory
  }
}

/// d_logits of probs. Per-warp shared memory (route_backward_bytes): s[E], val[k] (R), pos[E]
/// (int: the slot j of expert e, or -1).
template <typename R>
__global__ void topk_routing_backward_kernel(R* __restrict__ d_logits, const float* __restrict__ d_probs,
                                             const R* __restrict__ logits, const int32_t* __restrict__ top,
                                             RouteArgs a) {
  extern __shared__ __align__(8) unsigned char route_smem[];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int E = a.E, k = a.k;
  R* s = reinterpret_cast<R*>(route_smem + static_cast<size_t>(wib) * route_backward_bytes<R>(a));
  R* val = s + E;
  int* pos = reinterpret_cast<int*>(val + k);
  const double scaling = a.scaling;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * nw + wib; t < a.T; t += static_cast<int64_t>(gridDim.x) * nw) {
    const R* l = logits + t * E;
    const float* dp = d_probs + t * k;
    const int32_t* sel = top + t * k;
    R* dl = d_logits + t * E;
    for (int e = lane; e < E; e += 32) pos[e] = -1;
    __syncwarp();
    for (int j = lane; j < k; j += 32) {
      const int e = sel[j];
      if (e >= 0 && e < E) pos[e] = j;
    }
    __syncwarp();
    if (!a.sigmoid && !a.pre_softmax) {
      // probs = softmax(l[sel]): d l[sel_j] = p_j (g_j - Σ_i p_i g_i)
      R m = -INFINITY;
      for (int j = lane; j < k; j += 32) m = rmax(m, l[sel[j]]);
      m = warp_max(m);
      double sum = 0;
      for (int j = lane; j < k; j += 32) sum += exp(static_cast<double>(l[sel[j]] - m));
      sum = warp_sum_d(sum);
      double dot = 0;
      for (int j = lane; j < k; j += 32) {
        const R p = static_cast<R>(exp(static_cast<double>(l[sel[j]] - m)) / sum);
        val[j] = p;
        dot += static_cast<double>(p) * (static_cast<double>(dp[j]) * scaling);
      }
      dot = warp_sum_d(dot);
      for (int j = lane; j < k; j += 32)  // each lane rewrites its own val[j]
        val[j] = static_cast<R>(static_cast<double>(val[j]) * (static_cast<double>(dp[j]) * scaling - dot));
      __syncwarp();
      for (int e = lane; e < E; e += 32) dl[e] = pos[e] >= 0 ? val[pos[e]] : R(0);
    } else if (!a.sigmoid) {
      // probs_j = s[sel_j], s = softmax(l): d l = s ⊙ (G - <s, G>)
      warp_softmax(l, s, E, lane);
      __syncwarp();
      double dot = 0;
      for (int e = lane; e < E; e += 32)
        if (pos[e] >= 0) dot += static_cast<double>(s[e]) * (static_cast<double>(dp[pos[e]]) * scaling);
      dot = warp_sum_d(dot);
      for (int e = lane; e < E; e += 32) {
        const double g = pos[e] >= 0 ? static_cast<double>(dp[pos[e]]) * scaling : 0.0;
        dl[e] = static_cast<R>(static_cast<double>(s[e]) * (g - dot));
      }
    } else {
      // probs_j = σ_j / (S + eps) (k > 1) or σ_j
      double S = 0, dot = 0;
      for (int j = lane; j < k; j += 32) {
        const double sg = route_sigmoid(l[sel[j]]);
        S += sg;
        dot += static_cast<double>(dp[j]) * scaling * sg;
      }
      S = warp_sum_d(S);
      dot = warp_sum_d(dot);
      const double Sp = S + route_eps<R>();
      for (int j = lane; j < k; j += 32) {
        const double g = static_cast<double>(dp[j]) * scaling;
        const double sj = route_sigmoid(l[sel[j]]);
        const double ds = k > 1 ? g / Sp - dot / (Sp * Sp) : g;
        val[j] = static_cast<R>(ds * sj * (1.0 - sj));
      }
      __syncwarp();
      for (int e = lane; e < E; e += 32) dl[e] = pos[e] >= 0 ? val[pos[e]] : R(0);
    }
    __syncwarp();
  }
}

/// d_logits += d(scale · loss_scale · Σ_e scores[e] · tpe[t mod G, e]) / d logits, per token; s[E]
/// (R) per warp.
template <typename R>
__global__ void aux_scores_backward_kernel(R* __restrict__ d_logits, const R* __restrict__ logits,
                                           const float* __restrict__ tokens_per_expert, int64_t G, float scale,
                                           const float* __restrict__ loss_scale, int64_t T, int E, bool sigmoid) {
  extern __shared__ __align__(8) unsigned char route_smem[];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, nw = blockDim.x >> 5;
  R* s = reinterpret_cast<R*>(route_smem) + static_cast<size_t>(wib) * E;
  // the CPU's coefficient: cs · tpe[e] in R
  const R cs = static_cast<R>(scale) * static_cast<R>(loss_scale != nullptr ? *loss_scale : 1.f);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * nw + wib; t < T; t += static_cast<int64_t>(gridDim.x) * nw) {
    const R* l = logits + t * E;
    R* dl = d_logits + t * E;
    const float* tpe = tokens_per_expert + (t % G) * E;
    if (!sigmoid) {
      warp_softmax(l, s, E, lane);
      __syncwarp();
      double dot = 0;
      for (int e = lane; e < E; e += 32) dot += static_cast<double>(s[e]) * (cs * static_cast<R>(tpe[e]));
      dot = warp_sum_d(dot);
      for (int e = lane; e < E; e += 32) {
        const double c = cs * static_cast<R>(tpe[e]);
        dl[e] += static_cast<R>(static_cast<double>(s[e]) * (c - dot));
      }
    } else {
      double S = 0, dot = 0;
      for (int e = lane; e < E; e += 32) {
        const R v = route_sigmoid(l[e]);
        s[e] = v;
        S += static_cast<double>(v);
        dot += static_cast<double>(v) * (cs * static_cast<R>(tpe[e]));
      }
      S = warp_sum_d(S);
      dot = warp_sum_d(dot);
      const double Sp = S + route_eps<R>();
      for (int e = lane; e < E; e += 32) {  // s[e] was written by this lane
        const double se = s[e], c = cs * static_cast<R>(tpe[e]);
        dl[e] += static_cast<R>((c / Sp - dot / (Sp * Sp)) * se * (1.0 - se));
      }
    }
    __syncwarp();
  }
}

// ---- loss values -----------------------------------------------------------------------------

/// Pass-1 blocks for T token rows: a function of T only (so the summation order is too).
unsigned partial_blocks(int64_t T) {
  return static_cast<unsigned>(std::clamp<int64_t>((T + kRowWarps - 1) / kRowWarps, 1, kMaxPartials));
}

/// partial[block] = Σ over the block's tokens of Σ_e scores[t, e] · tpe[t mod G, e] (double).
template <typename R>
__global__ void __launch_bounds__(kRowThreads)
    aux_loss_partial_kernel(double* __restrict__ partial, const R* __restrict__ scores,
                            const float* __restrict__ tokens_per_expert, int64_t G, int64_t T, int E) {
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  double acc = 0;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kRowWarps + wib; t < T;
       t += static_cast<int64_t>(gridDim.x) * kRowWarps) {
    const R* r = scores + t * E;
    const float* tpe = tokens_per_expert + (t % G) * E;
    for (int e = lane; e < E; e += 32) acc += static_cast<double>(r[e]) * static_cast<double>(tpe[e]);
  }
  const double s = block_sum_d(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

/// z-loss: per token lse = logsumexp(logits[t]) (the CPU's: max in R, double sum); partial[block]
/// = Σ lse² over the block's tokens (when partial is given); d_logits += scale · loss_scale · 2 ·
/// lse · softmax (when given).
template <typename R>
__global__ void __launch_bounds__(kRowThreads)
    z_loss_kernel(double* __restrict__ partial, R* __restrict__ d_logits, const R* __restrict__ logits,
                  int64_t T, int E, float scale, const float* __restrict__ loss_scale) {
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  const double gscale = static_cast<double>(scale) * (loss_scale != nullptr ? *loss_scale : 1.f);
  double acc = 0;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kRowWarps + wib; t < T;
       t += static_cast<int64_t>(gridDim.x) * kRowWarps) {
    const R* l = logits + t * E;
    RowExp<R> r;
    warp_row_exp(l, E, lane, r);
    const double lse = static_cast<double>(r.m) + log(r.s);
    if (lane == 0) acc += lse * lse;
    if (d_logits != nullptr) {  // ∂ lse² / ∂ l = 2 · lse · softmax(l)
      R* dl = d_logits + t * E;
      const double g = gscale * 2.0 * lse / r.s;
      for_each_exp(r, l, E, lane, [&](int e, double v) { dl[e] += static_cast<R>(g * v); });
    }
  }
  if (partial == nullptr) return;  // uniform over the block
  const double s = block_sum_d(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

/// loss[0] += float(scale · Σ partial[0..n)) (one block, fixed order).
__global__ void __launch_bounds__(kRowThreads)
    finish_loss_kernel(float* __restrict__ loss, const double* __restrict__ partial, int n, float scale) {
  double acc = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  const double s = block_sum_d(acc);
  if (threadIdx.x == 0) loss[0] += static_cast<float>(static_cast<double>(scale) * s);
}

/// Scratch for the two-pass reductions and the routing map: the stream's cuBLASLt workspace. Every
/// user of it runs in the stream's order, so a kernel here never overlaps a GEMM that uses it.
void* stream_scratch(const Stream& stream, size_t bytes, const char* fn) {
  MT_CHECK(stream.cuda() != nullptr && stream.cuda()->workspace != nullptr, "{}: needs a CUDA stream", fn);
  MT_CHECK(bytes <= CudaStreamResources::kWorkspaceBytes, "{}: needs {} bytes of scratch, more than the stream's {}",
           fn, bytes, CudaStreamResources::kWorkspaceBytes);
  return stream.cuda()->workspace;
}

// ---- tokens per expert -------------------------------------------------------------------------

/// counts[(t mod G) · E + top[t, j]] += 1 for the entries i = t·k + j of top (integer atomics: exact in
/// any order), through a shared-memory histogram of the G·E bins when kShared.
template <bool kShared>
__global__ void histogram_kernel(int* __restrict__ counts, const int32_t* __restrict__ top, int64_t n, int k, int G,
                                 int E) {
  extern __shared__ int hist[];
  const int bins = G * E;
  if constexpr (kShared) {
    for (int b = threadIdx.x; b < bins; b += blockDim.x) hist[b] = 0;
    __syncthreads();
  }
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = top[i];
    if (e < 0 || e >= E) continue;
    const int b = (G > 1 ? static_cast<int>((i / k) % G) * E : 0) + e;
    atomicAdd(kShared ? &hist[b] : &counts[b], 1);
  }
  if constexpr (kShared) {
    __syncthreads();
    for (int b = threadIdx.x; b < bins; b += blockDim.x)
      if (hist[b] != 0) atomicAdd(&counts[b], hist[b]);
  }
}

/// expert_bias[e] += rate · sign(mean - tokens_per_expert[e]), the mean summed in expert order in
/// double (as the CPU does); one block.
__global__ void expert_bias_update_kernel(float* __restrict__ bias, const float* __restrict__ tpe, int E, float rate) {
  __shared__ float mean;
  if (threadIdx.x == 0) {
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += static_cast<double>(tpe[e]);
    mean = static_cast<float>(sum / static_cast<double>(E));
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const float d = mean - tpe[e];
    bias[e] += rate * static_cast<float>((d > 0.f) - (d < 0.f));
  }
}

/// acc[e] += counts[e], acc[E] += 1, avg[e] = acc[e] / acc[E]; one block.
__global__ void global_tokens_kernel(float* __restrict__ avg, float* __restrict__ acc, const float* __restrict__ counts,
                                     int E) {
  const float steps = acc[E] + 1.f;  // every thread reads acc[E] before thread 0 writes it
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const float a = acc[e] + counts[e];
    acc[e] = a;
    avg[e] = __fdiv_rn(a, steps);
  }
  __syncthreads();
  if (threadIdx.x == 0) acc[E] = steps;
}

/// counts[i] (int32 bits) -> float, in place.
__global__ void int_to_float_kernel(float* counts, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    counts[i] = static_cast<float>(reinterpret_cast<const int*>(counts)[i]);
}

// ---- routing map -------------------------------------------------------------------------------

/// (1) blocks[e * B + b] = slots of local expert e in chunk b.
__global__ void __launch_bounds__(kMapThreads)
    map_count_kernel(int* __restrict__ blocks, const int32_t* __restrict__ top, int64_t n, int first, int L, int B) {
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < L; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kMapChunk;
  for (int q = threadIdx.x; q < kMapChunk; q += blockDim.x) {
    const int64_t i = base + q;
    if (i >= n) break;
    const int e = top[i] - first;
    if (e >= 0 && e < L) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < L; e += blockDim.x) blocks[static_cast<int64_t>(e) * B + blockIdx.x] = hist[e];
}

/// (2) Block e: blocks[e, :] = its exclusive prefix over the chunks; counts[e] = the total.
__global__ void __launch_bounds__(kMapThreads) map_scan_kernel(int* __restrict__ blocks, int32_t* __restrict__ counts,
                                                               int B) {
  int* row = blocks + static_cast<int64_t>(blockIdx.x) * B;
  int carry = 0;
  for (int b0 = 0; b0 < B; b0 += blockDim.x) {
    const int b = b0 + threadIdx.x;
    const int v = b < B ? row[b] : 0;
    int total;
    const int p = block_exclusive_scan(v, &total);
    if (b < B) row[b] = carry + p;
    carry += total;
  }
  if (threadIdx.x == 0) counts[blockIdx.x] = carry;
}

/// (3) Block b places the local slots of its chunk: row_index[row] = slot for row < cap. kFused
/// (a single chunk): computes and writes counts itself (no blocks[] input). Shared memory: wc[W][L]
/// (per-warp counts, then per-warp start rows), base[L].
template <bool kFused>
__global__ void __launch_bounds__(kMapThreads)
    map_place_kernel(int32_t* __restrict__ row_index, int64_t cap, int32_t* __restrict__ counts,
                     const int* __restrict__ blocks, const int32_t* __restrict__ top, int64_t n, int first, int L,
                     int B) {
  extern __shared__ int sm[];
  int* wc = sm;
  int* base = sm + kMapWarps * L;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  for (int q = threadIdx.x; q < kMapWarps * L; q += blockDim.x) wc[q] = 0;
  __syncthreads();
  // Ranks within the warp: rounds in slot order, lanes of one expert ranked by lane.
  const int64_t wbase = static_cast<int64_t>(blockIdx.x) * kMapChunk + static_cast<int64_t>(w) * 32 * kMapItems;
  int* mine = wc + w * L;
  int item[kMapItems], rank[kMapItems];
  const unsigned lt = (1u << lane) - 1u;
#pragma unroll
  for (int r = 0; r < kMapItems; ++r) {
    const int64_t i = wbase + r * 32 + lane;
    int e = i < n ? top[i] - first : -1;
    if (e < 0 || e >= L) e = -1;
    item[r] = e;
    const unsigned peers = __match_any_sync(kFull, e);
    rank[r] = e >= 0 ? mine[e] + __popc(peers & lt) : 0;
    __syncwarp();
    if (e >= 0 && lane == __ffs(peers) - 1) mine[e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  // base[e] = first row of expert e in this chunk.
  int carry = 0;
  for (int e0 = 0; e0 < L; e0 += blockDim.x) {
    const int e = e0 + threadIdx.x;
    int v = 0;
    if (e < L) {
      if constexpr (kFused) {
        for (int q = 0; q < kMapWarps; ++q) v += wc[q * L + e];
        counts[e] = v;
      } else {
        v = counts[e];
      }
    }
    int total;
    const int p = block_exclusive_scan(v, &total);
    if (e < L) {
      if constexpr (kFused) {
        base[e] = carry + p;
      } else {
        base[e] = carry + p + blocks[static_cast<int64_t>(e) * B + blockIdx.x];
      }
    }
    carry += total;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < L; e += blockDim.x) {  // per-warp start rows, warps in slot order
    int run = base[e];
    for (int q = 0; q < kMapWarps; ++q) {
      const int c = wc[q * L + e];
      wc[q * L + e] = run;
      run += c;
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kMapItems; ++r) {
    if (item[r] < 0) continue;
    const int64_t row = static_cast<int64_t>(mine[item[r]]) + rank[r];
    if (row < cap) row_index[row] = static_cast<int32_t>(wbase + r * 32 + lane);
  }
}

/// (4) slot_row: -1 for slots of other experts, and slot_row[row_index[r]] = r for r < R (disjoint
/// writes).
__global__ void map_slot_row_kernel(int32_t* __restrict__ slot_row, const int32_t* __restrict__ row_index,
                                    const int32_t* __restrict__ top, int64_t n, int64_t R, int first, int L) {
  const int64_t m = n > R ? n : R;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < m;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < n) {
      const int e = top[i] - first;
      if (e < 0 || e >= L) slot_row[i] = -1;
    }
    if (i < R) slot_row[row_index[i]] = static_cast<int32_t>(i);
  }
}

// ---- permutation -------------------------------------------------------------------------------

/// rows[r] = x[row_index[r] / k] (rows with row_index[r] < 0 untouched): raw words of type W, one
/// warp per row.
template <typename W>
__global__ void __launch_bounds__(kRowThreads)
    permute_kernel(W* __restrict__ rows, const W* __restrict__ x, const int32_t* __restrict__ row_index, int64_t R,
                   int64_t words, int k) {
  const int lane = threadIdx.x & 31;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * kRowWarps;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5); r < R; r += nw) {
    const int32_t i = row_index[r];
    if (i < 0) continue;  // beyond the routed rows (moe_routing_map_device): untouched
    const W* src = x + static_cast<int64_t>(i / k) * words;
    W* dst = rows + r * words;
    for (int64_t c = lane; c < words; c += 32) dst[c] = src[c];
  }
}

/// dx[t] = Σ_j d_rows[slot_row[t·k + j]] (j order, fp32), one warp per token; hv = h / V vectors.
template <int V, typename T>
__global__ void __launch_bounds__(kRowThreads)
    permute_backward_kernel(T* __restrict__ dx, const T* __restrict__ d_rows, const int32_t* __restrict__ slot_row,
                            int64_t N, int64_t hv, int k, int64_t R) {
  const int lane = threadIdx.x & 31;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * kRowWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5); t < N; t += nw) {
    const int32_t* sr = slot_row + t * k;
    for (int64_t c = lane; c < hv; c += 32) {
      float acc[V];
#pragma unroll
      for (int q = 0; q < V; ++q) acc[q] = 0.f;
      for (int j = 0; j < k; ++j) {
        const int64_t r = sr[j];
        if (r < 0 || r >= R) continue;
        const Vec<T, V> v = reinterpret_cast<const Vec<T, V>*>(d_rows)[r * hv + c];
#pragma unroll
        for (int q = 0; q < V; ++q) acc[q] += to_f32(v.v[q]);
      }
      Vec<T, V> o;
#pragma unroll
      for (int q = 0; q < V; ++q) o.v[q] = from_f32<T>(acc[q]);
      reinterpret_cast<Vec<T, V>*>(dx)[t * hv + c] = o;
    }
  }
}

/// y[t] = Σ_j probs[t, j] · rows[slot_row[t·k + j]] (j order, fp32), one warp per token.
template <int V, typename T>
__global__ void __launch_bounds__(kRowThreads)
    unpermute_kernel(T* __restrict__ y, const T* __restrict__ rows, const float* __restrict__ probs,
                     const int32_t* __restrict__ slot_row, int64_t N, int64_t hv, int k, int64_t R) {
  const int lane = threadIdx.x & 31;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * kRowWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5); t < N; t += nw) {
    const int32_t* sr = slot_row + t * k;
    const float* pt = probs + t * k;
    for (int64_t c = lane; c < hv; c += 32) {
      float acc[V];
#pragma unroll
      for (int q = 0; q < V; ++q) acc[q] = 0.f;
      for (int j = 0; j < k; ++j) {
        const int64_t r = sr[j];
        if (r < 0 || r >= R) continue;
        const float p = pt[j];
        const Vec<T, V> v = reinterpret_cast<const Vec<T, V>*>(rows)[r * hv + c];
#pragma unroll
        for (int q = 0; q < V; ++q) acc[q] = fmaf(p, to_f32(v.v[q]), acc[q]);
      }
      Vec<T, V> o;
#pragma unroll
      for (int q = 0; q < V; ++q) o.v[q] = from_f32<T>(acc[q]);
      reinterpret_cast<Vec<T, V>*>(y)[t * hv + c] = o;
    }
  }
}

/// One warp per flat slot i: r = slot_row[i]; d_rows[r] = probs[i] · dy[i / k] and d_probs[i] =
/// <dy[i / k], rows[r]> (per-lane fp32 sums, then a warp butterfly); d_probs[i] = 0 when r < 0.
template <int V, typename T>
__global__ void __launch_bounds__(kRowThreads)
    unpermute_backward_kernel(T* __restrict__ d_rows, float* __restrict__ d_probs, const T* __restrict__ dy,
                              const T* __restrict__ rows, const float* __restrict__ probs,
                              const int32_t* __restrict__ slot_row, int64_t n, int64_t hv, int k, int64_t R) {
  const int lane = threadIdx.x & 31;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * kRowWarps;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5); i < n; i += nw) {
    const int64_t r = slot_row[i];
    if (r < 0 || r >= R) {  // uniform over the warp
      if (lane == 0) d_probs[i] = 0.f;
      continue;
    }
    const float p = probs[i];
    const Vec<T, V>* g = reinterpret_cast<const Vec<T, V>*>(dy) + (i / k) * hv;
    const Vec<T, V>* x = reinterpret_cast<const Vec<T, V>*>(rows) + r * hv;
    Vec<T, V>* d = reinterpret_cast<Vec<T, V>*>(d_rows) + r * hv;
    float dot = 0.f;
    for (int64_t c = lane; c < hv; c += 32) {
      const Vec<T, V> gv = g[c], xv = x[c];
      Vec<T, V> o;
#pragma unroll
      for (int q = 0; q < V; ++q) {
        const float gf = to_f32(gv.v[q]);
        o.v[q] = from_f32<T>(p * gf);
        dot = fmaf(gf, to_f32(xv.v[q]), dot);
      }
      d[c] = o;
    }
    dot = ew::warp_sum(dot);
    if (lane == 0) d_probs[i] = dot;
  }
}

/// d_rows[r] = 0 for the rows with row_index[r] < 0 (raw words of type W, one warp per row); the
/// other rows are left to unpermute_backward_kernel.
template <typename W>
__global__ void __launch_bounds__(kRowThreads)
    zero_unmapped_rows_kernel(W* __restrict__ d_rows, const int32_t* __restrict__ row_index, int64_t R,
                              int64_t words) {
  const int lane = threadIdx.x & 31;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * kRowWarps;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5); r < R; r += nw) {
    if (row_index[r] >= 0) continue;
    W* dst = d_rows + r * words;
    for (int64_t c = lane; c < words; c += 32) dst[c] = W{};
  }
}

// ---- launch helpers ----------------------------------------------------------------------------

/// Opts `kernel` in to `smem` bytes of dynamic shared memory when that exceeds the default 48 KiB.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t smem, const char* fn, const char* what) {
  if (smem <= kDefaultSmem) return;
  int dev = 0, max_optin = 0;
  MT_CUDA_CHECK(cudaGetDevice(&dev));
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  MT_CHECK(smem <= static_cast<size_t>(max_optin), "{}: {} needs {} bytes of shared memory, more than the device's {}",
           fn, what, smem, max_optin);
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
}

/// Warps per block (4, halved while the per-warp shared memory exceeds the default) and bytes.
template <typename Kernel>
std::pair<int, size_t> warp_row_config(Kernel kernel, size_t per_warp_bytes, const char* fn, int64_t E) {
  int warps = 4;
  while (warps > 1 && warps * per_warp_bytes > kDefaultSmem) warps /= 2;
  const size_t smem = warps * per_warp_bytes;
  allow_smem(kernel, smem, fn, fmt::format("a token row of {} experts", E).c_str());
  return {warps, smem};
}

/// Blocks for `rows` warp-rows of `warps`-warp blocks (grid-stride beyond 8 blocks per SM of 256
/// threads, i.e. 64 warps per SM).
unsigned row_grid(int64_t rows, int warps, const Stream& stream) {
  return ew::grid_for(rows, warps, stream, 8 * kRowWarps / warps);
}

RouteArgs route_args(const Tensor& logits, const MoeRouterOptions& o) {
  const int64_t E = logits.size(1);
  MT_CHECK(E <= INT32_MAX / 8, "moe routing: {} experts exceed the CUDA kernels' range", E);
  return RouteArgs{logits.size(0),          static_cast<int>(E),          static_cast<int>(o.topk),
                   o.sigmoid,               o.pre_softmax,                o.scaling_factor,
                   static_cast<int>(o.num_groups > 0 ? o.num_groups : 0),
                   static_cast<int>(o.num_groups > 0 ? o.group_topk : 0)};
}

const float* opt_f32(const Tensor& t) { return t.empty() ? nullptr : t.data_as<float>(); }

/// Calls f(TypeTag<R>{}) with the routing dtype of `t`: float, or double for fp64 (--moe-router-dtype).
template <typename F>
void dispatch_route(const Tensor& t, F&& f) {
  if (t.dtype() == DType::kF64) {
    f(ew::TypeTag<double>{});
  } else {
    f(ew::TypeTag<float>{});
  }
}

/// Calls f(integral_constant<int, V>) with the 16-byte vector width when h is a multiple of it and
/// every pointer is 16-byte aligned, else 1.
template <int V, typename F>
void dispatch_vec(int64_t h, std::initializer_list<const void*> ptrs, F&& f) {
  bool vec = h % V == 0;
  for (const void* p : ptrs) vec = vec && ew::aligned16(p);
  if (vec) {
    f(std::integral_constant<int, V>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

}  // namespace

// ---- entry points ------------------------------------------------------------------------------

void moe_topk_routing(const Tensor& probs, const Tensor& top, const Tensor& scores_for_aux, const Tensor& logits,
                      const Tensor& expert_bias, const MoeRouterOptions& options, const Stream& stream) {
  const char* fn = "moe_topk_routing";
  const RouteArgs a = route_args(logits, options);
  if (a.T == 0) return;
  dispatch_route(logits, [&](auto tag) {
    using R = typename decltype(tag)::type;
    const auto [warps, smem] = warp_row_config(topk_routing_kernel<R>, route_bytes<R>(a), fn, a.E);
    topk_routing_kernel<R><<<row_grid(a.T, warps, stream), warps * 32, smem, raw(stream)>>>(
        probs.data_as<float>(), top.data_as<int32_t>(), scores_for_aux.empty() ? nullptr : scores_for_aux.data_as<R>(),
        logits.data_as<R>(), opt_f32(expert_bias), a);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_topk_routing_backward(const Tensor& d_logits, const Tensor& d_probs, const Tensor& logits, const Tensor& top,
                               const MoeRouterOptions& options, const Stream& stream) {
  const char* fn = "moe_topk_routing_backward";
  const RouteArgs a = route_args(logits, options);
  if (a.T == 0) return;
  dispatch_route(logits, [&](auto tag) {
    using R = typename decltype(tag)::type;
    const auto [warps, smem] = warp_row_config(topk_routing_backward_kernel<R>, route_backward_bytes<R>(a), fn, a.E);
    topk_routing_backward_kernel<R><<<row_grid(a.T, warps, stream), warps * 32, smem, raw(stream)>>>(
        d_logits.data_as<R>(), d_probs.data_as<float>(), logits.data_as<R>(), top.data_as<int32_t>(), a);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_aux_loss(const Tensor& loss, const Tensor& scores, const Tensor& tokens_per_expert, float scale,
                  const Stream& stream) {
  const int64_t T = scores.size(0), E = scores.size(1);
  if (T == 0) return;
  const unsigned nb = partial_blocks(T);
  auto* partial = static_cast<double*>(stream_scratch(stream, nb * sizeof(double), "moe_aux_loss"));
  dispatch_route(scores, [&](auto tag) {
    using R = typename decltype(tag)::type;
    aux_loss_partial_kernel<R><<<nb, kRowThreads, 0, raw(stream)>>>(
        partial, scores.data_as<R>(), tokens_per_expert.data_as<float>(), tokens_per_expert.numel() / E, T,
        static_cast<int>(E));
  });
  MT_CUDA_CHECK_LAUNCH();
  finish_loss_kernel<<<1, kRowThreads, 0, raw(stream)>>>(loss.data_as<float>(), partial, static_cast<int>(nb), scale);
  MT_CUDA_CHECK_LAUNCH();
}

void moe_aux_scores_backward(const Tensor& d_logits, const Tensor& logits, const Tensor& tokens_per_expert,
                             float scale, const Tensor& loss_scale, bool sigmoid, const Stream& stream) {
  const char* fn = "moe_aux_scores_backward";
  const int64_t T = logits.size(0), E = logits.size(1);
  if (T == 0) return;
  dispatch_route(logits, [&](auto tag) {
    using R = typename decltype(tag)::type;
    const auto [warps, smem] = warp_row_config(aux_scores_backward_kernel<R>, static_cast<size_t>(E) * sizeof(R), fn, E);
    aux_scores_backward_kernel<R><<<row_grid(T, warps, stream), warps * 32, smem, raw(stream)>>>(
        d_logits.data_as<R>(), logits.data_as<R>(), tokens_per_expert.data_as<float>(), tokens_per_expert.numel() / E,
        scale, opt_f32(loss_scale), T, static_cast<int>(E), sigmoid);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_z_loss(const Tensor& loss, const Tensor& d_logits, const Tensor& logits, float scale,
                const Tensor& loss_scale, const Stream& stream) {
  const int64_t T = logits.size(0), E = logits.size(1);
  if (T == 0 || (loss.empty() && d_logits.empty())) return;
  const unsigned nb = partial_blocks(T);
  double* partial =
      loss.empty() ? nullptr : static_cast<double*>(stream_scratch(stream, nb * sizeof(double), "moe_z_loss"));
  dispatch_route(logits, [&](auto tag) {
    using R = typename decltype(tag)::type;
    z_loss_kernel<R><<<nb, kRowThreads, 0, raw(stream)>>>(partial, d_logits.empty() ? nullptr : d_logits.data_as<R>(),
                                                          logits.data_as<R>(), T, static_cast<int>(E), scale,
                                                          opt_f32(loss_scale));
  });
  MT_CUDA_CHECK_LAUNCH();
  if (partial != nullptr) {
    finish_loss_kernel<<<1, kRowThreads, 0, raw(stream)>>>(loss.data_as<float>(), partial, static_cast<int>(nb),
                                                            scale);
    MT_CUDA_CHECK_LAUNCH();
  }
}

void moe_tokens_per_expert(const Tensor& counts, const Tensor& top, const Stream& stream) {
  const int64_t n = counts.numel(), E = counts.size(-1), entries = top.numel();
  if (n == 0 || E == 0) return;
  const int64_t G = n / E, k = top.size(-1);
  MT_CHECK(n <= INT32_MAX && k <= INT32_MAX, "moe_tokens_per_expert: {} counts exceed the CUDA kernels' range", n);
  MT_CUDA_CHECK(cudaMemsetAsync(counts.data(), 0, static_cast<size_t>(n) * 4, raw(stream)));
  if (entries > 0) {
    constexpr int kThreads = 256;
    const unsigned grid = ew::grid_for(entries, kThreads, stream, 4);
    int* c = static_cast<int*>(counts.data());
    const size_t smem = static_cast<size_t>(n) * 4;
    const int32_t* tp = top.data_as<int32_t>();
    const int ki = static_cast<int>(k), gi = static_cast<int>(G), ei = static_cast<int>(E);
    if (smem <= kDefaultSmem) {
      histogram_kernel<true><<<grid, kThreads, smem, raw(stream)>>>(c, tp, entries, ki, gi, ei);
    } else {
      histogram_kernel<false><<<grid, kThreads, 0, raw(stream)>>>(c, tp, entries, ki, gi, ei);
    }
    MT_CUDA_CHECK_LAUNCH();
  }
  int_to_float_kernel<<<ew::grid_for(n, 256, stream, 1), 256, 0, raw(stream)>>>(counts.data_as<float>(),
                                                                                 static_cast<int>(n));
  MT_CUDA_CHECK_LAUNCH();
}

void moe_global_tokens_per_expert(const Tensor& average, const Tensor& accumulator, const Tensor& counts,
                                  const Stream& stream) {
  const int64_t E = average.numel();
  MT_CHECK(E <= INT32_MAX, "moe_global_tokens_per_expert: {} experts exceed the CUDA kernel's range", E);
  global_tokens_kernel<<<1, 256, 0, raw(stream)>>>(average.data_as<float>(), accumulator.data_as<float>(),
                                                   counts.data_as<float>(), static_cast<int>(E));
  MT_CUDA_CHECK_LAUNCH();
}

void moe_expert_bias_update(const Tensor& expert_bias, const Tensor& tokens_per_expert, float rate,
                            const Stream& stream) {
  const int64_t E = expert_bias.numel();
  if (E == 0) return;
  MT_CHECK(E <= INT32_MAX, "moe_expert_bias_update: {} experts exceed the CUDA kernel's range", E);
  expert_bias_update_kernel<<<1, 256, 0, raw(stream)>>>(expert_bias.data_as<float>(),
                                                        tokens_per_expert.data_as<float>(), static_cast<int>(E), rate);
  MT_CUDA_CHECK_LAUNCH();
}

namespace {
/// Steps (1)-(3) of the routing map: counts (device) and row_index[row] = slot for row < cap.
void map_place(int32_t* ri, int64_t cap, int32_t* cnt, const int32_t* tp, int64_t n, int first, int L,
               const Stream& stream, const char* fn) {
  cudaStream_t s = raw(stream);
  const int64_t B = (n + kMapChunk - 1) / kMapChunk;
  const size_t place_smem = static_cast<size_t>(kMapWarps + 1) * L * 4;
  if (B == 1) {
    allow_smem(map_place_kernel<true>, place_smem, fn, fmt::format("{} local experts", L).c_str());
    map_place_kernel<true><<<1, kMapThreads, place_smem, s>>>(ri, cap, cnt, nullptr, tp, n, first, L, 1);
    MT_CUDA_CHECK_LAUNCH();
  } else {
    int* blocks = static_cast<int*>(stream_scratch(stream, static_cast<size_t>(L) * B * 4, fn));
    const size_t count_smem = static_cast<size_t>(L) * 4;
    allow_smem(map_count_kernel, count_smem, fn, fmt::format("{} local experts", L).c_str());
    allow_smem(map_place_kernel<false>, place_smem, fn, fmt::format("{} local experts", L).c_str());
    const unsigned nb = static_cast<unsigned>(B);
    map_count_kernel<<<nb, kMapThreads, count_smem, s>>>(blocks, tp, n, first, L, static_cast<int>(B));
    MT_CUDA_CHECK_LAUNCH();
    map_scan_kernel<<<static_cast<unsigned>(L), kMapThreads, 0, s>>>(blocks, cnt, static_cast<int>(B));
    MT_CUDA_CHECK_LAUNCH();
    map_place_kernel<false><<<nb, kMapThreads, place_smem, s>>>(ri, cap, cnt, blocks, tp, n, first, L,
                                                                static_cast<int>(B));
    MT_CUDA_CHECK_LAUNCH();
  }
}

/// (4') slot_row[row_index[r]] = r for the rows r < cap with row_index[r] >= 0 (slot_row preset to -1).
__global__ void map_slot_row_device_kernel(int32_t* __restrict__ slot_row, const int32_t* __restrict__ row_index,
                                           int64_t cap) {
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < cap;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t i = row_index[r];
    if (i >= 0) slot_row[i] = static_cast<int32_t>(r);
  }
}

void check_map_range(int64_t n, int64_t first_expert, int64_t num_local, const char* fn) {
  MT_CHECK(n <= INT32_MAX && first_expert <= INT32_MAX && num_local <= INT32_MAX,
           "{}: {} slots, experts [{}, {}) exceed the int32 range of the maps", fn, n, first_expert,
           first_expert + num_local);
}
}  // namespace

std::vector<int64_t> moe_routing_map(const Tensor& row_index, const Tensor& slot_row, const Tensor& counts,
                                     const Tensor& top, int64_t first_expert, int64_t num_local,
                                     const Stream& stream) {
  const char* fn = "moe_routing_map";
  const int64_t n = top.numel(), cap = row_index.numel();
  check_map_range(n, first_expert, num_local, fn);
  const int L = static_cast<int>(num_local), first = static_cast<int>(first_expert);
  cudaStream_t s = raw(stream);
  if (n == 0) {
    MT_CUDA_CHECK(cudaMemsetAsync(counts.data(), 0, static_cast<size_t>(L) * 4, s));
    return std::vector<int64_t>(static_cast<size_t>(L), 0);
  }
  int32_t* ri = row_index.data_as<int32_t>();
  int32_t* cnt = counts.data_as<int32_t>();
  const int32_t* tp = top.data_as<int32_t>();
  map_place(ri, cap, cnt, tp, n, first, L, stream, fn);
  // The one host synchronisation: the counts decide the expert GEMM shapes.
  std::vector<int32_t> host(static_cast<size_t>(L));
  MT_CUDA_CHECK(cudaMemcpyAsync(host.data(), cnt, static_cast<size_t>(L) * 4, cudaMemcpyDeviceToHost, s));
  MT_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<int64_t> out(host.begin(), host.end());
  int64_t R = 0;
  for (int64_t c : out) R += c;
  MT_CHECK(R <= cap, "moe_routing_map: {} rows exceed the planned {}", R, cap);
  map_slot_row_kernel<<<ew::grid_for(std::max(n, R), 256, stream, 8), 256, 0, s>>>(slot_row.data_as<int32_t>(), ri,
                                                                                   tp, n, R, first, L);
  MT_CUDA_CHECK_LAUNCH();
  return out;
}

void moe_routing_map_device(const Tensor& row_index, const Tensor& slot_row, const Tensor& counts, const Tensor& top,
                            int64_t first_expert, int64_t num_local, const Stream& stream) {
  const char* fn = "moe_routing_map_device";
  const int64_t n = top.numel(), cap = row_index.numel();
  check_map_range(n, first_expert, num_local, fn);
  const int L = static_cast<int>(num_local), first = static_cast<int>(first_expert);
  cudaStream_t s = raw(stream);
  // Every row and slot starts unassigned (-1: all bytes 0xff); the place kernel fills the routed rows.
  if (cap > 0) MT_CUDA_CHECK(cudaMemsetAsync(row_index.data(), 0xff, static_cast<size_t>(cap) * 4, s));
  if (n > 0) MT_CUDA_CHECK(cudaMemsetAsync(slot_row.data(), 0xff, static_cast<size_t>(n) * 4, s));
  if (n == 0) {
    MT_CUDA_CHECK(cudaMemsetAsync(counts.data(), 0, static_cast<size_t>(L) * 4, s));
    return;
  }
  int32_t* ri = row_index.data_as<int32_t>();
  map_place(ri, cap, counts.data_as<int32_t>(), top.data_as<int32_t>(), n, first, L, stream, fn);
  if (cap > 0) {
    map_slot_row_device_kernel<<<ew::grid_for(cap, 256, stream, 8), 256, 0, s>>>(slot_row.data_as<int32_t>(), ri,
                                                                                 cap);
    MT_CUDA_CHECK_LAUNCH();
  }
}

void moe_permute(const Tensor& rows, const Tensor& x, const Tensor& row_index, int64_t topk, const Stream& stream) {
  const int64_t R = rows.size(0);
  const int64_t bytes = rows.size(1) * static_cast<int64_t>(dtype_size(rows.dtype()));
  if (R == 0 || bytes == 0) return;
  const auto go = [&](auto word) {
    using W = decltype(word);
    const int64_t words = bytes / static_cast<int64_t>(sizeof(W));
    permute_kernel<W><<<row_grid(R, kRowWarps, stream), kRowThreads, 0, raw(stream)>>>(
        static_cast<W*>(rows.data()), static_cast<const W*>(x.data()), row_index.data_as<int32_t>(), R, words,
        static_cast<int>(topk));
    MT_CUDA_CHECK_LAUNCH();
  };
  const auto fits = [&](size_t w) {
    return bytes % static_cast<int64_t>(w) == 0 && reinterpret_cast<uintptr_t>(rows.data()) % w == 0 &&
           reinterpret_cast<uintptr_t>(x.data()) % w == 0;
  };
  if (fits(16)) {
    go(uint4{});
  } else if (fits(8)) {
    go(uint2{});
  } else if (fits(4)) {
    go(uint32_t{});
  } else if (fits(2)) {
    go(uint16_t{});
  } else {
    go(uint8_t{});
  }
}

void moe_permute_backward(const Tensor& dx, const Tensor& d_rows, const Tensor& slot_row, int64_t topk,
                          const Stream& stream) {
  const int64_t N = dx.size(0), h = dx.size(1), R = d_rows.size(0);
  if (N == 0 || h == 0) return;
  ew::dispatch_float(dx.dtype(), "moe_permute_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_vec<ew::kVec16<T>>(h, {dx.data(), d_rows.data()}, [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      permute_backward_kernel<V, T><<<row_grid(N, kRowWarps, stream), kRowThreads, 0, raw(stream)>>>(
          static_cast<T*>(dx.data()), static_cast<const T*>(d_rows.data()), slot_row.data_as<int32_t>(), N, h / V,
          static_cast<int>(topk), R);
      MT_CUDA_CHECK_LAUNCH();
    });
  });
}

void moe_unpermute(const Tensor& y, const Tensor& rows, const Tensor& probs, const Tensor& slot_row,
                   const Stream& stream) {
  const int64_t N = y.size(0), h = y.size(1), R = rows.size(0), k = probs.size(1);
  if (N == 0 || h == 0) return;
  ew::dispatch_float(y.dtype(), "moe_unpermute", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_vec<ew::kVec16<T>>(h, {y.data(), rows.data()}, [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      unpermute_kernel<V, T><<<row_grid(N, kRowWarps, stream), kRowThreads, 0, raw(stream)>>>(
          static_cast<T*>(y.data()), static_cast<const T*>(rows.data()), probs.data_as<float>(),
          slot_row.data_as<int32_t>(), N, h / V, static_cast<int>(k), R);
      MT_CUDA_CHECK_LAUNCH();
    });
  });
}

void moe_unpermute_backward(const Tensor& d_rows, const Tensor& d_probs, const Tensor& dy, const Tensor& rows,
                            const Tensor& probs, const Tensor& row_index, const Tensor& slot_row,
                            const Stream& stream) {
  // slot_row is the inverse of row_index (moe_routing_map), so one warp per slot writes both
  // outputs: d_rows[slot_row[i]] and d_probs[i]; row_index is read only to zero the rows no slot
  // maps to (row_index[r] < 0).
  const int64_t N = dy.size(0), h = dy.size(1), R = rows.size(0), k = probs.size(1), n = N * k;
  const int64_t row_bytes = h * static_cast<int64_t>(dtype_size(d_rows.dtype()));
  if (R > 0 && row_bytes > 0) {
    const auto zero = [&](auto word) {
      using W = decltype(word);
      zero_unmapped_rows_kernel<W><<<row_grid(R, kRowWarps, stream), kRowThreads, 0, raw(stream)>>>(
          static_cast<W*>(d_rows.data()), row_index.data_as<int32_t>(), R,
          row_bytes / static_cast<int64_t>(sizeof(W)));
      MT_CUDA_CHECK_LAUNCH();
    };
    const auto fits = [&](size_t w) {
      return row_bytes % static_cast<int64_t>(w) == 0 && reinterpret_cast<uintptr_t>(d_rows.data()) % w == 0;
    };
    if (fits(16)) {
      zero(uint4{});
    } else if (fits(4)) {
      zero(uint32_t{});
    } else {
      zero(uint16_t{});  // bf16 / fp16 rows
    }
  }
  if (n == 0) return;
  ew::dispatch_float(dy.dtype(), "moe_unpermute_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_vec<ew::kVec16<T>>(h, {d_rows.data(), dy.data(), rows.data()}, [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      unpermute_backward_kernel<V, T><<<row_grid(n, kRowWarps, stream), kRowThreads, 0, raw(stream)>>>(
          static_cast<T*>(d_rows.data()), d_probs.data_as<float>(), static_cast<const T*>(dy.data()),
          static_cast<const T*>(rows.data()), probs.data_as<float>(), slot_row.data_as<int32_t>(), n,
          h / V, static_cast<int>(k), R);
      MT_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace mt::cuda
