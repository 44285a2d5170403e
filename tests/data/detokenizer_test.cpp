// The detokenizers of data/detokenizer.h.
//  * UTF-8 by construction: utf8_replace_invalid against Python's bytes.decode("utf-8",
//    errors="replace") for hand-worked byte strings (what Hugging Face's decoders give: truncated
//    characters, stray continuation bytes, overlong forms, surrogates, code points past U+10FFFF);
//    IncrementalDetokenizer on a byte-level BPE vocabulary with tokens that split characters (the
//    pieces hold a character back until its last byte arrives, and concatenate to the whole text
//    for random token sequences), on NullTokenizer, and on a SentencePiece model with byte fallback.
//  * The zero-shot evaluation detokenizers on WikiText-103 / Penn Treebank style lines, each rule
//    worked by hand: headings, number separators, punctuation spacing, brackets and quotes
//    tightened pairwise, the degree sign, " N ", possessives; an unmatched bracket or quote stays
//    as it is; the path picks the detokenizer as Megatron's get_detokenizer.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "data/data_test_util.h"
#include "data/detokenizer.h"
#include "data/gpt2_tokenizer.h"
#ifdef MT_WITH_SENTENCEPIECE
#include <sentencepiece_trainer.h>
#endif

namespace mt::data {
namespace {

const std::string kFffd = "\xEF\xBF\xBD";  // U+FFFD

// Python: bytes.decode("utf-8", errors="replace"), worked by hand (one U+FFFD per maximal subpart).
TEST(Utf8ReplaceInvalid, MatchesPythonErrorsReplace) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"\xE2\x82\xAC", "\xE2\x82\xAC"},                // U+20AC complete
      {"\xE2\x82", kFffd},                               // truncated 3-byte character: one U+FFFD
      {"\xE2\x82" "A", kFffd + "A"},                     // cut short by an ASCII byte
      {"\xFF", kFffd},                                    // never a start byte
      {"\xC0\x80", kFffd + kFffd},                        // C0 never starts; 80 alone
      {"\xED\xA0\x80", kFffd + kFffd + kFffd},           // a surrogate: ED allows 80..9F only
      {"\xF0\x9F\x98", kFffd},                           // truncated emoji
      {"\xF0\x9F\x98\x80", "\xF0\x9F\x98\x80"},          // U+1F600
      {"\xF4\x90\x80\x80", kFffd + kFffd + kFffd + kFffd},  // past U+10FFFF: F4 allows 80..8F
      {"\xE0\x80\x80", kFffd + kFffd + kFffd},           // overlong: E0 allows A0..BF
      {"\x80\x80", kFffd + kFffd},                        // stray continuation bytes
      {"a\xF0\x9F\x98" "b", "a" + kFffd + "b"},
      {"\xF8\x88\x80\x80\x80", kFffd + kFffd + kFffd + kFffd + kFffd},  // 5-byte forms do not exist
      {"\xE6\x97\xA5\xE6\x97", "\xE6\x97\xA5" + kFffd},   // U+65E5 then a truncated one
      {"\xF1\x80\x80\xE6\x97\xA5", kFffd + "\xE6\x97\xA5"},
      {std::string("\0z", 2), std::string("\0z", 2)},   // NUL is a character
      {"\xED\x9F\xBF", "\xED\x9F\xBF"},                // U+D7FF, last before the surrogates
      {"\xF4\x8F\xBF\xBF", "\xF4\x8F\xBF\xBF"},          // U+10FFFF
      {kFffd, kFffd},
      {"", ""},
  };
  for (const auto& [in, want] : cases) {
    EXPECT_EQ(utf8_replace_invalid(in), want) << testing::json_quote(in);
    EXPECT_EQ(utf8_first_invalid(in) == std::string::npos, in == want) << testing::json_quote(in);
  }
  EXPECT_EQ(utf8_first_invalid("ab\xE6\x97\xA5\xE6\x97"), 5u);
  EXPECT_EQ(utf8_first_invalid("ok \xC3\xA9"), std::string::npos);
  EXPECT_EQ(utf8_incomplete_tail("ab\xE6\x97"), 2u);
  EXPECT_EQ(utf8_incomplete_tail("ab\xF0\x9F\x98"), 3u);
  EXPECT_EQ(utf8_incomplete_tail("\xE6\x97\xA5"), 0u);
  EXPECT_EQ(utf8_incomplete_tail("\xE6" "A"), 0u);     // can never complete
  EXPECT_EQ(utf8_incomplete_tail("\xE0\x80"), 0u);     // overlong: can never complete
  EXPECT_EQ(utf8_incomplete_tail("x\xF0\x9F\x98\x80\xC3"), 1u);
}

