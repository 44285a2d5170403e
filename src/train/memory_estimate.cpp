#include "train/memory_estimate.h"

#include "ops/optimizer.h"

#include <algorithm>

#include "core/check.h"

namespace mt {

namespace {
double gib(size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0 * 1024.0); }
constexpr const char* kActivationRemedy =
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1, a smaller "
    "--micro-batch-size, --sequence-parallel with tensor parallelism, or a larger --pipeline-model-parallel-size";
constexpr const char* kModelRemedy = "a larger --tensor-model-parallel-size or --pipeline-model-parallel-size";
}  // namespace

size_t MemoryEstimate::total() const {
  size_t n = 0;
  for (const MemoryPart& p : parts) n += p.bytes;
  return n;
}

std::string MemoryEstimate::summary() const {
  std::string s;
  for (const MemoryPart& p : parts) {
    if (p.bytes == 0) continue;
    s += fmt::format("{}{} {:.3f} GiB", s.empty() ? "" : ", ", p.name, gib(p.bytes));
  }
  return s + fmt::format("; total {:.3f} GiB", gib(total()));
}

MemoryEstimate estimate_training_memory(const MemoryEstimateInputs& in) {
  const ModelMemoryPlan& m = in.model;
  const auto total = static_cast<size_t>(m.params.total), expert = static_cast<size_t>(m.params.expert);
  // the distributed optimizer owns 1/DP of every dense bucket and 1/EDP of every expert bucket
  // (buckets are padded to split evenly)
  const size_t owned = in.distributed_optimizer
                           ? (total - expert) / static_cast<size_t>(std::max<int64_t>(in.data_parallel, 1)) +
                                 expert / static_cast<size_t>(std::max<int64_t>(in.expert_data_parallel, 1))
                           : total;
  const bool separate_main = in.dtype != DType::kF32;
  const std::string sharded = in.distributed_optimizer ? "" : "; --use-distributed-optimizer shards it over DP";
  MemoryEstimate e;
  if (separate_main)
    e.parts.push_back({fmt::format("model parameters ({})", dtype_name(in.dtype)), total * dtype_size(in.dtype),
                       kModelRemedy});
  // ParamStore::main_storage_bytes: 4 bytes per stored main element, 2 as int16 remainders
  const bool remainders = separate_main && in.store_param_remainders;
  e.parts.push_back({!separate_main ? "parameters (fp32)"
                     : remainders   ? "main parameters (int16 remainders of fp32)"
                                    : "main parameters (fp32)",
                     separate_main ? owned * (remainders ? 2 : 4) : total * 4,
                     std::string(kModelRemedy) + (separate_main ? sharded : "") +
                         (separate_main && !remainders && in.dtype == DType::kBF16
                              ? "; --use-precision-aware-optimizer halves it"
                              : "")});
  e.parts.push_back({"gradients (fp32)", total * 4, kModelRemedy});
  // the moments, and AdamW's chunk table (AdamWPlan: at most one partial chunk per owned piece,
  // a piece being a parameter's run cut by the owned range of its bucket)
  const size_t chunks = (owned + kAdamWChunk - 1) / kAdamWChunk + static_cast<size_t>(m.params.count + m.params.buckets);
  e.parts.push_back({"optimizer state (Adam moments, fp32)", owned * 8 + chunks * sizeof(AdamWRun),
                     std::string(kModelRemedy) + sharded});
  e.parts.push_back({fmt::format("activations ({} slot{} of {:.3f} GiB)", m.activation_slots,
                                 m.activation_slots == 1 ? "" : "s", gib(m.activation_slot_bytes)),
                     m.activation_slot_bytes * static_cast<size_t>(m.activation_slots), kActivationRemedy});
  e.parts.push_back({"recompute area", m.recompute_bytes, "a smaller --recompute-num-layers"});
  e.parts.push_back({"loss head", m.head_slot_bytes * static_cast<size_t>(m.head_slots),
                     "a smaller --micro-batch-size or a larger --tensor-model-parallel-size"});
  e.parts.push_back({"scratch (temporaries shared by the layers and the loss head)", m.scratch_bytes,
                     "a smaller --micro-batch-size or a larger --tensor-model-parallel-size"});
  e.parts.push_back({"pipeline buffers", m.persistent_bytes - m.fp8_bytes + in.pipeline_grad_bytes, ""});
  e.parts.push_back({"FP8 weights (w and w^T) and scaling state", m.fp8_bytes,
                     "--first-last-layers-bf16, or a larger --tensor-model-parallel-size"});
  if (in.grad_reduce_in_bf16)
    e.parts.push_back({"bf16 gradient reduction buffer", static_cast<size_t>(m.params.largest_bucket) * 2,
                       "a smaller --ddp-bucket-size"});
  e.parts.push_back({"staged batches", in.batch_bytes, ""});
  return e;
}

void check_memory_fits(const MemoryEstimate& estimate, size_t available, size_t reserved, const std::string& device) {
  const size_t need = estimate.total() + reserved;
  if (need <= available) return;
  std::vector<MemoryPart> largest = estimate.parts;
  std::stable_sort(largest.begin(), largest.end(), [](const MemoryPart& a, const MemoryPart& b) { return a.bytes > b.bytes; });
  std::string top;
  for (size_t i = 0; i < largest.size() && i < 3; ++i)
    top += fmt::format("\n  {} {:.2f} GiB{}", largest[i].name, gib(largest[i].bytes),
                       largest[i].remedy.empty() ? "" : " (helps: " + largest[i].remedy + ")");
  MT_FAIL("out of memory at plan time on {}: training needs an estimated {:.2f} GiB ({:.2f} GiB of buffers + {:.2f} "
          "GiB already in use or reserved), {:.2f} GiB are available. Largest consumers:{}",
          device, gib(need), gib(estimate.total()), gib(reserved), gib(available), top);
}

}  // namespace mt
