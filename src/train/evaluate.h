// `megatron evaluate`: zero-shot evaluation as in the Megatron-LM paper (Shoeybi et al. 2019,
// appendix E) and Megatron-LM's tasks/zeroshot_gpt, under any TP x PP layout on CPU or GPU:
//   * language-model loss / perplexity of a token stream with overlapping sliding windows
//     (WIKITEXT103 over a raw text file, or the documents of an indexed dataset), optionally
//     adjusted to the word-level token count (appendix E.1);
//   * LAMBADA cloze accuracy (appendix E.2) on a .jsonl of {"text": ...} passages.
// Every function here is collective over the model's ranks; results are returned on every rank.
#pragma once
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "data/tokenizer.h"
#include "model/gpt_model.h"

namespace mt {

/// Σ of per-token losses (nats) and how many tokens were scored.
struct LmScore {
  double total_loss = 0;
  int64_t scored_tokens = 0;
};

/// Loss over the token stream `tokens` (T tokens, T - 1 targets) with windows of s =
/// model.config().seq_length tokens starting every `stride` tokens (Megatron's _LMDataset with
/// --overlapping-eval; stride = s: disjoint windows): window w reads tokens [w·stride,
/// w·stride + s) and scores only the targets no earlier window scored, so every target counts
/// once, with the context its window gives it. The model is planned for b = model.micro_batch()
/// windows per forward. Errors: mt::Error for stride outside [1, s], fewer than 2 tokens, ids
/// outside the vocabulary.
LmScore sliding_window_loss(GPTModel& model, const std::vector<int32_t>& tokens, int64_t stride, const Stream& stream);

/// One LAMBADA passage split into context and target tokens (Megatron's
/// tasks/zeroshot_gpt/datasets.py _LambadaDataset): strict: the target is the last
/// whitespace-separated word, tokenized with its leading space, the context the text before it;
/// otherwise the target is the last token of the tokenized passage.
/// Errors: mt::Error for a passage without a word or a context.
struct ClozeItem {
  std::vector<int32_t> context, target;
};
ClozeItem lambada_item(const std::string& text, const data::Tokenizer& tokenizer, bool strict);

/// How many items the model completes exactly: every target token is the argmax of the logits at
/// its position, given the context and the preceding target tokens (inputs truncated from the
/// left to the model's seq_length). Errors: mt::Error for an item without context or target.
int64_t cloze_correct(GPTModel& model, const std::vector<ClozeItem>& items, const Stream& stream);

/// Megatron's word count for the adjusted perplexity: len(text.strip().split(" ")).
int64_t original_word_count(const std::string& text);

struct EvaluateArgs {
  std::string load;                    ///< --load
  std::string task;                    ///< --task WIKITEXT103 | LAMBADA (empty: indexed-dataset loss)
  std::vector<std::string> valid_data;  ///< --valid-data (raw text / .jsonl files)
  std::vector<std::string> data_path;  ///< --data-path (indexed dataset; its --split validation part)
  std::vector<std::string> valid_data_path;  ///< --valid-data-path (indexed dataset, all of it)
  std::string split = "969,30,1";      ///< --split
  int64_t overlapping_eval = 32;       ///< --overlapping-eval (stride of the sliding windows)
  bool strict_lambada = false;         ///< --strict-lambada
  int64_t eval_iters = 0;              ///< --eval-iters: windows / micro-batch limit for indexed data (0 = all)
  int64_t seq_length = 0;              ///< --seq-length (0 = the checkpoint's)
  int64_t micro_batch_size = 1;        ///< --micro-batch-size
  std::string vocab_file, merge_file, tokenizer_type = "HuggingFaceTokenizer", tokenizer_model;
  data::TikTokenOptions tiktoken;  ///< --tiktoken-pattern, ... (TikTokenizer; add_tiktoken_options)
  std::string device = "auto";
  int tensor_model_parallel_size = 1, pipeline_model_parallel_size = 1, nproc_per_node = 1;
  bool bf16 = false, fp16 = false;
};
void add_evaluate_options(CLI::App& app, EvaluateArgs& args);
int run_evaluate(const EvaluateArgs& args);

}  // namespace mt
