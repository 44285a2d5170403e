// Zero-shot evaluation (train/evaluate.h): the sliding-window loss equals a brute-force sum of
// per-token losses (each target scored once, with the context its window gives it, computed from
// the logits of a separate forward per target) for several strides and micro-batch sizes, and
// under TP 2 / PP 2 (CPU ranks as threads) equals one rank's; LAMBADA accuracy on hand-made items
// with known answers, including multi-token targets; the passage split of strict and non-strict
// LAMBADA; Megatron's word count.
#include <gtest/gtest.h>

#include <cmath>
#include <unistd.h>
#include <fstream>
#include <filesystem>
#include <mutex>

#include "comm/thread_comm.h"
#include "data/data_test_util.h"
#include "data/detokenizer.h"
#include "data/gpt2_tokenizer.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include "testing/testing.h"
#include "train/evaluate.h"
#include "train/inference.h"

namespace mt {
namespace {

TransformerConfig config() {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.seq_length = 8;
  c.vocab_size = 37;
  c.make_vocab_size_divisible_by = 8;
  c.hidden_dropout = c.attention_dropout = 0.f;
  c.init_method_std = 0.3f;
  return c;
}

std::vector<int32_t> text_tokens(int n) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(static_cast<int32_t>((i * 7 + i * i) % 37));
  return t;
}

/// log-softmax of `target` in the logits row.
double nll(const std::vector<float>& row, int32_t target) {
  const float mx = *std::max_element(row.begin(), row.end());
  double z = 0;
  for (float v : row) z += std::exp(static_cast<double>(v) - mx);
  return -(row[static_cast<size_t>(target)] - mx - std::log(z));
}

/// Brute force: target t is scored by the first window w (start w·stride) whose span
/// [start + 1, start + S] contains it; its context is tokens[start, t).
double brute_force(const std::vector<int32_t>& tokens, int64_t stride) {
  TransformerConfig c = config();
  Stream st(Device::cpu());
  GPTModel model(c, 1, DType::kF32, Device::cpu(), ProcessGroups::single());
  model.params().initialize(7, st);
  const int64_t S = c.seq_length, T = static_cast<int64_t>(tokens.size());
  Buffer scratch;
  double total = 0;
  for (int64_t t = 1; t < T; ++t) {
    int64_t w = 0;
    while (t > w * stride + S) ++w;
    const int64_t start = w * stride;
    std::vector<int32_t> in(static_cast<size_t>(S), 0);
    for (int64_t i = start; i < t; ++i) in[static_cast<size_t>(i - start)] = tokens[static_cast<size_t>(i)];
    testing::OwnedTensor tok = testing::make_int_tensor(in, Device::cpu(), {S, 1}, st);
    MicroBatch mb;
    mb.tokens = tok.t;
    pipeline_forward(model, mb, false, Tensor(), st);
    total += nll(gather_logit_rows(model, t - 1 - start, 1, scratch, st), tokens[static_cast<size_t>(t)]);
  }
  return total;
}

LmScore windows(const std::vector<int32_t>& tokens, int64_t stride, int64_t b, int tp = 1, int pp = 1) {
  const TransformerConfig c = config();
  LmScore out;
  std::mutex mu;
  run_thread_ranks(tp * pp, [&](int rank, std::shared_ptr<Communicator> world) {
    ParallelConfig pc;
    pc.tp = tp;
    pc.pp = pp;
    validate_and_derive(pc, tp * pp);
    const ProcessGroups g = build_process_groups(world, pc);
    pipeline::PipelineLayout layout;
    layout.num_layers = c.num_layers;
    layout.pp = pp;
    ModelLayout ml;
    for (const auto& r : pipeline::layers_of(g.pp->rank(), layout)) ml.chunks.push_back({r, 1, 1});
    Stream st(Device::cpu());
    GPTModel model(c, b, DType::kF32, Device::cpu(), g, false, ParamLayout{}, ml);
    model.params().initialize(7, st);
    const LmScore s = sliding_window_loss(model, tokens, stride, st);
    std::lock_guard<std::mutex> lock(mu);
    if (rank == 0) out = s;
  });
  return out;
}

TEST(SlidingWindow, EqualsBruteForcePerTokenLosses) {
  const std::vector<int32_t> tokens = text_tokens(30);
  for (int64_t stride : {8, 3, 1}) {
    const double ref = brute_force(tokens, stride);
    for (int64_t b : {1, 3}) {
      const LmScore s = windows(tokens, stride, b);
      EXPECT_EQ(s.scored_tokens, 29) << "stride " << stride << " b " << b;
      EXPECT_NEAR(s.total_loss, ref, 1e-4 * std::abs(ref)) << "stride " << stride << " b " << b;
    }
  }
}

TEST(SlidingWindow, TensorAndPipelineParallelEqualOneRank) {
  const std::vector<int32_t> tokens = text_tokens(27);
  const LmScore one = windows(tokens, 3, 2);
  for (auto [tp, pp] : {std::pair{2, 1}, std::pair{1, 2}, std::pair{2, 2}}) {
    const LmScore s = windows(tokens, 3, 2, tp, pp);
    EXPECT_EQ(s.scored_tokens, one.scored_tokens);
    EXPECT_NEAR(s.total_loss, one.total_loss, 1e-5 * one.total_loss) << "tp " << tp << " pp " << pp;
  }
}

TEST(SlidingWindow, BadArguments) {
  const TransformerConfig c = config();
  Stream st(Device::cpu());
  GPTModel model(c, 1, DType::kF32, Device::cpu(), ProcessGroups::single());
  model.params().initialize(7, st);
  EXPECT_THROW(sliding_window_loss(model, text_tokens(10), 0, st), Error);
  EXPECT_THROW(sliding_window_loss(model, text_tokens(10), 9, st), Error);  // stride > seq_length
  EXPECT_THROW(sliding_window_loss(model, {3}, 4, st), Error);
  EXPECT_THROW(sliding_window_loss(model, {3, 40}, 4, st), Error);         // outside the vocabulary
}

/// The model's greedy continuation of `context` for n tokens (independently of cloze_correct: one
/// forward per token).
std::vector<int32_t> greedy(GPTModel& model, std::vector<int32_t> context, int n, const Stream& st) {
  Buffer scratch;
  std::vector<int32_t> out;
  const int64_t S = model.config().seq_length;
  for (int k = 0; k < n; ++k) {
    std::vector<int32_t> in(static_cast<size_t>(S), 0);
    std::copy(context.begin(), context.end(), in.begin());
    testing::OwnedTensor tok = testing::make_int_tensor(in, Device::cpu(), {S, 1}, st);
    MicroBatch mb;
    mb.tokens = tok.t;
    pipeline_forward(model, mb, false, Tensor(), st);
    const std::vector<float> row =
        gather_logit_rows(model, static_cast<int64_t>(context.size()) - 1, 1, scratch, st);
    const int32_t next = static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
    out.push_back(next);
    context.push_back(next);
  }
  return out;
}

TEST(Lambada, AccuracyOnItemsWithKnownAnswers) {
  const TransformerConfig c = config();
  Stream st(Device::cpu());
  GPTModel ref(c, 1, DType::kF32, Device::cpu(), ProcessGroups::single());
  ref.params().initialize(7, st);
  // Correct items: targets of 1, 2 and 3 tokens that are the model's greedy continuation. Wrong
  // items: the same with one target token changed (the first, or only the last one).
  std::vector<ClozeItem> items;
  std::vector<bool> answer;
  const std::vector<std::vector<int32_t>> contexts = {{4, 9, 1}, {30, 2}, {5, 6, 7, 8, 9}, {11}};
  for (size_t i = 0; i < contexts.size(); ++i) {
    const int n = 1 + static_cast<int>(i % 3);
    const std::vector<int32_t> t = greedy(ref, contexts[i], n, st);
    items.push_back({contexts[i], t});
    answer.push_back(true);
    std::vector<int32_t> wrong = t;
    wrong.back() = (wrong.back() + 1) % 37;
    items.push_back({contexts[i], wrong});
    answer.push_back(false);
    if (n > 1) {
      wrong = t;
      wrong.front() = (wrong.front() + 5) % 37;
      items.push_back({contexts[i], wrong});
      answer.push_back(false);
    }
  }
  // A context longer than the window is cut from the left: the first target token is
  // predicted from the last S - (target length - 1) context tokens.
  {
    std::vector<int32_t> long_ctx = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    const std::vector<int32_t> tail(long_ctx.end() - 7, long_ctx.end());  // S - (2 - 1) tokens
    std::vector<int32_t> t = greedy(ref, tail, 2, st);
    items.push_back({long_ctx, t});
    answer.push_back(true);
  }
  int64_t expected = std::count(answer.begin(), answer.end(), true);
  for (int64_t b : {1, 4}) {
    GPTModel m(c, b, DType::kF32, Device::cpu(), ProcessGroups::single());
    m.params().initialize(7, st);
    EXPECT_EQ(cloze_correct(m, items, st), expected) << "micro-batch " << b;
    // One item at a time gives its known answer.
    for (size_t i = 0; i < items.size(); ++i)
      EXPECT_EQ(cloze_correct(m, {items[i]}, st), answer[i] ? 1 : 0) << "item " << i;
  }
  // TP 2 x PP 2 counts the same.
  int64_t par = -1;
  run_thread_ranks(4, [&](int rank, std::shared_ptr<Communicator> world) {
    ParallelConfig pc;
    pc.tp = 2;
    pc.pp = 2;
    validate_and_derive(pc, 4);
    const ProcessGroups g = build_process_groups(world, pc);
    pipeline::PipelineLayout layout;
    layout.num_layers = c.num_layers;
    layout.pp = 2;
    ModelLayout ml;
    for (const auto& r : pipeline::layers_of(g.pp->rank(), layout)) ml.chunks.push_back({r, 1, 1});
    Stream s2(Device::cpu());
    GPTModel m(c, 3, DType::kF32, Device::cpu(), g, false, ParamLayout{}, ml);
    m.params().initialize(7, s2);
    const int64_t n = cloze_correct(m, items, s2);
    if (rank == 0) par = n;
  });
  EXPECT_EQ(par, expected);
}

TEST(Lambada, PassageSplit) {
  // Byte-level BPE with the merge "ab": " zab" is the three tokens " ", "z", "ab".
  data::testing::TempDir dir;
  const std::vector<std::string> vocab = data::testing::write_tiny_vocab(dir.path(), {{"a", "b"}});
  const std::unique_ptr<data::Tokenizer> tok =
      data::make_tokenizer("GPT2BPETokenizer", dir.file("vocab.json"), dir.file("merges.txt"), "", 0);
  const int32_t ab = static_cast<int32_t>(std::find(vocab.begin(), vocab.end(), "ab") - vocab.begin());
  // Strict (Megatron's _LambadaDataset strict): the whole last word with its leading space.
  const ClozeItem strict = lambada_item("x y zab ", *tok, true);
  EXPECT_EQ(strict.context, tok->encode("x y"));
  EXPECT_EQ(strict.target, (std::vector<int32_t>{' ', 'z', ab}));
  // Not strict: the last token of the tokenized passage.
  const ClozeItem loose = lambada_item("x y zab", *tok, false);
  EXPECT_EQ(loose.target, (std::vector<int32_t>{ab}));
  EXPECT_EQ(loose.context, (std::vector<int32_t>{'x', ' ', 'y', ' ', 'z'}));
  EXPECT_THROW(lambada_item("   ", *tok, true), Error);
  EXPECT_THROW(lambada_item("zab", *tok, true), Error);  // no context before the last word
  EXPECT_THROW(lambada_item("z", *tok, false), Error);
}

TEST(Wikitext, MegatronWordCount) {
  EXPECT_EQ(original_word_count(" a b  c\n"), 4);  // Python: "a b  c".split(" ") has 4 parts
  EXPECT_EQ(original_word_count("one"), 1);
  EXPECT_EQ(original_word_count(""), 1);
}

// The binary on a WikiText-style file (a path containing "wiki", as Megatron picks its
// detokenizer): the text is detokenized before tokenizing (the token count is that of the
// detokenized text), the word count is the original's, and a file whose path names no
// detokenizer is scored as it is.
TEST(Wikitext, TheBinaryDetokenizesByThePath) {
  const std::string data = data::testing::demo_data_dir();
  if (!std::filesystem::exists(data + "/gpt2/encoder.json")) GTEST_SKIP() << "demo data missing";
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("mt_detok_" + std::to_string(getpid()));  // no "wiki" in it
  std::filesystem::create_directories(dir);
  const std::string tok = "--vocab-file " + data + "/gpt2/encoder.json --merge-file " + data + "/gpt2/vocab.bpe";
  const testing::RunResult train = testing::run_megatron(
      "pretrain --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
      "--micro-batch-size 1 --global-batch-size 1 --train-iters 1 --lr 1e-3 --device cpu --no-progress --eval-iters 0 "
      "--mock-data " + tok + " --save " + (dir / "ck").string());
  ASSERT_EQ(train.rc, 0) << train.out;
  const std::string text = " = = Gameplay = = \n The game 's 1 @,@ 000 units sold in 2 @.@ 5 days ; it was well "
                           "@-@ received . \n He said \" hello \" ( in brackets ) , really . \n";
  for (const std::string name : {"wiki.test.tokens", "plain.txt"}) {
    std::ofstream(dir / name) << text;
    const testing::RunResult r = testing::run_megatron("evaluate --load " + (dir / "ck").string() +
                                                       " --task WIKITEXT103 --valid-data " + (dir / name).string() +
                                                       " --overlapping-eval 16 --device cpu " + tok);
    ASSERT_EQ(r.rc, 0) << r.out;
    const bool wiki = name.rfind("wiki", 0) == 0;
    EXPECT_EQ(r.out.find("the wikitext detokenizer") != std::string::npos, wiki) << r.out;
    const auto t = data::Gpt2Tokenizer::from_files(data + "/gpt2/encoder.json", data + "/gpt2/vocab.bpe");
    const size_t n = t.encode(wiki ? data::wikitext_detokenize(text) : text).size();
    EXPECT_NE(r.out.find(fmt::format("tokens: {} | words: {} |", n, original_word_count(text))), std::string::npos)
        << name << ": expected " << n << " tokens\n" << r.out;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace mt
