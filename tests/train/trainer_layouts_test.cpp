// `megatron pretrain` under several parallel layouts on CPU (ranks started by our local launcher,
// which runs mpiexec for CPU): the losses of every iteration (and the validation losses) equal
// the single-rank run, and a checkpoint written under TP 2 or PP 2 resumes under TP 1 / PP 1 (and
// vice versa) on the same loss curve.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include <nlohmann/json.hpp>

#include "testing/testing.h"

namespace fs = std::filesystem;

namespace {

using mt::testing::RunResult;
using mt::testing::run_megatron;

std::map<int, double> losses(const std::string& out) {
  std::map<int, double> v;
  std::regex re("iteration +([0-9]+)/ *[0-9]+ .*lm loss: ([0-9.E+-]+)");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    v[std::stoi((*it)[1].str())] = std::stod((*it)[2].str());
  return v;
}

std::map<int, double> val_losses(const std::string& out) {
  std::map<int, double> v;
  std::regex re("validation loss at iteration ([0-9]+) \\| lm loss value: ([0-9.E+-]+)");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    v[std::stoi((*it)[1].str())] = std::stod((*it)[2].str());
  return v;
}

std::string bias_state_name(int layer) {
  return "state/decoder.layers." + std::to_string(layer) + ".mlp.router.expert_bias";
}

// The whole fp32 tensor `name` (stored as one shard) of checkpoint iteration `iter` in `ck`.
std::vector<float> read_whole_tensor(const std::string& ck, int iter, const std::string& name) {
  char it[16];
  std::snprintf(it, sizeof(it), "iter_%07d", iter);
  const fs::path d = fs::path(ck) / it;
  std::ifstream meta(d / "metadata.json");
  const nlohmann::json m = nlohmann::json::parse(meta);
  for (const auto& t : m.at("tensors")) {
    if (t.at("name") != name) continue;
    int64_t n = 1;
    for (int64_t v : t.at("global_shape").get<std::vector<int64_t>>()) n *= v;
    const auto& sh = t.at("shards").at(0);
    std::ifstream f(d / sh.at("file").get<std::string>(), std::ios::binary);
    f.seekg(sh.at("offset_bytes").get<std::streamoff>());
    std::vector<float> out(static_cast<size_t>(n));
    f.read(reinterpret_cast<char*>(out.data()), n * 4);
    if (!f.good()) return {};
    return out;
  }
  return {};
}

std::string data_dir() {
  const char* d = std::getenv("MT_DATA_DIR");
  if (d) return d;
  const char* s = std::getenv("MT_SOURCE_DIR");
  return std::string(s ? s : ".") + "/data";
}

class TrainerLayouts : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = data_dir();
    if (!fs::exists(data_ + "/gpt2/encoder.json") || !fs::exists(data_ + "/moby-dick/data.txt"))
      GTEST_SKIP() << "demo data missing: run tools/fetch_demo_data.sh " << data_;
    dir_ = fs::temp_directory_path() / ("mt_layouts_" + std::to_string(getpid()));
    fs::create_directories(dir_);
    tok_ = "--vocab-file " + data_ + "/gpt2/encoder.json --merge-file " + data_ + "/gpt2/vocab.bpe";
    if (!fs::exists(dir_ / "moby_text_document.idx")) {
      RunResult r = run_megatron("preprocess-data --input " + data_ + "/moby-dick/data.txt --output-prefix " +
                                 (dir_ / "moby").string() + " --append-eod " + tok_);
      ASSERT_EQ(r.rc, 0) << r.out;
    }
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string flags(const std::string& extra) const {
    // Dropout on: the masks must not depend on the layout either. Vocabulary padded to a multiple
    // of 64 x TP: 50304 for TP 1 and 2 alike (DefaultVocabPadding... checks different paddings).
    return "pretrain --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
           "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 "
           "--lr-decay-style cosine --lr-warmup-iters 1 --lr-decay-iters 6 --log-interval 1 --eval-iters 1 "
           "--eval-interval 2 "
           "--adam-eps 1e-5 --device cpu --no-progress --make-vocab-size-divisible-by 64 "
           "--train-data-path " + (dir_ / "moby_text_document").string() + " --valid-data-path " +
           (dir_ / "moby_text_document").string() + " " + tok_ + " " + extra;
  }
  // Iterations 1-3 under `layout`, saving into checkpoint `ck` (the run's output in *first).
  void save_half(const std::string& ck, const std::string& layout, RunResult* first) {
    *first = run_megatron(flags("--train-iters 6 --exit-interval 3 --save " + ck + " " + layout));
    ASSERT_EQ(first->rc, 0) << first->out;
  }
  // Iterations 4-6 resumed from checkpoint `ck` with `more` (layout, --save), merged with the
  // first half's losses into *curve.
  void resume(const RunResult& first, const std::string& ck, const std::string& more,
              std::map<int, double>* curve) {
    RunResult r = run_megatron(flags("--train-iters 6 --load " + ck + " " + more));
    ASSERT_EQ(r.rc, 0) << r.out;
    ASSERT_NE(r.out.find("> loaded checkpoint from " + ck + " at iteration 3"), std::string::npos) << r.out;
    ASSERT_EQ(losses(r.out).count(1), 0u) << r.out;  // resumed, not restarted
    *curve = losses(first.out);
    for (auto [k, v] : losses(r.out)) (*curve)[k] = v;
  }
  void expect_same(const std::map<int, double>& a, const std::map<int, double>& b, const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (const auto& [it, l] : b) EXPECT_NEAR(a.at(it), l, 2e-5 * l) << what << " iteration " << it;
  }
  std::string data_, tok_;
  fs::path dir_;
};