// A byte-level BPE vocabulary whose merges build tokens that end or start inside a character.
class ByteLevelDetokenizer : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_tiny_vocab(dir_.path(), {{"\xE6", "\x97"},           // first 2 bytes of U+65E5
                                            {"\xA5", "\xE6"},           // last byte of U+65E5 + first of the next
                                            {"\xF0", "\x9F"},           // first half of an emoji
                                            {"\x98", "\x80"}});         // second half of U+1F600
    tok_ = std::make_unique<Gpt2Tokenizer>(Gpt2Tokenizer::from_files(dir_.file("vocab.json"), dir_.file("merges.txt")));
  }
  int32_t id(const std::string& bytes) const {
    const int32_t i = tok_->token_to_id(bytes);
    EXPECT_GE(i, 0) << testing::json_quote(bytes);
    return i;
  }
  testing::TempDir dir_;
  std::unique_ptr<Gpt2Tokenizer> tok_;
};

TEST_F(ByteLevelDetokenizer, HoldsBackSplitCharacters) {
  // U+65E5 U+65E5 U+1F600 as [E6 97] [A5 E6] [97] [A5] [F0 9F] [98 80] "!"
  const std::vector<int32_t> ids = {id("\xE6\x97"), id("\xA5\xE6"), id("\x97"), id("\xA5"),
                                    id("\xF0\x9F"), id("\x98\x80"), id("!")};
  IncrementalDetokenizer inc(*tok_);
  const std::vector<std::string> want = {"", "\xE6\x97\xA5", "", "\xE6\x97\xA5", "", "\xF0\x9F\x98\x80", "!"};
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(inc.push(ids[i]), want[i]) << "token " << i;
  EXPECT_EQ(inc.finish(), "");
  const DetokenizedText d = detokenize_pieces(*tok_, ids);
  EXPECT_EQ(d.text, "\xE6\x97\xA5\xE6\x97\xA5\xF0\x9F\x98\x80!");
  EXPECT_EQ(d.pieces, want);
}

TEST_F(ByteLevelDetokenizer, NeverCompletedBecomesReplacement) {
  // [E6 97] "A": the character can no longer complete -> U+FFFD "A" (Python: b"\xe6\x97A" -> "\ufffdA").
  IncrementalDetokenizer inc(*tok_);
  EXPECT_EQ(inc.push(id("\xE6\x97")), "");
  EXPECT_EQ(inc.push(id("A")), kFffd + "A");
  // A sequence ending inside a character: finish() gives one U+FFFD (b"\xf0\x9f" -> "\ufffd").
  EXPECT_EQ(inc.push(id("\xF0\x9F")), "");
  EXPECT_EQ(inc.finish(), kFffd);
  // Stray continuation bytes, an overlong start and a start past U+10FFFF, one U+FFFD each.
  const std::vector<int32_t> bad = {id("\x80"), id("\xC0"), id("\xAF"), id("\xF5"), id("z")};
  const DetokenizedText d = detokenize_pieces(*tok_, bad);
  EXPECT_EQ(d.text, kFffd + kFffd + kFffd + kFffd + "z");
  std::string joined;
  for (const auto& p : d.pieces) joined += p;
  EXPECT_EQ(joined, d.text);
  // A literal U+FFFD is held back only until the next token.
  IncrementalDetokenizer lit(*tok_);
  EXPECT_EQ(lit.push(id("\xEF")), "");
  EXPECT_EQ(lit.push(id("\xBF")), "");
  EXPECT_EQ(lit.push(id("\xBD")), "");
  EXPECT_EQ(lit.push(id("a")), kFffd + "a");
}

