// Detokenizers.
//  * Token ids -> text that is valid UTF-8 by construction (generate, serve): a byte-level tokenizer
//    (GPT-2 BPE, Hugging Face byte-level BPE) decodes a token to raw bytes, and a character may be
//    split across tokens, or a sampled sequence may never complete one. utf8_replace_invalid gives
//    what Hugging Face's decoders give for the same bytes (Python's bytes.decode("utf-8",
//    errors="replace"), Rust's String::from_utf8_lossy); IncrementalDetokenizer gives the same text
//    token by token, holding back the bytes of a character until it is complete (the streaming
//    detokenisers of Hugging Face TGI and vLLM do the same).
//  * The zero-shot evaluation texts (Megatron-LM tasks/zeroshot_gpt/detokenizer.py): WikiText-103
//    and Penn Treebank ship pre-tokenized ("word @-@ word", "don 't", "( x )"); Megatron undoes that
//    before tokenizing with the model's tokenizer, choosing the detokenizer by the file path. The
//    rules below give Megatron's output for the same input (same replacements, same order).
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace mt::data {

/// The UTF-8 text of `bytes` with every ill-formed part replaced by U+FFFD, one per maximal
/// subpart (Unicode 15 section 3.9, "U+FFFD Substitution of Maximal Subparts"): a byte that cannot
/// start a character (80..BF, C0, C1, F5..FF) is one U+FFFD; a valid start followed by fewer
/// continuation bytes than it needs (or by a byte outside the range its position allows: E0 A0..BF,
/// ED 80..9F, F0 90..BF, F4 80..8F) is one U+FFFD for the start and the continuations that fit.
/// Equal to Python's bytes.decode("utf-8", errors="replace") and Rust's String::from_utf8_lossy
/// (Hugging Face tokenizers' decoders). E.g. "\xE2\x82" -> U+FFFD, "\xED\xA0\x80" -> 3 x U+FFFD.
std::string utf8_replace_invalid(std::string_view bytes);

/// Offset of the first byte of `bytes` that is not part of a well-formed UTF-8 character (an
/// incomplete character at the end counts), or std::string::npos when all of it is valid.
size_t utf8_first_invalid(std::string_view bytes);

/// Bytes at the end of `bytes` that may still become a character: the start of a well-formed
/// sequence and the continuation bytes that fit it, cut short by the end (0..3 bytes; 0 when the
/// text ends with a complete character or with bytes that can never complete).
size_t utf8_incomplete_tail(std::string_view bytes);

/// Token-by-token detokenization whose pieces are valid UTF-8 and concatenate to
/// utf8_replace_invalid(tok.decode(all ids)) for byte-level and NullTokenizer tokenizers (the
/// text of the whole sequence, as Hugging Face decodes it). push(id) returns the text the token
/// completes: bytes of a character still incomplete, and a trailing U+FFFD a tokenizer produced
/// itself (SentencePiece's byte fallback replaces a partial character with U+FFFD until it
/// completes), are held back until a later token completes them; finish() returns what is held,
/// an incomplete character as U+FFFD. Each push decodes a window of a few tokens (the last emitted
/// tokens as context, so that tokenizers that join pieces with spaces or strip a leading space
/// see their neighbours). Errors: the tokenizer's, for an id outside its vocabulary.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tok) : tok_(&tok) {}
  std::string push(int32_t id);
  std::string finish();

 private:
  static constexpr size_t kContextTokens = 4;
  const Tokenizer* tok_;
  std::vector<int32_t> window_;  ///< context tokens (already emitted) + tokens not fully emitted
  size_t emitted_ = 0;           ///< bytes of tok_->decode(window_) already returned
};

/// The text of `ids` as Hugging Face decodes it (utf8_replace_invalid of the tokenizer's decode)
/// and the text each token completes (IncrementalDetokenizer; what finish() returns goes to the
/// last piece): the pieces concatenate to the text for the byte-level tokenizers and NullTokenizer,
/// and for SentencePiece wherever its decoder only appends to the text of a prefix.
struct DetokenizedText {
  std::string text;
  std::vector<std::string> pieces;
};
DetokenizedText detokenize_pieces(const Tokenizer& tok, std::span<const int32_t> ids);

/// WikiText detokenization, in this order: "s '" -> "s'"; the literal "/' d/" -> "/'[0-9]/" for a
/// digit d (Megatron's pattern, which only matches slash-delimited text, kept for identical
/// output); " @-@ " -> "-", " @,@ " -> ",", " @.@ " -> "."; " : ", " ; ", " . ", " ! ", " ? ",
/// " , " lose their leading space; whitespace just inside (), [], {}, "" and '' pairs is removed
/// (each opening character paired with the next closing one, scanning left to right);
/// "= = = =" -> "====", "= = =" -> "===", "= =" -> "=="; " ° " -> "°"; " \n" -> "\n";
/// "\n " -> "\n"; " N " -> " 1 "; " 's" -> "'s". Every replacement is global, left to right and
/// non-overlapping (Python's str.replace / re.sub).
std::string wikitext_detokenize(std::string text);

/// Penn Treebank detokenization: " '" -> "'", " \n" -> "\n", "\n " -> "\n", " n't" -> "n't",
/// " N " -> "1 ", "$ 1" -> "$1", "# 1" -> "#1".
std::string ptb_detokenize(std::string text);

/// Megatron's get_detokenizer: the first of "ptb", "wiki", "lambada" that occurs in `path` picks
/// the detokenizer ("lambada": none); "" when none occurs (the text is used as it is). Returns the
/// name chosen ("ptb", "wikitext", "lambada" or "").
const char* detokenizer_for(const std::string& path);
/// Applies detokenizer_for(path) to text.
std::string detokenize_for(const std::string& path, std::string text);

}  // namespace mt::data
