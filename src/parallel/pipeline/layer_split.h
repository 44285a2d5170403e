// Which transformer layers each pipeline rank builds (Megatron-Core
// megatron/core/transformer/transformer_block.py:get_num_layers_to_build and
// transformer_layer.py:get_transformer_layer_offset; flag conversion from
// megatron/training/arguments.py). Pure functions. See docs/parallelism.md.
//
// Stages: with pp ranks and V model chunks per rank (V = max(vpp, 1)) there are pp·V virtual
// stages; virtual stage s = c·pp + r is chunk c of pipeline rank r, and stages hold consecutive
// layers in stage order. Example: 32 layers, pp 4, V 2 -> 4 layers per stage; rank 0 holds
// layers 0-3 (chunk 0, stage 0) and 16-19 (chunk 1, stage 4).
// The embedding lives in stage 0 (chunk 0 of rank 0), the final norm / LM head / loss in stage
// pp·V − 1 (the last chunk of the last rank).
#pragma once
#include <cstdint>
#include <vector>

namespace mt::pipeline {

struct PipelineLayout {
  int64_t num_layers = 0;           ///< --num-layers
  int pp = 1;                       ///< --pipeline-model-parallel-size
  int vpp = 0;                      ///< model chunks per rank; 0 or 1 = no interleaving
  int64_t first_stage_layers = -1;  ///< --decoder-first-pipeline-num-layers; -1 = unset
  int64_t last_stage_layers = -1;   ///< --decoder-last-pipeline-num-layers; -1 = unset
  bool account_for_embedding = false;  ///< --account-for-embedding-in-pipeline-split
  bool account_for_loss = false;       ///< --account-for-loss-in-pipeline-split

  int num_chunks() const { return vpp > 1 ? vpp : 1; }
  int num_stages() const { return pp * num_chunks(); }
};

/// The layers of one model chunk: [begin, end) in global layer numbering (0-based).
struct LayerRange {
  int64_t begin = 0;
  int64_t end = 0;
  int chunk = 0;               ///< model chunk on this rank (vp_stage), 0-based
  int stage = 0;               ///< virtual stage = chunk·pp + pp_rank
  bool has_embedding = false;  ///< stage 0: word (+ position) embedding (Megatron pre_process)
  bool has_loss = false;       ///< last stage: final norm, LM head, loss (Megatron post_process)
  int64_t size() const { return end - begin; }
  bool operator==(const LayerRange&) const = default;
};

/// Throws mt::Error (naming the values) unless the layout is one Megatron accepts:
///  - num_layers >= 1, pp >= 1, vpp >= 0; vpp > 1 needs pp > 1;
///  - even split: num_layers (+1 with account_for_embedding, +1 with account_for_loss)
///    divisible by pp, and the per-rank count divisible by V;
///  - uneven split (first and/or last set): pp > 1; each set value in [1, num_layers] and
///    divisible by V; the remaining layers divisible by the remaining (middle) ranks, with the
///    per-middle-rank count divisible by V; layers remaining only with middle ranks left and
///    vice versa; not combined with account_for_embedding / account_for_loss;
///  - no chunk ends up with a negative number of layers.
void validate_pipeline_layout(const PipelineLayout& layout);

/// Megatron's get_num_layers_to_build for (pp_rank, vp_stage). Validates the layout.
int64_t num_layers_to_build(const PipelineLayout& layout, int pp_rank, int vp_stage = 0);
/// Megatron's get_transformer_layer_offset: global index of the chunk's first layer.
int64_t layer_offset(const PipelineLayout& layout, int pp_rank, int vp_stage = 0);
/// One LayerRange per model chunk of `pp_rank` (chunk order). Validates the layout; throws for a
/// pp_rank outside [0, pp).
std::vector<LayerRange> layers_of(int pp_rank, const PipelineLayout& layout);

/// Megatron's resolution of the two virtual-pipeline flags into chunks per rank
/// (arguments.py): at most one may be set (> 0);
///  - --num-layers-per-virtual-pipeline-stage n: not with uneven first/last stages; layers
///    (+1/+1 with account flags) divisible by pp and the per-rank count divisible by n;
///    vpp = per-rank count / n;
///  - --num-virtual-stages-per-pipeline-rank v: vpp = v.
/// Returns 0 when neither is set or the result is 1 (no interleaving). Throws mt::Error naming
/// the values. Arguments <= 0 mean unset.
int resolve_virtual_pipeline_size(const PipelineLayout& layout, int64_t num_layers_per_virtual_pipeline_stage,
                                  int num_virtual_stages_per_pipeline_rank);
/// The inverse for an even split without account flags: layers per virtual stage =
/// num_layers / (pp·V). Throws when it does not divide.
int64_t layers_per_virtual_stage(const PipelineLayout& layout);

}  // namespace mt::pipeline
