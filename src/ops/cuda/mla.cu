// CUDA ops/mla.h. The packing copies (mla_qkv_pack, mla_qkv_unpack_grad, mla_context_unpack) are
// pure data movement: one thread per output word of W bytes, W the widest of 16/8/4/2 bytes that
// divides every channel segment (d_n, d_r, d_v, D) and the tensors' addresses (16 bytes for bf16
// at any head dims that are multiples of 8), so a warp reads and writes contiguous 512-byte runs
// of a row; flat indices in 32 bits while they fit (the divisions by the row widths are most of a
// thread's instructions). Zero channels are the zero word: the results are bitwise those of the
// CPU reference at every width (tests/model/mla_cuda_test.cpp `MlaCuda.PackBitwiseMatchesCpu`).
// The head sum of dk_pe in fp32 in head order, as the CPU reference. bench/mla_pack_bench.cpp
// times them.
#include "ops/mla.h"  // first: ops/cuda/elementwise_common.cuh needs Tensor, Stream, DType

#include "ops/cuda/elementwise_common.cuh"
#include "ops/cuda/mla_widths.h"

namespace mt::cuda {
namespace {

using ew::from_f32;
using ew::raw;
using ew::to_f32;
using ew::Vec;

constexpr int kThreads = 256;

/// Sizes in elements (Dims) or in words of the access width (the copy kernels' Dims).
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

/// The widest access in bytes (16, 8, 4, or the element size; at most max_bytes) that divides
/// every size (in elements of `elem` bytes) and every address.
int access_bytes(int64_t elem, int max_bytes, std::initializer_list<int64_t> sizes,
                 std::initializer_list<const void*> ptrs) {
  for (int w = 16; w > elem; w /= 2) {
    bool ok = w <= max_bytes;
    for (int64_t s : sizes) ok = ok && (s * elem) % w == 0;
    for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % w == 0;
    if (ok) return w;
  }
  return static_cast<int>(elem);
}

/// Calls f(W{}, I{}) with W the unsigned word of `bytes` bytes and I uint32_t when `items` (the
/// largest flat index, in words) is below 2^31, else int64_t: an index plus the grid stride then stays
/// below 2^32 because grid_for caps the grid (4096 blocks of 256 threads per SM here: with 132 SMs a
/// stride of ~2^27).
template <typename F>
void dispatch_word(int bytes, int64_t items, F&& f) {
  auto with_index = [&](auto w) {
    if (items < (int64_t{1} << 31)) f(w, uint32_t{});
    else f(w, int64_t{});
  };
  switch (bytes) {
    case 16: return with_index(uint4{});
    case 8: return with_index(uint2{});
    case 4: return with_index(uint32_t{});
    case 2: return with_index(uint16_t{});
    default: MT_FAIL("mla: no access width of {} bytes", bytes);
  }
}

/// qkv[t, h, part, c] from q, kv, k_pe (ops/mla.h's layout); d in words of W.
template <typename W, typename I>
__global__ void __launch_bounds__(kThreads) pack_kernel(W* qkv, const W* q, const W* kv, const W* k_pe, Dims d) {
  const I D = static_cast<I>(d.D), dn = static_cast<I>(d.dn), dr = static_cast<I>(d.dr), dv = static_cast<I>(d.dv);
  const I n = static_cast<I>(d.n), items = static_cast<I>(d.tokens * d.n * 3 * d.D);
  const I stride = static_cast<I>(gridDim.x) * kThreads;
  for (I i = static_cast<I>(blockIdx.x) * kThreads + threadIdx.x; i < items; i += stride) {
    const I th = i / (3 * D);  // t·n + h
    I c = i - th * 3 * D;
    const I part = c / D;
    c -= part * D;
    const W* src = nullptr;
    if (part == 0) {
      if (c < dr) src = q + th * (dn + dr) + dn + c;
      else if (c < dr + dn) src = q + th * (dn + dr) + (c - dr);
    } else if (part == 1) {
      if (c < dr) src = k_pe + (th / n) * dr + c;
      else if (c < dr + dn) src = kv + th * (dn + dv) + (c - dr);
    } else if (c < dv) {
      src = kv + th * (dn + dv) + dn + c;
    }
    qkv[i] = src ? *src : W{};
  }
}

/// dq and dkv from dqkv: one thread per word of a row's dq then dkv (d in words of W).
template <typename W, typename I>
__global__ void __launch_bounds__(kThreads) unpack_kernel(W* dq, W* dkv, const W* g, Dims d) {
  const I D = static_cast<I>(d.D), dn = static_cast<I>(d.dn), dr = static_cast<I>(d.dr), dv = static_cast<I>(d.dv);
  const I wq = dn + dr, wkv = dn + dv, items = static_cast<I>(d.tokens * d.n) * (wq + wkv);
  const I stride = static_cast<I>(gridDim.x) * kThreads;
  for (I i = static_cast<I>(blockIdx.x) * kThreads + threadIdx.x; i < items; i += stride) {
    const I th = i / (wq + wkv), c = i - th * (wq + wkv);
    const W* row = g + th * 3 * D;
    if (c < wq) {
      dq[th * wq + c] = row[c < dn ? dr + c : c - dn];
    } else {
      const I j = c - wq;
      dkv[th * wkv + j] = j < dn ? row[D + dr + j] : row[2 * D + (j - dn)];
    }
  }
}

/// dk_pe[t, c] = Σ_h dqkv[t, h, 1, c] (fp32, head order), V channels per thread (d in elements).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) kpe_grad_kernel(T* dk_pe, const T* g, Dims d) {
  const int64_t per_token = d.dr / V, items = d.tokens * per_token;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < items; i += stride) {
    const int64_t t = i / per_token, c = (i - t * per_token) * V;
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.f;
#pragma unroll 4
    for (int64_t h = 0; h < d.n; ++h) {
      const Vec<T, V> x = *reinterpret_cast<const Vec<T, V>*>(g + ((t * d.n + h) * 3 + 1) * d.D + c);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += to_f32(x.v[k]);
    }
    Vec<T, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = from_f32<T>(acc[k]);
    *reinterpret_cast<Vec<T, V>*>(dk_pe + t * d.dr + c) = out;
  }
}

