// The alltoall token dispatchers (model/moe/alltoall_dispatcher.h) on thread ranks, with and without
// ECHO, under a skewed routing: every rank sends most of its slots to experts 0 and 1, both on EP
// rank 0. Checked:
//  * the data path: with identity experts (expert outputs = expert inputs) the combine gives every
//    token x[t]·Σ_j probs[t, j], whatever rank or clone its slots were computed on, and the
//    backward (combine_backward, dispatch_backward, preprocess_backward) gives dx[t] = dy[t]·Σ_j probs[t, j] and
//    d_probs[t, j] = <dy[t], x[t]>;
//  * the load: without ECHO EP rank 0 receives far more rows than the average load; with ECHO
//    (two spare slots per rank) no rank receives more than the average, the hot experts' excess
//    goes to clones (MoeDispatchStats::rerouted), and the placement names experts 0 and 1 only;
//  * the counts returned per local expert slot add up to the rows this rank received;
//  * with expert tensor parallelism 2 (EP 4 x ETP 2 on 8 thread ranks): one plan on the whole grid
//    although the ETP ranks of an EP rank route different tokens, every EP rank at the average
//    load of the grid's sources, each clone's quota split over all of them (the static blocks do
//    not overflow), and the data path through the ETP all-gather / reduce-scatter.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <numeric>
#include <vector>

#include "comm/thread_comm.h"
#include "model/moe/echo.h"
#include "model/moe/token_dispatcher.h"
#include "ops/elementwise.h"
#include "ops/moe_echo.h"
#include "testing/testing.h"