TEST_F(TrainerLayouts, ParallelLayoutsMatchOneRank) {
  RunResult ref = run_megatron(flags("--train-iters 4"));
  ASSERT_EQ(ref.rc, 0) << ref.out;
  const auto ref_losses = losses(ref.out);
  const auto ref_val = val_losses(ref.out);
  ASSERT_EQ(ref_losses.size(), 4u) << ref.out;
  ASSERT_EQ(ref_val.size(), 3u) << ref.out;  // iterations 0, 2, 4
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
    RunResult r = run_megatron(flags("--train-iters 4 " + layout));
    ASSERT_EQ(r.rc, 0) << layout << "\n" << r.out;
    EXPECT_NE(r.out.find("parallel layout"), std::string::npos) << r.out;
    expect_same(losses(r.out), ref_losses, layout);
    expect_same(val_losses(r.out), ref_val, layout + " (validation)");
  }
}

// Context parallelism (--context-parallel-size) with document masks and reset position ids: every
// CP layout gives the one-rank losses (the trainer shards each sequence into the load-balanced
// chunks of parallel/context_parallel.h), without and with dropout; a checkpoint written under
// CP 2 resumes on one rank on the same curve; bad CP flags fail with a clear message.
TEST_F(TrainerLayouts, ContextParallelMatchesOneRank) {
  const std::string cp_flags = " --hidden-dropout 0 --attention-dropout 0 --reset-attention-mask --reset-position-ids ";
  RunResult ref = run_megatron(flags("--train-iters 4" + cp_flags));
  ASSERT_EQ(ref.rc, 0) << ref.out;
  const auto ref_losses = losses(ref.out);
  const auto ref_val = val_losses(ref.out);
  for (const std::string layout :
       {"--nproc-per-node 2 --context-parallel-size 2", "--nproc-per-node 2 --context-parallel-size 2 --cp-comm-type a2a",
        "--nproc-per-node 4 --context-parallel-size 2 --use-distributed-optimizer",
        "--nproc-per-node 4 --context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
        "--cp-comm-type allgather",
        "--nproc-per-node 4 --context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2"}) {
    RunResult r = run_megatron(flags("--train-iters 4" + cp_flags + layout));
    ASSERT_EQ(r.rc, 0) << layout << "\n" << r.out;
    EXPECT_NE(r.out.find("context parallel:"), std::string::npos) << r.out;
    expect_same(losses(r.out), ref_losses, layout);
    expect_same(val_losses(r.out), ref_val, layout + " (validation)");
  }
  RunResult first, one_rank;
  const std::string ck = (dir_ / "ck_cp2").string();
  ASSERT_NO_FATAL_FAILURE(save_half(ck, cp_flags + "--nproc-per-node 2 --context-parallel-size 2", &first));
  std::map<int, double> l;
  ASSERT_NO_FATAL_FAILURE(resume(first, ck, cp_flags, &l));
  RunResult full = run_megatron(flags("--train-iters 6" + cp_flags));
  ASSERT_EQ(full.rc, 0) << full.out;
  expect_same(l, losses(full.out), "CP 2 checkpoint resumed on one rank");
  for (const auto& [bad, msg] : std::vector<std::pair<std::string, std::string>>{
           {"--nproc-per-node 2 --context-parallel-size 2 --seq-length 30 --max-position-embeddings 32",
            "--seq-length 30 must be divisible by 2 x --context-parallel-size = 4"},
           {"--nproc-per-node 4 --context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 "
            "4", "2 x 4 = 8 must equal --context-parallel-size 4"},
           {"--nproc-per-node 2 --context-parallel-size 2 --cp-comm-type a2a --num-attention-heads 3 --hidden-size 48",
            "must be divisible by 2"}}) {
    RunResult r = run_megatron(flags("--train-iters 1 --attention-dropout 0 " + bad));
    EXPECT_NE(r.rc, 0) << bad;
    EXPECT_NE(r.out.find(msg), std::string::npos) << bad << "\n" << r.out;
  }
  // With attention and hidden dropout: CP draws the masks of one rank (keyed by global positions,
  // heads and rows of the unsplit sequence), so the losses are still the one-rank losses.
  const std::string drop_flags = " --hidden-dropout 0.1 --attention-dropout 0.1 --reset-attention-mask "
                                 "--reset-position-ids ";
  RunResult dref = run_megatron(flags("--train-iters 4" + drop_flags));
  ASSERT_EQ(dref.rc, 0) << dref.out;
  const auto dref_losses = losses(dref.out);
  EXPECT_NE(dref_losses.at(3), ref_losses.at(3));  // dropout is on
  for (const std::string layout :
       {"--nproc-per-node 2 --context-parallel-size 2", "--nproc-per-node 2 --context-parallel-size 2 --cp-comm-type a2a",
        "--nproc-per-node 4 --context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
        "--cp-comm-type allgather"}) {
    RunResult r = run_megatron(flags("--train-iters 4" + drop_flags + layout));
    ASSERT_EQ(r.rc, 0) << layout << "\n" << r.out;
    expect_same(losses(r.out), dref_losses, layout + " (dropout)");
  }
}

