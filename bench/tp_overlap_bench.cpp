// Tensor-parallel communication of one transformer layer's MLP, phase by phase (issue 41: where the
// MFU of TP + SP goes; docs/parallelism.md §7). One rank per GPU (TP = the world size), bf16, b = 1,
// the 7B-class Llama's MLP by default (h 4096, SwiGLU 11008, sequence 4096; --hidden, --ffn, --seq):
//   fc1 (ColumnParallelLinear under SP): full [s, h] <- all-gather(local [s/tp, h]), then y [s, 2f/tp]
//       <- full · W1ᵀ, as tp GEMMs of s/tp rows (the blocks the layer computes);
//   fc2 (RowParallelLinear under SP): partial [s, h] <- z [s, f/tp] · W2ᵀ (tp block GEMMs), then
//       local [s/tp, h] <- reduce-scatter(partial).
// Per linear, each the median of --iters runs (events on the compute stream), the max over the ranks:
//   gemm     the tp block GEMMs alone (nothing to wait for)
//   coll     the collective alone (TensorParallelRegion::enter_forward / exit_forward: NCCL)
//   plain    TensorParallelRegion::all_gather_gemm / gemm_reduce_scatter without --tp-comm-overlap
//            (the collective, then the GEMMs: what a TP + SP step runs)
//   overlap  the same with --tp-comm-overlap (the collective in pieces on the region's
//            communication stream, pipelined with the block GEMMs)
// and exposed = time − gemm for plain and overlap, hidden = 1 − exposed(overlap) / coll (the share of
// the collective the pipelining hides; below 0 when the pipelining costs more than it hides: the
// block transfers' NCCL kernels take SMs from the GEMMs, and each step waits for its transfer).
// The backward's collectives mirror these (the same sizes), so twice the per-layer forward figures
// is the layer's TP communication per micro-batch.
// Run: mpiexec --allow-run-as-root -np 2 build/tp_overlap_bench [--iters 20] [--layers 32]
//   --layers L: also print the exposed TP communication of L layers' forward and backward
//   (4 × the two linears' exposed time per layer, fc1 + fc2 and the attention's qkv + proj taken
//   as the same sizes: an estimate for the model, said so).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "bench_dist.h"
#include "bench_util.h"
#include "comm/bootstrap.h"
#include "core/buffer.h"
#include "ops/elementwise.h"
#include "ops/init.h"
#include "ops/matmul.h"
#include "parallel/mappings.h"

namespace {

using namespace mt;

template <typename F>
double timed(Communicator& world, const Stream& st, int iters, F&& f) {
  world.barrier();  // the ranks start each measurement together
  return bench::timed(world, st, iters, std::forward<F>(f));
}

struct Phases {
  double gemm = 0, coll = 0, plain = 0, overlap = 0;
};

void print_row(const char* name, const Phases& p, double tflop) {
  const double exp_plain = p.plain - p.gemm, exp_over = p.overlap - p.gemm;
  fmt::print("{:<24} | {:>8.3f} {:>7.1f} | {:>8.3f} | {:>8.3f} {:>8.3f} | {:>8.3f} {:>8.3f} | {:>6.0f}%\n", name, p.gemm,
             tflop / p.gemm * 1e-9, p.coll, p.plain, exp_plain, p.overlap, exp_over,
             p.coll > 0 ? 100.0 * (1.0 - exp_over / p.coll) : NAN);
}

int bench_main(int argc, char** argv) {
  int64_t hidden = 4096, ffn = 11008, seq = 4096, layers = 0;
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    MT_REQUIRE(i + 1 < argc, "tp_overlap_bench: {} needs a value", a);
    const char* v = argv[++i];
    if (a == "--hidden") hidden = std::atoll(v);
    else if (a == "--ffn") ffn = std::atoll(v);
    else if (a == "--seq") seq = std::atoll(v);
    else if (a == "--iters") iters = std::atoi(v);
    else if (a == "--layers") layers = std::atoll(v);
    else MT_FAIL("tp_overlap_bench: unknown argument {} (expected --hidden, --ffn, --seq, --iters, --layers)", a);
  }
  Device dev;
  const auto world = bench::gpu_world("tp_overlap_bench", dev);
  const int tp = world->size();
  MT_REQUIRE(seq % tp == 0 && ffn % tp == 0, "tp_overlap_bench: --seq {} and --ffn {} must divide by TP {}", seq, ffn,
             tp);
  MT_REQUIRE(iters >= 1, "tp_overlap_bench: --iters {} must be >= 1", iters);
  const bool root = world->rank() == 0;
  const TensorParallelRegion plain(world, true, false), over(world, true, true);
  const int64_t sl = seq / tp, f1 = 2 * ffn / tp, f2 = ffn / tp;
  Stream st(dev);
  auto bf16 = [&](std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return std::make_shared<Buffer>(dev, static_cast<size_t>(n) * 2);
  };
  // fc1
  const auto b_local = bf16({sl, hidden}), b_full = bf16({seq, hidden}), b_w1 = bf16({f1, hidden}),
             b_y = bf16({seq, f1});
  const Tensor local = b_local->as(DType::kBF16, {sl, 1, hidden}), full = b_full->as(DType::kBF16, {seq, 1, hidden}),
               w1 = b_w1->as(DType::kBF16, {f1, hidden}), y = b_y->as(DType::kBF16, {seq, f1});
  // fc2
  const auto b_z = bf16({seq, f2}), b_w2 = bf16({hidden, f2}), b_part = bf16({seq, hidden}),
             b_out = bf16({sl, hidden});
  const Tensor z = b_z->as(DType::kBF16, {seq, f2}), w2 = b_w2->as(DType::kBF16, {hidden, f2}),
               part = b_part->as(DType::kBF16, {seq, 1, hidden}), out = b_out->as(DType::kBF16, {sl, 1, hidden});
  bench::randomize(local, 1 + world->rank(), st);
  bench::randomize(w1, 100 + world->rank(), st, 0.02f);
  bench::randomize(z, 200 + world->rank(), st);
  bench::randomize(w2, 300 + world->rank(), st, 0.02f);
  const Tensor full2 = full.view({seq, hidden}), part2 = part.view({seq, hidden});

