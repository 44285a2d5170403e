// CUDA grouped linear layers (ops/grouped_matmul.h): the per-group row counts are read on the
// device, so nothing here synchronises with the host. Each entry point first offers the call to
// the Hopper wgmma kernel (ops/cuda/grouped_matmul_sm90.cu: compute capability 9.0, bf16/fp16,
// aligned); the kernels below run everything it does not take.
//
// Every block first turns the G counts into the groups' row offsets (clipped at R) and, for the
// forward and dgrad, the prefix of their row tiles (warp 0: a per-lane serial sum over a run of
// groups, then a warp scan), all in shared memory. Forward / dgrad: the grid has ceil(R/BM) + G
// row-tile slots (enough for any counts summing to <= R: Σ ceil(c_g/BM) <= ceil(R/BM) + G - 1) by
// ceil(N/BN) column tiles; slot b holds row tile b - tiles_before(g) of the group g found by a
// binary search, and the slots beyond the last tile zero the tail rows [Σc, R). Wgrad: one block
// per (group, n tile, k tile) reduces over the group's rows; an empty group returns at once.
//
// Tensor-core kernel (bf16 / fp16): 128x128 block tile, BK = 32, 8 warps of 64x32, mma.sync
// m16n8k16 with fp32 accumulators, operands staged in shared memory by cp.async (16-byte chunks,
// zero-filled outside the matrix) over a 3-stage pipeline, fragments read by ldmatrix (.trans for
// the operands stored M- or N-contiguous: the dgrad's weight, both operands of the wgrad); padded
// shared-memory rows keep ldmatrix free of bank conflicts. Needs n, k multiples of 8 and 16-byte
// aligned pointers (the chunks); otherwise, and for fp32, the SIMT kernel: 64x64 tiles, BK = 16,
// 4x4 outputs per thread, fp32 FMA in a fixed order (fp32 results match the CPU to ~1e-6).
// Determinism: each output element is computed by one thread of one block in a fixed order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops/grouped_matmul.h"  // first: elementwise_common.cuh needs Tensor, Stream, DType

#include "ops/fp8.h"

#include "core/cuda_check.h"
#include "ops/cuda/elementwise_common.cuh"
#include "ops/cuda/grouped_matmul_common.cuh"
#include "ops/cuda/grouped_matmul_sm90.cuh"

