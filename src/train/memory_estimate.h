// Device memory of one training rank, estimated before anything large is allocated
// (docs/flags.md "Memory estimate"): the ParamStore's flat buffers, the optimizer state, the
// model's buffer plan (activation slots, recompute area, loss-head slots, scratch, pipeline
// inputs), the pipeline's gradient buffers and the staged batches, all from the same sizes the
// allocations will use (GPTModel::memory_plan, ParamStore::plan). Memory is static in
// megatron.cpp (docs/architecture.md principle 1), so the allocated total is also the peak; the
// trainer prints the estimate at start, refuses a configuration that cannot fit with the largest
// consumers named, and compares the estimate with the allocated buffers at the end.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "model/gpt_model.h"
#include "parallel/parallel_config.h"
#include "parallel/pipeline/layer_split.h"
#include "train/arguments.h"

namespace mt {

struct MemoryEstimateInputs {
  ModelMemoryPlan model;              ///< GPTModel::memory_plan of this rank
  DType dtype = DType::kF32;          ///< model parameters and activations
  bool distributed_optimizer = false; ///< --use-distributed-optimizer: main params and moments sharded
  /// --use-precision-aware-optimizer (bf16): main parameters as int16 remainders, 2 bytes each
  bool store_param_remainders = false;
  int64_t data_parallel = 1;          ///< ranks the dense parameters are sharded over (dp-cp; one instance of it
                                      ///< with --num-distributed-optimizer-instances: dp-cp / k)
  int64_t expert_data_parallel = 1;   ///< ranks the expert parameters are sharded over (edp; edp / k)
  bool grad_reduce_in_bf16 = false;   ///< --grad-reduce-in-bf16: a bf16 copy of the largest bucket
  /// optim_grads (DdpConfig::shard_grads): gradients are the owned shard plus this many staging
  /// slots of the largest non-expert bucket and the expert slots (ModelMemoryPlan's
  /// params.expert_grad_slots of params.expert_slot elements) (0: the whole fp32 gradient buffer)
  int grad_slots = 0;
  /// optim_grads_params (DdpConfig::shard_params): the model-dtype parameters are the owned slices,
  /// this many staging slots of the largest non-expert bucket and the expert slots
  /// (params.expert_param_slots of params.expert_slot elements) (0: the whole parameters)
  int param_slots = 0;
  size_t pipeline_grad_bytes = 0;     ///< the pipeline executor's received-gradient buffers
  size_t batch_bytes = 0;             ///< the staged micro-batches on the device
  /// --fp8-param-gather: the distributed optimizer's FP8 gather buffer and weight amaxes
  /// (GradSync::fp8_param_gather_bytes)
  size_t fp8_gather_bytes = 0;
  /// --optimizer muon (optim/muon.h muon_memory): the rank's Muon matrix elements (dense, expert),
  /// which keep one momentum buffer instead of AdamW's two moments, and the Newton-Schulz workspace.
  bool muon = false;
  int64_t muon_dense_elements = 0, muon_expert_elements = 0;
  size_t muon_workspace_bytes = 0;
  /// Dropless MoE layers (no --moe-expert-capacity-factor nor --moe-received-token-capacity): their
  /// expert buffers are sized for the worst case; the activations' remedies then name the capacities.
  bool dropless_moe = false;
};

/// One consumer: name, bytes and the flags that shrink it (empty: none).
struct MemoryPart {
  std::string name;
  size_t bytes = 0;
  std::string remedy;
};

struct MemoryEstimate {
  std::vector<MemoryPart> parts;
  size_t total() const;
  /// "parameters 0.24 GiB, gradients ..., total 8.61 GiB" (every part, in order).
  std::string summary() const;
};

/// The estimate of the buffers megatron.cpp allocates on the rank's device for training (what
/// device_bytes_allocated reports once training runs; the CUDA context, cuBLASLt's workspaces
/// and NCCL's buffers come on top).
MemoryEstimate estimate_training_memory(const MemoryEstimateInputs& in);

/// Errors (mt::Error) when estimate.total() + reserved exceeds available: the message names the
/// device, the totals, the three largest consumers with their sizes and the flags that shrink
/// them. reserved: memory already in use or needed besides the buffers (CUDA context, workspaces).
void check_memory_fits(const MemoryEstimate& estimate, size_t available, size_t reserved, const std::string& device);

// ---- From the configuration alone (docs/flags.md "Memory estimate") ----
// GPTModel::memory_plan builds the modules of every layer (about 0.3 ms each), so a configuration
// of 100,000 layers would run for half a minute before its estimate. The functions below count
// the weight matrices from the sizes in the configuration (long double arithmetic: no overflow,
// whatever the values) and refuse what cannot fit in microseconds, before any dataset, layer or
// buffer exists. They count only the weight matrices (embedding, position table, output layer,
// attention QKV and projection, MLP, router, experts, shared experts; no norms, no biases, no
// activations), so they give a lower bound of the memory and never refuse what would fit; the
// exact estimate (estimate_training_memory) follows once the layout is known.

/// Weights one rank holds on the pipeline stage that holds the most (lower bound, see above):
/// weight matrices split over TP as the model splits them, experts over EP (E / EP per rank,
/// expert TP = TP), the embedding on the first stage, the output layer (or the tied embedding's
/// copy) on the last.
struct StageWeights {
  long double dense = 0;   ///< non-expert weights (sharded over DP by the distributed optimizer)
  long double expert = 0;  ///< expert weights (sharded over expert DP)
  int pp_rank = 0;         ///< the stage
  int64_t layers = 0;      ///< its transformer layers
  long double total() const { return dense + expert; }
};
StageWeights largest_stage_weights(const TransformerConfig& config, int tp, int ep,
                                   const pipeline::PipelineLayout& layout);

/// Options of check_config_memory: the parts of the training estimate that depend only on the
/// number of parameters.
struct ConfigMemoryOptions {
  DType dtype = DType::kF32;           ///< model parameters (bf16 / fp16 add a copy)
  bool training = true;                ///< gradients and Adam moments too (false: inference)
  bool distributed_optimizer = false;  ///< main params (of bf16/fp16) and moments sharded over DP
  bool store_param_remainders = false; ///< --use-precision-aware-optimizer
  bool shard_grads = false;            ///< optim_grads: fp32 gradients sharded too (staging not counted)
  bool shard_params = false;           ///< optim_grads_params: model parameters sharded too (staging not counted)
  int64_t data_parallel = 1, expert_data_parallel = 1;
  /// Host copies made besides the parameters (import-hf / export-hf keep the weights twice in fp32).
  int extra_fp32_copies = 0;
  std::string what = "training";       ///< in the message: "training", "generation", "export-hf", ...
};

/// Refuses (mt::Error) a model whose weights, with the gradients and optimizer state training adds
/// (the bytes per parameter of estimate_training_memory), need more than the memory `device` has
/// free (CUDA: free memory less 64 MiB; CPU: available host memory; unknown: no check). The message
/// names the size flags with their values (--num-layers, --hidden-size, --ffn-hidden-size, heads,
/// vocabulary, experts), the parallel sizes and the bytes. Microseconds for any configuration.
void check_config_memory(const TransformerConfig& config, int tp, int ep, const pipeline::PipelineLayout& layout,
                         const ConfigMemoryOptions& options, Device device);

/// check_config_memory for a model that only runs forward (generate, serve, evaluate, logits): its
/// weights in `dtype`, split over `tp` and the stages of `layout` (default: one stage).
void check_inference_memory(const TransformerConfig& config, int tp, DType dtype, Device device,
                            const std::string& what, pipeline::PipelineLayout layout = {});

/// check_config_memory for `megatron pretrain` (args validated; pc derived; layout validated).
void check_pretrain_memory(const PretrainArgs& args, const ParallelConfig& pc, const pipeline::PipelineLayout& layout,
                           Device device);

}  // namespace mt
