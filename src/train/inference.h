// Inference over any TP/PP layout (generation with a key/value cache, and forward passes for
// evaluation). Every rank of the model calls the same functions with the same arguments
// (collective over the model's tensor- and pipeline-parallel groups); one model chunk per rank
// (no virtual pipeline stages).
//
// Generation follows Megatron-LM's text_generation (megatron/inference/text_generation/
// generation.py): a prefill forward over the shortest prompt's tokens fills the key/value cache,
// then one decoding step per position; a sequence still inside its (longer) prompt takes its
// prompt token instead of a sample. The last pipeline stage gathers the logits of the new position
// over the tensor-parallel group, samples on the host (the only per-token host work) and
// broadcasts the tokens over the pipeline group.
#pragma once
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "core/buffer.h"
#include "model/gpt_model.h"
#include "model/inference_context.h"

namespace mt {

struct SamplingOptions {
  bool greedy = false;      ///< argmax (Megatron: top_k = 1)
  float temperature = 1.f;  ///< > 0 unless greedy
  int64_t top_k = 0;        ///< 0 = off
  float top_p = 0.f;        ///< 0 = off, else (0, 1]
  uint64_t seed = 1234;     ///< random stream of the sampling (the same on every rank)
};

struct GenerationOptions {
  int64_t max_new_tokens = 64;  ///< --max-new-tokens / --out-seq-length / tokens_to_generate
  SamplingOptions sampling;
  int32_t eod = -1;             ///< a sequence stops after generating this token (-1: none)
  bool use_cache = true;        ///< false: recompute the whole prefix per token (reference path)
};

struct GenerationResult {
  /// Per prompt: its prompt tokens followed by the generated ones (ending with eod when it stopped there).
  std::vector<std::vector<int32_t>> tokens;
  std::vector<int64_t> prompt_lengths;
  int64_t generated_tokens = 0;  ///< new tokens over all prompts
  double prefill_seconds = 0, decode_seconds = 0;
  double tokens_per_second() const {
    const double t = prefill_seconds + decode_seconds;
    return t > 0 ? static_cast<double>(generated_tokens) / t : 0.0;
  }
};

/// Forward of micro-batch mb through this rank's chunk of `model`, receiving the input from the
/// previous pipeline stage and sending the output to the next (model.groups().pp). On the last
/// stage the logits are then in model.logits(); with compute_loss, loss_accum[0] +=
/// mb.loss_weight · Σ loss_mask · per-token losses. Errors: mt::Error for more than one chunk.
void pipeline_forward(GPTModel& model, const MicroBatch& mb, bool compute_loss, const Tensor& loss_accum,
                      const Stream& stream);

/// Gathers rows [first_row, first_row + rows) of the last stage's logits [s·b, V/tp] over the
/// tensor-parallel group: returns rows × vocab_size fp32 values (real vocabulary, no padding) on
/// the last pipeline stage and an empty vector elsewhere. `scratch` grows as needed.
std::vector<float> gather_logit_rows(GPTModel& model, int64_t first_row, int64_t rows, Buffer& scratch,
                                     const Stream& stream);

/// Picks the next token from the real-vocabulary logits (train/generate.h sample_token).
int32_t sample_next(const std::vector<float>& logits, const SamplingOptions& s, std::mt19937_64& rng);

class TextGenerator {
 public:
  /// model: loaded parameters, any TP/PP layout with one chunk per rank (it is not run itself: the
  /// generator plans its own prefill / decode models over the same parameters). Caches keys and
  /// values for max_batch sequences of max_sequence_length tokens (at most the learned positions).
  /// Errors: mt::Error for sizes < 1 or beyond the model's positions, several chunks per rank.
  TextGenerator(GPTModel& model, int64_t max_batch, int64_t max_sequence_length, const Stream& stream);
  /// Generates for up to max_batch prompts (each non-empty, shorter than max_sequence_length):
  /// each continues until it produced opt.max_new_tokens tokens, the eod token, or the sequence
  /// reaches max_sequence_length. Collective: every rank passes the same arguments and gets the
  /// same result. Errors: mt::Error for an empty or too long prompt, too many prompts, token ids
  /// outside the vocabulary, bad sampling options, non-finite logits.
  GenerationResult generate(const std::vector<std::vector<int32_t>>& prompts, const GenerationOptions& opt);
  int64_t max_batch() const { return max_batch_; }
  int64_t max_sequence_length() const { return max_seq_; }

 private:
  /// Runs `model` on tokens [s, max_batch] (position ids from `position` on) and returns, on every
  /// rank, the next tokens chosen by choose(b, logits row) for each batch row (logits of row
  /// `logit_pos` of the sequence); choose runs on the last stage only.
  GPTModel& planned(std::unique_ptr<GPTModel>& slot, int64_t seq);
  std::vector<std::vector<float>> logits_at(GPTModel& m, int64_t pos);
  void broadcast_tokens(std::vector<int32_t>& tokens);

  GPTModel& model_;
  const Stream& stream_;
  int64_t max_batch_, max_seq_;
  KvCache cache_;
  std::unique_ptr<GPTModel> prefill_, decode_, full_;
  Buffer tokens_dev_, positions_dev_, bcast_dev_, gather_;
};

}  // namespace mt
