// Mixture-of-experts routing and token permutation (Megatron-Core transformer/moe/router.py
// TopKRouter, moe_utils.py topk_routing_with_score_function, group_limited_topk,
// switch_load_balancing_loss_func, z_loss_func, permute / unpermute). T tokens, E experts, top-k.
// The routing math runs in the logits' dtype: fp32 (Megatron's --moe-router-dtype fp32) or fp64
// (--moe-router-dtype fp64: logits, scores, loss terms and their gradients in double; the
// probabilities handed to the dispatcher stay fp32, rounded once). CPU reference backend
// (ops/cpu/moe.cpp) and CUDA kernels (ops/cuda/moe.cu) that match it; every sum is taken in a fixed
// order, so both are deterministic.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// The routing options of TopKRouter (TransformerConfig's moe_router_* fields).
struct MoeRouterOptions {
  int64_t topk = 2;
  bool sigmoid = false;        ///< score function: sigmoid (else softmax)
  bool pre_softmax = false;
  float scaling_factor = 1.f;  ///< probs *= scaling_factor
  int64_t num_groups = 0;      ///< device-limited routing (DeepSeek-V3): 0 = off
  int64_t group_topk = 0;
};

/// Top-k routing from router logits (Megatron's topk_routing_with_score_function):
///   softmax:            top = topk(logits), probs = softmax over the k selected logits;
///   softmax, pre:       s = softmax(logits), (probs, top) = topk(s);
///   sigmoid:            s = sigmoid(logits), top = topk(s + expert_bias), probs = s[top] / Σ s[top]
///                       (not normalised when k = 1);
/// with group-limited selection when num_groups > 0 (experts in num_groups contiguous groups; a
/// group's score is the sum of its best k/group_topk scores; only the best group_topk groups
/// compete), then probs *= scaling_factor. top lists the experts in descending selection score
/// (ties: lower index first). scores_for_aux (may be empty) receives the scores of the load
/// balancing loss: softmax(logits), or the sigmoid scores normalised per token.
/// logits: fp32 or fp64 [T, E] (the routing dtype R: all the math runs in it); expert_bias: fp32
/// [E] or empty (sigmoid only); probs: fp32 [T, k] (scaled in R, then rounded); top: int32 [T, k];
/// scores_for_aux: R [T, E] or empty.
/// Errors: mt::Error on shapes/dtypes, k outside [1, E], group options that do not divide E.
void moe_topk_routing(const Tensor& probs, const Tensor& top, const Tensor& scores_for_aux, const Tensor& logits,
                      const Tensor& expert_bias, const MoeRouterOptions& options, const Stream& stream);

/// d_logits [T, E] (the logits' dtype, fp32 or fp64, overwritten) = the gradient of probs
/// (moe_topk_routing, same options and top) back to the logits, from d_probs fp32 [T, k]; the
/// selection is constant.
void moe_topk_routing_backward(const Tensor& d_logits, const Tensor& d_probs, const Tensor& logits, const Tensor& top,
                               const MoeRouterOptions& options, const Stream& stream);

/// Load-balancing loss (Megatron's switch_load_balancing_loss_func and, with G > 1,
/// sequence_load_balancing_loss_func, without their constants): loss[0] += scale · Σ_t Σ_e
/// scores[t, e] · tokens_per_expert[t mod G, e]. loss fp32 [1] on the device (accumulates, no host
/// synchronisation); scores fp32 or fp64 [T, E] (moe_topk_routing's scores_for_aux); tokens_per_expert
/// fp32 [G, E] or [E] (G = 1): G = 1 counts over all tokens (switch loss), G = b the counts of each
/// sequence of a [s, b] token layout (token t = i·b + j belongs to sequence j). The caller folds
/// coeff · E / (k · N²) (or coeff · E / (b · k · s²)) and the micro-batch weight into scale.
void moe_aux_loss(const Tensor& loss, const Tensor& scores, const Tensor& tokens_per_expert, float scale,
                  const Stream& stream);

/// Adds the gradient of scale · loss_scale[0] · Σ_t Σ_e scores[t, e] · tokens_per_expert[t mod G, e]
/// to d_logits [T, E] (accumulate), scores = softmax(logits) or the per-token normalised sigmoid
/// scores (moe_topk_routing's scores_for_aux). logits and d_logits fp32 or fp64 [T, E] (one dtype,
/// the math in it); tokens_per_expert fp32
/// [G, E] or [E] as in moe_aux_loss; loss_scale fp32 [1] on the device or empty (= 1), read on the
/// device.
void moe_aux_scores_backward(const Tensor& d_logits, const Tensor& logits, const Tensor& tokens_per_expert,
                             float scale, const Tensor& loss_scale, bool sigmoid, const Stream& stream);

