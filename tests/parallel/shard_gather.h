// Test helper: assembling global tensors from the shards of many ranks (TP shards, pipeline
// stages, the distributed optimizer's owned ranges).
#pragma once
#include <algorithm>
#include <vector>

#include "model/params.h"

namespace mt::testing {

/// Places a rank's shard `local` of parameter `info` into the global tensor (row-major, at the
/// shard box's global indices); only the local elements whose flat-buffer position lies in one of
/// `owned` (the distributed optimizer's owned ranges; nullptr = all).
inline void place(std::vector<float>& global, const ParamInfo& info, const std::vector<float>& local,
                  const std::vector<ParamStore::Range>* owned = nullptr) {
  for (int64_t e = 0; e < info.numel; ++e) {
    const int64_t flat = info.offset + e;
    if (owned && std::none_of(owned->begin(), owned->end(),
                              [&](const ParamStore::Range& o) { return flat >= o.begin && flat < o.end; }))
      continue;
    global[info.box.global_index(e)] = local[e];
  }
}

}  // namespace mt::testing
