// Backend entry points of ops/embedding.h (same arguments; validated by ops/embedding.cpp).
#pragma once
#include "ops/embedding.h"

namespace mt::cpu {
void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& wte, const Tensor& wpe,
                       const Tensor& positions, int64_t vocab_start, const Stream& stream);
void embedding_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& ids,
                        const Tensor& positions, int64_t vocab_start, const Stream& stream);
}  // namespace mt::cpu

namespace mt::cuda {
void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& wte, const Tensor& wpe,
                       const Tensor& positions, int64_t vocab_start, const Stream& stream);
void embedding_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& ids,
                        const Tensor& positions, int64_t vocab_start, const Stream& stream);
}  // namespace mt::cuda
