// Collective bus bandwidth of our NcclCommunicator against raw NCCL calls on the same
// communicator, in the same run (the raw column is NCCL's own peak on this machine; the
// difference is our per-call overhead: argument checks and the watchdog's event record).
// bf16, sizes 1 MiB .. 512 MiB (--max-mib to change), NCCL-tests conventions:
//   size      = all_reduce: the buffer; all_gather: the gathered output; reduce_scatter: the
//               input; all_to_all: the input (= output)
//   algbw     = size / time;  busbw = algbw * 2(n-1)/n (all_reduce), algbw * (n-1)/n (others)
//   time      = mean over --iters iterations (after warm-up), max over ranks.
// A second table compares the data-parallel gradient path's collectives, copy-engine transfers
// (comm/nccl/peer_copy.h, --ddp-copy-engine) against NCCL on the same buffers: the fp32
// reduce-scatter of the gradients and the bf16 all-gather of the parameters (in place).
// Run one process per GPU:
//   mpiexec --allow-run-as-root -np 2 build/comm_bench
//   torchrun --standalone --nproc-per-node 2 --no-python build/comm_bench
#ifdef MT_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "comm/bootstrap.h"
#include "comm/nccl/nccl_communicator.h"
#include "comm/nccl/peer_copy.h"
#include "core/buffer.h"
#include "core/cuda_check.h"
#include "core/stream.h"

namespace {

using namespace mt;

#define BENCH_NCCL(call)                                                                          \
  do {                                                                                            \
    ncclResult_t r_ = (call);                                                                     \
    if (r_ != ncclSuccess) MT_FAIL("NCCL error {} in {}", ncclGetErrorString(r_), #call);         \
  } while (0)

struct Op {
  const char* name;
  double bus_factor;  // busbw / algbw
  // (size_bytes, ours?) -> enqueue one operation
  std::function<void(size_t, bool)> run;
};

int bench_main(int argc, char** argv) {
  int max_mib = 512, iters = 20;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--max-mib") == 0) max_mib = std::atoi(argv[++i]);
    else if (std::strcmp(argv[i], "--iters") == 0) iters = std::atoi(argv[++i]);
  }
  const LaunchEnv env = read_launch_env();
  if (env.world_size < 2) {
    std::fprintf(stderr,
                 "comm_bench: needs several ranks, one per GPU: mpiexec -np 2 comm_bench, or torchrun "
                 "--standalone --nproc-per-node 2 --no-python comm_bench\n");
    return 1;
  }
  auto world = init_world(Device::cuda(), env, 10.0);
  auto* nccl = dynamic_cast<NcclCommunicator*>(world.get());
  MT_CHECK(nccl != nullptr, "comm_bench: the world communicator is not NCCL");
  const Device dev = nccl->device();
  const int n = nccl->size(), me = nccl->rank();
  ncclComm_t raw = nccl->raw();
  Stream stream(dev);
  cudaStream_t cs = static_cast<cudaStream_t>(stream.cuda_stream());
  const size_t max_bytes = static_cast<size_t>(max_mib) << 20;
  Buffer in_buf(dev, max_bytes), out_buf(dev, max_bytes), t_buf(dev, sizeof(float));
  MT_CUDA_CHECK(cudaMemset(in_buf.data(), 0x3c, max_bytes));  // bf16 0x3c3c ~ 0.0115
  MT_CUDA_CHECK(cudaMemset(out_buf.data(), 0x3c, max_bytes));
  constexpr size_t kEl = 2;  // bf16
  auto bf16 = [&](void* p, size_t bytes) { return Tensor(p, DType::kBF16, dev, {static_cast<int64_t>(bytes / kEl)}); };
  char* in = static_cast<char*>(in_buf.data());
  char* out = static_cast<char*>(out_buf.data());

  const Op ops[] = {
      {"all_reduce", 2.0 * (n - 1) / n,
       [&](size_t size, bool ours) {
         if (ours) nccl->all_reduce(bf16(in, size), ReduceOp::kSum, stream);
         else BENCH_NCCL(ncclAllReduce(in, in, size / kEl, ncclBfloat16, ncclSum, raw, cs));
       }},
      {"all_gather", double(n - 1) / n,
       [&](size_t size, bool ours) {
         if (ours) nccl->all_gather(bf16(out, size), bf16(in, size / n), stream);
         else BENCH_NCCL(ncclAllGather(in, out, size / n / kEl, ncclBfloat16, raw, cs));
       }},
      {"reduce_scatter", double(n - 1) / n,
       [&](size_t size, bool ours) {
         if (ours) nccl->reduce_scatter(bf16(out, size / n), bf16(in, size), ReduceOp::kSum, stream);
         else BENCH_NCCL(ncclReduceScatter(in, out, size / n / kEl, ncclBfloat16, ncclSum, raw, cs));
       }},
      {"all_to_all", double(n - 1) / n,
       [&](size_t size, bool ours) {
         if (ours) {
           nccl->all_to_all(bf16(out, size), bf16(in, size), stream);
           return;
         }
         const size_t chunk = size / n;
         BENCH_NCCL(ncclGroupStart());
         for (int p = 0; p < n; ++p) {
           BENCH_NCCL(ncclSend(in + p * chunk, chunk / kEl, ncclBfloat16, p, raw, cs));
           BENCH_NCCL(ncclRecv(out + p * chunk, chunk / kEl, ncclBfloat16, p, raw, cs));
         }
         BENCH_NCCL(ncclGroupEnd());
       }},
  };

  Event start(dev), stop(dev);
  Tensor t_max(t_buf.data(), DType::kF32, dev, {1});
  auto time_us = [&](const Op& op, size_t size, bool ours) {
    for (int i = 0; i < 3; ++i) op.run(size, ours);
    start.record(stream);
    for (int i = 0; i < iters; ++i) op.run(size, ours);
    stop.record(stream);
    stop.synchronize();
    float us = stop.elapsed_ms_since(start) * 1000.f / iters;
    MT_CUDA_CHECK(cudaMemcpy(t_buf.data(), &us, sizeof(float), cudaMemcpyHostToDevice));
    world->all_reduce(t_max, ReduceOp::kMax, stream);  // the slowest rank's time
    MT_CUDA_CHECK(cudaMemcpyAsync(&us, t_buf.data(), sizeof(float), cudaMemcpyDeviceToHost, cs));
    stream.synchronize();
    return static_cast<double>(us);
  };

  int nccl_version = 0;
  ncclGetVersion(&nccl_version);
  if (me == 0) {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, dev.index);
    std::printf("comm_bench: %d ranks (%s launch), %s, NCCL %d, bf16, %d iterations, NCCL_NVLS_ENABLE=%s\n", n,
                launcher_name(env.launcher), prop.name, nccl_version, iters,
                std::getenv("NCCL_NVLS_ENABLE") ? std::getenv("NCCL_NVLS_ENABLE") : "unset");
    std::printf("%-15s %10s | %10s %9s %9s | %10s %9s %9s | %6s\n", "op", "size", "ours us", "algbw", "busbw",
                "raw us", "algbw", "busbw", "ours/raw");
  }
  // One table row per (op, size); sizes from 1 MiB doubling to max_bytes, multiples of `multiple`.
  // alternate: swap which path runs first every other size, so that neither always goes first.
  auto table = [&](const auto& table_ops, size_t multiple, bool alternate) {
    for (const Op& op : table_ops) {
      for (size_t size = size_t(1) << 20; size <= max_bytes; size *= 2) {
        if (size % multiple != 0) continue;
        double t_raw, t_ours;
        if (!alternate || (size >> 20) % 2 == 0) {
          t_raw = time_us(op, size, false);
          t_ours = time_us(op, size, true);
        } else {
          t_ours = time_us(op, size, true);
          t_raw = time_us(op, size, false);
        }
        if (me == 0) {
          const double alg_ours = size / (t_ours * 1e-6) / 1e9, alg_raw = size / (t_raw * 1e-6) / 1e9;
          std::printf("%-15s %7zu MiB | %10.1f %7.1f GB/s %7.1f GB/s | %10.1f %7.1f GB/s %7.1f GB/s | %6.3f\n",
                      op.name, size >> 20, t_ours, alg_ours, alg_ours * op.bus_factor, t_raw, alg_raw,
                      alg_raw * op.bus_factor, t_raw / t_ours);
          std::fflush(stdout);
        }
      }
    }
  };
  table(ops, static_cast<size_t>(n) * kEl, true);

