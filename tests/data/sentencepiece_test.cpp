// SentencePieceTokenizer (CPU builds with Debian's libsentencepiece-dev): a tiny model trained by
// the test with SentencePiece's own trainer, then our tokenizer against SentencePiece's processor.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/check.h"
#include "data/tokenizer.h"
#ifdef MT_WITH_SENTENCEPIECE
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#endif

namespace fs = std::filesystem;

namespace mt::data {
namespace {

TEST(SentencePieceTokenizer, MatchesSentencePieceProcessor) {
#ifndef MT_WITH_SENTENCEPIECE
  GTEST_SKIP() << "built without libsentencepiece";
#else
  const fs::path dir = fs::temp_directory_path() / ("mt_sp_" + std::to_string(getpid()));
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "corpus.txt");
    const char* lines[] = {"Call me Ishmael.", "Some years ago, never mind how long precisely,",
                           "having little or no money in my purse,", "and nothing particular to interest me on shore,",
                           "I thought I would sail about a little and see the watery part of the world."};
    for (int r = 0; r < 40; ++r)
      for (const char* l : lines) f << l << "\n";
  }
  const auto st = sentencepiece::SentencePieceTrainer::Train("--input=" + (dir / "corpus.txt").string() +
                                                            " --model_prefix=" + (dir / "m").string() +
                                                            " --vocab_size=120 --model_type=bpe --minloglevel=2");
  ASSERT_TRUE(st.ok()) << st.ToString();
  const std::string model = (dir / "m.model").string();
  auto tok = make_tokenizer("SentencePieceTokenizer", "", "", model, 0);
  sentencepiece::SentencePieceProcessor ref;
  ASSERT_TRUE(ref.Load(model).ok());
  for (const std::string text : {"Call me Ishmael.", "never mind how long", "the watery part of the world!", ""}) {
    std::vector<int> want;
    ASSERT_TRUE(ref.Encode(text, &want).ok());
    const std::vector<int32_t> got = tok->encode(text);
    EXPECT_EQ(got, std::vector<int32_t>(want.begin(), want.end())) << text;
    std::string back;
    ASSERT_TRUE(ref.Decode(want, &back).ok());
    EXPECT_EQ(tok->decode(got), back);  // lossy only for characters the model lacks ("!" -> unk)
    if (text.find('!') == std::string::npos) EXPECT_EQ(back, text);
  }
  EXPECT_EQ(tok->vocab_size(), 120);
  EXPECT_EQ(tok->eod(), ref.eos_id());
  EXPECT_THROW(tok->decode(std::vector<int32_t>{500}), mt::Error);
  EXPECT_THROW(make_tokenizer("SentencePieceTokenizer", "", "", (dir / "missing.model").string(), 0), mt::Error);
  fs::remove_all(dir);
#endif
}

}  // namespace
}  // namespace mt::data
