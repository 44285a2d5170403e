// ECHO's used-slot transfers (model/moe/echo_peers.h) on thread ranks, against the fixed
// all-to-alls of every P·S block (ops/moe_echo_exchange.h) on the same plans: random skewed token
// counts over P EP ranks give moe_echo_plan's placement; then
//   * the weight dispatch writes every used clone slot's weights, bitwise its home expert's, and
//     exactly the bytes of the used slots whose home is this rank (unused slots are not touched);
//   * the gradient return adds the clones' gradients to their home experts' main gradients bitwise
//     as the all-to-all path does (moe_echo_accumulate_experts, slots in order), and moves exactly
//     the bytes of this rank's used clones;
//   * a second plan reuses the buffers (the barrier before the copies).
// The model with ECHO and static receive blocks runs this path on thread ranks: the *_echo*_recv*
// layouts of tests/parallel/parallel_layouts_test.cpp (against one rank).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "comm/thread_comm.h"
#include "model/moe/echo_peers.h"
#include "ops/elementwise.h"
#include "ops/moe_echo.h"
#include "ops/moe_echo_exchange.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;
const Device kCpu = Device::cpu();

// moe_echo_plan's clone_expert for random counts (expert 1 and 2L+1 hot), the same on every rank;
// balanced: every expert gets 10 tokens from every rank (no rank above the average: no clone).
std::vector<int32_t> plan(int64_t P, int64_t L, int64_t S, uint64_t seed, bool balanced = false) {
  const int64_t E = P * L;
  std::mt19937 rng(seed);
  std::vector<int32_t> counts(static_cast<size_t>(P * E));
  for (size_t i = 0; i < counts.size(); ++i) {
    const int64_t e = static_cast<int64_t>(i) % E;
    counts[i] = balanced ? 10 : static_cast<int32_t>(rng() % 40) * (e == 1 || e == 2 * L + 1 ? 9 : 1);
  }
  const Stream& st = testing::cpu_stream();
  auto c = testing::make_int_tensor(counts, kCpu, {P, E}, st);
  OwnedTensor ce(DType::kI32, kCpu, {P * S}), cq(DType::kI32, kCpu, {P * S}), q(DType::kI32, kCpu, {P, P * S});
  moe_echo_plan(ce, cq, q, c, P, S, st);
  return testing::to_host_ints(ce, st);
}

float weight(int64_t e, int64_t w, int64_t i) { return static_cast<float>((e * 37 + w * 11 + i) % 101) / 16.f - 3.f; }

