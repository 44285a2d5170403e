#include "model/params.h"

#include <fmt/ranges.h>

#include "core/rng.h"
#include "ops/elementwise.h"
#include "ops/optimizer.h"

namespace mt {

namespace {
int64_t round_up(int64_t x, int64_t q) { return (x + q - 1) / q * q; }
}  // namespace

int64_t default_ddp_bucket_size(int64_t data_parallel_size) {
  return std::max<int64_t>(40000000, 1000000 * data_parallel_size);
}

ParamStore::Plan ParamStore::plan(std::vector<ParamSpec> specs, const ParamLayout& layout) {
  const ParamStore laid_out(std::move(specs), DType::kF32, Device::cpu(), layout, /*allocate=*/false);
  Plan p;
  p.total = laid_out.total_;
  p.count = static_cast<int64_t>(laid_out.infos_.size());
  p.grad_slots = laid_out.grad_slots_needed();
  p.param_slots = laid_out.param_slots_needed();
  p.largest_dense_bucket = laid_out.largest_dense_bucket();
  p.expert_slot = laid_out.expert_slot_length();
  p.expert_param_slots = laid_out.expert_param_slots_needed();
  p.expert_grad_slots = laid_out.expert_grad_slots_needed();
  p.buckets = static_cast<int64_t>(laid_out.buckets_.size());
  for (const ParamBucket& b : laid_out.buckets_) {
    if (b.expert) p.expert += b.end - b.begin;
    p.largest_bucket = std::max(p.largest_bucket, b.end - b.begin);
  }
  return p;
}

std::unique_ptr<const ParamStore> ParamStore::laid_out(std::vector<ParamSpec> specs, DType model_dtype,
                                                      const ParamLayout& layout) {
  return std::unique_ptr<const ParamStore>(new ParamStore(std::move(specs), model_dtype, Device::cpu(), layout, false));
}

ParamStore::ParamStore(std::vector<ParamSpec> specs, DType model_dtype, Device device, const ParamLayout& layout,
                       bool allocate)
    : model_dtype_(model_dtype), device_(device), layout_(layout) {
  MT_CHECK(model_dtype == DType::kF32 || model_dtype == DType::kBF16 || model_dtype == DType::kF16,
           "parameter dtype must be fp32, bf16 or fp16, got {}", dtype_name(model_dtype));
  MT_REQUIRE(layout.data_parallel_size >= 1, "ParamLayout: data_parallel_size must be >= 1, got {}",
             layout.data_parallel_size);
  MT_REQUIRE(layout.bucket_size >= 0, "ParamLayout: bucket_size (--ddp-bucket-size) must be >= 0, got {}",
             layout.bucket_size);
  for (auto& s : specs) {
    ParamInfo info;
    static_cast<ParamSpec&>(info) = std::move(s);
    if (info.global_shape.empty()) info.global_shape = info.shape;
    if (info.shard_shape.empty()) info.shard_shape = info.shape;
    info.box = ShardBox::make(info.global_shape, info.shard_offset, info.shard_shape);
    info.numel = 1;
    for (auto d : info.shape) info.numel *= d;
    MT_CHECK(info.box.numel() == info.numel, "parameter {}: local shape [{}] and shard box [{}] differ in size",
             info.name, fmt::join(info.shape, ", "), fmt::join(info.shard_shape, ", "));
    MT_CHECK(by_name_.emplace(info.name, infos_.size()).second, "duplicate parameter name {}", info.name);
    infos_.push_back(std::move(info));
  }
  // Buckets, walking the parameters backwards (Megatron's _ParamAndGradBuffer): [param_begin,
  // param_end) ranges in reduction order. Sizes count the kAlign-aligned lengths.
  const int64_t bs = layout.bucket_size;
  auto aligned = [](const ParamInfo& p) { return round_up(p.numel, kAlign); };
  const size_t n = infos_.size();
  size_t end = n;  // the open bucket holds parameters [i, end)
  int64_t open_elems = 0;
  auto close = [&](size_t begin) {
    buckets_.push_back({begin, end, 0, 0, infos_[begin].expert});
    end = begin;
    open_elems = 0;
  };
  for (size_t i = n; i-- > 0;) {
    const ParamInfo& p = infos_[i];
    // close the open bucket before a parameter that needs its own, or of the other domain
    const bool own = p.shared_embedding_copy || (bs > 0 && aligned(p) >= bs) ||
                     (layout.isolate_word_embedding && p.name == "embedding.word_embeddings.weight");
    // an expert bucket holds one layer's experts (the MoE layers' expert slots, use_grad_slots)
    const bool other_layer = end > i + 1 && p.expert && infos_[i + 1].expert && unit_of(i) != unit_of(i + 1);
    // with split_model_chunks a bucket holds one model chunk's parameters
    const bool other_chunk = end > i + 1 && layout.split_model_chunks && p.model_chunk != infos_[i + 1].model_chunk;
    if (end > i + 1 && (own || other_layer || other_chunk || p.expert != infos_[i + 1].expert)) close(i + 1);
    open_elems += aligned(p);
    if (own || (bs > 0 && open_elems >= bs)) close(i);
  }
  if (end > 0) close(0);
  // Lay out forward: the last bucket starts at offset 0; each bucket padded to kAlign · DP
  // (kAlign · EDP for expert buckets).
  bucket_of_.assign(n, 0);
  int64_t off = 0;
  for (size_t b = buckets_.size(); b-- > 0;) {
    ParamBucket& bk = buckets_[b];
    bk.begin = off;
    for (size_t i = bk.param_begin; i < bk.param_end; ++i) {
      infos_[i].offset = off;
      off += aligned(infos_[i]);
      bucket_of_[i] = b;
    }
    off = round_up(off, kAlign * (bk.expert ? layout.edp() : layout.data_parallel_size));
    bk.end = off;
  }
  total_ = off;
  // The MoE layers: consecutive runs of expert buckets of one layer, ascending.
  moe_layer_of_bucket_.assign(buckets_.size(), -1);
  std::string last_unit;
  for (size_t b = buckets_.size(); b-- > 0;) {
    const ParamBucket& bk = buckets_[b];
    if (!bk.expert) continue;
    const std::string u = unit_of(bk.param_begin);
    const bool extends = !expert_regions_.empty() && expert_regions_.back().end == bk.begin && u == last_unit;
    if (extends) {
      expert_regions_.back().end = bk.end;
    } else {
      expert_regions_.push_back({bk.begin, bk.end});
    }
    last_unit = u;
    moe_layer_of_bucket_[b] = static_cast<int>(expert_regions_.size()) - 1;
  }
  // What zero_grads clears when parameters are grad_overwrite: everything but their elements.
  first_write_.assign(infos_.size(), 0);
  int64_t from = 0;
  for (const ParamInfo& p : infos_) {
    if (!p.grad_overwrite) continue;
    ++grad_overwrite_params_;
    if (p.offset > from) grad_zero_ranges_.push_back({from, p.offset});
    from = p.offset + p.numel;
  }
  if (from < total_) grad_zero_ranges_.push_back({from, total_});
  if (!allocate) return;
  main_ = Buffer(device, static_cast<size_t>(total_) * 4);
  if (model_dtype != DType::kF32) params_ = Buffer(device, static_cast<size_t>(total_) * dtype_size(model_dtype));
  grads_ = Buffer(device, static_cast<size_t>(total_) * 4);
}

size_t ParamStore::index(const std::string& name) const {
  const size_t i = find(name);
  MT_REQUIRE(i != kNoParam, "no parameter named '{}'", name);
  return i;
}

size_t ParamStore::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? kNoParam : it->second;
}

