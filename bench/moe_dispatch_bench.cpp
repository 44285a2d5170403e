// The MoE token dispatchers' exchanges against NCCL's all-to-all on the same GPUs (issue 39 item 2:
// "measure the dispatch/combine bandwidth against NCCL's all-to-all bus bandwidth"). One process
// per GPU, EP = the number of ranks (expert TP 1), bf16 tokens [T, h] per rank routed uniformly at
// random over E experts, top-k; identity experts (the combine sends back the rows it received).
// For each dispatcher variant the device time (max over ranks, median of --iters) of
//   dispatch  preprocess (permutation 1, count exchange) + dispatch (host read of the split sizes,
//             EP all-to-all, permutation 2)
//   combine   permutation 2 undone, EP all-to-all back, the weighted sum per token
//   backward  combine_backward + dispatch_backward (the same exchanges the other way)
// and the bus bandwidth of its exchanges: the bytes of the rows this rank sends to other ranks per
// second (NCCL-tests' busbw convention of an all-to-all: algbw · (n−1)/n, i.e. the off-rank bytes),
// beside NCCL's own all-to-all of a buffer of T·k·h elements per rank (the send rows) on the same
// communicator ("nccl a2a" row). Variants: alltoall (dropless, host split sizes), + --moe-permute-
// fusion, + 4 chunks (the exchange of --overlap-moe-expert-parallel-comm, here without experts to
// hide behind), the static blocks of --moe-received-token-capacity (capacity: every slot fits), and
// the allgather dispatcher (it moves every token of the group, whatever k: its busbw counts the
// gathered bytes).
//   mpiexec --allow-run-as-root -np 2 build/moe_dispatch_bench --tokens 8192 --hidden 4096 --experts 8 --topk 2
#ifdef MT_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_dist.h"
#include "bench_util.h"
#include "comm/bootstrap.h"
#include "comm/nccl/nccl_communicator.h"
#include "core/buffer.h"
#include "core/cuda_check.h"
#include "model/moe/alltoall_dispatcher.h"
#include "model/moe/token_dispatcher.h"

