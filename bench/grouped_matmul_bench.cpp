// Grouped expert GEMMs (ops/grouped_matmul.h) against the per-expert cuBLASLt loop
// (linear_forward / linear_backward over host row ranges, as MoELayer without --moe-grouped-gemm),
// bf16 with fp32 accumulation, on cuda:0:
//   build/grouped_matmul_bench [--iters 20] [--experts 8] [--rows 4096] [--hidden 1024] [--ffn 3584]
//                              [--skew 0]
// For each projection of an expert MLP — fc1 (n = ffn, k = hidden) and fc2 (n = hidden, k = ffn) —
// prints the time and TFLOP/s of forward (y = x Wᵀ), dgrad (dx = dy W) and wgrad (dW += dyᵀ x,
// fp32 main gradients), 2·R·n·k FLOPs each, R = experts · rows. --skew s gives expert e
// rows·(1 + s·(e − (E−1)/2)/(E−1)) rows (same total; s = 0: balanced). The grouped calls read the
// counts from the device; the loop reads them on the host (its cost of the host round trip is not
// included). Times: median over --iters of CUDA events around one call, after 3 warm-ups.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/buffer.h"
#include "core/device.h"
#include "bench_util.h"
#include "core/stream.h"
#include "ops/elementwise.h"
#include "ops/grouped_matmul.h"
#include "ops/init.h"
#include "ops/matmul.h"

