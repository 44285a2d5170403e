// Megatron-LM flags without an implementation of their own: the no-op / refused table, sample-based
// training, the remaining schedule flags and --profile (see train/megatron_compat.h).
#include "train/megatron_compat.h"

#include <CLI/CLI.hpp>

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "comm/bootstrap.h"
#include "core/cli_validators.h"
#include "core/logging.h"
#include "train/arguments.h"

#ifdef MT_WITH_CUDA
#include <cuda_profiler_api.h>

#include "core/cuda_check.h"
#endif

namespace mt {

namespace {

using enum CompatHandling;
using enum CompatValue;

constexpr const char* kFusion =
    "a fusion switch: each operation has one implementation here, fused where it is (results do not depend on it)";
constexpr const char* kWandb =
    "Weights & Biases logging is not built; use --tensorboard-dir (TensorBoard event files) or --metrics-file (JSON "
    "lines)";
constexpr const char* kStraggler = "the straggler detector is not built";
constexpr const char* kFaultTolerance = "the fault-tolerance package (nvidia-resiliency-ext) is not built";
constexpr const char* kSharp = "SHARP in-network reductions are not built";
constexpr const char* kOffload =
    "optimizer offload to the host is not built (--use-precision-aware-optimizer shrinks the main parameters)";
constexpr const char* kNonPersistent = "non-persistent checkpoints are not built";
constexpr const char* kWeightDecayIncr =
    "the weight decay is constant (--weight-decay); the linear / cosine increments are not built";
constexpr const char* kRopeScaling =
    "RoPE frequency scaling (Llama 3.1's, position interpolation) is not built; YaRN is, with "
    "--multi-latent-attention (--rope-type yarn, docs/mla.md)";
constexpr const char* kAdamMoments = "Adam's moments are fp32 (the only choice here)";
constexpr const char* kParallelSave = "every rank always writes its own shards in parallel (docs/checkpoints.md)";
constexpr const char* kTeBulk =
    "Transformer Engine userbuffers' bulk overlaps do not exist here: --tp-comm-overlap pipelines its collectives "
    "with the GEMM chunks in one fixed way (docs/parallelism.md)";
constexpr const char* kFsdp =
    "PyTorch FSDP2 is not built; --use-megatron-fsdp --data-parallel-sharding-strategy optim (or "
    "--use-distributed-optimizer) shards the optimizer state over data-parallel ranks (ZeRO-1), docs/fsdp.md";

const CompatFlag kFlags[] = {
    // implementation choices that are always one way here
    {"--use-mcore-models", kSwitch, nullptr, kNoOp,
     "the model is always Megatron-Core's GPT built from layer specs (there is no legacy model)"},
    {"--transformer-impl", kChoice, "local|transformer_engine|inference_optimized", kNoOp,
     "the layers have one implementation (this project's kernels; Transformer Engine is not used)"},
    {"--use-flash-attn", kSwitch, nullptr, kNoOp,
     "the attention kernel is chosen by --attention-backend (auto: cuDNN fused or FlashAttention-2 where they apply)"},
    {"--no-masked-softmax-fusion", kSwitch, nullptr, kNoOp, kFusion},
    {"--no-bias-gelu-fusion", kSwitch, nullptr, kNoOp, kFusion},
    {"--no-bias-swiglu-fusion", kSwitch, nullptr, kNoOp, kFusion},
    {"--no-bias-dropout-fusion", kSwitch, nullptr, kNoOp, kFusion},
    {"--no-rope-fusion", kSwitch, nullptr, kNoOp, kFusion},
    {"--no-persist-layer-norm", kSwitch, nullptr, kNoOp, kFusion},
    {"--no-gradient-accumulation-fusion", kSwitch, nullptr, kNoOp,
     "weight gradients always accumulate straight into the fp32 main gradients"},
    {"--cross-entropy-loss-fusion", kSwitch, nullptr, kNoOp,
     "the cross entropy is always fused with the output layer, chunk by chunk (vocabulary-parallel under TP)"},
    {"--cross-entropy-fusion-impl", kChoice, "native|te", kNoOp,
     "the cross entropy is always fused with the output layer, chunk by chunk (vocabulary-parallel under TP)"},
    {"--attention-softmax-in-fp32", kSwitch, nullptr, kNoOp, "the attention softmax is always computed in fp32"},
    {"--accumulate-allreduce-grads-in-fp32", kSwitch, nullptr, kNoOp,
     "gradients always accumulate in fp32 (--grad-reduce-in-bf16 makes the data-parallel reduction bf16)"},
    {"--distributed-backend", kChoice, "nccl|gloo", kNoOp,
     "the communication backend follows the device: NCCL on CUDA, MPI or in-process threads on CPU"},
    // host-side machinery that does not exist here
    {"--manual-gc", kSwitch, nullptr, kNoOp, "there is no garbage collector (C++ frees memory when it is released)"},
    {"--manual-gc-interval", kNonNegative, nullptr, kNoOp,
     "there is no garbage collector (C++ frees memory when it is released)"},
    {"--num-workers", kNonNegative, nullptr, kNoOp,
     "batches are read and staged by the trainer's batch stager, no dataloader worker processes"},
    {"--no-mmap-bin-files", kSwitch, nullptr, kNoOp,
     "the .bin files are always memory-mapped read-only (the samples read are the same)"},
    {"--no-create-attention-mask-in-dataloader", kSwitch, nullptr, kNoOp,
     "no dense attention mask is built: the causal and document masks are applied inside the attention kernels"},
    {"--empty-unused-memory-level", kChoice, "0|1|2", kNoOp,
     "device memory is planned once, statically (there is no caching allocator to empty)"},
    {"--log-throughput", kSwitch, nullptr, kNoOp,
     "the log line always has the throughput (TFLOP/s per GPU, tokens per second; MFU on GPUs)"},
    {"--ckpt-format", kChoice, "torch|torch_dist|torch_dcp|fsdp_dtensor", kNoOp,
     "checkpoints are always megatron.cpp's sharded, checksummed format (docs/checkpoints.md); Megatron-LM's files "
     "are neither read nor written (import-hf / export-hf convert Hugging Face models)"},
    {"--use-nccl-ub", kSwitch, nullptr, kNoOp,
     "NCCL user-buffer registration (a performance option of Megatron-LM's NCCL setup) is not used"},
    {"--auto-detect-ckpt-format", kSwitch, nullptr, kNoOp, "there is one checkpoint format (docs/checkpoints.md)"},
    {"--override-opt_param-scheduler,--override-opt-param-scheduler", kSwitch, nullptr, kNoOp,
     "checkpoints do not store the learning-rate schedule: it always comes from the command line"},
    {"--no-save-rng", kSwitch, nullptr, kNoOp,
     "there is no generator state: random numbers are a pure function of the seed, the element and the iteration "
     "(the checkpoint records the seed; --no-load-rng takes the command line's)"},
    {"--use-cpu-initialization", kSwitch, nullptr, kNoOp,
     "initial weights are a pure function of the seed and the element index, from the same generator (Philox) on "
     "the host and the GPU"},
    {"--init-model-with-meta-device", kSwitch, nullptr, kNoOp,
     "device memory is planned once and the weights are initialised in place (no second copy to avoid)"},
    {"--dataloader-type", kChoice, "single", kNoOp,
     "the samples are Megatron's single pass over the shuffled dataset index (what 'single' selects); 'cyclic' and "
     "'external' are not built"},
    {"--num-dataset-builder-threads", kNonNegative, nullptr, kNoOp,
     "the dataset indices are built by one thread on rank 0 and cached (--data-cache-path)"},
    {"--vocab-extra-ids", kChoice, "0", kNoOp, "no extra sentinel tokens (T5's) are added; only 0 is accepted"},
    {"--rerun-mode", kChoice, "disabled", kNoOp,
     "the rerun state machine (re-running a step to tell a transient fault from a bug) is not built; only "
     "'disabled' is accepted"},
    {"--weight-decay-incr-style", kChoice, "constant", kNoOp,
     kWeightDecayIncr},
    {"--main-grads-dtype", kChoice, "fp32", kNoOp,
     "the main gradients are fp32 (the only choice here; --grad-reduce-in-bf16 makes the reduction bf16)"},
    {"--main-params-dtype", kChoice, "fp32", kNoOp,
     "the main parameters are fp32 (the only choice here; --use-precision-aware-optimizer stores them as the bf16 "
     "weights plus 16-bit remainders, bitwise the fp32 values)"},
    {"--exp-avg-dtype", kChoice, "fp32", kNoOp, kAdamMoments},
    {"--exp-avg-sq-dtype", kChoice, "fp32", kNoOp, kAdamMoments},
    {"--fp8-interval", kNonNegative, nullptr, kNoOp,
     "deprecated in Megatron-LM: the FP8 scaling factors are updated every step"},
    {"--te-rng-tracker", kSwitch, nullptr, kNoOp,
     "Transformer Engine is not used; dropout masks come from the stateless generator (the same under any layout)"},
    {"--no-async-tensor-model-parallel-allreduce", kSwitch, nullptr, kNoOp,
     "deprecated in Megatron-LM: tensor-parallel collectives are issued as the layers need them"},
    {"--ckpt-fully-parallel-save", kSwitch, nullptr, kNoOp, kParallelSave},
    {"--no-ckpt-fully-parallel-save", kSwitch, nullptr, kNoOp, kParallelSave},
    {"--ckpt-fully-parallel-load", kSwitch, nullptr, kNoOp,
     "every rank reads the files of the shards it needs itself, in parallel (docs/checkpoints.md)"},
    {"--ckpt-assume-constant-structure", kSwitch, nullptr, kNoOp,
     "the checkpoint's layout is computed once per run (there is no per-save planning to cache)"},
    {"--dist-ckpt-strictness", kChoice,
     "assume_ok_unexpected|log_unexpected|log_all|raise_unexpected|raise_all|return_unexpected|return_all|ignore_all",
     kNoOp,
     "the loader's rules are fixed (docs/checkpoints.md): every model tensor the layout needs must be present and "
     "match; a missing optimizer state is a warning"},
    {"--use-dist-ckpt", kSwitch, nullptr, kNoOp, "checkpoints are always sharded (docs/checkpoints.md)"},
    {"--apply-query-key-layer-scaling", kSwitch, nullptr, kNoOp,
     "the same attention mathematically; the fp16 overflow guard it adds is not implemented, which matters only for "
     "--fp16 with --attention-backend local (the fused and flash kernels keep the scores in fp32)"},
    {"--moe-router-fusion", kSwitch, nullptr, kNoOp, kFusion},
    {"--moe-use-legacy-grouped-gemm", kSwitch, nullptr, kNoOp,
     "there is one grouped GEMM (--moe-grouped-gemm; docs/moe.md)"},
    {"--tensorboard-queue-size", kNonNegative, nullptr, kNoOp,
     "TensorBoard events are written as they are logged (no queue to size)"},
    {"--disable-tp-comm-bulk-wgrad", kSwitch, nullptr, kNoOp, kTeBulk},
    {"--disable-tp-comm-bulk-dgrad", kSwitch, nullptr, kNoOp, kTeBulk},
    {"--onnx-safe", kText, nullptr, kNoOp, "there is no ONNX export"},
    {"--openai-gelu", kSwitch, nullptr, kNoOp,
     "the GELU is always the tanh approximation, the form --openai-gelu selects in Megatron-LM (ops/gelu.h)"},
    {"--log-world-size-to-tensorboard", kSwitch, nullptr, kNoOp,
     "the world size is always written to TensorBoard (with --tensorboard-dir)"},
    {"--log-batch-size-to-tensorboard", kSwitch, nullptr, kNoOp,
     "the batch size is always written to TensorBoard (with --tensorboard-dir)"},
    {"--inference-max-seq-length", kNonNegative, nullptr, kNoOp,
     "pretraining runs no inference engine (generate and serve size their own caches)"},
    // features that are not built
    {"--use-torch-fsdp2", kSwitch, nullptr, kRefused, kFsdp},
    {"--use-pytorch-profiler", kSwitch, nullptr, kRefused,
     "there is no PyTorch profiler; --profile marks its steps for nsys (--capture-range=cudaProfilerApi)"},
    {"--use-checkpoint-opt_param-scheduler,--use-checkpoint-opt-param-scheduler", kSwitch, nullptr, kRefused,
     "checkpoints do not store the learning-rate schedule: it always comes from the command line"},
    {"--log-params-norm", kSwitch, nullptr, kRefused, "logging the parameter norm is not built"},
    {"--log-num-zeros-in-grad", kSwitch, nullptr, kRefused, "counting zero gradients is not built"},
    {"--record-memory-history", kSwitch, nullptr, kRefused,
     "PyTorch's CUDA memory history is not built: device memory is planned statically, and the log's memory report "
     "lists it before training"},
    {"--memory-snapshot-path", kText, nullptr, kRefused,
     "PyTorch's CUDA memory history is not built: device memory is planned statically, and the log's memory report "
     "lists it before training"},
    {"--wandb-project", kText, nullptr, kRefused, kWandb},
    {"--wandb-exp-name", kText, nullptr, kRefused, kWandb},
    {"--wandb-save-dir", kText, nullptr, kRefused, kWandb},
    {"--wandb-entity", kText, nullptr, kRefused, kWandb},
    {"--log-progress", kSwitch, nullptr, kRefused,
     "the progress.txt job-throughput file is not written; the log line and --metrics-file have the throughput"},
    {"--log-straggler", kSwitch, nullptr, kRefused, kStraggler},
    {"--disable-straggler-on-startup", kSwitch, nullptr, kRefused, kStraggler},
    {"--straggler-ctrlr-port", kNonNegative, nullptr, kRefused, kStraggler},
    {"--log-energy", kSwitch, nullptr, kRefused, "energy logging is not built"},
    {"--enable-ft-package", kSwitch, nullptr, kRefused, kFaultTolerance},
    {"--calc-ft-timeouts", kSwitch, nullptr, kRefused, kFaultTolerance},
    {"--check-for-spiky-loss", kSwitch, nullptr, kRefused,
     "the spiky-loss check (part of the rerun state machine) is not built; NaN / Inf losses and gradients are checked "
     "by default (--check-for-nan-in-loss-and-grad)"},
    {"--use-legacy-models", kSwitch, nullptr, kRefused,
     "there are no legacy models: the model is Megatron-Core's GPT built from layer specs"},
    {"--use-rope-scaling", kSwitch, nullptr, kRefused, kRopeScaling},
    {"--rope-scaling-factor", kNumber, nullptr, kRefused, kRopeScaling},
    {"--rotary-seq-len-interpolation-factor", kNumber, nullptr, kRefused, kRopeScaling},
    {"--moe-enable-deepep", kSwitch, nullptr, kRefused,
     "DeepEP is not built: --moe-token-dispatcher-type alltoall (or allgather) dispatches the tokens (docs/moe.md)"},
    {"--moe-input-jitter-eps", kNumber, nullptr, kRefused, "the router's input jitter is not built"},
    {"--moe-layer-recompute", kSwitch, nullptr, kRefused,
     "recompute of whole MoE layers is not built: --recompute-granularity selective --recompute-modules moe_act "
     "recomputes the experts' activation, --recompute-granularity full everything"},
    {"--moe-router-padding-for-fp8", kSwitch, nullptr, kRefused,
     "padding each expert's tokens to FP8's alignment in the router is not built (the FP8 expert GEMMs pad "
     "themselves, docs/fp8.md)"},
    {"--distribute-saved-activations", kSwitch, nullptr, kRefused,
     "distributing the saved activations of full recompute over the tensor-parallel ranks is not built"},
    {"--defer-embedding-wgrad-compute", kSwitch, nullptr, kRefused,
     "deferring the output layer's weight gradient into the pipeline bubble is not built"},
    {"--ddp-average-in-collective", kSwitch, nullptr, kRefused,
     "averaging inside the collective is not built: the loss is scaled by 1 / (micro-batches x data-parallel size) "
     "before the backward, and the reduction sums"},
    {"--ddp-num-buckets", kNonNegative, nullptr, kRefused, "bucket counts are not built: --ddp-bucket-size sizes them"},
    {"--ddp-pad-buckets-for-high-nccl-busbw", kSwitch, nullptr, kRefused,
     "padding buckets for NCCL's bus bandwidth is not built"},
    {"--check-weight-hash-across-dp-replicas-interval", kNonNegative, nullptr, kRefused,
     "the cross-replica weight hash check is not built"},
    {"--nccl-communicator-config-path", kText, nullptr, kRefused,
     "per-communicator NCCL configuration files are not built (NCCL's environment variables apply)"},
    {"--tp-comm-overlap-cfg", kText, nullptr, kRefused,
     "Transformer Engine userbuffers configuration files are not read: --tp-comm-overlap pipelines the collectives "
     "in one fixed way (docs/parallelism.md)"},
    {"--use-tp-pp-dp-mapping", kSwitch, nullptr, kRefused,
     "the rank order is Megatron-Core's default tp-cp-ep-dp-pp; the tp-pp-dp order is not built"},
    {"--use-ring-exchange-p2p", kSwitch, nullptr, kRefused,
     "the ring-exchange pipeline send/receive is not built (NCCL send/recv pairs are used)"},
    {"--high-priority-stream-groups", kList, nullptr, kRefused,
     "per-group stream priorities are not configurable (the CP ring's stream has the highest priority already)"},
    {"--use-sharp", kSwitch, nullptr, kRefused, kSharp},
    {"--sharp-enabled-group", kText, nullptr, kRefused, kSharp},
    {"--data-args-path", kText, nullptr, kRefused,
     "data paths from a file are not built: give --data-path (or --train-data-path / --valid-data-path)"},
    {"--per-split-data-args-path", kText, nullptr, kRefused,
     "data paths from a file are not built: give --train-data-path / --valid-data-path / --test-data-path"},
    {"--init-method-xavier-uniform", kSwitch, nullptr, kRefused,
     "Xavier initialisation is not built (normal with --init-method-std)"},
    {"--no-load-main-params-from-ckpt", kSwitch, nullptr, kRefused,
     "loading the bf16 weights without the fp32 main parameters is not built"},
    {"--ckpt-step", kNonNegative, nullptr, kRefused,
     "loading an older iteration than the latest is not built (--load reads the directory's latest)"},
    {"--pretrained-checkpoint", kText, nullptr, kRefused,
     "use --load with --finetune to start from a pretrained checkpoint"},
    {"--non-persistent-save-interval", kNonNegative, nullptr, kRefused, kNonPersistent},
    {"--non-persistent-ckpt-type", kChoice, "global|local|in_memory", kRefused, kNonPersistent},
    {"--optimizer-cpu-offload", kSwitch, nullptr, kRefused, kOffload},
    {"--overlap-cpu-optimizer-d2h-h2d", kSwitch, nullptr, kRefused, kOffload},
    {"--use-torch-optimizer-for-cpu-offload", kSwitch, nullptr, kRefused, kOffload},
    {"--no-fp8-wgrad", kSwitch, nullptr, kRefused,
     "a bf16 weight-gradient GEMM beside FP8 forward and data-gradient GEMMs is not built"},
    {"--sgd-momentum", kNumber, nullptr, kRefused, "SGD is not built (--optimizer adam or muon)"},
    {"--fp32-residual-connection", kSwitch, nullptr, kRefused, "an fp32 residual stream is not built"},
    {"--apply-residual-connection-post-layernorm", kSwitch, nullptr, kRefused,
     "the residual from after the norm (BERT's) is not built"},
    {"--squared-relu", kSwitch, nullptr, kRefused, "squared ReLU is not built (--swiglu or the GELU)"},
    {"--bert-no-binary-head", kSwitch, nullptr, kRefused, "BERT is not built (GPT models only)"},
    {"--encoder-num-layers", kNonNegative, nullptr, kRefused, "encoder models are not built (GPT decoders only)"},
    {"--use-rotary-position-embeddings", kSwitch, nullptr, kRefused,
     "the deprecated spelling: use --position-embedding-type rope"},
    {"--enable-cuda-graph", kSwitch, nullptr, kRefused,
     "the deprecated spelling: use --cuda-graph-impl local (docs/cuda_graphs.md)"},
    {"--external-cuda-graph", kSwitch, nullptr, kRefused,
     "the deprecated spelling: use --cuda-graph-impl transformer_engine (docs/cuda_graphs.md)"},
    {"--use-custom-fsdp", kSwitch, nullptr, kRefused, "the old spelling: use --use-megatron-fsdp (docs/fsdp.md)"},
    {"--hybrid-override-pattern", kText, nullptr, kRefused, "hybrid Mamba models are not built"},
    {"--spec", kList, nullptr, kRefused,
     "custom layer-spec modules are not loaded: the GPT layer spec follows the model flags"},
    {"--yaml-cfg", kText, nullptr, kRefused, "YAML configuration files are not read: give the flags"},
    {"--heterogeneous-layers-config-path", kText, nullptr, kRefused, "heterogeneous layer configurations are not built"},
    {"--retro-project-dir", kText, nullptr, kRefused, "Retro is not built"},
    {"--no-initialization", kSwitch, nullptr, kRefused,
     "skipping initialisation is not built (a run without --load initialises the weights)"},
    {"--use-mp-args-from-checkpoint-args", kSwitch, nullptr, kRefused,
     "use --use-checkpoint-args (the checkpoint's architecture; the parallel layout is the command line's)"},
    {"--use-tokenizer-model-from-checkpoint-args", kSwitch, nullptr, kRefused,
     "use --use-checkpoint-args (the checkpoint records the tokenizer it was trained with)"},
    {"--skip-train", kSwitch, nullptr, kRefused,
     "use megatron evaluate for evaluation without training (docs/evaluation.md)"},
    {"--full-validation", kSwitch, nullptr, kRefused,
     "a validation pass over the whole validation set is not built (--eval-iters sets its length)"},
    {"--start-weight-decay", kNumber, nullptr, kRefused, kWeightDecayIncr},
    {"--end-weight-decay", kNumber, nullptr, kRefused, kWeightDecayIncr},
    {"--head-lr-mult", kNumber, nullptr, kRefused,
     "a separate learning rate for the output layer is not built (--decoupled-lr sets the embedding and output "
     "layer's)"},
};

std::vector<std::string> split_choices(const char* choices) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* c = choices; *c; ++c) {
    if (*c == '|') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += *c;
    }
  }
  out.push_back(cur);
  return out;
}