// --grad-reduce-in-bf16 under mpiexec (MPI sums bf16 in fp32 and rounds once): the losses stay
// within 1e-4 of the one-rank run (bf16 rounding of the gradients, which Adam mostly normalises
// away); --ddp-copy-engine on CPU falls back with its reason.
TEST_F(TrainerLayouts, GradReduceInBf16StaysClose) {
  RunResult ref = run_megatron(flags("--train-iters 4"));
  ASSERT_EQ(ref.rc, 0) << ref.out;
  const auto ref_losses = losses(ref.out);
  RunResult r = run_megatron(flags("--train-iters 4 --nproc-per-node 2 --use-distributed-optimizer "
                                   "--grad-reduce-in-bf16 --ddp-copy-engine"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("gradient reduction in bf16"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("copy engine unavailable"), std::string::npos) << r.out;
  const auto l = losses(r.out);
  ASSERT_EQ(l.size(), ref_losses.size()) << r.out;
  double worst = 0;
  for (const auto& [it, v] : ref_losses) {
    EXPECT_NEAR(l.at(it), v, 1e-4 * v) << "iteration " << it;  // measured 1.9e-6
    worst = std::max(worst, std::abs(l.at(it) - v) / v);
  }
  std::printf("[grad-reduce-in-bf16] largest relative loss difference to one rank: %.2e\n", worst);
}

TEST_F(TrainerLayouts, CheckpointReshardsAcrossTensorParallelSizes) {
  RunResult full = run_megatron(flags("--train-iters 6"));
  ASSERT_EQ(full.rc, 0) << full.out;
  const auto full_losses = losses(full.out);
  RunResult first;
  std::map<int, double> l;
  // Save under TP 2, resume under TP 1.
  const std::string ck = (dir_ / "ck_tp2").string();
  ASSERT_NO_FATAL_FAILURE(save_half(ck, "--nproc-per-node 2 --tensor-model-parallel-size 2", &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ck, "--save " + ck, &l));
  expect_same(l, full_losses, "tp2 -> tp1");
  // And back: save under TP 1, resume under TP 2 with sequence parallelism.
  const std::string ck1 = (dir_ / "ck_tp1").string();
  RunResult one_rank;
  ASSERT_NO_FATAL_FAILURE(save_half(ck1, "", &one_rank));
  ASSERT_NO_FATAL_FAILURE(resume(one_rank, ck1,
                                 "--save " + (dir_ / "ck_tp2sp").string() +
                                     " --nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel",
                                 &l));
  expect_same(l, full_losses, "tp1 -> tp2 sp");
  // Distributed optimizer: moments sharded over DP 2 are gathered into the checkpoint and resume on
  // one rank.
  const std::string ckz = (dir_ / "ck_zero").string();
  ASSERT_NO_FATAL_FAILURE(save_half(ckz, "--nproc-per-node 2 --use-distributed-optimizer", &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ckz, "--save " + ckz, &l));
  expect_same(l, full_losses, "dp2 distributed optimizer -> 1 rank");
  // Pipeline parallelism: save under PP 2 (the last stage's embedding copy is not written), resume
  // on one rank; save on one rank, resume under PP 2 with two virtual stages per rank.
  const std::string ckp = (dir_ / "ck_pp2").string();
  ASSERT_NO_FATAL_FAILURE(save_half(ckp, "--nproc-per-node 2 --pipeline-model-parallel-size 2", &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ckp, "--save " + ckp, &l));
  expect_same(l, full_losses, "pp2 -> 1 rank");
  ASSERT_NO_FATAL_FAILURE(resume(one_rank, ck1,
                                 "--save " + (dir_ / "ck_vpp").string() +
                                     " --nproc-per-node 2 --pipeline-model-parallel-size 2 "
                                     "--num-layers-per-virtual-pipeline-stage 1",
                                 &l));
  expect_same(l, full_losses, "1 rank -> pp2 vpp2");
}

// Megatron's default --make-vocab-size-divisible-by 128 pads the vocabulary per TP size (50304 at
// TP 1, 50432 at TP 2, 50688 at TP 4). The padded entries take no probability mass (issue 21), so
// every TP size trains the same model, and a checkpoint moves between the paddings.
TEST_F(TrainerLayouts, DefaultVocabPaddingEveryTensorParallelSize) {
  const std::string pad = " --make-vocab-size-divisible-by 128";
  RunResult full = run_megatron(flags("--train-iters 6" + pad));
  ASSERT_EQ(full.rc, 0) << full.out;
  EXPECT_NE(full.out.find("padded 50304"), std::string::npos) << full.out;
  const auto full_losses = losses(full.out);
  for (const std::string layout : {"--nproc-per-node 2 --tensor-model-parallel-size 2",
                                   "--nproc-per-node 4 --tensor-model-parallel-size 4 --sequence-parallel"}) {
    RunResult r = run_megatron(flags("--train-iters 6 " + layout + pad));
    ASSERT_EQ(r.rc, 0) << layout << "\n" << r.out;
    EXPECT_NE(r.out.find(layout.find("size 2") != std::string::npos ? "padded 50432" : "padded 50688"),
              std::string::npos)
        << r.out;
    expect_same(losses(r.out), full_losses, layout);
  }
  // TP 1 (50304 rows) -> TP 2 (50432) and TP 4 (50688); TP 4 -> TP 1.
  RunResult first;
  std::map<int, double> l;
  const std::string ck1 = (dir_ / "ck_pad_tp1").string();
  ASSERT_NO_FATAL_FAILURE(save_half(ck1, pad, &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ck1, "--nproc-per-node 2 --tensor-model-parallel-size 2" + pad, &l));
  expect_same(l, full_losses, "tp1 -> tp2, default padding");
  ASSERT_NO_FATAL_FAILURE(resume(first, ck1, "--nproc-per-node 4 --tensor-model-parallel-size 4" + pad, &l));
  expect_same(l, full_losses, "tp1 -> tp4, default padding");
  const std::string ck4 = (dir_ / "ck_pad_tp4").string();
  ASSERT_NO_FATAL_FAILURE(save_half(ck4, "--nproc-per-node 4 --tensor-model-parallel-size 4" + pad, &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ck4, pad, &l));
  expect_same(l, full_losses, "tp4 -> tp1, default padding");
}

// The tiny MoE model of the MoE tests: Llama-style layers, MoE in layers 1 and 3 (8 experts, top-2).
constexpr const char* kTinyMoe =
    " --swiglu --ffn-hidden-size 64 --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-layer-freq [0,1]*2";

// A Mixtral-style MoE (8 experts, top-2, MoE in every other layer, load-balancing and z-loss)
// through the binary: its log line, layouts equal to one rank, and a checkpoint resharded from
// TP 2 to one rank; configuration errors before any communication.
TEST_F(TrainerLayouts, MixtureOfExperts) {
  const std::string moe = std::string(kTinyMoe) + " --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3";
  RunResult full = run_megatron(flags("--train-iters 6" + moe));
  ASSERT_EQ(full.rc, 0) << full.out;
  EXPECT_NE(full.out.find("MoE in 2 of 4 layers: 8 experts, top-2 softmax router"), std::string::npos) << full.out;
  EXPECT_NE(full.out.find("load_balancing_loss: "), std::string::npos) << full.out;
  EXPECT_NE(full.out.find("z_loss: "), std::string::npos) << full.out;
  // 8 sequences x 32 tokens x top-2 over 8 experts: 64 routed tokens per expert and iteration on average
  const std::string mean_load = "/64.0 | expert imbalance: ";
  EXPECT_NE(full.out.find("tokens per expert min/max/mean: "), std::string::npos) << full.out;
  EXPECT_NE(full.out.find(mean_load), std::string::npos) << full.out;
  const auto full_losses = losses(full.out);
  ASSERT_EQ(full_losses.size(), 6u) << full.out;
  EXPECT_EQ(full.out.find("grad norm: inf"), std::string::npos) << full.out;
  EXPECT_EQ(full.out.find("grad norm: nan"), std::string::npos) << full.out;
  EXPECT_EQ(full.out.find("number of skipped iterations:   1"), std::string::npos) << full.out;
  for (const std::string layout : {"--nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel",
                                   "--nproc-per-node 2 --use-distributed-optimizer",
                                   "--nproc-per-node 2 --pipeline-model-parallel-size 2",
                                   "--nproc-per-node 2 --expert-model-parallel-size 2",
                                   "--nproc-per-node 4 --tensor-model-parallel-size 2 --sequence-parallel "
                                   "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1 "
                                   "--use-distributed-optimizer",
                                   // all_to_allv over EP 2, unequal all-gather / reduce-scatter over
                                   // expert TP 2, four local experts regrouped (MPI backend)
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
    RunResult r = run_megatron(flags("--train-iters 6 " + layout + moe));
    ASSERT_EQ(r.rc, 0) << layout << "\n" << r.out;
    expect_same(losses(r.out), full_losses, layout + " (MoE)");
    EXPECT_NE(r.out.find(mean_load), std::string::npos) << layout << "\n" << r.out;
    if (layout.find("alltoall") != std::string::npos) {
      EXPECT_NE(r.out.find("alltoall token dispatcher"), std::string::npos) << r.out;
      const bool fixed = layout.find("capacity") != std::string::npos;
      EXPECT_NE(r.out.find(fixed ? "tokens overflowed at the received capacity: 0.0 |" : "max tokens received per EP rank: "),
                std::string::npos)
          << r.out;
    }
    if (layout.find("echo") != std::string::npos) {
      EXPECT_NE(r.out.find("ECHO with 1 spare expert slots per EP rank"), std::string::npos) << r.out;
      // counted from the host-read counts: the dropless dispatcher only
      EXPECT_EQ(r.out.find("ECHO rerouted tokens per layer: ") != std::string::npos,
                layout.find("capacity") == std::string::npos)
          << r.out;
    }
  }
  RunResult first;
  std::map<int, double> l;
  const std::string ck = (dir_ / "ck_moe").string();
  ASSERT_NO_FATAL_FAILURE(
      save_half(ck, "--nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel" + moe, &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ck, moe, &l));
  expect_same(l, full_losses, "MoE tp2 sp -> 1 rank");
  RunResult pl = run_megatron(flags("--train-iters 2 --moe-per-layer-logging" + moe));
  ASSERT_EQ(pl.rc, 0) << pl.out;
  EXPECT_NE(pl.out.find("load_balancing_loss layer 1: "), std::string::npos) << pl.out;
  EXPECT_NE(pl.out.find("z_loss layer 3: "), std::string::npos) << pl.out;
  EXPECT_EQ(pl.out.find("load_balancing_loss layer 0: "), std::string::npos) << pl.out;  // dense layer
  EXPECT_NE(pl.out.find("expert imbalance layer 3: "), std::string::npos) << pl.out;
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
            "--moe-enable-echo needs --expert-model-parallel-size > 1"}}) {
    RunResult r = run_megatron(flags("--train-iters 2" + moe + extra));
    EXPECT_NE(r.rc, 0) << extra;
    EXPECT_NE(r.out.find(message), std::string::npos) << extra << "\n" << r.out;
  }
}

