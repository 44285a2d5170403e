#include "core/logging.h"

#include <atomic>

namespace mt {

namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
}

void set_log_level(LogLevel l) { g_level = static_cast<int>(l); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load()); }

void log_line(LogLevel l, const std::string& msg) {
  FILE* f = l >= LogLevel::kWarn ? stderr : stdout;
  const char* prefix = l == LogLevel::kWarn ? "warning: " : (l == LogLevel::kError ? "error: " : "");
  std::fprintf(f, "%s%s\n", prefix, msg.c_str());
  std::fflush(f);
}

}  // namespace mt