/// Router z-loss (ST-MoE, Zoph et al. 2022; Megatron's z_loss_func without the coefficient) of
/// logits fp32 or fp64 [T, E]: when loss (fp32 [1]) is given, loss[0] += scale · Σ_t
/// logsumexp(logits[t])²; when d_logits (the logits' dtype, [T, E]) is given, d_logits += scale · loss_scale[0] · ∂/∂logits of that sum
/// (loss_scale fp32 [1] or empty = 1). Either may be empty; nothing is read on the host.
void moe_z_loss(const Tensor& loss, const Tensor& d_logits, const Tensor& logits, float scale,
                const Tensor& loss_scale, const Stream& stream);

/// The router GEMM in float64 (--moe-router-dtype fp64; Megatron's router_gating_linear with
/// router_dtype torch.float64): logits[t, e] = Σ_i x[t, i] · w[e, i], x and w widened to double
/// exactly and summed in double in ascending i (one thread per output on CUDA: deterministic, the
/// same order as the CPU). x [T, h] and w [E, h] in one act dtype (fp32/bf16/fp16); logits fp64
/// [T, E], overwritten. Errors: mt::Error on shapes/dtypes/devices.
void moe_router_logits_fp64(const Tensor& logits, const Tensor& x, const Tensor& w, const Stream& stream);
/// Backward of moe_router_logits_fp64, from d_logits fp64 [T, E]: dx[t, i] += Σ_e d_logits[t, e] ·
/// w[e, i] (act dtype [T, h], accumulate: the double sum is added to dx's value and rounded once;
/// skipped when empty) and dw[e, i] += Σ_t d_logits[t, e] · x[t, i] (fp32 main gradient [E, h],
/// accumulate, rounded once; skipped when empty); sums in double in ascending order.
/// Errors: mt::Error on shapes/dtypes/devices.
void moe_router_logits_fp64_backward(const Tensor& dx, const Tensor& dw, const Tensor& d_logits, const Tensor& x,
                                     const Tensor& w, const Stream& stream);

/// The sigmoid gate of a shared expert (--moe-shared-expert-gate; Megatron's SharedExpertMLP with
/// gate: output · sigmoid(x · w_gate)), applied while adding it to the routed output:
/// logits[t] = Σ_i x[t, i]·w[i] (summed in double, stored fp32), y[t, :] += sigmoid(logits[t]) ·
/// ys[t, :] (fp32 math, rounded once to the act dtype). y, ys, x [T, h] and w [1, h] in one act
/// dtype (fp32/bf16/fp16, contiguous; y may not alias ys); logits fp32 [T] (written, kept for the
/// backward). One pass per row, no GEMM (a GEMM with one output column is a poor fit for cuBLASLt).
/// Errors: mt::Error on shapes/dtypes/devices.
void moe_shared_gate_forward(const Tensor& y, const Tensor& logits, const Tensor& ys, const Tensor& x, const Tensor& w,
                             const Stream& stream);
/// Its backward from dy [T, h], with σ_t = sigmoid(logits[t]): d_ys[t, :] = σ_t · dy[t, :] (act
/// dtype, overwritten); d_logits[t] = σ_t(1 − σ_t) · Σ_i dy[t, i]·ys[t, i] (fp32 [T], overwritten
/// scratch); dx[t, :] += d_logits[t] · w (act dtype, accumulate; skipped when dx is empty);
/// dw[0, i] += Σ_t d_logits[t]·x[t, i] (fp32 main gradient [1, h], accumulate; summed in double in
/// token order: deterministic).
void moe_shared_gate_backward(const Tensor& d_ys, const Tensor& d_logits, const Tensor& dx, const Tensor& dw,
                              const Tensor& dy, const Tensor& ys, const Tensor& x, const Tensor& w,
                              const Tensor& logits, const Stream& stream);
/// The dx part of moe_shared_gate_backward on its own (the backward called with an empty dx, then
/// this later: --moe-shared-expert-overlap runs the rest on a side stream): dx[t, :] += d_logits[t]
/// · w, the same fp32 expression, so the result is bitwise that of the whole backward. dx [T, h]
/// act dtype; d_logits fp32 [T] (moe_shared_gate_backward's); w [1, h] of dx's dtype.
/// Errors: mt::Error on shapes, dtypes, devices.
void moe_shared_gate_backward_dx(const Tensor& dx, const Tensor& d_logits, const Tensor& w, const Stream& stream);

