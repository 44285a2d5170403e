// GPT model configuration (Megatron's TransformerConfig subset for the GPT-2 architecture:
// pre-LayerNorm, learned absolute positions, tied input/output embedding, biases, GELU MLP).
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace mt {

struct GptConfig {
  int64_t num_layers = 12;              ///< --num-layers
  int64_t hidden_size = 768;            ///< --hidden-size (h)
  int64_t num_attention_heads = 12;     ///< --num-attention-heads (n)
  int64_t ffn_hidden_size = 0;          ///< --ffn-hidden-size (f); 0 = 4h
  int64_t seq_length = 1024;            ///< --seq-length (s)
  int64_t max_position_embeddings = 0;  ///< --max-position-embeddings; 0 = seq_length
  int64_t vocab_size = 50257;           ///< tokenizer vocabulary (before padding)
  int64_t make_vocab_size_divisible_by = 128;  ///< --make-vocab-size-divisible-by
  float init_method_std = 0.02f;        ///< --init-method-std
  float layernorm_epsilon = 1e-5f;      ///< --layernorm-epsilon
  float hidden_dropout = 0.1f;          ///< --hidden-dropout
  float attention_dropout = 0.1f;       ///< --attention-dropout

  int64_t ffn() const { return ffn_hidden_size > 0 ? ffn_hidden_size : 4 * hidden_size; }
  int64_t max_positions() const { return max_position_embeddings > 0 ? max_position_embeddings : seq_length; }
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  /// Vocabulary padded to a multiple of make_vocab_size_divisible_by * tp (Megatron's
  /// _vocab_size_with_padding).
  int64_t padded_vocab_size(int tp = 1) const;
  /// Throws mt::Error naming the offending values (heads not dividing hidden size, sequence
  /// longer than the position table, non-positive sizes, dropout outside [0, 1), tp not
  /// dividing heads / ffn).
  void validate(int tp = 1) const;
  /// Parameters of the model (tied embedding counted once), with padded vocabulary.
  int64_t num_parameters(int tp = 1) const;
  /// Megatron's num_floating_point_operations (megatron/training/training.py) for one
  /// iteration of `global_batch` sequences, forward + backward, no recompute:
  /// 12·B·s·L·h²·((1 + 1 + s/h) + f/h + V/(2·L·h)) (groups = heads, no gating, no MoE).
  double flops_per_iteration(int64_t global_batch) const;
};

}  // namespace mt
