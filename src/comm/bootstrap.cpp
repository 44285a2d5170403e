#include "comm/bootstrap.h"

#include <charconv>
#include <cstdlib>
#include <cstring>

#include "comm/tcp_store.h"
#include "core/check.h"
#ifdef MT_WITH_MPI
#include "comm/mpi/mpi_communicator.h"
#endif
#ifdef MT_WITH_NCCL
#include "comm/nccl/nccl_communicator.h"
#endif
#ifdef MT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace mt {

namespace {

int parse_int(const char* name, const char* value) {
  int v = 0;
  const char* end = value + std::strlen(value);
  auto [p, ec] = std::from_chars(value, end, v);
  MT_REQUIRE(ec == std::errc() && p == end && p != value, "environment variable {}='{}' is not an integer", name,
             value);
  return v;
}

struct Vars {
  const char* rank;
  const char* size;
  const char* local;
};

}  // namespace

const char* launcher_name(LaunchEnv::Launcher l) {
  switch (l) {
    case LaunchEnv::kNone: return "none";
    case LaunchEnv::kTorchrun: return "torchrun";
    case LaunchEnv::kMpirun: return "mpirun";
    case LaunchEnv::kSlurm: return "srun";
  }
  return "?";
}

std::string slurm_first_host(const std::string& nodelist) {
  // The first entry ends at the first ',' outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < nodelist.size(); ++end) {
    if (nodelist[end] == '[') ++depth;
    if (nodelist[end] == ']') --depth;
    if (nodelist[end] == ',' && depth == 0) break;
  }
  std::string first = nodelist.substr(0, end);
  const size_t lb = first.find('[');
  if (lb == std::string::npos) return first;
  const size_t rb = first.find(']', lb);
  MT_REQUIRE(rb != std::string::npos, "cannot parse the Slurm node list '{}'", nodelist);
  std::string range = first.substr(lb + 1, rb - lb - 1);  // "003-004,9"
  range = range.substr(0, range.find(','));               // "003-004"
  range = range.substr(0, range.find('-'));               // "003" (zero padding kept)
  MT_REQUIRE(!range.empty(), "cannot parse the Slurm node list '{}'", nodelist);
  return first.substr(0, lb) + range + first.substr(rb + 1);
}

LaunchEnv read_launch_env() {
  return read_launch_env([](const char* n) -> const char* { return std::getenv(n); });
}

LaunchEnv read_launch_env(const EnvLookup& env) {
  LaunchEnv e;
  auto get = [&](const char* n) -> const char* {
    const char* v = env(n);
    return (v != nullptr && v[0] != '\0') ? v : nullptr;
  };
  Vars vars{};
  if (get("RANK") || get("WORLD_SIZE")) {
    e.launcher = LaunchEnv::kTorchrun;
    vars = {"RANK", "WORLD_SIZE", "LOCAL_RANK"};
  } else if (get("OMPI_COMM_WORLD_RANK") || get("OMPI_COMM_WORLD_SIZE")) {
    e.launcher = LaunchEnv::kMpirun;
    vars = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"};
  } else if (get("SLURM_PROCID")) {
    e.launcher = LaunchEnv::kSlurm;
    vars = {"SLURM_PROCID", get("SLURM_NTASKS") || !get("SLURM_NPROCS") ? "SLURM_NTASKS" : "SLURM_NPROCS",
            "SLURM_LOCALID"};
  } else {
    return e;  // a single process
  }
  const char* name = launcher_name(e.launcher);
  for (const char* v : {vars.rank, vars.size, vars.local}) {
    MT_REQUIRE(get(v) != nullptr, "launch environment ({}): {} is missing (set: {}={}, {}={}, {}={})", name, v,
               vars.rank, get(vars.rank) ? get(vars.rank) : "<unset>", vars.size,
               get(vars.size) ? get(vars.size) : "<unset>", vars.local, get(vars.local) ? get(vars.local) : "<unset>");
  }
  e.rank = parse_int(vars.rank, get(vars.rank));
  e.world_size = parse_int(vars.size, get(vars.size));
  e.local_rank = parse_int(vars.local, get(vars.local));
  MT_REQUIRE(e.world_size >= 1, "launch environment ({}): {}={} must be >= 1", name, vars.size, e.world_size);
  MT_REQUIRE(e.rank >= 0 && e.rank < e.world_size, "launch environment ({}): {}={} is out of range for {}={}", name,
             vars.rank, e.rank, vars.size, e.world_size);
  MT_REQUIRE(e.local_rank >= 0 && e.local_rank < e.world_size,
             "launch environment ({}): {}={} is out of range for {}={}", name, vars.local, e.local_rank, vars.size,
             e.world_size);

  if (const char* a = get("MASTER_ADDR")) e.master_addr = a;
  if (const char* p = get("MASTER_PORT")) e.master_port = parse_int("MASTER_PORT", p);
  if (e.launcher == LaunchEnv::kSlurm) {
    if (e.master_addr.empty()) {
      for (const char* v : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
        if (get(v)) {
          e.master_addr = slurm_first_host(get(v));
          break;
        }
      }
    }
    if (e.master_port == 0 && get("SLURM_JOB_ID")) {
      e.master_port = 20000 + parse_int("SLURM_JOB_ID", get("SLURM_JOB_ID")) % 10000;
    }
  }
  if (e.launcher == LaunchEnv::kTorchrun && e.world_size > 1) {
    MT_REQUIRE(!e.master_addr.empty(), "launch environment (torchrun): MASTER_ADDR is missing with WORLD_SIZE={}",
               e.world_size);
    MT_REQUIRE(e.master_port != 0, "launch environment (torchrun): MASTER_PORT is missing with WORLD_SIZE={}",
               e.world_size);
  }
  if (e.master_port != 0 || get("MASTER_PORT")) {
    MT_REQUIRE(e.master_port > 0 && e.master_port <= 65535, "launch environment: MASTER_PORT={} is not a TCP port",
               e.master_port);
  }
  return e;
}

