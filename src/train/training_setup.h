// The wiring of a training run, built once before the loop (torchtitan's Trainer.__init__;
// Megatron's initialize_megatron + setup_model_and_optimizer + build_train_valid_test_data_iterators):
//
//   ModelSetup     process groups (RankGenerator order), this rank's pipeline chunks, the training
//                  and validation schedules (plan_pipeline), the GPTModel planned for them, its
//                  PipelineExecutor, the data-parallel GradSync (the model's gradient hooks) and the
//                  AdamW optimizer; optionally the memory estimate, checked before anything large is
//                  allocated. What the layout tests and benchmarks build for their own batches.
//   TrainingSetup  a ModelSetup from `megatron pretrain`'s arguments, plus the tokenizer, the
//                  datasets, the resumed checkpoint (or the initialised parameters) and the
//                  BatchStager; from the launcher's environment (launch()) or in-process with a
//                  given world communicator, e.g. thread ranks (comm/thread_comm.h).
//
// The loop that runs on it is train/trainer.h.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "comm/communicator.h"
#include "data/data_args.h"
#include "model/gpt_model.h"
#include "optim/grad_sync.h"
#include "optim/optimizer.h"
#include "parallel/parallel_config.h"
#include "parallel/pipeline/layer_split.h"
#include "train/arguments.h"
#include "train/batch_stager.h"
#include "train/checkpoint.h"
#include "train/memory_estimate.h"
#include "train/pipeline.h"

namespace mt {

/// What a ModelSetup is built from.
struct ModelSetupOptions {
  TransformerConfig model;
  /// tp, cp, pp, ep, etp, vpp, order (the derived sizes are filled by validate_and_derive).
  ParallelConfig parallel;
  /// --decoder-first/last-pipeline-num-layers and --account-for-* (num_layers, pp and vpp are
  /// taken from `model` and `parallel`).
  pipeline::PipelineLayout pipeline;
  int64_t num_microbatches = 1;  ///< per data-parallel rank and iteration (the most, with a batch-size ramp-up)
  /// Smaller micro-batch counts that training iterations also run (a batch-size ramp-up,
  /// train/batch_schedule.h): each gets a training schedule of its own; buffers are sized for all.
  std::vector<int64_t> ramp_microbatches;
  int microbatch_group_size = 0;  ///< --microbatch-group-size-per-virtual-pipeline-stage (0 = pp)
  bool overlap_p2p_comm = false;  ///< --overlap-p2p-communication (ScheduleConfig::overlap_p2p_comm)
  int64_t micro_batch_size = 1;
  bool sequence_parallel = false;
  DType dtype = DType::kF32;
  Device device = Device::cpu();
  /// Gradient buckets (bucket_size); data_parallel_size and expert_data_parallel_size are set
  /// from the groups (the data × context parallel group and the expert-data-parallel size).
  ParamLayout param_layout;
  DdpConfig ddp;
  OptimizerConfig optim;
  /// Rows of the LM head's logits per chunk, in bytes (0: model_layout's choice).
  size_t head_chunk_bytes = 0;
  /// Estimate the memory (train/memory_estimate.h) with a staged batch of `batch_bytes`, log it and
  /// check it fits in the free device memory (the host's for CPU training) before allocating.
  bool check_memory = false;
  size_t batch_bytes = 0;
};

/// What ModelSetup derives for one pipeline rank before it builds anything: its model chunks (one
/// per virtual stage), the training and validation (forward-only) schedules, and the model layout
/// (chunks and buffer counts) that runs both.
struct RankSchedule {
  std::vector<pipeline::LayerRange> chunks;
  PipelinePlan train, eval;
  std::vector<PipelinePlan> ramp;  ///< training schedules of ModelSetupOptions::ramp_microbatches
  ModelLayout model_layout;
};

/// Errors (mt::Error naming the values) of the pipeline split (validate_pipeline_layout) and the
/// schedule (validate_schedule_config: micro-batches vs pp / vpp / group size) of `o` under the
/// validated, derived `parallel`. No communication.
void validate_rank_schedule(const ModelSetupOptions& o, const ParallelConfig& parallel);
/// The RankSchedule of pipeline rank `pp_rank` (errors: validate_rank_schedule's).
RankSchedule plan_rank_schedule(const ModelSetupOptions& o, const ParallelConfig& parallel, int pp_rank);
/// The memory estimate (train/memory_estimate.h) of the rank whose process groups are `groups`
/// (their sizes and ranks are read, nothing is communicated) running `schedule`: the model is
/// measured (GPTModel::memory_plan), not allocated. ModelSetup logs and checks it; `megatron plan`
/// (plan/plan.h) computes it for every kind of rank without running any. Bytes per part;
/// *model_plan (when given): the measured model (parameter counts, buffer sizes).
MemoryEstimate estimate_rank_memory(const ModelSetupOptions& o, const ProcessGroups& groups,
                                    const RankSchedule& schedule, ModelMemoryPlan* model_plan = nullptr);

/// One rank's model, schedules, gradient synchronisation and optimizer (see the file comment).
/// Parameters are left uninitialised: params().initialize(seed) or load a checkpoint.
class ModelSetup {
 public:
  /// Collective over `world` (build_process_groups). Errors (mt::Error, before any communication,
  /// identical on every rank): the parallel sizes (validate_and_derive), the pipeline split
  /// (validate_pipeline_layout, layers_of), the schedule (validate_schedule_config: micro-batches
  /// vs pp / vpp / group size), the context-parallel checks, the model's configuration; then
  /// the memory check (check_memory) and out-of-memory.
  ModelSetup(std::shared_ptr<Communicator> world, ModelSetupOptions options, const Stream& stream);
  ~ModelSetup();
  ModelSetup(const ModelSetup&) = delete;
  ModelSetup& operator=(const ModelSetup&) = delete;

