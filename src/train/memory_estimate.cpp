#include "train/memory_estimate.h"

#include "ops/optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/buffer.h"
#include "core/check.h"
#include "core/host_memory.h"
#include "optim/grad_sync.h"

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
  // optim_grads_params (ParamStore::use_param_slots): the owned slices, the staging slots and the
  // expert slots (the largest MoE layer's experts each), in the model dtype; an fp32 model's owned
  // slices are its main shard.
  const size_t staged = static_cast<size_t>(in.param_slots) * static_cast<size_t>(m.params.largest_dense_bucket) +
                        (in.param_slots > 0 ? static_cast<size_t>(m.params.expert_param_slots) *
                                                  static_cast<size_t>(m.params.expert_slot)
                                            : 0);
  const size_t model_elements = in.param_slots == 0 ? total : (separate_main ? owned : 0) + staged;
  if (separate_main || in.param_slots > 0)
    e.parts.push_back({in.param_slots == 0 ? fmt::format("model parameters ({})", dtype_name(in.dtype))
                       : separate_main
                           ? fmt::format("model parameters ({}; owned slices and {} staging slots{})",
                                         dtype_name(in.dtype), in.param_slots, expert > 0 ? " and the expert slots" : "")
                           : fmt::format("parameter staging slots ({}; {} slots{})", dtype_name(in.dtype),
                                         in.param_slots, expert > 0 ? " and the expert slots" : ""),
                       model_elements * dtype_size(in.dtype),
                       in.param_slots > 0 ? "a smaller --ddp-bucket-size"
                                          : std::string(kModelRemedy) +
                                                "; --use-megatron-fsdp --data-parallel-sharding-strategy "
                                                "optim_grads_params shards it over DP"});
  // ParamStore::main_storage_bytes: 4 bytes per stored main element, 2 as int16 remainders
  const bool remainders = separate_main && in.store_param_remainders;
  e.parts.push_back({!separate_main ? "parameters (fp32)"
                     : remainders   ? "main parameters (int16 remainders of fp32)"
                                    : "main parameters (fp32)",
                     separate_main || in.param_slots > 0 ? owned * (remainders ? 2 : 4) : total * 4,
                     std::string(kModelRemedy) + (separate_main ? sharded : "") +
                         (separate_main && !remainders && in.dtype == DType::kBF16
                              ? "; --use-precision-aware-optimizer halves it"
                              : "")});
  // optim_grads: the owned shard (GradSync::grad_shard), the staging slots of the largest
  // non-expert bucket and the expert slots (ParamStore::use_grad_slots)
  if (in.grad_slots > 0)
    e.parts.push_back(
        {fmt::format("gradients (fp32 shard and {} staging slots)", in.grad_slots),
         owned * 4 +
             static_cast<size_t>(in.grad_slots) * static_cast<size_t>(std::max<int64_t>(m.params.largest_dense_bucket, 1)) * 4 +
             static_cast<size_t>(m.params.expert_grad_slots) * static_cast<size_t>(m.params.expert_slot) * 4,
         "a smaller --ddp-bucket-size"});
  else
    e.parts.push_back({"gradients (fp32)", total * 4,
                       std::string(kModelRemedy) + "; --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads "
                                                   "shards it over DP"});
  // the moments, and AdamW's chunk table (AdamWPlan: at most one partial chunk per owned piece,
  // a piece being a parameter's run cut by the owned range of its bucket)
  const size_t chunks = (owned + kAdamWChunk - 1) / kAdamWChunk + static_cast<size_t>(m.params.count + m.params.buckets);
  // Muon: no second moment for its matrices (the owned share of them with the distributed optimizer)
  const size_t muon_owned =
      !in.muon ? 0
      : in.distributed_optimizer
          ? static_cast<size_t>(in.muon_dense_elements) / static_cast<size_t>(std::max<int64_t>(in.data_parallel, 1)) +
                static_cast<size_t>(in.muon_expert_elements) /
                    static_cast<size_t>(std::max<int64_t>(in.expert_data_parallel, 1))
          : static_cast<size_t>(in.muon_dense_elements + in.muon_expert_elements);
  e.parts.push_back({in.muon ? "optimizer state (Adam moments, Muon momentum, fp32)" : "optimizer state (Adam moments, fp32)",
                     owned * 8 - std::min(muon_owned, owned) * 4 + chunks * sizeof(AdamWRun),
                     std::string(kModelRemedy) + sharded});
  if (in.muon)
    e.parts.push_back({"Muon Newton-Schulz workspace", in.muon_workspace_bytes,
                       "a larger --tensor-model-parallel-size with --muon-tp-mode distributed"});
  e.parts.push_back({fmt::format("activations ({} slot{} of {:.3f} GiB)", m.activation_slots,
                                 m.activation_slots == 1 ? "" : "s", gib(m.activation_slot_bytes)),
                     m.activation_slot_bytes * static_cast<size_t>(m.activation_slots),
                     in.dropless_moe ? std::string(kActivationRemedy) + "; MoE: --moe-expert-capacity-factor or "
                                                                        "--moe-received-token-capacity (the dropless "
                                                                        "expert buffers are sized for the worst case)"
                                     : std::string(kActivationRemedy)});
  e.parts.push_back({"recompute area", m.recompute_bytes, "a smaller --recompute-num-layers"});
  e.parts.push_back({"loss head", m.head_slot_bytes * static_cast<size_t>(m.head_slots),
                     "a smaller --micro-batch-size or a larger --tensor-model-parallel-size"});
  e.parts.push_back({"scratch (temporaries shared by the layers and the loss head)", m.scratch_bytes,
                     "a smaller --micro-batch-size or a larger --tensor-model-parallel-size"});
  e.parts.push_back({"pipeline buffers", m.persistent_bytes - m.fp8_bytes + in.pipeline_grad_bytes, ""});
  e.parts.push_back({"FP8 weights (w and w^T beside the model weights, or their bf16 staging) and scaling state",
                     m.fp8_bytes,
                     "--first-last-layers-bf16, or a larger --tensor-model-parallel-size"});
  if (in.fp8_gather_bytes > 0)
    e.parts.push_back({"FP8 parameter all-gather buffer (--fp8-param-gather)", in.fp8_gather_bytes,
                       "a smaller --ddp-bucket-size"});
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

