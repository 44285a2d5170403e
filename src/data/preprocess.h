// `megatron preprocess-data`: text -> tokens -> Megatron indexed dataset, as Megatron-LM's
// tools/preprocess_data.py does (one sequence per document; no sentence splitting).
//
// Inputs, in the order given:
//   *.txt file   one document (the whole file, bytes as they are), output key "text";
//   directory    all its *.txt files sorted by name, each one document;
//   other file   JSON lines (.jsonl/.json): one JSON object per line; blank lines are skipped; for each
//                key in json_keys, the string value becomes one document of output `key` (a list of
//                strings, as Megatron accepts, is one document with one sequence per non-empty string).
// Outputs: {output_prefix}_{key}_document.bin/.idx for each key (Megatron's naming), all inputs
// concatenated in order. Token dtype: uint16 if the vocabulary has < 65,500 tokens, else int32.
// With append_eod, the tokenizer's end-of-document id follows every non-empty document (an empty
// text stays an empty document, as in Megatron).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace mt::data {

struct PreprocessConfig {
  std::vector<std::string> inputs;      ///< --input: files or directories (see above)
  std::string output_prefix;            ///< --output-prefix
  std::vector<std::string> json_keys{"text"};  ///< --json-keys
  bool append_eod = false;              ///< --append-eod
  std::string vocab_file, merge_file;   ///< --vocab-file, --merge-file
  int workers = 1;                      ///< --workers: tokenizer threads (output order is input order)
  std::string tokenizer_type = "GPT2BPETokenizer";  ///< --tokenizer-type (any of make_tokenizer's)
  std::string tokenizer_model;          ///< --tokenizer-model (HuggingFaceTokenizer, SentencePieceTokenizer)
  int64_t vocab_size = 0;               ///< --vocab-size (NullTokenizer, TikTokenizer)
  TikTokenOptions tiktoken;             ///< --tiktoken-* (TikTokenizer)
  bool split_sentences = false;         ///< --split-sentences: one sequence per sentence (split_into_sentences),
                                        ///< outputs named {prefix}_{key}_sentence.bin/.idx as Megatron's
  int64_t log_interval = 1000;          ///< --log-interval: documents between progress lines (stderr)
};

struct PreprocessStats {
  int64_t documents = 0;   ///< documents read (per key)
  int64_t tokens = 0;      ///< tokens written, all keys
  int64_t bytes = 0;       ///< input bytes read
  double seconds = 0;
  std::vector<std::string> output_prefixes;  ///< one per key: {output_prefix}_{key}_document
};

/// Runs the conversion. Errors (mt::Error): empty input list or output prefix, no json keys, an
/// unsupported tokenizer type, a missing input (or a directory without *.txt files), .txt inputs
/// mixed with JSON-lines inputs while json_keys != {"text"}, a JSON-lines line that is not valid JSON
/// or not an object (naming file and line), a missing key or a value that is neither a string nor a
/// list of strings (naming file, line and key), tokenizer file errors, I/O errors. Outputs are renamed
/// into place only when the whole run succeeded; a failed run leaves no partial or temporary files.
PreprocessStats preprocess_data(const PreprocessConfig& config);

/// --split-sentences: a rule-based sentence splitter (NOT NLTK punkt, which Megatron uses; results
/// differ on abbreviations and unusual punctuation). A boundary is terminal punctuation [.!?]+, then
/// closing quotes/brackets, then whitespace, then an upper-case ASCII letter, a digit, an opening
/// quote/bracket or a non-ASCII character; "X." after a single letter is not a boundary. Sentences
/// are views into `text` without the whitespace between them (as punkt's span_tokenize).
std::vector<std::string_view> split_into_sentences(std::string_view text);

/// Megatron's tools/merge_datasets.py: concatenates the indexed datasets `input_prefixes` (same
/// dtype) into `output_prefix`, keeping their sequences and document boundaries in order.
/// Errors: no inputs, a dtype mismatch (naming both), the IndexedDataset errors.
void merge_datasets(const std::vector<std::string>& input_prefixes, const std::string& output_prefix);

}  // namespace mt::data
