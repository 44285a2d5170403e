// CUDA ops/mla.h: grid-stride loops, one thread per output element (scalar loads: these copies
// are a small part of an MLA layer's traffic); the head sum of dk_pe in fp32 in head order, as
// the CPU reference.
#include "ops/mla.h"  // first: ops/cuda/elementwise_common.cuh needs Tensor, Stream, DType

#include "ops/cuda/elementwise_common.cuh"

namespace mt::cuda {
namespace {

using ew::from_f32;
using ew::raw;
using ew::to_f32;

constexpr int kThreads = 256;

struct Dims {
  int64_t tokens, n, D, dn, dr, dv;
};

Dims dims_of(const Tensor& qkv, const Tensor& q, const Tensor& kv, const Tensor& k_pe) {
  Dims d{};
  d.n = qkv.size(-3);
  d.D = qkv.size(-1);
  d.dr = k_pe.size(-1);
  d.dn = q.size(-1) - d.dr;
  d.dv = kv.size(-1) - d.dn;
  d.tokens = k_pe.numel() / d.dr;
  return d;
}

/// qkv[t, h, part, c] from q, kv, k_pe (ops/mla.h's layout).
template <typename T>
__global__ void __launch_bounds__(kThreads) pack_kernel(T* qkv, const T* q, const T* kv, const T* k_pe, Dims d) {
  const int64_t items = d.tokens * d.n * 3 * d.D;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < items; i += stride) {
    const int64_t c = i % d.D;
    const int64_t part = (i / d.D) % 3;
    const int64_t th = i / (3 * d.D);  // t·n + h
    const int64_t t = th / d.n;
    T v = from_f32<T>(0.f);
    if (part == 0) {
      if (c < d.dr) v = q[th * (d.dn + d.dr) + d.dn + c];
      else if (c < d.dr + d.dn) v = q[th * (d.dn + d.dr) + (c - d.dr)];
    } else if (part == 1) {
      if (c < d.dr) v = k_pe[t * d.dr + c];
      else if (c < d.dr + d.dn) v = kv[th * (d.dn + d.dv) + (c - d.dr)];
    } else if (c < d.dv) {
      v = kv[th * (d.dn + d.dv) + d.dn + c];
    }
    qkv[i] = v;
  }
}

/// dq and dkv from dqkv: one thread per element of dq, then of dkv.
template <typename T>
__global__ void __launch_bounds__(kThreads) unpack_kernel(T* dq, T* dkv, const T* g, Dims d) {
  const int64_t nq = d.tokens * d.n * (d.dn + d.dr), nkv = d.tokens * d.n * (d.dn + d.dv);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < nq + nkv; i += stride) {
    if (i < nq) {
      const int64_t w = d.dn + d.dr, th = i / w, c = i % w;
      dq[i] = g[th * 3 * d.D + (c < d.dn ? d.dr + c : c - d.dn)];
    } else {
      const int64_t j = i - nq, w = d.dn + d.dv, th = j / w, c = j % w;
      dkv[j] = c < d.dn ? g[(th * 3 + 1) * d.D + d.dr + c] : g[(th * 3 + 2) * d.D + (c - d.dn)];
    }
  }
}

/// dk_pe[t, c] = Σ_h dqkv[t, h, 1, c] (fp32, head order).
template <typename T>
__global__ void __launch_bounds__(kThreads) kpe_grad_kernel(T* dk_pe, const T* g, Dims d) {
  const int64_t items = d.tokens * d.dr;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < items; i += stride) {
    const int64_t t = i / d.dr, c = i % d.dr;
    float acc = 0.f;
    for (int64_t h = 0; h < d.n; ++h) acc += to_f32(g[((t * d.n + h) * 3 + 1) * d.D + c]);
    dk_pe[i] = from_f32<T>(acc);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) context_kernel(T* out, T* ctx, int64_t rows, int64_t dv, int64_t D,
                                                            bool pad) {
  const int64_t items = rows * (pad ? D : dv);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < items; i += stride) {
    if (pad) {
      const int64_t r = i / D, c = i % D;
      ctx[i] = c < dv ? out[r * dv + c] : from_f32<T>(0.f);
    } else {
      const int64_t r = i / dv, c = i % dv;
      out[i] = ctx[r * D + c];
    }
  }
}

/// One thread per element of the appended rows: c_kv's r channels, then k_pe's d_r.
template <typename T>
__global__ void __launch_bounds__(kThreads) append_kernel(T* ckv_cache, T* kpe_cache, const T* c_kv, const T* qkv,
                                                           int64_t s, int64_t b, int64_t n, int64_t D, int64_t B,
                                                           int64_t r, int64_t dr, int64_t offset) {
  const int64_t items = s * b * (r + dr);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < items; i += stride) {
    const int64_t c = i % (r + dr), tj = i / (r + dr), t = tj / b, j = tj % b;
    if (c < r) {
      ckv_cache[((offset + t) * B + j) * r + c] = c_kv[tj * r + c];
    } else {
      kpe_cache[((offset + t) * B + j) * dr + (c - r)] = qkv[((tj * n) * 3 + 1) * D + (c - r)];
    }
  }
}

