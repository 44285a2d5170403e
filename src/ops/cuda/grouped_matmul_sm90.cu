// The Hopper grouped GEMM (ops/cuda/grouped_matmul_sm90.cuh; the ops of ops/grouped_matmul.h on
// compute capability 9.0). Compiled for sm_90a as well as the project's architectures
// (CMakeLists.txt): the kernels' bodies exist only in the sm_90a image, and a probe kernel tells
// at run time whether that image is the one the driver loaded.
//
// One persistent block per SM, 384 threads: warpgroup 0 produces (one thread issues the TMA
// loads; setmaxnreg lowers its registers to 40), warpgroups 1 and 2 consume (232 registers each):
// each owns 64 rows of the 128 x BN output tile (BN = 256 or 128) and issues wgmma
// m64nBNk16 with fp32 accumulators in registers. A stage holds the A tile (128 x 64) and the B
// tile (BN x 64) in 128-byte-swizzled 64 x 64-element boxes (4 stages at BN = 256, 6 at 128);
// `full` mbarriers (TMA transaction bytes) and `empty` mbarriers (one arrival per consumer warp
// once its wgmma reading the stage completed) pass the stages around the ring.
// Ping-pong (Kernel::kWgmmaPingPong, BN = 128): each consumer warpgroup owns whole 128 x 128 tiles,
// the block's tiles alternating between the two (two m64n128k16 per k16 step, 128 accumulators
// per thread), so that one warpgroup's epilogue runs while the other's main loop keeps the tensor
// cores busy: the wgrad's short main loops (K = the rows of one expert) and its fp32
// read-modify-write epilogue are what this hides. The ring order is the block's tile order, so
// each warpgroup steps over the stages of the other's tiles, and the main loops take turns (named
// barriers; see consume_pingpong); a stage is released by the 4 warps of the warpgroup that read it.
//
// Work: every block first builds the group tables of grouped_matmul_common.cuh from the device
// counts (rows clipped at R, work tiles per group); block b then takes tiles b, b + grid, ... of
// the (group, row tile, column tile) list, rastered in bands of 8 row tiles per group so that the
// blocks running together share their A rows and B columns in L2.
//   forward  y_g  = x_g · W_gᵀ : A = x rows (K-major), B = W_g [n, k] (K-major);
//   dgrad    dx_g = dy_g · W_g : A = dy rows (K-major), B = W_g (N-major: wgmma's transposed B);
//   wgrad    dW_g += dy_gᵀ · x_g: A = dy_g (M-major), B = x_g (N-major), the group's rows being the
//            reduction: in the last, partial stage the consumers zero the rows beyond the group
//            in shared memory (they belong to the next group or the tail) before the wgmma.
// The wgrad adds to the fp32 dW (WgradEpilogue): by default each consumer thread reads its dW
// elements after the main loop in chunks, adds and stores; kPreload starts the accumulators from
// dW (loaded before the main loop: its latency behind the producer's first stages, in ping-pong
// behind the other warpgroup's main loop) and only stores; the *L2Prefetch kinds have the producer
// prefetch the tile's dW rows into L2 (cp.async.bulk.prefetch.L2) with the tile's first stage
// (preload) or its last (read-modify-write): whole 512- or 1024-byte rows in place of the
// consumers' scattered 32-byte sectors from DRAM.
// FP8 (grouped_fp8_linear_forward / _wgrad): both operands K-major (wgmma m64nBNk32 has no
// transposed FP8 operands), 128 reduction elements per stage; the wgrad over the transposes
// dyq_t / xq_t with the tokens beyond the group zeroed in shared memory (see Fp8E4M3 below).
// The activations' tensor maps span all R rows (kernel parameters, built per call); the A rows
// beyond a group in the forward / dgrad only reach output rows that are not stored. The weights'
// maps are per group in device memory (GroupedWeights, built once). Tail rows [Σc, R) of y / dx
// are zeroed by the consumers after their tiles. Every output element is reduced by one thread in
// a fixed order: deterministic, no atomics.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "ops/grouped_matmul.h"  // first: elementwise_common.cuh needs Tensor, Stream, DType

#include "core/cuda_check.h"
#include "core/device.h"
#include "ops/cuda/elementwise_common.cuh"
#include "ops/cuda/grouped_matmul_common.cuh"
#include "ops/cuda/grouped_matmul_sm90.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MT_GG_SM90A 1
#endif
#if defined(__CUDA_ARCH__) && !defined(MT_GG_SM90A)
#pragma nv_diag_suppress 177  // the tiling constants serve only the sm_90a image's kernels
#endif

namespace mt::cuda::grouped_sm90 {
namespace {

using ew::raw;
using grouped::kMaxGroups;

constexpr int kBM = 128;                         // output rows of a tile: two consumer warpgroups of 64
constexpr int kBK = 64;                          // reduction per stage: one 128-byte swizzle row
constexpr int kBox = 64;                         // TMA boxes of 64 x 64 elements
constexpr uint32_t kBoxBytes = kBox * kBox * 2;  // 8 KB
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kBand = 8;  // row tiles per raster band

enum class Mode { kForward, kDgrad, kWgrad };

/// The FP8 ops run with one of these as the kernel's type T: both operands K-major FP8 (A e4m3 or
/// e5m2, B e4m3), wgmma m64nBNk32, a stage of 128 reduction elements (the same 128-byte swizzled
/// rows, 128 x 64-element boxes of bytes). grouped_fp8_linear_forward (fprop, and dgrad with the
/// wᵀ copies) as Mode::kForward: the output bf16 scaled by sa_g · sb_g. grouped_fp8_linear_wgrad as
/// Mode::kWgrad over the transposes dyq_t [n, R] (A) and xq_t [k, R] (B): the group's tokens are
/// the reduction, columns [off_g, off_g + c_g) (TMA boxes from column off_g + k0, at any byte);
/// in the last stage of a group the consumers zero the columns beyond it (the next group's or the
/// tail) in shared memory; dW += (sa_g · sb_g) · acc by the read-modify-write epilogue.
struct Fp8E4M3 {};  // A e4m3
struct Fp8E5M2 {};  // A e5m2 (hybrid's dgrad: dy)
template <typename T>
inline constexpr bool kIsFp8 = std::is_same_v<T, Fp8E4M3> || std::is_same_v<T, Fp8E5M2>;
/// Reduction elements per stage (one 128-byte row): 64 of 16 bits, 128 of FP8.
template <typename T>
inline constexpr int kStageK = kIsFp8<T> ? 2 * kBK : kBK;
/// The output element type: T, or bf16 for FP8.
template <typename T>
using OutT = std::conditional_t<kIsFp8<T>, __nv_bfloat16, T>;

template <int BN>
struct Tiling {
  static constexpr int kStages = BN == 256 ? 4 : 6;
  static constexpr uint32_t kABytes = kBM * kBK * 2;
  static constexpr uint32_t kStageBytes = kABytes + BN * kBK * 2;
  static constexpr size_t kSmem = static_cast<size_t>(kStages) * kStageBytes + 1024;  // + 1024-byte alignment
  static constexpr size_t kStaticSmem = 2 * (kMaxGroups + 1) * sizeof(int) + 2 * kStages * sizeof(uint64_t);
  static constexpr int kAcc = BN / 2;  // fp32 accumulators per consumer thread (64 x BN / 128)
};

struct Params {
  CUtensorMap a;             // forward: x [R, k]; dgrad, wgrad: dy [R, n]
  CUtensorMap b;             // wgrad: x [R, k]
  const CUtensorMap* wmaps;  // forward, dgrad: the G weights' maps [n, k]
  void* c;                   // forward: y [R, n]; dgrad: dx [R, k]
  void* const* dw;           // wgrad: the G fp32 gradients [n, k]
  const int32_t* counts;     // [G]
  int G, R;
  int M;  // wgrad: n (the output rows of every group)
  int N;  // output columns: forward n, dgrad k, wgrad k
  int K;  // reduction: forward k, dgrad n (wgrad: the group's rows)
  // FP8: the dequantisation scales of A (the rows) and of the weights, 1 or G entries (stride 0 / 1)
  const float* sa;
  const float* sb;
  int sa_stride, sb_stride;
};

// ---- device primitives (sm_90a) ----------------------------------------------------------------

#ifdef MT_GG_SM90A

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

/// Waits for the phase of parity `parity` of the mbarrier. A wait of more than 2^36 cycles (tens
/// of seconds: a pipeline bug, never a slow load) traps, so that the launch fails instead of hanging.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  long long start = 0;
  for (;;) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.b32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    if (done) return;
    if (start == 0) {
      start = clock64();
    } else if (clock64() - start > (1ll << 36)) {
      __trap();
    }
  }
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}

