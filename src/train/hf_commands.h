// `megatron import-hf` and `megatron export-hf` (docs/huggingface.md): a Hugging Face transformers
// model directory (config.json, model.safetensors or sharded with model.safetensors.index.json,
// tokenizer files) to a megatron.cpp checkpoint and back. The checkpoint loads under any
// TP/PP/DP layout; `pretrain --load CKPT --finetune` continues training from it and `generate`
// samples from it.
#pragma once
#include <cstdint>
#include <string>

namespace CLI {
class App;
}

namespace mt {

struct ImportHfArgs {
  std::string hf_dir;                          ///< --hf-dir
  std::string save;                            ///< --save
  int64_t seq_length = 0;                      ///< --seq-length (0 = min(max_position_embeddings, 4096))
  int64_t make_vocab_size_divisible_by = 128;  ///< --make-vocab-size-divisible-by
  /// --apply-layernorm-1p: store the norm weights zero-centred (the HF weight minus 1), for a run
  /// with --apply-layernorm-1p (the checkpoint's config records it).
  bool apply_layernorm_1p = false;
};

struct ExportHfArgs {
  std::string load;            ///< --load
  std::string hf_dir;          ///< --hf-dir (created)
  std::string architecture;    ///< --hf-architecture (default: the imported one, else inferred)
  std::string dtype = "fp32";  ///< --hf-dtype fp32|bf16|fp16
  int64_t max_shard_bytes = 0; ///< --max-shard-size in bytes (0 = one file)
};

void add_import_hf_options(CLI::App& app, ImportHfArgs& args);
void add_export_hf_options(CLI::App& app, ExportHfArgs& args);

/// Both return the process exit code; errors are mt::Error naming the file and field.
int run_import_hf(const ImportHfArgs& args);
int run_export_hf(const ExportHfArgs& args);

/// The folder of a checkpoint directory holding the imported config.json and tokenizer files.
std::string hf_assets_dir(const std::string& checkpoint_dir);

}  // namespace mt
