#include "train/training_setup.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "comm/bootstrap.h"
#include "core/host_memory.h"
#include "core/logging.h"
#include "data/masks.h"
#include "model/fp8/fp8_model.h"
#include "parallel/pipeline/schedules.h"
#include "parallel/process_groups.h"
#include "train/megatron_compat.h"

namespace mt {

Device resolve_device(const std::string& flag) {
  if (flag == "auto") return cuda_available() ? Device::cuda(0) : Device::cpu();
  Device d = parse_device(flag);
  MT_REQUIRE(d.is_cpu() || cuda_available(), "--device {} requested but no CUDA device is available{}", flag,
#ifdef MT_WITH_CUDA
             ""
#else
             " (this binary was built without CUDA)"
#endif
  );
  return d;
}

namespace {

pipeline::ScheduleConfig schedule_config(const ParallelConfig& pc, int64_t num_microbatches, int group_size) {
  pipeline::ScheduleConfig sc;
  sc.pp = pc.pp;
  sc.vpp = pc.vpp;
  sc.num_microbatches = static_cast<int>(num_microbatches);
  sc.microbatch_group_size = group_size;
  return sc;
}

pipeline::ScheduleConfig schedule_config(const ModelSetupOptions& o, const ParallelConfig& pc) {
  pipeline::ScheduleConfig sc = schedule_config(pc, o.num_microbatches, o.microbatch_group_size);
  sc.overlap_p2p_comm = o.overlap_p2p_comm;
  return sc;
}

pipeline::PipelineLayout pipeline_layout_of(const ModelSetupOptions& o, const ParallelConfig& pc) {
  pipeline::PipelineLayout layout = o.pipeline;
  layout.num_layers = o.model.num_layers;
  layout.pp = pc.pp;
  layout.vpp = pc.vpp;
  return layout;
}

}  // namespace

static std::vector<const PipelinePlan*> all_plans(const RankSchedule& s) {
  std::vector<const PipelinePlan*> plans{&s.train, &s.eval};
  for (const PipelinePlan& p : s.ramp) plans.push_back(&p);
  return plans;
}

void validate_rank_schedule(const ModelSetupOptions& o, const ParallelConfig& pc) {
  pipeline::validate_pipeline_layout(pipeline_layout_of(o, pc));
  pipeline::validate_schedule_config(schedule_config(o, pc));
  for (const int64_t m : o.ramp_microbatches) {
    pipeline::ScheduleConfig sc = schedule_config(o, pc);
    sc.num_microbatches = static_cast<int>(m);
    try {
      pipeline::validate_schedule_config(sc);
    } catch (const Error& e) {
      MT_FAIL("the batch-size schedule's iterations of {} micro-batches per data-parallel rank: {}", m, e.what());
    }
  }
}

RankSchedule plan_rank_schedule(const ModelSetupOptions& o, const ParallelConfig& pc, int pp_rank) {
  validate_rank_schedule(o, pc);
  pipeline::ScheduleConfig sc = schedule_config(o, pc);
  RankSchedule s;
  s.chunks = pipeline::layers_of(pp_rank, pipeline_layout_of(o, pc));
  s.train = plan_pipeline(sc, pp_rank, s.chunks);
  sc.forward_only = true;
  s.eval = plan_pipeline(sc, pp_rank, s.chunks);
  sc.forward_only = false;
  for (const int64_t m : o.ramp_microbatches) {
    sc.num_microbatches = static_cast<int>(m);
    s.ramp.push_back(plan_pipeline(sc, pp_rank, s.chunks));
  }
  s.model_layout = model_layout(s.chunks, all_plans(s));
  if (o.head_chunk_bytes > 0) s.model_layout.head.chunk_bytes = o.head_chunk_bytes;
  return s;
}

MemoryEstimate estimate_rank_memory(const ModelSetupOptions& o, const ProcessGroups& groups, const RankSchedule& s,
                                    ModelMemoryPlan* model_plan) {
  // Parameter gradients are reduced (and the distributed optimizer sharded) over dp-cp (Megatron),
  // the shards over one instance of it with hybrid sharding.
  const int k = o.ddp.num_distributed_optimizer_instances;
  const int shard_dp = instance_group_size(groups.dp_cp->size(), k, "dp-cp");
  const int shard_edp = instance_group_size(groups.edp->size(), k, "edp");
  ParamLayout param_layout = o.param_layout;
  param_layout.data_parallel_size = shard_dp;
  param_layout.expert_data_parallel_size = shard_edp;
  MemoryEstimateInputs in;
  in.model = GPTModel::memory_plan(o.model, o.micro_batch_size, o.dtype, o.device, groups, o.sequence_parallel,
                                   param_layout, s.model_layout);
  in.dtype = o.dtype;
  in.distributed_optimizer = o.ddp.use_distributed_optimizer;
  if (o.ddp.shard_grads) in.grad_slots = o.ddp.grad_slots > 0 ? o.ddp.grad_slots : in.model.params.grad_slots;
  if (o.ddp.shard_params) in.param_slots = o.ddp.param_slots > 0 ? o.ddp.param_slots : in.model.params.param_slots;
  in.store_param_remainders = o.optim.store_param_remainders;
  in.data_parallel = shard_dp;
  in.expert_data_parallel = shard_edp;
  in.grad_reduce_in_bf16 = o.ddp.grad_reduce_in_bf16 && (groups.dp_cp->size() > 1 || groups.edp->size() > 1);
  int grad_buffers = 0;
  for (const PipelinePlan* p : all_plans(s)) grad_buffers = std::max(grad_buffers, p->grad_buffers);
  in.pipeline_grad_bytes = static_cast<size_t>(grad_buffers) * in.model.boundary_bytes;
  in.batch_bytes = o.batch_bytes;
  in.dropless_moe = o.model.num_moe_experts > 0 && !o.model.moe_expert_capacity_set &&
                    o.model.moe_received_token_capacity == 0;
  if (o.model.fp8 != Fp8Format::kNone && o.model.fp8_param && o.ddp.use_distributed_optimizer) {
    const int ep = groups.ep ? groups.ep->size() : 1, ep_rank = groups.ep ? groups.ep->rank() : 0;
    const auto store = ParamStore::laid_out(
        GPTModel::param_specs(o.model, groups.tp->size(), groups.tp->rank(), s.chunks, ep, ep_rank), o.dtype,
        param_layout);
    in.fp8_gather_bytes = static_cast<size_t>(
        GradSync::fp8_param_gather_bytes(*store, in.model.fp8_weights, shard_dp, o.ddp));
  }
  if (o.optim.optimizer == "muon") {
    const int ep = groups.ep ? groups.ep->size() : 1, ep_rank = groups.ep ? groups.ep->rank() : 0;
    const int etp = groups.etp ? groups.etp->size() : groups.tp->size();
    const MuonMemory mm = muon_memory(
        GPTModel::param_specs(o.model, groups.tp->size(), groups.tp->rank(), s.chunks, ep, ep_rank), o.optim.muon,
        groups.tp->size(), etp, o.device);
    in.muon = true;
    in.muon_dense_elements = mm.dense_elements;
    in.muon_expert_elements = mm.expert_elements;
    in.muon_workspace_bytes = mm.workspace_bytes;
  }
  if (model_plan) *model_plan = in.model;
  return estimate_training_memory(in);
}

ModelSetup::ModelSetup(std::shared_ptr<Communicator> world, ModelSetupOptions options, const Stream& stream)
    : options_(std::move(options)), parallel_(options_.parallel) {
  const ModelSetupOptions& o = options_;
  validate_and_derive(parallel_, world->size());
  validate_rank_schedule(o, parallel_);  // a mismatched layout fails before any collective
  GPTModel::validate_context_parallel(o.model, parallel_.cp, parallel_.tp);
  groups_ = build_process_groups(world, parallel_);
  // The pipeline schedule of this rank (no pipelining when pp == 1) for training and for
  // evaluation (forward only), and the model chunks and buffers they need.
  RankSchedule schedule = plan_rank_schedule(o, parallel_, groups_.pp->rank());
  chunks_ = schedule.chunks;
  train_plan_ = schedule.train;
  eval_plan_ = schedule.eval;
  ramp_plans_ = schedule.ramp;
  // Parameter gradients are reduced (and the distributed optimizer sharded) over dp-cp (Megatron),
  // the shards over one instance of it with hybrid sharding (GradSync splits the groups).
  const int k = o.ddp.num_distributed_optimizer_instances;
  options_.param_layout.data_parallel_size = instance_group_size(groups_.dp_cp->size(), k, "dp-cp");
  options_.param_layout.expert_data_parallel_size = instance_group_size(parallel_.edp, k, "edp");
  if (o.check_memory) estimate_memory(schedule);
  model_ = std::make_unique<GPTModel>(o.model, o.micro_batch_size, o.dtype, o.device, groups_, o.sequence_parallel,
                                      options_.param_layout, schedule.model_layout);
  std::vector<const PipelinePlan*> plans{&train_plan_, &eval_plan_};
  for (const PipelinePlan& p : ramp_plans_) plans.push_back(&p);
  executor_ = std::make_unique<PipelineExecutor>(*model_, groups_.pp, plans);
  // Data-parallel gradient buckets (reduced as the backward finishes them with
  // --overlap-grad-reduce) and the optimizer over this rank's owned elements.
  grad_sync_ = std::make_unique<GradSync>(model_->params(), groups_.dp_cp, o.ddp, groups_.edp);
  optimizer_ = std::make_unique<AdamWOptimizer>(
      *grad_sync_, o.optim, stream, OptimizerGroups{nullptr, groups_.mp, groups_.tp->rank(), false, groups_.etp_ep_pp, groups_.tp, groups_.etp});
  model_->set_hooks(grad_sync_.get());
  if (o.model.fp8_param) grad_sync_->set_fp8_param_gather(*model_->fp8());  // the FP8 weight all-gather
}

ModelSetup::~ModelSetup() = default;

const PipelinePlan& ModelSetup::train_plan(int64_t num_microbatches) const {
  if (num_microbatches == train_plan_.config.num_microbatches) return train_plan_;
  for (const PipelinePlan& p : ramp_plans_)
    if (p.config.num_microbatches == num_microbatches) return p;
  MT_FAIL("no training schedule for {} micro-batches (this rank has {} and the batch-size ramp-up's)", num_microbatches,
          train_plan_.config.num_microbatches);
}

// The memory estimate, before anything large is allocated (train/memory_estimate.h).
void ModelSetup::estimate_memory(const RankSchedule& schedule) {
  const ModelSetupOptions& o = options_;
  memory_estimate_ = estimate_rank_memory(o, groups_, schedule);
  in_use_before_ = device_memory_in_use(o.device);  // CUDA context, libraries, other processes
  log_info("> memory estimate per rank: {}", memory_estimate_.summary());
  if (o.device.is_cuda()) {
    // the free memory now, less 32 MiB per stream of cuBLASLt workspace still to come (one more
    // for the pipeline executor's overlapped p2p stream)
    const size_t streams = o.overlap_p2p_comm && parallel_.pp > 1 ? 3 : 2;
    check_memory_fits(memory_estimate_, device_memory_free(o.device), streams * (size_t{32} << 20), o.device.str());
  } else if (const uint64_t avail = available_host_memory_bytes(); avail > 0) {  // 0: unknown
    check_memory_fits(memory_estimate_, avail, 0, "the host (CPU training)");
  }
}

namespace {

/// --moe-layer-freq's list form of a model's MoE layers, e.g. "[0,1,1]".
std::string moe_layer_freq_list(const TransformerConfig& c) {
  std::string p = "[";
  for (int64_t l = 0; l < c.num_layers; ++l) p += fmt::format("{}{}", l ? "," : "", c.is_moe_layer(l) ? 1 : 0);
  return p + "]";
}

void check_resume_config(const TransformerConfig& ck, const TransformerConfig& m) {
  auto same = [](const char* flag, int64_t a, int64_t b) {
    MT_REQUIRE(a == b, "checkpoint has {} {} but the command line asks for {}", flag, a, b);
  };
  same("--num-layers", ck.num_layers, m.num_layers);
  same("--hidden-size", ck.hidden_size, m.hidden_size);
  same("--num-attention-heads", ck.num_attention_heads, m.num_attention_heads);
  same("--ffn-hidden-size", ck.ffn(), m.ffn());
  same("--max-position-embeddings", ck.max_positions(), m.max_positions());
  same("vocabulary size", ck.vocab_size, m.vocab_size);
  same("--num-query-groups", ck.query_groups(), m.query_groups());
  same("--kv-channels", ck.head_dim(), m.head_dim());
  auto same_flag = [](const char* what, const std::string& a, const std::string& b) {
    MT_REQUIRE(a == b, "checkpoint has {} {} but the command line asks for {}", what, a, b);
  };
  same_flag("--normalization", normalization_name(ck.normalization), normalization_name(m.normalization));
  same_flag("--position-embedding-type", position_embedding_type_name(ck.position_embedding_type),
            position_embedding_type_name(m.position_embedding_type));
  auto yes = [](bool b) { return std::string(b ? "on" : "off"); };
  same_flag("--swiglu", yes(ck.gated_linear_unit), yes(m.gated_linear_unit));
  same_flag("bias in linear layers (--disable-bias-linear)", yes(ck.add_bias_linear), yes(m.add_bias_linear));
  same_flag("--add-qkv-bias", yes(ck.add_qkv_bias), yes(m.add_qkv_bias));
  same_flag("--qk-layernorm", yes(ck.qk_layernorm), yes(m.qk_layernorm));
  same_flag("--multi-latent-attention", yes(ck.multi_latent_attention), yes(m.multi_latent_attention));
  if (m.multi_latent_attention) {
    same("--q-lora-rank", ck.q_lora_rank, m.q_lora_rank);
    same("--kv-lora-rank", ck.kv_lora_rank, m.kv_lora_rank);
    same("--qk-head-dim", ck.qk_head_dim, m.qk_head_dim);
    same("--qk-pos-emb-head-dim", ck.qk_pos_emb_head_dim, m.qk_pos_emb_head_dim);
    same("--v-head-dim", ck.v_head_dim, m.v_head_dim);
  }
  same_flag("--apply-layernorm-1p (zero-centred norm weights)", yes(ck.layernorm_zero_centered_gamma),
            yes(m.layernorm_zero_centered_gamma));
  same_flag("--untie-embeddings-and-output-weights", yes(ck.untie_embeddings_and_output_weights),
            yes(m.untie_embeddings_and_output_weights));
  same("--mtp-num-layers", ck.mtp_num_layers, m.mtp_num_layers);  // the MTP parameters
  // Mixture of experts: the experts and where they sit (the router and expert shapes follow).
  same("--num-experts", ck.num_moe_experts, m.num_moe_experts);
  if (ck.num_moe_experts == 0) return;
  same_flag("--moe-layer-freq", moe_layer_freq_list(ck), moe_layer_freq_list(m));
  same("--moe-ffn-hidden-size", ck.moe_ffn(), m.moe_ffn());
  same("--moe-shared-expert-intermediate-size", ck.moe_shared_expert_intermediate_size,
       m.moe_shared_expert_intermediate_size);
  same_flag("--moe-shared-expert-gate", yes(ck.moe_shared_expert_gate), yes(m.moe_shared_expert_gate));
}

}  // namespace

TrainingLayout resolve_training_layout(const PretrainArgs& args, int world_size) {
  TrainingLayout out;
  ParallelConfig& pc = out.parallel;
  pc.tp = args.tensor_model_parallel_size;
  pc.pp = args.pipeline_model_parallel_size;
  pc.ep = args.expert_model_parallel_size;
  pc.etp = args.expert_tensor_parallel_size;
  pc.cp = args.context_parallel_size;
  pipeline::PipelineLayout& layout = out.pipeline;
  layout.num_layers = args.model.num_layers;
  layout.pp = pc.pp;
  layout.first_stage_layers = args.decoder_first_pipeline_num_layers;
  layout.last_stage_layers = args.decoder_last_pipeline_num_layers;
  layout.account_for_embedding = args.account_for_embedding_in_pipeline_split;
  layout.account_for_loss = args.account_for_loss_in_pipeline_split;
  MT_REQUIRE(pc.pp >= 1, "--pipeline-model-parallel-size must be >= 1, got {}", pc.pp);
  layout.vpp = pipeline::resolve_virtual_pipeline_size(layout, args.num_layers_per_virtual_pipeline_stage,
                                                       args.num_virtual_stages_per_pipeline_rank);
  pc.vpp = layout.vpp;
  validate_and_derive(pc, world_size);
  pipeline::validate_pipeline_layout(layout);
  return out;
}

ModelSetupOptions pretrain_model_options(const PretrainArgs& args, const TrainingLayout& layout, Device device) {
  ModelSetupOptions o;
  o.model = args.model;
  o.parallel = layout.parallel;
  o.pipeline = layout.pipeline;
  o.num_microbatches = args.num_microbatches();
  for (const int64_t m : args.microbatch_counts())
    if (m != o.num_microbatches) o.ramp_microbatches.push_back(m);
  o.microbatch_group_size = args.microbatch_group_size_per_vp_stage;
  o.overlap_p2p_comm = args.overlap_p2p_comm;
  o.micro_batch_size = args.micro_batch_size;
  o.sequence_parallel = args.sequence_parallel;
  o.dtype = args.dtype();
  o.device = device;
  o.param_layout = args.param_layout();
  o.ddp = args.ddp_config();
  o.optim = args.optim;
  // FP8: the weight copies in the bf16 parameters' storage where the fp32 main weights allow it
  o.model.fp8_weights_in_params =
      o.model.fp8 != Fp8Format::kNone &&
      Fp8Model::weights_in_params(o.dtype, o.optim.store_param_remainders, o.ddp.use_distributed_optimizer,
                                  o.model.fp8_param, layout.parallel.dp * layout.parallel.cp, layout.parallel.edp);
  o.check_memory = true;
  o.batch_bytes =
      BatchStager::device_bytes(o.num_microbatches, o.micro_batch_size, args.model.seq_length, layout.parallel.cp,
                                args.model.mtp_num_layers);
  return o;
}

std::unique_ptr<TrainingSetup> TrainingSetup::launch(PretrainArgs args) {
  const LaunchEnv env = read_launch_env();
  Device device = resolve_device(args.device);
  if (device.is_cuda() && env.world_size > 1) device = local_device(DeviceType::kCUDA, env);  // GPU = LOCAL_RANK
  set_current_device(device);
  std::shared_ptr<Communicator> world = init_world(device, env, args.distributed_timeout_minutes);
  if (world->rank() != 0) set_log_level(LogLevel::kWarn);  // rank 0 logs
  return std::make_unique<TrainingSetup>(std::move(args), std::move(world), device);
}

TrainingSetup::TrainingSetup(PretrainArgs args, std::shared_ptr<Communicator> world, Device device)
    : args_(std::move(args)), world_(std::move(world)), device_(device) {
  save_lock_ = lock_save_directory(args_.save, *world_, device_);  // one job per --save, for the job's life
  resolve_arguments();  // no communication: the errors are the same on every rank
  prepare_save_directory();
  build_datasets();
  stream_ = std::make_unique<Stream>(device_);
  model_setup_ = std::make_unique<ModelSetup>(world_, model_options(), *stream_);
  log_summary();
  load_or_initialize();
  data::LtorOptions ltor;
  ltor.eod = tokenizer_->eod();
  ltor.reset_position_ids = args_.data.reset_position_ids;
  ltor.reset_attention_mask = args_.data.reset_attention_mask;
  ltor.eod_mask_loss = args_.data.eod_mask_loss;
  const ProcessGroups& g = groups();
  stager_ = std::make_unique<BatchStager>(
      BatchStager::Options{num_microbatches(), args_.micro_batch_size, args_.model.seq_length, parallel_.dp,
                           g.dp->rank(), args_.model.vocab_size, ltor, parallel_.cp, g.cp->rank(),
                           args_.data.reset_position_ids, args_.data.reset_attention_mask,
                           args_.calculate_per_token_loss, args_.model.mtp_num_layers},
      device_);
}

TrainingSetup::~TrainingSetup() = default;

// The checkpoint to resume, the parallel sizes, the tokenizer's vocabulary and the validation of
// every argument, in the order the errors are reported.
void TrainingSetup::resolve_arguments() {
  PretrainArgs& args = args_;
  check_megatron_compat(args);  // a refused Megatron-LM flag stops the run before anything is set up
  if (world_->rank() == 0) log_megatron_compat(args);
  if (!args.load.empty()) {
    const bool autoresume = args.load == args.save;
    if (autoresume && !latest_checkpoint_iteration(args.load).has_value()) {
      MT_REQUIRE(!args.exit_on_missing_checkpoint,
                 "--load directory '{}' holds no checkpoint and --exit-on-missing-checkpoint is given", args.load);
      log_info("> no checkpoint in {} yet (--load == --save): starting from scratch", args.load);
    } else {
      resume_ = read_checkpoint_state(args.load, {args.fallback_to_previous_checkpoint, std::nullopt});
    }
  }
  if (resume_ && args.use_checkpoint_args) {  // the architecture of the checkpoint (Megatron's --use-checkpoint-args)
    TransformerConfig m = resume_->model;
    m.seq_length = args.model.seq_length;  // training choices stay the command line's
    m.hidden_dropout = args.model.hidden_dropout;
    m.attention_dropout = args.model.attention_dropout;
    m.init_method_std = args.model.init_method_std;
    m.make_vocab_size_divisible_by = args.model.make_vocab_size_divisible_by;
    m.moe_per_layer_logging = args.model.moe_per_layer_logging;
    m.moe_router_bias_update_rate = args.model.moe_router_bias_update_rate;
    args.model = m;
    args.group_query_attention = m.num_query_groups > 0;
    if (m.num_moe_experts > 0) args.moe_layer_freq = moe_layer_freq_list(m);  // validate_pretrain_args re-reads it
  }
  const TrainingLayout resolved = resolve_training_layout(args, world_->size());
  parallel_ = resolved.parallel;
  pipeline_ = resolved.pipeline;
  const ParallelConfig& pc = parallel_;
  const pipeline::PipelineLayout& layout = pipeline_;
  args.data_parallel_size = pc.dp;
  args.expert_data_parallel_size = pc.edp;
  MT_REQUIRE(device_.is_cuda() || args.dtype() == DType::kF32,
             "--{} needs a CUDA device; the CPU backend trains in fp32", args.bf16 ? "bf16" : "fp16");
  tokenizer_ = data::build_tokenizer(args.data);
  args.model.vocab_size = tokenizer_->vocab_size();
  if (resume_) {
    // A model may have more embedding rows than its tokenizer has tokens (Hugging Face models).
    MT_REQUIRE(resume_->model.vocab_size >= args.model.vocab_size,
               "checkpoint '{}' has a vocabulary of {} tokens but the tokenizer has {}", args.load,
               resume_->model.vocab_size, args.model.vocab_size);
    args.model.vocab_size = resume_->model.vocab_size;
  }
  check_pretrain_memory(args, pc, layout, device_);  // absurd sizes: from the configuration, before anything is built
  validate_pretrain_args(args);
  MT_REQUIRE(!args.cuda_graph.enabled() || device_.is_cuda(),
             "--cuda-graph-impl {} needs a CUDA device; this run is on {}", args.cuda_graph.impl, device_.str());
  GPTModel::validate_context_parallel(args.model, pc.cp, pc.tp);  // before any communication
  pipeline::validate_schedule_config(
      schedule_config(pc, num_microbatches(), args.microbatch_group_size_per_vp_stage));
  if (resume_) check_resume_config(resume_->model, args.model);
}

// Fails early on an unwritable --save and cleans what interrupted saves left there (rank 0).
void TrainingSetup::prepare_save_directory() const {
  if (args_.save.empty() || world_->rank() != 0) return;
  std::error_code ec;
  std::filesystem::create_directories(args_.save, ec);
  const auto probe = std::filesystem::path(args_.save) / ".write_test";
  std::FILE* f = ec ? nullptr : std::fopen(probe.c_str(), "w");
  MT_REQUIRE(f != nullptr, "--save directory '{}' is not writable{}", args_.save,
             ec ? ": " + ec.message() : std::string());
  std::fclose(f);
  std::filesystem::remove(probe, ec);
  for (const auto& name : clean_interrupted_saves(args_.save))
    log_info("> removed what an interrupted checkpoint save left in {}: {}", args_.save, name);
}

// Megatron's GPTDataset / BlendedDataset / MockGPTDataset with the sample counts Megatron asks for.
// With --data-cache-path, rank 0 builds the index files and the other ranks then read them.
void TrainingSetup::build_datasets() {
  const PretrainArgs& args = args_;
  const int64_t M = num_microbatches();
  {  // An absurd batch is an error before the datasets are built: the batch buffers alone (two pinned
     // host copies and one device copy, 20 bytes per token) must fit in the memory there is.
    const double batch_bytes = 3.0 * 20.0 * static_cast<double>(M) * static_cast<double>(args.micro_batch_size) *
                               static_cast<double>(args.model.seq_length);
    const uint64_t avail = available_host_memory_bytes();
    MT_REQUIRE(avail == 0 || batch_bytes < 0.8 * static_cast<double>(avail),
               "--micro-batch-size {} x --seq-length {} ({} micro-batches per iteration) needs {:.3g} GiB for the "
               "batch buffers alone, more than the {:.1f} GiB of memory available",
               args.micro_batch_size, args.model.seq_length, M, batch_bytes / 1073741824.0,
               static_cast<double>(avail) / 1073741824.0);
  }
  auto counts = data::train_valid_test_num_samples(args.train_iters, args.global_batch_size, args.eval_interval,
                                                   args.eval_iters);
  if (args.train_samples > 0) counts[0] = args.train_samples;  // Megatron: the train split of --train-samples
  for (int pass = 0; pass < 2; ++pass) {
    if ((pass == 0) == (world_->rank() == 0))
      data_ = data::build_gpt_datasets(args.data, args.model.seq_length, args.seed, counts[0], counts[1], counts[2],
                                       *tokenizer_);
    if (pass == 0) world_->barrier();
  }
  MT_REQUIRE(data_.train && data_.train->size() > 0, "the training split is empty");
  log_info("> datasets: train {}; valid {}", data_.train->name(), data_.valid ? data_.valid->name() : "none");
  if (data_.valid && data_.valid->size() == 0) data_.valid.reset();
}

ModelSetupOptions TrainingSetup::model_options() const {
  return pretrain_model_options(args_, {parallel_, pipeline_}, device_);
}

void TrainingSetup::log_summary() {
  const ParallelConfig& pc = parallel_;
  GPTModel& model = model_setup_->model();
  const auto& cfg = model.config();
  if (world_->size() > 1) log_info("{}", layout_table(pc));
  log_info("> model: GPT {}, {} attention, seq {}, vocab {} (padded {}), {:.2f}M parameters, {} on {}; activations "
           "{:.1f} MiB",
           cfg.summary(), model.attention_backend(), cfg.seq_length, cfg.vocab_size, model.padded_vocab(),
           model.params().num_parameters() / 1e6, dtype_name(args_.dtype()), device_.str(),
           model.activation_bytes() / 1048576.0);
  if (pc.cp > 1)
    log_info("> context parallel: {} ranks, --cp-comm-type {}{}, {} of {} tokens per rank (chunks r and 2·{}-1-r "
             "of {}); activations {:.1f} MiB per rank",
             pc.cp, cfg.cp_comm_type,
             cfg.hierarchical_context_parallel_sizes.empty()
                 ? std::string()
                 : fmt::format(" (a2a {} x p2p {})", cfg.hierarchical_context_parallel_sizes[0],
                               cfg.hierarchical_context_parallel_sizes[1]),
             model.local_seq_length(), cfg.seq_length, pc.cp, 2 * pc.cp, model.activation_bytes() / 1048576.0);
  if (pc.pp > 1) {
    std::string stages;
    for (const auto& r : model_setup_->chunks()) stages += fmt::format(" [{}, {})", r.begin, r.end);
    log_info("> pipeline: {} stages{}, {} schedule{}, {} micro-batches; rank 0 holds layers{}, {} activation slots "
             "(theoretical bubble {:.1f}%)",
             pc.pp * pc.num_chunks(), pc.vpp > 1 ? fmt::format(" ({} per rank)", pc.vpp) : "",
             pc.vpp > 1 ? "interleaved 1F1B" : "1F1B", args_.overlap_p2p_comm ? " with overlapped p2p" : "",
             num_microbatches(), stages, model_setup_->train_plan().activation_slots,
             100.0 * pipeline::bubble_fraction(pc.pp, pc.vpp, static_cast<int>(num_microbatches())));
  }
  const GradSync& grad_sync = model_setup_->grad_sync();
  if (args_.ddp_copy_engine && groups().dp->size() > 1)
    log_info("> data-parallel collectives: {}", grad_sync.copy_engine_active()
                                                   ? std::string("copy engine for the collectives that overlap "
                                                                 "compute, NCCL for the others (--ddp-copy-engine)")
                                                   : "the DP communicator's (copy engine unavailable: " +
                                                         grad_sync.why_not_copy_engine() + ")");
  if (args_.grad_reduce_in_bf16 && groups().dp->size() > 1)
    log_info("> data-parallel gradient reduction in bf16 (--grad-reduce-in-bf16)");
  if (args_.optim.store_param_remainders)
    log_info("> fp32 main parameters stored as bf16 parameters + int16 remainders (--use-precision-aware-optimizer): "
             "{:.3f} GiB on this rank",
             static_cast<double>(model.params().main_storage_bytes()) / (1024.0 * 1024.0 * 1024.0));
  if (model.params().buckets().size() > 1)
    log_info("> data-parallel gradient buckets: {} (--ddp-bucket-size {}), overlap grad reduce {}, param gather {}",
             model.params().buckets().size(), model.params().layout().bucket_size, args_.overlap_grad_reduce,
             args_.overlap_param_gather);
  if (const int k = args_.num_distributed_optimizer_instances; k > 1)
    log_info("> hybrid sharding (--num-distributed-optimizer-instances {}): the data-parallel group of {} ranks as {} "
             "instances of {} (sharded within an instance, gradients all-reduced across instances)",
             k, groups().dp_cp->size(), k, grad_sync.dp()->size());
}

// The checkpoint of --load (weights, and unless --finetune / --no-load-optim the optimizer and the
// iteration), or freshly initialised parameters.
void TrainingSetup::load_or_initialize() {
  const PretrainArgs& args = args_;
  GPTModel& model = model_setup_->model();
  if (!resume_) {
    model.params().initialize(args.seed, *stream_);
    return;
  }
  const bool weights_only = args.finetune || args.no_load_optim;
  MT_REQUIRE(weights_only || resume_->has_optimizer,
             "checkpoint '{}' holds no optimizer state (written by import-hf?): add --finetune (weights only, "
             "iteration 0) or --no-load-optim",
             args.load);
  const auto t_load = std::chrono::steady_clock::now();
  // The expert bias (persistent_state) is model state: loaded for --finetune / --no-load-optim too.
  CheckpointState st = load_checkpoint(args.load, model.params(), weights_only ? nullptr : &model_setup_->optimizer(),
                                       *stream_, {false, resume_->iteration}, model.persistent_state(*stream_));
  model.load_persistent_state(*stream_);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
  const double load_gb = static_cast<double>(checkpoint_bytes(args.load, st.iteration)) / 1e9;
  log_info("> checkpoint read and verified: {:.3f} GB in {:.2f} s ({:.2f} GB/s; this rank's share of the files)",
           load_gb, load_s, load_gb / std::max(load_s, 1e-9));
  if (args.finetune) {
    log_info("> loaded the weights of {} (iteration {}) for finetuning: starting at iteration 0", args.load,
             st.iteration);
    return;
  }
  start_iteration_ = st.iteration;
  start_consumed_ = st.consumed_train_samples;
  MT_REQUIRE(st.seed == args.seed || args.no_load_rng,
             "checkpoint was trained with --seed {} but --seed {} was given (add --no-load-rng to continue with "
             "the new seed)", st.seed, args.seed);
  if (st.seed != args.seed) log_info("> --no-load-rng: continuing with --seed {} (checkpoint: {})", args.seed, st.seed);
  log_info("> loaded checkpoint from {} at iteration {} ({} samples consumed)", args.load, start_iteration_,
           start_consumed_);
}

void TrainingSetup::log_memory_report() {
  const MemoryEstimate& estimate = model_setup_->memory_estimate();
  {
    // the buffers the estimate covers: on the CPU the host's pinned staging buffers (two batches)
    // count too
    const double est = static_cast<double>(estimate.total()),
                 got = static_cast<double>(device_bytes_allocated(device_) -
                                           (device_.is_cuda() ? 0 : 2 * model_setup_->options().batch_bytes));
    log_info("> memory estimate {:.1f} MiB of buffers, {:+.1f}% from the {:.1f} MiB allocated", est / 1048576.0,
             100.0 * (est - got) / std::max(got, 1.0), got / 1048576.0);
  }
  if (!device_.is_cuda()) return;
  log_info("> device memory: {:.1f} MiB in megatron.cpp buffers (static: allocated once, so also the peak), "
           "{:.1f} MiB in use on {} (cudaMemGetInfo, includes the CUDA context and cuBLAS)",
           device_bytes_allocated(device_) / 1048576.0, device_memory_in_use(device_) / 1048576.0, device_.str());
  log_info("> memory estimate: {:.1f} MiB in use expected (the {:.1f} MiB in use before the model + the buffers' "
           "estimate)", (static_cast<double>(estimate.total()) + static_cast<double>(model_setup_->memory_in_use_before())) /
                            1048576.0,
           model_setup_->memory_in_use_before() / 1048576.0);
  if (world_->size() == 1) return;
  // per rank (pipeline stages differ), gathered to rank 0
  const int n = world_->size();
  const float mine[2] = {static_cast<float>(device_bytes_allocated(device_) / 1048576.0),
                         static_cast<float>(device_memory_in_use(device_) / 1048576.0)};
  const std::vector<char> gathered = all_gather_host(*world_, mine, sizeof(mine), *stream_);
  std::vector<float> host(static_cast<size_t>(2 * n));
  std::memcpy(host.data(), gathered.data(), gathered.size());
  std::string per_rank;
  for (int r = 0; r < n; ++r) per_rank += fmt::format(" r{}: {:.0f}/{:.0f}", r, host[2 * r], host[2 * r + 1]);
  log_info("> device memory per rank (MiB, buffers/in use; pipeline stage = rank / (tp·dp) in the "
           "default order):{}", per_rank);
}

}  // namespace mt
