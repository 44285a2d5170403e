#include "train/evaluate.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/logging.h"
#include "data/data_args.h"
#include "data/detokenizer.h"
#include "data/gpt_window_dataset.h"
#include "data/indexed_dataset.h"
#include "ops/elementwise.h"
#include "train/generate.h"
#include "train/inference.h"

namespace mt {

namespace {

/// Sums a host value over the pipeline group (the loss lives on the last stage, others pass 0).
double pp_sum(GPTModel& m, double v, Buffer& scratch, const Stream& st) {
  Communicator& pp = *m.groups().pp;
  if (pp.size() == 1) return v;
  if (scratch.bytes() < 4) scratch = Buffer(m.device(), 4);
  float f = static_cast<float>(v);
  copy_bytes(scratch.data(), m.device(), &f, Device::cpu(), 4, st);
  pp.all_reduce(Tensor(scratch.data(), DType::kF32, m.device(), {1}), ReduceOp::kSum, st);
  copy_bytes(&f, Device::cpu(), scratch.data(), m.device(), 4, st);
  st.synchronize();
  return f;
}

/// Device tensors for one micro-batch [s, b]: tokens, labels, loss mask.
struct BatchBuffers {
  Buffer tokens, labels, mask, loss, reduce;
  BatchBuffers(Device d, int64_t n)
      : tokens(d, static_cast<size_t>(n) * 4), labels(d, static_cast<size_t>(n) * 4), mask(d, static_cast<size_t>(n) * 4),
        loss(d, 4) {}
};

}  // namespace

LmScore sliding_window_loss(GPTModel& m, const std::vector<int32_t>& tokens, int64_t stride, const Stream& st) {
  const int64_t S = m.config().seq_length, b = m.micro_batch(), T = static_cast<int64_t>(tokens.size());
  const int64_t V = m.config().vocab_size;
  MT_REQUIRE(stride >= 1 && stride <= S, "--overlapping-eval {} must be in [1, --seq-length {}]", stride, S);
  MT_REQUIRE(T >= 2, "the evaluation text has {} tokens; at least 2 are needed", T);
  for (int32_t t : tokens) MT_REQUIRE(t >= 0 && t < V, "token id {} outside the vocabulary of {}", t, V);
  const Device dev = m.device();
  BatchBuffers buf(dev, S * b);
  std::vector<int32_t> tok(static_cast<size_t>(S * b)), lab(static_cast<size_t>(S * b));
  std::vector<float> mask(static_cast<size_t>(S * b));
  LmScore score;
  int64_t scored_up_to = 0;  // targets 1 .. scored_up_to are done
  for (int64_t w = 0; scored_up_to < T - 1;) {
    int64_t batch_scored = 0;
    for (int64_t bi = 0; bi < b; ++bi, ++w) {
      const int64_t start = w * stride;
      for (int64_t i = 0; i < S; ++i) {
        const int64_t t = start + i, target = t + 1;  // input token t predicts token t + 1
        const size_t k = static_cast<size_t>(i * b + bi);
        tok[k] = t < T ? tokens[static_cast<size_t>(t)] : 0;
        lab[k] = target < T ? tokens[static_cast<size_t>(target)] : 0;
        const bool counts = target < T && target > scored_up_to;
        mask[k] = counts ? 1.f : 0.f;
        batch_scored += counts;
      }
      scored_up_to = std::max(scored_up_to, std::min(start + S, T - 1));
    }
    copy_bytes(buf.tokens.data(), dev, tok.data(), Device::cpu(), tok.size() * 4, st);
    copy_bytes(buf.labels.data(), dev, lab.data(), Device::cpu(), lab.size() * 4, st);
    std::vector<float> mask_dev_src(mask);
    copy_bytes(buf.mask.data(), dev, mask_dev_src.data(), Device::cpu(), mask.size() * 4, st);
    const Tensor loss(buf.loss.data(), DType::kF32, dev, {1});
    fill(loss, 0.f, st);
    MicroBatch mb;
    mb.tokens = Tensor(buf.tokens.data(), DType::kI32, dev, {S, b});
    mb.labels = Tensor(buf.labels.data(), DType::kI32, dev, {S, b});
    mb.loss_mask = Tensor(buf.mask.data(), DType::kF32, dev, {S, b});
    mb.loss_weight = 1.f;
    pipeline_forward(m, mb, true, loss, st);
    float host = 0;
    if (m.chunk(0).layers.has_loss) {
      copy_bytes(&host, Device::cpu(), loss.data(), dev, 4, st);
      st.synchronize();
    }
    score.total_loss += pp_sum(m, host, buf.reduce, st);
    score.scored_tokens += batch_scored;
  }
  return score;
}

int64_t original_word_count(const std::string& text) {
  const size_t a = text.find_first_not_of(" \t\n\r\f\v");
  if (a == std::string::npos) return 1;  // Python: "".split(" ") == [""]
  const size_t z = text.find_last_not_of(" \t\n\r\f\v");
  return static_cast<int64_t>(std::count(text.begin() + static_cast<std::ptrdiff_t>(a),
                                         text.begin() + static_cast<std::ptrdiff_t>(z) + 1, ' ')) + 1;
}

ClozeItem lambada_item(const std::string& text, const data::Tokenizer& tok, bool strict) {
  ClozeItem item;
  if (!strict) {
    std::vector<int32_t> ids = tok.encode(text);
    MT_REQUIRE(ids.size() >= 2, "LAMBADA passage '{}' has {} tokens; at least 2 are needed", text.substr(0, 80),
               ids.size());
    item.target = {ids.back()};
    ids.pop_back();
    item.context = std::move(ids);
    return item;
  }
  // Megatron: last_token = text.split()[-1]; start = text.rfind(last_token);
  // context = tokenize(text[:start].strip()), target = tokenize(" " + last_token).
  std::istringstream words(text);
  std::string last, w;
  while (words >> w) last = w;
  MT_REQUIRE(!last.empty(), "LAMBADA passage '{}' has no word", text.substr(0, 80));
  const size_t start = text.rfind(last);
  std::string ctx = text.substr(0, start);
  const size_t a = ctx.find_first_not_of(" \t\n\r\f\v"), z = ctx.find_last_not_of(" \t\n\r\f\v");
  ctx = a == std::string::npos ? std::string() : ctx.substr(a, z - a + 1);
  item.context = tok.encode(ctx);
  item.target = tok.encode(" " + last);
  MT_REQUIRE(!item.context.empty() && !item.target.empty(), "LAMBADA passage '{}' has no context before its last word",
             text.substr(0, 80));
  return item;
}

int64_t cloze_correct(GPTModel& m, const std::vector<ClozeItem>& items, const Stream& st) {
  const int64_t S = m.config().seq_length, b = m.micro_batch(), V = m.config().vocab_size;
  const Device dev = m.device();
  BatchBuffers buf(dev, S * b);
  Buffer gather;
  std::vector<int32_t> tok(static_cast<size_t>(S * b));
  int64_t correct = 0;
  for (size_t first = 0; first < items.size(); first += static_cast<size_t>(b)) {
    // Per row: the input (context + target without its last token, the last S tokens) and where
    // the target's predictions sit in it.
    std::vector<std::vector<int32_t>> inputs;
    std::vector<int64_t> first_pred;
    std::fill(tok.begin(), tok.end(), 0);
    for (int64_t bi = 0; bi < b; ++bi) {
      const size_t k = std::min(first + static_cast<size_t>(bi), items.size() - 1);
      const ClozeItem& it = items[k];
      MT_REQUIRE(!it.context.empty() && !it.target.empty(), "cloze item {} needs a context and a target", k);
      for (int32_t t : it.context) MT_REQUIRE(t >= 0 && t < V, "token id {} outside the vocabulary of {}", t, V);
      for (int32_t t : it.target) MT_REQUIRE(t >= 0 && t < V, "token id {} outside the vocabulary of {}", t, V);
      MT_REQUIRE(static_cast<int64_t>(it.target.size()) <= S, "cloze item {}: a target of {} tokens does not fit in "
                 "--seq-length {}", k, it.target.size(), S);
      std::vector<int32_t> in(it.context);
      in.insert(in.end(), it.target.begin(), it.target.end() - 1);
      if (static_cast<int64_t>(in.size()) > S) in.erase(in.begin(), in.end() - S);
      first_pred.push_back(static_cast<int64_t>(in.size() - it.target.size()));  // logits row predicting target[0]
      for (size_t i = 0; i < in.size(); ++i) tok[i * static_cast<size_t>(b) + static_cast<size_t>(bi)] = in[i];
      inputs.push_back(std::move(in));
    }
    copy_bytes(buf.tokens.data(), dev, tok.data(), Device::cpu(), tok.size() * 4, st);
    MicroBatch mb;
    mb.tokens = Tensor(buf.tokens.data(), DType::kI32, dev, {S, b});
    pipeline_forward(m, mb, false, Tensor(), st);
    double batch_correct = 0;
    if (m.chunk(0).layers.has_loss) {
      for (int64_t bi = 0; bi < b && first + static_cast<size_t>(bi) < items.size(); ++bi) {
        const ClozeItem& it = items[first + static_cast<size_t>(bi)];
        bool ok = true;
        for (size_t j = 0; j < it.target.size(); ++j) {
          const int64_t pos = first_pred[static_cast<size_t>(bi)] + static_cast<int64_t>(j);
          const std::vector<float> row = gather_logit_rows(m, pos * b + bi, 1, gather, st);
          const int64_t arg = std::max_element(row.begin(), row.end()) - row.begin();
          ok = ok && arg == it.target[j];
        }
        batch_correct += ok;
      }
    }
    correct += static_cast<int64_t>(std::lround(pp_sum(m, batch_correct, buf.reduce, st)));
  }
  return correct;
}

void add_evaluate_options(CLI::App& app, EvaluateArgs& a) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--load", a.load, "Checkpoint directory")->required();
  app.add_option("--task", a.task, "WIKITEXT103 or LAMBADA (none: loss on --data-path / --valid-data-path)")
      ->check(CLI::IsMember({"WIKITEXT103", "LAMBADA"}));
  app.add_option("--valid-data", a.valid_data, "Evaluation files: raw text (WIKITEXT103) or .jsonl (LAMBADA)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--data-path", a.data_path, "Indexed dataset prefix: its validation split (--split)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--valid-data-path", a.valid_data_path, "Indexed dataset prefixes evaluated whole")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--split", a.split, "Train/valid/test split of --data-path")->capture_default_str();
  app.add_option("--overlapping-eval", a.overlapping_eval, "Stride of the sliding windows (tokens)")
      ->capture_default_str();
  app.add_flag("--strict-lambada", a.strict_lambada, "LAMBADA: the whole last word must be predicted");
  app.add_option("--eval-iters", a.eval_iters, "Indexed data: at most this many forwards (0 = all)")
      ->capture_default_str();
  app.add_option("--seq-length", a.seq_length, "Window length (0 = the checkpoint's)")->capture_default_str();
  app.add_option("--micro-batch-size", a.micro_batch_size, "Windows / passages per forward")->capture_default_str();
  app.add_option("--vocab-file", a.vocab_file, "GPT-2 vocab.json");
  app.add_option("--merge-file", a.merge_file, "GPT-2 merges.txt");
  app.add_option("--tokenizer-type", a.tokenizer_type, "Tokenizer of --tokenizer-model")->capture_default_str();
  app.add_option("--tokenizer-model", a.tokenizer_model, "tokenizer.json or SentencePiece model");
  data::add_tiktoken_options(app, a.tiktoken);
  app.add_option("--device", a.device, "cpu, cuda, cuda:N or auto")->capture_default_str();
  app.add_option("--tensor-model-parallel-size", a.tensor_model_parallel_size, "Tensor-parallel size")
      ->capture_default_str();
  app.add_option("--pipeline-model-parallel-size", a.pipeline_model_parallel_size, "Pipeline-parallel size")
      ->capture_default_str();
  app.add_option("--nproc-per-node", a.nproc_per_node, "Start N ranks on this machine")->capture_default_str();
  app.add_flag("--bf16", a.bf16, "bf16 (CUDA)");
  app.add_flag("--fp16", a.fp16, "fp16 (CUDA)");
}

