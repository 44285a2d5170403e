#include "core/rng.h"
#include "ops/init_impl.h"

namespace mt::cpu {

void init_normal(const Tensor& t, int64_t rows, int64_t cols, float std, uint64_t seed, uint32_t tensor_id,
                 const ShardOffset& shard, const Stream&) {
  float* p = t.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      uint64_t g = static_cast<uint64_t>((shard.row_offset + r) * shard.global_cols + shard.col_offset + c);
      p[r * cols + c] = std * philox_normal(seed, tensor_id, g);
    }
  }
}

}  // namespace mt::cpu
