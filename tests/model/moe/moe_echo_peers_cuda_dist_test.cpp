// ECHO's used-slot transfers (model/moe/echo_peers.h) on GPUs over NCCL's symmetric-memory window
// (2 or 4 ranks under mpiexec, one per GPU; ctest runs 4): against the fixed all-to-alls of every
// P·S block on the same plans, bf16 weights and fp32 gradients —
//   * eagerly: the used clone slots' weights bitwise the fixed path's, the unused ones untouched,
//     the home experts' main gradients bitwise the fixed path's, and exactly the used slots' bytes
//     counted on the device (weights: the used slots whose home is this rank; gradients: this
//     rank's used clones);
//   * captured in one CUDA graph (the exchange index from the plan on the device, the weight
//     dispatch, the gradient return and the accumulation) and replayed for new plans written into
//     the plan's device tensor between replays: the same checks after every replay — which slots
//     move is decided on the device, nothing is read on the host.
// A group on which the window cannot be made (ranks on several hosts) says why and fails: the
// lent machines are one NVLink domain.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "comm/bootstrap.h"
#include "core/cuda_check.h"
#include "core/cuda_graph.h"
#include "model/moe/echo_peers.h"
#include "ops/elementwise.h"
#include "ops/moe_echo.h"
#include "ops/moe_echo_exchange.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;

constexpr int64_t kL = 3, kS = 2, kN1 = 64, kK1 = 32, kN2 = 32, kK2 = 32;

// moe_echo_plan's placement for random skewed counts (the same on every rank: same seed).
std::vector<int32_t> plan(int64_t P, uint64_t seed) {
  const int64_t E = P * kL;
  std::mt19937 rng(seed);
  std::vector<int32_t> counts(static_cast<size_t>(P * E));
  for (size_t i = 0; i < counts.size(); ++i) {
    const int64_t e = static_cast<int64_t>(i) % E;
    counts[i] = static_cast<int32_t>(rng() % 40) * (e == static_cast<int64_t>(seed % E) || e == 1 ? 9 : 1);
  }
  const Stream& st = testing::cpu_stream();
  auto c = testing::make_int_tensor(counts, Device::cpu(), {P, E}, st);
  OwnedTensor ce(DType::kI32, Device::cpu(), {P * kS}), cq(DType::kI32, Device::cpu(), {P * kS}),
      q(DType::kI32, Device::cpu(), {P, P * kS});
  moe_echo_plan(ce, cq, q, c, P, kS, st);
  return testing::to_host_ints(ce, st);
}

std::vector<float> values(int64_t n, int64_t tag) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>((tag * 31 + i * 7) % 97) / 32.f - 1.5f;
  return v;
}

