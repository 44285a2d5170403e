// CUDA backend of ops/moe_echo.h (ECHO planner and rerouting). Same integers as the CPU reference
// (ops/cpu/moe_echo.cpp), computed by counting instead of sorting:
//
// moe_echo_plan: one block of 1024 threads, everything in shared memory (int64 sums):
//   tok_e = Σ_r counts[r, e] (thread per expert, the R source rows in order); load_p, avg (thread
//   0, ranks in order), spare_p; spill_e = the clamped excess of the inclusive cumulative sum at e's place in
//   its rank's ascending order (the sum over the rank's experts ordered before e or e itself —
//   tok ascending, ties lower index — i.e. the stable sort, without sorting); the start of e's
//   chunk = Σ spill of the experts before e in (spill descending, lower index) order, the start
//   of p's bucket likewise over spares; then one warp per EP rank picks its S clones: S rounds of
//   a warp argmax of the overlap |chunk e ∩ bucket p| under the order (overlap descending, lower
//   expert first), each round restricted to the entries after the previous pick; finally one
//   thread per spare slot splits its quota over the sources (proportional floors recomputed for
//   the expert's other clones, the remainder by interval overlap, sources in row order, clones in
//   slot order). O(E²/1024 + ep·S·E/32 + ep·S·(ep·S + R)) work, a few microseconds for E ≤ 256.
// moe_echo_reroute: a stable counting pass. A prep block chains each expert's clones in slot order
//   (lead[e] = its first clone slot, next[s], the cumulative quota before s); the hot slots are
//   counted per (lead slot, chunk of 4096 slots) into scratch, the counts of each lead slot are
//   scanned over the chunks, and each chunk ranks its slots within each warp (__match_any_sync,
//   rounds in slot order, warps in order) to get each slot's rank ρ among this rank's slots of its
//   expert in flat slot order; the slot goes to the clone s whose quota interval
//   [before_s, before_s + quota_s) holds ρ. Scratch: the stream's cuBLASLt workspace.
// Nothing is read on the host, nothing allocated, no floating point: deterministic and capturable.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "ops/cuda/common.cuh"
#include "ops/moe_echo.h"

namespace mt::cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kPlanThreads = 1024;
constexpr int kWarps = 8;  // reroute: warps per block
constexpr int kThreads = kWarps * 32;
constexpr int kItems = 16;                 // reroute: rounds of 32 slots per warp
constexpr int kChunk = kThreads * kItems;  // reroute: slots per block
constexpr size_t kDefaultSmem = 48 * 1024;

__device__ __forceinline__ int64_t overlap(int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
  const int64_t lo = a0 > b0 ? a0 : b0, hi = a1 < b1 ? a1 : b1;
  return hi > lo ? hi - lo : 0;
}
__device__ __forceinline__ int64_t relu(int64_t x) { return x > 0 ? x : 0; }

