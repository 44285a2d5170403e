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
// load they are filled from the saved parameter of the same name. Model state that is not a
// parameter (CheckpointExtra, e.g. the MoE expert bias) is stored whole as "state/<name>".
#pragma once
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "core/stream.h"

#include "model/transformer_config.h"
#include "model/params.h"
#include "optim/optimizer.h"

namespace mt {

/// Named model state that is not a parameter, saved and restored beside the parameters
/// (LanguageModel::persistent_state: Megatron's persistent buffers, e.g.
/// ("decoder.layers.3.mlp.router.expert_bias", fp32 [E])). Each tensor is fp32, contiguous, of
/// 1 to 4 dimensions, on the model's device, and holds the whole (unsharded) value, identical on every
/// rank of a pipeline stage (replicated over TP, CP, DP and EP). Names are unique within a
/// checkpoint (include the global layer number); stored as "state/<name>".
using CheckpointExtra = std::vector<std::pair<std::string, Tensor>>;

struct CheckpointState {
  bool has_optimizer = false;  ///< optimizer moments and scalars were saved (not by import-hf)
  int64_t iteration = 0;
  int64_t consumed_train_samples = 0;
  uint64_t seed = 0;
  TransformerConfig model;
  OptimizerScalars scalars{};
};

/// Who writes what. The non-expert parameters are replicated over the data-parallel (× context-
/// parallel) group, whose rank 0 writes them: one copy per TP rank and pipeline stage (the last
/// stage's copy of the tied embedding is not written: the first stage's is the parameter). The
/// expert parameters (ParamSpec::expert, named by their global expert index) are replicated over
/// the expert-data-parallel group, whose rank 0 writes them: one copy per expert TP rank, EP rank
/// and stage. A rank that writes anything writes rank_<world rank>.bin and reports, with the
/// file's size and CRC-32C, the shards it holds (name, global shape, box, byte offset); world
/// rank 0 assembles metadata.json from these reports, renames the directory and updates the
/// tracker. Collective over `world` (a size-1 group when training on one device). The extra
/// state (CheckpointExtra) is written whole by one rank per pipeline stage: data-parallel rank 0
/// with tensor-parallel rank 0.
struct CheckpointWriter {
  std::shared_ptr<Communicator> world;
  int dp_rank = 0;   ///< rank in the data-parallel (× CP) group: 0 writes the non-expert parameters
  int tp_rank = 0;   ///< rank in the tensor-parallel group: 0 (with dp_rank 0) writes the extra state
  int edp_rank = 0;  ///< rank in the expert-data-parallel group: 0 writes the expert parameters
  bool save_optim = true;    ///< false: --no-save-optim (parameters only; has_optimizer = false)
  double timeout_s = 600;    ///< rank 0 waits this long for the other ranks' files (--distributed-timeout-minutes)
  /// The layout that wrote the checkpoint, recorded in metadata.json (informational: loading
  /// assembles every tensor by name and global coordinates whatever layout wrote it).
  int tp = 1, pp = 1, dp = 1, ep = 1, etp = 1;
};

/// Which checkpoint of a --load directory to read.
struct LoadOptions {
  /// --fallback-to-previous-checkpoint: when the tracker's iteration is incomplete or corrupt,
  /// load the newest earlier iteration directory whose files all verify (size and CRC-32C;
  /// this reads every file once more), with a warning naming what was skipped.
  bool fallback_to_previous = false;
  /// Load this iteration instead of the tracker's (e.g. the one read_checkpoint_state chose).
  std::optional<int64_t> iteration;
};

/// Writes <dir>/iter_%07d/ and updates the tracker file. Collective over `writer.world` (every
/// rank must call it). Nothing is published (the directory renamed into place, the tracker
/// updated) once the launcher of rank 0 has died (comm/launcher.h launcher_alive): the save fails
/// with an mt::Error saying so and its temporary directory is removed. Test hook:
/// MT_TEST_CHECKPOINT_PUBLISH_DELAY_MS=N makes rank 0 wait N ms, with a warning, just before it
/// publishes (so that a test's kill lands inside a save). Each writing rank fills rank_XXXXX.bin in <dir>/iter_%07d.tmp/, fsyncs
/// it and reports its size and CRC-32C; rank 0 then writes metadata.json (with those checksums
/// under "files"), renames the directory, and updates the tracker last (all through fsync'ed
/// temporary files and renames). Errors (on every rank): mt::Error naming the path and the
/// system's reason (e.g. "No space left on device") when a directory or file cannot be created
/// or written; the temporary directory is then removed and earlier checkpoints are untouched.
/// `extra`: this rank's model state beyond the parameters (CheckpointExtra; pass the same list on
/// every rank of a stage), written as "state/<name>" by the writer of CheckpointWriter. Errors: a
/// tensor that is not fp32 or not contiguous (mt::Error naming it).
void save_checkpoint(const std::string& dir, const CheckpointState& state, const ParamStore& params,
                     const AdamWOptimizer* optimizer, const CheckpointWriter& writer, const Stream& stream,
                     const CheckpointExtra& extra = {});

struct CheckpointSaveJob;
struct AsyncSnapshot;

/// --async-save: save() takes the snapshot at the step boundary (the collective part of
/// save_checkpoint: temporary directory, DP gathers, and a copy of this rank's shards, `extra`
/// included, into host memory) and returns; a background thread writes the file, and on rank 0
/// waits for the other ranks' files and publishes the checkpoint exactly as save_checkpoint does
/// (same bytes, same metadata). One save is in flight at a time: save() and wait() first wait for
/// the previous one. Errors of the background write are rethrown by the next save() or wait(); the
/// destructor waits and only logs them.
///
/// The snapshot's memory is allocated by the first save and reused (pinned host memory for this
/// rank's shards; with sharded state, the device temporaries of the gathered state). On a GPU the
/// device-to-host copies are issued on the saver's own stream after the work queued on `stream`
/// (the last optimizer step, the gathers) and save() does not wait for them: until
/// snapshot_copied() has completed, the caller must not change the parameters, the optimizer
/// state or `extra` — the next training step makes its stream wait for that event (on the
/// device, the host does not block) before its first update (StepOptions::wait_before_update,
/// train/train_step.h). The background thread waits for the event before it reads the host copy.
/// On the CPU the copy is made by save() itself (synchronously) and snapshot_copied() is null.
class AsyncCheckpointSaver {
 public:
  AsyncCheckpointSaver();
  ~AsyncCheckpointSaver();
  AsyncCheckpointSaver(const AsyncCheckpointSaver&) = delete;
  AsyncCheckpointSaver& operator=(const AsyncCheckpointSaver&) = delete;
  /// Allocates the snapshot's memory ahead of the first save (optional: save() allocates what is
  /// missing; the pinned host buffer takes a noticeable time to allocate, about 0.3 s per GB):
  /// the host buffer for this rank's shards, and on a GPU the copy stream, its events and, with
  /// sharded state, the device temporaries of the gathered state. Not collective. Same arguments
  /// as save().
  void allocate(const ParamStore& params, const AdamWOptimizer* optimizer, const CheckpointWriter& writer,
                const Stream& stream, const CheckpointExtra& extra = {});
  /// Collective over writer.world, like save_checkpoint (same `extra`).
  void save(const std::string& dir, const CheckpointState& state, const ParamStore& params,
            const AdamWOptimizer* optimizer, const CheckpointWriter& writer, const Stream& stream,
            const CheckpointExtra& extra = {});
  /// Waits for the save in flight (local: this rank's file, and on rank 0 the publication).
  void wait();
  bool in_flight() const { return thread_.joinable(); }
  /// The event that completes when the last save()'s device-to-host copies have run, to be waited
  /// for (Event::wait on the training stream) before the saved state is next modified; null when
  /// that save copied nothing asynchronously (CPU, or a rank that writes no file).
  const Event* snapshot_copied() const { return last_copy_; }
  /// Seconds the background part of the last completed save took (write, fsync, publication).
  double last_write_seconds() const { return last_write_seconds_; }
  /// Milliseconds the last completed save's device-to-host copies took on the GPU (from the end of
  /// the work they were ordered after to their end); -1 when there were none (CPU). When longer
  /// than the next step's forward and backward, that step's update waited for them.
  double last_copy_ms() const { return last_copy_ms_; }

