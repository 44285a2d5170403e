// --tp-comm-overlap's pieces (parallel/mappings.h, comm/rank_order_sum.h), ranks as threads on the
// CPU: the collective matmul (all-gather pipelined with the GEMM of each TP block of rows) and the
// GEMM pipelined with a reduce-scatter give the bits of the plain collective + the same block GEMMs,
// for TP 2, 3 and 4 (3 and 4 reuse sent blocks as receive slots); the overlapped calls use
// point-to-point transfers and no all-gather / reduce-scatter; the rank-order sum is the thread
// communicator's reduce_scatter bit for bit; and the flag's errors (Megatron requires sequence
// parallelism, which TP 1 turns off).
// The whole models under the flag are compared with the plain ones in parallel_layouts_test.cpp
// (TpCommOverlap).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include "comm/rank_order_sum.h"
#include "comm/thread_comm.h"
#include "model/gpt_model.h"
#include "ops/matmul.h"
#include "parallel/mappings.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;

/// Counts the collectives and sends of a group (and of the groups split from it).
class CountingCommunicator final : public ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;
  void all_gather(const Tensor& out, const Tensor& in, const Stream& s) override {
    ++all_gathers;
    inner().all_gather(out, in, s);
  }
  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, const Stream& s) override {
    ++reduce_scatters;
    inner().reduce_scatter(out, in, op, s);
  }
  void send(const Tensor& t, int peer, const Stream& s) override {
    ++sends;
    inner().send(t, peer, s);
  }
  int all_gathers = 0, reduce_scatters = 0, sends = 0;

 protected:
  std::shared_ptr<Communicator> wrap(std::shared_ptr<Communicator> split) override {
    return std::make_shared<CountingCommunicator>(std::move(split));
  }
};

// Rows [first, first + count) of y = x·Wᵀ from those rows of x, as ColumnParallelLinear does. A
// row's bits depend on the GEMM's row count (OpenBLAS), so both paths make the same block GEMMs.
TEST(TpCommOverlap, AllGatherGemmEqualsAllGatherThenGemm) {
  for (int tp : {2, 3, 4}) {
    SCOPED_TRACE(tp);
    const int64_t s = 4 * tp, b = 2, k = 24, n = 20;  // local blocks of 4·2 = 8 rows
    const std::vector<float> w = testing::randn(n * k);
    std::vector<std::vector<float>> xs(static_cast<size_t>(tp));
    for (auto& x : xs) x = testing::randn(s / tp * b * k);
    run_thread_ranks(tp, [&](int rank, std::shared_ptr<Communicator> world) {
      const Stream& st = testing::cpu_stream();
      const OwnedTensor W = testing::make_tensor(w, DType::kF32, Device::cpu(), {n, k}, st);
      const OwnedTensor local = testing::make_tensor(xs[static_cast<size_t>(rank)], DType::kF32, Device::cpu(),
                                                     {s / tp, b, k}, st);
      std::vector<float> y[2], gathered[2];
      for (int overlap = 0; overlap < 2; ++overlap) {
        auto counting = std::make_shared<CountingCommunicator>(world);
        const TensorParallelRegion region(counting, /*sequence_parallel=*/true, overlap == 1);
        EXPECT_EQ(region.comm_overlap(), overlap == 1);
        OwnedTensor full(DType::kF32, Device::cpu(), {s, b, k}), out(DType::kF32, Device::cpu(), {s, b, n});
        testing::poison(full, st);
        testing::poison(out, st);
        std::vector<int64_t> firsts;
        const Tensor out2 = out.t.view({s * b, n});
        region.all_gather_gemm(full, local, [&](const Tensor& x_rows, int64_t first) {
          firsts.push_back(first);
          linear_forward(out2.slice0(first, first + x_rows.size(0)), x_rows, W, Tensor(), Tensor(), st);
        }, st);
        y[overlap] = testing::to_host(out, st);
        gathered[overlap] = testing::to_host(full, st);
        // one GEMM per rank's block, this rank's first, then the blocks in the order they arrive
        ASSERT_EQ(firsts.size(), static_cast<size_t>(tp));
        for (int i = 0; i < tp; ++i) EXPECT_EQ(firsts[static_cast<size_t>(i)], (rank + tp - i) % tp * (s / tp * b));
        EXPECT_EQ(counting->sends, overlap == 1 ? tp - 1 : 0);  // overlapped: point-to-point only
        EXPECT_EQ(counting->all_gathers, overlap == 1 ? 0 : 1);
      }
      EXPECT_TRUE(testing::all_finite(y[1]));
      EXPECT_TRUE(testing::same_bits(gathered[1], gathered[0])) << "rank " << rank << ": the gathered input";
      EXPECT_TRUE(testing::same_bits(y[1], y[0])) << "rank " << rank << ": the GEMM output";
    });
  }
}

