// Collective checks shared by the MPI (CPU) and NCCL (CUDA) dist tests: every rank of `comm`
// runs the same check with the same seed; each rank can regenerate every other rank's input
// from (seed, tag, rank), so expected values are computed locally in float64. Float inputs are
// non-zero integers in [-8, 8], so sums over a few ranks are exact in fp32, bf16 and fp16 and
// results are compared exactly; one fp32 check uses normal data with a tolerance.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/check.h"
#include "testing/testing.h"

namespace mt::comm_test {

using testing::OwnedTensor;

/// Rank r's input for check `tag`: non-zero integer values (float dtypes: [-8, 8]; int32:
/// [-1000, 1000]), or N(0, 1) when `normal`.
inline std::vector<float> rank_values(uint64_t seed, int tag, int r, int64_t n, DType dtype, bool normal = false) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), static_cast<uint32_t>(tag),
                    static_cast<uint32_t>(r)};
  std::mt19937_64 rng(seq);
  std::vector<float> v(n);
  if (normal) {
    std::normal_distribution<float> d(0.f, 1.f);
    for (auto& x : v) x = d(rng);
    return v;
  }
  const int hi = dtype == DType::kI32 ? 1000 : 8;
  std::uniform_int_distribution<int> mag(1, hi), sign(0, 1);
  for (auto& x : v) x = static_cast<float>(sign(rng) ? mag(rng) : -mag(rng));
  return v;
}

inline OwnedTensor make(const std::vector<float>& host, DType dtype, Device dev, const Stream& s) {
  const std::vector<int64_t> shape{static_cast<int64_t>(host.size())};
  if (dtype == DType::kI32) {
    std::vector<int32_t> iv(host.begin(), host.end());
    return testing::make_int_tensor(iv, dev, shape, s);
  }
  return testing::make_tensor(host, dtype, dev, shape, s);
}

inline void poison_any(const Tensor& t, const Stream& s) {
  if (t.dtype() == DType::kI32) {
    memset_tensor(t, 0x7f, s);
    s.synchronize();
  } else {
    testing::poison(t, s);
  }
}

inline double reduce(ReduceOp op, double a, double b) {
  if (op == ReduceOp::kSum) return a + b;
  if (op == ReduceOp::kMax) return std::max(a, b);
  return std::min(a, b);
}

/// Exact comparison (integer-valued data); reports the first mismatch.
inline void expect_equal(const std::vector<float>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (static_cast<double>(got[i]) != want[i]) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", expected " << want[i];
      return;
    }
  }
}

inline std::string ctx(const Communicator& c, const char* op, DType dt) {
  return fmt::format("{} {} on group '{}' rank {} of {}", op, dtype_name(dt), c.name(), c.rank(), c.size());
}

inline void check_all_reduce(Communicator& c, Device dev, const Stream& s, uint64_t seed, DType dt, ReduceOp op,
                             int64_t n) {
  const int tag = 100 + static_cast<int>(op);
  auto x = make(rank_values(seed, tag, c.rank(), n, dt), dt, dev, s);
  c.all_reduce(x, op, s);
  std::vector<double> want(n);
  for (int r = 0; r < c.size(); ++r) {
    auto v = rank_values(seed, tag, r, n, dt);
    for (int64_t i = 0; i < n; ++i) want[i] = r == 0 ? v[i] : reduce(op, want[i], v[i]);
  }
  expect_equal(testing::to_host(x, s), want, ctx(c, "all_reduce", dt) + " op " + std::to_string(int(op)));
}

/// fp32 normal data: the reduction order is the backend's, so compare with a tolerance
/// (a sum of a few O(1) fp32 values: rel. err. < 1e-6).
inline void check_all_reduce_normal(Communicator& c, Device dev, const Stream& s, uint64_t seed, int64_t n) {
  auto x = make(rank_values(seed, 7, c.rank(), n, DType::kF32, true), DType::kF32, dev, s);
  c.all_reduce(x, ReduceOp::kSum, s);
  std::vector<double> want(n, 0.0);
  for (int r = 0; r < c.size(); ++r) {
    auto v = rank_values(seed, 7, r, n, DType::kF32, true);
    for (int64_t i = 0; i < n; ++i) want[i] += v[i];
  }
  EXPECT_LT(testing::rel_err(testing::to_host(x, s), want), 1e-6) << ctx(c, "all_reduce normal", DType::kF32);
}