/// Tokens per expert: counts[g, e] (fp32 [G, E] or [E] for G = 1, overwritten) = the number of
/// (token t, slot) with t mod G = g and top[t, slot] = e; top int32 [T, k], every entry in [0, E).
void moe_tokens_per_expert(const Tensor& counts, const Tensor& top, const Stream& stream);

/// The token counts of the global load-balancing loss (Megatron's TopKRouter global_tokens_per_expert
/// and ga_steps, --moe-router-load-balancing-type global_aux_loss): accumulator fp32 [E + 1] gets
/// accumulator[e] += counts[e] for e < E and accumulator[E] += 1 (the forwards since the last reset),
/// then average[e] = accumulator[e] / accumulator[E] (IEEE division, bitwise alike on both backends).
/// counts, average fp32 [E]; all on the device, nothing read on the host (capturable). The caller
/// zeroes the accumulator once per step. Errors: mt::Error on shapes/dtypes.
void moe_global_tokens_per_expert(const Tensor& average, const Tensor& accumulator, const Tensor& counts,
                                  const Stream& stream);

/// Aux-loss-free load balancing (DeepSeek-V3 §2.1.2; Megatron's get_updated_expert_bias):
/// expert_bias[e] += rate · sign(mean_e' tokens_per_expert[e'] − tokens_per_expert[e]) (sign(0) = 0),
/// both fp32 [E] on the device; the caller passes the step's global token counts.
void moe_expert_bias_update(const Tensor& expert_bias, const Tensor& tokens_per_expert, float rate,
                            const Stream& stream);

/// The permutation of the local experts' tokens: rows ordered by local expert, then flat slot
/// i = t·k + j (Megatron's permute with a routing map). top: int32 [N, k] (the gathered
/// routing); local experts are [first_expert, first_expert + num_local). Writes
/// row_index int32 [≥ R] (row r holds flat slot row_index[r]), slot_row int32 [N·k] (its inverse:
/// the row of slot i, or -1 when expert top[i] is not local) and counts int32 [num_local] on the
/// device, and returns the counts on the host (one device-to-host copy and stream
/// synchronisation on CUDA: the counts decide the expert GEMM shapes). Errors: mt::Error when
/// R = Σ counts exceeds row_index.
std::vector<int64_t> moe_routing_map(const Tensor& row_index, const Tensor& slot_row, const Tensor& counts,
                                     const Tensor& top, int64_t first_expert, int64_t num_local,
                                     const Stream& stream);

/// moe_routing_map without the host copy (--moe-grouped-gemm; nothing is read on the host, so it
/// can be captured in a CUDA graph): writes the same row_index, slot_row and counts int32
/// [num_local] on the device, and row_index[r] = -1 for the rows R <= r < row_index.numel()
/// beyond the routed ones (moe_permute skips them). Consumers read R = Σ counts on the device
/// (ops/grouped_matmul.h). Σ counts must not exceed row_index.numel() (the dispatchers plan the
/// dropless bound, or with an expert capacity the capacity's): no error can be raised without
/// reading the counts, so on CUDA the rows beyond it are not placed (their slots get slot_row -1);
/// the CPU raises mt::Error.
void moe_routing_map_device(const Tensor& row_index, const Tensor& slot_row, const Tensor& counts, const Tensor& top,
                            int64_t first_expert, int64_t num_local, const Stream& stream);

/// rows[r] = x[row_index[r] / k] for r < R (rows [R, h], x [N, h], act dtype); rows with
/// row_index[r] < 0 (the tail of moe_routing_map_device) are left untouched.
void moe_permute(const Tensor& rows, const Tensor& x, const Tensor& row_index, int64_t topk, const Stream& stream);
/// dx[t] = Σ_{j < k, slot_row[t·k + j] ≥ 0} d_rows[slot_row[t·k + j]], summed in j order
/// (dx [N, h] overwritten; deterministic).
void moe_permute_backward(const Tensor& dx, const Tensor& d_rows, const Tensor& slot_row, int64_t topk,
                          const Stream& stream);
/// y[t] = Σ_{j < k, slot_row[t·k + j] ≥ 0} probs[t, j] · rows[slot_row[t·k + j]], summed in j order
/// (y [N, h] overwritten, act dtype, fp32 accumulation; probs fp32 [N, k]).
void moe_unpermute(const Tensor& y, const Tensor& rows, const Tensor& probs, const Tensor& slot_row,
                   const Stream& stream);
