// The tokenizer interface of the data layer (Megatron's --tokenizer-type) and its factory.
//
//   GPT2BPETokenizer       --vocab-file, --merge-file (data/gpt2_tokenizer.h)
//   HuggingFaceTokenizer   --tokenizer-model: a tokenizer.json of model type BPE with a byte-level
//                          pre-tokenizer, or a directory holding one (data/hf_tokenizer.h)
//   SentencePieceTokenizer --tokenizer-model: a SentencePiece .model file; only when built with
//                          MT_WITH_SENTENCEPIECE (Debian's libsentencepiece-dev), else an error
//   TikTokenizer           --tokenizer-model: Megatron's JSON list of base64 tokens or a tiktoken
//                          .tiktoken / Llama 3 tokenizer.model file (data/tiktoken_tokenizer.h)
//   NullTokenizer          --vocab-size: text is space-separated integer ids; EOD = vocab_size - 1
//                          (megatron/core/tokenizers/text/libraries/null_tokenizer.py)
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mt::data {

/// Text <-> token ids. Implementations are immutable after construction and thread-safe.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// Appends the token ids of `text` to *out (what Megatron's tokenizer.tokenize(text) returns).
  virtual void encode_append(std::string_view text, std::vector<int32_t>* out) const = 0;
  virtual std::vector<int32_t> encode(std::string_view text) const {
    std::vector<int32_t> ids;
    encode_append(text, &ids);
    return ids;
  }
  /// Text of the ids. Error: an id outside [0, vocab_size()).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  /// End-of-document id (Megatron's tokenizer.eod). Error if the tokenizer has none.
  virtual int32_t eod() const = 0;
  /// Number of ids (before Megatron's padding to --make-vocab-size-divisible-by).
  virtual int64_t vocab_size() const = 0;
  /// The --tokenizer-type name, e.g. "GPT2BPETokenizer".
  virtual std::string name() const = 0;
};

/// --tiktoken-pattern, --tiktoken-num-special-tokens, --tokenizer-special-tokens (and the older
/// --tiktoken-special-tokens), --vocab-size.
struct TikTokenOptions {
  std::string pattern = "v2";
  int64_t num_special_tokens = 1000;
  std::vector<std::string> special_tokens;  ///< empty: Megatron's SPECIAL_TOKENS
  int64_t vocab_size = 0;                   ///< ids in all (0: Megatron's default 2^17 = 131072)
};

/// Megatron's NullTokenizer: encode("3 17 5") = {3, 17, 5}; decode joins ids with spaces;
/// eod = vocab_size - 1 unless given.
class NullTokenizer final : public Tokenizer {
 public:
  /// Errors: vocab_size < 1; eod outside [0, vocab_size).
  explicit NullTokenizer(int64_t vocab_size, int32_t eod = -1);
  /// Error: a word that is not an integer, or an id outside [0, vocab_size).
  void encode_append(std::string_view text, std::vector<int32_t>* out) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t eod() const override { return eod_; }
  int64_t vocab_size() const override { return vocab_size_; }
  std::string name() const override { return "NullTokenizer"; }

 private:
  int64_t vocab_size_;
  int32_t eod_;
};

/// Names accepted by make_tokenizer.
std::vector<std::string> supported_tokenizer_types();
/// True when SentencePieceTokenizer is compiled in (MT_WITH_SENTENCEPIECE).
bool sentencepiece_available();

/// Builds the tokenizer named by `type` (Megatron's --tokenizer-type). Errors (mt::Error): an unknown
/// type (listing the supported ones), a missing required file/flag for the type (naming the flag),
/// SentencePieceTokenizer without MT_WITH_SENTENCEPIECE, and the tokenizers' own file errors.
/// vocab_size: --vocab-size (NullTokenizer; TikTokenizer: ids in all, 0 = 131072); tiktoken: the
/// TikTokenizer's other options.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& type, const std::string& vocab_file,
                                          const std::string& merge_file, const std::string& tokenizer_model,
                                          int64_t vocab_size, const TikTokenOptions& tiktoken = {});

}  // namespace mt::data
