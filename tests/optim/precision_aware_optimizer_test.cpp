// --use-precision-aware-optimizer with bf16 parameters (Megatron's store_param_remainders): the fp32
// main parameters live as the bf16 parameters plus int16 remainders (ParamStore::
// store_main_as_remainders), on one rank, on DP 2 ranks (threads) without and with the distributed
// optimizer. The gradients of the data-parallel tests (ddp_test_util.h) do not depend on the
// parameters, so the remainder runs must reproduce the plain fp32-main runs bitwise: the same
// gathered fp32 main parameters and moments, and bf16 parameters that are the same fp32 values
// rounded (ties away from zero instead of to even: equal except at exact ties). Checkpoints
// round-trip the exact bits across layouts and to and from plain runs; memory accounting and the
// documented errors are checked.
#include <gtest/gtest.h>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <bit>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <type_traits>

#include "testing/testing.h"
#include "comm/thread_comm.h"
#include "ops/optimizer.h"
#include "optim/ddp_test_util.h"
#include "optim/grad_sync.h"
#include "optim/optimizer.h"
#include "train/arguments.h"
#include "train/checkpoint.h"
#include "train/memory_estimate.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using ddp_test::Model;
using testing::OwnedTensor;

constexpr float kLr = 1e-2f;
constexpr uint64_t kSeed = 7;

using ::mt::testing::expect_error;

template <typename T>
std::vector<T> raw_host(const Tensor& t, const Stream& s) {
  std::vector<T> out(static_cast<size_t>(t.numel()));
  copy_bytes(out.data(), Device::cpu(), t.data(), t.device(), out.size() * sizeof(T), s);
  s.synchronize();
  return out;
}

OptimizerConfig config(bool remainders) {
  OptimizerConfig c = ddp_test::opt_config();
  c.store_param_remainders = remainders;
  return c;
}

fs::path temp_dir(const std::string& tag) {
  const fs::path d = fs::temp_directory_path() / ("mt_pao_" + tag + "_" + std::to_string(::getpid()) + "_" +
                                                  std::to_string(testing::test_seed() % 100000));
  fs::remove_all(d);
  return d;
}

/// A rank's whole state as raw bits: gathered fp32 main parameters and moments, the bf16
/// parameters; the parameters concatenated in order without the alignment and bucket padding (whose
/// placement depends on the data-parallel size).
struct State {
  std::vector<uint32_t> main, m, v;
  std::vector<uint16_t> param;
  int32_t step = 0;
  float grad_norm = 0.f;  // the last step's
};

/// The whole bf16 parameters: the buffer, or with staged parameters (optim_grads_params) each
/// unit's buckets gathered as a forward pass does.
std::vector<uint16_t> whole_params(const Model& model, const ParamStore& P, GradSync& sync, const Stream& st) {
  if (!P.params_staged()) return raw_host<uint16_t>(P.params_flat(), st);
  std::vector<uint16_t> out(static_cast<size_t>(P.total_elements()), 0);
  ddp_test::for_each_unit(model, false, [&](size_t, ddp_test::LayerRange r, ddp_test::LayerRange next) {
    sync.params_begin(r.first, r.end, false, next.first, next.end, st);
    for (size_t i = r.first; i < r.end; ++i) {
      const std::vector<uint16_t> v = raw_host<uint16_t>(P.param(i), st);
      std::copy(v.begin(), v.end(), out.begin() + P.info(i).offset);
    }
    sync.params_end(r.first, r.end, false, st);
  });
  return out;
}

State capture(const Model& model, const ParamStore& P, GradSync& sync, const AdamWOptimizer& opt, const Stream& st) {
  const int64_t total = P.total_elements();
  OwnedTensor main(DType::kF32, Device::cpu(), {total}), m(DType::kF32, Device::cpu(), {total}),
      v(DType::kF32, Device::cpu(), {total});
  testing::poison(main, st);
  opt.gather_main(main, st);
  opt.gather_moments(m, v, st);
  auto params_only = [&P](const auto& flat) {
    std::remove_cvref_t<decltype(flat)> out;
    for (const ParamInfo& p : P.infos()) out.insert(out.end(), flat.begin() + p.offset, flat.begin() + p.offset + p.numel);
    return out;
  };
  State s;
  s.main = params_only(raw_host<uint32_t>(main, st));
  s.m = params_only(raw_host<uint32_t>(m, st));
  s.v = params_only(raw_host<uint32_t>(v, st));
  s.param = params_only(whole_params(model, P, sync, st));
  const OptimizerScalars sc = opt.read_scalars_sync(st);
  s.step = sc.step;
  s.grad_norm = sc.grad_norm;
  return s;
}