Tensor ParamStore::param(size_t i) const {
  if (params_staged_) {
    const auto& p = infos_.at(i);
    const size_t b = bucket_of_[i];
    MT_REQUIRE(param_bound(b),
               "parameter '{}' read while its bucket {} is not gathered (--data-parallel-sharding-strategy "
               "optim_grads_params keeps only this rank's slice; the model requests a unit's parameters with the "
               "params_begin hook, model/param_hooks.h)",
               p.name, b);
    return bucket_params(b).flat_range(p.offset - buckets_[b].begin, p.numel).view(p.shape);
  }
  if (!has_separate_main()) return main(i);
  const auto& p = infos_.at(i);
  char* base = static_cast<char*>(params_.data()) + p.offset * static_cast<int64_t>(dtype_size(model_dtype_));
  return Tensor(base, model_dtype_, device_, p.shape);
}

namespace {
constexpr const char* kRemaindersNote =
    "the fp32 main parameters are stored as the bf16 parameters plus int16 remainders "
    "(--use-precision-aware-optimizer)";
}  // namespace

Tensor ParamStore::main(size_t i) const {
  const auto& p = infos_.at(i);
  MT_REQUIRE(!main_remainders_, "{}: parameter '{}' has no fp32 main tensor (gather it with the optimizer's gather_main)",
             kRemaindersNote, p.name);
  MT_REQUIRE(!main_sharded_,
             "the fp32 main parameters are sharded by the distributed optimizer: parameter '{}' has no whole main "
             "copy on this rank",
             p.name);
  return Tensor(static_cast<float*>(main_.data()) + p.offset, DType::kF32, device_, p.shape);
}

Tensor ParamStore::grad(size_t i) const {
  const auto& p = infos_.at(i);
  if (grads_staged()) {
    const size_t b = bucket_of_[i];
    return bucket_grads(b).flat_range(p.offset - buckets_[b].begin, p.numel).view(p.shape);
  }
  return Tensor(static_cast<float*>(grads_.data()) + p.offset, DType::kF32, device_, p.shape);
}

Tensor ParamStore::grad_view(size_t i) const {
  const auto& p = infos_.at(i);
  const size_t b = bucket_of_[i];
  if (!grads_staged() || !buckets_[b].expert || slot_of_bucket_[b] >= 0) return grad(i);
  // where bind_expert puts it
  return expert_view(expert_grads_, expert_slot(expert_grads_, b), b, DType::kF32)
      .flat_range(p.offset - buckets_[b].begin, p.numel)
      .view(p.shape);
}

