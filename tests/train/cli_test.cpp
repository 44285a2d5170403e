// End-to-end tests of the `megatron` binary on CPU: preprocess-data -> pretrain -> resume ->
// generate on a tiny corpus with a tiny byte-level BPE vocabulary written by the test, and one
// test per documented input error (non-zero exit and a message naming the problem).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include <sys/resource.h>

#include "data/indexed_dataset.h"
#include "model/variants.h"
#include "testing/testing.h"

namespace fs = std::filesystem;

namespace {

using mt::testing::RunResult;
using mt::testing::run_megatron;

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// A GPT-2-format byte-level BPE vocabulary: 256 byte tokens, two merges, <|endoftext|> last.
void write_tiny_tokenizer(const fs::path& dir) {
  std::vector<int> bs;
  for (int b = 33; b <= 126; ++b) bs.push_back(b);
  for (int b = 161; b <= 172; ++b) bs.push_back(b);
  for (int b = 174; b <= 255; ++b) bs.push_back(b);
  std::vector<uint32_t> cs(bs.begin(), bs.end());
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    if (std::find(bs.begin(), bs.end(), b) == bs.end()) {
      bs.push_back(b);
      cs.push_back(256 + extra++);
    }
  }
  nlohmann::json vocab;
  for (size_t i = 0; i < bs.size(); ++i) vocab[utf8(cs[i])] = static_cast<int>(i);
  vocab["th"] = 256;
  vocab["the"] = 257;
  vocab["<|endoftext|>"] = 258;
  std::ofstream(dir / "vocab.json") << vocab.dump();
  std::ofstream(dir / "merges.txt") << "#version: 0.2\nt h\nth e\n";
}

