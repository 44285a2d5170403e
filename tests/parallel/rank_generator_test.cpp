// Tests of parallel/rank_generator.h and parallel/parallel_config.h: the worked examples
// (Megatron's initialize_model_parallel docstring, docs/parallelism.md), an independent
// brute-force oracle over many layouts and orders, Megatron's unit-test closed forms
// (tests/unit_tests/test_parallel_state.py: golden_rank_result_from_past_code), group
// properties, and every documented error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "testing/testing.h"
#include "core/check.h"
#include "parallel/parallel_config.h"
#include "parallel/rank_generator.h"

namespace mt {
namespace {

RankGroups range_groups(int world, int size) {  // [0..size), [size..2size), ...
  RankGroups g;
  for (int s = 0; s < world; s += size) {
    g.emplace_back();
    for (int r = s; r < s + size; ++r) g.back().push_back(r);
  }
  return g;
}

ParallelConfig make(int world, int tp, int cp, int pp, int ep = 1, int etp = 0, const std::string& order = "tp-cp-ep-dp-pp") {
  ParallelConfig c;
  c.tp = tp;
  c.cp = cp;
  c.pp = pp;
  c.ep = ep;
  c.etp = etp;
  c.order = order;
  validate_and_derive(c, world);
  return c;
}

using ::mt::testing::expect_error;

// ---------------------------------------------------------------------------------------------
// Worked examples

TEST(RankGenerator, Tp4Pp2Dp2On16Ranks) {
  const ParallelGroups g(make(16, 4, 1, 2));
  EXPECT_EQ(g.config().dp, 2);
  EXPECT_EQ(g.groups(GroupKind::kTp), range_groups(16, 4));
  EXPECT_EQ(g.groups(GroupKind::kDp), (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(g.groups(GroupKind::kDpCp), g.groups(GroupKind::kDp));
  EXPECT_EQ(g.groups(GroupKind::kPp),
            (RankGroups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
  EXPECT_EQ(g.groups(GroupKind::kMp), (RankGroups{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}));
  EXPECT_EQ(g.groups(GroupKind::kCp), range_groups(16, 1));
  EXPECT_EQ(g.groups(GroupKind::kTpCp), range_groups(16, 4));
  EXPECT_EQ(g.groups(GroupKind::kTpDp), range_groups(16, 8));
  EXPECT_EQ(g.groups(GroupKind::kTpDpCp), range_groups(16, 8));
  EXPECT_EQ(g.groups(GroupKind::kEmbedding), g.groups(GroupKind::kPp));  // pp = 2: first = rank 0, last = rank 1
  EXPECT_EQ(g.groups(GroupKind::kPositionEmbedding), range_groups(8, 1));
  // Expert grid with etp = tp = 4, ep = 1: edp = dp.
  EXPECT_EQ(g.groups(GroupKind::kEtp), g.groups(GroupKind::kTp));
  EXPECT_EQ(g.groups(GroupKind::kEdp), g.groups(GroupKind::kDp));
  EXPECT_EQ(g.groups(GroupKind::kEp), range_groups(16, 1));
  const RankCoordinates c = g.coordinates(13);  // 13 = tp 1 + 4·(dp 1) + 8·(pp 1)
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(c.pp, 1);
  EXPECT_EQ(c.cp, 0);
  EXPECT_EQ(c.etp, 1);
  EXPECT_EQ(c.ep, 0);
  EXPECT_EQ(c.edp, 1);
}

// Megatron-LM megatron/core/parallel_state.py, initialize_model_parallel docstring: 16 GPUs,
// tensor parallel 2, pipeline parallel 4 (data parallel 2).
TEST(RankGenerator, MegatronDocstringTp2Pp4On16Ranks) {
  const ParallelGroups g(make(16, 2, 1, 4));
  EXPECT_EQ(g.groups(GroupKind::kDp),
            (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(g.groups(GroupKind::kTp),
            (RankGroups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(g.groups(GroupKind::kPp), (RankGroups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(g.groups(GroupKind::kEmbedding), (RankGroups{{0, 12}, {1, 13}, {2, 14}, {3, 15}}));
  EXPECT_EQ(g.groups(GroupKind::kPositionEmbedding), (RankGroups{{0}, {1}, {2}, {3}}));
  EXPECT_EQ(g.group_of(GroupKind::kEmbedding, 12), (std::vector<int>{0, 12}));
  EXPECT_TRUE(g.group_of(GroupKind::kEmbedding, 5).empty());  // middle stage: no embedding group
}

// generate_masked_orthogonal_rank_groups docstring examples.
TEST(RankGenerator, MaskedOrthogonalDocstringExamples) {
  // 8 GPUs, order tp-pp-dp, sizes 2-2-2: dp groups [[0,4],[1,5],[2,6],[3,7]].
  EXPECT_EQ(generate_masked_orthogonal_rank_groups(8, {2, 2, 2}, {false, false, true}),
            (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  // sizes [tp, dp, pp] = [2, 3, 4], mask dp: dp_group[0] = [0,2,4], [1] = [1,3,5], [7] = [19,21,23].
  const RankGroups dp = generate_masked_orthogonal_rank_groups(24, {2, 3, 4}, {false, true, false});
  ASSERT_EQ(dp.size(), 8u);
  EXPECT_EQ(dp[0], (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(dp[1], (std::vector<int>{1, 3, 5}));
  EXPECT_EQ(dp[7], (std::vector<int>{19, 21, 23}));
}

// MoE with context parallelism (Megatron's folding: edp = world / (etp·ep·pp), the expert grid has no
// cp): CP folds into EP and / or EDP. 8 ranks, TP 1, CP 2, EP 2 (dense DP 4): the EP groups are
// the CP groups, EDP the DP groups. TP 2, CP 2, EP 1 on 8 ranks (DP 2): EDP = the dp-cp groups.
TEST(RankGenerator, MoeWithContextParallel) {
  const ParallelGroups g(make(8, 1, 2, 1, /*ep=*/2, /*etp=*/1));
  EXPECT_EQ(g.config().edp, 4);
  EXPECT_EQ(g.groups(GroupKind::kCp), range_groups(8, 2));
  EXPECT_EQ(g.groups(GroupKind::kEp), range_groups(8, 2));
  EXPECT_EQ(g.groups(GroupKind::kDp), (RankGroups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(g.groups(GroupKind::kEdp), (RankGroups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(g.groups(GroupKind::kDpCp), range_groups(8, 8));
  const ParallelGroups h(make(8, 2, 2, 1));
  EXPECT_EQ(h.config().edp, 4);
  EXPECT_EQ(h.groups(GroupKind::kTpCp), range_groups(8, 4));
  EXPECT_EQ(h.groups(GroupKind::kDpCp), (RankGroups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(h.groups(GroupKind::kEdp), h.groups(GroupKind::kDpCp));
  EXPECT_EQ(h.groups(GroupKind::kEtp), h.groups(GroupKind::kTp));
}

// MoE parallel folding: dense TP4-PP2-DP2 and expert ETP1-EP4-EDP2-PP2 on 16 ranks.
TEST(RankGenerator, MoeEtp1Pp2Ep4Edp2On16Ranks) {
  const ParallelGroups g(make(16, 4, 1, 2, /*ep=*/4, /*etp=*/1));
  EXPECT_EQ(g.config().edp, 2);
  EXPECT_EQ(g.groups(GroupKind::kEp), range_groups(16, 4));
  EXPECT_EQ(g.groups(GroupKind::kEdp),
            (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(g.groups(GroupKind::kPp),
            (RankGroups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
  EXPECT_EQ(g.groups(GroupKind::kEtp), range_groups(16, 1));
  EXPECT_EQ(g.groups(GroupKind::kEtpEp), range_groups(16, 4));
  EXPECT_EQ(g.groups(GroupKind::kEtpEpPp), (RankGroups{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}));
  EXPECT_EQ(g.groups(GroupKind::kTp), range_groups(16, 4));  // dense tp unchanged by folding
  const RankCoordinates c = g.coordinates(14);               // ep 2, edp 1, pp 1; tp 2, dp 1
  EXPECT_EQ(c.ep, 2);
  EXPECT_EQ(c.edp, 1);
  EXPECT_EQ(c.etp, 0);
  EXPECT_EQ(c.pp, 1);
  EXPECT_EQ(c.tp, 2);
  EXPECT_EQ(c.dp, 1);
  // Same expert grid with a dense TP1 / DP8 grid.
  const ParallelGroups g2(make(16, 1, 1, 2, 4, 1));
  EXPECT_EQ(g2.config().dp, 8);
  EXPECT_EQ(g2.groups(GroupKind::kEp), g.groups(GroupKind::kEp));
  EXPECT_EQ(g2.groups(GroupKind::kEdp), g.groups(GroupKind::kEdp));
  EXPECT_EQ(g2.groups(GroupKind::kDp), (RankGroups{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}}));
}

TEST(RankGenerator, ContextParallelDocstring) {
  // initialize_model_parallel docstring: 8 GPUs, tp 4, cp 2: cp groups [0,4],[1,5],[2,6],[3,7].
  const ParallelGroups g(make(8, 4, 2, 1));
  EXPECT_EQ(g.groups(GroupKind::kCp), (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(g.groups(GroupKind::kTpCp), (RankGroups{{0, 1, 2, 3, 4, 5, 6, 7}}));
  EXPECT_EQ(g.groups(GroupKind::kDpCp), (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(g.groups(GroupKind::kDp), range_groups(8, 1));
}

TEST(RankGenerator, TpPpDpOrderAndOffset) {
  // Megatron's --use-tp-pp-dp-mapping order: tp 2, pp 2, dp 2 on 8: dp groups [0,4],[1,5],[2,6],[3,7].
  const ParallelGroups g(make(8, 2, 1, 2, 1, 0, "tp-cp-ep-pp-dp"));
  EXPECT_EQ(g.groups(GroupKind::kDp), (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(g.groups(GroupKind::kPp), (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  const RankGenerator off(2, 1, 2, 2, 1, "tp-pp-dp", 100);
  EXPECT_EQ(off.get_ranks("dp"), (RankGroups{{100, 104}, {101, 105}, {102, 106}, {103, 107}}));
  EXPECT_EQ(off.coordinate(105, "dp"), 1);
  EXPECT_EQ(off.order(), "tp-pp-dp-ep-cp");
}

// ---------------------------------------------------------------------------------------------
// Oracles

// Brute force: digits of each rank in the order (leftmost fastest); a group = ranks agreeing on
// every unnamed digit, listed by increasing rank; groups by increasing first rank.
RankGroups brute_force(const std::vector<std::string>& names, const std::vector<int>& sizes, const std::string& token) {
  int world = 1;
  for (int s : sizes) world *= s;
  std::set<std::string> named;
  for (size_t start = 0;;) {
    size_t p = token.find('-', start);
    named.insert(token.substr(start, p == std::string::npos ? std::string::npos : p - start));
    if (p == std::string::npos) break;
    start = p + 1;
  }
  std::map<std::vector<int>, std::vector<int>> by_key;
  for (int r = 0; r < world; ++r) {
    std::vector<int> key;
    int x = r;
    for (size_t i = 0; i < names.size(); ++i) {
      if (!named.count(names[i])) key.push_back(x % sizes[i]);
      x /= sizes[i];
    }
    by_key[key].push_back(r);
  }
  RankGroups out;
  for (auto& [k, v] : by_key) out.push_back(v);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> all_tokens(const std::vector<std::string>& dims) {
  std::vector<std::string> out;
  for (int mask = 1; mask < (1 << dims.size()); ++mask) {
    std::string t;
    for (size_t i = 0; i < dims.size(); ++i)
      if (mask & (1 << i)) t += (t.empty() ? "" : "-") + dims[i];
    out.push_back(t);
  }
  return out;
}

TEST(RankGenerator, MatchesBruteForceForManyLayoutsAndOrders) {
  const std::vector<std::string> orders = {"tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp", "pp-dp-tp-cp-ep",
                                           "dp-tp-pp-cp-ep", "cp-tp-ep-dp-pp"};
  int checked = 0;
  for (const std::string& order : orders)
    for (int tp : {1, 2, 3})
      for (int cp : {1, 2})
        for (int dp : {1, 2, 3})
          for (int pp : {1, 2, 4})
            for (int ep : {1, 2}) {
              if (ep > 1 && cp > 1) continue;
              if (order == "tp-pp-dp" && (cp > 1 || ep > 1)) continue;
              const RankGenerator g(tp, ep, dp, pp, cp, order);
              std::vector<std::string> names;
              std::vector<int> sizes;
              std::string o = g.order();
              for (size_t start = 0;;) {
                size_t p = o.find('-', start);
                names.push_back(o.substr(start, p == std::string::npos ? std::string::npos : p - start));
                sizes.push_back(g.size(names.back()));
                if (p == std::string::npos) break;
                start = p + 1;
              }
              for (const std::string& token : all_tokens(names)) {
                const RankGroups got = g.get_ranks(token);
                ASSERT_EQ(got, brute_force(names, sizes, token)) << order << " tp" << tp << " cp" << cp << " dp"
                                                                 << dp << " pp" << pp << " ep" << ep << " " << token;
                ++checked;
              }
              for (int r = 0; r < g.world_size(); ++r)
                for (const std::string& n : names) {
                  // coordinate == index inside the rank's single-dimension group
                  for (const auto& grp : g.get_ranks(n)) {
                    auto it = std::find(grp.begin(), grp.end(), r);
                    if (it != grp.end()) ASSERT_EQ(g.coordinate(r, n), it - grp.begin());
                  }
                }
            }
  std::printf("checked %d (layout, token) pairs\n", checked);
  EXPECT_GT(checked, 10000);
}

// Closed forms of Megatron's tests/unit_tests/test_parallel_state.py (order tp-cp-dp-pp and the
// expert order tp-ep-dp-pp), written independently here.
TEST(RankGenerator, MatchesMegatronUnitTestClosedForms) {
  struct L {
    int world, tp, pp, cp, ep;
  };
  for (const L l : {L{16, 4, 2, 1, 1}, L{32, 2, 4, 2, 1}, L{64, 4, 2, 8, 8}, L{64, 8, 4, 1, 2}, L{96, 4, 8, 1, 1},
                    L{48, 2, 2, 3, 3}, L{24, 1, 3, 2, 2}}) {
    const int dp = l.world / (l.tp * l.pp * l.cp);
    const int edp = l.world / (l.tp * l.ep * l.pp);
    const RankGenerator g(l.tp, 1, dp, l.pp, l.cp, "tp-cp-dp-pp");
    const RankGenerator e(l.tp, l.ep, edp, l.pp, 1, "tp-ep-dp-pp");
    const int per_stage = l.world / l.pp;
    RankGroups dp_g, dpcp_g, tp_g, pp_g, cp_g;
    for (int i = 0; i < l.pp; ++i) {
      for (int j = 0; j < l.cp * l.tp; ++j) {
        dp_g.emplace_back();
        for (int r = i * per_stage + j; r < (i + 1) * per_stage; r += l.cp * l.tp) dp_g.back().push_back(r);
      }
      for (int j = 0; j < l.tp; ++j) {
        dpcp_g.emplace_back();
        for (int r = i * per_stage + j; r < (i + 1) * per_stage; r += l.tp) dpcp_g.back().push_back(r);
      }
      for (int j = 0; j < dp; ++j)
        for (int k = 0; k < l.tp; ++k) {
          cp_g.emplace_back();
          const int start = i * per_stage + j * l.tp * l.cp;
          for (int r = start + k; r < start + l.tp * l.cp; r += l.tp) cp_g.back().push_back(r);
        }
    }
    for (int i = 0; i < l.world / l.tp; ++i) {
      tp_g.emplace_back();
      for (int r = i * l.tp; r < (i + 1) * l.tp; ++r) tp_g.back().push_back(r);
    }
    for (int i = 0; i < per_stage; ++i) {
      pp_g.emplace_back();
      for (int r = i; r < l.world; r += per_stage) pp_g.back().push_back(r);
    }
    // mp group i = the i-th rank of every dp-cp group (in order).
    RankGroups mp_g(dp * l.cp);
    for (const auto& grp : dpcp_g)
      for (int i = 0; i < dp * l.cp; ++i) mp_g[i].push_back(grp[i]);
    // Expert: ranks reshaped (pp, edp, ep, tp): tp-ep groups are rows of ep·tp; edp groups
    // vary the edp index.
    RankGroups tpep_g, edp_g;
    for (int i = 0; i < l.world / (l.ep * l.tp); ++i) {
      tpep_g.emplace_back();
      for (int r = i * l.ep * l.tp; r < (i + 1) * l.ep * l.tp; ++r) tpep_g.back().push_back(r);
    }
    for (int p = 0; p < l.pp; ++p)
      for (int x = 0; x < l.ep * l.tp; ++x) {
        edp_g.emplace_back();
        for (int d = 0; d < edp; ++d) edp_g.back().push_back(p * per_stage + d * l.ep * l.tp + x);
      }
    EXPECT_EQ(g.get_ranks("dp"), dp_g);
    EXPECT_EQ(g.get_ranks("dp-cp"), dpcp_g);
    EXPECT_EQ(g.get_ranks("cp"), cp_g);
    EXPECT_EQ(g.get_ranks("tp"), tp_g);
    EXPECT_EQ(g.get_ranks("pp"), pp_g);
    EXPECT_EQ(g.get_ranks("tp-pp"), mp_g);
    EXPECT_EQ(e.get_ranks("tp-ep"), tpep_g);
    EXPECT_EQ(e.get_ranks("dp"), edp_g);
  }
}

// ---------------------------------------------------------------------------------------------
// Properties of ParallelGroups for many layouts

std::set<int> as_set(const std::vector<int>& v) { return {v.begin(), v.end()}; }

TEST(ParallelGroups, PropertiesForManyLayouts) {
  int layouts = 0;
  for (int world : {1, 2, 4, 6, 8, 12, 16, 24, 32})
    for (int tp : {1, 2, 4})
      for (int cp : {1, 2})
        for (int pp : {1, 2, 3, 4})
          for (int ep : {1, 2, 4})
            for (int etp : {0, 1, 2})
              for (const std::string order : {"tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"}) {
                ParallelConfig c;
                c.tp = tp, c.cp = cp, c.pp = pp, c.ep = ep, c.etp = etp, c.order = order;
                try {
                  validate_and_derive(c, world);
                } catch (const Error&) {
                  continue;
                }
                ++layouts;
                const ParallelGroups g(c);
                const std::map<GroupKind, int> sizes = {
                    {GroupKind::kTp, c.tp},          {GroupKind::kCp, c.cp},
                    {GroupKind::kDp, c.dp},          {GroupKind::kPp, c.pp},
                    {GroupKind::kTpCp, c.tp * c.cp}, {GroupKind::kDpCp, c.dp * c.cp},
                    {GroupKind::kMp, c.tp * c.pp},   {GroupKind::kTpDp, c.tp * c.dp},
                    {GroupKind::kTpDpCp, c.tp * c.dp * c.cp}, {GroupKind::kEp, c.ep},
                    {GroupKind::kEtp, c.etp},        {GroupKind::kEtpEp, c.etp * c.ep},
                    {GroupKind::kEtpEpPp, c.etp * c.ep * c.pp}, {GroupKind::kEdp, c.edp}};
                // Every kind partitions the world into groups of the expected size, listed
                // by increasing rank.
                for (const auto& [kind, size] : sizes) {
                  std::vector<int> seen(world, 0);
                  for (const auto& grp : g.groups(kind)) {
                    ASSERT_EQ(static_cast<int>(grp.size()), size) << group_kind_name(kind) << " " << c.to_string();
                    ASSERT_TRUE(std::is_sorted(grp.begin(), grp.end()));
                    for (int r : grp) ++seen[r];
                  }
                  for (int r = 0; r < world; ++r) ASSERT_EQ(seen[r], 1) << group_kind_name(kind);
                }
                for (int r = 0; r < world; ++r) {
                  auto grp = [&](GroupKind k) { return as_set(g.group_of(k, r)); };
                  auto meet = [](const std::set<int>& a, const std::set<int>& b) {
                    std::set<int> out;
                    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::inserter(out, out.begin()));
                    return out;
                  };
                  const std::set<int> me = {r};
                  // Orthogonal dimensions meet in exactly this rank.
                  EXPECT_EQ(meet(grp(GroupKind::kTp), grp(GroupKind::kDp)), me);
                  EXPECT_EQ(meet(grp(GroupKind::kTp), grp(GroupKind::kPp)), me);
                  EXPECT_EQ(meet(grp(GroupKind::kTp), grp(GroupKind::kCp)), me);
                  EXPECT_EQ(meet(grp(GroupKind::kDp), grp(GroupKind::kPp)), me);
                  EXPECT_EQ(meet(grp(GroupKind::kCp), grp(GroupKind::kPp)), me);
                  EXPECT_EQ(meet(grp(GroupKind::kDp), grp(GroupKind::kCp)), me);
                  EXPECT_EQ(meet(grp(GroupKind::kMp), grp(GroupKind::kDpCp)), me);
                  EXPECT_EQ(meet(grp(GroupKind::kEp), grp(GroupKind::kEdp)), me);
                  EXPECT_EQ(meet(grp(GroupKind::kEtp), grp(GroupKind::kEp)), me);
                  EXPECT_EQ(meet(grp(GroupKind::kEtpEpPp), grp(GroupKind::kEdp)), me);
                  // Combined groups contain their parts.
                  auto contains = [](const std::set<int>& big, const std::set<int>& small) {
                    return std::includes(big.begin(), big.end(), small.begin(), small.end());
                  };
                  EXPECT_TRUE(contains(grp(GroupKind::kTpCp), grp(GroupKind::kTp)));
                  EXPECT_TRUE(contains(grp(GroupKind::kDpCp), grp(GroupKind::kDp)));
                  EXPECT_TRUE(contains(grp(GroupKind::kMp), grp(GroupKind::kPp)));
                  EXPECT_TRUE(contains(grp(GroupKind::kTpDpCp), grp(GroupKind::kTpDp)));
                  EXPECT_TRUE(contains(grp(GroupKind::kEtpEpPp), grp(GroupKind::kEtpEp)));
                  // Coordinates are the positions inside the groups.
                  const RankCoordinates co = g.coordinates(r);
                  auto pos = [&](GroupKind k) {
                    auto v = g.group_of(k, r);
                    return static_cast<int>(std::find(v.begin(), v.end(), r) - v.begin());
                  };
                  EXPECT_EQ(co.tp, pos(GroupKind::kTp));
                  EXPECT_EQ(co.cp, pos(GroupKind::kCp));
                  EXPECT_EQ(co.dp, pos(GroupKind::kDp));
                  EXPECT_EQ(co.pp, pos(GroupKind::kPp));
                  EXPECT_EQ(co.ep, pos(GroupKind::kEp));
                  EXPECT_EQ(co.etp, pos(GroupKind::kEtp));
                  EXPECT_EQ(co.edp, pos(GroupKind::kEdp));
                  // Embedding group: first and last stage of the rank's pp group.
                  const auto ppg = g.group_of(GroupKind::kPp, r);
                  const auto emb = g.group_of(GroupKind::kEmbedding, r);
                  if (r == ppg.front() || r == ppg.back()) {
                    const std::vector<int> want = c.pp == 1 ? std::vector<int>{r} : std::vector<int>{ppg.front(), ppg.back()};
                    EXPECT_EQ(emb, want);
                  } else {
                    EXPECT_TRUE(emb.empty());
                  }
                }
                EXPECT_EQ(g.dense().get_ranks("pp"), g.expert().get_ranks("pp"));
              }
  std::printf("checked %d layouts\n", layouts);
  EXPECT_GT(layouts, 100);
}

// ---------------------------------------------------------------------------------------------
// Errors

TEST(ParallelConfig, DerivesAndNormalises) {
  ParallelConfig c;
  c.tp = 2, c.pp = 2, c.vpp = 1, c.ep = 2;
  validate_and_derive(c, 16);
  EXPECT_EQ(c.dp, 4);
  EXPECT_EQ(c.etp, 2);
  EXPECT_EQ(c.edp, 2);
  EXPECT_EQ(c.vpp, 0);
  EXPECT_EQ(c.world, 16);
  EXPECT_EQ(c.num_chunks(), 1);
  validate_and_derive(c, 16);  // idempotent
  EXPECT_EQ(c.dp, 4);
}

TEST(ParallelConfig, Errors) {
  auto v = [](int world, int tp, int cp, int pp, int ep = 1, int etp = 0, int vpp = 0, int dp = 0,
              std::string order = "tp-cp-ep-dp-pp") {
    return [=] {
      ParallelConfig c;
      c.tp = tp, c.cp = cp, c.pp = pp, c.ep = ep, c.etp = etp, c.vpp = vpp, c.dp = dp, c.order = order;
      validate_and_derive(c, world);
    };
  };
  expect_error(v(12, 4, 1, 2), "world size 12 is not divisible by tp (4) x cp (1) x pp (2) = 8");
  expect_error(v(16, 2, 1, 2, 16, 1), "world size 16 is not divisible by etp (1) x ep (16) x pp (2) = 32");
  expect_error(v(16, 2, 1, 2, 3), "world size 16 is not divisible by etp (2) x ep (3) x pp (2) = 12");
  expect_error(v(0, 1, 1, 1), "world size must be positive, got 0");
  expect_error(v(8, 0, 1, 1), "(tp) must be >= 1, got 0");
  expect_error(v(8, 1, 0, 1), "(cp) must be >= 1, got 0");
  expect_error(v(8, 1, 1, 0), "(pp) must be >= 1, got 0");
  expect_error(v(8, 1, 1, 1, 0), "(ep) must be >= 1, got 0");
  expect_error(v(8, 1, 1, 1, 1, -1), "(etp) must be >= 1 (or 0 = tp), got -1");
  expect_error(v(8, 1, 1, 1, 1, 0, -2), "(vpp) must be >= 0");
  expect_error(v(8, 1, 1, 1, 1, 0, 2), "vpp (2) need pipeline parallelism, but pp = 1");
  expect_error(v(8, 2, 1, 2, 1, 0, 0, 3), "dp (3) disagrees with world size 8 / (tp (2) x cp (1) x pp (2)) = 2");
  expect_error(v(8, 2, 1, 1, 1, 0, 0, 0, "tp-xx-dp-pp"), "unknown dimension 'xx'");
  expect_error(v(8, 2, 1, 1, 1, 0, 0, 0, "tp-dp-tp-pp"), "dimension 'tp' repeated");
  expect_error(v(8, 2, 1, 2, 1, 0, 0, 0, "tp-cp-ep-dp"), "omits pp whose size is 2");
  // Not pp-last and dp != edp: tp 2 ep 1 etp 1 -> dp 2, edp 4 on 8 ranks with pp 2... world 16.
  expect_error(v(16, 2, 1, 2, 1, 1, 0, 0, "tp-cp-ep-pp-dp"), "dp (4) must equal edp (8)");
}

TEST(RankGenerator, Errors) {
  expect_error([] { RankGenerator(2, 2, 1, 1, 2, "tp-cp-ep-dp-pp"); }, "ep (2) and cp (2) cannot both exceed 1");
  expect_error([] { RankGenerator(2, 1, 2, 1, 1, "tp-pp"); }, "omits dp whose size is 2");
  expect_error([] { RankGenerator(2, 1, 1, 1, 1, "tp").get_ranks("zz"); }, "'zz' is not a dimension");
  expect_error([] { RankGenerator(2, 1, 1, 1, 1, "tp").get_ranks("tp-tp"); }, "names 'tp' twice");
  expect_error([] { RankGenerator(2, 1, 1, 1, 1, "tp").coordinate(2, "tp"); }, "rank 2 outside [0, 2)");
  expect_error([] { RankGenerator(0, 1, 1, 1, 1, "tp"); }, "sizes must be positive");
  expect_error([] { generate_masked_orthogonal_rank_groups(8, {2, 2}, {true, false}); },
               "world size 8 is not the product of the parallel sizes [2, 2] = 4");
  expect_error([] { generate_masked_orthogonal_rank_groups(4, {2, 2}, {true}); }, "different lengths");
  ParallelConfig raw;  // not validated
  raw.tp = 2;
  raw.world = 4;
  expect_error([&] { ParallelGroups g(raw); }, "passed validate_and_derive");
  const ParallelGroups g(make(4, 2, 1, 1));
  expect_error([&] { g.group_of(GroupKind::kTp, 4); }, "rank 4 outside the world of 4 ranks");
  expect_error([&] { g.coordinates(-1); }, "rank -1 outside");
  expect_error([] { default_embedding_ranks({}); }, "empty pipeline group");
}

TEST(ValidateModelParallel, ChecksEveryDimension) {
  const ParallelConfig c = make(16, 4, 2, 2);  // dense: tp 4, cp 2, pp 2, dp 1
  validate_model_parallel(c, 24, 32, 4096, 50304);  // ok
  expect_error([&] { validate_model_parallel(c, 24, 30, 4096, 50304); },
               "num_attention_heads (30) is not divisible by tp (4)");
  expect_error([&] { validate_model_parallel(c, 24, 32, 4098, 50304); }, "ffn_hidden_size (4098) is not divisible by tp (4)");
  expect_error([&] { validate_model_parallel(c, 24, 32, 4096, 50258); },
               "padded vocabulary size (50258) is not divisible by tp (4)");
  ModelParallelOptions o;
  o.num_query_groups = 6;
  expect_error([&] { validate_model_parallel(c, 24, 32, 4096, 50304, o); },
               "num_attention_heads (32) is not divisible by num_query_groups (6)");
  o.num_query_groups = 2;
  expect_error([&] { validate_model_parallel(c, 24, 32, 4096, 50304, o); }, "num_query_groups (2) is not divisible by tp (4)");
  o.num_query_groups = 8;
  validate_model_parallel(c, 24, 32, 4096, 50304, o);
  o = {};
  o.seq_length = 1026;
  expect_error([&] { validate_model_parallel(c, 24, 32, 4096, 50304, o); },
               "seq_length (1026) is not divisible by 2 x cp (2) = 4");
  o.seq_length = 1032;  // 1032 / cp 2 = 516, divisible by tp 4
  o.sequence_parallel = true;
  validate_model_parallel(c, 24, 32, 4096, 50304, o);
  o.seq_length = 1028;  // 1028 / 2 = 514, not divisible by 4
  expect_error([&] { validate_model_parallel(c, 24, 32, 4096, 50304, o); },
               "seq_length (1028) / cp (2) = 514 is not divisible by tp (4)");
  o = {};
  expect_error([&] { validate_model_parallel(c, 25, 32, 4096, 50304, o); }, "num_layers (25) = 25 is not divisible by pp (2)");
  o.decoder_first_pipeline_num_layers = 5;
  validate_model_parallel(c, 25, 32, 4096, 50304, o);  // 5 + 20 on the last rank
  o.decoder_last_pipeline_num_layers = 5;
  expect_error([&] { validate_model_parallel(c, 25, 32, 4096, 50304, o); }, "15 layers remain for 0 middle ranks");

  const ParallelConfig moe = make(16, 4, 2, 2, /*ep=*/2, /*etp=*/2);
  o = {};
  expect_error([&] { validate_model_parallel(moe, 24, 32, 4096, 50304, o); }, "ep (2) > 1 needs a mixture-of-experts");
  o.num_experts = 5;
  expect_error([&] { validate_model_parallel(moe, 24, 32, 4096, 50304, o); }, "num_experts (5) is not divisible by ep (2)");
  o.num_experts = 8;
  o.moe_ffn_hidden_size = 1023;
  expect_error([&] { validate_model_parallel(moe, 24, 32, 4096, 50304, o); },
               "moe_ffn_hidden_size (1023) is not divisible by etp (2)");
  o.moe_ffn_hidden_size = 1024;
  validate_model_parallel(moe, 24, 32, 4096, 50304, o);
  ParallelConfig raw;
  expect_error([&] { validate_model_parallel(raw, 24, 32, 4096, 50304); }, "passed validate_and_derive");
}

}  // namespace
}  // namespace mt