TEST(MoeEchoPeers, UsedSlotsOnlyBitwiseTheFixedAllToAlls) {
  constexpr int64_t L = 3, n1 = 6, k1 = 5, n2 = 5, k2 = 3;
  for (int64_t P : {2, 4}) {
    for (int64_t S : {1, 2}) {
      const std::vector<int32_t> ce1 = plan(P, L, S, 7 + P * S), ce2 = plan(P, L, S, 99 + P * S),
                                 ce0 = plan(P, L, S, 0, /*balanced=*/true);
      const auto used = [](const std::vector<int32_t>& ce) {
        return std::count_if(ce.begin(), ce.end(), [](int32_t e) { return e >= 0; });
      };
      ASSERT_GT(used(ce1), 0) << "P " << P << " S " << S << ": the plan uses no slot";
      ASSERT_EQ(used(ce0), 0) << "P " << P << " S " << S << ": a balanced plan uses a slot";
      // the bytes every rank wrote, per plan: [plan][rank] weights, gradients
      std::vector<std::vector<int64_t>> wbytes(3, std::vector<int64_t>(static_cast<size_t>(P))), gbytes = wbytes;
      run_thread_ranks(static_cast<int>(P), [&](int me, std::shared_ptr<Communicator> g) {
        const Stream st(kCpu);
        ExpertParallel ep;
        ep.ep_size = static_cast<int>(P);
        ep.ep_rank = me;
        ep.ep_group = g;
        std::string why;
        ASSERT_TRUE(EchoPeers::available(ep, kCpu, &why)) << why;
        const std::unique_ptr<EchoPeers> peers = EchoPeers::create(ep, kCpu, {S, n1, k1, n2, k2, DType::kF32});
        // this rank's experts (global id me·L + l) and, for the gradients, its clones'
        std::vector<OwnedTensor> own;
        std::vector<Tensor> w1s, w2s, mainA1, mainA2, mainB1, mainB2;
        for (int64_t l = 0; l < L; ++l) {
          for (int64_t w = 0; w < 2; ++w) {
            own.emplace_back(DType::kF32, kCpu, w == 0 ? std::vector<int64_t>{n1, k1} : std::vector<int64_t>{n2, k2});
            float* d = own.back().t.data_as<float>();
            for (int64_t i = 0; i < own.back().t.numel(); ++i) d[i] = weight(me * L + l, w, i);
            (w == 0 ? w1s : w2s).push_back(own.back().t);
          }
          for (int64_t copy = 0; copy < 2; ++copy)
            for (int64_t w = 0; w < 2; ++w) {  // main gradients: the same start for both paths
              own.emplace_back(DType::kF32, kCpu, w == 0 ? std::vector<int64_t>{n1, k1} : std::vector<int64_t>{n2, k2});
              float* d = own.back().t.data_as<float>();
              for (int64_t i = 0; i < own.back().t.numel(); ++i) d[i] = weight(1000 + me * L + l, w, i);
              (copy == 0 ? (w == 0 ? mainA1 : mainA2) : (w == 0 ? mainB1 : mainB2)).push_back(own.back().t);
            }
        }
        const GroupedWeights W1(w1s, st), W2(w2s, st);
        const GroupedWeights A1(mainA1, st), A2(mainA2, st), B1(mainB1, st), B2(mainB2, st);
        const int64_t NS = P * S;
        OwnedTensor w_send(DType::kI32, kCpu, {NS}), w_recv(DType::kI32, kCpu, {S}), g_send(DType::kI32, kCpu, {NS}),
            g_acc(DType::kI32, kCpu, {NS});
        for (size_t pi = 0; pi < 3; ++pi) {
          const std::vector<int32_t>* ce = pi == 0 ? &ce1 : pi == 1 ? &ce2 : &ce0;
          const auto cet = testing::make_int_tensor(*ce, kCpu, {NS}, st);
          moe_echo_exchange_index(w_send.t, w_recv.t, g_send.t, g_acc.t, cet.t, me, L, S, st);
          // --- weights: the peers, then the fixed all-to-all into separate buffers ---
          fill(peers->clone_w1(), -777.f, st);
          fill(peers->clone_w2(), -777.f, st);
          g->barrier();  // every rank has poisoned its clone buffers before anyone writes
          peers->reset_bytes(st);
          peers->put_weights(W1, W2, w_send.t, st);
          int64_t homed = 0;  // used slots whose home is this rank
          for (int64_t s = 0; s < NS; ++s) homed += (*ce)[static_cast<size_t>(s)] >= 0 && (*ce)[static_cast<size_t>(s)] / L == me;
          wbytes[pi][static_cast<size_t>(me)] = peers->bytes_sent_sync(st);
          EXPECT_EQ(wbytes[pi][static_cast<size_t>(me)], homed * (n1 * k1 + n2 * k2) * 4) << "P " << P << " S " << S;
          OwnedTensor s1(DType::kF32, kCpu, {NS, n1, k1}), r1(DType::kF32, kCpu, {NS, n1, k1});
          OwnedTensor s2(DType::kF32, kCpu, {NS, n2, k2}), r2(DType::kF32, kCpu, {NS, n2, k2});
          OwnedTensor c1(DType::kF32, kCpu, {S, n1, k1}), c2(DType::kF32, kCpu, {S, n2, k2});
          moe_echo_gather_experts(s1.t, W1, w_send.t, st);
          moe_echo_gather_experts(s2.t, W2, w_send.t, st);
          g->all_to_all(r1.t, s1.t, st);
          g->all_to_all(r2.t, s2.t, st);
          fill(c1.t, -777.f, st);
          fill(c2.t, -777.f, st);
          moe_echo_gather_blocks(c1.t, r1.t, w_recv.t, st);
          moe_echo_gather_blocks(c2.t, r2.t, w_recv.t, st);
          const auto p1 = testing::to_host(peers->clone_w1(), st), p2 = testing::to_host(peers->clone_w2(), st);
          EXPECT_EQ(p1, testing::to_host(c1.t, st)) << "rank " << me << ": clone fc1 weights";
          EXPECT_EQ(p2, testing::to_host(c2.t, st)) << "rank " << me << ": clone fc2 weights";
          for (int64_t j = 0; j < S; ++j) {  // used: the home expert's; unused: untouched
            const int32_t e = (*ce)[static_cast<size_t>(me * S + j)];
            for (int64_t i = 0; i < n1 * k1; ++i)
              ASSERT_EQ(p1[static_cast<size_t>(j * n1 * k1 + i)], e >= 0 ? weight(e, 0, i) : -777.f) << "slot " << j;
          }
          // --- gradients: this rank's clones' gradients home, both ways, into the two copies ---
          OwnedTensor cg1(DType::kF32, kCpu, {S, n1, k1}), cg2(DType::kF32, kCpu, {S, n2, k2});
          for (int64_t i = 0; i < cg1.t.numel(); ++i) cg1.t.data_as<float>()[i] = weight(5000 + me, 0, i);
          for (int64_t i = 0; i < cg2.t.numel(); ++i) cg2.t.data_as<float>()[i] = weight(6000 + me, 1, i);
          peers->reset_bytes(st);
          peers->put_grads(cg1.t, cg2.t, g_send.t, st);
          int64_t mine = 0;  // this rank's used clones
          for (int64_t j = 0; j < S; ++j) mine += (*ce)[static_cast<size_t>(me * S + j)] >= 0;
          gbytes[pi][static_cast<size_t>(me)] = peers->bytes_sent_sync(st);
          EXPECT_EQ(gbytes[pi][static_cast<size_t>(me)], mine * (n1 * k1 + n2 * k2) * 4) << "P " << P << " S " << S;
          moe_echo_accumulate_experts(A1, peers->grads_in1(), g_acc.t, st);
          moe_echo_accumulate_experts(A2, peers->grads_in2(), g_acc.t, st);
          moe_echo_gather_blocks(s1.t, cg1.t, g_send.t, st);
          moe_echo_gather_blocks(s2.t, cg2.t, g_send.t, st);
          g->all_to_all(r1.t, s1.t, st);
          g->all_to_all(r2.t, s2.t, st);
          moe_echo_accumulate_experts(B1, r1.t, g_acc.t, st);
          moe_echo_accumulate_experts(B2, r2.t, g_acc.t, st);
          for (int64_t l = 0; l < L; ++l) {
            EXPECT_EQ(testing::to_host(mainA1[static_cast<size_t>(l)], st), testing::to_host(mainB1[static_cast<size_t>(l)], st))
                << "rank " << me << " expert " << l << ": fc1 main gradient";
            EXPECT_EQ(testing::to_host(mainA2[static_cast<size_t>(l)], st), testing::to_host(mainB2[static_cast<size_t>(l)], st))
                << "rank " << me << " expert " << l << ": fc2 main gradient";
          }
        }
        // something was returned somewhere: the main gradients moved from their start
        int64_t moved = 0;
        for (int64_t l = 0; l < L; ++l) {
          const auto v = testing::to_host(mainA1[static_cast<size_t>(l)], st);
          for (int64_t i = 0; i < n1 * k1; ++i) moved += v[static_cast<size_t>(i)] != weight(1000 + me * L + l, 0, i);
        }
        int64_t all_moved = moved;
        OwnedTensor m(DType::kF32, kCpu, {1});
        m.t.data_as<float>()[0] = static_cast<float>(moved);
        g->all_reduce(m.t, ReduceOp::kSum, st);
        all_moved = static_cast<int64_t>(m.t.data_as<float>()[0]);
        EXPECT_GT(all_moved, 0) << "no gradient was returned on any rank";
      });
      // The traffic against the fixed all-to-alls, which move P·S expert blocks per rank and
      // direction whatever the plan ((P−1)·S of them to other ranks): here one block per used slot
      // and direction, nothing for a balanced plan.
      const int64_t block = (n1 * k1 + n2 * k2) * 4, fixed = P * (P - 1) * S * block;  // all ranks, one direction
      for (size_t pi = 0; pi < 3; ++pi) {
        const std::vector<int32_t>& ce = pi == 0 ? ce1 : pi == 1 ? ce2 : ce0;
        int64_t w = 0, gr = 0;
        for (int64_t r = 0; r < P; ++r) w += wbytes[pi][static_cast<size_t>(r)], gr += gbytes[pi][static_cast<size_t>(r)];
        EXPECT_EQ(w, used(ce) * block) << "P " << P << " S " << S << " plan " << pi << ": weight bytes";
        EXPECT_EQ(gr, used(ce) * block) << "P " << P << " S " << S << " plan " << pi << ": gradient bytes";
        if (pi < 2) EXPECT_LT(w, fixed) << "P " << P << " S " << S << ": no fewer bytes than the fixed all-to-alls";
        std::printf("P %lld S %lld plan %zu: %lld of %lld slots used, %lld bytes per direction (fixed all-to-alls: %lld to other ranks)\n",
                    static_cast<long long>(P), static_cast<long long>(S), pi, static_cast<long long>(used(ce)),
                    static_cast<long long>(P * S), static_cast<long long>(w), static_cast<long long>(fixed));
      }
    }
  }
}

