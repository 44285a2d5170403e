// Layer specs (Megatron-Core's ModuleSpec / TransformerLayerSubmodules, resolved statically): which
// module fills each slot of a transformer layer. A layer is always
//   input_layernorm -> self_attention -> self_attn_bda (bias-dropout-add)
//   -> pre_mlp_layernorm -> mlp -> mlp_bda,
// with the norms of TransformerConfig::normalization. The spec chooses the submodules that vary:
// the core attention implementation, whether queries and keys are normalised, and what fills the
// MLP slot. get_gpt_layer_local_spec mirrors Megatron's function of the same name
// (megatron/core/models/gpt/gpt_layer_specs.py) for the modules megatron.cpp implements.
#pragma once
#include <vector>

#include "model/transformer_config.h"

namespace mt {

class ContextParallelRegion;

/// What fills the MLP slot.
enum class MlpKind : uint8_t {
  kDense,  ///< MLP: linear_fc1 -> GELU or SwiGLU -> linear_fc2
  kMoE,    ///< MoELayer (model/moe/moe_layer.h): router, token dispatcher, experts, shared experts
};

struct LayerSpec {
  /// The core attention (Megatron's core_attention submodule): --attention-backend resolved
  /// (resolve_attention_backend, never kAuto); its entry of model/variants.h builds it.
  AttentionBackend core_attention = AttentionBackend::kLocal;
  bool qk_layernorm = false;  ///< q_layernorm / k_layernorm submodules present
  /// The self-attention slot is MLASelfAttention (--multi-latent-attention; Megatron's
  /// get_gpt_layer_local_spec(multi_latent_attention=True)), else SelfAttention.
  bool multi_latent_attention = false;
  MlpKind mlp = MlpKind::kDense;
  /// Set by the model when --context-parallel-size > 1: the core attention is then
  /// ContextParallelAttention (model/layers/cp_attention.h) over this region, whatever
  /// core_attention says (TransformerEngine's CP attention in Megatron-Core).
  const ContextParallelRegion* context_parallel = nullptr;
};

/// Megatron's get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm): the local (non-Transformer
/// Engine) modules, with the core attention `attention`: config.attention_backend as
/// resolve_attention_backend resolved it for the model's device and dtype. Errors: mt::Error for
/// kAuto (unresolved).
LayerSpec get_gpt_layer_local_spec(const TransformerConfig& config, AttentionBackend attention);

/// The spec of each decoder layer 0 .. num_layers-1: the local spec, with the MoE block in the
/// MLP slot of the layers TransformerConfig::is_moe_layer names (--num-experts, --moe-layer-freq;
/// Megatron's get_gpt_decoder_block_spec).
std::vector<LayerSpec> get_gpt_decoder_layer_specs(const TransformerConfig& config, AttentionBackend attention);

}  // namespace mt
