// The pipeline executor: runs one rank's schedule (parallel/pipeline/schedules.h, batched p2p
// mode) over its model chunks — forwards, backwards and the point-to-point transfers of stage
// activations and their gradients (Megatron-Core pipeline_parallel/schedules.py and
// p2p_communication.py). With pp = 1 the schedule is "no pipelining" (forward and backward of
// each micro-batch in turn), so every layout runs through this one executor.
//
// Buffers. The input of a (micro-batch, chunk) lives in one of the chunk's input buffers from the
// moment it arrives (receive, or the embedding on stage 0) until its backward; the activations
// saved by its forward live in one of the rank's activation slots (shared by its chunks) from the
// forward until the backward (in forward-only runs both until the output has been sent). Gradients travelling backwards live in a
// pool of [s_l, b, h] buffers from their receive (or their production by the loss chunk) until
// they have been consumed by the backward and the chunk's input gradient, written into the same
// buffer, has been sent. plan_pipeline() assigns slots and buffers by replaying the action list
// once, so nothing is allocated during a step; the peaks are the schedule's real memory bounds
// (1F1B: at most pp − rank micro-batches of activations on rank `rank`).
//
// Overlapped p2p (--overlap-p2p-communication, ScheduleConfig::overlap_p2p_comm; mode (b) of
// parallel/pipeline/schedules.h): the batches run on a communication stream of the executor with
// a communicator of their own, and each compute waits only for the last batch that touched one
// of its buffers (PipelinePlan::wait_batch). The buffers and their lifetimes are the same as
// without overlap (a buffer freed "after its batch" is reused only by a compute that waits for
// that batch or by a later batch on the same stream), so the plan needs no extra buffers; the
// executor adds the stream (on CUDA with its 32 MiB cuBLASLt workspace) and one event per batch.
#pragma once
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "model/language_model.h"
#include "parallel/pipeline/schedules.h"

namespace mt {

/// One rank's schedule with its buffer assignment.
struct PipelinePlan {
  pipeline::ScheduleConfig config;
  int pp_rank = 0;
  std::vector<pipeline::Action> actions;
  /// Per action, -1 where not used: the buffers of (microbatch, chunk) (kForward, kBackward,
  /// kSendForward; kRecvForward: input only); gradient buffer (kRecvBackward, kBackward,
  /// kSendBackward).
  std::vector<ChunkBuffers> buffers;
  std::vector<int> grad_buffer;
  /// Per action: for kForward / kBackward the last p2p batch (id) that received into or sent from
  /// one of its buffers (input, activation slot, gradient buffer), -1 if none. With overlapped p2p
  /// the compute stream waits for that batch before the compute (docs/parallelism.md).
  std::vector<int> wait_batch;
  int num_batches = 0;                    ///< p2p batches in `actions`
  int activation_slots = 1;               ///< peak forwarded-not-yet-backwarded (micro-batch, chunk)s
  std::vector<int> inputs_per_chunk;      ///< peak input buffers (incl. received, not yet forwarded)
  std::vector<int> loss_slots_per_chunk;  ///< peak head slots (loss chunk)
  int grad_buffers = 0;              ///< peak gradient buffers
};

/// Builds the schedule of `pp_rank` (validating cfg and, through the chunk list, the layer
/// layout) and assigns buffers. chunks: this rank's layer ranges (pipeline::layers_of).
/// Errors: mt::Error from validate_schedule_config (e.g. interleaving with micro-batches not a
/// multiple of pp), naming the values, before any communication.
PipelinePlan plan_pipeline(const pipeline::ScheduleConfig& cfg, int pp_rank,
                           const std::vector<pipeline::LayerRange>& chunks);

/// The model chunks and buffer counts this rank needs to run every given plan.
ModelLayout model_layout(const std::vector<pipeline::LayerRange>& chunks, const std::vector<const PipelinePlan*>& plans);

/// Where in training a run happens (keys dropout; see StepOptions in train_step.h).
struct RunContext {
  uint64_t seed = 0;
  int64_t iteration = 0;
  int dp_rank = 0, dp_size = 1;
  bool training = true;
  /// When set: the dropout reads the iteration from here when the kernels run (device memory,
  /// StepValues in train_step.h) instead of baking `iteration` into them (CUDA graph replay).
  const uint64_t* iteration_ptr = nullptr;
};

class PipelineExecutor {
 public:
  /// model: this rank's chunks, built with model_chunks(...) for every plan it will run.
  /// pp: the pipeline group (peers of the plans' p2p actions are ranks in it). When a plan has
  /// config.overlap_p2p_comm and pp has more than one rank, the constructor splits pp (collective
  /// over it: every pipeline rank builds its executor with the same plans' flags) into the
  /// communicator of the overlapped batches and creates their stream and events.
  PipelineExecutor(LanguageModel& model, std::shared_ptr<Communicator> pp, const std::vector<const PipelinePlan*>& plans);
  ~PipelineExecutor();

  /// Runs plan.actions over micro_batches (this rank's, plan.config.num_microbatches of them).
  /// The loss chunk accumulates loss_accum[0] += loss_weight_scale · mb.loss_weight · sum(loss)
  /// per micro-batch. Training (plan not forward-only): backwards accumulate into the fp32 main
  /// gradients, scaled by the device loss scale `loss_scale` (fp32 [1] or empty = 1); the last
  /// backward of each chunk runs its sequence-parallel reductions and grads_ready hooks.
  /// With plan.config.overlap_p2p_comm the transfers run on the executor's communication stream
  /// (see the file comment); `stream` has waited for all of them when the call returns (no host
  /// synchronisation; capturable in a CUDA graph).
  void run(const PipelinePlan& plan, const std::vector<MicroBatch>& micro_batches, const RunContext& ctx,
           const Tensor& loss_accum, float loss_weight_scale, const Tensor& loss_scale, const Stream& stream);

  /// Per-layer CUDA graphs (model/layer_graphs.h): from now on each forward first writes its
  /// global micro-batch index into its activation slot's key on the device (a stream-ordered copy
  /// from pinned host memory), and the forward and backward of that micro-batch key their dropout
  /// with it (DropoutContext::microbatch_ptr), so one graph per slot serves every micro-batch.
  /// Allocates the keys (call outside a step).
  void use_slot_keys();

  /// Whether plans with config.overlap_p2p_comm run overlapped (a pipeline of more than one rank).
  bool overlaps_p2p() const { return p2p_ != nullptr; }

 private:
  // Issues the p2p batch starting at action i of `plan` (ops on `st`); returns the index after it.
  size_t issue_batch(const PipelinePlan& plan, size_t i, Communicator& comm, const Stream& st);

  LanguageModel& model_;
  std::shared_ptr<Communicator> pp_;
  // Overlapped p2p: the batches' communicator (split from pp_), stream, the compute stream's
  // event each batch starts behind, and one completion event per batch id.
  std::shared_ptr<Communicator> p2p_;
  std::unique_ptr<Stream> p2p_stream_;
  std::unique_ptr<Event> computed_;
  std::vector<std::unique_ptr<Event>> batch_done_;
  Buffer grad_pool_;
  std::vector<Tensor> grads_;
  int max_microbatches_ = 0;
  Buffer slot_keys_;  // uint32 [activation slots] on the model's device
  Buffer host_keys_;  // uint32 [max micro-batches], pinned: the global index of local micro-batch m
};

}  // namespace mt
