// Command-line arguments of `megatron pretrain` and `megatron generate`, named as Megatron-LM
// names them (megatron/training/arguments.py), with Megatron's defaults. Validated once, in
// one place (validate_pretrain_args), with messages that print every offending value.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/data_args.h"
#include "model/transformer_config.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"
#include "train/batch_schedule.h"

namespace CLI {
class App;
}

namespace mt {

/// CUDA graph options (Megatron's --cuda-graph-impl / --cuda-graph-scope /
/// --cuda-graph-warmup-steps; docs/cuda_graphs.md).
struct CudaGraphOptions {
  /// --cuda-graph-impl none|local|full_iteration ("full_iteration" is local with scope
  /// full_iteration).
  std::string impl = "none";
  /// --cuda-graph-scope: full_iteration, or per-layer scopes attn|mlp|moe|moe_router|moe_preprocess
  /// (moe_preprocess only together with moe_router, as in Megatron-Core).
  std::vector<std::string> scope;
  int warmup_steps = 3;            ///< --cuda-graph-warmup-steps: eager steps before the capture
  bool include_optimizer = false;  ///< --cuda-graph-include-optimizer (ours): the optimizer step in the graph too
  bool enabled() const { return impl != "none"; }
  /// The whole forward and backward of all micro-batches (and stages) is one graph.
  bool full_iteration() const;
  /// Per-layer capture (model/layer_graphs.h): local without full_iteration.
  bool per_layer() const { return enabled() && !full_iteration(); }
  /// Per-layer capture of `scope` (attn, mlp, moe): named in --cuda-graph-scope, or no scope given
  /// (Megatron's default for local: the whole layer).
  bool captures(const std::string& s) const;
};

struct PretrainArgs {
  TransformerConfig model;
  bool group_query_attention = false;  ///< --group-query-attention (enables --num-query-groups)
  // mixture of experts (docs/moe.md); the model's fields are in `model`
  std::string moe_layer_freq = "1";    ///< --moe-layer-freq (resolved into model.moe_layer_pattern)
  int expert_model_parallel_size = 1;  ///< --expert-model-parallel-size (1 only so far)
  int expert_tensor_parallel_size = 0; ///< --expert-tensor-parallel-size (0 = TP; only TP so far)
  int expert_data_parallel_size = 1;   ///< derived: world / (etp · ep · pp)
  // batch / schedule
  int64_t micro_batch_size = 1;    ///< --micro-batch-size
  int64_t global_batch_size = 0;   ///< --global-batch-size (0 = micro-batch-size * data-parallel size)
  /// --rampup-batch-size <start> <increment> <ramp samples>; --step-batch-size-schedule's words
  /// (train/batch_schedule.h). Resolved by validate_pretrain_args into batch_schedule; with either,
  /// global_batch_size is the final (largest) batch.
  std::vector<int64_t> rampup_batch_size;
  std::vector<std::string> step_batch_size_schedule;
  BatchSizeSchedule batch_schedule;  ///< derived: the global batch size per consumed samples
  int64_t train_iters = 0;         ///< --train-iters
  double lr = -1;                  ///< --lr (required)
  double min_lr = 0;               ///< --min-lr
  /// --decoupled-lr / --decoupled-min-lr: the embedding and output layer's max / min learning rate
  /// (OptimizerConfig::decoupled_lr); -1 = unset (decoupled-min-lr unset: --min-lr).
  double decoupled_lr = -1, decoupled_min_lr = -1;
  int64_t lr_warmup_iters = 0;     ///< --lr-warmup-iters
  std::string lr_decay_style = "linear";  ///< --lr-decay-style
  int64_t lr_decay_iters = 0;      ///< --lr-decay-iters (0 = train-iters)
  // sample-based training and the rest of Megatron's schedule flags (train/megatron_compat.h)
  int64_t train_samples = 0;       ///< --train-samples (0 = iteration-based); train-iters = samples / global batch
  int64_t lr_warmup_samples = 0;   ///< --lr-warmup-samples
  int64_t lr_decay_samples = 0;    ///< --lr-decay-samples (0 = train-samples)
  double lr_warmup_fraction = -1;  ///< --lr-warmup-fraction of the decay steps (-1 = unset)
  double lr_warmup_init = 0;       ///< --lr-warmup-init: learning rate at the start of the warm-up
  std::string lr_wsd_decay_style = "exponential";  ///< --lr-wsd-decay-style (WSD's anneal)
  int64_t lr_wsd_decay_iters = 0;    ///< --lr-wsd-decay-iters (WSD, iteration-based)
  int64_t lr_wsd_decay_samples = 0;  ///< --lr-wsd-decay-samples (WSD, sample-based)
  /// --calculate-per-token-loss: the loss is the mean over the global batch's unmasked tokens,
  /// not the mean of the micro-batches' means (BatchStager::Options::per_token_loss)
  bool calculate_per_token_loss = false;
  OptimizerConfig optim;           ///< --weight-decay --clip-grad --adam-beta1 --adam-beta2 --adam-eps, scaler
  uint64_t seed = 1234;            ///< --seed
  // precision
  bool bf16 = false;               ///< --bf16
  bool fp16 = false;               ///< --fp16
  float loss_scale = 0;            ///< --loss-scale (static; 0 = dynamic for fp16)
  float initial_loss_scale = 4294967296.f;  ///< --initial-loss-scale (2^32)
  float min_loss_scale = 1.f;      ///< --min-loss-scale
  int loss_scale_window = 1000;    ///< --loss-scale-window
  int hysteresis = 2;              ///< --hysteresis
  // logging / eval
  int64_t log_interval = 100;      ///< --log-interval
  int64_t eval_interval = 1000;    ///< --eval-interval
  int64_t eval_iters = 100;        ///< --eval-iters
  int timing_log_level = 0;        ///< --timing-log-level (0 off, 1: core/timers.h)
  std::string timing_log_option = "minmax";  ///< --timing-log-option: max, minmax, all
  // data: --data-path (blends), --split, --mock-data, tokenizers, document masks (docs/data.md)
  data::DataArgs data;
  // checkpointing
  std::string save, load;          ///< --save --load
  bool finetune = false;           ///< --finetune: load weights only, start at iteration 0
  bool no_load_optim = false;      ///< --no-load-optim: load weights and the iteration, not the optimizer
  bool use_checkpoint_args = false;  ///< --use-checkpoint-args: model architecture from the checkpoint
  int64_t save_interval = 0;       ///< --save-interval (0 = only at the end when --save is given)
  int64_t exit_interval = 0;       ///< --exit-interval: stop (after saving) when iteration % N == 0
  double exit_duration_in_mins = 0;  ///< --exit-duration-in-mins: save and stop after this wall time (0 = off)
  bool exit_signal_handler = false;  ///< --exit-signal-handler: SIGTERM/SIGINT finish the step, save, exit 0
  bool async_save = false;         ///< --async-save: checkpoints written by a background thread
  bool no_save_optim = false;      ///< --no-save-optim: checkpoints without optimizer state
  bool no_load_rng = false;        ///< --no-load-rng: the checkpoint's seed is not imposed (a new --seed is allowed)
  bool fallback_to_previous_checkpoint = false;  ///< --fallback-to-previous-checkpoint (LoadOptions)
  bool exit_on_missing_checkpoint = false;  ///< --exit-on-missing-checkpoint: --load == --save with no checkpoint is an error
  bool check_for_nan_in_loss_and_grad = true;    ///< --check-for-nan-in-loss-and-grad (default on)
  // observability
  std::string tensorboard_dir;               ///< --tensorboard-dir (rank 0 writes event files)
  int64_t tensorboard_log_interval = 1;      ///< --tensorboard-log-interval
  bool log_timers_to_tensorboard = false;    ///< --log-timers-to-tensorboard
  bool log_memory_to_tensorboard = false;    ///< --log-memory-to-tensorboard
  bool log_validation_ppl_to_tensorboard = false;  ///< --log-validation-ppl-to-tensorboard
  bool log_loss_scale_to_tensorboard = true;       ///< --no-log-loss-scale-to-tensorboard turns it off
  std::string metrics_file;                  ///< --metrics-file: JSON lines, one per log interval / evaluation
  // distributed
  int tensor_model_parallel_size = 1;      ///< --tensor-model-parallel-size
  bool sequence_parallel = false;          ///< --sequence-parallel
  int context_parallel_size = 1;           ///< --context-parallel-size (--cp-comm-type etc. in model)
  int pipeline_model_parallel_size = 1;    ///< --pipeline-model-parallel-size
  int64_t num_layers_per_virtual_pipeline_stage = 0;  ///< --num-layers-per-virtual-pipeline-stage (0 = unset)
  int num_virtual_stages_per_pipeline_rank = 0;       ///< --num-virtual-stages-per-pipeline-rank (0 = unset)
  int64_t decoder_first_pipeline_num_layers = -1;     ///< --decoder-first-pipeline-num-layers (-1 = even split)
  int64_t decoder_last_pipeline_num_layers = -1;      ///< --decoder-last-pipeline-num-layers (-1 = even split)
  bool account_for_embedding_in_pipeline_split = false;  ///< --account-for-embedding-in-pipeline-split
  bool account_for_loss_in_pipeline_split = false;       ///< --account-for-loss-in-pipeline-split
  int microbatch_group_size_per_vp_stage = 0;  ///< --microbatch-group-size-per-virtual-pipeline-stage (0 = pp)
  /// --overlap-p2p-communication (--no-overlap-p2p-communication: off, the default): pipeline
  /// transfers on a communication stream, waited for only where their data is used
  /// (ScheduleConfig::overlap_p2p_comm). No effect without pipeline parallelism.
  bool overlap_p2p_comm = false;
  bool use_distributed_optimizer = false;  ///< --use-distributed-optimizer
  /// --use-precision-aware-optimizer: with --bf16, fp32 main parameters stored as int16
  /// remainders beside the bf16 parameters (OptimizerConfig::store_param_remainders).
  bool use_precision_aware_optimizer = false;
  bool overlap_grad_reduce = false;        ///< --overlap-grad-reduce (bucketed, overlapped with backward)
  bool overlap_param_gather = false;       ///< --overlap-param-gather (needs the two flags above)
  bool ddp_copy_engine = false;            ///< --ddp-copy-engine (DdpConfig::copy_engine)
  bool grad_reduce_in_bf16 = false;        ///< --grad-reduce-in-bf16 (DdpConfig::grad_reduce_in_bf16)
  /// --use-megatron-fsdp: Megatron-FSDP's sharding strategies (docs/fsdp.md). Built:
  /// --data-parallel-sharding-strategy no_shard (plain DDP), optim (== --use-distributed-
  /// optimizer) and optim_grads (the distributed optimizer with sharded gradients,
  /// DdpConfig::shard_grads) and optim_grads_params (also the parameters, DdpConfig::shard_params).
  bool use_megatron_fsdp = false;
  /// --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads or optim_grads_params.
  bool shard_grads() const {
    return use_megatron_fsdp &&
           (data_parallel_sharding_strategy == "optim_grads" || data_parallel_sharding_strategy == "optim_grads_params");
  }
  /// --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params.
  bool shard_params() const { return use_megatron_fsdp && data_parallel_sharding_strategy == "optim_grads_params"; }
  std::string data_parallel_sharding_strategy = "no_shard";  ///< --data-parallel-sharding-strategy
  std::string outer_dp_sharding_strategy = "no_shard";       ///< --outer-dp-sharding-strategy
  int num_distributed_optimizer_instances = 1;               ///< --num-distributed-optimizer-instances
  bool fsdp_double_buffer = false;                           ///< --fsdp-double-buffer
  std::string megatron_fsdp_grad_comm_dtype;                 ///< --megatron-fsdp-grad-comm-dtype ("" = fp32)
  /// --ddp-bucket-size in elements; unset = Megatron's max(40M, 1M · DP). Only used with
  /// --overlap-grad-reduce or optim_grads (otherwise there is one bucket, as in Megatron).
  std::optional<int64_t> ddp_bucket_size;
  double distributed_timeout_minutes = 10;  ///< --distributed-timeout-minutes
  int nproc_per_node = 1;                  ///< --nproc-per-node (ours; the local launcher)
  int data_parallel_size = 1;              ///< derived: world / (tensor · pipeline parallel size)
  CudaGraphOptions cuda_graph;
  /// --profile, --profile-step-start, --profile-step-end, --profile-ranks (train/megatron_compat.h)
  struct Profile {
    bool enabled = false;
    int64_t step_start = 10, step_end = 12;
    std::vector<int> ranks;  ///< empty: every rank
  } profile;
  // ours
  std::string device = "auto";     ///< --device cpu|cuda|cuda:N|auto (auto = cuda when available)
  bool progress = true;            ///< --no-progress disables the terminal progress line
  /// The options given on the command line (filled when parsing ends), for the flags that apply
  /// only to a feature (validate_pretrain_args: docs/flags.md "Flags of a feature not enabled").
  std::vector<std::string> flags_given;

