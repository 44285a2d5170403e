// Model configuration: Megatron-Core's TransformerConfig (megatron/core/transformer/
// transformer_config.py) for the decoder-only language models megatron.cpp builds, with
// Megatron-LM's field and flag names. One struct describes GPT-2 (the defaults: LayerNorm, learned
// absolute positions, biases, GELU MLP, tied embeddings) and the Llama / Qwen / Mistral family
// (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases, untied output layer, QK-norm).
// Validated once (validate), with messages that print every offending value. docs/architecture.md
// describes how the layer specs (model/specs.h) turn it into modules; the kinds of norm,
// activation, position embedding and core attention are entries of model/variants.h.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "model/fp8/fp8_recipe.h"
#include "model/variants.h"

namespace mt {

/// --moe-router-score-function
enum class MoeScoreFunction : uint8_t { kSoftmax, kSigmoid };
/// --moe-router-load-balancing-type (the auxiliary losses of Megatron-Core's TopKRouter; one type or
/// a list of several, each with its coefficient)
enum class MoeLoadBalancing : uint8_t { kAuxLoss, kSeqAuxLoss, kGlobalAuxLoss, kNone };
/// The per-layer MoE statistics (MoELayer::stats, GPTModel::moe_loss_stats): the loss of each
/// load-balancing type at index static_cast<int>(type) (aux_loss 0, seq_aux_loss 1,
/// global_aux_loss 2), the z-loss at kMoeStatZLoss, then the E token counts from kMoeStatLosses.
inline constexpr int kMoeStatZLoss = 3;
inline constexpr int kMoeStatLosses = 4;
/// --moe-token-dispatcher-type
enum class MoeDispatcher : uint8_t { kAllGather, kAllToAll };
/// --moe-token-drop-policy: which slots beyond an expert's capacity are dropped
enum class MoeTokenDropPolicy : uint8_t { kProbs, kPosition };
/// --recompute-granularity (Megatron-Core TransformerConfig.recompute_granularity; Korthikanti et
/// al. 2022, "Reducing Activation Recomputation in Large Transformer Models"): kNone keeps every
/// activation; kSelective recomputes the core attention in the backward (the [b, n, s, s]
/// probabilities of the local attention are not stored; flash attention stores none, so there it
/// changes nothing); kFull keeps only the input of each recomputed group of layers and re-runs the
/// group's forward before its backward.
enum class RecomputeGranularity : uint8_t { kNone, kSelective, kFull };
/// --recompute-method (with full granularity): kUniform = every layer of a chunk, in consecutive
/// groups of --recompute-num-layers (the last group may be shorter); kBlock = the first
/// --recompute-num-layers layers of each chunk, each on its own, the rest not recomputed.
enum class RecomputeMethod : uint8_t { kUniform, kBlock };
/// --recompute-modules with --recompute-granularity selective (Megatron-Core
/// TransformerConfig.recompute_modules; default core_attn). What each drops from the saved
/// tensors and recomputes in the backward (docs/flags.md "Activation recompute"):
struct RecomputeModules {
  /// "core_attn": the local attention's q, k, v and [b, n, s, s] probabilities (flash attention
  /// saves none of them: nothing changes).
  bool core_attn = true;
  /// "layernorm": the outputs of input_layernorm (every layer) and pre_mlp_layernorm (dense
  /// layers; an MoE layer keeps its input, which its router, dispatcher and shared experts read);
  /// the norm runs again from the kept residual stream and row statistics.
  bool layernorm = false;
  /// "mlp": the dense MLP's fc1 output and activation (its fc1 GEMM and activation run again).
  bool mlp = false;
  /// "mlp_act" (megatron.cpp's counterpart of moe_act for the dense MLP): the activation output,
  /// recomputed from the kept fc1 output.
  bool mlp_act = false;
  /// "moe_act": the experts' activation outputs, recomputed from their kept fc1 outputs.
  bool moe_act = false;
  /// "mla_up_proj" (--multi-latent-attention): the up-projected, rotated query/key/value tensor of
  /// multi-latent attention, recomputed from the kept latents (Megatron's qkv_up_checkpoint).
  bool mla_up_proj = false;
};

/// --rope-type of multi-latent attention (Megatron-Core MLATransformerConfig.rope_type).
enum class RopeType : uint8_t { kRope, kYarn };
/// "rope" / "yarn". Errors: mt::Error naming the value.
RopeType parse_rope_type(const std::string& s);
const char* rope_type_name(RopeType t);

/// "softmax" / "sigmoid"; "aux_loss" / "seq_aux_loss" / "global_aux_loss" / "none"; "allgather" /
/// "alltoall". Errors: mt::Error naming the value and the accepted ones (sinkhorn is named as not
/// implemented).
MoeScoreFunction parse_moe_score_function(const std::string& s);
MoeLoadBalancing parse_moe_load_balancing(const std::string& s);
/// Megatron's logging name of a type's loss: load_balancing_loss, seq_load_balancing_loss,
/// global_load_balancing_loss.
const char* moe_load_balancing_loss_name(MoeLoadBalancing b);
MoeDispatcher parse_moe_dispatcher(const std::string& s);
/// "probs" / "position" (--moe-token-drop-policy).
MoeTokenDropPolicy parse_moe_token_drop_policy(const std::string& s);
/// --recompute-modules' names (core_attn, layernorm, mlp, mlp_act, moe_act). Errors: mt::Error
/// naming an unknown or unsupported module (Megatron's moe, shared_experts, mla_up_proj).
RecomputeModules parse_recompute_modules(const std::vector<std::string>& names);
/// "full" / "selective" (--recompute-granularity); "uniform" / "block" (--recompute-method).
/// Errors: mt::Error naming the value and the accepted ones.
RecomputeGranularity parse_recompute_granularity(const std::string& s);
RecomputeMethod parse_recompute_method(const std::string& s);
const char* recompute_granularity_name(RecomputeGranularity g);
const char* recompute_method_name(RecomputeMethod m);
/// Megatron's spellings, as the parse functions accept them.
const char* moe_score_function_name(MoeScoreFunction f);
const char* moe_load_balancing_name(MoeLoadBalancing b);
/// --moe-layer-freq: an integer k (every k-th layer, starting with layer 0, is an MoE layer) or a
/// Python list expression as Megatron accepts it: "[1,0,1,0]", "([0]+[1]*23)", "[0]*3+[1]*9".
/// Returns one 0/1 entry per layer. Errors: mt::Error naming the text when it does not parse, an
/// entry is not 0 or 1, k < 1, or the list length differs from num_layers.
std::vector<uint8_t> parse_moe_layer_freq(const std::string& text, int64_t num_layers);

/// The dense bf16 peak of an H100 / H200 SXM in TFLOP/s, against which the log line's MFU is
/// counted (also for FP8 runs, so that speed-ups read as ratios).
inline constexpr double kMfuPeakTflops = 989.4;

struct TransformerConfig {
  // --- sizes ---
  int64_t num_layers = 12;              ///< --num-layers (L)
  int64_t hidden_size = 768;            ///< --hidden-size (h)
  int64_t num_attention_heads = 12;     ///< --num-attention-heads (n)
  /// --num-query-groups (g, with --group-query-attention): key/value heads; 0 = n (multi-head).
  int64_t num_query_groups = 0;
  int64_t kv_channels = 0;              ///< --kv-channels (d, the head dim); 0 = h / n
  /// --ffn-hidden-size (f); 0 = Megatron's default: 4h, or with --swiglu int(8h/3 / 64)·64.
  int64_t ffn_hidden_size = 0;
  int64_t seq_length = 1024;            ///< --seq-length (s)
  int64_t max_position_embeddings = 0;  ///< --max-position-embeddings; 0 = seq_length
  int64_t vocab_size = 50257;           ///< tokenizer vocabulary (before padding)
  int64_t make_vocab_size_divisible_by = 128;  ///< --make-vocab-size-divisible-by
  // --- architecture ---
  Normalization normalization = Normalization::kLayerNorm;  ///< --normalization
  float norm_epsilon = 1e-5f;           ///< --norm-epsilon (alias --layernorm-epsilon)
  /// --apply-layernorm-1p (Megatron-Core's layernorm_zero_centered_gamma): every LayerNorm /
  /// RMSNorm scales by 1 + weight, the weight initialised to 0 (model/layers/norm.h).
  bool layernorm_zero_centered_gamma = false;
  /// --swiglu: gated linear unit with SiLU (Shazeer 2020): fc1 produces 2f (gate, up), f goes on.
  /// Megatron's field; activation() is the kind it selects.
  bool gated_linear_unit = false;
  PositionEmbeddingType position_embedding_type = PositionEmbeddingType::kLearnedAbsolute;
  float rotary_base = 10000.f;          ///< --rotary-base
  float rotary_percent = 1.0f;          ///< --rotary-percent: fraction of each head's channels rotated
  bool rotary_interleaved = false;      ///< --rotary-interleaved (default: Llama's rotate-half pairs)
  bool add_bias_linear = true;          ///< false with --disable-bias-linear
  bool add_qkv_bias = false;            ///< --add-qkv-bias: bias on the QKV projection only (Qwen 2)
  bool qk_layernorm = false;            ///< --qk-layernorm: per-head norm of queries and keys (Qwen 3)
  bool untie_embeddings_and_output_weights = false;  ///< --untie-embeddings-and-output-weights
  AttentionBackend attention_backend = AttentionBackend::kAuto;  ///< --attention-backend
  /// --deterministic-mode (Megatron's deterministic_mode: "choose code that has deterministic
  /// execution; usually slower; good for debugging and testing"). CUDA kernels whose float sums
  /// depend on the order of atomics are replaced by fixed-order ones, so a run on one GPU gives the
  /// same losses and gradients bitwise every time, and CUDA-graph replay gives the eager ones: the
  /// FlashAttention-2 backward's dQ (a separate kernel per query tile instead of atomics; flash and
  /// context-parallel attention) and the embedding's weight gradient (a sort by token id instead of
  /// atomics). Every other kernel is deterministic in either mode; the CPU backend always is.
  bool deterministic_mode = false;
  /// --tp-comm-overlap (Megatron's ModelParallelConfig.tp_comm_overlap, which TransformerConfig
  /// inherits): the sequence-parallel all-gathers and reduce-scatters of the linear layers in
  /// pieces pipelined with their GEMMs (parallel/mappings.h). Needs sequence parallelism with
  /// TP > 1; the same results (docs/parallelism.md "Tensor-parallel communication overlap").
  bool tp_comm_overlap = false;
  // --- multi-latent attention (DeepSeek-V2 §2.1, arXiv:2405.04434; Megatron-Core
  // transformer/multi_latent_attention.py, MLATransformerConfig; docs/mla.md) ---
  bool multi_latent_attention = false;  ///< --multi-latent-attention: MLASelfAttention in every layer
  int64_t q_lora_rank = 0;              ///< --q-lora-rank (r_q); 0 = none: a full query projection
  int64_t kv_lora_rank = 32;            ///< --kv-lora-rank (r_kv)
  int64_t qk_head_dim = 128;            ///< --qk-head-dim (d_n): the query/key channels without RoPE
  int64_t qk_pos_emb_head_dim = 64;     ///< --qk-pos-emb-head-dim (d_r): the rotated channels
  int64_t v_head_dim = 128;             ///< --v-head-dim (d_v)
  RopeType rope_type = RopeType::kYarn;  ///< --rope-type (MLA's default: yarn, as Megatron)
  bool rope_type_set = false;            ///< --rope-type was given
  float rotary_scaling_factor = 1.f;     ///< --rotary-scaling-factor (YaRN's s; <= 1: no scaling)
  float mscale = 1.f;                    ///< --mscale
  float mscale_all_dim = 0.f;            ///< --mscale-all-dim
  int64_t original_max_position_embeddings = 4096;  ///< --yarn-original-max-position-embeddings
  float beta_fast = 32.f;                ///< --yarn-beta-fast
  float beta_slow = 1.f;                 ///< --yarn-beta-slow
  // --- context parallelism (used when the CP group has more than one rank) ---
  std::string cp_comm_type = "p2p";  ///< --cp-comm-type: p2p, allgather, a2a, a2a+p2p
  std::vector<int> hierarchical_context_parallel_sizes;  ///< --hierarchical-context-parallel-sizes
  // --- initialisation and regularisation ---
  float init_method_std = 0.02f;        ///< --init-method-std
  float hidden_dropout = 0.1f;          ///< --hidden-dropout
  float attention_dropout = 0.1f;       ///< --attention-dropout

