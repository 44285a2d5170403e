// Parallel layout: the sizes of every parallel dimension, validated once, in one place, with
// messages that print every value (torchtitan's ParallelDims style; Megatron-LM's checks in
// megatron/training/arguments.py and megatron/core/parallel_state.py:initialize_model_parallel).
//
// Two grids share the world (Megatron-Core "MoE parallel folding", arXiv:2504.14960):
//   dense  (attention, dense MLP, embeddings):  world = tp · cp · dp · pp
//   expert (MoE expert MLPs):                   world = etp · ep · edp · pp
// Both use the same order string and the same pp; rank_generator.h turns them into groups.
#pragma once
#include <cstdint>
#include <string>

namespace mt {

struct ParallelConfig {
  int tp = 1;    ///< --tensor-model-parallel-size
  int cp = 1;    ///< --context-parallel-size
  int pp = 1;    ///< --pipeline-model-parallel-size
  int dp = 0;    ///< data-parallel size; derived = world / (tp·cp·pp) (a nonzero value must agree)
  int ep = 1;    ///< --expert-model-parallel-size
  int etp = 0;   ///< --expert-tensor-parallel-size; 0 = tp (derived)
  int edp = 0;   ///< expert data-parallel size; derived = world / (etp·ep·pp) (nonzero must agree)
  int vpp = 0;   ///< model chunks (virtual stages) per pipeline rank; 0 = no interleaving.
                 ///< 1 is normalised to 0, as Megatron sets virtual_pipeline_model_parallel_size
                 ///< = None when it is 1.
  std::string order = "tp-cp-ep-dp-pp";  ///< rank order, leftmost varies fastest; Megatron's
                                         ///< --use-tp-pp-dp-mapping = "tp-cp-ep-pp-dp"
  int world = 1;  ///< set by validate_and_derive

  /// Model chunks per rank: max(vpp, 1).
  int num_chunks() const { return vpp > 0 ? vpp : 1; }
  /// Model-parallel size tp·cp·pp (ranks holding one replica of the dense model).
  int model_parallel_size() const { return tp * cp * pp; }
  /// "tp=2 cp=1 pp=4 dp=2 ep=1 etp=2 edp=2 vpp=0 order=tp-cp-ep-dp-pp world=16".
  std::string to_string() const;
};

/// Validates `cfg` against `world_size` and fills the derived fields (dp, etp when 0, edp, world;
/// vpp 1 -> 0). Throws mt::Error naming every value when:
///  - world_size < 1, or tp, cp, pp, ep < 1, or etp, vpp, dp, edp < 0;
///  - world_size is not divisible by tp·cp·pp (dense grid) or by etp·ep·pp (expert grid);
///  - a nonzero dp / edp disagrees with the derived value;
///  - vpp > 1 with pp == 1 (Megatron: "pipeline-model-parallel size should be greater than 1
///    with interleaved schedule");
///  - the order string is not a permutation of some of {tp, cp, ep, dp, pp} or omits a
///    dimension of size > 1 (missing size-1 dimensions are appended, as RankGenerator does);
///  - the order does not end with pp while pp > 1 and dp != edp (Megatron's assertion in
///    initialize_model_parallel: the pp groups of the two grids must coincide).
void validate_and_derive(ParallelConfig& cfg, int world_size);

/// Model-dependent options of validate_model_parallel (defaults = not used / not checked).
struct ModelParallelOptions {
  int64_t num_query_groups = 0;     ///< --num-query-groups (GQA); 0 = heads (MHA)
  int64_t seq_length = 0;           ///< --seq-length; 0 = unchecked
  bool sequence_parallel = false;   ///< --sequence-parallel
  int64_t num_experts = 0;          ///< --num-experts; 0 = dense model
  int64_t moe_ffn_hidden_size = 0;  ///< --moe-ffn-hidden-size; 0 = unchecked
  int64_t decoder_first_pipeline_num_layers = -1;  ///< --decoder-first-pipeline-num-layers; -1 unset
  int64_t decoder_last_pipeline_num_layers = -1;   ///< --decoder-last-pipeline-num-layers; -1 unset
  bool account_for_embedding_in_pipeline_split = false;
  bool account_for_loss_in_pipeline_split = false;
};

/// Model-dependent checks of a validated ParallelConfig; each error names the values:
///  - tp divides num_attention_heads, num_query_groups (when set), ffn_hidden_size and
///    padded_vocab_size (Megatron's TransformerConfig checks; the vocabulary is padded to a
///    multiple of make_vocab_size_divisible_by·tp, so a violation means it was padded for
///    another tp);
///  - cp > 1: seq_length divisible by 2·cp (arguments.py: load-balanced CP chunks);
///  - sequence parallel with tp > 1: seq_length / cp divisible by tp;
///  - num_experts divisible by ep; moe_ffn_hidden_size divisible by etp;
///  - the pipeline layer split (pipeline/layer_split.h: validate_pipeline_layout): num_layers
///    split over pp (and vpp chunks), or the uneven first/last-stage rules.
void validate_model_parallel(const ParallelConfig& cfg, int64_t num_layers, int64_t num_attention_heads,
                             int64_t ffn_hidden_size, int64_t padded_vocab_size,
                             const ModelParallelOptions& options = {});

}  // namespace mt