class CliTest : public ::testing::Test {
 protected:
  static fs::path dir;
  static std::string tok;  // tokenizer flags
  static std::string data;
  static void SetUpTestSuite() {
    dir = fs::temp_directory_path() / ("mt_cli_test_" + std::to_string(getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir / "corpus");
    write_tiny_tokenizer(dir);
    const char* words[] = {"the", "whale", "sea", "ship", "captain", "the", "harpoon", "white", "deep", "sailor"};
    uint32_t x = 12345;
    for (int d = 0; d < 24; ++d) {
      std::ofstream f(dir / "corpus" / fmt_doc(d));
      for (int w = 0; w < 80; ++w) {
        x = x * 1103515245u + 12345u;
        f << words[(x >> 16) % 10] << ((w % 12 == 11) ? ".\n" : " ");
      }
    }
    tok = "--vocab-file " + (dir / "vocab.json").string() + " --merge-file " + (dir / "merges.txt").string();
    RunResult r = run_megatron("preprocess-data --input " + (dir / "corpus").string() + " --output-prefix " +
                               (dir / "tiny").string() + " --append-eod " + tok);
    ASSERT_EQ(r.rc, 0) << r.out;
    data = (dir / "tiny_text_document").string();
    ASSERT_TRUE(fs::exists(data + ".bin") && fs::exists(data + ".idx")) << r.out;
  }
  static void TearDownTestSuite() { fs::remove_all(dir); }
  static std::string fmt_doc(int d) { return "doc" + std::to_string(100 + d) + ".txt"; }

  static std::string train_flags(const std::string& extra, const std::string& data_path = "") {
    return "pretrain --num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
           "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --min-lr 1e-3 "
           "--lr-decay-style cosine --lr-warmup-iters 2 --lr-decay-iters 6 --log-interval 1 --eval-interval 3 "
           "--eval-iters 1 --split 90,10,0 --device cpu --no-progress --data-path " +
           (data_path.empty() ? data : data_path) + " " + tok + " " + extra;
  }
};
fs::path CliTest::dir;
std::string CliTest::tok;
std::string CliTest::data;

std::vector<std::string> loss_lines(const std::string& out) {
  std::vector<std::string> v;
  std::regex re("iteration +([0-9]+)/ *[0-9]+ .*lm loss: ([0-9.E+-]+)");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    v.push_back((*it)[1].str() + ":" + (*it)[2].str());
  return v;
}

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST_F(CliTest, TrainsAndResumesBitwise) {
  const fs::path a = dir / "ckpt_a", b = dir / "ckpt_b";
  RunResult full = run_megatron(train_flags("--train-iters 6 --save " + a.string() + " --save-interval 3"));
  ASSERT_EQ(full.rc, 0) << full.out;
  auto full_losses = loss_lines(full.out);
  ASSERT_EQ(full_losses.size(), 6u) << full.out;
  EXPECT_NE(full.out.find("validation loss at iteration 3"), std::string::npos) << full.out;
  EXPECT_NE(full.out.find("number of skipped iterations:   0"), std::string::npos);

  RunResult first = run_megatron(train_flags("--train-iters 6 --exit-interval 3 --save " + b.string()));
  ASSERT_EQ(first.rc, 0) << first.out;
  EXPECT_NE(first.out.find("exiting program at iteration 3"), std::string::npos) << first.out;
  RunResult second = run_megatron(train_flags("--train-iters 6 --save " + b.string() + " --load " + b.string()));
  ASSERT_EQ(second.rc, 0) << second.out;
  auto l1 = loss_lines(first.out), l2 = loss_lines(second.out);
  l1.insert(l1.end(), l2.begin(), l2.end());
  EXPECT_EQ(l1, full_losses) << first.out << second.out;
  // Parameters, moments and scaler state at iteration 6 are bitwise identical.
  const std::string fa = read_bytes(a / "iter_0000006" / "rank_00000.bin");
  const std::string fb = read_bytes(b / "iter_0000006" / "rank_00000.bin");
  ASSERT_FALSE(fa.empty());
  EXPECT_TRUE(fa == fb) << "resumed run diverged from the uninterrupted run";
  EXPECT_EQ(read_bytes(a / "latest_checkpointed_iteration.txt"), "6\n");

  RunResult gen = run_megatron("generate --load " + a.string() + " " + tok +
                               " --prompt \"the whale\" --out-seq-length 8 --top-k 5 --device cpu");
  ASSERT_EQ(gen.rc, 0) << gen.out;
  EXPECT_NE(gen.out.find("the whale"), std::string::npos) << gen.out;
}

// Multi-latent attention (docs/mla.md) from the command line: an interrupted and resumed run
// equals the uninterrupted one (the checkpoint's config carries the MLA fields), --recompute-modules
// mla_up_proj trains the same model, a resume with another --kv-lora-rank is refused, and the
// checkpoint generates text through the latent cache.
TEST_F(CliTest, MultiLatentAttentionTrainsResumesAndGenerates) {
  const std::string mla = "--normalization RMSNorm --swiglu --ffn-hidden-size 32 --position-embedding-type rope "
                          "--disable-bias-linear "
                          "--multi-latent-attention --q-lora-rank 12 --kv-lora-rank 8 --qk-head-dim 6 "
                          "--qk-pos-emb-head-dim 4 --v-head-dim 5 --rotary-scaling-factor 4 "
                          "--yarn-original-max-position-embeddings 8 --mscale-all-dim 0.5 --attention-backend local ";
  const fs::path a = dir / "mla_a", b = dir / "mla_b";
  RunResult full = run_megatron(train_flags("--train-iters 6 " + mla + "--save " + a.string() + " --save-interval 3"));
  ASSERT_EQ(full.rc, 0) << full.out;
  const auto full_losses = loss_lines(full.out);
  ASSERT_EQ(full_losses.size(), 6u) << full.out;
  EXPECT_NE(full.out.find(", MLA (q-lora 12, kv-lora 8, qk 6+4, v 5, yarn x4)"), std::string::npos) << full.out;
  RunResult first = run_megatron(train_flags("--train-iters 6 --exit-interval 3 " + mla + "--save " + b.string()));
  ASSERT_EQ(first.rc, 0) << first.out;
  RunResult second =
      run_megatron(train_flags("--train-iters 6 " + mla + "--save " + b.string() + " --load " + b.string()));
  ASSERT_EQ(second.rc, 0) << second.out;
  auto l1 = loss_lines(first.out), l2 = loss_lines(second.out);
  l1.insert(l1.end(), l2.begin(), l2.end());
  EXPECT_EQ(l1, full_losses) << first.out << second.out;
  RunResult rc = run_megatron(train_flags("--train-iters 6 " + mla +
                                          "--recompute-granularity selective --recompute-modules core_attn mla_up_proj"));
  ASSERT_EQ(rc.rc, 0) << rc.out;
  EXPECT_EQ(loss_lines(rc.out), full_losses) << rc.out;
  const std::string other = std::regex_replace(mla, std::regex("--kv-lora-rank 8"), "--kv-lora-rank 4");
  RunResult bad = run_megatron(train_flags("--train-iters 9 " + other + "--load " + a.string()));
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("checkpoint has --kv-lora-rank 8 but the command line asks for 4"), std::string::npos)
      << bad.out;
  RunResult gen = run_megatron("generate --load " + a.string() + " " + tok +
                               " --prompt \"the whale\" --out-seq-length 8 --top-k 5 --device cpu");
  ASSERT_EQ(gen.rc, 0) << gen.out;
  EXPECT_NE(gen.out.find("the whale"), std::string::npos) << gen.out;
}

