// The alltoall token dispatcher (model/layers/moe_dispatcher.h) on thread ranks, with and without
// ECHO, under a skewed routing: every rank sends most of its slots to experts 0 and 1, both on EP
// rank 0. Checked:
//  * the data path: with identity experts (expert outputs = expert inputs) the combine gives every
//    token x[t]·Σ_j probs[t, j], whatever rank or clone its slots were computed on, and the
//    backward (combine_backward, dispatch_backward) gives dx[t] = dy[t]·Σ_j probs[t, j] and
//    d_probs[t, j] = <dy[t], x[t]>;
//  * the load: without ECHO EP rank 0 receives far more rows than the average load; with ECHO
//    (two spare slots per rank) no rank receives more than the average, the hot experts' excess
//    goes to clones (MoeDispatchStats::rerouted), and the placement names experts 0 and 1 only;
//  * the counts returned per local expert slot add up to the rows this rank received.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <numeric>
#include <vector>

#include "comm/thread_comm.h"
#include "model/layers/moe_dispatcher.h"
#include "testing/testing.h"

namespace mt {
namespace {

constexpr int kEp = 4;
constexpr int64_t kExperts = 8, kTopk = 2, kTokens = 64, kHidden = 4;

// Token t of rank r: slot 0 -> expert 0 for 7 of 8 tokens, slot 1 -> expert 1 for 3 of 4; the
// rest spread over the others (a token's two experts always differ).
std::vector<int32_t> skewed_top(int rank) {
  std::vector<int32_t> top(static_cast<size_t>(kTokens * kTopk));
  for (int64_t t = 0; t < kTokens; ++t) {
    const int64_t u = t + 5 * rank;
    const int32_t a = u % 8 != 7 ? 0 : static_cast<int32_t>(2 + u % 6);
    int32_t b = u % 4 != 3 ? 1 : static_cast<int32_t>(2 + (u + 3) % 6);
    if (b == a) b = static_cast<int32_t>(2 + (b - 2 + 1) % 6);
    top[static_cast<size_t>(t * kTopk)] = a;
    top[static_cast<size_t>(t * kTopk + 1)] = b;
  }
  return top;
}

struct RankResult {
  MoeDispatchStats stats;
  int64_t rows = 0;  // rows this rank received
  std::vector<int64_t> clone_expert;
};

// One forward + backward through the dispatcher on every rank; checks the data path on each.
std::vector<RankResult> run(int64_t num_echo) {
  std::vector<RankResult> out(kEp);
  std::vector<std::vector<float>> xs, dys;
  for (int r = 0; r < kEp; ++r) {
    xs.push_back(testing::randn(kTokens * kHidden));
    dys.push_back(testing::randn(kTokens * kHidden));
  }
  std::mutex mu;
  run_thread_ranks(kEp, [&](int rank, std::shared_ptr<Communicator> world) {
    ExpertParallel ep;
    ep.ep_size = kEp;
    ep.ep_rank = rank;
    ep.dispatch = world;
    ep.ep_group = world;
    const int64_t L = kExperts / kEp;
    auto disp = make_moe_token_dispatcher(MoeDispatcher::kAllToAll, ep,
                                          {kExperts, kTopk, L, rank * L, /*device_counts=*/false, num_echo});
    const Device cpu = Device::cpu();
    BufferPlanner planner(cpu, DType::kF32);
    int64_t max_rows = 0;
    for (int pass = 0; pass < 2; ++pass) {
      planner.begin_pass();
      planner.open_area(BufferPlanner::Family::kActivations, 0);
      max_rows = disp->plan(planner, kTokens, kHidden);
      planner.close_area();
      if (pass == 0) planner.materialize();
    }
    EXPECT_EQ(max_rows, kEp * kTokens * std::min(kTopk, L + num_echo));
    Stream st(cpu);
    const std::vector<float>& x = xs[static_cast<size_t>(rank)];
    const std::vector<float>& dy = dys[static_cast<size_t>(rank)];
    const std::vector<int32_t> top = skewed_top(rank);
    std::vector<float> probs(static_cast<size_t>(kTokens * kTopk));
    for (size_t i = 0; i < probs.size(); ++i) probs[i] = 0.25f + 0.5f * static_cast<float>(i % 7) / 7.f;
    std::copy(top.begin(), top.end(), disp->top(0).data_as<int32_t>());
    std::copy(probs.begin(), probs.end(), disp->probs(0).data_as<float>());
    testing::OwnedTensor xt(DType::kF32, cpu, {kTokens, kHidden}), dyt(DType::kF32, cpu, {kTokens, kHidden});
    std::copy(x.begin(), x.end(), xt.t.data_as<float>());
    std::copy(dy.begin(), dy.end(), dyt.t.data_as<float>());
    testing::OwnedTensor xp(DType::kF32, cpu, {max_rows, kHidden}), y(DType::kF32, cpu, {kTokens, kHidden});
    testing::OwnedTensor d_out(DType::kF32, cpu, {max_rows, kHidden}), dx(DType::kF32, cpu, {kTokens, kHidden});
    testing::OwnedTensor d_probs(DType::kF32, cpu, {kTokens, kTopk});
    const MoeExpertCounts counts = disp->dispatch(xp.t, xt.t, 0, st);
    ASSERT_EQ(counts.host.size(), static_cast<size_t>(L + num_echo));
    const int64_t R = std::accumulate(counts.host.begin(), counts.host.end(), int64_t{0});
    disp->combine(y.t, xp.t, 0, st);  // identity experts: out = xp
    disp->combine_backward(d_out.t, d_probs.t, dyt.t, xp.t, 0, st);
    disp->dispatch_backward(dx.t, d_out.t, 0, st);  // identity experts: d_xp = d_out
    for (int64_t t = 0; t < kTokens; ++t) {
      const float p = probs[static_cast<size_t>(t * kTopk)] + probs[static_cast<size_t>(t * kTopk + 1)];
      float dot = 0;
      for (int64_t c = 0; c < kHidden; ++c) {
        const size_t i = static_cast<size_t>(t * kHidden + c);
        EXPECT_NEAR(y.t.data_as<float>()[i], p * x[i], 1e-5f) << "rank " << rank << " token " << t;
        EXPECT_NEAR(dx.t.data_as<float>()[i], p * dy[i], 1e-5f) << "rank " << rank << " token " << t;
        dot += x[i] * dy[i];
      }
      for (int64_t j = 0; j < kTopk; ++j)
        EXPECT_NEAR(d_probs.t.data_as<float>()[t * kTopk + j], dot, 1e-5f) << "rank " << rank << " token " << t;
    }
    std::lock_guard<std::mutex> lock(mu);
    out[static_cast<size_t>(rank)].stats = disp->stats();
    out[static_cast<size_t>(rank)].rows = R;
    if (const EchoPlacement* p = disp->echo_placement(0)) out[static_cast<size_t>(rank)].clone_expert = p->clone_expert;
  });
  return out;
}

TEST(MoeAllToAllDispatcher, SkewedRoutingWithoutEcho) {
  const std::vector<RankResult> r = run(0);
  const int64_t avg = kTokens * kTopk;  // slots per rank = the average load per EP rank
  EXPECT_GT(r[0].rows, 2 * avg);        // experts 0 and 1 live on rank 0
  for (const RankResult& x : r) {
    EXPECT_EQ(x.stats.rerouted, 0);
    EXPECT_EQ(x.stats.max_received, r[0].rows);  // the same statistics on every rank
    EXPECT_EQ(x.stats.dispatches, 1);
  }
}

TEST(MoeAllToAllDispatcher, EchoKeepsEveryRankAtTheAverageLoad) {
  const std::vector<RankResult> base = run(0), echo = run(2);
  const int64_t avg = kTokens * kTopk;
  int64_t total = 0;
  for (int r = 0; r < kEp; ++r) {
    total += echo[static_cast<size_t>(r)].rows;
    EXPECT_LE(echo[static_cast<size_t>(r)].rows, avg) << "rank " << r;
    EXPECT_EQ(echo[static_cast<size_t>(r)].stats.max_received, avg);
    // every rank computes the same plan; the clones hold the hot experts only
    EXPECT_EQ(echo[static_cast<size_t>(r)].clone_expert, echo[0].clone_expert);
    EXPECT_EQ(echo[static_cast<size_t>(r)].stats.rerouted, base[0].rows - avg);
  }
  EXPECT_EQ(total, kEp * avg);  // ECHO moves rows, it neither drops nor duplicates them
  for (int64_t e : echo[0].clone_expert) EXPECT_TRUE(e == -1 || e == 0 || e == 1) << e;
  EXPECT_EQ(echo[0].clone_expert.size(), static_cast<size_t>(kEp * 2));
}

}  // namespace
}  // namespace mt