inline void check_all_gather(Communicator& c, Device dev, const Stream& s, uint64_t seed, DType dt, int64_t n,
                             bool in_place) {
  const int P = c.size(), me = c.rank();
  auto mine = rank_values(seed, 200, me, n, dt);
  OwnedTensor out(dt, dev, {P * n});
  poison_any(out, s);
  OwnedTensor in_own;
  Tensor in;
  if (in_place) {
    in = out.t.flat_range(me * n, n);
    copy(in, make(mine, dt, dev, s), s);
  } else {
    in_own = make(mine, dt, dev, s);
    in = in_own.t;
  }
  c.all_gather(out, in, s);
  std::vector<double> want;
  for (int r = 0; r < P; ++r) {
    auto v = rank_values(seed, 200, r, n, dt);
    want.insert(want.end(), v.begin(), v.end());
  }
  expect_equal(testing::to_host(out, s), want, ctx(c, in_place ? "all_gather (in place)" : "all_gather", dt));
}

inline void check_reduce_scatter(Communicator& c, Device dev, const Stream& s, uint64_t seed, DType dt, ReduceOp op,
                                 int64_t n, bool in_place) {
  const int P = c.size(), me = c.rank();
  auto in = make(rank_values(seed, 300, me, P * n, dt), dt, dev, s);
  OwnedTensor out_own;
  Tensor out;
  if (in_place) {
    out = in.t.flat_range(me * n, n);
  } else {
    out_own = OwnedTensor(dt, dev, {n});
    poison_any(out_own, s);
    out = out_own.t;
  }
  c.reduce_scatter(out, in, op, s);
  std::vector<double> want(n);
  for (int r = 0; r < P; ++r) {
    auto v = rank_values(seed, 300, r, P * n, dt);
    for (int64_t i = 0; i < n; ++i) want[i] = r == 0 ? v[me * n + i] : reduce(op, want[i], v[me * n + i]);
  }
  expect_equal(testing::to_host(out, s), want,
               ctx(c, in_place ? "reduce_scatter (in place)" : "reduce_scatter", dt) + " op " +
                   std::to_string(int(op)));
}

inline void check_broadcast(Communicator& c, Device dev, const Stream& s, uint64_t seed, DType dt, int64_t n) {
  for (int root = 0; root < c.size(); ++root) {
    auto x = make(rank_values(seed, 400 + root, c.rank(), n, dt), dt, dev, s);
    c.broadcast(x, root, s);
    auto v = rank_values(seed, 400 + root, root, n, dt);
    expect_equal(testing::to_host(x, s), std::vector<double>(v.begin(), v.end()),
                 ctx(c, "broadcast", dt) + " root " + std::to_string(root));
  }
}

inline void check_all_to_all(Communicator& c, Device dev, const Stream& s, uint64_t seed, DType dt, int64_t chunk) {
  const int P = c.size(), me = c.rank();
  auto in = make(rank_values(seed, 500, me, P * chunk, dt), dt, dev, s);
  OwnedTensor out(dt, dev, {P * chunk});
  poison_any(out, s);
  c.all_to_all(out, in, s);
  std::vector<double> want;
  for (int r = 0; r < P; ++r) {  // chunk r of out = chunk `me` of rank r's input
    auto v = rank_values(seed, 500, r, P * chunk, dt);
    want.insert(want.end(), v.begin() + me * chunk, v.begin() + (me + 1) * chunk);
  }
  expect_equal(testing::to_host(out, s), want, ctx(c, "all_to_all", dt));
}

/// all_to_allv layouts of check_all_to_allv.
enum class AllToAllvPattern {
  kUnequal,        ///< unequal splits with zeros, send pieces out of order with gaps, packed receive
  kUnequalGapped,  ///< the same with receive pieces at explicit offsets, in reverse order, with gaps
  kGatherv,        ///< every rank sends the same piece (its own size, rank 0: none) to every rank
};

