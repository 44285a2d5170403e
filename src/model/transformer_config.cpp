#include "model/transformer_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>

#include "core/check.h"
#include "ops/rope_math.h"

namespace mt {

MoeScoreFunction parse_moe_score_function(const std::string& s) {
  if (s == "softmax") return MoeScoreFunction::kSoftmax;
  if (s == "sigmoid") return MoeScoreFunction::kSigmoid;
  MT_FAIL("--moe-router-score-function '{}' is not supported: expected softmax or sigmoid", s);
}

MoeLoadBalancing parse_moe_load_balancing(const std::string& s) {
  if (s == "aux_loss") return MoeLoadBalancing::kAuxLoss;
  if (s == "seq_aux_loss") return MoeLoadBalancing::kSeqAuxLoss;
  if (s == "global_aux_loss") return MoeLoadBalancing::kGlobalAuxLoss;
  if (s == "none") return MoeLoadBalancing::kNone;
  if (s == "sinkhorn")
    MT_FAIL("--moe-router-load-balancing-type {} is not implemented yet: use aux_loss, seq_aux_loss, global_aux_loss "
            "or none",
            s);
  MT_FAIL("--moe-router-load-balancing-type '{}' is not supported: expected aux_loss, seq_aux_loss, global_aux_loss "
          "or none (one type or a list)",
          s);
}

const char* moe_load_balancing_loss_name(MoeLoadBalancing b) {
  switch (b) {
    case MoeLoadBalancing::kAuxLoss: return "load_balancing_loss";
    case MoeLoadBalancing::kSeqAuxLoss: return "seq_load_balancing_loss";
    case MoeLoadBalancing::kGlobalAuxLoss: return "global_load_balancing_loss";
    case MoeLoadBalancing::kNone: break;
  }
  return "none";
}

float TransformerConfig::moe_aux_coeff(MoeLoadBalancing t) const {
  if (t == MoeLoadBalancing::kNone) return 0.f;
  for (size_t i = 0; i < moe_router_load_balancing_type.size() && i < moe_aux_loss_coeff.size(); ++i)
    if (moe_router_load_balancing_type[i] == t) return moe_aux_loss_coeff[i];
  return 0.f;
}

bool TransformerConfig::moe_any_aux_loss() const {
  for (MoeLoadBalancing t : {MoeLoadBalancing::kAuxLoss, MoeLoadBalancing::kSeqAuxLoss, MoeLoadBalancing::kGlobalAuxLoss})
    if (moe_aux_loss_on(t)) return true;
  return false;
}

MoeDispatcher parse_moe_dispatcher(const std::string& s) {
  if (s == "allgather") return MoeDispatcher::kAllGather;
  if (s == "alltoall") return MoeDispatcher::kAllToAll;
  MT_FAIL("--moe-token-dispatcher-type '{}' is not supported: expected allgather or alltoall", s);
}

MoeTokenDropPolicy parse_moe_token_drop_policy(const std::string& s) {
  if (s == "probs") return MoeTokenDropPolicy::kProbs;
  if (s == "position") return MoeTokenDropPolicy::kPosition;
  MT_FAIL("--moe-token-drop-policy '{}' is not supported: expected probs or position", s);
}

RopeType parse_rope_type(const std::string& s) {
  if (s == "rope") return RopeType::kRope;
  if (s == "yarn") return RopeType::kYarn;
  MT_FAIL("--rope-type '{}' is not supported: expected rope or yarn", s);
}

const char* rope_type_name(RopeType t) { return t == RopeType::kYarn ? "yarn" : "rope"; }

RecomputeGranularity parse_recompute_granularity(const std::string& s) {
  if (s == "full") return RecomputeGranularity::kFull;
  if (s == "selective") return RecomputeGranularity::kSelective;
  MT_FAIL("--recompute-granularity '{}' is not supported: expected full or selective", s);
}

RecomputeMethod parse_recompute_method(const std::string& s) {
  if (s == "uniform") return RecomputeMethod::kUniform;
  if (s == "block") return RecomputeMethod::kBlock;
  MT_FAIL("--recompute-method '{}' is not supported: expected uniform or block", s);
}

RecomputeModules parse_recompute_modules(const std::vector<std::string>& names) {
  RecomputeModules m{false, false, false, false, false};
  for (const std::string& n : names) {
    if (n == "core_attn") {
      m.core_attn = true;
    } else if (n == "layernorm") {
      m.layernorm = true;
    } else if (n == "mlp") {
      m.mlp = true;
    } else if (n == "mlp_act") {
      m.mlp_act = true;
    } else if (n == "moe_act") {
      m.moe_act = true;
    } else if (n == "mla_up_proj") {
      m.mla_up_proj = true;
    } else if (n == "moe" || n == "shared_experts") {
      MT_FAIL("--recompute-modules {}: Megatron's {} recompute is not implemented (implemented: core_attn, layernorm, "
              "mlp, mlp_act, moe_act, mla_up_proj; --recompute-granularity full recomputes whole layers)",
              n, n);
    } else {
      MT_FAIL("--recompute-modules {}: unknown module, expected core_attn, layernorm, mlp, mlp_act, moe_act or "
              "mla_up_proj", n);
    }
  }
  return m;
}

const char* recompute_granularity_name(RecomputeGranularity g) {
  switch (g) {
    case RecomputeGranularity::kFull: return "full";
    case RecomputeGranularity::kSelective: return "selective";
    case RecomputeGranularity::kNone: break;
  }
  return "none";
}

const char* recompute_method_name(RecomputeMethod m) { return m == RecomputeMethod::kBlock ? "block" : "uniform"; }

int64_t TransformerConfig::recompute_group(int64_t index, int64_t chunk_layers) const {
  if (recompute_granularity != RecomputeGranularity::kFull || index < 0 || index >= chunk_layers) return -1;
  if (recompute_method == RecomputeMethod::kBlock) return index < recompute_num_layers ? index : -1;
  return index / recompute_num_layers;
}

const char* moe_score_function_name(MoeScoreFunction f) {
  return f == MoeScoreFunction::kSigmoid ? "sigmoid" : "softmax";
}

const char* moe_load_balancing_name(MoeLoadBalancing b) {
  switch (b) {
    case MoeLoadBalancing::kAuxLoss: return "aux_loss";
    case MoeLoadBalancing::kSeqAuxLoss: return "seq_aux_loss";
    case MoeLoadBalancing::kGlobalAuxLoss: return "global_aux_loss";
    case MoeLoadBalancing::kNone: break;
  }
  return "none";
}

namespace {
// A tiny parser for Megatron's --moe-layer-freq list expressions: sum of terms, a term is a
// bracketed list of integers optionally repeated with *n, the whole optionally in parentheses.
class LayerFreqParser {
 public:
  explicit LayerFreqParser(const std::string& t) : t_(t) {}
  std::vector<int64_t> parse() {
    std::vector<int64_t> out = sum();
    skip();
    if (i_ != t_.size()) fail();
    return out;
  }

