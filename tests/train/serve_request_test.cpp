// Requests and replies of `megatron serve` without a server (train/serve_request.h): every field
// read as the type it is, refused with its name and the value as given (random_seed -1,
// tokens_to_generate 3.7 and 2^63, n 0, booleans for numbers); n, echo and stop; documented options
// that are not implemented refused; invalid UTF-8 named by the field that holds it; replies to
// random byte-level token sequences (characters split and broken) serialise as valid UTF-8, the
// segments concatenate to the text; completion text after the prompt, cut at stop strings.
#include <gtest/gtest.h>

#include <random>

#include "data/data_test_util.h"
#include "data/detokenizer.h"
#include "data/gpt2_tokenizer.h"
#include "train/serve_request.h"

namespace mt {
namespace {

using nlohmann::json;

// Expects HttpError `status` whose message contains every part.
template <typename Fn>
void expect_refused(Fn&& fn, const std::vector<std::string>& parts, int status = 400) {
  try {
    fn();
    ADD_FAILURE() << "accepted; expected HTTP " << status << " mentioning '" << parts.front() << "'";
  } catch (const HttpError& e) {
    EXPECT_EQ(e.status, status) << e.what();
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " / " << p;
  }
}

GenerationRequest api(const std::string& body) { return parse_megatron_api(parse_request_body(body), 128, 77); }
GenerationRequest completion(const std::string& body) { return parse_completion(parse_request_body(body), 8, 77); }

TEST(ServeRequest, MegatronApiFields) {
  const GenerationRequest r = api(R"({"prompts": ["a", "b"], "tokens_to_generate": 9, "top_k": 5, "temperature": 0.5,
                                      "random_seed": 18446744073709551615, "no_log": true})");
  EXPECT_EQ(r.prompts, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(r.tokens_to_generate, 9);
  EXPECT_EQ(r.sampling.top_k, 5);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FALSE(r.sampling.greedy);
  EXPECT_EQ(r.sampling.seed, 18446744073709551615ull);
  const GenerationRequest d = api(R"({"prompts": "one", "temperature": 0, "random_seed": null})");
  EXPECT_EQ(d.tokens_to_generate, 64);  // Megatron's default
  EXPECT_TRUE(d.sampling.greedy);
  EXPECT_EQ(d.sampling.seed, 77u);      // the server's default
  EXPECT_EQ(api(R"({"prompts": ["a"], "tokens_to_generate": 9223372036854775807})").tokens_to_generate,
            9223372036854775807);
}

TEST(ServeRequest, MegatronApiRefusesEachBadValueByName) {
  expect_refused([] { api(R"({"prompts": ["a"], "random_seed": -1})"); }, {"'random_seed'", "got -1"});
  expect_refused([] { api(R"({"prompts": ["a"], "random_seed": 1.5})"); }, {"'random_seed'", "got 1.5"});
  expect_refused([] { api(R"({"prompts": ["a"], "tokens_to_generate": 3.7})"); }, {"'tokens_to_generate'", "got 3.7"});
  expect_refused([] { api(R"({"prompts": ["a"], "tokens_to_generate": 9223372036854775808})"); },
                 {"'tokens_to_generate'", "got 9223372036854775808"});  // 2^63: no wraparound
  expect_refused([] { api(R"({"prompts": ["a"], "tokens_to_generate": 18446744073709551616})"); },
                 {"'tokens_to_generate'", "got 1.8446744073709552e+19"});  // past uint64: JSON gives a float
  expect_refused([] { api(R"({"prompts": ["a"], "tokens_to_generate": -1})"); }, {"'tokens_to_generate'", "got -1"});
  expect_refused([] { api(R"({"prompts": ["a"], "tokens_to_generate": true})"); }, {"'tokens_to_generate'", "got true"});
  expect_refused([] { api(R"({"prompts": ["a"], "tokens_to_generate": "5"})"); }, {"'tokens_to_generate'", "got \"5\""});
  expect_refused([] { api(R"({"prompts": ["a"], "top_k": 2.0})"); }, {"'top_k'", "got 2.0"});
  expect_refused([] { api(R"({"prompts": ["a"], "top_k": 1001})"); }, {"'top_k'", "[0, 1000]"});
  expect_refused([] { api(R"({"prompts": ["a"], "top_p": 1.5})"); }, {"'top_p'", "got 1.5"});
  expect_refused([] { api(R"({"prompts": ["a"], "temperature": -2})"); }, {"'temperature'", "got -2"});
  expect_refused([] { api(R"({"prompts": ["a"], "temperature": false})"); }, {"'temperature'", "got false"});
  expect_refused([] { api(R"({"prompts": ["a"], "top_k": 5, "top_p": 0.5})"); }, {"top_k", "top_p"});
  expect_refused([] { api(R"({"prompts": ["a"], "no_log": 1})"); }, {"'no_log'", "got 1"});
  expect_refused([] { api(R"({"prompts": ["a"], "logprobs": true})"); }, {"'logprobs'", "not supported"});
  expect_refused([] { api(R"({"prompts": ["a"], "beam_width": 2})"); }, {"'beam_width'", "not supported"});
  expect_refused([] { api(R"({"prompts": ["a"], "add_BOS": true})"); }, {"'add_BOS'", "not supported"});
  expect_refused([] { api(R"({"prompts": ["a"], "stop_on_eol": true})"); }, {"'stop_on_eol'", "not supported"});
  expect_refused([] { api(R"({"prompts": ["a"], "stop_token": -3})"); }, {"'stop_token'", "got -3"});
  expect_refused([] { api(R"({"prompts": ["a"], "max_len": 3})"); }, {"max_len is no longer used"});
  expect_refused([] { api(R"({"tokens_to_generate": 4})"); }, {"prompts argument required"});
  expect_refused([] { api(R"({"prompts": []})"); }, {"'prompts'", "non-empty"});
  expect_refused([] { api(R"({"prompts": ["a", 3]})"); }, {"'prompts[1]'", "got 3"});
  json j = {{"prompts", std::vector<std::string>(129, "x")}};
  expect_refused([&] { parse_megatron_api(j, 128, 0); }, {"129 prompts", "128"});
  // Accepted defaults of the refused options.
  EXPECT_NO_THROW(api(R"({"prompts": ["a"], "logprobs": false, "add_BOS": false, "beam_width": null})"));
  EXPECT_EQ(api(R"({"prompts": ["a"], "stop_token": 50256})").stop_token, 50256);
}

TEST(ServeRequest, CompletionFields) {
  const GenerationRequest r = completion(R"({"prompt": ["x", "y"], "n": 3, "max_tokens": 5, "echo": true,
                                             "stop": ["\n", ""], "seed": 4, "top_p": 1, "model": "m", "user": "u",
                                             "best_of": 1, "logprobs": null, "stream": false,
                                             "frequency_penalty": 0.0, "logit_bias": {}})");
  EXPECT_EQ(r.prompts, (std::vector<std::string>{"x", "x", "x", "y", "y", "y"}));  // prompt-major, as OpenAI
  EXPECT_EQ(r.n, 3);
  EXPECT_EQ(r.tokens_to_generate, 5);
  EXPECT_TRUE(r.echo);
  EXPECT_EQ(r.stop, std::vector<std::string>{"\n"});  // empty stop strings never match
  EXPECT_EQ(r.sampling.seed, 4u);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.f);  // OpenAI's 1 = off
  EXPECT_EQ(completion(R"({"prompt": "x"})").tokens_to_generate, 16);
  EXPECT_EQ(completion(R"({"prompt": "x", "stop": "END"})").stop, std::vector<std::string>{"END"});
  EXPECT_TRUE(completion(R"({"prompt": "x", "temperature": 0})").sampling.greedy);
}

