#include "train/train_step.h"

namespace mt {

void allreduce_embedding_grads(LanguageModel& model, const Stream& stream) {
  const size_t wte = model.word_embedding_index();
  const auto& emb = model.groups().embedding;
  if (wte == ParamStore::kNoParam || !emb || emb->size() <= 1) return;
  emb->all_reduce(model.params().grad(wte), ReduceOp::kSum, stream);
  if (model.hooks() != nullptr) model.hooks()->grads_ready(wte, wte + 1, stream);
}

void train_step(LanguageModel& model, PipelineExecutor& executor, const PipelinePlan& plan, AdamWOptimizer& optimizer,
                const std::vector<MicroBatch>& micro_batches, const StepOptions& opt, const Tensor& loss_slot,
                const Stream& stream) {
  optimizer.grad_sync().zero_grad_buffer(stream);  // zero gradients, new bucket state
  {
    ScopedTimer t(opt.timers, Timers::kForwardBackward, stream);
    executor.run(plan, micro_batches, {opt.seed, opt.iteration, opt.dp_rank, opt.dp_size, true}, loss_slot, 1.f,
                 optimizer.loss_scale_tensor(), stream);
  }
  {
    ScopedTimer t(opt.timers, Timers::kEmbeddingGradsAllReduce, stream);
    allreduce_embedding_grads(model, stream);
  }
  {
    ScopedTimer t(opt.timers, Timers::kAllGradsSync, stream);
    optimizer.grad_sync().finish_grad_sync(stream);
  }
  model.update_expert_bias(stream);  // aux-loss-free MoE balancing (Megatron's finalize_model_grads)
  optimizer.step(opt.lr, stream, opt.timers);  // norm, AdamW, parameter all-gather
}

}  // namespace mt
