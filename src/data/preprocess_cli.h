// CLI registration of the `preprocess-data` subcommand (Megatron's tools/preprocess_data.py flags).
#pragma once

namespace CLI {
class App;
}

namespace mt::data {

/// Adds `preprocess-data` to `app`: --input (one or more), --output-prefix, --json-keys (list),
/// --append-eod, --vocab-file, --merge-file, --tokenizer-type GPT2BPETokenizer, --workers,
/// --log-interval. Its callback runs preprocess_data(); errors propagate as mt::Error.
void add_preprocess_data_command(CLI::App& app);

}  // namespace mt::data
