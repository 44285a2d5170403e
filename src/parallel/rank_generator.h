// Rank groups of every parallel dimension, as Megatron-Core builds them
// (megatron/core/parallel_state.py: generate_masked_orthogonal_rank_groups, RankGenerator,
// default_embedding_ranks, initialize_model_parallel). Pure functions, no communication: the
// runtime splits its world communicator with these lists. See docs/parallelism.md.
//
// A rank is a mixed-radix number whose digits are the coordinates along the dimensions of the
// order string, leftmost digit fastest:  order "tp-cp-ep-dp-pp", sizes [tp, cp, ep, dp, pp]:
//   rank = tp_rank + tp·(cp_rank + cp·(ep_rank + ep·(dp_rank + dp·pp_rank)))
// The group of a token such as "dp" or "tp-pp" is the set of ranks that agree on every
// coordinate not named by the token; inside a group ranks are listed in increasing mixed-radix
// order of the named coordinates (so increasing rank), and groups are listed in increasing
// mixed-radix order of the other coordinates.
#pragma once
#include <array>
#include <string>
#include <vector>

#include "parallel/parallel_config.h"

namespace mt {

using RankGroups = std::vector<std::vector<int>>;

/// Megatron's generate_masked_orthogonal_rank_groups: world = product(parallel_size); returns
/// world / product(masked sizes) groups of product(masked sizes) ranks each, the groups of the
/// dimensions whose mask is true. Throws mt::Error when the sizes are not positive, the lists
/// differ in length or world_size != product(parallel_size).
RankGroups generate_masked_orthogonal_rank_groups(int world_size, const std::vector<int>& parallel_size,
                                                  const std::vector<bool>& mask);

/// Megatron-Core's RankGenerator. Dimension names: tp, cp, ep, dp, pp. Dimensions of size 1 that
/// the order omits are appended (as Megatron does); omitting a dimension of size > 1, an unknown
/// or repeated name, or ep > 1 together with cp > 1 (Megatron builds the dense grid with ep = 1
/// and the expert grid with cp = 1) throws mt::Error.
class RankGenerator {
 public:
  RankGenerator(int tp, int ep, int dp, int pp, int cp, const std::string& order, int rank_offset = 0);

  /// Groups of `token`: one name ("tp") or several joined by '-' ("tp-pp", "dp-cp"); the order of
  /// names in the token does not matter. Throws mt::Error for a name not in the order.
  RankGroups get_ranks(const std::string& token) const;
  /// The coordinate of global `rank` along dimension `name` (0 <= value < size of name).
  int coordinate(int rank, const std::string& name) const;
  int size(const std::string& name) const;
  int world_size() const { return world_size_; }
  /// The normalised order (lower case, omitted size-1 dimensions appended).
  const std::string& order() const { return order_; }

 private:
  std::vector<bool> mask_of(const std::string& token) const;
  int index_of(const std::string& name) const;

  std::vector<std::string> names_;  // dimension names in order
  std::vector<int> sizes_;          // their sizes
  std::string order_;
  int world_size_ = 1;
  int rank_offset_ = 0;
};

/// Megatron's default_embedding_ranks: the first and last rank of a pipeline group (the stages
/// holding the word embedding and the tied output layer); the single rank when pp == 1.
std::vector<int> default_embedding_ranks(const std::vector<int>& pp_ranks);
/// Megatron's default_position_embedding_ranks: the first rank of a pipeline group.
std::vector<int> default_position_embedding_ranks(const std::vector<int>& pp_ranks);

/// Every group kind a trainer needs (the fields of comm/communicator.h ProcessGroups). Dense kinds
/// come from the dense grid, expert kinds from the expert grid.
enum class GroupKind {
  kTp,                 ///< dense "tp"
  kCp,                 ///< dense "cp"
  kDp,                 ///< dense "dp" (data loading: ranks that see different samples, same cp slice)
  kPp,                 ///< dense "pp" (equal to the expert grid's "pp"; checked)
  kTpCp,               ///< dense "tp-cp"
  kDpCp,               ///< dense "dp-cp" (gradient reduction / distributed optimizer of dense params)
  kMp,                 ///< dense "tp-pp": model-parallel group
  kTpDp,               ///< dense "tp-dp"
  kTpDpCp,             ///< dense "tp-dp-cp"
  kEp,                 ///< expert "ep"
  kEtp,                ///< expert "tp" (expert tensor parallel)
  kEtpEp,              ///< expert "tp-ep"
  kEtpEpPp,            ///< expert "tp-ep-pp"
  kEdp,                ///< expert "dp" (gradient reduction of expert params)
  kEmbedding,          ///< default_embedding_ranks of each pp group
  kPositionEmbedding,  ///< default_position_embedding_ranks of each pp group
};
constexpr std::array<GroupKind, 16> kAllGroupKinds = {
    GroupKind::kTp,    GroupKind::kCp,    GroupKind::kDp,     GroupKind::kPp,       GroupKind::kTpCp,
    GroupKind::kDpCp,  GroupKind::kMp,    GroupKind::kTpDp,   GroupKind::kTpDpCp,   GroupKind::kEp,
    GroupKind::kEtp,   GroupKind::kEtpEp, GroupKind::kEtpEpPp, GroupKind::kEdp,     GroupKind::kEmbedding,
    GroupKind::kPositionEmbedding};
/// "tp", "cp", "dp", "pp", "tp_cp", "dp_cp", "mp", "tp_dp", "tp_dp_cp", "ep", "etp", "etp_ep",
/// "etp_ep_pp", "edp", "embedding", "position_embedding" (ProcessGroups field names where one
/// exists).
const char* group_kind_name(GroupKind kind);

/// A rank's coordinates: dense grid (tp, cp, dp, pp) and expert grid (etp, ep, edp; same pp).
/// Each equals the rank's index inside its group of that kind.
struct RankCoordinates {
  int tp = 0, cp = 0, dp = 0, pp = 0, ep = 0, etp = 0, edp = 0;
};

/// The two RankGenerators of initialize_model_parallel for a validated ParallelConfig:
///   dense:  RankGenerator(tp, ep=1, dp, pp, cp, order)
///   expert: RankGenerator(etp, ep, edp, pp, cp=1, order)
class ParallelGroups {
 public:
  /// `cfg` must have passed validate_and_derive (checked: dp, edp, world consistent).
  explicit ParallelGroups(const ParallelConfig& cfg);

  const RankGenerator& dense() const { return dense_; }
  const RankGenerator& expert() const { return expert_; }
  const ParallelConfig& config() const { return cfg_; }

  /// All groups of `kind` (each a list of global ranks; together they partition the world,
  /// except kEmbedding / kPositionEmbedding which hold 1 or 2 ranks per pp group).
  RankGroups groups(GroupKind kind) const;
  /// The group of `kind` containing `rank`; empty for kEmbedding / kPositionEmbedding when the
  /// rank is in none (Megatron: the rank joins no such group). Throws for rank outside the world.
  std::vector<int> group_of(GroupKind kind, int rank) const;
  RankCoordinates coordinates(int rank) const;

 private:
  ParallelConfig cfg_;
  RankGenerator dense_;
  RankGenerator expert_;
};

}  // namespace mt
