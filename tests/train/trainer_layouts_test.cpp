// The trainer (TrainingSetup + Trainer, `megatron pretrain`'s code path after the launcher) under
// several parallel layouts, in-process: the ranks are threads (comm/thread_comm.h) on CPU, the data
// a synthetic corpus with a 96-token NullTokenizer vocabulary. The losses of every iteration (and
// the validation losses) equal the single-rank run; checkpoints written under one layout (TP, PP,
// DP with the distributed optimizer, CP, EP, expert TP, --async-save) resume under another on the
// same loss curve; the MoE log statistics; configuration errors before any communication.
// tests/train/pretrain_binary_test.cpp runs the binary (mpiexec ranks, the launcher, the GPT-2
// tokenizer) end to end.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include <nlohmann/json.hpp>

#include "testing/testing.h"
#include "train/trainer_testing.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

using testing::expect_error_text;
using testing::expect_same_losses;
using testing::log_text;
using testing::read_whole_tensor;
using testing::SetupInfo;
using testing::train_in_process;

std::string bias_state_name(int layer) {
  return "state/decoder.layers." + std::to_string(layer) + ".mlp.router.expert_bias";
}

class TrainerLayouts : public testing::CorpusFixture {
 protected:
  static TrainingResult train(const std::string& extra, SetupInfo* info = nullptr) {
    return train_in_process(flags(extra), info);
  }
  // Iterations 1-3 under `layout`, saving into checkpoint `ck` (the run's result in *first).
  static void save_half(const std::string& ck, const std::string& layout, TrainingResult* first) {
    *first = train("--train-iters 6 --exit-interval 3 --save " + ck + " " + layout);
    ASSERT_EQ(first->iteration, 3);
    ASSERT_EQ(first->exit_reason, "--exit-interval 3");
  }
  // Iterations 4-6 resumed from checkpoint `ck` with `more` (layout, --save), merged with the
  // first half's losses into *curve.
  static void resume(const TrainingResult& first, const std::string& ck, const std::string& more,
                     TrainingResult* curve) {
    TrainingResult r = train("--train-iters 6 --load " + ck + " " + more);
    ASSERT_EQ(r.losses.count(1), 0u);  // resumed, not restarted
    ASSERT_EQ(r.losses.count(4), 1u);
    *curve = first;
    for (auto [k, v] : r.losses) curve->losses[k] = v;
    for (auto [k, v] : r.validation) curve->validation[k] = v;
  }
  // On 2 ranks: a checkpoint written under `strategy` resumes under `other` and one written under
  // `other` under `strategy`, both on the curve of an uninterrupted `strategy` run.
  static void expect_checkpoints_cross_load(const std::string& strategy, const std::string& other,
                                            const std::string& tag, const std::string& ranks = "--nproc-per-node 2") {
    const TrainingResult whole = train("--train-iters 6 " + ranks + strategy);
    for (const auto& [from, to, name] : std::vector<std::tuple<std::string, std::string, std::string>>{
             {strategy, other, tag + "_to_other"}, {other, strategy, "other_to_" + tag}}) {
      SCOPED_TRACE(name);
      TrainingResult first, curve;
      ASSERT_NO_FATAL_FAILURE(save_half(dir(name), ranks + from, &first));
      ASSERT_NO_FATAL_FAILURE(resume(first, dir(name), ranks + to, &curve));
      expect_same_losses(curve, whole, name);
    }
  }
};

// Two runs whose gradients are summed in the same order: losses, gradient norms and validation
// losses bit for bit.
// norm_rel: 0 = the gradient norms bitwise too, else within that relative difference.
void expect_identical_runs(const TrainingResult& a, const TrainingResult& b, const std::string& what,
                           double norm_rel = 0) {
  ASSERT_EQ(a.losses.size(), 4u) << what;
  EXPECT_EQ(a.losses, b.losses) << what;
  ASSERT_EQ(a.log.size(), b.log.size()) << what;
  for (size_t i = 0; i < a.log.size(); ++i) {
    if (norm_rel == 0)
      EXPECT_EQ(a.log[i].point.grad_norm, b.log[i].point.grad_norm) << what;
    else
      EXPECT_NEAR(a.log[i].point.grad_norm, b.log[i].point.grad_norm, norm_rel * b.log[i].point.grad_norm) << what;
  }
  ASSERT_EQ(a.validation.size(), b.validation.size()) << what;
  for (const auto& [it, v] : b.validation) EXPECT_EQ(a.validation.at(it).loss, v.loss) << what << " validation";
}

// The memory estimate's gradient and parameter parts (staging slots and shards) are the bytes
// GradSync allocated.
void expect_estimate_matches_sync(const MemoryEstimate& estimate, const GradSync& gs) {
  size_t grads = 0, params = 0;
  for (const MemoryPart& p : estimate.parts) {
    if (p.name.rfind("gradients", 0) == 0) grads = p.bytes;
    if (p.name.rfind("parameter staging slots", 0) == 0 || p.name.rfind("parameters (fp32)", 0) == 0)
      params += p.bytes;
  }
  EXPECT_EQ(grads, static_cast<size_t>(gs.grad_bytes()));
  EXPECT_EQ(params, static_cast<size_t>(gs.param_bytes()));
}

// A sharded run against one rank: losses within expect_same_losses' tolerance, gradient norms 1e-4.
void expect_near_one_rank(const TrainingResult& a, const TrainingResult& ref, const std::string& what) {
  expect_same_losses(a, ref, what);
  ASSERT_EQ(a.log.size(), ref.log.size()) << what;
  for (size_t i = 0; i < a.log.size(); ++i)
    EXPECT_NEAR(a.log[i].point.grad_norm, ref.log[i].point.grad_norm, 1e-4 * ref.log[i].point.grad_norm) << what;
}

TEST_F(TrainerLayouts, ParallelLayoutsMatchOneRank) {
  const TrainingResult ref = train("--train-iters 4");
  ASSERT_EQ(ref.losses.size(), 4u);
  ASSERT_EQ(ref.validation.size(), 3u);  // iterations 0, 2, 4
  for (const std::string layout : {"--nproc-per-node 2 --tensor-model-parallel-size 2",
                                   "--nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel",
                                   "--nproc-per-node 2", "--nproc-per-node 2 --use-distributed-optimizer",
                                   "--nproc-per-node 4 --tensor-model-parallel-size 2",
                                   "--nproc-per-node 4 --tensor-model-parallel-size 2 --sequence-parallel "
                                   "--use-distributed-optimizer",
                                   "--nproc-per-node 2 --pipeline-model-parallel-size 2",
                                   "--nproc-per-node 2 --pipeline-model-parallel-size 2 "
                                   "--num-layers-per-virtual-pipeline-stage 1",
                                   "--nproc-per-node 2 --pipeline-model-parallel-size 2 "
                                   "--decoder-first-pipeline-num-layers 1",
                                   "--nproc-per-node 4 --pipeline-model-parallel-size 4",
                                   "--nproc-per-node 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                                   "--sequence-parallel --use-distributed-optimizer",
                                   "--nproc-per-node 2 --use-distributed-optimizer --overlap-grad-reduce "
                                   "--overlap-param-gather --ddp-bucket-size 20000",
                                   "--nproc-per-node 4 --pipeline-model-parallel-size 2 --overlap-grad-reduce "
                                   "--ddp-bucket-size 20000"}) {
    SCOPED_TRACE(layout);
    expect_same_losses(train("--train-iters 4 " + layout), ref, layout);
  }
}

// --use-megatron-fsdp (docs/fsdp.md): the built strategies are aliases of today's paths, so
// every loss and gradient norm is bitwise equal to the flags they stand for (DP 2, and DP 4 with
// TP 2 + SP for optim); the strategies and hybrid options not built are refused, naming the value.
TEST_F(TrainerLayouts, MegatronFsdpStrategiesAliasTodaysPaths) {
  const auto expect_identical = [](const TrainingResult& a, const TrainingResult& b, const std::string& what) {
    ASSERT_EQ(a.losses.size(), 4u) << what;
    EXPECT_EQ(a.losses, b.losses) << what;  // bitwise: the same code path
    ASSERT_EQ(a.log.size(), b.log.size()) << what;
    for (size_t i = 0; i < a.log.size(); ++i) {
      const std::string na = testing::logged(a.log[i].line, "grad norm");
      ASSERT_NE(na, "") << a.log[i].line;
      EXPECT_EQ(na, testing::logged(b.log[i].line, "grad norm")) << what << " log point " << i;
    }
  };
  const std::string fsdp = " --use-megatron-fsdp --data-parallel-sharding-strategy ";
  for (const auto& [today, alias] : std::vector<std::pair<std::string, std::string>>{
           {"--nproc-per-node 2", "--nproc-per-node 2" + fsdp + "no_shard"},
           {"--nproc-per-node 2 --use-distributed-optimizer", "--nproc-per-node 2" + fsdp + "optim"},
           // Megatron-FSDP's scripts pass --use-distributed-optimizer beside the strategy
           {"--nproc-per-node 2 --use-distributed-optimizer",
            "--nproc-per-node 2 --use-distributed-optimizer" + fsdp + "optim"},
           {"--nproc-per-node 2 --use-distributed-optimizer --grad-reduce-in-bf16",
            "--nproc-per-node 2" + fsdp + "optim --megatron-fsdp-grad-comm-dtype bf16"},
           {"--nproc-per-node 4 --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer",
            "--nproc-per-node 4 --tensor-model-parallel-size 2 --sequence-parallel" + fsdp + "optim"}}) {
    SCOPED_TRACE(alias);
    expect_identical(train("--train-iters 4 " + alias), train("--train-iters 4 " + today), alias);
  }
  // The strategy decides whether the optimizer state is sharded (what the aliases above stand for).
  EXPECT_FALSE(testing::parse_pretrain_args(flags("--nproc-per-node 2" + fsdp + "no_shard")).use_distributed_optimizer);
  EXPECT_TRUE(testing::parse_pretrain_args(flags("--nproc-per-node 2" + fsdp + "optim")).use_distributed_optimizer);
  for (const auto& [bad, msg] : std::vector<std::pair<std::string, std::string>>{
           {fsdp + "zero3", "zero3"},
           {" --data-parallel-sharding-strategy optim", "given without --use-megatron-fsdp"},
           {fsdp + "no_shard --use-distributed-optimizer", "contradicts --data-parallel-sharding-strategy no_shard"},
           {fsdp + "no_shard --num-distributed-optimizer-instances 2",
            "--num-distributed-optimizer-instances 2 needs the distributed optimizer"},
           {fsdp + "optim --outer-dp-sharding-strategy optim", "--outer-dp-sharding-strategy optim"},
           {fsdp + "optim --megatron-fsdp-grad-comm-dtype fp32 --grad-reduce-in-bf16", "contradicts"}})
    expect_error_text([&] { train("--train-iters 1 --nproc-per-node 2" + bad); }, msg, bad);
}

