#include "train/trainer.h"

#include <unistd.h>

#include <csignal>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <future>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>

#include <fmt/ranges.h>

#include "comm/bootstrap.h"
#include "core/cuda_graph.h"
#include "core/host_memory.h"
#include "core/logging.h"
#include "parallel/context_parallel.h"
#include "parallel/process_groups.h"
#include "data/data_args.h"
#include "data/masks.h"
#include "model/gpt_model.h"
#include "model/layer_graphs.h"
#include "model/layers/moe_dispatcher.h"
#include "ops/elementwise.h"
#include "parallel/pipeline/layer_split.h"
#include "parallel/pipeline/schedules.h"
#include "optim/grad_sync.h"
#include "train/checkpoint.h"
#include "train/exit_signal.h"
#include "train/memory_estimate.h"
#include "train/metrics_log.h"
#include "train/pipeline.h"
#include "train/timing_log.h"
#include "train/train_step.h"

namespace mt {

namespace {
std::atomic<bool> g_training_started{false};
}
bool training_started() { return g_training_started.load(); }

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

std::string timestamp() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", std::localtime(&t));
  return buf;
}

// Host-side staging of one iteration's batch. A loader thread fetches the samples of the next
// iteration and builds Megatron's ltor tensors (get_ltor_masks_and_position_ids) into one of two
// pinned host buffers while the device runs the current one; stage() then issues one
// host-to-device copy. Per micro-batch the device buffer holds, each s·b values of 4 bytes:
// tokens [s, b], labels [s, b], loss_mask fp32 [s, b], position_ids [s, b], doc_start [b, s].
// Data-parallel rank d of DP takes, of micro-batch step m, the samples
// [first + (m·DP + d)·b, first + (m·DP + d + 1)·b) (Megatron's MegatronPretrainingSampler).
// The MoE part of the log line (Megatron's track_moe_metrics): the load-balancing loss of each
// type that is on, under Megatron's names (load_balancing_loss, seq_load_balancing_loss,
// global_load_balancing_loss), and the z-loss, averaged over the MoE layers and the iterations since
// the last log line (each the mean over micro-batches and data-parallel ranks, summed over TP × CP;
// global_load_balancing_loss is the mean over micro-batches of the loss of the global micro-batch,
// summed over TP × CP × DP), the tokens routed per expert and
// iteration (min / max / mean over the experts of every MoE layer) and the worst layer's
// imbalance (max / mean over its experts), and per layer with --moe-per-layer-logging.
// Collective over the world; resets the model's statistics.
std::string moe_log(LanguageModel& model, Communicator& world, int64_t iters, bool per_layer, int tp_cp, int ep,
                    const Stream& stream) {
  const TransformerConfig& cfg = model.config();
  const std::vector<double> mine = model.moe_loss_stats(stream);
  const MoeDispatchStats dispatch = model.moe_dispatch_stats(stream);
  model.reset_moe_stats(stream);
  const size_t bytes = mine.size() * sizeof(float);
  const std::vector<float> local(mine.begin(), mine.end());
  const std::vector<char> all = all_gather_host(world, local.data(), bytes, stream);
  std::vector<double> host(mine.size(), 0.0);  // summed over the ranks in rank order
  for (int r = 0; r < world.size(); ++r) {
    const float* row = reinterpret_cast<const float*>(all.data() + static_cast<size_t>(r) * bytes);
    for (size_t i = 0; i < host.size(); ++i) host[i] += row[i];
  }
  const bool z = cfg.moe_z_loss_coeff > 0;
  std::vector<MoeLoadBalancing> lb_types;  // the types on, in the order given
  for (MoeLoadBalancing t : cfg.moe_router_load_balancing_type)
    if (cfg.moe_aux_loss_on(t)) lb_types.push_back(t);
  const int64_t E = cfg.num_moe_experts;
  const size_t per = static_cast<size_t>(kMoeStatLosses + E);
  double lb[kMoeStatZLoss] = {}, zl = 0, lo = std::numeric_limits<double>::infinity(), hi = 0, sum = 0, worst = 0;
  std::string layers;
  const double n = static_cast<double>(std::max<int64_t>(iters, 1));
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    if (!cfg.is_moe_layer(l)) continue;
    const double* v = host.data() + per * static_cast<size_t>(l);
    const double b = v[kMoeStatZLoss] / n;
    for (MoeLoadBalancing t : lb_types) lb[static_cast<int>(t)] += v[static_cast<int>(t)] / n;
    zl += b;
    double lmax = 0, lsum = 0;
    for (int64_t e = 0; e < E; ++e) {
      const double c = v[kMoeStatLosses + e] / tp_cp / n;  // tokens per iteration (each counted over TP × CP)
      lo = std::min(lo, c);
      lmax = std::max(lmax, c);
      lsum += c;
    }
    hi = std::max(hi, lmax);
    sum += lsum;
    const double imbalance = lsum > 0 ? lmax * static_cast<double>(E) / lsum : 0.0;
    worst = std::max(worst, imbalance);
    if (per_layer) {
      for (MoeLoadBalancing t : lb_types)
        layers += fmt::format(" {} layer {}: {:.6E} |", moe_load_balancing_loss_name(t), l, v[static_cast<int>(t)] / n);
      if (z) layers += fmt::format(" z_loss layer {}: {:.6E} |", l, b);
      layers += fmt::format(" expert imbalance layer {}: {:.3f} |", l, imbalance);
    }
  }
  const double L = static_cast<double>(std::max<int64_t>(cfg.num_moe_layers(), 1));
  std::string out;
  for (MoeLoadBalancing t : lb_types)
    out += fmt::format(" {}: {:.6E} |", moe_load_balancing_loss_name(t), lb[static_cast<int>(t)] / L);
  if (z) out += fmt::format(" z_loss: {:.6E} |", zl / L);
  if (sum > 0)
    out += fmt::format(" tokens per expert min/max/mean: {:.0f}/{:.0f}/{:.1f} | expert imbalance: {:.3f} |", lo, hi,
                       sum / (L * static_cast<double>(E)), worst);
  if (cfg.moe_token_dispatcher_type == MoeDispatcher::kAllToAll) {
    // the alltoall dispatcher's counts are known on every rank of an EP group alike: the largest
    // receive over the world; ECHO's rerouted slots summed over the world counts each EP group's
    // total once per member
    const int64_t v[3] = {dispatch.rerouted, dispatch.max_received, dispatch.overflowed};
    const std::vector<char> d = all_gather_host(world, v, sizeof(v), stream);
    int64_t rerouted = 0, received = 0, overflowed = 0;
    for (int r = 0; r < world.size(); ++r) {
      const int64_t* row = reinterpret_cast<const int64_t*>(d.data() + static_cast<size_t>(r) * sizeof(v));
      rerouted += row[0];
      received = std::max(received, row[1]);
      overflowed += row[2];
    }
    if (cfg.moe_received_token_capacity > 0) {  // the static receive blocks: counted drops, per iteration
      out += fmt::format(" tokens overflowed at the received capacity: {:.1f} |", static_cast<double>(overflowed) / n);
    } else {
      out += fmt::format(" max tokens received per EP rank: {} |", received);
    }
    if (cfg.moe_enable_echo && cfg.moe_received_token_capacity == 0)  // counted from the host counts only
      out += fmt::format(" ECHO rerouted tokens per layer: {:.1f} |",
                         static_cast<double>(rerouted) / std::max(ep, 1) / n / L);
  }
  return out + layers;
}

