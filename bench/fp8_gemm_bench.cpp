// FP8 against bf16 GEMMs at the linear-layer shapes of the benchmark models, and the FP8
// quantisation kernels' bandwidth, on cuda:0:
//   build/fp8_gemm_bench [--iters 20] [--model gpt2|llama_1b|llama_7b|gpt_1p3b|all] [--tokens T]
// Models (tokens = micro-batch x sequence, overridable with --tokens): GPT-2 124M (h 768, MLP
// 3072; 16 x 1024 tokens), the Llama-style 1.18B (h 2048, GQA 32/8 -> qkv 3072, SwiGLU f 8192;
// 4 x 1024), a Llama-2-7B-class layer (h 4096, qkv 12288, SwiGLU f 11008; 4 x 1024), GPT 1.3B
// (h 2048, MLP 8192; 8 x 1024). For each
// linear y[T, n] = x[T, k] wᵀ: fprop (M=T, N=n, K=k), dgrad dx = dy w (M=T, N=k, K=n) and wgrad
// dw += dyᵀ x (M=n, N=k, K=T, fp32 main_grad, beta = 1), 2·M·N·K FLOPs each, as
//   bf16      ops/matmul.h matmul (cuBLASLt, fp32 accumulation), bf16 out (wgrad: fp32);
//   fp8 tw    ops/fp8_matmul.h, tensorwise scales, hybrid format (e4m3 x and w, e5m2 dy; TE's
//             Float8CurrentScaling default), fast accumulation for fprop only (as TE);
//   fp8 blk   ops/fp8_matmul.h, 1x128 activations / gradients, 128x128 weights, e4m3 (TE's
//             Float8BlockScaling default); "n/a" where cuBLASLt offers no kernel.
// The FP8 operands come in the layouts Hopper needs (x, w, dy and their transposes from the
// cast + transpose kernels). Then the quantisation kernels (ops/fp8.h) on each activation and
// weight shape from bf16: amax, tensorwise cast + transpose, blockwise 1x128 and 128x128 cast +
// transpose, and a device-to-device copy of the bf16 tensor for the memory roof; GB/s counts the
// bytes each kernel must move (read bf16, write FP8 and its transpose, and the scales). Last, the
// per-step quantisation of the weights kept in their bf16 storage from the fp32 main parameters
// (Fp8Linear::quantize_weight) at each weight shape: staged as before (cast to bf16, then the bf16
// cast + transpose: 6 + 4 bytes an element) against fp8_quantize_bf16_rounded (6 bytes), and the
// fp32 amax current scaling adds (4 bytes). Then, for SwiGLU models at T tokens, the delayed-scaling
// fused SwiGLU quantisers (ops/fp8_fused.h) against the unfused ops: forward swiglu_forward + the
// cast + transpose of its output (10 bytes per output element) against fp8_swiglu_forward without
// y (6), backward swiglu_backward + the cast + transpose of the gradient (18 bytes per f-column)
// against fp8_swiglu_backward (10); for GELU models the fused GELU quantisers (fc1's bias added in
// its GEMM): forward fp8_bias_gelu's GELU + the cast + transpose (8 bytes per fc1 output element)
// against fp8_gelu_forward without y (4), backward gelu_backward + the bias gradient's column sum +
// the cast + transpose (12) against fp8_gelu_backward with the bias gradient (6), and the unfused
// FP8 path as the model runs it (fp8_gelu_backward writing dx and the bias gradient, then the
// cast: 10).
// Times: median over --iters of CUDA events around one call, after 3 warm-ups.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/buffer.h"
#include "core/device.h"
#include "core/stream.h"
#include "ops/elementwise.h"
#include "ops/fp8.h"
#include "ops/fp8_epilogue.h"
#include "ops/fp8_fused.h"
#include "ops/fp8_matmul.h"
#include "ops/init.h"
#include "ops/gelu.h"
#include "ops/matmul.h"
#include "ops/swiglu.h"