// Multi-token prediction through the trainer (the BatchStager's MTP inputs, rolled over whole
// sequences before the CP split; documents with reset position ids and --eod-mask-loss, so the
// depths' weights n0 / n_k vary): CP 2 (p2p and a2a), CP 2 x TP 2 + SP, PP 2 and DP 2 with the
// distributed optimizer give the one-rank LM losses and every depth's logged MTP loss.
TEST_F(TrainerLayouts, MultiTokenPredictionMatchesOneRank) {
  const std::string mtp = " --position-embedding-type rope --mtp-num-layers 2 --hidden-dropout 0 --attention-dropout 0 "
                          "--reset-attention-mask --reset-position-ids --eod-mask-loss ";
  const TrainingResult ref = train("--train-iters 4" + mtp);
  for (const std::string layout :
       {"--nproc-per-node 2 --context-parallel-size 2", "--nproc-per-node 2 --context-parallel-size 2 --cp-comm-type a2a",
        "--nproc-per-node 4 --context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel",
        "--nproc-per-node 2 --pipeline-model-parallel-size 2", "--nproc-per-node 2 --use-distributed-optimizer"}) {
    SCOPED_TRACE(layout);
    const TrainingResult r = train("--train-iters 4" + mtp + layout);
    expect_same_losses(r, ref, layout);
    ASSERT_EQ(r.log.size(), ref.log.size());
    for (size_t i = 0; i < ref.log.size(); ++i)
      for (const char* key : {"mtp_1 loss", "mtp_2 loss"}) {
        const std::string a = testing::logged(r.log[i].line, key), b = testing::logged(ref.log[i].line, key);
        ASSERT_NE(b, "") << ref.log[i].line;
        EXPECT_NEAR(std::stod(a), std::stod(b), 2e-5 * std::stod(b)) << key << " at log point " << i;
      }
  }
}

// Multi-token prediction with an untied output layer: the last pipeline stage holds a copy of the
// word embedding for the MTP (not written to checkpoints). A checkpoint written under PP 2 resumes
// on one rank, and one written on one rank resumes under PP 2 x VPP 2, on the one-rank curve (LM
// losses and every depth's MTP loss).
TEST_F(TrainerLayouts, MultiTokenPredictionUntiedCheckpointsReshard) {
  const std::string mtp = " --position-embedding-type rope --untie-embeddings-and-output-weights --mtp-num-layers 2 ";
  const std::string pp2 = " --nproc-per-node 2 --pipeline-model-parallel-size 2";
  const TrainingResult full = train("--train-iters 6" + mtp);
  auto expect_same_mtp = [&](const TrainingResult& r, const std::string& what) {
    ASSERT_FALSE(r.log.empty()) << what;
    for (const auto& l : r.log)
      for (const char* key : {"mtp_1 loss", "mtp_2 loss"}) {
        const std::string a = testing::logged(l.line, key);
        const std::string b = testing::logged(full.log.at(static_cast<size_t>(l.point.iteration - 1)).line, key);
        ASSERT_NE(b, "") << key;
        ASSERT_NE(a, "") << what << " " << key;
        EXPECT_NEAR(std::stod(a), std::stod(b), 2e-5 * std::stod(b)) << what << " " << key << " " << l.point.iteration;
      }
  };
  for (const auto& [save, load, what] :
       {std::tuple{pp2, std::string(), "pp2 -> 1 rank"},
        std::tuple{std::string(), pp2 + " --num-layers-per-virtual-pipeline-stage 1", "1 rank -> pp2 vpp2"}}) {
    SCOPED_TRACE(what);
    const std::string ck = dir(std::string("ck_mtp_untied_") + (save.empty() ? "pp1" : "pp2"));
    TrainingResult first;
    ASSERT_NO_FATAL_FAILURE(save_half(ck, mtp + save, &first));
    expect_same_mtp(first, what);
    const TrainingResult r = train("--train-iters 6 --load " + ck + mtp + load);
    ASSERT_EQ(r.losses.count(1), 0u);  // resumed, not restarted
    expect_same_mtp(r, what);
    TrainingResult curve = first;
    for (auto [k, v] : r.losses) curve.losses[k] = v;
    for (auto [k, v] : r.validation) curve.validation[k] = v;
    expect_same_losses(curve, full, what);
  }
}

// Context parallelism (--context-parallel-size) with document masks and reset position ids: every
// CP layout gives the one-rank losses (the trainer shards each sequence into the load-balanced
// chunks of parallel/context_parallel.h), without and with dropout; a checkpoint written under
// CP 2 resumes on one rank on the same curve; bad CP flags fail with a clear message.
TEST_F(TrainerLayouts, ContextParallelMatchesOneRank) {
  const std::string cp_flags = " --hidden-dropout 0 --attention-dropout 0 --reset-attention-mask --reset-position-ids ";
  const TrainingResult ref = train("--train-iters 4" + cp_flags);
  for (const std::string layout :
       {"--nproc-per-node 2 --context-parallel-size 2", "--nproc-per-node 2 --context-parallel-size 2 --cp-comm-type a2a",
        "--nproc-per-node 4 --context-parallel-size 2 --use-distributed-optimizer",
        "--nproc-per-node 4 --context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
        "--cp-comm-type allgather",
        "--nproc-per-node 4 --context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2"}) {
    SCOPED_TRACE(layout);
    expect_same_losses(train("--train-iters 4" + cp_flags + layout), ref, layout);
  }
  TrainingResult first, l;
  const std::string ck = dir("ck_cp2");
  ASSERT_NO_FATAL_FAILURE(save_half(ck, cp_flags + "--nproc-per-node 2 --context-parallel-size 2", &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ck, cp_flags, &l));
  expect_same_losses(l, train("--train-iters 6" + cp_flags), "CP 2 checkpoint resumed on one rank");
  for (const auto& [bad, msg] : std::vector<std::pair<std::string, std::string>>{
           {"--nproc-per-node 2 --context-parallel-size 2 --seq-length 30 --max-position-embeddings 32",
            "--seq-length 30 must be divisible by 2 x --context-parallel-size = 4"},
           {"--nproc-per-node 4 --context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 "
            "4", "2 x 4 = 8 must equal --context-parallel-size 4"},
           {"--nproc-per-node 2 --context-parallel-size 2 --cp-comm-type a2a --num-attention-heads 3 --hidden-size 48",
            "must be divisible by 2"}})
    expect_error_text([&] { train("--train-iters 1 --attention-dropout 0 " + bad); }, msg, bad);
  // With attention and hidden dropout: CP draws the masks of one rank (keyed by global positions,
  // heads and rows of the unsplit sequence), so the losses are still the one-rank losses.
  const std::string drop_flags = " --hidden-dropout 0.1 --attention-dropout 0.1 --reset-attention-mask "
                                 "--reset-position-ids ";
  const TrainingResult dref = train("--train-iters 4" + drop_flags);
  EXPECT_NE(dref.losses.at(3), ref.losses.at(3));  // dropout is on
  for (const std::string layout :
       {"--nproc-per-node 2 --context-parallel-size 2", "--nproc-per-node 2 --context-parallel-size 2 --cp-comm-type a2a",
        "--nproc-per-node 4 --context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
        "--cp-comm-type allgather"}) {
    SCOPED_TRACE(layout);
    expect_same_losses(train("--train-iters 4" + drop_flags + layout), dref, layout + " (dropout)");
  }
}

TEST_F(TrainerLayouts, CheckpointReshardsAcrossTensorParallelSizes) {
  const TrainingResult full = train("--train-iters 6");
  TrainingResult first, one_rank, l;
  // Save under TP 2, resume under TP 1.
  const std::string ck = dir("ck_tp2");
  ASSERT_NO_FATAL_FAILURE(save_half(ck, "--nproc-per-node 2 --tensor-model-parallel-size 2", &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ck, "--save " + ck, &l));
  expect_same_losses(l, full, "tp2 -> tp1");
  // And back: save under TP 1, resume under TP 2 with sequence parallelism.
  const std::string ck1 = dir("ck_tp1");
  ASSERT_NO_FATAL_FAILURE(save_half(ck1, "", &one_rank));
  ASSERT_NO_FATAL_FAILURE(resume(one_rank, ck1,
                                 "--save " + dir("ck_tp2sp") +
                                     " --nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel",
                                 &l));
  expect_same_losses(l, full, "tp1 -> tp2 sp");
  // Distributed optimizer: moments sharded over DP 2 are gathered into the checkpoint and resume on
  // one rank.
  const std::string ckz = dir("ck_zero");
  ASSERT_NO_FATAL_FAILURE(save_half(ckz, "--nproc-per-node 2 --use-distributed-optimizer", &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ckz, "--save " + ckz, &l));
  expect_same_losses(l, full, "dp2 distributed optimizer -> 1 rank");
  // Pipeline parallelism: save under PP 2 (the last stage's embedding copy is not written), resume
  // on one rank; save on one rank, resume under PP 2 with two virtual stages per rank.
  const std::string ckp = dir("ck_pp2");
  ASSERT_NO_FATAL_FAILURE(save_half(ckp, "--nproc-per-node 2 --pipeline-model-parallel-size 2", &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ckp, "--save " + ckp, &l));
  expect_same_losses(l, full, "pp2 -> 1 rank");
  ASSERT_NO_FATAL_FAILURE(resume(one_rank, ck1,
                                 "--save " + dir("ck_vpp") +
                                     " --nproc-per-node 2 --pipeline-model-parallel-size 2 "
                                     "--num-layers-per-virtual-pipeline-stage 1",
                                 &l));
  expect_same_losses(l, full, "1 rank -> pp2 vpp2");
}

