#include "parallel/process_groups.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "parallel/rank_generator.h"

namespace mt {

ProcessGroups process_groups_of(const ParallelConfig& cfg, int rank, const GroupMaker& make) {
  const ParallelGroups pg(cfg);
  const auto kind = [&](GroupKind k, const char* name) {
    const RankGroups groups = pg.groups(k);
    int color = -1, key = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      for (size_t i = 0; i < groups[g].size(); ++i) {
        if (groups[g][i] == rank) {
          color = static_cast<int>(g);
          key = static_cast<int>(i);
        }
      }
    }
    auto comm = make(name, color, key, color < 0 ? 0 : static_cast<int>(groups[static_cast<size_t>(color)].size()));
    return comm ? comm : std::make_shared<SingleRankCommunicator>(std::string(name) + "(none)");
  };
  ProcessGroups g;
  g.tp = kind(GroupKind::kTp, "tp");
  g.cp = kind(GroupKind::kCp, "cp");
  g.dp = kind(GroupKind::kDp, "dp");
  g.pp = kind(GroupKind::kPp, "pp");
  g.tp_cp = kind(GroupKind::kTpCp, "tp-cp");
  g.dp_cp = kind(GroupKind::kDpCp, "dp-cp");
  g.mp = kind(GroupKind::kMp, "mp");
  g.ep = kind(GroupKind::kEp, "ep");
  g.etp = kind(GroupKind::kEtp, "etp");
  g.edp = kind(GroupKind::kEdp, "edp");
  g.etp_ep = kind(GroupKind::kEtpEp, "etp-ep");
  g.etp_ep_pp = kind(GroupKind::kEtpEpPp, "etp-ep-pp");
  g.embedding = kind(GroupKind::kEmbedding, "embedding");
  return g;
}

ProcessGroups build_process_groups(const std::shared_ptr<Communicator>& world, const ParallelConfig& cfg) {
  MT_CHECK(cfg.world == world->size(), "parallel config is for {} ranks but the world has {}", cfg.world,
           world->size());
  if (world->size() == 1) {
    ProcessGroups g = ProcessGroups::single();
    g.world = world;
    return g;
  }
  ProcessGroups g = process_groups_of(cfg, world->rank(), [&](const char* name, int color, int key, int) {
    return world->split(color, key, name);
  });
  g.world = world;
  return g;
}

std::string layout_table(const ParallelConfig& cfg) {
  const ParallelGroups pg(cfg);
  std::string out = fmt::format("> parallel layout: {}\n", cfg.to_string());
  const std::pair<GroupKind, const char*> kinds[] = {{GroupKind::kTp, "tp"}, {GroupKind::kCp, "cp"},
                                                     {GroupKind::kDp, "dp"}, {GroupKind::kPp, "pp"},
                                                     {GroupKind::kMp, "mp"}, {GroupKind::kEp, "ep"},
                                                     {GroupKind::kEmbedding, "embedding"}};
  for (const auto& [kind, name] : kinds) {
    std::string groups;
    for (const auto& grp : pg.groups(kind)) groups += fmt::format("[{}] ", fmt::join(grp, ","));
    out += fmt::format(">   {:<10} {}\n", name, groups);
  }
  return out;
}

}  // namespace mt
