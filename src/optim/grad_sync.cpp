#include "optim/grad_sync.h"

#include <algorithm>

#include <fmt/ranges.h>

#include "model/fp8/fp8_model.h"
#include "ops/elementwise.h"

#ifdef MT_WITH_NCCL
#include "comm/nccl/peer_copy.h"
#else
namespace mt {

// Without NCCL there are no copy-engine collectives: peer_copy_ stays null, but its deleter
// needs a complete type.
class PeerCopyGroup {};
}  // namespace mt
#endif

namespace mt {

namespace {

// The FP8 gather writes its bytes into the bucket's fp32 gradients (consumed by the optimizer step
// that precedes it on the same stream) unless the gathers overlap the next step, whose
// zero_grad_buffer and backward write them, or the gradients are staged (shard_grads).
bool fp8_gather_in_grads(const DdpConfig& c) { return !c.overlap_param_gather && !c.shard_grads; }

int64_t largest_bucket(const std::vector<ParamBucket>& bks) {
  int64_t n = 0;
  for (const ParamBucket& bk : bks) n = std::max(n, bk.numel());
  return n;
}

}  // namespace

GradSync::GradSync(ParamStore& params, std::shared_ptr<Communicator> dp, const DdpConfig& config,
                   std::shared_ptr<Communicator> edp)
    : params_(params),
      dp_(dp ? std::move(dp) : std::make_shared<SingleRankCommunicator>("dp")),
      edp_(edp ? std::move(edp) : dp_),
      config_(config),
      comm_(params.device()),
      compute_ready_(params.device()),
      comm_done_(params.device()) {
  MT_REQUIRE(!config.overlap_param_gather || config.use_distributed_optimizer,
             "--overlap-param-gather requires --use-distributed-optimizer");
  MT_REQUIRE(!config.shard_grads || config.use_distributed_optimizer,
             "sharded gradients (--data-parallel-sharding-strategy optim_grads) need the distributed optimizer");
  MT_REQUIRE(!config.shard_grads || !config.copy_engine,
             "--ddp-copy-engine with --data-parallel-sharding-strategy optim_grads is not built (docs/fsdp.md)");
  MT_REQUIRE(config.grad_slots >= 0, "DdpConfig::grad_slots must be >= 0, got {}", config.grad_slots);
  MT_REQUIRE(!config.shard_params || config.shard_grads,
             "sharded parameters (--data-parallel-sharding-strategy optim_grads_params) need sharded gradients");
  MT_REQUIRE(!config.shard_params || !config.overlap_param_gather,
             "--overlap-param-gather with --data-parallel-sharding-strategy optim_grads_params: the parameters are "
             "all-gathered per unit before use (prefetched) instead of after the optimizer step; drop the flag");
  MT_REQUIRE(config.param_slots >= 0, "DdpConfig::param_slots must be >= 0, got {}", config.param_slots);
  const int k = config.num_distributed_optimizer_instances;
  MT_REQUIRE(k == 1 || config.use_distributed_optimizer,
             "--num-distributed-optimizer-instances {} needs the distributed optimizer (--use-distributed-optimizer): "
             "the instances are replicas of the sharded optimizer state",
             k);
  MT_REQUIRE(k == 1 || !config.copy_engine,
             "--ddp-copy-engine with --num-distributed-optimizer-instances {} is not built (docs/fsdp.md)", k);
  const bool same = edp_ == dp_;
  if (k != 1) {
    // Hybrid sharding: this rank's instance (contiguous group ranks, the shard group) and its
    // replica group (the same position in every instance). Both are communicators of our own.
    const auto split = [k](std::shared_ptr<Communicator>& g, std::shared_ptr<Communicator>& inter) {
      const int n = instance_group_size(g->size(), k, g->name()), r = g->rank();
      auto intra = g->split(r / n, r % n, g->name() + "-instance");
      inter = g->split(r % n, r / n, g->name() + "-replicas");
      g = std::move(intra);
    };
    split(dp_, inter_dp_);
    if (same) {
      edp_ = dp_;
      inter_edp_ = inter_dp_;
    } else {
      split(edp_, inter_edp_);
    }
  } else {
    inter_dp_ = std::make_shared<SingleRankCommunicator>("dp-replicas");
    inter_edp_ = inter_dp_;
  }
  const int n_dp = dp_->size();
  // With overlap the bucket collectives run on this object's communication stream while the
  // caller keeps using its DP communicator on its own stream (loss logging, evaluation). One NCCL
  // communicator must not be used from two streams concurrently, so take a communicator of our
  // own (a collective split over the DP group; hybrid sharding's groups are already our own).
  const int n_edp = edp_->size();
  const bool own = k == 1 && (config.overlap_grad_reduce || config.overlap_param_gather);
  if (own && n_dp > 1) dp_ = dp_->split(0, dp_->rank(), dp_->name() + "-buckets");
  if (same) {
    edp_ = dp_;
  } else if (own && n_edp > 1) {
    edp_ = edp_->split(0, edp_->rank(), edp_->name() + "-buckets");
  }
  distributed_ = config.use_distributed_optimizer && (n_dp > 1 || n_edp > 1);
  const auto& bks = params.buckets();
  if (distributed_) {
    if (const ParamBucket* bk = unshardable_bucket())
      MT_FAIL("bucket {} (elements [{}, {}), {} of them) is not a multiple of kAlign * {} = {} * {}: the ParamStore "
              "was laid out for data-parallel size {} (expert {}) but the group has {} ranks",
              bk - bks.data(), bk->begin, bk->end, bk->numel(), bk->expert ? "EDP" : "DP", ParamStore::kAlign,
              group(*bk).size(), params.layout().data_parallel_size, params.layout().edp(), group(*bk).size());
  }
  for (size_t b = bks.size(); b-- > 0;) {  // ascending offsets
    const ParamStore::Range r = owned_range(b);
    if (r.end > r.begin) owned_.push_back(r);
    owned_elements_ += r.end - r.begin;
  }
  if (config.grad_reduce_in_bf16 && (n_dp > 1 || n_edp > 1 || inter_dp_->size() > 1 || inter_edp_->size() > 1))
    bf16_comm_ = Buffer(params.device(), static_cast<size_t>(largest_bucket(bks)) * 2);
  if (config.shard_grads) {
    // The interleaved schedule runs the backwards of several model chunks (and micro-batches) in
    // turn: a staged bucket must be completed by the backward of the one chunk that writes it.
    for (size_t b = 0; b < bks.size(); ++b) {
      const ParamBucket& bk = bks[b];
      for (size_t i = bk.param_begin; i + 1 < bk.param_end; ++i) {  // every neighbouring pair
        const int c0 = params.info(i).model_chunk, c1 = params.info(i + 1).model_chunk;
        MT_REQUIRE(c0 == c1,
                   "sharded gradients (--data-parallel-sharding-strategy optim_grads): bucket {} holds parameters of "
                   "model chunks {} ('{}') and {} ('{}'), whose backwards interleave; lay the store out with "
                   "ParamLayout::split_model_chunks (docs/fsdp.md)",
                   b, c0, params.info(i).name, c1, params.info(i + 1).name);
      }
    }
    Stream s(params.device());
    params.use_grad_slots(config.grad_slots > 0 ? config.grad_slots : params.grad_slots_needed(), s);
    shard_offset_.assign(bks.size(), 0);
    int64_t off = 0;
    for (size_t b = bks.size(); b-- > 0;) {  // ascending offsets, as owned_
      shard_offset_[b] = off;
      off += owned_range(b).end - owned_range(b).begin;
    }
    shard_ = Buffer(params.device(), static_cast<size_t>(std::max<int64_t>(owned_elements_, 1)) * 4);
    memset_tensor(grad_shard(), 0, s);
    s.synchronize();
  }
  if (config.shard_params) {
    std::vector<ParamStore::Range> owned(bks.size());
    for (size_t b = 0; b < bks.size(); ++b) owned[b] = owned_range(b);
    Stream s(params.device());
    params.use_param_slots(owned, config.param_slots > 0 ? config.param_slots : params.param_slots_needed(), s);
    s.synchronize();
    param_refs_.assign(bks.size(), 0);
    param_pending_.assign(bks.size(), 0);
    // The gathers run on comm_ beside the compute stream's collectives (the gradient
    // reduce-scatters on dp_): a communicator of their own.
    gather_dp_ = distributed_ && dp_->size() > 1 ? dp_->split(0, dp_->rank(), dp_->name() + "-params") : dp_;
    // The expert buckets' gathers over the expert-data-parallel group, likewise.
    gather_edp_ = edp_ == dp_ ? gather_dp_
                  : distributed_ && edp_->size() > 1 ? edp_->split(0, edp_->rank(), edp_->name() + "-params")
                                                     : edp_;
  }
  setup_copy_engine();
  for (size_t b = 0; b < bks.size(); ++b) gathered_.push_back(std::make_unique<Event>(params.device()));
  if (grads_overlapped()) {
    for (size_t b = 0; b < bks.size(); ++b) released_.push_back(std::make_unique<Event>(params.device()));
    bracketed_.assign(params.size(), 0);
    grad_writers_.assign(bks.size(), 0);
  }
  ready_.assign(params.size(), 0);
  waiting_.assign(bks.size(), 0);
  launched_.assign(bks.size(), 0);
  gather_pending_.assign(bks.size(), 0);
  reset_grad_state();
}

void GradSync::setup_copy_engine() {
  if (!config_.copy_engine) {
    why_not_copy_engine_ = "not requested (--ddp-copy-engine)";
    return;
  }
  if (dp_->size() < 2) {
    why_not_copy_engine_ = "a data-parallel group of one rank";
    return;
  }
  if (const ParamBucket* bk = unshardable_bucket()) {
    why_not_copy_engine_ = fmt::format("bucket [{}, {}) is not a multiple of {} elements", bk->begin, bk->end,
                                       ParamStore::kAlign * dp_->size());
    return;
  }
#ifdef MT_WITH_NCCL
  auto nccl = std::dynamic_pointer_cast<NcclCommunicator>(dp_);
  if (!nccl) {
    why_not_copy_engine_ = "the data-parallel group is not an NCCL group";
    return;
  }
  // Staging: two generations of one slot per rank, each at most 4M fp32 values (16 MiB), which
  // is enough to keep the copies streaming; longer bucket slices are reduced in pieces.
  const int64_t max_chunk = std::max<int64_t>(1, largest_bucket(params_.buckets()) / dp_->size());
  const size_t stage = static_cast<size_t>(std::min<int64_t>(max_chunk, int64_t{4} << 20));
  const Tensor g = params_.grads_flat(), p = params_.params_flat();
  std::vector<PeerCopyGroup::Region> regions = {{g.data(), g.nbytes()}, {p.data(), p.nbytes()}};
  if (bf16_comm_.data()) regions.push_back({bf16_comm_.data(), bf16_comm_.bytes()});  // region 2
  peer_copy_ = PeerCopyGroup::create(nccl, regions, stage, &why_not_copy_engine_);
#else
  why_not_copy_engine_ = "built without NCCL";
#endif
}

const ParamBucket* GradSync::unshardable_bucket() const {
  for (const ParamBucket& bk : params_.buckets())
    if (bk.numel() % (ParamStore::kAlign * group(bk).size()) != 0) return &bk;
  return nullptr;
}

int instance_group_size(int group_size, int instances, const std::string& group) {
  MT_REQUIRE(instances >= 1, "--num-distributed-optimizer-instances must be >= 1, got {}", instances);
  MT_REQUIRE(group_size % instances == 0,
             "--num-distributed-optimizer-instances {}: the data-parallel group '{}' of {} ranks does not split into "
             "{} instances of equal size ({} is not divisible by {})",
             instances, group, group_size, instances, group_size, instances);
  return group_size / instances;
}

GradSync::~GradSync() {
  try {
    comm_.synchronize();  // no collective may still write into the buffers
  } catch (...) {
  }
}

ParamStore::Range GradSync::owned_range(size_t bucket) const {
  const ParamBucket& bk = params_.buckets().at(bucket);
  const Communicator& g = group(bk);
  if (!distributed_ || g.size() < 2) return {bk.begin, bk.end};
  const int64_t n = bk.numel() / g.size();
  return {bk.begin + g.rank() * n, bk.begin + (g.rank() + 1) * n};
}

void GradSync::reset_grad_state() {
  const auto& bks = params_.buckets();
  std::fill(ready_.begin(), ready_.end(), 0);
  for (size_t b = 0; b < bks.size(); ++b) waiting_[b] = bks[b].param_end - bks[b].param_begin;
  std::fill(launched_.begin(), launched_.end(), 0);
  n_launched_ = 0;
  comm_used_ = false;
  finished_ = false;
}

size_t GradSync::grad_reductions_launched() const { return n_launched_; }

Tensor GradSync::grad_shard() const {
  MT_REQUIRE(config_.shard_grads, "grad_shard: the gradients are not sharded (--data-parallel-sharding-strategy)");
  return shard_.as(DType::kF32, {owned_elements_});
}

int64_t GradSync::grad_bytes() const {
  return params_.grad_storage_bytes() + static_cast<int64_t>(shard_.bytes());
}


void GradSync::reduce_into_shard(size_t b, const Stream& stream) {
  const ParamBucket& bk = params_.buckets()[b];
  Communicator& grp = group(bk);
  const Tensor g = params_.bucket_grads(b);
  const ParamStore::Range r = owned_range(b);
  const int64_t o = r.begin - bk.begin, n = r.end - r.begin;
  if (grp.size() > 1) {  // (hybrid sharding: the replicas' all-reduce follows in finish_grad_sync)
    if (bf16_comm_.data() != nullptr) {
      const Tensor c = bf16_comm_.as(DType::kBF16, {bk.numel()});
      cast(c, g, stream);
      grp.reduce_scatter(c.flat_range(o, n), c, ReduceOp::kSum, stream);
      cast(g.flat_range(o, n), c.flat_range(o, n), stream);
    } else {
      grp.reduce_scatter(g.flat_range(o, n), g, ReduceOp::kSum, stream);
    }
  }
  const Tensor dst = grad_shard().flat_range(shard_offset_[b], n);
  add(dst, dst, g.flat_range(o, n), stream);
  memset_tensor(g, 0, stream);  // a free slot holds zeros
  if (&stream == &comm_) {  // overlapped: the slot stays bound until retired (retire_grad_slots)
    MT_CHECK(std::find(in_flight_.begin(), in_flight_.end(), b) == in_flight_.end(),
             "bucket {} reduced into the shard again while its last reduction is in flight", b);
    released_[b]->record(comm_);
    in_flight_.push_back(b);
  } else {
    params_.release_grad_slot(b);
  }
  for (size_t i = bk.param_begin; i < bk.param_end; ++i) ready_[i] = 0;
  waiting_[b] = bk.param_end - bk.param_begin;
  if (!launched_[b]) ++n_launched_;
  launched_[b] = 1;
}

const Stream& GradSync::reduce_stream(const Stream& stream, bool& recorded) {
  if (!config_.overlap_grad_reduce) return stream;
  if (!recorded) {  // the gradients reported so far are complete once the compute stream gets here
    comm_after(stream);
    recorded = true;
  }
  comm_used_ = true;
  return comm_;
}

void GradSync::comm_after(const Stream& stream) {
  compute_ready_.record(stream);
  compute_ready_.wait(comm_);
}

void GradSync::wait_for_comm(const Stream& stream) {
  comm_done_.record(comm_);
  comm_done_.wait(stream);
}

void GradSync::reduce_complete_buckets(size_t lo, size_t hi, const Stream& stream) {
  bool recorded = false;
  for (size_t b = lo; b <= hi; ++b)
    if (waiting_[b] == 0) reduce_into_shard(b, reduce_stream(stream, recorded));
  if (!grads_overlapped()) return;
  // A bucket some writer fills without a backward bracket (which would retire it first) goes
  // back now; then room for the binds before the next hook.
  retire_through_last([&](size_t b) { return holds_unbracketed(b); }, stream);
  make_room_for_grads(stream);
}

void GradSync::retire_grad_slots(size_t n, const Stream& stream) {
  if (n == 0) return;
  released_[in_flight_[n - 1]]->wait(stream);  // comm_ is in order: the older ones are done too
  for (size_t k = 0; k < n; ++k) params_.release_grad_slot(in_flight_[k]);
  in_flight_.erase(in_flight_.begin(), in_flight_.begin() + static_cast<std::ptrdiff_t>(n));
}

template <class Pick>
void GradSync::retire_through_last(Pick pick, const Stream& stream) {
  size_t n = 0;
  for (size_t k = 0; k < in_flight_.size(); ++k)
    if (pick(in_flight_[k])) n = k + 1;
  retire_grad_slots(n, stream);
}

bool GradSync::holds_unbracketed(size_t b) const {
  const ParamBucket& bk = params_.buckets()[b];
  for (size_t i = bk.param_begin; i < bk.param_end; ++i)
    if (!bracketed_[i]) return true;
  return false;
}

void GradSync::make_room_for_grads(const Stream& stream) {
  if (in_flight_.empty()) return;
  // What may be bound before the next hook: the unbound buckets of the open brackets,
  // and those holding parameters whose writers have no bracket. (Retiring changes neither set: an
  // in-flight bucket is bound, and one of either kind is retired before it could be in flight.)
  const auto& bks = params_.buckets();
  int64_t dense_needed = 0, dense_bound = 0;
  bool expert_needed = false;
  for (size_t b = 0; b < bks.size(); ++b) {
    if (params_.grad_bound(b)) {
      dense_bound += bks[b].expert ? 0 : 1;
      continue;
    }
    if (grad_writers_[b] == 0 && !holds_unbracketed(b)) continue;
    if (bks[b].expert) expert_needed = true;
    else ++dense_needed;
  }
  // One expert slot (ParamStore::expert_grad_slots_needed): no expert bucket in flight when one
  // will be bound.
  if (expert_needed) retire_through_last([&](size_t b) { return bks[b].expert; }, stream);
  int64_t short_by = dense_needed - (params_.grad_slots() - dense_bound);
  size_t n = 0;
  for (; n < in_flight_.size() && short_by > 0; ++n) short_by -= bks[in_flight_[n]].expert ? 0 : 1;
  retire_grad_slots(n, stream);
}

void GradSync::all_reduce_shard_over_instances(const Stream& stream) {
  const auto& bks = params_.buckets();
  for (size_t b = bks.size(); b-- > 0;) {  // ascending offsets
    Communicator& rep = replicas(bks[b]);
    const ParamStore::Range r = owned_range(b);
    const int64_t n = r.end - r.begin;
    if (rep.size() < 2 || n == 0) continue;
    const Tensor s = grad_shard().flat_range(shard_offset_[b], n);
    if (bf16_comm_.data() != nullptr) {  // in the reduction dtype, as the reduce-scatter
      const Tensor c = bf16_comm_.as(DType::kBF16, {n});
      cast(c, s, stream);
      rep.all_reduce(c, ReduceOp::kSum, stream);
      cast(s, c, stream);
    } else {
      rep.all_reduce(s, ReduceOp::kSum, stream);
    }
  }
}

std::pair<size_t, size_t> GradSync::bucket_span(size_t first, size_t end) const {
  return {params_.bucket_of(end - 1), params_.bucket_of(first)};
}

void GradSync::launch_grad_reduce(size_t b, const Stream& stream, bool exposed) {
  launched_[b] = 1;
  ++n_launched_;
  const ParamBucket& bk = params_.buckets()[b];
  Communicator& grp = group(bk);
  Communicator& rep = replicas(bk);
  if (grp.size() < 2 && rep.size() < 2) return;
  const Tensor g = params_.grads_flat().flat_range(bk.begin, bk.numel());
  // What is reduced: the fp32 gradients in place, or (--grad-reduce-in-bf16) their bf16 rounding
  // in the communication buffer, widened back afterwards.
  const bool bf16 = bf16_comm_.data() != nullptr;
  const Tensor c = bf16 ? bf16_comm_.as(DType::kBF16, {bk.numel()}) : g;
  if (bf16) cast(c, g, stream);
  const ParamStore::Range r = owned_range(b);  // the whole bucket without the distributed optimizer
  const Tensor owned = c.flat_range(r.begin - bk.begin, r.end - r.begin);
  bool copy_engine = false;
#ifdef MT_WITH_NCCL
  if (peer_copy_ && !exposed && !bk.expert) {  // region 0: fp32 gradients; region 2: bf16 buffer, bucket at 0
    copy_engine = true;
    const int region = bf16 ? 2 : 0;
    const size_t offset = bf16 ? 0 : static_cast<size_t>(bk.begin), es = dtype_size(c.dtype());
    const size_t m = static_cast<size_t>(bk.numel() / dp_->size());
    peer_copy_->reduce_scatter_sum(region, offset, m, c.dtype(), stream);
    if (!distributed_) peer_copy_->all_gather(region, offset * es, m * es, stream);
    ++copy_engine_collectives_;
  }
#endif
  if (!copy_engine && grp.size() > 1) {
    if (distributed_) grp.reduce_scatter(owned, c, ReduceOp::kSum, stream);
    else grp.all_reduce(c, ReduceOp::kSum, stream);
  }
  if (rep.size() > 1) rep.all_reduce(owned, ReduceOp::kSum, stream);  // hybrid sharding: over the instances
  if (bf16) cast(g.flat_range(r.begin - bk.begin, r.end - r.begin), owned, stream);
}

void GradSync::launch_param_gather(size_t b, const Stream& stream, bool exposed) {
  const ParamBucket& bk = params_.buckets()[b];
  Communicator& grp = group(bk);
  if (grp.size() < 2) return;
  const Tensor p = params_.params_flat().flat_range(bk.begin, bk.numel());
  const ParamStore::Range r = owned_range(b);
#ifdef MT_WITH_NCCL
  if (peer_copy_ && !exposed && !bk.expert && (fp8_buckets_.empty() || fp8_buckets_[b].pieces.empty())) {
    const size_t es = dtype_size(p.dtype());
    peer_copy_->all_gather(1, static_cast<size_t>(bk.begin) * es, static_cast<size_t>(r.end - r.begin) * es, stream);
    ++copy_engine_collectives_;
    return;
  }
#endif
  if (!fp8_buckets_.empty() && !fp8_buckets_[b].pieces.empty()) {
    launch_fp8_gather(b, stream);
    return;
  }
  grp.all_gather(p, p.flat_range(r.begin - bk.begin, r.end - r.begin), stream);
}

void GradSync::launch_model_gather(size_t b, const Stream& stream) {
  const ParamBucket& bk = params_.buckets()[b];
  const Tensor p = params_.params_flat().flat_range(bk.begin, bk.numel());
  const ParamStore::Range r = owned_range(b);
  group(bk).all_gather(p, p.flat_range(r.begin - bk.begin, r.end - r.begin), stream);
}

void GradSync::zero_grad_buffer(const Stream& stream) {
  if (comm_used_ && !finished_) wait_for_comm(stream);  // an abandoned step: its reductions still write the gradients
  retire_grad_slots(in_flight_.size(), stream);
  // Every step starts with nothing bound (CUDA graphs: the step a graph captured and every step it
  // replays for take the same binding decisions): a use since start_param_sync (a validation
  // forward not ended with end_param_use) may have left parameter slots gathered.
  release_param_slots();
  params_.zero_grads(stream);  // (staged gradients: every slot zeroed and unbound)
  if (config_.shard_grads) memset_tensor(grad_shard(), 0, stream);
  reset_grad_state();
}

void GradSync::grads_ready(size_t first, size_t end, const Stream& stream) {
  MT_REQUIRE(first <= end && end <= params_.size(), "grads_ready: parameter range [{}, {}) outside [0, {})", first,
             end, params_.size());
  MT_REQUIRE(!finished_,
             "grads_ready({}, {}) after finish_grad_sync in the same step: the gradients were already reduced "
             "(call zero_grad_buffer or run the optimizer step first)",
             first, end);
  if (first == end) return;
  for (size_t i = first; i < end; ++i) {
    MT_REQUIRE(!ready_[i], "grads_ready: parameter {} ('{}') reported twice in one {}", i, params_.info(i).name,
               config_.shard_grads ? "backward (before its bucket was reduced)" : "step");
    ready_[i] = 1;
    --waiting_[params_.bucket_of(i)];
  }
  const auto [lo, hi] = bucket_span(first, end);
  if (config_.shard_grads) {
    reduce_complete_buckets(lo, hi, stream);
    return;
  }
  if (!config_.overlap_grad_reduce) return;
  bool recorded = false;
  for (size_t b = lo; b <= hi; ++b) {
    if (waiting_[b] != 0 || launched_[b]) continue;
    // The bucket that completes the backward's reductions is on the critical path.
    const bool exposed = grad_reductions_launched() + 1 == launched_.size();
    launch_grad_reduce(b, reduce_stream(stream, recorded), exposed);
  }
}

void GradSync::finish_grad_sync(const Stream& stream) {
  if (finished_) return;
  const size_t unwritten = params_.untaken_first_write();
  MT_CHECK(unwritten == ParamStore::kNoParam,
           "finish_grad_sync: no backward of this step wrote the gradient of '{}' (declared grad_overwrite, so "
           "zero_grad_buffer left it holding the last step's values)",
           params_.info(unwritten).name);
  finish_param_sync(stream);
  const size_t nb = params_.buckets().size();
  if (config_.shard_grads) {
    // Every bucket was reduced when its last parameter was reported; one partly reported now
    // means a backward that did not report all its parameters.
    for (size_t b = 0; b < nb; ++b) {
      const ParamBucket& bk = params_.buckets()[b];
      for (size_t i = bk.param_begin; i < bk.param_end; ++i)
        MT_CHECK(!ready_[i] || waiting_[b] == 0,
                 "finish_grad_sync: bucket {} is partly reported ('{}' reported, not all of [{}, {})): its gradients "
                 "were never reduced into the shard",
                 b, params_.info(i).name, bk.param_begin, bk.param_end);
      if (launched_[b]) continue;
      // Nothing reported (no backward): zeros, collectives matched; retired at once (binds a slot).
      bool recorded = false;
      reduce_into_shard(b, reduce_stream(stream, recorded));
      retire_grad_slots(in_flight_.size(), stream);
    }
    retire_grad_slots(in_flight_.size(), stream);  // the shard is complete after this
    all_reduce_shard_over_instances(stream);
    // The step's parameter uses are over (the gathers were joined above; the optimizer writes the
    // owned slices, start_param_sync would return the slots): the step ends with nothing bound.
    release_param_slots();
    finished_ = true;
    return;
  }
  bool recorded = false;
  for (size_t b = 0; b < nb; ++b)
    if (!launched_[b]) launch_grad_reduce(b, reduce_stream(stream, recorded), true);
  if (comm_used_) wait_for_comm(stream);
  finished_ = true;
}

void GradSync::mark_replayed_grad_sync() {
  // A replay runs no host code: the state before it is the one the previous step (or the capture)
  // ended in, which must be a step boundary's for the replayed bindings to be the captured ones.
  const std::string live = live_host_state();
  MT_CHECK(live.empty(), "mark_replayed_grad_sync: the host state before the replayed step is not a step boundary's "
                         "({}): the graph's bindings would not be the host's",
           live);
  const auto& bks = params_.buckets();
  if (config_.shard_grads) {  // as reduce_into_shard leaves every bucket: reportable again
    std::fill(ready_.begin(), ready_.end(), 0);
    for (size_t b = 0; b < bks.size(); ++b) waiting_[b] = bks[b].param_end - bks[b].param_begin;
  } else {
    std::fill(ready_.begin(), ready_.end(), 1);
    std::fill(waiting_.begin(), waiting_.end(), 0);
  }
  std::fill(launched_.begin(), launched_.end(), 1);
  n_launched_ = launched_.size();
  comm_used_ = config_.overlap_grad_reduce && !bks.empty();  // every reduction went through reduce_stream
  finished_ = true;
}

void GradSync::mark_replayed_param_sync() {
  MT_CHECK(finished_, "mark_replayed_param_sync before mark_replayed_grad_sync");
  reset_grad_state();
  release_param_slots();
  if (fp8_param_gather_active()) {  // start_param_sync's host flags (its gathers were in the graph)
    fp8_->set_weights_gathered(true);
    model_params_stale_ = true;
  }
}

void GradSync::release_param_slots() {
  if (!config_.shard_params) return;
  prefetch_lo_ = prefetch_hi_ = kNone;
  release_idle_params(kNone, kNone, kNone, kNone);
}

void GradSync::end_param_use(const Stream& stream) {
  finish_param_sync(stream);  // the gathers (prefetches too) joined before the slots go back
  release_param_slots();
}

std::string GradSync::live_host_state() const {
  std::string out;
  const auto note = [&out](const std::string& what, const std::vector<size_t>& buckets) {
    if (buckets.empty()) return;
    out += fmt::format("{}{} (buckets {})", out.empty() ? "" : "; ", what, fmt::join(buckets, ", "));
  };
  const auto pick = [this](auto pred) {
    std::vector<size_t> v;
    for (size_t b = 0; b < params_.buckets().size(); ++b)
      if (pred(b)) v.push_back(b);
    return v;
  };
  if (params_.grads_staged()) note("gradient slots bound", pick([&](size_t b) { return params_.grad_bound(b); }));
  note("reduce-scatters in flight", std::vector<size_t>(in_flight_.begin(), in_flight_.end()));
  if (!grad_writers_.empty()) note("backward brackets open", pick([&](size_t b) { return grad_writers_[b] > 0; }));
  if (config_.shard_params) {
    note("parameter slots bound", pick([&](size_t b) { return params_.param_bound(b); }));
    note("units open", pick([&](size_t b) { return param_refs_[b] > 0; }));
    note("gathers not waited for", pick([&](size_t b) { return param_pending_[b] != 0; }));
  }
  note("all-gathers not waited for", pick([&](size_t b) { return gather_pending_[b] != 0; }));
  if (param_comm_used_) out += std::string(out.empty() ? "" : "; ") + "parameter gathers not joined back";
  return out;
}

std::string GradSync::host_state() const {
  const auto bits = [](const auto& v) {
    std::string s;
    for (const auto x : v) s += x ? '1' : '0';
    return s;
  };
  const auto& bks = params_.buckets();
  std::string slots;
  for (size_t b = 0; b < bks.size(); ++b)
    slots += fmt::format("{}{}/{}", b ? " " : "", params_.grads_staged() ? params_.grad_slot_of(b) : -1,
                         config_.shard_params ? params_.param_slot_of(b) : -1);
  return fmt::format("finished {} comm_used {} launched {} ({}) ready {} waiting {} in_flight [{}] writers [{}] "
                     "refs [{}] pending {} prefetch {}..{} param_comm {} gather_pending {} bracketed {} "
                     "slots (grad/param) [{}] live '{}'",
                     finished_, comm_used_, n_launched_, bits(launched_), bits(ready_), fmt::join(waiting_, ","),
                     fmt::join(in_flight_, ","), fmt::join(grad_writers_, ","), fmt::join(param_refs_, ","),
                     bits(param_pending_), prefetch_lo_ == kNone ? -1 : static_cast<int64_t>(prefetch_lo_),
                     prefetch_hi_ == kNone ? -1 : static_cast<int64_t>(prefetch_hi_), param_comm_used_,
                     bits(gather_pending_), bits(bracketed_), slots, live_host_state());
}

void GradSync::gather_into_slot(size_t b, const Stream& stream) {
  if (params_.param_bound(b)) return;
  const Tensor slot = params_.bind_param_slot(b), shard = params_.bucket_param_shard(b);
  // After every kernel enqueued so far: the readers of the slot's previous binding, the
  // optimizer's writes of the shard.
  comm_after(stream);
  Communicator& g = params_.buckets()[b].expert ? *gather_edp_ : *gather_dp_;
  if (distributed_ && g.size() > 1) {
    g.all_gather(slot, shard, comm_);
  } else {
    copy(slot, shard, comm_);  // one rank owns the whole bucket
  }
  gathered_[b]->record(comm_);
  param_pending_[b] = 1;
  param_comm_used_ = true;
  ++param_gathers_;
}

void GradSync::release_idle_params(size_t keep_lo, size_t keep_hi, size_t keep_lo2, size_t keep_hi2) {
  for (size_t b = 0; b < param_refs_.size(); ++b) {
    if (param_refs_[b] > 0 || (b >= keep_lo && b <= keep_hi) || (b >= keep_lo2 && b <= keep_hi2) ||
        params_.param_resident(b))
      continue;
    params_.release_param_slot(b);
    param_pending_[b] = 0;  // a gather still in flight: the next one into the slot is ordered after it on comm_
  }
}

void GradSync::begin_grad_writes(size_t first, size_t end, bool backward, const Stream& stream) {
  const auto [lo, hi] = bucket_span(first, end);
  // Only a backward bracket marks its parameters: the embedding's forward is bracketed, its
  // backward is not.
  if (backward)
    for (size_t i = first; i < end; ++i) bracketed_[i] = 1;
  for (size_t b = lo; b <= hi; ++b) ++grad_writers_[b];
  // The use may write these buckets again (a backward; a forward too: the output layer's fused
  // loss writes its weight gradient): their last reductions must be done with the slots.
  retire_through_last([&](size_t b) { return b >= lo && b <= hi; }, stream);
  make_room_for_grads(stream);
}

void GradSync::params_begin(size_t first, size_t end, bool backward, size_t next_first, size_t next_end,
                            const Stream& stream) {
  MT_REQUIRE(first <= end && end <= params_.size() && next_first <= next_end && next_end <= params_.size(),
             "params_begin: parameter ranges [{}, {}) and next [{}, {}) outside [0, {})", first, end, next_first,
             next_end, params_.size());
  if (first == end) return;
  if (grads_overlapped()) {
    begin_grad_writes(first, end, backward, stream);
    if (!config_.shard_params) params_needed(first, end, stream);  // called instead of params_needed
  }
  if (!config_.shard_params) return;
  const auto [lo, hi] = bucket_span(first, end);
  const bool prefetch = next_first < next_end;
  const auto [plo, phi] = prefetch ? bucket_span(next_first, next_end) : std::pair{prefetch_lo_, prefetch_hi_};
  // Slots of buckets neither this unit nor the prefetch reads go back first (the last unit's
  // shared bucket, an earlier prefetch the pass did not reach).
  release_idle_params(lo, hi, plo, phi);
  for (size_t b = lo; b <= hi; ++b) {
    if (params_.param_resident(b)) continue;
    if (params_.buckets()[b].expert) free_expert_slot(b);
    gather_into_slot(b, stream);
    ++param_refs_[b];
  }
  for (size_t b = lo; b <= hi; ++b) {
    if (!param_pending_[b]) continue;
    gathered_[b]->wait(stream);
    param_pending_[b] = 0;
  }
  if (!prefetch) return;
  prefetch_lo_ = plo;
  prefetch_hi_ = phi;
  for (size_t k = 0; k <= phi - plo; ++k) {  // beside this unit's compute, in the pass's order
    const size_t b = backward ? plo + k : phi - k;
    if (params_.param_resident(b)) continue;
    // An expert bucket whose slot another MoE layer holds (the unit in use: with full recompute
    // the backward of a group's first layer names the previous group's first layer, n layers
    // earlier) is gathered at its own params_begin instead.
    if (params_.buckets()[b].expert && !params_.param_bound(b)) {
      const int holder = params_.expert_param_slot_holder(b);
      if (holder >= 0 && holder != params_.moe_layer_of(b)) continue;
    }
    gather_into_slot(b, stream);
  }
}

void GradSync::free_expert_slot(size_t b) {
  if (params_.param_bound(b)) return;
  const int holder = params_.expert_param_slot_holder(b);
  if (holder < 0 || holder == params_.moe_layer_of(b)) return;
  // The holder's buckets no unit uses (a prefetch the pass did not reach, a kept boundary) go back;
  // one in use stays, and binding b is then an error naming both layers.
  for (size_t c = 0; c < param_refs_.size(); ++c) {
    if (params_.moe_layer_of(c) != holder || param_refs_[c] > 0) continue;
    params_.release_param_slot(c);
    param_pending_[c] = 0;  // a gather still in flight: the next one into the slot is ordered after it on comm_
  }
}

void GradSync::params_end(size_t first, size_t end, bool backward, const Stream& /*stream*/) {
  MT_REQUIRE(first <= end && end <= params_.size(), "params_end: parameter range [{}, {}) outside [0, {})", first, end,
             params_.size());
  if (first == end) return;
  if (grads_overlapped()) {
    const auto [glo, ghi] = bucket_span(first, end);
    for (size_t b = glo; b <= ghi; ++b) {
      MT_REQUIRE(grad_writers_[b] > 0, "params_end({}, {}): bucket {} was not begun (params_begin)", first, end, b);
      --grad_writers_[b];
    }
  }
  if (!config_.shard_params) return;
  const auto [lo, hi] = bucket_span(first, end);
  // The bucket this unit may share with the next unit of the pass: forward, the one holding its
  // last parameters (lowest index); backward, its first parameters (highest index).
  const size_t boundary = backward ? hi : lo;
  for (size_t b = lo; b <= hi; ++b) {
    if (params_.param_resident(b)) continue;
    MT_REQUIRE(param_refs_[b] > 0, "params_end({}, {}): bucket {} was not begun (params_begin)", first, end, b);
    if (--param_refs_[b] > 0 || b == boundary || (b >= prefetch_lo_ && b <= prefetch_hi_)) continue;
    params_.release_param_slot(b);  // freed after the unit's kernels (the next gather into it waits for them)
  }
}

void GradSync::start_param_sync(const Stream& stream) {
  reset_grad_state();  // the step's gradients have been consumed
  if (config_.shard_params) {
    // The slots (the expert slots too) hold the old parameters: every one goes back; the next use
    // gathers the updated owned slices.
    for (size_t b = 0; b < param_refs_.size(); ++b)
      MT_CHECK(param_refs_[b] == 0, "start_param_sync: bucket {} is still in use (params_begin without params_end)",
               b);
    prefetch_lo_ = prefetch_hi_ = kNone;
    release_idle_params(kNone, kNone, kNone, kNone);
    return;
  }
  if (!distributed_) return;
  const size_t nb = params_.buckets().size();
  if (fp8_param_gather_active()) {
    fp8_weight_scales(stream);  // before the gathers: their quantisation reads the scales
    fp8_->set_weights_gathered(true);
    model_params_stale_ = true;
  }
  if (config_.overlap_param_gather) {
    comm_after(stream);  // the optimizer's updates of the owned slices
    for (size_t b = nb; b-- > 0;) {  // forward order: the last bucket holds the first parameters
      launch_param_gather(b, comm_, b + 1 == nb);  // the forward waits for the first bucket at once
      gathered_[b]->record(comm_);
      gather_pending_[b] = 1;
    }
  } else {
    for (size_t b = nb; b-- > 0;) launch_param_gather(b, stream, true);
  }
}

void GradSync::params_needed(size_t first, size_t end, const Stream& stream) {
  MT_REQUIRE(first <= end && end <= params_.size(), "params_needed: parameter range [{}, {}) outside [0, {})", first,
             end, params_.size());
  if (first == end) return;
  const auto [lo, hi] = bucket_span(first, end);
  for (size_t b = lo; b <= hi; ++b) {
    if (!gather_pending_[b]) continue;
    gathered_[b]->wait(stream);
    gather_pending_[b] = 0;
  }
}

void GradSync::finish_param_sync(const Stream& stream) {
  if (param_comm_used_) {  // parameter gathers (prefetches) still in flight on comm_
    wait_for_comm(stream);
    param_comm_used_ = false;
  }
  for (size_t b = 0; b < gather_pending_.size(); ++b) {
    if (!gather_pending_[b]) continue;
    gathered_[b]->wait(stream);
    gather_pending_[b] = 0;
  }
}

void GradSync::set_fp8_param_gather(Fp8Model& fp8) {
  MT_REQUIRE(!config_.shard_params,
             "--fp8-param-gather with --data-parallel-sharding-strategy optim_grads_params is not built");
  MT_REQUIRE(config_.use_distributed_optimizer,
             "--fp8-param-gather requires --use-distributed-optimizer (its parameter all-gather carries the FP8 "
             "weights)");
  fp8_ = &fp8;
  fp8_linears_.clear();
  fp8_buckets_.assign(params_.buckets().size(), Fp8Bucket{});
  if (!distributed_) return;  // nothing gathered: each layer quantises its weights
  std::vector<std::vector<std::pair<int64_t, Fp8Linear*>>> weights(params_.buckets().size());
  for (Fp8Linear* l : fp8.linears()) {
    const size_t i = l->weight_index(), b = params_.bucket_of(i);
    const ParamBucket& bk = params_.buckets()[b];
    if (bk.expert || group(bk).size() < 2) continue;  // the experts keep the model-dtype gather
    MT_CHECK(params_.param(i).numel() == l->out() * l->in(), "{}: weight {} is not the FP8 linear's [{}, {}]",
             l->name(), params_.param(i).str(), l->out(), l->in());
    weights[b].emplace_back(params_.info(i).offset, l);
    fp8_linears_.push_back(l);
  }
  fp8.set_param_gather(fp8_linears_);
  int64_t largest = 0;
  for (size_t b = 0; b < weights.size(); ++b) {
    if (weights[b].empty()) continue;
    plan_fp8_bucket(b, std::move(weights[b]));
    largest = std::max(largest, fp8_buckets_[b].segment * group(params_.buckets()[b]).size());
  }
  if (fp8_linears_.empty()) return;
  fp8_in_grads_ = fp8_gather_in_grads(config_);
  if (!fp8_in_grads_) fp8_comm_ = Buffer(params_.device(), static_cast<size_t>((largest + 15) / 16 * 16));
  fp8_amax_ = Buffer(params_.device(), fp8_linears_.size() * sizeof(float));
}

namespace {
/// Bytes per rank of a bucket's FP8 gather buffer (GradSync::plan_fp8_bucket's segment): each rank's
/// slice of [begin, begin + numel) as model-dtype bytes (es each) outside the FP8 weights
/// [offset, offset + n) (sorted) and one byte per FP8 element inside, the largest rank's, rounded up
/// to 16.
int64_t fp8_segment_bytes(int64_t begin, int64_t numel, int ranks, int64_t es,
                          const std::vector<std::pair<int64_t, int64_t>>& weights) {
  const int64_t slice = numel / ranks;
  int64_t largest = 0;
  for (int d = 0; d < ranks; ++d) {
    const int64_t lo = begin + d * slice, hi = lo + slice;
    int64_t fp8 = 0;
    for (const auto& [offset, n] : weights) fp8 += std::max<int64_t>(0, std::min(hi, offset + n) - std::max(lo, offset));
    largest = std::max(largest, (slice - fp8) * es + fp8);
  }
  return (largest + 15) / 16 * 16;
}
}  // namespace

int64_t GradSync::fp8_param_gather_bytes(const ParamStore& store, const std::vector<std::string>& fp8_weights,
                                         int ranks, const DdpConfig& config) {
  if (ranks < 2) return 0;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> weights(store.buckets().size());
  int64_t gathered = 0, largest = 0;
  for (const std::string& name : fp8_weights) {
    const size_t i = store.find(name);
    if (i == ParamStore::kNoParam || store.buckets()[store.bucket_of(i)].expert) continue;
    weights[store.bucket_of(i)].emplace_back(store.info(i).offset, store.info(i).numel);
    ++gathered;
  }
  const int64_t es = static_cast<int64_t>(dtype_size(store.model_dtype()));
  for (size_t b = 0; b < weights.size(); ++b) {
    if (weights[b].empty()) continue;
    std::sort(weights[b].begin(), weights[b].end());
    const ParamBucket& bk = store.buckets()[b];
    largest = std::max(largest, fp8_segment_bytes(bk.begin, bk.numel(), ranks, es, weights[b]) * ranks);
  }
  if (gathered == 0) return 0;
  const int64_t comm = (largest + 15) / 16 * 16;
  return (fp8_gather_in_grads(config) ? 0 : comm) + gathered * static_cast<int64_t>(sizeof(float));
}

void GradSync::plan_fp8_bucket(size_t b, std::vector<std::pair<int64_t, Fp8Linear*>> weights) {
  const ParamBucket& bk = params_.buckets()[b];
  const int ranks = group(bk).size();
  const int64_t slice = bk.numel() / ranks, es = static_cast<int64_t>(dtype_size(params_.params_flat().dtype()));
  std::sort(weights.begin(), weights.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  Fp8Bucket& fb = fp8_buckets_[b];
  std::vector<int64_t> bytes(static_cast<size_t>(ranks), 0);
  for (int d = 0; d < ranks; ++d) {
    const int64_t lo = bk.begin + d * slice, hi = lo + slice;
    std::vector<Fp8Piece> fp8_pieces;
    int64_t at = lo, byte = 0;  // model-dtype pieces first (their bytes stay aligned), FP8 pieces after
    for (const auto& [offset, l] : weights) {
      const int64_t b0 = std::max(lo, offset), b1 = std::min(hi, offset + l->out() * l->in());
      if (b0 >= b1) continue;
      if (b0 > at) fb.pieces.push_back(Fp8Piece{d, at, b0 - at, nullptr, 0, byte, 0}), byte += (b0 - at) * es;
      const size_t k = static_cast<size_t>(std::find(fp8_linears_.begin(), fp8_linears_.end(), l) - fp8_linears_.begin());
      fp8_pieces.push_back(Fp8Piece{d, b0, b1 - b0, l, b0 - offset, 0, k});
      at = b1;
    }
    if (hi > at) fb.pieces.push_back(Fp8Piece{d, at, hi - at, nullptr, 0, byte, 0}), byte += (hi - at) * es;
    for (Fp8Piece& p : fp8_pieces) {
      p.byte = byte;
      byte += p.n;
      fb.pieces.push_back(p);
    }
    bytes[static_cast<size_t>(d)] = byte;
  }
  fb.segment = (*std::max_element(bytes.begin(), bytes.end()) + 15) / 16 * 16;
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const auto& [offset, l] : weights) spans.emplace_back(offset, l->out() * l->in());
  MT_CHECK(fb.segment == fp8_segment_bytes(bk.begin, bk.numel(), ranks, es, spans),
           "fp8 gather: bucket {}'s segment {} differs from the memory estimate's", b, fb.segment);
  for (Fp8Piece& p : fb.pieces) p.byte += p.rank * fb.segment;
  for (const auto& w : weights) fb.linears.push_back(w.second);
}

void GradSync::fp8_weight_scales(const Stream& stream) {
  if (fp8_->settings().recipe != Fp8Recipe::kTensorwise) return;  // delayed: the step's stored scales
  const Tensor amax = fp8_amax_.as(DType::kF32, {static_cast<int64_t>(fp8_linears_.size())});
  memset_tensor(amax, 0, stream);  // a weight none of whose elements this rank owns
  for (size_t b = 0; b < fp8_buckets_.size(); ++b) {
    const int me = group(params_.buckets()[b]).rank();
    for (const Fp8Piece& p : fp8_buckets_[b].pieces)
      if (p.linear && p.rank == me)
        p.linear->weight_piece_amax(amax.flat_range(static_cast<int64_t>(p.amax), 1), fp8_piece_values(p), stream);
  }
  fp8_->reduce_weight_amaxes(amax, stream);
  for (size_t k = 0; k < fp8_linears_.size(); ++k)
    fp8_linears_[k]->set_weight_scale(amax.flat_range(static_cast<int64_t>(k), 1), stream);
}

void GradSync::launch_fp8_gather(size_t b, const Stream& stream) {
  const ParamBucket& bk = params_.buckets()[b];
  Communicator& grp = group(bk);
  const Fp8Bucket& fb = fp8_buckets_[b];
  const int me = grp.rank();
  const int64_t bytes = fb.segment * grp.size();
  // The gathered bytes: in the bucket's fp32 gradients, consumed by the optimizer step before this
  // gather, or fp8_comm_.
  const Tensor g = fp8_in_grads_ ? params_.grads_flat().flat_range(bk.begin, bk.numel()) : Tensor();
  const Tensor region = fp8_in_grads_ ? Tensor(g.data(), DType::kU8, g.device(), {static_cast<int64_t>(g.nbytes())})
                                      : fp8_comm_.as(DType::kU8, {static_cast<int64_t>(fp8_comm_.bytes())});
  MT_CHECK(bytes <= region.numel(), "fp8 gather: bucket {} needs {} bytes, has {}", b, bytes, region.numel());
  const Tensor all = region.flat_range(0, bytes);
  const Tensor params = params_.params_flat();
  const DType md = params.dtype(), f = fp8_->settings().forward_dtype();
  auto at = [&](const Fp8Piece& p, DType dt) {
    return Tensor(static_cast<char*>(all.data()) + p.byte, dt, all.device(), {p.n});
  };
  for (const Fp8Piece& p : fb.pieces) {  // this rank's part: its owned values, the weights' quantised
    if (p.rank != me) continue;
    if (p.linear) p.linear->quantize_weight_piece(at(p, f), fp8_piece_values(p), stream);
    else copy(at(p, md), params.flat_range(p.begin, p.n), stream);
  }
  grp.all_gather(all, all.flat_range(me * fb.segment, fb.segment), stream);
  for (const Fp8Piece& p : fb.pieces) {
    if (p.linear) copy(p.linear->fp8_weight().flat_range(p.weight_begin, p.n), at(p, f), stream);
    else if (p.rank != me) copy(params.flat_range(p.begin, p.n), at(p, md), stream);
  }
  for (Fp8Linear* l : fb.linears) l->finish_weight_gather(stream);
}

Tensor GradSync::fp8_piece_values(const Fp8Piece& p) const {
  if (!p.linear->in_params()) return p.linear->weight_piece(Tensor(), p.weight_begin, p.n);
  MT_CHECK(params_.main_sharded() && !params_.main_remainders_stored(),
           "{}: an FP8 weight kept in its parameter storage is gathered from fp32 main parameter shards, but the main "
           "parameters are {}",
           p.linear->name(), params_.main_remainders_stored() ? "int16 remainders" : "not sharded");
  int64_t at = 0;  // the shard holds the owned ranges concatenated in ascending order
  for (const ParamStore::Range& r : params_.main_shard_ranges()) {
    if (p.begin >= r.begin && p.begin + p.n <= r.end)
      return p.linear->weight_piece(params_.main_shard().flat_range(at + p.begin - r.begin, p.n), p.weight_begin, p.n);
    at += r.end - r.begin;
  }
  MT_FAIL("{}: weight piece at flat [{}, {}) outside this rank's main parameter shard", p.linear->name(), p.begin,
          p.begin + p.n);
}

std::pair<int64_t, int64_t> GradSync::fp8_gather_bytes() const {
  int64_t fp8 = 0, model = 0;
  const int64_t es = static_cast<int64_t>(dtype_size(params_.params_flat().dtype()));
  for (size_t b = 0; b < fp8_buckets_.size(); ++b) {
    if (fp8_buckets_[b].pieces.empty()) continue;
    fp8 += fp8_buckets_[b].segment * group(params_.buckets()[b]).size();
    model += params_.buckets()[b].numel() * es;
  }
  return {fp8, model};
}

void GradSync::sync_model_params(const Stream& stream) {
  if (!model_params_stale_ || params_.has_separate_main()) return;
  finish_param_sync(stream);
  for (size_t b = fp8_buckets_.size(); b-- > 0;)
    if (!fp8_buckets_[b].pieces.empty()) launch_model_gather(b, stream);
  model_params_stale_ = false;
}

}  // namespace mt
