// Context-parallel blockwise attention (ops/context_attention.h) throughput on cuda:0, bf16: one
// (query shard, key block) pair of s tokens each, as one step of the p2p ring does:
//   build/context_attention_bench [--iters 10] [--hidden 2048] [--qpg 1] [--batch 1]
//                                 [--dims 64,128] [--seqs 4096,8192,16384,32768]
// n = hidden / d query heads (g = n / qpg key/value heads), b = --batch. Two masks per shape:
//   full    the queries at positions s .. 2s−1 against keys 0 .. s−1: every key visible (the
//           half-block steps of the load-balanced ring; ContextBlockMask::kFull);
//   causal  queries and keys at positions 0 .. s−1, causal (the ring's diagonal step; kCausal).
// Two backends per mask: "fa2" the FlashAttention-2 kernels, "cudnn" cuDNN's fused attention
// (ContextAttentionConfig::cudnn; only in builds with cuDNN), as the CP layer runs them with
// --attention-backend flash / fused.
// FLOPs (FlashAttention-2 convention): forward 4·b·n·s²·d (full) or half of it (causal), backward
// 2.5 × forward. Times: median over --iters of CUDA events around one call after 3 warm-ups.
// The forward runs with merge = true into an (out, lse) of an earlier block (the ring's case);
// the backward includes its preprocessing (D = rowsum(dO ∘ O), dq_accum zeroing) and the dQ sum
// (cuDNN: the LSE transpose, and the dQ / dK / dV additions).
// Old vs new: MT_CONTEXT_ATTN_SIMPLE=1 forces the simple CUDA-core kernels instead of fa2 (read
// once per process), e.g.  build/context_attention_bench --seqs 4096,8192 --iters 3
//       MT_CONTEXT_ATTN_SIMPLE=1 build/context_attention_bench --seqs 4096,8192 --iters 3
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
#include "ops/context_attention.h"
#include "ops/elementwise.h"
#include "ops/flash_attention.h"
#include "ops/init.h"

