// CUDA implementation of ops/context_attention.h: simple CUDA-core kernels with fp32 math (one
// thread per query row for the forward and dQ, one thread per key row for dK/dV, no atomics, so
// the results are deterministic). Correct for every shape up to head_dim 256; not tuned. The
// backward's workspace is not used yet. Dropout draws the one-rank mask by global positions
// (ops/context_attention_impl.h).
#include <cmath>
#include <type_traits>

#include "ops/context_attention.h"
#include "ops/context_attention_impl.h"
#include "core/cuda_check.h"
#include "ops/cuda/common.cuh"

namespace mt::cuda {
namespace {

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

}  // namespace

void context_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                               const ContextAttentionConfig& c, bool merge, const Stream& stream) {
  MT_CHECK(c.head_dim <= kMaxD, "context_attention_forward: head_dim={} exceeds {} on CUDA", c.head_dim, kMaxD);
  const Dims x = dims_of(qkv, kv, c);
  const AttnDropout drop = context_attention_dropout(c);
  const int64_t rows = x.sq * x.B * c.heads();
  dispatch_float(qkv.dtype(), "context_attention_forward", [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    forward_kernel<T><<<grid_for(rows, kBlock), kBlock, 0, cu(stream)>>>(
        out.data_as<T>(), lse.data_as<float>(), qkv.data_as<T>(), kv.data_as<T>(), x, merge, drop);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void context_attention_backward(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout, const Tensor& out,
                                const Tensor& lse, const Tensor& qkv, const Tensor& kv, const Tensor&,
                                const ContextAttentionConfig& c, const Stream& stream) {
  MT_CHECK(c.head_dim <= kMaxD, "context_attention_backward: head_dim={} exceeds {} on CUDA", c.head_dim, kMaxD);
  const Dims x = dims_of(qkv, kv, c);
  const AttnDropout drop = context_attention_dropout(c);
  dispatch_float(qkv.dtype(), "context_attention_backward", [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
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
