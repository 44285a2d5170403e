// Shared scaffolding of the multi-GPU benches (mpiexec, one rank per GPU: cp_ring_bench,
// tp_overlap_bench, moe_dispatch_bench): the world, random bf16 inputs, a host value's max over the
// ranks, and bench::time_ms's median taken as the slowest rank's.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>

#include "bench_util.h"
#include "comm/bootstrap.h"
#include "comm/communicator.h"
#include "core/buffer.h"
#include "core/check.h"
#include "core/device.h"
#include "ops/elementwise.h"
#include "ops/init.h"

namespace mt::bench {

/// The mpiexec world of `bench` (one rank per GPU, the current device set to this rank's):
/// an error naming the bench when it runs on fewer than two ranks.
inline std::shared_ptr<Communicator> gpu_world(const char* bench, Device& dev) {
  const LaunchEnv env = read_launch_env();
  MT_REQUIRE(env.world_size >= 2, "{} needs several ranks, one per GPU: mpiexec --allow-run-as-root -np 2 build/{}",
             bench, bench);
  dev = local_device(DeviceType::kCUDA, env);
  set_current_device(dev);
  return init_world(dev, env, 10.0);
}

/// t (bf16 or any act dtype) <- N(0, scale²) values seeded by id (the same on every rank for the
/// same id); synchronises `st`.
inline void randomize(const Tensor& t, uint32_t id, const Stream& st, float scale = 1.f) {
  Buffer tmp(t.device(), static_cast<size_t>(t.numel()) * 4);
  const Tensor f = tmp.as(DType::kF32, {t.numel()});
  init_normal(f, scale, 20261128, id, ShardBox::whole({t.numel()}), st);
  cast(t.view({t.numel()}), f, st);
  st.synchronize();
}

/// The max over the ranks of `world` of a host value.
inline float max_over(Communicator& world, float v, const Stream& st) {
  Buffer b(st.device(), sizeof(float));
  const Tensor t = b.as(DType::kF32, {1});
  copy_bytes(t.data(), t.device(), &v, Device::cpu(), sizeof(float), st);
  world.all_reduce(t, ReduceOp::kMax, st);
  float out = 0;
  copy_bytes(&out, Device::cpu(), t.data(), t.device(), sizeof(float), st);
  st.synchronize();
  return out;
}

/// time_ms (median of iters runs after 3 warm-ups) of f() on `st`, the max over the ranks.
template <typename F>
double timed(Communicator& world, const Stream& st, int iters, F&& f) {
  return max_over(world, static_cast<float>(time_ms(st, iters, std::forward<F>(f))), st);
}

}  // namespace mt::bench