/// out[r, c] = ctx[r, c] for c < dv, or with `pad` ctx[r, c] = c < dv ? out[r, c] : 0 (in words).
template <typename W, typename I>
__global__ void __launch_bounds__(kThreads) context_kernel(W* out, W* ctx, int64_t rows64, int64_t dv64, int64_t D64,
                                                            bool pad) {
  const I dv = static_cast<I>(dv64), D = static_cast<I>(D64), w = pad ? D : dv;
  const I items = static_cast<I>(rows64) * w, stride = static_cast<I>(gridDim.x) * kThreads;
  for (I i = static_cast<I>(blockIdx.x) * kThreads + threadIdx.x; i < items; i += stride) {
    const I r = i / w, c = i - r * w;
    if (pad) ctx[i] = c < dv ? out[r * dv + c] : W{};
    else out[i] = ctx[r * D + c];
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

void mla_qkv_pack(const Tensor& qkv, const Tensor& q, const Tensor& kv, const Tensor& k_pe, const Stream& stream,
                  int max_bytes) {
  Dims d = dims_of(qkv, q, kv, k_pe);
  if (qkv.numel() == 0) return;
  const int64_t elem = dtype_size(qkv.dtype());
  const int bytes = access_bytes(elem, max_bytes, {d.D, d.dn, d.dr, d.dv},
                                 {qkv.data(), q.data(), kv.data(), k_pe.data()});
  const int64_t per = bytes / elem;  // elements per word
  d.D /= per, d.dn /= per, d.dr /= per, d.dv /= per;
  const int64_t items = qkv.numel() / per;
  dispatch_word(bytes, items, [&](auto w, auto i) {
    using W = decltype(w);
    pack_kernel<W, decltype(i)><<<ew::grid_for(items, kThreads, stream, 4096), kThreads, 0, raw(stream)>>>(
        static_cast<W*>(qkv.data()), static_cast<const W*>(q.data()), static_cast<const W*>(kv.data()),
        static_cast<const W*>(k_pe.data()), d);
    MT_CUDA_CHECK_LAUNCH();
  });
}

void mla_qkv_pack(const Tensor& qkv, const Tensor& q, const Tensor& kv, const Tensor& k_pe, const Stream& stream) {
  mla_qkv_pack(qkv, q, kv, k_pe, stream, kMlaMaxAccessBytes);
}

void mla_qkv_unpack_grad(const Tensor& dq, const Tensor& dkv, const Tensor& dk_pe, const Tensor& dqkv,
                         const Stream& stream, int max_bytes) {
  const Dims d = dims_of(dqkv, dq, dkv, dk_pe);
  if (dqkv.numel() == 0) return;
  const int64_t elem = dtype_size(dqkv.dtype());
  const int bytes = access_bytes(elem, max_bytes, {d.D, d.dn, d.dr, d.dv},
                                 {dq.data(), dkv.data(), dk_pe.data(), dqkv.data()});
  const int64_t per = bytes / elem;
  Dims w = d;
  w.D /= per, w.dn /= per, w.dr /= per, w.dv /= per;
  dispatch_word(bytes, dqkv.numel() / per, [&](auto word, auto i) {
    using W = decltype(word);
    const int64_t items = (dq.numel() + dkv.numel()) / per;
    unpack_kernel<W, decltype(i)><<<ew::grid_for(items, kThreads, stream, 4096), kThreads, 0, raw(stream)>>>(
        static_cast<W*>(dq.data()), static_cast<W*>(dkv.data()), static_cast<const W*>(dqkv.data()), w);
    MT_CUDA_CHECK_LAUNCH();
  });
  ew::dispatch_float(dqkv.dtype(), "mla_qkv_unpack_grad", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kV = ew::kVec16<T>;
    const T* g = static_cast<const T*>(dqkv.data());
    T* out = static_cast<T*>(dk_pe.data());
    if (access_bytes(elem, max_bytes, {d.dr, d.D}, {g, out}) == 16) {
      kpe_grad_kernel<T, kV><<<ew::grid_for(dk_pe.numel() / kV, kThreads, stream), kThreads, 0, raw(stream)>>>(
          out, g, d);
    } else {
      kpe_grad_kernel<T, 1><<<ew::grid_for(dk_pe.numel(), kThreads, stream), kThreads, 0, raw(stream)>>>(out, g, d);
    }
    MT_CUDA_CHECK_LAUNCH();
  });
}

void mla_qkv_unpack_grad(const Tensor& dq, const Tensor& dkv, const Tensor& dk_pe, const Tensor& dqkv,
                         const Stream& stream) {
  mla_qkv_unpack_grad(dq, dkv, dk_pe, dqkv, stream, kMlaMaxAccessBytes);
}

void mla_context_unpack(const Tensor& out, const Tensor& context, int64_t heads, bool pad, const Stream& stream,
                        int max_bytes) {
  const int64_t dv = out.size(-1) / heads, D = context.size(-1) / heads, rows = out.numel() / dv;
  if (out.numel() == 0) return;
  const int64_t elem = dtype_size(out.dtype());
  const int bytes = access_bytes(elem, max_bytes, {dv, D}, {out.data(), context.data()});
  const int64_t per = bytes / elem;
  dispatch_word(bytes, context.numel() / per, [&](auto w, auto i) {
    using W = decltype(w);
    const int64_t items = rows * (pad ? D : dv) / per;
    context_kernel<W, decltype(i)><<<ew::grid_for(items, kThreads, stream, 4096), kThreads, 0, raw(stream)>>>(
        static_cast<W*>(out.data()), static_cast<W*>(context.data()), rows, dv / per, D / per, pad);
    MT_CUDA_CHECK_LAUNCH();
  });
}

void mla_context_unpack(const Tensor& out, const Tensor& context, int64_t heads, bool pad, const Stream& stream) {
  mla_context_unpack(out, context, heads, pad, stream, kMlaMaxAccessBytes);
}

}  // namespace mt::cuda
