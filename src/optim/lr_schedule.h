// Megatron's learning-rate schedule (megatron/core/optimizer_param_scheduler.py,
// OptimizerParamScheduler.get_lr) as a pure host function of the step count.
//
// A step is the unit of the schedule's lengths: iterations for iteration-based training
// (--lr-warmup-iters, --lr-decay-iters), samples for sample-based training (--train-samples,
// --lr-warmup-samples, --lr-decay-samples; PretrainArgs::lr_step). Megatron counts samples in
// both cases; with a constant global batch size the rates are the same.
#pragma once
#include <cstdint>
#include <string>

namespace mt {

struct LrScheduleConfig {
  double max_lr = 0;           ///< --lr
  double min_lr = 0;           ///< --min-lr
  /// --lr-warmup-iters / --lr-warmup-samples, or --lr-warmup-fraction · decay_steps (not an
  /// integer then, as in Megatron)
  double warmup_steps = 0;
  int64_t decay_steps = 0;     ///< --lr-decay-iters (Megatron defaults it to --train-iters)
  /// --lr-decay-style: "constant", "linear", "cosine", "inverse-square-root" or "WSD".
  std::string decay_style = "linear";
  double warmup_init_lr = 0;   ///< --lr-warmup-init: learning rate at step 0 of the warmup
  int64_t wsd_decay_steps = 0; ///< --lr-wsd-decay-iters (WSD only: length of the final anneal)
  /// --lr-wsd-decay-style (WSD only): "linear", "cosine", "exponential" or "minus_sqrt".
  std::string wsd_decay_style = "exponential";
};

/// Throws mt::Error naming the bad value: unknown decay or WSD style; min_lr < 0; max_lr <
/// min_lr; warmup_init_lr > max_lr or < 0; negative step counts; decay_steps <= warmup_steps
/// (or decay_steps <= 0) for every style except "constant"; WSD with wsd_decay_steps not in
/// [1, decay_steps].
void validate(const LrScheduleConfig& cfg);

/// Learning rate after `step` iterations (step >= 0), as Megatron's get_lr:
///   warmup_steps > 0 and step <= warmup_steps: warmup_init_lr + (max_lr - warmup_init_lr) * step / warmup_steps
///   "constant": max_lr
///   step > decay_steps: min_lr
///   "inverse-square-root": max(min_lr, max_lr * sqrt(max(warmup_steps, 1)) / sqrt(max(step, 1)))
///   else with r = (step - warmup_steps) / (decay_steps - warmup_steps), lr = min_lr + c * (max_lr - min_lr):
///     "linear": c = 1 - r;  "cosine": c = (cos(pi r) + 1) / 2;
///     "WSD": c = 1 until step <= decay_steps - wsd_decay_steps, then with
///            w = (step - (decay_steps - wsd_decay_steps)) / wsd_decay_steps:
///            linear 1 - w, cosine (cos(pi w) + 1) / 2, exponential 2 * 0.5^w - 1, minus_sqrt 1 - sqrt(w).
/// Validates cfg (see validate) and throws mt::Error for step < 0.
double learning_rate(const LrScheduleConfig& cfg, int64_t step);

}  // namespace mt
