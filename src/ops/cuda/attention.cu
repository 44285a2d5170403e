#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <type_traits>

#include "core/cuda_check.h"
#include "ops/cuda/common.cuh"
#include "ops/attention.h"
#include "ops/attention_impl.h"
#include "ops/cuda/cublaslt_gemm.h"

namespace mt::cuda {
namespace {




/// A V-element vector of T moved as one load/store (16 bytes when V = 16 / sizeof(T)).
template <typename T, int V>
struct ew_vec {
  struct alignas(sizeof(T) * V) type {
    T v[V];
  };
};

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

unsigned grid_for(int64_t n) {
  int64_t g = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(g < (int64_t{1} << 30) ? g : (int64_t{1} << 30));  // grid-stride loops cover the rest
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Permutes between the fused QKV layout [s, b, g, w = qpg + 2, d] and the per-head layouts
// q [b, g, qpg, s, d] (= [b, n, s, d]), k, v [b, g, s, d]; and between [b, n, s, d] and the
// output layout [s, b, n, d]. Each moves whole rows of d elements: one thread per V-element
// vector of a row (V = 16 bytes when d and the pointers allow, else 1), the row's coordinates
// computed with 32-bit divisions once per vector (64-bit division per element was the cost).
// ---------------------------------------------------------------------------------------------

/// Rows and row geometry of one permute; rows < 2^31 (checked by the launcher).
struct RowPermute {
  uint32_t S, B, G, W;  // W: components per group (qpg + 2) for the QKV permutes; heads N for sb<->bn
  uint32_t vpr;         // vectors per row (d / V)
};

template <typename T, int V>
using VecOf = ew_vec<T, V>;

/// dst row index -> src row index for each permute; `kind` selects which.
enum class PermuteKind { kSplitQkv, kMergeQkv, kSbToBn, kBnToSb };

template <typename T, int V, PermuteKind kKind>
__global__ void permute_rows_kernel(T* d0, T* d1, T* d2, const T* s0, const T* s1, const T* s2, RowPermute p,
                                    uint32_t rows) {
  using Vec = typename VecOf<T, V>::type;
  const uint64_t total = static_cast<uint64_t>(rows) * p.vpr;
  for (uint64_t idx = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t row = static_cast<uint32_t>(idx / p.vpr), lane = static_cast<uint32_t>(idx % p.vpr);
    const T* src;
    T* dst;
    if constexpr (kKind == PermuteKind::kSplitQkv) {
      // row enumerates [b, g, c, i] (destination order): q rows for c < W - 2, then k, v.
      uint32_t r = row;
      const uint32_t i = r % p.S;
      r /= p.S;
      const uint32_t c = r % p.W, bg = r / p.W, b = bg / p.G, g = bg % p.G;
      src = s0 + (((static_cast<uint64_t>(i) * p.B + b) * p.G + g) * p.W + c) * p.vpr * V;
      if (c < p.W - 2) {
        dst = d0 + ((static_cast<uint64_t>(bg) * (p.W - 2) + c) * p.S + i) * p.vpr * V;
      } else {
        dst = (c == p.W - 2 ? d1 : d2) + (static_cast<uint64_t>(bg) * p.S + i) * p.vpr * V;
      }
    } else if constexpr (kKind == PermuteKind::kMergeQkv) {
      // row enumerates [s, b, g, c] (destination order of dqkv).
      uint32_t r = row;
      const uint32_t c = r % p.W;
      r /= p.W;
      const uint32_t g = r % p.G;
      r /= p.G;
      const uint32_t b = r % p.B, i = r / p.B, bg = b * p.G + g;
      dst = d0 + static_cast<uint64_t>(row) * p.vpr * V;
      if (c < p.W - 2) {
        src = s0 + ((static_cast<uint64_t>(bg) * (p.W - 2) + c) * p.S + i) * p.vpr * V;
      } else {
        src = (c == p.W - 2 ? s1 : s2) + (static_cast<uint64_t>(bg) * p.S + i) * p.vpr * V;
      }
    } else if constexpr (kKind == PermuteKind::kSbToBn) {
      // dst [b, n, s] rows from src [s, b, n] rows (N in p.W).
      uint32_t r = row;
      const uint32_t i = r % p.S;
      r /= p.S;
      const uint32_t h = r % p.W, b = r / p.W;
      dst = d0 + static_cast<uint64_t>(row) * p.vpr * V;
      src = s0 + ((static_cast<uint64_t>(i) * p.B + b) * p.W + h) * p.vpr * V;
    } else {
      // dst [s, b, n] rows from src [b, n, s] rows.
      uint32_t r = row;
      const uint32_t h = r % p.W;
      r /= p.W;
      const uint32_t b = r % p.B, i = r / p.B;
      dst = d0 + static_cast<uint64_t>(row) * p.vpr * V;
      src = s0 + ((static_cast<uint64_t>(b) * p.W + h) * p.S + i) * p.vpr * V;
    }
    reinterpret_cast<Vec*>(dst)[lane] = reinterpret_cast<const Vec*>(src)[lane];
  }
}

template <typename T, PermuteKind kKind>
void launch_permute(T* d0, T* d1, T* d2, const T* s0, const T* s1, const T* s2, int64_t S, int64_t B, int64_t G,
                    int64_t W, int64_t D, int64_t rows, const Stream& stream) {
  MT_CHECK(rows < (int64_t{1} << 31) && S < (int64_t{1} << 31), "attention permute: {} rows exceed 2^31", rows);
  constexpr int kV = static_cast<int>(16 / sizeof(T));
  auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = D % kV == 0 && aligned(d0) && aligned(d1) && aligned(d2) && aligned(s0) && aligned(s1) && aligned(s2);
  RowPermute p{static_cast<uint32_t>(S), static_cast<uint32_t>(B), static_cast<uint32_t>(G), static_cast<uint32_t>(W),
               static_cast<uint32_t>(vec ? D / kV : D)};
  const int64_t work = rows * p.vpr;
  if (vec) {
    permute_rows_kernel<T, kV, kKind><<<grid_for(work), kThreads, 0, cu(stream)>>>(d0, d1, d2, s0, s1, s2, p,
                                                                                   static_cast<uint32_t>(rows));
  } else {
    permute_rows_kernel<T, 1, kKind><<<grid_for(work), kThreads, 0, cu(stream)>>>(d0, d1, d2, s0, s1, s2, p,
                                                                                  static_cast<uint32_t>(rows));
  }
  MT_CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------------
// Row kernels: one warp per row (b·n·s rows of length s). Row r = (bn, i) has the unmasked
// entries j0 .. i, j0 = doc_start[b, i] (b = bn / heads) or 0 without a document mask (doc_start
// == nullptr: plain causal, one predicate per row and no extra load). doc_start values are
// trusted (ops/attention.h). Dropout draws come in groups of four consecutive global elements
// (one Philox call), so the writing passes iterate over the groups that overlap the row, one
// group per lane.
// ---------------------------------------------------------------------------------------------

/// Calls f(j, keep) for every column j of the row (global elements g0 .. g0 + s - 1), with the
/// dropout keep decision (always true when dropout is off). Lanes take 4 consecutive columns.
template <typename F>
__device__ __forceinline__ void for_row_groups(const AttnDropout& drop, uint64_t g0, int64_t s, int lane, F&& f) {
  const uint64_t first = g0 >> 2, last = (g0 + static_cast<uint64_t>(s) - 1) >> 2;
  for (uint64_t grp = first + lane; grp <= last; grp += 32) {
    Philox4 r{{0u, 0u, 0u, 0u}};
    if (drop.enabled) r = drop.bits4(grp);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint64_t g = grp * 4 + e;
      if (g < g0 || g >= g0 + static_cast<uint64_t>(s)) continue;
      const bool keep = !drop.enabled || r.v[e] >= drop.threshold;
      f(static_cast<int64_t>(g - g0), keep);
    }
  }
}

/// First unmasked key of row (bn, i).
__device__ __forceinline__ int64_t first_key(const int32_t* doc_start, int64_t bn, int64_t i, int64_t heads,
                                             int64_t s) {
  return doc_start ? static_cast<int64_t>(doc_start[(bn / heads) * s + i]) : 0;
}

/// probs[row] = softmax over j0 <= j <= i of probs[row] (scores, already scaled), 0 elsewhere;
/// dropped[row] = mask · probs / (1 - p) when dropout is enabled.
template <typename T>
__global__ void causal_softmax_kernel(T* probs, T* dropped, const int32_t* doc_start, int64_t rows, int64_t s,
                                      AttnDropout drop) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t bn = row / s, i = row - bn * s;
  T* p = probs + row * s;
  const int64_t j0 = first_key(doc_start, bn, i, drop.heads, s), len = i + 1;
  float mx = -INFINITY;
  for (int64_t j = j0 + lane; j < len; j += 32) mx = fmaxf(mx, to_f(p[j]));
  mx = warp_max(mx);
  float sum = 0.f;
  for (int64_t j = j0 + lane; j < len; j += 32) sum += expf(to_f(p[j]) - mx);
  sum = warp_sum(sum);
  const float inv = 1.f / sum;
  // Each lane reads and writes only its own columns below, so the in-place update is safe.
  T* dr = dropped ? dropped + row * s : nullptr;
  const uint64_t g0 = drop.enabled ? drop.row_start(bn, i) : static_cast<uint64_t>(row * s);
  for_row_groups(drop, g0, s, lane, [&](int64_t j, bool keep) {
    const float v = j >= j0 && j < len ? expf(to_f(p[j]) - mx) * inv : 0.f;
    p[j] = from_f<T>(v);
    if (dr) dr[j] = from_f<T>(keep ? v * drop.inv_keep : 0.f);
  });
}

/// dropped[row] = mask · probs[row] / (1 - p) (backward recompute of the dropped probabilities).
template <typename T>
__global__ void dropout_probs_kernel(T* dropped, const T* probs, const int32_t* doc_start, int64_t rows, int64_t s,
                                     AttnDropout drop) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t bn = row / s, i = row - bn * s;
  const int64_t j0 = first_key(doc_start, bn, i, drop.heads, s);
  const T* p = probs + row * s;
  T* dr = dropped + row * s;
  for_row_groups(drop, drop.row_start(bn, i), s, lane, [&](int64_t j, bool keep) {
    dr[j] = from_f<T>(j >= j0 && j <= i && keep ? to_f(p[j]) * drop.inv_keep : 0.f);
  });
}

/// In place on grad: dP = mask · dP_drop / (1 - p); dS = P (dP - sum_j dP P), 0 outside j0 .. i.
template <typename T>
__global__ void causal_softmax_backward_kernel(T* grad, const T* probs, const int32_t* doc_start, int64_t rows,
                                               int64_t s, AttnDropout drop) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t bn = row / s, i = row - bn * s;
  const int64_t j0 = first_key(doc_start, bn, i, drop.heads, s);
  T* g = grad + row * s;
  const T* p = probs + row * s;
  const uint64_t g0 = drop.enabled ? drop.row_start(bn, i) : static_cast<uint64_t>(row * s);
  float dot = 0.f;
  for_row_groups(drop, g0, s, lane, [&](int64_t j, bool keep) {
    if (j >= j0 && j <= i && keep) dot += to_f(g[j]) * drop.inv_keep * to_f(p[j]);
  });
  dot = warp_sum(dot);
  // Same lane-to-column assignment as above, so every lane reads its columns before writing them.
  for_row_groups(drop, g0, s, lane, [&](int64_t j, bool keep) {
    const float dp = keep ? to_f(g[j]) * drop.inv_keep : 0.f;
    g[j] = from_f<T>(j >= j0 && j <= i ? to_f(p[j]) * (dp - dot) : 0.f);
  });
}

