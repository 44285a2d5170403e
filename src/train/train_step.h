// One training iteration, shared by `megatron pretrain` and the parallel-equivalence tests:
// zero the gradients, forward and backward of every micro-batch (gradient accumulation), the
// sequence-parallel gradient reduction, then the optimizer step (which reduces over DP).
#pragma once
#include <vector>

#include "model/gpt.h"
#include "optim/optimizer.h"

namespace mt {

struct StepOptions {
  uint64_t seed = 0;
  int64_t iteration = 0;
  float lr = 0;
  /// Weight of one token's loss: 1 / (tokens per micro-batch · micro-batches · DP size), so the
  /// logged loss is the mean over this rank's tokens times 1/DP and the DP sum of gradients is
  /// the gradient of the global mean loss.
  float loss_weight = 1;
  /// Global index of this rank's first micro-batch (data-parallel rank · micro-batches): keys
  /// the dropout masks, so they do not depend on the data-parallel layout.
  uint32_t microbatch_offset = 0;
};

/// Runs one iteration on this rank's micro-batches. loss_slot: fp32 [1] on the device that
/// accumulates this rank's weighted loss (sum over ranks of DP = the global mean loss).
void train_step(GptModel& model, AdamWOptimizer& optimizer, const std::vector<MicroBatch>& micro_batches,
                const StepOptions& opt, const Tensor& loss_slot, const Stream& stream);

}  // namespace mt
