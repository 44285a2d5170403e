#include "ops/cuda/elementwise_common.cuh"
#include "ops/gelu_math.h"
#include "ops/gelu.h"

namespace mt::cuda {
namespace {

struct GeluOp {
  __device__ float operator()(float x) const { return gelu_math::gelu(x); }
};
/// (dy, x) -> dy * gelu'(x)
struct GeluGradOp {
  __device__ float operator()(float dy, float x) const { return dy * gelu_math::gelu_grad(x); }
};

}  // namespace

void gelu_forward(const Tensor& y, const Tensor& x, const Stream& stream) {
  ew::dispatch_float(x.dtype(), "gelu_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    ew::launch_unary_map(static_cast<T*>(y.data()), static_cast<const T*>(x.data()), x.numel(), GeluOp{}, stream);
  });
}

void gelu_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const Stream& stream) {
  ew::dispatch_float(x.dtype(), "gelu_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    ew::launch_binary_map(static_cast<T*>(dx.data()), static_cast<const T*>(dy.data()),
                          static_cast<const T*>(x.data()), x.numel(), GeluGradOp{}, stream);
  });
}

}  // namespace mt::cuda
