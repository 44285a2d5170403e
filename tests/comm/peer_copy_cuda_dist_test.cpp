// Copy-engine collectives (comm/nccl/peer_copy.h) on the GPUs of one host, under mpiexec (one
// rank per GPU; ctest runs 4 ranks, `mpiexec -np 2` works too). The reduce-scatter sums in rank
// order, so the owned chunks must equal the host's fp32 sum x_0 + x_1 + ... bitwise; the
// all-gather must reproduce every rank's chunk bitwise. A small staging slot forces pieces and
// the reuse of both staging generations (acknowledgement waits), several operations run back to
// back without host synchronisation, and the untouched parts of the region must stay untouched.
// A second group moves chunks of several MiB with each copy split over 3 streams per peer; bf16
// reduce-scatters must equal bf16(rank-order fp32 sums) bitwise.
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <mpi.h>

#include <cstring>
#include <random>

#include "comm/bootstrap.h"
#include "comm/nccl/peer_copy.h"
#include "core/buffer.h"
#include "testing/testing.h"

namespace mt {
namespace {

// Deterministic test values of rank r: element k of operation `op`, multiples of 2^-10 of varied
// magnitude, so that sums depend on their order in the last bits.
float value(int op, int r, size_t k) {
  uint64_t h = (static_cast<uint64_t>(op) * 0x9E3779B97F4A7C15ull) ^ (static_cast<uint64_t>(r) << 40) ^ k;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 29;
  const float mant = static_cast<float>(static_cast<int64_t>(h % 2001) - 1000) / 1024.f;
  const int e = static_cast<int>((h >> 20) % 24) - 12;
  return std::ldexp(mant, e) + 1e-3f * static_cast<float>(k % 7);
}

struct Fixture {
  std::shared_ptr<NcclCommunicator> comm;
  Device dev;
};

Fixture setup() {
  const LaunchEnv env = read_launch_env();
  Fixture f;
  f.dev = local_device(DeviceType::kCUDA, env);
  set_current_device(f.dev);
  f.comm = std::dynamic_pointer_cast<NcclCommunicator>(init_world(f.dev, env, 5.0));
  return f;
}

struct Op {
  int region;
  size_t offset, m;  // elements; chunk m per rank
};

// Runs `ops` (3 rounds of reduce-scatters without host synchronisation), then an all-gather of
// `ops[gather_op]`'s fp32 range and a byte all-gather at an odd offset, and checks everything
// bitwise. stage_elems: the group's staging slot.
void check_group(const Fixture& f, size_t stage_elems, const std::vector<Op>& ops, size_t gather_op) {
  const int n = f.comm->size(), me = f.comm->rank();
  SCOPED_TRACE(::testing::Message() << "stage " << stage_elems);
  constexpr size_t kRegion = size_t{1} << 22;  // floats per region
  Buffer a(f.dev, kRegion * 4), b(f.dev, kRegion * 4);
  std::string why;
  auto g = PeerCopyGroup::create(f.comm, {{a.data(), a.bytes()}, {b.data(), b.bytes()}}, stage_elems, &why);
  ASSERT_TRUE(g) << "copy-engine group refused: " << why;
  EXPECT_EQ(g->size(), n);
  EXPECT_EQ(g->rank(), me);
  Stream st(f.dev);
  for (const Op& op : ops) ASSERT_LE(op.offset + op.m * n, kRegion);

  std::vector<std::vector<float>> host(2, std::vector<float>(kRegion));
  for (int rg = 0; rg < 2; ++rg)
    for (size_t k = 0; k < kRegion; ++k) host[rg][k] = value(100 + rg, me, k);
  for (int rg = 0; rg < 2; ++rg)
    copy_bytes((rg ? b : a).data(), f.dev, host[rg].data(), Device::cpu(), kRegion * 4, st);
  // The ranges of the operations hold operation-specific values.
  for (size_t o = 0; o < ops.size(); ++o) {
    std::vector<float> v(ops[o].m * n);
    for (size_t k = 0; k < v.size(); ++k) v[k] = value(static_cast<int>(o), me, k);
    std::memcpy(host[ops[o].region].data() + ops[o].offset, v.data(), v.size() * 4);
    copy_bytes(static_cast<float*>((ops[o].region ? b : a).data()) + ops[o].offset, f.dev, v.data(), Device::cpu(),
               v.size() * 4, st);
  }
  st.synchronize();
  f.comm->barrier();

  for (int round = 0; round < 3; ++round) {  // the same operations again: flags keep counting
    for (const Op& op : ops) g->reduce_scatter_sum_f32(op.region, op.offset, op.m, st);
  }
  std::vector<float> got[2] = {testing::to_host(a.as(DType::kF32, {static_cast<int64_t>(kRegion)}), st),
                               testing::to_host(b.as(DType::kF32, {static_cast<int64_t>(kRegion)}), st)};
  // Expected: each round replaces the owned chunk by the rank-order sum of the peers' (unchanged)
  // copies of that chunk and the current owned values.
  std::vector<std::vector<float>> expect = host;
  for (int round = 0; round < 3; ++round) {
    for (size_t o = 0; o < ops.size(); ++o) {
      const Op& op = ops[o];
      for (size_t k = 0; k < op.m; ++k) {
        const size_t at = op.offset + me * op.m + k;
        float acc = 0.f;
        for (int r = 0; r < n; ++r) {
          const float x = r == me ? expect[op.region][at] : value(static_cast<int>(o), r, me * op.m + k);
          acc = r == 0 ? x : acc + x;
        }
        expect[op.region][at] = acc;
      }
    }
  }
  for (int rg = 0; rg < 2; ++rg) {
    size_t bad = 0;
    for (size_t k = 0; k < kRegion; ++k)
      if (std::memcmp(&got[rg][k], &expect[rg][k], 4) != 0 && bad++ < 5)
        ADD_FAILURE() << "rank " << me << " region " << rg << " element " << k << ": got " << got[rg][k]
                      << ", expected " << expect[rg][k];
    EXPECT_EQ(bad, 0u) << "rank " << me << " region " << rg;
  }

  // All-gather of one reduced fp32 range, then bytes at an odd offset of region 1.
  const Op& ga = ops[gather_op];
  ASSERT_EQ(ga.region, 0);
  std::vector<char> before(kRegion * 4);
  std::memcpy(before.data(), got[1].data(), before.size());
  const size_t chunk = 3 * 1048576 / 2 + 2, off = 4 * kRegion - chunk * n - 1;  // bytes: > 1 MiB, odd offset
  g->all_gather(0, 4 * ga.offset, 4 * ga.m, st);
  g->all_gather(1, off, chunk, st);
  const std::vector<float> g0 = testing::to_host(a.as(DType::kF32, {static_cast<int64_t>(kRegion)}), st);
  const std::vector<float> g1 = testing::to_host(b.as(DType::kF32, {static_cast<int64_t>(kRegion)}), st);
  // Every rank's own chunk, gathered over MPI for the comparison.
  std::vector<float> mine_chunk(g0.begin() + ga.offset + me * ga.m, g0.begin() + ga.offset + (me + 1) * ga.m);
  std::vector<float> all_chunks(ga.m * n);
  MPI_Allgather(mine_chunk.data(), static_cast<int>(ga.m), MPI_FLOAT, all_chunks.data(), static_cast<int>(ga.m),
                MPI_FLOAT, MPI_COMM_WORLD);
  EXPECT_EQ(0, std::memcmp(g0.data() + ga.offset, all_chunks.data(), all_chunks.size() * 4)) << "rank " << me;
  std::vector<char> bytes_mine(before.begin() + off + me * chunk, before.begin() + off + (me + 1) * chunk);
  std::vector<char> bytes_all(chunk * n);
  MPI_Allgather(bytes_mine.data(), static_cast<int>(chunk), MPI_BYTE, bytes_all.data(), static_cast<int>(chunk),
                MPI_BYTE, MPI_COMM_WORLD);
  const char* g1b = reinterpret_cast<const char*>(g1.data());
  EXPECT_EQ(0, std::memcmp(g1b + off, bytes_all.data(), bytes_all.size())) << "rank " << me;
  // Outside the gathered range nothing changed.
  EXPECT_EQ(0, std::memcmp(g1b, before.data(), off));
  EXPECT_EQ(0, std::memcmp(g1b + off + chunk * n, before.data() + off + chunk * n, before.size() - off - chunk * n));

  // Out-of-range operations are errors.
  EXPECT_THROW(g->reduce_scatter_sum_f32(0, kRegion - 10, 100, st), Error);
  EXPECT_THROW(g->all_gather(2, 0, 4, st), Error);
  st.synchronize();
  f.comm->barrier();
}

// bf16 reduce-scatter: the owned chunk becomes bf16(Σ_r float(x_r)) summed in rank order.
void check_bf16(const Fixture& f, size_t stage_elems) {
  const int n = f.comm->size(), me = f.comm->rank();
  SCOPED_TRACE(::testing::Message() << "bf16, stage " << stage_elems);
  constexpr size_t kElems = size_t{1} << 23;
  Buffer a(f.dev, kElems * 2);
  std::string why;
  auto g = PeerCopyGroup::create(f.comm, {{a.data(), a.bytes()}}, stage_elems, &why);
  ASSERT_TRUE(g) << why;
  Stream st(f.dev);
  const std::vector<Op> ops = {{0, 8, 5000}, {0, 8 + 5000 * static_cast<size_t>(n), 1500001}};
  auto x = [&](int r, size_t k) { return f32_to_bf16_bits(value(7, r, k)); };
  std::vector<uint16_t> host(kElems);
  for (size_t k = 0; k < kElems; ++k) host[k] = x(me, k);
  copy_bytes(a.data(), f.dev, host.data(), Device::cpu(), kElems * 2, st);
  st.synchronize();
  f.comm->barrier();
  for (int round = 0; round < 2; ++round)
    for (const Op& op : ops) g->reduce_scatter_sum(0, op.offset, op.m, DType::kBF16, st);
  std::vector<uint16_t> got(kElems);
  copy_bytes(got.data(), Device::cpu(), a.data(), f.dev, kElems * 2, st);
  st.synchronize();
  std::vector<uint16_t> expect = host;
  for (int round = 0; round < 2; ++round) {
    for (const Op& op : ops) {
      for (size_t k = 0; k < op.m; ++k) {
        const size_t at = op.offset + me * op.m + k;
        float acc = 0.f;
        for (int r = 0; r < n; ++r) {
          const float v = bf16_bits_to_f32(r == me ? expect[at] : x(r, at));
          acc = r == 0 ? v : acc + v;
        }
        expect[at] = f32_to_bf16_bits(acc);
      }
    }
  }
  size_t bad = 0;
  for (size_t k = 0; k < kElems; ++k)
    if (got[k] != expect[k] && bad++ < 5)
      ADD_FAILURE() << "rank " << me << " element " << k << ": got " << got[k] << ", expected " << expect[k];
  EXPECT_EQ(bad, 0u);
  f.comm->barrier();
}

TEST(PeerCopy, ReduceScatterAndAllGatherMatchHostBitwise) {
  MT_REQUIRE_CUDA();
  const LaunchEnv env = read_launch_env();
  if (env.world_size < 2 || env.launcher != LaunchEnv::kMpirun) GTEST_SKIP() << "run under mpiexec -np 2 or 4";
  int gpus = 0;
  cudaGetDeviceCount(&gpus);
  if (gpus < env.world_size) GTEST_SKIP() << "needs " << env.world_size << " GPUs, found " << gpus;
  Fixture f = setup();
  ASSERT_TRUE(f.comm) << "the world communicator is not NCCL";
  const size_t n = static_cast<size_t>(f.comm->size());
  // Small chunks through a 1000-element staging slot: pieces and both generations reused.
  check_group(f, 1000,
              {{0, 0, 64}, {0, 4096, 3000}, {1, 128, 1000}, {0, 4096 + 3000 * n + 64, 2500}, {1, 200000, 7777},
               {0, 300000, 1}},
              1);
  // Chunks of several MiB through 1M-element slots.
  check_group(f, size_t{1} << 20, {{0, 64, 700000}, {1, 0, 900001}, {0, 64 + 700000 * n, 1500}}, 0);
  // bf16: pieces of 2 x 1000 elements, then whole chunks.
  check_bf16(f, 1000);
  check_bf16(f, size_t{1} << 20);
}

}  // namespace
}  // namespace mt