namespace mt::cuda {
namespace {

using ew::raw;
using grouped::find_group;
using grouped::group_tables;
using grouped::kMaxGroups;
using grouped::RowTiles;
constexpr int kThreads = 256;

enum class Mode { kForward, kDgrad, kWgrad };

struct Params {
  const void* a;         // forward: x [R, k]; dgrad, wgrad: dy [R, n]
  const void* b;         // wgrad: x [R, k]; else unused (the weights come from `table`)
  void* c;               // forward: y [R, n]; dgrad: dx [R, k]; wgrad: unused (fp32 grads in `table`)
  void* const* table;    // G weights [n, k] (forward, dgrad) or G fp32 gradients [n, k] (wgrad)
  const int32_t* counts;  // [G]
  int G, R, n, k;
};

/// What a block of the forward/dgrad computes: group g's row tile `mt` (rows [off + mt·bm, ...)
/// of `rows` rows in the group), or, with g < 0, the tail tile starting at row `tail_row`.
struct RowTile {
  int g, off, rows, m0, tail_row;
};

__device__ __forceinline__ RowTile row_tile(const int* off, const int* tile, int G, int R, int bm) {
  RowTile t{};
  const int b = static_cast<int>(blockIdx.y);
  t.g = find_group(tile, G, b);
  if (t.g < 0) {
    t.tail_row = off[G] + (b - tile[G]) * bm;
    return t;
  }
  t.off = off[t.g];
  t.rows = off[t.g + 1] - off[t.g];
  t.m0 = (b - tile[t.g]) * bm;
  return t;
}

/// Zeroes rows [row0, min(row0 + bm, R)) x columns [col0, min(col0 + bn, N)) of c [R, N].
template <typename T>
__device__ void zero_tile(T* __restrict__ c, int row0, int R, int N, int col0, int bm, int bn) {
  const int r1 = min(row0 + bm, R), c1 = min(col0 + bn, N);
  if (row0 >= r1 || col0 >= c1) return;
  const int w = c1 - col0;
  for (int e = threadIdx.x; e < (r1 - row0) * w; e += blockDim.x) {
    const int r = row0 + e / w, col = col0 + e % w;
    c[static_cast<int64_t>(r) * N + col] = T(0.f);
  }
}

// ---- the SIMT kernel (fp32, and the fallback of bf16/fp16) ---------------------------------------

constexpr int kSM = 64, kSN = 64, kSK = 16;

template <typename T>
__device__ __forceinline__ float ld_f(const T* p) {
  return ew::to_f32(*p);
}

/// Element (i, r) of operand A and (j, r) of operand B of mode kMode (r: the reduction index),
/// relative to the group's first row.
template <Mode kMode, typename T>
struct Operands {
  const T* a;
  const T* b;
  int n, k;
  __device__ float A(int i, int r) const {
    if constexpr (kMode == Mode::kWgrad) return ld_f(a + static_cast<int64_t>(r) * n + i);  // dy[r, i]
    if constexpr (kMode == Mode::kForward) return ld_f(a + static_cast<int64_t>(i) * k + r);  // x[i, r]
    return ld_f(a + static_cast<int64_t>(i) * n + r);                                      // dy[i, r]
  }
  __device__ float B(int j, int r) const {
    if constexpr (kMode == Mode::kForward) return ld_f(b + static_cast<int64_t>(j) * k + r);  // W[j, r]
    return ld_f(b + static_cast<int64_t>(r) * k + j);  // dgrad: W[r, j]; wgrad: x[r, j]
  }
};

template <typename T, Mode kMode>
__global__ void __launch_bounds__(kThreads) simt_kernel(Params p) {
  __shared__ int s_off[kMaxGroups + 1], s_tile[kMaxGroups + 1];
  __shared__ float As[kSK][kSM + 1], Bs[kSK][kSN + 1];
  constexpr bool kWgrad = kMode == Mode::kWgrad;
  group_tables(p.counts, p.G, p.R, RowTiles{kWgrad ? 0 : kSM, 1}, s_off, s_tile);
  // Problem of this block: C[M, N] (+)= A[M, Kr] · B[N, Kr]ᵀ over its tile.
  int g, M, N, Kr, m0, off;
  if constexpr (kWgrad) {
    g = blockIdx.z;
    off = s_off[g];
    Kr = s_off[g + 1] - off;
    if (Kr == 0) return;
    M = p.n;
    N = p.k;
    m0 = blockIdx.y * kSM;
  } else {
    const RowTile t = row_tile(s_off, s_tile, p.G, p.R, kSM);
    N = kMode == Mode::kForward ? p.n : p.k;
    if (t.g < 0) {
      zero_tile(static_cast<T*>(p.c), t.tail_row, p.R, N, blockIdx.x * kSN, kSM, kSN);
      return;
    }
    g = t.g;
    off = t.off;
    M = t.rows;
    m0 = t.m0;
    Kr = kMode == Mode::kForward ? p.k : p.n;
  }
  const int n0 = blockIdx.x * kSN;
  Operands<kMode, T> op;
  op.n = p.n;
  op.k = p.k;
  if constexpr (kWgrad) {
    op.a = static_cast<const T*>(p.a) + static_cast<int64_t>(off) * p.n;
    op.b = static_cast<const T*>(p.b) + static_cast<int64_t>(off) * p.k;
  } else {
    op.a = static_cast<const T*>(p.a) + static_cast<int64_t>(off) * (kMode == Mode::kForward ? p.k : p.n);
    op.b = static_cast<const T*>(p.table[g]);
  }
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int r0 = 0; r0 < Kr; r0 += kSK) {
    for (int e = threadIdx.x; e < kSK * kSM; e += kThreads) {
      const int kk = e / kSM, mm = e % kSM, r = r0 + kk;
      As[kk][mm] = (m0 + mm < M && r < Kr) ? op.A(m0 + mm, r) : 0.f;
      Bs[kk][mm] = (n0 + mm < N && r < Kr) ? op.B(n0 + mm, r) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + ty + 16 * i;
    if (m >= M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = n0 + tx + 16 * j;
      if (col >= N) continue;
      if constexpr (kWgrad) {
        float* dw = static_cast<float*>(p.table[g]);
        dw[static_cast<int64_t>(m) * N + col] += acc[i][j];
      } else {
        static_cast<T*>(p.c)[static_cast<int64_t>(off + m) * N + col] = ew::from_f32<T>(acc[i][j]);
      }
    }
  }
}

// ---- the tensor-core kernel (bf16 / fp16) -------------------------------------------------------

constexpr int kBM = 128, kBN = 128, kBK = 32, kStages = 3, kPad = 8;

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: nothing read, the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <bool kTrans>
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
  }
}

