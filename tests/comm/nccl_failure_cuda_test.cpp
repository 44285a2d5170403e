// End-to-end NCCL runs through the local launcher (fork/exec, torchrun variables, NCCL id over
// the TCP store) on 2 GPUs, and the failure paths: a peer that exits during a collective, and a
// peer that is alive but never joins (the watchdog's timeout). The ranks are this executable:
// with MT_COMM_TEST_HELPER set, a static initializer runs the helper role and exits before main.
// Needs 2 GPUs (skips otherwise).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "comm/bootstrap.h"
#include "comm/launcher.h"
#include "comm/nccl/nccl_communicator.h"
#include "core/buffer.h"
#include "testing/testing.h"

namespace mt {
namespace {

int helper_main(const std::string& mode) {
  const LaunchEnv env = read_launch_env();
  const bool stuck = mode == "nccl_stuck";
  auto world = init_world(Device::cuda(), env, stuck ? 0.1 : 1.0);  // stuck: 6 s timeout
  const Device dev = local_device(DeviceType::kCUDA, env);
  Stream s(dev);
  const int64_t n = 1 << 20;
  auto x = testing::make_tensor(std::vector<float>(n, 1.f), DType::kF32, dev, {n}, s);
  if (mode == "nccl_ok") {
    world->all_reduce(x, ReduceOp::kSum, s);
    for (float v : testing::to_host(x, s)) {
      if (v != static_cast<float>(world->size())) return 5;
    }
    auto sub = world->split(0, -world->rank(), "reversed");
    if (sub->rank() != world->size() - 1 - world->rank()) return 6;
    sub->barrier();
    return 0;
  }
  if (world->rank() == 1) {
    if (mode == "nccl_dead") std::_Exit(3);  // dies before the all_reduce
    std::this_thread::sleep_for(std::chrono::seconds(120));  // alive, never joins
    return 0;
  }
  world->all_reduce(x, ReduceOp::kSum, s);
  s.synchronize();  // blocks until the watchdog (or the launcher) ends this process
  return 0;
}

const int kHelperDone = [] {
  const char* mode = std::getenv("MT_COMM_TEST_HELPER");
  if (mode == nullptr) return 0;
  int code = 1;
  try {
    code = helper_main(mode);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "helper: %s\n", e.what());
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::exit(code);
}();

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

bool two_gpus() {
  int n = 0;
  if (!cuda_available() || cudaGetDeviceCount(&n) != cudaSuccess) return false;
  return n >= 2;
}

std::pair<int, std::string> launch2(const char* mode) {
  setenv("MT_COMM_TEST_HELPER", mode, 1);
  std::string arg0 = "megatron";
  char* argv[] = {arg0.data(), nullptr};
  ::testing::internal::CaptureStderr();
  int rc = launch_local(2, 1, argv, Device::cuda(0));
  std::string out = ::testing::internal::GetCapturedStderr();
  unsetenv("MT_COMM_TEST_HELPER");
  return {rc, out};
}

TEST(NcclLaunch, TwoRanksThroughTheTcpStore) {
  if (!two_gpus()) GTEST_SKIP() << "needs 2 GPUs";
  auto [rc, out] = launch2("nccl_ok");
  EXPECT_EQ(rc, 0) << out;
}

TEST(NcclLaunch, DeadPeerEndsTheJobNamingIt) {
  if (!two_gpus()) GTEST_SKIP() << "needs 2 GPUs";
  const auto t0 = Clock::now();
  auto [rc, out] = launch2("nccl_dead");
  EXPECT_EQ(rc, 3) << out;
  EXPECT_NE(out.find("rank 1 (of 2) exited with status 3"), std::string::npos) << out;
  EXPECT_LT(since(t0), 60.0);
}

TEST(NcclLaunch, StuckPeerTimesOutInTheWatchdog) {
  if (!two_gpus()) GTEST_SKIP() << "needs 2 GPUs";
  const auto t0 = Clock::now();
  auto [rc, out] = launch2("nccl_stuck");
  EXPECT_EQ(rc, 1) << out;
  // Either the enqueued all-reduce does not complete, or (NCCL >= 2.22 connects to peers inside
  // the first collective's host call) the host call does not return: both name the group.
  EXPECT_NE(out.find("[megatron.cpp NCCL watchdog] NCCL "), std::string::npos) << out;
  EXPECT_NE(out.find("on group 'world' (rank 0 of 2)"), std::string::npos) << out;
  // The watchdog's message is the report: a rank exiting with status 1 (kReportedErrorExitStatus)
  // has printed its error, so the launcher adds no "rank 0 (of 2) exited with status 1" line.
  EXPECT_EQ(out.find("exited with status 1"), std::string::npos) << out;
  EXPECT_GE(since(t0), 6.0);
  EXPECT_LT(since(t0), 60.0);
}

}  // namespace
}  // namespace mt
