// Pipeline bubble: measured against the theory. One process per rank (world = tp · pp):
//   mpiexec --allow-run-as-root -np 4 build/pipeline_bench --pp 4 [--tp 1] [--num-layers 32 ...]
// For each (vpp, m) it times the pipelined forward+backward of one step (PipelineExecutor::run,
// 1F1B or interleaved, batched p2p; no optimizer) and the ideal step: the same rank running the
// forwards and backwards of its chunks for the m micro-batches with no communication and no
// waiting (max over ranks). Bubble = step / ideal − 1, to compare with (pp − 1) / (m · vpp)
// (Narayanan et al. 2021, arXiv:2104.04473 §2.2). bf16 on CUDA, fp32 on CPU. Times are medians of
// --iters steps after 2 warm-up steps; every rank's step ends with a device sync and a barrier.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bench_util.h"
#include "comm/bootstrap.h"
#include "model/gpt_model.h"
#include "core/device.h"
#include "ops/elementwise.h"
#include "parallel/parallel_config.h"
#include "parallel/pipeline/layer_split.h"
#include "parallel/process_groups.h"
#include "train/pipeline.h"

namespace {

using namespace mt;
using bench::median;

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int bench_main(int argc, char** argv) {
  int tp = 1, pp = 0, iters = 5;
  TransformerConfig c;
  c.num_layers = 32;
  c.hidden_size = 4096;
  c.num_attention_heads = 32;
  c.seq_length = 2048;
  c.vocab_size = 50257;
  c.hidden_dropout = c.attention_dropout = 0.f;
  int64_t mb = 1;
  std::vector<int> ms = {4, 8, 16}, vpps = {1, 2};
  auto list = [](const char* s) {
    std::vector<int> v;
    for (const char* p = s; *p;) {
      v.push_back(std::atoi(p));
      while (*p && *p != ',') ++p;
      if (*p == ',') ++p;
    }
    return v;
  };
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--tp") tp = std::atoi(v);
    else if (a == "--pp") pp = std::atoi(v);
    else if (a == "--iters") iters = std::atoi(v);
    else if (a == "--num-layers") c.num_layers = std::atoi(v);
    else if (a == "--hidden-size") c.hidden_size = std::atoi(v);
    else if (a == "--num-attention-heads") c.num_attention_heads = std::atoi(v);
    else if (a == "--seq-length") c.seq_length = std::atoi(v);
    else if (a == "--micro-batch-size") mb = std::atoi(v);
    else if (a == "--microbatches") ms = list(v);
    else if (a == "--vpp") vpps = list(v);
    else MT_FAIL("pipeline_bench: unknown argument {}", a);
  }
  c.max_position_embeddings = c.seq_length;
  const LaunchEnv env = read_launch_env();
  const Device device = cuda_available() ? local_device(DeviceType::kCUDA, env) : Device::cpu();
  set_current_device(device);
  const DType dtype = device.is_cuda() ? DType::kBF16 : DType::kF32;
  auto world = init_world(device, env, 10.0);
  if (pp == 0) pp = world->size() / tp;
  for (const int vpp : vpps) {
    for (const int m : ms) {
      ParallelConfig pc;
      pc.tp = tp;
      pc.pp = pp;
      pc.vpp = vpp;
      validate_and_derive(pc, world->size());
      const ProcessGroups g = build_process_groups(world, pc);
      pipeline::PipelineLayout layout;
      layout.num_layers = c.num_layers;
      layout.pp = pp;
      layout.vpp = vpp;
      const int r = g.pp->rank();
      const auto chunks = pipeline::layers_of(r, layout);
      pipeline::ScheduleConfig sc;
      sc.pp = pp;
      sc.vpp = vpp;
      sc.num_microbatches = m;
      const PipelinePlan plan = plan_pipeline(sc, r, chunks);
      Stream st(device);
      GPTModel model(c, mb, dtype, device, g, tp > 1, 1, model_layout(chunks, {&plan}));
      PipelineExecutor exec(model, g.pp, {&plan});
      model.params().initialize(1234, st);
      const int64_t S = c.seq_length;
      Buffer data(device, static_cast<size_t>(2 * S * mb) * 4);
      const Tensor tok(data.data(), DType::kI32, device, {S, mb});
      const Tensor lab(static_cast<char*>(data.data()) + S * mb * 4, DType::kI32, device, {S, mb});
      memset_tensor(tok, 0, st);  // token 0 everywhere: timing does not depend on the ids
      memset_tensor(lab, 0, st);
      std::vector<MicroBatch> mbs(static_cast<size_t>(m), MicroBatch{tok, lab, Tensor()});
      for (auto& b : mbs) b.loss_weight = 1.f / static_cast<float>(S * mb * m);
      Buffer loss_buf(device, 4);
      const Tensor loss = loss_buf.as(DType::kF32, {1});
      // Pipelined step.
      std::vector<double> step, ideal;
      for (int it = 0; it < iters + 2; ++it) {
        world->barrier();
        const double t0 = now_ms();
        exec.run(plan, mbs, {1, it, 0, 1, true}, loss, 1.f, Tensor(), st);
        st.synchronize();
        world->barrier();
        if (it >= 2) step.push_back(now_ms() - t0);
      }
      // Ideal: this rank's compute alone (forward then backward of every chunk, m times).
      std::vector<double> mine;
      const std::vector<int64_t> shape = model.boundary_shape();
      Buffer gbuf(device, static_cast<size_t>(shape[0] * shape[1] * shape[2]) * dtype_size(dtype));
      const Tensor grad = gbuf.as(dtype, shape);
      memset_tensor(grad, 0, st);
      for (int it = 0; it < iters + 2; ++it) {
        st.synchronize();
        const double t0 = now_ms();
        for (int k = 0; k < m; ++k)
          for (int ch = 0; ch < model.num_chunks(); ++ch) {
            const DropoutContext dc{1, 0, static_cast<uint32_t>(k), true};
            const bool emb_and_loss = model.chunk(ch).layers.has_embedding && model.chunk(ch).layers.has_loss;
            model.forward_chunk(ch, ChunkBuffers{}, mbs[0], dc, loss, mbs[0].loss_weight, st, false);
            model.backward_chunk(ch, ChunkBuffers{}, mbs[0], dc, emb_and_loss ? Tensor() : grad, mbs[0].loss_weight,
                                 Tensor(), st, false);
          }
        st.synchronize();
        if (it >= 2) mine.push_back(now_ms() - t0);
      }
      double me = median(mine);
      // Gather each rank's ideal time on rank 0 via a device all-reduce of one-hot vectors.
      Buffer dev(device, 4 * world->size());
      std::vector<float> host(world->size(), 0.f);
      host[world->rank()] = static_cast<float>(me);
      copy_bytes(dev.data(), device, host.data(), Device::cpu(), host.size() * 4, st);
      world->all_reduce(dev.as(DType::kF32, {world->size()}), ReduceOp::kSum, st);
      copy_bytes(host.data(), Device::cpu(), dev.data(), device, host.size() * 4, st);
      st.synchronize();
      const double ideal_ms = *std::max_element(host.begin(), host.end());
      const double step_ms = median(step);
      if (world->rank() == 0)
        fmt::print("pp {} vpp {} tp {} m {:2d}: step {:8.1f} ms  ideal {:8.1f} ms  bubble {:5.1f}%  theory {:5.1f}%  "
                   "activation slots rank0 {}  (layers {} h {} s {} mb {}, {})\n",
                   pp, vpp, tp, m, step_ms, ideal_ms, 100.0 * (step_ms / ideal_ms - 1.0),
                   100.0 * pipeline::bubble_fraction(pp, vpp, m), plan.activation_slots, c.num_layers,
                   c.hidden_size, S, mb, dtype_name(dtype));
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mt::bench::run_main("pipeline_bench", argc, argv, bench_main); }