namespace {

using namespace mt;
using bench::time_ms;

struct Linear {
  const char* name;
  int64_t n, k;
};
struct Model {
  const char* name;
  int64_t tokens;
  std::vector<Linear> linears;
};

const std::vector<Model> kModels = {
    {"gpt2", 16 * 1024, {{"qkv", 2304, 768}, {"proj", 768, 768}, {"fc1", 3072, 768}, {"fc2", 768, 3072}}},
    {"llama_1b", 4 * 1024, {{"qkv", 3072, 2048}, {"proj", 2048, 2048}, {"fc1", 16384, 2048}, {"fc2", 2048, 8192}}},
    {"llama_7b", 4 * 1024, {{"qkv", 12288, 4096}, {"proj", 4096, 4096}, {"fc1", 22016, 4096}, {"fc2", 4096, 11008}}},
    {"gpt_1p3b", 8 * 1024, {{"qkv", 6144, 2048}, {"proj", 2048, 2048}, {"fc1", 8192, 2048}, {"fc2", 2048, 8192}}},
};

/// A device tensor that owns its buffer.
struct Dev {
  Buffer buf;
  Tensor t;
  Dev(DType dt, const std::vector<int64_t>& shape, Device dev) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    buf = Buffer(dev, static_cast<size_t>(std::max<int64_t>(n, 1)) * dtype_size(dt));
    t = buf.as(dt, shape);
  }
  operator const Tensor&() const { return t; }
};

/// FP8 copies of one bf16 tensor [rows, cols]: rowwise and transposed data, with the scales of
/// one recipe.
struct Quantised {
  Dev q, qt, s, st;
  Fp8Scaling scaling;
  Quantised(int64_t rows, int64_t cols, DType t, Fp8Scaling sc, Device dev)
      : q(t, {rows, cols}, dev),
        qt(t, {cols, rows}, dev),
        s(DType::kF32, fp8_scale_shape(sc, rows, cols), dev),
        st(DType::kF32, fp8_scale_shape(sc, cols, rows), dev),
        scaling(sc) {}
  Fp8Operand rowwise() const { return {q.t, s.t, scaling}; }
  Fp8Operand transposed() const { return {qt.t, st.t, scaling}; }
};

/// Quantises x into `out` (tensorwise: current scaling; blockwise: in one pass).
void quantise(const Tensor& x, Quantised& out, Dev& amax, Dev& scale, const Stream& st) {
  if (out.scaling == Fp8Scaling::kTensor) {
    fp8_amax(amax, x, st);
    fp8_scale_from_amax(scale, out.s, amax, out.q.t.dtype(), false, 0.f, st);
    copy(out.st, out.s, st);
    fp8_quantize(out.q, out.qt, x, scale, Tensor(), st);
  } else {
    fp8_quantize_blockwise(out.q, out.s, out.qt, out.st, x, out.scaling, true, st);
  }
}

std::string cell(double ms, double flops, double base_ms) {
  if (ms <= 0) return fmt::format("{:>22}", "n/a");
  return fmt::format("{:>7.3f} {:>6.0f} {:>6}", ms, flops / ms * 1e-9,
                     base_ms > 0 ? fmt::format("{:.2f}x", base_ms / ms) : std::string());
}

