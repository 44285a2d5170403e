// The cost of --deterministic-mode's kernels outside attention (flash attention: bench/
// flash_attention_bench.cpp, its "det bwd" columns), bf16 on cuda:0:
//   build/deterministic_ops_bench [--iters 50] [--tokens 4096,16384,65536] [--hidden 768,4096]
//                                 [--vocab 50304]
// (1) embedding_backward into an fp32 [vocab, h] gradient: the default fp32 atomics against the
//     deterministic path (CUB radix sort of the ids, one block per run of an id and column chunk),
//     ids drawn from a Zipf(1) law over the vocabulary (a text-like share of repeats: the most
//     frequent id is ~10% of the tokens);
// (2) the weight / bias gradients that are deterministic on every run now (fixed-order partial
//     rows, ops/cuda/column_partials.cuh): rmsnorm_backward, layernorm_backward and
//     bias_dropout_add_backward (p = 0.1) over [tokens, h], with their effective bandwidth
//     (MT_LAYERNORM_BWD_VARIANT=1: layernorm_backward's two-kernel path instead of the fused
//     one, ops/cuda/norm_backward_cached.cuh).
// Times: median over --iters of CUDA events around one call, after 3 warm-up calls.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/buffer.h"
#include "core/device.h"
#include "bench_util.h"
#include "core/stream.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/init.h"
#include "ops/layernorm.h"
#include "ops/rmsnorm.h"

namespace {

using namespace mt;
using bench::median;
using bench::parse_list;
using bench::time_ms;

/// Zipf(1) ids over [0, vocab): P(rank r) ∝ 1/(r + 1), ranks shuffled over the vocabulary.
std::vector<int32_t> zipf_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> cdf(static_cast<size_t>(vocab));
  double acc = 0;
  for (int64_t r = 0; r < vocab; ++r) cdf[r] = acc += 1.0 / static_cast<double>(r + 1);
  std::vector<int32_t> perm(static_cast<size_t>(vocab));
  for (int64_t r = 0; r < vocab; ++r) perm[r] = static_cast<int32_t>(r);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::uniform_real_distribution<double> u(0.0, acc);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = perm[std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin()];
  return ids;
}

/// A bf16 tensor of N(0, 1) values (through an fp32 scratch of the same element count).
void fill_normal_bf16(const Tensor& t, uint32_t id, const Stream& st) {
  Buffer tmp(t.device(), static_cast<size_t>(t.numel()) * 4);
  const Tensor f = tmp.as(DType::kF32, {t.numel()});
  init_normal(f, 1.f, 1234, id, ShardBox::whole({t.numel()}), st);
  cast(t, f, st);
  st.synchronize();
}