 private:
  [[noreturn]] void fail() const {
    MT_FAIL("--moe-layer-freq '{}' does not parse at position {}: expected an integer or a list expression "
            "such as [1,0,1,0] or ([0]+[1]*23)",
            t_, i_);
  }
  void skip() {
    while (i_ < t_.size() && std::isspace(static_cast<unsigned char>(t_[i_]))) ++i_;
  }
  bool eat(char c) {
    skip();
    if (i_ < t_.size() && t_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  int64_t number() {
    skip();
    const size_t b = i_;
    while (i_ < t_.size() && std::isdigit(static_cast<unsigned char>(t_[i_]))) ++i_;
    if (b == i_ || i_ - b > 9) fail();
    return std::stoll(t_.substr(b, i_ - b));
  }
  std::vector<int64_t> sum() {
    std::vector<int64_t> out = term();
    while (eat('+')) {
      const std::vector<int64_t> more = term();
      out.insert(out.end(), more.begin(), more.end());
    }
    return out;
  }
  std::vector<int64_t> term() {
    std::vector<int64_t> base;
    if (eat('(')) {
      base = sum();
      if (!eat(')')) fail();
    } else if (eat('[')) {
      if (!eat(']')) {
        do base.push_back(number());
        while (eat(','));
        if (!eat(']')) fail();
      }
    } else {
      fail();
    }
    if (eat('*')) {
      const int64_t n = number();
      if (n > 100000) fail();
      std::vector<int64_t> rep;
      for (int64_t r = 0; r < n; ++r) rep.insert(rep.end(), base.begin(), base.end());
      return rep;
    }
    return base;
  }
  const std::string& t_;
  size_t i_ = 0;
};
}  // namespace

std::vector<uint8_t> parse_moe_layer_freq(const std::string& text, int64_t num_layers) {
  std::string t = text;
  t.erase(std::remove_if(t.begin(), t.end(), [](unsigned char c) { return std::isspace(c); }), t.end());
  MT_REQUIRE(!t.empty(), "--moe-layer-freq is empty: expected an integer or a list expression");
  std::vector<uint8_t> out;
  if (std::all_of(t.begin(), t.end(), [](unsigned char c) { return std::isdigit(c); })) {
    MT_REQUIRE(t.size() <= 9, "--moe-layer-freq {} is too large", t);
    const int64_t k = std::stoll(t);
    MT_REQUIRE(k >= 1, "--moe-layer-freq must be >= 1, got {}", k);
    for (int64_t i = 0; i < num_layers; ++i) out.push_back(i % k == 0 ? 1 : 0);
    return out;
  }
  const std::vector<int64_t> v = LayerFreqParser(t).parse();
  MT_REQUIRE(static_cast<int64_t>(v.size()) == num_layers,
             "--moe-layer-freq {} gives {} entries but --num-layers is {}", text, v.size(), num_layers);
  for (size_t i = 0; i < v.size(); ++i) {
    MT_REQUIRE(v[i] == 0 || v[i] == 1, "--moe-layer-freq {}: entry {} is {}, expected 0 (dense) or 1 (MoE)", text, i,
               v[i]);
    out.push_back(static_cast<uint8_t>(v[i]));
  }
  return out;
}

bool TransformerConfig::is_moe_layer(int64_t layer) const {
  if (num_moe_experts <= 0) return false;
  if (moe_layer_pattern.empty()) return true;
  if (layer >= num_layers && layer < num_layers_with_mtp()) layer = num_layers - 1;  // an MTP layer: the last one's kind
  return layer >= 0 && layer < static_cast<int64_t>(moe_layer_pattern.size()) &&
         moe_layer_pattern[static_cast<size_t>(layer)] != 0;
}

int64_t TransformerConfig::num_moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers; ++l) n += is_moe_layer(l) ? 1 : 0;
  return n;
}

int64_t TransformerConfig::ffn() const {
  if (ffn_hidden_size > 0) return ffn_hidden_size;
  return mlp_activation_kind(activation()).default_ffn(hidden_size);
}

int64_t TransformerConfig::head_dim() const {
  if (multi_latent_attention) return std::max(q_head_dim(), v_head_dim);
  return kv_channels > 0 ? kv_channels : hidden_size / num_attention_heads;
}

float TransformerConfig::softmax_scale() const {
  if (!multi_latent_attention) return 1.0f / std::sqrt(static_cast<float>(head_dim()));
  const double m = rope_math::yarn_get_mscale(rotary_scaling_factor, mscale_all_dim);
  return static_cast<float>(m * m / std::sqrt(static_cast<double>(q_head_dim())));
}

int64_t TransformerConfig::rotary_dim() const {
  if (multi_latent_attention) return qk_pos_emb_head_dim;
  const int64_t r = static_cast<int64_t>(static_cast<double>(head_dim()) * rotary_percent);
  return r - r % 2;
}

int64_t TransformerConfig::padded_vocab_size(int tp) const {
  const int64_t m = make_vocab_size_divisible_by * tp;
  return (vocab_size + m - 1) / m * m;
}

void TransformerConfig::validate_moe_comm_overlap() const {
  // Megatron-Core's rules (TransformerConfig.__post_init__), and this implementation's: the chunked
  // exchange and the fused permutation are those of the dropless alltoall dispatcher.
  const bool a2a = moe_token_dispatcher_type == MoeDispatcher::kAllToAll;
  const bool dropless_a2a = a2a && moe_received_token_capacity == 0;
  MT_REQUIRE(!moe_shared_expert_overlap || moe_shared_expert_intermediate_size > 0,
             "--moe-shared-expert-overlap needs shared experts (--moe-shared-expert-intermediate-size > 0, got {})",
             moe_shared_expert_intermediate_size);
  MT_REQUIRE(!overlap_moe_expert_parallel_comm || dropless_a2a,
             "--overlap-moe-expert-parallel-comm needs --moe-token-dispatcher-type alltoall without "
             "--moe-received-token-capacity (got {}, capacity {}): the exchange is chunked by the host split sizes",
             a2a ? "alltoall" : "allgather", moe_received_token_capacity);
  MT_REQUIRE(!delay_wgrad_compute || overlap_moe_expert_parallel_comm,
             "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (the weight gradients wait for the "
             "chunked exchange)");
  MT_REQUIRE(!moe_permute_fusion || dropless_a2a,
             "--moe-permute-fusion needs --moe-token-dispatcher-type alltoall without --moe-received-token-capacity "
             "(got {}, capacity {}): it fuses that dispatcher's permutation 2 into its exchanges",
             a2a ? "alltoall" : "allgather", moe_received_token_capacity);
}

namespace {
/// The --multi-latent-attention rules (part of TransformerConfig::validate; docs/mla.md).
void validate_mla(const TransformerConfig& c) {
  const RecomputeModules rm = c.selective_recompute();
  if (!c.multi_latent_attention) {
    MT_REQUIRE(!rm.mla_up_proj, "--recompute-modules mla_up_proj needs --multi-latent-attention");
    MT_REQUIRE(!c.rope_type_set, "--rope-type {} applies only to --multi-latent-attention (standard attention takes "
               "--position-embedding-type rope)", rope_type_name(c.rope_type));
    return;
  }
  MT_REQUIRE(c.q_lora_rank >= 0, "--q-lora-rank must be positive (or absent: a full query projection), got {}",
             c.q_lora_rank);
  MT_REQUIRE(c.kv_lora_rank > 0, "--kv-lora-rank must be positive, got {}", c.kv_lora_rank);
  MT_REQUIRE(c.qk_head_dim > 0, "--qk-head-dim must be positive, got {}", c.qk_head_dim);
  MT_REQUIRE(c.qk_pos_emb_head_dim >= 2 && c.qk_pos_emb_head_dim % 2 == 0,
             "--qk-pos-emb-head-dim must be even and >= 2 (RoPE rotates channel pairs), got {}",
             c.qk_pos_emb_head_dim);
  MT_REQUIRE(c.v_head_dim > 0, "--v-head-dim must be positive, got {}", c.v_head_dim);
  MT_REQUIRE(position_embedding_kind(c.position_embedding_type).rotary,
             "--multi-latent-attention needs --position-embedding-type rope (its decoupled RoPE), got {}",
             position_embedding_type_name(c.position_embedding_type));
  MT_REQUIRE(c.num_query_groups == 0 || c.num_query_groups == c.num_attention_heads,
             "--multi-latent-attention gives every head its own key and value: --num-query-groups {} (grouped-query "
             "attention) is mutually exclusive with it",
             c.num_query_groups);
  MT_REQUIRE(c.kv_channels == 0,
             "--kv-channels {} with --multi-latent-attention: the head dims are --qk-head-dim, --qk-pos-emb-head-dim "
             "and --v-head-dim",
             c.kv_channels);
  MT_REQUIRE(c.rotary_percent == 1.f, "--rotary-percent {} with --multi-latent-attention: MLA rotates all "
             "--qk-pos-emb-head-dim channels and none of the others", c.rotary_percent);
  MT_REQUIRE(!c.rotary_interleaved, "--rotary-interleaved with --multi-latent-attention: MLA rotates the channel "
             "pairs (2i, 2i+1) of its --qk-pos-emb-head-dim channels always (DeepSeek-V3)");
  MT_REQUIRE(!c.qk_layernorm, "--qk-layernorm with --multi-latent-attention is not built (MLA normalises its "
             "latents: q_layernorm, kv_layernorm)");
  MT_REQUIRE(!c.add_qkv_bias, "--add-qkv-bias with --multi-latent-attention: MLA's projections have no bias");
  MT_REQUIRE(c.fp8 == Fp8Format::kNone, "--fp8-format with --multi-latent-attention is not built (docs/mla.md)");
  MT_REQUIRE(!rm.layernorm, "--recompute-modules layernorm with --multi-latent-attention is not built (use "
             "mla_up_proj, core_attn or --recompute-granularity full)");
  MT_REQUIRE(c.rotary_scaling_factor > 0 && std::isfinite(c.rotary_scaling_factor),
             "--rotary-scaling-factor must be positive, got {}", c.rotary_scaling_factor);
  MT_REQUIRE(std::isfinite(c.mscale) && std::isfinite(c.mscale_all_dim) && c.mscale >= 0 && c.mscale_all_dim >= 0,
             "--mscale {} and --mscale-all-dim {} must be finite and >= 0", c.mscale, c.mscale_all_dim);
  if (c.rope_type == RopeType::kYarn) {
    MT_REQUIRE(c.original_max_position_embeddings > 0,
               "--yarn-original-max-position-embeddings must be positive, got {}", c.original_max_position_embeddings);
    MT_REQUIRE(c.beta_slow > 0 && c.beta_fast > c.beta_slow,
               "--yarn-beta-fast {} must exceed --yarn-beta-slow {} > 0", c.beta_fast, c.beta_slow);
  }
}
}  // namespace

void TransformerConfig::validate_mtp() const {
  MT_REQUIRE(mtp_num_layers >= 0, "--mtp-num-layers must be >= 0, got {}", mtp_num_layers);
  MT_REQUIRE(std::isfinite(mtp_loss_scaling_factor) && mtp_loss_scaling_factor >= 0,
             "--mtp-loss-scaling-factor must be a finite number >= 0, got {}", mtp_loss_scaling_factor);
  if (mtp_num_layers == 0) return;
  MT_REQUIRE(!position_embedding_kind(position_embedding_type).learned_table,
             "--mtp-num-layers {} with --position-embedding-type {} is not supported (as in Megatron: multi-token "
             "prediction needs rope or none)",
             mtp_num_layers, position_embedding_type_name(position_embedding_type));
  MT_REQUIRE(fp8 == Fp8Format::kNone,
             "--mtp-num-layers {} with --fp8-format {} is not supported yet (the MTP layers have no FP8 GEMMs)",
             mtp_num_layers, fp8_format_name(fp8));
}

void TransformerConfig::validate(int tp) const {
  MT_REQUIRE(num_layers > 0, "--num-layers must be positive, got {}", num_layers);
  MT_REQUIRE(hidden_size > 0, "--hidden-size must be positive, got {}", hidden_size);
  MT_REQUIRE(num_attention_heads > 0, "--num-attention-heads must be positive, got {}", num_attention_heads);
  MT_REQUIRE(kv_channels >= 0, "--kv-channels must be positive, got {}", kv_channels);
  validate_mla(*this);
  MT_REQUIRE(multi_latent_attention || kv_channels > 0 || hidden_size % num_attention_heads == 0,
             "--hidden-size {} is not divisible by --num-attention-heads {} (give --kv-channels for another head "
             "size)",
             hidden_size, num_attention_heads);
  MT_REQUIRE(num_query_groups >= 0, "--num-query-groups must be positive, got {}", num_query_groups);
  MT_REQUIRE(num_attention_heads % query_groups() == 0,
             "--num-attention-heads {} is not divisible by --num-query-groups {}", num_attention_heads,
             query_groups());
  MT_REQUIRE(seq_length > 0, "--seq-length must be positive, got {}", seq_length);
  const PositionEmbeddingKind& positions = position_embedding_kind(position_embedding_type);
  MT_REQUIRE(!positions.learned_table || seq_length <= max_positions(),
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
  if (positions.rotary) {
    MT_REQUIRE(rotary_percent > 0 && rotary_percent <= 1, "--rotary-percent must be in (0, 1], got {}",
               rotary_percent);
    MT_REQUIRE(rotary_dim() >= 2, "--rotary-percent {} of head dim {} leaves fewer than 2 rotary channels",
               rotary_percent, head_dim());
    MT_REQUIRE(rotary_base > 0, "--rotary-base must be positive, got {}", rotary_base);
  }
  if (qk_layernorm && !norm_kind(normalization).strided_rows) {  // the q/k heads are strided rows of the QKV tensor
    std::vector<std::string> ok;
    for (const NormKind& k : norm_kinds())
      if (k.strided_rows) ok.push_back(k.names.name);
    MT_FAIL("--qk-layernorm is implemented with --normalization {} only (got {})", fmt::join(ok, " or "),
            normalization_name(normalization));
  }
  MT_REQUIRE(tp >= 1, "tensor parallel size must be >= 1, got {}", tp);
  MT_REQUIRE(num_attention_heads % tp == 0, "--num-attention-heads {} is not divisible by tensor parallel size {}",
             num_attention_heads, tp);
  MT_REQUIRE(query_groups() % tp == 0, "--num-query-groups {} is not divisible by tensor parallel size {}",
             query_groups(), tp);
  MT_REQUIRE(ffn() % tp == 0, "--ffn-hidden-size {} is not divisible by tensor parallel size {}", ffn(), tp);
  // Megatron-Core TransformerConfig.__post_init__'s recompute rules
  const bool full = recompute_granularity == RecomputeGranularity::kFull;
  MT_REQUIRE(full || !recompute_method_set, "--recompute-method {} needs --recompute-granularity full (got {})",
             recompute_method_name(recompute_method), recompute_granularity_name(recompute_granularity));
  MT_REQUIRE(full || recompute_num_layers == 0, "--recompute-num-layers {} needs --recompute-granularity full (got {})",
             recompute_num_layers, recompute_granularity_name(recompute_granularity));
  MT_REQUIRE(!full || recompute_method_set,
             "--recompute-granularity full needs --recompute-method uniform or block");
  MT_REQUIRE(!recompute_modules_set || recompute_granularity == RecomputeGranularity::kSelective,
             "--recompute-modules needs --recompute-granularity selective (got {})",
             recompute_granularity_name(recompute_granularity));
  MT_REQUIRE(!full || recompute_num_layers >= 1,
             "--recompute-granularity full needs --recompute-num-layers >= 1, got {}", recompute_num_layers);
  MT_REQUIRE(!full || recompute_method != RecomputeMethod::kUniform || recompute_num_layers <= num_layers,
             "--recompute-num-layers {} exceeds --num-layers {} (--recompute-method uniform)", recompute_num_layers,
             num_layers);
  validate_mtp();
  if (fp8 != Fp8Format::kNone) {  // docs/fp8.md
    MT_REQUIRE(fp8_amax_history_len >= 1, "--fp8-amax-history-len must be >= 1, got {}", fp8_amax_history_len);
    MT_REQUIRE(fp8_margin >= 0, "--fp8-margin must be >= 0, got {}", fp8_margin);
    MT_REQUIRE(num_layers_at_start_in_bf16 >= 0 && num_layers_at_end_in_bf16 >= 0,
               "--num-layers-at-start-in-bf16 {} and --num-layers-at-end-in-bf16 {} must be >= 0",
               num_layers_at_start_in_bf16, num_layers_at_end_in_bf16);
    MT_REQUIRE(num_moe_experts == 0 || !moe_grouped_gemm || fp8_recipe != Fp8Recipe::kBlockwise,
               "--fp8-recipe blockwise with --moe-grouped-gemm is not supported: the grouped expert GEMM takes "
               "tensorwise scales (one per expert); use --fp8-recipe tensorwise or delayed, or drop "
               "--moe-grouped-gemm (the per-expert path runs blockwise)");
    MT_REQUIRE(num_moe_experts == 0 || !moe_grouped_gemm || !overlap_moe_expert_parallel_comm,
               "--fp8-format {} with --moe-grouped-gemm and --overlap-moe-expert-parallel-comm is not supported: "
               "the grouped FP8 experts run every expert at once, not the pipeline's chunks",
               fp8_format_name(fp8));
    MT_REQUIRE(num_moe_experts == 0 || !moe_enable_echo,
               "--fp8-format {} with --moe-enable-echo is not supported (the expert clones have no FP8 weights)",
               fp8_format_name(fp8));
    MT_REQUIRE(!delay_wgrad_compute,
               "--fp8-format {} with --delay-wgrad-compute is not supported: an FP8 expert's weight gradient is "
               "computed with its input gradient (the quantised dy is not kept for a later pass)",
               fp8_format_name(fp8));
  }
  if (num_moe_experts > 0) validate_moe();
}

void TransformerConfig::validate_moe() const {
  const bool full = recompute_granularity == RecomputeGranularity::kFull;
  MT_REQUIRE(!full || !moe_aux_loss_on(MoeLoadBalancing::kGlobalAuxLoss),
             "--moe-router-load-balancing-type global_aux_loss with --recompute-granularity full is not supported: "
             "its token counts accumulate over the step's forwards, so a recomputed forward would see other counts");
  const int64_t E = num_moe_experts, k = moe_router_topk;
  MT_REQUIRE(E > 0, "--num-experts must be positive, got {}", E);
  MT_REQUIRE(k >= 1 && k <= E, "--moe-router-topk {} must be in [1, --num-experts {}]", k, E);
  MT_REQUIRE(moe_ffn_hidden_size >= 0, "--moe-ffn-hidden-size must be positive, got {}", moe_ffn_hidden_size);
  MT_REQUIRE(moe_shared_expert_intermediate_size >= 0, "--moe-shared-expert-intermediate-size must be positive, got {}",
             moe_shared_expert_intermediate_size);
  MT_REQUIRE(moe_layer_pattern.empty() || static_cast<int64_t>(moe_layer_pattern.size()) == num_layers,
             "--moe-layer-freq gives {} layers but --num-layers is {}", moe_layer_pattern.size(), num_layers);
  MT_REQUIRE(moe_router_num_groups >= 0 && moe_router_group_topk >= 0,
             "--moe-router-num-groups {} and --moe-router-group-topk {} must be >= 0", moe_router_num_groups,
             moe_router_group_topk);
  MT_REQUIRE((moe_router_num_groups > 0) == (moe_router_group_topk > 0),
             "--moe-router-group-topk {} needs --moe-router-num-groups (got {}) and the other way round",
             moe_router_group_topk, moe_router_num_groups);
  if (moe_router_num_groups > 0) {
    const int64_t G = moe_router_num_groups, gk = moe_router_group_topk;
    MT_REQUIRE(E % G == 0, "--num-experts {} is not divisible by --moe-router-num-groups {}", E, G);
    MT_REQUIRE(gk <= G, "--moe-router-group-topk {} exceeds --moe-router-num-groups {}", gk, G);
    MT_REQUIRE(k % gk == 0 && k / gk <= E / G,
               "--moe-router-topk {} must be a multiple of --moe-router-group-topk {} with at most {} experts per "
               "group (the {} experts of each of {} groups)",
               k, gk, E / G, E / G, G);
  }
  MT_REQUIRE(!moe_shared_expert_gate || moe_shared_expert_intermediate_size > 0,
             "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size > 0 (a shared expert to gate), got {}",
             moe_shared_expert_intermediate_size);
  MT_REQUIRE(moe_router_dtype == DType::kF32 || moe_router_dtype == DType::kF64,
             "--moe-router-dtype {} is not supported: expected fp32 or fp64", dtype_name(moe_router_dtype));
  MT_REQUIRE(!moe_router_force_load_balancing || moe_router_dtype == DType::kF32,
             "--moe-router-force-load-balancing with --moe-router-dtype fp64 is not supported: the random logits are "
             "drawn in fp32 (use --moe-router-dtype fp32)");
  MT_REQUIRE(moe_router_topk_scaling_factor > 0, "--moe-router-topk-scaling-factor must be positive, got {}",
             moe_router_topk_scaling_factor);
  validate_moe_comm_overlap();
  {  // Megatron's list of load-balancing types: one coefficient per type, in the same order
    std::vector<std::string> types;
    for (MoeLoadBalancing t : moe_router_load_balancing_type) types.push_back(moe_load_balancing_name(t));
    const std::string tl = fmt::format("{}", fmt::join(types, " ")),
                      cl = fmt::format("{}", fmt::join(moe_aux_loss_coeff, " "));
    MT_REQUIRE(!types.empty(), "--moe-router-load-balancing-type needs at least one type");
    MT_REQUIRE(moe_aux_loss_coeff.size() == types.size(),
               "--moe-aux-loss-coeff gives {} coefficient(s) ({}) but --moe-router-load-balancing-type gives {} "
               "type(s) ({}): expected one coefficient per type, in the same order",
               moe_aux_loss_coeff.size(), cl, types.size(), tl);
    for (size_t i = 0; i < types.size(); ++i) {
      MT_REQUIRE(moe_aux_loss_coeff[i] >= 0, "--moe-aux-loss-coeff must be >= 0, got {} (for {})",
                 moe_aux_loss_coeff[i], types[i]);
      for (size_t j = 0; j < i; ++j)
        MT_REQUIRE(types[j] != types[i], "--moe-router-load-balancing-type {} lists {} twice", tl, types[i]);
    }
  }
  MT_REQUIRE(moe_z_loss_coeff >= 0, "--moe-z-loss-coeff must be >= 0, got {}", moe_z_loss_coeff);
  MT_REQUIRE(!moe_router_enable_expert_bias || moe_router_score_function == MoeScoreFunction::kSigmoid,
             "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as Megatron: the bias "
             "shifts the sigmoid scores for the selection only)");
  MT_REQUIRE(moe_router_bias_update_rate >= 0, "--moe-router-bias-update-rate must be >= 0, got {}",
             moe_router_bias_update_rate);
  MT_REQUIRE(!moe_router_pre_softmax || moe_router_score_function == MoeScoreFunction::kSoftmax,
             "--moe-router-pre-softmax applies to --moe-router-score-function softmax only");
  MT_REQUIRE(!moe_expert_capacity_set || (moe_expert_capacity_factor > 0 && std::isfinite(moe_expert_capacity_factor)),
             "--moe-expert-capacity-factor must be a positive number, got {}", moe_expert_capacity_factor);
  MT_REQUIRE(!moe_pad_expert_input_to_capacity || moe_expert_capacity_set,
             "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor");
  MT_REQUIRE(moe_num_echo_experts >= 0, "--moe-num-echo-experts must be >= 0, got {}", moe_num_echo_experts);
  MT_REQUIRE(!moe_enable_echo || moe_num_echo_experts >= 1,
             "--moe-enable-echo needs --moe-num-echo-experts >= 1 (spare expert slots per EP rank), got {}",
             moe_num_echo_experts);
  MT_REQUIRE(moe_received_token_capacity >= 0, "--moe-received-token-capacity must be >= 0, got {}",
             moe_received_token_capacity);
  MT_REQUIRE(moe_received_token_capacity == 0 || moe_token_dispatcher_type == MoeDispatcher::kAllToAll,
             "--moe-received-token-capacity needs --moe-token-dispatcher-type alltoall");
  MT_REQUIRE(moe_received_token_capacity == 0 || moe_grouped_gemm,
             "--moe-received-token-capacity needs --moe-grouped-gemm (the experts read the received counts on the "
             "device)");
  MT_REQUIRE(!moe_enable_echo || moe_token_dispatcher_type == MoeDispatcher::kAllToAll,
             "--moe-enable-echo needs --moe-token-dispatcher-type alltoall (the clones are reached by the "
             "all-to-all over EP)");
  MT_REQUIRE(!add_bias_linear,
             "MoE experts with biases are not supported: pass --disable-bias-linear (Mixtral, Qwen MoE and "
             "DeepSeek models have none)");
}

int64_t TransformerConfig::num_parameters(int tp) const {
  const int64_t h = hidden_size, f = ffn(), V = padded_vocab_size(tp), n = num_attention_heads, d = head_dim();
  const int64_t g = query_groups(), qkv_out = (n + 2 * g) * d;
  const int64_t norm = norm_kind(normalization).params_per_channel();  // weight (+ bias)
  const int64_t bias = add_bias_linear ? 1 : 0;
  int64_t per_layer = 2 * norm * h;                                    // input and pre-MLP norms
  if (multi_latent_attention) {  // model/layers/mla_attention.h
    const int64_t rq = q_lora_rank, rkv = kv_lora_rank, dq = q_head_dim();
    per_layer += rq > 0 ? h * rq + norm * rq + rq * n * dq : h * n * dq;                 // query path
    per_layer += h * (rkv + qk_pos_emb_head_dim) + norm * rkv + rkv * n * (qk_head_dim + v_head_dim);  // kv
    per_layer += h * n * v_head_dim + bias * h;                                          // linear_proj
  } else {
    per_layer += qkv_out * h + (qkv_bias() ? qkv_out : 0);                // linear_qkv
    per_layer += qk_layernorm ? 2 * norm * d : 0;                        // q/k layernorm
    per_layer += h * n * d + bias * h;                                   // linear_proj
  }
  const int64_t glu = mlp_activation_kind(activation()).fc1_parts;
  const int64_t dense_mlp = glu * f * (h + bias) + f * h + bias * h;  // linear_fc1, linear_fc2
  const int64_t moe_mlp = num_moe_experts * h                                      // router
                          + num_moe_experts * (glu * moe_ffn() * h + moe_ffn() * h)  // experts (no bias)
                          + glu * moe_shared_expert_intermediate_size * h + moe_shared_expert_intermediate_size * h
                          + (moe_shared_expert_gate ? h : 0);  // the shared expert's gate [1, h]
  const int64_t L_moe = num_moe_layers();
  int64_t total = V * h + num_layers * per_layer + (num_layers - L_moe) * dense_mlp + L_moe * moe_mlp + norm * h;
  if (position_embedding_kind(position_embedding_type).learned_table) total += max_positions() * h;
  if (untie_embeddings_and_output_weights) total += V * h;
  // MTP depths: enorm, hnorm, final_layernorm, eh_proj [h, 2h] and a layer of the last layer's kind
  // (the embedding and the output layer are shared)
  total += mtp_num_layers * (3 * norm * h + 2 * h * h + per_layer + (is_moe_layer(num_layers - 1) ? moe_mlp : dense_mlp));
  return total;
}

double TransformerConfig::flops_per_iteration(int64_t global_batch, int tp) const {
  // Megatron-Core's transformer_flops: per token, 3 GEMMs (forward, dgrad, wgrad) × 2 FLOPs per
  // multiply-add × the sizes of the GEMMs a token goes through.
  const double B = static_cast<double>(global_batch), s = static_cast<double>(seq_length);
  double L = static_cast<double>(num_layers);
  const double h = static_cast<double>(hidden_size);
  const double V = static_cast<double>(padded_vocab_size(tp));
  const double q = static_cast<double>(num_attention_heads * head_dim());  // n·d
  const double kv = static_cast<double>(query_groups() * head_dim());     // g·d
  // linear_qkv, QKᵀ and PV (n·d·s each, halved by the causal mask), linear_proj
  double attention = h * (q + 2.0 * kv) + q * s + q * h;
  if (multi_latent_attention) attention = mla_flops_per_token();
  // fc1 + fc2: 2·f·h, 3·f·h with SwiGLU (fc1 is 2f wide; the activation's flops_factor 3/2);
  // MoE layers: the top-k routed experts and the shared experts (the router GEMM is not counted)
  const double ffn_factor = 2.0 * mlp_activation_kind(activation()).flops_factor;
  // MTP (Megatron's num_floating_point_operations): D more layers of the last layer's kind
  const double D = static_cast<double>(mtp_num_layers);
  const double L_moe = static_cast<double>(num_moe_layers()) + (is_moe_layer(num_layers - 1) ? D : 0.0);
  L += D;
  const double F = static_cast<double>(ffn()) * (L - L_moe) +
                   (static_cast<double>(moe_ffn()) * static_cast<double>(moe_router_topk) +
                    static_cast<double>(moe_shared_expert_intermediate_size)) *
                       L_moe;
  // the MTP norms (enorm, hnorm, final_layernorm: 3h) and eh_proj (2h²); the LM head D + 1 times
  return 6.0 * B * s * (L * attention + h * F * ffn_factor + D * (3.0 * h + 2.0 * h * h) + h * V * (D + 1.0));
}

double TransformerConfig::mla_flops_per_token() const {
  const double h = static_cast<double>(hidden_size), n = static_cast<double>(num_attention_heads);
  const double s = static_cast<double>(seq_length), dq = static_cast<double>(q_head_dim());
  const double dv = static_cast<double>(v_head_dim), rq = static_cast<double>(q_lora_rank);
  const double rkv = static_cast<double>(kv_lora_rank), dr = static_cast<double>(qk_pos_emb_head_dim);
  const double dn = static_cast<double>(qk_head_dim);
  const double q_term = q_lora_rank > 0 ? rq * (h + n * dq + 1.0) : h * n * dq;
  const double kv_term = rkv * (h + n * (dn + dv) + 1.0) + h * dr;
  return q_term + kv_term + n * dv * h + s * (n * dq / 2.0 + n * dv / 2.0);
}

bool TransformerConfig::fp8_layer(int64_t layer) const {
  if (fp8 == Fp8Format::kNone) return false;
  if (!first_last_layers_bf16) return true;
  return layer >= num_layers_at_start_in_bf16 && layer < num_layers - num_layers_at_end_in_bf16;
}

std::string TransformerConfig::summary() const {
  std::string s = fmt::format("{} layers, hidden {}, heads {}", num_layers, hidden_size, num_attention_heads);
  if (query_groups() != num_attention_heads) s += fmt::format(" ({} query groups)", query_groups());
  if (!multi_latent_attention && head_dim() * num_attention_heads != hidden_size)  // MLA names its head dims
    s += fmt::format(", kv channels {}", head_dim());
  // The GPT-2 defaults are not named (GELU), the other activations are: "ffn 704 (SwiGLU)".
  const MlpActivation act = activation();
  s += fmt::format(", ffn {}{}, {}, {} positions", ffn(),
                   act == MlpActivation::kGelu ? std::string() : fmt::format(" ({})", mlp_activation_name(act)),
                   normalization_name(normalization), position_embedding_type_name(position_embedding_type));
  if (!add_bias_linear) s += add_qkv_bias ? ", QKV bias only" : ", no bias";
  if (qk_layernorm) s += ", QK-norm";
  if (multi_latent_attention)
    s += fmt::format(", MLA (q-lora {}, kv-lora {}, qk {}+{}, v {}, {})", q_lora_rank > 0 ? fmt::format("{}", q_lora_rank)
                     : std::string("none"), kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim,
                     rope_type == RopeType::kYarn ? fmt::format("yarn x{}", rotary_scaling_factor) : std::string("rope"));
  if (layernorm_zero_centered_gamma) s += ", zero-centred norm weights (--apply-layernorm-1p)";
  if (untie_embeddings_and_output_weights) s += ", untied output layer";
  if (deterministic_mode) s += ", deterministic mode";
  if (mtp_num_layers > 0)
    s += fmt::format(", multi-token prediction: {} depth(s), loss scale {}", mtp_num_layers, mtp_loss_scaling_factor);
  if (fp8 != Fp8Format::kNone) {
    s += ", FP8 " + fp8_settings().summary();
    if (first_last_layers_bf16)
      s += fmt::format(" (first {} / last {} layers bf16)", num_layers_at_start_in_bf16, num_layers_at_end_in_bf16);
  }
  if (recompute_granularity == RecomputeGranularity::kSelective) {
    const RecomputeModules& r = recompute_modules;
    std::string mods;
    for (const auto& [on, name] : {std::pair{r.core_attn, "core_attn"}, {r.layernorm, "layernorm"}, {r.mlp, "mlp"},
                                   {r.mlp_act, "mlp_act"}, {r.moe_act, "moe_act"},
                                   {r.mla_up_proj, "mla_up_proj"}})
      if (on) mods += std::string(mods.empty() ? "" : " ") + name;
    s += fmt::format(", selective recompute ({})", mods.empty() ? "nothing" : mods);
  }
  if (recompute_granularity == RecomputeGranularity::kFull)
    s += fmt::format(", full recompute ({} {})", recompute_method_name(recompute_method), recompute_num_layers);
  if (num_moe_experts > 0) {
    s += fmt::format(", MoE in {} of {} layers: {} experts, top-{} {} router, expert ffn {}", num_moe_layers(),
                     num_layers, num_moe_experts, moe_router_topk,
                     moe_score_function_name(moe_router_score_function), moe_ffn());
    if (moe_shared_expert_intermediate_size > 0)
      s += fmt::format(", {}shared expert {}", moe_shared_expert_gate ? "gated " : "", moe_shared_expert_intermediate_size);
    if (moe_router_num_groups > 0)
      s += fmt::format(", {} of {} expert groups", moe_router_group_topk, moe_router_num_groups);
    if (moe_router_enable_expert_bias) s += fmt::format(", expert bias (rate {})", moe_router_bias_update_rate);
    for (MoeLoadBalancing t : moe_router_load_balancing_type)
      if (moe_aux_loss_on(t)) s += fmt::format(", {} {}", moe_load_balancing_name(t), moe_aux_coeff(t));
    if (moe_router_force_load_balancing) s += ", forced balance (random logits)";
    if (moe_token_dispatcher_type == MoeDispatcher::kAllToAll) s += ", alltoall token dispatcher";
    if (moe_grouped_gemm) s += ", grouped GEMM";
    if (moe_received_token_capacity > 0)
      s += fmt::format(", static receive buffers of {} tokens per EP rank", moe_received_token_capacity);
    if (moe_enable_echo) s += fmt::format(", ECHO with {} spare expert slots per EP rank", moe_num_echo_experts);
    if (moe_shared_expert_overlap) s += ", shared experts beside the exchange";
    if (overlap_moe_expert_parallel_comm)
      s += delay_wgrad_compute ? ", chunked exchange beside the experts (weight gradients delayed)"
                               : ", chunked exchange beside the experts";
    if (moe_permute_fusion) s += ", permutation fused into the exchange";
    if (moe_expert_capacity_set)
      s += fmt::format(", expert capacity factor {} (drop by {})", moe_expert_capacity_factor,
                       moe_token_drop_policy == MoeTokenDropPolicy::kProbs ? "probs" : "position");
  }
  return s;
}

}  // namespace mt