void bench_model(const Model& m, int64_t tokens, int iters, const Stream& st) {
  const Device dev = st.device();
  const int64_t T = tokens;
  fmt::print("\n{}: {} tokens\n", m.name, T);
  fmt::print("{:<5} {:<5} {:>6} {:>6} {:>6} | {:>22} | {:>22} | {:>22}\n", "layer", "gemm", "M", "N", "K",
             "bf16 ms TFLOP/s", "fp8 tw ms TFLOP/s", "fp8 blk ms TFLOP/s");
  Dev amax(DType::kF32, {1}, dev), scale(DType::kF32, {1}, dev);
  for (const Linear& l : m.linears) {
    const int64_t n = l.n, k = l.k;
    Dev x(DType::kBF16, {T, k}, dev), w(DType::kBF16, {n, k}, dev), dy(DType::kBF16, {T, n}, dev);
    Dev y(DType::kBF16, {T, n}, dev), dx(DType::kBF16, {T, k}, dev), dw(DType::kF32, {n, k}, dev);
    {
      Dev tmp(DType::kF32, {std::max({T * k, n * k, T * n})}, dev);
      auto randomize = [&](const Tensor& t, uint32_t id, float sd) {
        const Tensor t32 = tmp.t.flat_range(0, t.numel());
        init_normal(t32, sd, 7, id, ShardBox::whole({t.numel()}), st);
        cast(t.view({t.numel()}), t32, st);
      };
      randomize(x, 1, 1.f);
      randomize(w, 2, 0.02f);
      randomize(dy, 3, 1e-4f);
    }
    fill(dw, 0.f, st);
    // bf16
    const double bf = time_ms(st, iters, [&] { matmul(y, x, w, false, true, 1.f, 0.f, st); });
    const double bd = time_ms(st, iters, [&] { matmul(dx, dy, w, false, false, 1.f, 0.f, st); });
    const double bw = time_ms(st, iters, [&] { matmul(dw, dy, x, true, false, 1.f, 1.f, st); });
    // FP8: quantise x, w, dy with the recipe (weights' scaling sw), then time fprop, dgrad, wgrad.
    struct Times {
      double fprop = -1, dgrad = -1, wgrad = -1;
    };
    auto fp8 = [&](Fp8Scaling sx, Fp8Scaling sw, DType grad_type, bool fast_fprop) {
      Quantised xq(T, k, DType::kF8E4M3, sx, dev), wq(n, k, DType::kF8E4M3, sw, dev), gq(T, n, grad_type, sx, dev);
      quantise(x, xq, amax, scale, st);
      quantise(w, wq, amax, scale, st);
      quantise(dy, gq, amax, scale, st);
      Times t;
      t.fprop = time_ms(st, iters, [&] { fp8_matmul(y, xq.rowwise(), wq.rowwise(), false, fast_fprop, st); });
      t.dgrad = time_ms(st, iters, [&] { fp8_matmul(dx, gq.rowwise(), wq.transposed(), false, false, st); });
      t.wgrad = time_ms(st, iters, [&] { fp8_matmul(dw, gq.transposed(), xq.transposed(), true, false, st); });
      return t;
    };
    // Tensorwise, hybrid (e5m2 dy), fast accumulation in fprop as TE.
    const Times tw = fp8(Fp8Scaling::kTensor, Fp8Scaling::kTensor, DType::kF8E5M2, true);
    // Blockwise, e4m3: 1x128 x 128x128 for fprop and dgrad, 1x128 x 1x128 for wgrad.
    Times bk;
    try {
      bk = fp8(Fp8Scaling::kBlock1x128, Fp8Scaling::kBlock128x128, DType::kF8E4M3, false);
    } catch (const Error& e) {
      fmt::print("  (blockwise FP8 GEMM unavailable: {})\n", e.what());
    }
    auto row = [&](const char* g, int64_t M, int64_t N, int64_t K, double b, double t8, double k8) {
      const double flops = 2.0 * static_cast<double>(M) * N * K;
      fmt::print("{:<5} {:<5} {:>6} {:>6} {:>6} | {} | {} | {}\n", l.name, g, M, N, K, cell(b, flops, 0),
                 cell(t8, flops, b), cell(k8, flops, b));
    };
    row("fprop", T, n, k, bf, tw.fprop, bk.fprop);
    row("dgrad", T, k, n, bd, tw.dgrad, bk.dgrad);
    row("wgrad", n, k, T, bw, tw.wgrad, bk.wgrad);
  }
}

/// Quantisation kernels on bf16 tensors [rows, cols]: GB/s of the bytes each must move.
void bench_quantisers(const std::vector<std::pair<int64_t, int64_t>>& shapes, int iters, const Stream& st) {
  const Device dev = st.device();
  fmt::print("\nquantisation from bf16 (GB/s of the bytes moved; ms)\n");
  fmt::print("{:>6} {:>6} | {:>16} | {:>16} | {:>16} | {:>16} | {:>16} | {:>16}\n", "rows", "cols", "bf16 copy", "amax",
             "tw cast", "tw cast+T", "1x128 cast+T", "128x128 cast+T");
  Dev amax(DType::kF32, {1}, dev), scale(DType::kF32, {1}, dev);
  for (const auto& [rows, cols] : shapes) {
    const double e = static_cast<double>(rows) * cols;
    Dev x(DType::kBF16, {rows, cols}, dev), x2(DType::kBF16, {rows, cols}, dev);
    {
      Dev tmp(DType::kF32, {rows * cols}, dev);
      init_normal(tmp, 1.f, 11, 1, ShardBox::whole({rows * cols}), st);
      cast(x.t.view({rows * cols}), tmp, st);
    }
    fill(scale, 64.f, st);
    Quantised tw(rows, cols, DType::kF8E4M3, Fp8Scaling::kTensor, dev);
    Quantised b1(rows, cols, DType::kF8E4M3, Fp8Scaling::kBlock1x128, dev);
    Quantised b2(rows, cols, DType::kF8E4M3, Fp8Scaling::kBlock128x128, dev);
    const double s1 = 4.0 * (static_cast<double>(b1.s.t.numel()) + b1.st.t.numel());
    const double s2 = 4.0 * (static_cast<double>(b2.s.t.numel()) + b2.st.t.numel());
    const double t_copy = time_ms(st, iters, [&] { copy(x2, x, st); });
    const double t_amax = time_ms(st, iters, [&] { fp8_amax(amax, x, st); });
    const double t_cast = time_ms(st, iters, [&] { fp8_quantize(tw.q, Tensor(), x, scale, Tensor(), st); });
    const double t_ct = time_ms(st, iters, [&] { fp8_quantize(tw.q, tw.qt, x, scale, Tensor(), st); });
    const double t_b1 =
        time_ms(st, iters, [&] { fp8_quantize_blockwise(b1.q, b1.s, b1.qt, b1.st, x, b1.scaling, true, st); });
    const double t_b2 =
        time_ms(st, iters, [&] { fp8_quantize_blockwise(b2.q, b2.s, b2.qt, b2.st, x, b2.scaling, true, st); });
    auto c = [](double bytes, double ms) { return fmt::format("{:>7.0f} {:>8.4f}", bytes / ms * 1e-6, ms); };
    fmt::print("{:>6} {:>6} | {} | {} | {} | {} | {} | {}\n", rows, cols, c(4 * e, t_copy), c(2 * e, t_amax),
               c(3 * e, t_cast), c(4 * e, t_ct), c(4 * e + s1, t_b1), c(4 * e + s2, t_b2));
  }
}

