// Backend entry points of ops/layernorm.h (same arguments; validated by ops/layernorm.cpp).
#pragma once
#include "ops/layernorm.h"

namespace mt::cpu {
void layernorm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& weight, const Tensor& bias, float eps, const Stream& stream);
void layernorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                        const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                        bool accumulate_dx, const Stream& stream);
}  // namespace mt::cpu

namespace mt::cuda {
void layernorm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& weight, const Tensor& bias, float eps, const Stream& stream);
void layernorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                        const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                        bool accumulate_dx, const Stream& stream);
}  // namespace mt::cuda