// --moe-router-load-balancing-type global_aux_loss through the binary: accepted, logged as Megatron's
// global_load_balancing_loss, the same losses under TP 2 + SP and PP 2 (the same micro-batches as
// one rank; under DP each step's loss reads the counts of all DP ranks' micro-batches, as
// Megatron's); sinkhorn is still an error.
TEST_F(TrainerLayouts, MixtureOfExpertsGlobalAuxLoss) {
  const std::string moe = std::string(kTinyMoe) +
                          " --moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 1e-2 "
                          "--moe-z-loss-coeff 1e-3";
  RunResult full = run_megatron(flags("--train-iters 4" + moe));
  ASSERT_EQ(full.rc, 0) << full.out;
  EXPECT_NE(full.out.find("global_aux_loss 0.01"), std::string::npos) << full.out;
  EXPECT_NE(full.out.find(" global_load_balancing_loss: "), std::string::npos) << full.out;
  EXPECT_EQ(full.out.find(" load_balancing_loss: "), std::string::npos) << full.out;
  const auto full_losses = losses(full.out);
  ASSERT_EQ(full_losses.size(), 4u) << full.out;
  for (const std::string layout : {"--nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel",
                                   "--nproc-per-node 2 --pipeline-model-parallel-size 2"}) {
    RunResult r = run_megatron(flags("--train-iters 4 " + layout + moe));
    ASSERT_EQ(r.rc, 0) << layout << "\n" << r.out;
    expect_same(losses(r.out), full_losses, layout + " (MoE global_aux_loss)");
  }
  RunResult dp = run_megatron(flags("--train-iters 2 --nproc-per-node 2" + moe));
  ASSERT_EQ(dp.rc, 0) << dp.out;
  EXPECT_NE(dp.out.find(" global_load_balancing_loss: "), std::string::npos) << dp.out;
  RunResult sk = run_megatron(flags("--train-iters 2" + std::string(kTinyMoe) + " --moe-router-load-balancing-type sinkhorn"));
  EXPECT_NE(sk.rc, 0);
  EXPECT_NE(sk.out.find("--moe-router-load-balancing-type sinkhorn is not implemented yet"), std::string::npos)
      << sk.out;
}