/// cfg.doc_start as a device pointer, or nullptr for plain causal.
const int32_t* doc_start_ptr(const AttentionConfig& cfg) {
  return cfg.doc_start.empty() ? nullptr : cfg.doc_start.data_as<int32_t>();
}

unsigned row_grid(int64_t rows) { return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

/// Batched contiguous GEMM over the b·n (batch, head) pairs.
void bgemm(int64_t batch, int64_t m, int64_t n, int64_t k, bool ta, bool tb, DType t, const void* a, const void* b,
           void* c, float alpha, const Stream& stream) {
  gemm(contiguous_gemm(batch, m, n, k, ta, tb, t, t, a, b, c, alpha, 0.f), stream);
}

}  // namespace

void attention_forward(const Tensor& out, const Tensor& qkv, const AttentionBuffers& buf, const AttentionConfig& cfg,
                       const Stream& stream) {
  const int64_t s = cfg.seq, B = cfg.batch, n = cfg.heads, d = cfg.head_dim, bn = B * n, rows = bn * s;
  const int64_t g = cfg.groups > 0 ? cfg.groups : n, qpg = n / g, bg = B * g;
  const DType act = qkv.dtype();
  const AttnDropout drop = make_attn_dropout(cfg);
  MT_CHECK(rows / kWarpsPerBlock < (int64_t{1} << 31), "attention: {} rows exceed the grid limit", rows);
  dispatch_float(act, "attention", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t nd = bn * s * d, all = bg * (qpg + 2) * s * d;
    launch_permute<T, PermuteKind::kSplitQkv>(buf.q.data_as<T>(), buf.k.data_as<T>(), buf.v.data_as<T>(),
                                              qkv.data_as<T>(), nullptr, nullptr, s, B, g, qpg + 2, d, all / d, stream);
    // scores[b, g, qpg·s, s] = scale · q k^T, into probs ([b, n, s, s])
    bgemm(bg, qpg * s, s, d, false, true, act, buf.q.data(), buf.k.data(), buf.probs.data(), cfg.softmax_scale,
          stream);
    T* dropped = drop.enabled ? buf.scratch.data_as<T>() : nullptr;
    causal_softmax_kernel<T><<<row_grid(rows), kThreads, 0, cu(stream)>>>(buf.probs.data_as<T>(), dropped,
                                                                           doc_start_ptr(cfg), rows, s, drop);
    MT_CUDA_CHECK_LAUNCH();
    // context[b, g, qpg·s, d] = P_drop v, into dq; then out[s, b, n, d]
    const void* pd = drop.enabled ? buf.scratch.data() : buf.probs.data();
    bgemm(bg, qpg * s, d, s, false, false, act, pd, buf.v.data(), buf.dq.data(), 1.f, stream);
    launch_permute<T, PermuteKind::kBnToSb>(out.data_as<T>(), nullptr, nullptr, buf.dq.data_as<T>(), nullptr, nullptr,
                                            s, B, 1, n, d, nd / d, stream);
  });
}

