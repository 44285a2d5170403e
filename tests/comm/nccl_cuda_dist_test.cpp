// NCCL backend (CUDA tensors) under mpiexec, one rank per GPU (GPU = local rank): the same
// collective checks as the MPI dist test (tests/comm/collective_checks.h), plus groups of
// collectives and stream errors. The world comes from init_world (NCCL unique id over MPI).
// Runs on any number of ranks >= 2 with at most one rank per visible GPU; otherwise every rank
// skips (no GPU, one rank, or more ranks per node than GPUs).
//   mpiexec --allow-run-as-root -np 2 build/nccl_cuda_dist_test
#include <cuda_runtime.h>

#include <cstdlib>

#include "comm/bootstrap.h"
#include "comm/mpi/mpi_communicator.h"
#include "comm/nccl/nccl_communicator.h"
#include "collective_checks.h"

namespace mt {
namespace {

using namespace comm_test;

struct World {
  std::shared_ptr<Communicator> comm;
  Device device;
  uint64_t seed = 0;
  std::string skip;
};

World& world() {
  static World w = [] {
    World r;
    if (!cuda_available()) {
      r.skip = "no CUDA device";
      return r;
    }
    LaunchEnv env = read_launch_env();
    if (env.world_size < 2 || env.launcher != LaunchEnv::kMpirun) {
      r.skip = "run under mpiexec -np N with N >= 2 (one rank per GPU)";
      return r;
    }
    int gpus = 0;
    cudaGetDeviceCount(&gpus);
    const char* local_size = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (local_size && std::atoi(local_size) > gpus) {
      r.skip = fmt::format("{} ranks on this node but {} GPUs", local_size, gpus);
      return r;
    }
    r.comm = init_world(Device::cuda(), env, 2.0);
    r.device = local_device(DeviceType::kCUDA, env);
    uint64_t v = testing::test_seed();
    MPI_Bcast(&v, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    r.seed = v;
    return r;
  }();
  return w;
}

#define MT_REQUIRE_WORLD()                                  \
  do {                                                      \
    if (!world().comm) GTEST_SKIP() << world().skip;        \
  } while (0)

TEST(NcclDist, World) {
  MT_REQUIRE_WORLD();
  auto* nccl = dynamic_cast<NcclCommunicator*>(world().comm.get());
  ASSERT_NE(nccl, nullptr);
  EXPECT_EQ(nccl->size(), MpiRuntime::world_size());
  EXPECT_EQ(nccl->rank(), MpiRuntime::world_rank());
  EXPECT_EQ(nccl->name(), "world");
  EXPECT_EQ(nccl->device(), world().device);
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
}

TEST(NcclDist, AllReduce) {
  MT_REQUIRE_WORLD();
  Stream s(world().device);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
      for (int64_t n : {1, 1000, 4097, (1 << 20) + 3}) check_all_reduce(*world().comm, world().device, s, world().seed, dt, op, n);
    }
  }
  check_all_reduce_normal(*world().comm, world().device, s, world().seed, 100003);
}

TEST(NcclDist, AllGather) {
  MT_REQUIRE_WORLD();
  Stream s(world().device);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI32}) {
    for (int64_t n : {1, 777, 300001}) {
      check_all_gather(*world().comm, world().device, s, world().seed, dt, n, false);
      check_all_gather(*world().comm, world().device, s, world().seed, dt, n, true);
    }
  }
}

TEST(NcclDist, ReduceScatter) {
  MT_REQUIRE_WORLD();
  Stream s(world().device);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      for (int64_t n : {1, 333, 200003}) {
        check_reduce_scatter(*world().comm, world().device, s, world().seed, dt, op, n, false);
        check_reduce_scatter(*world().comm, world().device, s, world().seed, dt, op, n, true);
      }
    }
  }
}

TEST(NcclDist, Broadcast) {
  MT_REQUIRE_WORLD();
  Stream s(world().device);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI32}) check_broadcast(*world().comm, world().device, s, world().seed, dt, 70001);
}

TEST(NcclDist, AllToAll) {
  MT_REQUIRE_WORLD();
  Stream s(world().device);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI32}) {
    for (int64_t chunk : {1, 129, 65537}) check_all_to_all(*world().comm, world().device, s, world().seed, dt, chunk);
  }
}