/// One 64 x 64 box at element coordinates (c0 innermost, c1) of `map` into shared memory at
/// `dst`, completing on the mbarrier `bar`; elements outside the tensor arrive as zeros.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

/// Asks for `bytes` (a multiple of 16) at `p` (16-byte aligned) in L2, without waiting.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(reinterpret_cast<uint64_t>(p)), "r"(bytes)
               : "memory");
}

/// A tensor map in global memory, written by the host before the launch, read by the TMA unit.
__device__ __forceinline__ void tensormap_acquire(const CUtensorMap* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(reinterpret_cast<uint64_t>(map))
               : "memory");
}

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(128 * kConsumers) : "memory");
}
/// The 128 threads of consumer warpgroup cw (named barrier 2 + cw; ping-pong's stage zeroing).
__device__ __forceinline__ void warpgroup_sync(int cw) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(2 + cw) : "memory");
}
/// Ping-pong's turn order (named barriers 4 + cw, 256 threads): warpgroup cw waits for its turn
/// before its main loop; the other warpgroup gives it the turn once its own main loop has waited
/// for all its stages.
__device__ __forceinline__ void turn_wait(int cw) { asm volatile("bar.sync %0, 256;\n" ::"r"(4 + cw) : "memory"); }
__device__ __forceinline__ void turn_give(int to) { asm volatile("bar.arrive %0, 256;\n" ::"r"(4 + to) : "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kN>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kN) : "memory");
}

/// Shared-memory matrix descriptor of wgmma with 128-byte swizzle: start address, leading and
/// stride byte offsets (bits 0-13, 16-29, 32-45, in 16-byte units), layout type 1 (bits 62-63).
/// K-major tiles (rows of 64 reduction elements, 128 bytes): stride 1024 between 8-row groups, the
/// leading offset unused. MN-major tiles (64-element chunks of 64 reduction rows, 8 KB each): the
/// leading offset is the 8 KB between chunks along M/N, the stride the 1024 between 8 K-rows.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead, uint32_t stride) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lead >> 4) << 16) |
         (static_cast<uint64_t>(stride >> 4) << 32) | (1ull << 62);
}

template <int kAcc>
__device__ __forceinline__ void fence_acc(float (&d)[kAcc]) {
#pragma unroll
  for (int i = 0; i < kAcc; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands of the wgmma asm below: registers %0-%63 (and %64-%127 at n256).
#define MT_WGMMA_REGS_0_63 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MT_WGMMA_REGS_64_127 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define MT_WGMMA_ACC_0_63 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define MT_WGMMA_ACC_64_127 \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// wgmma m64nNk16 f32 += TY x TY from two shared-memory descriptors; scale_d = 0 overwrites d.
#define MT_WGMMA_M64N128K16(TY)                                                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" MT_WGMMA_REGS_0_63              \
               "}, %64, %65, p, 1, 1, %67, %68;\n}\n"                                                       \
               : MT_WGMMA_ACC_0_63                                                                          \
               : "l"(da), "l"(db), "r"(scale_d), "n"(kTA), "n"(kTB))
#define MT_WGMMA_M64N256K16(TY)                                                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                               \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {" MT_WGMMA_REGS_0_63 ", "         \
               MT_WGMMA_REGS_64_127 "}, %128, %129, p, 1, 1, %131, %132;\n}\n"                              \
               : MT_WGMMA_ACC_0_63, MT_WGMMA_ACC_64_127                                                     \
               : "l"(da), "l"(db), "r"(scale_d), "n"(kTA), "n"(kTB))

// wgmma m64nNk32 f32 += TA x TB (FP8, both operands K-major: no transpose operands).
#define MT_WGMMA_M64N128K32(TA, TB)                                                                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                \
               "wgmma.mma_async.sync.aligned.m64n128k32.f32." TA "." TB " {" MT_WGMMA_REGS_0_63              \
               "}, %64, %65, p, 1, 1;\n}\n"                                                                 \
               : MT_WGMMA_ACC_0_63                                                                          \
               : "l"(da), "l"(db), "r"(scale_d))
#define MT_WGMMA_M64N256K32(TA, TB)                                                                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                               \
               "wgmma.mma_async.sync.aligned.m64n256k32.f32." TA "." TB " {" MT_WGMMA_REGS_0_63 ", "         \
               MT_WGMMA_REGS_64_127 "}, %128, %129, p, 1, 1;\n}\n"                                          \
               : MT_WGMMA_ACC_0_63, MT_WGMMA_ACC_64_127                                                     \
               : "l"(da), "l"(db), "r"(scale_d))

/// d (+)= A · B over one k16 slice (FP8: k32), the warpgroup's m64 x BN accumulators (scale_d = 0:
/// d = A · B).
/// kTA / kTB = 1: A / B stored M- / N-major (wgmma's transposed operands, 16-bit types only).
template <typename T, int BN, int kTA, int kTB>
__device__ __forceinline__ void wgmma(float (&d)[BN / 2], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (kIsFp8<T>) {  // one k32 slice: the same 32 bytes of a K-major row
    static_assert(kTA == 0 && kTB == 0, "FP8 wgmma reads K-major operands only");
    if constexpr (BN == 256) {
      if constexpr (std::is_same_v<T, Fp8E4M3>) {
        MT_WGMMA_M64N256K32("e4m3", "e4m3");
      } else {
        MT_WGMMA_M64N256K32("e5m2", "e4m3");
      }
    } else {
      if constexpr (std::is_same_v<T, Fp8E4M3>) {
        MT_WGMMA_M64N128K32("e4m3", "e4m3");
      } else {
        MT_WGMMA_M64N128K32("e5m2", "e4m3");
      }
    }
  } else if constexpr (BN == 256) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      MT_WGMMA_M64N256K16("bf16");
    } else {
      MT_WGMMA_M64N256K16("f16");
    }
  } else {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      MT_WGMMA_M64N128K16("bf16");
    } else {
      MT_WGMMA_M64N128K16("f16");
    }
  }
}

