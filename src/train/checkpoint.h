// Checkpoints in Megatron's directory convention (<save>/iter_0000100/, with
// <save>/latest_checkpointed_iteration.txt written last) holding our own sharded format
// (docs/checkpoints.md): metadata.json lists every tensor's name, dtype, global shape and each
// rank's shard (file, byte offset, local shape, global offsets); one binary file per rank
// (rank_00000.bin) holds the raw little-endian shards. An iteration directory is written under
// a temporary name and renamed, so an interrupted save never leaves a partial checkpoint.
//
// Saved: fp32 main parameters ("model/<name>"), AdamW moments ("optim/exp_avg/<name>",
// "optim/exp_avg_sq/<name>"), the optimizer/loss-scaler scalars, iteration, consumed samples
// (data position) and the seed (the RNG is counter-based, so iteration + seed is its position).
// State sharded by the distributed optimizer (moments, and the fp32 main parameters of a
// bf16/fp16 model) is all-gathered over DP into temporary full-length device buffers at save
// time and scattered back at load time, so the files do not depend on DP or on
// --use-distributed-optimizer. Parameters flagged shared_embedding_copy are not written; on
// load they are filled from the saved parameter of the same name.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "comm/communicator.h"

#include "model/transformer_config.h"
#include "model/params.h"
#include "optim/optimizer.h"

namespace mt {

struct CheckpointState {
  bool has_optimizer = false;  ///< optimizer moments and scalars were saved (not by import-hf)
  int64_t iteration = 0;
  int64_t consumed_train_samples = 0;
  uint64_t seed = 0;
  TransformerConfig model;
  OptimizerScalars scalars{};
};

/// Who writes what: each model-parallel rank (TP rank t of pipeline stage p) of data-parallel
/// rank 0 writes its own shards to rank_<p·tp + t>.bin (the last stage's copy of the tied
/// embedding is not written: the first stage's is the parameter); world rank 0 writes
/// metadata.json, describing the shards of every model-parallel rank (specs_of(t, p) = the
/// parameter specs of TP rank t on pipeline rank p), renames the directory and updates the
/// tracker. Collective over `world` (a size-1 group when training on one device).
struct CheckpointWriter {
  std::shared_ptr<Communicator> world;
  int tp = 1, tp_rank = 0, dp_rank = 0;
  std::function<std::vector<ParamSpec>(int tp_rank, int pp_rank)> specs_of;
  int pp = 1, pp_rank = 0;
};

/// Writes <dir>/iter_%07d/ and updates the tracker file. Collective over the data-parallel group
/// as well when the optimizer is sharded (every DP rank must call it). Errors: mt::Error naming
/// the path when the directory cannot be created or written.
void save_checkpoint(const std::string& dir, const CheckpointState& state, const ParamStore& params,
                     const AdamWOptimizer* optimizer, const CheckpointWriter& writer, const Stream& stream);

/// Iteration named by <dir>/latest_checkpointed_iteration.txt, or nullopt when the file is
/// absent. Errors on an unreadable or malformed tracker.
std::optional<int64_t> latest_checkpoint_iteration(const std::string& dir);

/// Reads metadata of the latest checkpoint in `dir` (model config, iteration, ...). Errors when
/// there is none ("--load points at nothing") or the metadata is corrupt.
CheckpointState read_checkpoint_state(const std::string& dir);

/// Loads parameters (and, when optimizer != nullptr, moments and scalars) of the latest
/// checkpoint into `params`, whatever tensor/pipeline-parallel layout wrote it: each local shard is
/// assembled from the intersecting saved shards (global shapes are checked, a mismatch names
/// the tensor and both shapes; a region no saved shard covers is an error). Returns the state.
CheckpointState load_checkpoint(const std::string& dir, ParamStore& params, AdamWOptimizer* optimizer,
                                const Stream& stream);

}  // namespace mt
