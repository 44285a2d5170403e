// Multi-latent attention's packing copies (ops/mla.h, docs/mla.md) at DeepSeek-V3's head dims
// (d_n 128, d_r 64, d_v 128, packed D 192), bf16 on cuda:0:
//   build/mla_pack_bench [--iters 50] [--tokens 4096,8192] [--heads 16,128]
// per access width of the kernels (ops/cuda/mla_widths.h: 16 bytes is what the ops run; 2 bytes
// is one element per thread, the access pattern of the kernels before they were vectorised —
// which also paid four 64-bit divisions per element: 208 / 91 / 23 / 33 us by ncu at 4096 tokens
// and 16 heads on an H200, 2026-11-29): mla_qkv_pack, mla_qkv_unpack_grad (with the dk_pe head
// sum), mla_context_unpack (context -> out) and its padded reverse (out -> context), in us and
// effective GB/s = the bytes an op must read and write (the channels it uses; padding channels
// written, not read) / time, beside a device-to-device copy of the packed qkv's bytes (read +
// written) as the attainable bandwidth. Times: median over --iters of CUDA events around one
// call, after 3 warm-up calls.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bench_util.h"
#include "core/buffer.h"
#include "core/device.h"
#include "core/stream.h"
#include "ops/cuda/mla_widths.h"
#include "ops/elementwise.h"
#include "ops/mla.h"

namespace {

using namespace mt;
using bench::parse_list;
using bench::time_ms;

constexpr int64_t kDn = 128, kDr = 64, kDv = 128, kD = 192;  // DeepSeek-V3

/// One shape's tensors: the forward's inputs and packed qkv, the backward's gradients, the context.
struct Tensors {
  Buffer bq, bkv, bkpe, bqkv, bctx, bout;
  Tensor q, kv, k_pe, qkv, ctx, out;
  Tensors(int64_t T, int64_t n, Device dev, const Stream& st)
      : bq(dev, static_cast<size_t>(T * n * (kDn + kDr)) * 2),
        bkv(dev, static_cast<size_t>(T * n * (kDn + kDv)) * 2),
        bkpe(dev, static_cast<size_t>(T * kDr) * 2),
        bqkv(dev, static_cast<size_t>(T * n * 3 * kD) * 2),
        bctx(dev, static_cast<size_t>(T * n * kD) * 2),
        bout(dev, static_cast<size_t>(T * n * kDv) * 2) {
    q = bq.as(DType::kBF16, {T, n, kDn + kDr});
    kv = bkv.as(DType::kBF16, {T, n, kDn + kDv});
    k_pe = bkpe.as(DType::kBF16, {T, kDr});
    qkv = bqkv.as(DType::kBF16, {T, n, 3, kD});
    ctx = bctx.as(DType::kBF16, {T, n * kD});
    out = bout.as(DType::kBF16, {T, n * kDv});
    for (const Tensor* t : {&q, &kv, &k_pe, &qkv, &ctx, &out}) fill(*t, 0.5f, st);
  }
};

int bench_main(int argc, char** argv) {
  int iters = 50;
  std::vector<int64_t> tokens{4096}, heads{16};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--iters") iters = std::atoi(v);
    else if (a == "--tokens") tokens = parse_list(v);
    else if (a == "--heads") heads = parse_list(v);
    else MT_FAIL("mla_pack_bench: unknown argument {} (expected --iters, --tokens, --heads)", a);
  }
  MT_CHECK(iters > 0, "mla_pack_bench: --iters {} must be positive", iters);
  MT_CHECK(cuda_available(), "mla_pack_bench needs a CUDA device");
  const Device dev = Device::cuda(0);
  Stream st(dev);
  fmt::print("MLA packing copies, bf16, d_n {} d_r {} d_v {} D {}: us (effective GB/s)\n", kDn, kDr, kDv, kD);
  fmt::print("{:>6} {:>5} {:>6} | {:>16} {:>16} {:>16} {:>16} | {:>16}\n", "tokens", "heads", "width", "pack",
             "unpack_grad", "context", "context pad", "d2d copy");
  for (const int64_t T : tokens) {
    for (const int64_t n : heads) {
      Tensors x(T, n, dev, st);
      const double e = 2.0;  // bytes per element
      const double tn = static_cast<double>(T * n);
      // bytes each op must move: read + written
      const double b_pack = e * (tn * (kDn + kDr) + tn * (kDn + kDv) + T * kDr + tn * 3 * kD);
      const double b_unpack = e * (tn * (2 * kDn + 2 * kDr + kDv) + tn * (kDn + kDr) + tn * (kDn + kDv) + T * kDr);
      const double b_ctx = e * 2 * tn * kDv, b_pad = e * tn * (kDv + kD);
      const size_t copy_bytes_n = static_cast<size_t>(x.qkv.numel()) * 2;
      Buffer scratch(dev, copy_bytes_n);
      const double copy_ms = time_ms(st, iters, [&] {
        copy_bytes(scratch.data(), dev, x.qkv.data(), dev, copy_bytes_n, st);
      });
      auto cell = [](double ms, double bytes) { return fmt::format("{:7.1f} ({:5.0f})", ms * 1e3, bytes * 1e-6 / ms); };
      for (int width : {16, 8, 4, 2}) {
        const double pack = time_ms(st, iters, [&] { cuda::mla_qkv_pack(x.qkv, x.q, x.kv, x.k_pe, st, width); });
        const double unpack =
            time_ms(st, iters, [&] { cuda::mla_qkv_unpack_grad(x.q, x.kv, x.k_pe, x.qkv, st, width); });
        const double ctx = time_ms(st, iters, [&] { cuda::mla_context_unpack(x.out, x.ctx, n, false, st, width); });
        const double pad = time_ms(st, iters, [&] { cuda::mla_context_unpack(x.out, x.ctx, n, true, st, width); });
        fmt::print("{:>6} {:>5} {:>6} | {:>16} {:>16} {:>16} {:>16} | {:>16}\n", T, n, fmt::format("{} B", width),
                   cell(pack, b_pack), cell(unpack, b_unpack), cell(ctx, b_ctx), cell(pad, b_pad),
                   cell(copy_ms, 2.0 * static_cast<double>(copy_bytes_n)));
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mt::bench::run_main("mla_pack_bench", argc, argv, bench_main); }
