// The world of the mpiexec-launched ranks of a multi-GPU test, one GPU each, made once per process
// (a second init_world in one process would bootstrap a second world), or why the test skips.
// Header-only: the CUDA tests include it; tests/testing/testing.cpp is built without CUDA too.
#pragma once
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "comm/bootstrap.h"
#include "comm/communicator.h"
#include "core/device.h"

namespace mt::testing {

struct GpuWorld {
  std::shared_ptr<Communicator> comm;  ///< null when the test skips
  Device dev;
  std::string skip;  ///< the reason, when comm is null
};

/// The world when launched by mpiexec with one of `sizes` ranks and at least that many GPUs;
/// otherwise comm is null and skip names what is missing. The first call decides for the process
/// (later calls return the same world whatever their sizes).
inline const GpuWorld& gpu_world(std::initializer_list<int> sizes) {
  static const GpuWorld w = [v = std::vector<int>(sizes)] {
    GpuWorld r;
    const LaunchEnv env = read_launch_env();
    if (std::find(v.begin(), v.end(), env.world_size) == v.end() || env.launcher != LaunchEnv::kMpirun) {
      r.skip = fmt::format("run under mpiexec -np {}", fmt::join(v, " or -np "));
      return r;
    }
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
    if (gpus < env.world_size) {
      r.skip = fmt::format("needs {} GPUs, found {}", env.world_size, gpus);
      return r;
    }
    r.dev = local_device(DeviceType::kCUDA, env);
    set_current_device(r.dev);
    r.comm = init_world(r.dev, env, 5.0);
    return r;
  }();
  return w;
}

}  // namespace mt::testing
