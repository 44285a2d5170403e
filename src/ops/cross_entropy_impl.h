// Backend implementations of ops/cross_entropy.h (arguments already validated by
// ops/cross_entropy.cpp). Same names and signatures on both sides.
#pragma once
#include <cstdint>

#include "core/stream.h"
#include "core/tensor.h"

namespace mt::cpu {
void cross_entropy_stats(const Tensor& row_max, const Tensor& row_sumexp, const Tensor& target_logit,
                         const Tensor& logits, const Tensor& targets, int64_t vocab_start, const Stream& stream);
void cross_entropy_rescale_sumexp(const Tensor& row_sumexp, const Tensor& local_max, const Tensor& global_max,
                                  const Stream& stream);
void cross_entropy_loss(const Tensor& losses, const Tensor& row_max, const Tensor& row_sumexp,
                        const Tensor& target_logit, const Tensor& loss_mask, const Stream& stream);
void cross_entropy_backward_inplace(const Tensor& logits, const Tensor& targets, const Tensor& row_max,
                                    const Tensor& row_sumexp, const Tensor& loss_mask, int64_t vocab_start,
                                    float grad_scale, const Tensor& device_scale, const Stream& stream);
void sum_accumulate(const Tensor& out, const Tensor& x, float alpha, const Stream& stream);
}  // namespace mt::cpu

namespace mt::cuda {
void cross_entropy_stats(const Tensor& row_max, const Tensor& row_sumexp, const Tensor& target_logit,
                         const Tensor& logits, const Tensor& targets, int64_t vocab_start, const Stream& stream);
void cross_entropy_rescale_sumexp(const Tensor& row_sumexp, const Tensor& local_max, const Tensor& global_max,
                                  const Stream& stream);
void cross_entropy_loss(const Tensor& losses, const Tensor& row_max, const Tensor& row_sumexp,
                        const Tensor& target_logit, const Tensor& loss_mask, const Stream& stream);
void cross_entropy_backward_inplace(const Tensor& logits, const Tensor& targets, const Tensor& row_max,
                                    const Tensor& row_sumexp, const Tensor& loss_mask, int64_t vocab_start,
                                    float grad_scale, const Tensor& device_scale, const Stream& stream);
void sum_accumulate(const Tensor& out, const Tensor& x, float alpha, const Stream& stream);
}  // namespace mt::cuda
