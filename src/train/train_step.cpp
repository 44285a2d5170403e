#include "train/train_step.h"

#include <cstring>

namespace mt {

StepValues::StepValues(Device device) : device_(device, 16) {
  for (int i = 0; i < kSlots; ++i) {
    host_[i] = Buffer(Device::cpu(), 16, HostMemory::kPinned);
    done_[i] = std::make_unique<Event>(device);
  }
}

void StepValues::write(int64_t iteration, float lr, const Stream& stream, float decoupled_lr) {
  const int k = next_;
  next_ = (next_ + 1) % kSlots;
  done_[k]->synchronize();  // the copy that last read slot k has run (no-op before the first record)
  char* h = static_cast<char*>(host_[k].data());
  const uint64_t it = static_cast<uint64_t>(iteration);
  std::memcpy(h, &it, 8);
  std::memcpy(h + 8, &lr, 4);
  std::memcpy(h + 12, &decoupled_lr, 4);
  copy_bytes(device_.data(), device_.device(), h, Device::cpu(), 16, stream);
  done_[k]->record(stream);
}

void allreduce_embedding_grads(LanguageModel& model, const Stream& stream) {
  const size_t wte = model.word_embedding_index();
  const auto& emb = model.groups().embedding;
  if (wte == ParamStore::kNoParam || !emb || emb->size() <= 1) return;
  emb->all_reduce(model.params().grad(wte), ReduceOp::kSum, stream);
  if (model.hooks() != nullptr) model.hooks()->grads_ready(wte, wte + 1, stream);
}

void forward_backward_step(LanguageModel& model, PipelineExecutor& executor, const PipelinePlan& plan,
                           AdamWOptimizer& optimizer, const std::vector<MicroBatch>& micro_batches,
                           const StepOptions& opt, const Tensor& loss_slot, const Stream& stream) {
  optimizer.grad_sync().zero_grad_buffer(stream);  // zero gradients, new bucket state
  {
    ScopedTimer t(opt.timers, Timers::kForwardBackward, stream);
    executor.run(plan, micro_batches,
                 {opt.seed, opt.iteration, opt.dp_rank, opt.dp_size, true, opt.values ? opt.values->iteration() : nullptr},
                 loss_slot, 1.f, optimizer.loss_scale_tensor(), stream);
  }
  {
    ScopedTimer t(opt.timers, Timers::kEmbeddingGradsAllReduce, stream);
    allreduce_embedding_grads(model, stream);
  }
  {
    ScopedTimer t(opt.timers, Timers::kAllGradsSync, stream);
    optimizer.grad_sync().finish_grad_sync(stream);
  }
  // The first write to the saved state (--async-save: its snapshot may still be being copied).
  if (opt.wait_before_update) opt.wait_before_update->wait(stream);
  model.finish_step(stream);  // e.g. MoE expert-bias update, global aux-loss tracker reset
}

void train_step(LanguageModel& model, PipelineExecutor& executor, const PipelinePlan& plan, AdamWOptimizer& optimizer,
                const std::vector<MicroBatch>& micro_batches, const StepOptions& opt, const Tensor& loss_slot,
                const Stream& stream) {
  forward_backward_step(model, executor, plan, optimizer, micro_batches, opt, loss_slot, stream);
  // norm, AdamW, all-gather
  optimizer.step(opt.lr, stream, opt.timers, opt.values ? opt.values->lr() : nullptr, opt.decoupled_lr,
                 opt.values ? opt.values->decoupled_lr() : nullptr);
}

}  // namespace mt
