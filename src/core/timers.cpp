#include "core/timers.h"

#include "core/check.h"

namespace mt {

const char* Timers::name(Name n) {
  static constexpr std::array<const char*, kCount> names = {
      "forward-backward",         "embedding-grads-all-reduce", "all-grads-sync", "optimizer-clip-main-grad",
      "optimizer-inner-step",     "params-all-gather",          "optimizer"};
  MT_REQUIRE(n >= 0 && n < kCount, "Timers::name: no timer {}", static_cast<int>(n));
  return names[static_cast<size_t>(n)];
}

Timers::Timers(int log_level, Device device) : level_(log_level), device_(device) { check_level(log_level); }

void Timers::check_level(int log_level) {
  MT_REQUIRE(log_level == 0 || log_level == 1,
             "--timing-log-level {}: expected 0 (off) or 1 (Megatron's level-2 per-micro-batch timers are not "
             "implemented)",
             log_level);
}

void Timers::start(Name n, const Stream& stream) {
  if (!active()) return;
  const size_t i = static_cast<size_t>(n);
  MT_REQUIRE(!running_[i], "timer '{}' started while running", name(n));
  if (used_[i] == intervals_[i].size())
    intervals_[i].push_back({std::make_unique<Event>(device_), std::make_unique<Event>(device_)});
  intervals_[i][used_[i]].begin->record(stream);
  running_[i] = true;
}

void Timers::stop(Name n, const Stream& stream) {
  if (!active()) return;
  const size_t i = static_cast<size_t>(n);
  MT_REQUIRE(running_[i], "timer '{}' stopped while not running", name(n));
  intervals_[i][used_[i]].end->record(stream);
  ++used_[i];
  running_[i] = false;
}

std::array<float, 2 * Timers::kCount> Timers::take(const Stream& stream, int64_t iterations) {
  MT_REQUIRE(iterations > 0, "Timers::take: iterations must be positive, got {}", iterations);
  std::array<float, 2 * kCount> out{};
  if (!active()) return out;
  stream.synchronize();
  for (size_t t = 0; t < kCount; ++t) {
    double ms = 0;
    for (size_t k = 0; k < used_[t]; ++k) ms += intervals_[t][k].end->elapsed_ms_since(*intervals_[t][k].begin);
    out[2 * t] = static_cast<float>(ms / static_cast<double>(iterations));
    out[2 * t + 1] = static_cast<float>(used_[t]);
    used_[t] = 0;
  }
  return out;
}

}  // namespace mt
