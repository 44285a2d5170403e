// CUDA embedding (ops/embedding.h). Forward: a gather, 16-byte vectors. Backward into the fp32
// main gradients: by default one fp32 atomicAdd per element (order of repeated ids varies run to
// run); deterministic (--deterministic-mode): the (id, token) pairs are sorted by id with CUB's
// stable radix sort, the runs of equal ids found with DeviceSelect, and each (run, column chunk)
// summed by one block in token order (fixed-order tree over 8 row lanes), then added to the
// gradient row: no float atomics. Its index arrays and CUB's temporary storage live in the stream's
// workspace (CudaStreamResources::workspace, used in stream order only).
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>

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


// ---- deterministic backward: sort by id, then a block per (run of one id, column chunk) ---------

constexpr int kRunCols = 32;  // column lanes of a block (V elements each)
constexpr int kRunRows = 8;   // row lanes: the run's tokens are split over them in a fixed way

/// keys[t] = idx[t] - start when in [0, rows), else rows (out of range: sorted last, skipped);
/// order[t] = t.
__global__ void embedding_sort_keys_kernel(uint32_t* keys, int32_t* order, const int32_t* idx, int64_t start,
                                           int64_t rows, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < n; t += stride) {
    const int64_t r = static_cast<int64_t>(idx[t]) - start;
    keys[t] = static_cast<uint32_t>(r >= 0 && r < rows ? r : rows);
    order[t] = static_cast<int32_t>(t);
  }
}

/// flags[k] = 1 where a run of equal sorted keys starts (k = 0 or keys[k] != keys[k - 1]);
/// pos[k] = k (the values DeviceSelect::Flagged picks).
__global__ void embedding_run_flags_kernel(uint8_t* flags, int32_t* pos, const uint32_t* keys, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n; k += stride) {
    flags[k] = k == 0 || keys[k] != keys[k - 1];
    pos[k] = static_cast<int32_t>(k);
  }
}

/// table[key, c] += Σ_{k in run q} dout[order[k], c] for every run q < *num_runs (starts[q] ..
/// starts[q + 1], the last one ending at n) and column chunk of kRunCols·V columns: one block per
/// (run, chunk), grid-strided. Row lane y sums the run's entries y, y + kRunRows, ... (token
/// order), then the lanes are added in order: the same sums on every run. Keys >= rows are skipped.
template <int V, typename T>
__global__ void __launch_bounds__(kRunCols * kRunRows)
    embedding_backward_runs_kernel(float* table, const T* dout, const uint32_t* keys, const int32_t* order,
                                   const int32_t* starts, const int32_t* num_runs, int64_t rows, int64_t n,
                                   int64_t h) {
  __shared__ float red[kRunRows][kRunCols * V + 1];
  const int64_t runs = *num_runs;
  const int64_t width = kRunCols * V, chunks = (h + width - 1) / width;
  for (int64_t item = blockIdx.x; item < runs * chunks; item += gridDim.x) {
    const int64_t q = item / chunks, c = (item - q * chunks) * width + threadIdx.x * V;
    const int64_t lo = starts[q], hi = q + 1 < runs ? starts[q + 1] : n;
    const int64_t row = keys[lo];
    if (row >= rows) continue;  // out-of-range ids (block-uniform)
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.f;
    if (c < h) {  // V > 1 only when h % V == 0
      for (int64_t k = lo + threadIdx.y; k < hi; k += kRunRows) {
        const Vec<T, V> v = *reinterpret_cast<const Vec<T, V>*>(dout + static_cast<int64_t>(order[k]) * h + c);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] += to_f32(v.v[e]);
      }
    }
#pragma unroll
    for (int e = 0; e < V; ++e) red[threadIdx.y][threadIdx.x * V + e] = acc[e];
    __syncthreads();
    if (threadIdx.y == 0 && c < h) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        float s = 0.f;
#pragma unroll
        for (int y = 0; y < kRunRows; ++y) s += red[y][threadIdx.x * V + e];
        table[row * h + c + e] += s;
      }
    }
    __syncthreads();  // red is reused by the next item
  }
}

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

