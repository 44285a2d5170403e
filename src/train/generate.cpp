#include "train/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/logging.h"
#include "data/gpt2_tokenizer.h"
#include "model/gpt.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace mt {

int32_t sample_token(const std::vector<float>& logits, bool greedy, float temperature, int64_t top_k, float top_p,
                     std::mt19937_64& rng) {
  MT_REQUIRE(!logits.empty(), "sample_token: empty logits");
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

int run_generate(const GenerateArgs& args) {
  const Device device = resolve_device(args.device);
  set_current_device(device);
  MT_REQUIRE(args.out_seq_length > 0, "--out-seq-length must be positive, got {}", args.out_seq_length);
  data::Gpt2Tokenizer tok = data::Gpt2Tokenizer::from_files(args.vocab_file, args.merge_file);
  CheckpointState st = read_checkpoint_state(args.load);
  MT_REQUIRE(st.model.vocab_size == tok.vocab_size(), "checkpoint vocabulary {} differs from the tokenizer's {}",
             st.model.vocab_size, tok.vocab_size());
  Stream stream(device);
  GptModel model(st.model, 1, DType::kF32, device, ProcessGroups::single());
  load_checkpoint(args.load, model.params(), nullptr, stream);
  const int64_t S = st.model.seq_length, V = st.model.vocab_size, Vp = model.padded_vocab();

  Buffer tok_host(Device::cpu(), static_cast<size_t>(S) * 4);
  Buffer tok_dev(device, static_cast<size_t>(S) * 4);
  Tensor tokens = tok_dev.as(DType::kI32, {S, 1});
  std::mt19937_64 rng(args.seed);
  std::vector<float> row(static_cast<size_t>(Vp));
  for (int64_t sample = 0; sample < args.num_samples; ++sample) {
    std::vector<int32_t> ids = tok.encode(args.prompt);
    if (ids.empty()) ids.push_back(tok.eod());
    const size_t prompt_len = ids.size();
    for (int64_t t = 0; t < args.out_seq_length; ++t) {
      // Causal attention: positions < len see only the (last S) tokens; the rest is padding.
      const size_t start = ids.size() > static_cast<size_t>(S) ? ids.size() - S : 0;
      const int64_t len = static_cast<int64_t>(ids.size() - start);
      int32_t* h = static_cast<int32_t*>(tok_host.data());
      for (int64_t i = 0; i < S; ++i) h[i] = i < len ? ids[start + i] : tok.eod();
      copy_bytes(tok_dev.data(), device, h, Device::cpu(), static_cast<size_t>(S) * 4, stream);
      model.forward({tokens, Tensor(), Tensor()}, DropoutContext{0, 0, 0, false}, Tensor(), 0.f, stream,
                    /*compute_loss=*/false);
      const Tensor logits = model.logits();  // [S, Vp], fp32
      copy_bytes(row.data(), Device::cpu(), static_cast<float*>(logits.data()) + (len - 1) * Vp, device,
                 static_cast<size_t>(Vp) * 4, stream);
      stream.synchronize();
      std::vector<float> lv(row.begin(), row.begin() + V);
      int32_t next = sample_token(lv, args.greedy, args.temperature, args.top_k, args.top_p, rng);
      if (next == tok.eod()) break;
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
