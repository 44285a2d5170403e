#include "train/train_step.h"

namespace mt {

void train_step(GptModel& model, AdamWOptimizer& optimizer, const std::vector<MicroBatch>& micro_batches,
                const StepOptions& opt, const Tensor& loss_slot, const Stream& stream) {
  model.params().zero_grads(stream);
  for (size_t m = 0; m < micro_batches.size(); ++m) {
    const uint32_t global_mb = static_cast<uint32_t>(m * opt.dp_size + opt.dp_rank);
    DropoutContext dc{opt.seed, static_cast<uint64_t>(opt.iteration), global_mb, true};
    const float w = micro_batches[m].loss_weight;
    model.forward(micro_batches[m], dc, loss_slot, w, stream);
    model.backward(micro_batches[m], dc, w, optimizer.loss_scale_tensor(), stream, m + 1 == micro_batches.size());
  }
  optimizer.step(opt.lr, stream);
}

}  // namespace mt
