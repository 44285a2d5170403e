// Builds the ProcessGroups of this rank from the world communicator and a validated
// ParallelConfig, with Megatron-Core's rank layout (RankGenerator, order "tp-cp-ep-dp-pp").
// Collective over `world`: every rank must call it.
#pragma once
#include <string>

#include "comm/communicator.h"
#include "parallel/parallel_config.h"

namespace mt {

ProcessGroups build_process_groups(const std::shared_ptr<Communicator>& world, const ParallelConfig& cfg);

/// The layout table rank 0 prints: one line per group kind with the groups of ranks.
std::string layout_table(const ParallelConfig& cfg);

}  // namespace mt
