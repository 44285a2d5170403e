// `megatron generate`: sample text from a checkpoint (greedy, temperature, top-k, top-p).
// Recomputes the full (causal) forward for every new token; no KV cache yet.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "train/arguments.h"

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
