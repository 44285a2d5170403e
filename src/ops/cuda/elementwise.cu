#include <cstring>

#include "core/rng.h"
#include "ops/cuda/column_partials.cuh"
#include "ops/cuda/elementwise_common.cuh"
#include "ops/elementwise.h"

namespace mt::cuda {
namespace {

using ew::from_f32;
using ew::grid_for;
using ew::raw;
using ew::to_f32;

constexpr int kThreads = 256;

// ---- cast / fill / scale / add --------------------------------------------------------------

template <typename D, typename S>
__global__ void cast_kernel(D* dst, const S* src, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = from_f32<D>(to_f32(src[i]));
  }
}

/// Writes a raw bit pattern (uint16 or uint32 words).
template <typename W>
__global__ void fill_bits_kernel(W* x, int64_t n, W bits) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) x[i] = bits;
}

struct ScaleOp {
  float alpha;
  __device__ float operator()(float v) const { return v * alpha; }
};
struct AddOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// ---- dropout ----------------------------------------------------------------------------------

struct DropoutParams {
  uint64_t seed;
  uint64_t iteration;
  const uint64_t* iteration_ptr;  ///< DropoutKey::iteration_ptr: read by the kernel when set
  uint32_t microbatch;
  const uint32_t* microbatch_ptr;  ///< DropoutKey::microbatch_ptr: read by the kernel when set
  uint32_t stream_id;
  uint32_t threshold;
  float scale;
  int64_t offset;  ///< global index of local element 0
};

DropoutParams make_params(float p, const DropoutKey& key, int64_t global_offset) {
  DropoutParams d{};
  d.seed = key.seed;
  d.iteration = key.iteration;
  d.iteration_ptr = key.iteration_ptr;
  d.microbatch = key.microbatch;
  d.microbatch_ptr = key.microbatch_ptr;
  d.stream_id = key.stream_id;
  d.threshold = dropout_threshold(p);
  d.scale = 1.0f / (1.0f - p);
  d.offset = global_offset;
  return d;
}

/// out[l] = (residual[l] +) keep(g) ? (x[l] (+ bias[l % h])) * scale : 0, g = offset + l.
/// One thread per group of 4 global indices (one Philox call); groups at the ends are partial.
/// kDrop = false (p == 0): no RNG, scale 1. out may alias x or residual (element-wise).
template <bool kDrop, typename T>
__global__ void dropout_kernel(T* out, const T* x, const T* bias, int64_t h, const T* residual, int64_t n,
                               DropoutParams prm) {
  const int64_t g_first = prm.offset >> 2;
  const int64_t ngroups = ((prm.offset + n - 1) >> 2) - g_first + 1;
  const uint64_t iteration = kDrop ? dropout_iteration(prm.iteration_ptr, prm.iteration) : 0;
  const uint32_t microbatch = kDrop ? dropout_microbatch(prm.microbatch_ptr, prm.microbatch) : 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < ngroups; k += stride) {
    const int64_t grp = g_first + k;
    Philox4 r{{0u, 0u, 0u, 0u}};
    if constexpr (kDrop) {
      r = dropout_bits4(prm.seed, prm.stream_id, iteration, microbatch, static_cast<uint64_t>(grp));
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t l = grp * 4 + j - prm.offset;
      if (l < 0 || l >= n) continue;
      float v = to_f32(x[l]);
      if (bias) v += to_f32(bias[l % h]);
      if constexpr (kDrop) v = r.v[j] >= prm.threshold ? v * prm.scale : 0.f;
      if (residual) v += to_f32(residual[l]);
      out[l] = from_f32<T>(v);
    }
  }
}

