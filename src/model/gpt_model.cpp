#include "model/gpt_model.h"

#include "ops/flash_attention.h"
#include "ops/elementwise.h"
#include "ops/fp8.h"

#include "model/fp8/fp8_model.h"
#include "model/layers/embedding.h"
#include "model/layers/multi_token_prediction.h"
#include "model/layers/output_head.h"
#include "model/layers/transformer_layer.h"
#include "model/moe/echo_peers.h"
#include "model/moe/moe_metrics.h"
#include "model/specs.h"

namespace mt {

namespace {
// The last pipeline stage holds the word embedding too (a copy of the first stage's, its gradient
// all-reduced over the embedding group): as the tied output layer, or for the multi-token
// prediction's embedding of an untied model (Megatron-Core's post-process embedding for MTP).
bool word_embedding_on_last_stage(const TransformerConfig& c) { return c.tied_output() || c.mtp_num_layers > 0; }

std::vector<pipeline::LayerRange> whole_model(const TransformerConfig& c) {
  pipeline::LayerRange r;
  r.begin = 0;
  r.end = c.num_layers;
  r.has_embedding = r.has_loss = true;
  return {r};
}
}  // namespace

// The modules of one rank, declared in ParamStore order: the embedding (if a chunk has it), the
// layers of every chunk in order, the head (if a chunk has the loss). Holds the config and TP
// region the modules refer to, so it never moves.
struct GPTModel::Parts {
  /// attention: --attention-backend resolved (resolve_attention_backend).
  Parts(const TransformerConfig& config, TensorParallelRegion tp_region, ExpertParallel expert_parallel,
        const std::vector<pipeline::LayerRange>& ranges, AttentionBackend attention,
        const ContextParallelRegion* cp = nullptr, Fp8Model* fp8 = nullptr)
      : cfg(config), tp(std::move(tp_region)), ep(std::move(expert_parallel)) {
    registry.set_fp8(fp8);
    bool has_embedding = false, has_loss = false;
    int embedding_chunk = 0, loss_chunk = 0;  // ParamSpec::model_chunk of the embedding, the head
    for (size_t c = 0; c < ranges.size(); ++c) {
      if (ranges[c].has_embedding) embedding_chunk = static_cast<int>(c);
      if (ranges[c].has_loss) loss_chunk = static_cast<int>(c);
      has_embedding |= ranges[c].has_embedding;
      has_loss |= ranges[c].has_loss;
    }
    registry.set_model_chunk(embedding_chunk);
    if (has_embedding) embedding = std::make_unique<LanguageModelEmbedding>(cfg, tp, registry);
    std::vector<LayerSpec> specs = get_gpt_decoder_layer_specs(cfg, attention);
    for (LayerSpec& spec : specs) spec.context_parallel = cp;
    for (size_t c = 0; c < ranges.size(); ++c) {
      registry.set_model_chunk(static_cast<int>(c));
      for (int64_t l = ranges[c].begin; l < ranges[c].end; ++l)
        layers.push_back(std::make_unique<TransformerLayer>(cfg, specs[static_cast<size_t>(l)], l, tp, ep, registry));
    }
    registry.set_model_chunk(loss_chunk);
    if (has_loss)
      head = std::make_unique<LanguageModelHead>(cfg, tp, registry,
                                                 embedding && cfg.tied_output() ? &embedding->word_embeddings() : nullptr);
    if (has_loss && cfg.mtp_num_layers > 0) {  // Megatron's placement: after the decoder on the last stage
      // the word embedding: the embedding's, the last stage's copy of a tied one (the output
      // layer's), or (untied, the last of several stages) a copy the MTP declares
      const ParamRef* word = embedding ? &embedding->word_embeddings()
                             : cfg.tied_output() ? &head->output_weight()
                                                 : nullptr;
      mtp = std::make_unique<MultiTokenPrediction>(cfg, specs.back(), tp, ep, registry, word, head->output_weight());
    }
  }
  Parts(const Parts&) = delete;
  Parts& operator=(const Parts&) = delete;

