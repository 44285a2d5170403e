// Bench helper for bench/loss_agreement.sh: writes the token samples a one-rank `megatron pretrain`
// trains on, so that the PyTorch reference (bench/pytorch_gpt2.py --samples) sees exactly the same
// batches. It builds the training split as pretrain does (data::build_gpt_datasets with the same
// sample counts, hence the same Megatron indices) and writes samples [0, n) of it — iteration i of a
// one-rank run with global batch = micro-batch B reads samples [i·B, (i + 1)·B) — as int32
// [n, seq + 1] little-endian.
// usage: train_samples_bench OUT N SEQ SEED TRAIN_ITERS GLOBAL_BATCH EVAL_INTERVAL EVAL_ITERS DATA_FLAGS...
//        (DATA_FLAGS: --data-path, --split, --vocab-file, --merge-file, ... as for pretrain)
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "data/data_args.h"

int main(int argc, char** argv) {
  if (argc < 9) {
    std::fprintf(stderr,
                 "usage: %s OUT N SEQ SEED TRAIN_ITERS GLOBAL_BATCH EVAL_INTERVAL EVAL_ITERS DATA_FLAGS...\n", argv[0]);
    return 2;
  }
  try {
    const std::string out = argv[1];
    const int64_t n = std::stoll(argv[2]), seq = std::stoll(argv[3]);
    const uint64_t seed = std::stoull(argv[4]);
    const int64_t iters = std::stoll(argv[5]), gbs = std::stoll(argv[6]), eval_interval = std::stoll(argv[7]),
                  eval_iters = std::stoll(argv[8]);
    CLI::App app("train samples");
    mt::data::DataArgs a;
    mt::data::add_data_options(app, a);
    std::vector<std::string> rest(argv + 9, argv + argc);
    std::reverse(rest.begin(), rest.end());  // CLI11 parses a reversed vector
    app.parse(rest);
    const auto tok = mt::data::build_tokenizer(a);
    const auto counts = mt::data::train_valid_test_num_samples(iters, gbs, eval_interval, eval_iters);
    const auto splits = mt::data::build_gpt_datasets(a, seq, seed, counts[0], counts[1], counts[2], *tok);
    std::vector<int32_t> buf(static_cast<size_t>(n * (seq + 1)));
    for (int64_t i = 0; i < n; ++i) splits.train->get(i % splits.train->size(), buf.data() + i * (seq + 1));
    std::ofstream f(out, std::ios::binary);
    f.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size() * sizeof(int32_t)));
    if (!f) throw std::runtime_error("cannot write " + out);
    std::printf("%lld samples of %lld tokens written to %s\n", static_cast<long long>(n),
                static_cast<long long>(seq + 1), out.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