// --recompute-granularity full / selective (also with --recompute-modules) trains the same model:
// the loss lines are those of the run without recompute, and the log names the recompute.
TEST_F(CliTest, ActivationRecomputeTrainsTheSameModel) {
  const std::string common = "--train-iters 3 --attention-backend local ";
  RunResult plain = run_megatron(train_flags(common));
  ASSERT_EQ(plain.rc, 0) << plain.out;
  ASSERT_EQ(loss_lines(plain.out).size(), 3u) << plain.out;
  for (const std::string flags :
       {"--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
        "--recompute-activations",
        "--recompute-granularity selective --recompute-modules core_attn layernorm mlp_act"}) {
    RunResult r = run_megatron(train_flags(common + flags));
    ASSERT_EQ(r.rc, 0) << flags << "\n" << r.out;
    EXPECT_EQ(loss_lines(r.out), loss_lines(plain.out)) << flags << "\n" << r.out;
    EXPECT_NE(r.out.find(" recompute"), std::string::npos) << r.out;
  }
}

// --deterministic-mode (Megatron's flag) is accepted and named in the model line; on the CPU, whose
// kernels are all deterministic, it trains the same model bit for bit.
TEST_F(CliTest, DeterministicModeOnCpuTrainsTheSameModel) {
  RunResult plain = run_megatron(train_flags("--train-iters 3"));
  ASSERT_EQ(plain.rc, 0) << plain.out;
  ASSERT_EQ(loss_lines(plain.out).size(), 3u) << plain.out;
  RunResult det = run_megatron(train_flags("--train-iters 3 --deterministic-mode"));
  ASSERT_EQ(det.rc, 0) << det.out;
  EXPECT_EQ(loss_lines(det.out), loss_lines(plain.out)) << det.out;
  EXPECT_NE(det.out.find(", deterministic mode"), std::string::npos) << det.out;
  EXPECT_EQ(plain.out.find(", deterministic mode"), std::string::npos) << plain.out;
}

// The memory estimate printed before training matches the buffers allocated (within 10%: on the
// CPU the sizes are exact), with and without recompute.
TEST_F(CliTest, MemoryEstimateMatchesTheAllocation) {
  for (const std::string flags :
       {"", "--recompute-granularity full --recompute-method block --recompute-num-layers 1 --hidden-size 64",
        "--recompute-granularity selective --recompute-modules layernorm mlp_act"}) {
    RunResult r = run_megatron(train_flags("--train-iters 1 " + flags));
    ASSERT_EQ(r.rc, 0) << r.out;
    EXPECT_NE(r.out.find("> memory estimate per rank: parameters (fp32)"), std::string::npos) << r.out;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.out, m, std::regex("memory estimate ([0-9.]+) MiB of buffers, ([+-][0-9.]+)% "
                                                        "from the ([0-9.]+) MiB allocated")))
        << r.out;
    EXPECT_GT(std::stod(m[1].str()), 0.0);
    EXPECT_LT(std::fabs(std::stod(m[2].str())), 10.0) << r.out;
  }
}

