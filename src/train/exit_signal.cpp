#include "train/exit_signal.h"

#include <signal.h>

#include <atomic>

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