namespace {

using namespace mt;
using bench::median;
using bench::time_ms;

int bench_main(int argc, char** argv) {
  int iters = 20;
  int64_t E = 8, rows = 4096, hidden = 1024, ffn = 3584;
  double skew = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--iters") iters = std::atoi(argv[i + 1]);
    else if (a == "--experts") E = std::atoll(argv[i + 1]);
    else if (a == "--rows") rows = std::atoll(argv[i + 1]);
    else if (a == "--hidden") hidden = std::atoll(argv[i + 1]);
    else if (a == "--ffn") ffn = std::atoll(argv[i + 1]);
    else if (a == "--skew") skew = std::atof(argv[i + 1]);
    else MT_FAIL("unknown option {}", a);
  }
  const Device dev = Device::cuda(0);
  Stream st(dev);
  std::vector<int32_t> counts(static_cast<size_t>(E));
  int64_t R = 0;
  for (int64_t e = 0; e < E; ++e) {
    const double f = E > 1 ? 1 + skew * (static_cast<double>(e) - (E - 1) / 2.0) / (E - 1) : 1;
    counts[static_cast<size_t>(e)] = static_cast<int32_t>(std::max(0.0, std::round(rows * f)));
    R += counts[static_cast<size_t>(e)];
  }
  fmt::print("grouped_matmul_bench: {} experts, {} rows in all (counts {}), hidden {}, ffn {}, bf16, {}\n", E, R,
             fmt::join(counts, ","), hidden, ffn, dev.str());
  fmt::print("{:>4} {:>6} {:>6} | {:>22} | {:>22} | {:>22}\n", "proj", "n", "k", "forward ms  TFLOP/s", "dgrad ms  TFLOP/s",
             "wgrad ms  TFLOP/s");
  Buffer bcounts(dev, static_cast<size_t>(E) * 4);
  const Tensor dcounts = bcounts.as(DType::kI32, {E});
  copy_bytes(dcounts.data(), dev, counts.data(), Device::cpu(), counts.size() * 4, st);
  for (int proj = 0; proj < 2; ++proj) {
    const int64_t n = proj == 0 ? ffn : hidden, k = proj == 0 ? hidden : ffn;
    Buffer bx(dev, R * k * 2), by(dev, R * n * 2), bdx(dev, R * k * 2), bdy(dev, R * n * 2);
    Buffer bw(dev, E * n * k * 2), bg(dev, E * n * k * 4), tmp(dev, std::max(R * std::max(n, k), E * n * k) * 4);
    const Tensor x = bx.as(DType::kBF16, {R, k}), y = by.as(DType::kBF16, {R, n}), dx = bdx.as(DType::kBF16, {R, k});
    const Tensor dy = bdy.as(DType::kBF16, {R, n}), wall = bw.as(DType::kBF16, {E * n, k});
    const Tensor gall = bg.as(DType::kF32, {E * n, k});
    auto randomize = [&](const Tensor& t, uint32_t id, float sd) {
      const Tensor t32 = tmp.as(DType::kF32, {t.numel()});
      init_normal(t32, sd, 99, id, ShardBox::whole({t.numel()}), st);
      cast(t.view({t.numel()}), t32, st);
    };
    randomize(x, 1, 1.f);
    randomize(dy, 2, 1.f);
    randomize(wall, 3, 0.02f);
    fill(gall, 0.f, st);
    std::vector<Tensor> ws, gs;
    for (int64_t e = 0; e < E; ++e) {
      ws.push_back(wall.slice0(e * n, (e + 1) * n));
      gs.push_back(gall.slice0(e * n, (e + 1) * n));
    }
    const GroupedWeights gw(ws, st), gg(gs, st);
    const double flops = 2.0 * static_cast<double>(R) * n * k;
    auto loop = [&](auto&& f) {
      int64_t off = 0;
      for (int64_t e = 0; e < E; ++e) {
        const int64_t c = counts[static_cast<size_t>(e)];
        if (c > 0) f(e, off, c);
        off += c;
      }
    };
    const double gf = time_ms(st, iters, [&] { grouped_linear_forward(y, x, gw, dcounts, st); });
    const double gd = time_ms(st, iters, [&] { grouped_linear_dgrad(dx, dy, gw, dcounts, st); });
    const double gwg = time_ms(st, iters, [&] { grouped_linear_wgrad(gg, dy, x, dcounts, st); });
    const double lf = time_ms(st, iters, [&] {
      loop([&](int64_t e, int64_t off, int64_t c) {
        linear_forward(y.slice0(off, off + c), x.slice0(off, off + c), ws[e], Tensor(), Tensor(), st);
      });
    });
    const double ld = time_ms(st, iters, [&] {
      loop([&](int64_t e, int64_t off, int64_t c) {
        linear_backward(dx.slice0(off, off + c), Tensor(), Tensor(), dy.slice0(off, off + c), x.slice0(off, off + c),
                        ws[e], st);
      });
    });
    const double lw = time_ms(st, iters, [&] {
      loop([&](int64_t e, int64_t off, int64_t c) {
        linear_backward(Tensor(), gs[e], Tensor(), dy.slice0(off, off + c), x.slice0(off, off + c), ws[e], st);
      });
    });
    const char* name = proj == 0 ? "fc1" : "fc2";
    auto row = [&](const char* impl, double f, double d, double w) {
      fmt::print("{:>4} {:>6} {:>6} | {:>9.3f} {:>12.1f} | {:>9.3f} {:>12.1f} | {:>9.3f} {:>12.1f}  {}\n", name, n, k,
                 f, flops / f * 1e-9, d, flops / d * 1e-9, w, flops / w * 1e-9, impl);
    };
    row("grouped", gf, gd, gwg);
    row("cuBLASLt loop", lf, ld, lw);
    // Spot check: the grouped forward against the loop (bf16 outputs, relative error of the first rows).
    grouped_linear_forward(y, x, gw, dcounts, st);
    std::vector<uint16_t> a(static_cast<size_t>(std::min<int64_t>(R, 256) * n)), b(a.size());
    copy_bytes(a.data(), Device::cpu(), y.data(), dev, a.size() * 2, st);
    loop([&](int64_t e, int64_t off, int64_t c) {
      linear_forward(y.slice0(off, off + c), x.slice0(off, off + c), ws[e], Tensor(), Tensor(), st);
    });
    copy_bytes(b.data(), Device::cpu(), y.data(), dev, b.size() * 2, st);
    st.synchronize();
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      uint32_t ua = static_cast<uint32_t>(a[i]) << 16, ub = static_cast<uint32_t>(b[i]) << 16;
      float fa, fb;
      std::memcpy(&fa, &ua, 4);
      std::memcpy(&fb, &ub, 4);
      num += (static_cast<double>(fa) - fb) * (static_cast<double>(fa) - fb);
      den += static_cast<double>(fb) * fb;
    }
    fmt::print("     check: grouped vs loop forward rel. err {:.2e}\n", std::sqrt(num / std::max(den, 1e-30)));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mt::bench::run_main("grouped_matmul_bench", argc, argv, bench_main); }
