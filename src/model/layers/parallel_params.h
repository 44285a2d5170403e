// Parameter declarations of the tensor-parallel layers (Megatron-Core tensor_parallel/layers.py):
// local shapes, shard boxes in the global tensor and the flags the optimizer, the gradient
// synchronisation and checkpoints read (model/params.h). Weights are [out, in] as in Megatron.
#pragma once
#include <string>
#include <vector>

#include "model/params.h"

namespace mt {

/// ColumnParallelLinear / VocabParallelEmbedding weight: global [parts, out, in] rows split, rank r
/// holding rows [r·out/tp, (r+1)·out/tp) of each of the `parts` blocks; local [parts·out/tp, in].
/// parts = 1 is the plain [out, in] matrix; parts = 2 is a gated (SwiGLU) fc1, whose global
/// tensor is [gate; up] as in a one-rank checkpoint. Errors: out not divisible by tp.
ParamSpec column_parallel_weight(std::string name, int64_t out, int64_t in, float init_std, int tp, int rank,
                                 int64_t parts = 1);
/// The bias [parts·out] of a ColumnParallelLinear, split like its weight's rows; zeros.
ParamSpec column_parallel_bias(std::string name, int64_t out, int tp, int rank, int64_t parts = 1);
/// RowParallelLinear weight: global [out, in], columns split; local [out, in/tp].
ParamSpec row_parallel_weight(std::string name, int64_t out, int64_t in, float init_std, int tp, int rank);
/// A parameter replicated on every TP rank (norm weights and biases, the bias of a row-parallel
/// layer, learned position embeddings). weight_decay only for matrices (Megatron: no decay for
/// biases and 1-D parameters).
ParamSpec replicated_param(std::string name, std::vector<int64_t> shape, InitKind init, float init_std,
                           TpGradSum grad_sum);

}  // namespace mt
