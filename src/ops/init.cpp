#include "ops/init.h"

#include "ops/dispatch.h"
#include "ops/init_impl.h"

namespace mt {

void init_normal(const Tensor& t, float std, uint64_t seed, uint32_t tensor_id, const ShardOffset& shard,
                 const Stream& stream) {
  MT_CHECK(t.dtype() == DType::kF32 && t.is_contiguous(), "init_normal needs a contiguous fp32 tensor, got {}",
           t.str());
  MT_CHECK(t.device() == stream.device(), "init_normal: tensor on {} but stream on {}", t.device().str(),
           stream.device().str());
  int64_t rows = t.ndim() >= 2 ? t.size(0) : 1;
  int64_t cols = rows > 0 ? t.numel() / rows : 0;
  ShardOffset s = shard;
  if (s.global_cols == 0) s.global_cols = cols;
  MT_CHECK(s.col_offset + cols <= s.global_cols, "shard columns [{}, {}) exceed global columns {}", s.col_offset,
           s.col_offset + cols, s.global_cols);
  if (t.numel() == 0) return;
  MT_DISPATCH(t.device(), init_normal, t, rows, cols, std, seed, tensor_id, s, stream);
}

}  // namespace mt