/// The bf16 rounding of fp32 bits: the remainder split's (ties away from zero) or cast()'s
/// (round to nearest even).
uint16_t split_rounding(uint32_t u) { return static_cast<uint16_t>((u >> 16) + ((u & 0xFFFFu) >= 0x8000u ? 1 : 0)); }
uint16_t rne_rounding(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return f32_to_bf16_bits(x);
}

/// Elements where the bf16 parameters are not `round` of the main parameters.
int64_t rounding_mismatches(const State& s, uint16_t (*round)(uint32_t)) {
  int64_t bad = 0;
  for (size_t e = 0; e < s.main.size(); ++e) bad += s.param[e] != round(s.main[e]);
  return bad;
}

struct Layout {
  int dp = 1;
  bool distributed = false;
  bool remainders = false;
  bool zero3 = false;  // optim_grads_params: gradients and bf16 parameters sharded too (with distributed)
  int instances = 1;   // --num-distributed-optimizer-instances (hybrid sharding; with distributed)
};

std::string describe(const Layout& r) {
  return fmt::format("dp {}{}{}{}{}", r.dp, r.distributed ? " distopt" : "", r.zero3 ? " optim_grads_params" : "",
                     r.instances > 1 ? fmt::format(" instances {}", r.instances) : "",
                     r.remainders ? " remainders" : " fp32-main");
}

