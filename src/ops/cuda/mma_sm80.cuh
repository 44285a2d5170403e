// Tensor-core building blocks of the FlashAttention-2 kernels (ops/cuda/flash_attention_kernels.cuh):
// cp.async, ldmatrix and mma.sync.m16n8k16 with fp32 accumulation (sm_80+), 16-bit packing, the
// cp.async load of a ROWS x D tile into shared memory with row stride D + 8 (conflict-free
// ldmatrix), the query-major tile steps of the forward and of the deterministic dQ kernels
// (S = Q K^T, O += P V), and the backward's tile steps and element formula. Only included by .cu
// files.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace mt::cuda::mma {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
/// 16 bytes global -> shared; zero-fills the destination when !pred (src is then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
/// Waits until at most N committed groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
/// c += a · b for one m16n8k16 tile; T: __nv_bfloat16 or __half.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
/// Two floats -> one register of two 16-bit values, lo in the low half (the lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}
/// ROWS x D tile (rows row0.., global row stride rs elements) -> shared memory with row stride
/// D + 8; rows >= lim are zero-filled. Every thread of the block (NT threads) takes part.
template <int ROWS, int D, int NT, typename T>
__device__ __forceinline__ void load_tile(T* sm, const T* g, int64_t row0, int64_t rs, int64_t lim, int tid) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static_assert((ROWS * kChunks) % NT == 0, "tile chunks must divide evenly over the threads");
#pragma unroll
  for (int k = 0; k < ROWS * kChunks / NT; ++k) {
    const int c = tid + k * NT, r = c / kChunks, col = (c % kChunks) * 8;
    const int64_t row = row0 + r;
    const bool ok = row < lim;
    cp_async16(smem_u32(sm + r * (D + 8) + col), g + (ok ? row : 0) * rs + col, ok);
  }
}

// Query-major tile steps (FlashAttention-2 forward, Algorithm 1; also the deterministic dQ kernels):
// a warp owns MW groups of 16 query rows; accumulators are m16n8 fragments (element e of fragment
// nt: row g + 8·(e >> 1), column nt·8 + 2·t4 + (e & 1), with g = lane / 4, t4 = lane % 4).

/// acc[mi] += A_mi · B^T over the head dim D: A_mi (16 rows x D) as m16n8k16 A fragments from
/// afrag(mi, kk, a) (columns kk·16 .. kk·16 + 15), B (BC rows x D) in shared memory with row stride
/// D + 8 (ldmatrix, not transposed); acc[mi][nt] holds output columns nt·8 ... (S = Q K^T with
/// A = Q, B = K; dP = dO V^T with A = dO, B = V.)
template <typename T, int D, int BC, int MW, typename AFrag>
__device__ __forceinline__ void mma_abt_tile(float (&acc)[MW][BC / 8][4], AFrag&& afrag, const T* sB, int lane) {
  constexpr int SD = D + 8;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[MW][4];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) afrag(mi, kk, a[mi]);
#pragma unroll
    for (int nn = 0; nn < BC / 16; ++nn) {
      uint32_t bf[4];
      ldsm_x4(bf, smem_u32(sB + (nn * 16 + (lane & 7) + ((lane >> 4) << 3)) * SD + kk * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
        mma16816<T>(acc[mi][2 * nn], a[mi], bf[0], bf[1]);
        mma16816<T>(acc[mi][2 * nn + 1], a[mi], bf[2], bf[3]);
      }
    }
  }
}

/// acc[mi] += P_mi · B over BC keys: P_mi (16 rows x BC) from fp32 accumulators in the layout
/// mma_abt_tile writes (rounded to T), B (BC rows x D) in shared memory with row stride D + 8
/// (ldmatrix.trans). (O += P V; dQ += dS K.)
template <typename T, int D, int BC, int MW>
__device__ __forceinline__ void mma_pb_tile(float (&acc)[MW][D / 8][4], const float (&pm)[MW][BC / 8][4],
                                            const T* sB, int lane) {
  constexpr int SD = D + 8;
#pragma unroll
  for (int kk = 0; kk < BC / 16; ++kk) {
    uint32_t a[MW][4];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
      a[mi][0] = pack2<T>(pm[mi][2 * kk][0], pm[mi][2 * kk][1]);
      a[mi][1] = pack2<T>(pm[mi][2 * kk][2], pm[mi][2 * kk][3]);
      a[mi][2] = pack2<T>(pm[mi][2 * kk + 1][0], pm[mi][2 * kk + 1][1]);
      a[mi][3] = pack2<T>(pm[mi][2 * kk + 1][2], pm[mi][2 * kk + 1][3]);
    }
#pragma unroll
    for (int nn = 0; nn < D / 16; ++nn) {
      uint32_t bf[4];
      ldsm_x4_t(bf, smem_u32(sB + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SD + nn * 16 + (lane >> 4) * 8));
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
        mma16816<T>(acc[mi][2 * nn], a[mi], bf[0], bf[1]);
        mma16816<T>(acc[mi][2 * nn + 1], a[mi], bf[2], bf[3]);
      }
    }
  }
}