void add_table_options(CLI::App& app) {
  for (const CompatFlag& f : kFlags) {
    const std::string help = std::string(f.handling == kNoOp ? "Megatron-LM flag accepted, no effect: "
                                                              : "Megatron-LM flag refused: ") + f.reason;
    switch (f.value) {
      case kSwitch:
        app.add_flag(f.name)->description(help)->group("Megatron-LM compatibility");
        break;
      case kText:
        app.add_option(f.name, help)->group("Megatron-LM compatibility");
        break;
      case kChoice:
        app.add_option(f.name, help)->check(CLI::IsMember(split_choices(f.choices)))->group("Megatron-LM compatibility");
        break;
      case kNonNegative:
        app.add_option_function<int64_t>(f.name, [](const int64_t&) {}, help)
            ->check(integer_range(0))
            ->group("Megatron-LM compatibility");
        break;
      case kNumber:
        app.add_option_function<double>(f.name, [](const double&) {}, help)->group("Megatron-LM compatibility");
        break;
      case kList:
        app.add_option(f.name, help)->expected(1, -1)->allow_extra_args()->group("Megatron-LM compatibility");
        break;
    }
  }
}

// Sample-based training and the schedule flags Megatron has beside --lr-warmup-iters /
// --lr-decay-iters (get_optimizer_param_scheduler).
void add_schedule_options(CLI::App& app, PretrainArgs& a) {
  app.add_option("--train-samples", a.train_samples,
                 "Sample-based training: samples to train on (--train-iters = this / global batch size); the "
                 "schedule's lengths are then in samples")
      ->check(positive_integer());
  app.add_option("--lr-warmup-samples", a.lr_warmup_samples, "Linear warm-up samples (with --train-samples)")
      ->check(integer_range(0));
  app.add_option("--lr-decay-samples", a.lr_decay_samples,
                 "Decay samples (with --train-samples; default train-samples)")
      ->check(positive_integer());
  app.add_option("--lr-warmup-fraction", a.lr_warmup_fraction,
                 "Warm-up length as a fraction of the decay length (instead of --lr-warmup-iters/-samples)")
      ->check(number_range(0, 1, false, true));
  app.add_option("--lr-warmup-init", a.lr_warmup_init, "Learning rate at the start of the warm-up")
      ->check(number_range(0, kNoMax))
      ->capture_default_str();
  app.add_option("--lr-wsd-decay-style", a.lr_wsd_decay_style,
                 "WSD's anneal: exponential, linear, cosine or minus_sqrt")
      ->check(CLI::IsMember({"exponential", "linear", "cosine", "minus_sqrt"}))
      ->capture_default_str();
  app.add_option("--lr-wsd-decay-iters", a.lr_wsd_decay_iters,
                 "WSD: iterations of the final anneal (the end of the decay iterations)")
      ->check(positive_integer());
  app.add_option("--lr-wsd-decay-samples", a.lr_wsd_decay_samples,
                 "WSD with --train-samples: samples of the final anneal")
      ->check(positive_integer());
}

