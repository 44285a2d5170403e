// The local launcher (fork/exec with torchrun's variables, or mpiexec for CPU runs) and failure
// handling across processes: a rank that exits or hangs must end the job with an error that
// names it, within a bounded time. The ranks are this test executable itself: with
// MT_COMM_TEST_HELPER set, a static initializer runs the helper role and exits before main.
#include <gtest/gtest.h>

#include <csignal>

#include <atomic>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>

#include "comm/bootstrap.h"
#include "comm/launcher.h"
#include "comm/tcp_store.h"
#include "testing/testing.h"
#include "core/stream.h"
#ifdef MT_WITH_MPI
#include "comm/mpi/mpi_communicator.h"
#endif

namespace mt {
namespace {

// ---------------------------------------------------------------------------------------------
// Helper roles (child processes)
// ---------------------------------------------------------------------------------------------

std::vector<std::string> own_args() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  std::string cur;
  for (char c : all) {
    if (c == '\0') {
      args.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  if (!args.empty()) args.erase(args.begin());  // argv[0]
  return args;
}

int helper_main(const std::string& mode) {
  const LaunchEnv env = read_launch_env();
  const int rank = env.rank;
  if (mode == "env") {
    std::ofstream f(std::string(std::getenv("MT_COMM_TEST_DIR")) + "/rank" + std::to_string(rank) + ".txt");
    f << launcher_name(env.launcher) << ' ' << env.rank << ' ' << env.world_size << ' ' << env.local_rank << ' '
      << (env.master_addr.empty() ? "-" : env.master_addr) << ' ' << env.master_port;
    for (const char* v : {"OMP_NUM_THREADS", "OMP_WAIT_POLICY"}) f << ' ' << (std::getenv(v) ? std::getenv(v) : "-");
    f << '\n';
    for (const auto& a : own_args()) f << a << '\n';
    return 0;
  }
  if (mode == "fail") {
    if (rank == std::atoi(std::getenv("MT_COMM_TEST_FAIL_RANK"))) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      return 7;
    }
    std::this_thread::sleep_for(std::chrono::seconds(60));  // must be stopped by the launcher
    return 0;
  }
  if (mode == "report") {  // rank MT_COMM_TEST_FAIL_RANK prints its own error and exits 1
    if (rank == std::atoi(std::getenv("MT_COMM_TEST_FAIL_RANK"))) {
      std::fprintf(stderr, "error: bad input found by rank %d\n", rank);
      return kReportedErrorExitStatus;
    }
    std::this_thread::sleep_for(std::chrono::seconds(60));  // must be stopped by the launcher
    return 0;
  }
  if (mode == "crash") {  // rank MT_COMM_TEST_FAIL_RANK dies by SIGKILL, printing nothing
    if (rank == std::atoi(std::getenv("MT_COMM_TEST_FAIL_RANK"))) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      ::kill(::getpid(), SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  if (mode == "term") {  // waits for the SIGTERM the launcher forwards, then reports it and exits 0
    static std::atomic<int> got{0};
    std::signal(SIGTERM, [](int sig) { got.store(sig); });
    std::ofstream(std::string(std::getenv("MT_COMM_TEST_DIR")) + "/ready" + std::to_string(rank)) << "1";
    for (int i = 0; i < 3000 && got.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::ofstream(std::string(std::getenv("MT_COMM_TEST_DIR")) + "/rank" + std::to_string(rank) + ".txt")
        << "signal " << got.load() << "\n";
    return got.load() == SIGTERM ? 0 : 4;
  }
  if (mode == "guard" || mode == "alive") {
    // guard: a rank that would sleep for a minute; it must die with its launcher.
    // alive: without the signal (MT_TEST_NO_PARENT_DEATH_SIGNAL=1), launcher_alive() turns false.
    guard_parent_death(rank);
    const std::string d = std::getenv("MT_COMM_TEST_DIR");
    std::ofstream(d + "/pid" + std::to_string(rank) + ".tmp") << ::getpid() << "\n";
    std::filesystem::rename(d + "/pid" + std::to_string(rank) + ".tmp", d + "/pid" + std::to_string(rank));
    for (int i = 0; i < 6000; ++i) {
      if (mode == "alive" && !launcher_alive()) {
        std::ofstream(d + "/gone" + std::to_string(rank)) << guarded_parent_pid() << "\n";
        return 0;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return 0;
  }
  if (mode == "store") {
    TcpStore store(env.master_addr, env.master_port, env.world_size, rank == 0, 30.0);
    store.set("r" + std::to_string(rank), std::to_string(rank * rank));
    store.barrier(rank);
    for (int r = 0; r < env.world_size; ++r) {
      if (store.get("r" + std::to_string(r)) != std::to_string(r * r)) return 5;
    }
    store.barrier(rank);
    return 0;
  }
#ifdef MT_WITH_MPI
  if (mode == "mpi_dead" || mode == "mpi_stuck") {
    const bool dead = mode == "mpi_dead";
    auto world = MpiCommunicator::world(dead ? 60.0 : 2.0);
    world->barrier();
    if (world->rank() == 1) {
      if (dead) std::_Exit(3);  // dies before the all_reduce
      std::this_thread::sleep_for(std::chrono::seconds(60));  // stuck outside the collective
      return 0;
    }
    float x = 1.f;
    Stream cpu(Device::cpu());
    try {
      world->all_reduce(Tensor(&x, DType::kF32, Device::cpu(), {1}), ReduceOp::kSum, cpu);
    } catch (const Error& e) {
      std::fprintf(stderr, "helper rank %d: %s\n", world->rank(), e.what());
      return 1;
    }
    return 0;
  }
#endif
  std::fprintf(stderr, "unknown helper mode %s\n", mode.c_str());
  return 99;
}

const int kHelperDone = [] {
  const char* mode = std::getenv("MT_COMM_TEST_HELPER");
  if (mode == nullptr) return 0;
  int code = 1;
  try {
    code = helper_main(mode);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "helper: %s\n", e.what());
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::exit(code);  // runs MPI_Finalize when MPI was used (skipped after a timeout)
}();

// ---------------------------------------------------------------------------------------------
// Tests (parent)
// ---------------------------------------------------------------------------------------------

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

/// Sets the helper's environment for one test and clears it afterwards.
struct HelperEnv {
  std::filesystem::path dir;
  explicit HelperEnv(const char* mode, int fail_rank = -1) {
    dir = std::filesystem::temp_directory_path() /
          ("mt_launcher_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    std::filesystem::create_directories(dir);
    setenv("MT_COMM_TEST_HELPER", mode, 1);
    setenv("MT_COMM_TEST_DIR", dir.c_str(), 1);
    setenv("MT_COMM_TEST_FAIL_RANK", std::to_string(fail_rank).c_str(), 1);
  }
  ~HelperEnv() {
    unsetenv("MT_COMM_TEST_HELPER");
    unsetenv("MT_COMM_TEST_DIR");
    unsetenv("MT_COMM_TEST_FAIL_RANK");
    std::filesystem::remove_all(dir);
  }
  static int& counter() {
    static int c = 0;
    return c;
  }
  std::vector<std::string> lines(int rank) const {
    std::ifstream f(dir / ("rank" + std::to_string(rank) + ".txt"));
    std::vector<std::string> out;
    for (std::string l; std::getline(f, l);) out.push_back(l);
    return out;
  }
};

/// launch_local with a fixed argument list; returns (status, captured stdout + stderr).
std::pair<int, std::string> launch(int nproc, Device device, std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  int rc = launch_local(nproc, static_cast<int>(args.size()), argv.data(), device);
  std::string out = ::testing::internal::GetCapturedStdout();
  out += ::testing::internal::GetCapturedStderr();
  return {rc, out};
}

bool have_mpiexec() { return std::system("command -v mpiexec > /dev/null 2>&1") == 0; }

TEST(Launcher, StripNprocFlag) {
  std::vector<std::string> a{"megatron", "pretrain", "--nproc-per-node", "4", "--x", "1", "--nproc-per-node=2", "y"};
  std::vector<char*> argv;
  for (auto& s : a) argv.push_back(s.data());
  EXPECT_EQ(strip_nproc_flag(static_cast<int>(argv.size()), argv.data()),
            (std::vector<std::string>{"pretrain", "--x", "1", "y"}));
  auto cmd = mpiexec_command(3, "/bin/exe", {"a", "b"});
  ASSERT_GE(cmd.size(), 6u);
  EXPECT_EQ(cmd[0], "mpiexec");
  EXPECT_EQ(cmd[1], "-np");
  EXPECT_EQ(cmd[2], "3");
  EXPECT_NE(std::find(cmd.begin(), cmd.end(), "--oversubscribe"), cmd.end());
  EXPECT_EQ(cmd[cmd.size() - 3], "/bin/exe");
  EXPECT_EQ(cmd.back(), "b");
  EXPECT_THROW(launch_local(0, 1, argv.data(), Device::cpu()), Error);
}

TEST(Launcher, CpuRankOmpEnvironment) {
  using Env = std::vector<std::pair<std::string, std::string>>;
  // Unset: a share of the cores each; passive waits only when the ranks' threads exceed the cores.
  EXPECT_EQ(cpu_rank_omp_environment(2, 8, nullptr, nullptr), (Env{{"OMP_NUM_THREADS", "4"}}));
  EXPECT_EQ(cpu_rank_omp_environment(3, 8, nullptr, nullptr), (Env{{"OMP_NUM_THREADS", "2"}}));
  EXPECT_EQ(cpu_rank_omp_environment(4, 2, nullptr, nullptr),
            (Env{{"OMP_NUM_THREADS", "1"}, {"OMP_WAIT_POLICY", "passive"}}));
  // The user's values are kept, and the user's thread count decides the wait policy.
  EXPECT_EQ(cpu_rank_omp_environment(2, 2, "2", nullptr), (Env{{"OMP_WAIT_POLICY", "passive"}}));
  EXPECT_EQ(cpu_rank_omp_environment(2, 4, "2", nullptr), Env{});
  EXPECT_EQ(cpu_rank_omp_environment(2, 4, "3,2", nullptr), (Env{{"OMP_WAIT_POLICY", "passive"}}));
  EXPECT_EQ(cpu_rank_omp_environment(4, 2, "3", "active"), Env{});
  EXPECT_EQ(cpu_rank_omp_environment(4, 2, nullptr, "active"), (Env{{"OMP_NUM_THREADS", "1"}}));
  EXPECT_EQ(cpu_rank_omp_environment(2, 2, "abc", nullptr), Env{});  // counts as 1 thread
  EXPECT_THROW(cpu_rank_omp_environment(0, 2, nullptr, nullptr), Error);
  EXPECT_THROW(cpu_rank_omp_environment(2, 0, nullptr, nullptr), Error);
}

TEST(Launcher, ForkPathSetsTorchrunEnvironment) {
  HelperEnv h("env");
  auto [rc, out] = launch(3, Device::cuda(0), {"megatron", "pretrain", "--nproc-per-node", "3", "--foo=1", "bar"});
  ASSERT_EQ(rc, 0) << out;
  std::string port;
  for (int r = 0; r < 3; ++r) {
    auto l = h.lines(r);
    ASSERT_EQ(l.size(), 4u) << "rank " << r;
    std::istringstream s(l[0]);
    std::string launcher, addr, p;
    int rank, world, local;
    s >> launcher >> rank >> world >> local >> addr >> p;
    EXPECT_EQ(launcher, "torchrun");
    EXPECT_EQ(rank, r);
    EXPECT_EQ(world, 3);
    EXPECT_EQ(local, r);
    EXPECT_EQ(addr, "127.0.0.1");
    EXPECT_GT(std::stoi(p), 0);
    if (r == 0) port = p;
    EXPECT_EQ(p, port);
    EXPECT_EQ(std::vector<std::string>(l.begin() + 1, l.end()), (std::vector<std::string>{"pretrain", "--foo=1", "bar"}));
  }
}

// OpenMPI 4.1's stderr blocks, as mpiexec prints them.
const std::string kDashes(74, '-');
std::string mpi_block(const std::string& text) { return kDashes + "\n" + text + kDashes + "\n"; }
const std::string kPrimaryJob = mpi_block(
    "Primary job  terminated normally, but 1 process returned\n"
    "a non-zero exit code. Per user-direction, the job has been aborted.\n");
std::string non_zero_status(int rank, int code) {
  return mpi_block(
      "mpiexec detected that one or more processes exited with non-zero status, thus causing\n"
      "the job to be terminated. The first process to do so was:\n\n"
      "  Process name: [[32587,1]," + std::to_string(rank) + "]\n"
      "  Exit code:    " + std::to_string(code) + "\n");
}
const std::string kSignal11 = mpi_block(
    "mpiexec noticed that process rank 1 with PID 0 on node vm exited on signal 11 (Segmentation fault).\n");

// The filter's output for `in` fed whole, and fed one byte at a time (it must not depend on how
// the pipe splits the stream).
std::string filtered(const std::string& in, bool bytewise) {
  MpiexecStderrFilter f;
  std::string out;
  if (bytewise) {
    for (char c : in) out += f.feed(std::string_view(&c, 1));
  } else {
    out = f.feed(in);
  }
  return out + f.finish();
}

TEST(Launcher, MpiexecStderrFilterDropsOnlyTheBoilerplateOfReportedErrors) {
  const std::string err = "error: --seq-length 32 exceeds --max-position-embeddings 16\n";
  const std::string bar = std::string(74, '-') + "\n";  // a rank's own line of dashes
  struct Case {
    std::string in, out;
  };
  const std::vector<Case> cases = {
      // A rank printed its error and exited 1: only its message remains.
      {err + kPrimaryJob + non_zero_status(1, 1), err},
      {err + kPrimaryJob, err},  // mpiexec sometimes prints only the first block
      // Another exit status names the rank; a signal is reported; other blocks and lines pass.
      {kPrimaryJob + non_zero_status(1, 7), non_zero_status(1, 7)},
      {kPrimaryJob + kSignal11, kSignal11},
      {mpi_block("mpiexec has detected an attempt to run as root.\n"),
       mpi_block("mpiexec has detected an attempt to run as root.\n")},
      {"a\n" + bar + "b\n" + bar + bar + "c", "a\n" + bar + "b\n" + bar + bar + "c"},
      {bar + kPrimaryJob + "tail", bar + "tail"},
      // An unterminated block at the end of the stream is printed as it is.
      {kDashes + "\nPrimary job  terminated normally", kDashes + "\nPrimary job  terminated normally"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(filtered(c.in, false), c.out) << c.in;
    EXPECT_EQ(filtered(c.in, true), c.out) << c.in;
  }
  // A line without its '\n' yet (a progress line) is printed at once, not held.
  MpiexecStderrFilter f;
  EXPECT_EQ(f.feed("iteration 3/10\r"), "iteration 3/10\r");
  EXPECT_EQ(f.feed("iteration 4/10\n"), "iteration 4/10\n");
  EXPECT_EQ(f.feed(kDashes), "");  // may open a block: held
  EXPECT_EQ(f.feed("\nnot a block\n"), kDashes + "\nnot a block\n");
}

// A rank that printed its error and exited with kReportedErrorExitStatus: the error is the only
// report (no launcher line).
TEST(Launcher, ForkPathReportedErrorIsPrintedOnce) {
  HelperEnv h("report", 1);
  const auto t0 = Clock::now();
  auto [rc, out] = launch(2, Device::cuda(0), {"megatron"});
  EXPECT_EQ(rc, kReportedErrorExitStatus) << out;
  EXPECT_LT(since(t0), 15.0) << "the sleeping rank was not stopped";
  EXPECT_EQ(out, "error: bad input found by rank 1\n");
}

TEST(Launcher, ForkPathNamesARankKilledBySignal) {
  HelperEnv h("crash", 1);
  auto [rc, out] = launch(2, Device::cuda(0), {"megatron"});
  EXPECT_EQ(rc, 128 + SIGKILL) << out;
  EXPECT_NE(out.find("rank 1 (of 2) was killed by signal 9"), std::string::npos) << out;
}

TEST(Launcher, ForkPathStopsTheOthersAndNamesTheFailedRank) {
  HelperEnv h("fail", 1);
  const auto t0 = Clock::now();
  auto [rc, out] = launch(3, Device::cuda(0), {"megatron", "--nproc-per-node=3"});
  EXPECT_EQ(rc, 7) << out;
  EXPECT_LT(since(t0), 15.0) << "the sleeping ranks were not stopped";
  EXPECT_NE(out.find("rank 1 (of 3) exited with status 7"), std::string::npos) << out;
}

// --exit-signal-handler under the launcher: `kill <launcher>` must reach every rank.
TEST(Launcher, ForkPathForwardsSigterm) {
  HelperEnv h("term");
  std::pair<int, std::string> result;
  std::thread t([&] { result = launch(2, Device::cuda(0), {"megatron"}); });
  for (int i = 0; i < 1000 && !(std::filesystem::exists(h.dir / "ready0") && std::filesystem::exists(h.dir / "ready1"));
       ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ::kill(::getpid(), SIGTERM);  // the launcher (this process) receives it
  t.join();
  EXPECT_EQ(result.first, 0) << result.second;
  for (int r = 0; r < 2; ++r) EXPECT_EQ(h.lines(r), (std::vector<std::string>{"signal 15"})) << "rank " << r;
}

// ---- Ranks that cannot outlive their launcher (guard_parent_death) ----

bool ended(pid_t pid) { return testing::process_ended(pid); }

// Starts a launcher (launch_local in a child process) of 2 helper ranks, waits for both ranks to
// write their pid, and returns (launcher pid, rank pids).
std::pair<pid_t, std::vector<pid_t>> start_launcher(const HelperEnv& h, Device device) {
  const pid_t launcher = ::fork();
  if (launcher == 0) {
    std::vector<std::string> args{"megatron"};
    std::vector<char*> argv{args[0].data(), nullptr};
    ::_exit(launch_local(2, 1, argv.data(), device));
  }
  std::vector<pid_t> ranks;
  for (int r = 0; r < 2; ++r) {
    const auto file = h.dir / ("pid" + std::to_string(r));
    for (int i = 0; i < 3000 && !std::filesystem::exists(file); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    pid_t pid = -1;
    std::ifstream(file) >> pid;
    ranks.push_back(pid);
  }
  return {launcher, ranks};
}

// kill -9 of the launcher: no rank is left 2 s later (they end within milliseconds).
void expect_ranks_die_with_launcher(Device device) {
  HelperEnv h("guard");
  auto [launcher, ranks] = start_launcher(h, device);
  for (pid_t p : ranks) ASSERT_GT(p, 0) << "a rank did not start";
  for (pid_t p : ranks) ASSERT_FALSE(ended(p));
  ::kill(launcher, SIGKILL);
  ::waitpid(launcher, nullptr, 0);
  const auto t0 = Clock::now();
  while (since(t0) < 2.0 && !(ended(ranks[0]) && ended(ranks[1])))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  for (pid_t p : ranks) {
    EXPECT_TRUE(ended(p)) << "rank pid " << p << " outlived its launcher by 2 s";
    if (!ended(p)) ::kill(p, SIGKILL);  // leave nothing behind
  }
}

TEST(Launcher, ForkPathRanksDieWithTheLauncher) { expect_ranks_die_with_launcher(Device::cuda(0)); }

TEST(Launcher, MpiexecPathRanksDieWithTheLauncher) {
  if (!have_mpiexec()) GTEST_SKIP() << "no mpiexec";
  expect_ranks_die_with_launcher(Device::cpu());
}

// launcher_alive(): true while the launcher lives, false once the rank was re-parented. Here the
// signal is not armed (test hook), so the rank lives on and reports what launcher_alive() says.
TEST(Launcher, LauncherAliveTurnsFalseWhenTheLauncherDies) {
  HelperEnv h("alive");
  setenv("MT_TEST_NO_PARENT_DEATH_SIGNAL", "1", 1);
  auto [launcher, ranks] = start_launcher(h, Device::cuda(0));
  unsetenv("MT_TEST_NO_PARENT_DEATH_SIGNAL");
  for (pid_t p : ranks) ASSERT_GT(p, 0) << "a rank did not start";
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(std::filesystem::exists(h.dir / "gone0")) << "launcher_alive() false while the launcher lives";
  ::kill(launcher, SIGKILL);
  ::waitpid(launcher, nullptr, 0);
  const auto t0 = Clock::now();
  while (since(t0) < 2.0 && !(std::filesystem::exists(h.dir / "gone0") && std::filesystem::exists(h.dir / "gone1")))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  for (int r = 0; r < 2; ++r) {
    pid_t recorded = 0;
    std::ifstream(h.dir / ("gone" + std::to_string(r))) >> recorded;
    EXPECT_EQ(recorded, launcher) << "rank " << r << ": launcher_alive() did not turn false";
  }
  const auto t1 = Clock::now();
  while (since(t1) < 2.0 && !(ended(ranks[0]) && ended(ranks[1])))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  for (pid_t p : ranks)
    if (!ended(p)) ::kill(p, SIGKILL);
}

TEST(Launcher, ForkPathRanksMeetInTheTcpStore) {
  HelperEnv h("store");
  auto [rc, out] = launch(3, Device::cuda(0), {"megatron"});
  EXPECT_EQ(rc, 0) << out;
}

/// Unsets an environment variable for a scope and restores it afterwards.
struct UnsetEnv {
  std::string name;
  std::optional<std::string> saved;
  explicit UnsetEnv(std::string n) : name(std::move(n)) {
    if (const char* v = std::getenv(name.c_str())) saved = v;
    unsetenv(name.c_str());
  }
  ~UnsetEnv() {
    if (saved) setenv(name.c_str(), saved->c_str(), 1);
  }
};

TEST(Launcher, MpiexecPathSetsOpenMpiEnvironment) {
  if (!have_mpiexec()) GTEST_SKIP() << "no mpiexec";
  HelperEnv h("env");
  UnsetEnv omp_threads("OMP_NUM_THREADS"), omp_wait("OMP_WAIT_POLICY");
  auto [rc, out] = launch(2, Device::cpu(), {"megatron", "--nproc-per-node", "2", "train"});
  ASSERT_EQ(rc, 0) << out;
  // The ranks get cpu_rank_omp_environment's settings for this machine, and the launcher says so.
  const int cores = usable_cpu_cores();
  const std::string threads = std::to_string(std::max(1, cores / 2));
  const std::string wait = 2 * std::max(1, cores / 2) > cores ? "passive" : "-";
  EXPECT_NE(out.find("[megatron launcher] 2 ranks on " + std::to_string(cores) + " cores: OMP_NUM_THREADS=" + threads),
            std::string::npos)
      << out;
  for (int r = 0; r < 2; ++r) {
    auto l = h.lines(r);
    ASSERT_EQ(l.size(), 2u) << "rank " << r << "\n" << out;
    EXPECT_EQ(l[0].substr(0, l[0].find(' ', 7)), "mpirun " + std::to_string(r)) << l[0];
    EXPECT_NE(l[0].find(" 2 " + std::to_string(r) + " "), std::string::npos) << l[0];
    EXPECT_TRUE(l[0].ends_with(" " + threads + " " + wait)) << l[0];
    EXPECT_EQ(l[1], "train");
  }
}

TEST(Launcher, MpiexecPathPassiveWaitsWhenOversubscribed) {
  if (!have_mpiexec()) GTEST_SKIP() << "no mpiexec";
  HelperEnv h("env");
  UnsetEnv omp_threads("OMP_NUM_THREADS"), omp_wait("OMP_WAIT_POLICY");
  const int n = usable_cpu_cores() + 1;  // more ranks than cores
  if (n > 16) GTEST_SKIP() << "too many cores to oversubscribe cheaply";
  setenv("OMP_NUM_THREADS", "1", 1);  // the user's value is kept
  auto [rc, out] = launch(n, Device::cpu(), {"megatron", "train"});
  unsetenv("OMP_NUM_THREADS");
  ASSERT_EQ(rc, 0) << out;
  for (int r = 0; r < n; ++r) {
    auto l = h.lines(r);
    ASSERT_FALSE(l.empty()) << "rank " << r << "\n" << out;
    EXPECT_TRUE(l[0].ends_with(" 1 passive")) << l[0];
  }
}

TEST(Launcher, MpiexecPathPropagatesTheFailure) {
  if (!have_mpiexec()) GTEST_SKIP() << "no mpiexec";
  HelperEnv h("fail", 1);
  const auto t0 = Clock::now();
  auto [rc, out] = launch(2, Device::cpu(), {"megatron"});
  EXPECT_EQ(rc, 7) << out;
  EXPECT_LT(since(t0), 20.0);
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(Process name: \[\[[0-9]+,[0-9]+\],1\])"))) << out;
  EXPECT_NE(out.find("[megatron launcher] mpiexec exited with status 7"), std::string::npos) << out;
}

// A rank that printed its error and exited 1: printed once, without mpiexec's boilerplate.
TEST(Launcher, MpiexecPathReportedErrorIsPrintedOnceWithoutBoilerplate) {
  if (!have_mpiexec()) GTEST_SKIP() << "no mpiexec";
  HelperEnv h("report", 1);
  UnsetEnv omp_threads("OMP_NUM_THREADS"), omp_wait("OMP_WAIT_POLICY");
  setenv("OMP_NUM_THREADS", "1", 1);  // the user's settings: no launcher line about OpenMP
  setenv("OMP_WAIT_POLICY", "passive", 1);
  const auto t0 = Clock::now();
  auto [rc, out] = launch(2, Device::cpu(), {"megatron"});
  unsetenv("OMP_NUM_THREADS");
  unsetenv("OMP_WAIT_POLICY");
  EXPECT_EQ(rc, kReportedErrorExitStatus) << out;
  EXPECT_LT(since(t0), 20.0);
  EXPECT_EQ(out, "error: bad input found by rank 1\n");
}

// A rank killed by a signal (it prints nothing): mpiexec's report naming it is kept, and the
// launcher names mpiexec's status.
TEST(Launcher, MpiexecPathReportsARankKilledBySignal) {
  if (!have_mpiexec()) GTEST_SKIP() << "no mpiexec";
  HelperEnv h("crash", 1);
  auto [rc, out] = launch(2, Device::cpu(), {"megatron"});
  EXPECT_EQ(rc, 128 + SIGKILL) << out;
  EXPECT_NE(out.find("mpiexec exited with status 137"), std::string::npos) << out;
  EXPECT_EQ(out.find("Primary job"), std::string::npos) << out;
}

#ifdef MT_WITH_MPI
// A peer that exits before an all_reduce: mpiexec ends the job and names rank 1.
TEST(MpiFailure, DeadPeerEndsTheJobNamingIt) {
  if (!have_mpiexec()) GTEST_SKIP() << "no mpiexec";
  HelperEnv h("mpi_dead");
  const auto t0 = Clock::now();
  auto [rc, out] = launch(2, Device::cpu(), {"megatron"});
  EXPECT_NE(rc, 0) << out;
  EXPECT_LT(since(t0), 30.0);
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(Process name: \[\[[0-9]+,[0-9]+\],1\])"))) << out;
  EXPECT_NE(out.find("Exit code:    3"), std::string::npos) << out;
}

// A peer that is alive but never joins: the all_reduce times out (2 s) with an error naming the
// operation, the group and the rank; the job ends with a non-zero status.
TEST(MpiFailure, StuckPeerTimesOut) {
  if (!have_mpiexec()) GTEST_SKIP() << "no mpiexec";
  HelperEnv h("mpi_stuck");
  const auto t0 = Clock::now();
  auto [rc, out] = launch(2, Device::cpu(), {"megatron"});
  EXPECT_NE(rc, 0) << out;
  EXPECT_GE(since(t0), 2.0);
  EXPECT_LT(since(t0), 30.0);
  EXPECT_NE(out.find("MPI all_reduce on group 'world' (rank 0 of 2) did not complete within 2.0 s"), std::string::npos)
      << out;
}
#endif

}  // namespace
}  // namespace mt
