#include "parallel/pipeline/layer_split.h"

#include <algorithm>

#include "core/check.h"

namespace mt::pipeline {
namespace {

// Transformer layers of every virtual stage (index s = chunk·pp + rank). Validates.
std::vector<int64_t> stage_layer_counts(const PipelineLayout& p) {
  MT_REQUIRE(p.num_layers >= 1, "num_layers must be positive, got {}", p.num_layers);
  MT_REQUIRE(p.pp >= 1, "pipeline parallel size pp must be >= 1, got {}", p.pp);
  MT_REQUIRE(p.vpp >= 0, "virtual pipeline stages per rank vpp must be >= 0, got {}", p.vpp);
  MT_REQUIRE(p.vpp <= 1 || p.pp > 1, "interleaving (vpp = {}) needs pp > 1, got pp = {}", p.vpp, p.pp);
  const int V = p.num_chunks();
  const int S = p.num_stages();
  const bool uneven = p.first_stage_layers >= 0 || p.last_stage_layers >= 0;
  // per_rank[r]: transformer layers of rank r summed over its chunks (before the account
  // adjustments, which remove one layer slot from the first / last stage).
  std::vector<int64_t> per_rank(p.pp);
  if (uneven) {
    MT_REQUIRE(p.pp > 1,
               "--decoder-first/last-pipeline-num-layers ({} / {}) need pipeline parallelism, but pp = {}",
               p.first_stage_layers, p.last_stage_layers, p.pp);
    MT_REQUIRE(!p.account_for_embedding && !p.account_for_loss,
               "--decoder-first/last-pipeline-num-layers ({} / {}) cannot be combined with "
               "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split",
               p.first_stage_layers, p.last_stage_layers);
    int64_t middle_layers = p.num_layers;
    int middle_ranks = p.pp;
    if (p.first_stage_layers >= 0) {
      MT_REQUIRE(p.first_stage_layers >= 1 && p.first_stage_layers <= p.num_layers,
                 "--decoder-first-pipeline-num-layers ({}) must be in [1, num_layers ({})]", p.first_stage_layers,
                 p.num_layers);
      MT_REQUIRE(p.first_stage_layers % V == 0,
                 "--decoder-first-pipeline-num-layers ({}) is not divisible by the virtual stages per rank ({})",
                 p.first_stage_layers, V);
      middle_layers -= p.first_stage_layers;
      --middle_ranks;
    }
    if (p.last_stage_layers >= 0) {
      MT_REQUIRE(p.last_stage_layers >= 1 && p.last_stage_layers <= p.num_layers,
                 "--decoder-last-pipeline-num-layers ({}) must be in [1, num_layers ({})]", p.last_stage_layers,
                 p.num_layers);
      MT_REQUIRE(p.last_stage_layers % V == 0,
                 "--decoder-last-pipeline-num-layers ({}) is not divisible by the virtual stages per rank ({})",
                 p.last_stage_layers, V);
      middle_layers -= p.last_stage_layers;
      --middle_ranks;
    }
    MT_REQUIRE(middle_layers >= 0,
               "--decoder-first-pipeline-num-layers ({}) + --decoder-last-pipeline-num-layers ({}) exceed "
               "num_layers ({})",
               p.first_stage_layers, p.last_stage_layers, p.num_layers);
    MT_REQUIRE((middle_layers > 0) == (middle_ranks > 0),
               "uneven pipeline split: {} layers remain for {} middle ranks (num_layers {}, first {}, last {}, pp {})",
               middle_layers, middle_ranks, p.num_layers, p.first_stage_layers, p.last_stage_layers, p.pp);
    int64_t per_middle = 0;
    if (middle_ranks > 0) {
      MT_REQUIRE(middle_layers % middle_ranks == 0,
                 "uneven pipeline split: the {} remaining layers (num_layers {} - first {} - last {}) are not "
                 "divisible by the {} remaining ranks",
                 middle_layers, p.num_layers, std::max<int64_t>(p.first_stage_layers, 0),
                 std::max<int64_t>(p.last_stage_layers, 0), middle_ranks);
      per_middle = middle_layers / middle_ranks;
      MT_REQUIRE(per_middle % V == 0,
                 "uneven pipeline split: {} layers per middle rank are not divisible by the virtual stages per "
                 "rank ({})",
                 per_middle, V);
    }
    for (int r = 0; r < p.pp; ++r) per_rank[r] = per_middle;
    if (p.first_stage_layers >= 0) per_rank[0] = p.first_stage_layers;
    if (p.last_stage_layers >= 0) per_rank[p.pp - 1] = p.last_stage_layers;
  } else {
    const int64_t slots = p.num_layers + (p.account_for_embedding ? 1 : 0) + (p.account_for_loss ? 1 : 0);
    MT_REQUIRE(slots % p.pp == 0, "num_layers ({}{}{}) = {} is not divisible by pp ({})", p.num_layers,
               p.account_for_embedding ? " + 1 embedding" : "", p.account_for_loss ? " + 1 loss" : "", slots, p.pp);
    const int64_t per = slots / p.pp;
    MT_REQUIRE(per % V == 0, "{} layers per pipeline rank (num_layers {}, pp {}) are not divisible by the virtual "
               "stages per rank ({})",
               per, p.num_layers, p.pp, V);
    for (int r = 0; r < p.pp; ++r) per_rank[r] = per;
  }
  std::vector<int64_t> counts(S);
  for (int s = 0; s < S; ++s) counts[s] = per_rank[s % p.pp] / V;
  if (!uneven) {
    if (p.account_for_embedding) --counts[0];
    if (p.account_for_loss) --counts[S - 1];
    // Every stage has >= 1 slot (slots divisible by pp·V), so this cannot fail; kept as an invariant.
    MT_CHECK(counts[0] >= 0 && counts[S - 1] >= 0,
             "negative layer count: first {} last {} (num_layers {}, pp {}, vpp {})", counts[0], counts[S - 1],
             p.num_layers, p.pp, p.vpp);
  }
  return counts;
}

void check_position(const PipelineLayout& p, int pp_rank, int vp_stage) {
  MT_REQUIRE(pp_rank >= 0 && pp_rank < p.pp, "pp_rank {} outside [0, pp = {})", pp_rank, p.pp);
  MT_REQUIRE(vp_stage >= 0 && vp_stage < p.num_chunks(), "vp_stage {} outside [0, {})", vp_stage, p.num_chunks());
}

}  // namespace

void validate_pipeline_layout(const PipelineLayout& layout) { (void)stage_layer_counts(layout); }

int64_t num_layers_to_build(const PipelineLayout& p, int pp_rank, int vp_stage) {
  const auto counts = stage_layer_counts(p);
  check_position(p, pp_rank, vp_stage);
  return counts[vp_stage * p.pp + pp_rank];
}

int64_t layer_offset(const PipelineLayout& p, int pp_rank, int vp_stage) {
  const auto counts = stage_layer_counts(p);
  check_position(p, pp_rank, vp_stage);
  int64_t offset = 0;
  for (int s = 0; s < vp_stage * p.pp + pp_rank; ++s) offset += counts[s];
  return offset;
}

std::vector<LayerRange> layers_of(int pp_rank, const PipelineLayout& p) {
  const auto counts = stage_layer_counts(p);
  check_position(p, pp_rank, 0);
  std::vector<int64_t> prefix(counts.size() + 1, 0);
  for (size_t s = 0; s < counts.size(); ++s) prefix[s + 1] = prefix[s] + counts[s];
  std::vector<LayerRange> out;
  for (int c = 0; c < p.num_chunks(); ++c) {
    LayerRange r;
    r.chunk = c;
    r.stage = c * p.pp + pp_rank;
    r.begin = prefix[r.stage];
    r.end = prefix[r.stage + 1];
    r.has_embedding = r.stage == 0;
    r.has_loss = r.stage == p.num_stages() - 1;
    out.push_back(r);
  }
  return out;
}

int resolve_virtual_pipeline_size(const PipelineLayout& p, int64_t layers_per_vstage, int vstages_per_rank) {
  const bool by_layers = layers_per_vstage > 0, by_stages = vstages_per_rank > 0;
  MT_REQUIRE(!(by_layers && by_stages),
             "set only one of --num-layers-per-virtual-pipeline-stage ({}) and "
             "--num-virtual-stages-per-pipeline-rank ({})",
             layers_per_vstage, vstages_per_rank);
  int vpp = 0;
  if (by_layers) {
    MT_REQUIRE(p.first_stage_layers < 0 && p.last_stage_layers < 0,
               "--num-layers-per-virtual-pipeline-stage ({}) cannot be used with uneven first/last stages ({} / {}); "
               "use --num-virtual-stages-per-pipeline-rank",
               layers_per_vstage, p.first_stage_layers, p.last_stage_layers);
    MT_REQUIRE(p.pp >= 1, "pipeline parallel size pp must be >= 1, got {}", p.pp);
    const int64_t slots = p.num_layers + (p.account_for_embedding ? 1 : 0) + (p.account_for_loss ? 1 : 0);
    MT_REQUIRE(slots % p.pp == 0, "num_layers ({}) is not divisible by pp ({})", slots, p.pp);
    const int64_t per_rank = slots / p.pp;
    MT_REQUIRE(per_rank % layers_per_vstage == 0,
               "{} layers per pipeline rank (num_layers {}, pp {}) are not divisible by "
               "--num-layers-per-virtual-pipeline-stage ({})",
               per_rank, slots, p.pp, layers_per_vstage);
    vpp = static_cast<int>(per_rank / layers_per_vstage);
  } else if (by_stages) {
    vpp = vstages_per_rank;
  }
  if (vpp == 1) vpp = 0;
  MT_REQUIRE(vpp == 0 || p.pp > 1, "interleaving ({} virtual stages per rank) needs pp > 1, got pp = {}", vpp, p.pp);
  return vpp;
}

int64_t layers_per_virtual_stage(const PipelineLayout& p) {
  MT_REQUIRE(p.first_stage_layers < 0 && p.last_stage_layers < 0 && !p.account_for_embedding &&
                 !p.account_for_loss,
             "layers per virtual stage is defined for an even split only (first {}, last {}, account flags {} / {})",
             p.first_stage_layers, p.last_stage_layers, p.account_for_embedding, p.account_for_loss);
  validate_pipeline_layout(p);
  return p.num_layers / p.num_stages();
}

}  // namespace mt::pipeline
