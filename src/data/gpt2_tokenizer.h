// GPT-2 byte-level BPE tokenizer (Radford et al. 2019; OpenAI's gpt-2/src/encoder.py, which
// Megatron-LM's GPT2BPETokenizer wraps as megatron/training/tokenizer/gpt2_tokenization.py).
//
// Files: vocab.json + merges.txt (Hugging Face names) or encoder.json + vocab.bpe (OpenAI names); the
// content is the same. The vocabulary maps byte-level token strings to ids; the merges file lists BPE
// merges "a b", one per line, highest priority first, after an optional "#version" line.
//
// encode(text):
//   1. pre-tokenization with GPT-2's regex
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      implemented by hand over UTF-8 code points (see pretokenize()); \p{L}, \p{N} and \s come from
//      generated Unicode tables (data/unicode.h). Bytes that are not valid UTF-8 are units of their own
//      in the class [^\s\p{L}\p{N}], so any byte string round-trips.
//   2. each piece's bytes are merged by BPE rank exactly as encoder.py's bpe(): repeatedly take the
//      lowest-ranked adjacent pair and merge all its occurrences left to right; results are cached.
// "<|endoftext|>" in the text is plain text (as in GPT-2's encoder); eod() is its id (50256), which
// preprocess-data --append-eod appends after each document.
// decode(ids) concatenates the tokens' bytes and returns them as they are (no UTF-8 repair, so
// decode(encode(x)) == x for every byte string x).
//
// Thread safety: a Gpt2Tokenizer is immutable except for its internal, mutex-sharded BPE cache; encode
// and decode may be called from several threads at once. Copies share the same state and cache.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace mt::data {

/// Megatron's GPT2BPETokenizer (implements Tokenizer; copies share state).
class Gpt2Tokenizer final : public Tokenizer {
 public:
  /// Loads vocab.json/encoder.json and merges.txt/vocab.bpe.
  /// Errors (mt::Error, naming the file): missing or unreadable file; malformed JSON or a vocabulary
  /// that is not an object of non-negative integer ids forming 0..V-1 exactly once; a token with a
  /// character outside GPT-2's byte alphabet; a vocabulary lacking one of the 256 single-byte tokens;
  /// a merges line that is not "a b" (named with its line number), or whose parts or result are not
  /// in the vocabulary.
  static Gpt2Tokenizer from_files(const std::string& vocab_path, const std::string& merges_path);
  /// Same from in-memory file contents; `vocab_name`/`merges_name` are used in error messages.
  static Gpt2Tokenizer from_strings(std::string_view vocab_json, std::string_view merges_txt,
                                    const std::string& vocab_name = "<vocab>",
                                    const std::string& merges_name = "<merges>");

  /// Token ids of `text` (any bytes; UTF-8 expected).
  std::vector<int32_t> encode(std::string_view text) const override;
  /// Appends the token ids of `text` to *out.
  void encode_append(std::string_view text, std::vector<int32_t>* out) const override;

  /// Concatenated bytes of the tokens. Error: an id outside [0, vocab_size) (named with the size).
  std::string decode(const std::vector<int32_t>& ids) const;
  std::string decode(std::span<const int32_t> ids) const override;
  /// Bytes of one token. Same error.
  std::string decode_token(int32_t id) const;
  /// Id of a token given by its raw bytes (e.g. "Hello", " world"), or -1 if not in the vocabulary.
  int32_t token_to_id(std::string_view token_bytes) const;

  /// Id of "<|endoftext|>" (50256 for GPT-2). Error if the vocabulary has no such token.
  int32_t eod() const override;
  /// Number of entries in the vocabulary (50257 for GPT-2); ids are 0..vocab_size()-1.
  int64_t vocab_size() const override;
  std::string name() const override { return "GPT2BPETokenizer"; }
  /// Number of merges (50000 for GPT-2).
  int64_t num_merges() const;

  /// GPT-2's pre-tokenization of `text`: consecutive pieces (views into `text`) whose concatenation
  /// is `text`.
  static std::vector<std::string_view> pretokenize(std::string_view text);

  /// GPT-2's byte -> printable code point map (bytes_to_unicode() in encoder.py).
  static char32_t byte_to_unicode(uint8_t b);

 private:
  struct Impl;
  explicit Gpt2Tokenizer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace mt::data
