// CLI registration of the `preprocess-data` subcommand (Megatron's tools/preprocess_data.py flags).
#pragma once

namespace CLI {
class App;
}

namespace mt::data {

/// Adds `preprocess-data` to `app`: --input (one or more), --output-prefix, --json-keys (list),
/// --append-eod, --vocab-file, --merge-file, --tokenizer-type, --tokenizer-model, --vocab-size, --split-sentences, --workers,
/// --log-interval. Its callback runs preprocess_data(); errors propagate as mt::Error.
void add_preprocess_data_command(CLI::App& app);

/// Adds `merge-datasets --input P1 P2 ... --output-prefix OUT` (merge_datasets()).
void add_merge_datasets_command(CLI::App& app);

}  // namespace mt::data
