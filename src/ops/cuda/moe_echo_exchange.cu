// CUDA backend of ops/moe_echo_exchange.h (ECHO's fixed-size weight dispatch and gradient return):
//  * moe_echo_exchange_index: one grid-stride kernel over the P·S slots; each thread writes the
//    four maps' entries of its position (and w_recv's when the position is < S). Ids outside
//    [0, P·L) count as unused.
//  * moe_echo_gather_experts / moe_echo_gather_blocks: one grid-stride kernel, blocks (y) over the
//    index entries, threads (x) over the expert's units. The unit is the widest of 16, 8, 4, 2, 1
//    bytes that divides the block size and every address involved (the output, each source), so
//    16-byte vector loads are used whenever the layout allows. Rows with an index outside [0, G)
//    are skipped whole.
//  * moe_echo_accumulate_experts: one thread per element (or per float4 when every address is
//    16-byte aligned and n·k % 4 == 0), looping over m ascending: each element's fp32 sum has the
//    CPU's order, so the results are bitwise equal. No atomics.
// Nothing is read on the host (the launch configuration depends on shapes and addresses only),
// nothing is allocated: capturable in a CUDA graph.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda_check.h"
#include "ops/cuda/common.cuh"
#include "ops/moe_echo_exchange.h"

namespace mt::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kTargetBlocks = 8192;  // gather: blocks in all, spread over the index entries

__global__ void exchange_index_kernel(int32_t* __restrict__ w_send, int32_t* __restrict__ w_recv,
                                      int32_t* __restrict__ g_send, int32_t* __restrict__ g_acc,
                                      const int32_t* __restrict__ ce, int NS, int S, int L, int E, int me) {
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < NS; t += gridDim.x * blockDim.x) {
    const int e = ce[t];
    const bool valid = e >= 0 && e < E;
    const int32_t local = valid && e / L == me ? e - me * L : -1;
    w_send[t] = local;  // send block t = p·S + j: the local expert for rank p's clone j
    g_acc[t] = local;   // receive block t = slot t's gradient: the local expert it adds to
    const int h = t / S, j = t % S;
    const int ej = ce[me * S + j];  // this rank's clone j
    g_send[t] = ej >= 0 && ej < E && ej / L == h ? j : -1;
    if (t < S) {
      const int ec = ce[me * S + t];
      w_recv[t] = ec >= 0 && ec < E ? (ec / L) * S + t : -1;
    }
  }
}

/// out[m] = source block index[m] (units of U, `per` units per block) for 0 <= index[m] < G. The
/// source is table[g] when table is non-null, else base + g·per.
template <typename U>
__global__ void gather_kernel(U* __restrict__ out, const void* const* __restrict__ table, const U* __restrict__ base,
                              const int32_t* __restrict__ index, int M, int G, int64_t per) {
  for (int m = blockIdx.y; m < M; m += gridDim.y) {
    const int g = index[m];
    if (g < 0 || g >= G) continue;
    const U* src = table != nullptr ? static_cast<const U*>(table[g]) : base + static_cast<int64_t>(g) * per;
    U* dst = out + static_cast<int64_t>(m) * per;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < per;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
      dst[i] = src[i];
  }
}

/// Launches gather_kernel for blocks of `bytes` bytes; `align` = the OR of every address and of
/// `bytes` (its lowest set bit bounds the unit).
void launch_gather(void* out, const void* const* table, const void* base, const int32_t* index, int64_t M, int64_t G,
                   size_t bytes, uintptr_t align, const Stream& stream) {
  if (M == 0 || bytes == 0) return;
  const auto go = [&](auto unit) {
    using U = decltype(unit);
    const int64_t per = static_cast<int64_t>(bytes / sizeof(U));
    const int64_t gy = std::min<int64_t>(M, 65535);
    const int64_t gx =
        std::clamp<int64_t>((per + kThreads - 1) / kThreads, 1, std::max<int64_t>(1, kTargetBlocks / gy));
    gather_kernel<U><<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), kThreads, 0, cu(stream)>>>(
        static_cast<U*>(out), table, static_cast<const U*>(base), index, static_cast<int>(M), static_cast<int>(G), per);
    MT_CUDA_CHECK_LAUNCH();
  };
  if (align % 16 == 0) {
    go(uint4{});
  } else if (align % 8 == 0) {
    go(uint2{});
  } else if (align % 4 == 0) {
    go(uint32_t{});
  } else if (align % 2 == 0) {
    go(uint16_t{});
  } else {
    go(uint8_t{});
  }
}

