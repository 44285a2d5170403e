// The fp32 -> FP8 conversion of the CUDA quantisers (ops/cuda/fp8.cu) and the FP8 epilogue that
// producer kernels (RMSNorm: ops/fp8_fused.h) run on each value they store: the same
// conversion as fp8_quantize, the amax record by an atomic max of the ordered float bits (as
// fp8_amax: order-independent, bit-identical to the CPU). nvcc only.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "core/check.h"
#include "core/dtype.h"
#include "ops/fp8_math.h"

namespace mt::cuda {

/// fp8_math::quantize_value: x * s converted by the hardware (cvt.rn.satfinite: the rounding and
/// saturation of core/dtype.h's host conversion), a NaN x as kNaNCode.
template <bool kE4M3>
__device__ __forceinline__ uint8_t to_fp8(float x, float s) {
  if (isnan(x)) return fp8_math::kNaNCode;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x * s, __NV_SATFINITE, kE4M3 ? __NV_E4M3 : __NV_E5M2));
}

/// The largest of a warp's 32 values (amax bits, fp8_math::abs_bits_for_max), in every lane.
__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/// What a producer kernel writes besides its output (ops/fp8_fused.h): q (contiguous, the
/// output's element order), the scale it reads, the amax record (null: none).
struct Fp8Out {
  uint8_t* q = nullptr;
  const float* scale = nullptr;
  uint32_t* amax = nullptr;
};

/// kQ: 0 no FP8 output (the epilogue compiles away), 1 e4m3, 2 e5m2.
template <int kQ>
struct Fp8Epilogue {
  float s = 1.f;
  uint32_t m = 0;  // this thread's max |v| as ordered bits
  __device__ explicit Fp8Epilogue(const Fp8Out& o) {
    if constexpr (kQ != 0) s = *o.scale;
  }
  /// The FP8 code of a stored value v (read back from the output dtype), recorded for the amax.
  __device__ __forceinline__ uint8_t put(float v) {
    m = max(m, fp8_math::abs_bits_for_max(v));
    return to_fp8<kQ == 1>(v, s);
  }
  /// After the thread's last put; every lane of the warp calls it (amax is grid-uniform).
  __device__ __forceinline__ void finish(uint32_t* amax) {
    if constexpr (kQ != 0) {
      if (amax == nullptr) return;
      for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
      if ((threadIdx.x & 31) == 0) atomicMax(amax, m);
    }
  }
};

/// Calls f(integral_constant<int, kQ>) for an FP8 dtype (1: e4m3, 2: e5m2).
template <typename F>
void dispatch_fp8_out(DType t, F&& f) {
  if (t == DType::kF8E4M3) {
    f(std::integral_constant<int, 1>{});
  } else {
    MT_CHECK(t == DType::kF8E5M2, "fp8: unsupported dtype {}", dtype_name(t));
    f(std::integral_constant<int, 2>{});
  }
}

}  // namespace mt::cuda
