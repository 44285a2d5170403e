// Layout-invariant parameter initialisation (docs/architecture.md principle 4): element e of a rank's shard
// is N(0, std) drawn from Philox keyed by (seed, tensor id) at the element's global flat index in
// the unsharded tensor (ShardBox::global_index), so every TP/PP/EP layout produces the same global
// weights without materialising them anywhere.
#pragma once
#include <cstdint>
#include <vector>

#include "core/dtype.h"  // MT_HD
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// Where a rank's shard sits in the global (unsharded) tensor: the row-major box
/// [offset, offset + shape) of a tensor of global_shape. The shard's elements are stored
/// contiguously in the box's row-major order (whatever shape the layer views them with, e.g. the
/// SwiGLU fc1 weight: global [2, f, h], shard box [2, f/tp, h], viewed as [2f/tp, h]).
struct ShardBox {
  static constexpr int kMaxDims = 4;
  int ndim = 0;
  int64_t global_shape[kMaxDims] = {};
  int64_t offset[kMaxDims] = {};
  int64_t shape[kMaxDims] = {};

  /// An unsharded tensor of the given shape. Errors: mt::Error for more than kMaxDims dims.
  static ShardBox whole(const std::vector<int64_t>& shape);
  /// Errors: mt::Error when the ranks differ, exceed kMaxDims, or the box leaves the tensor.
  static ShardBox make(const std::vector<int64_t>& global_shape, const std::vector<int64_t>& offset,
                       const std::vector<int64_t>& shape);
  int64_t numel() const;
  /// Global row-major flat index of the shard's local element `e` (0 <= e < numel()).
  MT_HD int64_t global_index(int64_t e) const {
    int64_t g = 0, stride = 1;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t c = e % shape[d];
      e /= shape[d];
      g += (offset[d] + c) * stride;
      stride *= global_shape[d];
    }
    return g;
  }
};

/// t (fp32, contiguous, box.numel() elements) = std * philox_normal(seed', tensor_id,
/// box.global_index(e)) for each local element e, with seed' = seed, or, when iteration_ptr (a
/// uint64 in the tensor's device memory) is given, seed' = seed ^ (*iteration_ptr << 20) read when
/// the kernel runs (a per-step key that a CUDA graph replays correctly; core/rng.h's
/// dropout_iteration). Errors: mt::Error for a non-fp32 or non-contiguous t, an element count
/// that differs from the box, or a stream on another device.
void init_normal(const Tensor& t, float std, uint64_t seed, uint32_t tensor_id, const ShardBox& box,
                 const Stream& stream, const uint64_t* iteration_ptr = nullptr);

MT_OP_BACKENDS(init_normal)

}  // namespace mt
