// Host cost of one training batch: Megatron GPTDataset samples + get_ltor_masks_and_position_ids,
// for GPT-2 124M shapes (seq 1024, global batch 16 and 32), against the GPU step time it must hide
// behind (docs/benchmarks.md). Usage: loader_bench <data prefix> <vocab.json> <merges.txt>
#include <chrono>
#include <cstdio>

#include "data/data_args.h"
#include "data/masks.h"

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s <data prefix> <vocab.json> <merges.txt>\n", argv[0]);
    return 2;
  }
  try {
    mt::data::DataArgs a;
    a.data_path = {argv[1]};
    a.split = "98,2,0";
    a.vocab_file = argv[2];
    a.merge_file = argv[3];
    auto tok = mt::data::build_tokenizer(a);
    const int64_t S = 1024;
    for (int64_t gbs : {16, 32}) {
      auto t0 = std::chrono::steady_clock::now();
      auto splits = mt::data::build_gpt_datasets(a, S, 1234, 500 * gbs, 0, 0, *tok);
      const double build_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::vector<int32_t> samples(gbs * (S + 1)), t(gbs * S), l(gbs * S), p(gbs * S), d(gbs * S);
      std::vector<float> m(gbs * S);
      mt::data::LtorOptions o;
      o.eod = tok->eod();
      o.reset_position_ids = o.reset_attention_mask = o.eod_mask_loss = true;
      const int iters = 50;
      t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < iters; ++it) {
        for (int64_t i = 0; i < gbs; ++i) splits.train->get((it * gbs + i) % splits.train->size(), &samples[i * (S + 1)]);
        mt::data::prepare_ltor_batch(samples.data(), gbs, S, o, t.data(), l.data(), m.data(), p.data(), d.data());
      }
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / iters;
      std::printf("global batch %3lld x seq %lld: index build %.1f ms; one batch (samples + masks, 1 thread) %.3f ms\n",
                  static_cast<long long>(gbs), static_cast<long long>(S), build_ms, ms);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
