// CUDA graphs (docs/cuda_graphs.md): `megatron pretrain` with --cuda-graph-impl full_iteration
// (with and without the optimizer in the graph) and per-layer graphs follow the eager run: with
// dropout on, a learning rate that changes every step (warmup from 0, then cosine decay) and new
// data every step, so a value baked into the graph at capture would show.
// Under --deterministic-mode (the *Bitwise tests: GPT-2 style with flash attention, the
// distributed optimizer, per-layer attn/mlp graphs, MoE with the grouped GEMM; and the Llama-style,
// MoE, static-alltoall, moe_router / moe_preprocess, multi-latent attention with multi-token
// prediction, and --async-save runs) the CUDA step has no float atomics, so per iteration the loss,
// the gradient norm (full precision, --metrics-file), the validation losses (and the logged MTP
// losses) of two eager runs and of the graph run must be equal, bit for bit.
// Without it (FullIterationFollowsEagerWithoutDeterministicMode) the embedding and flash-attention
// dq gradients use float atomics, so the reference is two eager runs: the graph run must be as close
// to the first eager run as the second one is (times 10, floor 2e-4 relative: two eager runs may
// happen to agree while the graph run's atomics sum in another order; a baked-in learning rate,
// mask or batch moves the loss by far more). The capture itself checks that the step neither
// allocates nor synchronises (the trainer counts both; ThreadLocal capture fails on a sync).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "testing/testing.h"

namespace fs = std::filesystem;