void ParamStore::use_grad_slots(int slots, const Stream& stream) {
  MT_REQUIRE(slots >= 1, "use_grad_slots: {} gradient staging slots; need at least 1", slots);
  MT_REQUIRE(!grads_staged(), "use_grad_slots: the gradients are already staged ({} slots)", grad_slots());
  grad_slot_len_ = std::max<int64_t>(largest_dense_bucket(), 1);
  stream.synchronize();  // nothing may still write the whole buffer
  // Expert buckets: a pool of their own, MoE layer k in slot k mod n at fixed offsets
  // (MoeExperts caches its experts' gradient addresses in grouped-GEMM tables).
  grads_ = Buffer();
  allocate_expert_pool(expert_grads_, expert_grad_slots_needed(), 4);
  for (int s = 0; s < slots; ++s) grad_slot_buf_.emplace_back(device_, static_cast<size_t>(grad_slot_len_) * 4);
  slot_of_bucket_.assign(buckets_.size(), -1);
  bucket_of_slot_.assign(static_cast<size_t>(slots), -1);
  grad_overwrite_ = false;
  zero_grads(stream);
}

Tensor ParamStore::bucket_grads(size_t b) const {
  const ParamBucket& bk = buckets_.at(b);
  if (!grads_staged()) return grads_flat().flat_range(bk.begin, bk.numel());
  if (bk.expert) {  // its place in its MoE layer's expert slot (use_grad_slots)
    bind_expert(expert_grads_, slot_of_bucket_, b, "gradient");
    return expert_view(expert_grads_, slot_of_bucket_[b], b, DType::kF32);
  }
  int& s = slot_of_bucket_[b];
  if (s < 0) {
    s = take_free_slot(bucket_of_slot_, b);
    MT_CHECK(s >= 0,
             "gradient staging: bucket {} (parameters '{}'..) needs a slot but all {} are bound (to buckets {}); the "
             "backward writes more buckets before reporting them than planned (docs/fsdp.md)",
             b, infos_[bk.param_begin].name, grad_slots(), fmt::join(bucket_of_slot_, ", "));
  }
  return grad_slot_buf_[static_cast<size_t>(s)].as(DType::kF32, {bk.numel()});
}

size_t ParamStore::bucket_at(int64_t e) const {
  MT_REQUIRE(e >= 0 && e < total_, "bucket_at: flat element {} outside [0, {})", e, total_);
  // buckets_ descend in offset: the first bucket whose begin <= e
  const auto it = std::partition_point(buckets_.begin(), buckets_.end(),
                                       [e](const ParamBucket& bk) { return bk.begin > e; });
  return static_cast<size_t>(it - buckets_.begin());
}

Tensor ParamStore::grads_range(int64_t begin, int64_t n) const {
  if (!grads_staged()) return grads_flat().flat_range(begin, n);
  const size_t b = bucket_at(begin);
  const ParamBucket& bk = buckets_[b];
  MT_REQUIRE(begin + n <= bk.end, "grads_range: elements [{}, {}) cross the end of bucket {} ([{}, {})) while staged",
             begin, begin + n, b, bk.begin, bk.end);
  return bucket_grads(b).flat_range(begin - bk.begin, n);
}

void ParamStore::release_grad_slot(size_t b) {
  if (!grads_staged()) return;
  if (buckets_.at(b).expert) {
    unbind_expert(expert_grads_, slot_of_bucket_, b);
    return;
  }
  int& s = slot_of_bucket_.at(b);
  if (s < 0) return;
  bucket_of_slot_[static_cast<size_t>(s)] = -1;
  s = -1;
}

int ParamStore::slots_needed(const std::function<std::string(size_t)>& unit, size_t units, size_t extra) const {
  size_t most = 1, dense = 0;  // expert buckets have slots of their own
  for (const ParamBucket& b : buckets_) dense += b.expert ? 0 : 1;
  // Units are runs of consecutive parameters (a layer's parameters are consecutive).
  for (size_t i = 0; i < infos_.size();) {
    const std::string u = unit(i);
    std::vector<size_t> bks;
    for (; i < infos_.size() && unit(i) == u; ++i)
      if (!buckets_[bucket_of_[i]].expert) bks.push_back(bucket_of_[i]);
    std::sort(bks.begin(), bks.end());
    most = std::max<size_t>(most, static_cast<size_t>(std::unique(bks.begin(), bks.end()) - bks.begin()));
  }
  return static_cast<int>(std::max<size_t>(1, std::min(units * most + extra, dense)));
}

int ParamStore::grad_slots_needed() const {
  // The unit a parameter is reported with: its name up to the layer number for layers, else
  // its first component.
  return slots_needed([this](size_t i) {
    const std::string& n = infos_[i].name;
    const size_t l = n.find("layers.");
    if (l != std::string::npos) return n.substr(0, n.find('.', l + 7));
    return n.substr(0, n.find('.'));
  }, 1, 2);
}