// Megatron's --make-vocab-size-divisible-by 128 pads the vocabulary per TP size (96 tokens: 128 at
// TP 1, 256 at TP 2, 512 at TP 4). The padded entries take no probability mass (issue 21), so
// every TP size trains the same model, and a checkpoint moves between the paddings.
TEST_F(TrainerLayouts, DefaultVocabPaddingEveryTensorParallelSize) {
  const std::string pad = " --make-vocab-size-divisible-by 128";
  SetupInfo info;
  const TrainingResult full = train("--train-iters 6" + pad, &info);
  EXPECT_EQ(info.padded_vocab, 128);
  for (const auto& [layout, padded] :
       std::vector<std::pair<std::string, int64_t>>{{"--nproc-per-node 2 --tensor-model-parallel-size 2", 256},
                                                    {"--nproc-per-node 4 --tensor-model-parallel-size 4 "
                                                     "--sequence-parallel", 512}}) {
    SCOPED_TRACE(layout);
    expect_same_losses(train("--train-iters 6 " + layout + pad, &info), full, layout);
    EXPECT_EQ(info.padded_vocab, padded);
  }
  // TP 1 (128 rows) -> TP 2 (256) and TP 4 (512); TP 4 -> TP 1.
  TrainingResult first, l;
  const std::string ck1 = dir("ck_pad_tp1");
  ASSERT_NO_FATAL_FAILURE(save_half(ck1, pad, &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ck1, "--nproc-per-node 2 --tensor-model-parallel-size 2" + pad, &l));
  expect_same_losses(l, full, "tp1 -> tp2, default padding");
  ASSERT_NO_FATAL_FAILURE(resume(first, ck1, "--nproc-per-node 4 --tensor-model-parallel-size 4" + pad, &l));
  expect_same_losses(l, full, "tp1 -> tp4, default padding");
  const std::string ck4 = dir("ck_pad_tp4");
  ASSERT_NO_FATAL_FAILURE(save_half(ck4, "--nproc-per-node 4 --tensor-model-parallel-size 4" + pad, &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ck4, pad, &l));
  expect_same_losses(l, full, "tp4 -> tp1, default padding");
}

// The tiny MoE model of the MoE tests: Llama-style layers, MoE in layers 1 and 3 (8 experts, top-2).
constexpr const char* kTinyMoe =
    " --swiglu --ffn-hidden-size 64 --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-layer-freq [0,1]*2";

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

// A Mixtral-style MoE (8 experts, top-2, MoE in every other layer, load-balancing and z-loss): its
// log statistics (the model's log_statistics hook), layouts equal to one rank, and a checkpoint
// resharded from TP 2 to one rank; configuration errors before any communication.
TEST_F(TrainerLayouts, MixtureOfExperts) {
  const std::string moe = std::string(kTinyMoe) + " --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3";
  SetupInfo info;
  const TrainingResult full = train("--train-iters 6" + moe, &info);
  EXPECT_TRUE(has(info.model_summary, "MoE in 2 of 4 layers: 8 experts, top-2 softmax router")) << info.model_summary;
  const std::string log = log_text(full);
  EXPECT_TRUE(has(log, "load_balancing_loss: ")) << log;
  EXPECT_TRUE(has(log, "z_loss: ")) << log;
  // 8 sequences x 32 tokens x top-2 over 8 experts: 64 routed tokens per expert and iteration on average
  const std::string mean_load = "/64.0 | expert imbalance: ";
  EXPECT_TRUE(has(log, "tokens per expert min/max/mean: ")) << log;
  EXPECT_TRUE(has(log, mean_load)) << log;
  ASSERT_EQ(full.losses.size(), 6u);
  for (const auto& r : full.log) {
    EXPECT_TRUE(std::isfinite(r.point.grad_norm)) << r.line;
    EXPECT_EQ(r.point.skipped_iterations, 0) << r.line;
  }
  for (const std::string layout : {"--nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel",
                                   "--nproc-per-node 2 --use-distributed-optimizer",
                                   "--nproc-per-node 2 --pipeline-model-parallel-size 2",
                                   "--nproc-per-node 2 --expert-model-parallel-size 2",
                                   "--nproc-per-node 4 --tensor-model-parallel-size 2 --sequence-parallel "
                                   "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1 "
                                   "--use-distributed-optimizer",
                                   // all_to_allv over EP 2, unequal all-gather / reduce-scatter over
                                   // expert TP 2, four local experts regrouped
                                   "--nproc-per-node 4 --tensor-model-parallel-size 2 --sequence-parallel "
                                   "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall",
                                   // ECHO: hot experts cloned to the other EP rank's spare slot
                                   "--nproc-per-node 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type "
                                   "alltoall --moe-enable-echo --moe-num-echo-experts 1",
                                   // the capturable path: static receive blocks, ECHO on the device
                                   "--nproc-per-node 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type "
                                   "alltoall --moe-grouped-gemm --moe-received-token-capacity 100000 "
                                   "--moe-enable-echo --moe-num-echo-experts 1",
                                   // ECHO with expert TP 2 (= TP): one plan over the EP 2 x ETP 2 grid,
                                   // clones of each ETP rank's shard
                                   "--nproc-per-node 4 --tensor-model-parallel-size 2 --sequence-parallel "
                                   "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
                                   "--moe-enable-echo --moe-num-echo-experts 1"}) {
    SCOPED_TRACE(layout);
    const TrainingResult r = train("--train-iters 6 " + layout + moe, &info);
    expect_same_losses(r, full, layout + " (MoE)");
    const std::string text = log_text(r);
    EXPECT_TRUE(has(text, mean_load)) << text;
    if (has(layout, "alltoall")) {
      EXPECT_TRUE(has(info.model_summary, "alltoall token dispatcher")) << info.model_summary;
      const bool fixed = has(layout, "capacity");
      EXPECT_TRUE(has(text, fixed ? "tokens overflowed at the received capacity: 0.0 |"
                                  : "max tokens received per EP rank: "))
          << text;
    }
    if (has(layout, "echo")) {
      EXPECT_TRUE(has(info.model_summary, "ECHO with 1 spare expert slots per EP rank")) << info.model_summary;
      // counted from the host-read counts: the dropless dispatcher only
      EXPECT_EQ(has(text, "ECHO rerouted tokens per layer: "), !has(layout, "capacity")) << text;
    }
  }
  TrainingResult first, l;
  const std::string ck = dir("ck_moe");
  ASSERT_NO_FATAL_FAILURE(
      save_half(ck, "--nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel" + moe, &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ck, moe, &l));
  expect_same_losses(l, full, "MoE tp2 sp -> 1 rank");
  const std::string pl = log_text(train("--train-iters 2 --moe-per-layer-logging" + moe));
  EXPECT_TRUE(has(pl, "load_balancing_loss layer 1: ")) << pl;
  EXPECT_TRUE(has(pl, "z_loss layer 3: ")) << pl;
  EXPECT_FALSE(has(pl, "load_balancing_loss layer 0: ")) << pl;  // dense layer
  EXPECT_TRUE(has(pl, "expert imbalance layer 3: ")) << pl;
  for (const auto& [extra, message] : std::vector<std::pair<std::string, std::string>>{
           {" --moe-router-topk 9", "--moe-router-topk 9 must be in [1, --num-experts 8]"},
           {" --nproc-per-node 2 --tensor-model-parallel-size 2", "needs --sequence-parallel"},
           {" --moe-router-num-groups 3 --moe-router-group-topk 1", "--num-experts 8 is not divisible by "
                                                                     "--moe-router-num-groups 3"},
           {" --moe-router-group-topk 2", "needs --moe-router-num-groups"},
           {" --moe-expert-capacity-factor 0", "--moe-expert-capacity-factor must be a positive number, got 0"},
           {" --moe-token-drop-policy random", "--moe-token-drop-policy 'random' is not supported"},
           {" --moe-layer-freq [1,0,1]", "gives 3 entries but --num-layers is 4"},
           {" --moe-layer-freq [1,0,2,0]", "entry 2 is 2"},
           {" --moe-router-score-function tanh", "--moe-router-score-function 'tanh' is not supported"},
           {" --nproc-per-node 3 --expert-model-parallel-size 3 --global-batch-size 6",
            "--num-experts 8 is not divisible by expert model parallel size 3"},
           {" --moe-enable-echo", "--moe-enable-echo needs --moe-num-echo-experts >= 1"},
           {" --moe-enable-echo --moe-num-echo-experts 1", "needs --moe-token-dispatcher-type alltoall"},
           {" --moe-enable-echo --moe-num-echo-experts 1 --moe-token-dispatcher-type alltoall",
            "--moe-enable-echo needs --expert-model-parallel-size > 1"}})
    expect_error_text([&] { train("--train-iters 2" + moe + extra); }, message, extra);
}

// --moe-router-load-balancing-type global_aux_loss: logged as Megatron's global_load_balancing_loss,
// the same losses under TP 2 + SP and PP 2 (the same micro-batches as one rank; under DP each
// step's loss reads the counts of all DP ranks' micro-batches, as Megatron's); sinkhorn is still an
// error.
TEST_F(TrainerLayouts, MixtureOfExpertsGlobalAuxLoss) {
  const std::string moe = std::string(kTinyMoe) +
                          " --moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 1e-2 "
                          "--moe-z-loss-coeff 1e-3";
  SetupInfo info;
  const TrainingResult full = train("--train-iters 4" + moe, &info);
  EXPECT_TRUE(has(info.model_summary, "global_aux_loss 0.01")) << info.model_summary;
  const std::string log = log_text(full);
  EXPECT_TRUE(has(log, " global_load_balancing_loss: ")) << log;
  EXPECT_FALSE(has(log, " load_balancing_loss: ")) << log;
  ASSERT_EQ(full.losses.size(), 4u);
  for (const std::string layout : {"--nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel",
                                   "--nproc-per-node 2 --pipeline-model-parallel-size 2"}) {
    SCOPED_TRACE(layout);
    expect_same_losses(train("--train-iters 4 " + layout + moe), full, layout + " (MoE global_aux_loss)");
  }
  const std::string dp = log_text(train("--train-iters 2 --nproc-per-node 2" + moe));
  EXPECT_TRUE(has(dp, " global_load_balancing_loss: ")) << dp;
  expect_error_text([&] { train("--train-iters 2" + std::string(kTinyMoe) + " --moe-router-load-balancing-type sinkhorn"); },
                    "--moe-router-load-balancing-type sinkhorn is not implemented yet", "sinkhorn");
}