class BatchStager {
 public:
  struct Options {
    int64_t num_micro, micro, seq, dp, dp_rank, vocab;  // seq: the whole sequence
    data::LtorOptions ltor;
    int cp, cp_rank;  // context parallelism: this rank stages its seq / cp tokens
    bool positions, doc_start;  // pass position_ids / doc_start to the model
  };
  /// Bytes of the staged micro-batches on the device (5 int32/fp32 [s/cp, b] tensors each).
  static size_t device_bytes(int64_t num_micro, int64_t micro, int64_t seq, int cp) {
    return static_cast<size_t>(num_micro * 5 * (seq / cp) * micro) * 4;
  }
  BatchStager(const Options& o, Device device) : o_(o), device_(device), dev_(device, bytes()) {
    for (int i = 0; i < 2; ++i) {
      host_[i] = Buffer(Device::cpu(), bytes(), HostMemory::kPinned);
      copied_[i] = std::make_unique<Event>(device);
    }
  }
  ~BatchStager() {
    if (pending_.valid()) pending_.wait();
  }

  // Copies the batch whose first global sample is `first` to the device (prepared by the loader
  // thread when prefetch() asked for it, else now) and prefetches `next_first` (-1: nothing).
  void stage(const data::SampleSource& src, int64_t first, int64_t next_first, const Stream& stream) {
    int k;
    if (pending_.valid() && pending_first_ == first && pending_src_ == &src) {
      k = pending_.get();  // rethrows a data error of the loader thread
    } else {
      if (pending_.valid()) pending_.get();
      k = last_ < 0 ? 0 : last_ ^ 1;
      wait_free(k);
      fill(src, first, k);
    }
    copy_bytes(dev_.data(), device_, host_[k].data(), Device::cpu(), bytes(), stream);
    copied_[k]->record(stream);
    used_[k] = true;
    last_ = k;
    if (next_first >= 0) {
      const int nk = k ^ 1;
      pending_first_ = next_first;
      pending_src_ = &src;
      pending_ = std::async(std::launch::async, [this, &src, next_first, nk] {
        wait_free(nk);  // the copy that last read this buffer (issued one stage ago) is done
        fill(src, next_first, nk);
        return nk;
      });
    }
  }

  MicroBatch micro_batch(int64_t m) const {
    const int64_t sl = o_.seq / o_.cp, sb = sl * o_.micro;
    char* d = static_cast<char*>(dev_.data()) + m * 5 * sb * 4;
    auto t = [&](int i, DType dt, std::vector<int64_t> shape) { return Tensor(d + i * sb * 4, dt, device_, shape); };
    MicroBatch mb;
    mb.tokens = t(0, DType::kI32, {sl, o_.micro});
    mb.labels = t(1, DType::kI32, {sl, o_.micro});
    mb.loss_mask = t(2, DType::kF32, {sl, o_.micro});
    if (o_.positions || o_.cp > 1) mb.position_ids = t(3, DType::kI32, {sl, o_.micro});
    if (o_.doc_start) mb.doc_start = t(4, DType::kI32, {o_.micro, sl});
    // The micro-batch's 1 / unmasked tokens is folded into its staged loss mask (device data, so
    // a captured step reads each step's value); what remains is the same for every step.
    mb.loss_weight = 1.f / static_cast<float>(o_.num_micro * o_.dp);
    mb.aux_loss_weight = 1.f / static_cast<float>(o_.num_micro * o_.dp);
    return mb;
  }

 private:
  size_t bytes() const { return device_bytes(o_.num_micro, o_.micro, o_.seq, o_.cp); }
  void wait_free(int k) {
    if (used_[k]) copied_[k]->synchronize();
  }
  void fill(const data::SampleSource& src, int64_t first, int k) {
    const int64_t S = o_.seq, B = o_.micro, sb = S * B, lsb = sb / o_.cp;
    std::vector<int32_t> samples(static_cast<size_t>(B * (S + 1)));
    std::vector<int32_t> tok(sb), lab(sb), pos(sb), doc(sb), tok_sb(sb), lab_sb(sb), pos_sb(sb);
    std::vector<float> mask(sb), mask_sb(sb);
    char* h = static_cast<char*>(host_[k].data());
    for (int64_t m = 0; m < o_.num_micro; ++m) {
      const int64_t base = first + (m * o_.dp + o_.dp_rank) * B;
      for (int64_t ib = 0; ib < B; ++ib) {
        const int64_t i = (base + ib) % src.size();
        int32_t* smp = samples.data() + ib * (S + 1);
        src.get(i, smp);
        for (int64_t t = 0; t <= S; ++t)
          MT_REQUIRE(smp[t] >= 0 && smp[t] < o_.vocab, "token id {} at position {} of sample {} of {} is outside the "
                     "vocabulary of {} tokens", smp[t], t, i, src.name(), o_.vocab);
      }
      int32_t* dtok = reinterpret_cast<int32_t*>(h + (m * 5 + 0) * lsb * 4);
      int32_t* dlab = reinterpret_cast<int32_t*>(h + (m * 5 + 1) * lsb * 4);
      float* dmask = reinterpret_cast<float*>(h + (m * 5 + 2) * lsb * 4);
      int32_t* dpos = reinterpret_cast<int32_t*>(h + (m * 5 + 3) * lsb * 4);
      int32_t* ddoc = reinterpret_cast<int32_t*>(h + (m * 5 + 4) * lsb * 4);
      data::prepare_ltor_batch(samples.data(), B, S, o_.ltor, tok.data(), lab.data(), mask.data(), pos.data(),
                               doc.data());
      double unmasked = 0;  // over the whole sequences: the loss weight is the one of a single rank
      for (int64_t l = 0; l < sb; ++l) unmasked += mask[l];
      // Megatron's per-micro-batch mean: each unmasked token weighs 1 / unmasked (the staged mask)
      const float w = unmasked > 0 ? static_cast<float>(1.0 / unmasked) : 0.f;
      for (int64_t ib = 0; ib < B; ++ib) {
        for (int64_t is = 0; is < S; ++is) {  // [b, s] -> the model's [s, b]
          tok_sb[is * B + ib] = tok[ib * S + is];
          lab_sb[is * B + ib] = lab[ib * S + is];
          mask_sb[is * B + ib] = mask[ib * S + is] * w;
          pos_sb[is * B + ib] = o_.positions ? pos[ib * S + is] : static_cast<int32_t>(is);
        }
      }
      // This CP rank's tokens (Megatron's get_batch_on_this_cp_rank; the identity for cp = 1).
      cp_shard_rows(dtok, tok_sb.data(), S, B, o_.cp, o_.cp_rank);
      cp_shard_rows(dlab, lab_sb.data(), S, B, o_.cp, o_.cp_rank);
      cp_shard_rows(dmask, mask_sb.data(), S, B, o_.cp, o_.cp_rank);
      cp_shard_rows(dpos, pos_sb.data(), S, B, o_.cp, o_.cp_rank);
      cp_shard_columns(ddoc, doc.data(), B, S, o_.cp, o_.cp_rank);
    }
  }

