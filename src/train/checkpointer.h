// When and how `megatron pretrain` saves (Megatron's save_checkpoint_and_time): every
// --save-interval, at --train-iters and when the run exits early; synchronously
// (save_checkpoint) or with --async-save in the background (AsyncCheckpointSaver: a snapshot
// copied into pinned host memory, whose device-to-host copy the next step waits for on the device
// before its first update; the files written by a thread). train/checkpoint.h has the format.
#pragma once
#include <cstdint>

#include "train/checkpoint.h"
#include "train/training_setup.h"

namespace mt {

class Checkpointer {
 public:
  /// With --async-save, allocates the snapshot's pinned host memory (and copy stream) now, not
  /// inside the first save's step.
  explicit Checkpointer(TrainingSetup& setup);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  /// A checkpoint is due after `iteration` steps: --save given and an --save-interval multiple,
  /// the last iteration, or `exiting`.
  bool due(int64_t iteration, bool exiting) const;
  /// Saves iteration `iteration` with `consumed` samples (model, optimizer unless --no-save-optim,
  /// the model's persistent state). Collective over the world. Errors: mt::Error from the writer.
  void save(int64_t iteration, int64_t consumed);
  /// The snapshot copy of the last --async-save that the next step must wait for before its
  /// update (nullptr: none); handed out once.
  const Event* take_snapshot_pending();
  /// Waits for the save in flight (--async-save: the last checkpoint is complete, and published by
  /// rank 0, before exit) and logs its throughput.
  void finish(int64_t iteration);

 private:
  TrainingSetup& setup_;
  CheckpointWriter writer_;
  AsyncCheckpointSaver async_saver_;
  const Event* snapshot_pending_ = nullptr;
};

}  // namespace mt
