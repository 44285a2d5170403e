// ECHO expert dispatch (model/moe/echo.h, the host-placement transfers) over the thread
// communicator. The tests use placements from moe_echo_plan (the worked example and random skewed
// counts) and a placement written by hand, in which several clones of one expert sit on different
// ranks and one home rank receives many gradients. Checked: after the weight dispatch every used
// clone buffer equals its home expert's tensors bitwise and unused buffers stay untouched; after
// the gradient return every home main gradient equals its own value plus its clones' gradients
// (exact values, so any order gives the same sum), also with a scratch that holds a single expert,
// which forces several rounds.
// Errors: a clone on its home rank, a wrong group size, mismatched shapes, scratch too small.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "comm/thread_comm.h"
#include "model/moe/echo.h"
#include "ops/moe_echo.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;
const Device kCpu = Device::cpu();

// Two tensors per expert, fc1 [2, f, h] (gated) and fc2 [h, f], with f = 3 and h = 4.
const std::vector<std::vector<int64_t>> kShapes = {{2, 3, 4}, {4, 3}};

// Exact test values (multiples of 1/8): weight w of global expert e, element i; and a tag for
// gradients.
float value(int64_t tag, int64_t e, size_t w, int64_t i) {
  return static_cast<float>((tag * 131 + e * 17 + static_cast<int64_t>(w) * 7 + i) % 61 - 30) / 8.f;
}

struct Experts {
  std::vector<OwnedTensor> owned;
  std::vector<std::vector<Tensor>> lists;
  Experts(int64_t n, const std::function<float(int64_t, size_t, int64_t)>& fill) {
    owned.reserve(static_cast<size_t>(n) * kShapes.size());
    for (int64_t j = 0; j < n; ++j) {
      lists.emplace_back();
      for (size_t w = 0; w < kShapes.size(); ++w) {
        owned.emplace_back(DType::kF32, kCpu, kShapes[w]);
        float* d = owned.back().t.data_as<float>();
        for (int64_t i = 0; i < owned.back().t.numel(); ++i) d[i] = fill(j, w, i);
        lists.back().push_back(owned.back().t);
      }
    }
  }
  float at(int64_t j, size_t w, int64_t i) const { return lists[static_cast<size_t>(j)][w].data_as<float>()[i]; }
};

int64_t numel(size_t w) {
  int64_t n = 1;
  for (int64_t d : kShapes[w]) n *= d;
  return n;
}

// Dispatch and return on `ep` thread ranks for `p`, checking the results on every rank.
void check_placement(const EchoPlacement& p, int64_t scratch_experts) {
  const int64_t ep = p.ep, L = p.local_experts(), S = p.num_echo, NS = ep * S;
  const float kUntouched = 1234.5f;
  run_thread_ranks(static_cast<int>(ep), [&](int rank, std::shared_ptr<Communicator> g) {
    Stream st;
    // Weights of this rank's experts (global id rank·L + l), clone buffers filled with a sentinel.
    Experts local(L, [&](int64_t l, size_t w, int64_t i) { return value(0, rank * L + l, w, i); });
    Experts clones(S, [&](int64_t, size_t, int64_t) { return kUntouched; });
    echo_dispatch_weights(*g, p, local.lists, clones.lists, st);
    for (int64_t j = 0; j < S; ++j) {
      const int64_t s = rank * S + j, e = p.clone_expert[static_cast<size_t>(s)];
      for (size_t w = 0; w < kShapes.size(); ++w)
        for (int64_t i = 0; i < numel(w); ++i)
          ASSERT_EQ(clones.at(j, w, i), e >= 0 ? value(0, e, w, i) : kUntouched)
              << "rank " << rank << " slot " << s << " tensor " << w << " element " << i;
    }
    // Gradients: main grads of the home experts, clone grads tagged by their slot.
    Experts main(L, [&](int64_t l, size_t w, int64_t i) { return value(1, rank * L + l, w, i); });
    Experts cg(S, [&](int64_t j, size_t w, int64_t i) { return value(2 + rank * S + j, 0, w, i); });
    OwnedTensor scratch(DType::kF32, kCpu, {scratch_experts * (numel(0) + numel(1))});
    echo_return_gradients(*g, p, cg.lists, main.lists, scratch, st);
    for (int64_t l = 0; l < L; ++l) {
      const int64_t e = rank * L + l;
      for (size_t w = 0; w < kShapes.size(); ++w)
        for (int64_t i = 0; i < numel(w); ++i) {
          float want = value(1, e, w, i);
          for (int64_t s = 0; s < NS; ++s)
            if (p.clone_expert[static_cast<size_t>(s)] == e) want += value(2 + s, 0, w, i);
          ASSERT_EQ(main.at(l, w, i), want) << "rank " << rank << " expert " << e << " tensor " << w;
        }
    }
  });
}