/// grads[index[m]] += src[m] for m ascending, V floats per thread (V = 4: float4).
template <int V>
__global__ void accumulate_kernel(void* const* __restrict__ table, const float* __restrict__ src,
                                  const int32_t* __restrict__ index, int M, int G, int64_t nk) {
  const int64_t nv = nk / V;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nv;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    for (int m = 0; m < M; ++m) {
      const int g = index[m];
      if (g < 0 || g >= G) continue;
      const float* x = src + static_cast<int64_t>(m) * nk;
      float* y = static_cast<float*>(table[g]);
      if constexpr (V == 4) {
        float4 a = reinterpret_cast<float4*>(y)[i];
        const float4 b = reinterpret_cast<const float4*>(x)[i];
        a.x += b.x;
        a.y += b.y;
        a.z += b.z;
        a.w += b.w;
        reinterpret_cast<float4*>(y)[i] = a;
      } else {
        y[i] += x[i];
      }
    }
  }
}

}  // namespace

void moe_echo_exchange_index(const Tensor& w_send, const Tensor& w_recv, const Tensor& g_send, const Tensor& g_acc,
                             const Tensor& clone_expert, int64_t ep_rank, int64_t num_local, int64_t num_echo,
                             const Stream& stream) {
  const int64_t NS = clone_expert.numel(), P = NS / num_echo;
  exchange_index_kernel<<<grid_for(NS, kThreads), kThreads, 0, cu(stream)>>>(
      w_send.data_as<int32_t>(), w_recv.data_as<int32_t>(), g_send.data_as<int32_t>(), g_acc.data_as<int32_t>(),
      clone_expert.data_as<int32_t>(), static_cast<int>(NS), static_cast<int>(num_echo), static_cast<int>(num_local),
      static_cast<int>(P * num_local), static_cast<int>(ep_rank));
  MT_CUDA_CHECK_LAUNCH();
}

void moe_echo_gather_experts(const Tensor& out, const GroupedWeights& experts, const Tensor& index,
                             const Stream& stream) {
  const size_t bytes = experts[0].nbytes();
  uintptr_t align = reinterpret_cast<uintptr_t>(out.data()) | bytes;
  for (int64_t g = 0; g < experts.groups(); ++g) align |= reinterpret_cast<uintptr_t>(experts[g].data());
  launch_gather(out.data(), experts.table(), nullptr, index.data_as<int32_t>(), index.numel(), experts.groups(), bytes,
                align, stream);
}

void moe_echo_gather_blocks(const Tensor& out, const Tensor& src, const Tensor& index, const Stream& stream) {
  const size_t bytes = static_cast<size_t>(src.size(1) * src.size(2)) * dtype_size(src.dtype());
  const uintptr_t align = reinterpret_cast<uintptr_t>(out.data()) | reinterpret_cast<uintptr_t>(src.data()) | bytes;
  launch_gather(out.data(), nullptr, src.data(), index.data_as<int32_t>(), index.numel(), src.size(0), bytes, align,
                stream);
}

void moe_echo_accumulate_experts(const GroupedWeights& grads, const Tensor& src, const Tensor& index,
                                 const Stream& stream) {
  const int64_t M = index.numel(), G = grads.groups(), nk = grads.rows() * grads.cols();
  if (M == 0 || nk == 0) return;
  const bool vec = grads.aligned16() && nk % 4 == 0 && reinterpret_cast<uintptr_t>(src.data()) % 16 == 0;
  const int64_t nv = vec ? nk / 4 : nk;
  const auto launch = [&](auto kernel) {
    kernel<<<grid_for(nv, kThreads), kThreads, 0, cu(stream)>>>(
        grads.table(), src.data_as<float>(), index.data_as<int32_t>(), static_cast<int>(M), static_cast<int>(G), nk);
    MT_CUDA_CHECK_LAUNCH();
  };
  if (vec) {
    launch(accumulate_kernel<4>);
  } else {
    launch(accumulate_kernel<1>);
  }
}

}  // namespace mt::cuda