  // --- activation recompute (docs/flags.md "Activation recompute") ---
  RecomputeGranularity recompute_granularity = RecomputeGranularity::kNone;  ///< --recompute-granularity
  RecomputeMethod recompute_method = RecomputeMethod::kUniform;              ///< --recompute-method
  bool recompute_method_set = false;  ///< --recompute-method was given
  int64_t recompute_num_layers = 0;   ///< --recompute-num-layers (full granularity: >= 1)
  RecomputeModules recompute_modules;  ///< --recompute-modules
  bool recompute_modules_set = false;  ///< --recompute-modules was given
  /// The modules recomputed in the backward: recompute_modules under selective granularity,
  /// none otherwise.
  RecomputeModules selective_recompute() const {
    return recompute_granularity == RecomputeGranularity::kSelective ? recompute_modules
                                                                      : RecomputeModules{false, false, false, false, false};
  }

  // --- mixture of experts (Megatron-Core transformer/moe; docs/moe.md) ---
  int64_t num_moe_experts = 0;          ///< --num-experts (E); 0 = dense model
  /// --moe-layer-freq resolved: one 0/1 entry per layer (1 = MoE); empty = every layer when E > 0.
  std::vector<uint8_t> moe_layer_pattern;
  int64_t moe_ffn_hidden_size = 0;      ///< --moe-ffn-hidden-size; 0 = ffn()
  int64_t moe_shared_expert_intermediate_size = 0;  ///< --moe-shared-expert-intermediate-size; 0 = none
  /// --moe-shared-expert-gate (Megatron's moe_shared_expert_gate; Qwen 2 MoE's shared_expert_gate):
  /// the shared experts' output is scaled per token by sigmoid(x · w_gate), w_gate [1, h]
  /// (replicated). Needs --moe-shared-expert-intermediate-size.
  bool moe_shared_expert_gate = false;
  int64_t moe_router_topk = 2;          ///< --moe-router-topk (k)
  MoeScoreFunction moe_router_score_function = MoeScoreFunction::kSoftmax;  ///< --moe-router-score-function
  bool moe_router_pre_softmax = false;  ///< --moe-router-pre-softmax: softmax over all E before top-k
  float moe_router_topk_scaling_factor = 1.f;  ///< --moe-router-topk-scaling-factor (0 = unset = 1)
  int64_t moe_router_num_groups = 0;    ///< --moe-router-num-groups (device-limited routing); 0 = off
  int64_t moe_router_group_topk = 0;    ///< --moe-router-group-topk
  /// --moe-router-dtype (Megatron's moe_router_dtype): the dtype of the router GEMM and the routing
  /// math — logits, scores, top-k, probabilities, auxiliary losses and their gradients. kF32 (the
  /// default; Megatron's fp32) or kF64 (fp64: x and W_r widened exactly, logits in double; the
  /// probabilities handed to the dispatcher are rounded to fp32 once).
  DType moe_router_dtype = DType::kF32;
  /// --moe-router-load-balancing-type: one type, or Megatron's list of several (e.g. aux_loss
  /// seq_aux_loss), whose losses are added, each with its coefficient of --moe-aux-loss-coeff (one
  /// per type, in the same order; Megatron's TopKRouter.get_aux_loss_coeff).
  std::vector<MoeLoadBalancing> moe_router_load_balancing_type = {MoeLoadBalancing::kAuxLoss};
  std::vector<float> moe_aux_loss_coeff = {0.f};  ///< --moe-aux-loss-coeff: one per type
  float moe_z_loss_coeff = 0.f;         ///< --moe-z-loss-coeff (0 = off)
  /// --moe-router-enable-expert-bias: aux-loss-free balancing (DeepSeek-V3), a per-expert bias
  /// added to the sigmoid scores for the selection only, updated once per step by
  /// --moe-router-bias-update-rate · sign(mean load − load) from the step's global token counts.
  bool moe_router_enable_expert_bias = false;
  float moe_router_bias_update_rate = 1e-3f;  ///< --moe-router-bias-update-rate
  /// --moe-router-force-load-balancing (benchmarks): the router's logits are replaced by random
  /// normal values (keyed by seed, iteration, micro-batch, layer and global token), the gradient
  /// passes straight through to the router weight.
  bool moe_router_force_load_balancing = false;
  MoeDispatcher moe_token_dispatcher_type = MoeDispatcher::kAllGather;  ///< --moe-token-dispatcher-type
  /// --moe-expert-capacity-factor (Megatron's apply_router_token_dropping): each rank keeps at most
  /// ceil(T·k/E · factor) of its T tokens' slots per expert; unset (0) = dropless.
  double moe_expert_capacity_factor = 0.0;
  bool moe_expert_capacity_set = false;  ///< the flag was given (0 or less is then an error)
  MoeTokenDropPolicy moe_token_drop_policy = MoeTokenDropPolicy::kProbs;  ///< --moe-token-drop-policy
  /// --moe-pad-expert-input-to-capacity (needs a capacity factor). Padding rows have probability 0
  /// and change no output or gradient, so they are not materialised: same results as without.
  bool moe_pad_expert_input_to_capacity = false;
  /// --moe-grouped-gemm (Megatron's GroupedMLP / TE GroupedLinear): each expert projection is one
  /// grouped GEMM over the planned rows with the per-expert counts read on the device
  /// (ops/grouped_matmul.h), instead of a GEMM per expert with host counts; with the allgather
  /// dispatcher the MoE layer then never synchronises with the host. Same results.
  bool moe_grouped_gemm = false;
  /// --moe-enable-echo (ECHO, docs/echo.md): every MoE layer plans clones of its hot experts in
  /// --moe-num-echo-experts spare slots per EP rank from the global token counts and reroutes the
  /// tokens above the average load to them (the alltoall dispatcher; expert TP 1). Same math as
  /// without: the clones compute with their home expert's weights and return their gradients.
  bool moe_enable_echo = false;
  int64_t moe_num_echo_experts = 0;  ///< --moe-num-echo-experts: S, spare expert slots per EP rank
  /// --moe-received-token-capacity (alltoall with --moe-grouped-gemm): C rows an EP rank receives
  /// per MoE layer and micro-batch, as fixed blocks of ceil(C / EP) rows from each EP rank, so the
  /// dispatch reads nothing on the host (CUDA-graph capturable); slots beyond a block are dropped
  /// and counted in the log. 0 = off (dropless, split sizes read on the host).
  int64_t moe_received_token_capacity = 0;
  /// --moe-per-layer-logging (Megatron-Core's moe_per_layer_logging): the log line also gives each
  /// MoE layer's losses and imbalance (model/moe/moe_metrics.h). Logging only.
  bool moe_per_layer_logging = false;
  /// Communication hidden behind computation (docs/moe.md "Overlapped communication"); the math is
  /// unchanged (bitwise the same losses and gradients):
  /// --moe-shared-expert-overlap (Megatron's moe_shared_expert_overlap): the shared experts run on a
  /// side stream while the token dispatcher exchanges (forward and backward).
  bool moe_shared_expert_overlap = false;
  /// --overlap-moe-expert-parallel-comm (Megatron's overlap_moe_expert_parallel_comm; here within the
  /// layer): the dropless alltoall dispatcher exchanges the local experts in chunks on a side stream,
  /// pipelined with the experts of the chunks already received and the combine of those done.
  bool overlap_moe_expert_parallel_comm = false;
  /// --delay-wgrad-compute (Megatron's delay_wgrad_compute; needs the former): the experts' weight
  /// gradients after every chunk's input gradients, beside the last chunks' backward exchanges.
  bool delay_wgrad_compute = false;
  /// --moe-permute-fusion (Megatron's moe_permute_fusion; the dropless alltoall dispatcher):
  /// permutation 2 fused into the exchanges (every source's piece of every local expert travels to
  /// its row of the expert input, and back from the expert output: no staging copies).
  bool moe_permute_fusion = false;

