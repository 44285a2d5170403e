// Rotary position embedding (Su et al. 2021, "RoFormer", arXiv:2104.09864; Megatron-Core's
// RotaryEmbedding + apply_rotary_pos_emb, Hugging Face Llama's rotate_half), applied in place to
// the query and key heads of the fused QKV projection output.
#pragma once
#include <cstdint>

#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"
#include "ops/rope_math.h"

namespace mt {

struct RopeConfig {
  int64_t queries_per_group = 1;  ///< qpg: query heads per key/value group (num_heads / num_query_groups)
  int64_t rotary_dim = 0;         ///< channels that rotate per head: even, 2 <= rotary_dim <= d
                                  ///< (Megatron: d * --rotary-percent); channels [rotary_dim, d) pass through
  float base = 10000.f;           ///< --rotary-base (theta)
  bool interleaved = false;       ///< --rotary-interleaved: pairs (2i, 2i+1) instead of (i, i + rotary_dim/2)
  /// YaRN (multi-latent attention's --rope-type yarn): the frequencies of rope_math::yarn_inv_freq,
  /// and cos and sin multiplied by rope_math::yarn_concentration.
  rope_math::Yarn yarn;
};

/// Rotates the query and key heads of qkv in place; value heads and channels >= rotary_dim are
/// not touched.
/// qkv: contiguous [s, b, g, qpg + 2, d] (Megatron-Core's per-query-group layout: per (position,
///   sample, group) the qpg query heads, then the key head, then the value head); act dtype:
///   fp32 on CPU; fp32, bf16 or fp16 on CUDA (fp32 math, one rounding at the store).
/// positions: int32 contiguous [s, b] (e.g. --reset-position-ids positions; any values, used as
///   given), or an empty Tensor() for position i_s for every sample.
/// Per pair i < rotary_dim/2, in fp32 as HF/Megatron compute them:
///   inv_freq[i] = 1.0f / powf(base, (2i) / (float)rotary_dim)   (computed on the host by both
///   backends, so CPU and CUDA use bit-identical frequencies), angle = (float)pos * inv_freq[i]
///   (fp32 product), cos/sin of that fp32 angle with accurate fp32 sincosf. With cfg.yarn.on the
///   frequencies are rope_math::yarn_inv_freq and cos/sin are multiplied by
///   rope_math::yarn_concentration (fp32) before the rotation.
///   Non-interleaved (Llama's rotate_half): channels (i, i + rotary_dim/2);
///   interleaved: channels (2i, 2i + 1). For the pair (x1, x2):
///   x1' = x1·cos − x2·sin,  x2' = x2·cos + x1·sin.
/// (Megatron-Core and HF round cos/sin to the activation dtype and compute in it; here the whole
/// rotation is fp32 with a single rounding.)
/// Errors: mt::Error when qkv is not a contiguous float [s, b, g, qpg + 2, d] tensor (or not fp32
/// on the CPU), qpg < 1, rotary_dim odd, < 2 or > d, base <= 0, positions neither empty nor a
/// contiguous int32 [s, b] tensor on qkv's device, or the stream on another device type; YaRN with
/// a scaling factor or original positions <= 0 or beta_fast <= beta_slow.
void rope_forward(const Tensor& qkv, const Tensor& positions, const RopeConfig& cfg, const Stream& stream);

/// Backward of rope_forward, in place on dqkv (same layout as qkv): the gradient of a rotation
/// is the rotation by the negative angle, x1' = x1·cos + x2·sin, x2' = x2·cos − x1·sin, applied
/// to the query and key heads; value heads and pass-through channels are not touched (their
/// gradient passes through unchanged). Errors: as rope_forward.
void rope_backward(const Tensor& dqkv, const Tensor& positions, const RopeConfig& cfg, const Stream& stream);

MT_OP_BACKENDS(rope_forward)
MT_OP_BACKENDS(rope_backward)

}  // namespace mt
