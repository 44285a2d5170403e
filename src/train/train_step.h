// One training iteration, shared by `megatron pretrain` and the parallel-equivalence tests:
// zero the gradients (GradSync::zero_grad_buffer), run the pipeline schedule (forward and
// backward of every micro-batch; with pp = 1 simply one after the other; the model's last
// backward of each chunk reports finished gradients to its hooks, which may start their
// data-parallel reduction), reduce the tied embedding's gradient over the embedding group (first
// and last pipeline stage) and report it, then the optimizer step (which finishes the DP
// reduction and, with the distributed optimizer, all-gathers the updated parameters). The DP
// reduction is finished (GradSync::finish_grad_sync) before the optimizer step so that the
// all-grads-sync timer measures it.
#pragma once
#include <memory>
#include <vector>

#include "core/buffer.h"
#include "core/stream.h"

#include "model/language_model.h"
#include "optim/optimizer.h"
#include "train/pipeline.h"

namespace mt {

/// The values that change from one training step to the next and that the step's kernels read
/// from device memory, so that a captured step (CUDA graph, docs/cuda_graphs.md) replays with the
/// current ones: the iteration (keys the dropout masks) and the learning rate. write() is a
/// stream-ordered copy from pinned host memory (a ring of slots, each reused only once its
/// previous copy has run), issued before the step — outside any captured region.
class StepValues {
 public:
  explicit StepValues(Device device);
  /// decoupled_lr: the embedding and output layer's rate (--decoupled-lr; 0 when unused).
  void write(int64_t iteration, float lr, const Stream& stream, float decoupled_lr = 0.f);
  const uint64_t* iteration() const { return reinterpret_cast<const uint64_t*>(device_.data()); }
  const float* lr() const { return reinterpret_cast<const float*>(static_cast<const char*>(device_.data()) + 8); }
  const float* decoupled_lr() const {
    return reinterpret_cast<const float*>(static_cast<const char*>(device_.data()) + 12);
  }

 private:
  static constexpr int kSlots = 4;
  Buffer device_;              // {uint64 iteration, fp32 lr, fp32 decoupled lr}
  Buffer host_[kSlots];        // pinned
  std::unique_ptr<Event> done_[kSlots];
  int next_ = 0;
};

struct StepOptions {
  uint64_t seed = 0;
  int64_t iteration = 0;
  float lr = 0;
  /// Micro-batch m of data-parallel rank d is global micro-batch m·dp_size + d (Megatron's
  /// sampler interleaves DP ranks within each micro-batch step); the global index keys the
  /// dropout masks, so they do not depend on the data-parallel layout.
  int dp_rank = 0, dp_size = 1;
  /// Megatron's level-1 training timers (core/timers.h), or null.
  Timers* timers = nullptr;
  /// When set, the step's kernels read the iteration (dropout) and the learning rates from these
  /// device values (written beforehand by StepValues::write) instead of `iteration` and `lr`:
  /// the form a CUDA graph captures (docs/architecture.md principle 8).
  const StepValues* values = nullptr;
  /// When set, the step's stream waits for this event (on the device: the host does not block)
  /// before the step's first write to the parameters, the optimizer state or the model's
  /// persistent state, i.e. before the model's finish_step hook and the optimizer step; the forward and
  /// backward run before it. For an --async-save snapshot still being copied from that state
  /// (AsyncCheckpointSaver::snapshot_copied). Not for a step captured in a CUDA graph (the event
  /// of a later save would not be the one captured): wait before the graph launch instead.
  const Event* wait_before_update = nullptr;
  /// The embedding and output layer's learning rate with --decoupled-lr (AdamWOptimizer::step).
  float decoupled_lr = 0;
};

/// Runs one iteration on this rank's micro-batches (each carrying its loss weight, see
/// MicroBatch) with `plan` (plan_pipeline for plan.config.num_microbatches == micro_batches.size()).
/// loss_slot: fp32 [1] on the device that accumulates this rank's weighted loss (non-zero on the
/// last pipeline stage only; the sum over DP and PP ranks is the iteration's loss).
void train_step(LanguageModel& model, PipelineExecutor& executor, const PipelinePlan& plan, AdamWOptimizer& optimizer,
                const std::vector<MicroBatch>& micro_batches, const StepOptions& opt, const Tensor& loss_slot,
                const Stream& stream);

/// train_step without the optimizer step: zero the gradients, the schedule, the tied
/// embedding's reduction, the end of the DP reduction, the wait for opt.wait_before_update and
/// the model's finish_step hook (e.g. the MoE expert-bias update and the reset of the
/// global_aux_loss token counts): the part Megatron's full-iteration CUDA graph captures
/// (forward_backward_func and finalize_model_grads).
void forward_backward_step(LanguageModel& model, PipelineExecutor& executor, const PipelinePlan& plan,
                           AdamWOptimizer& optimizer, const std::vector<MicroBatch>& micro_batches,
                           const StepOptions& opt, const Tensor& loss_slot, const Stream& stream);

/// After the schedule: all-reduce the word-embedding gradient over the embedding group when it
/// spans pipeline stages (Megatron's _allreduce_word_embedding_grads), then report it to the
/// model's grads_ready hook. No-op on ranks without the embedding or with a one-rank group.
void allreduce_embedding_grads(LanguageModel& model, const Stream& stream);

}  // namespace mt