  Options o_;
  Device device_;
  Buffer host_[2];
  Buffer dev_;
  std::unique_ptr<Event> copied_[2];
  bool used_[2] = {false, false};
  int last_ = -1;
  std::future<int> pending_;
  int64_t pending_first_ = -1;
  const data::SampleSource* pending_src_ = nullptr;
};

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
  same_flag("--untie-embeddings-and-output-weights", yes(ck.untie_embeddings_and_output_weights),
            yes(m.untie_embeddings_and_output_weights));
  // Mixture of experts: the experts and where they sit (the router and expert shapes follow).
  same("--num-experts", ck.num_moe_experts, m.num_moe_experts);
  if (ck.num_moe_experts == 0) return;
  auto pattern = [](const TransformerConfig& c) {
    std::string p = "[";
    for (int64_t l = 0; l < c.num_layers; ++l) p += fmt::format("{}{}", l ? "," : "", c.is_moe_layer(l) ? 1 : 0);
    return p + "]";
  };
  same_flag("--moe-layer-freq", pattern(ck), pattern(m));
  same("--moe-ffn-hidden-size", ck.moe_ffn(), m.moe_ffn());
  same("--moe-shared-expert-intermediate-size", ck.moe_shared_expert_intermediate_size,
       m.moe_shared_expert_intermediate_size);
  same_flag("--moe-shared-expert-gate", yes(ck.moe_shared_expert_gate), yes(m.moe_shared_expert_gate));
}

class ProgressLine {
 public:
  explicit ProgressLine(bool enabled) : enabled_(enabled && isatty(STDERR_FILENO)) {}
  void update(int64_t it, int64_t total) {
    if (!enabled_) return;
    const int width = 30;
    int done = static_cast<int>(width * it / std::max<int64_t>(total, 1));
    std::fprintf(stderr, "\r[%.*s%*s] %lld/%lld", done, "##############################", width - done, "",
                 static_cast<long long>(it), static_cast<long long>(total));
    std::fflush(stderr);
    dirty_ = true;
  }
  void clear() {
    if (enabled_ && dirty_) std::fprintf(stderr, "\r%*s\r", 60, "");
    dirty_ = false;
  }

 private:
  bool enabled_;
  bool dirty_ = false;
};

}  // namespace