void ParamStore::allocate_expert_pool(ExpertPool& pool, int n, size_t elem_bytes) {
  pool.len = expert_slot_length();
  pool.owner.assign(static_cast<size_t>(n), -1);
  pool.bound.assign(static_cast<size_t>(n), 0);
  pool.buf = n > 0 ? Buffer(device_, static_cast<size_t>(n * pool.len) * elem_bytes) : Buffer();
}

int64_t ParamStore::expert_slot_length() const {
  int64_t n = 0;
  for (const Range& r : expert_regions_) n = std::max(n, r.end - r.begin);
  return n;
}

void ParamStore::bind_expert(ExpertPool& pool, std::vector<int>& slot_of, size_t b, const char* what) const {
  if (slot_of[b] >= 0) return;
  const int k = moe_layer_of_bucket_[b], n = pool.slots();
  MT_CHECK(k >= 0 && n > 0, "bucket {} is not an expert bucket of a staged store", b);
  const int s = expert_slot(pool, b);
  const int held = pool.owner[static_cast<size_t>(s)];
  MT_CHECK(held < 0 || held == k,
           "expert {} staging: MoE layer {} ('{}', bucket {}) needs expert slot {} of {}, which MoE layer {} ('{}') "
           "still holds (its buckets not released): two live MoE layers map to one slot (docs/fsdp.md \"Expert "
           "buckets\")",
           what, k, unit_of(buckets_[b].param_begin), b, s, n, held,
           [&] {
             for (size_t c = 0; c < buckets_.size(); ++c)
               if (moe_layer_of_bucket_[c] == held) return unit_of(buckets_[c].param_begin);
             return std::string("?");
           }());
  pool.owner[static_cast<size_t>(s)] = k;
  ++pool.bound[static_cast<size_t>(s)];
  slot_of[b] = s;
}

void ParamStore::unbind_expert(ExpertPool& pool, std::vector<int>& slot_of, size_t b) const {
  const int s = slot_of[b];
  if (s < 0) return;
  slot_of[b] = -1;
  if (--pool.bound[static_cast<size_t>(s)] == 0) pool.owner[static_cast<size_t>(s)] = -1;
}

Tensor ParamStore::expert_view(const ExpertPool& pool, int s, size_t b, DType dt) const {
  const ParamBucket& bk = buckets_[b];
  const int64_t off = s * pool.len + (bk.begin - expert_regions_[static_cast<size_t>(moe_layer_of_bucket_[b])].begin);
  return Tensor(static_cast<char*>(pool.buf.data()) + off * static_cast<int64_t>(dtype_size(dt)), dt, device_,
                {bk.numel()});
}

int ParamStore::take_free_slot(std::vector<int>& bucket_of_slot, size_t b) {
  const auto it = std::find(bucket_of_slot.begin(), bucket_of_slot.end(), -1);
  if (it == bucket_of_slot.end()) return -1;
  *it = static_cast<int>(b);
  return static_cast<int>(it - bucket_of_slot.begin());
}

int64_t ParamStore::grad_storage_bytes() const {
  if (!grads_staged()) return static_cast<int64_t>(grads_.bytes());
  int64_t n = static_cast<int64_t>(expert_grads_.buf.bytes());  // the expert slots
  for (const Buffer& b : grad_slot_buf_) n += static_cast<int64_t>(b.bytes());
  return n;
}

std::string ParamStore::unit_of(size_t i) const {
  const ParamInfo& p = infos_[i];
  if (const size_t l = p.name.find("layers."); l != std::string::npos) return p.name.substr(0, p.name.find('.', l + 7));
  if (p.name.rfind("embedding.", 0) == 0 && !p.shared_embedding_copy) return "embedding";
  return "head";
}

int64_t ParamStore::largest_dense_bucket() const {
  int64_t n = 0;
  for (const ParamBucket& b : buckets_)
    if (!b.expert) n = std::max(n, b.numel());
  return n;
}

int ParamStore::param_slots_needed() const {
  return slots_needed([this](size_t i) { return unit_of(i); }, 2, 1);
}

