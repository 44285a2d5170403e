// Launch-environment parsing (torchrun / mpirun / srun variables) and init_world's single-rank
// and misconfiguration paths. Pure: the environment is a map handed to read_launch_env.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "comm/bootstrap.h"

namespace mt {
namespace {

using Env = std::map<std::string, std::string>;

LaunchEnv parse(const Env& env) {
  return read_launch_env([&](const char* n) -> const char* {
    auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

/// Expects mt::Error whose message contains every fragment.
void expect_error(const Env& env, std::initializer_list<const char*> fragments) {
  try {
    parse(env);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (const char* f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

TEST(LaunchEnv, NoLauncherIsOneRank) {
  LaunchEnv e = parse({{"HOME", "/root"}});
  EXPECT_EQ(e.launcher, LaunchEnv::kNone);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_rank, 0);
}

TEST(LaunchEnv, Torchrun) {
  LaunchEnv e = parse({{"RANK", "5"},
                       {"WORLD_SIZE", "8"},
                       {"LOCAL_RANK", "1"},
                       {"MASTER_ADDR", "node7"},
                       {"MASTER_PORT", "29500"}});
  EXPECT_EQ(e.launcher, LaunchEnv::kTorchrun);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "node7");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_STREQ(launcher_name(e.launcher), "torchrun");
}

TEST(LaunchEnv, TorchrunErrors) {
  expect_error({{"RANK", "3"}, {"LOCAL_RANK", "0"}}, {"WORLD_SIZE is missing", "RANK=3"});
  expect_error({{"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}}, {"RANK is missing", "WORLD_SIZE=4"});
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}}, {"LOCAL_RANK is missing"});
  expect_error({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}}, {"RANK=4 is out of range for WORLD_SIZE=4"});
  expect_error({{"RANK", "-1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}}, {"RANK=-1"});
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "0"}, {"LOCAL_RANK", "0"}}, {"WORLD_SIZE=0 must be >= 1"});
  expect_error({{"RANK", "one"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}}, {"RANK='one' is not an integer"});
  expect_error({{"RANK", "1x"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}}, {"RANK='1x'"});
  expect_error({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "4"}}, {"LOCAL_RANK=4 is out of range"});
  expect_error({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_PORT", "29500"}},
               {"MASTER_ADDR is missing", "WORLD_SIZE=2"});
  expect_error({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "h"}},
               {"MASTER_PORT is missing"});
  expect_error({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}},
               {"MASTER_PORT=70000"});
}

TEST(LaunchEnv, TorchrunSingleRankNeedsNoMaster) {
  LaunchEnv e = parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}});
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.master_port, 0);
}

TEST(LaunchEnv, OpenMpi) {
  LaunchEnv e = parse({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  EXPECT_EQ(e.launcher, LaunchEnv::kMpirun);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "");
  expect_error({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}}, {"OMPI_COMM_WORLD_LOCAL_RANK is missing"});
  expect_error({{"OMPI_COMM_WORLD_RANK", "9"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}},
               {"OMPI_COMM_WORLD_RANK=9 is out of range for OMPI_COMM_WORLD_SIZE=4"});
}

TEST(LaunchEnv, Slurm) {
  LaunchEnv e = parse({{"SLURM_PROCID", "5"},
                       {"SLURM_NTASKS", "8"},
                       {"SLURM_LOCALID", "1"},
                       {"SLURM_JOB_NODELIST", "gpu[003-004]"},
                       {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(e.launcher, LaunchEnv::kSlurm);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "gpu003");
  EXPECT_EQ(e.master_port, 20000 + 123456 % 10000);
  // Explicit MASTER_* win; SLURM_NPROCS when SLURM_NTASKS is absent.
  e = parse({{"SLURM_PROCID", "0"},
             {"SLURM_NPROCS", "2"},
             {"SLURM_LOCALID", "0"},
             {"MASTER_ADDR", "10.0.0.1"},
             {"MASTER_PORT", "1234"},
             {"SLURM_JOB_NODELIST", "a,b"}});
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 1234);
  expect_error({{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}}, {"SLURM_NTASKS is missing"});
}

TEST(LaunchEnv, Precedence) {
  // torchrun workers started under srun see both: RANK wins.
  LaunchEnv e = parse({{"RANK", "1"},
                       {"WORLD_SIZE", "2"},
                       {"LOCAL_RANK", "1"},
                       {"MASTER_ADDR", "h"},
                       {"MASTER_PORT", "5"},
                       {"SLURM_PROCID", "0"},
                       {"SLURM_NTASKS", "1"},
                       {"SLURM_LOCALID", "0"}});
  EXPECT_EQ(e.launcher, LaunchEnv::kTorchrun);
  EXPECT_EQ(e.rank, 1);
  // mpirun inside a Slurm allocation: OpenMPI's variables win.
  e = parse({{"OMPI_COMM_WORLD_RANK", "2"},
             {"OMPI_COMM_WORLD_SIZE", "4"},
             {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
             {"SLURM_PROCID", "0"},
             {"SLURM_NTASKS", "1"},
             {"SLURM_LOCALID", "0"}});
  EXPECT_EQ(e.launcher, LaunchEnv::kMpirun);
  EXPECT_EQ(e.rank, 2);
}

TEST(LaunchEnv, SlurmFirstHost) {
  EXPECT_EQ(slurm_first_host("node1"), "node1");
  EXPECT_EQ(slurm_first_host("node[1-3]"), "node1");
  EXPECT_EQ(slurm_first_host("a[01-02,05],b7"), "a01");
  EXPECT_EQ(slurm_first_host("x,y[1-2]"), "x");
  EXPECT_EQ(slurm_first_host("rack1-[7,9]"), "rack1-7");
  EXPECT_EQ(slurm_first_host("n[10-11]-ib"), "n10-ib");
  EXPECT_THROW(slurm_first_host("bad[1-2"), Error);
}

TEST(InitWorld, SingleRank) {
  LaunchEnv e;
  auto w = init_world(Device::cpu(), e, 1.0);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->size(), 1);
  EXPECT_EQ(w->rank(), 0);
  EXPECT_EQ(w->name(), "world");
  EXPECT_THROW(init_world(Device::cpu(), e, 0.0), Error);
  EXPECT_EQ(local_device(DeviceType::kCPU, e), Device::cpu());
}

TEST(InitWorld, CpuNeedsMpirun) {
  LaunchEnv e;
  e.launcher = LaunchEnv::kTorchrun;
  e.rank = 0;
  e.world_size = 2;
  e.master_addr = "127.0.0.1";
  e.master_port = 29500;
  try {
    init_world(Device::cpu(), e, 1.0);
    ADD_FAILURE() << "no error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("mpirun -np 2"), std::string::npos) << err.what();
  }
}

}  // namespace
}  // namespace mt