namespace {

using LD = long double;

// Weight matrices of one transformer layer on one rank (model/layers: SelfAttention's linear_qkv
// [(n + 2g)·d / tp, h] and linear_proj [h, n·d / tp]; MLP's linear_fc1 [glu·f / tp, h] and
// linear_fc2 [h, f / tp]; MoELayer's router [E, h], its E / ep experts with expert TP = TP, the
// shared expert), for a dense and for an MoE layer.
struct LayerWeights {
  LD attention = 0, dense_mlp = 0, moe_dense = 0, moe_expert = 0;
};
LayerWeights layer_weights(const TransformerConfig& c, LD tp, LD ep) {
  const LD h = static_cast<LD>(c.hidden_size), n = static_cast<LD>(c.num_attention_heads);
  const LD d = c.kv_channels > 0 ? static_cast<LD>(c.kv_channels) : std::floor(h / n);
  const LD g = c.num_query_groups > 0 ? static_cast<LD>(c.num_query_groups) : n;
  const LD glu = c.gated_linear_unit ? 2 : 1;
  const auto mlp = [&](LD f) { return (glu * f * h + f * h) / tp; };
  LayerWeights w;
  w.attention = (n + 2 * g) * d * h / tp + n * d * h / tp;
  if (c.multi_latent_attention) {  // model/layers/mla_attention.h: replicated down-projections
    const LD rq = static_cast<LD>(c.q_lora_rank), rkv = static_cast<LD>(c.kv_lora_rank);
    const LD dq = static_cast<LD>(c.q_head_dim()), dn = static_cast<LD>(c.qk_head_dim);
    const LD dr = static_cast<LD>(c.qk_pos_emb_head_dim), dv = static_cast<LD>(c.v_head_dim);
    w.attention = (rq > 0 ? rq * h + n * dq * rq / tp : n * dq * h / tp) + (rkv + dr) * h +
                  n * (dn + dv) * rkv / tp + n * dv * h / tp;
  }
  w.dense_mlp = mlp(static_cast<LD>(c.ffn()));
  if (c.num_moe_experts > 0) {
    const LD experts = static_cast<LD>(c.num_moe_experts);
    w.moe_dense = experts * h + mlp(static_cast<LD>(c.moe_shared_expert_intermediate_size));
    w.moe_expert = std::floor(experts / ep) * mlp(static_cast<LD>(c.moe_ffn()));
  }
  return w;
}

// Adds the weights of layers [begin, end): MoE or dense as config.moe_layer_pattern says. An MoE
// model whose pattern is not parsed yet (--moe-layer-freq, empty pattern) counts each layer as
// the lighter of the two kinds (still a lower bound). Time: O(1) without a pattern.
void add_layers(const TransformerConfig& c, const LayerWeights& lw, int64_t begin, int64_t end, StageWeights& w) {
  const LD count = static_cast<LD>(end - begin);
  w.dense += lw.attention * count;
  if (c.num_moe_experts <= 0) {
    w.dense += lw.dense_mlp * count;
    return;
  }
  if (c.moe_layer_pattern.empty()) {
    if (lw.dense_mlp <= lw.moe_dense + lw.moe_expert) {
      w.dense += lw.dense_mlp * count;
    } else {
      w.dense += lw.moe_dense * count;
      w.expert += lw.moe_expert * count;
    }
    return;
  }
  LD moe = 0;
  for (int64_t l = begin; l < end; ++l) moe += c.is_moe_layer(l) ? 1 : 0;
  w.dense += lw.dense_mlp * (count - moe) + lw.moe_dense * moe;
  w.expert += lw.moe_expert * moe;
}

double gib_ld(LD bytes) { return static_cast<double>(bytes / (1024.0L * 1024.0L * 1024.0L)); }

}  // namespace

