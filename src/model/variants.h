// The model's variation points as small factories: one table per choice the configuration makes
// between implementations — the normalization (--normalization), the MLP activation (--swiglu),
// the position embedding (--position-embedding-type) and the core attention (--attention-backend).
// A table entry maps its kind to
//   * its name, Megatron's spelling: flag values and their parse errors, --help, the log's model
//     line, checkpoint metadata (train/checkpoint.cpp) and the Hugging Face checks; parse and
//     print go through the same entry, so they round-trip;
//   * its implementation: the ops or the module it builds;
//   * what it adds to TransformerConfig::num_parameters and ::flops_per_iteration.
// Nothing outside variants.cpp switches over these enums: code asks an entry what it needs
// (has_bias, fc1_parts, rotary, make, ...). Adding a kind: the enum value, one entry in
// variants.cpp, its op files (docs/architecture.md "Adding a norm kind or an attention backend").
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "core/dtype.h"

namespace mt {

class Tensor;
class Stream;
class TensorParallelRegion;
class CoreAttention;
struct TransformerConfig;

/// --normalization
enum class Normalization : uint8_t { kLayerNorm, kRMSNorm };
/// The MLP activation (Megatron's activation_func with gated_linear_unit; --swiglu selects kSwiGLU).
enum class MlpActivation : uint8_t { kGelu, kSwiGLU };
/// --position-embedding-type
enum class PositionEmbeddingType : uint8_t { kLearnedAbsolute, kRope, kNone };
/// --attention-backend (Megatron's AttnBackend). kAuto is resolved per model
/// (resolve_attention_backend) to one of the others, which build the core attention.
enum class AttentionBackend : uint8_t { kAuto, kFlash, kFused, kLocal };

/// The names of one kind: its spelling (flags, logs, checkpoints), an alias the parser also
/// accepts (nullptr: none) and a short description for --help.
struct KindName {
  const char* name;
  const char* alias;
  const char* help;
};

/// A normalization over the last dimension h (model/layers/norm.h builds it; the ops are its
/// implementation). Parameters: <prefix>.weight [h] (ones) and, with has_bias, <prefix>.bias [h]
/// (zeros). Saved per activation area: fp32 rstd [rows] and, with saves_mean, fp32 mean [rows].
/// FLOPs: none in Megatron's count (num_floating_point_operations counts GEMMs and attention).
struct NormKind {
  Normalization kind;
  KindName names;
  bool has_bias;
  bool saves_mean;
  /// The op accepts strided row views (ops/row_map.h): needed by --qk-layernorm, which
  /// normalises the q/k heads inside the fused QKV tensor.
  bool strided_rows;
  /// y = norm(x) (ops/layernorm.h, ops/rmsnorm.h): x, y [rows, h]; mean (empty unless
  /// saves_mean), rstd fp32 [rows] written; bias empty unless has_bias; zero_centered_gamma: the
  /// scale is 1 + weight (--apply-layernorm-1p).
  void (*forward)(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                  const Tensor& bias, float eps, const Stream& stream, bool zero_centered_gamma);
  /// dx (overwrite, or += with accumulate_dx); dweight (and dbias) += (fp32 [h]).
  void (*backward)(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy, const Tensor& x,
                   const Tensor& weight, const Tensor& mean, const Tensor& rstd, bool accumulate_dx,
                   const Stream& stream, bool zero_centered_gamma);
  /// Parameters per channel of h (num_parameters): weight, plus the bias.
  int64_t params_per_channel() const { return has_bias ? 2 : 1; }
};

/// The MLP activation between linear_fc1 and linear_fc2 (model/layers/mlp.h; the MoE experts).
struct MlpActivationKind {
  MlpActivation kind;
  KindName names;
  /// linear_fc1's output blocks: 1 ([f]) or 2 (gated: gate then up, [2, f]).
  int64_t fc1_parts;
  /// Megatron's --ffn-hidden-size default for hidden size h (arguments.py).
  int64_t (*default_ffn)(int64_t h);
  /// The MLP term's factor in flops_per_iteration (Megatron's gated_linear_multiplier: 3/2 when
  /// gated, the three GEMMs of f columns per two of an ungated MLP).
  double flops_factor;
  /// cuBLASLt's GELU epilogues compute it: the forward in linear_fc1's GEMM (GELU_AUX_BIAS, the
  /// pre-activation kept) and the backward in linear_fc2's dgrad GEMM (DGELU), ops/matmul.h.
  bool gelu_epilogue;
  /// act [rows, f] = act(pre [rows, fc1_parts·f]) and its backward dpre (overwrite) from dact and
  /// pre (ops/gelu.h, ops/swiglu.h).
  void (*forward)(const Tensor& act, const Tensor& pre, const Stream& stream);
  void (*backward)(const Tensor& dpre, const Tensor& dact, const Tensor& pre, const Stream& stream);
};

/// Where positions enter the model.
struct PositionEmbeddingKind {
  PositionEmbeddingType kind;
  KindName names;
  /// LanguageModelEmbedding declares embedding.position_embeddings.weight [max_positions, h]
  /// (max_positions·h parameters) and --seq-length must fit it.
  bool learned_table;
  /// SelfAttention rotates q and k (ops/rope.h; --rotary-base, --rotary-percent, --rotary-interleaved).
  bool rotary;
};

/// A core attention (model/layers/attention.h). FLOPs: the same for every backend (the model's
/// FLOPs, flops_per_iteration, not the kernels').
struct AttentionBackendKind {
  AttentionBackend kind;
  KindName names;
  /// Builds the core attention of layer `layer` on this TP rank; nullptr for kAuto, which is
  /// resolved first.
  std::unique_ptr<CoreAttention> (*make)(const TransformerConfig& config, int64_t layer, const TensorParallelRegion& tp);
};

/// The tables, in enum order.
std::span<const NormKind> norm_kinds();
std::span<const MlpActivationKind> mlp_activation_kinds();
std::span<const PositionEmbeddingKind> position_embedding_kinds();
std::span<const AttentionBackendKind> attention_backend_kinds();

/// The entry of a kind. Errors: mt::Error for a value without an entry.
const NormKind& norm_kind(Normalization n);
const MlpActivationKind& mlp_activation_kind(MlpActivation a);
const PositionEmbeddingKind& position_embedding_kind(PositionEmbeddingType p);
const AttentionBackendKind& attention_backend_kind(AttentionBackend a);

/// Names (KindName::name).
const char* normalization_name(Normalization n);
const char* mlp_activation_name(MlpActivation a);
const char* position_embedding_type_name(PositionEmbeddingType p);
const char* attention_backend_name(AttentionBackend a);

/// Parse a name or alias. Errors: mt::Error naming the flag, the value and every accepted name,
/// e.g. "--normalization 'BatchNorm' is not supported: expected LayerNorm or RMSNorm".
Normalization parse_normalization(const std::string& s);
MlpActivation parse_mlp_activation(const std::string& s);
PositionEmbeddingType parse_position_embedding_type(const std::string& s);
AttentionBackend parse_attention_backend(const std::string& s);

/// --help text of the flag: every name with its description, e.g. "LayerNorm (...) or RMSNorm (...)".
std::string normalization_help();
std::string position_embedding_type_help();
std::string attention_backend_help();

/// The activation Megatron's gated_linear_unit (--swiglu) selects: kSwiGLU or kGelu.
MlpActivation mlp_activation_of(bool gated_linear_unit);

/// What --attention-backend auto and fused depend on besides the config's head dim.
struct AttentionPlatform {
  bool cuda = false;           ///< the model runs on a GPU
  DType dtype = DType::kF32;   ///< activation dtype
  bool cudnn = false;          ///< the build has cuDNN's fused attention (flash_attention_cudnn_available())
  bool hopper = false;         ///< compute capability >= 9.0: cuDNN's head dims up to 256 (MLA's 192)
};

/// --attention-backend resolved for a model, once (GPTModel: the layer specs and the log's name):
///   local -> local; flash -> flash;
///   fused -> fused where cuDNN can run (CUDA, bf16/fp16, a cuDNN build; the op still falls back
///            to the FlashAttention-2 kernels per call where cuDNN does not apply), else flash;
///   auto  -> as fused where the FlashAttention-2 fast path applies (CUDA, bf16/fp16, head dim 64
///            or 128) or where cuDNN runs on Hopper or newer at a head dim up to 256 that is a
///            multiple of 8 (MLA's 192: cuDNN's support matrix), else local.
/// Never returns kAuto.
AttentionBackend resolve_attention_backend(AttentionBackend requested, int64_t head_dim, const AttentionPlatform& p);

}  // namespace mt
