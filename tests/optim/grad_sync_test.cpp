// Data-parallel gradient buckets (ParamStore layout), GradSync (bucketed / overlapped
// reduction, ZeRO-1 ownership, parameter all-gather) and AdamW over owned ranges, on CPU with
// ranks as threads (docs/architecture.md: N ranks == 1 rank). The reference is one rank stepping on the
// summed gradients; with the same operation order (no distributed optimizer) results must be
// bitwise identical, otherwise the norm is summed in another order and they agree to 1e-6.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <set>

#include "testing/testing.h"
#include "comm/thread_comm.h"
#include "ops/elementwise.h"
#include "optim/ddp_test_util.h"
#include "optim/grad_sync.h"
#include "optim/optimizer.h"
#include "train/arguments.h"

namespace mt {
namespace {

using ddp_test::Model;
using ddp_test::opt_config;
using ddp_test::Pattern;
using testing::OwnedTensor;

constexpr int kSteps = 3;
constexpr float kLr = 1e-2f;

using ::mt::testing::expect_error;

std::vector<ParamSpec> sized(const std::vector<int64_t>& numels) {
  std::vector<ParamSpec> s;
  for (size_t i = 0; i < numels.size(); ++i) {
    ParamSpec p;
    p.name = "p" + std::to_string(i);
    p.shape = {numels[i]};
    s.push_back(p);
  }
  return s;
}

std::vector<std::pair<size_t, size_t>> param_ranges(const ParamStore& P) {
  std::vector<std::pair<size_t, size_t>> out;
  for (const auto& b : P.buckets()) out.push_back({b.param_begin, b.param_end});
  return out;
}

// Invariants of every bucket plan: buckets in reverse parameter order, contiguous, covering the
// buffer; boundaries at parameter boundaries; each bucket a multiple of kAlign·DP with less than
// that of padding; parameters kAlign-aligned, disjoint, inside their bucket.
void check_plan(const ParamStore& P, int64_t dp) {
  const auto& bk = P.buckets();
  const int64_t q = ParamStore::kAlign * dp;
  ASSERT_FALSE(bk.empty());
  EXPECT_EQ(bk.front().param_end, P.size());
  EXPECT_EQ(bk.back().param_begin, 0u);
  EXPECT_EQ(bk.back().begin, 0);
  EXPECT_EQ(bk.front().end, P.total_elements());
  for (size_t b = 0; b < bk.size(); ++b) {
    EXPECT_LT(bk[b].param_begin, bk[b].param_end) << "empty bucket " << b;
    EXPECT_EQ(bk[b].numel() % q, 0) << "bucket " << b << " of " << bk[b].numel();
    if (b + 1 < bk.size()) {
      EXPECT_EQ(bk[b].begin, bk[b + 1].end) << b;
      EXPECT_EQ(bk[b].param_begin, bk[b + 1].param_end) << b;
    }
    const ParamInfo& last = P.info(bk[b].param_end - 1);
    const int64_t used = (last.offset + last.numel + ParamStore::kAlign - 1) / ParamStore::kAlign * ParamStore::kAlign;
    EXPECT_LT(bk[b].end - used, q) << "bucket " << b << " over-padded";
    EXPECT_EQ(P.info(bk[b].param_begin).offset, bk[b].begin) << b;
    for (size_t i = bk[b].param_begin; i < bk[b].param_end; ++i) {
      const ParamInfo& p = P.info(i);
      EXPECT_EQ(P.bucket_of(i), b);
      EXPECT_EQ(p.offset % ParamStore::kAlign, 0) << p.name;
      EXPECT_GE(p.offset, bk[b].begin);
      EXPECT_LE(p.offset + p.numel, bk[b].end);
      if (i + 1 < P.size()) EXPECT_LE(p.offset + p.numel, P.info(i + 1).offset) << p.name;
    }
  }
}

TEST(BucketPlan, ReverseOrderBoundariesAndPadding) {
  // Aligned sizes 128, 64, 320, 64, 5056, 128, 128; buckets close once >= 200 elements, a
  // parameter of >= 200 elements gets its own bucket.
  ParamStore P(sized({100, 64, 300, 1, 5000, 70, 70}), DType::kF32, Device::cpu(), ParamLayout{3, 200});
  check_plan(P, 3);
  using V = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(param_ranges(P), (V{{5, 7}, {4, 5}, {3, 4}, {2, 3}, {0, 2}}));
  // The first bucket in memory holds p0, p1: 192 elements padded to 192 (multiple of 192).
  EXPECT_EQ(P.buckets().back().numel(), 192);
  EXPECT_EQ(P.info(4).offset, P.buckets()[1].begin);
}

TEST(BucketPlan, OneBucket) {
  const std::vector<int64_t> sizes{100, 64, 300, 1, 5000, 70, 70};
  for (int64_t bs : {int64_t{0}, int64_t{1} << 40}) {
    ParamStore P(sized(sizes), DType::kF32, Device::cpu(), ParamLayout{3, bs});
    check_plan(P, 3);
    ASSERT_EQ(P.buckets().size(), 1u) << bs;
    EXPECT_EQ(P.total_elements(), 5952);  // 5888 aligned elements, padded to a multiple of 192
  }
  // The pad_multiple constructor is the one-bucket layout.
  ParamStore a(sized(sizes), DType::kF32, Device::cpu(), 4), b(sized(sizes), DType::kF32, Device::cpu(),
                                                                ParamLayout{4, 0});
  ASSERT_EQ(a.buckets().size(), 1u);
  EXPECT_EQ(a.total_elements(), b.total_elements());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a.info(i).offset, b.info(i).offset);
}

TEST(BucketPlan, ManyBucketsAndLargeParameter) {
  // 3 x 64 then a parameter of 1000 (>= bucket size 100: alone, even though the open bucket
  // holds p3 only), then 64: buckets {p3} {p2} {p0, p1} ... walked from the end.
  ParamStore P(sized({10, 10, 1000, 10}), DType::kF32, Device::cpu(), ParamLayout{2, 100});
  check_plan(P, 2);
  using V = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(param_ranges(P), (V{{3, 4}, {2, 3}, {0, 2}}));
  // Every parameter its own bucket when the size is 1; many buckets of a GPT-like model.
  ParamStore Q(sized({10, 20, 30, 40}), DType::kF32, Device::cpu(), ParamLayout{4, 1});
  check_plan(Q, 4);
  EXPECT_EQ(Q.buckets().size(), 4u);
  const Model m = ddp_test::gpt_like(4);
  ParamStore G(m.specs, DType::kF32, Device::cpu(), ParamLayout{4, 700});
  check_plan(G, 4);
  EXPECT_GE(G.buckets().size(), 6u);
}

TEST(BucketPlan, SharedEmbeddingCopyGetsItsOwnBucket) {
  const Model m = ddp_test::gpt_like(2, 1, 0, /*shared_copy=*/true);
  ParamStore P(m.specs, DType::kF32, Device::cpu(), ParamLayout{2, 0});
  check_plan(P, 2);
  using V = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(param_ranges(P), (V{{P.size() - 1, P.size()}, {0, P.size() - 1}}));
}

TEST(BucketPlan, Errors) {
  expect_error([] { ParamStore P(sized({4}), DType::kF32, Device::cpu(), ParamLayout{0, 0}); },
               "data_parallel_size must be >= 1, got 0");
  expect_error([] { ParamStore P(sized({4}), DType::kF32, Device::cpu(), ParamLayout{1, -3}); },
               "must be >= 0, got -3");
  ParamStore P(sized({4}), DType::kF32, Device::cpu());
  DdpConfig c;
  c.overlap_param_gather = true;
  expect_error([&] { GradSync s(P, nullptr, c); }, "--overlap-param-gather requires --use-distributed-optimizer");
  // A store laid out for DP 1 (one bucket of 64) cannot be sharded over 2 ranks.
  run_thread_ranks(2, [&](int, std::shared_ptr<Communicator> w) {
    ParamStore Q(sized({4}), DType::kF32, Device::cpu());
    DdpConfig d;
    d.use_distributed_optimizer = true;
    expect_error([&] { GradSync s(Q, w, d); }, "laid out for data-parallel size 1 (expert 1) but the group has 2 ranks");
  });
}

// ParamLayout::split_model_chunks (the interleaved pipeline schedule under optim_grads, docs/fsdp.md):
// a bucket never holds parameters of two model chunks, and sharded gradients refuse a store laid
// out without the rule (negative control: its one bucket spans both chunks). On 2 ranks the
// backwards of the two chunks and two micro-batches run interleaved (chunk 1 of micro-batches 0
// and 1, then chunk 0 of both), each completing its chunk's bucket: the shard is the sum.
TEST(BucketPlan, SplitModelChunks) {
  auto specs = [] {
    std::vector<ParamSpec> s = sized({100, 64, 300, 1});
    s[2].model_chunk = s[3].model_chunk = 1;
    return s;
  };
  ParamLayout split{2, 0};
  split.split_model_chunks = true;
  ParamStore whole(specs(), DType::kF32, Device::cpu(), ParamLayout{2, 0});
  ParamStore per_chunk(specs(), DType::kF32, Device::cpu(), split);
  check_plan(per_chunk, 2);
  using V = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(param_ranges(whole), (V{{0, 4}}));
  EXPECT_EQ(param_ranges(per_chunk), (V{{2, 4}, {0, 2}}));
  DdpConfig c;
  c.use_distributed_optimizer = c.shard_grads = true;
  expect_error([&] { GradSync g(whole, nullptr, c); }, "bucket 0 holds parameters of model chunks 0 ('p1') and 1 ('p2')");
  run_thread_ranks(2, [&](int rank, std::shared_ptr<Communicator> w) {
    Stream st;
    ParamStore P(specs(), DType::kF32, Device::cpu(), split);
    P.initialize(1, st);
    GradSync g(P, w, c);
    EXPECT_EQ(P.grad_slots(), 2);  // one bucket per unit ('p0'...: every parameter its own unit) + 2, at most 2
    g.zero_grad_buffer(st);
    for (const auto& [chunk, mb] : std::vector<std::pair<int, int>>{{1, 0}, {1, 1}, {0, 0}, {0, 1}}) {
      const size_t first = chunk == 0 ? 0 : 2;
      for (size_t i = first + 2; i-- > first;) {  // backward: reverse parameter order
        fill(P.grad(i), static_cast<float>((rank + 1) * (mb + 1) * (i + 1)), st);
        g.grads_ready(i, i + 1, st);
      }
      EXPECT_FALSE(P.grad_bound(P.bucket_of(first))) << "chunk " << chunk << " left its bucket staged";
    }
    g.finish_grad_sync(st);
    // sum over ranks (1 + 2) and micro-batches (1 + 2): 9 (i + 1) on the parameters, 0 on padding
    std::vector<float> expected(static_cast<size_t>(P.total_elements()), 0.f);
    for (size_t i = 0; i < P.size(); ++i)
      for (int64_t e = 0; e < P.info(i).numel; ++e)
        expected[static_cast<size_t>(P.info(i).offset + e)] = 9.f * static_cast<float>(i + 1);
    const float* shard = static_cast<const float*>(g.grad_shard().data());
    int64_t at = 0;
    for (const ParamStore::Range& r : g.owned_ranges())
      for (int64_t e = r.begin; e < r.end; ++e) EXPECT_EQ(shard[at++], expected[static_cast<size_t>(e)]) << e;
    EXPECT_EQ(at, g.owned_elements());
  });
}

TEST(GradSync, ProtocolErrorsAndIdempotentFinish) {
  const Model m = ddp_test::gpt_like(2);
  Stream st;
  ParamStore P(m.specs, DType::kF32, Device::cpu(), ParamLayout{1, 700});
  P.initialize(1, st);
  DdpConfig c;
  c.overlap_grad_reduce = true;
  GradSync s(P, nullptr, c);
  const size_t n = P.size();
  s.grads_ready(n - 1, n, st);
  expect_error([&] { s.grads_ready(n - 2, n, st); }, "reported twice in one step");
  expect_error([&] { s.grads_ready(0, n + 1, st); }, "outside [0, ");
  expect_error([&] { s.params_needed(2, 1, st); }, "outside [0, ");
  s.finish_grad_sync(st);
  EXPECT_EQ(s.grad_reductions_launched(), P.buckets().size());
  s.finish_grad_sync(st);  // a second call in the step does nothing
  expect_error([&] { s.grads_ready(0, 1, st); }, "after finish_grad_sync");
  s.zero_grad_buffer(st);
  EXPECT_EQ(s.grad_reductions_launched(), 0u);
  s.grads_ready(0, 1, st);  // a new step
}

// zero_grads leaves the grad_overwrite parameters' gradients alone and zeroes every other element
// (padding included); take_first_grad_write answers once per step; finish_grad_sync names a
// marked parameter no write took.
TEST(GradSync, FirstGradientWrites) {
  Model m = ddp_test::gpt_like(2);
  size_t fc1 = ParamStore::kNoParam;
  for (size_t i = 0; i < m.specs.size(); ++i)
    if (m.specs[i].name.find("fc1.weight") != std::string::npos) {
      m.specs[i].grad_overwrite = true;
      if (fc1 == ParamStore::kNoParam) fc1 = i;
    }
  ASSERT_NE(fc1, ParamStore::kNoParam);
  Stream st;
  ParamStore P(m.specs, DType::kF32, Device::cpu(), ParamLayout{1, 700});
  P.initialize(1, st);
  fill(P.grads_flat(), 3.f, st);
  GradSync s(P, nullptr, DdpConfig{});
  s.zero_grad_buffer(st);
  const std::vector<float> g = testing::to_host(P.grads_flat(), st);
  std::vector<char> kept(g.size(), 0);
  for (size_t i = 0; i < P.size(); ++i)
    if (P.info(i).grad_overwrite)
      std::fill(kept.begin() + P.info(i).offset, kept.begin() + P.info(i).offset + P.info(i).numel, 1);
  for (size_t k = 0; k < g.size(); ++k) ASSERT_EQ(g[k], kept[k] ? 3.f : 0.f) << "element " << k;
  const size_t left = P.untaken_first_write();
  EXPECT_EQ(left, fc1);
  expect_error([&] { s.finish_grad_sync(st); }, "no backward of this step wrote the gradient of '" + P.info(fc1).name);
  for (size_t i = 0; i < P.size(); ++i) EXPECT_EQ(P.take_first_grad_write(i), P.info(i).grad_overwrite) << i;
  EXPECT_FALSE(P.take_first_grad_write(fc1));  // once per step
  EXPECT_EQ(P.untaken_first_write(), ParamStore::kNoParam);
  s.finish_grad_sync(st);
  // Off: everything zeroed, nothing marked.
  P.set_grad_overwrite(false);
  fill(P.grads_flat(), 3.f, st);
  s.zero_grad_buffer(st);
  for (float x : testing::to_host(P.grads_flat(), st)) ASSERT_EQ(x, 0.f);
  EXPECT_FALSE(P.take_first_grad_write(fc1));
  EXPECT_EQ(P.untaken_first_write(), ParamStore::kNoParam);
}

// --- N ranks == 1 rank -------------------------------------------------------------------

struct Reference {
  std::vector<std::vector<float>> grads;  // per step: the summed gradients, flat [total]
  std::vector<float> params, main, m, v;  // after kSteps; params as floats of the model dtype
  OptimizerScalars scalars{};
};

// One rank, the gradients of `dp` ranks summed (in `instances` instances first: hybrid sharding's
// order), the same layout (so the same offsets).
Reference reference(const Model& m, const ParamLayout& layout, int dp, DType dtype = DType::kF32, int instances = 1) {
  Stream st;
  ParamStore P(m.specs, dtype, Device::cpu(), layout);
  P.initialize(99, st);
  AdamWOptimizer opt(P, opt_config(), st);
  Reference r;
  for (int step = 0; step < kSteps; ++step) {
    P.zero_grads(st);
    for (size_t i = 0; i < P.size(); ++i)
      testing::upload(P.grad(i), ddp_test::local_grad(P, i, step, -1, dp, instances), st);
    r.grads.push_back(testing::to_host(P.grads_flat(), st));
    opt.step(kLr, st);
  }
  r.params = testing::to_host(P.params_flat(), st);
  r.main = testing::to_host(P.main_flat(), st);
  r.m = testing::to_host(opt.exp_avg(), st);
  r.v = testing::to_host(opt.exp_avg_sq(), st);
  r.scalars = opt.read_scalars_sync(st);
  return r;
}

bool owned(const std::vector<ParamStore::Range>& rs, int64_t e) {
  return std::any_of(rs.begin(), rs.end(), [e](const ParamStore::Range& r) { return e >= r.begin && e < r.end; });
}

struct DpCase {
  int dp;
  bool overlap, distributed;
  int64_t bucket_size;  // 0 = one bucket
  int instances = 1;    // --num-distributed-optimizer-instances (hybrid sharding)
};

void PrintTo(const DpCase& c, std::ostream* os) {
  *os << "dp " << c.dp << (c.overlap ? " overlap" : " sync") << (c.distributed ? " distopt" : " allreduce")
      << " bucket_size " << c.bucket_size << " instances " << c.instances;
}

class DataParallel : public ::testing::TestWithParam<DpCase> {};

TEST_P(DataParallel, MatchesSingleRankOnSummedGradients) {
  const DpCase c = GetParam();
  const Model m = ddp_test::gpt_like(4);
  const int shard = c.dp / c.instances;  // ranks of one instance: the shard group
  const ParamLayout layout{shard, c.bucket_size};
  const Reference ref = reference(m, layout, c.dp, DType::kF32, c.instances);
  ASSERT_LT(ref.scalars.clip_coeff, 0.5f) << "clipping must be active";
  run_thread_ranks(c.dp, [&](int rank, std::shared_ptr<Communicator> world) {
    Stream st;
    auto dp = std::make_shared<ddp_test::CountingCommunicator>(world);
    ParamStore P(m.specs, DType::kF32, Device::cpu(), layout);
    P.initialize(99, st);
    DdpConfig dc;
    dc.overlap_grad_reduce = c.overlap;
    dc.use_distributed_optimizer = c.distributed;
    dc.overlap_param_gather = c.distributed && c.overlap;
    dc.num_distributed_optimizer_instances = c.instances;
    GradSync sync(P, dp, dc);
    AdamWOptimizer opt(sync, opt_config(), st, {});
    // Hybrid sharding: the instance is contiguous ranks (Megatron's intra-partial group), the
    // replica group the same position in each instance.
    EXPECT_EQ(sync.dp()->size(), shard);
    EXPECT_EQ(sync.dp()->rank(), rank % shard);
    EXPECT_EQ(sync.replicas(P.buckets()[0]).size(), c.instances);
    EXPECT_EQ(sync.replicas(P.buckets()[0]).rank(), rank / shard);
    const size_t nb = P.buckets().size();
    const int64_t total = P.total_elements();
    // Ownership: one slice of every bucket, total/DP elements (DP/k: the instance); optimizer
    // state accordingly.
    if (c.distributed) {
      ASSERT_EQ(sync.owned_ranges().size(), nb);
      for (size_t b = 0; b < nb; ++b) {
        const auto r = sync.owned_range(b);
        EXPECT_EQ(r.end - r.begin, P.buckets()[b].numel() / shard);
        EXPECT_EQ(r.begin, P.buckets()[b].begin + (rank % shard) * (r.end - r.begin));
      }
      EXPECT_EQ(sync.owned_elements() * shard, total);
    } else {
      EXPECT_EQ(sync.owned_elements(), total);
    }
    EXPECT_EQ(opt.state_elements(), 2 * sync.owned_elements());  // fp32: main == model params
    const Pattern patterns[kSteps] = {Pattern::kInOrder, Pattern::kLateNever, Pattern::kNone};
    for (int step = 0; step < kSteps; ++step) {
      sync.zero_grad_buffer(st);
      // Forward: wait for the parameters layer by layer, except the final layer (never asked
      // for: the next finish must still wait for its all-gather).
      for (size_t k = 0; k + 1 < m.layers.size(); ++k) sync.params_needed(m.layers[k].first, m.layers[k].end, st);
      dp->reductions = dp->gathers = 0;
      const auto never = ddp_test::backward(m, P, sync, patterns[step], step, rank, st);
      // Buckets launched before finish: those complete, with overlap only.
      size_t complete = 0;
      for (size_t b = 0; b < nb; ++b) {
        const auto& bk = P.buckets()[b];
        bool all = true;
        for (size_t i : never) all = all && !(i >= bk.param_begin && i < bk.param_end);
        complete += all;
      }
      EXPECT_EQ(sync.grad_reductions_launched(), c.overlap ? complete : 0u) << "step " << step;
      sync.finish_grad_sync(st);
      sync.finish_grad_sync(st);
      EXPECT_EQ(sync.grad_reductions_launched(), nb);
      // each bucket reduced exactly once (hybrid: a reduce-scatter in the instance, an all-reduce
      // over the instances)
      const int per_bucket = (shard > 1 ? 1 : 0) + (c.instances > 1 ? 1 : 0);
      EXPECT_EQ(dp->reductions, per_bucket * static_cast<int>(nb)) << "step " << step;
      // Reduced gradients: bitwise the summed ones, in the owned ranges.
      const std::vector<float> g = testing::to_host(P.grads_flat(), st);
      int64_t bad = 0;
      for (int64_t e = 0; e < total; ++e)
        if (owned(sync.owned_ranges(), e) && g[e] != ref.grads[step][e]) ++bad;
      EXPECT_EQ(bad, 0) << "reduced gradient elements differing from the sum, step " << step;
      dp->gathers = 0;
      opt.step(kLr, st);
      EXPECT_EQ(dp->gathers, c.distributed && shard > 1 ? static_cast<int>(nb) : 0);
    }
    sync.finish_param_sync(st);
    const std::vector<float> p = testing::to_host(P.params_flat(), st);
    OwnedTensor mm(DType::kF32, Device::cpu(), {total}), vv(DType::kF32, Device::cpu(), {total});
    opt.gather_moments(mm, vv, st);
    const std::vector<float> m_full = testing::to_host(mm.t, st), v_full = testing::to_host(vv.t, st);
    const OptimizerScalars sc = opt.read_scalars_sync(st);
    EXPECT_EQ(sc.step, kSteps);
    if (!c.distributed) {  // same operations in the same order: bitwise
      EXPECT_EQ(p, ref.params);
      EXPECT_EQ(m_full, ref.m);
      EXPECT_EQ(v_full, ref.v);
      EXPECT_EQ(sc.grad_norm, ref.scalars.grad_norm);
    } else {  // the squared norm summed over DP shards: another order
      EXPECT_LT(testing::rel_err(p, ref.params), 1e-6);
      EXPECT_LT(testing::rel_err(m_full, ref.m), 1e-6);
      EXPECT_LT(testing::rel_err(v_full, ref.v), 1e-6);
      EXPECT_NEAR(sc.grad_norm, ref.scalars.grad_norm, 1e-6 * ref.scalars.grad_norm);
      // The compact moments are exactly the owned elements of the gathered ones.
      const std::vector<float> m_own = testing::to_host(opt.exp_avg(), st);
      int64_t s = 0;
      for (const auto& r : sync.owned_ranges())
        for (int64_t e = r.begin; e < r.end; ++e) ASSERT_EQ(m_own[s++], m_full[e]);
    }
  });
}

std::vector<DpCase> dp_cases() {
  std::vector<DpCase> v;
  for (int dp : {2, 4})
    for (bool overlap : {false, true})
      for (bool dist : {false, true})
        for (int64_t bs : {int64_t{0}, int64_t{700}}) v.push_back({dp, overlap, dist, bs});
  // Hybrid sharding: DP 4 as 2 instances of 2 ranks; DP 2 as 2 instances of one rank (no shard).
  for (bool overlap : {false, true})
    for (int64_t bs : {int64_t{0}, int64_t{700}}) v.push_back({4, overlap, true, bs, 2});
  v.push_back({2, false, true, 700, 2});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, DataParallel, ::testing::ValuesIn(dp_cases()), [](const auto& info) {
  const DpCase& c = info.param;
  return fmt::format("dp{}_{}_{}_{}{}", c.dp, c.overlap ? "overlap" : "sync", c.distributed ? "distopt" : "allreduce",
                     c.bucket_size ? "buckets" : "onebucket",
                     c.instances > 1 ? fmt::format("_instances{}", c.instances) : "");
});

// Hybrid sharding's negative control: with GradSync's cross-instance all-reduce dropped (the
// counting communicator skips all-reduces over "*-replicas" groups), each instance keeps only the
// sum over its own ranks, which MatchesSingleRankOnSummedGradients' check (every owned element ==
// the sum over all DP ranks) catches; with it, the check passes. DP 4 as 2 instances of 2 ranks.
TEST(DataParallel, HybridShardingNeedsTheCrossInstanceAllReduce) {
  const Model m = ddp_test::gpt_like(4);
  const ParamLayout layout{2, 700};
  for (const bool drop : {false, true}) {
    SCOPED_TRACE(drop ? "all-reduce over the instances dropped" : "as built");
    run_thread_ranks(4, [&](int rank, std::shared_ptr<Communicator> world) {
      Stream st;
      auto dp = std::make_shared<ddp_test::CountingCommunicator>(world);
      dp->drop_replica_all_reduce = drop;
      ParamStore P(m.specs, DType::kF32, Device::cpu(), layout);
      P.initialize(99, st);
      DdpConfig dc;
      dc.use_distributed_optimizer = true;
      dc.num_distributed_optimizer_instances = 2;
      GradSync sync(P, dp, dc);
      sync.zero_grad_buffer(st);
      ddp_test::backward(m, P, sync, Pattern::kInOrder, 0, rank, st);
      sync.finish_grad_sync(st);
      const std::vector<float> g = testing::to_host(P.grads_flat(), st);
      int64_t owned_n = 0, differ_all = 0, differ_instance = 0;
      for (size_t i = 0; i < P.size(); ++i) {
        const std::vector<float> all = ddp_test::local_grad(P, i, 0, -1, 4, 2);
        const std::vector<float> mine = ddp_test::local_grad(P, i, 0, -1, 4, 2, rank / 2);
        const int64_t off = P.info(i).offset;
        for (int64_t e = 0; e < P.info(i).numel; ++e) {
          if (!owned(sync.owned_ranges(), off + e)) continue;
          ++owned_n;
          differ_all += g[off + e] != all[e];
          differ_instance += g[off + e] != mine[e];
        }
      }
      ASSERT_GT(owned_n, 100);
      EXPECT_EQ(drop ? differ_instance : differ_all, 0);
      EXPECT_GT(drop ? differ_all : differ_instance, owned_n * 9 / 10);
    });
  }
}

// Overlap on and off give bitwise identical parameters (the same collectives in the same order).
// Asking for the copy-engine collectives on CPU ranks falls back to the communicator (the
// collectives need CUDA peer memory), says why, and changes nothing.
TEST(DataParallel, OverlapOnOffBitwise) {
  const Model m = ddp_test::gpt_like(4);
  std::vector<float> out[3];
  for (int variant = 0; variant < 3; ++variant) {
    const int overlap = variant >= 1;
    std::mutex mu;
    run_thread_ranks(2, [&](int rank, std::shared_ptr<Communicator> w) {
      Stream st;
      ParamStore P(m.specs, DType::kF32, Device::cpu(), ParamLayout{2, 500});
      P.initialize(5, st);
      DdpConfig dc;
      dc.overlap_grad_reduce = overlap;
      dc.overlap_param_gather = overlap;
      dc.use_distributed_optimizer = true;
      dc.copy_engine = variant == 2;
      GradSync sync(P, w, dc);
      EXPECT_FALSE(sync.copy_engine_active());
      EXPECT_NE(sync.why_not_copy_engine().find(variant == 2 ? "NCCL" : "not requested"), std::string::npos)
          << sync.why_not_copy_engine();
      AdamWOptimizer opt(sync, opt_config(), st);
      for (int step = 0; step < kSteps; ++step) {
        sync.zero_grad_buffer(st);
        ddp_test::backward(m, P, sync, Pattern::kInOrder, step, rank, st);
        opt.step(kLr, st);
      }
      sync.finish_param_sync(st);
      std::lock_guard<std::mutex> lock(mu);
      if (rank == 1) out[variant] = testing::to_host(P.params_flat(), st);
    });
  }
  ASSERT_FALSE(out[0].empty());
  EXPECT_EQ(out[0], out[1]);
  EXPECT_EQ(out[0], out[2]);
}

// A full-iteration CUDA graph without the optimizer replays zero_grad_buffer ... finish_grad_sync
// on the device but none of their host bookkeeping (StepRunner::step_full_iteration). Emulated on
// CPU ranks: after a step reduced as usual, the gradients are set to their reduced values (what
// the replay leaves) and mark_replayed_grad_sync() records the step as finished: the optimizer's
// own finish_grad_sync must then reduce nothing (it used to sum the reduced gradients over DP a
// second time: twice the gradients on 2 ranks), and the next step starts normally.
TEST(DataParallel, ReplayedGradSyncIsNotReducedAgain) {
  const Model m = ddp_test::gpt_like(2);
  run_thread_ranks(2, [&](int rank, std::shared_ptr<Communicator> w) {
    Stream st;
    ParamStore P(m.specs, DType::kF32, Device::cpu(), ParamLayout{2, 500});
    P.initialize(5, st);
    GradSync sync(P, w, DdpConfig{});
    sync.zero_grad_buffer(st);
    ddp_test::backward(m, P, sync, Pattern::kInOrder, 0, rank, st);
    sync.finish_grad_sync(st);
    const std::vector<float> reduced = testing::to_host(P.grads_flat(), st);
    sync.start_param_sync(st);  // the optimizer step ends the step: host state reset
    // the "replayed" step: the graph leaves the reduced gradients, the host marks it finished
    sync.mark_replayed_grad_sync();
    EXPECT_EQ(sync.grad_reductions_launched(), P.buckets().size());
    sync.finish_grad_sync(st);
    EXPECT_EQ(testing::to_host(P.grads_flat(), st), reduced) << "rank " << rank << ": reduced a second time";
    expect_error([&] { sync.grads_ready(0, 1, st); }, "after finish_grad_sync");
    sync.zero_grad_buffer(st);  // a new step
    EXPECT_EQ(sync.grad_reductions_launched(), 0u);
  });
}

// --grad-reduce-in-bf16: every bucket's gradients are rounded to bf16, summed over DP by the
// communicator (the thread communicator sums in double in rank order and rounds once), and
// widened back: the reduced (owned) gradients equal that formula bitwise, for DP 2 and 4, one or
// several buckets, with and without overlap and the distributed optimizer; the padding stays 0.
TEST(DataParallel, GradReduceInBf16) {
  const Model m = ddp_test::gpt_like(4);
  for (int dp : {2, 4}) {
    for (int variant = 0; variant < 4; ++variant) {
      const bool overlap = variant & 1, dist = variant & 2;
      const ParamLayout layout{dp, overlap ? 700 : 0};
      SCOPED_TRACE(::testing::Message() << "dp " << dp << (overlap ? " overlap" : "") << (dist ? " distopt" : ""));
      run_thread_ranks(dp, [&](int rank, std::shared_ptr<Communicator> world) {
        Stream st;
        ParamStore P(m.specs, DType::kF32, Device::cpu(), layout);
        P.initialize(3, st);
        DdpConfig dc;
        dc.overlap_grad_reduce = overlap;
        dc.use_distributed_optimizer = dist;
        dc.grad_reduce_in_bf16 = true;
        dc.copy_engine = true;  // CPU ranks: falls back to the communicator, with the reason
        GradSync sync(P, world, dc);
        EXPECT_FALSE(sync.copy_engine_active());
        for (int step = 0; step < 2; ++step) {
          sync.zero_grad_buffer(st);
          ddp_test::backward(m, P, sync, Pattern::kInOrder, step, rank, st);
          sync.finish_grad_sync(st);
          const std::vector<float> g = testing::to_host(P.grads_flat(), st);
          std::vector<float> expect(g.size(), 0.f);
          for (size_t i = 0; i < P.size(); ++i) {
            std::vector<double> acc(static_cast<size_t>(P.info(i).numel), 0.0);
            for (int r = 0; r < dp; ++r) {
              const std::vector<float> gr = ddp_test::local_grad(P, i, step, r);
              for (size_t e = 0; e < acc.size(); ++e) acc[e] += bf16_bits_to_f32(f32_to_bf16_bits(gr[e]));
            }
            for (size_t e = 0; e < acc.size(); ++e)
              expect[P.info(i).offset + e] = bf16_bits_to_f32(f32_to_bf16_bits(static_cast<float>(acc[e])));
          }
          int64_t bad = 0, checked = 0;
          for (int64_t e = 0; e < static_cast<int64_t>(g.size()); ++e) {
            if (!owned(sync.owned_ranges(), e)) continue;
            ++checked;
            if (g[e] != expect[e]) ++bad;
          }
          EXPECT_EQ(checked, sync.owned_elements());
          EXPECT_EQ(bad, 0) << "step " << step;
          sync.start_param_sync(st);
          sync.finish_param_sync(st);
        }
      });
    }
  }
}

// bf16 model parameters: the fp32 main parameters are sharded (only the owned elements stored),
// the bf16 parameters are whole on every rank and equal the rounding of the gathered main ones.
TEST(DataParallel, ShardedMainParamsBf16) {
  const Model m = ddp_test::gpt_like(4);
  const int dp = 2;
  const ParamLayout layout{dp, 700};
  const Reference ref = reference(m, layout, dp, DType::kBF16);
  run_thread_ranks(dp, [&](int rank, std::shared_ptr<Communicator> w) {
    Stream st;
    ParamStore P(m.specs, DType::kBF16, Device::cpu(), layout);
    DdpConfig dc;
    dc.overlap_grad_reduce = true;
    dc.overlap_param_gather = true;
    dc.use_distributed_optimizer = true;
    GradSync sync(P, w, dc);
    AdamWOptimizer opt(sync, opt_config(), st);  // before initialize, as the trainer does
    P.initialize(99, st);
    const int64_t total = P.total_elements();
    ASSERT_TRUE(P.main_sharded());
    EXPECT_EQ(P.main_storage_elements() * dp, total);
    EXPECT_EQ(opt.state_elements() * dp, 3 * total);  // 12 bytes per element / DP
    expect_error([&] { (void)P.main(0); }, "sharded");
    for (int step = 0; step < kSteps; ++step) {
      sync.zero_grad_buffer(st);
      ddp_test::backward(m, P, sync, step == 1 ? Pattern::kLateNever : Pattern::kInOrder, step, rank, st);
      opt.step(kLr, st);
    }
    OwnedTensor full(DType::kF32, Device::cpu(), {total});
    opt.gather_main(full, st);
    const std::vector<float> main = testing::to_host(full.t, st);
    EXPECT_LT(testing::rel_err(main, ref.main), 1e-6);
    OwnedTensor rounded(DType::kBF16, Device::cpu(), {total});
    cast(rounded.t, full.t, st);
    EXPECT_EQ(testing::to_host(P.params_flat(), st), testing::to_host(rounded.t, st));
  });
}

// kSteps steps of a sharded bf16 store (in-order backward), the gathered fp32 main parameters
// against the reference's; returns their bf16 rounding (what a gathered bucket must hold).
std::vector<float> train_sharded_bf16(const Model& m, ParamStore& P, GradSync& sync, AdamWOptimizer& opt,
                                      const Reference& ref, int rank, const Stream& st) {
  for (int step = 0; step < kSteps; ++step) {
    sync.zero_grad_buffer(st);
    ddp_test::backward(m, P, sync, Pattern::kInOrder, step, rank, st);
    opt.step(kLr, st);
  }
  const int64_t total = P.total_elements();
  OwnedTensor full(DType::kF32, Device::cpu(), {total});
  opt.gather_main(full, st);
  EXPECT_LT(testing::rel_err(testing::to_host(full.t, st), ref.main), 1e-6);
  OwnedTensor rounded(DType::kBF16, Device::cpu(), {total});
  cast(rounded.t, full.t, st);
  return testing::to_host(rounded.t, st);
}

// optim_grads_params (ZeRO-3) with bf16 parameters: each rank stores its owned slice of the bf16
// parameters, written by the optimizer from its fp32 main slice; a unit's buckets gathered by
// params_begin hold the rounding of the reference's main parameters; the next unit's buckets are
// prefetched and reused, so a forward or backward pass over the layers gathers every bucket
// exactly once; slots are returned after use; the storage is the owned slices plus the slots.
TEST(DataParallel, ShardedParamsBf16) {
  const Model m = ddp_test::gpt_like(4);
  const int dp = 2;
  const ParamLayout layout{dp, 700};
  const Reference ref = reference(m, layout, dp, DType::kBF16);
  run_thread_ranks(dp, [&](int rank, std::shared_ptr<Communicator> w) {
    Stream st;
    ParamStore P(m.specs, DType::kBF16, Device::cpu(), layout);
    DdpConfig dc;
    dc.use_distributed_optimizer = dc.shard_grads = dc.shard_params = true;
    GradSync sync(P, w, dc);
    AdamWOptimizer opt(sync, opt_config(), st);  // before initialize, as the trainer does
    P.initialize(99, st);
    ASSERT_TRUE(P.params_staged());
    EXPECT_EQ(P.param_slots(), P.param_slots_needed());
    EXPECT_LT(P.param_slots(), static_cast<int>(P.buckets().size()));
    EXPECT_EQ(sync.param_bytes(), (sync.owned_elements() + P.param_slots() * P.largest_dense_bucket()) * 2);
    expect_error([&] { (void)P.params_flat(); }, "sharded");
    expect_error([&] { (void)P.param(0); }, "is not gathered");
    const std::vector<float> want = train_sharded_bf16(m, P, sync, opt, ref, rank, st);
    for (const bool backward : {false, true}) {
      SCOPED_TRACE(backward ? "backward" : "forward");
      size_t bound = 0;  // kept from the last pass (the forward's last bucket): not gathered again
      for (size_t b = 0; b < P.buckets().size(); ++b) bound += P.param_bound(b) ? 1 : 0;
      EXPECT_EQ(bound, backward ? 1u : 0u);
      const size_t before = sync.param_gathers();
      ddp_test::for_each_unit(m, backward, [&](size_t n, ddp_test::LayerRange r, ddp_test::LayerRange next) {
        sync.params_begin(r.first, r.end, backward, next.first, next.end, st);
        for (size_t i = r.first; i < r.end; ++i) {
          const std::vector<float> got = testing::to_host(P.param(i), st);
          const auto at = want.begin() + P.info(i).offset;
          ASSERT_EQ(got, std::vector<float>(at, at + P.info(i).numel)) << P.info(i).name;
        }
        const size_t lo = P.bucket_of(r.end - 1), hi = P.bucket_of(r.first);
        for (size_t i = next.first; i < next.end; ++i)  // the next unit's buckets: prefetched
          EXPECT_TRUE(P.param_bound(P.bucket_of(i))) << "layer " << n << " prefetching " << P.info(i).name;
        sync.params_end(r.first, r.end, backward, st);
        for (size_t b = lo; b <= hi; ++b)  // returned, but for the bucket the next unit may share
          if (b != (backward ? hi : lo) && (next.first == next.end || b < P.bucket_of(next.end - 1) ||
                                            b > P.bucket_of(next.first)))
            EXPECT_FALSE(P.param_bound(b)) << "bucket " << b;
      });
      EXPECT_EQ(sync.param_gathers() - before, P.buckets().size() - bound);
    }
    expect_error([&] { sync.params_end(0, 1, false, st); }, "was not begun");
    expect_error([&] { sync.params_begin(0, 1, false, 0, P.size() + 1, st); }, "outside");
  });
}

// gpt_like(num_layers) whose decoder layers 1.. end with two experts' fc1 weights (expert, as
// MoeExperts declares them; sizes differ per layer): MoE layers 0, 1, 2 for num_layers 4.
Model moe_like(int num_layers) {
  const Model g = ddp_test::gpt_like(num_layers);
  Model m;
  for (size_t k = 0; k < g.layers.size(); ++k) {
    const size_t first = m.specs.size();
    for (size_t i = g.layers[k].first; i < g.layers[k].end; ++i) m.specs.push_back(g.specs[i]);
    if (k >= 2 && k + 1 < g.layers.size()) {  // layers[0] is the embedding, the last the final norm
      for (int e = 0; e < 2; ++e) {
        ParamSpec p;
        p.name = "decoder.layers." + std::to_string(k - 1) + ".mlp.experts.local_experts." + std::to_string(e) +
                 ".linear_fc1.weight";
        p.shape = {static_cast<int64_t>(20 + 3 * e + 4 * k), 16};
        p.init_std = 0.2f;
        p.expert = true;
        m.specs.push_back(p);
      }
    }
    m.layers.push_back({first, m.specs.size()});
  }
  return m;
}

// optim_grads_params with MoE expert parameters (docs/fsdp.md "Expert buckets"): the experts are
// sharded like the dense parameters (EP 1 x DP 2, the expert group the data-parallel one) and
// staged in expert slots: 2 for parameters, 1 for gradients, each of the largest MoE layer's
// expert elements, MoE layer k always in slot k mod n at the same address (what the grouped-GEMM
// tables cache). Three steps equal one rank on the summed gradients; a pass gathers every bucket
// once; storage is the owned slices plus the slots (less than whole experts); a layer whose slot
// another live layer holds is an error (parameters and gradients); experts overwritten in their
// slot are gathered again after the optimizer step (the negative control: a slot kept across the
// step would show the garbage).
TEST(DataParallel, ShardedExpertsBf16) {
  const Model m = moe_like(4);
  const int dp = 2;
  const ParamLayout layout{dp, 500};  // an expert of >= 500 elements gets a bucket of its own
  const Reference ref = reference(m, layout, dp, DType::kBF16);
  run_thread_ranks(dp, [&](int rank, std::shared_ptr<Communicator> w) {
    Stream st;
    ParamStore P(m.specs, DType::kBF16, Device::cpu(), layout);
    ASSERT_EQ(P.expert_regions().size(), 3u);
    int64_t experts = 0;
    size_t expert_buckets = 0;
    for (size_t b = 0; b < P.buckets().size(); ++b) {
      if (!P.buckets()[b].expert) continue;
      experts += P.buckets()[b].numel();
      ++expert_buckets;
      EXPECT_GE(P.moe_layer_of(b), 0);
    }
    EXPECT_GT(expert_buckets, 3u);  // some MoE layer's experts span two buckets
    DdpConfig dc;
    dc.use_distributed_optimizer = dc.shard_grads = dc.shard_params = true;
    GradSync sync(P, w, dc);
    AdamWOptimizer opt(sync, opt_config(), st);
    P.initialize(99, st);
    EXPECT_EQ(P.expert_param_slots(), 2);
    EXPECT_EQ(P.expert_grad_slots(), 1);
    const int64_t slot = P.expert_slot_length();
    EXPECT_EQ(sync.param_bytes(),
              (sync.owned_elements() + P.param_slots() * P.largest_dense_bucket() + 2 * slot) * 2);
    EXPECT_EQ(sync.grad_bytes(), (sync.owned_elements() + P.grad_slots() * P.largest_dense_bucket() + slot) * 4);
    EXPECT_LT(2 * slot, experts);  // less than the whole experts the resident buffer held
    const std::vector<float> want = train_sharded_bf16(m, P, sync, opt, ref, rank, st);
    std::map<size_t, const void*> address;  // expert parameter -> its address in the slot
    const auto pass = [&](bool backward) {
      SCOPED_TRACE(backward ? "backward" : "forward");
      ddp_test::for_each_unit(m, backward, [&](size_t, ddp_test::LayerRange r, ddp_test::LayerRange next) {
        sync.params_begin(r.first, r.end, backward, next.first, next.end, st);
        for (size_t i = r.first; i < r.end; ++i) {
          const Tensor t = P.param(i);
          const std::vector<float> got = testing::to_host(t, st);
          const auto at = want.begin() + P.info(i).offset;
          ASSERT_EQ(got, std::vector<float>(at, at + P.info(i).numel)) << P.info(i).name;
          if (!P.info(i).expert) continue;
          const auto [it, fresh] = address.emplace(i, t.data());
          EXPECT_EQ(it->second, t.data()) << P.info(i).name << ": the expert's address moved";
        }
        sync.params_end(r.first, r.end, backward, st);
      });
    };
    for (const bool backward : {false, true}) {
      const size_t before = sync.param_gathers();
      pass(backward);
      EXPECT_LE(sync.param_gathers() - before, P.buckets().size());
      EXPECT_GE(sync.param_gathers() - before, P.buckets().size() - 1);  // the last bucket kept
    }
    // MoE layers 0 and 2 share expert slot 0, layer 1 has slot 1.
    const auto first_expert = [&](int layer) {
      return P.index("decoder.layers." + std::to_string(layer) + ".mlp.experts.local_experts.0.linear_fc1.weight");
    };
    EXPECT_EQ(address.at(first_expert(1)), address.at(first_expert(3)));
    EXPECT_NE(address.at(first_expert(1)), address.at(first_expert(2)));
    // Garbage written into MoE layer 0's slot: the next use after the optimizer step's end
    // (start_param_sync) gathers the owned slices again.
    const ddp_test::LayerRange l1 = m.layers[2];
    sync.params_begin(l1.first, l1.end, false, 0, 0, st);
    fill(P.param(first_expert(1)), std::nanf(""), st);
    sync.params_end(l1.first, l1.end, false, st);
    sync.start_param_sync(st);
    pass(false);
    // A prefetch onto a slot the unit in use holds (full recompute: the backward of a group's first
    // layer names the previous group's, here MoE layer 2 -> 0) is skipped; the layer is gathered
    // at its own params_begin, after MoE layer 2 went back.
    {
      const ddp_test::LayerRange l3 = m.layers[4], l1 = m.layers[2];
      sync.params_begin(l3.first, l3.end, true, l1.first, l1.end, st);
      EXPECT_FALSE(P.param_bound(P.bucket_of(first_expert(1))));
      EXPECT_TRUE(P.param_bound(P.bucket_of(l1.first)));  // its dense buckets are prefetched
      sync.params_end(l3.first, l3.end, true, st);
      sync.params_begin(l1.first, l1.end, true, 0, 0, st);
      const size_t i = first_expert(1);
      const auto at = want.begin() + P.info(i).offset;
      EXPECT_EQ(testing::to_host(P.param(i), st), std::vector<float>(at, at + P.info(i).numel));
      sync.params_end(l1.first, l1.end, true, st);
    }
    // Gradients: MoE layer 0 holds the one expert gradient slot until its buckets are reduced.
    sync.zero_grad_buffer(st);
    (void)P.grad(first_expert(1));
    expect_error([&] { (void)P.grad(first_expert(2)); }, "MoE layer 1 ('decoder.layers.2'");
    sync.zero_grad_buffer(st);
    (void)P.grad(first_expert(2));  // released by zero_grad_buffer
    // Parameters: MoE layer 0 in use, MoE layer 2 (the same slot) cannot be gathered.
    const ddp_test::LayerRange l3 = m.layers[4];
    sync.params_begin(l1.first, l1.end, false, 0, 0, st);
    expect_error([&] { sync.params_begin(l3.first, l3.end, false, 0, 0, st); },
                 "which MoE layer 0 ('decoder.layers.1') still holds");
  });
}

// Tensor x data parallelism (TP 2 x DP 2, distributed optimizer, overlapped buckets): every rank's
// parameter shards after three clipped steps equal the matching slices of one rank's run.
TEST(DataParallel, TensorParallelTimesDataParallel) {
  const int tp = 2, dp = 2;
  const Model global = ddp_test::gpt_like(3);
  const Reference ref = reference(global, ParamLayout{1, 0}, dp);
  ParamStore G(global.specs, DType::kF32, Device::cpu(), ParamLayout{1, 0});
  ASSERT_LT(ref.scalars.clip_coeff, 0.5f);
  run_thread_ranks(tp * dp, [&](int rank, std::shared_ptr<Communicator> world) {
    auto tpg = world->split(rank / tp, rank, "tp");
    auto dpg = world->split(rank % tp, rank, "dp");
    const int t = tpg->rank(), d = dpg->rank();
    const Model m = ddp_test::gpt_like(3, tp, t);
    Stream st;
    ParamStore P(m.specs, DType::kF32, Device::cpu(), ParamLayout{dp, 600});
    P.initialize(99, st);
    DdpConfig dc;
    dc.overlap_grad_reduce = true;
    dc.overlap_param_gather = true;
    dc.use_distributed_optimizer = true;
    GradSync sync(P, dpg, dc);
    AdamWOptimizer opt(sync, opt_config(), st, {nullptr, tpg, t, false});
    for (int step = 0; step < kSteps; ++step) {
      sync.zero_grad_buffer(st);
      ddp_test::backward(m, P, sync, Pattern::kInOrder, step, d, st);
      opt.step(kLr, st);
    }
    sync.finish_param_sync(st);
    std::vector<float> mine, theirs;
    for (size_t i = 0; i < P.size(); ++i) {
      const ParamInfo& p = P.info(i);
      const std::vector<float> local = testing::to_host(P.param(i), st);
      const ParamInfo& g = G.info(G.index(p.name));
      for (int64_t e = 0; e < p.numel; ++e) {
        mine.push_back(local[e]);
        theirs.push_back(ref.params[g.offset + ddp_test::global_index(p, e)]);
      }
    }
    EXPECT_LT(testing::rel_err(mine, theirs), 1e-6) << "tp " << t << " dp " << d;
    EXPECT_NEAR(opt.read_scalars_sync(st).grad_norm, ref.scalars.grad_norm, 1e-6 * ref.scalars.grad_norm);
  });
}

// A parameter flagged shared_embedding_copy (the tied output embedding on the last pipeline
// stage) is left out of the gradient norm: the norm equals that of the model without it.
TEST(DataParallel, SharedEmbeddingCopyExcludedFromNorm) {
  Stream st;
  auto run = [&](bool with_copy, bool flag) {
    Model m = ddp_test::gpt_like(2, 1, 0, with_copy);
    if (with_copy) m.specs.back().shared_embedding_copy = flag;
    ParamStore P(m.specs, DType::kF32, Device::cpu(), ParamLayout{1, 0});
    P.initialize(3, st);
    AdamWOptimizer opt(P, opt_config(), st);
    for (size_t i = 0; i < P.size(); ++i) testing::upload(P.grad(i), ddp_test::local_grad(P, i, 0, 0), st);
    opt.step(kLr, st);
    return opt.read_scalars_sync(st).grad_norm;
  };
  const float without = run(false, false), flagged = run(true, true), counted = run(true, false);
  EXPECT_NEAR(flagged, without, 1e-6 * without);
  EXPECT_GT(counted, without * 1.01f);  // the copy's gradient would have counted
}

// --- Flags --------------------------------------------------------------------------------

PretrainArgs parse(const std::string& line, int dp = 1) {
  CLI::App app;
  PretrainArgs a;
  add_pretrain_options(app, a);
  app.parse("--train-iters 2 --lr 1e-3 --mock-data " + line, false);
  a.model.vocab_size = 64;
  a.data_parallel_size = dp;
  validate_pretrain_args(a);
  return a;
}

// optim_grads with --overlap-grad-reduce (docs/fsdp.md "Overlapped reduce-scatter"): the
// reduce-scatters into the shard run on the communication stream and a slot stays bound while its
// bucket is in flight, retired at the backward bracket that writes the bucket again or when the
// slots run short. On CPU (inline streams, no-op events) the shard after each step of three
// micro-batches equals the non-overlapped run's bitwise: DP 4 (and hybrid sharding, 2 instances
// of 2), with sharded parameters or not, the minimum slot count (grad_slots_needed, unchanged by
// the overlap) or two more, the embedding's backward unbracketed (as GPTModel's) or bracketed.
// Every bound bucket has a slot of its own; with spare slots buckets stay in flight between hooks
// (the overlap happens); none after finish_grad_sync.
TEST(DataParallel, OverlappedShardedGradsBitwise) {
  const Model m = ddp_test::gpt_like(6);
  const int dp = 4;
  struct Result {
    std::vector<std::vector<float>> shards;  // per step
    size_t most_in_flight = 0;
  };
  const auto run = [&](bool overlap, int k, bool params, int extra_slots, bool bracket_embedding) {
    std::vector<Result> results(dp);
    run_thread_ranks(dp, [&](int rank, std::shared_ptr<Communicator> w) {
      Stream st;
      ParamStore P(m.specs, DType::kF32, Device::cpu(), ParamLayout{dp / k, 300});
      const int needed = P.grad_slots_needed();
      DdpConfig dc;
      dc.use_distributed_optimizer = dc.shard_grads = true;
      dc.shard_params = params;
      dc.overlap_grad_reduce = overlap;
      dc.num_distributed_optimizer_instances = k;
      if (extra_slots > 0) dc.grad_slots = needed + extra_slots;
      GradSync sync(P, w, dc);
      P.initialize(5, st);
      ASSERT_EQ(P.grad_slots(), needed + extra_slots);
      ASSERT_LT(P.grad_slots(), static_cast<int>(P.buckets().size()));
      EXPECT_EQ(sync.params_every_use(), params || overlap);
      Result& res = results[static_cast<size_t>(rank)];
      const auto check_slots = [&] {
        std::set<const void*> slots;
        size_t bound = 0;
        for (size_t b = 0; b < P.buckets().size(); ++b) {
          if (!P.grad_bound(b)) continue;
          ++bound;
          slots.insert(P.bucket_grads(b).data());
        }
        EXPECT_EQ(slots.size(), bound) << "two bound buckets share a slot";
        res.most_in_flight = std::max(res.most_in_flight, sync.grad_slots_in_flight());
      };
      for (int step = 0; step < 2; ++step) {
        sync.zero_grad_buffer(st);
        for (int mb = 0; mb < 3; ++mb) {
          ddp_test::for_each_unit(m, false, [&](size_t, ddp_test::LayerRange r, ddp_test::LayerRange next) {
            sync.params_begin(r.first, r.end, false, next.first, next.end, st);
            sync.params_end(r.first, r.end, false, st);
          });
          ddp_test::for_each_unit(m, true, [&](size_t, ddp_test::LayerRange r, ddp_test::LayerRange next) {
            const bool bracket = r.first > 0 || bracket_embedding;  // layers[0]: the embedding
            if (next.first == 0 && !bracket_embedding) next = {0, 0};
            if (bracket) sync.params_begin(r.first, r.end, true, next.first, next.end, st);
            ddp_test::accumulate_grads(P, r.first, r.end, step * 3 + mb, rank, st);
            if (bracket) sync.params_end(r.first, r.end, true, st);
            check_slots();
            sync.grads_ready(r.first, r.end, st);
            check_slots();
          });
        }
        sync.finish_grad_sync(st);
        EXPECT_EQ(sync.grad_slots_in_flight(), 0u);
        res.shards.push_back(testing::to_host(sync.grad_shard(), st));
        sync.start_param_sync(st);
      }
    });
    return results;
  };
  for (const int k : {1, 2}) {
    for (const bool params : {false, true}) {
      const std::vector<Result> ref = run(false, k, params, 0, false);
      for (const int extra : {0, 2}) {
        for (const bool bracket_embedding : {false, true}) {
          SCOPED_TRACE(fmt::format("instances {}, sharded parameters {}, {} extra slots, embedding bracketed {}", k,
                                   params, extra, bracket_embedding));
          const std::vector<Result> got = run(true, k, params, extra, bracket_embedding);
          for (int r = 0; r < dp; ++r) {
            EXPECT_EQ(got[r].shards, ref[r].shards) << "rank " << r;
            EXPECT_EQ(ref[r].most_in_flight, 0u);
            if (extra > 0) EXPECT_GT(got[r].most_in_flight, 0u) << "rank " << r;
          }
        }
      }
    }
  }
}

TEST(DdpFlags, DefaultsAndValidation) {
  PretrainArgs a = parse("");
  EXPECT_FALSE(a.overlap_grad_reduce || a.overlap_param_gather || a.ddp_bucket_size);
  EXPECT_EQ(a.param_layout().bucket_size, 0);  // no overlap: one bucket (Megatron)
  a = parse("--overlap-grad-reduce", 2);
  EXPECT_EQ(a.param_layout().bucket_size, 40000000);
  EXPECT_EQ(a.param_layout().data_parallel_size, 2);
  a = parse("--overlap-grad-reduce", 64);
  EXPECT_EQ(a.param_layout().bucket_size, 64000000);
  a = parse("--overlap-grad-reduce --ddp-bucket-size 1000");
  EXPECT_EQ(a.param_layout().bucket_size, 1000);
  a = parse("--ddp-bucket-size 1000");
  EXPECT_EQ(a.param_layout().bucket_size, 0);
  a = parse("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather");
  const DdpConfig dc = a.ddp_config();
  EXPECT_TRUE(dc.overlap_grad_reduce && dc.overlap_param_gather && dc.use_distributed_optimizer);
  EXPECT_FALSE(dc.copy_engine);
  EXPECT_TRUE(parse("--ddp-copy-engine").ddp_config().copy_engine);
  EXPECT_FALSE(dc.grad_reduce_in_bf16);
  EXPECT_TRUE(parse("--grad-reduce-in-bf16").ddp_config().grad_reduce_in_bf16);
  expect_error([] { parse("--overlap-param-gather --overlap-grad-reduce"); },
               "--overlap-param-gather requires --use-distributed-optimizer");
  expect_error([] { parse("--overlap-param-gather --use-distributed-optimizer"); },
               "--overlap-param-gather requires --overlap-grad-reduce");
  try {  // refused as the flag is read (a CLI11 error, with the value as given)
    parse("--overlap-grad-reduce --ddp-bucket-size=-5");
    ADD_FAILURE() << "--ddp-bucket-size=-5 accepted";
  } catch (const CLI::ParseError& e) {
    EXPECT_NE(std::string(e.what()).find("--ddp-bucket-size: must be an integer >= 0, got '-5'"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace mt
