// DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi K2 and their small cousins) <-> megatron.cpp's
// multi-latent attention, sigmoid-routed MoE with expert bias and shared experts, and MTP
// (docs/huggingface.md "DeepSeek-V3"); DeepseekV2ForCausalLM (DeepSeek-V2, V2-Lite) the same
// layout with softmax routing and no MTP (docs/huggingface.md "DeepSeek-V2"; facts from
// transformers 5's modeling_deepseek_v2.py / configuration_deepseek_v2.py): the router is
// --moe-router-pre-softmax (top-k of the softmax probabilities, 'greedy'; 'group_limited_greedy'
// scores a group by its best probability, Megatron's group score for top-k = topk_group) times
// routed_scaling_factor, no e_score_correction_bias; RoPE always on interleaved pairs; YaRN as
// DeepSeek-V3 (cos and sin by the mscale ratio, the softmax by get_mscale(factor, mscale_all_dim)²:
// transformers >= 5.17's DeepseekV2Attention, DeepSeek's own code; transformers <= 5.16 left the
// softmax factor out). Facts from transformers 5's modeling_deepseek_v3.py /
// configuration_deepseek_v3.py / modeling_rope_utils.py and DeepSeek-V3's released checkpoint
// layout (arXiv:2412.19437):
//   * attention, per layer (model.layers.l.self_attn.):
//       q_a_proj [r_q, h] -> linear_q_down_proj, q_a_layernorm [r_q] -> q_layernorm,
//       q_b_proj [n(d_n + d_r), r_q] -> linear_q_up_proj (q_proj [n(d_n + d_r), h] -> linear_q_proj
//       when q_lora_rank is null), kv_a_proj_with_mqa [r_kv + d_r, h] -> linear_kv_down_proj,
//       kv_a_layernorm [r_kv] -> kv_layernorm, kv_b_proj [n(d_n + d_v), r_kv] -> linear_kv_up_proj,
//       o_proj [h, n d_v] -> linear_proj: the same row orders (per head [nope | rope], [c_kv | k_pe],
//       per head [k_nope | v]).
//   * RoPE: with rope_interleave (transformers' default, DeepSeek's own layout) the d_r channels
//     rotate in pairs (2i, 2i+1) with frequency i, as megatron.cpp's MLA: no permutation. Without
//     it transformers rotates pairs (i, i + d_r/2): the rope rows of q_b_proj / q_proj and
//     kv_a_proj_with_mqa are permuted on import (ours 2i <- HF i, 2i+1 <- HF i + d_r/2) and back.
//   * MoE (layers >= first_k_dense_replace): mlp.gate.weight [E, h] -> router.weight,
//     mlp.gate.e_score_correction_bias [E] (fp32) -> the expert bias (checkpoint state
//     "<layer>.mlp.router.expert_bias"), mlp.experts.e.{gate,up,down}_proj -> the experts,
//     mlp.shared_experts.{gate,up,down}_proj -> shared_experts (f_s = n_shared_experts ·
//     moe_intermediate_size, no gate).
//   * MTP depth d = model.layers.<num_hidden_layers + d>: enorm, hnorm, eh_proj [h, 2h],
//     shared_head.norm -> mtp.layers.d.final_layernorm, the layer's own tensors ->
//     mtp.layers.d.transformer_layer.*; its embed_tokens and shared_head.head are copies of the
//     shared embedding and output layer (checked equal on import, written on export).
#pragma once
#include <nlohmann/json.hpp>

#include "model/hf/hf_mapping.h"

namespace mt::hf::detail {

/// DeepseekV3ForCausalLM or DeepseekV2ForCausalLM (the functions below map both).
inline bool is_deepseek(HfArchitecture a) { return a == HfArchitecture::kDeepseekV3 || a == HfArchitecture::kDeepseekV2; }

/// config.json of `arch` -> `c`. Errors (naming the file, the field and the reason): what
/// megatron.cpp cannot represent exactly. DeepseekV3: scoring_func other than sigmoid, topk_method
/// other than noaux_tc, norm_topk_prob false with top-k > 1, a group scoring that is not
/// Megatron's (num_experts_per_tok != 2 · topk_group). DeepseekV2: scoring_func other than softmax,
/// topk_method other than greedy / group_limited_greedy, norm_topk_prob true with top-k > 1,
/// group_limited_greedy with num_experts_per_tok != topk_group, n_shared_experts null,
/// num_nextn_predict_layers. Both: rope types other than default / yarn, YaRN's attention_factor,
/// mscale_all_dim without mscale, grouped keys, attention or MLP biases, moe_layer_freq, quantized
/// weights.
void deepseek_config(const Fields& f, HfArchitecture arch, TransformerConfig& c);
/// Errors: the first property of `c` the architecture cannot hold.
void check_deepseek_representable(HfArchitecture arch, const TransformerConfig& c);
/// The config.json of `c`; `base` (the imported config.json) keeps its other fields and, when they
/// describe the same RoPE, its rope_theta / rope_scaling / rope_parameters as written.
nlohmann::json deepseek_hf_config(HfArchitecture arch, const TransformerConfig& c, const nlohmann::json& base,
                                  DType dtype);

/// The checkpoint's tensors (of m.arch) -> Megatron-Core names (DeepSeek-V3's expert biases
/// included under their state names). Errors: a missing tensor or wrong shape (naming it), an MTP
/// embed_tokens / shared_head.head that differs from the shared one.
void deepseek_to_megatron(const HfModel& m, const SafetensorsCheckpoint& ck, GlobalTensors& t);
/// The inverse; `put_f32` writes DeepSeek-V3's expert biases in fp32 whatever the export dtype (as
/// transformers keeps e_score_correction_bias, _keep_in_fp32_modules_strict).
void deepseek_to_hf(const HfModel& m, const GetTensor& get, const PutTensor& put, const PutTensor& put_f32);

}  // namespace mt::hf::detail
