#pragma once
#include "ops/init.h"

namespace mt::cpu {
void init_normal(const Tensor& t, int64_t rows, int64_t cols, float std, uint64_t seed, uint32_t tensor_id,
                 const ShardOffset& shard, const Stream& stream);
}
namespace mt::cuda {
void init_normal(const Tensor& t, int64_t rows, int64_t cols, float std, uint64_t seed, uint32_t tensor_id,
                 const ShardOffset& shard, const Stream& stream);
}
