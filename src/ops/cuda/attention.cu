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
// output layout [s, b, n, d].
// ---------------------------------------------------------------------------------------------

/// Splits qkv into q, k, v (write-coalesced: the index runs over the destination rows).
template <typename T>
__global__ void split_qkv_kernel(T* q, T* k, T* v, const T* qkv, int64_t S, int64_t B, int64_t G, int64_t W,
                                 int64_t D) {
  const int64_t total = B * G * W * S * D;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = idx % D;
    int64_t r = idx / D;
    const int64_t i = r % S;
    r /= S;
    const int64_t c = r % W;  // component: query heads 0..W-3, key W-2, value W-1
    const int64_t bg = r / W, b = bg / G, g = bg - b * G;
    const T x = qkv[(((i * B + b) * G + g) * W + c) * D + e];
    if (c < W - 2) {
      q[((bg * (W - 2) + c) * S + i) * D + e] = x;
    } else {
      (c == W - 2 ? k : v)[(bg * S + i) * D + e] = x;
    }
  }
}

/// The inverse: dqkv [s, b, g, w, d] from dq [b, n, s, d], dk, dv [b, g, s, d].
template <typename T>
__global__ void merge_qkv_kernel(T* dqkv, const T* dq, const T* dk, const T* dv, int64_t S, int64_t B, int64_t G,
                                 int64_t W, int64_t D) {
  const int64_t total = S * B * G * W * D;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = idx % D;
    int64_t r = idx / D;
    const int64_t c = r % W;
    r /= W;
    const int64_t g = r % G;
    r /= G;
    const int64_t b = r % B, i = r / B, bg = b * G + g;
    dqkv[idx] = c < W - 2 ? dq[((bg * (W - 2) + c) * S + i) * D + e] : (c == W - 2 ? dk : dv)[(bg * S + i) * D + e];
  }
}

/// dst[b, n, s, d] = src[s, b, n, d].
template <typename T>
__global__ void sb_to_bn_kernel(T* dst, const T* src, int64_t S, int64_t B, int64_t N, int64_t D) {
  const int64_t total = B * N * S * D;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = idx % D;
    int64_t r = idx / D;
    const int64_t i = r % S;
    r /= S;
    const int64_t h = r % N, b = r / N;
    dst[idx] = src[((i * B + b) * N + h) * D + e];
  }
}

/// dst[s, b, n, d] = src[b, n, s, d].
template <typename T>
__global__ void bn_to_sb_kernel(T* dst, const T* src, int64_t S, int64_t B, int64_t N, int64_t D) {
  const int64_t total = S * B * N * D;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = idx % D;
    int64_t r = idx / D;
    const int64_t h = r % N;
    r /= N;
    const int64_t b = r % B, i = r / B;
    dst[idx] = src[((b * N + h) * S + i) * D + e];
  }
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
    split_qkv_kernel<T><<<grid_for(all), kThreads, 0, cu(stream)>>>(buf.q.data_as<T>(), buf.k.data_as<T>(),
                                                                     buf.v.data_as<T>(), qkv.data_as<T>(), s, B, g,
                                                                     qpg + 2, d);
    MT_CUDA_CHECK_LAUNCH();
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
    bn_to_sb_kernel<T><<<grid_for(nd), kThreads, 0, cu(stream)>>>(out.data_as<T>(), buf.dq.data_as<T>(), s, B, n, d);
    MT_CUDA_CHECK_LAUNCH();
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
    sb_to_bn_kernel<T><<<grid_for(nd), kThreads, 0, cu(stream)>>>(buf.dq.data_as<T>(), dout.data_as<T>(), s, B, n, d);
    MT_CUDA_CHECK_LAUNCH();
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
    merge_qkv_kernel<T><<<grid_for(all), kThreads, 0, cu(stream)>>>(dqkv.data_as<T>(), buf.dq.data_as<T>(),
                                                                     buf.dk.data_as<T>(), buf.dv.data_as<T>(), s, B, g,
                                                                     qpg + 2, d);
    MT_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mt::cuda
