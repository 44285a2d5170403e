// Mixture-of-experts routing and token permutation (Megatron-Core transformer/moe/router.py
// TopKRouter, moe_utils.py topk_routing_with_score_function, group_limited_topk,
// switch_load_balancing_loss_func, z_loss_func, permute / unpermute). T tokens, E experts, top-k.
// All routing math in fp32 (Megatron's --moe-router-dtype fp32). CPU reference backend; the CUDA
// kernels are not written yet (a CUDA tensor is an mt::Error naming the op).
#pragma once
#include <cstdint>

#include "core/stream.h"
#include "core/tensor.h"

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
/// logits: fp32 [T, E]; expert_bias: fp32 [E] or empty (sigmoid only); probs: fp32 [T, k];
/// top: int32 [T, k]; scores_for_aux: fp32 [T, E] or empty.
/// Errors: mt::Error on shapes/dtypes, k outside [1, E], group options that do not divide E.
void moe_topk_routing(const Tensor& probs, const Tensor& top, const Tensor& scores_for_aux, const Tensor& logits,
                      const Tensor& expert_bias, const MoeRouterOptions& options, const Stream& stream);

/// d_logits [T, E] (fp32, overwritten) = the gradient of probs (moe_topk_routing, same options and
/// top) back to the logits, from d_probs [T, k]; the selection is constant.
void moe_topk_routing_backward(const Tensor& d_logits, const Tensor& d_probs, const Tensor& logits, const Tensor& top,
                               const MoeRouterOptions& options, const Stream& stream);

/// Adds the gradient of Σ_t Σ_e coef[e] · scores_for_aux[t, e] to d_logits [T, E] (fp32,
/// accumulate): the load-balancing loss enters through its per-expert coefficient (for Megatron's
/// switch loss, coef[e] = weight · coeff · E · tokens_per_expert[e] / (k · N²)).
/// logits [T, E], coef [E], both fp32.
void moe_aux_scores_backward(const Tensor& d_logits, const Tensor& logits, const Tensor& coef,
                             bool sigmoid, const Stream& stream);

/// Router z-loss (ST-MoE, Zoph et al. 2022; Megatron's z_loss_func without the coefficient):
/// returns Σ_t logsumexp(logits[t])² (host double; the caller scales it) and, when d_logits is
/// given, adds scale · ∂/∂logits of that sum to it (fp32 [T, E], accumulate).
double moe_z_loss(const Tensor& logits, const Tensor& d_logits, float scale, const Stream& stream);

/// Tokens per expert: counts[e] (fp32 [E], overwritten) = number of (token, slot) with top == e.
void moe_tokens_per_expert(const Tensor& counts, const Tensor& top, const Stream& stream);

/// The permutation of the local experts' tokens: rows ordered by local expert, then token, then
/// slot (Megatron's permute with a routing map). top: int32 [N, k] (the gathered routing);
/// local experts are [first_expert, first_expert + num_local). Writes row_index int32 [≥ R]
/// (row r holds flat slot t·k + j) and counts int32 [num_local]; returns R (host: the row count
/// decides the expert GEMM shapes).
int64_t moe_routing_map(const Tensor& row_index, const Tensor& counts, const Tensor& top, int64_t first_expert,
                        int64_t num_local, const Stream& stream);

/// rows[r] = x[row_index[r] / k] for r < R (rows [R, h], x [N, h], act dtype).
void moe_permute(const Tensor& rows, const Tensor& x, const Tensor& row_index, int64_t topk, const Stream& stream);
/// dx[t] = Σ_{r: row_index[r] / k = t} d_rows[r] (dx [N, h] overwritten).
void moe_permute_backward(const Tensor& dx, const Tensor& d_rows, const Tensor& row_index, int64_t topk,
                          const Stream& stream);
/// y[t] = Σ_{r: row_index[r] / k = t} probs[row_index[r]] · rows[r] (y [N, h] overwritten; probs
/// fp32 [N, k] read flat).
void moe_unpermute(const Tensor& y, const Tensor& rows, const Tensor& probs, const Tensor& row_index,
                   const Stream& stream);
/// d_rows[r] = probs[i] · dy[t] and d_probs[i] = <dy[t], rows[r]> for i = row_index[r], t = i / k;
/// d_probs [N, k] fp32 is overwritten (0 where no local row).
void moe_unpermute_backward(const Tensor& d_rows, const Tensor& d_probs, const Tensor& dy, const Tensor& rows,
                            const Tensor& probs, const Tensor& row_index, const Stream& stream);

/// CPU entry points (ops/cpu/moe.cpp); the CUDA ones come with the MoE kernels.
namespace cpu {
decltype(::mt::moe_topk_routing) moe_topk_routing;
decltype(::mt::moe_topk_routing_backward) moe_topk_routing_backward;
decltype(::mt::moe_aux_scores_backward) moe_aux_scores_backward;
decltype(::mt::moe_z_loss) moe_z_loss;
decltype(::mt::moe_tokens_per_expert) moe_tokens_per_expert;
decltype(::mt::moe_routing_map) moe_routing_map;
decltype(::mt::moe_permute) moe_permute;
decltype(::mt::moe_permute_backward) moe_permute_backward;
decltype(::mt::moe_unpermute) moe_unpermute;
decltype(::mt::moe_unpermute_backward) moe_unpermute_backward;
}  // namespace cpu

}  // namespace mt
