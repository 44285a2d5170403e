// Launch and bootstrap: read the launcher's environment (torchrun, OpenMPI's mpirun, Slurm's
// srun, or our own `megatron pretrain --nproc-per-node N`, which sets torchrun's variables) and
// create the world communicator. docs/distributed.md describes the variables and backends.
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "core/device.h"

namespace mt {

struct LaunchEnv {
  enum Launcher { kNone, kTorchrun, kMpirun, kSlurm };
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;  ///< "" when the launcher gives none (mpirun without MASTER_ADDR)
  int master_port = 0;      ///< 0 when unknown
  Launcher launcher = kNone;
};

const char* launcher_name(LaunchEnv::Launcher l);

/// Environment lookup (returns nullptr for unset variables); tests pass their own.
using EnvLookup = std::function<const char*(const char*)>;

/// Reads, in this order of precedence:
///   torchrun (and our local launcher): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
///   OpenMPI: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
///            (MASTER_ADDR/MASTER_PORT optional);
///   Slurm:   SLURM_PROCID, SLURM_NTASKS (or SLURM_NPROCS), SLURM_LOCALID; MASTER_ADDR defaults
///            to the first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST / SLURM_NODELIST and
///            MASTER_PORT to 20000 + SLURM_JOB_ID % 10000;
///   none of them: a single process (rank 0 of 1).
/// Errors (mt::Error naming the variable and its value): a missing companion variable (RANK
/// without WORLD_SIZE, ...), a non-integer, rank/local rank outside [0, world size), world size
/// < 1, MASTER_ADDR/MASTER_PORT missing for a torchrun launch of several ranks, a bad port.
LaunchEnv read_launch_env();
LaunchEnv read_launch_env(const EnvLookup& getenv_fn);

/// First host name of a Slurm host list: "gpu[003-004,9],login1" -> "gpu003".
std::string slurm_first_host(const std::string& nodelist);

/// The device of this rank: CPU stays CPU; CUDA is GPU LOCAL_RANK (or GPU 0 when exactly one
/// GPU is visible, e.g. CUDA_VISIBLE_DEVICES set per rank). Error when LOCAL_RANK >= the number
/// of visible GPUs (and more than one is visible).
Device local_device(DeviceType type, const LaunchEnv& env);

/// The world communicator ("world") of this process:
///   world_size 1 -> SingleRankCommunicator;
///   CPU          -> MPI (ranks must be started by mpirun, or srun --mpi=pmix; anything else is
///                   an error that says how to launch);
///   CUDA         -> NCCL on local_device(); the NCCL unique id travels over MPI under mpirun,
///                   otherwise over a TCP store at MASTER_ADDR:MASTER_PORT hosted by rank 0.
/// timeout_minutes (--distributed-timeout-minutes) bounds every collective and the bootstrap.
std::shared_ptr<Communicator> init_world(Device device, const LaunchEnv& env, double timeout_minutes);

}  // namespace mt