  // Gradient path: copy engine ("ours") against NCCL ("raw"), in place on one buffer each.
  MT_CUDA_CHECK(cudaMemset(in_buf.data(), 0, max_bytes));
  if (me == 0) std::printf("gradient path: copy engine (ours) vs NCCL (raw), in place\n");
  std::string why;
  auto ce = PeerCopyGroup::create(std::dynamic_pointer_cast<NcclCommunicator>(world),
                                  {{in_buf.data(), max_bytes}, {out_buf.data(), max_bytes}}, size_t{4} << 20, &why);
  if (!ce) {
    if (me == 0) std::printf("copy-engine collectives unavailable: %s\n", why.c_str());
    return 0;
  }
  const Op grad_ops[] = {
      {"rs_f32_ce/nccl", double(n - 1) / n,
       [&](size_t size, bool ours) {
         const size_t m = size / 4 / n;
         if (ours) ce->reduce_scatter_sum_f32(0, 0, m, stream);
         else BENCH_NCCL(ncclReduceScatter(in, in + me * m * 4, m, ncclFloat32, ncclSum, raw, cs));
       }},
      {"ag_bf16_ce/nccl", double(n - 1) / n,
       [&](size_t size, bool ours) {
         const size_t chunk = size / n;
         if (ours) ce->all_gather(1, 0, chunk, stream);
         else BENCH_NCCL(ncclAllGather(out + me * chunk, out, chunk / kEl, ncclBfloat16, raw, cs));
       }},
  };
  table(grad_ops, static_cast<size_t>(n) * 256, false);
  stream.synchronize();  // the group is destroyed next: nothing of it may still run
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return bench_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm_bench: %s\n", e.what());
    return 1;
  }
}
#else
#include <cstdio>
int main() {
  std::printf("comm_bench: this build has no NCCL (configure with CUDA and NCCL to build the benchmark)\n");
  return 0;
}
#endif