// Grouped ncclSend/ncclRecv with unequal splits, zero counts (skipped peers), gaps and an
// all-gather of unequal sizes; the argument errors; a split group.
TEST(NcclDist, AllToAllv) {
  MT_REQUIRE_WORLD();
  Stream s(world().device);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI32})
    for (AllToAllvPattern p : {AllToAllvPattern::kUnequal, AllToAllvPattern::kUnequalGapped, AllToAllvPattern::kGatherv})
      for (int64_t unit : {1, 129, 65537}) check_all_to_allv(*world().comm, world().device, s, world().seed, dt, p, unit);
  check_all_to_allv_errors(*world().comm, world().device, s);
  auto parity = world().comm->split(world().comm->rank() % 2, world().comm->rank(), "parity");
  check_all_to_allv(*parity, world().device, s, world().seed, DType::kBF16, AllToAllvPattern::kUnequalGapped, 1000);
}

TEST(NcclDist, SendRecv) {
  MT_REQUIRE_WORLD();
  Stream s(world().device);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (int64_t n : {1, 10000, 1 << 20}) {
      check_ring_both_directions(*world().comm, world().device, s, world().seed, dt, n);
      check_pairwise_p2p(*world().comm, world().device, s, world().seed, dt, n);
    }
  }
}

// Several collectives batched in one NCCL group (their watchdog events are recorded at
// group_end), on two streams.
TEST(NcclDist, GroupedCollectives) {
  MT_REQUIRE_WORLD();
  Communicator& c = *world().comm;
  const Device dev = world().device;
  Stream s1(dev), s2(dev);
  const int P = c.size();
  auto a = make(rank_values(world().seed, 900, c.rank(), 5000, DType::kF32), DType::kF32, dev, s1);
  auto b = make(rank_values(world().seed, 901, c.rank(), 3000, DType::kBF16), DType::kBF16, dev, s2);
  c.group_start();
  c.all_reduce(a, ReduceOp::kSum, s1);
  c.all_reduce(b, ReduceOp::kMax, s2);
  c.group_end();
  std::vector<double> wa(5000, 0.0), wb(3000, -1e30);
  for (int r = 0; r < P; ++r) {
    auto va = rank_values(world().seed, 900, r, 5000, DType::kF32);
    auto vb = rank_values(world().seed, 901, r, 3000, DType::kBF16);
    for (size_t i = 0; i < wa.size(); ++i) wa[i] += va[i];
    for (size_t i = 0; i < wb.size(); ++i) wb[i] = std::max<double>(wb[i], vb[i]);
  }
  expect_equal(testing::to_host(a, s1), wa, "grouped all_reduce fp32");
  expect_equal(testing::to_host(b, s2), wb, "grouped all_reduce bf16 max");
}

TEST(NcclDist, Barrier) {
  MT_REQUIRE_WORLD();
  for (int i = 0; i < 3; ++i) world().comm->barrier();
}

TEST(NcclDist, Split) {
  MT_REQUIRE_WORLD();
  Stream s(world().device);
  check_split(*world().comm, world().device, s);
  auto parity = world().comm->split(world().comm->rank() % 2, world().comm->rank(), "parity");
  check_all_to_all(*parity, world().device, s, world().seed, DType::kBF16, 1000);
  check_ring_both_directions(*parity, world().device, s, world().seed, DType::kF32, 4096);
  check_reduce_scatter(*parity, world().device, s, world().seed, DType::kBF16, ReduceOp::kSum, 999, true);
}

TEST(NcclDist, Errors) {
  MT_REQUIRE_WORLD();
  Stream s(world().device);
  check_errors(*world().comm, world().device, s);
  // A CPU stream for CUDA tensors.
  Stream cpu(Device::cpu());
  OwnedTensor t(DType::kF32, world().device, {4});
  EXPECT_THROW(world().comm->all_reduce(t, ReduceOp::kSum, cpu), Error);
  EXPECT_THROW(world().comm->group_end(), Error);
}

}  // namespace
}  // namespace mt
