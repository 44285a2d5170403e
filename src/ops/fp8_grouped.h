// FP8 quantisation of grouped rows with one tensorwise scale per group (docs/fp8.md "The MoE
// experts' grouped GEMM"): the inputs and output gradients of the grouped expert MLP
// (--moe-grouped-gemm with --fp8-format), quantised per expert as the sequential experts' Fp8Linear
// quantises each expert's rows, with the per-group row counts read on the device (no host
// synchronisation; CUDA-graph capturable), as ops/grouped_matmul.h reads them.
//
// G groups share a [R, k] row buffer: group g owns rows [off_g, off_g + c_g), off_g = c_0 + ... +
// c_{g-1}; rows [Σc, R) are the tail. Per-group fp32 values (amax, scale, record) are G elements
// at a fixed stride: a contiguous [G] tensor or a [G, 1] view of any stride(0) (e.g. a row of
// Fp8Model's strided state, model/fp8/fp8_model.h).
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// amax[g] = max |x[r, c]| over the rows r of group g and every column (NaN passed over,
/// infinities count; 0 for an empty group), written over amax (fp8_amax per group). x: [R, k]
/// contiguous, fp32 (CPU) or fp32/bf16/fp16 (CUDA); amax: fp32 G elements (see above); counts:
/// int32 [G] on x's device, c_g >= 0, Σc <= R (checked on CPU; CUDA stops at row R).
/// Errors: mt::Error on wrong dtypes, shapes or devices, Σc > R on CPU, more than 1024 groups on
/// CUDA (the grouped GEMMs' limit).
void fp8_grouped_amax(const Tensor& amax, const Tensor& x, const Tensor& counts, const Stream& stream);

/// Tensorwise quantisation with group g's scale (fp8_quantize per group, in one pass):
///   q[r, c] = fp8(x[r, c] * scale[g(r)]),   q_t[c, r] = q[r, c]     (r < Σc)
/// and zero bytes for the tail: q's rows [Σc, R) and q_t's columns [Σc, Rt). x: [R, k] as
/// fp8_grouped_amax; q: [R, k] kF8E4M3 / kF8E5M2 (empty: not written); q_t: [k, Rt], Rt >= R, same
/// FP8 dtype (empty: not written; at least one of q, q_t). Rt > R lets the transposes of a
/// planned row count be padded to the multiple of 16 that grouped_fp8_linear_wgrad requires.
/// scale: fp32 G elements; record: fp32 G elements or empty: record[g] = max(record[g], amax of
/// group g) (delayed scaling's amax history row 0; an empty group leaves it unchanged).
/// Errors: as fp8_grouped_amax, and on mismatched q / q_t.
void fp8_grouped_quantize(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale,
                          const Tensor& record, const Tensor& counts, const Stream& stream);

MT_OP_BACKENDS(fp8_grouped_amax)
MT_OP_BACKENDS(fp8_grouped_quantize)

namespace fp8_grouped {
/// The stride (elements) between the G per-group values of t: contiguous fp32 [G], or [G, 1] of
/// any stride(0). Errors: mt::Error naming `fn`, `name` and the tensor otherwise.
int64_t value_stride(const Tensor& t, int64_t groups, const char* fn, const char* name);
}  // namespace fp8_grouped

}  // namespace mt
