// Communication beside computation in the MoE layer changes no math (docs/moe.md "Overlapped
// communication"): on thread ranks (CPU streams run inline, in the schedules' issue order), every
// flag gives bitwise the losses, gradients and updated parameters of the sequential layer:
//   --moe-shared-expert-overlap       the shared experts on their side stream (ungated and gated);
//   --overlap-moe-expert-parallel-comm the dropless alltoall exchange in chunks of local expert
//                                     slots, pipelined with the experts; with --delay-wgrad-compute;
//   --moe-permute-fusion              permutation 2 fused into the exchanges (per-piece messages);
// under EP 2, EP 2 × ETP 2 (the ETP all-gather / reduce-scatter paths), TP 2 + SP with EP over DP,
// ETP 2 without EP, PP 2 × EP 2, with the per-expert loop and the grouped GEMM, ECHO clones.
// The dispatcher is also checked on its own: the chunks tile the expert rows, the chunked and the
// fused exchanges deliver the rows one exchange delivers, bitwise (MoEAlltoAllTokenDispatcher).
// And the configuration errors of the flags.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "comm/thread_comm.h"
#include "model/moe/alltoall_dispatcher.h"
#include "ops/elementwise.h"
#include "testing/testing.h"
#include "train/train_step.h"
#include "train/training_setup.h"

