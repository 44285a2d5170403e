#include "core/cuda_check.h"
#include "core/rng.h"
#include "ops/init.h"

namespace mt::cuda {

namespace {
__global__ void init_normal_kernel(float* p, int64_t n, float std, uint64_t seed, uint32_t id, ShardBox box,
                                   const uint64_t* iteration_ptr) {
  if (iteration_ptr) seed ^= *iteration_ptr << 20;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = std * philox_normal(seed, id, static_cast<uint64_t>(box.global_index(i)));
}
}  // namespace

void init_normal(const Tensor& t, float std, uint64_t seed, uint32_t tensor_id, const ShardBox& box,
                 const Stream& stream, const uint64_t* iteration_ptr) {
  const int64_t n = t.numel();
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 65536));
  init_normal_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream.cuda_stream())>>>(t.data_as<float>(), n, std,
                                                                                           seed, tensor_id, box, iteration_ptr);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
