// --decoupled-lr / --decoupled-min-lr (Megatron's param group of is_embedding_or_output_parameter
// with its own max_lr / min_lr): the optimizer steps the word embedding and the output layer at
// their own rate, every other parameter at --lr; the schedule of that rate. The layouts (TP, PP,
// distributed optimizer) equal one rank in tests/parallel/parallel_layouts_test.cpp.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <bit>
#include <cmath>
#include <string>
#include <vector>

#include "ops/elementwise.h"
#include "ops/optimizer.h"
#include "optim/optimizer.h"
#include "testing/testing.h"
#include "train/arguments.h"

namespace mt {
namespace {

// Names as the model declares them; shapes small. weight_decay as Megatron's rule (1-D: none).
std::vector<ParamSpec> tiny_specs() {
  std::vector<ParamSpec> s;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    ParamSpec p;
    p.name = name;
    p.shape = shape;
    p.global_shape = shape;
    p.weight_decay = shape.size() > 1;
    s.push_back(p);
  };
  add("embedding.word_embeddings.weight", {5, 3});
  add("embedding.position_embeddings.weight", {4, 3});
  add("decoder.layers.0.mlp.linear_fc1.weight", {6, 3});
  add("decoder.layers.0.mlp.linear_fc1.bias", {6});
  add("decoder.final_layernorm.weight", {3});
  add("output_layer.weight", {5, 3});
  return s;
}

float value(size_t param, int64_t e, int salt) {
  return std::sin(0.37f * static_cast<float>(param * 31 + static_cast<size_t>(e) * 7 + static_cast<size_t>(salt)));
}

struct RunResult {
  std::vector<std::vector<float>> params;
};

// Two AdamW steps on the tiny store: parameters set, gradients set per step, then step(lr[k], ...,
// decoupled_lr[k]); via_ptr: the rates read from (host) memory as a captured step reads them.
RunResult run(bool decoupled, const float lr[2], const float dlr[2], bool via_ptr) {
  Stream st(Device::cpu());
  ParamStore P(tiny_specs(), DType::kF32, Device::cpu());
  OptimizerConfig oc;
  oc.weight_decay = 0.1f;
  oc.clip_grad = 0.f;  // off: the hand computation below has no clipping factor
  oc.decoupled_lr = decoupled;
  AdamWOptimizer opt(P, oc, st);
  // The alignment padding between parameters is part of the optimizer's runs: zero, as the
  // trainer's zero_grad_buffer and initialize leave it.
  fill(P.main_flat(), 0.f, st);
  fill(P.grads_flat(), 0.f, st);
  for (size_t i = 0; i < P.size(); ++i) {
    std::vector<float> v(static_cast<size_t>(P.info(i).numel));
    for (size_t e = 0; e < v.size(); ++e) v[e] = value(i, static_cast<int64_t>(e), 0);
    testing::upload(P.main(i), v, st);
  }
  float rates[2];
  for (int k = 0; k < 2; ++k) {
    for (size_t i = 0; i < P.size(); ++i) {
      std::vector<float> g(static_cast<size_t>(P.info(i).numel));
      for (size_t e = 0; e < g.size(); ++e) g[e] = value(i, static_cast<int64_t>(e), 100 + k);
      testing::upload(P.grad(i), g, st);
    }
    rates[0] = lr[k];
    rates[1] = dlr[k];
    if (via_ptr)
      opt.step(0.f, st, nullptr, &rates[0], 0.f, &rates[1]);  // the plain rates unused
    else
      opt.step(lr[k], st, nullptr, nullptr, dlr[k]);
  }
  RunResult r;
  for (size_t i = 0; i < P.size(); ++i) r.params.push_back(testing::to_host(P.main(i), st));
  return r;
}

// The documented update (ops/optimizer.h adamw_step; ops/optimizer_math.h adamw_element's fmaf
// order), two steps, by hand.
std::vector<float> by_hand(size_t i, int64_t n, bool decay, const float lr[2]) {
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = decay ? 0.1f : 0.f;
  std::vector<float> out;
  for (int64_t e = 0; e < n; ++e) {
    float p = value(i, e, 0), m = 0, v = 0;
    for (int k = 0; k < 2; ++k) {
      const float g = value(i, e, 100 + k);  // loss scale 1, no clipping
      const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), k + 1));  // fp32 betas
      const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(b2), k + 1));
      m = std::fmaf(b1, m, (1.f - b1) * g);
      v = std::fmaf(b2, v, ((1.f - b2) * g) * g);
      const float denom = std::sqrt(v / bc2) + eps;
      const float update = std::fmaf(wd, p, (m / bc1) / denom);
      p = std::fmaf(-lr[k], update, p);
    }
    out.push_back(p);
  }
  return out;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](float x, float y) {
           return std::bit_cast<uint32_t>(x) == std::bit_cast<uint32_t>(y);
         });
}

