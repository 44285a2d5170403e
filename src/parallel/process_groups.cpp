#include "parallel/process_groups.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "parallel/rank_generator.h"

namespace mt {

namespace {
std::shared_ptr<Communicator> split_kind(Communicator& world, const ParallelGroups& pg, GroupKind kind,
                                         const char* name) {
  const RankGroups groups = pg.groups(kind);
  const int me = world.rank();
  int color = -1, key = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].size(); ++i) {
      if (groups[g][i] == me) {
        color = static_cast<int>(g);
        key = static_cast<int>(i);
      }
    }
  }
  auto comm = world.split(color, key, name);
  return comm ? comm : std::make_shared<SingleRankCommunicator>(std::string(name) + "(none)");
}
}  // namespace

ProcessGroups build_process_groups(const std::shared_ptr<Communicator>& world, const ParallelConfig& cfg) {
  MT_CHECK(cfg.world == world->size(), "parallel config is for {} ranks but the world has {}", cfg.world,
           world->size());
  if (world->size() == 1) {
    ProcessGroups g = ProcessGroups::single();
    g.world = world;
    return g;
  }
  const ParallelGroups pg(cfg);
  ProcessGroups g;
  g.world = world;
  g.tp = split_kind(*world, pg, GroupKind::kTp, "tp");
  g.cp = split_kind(*world, pg, GroupKind::kCp, "cp");
  g.dp = split_kind(*world, pg, GroupKind::kDp, "dp");
  g.pp = split_kind(*world, pg, GroupKind::kPp, "pp");
  g.tp_cp = split_kind(*world, pg, GroupKind::kTpCp, "tp-cp");
  g.dp_cp = split_kind(*world, pg, GroupKind::kDpCp, "dp-cp");
  g.mp = split_kind(*world, pg, GroupKind::kMp, "mp");
  g.ep = split_kind(*world, pg, GroupKind::kEp, "ep");
  g.etp = split_kind(*world, pg, GroupKind::kEtp, "etp");
  g.edp = split_kind(*world, pg, GroupKind::kEdp, "edp");
  g.etp_ep = split_kind(*world, pg, GroupKind::kEtpEp, "etp-ep");
  g.etp_ep_pp = split_kind(*world, pg, GroupKind::kEtpEpPp, "etp-ep-pp");
  g.embedding = split_kind(*world, pg, GroupKind::kEmbedding, "embedding");
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
