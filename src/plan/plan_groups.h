// Process groups of a rank that is not running: what `megatron plan` measures the model with.
// GPTModel::memory_plan reads the sizes and ranks of its groups (TP shards, EP experts, CP chunks,
// DP shards of the distributed optimizer) but communicates nothing while it measures; a
// PlanCommunicator answers rank() and size() and refuses every collective, so any communication
// that crept into the measurement would be an error instead of a hang.
#pragma once
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "parallel/parallel_config.h"

namespace mt {

/// A group that knows its name, this rank's index and its size, and nothing else. Every
/// collective, point-to-point call and split throws mt::Error naming the group (a plan runs no
/// rank). rank in [0, size).
class PlanCommunicator final : public Communicator {
 public:
  PlanCommunicator(std::string name, int rank, int size);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  void all_reduce(const Tensor&, ReduceOp, const Stream&) override { refuse("all_reduce"); }
  void all_gather(const Tensor&, const Tensor&, const Stream&) override { refuse("all_gather"); }
  void reduce_scatter(const Tensor&, const Tensor&, ReduceOp, const Stream&) override { refuse("reduce_scatter"); }
  void broadcast(const Tensor&, int, const Stream&) override { refuse("broadcast"); }
  void all_to_all(const Tensor&, const Tensor&, const Stream&) override { refuse("all_to_all"); }
  void all_to_allv(const Tensor&, const AllToAllvSplits&, const Tensor&, const AllToAllvSplits&,
                   const Stream&) override {
    refuse("all_to_allv");
  }
  void send(const Tensor&, int, const Stream&) override { refuse("send"); }
  void recv(const Tensor&, int, const Stream&) override { refuse("recv"); }
  void group_start() override {}
  void group_end() override {}
  void barrier() override { refuse("barrier"); }
  std::shared_ptr<Communicator> split(int, int, const std::string& name) override;

 private:
  [[noreturn]] void refuse(const char* what) const;
  std::string name_;
  int rank_, size_;
};

/// The ProcessGroups global rank `rank` of the validated `cfg` would have (Megatron-Core's
/// RankGenerator layout, parallel/process_groups.h), as PlanCommunicators; world included.
/// Errors: rank outside [0, cfg.world).
ProcessGroups plan_process_groups(const ParallelConfig& cfg, int rank);

}  // namespace mt
