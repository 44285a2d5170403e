#include "model/moe/capacity.h"

#include "ops/moe.h"

namespace mt {

void ExpertCapacity::plan(BufferPlanner& p, int64_t tokens, int64_t k, int64_t E) {
  if (!on()) return;
  capacity_ = moe_expert_capacity(tokens, k, E, config_.moe_expert_capacity_factor);
  const size_t a = static_cast<size_t>(p.area());
  if (routed_.size() <= a) routed_.resize(a + 1);
  routed_[a] = p.saved(DType::kI32, {tokens, k}, "routing before the capacity drop");
  kept_counts_ = p.scratch("moe.kept_counts", DType::kF32, {E});
}

void ExpertCapacity::drop(const Tensor& kept, const Tensor& probs, int slot, const Stream& st) const {
  moe_capacity_drop(kept, kept_counts_, routed(slot), probs, capacity_,
                    config_.moe_token_drop_policy == MoeTokenDropPolicy::kProbs, st);
}

}  // namespace mt