  DType dtype() const { return bf16 ? DType::kBF16 : (fp16 ? DType::kF16 : DType::kF32); }
  /// Micro-batches per data-parallel rank per iteration (of the final global batch: the most).
  int64_t num_microbatches() const { return global_batch_size / (micro_batch_size * data_parallel_size); }
  /// The micro-batch counts per data-parallel rank the run's iterations use, increasing (one value
  /// without a batch-size schedule; the last is num_microbatches()).
  std::vector<int64_t> microbatch_counts() const;
  /// The learning-rate schedule in Megatron's units: samples with --train-samples, iterations
  /// otherwise (the same rates for a constant global batch size).
  LrScheduleConfig lr_schedule() const;
  /// With --decoupled-lr: the embedding and output layer's schedule, lr_schedule() with max_lr =
  /// --decoupled-lr and min_lr = --decoupled-min-lr (--min-lr when unset); the warm-up start
  /// (--lr-warmup-init) and the shape are shared (Megatron's param-group max_lr / min_lr in
  /// OptimizerParamScheduler.get_lr).
  LrScheduleConfig decoupled_lr_schedule() const;
  /// Whether the learning-rate schedule counts samples: with --train-samples, and with a batch-size
  /// schedule (Megatron's scheduler always counts samples: iteration lengths x --global-batch-size,
  /// advanced by each iteration's batch; the same as counting iterations at a constant batch).
  bool lr_counts_samples() const { return train_samples > 0 || !batch_schedule.is_constant(); }
  /// The schedule's step count before the step that starts from `iteration` completed iterations
  /// and `consumed` samples: `consumed` when lr_counts_samples(), else `iteration`.
  int64_t lr_step(int64_t iteration, int64_t consumed) const { return lr_counts_samples() ? consumed : iteration; }
  /// GradSync options from --overlap-grad-reduce, --overlap-param-gather,
  /// --use-distributed-optimizer.
  DdpConfig ddp_config() const;
  /// Bucket layout of the ParamStore (model/params.h) for data_parallel_size and
  /// --ddp-bucket-size after Megatron's defaulting (DistributedDataParallel.__init__): the
  /// bucket size is --ddp-bucket-size or max(40M, 1M · DP) with --overlap-grad-reduce, and one
  /// bucket (0) without it.
  ParamLayout param_layout() const;
};

/// Registers the pretrain flags on `app`, writing into `args`.
void add_pretrain_options(CLI::App& app, PretrainArgs& args);
/// Fills defaults that depend on other flags and validates everything; throws mt::Error with a
/// message naming the flag and value. Needs the vocabulary size already set in args.model.
void validate_pretrain_args(PretrainArgs& args);

struct GenerateArgs {
  std::string load;                 ///< --load (checkpoint directory, required)
  std::string vocab_file, merge_file;  ///< --vocab-file --merge-file (GPT-2 BPE)
  std::string tokenizer_type = "HuggingFaceTokenizer";  ///< --tokenizer-type (with --tokenizer-model)
  std::string tokenizer_model;      ///< --tokenizer-model
  data::TikTokenOptions tiktoken;   ///< --tiktoken-pattern, ... (TikTokenizer; add_tiktoken_options)
  std::vector<std::string> prompts;  ///< --prompt (repeatable: one batch row each)
  std::string prompt_file;          ///< --prompt-file: one prompt per line
  int64_t out_seq_length = 64;      ///< --out-seq-length / --max-new-tokens: tokens to generate
  int64_t micro_batch_size = 0;     ///< --micro-batch-size: prompts per batch (0 = all)
  int64_t seq_length = 0;           ///< --seq-length: context (prompt + new tokens); 0 = the checkpoint's
  bool no_kv_cache = false;         ///< --no-kv-cache: recompute the prefix for every token (reference)
  int tensor_model_parallel_size = 1;    ///< --tensor-model-parallel-size
  int pipeline_model_parallel_size = 1;  ///< --pipeline-model-parallel-size
  int nproc_per_node = 1;           ///< --nproc-per-node (local launcher)
  bool bf16 = false, fp16 = false;  ///< --bf16 / --fp16 (CUDA)
  float temperature = 1.0f;         ///< --temperature
  int64_t top_k = 0;                ///< --top-k (0 = off)
  float top_p = 0.f;                ///< --top-p (0 = off)
  bool greedy = false;              ///< --greedy
  uint64_t seed = 1234;             ///< --seed
  std::string device = "auto";
  int64_t num_samples = 1;          ///< --num-samples
};

void add_generate_options(CLI::App& app, GenerateArgs& args);

}  // namespace mt