/// Elements rank `src` sends to rank `dst` (pattern-dependent; zero for some pairs).
inline int64_t a2av_count(AllToAllvPattern p, int src, int dst, int64_t unit) {
  if (p == AllToAllvPattern::kGatherv) return (src % 3) * unit;
  return ((src * 5 + dst * 3 + 1) % 4) * unit;  // 0..3 units: zero for some pairs, self included
}

/// Rank `me`'s send side: pieces placed for dst = P-1 .. 0 with one spare element before each
/// (gatherv: one piece at offset 0 shared by all). Returns the splits and the input size.
inline AllToAllvSplits a2av_send(AllToAllvPattern p, int me, int P, int64_t unit, int64_t* numel) {
  AllToAllvSplits s;
  s.counts.resize(P);
  s.offsets.resize(P);
  int64_t off = 0;
  for (int dst = P - 1; dst >= 0; --dst) {
    s.counts[dst] = a2av_count(p, me, dst, unit);
    if (p == AllToAllvPattern::kGatherv) {
      s.offsets[dst] = 0;
      off = s.counts[dst];
    } else {
      s.offsets[dst] = off + 1;
      off += 1 + s.counts[dst];
    }
  }
  *numel = std::max<int64_t>(off, 1);
  return s;
}

inline void check_all_to_allv(Communicator& c, Device dev, const Stream& s, uint64_t seed, DType dt,
                              AllToAllvPattern pattern, int64_t unit) {
  const int P = c.size(), me = c.rank();
  const int tag = 800 + static_cast<int>(pattern);
  int64_t n_in = 0;
  const AllToAllvSplits send = a2av_send(pattern, me, P, unit, &n_in);
  auto in = make(rank_values(seed, tag, me, n_in, dt), dt, dev, s);
  AllToAllvSplits recv;
  recv.counts.resize(P);
  for (int src = 0; src < P; ++src) recv.counts[src] = a2av_count(pattern, src, me, unit);
  int64_t n_out = recv.total();
  if (pattern == AllToAllvPattern::kUnequalGapped) {
    recv.offsets.resize(P);
    int64_t off = 0;
    for (int src = P - 1; src >= 0; --src) {
      recv.offsets[src] = off + 2;
      off += 2 + recv.counts[src];
    }
    n_out = off;
  }
  OwnedTensor out(dt, dev, {std::max<int64_t>(n_out, 1)});
  poison_any(out, s);
  c.all_to_allv(out, recv, in, send, s);
  const std::vector<float> got = testing::to_host(out, s);
  const std::vector<int64_t> roff = recv.resolved_offsets();
  const std::string what = ctx(c, "all_to_allv", dt) + " pattern " + std::to_string(static_cast<int>(pattern));
  for (int src = 0; src < P; ++src) {  // piece `src` = rank src's input at its send offset for me
    int64_t src_numel = 0;
    const AllToAllvSplits ss = a2av_send(pattern, src, P, unit, &src_numel);
    const auto v = rank_values(seed, tag, src, src_numel, dt);
    const int64_t n = recv.counts[src];
    std::vector<float> piece(got.begin() + roff[src], got.begin() + roff[src] + n);
    std::vector<double> want(v.begin() + ss.offsets[me], v.begin() + ss.offsets[me] + n);
    expect_equal(piece, want, what + " from rank " + std::to_string(src));
  }
}

