#include "ops/cuda/elementwise_common.cuh"
#include "ops/embedding.h"

namespace mt::cuda {
namespace {

using ew::from_f32;
using ew::raw;
using ew::to_f32;
using ew::Vec;

constexpr int kThreads = 256;

struct EmbedShape {
  int64_t n_tok;        ///< s * b
  int64_t b;
  int64_t h;
  int64_t vocab_start;
  int64_t v_local;      ///< rows of wte
  int64_t p_rows;       ///< rows of wpe (0 if none)
};

template <int V, typename T>
__global__ void embedding_forward_kernel(T* out, const int32_t* ids, const T* wte, const T* wpe, const int32_t* pos,
                                         EmbedShape sh) {
  const int64_t hv = sh.h / V;
  const int64_t total = sh.n_tok * hv;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t t = i / hv;
    const int64_t c = (i - t * hv) * V;
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.f;
    const int64_t row = static_cast<int64_t>(ids[t]) - sh.vocab_start;
    if (row >= 0 && row < sh.v_local) {
      const Vec<T, V> v = *reinterpret_cast<const Vec<T, V>*>(wte + row * sh.h + c);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += to_f32(v.v[k]);
    }
    if (wpe) {
      const int64_t p = pos ? static_cast<int64_t>(pos[t]) : t / sh.b;
      if (p >= 0 && p < sh.p_rows) {
        const Vec<T, V> v = *reinterpret_cast<const Vec<T, V>*>(wpe + p * sh.h + c);
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += to_f32(v.v[k]);
      }
    }
    Vec<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = from_f32<T>(acc[k]);
    *reinterpret_cast<Vec<T, V>*>(out + t * sh.h + c) = o;
  }
}

/// table[row(t), c] += dout[t, c] with row(t) = idx[t] - start, skipped outside [0, rows).
template <typename T>
__global__ void embedding_backward_atomic_kernel(float* table, const T* dout, const int32_t* idx, int64_t start,
                                                 int64_t rows, int64_t n_tok, int64_t h) {
  const int64_t total = n_tok * h;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t t = i / h;
    const int64_t row = static_cast<int64_t>(idx[t]) - start;
    if (row < 0 || row >= rows) continue;
    atomicAdd(table + row * h + (i - t * h), to_f32(dout[i]));
  }
}

/// Default positions (pos = i_s): dwpe[i_s, c] += sum_{i_b} dout[i_s, i_b, c], summed in order.
template <typename T>
__global__ void embedding_backward_wpe_kernel(float* dwpe, const T* dout, int64_t s, int64_t b, int64_t h) {
  const int64_t total = s * h;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t is = i / h;
    const int64_t c = i - is * h;
    const T* d = dout + is * b * h + c;
    float acc = 0.f;
    for (int64_t ib = 0; ib < b; ++ib) acc += to_f32(d[ib * h]);
    dwpe[i] += acc;
  }
}

}  // namespace

void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& wte, const Tensor& wpe,
                       const Tensor& positions, int64_t vocab_start, const Stream& stream) {
  EmbedShape sh{ids.numel(), ids.size(1), out.size(2), vocab_start, wte.size(0), wpe.empty() ? 0 : wpe.size(0)};
  if (sh.n_tok == 0 || sh.h == 0) return;
  ew::dispatch_float(out.dtype(), "embedding_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = ew::kVec16<T>;
    T* po = static_cast<T*>(out.data());
    const T* pte = static_cast<const T*>(wte.data());
    const T* ppe = wpe.empty() ? nullptr : static_cast<const T*>(wpe.data());
    const int32_t* pid = ids.data_as<int32_t>();
    const int32_t* ppos = positions.empty() ? nullptr : positions.data_as<int32_t>();
    const bool vec = sh.h % V == 0 && ew::aligned16(po) && ew::aligned16(pte) && (!ppe || ew::aligned16(ppe));
    if (vec) {
      const unsigned grid = ew::grid_for(sh.n_tok * (sh.h / V), kThreads, stream);
      embedding_forward_kernel<V><<<grid, kThreads, 0, raw(stream)>>>(po, pid, pte, ppe, ppos, sh);
    } else {
      const unsigned grid = ew::grid_for(sh.n_tok * sh.h, kThreads, stream);
      embedding_forward_kernel<1><<<grid, kThreads, 0, raw(stream)>>>(po, pid, pte, ppe, ppos, sh);
    }
    MT_CUDA_CHECK_LAUNCH();
  });
}

void embedding_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& ids,
                        const Tensor& positions, int64_t vocab_start, const Stream& stream) {
  const int64_t n_tok = ids.numel(), s = ids.size(0), b = ids.size(1), h = dout.size(2);
  if (n_tok == 0 || h == 0) return;
  ew::dispatch_float(dout.dtype(), "embedding_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* pd = static_cast<const T*>(dout.data());
    const unsigned grid = ew::grid_for(n_tok * h, kThreads, stream);
    embedding_backward_atomic_kernel<<<grid, kThreads, 0, raw(stream)>>>(
        dwte.data_as<float>(), pd, ids.data_as<int32_t>(), vocab_start, dwte.size(0), n_tok, h);
    MT_CUDA_CHECK_LAUNCH();
    if (dwpe.empty()) return;
    if (positions.empty()) {
      embedding_backward_wpe_kernel<<<ew::grid_for(s * h, kThreads, stream), kThreads, 0, raw(stream)>>>(
          dwpe.data_as<float>(), pd, s, b, h);
    } else {
      embedding_backward_atomic_kernel<<<grid, kThreads, 0, raw(stream)>>>(
          dwpe.data_as<float>(), pd, positions.data_as<int32_t>(), 0, dwpe.size(0), n_tok, h);
    }
    MT_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mt::cuda
