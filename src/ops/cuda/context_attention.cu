// CUDA implementation of ops/context_attention.h: plain (causal / full) blocks on cuDNN's fused
// attention when ContextAttentionConfig::cudnn asks for it and it applies (ops/cuda/cudnn_attention.h),
// else the FlashAttention-2 kernels of
// ops/cuda/flash_attention_kernels.cuh with the global-position mask policy (flash::PositionMask):
// the query heads of qkv against the key block kv, (out, lse) written or merged by the LSE, dQ,
// dK and dV added. bf16/fp16 with head_dim 64 or 128 and 16-byte aligned tensors run on the tensor
// cores, everything else (or MT_CONTEXT_ATTN_SIMPLE=1, for comparisons) on the simple kernels. The
// tensor-core backward sums dQ with fp32 atomics (may differ in the last bits between runs), or,
// with ContextAttentionConfig::deterministic (--deterministic-mode), computes it in a kernel of its
// own per query tile (same bits every run). Also kv_pack / kv_unpack and transpose_blocks.
#include <cstdint>
#include <cstdlib>

#include "ops/context_attention.h"
#include "ops/context_attention_impl.h"
#include "ops/cuda/cudnn_attention.h"
#include "ops/cuda/flash_attention_kernels.cuh"

namespace mt::cuda {
namespace {

// The copy kernels below move W-byte words (W = 16, 8, 4, 2 or 1: the largest that divides the
// block size and the pointers' alignment, word_bytes), so a block of c bytes costs c / W index
// computations instead of c (the byte-wise versions took ~30 ms of a 32K a2a layer's 50 ms).
template <typename W>
__global__ void move_kv_kernel(W* t, const W* s, int64_t R, int64_t w, int64_t qpg, int64_t head, bool pack) {
  const int64_t total = R * 2 * head;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = k / (2 * head), off = k % (2 * head);
    const int64_t wide = (i * w + qpg) * head + off, narrow = i * 2 * head + off;
    if (pack) t[narrow] = s[wide];
    else t[wide] = s[narrow];
  }
}

/// The widest word (16, 8, 4, 2 or 1 bytes) dividing `bytes` and every pointer's address.
int word_bytes(int64_t bytes, std::initializer_list<const void*> ptrs) {
  for (int w : {16, 8, 4, 2}) {
    bool ok = bytes % w == 0;
    for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(w) == 0;
    if (ok) return w;
  }
  return 1;
}

/// Calls f(W{}) with the unsigned type of `bytes` bytes (uint4 for 16).
template <typename F>
void with_word(int bytes, F&& f) {
  switch (bytes) {
    case 16: f(uint4{}); break;
    case 8: f(uint64_t{}); break;
    case 4: f(uint32_t{}); break;
    case 2: f(uint16_t{}); break;
    default: f(uint8_t{}); break;
  }
}

/// move_kv_kernel at the widest word dividing the head's bytes and both pointers.
void move_kv(char* t, const char* s, int64_t R, int64_t w, int64_t qpg, int64_t head, bool pack, const Stream& stream) {
  const int wb = word_bytes(head, {t, s});
  with_word(wb, [&](auto word) {
    using W = decltype(word);
    const int64_t hw = head / wb;
    move_kv_kernel<W><<<grid_for(R * 2 * hw, 256), 256, 0, cu(stream)>>>(
        reinterpret_cast<W*>(t), reinterpret_cast<const W*>(s), R, w, qpg, hw, pack);
  });
}

template <typename W>
__global__ void transpose_kernel(W* y, const W* x, int64_t a, int64_t b, int64_t c) {
  const int64_t total = a * b * c;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = k % c, j = (k / c) % b, i = k / (b * c);
    y[(j * a + i) * c + e] = x[k];
  }
}