// Random token sequences (random bytes, and merges that split characters): the pieces are valid
// UTF-8 and concatenate to the text Hugging Face's decode(errors="replace") gives for the bytes.
TEST_F(ByteLevelDetokenizer, RandomSequencesConcatenateToTheWholeText) {
  std::mt19937 rng(2026);
  // Bytes weighted towards UTF-8 starts and continuations, so characters complete often.
  std::vector<int32_t> pool;
  for (int b = 0; b < 256; ++b) pool.push_back(b);
  for (const char* t : {"\xE6\x97", "\xA5\xE6", "\xF0\x9F", "\x98\x80"}) pool.push_back(id(t));
  for (int b : {0xE6, 0x97, 0xA5, 0xF0, 0x9F, 0x98, 0x80, 0xC3, 0xA9, 0xD0, 0xBF}) pool.insert(pool.end(), 6, b);
  for (int trial = 0; trial < 400; ++trial) {
    std::vector<int32_t> ids(1 + rng() % 24);
    for (auto& i : ids) i = pool[rng() % pool.size()];
    const DetokenizedText d = detokenize_pieces(*tok_, ids);
    ASSERT_EQ(d.text, utf8_replace_invalid(tok_->decode(ids)));
    std::string joined;
    for (const auto& p : d.pieces) {
      ASSERT_EQ(utf8_first_invalid(p), std::string::npos) << testing::json_quote(p);
      joined += p;
    }
    ASSERT_EQ(joined, d.text) << "trial " << trial;
    ASSERT_EQ(d.pieces.size(), ids.size());
  }
}

TEST(IncrementalDetokenizer, NullTokenizerJoinsWithSpaces) {
  NullTokenizer tok(64);
  const DetokenizedText d = detokenize_pieces(tok, std::vector<int32_t>{5, 9, 2, 17, 3, 41, 8});
  EXPECT_EQ(d.text, "5 9 2 17 3 41 8");
  EXPECT_EQ(d.pieces, (std::vector<std::string>{"5", " 9", " 2", " 17", " 3", " 41", " 8"}));
  EXPECT_TRUE(detokenize_pieces(tok, std::vector<int32_t>{}).pieces.empty());
}

// SentencePiece with byte fallback: a character the model lacks is encoded as its UTF-8 bytes
// (<0xE6> <0x97> <0xA5>); its decoder gives U+FFFD for a partial character, which the detokenizer
// holds back until the character completes.
TEST(IncrementalDetokenizer, SentencePieceByteFallback) {
#ifndef MT_WITH_SENTENCEPIECE
  GTEST_SKIP() << "built without libsentencepiece";
#else
  testing::TempDir dir;
  {
    std::ofstream f(dir.file("corpus.txt"));
    for (int r = 0; r < 40; ++r) f << "Call me Ishmael. Some years ago, never mind how long precisely.\n";
  }
  const auto st = sentencepiece::SentencePieceTrainer::Train("--input=" + dir.file("corpus.txt") + " --model_prefix=" +
                                                            dir.file("m") + " --vocab_size=300 --model_type=bpe "
                                                            "--byte_fallback=true --minloglevel=2");
  ASSERT_TRUE(st.ok()) << st.ToString();
  auto tok = make_tokenizer("SentencePieceTokenizer", "", "", dir.file("m.model"), 0);
  for (const std::string text : {"Call me \xE6\x97\xA5\xE6\x9C\xAC Ishmael", "never \xF0\x9F\x98\x80 mind",
                                 "\xD0\xBF\xD1\x80\xD0\xB8 long"}) {
    const std::vector<int32_t> ids = tok->encode(text);
    ASSERT_GT(ids.size(), 6u);
    const DetokenizedText d = detokenize_pieces(*tok, ids);
    EXPECT_EQ(d.text, text);
    std::string joined;
    for (const auto& p : d.pieces) {
      EXPECT_EQ(p.find(kFffd), std::string::npos) << "a partial character was emitted: " << testing::json_quote(p);
      joined += p;
    }
    EXPECT_EQ(joined, text);
    // Every prefix, also those that end inside a character (SentencePiece decodes those bytes
    // to U+FFFD): valid UTF-8, pieces that concatenate to the decoded text.
    for (size_t k = 1; k <= ids.size(); ++k) {
      const std::vector<int32_t> head(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k));
      const DetokenizedText h = detokenize_pieces(*tok, head);
      EXPECT_EQ(h.text, tok->decode(head));
      std::string all;
      for (const auto& p : h.pieces) all += p;
      EXPECT_EQ(all, h.text) << k << " tokens of " << testing::json_quote(text);
      EXPECT_EQ(utf8_first_invalid(all), std::string::npos);
    }
  }
