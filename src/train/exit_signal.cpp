#include "train/exit_signal.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include <fmt/format.h>

namespace mt {
namespace {
std::atomic<int> g_received{0};
struct sigaction g_old_term, g_old_int, g_old_usr1;
extern "C" void on_exit_signal(int sig) { g_received.store(sig); }
}  // namespace

ExitSignalHandler::ExitSignalHandler() {
  g_received.store(0);
  struct sigaction sa {};
  sa.sa_handler = on_exit_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, &g_old_term);
  sigaction(SIGINT, &sa, &g_old_int);
  sigaction(SIGUSR1, &sa, &g_old_usr1);
}

ExitSignalHandler::~ExitSignalHandler() {
  sigaction(SIGTERM, &g_old_term, nullptr);
  sigaction(SIGINT, &g_old_int, nullptr);
  sigaction(SIGUSR1, &g_old_usr1, nullptr);
}

int ExitSignalHandler::received() { return g_received.load(); }

}  // namespace mt

namespace mt {

ExitPolicy::ExitPolicy(ExitPolicyOptions options, Communicator& world, const Stream& stream)
    : options_(std::move(options)), world_(world), stream_(stream), start_(std::chrono::steady_clock::now()) {}

std::string ExitPolicy::check(int64_t iteration) const {
  const ExitPolicyOptions& o = options_;
  std::string reason = o.exit_interval > 0 && iteration % o.exit_interval == 0
                           ? fmt::format("--exit-interval {}", o.exit_interval)
                           : std::string();
  if (!o.received_signal && o.exit_duration_in_mins <= 0) return reason;
  const double minutes = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count() / 60.0;
  int32_t mine[2] = {o.received_signal ? o.received_signal() : 0,
                     o.exit_duration_in_mins > 0 && minutes > o.exit_duration_in_mins ? 1 : 0};
  if (world_.size() > 1) {
    const std::vector<char> all = all_gather_host(world_, mine, sizeof(mine), stream_);
    for (int r = 0; r < world_.size(); ++r) {
      int32_t v[2];
      std::memcpy(v, all.data() + r * sizeof(mine), sizeof(mine));
      mine[0] = std::max(mine[0], v[0]);
      mine[1] = std::max(mine[1], v[1]);
    }
  }
  if (mine[0] != 0)
    return fmt::format("received signal {} (--exit-signal-handler)",
                       mine[0] == SIGTERM ? "SIGTERM" : mine[0] == SIGINT ? "SIGINT" : "SIGUSR1");
  if (mine[1] != 0) return fmt::format("--exit-duration-in-mins {} reached", o.exit_duration_in_mins);
  return reason;
}

}  // namespace mt