void attention_backward(const Tensor& dqkv, const Tensor& dout, const AttentionBuffers& buf,
                        const AttentionConfig& cfg, const Stream& stream) {
  const int64_t s = cfg.seq, B = cfg.batch, n = cfg.heads, d = cfg.head_dim, bn = B * n, rows = bn * s;
  const int64_t g = cfg.groups > 0 ? cfg.groups : n, qpg = n / g, bg = B * g;
  const DType act = dout.dtype();
  const AttnDropout drop = make_attn_dropout(cfg);
  MT_CHECK(rows / kWarpsPerBlock < (int64_t{1} << 31), "attention: {} rows exceed the grid limit", rows);
  dispatch_float(act, "attention", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t nd = bn * s * d, all = bg * (qpg + 2) * s * d;
    // dO[b, n, s, d] into dq
    launch_permute<T, PermuteKind::kSbToBn>(buf.dq.data_as<T>(), nullptr, nullptr, dout.data_as<T>(), nullptr, nullptr,
                                            s, B, 1, n, d, nd / d, stream);
    const void* pd = buf.probs.data();
    if (drop.enabled) {
      dropout_probs_kernel<T><<<row_grid(rows), kThreads, 0, cu(stream)>>>(
          buf.scratch.data_as<T>(), buf.probs.data_as<T>(), doc_start_ptr(cfg), rows, s, drop);
      MT_CUDA_CHECK_LAUNCH();
      pd = buf.scratch.data();
    }
    // dV[b, g, s, d] = P_drop^T dO (summed over the group's query heads)
    bgemm(bg, s, d, qpg * s, true, false, act, pd, buf.dq.data(), buf.dv.data(), 1.f, stream);
    // dP_drop = dO V^T into scratch (the dropped probabilities are no longer needed)
    bgemm(bg, qpg * s, s, d, false, true, act, buf.dq.data(), buf.v.data(), buf.scratch.data(), 1.f, stream);
    causal_softmax_backward_kernel<T><<<row_grid(rows), kThreads, 0, cu(stream)>>>(
        buf.scratch.data_as<T>(), buf.probs.data_as<T>(), doc_start_ptr(cfg), rows, s, drop);
    MT_CUDA_CHECK_LAUNCH();
    // dQ = scale dS K, dK = scale dS^T Q (summed over the group's query heads)
    bgemm(bg, qpg * s, d, s, false, false, act, buf.scratch.data(), buf.k.data(), buf.dq.data(), cfg.softmax_scale,
          stream);
    bgemm(bg, s, d, qpg * s, true, false, act, buf.scratch.data(), buf.q.data(), buf.dk.data(), cfg.softmax_scale,
          stream);
    launch_permute<T, PermuteKind::kMergeQkv>(dqkv.data_as<T>(), nullptr, nullptr, buf.dq.data_as<T>(),
                                              buf.dk.data_as<T>(), buf.dv.data_as<T>(), s, B, g, qpg + 2, d, all / d,
                                              stream);
  });
}

}  // namespace mt::cuda
