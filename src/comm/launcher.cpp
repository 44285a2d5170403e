#include "comm/launcher.h"

#include <fcntl.h>
#include <poll.h>
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
#include <regex>
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
/// stderr_fd >= 0: the child's stderr (fd 2) is that descriptor instead of the launcher's.
pid_t spawn(const std::string& exe, const std::vector<std::string>& cmd,
            const std::vector<std::pair<std::string, std::string>>& env, int stderr_fd = -1) {
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
    // Dies with the launcher, at once: a rank (or mpiexec, which then takes its ranks with it)
    // must not train, save or publish after the launcher is gone. SIGKILL, not SIGTERM: a rank
    // with --exit-signal-handler would answer SIGTERM by saving a checkpoint, and mpiexec by
    // passing SIGTERM on. The launcher forks from its main thread, which lives as long as it.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);  // the launcher already died
    if (stderr_fd >= 0) ::dup2(stderr_fd, 2);
    ::execvpe(exe.c_str(), av.data(), envp.data());
    static const char kMsg[] = "[megatron launcher] exec failed\n";
    [[maybe_unused]] ssize_t w = ::write(2, kMsg, sizeof(kMsg) - 1);
    ::_exit(127);
  }
  return pid;
}

constexpr const char* kLauncherPidVariable = "MT_LAUNCHER_PID";  // the fork path's ranks: their parent

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

// Runs `cmd` (mpiexec) with its stderr read through a pipe and MpiexecStderrFilter, and waits for
// it, passing SIGTERM / SIGINT received meanwhile on as SIGUSR1 (as wait_pid). Returns the wait
// status. After mpiexec has exited its stderr is drained until end of file (at most 2 s more).
int run_mpiexec_filtered(const std::vector<std::string>& cmd,
                         const std::vector<std::pair<std::string, std::string>>& env) {
  int fds[2];
  MT_REQUIRE(::pipe2(fds, O_CLOEXEC) == 0, "launcher: pipe() failed: {}", std::strerror(errno));
  pid_t pid = -1;
  try {
    pid = spawn(cmd[0], cmd, env, fds[1]);
  } catch (...) {
    ::close(fds[0]);
    ::close(fds[1]);
    throw;
  }
  ::close(fds[1]);
  MpiexecStderrFilter filter;
  auto emit = [](const std::string& s) {
    if (s.empty()) return;
    std::fwrite(s.data(), 1, s.size(), stderr);
    std::fflush(stderr);
  };
  int st = 0;
  bool exited = false, eof = false;
  std::chrono::steady_clock::time_point drain_until;
  char buf[1 << 16];
  while (!eof && !(exited && std::chrono::steady_clock::now() > drain_until)) {
    if (g_launcher_signal.exchange(0) != 0 && !exited) ::kill(pid, SIGUSR1);
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, 50) > 0) {
      const ssize_t n = ::read(fds[0], buf, sizeof(buf));
      if (n > 0) emit(filter.feed(std::string_view(buf, static_cast<size_t>(n))));
      else if (n == 0 || (errno != EINTR && errno != EAGAIN)) eof = true;
    }
    if (!exited) {
      const pid_t w = ::waitpid(pid, &st, WNOHANG);
      if (w == pid || (w < 0 && errno != EINTR)) {
        if (w < 0) st = 1;
        exited = true;
        drain_until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      }
    }
  }
  ::close(fds[0]);
  emit(filter.finish());
  return exited ? st : wait_pid(pid);  // end of file first: mpiexec closed its stderr early
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
                     {"MASTER_PORT", std::to_string(port)},
                     {kLauncherPidVariable, std::to_string(::getpid())}});
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
        // A rank that exited with kReportedErrorExitStatus printed its own error: that is the report.
        const bool reported = w > 0 && WIFEXITED(st) && WEXITSTATUS(st) == kReportedErrorExitStatus;
        if (!reported) {
          std::fprintf(stderr, "[megatron launcher] rank %d (of %d) %s; stopping the other ranks\n", r, nproc,
                       w > 0 ? status_str(st).c_str() : "was lost");
          std::fflush(stderr);
        }
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

// OpenMPI's help blocks open and close with a line of 74 dashes.
bool is_dash_line(std::string_view l) {
  if (l.ends_with('\n')) l.remove_suffix(1);
  return l.size() == 74 && l.find_first_not_of('-') == std::string_view::npos;
}

constexpr std::string_view kPrimaryJobBlock = "Primary job  terminated normally";
constexpr std::string_view kNonZeroStatusBlock =
    "mpiexec detected that one or more processes exited with non-zero status";

// Whether a complete block (its text from the opening to the closing dash line) is dropped.
bool drop_block(const std::string& block) {
  if (block.find(kPrimaryJobBlock) != std::string::npos) return true;
  static const std::regex kExitCode(R"(Exit code:\s+(-?[0-9]+))");
  std::smatch m;
  return std::regex_search(block, m, kExitCode) && std::stoi(m[1].str()) == kReportedErrorExitStatus;
}

}  // namespace