  TransformerConfig cfg;
  TensorParallelRegion tp;
  ExpertParallel ep;
  ParamRegistry registry;
  std::unique_ptr<LanguageModelEmbedding> embedding;
  std::vector<std::unique_ptr<TransformerLayer>> layers;
  std::unique_ptr<LanguageModelHead> head;
  std::unique_ptr<MultiTokenPrediction> mtp;  // --mtp-num-layers, with the head
};

// One model chunk: its layer range, its modules and its input buffers.
struct GPTModel::ChunkState {
  pipeline::LayerRange range;
  LanguageModelEmbedding* embedding = nullptr;
  std::vector<TransformerLayer*> layers;
  LanguageModelHead* head = nullptr;
  std::vector<Tensor> input;  // input buffers [s_l, b, h]
  // Full recompute (TransformerConfig::recompute_group): per layer its group or -1, the groups'
  // first and last layers, and per activation slot each group's output [s_l, b, h] (the
  // checkpoint the next layer, the head or the next stage reads).
  std::vector<int64_t> group;
  std::vector<std::pair<size_t, size_t>> groups;
  std::vector<std::vector<Tensor>> checkpoint;  // [slot][group]
  // The recompute area's index (0) for a recomputed layer, else the micro-batch's slot.
  int slot_of(size_t layer, int slot) const { return group[layer] >= 0 ? 0 : slot; }
  bool ends_group(size_t layer) const {
    return group[layer] >= 0 && groups[static_cast<size_t>(group[layer])].second == layer;
  }
};

void GPTModel::for_each_moe(const std::function<void(MoELayer&)>& f) const {
  for (const auto& l : parts_->layers)
    if (MoELayer* m = l->moe()) f(*m);
  for (int64_t d = 0; parts_->mtp && d < parts_->mtp->depths(); ++d)
    if (MoELayer* m = parts_->mtp->layer(d).moe()) f(*m);
}

std::vector<double> GPTModel::moe_loss_stats(const Stream& stream) const {
  const size_t per = static_cast<size_t>(kMoeStatLosses + config_.num_moe_experts);
  std::vector<double> out(per * static_cast<size_t>(config_.num_layers_with_mtp()), 0.0);
  for_each_moe([&](MoELayer& m) {
    const std::vector<double> v = m.stats(stream);
    for (size_t i = 0; i < per; ++i) out[per * static_cast<size_t>(m.layer()) + i] += v[i];
  });
  return out;
}

MoeDispatchStats GPTModel::moe_dispatch_stats(const Stream& stream) const {
  MoeDispatchStats out;
  for_each_moe([&](MoELayer& m) {
    const MoeDispatchStats s = m.dispatch_stats(stream);
    out.rerouted += s.rerouted;
    out.overflowed += s.overflowed;
    out.dispatches += s.dispatches;
    out.max_received = std::max(out.max_received, s.max_received);
  });
  if (EchoPeers* p = echo_peers()) out.echo_bytes = p->bytes_sent_sync(stream);  // one for all layers
  return out;
}

EchoPeers* GPTModel::echo_peers() const {
  EchoPeers* out = nullptr;
  for_each_moe([&](MoELayer& m) {
    EchoPeers* p = m.shared_resources().echo_peers.get();
    MT_CHECK(out == nullptr || p == nullptr || p == out, "GPTModel: the MoE layers hold different ECHO transfers");
    if (p) out = p;
  });
  return out;
}

void GPTModel::reset_moe_stats(const Stream& stream) {
  for_each_moe([&](MoELayer& m) { m.reset_stats(stream); });
  if (EchoPeers* p = echo_peers()) p->reset_bytes(stream);
}

void GPTModel::update_expert_bias(const Stream& stream) {
  if (!config_.moe_router_enable_expert_bias) return;
  // the counts are summed over TP × CP in the forwards: over DP here (Megatron's tp_dp_cp all-reduce)
  for_each_moe([&](MoELayer& m) { m.update_expert_bias(groups_.dp.get(), stream); });
}

void GPTModel::reset_global_aux_loss_tracker(const Stream& stream) {
  if (!config_.moe_aux_loss_on(MoeLoadBalancing::kGlobalAuxLoss)) return;
  for_each_moe([&](MoELayer& m) { m.reset_global_tokens(stream); });
}

void GPTModel::finish_step(const Stream& stream) {
  update_expert_bias(stream);             // aux-loss-free MoE balancing (Megatron's finalize_model_grads)
  reset_global_aux_loss_tracker(stream);  // global_aux_loss: the next step counts from zero (device)
  if (fp8_) fp8_->finish_step(stream);    // delayed scaling: the step's amaxes reduced, the scales updated
}

std::string GPTModel::mtp_statistics(Communicator& world, int64_t iterations, const Stream& stream) {
  const size_t D = static_cast<size_t>(config_.mtp_num_layers);
  std::vector<float> mine(D, 0.f);
  if (!mtp_losses_.empty()) {
    if (tp_.rank() == 0) copy_bytes(mine.data(), Device::cpu(), mtp_losses_.data(), device_, D * sizeof(float), stream);
    stream.synchronize();
    fill(mtp_losses_, 0.f, stream);
  }
  // Each last-stage TP rank 0 of each DP (and CP) rank holds its share of the mean: summed in rank order.
  const std::vector<char> all = all_gather_host(world, mine.data(), D * sizeof(float), stream);
  std::string out;
  for (size_t d = 0; d < D; ++d) {
    double sum = 0;
    for (int r = 0; r < world.size(); ++r)
      sum += reinterpret_cast<const float*>(all.data() + static_cast<size_t>(r) * D * sizeof(float))[d];
    out += fmt::format(" mtp_{} loss: {:.6E} |", d + 1, sum / static_cast<double>(std::max<int64_t>(iterations, 1)));
  }
  return out;
}

std::string GPTModel::log_statistics(Communicator& world, int64_t iterations, const Stream& stream) {
  const std::string mtp = config_.mtp_num_layers > 0 ? mtp_statistics(world, iterations, stream) : "";
  if (config_.num_moe_experts == 0) return mtp;
  const std::vector<double> local = moe_loss_stats(stream);
  const MoeDispatchStats dispatch = moe_dispatch_stats(stream);
  reset_moe_stats(stream);
  const MoeWorldStatistics world_stats = gather_moe_statistics(config_, local, dispatch, world, stream);
  const int ep = groups_.ep ? groups_.ep->size() : 1;
  return mtp + format_moe_statistics(config_, world_stats, iterations, tp_.size() * context_parallel_size(), ep);
}

std::vector<std::pair<std::string, Tensor>> GPTModel::persistent_state(const Stream& stream) const {
  std::vector<std::pair<std::string, Tensor>> out;
  for_each_moe([&](MoELayer& m) {
    if (Tensor b = m.expert_bias(stream); !b.empty()) {
      const int64_t l = m.layer(), L = config_.num_layers;  // the MTP layers are numbered after the decoder's
      out.emplace_back(l < L ? fmt::format("decoder.layers.{}.mlp.router.expert_bias", l)
                             : fmt::format("mtp.layers.{}.transformer_layer.mlp.router.expert_bias", l - L),
                       b);
    }
  });
  if (fp8_)  // delayed scaling's amax histories and scales
    for (auto& entry : fp8_->persistent_state(stream)) out.push_back(std::move(entry));
  return out;
}

void GPTModel::load_persistent_state(const Stream& stream) {
  if (fp8_) fp8_->load_state(stream);  // the expert biases were written in place
}

std::vector<ParamSpec> GPTModel::param_specs(const TransformerConfig& c, int tp, int tp_rank,
                                             const std::vector<pipeline::LayerRange>& chunks, int ep, int ep_rank) {
  const ExpertParallel expert{ep, ep_rank, tp, tp_rank, nullptr, nullptr, nullptr};  // expert TP = TP
  const Parts parts(c, TensorParallelRegion::layout_only(tp, tp_rank), expert, chunks.empty() ? whole_model(c) : chunks,
                    AttentionBackend::kLocal);  // no core attention has parameters
  return parts.registry.specs();
}

ContextParallelOptions GPTModel::validate_context_parallel(const TransformerConfig& c, int cp, int tp) {
  ContextParallelOptions o;
  o.size = cp;
  o.comm_type = parse_cp_comm_type(c.cp_comm_type);
  o.hierarchical_sizes = c.hierarchical_context_parallel_sizes;
  mt::validate_context_parallel(o, c.seq_length, c.num_attention_heads, c.query_groups(), tp);
  return o;
}

DropoutContext GPTModel::cp_dropout(const DropoutContext& dc) const {
  if (!cp_) return dc;
  DropoutContext d = dc;
  d.cp_size = cp_->size();
  d.cp_rank = cp_->rank();
  d.cp_chunk_elems = local_seq_length() / 2 * micro_batch_ * config_.hidden_size;
  return d;
}

GPTModel::GPTModel(const TransformerConfig& config, int64_t micro_batch, DType dtype, Device device,
                   ProcessGroups groups, bool sequence_parallel, ParamLayout param_layout, ModelLayout layout)
    : GPTModel(config, micro_batch, dtype, device, std::move(groups), sequence_parallel, param_layout,
               std::move(layout), nullptr) {}

std::unique_ptr<GPTModel> GPTModel::planned_for(int64_t seq_length, int64_t micro_batch, const Stream& stream) const {
  TransformerConfig c = config_;
  c.seq_length = seq_length;
  ModelLayout layout;
  for (ModelChunk ch : chunk_specs_) {
    ch.inputs = ch.loss_slots = 1;
    layout.chunks.push_back(ch);
  }
  c.recompute_granularity = RecomputeGranularity::kNone;  // forward only: nothing to recompute
  c.recompute_method_set = false;
  c.recompute_num_layers = 0;
  c.recompute_modules_set = false;
  c.fp8 = Fp8Format::kNone;   // inference runs the bf16 GEMMs on the same weights
  c.tp_comm_overlap = false;  // no sequence parallelism to overlap
  std::unique_ptr<GPTModel> m(new GPTModel(c, micro_batch, dtype_, device_, groups_, /*sequence_parallel=*/false,
                                           params_->layout(), std::move(layout), params_));
  const auto src = persistent_state(stream), dst = m->persistent_state(stream);  // the expert biases
  for (const auto& [name, t] : dst)
    for (const auto& [src_name, s] : src)
      if (src_name == name) copy(t, s, stream);
  return m;
}

ModelMemoryPlan GPTModel::memory_plan(const TransformerConfig& config, int64_t micro_batch, DType dtype,
                                      Device device, ProcessGroups groups, bool sequence_parallel,
                                      ParamLayout param_layout, ModelLayout layout) {
  const GPTModel measured(config, micro_batch, dtype, device, std::move(groups), sequence_parallel, param_layout,
                          std::move(layout), nullptr, /*measure_only=*/true);
  return measured.memory_plan_;
}

GPTModel::GPTModel(const TransformerConfig& config, int64_t micro_batch, DType dtype, Device device,
                   ProcessGroups groups, bool sequence_parallel, ParamLayout param_layout, ModelLayout layout,
                   std::shared_ptr<ParamStore> shared, bool measure_only)
    : config_(config),
      micro_batch_(micro_batch),
      dtype_(dtype),
      device_(device),
      groups_(std::move(groups)),
      tp_(groups_.tp, sequence_parallel, config.tp_comm_overlap) {
  config_.validate(tp_.size());
  if (groups_.cp && groups_.cp->size() > 1) {
    const ContextParallelOptions cpo = validate_context_parallel(config_, groups_.cp->size(), tp_.size());
    // measured only (memory_plan, `megatron plan`): its small position table on the host, so that a
    // machine without the device can measure the model
    cp_ = std::make_unique<ContextParallelRegion>(groups_.cp, cpo, config_.seq_length,
                                                  measure_only ? Device::cpu() : device);
  }
  (void)tp_.local_seq(local_seq_length());  // errors when SP cannot split the sequence
  MT_REQUIRE(micro_batch > 0, "--micro-batch-size must be positive, got {}", micro_batch);
  MT_REQUIRE(device.is_cuda() || dtype == DType::kF32, "{} training needs --device cuda (the CPU backend is fp32)",
             dtype_name(dtype));
  if (config_.num_moe_experts > 0) {
    MT_REQUIRE(tp_.size() == 1 || tp_.sequence_parallel(),
               "MoE with tensor parallel size {} needs --sequence-parallel (as Megatron requires)", tp_.size());
    // With CP the router's token counts and N are those of the TP × CP group (moe.h).
  }
  std::vector<ModelChunk>& chunks = layout.chunks;
  if (chunks.empty()) chunks.push_back({whole_model(config_)[0], 1, 1});
  MT_REQUIRE(layout.activation_slots >= 1, "the model needs at least one activation slot, got {}",
             layout.activation_slots);
  activation_slots_ = layout.activation_slots;
  head_options_ = layout.head;
  std::vector<pipeline::LayerRange> ranges;
  int64_t prev_end = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const auto& r = chunks[c].layers;
    MT_REQUIRE(r.begin >= 0 && r.begin <= r.end && r.end <= config_.num_layers && (c == 0 || r.begin >= prev_end),
               "model chunk {} holds layers [{}, {}): expected increasing, non-overlapping ranges within [0, {})", c,
               r.begin, r.end, config_.num_layers);
    MT_REQUIRE(chunks[c].inputs >= 1 && chunks[c].loss_slots >= 1,
               "model chunk {} needs at least one input buffer and loss slot, got {} and {}", c, chunks[c].inputs,
               chunks[c].loss_slots);
    prev_end = r.end;
    ranges.push_back(r);
  }
  chunk_specs_ = chunks;
  // measured only (`megatron plan`, for H100/H200 on a machine that may have no GPU): Hopper
  const bool hopper = device.is_cuda() && (measure_only || compute_capability(device) >= 90);
  attention_backend_ = resolve_attention_backend(config_.attention_backend, config_.head_dim(),
                                                 {device.is_cuda(), dtype, flash_attention_cudnn_available(), hopper});
  // Without an expert grid (no etp-ep group): EP 1 and expert TP = TP over the TP group.
  ExpertParallel expert{1, 0, tp_.size(), tp_.rank(), groups_.tp, nullptr, groups_.tp};
  if (groups_.etp_ep) {
    expert = ExpertParallel{groups_.ep->size(), groups_.ep->rank(), groups_.etp->size(), groups_.etp->rank(),
                            groups_.etp_ep, groups_.ep, groups_.etp};
  }
  if (config_.fp8 != Fp8Format::kNone) {  // docs/fp8.md: checked before anything is allocated
    // (not when only measured: `megatron plan` sizes GPU runs on a machine without the GPU)
    if (!measure_only) fp8_check_device(device, config_.fp8_recipe == Fp8Recipe::kBlockwise);
    MT_REQUIRE(device.is_cpu() || dtype != DType::kF16,
               "--fp8-format with --fp16 is not supported: the FP8 GEMMs write bf16 or fp32 (use --bf16)");
    fp8_ = std::make_unique<Fp8Model>(config_, groups_);
  }
  parts_ = std::make_unique<Parts>(config_, tp_, expert, ranges, attention_backend_, cp_.get(), fp8_.get());
  // The router sums its token counts over TP × CP (Megatron's tp_cp_group), global_aux_loss then
  // over DP (together Megatron's tp_dp_cp_group).
  for_each_moe([&](MoELayer& m) {
    m.set_data_parallel(groups_.dp.get());
    if (cp_) m.set_context_parallel(groups_.tp_cp.get(), groups_.cp->size(), groups_.cp->rank());
  });
  if (measure_only) {
    memory_plan_.params = ParamStore::plan(parts_->registry.specs(), param_layout);
  } else {
    params_ = shared ? std::move(shared)
                     : std::make_shared<ParamStore>(parts_->registry.specs(), dtype, device, param_layout);
    parts_->registry.bind(*params_);
  }
  if (parts_->mtp)  // sharded parameters: the MTP's uses bracketed as the model's units
    parts_->mtp->set_use_hook([this](int64_t d, MultiTokenPrediction::Use u, bool backward, bool begin,
                                     const Stream& st) { mtp_use(d, static_cast<int>(u), backward, begin, st); });
  if (word_embedding_on_last_stage(config_)) {
    word_embedding_index_ = parts_->embedding ? parts_->embedding->word_embeddings().index
                            : parts_->mtp     ? parts_->mtp->word_embedding().index
                            : parts_->head    ? parts_->head->output_weight().index
                                              : ParamStore::kNoParam;
  }
  // Per registry group: the replicated parameters whose gradients are partial sums over TP.
  for (size_t g = 0; g < parts_->registry.num_groups() && params_; ++g) {
    const ParamStore& P = *params_;
    const auto [first, end] = parts_->registry.group_range(g);
    tp_partial_.push_back(P.ranges([&, first = first, end = end](const ParamInfo& p) {
      const size_t i = static_cast<size_t>(&p - P.infos().data());
      const bool partial = (p.tp_grad_sum == TpGradSum::kAlways && tp_.size() > 1) ||
                           (p.tp_grad_sum == TpGradSum::kSequenceParallel && tp_.sequence_parallel());
      return i >= first && i < end && partial;
    }));
  }
  chunks_.resize(chunks.size());
  size_t next_layer = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    ChunkState& ch = chunks_[c];
    ch.range = chunks[c].layers;
    if (ch.range.has_embedding) ch.embedding = parts_->embedding.get();
    for (int64_t l = ch.range.begin; l < ch.range.end; ++l) ch.layers.push_back(parts_->layers[next_layer++].get());
    if (ch.range.has_loss) ch.head = parts_->head.get();
    const int64_t n = static_cast<int64_t>(ch.layers.size());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t g = config_.recompute_group(i, n);
      ch.group.push_back(g);
      if (g < 0) continue;
      if (static_cast<size_t>(g) == ch.groups.size()) ch.groups.emplace_back(static_cast<size_t>(i), 0);
      ch.groups.back().second = static_cast<size_t>(i);
    }
  }
  planner_ = std::make_unique<BufferPlanner>(device, dtype);
  planner_->begin_pass();
  plan(*planner_);
  if (measure_only) {
    using Family = BufferPlanner::Family;
    ModelMemoryPlan& m = memory_plan_;
    m.activation_slot_bytes = planner_->area_bytes(Family::kActivations);
    m.activation_slots = planner_->area_count(Family::kActivations);
    m.recompute_bytes = planner_->area_bytes(Family::kRecompute) * static_cast<size_t>(planner_->area_count(Family::kRecompute));
    m.head_slot_bytes = planner_->area_bytes(Family::kHead);
    m.head_slots = planner_->area_count(Family::kHead);
    m.scratch_bytes = planner_->scratch_bytes();
    m.persistent_bytes = planner_->persistent_bytes();
    m.fp8_bytes = fp8_ ? fp8_->planned_bytes() : 0;
    if (fp8_) m.fp8_weights = fp8_->weight_names();
    m.boundary_bytes = static_cast<size_t>(Tensor(nullptr, dtype_, device_, boundary_shape()).nbytes());
    return;
  }
  planner_->materialize();
  planner_->begin_pass();
  plan(*planner_);
  if (!mtp_losses_.empty()) {
    Stream st(device_);
    fill(mtp_losses_, 0.f, st);
    st.synchronize();
  }
  if (fp8_) fp8_->initialize(device_);
}

