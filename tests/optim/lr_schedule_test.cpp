// Tests of optim/lr_schedule.h (Megatron's OptimizerParamScheduler.get_lr) against worked
// numbers computed by hand from Megatron's formulas, plus the configuration errors.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <string>

#include "core/check.h"
#include "optim/lr_schedule.h"

namespace mt {
namespace {

constexpr double kTol = 1e-12;

LrScheduleConfig cfg(const std::string& style, double max_lr = 1.0, double min_lr = 0.1, int64_t warmup = 10,
                     int64_t decay = 110) {
  LrScheduleConfig c;
  c.max_lr = max_lr;
  c.min_lr = min_lr;
  c.warmup_steps = warmup;
  c.decay_steps = decay;
  c.decay_style = style;
  return c;
}

/// Expects mt::Error whose message contains `needle` (the offending value).
void expect_error(const LrScheduleConfig& c, int64_t step, const std::string& needle) {
  try {
    learning_rate(c, step);
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(LrSchedule, LinearWarmupThenLinearDecay) {
  const auto c = cfg("linear");
  // Warmup: max_lr * step / warmup_steps, including step == warmup_steps.
  EXPECT_NEAR(learning_rate(c, 0), 0.0, kTol);
  EXPECT_NEAR(learning_rate(c, 1), 0.1, kTol);
  EXPECT_NEAR(learning_rate(c, 5), 0.5, kTol);
  EXPECT_NEAR(learning_rate(c, 10), 1.0, kTol);
  // Decay: r = (step - 10) / 100, lr = 0.1 + (1 - r) * 0.9.
  EXPECT_NEAR(learning_rate(c, 11), 0.1 + 0.99 * 0.9, kTol);
  EXPECT_NEAR(learning_rate(c, 35), 0.775, kTol);
  EXPECT_NEAR(learning_rate(c, 60), 0.55, kTol);
  EXPECT_NEAR(learning_rate(c, 110), 0.1, kTol);
  // Past decay_steps: min_lr.
  EXPECT_EQ(learning_rate(c, 111), 0.1);
  EXPECT_EQ(learning_rate(c, 100000), 0.1);
}

TEST(LrSchedule, CosineDecay) {
  const auto c = cfg("cosine");
  EXPECT_NEAR(learning_rate(c, 5), 0.5, kTol);
  EXPECT_NEAR(learning_rate(c, 10), 1.0, kTol);
  // r = 0.25: coeff = (cos(pi/4) + 1) / 2 = 0.8535533905932737 -> 0.1 + 0.9 * coeff.
  EXPECT_NEAR(learning_rate(c, 35), 0.8681980515339464, kTol);
  EXPECT_NEAR(learning_rate(c, 60), 0.55, kTol);
  // r = 0.75: coeff = 0.14644660940672627.
  EXPECT_NEAR(learning_rate(c, 85), 0.23180194846605364, kTol);
  EXPECT_NEAR(learning_rate(c, 110), 0.1, kTol);
  EXPECT_EQ(learning_rate(c, 111), 0.1);
  // A GPT-3-style configuration: --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 2000
  // --lr-decay-iters 320000 --lr-decay-style cosine; halfway through the decay: (6e-4 + 6e-5) / 2.
  const auto g = cfg("cosine", 6e-4, 6e-5, 2000, 320000);
  EXPECT_NEAR(learning_rate(g, 1000), 3e-4, 1e-15);
  EXPECT_NEAR(learning_rate(g, 161000), 3.3e-4, 1e-15);
}

TEST(LrSchedule, ConstantKeepsWarmup) {
  const auto c = cfg("constant");
  EXPECT_NEAR(learning_rate(c, 5), 0.5, kTol);
  EXPECT_EQ(learning_rate(c, 10), 1.0);
  EXPECT_EQ(learning_rate(c, 50), 1.0);
  EXPECT_EQ(learning_rate(c, 1000000), 1.0);  // constant ignores decay_steps
  auto no_decay = cfg("constant", 3e-4, 0, 0, 0);
  EXPECT_EQ(learning_rate(no_decay, 0), 3e-4);
  EXPECT_EQ(learning_rate(no_decay, 7), 3e-4);
}

TEST(LrSchedule, InverseSquareRoot) {
  const auto c = cfg("inverse-square-root", 1.0, 0.01, 16, 1000);
  EXPECT_NEAR(learning_rate(c, 8), 0.5, kTol);  // warmup
  EXPECT_NEAR(learning_rate(c, 16), 1.0, kTol);
  EXPECT_NEAR(learning_rate(c, 64), 0.5, kTol);   // sqrt(16) / sqrt(64)
  EXPECT_NEAR(learning_rate(c, 100), 0.4, kTol);  // 4 / 10
  EXPECT_NEAR(learning_rate(c, 1000), 4.0 / std::sqrt(1000.0), kTol);
  EXPECT_EQ(learning_rate(c, 1001), 0.01);  // past decay_steps: min_lr
  // Clamped below by min_lr.
  const auto k = cfg("inverse-square-root", 1.0, 0.3, 16, 1000);
  EXPECT_NEAR(learning_rate(k, 100), 0.4, kTol);
  EXPECT_NEAR(learning_rate(k, 400), 0.3, kTol);  // 0.2 -> 0.3
  // No warmup: max(warmup, 1) = 1, max(step, 1).
  const auto z = cfg("inverse-square-root", 1.0, 0.0, 0, 1000);
  EXPECT_NEAR(learning_rate(z, 0), 1.0, kTol);
  EXPECT_NEAR(learning_rate(z, 1), 1.0, kTol);
  EXPECT_NEAR(learning_rate(z, 4), 0.5, kTol);
}

TEST(LrSchedule, NoWarmupStartsAtMaxLr) {
  const auto c = cfg("linear", 2.0, 0.0, 0, 100);
  EXPECT_EQ(learning_rate(c, 0), 2.0);
  EXPECT_NEAR(learning_rate(c, 25), 1.5, kTol);
  EXPECT_NEAR(learning_rate(c, 100), 0.0, kTol);
}

TEST(LrSchedule, WarmupInitLr) {
  auto c = cfg("linear");
  c.warmup_init_lr = 0.2;
  EXPECT_NEAR(learning_rate(c, 0), 0.2, kTol);
  EXPECT_NEAR(learning_rate(c, 5), 0.6, kTol);
  EXPECT_NEAR(learning_rate(c, 10), 1.0, kTol);
}

TEST(LrSchedule, WarmupStableDecay) {
  auto c = cfg("WSD");
  c.wsd_decay_steps = 20;  // anneal over steps (90, 110]
  for (const char* style : {"linear", "cosine", "exponential", "minus_sqrt"}) {
    c.wsd_decay_style = style;
    EXPECT_NEAR(learning_rate(c, 5), 0.5, kTol) << style;
    EXPECT_EQ(learning_rate(c, 50), 1.0) << style;
    EXPECT_EQ(learning_rate(c, 90), 1.0) << style;
    EXPECT_NEAR(learning_rate(c, 110), 0.1, kTol) << style;
    EXPECT_EQ(learning_rate(c, 111), 0.1) << style;
  }
  // w = 0.5 at step 100; w = 0.25 at step 95.
  c.wsd_decay_style = "linear";
  EXPECT_NEAR(learning_rate(c, 100), 0.55, kTol);
  c.wsd_decay_style = "cosine";
  EXPECT_NEAR(learning_rate(c, 100), 0.55, kTol);
  c.wsd_decay_style = "exponential";  // 2 * 0.5^0.5 - 1 = 0.41421356237309515
  EXPECT_NEAR(learning_rate(c, 100), 0.1 + 0.9 * (std::numbers::sqrt2 - 1.0), kTol);
  c.wsd_decay_style = "minus_sqrt";  // 1 - sqrt(0.25) = 0.5
  EXPECT_NEAR(learning_rate(c, 95), 0.55, kTol);
}

TEST(LrSchedule, MonotoneAfterWarmup) {
  for (const char* style : {"linear", "cosine", "inverse-square-root"}) {
    const auto c = cfg(style, 3e-4, 3e-5, 100, 1000);
    double prev = learning_rate(c, 100);
    EXPECT_NEAR(prev, 3e-4, 1e-18) << style;
    for (int64_t s = 101; s <= 1100; ++s) {
      const double lr = learning_rate(c, s);
      EXPECT_LE(lr, prev) << style << " step " << s;
      EXPECT_GE(lr, 3e-5) << style << " step " << s;
      prev = lr;
    }
  }
}

TEST(LrSchedule, RejectsBadConfigurations) {
  expect_error(cfg("cosin"), 0, "cosin");
  expect_error(cfg("linear", 1e-4, 1e-3), 0, "0.001");         // min_lr > max_lr
  expect_error(cfg("linear", 1.0, -0.5), 0, "-0.5");           // negative min_lr
  expect_error(cfg("linear", 1.0, 0.1, 10, 10), 0, "decay_steps=10");
  expect_error(cfg("cosine", 1.0, 0.1, 200, 100), 0, "warmup_steps=200");
  expect_error(cfg("inverse-square-root", 1.0, 0.1, 0, 0), 0, "decay_steps=0");
  expect_error(cfg("linear", 1.0, 0.1, -3, 100), 0, "warmup_steps=-3");
  expect_error(cfg("constant", 1.0, 0.1, 0, -7), 0, "decay_steps=-7");
  expect_error(cfg("linear"), -1, "step=-1");
  auto w = cfg("WSD");
  w.wsd_decay_steps = 0;
  expect_error(w, 0, "wsd_decay_steps=0");
  w.wsd_decay_steps = 500;
  expect_error(w, 0, "wsd_decay_steps=500");
  w.wsd_decay_steps = 20;
  w.wsd_decay_style = "square";
  expect_error(w, 0, "square");
  auto init = cfg("linear");
  init.warmup_init_lr = 2.0;
  expect_error(init, 0, "warmup_init_lr=2");
  EXPECT_THROW(validate(cfg("Cosine")), Error);  // style names are case-sensitive, as in Megatron
  EXPECT_NO_THROW(validate(cfg("constant", 1.0, 0.1, 10, 5)));  // constant: decay_steps unused
}

}  // namespace
}  // namespace mt