void add_loss_options(CLI::App& app, PretrainArgs& a) {
  app.add_flag("--calculate-per-token-loss", a.calculate_per_token_loss,
               "Loss = mean over all unmasked tokens of the global batch (default: the mean of the micro-batches' "
               "means; the same unless --eod-mask-loss or padding masks tokens)");
}

void add_profile_options(CLI::App& app, PretrainArgs& a) {
  app.add_flag("--profile", a.profile.enabled,
               "CUDA profiler range (cudaProfilerStart/Stop) around steps [--profile-step-start, --profile-step-end): "
               "run under nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop");
  app.add_option("--profile-step-start", a.profile.step_start, "First profiled step (0-based)")
      ->check(integer_range(0))
      ->capture_default_str();
  app.add_option("--profile-step-end", a.profile.step_end, "The profiler stops once this many steps are done")
      ->check(integer_range(0))
      ->capture_default_str();
  app.add_option("--profile-ranks", a.profile.ranks, "Global ranks to profile (default: every rank)")
      ->check(integer_range(0))
      ->expected(1, -1);
}

// The name CLI11 reports for a flag: its first spelling.
std::string primary_name(const CompatFlag& f) {
  const std::string n = f.name;
  return n.substr(0, n.find(','));
}

bool given(const PretrainArgs& a, const std::string& flag) {
  return std::find(a.flags_given.begin(), a.flags_given.end(), flag) != a.flags_given.end();
}