/// The weights kept in their bf16 storage, quantised from fp32 main parameters [rows, cols] each
/// step: staged (cast to bf16, then cast + transpose of the bf16) against the fused
/// fp8_quantize_bf16_rounded, and current scaling's fp32 amax; GB/s of the bytes each moves.
void bench_weight_quantisers(const std::vector<std::pair<int64_t, int64_t>>& shapes, int iters, const Stream& st) {
  const Device dev = st.device();
  fmt::print("\nweight quantisation from fp32 main parameters (GB/s of the bytes moved; ms)\n");
  fmt::print("{:>6} {:>6} | {:>16} | {:>16} | {:>16} | {:>16}\n", "rows", "cols", "cast to bf16", "staged cast+T",
             "fused cast+T", "fp32 amax");
  Dev amax(DType::kF32, {1}, dev), scale(DType::kF32, {1}, dev);
  fill(scale, 64.f, st);
  for (const auto& [rows, cols] : shapes) {
    const double e = static_cast<double>(rows) * cols;
    Dev main(DType::kF32, {rows, cols}, dev), stage(DType::kBF16, {rows, cols}, dev);
    init_normal(main, 0.02f, 13, 1, ShardBox::whole({rows, cols}), st);
    Quantised tw(rows, cols, DType::kF8E4M3, Fp8Scaling::kTensor, dev);
    const double t_stage = time_ms(st, iters, [&] { cast(stage, main, st); });
    const double t_staged = time_ms(st, iters, [&] {
      cast(stage, main, st);
      fp8_quantize(tw.q, tw.qt, stage, scale, Tensor(), st);
    });
    const double t_fused =
        time_ms(st, iters, [&] { fp8_quantize_bf16_rounded(tw.q, tw.qt, main, scale, Tensor(), st); });
    const double t_amax = time_ms(st, iters, [&] { fp8_amax(amax, main, st); });
    auto c = [](double bytes, double ms) { return fmt::format("{:>7.0f} {:>8.4f}", bytes / ms * 1e-6, ms); };
    fmt::print("{:>6} {:>6} | {} | {} | {} | {}\n", rows, cols, c(6 * e, t_stage), c(10 * e, t_staged),
               c(6 * e, t_fused), c(4 * e, t_amax));
  }
}

