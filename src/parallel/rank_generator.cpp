#include "parallel/rank_generator.h"

#include <algorithm>
#include <cctype>

#include "core/check.h"

namespace mt {
namespace {

std::vector<std::string> split_dash(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t pos = s.find('-', start);
    out.push_back(s.substr(start, pos == std::string::npos ? std::string::npos : pos - start));
    if (pos == std::string::npos) break;
    start = pos + 1;
  }
  return out;
}

std::string to_lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string join_ints(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return "[" + s + "]";
}

}  // namespace

RankGroups generate_masked_orthogonal_rank_groups(int world_size, const std::vector<int>& parallel_size,
                                                  const std::vector<bool>& mask) {
  MT_REQUIRE(parallel_size.size() == mask.size(), "parallel sizes {} and mask have different lengths ({} vs {})",
             join_ints(parallel_size), parallel_size.size(), mask.size());
  int64_t product = 1;
  for (int s : parallel_size) {
    MT_REQUIRE(s >= 1, "parallel sizes must be positive, got {}", join_ints(parallel_size));
    product *= s;
  }
  MT_REQUIRE(product == world_size, "world size {} is not the product of the parallel sizes {} = {}", world_size,
             join_ints(parallel_size), product);

  // Global stride of dimension i = product of the sizes before it (leftmost varies fastest).
  const size_t n = parallel_size.size();
  std::vector<int> stride(n);
  int acc = 1;
  for (size_t i = 0; i < n; ++i) {
    stride[i] = acc;
    acc *= parallel_size[i];
  }
  std::vector<size_t> masked, unmasked;
  for (size_t i = 0; i < n; ++i) (mask[i] ? masked : unmasked).push_back(i);
  int group_size = 1;
  for (size_t i : masked) group_size *= parallel_size[i];
  const int num_groups = world_size / group_size;

  // Mixed-radix digits of `index` over the dimensions `dims` (leftmost fastest), dotted with the
  // global strides of those dimensions.
  auto place = [&](int index, const std::vector<size_t>& dims) {
    int rank = 0;
    for (size_t d : dims) {
      rank += (index % parallel_size[d]) * stride[d];
      index /= parallel_size[d];
    }
    return rank;
  };
  RankGroups groups(num_groups);
  for (int g = 0; g < num_groups; ++g) {
    const int base = place(g, unmasked);
    groups[g].reserve(group_size);
    for (int i = 0; i < group_size; ++i) groups[g].push_back(base + place(i, masked));
  }
  return groups;
}

RankGenerator::RankGenerator(int tp, int ep, int dp, int pp, int cp, const std::string& order, int rank_offset)
    : rank_offset_(rank_offset) {
  MT_REQUIRE(tp >= 1 && ep >= 1 && dp >= 1 && pp >= 1 && cp >= 1,
             "RankGenerator sizes must be positive: tp={} ep={} dp={} pp={} cp={}", tp, ep, dp, pp, cp);
  MT_REQUIRE(ep == 1 || cp == 1,
             "RankGenerator: ep ({}) and cp ({}) cannot both exceed 1 in one grid (cp belongs to the dense grid, "
             "ep to the expert grid)",
             ep, cp);
  MT_REQUIRE(rank_offset >= 0, "RankGenerator: rank_offset must be >= 0, got {}", rank_offset);
  const std::vector<std::pair<std::string, int>> known = {{"tp", tp}, {"pp", pp}, {"dp", dp}, {"ep", ep}, {"cp", cp}};
  auto size_of = [&](const std::string& name) {
    for (const auto& [k, v] : known)
      if (k == name) return v;
    return -1;
  };
  const std::string lowered = to_lower(order);
  for (const std::string& name : split_dash(lowered)) {
    MT_REQUIRE(size_of(name) >= 1, "order '{}': unknown dimension '{}' (expected tp, cp, ep, dp, pp)", order, name);
    MT_REQUIRE(std::find(names_.begin(), names_.end(), name) == names_.end(), "order '{}': dimension '{}' repeated",
               order, name);
    names_.push_back(name);
  }
  for (const auto& [name, size] : known) {
    if (std::find(names_.begin(), names_.end(), name) != names_.end()) continue;
    MT_REQUIRE(size == 1, "order '{}' omits {} whose size is {} (only size-1 dimensions may be omitted)", order,
               name, size);
    names_.push_back(name);
  }
  order_.clear();
  for (const std::string& name : names_) {
    order_ += (order_.empty() ? "" : "-") + name;
    sizes_.push_back(size_of(name));
    world_size_ *= sizes_.back();
  }
}