// Megatron's validate_args: iteration- and sample-based flags do not mix (checked on the flags as
// given: --train-iters is derived from --train-samples later).
void check_schedule_units(const PretrainArgs& a) {
  const bool by_samples = a.train_samples > 0;
  const std::vector<const char*> iteration_flags = {"--train-iters", "--lr-decay-iters", "--lr-warmup-iters",
                                                     "--lr-wsd-decay-iters"};
  const std::vector<const char*> sample_flags = {"--lr-decay-samples", "--lr-warmup-samples", "--lr-wsd-decay-samples"};
  for (const char* f : by_samples ? iteration_flags : sample_flags) {
    MT_REQUIRE(!given(a, f),
               "{} with {}: Megatron-LM's schedules are either iteration-based (--train-iters, --lr-*-iters) or "
               "sample-based (--train-samples, --lr-*-samples), not both",
               f, by_samples ? "--train-samples" : "--train-iters");
  }
  MT_REQUIRE(by_samples || a.train_iters > 0,
             "give --train-iters (iterations) or --train-samples (samples) for the length of training");
  const char* warmup = by_samples ? "--lr-warmup-samples" : "--lr-warmup-iters";
  MT_REQUIRE(!given(a, "--lr-warmup-fraction") || !given(a, warmup),
             "--lr-warmup-fraction {} and {}: give only one warm-up length", a.lr_warmup_fraction, warmup);
}

}  // namespace