namespace {

using namespace mt;

struct Options {
  int64_t tokens = 8192, hidden = 4096, experts = 8, topk = 2;
  int iters = 20;
};

struct Variant {
  std::string name;
  MoeDispatcher kind = MoeDispatcher::kAllToAll;
  int64_t chunks = 1;
  bool fusion = false;
  bool capacity = false;  // static blocks
};

// The rows this rank sends to other EP ranks (from its routing), the off-rank bytes of a dispatch.
int64_t off_rank_rows(const std::vector<int32_t>& top, int64_t local_experts, int me) {
  int64_t n = 0;
  for (int32_t e : top) n += e / local_experts != me ? 1 : 0;
  return n;
}

int bench_main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--tokens") == 0) o.tokens = std::atoll(argv[++i]);
    else if (std::strcmp(argv[i], "--hidden") == 0) o.hidden = std::atoll(argv[++i]);
    else if (std::strcmp(argv[i], "--experts") == 0) o.experts = std::atoll(argv[++i]);
    else if (std::strcmp(argv[i], "--topk") == 0) o.topk = std::atoll(argv[++i]);
    else if (std::strcmp(argv[i], "--iters") == 0) o.iters = std::atoi(argv[++i]);
  }
  Device dev;
  const auto world = bench::gpu_world("moe_dispatch_bench", dev);
  auto* nccl = dynamic_cast<NcclCommunicator*>(world.get());
  MT_REQUIRE(nccl != nullptr, "moe_dispatch_bench: the world communicator is not NCCL");
  const int P = world->size(), me = world->rank();
  MT_REQUIRE(o.experts % P == 0 && o.topk >= 1 && o.topk <= o.experts,
             "moe_dispatch_bench: --experts {} must be a multiple of the {} ranks and --topk {} in [1, experts]",
             o.experts, P, o.topk);
  const int64_t T = o.tokens, h = o.hidden, E = o.experts, k = o.topk, L = E / P;
  Stream st(dev);
  // routing: k distinct experts per token, uniform (each rank its own draw)
  std::mt19937 rng(1234 + me);
  std::vector<int32_t> top(static_cast<size_t>(T * k));
  std::vector<float> probs(top.size(), 1.f / static_cast<float>(k));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) perm[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    for (int64_t j = 0; j < k; ++j) {
      std::swap(perm[static_cast<size_t>(j)], perm[static_cast<size_t>(j + rng() % (E - j))]);
      top[static_cast<size_t>(t * k + j)] = perm[static_cast<size_t>(j)];
    }
  }
  const double elt = 2.0;  // bf16
  const double off_bytes = static_cast<double>(off_rank_rows(top, L, me)) * h * elt;
  // the slowest rank's milliseconds
  Buffer t_buf(dev, sizeof(float));
  const Tensor t_max(t_buf.data(), DType::kF32, dev, {1});
  auto slowest = [&](double ms) {
    float v = static_cast<float>(ms);
    MT_CUDA_CHECK(cudaMemcpy(t_buf.data(), &v, sizeof(float), cudaMemcpyHostToDevice));
    world->all_reduce(t_max, ReduceOp::kMax, st);
    MT_CUDA_CHECK(cudaMemcpy(&v, t_buf.data(), sizeof(float), cudaMemcpyDeviceToHost));
    return static_cast<double>(v);
  };
  if (me == 0) {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, dev.index);
    std::printf("moe_dispatch_bench: %d ranks (EP %d), %s, T %lld tokens/rank, h %lld, E %lld, top-%lld, bf16, "
                "median of %d\n",
                P, P, prop.name, static_cast<long long>(T), static_cast<long long>(h), static_cast<long long>(E),
                static_cast<long long>(k), o.iters);
    std::printf("%-26s | %9s %9s | %9s %9s | %9s %9s\n", "variant", "disp ms", "busbw", "comb ms", "busbw", "bwd ms",
                "busbw");
  }
  auto row = [&](const std::string& name, double d, double c, double b, double bytes_d, double bytes_b) {
    if (me != 0) return;
    auto bw = [](double bytes, double ms) { return ms > 0 ? bytes / (ms * 1e-3) / 1e9 : 0.0; };
    std::printf("%-26s | %9.3f %4.0f GB/s | %9.3f %4.0f GB/s | %9.3f %4.0f GB/s\n", name.c_str(), d, bw(bytes_d, d), c,
                bw(bytes_d, c), b, bw(bytes_b, b));
    std::fflush(stdout);
  };

  // NCCL's all-to-all of the send rows' size (equal splits), on the same communicator
  {
    const int64_t n = T * k * h / P * P;
    Buffer in(dev, static_cast<size_t>(n) * 2), out(dev, static_cast<size_t>(n) * 2);
    MT_CUDA_CHECK(cudaMemset(in.data(), 0x3c, static_cast<size_t>(n) * 2));
    const Tensor ti(in.data(), DType::kBF16, dev, {n}), to(out.data(), DType::kBF16, dev, {n});
    const double ms = slowest(bench::time_ms(st, o.iters, [&] { world->all_to_all(to, ti, st); }));
    const double bus = static_cast<double>(n) * elt * (P - 1) / P;
    row("nccl a2a (same bytes)", ms, ms, 2 * ms, bus, 2 * bus);
  }

  const std::vector<Variant> variants = {
      {"alltoall", MoeDispatcher::kAllToAll, 1, false, false},
      {"alltoall +permute-fusion", MoeDispatcher::kAllToAll, 1, true, false},
      {"alltoall 4 chunks", MoeDispatcher::kAllToAll, 4, false, false},
      {"alltoall 4 chunks +fusion", MoeDispatcher::kAllToAll, 4, true, false},
      {"alltoall static blocks", MoeDispatcher::kAllToAll, 1, false, true},
      {"allgather", MoeDispatcher::kAllGather, 1, false, false},
  };
  for (const Variant& v : variants) {
    ExpertParallel ep;
    ep.ep_size = P;
    ep.ep_rank = me;
    ep.dispatch = world;
    ep.ep_group = world;
    MoeDispatchSizes sizes{E, k, L, me * L, /*device_counts=*/v.capacity, 0, v.capacity ? P * T * k : 0};
    sizes.chunks = v.chunks;
    sizes.permute_fusion = v.fusion;
    std::unique_ptr<MoeTokenDispatcher> disp = make_moe_token_dispatcher(v.kind, ep, sizes);
    BufferPlanner planner(dev, DType::kBF16);
    int64_t R_max = 0;
    for (int pass = 0; pass < 2; ++pass) {
      planner.begin_pass();
      planner.open_area(BufferPlanner::Family::kActivations, 0);
      R_max = disp->plan(planner, T, h);
      planner.close_area();
      if (pass == 0) planner.materialize();
    }
    MT_CUDA_CHECK(cudaMemcpy(disp->top(0).data(), top.data(), top.size() * 4, cudaMemcpyHostToDevice));
    MT_CUDA_CHECK(cudaMemcpy(disp->probs(0).data(), probs.data(), probs.size() * 4, cudaMemcpyHostToDevice));
    Buffer bx(dev, static_cast<size_t>(T * h) * 2), by(dev, static_cast<size_t>(T * h) * 2);
    Buffer bxp(dev, static_cast<size_t>(R_max * h) * 2), bdo(dev, static_cast<size_t>(R_max * h) * 2);
    Buffer bdp(dev, static_cast<size_t>(T * k) * 4);
    MT_CUDA_CHECK(cudaMemset(bx.data(), 0x3c, static_cast<size_t>(T * h) * 2));
    MT_CUDA_CHECK(cudaMemset(bxp.data(), 0, static_cast<size_t>(R_max * h) * 2));
    const Tensor x(bx.data(), DType::kBF16, dev, {T, h}), y(by.data(), DType::kBF16, dev, {T, h});
    const Tensor xp(bxp.data(), DType::kBF16, dev, {R_max, h}), d_out(bdo.data(), DType::kBF16, dev, {R_max, h});
    const Tensor d_probs(bdp.data(), DType::kF32, dev, {T, k});
    MoeExpertCounts counts;
    const double d = slowest(bench::time_ms(st, o.iters, [&] {
      disp->preprocess(x, 0, st);
      counts = disp->dispatch(xp, x, 0, st);
    }));
    // identity experts: the rows received are the outputs; the output gradients come back into xp
    const double c = slowest(bench::time_ms(st, o.iters, [&] { disp->combine(y, xp, 0, st); }));
    const double b = slowest(bench::time_ms(st, o.iters, [&] {
      disp->combine_backward(d_out, d_probs, y, xp, 0, st);
      disp->dispatch_backward(x, d_out, 0, st);
      disp->preprocess_backward(x, 0, st);
    }));
    // allgather: every rank receives all other ranks' T tokens (and returns as much)
    const double bytes = v.kind == MoeDispatcher::kAllGather ? static_cast<double>(P - 1) * T * h * elt : off_bytes;
    row(v.name, d, c, b, bytes, 2 * bytes);
  }
  st.synchronize();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mt::bench::run_main("moe_dispatch_bench", argc, argv, bench_main); }
#else
#include <cstdio>
int main() {
  std::printf("moe_dispatch_bench: this build has no NCCL (configure with CUDA and NCCL to build the benchmark)\n");
  return 0;
}
#endif