GPTModel::~GPTModel() = default;

void GPTModel::plan(BufferPlanner& p) {
  using Family = BufferPlanner::Family;
  const int64_t s = local_seq_length(), b = micro_batch_, sl = tp_.local_seq(s), h = config_.hidden_size;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    ChunkState& ch = chunks_[c];
    ch.input.assign(static_cast<size_t>(chunk_specs_[c].inputs), Tensor());
    for (auto& in : ch.input) in = p.persistent(dtype_, {sl, b, h}, "chunk input");
  }
  if (fp8_) fp8_->plan(p);  // the FP8 weight copies and scaling state
  // Activation slots: every chunk's layers fill a slot from its start (a slot holds one forward
  // of one chunk at a time). Full recompute: a slot keeps the groups' outputs; the recomputed
  // layers' saved tensors are planned in the recompute area, one group at a time.
  for (int slot = 0; slot < activation_slots_; ++slot) {
    for (ChunkState& ch : chunks_) {
      p.open_area(Family::kActivations, slot);
      for (size_t i = 0; i < ch.layers.size(); ++i)
        if (ch.group[i] < 0) ch.layers[i]->plan(p, s, b);
      ch.checkpoint.resize(static_cast<size_t>(activation_slots_));
      ch.checkpoint[static_cast<size_t>(slot)].clear();
      for (size_t g = 0; g < ch.groups.size(); ++g)
        ch.checkpoint[static_cast<size_t>(slot)].push_back(p.saved(dtype_, {sl, b, h}, "recompute group output"));
      p.close_area();
      for (const auto& [first, last] : ch.groups) {
        p.open_area(Family::kRecompute, 0);
        for (size_t i = first; i <= last; ++i) ch.layers[i]->plan(p, s, b);
        p.close_area();
      }
    }
  }
  for (size_t c = 0; c < chunks_.size(); ++c) {
    if (!chunks_[c].head) continue;
    for (int k = 0; k < chunk_specs_[c].loss_slots; ++k) {
      p.open_area(Family::kHead, k);
      chunks_[c].head->plan(p, s, b, head_options_);
      if (parts_->mtp) parts_->mtp->plan(p, s, b, head_options_);
      p.close_area();
    }
  }
  if (parts_->embedding) parts_->embedding->plan(p, s, b);
  residual_grad_ = p.scratch("model.residual_grad", dtype_, {sl, b, h});
  if (parts_->mtp) mtp_losses_ = p.persistent(DType::kF32, {parts_->mtp->depths()}, "MTP losses");
}