std::span<const CompatFlag> megatron_compat_flags() { return kFlags; }

void add_megatron_compat_options(CLI::App& app, PretrainArgs& a) {
  add_schedule_options(app, a);
  add_profile_options(app, a);
  add_loss_options(app, a);
  app.add_flag("--no-position-embedding")
      ->description("Megatron-LM's deprecated switch: no learned position table (only with --position-embedding-type "
                    "rope or none, which have none)");
  add_table_options(app);
}

void check_megatron_compat(const PretrainArgs& a) {
  for (const CompatFlag& f : kFlags)
    MT_REQUIRE(f.handling != kRefused || !given(a, primary_name(f)), "{} is not supported: {}", primary_name(f),
               f.reason);
  // Megatron-LM (validate_args) refuses it with learned positions; with rope there is no table anyway.
  MT_REQUIRE(!given(a, "--no-position-embedding") ||
                 a.model.position_embedding_type != PositionEmbeddingType::kLearnedAbsolute,
             "--no-position-embedding with --position-embedding-type learned_absolute: Megatron-LM refuses it too "
             "(deprecated); use --position-embedding-type rope or none");
  check_schedule_units(a);
  MT_REQUIRE(!a.profile.enabled || a.profile.step_end > a.profile.step_start,
             "--profile-step-end {} must be greater than --profile-step-start {}", a.profile.step_end,
             a.profile.step_start);
}