namespace mt {
namespace {

using testing::OwnedTensor;

// ---------------------------------------------------------------------------------------------
// The whole model
// ---------------------------------------------------------------------------------------------

struct Flags {
  bool shared = false, chunked = false, delay = false, fusion = false;
  std::string name() const {
    std::string s;
    if (shared) s += "+shared_overlap";
    if (chunked) s += "+ep_overlap";
    if (delay) s += "+delay_wgrad";
    if (fusion) s += "+permute_fusion";
    return s.empty() ? "sequential" : s;
  }
};

struct Layout {
  int tp = 1, pp = 1, ep = 1, etp = 0, world = 2;
  bool sp = false, grouped = false, gate = false;
  int echo = 0;
  std::string name() const {
    return fmt::format("tp{}{}_pp{}_ep{}_etp{}_w{}{}{}{}", tp, sp ? "sp" : "", pp, ep, etp, world,
                       grouped ? "_gg" : "", gate ? "_gate" : "", echo > 0 ? fmt::format("_echo{}", echo) : "");
  }
};

TransformerConfig config(const Layout& L, const Flags& f) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.seq_length = 16;
  c.vocab_size = 61;
  c.make_vocab_size_divisible_by = 8;
  c.ffn_hidden_size = 48;
  c.gated_linear_unit = true;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  c.init_method_std = 0.1f;
  c.hidden_dropout = 0.1f;
  c.num_moe_experts = 8;  // EP 2: 4 local experts, so 4 chunks (5 slots with an ECHO clone)
  c.moe_ffn_hidden_size = 16;
  c.moe_router_topk = 2;
  c.moe_aux_loss_coeff = {0.05f};
  c.moe_z_loss_coeff = 0.01f;
  c.moe_shared_expert_intermediate_size = 24;
  c.moe_shared_expert_gate = L.gate;
  c.moe_token_dispatcher_type = MoeDispatcher::kAllToAll;
  c.moe_grouped_gemm = L.grouped;
  c.moe_enable_echo = L.echo > 0;
  c.moe_num_echo_experts = L.echo;
  c.moe_shared_expert_overlap = f.shared;
  c.overlap_moe_expert_parallel_comm = f.chunked;
  c.delay_wgrad_compute = f.delay;
  c.moe_permute_fusion = f.fusion;
  return c;
}

struct RankRun {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> grads, params;
};

constexpr int kIters = 2;

// Per world rank: the losses of each iteration, this rank's gradients after the last backward and
// its parameters after the last update.
std::vector<RankRun> run(const Layout& L, const Flags& f) {
  const TransformerConfig c = config(L, f);
  const int64_t S = c.seq_length, mb = 2;
  const int dp = L.world / (L.tp * L.pp), M = 2;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> draw(0, 60);
  std::vector<int32_t> tokens(static_cast<size_t>(M * dp * S * mb)), labels(tokens.size());
  for (auto& t : tokens) t = draw(rng);
  for (auto& t : labels) t = draw(rng);
  std::vector<RankRun> out(static_cast<size_t>(L.world));
  run_thread_ranks(L.world, [&](int rank, std::shared_ptr<Communicator> world) {
    ModelSetupOptions o;
    o.model = c;
    o.parallel.tp = L.tp;
    o.parallel.pp = L.pp;
    o.parallel.ep = L.ep;
    o.parallel.etp = L.etp;
    o.num_microbatches = M;
    o.micro_batch_size = mb;
    o.sequence_parallel = L.sp;
    o.optim.eps = 1e-3f;
    Stream st(Device::cpu());
    ModelSetup setup(world, o, st);
    const int d = setup.groups().dp->rank();
    GPTModel& model = setup.model();
    model.params().initialize(321, st);
    std::vector<OwnedTensor> tok, lab;
    std::vector<MicroBatch> mbs;
    for (int m = 0; m < M; ++m) {
      const int64_t gm = static_cast<int64_t>(m) * dp + d;
      const std::vector<int32_t> t(tokens.begin() + gm * S * mb, tokens.begin() + (gm + 1) * S * mb);
      const std::vector<int32_t> l(labels.begin() + gm * S * mb, labels.begin() + (gm + 1) * S * mb);
      tok.push_back(testing::make_int_tensor(t, Device::cpu(), {S, mb}, st));
      lab.push_back(testing::make_int_tensor(l, Device::cpu(), {S, mb}, st));
    }
    for (int m = 0; m < M; ++m) {
      MicroBatch b{tok[m].t, lab[m].t, Tensor()};
      b.loss_weight = 1.0f / static_cast<float>(S * mb * M * dp);
      b.aux_loss_weight = 1.0f / static_cast<float>(M * dp);
      mbs.push_back(b);
    }
    OwnedTensor loss(DType::kF32, Device::cpu(), {1});
    RankRun& r = out[static_cast<size_t>(rank)];
    const ParamStore& P = model.params();
    for (int it = 0; it < kIters; ++it) {
      fill(loss, 0.f, st);
      train_step(model, setup.executor(), setup.train_plan(), setup.optimizer(), mbs, {5, it, 1e-2f, d, dp}, loss, st);
      r.losses.push_back(loss.t.data_as<float>()[0]);
      if (it + 1 == kIters)
        for (size_t i = 0; i < P.size(); ++i) r.grads[P.info(i).name] = testing::to_host(P.grad(i), st);
    }
    for (size_t i = 0; i < P.size(); ++i) r.params[P.info(i).name] = testing::to_host(P.main(i), st);
  });
  return out;
}

// Bitwise: the same floats (NaN never expected).
void expect_bitwise(const std::vector<RankRun>& got, const std::vector<RankRun>& ref, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  for (size_t r = 0; r < ref.size(); ++r) {
    EXPECT_EQ(got[r].losses, ref[r].losses) << what << " rank " << r;
    ASSERT_EQ(got[r].grads.size(), ref[r].grads.size()) << what;
    for (const auto& [name, g] : ref[r].grads) {
      EXPECT_EQ(got[r].grads.at(name), g) << what << " rank " << r << " gradient " << name;
      EXPECT_EQ(got[r].params.at(name), ref[r].params.at(name)) << what << " rank " << r << " parameter " << name;
    }
  }
}

class MoeOverlapLayouts : public ::testing::TestWithParam<Layout> {};

TEST_P(MoeOverlapLayouts, EveryFlagIsBitwiseTheSequentialLayer) {
  const Layout L = GetParam();
  const std::vector<RankRun> ref = run(L, Flags{});
  // the reference trained: finite, changing losses
  for (const RankRun& r : ref)
    for (double l : r.losses) ASSERT_TRUE(std::isfinite(l)) << L.name();
  const std::vector<Flags> variants = {
      {true, false, false, false}, {false, true, false, false}, {false, true, true, false},
      {false, false, false, true}, {true, true, true, true}};
  for (const Flags& f : variants) expect_bitwise(run(L, f), ref, L.name() + " " + f.name());
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, MoeOverlapLayouts,
    ::testing::Values(Layout{1, 1, 2, 1, 2},                                // EP 2
                      Layout{1, 1, 2, 1, 2, false, true, true, 1},          // grouped GEMM, gated, ECHO
                      Layout{2, 1, 2, 2, 4, true},                          // EP 2 × ETP 2 (= TP 2 + SP)
                      Layout{2, 1, 2, 1, 4, true, false, true},             // TP 2 + SP, EP 2 over DP, gated
                      Layout{2, 1, 1, 2, 2, true, true},                    // ETP 2 without EP, grouped GEMM
                      Layout{1, 2, 2, 1, 4, false, true, false, 1}),        // PP 2 × EP 2, ECHO
    [](const ::testing::TestParamInfo<Layout>& i) { return i.param.name(); });

// ---------------------------------------------------------------------------------------------
// The dispatcher alone: chunks and fused exchanges against one exchange
// ---------------------------------------------------------------------------------------------

struct DispatchRun {
  std::vector<float> xp, y, dx, d_probs;  // per rank, concatenated
  std::vector<MoEAlltoAllTokenDispatcher::ChunkRange> chunks;  // rank 0's
  std::vector<int64_t> counts;                                 // rank 0's per local slot
};

// Every rank routes T random tokens over E experts (top-2); the "experts" scale each row by
// 1 + local slot (so a row that lands on a wrong slot changes y). Forward and backward through the
// chunk API on an exchange stream (CPU: inline), with `chunks` chunks and `fusion`.
constexpr int64_t kE = 8, kK = 2, kT = 24, kH = 4;

struct DispatchInputs {
  std::vector<std::vector<int32_t>> tops;  // per rank [T, k], two distinct experts per token
  std::vector<std::vector<float>> xs, dys;  // per rank [T, h]
};

DispatchInputs dispatch_inputs(int world_size) {
  DispatchInputs in;
  std::mt19937 rng(11);
  for (int r = 0; r < world_size; ++r) {
    std::vector<int32_t> top(static_cast<size_t>(kT * kK));
    for (int64_t t = 0; t < kT; ++t) {
      const int32_t a = static_cast<int32_t>(rng() % kE);
      int32_t b = static_cast<int32_t>(rng() % (kE - 1));
      if (b >= a) ++b;
      top[static_cast<size_t>(t * kK)] = a;
      top[static_cast<size_t>(t * kK + 1)] = b;
    }
    in.tops.push_back(top);
    in.xs.push_back(testing::randn(kT * kH));
    in.dys.push_back(testing::randn(kT * kH));
  }
  return in;
}

std::vector<DispatchRun> dispatch_run(const DispatchInputs& in, int ep_size, int etp_size, int64_t chunks,
                                      bool fusion) {
  constexpr int64_t E = kE, k = kK, T = kT, h = kH;
  const int world_size = ep_size * etp_size;
  std::vector<DispatchRun> out(static_cast<size_t>(world_size));
  const auto& tops = in.tops;
  const auto& xs = in.xs;
  const auto& dys = in.dys;
  run_thread_ranks(world_size, [&](int rank, std::shared_ptr<Communicator> world) {
    const int etp_rank = rank / ep_size, ep_rank = rank % ep_size;
    ExpertParallel ep;
    ep.ep_size = ep_size;
    ep.ep_rank = ep_rank;
    ep.etp_size = etp_size;
    ep.etp_rank = etp_rank;
    ep.dispatch = world;
    ep.ep_group = world->split(etp_rank, ep_rank, "ep");
    ep.etp_group = world->split(ep_rank, etp_rank, "etp");
    const int64_t Lc = E / ep_size;
    MoeDispatchSizes sizes{E, k, Lc, ep_rank * Lc, false, 0, 0};
    sizes.chunks = chunks;
    sizes.permute_fusion = fusion;
    MoEAlltoAllTokenDispatcher disp(ep, sizes);
    const Device cpu = Device::cpu();
    BufferPlanner planner(cpu, DType::kF32);
    int64_t R_max = 0;
    for (int pass = 0; pass < 2; ++pass) {
      planner.begin_pass();
      planner.open_area(BufferPlanner::Family::kActivations, 0);
      R_max = disp.plan(planner, T, h);
      planner.close_area();
      if (pass == 0) planner.materialize();
    }
    Stream st(cpu), comm(cpu);
    const std::vector<int32_t>& top = tops[static_cast<size_t>(rank)];
    std::copy(top.begin(), top.end(), disp.top(0).data_as<int32_t>());
    float* p = disp.probs(0).data_as<float>();
    for (int64_t i = 0; i < T * k; ++i) p[i] = 0.3f + 0.05f * static_cast<float>((i + rank) % 9);
    OwnedTensor x(DType::kF32, cpu, {T, h}), dy(DType::kF32, cpu, {T, h}), y(DType::kF32, cpu, {T, h});
    OwnedTensor dx(DType::kF32, cpu, {T, h}), d_probs(DType::kF32, cpu, {T, k});
    OwnedTensor xp(DType::kF32, cpu, {R_max, h}), o(DType::kF32, cpu, {R_max, h});
    OwnedTensor d_out(DType::kF32, cpu, {R_max, h}), d_xp(DType::kF32, cpu, {R_max, h});
    std::copy(xs[rank].begin(), xs[rank].end(), x.t.data_as<float>());
    std::copy(dys[rank].begin(), dys[rank].end(), dy.t.data_as<float>());
    for (Tensor t : {xp.t, o.t, d_out.t, d_xp.t, y.t, dx.t, d_probs.t}) fill(t, std::nanf(""), st);
    disp.preprocess(x.t, 0, st);
    const MoeExpertCounts counts = disp.plan_dispatch(xp.t, 0, st);
    const int64_t n = disp.num_chunks(0);
    // the "experts": row-wise, by slot
    auto scale = [&](const Tensor& dst, const Tensor& src, const MoEAlltoAllTokenDispatcher::ChunkRange& r) {
      int64_t row = r.row_begin;
      for (int64_t e = r.first; e < r.last; ++e)
        for (int64_t i = 0; i < counts.host[static_cast<size_t>(e)]; ++i, ++row)
          for (int64_t c = 0; c < h; ++c)
            dst.data_as<float>()[row * h + c] = src.data_as<float>()[row * h + c] * static_cast<float>(1 + e);
    };
    for (int64_t c = 0; c < n; ++c) disp.dispatch_chunk(xp.t, 0, c, comm);
    for (int64_t c = 0; c < n; ++c) {
      scale(o.t, xp.t, disp.chunk(0, c));
      disp.combine_chunk(o.t, 0, c, comm);
    }
    disp.combine_finish(y.t, 0, st);
    disp.combine_backward_start(d_probs.t, dy.t, 0, st);
    for (int64_t c = 0; c < n; ++c) disp.combine_backward_chunk(d_out.t, 0, c, comm);
    for (int64_t c = 0; c < n; ++c) {
      scale(d_xp.t, d_out.t, disp.chunk(0, c));
      disp.dispatch_backward_chunk(d_xp.t, 0, c, comm);
    }
    disp.preprocess_backward(dx.t, 0, st);
    DispatchRun& r = out[static_cast<size_t>(rank)];
    const int64_t R = std::accumulate(counts.host.begin(), counts.host.end(), int64_t{0});
    r.xp = testing::to_host(xp.t.slice0(0, R), st);
    r.y = testing::to_host(y.t, st);
    r.dx = testing::to_host(dx.t, st);
    r.d_probs = testing::to_host(d_probs.t, st);
    r.counts = counts.host;
    for (int64_t c = 0; c < n; ++c) r.chunks.push_back(disp.chunk(0, c));
  });
  return out;
}

TEST(MoeOverlapDispatcher, ChunksAndFusedExchangesDeliverTheRowsOfOneExchange) {
  for (const auto& [ep, etp] : {std::pair{4, 1}, std::pair{2, 2}, std::pair{1, 2}, std::pair{2, 1}}) {
    const DispatchInputs in = dispatch_inputs(ep * etp);
    const std::vector<DispatchRun> ref = dispatch_run(in, ep, etp, 1, false);
    const int64_t slots = 8 / ep;
    for (const auto& [chunks, fusion] : {std::pair{int64_t{3}, false}, std::pair{int64_t{1}, true},
                                         std::pair{int64_t{4}, true}, std::pair{int64_t{16}, false}}) {
      const std::string what = fmt::format("ep {} etp {} chunks {} fusion {}", ep, etp, chunks, fusion);
      const std::vector<DispatchRun> got = dispatch_run(in, ep, etp, chunks, fusion);
      // the chunks: min(chunks, slots) non-empty slot runs that tile the slots and the expert rows
      const auto& ch = got[0].chunks;
      ASSERT_EQ(static_cast<int64_t>(ch.size()), std::min(chunks, slots)) << what;
      int64_t slot = 0, row = 0;
      for (const auto& c : ch) {
        EXPECT_EQ(c.first, slot) << what;
        EXPECT_GT(c.last, c.first) << what;
        EXPECT_EQ(c.row_begin, row) << what;
        int64_t rows = 0;
        for (int64_t e = c.first; e < c.last; ++e) rows += got[0].counts[static_cast<size_t>(e)];
        EXPECT_EQ(c.rows, rows) << what;
        slot = c.last;
        row += c.rows;
      }
      EXPECT_EQ(slot, slots) << what;
      for (size_t r = 0; r < ref.size(); ++r) {
        EXPECT_GT(ref[r].xp.size(), 0u) << what;
        EXPECT_EQ(got[r].xp, ref[r].xp) << what << " rank " << r << ": expert rows";
        EXPECT_EQ(got[r].y, ref[r].y) << what << " rank " << r << ": combine";
        EXPECT_EQ(got[r].dx, ref[r].dx) << what << " rank " << r << ": dx";
        EXPECT_EQ(got[r].d_probs, ref[r].d_probs) << what << " rank " << r << ": d probs";
      }
    }
    // the reference delivered every routed slot: each of the world's T·k slots lands on the etp
    // ranks of its expert's EP rank (the ETP all-gather)
    int64_t rows = 0;
    for (const DispatchRun& r : ref) rows += static_cast<int64_t>(r.xp.size()) / kH;
    EXPECT_EQ(rows, static_cast<int64_t>(ep * etp) * kT * kK * etp) << "ep " << ep << " etp " << etp;
    // and the combine is the definition: y[t] = etp · Σ_j p[t, j]·(1 + local slot of e_tj)·x[t]
    // (each of the etp ranks' identical partial outputs summed by the reduce-scatter)
    for (int r = 0; r < ep * etp; ++r)
      for (int64_t t = 0; t < kT; ++t)
        for (int64_t c = 0; c < kH; ++c) {
          double want = 0;
          for (int64_t j = 0; j < kK; ++j) {
            const int32_t e = in.tops[r][static_cast<size_t>(t * kK + j)];
            const double p = 0.3 + 0.05 * static_cast<double>((t * kK + j + r) % 9);
            want += p * (1 + e % (kE / ep)) * in.xs[r][static_cast<size_t>(t * kH + c)];
          }
          EXPECT_NEAR(ref[r].y[static_cast<size_t>(t * kH + c)], etp * want, 1e-4 * (1 + std::fabs(want)))
              << "ep " << ep << " etp " << etp << " rank " << r << " token " << t;
        }
  }
}

// ---------------------------------------------------------------------------------------------
// Configuration errors
// ---------------------------------------------------------------------------------------------

TEST(MoeOverlapFlags, ErrorsNameTheFlagAndWhatItNeeds) {
  const Layout L{1, 1, 2, 1, 2};
  auto expect_error = [&](const std::function<void(TransformerConfig&)>& edit, const std::string& text) {
    TransformerConfig c = config(L, Flags{});
    edit(c);
    try {
      c.validate(1);
      ADD_FAILURE() << "no error, expected one mentioning " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_error([](TransformerConfig& c) { c.moe_token_dispatcher_type = MoeDispatcher::kAllGather;
                                          c.overlap_moe_expert_parallel_comm = true; },
               "--overlap-moe-expert-parallel-comm needs --moe-token-dispatcher-type alltoall");
  expect_error([](TransformerConfig& c) { c.moe_grouped_gemm = true; c.moe_received_token_capacity = 64;
                                          c.overlap_moe_expert_parallel_comm = true; },
               "capacity 64");
  expect_error([](TransformerConfig& c) { c.delay_wgrad_compute = true; },
               "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm");
  expect_error([](TransformerConfig& c) { c.moe_token_dispatcher_type = MoeDispatcher::kAllGather;
                                          c.moe_permute_fusion = true; },
               "--moe-permute-fusion needs --moe-token-dispatcher-type alltoall");
  expect_error([](TransformerConfig& c) { c.moe_shared_expert_intermediate_size = 0;
                                          c.moe_shared_expert_overlap = true; },
               "--moe-shared-expert-overlap needs shared experts");
  TransformerConfig ok = config(L, Flags{true, true, true, true});
  EXPECT_NO_THROW(ok.validate(1));
}

}  // namespace
}  // namespace mt