namespace {
std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MT_REQUIRE(f.good(), "--valid-data '{}' cannot be read", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
}  // namespace

int run_evaluate(const EvaluateArgs& a) {
  MT_REQUIRE(a.micro_batch_size >= 1, "--micro-batch-size must be >= 1, got {}", a.micro_batch_size);
  MT_REQUIRE(a.eval_iters >= 0, "--eval-iters must be >= 0, got {}", a.eval_iters);
  const bool indexed = a.task.empty();
  MT_REQUIRE(!indexed || !a.data_path.empty() || !a.valid_data_path.empty(),
             "evaluate needs --task WIKITEXT103|LAMBADA with --valid-data, or --data-path / --valid-data-path");
  MT_REQUIRE(indexed || !a.valid_data.empty(), "--task {} needs --valid-data FILE", a.task);
  for (const auto& f : a.valid_data) (void)read_text(f);  // unreadable files fail before loading the model
  InferenceModelOptions o;
  o.load = a.load;
  o.device = a.device;
  o.tp = a.tensor_model_parallel_size;
  o.pp = a.pipeline_model_parallel_size;
  o.bf16 = a.bf16;
  o.fp16 = a.fp16;
  o.seq_length = a.seq_length;
  o.micro_batch = a.micro_batch_size;
  InferenceModel im = load_inference_model(o);
  GPTModel& m = *im.model;
  const Stream& st = *im.stream;
  const int64_t S = im.config.seq_length;
  const bool print = im.world->rank() == 0;
  auto out = [&](const std::string& line) {
    if (print) std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  };
  if (indexed) {
    // The documents as one token stream, windows of S tokens every S (Megatron's GPTDataset
    // samples of S + 1 tokens that share their last token with the next sample's first).
    std::vector<int32_t> stream;
    auto add = [&](const std::string& prefix, bool split_only) {
      data::IndexedDataset ds(prefix);
      int64_t d0 = 0, d1 = ds.num_documents();
      if (split_only) std::tie(d0, d1) = data::split_document_ranges(data::parse_split(a.split), ds.num_documents())[1];
      const auto& di = ds.document_indices();
      for (int64_t d = d0; d < d1; ++d)
        for (int64_t sq = di[static_cast<size_t>(d)]; sq < di[static_cast<size_t>(d) + 1]; ++sq) {
          const std::vector<int32_t> t = ds.get(sq);
          stream.insert(stream.end(), t.begin(), t.end());
        }
    };
    for (const auto& p : a.data_path) add(p, true);
    for (const auto& p : a.valid_data_path) add(p, false);
    if (a.eval_iters > 0) {
      const size_t cap = static_cast<size_t>(a.eval_iters * a.micro_batch_size * S + 1);
      if (stream.size() > cap) stream.resize(cap);
    }
    MT_REQUIRE(stream.size() >= 2, "the validation data holds {} tokens; at least 2 are needed", stream.size());
    const LmScore s = sliding_window_loss(m, stream, S, st);
    const double loss = s.total_loss / static_cast<double>(s.scored_tokens);
    out(fmt::format(" validation loss | lm loss value: {:.6E} | lm loss PPL: {:.6E} | tokens: {} |", loss,
                    std::exp(std::min(loss, 20.0)), s.scored_tokens));
    return 0;
  }
  const std::unique_ptr<data::Tokenizer> tok = inference_tokenizer(a.load, a.vocab_file, a.merge_file,
                                                                   a.tokenizer_type, a.tokenizer_model,
                                                                   im.state.model.vocab_size, a.tiktoken);
  if (a.task == "WIKITEXT103") {
    // Megatron: the word count of the original text, the tokens of the detokenized one (the
    // detokenizer chosen by the file's path, data/detokenizer.h).
    std::string text, detokenized;
    for (const auto& f : a.valid_data) {
      std::string t = read_text(f);
      const char* d = data::detokenizer_for(f);
      if (*d != '\0') out(fmt::format(" {}: the {} detokenizer (chosen by the path, as Megatron)", f, d));
      detokenized += data::detokenize_for(f, t);
      text += t;
    }
    const std::vector<int32_t> ids = tok->encode(detokenized);
    const int64_t words = original_word_count(text), T = static_cast<int64_t>(ids.size());
    const LmScore s = sliding_window_loss(m, ids, a.overlapping_eval, st);
    const double loss = s.total_loss / static_cast<double>(T - 1);
    const double ratio = static_cast<double>(T - 1) / static_cast<double>(std::max<int64_t>(words - 1, 1));
    out(fmt::format(" validation results on WIKITEXT103 | avg loss: {:.4E} | ppl: {:.4E} | adjusted ppl: {:.4E} | "
                    "token ratio: {:.4f} | tokens: {} | words: {} |",
                    loss, std::exp(std::min(loss, 20.0)), std::exp(std::min(loss * ratio, 20.0)), ratio, T, words));
    return 0;
  }
  std::vector<ClozeItem> items;
  for (const auto& f : a.valid_data) {
    std::istringstream lines(read_text(f));
    int64_t n = 0;
    for (std::string line; std::getline(lines, line);) {
      ++n;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const std::exception& e) {
        MT_FAIL("{} line {}: not JSON ({})", f, n, e.what());
      }
      MT_REQUIRE(j.is_object() && j.contains("text") && j["text"].is_string(),
                 "{} line {}: expected an object with a \"text\" string", f, n);
      items.push_back(lambada_item(j["text"].get<std::string>(), *tok, a.strict_lambada));
    }
  }
  MT_REQUIRE(!items.empty(), "no LAMBADA passages in --valid-data");
  const int64_t correct = cloze_correct(m, items, st);
  const int64_t total = static_cast<int64_t>(items.size());
  out(fmt::format(" validation results on LAMBADA{} | number correct: {} | total examples: {} | avg accuracy: "
                  "{:.4f} % |",
                  a.strict_lambada ? " (strict)" : "", correct, total, 100.0 * correct / total));
  return 0;
}

}  // namespace mt