 private:
  double last_write_seconds_ = 0;
  double last_copy_ms_ = -1;
  std::thread thread_;
  std::exception_ptr error_;
  std::unique_ptr<AsyncSnapshot> snap_;  // kept from one save to the next
  const Event* last_copy_ = nullptr;
};

/// One job per --save directory (docs/checkpoints.md "One job per --save directory"): an exclusive
/// flock(2) on <dir>/.megatron.lock, held for the object's life and released by the kernel when
/// the process ends however it ends. The lock file records its holder ("pid 1234 on host node7
/// since 2026-11-28 09:10:11 UTC"); it is never removed (removing it would let two processes lock
/// two different files of that name). Across nodes it holds where the file system honours flock:
/// local disks, NFS (Linux sends flock as NFS byte-range locks), Lustre mounted with -o flock,
/// GPFS. Move-only.
class SaveDirectoryLock {
 public:
  SaveDirectoryLock() = default;  ///< holds nothing
  SaveDirectoryLock(SaveDirectoryLock&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  SaveDirectoryLock& operator=(SaveDirectoryLock&& o) noexcept;
  ~SaveDirectoryLock();
  /// Creates `dir` when missing and takes its lock. Held by another process: retried for wait_s
  /// seconds (a job being killed may take a moment to end), then mt::Error naming the directory
  /// and the holder. A file system without locks (ENOLCK, EOPNOTSUPP, ENOSYS): a warning, and
  /// nothing is held. Errors: mt::Error when the directory or the lock file cannot be created.
  static SaveDirectoryLock acquire(const std::string& dir, double wait_s = 2.0);
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

/// The lock of `save` (nothing when it is empty) for a job of several ranks: rank 0 takes it, and
/// every rank learns whether it did before it goes on (the same mt::Error on every rank when not,
/// rank 0's naming the holder), so no rank reads the directory's checkpoints while another job
/// may still publish into it. Collective over `world`; the result is held for the job's life.
SaveDirectoryLock lock_save_directory(const std::string& save, Communicator& world, Device device);

/// Removes what interrupted saves left in `dir` (iter_XXXXXXX.tmp directories; an
/// iter_XXXXXXX.old beside a complete iter_XXXXXXX) and returns their names. An .old without its
/// iter_XXXXXXX (a replacement interrupted between its renames) is renamed back. Call on the
/// rank that saves (rank 0) before training, with no save in flight.
std::vector<std::string> clean_interrupted_saves(const std::string& dir);

/// Bytes of the files of <dir>/iter_%07d/ (0 when absent), for throughput logs.
uint64_t checkpoint_bytes(const std::string& dir, int64_t iteration);

/// Iteration named by <dir>/latest_checkpointed_iteration.txt, or nullopt when the file is
/// absent. Errors on an unreadable or malformed tracker.
std::optional<int64_t> latest_checkpoint_iteration(const std::string& dir);

/// Reads metadata of the latest checkpoint in `dir` (model config, iteration, ...) and checks
/// that its data files are all present with the sizes metadata.json records. Errors when there
/// is none ("--load points at nothing"), the metadata is corrupt, or a data file is missing or
/// truncated (naming the file). With opt.fallback_to_previous: see LoadOptions.
CheckpointState read_checkpoint_state(const std::string& dir, const LoadOptions& opt = {});

/// Loads parameters (and, when optimizer != nullptr, moments and scalars) of the latest
/// checkpoint into `params`, whatever tensor/pipeline/data/expert-parallel layout wrote it (expert
/// parameters are named by their global expert index, so each EP rank reads its own experts, and
/// their expert-TP shards are cut like any TP shard): each local shard is
/// assembled from the intersecting saved shards (global shapes are checked, a mismatch names
/// the tensor and both shapes; a region no saved shard covers is an error). Returns the state.
/// Every data file is verified (size and CRC-32C recorded in metadata.json) before its first
/// byte is used: a missing, truncated or corrupt file is an mt::Error naming it.
/// `extra` (CheckpointExtra): each tensor is overwritten in place with the saved "state/<name>"
/// (also for a weights-only load). One the checkpoint does not hold (written before this state
/// was stored, or without the option that creates it) keeps its current value, with one warning
/// naming every missing tensor; a saved global shape other than the tensor's is an mt::Error
/// naming the tensor and both shapes; a tensor that is not fp32 or not contiguous is an error.
CheckpointState load_checkpoint(const std::string& dir, ParamStore& params, AdamWOptimizer* optimizer,
                                const Stream& stream, const LoadOptions& opt = {}, const CheckpointExtra& extra = {});

}  // namespace mt