int bench_main(int argc, char** argv) {
  int iters = 50;
  std::vector<int64_t> tokens{4096, 16384, 65536}, hidden{768, 4096};
  int64_t vocab = 50304;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--iters") iters = std::atoi(v);
    else if (a == "--tokens") tokens = parse_list(v);
    else if (a == "--hidden") hidden = parse_list(v);
    else if (a == "--vocab") vocab = std::atoll(v);
    else MT_FAIL("deterministic_ops_bench: unknown argument {}", a);
  }
  MT_CHECK(cuda_available(), "deterministic_ops_bench needs a CUDA device");
  const Device dev = Device::cuda(0);
  Stream st(dev);
  fmt::print("embedding_backward (bf16 dout, fp32 [{} x h] gradient, Zipf ids): fp32 atomics vs deterministic\n",
             vocab);
  fmt::print("{:>7} {:>6} {:>8} | {:>11} {:>11} {:>8}\n", "tokens", "h", "top id %", "atomic ms", "determ. ms",
             "ratio");
  for (const int64_t h : hidden) {
    Buffer bgrad(dev, static_cast<size_t>(vocab * h) * 4);
    const Tensor grad = bgrad.as(DType::kF32, {vocab, h});
    fill(grad, 0.f, st);
    for (const int64_t n : tokens) {
      const auto ids = zipf_ids(n, vocab, 42);
      std::vector<int64_t> count(static_cast<size_t>(vocab), 0);
      for (int32_t id : ids) ++count[id];
      const double top = 100.0 * static_cast<double>(*std::max_element(count.begin(), count.end())) / n;
      Buffer bids(dev, static_cast<size_t>(n) * 4), bdout(dev, static_cast<size_t>(n * h) * 2);
      const Tensor tids = bids.as(DType::kI32, {n, 1}), dout = bdout.as(DType::kBF16, {n, 1, h});
      copy_bytes(tids.data(), dev, ids.data(), Device::cpu(), ids.size() * 4, st);
      fill_normal_bf16(dout, 1, st);
      const Tensor none;
      const double atomic =
          time_ms(st, iters, [&] { embedding_backward(grad, none, dout, tids, none, 0, false, st); });
      const double det = time_ms(st, iters, [&] { embedding_backward(grad, none, dout, tids, none, 0, true, st); });
      fmt::print("{:>7} {:>6} {:>8.1f} | {:>11.3f} {:>11.3f} {:>8.2f}\n", n, h, top, atomic, det, det / atomic);
      std::fflush(stdout);
    }
  }

  fmt::print("\nnorm / bias gradients (bf16 [tokens, h], fp32 weight gradients; deterministic on every run)\n");
  fmt::print("{:>7} {:>6} | {:>12} {:>8} | {:>12} {:>8} | {:>12} {:>8}\n", "tokens", "h", "rmsnorm ms", "GB/s",
             "layernorm ms", "GB/s", "bda dbias ms", "GB/s");
  for (const int64_t h : hidden) {
    for (const int64_t n : tokens) {
      const size_t act = static_cast<size_t>(n * h) * 2;
      Buffer bx(dev, act), bdy(dev, act), bdx(dev, act), bw(dev, h * 2), bb(dev, h * 2), bdw(dev, h * 4),
          bdb(dev, h * 4), bstat(dev, n * 8);
      const Tensor x = bx.as(DType::kBF16, {n, h}), dy = bdy.as(DType::kBF16, {n, h}), dx = bdx.as(DType::kBF16, {n, h});
      const Tensor w = bw.as(DType::kBF16, {h}), b = bb.as(DType::kBF16, {h});
      const Tensor dw = bdw.as(DType::kF32, {h}), db = bdb.as(DType::kF32, {h});
      const Tensor mean = bstat.as(DType::kF32, {2 * n}).flat_range(0, n), rstd = bstat.as(DType::kF32, {2 * n}).flat_range(n, n);
      fill_normal_bf16(x, 2, st);
      fill_normal_bf16(dy, 3, st);
      fill(w, 1.f, st);
      fill(b, 0.f, st);
      fill(dw, 0.f, st);
      fill(db, 0.f, st);
      const Tensor y = dx;
      rmsnorm_forward(y, rstd, x, w, 1e-5f, st);
      const double rms = time_ms(st, iters, [&] { rmsnorm_backward(dx, dw, dy, x, w, rstd, false, st); });
      layernorm_forward(y, mean, rstd, x, w, b, 1e-5f, st);
      const double ln = time_ms(st, iters, [&] { layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, false, st); });
      const DropoutKey key{1234, 1, 0, 0};
      const double bda = time_ms(st, iters, [&] { bias_dropout_add_backward(dx, db, dy, 0.1f, key, 0, st); });
      // Bytes moved: x, dy read and dx written (norms), dy read and dx written (bias-dropout-add).
      const double gb3 = 3.0 * static_cast<double>(act) * 1e-6, gb2 = 2.0 * static_cast<double>(act) * 1e-6;
      fmt::print("{:>7} {:>6} | {:>12.3f} {:>8.0f} | {:>12.3f} {:>8.0f} | {:>12.3f} {:>8.0f}\n", n, h, rms, gb3 / rms,
                 ln, gb3 / ln, bda, gb2 / bda);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mt::bench::run_main("deterministic_ops_bench", argc, argv, bench_main); }
