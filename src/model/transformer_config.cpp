#include "model/transformer_config.h"

#include <fmt/format.h>

#include "core/check.h"

namespace mt {

const char* normalization_name(Normalization n) { return n == Normalization::kRMSNorm ? "RMSNorm" : "LayerNorm"; }

const char* position_embedding_type_name(PositionEmbeddingType p) {
  switch (p) {
    case PositionEmbeddingType::kLearnedAbsolute: return "learned_absolute";
    case PositionEmbeddingType::kRope: return "rope";
    case PositionEmbeddingType::kNone: return "none";
  }
  return "?";
}

const char* attention_backend_name(AttentionBackend a) {
  return a == AttentionBackend::kFlash ? "flash" : a == AttentionBackend::kLocal ? "local" : "auto";
}

AttentionBackend parse_attention_backend(const std::string& s) {
  if (s == "auto") return AttentionBackend::kAuto;
  if (s == "flash" || s == "fused") return AttentionBackend::kFlash;
  if (s == "local" || s == "unfused") return AttentionBackend::kLocal;
  MT_FAIL("--attention-backend '{}' is not supported: expected auto, flash (fused) or local (unfused)", s);
}

Normalization parse_normalization(const std::string& s) {
  if (s == "LayerNorm") return Normalization::kLayerNorm;
  if (s == "RMSNorm") return Normalization::kRMSNorm;
  MT_FAIL("--normalization '{}' is not supported: expected LayerNorm or RMSNorm", s);
}

PositionEmbeddingType parse_position_embedding_type(const std::string& s) {
  if (s == "learned_absolute") return PositionEmbeddingType::kLearnedAbsolute;
  if (s == "rope") return PositionEmbeddingType::kRope;
  if (s == "none") return PositionEmbeddingType::kNone;
  MT_FAIL("--position-embedding-type '{}' is not supported: expected learned_absolute, rope or none", s);
}

int64_t TransformerConfig::ffn() const {
  if (ffn_hidden_size > 0) return ffn_hidden_size;
  // Megatron's arguments.py: with --swiglu the two fc1 projections keep the parameter count of a
  // 4h MLP, rounded down to a multiple of 64.
  if (gated_linear_unit) return static_cast<int64_t>((4.0 * static_cast<double>(hidden_size) * 2.0 / 3.0) / 64.0) * 64;
  return 4 * hidden_size;
}

int64_t TransformerConfig::rotary_dim() const {
  const int64_t r = static_cast<int64_t>(static_cast<double>(head_dim()) * rotary_percent);
  return r - r % 2;
}

int64_t TransformerConfig::padded_vocab_size(int tp) const {
  const int64_t m = make_vocab_size_divisible_by * tp;
  return (vocab_size + m - 1) / m * m;
}

void TransformerConfig::validate(int tp) const {
  MT_REQUIRE(num_layers > 0, "--num-layers must be positive, got {}", num_layers);
  MT_REQUIRE(hidden_size > 0, "--hidden-size must be positive, got {}", hidden_size);
  MT_REQUIRE(num_attention_heads > 0, "--num-attention-heads must be positive, got {}", num_attention_heads);
  MT_REQUIRE(kv_channels >= 0, "--kv-channels must be positive, got {}", kv_channels);
  MT_REQUIRE(kv_channels > 0 || hidden_size % num_attention_heads == 0,
             "--hidden-size {} is not divisible by --num-attention-heads {} (give --kv-channels for another head "
             "size)",
             hidden_size, num_attention_heads);
  MT_REQUIRE(num_query_groups >= 0, "--num-query-groups must be positive, got {}", num_query_groups);
  MT_REQUIRE(num_attention_heads % query_groups() == 0,
             "--num-attention-heads {} is not divisible by --num-query-groups {}", num_attention_heads,
             query_groups());
  MT_REQUIRE(seq_length > 0, "--seq-length must be positive, got {}", seq_length);
  MT_REQUIRE(position_embedding_type != PositionEmbeddingType::kLearnedAbsolute || seq_length <= max_positions(),
             "--seq-length {} exceeds --max-position-embeddings {}", seq_length, max_positions());
  MT_REQUIRE(vocab_size > 0, "vocabulary size must be positive, got {}", vocab_size);
  MT_REQUIRE(make_vocab_size_divisible_by > 0, "--make-vocab-size-divisible-by must be positive, got {}",
             make_vocab_size_divisible_by);
  MT_REQUIRE(ffn_hidden_size >= 0 && ffn() > 0, "--ffn-hidden-size must be positive, got {}", ffn_hidden_size);
  MT_REQUIRE(norm_epsilon >= 0, "--norm-epsilon must be >= 0, got {}", norm_epsilon);
  MT_REQUIRE(hidden_dropout >= 0 && hidden_dropout < 1, "--hidden-dropout must be in [0, 1), got {}", hidden_dropout);
  MT_REQUIRE(attention_dropout >= 0 && attention_dropout < 1, "--attention-dropout must be in [0, 1), got {}",
             attention_dropout);
  MT_REQUIRE(init_method_std > 0, "--init-method-std must be positive, got {}", init_method_std);
  if (position_embedding_type == PositionEmbeddingType::kRope) {
    MT_REQUIRE(rotary_percent > 0 && rotary_percent <= 1, "--rotary-percent must be in (0, 1], got {}",
               rotary_percent);
    MT_REQUIRE(rotary_dim() >= 2, "--rotary-percent {} of head dim {} leaves fewer than 2 rotary channels",
               rotary_percent, head_dim());
    MT_REQUIRE(rotary_base > 0, "--rotary-base must be positive, got {}", rotary_base);
  }
  MT_REQUIRE(!qk_layernorm || normalization == Normalization::kRMSNorm,
             "--qk-layernorm is implemented with --normalization RMSNorm only (got {})",
             normalization_name(normalization));
  MT_REQUIRE(tp >= 1, "tensor parallel size must be >= 1, got {}", tp);
  MT_REQUIRE(num_attention_heads % tp == 0, "--num-attention-heads {} is not divisible by tensor parallel size {}",
             num_attention_heads, tp);
  MT_REQUIRE(query_groups() % tp == 0, "--num-query-groups {} is not divisible by tensor parallel size {}",
             query_groups(), tp);
  MT_REQUIRE(ffn() % tp == 0, "--ffn-hidden-size {} is not divisible by tensor parallel size {}", ffn(), tp);
}

int64_t TransformerConfig::num_parameters(int tp) const {
  const int64_t h = hidden_size, f = ffn(), V = padded_vocab_size(tp), n = num_attention_heads, d = head_dim();
  const int64_t g = query_groups(), qkv_out = (n + 2 * g) * d;
  const int64_t norm = normalization == Normalization::kLayerNorm ? 2 : 1;  // weight (+ bias)
  const int64_t bias = add_bias_linear ? 1 : 0;
  int64_t per_layer = 2 * norm * h;                                    // input and pre-MLP norms
  per_layer += qkv_out * h + (qkv_bias() ? qkv_out : 0);                // linear_qkv
  per_layer += qk_layernorm ? 2 * norm * d : 0;                        // q/k layernorm
  per_layer += h * n * d + bias * h;                                   // linear_proj
  per_layer += (gated_linear_unit ? 2 : 1) * f * (h + bias) + f * h + bias * h;  // linear_fc1, linear_fc2
  int64_t total = V * h + num_layers * per_layer + norm * h;
  if (position_embedding_type == PositionEmbeddingType::kLearnedAbsolute) total += max_positions() * h;
  if (untie_embeddings_and_output_weights) total += V * h;
  return total;
}

double TransformerConfig::flops_per_iteration(int64_t global_batch) const {
  const double B = static_cast<double>(global_batch), s = static_cast<double>(seq_length);
  const double L = static_cast<double>(num_layers), h = static_cast<double>(hidden_size);
  const double f = static_cast<double>(ffn()), V = static_cast<double>(padded_vocab_size());
  const double n = static_cast<double>(num_attention_heads), g = static_cast<double>(query_groups());
  const double qproj = n * static_cast<double>(head_dim()) / h;
  const double glu = gated_linear_unit ? 1.5 : 1.0;
  return 12.0 * B * s * L * h * h * ((1.0 + g / n + s / h) * qproj + (f / h) * glu + V / (2.0 * L * h));
}

std::string TransformerConfig::summary() const {
  std::string s = fmt::format("{} layers, hidden {}, heads {}", num_layers, hidden_size, num_attention_heads);
  if (query_groups() != num_attention_heads) s += fmt::format(" ({} query groups)", query_groups());
  if (head_dim() * num_attention_heads != hidden_size) s += fmt::format(", kv channels {}", head_dim());
  s += fmt::format(", ffn {}{}, {}, {} positions", ffn(), gated_linear_unit ? " (SwiGLU)" : "",
                   normalization_name(normalization), position_embedding_type_name(position_embedding_type));
  if (!add_bias_linear) s += add_qkv_bias ? ", QKV bias only" : ", no bias";
  if (qk_layernorm) s += ", QK-norm";
  if (untie_embeddings_and_output_weights) s += ", untied output layer";
  return s;
}

}  // namespace mt
