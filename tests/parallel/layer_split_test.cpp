// Tests of parallel/pipeline/layer_split.h: worked examples (docs/parallelism.md, Megatron's
// initialize_model_parallel docstring and transformer_block.py comments), an independent port of
// Megatron's get_num_layers_to_build / get_transformer_layer_offset formulas as an oracle over
// many layouts, tiling properties, the virtual-pipeline flag conversion, and every error.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "testing/testing.h"
#include "core/check.h"
#include "parallel/pipeline/layer_split.h"

namespace mt::pipeline {
namespace {

using ::mt::testing::expect_error;

PipelineLayout layout(int64_t L, int pp, int vpp = 0, int64_t first = -1, int64_t last = -1, bool emb = false,
                      bool loss = false) {
  PipelineLayout p;
  p.num_layers = L;
  p.pp = pp;
  p.vpp = vpp;
  p.first_stage_layers = first;
  p.last_stage_layers = last;
  p.account_for_embedding = emb;
  p.account_for_loss = loss;
  return p;
}

std::vector<std::pair<int64_t, int64_t>> ranges(int rank, const PipelineLayout& p) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const LayerRange& r : layers_of(rank, p)) out.emplace_back(r.begin, r.end);
  return out;
}

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

TEST(LayerSplit, WorkedExample32LayersPp4Vpp2) {
  const PipelineLayout p = layout(32, 4, 2);
  EXPECT_EQ(ranges(0, p), (Ranges{{0, 4}, {16, 20}}));
  EXPECT_EQ(ranges(1, p), (Ranges{{4, 8}, {20, 24}}));
  EXPECT_EQ(ranges(2, p), (Ranges{{8, 12}, {24, 28}}));
  EXPECT_EQ(ranges(3, p), (Ranges{{12, 16}, {28, 32}}));
  const auto r0 = layers_of(0, p);
  EXPECT_TRUE(r0[0].has_embedding);
  EXPECT_FALSE(r0[0].has_loss);
  EXPECT_FALSE(r0[1].has_embedding);
  EXPECT_EQ(r0[1].stage, 4);
  EXPECT_EQ(r0[1].chunk, 1);
  const auto r3 = layers_of(3, p);
  EXPECT_FALSE(r3[0].has_loss);
  EXPECT_TRUE(r3[1].has_loss);
  EXPECT_EQ(r3[1].stage, 7);
  EXPECT_EQ(layers_per_virtual_stage(p), 4);
}

