// The attention-probability dropout mask shared by the CPU and CUDA attention implementations (so
// that both draw bit-identical masks; ops/attention.h defines the mask).
#pragma once
#include "core/rng.h"
#include "ops/attention.h"

namespace mt {
namespace cuda {
void attention_forward(const Tensor& out, const Tensor& qkv, const AttentionBuffers& buf, const AttentionConfig& cfg,
                       const Stream& stream);
void attention_backward(const Tensor& dqkv, const Tensor& dout, const AttentionBuffers& buf,
                        const AttentionConfig& cfg, const Stream& stream);
}  // namespace cuda

/// The attention-probability dropout of one call, resolved once on the host (trivially
/// copyable, passed by value to kernels).
struct AttnDropout {
  uint64_t seed = 0;
  uint64_t iteration = 0;
  const uint64_t* iteration_ptr = nullptr;  ///< DropoutKey::iteration_ptr (read when the kernel runs)
  uint32_t microbatch = 0;
  const uint32_t* microbatch_ptr = nullptr;  ///< DropoutKey::microbatch_ptr (read when the kernel runs)
  uint32_t stream_id = 0;
  uint32_t threshold = 0;  ///< dropout_threshold(p): keep iff draw >= threshold
  float inv_keep = 1.f;    ///< 1 / (1 - p)
  bool enabled = false;    ///< p > 0
  int64_t heads = 0;       ///< n (local)
  int64_t total_heads = 0;
  int64_t head_offset = 0;
  int64_t seq = 0;

  /// Global flat index of element (bn = b·heads + head, i, j = 0): the mask key of
  /// ops/attention.h, ((b·total_heads + head_offset + head)·s + i)·s.
  MT_HD uint64_t row_start(int64_t bn, int64_t i) const {
    const int64_t b = bn / heads, h = bn - b * heads;
    return static_cast<uint64_t>(((b * total_heads + head_offset + h) * seq + i) * seq);
  }
  /// Four consecutive draws for global elements 4·group .. 4·group + 3.
  MT_HD Philox4 bits4(uint64_t group) const {
    return dropout_bits4(seed, stream_id, dropout_iteration(iteration_ptr, iteration),
                         dropout_microbatch(microbatch_ptr, microbatch), group);
  }
  /// Keep decision of global element g.
  MT_HD bool keep(uint64_t g) const {
    const Philox4 r = bits4(g >> 2);
    const uint32_t e = static_cast<uint32_t>(g & 3u);
    const uint32_t v = e == 0 ? r.v[0] : e == 1 ? r.v[1] : e == 2 ? r.v[2] : r.v[3];
    return v >= threshold;
  }
};

/// The mask parameters of attention-probability dropout with `key` and probability p over local
/// heads `heads` of `total_heads` (0: the same), the first at `head_offset`, sequence length seq
/// (shared by the local, flash and context-parallel attention).
inline AttnDropout make_attn_dropout(const DropoutKey& key, float p, int64_t heads, int64_t total_heads,
                                     int64_t head_offset, int64_t seq) {
  AttnDropout d;
  d.seed = key.seed;
  d.iteration = key.iteration;
  d.iteration_ptr = key.iteration_ptr;
  d.microbatch = key.microbatch;
  d.microbatch_ptr = key.microbatch_ptr;
  d.stream_id = key.stream_id;
  d.enabled = p > 0.f;
  d.threshold = d.enabled ? dropout_threshold(p) : 0u;
  d.inv_keep = d.enabled ? 1.f / (1.f - p) : 1.f;
  d.heads = heads;
  d.total_heads = total_heads > 0 ? total_heads : heads;
  d.head_offset = head_offset;
  d.seq = seq;
  return d;
}

inline AttnDropout make_attn_dropout(const AttentionConfig& cfg) {
  return make_attn_dropout(cfg.dropout_key, cfg.dropout_p, cfg.heads, cfg.total_heads, cfg.head_offset, cfg.seq);
}

}  // namespace mt
