// Grouped linear layers with per-group row counts read on the device: the GEMMs of the MoE
// experts (Megatron-Core's GroupedMLP / TransformerEngine's GroupedLinear, without the host
// `tokens_per_expert.cpu()` split — docs/architecture.md principle 8; docs/moe.md
// "--moe-grouped-gemm").
//
// G groups share a [R, *] row buffer: group g owns rows [off_g, off_g + c_g), off_g = c_0 + ... +
// c_{g-1} (groups in order, no gaps), c = counts int32 [G] read by the kernels from the tensor's
// device (no host synchronisation; CUDA-graph capturable). R is the planned row capacity; rows
// [Σc, R) are the tail (see each function). Group g has its own weight W_g [n, k] (the experts'
// parameters are separate tensors of the ParamStore): GroupedWeights holds their G views and a
// table of their addresses on the weights' device, built once.
//
// CPU: the reference, fp32 (OpenBLAS sgemm per group; the counts are host memory). CUDA, bf16 /
// fp16 storage with fp32 accumulation, when n and k are multiples of 8 and every pointer is
// 16-byte aligned: on Hopper (compute capability 9.0) the wgmma kernel (ops/cuda/
// grouped_matmul_sm90.cu: TMA loads into a 4-6-stage shared-memory pipeline, one producer and two
// consumer warpgroups, 128x256 or 128x128 output tiles, a persistent grid that walks the (group,
// row tile, column tile) work found on the device from the counts); elsewhere tensor cores
// through mma.sync m16n8k16 (ops/cuda/grouped_matmul.cu: 128x128x32 block tiles, a cp.async
// 3-stage K loop, a grid sized for the worst case ceil(R/128) + G row tiles). Otherwise (and
// always for fp32) a tiled fp32 SIMT kernel. Each output tile is computed by one block with a
// fixed reduction order: deterministic, no atomics.
#pragma once
#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// The weights (or fp32 main gradients) of G groups: G contiguous tensors of one dtype, device and
/// shape [n, k], plus a table of their G addresses on that device (a Buffer filled once at
/// construction: on CUDA one host-to-device copy ordered on `stream`, so build it outside a
/// captured region; fp32/bf16/fp16, or FP8 for grouped_fp8_linear_forward; the tensors' addresses
/// must stay valid and fixed while it is used — the ParamStore's are). Move-only. Errors: mt::Error when the list is empty or the tensors differ in
/// dtype, device or shape, are not 2-D or not contiguous.
class GroupedWeights {
 public:
  GroupedWeights() = default;
  GroupedWeights(std::vector<Tensor> weights, const Stream& stream);
  GroupedWeights(GroupedWeights&&) noexcept = default;
  GroupedWeights& operator=(GroupedWeights&&) noexcept = default;

  bool empty() const { return w_.empty(); }
  int64_t groups() const { return static_cast<int64_t>(w_.size()); }
  int64_t rows() const { return w_.at(0).size(0); }  ///< n
  int64_t cols() const { return w_.at(0).size(1); }  ///< k
  DType dtype() const { return w_.at(0).dtype(); }
  Device device() const { return w_.at(0).device(); }
  const Tensor& operator[](int64_t g) const { return w_.at(static_cast<size_t>(g)); }
  /// The table: G addresses on device(), entry g = (*this)[g].data().
  void* const* table() const { return static_cast<void* const*>(table_.data()); }
  /// True when every address is 16-byte aligned (the tensor-core path's requirement).
  bool aligned16() const { return aligned16_; }
  /// True when the Hopper wgmma kernel may use these tensors: a CUDA device of compute capability
  /// 9.0 running the sm_90a code, every address 16-byte aligned, n and k multiples of 8.
  bool hopper() const { return hopper_; }
  /// With hopper() and bf16/fp16/fp8_e4m3 tensors: G TMA tensor maps of them on device() (128
  /// bytes each: 2-D [n, k], 64 x 64-element boxes (FP8: 128 x 64), 128-byte swizzle), built once
  /// at construction; else null.
  const void* tensor_maps() const { return maps_.data(); }

 private:
  std::vector<Tensor> w_;
  Buffer table_;
  Buffer maps_;
  bool aligned16_ = false;
  bool hopper_ = false;
};

/// Grouped forward (TE GroupedLinear forward, no bias): y[off_g + i] = x[off_g + i] · W_gᵀ for
/// i < c_g, g < G; the tail rows [Σc, R) of y are set to 0 (so an elementwise activation applied
/// to all R rows sees zeros there).
/// y: [R, n], x: [R, k] (act dtype, contiguous; x's tail rows are not read), w: G weights [n, k]
/// of the act dtype, counts: int32 [G] on the tensors' device, c_g >= 0, Σc <= R (the caller's
/// planned bound: the CPU checks it; CUDA cannot raise from the device and clips the groups at
/// row R). y must not overlap x.
/// Errors: mt::Error on mismatched shapes/dtypes/devices, non-fp32 on CPU, Σc > R on CPU.
void grouped_linear_forward(const Tensor& y, const Tensor& x, const GroupedWeights& w, const Tensor& counts,
                            const Stream& stream);

/// Grouped input gradient (overwrite): dx[off_g + i] = dy[off_g + i] · W_g for i < c_g; the tail
/// rows [Σc, R) of dx are set to 0; dy's tail rows are not read.
/// dx: [R, k], dy: [R, n], w: G weights [n, k], counts as in grouped_linear_forward.
void grouped_linear_dgrad(const Tensor& dx, const Tensor& dy, const GroupedWeights& w, const Tensor& counts,
                          const Stream& stream);