TEST_F(CliTest, DocumentMasksAndMockData) {
  RunResult r =
      run_megatron(train_flags("--train-iters 3 --reset-position-ids --reset-attention-mask --eod-mask-loss"));
  ASSERT_EQ(r.rc, 0) << r.out;
  ASSERT_EQ(loss_lines(r.out).size(), 3u) << r.out;
  EXPECT_EQ(r.out.find("NAN"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("grad norm: nan"), std::string::npos) << r.out;
  // Megatron's MockGPTDataset: no files at all.
  RunResult m = run_megatron("pretrain --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
                             "--micro-batch-size 2 --lr 1e-3 --train-iters 2 --log-interval 1 --eval-iters 0 "
                             "--device cpu --no-progress --mock-data --timing-log-level 1 " + tok);
  ASSERT_EQ(m.rc, 0) << m.out;
  EXPECT_NE(m.out.find("<mock>"), std::string::npos) << m.out;
  EXPECT_EQ(loss_lines(m.out).size(), 2u) << m.out;
  EXPECT_EQ(m.out.find("validation loss"), std::string::npos) << "--eval-iters 0 still validated:\n" << m.out;
  // --timing-log-level 1: Megatron's timer report after each log line (default option minmax).
  for (const char* t : {"(min, max) time across ranks (ms):", "forward-backward ....", "all-grads-sync ....",
                        "optimizer-inner-step ....", "optimizer ...."})
    EXPECT_NE(m.out.find(t), std::string::npos) << t << " missing in\n" << m.out;
}

// The flags of the variation points (model/variants.h): --help describes each from its table, and
// a value outside it exits non-zero naming the value and every accepted one.
TEST(Cli, VariantFlagsHelpAndErrors) {
  const RunResult help = run_megatron("pretrain --help");
  EXPECT_EQ(help.rc, 0) << help.out;
  for (const std::string& text : {mt::normalization_help(), mt::position_embedding_type_help(),
                                  mt::attention_backend_help()})
    EXPECT_NE(help.out.find(text), std::string::npos) << "'" << text << "' missing in\n" << help.out;
  const std::vector<std::pair<std::string, std::string>> cases{
      {"--normalization BatchNorm", "--normalization 'BatchNorm' is not supported: expected LayerNorm or RMSNorm"},
      {"--position-embedding-type alibi",
       "--position-embedding-type 'alibi' is not supported: expected learned_absolute, rope or none"},
      {"--attention-backend flex",
       "--attention-backend 'flex' is not supported: expected auto, flash, fused or local (unfused)"},
  };
  for (const auto& [args, expect] : cases) {
    const RunResult r = run_megatron("pretrain " + args);
    EXPECT_NE(r.rc, 0) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(expect), std::string::npos) << "expected '" << expect << "' in:\n" << r.out;
  }
}