TEST(LayerSplit, MegatronDocstringExamples) {
  // initialize_model_parallel: 16 layers, pp 4, vpp 2 -> GPU 0: [1, 2] [9, 10] (1-based) ...
  const PipelineLayout p = layout(16, 4, 2);
  EXPECT_EQ(ranges(0, p), (Ranges{{0, 2}, {8, 10}}));
  EXPECT_EQ(ranges(1, p), (Ranges{{2, 4}, {10, 12}}));
  EXPECT_EQ(ranges(2, p), (Ranges{{4, 6}, {12, 14}}));
  EXPECT_EQ(ranges(3, p), (Ranges{{6, 8}, {14, 16}}));
  // transformer_block.py: 8 layers, 2 stages, 4 chunks: stage 0: [0] [2] [4] [6]; stage 1: [1] [3] [5] [7].
  EXPECT_EQ(ranges(0, layout(8, 2, 4)), (Ranges{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(ranges(1, layout(8, 2, 4)), (Ranges{{1, 2}, {3, 4}, {5, 6}, {7, 8}}));
  // ... 2 virtual stages: stage 0: [0, 1] [4, 5]; stage 1: [2, 3] [6, 7].
  EXPECT_EQ(ranges(0, layout(8, 2, 2)), (Ranges{{0, 2}, {4, 6}}));
  EXPECT_EQ(ranges(1, layout(8, 2, 2)), (Ranges{{2, 4}, {6, 8}}));
}

TEST(LayerSplit, EvenAndUnevenWithoutInterleaving) {
  EXPECT_EQ(ranges(0, layout(12, 1)), (Ranges{{0, 12}}));
  const auto single = layers_of(0, layout(12, 1));
  EXPECT_TRUE(single[0].has_embedding && single[0].has_loss);
  EXPECT_EQ(ranges(2, layout(12, 4)), (Ranges{{6, 9}}));
  // --decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 4, 12 layers, pp 4:
  // 2 | 3 | 3 | 4.
  const PipelineLayout u = layout(12, 4, 0, 2, 4);
  EXPECT_EQ(ranges(0, u), (Ranges{{0, 2}}));
  EXPECT_EQ(ranges(1, u), (Ranges{{2, 5}}));
  EXPECT_EQ(ranges(2, u), (Ranges{{5, 8}}));
  EXPECT_EQ(ranges(3, u), (Ranges{{8, 12}}));
  // Only the last set: 13 layers, pp 3, last 5 -> 4 | 4 | 5.
  const PipelineLayout l = layout(13, 3, 0, -1, 5);
  EXPECT_EQ(ranges(0, l), (Ranges{{0, 4}}));
  EXPECT_EQ(ranges(2, l), (Ranges{{8, 13}}));
  // Both set with pp 2: no middle rank.
  EXPECT_EQ(ranges(1, layout(10, 2, 0, 3, 7)), (Ranges{{3, 10}}));
}

TEST(LayerSplit, UnevenWithInterleaving) {
  // 10 layers, pp 3, vpp 2, first 2, last 2: chunks hold 1 | 3 | 1 layers.
  const PipelineLayout p = layout(10, 3, 2, 2, 2);
  EXPECT_EQ(ranges(0, p), (Ranges{{0, 1}, {5, 6}}));
  EXPECT_EQ(ranges(1, p), (Ranges{{1, 4}, {6, 9}}));
  EXPECT_EQ(ranges(2, p), (Ranges{{4, 5}, {9, 10}}));
  // pp 2 with both set and vpp 2 (Megatron's offset divides by the zero middle ranks here; we
  // give the obvious split): 4 | 8 layers -> chunks 2 | 4.
  const PipelineLayout q = layout(12, 2, 2, 4, 8);
  EXPECT_EQ(ranges(0, q), (Ranges{{0, 2}, {6, 8}}));
  EXPECT_EQ(ranges(1, q), (Ranges{{2, 6}, {8, 12}}));
}

TEST(LayerSplit, AccountForEmbeddingAndLoss) {
  // 14 layers + embedding + loss = 16 slots over pp 4: 3 | 4 | 4 | 3.
  const PipelineLayout p = layout(14, 4, 0, -1, -1, true, true);
  EXPECT_EQ(ranges(0, p), (Ranges{{0, 3}}));
  EXPECT_EQ(ranges(1, p), (Ranges{{3, 7}}));
  EXPECT_EQ(ranges(3, p), (Ranges{{11, 14}}));
  // Interleaved: 14 + 2 = 16 slots, pp 2, vpp 2: stages 3 | 4 | 4 | 3.
  const PipelineLayout q = layout(14, 2, 2, -1, -1, true, true);
  EXPECT_EQ(ranges(0, q), (Ranges{{0, 3}, {7, 11}}));
  EXPECT_EQ(ranges(1, q), (Ranges{{3, 7}, {11, 14}}));
  // A stage may end up with zero layers: 2 layers + 2 slots over pp 4: 0 | 1 | 1 | 0.
  const PipelineLayout z = layout(2, 4, 0, -1, -1, true, true);
  EXPECT_EQ(ranges(0, z), (Ranges{{0, 0}}));
  EXPECT_EQ(ranges(3, z), (Ranges{{2, 2}}));
}

// Independent port of Megatron's formulas (transformer_block.py / transformer_layer.py).
int64_t mg_build(const PipelineLayout& p, int r, int v) {
  const bool uneven = p.first_stage_layers >= 0 || p.last_stage_layers >= 0;
  const int V = p.vpp > 1 ? p.vpp : 1;
  int64_t per = 0;
  if (uneven) {
    int64_t distribute = p.num_layers;
    int left = p.pp;
    if (p.first_stage_layers >= 0) distribute -= p.first_stage_layers, --left;
    if (p.last_stage_layers >= 0) distribute -= p.last_stage_layers, --left;
    per = left > 0 ? distribute / left : 0;
    if (r == 0 && p.first_stage_layers >= 0) per = p.first_stage_layers;
    if (r == p.pp - 1 && p.last_stage_layers >= 0) per = p.last_stage_layers;
  } else {
    per = (p.num_layers + p.account_for_embedding + p.account_for_loss) / p.pp;
  }
  int64_t n = (V > 1 && p.pp > 1) ? per / V : per;
  if (p.account_for_embedding && v == 0 && r == 0) --n;
  if (p.account_for_loss && v == V - 1 && r == p.pp - 1) --n;
  return n;
}

int64_t mg_offset(const PipelineLayout& p, int r, int v) {
  if (p.pp <= 1) return 0;
  const int V = p.vpp > 1 ? p.vpp : 1;
  const bool uneven = p.first_stage_layers >= 0 || p.last_stage_layers >= 0;
  if (uneven) {
    const int middle_stages = p.pp - (p.first_stage_layers >= 0) - (p.last_stage_layers >= 0);
    const int64_t f = std::max<int64_t>(p.first_stage_layers, 0), la = std::max<int64_t>(p.last_stage_layers, 0);
    const int64_t middle = p.num_layers - f - la;
    const int middle_rank = p.first_stage_layers < 0 ? r : r - 1;
    if (V > 1) {
      const int64_t fc = f / V, lc = la / V, mc = middle / V, total = fc + mc + lc;
      if (r == 0) return v * total;
      return v * total + fc + middle_rank * (middle_stages > 0 ? mc / middle_stages : 0);
    }
    const int64_t per = middle_stages > 0 ? middle / middle_stages : 0;
    return r == 0 ? 0 : middle_rank * per + f;
  }
  const int64_t n = p.num_layers + p.account_for_embedding + p.account_for_loss;
  const int64_t per = n / p.pp;
  int64_t off;
  if (V > 1) {
    off = v * (n / V) + r * (per / V);
  } else {
    off = r * per;
  }
  if (p.account_for_embedding && !(v == 0 && r == 0)) off -= 1;
  return off;
}

TEST(LayerSplit, MatchesMegatronFormulasAndTiles) {
  int valid = 0;
  for (int64_t L = 1; L <= 26; ++L)
    for (int pp : {1, 2, 3, 4})
      for (int vpp : {0, 2, 3})
        for (int64_t first : {-1, 1, 2, 3, 4, 6})
          for (int64_t last : {-1, 1, 2, 4, 6})
            for (int acc = 0; acc < 4; ++acc) {
              const PipelineLayout p = layout(L, pp, vpp, first, last, acc & 1, acc & 2);
              try {
                validate_pipeline_layout(p);
              } catch (const Error&) {
                continue;
              }
              ++valid;
              // Megatron's formulas, and a contiguous tiling of [0, L) in stage order.
              std::vector<LayerRange> by_stage(p.num_stages());
              for (int r = 0; r < pp; ++r)
                for (const LayerRange& lr : layers_of(r, p)) {
                  ASSERT_EQ(lr.size(), mg_build(p, r, lr.chunk)) << "L" << L << " pp" << pp << " vpp" << vpp << " f"
                                                                 << first << " l" << last << " acc" << acc;
                  ASSERT_EQ(lr.begin, mg_offset(p, r, lr.chunk)) << "L" << L << " pp" << pp << " vpp" << vpp
                                                                 << " f" << first << " l" << last << " acc" << acc;
                  ASSERT_EQ(lr.size(), num_layers_to_build(p, r, lr.chunk));
                  ASSERT_EQ(lr.begin, layer_offset(p, r, lr.chunk));
                  ASSERT_EQ(lr.stage, lr.chunk * pp + r);
                  ASSERT_GE(lr.size(), 0);
                  by_stage[lr.stage] = lr;
                }
              int64_t next = 0;
              for (int s = 0; s < p.num_stages(); ++s) {
                ASSERT_EQ(by_stage[s].begin, next);
                next = by_stage[s].end;
                ASSERT_EQ(by_stage[s].has_embedding, s == 0);
                ASSERT_EQ(by_stage[s].has_loss, s == p.num_stages() - 1);
              }
              ASSERT_EQ(next, L);
            }
  std::printf("checked %d layouts\n", valid);
  EXPECT_GT(valid, 300);
}

TEST(LayerSplit, VirtualPipelineFlagConversion) {
  const PipelineLayout p = layout(32, 4);
  EXPECT_EQ(resolve_virtual_pipeline_size(p, 4, 0), 2);  // 8 layers per rank / 4
  EXPECT_EQ(resolve_virtual_pipeline_size(p, 2, 0), 4);
  EXPECT_EQ(resolve_virtual_pipeline_size(p, 8, 0), 0);  // 1 chunk = no interleaving
  EXPECT_EQ(resolve_virtual_pipeline_size(p, 0, 3), 3);
  EXPECT_EQ(resolve_virtual_pipeline_size(p, 0, 1), 0);
  EXPECT_EQ(resolve_virtual_pipeline_size(p, 0, 0), 0);
  EXPECT_EQ(resolve_virtual_pipeline_size(layout(30, 4, 0, -1, -1, true, true), 2, 0), 4);  // (30+2)/4/2
  EXPECT_EQ(layers_per_virtual_stage(layout(32, 4, 4)), 2);
  // Round trip: vpp -> layers per virtual stage -> vpp.
  for (int vpp : {2, 4, 8}) {
    const PipelineLayout q = layout(64, 4, vpp);
    EXPECT_EQ(resolve_virtual_pipeline_size(layout(64, 4), layers_per_virtual_stage(q), 0), vpp);
  }
  expect_error([&] { resolve_virtual_pipeline_size(p, 2, 2); },
               "set only one of --num-layers-per-virtual-pipeline-stage (2) and --num-virtual-stages-per-pipeline-rank (2)");
  expect_error([&] { resolve_virtual_pipeline_size(p, 3, 0); },
               "8 layers per pipeline rank (num_layers 32, pp 4) are not divisible by "
               "--num-layers-per-virtual-pipeline-stage (3)");
  expect_error([&] { resolve_virtual_pipeline_size(layout(30, 4), 2, 0); }, "num_layers (30) is not divisible by pp (4)");
  expect_error([&] { resolve_virtual_pipeline_size(layout(32, 4, 0, 4, -1), 2, 0); },
               "cannot be used with uneven first/last stages");
  expect_error([&] { resolve_virtual_pipeline_size(layout(32, 1), 4, 0); }, "needs pp > 1, got pp = 1");
  expect_error([&] { layers_per_virtual_stage(layout(32, 4, 0, 4, -1)); }, "even split only");
}

TEST(LayerSplit, Errors) {
  expect_error([] { validate_pipeline_layout(layout(0, 1)); }, "num_layers must be positive, got 0");
  expect_error([] { validate_pipeline_layout(layout(8, 0)); }, "pp must be >= 1, got 0");
  expect_error([] { validate_pipeline_layout(layout(8, 1, -1)); }, "vpp must be >= 0, got -1");
  expect_error([] { validate_pipeline_layout(layout(8, 1, 2)); }, "interleaving (vpp = 2) needs pp > 1");
  expect_error([] { validate_pipeline_layout(layout(30, 4)); }, "num_layers (30) = 30 is not divisible by pp (4)");
  expect_error([] { validate_pipeline_layout(layout(29, 4, 0, -1, -1, true, true)); },
               "num_layers (29 + 1 embedding + 1 loss) = 31 is not divisible by pp (4)");
  expect_error([] { validate_pipeline_layout(layout(24, 4, 4)); },
               "6 layers per pipeline rank (num_layers 24, pp 4) are not divisible by the virtual stages per rank (4)");
  expect_error([] { validate_pipeline_layout(layout(12, 1, 0, 4)); }, "need pipeline parallelism, but pp = 1");
  expect_error([] { validate_pipeline_layout(layout(12, 4, 0, 2, -1, true)); }, "cannot be combined");
  expect_error([] { validate_pipeline_layout(layout(12, 4, 0, 0)); },
               "--decoder-first-pipeline-num-layers (0) must be in [1, num_layers (12)]");
  expect_error([] { validate_pipeline_layout(layout(12, 4, 0, -1, 13)); },
               "--decoder-last-pipeline-num-layers (13) must be in [1, num_layers (12)]");
  expect_error([] { validate_pipeline_layout(layout(12, 4, 2, 3)); },
               "--decoder-first-pipeline-num-layers (3) is not divisible by the virtual stages per rank (2)");
  expect_error([] { validate_pipeline_layout(layout(12, 4, 2, -1, 3)); },
               "--decoder-last-pipeline-num-layers (3) is not divisible by the virtual stages per rank (2)");
  expect_error([] { validate_pipeline_layout(layout(12, 4, 0, 8, 8)); }, "exceed num_layers (12)");
  expect_error([] { validate_pipeline_layout(layout(12, 4, 0, 3, 2)); },
               "the 7 remaining layers (num_layers 12 - first 3 - last 2) are not divisible by the 2 remaining ranks");
  expect_error([] { validate_pipeline_layout(layout(12, 3, 0, 6, 6)); }, "0 layers remain for 1 middle ranks");
  expect_error([] { validate_pipeline_layout(layout(12, 2, 0, 6, 5)); }, "1 layers remain for 0 middle ranks");
  validate_pipeline_layout(layout(14, 3, 2, 2, 2));  // 1 | 5 | 1 layers per chunk: fine
}

TEST(LayerSplit, MoreErrors) {
  expect_error([] { validate_pipeline_layout(layout(13, 3, 2, 2, 2)); },
               "9 layers per middle rank are not divisible by the virtual stages per rank (2)");
  expect_error([] { validate_pipeline_layout(layout(1, 2, 0, -1, -1, true, true)); },
               "num_layers (1 + 1 embedding + 1 loss) = 3 is not divisible by pp (2)");
  expect_error([] { layers_of(4, layout(8, 4)); }, "pp_rank 4 outside [0, pp = 4)");
  expect_error([] { num_layers_to_build(layout(8, 4, 2), 0, 2); }, "vp_stage 2 outside [0, 2)");
  expect_error([] { layer_offset(layout(8, 4), -1, 0); }, "pp_rank -1 outside");
}

}  // namespace
}  // namespace mt::pipeline
