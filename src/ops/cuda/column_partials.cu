// ops/cuda/column_partials.cuh: the deterministic second pass of the gradient column sums.
#include "ops/cuda/column_partials.cuh"

#include <algorithm>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"

namespace mt::cuda {
namespace {

constexpr int kCols = 32;   // columns per block
constexpr int kLanes = 16;  // partial rows summed in parallel per column

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

}  // namespace mt::cuda
