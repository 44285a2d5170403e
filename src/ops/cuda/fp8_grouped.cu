// CUDA backend of ops/fp8_grouped.h. Every CTA loads the counts (int32 [G], device memory) and
// forms the group offsets in shared memory (the grouped GEMMs' group_tables / find_group,
// ops/cuda/grouped_matmul_common.cuh), so nothing passes through the host (capturable).
// A CTA of 8 warps owns a 32 x 32 tile of x: warp w holds rows w + 8i (i < 4), lane l
// column l, so a row's 32 elements are one warp (its group's amax: a warp max, one atomic max of
// the ordered float bits per row and tile — order-independent, bit-identical to the CPU); q is
// written from registers, q_t through a shared-memory transpose. Not tuned: the grouped expert
// MLP quantises each input and gradient once per projection.
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "core/cuda_check.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/grouped_matmul_common.cuh"
#include "ops/cuda/fp8_out.cuh"
#include "ops/fp8_grouped.h"
#include "ops/fp8_math.h"

namespace mt::cuda {
namespace {

constexpr int kTile = 32;
constexpr int kRowsPerWarp = 4;  // 8 warps x 4 rows = the tile's 32 rows
using grouped::kMaxGroups;  // the grouped GEMMs' shared-memory group tables (1024 groups)

struct GroupArgs {
  const int32_t* counts = nullptr;
  int64_t groups = 0;
  const float* scale = nullptr;
  int64_t scale_stride = 1;
  uint32_t* amax = nullptr;  // fp8_grouped_amax's output or the record (null: none)
  int64_t amax_stride = 1;
  uint8_t* q = nullptr;
  uint8_t* q_t = nullptr;
  int64_t rows = 0, cols = 0, rows_t = 0;  // x [rows, cols], q_t [cols, rows_t]
};

__global__ void zero_values_kernel(uint32_t* v, int64_t stride, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) v[i * stride] = 0u;
}

// kQ: 0 amax only, 1 e4m3, 2 e5m2.
template <typename T, int kQ>
__global__ void __launch_bounds__(kTile * 8) grouped_tile_kernel(const T* __restrict__ x, GroupArgs p) {
  __shared__ int off[kMaxGroups + 1], tile[kMaxGroups + 1];  // group g's rows [off[g], off[g + 1])
  __shared__ uint8_t tq[kTile][kTile + 4];
  const int G = static_cast<int>(p.groups);
  grouped::group_tables(p.counts, G, static_cast<int>(p.rows), grouped::RowTiles{1, 1}, off, tile);
  const int64_t used = off[G];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t c = c0 + lane;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int ri = warp + 8 * i;
    const int64_t r = r0 + ri;
    uint8_t b = 0;
    if (r < used) {  // the whole warp agrees (one row)
      const int64_t g = grouped::find_group(off, G, static_cast<int>(r));
      const float v = c < p.cols ? to_f(x[r * p.cols + c]) : 0.f;
      if constexpr (kQ != 0) b = c < p.cols ? to_fp8<kQ == 1>(v, p.scale[g * p.scale_stride]) : uint8_t{0};
      if (p.amax) {
        const uint32_t m = warp_max(c < p.cols ? fp8_math::abs_bits_for_max(v) : 0u);
        if (lane == 0 && m != 0u) atomicMax(p.amax + g * p.amax_stride, m);
      }
    }
    if constexpr (kQ != 0) {
      if (p.q && r < p.rows && c < p.cols) p.q[r * p.cols + c] = b;
      tq[lane][ri] = b;
    }
  }
  if constexpr (kQ != 0) {
    if (p.q_t) {
      __syncthreads();
      // q_t [cols, rows_t]: row c0 + ci, columns r0 .. r0 + 31 (the tail columns zero)
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int ci = warp + 8 * i;
        const int64_t cc = c0 + ci, rr = r0 + lane;
        if (cc < p.cols && rr < p.rows_t) p.q_t[cc * p.rows_t + rr] = tq[ci][lane];
      }
    }
  }
}

template <int kQ>
void launch(const Tensor& x, const GroupArgs& p, int64_t grid_rows, const Stream& stream) {
  if (grid_rows == 0 || p.cols == 0) return;
  const dim3 grid(static_cast<unsigned>((p.cols + kTile - 1) / kTile),
                  static_cast<unsigned>((grid_rows + kTile - 1) / kTile));
  MT_CHECK(grid.y <= 65535u, "fp8_grouped: {} rows exceed the grid ({} at most)", grid_rows, 65535 * kTile);
  dispatch_float(x.dtype(), "fp8_grouped", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    grouped_tile_kernel<T, kQ><<<grid, kTile * 8, 0, cu(stream)>>>(x.data_as<T>(), p);
    MT_CUDA_CHECK_LAUNCH();
  });
}

GroupArgs base_args(const Tensor& x, const Tensor& counts) {
  GroupArgs p;
  p.counts = counts.data_as<int32_t>();
  p.groups = counts.size(0);
  MT_CHECK(p.groups <= kMaxGroups, "fp8_grouped: {} groups, at most {}", p.groups, kMaxGroups);
  p.rows = x.size(0);
  MT_CHECK(p.rows <= (int64_t{1} << 30), "fp8_grouped: {} rows, at most 2^30", p.rows);
  p.cols = x.size(1);
  return p;
}

}  // namespace

void fp8_grouped_amax(const Tensor& amax, const Tensor& x, const Tensor& counts, const Stream& stream) {
  GroupArgs p = base_args(x, counts);
  p.amax = amax.data_as<uint32_t>();
  p.amax_stride = fp8_grouped::value_stride(amax, p.groups, "fp8_grouped_amax", "amax");
  zero_values_kernel<<<static_cast<unsigned>((p.groups + 255) / 256), 256, 0, cu(stream)>>>(p.amax, p.amax_stride,
                                                                                          p.groups);
  MT_CUDA_CHECK_LAUNCH();
  launch<0>(x, p, p.rows, stream);
}

void fp8_grouped_quantize(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale,
                          const Tensor& record, const Tensor& counts, const Stream& stream) {
  GroupArgs p = base_args(x, counts);
  p.scale = scale.data_as<float>();
  p.scale_stride = fp8_grouped::value_stride(scale, p.groups, "fp8_grouped_quantize", "scale");
  if (!record.empty()) {
    p.amax = record.data_as<uint32_t>();
    p.amax_stride = fp8_grouped::value_stride(record, p.groups, "fp8_grouped_quantize", "record");
  }
  p.q = q.empty() ? nullptr : q.data_as<uint8_t>();
  p.q_t = q_t.empty() ? nullptr : q_t.data_as<uint8_t>();
  p.rows_t = q_t.empty() ? p.rows : q_t.size(1);
  const DType t = q.empty() ? q_t.dtype() : q.dtype();
  // the grid covers q_t's padded columns too (written as zeros)
  if (t == DType::kF8E4M3) {
    launch<1>(x, p, p.rows_t, stream);
  } else {
    launch<2>(x, p, p.rows_t, stream);
  }
}

}  // namespace mt::cuda
