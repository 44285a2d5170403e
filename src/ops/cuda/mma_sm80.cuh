// Tensor-core building blocks shared by the FlashAttention-2 style kernels (ops/cuda/
// flash_attention.cu, ops/cuda/context_attention.cu): cp.async, ldmatrix and mma.sync.m16n8k16
// with fp32 accumulation (sm_80+), 16-bit packing, and the cp.async load of a ROWS x D tile into
// shared memory with row stride D + 8 (conflict-free ldmatrix). Only included by .cu files.
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

}  // namespace mt::cuda::mma
