// CUDA backend of ops/moe_block.h (index maps of the static-buffer MoE dispatch). Same integers as
// the CPU reference (ops/cpu/moe_block.cpp), computed with one thread per row:
//
// moe_block_send_layout: slot_send preset to -1 (memset); one block of 1024 threads scans the
//   counts (int64, negative ones as 0) into P[0..Ev] in scratch, writes sent[e] = clamp(B - (P[e] -
//   P[first expert of e's destination]), 0, counts[e]) and adds the dropped slots (a block sum in
//   int64, converted once to fp32 as the CPU does) to overflow[0]; then one thread per send row
//   q = m·B + o reads its destination's run [P[m·Lv], P[(m+1)·Lv]) and writes send_index[q] and
//   slot_send[send_index[q]] = q (disjoint writes: row_index holds distinct slots).
// moe_block_receive_layout: gather_index preset to -1 (memset); one block of 1024 threads: one warp
//   per source c scans its row of sent_all over the local experts (int64, negative entries as 0)
//   into the clipped prefix pb[c][i] = min(B, Σ_{i' < i}) (scratch [C][L + 1]); then per local
//   expert i: local_counts[i] = Σ_c (pb[c][i+1] - pb[c][i]), its first expert-ordered row (a block
//   scan over i), and off[i][c] = the first expert-ordered row of (expert i, source c) (scratch
//   [L][C]); then one thread per received row c·B + o < c·B + pb[c][L] finds its expert by binary
//   search in pb[c] and writes scatter_index and gather_index (disjoint writes).
// Nothing is read on the host, nothing allocated, no floating point beyond the one fp32 add of
// the overflow counter: deterministic and capturable in a CUDA graph.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "ops/cuda/common.cuh"
#include "ops/moe_block.h"

namespace mt::cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kPrepThreads = 1024;  // the one-block prep kernels
constexpr int kRowThreads = 256;    // the per-row kernels

__device__ __forceinline__ int64_t clamp0(int64_t x, int64_t hi) { return x < 0 ? 0 : (x > hi ? hi : x); }

