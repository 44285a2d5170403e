// Layout-invariant parameter initialisation (DESIGN.md principle 4): element (r, c) of a
// rank's shard is N(0, std) drawn from Philox keyed by (seed, tensor id) at the element's
// global flat index (row_offset + r) * global_cols + (col_offset + c), so every TP/PP layout
// produces the same global weights without materialising them anywhere.
#pragma once
#include <cstdint>

#include "core/stream.h"
#include "core/tensor.h"

namespace mt {

struct ShardOffset {
  int64_t row_offset = 0;   ///< first global row of this shard
  int64_t col_offset = 0;   ///< first global column of this shard
  int64_t global_cols = 0;  ///< columns of the global tensor (0 = local columns)
};

/// t (fp32, viewed as [rows, cols] = [size(0), numel/size(0)]; 1-D tensors are one row) =
/// std * philox_normal(seed, tensor_id, global index).
void init_normal(const Tensor& t, float std, uint64_t seed, uint32_t tensor_id, const ShardOffset& shard,
                 const Stream& stream);

}  // namespace mt