// --moe-router-dtype fp64, Megatron's list of load-balancing types and a gated shared expert
// (--moe-shared-expert-gate): the summary names every type with its coefficient and the gated
// shared expert, the log shows each type's loss under Megatron's name, TP 2 + SP and EP 2 give the
// one-rank losses, a checkpoint (with the gate's weight) resumes on the same curve; mismatched lists
// and bad values are errors naming them.
TEST_F(TrainerLayouts, MixtureOfExpertsRouterDtypeAndLoadBalancingLists) {
  const std::string moe = std::string(kTinyMoe) +
                          " --moe-router-dtype fp64 --moe-router-load-balancing-type aux_loss seq_aux_loss "
                          "--moe-aux-loss-coeff 1e-2 1e-3 --moe-z-loss-coeff 1e-3 "
                          "--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate";
  SetupInfo info;
  const TrainingResult full = train("--train-iters 6" + moe, &info);
  EXPECT_TRUE(has(info.model_summary, "aux_loss 0.01, seq_aux_loss 0.001")) << info.model_summary;
  EXPECT_TRUE(has(info.model_summary, "gated shared expert 32")) << info.model_summary;
  const std::string log = log_text(full);
  EXPECT_TRUE(has(log, " load_balancing_loss: ")) << log;
  EXPECT_TRUE(has(log, " seq_load_balancing_loss: ")) << log;
  ASSERT_EQ(full.losses.size(), 6u);
  for (const std::string layout : {"--nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel",
                                   "--nproc-per-node 2 --expert-model-parallel-size 2"}) {
    SCOPED_TRACE(layout);
    expect_same_losses(train("--train-iters 6 " + layout + moe), full,
                       layout + " (fp64 router, two load-balancing types)");
  }
  TrainingResult first, l;
  const std::string ck = dir("ck_moe_lists");
  ASSERT_NO_FATAL_FAILURE(save_half(ck, moe, &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ck, moe, &l));
  expect_same_losses(l, full, "fp64 router, two load-balancing types: resumed");
  for (const auto& [extra, message] : std::vector<std::pair<std::string, std::string>>{
           {" --moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 1e-2",
            "--moe-aux-loss-coeff gives 1 coefficient(s) (0.01) but --moe-router-load-balancing-type gives 2 type(s) "
            "(aux_loss seq_aux_loss)"},
           {" --moe-aux-loss-coeff 1e-2 1e-3",
            "--moe-aux-loss-coeff gives 2 coefficient(s) (0.01 0.001) but --moe-router-load-balancing-type gives 1 "
            "type(s) (aux_loss)"},
           {" --moe-router-load-balancing-type aux_loss aux_loss --moe-aux-loss-coeff 1e-2 1e-3",
            "--moe-router-load-balancing-type aux_loss aux_loss lists aux_loss twice"},
           {" --moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 1e-2 -1",
            "--moe-aux-loss-coeff must be >= 0, got -1 (for seq_aux_loss)"},
           {" --moe-router-dtype fp16", "--moe-router-dtype 'fp16' is not supported: expected fp32 or fp64"},
           {" --moe-shared-expert-gate",
            "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size > 0 (a shared expert to gate), got 0"},
           {" --moe-router-dtype fp64 --moe-router-force-load-balancing",
            "--moe-router-force-load-balancing with --moe-router-dtype fp64 is not supported"}})
    expect_error_text([&] { train("--train-iters 2" + std::string(kTinyMoe) + extra); }, message, extra);
}

