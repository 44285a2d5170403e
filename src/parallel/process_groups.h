// Builds the ProcessGroups of this rank from the world communicator and a validated
// ParallelConfig, with Megatron-Core's rank layout (RankGenerator, order "tp-cp-ep-dp-pp").
// Collective over `world`: every rank must call it.
#pragma once
#include <functional>
#include <string>

#include "comm/communicator.h"
#include "parallel/parallel_config.h"

namespace mt {

ProcessGroups build_process_groups(const std::shared_ptr<Communicator>& world, const ParallelConfig& cfg);

/// Makes the communicator of one group kind for the rank: name ("tp", "dp-cp", ...), color (the
/// index of the rank's group among the kind's groups; -1 when the rank is in none, e.g. the
/// embedding group), key (the rank's index in its group) and the group's size. nullptr: no group.
using GroupMaker = std::function<std::shared_ptr<Communicator>(const char* name, int color, int key, int size)>;

/// The ProcessGroups of global `rank` of a validated `cfg` (world left empty), each group made by
/// `make` in a fixed order of kinds (the same on every rank: `make` may be collective).
/// build_process_groups splits the world with it; `megatron plan` makes groups that only know
/// their rank and size (plan/plan_groups.h).
ProcessGroups process_groups_of(const ParallelConfig& cfg, int rank, const GroupMaker& make);

/// The layout table rank 0 prints: one line per group kind with the groups of ranks.
std::string layout_table(const ParallelConfig& cfg);

}  // namespace mt
