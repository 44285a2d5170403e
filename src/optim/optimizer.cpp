#include "optim/optimizer.h"

#include "ops/elementwise.h"

#include <cstddef>
#include <algorithm>
#include <cstring>

namespace mt {

AdamWOptimizer::AdamWOptimizer(ParamStore& params, const OptimizerConfig& config, const Stream& stream,
                               OptimizerGroups groups)
    : params_(params), config_(config), groups_(std::move(groups)) {
  DdpConfig ddp;
  ddp.use_distributed_optimizer = groups_.distributed;
  own_sync_ = std::make_unique<GradSync>(params, groups_.dp, ddp);
  sync_ = own_sync_.get();
  init(stream);
}

AdamWOptimizer::AdamWOptimizer(GradSync& sync, const OptimizerConfig& config, const Stream& stream,
                               OptimizerGroups groups)
    : params_(sync.params()), config_(config), groups_(std::move(groups)), sync_(&sync) {
  MT_REQUIRE(!groups_.dp || groups_.dp == sync.dp(),
             "AdamWOptimizer: OptimizerGroups::dp (group '{}') is not the GradSync's data-parallel group ('{}')",
             groups_.dp->name(), sync.dp()->name());
  MT_REQUIRE(!groups_.distributed || sync.config().use_distributed_optimizer,
             "AdamWOptimizer: OptimizerGroups::distributed is set but the GradSync was built without "
             "use_distributed_optimizer");
  init(stream);
}

bool is_embedding_or_output_parameter(const ParamInfo& p) {
  return p.name == "embedding.word_embeddings.weight" || p.name == "output_layer.weight";
}

std::vector<AdamWOptimizer::Piece> AdamWOptimizer::owned_pieces(const std::vector<ParamStore::Range>& ranges) const {
  // Intersections of `ranges` (ascending) with the owned ranges (ascending), in ascending order.
  std::vector<Piece> out;
  int64_t state = 0;
  for (const auto& o : sync_->owned_ranges()) {
    for (const auto& r : ranges) {
      const int64_t b = std::max(r.begin, o.begin), e = std::min(r.end, o.end);
      if (b < e) out.push_back({b, e - b, state + (b - o.begin)});
    }
    state += o.end - o.begin;
  }
  return out;
}

int64_t AdamWOptimizer::moment_index(const Piece& p) const {
  auto it = std::upper_bound(m_layout_.begin(), m_layout_.end(), p.begin,
                             [](int64_t b, const Piece& l) { return b < l.begin; });
  MT_CHECK(it != m_layout_.begin(), "optimizer: flat element {} is not owned", p.begin);
  --it;
  MT_CHECK(p.begin + p.n <= it->begin + it->n, "optimizer: run [{}, {}) crosses a state run [{}, {})", p.begin,
           p.begin + p.n, it->begin, it->begin + it->n);
  return it->state + (p.begin - it->begin);
}

void AdamWOptimizer::init(const Stream& stream) {
  const OptimizerConfig& config = config_;
  MT_REQUIRE(config.beta1 >= 0 && config.beta1 < 1, "--adam-beta1 must be in [0, 1), got {}", config.beta1);
  MT_REQUIRE(config.beta2 >= 0 && config.beta2 < 1, "--adam-beta2 must be in [0, 1), got {}", config.beta2);
  MT_REQUIRE(config.eps > 0, "--adam-eps must be positive, got {}", config.eps);
  MT_REQUIRE(config.weight_decay >= 0, "--weight-decay must be >= 0, got {}", config.weight_decay);
  MT_REQUIRE(config.clip_grad >= 0, "--clip-grad must be >= 0, got {}", config.clip_grad);
  MT_REQUIRE(config.optimizer == "adam" || config.optimizer == "muon", "--optimizer '{}' is not one of adam, muon",
             config.optimizer);
  const bool muon = config.optimizer == "muon";
  MT_REQUIRE(!(muon && sync_->grads_sharded()),
             "--optimizer muon with sharded gradients (--data-parallel-sharding-strategy optim_grads) is not built: "
             "Muon reads whole gradient matrices");
  if (muon) validate_muon_config(config.muon);
  owned_n_ = sync_->owned_elements();
  // Remainders before sharding (every rank still holds the whole fp32 copy, so every rank's bf16
  // parameters are the same split), and both before the moments are allocated (lower peak).
  if (config.store_param_remainders) params_.store_main_as_remainders(stream);
  if (sync_->distributed()) params_.shard_main(sync_->owned_ranges(), stream);  // no-op for fp32 models
  // Gradient norm: TP-split parameters on every TP rank, replicated ones on TP rank 0 only; a
  // shared_embedding_copy is counted where the original lives (the first pipeline stage).
  const int tp_rank = groups_.tp_rank;
  norm_pieces_ = owned_pieces(params_.ranges([tp_rank](const ParamInfo& p) {
    return !p.expert && !p.shared_embedding_copy && (p.tensor_parallel || tp_rank == 0);
  }));
  // Expert parameters: distinct on every expert-model-parallel rank, replicated over EDP.
  expert_norm_pieces_ = owned_pieces(params_.ranges([](const ParamInfo& p) { return p.expert; }));
  if (!expert_norm_pieces_.empty()) {
    expert_scalars_ = Buffer(params_.device(), sizeof(OptimizerScalars));
    memset_tensor(expert_scalars_.as(DType::kU8, {static_cast<int64_t>(sizeof(OptimizerScalars))}), 0, stream);
  }
  // Where the moments keep each owned run: the owned ranges in order (state index), or with Muon
  // the runs outside the Muon matrices first (both moments) and the Muon runs after them (exp_avg
  // only: the momentum).
  m_layout_.clear();
  v_layout_.clear();
  {
    const std::vector<Piece> muon_runs = muon ? owned_pieces(params_.ranges(is_muon_parameter)) : std::vector<Piece>{};
    int64_t next = 0;
    size_t k = 0;
    for (const auto& o : sync_->owned_ranges()) {
      int64_t at = o.begin;
      for (; k < muon_runs.size() && muon_runs[k].begin < o.end; ++k) {
        if (muon_runs[k].begin > at) v_layout_.push_back({at, muon_runs[k].begin - at, 0});
        at = muon_runs[k].begin + muon_runs[k].n;
      }
      if (o.end > at) v_layout_.push_back({at, o.end - at, 0});
    }
    for (Piece& p : v_layout_) {
      p.state = next;
      next += p.n;
    }
    v_n_ = next;
    m_layout_ = v_layout_;
    for (const Piece& p : muon_runs) {
      m_layout_.push_back({p.begin, p.n, next});
      next += p.n;
    }
    MT_CHECK(next == owned_n_, "optimizer state layout covers {} of {} owned elements", next, owned_n_);
    std::sort(m_layout_.begin(), m_layout_.end(), [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  }
  // One multi-tensor AdamW launch per step over every owned run (two with --decoupled-lr: one
  // per learning rate). The fp32 main parameters (or their remainders) are indexed by state index
  // when sharded (the compact shard), else by flat index.
  const bool sharded = params_.main_sharded();
  auto plan = [&](bool decoupled) {
    std::vector<AdamWRun> runs;
    for (const bool decay : {true, false}) {
      const auto pieces = owned_pieces(params_.ranges([&](const ParamInfo& p) {
        return p.weight_decay == decay && (config.decoupled_lr && is_embedding_or_output_parameter(p)) == decoupled &&
               !(muon && is_muon_parameter(p));
      }));
      for (const auto& p : pieces)
        runs.push_back({sync_->params_sharded() ? p.state : p.begin, sharded ? p.state : p.begin, moment_index(p), p.n,
                        decay ? 1 : 0, 0, sync_->grads_sharded() ? p.state : p.begin});
    }
    return runs;
  };
  adamw_plan_ = AdamWPlan(plan(false), params_.device(), stream);
  if (config.decoupled_lr) {
    const std::vector<AdamWRun> runs = plan(true);
    if (!runs.empty()) decoupled_plan_ = AdamWPlan(runs, params_.device(), stream);
  }
  if (muon) {
    // Muon's updates applied as AdamW's runs are (every storage variant of the main parameters),
    // with AdamWHyper::precomputed_update.
    std::vector<AdamWRun> runs;
    std::vector<MuonPiece> muon_pieces;
    for (const bool decay : {true, false}) {
      const auto pieces = owned_pieces(
          params_.ranges([&](const ParamInfo& p) { return p.weight_decay == decay && is_muon_parameter(p); }));
      for (const auto& p : pieces)
        runs.push_back({p.begin, sharded ? p.state : p.begin, moment_index(p), p.n, decay ? 1 : 0, 0});
    }
    for (const auto& p : owned_pieces(params_.ranges(is_muon_parameter)))
      muon_pieces.push_back({p.begin, p.n, moment_index(p)});
    if (!runs.empty()) muon_plan_ = AdamWPlan(runs, params_.device(), stream);
    muon_ = std::make_unique<MuonStep>(params_, *sync_, config.muon, groups_.tp, groups_.etp, std::move(muon_pieces),
                                       stream);
  }
  exp_avg_ = Buffer(params_.device(), static_cast<size_t>(owned_n_) * 4);
  exp_avg_sq_ = Buffer(params_.device(), static_cast<size_t>(v_n_) * 4);
  scalars_ = Buffer(params_.device(), sizeof(OptimizerScalars));
  host_scalars_ = Buffer(Device::cpu(), sizeof(OptimizerScalars), HostMemory::kPinned);
  memset_tensor(exp_avg(), 0, stream);
  memset_tensor(exp_avg_sq(), 0, stream);
  write_scalars(initial_optimizer_scalars(config.scaler), stream);
}

void AdamWOptimizer::write_scalars(const OptimizerScalars& s, const Stream& stream) {
  std::memcpy(host_scalars_.data(), &s, sizeof(s));
  copy_bytes(scalars_.data(), scalars_.device(), host_scalars_.data(), Device::cpu(), sizeof(s), stream);
  stream.synchronize();
}

OptimizerScalars AdamWOptimizer::read_scalars_sync(const Stream& stream) const {
  copy_bytes(host_scalars_.data(), Device::cpu(), scalars_.data(), scalars_.device(), sizeof(OptimizerScalars),
             stream);
  stream.synchronize();
  OptimizerScalars s;
  std::memcpy(&s, host_scalars_.data(), sizeof(s));
  return s;
}

Tensor AdamWOptimizer::loss_scale_tensor() const {
  char* p = static_cast<char*>(scalars_.data()) + offsetof(OptimizerScalars, loss_scale);
  return Tensor(p, DType::kF32, scalars_.device(), {1});
}

void AdamWOptimizer::step(float lr, const Stream& stream, Timers* timers, const float* lr_ptr, float decoupled_lr,
                          const float* decoupled_lr_ptr) {
  sync_->finish_grad_sync(stream);  // no-op when the step already called it
  ScopedTimer whole(timers, Timers::kOptimizer, stream);
  const Tensor sc = scalars();
  // Sharded gradients (optim_grads) are indexed like the moments (Piece::state), else by flat index.
  const bool gs = sync_->grads_sharded();
  const Tensor grads = gs ? sync_->grad_shard() : params_.grads_flat();
  {
    ScopedTimer clip(timers, Timers::kOptimizerClipMainGrad, stream);
    for (const auto& p : norm_pieces_) grad_sumsq_accumulate(sc, grads.flat_range(gs ? p.state : p.begin, p.n), stream);
    const Tensor sumsq(static_cast<char*>(scalars_.data()) + offsetof(OptimizerScalars, grad_sumsq), DType::kF32,
                       scalars_.device(), {1});
    if (sync_->distributed()) sync_->dp()->all_reduce(sumsq, ReduceOp::kSum, stream);
    if (groups_.mp && groups_.mp->size() > 1) groups_.mp->all_reduce(sumsq, ReduceOp::kSum, stream);
    if (!expert_norm_pieces_.empty()) {
      const Tensor esc = expert_scalars_.as(DType::kU8, {static_cast<int64_t>(sizeof(OptimizerScalars))});
      const Tensor esumsq(static_cast<char*>(expert_scalars_.data()) + offsetof(OptimizerScalars, grad_sumsq),
                          DType::kF32, expert_scalars_.device(), {1});
      // The accumulation unscales by the loss scale of its scalars: the current one.
      copy(Tensor(static_cast<char*>(expert_scalars_.data()) + offsetof(OptimizerScalars, loss_scale), DType::kF32,
                  expert_scalars_.device(), {1}),
           loss_scale_tensor(), stream);
      for (const auto& p : expert_norm_pieces_)
        grad_sumsq_accumulate(esc, grads.flat_range(gs ? p.state : p.begin, p.n), stream);
      if (sync_->distributed()) sync_->edp()->all_reduce(esumsq, ReduceOp::kSum, stream);
      if (groups_.expert_mp && groups_.expert_mp->size() > 1)
        groups_.expert_mp->all_reduce(esumsq, ReduceOp::kSum, stream);
      add(sumsq, sumsq, esumsq, stream);
      fill(esumsq, 0.f, stream);
    }
    optimizer_prepare(sc, config_.clip_grad, stream);
  }
  {
    ScopedTimer inner(timers, Timers::kOptimizerInnerStep, stream);
    // fp32 main parameters: the compact shard (sharded, state index), or the whole flat buffer
    // (flat index; == the model parameters for an fp32 model); or their int16 remainders, laid
    // out the same way, beside the bf16 model parameters.
    const Tensor main = params_.main_remainders_stored() ? params_.main_remainders()
                        : params_.main_sharded()         ? params_.main_shard()
                                                         : params_.main_flat();
    // The model parameters: the owned slices by state index with sharded parameters (optim_grads_params).
    const Tensor model = !params_.has_separate_main() ? Tensor()
                         : sync_->params_sharded()    ? params_.param_shard()
                                                      : params_.params_flat();
    const AdamWHyper hp{lr, lr_ptr, config_.beta1, config_.beta2, config_.eps, config_.weight_decay};
    adamw_multi_step(main, grads, exp_avg(), exp_avg_sq(), model, adamw_plan_, hp, sc, stream);
    if (!decoupled_plan_.chunks().empty()) {
      const AdamWHyper dhp{decoupled_lr, decoupled_lr_ptr, config_.beta1, config_.beta2, config_.eps, config_.weight_decay};
      adamw_multi_step(main, grads, exp_avg(), exp_avg_sq(), model, decoupled_plan_, dhp, sc, stream);
    }
    if (muon_) {
      // Momentum, Newton-Schulz and scale: the updates over the Muon parameters' gradients.
      muon_->step(grads, exp_avg(), sc, stream);
      AdamWHyper mhp{lr, lr_ptr, config_.beta1, config_.beta2, config_.eps, config_.weight_decay};
      mhp.precomputed_update = true;
      if (!muon_plan_.chunks().empty())
        // (the update reads and writes no moment: exp_avg stands for both, its Muon state indices
      // lying beyond exp_avg_sq)
      adamw_multi_step(main, grads, exp_avg(), exp_avg(), model, muon_plan_, mhp, sc, stream);
    }
  }
  loss_scaler_update(sc, config_.scaler, stream);
  ScopedTimer gather(timers, Timers::kParamsAllGather, stream);
  sync_->start_param_sync(stream);
}

void AdamWOptimizer::gather_compact(const Tensor& full, const Tensor& compact, const Stream& stream) const {
  MT_REQUIRE(full.dtype() == DType::kF32 && full.numel() == params_.total_elements(),
             "optimizer gather: expected fp32 [{}], got {}", params_.total_elements(), full.str());
  sync_->finish_param_sync(stream);  // no collective of ours may be in flight on the comm stream
  int64_t state = 0;
  for (const auto& o : sync_->owned_ranges()) {
    copy(full.flat_range(o.begin, o.end - o.begin), compact.flat_range(state, o.end - o.begin), stream);
    state += o.end - o.begin;
  }
  all_gather_owned(full, stream);
}

void AdamWOptimizer::all_gather_owned(const Tensor& full, const Stream& stream) const {
  if (!sync_->distributed()) return;
  const auto& bks = params_.buckets();
  for (size_t b = 0; b < bks.size(); ++b) {
    Communicator& g = sync_->group(bks[b]);
    if (g.size() < 2) continue;
    const ParamStore::Range r = sync_->owned_range(b);
    g.all_gather(full.flat_range(bks[b].begin, bks[b].numel()), full.flat_range(r.begin, r.end - r.begin), stream);
  }
}

void AdamWOptimizer::gather_moments(const Tensor& m, const Tensor& v, const Stream& stream) const {
  for (const Tensor* t : {&m, &v})
    MT_REQUIRE(t->dtype() == DType::kF32 && t->numel() == params_.total_elements(),
               "optimizer gather: expected fp32 [{}], got {}", params_.total_elements(), t->str());
  sync_->finish_param_sync(stream);  // no collective of ours may be in flight on the comm stream
  if (v_n_ < owned_n_) memset_tensor(v, 0, stream);  // Muon matrices: no second moment
  for (const Piece& p : m_layout_) copy(m.flat_range(p.begin, p.n), exp_avg().flat_range(p.state, p.n), stream);
  for (const Piece& p : v_layout_) copy(v.flat_range(p.begin, p.n), exp_avg_sq().flat_range(p.state, p.n), stream);
  all_gather_owned(m, stream);
  all_gather_owned(v, stream);
}

void AdamWOptimizer::gather_main(const Tensor& full, const Stream& stream) const {
  if (params_.main_remainders_stored()) {
    // The owned elements merged from (bf16 parameter, remainder) straight into `full` (exact),
    // then the all-gathers of the fp32 shard.
    MT_REQUIRE(full.dtype() == DType::kF32 && full.numel() == params_.total_elements(),
               "optimizer gather: expected fp32 [{}], got {}", params_.total_elements(), full.str());
    sync_->finish_param_sync(stream);  // the bf16 parameters are final; no collective in flight
    // The bf16 parameters: the owned slices by state index with sharded parameters
    // (optim_grads_params), else the whole buffer by flat index.
    const bool staged = sync_->params_sharded();
    const Tensor rem = params_.main_remainders(), params = staged ? params_.param_shard() : params_.params_flat();
    const bool sharded = params_.main_sharded();  // remainders by state index, else by flat index
    int64_t state = 0;
    for (const auto& o : sync_->owned_ranges()) {
      const int64_t n = o.end - o.begin;
      merge_param_remainders(full.flat_range(o.begin, n), params.flat_range(staged ? state : o.begin, n),
                             rem.flat_range(sharded ? state : o.begin, n), stream);
      state += n;
    }
    all_gather_owned(full, stream);
    return;
  }
  if (params_.main_sharded()) {
    gather_compact(full, params_.main_shard(), stream);
    return;
  }
  sync_->finish_param_sync(stream);  // fp32 model: the main parameters are the gathered ones
  copy(full, params_.main_flat(), stream);
}

void AdamWOptimizer::scatter_moments(const Tensor& m, const Tensor& v, const Stream& stream) {
  for (const Piece& p : m_layout_) copy(exp_avg().flat_range(p.state, p.n), m.flat_range(p.begin, p.n), stream);
  for (const Piece& p : v_layout_) copy(exp_avg_sq().flat_range(p.state, p.n), v.flat_range(p.begin, p.n), stream);
}

}  // namespace mt