TEST(DecoupledLr, EmbeddingAndOutputLayerStepAtTheirOwnRate) {
  const float lr[2] = {1e-2f, 8e-3f}, dlr[2] = {5e-2f, 3e-2f};
  const auto specs = tiny_specs();
  for (const bool via_ptr : {false, true}) {
    const RunResult r = run(true, lr, dlr, via_ptr);
    for (size_t i = 0; i < specs.size(); ++i) {
      int64_t n = 1;
      for (const int64_t x : specs[i].shape) n *= x;
      ParamInfo info;
      static_cast<ParamSpec&>(info) = specs[i];
      const bool decoupled = is_embedding_or_output_parameter(info);
      EXPECT_EQ(decoupled, i == 0 || i == 5) << specs[i].name;  // not the position embedding
      EXPECT_TRUE(bitwise_equal(r.params[i], by_hand(i, n, specs[i].weight_decay, decoupled ? dlr : lr)))
          << specs[i].name << (via_ptr ? " (rates from memory)" : "");
      // ... and not what the other rate gives (the test can see a wrong group).
      EXPECT_FALSE(bitwise_equal(r.params[i], by_hand(i, n, specs[i].weight_decay, decoupled ? lr : dlr)))
          << specs[i].name;
    }
  }
}

// Without --decoupled-lr the decoupled rate is ignored: every parameter at --lr, the same bits as
// a decoupled run whose two rates are equal.
TEST(DecoupledLr, AbsentIsOneRate) {
  const float lr[2] = {1e-2f, 8e-3f}, dlr[2] = {5e-2f, 3e-2f};
  const RunResult off = run(false, lr, dlr, false), same = run(true, lr, lr, false);
  const auto specs = tiny_specs();
  for (size_t i = 0; i < specs.size(); ++i) {
    int64_t n = 1;
    for (const int64_t x : specs[i].shape) n *= x;
    EXPECT_TRUE(bitwise_equal(off.params[i], by_hand(i, n, specs[i].weight_decay, lr))) << specs[i].name;
    EXPECT_TRUE(bitwise_equal(off.params[i], same.params[i])) << specs[i].name;
  }
}

PretrainArgs parse(std::vector<std::string> w) {
  CLI::App app;
  PretrainArgs a;
  add_pretrain_options(app, a);
  std::reverse(w.begin(), w.end());
  app.parse(w);
  a.model.vocab_size = 128;
  validate_pretrain_args(a);
  return a;
}

const std::vector<std::string> kBase = {"--num-layers", "2",  "--hidden-size", "32",   "--num-attention-heads",
                                        "4",            "--seq-length", "16", "--max-position-embeddings", "16",
                                        "--micro-batch-size", "1", "--train-iters", "100", "--lr", "1e-3",
                                        "--min-lr", "1e-4", "--lr-warmup-iters", "10", "--lr-warmup-init", "1e-5",
                                        "--lr-decay-style", "cosine", "--mock-data"};

std::vector<std::string> with(std::vector<std::string> extra) {
  std::vector<std::string> w = kBase;
  w.insert(w.end(), extra.begin(), extra.end());
  return w;
}

// Megatron's OptimizerParamScheduler.get_lr with the group's max_lr / min_lr: warm-up from the
// shared --lr-warmup-init to --decoupled-lr, cosine down to --decoupled-min-lr (--min-lr unset).
TEST(DecoupledLr, Schedule) {
  const PretrainArgs a = parse(with({"--decoupled-lr", "5e-3", "--decoupled-min-lr", "2e-4"}));
  EXPECT_TRUE(a.optim.decoupled_lr);
  const LrScheduleConfig s = a.decoupled_lr_schedule();
  EXPECT_DOUBLE_EQ(learning_rate(s, 0), 1e-5);
  EXPECT_DOUBLE_EQ(learning_rate(s, 5), 1e-5 + (5e-3 - 1e-5) * 5 / 10);
  EXPECT_DOUBLE_EQ(learning_rate(s, 10), 5e-3);
  const double r = (55.0 - 10) / (100 - 10);
  EXPECT_DOUBLE_EQ(learning_rate(s, 55), 2e-4 + 0.5 * (std::cos(M_PI * r) + 1) * (5e-3 - 2e-4));
  EXPECT_DOUBLE_EQ(learning_rate(s, 100), 2e-4);
  EXPECT_DOUBLE_EQ(learning_rate(a.lr_schedule(), 100), 1e-4);  // the other parameters' schedule is unchanged
  EXPECT_DOUBLE_EQ(learning_rate(parse(with({"--decoupled-lr", "5e-3"})).decoupled_lr_schedule(), 100), 1e-4);
  // --decoupled-min-lr alone does nothing (Megatron reads it only with --decoupled-lr).
  EXPECT_FALSE(parse(with({"--decoupled-min-lr", "2e-4"})).optim.decoupled_lr);
  EXPECT_FALSE(parse(kBase).optim.decoupled_lr);
}

TEST(DecoupledLr, Errors) {
  testing::expect_error([] { parse(with({"--decoupled-lr", "1e-3", "--decoupled-min-lr", "2e-3"})); },
               "--decoupled-lr 0.001 / --decoupled-min-lr 0.002");
  testing::expect_error([] { parse(with({"--decoupled-lr", "1e-6"})); },
                        "--decoupled-min-lr unset (--min-lr): the embedding and output layer's schedule is invalid");
  // below --lr-warmup-init 1e-5
  testing::expect_error([] { parse(with({"--decoupled-lr", "5e-6", "--decoupled-min-lr", "1e-6"})); }, "warmup_init_lr");
  EXPECT_THROW(parse(with({"--decoupled-lr", "-1"})), CLI::ValidationError);
}

}  // namespace
}  // namespace mt