// transpose_blocks with one-byte blocks (c = 1: an FP8 matrix [a, b] -> [b, a]) when a and b are
// multiples of 16 and both pointers 16-byte aligned: 64 x 64 byte tiles through shared memory, 16-byte
// loads and stores (the element-wise kernel above writes single bytes with a stride of a).
constexpr int kByteTile = 64;
__global__ void transpose_bytes_kernel(uint8_t* y, const uint8_t* x, int64_t a, int64_t b) {
  __shared__ __align__(16) uint8_t tile[kByteTile][kByteTile + 16];  // row stride 80: 16-byte aligned rows
  const int64_t i0 = int64_t(blockIdx.y) * kByteTile, j0 = int64_t(blockIdx.x) * kByteTile;
  const int r = threadIdx.x / 4, q = threadIdx.x % 4;  // 256 threads: tile row r, 16-byte chunk q
  if (i0 + r < a && j0 + 16 * q < b)
    *reinterpret_cast<uint4*>(&tile[r][16 * q]) = *reinterpret_cast<const uint4*>(x + (i0 + r) * b + j0 + 16 * q);
  __syncthreads();
  if (j0 + r < b && i0 + 16 * q < a) {  // y[j0 + r, i0 + 16q .. +16) = x[i0 + 16q .. +16, j0 + r]
    union {
      uint4 v;
      uint8_t e[16];
    } out;
#pragma unroll
    for (int k = 0; k < 16; ++k) out.e[k] = tile[16 * q + k][r];
    *reinterpret_cast<uint4*>(y + (j0 + r) * a + i0 + 16 * q) = out.v;
  }
}

/// permute_blocks: target block j of each outer row comes from block src_of[j] (at most 128 blocks).
struct BlockPerm {
  uint8_t src_of[128];
};

template <typename W>
__global__ void permute_kernel(W* y, const W* x, BlockPerm bp, int k, int64_t total, int64_t c) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t byte = e % c, blk = (e / c) % k, o = e / (c * k);
    y[e] = x[(o * k + bp.src_of[blk]) * c + byte];
  }
}

/// MT_CONTEXT_ATTN_SIMPLE=1: always the simple kernels (benchmarks: old vs new), read once.
bool force_simple() {
  static const bool v = [] {
    const char* e = std::getenv("MT_CONTEXT_ATTN_SIMPLE");
    return e != nullptr && std::atoi(e) != 0;
  }();
  return v;
}

/// The kernels' view of one call: keys and values from kv [sk, b, g, 2, d], lse [sq, b, n].
flash::Params make_params(const Tensor& qkv, const Tensor& kv, const ContextAttentionConfig& c) {
  flash::Params p;
  p.q = qkv.data();
  p.kv = kv.data();
  p.q_pos = c.q_pos.data_as<int32_t>();
  p.k_pos = c.k_pos.data_as<int32_t>();
  p.doc = c.doc_start.empty() ? nullptr : c.doc_start.data_as<int32_t>();
  p.doc_stride = c.doc_start.empty() ? 0 : c.doc_start.stride(0);
  p.sq = qkv.size(0);
  p.sk = kv.size(0);
  p.B = c.batch;
  p.G = c.groups;
  p.qpg = c.queries_per_group;
  p.n = c.heads();
  p.d = c.head_dim;
  p.kv_heads = 2;
  p.kv_first = 0;
  p.row_bh = 1;
  p.row_i = c.batch * c.heads();
  p.scale = c.softmax_scale;
  p.scale_log2 = c.softmax_scale * flash::kLog2e;
  p.drop = context_attention_dropout(c);
  return p;
}

}  // namespace

void context_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                               const Tensor& workspace, const ContextAttentionConfig& c, bool merge,
                               const Stream& stream) {
  if (cudnn_context_applies(c, qkv.dtype(), qkv.size(0), kv.size(0), {qkv.data(), kv.data(), out.data()}) &&
      cudnn_context_forward(out, lse, qkv, kv, workspace, c, merge, stream))
    return;
  flash::Params p = make_params(qkv, kv, c);
  p.out = out.data();
  p.lse = lse.data_as<float>();
  p.merge = merge;
  flash::forward<flash::PositionMask>(p, qkv.dtype(), !force_simple() && flash::mma_applies(p.d, {p.q, p.kv, p.out}),
                                      cu(stream), "context_attention_forward");
}

