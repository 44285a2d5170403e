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
  /// Micro-batch m of data-parallel rank d is global micro-batch m·dp_size + d (Megatron's
  /// sampler interleaves DP ranks within each micro-batch step); the global index keys the
  /// dropout masks, so they do not depend on the data-parallel layout.
  int dp_rank = 0, dp_size = 1;
};

/// Runs one iteration on this rank's micro-batches (each carrying its loss weight, see
/// MicroBatch). loss_slot: fp32 [1] on the device that accumulates this rank's weighted loss
/// (sum over ranks of DP = the iteration's loss).
void train_step(GptModel& model, AdamWOptimizer& optimizer, const std::vector<MicroBatch>& micro_batches,
                const StepOptions& opt, const Tensor& loss_slot, const Stream& stream);

}  // namespace mt
