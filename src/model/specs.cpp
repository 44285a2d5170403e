#include "model/specs.h"

#include "core/check.h"

namespace mt {

LayerSpec get_gpt_layer_local_spec(const TransformerConfig& c, AttentionBackend attention) {
  MT_REQUIRE(attention != AttentionBackend::kAuto,
             "get_gpt_layer_local_spec: --attention-backend auto must be resolved first (resolve_attention_backend)");
  LayerSpec s;
  s.core_attention = attention;
  s.qk_layernorm = c.qk_layernorm;
  s.multi_latent_attention = c.multi_latent_attention;
  s.mlp = MlpKind::kDense;
  return s;
}

std::vector<LayerSpec> get_gpt_decoder_layer_specs(const TransformerConfig& c, AttentionBackend attention) {
  std::vector<LayerSpec> specs(static_cast<size_t>(c.num_layers), get_gpt_layer_local_spec(c, attention));
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (c.is_moe_layer(l)) specs[static_cast<size_t>(l)].mlp = MlpKind::kMoE;
  return specs;
}

}  // namespace mt