Device local_device(DeviceType type, const LaunchEnv& env) {
  if (type == DeviceType::kCPU) return Device::cpu();
#ifdef MT_WITH_CUDA
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) cudaGetLastError();
  MT_REQUIRE(err == cudaSuccess && n > 0, "rank {}: no CUDA device is visible ({})", env.rank,
             err == cudaSuccess ? "0 devices" : cudaGetErrorString(err));
  if (env.local_rank < n) return Device::cuda(env.local_rank);
  if (n == 1) return Device::cuda(0);  // one GPU per rank via CUDA_VISIBLE_DEVICES
  MT_FAIL("rank {}: LOCAL_RANK={} but only {} GPUs are visible on this node (start at most {} ranks per node)",
          env.rank, env.local_rank, n, n);
#else
  MT_FAIL("rank {}: a CUDA device was requested but this binary was built without CUDA", env.rank);
#endif
}

std::shared_ptr<Communicator> init_world(Device device, const LaunchEnv& env, double timeout_minutes) {
  MT_REQUIRE(timeout_minutes > 0, "--distributed-timeout-minutes must be positive, got {}", timeout_minutes);
  if (env.world_size == 1) return std::make_shared<SingleRankCommunicator>("world");
  const double timeout_s = timeout_minutes * 60.0;

  if (device.is_cpu()) {
#ifdef MT_WITH_MPI
    MT_REQUIRE(env.launcher == LaunchEnv::kMpirun || (env.launcher == LaunchEnv::kSlurm && MpiRuntime::launched_by_mpi()),
               "rank {} of {}: CPU runs with several ranks use the MPI backend, but this process was started by {}. "
               "Start it with `mpirun -np {} megatron ...`, `srun --mpi=pmix ...`, or `megatron pretrain "
               "--nproc-per-node {} --device cpu ...`",
               env.rank, env.world_size, launcher_name(env.launcher), env.world_size, env.world_size);
    auto world = MpiCommunicator::world(timeout_s, "world");
    MT_REQUIRE(world->size() == env.world_size && world->rank() == env.rank,
               "MPI sees rank {} of {} but the launch environment ({}) says rank {} of {}", world->rank(),
               world->size(), launcher_name(env.launcher), env.rank, env.world_size);
    return world;
#else
    MT_FAIL("rank {} of {}: CPU runs with several ranks need the MPI backend; this binary was built without MPI",
            env.rank, env.world_size);
#endif
  }

#ifdef MT_WITH_NCCL
  const Device dev = local_device(DeviceType::kCUDA, env);
  set_current_device(dev);
  NcclCommunicator::UniqueId id{};
  bool have_id = false;
#ifdef MT_WITH_MPI
  if (env.launcher == LaunchEnv::kMpirun) {
    const int mpi_rank = MpiRuntime::world_rank(), mpi_size = MpiRuntime::world_size();
    MT_REQUIRE(mpi_size == env.world_size && mpi_rank == env.rank,
               "MPI sees rank {} of {} but the launch environment says rank {} of {}", mpi_rank, mpi_size, env.rank,
               env.world_size);
    if (env.rank == 0) id = NcclCommunicator::make_unique_id();
    int rc = MPI_Bcast(id.data(), static_cast<int>(id.size()), MPI_BYTE, 0, MPI_COMM_WORLD);
    MT_REQUIRE(rc == MPI_SUCCESS, "rank {}: MPI_Bcast of the NCCL unique id failed (code {})", env.rank, rc);
    have_id = true;
  }
#endif
  if (!have_id) {
    MT_REQUIRE(!env.master_addr.empty() && env.master_port > 0,
               "rank {} of {} ({}): the NCCL bootstrap needs MASTER_ADDR and MASTER_PORT (rank 0 hosts a TCP store "
               "there); got MASTER_ADDR='{}' MASTER_PORT={}",
               env.rank, env.world_size, launcher_name(env.launcher), env.master_addr, env.master_port);
    TcpStore store(env.master_addr, env.master_port, env.world_size, env.rank == 0, timeout_s);
    const std::string key = "megatron/nccl_unique_id/world";
    if (env.rank == 0) {
      id = NcclCommunicator::make_unique_id();
      store.set(key, std::string(id.data(), id.size()));
    } else {
      const std::string v = store.get(key);
      MT_REQUIRE(v.size() == id.size(), "TCP store: NCCL unique id has {} bytes, expected {}", v.size(), id.size());
      std::memcpy(id.data(), v.data(), id.size());
    }
    // The store closes here; rank 0's server waits (up to the timeout) until every rank has
    // connected and disconnected.
  }
  return std::make_shared<NcclCommunicator>(id, env.rank, env.world_size, dev, "world", timeout_s);
#else
  MT_FAIL("rank {} of {}: CUDA runs with several ranks need NCCL; this binary was built without it", env.rank,
          env.world_size);
#endif
}

}  // namespace mt