/// `steps` steps (global step numbers [first_step, first_step + steps)) of gpt_like(3) in bf16 under
/// r (DP rank d adds the gradients of simulated rank d; overlapped buckets), after loading `load`
/// (else a fresh initialisation), saving to `save` at the end if given. Checks the storage of the
/// main parameters on every rank and that every rank holds the same bf16 parameters; returns DP
/// rank 0's state.
State run(const Model& model, const Layout& r, int first_step, int steps, const fs::path& load = {},
          const fs::path& save = {}) {
  SCOPED_TRACE(describe(r));
  std::vector<State> states(static_cast<size_t>(r.dp));
  std::mutex mu;
  run_thread_ranks(r.dp, [&](int rank, std::shared_ptr<Communicator> world) {
    Stream st;
    const int shard = r.dp / r.instances;  // the ranks of one instance: the shard group
    ParamStore P(model.specs, DType::kBF16, Device::cpu(), ParamLayout{shard, 600});
    DdpConfig dc;
    dc.overlap_grad_reduce = true;
    dc.use_distributed_optimizer = r.distributed;
    dc.overlap_param_gather = r.distributed && !r.zero3;  // (optim_grads_params gathers per unit)
    dc.shard_grads = dc.shard_params = r.zero3;
    dc.num_distributed_optimizer_instances = r.instances;
    GradSync sync(P, world, dc);
    AdamWOptimizer opt(sync, config(r.remainders), st);  // before initialize, as the trainer does
    const int64_t total = P.total_elements();
    const int64_t stored = r.distributed ? total / shard : total;
    EXPECT_EQ(P.main_remainders_stored(), r.remainders);
    EXPECT_EQ(P.has_main_flat(), !r.remainders && !r.distributed);
    EXPECT_EQ(P.main_storage_elements(), stored);
    EXPECT_EQ(opt.state_elements(), 2 * opt.owned_elements() + stored);
    // Memory: 8 bytes of moments per owned element plus 4 (fp32) or 2 (remainders) per stored main
    // element: 12 or 10 bytes per parameter, / DP with the distributed optimizer.
    EXPECT_EQ(P.main_storage_bytes(), stored * (r.remainders ? 2 : 4));
    EXPECT_EQ(opt.state_bytes() * (r.distributed ? shard : 1), total * (r.remainders ? 10 : 12));
    EXPECT_EQ(P.params_staged(), r.zero3);
    if (r.zero3) {
      // The bf16 parameters: the owned slices (the remainders' elements) plus the staging slots.
      EXPECT_EQ(sync.owned_elements(), stored);
      EXPECT_EQ(sync.param_bytes(), (stored + P.param_slots() * P.largest_dense_bucket()) * 2);
      // The memory estimate of this store counts exactly what is allocated: the parameters, the
      // main parameters (2 or 4 bytes per owned element), the gradients and the moments.
      MemoryEstimateInputs in;
      in.model.params = ParamStore::plan(model.specs, ParamLayout{shard, 600});  // as GPTModel::memory_plan
      in.dtype = DType::kBF16;
      in.distributed_optimizer = true;
      in.data_parallel = shard;
      in.param_slots = in.model.params.param_slots;  // as estimate_rank_memory
      in.grad_slots = in.model.params.grad_slots;
      EXPECT_EQ(in.param_slots, P.param_slots());
      EXPECT_EQ(in.grad_slots, P.grad_slots());
      in.store_param_remainders = r.remainders;
      const MemoryEstimate e = estimate_training_memory(in);
      auto part = [&](const std::string& prefix) {
        size_t n = 0, hits = 0;
        for (const MemoryPart& p : e.parts)
          if (p.name.rfind(prefix, 0) == 0) n += p.bytes, ++hits;
        EXPECT_EQ(hits, 1u) << prefix << " in " << e.summary();
        return n;
      };
      EXPECT_EQ(part("model parameters (bf16; owned slices"), static_cast<size_t>(sync.param_bytes()));
      EXPECT_EQ(part(r.remainders ? "main parameters (int16 remainders of fp32)" : "main parameters (fp32)"),
                static_cast<size_t>(P.main_storage_bytes()));
      EXPECT_EQ(part("gradients (fp32 shard"), static_cast<size_t>(sync.grad_bytes()));
    }
    if (r.remainders) {
      EXPECT_EQ(P.main_remainders().dtype(), DType::kI16);
      EXPECT_EQ(P.main_remainders().numel(), stored);
      expect_error([&] { (void)P.main(0); }, "--use-precision-aware-optimizer");
      expect_error([&] { (void)P.main_flat(); }, "--use-precision-aware-optimizer");
      expect_error([&] { (void)P.main_shard(); }, "--use-precision-aware-optimizer");
      expect_error([&] { P.sync_model_from_main(st); }, "--use-precision-aware-optimizer");
    } else {
      expect_error([&] { (void)P.main_remainders(); }, "not stored as remainders");
    }
    if (!load.empty()) {
      EXPECT_EQ(load_checkpoint(load.string(), P, &opt, st).iteration, first_step);
    } else {
      P.initialize(kSeed, st);
    }
    for (int s = first_step; s < first_step + steps; ++s) {
      sync.zero_grad_buffer(st);
      ddp_test::backward(model, P, sync, ddp_test::Pattern::kInOrder, s, rank, st);
      opt.step(kLr, st);
    }
    if (!save.empty()) {
      CheckpointState cs;
      cs.iteration = first_step + steps;
      cs.seed = kSeed;
      cs.scalars = opt.read_scalars_sync(st);
      const CheckpointWriter w{.world = world, .dp_rank = rank, .edp_rank = rank};
      save_checkpoint(save.string(), cs, P, &opt, w, st);
    }
    State s = capture(model, P, sync, opt, st);
    std::lock_guard<std::mutex> lock(mu);
    states[static_cast<size_t>(rank)] = std::move(s);
  });
  for (int d = 1; d < r.dp; ++d) {
    EXPECT_EQ(states[d].param, states[0].param) << "bf16 parameters of DP rank " << d << " differ from rank 0's";
    EXPECT_EQ(states[d].main, states[0].main) << "gathered main parameters of DP rank " << d;
  }
  // The bf16 parameters are the rounding of the fp32 main parameters: the split's with remainders,
  // cast()'s without.
  EXPECT_EQ(rounding_mismatches(states[0], r.remainders ? split_rounding : rne_rounding), 0);
  return states[0];
}

void expect_same(const State& a, const State& b, bool same_params, const std::string& what) {
  EXPECT_EQ(a.step, b.step) << what;
  EXPECT_EQ(std::bit_cast<uint32_t>(a.grad_norm), std::bit_cast<uint32_t>(b.grad_norm)) << what << ": gradient norm";
  EXPECT_TRUE(a.main == b.main) << what << ": fp32 main parameters differ";
  EXPECT_TRUE(a.m == b.m) << what << ": exp_avg differs";
  EXPECT_TRUE(a.v == b.v) << what << ": exp_avg_sq differs";
  if (same_params) {
    EXPECT_TRUE(a.param == b.param) << what << ": bf16 parameters differ";
  }
}