template <typename T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
  } else {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
  }
}

/// The output scale of group g: sa_g · sb_g for FP8 (as fp8_matmul: the product of the two
/// dequantisation scales, then one multiply per element), unused otherwise.
template <typename T>
__device__ __forceinline__ float out_scale(const Params& p, int g) {
  if constexpr (kIsFp8<T>) {
    return p.sa[g * p.sa_stride] * p.sb[g * p.sb_stride];
  } else {
    return 1.f;
  }
}
/// FP8: acc *= s (the wgrad's product before it is added to dW); nothing otherwise.
template <typename T, int kAcc>
__device__ __forceinline__ void scale_acc(float (&acc)[kAcc], float s) {
  if constexpr (kIsFp8<T>) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] *= s;
  }
}
template <typename T>
__device__ __forceinline__ float scaled(float v, float s) {
  if constexpr (kIsFp8<T>) {
    return v * s;
  } else {
    return v;
  }
}

#endif  // MT_GG_SM90A

// ---- the kernel --------------------------------------------------------------------------------

/// A work tile: group g (rows [off, off + rows) of the row buffer), output rows from m0 (relative
/// to the group in the forward / dgrad, rows of dW_g in the wgrad) and columns from n0.
struct Work {
  int g, off, rows, m0, n0;
  int lead = 0;  ///< FP8 wgrad: tokens [off, off + lead) belong to the group before (kernel_view)
};

/// Work tile t (< tile[G]) of the group tables; m_tiles > 0: every group has that many row tiles
/// (wgrad), else ceil(rows / kBM). Within a group the tiles go in bands of kBand row tiles, the
/// rows fastest.
template <int BN>
__device__ __forceinline__ Work decode(int t, const int* off, const int* tile, int G, int n_tiles, int m_tiles) {
  Work w;
  w.g = grouped::find_group(tile, G, t);
  w.off = off[w.g];
  w.rows = off[w.g + 1] - w.off;
  const int mt = m_tiles > 0 ? m_tiles : (w.rows + kBM - 1) / kBM;
  const int local = t - tile[w.g], band_tiles = kBand * n_tiles;
  const int band = local / band_tiles, in_band = local - band * band_tiles;
  const int band_rows = min(kBand, mt - band * kBand);
  w.m0 = (band * kBand + in_band % band_rows) * kBM;
  w.n0 = (in_band / band_rows) * BN;
  return w;
}

/// The FP8 wgrad's view of a group: its tokens are the innermost (K-major) dimension of dyq_t and
/// xq_t, and a TMA box must start on a 16-byte boundary of that dimension (a group at token 100
/// faulted with an illegal instruction on an H200). So the boxes start at off rounded down to 16
/// tokens; the `lead` tokens before the group's first are zeroed in its first stage like the tail
/// ones in its last (zero_stage_cols). Other modes: unchanged.
template <typename T, Mode kMode>
__device__ __forceinline__ Work kernel_view(Work w) {
  if constexpr (kMode == Mode::kWgrad && kIsFp8<T>) {
    w.lead = w.off % 16;
    w.off -= w.lead;
    if (w.rows > 0) w.rows += w.lead;  // an empty group stays empty: no stage
  }
  return w;
}

/// The shared state of a block: the stage ring (mbarriers, the 1024-byte-aligned shared-memory
/// base of stage 0), the group tables and the work-tile counts.
struct Ring {
  uint64_t* full;
  uint64_t* empty;
  uint32_t base;
  const int* off;
  const int* tile;
  int total, n_tiles, m_tiles;
};

#ifdef MT_GG_SM90A

/// The producer (one thread): for every k-stage of every work tile of the block, waits for the
/// stage to be free and issues its TMA loads (A: 2 boxes, B: BN / 64 boxes). kPrefetchDw (wgrad):
/// the L2 prefetch of the tile's dW rows, after the loads of the tile's first stage where the
/// consumers load dW before their main loop (kPreloadDw), else after those of its last stage (the
/// producer runs kStages ahead of the consumers: the rows arrive by the epilogue, and a long main
/// loop cannot evict them first).
template <typename T, Mode kMode, int BN, bool kPrefetchDw, bool kPreloadDw>
__device__ __forceinline__ void produce(const Params& p, const Ring& ring) {
  using Tl = Tiling<BN>;
  constexpr int kStages = Tl::kStages;
  constexpr bool kWgrad = kMode == Mode::kWgrad;
  int it = 0, last_g = -1;
  for (int t = blockIdx.x; t < ring.total; t += gridDim.x) {
    const Work w = kernel_view<T, kMode>(decode<BN>(t, ring.off, ring.tile, p.G, ring.n_tiles, ring.m_tiles));
    const CUtensorMap* bmap = kWgrad ? &p.b : p.wmaps + w.g;
    if (!kWgrad && w.g != last_g) {
      tensormap_acquire(bmap);
      last_g = w.g;
    }
    const int ktiles = ((kWgrad ? w.rows : p.K) + kStageK<T> - 1) / kStageK<T>;
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const int s = it % kStages;
      mbar_wait(smem_u32(&ring.empty[s]), ((it / kStages) & 1) ^ 1);
      const uint32_t bar = smem_u32(&ring.full[s]), a_s = ring.base + s * Tl::kStageBytes, b_s = a_s + Tl::kABytes;
      mbar_arrive_expect_tx(bar, Tl::kStageBytes);
      const int k0 = kt * kStageK<T>;
#pragma unroll
      for (int h = 0; h < kBM / kBox; ++h) {
        if constexpr (kWgrad && kIsFp8<T>) {
          tma_load(a_s + h * kBoxBytes, &p.a, w.off + k0, w.m0 + h * kBox, bar);  // dyq_t[m0.., off + k0..]
        } else if constexpr (kWgrad) {
          tma_load(a_s + h * kBoxBytes, &p.a, w.m0 + h * kBox, w.off + k0, bar);  // dy_g[k0.., m0..]
        } else {
          tma_load(a_s + h * kBoxBytes, &p.a, k0, w.off + w.m0 + h * kBox, bar);  // rows [m0.., k0..]
        }
      }
#pragma unroll
      for (int c = 0; c < BN / kBox; ++c) {
        if constexpr (kMode == Mode::kForward) {
          tma_load(b_s + c * kBoxBytes, bmap, k0, w.n0 + c * kBox, bar);  // W_g[n0.., k0..]
        } else if constexpr (kMode == Mode::kDgrad) {
          tma_load(b_s + c * kBoxBytes, bmap, w.n0 + c * kBox, k0, bar);  // W_g[k0.., n0..]
        } else if constexpr (kIsFp8<T>) {
          tma_load(b_s + c * kBoxBytes, bmap, w.off + k0, w.n0 + c * kBox, bar);  // xq_t[n0.., off + k0..]
        } else {
          tma_load(b_s + c * kBoxBytes, bmap, w.n0 + c * kBox, w.off + k0, bar);  // x_g[k0.., n0..]
        }
      }
      if constexpr (kPrefetchDw) {
        if (kt == (kPreloadDw ? 0 : ktiles - 1)) {
          const float* dw = static_cast<const float*>(p.dw[w.g]) + static_cast<int64_t>(w.m0) * p.N + w.n0;
          const uint32_t bytes = static_cast<uint32_t>(min(BN, p.N - w.n0)) * 4;  // N % 8 == 0: 32-byte multiple
          for (int r = 0; r < min(kBM, p.M - w.m0); ++r) prefetch_l2(dw + static_cast<int64_t>(r) * p.N, bytes);
        }
      }
    }
  }
}

