#include "model/config.h"

namespace mt {

int64_t GptConfig::padded_vocab_size(int tp) const {
  int64_t m = make_vocab_size_divisible_by * tp;
  return (vocab_size + m - 1) / m * m;
}

void GptConfig::validate(int tp) const {
  MT_REQUIRE(num_layers > 0, "--num-layers must be positive, got {}", num_layers);
  MT_REQUIRE(hidden_size > 0, "--hidden-size must be positive, got {}", hidden_size);
  MT_REQUIRE(num_attention_heads > 0, "--num-attention-heads must be positive, got {}", num_attention_heads);
  MT_REQUIRE(hidden_size % num_attention_heads == 0,
             "--hidden-size {} is not divisible by --num-attention-heads {}", hidden_size, num_attention_heads);
  MT_REQUIRE(seq_length > 0, "--seq-length must be positive, got {}", seq_length);
  MT_REQUIRE(seq_length <= max_positions(), "--seq-length {} exceeds --max-position-embeddings {}", seq_length,
             max_positions());
  MT_REQUIRE(vocab_size > 0, "vocabulary size must be positive, got {}", vocab_size);
  MT_REQUIRE(make_vocab_size_divisible_by > 0, "--make-vocab-size-divisible-by must be positive, got {}",
             make_vocab_size_divisible_by);
  MT_REQUIRE(ffn() > 0, "--ffn-hidden-size must be positive, got {}", ffn_hidden_size);
  MT_REQUIRE(hidden_dropout >= 0 && hidden_dropout < 1, "--hidden-dropout must be in [0, 1), got {}", hidden_dropout);
  MT_REQUIRE(attention_dropout >= 0 && attention_dropout < 1, "--attention-dropout must be in [0, 1), got {}",
             attention_dropout);
  MT_REQUIRE(init_method_std > 0, "--init-method-std must be positive, got {}", init_method_std);
  MT_REQUIRE(num_attention_heads % tp == 0, "--num-attention-heads {} is not divisible by tensor parallel size {}",
             num_attention_heads, tp);
  MT_REQUIRE(ffn() % tp == 0, "--ffn-hidden-size {} is not divisible by tensor parallel size {}", ffn(), tp);
}

int64_t GptConfig::num_parameters(int tp) const {
  int64_t h = hidden_size, f = ffn(), V = padded_vocab_size(tp);
  int64_t per_layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (f * h + f) + (h * f + h);
  return V * h + max_positions() * h + num_layers * per_layer + 2 * h;
}

double GptConfig::flops_per_iteration(int64_t global_batch) const {
  double B = static_cast<double>(global_batch), s = static_cast<double>(seq_length);
  double L = static_cast<double>(num_layers), h = static_cast<double>(hidden_size);
  double f = static_cast<double>(ffn()), V = static_cast<double>(padded_vocab_size());
  return 12.0 * B * s * L * h * h * ((1.0 + 1.0 + s / h) + f / h + V / (2.0 * L * h));
}

}  // namespace mt
