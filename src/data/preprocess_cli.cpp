#include "data/preprocess_cli.h"

#include "core/cli_validators.h"

#include <CLI/CLI.hpp>
#include <memory>

#include "data/data_args.h"
#include "data/preprocess.h"

namespace mt::data {

void add_preprocess_data_command(CLI::App& app) {
  auto cfg = std::make_shared<PreprocessConfig>();
  CLI::App* sub = app.add_subcommand(
      "preprocess-data", "Tokenize text (JSON lines or .txt files) into a Megatron indexed dataset (.bin/.idx)");
  sub->add_option("--input", cfg->inputs,
                  "Input files or directories: JSON lines (one object per line), .txt files (one document each), "
                  "or directories of .txt files (sorted by name)")
      ->required()
      ->expected(1, -1);
  sub->add_option("--output-prefix", cfg->output_prefix,
                  "Output prefix; writes {prefix}_{key}_document.bin/.idx for each JSON key")
      ->required();
  sub->add_option("--json-keys", cfg->json_keys, "Keys to extract from each JSON line")
      ->expected(1, -1)
      ->capture_default_str();
  sub->add_flag("--append-eod", cfg->append_eod, "Append the end-of-document token to each non-empty document");
  sub->add_option("--tokenizer-type", cfg->tokenizer_type,
                  "GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer (SentencePieceTokenizer when built with it)")
      ->capture_default_str();
  sub->add_option("--vocab-file", cfg->vocab_file, "GPT-2 vocabulary (vocab.json / encoder.json)");
  sub->add_option("--merge-file", cfg->merge_file, "GPT-2 merges (merges.txt / vocab.bpe)");
  sub->add_option("--tokenizer-model", cfg->tokenizer_model, "tokenizer.json (or its directory) / SentencePiece model");
  sub->add_option("--vocab-size", cfg->vocab_size, "NullTokenizer vocabulary size (TikTokenizer: ids in all)");
  add_tiktoken_options(*sub, cfg->tiktoken);
  sub->add_flag("--split-sentences", cfg->split_sentences,
                "One sequence per sentence (rule-based splitter; Megatron uses NLTK punkt)");
  sub->add_option("--workers", cfg->workers, "Tokenizer threads")
      ->check(positive_integer())
      ->capture_default_str();
  sub->add_option("--log-interval", cfg->log_interval, "Documents between progress lines on stderr")
      ->check(positive_integer())
      ->capture_default_str();
  sub->callback([cfg] { preprocess_data(*cfg); });
}

void add_merge_datasets_command(CLI::App& app) {
  auto inputs = std::make_shared<std::vector<std::string>>();
  auto output = std::make_shared<std::string>();
  CLI::App* sub = app.add_subcommand("merge-datasets",
                                     "Concatenate indexed datasets (.bin/.idx) into one (Megatron's merge_datasets.py)");
  sub->add_option("--input", *inputs, "Input prefixes, in order")->required()->expected(1, -1);
  sub->add_option("--output-prefix", *output, "Output prefix")->required();
  sub->callback([inputs, output] { merge_datasets(*inputs, *output); });
}

}  // namespace mt::data
