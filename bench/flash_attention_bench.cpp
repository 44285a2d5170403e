// Flash attention (ops/flash_attention.h) throughput, causal, bf16, on cuda:0:
//   build/flash_attention_bench [--iters 20] [--tokens 16384] [--hidden 2048] [--qpg 1]
//                               [--dims 64,128] [--seqs 1024,2048,4096,8192] [--dropout 0]
// For each head dim d and sequence length s: b = tokens / s samples and n = hidden / d query heads
// (g = n / qpg key/value heads), so every shape does the same work per token and fills the GPU.
// FLOPs (FlashAttention-2 paper's convention): causal forward 2·b·n·s²·d (half of 4·b·n·s²·d),
// backward 2.5 × forward (recomputation of S not counted). Times: median over --iters of CUDA
// events around one call, after 3 warm-up calls; inputs are N(0, 1). Backward includes its
// preprocessing (D = rowsum(dO ∘ O), dq_accum zeroing) and the dQ conversion. "det bwd" is the
// deterministic backward (--deterministic-mode: dK/dV kernel without dQ, then the dQ kernel;
// FlashAttentionConfig::deterministic), with the same FLOP count for its TF/s, and "det/atomic"
// its time over the default backward's. --dropout p adds attention dropout to both. "cudnn" columns:
// the same calls with FlashAttentionConfig::cudnn (--attention-backend fused: cuDNN's fused
// attention, ops/cuda/cudnn_attention.h; MHA only, so they show "-" with --qpg > 1 or dropout, where
// the calls would fall back to the kernels above).
// bench/flash_attention_torch.py prints the same table for PyTorch's SDPA (flash backend).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/buffer.h"
#include "core/device.h"
#include "bench_util.h"
#include "core/stream.h"
#include "ops/elementwise.h"
#include "ops/cuda/cudnn_attention.h"
#include "ops/flash_attention.h"
#include "ops/init.h"

namespace {

using namespace mt;
using bench::median;
using bench::parse_list;
using bench::time_ms;

/// Median milliseconds of f() over `iters` calls (events around each call) after 3 warm-ups.
int bench_main(int argc, char** argv) {
  int iters = 20;
  int64_t tokens = 16384, hidden = 2048, qpg = 1;
  float dropout = 0.f;
  std::vector<int64_t> dims{64, 128}, seqs{1024, 2048, 4096, 8192};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--iters") iters = std::atoi(v);
    else if (a == "--tokens") tokens = std::atoll(v);
    else if (a == "--hidden") hidden = std::atoll(v);
    else if (a == "--qpg") qpg = std::atoll(v);
    else if (a == "--dims") dims = parse_list(v);
    else if (a == "--seqs") seqs = parse_list(v);
    else if (a == "--dropout") dropout = static_cast<float>(std::atof(v));
    else MT_FAIL("flash_attention_bench: unknown argument {}", a);
  }
  MT_CHECK(cuda_available(), "flash_attention_bench needs a CUDA device");
  const Device dev = Device::cuda(0);
  Stream st(dev);
  fmt::print("flash attention (megatron.cpp, FA2 on mma.sync), causal, bf16, tokens b*s = {}, n*d = {}, qpg = {}, "
             "dropout {}\n",
             tokens, hidden, qpg, dropout);
  fmt::print("{:>4} {:>6} {:>4} {:>4} | {:>9} {:>9} | {:>9} {:>9} | {:>11} {:>11} {:>10} | {:>12} {:>12}\n", "d", "s",
             "b", "n", "fwd ms", "fwd TF/s", "bwd ms", "bwd TF/s", "det bwd ms", "det TF/s", "det/atomic",
             "cudnn fwd TF", "cudnn bwd TF");
  for (const int64_t d : dims) {
    for (const int64_t s : seqs) {
      const int64_t b = std::max<int64_t>(1, tokens / s), n = hidden / d, g = n / qpg;
      FlashAttentionConfig cfg;
      cfg.seq = s;
      cfg.batch = b;
      cfg.groups = g;
      cfg.queries_per_group = qpg;
      cfg.head_dim = d;
      cfg.softmax_scale = 1.f / std::sqrt(static_cast<float>(d));
      cfg.dropout_p = dropout;
      cfg.dropout_key = DropoutKey{1234, 1, 0, 0};
      FlashAttentionConfig det = cfg;
      det.deterministic = true;
      const int64_t nqkv = s * b * g * (qpg + 2) * d, nout = s * b * n * d;
      Buffer bqkv(dev, nqkv * 2), bdqkv(dev, nqkv * 2), bout(dev, nout * 2), bdout(dev, nout * 2);
      Buffer blse(dev, b * n * s * 4), bws(dev, flash_attention_workspace_bytes(cfg)), tmp(dev, nqkv * 4);
      const Tensor qkv = bqkv.as(DType::kBF16, {s, b, g, qpg + 2, d}), dqkv = bdqkv.as(DType::kBF16, {s, b, g, qpg + 2, d});
      const Tensor out = bout.as(DType::kBF16, {s, b, n, d}), dout = bdout.as(DType::kBF16, {s, b, n, d});
      const Tensor lse = blse.as(DType::kF32, {b, n, s}), ws = bws.as(DType::kU8, {static_cast<int64_t>(bws.bytes())});
      const Tensor t32 = tmp.as(DType::kF32, {nqkv});
      init_normal(t32, 1.f, 1234, 1, ShardBox::whole({nqkv}), st);
      cast(qkv, t32, st);
      const Tensor t32o = t32.flat_range(0, nout);
      init_normal(t32o, 1.f, 1234, 2, ShardBox::whole({nout}), st);
      cast(dout, t32o, st);
      const double fwd = time_ms(st, iters, [&] { flash_attention_forward(out, lse, qkv, cfg, st); });
      const double bwd =
          time_ms(st, iters, [&] { flash_attention_backward(dqkv, dout, out, lse, qkv, ws, cfg, st); });
      const double bwd_det =
          time_ms(st, iters, [&] { flash_attention_backward(dqkv, dout, out, lse, qkv, ws, det, st); });
      const double flops = 2.0 * b * n * static_cast<double>(s) * s * d;
      FlashAttentionConfig fused = cfg;
      fused.cudnn = true;
      std::string cudnn_fwd = "-", cudnn_bwd = "-";
      if (cuda::cudnn_attention_applies(fused, DType::kBF16, {qkv.data(), out.data(), dout.data(), dqkv.data()})) {
        const double f = time_ms(st, iters, [&] { flash_attention_forward(out, lse, qkv, fused, st); });
        const double bk =
            time_ms(st, iters, [&] { flash_attention_backward(dqkv, dout, out, lse, qkv, ws, fused, st); });
        cudnn_fwd = fmt::format("{:.1f}", flops / f * 1e-9);
        cudnn_bwd = fmt::format("{:.1f}", 2.5 * flops / bk * 1e-9);
      }
      fmt::print(
          "{:>4} {:>6} {:>4} {:>4} | {:>9.3f} {:>9.1f} | {:>9.3f} {:>9.1f} | {:>11.3f} {:>11.1f} {:>10.2f} | {:>12} {:>12}\n",
          d, s, b, n, fwd, flops / fwd * 1e-9, bwd, 2.5 * flops / bwd * 1e-9, bwd_det, 2.5 * flops / bwd_det * 1e-9,
          bwd_det / bwd, cudnn_fwd, cudnn_bwd);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mt::bench::run_main("flash_attention_bench", argc, argv, bench_main); }
