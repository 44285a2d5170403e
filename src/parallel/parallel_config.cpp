#include "parallel/parallel_config.h"

#include <fmt/format.h>

#include "core/check.h"
#include "parallel/pipeline/layer_split.h"
#include "parallel/rank_generator.h"

namespace mt {

std::string ParallelConfig::to_string() const {
  return fmt::format("tp={} cp={} pp={} dp={} ep={} etp={} edp={} vpp={} order={} world={}", tp, cp, pp, dp, ep, etp,
                     edp, vpp, order, world);
}

void validate_and_derive(ParallelConfig& c, int world_size) {
  MT_REQUIRE(world_size >= 1, "world size must be positive, got {}", world_size);
  MT_REQUIRE(c.tp >= 1, "tensor parallel size (tp) must be >= 1, got {}", c.tp);
  MT_REQUIRE(c.cp >= 1, "context parallel size (cp) must be >= 1, got {}", c.cp);
  MT_REQUIRE(c.pp >= 1, "pipeline parallel size (pp) must be >= 1, got {}", c.pp);
  MT_REQUIRE(c.ep >= 1, "expert parallel size (ep) must be >= 1, got {}", c.ep);
  MT_REQUIRE(c.etp >= 0, "expert tensor parallel size (etp) must be >= 1 (or 0 = tp), got {}", c.etp);
  MT_REQUIRE(c.vpp >= 0, "virtual pipeline stages per rank (vpp) must be >= 0 (0 = none), got {}", c.vpp);
  MT_REQUIRE(c.dp >= 0, "data parallel size (dp) must be >= 0 (0 = derived), got {}", c.dp);
  MT_REQUIRE(c.edp >= 0, "expert data parallel size (edp) must be >= 0 (0 = derived), got {}", c.edp);

  const int64_t dense = int64_t{c.tp} * c.cp * c.pp;
  MT_REQUIRE(world_size % dense == 0, "world size {} is not divisible by tp ({}) x cp ({}) x pp ({}) = {}",
             world_size, c.tp, c.cp, c.pp, dense);
  const int dp = static_cast<int>(world_size / dense);
  MT_REQUIRE(c.dp == 0 || c.dp == dp,
             "data parallel size dp ({}) disagrees with world size {} / (tp ({}) x cp ({}) x pp ({})) = {}", c.dp,
             world_size, c.tp, c.cp, c.pp, dp);

  const int etp = c.etp == 0 ? c.tp : c.etp;
  const int64_t expert = int64_t{etp} * c.ep * c.pp;
  MT_REQUIRE(world_size % expert == 0, "world size {} is not divisible by etp ({}) x ep ({}) x pp ({}) = {}",
             world_size, etp, c.ep, c.pp, expert);
  const int edp = static_cast<int>(world_size / expert);
  MT_REQUIRE(c.edp == 0 || c.edp == edp,
             "expert data parallel size edp ({}) disagrees with world size {} / (etp ({}) x ep ({}) x pp ({})) = {}",
             c.edp, world_size, etp, c.ep, c.pp, edp);

  MT_REQUIRE(c.vpp <= 1 || c.pp > 1,
             "virtual pipeline stages per rank vpp ({}) need pipeline parallelism, but pp = {} (interleaving needs "
             "pp > 1)",
             c.vpp, c.pp);

  // Order: both generators parse it (unknown / repeated / missing size>1 names throw there).
  const RankGenerator dense_gen(c.tp, 1, dp, c.pp, c.cp, c.order);
  const RankGenerator expert_gen(etp, c.ep, edp, c.pp, 1, c.order);
  const std::string& norm = dense_gen.order();
  const bool pp_last = norm.size() >= 2 && norm.compare(norm.size() - 2, 2, "pp") == 0;
  MT_REQUIRE(pp_last || c.pp == 1 || dp == edp,
             "order '{}' does not end with pp, so dp ({}) must equal edp ({}) when pp ({}) > 1 (Megatron: the dense "
             "and expert pipeline groups must coincide)",
             c.order, dp, edp, c.pp);
  MT_REQUIRE(dense_gen.get_ranks("pp") == expert_gen.get_ranks("pp"),
             "order '{}': pipeline groups of the dense grid (tp={} cp={} dp={} pp={}) and the expert grid (etp={} "
             "ep={} edp={} pp={}) differ; put pp last",
             c.order, c.tp, c.cp, dp, c.pp, etp, c.ep, edp, c.pp);

  c.dp = dp;
  c.etp = etp;
  c.edp = edp;
  if (c.vpp == 1) c.vpp = 0;
  c.world = world_size;
}

void validate_model_parallel(const ParallelConfig& c, int64_t num_layers, int64_t heads, int64_t ffn,
                             int64_t padded_vocab, const ModelParallelOptions& o) {
  MT_REQUIRE(c.world >= 1 && c.dp >= 1 && c.etp >= 1 && c.edp >= 1,
             "validate_model_parallel needs a ParallelConfig that passed validate_and_derive; got {}", c.to_string());
  MT_REQUIRE(heads >= 1, "num_attention_heads must be positive, got {}", heads);
  MT_REQUIRE(heads % c.tp == 0, "num_attention_heads ({}) is not divisible by tp ({})", heads, c.tp);
  if (o.num_query_groups > 0) {
    MT_REQUIRE(heads % o.num_query_groups == 0, "num_attention_heads ({}) is not divisible by num_query_groups ({})",
               heads, o.num_query_groups);
    MT_REQUIRE(o.num_query_groups % c.tp == 0, "num_query_groups ({}) is not divisible by tp ({})",
               o.num_query_groups, c.tp);
  }
  MT_REQUIRE(ffn >= 1 && ffn % c.tp == 0, "ffn_hidden_size ({}) is not divisible by tp ({})", ffn, c.tp);
  MT_REQUIRE(padded_vocab >= 1 && padded_vocab % c.tp == 0,
             "padded vocabulary size ({}) is not divisible by tp ({}) (pad to a multiple of "
             "make_vocab_size_divisible_by x tp)",
             padded_vocab, c.tp);
  if (o.seq_length > 0) {
    if (c.cp > 1)
      MT_REQUIRE(o.seq_length % (2 * c.cp) == 0, "seq_length ({}) is not divisible by 2 x cp ({}) = {}",
                 o.seq_length, c.cp, 2 * c.cp);
    if (o.sequence_parallel && c.tp > 1)
      MT_REQUIRE((o.seq_length / c.cp) % c.tp == 0,
                 "sequence parallel: seq_length ({}) / cp ({}) = {} is not divisible by tp ({})", o.seq_length, c.cp,
                 o.seq_length / c.cp, c.tp);
  }
  if (o.num_experts > 0) {
    MT_REQUIRE(o.num_experts % c.ep == 0, "num_experts ({}) is not divisible by ep ({})", o.num_experts, c.ep);
    if (o.moe_ffn_hidden_size > 0)
      MT_REQUIRE(o.moe_ffn_hidden_size % c.etp == 0, "moe_ffn_hidden_size ({}) is not divisible by etp ({})",
                 o.moe_ffn_hidden_size, c.etp);
  } else {
    MT_REQUIRE(c.ep == 1, "ep ({}) > 1 needs a mixture-of-experts model (num_experts = 0)", c.ep);
  }
  pipeline::PipelineLayout layout;
  layout.num_layers = num_layers;
  layout.pp = c.pp;
  layout.vpp = c.vpp;
  layout.first_stage_layers = o.decoder_first_pipeline_num_layers;
  layout.last_stage_layers = o.decoder_last_pipeline_num_layers;
  layout.account_for_embedding = o.account_for_embedding_in_pipeline_split;
  layout.account_for_loss = o.account_for_loss_in_pipeline_split;
  pipeline::validate_pipeline_layout(layout);
}

}  // namespace mt
