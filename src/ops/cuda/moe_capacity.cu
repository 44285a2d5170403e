// CUDA backend of moe_capacity_drop (ops/moe.h; token dropping at an expert capacity).
// slot i = t·k + j routed to expert e keeps its place when fewer than
// `capacity` slots of e precede it in the policy's order — by_probs: higher prob first, ties to the
// earlier slot (the CPU's stable sort by descending prob); position: the earlier slot first. Each
// thread ranks one slot against all slots, read in shared-memory tiles (O((T·k)²) comparisons:
// ~3·10⁸ for 16K slots, well under a millisecond on an H100; the dropless default does not call
// it). The kept counts are the histogram of the kept selection (moe_tokens_per_expert, which skips
// the -1 of dropped slots). No atomics on floats, nothing read on the host: deterministic.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "ops/cuda/common.cuh"
#include "ops/moe.h"

namespace mt::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    capacity_rank_kernel(int32_t* __restrict__ kept, const int32_t* __restrict__ top, const float* __restrict__ probs,
                         int64_t n, int64_t num_experts, int64_t capacity, bool by_probs) {
  __shared__ int32_t s_top[kThreads];
  __shared__ float s_p[kThreads];
  const int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  const int32_t e = i < n ? top[i] : -1;
  // a NaN probability ranks last (as −inf): the ranks stay a total order, so at most `capacity`
  // slots per expert are kept whatever the probabilities (the dispatchers' buffers rely on it)
  const auto key = [](float x) { return isnan(x) ? -INFINITY : x; };
  const float p = i < n ? key(probs[i]) : 0.f;
  int64_t rank = 0;
  for (int64_t base = 0; base < n; base += kThreads) {
    const int64_t j = base + threadIdx.x;
    s_top[threadIdx.x] = j < n ? top[j] : -1;
    s_p[threadIdx.x] = j < n ? key(probs[j]) : 0.f;
    __syncthreads();
    if (e >= 0) {
      const int64_t m = n - base < kThreads ? n - base : int64_t{kThreads};
      for (int64_t q = 0; q < m; ++q) {
        if (s_top[q] != e) continue;
        const int64_t jq = base + q;
        const bool before = by_probs ? (s_p[q] > p || (s_p[q] == p && jq < i)) : jq < i;
        rank += before ? 1 : 0;
      }
    }
    __syncthreads();
  }
  if (i < n) kept[i] = (e >= 0 && e < num_experts && rank < capacity) ? e : -1;
}

}  // namespace

void moe_capacity_drop(const Tensor& kept, const Tensor& kept_counts, const Tensor& top, const Tensor& probs,
                       int64_t capacity, bool by_probs, const Stream& stream) {
  const int64_t n = top.numel(), E = kept_counts.numel();
  if (n > 0) {
    const unsigned blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
    capacity_rank_kernel<<<blocks, kThreads, 0, cu(stream)>>>(kept.data_as<int32_t>(), top.data_as<int32_t>(),
                                                              probs.data_as<float>(), n, E, capacity, by_probs);
    MT_CUDA_CHECK_LAUNCH();
  }
  cuda::moe_tokens_per_expert(kept_counts, kept, stream);  // the kept slots per expert (dropped ones are -1)
}

}  // namespace mt::cuda