// --moe-router-dtype fp64, Megatron's list of load-balancing types and a gated shared expert
// (--moe-shared-expert-gate) through the binary: accepted, the summary names every type with its
// coefficient and the gated shared expert, the log shows each type's loss under Megatron's name,
// TP 2 + SP and EP 2 give the one-rank losses, a checkpoint (with the gate's weight) resumes on the
// same curve; mismatched lists and bad values are errors naming them.
TEST_F(TrainerLayouts, MixtureOfExpertsRouterDtypeAndLoadBalancingLists) {
  const std::string moe = std::string(kTinyMoe) +
                          " --moe-router-dtype fp64 --moe-router-load-balancing-type aux_loss seq_aux_loss "
                          "--moe-aux-loss-coeff 1e-2 1e-3 --moe-z-loss-coeff 1e-3 "
                          "--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate";
  RunResult full = run_megatron(flags("--train-iters 6" + moe));
  ASSERT_EQ(full.rc, 0) << full.out;
  EXPECT_NE(full.out.find("aux_loss 0.01, seq_aux_loss 0.001"), std::string::npos) << full.out;
  EXPECT_NE(full.out.find("gated shared expert 32"), std::string::npos) << full.out;
  EXPECT_NE(full.out.find(" load_balancing_loss: "), std::string::npos) << full.out;
  EXPECT_NE(full.out.find(" seq_load_balancing_loss: "), std::string::npos) << full.out;
  const auto full_losses = losses(full.out);
  ASSERT_EQ(full_losses.size(), 6u) << full.out;
  for (const std::string layout : {"--nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel",
                                   "--nproc-per-node 2 --expert-model-parallel-size 2"}) {
    RunResult r = run_megatron(flags("--train-iters 6 " + layout + moe));
    ASSERT_EQ(r.rc, 0) << layout << "\n" << r.out;
    expect_same(losses(r.out), full_losses, layout + " (fp64 router, two load-balancing types)");
  }
  RunResult first;
  std::map<int, double> l;
  const std::string ck = (dir_ / "ck_moe_lists").string();
  ASSERT_NO_FATAL_FAILURE(save_half(ck, moe, &first));
  ASSERT_NO_FATAL_FAILURE(resume(first, ck, moe, &l));
  expect_same(l, full_losses, "fp64 router, two load-balancing types: resumed");
  const std::string base = std::string(kTinyMoe);
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
            "--moe-router-force-load-balancing with --moe-router-dtype fp64 is not supported"}}) {
    RunResult r = run_megatron(flags("--train-iters 2" + base + extra));
    EXPECT_NE(r.rc, 0) << extra;
    EXPECT_NE(r.out.find(message), std::string::npos) << extra << "\n" << r.out;
  }
}