/// The four 8x8 matrices of one ldsm_x4 of B (n rows 16 nj.. +16) as the b operands of the two
/// mma n-tiles 2 nj and 2 nj + 1.
__device__ __forceinline__ void split_b_x4(unsigned (&bf)[4][2], int nj, const unsigned (&r)[4]) {
  bf[2 * nj][0] = r[0];
  bf[2 * nj][1] = r[1];
  bf[2 * nj + 1][0] = r[2];
  bf[2 * nj + 1][1] = r[3];
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

/// The cp.async k loop of the tensor-core kernels: kStages - 1 k tiles in flight. load(stage, kt)
/// issues the loads of k tile kt into ring slot `stage`; compute(stage) consumes a landed slot.
template <int kStages, typename Load, typename Compute>
__device__ __forceinline__ void k_pipeline(int ktiles, Load&& load, Compute&& compute) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt landed for every thread (byte stores visible); stage kt - 1 is free
    {
      const int next = kt + kStages - 1;
      if (next < ktiles) load(next % kStages, next);
      cp_async_commit();
    }
    compute(kt % kStages);
  }
  cp_async_wait<0>();
}

/// The epilogue walk of a warp's 64x32 block at (m0, n0) held as 4x4 m16n8 fragments (thread
/// (g = lane / 4, t = lane % 4) holds rows g, g + 8 and columns 2t, 2t + 1 of each): fn(m, col, v0,
/// v1) for the rows m < M and the column pairs col < N (N even: col + 1 < N too).
template <typename Fn>
__device__ __forceinline__ void for_each_pair(const float (&acc)[4][4][4], int m0, int n0, int M, int N, Fn&& fn) {
  const int lane = threadIdx.x & 31, gr = lane >> 2, tc = (lane & 3) * 2;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + mi * 16 + gr + h * 8;
      if (m >= M) continue;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int col = n0 + ni * 8 + tc;
        if (col < N) fn(m, col, acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
      }
    }
  }
}

/// d[0..1] += (v0, v1): the fp32 weight gradient's read-modify-write of a column pair.
__device__ __forceinline__ void add_pair(float* d, float v0, float v1) {
  float2 o = *reinterpret_cast<float2*>(d);
  o.x += v0;
  o.y += v1;
  *reinterpret_cast<float2*>(d) = o;
}

/// One operand tile in shared memory: kOuter rows of kInner contiguous elements (+ kPad), filled
/// by cp.async from a matrix with `ld` elements per row, rows < outer_lim and columns < inner_lim
/// valid (inner_lim a multiple of 8), the rest zero.
template <typename T, int kOuter, int kInner>
struct Tile {
  static constexpr int kLd = kInner + kPad;
  static constexpr int kElems = kOuter * kLd;
  __device__ static void load(T* s, const T* g, int64_t ld, int outer0, int inner0, int outer_lim, int inner_lim) {
    constexpr int kChunks = kInner / 8;
#pragma unroll
    for (int i = 0; i < kOuter * kChunks / kThreads; ++i) {
      const int q = threadIdx.x + i * kThreads, o = q / kChunks, c = (q % kChunks) * 8;
      const int go = outer0 + o, gi = inner0 + c;
      const bool valid = go < outer_lim && gi < inner_lim;
      cp_async16(s + o * kLd + c, valid ? g + static_cast<int64_t>(go) * ld + gi : g, valid);
    }
  }
};

/// Shared memory of the tensor-core kernel (dynamic part).
template <typename T, Mode kMode>
constexpr size_t tc_smem_bytes() {
  constexpr bool kAk = kMode != Mode::kWgrad, kBk = kMode == Mode::kForward;
  constexpr int a = kAk ? Tile<T, kBM, kBK>::kElems : Tile<T, kBK, kBM>::kElems;
  constexpr int b = kBk ? Tile<T, kBN, kBK>::kElems : Tile<T, kBK, kBN>::kElems;
  return static_cast<size_t>(kStages) * (a + b) * sizeof(T);
}

