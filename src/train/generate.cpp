#include "train/generate.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/logging.h"
#include <filesystem>

#include "data/tokenizer.h"
#include "train/hf_commands.h"
#include "model/gpt_model.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace mt {

int32_t sample_token(const std::vector<float>& logits, bool greedy, float temperature, int64_t top_k, float top_p,
                     std::mt19937_64& rng) {
  MT_REQUIRE(!logits.empty(), "sample_token: empty logits");
  const auto bad = std::find_if(logits.begin(), logits.end(), [](float v) { return !std::isfinite(v); });
  MT_REQUIRE(bad == logits.end(), "the model produced a non-finite logit ({} for token {}): the checkpoint holds "
             "NaN/Inf weights (a diverged run?)", *bad, bad - logits.begin());
  if (greedy) return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  MT_REQUIRE(temperature > 0, "--temperature must be positive, got {}", temperature);
  MT_REQUIRE(top_k >= 0, "--top-k must be >= 0, got {}", top_k);
  MT_REQUIRE(top_p >= 0 && top_p <= 1, "--top-p must be in [0, 1], got {}", top_p);
  std::vector<int32_t> idx(logits.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  size_t keep = idx.size();
  if (top_k > 0) keep = std::min<size_t>(keep, static_cast<size_t>(top_k));
  std::vector<double> p(keep);
  const double mx = logits[idx[0]] / temperature;
  double z = 0;
  for (size_t i = 0; i < keep; ++i) {
    p[i] = std::exp(logits[idx[i]] / temperature - mx);
    z += p[i];
  }
  for (auto& x : p) x /= z;
  if (top_p > 0) {
    double c = 0;
    size_t k = 0;
    while (k < keep) {
      c += p[k++];
      if (c >= top_p) break;
    }
    keep = k;
    p.resize(keep);
  }
  std::discrete_distribution<size_t> dist(p.begin(), p.end());
  return idx[dist(rng)];
}

std::vector<float> vocab_logits(const float* row, int64_t padded_vocab, int64_t vocab_size) {
  MT_REQUIRE(vocab_size >= 1 && vocab_size <= padded_vocab, "vocabulary of {} tokens outside the {} logits",
             vocab_size, padded_vocab);
  return std::vector<float>(row, row + vocab_size);
}

namespace {
/// --vocab-file/--merge-file (GPT-2 BPE), --tokenizer-type/--tokenizer-model, or the tokenizer files
/// import-hf stored beside the checkpoint.
std::unique_ptr<data::Tokenizer> generation_tokenizer(const GenerateArgs& a, int64_t checkpoint_vocab) {
  namespace fs = std::filesystem;
  if (a.tokenizer_type == "NullTokenizer") return data::make_tokenizer("NullTokenizer", "", "", "", checkpoint_vocab);
  if (!a.vocab_file.empty() || !a.merge_file.empty())
    return data::make_tokenizer("GPT2BPETokenizer", a.vocab_file, a.merge_file, "", 0);
  if (!a.tokenizer_model.empty()) return data::make_tokenizer(a.tokenizer_type, "", "", a.tokenizer_model, 0);
  const fs::path assets = hf_assets_dir(a.load);
  if (fs::is_regular_file(assets / "tokenizer.json"))
    return data::make_tokenizer("HuggingFaceTokenizer", "", "", (assets / "tokenizer.json").string(), 0);
  if (fs::is_regular_file(assets / "vocab.json") && fs::is_regular_file(assets / "merges.txt"))
    return data::make_tokenizer("GPT2BPETokenizer", (assets / "vocab.json").string(),
                                (assets / "merges.txt").string(), "", 0);
  MT_FAIL("no tokenizer: give --vocab-file and --merge-file, or --tokenizer-type and --tokenizer-model (the "
          "checkpoint '{}' has no Hugging Face tokenizer files in {})",
          a.load, assets.string());
}
}  // namespace

int run_generate(const GenerateArgs& args) {
  const Device device = resolve_device(args.device);
  set_current_device(device);
  MT_REQUIRE(args.out_seq_length > 0, "--out-seq-length must be positive, got {}", args.out_seq_length);
  CheckpointState st = read_checkpoint_state(args.load);
  const std::unique_ptr<data::Tokenizer> tok_ptr = generation_tokenizer(args, st.model.vocab_size);
  const data::Tokenizer& tok = *tok_ptr;
  // A model may have more embedding rows than its tokenizer has tokens (Hugging Face models).
  MT_REQUIRE(st.model.vocab_size >= tok.vocab_size(), "checkpoint vocabulary {} is smaller than the tokenizer's {}",
             st.model.vocab_size, tok.vocab_size());
  int32_t eod = -1;
  try {
    eod = tok.eod();
  } catch (const Error&) {  // a tokenizer without an end-of-document token: stop at the length only
  }
  // The context the model is planned for: the prompt and the new tokens, at most the trained length.
  const int64_t prompt_tokens = std::max<int64_t>(static_cast<int64_t>(tok.encode(args.prompt).size()), 1);
  TransformerConfig cfg = st.model;
  MT_REQUIRE(prompt_tokens <= cfg.seq_length, "the prompt has {} tokens but the model's context (--seq-length of "
             "the checkpoint) is {} tokens: shorten the prompt", prompt_tokens, cfg.seq_length);
  cfg.seq_length = std::min(cfg.seq_length, prompt_tokens + args.out_seq_length);
  Stream stream(device);
  GPTModel model(cfg, 1, DType::kF32, device, ProcessGroups::single());
  load_checkpoint(args.load, model.params(), nullptr, stream);
  const int64_t S = cfg.seq_length, V = cfg.vocab_size, Vp = model.padded_vocab();

  Buffer tok_host(Device::cpu(), static_cast<size_t>(S) * 4);
  Buffer tok_dev(device, static_cast<size_t>(S) * 4);
  Tensor tokens = tok_dev.as(DType::kI32, {S, 1});
  std::mt19937_64 rng(args.seed);
  std::vector<float> row(static_cast<size_t>(Vp));
  for (int64_t sample = 0; sample < args.num_samples; ++sample) {
    std::vector<int32_t> ids = tok.encode(args.prompt);
    if (ids.empty()) ids.push_back(eod >= 0 ? eod : 0);
    const size_t prompt_len = ids.size();
    for (int64_t t = 0; t < args.out_seq_length; ++t) {
      // Causal attention: positions < len see only the (last S) tokens; the rest is padding.
      const size_t start = ids.size() > static_cast<size_t>(S) ? ids.size() - S : 0;
      const int64_t len = static_cast<int64_t>(ids.size() - start);
      int32_t* h = static_cast<int32_t*>(tok_host.data());
      for (int64_t i = 0; i < S; ++i) h[i] = i < len ? ids[start + i] : (eod >= 0 ? eod : 0);
      copy_bytes(tok_dev.data(), device, h, Device::cpu(), static_cast<size_t>(S) * 4, stream);
      MicroBatch mb;
      mb.tokens = tokens;
      model.forward(mb, DropoutContext{0, 0, 0, false}, Tensor(), 0.f, stream, /*compute_loss=*/false);
      const Tensor logits = model.logits();  // [S, Vp], fp32
      copy_bytes(row.data(), Device::cpu(), static_cast<float*>(logits.data()) + (len - 1) * Vp, device,
                 static_cast<size_t>(Vp) * 4, stream);
      stream.synchronize();
      const std::vector<float> lv = vocab_logits(row.data(), Vp, V);
      int32_t next = sample_token(lv, args.greedy, args.temperature, args.top_k, args.top_p, rng);
      if (next == eod) break;
      ids.push_back(next);
    }
    std::vector<int32_t> gen(ids.begin() + static_cast<std::ptrdiff_t>(prompt_len), ids.end());
    std::fprintf(stdout, "----- sample %lld -----\n%s%s\n", static_cast<long long>(sample), args.prompt.c_str(),
                 tok.decode(gen).c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace mt

namespace mt {

void add_logits_options(CLI::App& app, LogitsArgs& a) {
  app.add_option("--load", a.load, "Checkpoint directory")->required();
  app.add_option("--token-ids", a.token_ids, "Token ids, separated by spaces or commas")->required();
  app.add_option("--output", a.output, "Output file: fp32 [tokens, vocabulary], little-endian")->required();
  app.add_option("--device", a.device, "cpu, cuda, cuda:N or auto")->capture_default_str();
}

int run_logits(const LogitsArgs& a) {
  std::vector<int32_t> ids;
  std::string cur;
  for (char ch : a.token_ids + " ") {
    if (ch == ' ' || ch == ',') {
      if (cur.empty()) continue;
      size_t pos = 0;
      long long v = 0;
      try {
        v = std::stoll(cur, &pos);
      } catch (const std::exception&) {
        pos = 0;
      }
      MT_REQUIRE(pos == cur.size(), "--token-ids: '{}' is not an integer", cur);
      ids.push_back(static_cast<int32_t>(v));
      cur.clear();
    } else {
      cur += ch;
    }
  }
  MT_REQUIRE(!ids.empty(), "--token-ids is empty");
  const Device device = resolve_device(a.device);
  set_current_device(device);
  const CheckpointState st = read_checkpoint_state(a.load);
  TransformerConfig cfg = st.model;
  const int64_t T = static_cast<int64_t>(ids.size());
  for (int32_t id : ids)
    MT_REQUIRE(id >= 0 && id < cfg.vocab_size, "--token-ids: {} is outside the vocabulary of {} tokens", id,
               cfg.vocab_size);
  MT_REQUIRE(cfg.position_embedding_type != PositionEmbeddingType::kLearnedAbsolute || T <= cfg.max_positions(),
             "{} tokens exceed the {} learned positions", T, cfg.max_positions());
  cfg.seq_length = T;
  Stream stream(device);
  GPTModel model(cfg, 1, DType::kF32, device, ProcessGroups::single());
  load_checkpoint(a.load, model.params(), nullptr, stream);
  Buffer tok(device, static_cast<size_t>(T) * 4);
  copy_bytes(tok.data(), device, ids.data(), Device::cpu(), static_cast<size_t>(T) * 4, stream);
  MicroBatch mb;
  mb.tokens = tok.as(DType::kI32, {T, 1});
  model.forward(mb, DropoutContext{0, 0, 0, false}, Tensor(), 0.f, stream, /*compute_loss=*/false);
  const int64_t Vp = model.padded_vocab(), V = cfg.vocab_size;
  std::vector<float> all(static_cast<size_t>(T * Vp));
  copy_bytes(all.data(), Device::cpu(), model.logits().data(), device, all.size() * 4, stream);
  stream.synchronize();
  std::FILE* f = std::fopen(a.output.c_str(), "wb");
  MT_REQUIRE(f != nullptr, "cannot write '{}'", a.output);
  for (int64_t t = 0; t < T; ++t) std::fwrite(all.data() + t * Vp, 4, static_cast<size_t>(V), f);
  const bool ok = std::fclose(f) == 0;
  MT_REQUIRE(ok, "error writing '{}'", a.output);
  return 0;
}

}  // namespace mt