void log_megatron_compat(const PretrainArgs& a) {
  std::vector<std::string> noop;
  for (const CompatFlag& f : kFlags)
    if (f.handling == kNoOp && given(a, primary_name(f))) noop.push_back(primary_name(f));
  if (given(a, "--no-position-embedding")) noop.push_back("--no-position-embedding");
  if (!noop.empty())
    log_info("> Megatron-LM flags accepted without effect here (docs/flags.md \"Megatron-LM flags\"): {}",
             fmt::join(noop, " "));
}

void resolve_batch_schedule(PretrainArgs& a) {
  MT_REQUIRE(a.rampup_batch_size.empty() || a.step_batch_size_schedule.empty(),
             "Cannot specify both --step-batch-size-schedule and --rampup-batch-size (Megatron-LM refuses it too)");
  const int64_t per_micro = a.micro_batch_size * a.data_parallel_size;
  if (!a.step_batch_size_schedule.empty()) {
    a.batch_schedule = BatchSizeSchedule::steps(a.step_batch_size_schedule, a.model.seq_length);
    // Megatron-LM refuses --global-batch-size beside the schedule, though its GPT-3 175B example
    // gives both; here it is accepted when it is the schedule's final batch.
    MT_REQUIRE(!given(a, "--global-batch-size") || a.global_batch_size == a.batch_schedule.final_batch_size(),
               "--global-batch-size {} with --step-batch-size-schedule, whose final batch size is {}: give the "
               "schedule alone (or a --global-batch-size equal to its final batch)",
               a.global_batch_size, a.batch_schedule.final_batch_size());
    a.global_batch_size = a.batch_schedule.final_batch_size();
  } else if (!a.rampup_batch_size.empty()) {
    a.batch_schedule = BatchSizeSchedule::rampup(a.rampup_batch_size, a.global_batch_size);
  } else {
    a.batch_schedule = BatchSizeSchedule(a.global_batch_size);
    return;
  }
  MT_REQUIRE(a.global_batch_size % per_micro == 0,
             "--global-batch-size {} is not divisible by --micro-batch-size {} times data-parallel size {}",
             a.global_batch_size, a.micro_batch_size, a.data_parallel_size);
  MT_REQUIRE(a.train_samples > 0 || a.train_iters > 0,
             "give --train-iters (iterations) or --train-samples (samples) for the length of training");
  const int64_t iterations = a.train_samples > 0 ? a.batch_schedule.train_iters(a.train_samples) : a.train_iters;
  // Every batch the run reaches is checked now (Megatron-LM asserts each one when it is reached).
  for (const int64_t b : a.batch_schedule.sizes_used(iterations))
    MT_REQUIRE(b % per_micro == 0,
               "{}: the global batch size {} is not divisible by --micro-batch-size {} times data-parallel size {} "
               "(the number of micro-batches changes, the micro-batch size does not)",
               a.batch_schedule.describe(), b, a.micro_batch_size, a.data_parallel_size);
  MT_REQUIRE(!a.cuda_graph.full_iteration(),
             "--cuda-graph-scope full_iteration with {}: the captured iteration has a fixed number of micro-batches; "
             "use the per-layer capture (--cuda-graph-impl local with attn/mlp scopes) or no CUDA graphs",
             a.batch_schedule.describe());
}