namespace {

using namespace mt;
using bench::parse_list;
using bench::time_ms;

/// dst (int32 [n] on the device) <- first, first + 1, ...
void upload_positions(const Tensor& dst, int64_t first, const Stream& st) {
  std::vector<int32_t> h(static_cast<size_t>(dst.numel()));
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<int32_t>(first + static_cast<int64_t>(i));
  copy_bytes(dst.data(), dst.device(), h.data(), Device::cpu(), h.size() * sizeof(int32_t), st);
  st.synchronize();
}

int bench_main(int argc, char** argv) {
  int iters = 10;
  int64_t hidden = 2048, qpg = 1, batch = 1;
  std::vector<int64_t> dims{64, 128}, seqs{4096, 8192, 16384, 32768};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--iters") iters = std::atoi(v);
    else if (a == "--hidden") hidden = std::atoll(v);
    else if (a == "--qpg") qpg = std::atoll(v);
    else if (a == "--batch") batch = std::atoll(v);
    else if (a == "--dims") dims = parse_list(v);
    else if (a == "--seqs") seqs = parse_list(v);
    else MT_FAIL("context_attention_bench: unknown argument {}", a);
  }
  MT_CHECK(cuda_available(), "context_attention_bench needs a CUDA device");
  const Device dev = Device::cuda(0);
  Stream st(dev);
  const char* simple = std::getenv("MT_CONTEXT_ATTN_SIMPLE");
  const bool is_simple = simple != nullptr && std::atoi(simple) != 0;
  fmt::print("context attention (one query shard x one key block), bf16, n*d = {}, qpg = {}, b = {}, kernels: {}\n",
             hidden, qpg, batch, is_simple ? "simple CUDA-core (MT_CONTEXT_ATTN_SIMPLE=1)" : "tensor-core (default)");
  fmt::print("{:>4} {:>6} {:>4} {:>7} {:>6} | {:>9} {:>9} | {:>9} {:>9}\n", "d", "s", "n", "mask", "kernel", "fwd ms",
             "fwd TF/s", "bwd ms", "bwd TF/s");
  for (const int64_t d : dims) {
    for (const int64_t s : seqs) {
      const int64_t b = batch, n = hidden / d, g = n / qpg;
      ContextAttentionConfig cfg;
      cfg.batch = b;
      cfg.groups = g;
      cfg.queries_per_group = qpg;
      cfg.head_dim = d;
      cfg.softmax_scale = 1.f / std::sqrt(static_cast<float>(d));
      const int64_t nqkv = s * b * g * (qpg + 2) * d, nkv = s * b * g * 2 * d, nout = s * b * n * d;
      ContextAttentionConfig cud = cfg;
      cud.cudnn = true;
      const size_t ws_bytes = std::max(context_attention_workspace_bytes(cud, s, s),
                                        context_attention_forward_workspace_bytes(cud, s));
      Buffer bqkv(dev, nqkv * 2), bdqkv(dev, nqkv * 2), bkv(dev, nkv * 2), bdkv(dev, nkv * 2), bout(dev, nout * 2),
          bdout(dev, nout * 2), blse(dev, s * b * n * 4), tmp(dev, std::max(nqkv, nout) * 4), bqp(dev, s * 4),
          bkp(dev, s * 4), bkp2(dev, s * 4), bws(dev, ws_bytes);
      const Tensor qkv = bqkv.as(DType::kBF16, {s, b, g, qpg + 2, d}), dqkv = bdqkv.as(DType::kBF16, {s, b, g, qpg + 2, d});
      const Tensor kv = bkv.as(DType::kBF16, {s, b, g, 2, d}), dkv = bdkv.as(DType::kBF16, {s, b, g, 2, d});
      const Tensor out = bout.as(DType::kBF16, {s, b, n, d}), dout = bdout.as(DType::kBF16, {s, b, n, d});
      const Tensor lse = blse.as(DType::kF32, {s, b, n});
      const Tensor ws = bws.as(DType::kU8, {static_cast<int64_t>(bws.bytes())});
      const Tensor t32 = tmp.as(DType::kF32, {std::max(nqkv, nout)});
      init_normal(t32.flat_range(0, nqkv), 1.f, 1234, 1, ShardBox::whole({nqkv}), st);
      cast(qkv, t32.flat_range(0, nqkv), st);
      kv_pack(kv, qkv, qpg, st);
      init_normal(t32.flat_range(0, nout), 1.f, 1234, 2, ShardBox::whole({nout}), st);
      cast(dout, t32.flat_range(0, nout), st);
      fill(dqkv, 0.f, st);
      fill(dkv, 0.f, st);
      cfg.q_pos = bqp.as(DType::kI32, {s});
      const Tensor k_low = bkp.as(DType::kI32, {s}), k_same = bkp2.as(DType::kI32, {s});
      upload_positions(k_low, 0, st);
      upload_positions(k_same, 0, st);
      for (const bool full : {true, false}) {
        upload_positions(cfg.q_pos, full ? s : 0, st);
        cfg.k_pos = full ? k_low : k_same;
        cfg.block = full ? ContextBlockMask::kFull : ContextBlockMask::kCausal;
        for (const bool cudnn : {false, true}) {
          if (cudnn && !flash_attention_cudnn_available()) continue;
          ContextAttentionConfig c = cfg;
          c.cudnn = cudnn;
          // (out, lse) of the block itself, so that merge = true below is the ring's later step.
          context_attention_forward(out, lse, qkv, kv, ws, c, false, st);
          const double fwd =
              time_ms(st, iters, [&] { context_attention_forward(out, lse, qkv, kv, ws, c, true, st); });
          context_attention_forward(out, lse, qkv, kv, ws, c, false, st);
          const double bwd = time_ms(
              st, iters, [&] { context_attention_backward(dqkv, dkv, dout, out, lse, qkv, kv, ws, c, st); });
          const double flops = (full ? 4.0 : 2.0) * b * n * static_cast<double>(s) * s * d;
          fmt::print("{:>4} {:>6} {:>4} {:>7} {:>6} | {:>9.3f} {:>9.1f} | {:>9.3f} {:>9.1f}\n", d, s, n,
                     full ? "full" : "causal", cudnn ? "cudnn" : "fa2", fwd, flops / fwd * 1e-9, bwd,
                     2.5 * flops / bwd * 1e-9);
          std::fflush(stdout);
        }
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mt::bench::run_main("context_attention_bench", argc, argv, bench_main); }
