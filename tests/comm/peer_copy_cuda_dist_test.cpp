// Copy-engine collectives (comm/nccl/peer_copy.h) on the GPUs of one host, under mpiexec (one
// rank per GPU; ctest runs 4 ranks, `mpiexec -np 2` works too). The reduce-scatter sums in rank
// order, so the owned chunks must equal the host's fp32 sum x_0 + x_1 + ... bitwise; the
// all-gather must reproduce every rank's chunk bitwise. A small staging slot forces pieces and
// the reuse of both staging generations (acknowledgement waits), several operations run back to
// back without host synchronisation, and the untouched parts of the region must stay untouched.
// A second group moves chunks of several MiB with each copy split over 3 streams per peer; bf16
// reduce-scatters must equal bf16(rank-order fp32 sums) bitwise.
// The ring exchange (comm/nccl/peer_ring.h) is run as the CP attention runs it: a compute stream
// writes the outgoing blocks and reads what arrived, the ring stream exchanges between a `ready`
// and a `done` event, two alternating receive buffers (and, every other step, a second transfer
// into two more), for many consecutive steps with ranks delayed at random (host delays before
// issuing a step, and host callbacks that stall the compute stream before it reads a received
// block or writes an outgoing one): every step must receive exactly the previous rank's block of
// that step, which fails if a sender overwrote a buffer its next rank still read (the "free" flag)
// or a reader read before the data arrived (the "arrived" flag).
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <mpi.h>

#include <unistd.h>

#include <bit>
#include <cstring>
#include <random>

#include "comm/bootstrap.h"
#include "comm/nccl/peer_copy.h"
#include "comm/nccl/peer_ring.h"
#include "core/buffer.h"
#include "testing/gpu_world.h"
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