/// Grouped weight gradient (accumulate into fp32 main gradients, beta = 1):
/// dW_g += Σ_{i < c_g} dy[off_g + i]ᵀ · x[off_g + i] (the sum over the group's rows in a fixed
/// order; a group with c_g = 0 leaves dW_g unchanged). dw: G fp32 tensors [n, k]; dy: [R, n],
/// x: [R, k] (act dtype; tail rows not read); counts as in grouped_linear_forward.
void grouped_linear_wgrad(const GroupedWeights& dw, const Tensor& dy, const Tensor& x, const Tensor& counts,
                          const Stream& stream);

/// FP8 grouped GEMM of the rows, tensorwise scales (docs/fp8.md "The MoE experts' grouped GEMM";
/// Transformer Engine's GroupedLinear under Float8CurrentScaling / DelayedScaling): for g < G and
/// i < c_g,  y[off_g + i, j] = (sa_g · sb_g) · Σ_r aq[off_g + i, r] · wq_g[j, r]
/// (the FP8 values multiplied exactly, fp32 accumulation, then the product of the two
/// dequantisation scales sa_g, sb_g of the group, as fp8_matmul). The
/// tail rows [Σc, R) of y are set to 0. Both operands are K-major (Hopper's FP8 rule), so:
///   fprop: y [R, n] from aq = xq [R, k] and wq = the experts' FP8 weights [n, k];
///   dgrad: dx [R, k] from aq = dyq [R, n] and wq = their transposed FP8 copies wᵀ [k, n].
/// y: [R, N] contiguous, fp32 (CPU) or bf16 (CUDA); aq: [R, K] contiguous, kF8E4M3 or kF8E5M2
/// (tail rows not read); wq: G FP8 tensors [N, K]; aq and wq not both e5m2. a_scale_inv,
/// w_scale_inv: contiguous fp32 dequantisation scales of 1 element (one for every group) or G
/// (group g's at entry g: TE's per-GEMM quantizers), read on the device. counts: int32 [G] as in
/// grouped_linear_forward (CUDA clips at row R). N and K multiples of 16, pointers 16-byte aligned
/// (the kernels' 16-byte loads; cuBLASLt's FP8 rule). CPU: per group cpu::fp8_matmul (the FP8
/// emulation). CUDA (compute capability >= 8.9): mma.sync m16n8k32 with FP8 operands
/// (ops/cuda/grouped_matmul.cu); on Hopper, with fp8_e4m3 weights, the wgmma kernel (wgmma
/// m64nNk32, ops/cuda/grouped_matmul_sm90.cu); the scales applied in the epilogue, counts read on
/// the device (capturable). Errors: mt::Error on mismatched shapes/dtypes/devices, a violated requirement,
/// Σc > R on CPU, a GPU below compute capability 8.9.
void grouped_fp8_linear_forward(const Tensor& y, const Tensor& aq, const Tensor& a_scale_inv, const GroupedWeights& wq,
                                const Tensor& w_scale_inv, const Tensor& counts, const Stream& stream);

/// FP8 grouped weight gradient (accumulate into the fp32 main gradients, beta = 1): for g < G
///   dW_g[i, j] += (s_dy,g · s_x,g) · Σ_{r in [off_g, off_g + c_g)} dyq_t[i, r] · xq_t[j, r]
/// (a group with c_g = 0 leaves dW_g unchanged). The operands are the transposes of the whole
/// [R, *] tensors, exactly what fp8_quantize's q_t writes for dy [R, n] and x [R, k] in its
/// cast + transpose pass: dyq_t [n, R], xq_t [k, R] (tokens contiguous, i.e. K-major for this
/// GEMM; group g's segment is columns [off_g, off_g + c_g), so no per-group copy or padding is
/// needed; columns >= Σc are not read). CPU: cpu::fp8_matmul per group on copies of the segments.
/// CUDA: on Hopper with xq_t e4m3 the wgmma kernel (TMA boxes start on a 16-byte boundary, so a
/// segment is read from the 16-column boundary at or before it; the columns before and beyond it
/// are zeroed in shared memory), else the mma.sync FP8 kernel.
/// dw: G fp32 [n, k]; dyq_t, xq_t FP8, not both e5m2;
/// dy_scale_inv, x_scale_inv: fp32 of 1 or G elements. n and k multiples of 16; R a multiple of 16
/// (the transposes' rows 16-byte aligned). Counts need not be multiples of 16: the mma.sync kernel
/// loads a segment that starts off a 16-byte boundary byte by byte (slower; Megatron's
/// --moe-router-padding-for-fp8 gives aligned segments). Errors: as grouped_fp8_linear_forward.
void grouped_fp8_linear_wgrad(const GroupedWeights& dw, const Tensor& dyq_t, const Tensor& dy_scale_inv,
                              const Tensor& xq_t, const Tensor& x_scale_inv, const Tensor& counts,
                              const Stream& stream);

MT_OP_BACKENDS(grouped_linear_forward)
MT_OP_BACKENDS(grouped_linear_dgrad)
MT_OP_BACKENDS(grouped_linear_wgrad)
MT_OP_BACKENDS(grouped_fp8_linear_forward)
MT_OP_BACKENDS(grouped_fp8_linear_wgrad)

}  // namespace mt
