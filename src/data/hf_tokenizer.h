// Hugging Face `tokenizers` byte-level BPE (tokenizer.json), as shipped with GPT-2, GPT-NeoX-style,
// Llama-3 and Qwen-2/3 models: Megatron's HuggingFaceTokenizer with --tokenizer-model.
//
// Supported tokenizer.json content (anything else is a clear mt::Error naming the field):
//   model:         type "BPE" with vocab + merges ("a b" strings or ["a", "b"] pairs), ignore_merges,
//                  dropout null, no byte_fallback, no continuing_subword_prefix / end_of_word_suffix;
//                  tokens in GPT-2's byte-level alphabet. (WordPiece, Unigram, WordLevel: error.)
//   normalizer:    null (an NFC normalizer is rejected: not implemented)
//   pre_tokenizer: ByteLevel (add_prefix_space, use_regex with GPT-2's regex), Split with one of the
//                  known regexes (GPT-2's; Llama-3's `(?i:'s|'t|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//                  ...`; Qwen-2's, the same with \p{N}), behavior "Isolated", invert false, or a
//                  Sequence of these. The regexes are implemented by hand on data/unicode.h.
//   added_tokens:  matched in the raw text before pre-tokenization, leftmost-longest (as the
//                  library's AddedVocabulary), with lstrip/rstrip; single_word is rejected.
//   post_processor: null, ByteLevel, TemplateProcessing ("single" template: special tokens + $A),
//                  or a Sequence of these. encode() applies it (add_special_tokens=True, which is
//                  what Megatron's HuggingFaceTokenizer.text_to_ids does by default), e.g. Llama-3's
//                  <|begin_of_text|>.
// eod(): the id of tokenizer_config.json's "eos_token" (read from the same directory when present,
// as Megatron's eod = eos_token_id), else of the first added/vocab token among <|endoftext|>,
// <|end_of_text|>, </s>.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace mt::data {

class HfTokenizer final : public Tokenizer {
 public:
  /// `path`: a tokenizer.json file, or a directory containing tokenizer.json (and optionally
  /// tokenizer_config.json). Errors: missing files, malformed JSON, unsupported content (above).
  static HfTokenizer from_file(const std::string& path);
  /// From file contents; config_json may be empty. `name` is used in messages.
  static HfTokenizer from_json(std::string_view tokenizer_json, std::string_view config_json,
                               const std::string& name = "<tokenizer.json>");

  void encode_append(std::string_view text, std::vector<int32_t>* out) const override;
  /// encode with add_special_tokens = false skips the post-processor's template tokens.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;
  std::vector<int32_t> encode(std::string_view text) const override { return encode(text, true); }
  /// Concatenated bytes of the tokens (added tokens as their content). Error: unknown id.
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t eod() const override;
  /// 1 + the largest id of the vocabulary and the added tokens (len(tokenizer) in transformers).
  int64_t vocab_size() const override;
  std::string name() const override { return "HuggingFaceTokenizer"; }
  /// Id of a vocabulary token given as raw bytes, or of an added token given by its content; -1 if none.
  int32_t token_to_id(std::string_view token) const;

  /// Pieces of `text` under the configured pre-tokenizer regex(es), before byte-level mapping
  /// (exposed for tests).
  std::vector<std::string_view> pretokenize(std::string_view text) const;
  /// The Llama-3 (max_digits = 3) / Qwen-2 (max_digits = 1) split regex, by hand.
  static std::vector<std::string_view> pretokenize_llama3(std::string_view text, int max_digits);
  /// The family of split regexes written by hand here (alternatives in this order):
  ///   (?i:'s|'t|'re|'ve|'m|'ll|'d)                      when contractions
  ///   [^\r\n\p{L}\p{N}]?\p{L}+                              plain letters, or when cased_letters
  ///   [^\r\n\p{L}\p{N}]?U*W+|[^\r\n\p{L}\p{N}]?U+W*            U = [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}],
  ///                                                     W = [\p{Ll}\p{Lm}\p{Lo}\p{M}]
  ///   \p{N}{1,max_digits}
  ///   ' ?[^\s\p{L}\p{N}]+[\r\n]*'  ('[\r\n/]*' when slash_after_punctuation)
  ///   \s*[\r\n]+|\s+(?!\S)|\s+
  /// Llama 3: {true, 3, false, false}; Qwen 2: {true, 1, ...}; tiktoken patterns: TikTokenizer.
  struct SplitPattern {
    bool contractions = true;
    int max_digits = 3;
    bool cased_letters = false;
    bool slash_after_punctuation = false;
  };
  static std::vector<std::string_view> pretokenize_split(std::string_view text, const SplitPattern& pattern);

 private:
  struct Impl;
  explicit HfTokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace mt::data
