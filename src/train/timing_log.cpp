#include "train/timing_log.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/check.h"

namespace mt {

TimingLogOption parse_timing_log_option(const std::string& s) {
  if (s == "max") return TimingLogOption::kMax;
  if (s == "minmax") return TimingLogOption::kMinMax;
  if (s == "all") return TimingLogOption::kAll;
  MT_FAIL("--timing-log-option '{}': expected one of max, minmax, all", s);
}

std::string timing_report(Timers& timers, TimingLogOption option, Communicator& world, const Stream& stream,
                          int64_t iterations, std::vector<std::pair<std::string, float>>* max_ms) {
  if (!timers.active()) return {};
  constexpr size_t kPer = 2 * Timers::kCount;  // per rank: [ms per iteration, intervals] per timer
  const auto mine = timers.take(stream, iterations);
  const int n = world.size();
  const std::vector<char> gathered = all_gather_host(world, mine.data(), sizeof(mine), stream);
  std::vector<float> host(static_cast<size_t>(n) * kPer);
  std::memcpy(host.data(), gathered.data(), gathered.size());
  std::string out;
  for (size_t t = 0; t < Timers::kCount; ++t) {
    float lo = host[2 * t], hi = host[2 * t], count = 0;
    for (int r = 0; r < n; ++r) {
      const float v = host[r * kPer + 2 * t];
      lo = std::min(lo, v);
      hi = std::max(hi, v);
      count += host[r * kPer + 2 * t + 1];
    }
    if (count == 0) continue;  // this timer ran on no rank
    const std::string name = Timers::name(static_cast<Timers::Name>(t));
    if (max_ms != nullptr) max_ms->emplace_back(name, hi);
    const std::string dots(name.size() < 48 ? 48 - name.size() : 1, '.');
    switch (option) {
      case TimingLogOption::kMax:
        out += fmt::format("\n    {} {}: {:.2f}", name, dots, hi);
        break;
      case TimingLogOption::kMinMax:
        out += fmt::format("\n    {} {}: ({:.2f}, {:.2f})", name, dots, lo, hi);
        break;
      case TimingLogOption::kAll:
        out += fmt::format("\n  {}:", name);
        for (int r = 0; r < n; ++r) out += fmt::format("\n     rank {:2d}: {:.2f}", r, host[r * kPer + 2 * t]);
        break;
    }
  }
  if (out.empty()) return {};
  static constexpr const char* kHeader[] = {"(max) time across ranks (ms):", "(min, max) time across ranks (ms):",
                                            "times across ranks (ms):"};
  return kHeader[static_cast<int>(option)] + out;
}

}  // namespace mt
