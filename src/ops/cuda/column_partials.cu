// ops/cuda/column_partials.cuh: the deterministic second pass of the gradient column sums.
#include "ops/cuda/column_partials.cuh"

#include <algorithm>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "ops/cuda/common.cuh"

namespace mt::cuda {
namespace {

/// Partial column sums: part[blockIdx.y, c] = Σ x[r, c] over the rows r = blockIdx.y · 8 +
/// threadIdx.y + k · 8 · gridDim.y (overwrite; add_column_partials adds the partial rows in a fixed
/// order). Block (32, 8); thread x owns the V columns (blockIdx.x · 32 + threadIdx.x) · V + [0, V)
/// (16-byte loads when V > 1); the 8 row lanes of a column are added in shared memory in order.
constexpr int kColLanes = 32, kColRows = 8;
template <int V, typename T>
__global__ void __launch_bounds__(kColLanes * kColRows)
    column_partials_kernel(float* part, const T* x, int64_t rows, int64_t cols) {
  __shared__ float red[kColRows][kColLanes * V + 1];
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kColLanes + threadIdx.x) * V;
  float acc[V];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = 0.f;
  if (c0 < cols) {
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * kColRows + threadIdx.y; r < rows;
         r += static_cast<int64_t>(kColRows) * gridDim.y) {
      if constexpr (V == 1) {
        acc[0] += to_f(x[r * cols + c0]);
      } else {
        const uint4 raw = *reinterpret_cast<const uint4*>(x + r * cols + c0);
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += to_f(v[k]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) red[threadIdx.y][threadIdx.x * V + k] = acc[k];
  __syncthreads();
  const int tid = threadIdx.y * kColLanes + threadIdx.x;
  for (int j = tid; j < kColLanes * V; j += kColLanes * kColRows) {
    const int64_t col = static_cast<int64_t>(blockIdx.x) * kColLanes * V + j;
    if (col >= cols) continue;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kColRows; ++i) sum += red[i][j];
    part[static_cast<int64_t>(blockIdx.y) * cols + col] = sum;
  }
}


// 8 columns x 64 lanes per block: for h = 768 and ~350 partial rows, 96 blocks whose lanes each
// add ~6 rows (32 columns x 16 lanes: 24 blocks of 22-row chains, latency-bound).
constexpr int kCols = 8;    // columns per block
constexpr int kLanes = 64;  // partial rows summed in parallel per column

struct Pairs {
  float* dst[2];
  const float* part[2];
};

/// Block (kCols, kLanes), grid (ceil(h / kCols), count): column c of gradient blockIdx.y.
__global__ void __launch_bounds__(kCols * kLanes) add_column_partials_kernel(Pairs pr, int64_t P, int64_t h) {
  __shared__ float red[kLanes][kCols + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCols + threadIdx.x;
  const float* part = pr.part[blockIdx.y];
  float acc = 0.f;
  if (c < h) {
#pragma unroll 4
    for (int64_t p = threadIdx.y; p < P; p += kLanes) acc += part[p * h + c];
  }
  red[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < h) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kLanes; ++i) s += red[i][threadIdx.x];
    pr.dst[blockIdx.y][c] += s;
  }
}

}  // namespace

int64_t column_partials_rows(int64_t want, int64_t h, int count, const char* fn) {
  const int64_t cap = static_cast<int64_t>(CudaStreamResources::kWorkspaceBytes / sizeof(float)) / (count * h);
  MT_CHECK(cap >= 1, "{}: h={} too large for the deterministic gradient reduction ({} x {} fp32 partials exceed the "
           "stream's {}-byte workspace)", fn, h, count, h, CudaStreamResources::kWorkspaceBytes);
  return std::max<int64_t>(1, std::min(want, cap));
}

int64_t column_partials_grid_rows(int64_t rows, int64_t rows_per_block, int64_t col_blocks, int64_t h, int count,
                                  const Stream& stream, const char* fn) {
  const int sms = (stream.cuda() && stream.cuda()->num_sms > 0) ? stream.cuda()->num_sms : 132;
  const int64_t want = std::max<int64_t>(1, (static_cast<int64_t>(sms) * 8 + col_blocks - 1) / col_blocks);
  return column_partials_rows(std::min<int64_t>({(rows + rows_per_block - 1) / rows_per_block, want, 65535}), h, count,
                              fn);
}

float* column_partials_scratch(const Stream& stream, const char* fn) {
  MT_CHECK(stream.cuda() != nullptr && stream.cuda()->workspace != nullptr, "{}: needs a CUDA stream", fn);
  return static_cast<float*>(stream.cuda()->workspace);
}

void add_column_partials(float* dst0, const float* part0, float* dst1, const float* part1, int64_t P, int64_t h,
                         const Stream& stream) {
  if (h == 0) return;
  const Pairs pr{{dst0, dst1}, {part0, part1}};
  const dim3 grid(static_cast<unsigned>((h + kCols - 1) / kCols), dst1 ? 2u : 1u);
  add_column_partials_kernel<<<grid, dim3(kCols, kLanes), 0, static_cast<cudaStream_t>(stream.cuda_stream())>>>(
      pr, P, h);
  MT_CUDA_CHECK_LAUNCH();
}

void column_sum_add(const Tensor& out, const void* x, DType act, int64_t m, int64_t n, const Stream& stream,
                    const char* fn) {
  dispatch_float(act, fn, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int V = 16 / sizeof(T);
    const bool vec = n % V == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
    const int64_t width = kColLanes * (vec ? V : 1);
    const int64_t gx = (n + width - 1) / width;
    const int64_t gy = column_partials_grid_rows(m, kColRows, gx, n, 1, stream, fn);
    float* part = column_partials_scratch(stream, fn);
    const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), block(kColLanes, kColRows);
    if (vec) {
      column_partials_kernel<V, T><<<grid, block, 0, cu(stream)>>>(part, static_cast<const T*>(x), m, n);
    } else {
      column_partials_kernel<1, T><<<grid, block, 0, cu(stream)>>>(part, static_cast<const T*>(x), m, n);
    }
    MT_CUDA_CHECK_LAUNCH();
    add_column_partials(out.data_as<float>(), part, nullptr, nullptr, gy, n, stream);
  });
}

}  // namespace mt::cuda
