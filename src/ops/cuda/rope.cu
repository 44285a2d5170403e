// CUDA RoPE (ops/rope.h). One thread owns NP consecutive rotation pairs of one token and a chunk
// of up to kHeadsPerItem of the token's g·(qpg + 1) query/key heads: it computes the NP cos/sin
// once (accurate fp32 sincosf) and rotates those pairs in every head of its chunk, in place.
// 16-byte vector loads when the pair channels allow it (non-interleaved: rotary_dim/2 and d
// multiples of the vector width; interleaved: rotary_dim and d multiples of it), else scalar.
// The inv_freq table is computed on the host (ops/rope_math.h, as the CPU backend does) and
// passed by value as a kernel parameter, then staged in shared memory.
#include <algorithm>
#include <cstring>
#include <vector>

#include "ops/rope.h"  // first: ops/cuda/elementwise_common.cuh needs Tensor, Stream, DType

#include "ops/cuda/elementwise_common.cuh"
#include "ops/rope_math.h"

namespace mt::cuda {
namespace {

using ew::from_f32;
using ew::raw;
using ew::to_f32;
using ew::Vec;

constexpr int kThreads = 256;
constexpr int kMaxPairs = 512;  // rotary_dim <= 1024
constexpr int kHeadsPerItem = 8;

struct InvFreqTable {
  float f[kMaxPairs];
};

struct RopeShape {
  int64_t tokens;    // s * b
  int64_t b;         // samples (position = token / b without explicit positions)
  int g;             // query groups
  int qpg;           // query heads per group (heads per group in memory: qpg + 2)
  int d;             // head dim
  int half;          // rotary_dim / 2 pairs
  int pair_groups;   // half / NP
  int chunks;        // ceil(g * (qpg + 1) / kHeadsPerItem)
};

/// NP pairs per thread; kInter: pairs (2i, 2i+1), else (i, i + half); kVec: vector loads.
template <int NP, bool kInter, bool kVec, typename T>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(T* p, const int32_t* positions, const __grid_constant__ InvFreqTable inv, RopeShape sh, float sign,
                float amp) {
  __shared__ float freq[kMaxPairs];
  for (int i = threadIdx.x; i < sh.half; i += kThreads) freq[i] = inv.f[i];
  __syncthreads();

  const int rotated = sh.qpg + 1;
  const int heads_total = sh.g * rotated;
  const int64_t items = sh.tokens * sh.chunks * sh.pair_groups;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; item < items; item += stride) {
    const int pg = static_cast<int>(item % sh.pair_groups);
    const int64_t rest = item / sh.pair_groups;
    const int chunk = static_cast<int>(rest % sh.chunks);
    const int64_t t = rest / sh.chunks;
    const int32_t pos = positions ? positions[t] : static_cast<int32_t>(t / sh.b);
    const int i0 = pg * NP;
    float c[NP], s[NP];
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      sincosf(rope_math::angle(pos, freq[i0 + k]), &s[k], &c[k]);
      c[k] *= amp;  // YaRN's concentration factor (1 otherwise: exact)
      s[k] = sign * (amp * s[k]);
    }
    const int h_end = min(heads_total, (chunk + 1) * kHeadsPerItem);
    for (int hh = chunk * kHeadsPerItem; hh < h_end; ++hh) {
      const int gi = hh / rotated, hi = hh - gi * rotated;
      T* x = p + ((t * sh.g + gi) * (sh.qpg + 2) + hi) * static_cast<int64_t>(sh.d);
      if constexpr (kInter) {
        if constexpr (kVec) {
          Vec<T, 2 * NP> v = *reinterpret_cast<const Vec<T, 2 * NP>*>(x + 2 * i0);
#pragma unroll
          for (int k = 0; k < NP; ++k) {
            float a = to_f32(v.v[2 * k]), b = to_f32(v.v[2 * k + 1]);
            rope_math::rotate(a, b, c[k], s[k]);
            v.v[2 * k] = from_f32<T>(a);
            v.v[2 * k + 1] = from_f32<T>(b);
          }
          *reinterpret_cast<Vec<T, 2 * NP>*>(x + 2 * i0) = v;
        } else {
#pragma unroll
          for (int k = 0; k < NP; ++k) {
            T* q = x + 2 * (i0 + k);
            float a = to_f32(q[0]), b = to_f32(q[1]);
            rope_math::rotate(a, b, c[k], s[k]);
            q[0] = from_f32<T>(a);
            q[1] = from_f32<T>(b);
          }
        }
      } else {
        if constexpr (kVec) {
          Vec<T, NP> va = *reinterpret_cast<const Vec<T, NP>*>(x + i0);
          Vec<T, NP> vb = *reinterpret_cast<const Vec<T, NP>*>(x + sh.half + i0);
#pragma unroll
          for (int k = 0; k < NP; ++k) {
            float a = to_f32(va.v[k]), b = to_f32(vb.v[k]);
            rope_math::rotate(a, b, c[k], s[k]);
            va.v[k] = from_f32<T>(a);
            vb.v[k] = from_f32<T>(b);
          }
          *reinterpret_cast<Vec<T, NP>*>(x + i0) = va;
          *reinterpret_cast<Vec<T, NP>*>(x + sh.half + i0) = vb;
        } else {
#pragma unroll
          for (int k = 0; k < NP; ++k) {
            float a = to_f32(x[i0 + k]), b = to_f32(x[sh.half + i0 + k]);
            rope_math::rotate(a, b, c[k], s[k]);
            x[i0 + k] = from_f32<T>(a);
            x[sh.half + i0 + k] = from_f32<T>(b);
          }
        }
      }
    }
  }
}