// ---- plan ------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kPlanThreads)
    echo_plan_kernel(int32_t* __restrict__ clone_expert, int32_t* __restrict__ clone_quota, int32_t* __restrict__ quota,
                     const int32_t* __restrict__ counts, int R, int ep, int E, int S) {
  extern __shared__ int64_t sm[];
  const int L = E / ep, NS = ep * S, tid = threadIdx.x, nt = blockDim.x;
  int64_t* tok = sm;                          // [E]
  int64_t* spill = tok + E;                   // [E]
  int64_t* cstart = spill + E;                // [E] chunk start
  int64_t* load = cstart + E;                 // [ep]
  int64_t* spare = load + ep;                 // [ep]
  int64_t* bstart = spare + ep;               // [ep] bucket start
  int64_t* cq = bstart + ep;                  // [NS] clone quota
  int* ce = reinterpret_cast<int*>(cq + NS);  // [NS] clone expert
  __shared__ int64_t s_avg;

  for (int e = tid; e < E; e += nt) {
    int64_t t = 0;
    for (int r = 0; r < R; ++r) t += counts[static_cast<int64_t>(r) * E + e];
    tok[e] = t;
  }
  __syncthreads();
  for (int p = tid; p < ep; p += nt) {
    int64_t l = 0;
    for (int j = 0; j < L; ++j) l += tok[p * L + j];
    load[p] = l;
  }
  __syncthreads();
  if (tid == 0) {
    int64_t total = 0;
    for (int p = 0; p < ep; ++p) total += load[p];
    s_avg = total / ep;
  }
  __syncthreads();
  const int64_t avg = s_avg;
  for (int p = tid; p < ep; p += nt) spare[p] = relu(avg - load[p]);
  for (int e = tid; e < E; e += nt) {  // gen_intermediate's spillover without sorting
    const int p0 = (e / L) * L;
    const int64_t te = tok[e];
    int64_t cum = 0;  // inclusive: the rank's experts up to e in (tok ascending, index) order
    for (int j = p0; j < p0 + L; ++j) {
      const int64_t t = tok[j];
      if (t < te || (t == te && j <= e)) cum += t;
    }
    spill[e] = relu(cum - avg) - relu(cum - te - avg);
  }
  __syncthreads();
  for (int e = tid; e < E; e += nt) {  // chunk starts in (spill descending, index) order
    const int64_t v = spill[e];
    int64_t start = 0;
    for (int j = 0; j < E; ++j) {
      const int64_t w = spill[j];
      if (w > v || (w == v && j < e)) start += w;
    }
    cstart[e] = start;
  }
  for (int p = tid; p < ep; p += nt) {  // bucket starts in (spare descending, rank) order
    const int64_t v = spare[p];
    int64_t start = 0;
    for (int j = 0; j < ep; ++j) {
      const int64_t w = spare[j];
      if (w > v || (w == v && j < p)) start += w;
    }
    bstart[p] = start;
  }
  __syncthreads();
  // One warp per EP rank: its S largest overlaps, (value descending, expert ascending).
  const int lane = tid & 31, nwarps = nt >> 5;
  for (int p = tid >> 5; p < ep; p += nwarps) {
    const int64_t b0 = bstart[p], b1 = b0 + spare[p];
    int64_t prev_v = INT64_MAX;
    int prev_e = -1;
    for (int j = 0; j < S; ++j) {
      int64_t best_v = 0;
      int best_e = -1;
      if (prev_e >= 0 || j == 0) {
        for (int e = lane; e < E; e += 32) {
          const int64_t v = overlap(cstart[e], cstart[e] + spill[e], b0, b1);
          const bool after = v < prev_v || (v == prev_v && e > prev_e);
          if (v > best_v && after) {  // e ascending per lane: ties keep the lower expert
            best_v = v;
            best_e = e;
          }
        }
        for (int o = 16; o > 0; o >>= 1) {
          const int64_t ov = __shfl_xor_sync(kFull, best_v, o);
          const int oe = __shfl_xor_sync(kFull, best_e, o);
          if (oe >= 0 && (best_e < 0 || ov > best_v || (ov == best_v && oe < best_e))) {
            best_v = ov;
            best_e = oe;
          }
        }
      }
      if (lane == 0) {
        ce[p * S + j] = best_e;
        cq[p * S + j] = best_e >= 0 ? best_v : 0;
      }
      prev_v = best_v;
      prev_e = best_e;
    }
  }
  __syncthreads();
  // One thread per spare slot: its column of quota.
  for (int s = tid; s < NS; s += nt) {
    const int e = ce[s];
    clone_expert[s] = e;
    clone_quota[s] = static_cast<int32_t>(cq[s]);
    if (e < 0) {
      for (int r = 0; r < R; ++r) quota[static_cast<int64_t>(r) * NS + s] = 0;
      continue;
    }
    const int64_t te = tok[e], q = cq[s];
    const auto floor_of = [&](int r, int slot) { return counts[static_cast<int64_t>(r) * E + e] * cq[slot] / te; };
    int64_t need_start = 0, need = q;  // this clone's remainder interval among e's clones
    for (int s2 = 0; s2 < NS; ++s2) {
      if (ce[s2] != e || s2 > s) continue;
      int64_t rest = cq[s2];
      for (int r = 0; r < R; ++r) rest -= floor_of(r, s2);
      if (s2 < s) {
        need_start += rest;
      } else {
        need = rest;
      }
    }
    int64_t pos = 0;  // the sources' leftovers, end to end in row order
    for (int r = 0; r < R; ++r) {
      int64_t left = counts[static_cast<int64_t>(r) * E + e];
      for (int s2 = 0; s2 < NS; ++s2)
        if (ce[s2] == e) left -= floor_of(r, s2);
      const int64_t extra = overlap(pos, pos + left, need_start, need_start + need);
      quota[static_cast<int64_t>(r) * NS + s] = static_cast<int32_t>(floor_of(r, s) + extra);
      pos += left;
    }
  }
}