TEST_F(CliTest, BadInputErrors) {
  struct Case {
    std::string args, expect;
  };
  const fs::path bad = dir / "bad";
  fs::create_directories(bad);
  // Corrupt copies of the dataset.
  fs::copy_file(data + ".bin", bad / "magic.bin");
  {
    std::string idx = read_bytes(data + ".idx");
    idx[0] = 'X';
    std::ofstream(bad / "magic.idx", std::ios::binary) << idx;
    std::string bin = read_bytes(data + ".bin");
    std::ofstream(bad / "trunc.bin", std::ios::binary) << bin.substr(0, bin.size() / 2);
    std::ofstream(bad / "trunc.idx", std::ios::binary) << read_bytes(data + ".idx");
    std::ofstream(bad / "shortidx.idx", std::ios::binary) << idx.substr(0, 20);
    fs::copy_file(data + ".bin", bad / "shortidx.bin");
  }
  {  // token ids beyond the 259-token vocabulary
    mt::data::IndexedDatasetBuilder builder((bad / "bigids").string(), mt::data::IndexDType::kInt32);
    for (int d = 0; d < 20; ++d) {  // every 10th id is bad, so every 17-token sample holds one
      std::vector<int32_t> doc(200, 7);
      for (size_t t = 5; t < doc.size(); t += 10) doc[t] = 5000;
      builder.add_document(doc);
    }
    builder.finalize();
  }
  std::ofstream(bad / "a_file") << "x";
  const std::string moe = "--num-experts 4 --disable-bias-linear";
  const std::vector<Case> cases = {
      {train_flags("--train-iters 2", (bad / "nothing").string()), "nothing"},
      {train_flags("--train-iters 2", (bad / "magic").string()), "magic"},
      {train_flags("--train-iters 2", (bad / "trunc").string()), "trunc"},
      {train_flags("--train-iters 2", (bad / "shortidx").string()), "shortidx"},
      {train_flags("--train-iters 2", (bad / "bigids").string()), "5000"},
      {train_flags("--train-iters 2 --seq-length 32"), "--seq-length 32 exceeds --max-position-embeddings 16"},
      {train_flags("--train-iters 2 --num-attention-heads 3"), "not divisible by --num-attention-heads 3"},
      {train_flags("--train-iters 2 --global-batch-size 5"), "--global-batch-size 5 is not divisible"},
      {train_flags("--train-iters 2 --no-such-flag 3"), "no-such-flag"},
      {train_flags("--train-iters 2 --save " + (bad / "a_file" / "sub").string()), "a_file"},
      {train_flags("--train-iters 2 --load " + (bad / "empty_dir").string()), "empty_dir"},
      {train_flags("--train-iters 2 --bf16"), "bf16"},
      {train_flags("--train-iters 2 --lr-decay-style triangle"), "triangle"},
      {train_flags("--train-iters 2 --timing-log-level 2"), "--timing-log-level 2"},
      {train_flags("--train-iters 2 --timing-log-option median"), "median"},
      // CUDA graphs: a CPU run, and the combinations a captured step cannot honour
      {train_flags("--train-iters 2 --cuda-graph-impl full_iteration"), "needs a CUDA device"},
      {train_flags("--train-iters 2 --cuda-graph-impl partial"), "partial"},
      {train_flags("--train-iters 2 --cuda-graph-impl full_iteration --timing-log-level 1"), "--timing-log-level 1"},
      {train_flags("--train-iters 2 --cuda-graph-impl full_iteration --cuda-graph-warmup-steps 0"),
       "--cuda-graph-warmup-steps 0"},
      {train_flags("--train-iters 2 --cuda-graph-include-optimizer"), "--cuda-graph-impl none"},
      {train_flags("--train-iters 2 --cuda-graph-impl local --cuda-graph-scope attn full_iteration"),
       "cannot be combined"},
      // moe_preprocess: only with moe_router (Megatron-Core's rule), only for a MoE model; accepted
      // (then refused on the CPU) for every dispatcher, including the host-synchronised ones
      {train_flags("--train-iters 2 " + moe + " --cuda-graph-impl local --cuda-graph-scope moe_preprocess"),
       "--cuda-graph-scope moe_preprocess: moe_preprocess needs moe_router as well"},
      {train_flags("--train-iters 2 " + moe + " --cuda-graph-impl local --cuda-graph-scope attn moe_preprocess"),
       "--cuda-graph-scope attn moe_preprocess: moe_preprocess needs moe_router as well"},
      {train_flags("--train-iters 2 --cuda-graph-impl local --cuda-graph-scope moe_router moe_preprocess"),
       "--cuda-graph-scope moe_preprocess needs a mixture-of-experts model (--num-experts > 0, got 0)"},
      {train_flags("--train-iters 2 " + moe +
                   " --cuda-graph-impl full_iteration --cuda-graph-scope moe_router moe_preprocess"),
       "cannot be combined"},
      {train_flags("--train-iters 2 " + moe +
                   " --moe-router-force-load-balancing --cuda-graph-impl local --cuda-graph-scope moe_router "
                   "moe_preprocess"),
       "--moe-router-force-load-balancing with the per-layer moe / moe_router scope"},
      {train_flags("--train-iters 2 " + moe + " --cuda-graph-impl local --cuda-graph-scope moe_router moe_preprocess"),
       "needs a CUDA device"},
      {train_flags("--train-iters 2 " + moe +
                   " --moe-token-dispatcher-type alltoall --cuda-graph-impl local --cuda-graph-scope attn moe_router "
                   "moe_preprocess"),
       "needs a CUDA device"},
      {train_flags("--train-iters 2 --cuda-graph-impl local --cuda-graph-scope attn mlp"), "needs a CUDA device"},
      // a model that cannot fit: its weights refused from the configuration, its activations (1 TB of
      // attention scores) by the exact plan, before allocating, naming the largest consumers
      {train_flags("--train-iters 2 --num-layers 64 --hidden-size 65536 --num-attention-heads 64 "
                   "--max-position-embeddings 16"),
       "training cannot fit: the weights, gradients and optimizer state of the model (--num-layers 64, "
       "--hidden-size 65536"},
      {train_flags("--train-iters 2 --num-layers 64 --seq-length 16384 --max-position-embeddings 16384 "
                   "--micro-batch-size 8 --global-batch-size 8"),
       "out of memory at plan time on the host (CPU training)"},
      // activation recompute
      {train_flags("--train-iters 2 --recompute-granularity partial"), "--recompute-granularity 'partial'"},
      {train_flags("--train-iters 2 --recompute-granularity full"), "needs --recompute-method uniform or block"},
      {train_flags("--train-iters 2 --recompute-method block --recompute-num-layers 1"),
       "--recompute-method block needs --recompute-granularity full"},
      {train_flags("--train-iters 2 --recompute-activations --recompute-modules moe"),
       "--recompute-modules moe: Megatron's moe recompute is not implemented"},
      {train_flags("--train-iters 2 --recompute-activations --recompute-modules attn"),
       "--recompute-modules attn: unknown module"},
      {train_flags("--train-iters 2 --recompute-modules layernorm"),
       "--recompute-modules needs --recompute-granularity selective (got none)"},
      {train_flags("--train-iters 2 --cuda-graph-impl local --recompute-granularity full --recompute-method uniform "
                   "--recompute-num-layers 1"),
       "--cuda-graph-impl local with --recompute-granularity full is not supported"},
      {"generate --load " + (bad / "nothing").string() + " " + tok, "nothing"},
  };
  for (const auto& c : cases) {
    RunResult r = run_megatron(c.args);
    EXPECT_NE(r.rc, 0) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << "expected '" << c.expect << "' in:\n" << r.out;
    EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
  }
}

