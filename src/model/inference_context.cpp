#include "model/inference_context.h"

#include <algorithm>

#include "core/check.h"

namespace mt {

KvCache::KvCache(const TransformerConfig& c, int tp, const std::vector<pipeline::LayerRange>& chunks,
                 int64_t max_batch, int64_t max_sequence_length, DType dtype, Device device)
    : max_batch_(max_batch), max_seq_(max_sequence_length) {
  MT_REQUIRE(max_batch >= 1 && max_sequence_length >= 1,
             "key/value cache: batch {} and sequence length {} must be >= 1", max_batch, max_sequence_length);
  MT_REQUIRE(tp >= 1 && c.query_groups() % tp == 0, "key/value cache: {} query groups not divisible by tp={}",
             c.query_groups(), tp);
  const int64_t g = c.query_groups() / tp, d = c.head_dim();
  const bool mla = c.multi_latent_attention;
  const size_t per = static_cast<size_t>(max_batch * max_seq_) * bytes_per_token(c, tp, dtype) / (mla ? 1 : 2);
  const size_t kv_bytes = static_cast<size_t>(max_batch * g * max_seq_ * d) * dtype_size(dtype);  // MLA: expanded
  const size_t up_bytes =
      static_cast<size_t>(max_seq_ * max_batch * g * (c.qk_head_dim + c.v_head_dim)) * dtype_size(dtype);
  int64_t n = 0;
  for (const auto& r : chunks) n += r.end - r.begin;
  const size_t total = mla ? per * static_cast<size_t>(n) + 2 * kv_bytes + up_bytes : per * 2 * static_cast<size_t>(n);
  try {
    buffer_ = Buffer(device, std::max<size_t>(total, 1));
  } catch (const Error& e) {
    MT_FAIL("key/value cache of {:.1f} MiB ({} layers, batch {}, {} positions) does not fit: {}",
            total / 1048576.0, n, max_batch, max_seq_, e.what());
  }
  size_t off = 0;
  char* base = static_cast<char*>(buffer_.data());
  if (mla) {
    const size_t ckv_bytes = static_cast<size_t>(max_seq_ * max_batch * c.kv_lora_rank) * dtype_size(dtype);
    for (const auto& r : chunks)
      for (int64_t l = r.begin; l < r.end; ++l) {
        Layer& L = layers_[l];
        L.ckv = Tensor(base + off, dtype, device, {max_seq_, max_batch, c.kv_lora_rank});
        L.kpe = Tensor(base + off + ckv_bytes, dtype, device, {max_seq_, max_batch, c.qk_pos_emb_head_dim});
        off += per;
      }
    mla_.key = Tensor(base + off, dtype, device, {max_batch, g, max_seq_, d});
    mla_.value = Tensor(base + off + kv_bytes, dtype, device, {max_batch, g, max_seq_, d});
    mla_.kv_up = Tensor(base + off + 2 * kv_bytes, dtype, device, {max_seq_, max_batch, g * (c.qk_head_dim + c.v_head_dim)});
    return;
  }
  for (const auto& r : chunks)
    for (int64_t l = r.begin; l < r.end; ++l) {
      Layer& L = layers_[l];
      L.key = Tensor(base + off, dtype, device, {max_batch, g, max_seq_, d});
      L.value = Tensor(base + off + per, dtype, device, {max_batch, g, max_seq_, d});
      off += 2 * per;
    }
}

size_t KvCache::bytes_per_token(const TransformerConfig& c, int tp, DType dtype) {
  if (c.multi_latent_attention) return static_cast<size_t>(c.kv_lora_rank + c.qk_pos_emb_head_dim) * dtype_size(dtype);
  return static_cast<size_t>(2 * (c.query_groups() / tp) * c.head_dim()) * dtype_size(dtype);
}

const KvCache::Layer& KvCache::layer(int64_t layer) const {
  const auto it = layers_.find(layer);
  MT_REQUIRE(it != layers_.end(), "key/value cache: layer {} is not on this rank", layer);
  return it->second;
}

}  // namespace mt