namespace mt {
namespace {

constexpr int kEp = 4;
constexpr int64_t kExperts = 8, kTopk = 2, kTokens = 64, kHidden = 4;

// Token t of rank r: slot 0 -> expert 0 for 7 of 8 tokens, slot 1 -> expert 1 for 3 of 4; the
// rest spread over the others (a token's two experts always differ). shift s: every expert id
// moved by 2·s (mod 8), so the hot experts are 2s and 2s + 1.
std::vector<int32_t> skewed_top(int rank, int shift = 0) {
  std::vector<int32_t> top(static_cast<size_t>(kTokens * kTopk));
  for (int64_t t = 0; t < kTokens; ++t) {
    const int64_t u = t + 5 * rank;
    const int32_t a = u % 8 != 7 ? 0 : static_cast<int32_t>(2 + u % 6);
    int32_t b = u % 4 != 3 ? 1 : static_cast<int32_t>(2 + (u + 3) % 6);
    if (b == a) b = static_cast<int32_t>(2 + (b - 2 + 1) % 6);
    top[static_cast<size_t>(t * kTopk)] = static_cast<int32_t>((a + 2 * shift) % kExperts);
    top[static_cast<size_t>(t * kTopk + 1)] = static_cast<int32_t>((b + 2 * shift) % kExperts);
  }
  return top;
}

std::vector<int32_t> ints(const Tensor& t, const Stream& s) { return testing::to_host_ints(t, s); }

struct RankResult {
  MoeDispatchStats stats;
  int64_t rows = 0;  // rows this rank received
  std::vector<int64_t> clone_expert;
};

// The expert grid of a run: kEp EP ranks x `etp` expert TP ranks, world rank w = i·kEp + j for ETP
// rank i and EP rank j; `shift`: ETP rank i routes skewed_top(w, i) (its own hot experts), else
// skewed_top(w).
struct Grid {
  int etp = 1;
  bool shift = false;
  int size() const { return kEp * etp; }
};

// One forward (preprocess, dispatch, combine) + backward through the dispatcher on every rank;
// checks the data path on each.
// received > 0: the static dispatcher (--moe-received-token-capacity), whose overflowed slots add
// nothing; `kept` (per rank, [T·k]) says which slots the test expects kept (empty: all). With
// expert TP the identity experts of the `etp` ranks each return the whole row, so the combine's
// reduce-scatter over ETP gives etp times the sum (and likewise the gradients).
std::vector<RankResult> run(int64_t num_echo, int64_t received = 0,
                            const std::vector<std::vector<char>>& kept = {}, Grid grid = {}) {
  const int world_size = grid.size();
  std::vector<RankResult> out(static_cast<size_t>(world_size));
  std::vector<std::vector<float>> xs, dys;
  for (int r = 0; r < world_size; ++r) {
    xs.push_back(testing::randn(kTokens * kHidden));
    dys.push_back(testing::randn(kTokens * kHidden));
  }
  std::mutex mu;
  run_thread_ranks(world_size, [&](int rank, std::shared_ptr<Communicator> world) {
    const int etp_rank = rank / kEp, ep_rank = rank % kEp;
    ExpertParallel ep;
    ep.ep_size = kEp;
    ep.ep_rank = ep_rank;
    ep.etp_size = grid.etp;
    ep.etp_rank = etp_rank;
    ep.dispatch = world;
    if (grid.etp == 1) {
      ep.ep_group = world;
    } else {
      ep.ep_group = world->split(etp_rank, ep_rank, "ep");
      ep.etp_group = world->split(ep_rank, etp_rank, "etp");
    }
    const int64_t L = kExperts / kEp;
    auto disp = make_moe_token_dispatcher(MoeDispatcher::kAllToAll, ep,
                                          {kExperts, kTopk, L, ep_rank * L, /*device_counts=*/received > 0, num_echo,
                                           received});
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
    const int64_t block = (received + kEp - 1) / kEp;
    EXPECT_EQ(max_rows, grid.etp * (received > 0 ? kEp * block : kEp * kTokens * std::min(kTopk, L + num_echo)));
    Stream st(cpu);
    const std::vector<float>& x = xs[static_cast<size_t>(rank)];
    const std::vector<float>& dy = dys[static_cast<size_t>(rank)];
    const std::vector<int32_t> top = skewed_top(rank, grid.shift ? etp_rank : 0);
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
    fill(dx.t, std::nanf(""), st);  // poisoned: the backward must write every element
    disp->preprocess(xt.t, 0, st);
    const MoeExpertCounts counts = disp->dispatch(xp.t, xt.t, 0, st);
    std::vector<int64_t> per_slot = counts.host;
    if (received > 0) {  // device counts only
      EXPECT_TRUE(counts.host.empty());
      const std::vector<int32_t> c = ints(counts.device, st);
      per_slot.assign(c.begin(), c.end());
    }
    ASSERT_EQ(per_slot.size(), static_cast<size_t>(L + num_echo));
    const int64_t R = std::accumulate(per_slot.begin(), per_slot.end(), int64_t{0});
    disp->combine(y.t, xp.t, 0, st);  // identity experts: out = xp
    disp->combine_backward(d_out.t, d_probs.t, dyt.t, xp.t, 0, st);
    disp->dispatch_backward(dx.t, d_out.t, 0, st);  // identity experts: d_xp = d_out
    disp->preprocess_backward(dx.t, 0, st);
    const auto keeps = [&](int64_t i) { return kept.empty() || kept[static_cast<size_t>(rank)][static_cast<size_t>(i)]; };
    const auto Q = static_cast<float>(grid.etp);
    for (int64_t t = 0; t < kTokens; ++t) {
      float p = 0;
      for (int64_t j = 0; j < kTopk; ++j)
        if (keeps(t * kTopk + j)) p += probs[static_cast<size_t>(t * kTopk + j)];
      float dot = 0;
      for (int64_t c = 0; c < kHidden; ++c) {
        const size_t i = static_cast<size_t>(t * kHidden + c);
        EXPECT_NEAR(y.t.data_as<float>()[i], Q * p * x[i], 1e-5f) << "rank " << rank << " token " << t;
        EXPECT_NEAR(dx.t.data_as<float>()[i], Q * p * dy[i], 1e-5f) << "rank " << rank << " token " << t;
        dot += x[i] * dy[i];
      }
      for (int64_t j = 0; j < kTopk; ++j)
        EXPECT_NEAR(d_probs.t.data_as<float>()[t * kTopk + j], keeps(t * kTopk + j) ? Q * dot : 0.f, 1e-4f)
            << "rank " << rank << " token " << t;
    }
    std::lock_guard<std::mutex> lock(mu);
    out[static_cast<size_t>(rank)].stats = disp->stats(st);
    if (const Tensor ce = disp->echo_clone_expert(0); !ce.empty()) {
      const std::vector<int32_t> c = ints(ce, st);
      out[static_cast<size_t>(rank)].clone_expert.assign(c.begin(), c.end());
    }
    out[static_cast<size_t>(rank)].rows = R;
    if (const EchoPlacement* p = disp->echo_placement(0)) out[static_cast<size_t>(rank)].clone_expert = p->clone_expert;
  });
  return out;
}

// --moe-expert-capacity-factor bounds the expert rows a rank plans for (R_max): each source keeps
// at most C = ceil(T·k/E · factor) slots per expert, so a rank receives at most sources · local
// experts · C rows; a factor large enough leaves the dropless bound. Both dispatchers, EP 2.
TEST(MoeDispatchers, ExpertCapacityBoundsThePlannedRows) {
  constexpr int kRanks = 2;
  constexpr int64_t L = kExperts / kRanks, kCap1 = (kTokens * kTopk + kExperts - 1) / kExperts;  // factor 1: 16
  for (const MoeDispatcher type : {MoeDispatcher::kAllToAll, MoeDispatcher::kAllGather})
    for (const double factor : {0.0, 1.0, 1.5, 4.0}) {
      std::vector<int64_t> planned(kRanks);
      run_thread_ranks(kRanks, [&](int rank, std::shared_ptr<Communicator> world) {
        ExpertParallel ep;
        ep.ep_size = kRanks;
        ep.ep_rank = rank;
        ep.dispatch = ep.ep_group = world;
        MoeDispatchSizes sizes{kExperts, kTopk, L, rank * L};
        sizes.capacity_factor = factor;
        auto disp = make_moe_token_dispatcher(type, ep, sizes);
        BufferPlanner planner(Device::cpu(), DType::kF32);
        planner.begin_pass();
        planner.open_area(BufferPlanner::Family::kActivations, 0);
        planned[static_cast<size_t>(rank)] = disp->plan(planner, kTokens, kHidden);
        planner.close_area();
      });
      const int64_t dropless = kRanks * kTokens * std::min(kTopk, L);
      const int64_t cap = factor > 0 ? static_cast<int64_t>(std::ceil(kTokens * kTopk / double(kExperts) * factor)) : 0;
      const int64_t expect = factor > 0 ? std::min(dropless, kRanks * L * cap) : dropless;
      for (int64_t p : planned) EXPECT_EQ(p, expect) << "factor " << factor << " type " << static_cast<int>(type);
      if (factor == 1.0) EXPECT_EQ(expect, kRanks * L * kCap1);  // 128 rows, half the dropless 256
      if (factor == 4.0) EXPECT_EQ(expect, dropless);
    }
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

// The static receive blocks: each source keeps, per destination EP rank, the first B = C / EP
// slots in expert-sorted order (expert, then flat slot); the others overflow.
std::vector<std::vector<char>> expected_kept(int64_t block, int64_t* dropped, int ranks = kEp) {
  std::vector<std::vector<char>> kept(static_cast<size_t>(ranks));
  *dropped = 0;
  const int64_t L = kExperts / kEp;
  for (int r = 0; r < ranks; ++r) {
    const std::vector<int32_t> top = skewed_top(r);
    kept[static_cast<size_t>(r)].assign(top.size(), 0);
    std::vector<int64_t> used(kEp, 0);
    for (int64_t e = 0; e < kExperts; ++e)
      for (size_t i = 0; i < top.size(); ++i)
        if (top[i] == e) {
          const bool fits = used[static_cast<size_t>(e / L)]++ < block;
          kept[static_cast<size_t>(r)][i] = fits;
          *dropped += fits ? 0 : 1;
        }
  }
  return kept;
}

TEST(MoeStaticAllToAllDispatcher, LargeCapacityKeepsEverySlot) {
  const std::vector<RankResult> r = run(0, /*received=*/kEp * kTokens * kTopk);
  for (const RankResult& x : r) EXPECT_EQ(x.stats.overflowed, 0);
}

TEST(MoeStaticAllToAllDispatcher, OverflowIsDroppedAndCounted) {
  const int64_t capacity = 2 * kTokens * kTopk;  // twice the balanced load: rank 0 still overflows
  int64_t dropped = 0;
  const auto kept = expected_kept(capacity / kEp, &dropped);
  ASSERT_GT(dropped, 0);
  const std::vector<RankResult> r = run(0, capacity, kept);
  int64_t counted = 0;
  for (const RankResult& x : r) counted += x.stats.overflowed;
  EXPECT_EQ(counted, dropped);
}

TEST(MoeStaticAllToAllDispatcher, EchoAvoidsTheOverflow) {
  // 1.25 x the balanced load: without ECHO rank 0's blocks overflow, with ECHO (two spare slots per
  // rank, planned on the device) every slot fits and reaches its clone or home expert.
  const int64_t capacity = kTokens * kTopk * 5 / 4;
  int64_t dropped = 0;
  expected_kept(capacity / kEp, &dropped);
  ASSERT_GT(dropped, 0);
  const std::vector<RankResult> echo = run(2, capacity);  // `kept` empty: every slot must count
  for (const RankResult& x : echo) {
    EXPECT_EQ(x.stats.overflowed, 0);
    EXPECT_EQ(x.clone_expert, echo[0].clone_expert);
  }
  for (int64_t e : echo[0].clone_expert) EXPECT_TRUE(e == -1 || e == 0 || e == 1) << e;
}

// ---- expert tensor parallelism --------------------------------------------------------------------

constexpr int kEtp = 2;

// The placement one ETP slice's counts alone would give (what an ETP rank planning from its EP
// group's counts only would compute).
std::vector<int64_t> slice_placement(int etp_rank, int64_t num_echo, const Grid& grid) {
  std::vector<int64_t> counts(static_cast<size_t>(kEp * kExperts), 0);
  for (int j = 0; j < kEp; ++j)
    for (int32_t e : skewed_top(etp_rank * kEp + j, grid.shift ? etp_rank : 0))
      if (e >= 0) ++counts[static_cast<size_t>(j * kExperts + e)];
  return echo::plan(counts, kEp, kExperts, num_echo).clone_expert;
}

TEST(MoeAllToAllDispatcher, EchoWithExpertTensorParallelism) {
  // EP 4 x ETP 2: ETP rank 0 routes mostly to experts 0 and 1 (EP rank 0), ETP rank 1 to experts 2
  // and 3 (EP rank 1), so planned per ETP slice the two ETP ranks of an EP rank would place
  // different clones; the grid's plan holds on all eight ranks.
  const Grid grid{kEtp, /*shift=*/true};
  const int64_t S = 3;
  ASSERT_NE(slice_placement(0, S, grid), slice_placement(1, S, grid));
  const std::vector<RankResult> base = run(0, 0, {}, grid), echo = run(S, 0, {}, grid);
  const int64_t avg = kEtp * kTokens * kTopk;  // the grid's Q·P·T·k slots over the P EP ranks
  EXPECT_GT(base[0].rows, avg);
  EXPECT_GT(base[1].rows, avg);
  int64_t total = 0, excess = 0, rerouted = 0;
  for (int r = 0; r < grid.size(); ++r) {
    const RankResult& x = echo[static_cast<size_t>(r)];
    EXPECT_EQ(x.clone_expert, echo[0].clone_expert) << "rank " << r;
    // both ETP ranks of an EP rank compute on the rows of all sources of the grid
    EXPECT_EQ(x.rows, echo[static_cast<size_t>(r % kEp)].rows) << "rank " << r;
    EXPECT_EQ(x.rows, avg) << "rank " << r;
    EXPECT_EQ(x.stats.max_received, avg) << "rank " << r;
    if (r < kEp) {
      total += x.rows;
      excess += std::max<int64_t>(0, base[static_cast<size_t>(r)].rows - avg);
    }
    if (r % kEp == 0) rerouted += x.stats.rerouted;  // an EP group counts the slots of its own sources
  }
  EXPECT_EQ(total, kEp * avg);  // moved, neither dropped nor duplicated
  EXPECT_EQ(rerouted, excess);
  const auto& ce = echo[0].clone_expert;
  for (int64_t e : ce) EXPECT_TRUE(e >= -1 && e < 4) << e;
  EXPECT_NE(std::find(ce.begin(), ce.end(), 0), ce.end()) << "ETP rank 0's hot expert not cloned";
  EXPECT_NE(std::find(ce.begin(), ce.end(), 2), ce.end()) << "ETP rank 1's hot expert not cloned";
}

TEST(MoeStaticAllToAllDispatcher, EchoWithExpertTensorParallelismAvoidsTheOverflow) {
  // EP 4 x ETP 2, every source skewed toward experts 0 and 1, blocks of 1.25 x the balanced load:
  // without ECHO EP rank 0's blocks overflow; with ECHO, planned on the device from the grid's
  // counts, each clone's quota is split over all eight sources in proportion, and every slot fits.
  const Grid grid{kEtp, /*shift=*/false};
  const int64_t capacity = kTokens * kTopk * 5 / 4;
  int64_t dropped = 0;
  const auto kept = expected_kept(capacity / kEp, &dropped, grid.size());
  ASSERT_GT(dropped, 0);
  const std::vector<RankResult> base = run(0, capacity, kept, grid);
  int64_t counted = 0;
  for (const RankResult& x : base) counted += x.stats.overflowed;
  EXPECT_EQ(counted, dropped);
  const std::vector<RankResult> echo = run(2, capacity, {}, grid);  // `kept` empty: every slot must count
  for (const RankResult& x : echo) {
    EXPECT_EQ(x.stats.overflowed, 0);
    EXPECT_EQ(x.clone_expert, echo[0].clone_expert);
  }
  for (int64_t e : echo[0].clone_expert) EXPECT_TRUE(e == -1 || e == 0 || e == 1) << e;
}

}  // namespace
}  // namespace mt