/// Backward with bias gradient: dx = mask(dout) (rounded to T) and the partial column sums of row
/// group blockIdx.y, part[blockIdx.y, c] = Σ_r dx[r, c] (overwrite; add_column_partials adds them
/// to dbias in a fixed order: deterministic). Block (32, 8): 32 columns x 8 row lanes; rows
/// grid-strided over gridDim.y; the 8 lanes of a column are added in shared memory in a fixed
/// order. dx may alias dout, or be null (p = 0: dbias only).
template <bool kDrop, typename T>
__global__ void dropout_backward_dbias_kernel(T* dx, float* part, const T* dout, int64_t rows, int64_t h,
                                              DropoutParams prm) {
  __shared__ float red[8][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const uint64_t iteration = kDrop ? dropout_iteration(prm.iteration_ptr, prm.iteration) : 0;
  const uint32_t microbatch = kDrop ? dropout_microbatch(prm.microbatch_ptr, prm.microbatch) : 0;
  float acc = 0.f;
  if (c < h) {
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * 8 + threadIdx.y; r < rows; r += 8ll * gridDim.y) {
      const int64_t l = r * h + c;
      float v = to_f32(dout[l]);
      if constexpr (kDrop) {
        const uint64_t g = static_cast<uint64_t>(prm.offset + l);
        const Philox4 bits = dropout_bits4(prm.seed, prm.stream_id, iteration, microbatch, g >> 2);
        v = bits.v[g & 3] >= prm.threshold ? v * prm.scale : 0.f;
      }
      const T t = from_f32<T>(v);
      if (dx) dx[l] = t;
      acc += to_f32(t);
    }
  }
  red[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < h) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += red[i][threadIdx.x];
    part[static_cast<int64_t>(blockIdx.y) * h + c] = s;
  }
}

template <typename T>
void launch_dropout(T* out, const T* x, const T* bias, int64_t h, const T* residual, int64_t n, float p,
                    const DropoutKey& key, int64_t offset, const Stream& s) {
  if (n == 0) return;
  const DropoutParams prm = make_params(p, key, offset);
  const int64_t ngroups = ((offset + n - 1) >> 2) - (offset >> 2) + 1;
  const unsigned grid = grid_for(ngroups, kThreads, s);
  if (p == 0.f) {
    dropout_kernel<false><<<grid, kThreads, 0, raw(s)>>>(out, x, bias, h, residual, n, prm);
  } else {
    dropout_kernel<true><<<grid, kThreads, 0, raw(s)>>>(out, x, bias, h, residual, n, prm);
  }
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void cast(const Tensor& dst, const Tensor& src, const Stream& stream) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  if (dst.dtype() == src.dtype()) {
    if (dst.data() != src.data()) {
      MT_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), dst.nbytes(), cudaMemcpyDeviceToDevice, raw(stream)));
    }
    return;
  }
  ew::dispatch_float(dst.dtype(), "cast", [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    ew::dispatch_float(src.dtype(), "cast", [&](auto stag) {
      using S = typename decltype(stag)::type;
      cast_kernel<<<grid_for(n, kThreads, stream), kThreads, 0, raw(stream)>>>(static_cast<D*>(dst.data()),
                                                                               static_cast<const S*>(src.data()), n);
      MT_CUDA_CHECK_LAUNCH();
    });
  });
}

void add(const Tensor& y, const Tensor& a, const Tensor& b, const Stream& stream) {
  ew::dispatch_float(y.dtype(), "add", [&](auto tag) {
    using T = typename decltype(tag)::type;
    ew::launch_binary_map(static_cast<T*>(y.data()), static_cast<const T*>(a.data()), static_cast<const T*>(b.data()),
                          y.numel(), AddOp{}, stream);
  });
}

void scale_inplace(const Tensor& x, float alpha, const Stream& stream) {
  ew::dispatch_float(x.dtype(), "scale_inplace", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(x.data());
    ew::launch_unary_map(p, static_cast<const T*>(p), x.numel(), ScaleOp{alpha}, stream);
  });
}