/// all_to_allv argument errors (no communication happens): wrong number of counts, a negative
/// count, a piece beyond the tensor, overlapping receive pieces, a dtype mismatch.
inline void check_all_to_allv_errors(Communicator& c, Device dev, const Stream& s) {
  const int P = c.size();
  OwnedTensor a(DType::kF32, dev, {4 * P}), b(DType::kF32, dev, {4 * P}), h(DType::kBF16, dev, {4 * P});
  AllToAllvSplits ok{std::vector<int64_t>(P, 4), {}};
  auto expect_error = [&](auto&& fn, const char* what, const char* needle) {
    try {
      fn();
      ADD_FAILURE() << what << ": no mt::Error";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(fmt::format("group '{}'", c.name())), std::string::npos) << what << ": " << m;
      EXPECT_NE(m.find(needle), std::string::npos) << what << ": " << m;
    }
  };
  AllToAllvSplits short_counts{std::vector<int64_t>(P + 1, 0), {}};
  expect_error([&] { c.all_to_allv(a, short_counts, b, ok, s); }, "counts of the wrong length", "one per rank");
  AllToAllvSplits negative = ok;
  negative.counts[0] = -1;
  expect_error([&] { c.all_to_allv(a, ok, b, negative, s); }, "negative count", "must be >= 0");
  AllToAllvSplits beyond = ok;
  beyond.counts[P - 1] = 5;
  expect_error([&] { c.all_to_allv(a, beyond, b, ok, s); }, "piece beyond the tensor", "exceeds");
  if (P > 1) {
    AllToAllvSplits overlap{std::vector<int64_t>(P, 2), std::vector<int64_t>(P, 0)};
    expect_error([&] { c.all_to_allv(a, overlap, b, ok, s); }, "overlapping receive pieces", "overlap");
  }
  expect_error([&] { c.all_to_allv(h, ok, b, ok, s); }, "dtype mismatch", "dtype");
  expect_error([&] { c.all_to_allv(a, ok, a, ok, s); }, "in place", "in-place");
}

/// Every rank sends to both ring neighbours and receives from both inside one group: only
/// batched (non-blocking) semantics make this deadlock-free.
inline void check_ring_both_directions(Communicator& c, Device dev, const Stream& s, uint64_t seed, DType dt,
                                       int64_t n) {
  const int P = c.size(), me = c.rank();
  if (P < 2) return;
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  auto fwd = make(rank_values(seed, 600, me, n, dt), dt, dev, s);  // goes to next
  auto bwd = make(rank_values(seed, 601, me, n, dt), dt, dev, s);  // goes to prev
  OwnedTensor from_prev(dt, dev, {n}), from_next(dt, dev, {n});
  poison_any(from_prev, s);
  poison_any(from_next, s);
  c.group_start();
  c.send(fwd, next, s);
  c.send(bwd, prev, s);
  c.recv(from_prev, prev, s);
  c.recv(from_next, next, s);
  c.group_end();
  auto a = rank_values(seed, 600, prev, n, dt), b = rank_values(seed, 601, next, n, dt);
  expect_equal(testing::to_host(from_prev, s), std::vector<double>(a.begin(), a.end()), ctx(c, "ring recv prev", dt));
  expect_equal(testing::to_host(from_next, s), std::vector<double>(b.begin(), b.end()), ctx(c, "ring recv next", dt));
}

/// Pairs (0,1), (2,3), ...: even ranks send then receive, odd ranks receive then send, outside
/// any group.
inline void check_pairwise_p2p(Communicator& c, Device dev, const Stream& s, uint64_t seed, DType dt, int64_t n) {
  const int me = c.rank(), peer = me ^ 1;
  if (peer >= c.size()) return;
  auto mine = make(rank_values(seed, 700, me, n, dt), dt, dev, s);
  OwnedTensor got(dt, dev, {n});
  poison_any(got, s);
  if (me % 2 == 0) {
    c.send(mine, peer, s);
    c.recv(got, peer, s);
  } else {
    c.recv(got, peer, s);
    c.send(mine, peer, s);
  }
  auto v = rank_values(seed, 700, peer, n, dt);
  expect_equal(testing::to_host(got, s), std::vector<double>(v.begin(), v.end()), ctx(c, "pairwise p2p", dt));
}