size_t GPTModel::activation_bytes() const { return planner_->bytes(); }

const ModelChunk& GPTModel::chunk(int c) const {
  MT_REQUIRE(c >= 0 && c < num_chunks(), "model chunk {} requested; this rank has {}", c, num_chunks());
  return chunk_specs_[static_cast<size_t>(c)];
}

std::vector<int64_t> GPTModel::boundary_shape() const {
  return {tp_.local_seq(local_seq_length()), micro_batch_, config_.hidden_size};
}

Tensor GPTModel::chunk_input(int c, int input) const {
  MT_REQUIRE(input >= 0 && input < chunk(c).inputs, "input buffer {} of model chunk {} requested; it has {}", input,
             c, chunk(c).inputs);
  return chunks_[static_cast<size_t>(c)].input[static_cast<size_t>(input)];
}

void GPTModel::check_buffers(int c, const ChunkBuffers& buf) const {
  chunk_input(c, buf.input);  // checks c and the input buffer
  MT_REQUIRE(buf.slot >= 0 && buf.slot < activation_slots_, "activation slot {} requested; the model has {}",
             buf.slot, activation_slots_);
  MT_REQUIRE(!chunks_[static_cast<size_t>(c)].head || (buf.head >= 0 && buf.head < chunk(c).loss_slots),
             "loss slot {} of model chunk {} requested; it has {}", buf.head, c, chunk(c).loss_slots);
}