TEST(MoeEchoPeers, Errors) {
  run_thread_ranks(2, [&](int me, std::shared_ptr<Communicator> g) {
    const Stream st(kCpu);
    ExpertParallel ep;
    ep.ep_size = 2;
    ep.ep_rank = me;
    std::string why;
    EXPECT_FALSE(EchoPeers::available(ep, kCpu, &why));
    EXPECT_EQ(why, "no expert model parallel group");
    EXPECT_THROW(EchoPeers::create(ep, kCpu, {1, 2, 2, 2, 2, DType::kF32}), Error);  // no group
    ep.ep_group = g;
    EXPECT_THROW(EchoPeers::create(ep, kCpu, {0, 2, 2, 2, 2, DType::kF32}), Error);  // no slot
    auto peers = EchoPeers::create(ep, kCpu, {1, 2, 2, 2, 2, DType::kF32});
    ASSERT_NE(peers, nullptr);
    OwnedTensor a(DType::kF32, kCpu, {2, 2}), idx(DType::kI32, kCpu, {2}), bad_idx(DType::kI32, kCpu, {3});
    const GroupedWeights w({a.t}, st);
    EXPECT_THROW(peers->put_weights(w, w, bad_idx.t, st), Error);  // index of P·S = 2 entries
    OwnedTensor g1(DType::kF32, kCpu, {2, 2, 2});                  // S = 1 blocks expected
    EXPECT_THROW(peers->put_grads(g1.t, g1.t, idx.t, st), Error);
  });
}

}  // namespace
}  // namespace mt
