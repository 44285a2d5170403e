// ops/grouped_matmul.h on the CPU against a float64 reference written here: uneven group sizes
// (including empty groups and one group holding every row), the tail rows zeroed, tail inputs
// (NaN) never read, the weight gradient accumulated, and the documented errors.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "ops/grouped_matmul.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::cpu_stream;
using testing::make_int_tensor;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::randn;
using testing::rel_err;
using testing::to_host;
const Device kCpu = Device::cpu();

struct Problem {
  int64_t R, n, k;
  std::vector<int32_t> counts;
};

struct Data {
  std::vector<float> x, dy;               // [R, k], [R, n]; NaN in the tail rows
  std::vector<std::vector<float>> w, dw;  // G x [n, k]
};

Data make_data(const Problem& p) {
  const int64_t used = std::accumulate(p.counts.begin(), p.counts.end(), int64_t{0});
  Data d;
  d.x = randn(p.R * p.k);
  d.dy = randn(p.R * p.n);
  for (int64_t i = used * p.k; i < p.R * p.k; ++i) d.x[static_cast<size_t>(i)] = NAN;
  for (int64_t i = used * p.n; i < p.R * p.n; ++i) d.dy[static_cast<size_t>(i)] = NAN;
  for (size_t g = 0; g < p.counts.size(); ++g) {
    d.w.push_back(randn(p.n * p.k));
    d.dw.push_back(randn(p.n * p.k));
  }
  return d;
}

// float64 references.
std::vector<double> forward_ref(const Problem& p, const Data& d) {
  std::vector<double> y(static_cast<size_t>(p.R * p.n), 0.0);
  int64_t off = 0;
  for (size_t g = 0; g < p.counts.size(); ++g) {
    for (int64_t i = off; i < off + p.counts[g]; ++i)
      for (int64_t j = 0; j < p.n; ++j) {
        double s = 0;
        for (int64_t r = 0; r < p.k; ++r) s += double(d.x[size_t(i * p.k + r)]) * d.w[g][size_t(j * p.k + r)];
        y[size_t(i * p.n + j)] = s;
      }
    off += p.counts[g];
  }
  return y;
}

std::vector<double> dgrad_ref(const Problem& p, const Data& d) {
  std::vector<double> dx(static_cast<size_t>(p.R * p.k), 0.0);
  int64_t off = 0;
  for (size_t g = 0; g < p.counts.size(); ++g) {
    for (int64_t i = off; i < off + p.counts[g]; ++i)
      for (int64_t j = 0; j < p.k; ++j) {
        double s = 0;
        for (int64_t r = 0; r < p.n; ++r) s += double(d.dy[size_t(i * p.n + r)]) * d.w[g][size_t(r * p.k + j)];
        dx[size_t(i * p.k + j)] = s;
      }
    off += p.counts[g];
  }
  return dx;
}

std::vector<double> wgrad_ref(const Problem& p, const Data& d, size_t g) {
  int64_t off = 0;
  for (size_t q = 0; q < g; ++q) off += p.counts[q];
  std::vector<double> dw(d.dw[g].begin(), d.dw[g].end());
  for (int64_t i = 0; i < p.n; ++i)
    for (int64_t j = 0; j < p.k; ++j) {
      double s = 0;
      for (int64_t r = off; r < off + p.counts[g]; ++r) s += double(d.dy[size_t(r * p.n + i)]) * d.x[size_t(r * p.k + j)];
      dw[size_t(i * p.k + j)] += s;
    }
  return dw;
}

struct Owned {
  std::vector<OwnedTensor> store;
  GroupedWeights weights;
};
Owned make_weights(const std::vector<std::vector<float>>& host, int64_t n, int64_t k) {
  Owned o;
  std::vector<Tensor> views;
  for (const auto& h : host) {
    o.store.push_back(make_tensor(h, DType::kF32, kCpu, {n, k}, cpu_stream()));
    views.push_back(o.store.back().t);
  }
  o.weights = GroupedWeights(views, cpu_stream());
  return o;
}