template <int NP, bool kInter, bool kVec, typename T>
void launch(T* p, const int32_t* positions, const InvFreqTable& inv, RopeShape sh, float sign, float amp,
            const Stream& stream) {
  sh.pair_groups = sh.half / NP;
  const int64_t items = sh.tokens * sh.chunks * sh.pair_groups;
  rope_kernel<NP, kInter, kVec><<<ew::grid_for(items, kThreads, stream), kThreads, 0, raw(stream)>>>(p, positions, inv,
                                                                                                     sh, sign, amp);
  MT_CUDA_CHECK_LAUNCH();
}

void rope_apply(const Tensor& qkv, const Tensor& positions, const RopeConfig& cfg, float sign, const Stream& stream,
                const char* fn) {
  const int64_t s = qkv.size(0), b = qkv.size(1), g = qkv.size(2), d = qkv.size(4);
  MT_CHECK(cfg.rotary_dim / 2 <= kMaxPairs, "{}: rotary_dim={} exceeds the CUDA kernel's limit {}", fn,
           cfg.rotary_dim, 2 * kMaxPairs);
  MT_CHECK(g * (cfg.queries_per_group + 1) < (int64_t{1} << 31) && d < (int64_t{1} << 31),
           "{}: {} too large for the CUDA kernel", fn, qkv.str());
  if (qkv.numel() == 0) return;
  InvFreqTable inv{};
  const std::vector<float> f = rope_math::rope_inv_freq(cfg.rotary_dim, cfg.base, cfg.yarn);
  const float amp = rope_math::yarn_concentration(cfg.yarn);
  std::copy(f.begin(), f.end(), inv.f);
  RopeShape sh{};
  sh.tokens = s * b;
  sh.b = b;
  sh.g = static_cast<int>(g);
  sh.qpg = static_cast<int>(cfg.queries_per_group);
  sh.d = static_cast<int>(d);
  sh.half = static_cast<int>(cfg.rotary_dim / 2);
  const int64_t heads_total = g * (cfg.queries_per_group + 1);
  sh.chunks = static_cast<int>((heads_total + kHeadsPerItem - 1) / kHeadsPerItem);
  const int32_t* pos = positions.empty() ? nullptr : positions.data_as<int32_t>();
  ew::dispatch_float(qkv.dtype(), fn, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = ew::kVec16<T>;
    T* p = static_cast<T*>(qkv.data());
    const bool aligned = ew::aligned16(p) && d % V == 0;
    if (cfg.interleaved) {
      if (aligned && cfg.rotary_dim % V == 0) {
        launch<V / 2, true, true>(p, pos, inv, sh, sign, amp, stream);
      } else {
        launch<1, true, false>(p, pos, inv, sh, sign, amp, stream);
      }
    } else {
      if (aligned && sh.half % V == 0) {
        launch<V, false, true>(p, pos, inv, sh, sign, amp, stream);
      } else {
        launch<1, false, false>(p, pos, inv, sh, sign, amp, stream);
      }
    }
  });
}

}  // namespace

void rope_forward(const Tensor& qkv, const Tensor& positions, const RopeConfig& cfg, const Stream& stream) {
  rope_apply(qkv, positions, cfg, 1.f, stream, "rope_forward");
}

void rope_backward(const Tensor& dqkv, const Tensor& positions, const RopeConfig& cfg, const Stream& stream) {
  rope_apply(dqkv, positions, cfg, -1.f, stream, "rope_backward");
}

}  // namespace mt::cuda