namespace {

using mt::testing::RunResult;
using mt::testing::run_megatron;

// Per logged point of a --metrics-file: ("train"/"validation", iteration) -> {lm_loss, grad_norm}.
std::map<std::pair<std::string, int>, std::pair<double, double>> metrics(const fs::path& file) {
  std::map<std::pair<std::string, int>, std::pair<double, double>> m;
  std::ifstream f(file);
  std::string line;
  while (std::getline(f, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    const std::string type = j.at("type");
    if (type != "train" && type != "validation") continue;
    m[{type, j.at("iteration").get<int>()}] = {j.at("lm_loss").get<double>(),
                                               type == "train" ? j.at("grad_norm").get<double>() : 0.0};
  }
  return m;
}

// The multi-token prediction losses of a run's log lines (" mtp_1 loss: 1.234567E+01 |", one per
// logged iteration; they are not in --metrics-file), in order.
std::vector<std::string> mtp_losses(const std::string& out) {
  const std::string key = "mtp_1 loss: ";
  std::vector<std::string> v;
  for (size_t at = out.find(key); at != std::string::npos; at = out.find(key, at + 1))
    v.push_back(out.substr(at, out.find('|', at) - at));
  return v;
}

class CudaGraphTraining : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* s = std::getenv("MT_SOURCE_DIR");
    data_ = std::string(s ? s : ".") + "/data";
    if (!fs::exists(data_ + "/gpt2/encoder.json") || !fs::exists(data_ + "/moby-dick/data.txt"))
      GTEST_SKIP() << "demo data missing: run tools/fetch_demo_data.sh " << data_;
    dir_ = fs::temp_directory_path() / ("mt_cuda_graph_" + std::to_string(getpid()));
    fs::create_directories(dir_);
    tok_ = "--vocab-file " + data_ + "/gpt2/encoder.json --merge-file " + data_ + "/gpt2/vocab.bpe";
    RunResult r = run_megatron("preprocess-data --input " + data_ + "/moby-dick/data.txt --output-prefix " +
                               (dir_ / "moby").string() + " --append-eod " + tok_);
    ASSERT_EQ(r.rc, 0) << r.out;
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  std::string flags(const std::string& extra) const {
    return "pretrain --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
           "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size " + std::to_string(global_batch_) +
           " --train-iters 8 "
           "--lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2 --log-interval 1 "
           "--eval-iters 2 --eval-interval 4 --hidden-dropout 0.1 --attention-dropout 0.1 --bf16 "
           "--device cuda --no-progress --train-data-path " + (dir_ / "moby_text_document").string() +
           " --valid-data-path " + (dir_ / "moby_text_document").string() + " " + tok_ + " " + extra;
  }
  // Two eager runs and the graph run with `graph_flags`: the graph run is within the eager runs'
  // own run-to-run spread of the first one; with `bitwise`, every run has --deterministic-mode and
  // all three must agree exactly. With --mtp-num-layers 1, also the logged MTP losses (exactly, as
  // printed, with `bitwise`).
  // With `checkpoints` (and `bitwise`), every run saves a checkpoint after its last iteration and
  // the parameters and optimizer state it holds (rank_00000.bin) must be equal byte for byte.
  void expect_same(const std::string& model_flags, const std::string& graph_flags, bool bitwise = false,
                   bool checkpoints = false) {
    const std::string model = bitwise ? model_flags + " --deterministic-mode" : model_flags;
    std::map<std::string, std::vector<std::string>> mtp;  // per run tag
    auto saved = [&](const std::string& tag) { return dir_ / ("ck_" + tag) / "iter_0000008" / "rank_00000.bin"; };
    auto run_metrics = [&](const std::string& tag, const std::string& extra) {
      const fs::path mf = dir_ / (tag + ".jsonl");
      fs::remove(mf);
      fs::remove_all(dir_ / ("ck_" + tag));
      const std::string save =
          checkpoints ? " --save " + (dir_ / ("ck_" + tag)).string() + " --save-interval 8" : std::string();
      const RunResult r = run_megatron(flags(model + " --metrics-file " + mf.string() + save + " " + extra));
      EXPECT_EQ(r.rc, 0) << r.out;
      mtp[tag] = mtp_losses(r.out);
      if (!extra.empty() && extra.find("full_iteration") != std::string::npos) {
        EXPECT_NE(r.out.find("CUDA graph: training step"), std::string::npos) << r.out;
        EXPECT_NE(r.out.find("CUDA graph: the validation forward captured"), std::string::npos) << r.out;
      } else if (!extra.empty()) {  // per-layer graphs
        EXPECT_NE(r.out.find("CUDA graph (per layer"), std::string::npos) << r.out;
      }
      return metrics(mf);
    };
    const auto a = run_metrics("eager_a", ""), b = run_metrics("eager_b", ""), g = run_metrics("graph", graph_flags);
    ASSERT_EQ(a.size(), 8u + 3u);  // 8 iterations, validation at 0, 4, 8
    ASSERT_EQ(b.size(), a.size());
    ASSERT_EQ(g.size(), a.size());
    if (model_flags.find("--mtp-num-layers 1") != std::string::npos) {
      EXPECT_EQ(mtp["eager_a"].size(), 8u);  // one per iteration (--log-interval 1)
      EXPECT_EQ(mtp["eager_b"].size(), mtp["eager_a"].size());
      EXPECT_EQ(mtp["graph"].size(), mtp["eager_a"].size());
      if (bitwise) {
        EXPECT_EQ(mtp["eager_b"], mtp["eager_a"]) << "eager runs: MTP losses";
        EXPECT_EQ(mtp["graph"], mtp["eager_a"]) << "graph vs eager: MTP losses";
      }
    }
    if (checkpoints) {
      auto bytes = [](const fs::path& f) {
        std::ifstream in(f, std::ios::binary);
        EXPECT_TRUE(in.good()) << f;
        return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      };
      const std::string ca = bytes(saved("eager_a")), cb = bytes(saved("eager_b")), cg = bytes(saved("graph"));
      EXPECT_FALSE(ca.empty());
      EXPECT_TRUE(cb == ca) << "eager runs: the saved parameters and optimizer state differ";
      EXPECT_TRUE(cg == ca) << "graph vs eager: the saved parameters and optimizer state differ";
    }
    if (bitwise) {
      for (const auto& [k, v] : a) {
        SCOPED_TRACE(k.first + " " + std::to_string(k.second));
        ASSERT_TRUE(b.count(k) && g.count(k));
        EXPECT_EQ(b.at(k).first, v.first) << fmt::format("eager runs: loss {:.17g} vs {:.17g}", v.first, b.at(k).first);
        EXPECT_EQ(b.at(k).second, v.second)
            << fmt::format("eager runs: grad norm {:.17g} vs {:.17g}", v.second, b.at(k).second);
        EXPECT_EQ(g.at(k).first, v.first) << fmt::format("graph vs eager: loss {:.17g} vs {:.17g}", v.first,
                                                         g.at(k).first);
        EXPECT_EQ(g.at(k).second, v.second)
            << fmt::format("graph vs eager: grad norm {:.17g} vs {:.17g}", v.second, g.at(k).second);
      }
      return;
    }
    double noise = 0;  // the eager runs' relative spread
    for (const auto& [k, v] : a) {
      noise = std::max(noise, std::abs(b.at(k).first - v.first) / std::abs(v.first));
      if (k.first == "train") noise = std::max(noise, std::abs(b.at(k).second - v.second) / std::abs(v.second));
    }
    const double tol = std::max(10 * noise, 2e-4);
    for (const auto& [k, v] : a) {
      SCOPED_TRACE(k.first + " " + std::to_string(k.second));
      EXPECT_LE(std::abs(g.at(k).first - v.first), tol * std::abs(v.first)) << "loss " << v.first << " vs "
                                                                              << g.at(k).first;
      if (k.first == "train")
        EXPECT_LE(std::abs(g.at(k).second - v.second), tol * std::abs(v.second))
            << "grad norm " << v.second << " vs " << g.at(k).second;
    }
    std::printf("eager run-to-run spread %.3g (relative); tolerance %.3g\n", noise, tol);
  }

  std::string data_, tok_;
  fs::path dir_;
  int global_batch_ = 6;
};

// Head dim 64 (hidden 128, 2 heads): the FlashAttention-2 kernels (tensor cores, bf16) with attention
// dropout, whose dQ is the deterministic kernel's under --deterministic-mode.
const char* const kFlashModel = "--hidden-size 128 --num-attention-heads 2 --attention-backend flash";

TEST_F(CudaGraphTraining, FullIterationEqualsEagerBitwise) {
  // GPT-2 style (LayerNorm, learned positions, biases, GELU, tied embedding) with dropout.
  expect_same(kFlashModel, "--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 2", true);
}

TEST_F(CudaGraphTraining, FullIterationFollowsEagerWithoutDeterministicMode) {
  expect_same("", "--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 2");
}

TEST_F(CudaGraphTraining, FullIterationWithOptimizerEqualsEagerBitwise) {
  // The scope spelling of Megatron (local + full_iteration), the optimizer inside the graph, the
  // distributed optimizer with overlapped gradient reduction.
  expect_same(std::string(kFlashModel) + " --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 20000",
              "--cuda-graph-impl local --cuda-graph-scope full_iteration --cuda-graph-warmup-steps 1 "
              "--cuda-graph-include-optimizer",
              true);
}

// Megatron-FSDP's optim_grads (ZeRO-2) and optim_grads_params (ZeRO-3) (docs/fsdp.md "CUDA graphs
// of the whole step") at DP 1: the single-rank world still runs the staging machinery — every
// gradient bucket bound to a slot in the backward, added into the gradient shard and released;
// under ZeRO-3 every parameter bucket gathered (copied from the owned slice) into a slot on
// GradSync's communication stream with the next unit prefetched; with --overlap-grad-reduce the
// add into the shard on that stream too — so the graph holds the forked stream, its events and the
// slot bindings of the captured step. Several buckets (a layer spans about three). Per strategy: no
// overlap with the optimizer outside the graph (replays followed by mark_replayed_grad_sync and the
// eager optimizer step), and overlapped with the optimizer inside (mark_replayed_param_sync).
// Losses, gradient norms, validation losses and the saved parameters and optimizer state after 8
// iterations bitwise equal to eager.
const char* const kFsdpModel = "--hidden-size 128 --num-attention-heads 2 --attention-backend flash --use-megatron-fsdp "
                               "--ddp-bucket-size 100000 --data-parallel-sharding-strategy ";

TEST_F(CudaGraphTraining, MegatronFsdpOptimGradsFullIterationEqualsEagerBitwise) {
  const std::string model = std::string(kFsdpModel) + "optim_grads";
  expect_same(model, "--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 2", true, true);
  expect_same(model + " --overlap-grad-reduce",
              "--cuda-graph-impl local --cuda-graph-scope full_iteration --cuda-graph-warmup-steps 1 "
              "--cuda-graph-include-optimizer",
              true, true);
}

TEST_F(CudaGraphTraining, MegatronFsdpOptimGradsParamsFullIterationEqualsEagerBitwise) {
  const std::string model = std::string(kFsdpModel) + "optim_grads_params";
  expect_same(model, "--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 2", true, true);
  expect_same(model + " --overlap-grad-reduce",
              "--cuda-graph-impl local --cuda-graph-scope full_iteration --cuda-graph-warmup-steps 1 "
              "--cuda-graph-include-optimizer",
              true, true);
}

TEST_F(CudaGraphTraining, LlamaStyleFullIterationFollowsEager) {
  expect_same("--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
              "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2",
              "--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 3 --cuda-graph-include-optimizer", true);
}

// DeepSeek-V3-style attention and multi-token prediction (docs/mla.md): multi-latent attention
// with a query latent, decoupled RoPE (YaRN, the default with MLA) and padded heads (qk 48 + 16, v
// 32: the core attention's head dim 64, the FlashAttention-2 tensor-core kernels with dropout), and
// one MTP depth (its embedding, projection, transformer layer and the shared output head in the step).
const char* const kMlaMtpModel =
    "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --multi-latent-attention --q-lora-rank 64 --kv-lora-rank 32 "
    "--qk-head-dim 48 --qk-pos-emb-head-dim 16 --v-head-dim 32 --mtp-num-layers 1";

TEST_F(CudaGraphTraining, MlaMtpFullIterationEqualsEagerBitwise) {
  expect_same(kMlaMtpModel,
              "--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 2 --cuda-graph-include-optimizer", true);
}

TEST_F(CudaGraphTraining, MlaMtpPerLayerAttnMlpEqualsEagerBitwise) {
  // Each decoder layer's MLA block and MLP captured per activation slot; the MTP depth runs eagerly
  // between the replays and the head.
  expect_same(kMlaMtpModel, "--cuda-graph-impl local --cuda-graph-scope attn mlp --cuda-graph-warmup-steps 2", true);
}

TEST_F(CudaGraphTraining, MixtureOfExpertsFullIterationEqualsEagerBitwise) {
  // Sync-free MoE (--moe-grouped-gemm, allgather dispatcher): top-2 of 4 experts with the
  // load-balancing and z losses, aux-loss-free expert bias (updated inside the step).
  expect_same("--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --moe-aux-loss-coeff 1e-2 "
              "--moe-z-loss-coeff 1e-3 --moe-router-enable-expert-bias --moe-router-score-function sigmoid",
              "--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 2 --cuda-graph-include-optimizer", true);
}

TEST_F(CudaGraphTraining, MixtureOfExpertsForcedBalanceFollowsEager) {
  // --moe-router-force-load-balancing: the random logits' key takes the iteration from StepValues.
  expect_same("--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm "
              "--moe-router-force-load-balancing",
              "--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 2", true);
}

TEST_F(CudaGraphTraining, AlltoAllStaticBuffersFollowEager) {
  // The capturable alltoall dispatcher on one GPU (EP 1: the fixed block, the device-side
  // permutations and counts, and a capacity that drops slots: the overflow must be the same).
  expect_same("--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --moe-aux-loss-coeff 1e-2 "
              "--moe-token-dispatcher-type alltoall --moe-received-token-capacity 200",
              "--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 2 --cuda-graph-include-optimizer", true);
}

TEST_F(CudaGraphTraining, AlltoAllStaticBuffersWithEchoOnTwoGpus) {
  // The capturable alltoall dispatcher (static receive blocks, counts on the device) with ECHO
  // (plan, rerouting, the clones' weights and gradients exchanged by fixed all-to-alls) over EP 2.
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  global_batch_ = 8;
  expect_same("--nproc-per-node 2 --expert-model-parallel-size 2 --disable-bias-linear --num-experts 4 "
              "--moe-router-topk 2 --moe-grouped-gemm --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall "
              "--moe-received-token-capacity 1024 --moe-enable-echo --moe-num-echo-experts 1",
              "--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 2 --cuda-graph-include-optimizer");
}

// --async-save every iteration beside CUDA graphs: the snapshot's copies run on their own stream
// and the next step waits for them on the device before its first update (a full-iteration graph:
// before its launch; per-layer graphs: inside the step, StepOptions::wait_before_update). Training
// must follow the eager run without saving (the saved bytes: async_save_cuda_test). The MoE
// expert bias is saved state that the step itself updates.
TEST_F(CudaGraphTraining, AsyncSaveEveryIterationWithFullIterationGraphFollowsEager) {
  expect_same("--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm "
              "--moe-router-enable-expert-bias --moe-router-score-function sigmoid",
              "--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 2 --cuda-graph-include-optimizer "
              "--async-save --save-interval 1 --save " + (dir_ / "ck_full").string(), true);
}

TEST_F(CudaGraphTraining, AsyncSaveEveryIterationWithPerLayerGraphsFollowsEager) {
  expect_same("", "--cuda-graph-impl local --cuda-graph-scope attn mlp --cuda-graph-warmup-steps 2 "
                  "--async-save --save-interval 1 --save " + (dir_ / "ck_layer").string(), true);
}

// Per-layer capture (--cuda-graph-impl local with scopes): each layer's attention and MLP blocks
// captured per activation slot, replayed for every micro-batch (3 per step here), the dropout
// keyed by the slot's device micro-batch key.
TEST_F(CudaGraphTraining, PerLayerAttnMlpEqualsEagerBitwise) {
  expect_same(kFlashModel, "--cuda-graph-impl local --cuda-graph-scope attn mlp --cuda-graph-warmup-steps 2", true);
}

TEST_F(CudaGraphTraining, PerLayerWholeLayerWithDistributedOptimizerEqualsEagerBitwise) {
  // No scope: the whole layer (Megatron's default for local); gradient-reduction hooks between
  // the replayed layers (overlapped, the distributed optimizer). Llama style: RMSNorm, SwiGLU,
  // RoPE, no biases.
  expect_same(std::string(kFlashModel) +
                  " --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
                  "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 20000",
              "--cuda-graph-impl local --cuda-graph-warmup-steps 1", true);
}

TEST_F(CudaGraphTraining, PerLayerMoeFollowsEager) {
  expect_same("--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --moe-aux-loss-coeff 1e-2 "
              "--moe-z-loss-coeff 1e-3 --moe-router-enable-expert-bias --moe-router-score-function sigmoid",
              "--cuda-graph-impl local --cuda-graph-scope attn moe --cuda-graph-warmup-steps 2", true);
}

TEST_F(CudaGraphTraining, PerLayerMoeRouterWithHostCountsFollowsEager) {
  // moe_router: the router and its losses captured while the experts' per-expert GEMM loop (which
  // reads the counts on the host) runs eagerly; with the global load-balancing loss, whose counts
  // accumulate over the step's micro-batches on the device.
  expect_same("--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 "
              "--moe-router-load-balancing-type global_aux_loss --moe-z-loss-coeff 1e-3",
              "--cuda-graph-impl local --cuda-graph-scope attn moe_router --cuda-graph-warmup-steps 2", true);
}

// moe_preprocess (with moe_router): the router and the token dispatcher's preprocessing (the
// routing metadata up to the first host read) in one graph per layer, slot and direction, the rest
// of the MoE block eager between the replays. Allgather with host counts (per-expert GEMMs),
// alltoall dropless (its split sizes read on the host after the graph), alltoall with static
// receive blocks that overflow (grouped GEMM; nothing read on the host).
TEST_F(CudaGraphTraining, PerLayerMoePreprocessAllgatherFollowsEager) {
  expect_same("--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 "
              "--moe-router-load-balancing-type global_aux_loss --moe-z-loss-coeff 1e-3",
              "--cuda-graph-impl local --cuda-graph-scope attn moe_router moe_preprocess --cuda-graph-warmup-steps 2", true);
}

TEST_F(CudaGraphTraining, PerLayerMoePreprocessAlltoAllFollowsEager) {
  expect_same("--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 "
              "--moe-token-dispatcher-type alltoall --moe-z-loss-coeff 1e-3",
              "--cuda-graph-impl local --cuda-graph-scope attn moe_router moe_preprocess --cuda-graph-warmup-steps 2", true);
}

TEST_F(CudaGraphTraining, PerLayerMoePreprocessStaticAlltoAllFollowsEager) {
  expect_same("--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --moe-aux-loss-coeff 1e-2 "
              "--moe-token-dispatcher-type alltoall --moe-received-token-capacity 200",
              "--cuda-graph-impl local --cuda-graph-scope moe_router moe_preprocess --cuda-graph-warmup-steps 2", true);
}

// The summary line of per-layer capture names the preprocessing region, and its graphs hold more
// nodes than the router's alone, in as many graphs (the region replaces the router's).
TEST_F(CudaGraphTraining, PerLayerMoePreprocessGraphsHoldThePreprocessing) {
  // "> CUDA graph (per layer, scopes ...): G graphs (N nodes)": the last such line of a run
  auto summary = [](const std::string& out) {
    const std::string key = "> CUDA graph (per layer, scopes ";
    const size_t at = out.rfind(key);
    EXPECT_NE(at, std::string::npos) << out;
    std::pair<long, long> gn{-1, -1};
    if (at == std::string::npos) return std::make_pair(gn, std::string());
    const size_t colon = out.find("): ", at);
    const std::string line = out.substr(at, out.find('\n', at) - at);
    if (std::sscanf(out.c_str() + colon + 3, "%ld graphs (%ld nodes)", &gn.first, &gn.second) != 2)
      ADD_FAILURE() << line;
    return std::make_pair(gn, line);
  };
  for (const std::string& model :
       {std::string("--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2"),
        std::string("--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 "
                    "--moe-token-dispatcher-type alltoall")}) {
    SCOPED_TRACE(model);
    const RunResult router =
        run_megatron(flags(model + " --cuda-graph-impl local --cuda-graph-scope moe_router --cuda-graph-warmup-steps 1"));
    const RunResult pre = run_megatron(flags(
        model + " --cuda-graph-impl local --cuda-graph-scope moe_router moe_preprocess --cuda-graph-warmup-steps 1"));
    ASSERT_EQ(router.rc, 0) << router.out;
    ASSERT_EQ(pre.rc, 0) << pre.out;
    const auto [r, router_line] = summary(router.out);
    const auto [p, pre_line] = summary(pre.out);
    EXPECT_EQ(router_line.find("moe_preprocess"), std::string::npos) << router_line;
    EXPECT_NE(pre_line.find("(moe_preprocess: router, "), std::string::npos) << pre_line;
    if (model.find("alltoall") != std::string::npos)
      EXPECT_NE(pre_line.find("permutation 1, count all-gather"), std::string::npos) << pre_line;
    EXPECT_EQ(p.first, r.first) << "graphs: " << router_line << "\n" << pre_line;
    EXPECT_GT(p.second, r.second) << "nodes: " << router_line << "\n" << pre_line;
    std::printf("%s\n%s\n", router_line.c_str(), pre_line.c_str());
  }
}

TEST_F(CudaGraphTraining, RefusedCombinationsNameTheFlag) {
  RunResult r = run_megatron(flags("--cuda-graph-impl full_iteration --timing-log-level 1"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("--timing-log-level"), std::string::npos) << r.out;
  r = run_megatron(flags("--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 0"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("--cuda-graph-warmup-steps 0"), std::string::npos) << r.out;
  r = run_megatron(flags("--cuda-graph-include-optimizer"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("--cuda-graph-impl none"), std::string::npos) << r.out;
  r = run_megatron(flags("--cuda-graph-impl full_iteration --num-experts 4"));  // host-read expert counts
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("--moe-grouped-gemm"), std::string::npos) << r.out;
  r = run_megatron(flags("--cuda-graph-impl full_iteration --num-experts 4 --moe-grouped-gemm "
                         "--moe-token-dispatcher-type alltoall"));  // host-read split sizes
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("--moe-received-token-capacity"), std::string::npos) << r.out;
  r = run_megatron(flags("--cuda-graph-impl local --num-experts 4 --cuda-graph-scope attn moe_preprocess"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("moe_preprocess needs moe_router"), std::string::npos) << r.out;
  // Megatron-FSDP's staging slots with per-layer graphs (the full-iteration graph is built)
  r = run_megatron(flags("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                         "--cuda-graph-impl local --cuda-graph-scope attn mlp"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("optim_grads_params with per-layer CUDA graphs"), std::string::npos) << r.out;
}

}  // namespace
