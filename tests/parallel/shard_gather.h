// Test helper: assembling global tensors from the shards of many ranks (TP shards, pipeline
// stages, the distributed optimizer's owned ranges).
#pragma once
#include <algorithm>
#include <vector>

#include "model/params.h"

namespace mt::testing {

/// Places a rank's shard `local` of parameter `info` into the global tensor (2-D [R, C] or 1-D as
/// one row); only the local elements whose flat-buffer position lies in one of `owned` (the
/// distributed optimizer's owned ranges; nullptr = all).
inline void place(std::vector<float>& global, const ParamInfo& info, const std::vector<float>& local,
                  const std::vector<ParamStore::Range>* owned = nullptr) {
  const int64_t rows = info.shape.size() == 2 ? info.shape[0] : 1;
  const int64_t cols = info.numel / rows;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t flat = info.offset + r * cols + c;
      if (owned && std::none_of(owned->begin(), owned->end(),
                                [&](const ParamStore::Range& o) { return flat >= o.begin && flat < o.end; }))
        continue;
      global[(info.shard.row_offset + r) * info.shard.global_cols + info.shard.col_offset + c] = local[r * cols + c];
    }
}

}  // namespace mt::testing
