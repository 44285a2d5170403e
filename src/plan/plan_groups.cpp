#include "plan/plan_groups.h"

#include "core/check.h"
#include "parallel/process_groups.h"

namespace mt {

PlanCommunicator::PlanCommunicator(std::string name, int rank, int size)
    : name_(std::move(name)), rank_(rank), size_(size) {
  MT_CHECK(size >= 1 && rank >= 0 && rank < size, "plan group '{}': rank {} of a group of {}", name_, rank, size);
}

void PlanCommunicator::refuse(const char* what) const {
  MT_FAIL("{} on the plan-only group '{}' (rank {} of {}): `megatron plan` measures ranks, it runs none", what, name_,
          rank_, size_);
}

std::shared_ptr<Communicator> PlanCommunicator::split(int, int, const std::string& name) {
  refuse(("split into '" + name + "'").c_str());
}

ProcessGroups plan_process_groups(const ParallelConfig& cfg, int rank) {
  MT_REQUIRE(rank >= 0 && rank < cfg.world, "rank {} is outside the world of {} ranks", rank, cfg.world);
  ProcessGroups g = process_groups_of(cfg, rank, [](const char* name, int color, int key, int size) {
    return color < 0 ? nullptr : std::make_shared<PlanCommunicator>(name, key, size);
  });
  g.world = std::make_shared<PlanCommunicator>("world", rank, cfg.world);
  return g;
}

}  // namespace mt