StageWeights largest_stage_weights(const TransformerConfig& c, int tp, int ep, const pipeline::PipelineLayout& layout) {
  const LD h = static_cast<LD>(c.hidden_size), t = static_cast<LD>(std::max(tp, 1));
  const LD m = static_cast<LD>(c.make_vocab_size_divisible_by) * t;
  const LD vocab_rows = std::ceil(static_cast<LD>(c.vocab_size) / m) * m / t;  // padded, this rank's share
  const LayerWeights lw = layer_weights(c, t, static_cast<LD>(std::max(ep, 1)));
  StageWeights best;
  for (int r = 0; r < layout.pp; ++r) {
    StageWeights w;
    w.pp_rank = r;
    for (const pipeline::LayerRange& range : pipeline::layers_of(r, layout)) {
      w.layers += range.size();
      add_layers(c, lw, range.begin, range.end, w);
      if (range.has_embedding) {
        w.dense += vocab_rows * h;
        if (c.position_embedding_type == PositionEmbeddingType::kLearnedAbsolute)
          w.dense += static_cast<LD>(c.max_positions()) * h;
      }
      // the output layer, or on the last of several stages the tied embedding's copy
      if (range.has_loss && (!c.tied_output() || layout.pp > 1)) w.dense += vocab_rows * h;
      // and the word embedding's copy for the multi-token prediction of an untied model
      if (range.has_loss && layout.pp > 1 && !c.tied_output() && c.mtp_num_layers > 0) w.dense += vocab_rows * h;
    }
    if (r == 0 || w.total() > best.total()) best = w;
  }
  return best;
}