/// Zeroes reduction rows [valid, 64) of the stage's boxes (A: 2, B: BN / 64; each row 128 bytes,
/// which the swizzle only permutes within) with `threads` threads from `tid` (wgrad's last stage of
/// a group: those rows belong to the next group or the tail), then hands them to the async proxy.
template <int BN>
__device__ __forceinline__ void zero_stage_tail(uint32_t a_s, int valid, int tid, int threads) {
  constexpr int kChunks = kBM / kBox + BN / kBox;
  const int per_box = (kBK - valid) * 8;
  for (int i = tid; i < kChunks * per_box; i += threads) {
    const int box = i / per_box, r = i - box * per_box;
    const uint32_t addr = a_s + box * kBoxBytes + (valid + r / 8) * 128 + (r % 8) * 16;
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
  }
  fence_proxy_async();
}

/// The FP8 wgrad's zero_stage_tail: the stage's rows are K-major (A: 128 rows, B: BN, each 128
/// bytes = 128 tokens, 16-byte chunks swizzled: logical chunk j of row r at chunk j ^ (r % 8));
/// zeroes tokens [0, lo) and [hi, 128) of every row (a partial chunk byte by byte; lo < 16 is the
/// group's lead in its first stage, hi the end of its last), then hands them to the async proxy.
template <int BN>
__device__ __forceinline__ void zero_stage_cols(uint32_t a_s, int lo, int hi, int tid, int threads) {
  constexpr int kRows = kBM + BN;  // A's rows, then B's: contiguous 128-byte rows
  for (int i = tid; i < kRows * 8; i += threads) {
    const int r = i / 8, j = i % 8, t0 = j * 16;
    if (t0 >= lo && t0 + 16 <= hi) continue;  // only the group's tokens
    const uint32_t addr = a_s + r * 128 + ((j ^ (r % 8)) * 16);
    if (t0 + 16 <= lo || t0 >= hi) {
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
    } else {
      for (int b = 0; b < 16; ++b)
        if (t0 + b < lo || t0 + b >= hi) asm volatile("st.shared.u8 [%0], %1;\n" ::"r"(addr + b), "r"(0) : "memory");
    }
  }
  fence_proxy_async();
}

/// The tail rows [Σc, R) of the output (forward, dgrad): zeros, in 16-byte stores spread over the
/// 128 kConsumers consumer threads (ctid), after their tiles.
__device__ __forceinline__ void zero_tail(const Params& p, const Ring& ring, int ctid) {
  const int64_t per_row = p.N / 8;
  uint4* c = static_cast<uint4*>(p.c);
  const int64_t threads = 128 * kConsumers, end = static_cast<int64_t>(p.R) * per_row;
  const int64_t first = static_cast<int64_t>(ring.off[p.G]) * per_row + blockIdx.x * threads + ctid;
  for (int64_t i = first; i < end; i += gridDim.x * threads) {
    c[i] = make_uint4(0, 0, 0, 0);
  }
}

/// dW rows [r0, r0 + 8 h] x columns c0 + 8 j (+1) += the warpgroup accumulators acc (the wgmma
/// m64nBN fragment of one thread: acc[4 j + 2 h + {0, 1}]), rows < M and columns < N only. The
/// fp32 read-modify-write goes in chunks of 8 columns groups: the 16 loads of a chunk are issued
/// before any store (one memory round trip per chunk instead of one per float2: the stores could
/// alias the next loads, so the compiler keeps them in program order).
template <int kAcc>
__device__ __forceinline__ void add_to_dw(float* dw, const float (&acc)[kAcc], int r0, int c0, int M, int N) {
  constexpr int kCols = kAcc / 4, kChunk = 8;
#pragma unroll
  for (int j0 = 0; j0 < kCols; j0 += kChunk) {
    float2 o[kChunk][2];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + 8 * h, col = c0 + 8 * (j0 + j);
        if (r < M && col < N) o[j][h] = *reinterpret_cast<const float2*>(dw + static_cast<int64_t>(r) * N + col);
      }
    }
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + 8 * h, col = c0 + 8 * (j0 + j);  // N is a multiple of 8: col + 1 < N too
        if (r < M && col < N) {
          o[j][h].x += acc[4 * (j0 + j) + 2 * h];
          o[j][h].y += acc[4 * (j0 + j) + 2 * h + 1];
          *reinterpret_cast<float2*>(dw + static_cast<int64_t>(r) * N + col) = o[j][h];
        }
      }
    }
  }
}

/// WgradEpilogue::kPreload, before the main loop: acc = dW at the accumulators' positions (as in
/// add_to_dw; 0 outside [M, N]), every load issued before any is used.
template <int kAcc>
__device__ __forceinline__ void load_dw(const float* dw, float (&acc)[kAcc], int r0, int c0, int M, int N) {
#pragma unroll
  for (int j = 0; j < kAcc / 4; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h, col = c0 + 8 * j;
      float2 v = make_float2(0.f, 0.f);
      if (r < M && col < N) v = *reinterpret_cast<const float2*>(dw + static_cast<int64_t>(r) * N + col);
      acc[4 * j + 2 * h] = v.x;
      acc[4 * j + 2 * h + 1] = v.y;
    }
  }
}

/// WgradEpilogue::kPreload, after the main loop: dW = acc (rows < M, columns < N).
template <int kAcc>
__device__ __forceinline__ void store_dw(float* dw, const float (&acc)[kAcc], int r0, int c0, int M, int N) {
#pragma unroll
  for (int j = 0; j < kAcc / 4; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h, col = c0 + 8 * j;
      if (r < M && col < N) {
        *reinterpret_cast<float2*>(dw + static_cast<int64_t>(r) * N + col) =
            make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      }
    }
  }
}

/// The wgrad epilogue of one m64 x BN accumulator block: dW += acc (kPreload: dW = acc, the
/// accumulators having started from dW).
template <bool kPreload, int kAcc>
__device__ __forceinline__ void finish_dw(float* dw, const float (&acc)[kAcc], int r0, int c0, int M, int N) {
  if constexpr (kPreload) {
    store_dw(dw, acc, r0, c0, M, N);
  } else {
    add_to_dw(dw, acc, r0, c0, M, N);
  }
}

