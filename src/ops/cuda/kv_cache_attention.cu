// CUDA kv_cache_attention_forward (ops/kv_cache_attention.h). Two kernels:
//  * append: one thread per element copies the new keys/values into the caches;
//  * attend: one block per (new token, sample, query head). Each warp takes keys in turn (the
//    lanes stride over the head dim: coalesced key rows, a warp reduction per score), the scores
//    go to shared memory, the block reduces their max and exp-sum, then the threads stride over
//    the head dim accumulating Σ p_j v_j (coalesced value rows). fp32 math throughout.
// A decoding step (s = 1) is b·n blocks; no host synchronisation.
#include "ops/kv_cache_attention.h"  // first: elementwise_common.cuh needs Tensor, Stream, DType

#include <cfloat>

#include "core/cuda_check.h"
#include "ops/cuda/elementwise_common.cuh"

namespace mt::cuda {
namespace {

using ew::from_f32;
using ew::raw;
using ew::to_f32;
using ew::warp_sum;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxKeys = 12 * 1024;  // fp32 scores in 48 KiB of shared memory

struct Shape {
  int64_t s, b, g, qpg, d, smax, off;
  float scale;
};

template <typename T>
__global__ void append_kernel(T* kc, T* vc, const T* qkv, Shape sh) {
  const int64_t n = sh.s * sh.b * sh.g * sh.d;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = e % sh.d, t = e / sh.d;  // t = (i·b + bi)·g + gi
    const int64_t gi = t % sh.g, bi = (t / sh.g) % sh.b, i = t / (sh.g * sh.b);
    const T* src = qkv + (t * (sh.qpg + 2) + sh.qpg) * sh.d + c;
    const int64_t dst = ((bi * sh.g + gi) * sh.smax + sh.off + i) * sh.d + c;
    kc[dst] = src[0];
    vc[dst] = src[sh.d];
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) attend_kernel(T* out, const T* qkv, const T* kc, const T* vc, Shape sh) {
  extern __shared__ float scores[];
  __shared__ float red[kWarps];
  const int64_t n = sh.g * sh.qpg;
  const int64_t h = blockIdx.x % n, bi = (blockIdx.x / n) % sh.b, i = blockIdx.x / (n * sh.b);
  const int64_t gi = h / sh.qpg, keys = sh.off + i + 1;
  const T* q = qkv + (((i * sh.b + bi) * sh.g + gi) * (sh.qpg + 2) + h % sh.qpg) * sh.d;
  const T* kb = kc + (bi * sh.g + gi) * sh.smax * sh.d;
  const T* vb = vc + (bi * sh.g + gi) * sh.smax * sh.d;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float mx = -FLT_MAX;
  for (int64_t j = warp; j < keys; j += kWarps) {
    float dot = 0;
    for (int64_t c = lane; c < sh.d; c += 32) dot += to_f32(q[c]) * to_f32(kb[j * sh.d + c]);
    dot = warp_sum(dot) * sh.scale;
    if (lane == 0) scores[j] = dot;
    mx = fmaxf(mx, dot);
  }
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();
  float z = 0;
  for (int64_t j = threadIdx.x; j < keys; j += kThreads) {
    const float e = __expf(scores[j] - mx);
    scores[j] = e;
    z += e;
  }
  z = warp_sum(z);
  if (lane == 0) red[warp] = z;
  __syncthreads();
  z = 0;
  for (int w = 0; w < kWarps; ++w) z += red[w];
  const float inv = 1.f / z;
  T* o = out + ((i * sh.b + bi) * n + h) * sh.d;
  for (int64_t c = threadIdx.x; c < sh.d; c += kThreads) {
    float acc = 0;
    for (int64_t j = 0; j < keys; ++j) acc += scores[j] * to_f32(vb[j * sh.d + c]);
    o[c] = from_f32<T>(acc * inv);
  }
}

}  // namespace

void kv_cache_attention_forward(const Tensor& out, const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                                const KvCacheAttentionConfig& cfg, const Stream& stream) {
  const Shape sh{qkv.size(0), qkv.size(1), qkv.size(2), qkv.size(3) - 2, qkv.size(4), k_cache.size(2), cfg.offset,
                 cfg.softmax_scale};
  MT_CHECK(sh.off + sh.s <= kMaxKeys, "kv_cache_attention_forward (CUDA): {} keys exceed the kernel's {}",
           sh.off + sh.s, kMaxKeys);
  ew::dispatch_float(qkv.dtype(), "kv_cache_attention_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t n = sh.s * sh.b * sh.g * sh.d;
    append_kernel<T><<<ew::grid_for(n, 256, stream), 256, 0, raw(stream)>>>(
        static_cast<T*>(k_cache.data()), static_cast<T*>(v_cache.data()), static_cast<const T*>(qkv.data()), sh);
    MT_CUDA_CHECK(cudaGetLastError());
    const int64_t blocks = sh.s * sh.b * sh.g * sh.qpg;
    const size_t smem = static_cast<size_t>(sh.off + sh.s) * sizeof(float);
    attend_kernel<T><<<static_cast<unsigned>(blocks), kThreads, smem, raw(stream)>>>(
        static_cast<T*>(out.data()), static_cast<const T*>(qkv.data()), static_cast<const T*>(k_cache.data()),
        static_cast<const T*>(v_cache.data()), sh);
    MT_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace mt::cuda