// Every numeric flag holds the number written or stops with a message naming the flag and the
// value as given (docs/flags.md "Numbers"): no wraparound, no octal, no silent coercion of 0 to a
// default, no flag of a feature that is not enabled.
TEST_F(CliTest, BadNumbersNamed) {
  struct Case {
    std::string args, expect;
  };
  const std::vector<Case> cases = {
      {train_flags("--train-iters 2 --micro-batch-size 99999999999999999999"),
       "--micro-batch-size: '99999999999999999999' is out of range: expected an integer in [-9223372036854775808, "
       "9223372036854775807]"},
      {train_flags("--train-iters 2 --seed -1"), "--seed: '-1' is negative: expected an integer >= 0"},
      {train_flags("--train-iters 2 --seed 4294967296"), "--seed: must be an integer in [0, 4294967295], got '4294967296'"},
      {train_flags("--train-iters 2 --tensor-model-parallel-size 99999999999"),
       "--tensor-model-parallel-size: '99999999999' is out of range: expected an integer in [-2147483648, 2147483647]"},
      {train_flags("--train-iters 2 --kv-channels 0"), "--kv-channels: must be a positive integer (>= 1), got '0'"},
      {train_flags("--train-iters 2 --global-batch-size 0"),
       "--global-batch-size: must be a positive integer (>= 1), got '0'"},
      {train_flags("--train-iters 2 --max-position-embeddings 0"),
       "--max-position-embeddings: must be a positive integer (>= 1), got '0'"},
      {train_flags("--train-iters 2 --num-layers 0x10"), "--num-layers: expected an integer, got '0x10'"},
      {train_flags("--train-iters 2 --micro-batch-size 1.5"), "--micro-batch-size: expected an integer, got '1.5'"},
      {train_flags("--train-iters 2 --lr 1e-3 --lr abc"), "--lr: expected a number, got 'abc'"},
      {train_flags("--train-iters 2 --lr nan"), "--lr: expected a finite number, got 'nan'"},
      {train_flags("--train-iters 2 --hidden-dropout 1e39"),
       "--hidden-dropout: '1e39' is out of range: expected a number of magnitude at most 3.4028235e+38"},
      {train_flags("--train-iters 2 --adam-beta2 1"), "--adam-beta2: must be in [0, 1), got '1'"},
      {train_flags("--train-iters 2 --adam-eps 0"), "--adam-eps: must be > 0, got '0'"},
      {train_flags("--train-iters 2 --moe-router-topk 2"),
       "--moe-router-topk given without --num-experts: it applies only to a mixture-of-experts model"},
      {train_flags("--train-iters 2 --kv-lora-rank 16 --v-head-dim 8"),
       "--kv-lora-rank, --v-head-dim given without --multi-latent-attention: they apply only to multi-latent attention"},
      {train_flags("--train-iters 2 --multi-latent-attention --position-embedding-type rope --group-query-attention "
                   "--num-query-groups 1"),
       "--group-query-attention is mutually exclusive with --multi-latent-attention"},
      {train_flags("--train-iters 2 --multi-latent-attention"),
       "--multi-latent-attention needs --position-embedding-type rope"},
      {train_flags("--train-iters 2 --multi-latent-attention --position-embedding-type rope --rope-type ntk"),
       "--rope-type 'ntk' is not supported: expected rope or yarn"},
      {train_flags("--train-iters 2 --multi-latent-attention --position-embedding-type rope --qk-pos-emb-head-dim 3"),
       "--qk-pos-emb-head-dim must be even and >= 2"},
      {train_flags("--train-iters 2 --moe-ffn-hidden-size 32 --moe-router-topk 1"),
       "--moe-ffn-hidden-size, --moe-router-topk given without --num-experts"},
      {train_flags("--train-iters 1000000000 --log-interval 1000000000000"),
       "--log-interval 1000000000000 with --train-iters 1000000000: at most 100000000 iterations per log line"},
      {train_flags("--train-iters 1000000000000000000 --global-batch-size 100"),
       "--train-iters 1000000000000000000, --global-batch-size 100, --eval-interval 3 and --eval-iters 1 ask for "
       "more than 2^63 samples"},
      {"export-hf --load " + (dir / "nothing").string() + " --hf-dir " + (dir / "out").string() +
           " --max-shard-size -1",
       "--max-shard-size: must be an integer >= 0, got '-1'"},
      {"generate --load " + (dir / "nothing").string() + " --top-k -1", "--top-k: must be an integer >= 0, got '-1'"},
      {"generate --load " + (dir / "nothing").string() + " --seed 18446744073709551616",
       "--seed: '18446744073709551616' is out of range: expected an integer in [0, 18446744073709551615]"},
  };
  for (const auto& c : cases) {
    RunResult r = run_megatron(c.args);
    EXPECT_NE(r.rc, 0) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << "expected '" << c.expect << "' in:\n" << r.out;
  }
  // Accepted as written: "010" is 10 (decimal, as Python's int() reads it), a log interval longer
  // than the run logs at its end, and a flag of a feature that is off (RoPE) is named in a warning.
  RunResult ok = run_megatron(train_flags("--train-iters 2 --num-layers 010 --log-interval 1000000000000 "
                                          "--rotary-base 5000"));
  ASSERT_EQ(ok.rc, 0) << ok.out;
  EXPECT_NE(ok.out.find("GPT 10 layers"), std::string::npos) << ok.out;
  EXPECT_EQ(loss_lines(ok.out).size(), 1u) << ok.out;
  EXPECT_NE(ok.out.find("iteration        2/"), std::string::npos) << ok.out;
  EXPECT_NE(ok.out.find("warning: --rotary-base ignored: it applies only with --position-embedding-type rope"),
            std::string::npos)
      << ok.out;
}

// --num-layers 100000 is refused from the configuration alone, before any dataset, layer or
// buffer exists (it used to build layers for minutes first): within a second of CPU time, naming
// the flag. (CPU time of the child processes: wall time depends on the machine's load.)
TEST_F(CliTest, AbsurdModelRefusedAtOnce) {
  rusage before{}, after{};
  getrusage(RUSAGE_CHILDREN, &before);
  const auto t0 = std::chrono::steady_clock::now();
  RunResult r = run_megatron(train_flags("--train-iters 2 --num-layers 100000 --hidden-size 256"));
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  getrusage(RUSAGE_CHILDREN, &after);
  const auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  const double cpu = seconds(after.ru_utime) - seconds(before.ru_utime) + seconds(after.ru_stime) -
                     seconds(before.ru_stime);
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("training cannot fit: the weights, gradients and optimizer state of the model (--num-layers "
                       "100000, --hidden-size 256"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("> datasets"), std::string::npos) << "refused only after the datasets were built:\n" << r.out;
  EXPECT_LT(cpu, 1.0) << r.out;
  EXPECT_LT(wall, 30.0) << r.out;
}

}  // namespace