/// key/value[j, h, p, c] for p < count (mla_qkv_pack's layout from the cached latents).
template <typename T>
__global__ void __launch_bounds__(kThreads) expand_kernel(T* key, T* value, const T* kv_up, const T* kpe, int64_t b,
                                                           int64_t n, int64_t S, int64_t D, int64_t B, int64_t dn,
                                                           int64_t dv, int64_t dr, int64_t count) {
  const int64_t items = b * n * count * D;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < items; i += stride) {
    const int64_t c = i % D, p = (i / D) % count, jh = i / (D * count), j = jh / n, h = jh % n;
    const T* up = kv_up + ((p * B + j) * n + h) * (dn + dv);
    T kv = from_f32<T>(0.f), vv = from_f32<T>(0.f);
    if (c < dr) kv = kpe[(p * B + j) * dr + c];
    else if (c < dr + dn) kv = up[c - dr];
    if (c < dv) vv = up[dn + c];
    const int64_t at = (jh * S + p) * D + c;
    key[at] = kv;
    value[at] = vv;
  }
}

}  // namespace

void mla_latent_append(const Tensor& ckv_cache, const Tensor& kpe_cache, const Tensor& c_kv, const Tensor& qkv,
                       int64_t offset, const Stream& stream) {
  const int64_t s = qkv.size(0), b = qkv.size(1), r = ckv_cache.size(2), dr = kpe_cache.size(2);
  if (s * b == 0) return;
  ew::dispatch_float(qkv.dtype(), "mla_latent_append", [&](auto tag) {
    using T = typename decltype(tag)::type;
    append_kernel<T><<<ew::grid_for(s * b * (r + dr), kThreads, stream), kThreads, 0, raw(stream)>>>(
        static_cast<T*>(ckv_cache.data()), static_cast<T*>(kpe_cache.data()), static_cast<const T*>(c_kv.data()),
        static_cast<const T*>(qkv.data()), s, b, qkv.size(2), qkv.size(4), ckv_cache.size(1), r, dr, offset);
    MT_CUDA_CHECK_LAUNCH();
  });
}

void mla_latent_expand(const Tensor& key, const Tensor& value, const Tensor& kv_up, const Tensor& kpe_cache,
                       int64_t count, int64_t qk_head_dim, const Stream& stream) {
  const int64_t b = key.size(0), n = key.size(1), D = key.size(3);
  if (b * n * count == 0) return;
  ew::dispatch_float(key.dtype(), "mla_latent_expand", [&](auto tag) {
    using T = typename decltype(tag)::type;
    expand_kernel<T><<<ew::grid_for(b * n * count * D, kThreads, stream), kThreads, 0, raw(stream)>>>(
        static_cast<T*>(key.data()), static_cast<T*>(value.data()), static_cast<const T*>(kv_up.data()),
        static_cast<const T*>(kpe_cache.data()), b, n, key.size(2), D, kv_up.size(1), qk_head_dim,
        kv_up.size(3) - qk_head_dim, kpe_cache.size(2), count);
    MT_CUDA_CHECK_LAUNCH();
  });
}

void mla_qkv_pack(const Tensor& qkv, const Tensor& q, const Tensor& kv, const Tensor& k_pe, const Stream& stream) {
  const Dims d = dims_of(qkv, q, kv, k_pe);
  if (qkv.numel() == 0) return;
  ew::dispatch_float(qkv.dtype(), "mla_qkv_pack", [&](auto tag) {
    using T = typename decltype(tag)::type;
    pack_kernel<T><<<ew::grid_for(qkv.numel(), kThreads, stream), kThreads, 0, raw(stream)>>>(
        static_cast<T*>(qkv.data()), static_cast<const T*>(q.data()), static_cast<const T*>(kv.data()),
        static_cast<const T*>(k_pe.data()), d);
    MT_CUDA_CHECK_LAUNCH();
  });
}

void mla_qkv_unpack_grad(const Tensor& dq, const Tensor& dkv, const Tensor& dk_pe, const Tensor& dqkv,
                         const Stream& stream) {
  const Dims d = dims_of(dqkv, dq, dkv, dk_pe);
  if (dqkv.numel() == 0) return;
  ew::dispatch_float(dqkv.dtype(), "mla_qkv_unpack_grad", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* g = static_cast<const T*>(dqkv.data());
    unpack_kernel<T><<<ew::grid_for(dq.numel() + dkv.numel(), kThreads, stream), kThreads, 0, raw(stream)>>>(
        static_cast<T*>(dq.data()), static_cast<T*>(dkv.data()), g, d);
    MT_CUDA_CHECK_LAUNCH();
    kpe_grad_kernel<T><<<ew::grid_for(dk_pe.numel(), kThreads, stream), kThreads, 0, raw(stream)>>>(
        static_cast<T*>(dk_pe.data()), g, d);
    MT_CUDA_CHECK_LAUNCH();
  });
}

void mla_context_unpack(const Tensor& out, const Tensor& context, int64_t heads, bool pad, const Stream& stream) {
  const int64_t dv = out.size(-1) / heads, D = context.size(-1) / heads, rows = out.numel() / dv;
  if (out.numel() == 0) return;
  ew::dispatch_float(out.dtype(), "mla_context_unpack", [&](auto tag) {
    using T = typename decltype(tag)::type;
    context_kernel<T><<<ew::grid_for(rows * (pad ? D : dv), kThreads, stream), kThreads, 0, raw(stream)>>>(
        static_cast<T*>(out.data()), static_cast<T*>(context.data()), rows, dv, D, pad);
    MT_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mt::cuda
