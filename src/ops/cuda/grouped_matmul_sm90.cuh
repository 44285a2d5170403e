// The Hopper (sm_90a) grouped GEMM behind ops/grouped_matmul.h (ops/cuda/grouped_matmul_sm90.cu):
// wgmma on tensor cores, operands brought into shared memory by TMA, a persistent grid whose
// work tiles are found on the device from the counts. Plain C++ declarations (no CUDA syntax):
// included by ops/grouped_matmul.cpp (GroupedWeights' tensor maps), the CUDA entry points in
// ops/cuda/grouped_matmul.cu, and the tests and bench that pick the kernel.
#pragma once
#include <vector>

#include "core/buffer.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace mt {
class GroupedWeights;
}

namespace mt::cuda::grouped_sm90 {

/// Which kernel the CUDA grouped GEMMs run (process-wide; a test and bench hook). kAuto: the
/// wgmma kernel where it applies (below), else the mma.sync / SIMT kernels. kMmaSync: always the
/// latter. kWgmma / kWgmma128 / kWgmma256: the wgmma kernel with the automatic / a 128- / a
/// 256-column tile; kWgmmaPingPong: its ping-pong schedule (128 x 128 tiles, each consumer
/// warpgroup a whole tile, one's epilogue beside the other's main loop). Forced kinds raise an
/// mt::Error naming the reason where the kernel does not apply.
enum class Kernel { kAuto, kMmaSync, kWgmma, kWgmma128, kWgmma256, kWgmmaPingPong };
void set_kernel(Kernel k);
Kernel kernel();

/// How the wgmma wgrad adds a tile's product to the fp32 dW (process-wide; a test and bench hook,
/// with any Kernel above). kReadModifyWrite: after the main loop each consumer thread loads its dW
/// elements in chunks of 16 float2, adds its accumulators and stores them. kPreload: each consumer
/// thread loads its dW elements into its accumulators before the main loop (all of them in flight
/// at once; in the ping-pong schedule before it waits for its turn, i.e. behind the other
/// warpgroup's main loop), the wgmmas accumulate onto them and the epilogue only stores. The sums
/// differ by fp32 rounding (dW + Σ instead of Σ then + dW). The *L2Prefetch kinds: besides, the
/// producer thread asks for the tile's dW rows in L2 (cp.async.bulk.prefetch.L2) with the loads
/// of the tile's first (preload) or last (read-modify-write) stage, so that the consumers' dW
/// loads find them there. Forward and dgrad ignore it.
enum class WgradEpilogue { kReadModifyWrite, kReadModifyWriteL2Prefetch, kPreload, kPreloadL2Prefetch };
/// The default: preload + L2 prefetch. H200, 2026-11-28, bench/grouped_matmul_bench, MLP (fc1 + fc2,
/// forward + dgrad + wgrad) against the per-expert cuBLASLt loop, read-modify-write -> this:
/// Mixtral-style balanced 0.881 -> 0.922, skewed 0.894 -> 0.929; DeepSeek-style (64 experts)
/// balanced 0.871 -> 1.308, skewed 1.004 -> 1.471 (docs/benchmarks.md).
inline constexpr WgradEpilogue kDefaultWgradEpilogue = WgradEpilogue::kPreloadL2Prefetch;
void set_wgrad_epilogue(WgradEpilogue e);
WgradEpilogue wgrad_epilogue();

/// kernel() = k and wgrad_epilogue() = e while in scope; then kAuto and kDefaultWgradEpilogue (the
/// defaults) again. For tests and benchmarks.
class KernelScope {
 public:
  explicit KernelScope(Kernel k, WgradEpilogue e = kDefaultWgradEpilogue) {
    set_kernel(k);
    set_wgrad_epilogue(e);
  }
  ~KernelScope() {
    set_kernel(Kernel::kAuto);
    set_wgrad_epilogue(kDefaultWgradEpilogue);
  }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;
};

/// The wgmma kernel's output-tile width for N output columns when not forced: 256, unless it
/// pads the columns by more than 4% beyond what 128 pads (N = 1408: 128).
int auto_tile_width(int64_t N);

/// Whether the current CUDA device has compute capability 9.0 and runs this binary's sm_90a
/// code (a one-thread probe kernel, once per device: it synchronises `stream`, so call it outside
/// a captured region — GroupedWeights' constructor does).
bool device_ready(const Stream& stream);

/// What GroupedWeights keeps for the wgmma kernel: `hopper` when the device is ready, every
/// tensor 16-byte aligned and n, k multiples of 8; then, for bf16/fp16 (and fp8_e4m3) tensors,
/// `maps` holds one TMA tensor map per tensor (128 bytes each, on the device: 2-D [n, k], boxes of
/// 64 x 64 elements (FP8: 128 x 64), 128-byte swizzle), built once (synchronises `stream`).
struct WeightMaps {
  Buffer maps;
  bool hopper = false;
};
WeightMaps build_weight_maps(const std::vector<Tensor>& w, const Stream& stream);

/// The ops of ops/grouped_matmul.h on the wgmma kernel (arguments already validated). Each
/// returns false without doing anything when the kernel does not apply (fp32, no tensor maps or
/// not `hopper()`, a pointer not 16-byte aligned, more than 1024 groups, or kernel() is kMmaSync);
/// with a forced wgmma kernel() that is an mt::Error instead.
bool forward(const Tensor& y, const Tensor& x, const GroupedWeights& w, const Tensor& counts, const Stream& stream);
bool dgrad(const Tensor& dx, const Tensor& dy, const GroupedWeights& w, const Tensor& counts, const Stream& stream);
bool wgrad(const GroupedWeights& dw, const Tensor& dy, const Tensor& x, const Tensor& counts, const Stream& stream);
/// grouped_fp8_linear_forward on the wgmma kernel (FP8 wgmma m64nBNk32; the weights e4m3, aq e4m3
/// or e5m2, their maps built by GroupedWeights); false / an error as above.
bool fp8_forward(const Tensor& y, const Tensor& aq, const Tensor& a_scale_inv, const GroupedWeights& wq,
                 const Tensor& w_scale_inv, const Tensor& counts, const Stream& stream);
/// grouped_fp8_linear_wgrad on the wgmma kernel (xq_t e4m3, dyq_t e4m3 or e5m2; the fp32 gradients
/// as `hopper()`; the read-modify-write epilogue, see WgradEpilogue); false / an error as above.
bool fp8_wgrad(const GroupedWeights& dw, const Tensor& dyq_t, const Tensor& dy_scale_inv, const Tensor& xq_t,
               const Tensor& x_scale_inv, const Tensor& counts, const Stream& stream);

}  // namespace mt::cuda::grouped_sm90