/// table[idx[t] - start, :] += dout[t, :] for ids in [start, start + rows), deterministically (see
/// the file comment). Scratch: the stream's workspace. Errors: mt::Error when the index arrays
/// and CUB's temporary storage exceed it (about 1.1 M tokens), or rows / n exceed int32.
template <typename T>
void accumulate_sorted(float* table, const T* dout, const int32_t* idx, int64_t start, int64_t rows, int64_t n,
                       int64_t h, const Stream& stream, const char* fn) {
  MT_CHECK(rows < INT32_MAX && n < INT32_MAX, "{}: {} rows / {} tokens exceed the deterministic kernel's int32 "
           "indices", fn, rows, n);
  MT_CHECK(stream.cuda() != nullptr && stream.cuda()->workspace != nullptr, "{}: needs a CUDA stream", fn);
  const cudaStream_t st = raw(stream);
  int end_bit = 1;  // the keys, sentinel `rows` included, fit in end_bit bits
  while ((int64_t{1} << end_bit) <= rows) ++end_bit;
  // Workspace layout: keys [2][n], order [2][n], pos [n], starts [n], num_runs, flags [n], CUB temp.
  char* base = static_cast<char*>(stream.cuda()->workspace);
  const size_t words = align256(static_cast<size_t>(n) * 4);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    char* p = base + off;
    off += align256(bytes);
    return p;
  };
  uint32_t* keys0 = reinterpret_cast<uint32_t*>(take(words));
  uint32_t* keys1 = reinterpret_cast<uint32_t*>(take(words));
  int32_t* order0 = reinterpret_cast<int32_t*>(take(words));
  int32_t* order1 = reinterpret_cast<int32_t*>(take(words));
  int32_t* pos = reinterpret_cast<int32_t*>(take(words));
  int32_t* starts = reinterpret_cast<int32_t*>(take(words));
  int32_t* num_runs = reinterpret_cast<int32_t*>(take(4));
  uint8_t* flags = reinterpret_cast<uint8_t*>(take(static_cast<size_t>(n)));
  void* temp = base + off;
  cub::DoubleBuffer<uint32_t> keys(keys0, keys1);
  cub::DoubleBuffer<int32_t> order(order0, order1);
  size_t sort_bytes = 0, select_bytes = 0;
  MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys, order, n, 0, end_bit, st));
  MT_CUDA_CHECK(cub::DeviceSelect::Flagged(nullptr, select_bytes, pos, flags, starts, num_runs, n, st));
  const size_t need = off + std::max(sort_bytes, select_bytes);
  MT_CHECK(need <= CudaStreamResources::kWorkspaceBytes,
           "{}: the deterministic gradient of {} tokens needs {} bytes of scratch, more than the stream's {}", fn, n,
           need, CudaStreamResources::kWorkspaceBytes);

  const unsigned grid = ew::grid_for(n, kThreads, stream);
  embedding_sort_keys_kernel<<<grid, kThreads, 0, st>>>(keys.Current(), order.Current(), idx, start, rows, n);
  MT_CUDA_CHECK_LAUNCH();
  MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, sort_bytes, keys, order, n, 0, end_bit, st));
  embedding_run_flags_kernel<<<grid, kThreads, 0, st>>>(flags, pos, keys.Current(), n);
  MT_CUDA_CHECK_LAUNCH();
  MT_CUDA_CHECK(cub::DeviceSelect::Flagged(temp, select_bytes, pos, flags, starts, num_runs, n, st));
  constexpr int V = ew::kVec16<T>;
  auto launch = [&](auto vtag) {
    constexpr int VV = decltype(vtag)::value;
    const int64_t chunks = (h + kRunCols * VV - 1) / (kRunCols * VV);
    const unsigned g = ew::grid_for(n * chunks, 1, stream, /*per_sm=*/8);
    embedding_backward_runs_kernel<VV><<<g, dim3(kRunCols, kRunRows), 0, st>>>(
        table, dout, keys.Current(), order.Current(), starts, num_runs, rows, n, h);
    MT_CUDA_CHECK_LAUNCH();
  };
  if (h % V == 0 && ew::aligned16(dout)) {
    launch(std::integral_constant<int, V>{});
  } else {
    launch(std::integral_constant<int, 1>{});
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
                        const Tensor& positions, int64_t vocab_start, bool deterministic, const Stream& stream) {
  const int64_t n_tok = ids.numel(), s = ids.size(0), b = ids.size(1), h = dout.size(2);
  if (n_tok == 0 || h == 0) return;
  const char* fn = "embedding_backward";
  ew::dispatch_float(dout.dtype(), fn, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* pd = static_cast<const T*>(dout.data());
    const unsigned grid = ew::grid_for(n_tok * h, kThreads, stream);
    // table[idx - start] += dout for idx in [start, start + rows): sorted (deterministic) or atomics.
    auto scatter_add = [&](const Tensor& table, const Tensor& idx, int64_t start) {
      if (deterministic) {
        accumulate_sorted(table.data_as<float>(), pd, idx.data_as<int32_t>(), start, table.size(0), n_tok, h, stream,
                          fn);
      } else {
        embedding_backward_atomic_kernel<<<grid, kThreads, 0, raw(stream)>>>(
            table.data_as<float>(), pd, idx.data_as<int32_t>(), start, table.size(0), n_tok, h);
        MT_CUDA_CHECK_LAUNCH();
      }
    };
    scatter_add(dwte, ids, vocab_start);
    if (dwpe.empty()) return;
    if (positions.empty()) {
      embedding_backward_wpe_kernel<<<ew::grid_for(s * h, kThreads, stream), kThreads, 0, raw(stream)>>>(
          dwpe.data_as<float>(), pd, s, b, h);
      MT_CUDA_CHECK_LAUNCH();
    } else {
      scatter_add(dwpe, positions, 0);
    }
  });
}

}  // namespace mt::cuda