Tensor GPTModel::chunk_output(int c, const ChunkBuffers& buf) const {
  check_buffers(c, buf);
  const ChunkState& ch = chunks_[static_cast<size_t>(c)];
  if (ch.layers.empty()) return ch.input[static_cast<size_t>(buf.input)];
  return layer_output(ch, ch.layers.size() - 1, buf.slot);
}

Tensor GPTModel::layer_output(const ChunkState& ch, size_t i, int slot) const {
  if (ch.ends_group(i))
    return ch.checkpoint[static_cast<size_t>(slot)][static_cast<size_t>(ch.group[i])];
  return ch.layers[i]->output(ch.slot_of(i, slot));
}

void GPTModel::recompute_forward(const ChunkState& ch, size_t first, size_t last, const Tensor& in, int slot,
                                 const MicroBatch& mb, const DropoutContext& dc, const Stream& st) {
  StepContext ctx{mb, dc, /*slot=*/0, st};
  ctx.recompute = true;
  Tensor x = first == 0 ? in : layer_output(ch, first - 1, slot);
  for (size_t i = first; i <= last; ++i) {
    // next: the following recomputed layer, and after the last its own backward
    params_begin(ch.layers[i]->param_group(), ch.layers[std::min(i + 1, last)]->param_group(), false, true, st);
    x = ch.layers[i]->forward(x, ctx);
    params_end(ch.layers[i]->param_group(), false, true, st);
  }
}