// Partial products x·Wᵀ of every rank's columns, summed over the ranks and scattered by rows, as
// RowParallelLinear does; the tail (a weight gradient) runs once, after every block's GEMM.
TEST(TpCommOverlap, GemmReduceScatterEqualsGemmThenReduceScatter) {
  for (int tp : {2, 3, 4}) {
    SCOPED_TRACE(tp);
    const int64_t s = 4 * tp, b = 2, k = 24, n = 20;
    std::vector<std::vector<float>> xs(static_cast<size_t>(tp)), ws(static_cast<size_t>(tp));
    for (auto& x : xs) x = testing::randn(s * b * k);
    for (auto& w : ws) w = testing::randn(n * k);
    run_thread_ranks(tp, [&](int rank, std::shared_ptr<Communicator> world) {
      const Stream& st = testing::cpu_stream();
      const OwnedTensor W = testing::make_tensor(ws[static_cast<size_t>(rank)], DType::kF32, Device::cpu(), {n, k}, st);
      const OwnedTensor X = testing::make_tensor(xs[static_cast<size_t>(rank)], DType::kF32, Device::cpu(),
                                                 {s * b, k}, st);
      std::vector<float> y[2];
      for (int overlap = 0; overlap < 2; ++overlap) {
        auto counting = std::make_shared<CountingCommunicator>(world);
        const TensorParallelRegion region(counting, /*sequence_parallel=*/true, overlap == 1);
        OwnedTensor full(DType::kF32, Device::cpu(), {s, b, n}), local(DType::kF32, Device::cpu(), {s / tp, b, n});
        testing::poison(full, st);
        testing::poison(local, st);
        int gemms = 0, tails = 0;
        region.gemm_reduce_scatter(local, full, [&](const Tensor& out_rows, int64_t first) {
          ++gemms;
          linear_forward(out_rows, X.t.slice0(first, first + out_rows.size(0)), W, Tensor(), Tensor(), st);
        }, [&] {
          ++tails;
          EXPECT_EQ(gemms, tp) << "the tail runs after the GEMMs";
        }, st);
        EXPECT_EQ(tails, 1);
        y[overlap] = testing::to_host(local, st);
        EXPECT_EQ(counting->sends, overlap == 1 ? tp - 1 : 0);
        EXPECT_EQ(counting->reduce_scatters, overlap == 1 ? 0 : 1);
      }
      EXPECT_TRUE(testing::all_finite(y[1]));
      EXPECT_TRUE(testing::same_bits(y[1], y[0])) << "rank " << rank;
    });
  }
}

// The thread communicator's reduce_scatter sums in rank order in fp32: the pieces summed by
// rank_order_sum give its bits, and the order shows (1e8 + 1 − 1e8 = 0 in fp32, not 1).
TEST(RankOrderSum, IsTheThreadReduceScatter) {
  const Stream& st = testing::cpu_stream();
  const OwnedTensor a = testing::make_tensor({1e8f, 3.f}, DType::kF32, Device::cpu(), {2}, st);
  const OwnedTensor b = testing::make_tensor({1.f, 0.5f}, DType::kF32, Device::cpu(), {2}, st);
  const OwnedTensor c = testing::make_tensor({-1e8f, 0.25f}, DType::kF32, Device::cpu(), {2}, st);
  const Tensor pieces[] = {a, b, c};
  OwnedTensor out(DType::kF32, Device::cpu(), {2});
  rank_order_sum(out, pieces, 3, st);
  EXPECT_EQ(testing::to_host(out, st), (std::vector<float>{0.f, 3.75f}));
  const Tensor reordered[] = {a, c, b};
  rank_order_sum(out, reordered, 3, st);
  EXPECT_EQ(testing::to_host(out, st), (std::vector<float>{1.f, 3.75f}));
  rank_order_sum(a, pieces, 3, st);  // out may be one of the pieces
  EXPECT_EQ(testing::to_host(a, st), (std::vector<float>{0.f, 3.75f}));

  for (const int n : {2, 3, 4}) {
    const int64_t m = 37;
    std::vector<std::vector<float>> ins(static_cast<size_t>(n));
    for (auto& v : ins) v = testing::randn(n * m, 1e3f);
    run_thread_ranks(n, [&](int rank, std::shared_ptr<Communicator> world) {
      const Stream& s = testing::cpu_stream();
      std::vector<OwnedTensor> in;
      for (int r = 0; r < n; ++r) in.push_back(testing::make_tensor(ins[static_cast<size_t>(r)], DType::kF32,
                                                                     Device::cpu(), {n * m}, s));
      OwnedTensor scattered(DType::kF32, Device::cpu(), {m}), summed(DType::kF32, Device::cpu(), {m});
      world->reduce_scatter(scattered, in[static_cast<size_t>(rank)], ReduceOp::kSum, s);
      std::vector<Tensor> mine;
      for (int r = 0; r < n; ++r) mine.push_back(in[static_cast<size_t>(r)].t.slice0(rank * m, (rank + 1) * m));
      rank_order_sum(summed, mine.data(), n, s);
      EXPECT_TRUE(testing::same_bits(testing::to_host(summed, s), testing::to_host(scattered, s))) << n << " rank " << rank;
    });
  }
}

