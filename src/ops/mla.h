// The tensor plumbing of multi-latent attention (DeepSeek-V2 §2.1, arXiv:2405.04434; Megatron-Core
// transformer/multi_latent_attention.py): the up-projected queries, keys and values packed into the
// fused QKV layout the core attention ops read (ops/attention.h, ops/flash_attention.h,
// ops/context_attention.h), and the context unpacked for the output projection.
//
// Shapes: T tokens ([s, b] flattened), n heads (this TP rank's), d_n = --qk-head-dim, d_r =
// --qk-pos-emb-head-dim, d_v = --v-head-dim, D >= max(d_n + d_r, d_v) the core attention's head
// dim. In the packed layout the rotated channels come FIRST, so that rope_forward (ops/rope.h,
// rotary_dim = d_r) rotates them, and the zero channels last:
//   query = [q_pe (d_r), q_nope (d_n), 0...],  key = [k_pe (d_r), k_nope (d_n), 0...],
//   value = [v (d_v), 0...]
// The scores q·k are those of Megatron's [q_nope, q_pe]·[k_nope, k_pe] (a permutation of the
// channels shared by q and k); the zero channels add nothing to scores and give zero context
// channels, which mla_context_unpack drops. k_pe is shared by the n heads of a token.
//
// Dtypes: the act dtype (fp32 on CPU; fp32, bf16 or fp16 on CUDA), all tensors the same;
// contiguous. The backward's head sum of dk_pe is in fp32, in head order, rounded once.
#pragma once
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// qkv [T, n, 3, D] (overwrite) from q [T, n, d_n + d_r] (Megatron's q_nope | q_pe), kv [T, n, d_n + d_v]
/// (k_nope | v) and k_pe [T, d_r]; d_r = k_pe's last dim. Leading dims may be any shape with T
/// elements ([s, b]). Errors: mt::Error for shapes that disagree, D < d_n + d_r or D < d_v, dtypes
/// or devices that differ, non-contiguous tensors.
void mla_qkv_pack(const Tensor& qkv, const Tensor& q, const Tensor& kv, const Tensor& k_pe, const Stream& stream);
/// The backward of mla_qkv_pack: dq, dkv (overwrite) from dqkv; dk_pe [T, d_r] (overwrite) = Σ
/// over the n heads of the key heads' d_r channels. Gradients of the zero channels are dropped.
void mla_qkv_unpack_grad(const Tensor& dq, const Tensor& dkv, const Tensor& dk_pe, const Tensor& dqkv,
                         const Stream& stream);
/// out [T, n·d_v] (overwrite) = the first d_v channels of each head of context [T, n·D]; with
/// `pad` the reverse (context's gradient from out's, zeros in channels >= d_v): context [T, n·D]
/// (overwrite) from out [T, n·d_v]. Errors: mt::Error as above, d_v > D.
void mla_context_unpack(const Tensor& out, const Tensor& context, int64_t heads, bool pad, const Stream& stream);

/// Generation with the latent cache (model/inference_context.h): the new tokens' latents appended
/// at rows [offset, offset + s) of samples [0, b) of the cache: ckv_cache [S_max, B, r_kv] <- c_kv
/// [s, b, r_kv] (kv_layernorm's output), kpe_cache [S_max, B, d_r] <- the rotated k_pe of qkv
/// [s, b, n, 3, D] (channels [0, d_r) of the key of head 0; every head holds the same).
/// Errors: mt::Error for shapes that disagree, b > B, offset + s > S_max.
void mla_latent_append(const Tensor& ckv_cache, const Tensor& kpe_cache, const Tensor& c_kv, const Tensor& qkv,
                       int64_t offset, const Stream& stream);
/// The keys and values of positions [0, count) rebuilt from the cache, in the key/value-cache
/// layout of ops/kv_cache_attention.h, packed as mla_qkv_pack packs them: key, value [b, n, S_max,
/// D] (positions >= count untouched) from kv_up [P, B, n, d_n + d_v] (linear_kv_up_proj of the
/// cached c_kv rows, P >= count; d_n = qk_head_dim) and kpe_cache [S_max, B, d_r]. Errors: as
/// above, count > P, d_n + d_r > D or d_v > D.
void mla_latent_expand(const Tensor& key, const Tensor& value, const Tensor& kv_up, const Tensor& kpe_cache,
                       int64_t count, int64_t qk_head_dim, const Stream& stream);

MT_OP_BACKENDS(mla_qkv_pack)
MT_OP_BACKENDS(mla_qkv_unpack_grad)
MT_OP_BACKENDS(mla_context_unpack)
MT_OP_BACKENDS(mla_latent_append)
MT_OP_BACKENDS(mla_latent_expand)

}  // namespace mt
