// Megatron's OptimizerParamScheduler.get_lr as a pure function (see optim/lr_schedule.h).
#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/check.h"

namespace mt {
namespace {

bool is_decay_style(const std::string& s) {
  return s == "constant" || s == "linear" || s == "cosine" || s == "inverse-square-root" || s == "WSD";
}
bool is_wsd_style(const std::string& s) {
  return s == "linear" || s == "cosine" || s == "exponential" || s == "minus_sqrt";
}

}  // namespace

void validate(const LrScheduleConfig& cfg) {
  MT_REQUIRE(is_decay_style(cfg.decay_style),
             "lr schedule: unknown decay style '{}' (expected constant, linear, cosine, inverse-square-root or WSD)",
             cfg.decay_style);
  MT_REQUIRE(std::isfinite(cfg.max_lr) && std::isfinite(cfg.min_lr) && std::isfinite(cfg.warmup_init_lr),
             "lr schedule: max_lr={} min_lr={} warmup_init_lr={} must be finite", cfg.max_lr, cfg.min_lr,
             cfg.warmup_init_lr);
  MT_REQUIRE(cfg.min_lr >= 0, "lr schedule: min_lr={} must be >= 0", cfg.min_lr);
  MT_REQUIRE(cfg.max_lr >= cfg.min_lr, "lr schedule: max_lr={} must be >= min_lr={}", cfg.max_lr, cfg.min_lr);
  MT_REQUIRE(cfg.warmup_init_lr >= 0 && cfg.warmup_init_lr <= cfg.max_lr,
             "lr schedule: warmup_init_lr={} must be in [0, max_lr={}]", cfg.warmup_init_lr, cfg.max_lr);
  MT_REQUIRE(std::isfinite(cfg.warmup_steps) && cfg.warmup_steps >= 0, "lr schedule: warmup_steps={} must be >= 0",
             cfg.warmup_steps);
  MT_REQUIRE(cfg.decay_steps >= 0, "lr schedule: decay_steps={} must be >= 0", cfg.decay_steps);
  if (cfg.decay_style != "constant") {
    MT_REQUIRE(cfg.decay_steps > 0 && static_cast<double>(cfg.decay_steps) > cfg.warmup_steps,
               "lr schedule: decay_steps={} must be > 0 and > warmup_steps={} for decay style '{}'", cfg.decay_steps,
               cfg.warmup_steps, cfg.decay_style);
  }
  if (cfg.decay_style == "WSD") {
    MT_REQUIRE(is_wsd_style(cfg.wsd_decay_style),
               "lr schedule: unknown WSD decay style '{}' (expected linear, cosine, exponential or minus_sqrt)",
               cfg.wsd_decay_style);
    MT_REQUIRE(cfg.wsd_decay_steps > 0 && cfg.wsd_decay_steps <= cfg.decay_steps,
               "lr schedule: wsd_decay_steps={} must be in [1, decay_steps={}] for decay style WSD",
               cfg.wsd_decay_steps, cfg.decay_steps);
  }
}

double learning_rate(const LrScheduleConfig& cfg, int64_t step) {
  validate(cfg);
  MT_REQUIRE(step >= 0, "lr schedule: step={} must be >= 0", step);
  const double max_lr = cfg.max_lr, min_lr = cfg.min_lr;

  // Linear warmup from warmup_init_lr to max_lr.
  if (cfg.warmup_steps > 0 && static_cast<double>(step) <= cfg.warmup_steps) {
    return cfg.warmup_init_lr + (max_lr - cfg.warmup_init_lr) * static_cast<double>(step) / cfg.warmup_steps;
  }
  if (cfg.decay_style == "constant") return max_lr;
  if (step > cfg.decay_steps) return min_lr;

  if (cfg.decay_style == "inverse-square-root") {
    const double w = std::max(cfg.warmup_steps, 1.0);
    const double s = static_cast<double>(std::max<int64_t>(step, 1));
    return std::max(min_lr, max_lr * std::sqrt(w) / std::sqrt(s));
  }

  const double ratio = (static_cast<double>(step) - cfg.warmup_steps) /
                       (static_cast<double>(cfg.decay_steps) - cfg.warmup_steps);
  MT_CHECK(ratio >= 0.0 && ratio <= 1.0, "decay ratio {} at step {}", ratio, step);
  double coeff = 0;
  if (cfg.decay_style == "linear") {
    coeff = 1.0 - ratio;
  } else if (cfg.decay_style == "cosine") {
    coeff = 0.5 * (std::cos(std::numbers::pi * ratio) + 1.0);
  } else {  // WSD: stable at max_lr, then anneal over the last wsd_decay_steps steps
    const int64_t anneal_start = cfg.decay_steps - cfg.wsd_decay_steps;
    if (step <= anneal_start) {
      coeff = 1.0;
    } else {
      const double w = static_cast<double>(step - anneal_start) / static_cast<double>(cfg.wsd_decay_steps);
      if (cfg.wsd_decay_style == "linear") {
        coeff = 1.0 - w;
      } else if (cfg.wsd_decay_style == "cosine") {
        coeff = 0.5 * (std::cos(std::numbers::pi * w) + 1.0);
      } else if (cfg.wsd_decay_style == "exponential") {
        coeff = 2.0 * std::pow(0.5, w) - 1.0;
      } else {  // minus_sqrt
        coeff = 1.0 - std::sqrt(w);
      }
    }
  }
  return min_lr + coeff * (max_lr - min_lr);
}

}  // namespace mt