// Checkpoints of the MoE model move between expert layouts (docs/moe.md "Checkpoints"): each
// rank writes only the experts it owns (expert-data-parallel rank 0 of its expert TP / EP
// coordinates), and a run resumed under another EP / ETP / TP / PP / DP size, with or without the
// distributed optimizer (which shards the expert state over the expert-data-parallel group), saved
// synchronously or with --async-save, continues on the uninterrupted one-rank loss curve. A checkpoint of another MoE shape is a clear
// error.
TEST_F(TrainerLayouts, MixtureOfExpertsCheckpointsReshard) {
  const std::string moe = std::string(kTinyMoe) + " --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3";
  RunResult full = run_megatron(flags("--train-iters 6" + moe));
  ASSERT_EQ(full.rc, 0) << full.out;
  const auto full_losses = losses(full.out);
  ASSERT_EQ(full_losses.size(), 6u) << full.out;
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
    RunResult first;
    std::map<int, double> l;
    const std::string ck = (dir_ / ("ck_moe_" + c.name)).string();
    ASSERT_NO_FATAL_FAILURE(save_half(ck, c.save + moe, &first));
    ASSERT_NO_FATAL_FAILURE(resume(first, ck, c.resume + moe, &l));
    expect_same(l, full_losses, "MoE checkpoint " + c.name + ": [" + c.save + "] -> [" + c.resume + "]");
  }
  // Under EP 2 the two ranks each wrote their own 4 experts (and DP rank 0 the dense tensors).
  const std::string ck = (dir_ / "ck_moe_ep2").string();
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
           {" --moe-layer-freq 1", "checkpoint has --moe-layer-freq [0,1,0,1] but the command line asks for [1,1,1,1]"}}) {
    RunResult r = run_megatron(flags("--train-iters 6 --load " + ck + moe + extra));
    EXPECT_NE(r.rc, 0) << extra;
    EXPECT_NE(r.out.find(message), std::string::npos) << extra << "\n" << r.out;
  }
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
  const std::string full_ck = (dir_ / "ck_bias_full").string();
  RunResult full = run_megatron(flags("--train-iters 6 --save " + full_ck + moe));
  ASSERT_EQ(full.rc, 0) << full.out;
  const auto full_losses = losses(full.out);
  ASSERT_EQ(full_losses.size(), 6u) << full.out;
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
    RunResult first;
    std::map<int, double> l;
    const std::string ck = (dir_ / ("ck_bias_" + c.name)).string();
    ASSERT_NO_FATAL_FAILURE(save_half(ck, c.save + moe, &first));
    ASSERT_NO_FATAL_FAILURE(resume(first, ck, c.resume + moe + " --save " + ck, &l));
    EXPECT_EQ(l.size(), 6u);
    for (int i = 0; i < 2; ++i) {
      const std::vector<float> b = read_whole_tensor(ck, 6, bias_state_name(2 * i + 1));
      ASSERT_EQ(b.size(), 8u);
      for (size_t e = 0; e < 8; ++e) EXPECT_NEAR(b[e], full_bias[i][e], 1e-6) << "layer " << 2 * i + 1 << " expert " << e;
    }
    expect_same(l, full_losses, "expert bias checkpoint " + c.name + ": [" + c.save + "] -> [" + c.resume + "]");
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
  std::ifstream meta(dir_ / "ck_bias_pp2_async_to_1/iter_0000003/metadata.json");
  const nlohmann::json m = nlohmann::json::parse(meta);
  for (const auto& t : m.at("tensors")) {
    if (t.at("name") == bias_state_name(1)) EXPECT_EQ(t.at("shards")[0].at("file"), "rank_00000.bin");
    if (t.at("name") == bias_state_name(3)) EXPECT_EQ(t.at("shards")[0].at("file"), "rank_00001.bin");
  }
}

TEST_F(TrainerLayouts, BadLayoutErrors) {
  RunResult r = run_megatron(flags("--train-iters 2 --nproc-per-node 2 --tensor-model-parallel-size 3"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("world size 2 is not divisible by tp (3)"), std::string::npos) << r.out;
  r = run_megatron(flags("--train-iters 2 --nproc-per-node 2 --tensor-model-parallel-size 2 --num-attention-heads 3 "
                         "--hidden-size 33"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("not divisible by tensor parallel size 2"), std::string::npos) << r.out;
  r = run_megatron(flags("--train-iters 2 --nproc-per-node 2 --global-batch-size 6 --micro-batch-size 4"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("data-parallel size 2"), std::string::npos) << r.out;
  r = run_megatron(flags("--train-iters 2 --nproc-per-node 2 --pipeline-model-parallel-size 2 --num-layers 3"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("num_layers (3) = 3 is not divisible by pp (2)"), std::string::npos) << r.out;
  r = run_megatron(flags("--train-iters 2 --nproc-per-node 2 --pipeline-model-parallel-size 2 "
                         "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 6"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("number of micro-batches (3)"), std::string::npos) << r.out;
}

}  // namespace
