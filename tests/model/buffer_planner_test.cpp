// BufferPlanner's scratch placement (model/module.h): keys requested only inside loss-head areas
// and keys requested only inside layer areas share memory; keys requested in both kinds of area or
// outside any area get their own. Checked on the placed addresses and on scratch_bytes(), with a
// two-pass plan as GPTModel makes it (measure, materialize, place).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "model/module.h"

namespace mt {
namespace {

using Family = BufferPlanner::Family;

struct Placed {
  Tensor layer_a, layer_b, recompute_only, head_logits, head_losses, both, outside, saved;
};

// One pass of a model's plan: two layer slots, one recompute area, one head area, model-level
// scratch. Sizes in fp32 elements (256-byte multiples, so no alignment padding).
Placed plan(BufferPlanner& p) {
  Placed r;
  for (int slot = 0; slot < 2; ++slot) {
    p.open_area(Family::kActivations, slot);
    r.saved = p.saved(DType::kF32, {64}, "saved");
    r.layer_a = p.scratch("layer.a", DType::kF32, {1024});
    r.layer_b = p.scratch("layer.b", DType::kF32, {512});
    r.both = p.scratch("shared.by_both", DType::kF32, {128});
    p.close_area();
  }
  p.open_area(Family::kRecompute, 0);
  r.recompute_only = p.scratch("layer.recompute", DType::kF32, {256});
  p.close_area();
  p.open_area(Family::kHead, 0);
  r.head_logits = p.scratch("head.logits", DType::kF32, {2048});
  r.head_losses = p.scratch("head.losses", DType::kF32, {64});
  r.both = p.scratch("shared.by_both", DType::kF32, {128});
  p.close_area();
  r.outside = p.scratch("model.residual_grad", DType::kF32, {192});
  return r;
}

uintptr_t begin(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()); }
uintptr_t end(const Tensor& t) { return begin(t) + t.nbytes(); }
bool overlap(const Tensor& a, const Tensor& b) { return begin(a) < end(b) && begin(b) < end(a); }

TEST(BufferPlanner, HeadScratchSharesTheLayersScratch) {
  BufferPlanner p(Device::cpu(), DType::kF32);
  p.begin_pass();
  plan(p);
  // shared: "shared.by_both" (128) + "model.residual_grad" (192); layers: 1024 + 512 + 256;
  // head: 2048 + 64 -> the head's phase is the larger.
  EXPECT_EQ(p.scratch_bytes(), 4u * (128 + 192 + 2048 + 64));
  p.materialize();
  p.begin_pass();
  const Placed r = plan(p);
  const std::vector<Tensor> layer = {r.layer_a, r.layer_b, r.recompute_only};
  const std::vector<Tensor> head = {r.head_logits, r.head_losses};
  const std::vector<Tensor> shared = {r.both, r.outside};
  // Within a phase and among shared keys: disjoint.
  for (const auto* group : {&layer, &head, &shared})
    for (size_t i = 0; i < group->size(); ++i)
      for (size_t j = i + 1; j < group->size(); ++j) EXPECT_FALSE(overlap((*group)[i], (*group)[j])) << i << " " << j;
  // Shared keys and saved tensors overlap nothing else.
  for (const Tensor& s : shared) {
    for (const Tensor& t : layer) EXPECT_FALSE(overlap(s, t));
    for (const Tensor& t : head) EXPECT_FALSE(overlap(s, t));
    EXPECT_FALSE(overlap(s, r.saved));
  }
  for (const Tensor& t : layer) EXPECT_FALSE(overlap(t, r.saved));
  for (const Tensor& t : head) EXPECT_FALSE(overlap(t, r.saved));
  // The head's logits reuse the layers' temporaries.
  EXPECT_TRUE(overlap(r.head_logits, r.layer_a));
  EXPECT_TRUE(overlap(r.head_logits, r.layer_b));
  // Everything inside the one buffer.
  const uintptr_t lo = begin(r.saved), hi = lo + p.bytes();
  for (const Tensor& t : {r.layer_a, r.layer_b, r.recompute_only, r.head_logits, r.head_losses, r.both, r.outside}) {
    EXPECT_GE(begin(t), lo);
    EXPECT_LE(end(t), hi);
  }
}

TEST(BufferPlanner, ScratchWithoutAHeadIsTheSumOfItsKeys) {
  BufferPlanner p(Device::cpu(), DType::kF32);
  p.begin_pass();
  p.open_area(Family::kActivations, 0);
  p.scratch("a", DType::kF32, {64});
  p.scratch("b", DType::kF32, {128});
  p.scratch("a", DType::kF32, {256});  // the larger request of a key wins
  p.close_area();
  p.scratch("c", DType::kF32, {64});
  EXPECT_EQ(p.scratch_bytes(), 4u * (256 + 128 + 64));
}

TEST(BufferPlanner, PlacingAScratchKeyLargerThanPlannedIsAnError) {
  BufferPlanner p(Device::cpu(), DType::kF32);
  p.begin_pass();
  p.open_area(Family::kHead, 0);
  p.scratch("head.x", DType::kF32, {64});
  p.close_area();
  p.materialize();
  p.begin_pass();
  p.open_area(Family::kHead, 0);
  EXPECT_THROW(p.scratch("head.x", DType::kF32, {65}), Error);
  EXPECT_THROW(p.scratch("never.planned", DType::kF32, {1}), Error);
}

}  // namespace
}  // namespace mt
