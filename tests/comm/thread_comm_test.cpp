// The in-process thread communicator the parallel-equivalence tests run on: collectives, split,
// batched send/recv in both directions, a failing rank ending the others, and all_gather_host.
#include <gtest/gtest.h>

#include "comm/thread_comm.h"
#include "collective_checks.h"
#include "core/stream.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;

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

// all_gather_host: every rank's host bytes in rank order (an odd size: no alignment assumed), and
// a group of one rank returns its own bytes.
TEST(ThreadComm, AllGatherHost) {
  run_thread_ranks(3, [](int rank, std::shared_ptr<Communicator> w) {
    Stream st;
    const char mine[3] = {static_cast<char>('a' + rank), static_cast<char>(rank), 'z'};
    const std::vector<char> all = all_gather_host(*w, mine, sizeof(mine), st);
    ASSERT_EQ(all.size(), 9u);
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(all[3 * r], 'a' + r);
      EXPECT_EQ(all[3 * r + 1], r);
      EXPECT_EQ(all[3 * r + 2], 'z');
    }
  });
  SingleRankCommunicator one;
  const int v = 42;
  const std::vector<char> self = all_gather_host(one, &v, sizeof(v), Stream());
  ASSERT_EQ(self.size(), sizeof(v));
  EXPECT_EQ(*reinterpret_cast<const int*>(self.data()), 42);
}

// all_to_allv: unequal splits with zero counts (self included), pieces out of order with gaps on
// both sides, an all-gather of unequal sizes (overlapping send pieces), for 4 and 3 ranks; the
// argument errors; a count mismatch between sender and receiver; a group of one rank.
TEST(ThreadComm, AllToAllv) {
  using comm_test::AllToAllvPattern;
  const uint64_t seed = testing::test_seed();
  for (int n : {4, 3}) {
    run_thread_ranks(n, [&](int, std::shared_ptr<Communicator> w) {
      Stream st;
      for (DType dt : {DType::kF32, DType::kBF16, DType::kI32})
        for (AllToAllvPattern p : {AllToAllvPattern::kUnequal, AllToAllvPattern::kUnequalGapped,
                                   AllToAllvPattern::kGatherv})
          for (int64_t unit : {1, 129}) comm_test::check_all_to_allv(*w, Device::cpu(), st, seed, dt, p, unit);
      comm_test::check_all_to_allv_errors(*w, Device::cpu(), st);
      // On a split group too.
      auto half = w->split(w->rank() % 2, w->rank(), "half");
      comm_test::check_all_to_allv(*half, Device::cpu(), st, seed, DType::kF32, AllToAllvPattern::kUnequal, 3);
    });
  }
  try {
    run_thread_ranks(2, [](int rank, std::shared_ptr<Communicator> w) {
      Stream st;
      OwnedTensor in(DType::kF32, Device::cpu(), {4}), out(DType::kF32, Device::cpu(), {4});
      AllToAllvSplits send{{2, 2}, {}}, recv{{2, rank == 0 ? 1 : 2}, {}};  // rank 0 expects 1 from rank 1
      w->all_to_allv(out, recv, in, send, st);
    });
    ADD_FAILURE() << "count mismatch not detected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 sends 2 elements but this rank expects 1"), std::string::npos)
        << e.what();
  }
  SingleRankCommunicator one("one");
  Stream st;
  comm_test::check_all_to_allv(one, Device::cpu(), st, seed, DType::kF32, AllToAllvPattern::kUnequalGapped, 5);
  comm_test::check_all_to_allv_errors(one, Device::cpu(), st);
}

}  // namespace
}  // namespace mt