  const ParallelConfig& parallel() const { return parallel_; }
  const ProcessGroups& groups() const { return groups_; }
  /// This rank's model chunks (layer ranges), one per virtual stage.
  const std::vector<pipeline::LayerRange>& chunks() const { return chunks_; }
  const PipelinePlan& train_plan() const { return train_plan_; }
  /// The training schedule for `num_microbatches` (train_plan()'s count or one of
  /// ModelSetupOptions::ramp_microbatches). Errors: mt::Error for another count.
  const PipelinePlan& train_plan(int64_t num_microbatches) const;
  /// The forward-only schedule of the validation.
  const PipelinePlan& eval_plan() const { return eval_plan_; }
  GPTModel& model() { return *model_; }
  PipelineExecutor& executor() { return *executor_; }
  GradSync& grad_sync() { return *grad_sync_; }
  AdamWOptimizer& optimizer() { return *optimizer_; }
  /// The memory estimate (check_memory only; else empty) and the device memory in use before the
  /// model was allocated (CUDA context, libraries, other processes).
  const MemoryEstimate& memory_estimate() const { return memory_estimate_; }
  size_t memory_in_use_before() const { return in_use_before_; }
  const ModelSetupOptions& options() const { return options_; }

 private:
  void estimate_memory(const RankSchedule& schedule);