void check_config_memory(const TransformerConfig& c, int tp, int ep, const pipeline::PipelineLayout& layout,
                         const ConfigMemoryOptions& o, Device device) {
  uint64_t available = 0;
  std::string where;
  if (device.is_cuda()) {
    const size_t free_now = device_memory_free(device), reserved = size_t{64} << 20;
    available = free_now > reserved ? free_now - reserved : 0;
    where = device.str();
  } else {
    available = available_host_memory_bytes();  // 0: unknown
    where = "the host";
  }
  if (available == 0 && !device.is_cuda()) return;
  const StageWeights w = largest_stage_weights(c, tp, ep, layout);
  // Bytes per parameter as estimate_training_memory counts them (its parameter parts).
  const LD owned = o.training && o.distributed_optimizer
                       ? w.dense / static_cast<LD>(std::max<int64_t>(o.data_parallel, 1)) +
                             w.expert / static_cast<LD>(std::max<int64_t>(o.expert_data_parallel, 1))
                       : w.total();
  const bool separate_main = o.dtype != DType::kF32;
  // optim_grads_params: the owned slices of the model parameters (staging slots not counted)
  const LD model = o.training && o.shard_params ? owned : w.total();
  LD bytes = model * static_cast<LD>(dtype_size(o.dtype)) + w.total() * 4 * o.extra_fp32_copies;
  if (o.training) {
    if (separate_main) bytes += owned * (o.store_param_remainders ? 2 : 4);  // main parameters
    bytes += (o.shard_grads ? owned : w.total()) * 4 + owned * 8;  // gradients (staging not counted), Adam moments
  }
  if (bytes <= static_cast<LD>(available)) return;
  std::string sizes = fmt::format("--num-layers {}, --hidden-size {}, --num-attention-heads {}, --ffn-hidden-size {}",
                                  c.num_layers, c.hidden_size, c.num_attention_heads, c.ffn());
  if (c.num_query_groups > 0) sizes += fmt::format(", --num-query-groups {}", c.num_query_groups);
  if (c.kv_channels > 0) sizes += fmt::format(", --kv-channels {}", c.kv_channels);
  sizes += fmt::format(", vocabulary {}", c.vocab_size);
  if (c.position_embedding_type == PositionEmbeddingType::kLearnedAbsolute)
    sizes += fmt::format(", --max-position-embeddings {}", c.max_positions());
  if (c.num_moe_experts > 0)
    sizes += fmt::format(", --num-experts {}, --moe-ffn-hidden-size {}", c.num_moe_experts, c.moe_ffn());
  const std::string per_param = o.training ? "weights, gradients and optimizer state" : "weights";
  MT_FAIL("{} cannot fit: the {} of the model ({}) need at least {:.2f} GiB on {} ({:.4g} billion weights on pipeline "
          "stage {} of {}, {} layers, with tensor-parallel size {}, expert-parallel size {}{}), {:.2f} GiB are "
          "available. Reduce the sizes, or spread the model: a larger --tensor-model-parallel-size or "
          "--pipeline-model-parallel-size{}",
          o.what, per_param, sizes, gib_ld(bytes), where, static_cast<double>(w.total() / 1e9L), w.pp_rank, layout.pp,
          w.layers, tp, ep,
          o.training ? fmt::format(", data-parallel size {}{}", o.data_parallel,
                                   o.distributed_optimizer ? " with the distributed optimizer" : "")
                     : std::string(),
          gib_ld(static_cast<LD>(available)),
          o.training && !o.distributed_optimizer ? ", or --use-distributed-optimizer" : "");
}

void check_inference_memory(const TransformerConfig& config, int tp, DType dtype, Device device, const std::string& what,
                            pipeline::PipelineLayout layout) {
  if (layout.num_layers == 0) layout.num_layers = config.num_layers;
  ConfigMemoryOptions o;
  o.dtype = dtype;
  o.training = false;
  o.what = what;
  check_config_memory(config, tp, 1, layout, o, device);
}

void check_pretrain_memory(const PretrainArgs& args, const ParallelConfig& pc, const pipeline::PipelineLayout& layout,
                           Device device) {
  ConfigMemoryOptions o;
  o.dtype = args.dtype();
  o.distributed_optimizer = args.use_distributed_optimizer;
  o.shard_grads = args.shard_grads();
  o.shard_params = args.shard_params();
  o.store_param_remainders = args.use_precision_aware_optimizer && args.bf16;
  // the trainer shards over dp-cp (one instance of it with --num-distributed-optimizer-instances)
  const int k = args.num_distributed_optimizer_instances;
  o.data_parallel = instance_group_size(pc.dp * pc.cp, k, "dp-cp");
  o.expert_data_parallel = instance_group_size(pc.edp, k, "edp");
  check_config_memory(args.model, pc.tp, pc.ep, layout, o, device);
}

}  // namespace mt