#endif
}

TEST(WikitextDetokenizer, HeadingsAndNumberSeparators) {
  EXPECT_EQ(wikitext_detokenize(" = Valkyria Chronicles III = \n"), " = Valkyria Chronicles III =\n");
  EXPECT_EQ(wikitext_detokenize(" = = Gameplay = = \n"), " == Gameplay ==\n");
  EXPECT_EQ(wikitext_detokenize(" = = = = Sub = = = = \n"), " ==== Sub ====\n");
  EXPECT_EQ(wikitext_detokenize(" The game 's 1 @,@ 000 units sold in 2 @.@ 5 days ; it was well @-@ received . \n"),
            " The game's 1,000 units sold in 2.5 days; it was well-received.\n");
}

TEST(WikitextDetokenizer, PunctuationBracketsAndQuotes) {
  EXPECT_EQ(wikitext_detokenize(" He said \" hello world \" and ( in brackets ) , [ one ] { two } ! Really ? Yes : no . \n"),
            " He said \"hello world\" and (in brackets), [one] {two}! Really? Yes: no.\n");
  // each opening character pairs with the next closing one; "( )" empties
  EXPECT_EQ(wikitext_detokenize("a ( b ( c ) d ) e (  )"), "a (b ( c) d ) e ()");
  EXPECT_EQ(wikitext_detokenize("x ' y ' z ' w"), "x 'y' z ' w");
  // no closing character: unchanged
  EXPECT_EQ(wikitext_detokenize(" odd ( open without close and a ' lone quote \n"),
            " odd ( open without close and a ' lone quote\n");
}

TEST(WikitextDetokenizer, DegreesNumbersPossessives) {
  EXPECT_EQ(wikitext_detokenize(" the players ' scores were 12 \xC2\xB0 C . The N value \n"),
            " the players' scores were 12\xC2\xB0" "C. The 1 value\n");
  EXPECT_EQ(wikitext_detokenize("\n line\n"), "\nline\n");
  EXPECT_EQ(wikitext_detokenize(" path /' 5/ end"), " path /'[0-9]/ end");  // Megatron's literal pattern
  EXPECT_EQ(wikitext_detokenize(""), "");
}

TEST(PtbDetokenizer, Rules) {
  EXPECT_EQ(ptb_detokenize("it does n't cost $ 1 or # 1 , the N rule 's \n next"),
            "it doesn't cost $1 or #1 , the1 rule's\nnext");
}

TEST(Detokenizer, ChosenByThePath) {
  EXPECT_STREQ(detokenizer_for("/data/wikitext-103/wiki.test.tokens"), "wikitext");
  EXPECT_STREQ(detokenizer_for("ptb.test.txt"), "ptb");
  EXPECT_STREQ(detokenizer_for("lambada_test.jsonl"), "lambada");
  EXPECT_STREQ(detokenizer_for("my_text.txt"), "");
  EXPECT_STREQ(detokenizer_for("ptb_wiki.txt"), "ptb");  // the first key found, in Megatron's order
  EXPECT_EQ(detokenize_for("wiki.txt", "a @-@ b"), "a-b");
  EXPECT_EQ(detokenize_for("plain.txt", "a @-@ b"), "a @-@ b");
  EXPECT_EQ(detokenize_for("lambada.jsonl", "a @-@ b"), "a @-@ b");
}

}  // namespace
}  // namespace mt::data