class PrecisionAware : public ::testing::TestWithParam<Layout> {};

// A few steps with remainders == the same steps with a separate fp32 main copy, bitwise.
TEST_P(PrecisionAware, MatchesFp32MainRunBitwise) {
  const Model model = ddp_test::gpt_like(3);
  Layout r = GetParam();
  r.remainders = false;
  const State plain = run(model, r, 0, 3);
  r.remainders = true;
  const State rem = run(model, r, 0, 3);
  ASSERT_EQ(rem.step, 3);
  expect_same(rem, plain, /*same_params=*/false, describe(r));
  // The bf16 parameters agree except where the main parameter is an exact tie (low half 0x8000,
  // even high half): there the remainder split rounds away from zero, the cast to even.
  int64_t differ = 0, ties = 0;
  for (size_t e = 0; e < rem.main.size(); ++e) {
    const bool even_tie = (rem.main[e] & 0xFFFFu) == 0x8000u && ((rem.main[e] >> 16) & 1u) == 0;
    ties += even_tie;
    if (rem.param[e] != plain.param[e]) {
      ++differ;
      EXPECT_TRUE(even_tie) << "element " << e;
    }
  }
  EXPECT_EQ(differ, ties);
}

INSTANTIATE_TEST_SUITE_P(Layouts, PrecisionAware,
                         ::testing::Values(Layout{1, false}, Layout{2, false}, Layout{2, true},
                                           Layout{.dp = 2, .distributed = true, .zero3 = true},
                                           Layout{.dp = 4, .distributed = true, .zero3 = true},
                                           Layout{.dp = 4, .distributed = true, .zero3 = true, .instances = 2}),
                         [](const auto& info) {
                           const Layout& l = info.param;
                           return fmt::format("dp{}{}{}{}", l.dp, l.distributed ? "_distopt" : "",
                                              l.zero3 ? "_optim_grads_params" : "",
                                              l.instances > 1 ? fmt::format("_instances{}", l.instances) : "");
                         });

// optim_grads_params (ZeRO-3) with remainders: each rank's remainders cover its owned slices of
// the bf16 parameter shard, reconstructed and written back by the AdamW step; the same training
// as the distributed optimizer (ZeRO-1) with remainders bit for bit (main parameters, moments, bf16
// parameters, gradient norm), at DP 2, DP 4 and DP 4 in 2 instances (hybrid sharding), the
// gradient reduction overlapped.
TEST(PrecisionAware, OptimGradsParamsMatchesDistributedOptimizerBitwise) {
  const Model model = ddp_test::gpt_like(3);
  for (const auto& [dp, instances] : std::vector<std::pair<int, int>>{{2, 1}, {4, 1}, {4, 2}}) {
    const Layout zero1{.dp = dp, .distributed = true, .remainders = true, .instances = instances};
    Layout zero3 = zero1;
    zero3.zero3 = true;
    const State a = run(model, zero3, 0, 3), b = run(model, zero1, 0, 3);
    ASSERT_EQ(a.step, 3);
    expect_same(a, b, /*same_params=*/true, describe(zero3) + " vs " + describe(zero1));
  }
}

// Checkpoints hold the fp32 main parameters (merged from the remainders): they load bit-exactly
// under another layout, into a plain fp32-main run and back, and resuming is exact.
TEST(PrecisionAware, CheckpointRoundTripIsExact) {
  const Model model = ddp_test::gpt_like(3);
  const fs::path a = temp_dir("a"), b = temp_dir("b");
  const Layout dist_rem{2, true, true}, one_rem{1, false, true}, one_plain{1, false, false};
  const State saved = run(model, dist_rem, 0, 2, {}, a);
  ASSERT_EQ(saved.step, 2);
  expect_same(run(model, dist_rem, 2, 0, a), saved, true, "DP2 distopt remainders -> same");
  expect_same(run(model, one_rem, 2, 0, a), saved, true, "DP2 distopt remainders -> DP1 remainders");
  // A plain run loads the same fp32 main parameters (its bf16 parameters: the even rounding).
  const State plain = run(model, one_plain, 2, 0, a);
  expect_same(plain, saved, false, "DP2 distopt remainders -> DP1 fp32 main");
  // ... and what it saves loads back into remainders, identically.
  run(model, one_plain, 2, 0, a, b);
  expect_same(run(model, dist_rem, 2, 0, b), saved, true, "-> DP1 fp32 main -> DP2 distopt remainders");
  // Resuming is exact: 2 steps + save + load + 1 step == 3 steps without stopping.
  expect_same(run(model, dist_rem, 2, 1, a), run(model, dist_rem, 0, 3), true, "resumed vs uninterrupted");
  fs::remove_all(a);
  fs::remove_all(b);
}

