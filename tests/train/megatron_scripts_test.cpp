// Megatron-LM's example launch scripts run as they are (issue 42 item 1): the argument lists of
// examples/gpt3/train_gpt3_175b_distributed.sh, examples/llama/train_llama3_8b_h100_fp8.sh and
// examples/mixtral/train_mixtral_8x7b_distributed.sh (written out here as the words bash passes to
// pretrain_gpt.py, paths as placeholders) parse; refused flags stop with their message; shrunk by
// appended overrides they train a few iterations on CPU thread ranks. Also: every no-op and
// refused flag of train/megatron_compat.h, sample-based schedules against their iteration-based
// twins, the WSD flags, --lr-warmup-fraction, --profile's window and --calculate-per-token-loss.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <bit>
#include <filesystem>
#include <sstream>
#include <vector>

#include "data/gpt_window_dataset.h"
#include "data/indexed_dataset.h"
#include "data/preprocess.h"
#include "data/tiktoken_tokenizer.h"
#include "plan/plan.h"
#include "testing/testing.h"
#include "train/evaluate.h"
#include "train/generate.h"
#include "train/megatron_compat.h"
#include "train/serve.h"
#include "train/trainer_testing.h"

namespace mt {
namespace {

using testing::CorpusFixture;
using testing::expect_error;
using testing::kCorpusVocab;
using testing::train_in_process;

// pretrain_gpt.py's arguments of examples/gpt3/train_gpt3_175b_distributed.sh (Megatron-LM main,
// 2026-11), in the script's order. The quoted --step-batch-size-schedule reaches the program as
// separate words (the array is expanded unquoted).
constexpr const char* kGpt3Script =
    "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048 "
    "--attention-backend auto "
    "--micro-batch-size 1 --global-batch-size 1536 "
    "--step-batch-size-schedule 0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536 "
    "--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 "
    "--clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 "
    "--lr-decay-iters 430000 "
    "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 "
    "--data-path $DATA --vocab-file $VOCAB --merge-file $MERGE --split 949,50,1 "
    "--log-interval 100 --save-interval 10000 --eval-interval 1000 --save $CKPT --load $CKPT --eval-iters 10 "
    "--tensorboard-dir $TB";

// examples/llama/train_llama3_8b_h100_fp8.sh with its MOCK data branch. DTYPE_ARGS (the FP8 flags)
// are left out: the script's own non-fp8 DTYPE gives this list (Llama3_8bParsesAsItIs adds them). The
// "--split '99,1,0'" array element keeps its quotes after word splitting.
constexpr const char* kLlama3Script =
    "--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192 "
    "--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 "
    "--hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused "
    "--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear "
    "--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748 "
    "--lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 "
    "--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 "
    "--grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc "
    "--empty-unused-memory-level 1 --exit-duration-in-mins 235 "
    "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
    "--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path $CACHE --tiktoken-pattern v2 "
    "--split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 "
    "--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile "
    "--profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60 "
    "--save $CKPT --load $CKPT --tensorboard-dir $TB";

// examples/mixtral/train_mixtral_8x7b_distributed.sh (without the WANDB_API_KEY branch).
constexpr const char* kMixtralScript =
    "--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 --num-layers 32 "
    "--hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu "
    "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion "
    "--no-position-embedding --rotary-base 1000000 "
    "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce "
    "--tokenizer-type Llama2Tokenizer --tokenizer-model $TOKENIZER --data-path $DATA --split 99990,8,2 "
    "--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000 "
    "--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16 "
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8 "
    "--use-distributed-optimizer --sequence-parallel "
    "--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save $CKPT --load $CKPT "
    "--tensorboard-dir $CKPT/tensorboard --no-load-optim --no-load-rng";

// The words of `line` (bash's word splitting), $NAME replaced from `vars`; words in `drop` removed,
// each with the values that follow it up to the next flag.
std::vector<std::string> words(const std::string& line, const std::map<std::string, std::string>& vars = {},
                               const std::vector<std::string>& drop = {}) {
  std::vector<std::string> out;
  std::istringstream in(line);
  bool dropping = false;
  for (std::string w; in >> w;) {
    for (const auto& [k, v] : vars) {
      for (size_t p = w.find("$" + k); p != std::string::npos; p = w.find("$" + k)) w.replace(p, k.size() + 1, v);
    }
    if (w.starts_with("--")) dropping = std::find(drop.begin(), drop.end(), w) != drop.end();
    if (!dropping) out.push_back(w);
  }
  return out;
}

std::string join(const std::vector<std::string>& w) {
  std::string s;
  for (const std::string& x : w) s += (s.empty() ? "" : " ") + x;
  return s;
}

// Parses the words as `megatron pretrain` does (CLI11, the words as given: no second splitting).
PretrainArgs parse_words(std::vector<std::string> w) {
  CLI::App app;
  PretrainArgs a;
  add_pretrain_options(app, a);
  std::reverse(w.begin(), w.end());  // CLI11 takes the vector last word first
  app.parse(w);
  return a;
}

// validate_pretrain_args after what TrainingSetup derives first (the data-parallel size of `world`
// ranks, the tokenizer's vocabulary).
PretrainArgs validated(PretrainArgs a, int world) {
  a.data_parallel_size = world / (a.tensor_model_parallel_size * a.pipeline_model_parallel_size);
  a.expert_data_parallel_size = world / (a.expert_model_parallel_size * a.pipeline_model_parallel_size);
  a.model.vocab_size = a.data.vocab_size > 0 ? a.data.vocab_size : 50257;
  validate_pretrain_args(a);
  return a;
}

const std::map<std::string, std::string> kPaths = {{"DATA", "/data/corpus"},  {"VOCAB", "/data/vocab.json"},
                                                   {"MERGE", "/data/merges.txt"}, {"CKPT", "/ckpt"},
                                                   {"TB", "/tb"},           {"CACHE", "/cache"},
                                                   {"TOKENIZER", "/data/tokenizer.model"}};

std::string compat_error(const PretrainArgs& a) {
  try {
    check_megatron_compat(a);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(MegatronScripts, Gpt3175bParsesWithItsStepBatchSchedule) {
  const PretrainArgs full = parse_words(words(kGpt3Script, kPaths));  // no unknown flag
  EXPECT_EQ(compat_error(full), "");
  // 16 x 8 = 128 ranks: TP 8, PP 16, DP 1.
  const PretrainArgs a = validated(full, 128);
  EXPECT_TRUE(a.fp16);
  EXPECT_EQ(a.train_iters, 500000);
  EXPECT_EQ(a.global_batch_size, 1536);  // = the schedule's final batch (Megatron-LM refuses both flags)
  EXPECT_EQ(a.num_microbatches(), 1536);
  // 2.4B tokens // --seq-length 2048 = 1171875 samples per step of the schedule
  EXPECT_EQ(a.batch_schedule.at(0), 16);
  EXPECT_EQ(a.batch_schedule.at(1171874), 16);
  EXPECT_EQ(a.batch_schedule.at(1171875), 320);
  EXPECT_EQ(a.batch_schedule.at(5859375), 1536);
  EXPECT_EQ(a.microbatch_counts(), (std::vector<int64_t>{16, 320, 624, 928, 1232, 1536}));
  // With a batch schedule Megatron's scheduler counts samples: --lr-decay-iters x the global batch.
  const LrScheduleConfig s = a.lr_schedule();
  EXPECT_EQ(s.decay_steps, int64_t{430000} * 1536);
  EXPECT_NEAR(s.warmup_steps, 430.0 * 1536, 1e-6);  // Megatron: --lr-warmup-fraction x the decay length
  EXPECT_EQ(s.decay_style, "cosine");
  EXPECT_DOUBLE_EQ(learning_rate(s, a.lr_step(20, 215 * 1536)), 6.0e-5 * 215 * 1536 / s.warmup_steps);
}

TEST(MegatronScripts, Llama3_8bParsesAsItIs) {
  // Every flag of the script is implemented or a documented no-op (none is refused).
  const PretrainArgs full = parse_words(words(kLlama3Script, kPaths));
  EXPECT_EQ(compat_error(full), "");
  const PretrainArgs a = validated(full, 8);
  EXPECT_TRUE(a.model.layernorm_zero_centered_gamma);  // --apply-layernorm-1p
  EXPECT_EQ(a.train_samples, 1953125000);
  EXPECT_EQ(a.train_iters, 1953125000 / 128);  // Megatron's update_train_iters
  EXPECT_EQ(a.num_microbatches(), 16);
  EXPECT_TRUE(a.calculate_per_token_loss);
  EXPECT_TRUE(a.profile.enabled);
  EXPECT_EQ(a.profile.step_start, 4);
  EXPECT_EQ(a.profile.step_end, 6);
  EXPECT_EQ(a.data.split, "'99,1,0'");  // quotes and all, as bash passes it; read as 99,1,0
  const LrScheduleConfig s = a.lr_schedule();  // in samples
  EXPECT_EQ(s.decay_steps, 1949218748);
  EXPECT_EQ(s.warmup_steps, 3906252);
  EXPECT_EQ(a.lr_step(10, 1280), 1280);
  // --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5: the embedding and output layer's schedule.
  EXPECT_TRUE(a.optim.decoupled_lr);
  const LrScheduleConfig d = a.decoupled_lr_schedule();
  EXPECT_EQ(d.max_lr, 5.0e-4);
  EXPECT_EQ(d.min_lr, 4.5e-5);
  EXPECT_EQ(d.decay_steps, s.decay_steps);
  EXPECT_EQ(d.warmup_steps, s.warmup_steps);
  // the script's FP8 branch (DTYPE=fp8: its DTYPE_ARGS) parses and validates too
  const PretrainArgs fp8 = parse_words(words(std::string(kLlama3Script) +
                                             " --fp8-format hybrid --fp8-amax-history-len 1024 "
                                             "--fp8-amax-compute-algo max --fp8-param-gather",
                                             kPaths));
  EXPECT_EQ(compat_error(fp8), "");
  const PretrainArgs f = validated(fp8, 8);
  EXPECT_EQ(f.model.fp8, Fp8Format::kHybrid);
  EXPECT_EQ(f.model.fp8_amax_history_len, 1024);
  EXPECT_TRUE(f.model.fp8_param);
}

// "--split '99,1,0'" inside a bash array keeps its quotes (the Llama 3 script): read as Megatron
// reads it (the numbers only); an unmatched quote is still an error.
TEST(MegatronScripts, QuotedSplit) {
  EXPECT_EQ(data::parse_split("'99,1,0'"), data::parse_split("99,1,0"));
  EXPECT_EQ(data::parse_split("\"969,30,1\""), data::parse_split("969,30,1"));
  expect_error([] { data::parse_split("'99,1,0"); }, "is not a non-negative number");
}

TEST(MegatronScripts, Mixtral8x7bParsesAsItIs) {
  const PretrainArgs a = validated(parse_words(words(kMixtralScript, kPaths)), 32);  // TP 1, PP 4, EP 8: 32 ranks
  EXPECT_EQ(a.model.num_moe_experts, 8);
  EXPECT_EQ(a.expert_model_parallel_size, 8);
  EXPECT_EQ(a.num_microbatches(), 32);
  EXPECT_EQ(a.model.position_embedding_type, PositionEmbeddingType::kRope);
  // The WANDB_API_KEY branch of the script.
  const std::string err = compat_error(
      parse_words(words(std::string(kMixtralScript) + " --wandb-project Mixtral --wandb-exp-name Mixtral_8x7B", kPaths)));
  EXPECT_NE(err.find("--wandb-project is not supported: Weights & Biases logging is not built"), std::string::npos)
      << err;
}

// Every table flag: a no-op parses and validates with a value Megatron-LM accepts (and refuses a
// value it refuses); a refused flag names itself and its reason.
TEST(MegatronScripts, EveryCompatFlag) {
  const std::string base = "--train-iters 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 64 ";
  int noops = 0, refusals = 0;
  for (const CompatFlag& f : megatron_compat_flags()) {
    std::string value;
    switch (f.value) {
      case CompatValue::kSwitch: break;
      case CompatValue::kText: value = "x"; break;
      case CompatValue::kChoice: value = std::string(f.choices).substr(0, std::string(f.choices).find('|')); break;
      case CompatValue::kNonNegative: value = "1"; break;
      case CompatValue::kNumber: value = "1e-4"; break;
      case CompatValue::kList: value = "16 8 1000"; break;
    }
    const std::string names = f.name, name = names.substr(0, names.find(','));  // each spelling works
    const std::string flag = names.find(',') == std::string::npos ? name : names.substr(names.find(',') + 1);
    const std::string moe = name.starts_with("--moe-") ? "--num-experts 2 --disable-bias-linear " : "";
    const std::string line = base + moe + (noops % 2 ? flag : name) + " " + value;
    SCOPED_TRACE(line);
    if (f.handling == CompatHandling::kNoOp) {
      ++noops;
      EXPECT_NO_THROW(validated(parse_words(words(line)), 1));
      // without effect: the run's plan (layout, every memory part, the predicted step) is the same
      // with and without the flag
      PlanRequest with, without;
      with.args = parse_words(words(line));
      without.args = parse_words(words(base + moe));
      with.gpu = without.gpu = "h200";
      EXPECT_EQ(plan_json(plan_training(with)), plan_json(plan_training(without)));
      if (f.value == CompatValue::kChoice || f.value == CompatValue::kNonNegative) {
        EXPECT_THROW(parse_words(words(base + name + " bogus")), CLI::ParseError);
      }
    } else {
      ++refusals;
      expect_error([&] { validated(parse_words(words(base + flag + " " + value)), 1); },
                   name + " is not supported: " + std::string(f.reason).substr(0, 30));
    }
  }
  EXPECT_GE(noops, 55);
  EXPECT_GE(refusals, 70);
  // TikTokenizer is built (its options parse; the tokenizer itself: TikTokenizerPreprocessesAndTrains)
  const PretrainArgs tt = parse_words(words("--train-iters 2 --lr 1 --mock-data --tokenizer-type TikTokenizer "
                                            "--tiktoken-pattern v1 --tiktoken-num-special-tokens 12 "
                                            "--tiktoken-special-tokens <unk> <s> </s> <mask> <pad> <cls> <sep> <x>"));
  EXPECT_EQ(compat_error(tt), "");
  EXPECT_EQ(tt.data.tiktoken.pattern, "v1");
  EXPECT_EQ(tt.data.tiktoken.num_special_tokens, 12);
  EXPECT_EQ(tt.data.tiktoken.special_tokens.size(), 8u);
  expect_error([&] { validated(parse_words(words(base + "--no-position-embedding")), 1); },
               "--no-position-embedding with --position-embedding-type learned_absolute");
  EXPECT_NO_THROW(validated(parse_words(words(base + "--no-position-embedding --position-embedding-type rope")), 1));
}

TEST(MegatronScripts, IterationAndSampleFlagsDoNotMix) {
  const std::string base = "--lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 64 --global-batch-size 4 ";
  expect_error([&] { validated(parse_words(words(base + "--train-samples 40 --train-iters 10")), 1); },
               "--train-iters with --train-samples");
  expect_error([&] { validated(parse_words(words(base + "--train-samples 40 --lr-decay-iters 10")), 1); },
               "--lr-decay-iters with --train-samples");
  expect_error([&] { validated(parse_words(words(base + "--train-iters 10 --lr-warmup-samples 8")), 1); },
               "--lr-warmup-samples with --train-iters");
  expect_error([&] { validated(parse_words(words(base + "--train-iters 10 --lr-warmup-fraction 0.1 --lr-warmup-iters 2")), 1); },
               "give only one warm-up length");
  expect_error([&] { validated(parse_words(words(base)), 1); }, "give --train-iters (iterations) or --train-samples");
  expect_error([&] { validated(parse_words(words(base + "--train-samples 3")), 1); },
               "--train-samples 3 is less than one global batch of 4 samples");
  expect_error([&] { validated(parse_words(words(base + "--train-iters 10 --profile --profile-step-start 5 --profile-step-end 5")), 1); },
               "--profile-step-end 5 must be greater than --profile-step-start 5");
}

// The learning rate before each iteration, as the trainer computes it.
std::vector<double> rates(const PretrainArgs& a) {
  std::vector<double> r;
  for (int64_t i = 0; i <= a.train_iters + 2; ++i) r.push_back(learning_rate(a.lr_schedule(), a.lr_step(i, i * a.global_batch_size)));
  return r;
}

TEST(MegatronScripts, SampleSchedulesEqualTheirIterationTwins) {
  const std::string base =
      "--lr 1e-3 --min-lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 64 --global-batch-size 8 "
      "--lr-warmup-init 1e-5 ";
  for (const std::string style : {"linear", "cosine", "constant", "inverse-square-root"}) {
    SCOPED_TRACE(style);
    const PretrainArgs it = validated(parse_words(words(
        base + "--lr-decay-style " + style + " --train-iters 40 --lr-warmup-iters 5 --lr-decay-iters 30")), 1);
    const PretrainArgs sa = validated(parse_words(words(
        base + "--lr-decay-style " + style + " --train-samples 327 --lr-warmup-samples 40 --lr-decay-samples 240")), 1);
    EXPECT_EQ(sa.train_iters, 40);  // floor(327 / 8)
    const std::vector<double> a = rates(it), b = rates(sa);
    for (size_t i = 0; i < a.size(); ++i) {
      if (style == "inverse-square-root")
        EXPECT_NEAR(b[i], a[i], 1e-15) << i;  // sqrt(8w) / sqrt(8s): rounded differently
      else
        EXPECT_EQ(b[i], a[i]) << i;
    }
    EXPECT_GT(a[1], a[0]);  // the warm-up starts at --lr-warmup-init
    EXPECT_EQ(a[0], 1e-5);
  }
  // WSD: --lr-wsd-decay-iters / -samples, --lr-wsd-decay-style.
  const PretrainArgs it = validated(parse_words(words(base + "--lr-decay-style WSD --lr-wsd-decay-style linear "
                                                             "--train-iters 40 --lr-warmup-iters 5 --lr-wsd-decay-iters 10")), 1);
  const PretrainArgs sa = validated(parse_words(words(base + "--lr-decay-style WSD --lr-wsd-decay-style linear "
                                                             "--train-samples 320 --lr-warmup-samples 40 "
                                                             "--lr-wsd-decay-samples 80")), 1);
  EXPECT_EQ(rates(it), rates(sa));
  EXPECT_EQ(rates(it)[30], 1e-3);  // stable until the last 10 iterations
  EXPECT_NEAR(rates(it)[35], 1e-4 + 0.5 * (1e-3 - 1e-4), 1e-15);
  EXPECT_EQ(rates(it)[40], 1e-4);
  expect_error([&] { validated(parse_words(words(base + "--lr-decay-style WSD --train-iters 40")), 1); },
               "wsd_decay_steps=0 must be in [1, decay_steps=40]");
  // --lr-warmup-fraction: of the decay length, as --lr-warmup-iters where that is whole.
  const PretrainArgs fr = validated(parse_words(words(base + "--lr-decay-style cosine --train-iters 40 "
                                                             "--lr-decay-iters 32 --lr-warmup-fraction 0.25")), 1);
  const PretrainArgs wi = validated(parse_words(words(base + "--lr-decay-style cosine --train-iters 40 "
                                                             "--lr-decay-iters 32 --lr-warmup-iters 8")), 1);
  EXPECT_EQ(rates(fr), rates(wi));
}

TEST(MegatronScripts, CudaGraphImplTransformerEngineIsThePerLayerCapture) {
  const PretrainArgs a = validated(parse_words(words("--train-iters 2 --lr 1e-3 --mock-data --tokenizer-type "
                                                     "NullTokenizer --vocab-size 64 --cuda-graph-impl "
                                                     "transformer_engine --cuda-graph-scope attn mlp")), 1);
  EXPECT_EQ(a.cuda_graph.impl, "local");
  EXPECT_TRUE(a.cuda_graph.per_layer());
  EXPECT_TRUE(a.cuda_graph.captures("attn"));
  EXPECT_FALSE(a.cuda_graph.captures("moe"));
}

TEST(MegatronScripts, ProfileWindowFollowsMegatronsLoop) {
  PretrainArgs a = validated(parse_words(words("--train-iters 10 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
                                               "--vocab-size 64 --profile --profile-step-start 2 "
                                               "--profile-step-end 4 --profile-ranks 0 3")), 1);
  EXPECT_EQ(a.profile.ranks, (std::vector<int>{0, 3}));
  for (int rank : {0, 1, 3}) {
    ProfileWindow w(a, rank, /*cuda=*/false);
    std::vector<int64_t> profiled;
    for (int64_t it = 0; it < 10;) {
      w.before_step(it);
      if (w.active()) profiled.push_back(it);  // the step of 0-based index `it` runs now
      ++it;
      w.after_step(it);
    }
    if (rank == 1) {
      EXPECT_TRUE(profiled.empty());
      EXPECT_EQ(w.starts(), 0);
    } else {
      EXPECT_EQ(profiled, (std::vector<int64_t>{2, 3})) << rank;
      EXPECT_EQ(w.starts(), 1);
      EXPECT_EQ(w.stops(), 1);
    }
  }
  a.profile.ranks.clear();  // none given: every rank
  ProfileWindow every(a, 7, false);
  every.before_step(2);
  EXPECT_TRUE(every.active());
}

// The binary (with its strict number syntax, e.g. --lr-warmup-fraction .001) takes the scripts'
// words as they are: each stops at what this machine cannot run, never at an unknown flag.
std::string shell_quoted(const std::vector<std::string>& w) {
  std::string s;
  for (const std::string& x : w) {
    s += " '";
    for (char c : x) s += c == '\'' ? std::string("'\\''") : std::string(1, c);
    s += "'";
  }
  return s;
}

TEST(MegatronScripts, TheBinaryTakesTheScriptsWords) {
  const auto run = [](const char* script, const std::vector<std::string>& drop = {}) {
    return testing::run_megatron("pretrain --device cpu" + shell_quoted(words(script, kPaths, drop)));
  };
  testing::RunResult r = run(kGpt3Script);  // 128 ranks: TP 8 x PP 16
  EXPECT_NE(r.rc, 0);
  EXPECT_EQ(r.out.find("not supported"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("world size 1 is not divisible by tp (8) x cp (1) x pp (16)"), std::string::npos) << r.out;
  r = run(kLlama3Script);
  EXPECT_NE(r.rc, 0);
  EXPECT_EQ(r.out.find("not supported"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--bf16 needs a CUDA device"), std::string::npos) << r.out;
  r = run(kMixtralScript);  // 32 ranks: TP 1 x PP 4 x DP 8 (EP 8)
  EXPECT_NE(r.rc, 0);
  EXPECT_EQ(r.out.find("not expected"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("not supported"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Megatron-LM flags accepted without effect here"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("world size 1 is not divisible by tp (1) x cp (1) x pp (4)"), std::string::npos) << r.out;
  // a flag in no table: CLI11's message, pointing at the list of Megatron-LM flags, and a failing exit
  r = testing::run_megatron("pretrain --device cpu --train-iters 2 --lr 1e-3 --mock-data --no-such-megatron-flag");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("The following argument was not expected: --no-such-megatron-flag"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("docs/flags.md"), std::string::npos) << r.out;
  // a no-op flag that takes only the value describing this implementation: another value is an error
  r = testing::run_megatron("pretrain --device cpu --train-iters 2 --lr 1e-3 --mock-data --main-grads-dtype bf16");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("--main-grads-dtype"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("fp32"), std::string::npos) << r.out;
}

// --exit-on-missing-checkpoint: with --load == --save and no checkpoint there, an error (without the
// flag the run starts from scratch, as Megatron-LM does).
TEST(MegatronScripts, ExitOnMissingCheckpoint) {
  const std::string d = ::testing::TempDir() + "mt_exit_on_missing_ckpt";
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  const std::string base = "pretrain --device cpu --num-layers 1 --hidden-size 16 --num-attention-heads 2 "
                           "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 1 "
                           "--train-iters 1 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 64 "
                           "--eval-iters 0 --no-progress --load " + d + " --save " + d;
  testing::RunResult r = testing::run_megatron(base + " --exit-on-missing-checkpoint");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("holds no checkpoint and --exit-on-missing-checkpoint is given"), std::string::npos) << r.out;
  r = testing::run_megatron(base);
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("starting from scratch"), std::string::npos) << r.out;
  std::filesystem::remove_all(d);
}

// The scripts train, shrunk by appended overrides (a flag given again takes the last value), on
// CPU thread ranks. The CPU backend trains in fp32, so --fp16 / --bf16 / --grad-reduce-in-bf16
// are left out; the refused flags too.
class MegatronScriptsRun : public CorpusFixture {
 protected:
  static std::map<std::string, std::string> paths(const std::string& name) {
    return {{"DATA", corpus()},         {"VOCAB", "unused"},      {"MERGE", "unused"}, {"CKPT", dir(name + "_ckpt")},
            {"TB", dir(name + "_tb")}, {"CACHE", dir(name + "_cache")}, {"TOKENIZER", "unused"}};
  }
  static std::string corpus() { return dir("corpus"); }
  static constexpr const char* kSmall =
      " --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
      "--global-batch-size 8 --eval-iters 1 --eval-interval 2 --log-interval 1 --device cpu --no-progress "
      "--tokenizer-type NullTokenizer --vocab-size 96 --make-vocab-size-divisible-by 64 ";

  static void expect_trains(const TrainingResult& r, int64_t iters) {
    EXPECT_EQ(r.iteration, iters);
    ASSERT_EQ(r.losses.size(), static_cast<size_t>(iters));
    for (const auto& [i, l] : r.losses) EXPECT_TRUE(std::isfinite(l)) << i;
    EXPECT_LT(r.losses.rbegin()->second, r.losses.begin()->second);
  }
};

// The schedule shrunk with the model: batches of 4 then (from 64 tokens = 2 samples) 8.
TEST_F(MegatronScriptsRun, Gpt3OnTpTwoPpTwo) {
  const std::string args =
      join(words(kGpt3Script, paths("gpt3"), {"--step-batch-size-schedule", "--fp16"})) + kSmall +
      "--max-position-embeddings 32 --train-iters 4 --lr-decay-iters 4 --lr 3e-3 --tensor-model-parallel-size 2 "
      "--pipeline-model-parallel-size 2 --nproc-per-node 4 --step-batch-size-schedule 0:4 64:8";
  const TrainingResult r = train_in_process(args);
  expect_trains(r, 4);
  EXPECT_EQ(r.consumed_samples, 4 + 3 * 8);
}

TEST_F(MegatronScriptsRun, Llama3SampleBasedWithDistributedOptimizer) {
  const std::string args =
      join(words(kLlama3Script, paths("llama"),
                 {"--bf16", "--grad-reduce-in-bf16"})) +
      kSmall + "--kv-channels 8 --ffn-hidden-size 64 --num-query-groups 2 --max-position-embeddings 32 "
      "--train-samples 32 --lr-decay-samples 32 --lr-warmup-samples 8 --lr 3e-3 --nproc-per-node 2 "
      "--profile-step-start 1 --profile-step-end 3";
  expect_trains(train_in_process(args), 4);  // 32 samples / 8
}

// --apply-layernorm-1p is the plain norm at the start (scale 1 + 0 == 1, the 1 added in fp32; the
// weight initialised to 0): the first iteration's loss is bitwise the same. Afterwards the updates
// of w and of 1 + w round differently in fp32, so the losses stay close, not equal. LayerNorm (GPT)
// and RMSNorm with q/k norms (Llama-style), with TP 2 (the norm weights' gradients summed over TP).
TEST_F(MegatronScriptsRun, ApplyLayernorm1pTrainsAsThePlainNorm) {
  for (const std::string arch :
       {"", "--normalization RMSNorm --qk-layernorm --swiglu --disable-bias-linear --position-embedding-type rope "
            "--tensor-model-parallel-size 2 --sequence-parallel --nproc-per-node 2 "}) {
    const std::string base = flags(arch + "--train-iters 4 --lr-decay-iters 4");
    testing::SetupInfo plain_info, onep_info;
    const TrainingResult plain = train_in_process(base, &plain_info);
    const TrainingResult onep = train_in_process(base + " --apply-layernorm-1p", &onep_info);
    EXPECT_NE(onep_info.model_summary.find("zero-centred norm weights"), std::string::npos) << onep_info.model_summary;
    EXPECT_EQ(plain_info.model_summary.find("zero-centred"), std::string::npos);
    ASSERT_EQ(plain.losses.size(), 4u);
    ASSERT_EQ(onep.losses.size(), 4u);
    EXPECT_EQ(std::bit_cast<uint32_t>(onep.losses.begin()->second), std::bit_cast<uint32_t>(plain.losses.begin()->second))
        << arch;
    for (const auto& [it, l] : plain.losses) EXPECT_NEAR(onep.losses.at(it), l, 1e-4 * l) << arch << " iteration " << it;
  }
}

TEST_F(MegatronScriptsRun, MixtralOnPpTwoEpTwo) {
  const std::string args =
      join(words(kMixtralScript, paths("mixtral"), {"--bf16"})) + kSmall +
      "--ffn-hidden-size 64 --num-query-groups 2 --num-experts 4 --expert-model-parallel-size 2 "
      "--pipeline-model-parallel-size 2 --split 90,8,2 --train-iters 4 --lr-decay-iters 4 --lr-warmup-iters 1 "
      "--lr 3e-3 --nproc-per-node 4";
  expect_trains(train_in_process(args), 4);
}

// --calculate-per-token-loss: the mean over the global batch's unmasked tokens. With every token
// in the loss it is the mean of the micro-batches' means (bitwise); with --eod-mask-loss the
// micro-batches count different tokens and the two differ, except with one micro-batch.
TEST_F(MegatronScriptsRun, PerTokenLoss) {
  const std::string base = std::string(kSmall) + "--data-path " + corpus() +
                           " --split 90,8,2 --max-position-embeddings 32 --train-iters 3 --lr 3e-3 ";
  const auto losses = [&](const std::string& extra) { return train_in_process(base + extra).losses; };
  EXPECT_EQ(losses("--calculate-per-token-loss"), losses(""));
  const auto per_token = losses("--eod-mask-loss --calculate-per-token-loss"), per_mb = losses("--eod-mask-loss");
  EXPECT_NE(per_token, per_mb);
  for (const auto& [i, l] : per_token) EXPECT_NEAR(l, per_mb.at(i), 0.05 * per_mb.at(i)) << i;
  EXPECT_EQ(losses("--eod-mask-loss --calculate-per-token-loss --global-batch-size 2"),
            losses("--eod-mask-loss --global-batch-size 2"));
}

// --calculate-per-token-loss across ranks: the token count is the global batch's, so DP 2 and PP 2
// (thread ranks) give the one-rank per-token losses, within fp32 rounding. A corpus of 1- to
// 5-token documents puts several masked EODs into every sequence, in different numbers per
// micro-batch, so the per-micro-batch means (what a count per rank or per micro-batch would give)
// differ from the per-token ones by ten times the bound or more.
TEST_F(MegatronScriptsRun, PerTokenLossAcrossRanks) {
  const std::string prefix = dir("short_docs");
  {
    data::IndexedDatasetBuilder b(prefix, data::IndexDType::kUInt16);
    std::mt19937_64 rng(20261129);
    for (int d = 0; d < 3000; ++d) {
      std::vector<int32_t> doc(1 + rng() % 5);
      for (auto& x : doc) x = static_cast<int32_t>(rng() % (kCorpusVocab - 1));
      doc.push_back(kCorpusVocab - 1);  // EOD
      b.add_document(doc);
    }
    b.finalize();
  }
  const std::string base = std::string(kSmall) + "--data-path " + prefix +
                           " --split 90,8,2 --max-position-embeddings 32 --train-iters 3 --lr 3e-3 --eod-mask-loss ";
  const auto losses = [&](const std::string& extra) { return train_in_process(base + extra).losses; };
  const auto per_token = losses("--calculate-per-token-loss"), per_mb = losses("");
  for (const char* layout : {"--nproc-per-node 2", "--nproc-per-node 2 --pipeline-model-parallel-size 2"}) {
    const auto par = losses(std::string("--calculate-per-token-loss ") + layout);
    ASSERT_EQ(par.size(), per_token.size()) << layout;
    for (const auto& [i, l] : per_token) {
      // measured: ranks vs one rank <= 1.1e-7 relative; per-micro-batch vs per-token >= 3.6e-5
      EXPECT_NEAR(par.at(i), l, 2e-6 * l) << layout << " iteration " << i;
      EXPECT_GT(std::abs(per_mb.at(i) - l), 2e-5 * l) << "iteration " << i << ": the masks did not make the two differ";
    }
  }
}


// The TikTokenizer vocabulary of tests/data/fixtures/tiktoken_ref (Megatron's JSON format).
std::string tiktoken_fixture_vocab() {
  const char* src = std::getenv("MT_SOURCE_DIR");
  return std::string(src ? src : ".") + "/tests/data/fixtures/tiktoken_ref/vocab.json";
}

// --tokenizer-type TikTokenizer through preprocess_data and pretraining, with the Llama 3 script's
// --tiktoken-pattern v2 and the vocabulary of tests/data/fixtures/tiktoken_ref (Megatron's JSON
// format; 10 special tokens, so 10 + its ranks ids in all).
TEST_F(MegatronScriptsRun, TikTokenizerPreprocessesAndTrains) {
  const std::string vocab = tiktoken_fixture_vocab();
  ASSERT_TRUE(std::filesystem::is_regular_file(vocab)) << vocab;
  const int64_t ranks = static_cast<int64_t>(nlohmann::json::parse(std::ifstream(vocab)).size());
  {
    std::ofstream j(dir("tt.jsonl"));
    for (int d = 0; d < 200; ++d)
      j << nlohmann::json{{"text", fmt::format("Document {} — naïve café 東京 👍🏽: the quick brown fox, {} times. "
                                               "HelloWorld it's here.", d, d * 7)}}.dump()
        << "\n";
  }
  data::PreprocessConfig c;
  c.inputs = {dir("tt.jsonl")};
  c.output_prefix = dir("tt");
  c.append_eod = true;
  c.tokenizer_type = "TikTokenizer";
  c.tokenizer_model = vocab;
  c.vocab_size = 10 + ranks;
  c.tiktoken.num_special_tokens = 10;
  const data::PreprocessStats st = data::preprocess_data(c);
  EXPECT_EQ(st.documents, 200);
  // the first document decodes back to its text, then EOD (</s> = 2)
  const data::TikTokenizer tok = data::TikTokenizer::from_file(vocab, [&] {
    data::TikTokenOptions o;
    o.num_special_tokens = 10;
    o.vocab_size = 10 + ranks;
    return o;
  }());
  data::IndexedDataset ds(st.output_prefixes.at(0));
  const std::vector<int32_t> doc0 = ds.get(0);
  ASSERT_FALSE(doc0.empty());
  EXPECT_EQ(doc0.back(), 2);
  EXPECT_EQ(tok.decode(std::span(doc0).first(doc0.size() - 1)),
            "Document 0 — naïve café 東京 👍🏽: the quick brown fox, 0 times. HelloWorld it's here.");
  const std::string args = std::string(kSmall) + fmt::format(
      "--tokenizer-type TikTokenizer --tokenizer-model {} --vocab-size {} --tiktoken-num-special-tokens 10 "
      "--tiktoken-pattern v2 --data-path {} --split 90,8,2 --max-position-embeddings 32 --train-iters 4 --lr 3e-3",
      vocab, 10 + ranks, st.output_prefixes.at(0));
  testing::SetupInfo info;
  const TrainingResult r = train_in_process(args, &info);
  expect_trains(r, 4);
  EXPECT_EQ(info.padded_vocab, ((10 + ranks + 63) / 64) * 64);
}


// generate, serve and evaluate take the TikTokenizer options of the pretraining script
// (--tiktoken-pattern, --tiktoken-num-special-tokens, --tokenizer-special-tokens) and build the
// tokenizer with them: ids shift with the number of special tokens, v1 and v2 cut combining marks
// differently, and a pattern that is neither is refused by each command's parser.
TEST(MegatronScripts, InferenceCommandsTakeTikTokenOptions) {
  const std::string vocab = tiktoken_fixture_vocab();
  ASSERT_TRUE(std::filesystem::is_regular_file(vocab)) << vocab;
  const int64_t ranks = static_cast<int64_t>(nlohmann::json::parse(std::ifstream(vocab)).size());
  const std::string flags = fmt::format(
      "--load ck --tokenizer-type TikTokenizer --tokenizer-model {} --tiktoken-pattern v1 "
      "--tiktoken-num-special-tokens 10",
      vocab);
  GenerateArgs g;
  {
    CLI::App app;
    add_generate_options(app, g);
    app.parse(flags, false);
  }
  std::vector<const data::TikTokenOptions*> parsed{&g.tiktoken};
#ifdef MT_WITH_HTTPLIB  // `megatron serve` is built only with cpp-httplib
  ServeArgs sv;
  {
    CLI::App app;
    add_serve_options(app, sv);
    app.parse(flags, false);
  }
  parsed.push_back(&sv.tiktoken);
#endif
  EvaluateArgs ev;
  {
    CLI::App app;
    add_evaluate_options(app, ev);
    app.parse(flags, false);
  }
  parsed.push_back(&ev.tiktoken);
  for (const data::TikTokenOptions* o : parsed) {
    EXPECT_EQ(o->pattern, "v1");
    EXPECT_EQ(o->num_special_tokens, 10);
  }
  // combining marks: v1 and v2 cut them into different pieces (text 7 of the fixture corpus)
  const std::string text =
      "e\xCC\x81t\xC3\xA9 co\xCC\x88operate a\xCC\x8A \xE0\xA4\xB9\xE0\xA4\xBF\xE0\xA4\xA8\xE0\xA5\x8D\xE0\xA4"
      "\xA6\xE0\xA5\x80";
  const auto encode = [&](const data::TikTokenOptions& o) {
    return inference_tokenizer("ck", "", "", "TikTokenizer", vocab, 10 + ranks, o)->encode(text);
  };
  data::TikTokenOptions want = g.tiktoken;
  want.vocab_size = 10 + ranks;
  EXPECT_EQ(encode(g.tiktoken), data::TikTokenizer::from_file(vocab, want).encode(text));
  data::TikTokenOptions v2 = g.tiktoken;
  v2.pattern = "v2";
  EXPECT_NE(encode(g.tiktoken), encode(v2));
  data::TikTokenOptions more_special = g.tiktoken;
  more_special.num_special_tokens = 11;
  EXPECT_NE(encode(g.tiktoken), encode(more_special));
  const std::string bad = "--load ck --tiktoken-pattern v3";
  {
    CLI::App app;
    GenerateArgs a;
    add_generate_options(app, a);
    EXPECT_THROW(app.parse(bad, false), CLI::ValidationError);
  }
#ifdef MT_WITH_HTTPLIB
  {
    CLI::App app;
    ServeArgs a;
    add_serve_options(app, a);
    EXPECT_THROW(app.parse(bad, false), CLI::ValidationError);
  }
#endif
}

}  // namespace
}  // namespace mt