  const TensorParallelRegion::RowGemm gemm1 = [&](const Tensor& rows, int64_t first) {
    const int64_t n = rows.numel() / hidden;
    linear_forward(y.slice(0, first, first + n), rows.view({n, hidden}), w1, Tensor(), Tensor(), st);
  };
  const TensorParallelRegion::RowGemm gemm2 = [&](const Tensor& rows, int64_t first) {
    const int64_t n = rows.numel() / hidden;
    linear_forward(rows.view({n, hidden}), z.slice(0, first, first + n), w2, Tensor(), Tensor(), st);
  };
  Phases p1, p2;
  p1.gemm = timed(*world, st, iters, [&] {
    for (int j = 0; j < tp; ++j) gemm1(full2.slice(0, j * sl, (j + 1) * sl), j * sl);
  });
  p1.coll = timed(*world, st, iters, [&] { plain.enter_forward(full, local, st); });
  p1.plain = timed(*world, st, iters, [&] { plain.all_gather_gemm(full, local, gemm1, st); });
  p1.overlap = timed(*world, st, iters, [&] { over.all_gather_gemm(full, local, gemm1, st); });
  p2.gemm = timed(*world, st, iters, [&] {
    for (int j = 0; j < tp; ++j) gemm2(part2.slice(0, j * sl, (j + 1) * sl), j * sl);
  });
  p2.coll = timed(*world, st, iters, [&] { plain.exit_forward(out, part, st); });
  p2.plain = timed(*world, st, iters, [&] { plain.gemm_reduce_scatter(out, part, gemm2, {}, st); });
  p2.overlap = timed(*world, st, iters, [&] { over.gemm_reduce_scatter(out, part, gemm2, {}, st); });
  if (root) {
    fmt::print("TP {} + SP, one MLP's forward, bf16, b = 1, sequence {}, hidden {}, SwiGLU {} (fc1 {} columns, fc2 {} "
               "inputs per rank); ms, median of {}, max over ranks\n",
               tp, seq, hidden, ffn, f1, f2, iters);
    fmt::print("{:<24} | {:>8} {:>7} | {:>8} | {:>8} {:>8} | {:>8} {:>8} | {:>7}\n", "linear", "gemm", "TF/s", "coll",
               "plain", "exposed", "overlap", "exposed", "hidden");
    print_row("fc1: all-gather + GEMM", p1, 2.0 * seq * f1 * hidden);
    print_row("fc2: GEMM + reduce-scatter", p2, 2.0 * seq * f2 * hidden);
    if (layers > 0) {
      const double plain_ms = 4 * layers * ((p1.plain - p1.gemm) + (p2.plain - p2.gemm));
      const double over_ms = 4 * layers * ((p1.overlap - p1.gemm) + (p2.overlap - p2.gemm));
      fmt::print("estimate for {} layers (forward + backward, the attention's qkv / proj counted as fc1 / fc2): "
                 "exposed TP communication {:.1f} ms plain, {:.1f} ms with --tp-comm-overlap per micro-batch\n",
                 layers, plain_ms, over_ms);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mt::bench::run_main("tp_overlap_bench", argc, argv, bench_main); }
