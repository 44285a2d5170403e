// Detokenizers for the zero-shot evaluation texts (Megatron-LM tasks/zeroshot_gpt/detokenizer.py):
// WikiText-103 and Penn Treebank ship pre-tokenized ("word @-@ word", "don 't", "( x )"); Megatron
// undoes that before tokenizing with the model's tokenizer, choosing the detokenizer by the file
// path. The rules below give Megatron's output for the same input (same replacements, same order).
#pragma once
#include <string>

namespace mt::data {

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
