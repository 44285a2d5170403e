// TikTokenizer (data/tiktoken_tokenizer.h): BPE by ranks worked out by hand on a tiny vocabulary,
// Megatron's special-token layout, both vocabulary file formats, the v1 / v2 pre-tokenizer patterns
// against the pieces Python's `regex` module gives for Megatron's pattern strings
// (tests/data/fixtures/tiktoken_ref/pieces.json), a round trip of a text corpus (non-ASCII, emoji,
// CJK, combining marks), and, once made, the token ids of the tiktoken package for the same
// vocabulary and texts (ids.json). The fixture's inputs (vocab.json: a vocabulary trained here by
// BPE on the texts; texts.json) are written by this test with MT_WRITE_TIKTOKEN_FIXTURES=1 and
// kept in the repository; tools/tiktoken_ref.py makes pieces.json (needs `regex`) and ids.json
// (the tiktoken package, or its pure-Python reference BPE: `ids --educational
// tiktoken/_educational.py`, which made the committed ids.json from openai/tiktoken 4e71bbe).
#include "data/tiktoken_tokenizer.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "data/detokenizer.h"
#include "megatron_ref_util.h"

namespace mt::data {
namespace {

using testing::expect_error;

std::string fixture(const std::string& name) {
  return testing::source_dir() + "/tests/data/fixtures/tiktoken_ref/" + name;
}

std::string base64(const std::string& s) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (unsigned char c : s) {
    acc = (acc << 8) | c;
    bits += 8;
    while (bits >= 6) out += k[(acc >> (bits -= 6)) & 63];
  }
  if (bits > 0) out += k[(acc << (6 - bits)) & 63];
  while (out.size() % 4) out += '=';
  return out;
}

std::vector<std::string> bytes_and(const std::vector<std::string>& merged) {
  std::vector<std::string> t;
  for (int b = 0; b < 256; ++b) t.emplace_back(1, static_cast<char>(b));
  t.insert(t.end(), merged.begin(), merged.end());
  return t;
}

// 7 specials + 3 fillers, the bytes at 10..265, the merged tokens from 266.
TikTokenOptions tiny_options(int64_t merged) {
  TikTokenOptions o;
  o.num_special_tokens = 10;
  o.vocab_size = 10 + 256 + merged;
  return o;
}

TEST(TikTokenizer, BytePairMergeByRanksWorkedByHand) {
  // ranks 256 "ab", 257 "bc", 258 "abc" (ids + 10)
  const TikTokenizer t = TikTokenizer::from_ranks(bytes_and({"ab", "bc", "abc"}), tiny_options(3));
  const int32_t ab = 266, bc = 267, abc = 268;
  const auto byte = [](char c) { return static_cast<int32_t>(static_cast<unsigned char>(c)) + 10; };
  // "abcd": pairs ab 256, bc 257, cd -: merge ab -> [ab c d]; abc 258 -> [abc d]; abcd -: done.
  EXPECT_EQ(t.encode_piece("abcd"), (std::vector<int32_t>{abc, byte('d')}));
  // "bcab": bc 257, ca -, ab 256: the lowest rank first (not the leftmost pair): [b c ab]; then
  // bc 257 -> [bc ab]; "bcab" has no rank.
  EXPECT_EQ(t.encode_piece("bcab"), (std::vector<int32_t>{bc, ab}));
  // "abab": ab at 0 and at 2 tie: the leftmost merges first, then the other: [ab ab].
  EXPECT_EQ(t.encode_piece("abab"), (std::vector<int32_t>{ab, ab}));
  // a piece that is a token is that token
  EXPECT_EQ(t.encode_piece("abc"), (std::vector<int32_t>{abc}));
  EXPECT_EQ(t.encode_piece("x"), (std::vector<int32_t>{byte('x')}));
  // through the pre-tokenizer (v2): "abcd bcab" -> "abcd", " bcab" (' ' stays a byte: " b" has no rank)
  EXPECT_EQ(t.encode("abcd bcab"), (std::vector<int32_t>{abc, byte('d'), byte(' '), bc, ab}));
  EXPECT_EQ(t.decode(t.encode("abcd bcab")), "abcd bcab");
}

TEST(TikTokenizer, MegatronsSpecialTokenLayout) {
  const TikTokenizer t = TikTokenizer::from_ranks(bytes_and({"ab"}), tiny_options(1));
  EXPECT_EQ(t.vocab_size(), 267);
  EXPECT_EQ(t.eod(), 2);  // "</s>"
  const std::vector<int32_t> specials = {0, 1, 2, 3, 4, 5, 6, 7, 9};
  EXPECT_EQ(t.decode(specials), "<unk><s></s><mask><pad><cls><sep><SPECIAL_7><SPECIAL_9>");
  // special tokens in the text are encoded as their ids (allowed_special="all")
  EXPECT_EQ(t.encode("<s>ab</s>"), (std::vector<int32_t>{1, 266, 2}));
  EXPECT_EQ(t.encode("a<SPECIAL_8>"), (std::vector<int32_t>{'a' + 10, 8}));
  EXPECT_EQ(t.encode("<s<s>>"), (std::vector<int32_t>{'<' + 10, 's' + 10, 1, '>' + 10}));
  // a custom list (Megatron's seven in another order plus one of its own)
  TikTokenOptions o = tiny_options(1);
  o.special_tokens = {"<s>", "</s>", "<|tool|>", "<unk>", "<mask>", "<pad>", "<cls>", "<sep>"};
  const TikTokenizer c = TikTokenizer::from_ranks(bytes_and({"ab"}), o);
  EXPECT_EQ(c.eod(), 1);
  EXPECT_EQ(c.encode("x<|tool|>"), (std::vector<int32_t>{'x' + 10, 2}));
  EXPECT_EQ(c.decode(std::vector<int32_t>{8, 9}), "<SPECIAL_8><SPECIAL_9>");
}

TEST(TikTokenizer, BadInputIsAnError) {
  const auto make = [](TikTokenOptions o, std::vector<std::string> t = bytes_and({"ab"})) {
    return TikTokenizer::from_ranks(std::move(t), o);
  };
  TikTokenOptions o = tiny_options(1);
  o.pattern = "v3";
  expect_error([&] { make(o); }, {"--tiktoken-pattern: expected v1 or v2, got 'v3'"});
  o = tiny_options(1);
  o.special_tokens = {"<s>", "</s>"};
  expect_error([&] { make(o); }, {"must include Megatron's", "missing '<unk>'"});
  o.special_tokens = {"<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<s>"};
  expect_error([&] { make(o); }, {"'<s>' is given twice"});
  o = tiny_options(1);
  o.num_special_tokens = 5;
  expect_error([&] { make(o); }, {"7 special tokens <= --tiktoken-num-special-tokens 5"});
  o = tiny_options(1);
  o.vocab_size = 300;
  expect_error([&] { make(o); }, {"has 257 ranks", "needs 290", "--vocab-size 267"});
  std::vector<std::string> no_a = bytes_and({"ab"});
  no_a['a'] = "zz";
  expect_error([&] { make(tiny_options(1), no_a); }, {"no rank for the single byte 0x61"});
  expect_error([&] { make(tiny_options(1), bytes_and({"b"})); }, {"rank 256 repeats the bytes of rank 98"});
  TikTokenizer t = make(tiny_options(1));
  expect_error([&] { t.decode(std::vector<int32_t>{267}); }, {"id 267 outside [0, 267)"});
}

// The vocabulary formats: Megatron's JSON list and tiktoken's "base64 rank" lines give one tokenizer.
TEST(TikTokenizer, ReadsBothVocabularyFormats) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("mt_tiktoken_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::vector<std::string> toks = bytes_and({"ab", "\xE4\xB8\xAD"});  // "中"
  nlohmann::json j = nlohmann::json::array();
  std::string lines;
  for (size_t r = 0; r < toks.size(); ++r) {
    j.push_back({{"rank", r}, {"token_bytes", base64(toks[r])}, {"token_str", ""}});
    lines += base64(toks[r]) + " " + std::to_string(r) + "\n";
  }
  std::ofstream(dir / "vocab.json") << j.dump();
  std::ofstream(dir / "vocab.tiktoken") << lines;
  const TikTokenOptions o = tiny_options(2);
  const auto a = make_tokenizer("TikTokenizer", "", "", (dir / "vocab.json").string(), o.vocab_size, o);
  const auto b = make_tokenizer("TikTokenizer", "", "", (dir / "vocab.tiktoken").string(), o.vocab_size, o);
  const std::string text = "ab 中中 abc";
  EXPECT_EQ(a->encode(text), b->encode(text));
  EXPECT_EQ(a->encode("中"), (std::vector<int32_t>{267}));
  EXPECT_EQ(a->name(), "TikTokenizer");
  // errors name the file and the place
  std::ofstream(dir / "bad.tiktoken") << "YQ== 0\nYg== 2\n";
  expect_error([&] { make_tokenizer("TikTokenizer", "", "", (dir / "bad.tiktoken").string(), 300, o); },
               {"bad.tiktoken' line 2", "rank '2'; expected 1"});
  std::ofstream(dir / "bad64.tiktoken") << "Y*== 0\n";
  expect_error([&] { make_tokenizer("TikTokenizer", "", "", (dir / "bad64.tiktoken").string(), 300, o); },
               {"is not base64"});
  std::ofstream(dir / "order.json") << R"([{"rank": 0, "token_bytes": "YQ==", "token_str": "a"}])";
  expect_error([&] { make_tokenizer("TikTokenizer", "", "", (dir / "order.json").string(), 300, o); },
               {"order.json' entry 0", "single bytes 0..255 in order"});
  expect_error([&] { make_tokenizer("TikTokenizer", "", "", "", 300, o); }, {"TikTokenizer needs --tokenizer-model"});
  std::filesystem::remove_all(dir);
}

// ---- the fixture: texts, a vocabulary trained on them, pieces and ids of the reference ----

std::vector<std::string> corpus_texts() {
  return {
      "Hello world! HelloWorld isn't it? I'M here, you're there; we'll see.",
      "The quick brown fox jumps over the lazy dog 1234567890 times.\n\nNew paragraph\r\nwith CRLF.",
      "  leading and trailing spaces   ",
      "path/to/file.txt and https://example.com/a/b?c=d&e=f // comment\n/* block */",
      "naïve café déjà vu — Straße, ÉCOLE, Ωmega, ДОБРЫЙ день, Ελληνικά",
      "東京タワー 中文分词测试 한국어 텍스트 日本語の文章です。",
      "emoji: 👍🏽 🎉🎉 😀 👨‍👩‍👧 🇫🇷 ok",
      "e\xCC\x81t\xC3\xA9 co\xCC\x88operate a\xCC\x8A \xE0\xA4\xB9\xE0\xA4\xBF\xE0\xA4\xA8\xE0\xA5\x8D\xE0\xA4\xA6\xE0\xA5\x80",
      "CamelCaseWords XMLHttpRequest iPhone McDONALD's ÀBC ǅungla",
      "tabs\tand\ttabs\n\t\n  \n\nnumbers: 3.14159 1,000,000 ١٢٣ ²³",
      "<s>special</s> tokens <unk> mid<pad>word <SPECIAL_8>",
      "x\xC2\xA0\xC2\xA0y \xC2\xA0z\xE2\x80\x83w",
      "",
      "a",
  };
}

// A vocabulary of the 256 bytes and `merges` BPE merges learned on the texts' v2 pieces (the most
// frequent adjacent pair first, the smaller concatenated bytes among equals).
std::vector<std::string> trained_vocabulary(int merges) {
  TikTokenOptions o;
  o.num_special_tokens = 7;
  o.vocab_size = 7 + 256;
  const TikTokenizer bytes_only = TikTokenizer::from_ranks(bytes_and({}), o);
  std::vector<std::vector<std::string>> words;
  for (const std::string& t : corpus_texts())
    for (std::string_view p : bytes_only.pretokenize(t)) {
      std::vector<std::string> w;
      for (char c : p) w.emplace_back(1, c);
      words.push_back(w);
    }
  std::vector<std::string> vocab = bytes_and({});
  for (int m = 0; m < merges; ++m) {
    std::map<std::pair<std::string, std::string>, int> count;
    for (const auto& w : words)
      for (size_t i = 0; i + 1 < w.size(); ++i) ++count[{w[i], w[i + 1]}];
    std::pair<std::string, std::string> best;
    int best_n = 0;
    for (const auto& [pair, n] : count)
      if (n > best_n || (n == best_n && pair.first + pair.second < best.first + best.second)) best = pair, best_n = n;
    if (best_n < 1) break;
    const std::string joined = best.first + best.second;
    if (std::find(vocab.begin(), vocab.end(), joined) != vocab.end()) {  // already a token: merge only
    } else {
      vocab.push_back(joined);
    }
    for (auto& w : words) {
      std::vector<std::string> out;
      for (size_t i = 0; i < w.size(); ++i) {
        if (i + 1 < w.size() && w[i] == best.first && w[i + 1] == best.second) {
          out.push_back(joined);
          ++i;
        } else {
          out.push_back(w[i]);
        }
      }
      w = out;
    }
  }
  return vocab;
}

constexpr int kMerges = 300;
constexpr int64_t kFixtureSpecials = 10;


nlohmann::json vocab_json(const std::vector<std::string>& vocab) {
  nlohmann::json j = nlohmann::json::array();
  for (size_t r = 0; r < vocab.size(); ++r) j.push_back({{"rank", r}, {"token_bytes", base64(vocab[r])}, {"token_str", ""}});
  return j;
}

TikTokenizer fixture_tokenizer(const std::string& pattern) {
  const std::vector<std::string> vocab = trained_vocabulary(kMerges);
  TikTokenOptions o;
  o.pattern = pattern;
  o.num_special_tokens = kFixtureSpecials;
  o.vocab_size = kFixtureSpecials + static_cast<int64_t>(vocab.size());
  return TikTokenizer::from_ranks(vocab, o);
}

TEST(TikTokenizer, FixtureInputsAreTheTestsOwn) {
  const std::vector<std::string> vocab = trained_vocabulary(kMerges);
  EXPECT_GT(vocab.size(), 256u + 200u);
  const nlohmann::json v = vocab_json(vocab), texts = corpus_texts();
  if (std::getenv("MT_WRITE_TIKTOKEN_FIXTURES")) {
    std::filesystem::create_directories(fixture(""));
    std::ofstream(fixture("vocab.json")) << v.dump() << "\n";
    std::ofstream(fixture("texts.json")) << texts.dump(1) << "\n";
    std::ofstream(fixture("options.json")) << nlohmann::json{{"num_special_tokens", kFixtureSpecials}}.dump() << "\n";
  }
  std::ifstream fv(fixture("vocab.json")), ft(fixture("texts.json"));
  ASSERT_TRUE(fv && ft) << "missing " << fixture("vocab.json") << " (MT_WRITE_TIKTOKEN_FIXTURES=1 writes it)";
  EXPECT_EQ(nlohmann::json::parse(fv), v) << "the committed vocabulary differs from the one this test trains";
  EXPECT_EQ(nlohmann::json::parse(ft), texts);
}

// The pre-tokenizer against Python's `regex` module on Megatron's pattern strings.
TEST(TikTokenizer, PiecesMatchTheRegexModule) {
  std::ifstream f(fixture("pieces.json"));
  ASSERT_TRUE(f) << "missing " << fixture("pieces.json") << " (python3 tools/tiktoken_ref.py pieces)";
  const nlohmann::json ref = nlohmann::json::parse(f);
  const std::vector<std::string> texts = corpus_texts();
  for (const std::string pattern : {"v1", "v2"}) {
    const TikTokenizer t = fixture_tokenizer(pattern);
    ASSERT_EQ(ref.at(pattern).size(), texts.size());
    for (size_t i = 0; i < texts.size(); ++i) {
      // the segments between special tokens (tiktoken cuts them out first), as pieces
      std::vector<std::string> got;
      std::string_view rest = texts[i];
      while (true) {
        size_t at = std::string_view::npos, len = 0;
        for (const std::string s : {"<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<SPECIAL_7>",
                                    "<SPECIAL_8>", "<SPECIAL_9>"})
          if (const size_t p = rest.find(s); p != std::string_view::npos && p < at) at = p, len = s.size();
        for (std::string_view p : t.pretokenize(rest.substr(0, at))) got.emplace_back(p);
        if (at == std::string_view::npos) break;
        rest.remove_prefix(at + len);
      }
      EXPECT_EQ(got, ref.at(pattern)[i].get<std::vector<std::string>>()) << pattern << " text " << i << ": " << texts[i];
    }
  }
}

TEST(TikTokenizer, CorpusRoundTripsAndMatchesTiktoken) {
  const std::vector<std::string> texts = corpus_texts();
  std::ifstream f(fixture("ids.json"));
  const nlohmann::json ref = f ? nlohmann::json::parse(f) : nlohmann::json();
  for (const std::string pattern : {"v1", "v2"}) {
    const TikTokenizer t = fixture_tokenizer(pattern);
    size_t merged = 0, total = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      const std::vector<int32_t> ids = t.encode(texts[i]);
      EXPECT_EQ(t.decode(ids), texts[i]) << pattern << " text " << i;
      EXPECT_EQ(utf8_replace_invalid(t.decode(ids)), texts[i]);
      for (int32_t id : ids) merged += id >= kFixtureSpecials + 256;
      total += ids.size();
      if (!ref.is_null())
        EXPECT_EQ(ids, ref.at(pattern)[i].get<std::vector<int32_t>>()) << pattern << " text " << i << ": " << texts[i];
    }
    EXPECT_GT(merged, total / 4) << pattern << ": the trained merges are used";
  }
  if (ref.is_null())
    std::printf("note: %s is not there yet (python3 tools/tiktoken_ref.py ids, where tiktoken is installed); the "
                "ids were not compared with tiktoken's\n", fixture("ids.json").c_str());
}

}  // namespace
}  // namespace mt::data
