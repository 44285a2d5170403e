#include "train/batch_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>

#include "core/check.h"

namespace mt {

namespace {

// StepBatchsizeNumMicroBatchesCalculator._parse_numeric_value: int(float(value) * multiplier) with
// an optional K / M / B / T suffix (case-insensitive).
int64_t parse_schedule_number(const std::string& entry, std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double multiplier = 1;
  if (!s.empty()) {
    switch (s.back()) {
      case 'T': multiplier = 1e12; break;
      case 'B': multiplier = 1e9; break;
      case 'M': multiplier = 1e6; break;
      case 'K': multiplier = 1e3; break;
      default: break;
    }
    if (multiplier != 1) s.pop_back();
  }
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  MT_REQUIRE(!s.empty() && ec == std::errc() && end == s.data() + s.size() && std::isfinite(v * multiplier) &&
                 std::fabs(v * multiplier) < 9.2e18,
             "--step-batch-size-schedule: '{}' in entry '{}' is not a number (expected digits with an optional K, M, "
             "B or T suffix, e.g. 2.4B)",
             s, entry);
  return static_cast<int64_t>(v * multiplier);  // Python's int(): truncation toward zero
}

}  // namespace

BatchSizeSchedule::BatchSizeSchedule(int64_t global_batch_size) : final_(global_batch_size) {
  MT_REQUIRE(global_batch_size > 0, "global batch size must be positive, got {}", global_batch_size);
}

BatchSizeSchedule BatchSizeSchedule::rampup(const std::vector<int64_t>& v, int64_t global_batch_size) {
  MT_REQUIRE(v.size() == 3,
             "--rampup-batch-size takes 3 values (<start batch size> <batch size increment> <ramp-up samples>), got {}",
             v.size());
  MT_REQUIRE(global_batch_size > 0, "global batch size should be positive, got {}", global_batch_size);
  MT_REQUIRE(v[0] > 0, "--rampup-batch-size: start batch size should be positive, got {}", v[0]);
  MT_REQUIRE(v[1] > 0, "--rampup-batch-size: batch size increment should be positive, got {}", v[1]);
  MT_REQUIRE(v[2] > 0,
             "--rampup-batch-size: ramp-up samples should be positive, got {} (Megatron-LM accepts 0 and then divides "
             "by zero)",
             v[2]);
  const int64_t diff = global_batch_size - v[0];
  MT_REQUIRE(diff >= 0,
             "--rampup-batch-size: expected --global-batch-size ({}) to be greater than or equal to the start batch "
             "size ({})",
             global_batch_size, v[0]);
  MT_REQUIRE(diff % v[1] == 0,
             "--rampup-batch-size: the global batch size interval {} - {} = {} is not divisible by the increment {}",
             global_batch_size, v[0], diff, v[1]);
  MT_REQUIRE(diff > 0,
             "--rampup-batch-size: the start batch size equals --global-batch-size ({}): there is nothing to ramp "
             "(Megatron-LM divides by zero increments); drop the flag",
             global_batch_size);
  BatchSizeSchedule s(global_batch_size);
  s.kind_ = Kind::kRampup;
  s.start_ = v[0];
  s.increment_ = v[1];
  s.ramp_samples_ = v[2];
  s.samples_per_increment_ = static_cast<double>(v[2]) / static_cast<double>(diff / v[1]);
  return s;
}

BatchSizeSchedule BatchSizeSchedule::steps(const std::vector<std::string>& words, int64_t seq_length) {
  MT_REQUIRE(seq_length > 0, "--step-batch-size-schedule needs --seq-length (thresholds are in tokens), got {}",
             seq_length);
  std::vector<std::string> entries;
  for (const std::string& w : words) {
    std::string cur;
    for (char c : w + " ") {
      if (c == ',' || std::isspace(static_cast<unsigned char>(c))) {
        if (!cur.empty()) entries.push_back(cur);
        cur.clear();
      } else {
        cur += c;
      }
    }
  }
  MT_REQUIRE(!entries.empty(), "--step-batch-size-schedule: the schedule must have at least one entry");
  BatchSizeSchedule s;
  s.kind_ = Kind::kSteps;
  for (const std::string& e : entries) {
    const size_t colon = e.find(':');
    MT_REQUIRE(colon != std::string::npos, "--step-batch-size-schedule: invalid entry '{}'; expected THRESHOLD:BATCH_SIZE",
               e);
    const int64_t tokens = parse_schedule_number(e, e.substr(0, colon));
    const int64_t batch = parse_schedule_number(e, e.substr(colon + 1));
    // Python's //: floor division (a negative threshold stays negative)
    const int64_t samples = tokens / seq_length - ((tokens % seq_length != 0 && tokens < 0) ? 1 : 0);
    s.steps_.emplace_back(samples, batch);
  }
  std::stable_sort(s.steps_.begin(), s.steps_.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  MT_REQUIRE(s.steps_[0].first == 0,
             "--step-batch-size-schedule: the first entry must have threshold 0, got {} samples ({} tokens // "
             "--seq-length {})",
             s.steps_[0].first, s.steps_[0].first * seq_length, seq_length);
  for (size_t i = 0; i < s.steps_.size(); ++i) {
    MT_REQUIRE(s.steps_[i].second > 0, "--step-batch-size-schedule: batch size must be positive, got {}",
               s.steps_[i].second);
    if (i == 0) continue;
    MT_REQUIRE(s.steps_[i].first > s.steps_[i - 1].first,
               "--step-batch-size-schedule: thresholds must be strictly increasing in samples (tokens // --seq-length "
               "{}), got {} before {}",
               seq_length, s.steps_[i - 1].first, s.steps_[i].first);
    MT_REQUIRE(s.steps_[i].second >= s.steps_[i - 1].second,
               "--step-batch-size-schedule: batch size {} after {}: the number of micro-batches must not decrease "
               "(Megatron-LM's training loop asserts it when the step is reached)",
               s.steps_[i].second, s.steps_[i - 1].second);
  }
  s.final_ = s.steps_.back().second;
  return s;
}

int64_t BatchSizeSchedule::at(int64_t consumed) const {
  switch (kind_) {
    case Kind::kConstant:
      return final_;
    case Kind::kRampup: {
      if (consumed > ramp_samples_) return final_;
      // int(consumed_samples / rampup_samples_per_increment), in doubles as Python computes it
      const auto steps = static_cast<int64_t>(static_cast<double>(consumed) / samples_per_increment_);
      return std::min(start_ + steps * increment_, final_);
    }
    case Kind::kSteps: {
      int64_t b = steps_[0].second;
      for (const auto& [threshold, batch] : steps_) {
        if (consumed < threshold) break;
        b = batch;
      }
      return b;
    }
  }
  return final_;
}

int64_t BatchSizeSchedule::train_iters(int64_t train_samples) const {
  int64_t iterations = 0, consumed = 0;
  switch (kind_) {
    case Kind::kConstant:
      return train_samples / final_;
    case Kind::kRampup:
      while (consumed <= ramp_samples_ && consumed <= train_samples) {
        consumed += at(consumed);
        ++iterations;
      }
      if (train_samples > consumed) iterations += (train_samples - consumed) / final_;  // a partial batch is dropped
      return iterations;
    case Kind::kSteps:
      // Constant after the last threshold: the loop is only walked up to it.
      while (consumed < train_samples && consumed < steps_.back().first) {
        consumed += at(consumed);
        ++iterations;
      }
      if (consumed < train_samples) iterations += (train_samples - consumed + final_ - 1) / final_;
      return iterations;
  }
  return 0;
}

std::vector<int64_t> BatchSizeSchedule::sizes_used(int64_t iterations) const {
  std::vector<int64_t> out;
  const int64_t last_change = kind_ == Kind::kRampup ? ramp_samples_ + 1
                              : kind_ == Kind::kSteps ? steps_.back().first
                                                      : 0;
  int64_t consumed = 0;
  for (int64_t i = 0; i < iterations; ++i) {
    const int64_t b = at(consumed);
    if (out.empty() || out.back() != b) out.push_back(b);
    if (consumed >= last_change) break;  // constant from here on
    consumed += b;
  }
  return out;
}

std::string BatchSizeSchedule::describe() const {
  switch (kind_) {
    case Kind::kConstant:
      return fmt::format("constant global batch size {}", final_);
    case Kind::kRampup:
      return fmt::format("batch-size ramp-up from {} by {} every {:.2f} samples to {} after {} samples "
                         "(--rampup-batch-size)",
                         start_, increment_, samples_per_increment_, final_, ramp_samples_);
    case Kind::kSteps: {
      std::string s = "step batch-size schedule (--step-batch-size-schedule):";
      for (const auto& [threshold, batch] : steps_) s += fmt::format(" {} from {} samples,", batch, threshold);
      s.pop_back();
      return s;
    }
  }
  return "";
}

}  // namespace mt
