// Megatron-LM's TikTokenizer (--tokenizer-type TikTokenizer; megatron/core/tokenizers/text/
// libraries/tiktoken_tokenizer.py, which wraps OpenAI's tiktoken): byte-level BPE by merge ranks.
//
// Vocabulary files (--tokenizer-model), by their first non-blank character:
//   '['   Megatron's JSON list [{"rank": i, "token_bytes": base64, "token_str": ...}, ...], entry i
//         of rank i, entries 0..255 the single bytes 0..255 (reload_mergeable_ranks)
//   else  tiktoken's text format (cl100k_base.tiktoken, o200k_base.tiktoken, Llama 3's
//         tokenizer.model): one "base64 rank" per line, ranks 0, 1, 2, ... in order
// Ids (Megatron's layout): 0 .. num_special_tokens-1 are the special tokens (the given list, which
// must hold <unk> <s> </s> <mask> <pad> <cls> <sep>; default exactly those, in that order), then
// "<SPECIAL_k>" fillers up to num_special_tokens; rank r is id r + num_special_tokens, for the first
// vocab_size - num_special_tokens ranks of the file. EOD = the id of "</s>".
//
// Encoding (tiktoken's Encoding.encode with allowed_special="all"): the text is cut at every
// special token's text (leftmost, longest where two start at one place); between them the
// pre-tokenizer pattern splits the text (data/hf_tokenizer.h HfTokenizer::pretokenize_split):
//   v1  [^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+
//   v2  [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|
//       [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|
//        ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
// and each piece is one token when its bytes have a rank, else tiktoken's byte_pair_merge: start
// from single bytes and repeatedly merge the adjacent pair whose concatenated bytes have the lowest
// rank (the leftmost among equals) until no adjacent pair has a rank.
// Decoding concatenates the tokens' bytes (special tokens as their text); a caller that needs
// valid UTF-8 applies utf8_replace_invalid (data/detokenizer.h), which is tiktoken's
// decode(errors="replace").
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace mt::data {

class TikTokenizer final : public Tokenizer {
 public:
  /// Reads `path` (either format). Errors (mt::Error naming the file and line / entry): unreadable
  /// file, bad JSON or base64, ranks out of order, a repeated token, a JSON entry i < 256 that is
  /// not byte i, a single byte without a rank, fewer ranks than vocab_size - num_special_tokens; and
  /// the options' errors (from_ranks).
  static TikTokenizer from_file(const std::string& path, const TikTokenOptions& options);
  /// The tokens' bytes in rank order. Errors: pattern not v1 / v2; special tokens repeated or
  /// missing one of Megatron's seven; not len(special tokens) <= num_special_tokens < vocab_size;
  /// the rank errors above.
  static TikTokenizer from_ranks(std::vector<std::string> token_bytes, const TikTokenOptions& options,
                                 const std::string& name = "ranks");

  void encode_append(std::string_view text, std::vector<int32_t>* out) const override;
  /// The tokens' bytes concatenated (special tokens as their text). Error: an id outside the vocabulary.
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t eod() const override;
  int64_t vocab_size() const override;
  std::string name() const override { return "TikTokenizer"; }

  /// The pieces `text` (without special tokens) is split into (exposed for tests).
  std::vector<std::string_view> pretokenize(std::string_view text) const;
  /// The ids of one piece (tiktoken's byte_pair_encode; exposed for tests).
  std::vector<int32_t> encode_piece(std::string_view piece) const;

 private:
  struct Impl;
  explicit TikTokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace mt::data