/// The fused SwiGLU quantisers against the unfused ops at [tokens, f] (bf16 inputs, e4m3 forward,
/// e5m2 backward, delayed scaling's known scale with the amax record); GB/s of the bytes each must
/// move, as in the header.
void bench_swiglu_quantisers(int64_t tokens, int64_t f, int iters, const Stream& st) {
  const Device dev = st.device();
  fmt::print("\nSwiGLU -> FP8 at {} x {} (GB/s of the bytes moved; ms)\n", tokens, f);
  fmt::print("{:>18} | {:>16} | {:>16}\n", "", "unfused", "fused");
  Dev x(DType::kBF16, {tokens, 2 * f}, dev), y(DType::kBF16, {tokens, f}, dev), dy(DType::kBF16, {tokens, f}, dev),
      dx(DType::kBF16, {tokens, 2 * f}, dev);
  Dev amax(DType::kF32, {1}, dev), scale(DType::kF32, {1}, dev);
  {
    Dev x32(DType::kF32, {tokens, 2 * f}, dev), dy32(DType::kF32, {tokens, f}, dev);
    init_normal(x32, 1.f, 3, 1, ShardBox::whole({tokens, 2 * f}), st);
    init_normal(dy32, 1e-3f, 5, 1, ShardBox::whole({tokens, f}), st);
    cast(x.t.view({x.t.numel()}), x32.t.view({x32.t.numel()}), st);
    cast(dy.t.view({dy.t.numel()}), dy32.t.view({dy32.t.numel()}), st);
  }
  fill(scale, 64.f, st);
  fill(amax, 0.f, st);
  Quantised q(tokens, f, DType::kF8E4M3, Fp8Scaling::kTensor, dev), g(tokens, 2 * f, DType::kF8E5M2,
                                                                     Fp8Scaling::kTensor, dev);
  const double t_fu = time_ms(st, iters, [&] {
    swiglu_forward(y, x, st);
    fp8_quantize(q.q, q.qt, y, scale, amax, st);
  });
  const double t_ff = time_ms(st, iters, [&] { fp8_swiglu_forward(Tensor(), q.q, q.qt, x, scale, amax, st); });
  const double t_bu = time_ms(st, iters, [&] {
    swiglu_backward(dx, dy, x, st);
    fp8_quantize(g.q, g.qt, dx, scale, amax, st);
  });
  const double t_bf = time_ms(st, iters, [&] { fp8_swiglu_backward(g.q, g.qt, dy, x, scale, amax, st); });
  // the unfused parts alone
  const double t_sf = time_ms(st, iters, [&] { swiglu_forward(y, x, st); });
  const double t_cf = time_ms(st, iters, [&] { fp8_quantize(q.q, q.qt, y, scale, amax, st); });
  const double t_sb = time_ms(st, iters, [&] { swiglu_backward(dx, dy, x, st); });
  const double t_cb = time_ms(st, iters, [&] { fp8_quantize(g.q, g.qt, dx, scale, amax, st); });
  const double e = static_cast<double>(tokens) * f;
  auto c = [](double bytes, double ms) { return fmt::format("{:>7.0f} {:>8.4f}", bytes / ms * 1e-6, ms); };
  fmt::print("{:>18} | {} | {}\n", "forward", c(10 * e, t_fu), c(6 * e, t_ff));
  fmt::print("{:>18} | {} | {}\n", "backward", c(18 * e, t_bu), c(10 * e, t_bf));
  fmt::print("unfused parts: swiglu_forward {} | cast+T {} | swiglu_backward {} | cast+T {}\n", c(6 * e, t_sf),
             c(4 * e, t_cf), c(10 * e, t_sb), c(8 * e, t_cb));
}