/// FlashAttention-2 backward, one element (query i, key j), the same formula in the dK/dV kernels
/// (key-major) and the deterministic dQ kernels (query-major): P = exp2(S · sl2 − lse2) with
/// sl2 = scale·log2(e) and lse2 = lse·log2(e) (+inf for rows without keys), 0 where j is not
/// visible to i; with the dropout decision `kept` and inv_keep = 1/(1−p) (1 without dropout):
/// returns dS = P ∘ (dP_drop − D_i), dP_drop = kept ? dP · inv_keep : 0, and sets p_drop =
/// kept ? P · inv_keep : 0 (the probability that multiplies dO in dV).
__device__ __forceinline__ float bwd_ds_element(float s, float sl2, float lse2, bool visible, bool kept, float inv_keep,
                                                float dp, float delta, float& p_drop) {
  float pv = exp2f(fmaf(s, sl2, -lse2));
  if (!visible) pv = 0.f;
  const float dpd = kept ? dp * inv_keep : 0.f;
  p_drop = kept ? pv * inv_keep : 0.f;
  return pv * (dpd - delta);
}

// FlashAttention-2 backward tile steps (Dao 2023, Algorithm 2) of bwd_mma. A warp owns 16 keys; p
// and ds are its P^T (dropout applied) and dS^T accumulators, 16 keys x BR queries in m16n8
// fragments; shared tiles have row stride D + 8 (Q, dO, K) and BR + 8 (dS^T).

/// dV += P^T dO and dK += dS^T Q for this warp's 16 keys (A fragments from the accumulators, B by
/// ldmatrix.trans from the query tile's sQ / sdO).
template <typename T, int D, int BR>
__device__ __forceinline__ void bwd_dkdv_tile(float (&dv)[D / 8][4], float (&dk)[D / 8][4], const float (&p)[BR / 8][4],
                                              const float (&ds)[BR / 8][4], const T* sdO, const T* sQ, int lane) {
  constexpr int SD = D + 8;
#pragma unroll
  for (int kk = 0; kk < BR / 16; ++kk) {
    const uint32_t pa[4] = {pack2<T>(p[2 * kk][0], p[2 * kk][1]), pack2<T>(p[2 * kk][2], p[2 * kk][3]),
                            pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
    const uint32_t da[4] = {pack2<T>(ds[2 * kk][0], ds[2 * kk][1]), pack2<T>(ds[2 * kk][2], ds[2 * kk][3]),
                            pack2<T>(ds[2 * kk + 1][0], ds[2 * kk + 1][1]),
                            pack2<T>(ds[2 * kk + 1][2], ds[2 * kk + 1][3])};
#pragma unroll
    for (int nn = 0; nn < D / 16; ++nn) {
      const int off = (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SD + nn * 16 + (lane >> 4) * 8;
      uint32_t bo[4], bq[4];
      ldsm_x4_t(bo, smem_u32(sdO + off));
      mma16816<T>(dv[2 * nn], pa, bo[0], bo[1]);
      mma16816<T>(dv[2 * nn + 1], pa, bo[2], bo[3]);
      ldsm_x4_t(bq, smem_u32(sQ + off));
      mma16816<T>(dk[2 * nn], da, bq[0], bq[1]);
      mma16816<T>(dk[2 * nn + 1], da, bq[2], bq[3]);
    }
  }
}

/// This warp's dS^T (16 keys x BR queries) into rows warp·16.. of sdS (row stride BR + 8).
template <typename T, int BR>
__device__ __forceinline__ void bwd_store_ds(T* sdS, const float (&ds)[BR / 8][4], int warp, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < BR / 8; ++nt) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<uint32_t*>(sdS + (warp * 16 + g + 8 * r) * (BR + 8) + nt * 8 + 2 * t4) =
          pack2<T>(ds[nt][2 * r], ds[nt][2 * r + 1]);
  }
}

/// dq = dS K over the block's BC keys for query rows rg·16.. and head dims cg·DC.. (overwritten;
/// sdS as bwd_store_ds wrote it for every warp, sK with row stride D + 8).
template <typename T, int D, int BR, int BC, int DC>
__device__ __forceinline__ void bwd_dq_tile(float (&dq)[DC / 8][4], const T* sdS, const T* sK, int rg, int cg,
                                            int lane) {
  constexpr int SD = D + 8, SR = BR + 8;
#pragma unroll
  for (int nt = 0; nt < DC / 8; ++nt) dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < BC / 16; ++kk) {
    uint32_t a[4];
    ldsm_x4_t(a, smem_u32(sdS + (kk * 16 + (lane & 7) + ((lane >> 4) << 3)) * SR + rg * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
    for (int nn = 0; nn < DC / 16; ++nn) {
      uint32_t bk[4];
      ldsm_x4_t(bk, smem_u32(sK + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SD + cg * DC + nn * 16 +
                             (lane >> 4) * 8));
      mma16816<T>(dq[2 * nn], a, bk[0], bk[1]);
      mma16816<T>(dq[2 * nn + 1], a, bk[2], bk[3]);
    }
  }
}

}  // namespace mt::cuda::mma
