#include "model/specs.h"

namespace mt {

LayerSpec get_gpt_layer_local_spec(const TransformerConfig& c) {
  LayerSpec s;
  s.core_attention = CoreAttentionKind::kDotProduct;
  s.qk_layernorm = c.qk_layernorm;
  s.mlp = MlpKind::kDense;
  return s;
}

std::vector<LayerSpec> get_gpt_decoder_layer_specs(const TransformerConfig& c) {
  return std::vector<LayerSpec>(static_cast<size_t>(c.num_layers), get_gpt_layer_local_spec(c));
}

}  // namespace mt