TEST(ServeRequest, CompletionRefusesEachBadValueByName) {
  expect_refused([] { completion(R"({"prompt": "a", "n": 0})"); }, {"'n'", "got 0"});
  expect_refused([] { completion(R"({"prompt": "a", "n": 2.5})"); }, {"'n'", "got 2.5"});
  expect_refused([] { completion(R"({"prompt": ["a", "b", "c"], "n": 3})"); }, {"3 prompts x n 3 = 9", "8"});
  expect_refused([] { completion(R"({"prompt": "a", "seed": -5})"); }, {"'seed'", "got -5"});
  expect_refused([] { completion(R"({"prompt": "a", "max_tokens": 1e30})"); }, {"'max_tokens'", "got 1e+30"});
  expect_refused([] { completion(R"({"prompt": "a", "echo": "yes"})"); }, {"'echo'", "got \"yes\""});
  expect_refused([] { completion(R"({"prompt": "a", "stop": [1]})"); }, {"'stop[0]'", "got 1"});
  expect_refused([] { completion(R"({"prompt": "a", "model": 7})"); }, {"'model'", "got 7"});
  expect_refused([] { completion(R"({"prompt": "a", "stream": true})"); }, {"'stream'", "streaming"});
  expect_refused([] { completion(R"({"prompt": "a", "best_of": 2})"); }, {"'best_of'", "not supported"});
  expect_refused([] { completion(R"({"prompt": "a", "logprobs": 1})"); }, {"'logprobs'", "not supported"});
  expect_refused([] { completion(R"({"prompt": "a", "suffix": "z"})"); }, {"'suffix'", "not supported"});
  expect_refused([] { completion(R"({"prompt": "a", "presence_penalty": 0.5})"); }, {"'presence_penalty'"});
  expect_refused([] { completion(R"({"prompt": "a", "logit_bias": {"5": 1}})"); }, {"'logit_bias'"});
  expect_refused([] { completion(R"({"max_tokens": 3})"); }, {"'prompt' is required"});
  expect_refused([] { completion(R"([1, 2])"); }, {"must be a JSON object", "array"});
}

