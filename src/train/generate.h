// `megatron generate`: sample text from a checkpoint (greedy, temperature, top-k, top-p).
// Batched, with a key/value cache under any TP x PP layout (train/inference.h).
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "comm/communicator.h"
#include "data/tokenizer.h"
#include "model/gpt_model.h"
#include "train/arguments.h"
#include "train/checkpoint.h"

namespace mt {

/// Picks the next token from fp32 logits over the (unpadded) vocabulary. greedy: argmax;
/// otherwise softmax(logits / temperature) restricted to the top_k most likely tokens (0 = all)
/// and then to the smallest set whose probability mass reaches top_p (0 = off), renormalised.
/// Errors: temperature <= 0 without greedy, top_p outside [0, 1], top_k < 0.
int32_t sample_token(const std::vector<float>& logits, bool greedy, float temperature, int64_t top_k, float top_p,
                     std::mt19937_64& rng);

/// The logits of the real vocabulary: the first vocab_size of a row of padded_vocab logits (the
/// padded entries take no probability mass and are never sampled). Errors: vocab_size outside
/// [1, padded_vocab].
std::vector<float> vocab_logits(const float* row, int64_t padded_vocab, int64_t vocab_size);

int run_generate(const GenerateArgs& args);

/// A checkpoint loaded for inference (generate, evaluate, serve) under a TP x PP layout, with
/// the world communicator of the launcher (torchrun / mpirun / Slurm / --nproc-per-node) and the
/// process groups. The model is planned for micro_batch sequences of config.seq_length tokens.
struct InferenceModelOptions {
  std::string load;
  std::string device = "auto";
  int tp = 1, pp = 1;
  bool bf16 = false, fp16 = false;
  int64_t seq_length = 0;  ///< 0: the checkpoint's
  int64_t micro_batch = 1;
};
struct InferenceModel {
  Device device;
  std::shared_ptr<Communicator> world;
  ProcessGroups groups;
  CheckpointState state;
  TransformerConfig config;  ///< the checkpoint's, with the seq_length used
  std::unique_ptr<Stream> stream;
  std::unique_ptr<GPTModel> model;
};
/// Errors: mt::Error for a missing/corrupt checkpoint, a layout that does not match the ranks
/// (tp·pp must equal the world size), the model's constraints (heads divisible by tp, ...).
InferenceModel load_inference_model(const InferenceModelOptions& options);

/// The tokenizer for inference: --vocab-file/--merge-file (GPT-2 BPE), --tokenizer-type +
/// --tokenizer-model, NullTokenizer (checkpoint_vocab ids), or the Hugging Face tokenizer files
/// import-hf stored beside the checkpoint. Errors: mt::Error when none is found.
std::unique_ptr<data::Tokenizer> inference_tokenizer(const std::string& load, const std::string& vocab_file,
                                                     const std::string& merge_file, const std::string& tokenizer_type,
                                                     const std::string& tokenizer_model, int64_t checkpoint_vocab,
                                                     const data::TikTokenOptions& tiktoken = {});

/// `megatron logits`: the model's fp32 logits for one sequence of token ids (for checks against
/// other implementations, e.g. tools/hf_check.py). Writes [T, vocab_size] little-endian fp32 (no
/// vocabulary padding) to `output`.
struct LogitsArgs {
  std::string load;      ///< --load
  std::string token_ids; ///< --token-ids "1 2 3" (spaces or commas)
  std::string output;    ///< --output
  std::string device = "auto";
};
void add_logits_options(CLI::App& app, LogitsArgs& args);
int run_logits(const LogitsArgs& args);

}  // namespace mt
