// Argument validation and backend dispatch for ops/init.h; ShardBox construction.
#include "ops/init.h"

#include <fmt/ranges.h>

namespace mt {

ShardBox ShardBox::whole(const std::vector<int64_t>& shape) { return make(shape, {}, shape); }

ShardBox ShardBox::make(const std::vector<int64_t>& global_shape, const std::vector<int64_t>& offset,
                        const std::vector<int64_t>& shape) {
  const size_t n = global_shape.size();
  MT_CHECK(n <= static_cast<size_t>(kMaxDims), "shard of a tensor of shape [{}]: at most {} dimensions",
           fmt::join(global_shape, ", "), kMaxDims);
  MT_CHECK(shape.size() == n && (offset.empty() || offset.size() == n),
           "shard box [{}] at [{}] does not have the rank of the global shape [{}]", fmt::join(shape, ", "),
           fmt::join(offset, ", "), fmt::join(global_shape, ", "));
  ShardBox b;
  b.ndim = static_cast<int>(n);
  for (size_t d = 0; d < n; ++d) {
    b.global_shape[d] = global_shape[d];
    b.offset[d] = offset.empty() ? 0 : offset[d];
    b.shape[d] = shape[d];
    MT_CHECK(b.offset[d] >= 0 && b.shape[d] >= 0 && b.offset[d] + b.shape[d] <= b.global_shape[d],
             "shard box [{}] at [{}] leaves the global shape [{}] in dimension {}", fmt::join(shape, ", "),
             fmt::join(offset, ", "), fmt::join(global_shape, ", "), d);
  }
  return b;
}

int64_t ShardBox::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

void init_normal(const Tensor& t, float std, uint64_t seed, uint32_t tensor_id, const ShardBox& box,
                 const Stream& stream, const uint64_t* iteration_ptr) {
  MT_CHECK(t.dtype() == DType::kF32 && t.is_contiguous(), "init_normal needs a contiguous fp32 tensor, got {}",
           t.str());
  MT_CHECK(t.device() == stream.device(), "init_normal: tensor on {} but stream on {}", t.device().str(),
           stream.device().str());
  MT_CHECK(t.numel() == box.numel(), "init_normal: tensor {} has {} elements but its shard box {}", t.str(),
           t.numel(), box.numel());
  if (t.numel() == 0) return;
  MT_DISPATCH(t.device(), init_normal, t, std, seed, tensor_id, box, stream, iteration_ptr);
}

}  // namespace mt
