// CUDA tests of ops/grouped_matmul.h's FP8 ops (the mma.sync m16n8k32 FP8 kernel of
// ops/cuda/grouped_matmul.cu, and on Hopper the FP8 wgmma kernel of grouped_matmul_sm90.cu:
// automatic, forced 128- and 256-wide tiles, ping-pong, the wgrad's read-modify-write with and
// without the L2 prefetch) against the CPU emulation on the
// same FP8 operands: small-integer
// operands with power-of-two scales bit for bit (bf16 y equal to the CPU's fp32 y rounded to bf16;
// the fp32 gradients equal), random FP8 values within the FP8 tensor cores' accumulation
// tolerance; ragged, empty and skewed counts, wgrad segments on and off 16-byte boundaries,
// hybrid operands, one or per-group row scales, the poisoned tail rows zeroed, NaN tail inputs
// never read, empty groups' gradients untouched; and both calls captured in a CUDA graph replayed
// with counts that change between replays. Skipped below compute capability 8.9.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "ops/cuda/grouped_matmul_sm90.cuh"
#include "ops/grouped_fp8_test_util.h"

namespace mt {
namespace {

using grouped_fp8_test::Case;
using testing::cpu_stream;
using testing::cuda_stream;
using testing::OwnedTensor;
const Device kCpu = Device::cpu();

#define MT_REQUIRE_FP8_GPU()                                                                              \
  do {                                                                                                    \
    MT_REQUIRE_CUDA();                                                                                    \
    try {                                                                                                 \
      fp8_check_device(Device::cuda(), false);                                                            \
    } catch (const Error& e) {                                                                            \
      GTEST_SKIP() << e.what();                                                                           \
    }                                                                                                     \
  } while (0)

/// The operands of one case on one device, and both ops' outputs (as host floats).
struct Outputs {
  std::vector<float> y;
  std::vector<std::vector<float>> dw;
};

/// The operands on `dev` with the counts in a device tensor; `calls` runs both ops.
struct Operands {
  Operands(const Case& c, const grouped_fp8_test::Rows& r, const grouped_fp8_test::Cols& k, Device dev,
        const Stream& s)
      : a(fp8_test::bytes_tensor(r.a, c.a_dt, dev, {c.R, c.K}, s)),
        sa(testing::make_tensor(r.sa, DType::kF32, dev, {int64_t(r.sa.size())}, s)),
        sw(testing::make_tensor(r.sw, DType::kF32, dev, {int64_t(r.sw.size())}, s)),
        w(grouped_fp8_test::fp8_group(r.w, c.b_dt, c.N, c.K, dev, s)),
        y(dev.is_cpu() ? DType::kF32 : DType::kBF16, dev, {c.R, c.N}),
        dyt(fp8_test::bytes_tensor(k.dyt, c.a_dt, dev, {c.N, c.R}, s)),
        xt(fp8_test::bytes_tensor(k.xt, c.b_dt, dev, {c.K, c.R}, s)),
        sdy(testing::make_tensor(k.sdy, DType::kF32, dev, {int64_t(k.sdy.size())}, s)),
        sx(testing::make_tensor(k.sx, DType::kF32, dev, {int64_t(k.sx.size())}, s)),
        dw(grouped_fp8_test::f32_group(k.dw0, c.N, c.K, dev, s)),
        counts(testing::make_int_tensor(c.counts, dev, {c.groups()}, s)) {}
  void calls(const Stream& s) {
    grouped_fp8_linear_forward(y, a, sa, w.weights, sw, counts, s);
    grouped_fp8_linear_wgrad(dw.weights, dyt, sdy, xt, sx, counts, s);
  }
  /// Poisons y and resets the gradients to dw0.
  void reset(const grouped_fp8_test::Cols& k, const Stream& s) {
    testing::poison(y, s);
    for (size_t g = 0; g < k.dw0.size(); ++g) testing::upload(dw.store[g], k.dw0[g], s);
  }
  Outputs result(const Stream& s) const {
    Outputs r{testing::to_host(y, s), {}};
    for (const auto& t : dw.store) r.dw.push_back(testing::to_host(t, s));
    return r;
  }
  OwnedTensor a, sa, sw;
  grouped_fp8_test::Group w;
  OwnedTensor y, dyt, xt, sdy, sx;
  grouped_fp8_test::Group dw;
  OwnedTensor counts;
};

Outputs run_on(const Case& c, const grouped_fp8_test::Rows& r, const grouped_fp8_test::Cols& k, Device dev) {
  const Stream& s = dev.is_cpu() ? cpu_stream() : cuda_stream();
  Operands st(c, r, k, dev, s);
  st.reset(k, s);
  st.calls(s);
  return st.result(s);
}

/// Largest |gpu - cpu| / Σ|products| seen (printed at the end, to tighten the tolerance).
double g_worst = 0;

/// gpu against cpu: bitwise (ints: bf16 y = the CPU's y rounded to bf16), else within the FP8 tensor
/// cores' accumulation (2^-8 of Σ|products|) plus a bf16 rounding of y.
void compare(const Case& c, const grouped_fp8_test::Rows& r, const grouped_fp8_test::Cols& k, const Outputs& gpu,
             const Outputs& cpu) {
  const std::vector<float> cpu_y = testing::rounded(cpu.y, DType::kBF16);
  const grouped_fp8_test::Ref ry = c.ints ? grouped_fp8_test::Ref{} : grouped_fp8_test::rows_ref(c, r);
  for (size_t i = 0; i < cpu_y.size(); ++i) {
    ASSERT_TRUE(std::isfinite(gpu.y[i])) << "y at " << i;
    if (c.ints) {
      ASSERT_EQ(gpu.y[i], cpu_y[i]) << "y at " << i;
      continue;
    }
    const double err = std::fabs(double(gpu.y[i]) - cpu.y[i]);
    g_worst = std::max(g_worst, (err - std::ldexp(std::fabs(cpu.y[i]), -8)) / (ry.bound[i] + 1e-30));
    ASSERT_LE(err, std::ldexp(ry.bound[i], -8) + std::ldexp(std::fabs(cpu.y[i]), -8) + 1e-30)
        << "y at " << i << ": gpu " << gpu.y[i] << " cpu " << cpu.y[i];
  }
  for (int64_t g = 0; g < c.groups(); ++g) {
    SCOPED_TRACE(::testing::Message() << "dw of group " << g << " (" << c.counts[size_t(g)] << " rows)");
    const auto& got = gpu.dw[size_t(g)];
    const auto& want = cpu.dw[size_t(g)];
    if (c.ints || c.counts[size_t(g)] == 0) {
      ASSERT_TRUE(testing::same_bits(got, want));
      continue;
    }
    const grouped_fp8_test::Ref rw = grouped_fp8_test::cols_ref(c, k, g);
    for (size_t i = 0; i < got.size(); ++i) {
      const double err = std::fabs(double(got[i]) - want[i]);
      g_worst = std::max(g_worst, err / (rw.bound[i] + 1e-30));
      ASSERT_LE(err, std::ldexp(rw.bound[i], -8) + 1e-30) << "at " << i << ": gpu " << got[i] << " cpu " << want[i];
    }
  }
}

using Kernel = cuda::grouped_sm90::Kernel;
using Epilogue = cuda::grouped_sm90::WgradEpilogue;
using Variant = std::pair<Kernel, Epilogue>;

/// The kernels to run: mma.sync always; on a Hopper device running the sm_90a code the wgmma
/// kernel too (automatic, and forced where it applies: fp8_e4m3 weights and x).
std::vector<Variant> kernels(const Case& c) {
  const Epilogue def = cuda::grouped_sm90::kDefaultWgradEpilogue;
  std::vector<Variant> k = {{Kernel::kMmaSync, def}};
  if (!cuda::grouped_sm90::device_ready(cuda_stream())) return k;
  k.push_back({Kernel::kAuto, def});
  if (c.b_dt == DType::kF8E4M3) {
    for (Kernel f : {Kernel::kWgmma128, Kernel::kWgmma256, Kernel::kWgmmaPingPong}) k.push_back({f, def});
    k.push_back({Kernel::kWgmma, Epilogue::kReadModifyWrite});
  }
  return k;
}

void check(Case c) {
  for (const auto& [ints, kern] : [&] {
         std::vector<std::pair<bool, Variant>> v;
         for (bool i : {true, false})
           for (const Variant& k : kernels(c)) v.emplace_back(i, k);
         return v;
       }()) {
    c.ints = ints;
    const cuda::grouped_sm90::KernelScope scope(kern.first, kern.second);
    SCOPED_TRACE(::testing::Message() << "R=" << c.R << " N=" << c.N << " K=" << c.K << " G=" << c.groups()
                                      << (ints ? " ints" : " random") << " " << dtype_name(c.a_dt) << " x "
                                      << dtype_name(c.b_dt) << " kernel " << static_cast<int>(kern.first)
                                      << " wgrad epilogue " << static_cast<int>(kern.second));
    const grouped_fp8_test::Rows r = grouped_fp8_test::make_rows(c);
    const grouped_fp8_test::Cols k = grouped_fp8_test::make_cols(c);
    const Outputs gpu = run_on(c, r, k, Device::cuda()), cpu = run_on(c, r, k, kCpu);
    compare(c, r, k, gpu, cpu);
    if (!ints) {  // bitwise repeatable
      const Outputs again = run_on(c, r, k, Device::cuda());
      EXPECT_TRUE(testing::same_bits(again.y, gpu.y));
      for (size_t g = 0; g < again.dw.size(); ++g) EXPECT_TRUE(testing::same_bits(again.dw[g], gpu.dw[g]));
    }
  }
}

TEST(GroupedFp8MatmulCuda, MatchesCpuAtRaggedEmptyAndSkewedCounts) {
  MT_REQUIRE_FP8_GPU();
  check({320, 144, 208, {100, 0, 57, 1, 130}});         // ragged: segments off 16-byte boundaries
  check({256, 128, 64, {0, 256, 0}});                    // one group holds every row
  check({1024, 272, 400, {128, 256, 0, 128, 512}});      // aligned segments (cp.async), K tiles + 16
  check({64, 16, 16, {0, 0, 0, 0, 0, 0, 0, 0}});         // all empty: only the zeroed tail
  check({784, 160, 528, {333, 0, 0, 444}});              // several K tiles, odd row counts
}

TEST(GroupedFp8MatmulCuda, HybridOperandsAndPerGroupScales) {
  MT_REQUIRE_FP8_GPU();
  check({320, 96, 160, {31, 77, 0, 150, 40}, DType::kF8E5M2, DType::kF8E4M3, /*per_group_a=*/true});
  check({320, 96, 160, {31, 77, 0, 150, 40}, DType::kF8E4M3, DType::kF8E5M2, /*per_group_a=*/false});
}

TEST(GroupedFp8MatmulCuda, ManySmallExperts) {
  MT_REQUIRE_FP8_GPU();
  Case c{2048, 256, 128, std::vector<int32_t>(64, 0)};
  for (size_t g = 0; g < 64; ++g) c.counts[g] = static_cast<int32_t>((g * 37) % 61);  // Σ = 1886
  check(c);
}

/// Both calls captured once, replayed with each counts set written into the captured counts tensor
/// between replays (y poisoned and the gradients reset before each), against the CPU on that set.
TEST(GroupedFp8MatmulCuda, CapturedGraphReplaysWithChangingCounts) {
  MT_REQUIRE_FP8_GPU();
  const std::vector<std::vector<int32_t>> sets = {
      {100, 0, 57, 1, 130}, {0, 0, 0, 0, 0}, {288, 0, 0, 0, 0}, {16, 32, 48, 64, 128}, {1, 2, 3, 4, 5}};
  for (const auto& [ints, kern] : {std::pair{true, Kernel::kAuto}, std::pair{false, Kernel::kAuto},
                                   std::pair{false, Kernel::kMmaSync}}) {
    const cuda::grouped_sm90::KernelScope scope(kern);
    Case c{288, 144, 208, sets.front()};
    c.ints = ints;
    // the first set uses all 288 rows: no NaN tail, every later set reads real rows (tails: above)
    const grouped_fp8_test::Rows r = grouped_fp8_test::make_rows(c);
    const grouped_fp8_test::Cols k = grouped_fp8_test::make_cols(c);
    const Stream& s = cuda_stream();
    Operands st(c, r, k, Device::cuda(), s);
    st.calls(s);  // eager first: kernel attributes are set once, outside the capture
    s.synchronize();
    cudaStream_t cs = static_cast<cudaStream_t>(s.cuda_stream());
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal), cudaSuccess);
    st.calls(s);
    ASSERT_EQ(cudaStreamEndCapture(cs, &graph), cudaSuccess) << "a grouped FP8 GEMM synchronised with the host";
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (size_t i = 0; i < sets.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "replay " << i << (ints ? " ints" : " random") << " kernel "
                                        << static_cast<int>(kern));
      c.counts = sets[i];
      copy_bytes(st.counts.t.data(), Device::cuda(), sets[i].data(), kCpu, sets[i].size() * sizeof(int32_t), s);
      st.reset(k, s);
      ASSERT_EQ(cudaGraphLaunch(exec, cs), cudaSuccess);
      const Outputs gpu = st.result(s);
      compare(c, r, k, gpu, run_on(c, r, k, kCpu));
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

TEST(GroupedFp8MatmulCuda, WorstErrorSeen) {
  MT_REQUIRE_FP8_GPU();
  std::printf("grouped FP8: worst |gpu - cpu| / sum|products| = %.3g (tolerance 2^-8 = %.3g)\n", g_worst,
              std::ldexp(1.0, -8));
}

}  // namespace
}  // namespace mt