// Checkpoints written under optim_grads_params with remainders hold the fp32 main parameters: they
// load under the distributed optimizer (ZeRO-1) with and without remainders, and what those save
// loads back under optim_grads_params; resuming under optim_grads_params is exact.
TEST(PrecisionAware, OptimGradsParamsCheckpointsCrossLoad) {
  const Model model = ddp_test::gpt_like(3);
  const fs::path a = temp_dir("z3a"), b = temp_dir("z3b"), c = temp_dir("z3c");
  const Layout z3_rem{.dp = 2, .distributed = true, .remainders = true, .zero3 = true};
  const Layout z3_plain{.dp = 4, .distributed = true, .zero3 = true};
  const Layout z1_rem{.dp = 2, .distributed = true, .remainders = true};
  const Layout z1_plain{.dp = 4, .distributed = true};
  const State saved = run(model, z3_rem, 0, 2, {}, a);
  ASSERT_EQ(saved.step, 2);
  expect_same(run(model, z3_rem, 2, 0, a), saved, true, "ZeRO-3 remainders -> same");
  expect_same(run(model, z1_rem, 2, 0, a), saved, true, "ZeRO-3 remainders -> ZeRO-1 remainders");
  expect_same(run(model, z1_plain, 2, 0, a), saved, false, "ZeRO-3 remainders -> ZeRO-1 fp32 main (DP 4)");
  expect_same(run(model, z3_plain, 2, 0, a), saved, false, "ZeRO-3 remainders -> ZeRO-3 fp32 main (DP 4)");
  // ... and back: what ZeRO-1 saves (with and without remainders) loads into ZeRO-3 remainders.
  run(model, z1_plain, 2, 0, a, b);
  expect_same(run(model, z3_rem, 2, 0, b), saved, true, "-> ZeRO-1 fp32 main -> ZeRO-3 remainders");
  run(model, z1_rem, 2, 0, a, c);
  expect_same(run(model, z3_rem, 2, 0, c), saved, true, "-> ZeRO-1 remainders -> ZeRO-3 remainders");
  // Resuming is exact: 2 steps + save + load + 1 step == 3 steps without stopping.
  expect_same(run(model, z3_rem, 2, 1, a), run(model, z3_rem, 0, 3), true, "resumed vs uninterrupted");
  for (const fs::path& d : {a, b, c}) fs::remove_all(d);
}

// set_main_from_full and gather_main directly: every element's bf16 parameter from the split, the
// stored remainders exact, including exact ties and values of every magnitude.
TEST(PrecisionAware, SetMainFromFullAndGatherAreExact) {
  const Model model = ddp_test::gpt_like(2);
  run_thread_ranks(2, [&](int rank, std::shared_ptr<Communicator> world) {
    Stream st;
    ParamStore P(model.specs, DType::kBF16, Device::cpu(), ParamLayout{2, 0});
    AdamWOptimizer opt(P, config(true), st, {world, nullptr, 0, /*distributed=*/true, nullptr});
    ASSERT_TRUE(P.main_sharded() && P.main_remainders_stored());
    const int64_t total = P.total_elements();
    std::vector<uint32_t> bits(static_cast<size_t>(total));
    for (int64_t e = 0; e < total; ++e) {  // the same values on both ranks
      const float x = ddp_test::grad_value(9, 0, "x", e) * std::ldexp(1.f, static_cast<int>(e % 60) - 30);
      std::memcpy(&bits[e], &x, 4);
      if (e % 7 == 0) bits[e] = (bits[e] & 0xFFFF0000u) | 0x8000u;  // ties
    }
    OwnedTensor full(DType::kF32, Device::cpu(), {total}), back(DType::kF32, Device::cpu(), {total});
    copy_bytes(full.t.data(), Device::cpu(), bits.data(), Device::cpu(), bits.size() * 4, st);
    testing::poison(back, st);
    P.set_main_from_full(full, st);
    opt.gather_main(back, st);
    EXPECT_EQ(raw_host<uint32_t>(back, st), bits) << "rank " << rank;
    const std::vector<uint16_t> params = raw_host<uint16_t>(P.params_flat(), st);
    int64_t bad = 0;
    for (int64_t e = 0; e < total; ++e) bad += params[e] != split_rounding(bits[e]);
    EXPECT_EQ(bad, 0);
  });
}