void MpiexecStderrFilter::line(std::string l, std::string& out) {
  if (in_block_) {
    block_ += l;
    if (is_dash_line(l)) {
      if (!drop_block(block_)) out += block_;
      block_.clear();
      in_block_ = false;
    }
    return;
  }
  if (!held_dash_.empty()) {
    if (l.starts_with(kPrimaryJobBlock) || l.starts_with(kNonZeroStatusBlock)) {
      block_ = std::move(held_dash_) + l;
      held_dash_.clear();
      in_block_ = true;
      return;
    }
    out += held_dash_;
    held_dash_.clear();
  }
  if (is_dash_line(l)) {
    held_dash_ = std::move(l);
    return;
  }
  out += l;
}

std::string MpiexecStderrFilter::feed(std::string_view chunk) {
  std::string out;
  while (!chunk.empty()) {
    const size_t nl = chunk.find('\n');
    const size_t n = nl == std::string_view::npos ? chunk.size() : nl + 1;
    if (mid_line_) {
      out.append(chunk.substr(0, n));
      mid_line_ = nl == std::string_view::npos;
    } else {
      partial_.append(chunk.substr(0, n));
      if (nl != std::string_view::npos) {
        line(std::move(partial_), out);
        partial_.clear();
      }
    }
    chunk.remove_prefix(n);
  }
  // The start of a line that cannot be a dash line, outside a block: printed now (e.g. a
  // progress line without '\n'); the rest of the line follows it as it comes.
  if (!partial_.empty() && !in_block_ && held_dash_.empty() && partial_.find_first_not_of('-') != std::string::npos) {
    out += partial_;
    partial_.clear();
    mid_line_ = true;
  }
  return out;
}

std::string MpiexecStderrFilter::finish() {
  std::string out = held_dash_ + block_ + partial_;
  held_dash_.clear();
  block_.clear();
  partial_.clear();
  in_block_ = false;
  mid_line_ = false;
  return out;
}

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
  const int st = run_mpiexec_filtered(cmd, omp);
  const int code = status_code(st);
  if (code == 127) {
    std::fprintf(stderr, "[megatron launcher] could not run mpiexec (is OpenMPI installed and on PATH?)\n");
  } else if (code != 0 && code != kReportedErrorExitStatus) {  // the rank printed its error itself
    std::fprintf(stderr, "[megatron launcher] mpiexec %s\n", status_str(st).c_str());
  }
  return code;
}

namespace {
std::atomic<pid_t> g_guarded_parent{0};
char g_parent_death_message[160];  // composed before the signal is armed (the handler only writes it)
size_t g_parent_death_message_len = 0;

extern "C" void on_parent_death(int) {
  const pid_t parent = g_guarded_parent.load();
  if (parent == 0 || ::getppid() == parent) return;  // only the parent's thread that forked us exited
  [[maybe_unused]] const ssize_t w = ::write(2, g_parent_death_message, g_parent_death_message_len);
  ::_exit(kReportedErrorExitStatus);
}
}  // namespace

int parent_death_signal() { return SIGRTMIN + 3; }

void guard_parent_death(int rank) {
  const pid_t parent = ::getppid();
  const int n = std::snprintf(g_parent_death_message, sizeof(g_parent_death_message),
                              "error (rank %d): its launcher (parent process %d) has died; exiting at once, without "
                              "saving\n",
                              rank, static_cast<int>(parent));
  g_parent_death_message_len = n > 0 ? std::min(static_cast<size_t>(n), sizeof(g_parent_death_message) - 1) : 0;
  g_guarded_parent.store(parent);
  const char* test_no_signal = std::getenv("MT_TEST_NO_PARENT_DEATH_SIGNAL");
  if (test_no_signal == nullptr || std::string(test_no_signal) != "1") {
    struct sigaction sa {};
    sa.sa_handler = on_parent_death;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(parent_death_signal(), &sa, nullptr);
    ::prctl(PR_SET_PDEATHSIG, parent_death_signal());
  } else {
    ::prctl(PR_SET_PDEATHSIG, 0);  // the test hook: no signal at all (not the launcher's SIGKILL either)
  }
  // Our launcher's ranks know their launcher: a parent that is not it means it died before the
  // guard was armed (the SIGKILL it set before exec covers the rest of that window).
  if (const char* v = std::getenv(kLauncherPidVariable); v != nullptr && std::atoi(v) != static_cast<int>(parent)) {
    [[maybe_unused]] const ssize_t w = ::write(2, g_parent_death_message, g_parent_death_message_len);
    ::_exit(kReportedErrorExitStatus);
  }
}

bool launcher_alive() {
  const pid_t parent = g_guarded_parent.load();
  return parent == 0 || ::getppid() == parent;
}

int guarded_parent_pid() { return static_cast<int>(g_guarded_parent.load()); }

}  // namespace mt