void ParamStore::use_param_slots(const std::vector<Range>& owned, int slots, const Stream& stream) {
  MT_REQUIRE(slots >= 1, "use_param_slots: {} parameter staging slots; need at least 1", slots);
  MT_REQUIRE(!params_staged_, "use_param_slots: the parameters are already staged ({} slots)", param_slots());
  MT_REQUIRE(!main_remainders_ && !main_sharded_,
             "use_param_slots: the main parameters are already {} (stage the parameters first)",
             main_remainders_ ? "stored as remainders" : "sharded");
  MT_REQUIRE(owned.size() == buckets_.size(), "use_param_slots: {} owned ranges for {} buckets", owned.size(),
             buckets_.size());
  param_owned_ = owned;
  param_shard_off_.assign(buckets_.size(), 0);
  std::vector<Range> ascending;
  for (size_t b = buckets_.size(); b-- > 0;) {  // ascending offsets: the optimizer state's order
    const ParamBucket& bk = buckets_[b];
    const Range r = owned[b];
    MT_REQUIRE(r.begin >= bk.begin && r.begin <= r.end && r.end <= bk.end,
               "use_param_slots: owned range [{}, {}) of bucket {} outside it ([{}, {}))", r.begin, r.end, b, bk.begin,
               bk.end);
    param_shard_off_[b] = param_shard_n_;
    param_shard_n_ += r.end - r.begin;
    if (r.end > r.begin) ascending.push_back(r);
  }
  param_slot_len_ = largest_dense_bucket();
  const size_t es = dtype_size(model_dtype_);
  stream.synchronize();  // nothing may still write the whole buffers
  // The owned slices, copied from the whole parameters.
  const Tensor whole = params_flat();
  Buffer shard(device_, static_cast<size_t>(std::max<int64_t>(param_shard_n_, 1)) * es);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Range r = owned[b];
    copy(shard.as(model_dtype_, {param_shard_n_}).flat_range(param_shard_off_[b], r.end - r.begin),
         whole.flat_range(r.begin, r.end - r.begin), stream);
  }
  stream.synchronize();  // the whole buffer is freed next
  if (has_separate_main()) {
    param_shard_ = std::move(shard);
  } else {  // fp32: the shard is the main shard
    main_ = std::move(shard);
    main_ranges_ = ascending;
    main_shard_n_ = param_shard_n_;
    main_sharded_ = true;
  }
  params_ = Buffer();
  allocate_expert_pool(expert_params_, expert_param_slots_needed(), es);
  for (int k = 0; k < slots; ++k) param_slot_buf_.emplace_back(device_, static_cast<size_t>(param_slot_len_) * es);
  slot_of_param_bucket_.assign(buckets_.size(), -1);
  bucket_of_param_slot_.assign(static_cast<size_t>(slots), -1);
  params_staged_ = true;
}

Tensor ParamStore::param_shard() const {
  MT_REQUIRE(params_staged_, "param_shard: the parameters are not staged (use_param_slots)");
  const Buffer& b = has_separate_main() ? param_shard_ : main_;
  return Tensor(b.data(), model_dtype_, device_, {param_shard_n_});
}

Tensor ParamStore::bucket_param_shard(size_t b) const {
  const Range r = param_owned_.at(b);
  return param_shard().flat_range(param_shard_off_[b], r.end - r.begin);
}

Tensor ParamStore::bucket_params(size_t b) const {
  const ParamBucket& bk = buckets_.at(b);
  if (!params_staged_) return params_flat().flat_range(bk.begin, bk.numel());
  const int s = slot_of_param_bucket_[b];
  MT_REQUIRE(s >= 0, "bucket {} (parameters '{}'..) is not gathered into a parameter slot", b,
             infos_[bk.param_begin].name);
  if (bk.expert) return expert_view(expert_params_, s, b, model_dtype_);
  return param_slot_buf_[static_cast<size_t>(s)].as(model_dtype_, {bk.numel()});
}

Tensor ParamStore::bind_param_slot(size_t b) {
  MT_REQUIRE(params_staged_, "bind_param_slot: bucket {} is not staged", b);
  if (buckets_.at(b).expert) {
    bind_expert(expert_params_, slot_of_param_bucket_, b, "parameter");
    return bucket_params(b);
  }
  int& s = slot_of_param_bucket_[b];
  if (s < 0) {
    s = take_free_slot(bucket_of_param_slot_, b);
    MT_CHECK(s >= 0,
             "parameter staging: bucket {} (parameters '{}'..) needs a slot but all {} are bound (to buckets {}); a "
             "unit reads more buckets than planned (docs/fsdp.md)",
             b, infos_[buckets_[b].param_begin].name, param_slots(), fmt::join(bucket_of_param_slot_, ", "));
  }
  return bucket_params(b);
}

int ParamStore::expert_param_slot_holder(size_t b) const {
  MT_REQUIRE(params_staged_ && buckets_.at(b).expert && expert_params_.slots() > 0,
             "expert_param_slot_holder: bucket {} is not a staged expert bucket", b);
  return expert_params_.owner[static_cast<size_t>(expert_slot(expert_params_, b))];
}

void ParamStore::release_param_slot(size_t b) {
  if (param_resident(b)) return;
  if (buckets_.at(b).expert) {
    unbind_expert(expert_params_, slot_of_param_bucket_, b);
    return;
  }
  int& s = slot_of_param_bucket_.at(b);
  if (s < 0) return;
  bucket_of_param_slot_[static_cast<size_t>(s)] = -1;
  s = -1;
}

int64_t ParamStore::param_storage_bytes() const {
  if (!params_staged_) return has_separate_main() ? static_cast<int64_t>(params_.bytes()) : 0;
  // the shard (an fp32 model's is its main shard), the expert slots, the slots
  int64_t n = param_shard_n_ * static_cast<int64_t>(dtype_size(model_dtype_)) +
              static_cast<int64_t>(expert_params_.buf.bytes());
  for (const Buffer& b : param_slot_buf_) n += static_cast<int64_t>(b.bytes());
  return n;
}