/// A consumer warpgroup (cw = 0, 1: rows [64 cw, 64 cw + 64) of each tile): the wgmma k-loop over
/// the ring, then the epilogue; after the tiles (forward, dgrad) its share of the zeroed tail.
template <typename T, Mode kMode, int BN, bool kPreload>
__device__ __forceinline__ void consume(const Params& p, const Ring& ring) {
  using Tl = Tiling<BN>;
  constexpr int kStages = Tl::kStages;
  constexpr bool kWgrad = kMode == Mode::kWgrad;
  const int cw = threadIdx.x / 128 - 1, ctid = threadIdx.x - 128;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  constexpr int kTA = kWgrad && !kIsFp8<T> ? 1 : 0, kTB = kMode == Mode::kForward || kIsFp8<T> ? 0 : 1;
  // Per k16 step: +32 bytes along a K-major row, +16 rows of 128 bytes in an MN-major chunk.
  constexpr uint32_t kStepA = kTA ? 2048 : 32, kStepB = kTB ? 2048 : 32;
  constexpr uint32_t kLeadA = kTA ? kBoxBytes : 16, kLeadB = kTB ? kBoxBytes : 16;
  float acc[Tl::kAcc];
  int it = 0;
  for (int t = blockIdx.x; t < ring.total; t += gridDim.x) {
    const Work w = kernel_view<T, kMode>(decode<BN>(t, ring.off, ring.tile, p.G, ring.n_tiles, ring.m_tiles));
    const int ktiles = ((kWgrad ? w.rows : p.K) + kStageK<T> - 1) / kStageK<T>;
    // Thread (warp, lane) holds rows 16 warp + lane / 4 (+ 8) and columns 8 j + 2 (lane % 4) (+ 1)
    // of the warpgroup's 64 x BN block, in acc[4 j + 2 h + {0, 1}].
    const int r0 = w.m0 + cw * 64 + warp * 16 + lane / 4, c0 = w.n0 + 2 * (lane % 4);
    if constexpr (kPreload) load_dw(static_cast<const float*>(p.dw[w.g]), acc, r0, c0, p.M, p.N);
    int prev = -1;
    fence_acc(acc);
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const int s = it % kStages;
      mbar_wait(smem_u32(&ring.full[s]), (it / kStages) & 1);
      const uint32_t a_s = ring.base + s * Tl::kStageBytes, b_s = a_s + Tl::kABytes;
      if constexpr (kWgrad) {
        const int valid = w.rows - kt * kStageK<T>;  // rows (FP8: tokens) of the group in this stage
        const int lo = kt == 0 ? w.lead : 0;  // FP8: the tokens before the group's first
        if (valid < kStageK<T> || lo > 0) {
          if constexpr (kIsFp8<T>) {
            zero_stage_cols<BN>(a_s, lo, min(valid, kStageK<T>), ctid, 128 * kConsumers);
          } else {
            zero_stage_tail<BN>(a_s, valid, ctid, 128 * kConsumers);
          }
          consumers_sync();
        }
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {  // 32 bytes per step (k16, FP8 k32)
        const uint64_t da = smem_desc(a_s + cw * kBoxBytes + kk * kStepA, kLeadA, 1024);
        const uint64_t db = smem_desc(b_s + kk * kStepB, kLeadB, 1024);
        wgmma<T, BN, kTA, kTB>(acc, da, db, kPreload || (kt | kk) != 0);
      }
      wgmma_commit();
      if (prev >= 0) {
        wgmma_wait<1>();  // the previous stage's wgmma completed: release it
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_u32(&ring.empty[prev]));
      }
      prev = s;
    }
    wgmma_wait<0>();
    fence_acc(acc);
    __syncwarp();
    if (lane == 0 && prev >= 0) mbar_arrive(smem_u32(&ring.empty[prev]));

    if constexpr (kWgrad) {
      scale_acc<T>(acc, out_scale<T>(p, w.g));
      finish_dw<kPreload>(static_cast<float*>(p.dw[w.g]), acc, r0, c0, p.M, p.N);
    } else {
      OutT<T>* c = static_cast<OutT<T>*>(p.c) + static_cast<int64_t>(w.off) * p.N;
      const float sc = out_scale<T>(p, w.g);
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int col = c0 + 8 * j;
        if (col >= p.N) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = r0 + 8 * h;
          if (r < w.rows)
            store2(c + static_cast<int64_t>(r) * p.N + col, scaled<T>(acc[4 * j + 2 * h], sc),
                   scaled<T>(acc[4 * j + 2 * h + 1], sc));
        }
      }
    }
  }
  if constexpr (!kWgrad) zero_tail(p, ring, ctid);
}

/// The ping-pong consumer warpgroup cw: tiles j = cw, cw + 2, ... of the block (t = blockIdx.x +
/// j gridDim.x), each 128 x 128 in two m64 halves (acc[0]: rows 0-63, acc[1]: rows 64-127);
/// then its share of the zeroed tail (forward, dgrad).
template <typename T, Mode kMode, bool kPreload>
__device__ __forceinline__ void consume_pingpong(const Params& p, const Ring& ring) {
  constexpr int BN = 128;
  using Tl = Tiling<BN>;
  constexpr int kStages = Tl::kStages;
  constexpr bool kWgrad = kMode == Mode::kWgrad;
  const int cw = threadIdx.x / 128 - 1, wtid = threadIdx.x % 128, ctid = threadIdx.x - 128;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  constexpr int kTA = kWgrad && !kIsFp8<T> ? 1 : 0, kTB = kMode == Mode::kForward || kIsFp8<T> ? 0 : 1;
  constexpr uint32_t kStepA = kTA ? 2048 : 32, kStepB = kTB ? 2048 : 32;
  constexpr uint32_t kLeadA = kTA ? kBoxBytes : 16, kLeadB = kTB ? kBoxBytes : 16;
  float acc[2][Tl::kAcc];
  int it = 0, j = 0;
  for (int t = blockIdx.x; t < ring.total; t += gridDim.x, ++j) {
    const Work w = kernel_view<T, kMode>(decode<BN>(t, ring.off, ring.tile, p.G, ring.n_tiles, ring.m_tiles));
    const int ktiles = ((kWgrad ? w.rows : p.K) + kStageK<T> - 1) / kStageK<T>;
    if ((j & 1) != cw) {  // the other warpgroup's tile: step over its stages
      it += ktiles;
      continue;
    }
    const int r0 = w.m0 + warp * 16 + lane / 4, c0 = w.n0 + 2 * (lane % 4);  // + 64 h: acc[h]
    if constexpr (kPreload) {  // in flight while the other warpgroup's main loop runs
#pragma unroll
      for (int h = 0; h < 2; ++h) load_dw(static_cast<const float*>(p.dw[w.g]), acc[h], r0 + 64 * h, c0, p.M, p.N);
    }
    // A stage's full barrier is waited by parity: this warpgroup, having stepped over the other's
    // stages, may only wait once every earlier fill has completed, i.e. after the previous tile's
    // main loop waited for its stages (else the parity of a fill two phases back would pass).
    if (j > 0) turn_wait(cw);
    int prev = -1;
    fence_acc(acc[0]);
    fence_acc(acc[1]);
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const int s = it % kStages;
      mbar_wait(smem_u32(&ring.full[s]), (it / kStages) & 1);
      const uint32_t a_s = ring.base + s * Tl::kStageBytes, b_s = a_s + Tl::kABytes;
      if constexpr (kWgrad) {
        const int valid = w.rows - kt * kStageK<T>;
        const int lo = kt == 0 ? w.lead : 0;  // FP8: the tokens before the group's first
        if (valid < kStageK<T> || lo > 0) {
          if constexpr (kIsFp8<T>) {
            zero_stage_cols<BN>(a_s, lo, min(valid, kStageK<T>), wtid, 128);
          } else {
            zero_stage_tail<BN>(a_s, valid, wtid, 128);
          }
          warpgroup_sync(cw);
        }
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {  // 32 bytes per step (k16, FP8 k32)
        const uint64_t db = smem_desc(b_s + kk * kStepB, kLeadB, 1024);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint64_t da = smem_desc(a_s + h * kBoxBytes + kk * kStepA, kLeadA, 1024);
          wgmma<T, BN, kTA, kTB>(acc[h], da, db, kPreload || (kt | kk) != 0);
        }
      }
      wgmma_commit();
      if (prev >= 0) {
        wgmma_wait<1>();
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_u32(&ring.empty[prev]));
      }
      prev = s;
    }
    if (t + static_cast<int>(gridDim.x) < ring.total) turn_give(cw ^ 1);
    wgmma_wait<0>();
    fence_acc(acc[0]);
    fence_acc(acc[1]);
    __syncwarp();
    if (lane == 0 && prev >= 0) mbar_arrive(smem_u32(&ring.empty[prev]));

