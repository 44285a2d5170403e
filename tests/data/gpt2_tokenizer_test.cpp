// GPT-2 byte-level BPE tokenizer: pre-tokenizer splits (expected values from Python's `regex` module
// with GPT-2's pattern), BPE against a naive transcription of encoder.py's bpe(), byte-level round
// trips of arbitrary bytes, error messages, and (when tools/fetch_demo_data.sh has been run) the real
// GPT-2 files against encodings computed with OpenAI's reference algorithm.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <thread>

#include "data/gpt2_tokenizer.h"
#include "data/unicode.h"
#include "data_test_util.h"
#include "testing/testing.h"

namespace mt::data {
namespace {

using testing::expect_error;
using testing::TempDir;
using testing::write_file;
using testing::write_tiny_vocab;

// ---------------------------------------------------------------------------------------------------
// Pre-tokenizer
// ---------------------------------------------------------------------------------------------------

struct PretokCase {
  std::string text;
  std::vector<std::string> pieces;
};

// Generated with Python 3.11 + regex 2022.10.31: regex.findall(GPT-2 pattern, text). Non-ASCII bytes
// and control characters are written as octal escapes.
const std::vector<PretokCase>& pretok_cases() {
  static const std::vector<PretokCase> cases = {
#include "pretokenize_cases.inc"
  };
  return cases;
}

TEST(Gpt2Pretokenize, MatchesPythonRegex) {
  for (const auto& c : pretok_cases()) {
    std::vector<std::string> got;
    for (auto p : Gpt2Tokenizer::pretokenize(c.text)) got.emplace_back(p);
    EXPECT_EQ(got, c.pieces) << "text: " << c.text;
  }
}

TEST(Gpt2Pretokenize, BriefExample) {
  std::vector<std::string> got;
  for (auto p : Gpt2Tokenizer::pretokenize("Hello world's  test\n\n123 ok")) got.emplace_back(p);
  EXPECT_EQ(got, (std::vector<std::string>{"Hello", " world", "'s", " ", " test", "\n", "\n", "123", " ok"}));
}

TEST(Gpt2Pretokenize, InvalidBytesAreOther) {
  auto split = [](std::string_view s) {
    std::vector<std::string> v;
    for (auto p : Gpt2Tokenizer::pretokenize(s)) v.emplace_back(p);
    return v;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(split("a\xff" "b"), (V{"a", "\xff", "b"}));
  EXPECT_EQ(split(" \xff\xfe!x"), (V{" \xff\xfe!", "x"}));            // space + run of "other"
  EXPECT_EQ(split("x\xe2\x82"), (V{"x", "\xe2\x82"}));                  // truncated 3-byte sequence
  EXPECT_EQ(split("\xed\xa0\x80" "a"), (V{"\xed\xa0\x80", "a"}));       // encoded surrogate: 3 invalid bytes
  EXPECT_EQ(split("\xc0\xaf" "1"), (V{"\xc0\xaf", "1"}));               // overlong '/'
  EXPECT_EQ(split("\xc3\xa9\xc3"), (V{"\xc3\xa9", "\xc3"}));            // é then a lone lead byte
  EXPECT_EQ(split("\xf4\x90\x80\x80"), (V{"\xf4\x90\x80\x80"}));        // > U+10FFFF
  EXPECT_EQ(split("ab \x80\x80  "), (V{"ab", " \x80\x80", "  "}));
}

TEST(Unicode, ClassesAndDecoding) {
  EXPECT_TRUE(is_letter(U'a'));
  EXPECT_TRUE(is_letter(U'\u00e9'));
  EXPECT_TRUE(is_letter(U'\u6771'));
  EXPECT_FALSE(is_letter(U'\u0301'));  // combining mark (Mn)
  EXPECT_TRUE(is_number(U'7'));
  EXPECT_TRUE(is_number(U'\u00bd'));   // No
  EXPECT_TRUE(is_number(U'\u2167'));   // Nl
  EXPECT_TRUE(is_whitespace(U'\u3000'));
  EXPECT_TRUE(is_whitespace(U'\u0085'));
  EXPECT_FALSE(is_whitespace(U'\u001c'));  // str.isspace() but not White_Space / regex \s
  EXPECT_FALSE(is_whitespace(U'\u200b'));
  EXPECT_EQ(char_class(kInvalidCodepoint), CharClass::kOther);
  EXPECT_STRNE(unicode_version(), "");
  char32_t cp;
  EXPECT_EQ(utf8_decode("\xf0\x9f\x91\x8d", 0, &cp), 4u);
  EXPECT_EQ(cp, U'\U0001F44D');
  EXPECT_EQ(utf8_decode("\xe0\x80\x80", 0, &cp), 1u);  // overlong
  EXPECT_EQ(cp, kInvalidCodepoint);
}

// ---------------------------------------------------------------------------------------------------
// BPE on a tiny vocabulary
// ---------------------------------------------------------------------------------------------------

// encoder.py's bpe() on raw byte strings: returns the final symbols.
std::vector<std::string> reference_bpe(const std::string& word,
                                       const std::map<std::pair<std::string, std::string>, int>& ranks) {
  std::vector<std::string> w;
  for (char c : word) w.emplace_back(1, c);
  while (w.size() > 1) {
    int best = -1;
    std::pair<std::string, std::string> bigram;
    for (size_t i = 0; i + 1 < w.size(); ++i) {
      auto it = ranks.find({w[i], w[i + 1]});
      if (it != ranks.end() && (best < 0 || it->second < best)) {
        best = it->second;
        bigram = it->first;
      }
    }
    if (best < 0) break;
    std::vector<std::string> nw;
    for (size_t i = 0; i < w.size();) {
      if (i + 1 < w.size() && w[i] == bigram.first && w[i + 1] == bigram.second) {
        nw.push_back(w[i] + w[i + 1]);
        i += 2;
      } else {
        nw.push_back(w[i]);
        i += 1;
      }
    }
    w = std::move(nw);
  }
  return w;
}

std::vector<int32_t> ids_of(const std::vector<std::string>& toks, const std::vector<std::string>& vocab) {
  std::vector<int32_t> ids;
  for (const auto& t : toks) {
    ids.push_back(static_cast<int32_t>(std::find(vocab.begin(), vocab.end(), t) - vocab.begin()));
  }
  return ids;
}

TEST(Gpt2Bpe, MergeOrderByRank) {
  TempDir dir;
  {  // "b c" ranks before "a b": abc -> a | bc
    auto vocab = write_tiny_vocab(dir.path(), {{"b", "c"}, {"a", "b"}});
    auto tok = Gpt2Tokenizer::from_files(dir.file("vocab.json"), dir.file("merges.txt"));
    EXPECT_EQ(tok.encode("abc"), ids_of({"a", "bc"}, vocab));
    EXPECT_EQ(tok.num_merges(), 2);
    EXPECT_EQ(tok.vocab_size(), 256 + 2 + 1);
  }
  {  // reversed: abc -> ab | c
    auto vocab = write_tiny_vocab(dir.path(), {{"a", "b"}, {"b", "c"}});
    auto tok = Gpt2Tokenizer::from_files(dir.file("vocab.json"), dir.file("merges.txt"));
    EXPECT_EQ(tok.encode("abc"), ids_of({"ab", "c"}, vocab));
  }
  {  // all occurrences of the best pair, left to right, non-overlapping
    auto vocab = write_tiny_vocab(dir.path(), {{"a", "a"}, {"aa", "aa"}});
    auto tok = Gpt2Tokenizer::from_files(dir.file("vocab.json"), dir.file("merges.txt"));
    EXPECT_EQ(tok.encode("aaa"), ids_of({"aa", "a"}, vocab));
    EXPECT_EQ(tok.encode("aaaa"), ids_of({"aaaa"}, vocab));
    EXPECT_EQ(tok.encode("aaaaaaa"), ids_of({"aaaa", "aa", "a"}, vocab));
    EXPECT_EQ(tok.eod(), static_cast<int32_t>(vocab.size()) - 1);
  }
  {  // merges including the space byte: " hello" is one piece
    auto vocab = write_tiny_vocab(dir.path(), {{" ", "h"}, {"l", "l"}, {" h", "e"}, {" he", "ll"}, {"ll", "o"}});
    auto tok = Gpt2Tokenizer::from_files(dir.file("vocab.json"), dir.file("merges.txt"));
    EXPECT_EQ(tok.encode(" hello"), ids_of({" hell", "o"}, vocab));
    EXPECT_EQ(tok.encode("hello"), ids_of({"h", "e", "llo"}, vocab));
    EXPECT_EQ(tok.decode(tok.encode(" hello hello")), " hello hello");
    EXPECT_EQ(tok.token_to_id(" hell"), ids_of({" hell"}, vocab)[0]);
    EXPECT_EQ(tok.token_to_id("nope"), -1);
  }
}

// Random merge tables (also in non-topological order) against the reference, on random words.
TEST(Gpt2Bpe, MatchesReferenceOnRandomMerges) {
  auto& rng = mt::testing::test_rng();
  TempDir dir;
  const std::string alphabet = "abcd";
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<std::string> toks;
    for (char c : alphabet) toks.emplace_back(1, c);
    std::vector<std::pair<std::string, std::string>> merges;
    std::set<std::pair<std::string, std::string>> seen;
    const int num_merges = 5 + static_cast<int>(rng() % 40);
    while (static_cast<int>(merges.size()) < num_merges) {
      const auto& a = toks[rng() % toks.size()];
      const auto& b = toks[rng() % toks.size()];
      if (a.size() + b.size() > 8 || !seen.insert({a, b}).second) continue;
      merges.push_back({a, b});
      if (std::find(toks.begin(), toks.end(), a + b) == toks.end()) toks.push_back(a + b);
    }
    if (trial % 2 == 1) std::shuffle(merges.begin(), merges.end(), rng);  // ranks not topological
    auto vocab = write_tiny_vocab(dir.path(), merges);
    std::map<std::pair<std::string, std::string>, int> ranks;
    for (size_t r = 0; r < merges.size(); ++r) ranks.emplace(merges[r], static_cast<int>(r));
    auto tok = Gpt2Tokenizer::from_files(dir.file("vocab.json"), dir.file("merges.txt"));
    for (int w = 0; w < 200; ++w) {
      std::string word;
      const int len = 1 + static_cast<int>(rng() % 24);
      for (int k = 0; k < len; ++k) word.push_back(alphabet[rng() % alphabet.size()]);
      ASSERT_EQ(tok.encode(word), ids_of(reference_bpe(word, ranks), vocab)) << "word " << word << " trial " << trial;
    }
  }
}

// Random strings from many Unicode classes plus invalid bytes: pieces concatenate to the text, and
// decode(encode(x)) == x with a tiny vocabulary.
std::string random_text(std::mt19937_64& rng, int units) {
  static const std::vector<std::string> pieces = {
      "a", "Z", "q", " ", " ", "  ", "\n", "\t", "\r\n", "'", "'s", "'ll", "7", "42", ".", ",", "!?",
      "\xc3\xa9",                 // é
      "e\xcc\x81",                // e + combining acute
      "\xe6\x9d\xb1\xe4\xba\xac",  // 東京
      "\xf0\x9f\x91\x8d",         // 👍
      "\xf0\x9f\x8f\xbd",         // skin tone modifier
      "\xe2\x80\xa8",             // line separator
      "\xc2\xa0",                 // no-break space
      "\xe3\x80\x80",             // ideographic space
      "\xd9\xa3",                 // Arabic-indic digit three
      "\xc2\xbd",                 // ½
      "\x1c",                     // file separator (other)
      "\xff", "\x80", "\xc3", "\xe2\x82", "\xed\xa0\x80", "\xc0\xaf", "\xf4\x90\x80\x80",  // invalid
  };
  std::string s;
  for (int k = 0; k < units; ++k) {
    if (rng() % 8 == 0) {
      s.push_back(static_cast<char>(rng() & 0xFF));  // any byte
    } else {
      s += pieces[rng() % pieces.size()];
    }
  }
  return s;
}

TEST(Gpt2Bpe, ByteLevelRoundTripOfArbitraryText) {
  auto& rng = mt::testing::test_rng();
  TempDir dir;
  write_tiny_vocab(dir.path(), {{"a", "Z"}, {" ", "a"}, {"\xc3", "\xa9"}, {"\xf0", "\x9f"}, {"\n", "\n"}});
  auto tok = Gpt2Tokenizer::from_files(dir.file("vocab.json"), dir.file("merges.txt"));
  for (int t = 0; t < 300; ++t) {
    const std::string text = random_text(rng, 1 + static_cast<int>(rng() % 60));
    std::string joined;
    for (auto p : Gpt2Tokenizer::pretokenize(text)) {
      ASSERT_FALSE(p.empty());
      joined += p;
    }
    ASSERT_EQ(joined, text);
    const auto ids = tok.encode(text);
    ASSERT_EQ(tok.decode(ids), text);
    std::string by_token;
    for (int32_t id : ids) by_token += tok.decode_token(id);
    ASSERT_EQ(by_token, text);
  }
  EXPECT_TRUE(tok.encode("").empty());
  EXPECT_EQ(tok.decode(std::vector<int32_t>{}), "");
}

TEST(Gpt2Bpe, ConcurrentEncodeIsConsistent) {
  auto& rng = mt::testing::test_rng();
  TempDir dir;
  write_tiny_vocab(dir.path(), {{"a", "Z"}, {" ", "a"}, {"aZ", "aZ"}, {"q", "q"}});
  auto tok = Gpt2Tokenizer::from_files(dir.file("vocab.json"), dir.file("merges.txt"));
  std::vector<std::string> texts;
  for (int i = 0; i < 64; ++i) texts.push_back(random_text(rng, 200));
  std::vector<std::vector<int32_t>> expected;
  for (const auto& t : texts) expected.push_back(tok.encode(t));
  std::vector<int> ok(4, 1);
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      for (int rep = 0; rep < 5; ++rep) {
        for (size_t i = 0; i < texts.size(); ++i) {
          if (tok.encode(texts[(i + w) % texts.size()]) != expected[(i + w) % texts.size()]) ok[w] = 0;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok, std::vector<int>(4, 1));
}

// ---------------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------------

TEST(Gpt2Errors, FilesAndFormats) {
  TempDir dir;
  write_tiny_vocab(dir.path(), {{"a", "b"}});
  const std::string vocab = dir.file("vocab.json"), merges = dir.file("merges.txt");
  expect_error([&] { Gpt2Tokenizer::from_files(dir.file("missing.json"), merges); }, {"missing.json", "cannot open"});
  expect_error([&] { Gpt2Tokenizer::from_files(vocab, dir.file("missing.txt")); }, {"missing.txt"});

  write_file(dir.file("bad.json"), "{\"a\": 0, ");
  expect_error([&] { Gpt2Tokenizer::from_files(dir.file("bad.json"), merges); }, {"bad.json", "malformed JSON"});
  write_file(dir.file("array.json"), "[1, 2]");
  expect_error([&] { Gpt2Tokenizer::from_files(dir.file("array.json"), merges); }, {"array.json", "object"});
  write_file(dir.file("noint.json"), "{\"a\": \"x\"}");
  expect_error([&] { Gpt2Tokenizer::from_files(dir.file("noint.json"), merges); }, {"noint.json", "non-integer"});
  write_file(dir.file("gap.json"), "{\"a\": 0, \"b\": 5}");
  expect_error([&] { Gpt2Tokenizer::from_files(dir.file("gap.json"), merges); }, {"gap.json", "id 5"});
  write_file(dir.file("few.json"), "{\"a\": 0, \"b\": 1}");
  expect_error([&] { Gpt2Tokenizer::from_files(dir.file("few.json"), merges); }, {"few.json", "byte 0x00"});
  write_file(dir.file("alpha.json"), "{\"\xe6\x9d\xb1\": 0}");  // 東 is not a byte-level symbol
  expect_error([&] { Gpt2Tokenizer::from_files(dir.file("alpha.json"), merges); }, {"alpha.json", "alphabet"});

  write_file(dir.file("m1.txt"), "#version: 0.2\na b\nabc\n");
  expect_error([&] { Gpt2Tokenizer::from_files(vocab, dir.file("m1.txt")); }, {"m1.txt", "line 3", "two tokens"});
  write_file(dir.file("m2.txt"), "a b c\n");
  expect_error([&] { Gpt2Tokenizer::from_files(vocab, dir.file("m2.txt")); }, {"m2.txt", "line 1"});
  write_file(dir.file("m3.txt"), "#version: 0.2\nx y\n");  // "xy" is not in the vocabulary
  expect_error([&] { Gpt2Tokenizer::from_files(vocab, dir.file("m3.txt")); }, {"m3.txt", "line 2", "not in the vocabulary"});
  // CRLF line ends and a missing #version line are fine.
  write_file(dir.file("m4.txt"), "a b\r\n");
  EXPECT_EQ(Gpt2Tokenizer::from_files(vocab, dir.file("m4.txt")).num_merges(), 1);
}

TEST(Gpt2Errors, DecodeOutOfRange) {
  TempDir dir;
  write_tiny_vocab(dir.path(), {{"a", "b"}});
  auto tok = Gpt2Tokenizer::from_files(dir.file("vocab.json"), dir.file("merges.txt"));
  const int64_t v = tok.vocab_size();
  expect_error([&] { tok.decode(std::vector<int32_t>{1, static_cast<int32_t>(v)}); },
               {std::to_string(v), "vocab size " + std::to_string(v)});
  expect_error([&] { tok.decode_token(-1); }, {"-1", std::to_string(v)});
}

TEST(Gpt2Errors, NoEndOfText) {
  TempDir dir;
  std::string json = "{";
  for (int b = 0; b < 256; ++b) {
    json += (b ? ", " : "") + testing::json_quote(testing::byte_level(std::string(1, static_cast<char>(b)))) + ": " +
            std::to_string(b);
  }
  write_file(dir.file("v.json"), json + "}");
  write_file(dir.file("m.txt"), "#version: 0.2\n");
  auto tok = Gpt2Tokenizer::from_files(dir.file("v.json"), dir.file("m.txt"));
  EXPECT_EQ(tok.vocab_size(), 256);
  expect_error([&] { tok.eod(); }, {"<|endoftext|>"});
}

// ---------------------------------------------------------------------------------------------------
// Real GPT-2 files (tools/fetch_demo_data.sh); skipped when absent.
// ---------------------------------------------------------------------------------------------------

class Gpt2Real : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string dir = testing::demo_data_dir();
    if (is_file(dir + "/gpt2/encoder.json") && is_file(dir + "/gpt2/vocab.bpe")) {
      tok_ = new Gpt2Tokenizer(Gpt2Tokenizer::from_files(dir + "/gpt2/encoder.json", dir + "/gpt2/vocab.bpe"));
    }
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override {
    if (tok_ == nullptr) GTEST_SKIP() << "GPT-2 files not found in " << testing::demo_data_dir() << "/gpt2 (run tools/fetch_demo_data.sh)";
  }
  static bool is_file(const std::string& p) { return std::filesystem::is_regular_file(p); }
  static Gpt2Tokenizer* tok_;
};
Gpt2Tokenizer* Gpt2Real::tok_ = nullptr;

uint64_t fnv1a(const std::vector<int32_t>& ids) {
  uint64_t h = 14695981039346656037ull;
  for (int32_t id : ids) h = (h ^ static_cast<uint64_t>(id)) * 1099511628211ull;
  return h;
}

TEST_F(Gpt2Real, KnownEncodings) {
  EXPECT_EQ(tok_->vocab_size(), 50257);
  EXPECT_EQ(tok_->num_merges(), 50000);
  EXPECT_EQ(tok_->eod(), 50256);
  EXPECT_EQ(tok_->decode_token(50256), "<|endoftext|>");
  // Expected ids from OpenAI's encoder.py algorithm (Python + regex) on these files.
  const std::vector<std::pair<std::string, std::vector<int32_t>>> cases = {
      {"Hello world", {15496, 995}},
      {" Hello", {18435}},
      {"Hello", {15496}},
      {"hello world", {31373, 995}},
      {"<|endoftext|>", {27, 91, 437, 1659, 5239, 91, 29}},  // plain text, not the special token
      {"Hello world's  test\n\n123 ok", {15496, 995, 338, 220, 1332, 198, 198, 10163, 12876}},
      {"The quick brown fox jumps over the lazy dog.", {464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13}},
      {"na\303\257ve caf\303\251 \346\235\261\344\272\254 123\357\274\224\357\274\225",
       {2616, 38776, 40304, 10545, 251, 109, 12859, 105, 17031, 171, 120, 242, 171, 120, 243}},
      {"\360\237\221\215\360\237\217\275 emoji\314\201!", {41840, 235, 8582, 237, 121, 44805, 136, 223, 0}},
      {"  multiple   spaces\012\012\012and\011tabs", {220, 3294, 220, 220, 9029, 628, 198, 392, 197, 8658, 82}},
      {"It's 3.14159 o'clock, isn't it?", {1026, 338, 513, 13, 1415, 19707, 267, 6, 15750, 11, 2125, 470, 340, 30}},
      {"\304\240", {128, 254}},
  };
  for (const auto& [text, ids] : cases) {
    EXPECT_EQ(tok_->encode(text), ids) << text;
    EXPECT_EQ(tok_->decode(ids), text);
  }
}

TEST_F(Gpt2Real, MobyDickMatchesReference) {
  const std::string path = testing::demo_data_dir() + "/moby-dick/data.txt";
  if (!is_file(path)) GTEST_SKIP() << path << " not found";
  const std::string text = testing::read_file(path);
  ASSERT_EQ(text.size(), 1204997u);
  const auto ids = tok_->encode(text);
  // Reference: OpenAI's algorithm (Python + regex) on the same file: 317756 tokens, FNV-1a below.
  EXPECT_EQ(ids.size(), 317756u);
  EXPECT_EQ(fnv1a(ids), 0xa11b5d12787588cdull);
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + 12),
            (std::vector<int32_t>{41481, 352, 13, 406, 4207, 654, 13, 198, 198, 14134, 502, 1148}));
  EXPECT_EQ(tok_->decode(ids), text);
  const std::string paragraph = text.substr(text.find("Call me Ishmael"), 2000);
  EXPECT_EQ(tok_->decode(tok_->encode(paragraph)), paragraph);
}

TEST_F(Gpt2Real, SotuMatchesReference) {
  const std::string path = testing::demo_data_dir() + "/sotu/1790_george_washington_n.txt";
  if (!is_file(path)) GTEST_SKIP() << path << " not found";
  const auto ids = tok_->encode(testing::read_file(path));
  EXPECT_EQ(ids.size(), 1571u);
  EXPECT_EQ(fnv1a(ids), 0xed881bc30385d498ull);
}

TEST_F(Gpt2Real, RandomBytesRoundTrip) {
  auto& rng = mt::testing::test_rng();
  for (int t = 0; t < 200; ++t) {
    const std::string text = random_text(rng, 1 + static_cast<int>(rng() % 80));
    ASSERT_EQ(tok_->decode(tok_->encode(text)), text);
  }
}

}  // namespace
}  // namespace mt::data
