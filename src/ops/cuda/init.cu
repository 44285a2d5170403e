#include "core/cuda_check.h"
#include "core/rng.h"
#include "ops/init_impl.h"

namespace mt::cuda {

namespace {
__global__ void init_normal_kernel(float* p, int64_t rows, int64_t cols, float std, uint64_t seed, uint32_t id,
                                   int64_t row_off, int64_t col_off, int64_t gcols) {
  int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t r = i / cols, c = i % cols;
    uint64_t g = static_cast<uint64_t>((row_off + r) * gcols + col_off + c);
    p[i] = std * philox_normal(seed, id, g);
  }
}
}  // namespace

void init_normal(const Tensor& t, int64_t rows, int64_t cols, float std, uint64_t seed, uint32_t tensor_id,
                 const ShardOffset& shard, const Stream& stream) {
  int64_t n = rows * cols;
  int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 65536));
  init_normal_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream.cuda_stream())>>>(
      t.data_as<float>(), rows, cols, std, seed, tensor_id, shard.row_offset, shard.col_offset, shard.global_cols);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
