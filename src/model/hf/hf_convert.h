// Hugging Face interchange (docs/huggingface.md): config.json <-> TransformerConfig and the
// per-layer weight mapping between a transformers checkpoint and Megatron-Core's parameter names
// and layouts, for GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, the
// mixture-of-experts MixtralForCausalLM, Qwen3MoeForCausalLM and Qwen2MoeForCausalLM, and
// DeepseekV3ForCausalLM (multi-latent attention, sigmoid routing with expert bias, MTP) and
// DeepseekV2ForCausalLM (multi-latent attention, softmax routing; model/hf/hf_deepseek.h).
//
// Layout conversions (facts from transformers' modeling files and Megatron-Core's checkpoint
// converters):
//   * QKV: transformers keeps q_proj [n·d, h], k_proj [g·d, h], v_proj [g·d, h] (GPT-2: one
//     Conv1D c_attn [h, 3h] holding q | k | v columns); Megatron-Core's linear_qkv is
//     [(n + 2g)·d, h] in per-query-group order: for each group its n/g query heads, then its key
//     head, then its value head.
//   * GPT-2's Conv1D weights are [in, out]: transposed to Megatron's [out, in].
//   * SwiGLU: gate_proj and up_proj [f, h] stack into linear_fc1 [2, f, h] (gate first).
//   * RoPE: transformers' Llama/Qwen rotate halves of each head (rotate_half), which is Megatron's
//     non-interleaved RoPE on the same weight order: no permutation.
//   * Vocabulary: padded with zero rows on import (the padding is inert), dropped on export.
//   * MoE (Mixtral's block_sparse_moe, Qwen 3 MoE's mlp): gate [E, h] is the router; each expert's
//     w1 / gate_proj and w3 / up_proj stack into its linear_fc1 [2, f, h], w2 / down_proj is its
//     linear_fc2 (transformers 5's fused experts.gate_up_proj [E, 2f, h] / experts.down_proj
//     [E, h, f] are read too). Router: softmax over all experts, top-k, renormalised (Mixtral;
//     Qwen 3 MoE with norm_topk_prob) = Megatron's softmax over the selected logits; not
//     renormalised (norm_topk_prob false) = --moe-router-pre-softmax. Qwen 3 MoE's dense layers
//     (mlp_only_layers, decoder_sparse_step) become --moe-layer-freq's pattern.
//   * Qwen 2 MoE (Qwen 3 MoE's layout with Qwen 2's QKV bias and no QK-norm, facts from
//     transformers' modeling_qwen2_moe.py): its shared expert mlp.shared_expert.{gate,up,down}_proj
//     is Megatron's mlp.shared_experts.linear_fc1 [2, f_s, h] / linear_fc2 [h, f_s]
//     (--moe-shared-expert-intermediate-size f_s = shared_expert_intermediate_size), its
//     mlp.shared_expert_gate.weight [1, h] is mlp.shared_experts.gate_weight
//     (--moe-shared-expert-gate: the shared output times sigmoid(x · w), as transformers).
#pragma once
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/hf/safetensors.h"
#include "model/transformer_config.h"

namespace mt::hf {

enum class HfArchitecture { kGpt2, kLlama, kQwen2, kQwen3, kMixtral, kQwen3Moe, kQwen2Moe, kDeepseekV3, kDeepseekV2 };

/// "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
/// "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM",
/// "DeepseekV2ForCausalLM".
const char* architecture_name(HfArchitecture a);
/// Errors: mt::Error naming the value and the supported architectures.
HfArchitecture parse_architecture(const std::string& name);
/// Mixtral, Qwen 3 MoE or Qwen 2 MoE (the Llama-like MoE families; DeepSeek-V2/V3 are mapped apart).
bool is_moe(HfArchitecture a);

struct HfModel {
  HfArchitecture arch = HfArchitecture::kGpt2;
  TransformerConfig config;
  nlohmann::json config_json;  ///< the config.json read (or written)
};

/// Reads <dir>/config.json into a TransformerConfig. seq_length: the model's --seq-length (0 =
/// min(max_position_embeddings, 4096)). Errors (mt::Error naming the file and the field): a missing
/// or unreadable file, invalid JSON, an unknown architecture, a missing or ill-typed field, and
/// features megatron.cpp does not implement (RoPE scaling, sliding windows, biases only on some
/// projections, non-tanh GELU for GPT-2, router jitter, shared experts, ...).
HfModel read_hf_config(const std::string& dir, int64_t seq_length = 0, int64_t make_vocab_size_divisible_by = 128);

/// The architecture that represents `config`: DeepSeek-V2 (multi-latent attention with a softmax
/// MoE router), DeepSeek-V3 (any other multi-latent attention model), GPT-2
/// (LayerNorm, learned positions, biases, GELU, tied), Llama (RMSNorm, RoPE, SwiGLU, no biases),
/// Qwen 2 (Llama + QKV bias), Qwen 3 (Llama + QK-norm); with experts Qwen 3 MoE (QK-norm), Qwen 2
/// MoE (shared expert or QKV bias) or Mixtral. check_representable then names what does not fit.
HfArchitecture infer_architecture(const TransformerConfig& config);
/// Checks that `arch` can represent `config`; errors name the first field that differs.
void check_representable(HfArchitecture arch, const TransformerConfig& config);

/// config.json for `arch` and `config`. Fields of `base` (a config.json read at import: token
/// ids, generation defaults, torch_dtype) are kept unless they describe the architecture.
nlohmann::json make_hf_config(HfArchitecture arch, const TransformerConfig& config, const nlohmann::json& base,
                              DType dtype);

/// Global (unsharded) fp32 tensors under Megatron-Core's names, in the global shapes of
/// GPTModel::param_specs at TP 1 (vocabulary tensors with their padding rows), plus the model
/// state of expert_bias_state_names.
using GlobalTensors = std::map<std::string, std::vector<float>>;

/// The model state import-hf and export-hf carry beside the parameters: the expert bias of every
/// MoE layer when --moe-router-enable-expert-bias (DeepSeek-V3's e_score_correction_bias), named
/// as GPTModel::persistent_state names it ("decoder.layers.<l>.mlp.router.expert_bias",
/// "mtp.layers.<d>.transformer_layer.mlp.router.expert_bias"), each fp32 [num_moe_experts].
std::vector<std::string> expert_bias_state_names(const TransformerConfig& config);

/// DeepseekV3ForCausalLM: num_nextn_predict_layers counts the MTP layers DeepSeek's checkpoints
/// hold as model.layers.<num_hidden_layers + d>, but transformers drops them (a model saved by
/// transformers keeps the field without the weights). Sets config.mtp_num_layers to 0, with a log
/// line, when the checkpoint holds no MTP tensors; other architectures are left alone.
void drop_absent_mtp_layers(HfModel& model, const SafetensorsCheckpoint& ckpt);

/// Maps a transformers checkpoint onto GlobalTensors. Errors: a tensor missing (naming it and the
/// directory) or with a shape that disagrees with config.json (naming both shapes).
GlobalTensors hf_to_megatron(const HfModel& model, const SafetensorsCheckpoint& ckpt);
/// The inverse: the transformers tensors of `model` in `dtype` (fp32, bf16 or fp16). Errors: a
/// missing Megatron tensor.
std::vector<TensorToWrite> megatron_to_hf(const HfModel& model, const GlobalTensors& tensors, DType dtype);

}  // namespace mt::hf