void GPTModel::params_begin(size_t group, size_t next, bool head, bool backward, const Stream& st) {
  if (hooks_ == nullptr || !hooks_->params_every_use()) return;
  const auto [first, end] = parts_->registry.group_range(group);
  const auto [next_first, next_end] = next == kNoGroup ? std::pair<size_t, size_t>{0, 0}
                                                       : parts_->registry.group_range(next);
  hooks_->params_begin(first, end, backward, next_first, next_end, st);
  // Without pipeline parallelism a tied output layer reads the embedding's word embedding.
  if (head && parts_->embedding && config_.tied_output()) {
    const size_t word = parts_->embedding->word_embeddings().index;
    hooks_->params_begin(word, word + 1, backward, 0, 0, st);
  }
}

void GPTModel::params_end(size_t group, bool head, bool backward, const Stream& st) {
  if (hooks_ == nullptr || !hooks_->params_every_use()) return;
  if (head && parts_->embedding && config_.tied_output()) {
    const size_t word = parts_->embedding->word_embeddings().index;
    hooks_->params_end(word, word + 1, backward, st);
  }
  const auto [first, end] = parts_->registry.group_range(group);
  hooks_->params_end(first, end, backward, st);
}

std::pair<size_t, size_t> GPTModel::mtp_depth_range(int64_t d) const {
  auto [first, end] = parts_->registry.group_range(parts_->mtp->param_group(d));
  while (first < end && params_->info(first).shared_embedding_copy) ++first;  // read by the embedding use only
  while (end > first && params_->info(end - 1).shared_embedding_copy) --end;
  for (size_t i = first; i < end; ++i)
    MT_CHECK(!params_->info(i).shared_embedding_copy, "MTP depth {}: the word embedding copy '{}' inside its group", d,
             params_->info(i).name);
  return {first, end};
}

void GPTModel::mtp_use(int64_t d, int use, bool backward, bool begin, const Stream& st) {
  if (hooks_ == nullptr || !hooks_->params_every_use()) return;
  using Use = MultiTokenPrediction::Use;
  const MultiTokenPrediction& m = *parts_->mtp;
  auto one = [](size_t i) { return std::pair<size_t, size_t>{i, i + 1}; };
  // The ranges of the use, the outer first (the head's shared output layer nested in the depth's
  // norms, as the main head's tied word embedding).
  std::pair<size_t, size_t> r[2];
  size_t n = 1;
  switch (static_cast<Use>(use)) {
    case Use::kEmbedding:  // the embedding's, the output layer's (tied, last stage) or the MTP's copy
      r[0] = one(m.word_embedding().index);
      break;
    case Use::kInput:
      r[0] = mtp_depth_range(d);
      break;
    case Use::kLayer:
      r[0] = parts_->registry.group_range(m.layer(d).param_group());
      break;
    case Use::kHead:
      r[0] = mtp_depth_range(d);
      r[1] = one(parts_->head->output_weight().index);
      n = 2;
      break;
  }
  // No next range: the MTP names no prefetch (GradSync keeps the pass's last one, e.g. the head's).
  if (begin) {
    for (size_t k = 0; k < n; ++k) hooks_->params_begin(r[k].first, r[k].second, backward, 0, 0, st);
  } else {
    for (size_t k = n; k-- > 0;) hooks_->params_end(r[k].first, r[k].second, backward, st);
  }
}

Tensor GPTModel::logits(int head) const {
  return parts_->head ? parts_->head->logits(head) : Tensor();
}

bool GPTModel::embedding_shared_across_stages() const {
  return word_embedding_on_last_stage(config_) && groups_.embedding && groups_.embedding->size() > 1;
}

void GPTModel::grads_final(size_t first, size_t end, const Stream& st) {
  if (hooks_ != nullptr && first < end) hooks_->grads_ready(first, end, st);
}