TEST(ServeRequest, InvalidUtf8IsNamedByItsField) {
  expect_refused([] { parse_request_body("{\"prompts\": [\"ok\", \"a\xFF b\"]}"); },
                 {"'prompts[1]' is not valid UTF-8", "0xFF", "offset 21"});
  expect_refused([] { parse_request_body("{\"model\": \"m\", \"prompt\": \"caf\xC3\"}"); }, {"'prompt'", "0xC3"});
  expect_refused([] { parse_request_body("{\"a\": {\"b\": [1, {\"c\": \"\xED\xA0\x80\"}]}}"); }, {"'a.b[1].c'", "0xED"});
  expect_refused([] { parse_request_body("{\"x\xF5\": 1}"); }, {"a key", "0xF5"});
  expect_refused([] { parse_request_body("\xEF\xBB"); }, {"the body is not valid UTF-8"});
  expect_refused([] { parse_request_body("{\"prompts\": [\"\\ud800\"]}"); }, {"not valid JSON"});  // lone surrogate
  expect_refused([] { parse_request_body("{\"prompts\": [\"1 2\""); }, {"not valid JSON"});
  EXPECT_EQ(json_path_at(R"({"k": "v\"x", "arr": [0, "s", {"d": "e"}]})", 37), "arr[2].d");
  EXPECT_EQ(json_path_at(R"({"k": "v\"x", "arr": [0, "s", {"d": "e"}]})", 33), "a key of 'arr[2]'");
  EXPECT_EQ(json_path_at(R"({"k": "v\"x", "arr": [0, "s"]})", 8), "k");  // an escaped quote does not end it
  EXPECT_EQ(json_path_at(R"(["a", "b"])", 7), "[1]");
  // Valid UTF-8 everywhere, escapes included.
  EXPECT_EQ(parse_request_body("{\"p\": \"\xE6\x97\xA5 \\u00e9 \\ud83d\\ude00\"}")["p"].get<std::string>(), "\xE6\x97\xA5 \xC3\xA9 \xF0\x9F\x98\x80");
}

TEST(ServeRequest, DumpNeverThrows) {
  const json bad = {{"error", std::string("bytes \xFF\xE6\x97 end")}};
  EXPECT_THROW(bad.dump(), json::type_error);  // what the server used to do (HTTP 500)
  EXPECT_EQ(dump_json(bad), "{\"error\":\"bytes \xEF\xBF\xBD\xEF\xBF\xBD end\"}");
}