void context_attention_backward(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout, const Tensor& out,
                                const Tensor& lse, const Tensor& qkv, const Tensor& kv, const Tensor& workspace,
                                const ContextAttentionConfig& c, const Stream& stream) {
  if (cudnn_context_applies(c, qkv.dtype(), qkv.size(0), kv.size(0),
                            {qkv.data(), kv.data(), out.data(), dout.data(), dqkv.data(), dkv.data()}) &&
      cudnn_context_backward(dqkv, dkv, dout, out, lse, qkv, kv, workspace, c, stream))
    return;
  flash::Params p = make_params(qkv, kv, c);
  p.out = out.data();
  p.lse = lse.data_as<float>();
  p.dout = dout.data();
  p.dq = dqkv.data();
  p.dkv = dkv.data();
  unsigned char* ws = static_cast<unsigned char*>(workspace.data());
  p.delta = reinterpret_cast<float*>(ws);
  p.dq_accum = reinterpret_cast<float*>(ws + context_attention_dq_accum_offset(c, p.sq));
  const bool mma = !force_simple() && flash::mma_applies(p.d, {p.q, p.kv, p.out, p.dout, p.dq, p.dkv, ws});
  flash::backward<flash::PositionMask>(p, qkv.dtype(), mma, c.deterministic, cu(stream), "context_attention_backward");
}

void kv_pack(const Tensor& kv, const Tensor& qkv, int64_t qpg, const Stream& stream) {
  const int64_t dim = qkv.size(-1), R = qkv.numel() / ((qpg + 2) * dim);
  const int64_t head = dim * static_cast<int64_t>(dtype_size(qkv.dtype()));
  move_kv(static_cast<char*>(kv.data()), static_cast<const char*>(qkv.data()), R, qpg + 2, qpg, head, true,
          stream);
  MT_CUDA_CHECK(cudaGetLastError());
}

void kv_unpack(const Tensor& dqkv, const Tensor& dkv, int64_t qpg, const Stream& stream) {
  const int64_t dim = dqkv.size(-1), R = dqkv.numel() / ((qpg + 2) * dim);
  const int64_t head = dim * static_cast<int64_t>(dtype_size(dqkv.dtype()));
  move_kv(static_cast<char*>(dqkv.data()), static_cast<const char*>(dkv.data()), R, qpg + 2, qpg, head, false,
          stream);
  MT_CUDA_CHECK(cudaGetLastError());
}

void transpose_blocks(const Tensor& y, const Tensor& x, int64_t a, int64_t b, const Stream& stream) {
  const int64_t c = x.numel() / (a * b) * static_cast<int64_t>(dtype_size(x.dtype()));
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (c == 1 && a % 16 == 0 && b % 16 == 0 && aligned(x.data()) && aligned(y.data()) &&
      (a + kByteTile - 1) / kByteTile <= 65535) {
    const dim3 grid(static_cast<unsigned>((b + kByteTile - 1) / kByteTile),
                    static_cast<unsigned>((a + kByteTile - 1) / kByteTile));
    transpose_bytes_kernel<<<grid, 256, 0, cu(stream)>>>(static_cast<uint8_t*>(y.data()),
                                                         static_cast<const uint8_t*>(x.data()), a, b);
    MT_CUDA_CHECK(cudaGetLastError());
    return;
  }
  const int wb = word_bytes(c, {x.data(), y.data()});
  with_word(wb, [&](auto w) {
    using W = decltype(w);
    const int64_t cw = c / wb;
    transpose_kernel<W><<<grid_for(a * b * cw, 256), 256, 0, cu(stream)>>>(static_cast<W*>(y.data()),
                                                                          static_cast<const W*>(x.data()), a, b, cw);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void permute_blocks(const Tensor& y, const Tensor& x, int64_t outer, const std::vector<int>& perm, bool inverse,
                    const Stream& stream) {
  BlockPerm bp{};
  const int k = static_cast<int>(perm.size());
  for (int j = 0; j < k; ++j) {
    const int from = inverse ? j : perm[static_cast<size_t>(j)], to = inverse ? perm[static_cast<size_t>(j)] : j;
    bp.src_of[to] = static_cast<uint8_t>(from);
  }
  const int64_t c = x.numel() / (outer * k) * static_cast<int64_t>(dtype_size(x.dtype()));
  const int wb = word_bytes(c, {x.data(), y.data()});
  with_word(wb, [&](auto w) {
    using W = decltype(w);
    const int64_t cw = c / wb;
    permute_kernel<W><<<grid_for(outer * k * cw, 256), 256, 0, cu(stream)>>>(
        static_cast<W*>(y.data()), static_cast<const W*>(x.data()), bp, k, outer * k * cw, cw);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mt::cuda
