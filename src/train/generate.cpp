#include "train/generate.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/logging.h"
#include <filesystem>

#include "data/detokenizer.h"
#include "data/tokenizer.h"
#include "train/hf_commands.h"
#include "model/gpt_model.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "train/inference.h"
#include "train/memory_estimate.h"
#include "comm/bootstrap.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include <fstream>

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
  return inference_tokenizer(a.load, a.vocab_file, a.merge_file, a.tokenizer_type, a.tokenizer_model,
                             checkpoint_vocab, a.tiktoken);
}

std::vector<std::string> read_prompts(const GenerateArgs& a) {
  std::vector<std::string> prompts = a.prompts;
  if (!a.prompt_file.empty()) {
    std::ifstream f(a.prompt_file);
    MT_REQUIRE(f.good(), "--prompt-file '{}' cannot be read", a.prompt_file);
    for (std::string line; std::getline(f, line);)
      if (!line.empty()) prompts.push_back(line);
  }
  if (prompts.empty()) prompts.push_back("");
  return prompts;
}
}  // namespace

std::unique_ptr<data::Tokenizer> inference_tokenizer(const std::string& load, const std::string& vocab_file,
                                                     const std::string& merge_file, const std::string& tokenizer_type,
                                                     const std::string& tokenizer_model, int64_t checkpoint_vocab,
                                                     const data::TikTokenOptions& tiktoken) {
  namespace fs = std::filesystem;
  if (tokenizer_type == "NullTokenizer") return data::make_tokenizer("NullTokenizer", "", "", "", checkpoint_vocab);
  if (!vocab_file.empty() || !merge_file.empty())
    return data::make_tokenizer("GPT2BPETokenizer", vocab_file, merge_file, "", 0);
  // TikTokenizer: --tiktoken-pattern / --tiktoken-num-special-tokens / --tokenizer-special-tokens as
  // given (Megatron's defaults otherwise), the checkpoint's vocabulary size
  if (!tokenizer_model.empty())
    return data::make_tokenizer(tokenizer_type, "", "", tokenizer_model,
                                tokenizer_type == "TikTokenizer" ? checkpoint_vocab : 0, tiktoken);
  const fs::path assets = hf_assets_dir(load);
  if (fs::is_regular_file(assets / "tokenizer.json"))
    return data::make_tokenizer("HuggingFaceTokenizer", "", "", (assets / "tokenizer.json").string(), 0);
  if (fs::is_regular_file(assets / "vocab.json") && fs::is_regular_file(assets / "merges.txt"))
    return data::make_tokenizer("GPT2BPETokenizer", (assets / "vocab.json").string(),
                                (assets / "merges.txt").string(), "", 0);
  MT_FAIL("no tokenizer: give --vocab-file and --merge-file, or --tokenizer-type and --tokenizer-model (the "
          "checkpoint '{}' has no Hugging Face tokenizer files in {})",
          load, assets.string());
}

InferenceModel load_inference_model(const InferenceModelOptions& o) {
  InferenceModel r;
  const LaunchEnv env = read_launch_env();
  r.device = resolve_device(o.device);
  if (r.device.is_cuda() && env.world_size > 1) r.device = local_device(DeviceType::kCUDA, env);
  set_current_device(r.device);
  MT_REQUIRE(!(o.bf16 && o.fp16), "--bf16 and --fp16 exclude each other");
  const DType dt = o.bf16 ? DType::kBF16 : (o.fp16 ? DType::kF16 : DType::kF32);
  MT_REQUIRE(r.device.is_cuda() || dt == DType::kF32, "--{} needs a CUDA device; the CPU backend runs in fp32",
             o.bf16 ? "bf16" : "fp16");
  MT_REQUIRE(o.tp >= 1 && o.pp >= 1, "--tensor-model-parallel-size {} and --pipeline-model-parallel-size {} must be "
             ">= 1", o.tp, o.pp);
  r.world = init_world(r.device, env, 10.0);
  if (r.world->rank() != 0) set_log_level(LogLevel::kWarn);
  r.state = read_checkpoint_state(o.load);
  TransformerConfig cfg = r.state.model;
  if (o.seq_length > 0) cfg.seq_length = o.seq_length;
  MT_REQUIRE(cfg.seq_length >= 2, "--seq-length must be >= 2, got {}", cfg.seq_length);
  ParallelConfig pc;
  pc.tp = o.tp;
  pc.pp = o.pp;
  validate_and_derive(pc, r.world->size());
  MT_REQUIRE(pc.dp == 1, "{} ranks for tensor-parallel {} x pipeline-parallel {}: inference uses tp x pp ranks exactly",
             r.world->size(), o.tp, o.pp);
  r.groups = build_process_groups(r.world, pc);
  pipeline::PipelineLayout layout;
  layout.num_layers = cfg.num_layers;
  layout.pp = o.pp;
  pipeline::validate_pipeline_layout(layout);
  ModelLayout ml;
  for (const auto& range : pipeline::layers_of(r.groups.pp->rank(), layout)) ml.chunks.push_back({range, 1, 1});
  check_inference_memory(cfg, o.tp, dt, r.device, "loading the model", layout);  // before anything is built
  r.stream = std::make_unique<Stream>(r.device);
  r.model = std::make_unique<GPTModel>(cfg, o.micro_batch, dt, r.device, r.groups, false, ParamLayout{}, ml);
  load_checkpoint(o.load, r.model->params(), nullptr, *r.stream, {}, r.model->persistent_state(*r.stream));
  r.model->load_persistent_state(*r.stream);
  r.config = cfg;
  return r;
}