// Checkpoints of the MoE model move between expert layouts (docs/moe.md "Checkpoints"): each
// rank writes only the experts it owns (expert-data-parallel rank 0 of its expert TP / EP
// coordinates), and a run resumed under another EP / ETP / TP / PP / DP size, with or without the
// distributed optimizer (which shards the expert state over the expert-data-parallel group), saved
// synchronously or with --async-save, continues on the uninterrupted one-rank loss curve. A
// checkpoint of another MoE shape is a clear error.
TEST_F(TrainerLayouts, MixtureOfExpertsCheckpointsReshard) {
  const std::string moe = std::string(kTinyMoe) + " --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3";
  const TrainingResult full = train("--train-iters 6" + moe);
  ASSERT_EQ(full.losses.size(), 6u);
  const std::string tp2 = " --tensor-model-parallel-size 2 --sequence-parallel";
  struct Case {
    std::string name, save, resume;
  };
  const std::vector<Case> cases = {
      {"ep2", "--nproc-per-node 2 --expert-model-parallel-size 2", ""},
      {"ep1_to_ep4", "", "--nproc-per-node 4 --expert-model-parallel-size 4 --use-distributed-optimizer"},
      {"etp1_to_etp2", "--nproc-per-node 2" + tp2 + " --expert-tensor-parallel-size 1 --use-distributed-optimizer",
       "--nproc-per-node 2" + tp2},
      {"ep2etp2_to_ep2etp1",
       "--nproc-per-node 4" + tp2 + " --expert-model-parallel-size 2 --use-distributed-optimizer",
       "--nproc-per-node 4" + tp2 + " --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 "
       "--use-distributed-optimizer"},
      {"pp2ep2_async_to_dp2",
       "--nproc-per-node 4 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 --async-save",
       "--nproc-per-node 2 --use-distributed-optimizer"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TrainingResult first, l;
    const std::string ck = dir("ck_moe_" + c.name);
    ASSERT_NO_FATAL_FAILURE(save_half(ck, c.save + moe, &first));
    ASSERT_NO_FATAL_FAILURE(resume(first, ck, c.resume + moe, &l));
    expect_same_losses(l, full, "MoE checkpoint " + c.name + ": [" + c.save + "] -> [" + c.resume + "]");
  }
  // Under EP 2 the two ranks each wrote their own 4 experts (and DP rank 0 the dense tensors).
  const std::string ck = dir("ck_moe_ep2");
  std::ifstream meta(ck + "/iter_0000003/metadata.json");
  const nlohmann::json m = nlohmann::json::parse(meta);
  EXPECT_EQ(m.at("expert_model_parallel_size"), 2);
  std::map<std::string, std::string> file_of;
  for (const auto& t : m.at("tensors")) {
    ASSERT_EQ(t.at("shards").size(), 1u) << t.dump();
    file_of[t.at("name").get<std::string>()] = t.at("shards")[0].at("file").get<std::string>();
  }
  const std::string e = "decoder.layers.1.mlp.experts.local_experts.";
  EXPECT_EQ(file_of.at("model/" + e + "3.linear_fc1.weight"), "rank_00000.bin");
  EXPECT_EQ(file_of.at("model/" + e + "4.linear_fc1.weight"), "rank_00001.bin");
  EXPECT_EQ(file_of.at("optim/exp_avg/" + e + "7.linear_fc2.weight"), "rank_00001.bin");
  EXPECT_EQ(file_of.at("model/decoder.layers.1.mlp.router.weight"), "rank_00000.bin");
  // Another MoE shape: a clear error before training.
  for (const auto& [extra, message] : std::vector<std::pair<std::string, std::string>>{
           {" --num-experts 4", "checkpoint has --num-experts 8 but the command line asks for 4"},
           {" --moe-ffn-hidden-size 16", "checkpoint has --moe-ffn-hidden-size 32 but the command line asks for 16"},
           {" --moe-layer-freq 1", "checkpoint has --moe-layer-freq [0,1,0,1] but the command line asks for [1,1,1,1]"}})
    expect_error_text([&] { train("--train-iters 6 --load " + ck + moe + extra); }, message, extra);
}

// DeepSeek-style aux-loss-free balancing (sigmoid router, --moe-router-enable-expert-bias): the
// expert bias is model state, stored whole as "state/decoder.layers.<L>.mlp.router.expert_bias"
// by one rank per pipeline stage, so a run resumed under another layout continues on the
// uninterrupted curve, and its final expert bias (saved at iteration 6) equals the uninterrupted
// run's. The bias comparison is what catches a bias that is not restored: it moves the loss of
// this barely trained model by less than the tolerance, but restarts from zeros. Rate 0.01: at
// 0.05 the bias overshoots and oscillates back to exactly 0 after an even number of steps.
TEST_F(TrainerLayouts, MixtureOfExpertsExpertBiasCheckpoints) {
  const std::string moe = std::string(kTinyMoe) +
                          " --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                          "--moe-router-bias-update-rate 0.01";
  const std::string full_ck = dir("ck_bias_full");
  const TrainingResult full = train("--train-iters 6 --save " + full_ck + moe);
  ASSERT_EQ(full.losses.size(), 6u);
  std::vector<float> full_bias[2];
  for (int i = 0; i < 2; ++i) {
    full_bias[i] = read_whole_tensor(full_ck, 6, bias_state_name(2 * i + 1));
    ASSERT_EQ(full_bias[i].size(), 8u);
    EXPECT_TRUE(std::any_of(full_bias[i].begin(), full_bias[i].end(), [](float b) { return b != 0.f; }));
  }
  struct Case {
    std::string name, save, resume;
  };
  const std::vector<Case> cases = {
      {"tp2sp_to_1", "--nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel", ""},
      {"pp2_async_to_1", "--nproc-per-node 2 --pipeline-model-parallel-size 2 --async-save", ""},
      {"ep2_to_dp2", "--nproc-per-node 2 --expert-model-parallel-size 2",
       "--nproc-per-node 2 --use-distributed-optimizer"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TrainingResult first, l;
    const std::string ck = dir("ck_bias_" + c.name);
    ASSERT_NO_FATAL_FAILURE(save_half(ck, c.save + moe, &first));
    ASSERT_NO_FATAL_FAILURE(resume(first, ck, c.resume + moe + " --save " + ck, &l));
    EXPECT_EQ(l.losses.size(), 6u);
    for (int i = 0; i < 2; ++i) {
      const std::vector<float> b = read_whole_tensor(ck, 6, bias_state_name(2 * i + 1));
      ASSERT_EQ(b.size(), 8u);
      for (size_t e = 0; e < 8; ++e) EXPECT_NEAR(b[e], full_bias[i][e], 1e-6) << "layer " << 2 * i + 1 << " expert " << e;
    }
    expect_same_losses(l, full, "expert bias checkpoint " + c.name + ": [" + c.save + "] -> [" + c.resume + "]");
    // The bias of each MoE layer (1 and 3) is stored once, whole: [8] from one file.
    std::ifstream meta(ck + "/iter_0000003/metadata.json");
    const nlohmann::json m = nlohmann::json::parse(meta);
    std::map<std::string, nlohmann::json> state;
    for (const auto& t : m.at("tensors"))
      if (t.at("name").get<std::string>().rfind("state/", 0) == 0) state[t.at("name").get<std::string>()] = t;
    ASSERT_EQ(state.size(), 2u) << m.dump();
    for (int layer : {1, 3}) {
      const auto& t = state.at(bias_state_name(layer));
      EXPECT_EQ(t.at("global_shape"), nlohmann::json({8})) << t.dump();
      ASSERT_EQ(t.at("shards").size(), 1u) << t.dump();
      EXPECT_EQ(t.at("shards")[0].at("shape"), nlohmann::json({8})) << t.dump();
    }
  }
  // Pipeline stage 1 (rank 1) holds layer 3 and writes its bias.
  std::ifstream meta(dir("ck_bias_pp2_async_to_1") + "/iter_0000003/metadata.json");
  const nlohmann::json m = nlohmann::json::parse(meta);
  for (const auto& t : m.at("tensors")) {
    if (t.at("name") == bias_state_name(1)) EXPECT_EQ(t.at("shards")[0].at("file"), "rank_00000.bin");
    if (t.at("name") == bias_state_name(3)) EXPECT_EQ(t.at("shards")[0].at("file"), "rank_00001.bin");
  }
}

TEST_F(TrainerLayouts, BadLayoutErrors) {
  for (const auto& [extra, message] : std::vector<std::pair<std::string, std::string>>{
           {"--nproc-per-node 2 --tensor-model-parallel-size 3", "world size 2 is not divisible by tp (3)"},
           {"--nproc-per-node 2 --tensor-model-parallel-size 2 --num-attention-heads 3 --hidden-size 33",
            "not divisible by tensor parallel size 2"},
           {"--nproc-per-node 2 --global-batch-size 6 --micro-batch-size 4", "data-parallel size 2"},
           {"--nproc-per-node 2 --pipeline-model-parallel-size 2 --num-layers 3",
            "num_layers (3) = 3 is not divisible by pp (2)"},
           {"--nproc-per-node 2 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
            "--global-batch-size 6",
            "number of micro-batches (3)"}})
    expect_error_text([&] { train("--train-iters 2 " + extra); }, message, extra);
}

// --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads (ZeRO-2, docs/fsdp.md): the
// gradients are reduce-scattered per micro-batch into a shard through staging slots. Bitwise equal
// to optim (the distributed optimizer with the same buckets) where each rank runs one micro-batch
// (the sums are then taken in the same order; fp32 and bf16 reduction, TP 2 + SP); with gradient
// accumulation (DP 2: 2 micro-batches per rank) and under TP+SP, PP (tied embedding), CP and EP the
// one-rank losses and gradient norms within the layout tolerances; checkpoints written under
// optim_grads resume under optim and back on the same curve; the memory estimate's gradient term
// is the bytes the ranks allocate for gradients (shard + slots), less than a whole buffer.
// `strategy` against one rank within fp32 rounding (gradient accumulation): DP 2, DP 4, TP 2 + SP x
// DP 2, PP 2 x DP 2 (the tied embedding across stages), CP 2 x DP 2, and the tiny MoE at EP 2 x DP 4.
void expect_layouts_near_one_rank(const std::function<TrainingResult(const std::string&)>& train,
                                  const std::string& strategy) {
  const TrainingResult ref = train("--train-iters 4");
  for (const std::string layout : {"--nproc-per-node 2", "--nproc-per-node 4",
                                   "--nproc-per-node 4 --tensor-model-parallel-size 2 --sequence-parallel",
                                   "--nproc-per-node 4 --pipeline-model-parallel-size 2",
                                   "--nproc-per-node 4 --context-parallel-size 2"}) {
    SCOPED_TRACE(layout);
    expect_near_one_rank(train("--train-iters 4 " + layout + strategy), ref, layout);
  }
  const std::string moe = kTinyMoe;
  expect_near_one_rank(train("--train-iters 4 --nproc-per-node 4 --expert-model-parallel-size 2" + moe + strategy),
                       train("--train-iters 4" + moe), "EP 2 x DP 4");
}

TEST_F(TrainerLayouts, MegatronFsdpOptimGrads) {
  const std::string og = " --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --ddp-bucket-size 3000";
  const std::string optim = " --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000";
  for (const std::string layout : {"--nproc-per-node 4", "--nproc-per-node 4 --megatron-fsdp-grad-comm-dtype bf16",
                                   "--nproc-per-node 4 --tensor-model-parallel-size 2 --sequence-parallel "
                                   "--global-batch-size 4"}) {
    SCOPED_TRACE(layout);
    std::string today = layout;
    if (const size_t at = today.find(" --megatron-fsdp-grad-comm-dtype bf16"); at != std::string::npos)
      today.replace(at, 37, " --grad-reduce-in-bf16");
    expect_identical_runs(train("--train-iters 4 " + layout + og), train("--train-iters 4 " + today + optim), layout);
  }
  expect_layouts_near_one_rank([](const std::string& f) { return train(f); }, og);
  // Checkpoints: optim_grads -> optim and optim -> optim_grads on the one-layout curve.
  expect_checkpoints_cross_load(og, optim, "og");
  // Memory: the estimate's gradient term == the gradient bytes allocated (shard + staging slots),
  // less than a whole gradient once the model has more than a few buckets (8 layers, DP 4; the
  // slots are as large as the largest bucket, here the word embedding's).
  const std::string f = flags("--train-iters 1 --num-layers 8 --nproc-per-node 4" + og);
  run_thread_ranks(4, [&](int, std::shared_ptr<Communicator> world) {
    TrainingSetup setup(testing::parse_pretrain_args(f), std::move(world), Device::cpu());
    const GradSync& gs = setup.model_setup().grad_sync();
    const ParamStore& ps = gs.params();
    EXPECT_TRUE(gs.grads_sharded());
    EXPECT_LT(ps.grad_slots(), static_cast<int>(ps.buckets().size()));
    int64_t largest = 0;
    for (const ParamBucket& b : ps.buckets()) largest = std::max(largest, b.numel());
    EXPECT_EQ(gs.grad_bytes(), (gs.owned_elements() + ps.grad_slots() * largest) * 4);
    EXPECT_LT(gs.grad_bytes(), ps.total_elements() * 4);
    size_t estimated = 0;
    for (const MemoryPart& p : setup.model_setup().memory_estimate().parts)
      if (p.name.rfind("gradients", 0) == 0) estimated = p.bytes;
    EXPECT_EQ(estimated, static_cast<size_t>(gs.grad_bytes()));
  });
  for (const auto& [bad, msg] : std::vector<std::pair<std::string, std::string>>{
           {" --optimizer muon", "--optimizer muon with sharded gradients"}})
    expect_error_text([&] { train("--train-iters 1 --nproc-per-node 2" + og + bad); }, msg, bad);
}

// --data-parallel-sharding-strategy optim_grads_params (ZeRO-3, docs/fsdp.md): each rank keeps its
// owned slice of the parameters, gathered per unit into staging slots. With one micro-batch per
// rank the gradients are summed in the same order as the distributed optimizer's (same buckets),
// so losses and gradient norms are bitwise those of optim (fp32 and bf16 models, recompute);
// with gradient accumulation and under every composition (TP + SP, PP with the tied embedding, CP,
// EP) they equal one rank within fp32 rounding; checkpoints load across strategies; the memory
// estimate counts the allocated parameter bytes exactly; what is not built is refused.
TEST_F(TrainerLayouts, MegatronFsdpOptimGradsParams) {
  const std::string ogp =
      " --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ddp-bucket-size 3000";
  const std::string optim = " --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000";
  for (const std::string layout :
       {"--nproc-per-node 4", "--nproc-per-node 2 --global-batch-size 4",
        "--nproc-per-node 4 --recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
        "--nproc-per-node 2 --global-batch-size 4 --overlap-grad-reduce",
        "--nproc-per-node 4 --tensor-model-parallel-size 2 --sequence-parallel --global-batch-size 4"}) {
    SCOPED_TRACE(layout);
    expect_identical_runs(train("--train-iters 4 " + layout + ogp), train("--train-iters 4 " + layout + optim),
                          layout);
  }
  expect_layouts_near_one_rank([](const std::string& f) { return train(f); }, ogp);
  // Checkpoints: optim_grads_params -> optim and optim -> optim_grads_params on the one-layout curve.
  expect_checkpoints_cross_load(ogp, optim, "ogp");
  // Memory: the estimate's parameter terms == the bytes allocated (owned slices + staging slots;
  // an fp32 model's owned slices are its main shard), less than whole parameters (8 layers, DP 4).
  {  // (the CPU backend trains in fp32: the bf16 terms are checked in grad_sync_test)
    const std::string dtype;
    const std::string f = flags("--train-iters 1 --num-layers 8 --nproc-per-node 4" + ogp);
    run_thread_ranks(4, [&](int, std::shared_ptr<Communicator> world) {
      TrainingSetup setup(testing::parse_pretrain_args(f), std::move(world), Device::cpu());
      const GradSync& gs = setup.model_setup().grad_sync();
      const ParamStore& ps = gs.params();
      EXPECT_TRUE(gs.params_sharded());
      EXPECT_TRUE(ps.params_staged());
      EXPECT_LT(ps.param_slots(), static_cast<int>(ps.buckets().size()));
      const int64_t es = dtype.empty() ? 4 : 2;
      const int64_t model_bytes = gs.param_bytes();  // an fp32 model's shard is its main shard
      EXPECT_EQ(model_bytes, (gs.owned_elements() + ps.param_slots() * ps.largest_dense_bucket()) * es);
      EXPECT_LT(model_bytes, ps.total_elements() * es);
      size_t estimated = 0;
      for (const MemoryPart& p : setup.model_setup().memory_estimate().parts)
        if (p.name.rfind("parameter staging slots", 0) == 0 || p.name.rfind("parameters (fp32)", 0) == 0)
          estimated += p.bytes;
      EXPECT_EQ(estimated, static_cast<size_t>(model_bytes));
    });
  }
  for (const auto& [bad, msg] : std::vector<std::pair<std::string, std::string>>{
           {" --optimizer muon", "--optimizer muon with --data-parallel-sharding-strategy optim_grads_params"},
           {" --fp8-format hybrid", "optim_grads_params with --fp8-format is not built"},
           {" --overlap-grad-reduce --overlap-param-gather", "drop the flag"},
           {" --cuda-graph-impl local --cuda-graph-scope attn mlp", "optim_grads_params with per-layer CUDA graphs"},
           // (the full-iteration graph is built: refused on the CPU only, docs/fsdp.md)
           {" --cuda-graph-impl full_iteration", "--cuda-graph-impl full_iteration needs a CUDA device"},
           {" --ddp-copy-engine", "optim_grads_params with --ddp-copy-engine is not built"}})
    expect_error_text([&] { train("--train-iters 1 --nproc-per-node 2" + ogp + bad); }, msg, bad);
}

// Multi-token prediction under optim_grads_params (docs/fsdp.md "optim_grads_params (ZeRO-3): as
// built"): the MTP brackets each use of the parameters it reads (the word embedding for its
// embedding, its norms and eh_proj, its layer, its head with the shared output layer), so a
// parameter read outside them is an error (ParamStore::param). With one micro-batch per rank the
// losses, the logged MTP losses, gradient norms and validation losses are bitwise those of optim
// (DP 4, PP 2 x DP 2 with the MTP on the last stage; tied and untied embeddings: the word embedding
// is the embedding's, the last stage's copy of the tied one in the head, or the copy the MTP
// declares; full recompute; two depths; --overlap-grad-reduce); with accumulation (DP 2, PP 2 x
// DP 2 over 2 micro-batches) within fp32 rounding; checkpoints load across optim and back; the
// memory estimate counts the allocated gradient and parameter bytes.
TEST_F(TrainerLayouts, MegatronFsdpOptimGradsParamsMtp) {
  const std::string ogp =
      " --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ddp-bucket-size 3000";
  const std::string optim = " --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000";
  const std::string mtp1 = " --position-embedding-type rope --mtp-num-layers 1";
  const std::string untied = " --untie-embeddings-and-output-weights";
  const std::string pp2 = " --nproc-per-node 4 --pipeline-model-parallel-size 2";
  const std::string recompute = " --recompute-granularity full --recompute-method uniform --recompute-num-layers 2";
  auto expect_same_mtp_losses = [](const TrainingResult& a, const TrainingResult& b, const std::string& what,
                                   int depths, double rel) {
    ASSERT_EQ(a.log.size(), b.log.size()) << what;
    for (size_t i = 0; i < b.log.size(); ++i)
      for (int k = 1; k <= depths; ++k) {
        const std::string key = "mtp_" + std::to_string(k) + " loss";
        const std::string x = testing::logged(a.log[i].line, key), y = testing::logged(b.log[i].line, key);
        ASSERT_NE(y, "") << what << ": " << b.log[i].line;
        if (rel == 0)
          EXPECT_EQ(x, y) << what << " " << key << " at log point " << i;
        else
          EXPECT_NEAR(std::stod(x), std::stod(y), rel * std::stod(y)) << what << " " << key << " at log point " << i;
      }
  };
  // One micro-batch per rank: bitwise optim.
  for (const std::string layout :
       {"--nproc-per-node 4" + mtp1, "--nproc-per-node 4" + mtp1 + untied,
        "--nproc-per-node 4" + mtp1 + recompute, std::string("--nproc-per-node 4 --mtp-num-layers 2 --position-embedding-type rope"),
        "--nproc-per-node 4 --overlap-grad-reduce" + mtp1 + untied,
        pp2 + " --global-batch-size 4" + mtp1, pp2 + " --global-batch-size 4" + mtp1 + untied,
        pp2 + " --global-batch-size 4 --overlap-grad-reduce" + mtp1 + untied + recompute}) {
    SCOPED_TRACE(layout);
    const TrainingResult a = train("--train-iters 4 " + layout + ogp), b = train("--train-iters 4 " + layout + optim);
    expect_identical_runs(a, b, layout);
    expect_same_mtp_losses(a, b, layout, layout.find("--mtp-num-layers 2") != std::string::npos ? 2 : 1, 0);
  }
  // Gradient accumulation (2 micro-batches per rank): optim within fp32 rounding, and the
  // overlapped reduce-scatter bitwise the non-overlapped one.
  for (const std::string layout : {"--nproc-per-node 2" + mtp1, "--nproc-per-node 2" + mtp1 + untied,
                                   pp2 + mtp1, pp2 + mtp1 + untied}) {
    SCOPED_TRACE(layout);
    const TrainingResult a = train("--train-iters 4 " + layout + ogp);
    const TrainingResult b = train("--train-iters 4 " + layout + optim);
    expect_near_one_rank(a, b, layout);
    expect_same_mtp_losses(a, b, layout, 1, 2e-5);
    const TrainingResult o = train("--train-iters 4 --overlap-grad-reduce " + layout + ogp);
    expect_identical_runs(o, a, layout + " overlapped");
    expect_same_mtp_losses(o, a, layout + " overlapped", 1, 0);
  }
  // Checkpoints: optim_grads_params -> optim and optim -> optim_grads_params (untied: the last
  // stage's copy of the word embedding is not saved).
  expect_checkpoints_cross_load(mtp1 + untied + ogp, mtp1 + untied + optim, "ogp_mtp");
  expect_checkpoints_cross_load(mtp1 + ogp, mtp1 + optim, "ogp_mtp_pp2", pp2 + " --global-batch-size 4");
  // Memory: the slot counts need no MTP term; the estimate == the allocated bytes (PP 2, untied:
  // the last stage holds the MTP's copy of the word embedding).
  const std::string f = flags("--train-iters 1 --num-layers 8" + pp2 + mtp1 + untied + ogp);
  run_thread_ranks(4, [&](int, std::shared_ptr<Communicator> world) {
    TrainingSetup setup(testing::parse_pretrain_args(f), std::move(world), Device::cpu());
    const GradSync& gs = setup.model_setup().grad_sync();
    EXPECT_TRUE(gs.params_sharded());
    EXPECT_EQ(gs.params().param_slots(), gs.params().param_slots_needed());
    expect_estimate_matches_sync(setup.model_setup().memory_estimate(), gs);
  });
}

// The interleaved pipeline schedule (--num-layers-per-virtual-pipeline-stage, docs/fsdp.md
// "Interleaved pipeline schedule: as built") under optim_grads and optim_grads_params: the buckets
// never span two model chunks (ParamLayout::split_model_chunks), so each chunk's backward completes
// the buckets it writes while the backwards and forwards of the chunks and micro-batches interleave.
// PP 2 x VPP 2 x DP 2 (2 micro-batches per rank: accumulation) equals one rank and the distributed
// optimizer with the same layout within fp32 rounding, for the dense GPT (the tied embedding across
// the first and last virtual stages), the Llama style (untied), full recompute, and the tiny MoE with
// its experts sharded over EDP (six MoE layers, three per rank in three chunks: MoE layers 0 and 2 of
// a rank share an expert parameter slot; EP 2 too); the memory estimate counts the bytes allocated
// and no bucket spans two chunks. (The negative control, a store whose bucket spans two chunks
// refused, is grad_sync_test's BucketPlan.SplitModelChunks.)
TEST_F(TrainerLayouts, MegatronFsdpInterleavedPipeline) {
  const std::string vpp = "--nproc-per-node 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1";
  const std::string fsdp = " --use-megatron-fsdp --ddp-bucket-size 3000 --data-parallel-sharding-strategy ";
  const std::string optim = " --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000";
  const std::string llama = " --swiglu --ffn-hidden-size 64 --normalization RMSNorm --position-embedding-type rope "
                            "--disable-bias-linear --untie-embeddings-and-output-weights";
  const std::string recompute = " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1";
  for (const std::string model : {std::string(), llama}) {
    SCOPED_TRACE(model);
    const TrainingResult ref = train("--train-iters 4" + model);
    const TrainingResult today = train("--train-iters 4 " + vpp + model + optim);
    expect_near_one_rank(today, ref, "optim" + model);
    for (const std::string strategy : {"optim_grads", "optim_grads_params"}) {
      for (const std::string extra : {std::string(), recompute}) {
        const TrainingResult r = train("--train-iters 4 " + vpp + model + extra + fsdp + strategy);
        expect_near_one_rank(r, ref, strategy + model + extra);
        expect_near_one_rank(r, today, strategy + " vs optim" + model + extra);
      }
    }
  }
  // One bucket per model chunk (the bucket size above the whole model): without the chunk rule
  // the one bucket would span both chunks of a rank (the gradients reported twice before it
  // completes: the negative control, by hand, fails here).
  {
    const std::string big = " --use-megatron-fsdp --ddp-bucket-size 1000000 --data-parallel-sharding-strategy ";
    const TrainingResult ref = train("--train-iters 4");
    for (const std::string strategy : {"optim_grads", "optim_grads_params"})
      expect_near_one_rank(train("--train-iters 4 " + vpp + big + strategy), ref, strategy + " one bucket per chunk");
    // Llama (an untied output layer, in the loss chunk's bucket) with micro-batch groups of 3 over 5
    // micro-batches per rank: the loss chunk's forward writes the output layer's gradient, and its
    // bucket stays bound across the other chunk's actions until that micro-batch's backward
    // (docs/fsdp.md "Interleaved pipeline schedule"); also with multi-token prediction in that
    // chunk.
    const std::string groups = " --global-batch-size 20 --microbatch-group-size-per-virtual-pipeline-stage 3";
    for (const std::string mtp : {std::string(), std::string(" --mtp-num-layers 1")}) {
      const TrainingResult ref_l = train("--train-iters 4 --global-batch-size 20" + llama + mtp);
      for (const std::string strategy : {"optim_grads", "optim_grads_params"}) {
        expect_near_one_rank(train("--train-iters 4 " + vpp + llama + mtp + groups + big + strategy), ref_l,
                             strategy + " llama, groups of 3" + mtp);
      }
    }
  }
  const std::string moe = std::string(kTinyMoe) + " --num-layers 6 --moe-layer-freq 1";
  const TrainingResult ref_moe = train("--train-iters 4" + moe);
  for (const std::string strategy : {"optim_grads", "optim_grads_params"})
    for (const std::string ep : {"", " --expert-model-parallel-size 2"})
      expect_near_one_rank(train("--train-iters 4 " + vpp + ep + moe + fsdp + strategy), ref_moe,
                           "MoE " + strategy + ep);
  // Memory and layout: 8 layers, 2 per virtual stage (two chunks per rank).
  for (const std::string strategy : {"optim_grads", "optim_grads_params"}) {
    const std::string f = flags("--train-iters 1 --num-layers 8 --nproc-per-node 4 --pipeline-model-parallel-size 2 "
                                "--num-layers-per-virtual-pipeline-stage 2" +
                                fsdp + strategy);
    run_thread_ranks(4, [&](int, std::shared_ptr<Communicator> world) {
      TrainingSetup setup(testing::parse_pretrain_args(f), std::move(world), Device::cpu());
      const GradSync& gs = setup.model_setup().grad_sync();
      const ParamStore& ps = gs.params();
      EXPECT_TRUE(ps.layout().split_model_chunks);
      EXPECT_EQ(ps.info(ps.size() - 1).model_chunk, 1) << strategy;  // two chunks on every rank
      for (const ParamBucket& b : ps.buckets())
        EXPECT_EQ(ps.info(b.param_begin).model_chunk, ps.info(b.param_end - 1).model_chunk)
            << strategy << ": bucket of '" << ps.info(b.param_begin).name << "'..";
      EXPECT_LT(ps.grad_slots(), static_cast<int>(ps.buckets().size()));
      if (gs.params_sharded()) {
        expect_estimate_matches_sync(setup.model_setup().memory_estimate(), gs);
      } else {  // (an fp32 model without parameter staging: its parameters are the main ones)
        size_t estimated = 0;
        for (const MemoryPart& p : setup.model_setup().memory_estimate().parts)
          if (p.name.rfind("gradients", 0) == 0) estimated = p.bytes;
        EXPECT_EQ(estimated, static_cast<size_t>(gs.grad_bytes()));
        EXPECT_EQ(gs.grad_bytes(), (gs.owned_elements() + ps.grad_slots() * ps.largest_dense_bucket()) * 4);
      }
    });
  }
}

// Sharded experts (docs/fsdp.md "Expert buckets"): under optim_grads and optim_grads_params the
// MoE experts' gradients (and parameters) are staged per MoE layer in expert slots at fixed
// addresses (the grouped-GEMM tables are built once) and sharded over the expert-data-parallel
// group like the dense buckets. The tiny MoE equals one rank within fp32 rounding with the
// sequential and the grouped-GEMM experts at EP 2 x EDP 2 (DP 4) and EP 1 x DP 2, and with six
// MoE layers (slots reused: MoE layers k and k + 2 share one) at EP 2 x EDP 2, with full
// recompute, and PP 2 (1F1B) x DP 2 (three MoE layers per stage), ECHO clones, the chunked expert pipeline with delayed weight
// gradients, hybrid sharding (k = 2); FP8 experts under optim_grads equal the distributed
// optimizer; checkpoints written under optim_grads_params with sharded
// experts load under the distributed optimizer and back; the memory estimate's parameter and
// gradient terms are the bytes allocated, the experts' share E/EDP plus the slots instead of E.
// (The negative controls, experts not gathered again and two live MoE layers on one slot, are
// grad_sync_test's ShardedExpertsBf16.)
TEST_F(TrainerLayouts, MegatronFsdpShardedExperts) {
  const std::string moe = kTinyMoe;
  const std::string fsdp = " --use-megatron-fsdp --ddp-bucket-size 3000 --data-parallel-sharding-strategy ";
  // six MoE layers: three per stage under PP 2, so MoE layers 0 and 2 of a stage share an expert
  // parameter slot (and every MoE layer the one gradient slot)
  const std::string every = " --num-layers 6 --moe-layer-freq 1";
  for (const std::string experts : {"", " --moe-grouped-gemm"}) {
    SCOPED_TRACE(experts);
    const TrainingResult ref = train("--train-iters 4" + moe + experts);
    const TrainingResult ref_every = train("--train-iters 4" + moe + every + experts);
    for (const std::string strategy : {"optim_grads", "optim_grads_params"}) {
      for (const std::string layout : {"--nproc-per-node 4 --expert-model-parallel-size 2", "--nproc-per-node 2"})
        expect_near_one_rank(train("--train-iters 4 " + layout + moe + experts + fsdp + strategy), ref,
                             layout + " " + strategy + experts);
      for (const std::string layout :
           {"--nproc-per-node 4 --expert-model-parallel-size 2",
            "--nproc-per-node 4 --expert-model-parallel-size 2 --recompute-granularity full --recompute-method "
            "uniform --recompute-num-layers 2",
            "--nproc-per-node 4 --pipeline-model-parallel-size 2"})
        expect_near_one_rank(train("--train-iters 4 " + layout + moe + every + experts + fsdp + strategy), ref_every,
                             layout + every + " " + strategy + experts);
      // ECHO: the clones fetch their home experts' weights from the slots and return gradients into them
      const std::string echo = std::string("--nproc-per-node 4 --expert-model-parallel-size 2 ") +
                               "--moe-token-dispatcher-type alltoall --moe-enable-echo --moe-num-echo-experts 1" +
                               (experts.empty() ? "" : " --moe-received-token-capacity 100000");
      expect_near_one_rank(train("--train-iters 4 " + echo + moe + experts + fsdp + strategy), ref,
                           echo + " " + strategy + experts);
      // the chunked expert pipeline with delayed weight gradients (still inside the layer's backward)
      const std::string chunked = "--nproc-per-node 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type "
                                  "alltoall --overlap-moe-expert-parallel-comm --delay-wgrad-compute";
      if (experts.empty())
        expect_near_one_rank(train("--train-iters 4 " + chunked + moe + fsdp + strategy), ref, chunked + " " + strategy);
    }
  }
  // Hybrid sharding (DP 8 = 2 instances of 4, EDP 4 = 2 instances of 2): the experts sharded and
  // gathered over the expert instance.
  expect_near_one_rank(train("--train-iters 4 --micro-batch-size 1 --nproc-per-node 8 --expert-model-parallel-size 2" +
                             moe + " --moe-grouped-gemm" + fsdp +
                             "optim_grads_params --num-distributed-optimizer-instances 2"),
                       train("--train-iters 4 --micro-batch-size 1" + moe + " --moe-grouped-gemm"), "EP 2 x EDP 4, k 2");
  // FP8 grouped experts (optim_grads: their weight gradients through the tables into the expert
  // slot) against the distributed optimizer with the same layout and buckets.
  for (const std::string experts : {"", " --moe-grouped-gemm"}) {
    const std::string fp8 = "--nproc-per-node 4 --expert-model-parallel-size 2 --fp8-format hybrid" + moe + experts;
    expect_near_one_rank(train("--train-iters 4 " + fp8 + fsdp + "optim_grads"),
                         train("--train-iters 4 " + fp8 + " --use-distributed-optimizer --overlap-grad-reduce "
                                                         "--ddp-bucket-size 3000"),
                         "FP8 experts, optim_grads" + experts);
  }
  // Checkpoints: optim_grads_params (sharded experts) -> the distributed optimizer and back.
  expect_checkpoints_cross_load(moe + " --moe-grouped-gemm" + fsdp + "optim_grads_params",
                                moe + " --moe-grouped-gemm --use-distributed-optimizer --overlap-grad-reduce "
                                      "--ddp-bucket-size 3000",
                                "experts", "--nproc-per-node 4 --expert-model-parallel-size 2");
  // Memory (8 MoE layers, EP 2 x EDP 2): the expert slots are 2 (parameters) and 1 (gradients) of
  // the largest MoE layer's experts; the estimate counts exactly the bytes allocated; the experts'
  // parameters take E/EDP + 2 layers' worth, less than the whole E the resident buffer held.
  const std::string f = flags("--train-iters 1 --num-layers 8 --nproc-per-node 4 --expert-model-parallel-size 2" +
                              moe + " --moe-layer-freq 1 --moe-grouped-gemm" + fsdp + "optim_grads_params");
  run_thread_ranks(4, [&](int, std::shared_ptr<Communicator> world) {
    TrainingSetup setup(testing::parse_pretrain_args(f), std::move(world), Device::cpu());
    const GradSync& gs = setup.model_setup().grad_sync();
    const ParamStore& ps = gs.params();
    ASSERT_EQ(ps.expert_regions().size(), 8u);
    EXPECT_EQ(gs.edp()->size(), 2);
    EXPECT_EQ(ps.expert_param_slots(), 2);
    EXPECT_EQ(ps.expert_grad_slots(), 1);
    int64_t experts = 0, owned_experts = 0;
    for (size_t b = 0; b < ps.buckets().size(); ++b) {
      if (!ps.buckets()[b].expert) continue;
      experts += ps.buckets()[b].numel();
      owned_experts += gs.owned_range(b).end - gs.owned_range(b).begin;
    }
    const int64_t slot = ps.expert_slot_length();
    EXPECT_EQ(slot * 8, experts);  // every MoE layer's experts alike
    EXPECT_EQ(owned_experts * 2, experts);
    EXPECT_EQ(gs.param_bytes(), (gs.owned_elements() + ps.param_slots() * ps.largest_dense_bucket() + 2 * slot) * 4);
    EXPECT_EQ(gs.grad_bytes(), (gs.owned_elements() + ps.grad_slots() * ps.largest_dense_bucket() + slot) * 4);
    EXPECT_LT(owned_experts + 2 * slot, experts);  // 3/4 E
    expect_estimate_matches_sync(setup.model_setup().memory_estimate(), gs);
  });
}

// --num-distributed-optimizer-instances k (hybrid sharding, docs/fsdp.md): the DP group splits
// into k instances of DP/k contiguous ranks, each sharding as a DP group of DP/k would, the owned
// gradients all-reduced across the instances. For the distributed optimizer and every Megatron-FSDP
// strategy: DP 4 as 2 instances equals one rank and k = 1 within fp32 rounding (the sums are taken
// in another order: within the instance, then across); DP 2 as 2 instances of one rank is plain
// DDP's reduction (the all-reduce over the 2 ranks, the norm over whole gradients), bitwise (under
// optim_grads(_params) the losses bitwise, the norm, summed over the owned shard, within 1e-6); with one
// micro-batch per rank optim_grads(_params) with k = 2 are bitwise the distributed optimizer with
// k = 2 (fp32 and bf16 reduction); TP 2 + SP x DP 4, PP 2 x DP 2, CP 2 x DP 2 (the dp-cp group split)
// and the tiny MoE at EP 2 x DP 4 equal one rank; checkpoints written with k = 2 resume
// with k = 1 and back; the memory estimate's parameter and gradient terms are the bytes allocated;
// bad values are refused, naming them. (The negative control, a dropped cross-instance all-reduce
// caught, is grad_sync_test's HybridShardingNeedsTheCrossInstanceAllReduce.)
TEST_F(TrainerLayouts, MegatronFsdpHybridSharding) {
  const std::string k2 = " --num-distributed-optimizer-instances 2";
  const std::string fsdp = " --use-megatron-fsdp --ddp-bucket-size 3000 --data-parallel-sharding-strategy ";
  const TrainingResult ref = train("--train-iters 4");
  for (const std::string strategy : {std::string(" --use-distributed-optimizer"), fsdp + "optim",
                                     fsdp + "optim_grads", fsdp + "optim_grads_params"}) {
    SCOPED_TRACE(strategy);
    const TrainingResult hybrid = train("--train-iters 4 --nproc-per-node 4" + strategy + k2);
    expect_near_one_rank(hybrid, ref, "DP 4, k 2");
    expect_near_one_rank(hybrid, train("--train-iters 4 --nproc-per-node 4" + strategy), "DP 4, k 2 against k 1");
    // optim_grads(_params) hold the gradients as the owned shard (every bucket's owned slice,
    // concatenated), whose squared norm sums in another grouping than over the whole gradient
    // buffer: the norms agree to the last bits only (measured here: equal to 6 digits, not bitwise)
    const bool shard = strategy.find("optim_grads") != std::string::npos;
    expect_identical_runs(train("--train-iters 4 --nproc-per-node 2" + strategy + k2),
                          train("--train-iters 4 --nproc-per-node 2"), "DP 2, k 2 against plain DDP",
                          shard ? 1e-6 : 0.0);
  }
  // One micro-batch per rank (DP 4): optim_grads and optim_grads_params sum in the distributed
  // optimizer's order with the same buckets (the reduce-scatter in the instance, then the
  // all-reduce across instances), so with k = 2 they are bitwise the distributed optimizer's, in
  // fp32 and with the bf16 reduction (the shard's bf16 all-reduce sees the bf16-reduced values).
  const std::string distopt = " --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000" + k2;
  for (const std::string bf16 : {"", " --megatron-fsdp-grad-comm-dtype bf16"})
    for (const std::string strategy : {"optim_grads", "optim_grads_params"})
      expect_identical_runs(train("--train-iters 4 --nproc-per-node 4" + fsdp + strategy + bf16 + k2),
                            train("--train-iters 4 --nproc-per-node 4" + distopt +
                                  (bf16.empty() ? "" : " --grad-reduce-in-bf16")),
                            strategy + bf16 + ", k 2 against the distributed optimizer");
  for (const std::string layout : {"--nproc-per-node 8 --tensor-model-parallel-size 2 --sequence-parallel",
                                   "--nproc-per-node 4 --pipeline-model-parallel-size 2",
                                   "--nproc-per-node 4 --context-parallel-size 2"})
    expect_near_one_rank(train("--train-iters 4 " + layout + fsdp + "optim_grads_params" + k2), ref, layout + ", k 2");
  const std::string moe = kTinyMoe;
  expect_near_one_rank(
      train("--train-iters 4 --nproc-per-node 4 --expert-model-parallel-size 2" + moe + fsdp + "optim_grads" + k2),
      train("--train-iters 4" + moe), "EP 2 x DP 4, k 2");
  // Checkpoints: k = 2 -> k = 1 and k = 1 -> k = 2 (DP 4) on the curve of an uninterrupted k = 2 run.
  expect_checkpoints_cross_load(fsdp + "optim_grads_params" + k2, fsdp + "optim_grads_params", "hybrid",
                                "--nproc-per-node 4");
  // Memory: the estimate's gradient and parameter terms == the bytes allocated with k = 2 (8
  // layers, DP 4: shards over 2 ranks), and the shards are those of DP 2.
  const std::string f = flags("--train-iters 1 --num-layers 8 --nproc-per-node 4" + fsdp + "optim_grads_params" + k2);
  run_thread_ranks(4, [&](int rank, std::shared_ptr<Communicator> world) {
    TrainingSetup setup(testing::parse_pretrain_args(f), std::move(world), Device::cpu());
    const GradSync& gs = setup.model_setup().grad_sync();
    const ParamStore& ps = gs.params();
    EXPECT_EQ(gs.dp()->size(), 2);
    EXPECT_EQ(gs.dp()->rank(), rank % 2);
    EXPECT_EQ(ps.layout().data_parallel_size, 2);
    EXPECT_EQ(gs.owned_elements() * 2, ps.total_elements());
    int64_t largest = 0;
    for (const ParamBucket& b : ps.buckets()) largest = std::max(largest, b.numel());
    EXPECT_EQ(gs.grad_bytes(), (gs.owned_elements() + ps.grad_slots() * largest) * 4);
    EXPECT_EQ(gs.param_bytes(), (gs.owned_elements() + ps.param_slots() * ps.largest_dense_bucket()) * 4);
    expect_estimate_matches_sync(setup.model_setup().memory_estimate(), gs);
  });
  for (const auto& [bad, msg] : std::vector<std::pair<std::string, std::string>>{
           {" --nproc-per-node 4 --use-distributed-optimizer --num-distributed-optimizer-instances 3",
            "--num-distributed-optimizer-instances 3: the data-parallel group 'dp-cp' of 4 ranks does not split into 3 "
            "instances of equal size (4 is not divisible by 3)"},
           {" --nproc-per-node 2" + k2, "--num-distributed-optimizer-instances 2 needs the distributed optimizer"},
           {" --nproc-per-node 2 --use-distributed-optimizer --ddp-copy-engine" + k2, "with --ddp-copy-engine is not built"},
           {" --nproc-per-node 2 --use-distributed-optimizer --optimizer muon" + k2, "with --optimizer muon is not built"},
           {" --nproc-per-node 2 --use-distributed-optimizer --fp8-format hybrid --fp8-param-gather" + k2,
            "with --fp8-param-gather is not built"}})
    expect_error_text([&] { train("--train-iters 1" + bad); }, msg, bad);
}

// --overlap-grad-reduce under optim_grads and optim_grads_params (docs/fsdp.md "Overlapped
// reduce-scatter"): the reduce-scatters into the shard run on the communication stream, slots
// retired at the brackets of the next uses and when they run short, with the default (minimum)
// slot count. On CPU ranks the runs are bitwise the non-overlapped ones (losses, gradient norms,
// validation) with several micro-batches per rank: DP 2, PP 2 x DP 2 (the tied embedding across
// stages), the interleaved schedule with Llama (untied output layer, whose gradient the loss
// chunk's forward writes) and full recompute, hybrid sharding (2 instances), the tiny MoE at EP 2 x
// DP 4 (expert slot), and multi-token prediction (its uses bracketed; its embedding's backward, an
// unbracketed writer of the word embedding's gradient).
TEST_F(TrainerLayouts, MegatronFsdpOverlappedReduceScatter) {
  const std::string fsdp = " --use-megatron-fsdp --ddp-bucket-size 3000 --data-parallel-sharding-strategy ";
  const std::string llama = " --swiglu --ffn-hidden-size 64 --normalization RMSNorm --position-embedding-type rope "
                            "--disable-bias-linear --untie-embeddings-and-output-weights";
  const std::string recompute = " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1";
  const std::string gbs16 = " --global-batch-size 16";
  for (const std::string strategy : {"optim_grads", "optim_grads_params"}) {
    for (const std::string layout :
         {std::string("--nproc-per-node 2"), std::string("--nproc-per-node 4 --pipeline-model-parallel-size 2"),
          "--nproc-per-node 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1" + llama +
              recompute,
          "--nproc-per-node 4 --num-distributed-optimizer-instances 2" + gbs16,
          "--nproc-per-node 4 --expert-model-parallel-size 2" + gbs16 + kTinyMoe,
          "--nproc-per-node 2 --mtp-num-layers 1" + llama}) {
      SCOPED_TRACE(strategy + ", " + layout);
      const std::string f = "--train-iters 4 " + layout + fsdp + strategy;
      expect_identical_runs(train(f + " --overlap-grad-reduce"), train(f), layout);
    }
  }
  // The slot count and the memory estimate are those of the non-overlapped run.
  const std::string f = flags("--train-iters 1 --num-layers 8 --nproc-per-node 4" + fsdp + "optim_grads --overlap-grad-reduce");
  run_thread_ranks(4, [&](int, std::shared_ptr<Communicator> world) {
    TrainingSetup setup(testing::parse_pretrain_args(f), std::move(world), Device::cpu());
    const GradSync& gs = setup.model_setup().grad_sync();
    EXPECT_TRUE(gs.grads_overlapped());
    EXPECT_EQ(gs.params().grad_slots(), gs.params().grad_slots_needed());
    size_t estimated = 0;
    for (const MemoryPart& p : setup.model_setup().memory_estimate().parts)
      if (p.name.rfind("gradients", 0) == 0) estimated = p.bytes;
    EXPECT_EQ(estimated, static_cast<size_t>(gs.grad_bytes()));
  });
}

}  // namespace
}  // namespace mt
