#include "model/specs.h"

namespace mt {

LayerSpec get_gpt_layer_local_spec(const TransformerConfig& c, bool fast_flash) {
  LayerSpec s;
  const bool flash = c.attention_backend == AttentionBackend::kFlash || c.attention_backend == AttentionBackend::kFused ||
                     (c.attention_backend == AttentionBackend::kAuto && fast_flash);
  s.core_attention = flash ? CoreAttentionKind::kFlash : CoreAttentionKind::kDotProduct;
  s.qk_layernorm = c.qk_layernorm;
  s.mlp = MlpKind::kDense;
  return s;
}

std::vector<LayerSpec> get_gpt_decoder_layer_specs(const TransformerConfig& c, bool fast_flash) {
  std::vector<LayerSpec> specs(static_cast<size_t>(c.num_layers), get_gpt_layer_local_spec(c, fast_flash));
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (c.is_moe_layer(l)) specs[static_cast<size_t>(l)].mlp = MlpKind::kMoE;
  return specs;
}

}  // namespace mt
