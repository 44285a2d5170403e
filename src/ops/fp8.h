// FP8 quantisation ops (docs/fp8.md): amax, scales (current and delayed scaling), tensorwise and
// blockwise quantisation with the transposed output in the same pass, dequantisation. The recipes
// are Transformer Engine's (transformer_engine/common/recipe: Float8CurrentScaling, DelayedScaling,
// Float8BlockScaling) as Megatron-LM selects them (--fp8-recipe tensorwise|delayed|blockwise).
// Every scale and amax lives in device memory and is read by the kernels there: no host
// synchronisation, capturable in CUDA graphs. CPU: the reference (fp32 inputs), bit-identical to
// CUDA for every output (the scalar formulas are shared: ops/fp8_math.h, core/dtype.h).
#pragma once
#include <vector>

#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"
#include "ops/fp8_math.h"

namespace mt {

/// Fp8Scaling (ops/fp8_math.h): kTensor, kBlock1x128, kBlock128x128.

/// Shape of the fp32 dequantisation-scale tensor of an x [rows, cols] under `s`: {1} (tensorwise),
/// {ceil(cols/128), pad4(rows)} (1x128), {ceil(rows/128), pad4(ceil(cols/128))} (128x128): the
/// layouts cuBLASLt's VEC128_32F / BLK128x128_32F scale modes read (ops/fp8_math.h).
std::vector<int64_t> fp8_scale_shape(Fp8Scaling s, int64_t rows, int64_t cols);

/// amax[0] = max |x| over every element (NaN elements are passed over, infinities count; 0 for an
/// empty x), written over amax. x: any shape, contiguous, fp32 (CPU) or fp32/bf16/fp16 (CUDA);
/// amax: fp32, one element, same device. CUDA: a memset and one reduction kernel (atomic max of the
/// float bits: order-independent, so bit-identical to the CPU). The amax of a sharded tensor is
/// then all-reduced (MAX) over the ranks holding its shards (docs/fp8.md "Layout invariance").
/// Errors: mt::Error on a wrong dtype, shape, device or stream.
void fp8_amax(const Tensor& amax, const Tensor& x, const Stream& stream);

/// Current scaling (Megatron's --fp8-recipe tensorwise; TE's Float8CurrentScaling): for each of
/// n tensors, scale[i] = fp8_max(fp8) / max(amax[i], epsilon) (1 when the amax is 0, inf or NaN;
/// FLT_MAX when the quotient overflows; rounded down to a power of two when pow2) and scale_inv[i]
/// = 1 / scale[i]. amax, scale, scale_inv: fp32 [n] (any shape of n elements), contiguous, one
/// device. fp8: kF8E4M3 or kF8E5M2. Errors: mt::Error on mismatched tensors, a non-FP8 `fp8`,
/// epsilon < 0.
void fp8_scale_from_amax(const Tensor& scale, const Tensor& scale_inv, const Tensor& amax, DType fp8, bool pow2,
                         float epsilon, const Stream& stream);

/// Delayed scaling (Megatron's --fp8-recipe delayed with --fp8-amax-history-len,
/// --fp8-amax-compute-algo, --fp8-margin; TE's DelayedScaling and its
/// amax_and_scale_update_after_reduction): amax_history fp32 [len, n] holds each of n tensors'
/// amax history in a column, row 0 the amax recorded during this step (by fp8_quantize's `amax`,
/// after the all-reduce over the tensor's shards). For every column: the history rolls and
/// row 0 is cleared, amax = row 0 (kMostRecent) or the max of the column (kMax), scale = fp8_max
/// * 2^-margin / amax, scale_inv = 1 / scale; a column whose row 0 is 0 (tensor not quantised this
/// step) keeps its history and scale (ops/fp8_math.h delayed_update gives every rule). scale,
/// scale_inv: fp32 [n]. len >= 1, margin >= 0. Errors: mt::Error on mismatched tensors, a
/// non-FP8 `fp8`, margin < 0.
void fp8_delayed_scale_update(const Tensor& amax_history, const Tensor& scale, const Tensor& scale_inv, DType fp8,
                              int margin, fp8_math::AmaxAlgo algo, const Stream& stream);

/// Tensorwise quantisation with a device scale (current or delayed scaling), and the transpose in
/// the same pass (cast + transpose: Hopper's FP8 GEMM reads only K-major operands, so the wgrad
/// and dgrad GEMMs need x^T, dy^T and w^T; docs/fp8.md "Hopper layout rule"):
///   q[r, c] = fp8(x[r, c] * scale[0]),   q_t[c, r] = q[r, c]
/// with fp8() rounding to nearest even and saturating to +-fp8_max (core/dtype.h; a NaN element
/// becomes fp8_math::kNaNCode, 0x7f, on both backends). x: [..., cols]
/// viewed as [rows, cols], contiguous, fp32 (CPU) or fp32/bf16/fp16 (CUDA); q: x's shape,
/// kF8E4M3 or kF8E5M2 (empty: not written); q_t: [cols, rows] of the same FP8 dtype (empty: not
/// written; at least one of q, q_t). scale: fp32, one element (the quantisation scale, 1 /
/// scale_inv). amax: fp32, one element, or empty: when given, amax[0] = max(amax[0], max |x|)
/// (NaN passed over; amax[0] must hold a value >= 0), the delayed-scaling record into the amax
/// history's row 0. All on one device. Errors: mt::Error on wrong dtypes, shapes, devices, more
/// than 65535 * 128 rows on CUDA.
void fp8_quantize(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale, const Tensor& amax,
                  const Stream& stream);

/// fp8_quantize of the bf16 rounding of fp32 values, in one pass: each element of x is rounded to
/// bf16 (nearest even, as the optimizer rounds the fp32 main parameters into bf16 weights) before
/// it is scaled, so q, q_t and the amax record are bit for bit those of fp8_quantize(q, q_t,
/// bf16(x), scale, amax) — without the bf16 copy (docs/fp8.md "Memory": the FP8 weight copies kept
/// in the bf16 weights' storage are quantised from the fp32 main parameters). Current scaling
/// takes its scale from fp8_amax(x) rounded to bf16: rounding is monotonic and symmetric, so that
/// is the amax of the rounded values. x: fp32 [..., cols] viewed as [rows, cols], contiguous, on
/// either backend; q, q_t, scale, amax as fp8_quantize. Errors: mt::Error as fp8_quantize, and for
/// a non-fp32 x.
void fp8_quantize_bf16_rounded(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale,
                               const Tensor& amax, const Stream& stream);

/// Blockwise quantisation (Megatron's --fp8-recipe blockwise; TE's Float8BlockScaling, DeepSeek-V3
/// style) with the scales computed from each block's amax in the same pass: for every block B of
/// x [rows, cols] (`scaling` kBlock1x128: 1 row x 128 columns; kBlock128x128: 128 x 128; ragged
/// edge blocks are smaller), s_B = fp8_math::scale_from_amax(max_B |x|, fp8_max, pow2, 0) and
///   q[r, c] = fp8(x[r, c] * s_B),   q_scale_inv[...] = 1 / s_B   (layout: fp8_scale_shape)
/// q_t / q_t_scale_inv: exactly what this op gives for x^T [cols, rows] (for 1x128 the blocks run
/// down x's columns, 128 rows each, so the transpose is quantised apart from q, as TE does; for
/// 128x128 they hold q's blocks transposed). Either pair may be empty (not both). Scale tensors:
/// fp32 of exactly fp8_scale_shape(scaling, rows, cols) (q) and (scaling, cols, rows) (q_t); their
/// padding entries are set to 0. pow2: power-of-two scales (TE's default for this recipe). x, q,
/// q_t as fp8_quantize. Errors: mt::Error on wrong dtypes, shapes, devices, scaling kTensor.
void fp8_quantize_blockwise(const Tensor& q, const Tensor& q_scale_inv, const Tensor& q_t, const Tensor& q_t_scale_inv,
                            const Tensor& x, Fp8Scaling scaling, bool pow2, const Stream& stream);

/// y[r, c] = fp8_to_f32(q[r, c]) * s(r, c) in fp32, stored in y's dtype, with s from scale_inv
/// under `scaling` (one element for kTensor; fp8_scale_shape(scaling, rows, cols) for the block
/// scalings). q: [..., cols] FP8; y: q's shape, fp32 (CPU) or fp32/bf16/fp16 (CUDA). Errors:
/// mt::Error on wrong dtypes, shapes or devices.
void fp8_dequantize(const Tensor& y, const Tensor& q, const Tensor& scale_inv, Fp8Scaling scaling,
                    const Stream& stream);

/// Errors (mt::Error naming the device, its compute capability and what is needed) unless
/// `device` runs the FP8 GEMMs of fp8_matmul: the CPU always (the emulation); a GPU needs FP8
/// tensor cores, compute capability >= 8.9 (Ada, Hopper, Blackwell), and for the block scalings
/// (`blockwise`) Hopper, 9.x (cuBLASLt's VEC128_32F / BLK128x128_32F scale modes; Transformer
/// Engine emulates the recipe with MXFP8 on later GPUs). Checked before any work (docs/fp8.md).
void fp8_check_device(Device device, bool blockwise);

MT_OP_BACKENDS(fp8_amax)
MT_OP_BACKENDS(fp8_scale_from_amax)
MT_OP_BACKENDS(fp8_delayed_scale_update)
MT_OP_BACKENDS(fp8_quantize)
MT_OP_BACKENDS(fp8_quantize_bf16_rounded)
MT_OP_BACKENDS(fp8_quantize_blockwise)
MT_OP_BACKENDS(fp8_dequantize)


}  // namespace mt