template <typename T, Mode kMode>
__global__ void __launch_bounds__(kThreads) tc_kernel(Params p) {
  // A is K-contiguous (x, dy as [rows, reduction]) except in the wgrad (dyᵀ: M-contiguous); B is
  // K-contiguous in the forward (W[n, k]) and N-contiguous otherwise (W in the dgrad, x in the wgrad).
  constexpr bool kAk = kMode != Mode::kWgrad, kBk = kMode == Mode::kForward, kWgrad = kMode == Mode::kWgrad;
  using TileA = std::conditional_t<kAk, Tile<T, kBM, kBK>, Tile<T, kBK, kBM>>;
  using TileB = std::conditional_t<kBk, Tile<T, kBN, kBK>, Tile<T, kBK, kBN>>;
  __shared__ int s_off[kMaxGroups + 1], s_tile[kMaxGroups + 1];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sA = reinterpret_cast<T*>(smem_raw);
  T* sB = sA + kStages * TileA::kElems;

  group_tables(p.counts, p.G, p.R, RowTiles{kWgrad ? 0 : kBM, 1}, s_off, s_tile);
  int g, M, N, Kr, m0, off;
  if constexpr (kWgrad) {
    g = blockIdx.z;
    off = s_off[g];
    Kr = s_off[g + 1] - off;
    if (Kr == 0) return;
    M = p.n;
    N = p.k;
    m0 = blockIdx.y * kBM;
  } else {
    const RowTile t = row_tile(s_off, s_tile, p.G, p.R, kBM);
    N = kMode == Mode::kForward ? p.n : p.k;
    if (t.g < 0) {
      zero_tile(static_cast<T*>(p.c), t.tail_row, p.R, N, blockIdx.x * kBN, kBM, kBN);
      return;
    }
    g = t.g;
    off = t.off;
    M = t.rows;
    m0 = t.m0;
    Kr = kMode == Mode::kForward ? p.k : p.n;
  }
  const int n0 = blockIdx.x * kBN;
  // Operand bases and row lengths.
  const T* A;
  const T* B;
  int64_t lda, ldb;
  if constexpr (kWgrad) {
    A = static_cast<const T*>(p.a) + static_cast<int64_t>(off) * p.n;  // dy_g [rows, n]
    lda = p.n;
    B = static_cast<const T*>(p.b) + static_cast<int64_t>(off) * p.k;  // x_g [rows, k]
    ldb = p.k;
  } else {
    lda = kMode == Mode::kForward ? p.k : p.n;
    A = static_cast<const T*>(p.a) + static_cast<int64_t>(off) * lda;  // x_g or dy_g
    B = static_cast<const T*>(p.table[g]);                             // W_g [n, k]
    ldb = p.k;
  }
  auto load_stage = [&](int stage, int r0) {
    T* a = sA + stage * TileA::kElems;
    T* b = sB + stage * TileB::kElems;
    if constexpr (kAk) {
      TileA::load(a, A, lda, m0, r0, M, Kr);
    } else {
      TileA::load(a, A, lda, r0, m0, Kr, M);
    }
    if constexpr (kBk) {
      TileB::load(b, B, ldb, n0, r0, N, Kr);
    } else {
      TileB::load(b, B, ldb, r0, n0, Kr, N);
    }
  };

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = (warp / 4) * 64, wn = (warp % 4) * 32;
  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

  const int ktiles = (Kr + kBK - 1) / kBK;
  k_pipeline<kStages>(ktiles, [&](int stage, int kt) { load_stage(stage, kt * kBK); }, [&](int stage) {
    const T* a = sA + stage * TileA::kElems;
    const T* b = sB + stage * TileB::kElems;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      unsigned af[4][4], bf[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const int mb = wm + mi * 16;
        if constexpr (kAk) {  // a[m][k]
          ldsm_x4<false>(af[mi], a + (mb + (lane & 15)) * TileA::kLd + kk + (lane >> 4) * 8);
        } else {  // a[k][m]
          ldsm_x4<true>(af[mi], a + (kk + (lane & 7) + (lane >> 4) * 8) * TileA::kLd + mb + ((lane >> 3) & 1) * 8);
        }
      }
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        const int nb = wn + nj * 16;
        unsigned r[4];
        if constexpr (kBk) {  // b[n][k]
          ldsm_x4<false>(r, b + (nb + (lane & 7) + (lane >> 4) * 8) * TileB::kLd + kk + ((lane >> 3) & 1) * 8);
        } else {  // b[k][n]
          ldsm_x4<true>(r, b + (kk + (lane & 7) + ((lane >> 3) & 1) * 8) * TileB::kLd + nb + (lane >> 4) * 8);
        }
        split_b_x4(bf, nj, r);
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma16816<T>(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
  });

  for_each_pair(acc, m0 + wm, n0 + wn, M, N, [&](int m, int col, float v0, float v1) {
    if constexpr (kWgrad) {
      add_pair(static_cast<float*>(p.table[g]) + static_cast<int64_t>(m) * N + col, v0, v1);
    } else {
      T* d = static_cast<T*>(p.c) + static_cast<int64_t>(off + m) * N + col;
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        *reinterpret_cast<__nv_bfloat162*>(d) = __floats2bfloat162_rn(v0, v1);
      } else {
        *reinterpret_cast<__half2*>(d) = __floats2half2_rn(v0, v1);
      }
    }
  });
}