#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rh = r0 + 64 * h;
      if constexpr (kWgrad) {
        scale_acc<T>(acc[h], out_scale<T>(p, w.g));
        finish_dw<kPreload>(static_cast<float*>(p.dw[w.g]), acc[h], rh, c0, p.M, p.N);
      } else {
        OutT<T>* c = static_cast<OutT<T>*>(p.c) + static_cast<int64_t>(w.off) * p.N;
        const float sc = out_scale<T>(p, w.g);
#pragma unroll
        for (int jj = 0; jj < BN / 8; ++jj) {
          const int col = c0 + 8 * jj;
          if (col >= p.N) continue;
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int r = rh + 8 * hh;
            if (r < w.rows)
              store2(c + static_cast<int64_t>(r) * p.N + col, scaled<T>(acc[h][4 * jj + 2 * hh], sc),
                     scaled<T>(acc[h][4 * jj + 2 * hh + 1], sc));
          }
        }
      }
    }
  }
  if constexpr (!kWgrad) zero_tail(p, ring, ctid);
}

#endif  // MT_GG_SM90A

/// kEpi (wgrad only): the WgradEpilogue.
template <typename T, Mode kMode, int BN, bool kPingPong, WgradEpilogue kEpi>
__global__ void __launch_bounds__(kThreads, 1) wgmma_kernel(const __grid_constant__ Params p) {
  static_assert(!kPingPong || BN == 128, "ping-pong tiles are 128 x 128");
  static_assert(kEpi == WgradEpilogue::kReadModifyWrite || kMode == Mode::kWgrad, "the dW epilogues are the wgrad's");
  static_assert(!kIsFp8<T> || kEpi == WgradEpilogue::kReadModifyWrite || kEpi == WgradEpilogue::kReadModifyWriteL2Prefetch,
                "the FP8 wgrad scales its product before adding it to dW: no preload");
#ifdef MT_GG_SM90A
  constexpr bool kPreload = kEpi == WgradEpilogue::kPreload || kEpi == WgradEpilogue::kPreloadL2Prefetch;
  constexpr bool kPrefetchDw =
      kEpi == WgradEpilogue::kReadModifyWriteL2Prefetch || kEpi == WgradEpilogue::kPreloadL2Prefetch;
  using Tl = Tiling<BN>;
  constexpr int kStages = Tl::kStages;
  constexpr bool kWgrad = kMode == Mode::kWgrad;
  __shared__ int s_off[kMaxGroups + 1], s_tile[kMaxGroups + 1];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;  // stage s: A at base + s * kStageBytes, B after

  const int n_tiles = (p.N + BN - 1) / BN;
  const int m_tiles = kWgrad ? (p.M + kBM - 1) / kBM : 0;
  if constexpr (kWgrad) {
    grouped::group_tables(p.counts, p.G, p.R, grouped::FixedTiles{m_tiles * n_tiles}, s_off, s_tile);
  } else {
    grouped::group_tables(p.counts, p.G, p.R, grouped::RowTiles{kBM, n_tiles}, s_off, s_tile);
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_u32(&full[s]), 1);
      mbar_init(smem_u32(&empty[s]), kPingPong ? 4 : 4 * kConsumers);  // one arrival per reading warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    fence_proxy_async();
  }
  __syncthreads();
  const Ring ring{full, empty, base, s_off, s_tile, s_tile[p.G], n_tiles, m_tiles};
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x == 0) produce<T, kMode, BN, kPrefetchDw, kPreload>(p, ring);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    if constexpr (kPingPong) {
      consume_pingpong<T, kMode, kPreload>(p, ring);
    } else {
      consume<T, kMode, BN, kPreload>(p, ring);
    }
  }
#endif  // MT_GG_SM90A
}

/// Writes 1 in the sm_90a image, 2 in any other: which image the driver loaded for this device.
__global__ void probe_kernel(int* out) {
#ifdef MT_GG_SM90A
  *out = 1;
#else
  *out = 2;
#endif
}

// ---- host side ---------------------------------------------------------------------------------

std::atomic<int> g_kernel{static_cast<int>(Kernel::kAuto)};
std::atomic<int> g_wgrad_epilogue{static_cast<int>(kDefaultWgradEpilogue)};

using EncodeTiled = decltype(&cuTensorMapEncodeTiled);