void ParamStore::write_stored_params(size_t i, const Tensor& model, const Stream& stream) {
  const ParamInfo& p = infos_[i];
  const size_t b = bucket_of_[i];
  const Range r = param_owned_[b];
  const int64_t lo = std::max(r.begin, p.offset), hi = std::min(r.end, p.offset + p.numel);
  if (lo < hi) copy(bucket_param_shard(b).flat_range(lo - r.begin, hi - lo), model.flat_range(lo - p.offset, hi - lo), stream);
}

Tensor ParamStore::params_flat() const {
  MT_REQUIRE(!params_staged_,
             "the model parameters are sharded (--data-parallel-sharding-strategy optim_grads_params): there is no "
             "whole parameter buffer; use param_shard or the gathered buckets");
  if (!has_separate_main()) return Tensor(main_.data(), DType::kF32, device_, {total_});
  return Tensor(params_.data(), model_dtype_, device_, {total_});
}
Tensor ParamStore::main_flat() const {
  MT_REQUIRE(!main_remainders_, "{}: there is no flat fp32 main buffer (gather it with the optimizer's gather_main)",
             kRemaindersNote);
  MT_REQUIRE(!main_sharded_, "the fp32 main parameters are sharded by the distributed optimizer (no whole copy)");
  return Tensor(main_.data(), DType::kF32, device_, {total_});
}
Tensor ParamStore::grads_flat() const {
  MT_REQUIRE(!grads_staged(),
             "the gradients are staged per bucket (--data-parallel-sharding-strategy optim_grads): there is no whole "
             "gradient buffer; use bucket_grads or the gradient shard");
  return Tensor(grads_.data(), DType::kF32, device_, {total_});
}

int64_t ParamStore::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : infos_) n += p.numel;
  return n;
}

void ParamStore::shard_main(const std::vector<Range>& owned, const Stream& stream) {
  if (!has_separate_main()) return;
  if (main_sharded_) {  // a second optimizer over the same store: only with the same ownership
    const bool same = owned.size() == main_ranges_.size() &&
                      std::equal(owned.begin(), owned.end(), main_ranges_.begin(),
                                 [](const Range& a, const Range& b) { return a.begin == b.begin && a.end == b.end; });
    MT_REQUIRE(same, "ParamStore::shard_main: the main parameters are already sharded over {} other ranges",
               main_ranges_.size());
    return;
  }
  int64_t n = 0, prev = 0;
  for (const auto& r : owned) {
    MT_REQUIRE(r.begin >= prev && r.begin <= r.end && r.end <= total_,
               "shard_main: owned range [{}, {}) is unsorted, overlapping or outside [0, {})", r.begin, r.end, total_);
    prev = r.end;
    n += r.end - r.begin;
  }
  const DType storage_dtype = main_remainders_ ? DType::kI16 : DType::kF32;
  Buffer shard(device_, static_cast<size_t>(n) * dtype_size(storage_dtype));
  const Tensor full = main_storage(), compact = shard.as(storage_dtype, {n});
  int64_t c = 0;
  for (const auto& r : owned) {
    copy(compact.flat_range(c, r.end - r.begin), full.flat_range(r.begin, r.end - r.begin), stream);
    c += r.end - r.begin;
  }
  stream.synchronize();  // the full buffer is freed next
  main_ = std::move(shard);
  main_ranges_ = owned;
  main_shard_n_ = n;
  main_sharded_ = true;
}

Tensor ParamStore::main_shard() const {
  MT_REQUIRE(!main_remainders_, "ParamStore::main_shard: {}; use main_remainders()", kRemaindersNote);
  MT_REQUIRE(main_sharded_, "ParamStore::main_shard: the main parameters are not sharded");
  return Tensor(main_.data(), DType::kF32, device_, {main_shard_n_});
}

Tensor ParamStore::main_storage() const {
  return Tensor(main_.data(), main_remainders_ ? DType::kI16 : DType::kF32, device_,
                {main_sharded_ ? main_shard_n_ : total_});
}

std::vector<ParamStore::Range> ParamStore::stored_ranges() const {
  if (main_sharded_) return main_ranges_;
  return {Range{0, total_}};
}

void ParamStore::store_main_as_remainders(const Stream& stream) {
  if (main_remainders_) return;  // a second optimizer over the same store
  MT_REQUIRE(model_dtype_ == DType::kBF16,
             "--use-precision-aware-optimizer stores the fp32 main parameters as int16 remainders beside bf16 "
             "parameters: it needs --bf16 (the parameters are {})",
             dtype_name(model_dtype_));
  MT_REQUIRE(!main_sharded_,
             "ParamStore::store_main_as_remainders: the main parameters are already sharded (call it before "
             "shard_main, while every rank holds the whole fp32 copy)");
  Buffer rem(device_, static_cast<size_t>(total_) * 2);
  const Tensor rem_flat = rem.as(DType::kI16, {total_});
  if (params_staged_) {
    // optim_grads_params: only the owned slices have bf16 parameters here (param_shard); split
    // those, each rank its own (every rank holds the same fp32 copy, so the slices agree with the
    // split of the whole). The other remainders are zero and dropped by shard_main.
    memset_tensor(rem_flat, 0, stream);
    const Tensor whole = main_flat();
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Range r = param_owned_[b];
      if (r.end > r.begin)
        split_param_remainders(whole.flat_range(r.begin, r.end - r.begin), bucket_param_shard(b),
                               rem_flat.flat_range(r.begin, r.end - r.begin), stream);
    }
  } else {
    split_param_remainders(main_flat(), params_flat(), rem_flat, stream);
  }
  stream.synchronize();  // the fp32 buffer is freed next
  main_ = std::move(rem);
  main_remainders_ = true;
}