// ---- reroute ---------------------------------------------------------------------------------------

/// Scratch of the reroute: lead [E] (first clone slot of each expert, -1), next [NS] (the
/// expert's next clone slot, -1), before [NS] (int64: quotas of the expert's earlier clones),
/// blocks [NS][B] (hot slots per lead slot and chunk, then their exclusive scan).
struct RerouteScratch {
  int* lead;
  int* next;
  int64_t* before;
  int* blocks;
};

__global__ void __launch_bounds__(kPlanThreads) reroute_prep_kernel(RerouteScratch w, const int32_t* __restrict__ ce,
                                                                    const int32_t* __restrict__ q, int E, int NS) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) w.lead[e] = INT_MAX;
  __syncthreads();
  for (int s = threadIdx.x; s < NS; s += blockDim.x) {
    const int e = ce[s];
    if (e >= 0 && e < E) atomicMin(&w.lead[e], s);
    int nx = -1;
    int64_t before = 0;
    if (e >= 0 && e < E) {
      for (int s2 = 0; s2 < NS; ++s2) {
        if (ce[s2] != e) continue;
        if (s2 < s) before += q[s2] > 0 ? q[s2] : 0;
        if (s2 > s && nx < 0) nx = s2;
      }
    }
    w.next[s] = nx;
    w.before[s] = before;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (w.lead[e] == INT_MAX) w.lead[e] = -1;
}

/// The lead clone slot of slot i's expert, or -1 (not a hot expert, or not an expert id).
__device__ __forceinline__ int bin_of(const int32_t* top, const int* lead, int64_t i, int64_t n, int E) {
  if (i >= n) return -1;
  const int e = top[i];
  return (e >= 0 && e < E) ? lead[e] : -1;
}

__global__ void __launch_bounds__(kThreads)
    reroute_count_kernel(RerouteScratch w, const int32_t* __restrict__ top, int64_t n, int E, int NS, int B) {
  extern __shared__ int hist[];
  for (int b = threadIdx.x; b < NS; b += blockDim.x) hist[b] = 0;
  __syncthreads();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk;
  for (int q = threadIdx.x; q < kChunk; q += blockDim.x) {
    const int b = bin_of(top, w.lead, base + q, n, E);
    if (b >= 0) atomicAdd(&hist[b], 1);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < NS; b += blockDim.x) w.blocks[static_cast<int64_t>(b) * B + blockIdx.x] = hist[b];
}

/// Exclusive prefix of v across the block (thread order); *total = the block's sum.
__device__ int block_exclusive_scan(int v, int* total) {
  __shared__ int wsum[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  int x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) wsum[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < nw ? wsum[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFull, s, o);
      if (lane >= o) s += y;
    }
    wsum[lane] = s;
  }
  __syncthreads();
  const int prefix = (warp > 0 ? wsum[warp - 1] : 0) + x - v;
  *total = wsum[nw - 1];
  __syncthreads();
  return prefix;
}

/// One block per lead slot: blocks[b][*] becomes its exclusive scan over the chunks.
__global__ void __launch_bounds__(kThreads) reroute_scan_kernel(RerouteScratch w, int B) {
  int* row = w.blocks + static_cast<int64_t>(blockIdx.x) * B;
  int carry = 0;
  for (int b0 = 0; b0 < B; b0 += blockDim.x) {
    const int b = b0 + threadIdx.x;
    const int v = b < B ? row[b] : 0;
    int total;
    const int p = block_exclusive_scan(v, &total);
    if (b < B) row[b] = carry + p;
    carry += total;
  }
}