void GPTModel::finish_group(size_t group, const Stream& st) {
  for (const ParamStore::Range& r : tp_partial_[group]) {
    if (!params_->grads_staged()) {
      tp_.all_reduce_grads(params_->grads_flat().flat_range(r.begin, r.end - r.begin), st);
      continue;
    }
    for (int64_t b = r.begin; b < r.end;) {  // staged gradients: one piece per bucket
      const int64_t e = std::min(r.end, params_->buckets()[params_->bucket_at(b)].end);
      tp_.all_reduce_grads(params_->grads_range(b, e - b), st);
      b = e;
    }
  }
  auto [first, end] = parts_->registry.group_range(group);
  // The last stage's copy of a tied embedding is reported by the step executor after the
  // embedding-group all-reduce (train/train_step.h) when that group spans stages.
  if (embedding_shared_across_stages()) {
    for (size_t i = first; i < end; ++i) {
      if (!params_->info(i).shared_embedding_copy) continue;
      grads_final(first, i, st);
      first = i + 1;
    }
  }
  grads_final(first, end, st);
}

void GPTModel::forward(const MicroBatch& mb, const DropoutContext& dc, const Tensor& loss_accum, float loss_weight,
                       const Stream& st, bool compute_loss) {
  MT_REQUIRE(num_chunks() == 1 && chunks_[0].embedding && chunks_[0].head,
             "GPTModel::forward needs the whole model on this rank (use forward_chunk with pipeline parallelism)");
  if (fp8_) fp8_->invalidate_weights();  // the weights may have changed since the last call
  forward_chunk(0, ChunkBuffers{}, mb, dc, loss_accum, loss_weight, st, /*first_forward=*/false, compute_loss);
}

void GPTModel::backward(const MicroBatch& mb, const DropoutContext& dc, float grad_scale, const Tensor& loss_scale,
                        const Stream& st, bool last_backward) {
  MT_REQUIRE(num_chunks() == 1 && chunks_[0].embedding && chunks_[0].head,
             "GPTModel::backward needs the whole model on this rank (use backward_chunk with pipeline parallelism)");
  backward_chunk(0, ChunkBuffers{}, mb, dc, Tensor(), grad_scale, loss_scale, st, last_backward);
}

Tensor GPTModel::forward_chunk(int c, const ChunkBuffers& buf, const MicroBatch& mb, const DropoutContext& dc_in,
                               const Tensor& loss_accum, float loss_weight, const Stream& st, bool first_forward,
                               bool compute_loss, const HeadGrad* head_grad) {
  check_buffers(c, buf);
  const DropoutContext dc = cp_dropout(dc_in);
  MT_REQUIRE(!cp_ || ((mb.tokens.empty() || mb.tokens.size(0) == local_seq_length()) && !mb.position_ids.empty()),
             "context parallelism ({} ranks) needs micro-batches of this rank's {} tokens with their global "
             "position_ids (parallel/context_parallel.h), got tokens {} and {}",
             context_parallel_size(), local_seq_length(), mb.tokens.empty() ? "none" : mb.tokens.shape_str(),
             mb.position_ids.empty() ? "no position_ids" : "position_ids");
  ChunkState& ch = chunks_[static_cast<size_t>(c)];
  const Tensor in = ch.input[static_cast<size_t>(buf.input)];
  const StepContext ctx{mb, dc, buf.slot, st, Tensor(), layer_graphs_};
  if (fp8_) fp8_->set_training(dc.training);  // delayed scaling records training forwards only
  // Sharded parameters: params_begin / params_end around each unit instead.
  const bool per_use = hooks_ != nullptr && hooks_->params_every_use();
  auto needed = [&](size_t group) {
    const auto [first, end] = parts_->registry.group_range(group);
    if (first_forward && !per_use && hooks_ != nullptr && first < end) hooks_->params_needed(first, end, st);
  };
  // The unit the forward uses after layer i - 1 (the embedding for i = 0): layer i, or the head.
  auto forward_next = [&](size_t i) {
    return i < ch.layers.size() ? ch.layers[i]->param_group() : ch.head ? ch.head->param_group() : kNoGroup;
  };
  if (ch.embedding) {
    needed(ch.embedding->param_group());
    params_begin(ch.embedding->param_group(), forward_next(0), false, false, st);
    ch.embedding->forward(in, ctx);
    params_end(ch.embedding->param_group(), false, false, st);
  }
  Tensor x = in;
  for (size_t i = 0; i < ch.layers.size(); ++i) {
    needed(ch.layers[i]->param_group());
    params_begin(ch.layers[i]->param_group(), forward_next(i + 1), false, false, st);
    // FP8: the layer's weights quantised once per step, after their all-gather (needed)
    if (fp8_) fp8_->quantize_weights(ch.range.begin + static_cast<int64_t>(i), first_forward, st);
    StepContext lctx = ctx;
    lctx.slot = ch.slot_of(i, buf.slot);
    x = ch.layers[i]->forward(x, lctx);
    params_end(ch.layers[i]->param_group(), false, false, st);
    if (ch.ends_group(i)) {  // full recompute: keep the group's output, the next group's input
      const Tensor kept = layer_output(ch, i, buf.slot);
      copy(kept, x, st);
      x = kept;
    }
  }
  if (!ch.head) return x;
  needed(ch.head->param_group());
  params_begin(ch.head->param_group(), kNoGroup, true, false, st);
  ch.head->forward(x, loss_accum, loss_weight, compute_loss, head_grad, StepContext{mb, dc, buf.head, st});
  params_end(ch.head->param_group(), true, false, st);
  // Multi-token prediction: training forwards only (the validation loss is the LM loss, as Megatron's)
  mtp_forwarded_.resize(static_cast<size_t>(chunk(c).loss_slots));
  mtp_forwarded_[static_cast<size_t>(buf.head)] = parts_->mtp && dc.training && compute_loss;
  if (!mtp_forwarded_[static_cast<size_t>(buf.head)]) return Tensor();
  for (int64_t d = 0; d < parts_->mtp->depths(); ++d) {  // (sharded parameters: each use bracketed instead)
    needed(parts_->mtp->param_group(d));
    needed(parts_->mtp->layer(d).param_group());
  }
  parts_->mtp->forward(ch.head->norm_output(buf.head), mtp_losses_, loss_weight, head_grad,
                       StepContext{mb, dc, buf.head, st});
  return Tensor();
}