TEST(PrecisionAware, Errors) {
  const Model model = ddp_test::gpt_like(1);
  Stream st;
  for (DType dt : {DType::kF32, DType::kF16}) {
    ParamStore P(model.specs, dt, Device::cpu());
    expect_error([&] { AdamWOptimizer opt(P, config(true), st); }, "--use-precision-aware-optimizer");
    expect_error([&] { P.store_main_as_remainders(st); }, "needs --bf16");
  }
  // After shard_main there is no whole fp32 copy left to split.
  run_thread_ranks(2, [&](int, std::shared_ptr<Communicator> world) {
    Stream s;
    ParamStore P(model.specs, DType::kBF16, Device::cpu(), ParamLayout{2, 0});
    AdamWOptimizer opt(P, config(false), s, {world, nullptr, 0, /*distributed=*/true, nullptr});
    expect_error([&] { P.store_main_as_remainders(s); }, "already sharded");
  });
  // A second call (a second optimizer over the same store) does nothing.
  ParamStore P(model.specs, DType::kBF16, Device::cpu());
  P.initialize(kSeed, st);
  AdamWOptimizer first(P, config(true), st);
  const std::vector<int16_t> rem = raw_host<int16_t>(P.main_remainders(), st);
  AdamWOptimizer second(P, config(true), st);
  EXPECT_EQ(raw_host<int16_t>(P.main_remainders(), st), rem);
}

PretrainArgs parse(const std::string& line) {
  CLI::App app;
  PretrainArgs a;
  add_pretrain_options(app, a);
  app.parse("--train-iters 2 --lr 1e-3 --mock-data " + line, false);
  a.model.vocab_size = 64;
  validate_pretrain_args(a);
  return a;
}

TEST(PrecisionAware, FlagAndMemoryEstimate) {
  EXPECT_FALSE(parse("--bf16").optim.store_param_remainders);
  EXPECT_TRUE(parse("--bf16 --use-precision-aware-optimizer").optim.store_param_remainders);
  expect_error([] { parse("--use-precision-aware-optimizer"); }, "--use-precision-aware-optimizer needs --bf16");
  expect_error([] { parse("--use-precision-aware-optimizer"); }, "fp32");
  expect_error([] { parse("--fp16 --use-precision-aware-optimizer"); }, "fp16");
  // optim_grads_params (ZeRO-3) takes the flag, also with the full-iteration CUDA graph and with
  // hybrid sharding (remainders of the owned slices: OptimGradsParams* below).
  for (const std::string extra : {"", " --cuda-graph-impl full_iteration", " --num-distributed-optimizer-instances 2"})
    EXPECT_TRUE(parse("--bf16 --use-precision-aware-optimizer --use-megatron-fsdp --data-parallel-sharding-strategy "
                      "optim_grads_params" +
                      extra)
                    .optim.store_param_remainders)
        << extra;
  // The memory estimate counts 2 bytes per stored main element instead of 4.
  MemoryEstimateInputs in;
  in.model.params.total = 1 << 20;
  in.model.params.count = 10;
  in.model.params.buckets = 1;
  in.dtype = DType::kBF16;
  for (bool distributed : {false, true}) {
    in.distributed_optimizer = distributed;
    in.data_parallel = distributed ? 4 : 1;
    in.store_param_remainders = false;
    const MemoryEstimate plain = estimate_training_memory(in);
    in.store_param_remainders = true;
    const MemoryEstimate rem = estimate_training_memory(in);
    const size_t owned = (1u << 20) / (distributed ? 4u : 1u);
    EXPECT_EQ(plain.total() - rem.total(), 2 * owned);
    bool found = false;
    for (const MemoryPart& p : rem.parts) {
      if (p.name != "main parameters (int16 remainders of fp32)") continue;
      found = true;
      EXPECT_EQ(p.bytes, 2 * owned);
    }
    EXPECT_TRUE(found) << rem.summary();
  }
}

}  // namespace
}  // namespace mt