TEST(MoeEchoPeersNccl, UsedSlotsOnlyEagerAndInACudaGraph) {
  MT_REQUIRE_CUDA();
  const LaunchEnv env = read_launch_env();
  if ((env.world_size != 2 && env.world_size != 4) || env.launcher != LaunchEnv::kMpirun)
    GTEST_SKIP() << "run under mpiexec -np 2 or -np 4 (launcher " << launcher_name(env.launcher) << ", "
                 << env.world_size << " ranks)";
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  if (gpus < env.world_size) GTEST_SKIP() << "needs " << env.world_size << " GPUs, found " << gpus;
  const Device dev = local_device(DeviceType::kCUDA, env);
  set_current_device(dev);
  auto world = init_world(dev, env, 5.0);
  const int64_t P = world->size(), NS = P * kS;
  const int me = world->rank();
  Stream st(dev);
  ExpertParallel ep;
  ep.ep_size = static_cast<int>(P);
  ep.ep_rank = me;
  ep.ep_group = world;
  std::string why;
  // a library other than the headers' version cannot run the device API (EchoPeers::available says
  // no and ECHO keeps the all-to-alls, which moe_layouts_cuda_dist_test checks): nothing to test here
  if (!echo_detail::nccl_device_api_matches(&why)) GTEST_SKIP() << "the NCCL window path cannot run: " << why;
  ASSERT_TRUE(EchoPeers::available(ep, dev, &why)) << "no NCCL window for the EP group: " << why;
  const std::unique_ptr<EchoPeers> peers = EchoPeers::create(ep, dev, {kS, kN1, kK1, kN2, kK2, DType::kBF16});
  // local experts (bf16), main gradients of two paths (fp32), clone gradients (fp32)
  std::vector<OwnedTensor> own;
  auto add = [&](DType dt, std::vector<int64_t> shape, int64_t tag) -> Tensor {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    own.push_back(testing::make_tensor(testing::rounded(values(n, tag), dt), dt, dev, shape, st));
    return own.back().t;
  };
  std::vector<Tensor> w1, w2, a1, a2, b1, b2;
  for (int64_t l = 0; l < kL; ++l) {
    w1.push_back(add(DType::kBF16, {kN1, kK1}, me * kL + l));
    w2.push_back(add(DType::kBF16, {kN2, kK2}, 100 + me * kL + l));
    a1.push_back(add(DType::kF32, {kN1, kK1}, 200 + l));
    a2.push_back(add(DType::kF32, {kN2, kK2}, 300 + l));
    b1.push_back(add(DType::kF32, {kN1, kK1}, 200 + l));
    b2.push_back(add(DType::kF32, {kN2, kK2}, 300 + l));
  }
  const GroupedWeights W1(w1, st), W2(w2, st), A1(a1, st), A2(a2, st), B1(b1, st), B2(b2, st);
  const Tensor cg1 = add(DType::kF32, {kS, kN1, kK1}, 400 + me), cg2 = add(DType::kF32, {kS, kN2, kK2}, 500 + me);
  OwnedTensor ce(DType::kI32, dev, {NS}), w_send(DType::kI32, dev, {NS}), w_recv(DType::kI32, dev, {kS}),
      g_send(DType::kI32, dev, {NS}), g_acc(DType::kI32, dev, {NS});
  OwnedTensor s1(DType::kBF16, dev, {NS, kN1, kK1}), r1(DType::kBF16, dev, {NS, kN1, kK1}),
      s2(DType::kBF16, dev, {NS, kN2, kK2}), r2(DType::kBF16, dev, {NS, kN2, kK2});
  OwnedTensor c1(DType::kBF16, dev, {kS, kN1, kK1}), c2(DType::kBF16, dev, {kS, kN2, kK2});
  OwnedTensor gs1(DType::kF32, dev, {NS, kN1, kK1}), gr1(DType::kF32, dev, {NS, kN1, kK1}),
      gs2(DType::kF32, dev, {NS, kN2, kK2}), gr2(DType::kF32, dev, {NS, kN2, kK2});
  // the path under test: index, weights, gradients home, accumulation (captured below)
  auto peer_path = [&] {
    moe_echo_exchange_index(w_send.t, w_recv.t, g_send.t, g_acc.t, ce.t, me, kL, kS, st);
    peers->put_weights(W1, W2, w_send.t, st);
    peers->put_grads(cg1, cg2, g_send.t, st);
    moe_echo_accumulate_experts(A1, peers->grads_in1(), g_acc.t, st);
    moe_echo_accumulate_experts(A2, peers->grads_in2(), g_acc.t, st);
  };
  // the reference: the fixed all-to-alls of all P·S blocks
  auto fixed_path = [&] {
    moe_echo_exchange_index(w_send.t, w_recv.t, g_send.t, g_acc.t, ce.t, me, kL, kS, st);
    moe_echo_gather_experts(s1.t, W1, w_send.t, st);
    moe_echo_gather_experts(s2.t, W2, w_send.t, st);
    world->all_to_all(r1.t, s1.t, st);
    world->all_to_all(r2.t, s2.t, st);
    moe_echo_gather_blocks(c1.t, r1.t, w_recv.t, st);
    moe_echo_gather_blocks(c2.t, r2.t, w_recv.t, st);
    moe_echo_gather_blocks(gs1.t, cg1, g_send.t, st);
    moe_echo_gather_blocks(gs2.t, cg2, g_send.t, st);
    world->all_to_all(gr1.t, gs1.t, st);
    world->all_to_all(gr2.t, gs2.t, st);
    moe_echo_accumulate_experts(B1, gr1.t, g_acc.t, st);
    moe_echo_accumulate_experts(B2, gr2.t, g_acc.t, st);
  };
  // checks after one round with plan `placement` (the weights' bytes and the gradients' bytes)
  auto check = [&](const std::vector<int32_t>& placement, const std::string& what) {
    int64_t homed = 0, mine = 0;
    for (int64_t s = 0; s < NS; ++s) {
      const int32_t e = placement[static_cast<size_t>(s)];
      homed += e >= 0 && e / kL == me;
      mine += e >= 0 && s / kS == me;
    }
    const int64_t sent = peers->bytes_sent_sync(st), block = kN1 * kK1 + kN2 * kK2;
    EXPECT_EQ(sent, homed * block * 2 + mine * block * 4) << what << ": bytes written into other ranks' memory";
    // the fixed all-to-alls send (P − 1)·S blocks per direction to other ranks whatever the plan
    const int64_t fixed = (P - 1) * kS * block * (2 + 4);
    if (homed + mine < 2 * (P - 1) * kS) EXPECT_LT(sent, fixed) << what;
    std::printf("rank %d %s: %lld clone slots homed here, %lld used clones here: %lld bytes written (fixed all-to-alls: "
                "%lld to other ranks)\n",
                me, what.c_str(), static_cast<long long>(homed), static_cast<long long>(mine),
                static_cast<long long>(sent), static_cast<long long>(fixed));
    const auto p1 = testing::to_host(peers->clone_w1(), st), f1 = testing::to_host(c1.t, st);
    const auto p2 = testing::to_host(peers->clone_w2(), st), f2 = testing::to_host(c2.t, st);
    for (int64_t j = 0; j < kS; ++j) {
      if (placement[static_cast<size_t>(me * kS + j)] < 0) continue;  // unused: stale in both
      const size_t o1 = static_cast<size_t>(j * kN1 * kK1), o2 = static_cast<size_t>(j * kN2 * kK2);
      EXPECT_TRUE(std::equal(p1.begin() + o1, p1.begin() + o1 + kN1 * kK1, f1.begin() + o1)) << what << " clone " << j;
      EXPECT_TRUE(std::equal(p2.begin() + o2, p2.begin() + o2 + kN2 * kK2, f2.begin() + o2)) << what << " clone " << j;
    }
    for (int64_t l = 0; l < kL; ++l) {
      EXPECT_EQ(testing::to_host(a1[static_cast<size_t>(l)], st), testing::to_host(b1[static_cast<size_t>(l)], st))
          << what << " expert " << l << " fc1 main gradient";
      EXPECT_EQ(testing::to_host(a2[static_cast<size_t>(l)], st), testing::to_host(b2[static_cast<size_t>(l)], st))
          << what << " expert " << l << " fc2 main gradient";
    }
  };
  auto set_plan = [&](const std::vector<int32_t>& placement) {
    MT_CUDA_CHECK(cudaMemcpy(ce.t.data(), placement.data(), placement.size() * 4, cudaMemcpyHostToDevice));
    peers->reset_bytes(st);
  };
  // eagerly
  for (uint64_t seed : {3u, 11u}) {
    const std::vector<int32_t> placement = plan(P, seed);
    ASSERT_TRUE(std::any_of(placement.begin(), placement.end(), [](int32_t e) { return e >= 0; })) << seed;
    set_plan(placement);
    peer_path();
    fixed_path();
    check(placement, fmt::format("eager plan {}", seed));
  }
  // captured once, replayed with new plans
  CudaGraph graph;
  const uint64_t syncs = host_sync_count();
  graph.capture(st, peer_path);
  EXPECT_EQ(host_sync_count(), syncs) << "the transfers synchronised with the host";
  for (uint64_t seed : {5u, 17u, 23u}) {
    const std::vector<int32_t> placement = plan(P, seed);
    set_plan(placement);
    graph.launch(st);
    fixed_path();
    check(placement, fmt::format("replayed plan {}", seed));
  }
  st.synchronize();
}

}  // namespace
}  // namespace mt