void check_problem(const Problem& p) {
  SCOPED_TRACE(::testing::Message() << "R=" << p.R << " n=" << p.n << " k=" << p.k << " G=" << p.counts.size());
  const Data d = make_data(p);
  auto x = make_tensor(d.x, DType::kF32, kCpu, {p.R, p.k}, cpu_stream());
  auto dy = make_tensor(d.dy, DType::kF32, kCpu, {p.R, p.n}, cpu_stream());
  auto counts = make_int_tensor(p.counts, kCpu, {static_cast<int64_t>(p.counts.size())}, cpu_stream());
  Owned w = make_weights(d.w, p.n, p.k), dw = make_weights(d.dw, p.n, p.k);
  auto y = OwnedTensor(DType::kF32, kCpu, {p.R, p.n});
  auto dx = OwnedTensor(DType::kF32, kCpu, {p.R, p.k});
  testing::poison(y, cpu_stream());
  testing::poison(dx, cpu_stream());
  grouped_linear_forward(y, x, w.weights, counts, cpu_stream());
  grouped_linear_dgrad(dx, dy, w.weights, counts, cpu_stream());
  grouped_linear_wgrad(dw.weights, dy, x, counts, cpu_stream());
  const auto yh = to_host(y, cpu_stream()), dxh = to_host(dx, cpu_stream());
  EXPECT_TRUE(testing::all_finite(yh));
  EXPECT_TRUE(testing::all_finite(dxh));
  EXPECT_LT(rel_err(yh, forward_ref(p, d)), 1e-5);
  EXPECT_LT(rel_err(dxh, dgrad_ref(p, d)), 1e-5);
  const int64_t used = std::accumulate(p.counts.begin(), p.counts.end(), int64_t{0});
  for (int64_t i = used * p.n; i < p.R * p.n; ++i) ASSERT_EQ(yh[size_t(i)], 0.f) << "tail of y at " << i;
  for (int64_t i = used * p.k; i < p.R * p.k; ++i) ASSERT_EQ(dxh[size_t(i)], 0.f) << "tail of dx at " << i;
  for (size_t g = 0; g < p.counts.size(); ++g) {
    const auto got = to_host(dw.store[g], cpu_stream());
    if (p.counts[g] == 0) {
      EXPECT_EQ(got, d.dw[g]) << "empty group " << g << " changed its gradient";
    } else {
      EXPECT_LT(rel_err(got, wgrad_ref(p, d, g)), 1e-5) << "group " << g;
    }
  }
}

TEST(GroupedMatmul, UnevenGroups) {
  check_problem({40, 12, 9, {7, 0, 13, 1, 0, 11}});  // 32 of 40 rows: a tail of 8
}

TEST(GroupedMatmul, OneGroupHoldsEveryRow) {
  check_problem({25, 6, 10, {0, 25, 0}});
  check_problem({17, 5, 3, {17}});
}

TEST(GroupedMatmul, AllEmpty) { check_problem({9, 4, 5, {0, 0, 0, 0}}); }

TEST(GroupedMatmul, Errors) {
  auto x = OwnedTensor(DType::kF32, kCpu, {10, 4});
  auto y = OwnedTensor(DType::kF32, kCpu, {10, 3});
  auto w0 = OwnedTensor(DType::kF32, kCpu, {3, 4}), w1 = OwnedTensor(DType::kF32, kCpu, {3, 4});
  auto wbad = OwnedTensor(DType::kF32, kCpu, {4, 4});
  GroupedWeights w({w0.t, w1.t}, cpu_stream());
  auto too_many = make_int_tensor({6, 5}, kCpu, {2}, cpu_stream());
  EXPECT_THROW(grouped_linear_forward(y, x, w, too_many, cpu_stream()), Error);  // 11 rows > 10
  auto negative = make_int_tensor({-1, 5}, kCpu, {2}, cpu_stream());
  EXPECT_THROW(grouped_linear_forward(y, x, w, negative, cpu_stream()), Error);
  auto three = make_int_tensor({1, 2, 3}, kCpu, {3}, cpu_stream());
  EXPECT_THROW(grouped_linear_forward(y, x, w, three, cpu_stream()), Error);  // G mismatch
  auto ok = make_int_tensor({4, 5}, kCpu, {2}, cpu_stream());
  EXPECT_THROW(grouped_linear_forward(x, x, w, ok, cpu_stream()), Error);  // y [10, 4] != [R, n]
  EXPECT_THROW(grouped_linear_dgrad(y, y, w, ok, cpu_stream()), Error);    // dx must be [R, k]
  EXPECT_THROW(GroupedWeights({w0.t, wbad.t}, cpu_stream()), Error);        // shapes differ
  EXPECT_THROW(GroupedWeights({}, cpu_stream()), Error);
  auto y16 = OwnedTensor(DType::kBF16, kCpu, {10, 3});
  EXPECT_THROW(grouped_linear_forward(y16, x, w, ok, cpu_stream()), Error);  // dtype
  auto wb0 = OwnedTensor(DType::kBF16, kCpu, {3, 4});
  GroupedWeights wb({wb0.t, wb0.t}, cpu_stream());
  EXPECT_THROW(grouped_linear_wgrad(wb, y, x, ok, cpu_stream()), Error);  // dw not fp32
  grouped_linear_forward(y, x, w, ok, cpu_stream());                      // and the valid call runs
}

}  // namespace
}  // namespace mt
