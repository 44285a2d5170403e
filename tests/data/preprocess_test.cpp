// preprocess-data: JSON lines and .txt inputs with a tiny vocabulary (ordering, keys, --append-eod,
// --workers determinism, output names, errors), the CLI subcommand, and (when the demo data exists)
// the real GPT-2 files on Moby Dick + State of the Union.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <filesystem>

#include "data/gpt2_tokenizer.h"
#include "data/tokenizer.h"
#include "data/indexed_dataset.h"
#include "data/preprocess.h"
#include "data/preprocess_cli.h"
#include "data_test_util.h"
#include "testing/testing.h"

namespace mt::data {
namespace {

using testing::expect_error;
using testing::read_file;
using testing::TempDir;
using testing::write_file;

struct Env {
  TempDir dir;
  std::string vocab, merges;
  Gpt2Tokenizer tok;
  Env() : tok(make()) {}
  Gpt2Tokenizer make() {
    testing::write_tiny_vocab(dir.path(), {{"h", "e"}, {"l", "l"}, {" ", "w"}, {"he", "ll"}, {" w", "o"}});
    vocab = dir.file("vocab.json");
    merges = dir.file("merges.txt");
    return Gpt2Tokenizer::from_files(vocab, merges);
  }
  PreprocessConfig config(std::vector<std::string> inputs, const std::string& out) const {
    PreprocessConfig c;
    c.inputs = std::move(inputs);
    c.output_prefix = dir.file(out);
    c.vocab_file = vocab;
    c.merge_file = merges;
    c.log_interval = 1000000;
    return c;
  }
  size_t num_files() const {
    return static_cast<size_t>(std::distance(std::filesystem::directory_iterator(dir.path()), {}));
  }
};

std::vector<std::vector<int32_t>> all_sequences(const IndexedDataset& ds) {
  std::vector<std::vector<int32_t>> v;
  for (int64_t i = 0; i < ds.num_sequences(); ++i) v.push_back(ds.get(i));
  return v;
}

TEST(Preprocess, JsonLinesTwoKeysAppendEod) {
  Env env;
  const std::vector<std::pair<std::string, std::string>> docs = {
      {"hello world", "t1"}, {"", "empty text"}, {"h\\u00e9llo\\n\\n wo", ""}, {"hell hello  world's", "x"}};
  std::string jsonl;
  for (size_t i = 0; i < docs.size(); ++i) {
    jsonl += "{\"id\": " + std::to_string(i) + ", \"text\": \"" + docs[i].first + "\", \"title\": \"" +
             docs[i].second + "\"}\n";
    if (i == 1) jsonl += "\n   \n";  // blank lines are skipped
  }
  write_file(env.dir.file("in.jsonl"), jsonl);
  auto cfg = env.config({env.dir.file("in.jsonl")}, "out");
  cfg.json_keys = {"text", "title"};
  cfg.append_eod = true;
  const PreprocessStats st = preprocess_data(cfg);
  EXPECT_EQ(st.documents, 4);
  ASSERT_EQ(st.output_prefixes.size(), 2u);
  EXPECT_EQ(st.output_prefixes[0], env.dir.file("out_text_document"));
  EXPECT_EQ(st.output_prefixes[1], env.dir.file("out_title_document"));

  const std::vector<std::string> texts = {"hello world", "", "h\xc3\xa9llo\n\n wo", "hell hello  world's"};
  const std::vector<std::string> titles = {"t1", "empty text", "", "x"};
  for (int k = 0; k < 2; ++k) {
    IndexedDataset ds(st.output_prefixes[k]);
    EXPECT_EQ(ds.dtype(), IndexDType::kUInt16);
    const auto& src = k == 0 ? texts : titles;
    ASSERT_EQ(ds.num_documents(), 4);
    int64_t seq = 0;
    for (int d = 0; d < 4; ++d) {
      const auto& di = ds.document_indices();
      if (src[d].empty()) {  // an empty text is an empty document, without EOD
        EXPECT_EQ(di[d + 1], di[d]);
        continue;
      }
      ASSERT_EQ(di[d + 1], di[d] + 1);
      auto expected = env.tok.encode(src[d]);
      expected.push_back(env.tok.eod());
      EXPECT_EQ(ds.get(seq++), expected) << "key " << k << " doc " << d;
    }
  }
  EXPECT_EQ(st.tokens, IndexedDataset(st.output_prefixes[0]).num_tokens() + IndexedDataset(st.output_prefixes[1]).num_tokens());
}

TEST(Preprocess, ListValuesAreSequencesOfOneDocument) {
  Env env;
  write_file(env.dir.file("in.jsonl"),
             "{\"text\": [\"hello\", \"\", \" world\"]}\n{\"text\": []}\n{\"text\": [\"\"]}\n{\"text\": \"wo\"}\n");
  auto cfg = env.config({env.dir.file("in.jsonl")}, "list");
  cfg.append_eod = true;
  preprocess_data(cfg);
  IndexedDataset ds(env.dir.file("list_text_document"));
  auto world = env.tok.encode(" world");
  world.push_back(env.tok.eod());
  auto wo = env.tok.encode("wo");
  wo.push_back(env.tok.eod());
  EXPECT_EQ(all_sequences(ds), (std::vector<std::vector<int32_t>>{env.tok.encode("hello"), world, wo}));
  EXPECT_EQ(ds.document_indices(), (std::vector<int64_t>{0, 2, 2, 2, 3}));
  write_file(env.dir.file("bad.jsonl"), "{\"text\": [\"a\", 3]}\n");
  cfg.inputs = {env.dir.file("bad.jsonl")};
  expect_error([&] { preprocess_data(cfg); }, {"bad.jsonl:1", "list with a number element"});
}

TEST(Preprocess, WorkersGiveIdenticalOutput) {
  Env env;
  auto& rng = mt::testing::test_rng();
  std::string jsonl;
  const char* words[] = {"hello", " world", "\\n", "  ", "hell", "wo", "\\u6771", "42", "!"};
  for (int i = 0; i < 3000; ++i) {  // more than one internal batch
    std::string t;
    const int n = static_cast<int>(rng() % 20);
    for (int k = 0; k < n; ++k) t += words[rng() % 9];
    jsonl += "{\"text\": \"" + t + "\"}\n";
  }
  write_file(env.dir.file("in.jsonl"), jsonl);
  auto c1 = env.config({env.dir.file("in.jsonl")}, "w1");
  auto c4 = env.config({env.dir.file("in.jsonl")}, "w4");
  c4.workers = 4;
  preprocess_data(c1);
  preprocess_data(c4);
  EXPECT_EQ(read_file(env.dir.file("w1_text_document.bin")), read_file(env.dir.file("w4_text_document.bin")));
  EXPECT_EQ(read_file(env.dir.file("w1_text_document.idx")), read_file(env.dir.file("w4_text_document.idx")));
  EXPECT_EQ(IndexedDataset(env.dir.file("w4_text_document")).num_documents(), 3000);
}

TEST(Preprocess, TextFilesAndDirectories) {
  Env env;
  std::filesystem::create_directory(env.dir.file("corpus"));
  write_file(env.dir.file("corpus/b.txt"), "hello\n");
  write_file(env.dir.file("corpus/a.txt"), "world world");
  write_file(env.dir.file("corpus/skip.md"), "not a txt");
  write_file(env.dir.file("first.txt"), "he said \"hello\"\n\nbye");
  auto cfg = env.config({env.dir.file("first.txt"), env.dir.file("corpus")}, "txt");
  cfg.workers = 2;
  const auto st = preprocess_data(cfg);
  ASSERT_EQ(st.output_prefixes, std::vector<std::string>{env.dir.file("txt_text_document")});
  IndexedDataset ds(st.output_prefixes[0]);
  const std::vector<std::vector<int32_t>> expected = {
      env.tok.encode("he said \"hello\"\n\nbye"), env.tok.encode("world world"), env.tok.encode("hello\n")};
  EXPECT_EQ(all_sequences(ds), expected);  // file order, then the directory sorted by name
  EXPECT_EQ(ds.document_indices(), (std::vector<int64_t>{0, 1, 2, 3}));
}

TEST(Preprocess, Errors) {
  Env env;
  write_file(env.dir.file("ok.jsonl"), "{\"text\": \"hello\"}\n");
  const size_t files_before = env.num_files();
  {
    auto c = env.config({env.dir.file("nope.jsonl")}, "o");
    expect_error([&] { preprocess_data(c); }, {"nope.jsonl", "not found"});
  }
  {
    write_file(env.dir.file("bad.jsonl"), "{\"text\": \"hello\"}\n{\"text\": \"x\"}\n{\"text\": oops}\n");
    auto c = env.config({env.dir.file("ok.jsonl"), env.dir.file("bad.jsonl")}, "o");
    c.workers = 3;
    expect_error([&] { preprocess_data(c); }, {"bad.jsonl:3", "invalid JSON"});
  }
  {
    write_file(env.dir.file("nokey.jsonl"), "{\"text\": \"hello\"}\n{\"body\": \"x\"}\n");
    auto c = env.config({env.dir.file("nokey.jsonl")}, "o");
    expect_error([&] { preprocess_data(c); }, {"nokey.jsonl:2", "key 'text' not found"});
    c.json_keys = {"body"};
    expect_error([&] { preprocess_data(c); }, {"nokey.jsonl:1", "key 'body' not found"});
  }
  {
    write_file(env.dir.file("num.jsonl"), "{\"text\": 5}\n");
    auto c = env.config({env.dir.file("num.jsonl")}, "o");
    expect_error([&] { preprocess_data(c); }, {"num.jsonl:1", "expected a string"});
    write_file(env.dir.file("arr.jsonl"), "[1]\n");
    c.inputs = {env.dir.file("arr.jsonl")};
    expect_error([&] { preprocess_data(c); }, {"arr.jsonl:1", "JSON object"});
  }
  {
    auto c = env.config({env.dir.file("ok.jsonl")}, "o");
    c.tokenizer_type = "HuggingFaceTokenizer";
    expect_error([&] { preprocess_data(c); }, {"HuggingFaceTokenizer", "--tokenizer-model"});
    c = env.config({env.dir.file("ok.jsonl")}, "o");
    c.vocab_file = env.dir.file("missing_vocab.json");
    expect_error([&] { preprocess_data(c); }, {"missing_vocab.json"});
  }
  {
    write_file(env.dir.file("x.txt"), "hello");
    auto c = env.config({env.dir.file("ok.jsonl"), env.dir.file("x.txt")}, "o");
    c.json_keys = {"text", "title"};
    expect_error([&] { preprocess_data(c); }, {".txt inputs", "cannot be mixed"});
    std::filesystem::create_directory(env.dir.file("emptydir"));
    c = env.config({env.dir.file("emptydir")}, "o");
    expect_error([&] { preprocess_data(c); }, {"emptydir", "no *.txt"});
    std::filesystem::remove(env.dir.file("x.txt"));
    std::filesystem::remove(env.dir.file("emptydir"));
  }
  // Failed runs leave no output (or temporary) files behind.
  EXPECT_EQ(env.num_files(), files_before + 4);  // bad, nokey, num, arr .jsonl written above
  for (const auto& e : std::filesystem::directory_iterator(env.dir.path())) {
    EXPECT_EQ(e.path().filename().string().rfind("o_", 0), std::string::npos) << e.path();
  }
}

TEST(PreprocessCli, ParsesMegatronFlags) {
  Env env;
  write_file(env.dir.file("in.jsonl"), "{\"text\": \"hello world\", \"t\": \"hell\"}\n{\"text\": \"wo\", \"t\": \"\"}\n");
  CLI::App app("megatron");
  add_preprocess_data_command(app);
  const std::string out = env.dir.file("cli");
  std::vector<std::string> args = {"megatron", "preprocess-data", "--input", env.dir.file("in.jsonl"),
                                   "--output-prefix", out, "--json-keys", "text", "t", "--append-eod",
                                   "--vocab-file", env.vocab, "--merge-file", env.merges,
                                   "--tokenizer-type", "GPT2BPETokenizer", "--workers", "2"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  app.parse(static_cast<int>(argv.size()), argv.data());
  IndexedDataset text(out + "_text_document"), t(out + "_t_document");
  auto e1 = env.tok.encode("hello world");
  e1.push_back(env.tok.eod());
  EXPECT_EQ(text.get(0), e1);
  EXPECT_EQ(text.num_documents(), 2);
  EXPECT_EQ(t.num_sequences(), 1);
  EXPECT_EQ(t.num_documents(), 2);

  CLI::App app2("megatron");
  add_preprocess_data_command(app2);
  std::vector<std::string> bad = {"megatron", "preprocess-data", "--input", env.dir.file("in.jsonl"),
                                  "--output-prefix", out, "--vocab-file", env.vocab, "--merge-file", env.merges,
                                  "--tokenizer-type", "SentencePieceTokenizer"};
  std::vector<char*> argv2;
  for (auto& a : bad) argv2.push_back(a.data());
  // Without MT_WITH_SENTENCEPIECE the tokenizer type is a clear run-time error.
  if (!sentencepiece_available()) EXPECT_THROW(app2.parse(static_cast<int>(argv2.size()), argv2.data()), mt::Error);
}

TEST(PreprocessReal, MobyDickAndSotu) {
  const std::string dir = testing::demo_data_dir();
  const std::string moby = dir + "/moby-dick/data.txt", sotu = dir + "/sotu";
  if (!std::filesystem::is_regular_file(dir + "/gpt2/encoder.json") || !std::filesystem::is_regular_file(moby) ||
      !std::filesystem::is_directory(sotu)) {
    GTEST_SKIP() << "demo data not found in " << dir << " (run tools/fetch_demo_data.sh)";
  }
  TempDir out;
  PreprocessConfig c;
  c.inputs = {moby, sotu};
  c.output_prefix = out.file("demo");
  c.vocab_file = dir + "/gpt2/encoder.json";
  c.merge_file = dir + "/gpt2/vocab.bpe";
  c.append_eod = true;
  c.workers = 2;
  c.log_interval = 100;
  const auto st = preprocess_data(c);
  IndexedDataset ds(out.file("demo_text_document"));
  size_t num_sotu = 0;
  for (const auto& e : std::filesystem::directory_iterator(sotu)) num_sotu += e.path().extension() == ".txt";
  EXPECT_EQ(ds.num_documents(), static_cast<int64_t>(1 + num_sotu));
  EXPECT_EQ(ds.dtype(), IndexDType::kUInt16);
  const auto first = ds.get(0);
  ASSERT_EQ(first.size(), 317756u + 1);  // the reference token count of Moby Dick + EOD
  EXPECT_EQ(first.back(), 50256);
  EXPECT_EQ(std::vector<int32_t>(first.begin(), first.begin() + 4), (std::vector<int32_t>{41481, 352, 13, 406}));
  EXPECT_EQ(st.tokens, ds.num_tokens());
  EXPECT_GT(st.bytes, 1204997);
}

}  // namespace
}  // namespace mt::data

namespace mt::data {
namespace {

TEST(Preprocess, SplitSentences) {
  using V = std::vector<std::string_view>;
  EXPECT_EQ(split_into_sentences("Hello there. How are you? I am fine!  \n"),
            (V{"Hello there.", "How are you?", "I am fine!"}));
  EXPECT_EQ(split_into_sentences("  Mr. J. Smith went home. \"Yes.\" He said 3.5 times... Then 42 left."),
            (V{"Mr.", "J. Smith went home.", "\"Yes.\"", "He said 3.5 times...", "Then 42 left."}));
  EXPECT_EQ(split_into_sentences("no terminal punctuation"), (V{"no terminal punctuation"}));
  EXPECT_TRUE(split_into_sentences(" \n ").empty());
}

TEST(Preprocess, SplitSentencesNullTokenizerAndMerge) {
  testing::TempDir dir;
  testing::write_file(dir.file("a.jsonl"), "{\"text\": \"1 2 3 4\"}\n{\"text\": \"5\"}\n");
  PreprocessConfig c;
  c.inputs = {dir.file("a.jsonl")};
  c.output_prefix = dir.file("a");
  c.tokenizer_type = "NullTokenizer";
  c.vocab_size = 10;
  c.append_eod = true;
  c.split_sentences = false;
  c.log_interval = 1;
  preprocess_data(c);
  IndexedDataset a(dir.file("a_text_document"));
  EXPECT_EQ(a.dtype(), IndexDType::kUInt16);
  ASSERT_EQ(a.num_sequences(), 2);
  testing::write_file(dir.file("b.jsonl"), "{\"text\": \"7 8\"}\n{\"text\": \"\"}\n{\"text\": \"3\"}\n");
  c.inputs = {dir.file("b.jsonl")};
  c.output_prefix = dir.file("b");
  preprocess_data(c);
  merge_datasets({dir.file("a_text_document"), dir.file("b_text_document")}, dir.file("m"));
  IndexedDataset m(dir.file("m"));
  IndexedDataset b(dir.file("b_text_document"));
  EXPECT_EQ(m.num_sequences(), a.num_sequences() + b.num_sequences());
  EXPECT_EQ(m.num_documents(), a.num_documents() + b.num_documents());  // the empty document is kept
  EXPECT_EQ(m.get(2), (std::vector<int32_t>{7, 8, 9}));                   // EOD = vocab_size - 1
  // Byte-identical to writing everything at once (Megatron's add_index appends the same arrays).
  testing::write_file(dir.file("ab.jsonl"), testing::read_file(dir.file("a.jsonl")) + testing::read_file(dir.file("b.jsonl")));
  c.inputs = {dir.file("ab.jsonl")};
  c.output_prefix = dir.file("ab");
  preprocess_data(c);
  EXPECT_EQ(testing::read_file(dir.file("ab_text_document.idx")), testing::read_file(dir.file("m.idx")));
  EXPECT_EQ(testing::read_file(dir.file("ab_text_document.bin")), testing::read_file(dir.file("m.bin")));
  // Sentence level: one sequence per sentence, outputs named _sentence.
  testing::write_file(dir.file("s.jsonl"), "{\"text\": \"1 2\"}\n");
  c.inputs = {dir.file("s.jsonl")};
  c.output_prefix = dir.file("s");
  c.split_sentences = true;
  preprocess_data(c);
  IndexedDataset s(dir.file("s_text_sentence"));
  EXPECT_EQ(s.num_documents(), 1);
  // dtype mismatch
  IndexedDatasetBuilder w(dir.file("wide"), IndexDType::kInt32);
  w.add_document(std::vector<int32_t>{1});
  w.finalize();
  testing::expect_error([&] { merge_datasets({dir.file("m"), dir.file("wide")}, dir.file("x")); }, {"dtype", "int32"});
}

}  // namespace
}  // namespace mt::data
