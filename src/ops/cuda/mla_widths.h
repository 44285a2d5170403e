// The CUDA packing copies of ops/mla.h at a chosen access width, for the tests and the bench
// (tests/model/mla_cuda_test.cpp, bench/mla_pack_bench.cpp): every width gives bitwise the same
// results; the ops themselves run at kMlaMaxAccessBytes. Plain C++ (no CUDA headers).
#pragma once
#include "core/stream.h"
#include "core/tensor.h"

namespace mt::cuda {

/// The widest access of the ops (bytes): a 128-bit load or store.
inline constexpr int kMlaMaxAccessBytes = 16;

/// ops/mla.h's mla_qkv_pack, mla_qkv_unpack_grad and mla_context_unpack on CUDA tensors with
/// loads and stores of at most max_bytes bytes (16, 8, 4, 2; never less than one element: the
/// element size gives one element per access, the pre-vectorisation access pattern). No argument
/// checks: call them with tensors the ops of ops/mla.h accept.
void mla_qkv_pack(const Tensor& qkv, const Tensor& q, const Tensor& kv, const Tensor& k_pe, const Stream& stream,
                  int max_bytes);
void mla_qkv_unpack_grad(const Tensor& dq, const Tensor& dkv, const Tensor& dk_pe, const Tensor& dqkv,
                         const Stream& stream, int max_bytes);
void mla_context_unpack(const Tensor& out, const Tensor& context, int64_t heads, bool pad, const Stream& stream,
                        int max_bytes);

}  // namespace mt::cuda
