// Element-wise pieces of the Muon optimizer step (optim/muon.h) that keep it on the device with no
// host sync: the momentum update reading the loss scale, clip coefficient and found_inf from the
// optimizer's device scalars (ops/optimizer.h), the Frobenius norm of a matrix into a device
// scalar and the normalisation by it, and a strided 2-D block copy (gathering a QKV component or
// a row-parallel shard into a contiguous matrix and back). The Newton-Schulz products themselves
// are ops/matmul.h GEMMs (cuBLASLt on CUDA, OpenBLAS on the CPU).
#pragma once
#include <cmath>
#include <cstdint>

#include "core/dtype.h"  // MT_HD
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// fp32 elements of the norm scratch muon_sumsq and muon_normalize need: element 0 is the sum of
/// squares, the rest the CUDA reduction's per-block partials (fixed grid: deterministic).
inline constexpr int64_t kMuonNormBlocks = 256;
inline constexpr int64_t kMuonNormScratch = kMuonNormBlocks + 1;

/// Muon's momentum (Jordan 2024, "Muon: An optimizer for hidden layers"; emerging_optimizers'
/// OrthogonalizedOptimizer.step, which Megatron-LM's --optimizer muon uses), per element with
/// g = grad · (1 / loss_scale) · clip_coeff (the optimizer scalars after optimizer_prepare):
///   m = beta · m + (1 - beta) · g                      (momentum.lerp_(g, 1 - beta))
///   u = nesterov ? (1 - beta) · g + beta · m : m       (g.lerp(m, beta))
/// When found_inf: m is left alone and u = 0. grad, momentum, u: fp32 [n]; u may be grad itself
/// (in place) but not momentum. scalars: the OptimizerScalars bytes on the tensors' device.
/// Errors: mt::Error for a dtype, size or device mismatch, beta outside [0, 1), or u aliasing
/// momentum.
void muon_momentum(const Tensor& u, const Tensor& grad, const Tensor& momentum, float beta, bool nesterov,
                   const Tensor& scalars, const Stream& stream);

/// scratch[0] = sum_i x_i^2 (fp32 accumulation in a fixed order on each backend). x: fp32 or
/// bf16, any shape, contiguous; scratch: fp32 [>= kMuonNormScratch] on x's device. Errors:
/// mt::Error on a dtype, size or device mismatch.
void muon_sumsq(const Tensor& scratch, const Tensor& x, const Stream& stream);

/// y = x · (1 / max(sqrt(scratch[0]), eps)) (torch.nn.functional.normalize over the whole matrix),
/// reading the sum of squares from the device (after muon_sumsq, and an all-reduce of scratch[0]
/// when the matrix is sharded). x: fp32 [n]; y: fp32 or bf16 [n] (rounded once), may be x when
/// both are fp32. Errors: as muon_sumsq, eps <= 0, or a y/x size mismatch.
void muon_normalize(const Tensor& y, const Tensor& x, const Tensor& scratch, float eps, const Stream& stream);

/// A 2-D strided copy of `rows` rows of `cols` elements: row i of dst starts at element
/// i · dst_stride of dst, row i of src at i · src_stride of src (cudaMemcpy2DAsync on CUDA).
/// dst and src: same dtype and device, flat views covering the strided extents; strides >= cols.
/// Errors: mt::Error for a dtype/device mismatch or extents beyond either tensor.
void muon_copy_2d(const Tensor& dst, int64_t dst_stride, const Tensor& src, int64_t src_stride, int64_t rows,
                  int64_t cols, const Stream& stream);

namespace detail {
/// One element of muon_momentum (shared by both backends: identical bits).
MT_HD float muon_momentum_element(float grad, float& m, float beta, bool nesterov, float inv_scale, float clip) {
  const float g = grad * inv_scale * clip;
  m = fmaf(beta, m, (1.f - beta) * g);
  return nesterov ? fmaf(beta, m, (1.f - beta) * g) : m;
}
}  // namespace detail

MT_OP_BACKENDS(muon_momentum)
MT_OP_BACKENDS(muon_sumsq)
MT_OP_BACKENDS(muon_normalize)
MT_OP_BACKENDS(muon_copy_2d)

}  // namespace mt