  // --- multi-token prediction (DeepSeek-V3, arXiv:2412.19437 §2.2; Megatron-Core
  // transformer/multi_token_prediction.py; model/layers/multi_token_prediction.h) ---
  /// --mtp-num-layers (D): MTP depths after the decoder on the last pipeline stage; depth k predicts
  /// the token k + 1 positions ahead. 0 = off (Megatron's None).
  int64_t mtp_num_layers = 0;
  /// --mtp-loss-scaling-factor (λ): the MTP loss λ/D · Σ_k L_k is added to the LM loss for the
  /// backward (logged separately, not part of "lm loss"). Megatron's default 0.1.
  float mtp_loss_scaling_factor = 0.1f;

  // --- FP8 training (Transformer Engine's recipes as Megatron drives them; docs/fp8.md) ---
  /// --fp8-format: every linear layer of the decoder (ColumnParallelLinear / RowParallelLinear
  /// and the MoE experts) runs its three GEMMs in FP8; the embeddings, the LM head, norms,
  /// attention and the optimizer stay in higher precision. kNone = off.
  Fp8Format fp8 = Fp8Format::kNone;
  Fp8Recipe fp8_recipe = Fp8Recipe::kDelayed;  ///< --fp8-recipe (Megatron's default: delayed)
  int fp8_margin = 0;                          ///< --fp8-margin (delayed: scale = fp8_max / amax / 2^margin)
  int64_t fp8_amax_history_len = 1;            ///< --fp8-amax-history-len (delayed)
  fp8_math::AmaxAlgo fp8_amax_compute_algo = fp8_math::AmaxAlgo::kMostRecent;  ///< --fp8-amax-compute-algo
  /// --first-last-layers-bf16: the first --num-layers-at-start-in-bf16 and the last
  /// --num-layers-at-end-in-bf16 decoder layers (global numbering) keep bf16 GEMMs.
  bool first_last_layers_bf16 = false;
  int64_t num_layers_at_start_in_bf16 = 1;
  int64_t num_layers_at_end_in_bf16 = 1;
  /// --fp8-param-gather (Megatron's fp8_param): the distributed optimizer all-gathers FP8 weights.
  bool fp8_param = false;
  /// Not flags: delayed scaling's fused producers (Fp8Settings::fused_norm / fused_activation;
  /// MT_FP8_FUSED_PRODUCERS in a run, train/arguments.cpp).
  bool fp8_fused_norm = false;
  bool fp8_fused_activation = true;
  /// Not a flag (the trainer sets it: Fp8Model::weights_in_params): the FP8 weight copies wq and
  /// wq_t live in the bytes of their weight's bf16 parameter storage, which then holds no bf16 copy
  /// of the weight (docs/fp8.md "Memory"); off: separate copies beside the model-dtype weights.
  bool fp8_weights_in_params = false;
  /// The FP8 settings of the linear layers (format kNone when FP8 is off).
  Fp8Settings fp8_settings() const {
    return Fp8Settings{fp8, fp8_recipe, fp8_margin, fp8_amax_history_len, fp8_amax_compute_algo, fp8_fused_norm,
                       fp8_fused_activation};
  }
  /// Whether decoder layer `layer` (global, 0-based) runs its linear layers in FP8: FP8 on and the
  /// layer not among the bf16 first / last layers of --first-last-layers-bf16.
  bool fp8_layer(int64_t layer) const;