// ---- the FP8 tensor-core kernel (grouped_fp8_linear_forward / _wgrad) ---------------------------
//
// Both operands K-major FP8 bytes (the rows' op: a = aq [rows, K], b = W_g [N, K]; the wgrad: a =
// dyq_t [n, R], b = xq_t [k, R] over the group's column segment), staged by cp.async in 16-byte
// chunks (a partial chunk zero-filled through cp.async's source size) into rows of kF8BK bytes +
// 16 of padding (ldmatrix conflict-free), 128x128 block tiles, 8 warps of 64x32, mma.sync
// m16n8k32 with e4m3/e5m2 operands (sm_89+) and fp32 accumulators. An FP8 fragment of 4 bytes per
// register has the layout of a 16-bit fragment of 2 elements, so ldmatrix (b16, no .trans) loads
// both operands. A wgrad segment that starts off a 16-byte boundary is loaded byte by byte.
// Epilogue: acc · (sa_g · sb_g), stored as bf16 (rows) or added to the fp32 gradient (wgrad).

constexpr int kF8BK = 64, kF8Ld = kF8BK + 16, kF8Stages = 4;
constexpr int kF8TileBytes = kBM * kF8Ld;  // one operand's stage (kBM == kBN)

struct Fp8Params {
  const uint8_t* a;       // rows: aq [R, K]; wgrad: dyq_t [n, R]
  const uint8_t* b;       // wgrad: xq_t [k, R]; rows: unused (the weights come from `table`)
  __nv_bfloat16* c;       // rows: y [R, N]; wgrad: unused
  void* const* table;     // rows: G FP8 weights [N, K]; wgrad: G fp32 gradients [n, k]
  const float* sa;        // the row operand's scales (sa_stride 0: one; 1: per group)
  const float* sb;        // the weights' (rows) or x's (wgrad) scales
  int sa_stride, sb_stride;
  const int32_t* counts;  // [G]
  int G, R, N, K;         // rows: y [R, N] from K; wgrad: dW [N, K] = [n, k], R columns of the transposes
};

__device__ __forceinline__ void cp_async16_n(void* smem, const void* gmem, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(bytes));
}