__global__ void __launch_bounds__(kThreads)
    reroute_place_kernel(int32_t* __restrict__ out, RerouteScratch w, const int32_t* __restrict__ top,
                         const int32_t* __restrict__ q, int64_t n, int E, int NS, int B) {
  extern __shared__ int wc[];  // [kWarps][NS]: per-warp counts, then per-warp starts
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < kWarps * NS; i += blockDim.x) wc[i] = 0;
  __syncthreads();
  const int64_t wbase = static_cast<int64_t>(blockIdx.x) * kChunk + static_cast<int64_t>(warp) * 32 * kItems;
  int* mine = wc + warp * NS;
  int bin[kItems], rank[kItems];
  const unsigned lt = (1u << lane) - 1u;
#pragma unroll
  for (int r = 0; r < kItems; ++r) {
    const int64_t i = wbase + r * 32 + lane;
    const int b = bin_of(top, w.lead, i, n, E);
    bin[r] = b;
    const unsigned peers = __match_any_sync(kFull, b);
    rank[r] = b >= 0 ? mine[b] + __popc(peers & lt) : 0;
    __syncwarp();
    if (b >= 0 && lane == __ffs(peers) - 1) mine[b] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  for (int b = threadIdx.x; b < NS; b += blockDim.x) {  // per-warp starts: chunk prefix, warps in order
    int run = w.blocks[static_cast<int64_t>(b) * B + blockIdx.x];
    for (int v = 0; v < kWarps; ++v) {
      const int c = wc[v * NS + b];
      wc[v * NS + b] = run;
      run += c;
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kItems; ++r) {
    const int64_t i = wbase + r * 32 + lane;
    if (i >= n) continue;
    const int e = top[i];
    int32_t v = e;
    if (bin[r] >= 0) {
      const int64_t rho = static_cast<int64_t>(mine[bin[r]]) + rank[r];
      int s = bin[r];
      while (s >= 0 && rho >= w.before[s] + (q[s] > 0 ? q[s] : 0)) s = w.next[s];
      if (s >= 0) v = E + s;
    }
    out[i] = v;
  }
}

/// Opts `kernel` in to `smem` bytes of dynamic shared memory when that exceeds the default 48 KiB.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t smem, const char* fn) {
  if (smem <= kDefaultSmem) return;
  int dev = 0, max_optin = 0;
  MT_CUDA_CHECK(cudaGetDevice(&dev));
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  MT_CHECK(smem <= static_cast<size_t>(max_optin), "{}: needs {} bytes of shared memory, more than the device's {}", fn,
           smem, max_optin);
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
}

}  // namespace

void moe_echo_plan(const Tensor& clone_expert, const Tensor& clone_quota, const Tensor& quota, const Tensor& counts,
                   int64_t ep, int64_t num_echo, const Stream& stream) {
  const char* fn = "moe_echo_plan";
  const int64_t R = counts.size(0), E = counts.size(1), NS = ep * num_echo;
  MT_CHECK(E <= 4096 && NS <= 4096,
           "{}: the CUDA planner supports up to 4096 experts and 4096 spare slots, got {} and {}", fn, E, NS);
  const size_t smem = static_cast<size_t>(24 * (E + ep) + 12 * NS);
  allow_smem(echo_plan_kernel, smem, fn);
  echo_plan_kernel<<<1, kPlanThreads, smem, cu(stream)>>>(
      clone_expert.data_as<int32_t>(), clone_quota.data_as<int32_t>(), quota.data_as<int32_t>(),
      counts.data_as<int32_t>(), static_cast<int>(R), static_cast<int>(ep), static_cast<int>(E),
      static_cast<int>(num_echo));
  MT_CUDA_CHECK_LAUNCH();
}

