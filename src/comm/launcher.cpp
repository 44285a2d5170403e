#include "comm/launcher.h"

#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm/tcp_store.h"
#include "core/check.h"

namespace mt {

namespace {

std::string self_exe() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  MT_REQUIRE(n > 0, "launcher: cannot resolve /proc/self/exe: {}", std::strerror(errno));
  return std::string(buf, static_cast<size_t>(n));
}

int status_code(int st) {
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return 1;
}

std::string status_str(int st) {
  if (WIFSIGNALED(st)) return fmt::format("was killed by signal {} ({})", WTERMSIG(st), strsignal(WTERMSIG(st)));
  return fmt::format("exited with status {}", WEXITSTATUS(st));
}

/// fork + exec of `cmd` with extra environment variables; the child dies with its parent. The
/// argument and environment arrays are built before fork (the child only calls exec).
pid_t spawn(const std::string& exe, const std::vector<std::string>& cmd,
            const std::vector<std::pair<std::string, std::string>>& env) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    bool overridden = false;
    for (const auto& [k, v] : env) overridden = overridden || k == key;
    if (!overridden) env_strings.push_back(kv);
  }
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, av;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  for (const auto& a : cmd) av.push_back(const_cast<char*>(a.c_str()));
  av.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  MT_REQUIRE(pid >= 0, "launcher: fork() failed: {}", std::strerror(errno));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(1);  // the launcher already died
    ::execvpe(exe.c_str(), av.data(), envp.data());
    static const char kMsg[] = "[megatron launcher] exec failed\n";
    [[maybe_unused]] ssize_t w = ::write(2, kMsg, sizeof(kMsg) - 1);
    ::_exit(127);
  }
  return pid;
}

// SIGTERM / SIGINT received by the launcher, forwarded to the ranks (so that `kill <launcher>`
// reaches ranks running with --exit-signal-handler, which then save and exit 0).
std::atomic<int> g_launcher_signal{0};
extern "C" void launcher_on_signal(int sig) { g_launcher_signal.store(sig); }

// Installs the forwarding handlers for its lifetime (no SA_RESTART: waitpid returns EINTR).
struct ForwardSignals {
  struct sigaction old_term {}, old_int {};
  ForwardSignals() {
    struct sigaction sa {};
    sa.sa_handler = launcher_on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, &old_term);
    sigaction(SIGINT, &sa, &old_int);
  }
  ~ForwardSignals() {
    sigaction(SIGTERM, &old_term, nullptr);
    sigaction(SIGINT, &old_int, nullptr);
  }
};

// Waits for `pid` (mpiexec), passing SIGTERM / SIGINT received meanwhile on as SIGUSR1: mpiexec
// forwards SIGUSR1 to the ranks (OpenMPI), whereas it answers SIGTERM by killing them.
int wait_pid(pid_t pid) {
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0) {
    if (errno != EINTR) return 1;
    if (g_launcher_signal.exchange(0) != 0) ::kill(pid, SIGUSR1);
  }
  return st;
}

int launch_fork(int nproc, const std::string& exe, const std::vector<std::string>& args) {
  ForwardSignals forward;
  const int port = find_free_port();
  std::vector<std::string> cmd{exe};
  cmd.insert(cmd.end(), args.begin(), args.end());
  std::vector<pid_t> pids(nproc, -1);
  for (int r = 0; r < nproc; ++r) {
    pids[r] = spawn(exe, cmd,
                    {{"RANK", std::to_string(r)},
                     {"WORLD_SIZE", std::to_string(nproc)},
                     {"LOCAL_RANK", std::to_string(r)},
                     {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
                     {"MASTER_ADDR", "127.0.0.1"},
                     {"MASTER_PORT", std::to_string(port)}});
  }
  int remaining = nproc;
  int result = 0;
  bool failed = false;
  std::chrono::steady_clock::time_point kill_deadline;
  while (remaining > 0) {
    if (const int sig = g_launcher_signal.exchange(0); sig != 0) {
      for (pid_t p : pids) {
        if (p > 0) ::kill(p, sig);
      }
    }
    bool reaped = false;
    for (int r = 0; r < nproc; ++r) {
      if (pids[r] < 0) continue;
      int st = 0;
      pid_t w = ::waitpid(pids[r], &st, WNOHANG);
      if (w == 0 || (w < 0 && errno == EINTR)) continue;
      pids[r] = -1;
      --remaining;
      reaped = true;
      const bool ok = w > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
      if (!ok && !failed) {
        failed = true;
        result = w > 0 ? status_code(st) : 1;
        std::fprintf(stderr, "[megatron launcher] rank %d (of %d) %s; stopping the other ranks\n", r, nproc,
                     w > 0 ? status_str(st).c_str() : "was lost");
        std::fflush(stderr);
        for (pid_t p : pids) {
          if (p > 0) ::kill(p, SIGTERM);
        }
        kill_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      }
    }
    if (failed && std::chrono::steady_clock::now() > kill_deadline) {
      for (pid_t p : pids) {
        if (p > 0) ::kill(p, SIGKILL);
      }
    }
    if (!reaped && remaining > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return result;
}

}  // namespace

std::vector<std::string> strip_nproc_flag(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--nproc-per-node") {
      ++i;  // skip its value
      continue;
    }
    if (a.rfind("--nproc-per-node=", 0) == 0) continue;
    out.push_back(std::move(a));
  }
  return out;
}