/// Inclusive prefix sum over the warp (lane order).
__device__ __forceinline__ int64_t warp_inclusive_scan(int64_t x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

/// Exclusive prefix of v across the block (thread order); *total = the block's sum. Every thread
/// of the block calls it; blockDim.x is a multiple of 32.
__device__ int64_t block_exclusive_scan(int64_t v, int64_t* total) {
  __shared__ int64_t wsum[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int64_t x = warp_inclusive_scan(v);
  if (lane == 31) wsum[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const int64_t s = warp_inclusive_scan(lane < nw ? wsum[lane] : 0);
    wsum[lane] = s;
  }
  __syncthreads();
  const int64_t prefix = (warp > 0 ? wsum[warp - 1] : 0) + x - v;
  *total = wsum[nw - 1];
  __syncthreads();
  return prefix;
}

/// Block-wide sum (fixed order; integers, so exact anyway); valid in every thread.
__device__ int64_t block_sum(int64_t v) {
  int64_t total;
  block_exclusive_scan(v, &total);
  return total;
}

// ---- send ------------------------------------------------------------------------------------------

/// One block: P[e] = Σ_{e' < e} max(0, counts[e']) for e <= Ev (scratch), sent[e], overflow[0].
__global__ void __launch_bounds__(kPrepThreads)
    send_prep_kernel(int64_t* __restrict__ P, int32_t* __restrict__ sent, float* __restrict__ overflow,
                     const int32_t* __restrict__ counts, int Ev, int Lv, int64_t B) {
  int64_t carry = 0;
  for (int e0 = 0; e0 < Ev; e0 += blockDim.x) {
    const int e = e0 + threadIdx.x;
    const int64_t v = e < Ev ? (counts[e] > 0 ? counts[e] : 0) : 0;
    int64_t total;
    const int64_t p = block_exclusive_scan(v, &total);
    if (e < Ev) P[e] = carry + p;
    carry += total;
  }
  if (threadIdx.x == 0) P[Ev] = carry;
  __syncthreads();  // P in global memory, visible to the block after the barrier
  int64_t dropped = 0;
  for (int e = threadIdx.x; e < Ev; e += blockDim.x) {
    const int64_t pre = P[e] - P[(e / Lv) * Lv], c = P[e + 1] - P[e];
    const int64_t s = clamp0(B - pre, c);
    sent[e] = static_cast<int32_t>(s);
    dropped += c - s;
  }
  dropped = block_sum(dropped);
  if (threadIdx.x == 0 && overflow != nullptr) overflow[0] += static_cast<float>(dropped);
}

/// One thread per send row q = m·B + o: send_index[q], and slot_send[send_index[q]] = q.
__global__ void __launch_bounds__(kRowThreads)
    send_rows_kernel(int32_t* __restrict__ send_index, int32_t* __restrict__ slot_send, const int64_t* __restrict__ P,
                     const int32_t* __restrict__ row_index, int64_t n, int Lv, int64_t B, int64_t rows) {
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < rows;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = q / B, o = q - m * B;
    const int64_t start = P[m * Lv], run = P[(m + 1) * Lv] - start;
    int32_t v = -1;
    if (o < run && start + o < n) {
      const int32_t i = row_index[start + o];
      if (i >= 0 && i < n) v = i;
    }
    send_index[q] = v;
    if (v >= 0) slot_send[v] = static_cast<int32_t>(q);
  }
}

// ---- receive ---------------------------------------------------------------------------------------

/// Scratch of the receive layout: pb [C][L + 1] (clipped prefix within each block), off [L][C]
/// (the first expert-ordered row of each (local expert, source)).
struct RecvScratch {
  int32_t* pb;
  int32_t* off;
};

__global__ void __launch_bounds__(kPrepThreads)
    recv_prep_kernel(RecvScratch w, int32_t* __restrict__ local_counts, const int32_t* __restrict__ sent_all, int C,
                     int Ev, int first, int L, int64_t B) {
  const int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  for (int c = threadIdx.x >> 5; c < C; c += nwarps) {  // one warp per source: its clipped prefix
    const int32_t* row = sent_all + static_cast<int64_t>(c) * Ev + first;
    int32_t* pb = w.pb + static_cast<int64_t>(c) * (L + 1);
    if (lane == 0) pb[0] = 0;
    int64_t carry = 0;
    for (int i0 = 0; i0 < L; i0 += 32) {
      const int i = i0 + lane;
      const int64_t v = i < L ? (row[i] > 0 ? row[i] : 0) : 0;
      const int64_t x = warp_inclusive_scan(v);
      if (i < L) pb[i + 1] = static_cast<int32_t>(carry + x < B ? carry + x : B);
      carry += __shfl_sync(kFull, x, 31);
    }
  }
  __syncthreads();
  int64_t carry = 0;  // first expert-ordered row of expert i
  for (int i0 = 0; i0 < L; i0 += blockDim.x) {
    const int i = i0 + threadIdx.x;
    int64_t rows = 0;
    if (i < L)
      for (int c = 0; c < C; ++c) {
        const int32_t* pb = w.pb + static_cast<int64_t>(c) * (L + 1);
        rows += pb[i + 1] - pb[i];
      }
    int64_t total;
    const int64_t base = carry + block_exclusive_scan(rows, &total);
    if (i < L) {
      local_counts[i] = static_cast<int32_t>(rows);
      int64_t run = base;
      for (int c = 0; c < C; ++c) {
        const int32_t* pb = w.pb + static_cast<int64_t>(c) * (L + 1);
        w.off[static_cast<int64_t>(i) * C + c] = static_cast<int32_t>(run);
        run += pb[i + 1] - pb[i];
      }
    }
    carry += total;
  }
}

/// One thread per received row c·B + o: scatter_index, and gather_index[scatter_index] = the row.
__global__ void __launch_bounds__(kRowThreads)
    recv_rows_kernel(int32_t* __restrict__ gather_index, int32_t* __restrict__ scatter_index, RecvScratch w, int C,
                     int L, int64_t B, int64_t rows) {
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = r / B, o = r - c * B;
    const int32_t* pb = w.pb + c * (L + 1);
    if (o >= pb[L]) {
      scatter_index[r] = -1;
      continue;
    }
    int lo = 0, hi = L;  // the last i with pb[i] <= o: pb[lo] <= o < pb[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (pb[mid] <= o) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const int64_t q = w.off[static_cast<int64_t>(lo) * C + c] + (o - pb[lo]);
    scatter_index[r] = static_cast<int32_t>(q);
    gather_index[q] = static_cast<int32_t>(r);
  }
}