int run_pretrain(PretrainArgs args) {
  const LaunchEnv env = read_launch_env();
  Device device = resolve_device(args.device);
  if (device.is_cuda() && env.world_size > 1) device = local_device(DeviceType::kCUDA, env);  // GPU = LOCAL_RANK
  set_current_device(device);
  const std::shared_ptr<Communicator> world = init_world(device, env, args.distributed_timeout_minutes);
  if (world->rank() != 0) set_log_level(LogLevel::kWarn);  // rank 0 logs
  const SaveDirectoryLock save_lock = lock_save_directory(args.save, *world, device);  // one job per --save
  std::optional<CheckpointState> resume;
  if (!args.load.empty()) {
    const bool autoresume = args.load == args.save;
    if (autoresume && !latest_checkpoint_iteration(args.load).has_value()) {
      log_info("> no checkpoint in {} yet (--load == --save): starting from scratch", args.load);
    } else {
      resume = read_checkpoint_state(args.load, {args.fallback_to_previous_checkpoint, std::nullopt});
    }
  }
  if (resume && args.use_checkpoint_args) {  // the architecture of the checkpoint (Megatron's --use-checkpoint-args)
    TransformerConfig m = resume->model;
    m.seq_length = args.model.seq_length;  // training choices stay the command line's
    m.hidden_dropout = args.model.hidden_dropout;
    m.attention_dropout = args.model.attention_dropout;
    m.init_method_std = args.model.init_method_std;
    m.make_vocab_size_divisible_by = args.model.make_vocab_size_divisible_by;
    args.model = m;
    args.group_query_attention = m.num_query_groups > 0;
  }
  ParallelConfig pc;
  pc.tp = args.tensor_model_parallel_size;
  pc.pp = args.pipeline_model_parallel_size;
  pc.ep = args.expert_model_parallel_size;
  pc.etp = args.expert_tensor_parallel_size;
  pc.cp = args.context_parallel_size;
  pipeline::PipelineLayout layout;
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
  validate_and_derive(pc, world->size());
  pipeline::validate_pipeline_layout(layout);
  args.data_parallel_size = pc.dp;
  args.expert_data_parallel_size = pc.edp;
  MT_REQUIRE(device.is_cuda() || args.dtype() == DType::kF32,
             "--{} needs a CUDA device; the CPU backend trains in fp32", args.bf16 ? "bf16" : "fp16");

  const std::unique_ptr<data::Tokenizer> tokenizer = data::build_tokenizer(args.data);
  args.model.vocab_size = tokenizer->vocab_size();

  if (resume) {
    // A model may have more embedding rows than its tokenizer has tokens (Hugging Face models).
    MT_REQUIRE(resume->model.vocab_size >= args.model.vocab_size,
               "checkpoint '{}' has a vocabulary of {} tokens but the tokenizer has {}", args.load,
               resume->model.vocab_size, args.model.vocab_size);
    args.model.vocab_size = resume->model.vocab_size;
  }
  check_pretrain_memory(args, pc, layout, device);  // absurd sizes: from the configuration, before anything is built
  validate_pretrain_args(args);
  GPTModel::validate_context_parallel(args.model, pc.cp, pc.tp);  // before any communication
  const int64_t M = args.num_microbatches();
  pipeline::ScheduleConfig sched_cfg;
  sched_cfg.pp = pc.pp;
  sched_cfg.vpp = pc.vpp;
  sched_cfg.num_microbatches = static_cast<int>(M);
  sched_cfg.microbatch_group_size = args.microbatch_group_size_per_vp_stage;
  pipeline::validate_schedule_config(sched_cfg);  // a mismatched layout fails before any collective
  if (resume) check_resume_config(resume->model, args.model);
  if (!args.save.empty() && world->rank() == 0) {  // fail early on an unwritable --save
    std::error_code ec;
    std::filesystem::create_directories(args.save, ec);
    const auto probe = std::filesystem::path(args.save) / ".write_test";
    std::FILE* f = ec ? nullptr : std::fopen(probe.c_str(), "w");
    MT_REQUIRE(f != nullptr, "--save directory '{}' is not writable{}", args.save,
               ec ? ": " + ec.message() : std::string());
    std::fclose(f);
    std::filesystem::remove(probe, ec);
    for (const auto& name : clean_interrupted_saves(args.save))
      log_info("> removed what an interrupted checkpoint save left in {}: {}", args.save, name);
  }

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
  // Megatron's GPTDataset / BlendedDataset / MockGPTDataset with the sample counts Megatron asks
  // for. With --data-cache-path, rank 0 builds the index files and the other ranks then read them.
  const auto counts = data::train_valid_test_num_samples(args.train_iters, args.global_batch_size, args.eval_interval,
                                                         args.eval_iters);
  data::DataSplits data;
  for (int pass = 0; pass < 2; ++pass) {
    if ((pass == 0) == (world->rank() == 0))
      data = data::build_gpt_datasets(args.data, args.model.seq_length, args.seed, counts[0], counts[1], counts[2],
                                      *tokenizer);
    if (pass == 0) world->barrier();
  }
  MT_REQUIRE(data.train && data.train->size() > 0, "the training split is empty");
  log_info("> datasets: train {}; valid {}", data.train->name(), data.valid ? data.valid->name() : "none");
  if (data.valid && data.valid->size() == 0) data.valid.reset();
  Stream stream(device);
  const ProcessGroups groups = build_process_groups(world, pc);
  if (world->size() > 1) log_info("{}", layout_table(pc));
  const int dp_rank = groups.dp->rank();
  const int pp_rank = groups.pp->rank();
  // The pipeline schedule of this rank (no pipelining when pp == 1) for training and for
  // evaluation (forward only), and the model chunks and buffers they need.
  const std::vector<pipeline::LayerRange> chunks = pipeline::layers_of(pp_rank, layout);
  const PipelinePlan train_plan = plan_pipeline(sched_cfg, pp_rank, chunks);
  sched_cfg.forward_only = true;
  const PipelinePlan eval_plan = plan_pipeline(sched_cfg, pp_rank, chunks);
  // Parameter gradients are reduced (and the distributed optimizer sharded) over dp-cp (Megatron).
  ParamLayout param_layout = args.param_layout();
  param_layout.data_parallel_size = groups.dp_cp->size();
  // The memory estimate, before anything large is allocated (train/memory_estimate.h).
  const ModelLayout layout_needed = model_layout(chunks, {&train_plan, &eval_plan});
  MemoryEstimateInputs mem_in;
  mem_in.model = GPTModel::memory_plan(args.model, args.micro_batch_size, args.dtype(), device, groups,
                                       args.sequence_parallel, param_layout, layout_needed);
  mem_in.dtype = args.dtype();
  mem_in.distributed_optimizer = args.use_distributed_optimizer;
  mem_in.store_param_remainders = args.optim.store_param_remainders;
  mem_in.data_parallel = groups.dp_cp->size();
  mem_in.expert_data_parallel = groups.edp->size();
  mem_in.grad_reduce_in_bf16 = args.grad_reduce_in_bf16 && (groups.dp_cp->size() > 1 || groups.edp->size() > 1);
  mem_in.pipeline_grad_bytes = static_cast<size_t>(std::max(train_plan.grad_buffers, eval_plan.grad_buffers)) *
                               mem_in.model.boundary_bytes;
  mem_in.batch_bytes = BatchStager::device_bytes(M, args.micro_batch_size, args.model.seq_length, pc.cp);
  const MemoryEstimate mem_estimate = estimate_training_memory(mem_in);
  const size_t in_use_before = device_memory_in_use(device);  // CUDA context, libraries, other processes
  log_info("> memory estimate per rank: {}", mem_estimate.summary());
  if (device.is_cuda()) {
    // the free memory now, less 32 MiB per stream of cuBLASLt workspace still to come
    const size_t free_now = device_memory_free(device);
    check_memory_fits(mem_estimate, free_now, size_t{64} << 20, device.str());
  } else if (const uint64_t avail = available_host_memory_bytes(); avail > 0) {  // 0: unknown
    check_memory_fits(mem_estimate, avail, 0, "the host (CPU training)");
  }
  GPTModel model(args.model, args.micro_batch_size, args.dtype(), device, groups, args.sequence_parallel,
                 param_layout, layout_needed);
  PipelineExecutor executor(model, groups.pp, {&train_plan, &eval_plan});
  const auto& cfg = model.config();
  log_info("> model: GPT {}, {} attention, seq {}, vocab {} (padded {}), {:.2f}M parameters, {} on {}; activations "
           "{:.1f} MiB",
           cfg.summary(), model.attention_backend(), cfg.seq_length, cfg.vocab_size, model.padded_vocab(),
           model.params().num_parameters() / 1e6, dtype_name(args.dtype()), device.str(),
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
    for (const auto& r : chunks) stages += fmt::format(" [{}, {})", r.begin, r.end);
    log_info("> pipeline: {} stages{}, {} schedule, {} micro-batches; rank 0 holds layers{}, {} activation slots "
             "(theoretical bubble {:.1f}%)",
             pc.pp * pc.num_chunks(), pc.vpp > 1 ? fmt::format(" ({} per rank)", pc.vpp) : "",
             pc.vpp > 1 ? "interleaved 1F1B" : "1F1B", M, stages, train_plan.activation_slots,
             100.0 * pipeline::bubble_fraction(pc.pp, pc.vpp, static_cast<int>(M)));
  }
  // Data-parallel gradient buckets (reduced as the backward finishes them with
  // --overlap-grad-reduce) and the optimizer over this rank's owned elements.
  GradSync grad_sync(model.params(), groups.dp_cp, args.ddp_config(), groups.edp);
  AdamWOptimizer optimizer(grad_sync, args.optim, stream,
                           {nullptr, groups.mp, groups.tp->rank(), false, groups.etp_ep_pp});
  model.set_hooks(&grad_sync);
  if (args.ddp_copy_engine && groups.dp->size() > 1)
    log_info("> data-parallel collectives: {}", grad_sync.copy_engine_active()
                                                   ? std::string("copy engine for the collectives that overlap "
                                                                 "compute, NCCL for the others (--ddp-copy-engine)")
                                                   : "the DP communicator's (copy engine unavailable: " +
                                                         grad_sync.why_not_copy_engine() + ")");
  if (args.grad_reduce_in_bf16 && groups.dp->size() > 1)
    log_info("> data-parallel gradient reduction in bf16 (--grad-reduce-in-bf16)");
  if (args.optim.store_param_remainders)
    log_info("> fp32 main parameters stored as bf16 parameters + int16 remainders (--use-precision-aware-optimizer): "
             "{:.3f} GiB on this rank",
             static_cast<double>(model.params().main_storage_bytes()) / (1024.0 * 1024.0 * 1024.0));
  if (model.params().buckets().size() > 1)
    log_info("> data-parallel gradient buckets: {} (--ddp-bucket-size {}), overlap grad reduce {}, param gather {}",
             model.params().buckets().size(), model.params().layout().bucket_size, args.overlap_grad_reduce,
             args.overlap_param_gather);

  int64_t iteration = 0, consumed = 0;
  if (resume) {
    const bool weights_only = args.finetune || args.no_load_optim;
    MT_REQUIRE(weights_only || resume->has_optimizer,
               "checkpoint '{}' holds no optimizer state (written by import-hf?): add --finetune (weights only, "
               "iteration 0) or --no-load-optim",
               args.load);
    const auto t_load = std::chrono::steady_clock::now();
    // The expert bias (persistent_state) is model state: loaded for --finetune / --no-load-optim too.
    CheckpointState st = load_checkpoint(args.load, model.params(), weights_only ? nullptr : &optimizer, stream,
                                         {false, resume->iteration}, model.persistent_state(stream));
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
    const double load_gb = static_cast<double>(checkpoint_bytes(args.load, st.iteration)) / 1e9;
    log_info("> checkpoint read and verified: {:.3f} GB in {:.2f} s ({:.2f} GB/s; this rank's share of the files)",
             load_gb, load_s, load_gb / std::max(load_s, 1e-9));
    if (args.finetune) {
      log_info("> loaded the weights of {} (iteration {}) for finetuning: starting at iteration 0", args.load,
               st.iteration);
    } else {
      iteration = st.iteration;
      consumed = st.consumed_train_samples;
      MT_REQUIRE(st.seed == args.seed || args.no_load_rng,
                 "checkpoint was trained with --seed {} but --seed {} was given (add --no-load-rng to continue with "
                 "the new seed)", st.seed, args.seed);
      if (st.seed != args.seed) log_info("> --no-load-rng: continuing with --seed {} (checkpoint: {})", args.seed, st.seed);
      log_info("> loaded checkpoint from {} at iteration {} ({} samples consumed)", args.load, iteration, consumed);
    }
  } else {
    model.params().initialize(args.seed, stream);
  }

  const LrScheduleConfig sched = args.lr_schedule();

  // Per-iteration losses of the current log interval live on the device; read at log time.
  Buffer losses_dev(device, static_cast<size_t>(args.log_interval) * 4);
  Tensor losses = losses_dev.as(DType::kF32, {args.log_interval});
  fill(losses, 0.f, stream);
  // Per-iteration found_inf of the optimizer (non-finite gradient), for --check-for-nan-in-loss-and-grad.
  Buffer found_inf_dev(device, static_cast<size_t>(args.log_interval) * 4);
  Tensor found_inf = found_inf_dev.as(DType::kI32, {args.log_interval});
  fill(found_inf, 0.f, stream);
  const bool dynamic_scaling = args.optim.scaler.dynamic;  // fp16: overflowed steps are skipped, not errors
  std::optional<MetricsLog> metrics;
  if (world->rank() == 0 && (!args.tensorboard_dir.empty() || !args.metrics_file.empty()))
    metrics.emplace(MetricsLogOptions{args.tensorboard_dir, args.tensorboard_log_interval,
                                      args.log_timers_to_tensorboard, args.log_memory_to_tensorboard,
                                      args.log_validation_ppl_to_tensorboard, args.log_loss_scale_to_tensorboard,
                                      args.metrics_file});
  std::optional<ExitSignalHandler> signal_handler;
  if (args.exit_signal_handler) signal_handler.emplace();
  const auto train_start = std::chrono::steady_clock::now();
  Timers timers(args.timing_log_level, device);  // --timing-log-level, reported at log intervals
  const TimingLogOption timing_option = parse_timing_log_option(args.timing_log_option);
  Buffer eval_loss_dev(device, 4);
  Tensor eval_loss = eval_loss_dev.as(DType::kF32, {1});
  // The iteration and the learning rate, read by the kernels from device memory (principle 8).
  StepValues step_values(device);
  StepValues eval_values(device);  // the validation forward's iteration (its graph replays it)
  // CUDA graphs (--cuda-graph-impl, docs/cuda_graphs.md): after the warmup steps the training step
  // (and the validation forward) is captured once and replayed. Its loss goes to a fixed slot.
  const CudaGraphOptions& cg = args.cuda_graph;
  MT_REQUIRE(!cg.enabled() || device.is_cuda(), "--cuda-graph-impl {} needs a CUDA device; this run is on {}",
             cg.impl, device.str());
  CudaGraph train_graph, eval_graph;
  // Per-layer capture (--cuda-graph-impl local with attn / mlp / moe / moe_router / moe_preprocess):
  // the layers' scoped regions, one graph per (layer, region, slot), captured on first use after
  // the warm-up.
  LayerGraphs layer_graphs(cg.captures("attn"), cg.captures("mlp"), cg.captures("moe"), cg.captures("moe_router"),
                           cg.captures("moe_preprocess"));
  // What a moe_preprocess graph holds (named in the summary line, as the scopes are).
  std::string preprocess_region;
  if (cfg.num_moe_experts > 0 && cg.per_layer() && !cg.scope.empty() && cg.captures("moe_preprocess"))
    preprocess_region = fmt::format(
        " (moe_preprocess: {})",
        moe_preprocess_region(cfg.moe_token_dispatcher_type,
                              {.num_echo = cfg.moe_enable_echo ? cfg.moe_num_echo_experts : 0,
                               .received_capacity = cfg.moe_received_token_capacity}));
  if (cg.per_layer()) {
    model.set_layer_graphs(&layer_graphs);
    executor.use_slot_keys();
  }
  size_t layer_graphs_logged = 0;
  Buffer step_loss_dev(device, 4);
  const Tensor step_loss = step_loss_dev.as(DType::kF32, {1});
  int64_t steps_run = 0;  // training steps of this process (the warmup counts them)
  double host_issue_ms = 0;  // host time spent issuing the steps since the last log line
  data::LtorOptions ltor;
  ltor.eod = tokenizer->eod();
  ltor.reset_position_ids = args.data.reset_position_ids;
  ltor.reset_attention_mask = args.data.reset_attention_mask;
  ltor.eod_mask_loss = args.data.eod_mask_loss;
  BatchStager stager({M, args.micro_batch_size, cfg.seq_length, pc.dp, dp_rank, cfg.vocab_size, ltor, pc.cp,
                      groups.cp->rank(), args.data.reset_position_ids, args.data.reset_attention_mask},
                     device);

  AsyncCheckpointSaver async_saver;
  // --async-save on a GPU: the last snapshot's copy, waited for by the next step before its update.
  const Event* snapshot_pending = nullptr;
  const CheckpointWriter writer{.world = world,
                                .dp_rank = groups.dp_cp->rank(),
                                .tp_rank = groups.tp->rank(),
                                .edp_rank = groups.edp->rank(),
                                .save_optim = !args.no_save_optim,
                                .timeout_s = args.distributed_timeout_minutes * 60,
                                .tp = pc.tp,
                                .pp = pc.pp,
                                .dp = pc.dp,
                                .ep = pc.ep,
                                .etp = pc.etp};
  // The snapshot's pinned host memory (and copy stream) now, not inside the first save's step.
  if (args.async_save) async_saver.allocate(model.params(), &optimizer, writer, stream, model.persistent_state(stream));
  auto save = [&](int64_t it) {
    CheckpointState st{!args.no_save_optim, it, consumed, args.seed, cfg, optimizer.read_scalars_sync(stream)};
    const auto t0 = std::chrono::steady_clock::now();
    auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
    if (args.async_save) {
      const bool previous = async_saver.in_flight();
      async_saver.save(args.save, st, model.params(), &optimizer, writer, stream, model.persistent_state(stream));
      snapshot_pending = async_saver.snapshot_copied();
      log_info("  checkpoint at iteration {:7d}: snapshot taken in {:.2f} s{}, being written to {} (--async-save)", it,
               seconds(), previous ? " (incl. waiting for the previous save)" : "", args.save);
    } else {
      save_checkpoint(args.save, st, model.params(), &optimizer, writer, stream, model.persistent_state(stream));
      const double s = seconds(), gb = static_cast<double>(checkpoint_bytes(args.save, it)) / 1e9;
      log_info("  successfully saved checkpoint at iteration {:7d} to {} ({:.3f} GB in {:.2f} s: {:.2f} GB/s)", it,
               args.save, gb, s, gb / std::max(s, 1e-9));
    }
  };
  // --check-for-nan-in-loss-and-grad: the iterations since the last log line (their losses and
  // found_inf still on the device) are checked on every rank; all ranks stop together.
  auto check_nan = [&](int64_t it_now, int64_t n) {
    if (!args.check_for_nan_in_loss_and_grad || n == 0) return;
    std::vector<float> l(static_cast<size_t>(n));
    std::vector<int32_t> inf(static_cast<size_t>(n));
    copy_bytes(l.data(), Device::cpu(), losses.data(), device, l.size() * 4, stream);
    copy_bytes(inf.data(), Device::cpu(), found_inf.data(), device, inf.size() * 4, stream);
    stream.synchronize();
    int64_t bad[2] = {-1, 0};  // first bad iteration, what (1 loss, 2 gradient)
    for (int64_t i = 0; i < n && bad[0] < 0; ++i) {
      if (!std::isfinite(l[i])) bad[0] = it_now - n + 1 + i, bad[1] = 1;
      else if (inf[i] != 0 && !dynamic_scaling) bad[0] = it_now - n + 1 + i, bad[1] = 2;
    }
    const std::vector<char> all = all_gather_host(*world, bad, sizeof(bad), stream);
    for (int r = 0; r < world->size(); ++r) {
      int64_t b[2];
      std::memcpy(b, all.data() + r * sizeof(bad), sizeof(bad));
      if (b[0] >= 0 && (bad[0] < 0 || b[0] < bad[0])) bad[0] = b[0], bad[1] = b[1];
    }
    MT_REQUIRE(bad[0] < 0,
               "iteration {}: the {} is NaN or Inf; stopping before anything more is saved "
               "(--check-for-nan-in-loss-and-grad; learning rate there {:.3E}: is --lr {} too high?). "
               "--no-check-for-nan-in-loss-and-grad skips such iterations instead",
               bad[0], bad[1] == 1 ? "loss" : "gradient norm", learning_rate(sched, bad[0] - 1), args.lr);
  };

  auto evaluate = [&](int64_t it) -> std::optional<EvalResult> {
    if (!data.valid || args.eval_iters == 0) return std::nullopt;  // Megatron: no validation
    grad_sync.finish_param_sync(stream);  // the last step's parameter all-gather is complete
    fill(eval_loss, 0.f, stream);
    eval_values.write(it, 0.f, stream);  // e.g. --moe-router-force-load-balancing keys by it
    for (int64_t e = 0; e < args.eval_iters; ++e) {
      stager.stage(*data.valid, e * args.global_batch_size, -1, stream);
      std::vector<MicroBatch> mbs;
      for (int64_t m = 0; m < M; ++m) mbs.push_back(stager.micro_batch(m));
      auto forward = [&] {
        const RunContext rc{args.seed, it, dp_rank, static_cast<int>(pc.dp), false, eval_values.iteration()};
        executor.run(eval_plan, mbs, rc, eval_loss, 1.f / static_cast<float>(args.eval_iters), Tensor(), stream);
      };
      if (!cg.full_iteration() || steps_run < cg.warmup_steps) {
        forward();
        continue;
      }
      if (!eval_graph.captured()) {
        eval_graph.capture(stream, forward);
        log_info("> CUDA graph: the validation forward captured ({} nodes)", eval_graph.num_nodes());
      }
      eval_graph.launch(stream);
    }
    // The loss lives on the last pipeline stage; sum over DP and CP, then over PP (other stages add 0).
    groups.dp_cp->all_reduce(eval_loss, ReduceOp::kSum, stream);
    groups.pp->all_reduce(eval_loss, ReduceOp::kSum, stream);
    float host = 0;
    copy_bytes(&host, Device::cpu(), eval_loss.data(), device, 4, stream);
    stream.synchronize();
    EvalResult r{host, std::exp(std::min<double>(host, 20.0))};
    if (metrics) metrics->validation(it, consumed, r.loss, r.ppl);
    std::string line = fmt::format(" validation loss at iteration {} | lm loss value: {:.6E} | lm loss PPL: {:.6E} | ",
                                   it, r.loss, r.ppl);
    std::string bar(line.size(), '-');
    log_info("{}\n{}\n{}", bar, line, bar);
    return r;
  };

  log_info("> training {} iterations from iteration {}: global batch {} = {} micro-batches of {}, seq {}", 
           args.train_iters, iteration, args.global_batch_size, M, args.micro_batch_size, cfg.seq_length);
  ProgressLine progress(args.progress);
  OptimizerScalars last = optimizer.read_scalars_sync(stream);
  int64_t last_skipped = last.skipped_iters;
  auto t_last = std::chrono::steady_clock::now();
  int64_t iters_since_log = 0;
  const double flops_iter = cfg.flops_per_iteration(args.global_batch_size);

  // Validation before the first iteration of a fresh run gives the starting point of the curve.
  if ((!resume || args.finetune) && data.valid) evaluate(0);
  t_last = std::chrono::steady_clock::now();
  const auto loop_start = t_last;
  const int64_t loop_first_iteration = iteration;
  g_training_started.store(true);
  while (iteration < args.train_iters) {
    const float lr = static_cast<float>(learning_rate(sched, iteration));
    stager.stage(*data.train, consumed,
                 iteration + 1 < args.train_iters ? consumed + args.global_batch_size : -1, stream);
    std::vector<MicroBatch> mbs;
    for (int64_t m = 0; m < M; ++m) mbs.push_back(stager.micro_batch(m));
    const auto host_t0 = std::chrono::steady_clock::now();  // the host's time to issue the step
    step_values.write(iteration, lr, stream);
    StepOptions so{args.seed, iteration, lr, dp_rank, static_cast<int>(pc.dp), cg.enabled() ? nullptr : &timers,
                   &step_values};
    // An --async-save snapshot still being copied: the step's update waits for it on the device
    // (a captured full-iteration step cannot: the graph launch waits, below).
    if (!cg.full_iteration()) so.wait_before_update = snapshot_pending;
    const Tensor loss_slot = losses.flat_range(iters_since_log, 1);
    if (!cg.full_iteration()) {
      if (cg.per_layer() && steps_run >= cg.warmup_steps) layer_graphs.set_capturing(true);
      const size_t before = cg.per_layer() ? device_memory_in_use(device) : 0;
      train_step(model, executor, train_plan, optimizer, mbs, so, loss_slot, stream);
      if (layer_graphs.graphs() > layer_graphs_logged) {  // a step captured new per-layer graphs
        log_info("> CUDA graph (per layer, scopes {}{}): {} graphs ({} nodes) over {} activation slots (the static "
                 "buffer sets; the pipeline schedule's in-flight bound); graph memory {:.1f} MiB (device memory "
                 "in use before and after the capturing step)",
                 cg.scope.empty() ? std::string("attn mlp moe") : fmt::format("{}", fmt::join(cg.scope, " ")),
                 preprocess_region, layer_graphs.graphs(), layer_graphs.nodes(), train_plan.activation_slots,
                 (static_cast<double>(device_memory_in_use(device)) - static_cast<double>(before)) / 1048576.0);
        layer_graphs_logged = layer_graphs.graphs();
      }
    } else {
      if (snapshot_pending) snapshot_pending->wait(stream);
      fill(step_loss, 0.f, stream);
      auto body = [&] {
        if (cg.include_optimizer) {
          train_step(model, executor, train_plan, optimizer, mbs, so, step_loss, stream);
        } else {
          forward_backward_step(model, executor, train_plan, optimizer, mbs, so, step_loss, stream);
        }
      };
      if (steps_run >= cg.warmup_steps && !train_graph.captured()) {
        const uint64_t allocs = buffer_allocation_count(), syncs = host_sync_count();
        train_graph.capture(stream, body);
        MT_CHECK(buffer_allocation_count() == allocs && host_sync_count() == syncs,
                 "the captured training step allocated ({}) or synchronised ({})", buffer_allocation_count() - allocs,
                 host_sync_count() - syncs);
        log_info("> CUDA graph: training step{} captured after {} warmup steps ({} nodes; no memory of its own: "
                 "it replays on the model's static buffers)",
                 cg.include_optimizer ? " with the optimizer" : "", steps_run, train_graph.num_nodes());
      }
      if (train_graph.captured()) {
        train_graph.launch(stream);
      } else {
        body();
      }
      if (!cg.include_optimizer) optimizer.step(lr, stream, nullptr, step_values.lr());
      add(loss_slot, loss_slot, step_loss, stream);
    }
    host_issue_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_t0).count();
    snapshot_pending = nullptr;
    ++steps_run;
    copy_bytes(found_inf.flat_range(iters_since_log, 1).data(), device,
               static_cast<const char*>(optimizer.scalars().data()) + offsetof(OptimizerScalars, found_inf), device, 4,
               stream);
    ++iteration;
    ++iters_since_log;
    consumed += args.global_batch_size;
    progress.update(iteration, args.train_iters);

    if (iteration % args.log_interval == 0 || iteration == args.train_iters) {
      check_nan(iteration, iters_since_log);
      std::vector<float> host(static_cast<size_t>(iters_since_log));
      groups.dp_cp->all_reduce(losses, ReduceOp::kSum, stream);
      groups.pp->all_reduce(losses, ReduceOp::kSum, stream);  // only the last stage has a loss
      copy_bytes(host.data(), Device::cpu(), losses.data(), device, host.size() * 4, stream);
      const OptimizerScalars sc = optimizer.read_scalars_sync(stream);  // synchronizes
      const auto now = std::chrono::steady_clock::now();
      const double ms = std::chrono::duration<double, std::milli>(now - t_last).count() / iters_since_log;
      double loss_sum = 0;
      int64_t n_ok = 0, n_nan = 0;
      for (float l : host) {
        if (std::isfinite(l)) {
          loss_sum += l;
          ++n_ok;
        } else {
          ++n_nan;
        }
      }
      const double tokens_per_s = args.global_batch_size * cfg.seq_length / (ms / 1e3);
      const double tflops = flops_iter / (ms / 1e3) / 1e12 / world->size();  // per GPU
      progress.clear();
      std::string line = fmt::format(
          " [{}] iteration {:8d}/{:8d} | consumed samples: {:12d} | elapsed time per iteration (ms): {:.1f} | "
          "throughput per GPU (TFLOP/s/GPU): {:.1f} | tokens per second: {:.0f} | learning rate: {:.6E} | "
          "global batch size: {:5d} | lm loss: {:.6E} | loss scale: {:.1f} | grad norm: {:.3f} | "
          "number of skipped iterations: {:3d} | number of nan iterations: {:3d} | host time per iteration (ms): "
          "{:.2f} |",
          timestamp(), iteration, args.train_iters, consumed, ms, tflops, tokens_per_s, lr, args.global_batch_size,
          n_ok ? loss_sum / n_ok : NAN, sc.loss_scale, sc.grad_norm, sc.skipped_iters - last_skipped, n_nan,
          host_issue_ms / static_cast<double>(iters_since_log));
      if (cfg.num_moe_experts > 0) line += moe_log(model, *world, iters_since_log, args.moe_per_layer_logging,
                                                 args.tensor_model_parallel_size * args.context_parallel_size,
                                                 args.expert_model_parallel_size,
                                                 stream);
      log_info("{}", line);
      std::vector<std::pair<std::string, float>> timer_max;
      const std::string timing = timing_report(timers, timing_option, *world, stream, iters_since_log, &timer_max);
      if (!timing.empty()) log_info("{}", timing);
      if (metrics) {
        for (int64_t i = 0; i < iters_since_log; ++i) {
          const int64_t k = iteration - iters_since_log + 1 + i;
          metrics->iteration_loss(k, consumed - (iteration - k) * args.global_batch_size, host[i],
                                  learning_rate(sched, k - 1), args.global_batch_size);
        }
        TrainLogPoint p;
        p.iteration = iteration;
        p.consumed_samples = consumed;
        p.lm_loss = n_ok ? loss_sum / n_ok : NAN;
        p.learning_rate = lr;
        p.batch_size = args.global_batch_size;
        p.grad_norm = sc.grad_norm;
        p.loss_scale = sc.loss_scale;
        p.world_size = world->size();
        p.iteration_time_s = ms / 1e3;
        p.tflops_per_gpu = tflops;
        p.tokens_per_s = tokens_per_s;
        p.skipped_iterations = sc.skipped_iters - last_skipped;
        p.nan_iterations = n_nan;
        p.mem_allocated_bytes = static_cast<double>(device_bytes_allocated(device));
        if (device.is_cuda()) p.mem_reserved_bytes = static_cast<double>(device_memory_in_use(device));
        p.timers_max_ms = timer_max;
        metrics->train_point(p);
      }
      last_skipped = sc.skipped_iters;
      iters_since_log = 0;
      host_issue_ms = 0;
      fill(losses, 0.f, stream);
      fill(found_inf, 0.f, stream);
      t_last = std::chrono::steady_clock::now();
    }
    bool timing_reset = false;
    if (iteration % args.eval_interval == 0 || iteration == args.train_iters) {
      progress.clear();
      evaluate(iteration);
      timing_reset = true;
    }
    bool exiting = args.exit_interval > 0 && iteration % args.exit_interval == 0;
    std::string exit_reason = exiting ? fmt::format("--exit-interval {}", args.exit_interval) : "";
    if (signal_handler || args.exit_duration_in_mins > 0) {  // Megatron: every iteration, agreed by all ranks
      const double minutes =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - train_start).count() / 60.0;
      int32_t mine[2] = {signal_handler ? ExitSignalHandler::received() : 0,
                         args.exit_duration_in_mins > 0 && minutes > args.exit_duration_in_mins ? 1 : 0};
      if (world->size() > 1) {
        const std::vector<char> all = all_gather_host(*world, mine, sizeof(mine), stream);
        for (int r = 0; r < world->size(); ++r) {
          int32_t v[2];
          std::memcpy(v, all.data() + r * sizeof(mine), sizeof(mine));
          mine[0] = std::max(mine[0], v[0]);
          mine[1] = std::max(mine[1], v[1]);
        }
      }
      if (mine[0] != 0) {
        exiting = true;
        exit_reason = fmt::format("received signal {} (--exit-signal-handler)",
                                  mine[0] == SIGTERM ? "SIGTERM" : mine[0] == SIGINT ? "SIGINT" : "SIGUSR1");
      } else if (mine[1] != 0) {
        exiting = true;
        exit_reason = fmt::format("--exit-duration-in-mins {} reached", args.exit_duration_in_mins);
      }
    }
    if (!args.save.empty() && ((args.save_interval > 0 && iteration % args.save_interval == 0) ||
                               iteration == args.train_iters || exiting)) {
      progress.clear();
      check_nan(iteration, iters_since_log);  // never save what a NaN produced
      save(iteration);
      timing_reset = true;
    }
    if (timing_reset) t_last = std::chrono::steady_clock::now();
    if (exiting && iteration < args.train_iters) {
      log_info("exiting program at iteration {} ({})", iteration, exit_reason);
      break;
    }
  }
  {
    // The whole loop's time per iteration, everything included (logging, validation, checkpoints
    // and their effect on the steps; not the wait for the last --async-save below): what
    // bench/checkpoint_bench.sh compares with and without saving.
    stream.synchronize();
    const int64_t n = iteration - loop_first_iteration;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - loop_start).count();
    if (n > 0)
      log_info("> training loop: {} iterations in {:.3f} s: {:.2f} ms per iteration (logging, validation and "
               "checkpoints included)", n, s, 1e3 * s / static_cast<double>(n));
  }
  if (async_saver.in_flight()) {
    async_saver.wait();  // the last checkpoint is complete (and published by rank 0) before exit
    const double gb = static_cast<double>(checkpoint_bytes(args.save, iteration)) / 1e9;
    log_info("  successfully saved checkpoint at iteration {:7d} to {} (--async-save; {:.3f} GB written in the "
             "background in {:.2f} s: {:.2f} GB/s)", iteration, args.save, gb, async_saver.last_write_seconds(),
             gb / std::max(async_saver.last_write_seconds(), 1e-9));
    if (async_saver.last_copy_ms() >= 0)
      log_info("  its snapshot: device-to-host copy into pinned memory in {:.1f} ms on the GPU, beside the next "
               "step's forward and backward", async_saver.last_copy_ms());
  }
  world->barrier();
  if (metrics) metrics->flush();
  progress.clear();
  stream.synchronize();
  {
    // the buffers the estimate covers: on the CPU the host's pinned staging buffers (two batches)
    // count too
    const double est = static_cast<double>(mem_estimate.total()),
                 got = static_cast<double>(device_bytes_allocated(device) -
                                           (device.is_cuda() ? 0 : 2 * mem_in.batch_bytes));
    log_info("> memory estimate {:.1f} MiB of buffers, {:+.1f}% from the {:.1f} MiB allocated", est / 1048576.0,
             100.0 * (est - got) / std::max(got, 1.0), got / 1048576.0);
  }
  if (device.is_cuda()) {
    log_info("> device memory: {:.1f} MiB in megatron.cpp buffers (static: allocated once, so also the peak), "
             "{:.1f} MiB in use on {} (cudaMemGetInfo, includes the CUDA context and cuBLAS)",
             device_bytes_allocated(device) / 1048576.0, device_memory_in_use(device) / 1048576.0, device.str());
    log_info("> memory estimate: {:.1f} MiB in use expected (the {:.1f} MiB in use before the model + the buffers' "
             "estimate)", (static_cast<double>(mem_estimate.total()) + static_cast<double>(in_use_before)) / 1048576.0,
             in_use_before / 1048576.0);
    if (world->size() > 1) {  // per rank (pipeline stages differ), gathered to rank 0
      const int n = world->size();
      const float mine[2] = {static_cast<float>(device_bytes_allocated(device) / 1048576.0),
                             static_cast<float>(device_memory_in_use(device) / 1048576.0)};
      const std::vector<char> gathered = all_gather_host(*world, mine, sizeof(mine), stream);
      std::vector<float> host(static_cast<size_t>(2 * n));
      std::memcpy(host.data(), gathered.data(), gathered.size());
      std::string per_rank;
      for (int r = 0; r < n; ++r)
        per_rank += fmt::format(" r{}: {:.0f}/{:.0f}", r, host[2 * r], host[2 * r + 1]);
      log_info("> device memory per rank (MiB, buffers/in use; pipeline stage = rank / (tp·dp) in the "
               "default order):{}", per_rank);
    }
  }
  return 0;
}

}  // namespace mt