void resolve_sample_based_training(PretrainArgs& a) {
  if (a.train_samples <= 0) return;
  MT_REQUIRE(a.global_batch_size > 0, "sample-based training needs the global batch size resolved");
  a.train_iters = a.batch_schedule.train_iters(a.train_samples);  // Megatron's update_train_iters
  MT_REQUIRE(a.train_iters > 0, "--train-samples {} is less than one global batch of {} samples", a.train_samples,
             a.batch_schedule.at(0));
}

ProfileWindow::ProfileWindow(const PretrainArgs& a, int rank, bool cuda)
    : enabled_(a.profile.enabled && (a.profile.ranks.empty() || std::find(a.profile.ranks.begin(),
                                                                          a.profile.ranks.end(), rank) !=
                                                                    a.profile.ranks.end())),
      cuda_(cuda),
      start_(a.profile.step_start),
      end_(a.profile.step_end) {
  if (enabled_ && !cuda_)
    log_warn("--profile on rank {}: the CPU backend has no CUDA profiler; the steps [{}, {}) are not marked", rank,
             start_, end_);
}

ProfileWindow::~ProfileWindow() {
  if (active_) stop();
}

void ProfileWindow::before_step(int64_t iteration) {
  if (!enabled_ || active_ || iteration != start_) return;
#ifdef MT_WITH_CUDA
  if (cuda_) MT_CUDA_CHECK(cudaProfilerStart());
#endif
  active_ = true;
  ++starts_;
  if (cuda_) log_info("> CUDA profiler started before step {} (--profile-step-start)", iteration);
}

void ProfileWindow::after_step(int64_t iteration) {
  if (active_ && iteration == end_) stop();
}

void ProfileWindow::stop() {
#ifdef MT_WITH_CUDA
  if (cuda_) cudaProfilerStop();  // no throw: also called from the destructor
#endif
  active_ = false;
  ++stops_;
  if (cuda_) log_info("> CUDA profiler stopped");
}

}  // namespace mt
