// Host-side staging of one training iteration's batch (the data half of Megatron's get_batch,
// megatron/training/utils.py get_batch_on_this_tp_rank / get_batch_on_this_cp_rank). A loader
// thread fetches the samples of the next iteration and builds Megatron's ltor tensors
// (get_ltor_masks_and_position_ids) into one of two pinned host buffers while the device runs the
// current one; stage() then issues one host-to-device copy. Per micro-batch the device buffer
// holds, each s/cp·b values of 4 bytes: tokens [s/cp, b], labels [s/cp, b], loss_mask fp32
// [s/cp, b], position_ids [s/cp, b], doc_start [b, s/cp]. Data-parallel rank d of DP takes, of
// micro-batch step m, the samples [first + (m·DP + d)·b, first + (m·DP + d + 1)·b) (Megatron's
// MegatronPretrainingSampler).
#pragma once
#include <cstdint>
#include <future>
#include <memory>
#include <vector>

#include "core/buffer.h"
#include "core/stream.h"
#include "data/masks.h"
#include "data/sample_source.h"
#include "model/module.h"

namespace mt {

class BatchStager {
 public:
  struct Options {
    // num_micro: the most micro-batches of an iteration (buffers); seq: the whole sequence
    int64_t num_micro, micro, seq, dp, dp_rank, vocab;
    data::LtorOptions ltor;
    int cp, cp_rank;  // context parallelism: this rank stages its seq / cp tokens
    bool positions, doc_start;  // pass position_ids / doc_start to the model
    /// --calculate-per-token-loss: every unmasked token of the global batch (all micro-batches,
    /// all DP ranks) weighs 1 / their count, instead of 1 / (its micro-batch's count) per
    /// micro-batch mean (Megatron's default). Reads the whole global batch's samples on every rank.
    bool per_token_loss = false;
  };
  /// Bytes of the staged micro-batches on the device (5 int32/fp32 [s/cp, b] tensors each).
  static size_t device_bytes(int64_t num_micro, int64_t micro, int64_t seq, int cp) {
    return static_cast<size_t>(num_micro * 5 * (seq / cp) * micro) * 4;
  }
  /// Allocates the device buffer and the two pinned host buffers.
  BatchStager(const Options& o, Device device);
  ~BatchStager();
  BatchStager(const BatchStager&) = delete;
  BatchStager& operator=(const BatchStager&) = delete;

  /// A batch: its first global sample and its micro-batches per data-parallel rank (1 ..
  /// Options::num_micro; fewer during a batch-size ramp-up).
  struct Batch {
    int64_t first = -1, num_micro = 0;
  };
  /// Copies `batch` to the device (prepared by the loader thread when the previous stage()
  /// prefetched it, else now) and prefetches `next` (first -1: nothing). Errors: mt::Error for a
  /// token id outside the vocabulary (naming the sample), a micro-batch count out of range, and
  /// the data source's errors (rethrown from the loader thread).
  void stage(const data::SampleSource& src, Batch batch, Batch next, const Stream& stream);
  /// Micro-batch m of the staged batch (views of the device buffer, valid until the next stage()).
  /// Its loss weight is 1 / (the staged batch's micro-batches · dp).
  MicroBatch micro_batch(int64_t m) const;
  /// All micro-batches of the staged batch.
  std::vector<MicroBatch> micro_batches() const;

 private:
  size_t bytes(int64_t num_micro) const { return device_bytes(num_micro, o_.micro, o_.seq, o_.cp); }
  void wait_free(int k);
  void fill(const data::SampleSource& src, Batch batch, int k);

  Options o_;
  Device device_;
  Buffer host_[2];
  Buffer dev_;
  std::unique_ptr<Event> copied_[2];
  bool used_[2] = {false, false};
  int last_ = -1;
  std::future<int> pending_;
  Batch pending_batch_;
  int64_t staged_micro_ = 0;  // micro-batches of the staged batch
  const data::SampleSource* pending_src_ = nullptr;
};

}  // namespace mt