int RankGenerator::index_of(const std::string& name) const {
  for (size_t i = 0; i < names_.size(); ++i)
    if (names_[i] == name) return static_cast<int>(i);
  MT_FAIL("'{}' is not a dimension of order '{}'", name, order_);
}

std::vector<bool> RankGenerator::mask_of(const std::string& token) const {
  std::vector<bool> mask(names_.size(), false);
  for (const std::string& name : split_dash(to_lower(token))) {
    const int i = index_of(name);
    MT_REQUIRE(!mask[i], "token '{}' names '{}' twice", token, name);
    mask[i] = true;
  }
  return mask;
}

RankGroups RankGenerator::get_ranks(const std::string& token) const {
  RankGroups groups = generate_masked_orthogonal_rank_groups(world_size_, sizes_, mask_of(token));
  for (auto& g : groups)
    for (int& r : g) r += rank_offset_;
  return groups;
}

int RankGenerator::size(const std::string& name) const { return sizes_[index_of(to_lower(name))]; }

int RankGenerator::coordinate(int rank, const std::string& name) const {
  const int local = rank - rank_offset_;
  MT_REQUIRE(local >= 0 && local < world_size_, "rank {} outside [{}, {})", rank, rank_offset_,
             rank_offset_ + world_size_);
  const int target = index_of(to_lower(name));
  int stride = 1;
  for (int i = 0; i < target; ++i) stride *= sizes_[i];
  return (local / stride) % sizes_[target];
}

std::vector<int> default_embedding_ranks(const std::vector<int>& pp_ranks) {
  MT_REQUIRE(!pp_ranks.empty(), "default_embedding_ranks: empty pipeline group");
  if (pp_ranks.size() == 1) return {pp_ranks[0]};
  return {pp_ranks.front(), pp_ranks.back()};
}

std::vector<int> default_position_embedding_ranks(const std::vector<int>& pp_ranks) {
  MT_REQUIRE(!pp_ranks.empty(), "default_position_embedding_ranks: empty pipeline group");
  return {pp_ranks.front()};
}

const char* group_kind_name(GroupKind kind) {
  switch (kind) {
    case GroupKind::kTp: return "tp";
    case GroupKind::kCp: return "cp";
    case GroupKind::kDp: return "dp";
    case GroupKind::kPp: return "pp";
    case GroupKind::kTpCp: return "tp_cp";
    case GroupKind::kDpCp: return "dp_cp";
    case GroupKind::kMp: return "mp";
    case GroupKind::kTpDp: return "tp_dp";
    case GroupKind::kTpDpCp: return "tp_dp_cp";
    case GroupKind::kEp: return "ep";
    case GroupKind::kEtp: return "etp";
    case GroupKind::kEtpEp: return "etp_ep";
    case GroupKind::kEtpEpPp: return "etp_ep_pp";
    case GroupKind::kEdp: return "edp";
    case GroupKind::kEmbedding: return "embedding";
    case GroupKind::kPositionEmbedding: return "position_embedding";
  }
  return "?";
}

namespace {

void check_validated(const ParallelConfig& c) {
  MT_REQUIRE(c.world >= 1 && c.dp >= 1 && c.edp >= 1 && c.etp >= 1 && c.tp * c.cp * c.dp * c.pp == c.world &&
                 c.etp * c.ep * c.edp * c.pp == c.world,
             "ParallelGroups needs a ParallelConfig that passed validate_and_derive; got {}", c.to_string());
}

}  // namespace

