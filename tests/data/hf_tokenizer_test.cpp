// HfTokenizer (tokenizer.json byte-level BPE) against the Hugging Face `tokenizers` library: the ids
// in tests/data/fixtures/hf_ref/*.ids.json were computed by tokenizers 0.22 (Rust, via its node
// binding; tools/megatron_ref/hf_ref.js) for the two committed small tokenizer.json files (GPT-2-style
// ByteLevel; Llama-3-style Split + ByteLevel + ignore_merges + BOS template + lstrip/rstrip added
// token) and for the real Llama-3 tokenizer.json when present in $MT_DATA_DIR/hf/llama3 (skipped
// otherwise). Plus NullTokenizer, the factory, and the errors for unsupported files.
#include "data/hf_tokenizer.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "data/gpt2_tokenizer.h"
#include "megatron_ref_util.h"

namespace mt::data {
namespace {

using testing::expect_error;

std::string fixture(const std::string& name) { return testing::source_dir() + "/tests/data/fixtures/hf_ref/" + name; }

void check_against_reference(const HfTokenizer& tok, const std::string& ids_file) {
  std::ifstream f(ids_file);
  ASSERT_TRUE(f) << ids_file;
  const auto j = nlohmann::json::parse(f);
  int n = 0;
  for (const auto& c : j.at("cases")) {
    const std::string text = c.at("text").get<std::string>();
    EXPECT_EQ(tok.encode(text, true), c.at("ids").get<std::vector<int32_t>>()) << "text: " << text.substr(0, 80);
    EXPECT_EQ(tok.encode(text, false), c.at("ids_no_special").get<std::vector<int32_t>>()) << text.substr(0, 80);
    // decode inverts encode, except where an lstrip/rstrip added token absorbed whitespace.
    if (text.find("<|pad|>") == std::string::npos) EXPECT_EQ(tok.decode(tok.encode(text, false)), text);
    ++n;
  }
  EXPECT_GT(n, 20);
}

TEST(HfTokenizer, Gpt2StyleMatchesTokenizersLibrary) {
  const std::string path = fixture("gpt2style.tokenizer.json");
  if (!testing::is_regular_file_path(path)) GTEST_SKIP() << "missing " << path;
  const HfTokenizer tok = HfTokenizer::from_file(path);
  check_against_reference(tok, fixture("gpt2style.ids.json"));
  EXPECT_EQ(tok.eod(), tok.token_to_id("<|endoftext|>"));
  EXPECT_EQ(tok.name(), "HuggingFaceTokenizer");
}

TEST(HfTokenizer, Llama3StyleMatchesTokenizersLibrary) {
  const std::string path = fixture("llama3style.tokenizer.json");
  if (!testing::is_regular_file_path(path)) GTEST_SKIP() << "missing " << path;
  const HfTokenizer tok = HfTokenizer::from_file(path);
  check_against_reference(tok, fixture("llama3style.ids.json"));
  EXPECT_EQ(tok.eod(), tok.token_to_id("<|end_of_text|>"));
  EXPECT_EQ(tok.encode("x").front(), tok.token_to_id("<|begin_of_text|>"));  // BOS from the template
}

TEST(HfTokenizer, RealLlama3MatchesTokenizersLibrary) {
  const std::string dir = testing::demo_data_dir() + "/hf/llama3";
  if (!testing::is_regular_file_path(dir + "/tokenizer.json")) {
    GTEST_SKIP() << dir << "/tokenizer.json not found (tools/megatron_ref/fetch_hf_ref.sh fetches it)";
  }
  const HfTokenizer tok = HfTokenizer::from_file(dir);
  EXPECT_EQ(tok.vocab_size(), 128256);
  EXPECT_EQ(tok.eod(), 128001);  // eos_token <|end_of_text|> from tokenizer_config.json
  check_against_reference(tok, fixture("llama3.ids.json"));
}

TEST(HfTokenizer, Llama3PreTokenizer) {
  auto split = [](std::string_view s, int d) {
    std::vector<std::string> out;
    for (auto v : HfTokenizer::pretokenize_llama3(s, d)) out.emplace_back(v);
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(split("Hello world's 12345", 3), (V{"Hello", " world", "'s", " ", "123", "45"}));
  EXPECT_EQ(split("12345", 1), (V{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(split("a\n\n  b", 3), (V{"a", "\n\n", " ", " b"}));
  EXPECT_EQ(split("\"quote\" ok!!\n", 3), (V{"\"quote", "\"", " ok", "!!\n"}));
  EXPECT_EQ(split("x   ", 3), (V{"x", "   "}));
  EXPECT_EQ(split("I'LL", 3), (V{"I", "'LL"}));
}

TEST(HfTokenizer, UnsupportedFilesAreClearErrors) {
  const std::string base = R"({"model": {"type": "BPE", "vocab": {}, "merges": []}, "pre_tokenizer": {"type": "ByteLevel"}})";
  expect_error([] { HfTokenizer::from_json(R"({"model": {"type": "WordPiece", "vocab": {}}})", "", "t.json"); },
               {"t.json", "'WordPiece'", "byte-level BPE"});
  expect_error([] { HfTokenizer::from_json(R"({"model": {"type": "Unigram", "vocab": []}})", "", "u.json"); },
               {"'Unigram'"});
  expect_error([] { HfTokenizer::from_json(R"({"version": "1.0"})", "", "x.json"); }, {"not a tokenizer.json"});
  expect_error([] { HfTokenizer::from_json("{oops", "", "y.json"); }, {"y.json", "malformed JSON"});
  expect_error(
      [] {
        HfTokenizer::from_json(
            R"({"normalizer": {"type": "NFC"}, "model": {"type": "BPE", "vocab": {}, "merges": []}, "pre_tokenizer": {"type": "ByteLevel"}})",
            "", "n.json");
      },
      {"normalizer", "NFC", "not supported"});
  expect_error(
      [] {
        HfTokenizer::from_json(
            R"({"model": {"type": "BPE", "vocab": {}, "merges": []}, "pre_tokenizer": {"type": "Metaspace"}})", "",
            "m.json");
      },
      {"pre_tokenizer type 'Metaspace'"});
  expect_error([&] { HfTokenizer::from_json(base, "", "b.json"); }, {"lacks the byte-level token"});
  expect_error(
      [] {
        HfTokenizer::from_json(
            R"({"model": {"type": "BPE", "vocab": {}, "merges": []}, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\w+"}, "behavior": "Isolated", "invert": false}})",
            "", "r.json");
      },
      {"unsupported Split pre-tokenizer regex"});
  expect_error([] { HfTokenizer::from_file("/nonexistent/tokenizer.json"); }, {"/nonexistent/tokenizer.json"});
}

TEST(Tokenizers, NullTokenizerAndFactory) {
  NullTokenizer n(100);
  EXPECT_EQ(n.eod(), 99);
  EXPECT_EQ(n.encode("3 17 5"), (std::vector<int32_t>{3, 17, 5}));
  EXPECT_EQ(n.decode(std::vector<int32_t>{3, 17, 5}), "3 17 5");
  expect_error([&] { n.encode("3 x"); }, {"'x' is not an integer"});
  expect_error([&] { n.encode("100"); }, {"outside [0, 100)"});
  expect_error([] { make_tokenizer("BertWordPieceCase", "", "", "", 0); }, {"unknown --tokenizer-type", "NullTokenizer"});
  expect_error([] { make_tokenizer("GPT2BPETokenizer", "", "", "", 0); }, {"--vocab-file"});
  expect_error([] { make_tokenizer("HuggingFaceTokenizer", "", "", "", 0); }, {"--tokenizer-model"});
  expect_error([] { make_tokenizer("NullTokenizer", "", "", "", 0); }, {"--vocab-size"});
  if (!sentencepiece_available()) {
    expect_error([] { make_tokenizer("SentencePieceTokenizer", "", "", "m.model", 0); }, {"no SentencePiece support"});
  }
  EXPECT_EQ(make_tokenizer("NullTokenizer", "", "", "", 64)->vocab_size(), 64);
  // A tokenizer.json of the wrong kind through the factory.
  testing::TempDir d;
  testing::write_file(d.file("tokenizer.json"), R"({"model": {"type": "WordLevel", "vocab": {}}})");
  expect_error([&] { make_tokenizer("HuggingFaceTokenizer", "", "", d.path(), 0); }, {"'WordLevel'"});
}

}  // namespace
}  // namespace mt::data