class ServeReplies : public ::testing::Test {
 protected:
  void SetUp() override {
    data::testing::write_tiny_vocab(dir_.path(), {{"\xE6", "\x97"}, {"\xF0", "\x9F"}, {"a", "b"}});
    tok_ = std::make_unique<data::Gpt2Tokenizer>(
        data::Gpt2Tokenizer::from_files(dir_.file("vocab.json"), dir_.file("merges.txt")));
  }
  data::testing::TempDir dir_;
  std::unique_ptr<data::Gpt2Tokenizer> tok_;
};

// Random sampled sequences after UTF-8 prompts: every reply serialises, is valid UTF-8, and its
// text is what Hugging Face's decode(errors="replace") gives; segments concatenate to the text.
TEST_F(ServeReplies, RandomSequencesSerialise) {
  std::mt19937 rng(37);
  const std::vector<std::string> prompts = {"\xF0\x9F\x98\x80 emoji", "\xE6\x97\xA5\xE6\x9C\xAC", "\xD0\x9F\xD1\x80\xD0\xB8"};
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::vector<int32_t>> seqs;
    for (const auto& p : prompts) {
      std::vector<int32_t> ids = tok_->encode(p);
      const size_t prompt_len = ids.size();
      for (int k = 0; k < 12; ++k) ids.push_back(static_cast<int32_t>(rng() % tok_->vocab_size()));
      seqs.push_back(ids);
      const CompletionText c = completion_text(*tok_, ids, static_cast<int64_t>(prompt_len), false, {});
      EXPECT_EQ(data::utf8_first_invalid(c.text), std::string::npos);
      EXPECT_EQ(p + c.text, data::utf8_replace_invalid(tok_->decode(ids)));  // the prompt is complete text
    }
    const json reply = megatron_api_reply(*tok_, seqs);
    const std::string text = reply.dump();  // throws on invalid UTF-8
    EXPECT_EQ(json::parse(text), reply);
    for (size_t i = 0; i < seqs.size(); ++i) {
      EXPECT_EQ(reply["text"][i].get<std::string>(), data::utf8_replace_invalid(tok_->decode(seqs[i])));
      std::string joined;
      for (const auto& s : reply["segments"][i]) joined += s.get<std::string>();
      EXPECT_EQ(joined, reply["text"][i].get<std::string>());
      EXPECT_EQ(reply["segments"][i].size(), seqs[i].size());
    }
  }
}

TEST_F(ServeReplies, CompletionTextAfterThePrompt) {
  // The prompt's last token leaves U+65E5 incomplete ([E6 97]); the generated [A5] completes it:
  // the completion holds the whole character, echo gives the whole text.
  const std::vector<int32_t> seq = {tok_->token_to_id("x"), tok_->token_to_id("\xE6\x97"), tok_->token_to_id("\xA5"),
                                    tok_->token_to_id("ab"), tok_->token_to_id("!"), tok_->token_to_id("c")};
  EXPECT_EQ(completion_text(*tok_, seq, 2, false, {}).text, "\xE6\x97\xA5" "ab!c");
  EXPECT_EQ(completion_text(*tok_, seq, 2, true, {}).text, "x\xE6\x97\xA5" "ab!c");
  const CompletionText s = completion_text(*tok_, seq, 2, false, {"!c", "b!"});
  EXPECT_EQ(s.text, "\xE6\x97\xA5" "a");  // the earliest stop string
  EXPECT_TRUE(s.stopped_by_string);
  EXPECT_EQ(completion_text(*tok_, seq, 2, true, {"!"}).text, "x\xE6\x97\xA5" "ab");
  EXPECT_FALSE(completion_text(*tok_, seq, 2, false, {"zz"}).stopped_by_string);
  // A sequence that ends inside a character: U+FFFD, as Hugging Face decodes it.
  EXPECT_EQ(completion_text(*tok_, std::span<const int32_t>(seq).first(2), 1, false, {}).text, "\xEF\xBF\xBD");
}

}  // namespace
}  // namespace mt
