// fp8_gelu_backward (ops/fp8_fused.h) with its bias gradient summed in chunks of at most
// `chunk_tiles` 128-row tiles: what the op does when the tiles' partial rows exceed the stream's
// workspace (rows x f above ~1G elements), at sizes a test can afford. Each chunk's partial rows are
// added to dbias in turn (add_column_partials), so the bias gradient's summation order changes with
// the chunking; dx, dq, dq_t and the amax record do not. CUDA tensors only. Errors: as
// fp8_gelu_backward (the caller validates), mt::Error for chunk_tiles < 1.
#pragma once
#include <cstdint>

#include "core/stream.h"
#include "core/tensor.h"

namespace mt::cuda {

void fp8_gelu_backward_in_chunks(const Tensor& dx, const Tensor& dq, const Tensor& dq_t, const Tensor& dbias,
                                 const Tensor& dy, const Tensor& pre, const Tensor& scale, const Tensor& amax,
                                 int64_t chunk_tiles, const Stream& stream);

}  // namespace mt::cuda