void fill(const Tensor& x, float value, const Stream& stream) {
  const int64_t n = x.numel();
  if (n == 0) return;
  const unsigned grid = grid_for(n, kThreads, stream);
  switch (x.dtype()) {
    case DType::kF32: {
      uint32_t bits;
      std::memcpy(&bits, &value, 4);
      fill_bits_kernel<<<grid, kThreads, 0, raw(stream)>>>(static_cast<uint32_t*>(x.data()), n, bits);
      break;
    }
    case DType::kI32: {
      const int32_t v = static_cast<int32_t>(value);
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      fill_bits_kernel<<<grid, kThreads, 0, raw(stream)>>>(static_cast<uint32_t*>(x.data()), n, bits);
      break;
    }
    case DType::kBF16:
      fill_bits_kernel<<<grid, kThreads, 0, raw(stream)>>>(static_cast<uint16_t*>(x.data()), n,
                                                           f32_to_bf16_bits(value));
      break;
    case DType::kF16:
      fill_bits_kernel<<<grid, kThreads, 0, raw(stream)>>>(static_cast<uint16_t*>(x.data()), n,
                                                           f32_to_f16_bits(value));
      break;
    default: MT_FAIL("fill: unsupported dtype {}", dtype_name(x.dtype()));
  }
  MT_CUDA_CHECK_LAUNCH();
}

void bias_dropout_add_forward(const Tensor& out, const Tensor& x, const Tensor& bias, const Tensor& residual,
                              float p, const DropoutKey& key, int64_t global_offset, const Stream& stream) {
  ew::dispatch_float(out.dtype(), "bias_dropout_add_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t h = bias.empty() ? 1 : bias.numel();
    launch_dropout(static_cast<T*>(out.data()), static_cast<const T*>(x.data()),
                   bias.empty() ? nullptr : static_cast<const T*>(bias.data()), h,
                   static_cast<const T*>(residual.data()), out.numel(), p, key, global_offset, stream);
  });
}

void bias_dropout_add_backward(const Tensor& dx, const Tensor& dbias, const Tensor& dout, float p,
                               const DropoutKey& key, int64_t global_offset, const Stream& stream) {
  const int64_t n = dout.numel();
  if (n == 0) return;
  ew::dispatch_float(dout.dtype(), "bias_dropout_add_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* pdx = static_cast<T*>(dx.data());  // null when empty (p = 0: dbias only)
    const T* pdout = static_cast<const T*>(dout.data());
    if (dbias.empty()) {
      launch_dropout(pdx, pdout, static_cast<const T*>(nullptr), 1, static_cast<const T*>(nullptr), n, p, key,
                     global_offset, stream);
      return;
    }
    const int64_t h = dbias.numel();
    const int64_t rows = n / h;
    const char* fn = "bias_dropout_add_backward";
    if (p == 0.f && pdx == nullptr) {  // without dropout: the bias gradient only (vectorised column sums)
      column_sum_add(dbias, pdout, dout.dtype(), rows, h, stream, fn);
      return;
    }
    const DropoutParams prm = make_params(p, key, global_offset);
    const int64_t gx = (h + 31) / 32;
    const int64_t gy = column_partials_grid_rows(rows, 8, gx, h, 1, stream, fn);
    float* part = column_partials_scratch(stream, fn);
    const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
    const dim3 block(32, 8);
    if (p == 0.f) {
      dropout_backward_dbias_kernel<false><<<grid, block, 0, raw(stream)>>>(pdx, part, pdout, rows, h, prm);
    } else {
      dropout_backward_dbias_kernel<true><<<grid, block, 0, raw(stream)>>>(pdx, part, pdout, rows, h, prm);
    }
    MT_CUDA_CHECK_LAUNCH();
    add_column_partials(dbias.data_as<float>(), part, nullptr, nullptr, gy, h, stream);
  });
}

void dropout_forward(const Tensor& y, const Tensor& x, float p, const DropoutKey& key, int64_t global_offset,
                     const Stream& stream) {
  ew::dispatch_float(y.dtype(), "dropout_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_dropout(static_cast<T*>(y.data()), static_cast<const T*>(x.data()), static_cast<const T*>(nullptr), 1,
                   static_cast<const T*>(nullptr), y.numel(), p, key, global_offset, stream);
  });
}

}  // namespace mt::cuda