// The world of the mpiexec ranks (made once per process: testing/gpu_world.h); comm null when the
// test skips (*skip says why) or when the world is not NCCL.
Fixture setup(std::string* skip) {
  const testing::GpuWorld& w = testing::gpu_world({2, 3, 4, 5, 6, 7, 8});
  *skip = w.skip;
  return Fixture{std::dynamic_pointer_cast<NcclCommunicator>(w.comm), w.dev};
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
  std::string skip;
  Fixture f = setup(&skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
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

// The stream callback of a delay: sleeps *static_cast<int*>(us) microseconds (the stream stalls).
void CUDART_CB sleep_us(void* us) { usleep(static_cast<useconds_t>(*static_cast<int*>(us))); }

// `steps` ring steps as the CP attention runs them (see the file comment); pool slices of
// `bytes_a` (and `bytes_b` for the second transfer) bytes, distinct per rank and slice.
void check_ring(const Fixture& f, int steps, size_t bytes_a, size_t bytes_b, uint32_t seed) {
  const int n = f.comm->size(), me = f.comm->rank(), prev = (me + n - 1) % n;
  SCOPED_TRACE(::testing::Message() << "ring of " << n << ", " << steps << " steps, " << bytes_a << " + " << bytes_b
                                    << " bytes");
  constexpr int kSlices = 16;
  auto slice_byte = [](int r, int slice, int which, size_t k) {
    return static_cast<char>(std::bit_cast<uint32_t>(value(1000 + 2 * slice + which, r, k)) >> 7);
  };
  // The outgoing pools (device) and what every step must receive (host, from prev's pools).
  Buffer pool_a(f.dev, kSlices * bytes_a), pool_b(f.dev, kSlices * bytes_b);
  {
    std::vector<char> ha(kSlices * bytes_a), hb(kSlices * bytes_b);
    for (int sl = 0; sl < kSlices; ++sl) {
      for (size_t k = 0; k < bytes_a; ++k) ha[sl * bytes_a + k] = slice_byte(me, sl, 0, k);
      for (size_t k = 0; k < bytes_b; ++k) hb[sl * bytes_b + k] = slice_byte(me, sl, 1, k);
    }
    Stream up(f.dev);
    copy_bytes(pool_a.data(), f.dev, ha.data(), Device::cpu(), ha.size(), up);
    copy_bytes(pool_b.data(), f.dev, hb.data(), Device::cpu(), hb.size(), up);
    up.synchronize();
  }
  // Receive buffers: A and B in one allocation (the second at an odd offset, as the planner's
  // scratch shares one), C and D in another; outgoing buffers alternate too.
  const size_t off_b = bytes_a + 259;
  Buffer recv_ab(f.dev, off_b + bytes_a + 64), recv_cd(f.dev, 2 * bytes_b + 512);
  char* recv_a[2] = {static_cast<char*>(recv_ab.data()), static_cast<char*>(recv_ab.data()) + off_b};
  char* recv_b[2] = {static_cast<char*>(recv_cd.data()), static_cast<char*>(recv_cd.data()) + bytes_b + 256};
  Buffer send_a(f.dev, 2 * bytes_a), send_b(f.dev, 2 * bytes_b);
  Buffer log_a(f.dev, steps * bytes_a), log_b(f.dev, steps * bytes_b);
  std::string why;
  auto x = PeerRingExchange::create(f.comm, {recv_a[0], recv_a[1], recv_b[0], recv_b[1]}, &why);
  ASSERT_TRUE(x) << "copy-engine ring refused: " << why;
  EXPECT_EQ(x->size(), n);
  EXPECT_EQ(x->rank(), me);

  // Random delays, fixed before the loop (the callbacks read them while it runs).
  std::mt19937 rng(seed + 7919u * static_cast<uint32_t>(me));
  std::vector<int> host_us(steps), read_us(steps), write_us(steps);
  for (int k = 0; k < steps; ++k) {
    host_us[k] = rng() % 4 == 0 ? static_cast<int>(rng() % 400) : 0;
    read_us[k] = rng() % 3 == 0 ? static_cast<int>(rng() % 300) : 0;
    write_us[k] = rng() % 5 == 0 ? static_cast<int>(rng() % 300) : 0;
  }
  Stream cs(f.dev), rs(f.dev, StreamPriority::kHigh);
  Event ready(f.dev), done(f.dev);
  const cudaStream_t ccs = static_cast<cudaStream_t>(cs.cuda_stream());
  f.comm->barrier();
  for (int k = 0; k < steps; ++k) {
    const bool two = k % 3 != 0;
    if (host_us[k] > 0) usleep(static_cast<useconds_t>(host_us[k]));  // this rank issues late
    // The compute stream writes the outgoing blocks (after the exchange that sent them last: `done`).
    if (write_us[k] > 0) ASSERT_EQ(cudaLaunchHostFunc(ccs, sleep_us, &write_us[k]), cudaSuccess);
    char* sa = static_cast<char*>(send_a.data()) + (k % 2) * bytes_a;
    char* sb = static_cast<char*>(send_b.data()) + (k % 2) * bytes_b;
    copy_bytes(sa, f.dev, static_cast<char*>(pool_a.data()) + (k % kSlices) * bytes_a, f.dev, bytes_a, cs);
    if (two) copy_bytes(sb, f.dev, static_cast<char*>(pool_b.data()) + (k % kSlices) * bytes_b, f.dev, bytes_b, cs);
    ready.record(cs);
    ready.wait(rs);
    const PeerRingExchange::Transfer t[2] = {{sa, recv_a[k % 2], bytes_a}, {sb, recv_b[k % 2], bytes_b}};
    x->exchange(std::span<const PeerRingExchange::Transfer>(t, two ? 2 : 1),
                static_cast<cudaStream_t>(rs.cuda_stream()));
    done.record(rs);
    done.wait(cs);
    // A slow reader of what arrived: the next step into this buffer must wait for it.
    if (read_us[k] > 0) ASSERT_EQ(cudaLaunchHostFunc(ccs, sleep_us, &read_us[k]), cudaSuccess);
    copy_bytes(static_cast<char*>(log_a.data()) + k * bytes_a, f.dev, recv_a[k % 2], f.dev, bytes_a, cs);
    if (two) copy_bytes(static_cast<char*>(log_b.data()) + k * bytes_b, f.dev, recv_b[k % 2], f.dev, bytes_b, cs);
  }
  cs.synchronize();
  rs.synchronize();
  EXPECT_EQ(x->exchanges(), static_cast<uint32_t>(steps));
  std::vector<char> got_a(steps * bytes_a), got_b(steps * bytes_b);
  copy_bytes(got_a.data(), Device::cpu(), log_a.data(), f.dev, got_a.size(), cs);
  copy_bytes(got_b.data(), Device::cpu(), log_b.data(), f.dev, got_b.size(), cs);
  cs.synchronize();
  int bad_steps = 0;
  for (int k = 0; k < steps; ++k) {
    const int sl = k % kSlices;
    size_t bad = 0;
    for (size_t i = 0; i < bytes_a; ++i) bad += got_a[k * bytes_a + i] != slice_byte(prev, sl, 0, i);
    if (k % 3 != 0)
      for (size_t i = 0; i < bytes_b; ++i) bad += got_b[k * bytes_b + i] != slice_byte(prev, sl, 1, i);
    if (bad > 0 && bad_steps++ < 5)
      ADD_FAILURE() << "rank " << me << " step " << k << ": " << bad << " bytes differ from rank " << prev
                    << "'s block of that step";
  }
  EXPECT_EQ(bad_steps, 0) << "rank " << me;

  // Errors, before anything is issued (the sequence numbers stay in step on every rank): a
  // receive buffer outside the registered allocations, a capturing stream.
  const PeerRingExchange::Transfer outside[1] = {{recv_a[0], send_a.data(), 16}};
  EXPECT_THROW(x->exchange(outside, static_cast<cudaStream_t>(rs.cuda_stream())), Error);
  Stream cap(f.dev);
  const cudaStream_t ccap = static_cast<cudaStream_t>(cap.cuda_stream());
  ASSERT_EQ(cudaStreamBeginCapture(ccap, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const PeerRingExchange::Transfer inside[1] = {{send_a.data(), recv_a[0], 16}};
  EXPECT_THROW(x->exchange(inside, ccap), Error);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(ccap, &graph), cudaSuccess);
  if (graph) cudaGraphDestroy(graph);
  EXPECT_EQ(x->exchanges(), static_cast<uint32_t>(steps));
  f.comm->barrier();
}

TEST(PeerCopy, RingExchangeDeliversThePreviousRanksBlocks) {
  MT_REQUIRE_CUDA();
  std::string skip;
  Fixture f = setup(&skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_TRUE(f.comm) << "the world communicator is not NCCL";
  uint32_t seed = 12345;
  if (f.comm->rank() == 0) seed = std::random_device{}();
  MPI_Bcast(&seed, 1, MPI_UINT32_T, 0, MPI_COMM_WORLD);
  if (f.comm->rank() == 0) std::printf("ring exchange delays seed %u\n", seed);
  check_ring(f, 200, 4096 * 3 + 1, 777, seed);                    // small blocks: many steps in flight
  check_ring(f, 40, size_t{3} << 20, size_t{1} << 20, seed + 1);  // MiB blocks: the copies take a while

  // Receive buffers at different offsets on different ranks: refused on every rank.
  Buffer r(f.dev, 1 << 16);
  std::string why;
  auto x = PeerRingExchange::create(f.comm, {static_cast<char*>(r.data()) + (f.comm->rank() == 0 ? 256 : 0)}, &why);
  EXPECT_FALSE(x);
  EXPECT_NE(why.find("different offsets"), std::string::npos) << why;
  f.comm->barrier();
}

}  // namespace
}  // namespace mt