EchoPlacement placement_of(const std::vector<int32_t>& counts, int64_t ep, int64_t E, int64_t S) {
  const Stream& cs = testing::cpu_stream();
  auto c = testing::make_int_tensor(counts, kCpu, {ep, E}, cs);
  OwnedTensor ce(DType::kI32, kCpu, {ep * S}), cq(DType::kI32, kCpu, {ep * S}), q(DType::kI32, kCpu, {ep, ep * S});
  moe_echo_plan(ce, cq, q, c, ep, S, cs);
  return echo_placement_sync(ce, E, ep, cs);
}

TEST(MoeEchoExperts, WorkedExamplePlan) {
  const std::vector<int32_t> counts = {40, 60, 25, 20, 30, 30, 25, 100, 40, 100, 25, 20, 30, 30, 25, 90,
                                       40, 40, 25, 20, 30, 30, 25, 50,  30, 40,  25, 20, 30, 30, 25, 50};
  const EchoPlacement p = placement_of(counts, 4, 8, 2);
  ASSERT_EQ(p.clone_expert, (std::vector<int64_t>{-1, -1, 1, 7, 7, -1, -1, -1}));
  check_placement(p, 4);
  check_placement(p, 1);  // e7's two clones return in two rounds
}

TEST(MoeEchoExperts, HandMadePlacement) {
  // 4 ranks, 2 experts each, 3 slots per rank: expert 0 (home 0) cloned on ranks 1, 2 and 3 and
  // expert 1 (home 0) on rank 2, so rank 0 receives 4 gradients; expert 5 (home 2) on rank 0,
  // expert 6 (home 3) on rank 1, expert 3 (home 1) on rank 3; 5 slots unused.
  EchoPlacement p{8, 4, 3, {5, -1, -1, 0, -1, 6, 0, 1, -1, 0, 3, -1}};
  check_placement(p, 5);
  check_placement(p, 2);
  check_placement(p, 1);
}

TEST(MoeEchoExperts, RandomPlans) {
  auto& rng = testing::test_rng();
  for (int64_t ep : {2, 4}) {
    for (int64_t S : {1, 2}) {
      const int64_t L = 3, E = ep * L;
      std::vector<int32_t> counts(static_cast<size_t>(ep * E));
      std::uniform_int_distribution<int32_t> d(0, 50);
      // expert 1 hot on every rank (8 x at least 50 tokens: at 8 x 0-50 a seed could leave it cold
      // and no expert cloned, MT_TEST_SEED=14961495931686798955)
      for (size_t i = 0; i < counts.size(); ++i)
        counts[i] = i % static_cast<size_t>(E) == 1 ? 8 * (50 + d(rng)) : d(rng);
      SCOPED_TRACE(fmt::format("ep={} S={}", ep, S));
      const EchoPlacement p = placement_of(counts, ep, E, S);
      EXPECT_TRUE(std::any_of(p.clone_expert.begin(), p.clone_expert.end(), [](int64_t e) { return e >= 0; }));
      check_placement(p, 1);
      check_placement(p, 3);
    }
  }
}

TEST(MoeEchoExperts, Errors) {
  EchoPlacement own{8, 4, 1, {1, -1, -1, -1}};  // slot 0 on rank 0 clones rank 0's expert 1
  EXPECT_THROW(own.validate(), Error);
  EchoPlacement far{8, 4, 1, {-1, 8, -1, -1}};
  EXPECT_THROW(far.validate(), Error);
  EchoPlacement ok{8, 4, 1, {-1, 0, -1, -1}};
  EXPECT_NO_THROW(ok.validate());
  run_thread_ranks(2, [&](int rank, std::shared_ptr<Communicator> g) {
    Stream st;
    Experts local(2, [](int64_t, size_t, int64_t) { return 0.f; });
    Experts clones(1, [](int64_t, size_t, int64_t) { return 0.f; });
    // A group of 2 ranks for a placement over 4: refused on both ranks before any communication.
    EXPECT_THROW(echo_dispatch_weights(*g, ok, local.lists, clones.lists, st), Error);
    EchoPlacement two{4, 2, 1, {2, 0}};  // rank 0 clones expert 2 (home 1), rank 1 expert 0
    std::vector<std::vector<Tensor>> bad = clones.lists;
    bad[0][1] = bad[0][1].view({12});  // fc2 of the wrong shape
    EXPECT_THROW(echo_dispatch_weights(*g, two, local.lists, bad, st), Error);
    OwnedTensor small(DType::kF32, kCpu, {10});
    EXPECT_THROW(echo_return_gradients(*g, two, clones.lists, local.lists, small, st), Error);
    OwnedTensor scratch(DType::kF32, kCpu, {36});
    EXPECT_NO_THROW(echo_return_gradients(*g, two, clones.lists, local.lists, scratch, st));
    EXPECT_NO_THROW(echo_dispatch_weights(*g, two, local.lists, clones.lists, st));
    (void)rank;
  });
}

}  // namespace
}  // namespace mt
