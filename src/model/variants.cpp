// The variation-point tables of model/variants.h. One entry per kind; nothing else in the code
// switches over these enums.
#include "model/variants.h"

#include <array>

#include "core/check.h"
#include "model/layers/attention.h"
#include "ops/gelu.h"
#include "ops/layernorm.h"
#include "ops/rmsnorm.h"
#include "ops/swiglu.h"

namespace mt {

namespace {

// --- the tables --------------------------------------------------------------------------------

void rmsnorm_forward_entry(const Tensor& y, const Tensor&, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                           const Tensor&, float eps, const Stream& stream, bool zero_centered_gamma) {
  rmsnorm_forward(y, rstd, x, weight, eps, stream, zero_centered_gamma);
}
void rmsnorm_backward_entry(const Tensor& dx, const Tensor& dweight, const Tensor&, const Tensor& dy, const Tensor& x,
                            const Tensor& weight, const Tensor&, const Tensor& rstd, bool accumulate_dx,
                            const Stream& stream, bool zero_centered_gamma) {
  rmsnorm_backward(dx, dweight, dy, x, weight, rstd, accumulate_dx, stream, zero_centered_gamma);
}

const std::array<NormKind, 2> kNormKinds{{
    {Normalization::kLayerNorm,
     {"LayerNorm", nullptr, "weight and bias, centred by the mean (Ba et al. 2016)"},
     /*has_bias=*/true, /*saves_mean=*/true, /*strided_rows=*/false, &layernorm_forward, &layernorm_backward},
    {Normalization::kRMSNorm,
     {"RMSNorm", nullptr, "weight only, scaled by the root mean square (Zhang & Sennrich 2019)"},
     /*has_bias=*/false, /*saves_mean=*/false, /*strided_rows=*/true, &rmsnorm_forward_entry, &rmsnorm_backward_entry},
}};

int64_t four_h(int64_t h) { return 4 * h; }
// Megatron's arguments.py: with --swiglu the two fc1 projections keep the parameter count of a 4h
// MLP, rounded down to a multiple of 64.
int64_t swiglu_ffn(int64_t h) {
  return static_cast<int64_t>((4.0 * static_cast<double>(h) * 2.0 / 3.0) / 64.0) * 64;
}

const std::array<MlpActivationKind, 2> kMlpActivationKinds{{
    {MlpActivation::kGelu,
     {"GELU", nullptr, "tanh approximation (Hendrycks & Gimpel 2016)"},
     /*fc1_parts=*/1, &four_h, /*flops_factor=*/1.0, /*gelu_epilogue=*/true, &gelu_forward, &gelu_backward},
    {MlpActivation::kSwiGLU,
     {"SwiGLU", nullptr, "SiLU(gate) * up, a gated linear unit (Shazeer 2020; --swiglu)"},
     /*fc1_parts=*/2, &swiglu_ffn, /*flops_factor=*/1.5, /*gelu_epilogue=*/false, &swiglu_forward, &swiglu_backward},
}};

const std::array<PositionEmbeddingKind, 3> kPositionEmbeddingKinds{{
    {PositionEmbeddingType::kLearnedAbsolute,
     {"learned_absolute", nullptr, "a learned table of --max-position-embeddings rows"},
     /*learned_table=*/true, /*rotary=*/false},
    {PositionEmbeddingType::kRope,
     {"rope", nullptr, "rotary embedding of queries and keys (Su et al. 2021)"},
     /*learned_table=*/false, /*rotary=*/true},
    {PositionEmbeddingType::kNone, {"none", nullptr, "no position information"}, false, false},
}};

template <bool kCudnn>
std::unique_ptr<CoreAttention> make_flash(const TransformerConfig& c, int64_t layer, const TensorParallelRegion& tp) {
  return std::make_unique<FlashAttention>(c, layer, tp, kCudnn);
}
std::unique_ptr<CoreAttention> make_local(const TransformerConfig& c, int64_t layer, const TensorParallelRegion& tp) {
  return std::make_unique<DotProductAttention>(c, layer, tp);
}

const std::array<AttentionBackendKind, 4> kAttentionBackendKinds{{
    {AttentionBackend::kAuto,
     {"auto", nullptr, "fused on CUDA in bf16/fp16 with head dim 64 or 128, else local"},
     nullptr},
    {AttentionBackend::kFlash, {"flash", nullptr, "the FlashAttention-2 kernels"}, &make_flash<false>},
    {AttentionBackend::kFused,
     {"fused", nullptr, "cuDNN's fused attention where it applies (CUDA, bf16/fp16), else the flash kernels"},
     &make_flash<true>},
    {AttentionBackend::kLocal,
     {"local", "unfused", "the unfused DotProductAttention, which keeps the [b, n, s, s] probabilities"},
     &make_local},
}};

// --- lookups shared by the tables ---------------------------------------------------------------

template <class Entry>
const Entry& find(std::span<const Entry> table, decltype(Entry::kind) kind, const char* what) {
  for (const Entry& e : table)
    if (e.kind == kind) return e;
  MT_FAIL("{} {} has no entry in its table (model/variants.cpp)", what, static_cast<int>(kind));
}

/// "a, b or c (alias)"; with descriptions "a: ...; b: ...; c (alias): ...".
template <class Entry>
std::string choices(std::span<const Entry> table, bool with_help) {
  std::string s;
  for (size_t i = 0; i < table.size(); ++i) {
    const KindName& n = table[i].names;
    if (i > 0) s += with_help ? "; " : i + 1 == table.size() ? " or " : ", ";
    s += n.name;
    if (n.alias != nullptr) s += fmt::format(" ({})", n.alias);
    if (with_help) s += fmt::format(": {}", n.help);
  }
  return s;
}

template <class Entry>
decltype(Entry::kind) parse(std::span<const Entry> table, const std::string& s, const char* flag) {
  for (const Entry& e : table)
    if (s == e.names.name || (e.names.alias != nullptr && s == e.names.alias)) return e.kind;
  MT_FAIL("{} '{}' is not supported: expected {}", flag, s, choices(table, false));
}

}  // namespace

std::span<const NormKind> norm_kinds() { return kNormKinds; }
std::span<const MlpActivationKind> mlp_activation_kinds() { return kMlpActivationKinds; }
std::span<const PositionEmbeddingKind> position_embedding_kinds() { return kPositionEmbeddingKinds; }
std::span<const AttentionBackendKind> attention_backend_kinds() { return kAttentionBackendKinds; }

const NormKind& norm_kind(Normalization n) { return find(norm_kinds(), n, "normalization"); }
const MlpActivationKind& mlp_activation_kind(MlpActivation a) {
  return find(mlp_activation_kinds(), a, "MLP activation");
}
const PositionEmbeddingKind& position_embedding_kind(PositionEmbeddingType p) {
  return find(position_embedding_kinds(), p, "position embedding type");
}
const AttentionBackendKind& attention_backend_kind(AttentionBackend a) {
  return find(attention_backend_kinds(), a, "attention backend");
}

const char* normalization_name(Normalization n) { return norm_kind(n).names.name; }
const char* mlp_activation_name(MlpActivation a) { return mlp_activation_kind(a).names.name; }
const char* position_embedding_type_name(PositionEmbeddingType p) { return position_embedding_kind(p).names.name; }
const char* attention_backend_name(AttentionBackend a) { return attention_backend_kind(a).names.name; }

Normalization parse_normalization(const std::string& s) { return parse(norm_kinds(), s, "--normalization"); }
MlpActivation parse_mlp_activation(const std::string& s) { return parse(mlp_activation_kinds(), s, "MLP activation"); }
PositionEmbeddingType parse_position_embedding_type(const std::string& s) {
  return parse(position_embedding_kinds(), s, "--position-embedding-type");
}
AttentionBackend parse_attention_backend(const std::string& s) {
  return parse(attention_backend_kinds(), s, "--attention-backend");
}

std::string normalization_help() { return choices(norm_kinds(), true); }
std::string position_embedding_type_help() { return choices(position_embedding_kinds(), true); }
std::string attention_backend_help() { return choices(attention_backend_kinds(), true); }

MlpActivation mlp_activation_of(bool gated_linear_unit) {
  return gated_linear_unit ? MlpActivation::kSwiGLU : MlpActivation::kGelu;
}

AttentionBackend resolve_attention_backend(AttentionBackend requested, int64_t head_dim, const AttentionPlatform& p) {
  const bool half = p.dtype == DType::kBF16 || p.dtype == DType::kF16;
  const bool cudnn_runs = p.cuda && half && p.cudnn;
  const bool flash_fast_path = p.cuda && half && (head_dim == 64 || head_dim == 128);
  const bool cudnn_wide_heads = cudnn_runs && p.hopper && head_dim <= 256 && head_dim % 8 == 0;
  if (requested == AttentionBackend::kAuto)
    requested = flash_fast_path || cudnn_wide_heads ? AttentionBackend::kFused : AttentionBackend::kLocal;
  if (requested == AttentionBackend::kFused && !cudnn_runs) return AttentionBackend::kFlash;
  return requested;
}

}  // namespace mt
