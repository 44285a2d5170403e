// How `megatron pretrain` issues its training steps and validation forwards: the policy of
// --cuda-graph-impl (docs/cuda_graphs.md), one of
//   eager            train_step (train/train_step.h) every iteration, with Megatron's level-1 timers;
//   per layer        (--cuda-graph-impl local with attn / mlp / moe / moe_router / moe_preprocess
//                    scopes) train_step with the layers' scoped regions run through LayerGraphs,
//                    captured on first use after --cuda-graph-warmup-steps eager steps;
//   full iteration   (--cuda-graph-scope full_iteration) forward_backward_step (+ the optimizer step
//                    with --cuda-graph-include-optimizer) captured once after the warm-up steps and
//                    replayed; the validation forward likewise. The step's loss goes to a fixed
//                    device slot, added into the caller's slot after the replay.
// Everything a replay reads that changes per step (iteration, learning rate) comes from StepValues.
// On a CPU stream the per-layer policy runs every region eagerly and the full-iteration policy runs
// eagerly until its capture, which fails (CudaGraph::capture: not a CUDA stream); the trainer
// refuses --cuda-graph-impl on the CPU before it gets here (TrainingSetup).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/cuda_graph.h"
#include "core/timers.h"
#include "model/layer_graphs.h"
#include "train/arguments.h"
#include "train/train_step.h"
#include "train/training_setup.h"

namespace mt {

class StepRunner {
 public:
  /// Installs the per-layer graphs in the model (and slot keys in the executor) when the policy
  /// is per layer. seed: --seed (keys the dropout). timers: level-1 timers for eager and per-layer
  /// steps (nullptr: none; graph policies never time). Errors: mt::Error for bad scopes
  /// (LayerGraphs).
  StepRunner(ModelSetup& setup, const CudaGraphOptions& graphs, uint64_t seed, Timers* timers, const Stream& stream);
  StepRunner(const StepRunner&) = delete;
  StepRunner& operator=(const StepRunner&) = delete;

  /// Training step `iteration` on `micro_batches` (this rank's, plan_pipeline's count) at learning
  /// rate `lr` (the embedding and output layer at `decoupled_lr` with --decoupled-lr): its weighted loss is added into loss_slot (fp32 [1] on the device). snapshot_pending:
  /// an --async-save snapshot still being copied from the parameters and the optimizer state
  /// (AsyncCheckpointSaver::snapshot_copied; nullptr: none): the step waits for it on the device
  /// before its first update (a full-iteration step: before the graph launch). Errors: mt::Error
  /// from a capture that allocated, synchronised with the host or failed.
  void step(int64_t iteration, float lr, const std::vector<MicroBatch>& micro_batches, const Tensor& loss_slot,
            const Event* snapshot_pending, float decoupled_lr = 0.f);
  /// Writes the validation's iteration to the device (read by a captured validation forward) and
  /// returns it for RunContext::iteration_ptr. Call once per validation, before its forwards.
  const uint64_t* begin_validation(int64_t iteration);
  /// One validation forward (`forward` issues it on the stream): eagerly, or after the warm-up of
  /// the full-iteration policy captured once (the first forward given) and replayed.
  void validation_forward(const std::function<void()>& forward);

  /// Training steps run by this object (the warm-up counts them).
  int64_t steps_run() const { return steps_run_; }
  /// Host milliseconds spent issuing training steps since the previous call.
  double take_host_issue_ms();

 private:
  void step_eager(const std::vector<MicroBatch>& micro_batches, const StepOptions& so, const Tensor& loss_slot);
  void step_full_iteration(const std::vector<MicroBatch>& micro_batches, const StepOptions& so,
                           const Tensor& loss_slot, const Event* snapshot_pending);
  std::string per_layer_scopes() const;
  // mt::Error unless GradSync holds nothing live on the host (GradSync::live_host_state): the state
  // a captured region starts and ends in. where: e.g. "before the captured training step".
  void check_step_boundary(const char* where) const;

  ModelSetup& setup_;
  CudaGraphOptions graphs_;
  uint64_t seed_;
  Timers* timers_;
  const Stream& stream_;
  StepValues step_values_, eval_values_;
  LayerGraphs layer_graphs_;
  size_t layer_graphs_logged_ = 0;
  CudaGraph train_graph_, eval_graph_;
  Buffer step_loss_;  // fp32 [1]: the full-iteration graph's loss slot
  int64_t steps_run_ = 0;
  double host_issue_ms_ = 0;
};

}  // namespace mt
