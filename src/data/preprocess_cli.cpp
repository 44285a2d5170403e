#include "data/preprocess_cli.h"

#include <CLI/CLI.hpp>
#include <memory>

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
  sub->add_option("--tokenizer-type", cfg->tokenizer_type, "Tokenizer type")
      ->check(CLI::IsMember({"GPT2BPETokenizer"}))
      ->capture_default_str();
  sub->add_option("--vocab-file", cfg->vocab_file, "GPT-2 vocabulary (vocab.json / encoder.json)")->required();
  sub->add_option("--merge-file", cfg->merge_file, "GPT-2 merges (merges.txt / vocab.bpe)")->required();
  sub->add_option("--workers", cfg->workers, "Tokenizer threads")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--log-interval", cfg->log_interval, "Documents between progress lines on stderr")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->callback([cfg] { preprocess_data(*cfg); });
}

}  // namespace mt::data
