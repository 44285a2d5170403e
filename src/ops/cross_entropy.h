// Softmax cross-entropy over logits of the LM head, split into pieces so that the
// vocab-parallel version (Megatron's _VocabParallelCrossEntropy) reuses them with three
// all-reduces of m values each (MAX of the row max, SUM of the exp-sum, SUM of the target
// logit) and never communicates m·V values. All statistics and the loss in fp32.
//
// Single rank:  stats -> loss -> backward_inplace, or forward_backward_inplace (stats and gradient
//               in one pass over the logits) -> loss.
// Vocab-parallel: stats -> allreduce(MAX, row_max') -> rescale_sumexp(local max -> global max)
//                 -> allreduce(SUM, sumexp), allreduce(SUM, target_logit) -> loss -> backward.
//
// Backends: CPU (fp32, bf16, fp16 logits; reference) and CUDA (one block per row, fp32 math,
// 16-byte vector loads when the rows allow). Errors: mt::Error on a shape, dtype, device or
// stream mismatch (messages print the tensors), V = 0 or vocab_start < 0. Targets are not
// range-checked (that would need a host sync): a target outside [vocab_start, vocab_start + V)
// simply contributes no target logit and no one-hot term on this rank.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// Vocabulary padding: only the first `valid_cols` columns of this rank's logits are real tokens
/// (valid_cols = clamp(vocab_size - vocab_start, 0, V_local); -1 = all V_local). The padded
/// columns take no probability mass: they are left out of the max and the exp-sum, and their
/// gradient is 0 (docs/architecture.md, "Vocabulary padding"). A rank whose columns are all padding
/// has row_max = -inf and row_sumexp = 0.
///
/// Per row r of logits [m, V_local] (act dtype), over the valid columns j:
///   row_max[r] = max_j logits[r, j];  row_sumexp[r] = sum_j exp(logits[r, j] - row_max[r]);
///   target_logit[r] = logits[r, targets[r] - vocab_start] if the target is in this rank's
///   range [vocab_start, vocab_start + valid_cols), else 0.
/// targets: int32 [m]; outputs fp32 [m]. Errors also for valid_cols outside [-1, V_local].
void cross_entropy_stats(const Tensor& row_max, const Tensor& row_sumexp, const Tensor& target_logit,
                         const Tensor& logits, const Tensor& targets, int64_t vocab_start, int64_t valid_cols,
                         const Stream& stream);

/// sumexp[r] *= exp(local_max[r] - global_max[r]) (vocab-parallel only).
void cross_entropy_rescale_sumexp(const Tensor& row_sumexp, const Tensor& local_max, const Tensor& global_max,
                                  const Stream& stream);

/// losses[r] = (log(row_sumexp[r]) + row_max[r] - target_logit[r]) * (loss_mask ? loss_mask[r] : 1)
/// (fp32 [m]); loss_mask fp32 [m] or empty.
void cross_entropy_loss(const Tensor& losses, const Tensor& row_max, const Tensor& row_sumexp,
                        const Tensor& target_logit, const Tensor& loss_mask, const Stream& stream);

/// In place: logits[r, j] <- (softmax(logits)[r, j] - [j == target_r - vocab_start]) * grad_scale
/// * (loss_mask ? loss_mask[r] : 1), i.e. d(grad_scale * sum_r losses[r]) / d logits, for the
/// valid columns; 0 for the padded ones. Uses the (global) row_max and row_sumexp. Overwrites the
/// logits with their gradient (act dtype).
/// device_scale: fp32 [1] on the logits' device (the dynamic loss scale, read by the kernel so no
/// host sync is needed) multiplying grad_scale, or empty (1).
void cross_entropy_backward_inplace(const Tensor& logits, const Tensor& targets, const Tensor& row_max,
                                    const Tensor& row_sumexp, const Tensor& loss_mask, int64_t vocab_start,
                                    int64_t valid_cols, float grad_scale, const Tensor& device_scale,
                                    const Stream& stream);

/// Single rank (the whole vocabulary on this rank, vocab_start = 0): cross_entropy_stats followed by
/// cross_entropy_backward_inplace, i.e. row_max, row_sumexp and target_logit of each row as
/// cross_entropy_stats gives them, and the logits overwritten with their gradient as
/// cross_entropy_backward_inplace gives it (the same arguments and errors). CUDA: when a row fits
/// twice in a multiprocessor's shared memory (cross_entropy_fused_row_fits; GPT-2's 50304 bf16
/// columns do on sm_90), one kernel reads each row once from device memory into shared memory,
/// reduces its statistics there and writes the gradient: one read and one write of the logits
/// instead of two reads and one write. Otherwise, and on the CPU, the two ops in sequence.
void cross_entropy_forward_backward_inplace(const Tensor& row_max, const Tensor& row_sumexp,
                                            const Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                                            const Tensor& loss_mask, int64_t valid_cols, float grad_scale,
                                            const Tensor& device_scale, const Stream& stream);

#ifdef MT_WITH_CUDA
namespace cuda {
/// True when cross_entropy_forward_backward_inplace takes its one-kernel path on `device` for
/// contiguous, 16-byte aligned rows of v elements of dtype (for tests and the bench).
bool cross_entropy_fused_row_fits(int64_t v, DType dtype, Device device);
}  // namespace cuda
#endif

/// out[0] += alpha * sum(x) over fp32 x [n]; deterministic order (CUDA: one block, fixed
/// reduction tree, no float atomics; CPU: fixed chunks summed in double). out: fp32 [1].
void sum_accumulate(const Tensor& out, const Tensor& x, float alpha, const Stream& stream);

MT_OP_BACKENDS(cross_entropy_stats)
MT_OP_BACKENDS(cross_entropy_rescale_sumexp)
MT_OP_BACKENDS(cross_entropy_loss)
MT_OP_BACKENDS(cross_entropy_backward_inplace)
MT_OP_BACKENDS(cross_entropy_forward_backward_inplace)
MT_OP_BACKENDS(sum_accumulate)

}  // namespace mt