/// The fused GELU quantisers against the unfused ops at [tokens, f] (bf16, e4m3 forward, e5m2
/// backward, delayed scaling's known scale with the amax record; the backward with fc1's fp32 bias
/// gradient); GB/s of the bytes each must move, as in the header.
void bench_gelu_quantisers(int64_t tokens, int64_t f, int iters, const Stream& st) {
  const Device dev = st.device();
  fmt::print("\nGELU -> FP8 at {} x {} (GB/s of the bytes moved; ms)\n", tokens, f);
  fmt::print("{:>18} | {:>16} | {:>16} | {:>16}\n", "", "unfused", "fused", "model's unfused");
  Dev pre(DType::kBF16, {tokens, f}, dev), y(DType::kBF16, {tokens, f}, dev), dy(DType::kBF16, {tokens, f}, dev),
      dx(DType::kBF16, {tokens, f}, dev), dbias(DType::kF32, {f}, dev);
  Dev amax(DType::kF32, {1}, dev), scale(DType::kF32, {1}, dev);
  {
    Dev x32(DType::kF32, {tokens, f}, dev), dy32(DType::kF32, {tokens, f}, dev);
    init_normal(x32, 1.f, 3, 1, ShardBox::whole({tokens, f}), st);
    init_normal(dy32, 1e-3f, 5, 1, ShardBox::whole({tokens, f}), st);
    cast(pre.t.view({pre.t.numel()}), x32.t.view({x32.t.numel()}), st);
    cast(dy.t.view({dy.t.numel()}), dy32.t.view({dy32.t.numel()}), st);
  }
  fill(scale, 64.f, st);
  fill(amax, 0.f, st);
  fill(dbias, 0.f, st);
  Quantised q(tokens, f, DType::kF8E4M3, Fp8Scaling::kTensor, dev), g(tokens, f, DType::kF8E5M2,
                                                                     Fp8Scaling::kTensor, dev);
  const double t_fu = time_ms(st, iters, [&] {
    fp8_bias_gelu(pre, Tensor(), y, st);
    fp8_quantize(q.q, q.qt, y, scale, amax, st);
  });
  const double t_ff = time_ms(st, iters, [&] { fp8_gelu_forward(Tensor(), q.q, q.qt, pre, scale, amax, st); });
  const double t_bu = time_ms(st, iters, [&] {
    gelu_backward(dx, dy, pre, st);
    bias_dropout_add_backward(Tensor(), dbias, dx, 0.f, DropoutKey{}, 0, st);
    fp8_quantize(g.q, g.qt, dx, scale, amax, st);
  });
  const double t_bf = time_ms(st, iters, [&] {
    fp8_gelu_backward(Tensor(), g.q, g.qt, dbias, dy, pre, scale, amax, st);
  });
  const double t_bm = time_ms(st, iters, [&] {
    fp8_gelu_backward(dx, Tensor(), Tensor(), dbias, dy, pre, Tensor(), Tensor(), st);
    fp8_quantize(g.q, g.qt, dx, scale, amax, st);
  });
  const double t_cf = time_ms(st, iters, [&] { fp8_quantize(q.q, q.qt, y, scale, amax, st); });
  const double e = static_cast<double>(tokens) * f;
  auto c = [](double bytes, double ms) { return fmt::format("{:>7.0f} {:>8.4f}", bytes / ms * 1e-6, ms); };
  fmt::print("{:>18} | {} | {} |\n", "forward", c(8 * e, t_fu), c(4 * e, t_ff));
  fmt::print("{:>18} | {} | {} | {}\n", "backward", c(12 * e, t_bu), c(6 * e, t_bf), c(10 * e, t_bm));
  fmt::print("cast+T alone {}\n", c(4 * e, t_cf));
}

int bench_main(int argc, char** argv) {
  int iters = 20;
  std::string which = "all";
  int64_t tokens = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--iters")
      iters = std::atoi(argv[i + 1]);
    else if (a == "--model")
      which = argv[i + 1];
    else if (a == "--tokens")
      tokens = std::atoll(argv[i + 1]);
    else
      MT_FAIL("unknown option {} (expected --iters, --model, --tokens)", a);
  }
  MT_CHECK(iters >= 1, "--iters must be >= 1, got {}", iters);
  MT_CHECK(tokens >= 0 && tokens % 16 == 0, "--tokens must be a multiple of 16 (FP8 GEMM rule), got {}", tokens);
  MT_CHECK(cuda_available(), "fp8_gemm_bench needs a CUDA device");
  const Stream st(Device::cuda(0));
  fmt::print("fp8_gemm_bench on {}: median of {} runs\n", st.device().str(), iters);
  std::vector<std::pair<int64_t, int64_t>> qshapes, wshapes;
  bool found = false;
  for (const Model& m : kModels) {
    if (which != "all" && which != m.name) continue;
    found = true;
    const int64_t T = tokens > 0 ? tokens : m.tokens;
    bench_model(m, T, iters, st);
    for (const Linear& l : m.linears) {
      for (std::pair<int64_t, int64_t> s : {std::pair{T, l.k}, std::pair{l.n, l.k}}) {  // activation x, weight
        if (std::find(qshapes.begin(), qshapes.end(), s) == qshapes.end()) qshapes.push_back(s);
      }
      const std::pair<int64_t, int64_t> w{l.n, l.k};
      if (std::find(wshapes.begin(), wshapes.end(), w) == wshapes.end()) wshapes.push_back(w);
    }
  }
  MT_CHECK(found, "--model {}: expected gpt2, llama_1b, llama_7b, gpt_1p3b or all", which);
  bench_quantisers(qshapes, iters, st);
  bench_weight_quantisers(wshapes, iters, st);
  for (const Model& m : kModels) {
    if (which != "all" && which != m.name) continue;
    const bool gelu = std::string(m.name).rfind("gpt", 0) == 0;  // fc1's output is the MLP width
    if (gelu) {
      bench_gelu_quantisers(tokens > 0 ? tokens : m.tokens, m.linears[3].k, iters, st);
    } else {
      bench_swiglu_quantisers(tokens > 0 ? tokens : m.tokens, m.linears[3].k, iters, st);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mt::bench::run_main("fp8_gemm_bench", argc, argv, bench_main); }