void* scratch(const Stream& stream, size_t bytes, const char* fn) {
  MT_CHECK(stream.cuda() != nullptr && stream.cuda()->workspace != nullptr, "{}: needs a CUDA stream", fn);
  MT_CHECK(bytes <= CudaStreamResources::kWorkspaceBytes, "{}: needs {} bytes of scratch, more than the stream's {}",
           fn, bytes, CudaStreamResources::kWorkspaceBytes);
  return stream.cuda()->workspace;
}

unsigned row_blocks(int64_t rows) { return grid_for(rows, kRowThreads); }

}  // namespace

void moe_block_send_layout(const Tensor& send_index, const Tensor& slot_send, const Tensor& sent,
                           const Tensor& overflow, const Tensor& counts, const Tensor& row_index, int64_t num_dest,
                           int64_t block, const Stream& stream) {
  const char* fn = "moe_block_send_layout";
  const int64_t Ev = counts.numel(), Lv = Ev / num_dest, n = row_index.numel(), rows = num_dest * block;
  MT_CHECK(Ev < INT32_MAX, "{}: {} experts exceed the CUDA kernels' range", fn, Ev);
  auto* P = static_cast<int64_t*>(scratch(stream, static_cast<size_t>(Ev + 1) * 8, fn));
  cudaStream_t s = cu(stream);
  if (n > 0) MT_CUDA_CHECK(cudaMemsetAsync(slot_send.data(), 0xff, static_cast<size_t>(n) * 4, s));
  send_prep_kernel<<<1, kPrepThreads, 0, s>>>(P, sent.data_as<int32_t>(),
                                              overflow.empty() ? nullptr : overflow.data_as<float>(),
                                              counts.data_as<int32_t>(), static_cast<int>(Ev), static_cast<int>(Lv),
                                              block);
  MT_CUDA_CHECK_LAUNCH();
  if (rows == 0) return;
  send_rows_kernel<<<row_blocks(rows), kRowThreads, 0, s>>>(send_index.data_as<int32_t>(), slot_send.data_as<int32_t>(),
                                                            P, row_index.data_as<int32_t>(), n, static_cast<int>(Lv),
                                                            block, rows);
  MT_CUDA_CHECK_LAUNCH();
}

void moe_block_receive_layout(const Tensor& gather_index, const Tensor& scatter_index, const Tensor& local_counts,
                              const Tensor& sent_all, int64_t first, int64_t num_local, int64_t block,
                              const Stream& stream) {
  const char* fn = "moe_block_receive_layout";
  const int64_t C = sent_all.size(0), Ev = sent_all.size(1), L = num_local, rows = C * block;
  MT_CHECK(C < INT32_MAX && Ev < INT32_MAX, "{}: sent_all {} exceeds the CUDA kernels' range", fn, sent_all.str());
  const auto align = [](size_t b) { return (b + 255) & ~size_t{255}; };
  const size_t pb_bytes = align(static_cast<size_t>(C * (L + 1)) * 4), off_bytes = static_cast<size_t>(L * C) * 4;
  char* base = static_cast<char*>(scratch(stream, pb_bytes + off_bytes, fn));
  const RecvScratch w{reinterpret_cast<int32_t*>(base), reinterpret_cast<int32_t*>(base + pb_bytes)};
  cudaStream_t s = cu(stream);
  if (rows > 0) MT_CUDA_CHECK(cudaMemsetAsync(gather_index.data(), 0xff, static_cast<size_t>(rows) * 4, s));
  recv_prep_kernel<<<1, kPrepThreads, 0, s>>>(w, local_counts.data_as<int32_t>(), sent_all.data_as<int32_t>(),
                                              static_cast<int>(C), static_cast<int>(Ev), static_cast<int>(first),
                                              static_cast<int>(L), block);
  MT_CUDA_CHECK_LAUNCH();
  if (rows == 0) return;
  recv_rows_kernel<<<row_blocks(rows), kRowThreads, 0, s>>>(gather_index.data_as<int32_t>(),
                                                            scatter_index.data_as<int32_t>(), w, static_cast<int>(C),
                                                            static_cast<int>(L), block, rows);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
