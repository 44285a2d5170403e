// CPU reference of the fused FP8 quantisation (ops/fp8_fused.h): by definition the unfused
// composition — the forward op, then fp8_quantize of its stored output with the amax record.
#include "ops/fp8_fused.h"

#include "ops/fp8.h"
#include "ops/rmsnorm.h"
#include "ops/swiglu.h"

namespace mt::cpu {

void fp8_rmsnorm_forward(const Tensor& y, const Tensor& q, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                         float eps, const Tensor& scale, const Tensor& amax, const Stream& stream,
                         bool zero_centered_gamma) {
  cpu::rmsnorm_forward(y, rstd, x, weight, eps, stream, zero_centered_gamma);
  cpu::fp8_quantize(q, Tensor(), y, scale, amax, stream);
}

void fp8_swiglu_forward(const Tensor& y, const Tensor& q, const Tensor& x, const Tensor& scale, const Tensor& amax,
                        const Stream& stream) {
  cpu::swiglu_forward(y, x, stream);
  cpu::fp8_quantize(q, Tensor(), y, scale, amax, stream);
}

}  // namespace mt::cpu
