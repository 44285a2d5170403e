#include "data/tokenizer.h"

#include <cerrno>
#include <cstdlib>

#include "core/check.h"
#include "data/gpt2_tokenizer.h"
#include "data/hf_tokenizer.h"
#include "data/tiktoken_tokenizer.h"

#ifdef MT_WITH_SENTENCEPIECE
#include <sentencepiece_processor.h>
#endif

namespace mt::data {

NullTokenizer::NullTokenizer(int64_t vocab_size, int32_t eod) : vocab_size_(vocab_size) {
  MT_REQUIRE(vocab_size >= 1 && vocab_size <= INT32_MAX, "NullTokenizer: --vocab-size {} must be in [1, 2^31)",
             vocab_size);
  eod_ = eod >= 0 ? eod : static_cast<int32_t>(vocab_size - 1);
  MT_REQUIRE(eod_ < vocab_size, "NullTokenizer: EOD id {} outside [0, {})", eod_, vocab_size);
}

void NullTokenizer::encode_append(std::string_view text, std::vector<int32_t>* out) const {
  // Python: [int(x) for x in text.split(' ')]. An empty text gives no ids (Megatron would raise).
  if (text.empty()) return;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t sp = text.find(' ', pos);
    if (sp == std::string_view::npos) sp = text.size();
    const std::string word(text.substr(pos, sp - pos));
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(word.c_str(), &end, 10);
    bool ok = !word.empty() && end != word.c_str() && errno == 0;
    while (ok && *end != '\0' && (*end == '\n' || *end == '\t' || *end == '\r')) ++end;
    ok = ok && *end == '\0';
    MT_REQUIRE(ok, "NullTokenizer: '{}' is not an integer (text must be space-separated token ids)", word);
    MT_REQUIRE(v >= 0 && v < vocab_size_, "NullTokenizer: id {} outside [0, {})", v, vocab_size_);
    out->push_back(static_cast<int32_t>(v));
    pos = sp + 1;
  }
}

std::string NullTokenizer::decode(std::span<const int32_t> ids) const {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    MT_REQUIRE(ids[i] >= 0 && ids[i] < vocab_size_, "NullTokenizer decode: id {} outside [0, {})", ids[i], vocab_size_);
    if (i) s.push_back(' ');
    s += std::to_string(ids[i]);
  }
  return s;
}

#ifdef MT_WITH_SENTENCEPIECE
namespace {
// Megatron's SentencePieceTokenizer/GPTSentencePieceTokenizer core: encode_as_ids, eod = eos id.
class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& model) {
    const auto status = sp_.Load(model);
    MT_REQUIRE(status.ok(), "SentencePieceTokenizer: cannot load --tokenizer-model '{}': {}", model,
               status.ToString());
  }
  void encode_append(std::string_view text, std::vector<int32_t>* out) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(std::string(text), &ids);
    MT_REQUIRE(status.ok(), "SentencePieceTokenizer: encode failed: {}", status.ToString());
    out->insert(out->end(), ids.begin(), ids.end());
  }
  std::string decode(std::span<const int32_t> ids) const override {
    std::vector<int> v(ids.begin(), ids.end());
    for (int id : v) {
      MT_REQUIRE(id >= 0 && id < sp_.GetPieceSize(), "SentencePieceTokenizer decode: id {} outside [0, {})", id,
                 sp_.GetPieceSize());
    }
    std::string s;
    const auto status = sp_.Decode(v, &s);
    MT_REQUIRE(status.ok(), "SentencePieceTokenizer: decode failed: {}", status.ToString());
    return s;
  }
  int32_t eod() const override {
    MT_REQUIRE(sp_.eos_id() >= 0, "SentencePieceTokenizer: the model has no EOS piece");
    return sp_.eos_id();
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::string name() const override { return "SentencePieceTokenizer"; }

 private:
  sentencepiece::SentencePieceProcessor sp_;
};
}  // namespace
#endif

bool sentencepiece_available() {
#ifdef MT_WITH_SENTENCEPIECE
  return true;
#else
  return false;
#endif
}

std::vector<std::string> supported_tokenizer_types() {
  std::vector<std::string> t = {"GPT2BPETokenizer", "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer"};
  if (sentencepiece_available()) t.push_back("SentencePieceTokenizer");
  return t;
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& type, const std::string& vocab_file,
                                          const std::string& merge_file, const std::string& tokenizer_model,
                                          int64_t vocab_size, const TikTokenOptions& tiktoken) {
  if (type == "GPT2BPETokenizer") {
    MT_REQUIRE(!vocab_file.empty() && !merge_file.empty(), "GPT2BPETokenizer needs --vocab-file and --merge-file");
    return std::make_unique<Gpt2Tokenizer>(Gpt2Tokenizer::from_files(vocab_file, merge_file));
  }
  if (type == "HuggingFaceTokenizer") {
    MT_REQUIRE(!tokenizer_model.empty(),
               "HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or a directory containing one)");
    return std::make_unique<HfTokenizer>(HfTokenizer::from_file(tokenizer_model));
  }
  if (type == "TikTokenizer") {
    MT_REQUIRE(!tokenizer_model.empty(),
               "TikTokenizer needs --tokenizer-model (Megatron's JSON list of base64 tokens, or a tiktoken "
               ".tiktoken / Llama 3 tokenizer.model file)");
    TikTokenOptions o = tiktoken;
    o.vocab_size = vocab_size;
    return std::make_unique<TikTokenizer>(TikTokenizer::from_file(tokenizer_model, o));
  }
  if (type == "NullTokenizer") {
    MT_REQUIRE(vocab_size > 0, "NullTokenizer needs --vocab-size");
    return std::make_unique<NullTokenizer>(vocab_size);
  }
  if (type == "SentencePieceTokenizer" || type == "GPTSentencePieceTokenizer" || type == "Llama2Tokenizer") {
#ifdef MT_WITH_SENTENCEPIECE
    MT_REQUIRE(!tokenizer_model.empty(), "{} needs --tokenizer-model (a SentencePiece .model file)", type);
    return std::make_unique<SentencePieceTokenizer>(tokenizer_model);
#else
    MT_FAIL("--tokenizer-type {}: this build has no SentencePiece support (it needs libsentencepiece-dev at build "
            "time; see docs/data.md)",
            type);
#endif
  }
  std::string list;
  for (const auto& t : supported_tokenizer_types()) list += (list.empty() ? "" : ", ") + t;
  MT_FAIL("unknown --tokenizer-type '{}' (supported: {})", type, list);
}

}  // namespace mt::data