/// Rows [outer0, outer0 + kBM) x bytes [inner0, inner0 + kF8BK) of a byte matrix g (ld bytes per
/// row) into s (kF8Ld bytes per row); rows >= outer_lim and bytes >= inner_lim are zero. aligned:
/// g, ld and inner0 are multiples of 16 (cp.async); else byte loads.
__device__ __forceinline__ void fp8_load_tile(uint8_t* s, const uint8_t* g, int64_t ld, int outer0, int inner0,
                                              int outer_lim, int inner_lim, bool aligned) {
  constexpr int kChunks = kF8BK / 16;
#pragma unroll
  for (int i = 0; i < kBM * kChunks / kThreads; ++i) {
    const int q = threadIdx.x + i * kThreads, o = q / kChunks, c = (q % kChunks) * 16;
    const int go = outer0 + o, gi = inner0 + c;
    const int bytes = go < outer_lim ? max(0, min(16, inner_lim - gi)) : 0;
    const uint8_t* src = bytes > 0 ? g + static_cast<int64_t>(go) * ld + gi : g;
    if (aligned) {
      cp_async16_n(s + o * kF8Ld + c, src, bytes);
    } else {
      unsigned w[4] = {0, 0, 0, 0};
      for (int e = 0; e < bytes; ++e) w[e / 4] |= static_cast<unsigned>(src[e]) << (8 * (e % 4));
      *reinterpret_cast<uint4*>(s + o * kF8Ld + c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define MT_MMA_FP8(AT, BT)                                                                                   \
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32." AT "." BT                                            \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
#endif

/// c += a (16x32 FP8, row) · b (32x8 FP8, col); kA5 / kB5: the operand is e5m2 (else e4m3).
template <bool kA5, bool kB5>
__device__ __forceinline__ void mma_fp8(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (!kA5 && !kB5) {
    MT_MMA_FP8("e4m3", "e4m3");
  } else if constexpr (kA5 && !kB5) {
    MT_MMA_FP8("e5m2", "e4m3");
  } else if constexpr (!kA5 && kB5) {
    MT_MMA_FP8("e4m3", "e5m2");
  } else {
    MT_MMA_FP8("e5m2", "e5m2");
  }
#else
  __trap();  // the host refuses devices below compute capability 8.9
#endif
}
#undef MT_MMA_FP8

template <bool kWgrad, bool kA5, bool kB5>
__global__ void __launch_bounds__(kThreads) fp8_kernel(Fp8Params p) {
  __shared__ int s_off[kMaxGroups + 1], s_tile[kMaxGroups + 1];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint8_t* sA = smem_raw;
  uint8_t* sB = sA + kF8Stages * kF8TileBytes;

  group_tables(p.counts, p.G, p.R, RowTiles{kWgrad ? 0 : kBM, 1}, s_off, s_tile);
  // This block: C[M, N] (+)= A[M, Kr] · B[N, Kr]ᵀ over its 128x128 tile, A and B K-major.
  int g, M, Kr, m0, off;
  const uint8_t* A;
  const uint8_t* B;
  int64_t ld;  // bytes per row of A and B
  int k0 = 0;  // first reduction byte (the wgrad's segment)
  if constexpr (kWgrad) {
    g = blockIdx.z;
    off = s_off[g];
    Kr = s_off[g + 1] - off;
    if (Kr == 0) return;
    M = p.N;
    m0 = blockIdx.y * kBM;
    A = p.a;
    B = p.b;
    ld = p.R;
    k0 = off;
  } else {
    const RowTile t = row_tile(s_off, s_tile, p.G, p.R, kBM);
    if (t.g < 0) {
      zero_tile(p.c, t.tail_row, p.R, p.N, blockIdx.x * kBN, kBM, kBN);
      return;
    }
    g = t.g;
    off = t.off;
    M = t.rows;
    m0 = t.m0;
    Kr = p.K;
    A = p.a + static_cast<int64_t>(off) * p.K;
    B = static_cast<const uint8_t*>(p.table[g]);
    ld = p.K;
  }
  const int N = kWgrad ? p.K : p.N;
  const int n0 = blockIdx.x * kBN;
  const bool aligned = k0 % 16 == 0;
  auto load_stage = [&](int stage, int r0) {
    fp8_load_tile(sA + stage * kF8TileBytes, A, ld, m0, k0 + r0, M, k0 + Kr, aligned);
    fp8_load_tile(sB + stage * kF8TileBytes, B, ld, n0, k0 + r0, N, k0 + Kr, aligned);
  };

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = (warp / 4) * 64, wn = (warp % 4) * 32;
  float acc[4][4][4] = {};
  const int ktiles = (Kr + kF8BK - 1) / kF8BK;
  k_pipeline<kF8Stages>(ktiles, [&](int stage, int kt) { load_stage(stage, kt * kF8BK); }, [&](int stage) {
    const uint8_t* a = sA + stage * kF8TileBytes;
    const uint8_t* b = sB + stage * kF8TileBytes;
#pragma unroll
    for (int kk = 0; kk < kF8BK; kk += 32) {
      unsigned af[4][4], bf[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
        ldsm_x4<false>(af[mi], a + (wm + mi * 16 + (lane & 15)) * kF8Ld + kk + (lane >> 4) * 16);
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        unsigned r[4];
        ldsm_x4<false>(r, b + (wn + nj * 16 + (lane & 7) + (lane >> 4) * 8) * kF8Ld + kk + ((lane >> 3) & 1) * 16);
        split_b_x4(bf, nj, r);
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_fp8<kA5, kB5>(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
  });

  // The scales as fp8_matmul applies them: acc · (sa · sb).
  const float scale = p.sa[g * p.sa_stride] * p.sb[g * p.sb_stride];
  for_each_pair(acc, m0 + wm, n0 + wn, M, N, [&](int m, int col, float v0, float v1) {
    if constexpr (kWgrad) {
      add_pair(static_cast<float*>(p.table[g]) + static_cast<int64_t>(m) * N + col, v0 * scale, v1 * scale);
    } else {
      *reinterpret_cast<__nv_bfloat162*>(p.c + static_cast<int64_t>(off + m) * N + col) =
          __floats2bfloat162_rn(v0 * scale, v1 * scale);
    }
  });
}

// ---- launchers ---------------------------------------------------------------------------------

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <Mode kMode>
void launch(const char* fn, DType dtype, const Params& p, bool tensor_cores, int64_t R, int64_t N, int64_t M_wgrad,
            const Stream& stream) {
  MT_CHECK(p.G <= kMaxGroups, "{}: {} groups, more than the kernel's {}", fn, p.G, kMaxGroups);
  const int bm = tensor_cores ? kBM : kSM, bn = tensor_cores ? kBN : kSN;
  dim3 grid;
  if constexpr (kMode == Mode::kWgrad) {
    grid = dim3(static_cast<unsigned>((N + bn - 1) / bn), static_cast<unsigned>((M_wgrad + bm - 1) / bm),
                static_cast<unsigned>(p.G));
  } else {
    const int64_t slots = (R + bm - 1) / bm + p.G;
    MT_CHECK(slots <= 65535, "{}: {} rows need {} row-tile slots, more than the grid's 65535", fn, R, slots);
    grid = dim3(static_cast<unsigned>((N + bn - 1) / bn), static_cast<unsigned>(slots));
  }
  MT_CHECK(grid.y <= 65535 && grid.x >= 1, "{}: grid {}x{}x{} out of range", fn, grid.x, grid.y, grid.z);
  cudaStream_t s = raw(stream);
  ew::dispatch_float(dtype, fn, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float>) {
      simt_kernel<T, kMode><<<grid, kThreads, 0, s>>>(p);
    } else {
      if (tensor_cores) {
        constexpr size_t smem = tc_smem_bytes<T, kMode>();
        grouped::allow_smem(tc_kernel<T, kMode>, smem, 2 * (kMaxGroups + 1) * sizeof(int), fn);
        tc_kernel<T, kMode><<<grid, kThreads, smem, s>>>(p);
      } else {
        simt_kernel<T, kMode><<<grid, kThreads, 0, s>>>(p);
      }
    }
  });
  MT_CUDA_CHECK_LAUNCH();
}

Params make_params(const void* a, const void* b, void* c, const GroupedWeights& w, const Tensor& counts, int64_t R,
                   const char* fn) {
  MT_CHECK(R <= INT32_MAX && w.rows() <= INT32_MAX && w.cols() <= INT32_MAX && w.groups() <= INT32_MAX,
           "{}: {} rows of [{}, {}] exceed the kernel's int32 range", fn, R, w.rows(), w.cols());
  Params p{};
  p.a = a;
  p.b = b;
  p.c = c;
  p.table = w.table();
  p.counts = counts.data_as<int32_t>();
  p.G = static_cast<int>(w.groups());
  p.R = static_cast<int>(R);
  p.n = static_cast<int>(w.rows());
  p.k = static_cast<int>(w.cols());
  return p;
}

}  // namespace

void grouped_linear_forward(const Tensor& y, const Tensor& x, const GroupedWeights& w, const Tensor& counts,
                            const Stream& stream) {
  const char* fn = "grouped_linear_forward";
  const int64_t R = x.size(0), n = w.rows(), k = w.cols();
  if (R == 0 || n == 0) return;
  if (grouped_sm90::forward(y, x, w, counts, stream)) return;
  const Params p = make_params(x.data(), nullptr, y.data(), w, counts, R, fn);
  const bool tc = x.dtype() != DType::kF32 && n % 8 == 0 && k % 8 == 0 && w.aligned16() && aligned16(x.data()) &&
                  aligned16(y.data());
  launch<Mode::kForward>(fn, x.dtype(), p, tc, R, n, 0, stream);
}

void grouped_linear_dgrad(const Tensor& dx, const Tensor& dy, const GroupedWeights& w, const Tensor& counts,
                          const Stream& stream) {
  const char* fn = "grouped_linear_dgrad";
  const int64_t R = dy.size(0), n = w.rows(), k = w.cols();
  if (R == 0 || k == 0) return;
  if (grouped_sm90::dgrad(dx, dy, w, counts, stream)) return;
  const Params p = make_params(dy.data(), nullptr, dx.data(), w, counts, R, fn);
  const bool tc = dy.dtype() != DType::kF32 && n % 8 == 0 && k % 8 == 0 && w.aligned16() && aligned16(dy.data()) &&
                  aligned16(dx.data());
  launch<Mode::kDgrad>(fn, dy.dtype(), p, tc, R, k, 0, stream);
}

void grouped_linear_wgrad(const GroupedWeights& dw, const Tensor& dy, const Tensor& x, const Tensor& counts,
                          const Stream& stream) {
  const char* fn = "grouped_linear_wgrad";
  const int64_t R = x.size(0), n = dw.rows(), k = dw.cols();
  if (R == 0 || n == 0 || k == 0) return;
  if (grouped_sm90::wgrad(dw, dy, x, counts, stream)) return;
  const Params p = make_params(dy.data(), x.data(), nullptr, dw, counts, R, fn);
  const bool tc = x.dtype() != DType::kF32 && n % 8 == 0 && k % 8 == 0 && dw.aligned16() && aligned16(dy.data()) &&
                  aligned16(x.data());
  launch<Mode::kWgrad>(fn, x.dtype(), p, tc, R, k, n, stream);
}

namespace {

template <bool kWgrad>
void launch_fp8(const char* fn, DType a_dt, DType b_dt, const Fp8Params& p, dim3 grid, const Stream& stream) {
  MT_CHECK(p.G <= kMaxGroups, "{}: {} groups, more than the kernel's {}", fn, p.G, kMaxGroups);
  MT_CHECK(grid.y <= 65535 && grid.z <= 65535 && grid.x >= 1, "{}: grid {}x{}x{} out of range", fn, grid.x, grid.y,
           grid.z);
  constexpr size_t smem = 2 * kF8Stages * kF8TileBytes;
  auto run = [&](auto kernel) {
    grouped::allow_smem(kernel, smem, 2 * (kMaxGroups + 1) * sizeof(int), fn);
    kernel<<<grid, kThreads, smem, raw(stream)>>>(p);
  };
  const bool a5 = a_dt == DType::kF8E5M2, b5 = b_dt == DType::kF8E5M2;
  if (!a5 && !b5) run(fp8_kernel<kWgrad, false, false>);
  if (a5 && !b5) run(fp8_kernel<kWgrad, true, false>);
  if (!a5 && b5) run(fp8_kernel<kWgrad, false, true>);
  MT_CHECK(!(a5 && b5), "{}: both operands fp8_e5m2", fn);
  MT_CUDA_CHECK_LAUNCH();
}

Fp8Params fp8_params(const Tensor& a_scale_inv, const Tensor& b_scale_inv, const GroupedWeights& w,
                     const Tensor& counts, int64_t R, int64_t N, int64_t K, const char* fn) {
  MT_CHECK(R <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX && w.groups() <= INT32_MAX,
           "{}: {} rows of [{}, {}] exceed the kernel's int32 range", fn, R, N, K);
  Fp8Params p{};
  p.table = w.table();
  p.sa = a_scale_inv.data_as<float>();
  p.sb = b_scale_inv.data_as<float>();
  p.sa_stride = a_scale_inv.numel() == 1 ? 0 : 1;
  p.sb_stride = b_scale_inv.numel() == 1 ? 0 : 1;
  p.counts = counts.data_as<int32_t>();
  p.G = static_cast<int>(w.groups());
  p.R = static_cast<int>(R);
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  return p;
}

}  // namespace

void grouped_fp8_linear_forward(const Tensor& y, const Tensor& aq, const Tensor& a_scale_inv, const GroupedWeights& wq,
                                const Tensor& w_scale_inv, const Tensor& counts, const Stream& stream) {
  const char* fn = "grouped_fp8_linear_forward";
  const int64_t R = aq.size(0), N = wq.rows(), K = wq.cols();
  fp8_check_device(aq.device(), /*blockwise=*/false);
  if (R == 0 || N == 0) return;
  if (grouped_sm90::fp8_forward(y, aq, a_scale_inv, wq, w_scale_inv, counts, stream)) return;
  Fp8Params p = fp8_params(a_scale_inv, w_scale_inv, wq, counts, R, N, K, fn);
  p.a = aq.data_as<uint8_t>();
  p.c = y.data_as<__nv_bfloat16>();
  const int64_t slots = (R + kBM - 1) / kBM + p.G;
  MT_CHECK(slots <= 65535, "{}: {} rows need {} row-tile slots, more than the grid's 65535", fn, R, slots);
  launch_fp8<false>(fn, aq.dtype(), wq.dtype(), p,
                    dim3(static_cast<unsigned>((N + kBN - 1) / kBN), static_cast<unsigned>(slots)), stream);
}

void grouped_fp8_linear_wgrad(const GroupedWeights& dw, const Tensor& dyq_t, const Tensor& dy_scale_inv,
                              const Tensor& xq_t, const Tensor& x_scale_inv, const Tensor& counts,
                              const Stream& stream) {
  const char* fn = "grouped_fp8_linear_wgrad";
  const int64_t R = xq_t.size(1), n = dw.rows(), k = dw.cols();
  fp8_check_device(xq_t.device(), /*blockwise=*/false);
  if (R == 0 || n == 0 || k == 0) return;
  if (grouped_sm90::fp8_wgrad(dw, dyq_t, dy_scale_inv, xq_t, x_scale_inv, counts, stream)) return;
  Fp8Params p = fp8_params(dy_scale_inv, x_scale_inv, dw, counts, R, n, k, fn);
  p.a = dyq_t.data_as<uint8_t>();
  p.b = xq_t.data_as<uint8_t>();
  launch_fp8<true>(fn, dyq_t.dtype(), xq_t.dtype(), p,
                   dim3(static_cast<unsigned>((k + kBN - 1) / kBN), static_cast<unsigned>((n + kBM - 1) / kBM),
                        static_cast<unsigned>(p.G)),
                   stream);
}

}  // namespace mt::cuda