int run_generate(const GenerateArgs& args) {
  MT_REQUIRE(args.out_seq_length > 0, "--out-seq-length must be positive, got {}", args.out_seq_length);
  MT_REQUIRE(args.num_samples >= 1, "--num-samples must be >= 1, got {}", args.num_samples);
  MT_REQUIRE(args.micro_batch_size >= 0, "--micro-batch-size must be >= 0, got {}", args.micro_batch_size);
  InferenceModelOptions o;
  o.load = args.load;
  o.device = args.device;
  o.tp = args.tensor_model_parallel_size;
  o.pp = args.pipeline_model_parallel_size;
  o.bf16 = args.bf16;
  o.fp16 = args.fp16;
  o.seq_length = args.seq_length;
  InferenceModel im = load_inference_model(o);
  const std::unique_ptr<data::Tokenizer> tok_ptr = generation_tokenizer(args, im.state.model.vocab_size);
  const data::Tokenizer& tok = *tok_ptr;
  // A model may have more embedding rows than its tokenizer has tokens (Hugging Face models).
  MT_REQUIRE(im.state.model.vocab_size >= tok.vocab_size(), "checkpoint vocabulary {} is smaller than the tokenizer's {}",
             im.state.model.vocab_size, tok.vocab_size());
  int32_t eod = -1;
  try {
    eod = tok.eod();
  } catch (const Error&) {  // a tokenizer without an end-of-document token: stop at the length only
  }
  std::vector<std::string> texts;
  for (const std::string& p : read_prompts(args))
    for (int64_t k = 0; k < args.num_samples; ++k) texts.push_back(p);
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& t : texts) {
    std::vector<int32_t> ids = tok.encode(t);
    if (ids.empty()) ids.push_back(eod >= 0 ? eod : 0);
    prompts.push_back(std::move(ids));
  }
  const int64_t n = static_cast<int64_t>(prompts.size());
  const int64_t batch = args.micro_batch_size > 0 ? std::min(args.micro_batch_size, n) : n;
  TextGenerator gen(*im.model, batch, im.config.seq_length, *im.stream);
  GenerationOptions go;
  go.max_new_tokens = std::min(args.out_seq_length, im.config.seq_length);  // a sequence stops at the context anyway
  go.sampling = {args.greedy, args.temperature, args.top_k, args.top_p, args.seed};
  go.eod = eod;
  go.use_cache = !args.no_kv_cache;
  const bool print = im.world->rank() == 0;
  int64_t total_new = 0;
  double total_s = 0, decode_s = 0;
  for (int64_t first = 0; first < n; first += batch) {
    const std::vector<std::vector<int32_t>> part(prompts.begin() + first, prompts.begin() + std::min(n, first + batch));
    go.sampling.seed = args.seed + static_cast<uint64_t>(first);
    const GenerationResult r = gen.generate(part, go);
    total_new += r.generated_tokens;
    total_s += r.prefill_seconds + r.decode_seconds;
    decode_s += r.decode_seconds;
    for (size_t i = 0; i < part.size() && print; ++i) {
      const auto& t = r.tokens[i];
      // The prompt and its continuation, detokenized together (as Megatron's server returns them);
      // valid UTF-8 (a character the sampled tokens leave incomplete becomes U+FFFD).
      std::vector<int32_t> ids(t.begin(), t.end());
      if (static_cast<int64_t>(ids.size()) > r.prompt_lengths[i] && ids.back() == eod) ids.pop_back();
      const auto from = texts[static_cast<size_t>(first) + i].empty() ? r.prompt_lengths[i] : 0;
      const std::string text = data::utf8_replace_invalid(tok.decode(std::span<const int32_t>(ids).subspan(static_cast<size_t>(from))));
      std::fprintf(stdout, "----- sample %lld -----\n", static_cast<long long>(first + static_cast<int64_t>(i)));
      std::fwrite(text.data(), 1, text.size(), stdout);  // the text may hold NUL characters
      std::fputc('\n', stdout);
    }
    std::fflush(stdout);
  }
  if (print)
    std::fprintf(stderr, "generated %lld tokens in %.3f s: %.1f tokens/s (batch %lld, %s)\n",
                 static_cast<long long>(total_new), total_s, total_s > 0 ? total_new / total_s : 0.0,
                 static_cast<long long>(batch), args.no_kv_cache ? "no KV cache" : "KV cache");
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
  MT_REQUIRE(!position_embedding_kind(cfg.position_embedding_type).learned_table || T <= cfg.max_positions(),
             "{} tokens exceed the {} learned positions", T, cfg.max_positions());
  cfg.seq_length = T;
  check_inference_memory(cfg, 1, DType::kF32, device, "logits");  // before anything is built
  Stream stream(device);
  GPTModel model(cfg, 1, DType::kF32, device, ProcessGroups::single());
  load_checkpoint(a.load, model.params(), nullptr, stream, {}, model.persistent_state(stream));
  model.load_persistent_state(stream);
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
