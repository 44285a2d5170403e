// Points in a training step where the data-parallel machinery may act on parameter ranges
// (Megatron's DistributedDataParallel forward pre-hooks and backward grad-ready hooks, made
// explicit calls). The model calls them; src/optim/grad_sync.h implements them.
//
// Indices are ParamStore parameter indices; [first, end) is a run of consecutive parameters.
// Parameters of one decoder layer are consecutive in the ParamStore (GPTModel::param_specs).
//
// Contract (what the model guarantees):
//  * params_needed(first, end): called before the first kernel of the step that reads these
//    model parameters is enqueued on `stream`, once per step per range (the first forward of
//    the model chunk in the step), in forward layer order. An implementation that all-gathers
//    parameters asynchronously (--overlap-param-gather) makes `stream` wait for them here.
//  * grads_ready(first, end): called during the LAST backward of the step of the chunk that
//    owns these parameters, after every kernel accumulating into their fp32 main gradients has
//    been enqueued on `stream` (and after the sequence-parallel TP all-reduce of replicated
//    parameters, so the gradients are complete for this rank). Each parameter is reported exactly
//    once per step, except the tied word embedding when the embedding group has more than one
//    rank (pipeline parallelism): it is reported by the step executor after the embedding-group
//    all-reduce. An implementation that reduces gradients asynchronously (--overlap-grad-reduce)
//    records an event on `stream` and starts the reduction of every bucket now complete.
//  * grads_every_backward() true (a sharded gradient, --data-parallel-sharding-strategy
//    optim_grads): grads_ready is called in EVERY backward of the chunk, not only the last one of
//    the step, each parameter once per backward (the sequence-parallel all-reduce too), so the
//    implementation reduces each micro-batch's gradients and frees their staging buffers. The tied
//    word embedding shared across stages is still reported once per step, by the step executor.
//  * params_every_use() true (sharded parameters, --data-parallel-sharding-strategy
//    optim_grads_params; and sharded gradients with overlapped reduction, optim_grads or
//    optim_grads_params with --overlap-grad-reduce, where the brackets tell the implementation
//    which uses may write a bucket whose reduce-scatter is in flight: GradSync::params_every_use):
//    every use of a unit's parameters is bracketed by params_begin(first, end, backward,
//    next_first, next_end) before its first kernel and params_end(first, end, backward) after its
//    last: a layer's forward, its recomputed forward (backward = true), its backward; the
//    embedding's forward; the head's forward and backward (with the tied word embedding's range,
//    no next range, when the head reads it); each multi-token prediction depth's embedding lookup
//    (the word embedding), its input part (norms, eh_proj), its layer and its head (its final norm
//    with the shared output layer's weight nested), forward and backward, without next ranges.
//    The backward brackets cover every gradient write of the parameters they name except those
//    of the embeddings' backwards (the embedding's, an MTP depth's), which read no parameter and
//    are not bracketed. Between them the parameters are readable; outside, a staged parameter is
//    not (ParamStore::param raises). Ranges may nest (the tied embedding inside the head's) but
//    each params_end matches a params_begin. [next_first, next_end): the parameters the next use
//    of the pass reads (empty: none, or unknown), which the implementation may start gathering
//    now (prefetch). params_needed is not called then.
#pragma once
#include <cstddef>

#include "core/stream.h"

namespace mt {

class ParamGradHooks {
 public:
  virtual ~ParamGradHooks() = default;
  virtual void params_needed(size_t first, size_t end, const Stream& stream) = 0;
  virtual void grads_ready(size_t first, size_t end, const Stream& stream) = 0;
  virtual bool grads_every_backward() const { return false; }
  virtual bool params_every_use() const { return false; }
  virtual void params_begin(size_t /*first*/, size_t /*end*/, bool /*backward*/, size_t /*next_first*/,
                            size_t /*next_end*/, const Stream& /*stream*/) {}
  virtual void params_end(size_t /*first*/, size_t /*end*/, bool /*backward*/, const Stream& /*stream*/) {}
};

}  // namespace mt
