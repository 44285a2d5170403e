#include "model/module.h"

#include <algorithm>
#include <set>

#include "ops/matmul.h"

namespace mt {

// ---------------------------------------------------------------------------------------------
// ParamRegistry
// ---------------------------------------------------------------------------------------------

void ParamRegistry::begin_group(bool sort_by_sharding) { groups_.push_back({{}, sort_by_sharding}); }

void ParamRegistry::declare(ParamSpec spec, ParamRef* ref) {
  MT_CHECK(!groups_.empty(), "ParamRegistry::declare({}) before begin_group", spec.name);
  if (!rename_.first.empty() && spec.name.rfind(rename_.first, 0) == 0)
    spec.name = rename_.second + spec.name.substr(rename_.first.size());
  MT_CHECK(names_.insert(spec.name).second, "parameter {} declared twice", spec.name);
  spec.model_chunk = chunk_;
  groups_.back().entries.push_back({std::move(spec), ref});
}

std::vector<ParamRegistry::Group> ParamRegistry::ordered() const {
  std::vector<Group> out = groups_;
  for (Group& g : out) {
    if (!g.sort) continue;
    auto category = [](const ParamSpec& p) {
      if (p.expert) return 3;  // MoE experts last: a contiguous run in buckets of their own
      if (p.tp_split_dim >= 0 && p.shape.size() >= 2) return 0;
      if (p.tp_split_dim >= 0) return 1;
      return 2;
    };
    std::stable_sort(g.entries.begin(), g.entries.end(),
                     [&](const Entry& a, const Entry& b) { return category(a.spec) < category(b.spec); });
  }
  return out;
}

std::vector<ParamSpec> ParamRegistry::specs() const {
  std::vector<ParamSpec> out;
  for (const Group& g : ordered())
    for (const Entry& e : g.entries) out.push_back(e.spec);
  return out;
}

std::pair<size_t, size_t> ParamRegistry::group_range(size_t k) const {
  MT_CHECK(k < groups_.size(), "parameter group {} of {}", k, groups_.size());
  size_t first = 0;
  for (size_t i = 0; i < k; ++i) first += groups_[i].entries.size();
  return {first, first + groups_[k].entries.size()};
}

void ParamRegistry::bind(ParamStore& store) {
  for (const Group& g : ordered())
    for (const Entry& e : g.entries) {
      if (e.ref == nullptr) continue;
      e.ref->index = store.index(e.spec.name);
      e.ref->store = &store;
    }
}

// ---------------------------------------------------------------------------------------------
// BufferPlanner
// ---------------------------------------------------------------------------------------------

BufferPlanner::BufferPlanner(Device device, DType act) : device_(device), act_(act) {}

void BufferPlanner::begin_pass() {
  area_open_ = false;
  cursor_ = 0;
  persistent_cursor_ = 0;
}

void BufferPlanner::open_area(Family family, int index) {
  MT_CHECK(index >= 0, "buffer area index {} must be >= 0", index);
  FamilyState& f = families_[static_cast<int>(family)];
  if (placing_) {
    MT_CHECK(index < f.count, "buffer area {} of a family with {} regions opened while placing", index, f.count);
  } else {
    f.count = std::max(f.count, index + 1);
  }
  area_open_ = true;
  open_family_ = family;
  open_index_ = index;
  cursor_ = 0;
}

void BufferPlanner::close_area() { area_open_ = false; }

int BufferPlanner::area() const {
  MT_CHECK(area_open_, "BufferPlanner::area() outside an open area");
  return open_index_;
}

Tensor BufferPlanner::at(size_t offset, DType dtype, const std::vector<int64_t>& shape) const {
  if (!placing_) return Tensor(nullptr, dtype, device_, shape);
  return Tensor(static_cast<char*>(buffer_.data()) + offset, dtype, device_, shape);
}

namespace {
size_t nbytes(DType dtype, const std::vector<int64_t>& shape) {
  size_t n = dtype_size(dtype);
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}
}  // namespace

Tensor BufferPlanner::saved(DType dtype, const std::vector<int64_t>& shape, const char* what) {
  MT_CHECK(area_open_, "saved tensor '{}' requested outside an activation area", what);
  FamilyState& f = families_[static_cast<int>(open_family_)];
  const size_t off = cursor_;
  cursor_ += aligned(nbytes(dtype, shape));
  if (!placing_) {
    f.region = std::max(f.region, cursor_);
    return at(0, dtype, shape);
  }
  MT_CHECK(cursor_ <= f.region, "saved tensor '{}' exceeds its planned region ({} > {} bytes)", what, cursor_,
           f.region);
  return at(f.base + static_cast<size_t>(open_index_) * f.region + off, dtype, shape);
}

Tensor BufferPlanner::scratch(const std::string& key, DType dtype, const std::vector<int64_t>& shape) {
  const size_t n = aligned(nbytes(dtype, shape));
  if (!placing_) {
    size_t& s = scratch_size_[key];
    s = std::max(s, n);
    const ScratchPhase phase = current_phase();
    auto [it, first] = scratch_phase_.emplace(key, phase);
    if (!first && it->second != phase) it->second = ScratchPhase::kShared;
    return at(0, dtype, shape);
  }
  auto it = scratch_offset_.find(key);
  MT_CHECK(it != scratch_offset_.end() && n <= scratch_size_.at(key), "scratch '{}' was not planned at this size",
           key);
  return at(it->second, dtype, shape);
}

Tensor BufferPlanner::persistent(DType dtype, const std::vector<int64_t>& shape, const char* what) {
  const size_t n = aligned(nbytes(dtype, shape));
  const size_t off = persistent_cursor_;
  persistent_cursor_ += n;
  if (!placing_) {
    persistent_ = std::max(persistent_, persistent_cursor_);
    return at(0, dtype, shape);
  }
  MT_CHECK(persistent_cursor_ <= persistent_, "persistent tensor '{}' exceeds the planned size", what);
  return at(off, dtype, shape);
}

void BufferPlanner::materialize() {
  MT_CHECK(!placing_, "BufferPlanner::materialize called twice");
  size_t off = persistent_;
  for (FamilyState& f : families_) {
    f.base = off;
    off += f.region * static_cast<size_t>(f.count);
  }
  off += scratch_layout(off, &scratch_offset_);
  total_ = off;
  buffer_ = Buffer(device_, std::max<size_t>(total_, 1));
  placing_ = true;
}

size_t BufferPlanner::area_bytes(Family f) const { return families_[static_cast<int>(f)].region; }
int BufferPlanner::area_count(Family f) const { return families_[static_cast<int>(f)].count; }

BufferPlanner::ScratchPhase BufferPlanner::current_phase() const {
  if (!area_open_) return ScratchPhase::kShared;
  return open_family_ == Family::kHead ? ScratchPhase::kHead : ScratchPhase::kLayers;
}

size_t BufferPlanner::scratch_layout(size_t base, std::map<std::string, size_t>* offsets) const {
  // The shared keys first, then each phase's keys from the same offset.
  size_t shared = 0, phase_end[2] = {0, 0};  // kLayers, kHead
  for (const auto& [key, size] : scratch_size_)
    if (scratch_phase_.at(key) == ScratchPhase::kShared) {
      if (offsets) (*offsets)[key] = base + shared;
      shared += size;
    }
  for (const auto& [key, size] : scratch_size_) {
    const ScratchPhase ph = scratch_phase_.at(key);
    if (ph == ScratchPhase::kShared) continue;
    size_t& end = phase_end[static_cast<int>(ph)];
    if (offsets) (*offsets)[key] = base + shared + end;
    end += size;
  }
  return shared + std::max(phase_end[0], phase_end[1]);
}

size_t BufferPlanner::scratch_bytes() const { return scratch_layout(0, nullptr); }

// ---------------------------------------------------------------------------------------------
// WgradDeferral
// ---------------------------------------------------------------------------------------------

void WgradDeferral::run(const Stream& stream) {
  for (const Item& d : list_) linear_backward(Tensor(), d.dw, d.dbias, d.dy, d.x, d.w, stream, d.dw_write);
  list_.clear();
}

}  // namespace mt