// The driver's tensor-map encoder, through the runtime's entry-point query (no libcuda link).
EncodeTiled encoder() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSuccess;
    MT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    MT_REQUIRE(q == cudaDriverEntryPointSuccess && f, "the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

/// The map of a row-major [outer, inner] bf16/fp16 matrix at `ptr` (16-byte aligned, inner a
/// multiple of 8): 64 x 64-element boxes, 128-byte swizzle, zeros outside. FP8 (bytes; inner a
/// multiple of 16): 128 x 64-element boxes, the same 128-byte rows.
void encode(CUtensorMap* map, DType dt, const void* ptr, int64_t inner, int64_t outer, const char* fn) {
  const bool f8 = is_fp8(dt);
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(inner) * (f8 ? 1 : 2)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(f8 ? 2 * kBox : kBox), kBox}, elem_strides[2] = {1, 1};
  const CUtensorMapDataType type = f8                    ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : dt == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                        : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r =
      encoder()(map, type, 2,
                const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MT_CHECK(r == CUDA_SUCCESS, "{}: cuTensorMapEncodeTiled failed ({}) for a [{}, {}] {} matrix at {}", fn,
           static_cast<int>(r), outer, inner, dtype_name(dt), ptr);
}

int sm_count() {
  static std::mutex mu;
  static std::map<int, int> counts;
  int dev = 0;
  MT_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = counts.find(dev);
  if (it != counts.end()) return it->second;
  int n = 0;
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  counts[dev] = n;
  return n;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

/// The output-tile width: forced, or auto_tile_width.
int pick_bn(int64_t N) {
  const Kernel k = kernel();
  if (k == Kernel::kWgmma128) return 128;
  if (k == Kernel::kWgmma256) return 256;
  return auto_tile_width(N);
}

/// Why the wgmma kernel does not apply ("" when it does).
std::string why_not(DType dt, const GroupedWeights& w, bool need_maps, int64_t R,
                    std::initializer_list<const void*> ptrs) {
  if (dt != DType::kBF16 && dt != DType::kF16 && !is_fp8(dt)) {
    return fmt::format("the dtype is {} (it takes bf16, fp16, FP8)", dtype_name(dt));
  }
  if (!w.hopper())
    return "the weights are not usable by it (a device of compute capability 9.0 running the sm_90a code, 16-byte "
           "aligned tensors, n and k multiples of 8)";
  if (need_maps && !w.tensor_maps()) return "the weights have no tensor maps";
  if (w.groups() > kMaxGroups) return fmt::format("{} groups, more than its {}", w.groups(), kMaxGroups);
  if (R > INT32_MAX) return fmt::format("{} rows exceed its int32 range", R);
  for (const void* p : ptrs)
    if (!aligned16(p)) return fmt::format("the pointer {} is not 16-byte aligned", p);
  return "";
}

/// Whether to run the wgmma kernel (errors where it was forced but does not apply).
bool use_wgmma(const char* fn, const std::string& why) {
  const Kernel k = kernel();
  if (k == Kernel::kMmaSync) return false;
  if (why.empty()) return true;
  MT_CHECK(k == Kernel::kAuto, "{}: the wgmma kernel was requested but {}", fn, why);
  return false;
}

template <typename T, Mode kMode, int BN, bool kPingPong, WgradEpilogue kEpi>
void launch_typed(const char* fn, const Params& p, int64_t tiles_bound, const Stream& stream) {
  using Tl = Tiling<BN>;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(sm_count(), tiles_bound)));
  grouped::allow_smem(wgmma_kernel<T, kMode, BN, kPingPong, kEpi>, Tl::kSmem, Tl::kStaticSmem, fn);
  wgmma_kernel<T, kMode, BN, kPingPong, kEpi><<<grid, kThreads, Tl::kSmem, raw(stream)>>>(p);
  MT_CUDA_CHECK_LAUNCH();
}

template <typename T, Mode kMode, WgradEpilogue kEpi>
void launch_width(const char* fn, const Params& p, int bn, bool pingpong, int64_t tiles, const Stream& stream) {
  if (pingpong) {
    launch_typed<T, kMode, 128, true, kEpi>(fn, p, tiles, stream);
  } else if (bn == 256) {
    launch_typed<T, kMode, 256, false, kEpi>(fn, p, tiles, stream);
  } else {
    launch_typed<T, kMode, 128, false, kEpi>(fn, p, tiles, stream);
  }
}

/// launch_width with the wgrad's epilogue of wgrad_epilogue() (forward, dgrad: none).
template <typename T, Mode kMode>
void launch_epilogue(const char* fn, const Params& p, int bn, bool pingpong, int64_t tiles, const Stream& stream) {
  using E = WgradEpilogue;
  if constexpr (kMode == Mode::kWgrad) {
    switch (wgrad_epilogue()) {
      case E::kReadModifyWriteL2Prefetch:
        return launch_width<T, kMode, E::kReadModifyWriteL2Prefetch>(fn, p, bn, pingpong, tiles, stream);
      case E::kPreload:
        return launch_width<T, kMode, E::kPreload>(fn, p, bn, pingpong, tiles, stream);
      case E::kPreloadL2Prefetch:
        return launch_width<T, kMode, E::kPreloadL2Prefetch>(fn, p, bn, pingpong, tiles, stream);
      case E::kReadModifyWrite:
        break;
    }
  }
  launch_width<T, kMode, E::kReadModifyWrite>(fn, p, bn, pingpong, tiles, stream);
}

/// Launches mode kMode: ping-pong 128 x 128 tiles where kernel() asks for them, else the
/// cooperative kernel with pick_bn's width; tiles_bound(bn): an upper bound of the work tiles.
template <Mode kMode, typename TilesBound>
void launch(const char* fn, DType dt, const Params& p, TilesBound tiles_bound, const Stream& stream) {
  const bool pingpong = kernel() == Kernel::kWgmmaPingPong;
  const int bn = pingpong ? 128 : pick_bn(p.N);
  const int64_t tiles = tiles_bound(bn);
  if (dt == DType::kBF16) {
    launch_epilogue<__nv_bfloat16, kMode>(fn, p, bn, pingpong, tiles, stream);
  } else {
    launch_epilogue<__half, kMode>(fn, p, bn, pingpong, tiles, stream);
  }
}

/// An FP8 op (an FP8 kernel type; a: e4m3 or e5m2, b e4m3): the forward, or the wgrad with the
/// read-modify-write epilogue (with the L2 prefetch where wgrad_epilogue() has it: the FP8 product
/// is scaled before it is added, so the preload kinds run as their read-modify-write ones).
template <Mode kMode, typename TilesBound>
void launch_fp8(const char* fn, DType a_dt, const Params& p, TilesBound tiles_bound, const Stream& stream) {
  const bool pingpong = kernel() == Kernel::kWgmmaPingPong;
  const int bn = pingpong ? 128 : pick_bn(p.N);
  const int64_t tiles = tiles_bound(bn);
  using E = WgradEpilogue;
  const E e = wgrad_epilogue();
  const bool l2 = kMode == Mode::kWgrad && (e == E::kReadModifyWriteL2Prefetch || e == E::kPreloadL2Prefetch);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    if (l2) {
      if constexpr (kMode == Mode::kWgrad) launch_width<T, kMode, E::kReadModifyWriteL2Prefetch>(fn, p, bn, pingpong, tiles, stream);
    } else {
      launch_width<T, kMode, E::kReadModifyWrite>(fn, p, bn, pingpong, tiles, stream);
    }
  };
  if (a_dt == DType::kF8E4M3) {
    run(Fp8E4M3{});
  } else {
    run(Fp8E5M2{});
  }
}

/// The FP8 scales of Params (1 or G entries each).
void set_scales(Params& p, const Tensor& a_scale_inv, const Tensor& b_scale_inv) {
  p.sa = a_scale_inv.data_as<float>();
  p.sb = b_scale_inv.data_as<float>();
  p.sa_stride = a_scale_inv.numel() == 1 ? 0 : 1;
  p.sb_stride = b_scale_inv.numel() == 1 ? 0 : 1;
}

Params base_params(const Tensor& counts, const GroupedWeights& w, int64_t R) {
  Params p{};
  p.counts = counts.data_as<int32_t>();
  p.G = static_cast<int>(w.groups());
  p.R = static_cast<int>(R);
  return p;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void set_kernel(Kernel k) { g_kernel.store(static_cast<int>(k)); }
Kernel kernel() { return static_cast<Kernel>(g_kernel.load()); }
void set_wgrad_epilogue(WgradEpilogue e) { g_wgrad_epilogue.store(static_cast<int>(e)); }
WgradEpilogue wgrad_epilogue() { return static_cast<WgradEpilogue>(g_wgrad_epilogue.load()); }

int auto_tile_width(int64_t N) {
  const int64_t w256 = (N + 255) / 256 * 256, w128 = (N + 127) / 128 * 128;
  return w256 * 100 <= w128 * 104 ? 256 : 128;
}

bool device_ready(const Stream& stream) {
  static std::mutex mu;
  static std::map<int, bool> ready;
  int dev = 0;
  MT_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = ready.find(dev); it != ready.end()) return it->second;
  bool ok = false;
  if (compute_capability(Device::cuda(dev)) == 90) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    MT_CUDA_CHECK(cudaStreamIsCapturing(raw(stream), &cap));
    MT_CHECK(cap == cudaStreamCaptureStatusNone,
             "grouped GEMM: the first use on cuda:{} probes the device and cannot run inside a CUDA graph capture "
             "(build the GroupedWeights before capturing)",
             dev);
    Buffer flag(stream.device(), sizeof(int));
    probe_kernel<<<1, 1, 0, raw(stream)>>>(static_cast<int*>(flag.data()));
    MT_CUDA_CHECK_LAUNCH();
    int host = 0;
    copy_bytes(&host, Device::cpu(), flag.data(), stream.device(), sizeof(int), stream);
    stream.synchronize();
    ok = host == 1;
  }
  ready[dev] = ok;
  return ok;
}

