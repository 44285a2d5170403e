#include "core/rng.h"
#include "ops/init.h"

namespace mt::cpu {

void init_normal(const Tensor& t, float std, uint64_t seed, uint32_t tensor_id, const ShardBox& box, const Stream&,
                 const uint64_t* iteration_ptr) {
  if (iteration_ptr) seed ^= *iteration_ptr << 20;
  float* p = t.data_as<float>();
  const int64_t n = t.numel();
#pragma omp parallel for schedule(static)
  for (int64_t e = 0; e < n; ++e)
    p[e] = std * philox_normal(seed, tensor_id, static_cast<uint64_t>(box.global_index(e)));
}

}  // namespace mt::cpu
