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

#include "core/dtype.h"
#include "model/gpt_model.h"

namespace mt {

struct MemoryEstimateInputs {
  ModelMemoryPlan model;              ///< GPTModel::memory_plan of this rank
  DType dtype = DType::kF32;          ///< model parameters and activations
  bool distributed_optimizer = false; ///< --use-distributed-optimizer: main params and moments sharded
  /// --use-precision-aware-optimizer (bf16): main parameters as int16 remainders, 2 bytes each
  bool store_param_remainders = false;
  int64_t data_parallel = 1;          ///< ranks the dense parameters are sharded over (dp-cp)
  int64_t expert_data_parallel = 1;   ///< ranks the expert parameters are sharded over (edp)
  bool grad_reduce_in_bf16 = false;   ///< --grad-reduce-in-bf16: a bf16 copy of the largest bucket
  size_t pipeline_grad_bytes = 0;     ///< the pipeline executor's received-gradient buffers
  size_t batch_bytes = 0;             ///< the staged micro-batches on the device
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

}  // namespace mt