WeightMaps build_weight_maps(const std::vector<Tensor>& w, const Stream& stream) {
  WeightMaps r;
  const Tensor& w0 = w.front();
  const int64_t n = w0.size(0), k = w0.size(1);
  bool ok = n > 0 && k > 0 && n % 8 == 0 && k % 8 == 0 && n <= INT32_MAX && k <= INT32_MAX &&
            static_cast<int64_t>(w.size()) <= kMaxGroups;
  for (const Tensor& t : w) ok = ok && aligned16(t.data());
  if (!ok || !device_ready(stream)) return r;
  r.hopper = true;
  if (w0.dtype() != DType::kBF16 && w0.dtype() != DType::kF16 && w0.dtype() != DType::kF8E4M3) return r;
  std::vector<CUtensorMap> host(w.size());
  for (size_t g = 0; g < w.size(); ++g) encode(&host[g], w0.dtype(), w[g].data(), k, n, "GroupedWeights");
  r.maps = Buffer(w0.device(), host.size() * sizeof(CUtensorMap));
  copy_bytes(r.maps.data(), w0.device(), host.data(), Device::cpu(), host.size() * sizeof(CUtensorMap), stream);
  stream.synchronize();  // `host` goes out of scope; built once, outside a step
  return r;
}

namespace {

/// The forward (out = y, in = x, N = n, K = k) or the dgrad (out = dx, in = dy, N = k, K = n).
template <Mode kMode>
bool rows_op(const char* fn, const Tensor& out, const Tensor& in, const GroupedWeights& w, const Tensor& counts,
             int64_t N, int64_t K, const Stream& stream) {
  const int64_t R = in.size(0);
  if (!use_wgmma(fn, why_not(in.dtype(), w, true, R, {in.data(), out.data()}))) return false;
  Params p = base_params(counts, w, R);
  encode(&p.a, in.dtype(), in.data(), K, R, fn);
  p.wmaps = static_cast<const CUtensorMap*>(w.tensor_maps());
  p.c = out.data();
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  launch<kMode>(fn, in.dtype(), p,
                [&](int bn) { return (ceil_div(R, kBM) + w.groups()) * ceil_div(N, bn); }, stream);
  return true;
}

}  // namespace

bool forward(const Tensor& y, const Tensor& x, const GroupedWeights& w, const Tensor& counts, const Stream& stream) {
  return rows_op<Mode::kForward>("grouped_linear_forward", y, x, w, counts, w.rows(), w.cols(), stream);
}

bool dgrad(const Tensor& dx, const Tensor& dy, const GroupedWeights& w, const Tensor& counts, const Stream& stream) {
  return rows_op<Mode::kDgrad>("grouped_linear_dgrad", dx, dy, w, counts, w.cols(), w.rows(), stream);
}

bool fp8_forward(const Tensor& y, const Tensor& aq, const Tensor& a_scale_inv, const GroupedWeights& wq,
                 const Tensor& w_scale_inv, const Tensor& counts, const Stream& stream) {
  const char* fn = "grouped_fp8_linear_forward";
  const int64_t R = aq.size(0), N = wq.rows(), K = wq.cols();
  std::string why = wq.dtype() != DType::kF8E4M3
                        ? fmt::format("the weights are {} (it takes fp8_e4m3 weights)", dtype_name(wq.dtype()))
                        : why_not(aq.dtype(), wq, true, R, {aq.data(), y.data()});
  if (!use_wgmma(fn, why)) return false;
  Params p = base_params(counts, wq, R);
  encode(&p.a, aq.dtype(), aq.data(), K, R, fn);
  p.wmaps = static_cast<const CUtensorMap*>(wq.tensor_maps());
  p.c = y.data();
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  set_scales(p, a_scale_inv, w_scale_inv);
  launch_fp8<Mode::kForward>(fn, aq.dtype(), p,
                             [&](int bn) { return (ceil_div(R, kBM) + wq.groups()) * ceil_div(N, bn); }, stream);
  return true;
}

bool fp8_wgrad(const GroupedWeights& dw, const Tensor& dyq_t, const Tensor& dy_scale_inv, const Tensor& xq_t,
               const Tensor& x_scale_inv, const Tensor& counts, const Stream& stream) {
  const char* fn = "grouped_fp8_linear_wgrad";
  const int64_t R = xq_t.size(1), n = dw.rows(), k = dw.cols();
  std::string why = xq_t.dtype() != DType::kF8E4M3
                        ? fmt::format("xq_t is {} (it takes fp8_e4m3 for x)", dtype_name(xq_t.dtype()))
                        : why_not(dyq_t.dtype(), dw, false, R, {dyq_t.data(), xq_t.data()});
  if (!use_wgmma(fn, why)) return false;
  Params p = base_params(counts, dw, R);
  encode(&p.a, dyq_t.dtype(), dyq_t.data(), R, n, fn);
  encode(&p.b, xq_t.dtype(), xq_t.data(), R, k, fn);
  p.dw = dw.table();
  p.M = static_cast<int>(n);
  p.N = static_cast<int>(k);
  set_scales(p, dy_scale_inv, x_scale_inv);
  launch_fp8<Mode::kWgrad>(fn, dyq_t.dtype(), p,
                           [&](int bn) { return dw.groups() * ceil_div(n, kBM) * ceil_div(k, bn); }, stream);
  return true;
}

bool wgrad(const GroupedWeights& dw, const Tensor& dy, const Tensor& x, const Tensor& counts, const Stream& stream) {
  const char* fn = "grouped_linear_wgrad";
  const int64_t R = x.size(0), n = dw.rows(), k = dw.cols();
  if (!use_wgmma(fn, why_not(x.dtype(), dw, false, R, {dy.data(), x.data()}))) return false;
  Params p = base_params(counts, dw, R);
  encode(&p.a, dy.dtype(), dy.data(), n, R, fn);
  encode(&p.b, x.dtype(), x.data(), k, R, fn);
  p.dw = dw.table();
  p.M = static_cast<int>(n);
  p.N = static_cast<int>(k);
  launch<Mode::kWgrad>(fn, x.dtype(), p,
                       [&](int bn) { return dw.groups() * ceil_div(n, kBM) * ceil_div(k, bn); }, stream);
  return true;
}

}  // namespace mt::cuda::grouped_sm90
