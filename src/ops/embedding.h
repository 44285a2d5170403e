// Token + learned absolute position embedding (GPT-2; Megatron LanguageModelEmbedding).
// Vocab-parallel ready (Megatron VocabParallelEmbedding): this rank holds rows
// [vocab_start, vocab_start + V_local) of the word table; ids outside that range contribute 0.
// With TP > 1 the caller passes wpe on one TP rank only and all-reduces the output.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// out[t, :] = (vocab_start <= ids[t] < vocab_start+V_local ? wte[ids[t]-vocab_start, :] : 0)
///           + (wpe given ? wpe[pos(t), :] : 0)
/// where t = (i_s, i_b) indexes [s, b] and pos(t) = positions[t] if `positions` is given, else i_s.
/// Shapes: out [s, b, h] (act dtype), ids int32 [s, b], wte [V_local, h], wpe [P, h] (same dtype
/// as out, may be empty), positions int32 [s, b] or empty. Act dtype: fp32 on CPU; fp32, bf16
/// or fp16 on CUDA. Errors: mt::Error on shape/dtype/device mismatch, vocab_start < 0, or a
/// position table with P < s when `positions` is empty. An id outside [0, vocab_size) is the
/// data loader's job to reject (not checked here; it simply contributes 0). An explicit position
/// outside [0, P) throws on CPU and is skipped (contributes 0) on CUDA.
void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& wte, const Tensor& wpe,
                       const Tensor& positions, int64_t vocab_start, const Stream& stream);

/// Weight gradients, accumulated (+=) into fp32 main grads:
/// dwte[ids[t]-vocab_start, :] += dout[t, :] for in-range ids; dwpe[pos(t), :] += dout[t, :].
/// dwte fp32 [V_local, h]; dwpe fp32 [P, h] or empty; dout [s, b, h] (act dtype).
/// deterministic (--deterministic-mode; TransformerConfig::deterministic_mode): on CUDA, sum the
/// rows of each id in token order instead of with atomics (a stable radix sort of the ids, then one
/// block per run of equal ids and column chunk; scratch in the stream's workspace), so the
/// gradients are bitwise the same on every run. The CPU is always deterministic and ignores it.
/// CUDA without it: dwte (and dwpe with explicit positions) use fp32 atomicAdd, so the summation
/// order of repeated ids varies from run to run (bitwise); dwpe with the default positions is
/// summed over b in a fixed order either way.
/// Errors: mt::Error on shape/dtype/device mismatch, vocab_start < 0, a position table with P < s
/// when `positions` is empty, on CPU an explicit position outside [0, P); deterministic on CUDA:
/// more tokens than the stream's workspace can sort (about 1.1 M per call).
void embedding_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& ids,
                        const Tensor& positions, int64_t vocab_start, bool deterministic, const Stream& stream);

MT_OP_BACKENDS(embedding_forward)
MT_OP_BACKENDS(embedding_backward)

}  // namespace mt