void GPTModel::backward_chunk(int c, const ChunkBuffers& buf, const MicroBatch& mb, const DropoutContext& dc_in,
                              const Tensor& grad, float grad_scale, const Tensor& loss_scale, const Stream& st,
                              bool last_backward) {
  check_buffers(c, buf);
  // Sharded gradients report every backward (param_hooks.h grads_every_backward).
  const bool report = last_backward || (hooks_ != nullptr && hooks_->grads_every_backward());
  const DropoutContext dc = cp_dropout(dc_in);
  ChunkState& ch = chunks_[static_cast<size_t>(c)];
  const Tensor in = ch.input[static_cast<size_t>(buf.input)];
  const Tensor g = grad.empty() ? residual_grad_ : grad;  // running dL/d(residual stream)
  if (!grad.empty()) check_tensor(grad, dtype_, {boundary_shape()[0], micro_batch_, config_.hidden_size},
                                  "pipeline gradient buffer");
  const StepContext ctx{mb, dc, buf.slot, st, loss_scale, layer_graphs_};
  const size_t nlayers = ch.layers.size();
  // Layer i's forward input: the chunk input, a kept output, or (inside a recompute group) the
  // previous layer's output in the recompute area.
  auto layer_input = [&](size_t i) {
    if (i == 0) return in;
    if (i < nlayers && ch.group[i] >= 0 && ch.group[i - 1] == ch.group[i]) return ch.layers[i - 1]->output(0);
    return layer_output(ch, i - 1, buf.slot);
  };
  // The unit the backward uses after layer i's (the head's for i = nlayers): layer i - 1's
  // backward, or the recomputed forward of the full-recompute group ending at layer i - 1; none
  // before the embedding (whose backward reads no parameter).
  auto backward_next = [&](size_t i) {
    if (i == 0) return kNoGroup;
    const size_t j = ch.ends_group(i - 1) ? ch.groups[static_cast<size_t>(ch.group[i - 1])].first : i - 1;
    return ch.layers[j]->param_group();
  };
  if (ch.head) {
    Tensor dh0;  // the MTP's gradient of the final norm's output (its first depth reads it)
    if (parts_->mtp) {
      MT_REQUIRE(static_cast<size_t>(buf.head) < mtp_forwarded_.size() && mtp_forwarded_[static_cast<size_t>(buf.head)],
                 "the backward of loss slot {} needs a training forward with the multi-token prediction", buf.head);
      dh0 = parts_->mtp->backward(ch.head->norm_output(buf.head), grad_scale, loss_scale,
                                  StepContext{mb, dc, buf.head, st}, [&](size_t group) {
                                    if (report) finish_group(group, st);
                                  });
    }
    params_begin(ch.head->param_group(), backward_next(nlayers), true, true, st);
    ch.head->backward(g, layer_input(nlayers), grad_scale, loss_scale, StepContext{mb, dc, buf.head, st}, dh0);
    params_end(ch.head->param_group(), true, true, st);
    if (report) finish_group(ch.head->param_group(), st);
  }
  // The chunk's last backward with the embedding: the first layer's weight gradients wait until
  // the embedding backward has made the word embedding's gradient final, so that its reduction
  // (the largest bucket, the last one to complete otherwise) runs beside them instead of after
  // the backward. Same operations on the same buffers, only later: bitwise identical gradients.
  deferred_.clear();
  const bool defer_first = report && ch.embedding && nlayers > 0;
  for (size_t i = nlayers; i-- > 0;) {
    const bool defer = defer_first && i == 0;
    if (ch.ends_group(i))  // full recompute: the group's saved tensors again, before its backward
      recompute_forward(ch, ch.groups[static_cast<size_t>(ch.group[i])].first, i, in, buf.slot, mb, dc, st);
    StepContext lctx = ctx;
    lctx.slot = ch.slot_of(i, buf.slot);
    params_begin(ch.layers[i]->param_group(), backward_next(i), false, true, st);
    ch.layers[i]->backward(layer_input(i), g, lctx, defer ? &deferred_ : nullptr);
    params_end(ch.layers[i]->param_group(), false, true, st);
    if (report && !defer) finish_group(ch.layers[i]->param_group(), st);
  }
  if (!ch.embedding) return;
  ch.embedding->backward(g, ctx);  // reads no parameter (sharded parameters: no params_begin)
  if (report) {
    // Report the position embedding first, then the word embedding unless the step executor does
    // (a tied embedding shared with the last stage).
    const auto [first, end] = parts_->registry.group_range(ch.embedding->param_group());
    const size_t word = ch.embedding->word_embeddings().index;
    for (size_t i = first; i < end; ++i)
      if (i != word) grads_final(i, i + 1, st);
    if (!embedding_shared_across_stages()) grads_final(word, word + 1, st);
  }
  if (!defer_first) return;
  deferred_.run(st);
  finish_group(ch.layers[0]->param_group(), st);
}

}  // namespace mt