  ModelSetupOptions options_;
  ParallelConfig parallel_;
  ProcessGroups groups_;
  std::vector<pipeline::LayerRange> chunks_;
  PipelinePlan train_plan_, eval_plan_;
  std::vector<PipelinePlan> ramp_plans_;
  MemoryEstimate memory_estimate_;
  size_t in_use_before_ = 0;
  std::unique_ptr<GPTModel> model_;
  std::unique_ptr<PipelineExecutor> executor_;
  std::unique_ptr<GradSync> grad_sync_;
  std::unique_ptr<AdamWOptimizer> optimizer_;
};

/// Resolves --device (auto = cuda:0 when available, else cpu). Errors: a CUDA device asked for
/// where there is none.
Device resolve_device(const std::string& flag);

/// The parallel sizes and the pipeline split of `megatron pretrain`'s arguments over `world_size`
/// ranks (--tensor-model-parallel-size ... --num-layers-per-virtual-pipeline-stage,
/// --decoder-first/last-pipeline-num-layers, --account-for-*), validated and derived
/// (validate_and_derive, validate_pipeline_layout; errors name the flags and values).
struct TrainingLayout {
  ParallelConfig parallel;
  pipeline::PipelineLayout pipeline;
};
TrainingLayout resolve_training_layout(const PretrainArgs& args, int world_size);

/// The ModelSetupOptions `megatron pretrain` builds each rank from (memory check on): `args`
/// resolved (vocabulary size known, validate_pretrain_args passed), on `device`.
ModelSetupOptions pretrain_model_options(const PretrainArgs& args, const TrainingLayout& layout, Device device);

/// Everything `megatron pretrain` sets up before its loop (see the file comment).
class TrainingSetup {
 public:
  /// From the launcher's environment (comm/bootstrap.h): the device (GPU = LOCAL_RANK), the
  /// world communicator; ranks other than 0 log warnings only.
  static std::unique_ptr<TrainingSetup> launch(PretrainArgs args);
  /// In-process: `world` (any Communicator, e.g. a thread rank's) and this rank's device. Collective
  /// over `world`. Errors (mt::Error, naming the flag and value): invalid arguments
  /// (validate_pretrain_args), layouts, data, an unreadable or mismatched checkpoint, an
  /// unwritable --save, memory that does not fit; the same on every rank where the arguments are.
  TrainingSetup(PretrainArgs args, std::shared_ptr<Communicator> world, Device device);
  ~TrainingSetup();
  TrainingSetup(const TrainingSetup&) = delete;
  TrainingSetup& operator=(const TrainingSetup&) = delete;

  /// The arguments after resolution: vocabulary size (tokenizer, checkpoint), derived sizes,
  /// --use-checkpoint-args.
  const PretrainArgs& args() const { return args_; }
  Communicator& world() const { return *world_; }
  const std::shared_ptr<Communicator>& world_ptr() const { return world_; }
  Device device() const { return device_; }
  const Stream& stream() const { return *stream_; }
  ModelSetup& model_setup() { return *model_setup_; }
  GPTModel& model() { return model_setup_->model(); }
  AdamWOptimizer& optimizer() { return model_setup_->optimizer(); }
  const ProcessGroups& groups() const { return model_setup_->groups(); }
  const data::DataSplits& data() const { return data_; }
  BatchStager& stager() { return *stager_; }
  int64_t num_microbatches() const { return args_.num_microbatches(); }
  /// Where training starts: the checkpoint's iteration and consumed samples (0 for a fresh run
  /// or --finetune).
  int64_t start_iteration() const { return start_iteration_; }
  int64_t start_consumed_samples() const { return start_consumed_; }
  /// A checkpoint was loaded and training continues from it (not --finetune).
  bool resumed() const { return resume_.has_value() && !args_.finetune; }
  /// Logs the memory estimate against what was allocated and, on CUDA, the device memory (per
  /// rank over the world when it has several ranks: collective).
  void log_memory_report();

 private:
  void resolve_arguments();
  void prepare_save_directory() const;
  void build_datasets();
  ModelSetupOptions model_options() const;
  void log_summary();
  void load_or_initialize();

  PretrainArgs args_;
  std::shared_ptr<Communicator> world_;
  Device device_;
  SaveDirectoryLock save_lock_;  // held for the setup's (the job's) life
  std::unique_ptr<Stream> stream_;
  std::optional<CheckpointState> resume_;
  std::unique_ptr<data::Tokenizer> tokenizer_;
  data::DataSplits data_;
  ParallelConfig parallel_;            // validated, derived
  pipeline::PipelineLayout pipeline_;  // --decoder-*-pipeline-num-layers, --account-for-*, vpp resolved
  std::unique_ptr<ModelSetup> model_setup_;
  std::unique_ptr<BatchStager> stager_;
  int64_t start_iteration_ = 0, start_consumed_ = 0;
};

}  // namespace mt
