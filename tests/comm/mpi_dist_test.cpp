// MPI backend (CPU tensors) under mpiexec with 4 ranks: every collective against values each
// rank recomputes for all ranks (tests/comm/collective_checks.h), split, p2p, errors.
#include "comm/comm_util.h"
#include "comm/mpi/mpi_communicator.h"
#include "collective_checks.h"

namespace mt {
namespace {

using namespace comm_test;

const Device kCpu = Device::cpu();

MpiCommunicator& world() {
  // 2 minutes: a failing rank makes the others error out instead of hanging until ctest's limit.
  static std::shared_ptr<MpiCommunicator> w = MpiCommunicator::world(120.0);
  return *w;
}

/// Rank 0's fresh test seed, the same on every rank.
uint64_t seed() {
  static uint64_t s = [] {
    world();
    uint64_t v = testing::test_seed();
    MPI_Bcast(&v, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    return v;
  }();
  return s;
}

TEST(MpiDist, WorldMatchesLauncher) {
  EXPECT_EQ(world().size(), MpiRuntime::world_size());
  EXPECT_EQ(world().rank(), MpiRuntime::world_rank());
  EXPECT_EQ(world().name(), "world");
  EXPECT_GE(world().size(), 2) << "run under mpiexec -np 4";
  EXPECT_TRUE(MpiRuntime::launched_by_mpi());
}

TEST(MpiDist, AllReduce) {
  Stream s(kCpu);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
      for (int64_t n : {1, 1000, 4097}) check_all_reduce(world(), kCpu, s, seed(), dt, op, n);
    }
  }
  check_all_reduce_normal(world(), kCpu, s, seed(), 5000);
}

TEST(MpiDist, AllGather) {
  Stream s(kCpu);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI32}) {
    for (int64_t n : {1, 777}) {
      check_all_gather(world(), kCpu, s, seed(), dt, n, false);
      check_all_gather(world(), kCpu, s, seed(), dt, n, true);
    }
  }
}

TEST(MpiDist, ReduceScatter) {
  Stream s(kCpu);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      for (int64_t n : {1, 333}) {
        check_reduce_scatter(world(), kCpu, s, seed(), dt, op, n, false);
        check_reduce_scatter(world(), kCpu, s, seed(), dt, op, n, true);
      }
    }
  }
}

TEST(MpiDist, Broadcast) {
  Stream s(kCpu);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI32}) check_broadcast(world(), kCpu, s, seed(), dt, 513);
}

TEST(MpiDist, AllToAll) {
  Stream s(kCpu);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI32}) {
    for (int64_t chunk : {1, 129}) check_all_to_all(world(), kCpu, s, seed(), dt, chunk);
  }
}

TEST(MpiDist, AllToAllv) {
  Stream s(kCpu);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI32})
    for (AllToAllvPattern p : {AllToAllvPattern::kUnequal, AllToAllvPattern::kUnequalGapped, AllToAllvPattern::kGatherv})
      for (int64_t unit : {1, 129, 5000}) check_all_to_allv(world(), kCpu, s, seed(), dt, p, unit);
  check_all_to_allv_errors(world(), kCpu, s);
  auto parity = world().split(world().rank() % 2, world().rank(), "parity");
  check_all_to_allv(*parity, kCpu, s, seed(), DType::kF32, AllToAllvPattern::kUnequalGapped, 7);
  // More than INT_MAX elements cannot be addressed by MPI_Alltoallv's int displacements: a clear
  // error before any communication (a view of a small buffer; nothing is read).
  OwnedTensor small(DType::kU8, kCpu, {16});
  const int64_t big = int64_t{1} << 31;
  Tensor huge_out(small.t.data(), DType::kU8, kCpu, {big + 8}), in(small.t.data(), DType::kU8, kCpu, {0});
  AllToAllvSplits send{std::vector<int64_t>(world().size(), 0), {}}, recv = send;
  recv.offsets.assign(world().size(), 0);
  recv.offsets[0] = big;
  recv.counts[0] = 1;
  try {
    world().all_to_allv(huge_out, recv, in, send, s);
    ADD_FAILURE() << "no error for an offset beyond INT_MAX";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("beyond MPI's int range"), std::string::npos) << e.what();
  }
}

TEST(MpiDist, SendRecv) {
  Stream s(kCpu);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    check_ring_both_directions(world(), kCpu, s, seed(), dt, 10000);  // above the eager limit
    check_pairwise_p2p(world(), kCpu, s, seed(), dt, 257);
  }
}

TEST(MpiDist, Barrier) {
  for (int i = 0; i < 3; ++i) world().barrier();
}

TEST(MpiDist, Split) {
  Stream s(kCpu);
  check_split(world(), kCpu, s);
  // Collectives on a split group of the split group.
  auto parity = world().split(world().rank() % 2, world().rank(), "parity");
  auto sub = parity->split(0, parity->rank(), "parity2");
  ASSERT_NE(sub, nullptr);
  check_all_reduce(*sub, kCpu, s, seed(), DType::kBF16, ReduceOp::kSum, 100);
  check_all_to_all(*sub, kCpu, s, seed(), DType::kF32, 5);
}

TEST(MpiDist, Errors) {
  Stream s(kCpu);
  check_errors(world(), kCpu, s);
  EXPECT_THROW(world().group_end(), Error);
}

}  // namespace
}  // namespace mt