  // --- derived (Megatron's defaulting) ---
  /// The MLP activation (model/variants.h): kSwiGLU with --swiglu, else kGelu.
  MlpActivation activation() const { return mlp_activation_of(gated_linear_unit); }
  int64_t ffn() const;
  /// The core attention's head dim d: kv_channels (default h / n); with --multi-latent-attention
  /// max(d_n + d_r, d_v): the value heads (or, when d_v is larger, the query/key heads) are
  /// zero-padded to it for the core attention (docs/mla.md).
  int64_t head_dim() const;
  /// MLA's query/key head dim d_n + d_r (Megatron's q_head_dim).
  int64_t q_head_dim() const { return qk_head_dim + qk_pos_emb_head_dim; }
  /// The core attention's softmax scale: 1/sqrt(d); with MLA mscale^2 / sqrt(d_n + d_r), mscale =
  /// yarn_get_mscale(--rotary-scaling-factor, --mscale-all-dim) (Megatron's MLASelfAttention,
  /// DeepSeek-V3's modelling code).
  float softmax_scale() const;
  int64_t query_groups() const { return num_query_groups > 0 ? num_query_groups : num_attention_heads; }
  int64_t max_positions() const { return max_position_embeddings > 0 ? max_position_embeddings : seq_length; }
  /// Channels of each head that RoPE rotates: head_dim · rotary_percent, rounded down to even; with
  /// MLA d_r.
  int64_t rotary_dim() const;
  bool qkv_bias() const { return add_bias_linear || add_qkv_bias; }
  bool tied_output() const { return !untie_embeddings_and_output_weights; }
  /// Full recompute: the recompute group of the layer at `index` (0-based) within a chunk of
  /// `chunk_layers` layers, or -1 when that layer keeps its activations. Groups are numbered from 0
  /// in layer order; a group is a run of consecutive layers.
  int64_t recompute_group(int64_t index, int64_t chunk_layers) const;
  /// Whether layer `layer` (0-based, global) has an MoE block in its MLP slot. The MTP layers are
  /// numbered num_layers + k (k = 0 .. D-1) and follow the last decoder layer (Megatron builds them
  /// from the last layer's spec).
  bool is_moe_layer(int64_t layer) const;
  int64_t num_moe_layers() const;
  /// The decoder layers and the MTP layers (the layer numbers keying dropout and MoE statistics).
  int64_t num_layers_with_mtp() const { return num_layers + mtp_num_layers; }
  int64_t moe_ffn() const { return moe_ffn_hidden_size > 0 ? moe_ffn_hidden_size : ffn(); }
  /// The coefficient of load-balancing type t: its entry of moe_aux_loss_coeff, 0 when t is not
  /// listed or is kNone (Megatron's get_aux_loss_coeff). A type is on when its coefficient is > 0.
  float moe_aux_coeff(MoeLoadBalancing t) const;
  bool moe_aux_loss_on(MoeLoadBalancing t) const { return moe_aux_coeff(t) > 0; }
  /// Any load-balancing loss on (Megatron's is_aux_loss_enabled).
  bool moe_any_aux_loss() const;
  /// Sets one type with its coefficient (the common single-type case).
  void set_moe_load_balancing(MoeLoadBalancing t, float coeff) {
    moe_router_load_balancing_type = {t};
    moe_aux_loss_coeff = {coeff};
  }
  /// Vocabulary padded to a multiple of make_vocab_size_divisible_by * tp (Megatron's
  /// _vocab_size_with_padding).
  int64_t padded_vocab_size(int tp = 1) const;
  /// Throws mt::Error naming the offending values: non-positive sizes, heads not dividing the
  /// hidden size (without --kv-channels), query groups not dividing heads, a sequence longer than
  /// the position table, dropout outside [0, 1), a rotary fraction outside (0, 1], tp not dividing
  /// heads, query groups or ffn; for MoE: top-k outside [1, E], groups not dividing E or not
  /// covering top-k, a group top-k without groups, negative loss coefficients, load-balancing
  /// types and coefficients of different counts, a type listed twice, a layer pattern of
  /// the wrong length, biases on experts (use --disable-bias-linear), a capacity factor <= 0 or
  /// padding to capacity without one; --recompute-method or --recompute-num-layers without full
  /// granularity, full granularity without a method or with --recompute-num-layers < 1; global
  /// load balancing (its token counts accumulate over the step's forwards) under full recompute;
  /// FP8: --fp8-amax-history-len < 1, --fp8-margin < 0, negative bf16 layer counts, FP8 with the
  /// grouped experts (--moe-grouped-gemm) or ECHO (not built); MTP: --mtp-num-layers < 0, a
  /// negative or non-finite --mtp-loss-scaling-factor, learned absolute positions (Megatron's rule:
  /// rope or none), FP8.
  void validate(int tp = 1) const;
  /// The multi-token prediction rules (part of validate()).
  void validate_mtp() const;
  /// The MoE flags (validate's part when --num-experts > 0).
  void validate_moe() const;
  /// The MoE communication-overlap flags' rules (part of validate()).
  void validate_moe_comm_overlap() const;
  /// Parameters of the model (a tied embedding counted once), with padded vocabulary.
  int64_t num_parameters(int tp = 1) const;
  /// FLOPs of one iteration of `global_batch` sequences, forward + backward, no recompute, as
  /// Megatron-Core counts them today (megatron/training/training.py num_floating_point_operations,
  /// transformer_flops): 6·B·s·(L·(h·(n·d + 2·g·d) + n·d·s + n·d·h) + h·F·c + h·V), i.e. every GEMM
  /// three times (forward, dgrad, wgrad) at 2 FLOPs per multiply-add: QKV with g key/value
  /// groups, the attention scores and their product with V (2·n·d·s per token, halved by the
  /// causal mask), the output projection, the MLP (c = 3 with SwiGLU, 2 with GELU; F = f·L_dense +
  /// (f_moe·k + f_shared)·L_moe: the top-k routed experts and the shared experts of MoE layers, the
  /// router not counted) and the LM head over the vocabulary V padded for `tp` ranks (Megatron's
  /// padded_vocab_size). With D = --mtp-num-layers, as Megatron: D more layers of the last layer's
  /// kind (dense or MoE), 6·B·s·D·(3h + 2h²) for the MTP norms and eh_proj, and the LM head D + 1
  /// times. Until issue 41 the log counted the attention scores in full:
  /// 12·B·s·L·h·n·d·(1 + g/n + s/h) instead of (1 + g/n + s/(2h)) (docs/flags.md "The log line").
  /// With --multi-latent-attention the attention term per token and layer is Megatron's MLA one:
  /// q_term + r_kv·(h + n·(d_n + d_v) + 1) + h·d_r + n·d_v·h + s·(n·(d_n + d_r) + n·d_v)/2, q_term =
  /// r_q·(h + n·(d_n + d_r) + 1) with --q-lora-rank, else h·n·(d_n + d_r) (mla_flops_per_token).
  double flops_per_iteration(int64_t global_batch, int tp = 1) const;
  /// MLA's attention multiply-adds per token and layer as flops_per_iteration counts them.
  double mla_flops_per_token() const;
  /// One line naming the architecture ("GPT: 12 layers, hidden 768, ...").
  std::string summary() const;
};

}  // namespace mt