int usable_cpu_cores() {
  cpu_set_t cpus;
  if (::sched_getaffinity(0, sizeof(cpus), &cpus) == 0) return std::max(1, CPU_COUNT(&cpus));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

std::vector<std::pair<std::string, std::string>> cpu_rank_omp_environment(int nproc, int cores,
                                                                         const char* omp_num_threads,
                                                                         const char* omp_wait_policy) {
  MT_REQUIRE(nproc >= 1 && cores >= 1, "cpu_rank_omp_environment: nproc {} and cores {} must be >= 1", nproc, cores);
  std::vector<std::pair<std::string, std::string>> env;
  long threads = std::max(1, cores / nproc);
  if (omp_num_threads == nullptr) {
    env.emplace_back("OMP_NUM_THREADS", std::to_string(threads));
  } else {
    threads = std::max(1L, std::strtol(omp_num_threads, nullptr, 10));  // "4,2" (nested levels): 4
  }
  if (omp_wait_policy == nullptr && nproc * threads > cores) env.emplace_back("OMP_WAIT_POLICY", "passive");
  return env;
}

std::vector<std::string> mpiexec_command(int nproc, const std::string& exe, const std::vector<std::string>& args) {
  std::vector<std::string> cmd{"mpiexec", "-np", std::to_string(nproc), "--oversubscribe", "--bind-to", "none"};
  if (::getuid() == 0) cmd.push_back("--allow-run-as-root");
  cmd.push_back(exe);
  cmd.insert(cmd.end(), args.begin(), args.end());
  return cmd;
}

int launch_local(int nproc, int argc, char** argv, Device device) {
  MT_REQUIRE(nproc >= 1, "--nproc-per-node must be >= 1, got {}", nproc);
  const std::string exe = self_exe();
  const std::vector<std::string> args = strip_nproc_flag(argc, argv);
  if (device.is_cuda()) return launch_fork(nproc, exe, args);
  const std::vector<std::string> cmd = mpiexec_command(nproc, exe, args);
  const int cores = usable_cpu_cores();
  const auto omp = cpu_rank_omp_environment(nproc, cores, std::getenv("OMP_NUM_THREADS"), std::getenv("OMP_WAIT_POLICY"));
  if (!omp.empty()) {
    std::string set;
    for (const auto& [k, v] : omp) set += fmt::format(" {}={}", k, v);
    std::fprintf(stderr, "[megatron launcher] %d ranks on %d cores:%s (set them to override)\n", nproc, cores,
                 set.c_str());
  }
  ForwardSignals forward;  // mpiexec passes SIGTERM / SIGINT on to the ranks
  pid_t pid = spawn(cmd[0], cmd, omp);
  const int st = wait_pid(pid);
  const int code = status_code(st);
  if (code == 127) {
    std::fprintf(stderr, "[megatron launcher] could not run mpiexec (is OpenMPI installed and on PATH?)\n");
  } else if (code != 0 && code != 1) {  // 1: a rank reported its error itself
    std::fprintf(stderr, "[megatron launcher] mpiexec %s\n", status_str(st).c_str());
  }
  return code;
}

}  // namespace mt