/// d_rows[r] = probs[i] · dy[i / k] for i = row_index[r] (r < R = d_rows rows), and 0 for the rows
/// with row_index[r] < 0 (the unrouted tail of moe_routing_map_device, the padding rows of
/// moe_block_send_layout's send_index); d_probs[i] = <dy[i / k], rows[slot_row[i]]> (fp32
/// accumulation), 0 where slot_row[i] < 0; d_rows [R, h] and d_probs [N, k] fp32 overwritten.
/// slot_row must be the inverse of row_index on the rows r with row_index[r] >= 0 (the CUDA
/// backend writes d_rows through slot_row).
void moe_unpermute_backward(const Tensor& d_rows, const Tensor& d_probs, const Tensor& dy, const Tensor& rows,
                            const Tensor& probs, const Tensor& row_index, const Tensor& slot_row,
                            const Stream& stream);

/// Megatron's get_capacity for token dropping with num_tokens = tokens·topk:
/// ceil(tokens·topk / num_experts · factor) in double precision. Errors: mt::Error when factor is
/// not positive or a size is < 1.
int64_t moe_expert_capacity(int64_t tokens, int64_t topk, int64_t num_experts, double factor);

/// Token dropping at an expert capacity (Megatron's apply_router_token_dropping, without padding):
/// of the slots of top int32 [T, k] routed to expert e, at most `capacity` are kept — by_probs
/// (--moe-token-drop-policy probs): those of the highest probs (fp32 [T, k]; ties: the earlier
/// slot; a NaN ranks below every number, so never more than `capacity` are kept), else (position):
/// those of the earliest tokens — and the others dropped:
/// kept[t, j] = top[t, j], or -1 for a dropped slot (the dispatchers skip it: its output and its
/// probability's gradient are zero). kept_counts fp32 [E] (overwritten): the kept slots of each
/// expert. A token selects an expert at most once. kept int32 [T, k] must not alias top.
/// Errors: mt::Error on shapes/dtypes or capacity < 0.
void moe_capacity_drop(const Tensor& kept, const Tensor& kept_counts, const Tensor& top, const Tensor& probs,
                       int64_t capacity, bool by_probs, const Stream& stream);

/// Regroups chunks of rows (Megatron's sort_chunks_by_idxs; the all-to-all dispatcher's
/// "permutation 2" from [source rank][local expert] to [local expert][source rank] order and back):
/// `in` [R, h] is the sequence of chunks c = 0..C-1 of split_sizes[c] rows (Σ = R), and
/// out [R, h] = concat(chunk order[0], chunk order[1], ..., chunk order[C-1]). split_sizes and
/// order are host values (the dispatcher knows the chunk sizes on the host; nothing is read from
/// the device); order is a permutation of 0..C-1; zero-size chunks are allowed. The backward is
/// the same op with the inverse permutation (moe_sort_chunks_inverse). Rows are copied exactly
/// (act dtype, or fp32), one stream-ordered copy per non-empty chunk on either device (no kernel
/// of its own). Errors: mt::Error on shapes/dtypes, Σ split_sizes != R, negative sizes,
/// an order that is not a permutation, out overlapping in.
void moe_sort_chunks(const Tensor& out, const Tensor& in, const std::vector<int64_t>& split_sizes,
                     const std::vector<int64_t>& order, const Stream& stream);
/// The split sizes and order that undo moe_sort_chunks(split_sizes, order): the sizes in output
/// order (split_sizes[order[i]]) and the inverse permutation.
std::pair<std::vector<int64_t>, std::vector<int64_t>> moe_sort_chunks_inverse(const std::vector<int64_t>& split_sizes,
                                                                              const std::vector<int64_t>& order);

MT_OP_BACKENDS(moe_topk_routing)
MT_OP_BACKENDS(moe_topk_routing_backward)
MT_OP_BACKENDS(moe_aux_loss)
MT_OP_BACKENDS(moe_aux_scores_backward)
MT_OP_BACKENDS(moe_z_loss)
MT_OP_BACKENDS(moe_router_logits_fp64)
MT_OP_BACKENDS(moe_router_logits_fp64_backward)
MT_OP_BACKENDS(moe_shared_gate_forward)
MT_OP_BACKENDS(moe_shared_gate_backward)
MT_OP_BACKENDS(moe_shared_gate_backward_dx)
MT_OP_BACKENDS(moe_tokens_per_expert)
MT_OP_BACKENDS(moe_global_tokens_per_expert)
MT_OP_BACKENDS(moe_expert_bias_update)
MT_OP_BACKENDS(moe_routing_map)
MT_OP_BACKENDS(moe_routing_map_device)
MT_OP_BACKENDS(moe_permute)
MT_OP_BACKENDS(moe_permute_backward)
MT_OP_BACKENDS(moe_unpermute)
MT_OP_BACKENDS(moe_unpermute_backward)
MT_OP_BACKENDS(moe_capacity_drop)

}  // namespace mt
