// CUDA SwiGLU (ops/swiglu.h): a grid-stride loop over vectors of V output elements of one row
// (16-byte loads of the gate and linear halves when f is a multiple of V and the pointers are
// 16-byte aligned, else V = 1); 32-bit index arithmetic when the element count allows it.
#include <type_traits>

#include "ops/swiglu.h"  // first: ops/cuda/elementwise_common.cuh needs Tensor, Stream, DType

#include "ops/cuda/elementwise_common.cuh"
#include "ops/swiglu_math.h"

namespace mt::cuda {
namespace {

using ew::from_f32;
using ew::raw;
using ew::to_f32;
using ew::Vec;

constexpr int kThreads = 256;

/// y[r, j] = swiglu(x[r, j], x[r, f + j]); items are vectors of V elements, fv = f / V per row.
/// (With FP8 output: fp8_swiglu_forward, ops/cuda/fp8.cu.)
template <int V, typename I, typename T>
__global__ void __launch_bounds__(kThreads) swiglu_forward_kernel(T* y, const T* x, I items, I fv) {
  const I stride = static_cast<I>(gridDim.x) * kThreads;
  for (I i = static_cast<I>(blockIdx.x) * kThreads + threadIdx.x; i < items; i += stride) {
    const I r = i / fv;
    const I jv = i - r * fv;
    const T* a = x + (2 * r * fv + jv) * V;
    const Vec<T, V> va = *reinterpret_cast<const Vec<T, V>*>(a);
    const Vec<T, V> vb = *reinterpret_cast<const Vec<T, V>*>(a + fv * V);
    Vec<T, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = from_f32<T>(swiglu_math::swiglu(to_f32(va.v[k]), to_f32(vb.v[k])));
    reinterpret_cast<Vec<T, V>*>(y)[i] = out;
  }
}

/// dx[r, j] = dy * x[r, f + j] * silu'(x[r, j]); dx[r, f + j] = dy * silu(x[r, j]).
template <int V, typename I, typename T>
__global__ void __launch_bounds__(kThreads) swiglu_backward_kernel(T* dx, const T* dy, const T* x, I items, I fv) {
  const I stride = static_cast<I>(gridDim.x) * kThreads;
  for (I i = static_cast<I>(blockIdx.x) * kThreads + threadIdx.x; i < items; i += stride) {
    const I r = i / fv;
    const I jv = i - r * fv;
    const I off = (2 * r * fv + jv) * V;
    const Vec<T, V> va = *reinterpret_cast<const Vec<T, V>*>(x + off);
    const Vec<T, V> vb = *reinterpret_cast<const Vec<T, V>*>(x + off + fv * V);
    const Vec<T, V> vg = reinterpret_cast<const Vec<T, V>*>(dy)[i];
    Vec<T, V> da, db;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float a = to_f32(va.v[k]), b = to_f32(vb.v[k]), g = to_f32(vg.v[k]);
      da.v[k] = from_f32<T>(swiglu_math::swiglu_grad_gate(g, a, b));
      db.v[k] = from_f32<T>(swiglu_math::swiglu_grad_linear(g, a));
    }
    *reinterpret_cast<Vec<T, V>*>(dx + off) = da;
    *reinterpret_cast<Vec<T, V>*>(dx + off + fv * V) = db;
  }
}

/// Calls f(integral_constant<int, V or 1>, I{}) with I = uint32_t when 2 * numel(y) fits, else
/// int64_t.
template <int V, typename F>
void dispatch_layout(bool vec, int64_t y_numel, F&& f) {
  const bool small = 2 * y_numel < (int64_t{1} << 31);
  if (vec) {
    if (small) f(std::integral_constant<int, V>{}, uint32_t{});
    else f(std::integral_constant<int, V>{}, int64_t{});
  } else {
    if (small) f(std::integral_constant<int, 1>{}, uint32_t{});
    else f(std::integral_constant<int, 1>{}, int64_t{});
  }
}

}  // namespace

void swiglu_forward(const Tensor& y, const Tensor& x, const Stream& stream) {
  const int64_t f = y.size(-1);
  const int64_t numel = y.numel();
  if (numel == 0) return;
  ew::dispatch_float(x.dtype(), "swiglu_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = ew::kVec16<T>;
    T* py = static_cast<T*>(y.data());
    const T* px = static_cast<const T*>(x.data());
    const bool vec = f % V == 0 && ew::aligned16(py) && ew::aligned16(px);
    dispatch_layout<V>(vec, numel, [&](auto vtag, auto itag) {
      constexpr int VV = decltype(vtag)::value;
      using I = decltype(itag);
      const int64_t items = numel / VV;
      swiglu_forward_kernel<VV, I><<<ew::grid_for(items, kThreads, stream), kThreads, 0, raw(stream)>>>(
          py, px, static_cast<I>(items), static_cast<I>(f / VV));
      MT_CUDA_CHECK_LAUNCH();
    });
  });
}

void swiglu_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const Stream& stream) {
  const int64_t f = dy.size(-1);
  const int64_t numel = dy.numel();
  if (numel == 0) return;
  ew::dispatch_float(x.dtype(), "swiglu_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = ew::kVec16<T>;
    T* pdx = static_cast<T*>(dx.data());
    const T* pdy = static_cast<const T*>(dy.data());
    const T* px = static_cast<const T*>(x.data());
    const bool vec = f % V == 0 && ew::aligned16(pdx) && ew::aligned16(pdy) && ew::aligned16(px);
    dispatch_layout<V>(vec, numel, [&](auto vtag, auto itag) {
      constexpr int VV = decltype(vtag)::value;
      using I = decltype(itag);
      const int64_t items = numel / VV;
      swiglu_backward_kernel<VV, I><<<ew::grid_for(items, kThreads, stream), kThreads, 0, raw(stream)>>>(
          pdx, pdy, px, static_cast<I>(items), static_cast<I>(f / VV));
      MT_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace mt::cuda