/// color = rank % 2, key = -rank: each group holds the ranks of one parity in descending order.
/// Checks rank/size/name, then an all_gather of the world ranks and an all_reduce inside it;
/// then a split where rank 0 passes color -1 (gets nullptr).
inline void check_split(Communicator& world, Device dev, const Stream& s) {
  const int P = world.size(), me = world.rank();
  auto sub = world.split(me % 2, -me, "parity");
  ASSERT_NE(sub, nullptr);
  std::vector<double> members;  // descending world ranks of my parity
  for (int r = P - 1; r >= 0; --r) {
    if (r % 2 == me % 2) members.push_back(r);
  }
  EXPECT_EQ(sub->name(), "parity");
  EXPECT_EQ(sub->size(), static_cast<int>(members.size()));
  EXPECT_EQ(sub->rank(), static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin()));
  auto mine = make({static_cast<float>(me)}, DType::kI32, dev, s);
  OwnedTensor all(DType::kI32, dev, {sub->size()});
  sub->all_gather(all, mine, s);
  expect_equal(testing::to_host(all, s), members, "split all_gather of world ranks");
  auto sum = make({static_cast<float>(me + 1)}, DType::kF32, dev, s);
  sub->all_reduce(sum, ReduceOp::kSum, s);
  double want = 0;
  for (double r : members) want += r + 1;
  expect_equal(testing::to_host(sum, s), {want}, "split all_reduce");
  sub->barrier();

  auto some = world.split(me == 0 ? -1 : 0, me, "not-rank-0");
  if (me == 0) {
    EXPECT_EQ(some, nullptr);
  } else {
    ASSERT_NE(some, nullptr);
    EXPECT_EQ(some->size(), P - 1);
    EXPECT_EQ(some->rank(), me - 1);
    auto one = make({1.f}, DType::kF32, dev, s);
    some->all_reduce(one, ReduceOp::kSum, s);
    expect_equal(testing::to_host(one, s), {static_cast<double>(P - 1)}, "split without rank 0");
  }

  // Groups of one rank: collectives are no-ops / copies.
  auto self = world.split(me, 0, "self");
  ASSERT_NE(self, nullptr);
  EXPECT_EQ(self->size(), 1);
  auto x = make({3.f, -2.f}, DType::kF32, dev, s);
  self->all_reduce(x, ReduceOp::kSum, s);
  expect_equal(testing::to_host(x, s), {3.0, -2.0}, "size-1 all_reduce");
}

/// Invalid arguments throw mt::Error naming the group and rank (no communication happens).
inline void check_errors(Communicator& c, Device dev, const Stream& s) {
  auto expect_error = [&](auto&& fn, const char* what) {
    try {
      fn();
      ADD_FAILURE() << what << ": no mt::Error";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(fmt::format("group '{}'", c.name())), std::string::npos) << what << ": " << m;
      EXPECT_NE(m.find(fmt::format("rank {} of {}", c.rank(), c.size())), std::string::npos) << what << ": " << m;
    }
  };
  const int P = c.size();
  OwnedTensor a(DType::kF32, dev, {P * 4}), b(DType::kF32, dev, {4}), h(DType::kBF16, dev, {4});
  OwnedTensor u8(DType::kU8, dev, {4});
  expect_error([&] { c.all_gather(a, h, s); }, "all_gather dtype mismatch");
  expect_error([&] { c.all_gather(b, b, s); }, "all_gather size mismatch");
  expect_error([&] { c.reduce_scatter(a, b, ReduceOp::kSum, s); }, "reduce_scatter size mismatch");
  expect_error([&] { c.all_reduce(u8, ReduceOp::kSum, s); }, "all_reduce of uint8");
  expect_error([&] { c.broadcast(b, P, s); }, "broadcast root out of range");
  expect_error([&] { c.send(b, c.rank(), s); }, "send to self");
  expect_error([&] { c.recv(b, -1, s); }, "recv from -1");
  expect_error([&] { c.all_to_all(a, a, s); }, "all_to_all in place");
  if (P > 1) {
    const int other = (c.rank() + 1) % P;
    expect_error([&] { c.all_gather(a, a.t.flat_range(other * 4, 4), s); }, "all_gather in = another rank's slice");
    expect_error([&] { c.reduce_scatter(a.t.flat_range(other * 4, 4), a, ReduceOp::kSum, s); },
                 "reduce_scatter out = another rank's chunk");
  }
  // A tensor on the wrong device.
  Tensor wrong(b.t.data(), DType::kF32, dev.is_cpu() ? Device::cuda(0) : Device::cpu(), {4});
  expect_error([&] { c.all_reduce(wrong, ReduceOp::kSum, s); }, "tensor on the wrong device");
}

}  // namespace mt::comm_test
