// GradSync on 2 GPUs over NCCL (mpiexec -np 2, one rank per GPU): with --overlap-grad-reduce
// (bucket reductions on the communication stream while the "backward" keeps enqueuing work) and
// --overlap-param-gather (all-gathers waited for by params_needed), parameters, snapshots of
// what each "forward" read, and the gathered fp32 main parameters are bitwise identical to the
// non-overlapped run, for fp32 and bf16, with and without the distributed optimizer; and they
// match one GPU stepping on the summed gradients (rel 1e-6). The backward is asynchronous: its
// gradient accumulations are device adds enqueued on the compute stream right before each
// grads_ready, so a missing event wait shows up as a race (likely, not certainly).
// The copy-engine collectives (--ddp-copy-engine) give the same bits as NCCL, with and without
// overlap: with two ranks the rank-order sum x_0 + x_1 equals NCCL's (addition commutes), also
// with --grad-reduce-in-bf16.
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <mpi.h>

#include <cstdlib>
#include <random>
#include <string>

#include "comm/bootstrap.h"
#include "ops/elementwise.h"
#include "optim/ddp_test_util.h"
#include "optim/optimizer.h"

namespace mt {
namespace {

using ddp_test::Model;
using ddp_test::opt_config;
using testing::OwnedTensor;

constexpr int kSteps = 4;

struct Out {
  std::vector<float> params, main;  // params as floats of the model dtype
  std::vector<std::vector<float>> snapshots;  // per step: the parameters the forward read
  bool copy_engine = false;                   // GradSync set up the copy-engine group
  size_t ce_collectives = 0;                  // collectives it ran by copy engine
  size_t buckets = 0;
  std::string why_not;
};

// This rank's gradients of every step, laid out like P (flat [total], padding zero), on the
// device. rank < 0: the sum over `ranks` ranks (the single-GPU reference).
std::vector<OwnedTensor> step_grads(const ParamStore& P, int rank, int ranks, const Stream& st) {
  std::vector<OwnedTensor> out;
  for (int s = 0; s < kSteps; ++s) {
    std::vector<float> flat(static_cast<size_t>(P.total_elements()), 0.f);
    for (size_t i = 0; i < P.size(); ++i) {
      const auto g = ddp_test::local_grad(P, i, s, rank, ranks);
      std::copy(g.begin(), g.end(), flat.begin() + P.info(i).offset);
    }
    out.push_back(testing::make_tensor(flat, DType::kF32, P.device(), {P.total_elements()}, st));
  }
  return out;
}

Out run(const Model& m, std::shared_ptr<Communicator> dp, int rank, int ranks, DType dtype, bool distributed,
        bool overlap, Device dev, bool copy_engine = false, bool bf16_reduce = false) {
  Stream st(dev);
  ParamStore P(m.specs, dtype, dev, ParamLayout{2, 700});
  DdpConfig dc;
  dc.overlap_grad_reduce = overlap;
  dc.use_distributed_optimizer = distributed;
  dc.overlap_param_gather = overlap && distributed;
  dc.copy_engine = copy_engine;
  dc.grad_reduce_in_bf16 = bf16_reduce;
  GradSync sync(P, dp, dc);
  AdamWOptimizer opt(sync, opt_config(), st);
  P.initialize(99, st);
  const std::vector<OwnedTensor> grads = step_grads(P, rank, ranks, st);
  std::vector<OwnedTensor> snaps;
  for (int s = 0; s < kSteps; ++s) {
    snaps.emplace_back(dtype, dev, std::vector<int64_t>{P.total_elements()});
    memset_tensor(snaps.back().t, 0, st);  // the padding between layers is never copied into
  }
  st.synchronize();
  for (int s = 0; s < kSteps; ++s) {
    sync.zero_grad_buffer(st);
    // Forward: wait for a layer's parameters, then read them (copy into this step's snapshot).
    for (const auto& l : m.layers) {
      sync.params_needed(l.first, l.end, st);
      const int64_t b = P.info(l.first).offset;
      const int64_t e = P.info(l.end - 1).offset + P.info(l.end - 1).numel;
      copy(snaps[s].t.flat_range(b, e - b), P.params_flat().flat_range(b, e - b), st);
    }
    // Backward: per layer, last to first, accumulate (async device adds) then report.
    for (size_t k = m.layers.size(); k-- > 0;) {
      for (size_t i = m.layers[k].first; i < m.layers[k].end; ++i) {
        const ParamInfo& p = P.info(i);
        const Tensor g = P.grads_flat().flat_range(p.offset, p.numel);
        add(g, g, grads[s].t.flat_range(p.offset, p.numel), st);
        for (int rep = 0; rep < 4; ++rep) scale_inplace(g, 1.f, st);  // more queued work, exact
      }
      sync.grads_ready(m.layers[k].first, m.layers[k].end, st);
    }
    opt.step(1e-2f, st);
  }
  sync.finish_param_sync(st);
  Out o;
  o.copy_engine = sync.copy_engine_active();
  o.why_not = sync.why_not_copy_engine();
  o.ce_collectives = sync.copy_engine_collectives();
  o.buckets = P.buckets().size();
  o.params = testing::to_host(P.params_flat(), st);
  OwnedTensor full(DType::kF32, dev, {P.total_elements()});
  opt.gather_main(full, st);
  o.main = testing::to_host(full.t, st);
  for (auto& sn : snaps) o.snapshots.push_back(testing::to_host(sn.t, st));
  return o;
}

TEST(GradSyncNccl, OverlapMatchesNoOverlapBitwise) {
  MT_REQUIRE_CUDA();
  const LaunchEnv env = read_launch_env();
  if (env.world_size != 2 || env.launcher != LaunchEnv::kMpirun) GTEST_SKIP() << "run under mpiexec -np 2";
  int gpus = 0;
  cudaGetDeviceCount(&gpus);
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  const Device dev = local_device(DeviceType::kCUDA, env);
  set_current_device(dev);
  auto world = init_world(dev, env, 5.0);
  // One test seed for both ranks (the gradients are keyed by it).
  uint64_t seed = std::random_device{}();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  setenv("MT_TEST_SEED", std::to_string(seed).c_str(), 1);
  ASSERT_EQ(testing::test_seed(), seed);
  const Model m = ddp_test::gpt_like(8);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (bool dist : {false, true}) {
      const std::string what = std::string(dtype_name(dt)) + (dist ? " distopt" : " allreduce");
      const Out off = run(m, world, world->rank(), 2, dt, dist, false, dev);
      const Out on = run(m, world, world->rank(), 2, dt, dist, true, dev);
      EXPECT_EQ(on.params, off.params) << what;
      EXPECT_EQ(on.main, off.main) << what;
      for (int s = 0; s < kSteps; ++s) EXPECT_EQ(on.snapshots[s], off.snapshots[s]) << what << " step " << s;
      for (bool ov : {false, true}) {
        const Out ce = run(m, world, world->rank(), 2, dt, dist, ov, dev, /*copy_engine=*/true);
        EXPECT_TRUE(ce.copy_engine) << what << ": copy engine not used: " << ce.why_not;
        // Without overlap every collective is exposed and runs on NCCL; with overlap all but the
        // last reduction of each step (and its first parameter all-gather) use the copy engine.
        const size_t per_step = (ce.buckets - 1) * (dist ? 2 : 1);
        EXPECT_EQ(ce.ce_collectives, ov ? kSteps * per_step : 0) << what << " overlap " << ov << ", "
                                                                 << ce.buckets << " buckets";
        EXPECT_EQ(ce.params, off.params) << what << " copy engine, overlap " << ov;
        EXPECT_EQ(ce.main, off.main) << what << " copy engine, overlap " << ov;
        for (int s = 0; s < kSteps; ++s)
          EXPECT_EQ(ce.snapshots[s], off.snapshots[s]) << what << " copy engine, overlap " << ov << " step " << s;
      }
      // --grad-reduce-in-bf16: NCCL's bf16 sum of two values is bf16(float(a) + float(b)), as the
      // copy engine's rank-order sum.
      const Out nb = run(m, world, world->rank(), 2, dt, dist, false, dev, false, /*bf16_reduce=*/true);
      for (bool ov : {false, true}) {
        const Out cb = run(m, world, world->rank(), 2, dt, dist, ov, dev, true, /*bf16_reduce=*/true);
        EXPECT_TRUE(cb.copy_engine) << what << ": copy engine not used with bf16 reduction: " << cb.why_not;
        EXPECT_EQ(cb.params, nb.params) << what << " bf16 reduction, copy engine, overlap " << ov;
        EXPECT_EQ(cb.main, nb.main) << what << " bf16 reduction, copy engine, overlap " << ov;
      }
      const Out ref = run(m, std::make_shared<SingleRankCommunicator>("dp"), -1, 2, dt, false, false, dev);
      EXPECT_LT(testing::rel_err(nb.main, ref.main), 1e-2) << what << " bf16 reduction";
      EXPECT_LT(testing::rel_err(on.main, ref.main), 1e-6) << what;
      std::printf("[%s] rank %d: main params rel err vs one GPU %.2e\n", what.c_str(), world->rank(),
                  testing::rel_err(on.main, ref.main));
    }
  }
}

}  // namespace
}  // namespace mt
