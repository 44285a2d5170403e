// Grouped expert GEMMs (ops/grouped_matmul.h) on their kernels against the per-expert cuBLASLt
// loop (linear_forward / linear_backward over host row ranges, as MoELayer without
// --moe-grouped-gemm), bf16 with fp32 accumulation, on cuda:0:
//   build/grouped_matmul_bench                 the suite: Mixtral-style (8 experts, hidden 4096,
//                                              ffn 14336, 8192 rows per expert) and DeepSeek-style
//                                              (64 experts, hidden 2048, ffn 1408, 8192 tokens
//                                              top-6: 768 rows per expert), balanced and skewed
//   build/grouped_matmul_bench --experts 8 --rows 4096 --hidden 1024 --ffn 3584 [--skew 0]
//   build/grouped_matmul_bench --check         the wgmma kernel against the mma.sync kernel
//   build/grouped_matmul_bench --fp8 [shape options]  FP8 (e4m3, tensorwise): the grouped FP8
//                                              kernels (automatic; mma.sync), the grouped bf16
//                                              kernel and the per-expert cuBLASLt FP8 loop, counts
//                                              rounded down to 16
//   [--iters 10]
// For each projection of an expert MLP — fc1 (n = ffn, k = hidden) and fc2 (n = hidden, k = ffn)
// — prints the time and TFLOP/s of forward (y = x Wᵀ), dgrad (dx = dy W) and wgrad (dW += dyᵀ x,
// fp32 main gradients), 2·R·n·k FLOPs each, R = Σ rows, for the Hopper wgmma kernel (where the
// device runs it), the mma.sync kernel and the loop, then the wgmma / loop speed ratio; then the
// wgrad alone with each WgradEpilogue of grouped_matmul_sm90.cuh (rmw: the read-modify-write,
// rmw+l2pf, preload, preload+l2pf) on each tile kind (128x256, 128x128, ping-pong), and per shape
// the fc1 + fc2 wgrad of every variant against the loop's, the MLP's speed against the loop's with
// that variant as its wgrad (per tile kind, and "auto": each projection at its automatic width),
// and the BEST (each projection's fastest variant). --skew s
// gives expert e rows·(1 + s·(e − (E−1)/2)/(E−1)) rows (same total; s = 0: balanced; the suite's
// skewed rows use s = 1.5: 0.25× to 1.75× the mean). The grouped calls read the counts from the
// device; the loop reads them on the host (its cost of the host round trip is not included).
// Times: median over --iters of CUDA events around one call, after 3 warm-ups.
// --check: random bf16 inputs with NaN rows beyond Σc, NaN-poisoned outputs, ragged / skewed /
// empty counts, every tile kind and wgrad epilogue; prints per op the largest |wgmma − mma.sync|
// over the largest |mma.sync| (the weight gradients: their increments), whether the tails are zero
// and the outputs finite, and PASS / FAIL (exit status 1 on a failure).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bench_util.h"
#include "core/buffer.h"
#include "core/device.h"
#include "core/stream.h"
#include "ops/cuda/grouped_matmul_sm90.cuh"
#include "ops/elementwise.h"
#include "ops/fp8.h"
#include "ops/fp8_matmul.h"
#include "ops/grouped_matmul.h"
#include "ops/init.h"
#include "ops/matmul.h"