TEST(RankOrderSum, Errors) {
  const Stream& st = testing::cpu_stream();
  const OwnedTensor a(DType::kF32, Device::cpu(), {4}), b(DType::kF32, Device::cpu(), {5});
  const OwnedTensor i(DType::kI32, Device::cpu(), {4});
  const Tensor nine[] = {a, a, a, a, a, a, a, a, a};
  testing::expect_error([&] { rank_order_sum(a, nine, 0, st); }, "0 pieces, expected 1 to 8");
  testing::expect_error([&] { rank_order_sum(a, nine, 9, st); }, "9 pieces, expected 1 to 8");
  const Tensor mixed[] = {a, b};
  testing::expect_error([&] { rank_order_sum(a, mixed, 2, st); }, "piece 1");
  const Tensor ints[] = {i};
  testing::expect_error([&] { rank_order_sum(i, ints, 1, st); }, "needs fp32, bf16 or fp16");
}

// Megatron-LM: "Tensor parallel communication/GEMM overlap can happen only when sequence
// parallelism is enabled"; it turns --sequence-parallel off at TP 1, so TP 1 fails too.
TEST(TpCommOverlap, NeedsSequenceParallelismOverSeveralRanks) {
  run_thread_ranks(2, [](int, std::shared_ptr<Communicator> world) {
    testing::expect_error([&] { TensorParallelRegion(world, false, true); },
                          "--tp-comm-overlap needs --sequence-parallel with --tensor-model-parallel-size > 1, got "
                          "sequence parallelism off with tensor parallel size 2");
    EXPECT_TRUE(TensorParallelRegion(world, true, true).comm_overlap());
  });
  testing::expect_error([] { TensorParallelRegion(std::make_shared<SingleRankCommunicator>("tp"), true, true); },
                        "got sequence parallelism on with tensor parallel size 1");
  run_thread_ranks(9, [](int, std::shared_ptr<Communicator> world) {
    testing::expect_error([&] { TensorParallelRegion(world, true, true); },
                          "--tp-comm-overlap supports up to 8 tensor-parallel ranks, got 9");
  });
}

// The model passes TransformerConfig::tp_comm_overlap (--tp-comm-overlap) to its region: the same
// errors from GPTModel (its memory plan runs them before anything is allocated); the inference
// models planned from an overlapped one (no sequence parallelism) run without it.
TEST(TpCommOverlap, ModelFlagChecks) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.seq_length = 8;
  c.vocab_size = 61;
  c.make_vocab_size_divisible_by = 8;
  c.tp_comm_overlap = true;
  const std::string needle = "--tp-comm-overlap needs --sequence-parallel";
  testing::expect_error([&] { GPTModel(c, 2, DType::kF32, Device::cpu(), ProcessGroups::single(), true); }, needle);
  run_thread_ranks(2, [&](int, std::shared_ptr<Communicator> world) {
    ProcessGroups g = ProcessGroups::single();
    g.world = g.tp = world;
    testing::expect_error([&] { GPTModel::memory_plan(c, 2, DType::kF32, Device::cpu(), g, false); }, needle);
    GPTModel model(c, 2, DType::kF32, Device::cpu(), g, true);
    EXPECT_TRUE(model.planned_for(8, 1, testing::cpu_stream()) != nullptr);
  });
}

}  // namespace
}  // namespace mt
