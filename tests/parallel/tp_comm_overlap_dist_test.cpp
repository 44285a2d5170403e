// --tp-comm-overlap over the MPI backend (CPU processes under mpiexec, 4 ranks): the pipelined
// all-gather + GEMM and GEMM + reduce-scatter of parallel/mappings.h with MPI's non-blocking
// send/recv, on the whole world (TP 4) and on its halves (TP 2, split). The gathered input and the
// blocked GEMM's output equal the plain all-gather's bit for bit; the overlapped reduce-scatter
// equals the rank-order sum of every rank's partial block (each rank recomputes all ranks' data
// from one seed) bit for bit, and MPI's reduce_scatter bit for bit on two ranks (a + b) and within
// fp32 rounding on four (OpenMPI sums in its own order).
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "comm/mpi/mpi_communicator.h"
#include "comm/rank_order_sum.h"
#include "ops/matmul.h"
#include "parallel/mappings.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;

std::shared_ptr<Communicator> world() {
  static std::shared_ptr<MpiCommunicator> w = MpiCommunicator::world(120.0);
  return w;
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

/// n normal values drawn from (seed, stream): every rank can make any rank's data.
std::vector<float> draw(uint64_t stream, int64_t n) {
  std::mt19937_64 g(seed() * 1000003 + stream);
  std::normal_distribution<float> d;
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(g);
  return v;
}

/// The TP groups under test: the world (TP 4 under mpiexec -np 4) and its halves (TP 2).
std::vector<std::shared_ptr<Communicator>> groups() {
  std::vector<std::shared_ptr<Communicator>> v{world()};
  if (world()->size() % 2 == 0 && world()->size() > 2) v.push_back(world()->split(world()->rank() / 2, 0, "half"));
  return v;
}

TEST(TpCommOverlapMpi, AllGatherGemm) {
  ASSERT_GE(world()->size(), 2) << "run under mpiexec -np 4";
  const Stream& st = testing::cpu_stream();
  for (const auto& tp : groups()) {
    const int n_tp = tp->size(), r = tp->rank();
    SCOPED_TRACE(n_tp);
    const int64_t sl = 6, b = 2, k = 24, n = 20;
    const OwnedTensor w = testing::make_tensor(draw(7, n * k), DType::kF32, Device::cpu(), {n, k}, st);
    const OwnedTensor local = testing::make_tensor(draw(100 + r, sl * b * k), DType::kF32, Device::cpu(), {sl, b, k}, st);
    std::vector<float> y[2], gathered[2];
    for (int overlap = 0; overlap < 2; ++overlap) {
      const TensorParallelRegion region(tp, /*sequence_parallel=*/true, overlap == 1);
      OwnedTensor full(DType::kF32, Device::cpu(), {sl * n_tp, b, k}), out(DType::kF32, Device::cpu(), {sl * n_tp * b, n});
      testing::poison(full, st);
      testing::poison(out, st);
      region.all_gather_gemm(full, local, [&](const Tensor& x_rows, int64_t first) {
        linear_forward(out.t.slice0(first, first + x_rows.size(0)), x_rows, w, Tensor(), Tensor(), st);
      }, st);
      y[overlap] = testing::to_host(out, st);
      gathered[overlap] = testing::to_host(full, st);
    }
    std::vector<float> expect;  // the gathered input, made here from every rank's draw
    for (int j = 0; j < n_tp; ++j) {
      const std::vector<float> x = draw(100 + j, sl * b * k);
      expect.insert(expect.end(), x.begin(), x.end());
    }
    EXPECT_TRUE(testing::same_bits(gathered[0], expect)) << "plain all-gather, rank " << r;
    EXPECT_TRUE(testing::same_bits(gathered[1], expect)) << "overlapped all-gather, rank " << r;
    EXPECT_TRUE(testing::same_bits(y[1], y[0])) << "rank " << r;
  }
}

TEST(TpCommOverlapMpi, GemmReduceScatter) {
  ASSERT_GE(world()->size(), 2) << "run under mpiexec -np 4";
  const Stream& st = testing::cpu_stream();
  for (const auto& tp : groups()) {
    const int n_tp = tp->size(), r = tp->rank();
    SCOPED_TRACE(n_tp);
    const int64_t sl = 6, b = 2, k = 24, n = 20, rows = sl * b;
    // rank j's partial products x_j·W_jᵀ over all s·b rows
    auto operands = [&](int j) {
      return std::pair{testing::make_tensor(draw(200 + j, rows * n_tp * k), DType::kF32, Device::cpu(), {rows * n_tp, k}, st),
                       testing::make_tensor(draw(300 + j, n * k), DType::kF32, Device::cpu(), {n, k}, st)};
    };
    const auto [x, w] = operands(r);
    std::vector<float> y[2];
    for (int overlap = 0; overlap < 2; ++overlap) {
      const TensorParallelRegion region(tp, /*sequence_parallel=*/true, overlap == 1);
      OwnedTensor full(DType::kF32, Device::cpu(), {sl * n_tp, b, n}), local(DType::kF32, Device::cpu(), {sl, b, n});
      testing::poison(full, st);
      testing::poison(local, st);
      region.gemm_reduce_scatter(local, full, [&](const Tensor& out_rows, int64_t first) {
        linear_forward(out_rows, x.t.slice0(first, first + out_rows.size(0)), w, Tensor(), Tensor(), st);
      }, {}, st);
      y[overlap] = testing::to_host(local, st);
    }
    // Every rank's partial block of this rank's rows, by the same block GEMM, summed in rank order.
    std::vector<OwnedTensor> parts;
    std::vector<Tensor> pieces;
    for (int j = 0; j < n_tp; ++j) {
      const auto [xj, wj] = operands(j);
      parts.emplace_back(DType::kF32, Device::cpu(), std::vector<int64_t>{rows, n});
      linear_forward(parts.back(), xj.t.slice0(r * rows, (r + 1) * rows), wj, Tensor(), Tensor(), st);
    }
    for (const auto& p : parts) pieces.push_back(p.t);
    OwnedTensor expect(DType::kF32, Device::cpu(), {rows, n});
    rank_order_sum(expect, pieces.data(), n_tp, st);
    EXPECT_TRUE(testing::same_bits(y[1], testing::to_host(expect, st))) << "rank " << r;
    if (n_tp == 2) {
      EXPECT_TRUE(testing::same_bits(y[1], y[0])) << "rank " << r;
    } else {
      EXPECT_LT(testing::rel_err(y[1], y[0]), 1e-6) << "rank " << r;
    }
  }
}

}  // namespace
}  // namespace mt