void moe_echo_reroute(const Tensor& rerouted, const Tensor& top, const Tensor& clone_expert, const Tensor& quota_row,
                      int64_t num_experts, const Stream& stream) {
  const char* fn = "moe_echo_reroute";
  const int64_t n = top.numel(), NS = clone_expert.numel(), E = num_experts;
  MT_CHECK(NS <= 4096 && n <= INT32_MAX,
           "{}: the CUDA rerouting supports up to 4096 spare slots and 2^31 slots, got {} and {}", fn, NS, n);
  if (n == 0) return;
  const int64_t B = (n + kChunk - 1) / kChunk;
  auto align = [](size_t b) { return (b + 255) & ~size_t{255}; };
  const size_t lead_b = align(static_cast<size_t>(E) * 4), next_b = align(static_cast<size_t>(NS) * 4),
               before_b = align(static_cast<size_t>(NS) * 8), blocks_b = static_cast<size_t>(NS * B) * 4;
  const size_t bytes = lead_b + next_b + before_b + blocks_b;
  MT_CHECK(stream.cuda() != nullptr && stream.cuda()->workspace != nullptr, "{}: needs a CUDA stream", fn);
  MT_CHECK(bytes <= CudaStreamResources::kWorkspaceBytes, "{}: needs {} bytes of scratch, more than the stream's {}",
           fn, bytes, CudaStreamResources::kWorkspaceBytes);
  char* base = static_cast<char*>(stream.cuda()->workspace);
  RerouteScratch w{reinterpret_cast<int*>(base), reinterpret_cast<int*>(base + lead_b),
                   reinterpret_cast<int64_t*>(base + lead_b + next_b),
                   reinterpret_cast<int*>(base + lead_b + next_b + before_b)};
  const int e32 = static_cast<int>(E), ns = static_cast<int>(NS), nb = static_cast<int>(B);
  const int32_t* tp = top.data_as<int32_t>();
  const int32_t* q = quota_row.data_as<int32_t>();
  cudaStream_t s = cu(stream);
  reroute_prep_kernel<<<1, kPlanThreads, 0, s>>>(w, clone_expert.data_as<int32_t>(), q, e32, ns);
  MT_CUDA_CHECK_LAUNCH();
  const size_t count_smem = static_cast<size_t>(NS) * 4, place_smem = static_cast<size_t>(kWarps * NS) * 4;
  allow_smem(reroute_count_kernel, count_smem, fn);
  allow_smem(reroute_place_kernel, place_smem, fn);
  reroute_count_kernel<<<static_cast<unsigned>(B), kThreads, count_smem, s>>>(w, tp, n, e32, ns, nb);
  MT_CUDA_CHECK_LAUNCH();
  reroute_scan_kernel<<<static_cast<unsigned>(NS), kThreads, 0, s>>>(w, nb);
  MT_CUDA_CHECK_LAUNCH();
  reroute_place_kernel<<<static_cast<unsigned>(B), kThreads, place_smem, s>>>(rerouted.data_as<int32_t>(), w, tp, q, n,
                                                                              e32, ns, nb);
  MT_CUDA_CHECK_LAUNCH();
}

namespace {
__global__ void virtual_experts_kernel(int32_t* __restrict__ y, const int32_t* __restrict__ x, int64_t n, int E, int L,
                                       int S, int NS) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = x[i];
    int v = e;
    if (e >= E + NS) {
      v = -1;
    } else if (e >= E) {
      const int s = e - E;
      v = (s / S) * (L + S) + L + s % S;
    } else if (e >= 0) {
      v = (e / L) * (L + S) + e % L;
    }
    y[i] = v;
  }
}
}  // namespace

void moe_echo_virtual_experts(const Tensor& out, const Tensor& in, int64_t num_experts, int64_t ep, int64_t num_echo,
                              const Stream& stream) {
  const int64_t n = in.numel();
  if (n == 0) return;
  const int64_t L = num_experts / ep;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096));
  virtual_experts_kernel<<<blocks, 256, 0, cu(stream)>>>(out.data_as<int32_t>(), in.data_as<int32_t>(), n,
                                                         static_cast<int>(num_experts), static_cast<int>(L),
                                                         static_cast<int>(num_echo), static_cast<int>(ep * num_echo));
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