Tensor ParamStore::main_remainders() const {
  MT_REQUIRE(main_remainders_,
             "ParamStore::main_remainders: the fp32 main parameters are not stored as remainders (see "
             "--use-precision-aware-optimizer)");
  return main_storage();
}

int64_t ParamStore::main_storage_elements() const {
  if (!has_separate_main()) return 0;
  return main_sharded_ ? main_shard_n_ : total_;
}

void ParamStore::set_stored_params(const Tensor& full, const Stream& stream) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Range r = param_owned_[b];
    cast(bucket_param_shard(b), full.flat_range(r.begin, r.end - r.begin), stream);
  }
}

void ParamStore::set_main_from_full(const Tensor& full, const Stream& stream) {
  MT_REQUIRE(full.dtype() == DType::kF32 && full.numel() == total_ && full.device() == device_,
             "set_main_from_full: expected fp32 [{}] on {}, got {}", total_, device_.str(), full.str());
  if (params_staged_ && main_remainders_) {
    // The owned slices split into their bf16 halves (the parameter shard) and remainders (the
    // remainder shard holds the same ranges in the same ascending order, or is flat-indexed
    // before shard_main).
    MT_CHECK(!main_sharded_ || main_shard_n_ == param_shard_n_,
             "set_main_from_full: {} stored remainders for {} owned parameter elements", main_shard_n_, param_shard_n_);
    const Tensor rem = main_remainders();
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Range r = param_owned_[b];
      const int64_t n = r.end - r.begin;
      if (n > 0)
        split_param_remainders(full.flat_range(r.begin, n), bucket_param_shard(b),
                               rem.flat_range(main_sharded_ ? param_shard_off_[b] : r.begin, n), stream);
    }
    return;
  }
  if (params_staged_) {  // the owned slices (fp32: the main shard itself)
    set_stored_params(full, stream);
    if (!has_separate_main()) return;
    if (!main_sharded_) {
      copy(main_flat(), full, stream);
      return;
    }
    const Tensor compact = main_shard();
    int64_t c = 0;
    for (const auto& r : main_ranges_) {
      copy(compact.flat_range(c, r.end - r.begin), full.flat_range(r.begin, r.end - r.begin), stream);
      c += r.end - r.begin;
    }
    return;
  }
  if (main_remainders_) {
    // Every model element from the split's rounding, with the stored elements' remainders (when
    // sharded, their bf16 halves are written again, identically).
    const Tensor flat = full.flat_range(0, total_), params = params_flat(), rem = main_remainders();
    if (!main_sharded_) {
      split_param_remainders(flat, params, rem, stream);
      return;
    }
    split_param_remainders(flat, params, Tensor(), stream);
    int64_t c = 0;
    for (const auto& r : main_ranges_) {
      split_param_remainders(flat.flat_range(r.begin, r.end - r.begin), params.flat_range(r.begin, r.end - r.begin),
                             rem.flat_range(c, r.end - r.begin), stream);
      c += r.end - r.begin;
    }
    return;
  }
  if (!main_sharded_) {
    copy(main_flat(), full, stream);
    sync_model_from_main(stream);
    return;
  }
  cast(params_flat(), full, stream);
  const Tensor compact = main_shard();
  int64_t c = 0;
  for (const auto& r : main_ranges_) {
    copy(compact.flat_range(c, r.end - r.begin), full.flat_range(r.begin, r.end - r.begin), stream);
    c += r.end - r.begin;
  }
}

