// N ranks produce what 1 rank produces (DESIGN.md principle 4): tensor parallelism (with and
// without sequence parallelism) x data parallelism on CPU, ranks as threads. Three training
// iterations with dropout, weight decay and clipping; losses every iteration, gradients of the
// last iteration and parameters after it, gathered from the shards, against the single-rank run.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "comm/thread_comm.h"
#include "model/gpt.h"
#include "ops/elementwise.h"
#include "testing/testing.h"
#include "shard_gather.h"
#include "train/train_step.h"

namespace mt {
namespace {

using testing::OwnedTensor;
using testing::place;

constexpr int kIters = 3;

GptConfig config() {
  GptConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.seq_length = 8;
  c.vocab_size = 64;  // padded to 64 for tp 1, 2, 4 (divisible by 8 x tp)
  c.make_vocab_size_divisible_by = 8;
  c.hidden_dropout = 0.1f;
  c.attention_dropout = 0.1f;
  c.init_method_std = 0.1f;
  return c;
}

struct Result {
  std::vector<double> losses;                          // per iteration, global mean loss
  std::map<std::string, std::vector<float>> grads;     // global (gathered) tensors
  std::map<std::string, std::vector<float>> params;
};

Result run_layout(int tp, int dp, bool sp, const std::vector<int32_t>& tokens, const std::vector<int32_t>& labels,
                  int64_t mb, int64_t num_micro_total, bool zero = false) {
  const GptConfig c = config();
  const int64_t S = c.seq_length;
  const int64_t M = num_micro_total / dp;  // micro-batches per DP rank
  Result out;
  out.losses.assign(kIters, 0.0);
  std::mutex mu;
  run_thread_ranks(tp * dp, [&](int rank, std::shared_ptr<Communicator> world) {
    // Megatron's order "tp-dp": TP ranks are consecutive.
    ProcessGroups g = ProcessGroups::single();
    g.world = world;
    g.tp = world->split(rank / tp, rank, "tp");
    g.dp = world->split(rank % tp, rank, "dp");
    g.mp = g.tp;
    Stream st(Device::cpu());
    GptModel model(c, mb, DType::kF32, Device::cpu(), g, sp, dp);
    model.params().initialize(1234, st);
    OptimizerConfig oc;
    oc.weight_decay = 0.1f;
    oc.clip_grad = 0.05f;  // small, so clipping is active and depends on the global norm
    // Adam's m / (sqrt(v) + eps) turns a small relative gradient difference on a near-zero
    // element into an O(1) update difference (the key bias even has an exactly-zero gradient, so
    // its fp32 value is pure rounding noise). eps 1e-3 keeps updates proportional to the
    // gradients here, so parameters compare at the gradients' precision.
    oc.eps = 1e-3f;
    AdamWOptimizer opt(model.params(), oc, st, {g.dp, g.mp, g.tp->rank(), zero});
    if (zero) {  // optimizer state per rank: 1/DP of the moments
      EXPECT_EQ(opt.exp_avg().numel() * dp, model.params().total_elements());
    }
    const int d = g.dp->rank();
    std::vector<OwnedTensor> tok, lab;
    std::vector<MicroBatch> mbs;
    for (int64_t m = 0; m < M; ++m) {
      // Global micro-batch m·DP + d (Megatron's sampler order), stored [s, b].
      const int64_t gm = m * dp + d;
      std::vector<int32_t> t(S * mb), l(S * mb);
      for (int64_t i = 0; i < S * mb; ++i) {
        t[i] = tokens[gm * S * mb + i];
        l[i] = labels[gm * S * mb + i];
      }
      tok.push_back(testing::make_int_tensor(t, Device::cpu(), {S, mb}, st));
      lab.push_back(testing::make_int_tensor(l, Device::cpu(), {S, mb}, st));
    }
    OwnedTensor loss(DType::kF32, Device::cpu(), {1});
    const float w = 1.0f / static_cast<float>(S * mb * M * dp);
    for (int64_t m = 0; m < M; ++m) {
      MicroBatch b{tok[m].t, lab[m].t, Tensor()};
      b.loss_weight = w;
      mbs.push_back(b);
    }
    for (int it = 0; it < kIters; ++it) {
      fill(loss, 0.f, st);
      train_step(model, opt, mbs, {77, it, 1e-2f, d, dp}, loss, st);
      const float l = loss.t.data_as<float>()[0];
      std::lock_guard<std::mutex> lock(mu);
      if (g.tp->rank() == 0) out.losses[it] += l;  // sum over DP ranks = global mean
    }
    // Gather this rank's shards (only DP rank 0 of each TP group; DP replicas are equal).
    // Parameters from DP rank 0 (replicas are equal). Gradients: the reduced ones, i.e. with the
    // distributed optimizer each DP rank's owned range, otherwise DP rank 0's whole buffer.
    if (d != 0 && !zero) return;
    const ParamStore& P = model.params();
    const std::vector<ParamStore::Range>* owned = zero ? &opt.owned_ranges() : nullptr;
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < P.size(); ++i) {
      const auto& info = P.info(i);
      int64_t gnumel = 1;
      for (auto x : info.global_shape) gnumel *= x;
      auto& gg = out.grads[info.name];
      auto& gp = out.params[info.name];
      gg.resize(gnumel, NAN);
      gp.resize(gnumel, NAN);
      place(gg, info, testing::to_host(P.grad(i), st), owned);
      if (d == 0) place(gp, info, testing::to_host(P.main(i), st));
    }
  });
  return out;
}

class TensorDataParallel : public ::testing::TestWithParam<std::tuple<int, int, bool, bool>> {};

TEST_P(TensorDataParallel, MatchesSingleRank) {
  const auto [tp, dp, sp, zero] = GetParam();
  const GptConfig c = config();
  const int64_t mb = 2, num_micro = 4;  // global batch 8 sequences
  const auto tokens = testing::randint(num_micro * mb * c.seq_length, 0, 64);
  const auto labels = testing::randint(num_micro * mb * c.seq_length, 0, 64);
  const Result ref = run_layout(1, 1, false, tokens, labels, mb, num_micro);
  const Result par = run_layout(tp, dp, sp, tokens, labels, mb, num_micro, zero);
  for (int it = 0; it < kIters; ++it) EXPECT_NEAR(par.losses[it], ref.losses[it], 1e-5 * ref.losses[it]) << it;
  std::vector<float> all_par, all_ref;
  for (const auto& [name, g] : ref.grads) {
    ASSERT_TRUE(testing::all_finite(par.grads.at(name))) << name << " not fully gathered";
    const double eg = testing::rel_err(par.grads.at(name), g);
    const double ep = testing::rel_err(par.params.at(name), ref.params.at(name));
    if (std::getenv("MT_PRINT_ERR")) std::printf("%-50s grad %.2e param %.2e\n", name.c_str(), eg, ep);
    EXPECT_LT(eg, 1e-5) << "grad " << name;
    EXPECT_LT(ep, 1e-5) << "param " << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, TensorDataParallel,
                         ::testing::Values(std::tuple{2, 1, false, false}, std::tuple{4, 1, false, false},
                                           std::tuple{2, 1, true, false}, std::tuple{4, 1, true, false},
                                           std::tuple{1, 2, false, false}, std::tuple{2, 2, false, false},
                                           std::tuple{2, 2, true, false}, std::tuple{1, 2, false, true},
                                           std::tuple{2, 2, true, true}),
                         [](const auto& info) {
                           return fmt::format("tp{}_dp{}{}{}", std::get<0>(info.param), std::get<1>(info.param),
                                              std::get<2>(info.param) ? "_sp" : "",
                                              std::get<3>(info.param) ? "_distopt" : "");
                         });

TEST(ThreadComm, CollectivesAndSplit) {
  run_thread_ranks(4, [](int rank, std::shared_ptr<Communicator> w) {
    Stream st;
    OwnedTensor t(DType::kF32, Device::cpu(), {3});
    for (int i = 0; i < 3; ++i) t.t.data_as<float>()[i] = static_cast<float>(rank + i);
    w->all_reduce(t, ReduceOp::kSum, st);
    EXPECT_EQ(t.t.data_as<float>()[1], 0 + 1 + 2 + 3 + 4);
    auto half = w->split(rank % 2, rank, "half");
    ASSERT_EQ(half->size(), 2);
    EXPECT_EQ(half->rank(), rank / 2);
    OwnedTensor one(DType::kF32, Device::cpu(), {1}), both(DType::kF32, Device::cpu(), {2});
    one.t.data_as<float>()[0] = static_cast<float>(rank);
    half->all_gather(both, one, st);
    EXPECT_EQ(both.t.data_as<float>()[1], static_cast<float>(rank % 2 + 2));
    // Ring exchange in both directions inside one group: no deadlock.
    OwnedTensor from_left(DType::kF32, Device::cpu(), {1}), from_right(DType::kF32, Device::cpu(), {1});
    w->group_start();
    w->send(one, (rank + 1) % 4, st);
    w->send(one, (rank + 3) % 4, st);
    w->recv(from_left, (rank + 3) % 4, st);
    w->recv(from_right, (rank + 1) % 4, st);
    w->group_end();
    EXPECT_EQ(from_left.t.data_as<float>()[0], static_cast<float>((rank + 3) % 4));
    EXPECT_EQ(from_right.t.data_as<float>()[0], static_cast<float>((rank + 1) % 4));
  });
  // A rank that throws makes the others fail instead of hanging.
  EXPECT_THROW(run_thread_ranks(2,
                                [](int rank, std::shared_ptr<Communicator> w) {
                                  if (rank == 1) MT_FAIL("rank 1 dies");
                                  Stream st;
                                  OwnedTensor t(DType::kF32, Device::cpu(), {1});
                                  w->all_reduce(t, ReduceOp::kSum, st);
                                }),
               Error);
}

}  // namespace
}  // namespace mt