ParallelGroups::ParallelGroups(const ParallelConfig& cfg)
    : cfg_((check_validated(cfg), cfg)),
      dense_(cfg.tp, 1, cfg.dp, cfg.pp, cfg.cp, cfg.order),
      expert_(cfg.etp, cfg.ep, cfg.edp, cfg.pp, 1, cfg.order) {
  MT_REQUIRE(dense_.get_ranks("pp") == expert_.get_ranks("pp"),
             "pipeline groups of the dense grid (tp={} cp={} dp={} pp={}) and the expert grid (etp={} ep={} edp={} "
             "pp={}) differ under order '{}'; put pp last or make dp equal edp",
             cfg.tp, cfg.cp, cfg.dp, cfg.pp, cfg.etp, cfg.ep, cfg.edp, cfg.pp, cfg.order);
}

RankGroups ParallelGroups::groups(GroupKind kind) const {
  switch (kind) {
    case GroupKind::kTp: return dense_.get_ranks("tp");
    case GroupKind::kCp: return dense_.get_ranks("cp");
    case GroupKind::kDp: return dense_.get_ranks("dp");
    case GroupKind::kPp: return dense_.get_ranks("pp");
    case GroupKind::kTpCp: return dense_.get_ranks("tp-cp");
    case GroupKind::kDpCp: return dense_.get_ranks("dp-cp");
    case GroupKind::kMp: return dense_.get_ranks("tp-pp");
    case GroupKind::kTpDp: return dense_.get_ranks("tp-dp");
    case GroupKind::kTpDpCp: return dense_.get_ranks("tp-dp-cp");
    case GroupKind::kEp: return expert_.get_ranks("ep");
    case GroupKind::kEtp: return expert_.get_ranks("tp");
    case GroupKind::kEtpEp: return expert_.get_ranks("tp-ep");
    case GroupKind::kEtpEpPp: return expert_.get_ranks("tp-ep-pp");
    case GroupKind::kEdp: return expert_.get_ranks("dp");
    case GroupKind::kEmbedding:
    case GroupKind::kPositionEmbedding: {
      RankGroups out;
      for (const auto& pp_ranks : dense_.get_ranks("pp"))
        out.push_back(kind == GroupKind::kEmbedding ? default_embedding_ranks(pp_ranks)
                                                    : default_position_embedding_ranks(pp_ranks));
      return out;
    }
  }
  MT_FAIL("unknown GroupKind {}", static_cast<int>(kind));
}

std::vector<int> ParallelGroups::group_of(GroupKind kind, int rank) const {
  MT_REQUIRE(rank >= 0 && rank < cfg_.world, "rank {} outside the world of {} ranks", rank, cfg_.world);
  for (auto& g : groups(kind))
    if (std::find(g.begin(), g.end(), rank) != g.end()) return g;
  MT_REQUIRE(kind == GroupKind::kEmbedding || kind == GroupKind::kPositionEmbedding,
             "rank {} is in no {} group (internal error)", rank, group_kind_name(kind));
  return {};
}

RankCoordinates ParallelGroups::coordinates(int rank) const {
  MT_REQUIRE(rank >= 0 && rank < cfg_.world, "rank {} outside the world of {} ranks", rank, cfg_.world);
  RankCoordinates c;
  c.tp = dense_.coordinate(rank, "tp");
  c.cp = dense_.coordinate(rank, "cp");
  c.dp = dense_.coordinate(rank, "dp");
  c.pp = dense_.coordinate(rank, "pp");
  c.etp = expert_.coordinate(rank, "tp");
  c.ep = expert_.coordinate(rank, "ep");
  c.edp = expert_.coordinate(rank, "dp");
  return c;
}

}  // namespace mt