namespace {

using namespace mt;
using bench::time_ms;
using Kernel = cuda::grouped_sm90::Kernel;

using WgradEpilogue = cuda::grouped_sm90::WgradEpilogue;
using cuda::grouped_sm90::KernelScope;

const char* kernel_name(Kernel k) {
  switch (k) {
    case Kernel::kWgmma128: return "128x128";
    case Kernel::kWgmma256: return "128x256";
    case Kernel::kWgmmaPingPong: return "ping-pong";
    case Kernel::kWgmma: return "auto";
    case Kernel::kMmaSync: return "mma.sync";
    case Kernel::kAuto: break;
  }
  return "auto";
}

const char* epilogue_name(WgradEpilogue e) {
  switch (e) {
    case WgradEpilogue::kReadModifyWrite: return "rmw";
    case WgradEpilogue::kReadModifyWriteL2Prefetch: return "rmw+l2pf";
    case WgradEpilogue::kPreload: return "preload";
    case WgradEpilogue::kPreloadL2Prefetch: return "preload+l2pf";
  }
  return "?";
}

/// The wgrad variants timed beside the read-modify-write of every tile kind (wgrad only).
constexpr WgradEpilogue kNewEpilogues[] = {WgradEpilogue::kReadModifyWriteL2Prefetch, WgradEpilogue::kPreload,
                                           WgradEpilogue::kPreloadL2Prefetch};
constexpr Kernel kTileKinds[] = {Kernel::kWgmma256, Kernel::kWgmma128, Kernel::kWgmmaPingPong};

std::vector<int32_t> skewed_counts(int64_t E, int64_t rows, double skew) {
  std::vector<int32_t> counts(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const double f = E > 1 ? 1 + skew * (static_cast<double>(e) - (E - 1) / 2.0) / (E - 1) : 1;
    counts[static_cast<size_t>(e)] = static_cast<int32_t>(std::max(0.0, std::round(rows * f)));
  }
  return counts;
}

float bf16_to_float(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// Device tensors of one projection (n = output features, k = input features) over R rows and
/// E experts: activations bf16, weights bf16 [E·n, k] (expert e: rows [e·n, (e+1)·n)), fp32
/// gradients; random N(0, 1) activations and N(0, 0.02) weights.
struct Problem {
  int64_t R, n, k, E;
  Buffer bx, by, bdx, bdy, bw, bg;
  Tensor x, y, dx, dy, wall, gall, dcounts;
  Buffer bcounts;
  std::vector<Tensor> ws, gs;
  std::vector<int32_t> counts;
  Problem(const std::vector<int32_t>& c, int64_t rows, int64_t n_, int64_t k_, const Stream& st)
      : R(rows), n(n_), k(k_), E(static_cast<int64_t>(c.size())), counts(c) {
    const Device dev = st.device();
    bx = Buffer(dev, R * k * 2);
    by = Buffer(dev, R * n * 2);
    bdx = Buffer(dev, R * k * 2);
    bdy = Buffer(dev, R * n * 2);
    bw = Buffer(dev, E * n * k * 2);
    bg = Buffer(dev, E * n * k * 4);
    bcounts = Buffer(dev, static_cast<size_t>(E) * 4);
    x = bx.as(DType::kBF16, {R, k});
    y = by.as(DType::kBF16, {R, n});
    dx = bdx.as(DType::kBF16, {R, k});
    dy = bdy.as(DType::kBF16, {R, n});
    wall = bw.as(DType::kBF16, {E * n, k});
    gall = bg.as(DType::kF32, {E * n, k});
    dcounts = bcounts.as(DType::kI32, {E});
    copy_bytes(dcounts.data(), dev, counts.data(), Device::cpu(), counts.size() * 4, st);
    {
      // fp32 staging for the random values, one tensor at a time (the largest: max(R·max(n, k), E·n·k)).
      Buffer tmp(dev, static_cast<size_t>(std::max(R * std::max(n, k), E * n * k)) * 4);
      auto randomize = [&](const Tensor& t, uint32_t id, float sd) {
        const Tensor t32 = tmp.as(DType::kF32, {t.numel()});
        init_normal(t32, sd, 99, id, ShardBox::whole({t.numel()}), st);
        cast(t.view({t.numel()}), t32, st);
      };
      randomize(x, 1, 1.f);
      randomize(dy, 2, 1.f);
      randomize(wall, 3, 0.02f);
      st.synchronize();
    }
    fill(gall, 0.f, st);
    for (int64_t e = 0; e < E; ++e) {
      ws.push_back(wall.slice0(e * n, (e + 1) * n));
      gs.push_back(gall.slice0(e * n, (e + 1) * n));
    }
  }
  int64_t used() const {
    int64_t s = 0;
    for (int32_t c : counts) s += c;
    return std::min(s, R);
  }
};

struct Times {
  double f = 0, d = 0, w = 0;
};

/// The per-expert loop over host row ranges.
template <typename F>
void each_expert(const Problem& p, F&& f) {
  int64_t off = 0;
  for (int64_t e = 0; e < p.E; ++e) {
    const int64_t c = p.counts[static_cast<size_t>(e)];
    if (c > 0) f(e, off, c);
    off += c;
  }
}

Times time_grouped(const Problem& p, const GroupedWeights& gw, const GroupedWeights& gg, int iters,
                   const Stream& st) {
  Times t;
  t.f = time_ms(st, iters, [&] { grouped_linear_forward(p.y, p.x, gw, p.dcounts, st); });
  t.d = time_ms(st, iters, [&] { grouped_linear_dgrad(p.dx, p.dy, gw, p.dcounts, st); });
  t.w = time_ms(st, iters, [&] { grouped_linear_wgrad(gg, p.dy, p.x, p.dcounts, st); });
  return t;
}

Times time_loop(const Problem& p, int iters, const Stream& st) {
  Times t;
  t.f = time_ms(st, iters, [&] {
    each_expert(p, [&](int64_t e, int64_t off, int64_t c) {
      linear_forward(p.y.slice0(off, off + c), p.x.slice0(off, off + c), p.ws[e], Tensor(), Tensor(), st);
    });
  });
  t.d = time_ms(st, iters, [&] {
    each_expert(p, [&](int64_t e, int64_t off, int64_t c) {
      linear_backward(p.dx.slice0(off, off + c), Tensor(), Tensor(), p.dy.slice0(off, off + c),
                      p.x.slice0(off, off + c), p.ws[e], st);
    });
  });
  t.w = time_ms(st, iters, [&] {
    each_expert(p, [&](int64_t e, int64_t off, int64_t c) {
      linear_backward(Tensor(), p.gs[e], Tensor(), p.dy.slice0(off, off + c), p.x.slice0(off, off + c), p.ws[e],
                      st);
    });
  });
  return t;
}

/// One MoE shape: both projections, every implementation (the wgmma kernel where it runs).
void bench_shape(const std::string& name, int64_t E, int64_t rows, int64_t hidden, int64_t ffn, double skew,
                 int iters, const Stream& st) {
  const std::vector<int32_t> counts = skewed_counts(E, rows, skew);
  int64_t R = 0;
  for (int32_t c : counts) R += c;
  const auto [mn, mx] = std::minmax_element(counts.begin(), counts.end());
  fmt::print("\n== {}: {} experts, {} rows in all (per expert {} to {}, skew {}), hidden {}, ffn {}, bf16, {}\n",
             name, E, R, *mn, *mx, skew, hidden, ffn, st.device().str());
  fmt::print("{:>4} {:>6} {:>6} | {:>20} | {:>20} | {:>20} |\n", "proj", "n", "k", "forward ms TFLOP/s",
             "dgrad ms TFLOP/s", "wgrad ms TFLOP/s");
  Times sum_wg, sum_pp, sum_mma, sum_loop;
  // wgrad ms per projection, tile kind (kTileKinds) and epilogue (0: rmw, 1 + i: kNewEpilogues[i]);
  // auto_kind: each projection's automatic width (index into kTileKinds).
  double wms[2][3][4] = {};
  int auto_kind[2] = {0, 0};
  bool have_wg = true;
  std::string why;
  for (int proj = 0; proj < 2; ++proj) {
    const int64_t n = proj == 0 ? ffn : hidden, k = proj == 0 ? hidden : ffn;
    const Problem p(counts, R, n, k, st);
    const GroupedWeights gw(p.ws, st), gg(p.gs, st);
    const double flops = 2.0 * static_cast<double>(R) * n * k;
    const char* pname = proj == 0 ? "fc1" : "fc2";
    auto row = [&](const char* impl, const Times& t) {
      fmt::print("{:>4} {:>6} {:>6} | {:>8.3f} {:>11.1f} | {:>8.3f} {:>11.1f} | {:>8.3f} {:>11.1f} | {}\n", pname, n,
                 k, t.f, flops / t.f * 1e-9, t.d, flops / t.d * 1e-9, t.w, flops / t.w * 1e-9, impl);
    };
    Times pp;  // the ping-pong schedule
    Times wg;  // with the automatic tile width of each op's output columns (forward n, dgrad and wgrad k)
    if (have_wg) {
      try {
        Times by_bn[2];
        for (int i = 0; i < 2; ++i) {
          const KernelScope scope(i == 0 ? Kernel::kWgmma256 : Kernel::kWgmma128);
          by_bn[i] = time_grouped(p, gw, gg, iters, st);
          row(i == 0 ? "wgmma 128x256" : "wgmma 128x128", by_bn[i]);
        }
        auto pick = [&](int64_t cols) { return cuda::grouped_sm90::auto_tile_width(cols) == 256 ? 0 : 1; };
        wg = {by_bn[pick(n)].f, by_bn[pick(k)].d, by_bn[pick(k)].w};
        row("wgmma, automatic width", wg);
        {
          const KernelScope scope(Kernel::kWgmmaPingPong);
          pp = time_grouped(p, gw, gg, iters, st);
          row("wgmma ping-pong 128x128", pp);
        }
        const double rmw[3] = {by_bn[0].w, by_bn[1].w, pp.w};
        auto_kind[proj] = pick(k);
        for (int ki = 0; ki < 3; ++ki) {
          wms[proj][ki][0] = rmw[ki];
          for (int ei = 0; ei < 3; ++ei) {
            const KernelScope scope(kTileKinds[ki], kNewEpilogues[ei]);
            const double ms = time_ms(st, iters, [&] { grouped_linear_wgrad(gg, p.dy, p.x, p.dcounts, st); });
            wms[proj][ki][1 + ei] = ms;
            fmt::print("{:>4} {:>6} {:>6} | {:>20} | {:>20} | {:>8.3f} {:>11.1f} | wgrad {} {} ({:.3f}x the rmw)\n",
                       pname, n, k, "", "", ms, flops / ms * 1e-9, kernel_name(kTileKinds[ki]),
                       epilogue_name(kNewEpilogues[ei]), rmw[ki] / ms);
          }
        }
      } catch (const std::exception& e) {
        have_wg = false;
        why = e.what();
      }
    }
    Times mma;
    {
      const KernelScope scope(Kernel::kMmaSync);
      mma = time_grouped(p, gw, gg, iters, st);
      row("mma.sync", mma);
    }
    const Times loop = time_loop(p, iters, st);
    row("cuBLASLt loop", loop);
    if (have_wg) {
      fmt::print("{:>4} {:>6} {:>6} | {:>20.3f} | {:>20.3f} | {:>20.3f} | wgmma / loop speed\n", pname, n, k,
                 loop.f / wg.f, loop.d / wg.d, loop.w / wg.w);
      fmt::print("{:>4} {:>6} {:>6} | {:>20.3f} | {:>20.3f} | {:>20.3f} | ping-pong / loop speed\n", pname, n, k,
                 loop.f / pp.f, loop.d / pp.d, loop.w / pp.w);
    }
    sum_pp = {sum_pp.f + pp.f, sum_pp.d + pp.d, sum_pp.w + pp.w};
    sum_wg = {sum_wg.f + wg.f, sum_wg.d + wg.d, sum_wg.w + wg.w};
    sum_mma = {sum_mma.f + mma.f, sum_mma.d + mma.d, sum_mma.w + mma.w};
    sum_loop = {sum_loop.f + loop.f, sum_loop.d + loop.d, sum_loop.w + loop.w};
    std::fflush(stdout);
  }
  auto total = [](const Times& t) { return t.f + t.d + t.w; };
  if (!have_wg) fmt::print("wgmma kernel not run: {}\n", why);
  if (have_wg) {
    fmt::print("MLP fc1 + fc2, forward + dgrad + wgrad: wgmma ping-pong {:.3f} ms (ping-pong / loop speed {:.3f})\n",
               total(sum_pp), total(sum_loop) / total(sum_pp));
    // Each wgrad variant in place of the automatic width's wgrad, forward and dgrad unchanged.
    fmt::print("wgrad fc1 + fc2, loop {:.3f} ms; per variant: ms, wgrad / loop speed, MLP total / loop speed with "
               "it as the wgrad\n",
               sum_loop.w);
    auto ename = [](int ei) { return ei == 0 ? "rmw" : epilogue_name(kNewEpilogues[ei - 1]); };
    auto line = [&](const char* kind, int ei, double w) {
      fmt::print("  wgrad {:>9} {:>12}: {:>8.3f} ms  wgrad/loop {:.3f}  MLP/loop {:.3f}\n", kind, ename(ei), w,
                 sum_loop.w / w, total(sum_loop) / (total(sum_wg) - sum_wg.w + w));
    };
    for (int ei = 0; ei < 4; ++ei) {
      for (int ki = 0; ki < 3; ++ki) line(kernel_name(kTileKinds[ki]), ei, wms[0][ki][ei] + wms[1][ki][ei]);
      line("auto", ei, wms[0][auto_kind[0]][ei] + wms[1][auto_kind[1]][ei]);
    }
    double best = 0;
    std::string best_names;
    for (int proj = 0; proj < 2; ++proj) {
      int bk = 0, be = 0;
      for (int ki = 0; ki < 3; ++ki) {
        for (int ei = 0; ei < 4; ++ei) {
          if (wms[proj][ki][ei] < wms[proj][bk][be]) {
            bk = ki;
            be = ei;
          }
        }
      }
      best += wms[proj][bk][be];
      best_names += fmt::format("{}{} {} {}", proj == 0 ? "" : ", ", proj == 0 ? "fc1" : "fc2",
                                kernel_name(kTileKinds[bk]), ename(be));
    }
    fmt::print("BEST wgrad ({}): {:.3f} ms (rmw at the automatic width {:.3f} ms, loop {:.3f} ms): wgrad / loop "
               "{:.3f}, MLP / loop {:.3f} with it\n",
               best_names, best, sum_wg.w, sum_loop.w, sum_loop.w / best,
               total(sum_loop) / (total(sum_wg) - sum_wg.w + best));
  }
  fmt::print("MLP fc1 + fc2, forward + dgrad + wgrad: {}mma.sync {:.3f} ms, cuBLASLt loop {:.3f} ms{}\n",
             have_wg ? fmt::format("wgmma {:.3f} ms, ", total(sum_wg)) : std::string(), total(sum_mma),
             total(sum_loop),
             have_wg ? fmt::format(" (wgmma / loop speed {:.3f})", total(sum_loop) / total(sum_wg)) : std::string());
  std::fflush(stdout);
}

// ---- --fp8 --------------------------------------------------------------------------------------

/// The FP8 operands of a Problem (tensorwise, scale 1: x, dy and the weights cast to e4m3 by
/// fp8_quantize, with the transposes the wgrad reads), and the per-expert copies the cuBLASLt loop
/// reads (each expert's dyᵀ [n, c_e] and xᵀ [k, c_e] contiguous, as a per-expert Fp8Linear holds
/// them; their bytes are not initialised: the timing does not depend on them).
struct Fp8Problem {
  Buffer bxq, bxt, bdyq, bdyt, bwq, bwt, bscale, bloop_t, bloop_scales;
  Tensor xq, xt, dyq, dyt, one;
  std::vector<Tensor> wq, wt, loop_dyt, loop_xt, loop_scale;
  Tensor w_scales;
  Fp8Problem(const Problem& p, const Stream& st) {
    const Device dev = st.device();
    const int64_t R = p.R, n = p.n, k = p.k, E = p.E;
    bxq = Buffer(dev, R * k);
    bxt = Buffer(dev, R * k);
    bdyq = Buffer(dev, R * n);
    bdyt = Buffer(dev, R * n);
    bwq = Buffer(dev, E * n * k);
    bwt = Buffer(dev, E * n * k);
    bscale = Buffer(dev, static_cast<size_t>(E + 4) * 4);
    bloop_t = Buffer(dev, R * (n + k));
    bloop_scales = Buffer(dev, static_cast<size_t>(E) * 16);
    xq = bxq.as(DType::kF8E4M3, {R, k});
    xt = bxt.as(DType::kF8E4M3, {k, R});
    dyq = bdyq.as(DType::kF8E4M3, {R, n});
    dyt = bdyt.as(DType::kF8E4M3, {n, R});
    one = bscale.as(DType::kF32, {E + 4}).slice0(0, 1);
    w_scales = bscale.as(DType::kF32, {E + 4}).slice0(4, 4 + E);
    fill(bscale.as(DType::kF32, {E + 4}), 1.f, st);
    fill(bloop_scales.as(DType::kF32, {E * 4}), 1.f, st);
    const Tensor none;
    fp8_quantize(xq, xt, p.x, one, none, st);
    fp8_quantize(dyq, dyt, p.dy, one, none, st);
    const Tensor wall_q = bwq.as(DType::kF8E4M3, {E * n, k});
    fp8_quantize(wall_q, Tensor(), p.wall, one, none, st);
    int64_t off = 0;
    for (int64_t e = 0; e < E; ++e) {
      wq.push_back(wall_q.slice0(e * n, (e + 1) * n));
      const Tensor wte = bwt.as(DType::kF8E4M3, {E * k, n}).slice0(e * k, (e + 1) * k);
      fp8_quantize(Tensor(), wte, p.ws[static_cast<size_t>(e)], one, none, st);
      wt.push_back(wte);
      const int64_t c = p.counts[static_cast<size_t>(e)];
      uint8_t* base = static_cast<uint8_t*>(bloop_t.data()) + off * (n + k);
      loop_dyt.emplace_back(base, DType::kF8E4M3, dev, std::vector<int64_t>{n, c});
      loop_xt.emplace_back(base + n * c, DType::kF8E4M3, dev, std::vector<int64_t>{k, c});
      loop_scale.push_back(bloop_scales.as(DType::kF32, {E * 4}).slice0(e * 4, e * 4 + 1));  // 16-byte aligned
      off += c;
    }
    st.synchronize();
  }
};

Times time_fp8_grouped(const Problem& p, const Fp8Problem& q, const GroupedWeights& gw, const GroupedWeights& gwt,
                       const GroupedWeights& gg, int iters, const Stream& st) {
  Times t;
  t.f = time_ms(st, iters, [&] { grouped_fp8_linear_forward(p.y, q.xq, q.one, gw, q.w_scales, p.dcounts, st); });
  t.d = time_ms(st, iters, [&] { grouped_fp8_linear_forward(p.dx, q.dyq, q.one, gwt, q.w_scales, p.dcounts, st); });
  t.w = time_ms(st, iters, [&] { grouped_fp8_linear_wgrad(gg, q.dyt, q.one, q.xt, q.one, p.dcounts, st); });
  return t;
}

/// The per-expert cuBLASLt FP8 loop (fp8_matmul over host row ranges: the counts on the host, so
/// not capturable), TE's accumulation modes (fast accumulation for the forward only).
Times time_fp8_loop(const Problem& p, const Fp8Problem& q, int iters, const Stream& st) {
  Times t;
  t.f = time_ms(st, iters, [&] {
    each_expert(p, [&](int64_t e, int64_t off, int64_t c) {
      fp8_matmul(p.y.slice0(off, off + c), {q.xq.slice0(off, off + c), q.one}, {q.wq[e], q.loop_scale[e]}, false,
                 true, st);
    });
  });
  t.d = time_ms(st, iters, [&] {
    each_expert(p, [&](int64_t e, int64_t off, int64_t c) {
      fp8_matmul(p.dx.slice0(off, off + c), {q.dyq.slice0(off, off + c), q.one}, {q.wt[e], q.loop_scale[e]}, false,
                 false, st);
    });
  });
  t.w = time_ms(st, iters, [&] {
    each_expert(p, [&](int64_t e, int64_t, int64_t) {
      fp8_matmul(p.gs[e], {q.loop_dyt[e], q.one}, {q.loop_xt[e], q.loop_scale[e]}, true, false, st);
    });
  });
  return t;
}

/// One MoE shape in FP8 (e4m3, tensorwise): the grouped FP8 kernels (automatic, and mma.sync
/// alone), the grouped bf16 kernel (its automatic choice) and the per-expert cuBLASLt FP8 loop,
/// both projections. The counts are
/// rounded down to multiples of 16 (Megatron's --moe-router-padding-for-fp8; the loop's cuBLASLt
/// GEMMs need m % 16 == 0).
void bench_fp8_shape(const std::string& name, int64_t E, int64_t rows, int64_t hidden, int64_t ffn, double skew,
                     int iters, const Stream& st) {
  std::vector<int32_t> counts = skewed_counts(E, rows, skew);
  int64_t R = 0;
  for (int32_t& c : counts) {
    c = c / 16 * 16;
    R += c;
  }
  const auto [mn, mx] = std::minmax_element(counts.begin(), counts.end());
  fmt::print("\n== FP8 {}: {} experts, {} rows in all (per expert {} to {}, skew {}), hidden {}, ffn {}, {}\n", name,
             E, R, *mn, *mx, skew, hidden, ffn, st.device().str());
  fmt::print("{:>4} {:>6} {:>6} | {:>20} | {:>20} | {:>20} |\n", "proj", "n", "k", "forward ms TFLOP/s",
             "dgrad ms TFLOP/s", "wgrad ms TFLOP/s");
  Times sum_f8, sum_bf, sum_loop;
  for (int proj = 0; proj < 2; ++proj) {
    const int64_t n = proj == 0 ? ffn : hidden, k = proj == 0 ? hidden : ffn;
    const Problem p(counts, R, n, k, st);
    const Fp8Problem q(p, st);
    const GroupedWeights gw(p.ws, st), gg(p.gs, st), gwq(q.wq, st), gwt(q.wt, st);
    const double flops = 2.0 * static_cast<double>(R) * n * k;
    const char* pname = proj == 0 ? "fc1" : "fc2";
    auto row = [&](const char* impl, const Times& t) {
      fmt::print("{:>4} {:>6} {:>6} | {:>8.3f} {:>11.1f} | {:>8.3f} {:>11.1f} | {:>8.3f} {:>11.1f} | {}\n", pname, n,
                 k, t.f, flops / t.f * 1e-9, t.d, flops / t.d * 1e-9, t.w, flops / t.w * 1e-9, impl);
    };
    const Times f8 = time_fp8_grouped(p, q, gwq, gwt, gg, iters, st);
    row("FP8 grouped (automatic: wgmma on Hopper)", f8);
    {
      const KernelScope scope(Kernel::kMmaSync);
      row("FP8 grouped mma.sync", time_fp8_grouped(p, q, gwq, gwt, gg, iters, st));
    }
    const Times bf = time_grouped(p, gw, gg, iters, st);
    row("bf16 grouped", bf);
    const Times loop = time_fp8_loop(p, q, iters, st);
    row("FP8 cuBLASLt loop", loop);
    fmt::print("{:>4} {:>6} {:>6} | {:>20.3f} | {:>20.3f} | {:>20.3f} | FP8 grouped / FP8 loop speed\n", pname, n, k,
               loop.f / f8.f, loop.d / f8.d, loop.w / f8.w);
    sum_f8 = {sum_f8.f + f8.f, sum_f8.d + f8.d, sum_f8.w + f8.w};
    sum_bf = {sum_bf.f + bf.f, sum_bf.d + bf.d, sum_bf.w + bf.w};
    sum_loop = {sum_loop.f + loop.f, sum_loop.d + loop.d, sum_loop.w + loop.w};
    std::fflush(stdout);
  }
  auto total = [](const Times& t) { return t.f + t.d + t.w; };
  fmt::print("MLP fc1 + fc2, forward + dgrad + wgrad: FP8 grouped {:.3f} ms, bf16 grouped {:.3f} ms, FP8 cuBLASLt "
             "loop {:.3f} ms (FP8 grouped / loop speed {:.3f}, / bf16 grouped {:.3f})\n",
             total(sum_f8), total(sum_bf), total(sum_loop), total(sum_loop) / total(sum_f8),
             total(sum_bf) / total(sum_f8));
  std::fflush(stdout);
}

// ---- --check ------------------------------------------------------------------------------------

std::vector<float> to_host_bf16(const Tensor& t, const Stream& st) {
  std::vector<uint16_t> raw(static_cast<size_t>(t.numel()));
  copy_bytes(raw.data(), Device::cpu(), t.data(), t.device(), raw.size() * 2, st);
  st.synchronize();
  std::vector<float> v(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) v[i] = bf16_to_float(raw[i]);
  return v;
}

std::vector<float> to_host_f32(const Tensor& t, const Stream& st) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  copy_bytes(v.data(), Device::cpu(), t.data(), t.device(), v.size() * 4, st);
  st.synchronize();
  return v;
}

/// max |a − b| over [0, end) / max |b| there (NaN anywhere: infinity).
double max_rel(const std::vector<float>& a, const std::vector<float>& b, size_t end) {
  double num = 0, den = 0;
  for (size_t i = 0; i < end; ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return num / std::max(den, 1e-30);
}

struct Outputs {
  std::vector<float> y, dx, dw;  // dw: the increments over the initial gradients
};

/// A kernel and wgrad epilogue to check.
struct Variant {
  Kernel kernel;
  WgradEpilogue epilogue;
};

/// Runs the three ops on `v` from NaN-poisoned outputs and the given initial gradients.
Outputs run_ops(const Problem& p, const GroupedWeights& gw, const GroupedWeights& gg,
                const std::vector<float>& g0, Variant v, const Stream& st) {
  const KernelScope scope(v.kernel, v.epilogue);
  fill(p.y, NAN, st);
  fill(p.dx, NAN, st);
  copy_bytes(p.gall.data(), st.device(), g0.data(), Device::cpu(), g0.size() * 4, st);
  grouped_linear_forward(p.y, p.x, gw, p.dcounts, st);
  grouped_linear_dgrad(p.dx, p.dy, gw, p.dcounts, st);
  grouped_linear_wgrad(gg, p.dy, p.x, p.dcounts, st);
  Outputs o{to_host_bf16(p.y, st), to_host_bf16(p.dx, st), to_host_f32(p.gall, st)};
  for (size_t i = 0; i < o.dw.size(); ++i) o.dw[i] -= g0[i];
  return o;
}

/// Every variant of `vs` against the mma.sync kernel on one case.
bool check_case(const std::vector<int32_t>& counts, int64_t R, int64_t n, int64_t k, const std::vector<Variant>& vs,
                const Stream& st) {
  Problem p(counts, R, n, k, st);
  const int64_t used = p.used();
  if (used < R) {  // never read: NaN rows beyond the routed ones
    fill(p.x.slice0(used, R), NAN, st);
    fill(p.dy.slice0(used, R), NAN, st);
  }
  const GroupedWeights gw(p.ws, st), gg(p.gs, st);
  std::vector<float> g0(static_cast<size_t>(p.E * n * k));
  for (size_t i = 0; i < g0.size(); ++i) g0[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.f - 0.5f;
  const Outputs ref = run_ops(p, gw, gg, g0, {Kernel::kMmaSync, WgradEpilogue::kReadModifyWrite}, st);
  bool all = true;
  for (const Variant& v : vs) {
    const Outputs got = run_ops(p, gw, gg, g0, v, st);
    const double ef = max_rel(got.y, ref.y, static_cast<size_t>(used * n));
  const double ed = max_rel(got.dx, ref.dx, static_cast<size_t>(used * k));
  const double ew = max_rel(got.dw, ref.dw, got.dw.size());
  bool tails = true;
  for (size_t i = static_cast<size_t>(used * n); i < got.y.size(); ++i) tails = tails && got.y[i] == 0.f;
  for (size_t i = static_cast<size_t>(used * k); i < got.dx.size(); ++i) tails = tails && got.dx[i] == 0.f;
  // bf16 outputs of two fp32 reductions in different orders differ by about one bf16 rounding
  // (2^-8 of an element); the fp32 gradient increments by fp32 rounding.
    const bool ok = ef < 1e-2 && ed < 1e-2 && ew < 1e-4 && tails;
    fmt::print("{:>3} groups R {:>6} (used {:>6}) n {:>5} k {:>5} tile {:>9} wgrad {:>12} | max rel. err fwd {:.2e} "
               "dgrad {:.2e} wgrad {:.2e} | tails {} | {}\n",
               p.E, R, used, n, k, kernel_name(v.kernel), epilogue_name(v.epilogue), ef, ed, ew,
               tails ? "zero" : "NOT ZERO", ok ? "PASS" : "FAIL");
    std::fflush(stdout);
    all = all && ok;
  }
  return all;
}

int run_check(const Stream& st) {
  if (!cuda::grouped_sm90::device_ready(st)) {
    fmt::print("--check: {} does not run the wgmma kernel (not compute capability 9.0, or the sm_90a code is not "
               "loaded)\n",
               st.device().str());
    return 1;
  }
  fmt::print("--check: the wgmma kernel against the mma.sync kernel (bf16, {})\n", st.device().str());
  std::vector<int32_t> ds;  // 64 DeepSeek-style experts, skewed with empty ones
  for (int g = 0; g < 64; ++g) ds.push_back(g % 7 == 0 ? 0 : (g * 53) % 300);
  std::vector<Variant> vs;
  for (Kernel kern : {Kernel::kWgmma128, Kernel::kWgmma256, Kernel::kWgmma, Kernel::kWgmmaPingPong}) {
    vs.push_back({kern, WgradEpilogue::kReadModifyWrite});
  }
  for (Kernel kern : kTileKinds) {
    for (WgradEpilogue e : kNewEpilogues) vs.push_back({kern, e});
  }
  bool ok = true;
  ok &= check_case({100, 0, 57, 1, 130}, 300, 72, 40, vs, st);              // ragged, a tail of 12
  ok &= check_case({1, 0, 1900, 3, 0, 129, 200}, 2400, 328, 1032, vs, st);  // skewed, 17 K stages
  ok &= check_case({0, 0, 0}, 128, 256, 64, vs, st);                         // all empty
  ok &= check_case(ds, 12000, 1408, 512, vs, st);                            // fc1-shaped (n = 1408)
  ok &= check_case(ds, 12000, 512, 1408, vs, st);                            // fc2-shaped (k = 1408)
  ok &= check_case({3000, 2500, 0, 2700}, 9000, 4096, 1024, vs, st);         // large, a tail of 800
  ok &= check_case({5000, 5000}, 8192, 512, 512, vs, st);                    // Σc > R: the second group clipped
  fmt::print("--check: {}\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

int bench_main(int argc, char** argv) {
  int iters = 10;
  int64_t E = 0, rows = 4096, hidden = 1024, ffn = 3584;
  double skew = 0;
  bool check = false, fp8 = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--check") {
      check = true;
      continue;
    }
    if (a == "--fp8") {
      fp8 = true;
      continue;
    }
    MT_CHECK(i + 1 < argc, "option {} needs a value", a);
    const char* v = argv[++i];
    if (a == "--iters") iters = std::atoi(v);
    else if (a == "--experts") E = std::atoll(v);
    else if (a == "--rows") rows = std::atoll(v);
    else if (a == "--hidden") hidden = std::atoll(v);
    else if (a == "--ffn") ffn = std::atoll(v);
    else if (a == "--skew") skew = std::atof(v);
    else MT_FAIL("unknown option {}", a);
  }
  MT_CHECK(iters >= 1, "--iters {} must be >= 1", iters);
  const Device dev = Device::cuda(0);
  Stream st(dev);
  if (check) return run_check(st);
  const auto shape = fp8 ? bench_fp8_shape : bench_shape;
  if (E > 0) {
    shape("custom", E, rows, hidden, ffn, skew, iters, st);
    return 0;
  }
  if (fp8) {
    bench_fp8_shape("Mixtral-style, balanced", 8, 8192, 4096, 14336, 0, iters, st);
    bench_fp8_shape("Mixtral-style, skewed", 8, 8192, 4096, 14336, 1.5, iters, st);
    bench_fp8_shape("DeepSeek-style, balanced", 64, 768, 2048, 1408, 0, iters, st);
    bench_fp8_shape("DeepSeek-style, skewed", 64, 768, 2048, 1408, 1.5, iters, st);
    return 0;
  }
  bench_shape("Mixtral-style, balanced", 8, 8192, 4096, 14336, 0, iters, st);
  bench_shape("Mixtral-style, skewed", 8, 8192, 4096, 14336, 1.5, iters, st);
  bench_shape("DeepSeek-style, balanced", 64, 768, 2048, 1408, 0, iters, st);
  bench_shape("DeepSeek-style, skewed", 64, 768, 2048, 1408, 1.5, iters, st);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mt::bench::run_main("grouped_matmul_bench", argc, argv, bench_main); }