void ParamStore::initialize(uint64_t seed, const Stream& stream) {
  auto init_one = [&](const ParamInfo& p, const Tensor& m) {
    switch (p.init) {
      case InitKind::kZeros: fill(m, 0.f, stream); break;
      case InitKind::kOnes: fill(m, 1.f, stream); break;
      case InitKind::kNormal: init_normal(m, p.init_std, seed, tensor_stream_id(p.name), p.box, stream); break;
    }
    // Vocabulary padding rows start (and, taking no probability mass and no gradient, stay) zero.
    if (p.vocab_rows > 0 && p.box.ndim >= 1) {
      const int64_t rows = p.box.shape[0], row_len = rows > 0 ? p.numel / rows : 0;
      const int64_t first_pad = std::clamp<int64_t>(p.vocab_rows - p.box.offset[0], 0, rows);
      if (first_pad < rows) fill(m.flat_range(first_pad * row_len, (rows - first_pad) * row_len), 0.f, stream);
    }
  };
  if (has_main_flat()) {
    fill(main_flat(), 0.f, stream);  // alignment padding stays zero
    for (size_t i = 0; i < infos_.size(); ++i) init_one(infos_[i], main(i));
    sync_model_from_main(stream);
    if (!grads_staged()) memset_tensor(grads_flat(), 0, stream);  // every element defined, whatever writes come first
    zero_grads(stream);
    return;
  }
  // Sharded or remainders: draw each parameter into a scratch buffer, round (or split) it into
  // the model parameters and keep the stored elements (sorted ranges; walk them alongside the
  // parameters). All-zero bits are 0 as fp32 and as (bf16, remainder).
  int64_t max_numel = 0;
  for (const auto& p : infos_) max_numel = std::max(max_numel, p.numel);
  Buffer scratch(device_, static_cast<size_t>(std::max<int64_t>(max_numel, 1)) * 4);
  // Staged parameters (use_param_slots): each parameter rounded into a model-dtype scratch, its
  // stored elements kept (the owned slice).
  Buffer model_scratch =
      params_staged_ && has_separate_main()
          ? Buffer(device_, static_cast<size_t>(std::max<int64_t>(max_numel, 1)) * dtype_size(model_dtype_))
          : Buffer();
  if (params_staged_) {
    memset_tensor(param_shard(), 0, stream);
  } else {
    memset_tensor(params_flat(), 0, stream);
  }
  const Tensor compact = main_storage();
  memset_tensor(compact, 0, stream);
  const std::vector<Range> stored = stored_ranges();
  for (size_t i = 0; i < infos_.size(); ++i) {
    const auto& p = infos_[i];
    const Tensor m = scratch.as(DType::kF32, p.shape);
    init_one(p, m);
    const Tensor model = !params_staged_      ? param(i)
                         : has_separate_main() ? model_scratch.as(model_dtype_, p.shape)
                                               : m;
    if (main_remainders_) {
      split_param_remainders(m.flat_range(0, p.numel), model.flat_range(0, p.numel), Tensor(), stream);
    } else if (model.data() != m.data()) {
      cast(model, m, stream);
    }
    if (params_staged_) write_stored_params(i, model, stream);
    int64_t c = 0;
    for (const auto& r : stored) {
      const int64_t b = std::max(r.begin, p.offset), e = std::min(r.end, p.offset + p.numel);
      if (b < e) {
        const Tensor src = m.flat_range(b - p.offset, e - b), dst = compact.flat_range(c + (b - r.begin), e - b);
        if (main_remainders_) {
          split_param_remainders(src, model.flat_range(b - p.offset, e - b), dst, stream);
        } else {
          copy(dst, src, stream);
        }
      }
      c += r.end - r.begin;
    }
  }
  if (!grads_staged()) memset_tensor(grads_flat(), 0, stream);
  zero_grads(stream);
  stream.synchronize();  // before the scratch buffer is freed
}

void ParamStore::sync_model_from_main(const Stream& stream) {
  MT_REQUIRE(!main_remainders_, "sync_model_from_main: {} (the model parameters are part of them)", kRemaindersNote);
  MT_REQUIRE(!main_sharded_,
             "sync_model_from_main: the fp32 main parameters are sharded by the distributed optimizer; use "
             "set_main_from_full or the optimizer's parameter all-gather");
  if (params_staged_) {  // the main copy is whole (one data-parallel rank): the stored elements from it
    set_stored_params(main_flat(), stream);
    return;
  }
  if (has_separate_main()) cast(params_flat(), main_flat(), stream);
}

void ParamStore::zero_grads(const Stream& stream) {
  const bool marks = grad_overwrite_ && grad_overwrite_params_ > 0;
  for (size_t i = 0; i < infos_.size(); ++i) first_write_[i] = marks && infos_[i].grad_overwrite ? 1 : 0;
  first_writes_pending_ = marks ? grad_overwrite_params_ : 0;
  if (grads_staged()) {
    for (const Buffer& s : grad_slot_buf_) memset_tensor(s.as(DType::kF32, {grad_slot_len_}), 0, stream);
    if (expert_grads_.slots() > 0)
      memset_tensor(expert_grads_.buf.as(DType::kF32, {expert_grads_.slots() * expert_grads_.len}), 0, stream);
    std::fill(expert_grads_.owner.begin(), expert_grads_.owner.end(), -1);
    std::fill(expert_grads_.bound.begin(), expert_grads_.bound.end(), 0);
    std::fill(slot_of_bucket_.begin(), slot_of_bucket_.end(), -1);
    std::fill(bucket_of_slot_.begin(), bucket_of_slot_.end(), -1);
    return;
  }
  if (!marks) {
    memset_tensor(grads_flat(), 0, stream);
    return;
  }
  const Tensor g = grads_flat();
  for (const Range& r : grad_zero_ranges_) memset_tensor(g.flat_range(r.begin, r.end - r.begin), 0, stream);
}

bool ParamStore::take_first_grad_write(size_t i) {
  if (!first_write_.at(i)) return false;
  first_write_[i] = 0;
  --first_writes_pending_;
  return true;
}

size_t ParamStore::untaken_first_write() const {
  if (first_writes_pending_ == 0) return kNoParam;
  for (size_t i = 0; i < first_write_.size(); ++i)
    if (first_write_[i]) return i;
  return kNoParam;
}

}  // namespace mt
