// The timing report of `megatron pretrain` (--timing-log-level 1, --timing-log-option), in
// Megatron's format (megatron/core/timers.py Timers.log), printed by rank 0 after each
// --log-interval line. The timers themselves: core/timers.h.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/timers.h"

namespace mt {

/// --timing-log-option: the per-timer reduction across ranks.
enum class TimingLogOption { kMax, kMinMax, kAll };

/// Parses "max", "minmax" or "all"; throws mt::Error naming the value otherwise.
TimingLogOption parse_timing_log_option(const std::string& s);

/// Collective over `world` (every rank calls it at the same iteration): takes each timer's ms
/// per iteration over the last `iterations` (Timers::take), all-gathers them over `world` on
/// `stream`, and returns the report: a header ("(min, max) time across ranks (ms):" and so on)
/// and one line per timer that ran on some rank ("    forward-backward ....: (53.10, 53.42)"),
/// or with kAll one line per rank. Empty when the timers are off. max_ms (optional): receives
/// (Megatron name, max over ranks in ms per iteration) of every timer that ran (for
/// --log-timers-to-tensorboard).
std::string timing_report(Timers& timers, TimingLogOption option, Communicator& world, const Stream& stream,
                          int64_t iterations, std::vector<std::pair<std::string, float>>* max_ms = nullptr);

}  // namespace mt
