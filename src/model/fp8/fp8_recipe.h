// FP8 training recipes as Megatron-LM names them (--fp8-format, --fp8-recipe and the delayed-scaling
// flags; megatron/core/fp8_utils.py, Transformer Engine's transformer_engine/common/recipe). The
// contract — which GEMMs run in FP8, which scales, which amax reductions — is docs/fp8.md.
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "ops/fp8_math.h"

namespace mt {

/// --fp8-format (Megatron's `fp8`): off, e4m3 everywhere, or hybrid (e4m3 for activations and
/// weights, e5m2 for the output gradients).
enum class Fp8Format : uint8_t { kNone, kE4M3, kHybrid };

/// --fp8-recipe: tensorwise = TE's Float8CurrentScaling (each tensor's scale from its own amax),
/// delayed = TE's DelayedScaling (scales from an amax history), blockwise = TE's
/// Float8BlockScaling (1x128 activation / gradient tiles, 128x128 weight blocks; DeepSeek-V3).
/// Megatron's mxfp8 (Blackwell) and custom recipes are not built.
enum class Fp8Recipe : uint8_t { kTensorwise, kDelayed, kBlockwise };

/// "e4m3" / "hybrid"; "tensorwise" / "delayed" / "blockwise"; "max" / "most_recent". Errors:
/// mt::Error naming the value and the accepted ones (mxfp8 and custom named as not built).
Fp8Format parse_fp8_format(const std::string& s);
Fp8Recipe parse_fp8_recipe(const std::string& s);
fp8_math::AmaxAlgo parse_fp8_amax_compute_algo(const std::string& s);
const char* fp8_format_name(Fp8Format f);  ///< "e4m3", "hybrid", "off"
const char* fp8_recipe_name(Fp8Recipe r);
const char* fp8_amax_compute_algo_name(fp8_math::AmaxAlgo a);

/// What one FP8 linear layer needs of the configuration (TransformerConfig's fp8 fields).
struct Fp8Settings {
  Fp8Format format = Fp8Format::kNone;
  Fp8Recipe recipe = Fp8Recipe::kDelayed;
  int margin = 0;                    ///< --fp8-margin (delayed)
  int64_t amax_history_len = 1;      ///< --fp8-amax-history-len (delayed)
  fp8_math::AmaxAlgo amax_compute_algo = fp8_math::AmaxAlgo::kMostRecent;  ///< --fp8-amax-compute-algo
  /// Delayed scaling's fused producers (ops/fp8_fused.h; docs/fp8.md "Fused quantisation"), each
  /// bitwise the separate quantisation; not flags (TransformerConfig::fp8_fused_norm /
  /// fp8_fused_activation). fused_norm: the RMSNorm before linear_qkv / linear_fc1 writes the
  /// linear's FP8 input (off by default: on an H200 that step measured slower, docs/fp8.md "What
  /// fuses"). fused_activation: the SwiGLU before linear_fc2 writes its FP8 input and saved
  /// transpose (no bf16 output), and the SwiGLU's backward linear_fc1's FP8 output gradient (no
  /// bf16 gradient).
  bool fused_norm = false;
  bool fused_activation = true;
  bool on() const { return format != Fp8Format::kNone; }
  /// The FP8 dtype of activations and weights (e4m3) and of output gradients (e5m2 for hybrid).
  DType forward_dtype() const { return DType::kF8E4M3; }
  DType grad_dtype() const { return format == Fp8Format::kHybrid ? DType::kF8E5M2 : DType::kF8E4M3; }
  bool blockwise() const { return recipe == Fp8Recipe::kBlockwise; }
  bool delayed() const { return recipe == Fp8Recipe::kDelayed; }
  /// "e4m3 tensorwise", "hybrid delayed (history 16, max, margin 0)", ...
  std::string summary() const;
};

}  // namespace mt
