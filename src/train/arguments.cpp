#include "train/arguments.h"

#include <CLI/CLI.hpp>

#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>

#include "comm/bootstrap.h"
#include "core/cli_validators.h"
#include "core/logging.h"
#include "train/megatron_compat.h"
#include "train/timing_log.h"

namespace mt {

LrScheduleConfig PretrainArgs::lr_schedule() const {
  LrScheduleConfig c;
  c.max_lr = lr;
  c.min_lr = min_lr;
  c.decay_style = lr_decay_style;
  c.warmup_init_lr = lr_warmup_init;
  c.wsd_decay_style = lr_wsd_decay_style;
  // Megatron's get_optimizer_param_scheduler: a warm-up fraction is of the decay steps.
  if (train_samples > 0) {
    c.decay_steps = lr_decay_samples > 0 ? lr_decay_samples : train_samples;
    c.warmup_steps = static_cast<double>(lr_warmup_samples);
    c.wsd_decay_steps = lr_wsd_decay_samples;
  } else {
    c.decay_steps = lr_decay_iters > 0 ? lr_decay_iters : train_iters;
    c.warmup_steps = static_cast<double>(lr_warmup_iters);
    c.wsd_decay_steps = lr_wsd_decay_iters;
    if (lr_counts_samples()) {  // a batch-size schedule: iterations x the (final) global batch size
      c.decay_steps *= global_batch_size;
      c.warmup_steps *= static_cast<double>(global_batch_size);
      c.wsd_decay_steps *= global_batch_size;
    }
  }
  if (lr_warmup_fraction >= 0) c.warmup_steps = lr_warmup_fraction * static_cast<double>(c.decay_steps);
  return c;
}

std::vector<int64_t> PretrainArgs::microbatch_counts() const {
  std::vector<int64_t> out;
  for (const int64_t b : batch_schedule.sizes_used(train_iters)) out.push_back(b / (micro_batch_size * data_parallel_size));
  if (out.empty() || out.back() != num_microbatches()) out.push_back(num_microbatches());
  return out;
}

LrScheduleConfig PretrainArgs::decoupled_lr_schedule() const {
  LrScheduleConfig c = lr_schedule();
  c.max_lr = decoupled_lr;
  if (decoupled_min_lr >= 0) c.min_lr = decoupled_min_lr;
  return c;
}

DdpConfig PretrainArgs::ddp_config() const {
  DdpConfig c;
  c.overlap_grad_reduce = overlap_grad_reduce;
  c.overlap_param_gather = overlap_param_gather;
  c.copy_engine = ddp_copy_engine;
  c.grad_reduce_in_bf16 = grad_reduce_in_bf16;
  c.use_distributed_optimizer = use_distributed_optimizer;
  c.shard_grads = shard_grads();
  c.shard_params = shard_params();
  c.num_distributed_optimizer_instances = num_distributed_optimizer_instances;
  return c;
}

ParamLayout PretrainArgs::param_layout() const {
  ParamLayout l;
  l.data_parallel_size = std::max(data_parallel_size, 1);
  l.expert_data_parallel_size = std::max(expert_data_parallel_size, 1);
  // optim_grads stages the gradients per bucket: one bucket would hold the whole gradient.
  l.bucket_size = overlap_grad_reduce || shard_grads()
                      ? ddp_bucket_size.value_or(default_ddp_bucket_size(l.data_parallel_size))
                      : 0;
  l.isolate_word_embedding = shard_grads() && pipeline_model_parallel_size > 1;
  // the interleaved schedule's chunks complete their buckets in their own backwards (docs/fsdp.md)
  l.split_model_chunks = shard_grads();
  return l;
}

namespace {

void resolve_megatron_fsdp(PretrainArgs& a);  // below

/// Megatron's _add_mla_args and the YaRN flags (docs/mla.md): only with --multi-latent-attention.
const std::vector<std::string> kMlaFlags = {
    "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--rope-type",
    "--rotary-scaling-factor", "--mscale", "--mscale-all-dim", "--yarn-original-max-position-embeddings",
    "--yarn-beta-fast", "--yarn-beta-slow"};

void add_mla_args(CLI::App& app, TransformerConfig& m) {
  app.add_flag("--multi-latent-attention", m.multi_latent_attention,
               "Multi-latent attention (DeepSeek-V2/V3): low-rank query and key/value latents, decoupled RoPE");
  app.add_option("--q-lora-rank", m.q_lora_rank, "Rank of the query latent (absent: a full query projection)")
      ->check(positive_integer());
  app.add_option("--kv-lora-rank", m.kv_lora_rank, "Rank of the key/value latent")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--qk-head-dim", m.qk_head_dim, "Query/key head channels without RoPE")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--qk-pos-emb-head-dim", m.qk_pos_emb_head_dim, "Query/key head channels with RoPE (decoupled)")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--v-head-dim", m.v_head_dim, "Value head channels")->check(positive_integer())->capture_default_str();
  app.add_option_function<std::string>(
         "--rope-type",
         [&m](const std::string& v) {
           m.rope_type = parse_rope_type(v);
           m.rope_type_set = true;
         },
         "RoPE of multi-latent attention: rope or yarn")
      ->default_str("yarn");
  app.add_option("--rotary-scaling-factor", m.rotary_scaling_factor, "YaRN scaling factor s")->capture_default_str();
  app.add_option("--mscale", m.mscale, "YaRN mscale")->capture_default_str();
  app.add_option("--mscale-all-dim", m.mscale_all_dim, "YaRN mscale_all_dim (softmax scale mscale^2)")
      ->capture_default_str();
  app.add_option("--yarn-original-max-position-embeddings", m.original_max_position_embeddings,
                 "YaRN's original context length")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--yarn-beta-fast", m.beta_fast, "YaRN beta_fast (rotations)")->capture_default_str();
  app.add_option("--yarn-beta-slow", m.beta_slow, "YaRN beta_slow (rotations)")->capture_default_str();
}

// The architecture (Megatron's _add_network_size_args and friends) and activation recompute.
void add_model_options(CLI::App& app, PretrainArgs& a) {
  auto& m = a.model;
  app.add_option("--num-layers", m.num_layers, "Number of transformer layers")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--hidden-size", m.hidden_size, "Transformer hidden size")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--num-attention-heads", m.num_attention_heads, "Number of attention heads")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--ffn-hidden-size", m.ffn_hidden_size, "MLP hidden size (default 4 * hidden)")
      ->check(positive_integer());
  app.add_option("--seq-length", m.seq_length, "Sequence length")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--max-position-embeddings", m.max_position_embeddings,
                 "Position embedding table size (default seq-length)")
      ->check(positive_integer());
  app.add_option("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by,
                 "Pad the vocabulary to a multiple of this (times TP)")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--init-method-std", m.init_method_std, "Std of the normal weight init")->capture_default_str();
  app.add_option("--hidden-dropout", m.hidden_dropout, "Dropout on hidden states")->capture_default_str();
  app.add_option("--attention-dropout", m.attention_dropout, "Dropout on attention probabilities")
      ->capture_default_str();
  app.add_option("--norm-epsilon,--layernorm-epsilon", m.norm_epsilon, "Epsilon of LayerNorm / RMSNorm")
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--normalization", [&m](const std::string& v) { m.normalization = parse_normalization(v); },
         normalization_help())
      ->default_str(normalization_name(m.normalization));
  app.add_flag("--apply-layernorm-1p", m.layernorm_zero_centered_gamma,
               "Zero-centred norm weights: LayerNorm / RMSNorm scale by 1 + weight, the weight initialised to 0");
  app.add_flag("--swiglu", m.gated_linear_unit,
               "Gated SiLU MLP (SwiGLU); --ffn-hidden-size defaults to int(8h/3 / 64) * 64");
  app.add_option_function<std::string>(
         "--position-embedding-type",
         [&m](const std::string& v) { m.position_embedding_type = parse_position_embedding_type(v); },
         position_embedding_type_help())
      ->default_str(position_embedding_type_name(m.position_embedding_type));
  app.add_option("--rotary-base", m.rotary_base, "RoPE base (theta)")->capture_default_str();
  app.add_option("--rotary-percent", m.rotary_percent, "Fraction of each head's channels RoPE rotates")
      ->capture_default_str();
  app.add_flag("--rotary-interleaved", m.rotary_interleaved,
               "RoPE on interleaved channel pairs (2i, 2i+1) instead of Llama's rotate-half halves");
  app.add_flag("--group-query-attention", a.group_query_attention, "Grouped-query attention (--num-query-groups)");
  app.add_option("--num-query-groups", m.num_query_groups, "Key/value heads with --group-query-attention")
      ->check(positive_integer());
  app.add_option("--kv-channels", m.kv_channels, "Head dimension (default hidden-size / num-attention-heads)")
      ->check(positive_integer());
  app.add_flag("--untie-embeddings-and-output-weights", m.untie_embeddings_and_output_weights,
               "Separate output layer weights instead of the word embedding's");
  app.add_flag("!--disable-bias-linear", m.add_bias_linear, "No biases in the linear layers");
  app.add_flag("--add-qkv-bias", m.add_qkv_bias, "Bias on the QKV projection (with --disable-bias-linear, Qwen 2)");
  app.add_flag("--qk-layernorm", m.qk_layernorm, "Normalise each query and key head (Qwen 3)");
  add_mla_args(app, m);
  app.add_option_function<std::string>(
         "--attention-backend", [&m](const std::string& v) { m.attention_backend = parse_attention_backend(v); },
         attention_backend_help())
      ->default_str(attention_backend_name(m.attention_backend));
  app.add_option("--mtp-num-layers", m.mtp_num_layers,
                 "Multi-token prediction depths on the last pipeline stage (DeepSeek-V3; 0 = off)")
      ->check(integer_range(0))
      ->capture_default_str();
  app.add_option("--mtp-loss-scaling-factor", m.mtp_loss_scaling_factor,
                 "Weight of the MTP loss: scaling factor / depths * the sum of the depths' losses")
      ->check(number_range(0, kNoMax))
      ->capture_default_str();
  app.add_flag("--deterministic-mode", m.deterministic_mode,
               "Choose code that has deterministic execution (usually slower; good for debugging and testing): "
               "bitwise repeatable losses and gradients on CUDA, also under CUDA graphs");


  app.add_option_function<std::string>(
      "--recompute-granularity", [&m](const std::string& v) { m.recompute_granularity = parse_recompute_granularity(v); },
      "Activation recompute: full (re-run groups of layers) or selective (--recompute-modules)");
  app.add_flag_callback(
      "--recompute-activations", [&m] { m.recompute_granularity = RecomputeGranularity::kSelective; },
      "Same as --recompute-granularity selective");
  app.add_option_function<std::string>(
      "--recompute-method",
      [&m](const std::string& v) {
        m.recompute_method = parse_recompute_method(v);
        m.recompute_method_set = true;
      },
      "Full recompute: uniform (every layer, in groups) or block (the first N layers of each chunk)");
  app.add_option("--recompute-num-layers", m.recompute_num_layers,
                 "Full recompute: layers per group (uniform) or recomputed layers per chunk (block)")
      ->check(positive_integer());
  app.add_option_function<std::vector<std::string>>(
      "--recompute-modules",
      [&m](const std::vector<std::string>& v) {
        m.recompute_modules = parse_recompute_modules(v);
        m.recompute_modules_set = true;
      },
      "Selective recompute: the modules to recompute: core_attn (default), layernorm, mlp, mlp_act, moe_act");
}

// Mixture of experts (Megatron-Core transformer/moe; docs/moe.md).
void add_moe_options(CLI::App& app, PretrainArgs& a) {
  auto& m = a.model;
  app.add_option("--num-experts", m.num_moe_experts, "Experts per MoE layer (0 = dense model)")
      ->check(integer_range(0));
  app.add_option("--moe-layer-freq", a.moe_layer_freq,
                 "MoE layer pattern: k (every k-th layer from layer 0) or a list such as ([0]+[1]*23)")
      ->capture_default_str();
  app.add_option("--moe-ffn-hidden-size", m.moe_ffn_hidden_size, "Hidden size of each expert (default ffn-hidden-size)")
      ->check(positive_integer());
  app.add_option("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size,
                 "Hidden size of the shared experts (0 = none)")
      ->check(integer_range(0));
  app.add_flag("--moe-shared-expert-gate", m.moe_shared_expert_gate,
               "Scale the shared experts' output per token by sigmoid(x . w), w [1, hidden] (Qwen 2 MoE)");
  app.add_option("--moe-router-topk", m.moe_router_topk, "Experts per token")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--moe-router-score-function",
         [&m](const std::string& v) { m.moe_router_score_function = parse_moe_score_function(v); },
         "softmax or sigmoid")
      ->default_str("softmax");
  app.add_flag("--moe-router-pre-softmax", m.moe_router_pre_softmax, "Softmax over all experts before the top-k");
  app.add_option("--moe-router-topk-scaling-factor", m.moe_router_topk_scaling_factor,
                 "Scale of the routing probabilities")->capture_default_str();
  app.add_option("--moe-router-num-groups", m.moe_router_num_groups, "Expert groups of device-limited routing")
      ->check(integer_range(0));
  app.add_option("--moe-router-group-topk", m.moe_router_group_topk, "Groups each token may route to")
      ->check(integer_range(0));
  app.add_option_function<std::string>(
         "--moe-router-dtype",
         [&m](const std::string& v) {
           MT_REQUIRE(v == "fp32" || v == "fp64", "--moe-router-dtype '{}' is not supported: expected fp32 or fp64", v);
           m.moe_router_dtype = v == "fp64" ? DType::kF64 : DType::kF32;
         },
         "Precision of the router GEMM and the routing math: fp32 or fp64")
      ->default_str("fp32");
  app.add_option_function<std::vector<std::string>>(
         "--moe-router-load-balancing-type",
         [&m](const std::vector<std::string>& v) {
           m.moe_router_load_balancing_type.clear();
           for (const std::string& t : v) m.moe_router_load_balancing_type.push_back(parse_moe_load_balancing(t));
         },
         "aux_loss, seq_aux_loss, global_aux_loss or none; a list combines several (one coefficient each)")
      ->default_str("aux_loss");
  app.add_option("--moe-aux-loss-coeff", m.moe_aux_loss_coeff,
                 "Load-balancing loss coefficient(s): one per --moe-router-load-balancing-type, in its order")
      ->default_str("0");
  app.add_option("--moe-z-loss-coeff", m.moe_z_loss_coeff, "Router z-loss coefficient (0 = off)");
  app.add_flag("--moe-router-enable-expert-bias", m.moe_router_enable_expert_bias,
               "Aux-loss-free load balancing: a per-expert selection bias updated once per step (sigmoid router)");
  app.add_option("--moe-router-bias-update-rate", m.moe_router_bias_update_rate, "Expert bias update per step")
      ->capture_default_str();
  app.add_flag("--moe-router-force-load-balancing", m.moe_router_force_load_balancing,
               "Benchmarks: random router logits (balanced load), gradients straight through");
  app.add_option_function<std::string>(
         "--moe-token-dispatcher-type",
         [&m](const std::string& v) { m.moe_token_dispatcher_type = parse_moe_dispatcher(v); }, "allgather or alltoall")
      ->default_str("allgather");
  app.add_option_function<double>(
      "--moe-expert-capacity-factor",
      [&m](double v) {
        m.moe_expert_capacity_factor = v;
        m.moe_expert_capacity_set = true;
      },
      "Expert capacity ceil(T*k/E * factor) per rank; slots beyond it are dropped (default: dropless)");
  app.add_option_function<std::string>(
         "--moe-token-drop-policy",
         [&m](const std::string& v) { m.moe_token_drop_policy = parse_moe_token_drop_policy(v); },
         "probs (drop the lowest probabilities) or position (drop the latest tokens)")
      ->default_str("probs");
  app.add_flag("--moe-pad-expert-input-to-capacity", m.moe_pad_expert_input_to_capacity,
               "Pad every expert to its capacity (same results: padding rows are not materialised)");
  app.add_flag("--moe-grouped-gemm", m.moe_grouped_gemm,
               "Experts as grouped GEMMs with device-side token counts (no host sync with the allgather dispatcher)");
  app.add_flag("--moe-enable-echo", m.moe_enable_echo,
               "ECHO: clone hot experts into spare slots of under-loaded EP ranks each micro-batch (alltoall, "
               "docs/echo.md)");
  app.add_option("--moe-num-echo-experts", m.moe_num_echo_experts, "ECHO spare expert slots per EP rank")
      ->check(integer_range(0));
  app.add_option("--moe-received-token-capacity", m.moe_received_token_capacity,
                 "alltoall: tokens an EP rank receives per layer and micro-batch, in fixed blocks (no host sync, "
                 "CUDA-graph capturable; overflow dropped and counted); 0 = dropless")
      ->check(integer_range(0));
  app.add_flag("--moe-per-layer-logging", a.model.moe_per_layer_logging, "Log the auxiliary losses of every MoE layer");
  app.add_flag("--moe-shared-expert-overlap", m.moe_shared_expert_overlap,
               "Run the shared experts on a side stream beside the token dispatcher's exchanges (same results)");
  app.add_flag("--overlap-moe-expert-parallel-comm", m.overlap_moe_expert_parallel_comm,
               "alltoall (dropless): exchange the local experts' tokens in chunks on a side stream, pipelined with "
               "the experts (same results)");
  app.add_flag("--delay-wgrad-compute", m.delay_wgrad_compute,
               "With --overlap-moe-expert-parallel-comm: the experts' weight gradients after the chunks' input "
               "gradients, beside the last exchanges (same results)");
  app.add_flag("--moe-permute-fusion", m.moe_permute_fusion,
               "alltoall (dropless): send every expert's piece straight to its row (no permutation-2 copies; same "
               "results)");
  app.add_option("--expert-model-parallel-size", a.expert_model_parallel_size, "Expert-parallel size")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--expert-tensor-parallel-size", a.expert_tensor_parallel_size,
                 "Tensor-parallel size of the experts (default = tensor-model-parallel-size)")
      ->check(positive_integer());
}

// Batch, learning-rate schedule, optimizer, precision, logging and evaluation.
void add_training_options(CLI::App& app, PretrainArgs& a) {
  app.add_option("--micro-batch-size", a.micro_batch_size, "Sequences per micro-batch")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--global-batch-size", a.global_batch_size,
                 "Sequences per iteration (gradient accumulation over micro-batches)")
      ->check(positive_integer());
  app.add_option("--rampup-batch-size", a.rampup_batch_size,
                 "<start> <increment> <ramp samples>: the global batch grows from <start> by <increment> every "
                 "ramp-samples / ((global - start) / increment) consumed samples up to --global-batch-size")
      ->expected(1, -1);
  app.add_option("--step-batch-size-schedule", a.step_batch_size_schedule,
                 "\"T0:B0 T1:B1 ...\": global batch B_k from T_k consumed tokens on (K/M/B/T suffixes; T0 = 0)")
      ->expected(1, -1)
      ->allow_extra_args();
  app.add_option("--train-iters", a.train_iters, "Training iterations (or --train-samples)")->check(positive_integer());
  app.add_option("--lr", a.lr, "Peak learning rate")->check(number_range(0, kNoMax))->required();
  app.add_option("--min-lr", a.min_lr, "Minimum learning rate")
      ->check(number_range(0, kNoMax))
      ->capture_default_str();
  app.add_option("--decoupled-lr", a.decoupled_lr,
                 "Separate peak learning rate of the input embedding and the output layer (same schedule shape)")
      ->check(number_range(0, kNoMax));
  app.add_option("--decoupled-min-lr", a.decoupled_min_lr,
                 "Minimum learning rate of the input embedding and the output layer (default --min-lr; only with "
                 "--decoupled-lr)")
      ->check(number_range(0, kNoMax));
  app.add_option("--lr-warmup-iters", a.lr_warmup_iters, "Linear warm-up iterations")
      ->check(integer_range(0))
      ->capture_default_str();
  app.add_option("--lr-decay-style", a.lr_decay_style, "constant, linear, cosine or inverse-square-root")
      ->capture_default_str();
  app.add_option("--lr-decay-iters", a.lr_decay_iters, "Decay iterations (default train-iters)")
      ->check(positive_integer());
  app.add_option("--weight-decay", a.optim.weight_decay, "AdamW weight decay")
      ->check(number_range(0, kNoMax))
      ->capture_default_str();
  app.add_option("--clip-grad", a.optim.clip_grad, "Global gradient-norm clipping (0 = off)")
      ->check(number_range(0, kNoMax))
      ->capture_default_str();
  app.add_option("--adam-beta1", a.optim.beta1, "AdamW beta1")
      ->check(number_range(0, 1, false, true))
      ->capture_default_str();
  app.add_option("--adam-beta2", a.optim.beta2, "AdamW beta2")
      ->check(number_range(0, 1, false, true))
      ->capture_default_str();
  app.add_option("--adam-eps", a.optim.eps, "AdamW epsilon")
      ->check(number_range(0, kNoMax, true))
      ->capture_default_str();
  // --optimizer muon (Megatron's _add_training_args / OptimizerConfig muon_*; docs/optimizer.md)
  app.add_option("--optimizer", a.optim.optimizer,
                 "adam (AdamW) or muon (Muon for the transformer layers' weight matrices, AdamW for the rest)")
      ->capture_default_str();
  app.add_option("--muon-momentum", a.optim.muon.momentum, "Muon momentum (EMA) factor")
      ->check(number_range(0, 1, false, true))
      ->capture_default_str();
  app.add_flag("--muon-nesterov,--muon-use-nesterov", a.optim.muon.nesterov, "Muon: Nesterov-style momentum");
  app.add_flag("!--muon-no-split-qkv", a.optim.muon.split_qkv,
               "Muon: orthogonalise the fused QKV weight whole instead of Q, K and V apart");
  app.add_option("--muon-num-ns-steps", a.optim.muon.num_ns_steps, "Muon: Newton-Schulz steps")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--muon-scale-mode", [&a](const std::string& v) { a.optim.muon.scale_mode = parse_muon_scale_mode(v); },
         "Muon update scale: spectral sqrt(max(r, c)), unit_rms_norm sqrt(r / c), shape_scaling "
         "sqrt(max(1, r / c))")
      ->default_str(muon_scale_mode_name(a.optim.muon.scale_mode));
  app.add_option("--muon-extra-scale-factor", a.optim.muon.extra_scale_factor, "Muon: extra update scale factor")
      ->check(number_range(0, kNoMax))
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--muon-coefficient-type",
         [&a](const std::string& v) { a.optim.muon.coefficient_type = parse_muon_coefficient_type(v); },
         "Muon Newton-Schulz coefficients: simple, quintic, polar_express or aol")
      ->default_str(muon_coefficient_type_name(a.optim.muon.coefficient_type));
  app.add_option_function<std::string>(
         "--muon-tp-mode", [&a](const std::string& v) { a.optim.muon.tp_mode = parse_muon_tp_mode(v); },
         "Muon with tensor parallelism: duplicated (gather, orthogonalise, keep the shard), distributed "
         "(sharded iteration) or blockwise (each shard alone)")
      ->default_str(muon_tp_mode_name(a.optim.muon.tp_mode));
  app.add_option("--seed", a.seed, "Random seed (init, dropout, data order)")
      ->check(integer_range(0, 4294967295))
      ->capture_default_str();

  app.add_flag("--bf16", a.bf16, "bf16 parameters and activations, fp32 main parameters and gradients");
  app.add_flag("--fp16", a.fp16, "fp16 parameters and activations with dynamic loss scaling");
  // FP8 training (Megatron's _add_transformer_engine_args; docs/fp8.md)
  app.add_option_function<std::string>(
      "--fp8-format", [&a](const std::string& v) { a.model.fp8 = parse_fp8_format(v); },
      "FP8 GEMMs in every decoder linear layer: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients)");
  app.add_option_function<std::string>(
         "--fp8-recipe", [&a](const std::string& v) { a.model.fp8_recipe = parse_fp8_recipe(v); },
         "FP8 scaling: tensorwise (current scaling), delayed (amax history) or blockwise (1x128 / 128x128 blocks)")
      ->default_str("delayed");
  app.add_option("--fp8-margin", a.model.fp8_margin, "Delayed scaling: scale = fp8_max / amax / 2^margin")
      ->capture_default_str();
  app.add_option("--fp8-amax-history-len", a.model.fp8_amax_history_len, "Delayed scaling: amax history length")
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--fp8-amax-compute-algo",
         [&a](const std::string& v) { a.model.fp8_amax_compute_algo = parse_fp8_amax_compute_algo(v); },
         "Delayed scaling: the amax of the history, max or most_recent")
      ->default_str("most_recent");
  app.add_flag("--first-last-layers-bf16", a.model.first_last_layers_bf16,
               "With --fp8-format: keep the first and last decoder layers in bf16");
  app.add_option("--num-layers-at-start-in-bf16", a.model.num_layers_at_start_in_bf16,
                 "--first-last-layers-bf16: decoder layers at the start kept in bf16")
      ->capture_default_str();
  app.add_option("--num-layers-at-end-in-bf16", a.model.num_layers_at_end_in_bf16,
                 "--first-last-layers-bf16: decoder layers at the end kept in bf16")
      ->capture_default_str();
  app.add_flag("--fp8-param-gather", a.model.fp8_param,
               "The distributed optimizer all-gathers FP8 weights (needs --use-distributed-optimizer; not built yet)");
  app.add_option("--loss-scale", a.loss_scale, "Static loss scale (fp16); default dynamic");
  app.add_option("--initial-loss-scale", a.initial_loss_scale, "Initial dynamic loss scale")->capture_default_str();
  app.add_option("--min-loss-scale", a.min_loss_scale, "Minimum dynamic loss scale")->capture_default_str();
  app.add_option("--loss-scale-window", a.loss_scale_window, "Clean steps before the scale grows")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--hysteresis", a.hysteresis, "Overflowed steps tolerated before the scale backs off")
      ->check(positive_integer())
      ->capture_default_str();

  app.add_option("--log-interval", a.log_interval, "Iterations between log lines")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--eval-interval", a.eval_interval, "Iterations between evaluations")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--eval-iters", a.eval_iters, "Iterations (global batches) per evaluation")
      ->check(integer_range(0))
      ->capture_default_str();
  app.add_option("--timing-log-level", a.timing_log_level,
                 "Training timers in the log: 0 off, 1 forward-backward, gradient sync and optimizer phases")
      ->capture_default_str();
  app.add_option("--timing-log-option", a.timing_log_option,
                 "Timer values across ranks: max, minmax or all (one per rank)")
      ->capture_default_str();
}

// Checkpoints, early exits, the NaN check, TensorBoard and the metrics file.
void add_checkpoint_options(CLI::App& app, PretrainArgs& a) {
  app.add_option("--save", a.save, "Checkpoint directory to save to");
  app.add_option("--load", a.load, "Checkpoint directory to resume from");
  app.add_flag("--finetune", a.finetune,
               "Load the model weights only (no optimizer state, iteration and data position reset to 0), e.g. a "
               "checkpoint written by import-hf");
  app.add_flag("--no-load-optim", a.no_load_optim, "Do not load the optimizer state of the checkpoint");
  app.add_flag("--use-checkpoint-args", a.use_checkpoint_args,
               "Take the model architecture (layers, sizes, norm, positions, MLP, biases) from the --load checkpoint");
  app.add_option("--save-interval", a.save_interval, "Iterations between checkpoints")
      ->check(integer_range(0));
  app.add_option("--exit-interval", a.exit_interval, "Exit (after saving a checkpoint) when iteration % N == 0")
      ->check(integer_range(0));
  app.add_option("--exit-duration-in-mins", a.exit_duration_in_mins,
                 "Exit (after saving a checkpoint) once training has run this many minutes");
  app.add_flag("--exit-signal-handler", a.exit_signal_handler,
               "On SIGTERM or SIGINT finish the current iteration, save a checkpoint and exit with status 0");
  app.add_flag("--async-save", a.async_save,
               "Write checkpoints from a background thread: training continues after a host snapshot");
  app.add_flag("--no-save-optim", a.no_save_optim, "Save checkpoints without the optimizer state");
  app.add_flag("--no-load-rng", a.no_load_rng,
               "Do not take the random state (the seed) from the checkpoint: --seed may differ from it");
  app.add_flag("--exit-on-missing-checkpoint", a.exit_on_missing_checkpoint,
               "With --load: stop with an error when the directory holds no checkpoint, also when --load == --save "
               "(which otherwise starts from scratch)");
  app.add_flag("--fallback-to-previous-checkpoint", a.fallback_to_previous_checkpoint,
               "If the latest checkpoint of --load is incomplete or corrupt, load the newest earlier one that "
               "verifies (warning) instead of stopping with an error");
  app.add_flag("--check-for-nan-in-loss-and-grad,!--no-check-for-nan-in-loss-and-grad",
               a.check_for_nan_in_loss_and_grad,
               "Stop with an error naming the iteration when the loss or the gradient norm is NaN/Inf (default on)");
  app.add_option("--tensorboard-dir", a.tensorboard_dir, "Write TensorBoard event files to this directory");
  app.add_option("--tensorboard-log-interval", a.tensorboard_log_interval,
                 "Iterations between TensorBoard points")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_flag("--log-timers-to-tensorboard", a.log_timers_to_tensorboard,
               "Iteration time, throughput and the --timing-log-level timers to TensorBoard");
  app.add_flag("--log-memory-to-tensorboard", a.log_memory_to_tensorboard, "Device memory to TensorBoard");
  app.add_flag("--log-validation-ppl-to-tensorboard", a.log_validation_ppl_to_tensorboard,
               "Validation perplexity to TensorBoard");
  app.add_flag("!--no-log-loss-scale-to-tensorboard", a.log_loss_scale_to_tensorboard,
               "No loss scale in TensorBoard");
  app.add_option("--metrics-file", a.metrics_file,
                 "Append one JSON object per log interval and per evaluation to this file (JSON lines)");
}

// Parallel layouts, the device and CUDA graphs.
void add_parallel_options(CLI::App& app, PretrainArgs& a) {
  app.add_option("--tensor-model-parallel-size", a.tensor_model_parallel_size, "Tensor-parallel size")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_flag("--sequence-parallel", a.sequence_parallel, "Sequence parallelism in the TP group");
  app.add_flag("--tp-comm-overlap", a.model.tp_comm_overlap,
               "Pipeline the sequence-parallel all-gathers / reduce-scatters with the linear layers' GEMMs "
               "(needs --sequence-parallel, TP > 1)");
  app.add_option("--context-parallel-size", a.context_parallel_size,
                 "Context-parallel size: each rank holds seq-length / N tokens of every sequence (docs/parallelism.md)")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--cp-comm-type", a.model.cp_comm_type, "Context-parallel attention: p2p, allgather, a2a, a2a+p2p")
      ->capture_default_str();
  app.add_option("--hierarchical-context-parallel-sizes", a.model.hierarchical_context_parallel_sizes,
                 "a2a+p2p: the a2a and p2p sizes (their product = --context-parallel-size)")
      ->expected(2)
      ->check(positive_integer());
  app.add_option("--pipeline-model-parallel-size", a.pipeline_model_parallel_size, "Pipeline-parallel size")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--num-layers-per-virtual-pipeline-stage", a.num_layers_per_virtual_pipeline_stage,
                 "Layers per virtual pipeline stage (interleaved 1F1B)")
      ->check(positive_integer());
  app.add_option("--num-virtual-stages-per-pipeline-rank", a.num_virtual_stages_per_pipeline_rank,
                 "Model chunks per pipeline rank (interleaved 1F1B)")
      ->check(positive_integer());
  app.add_option("--decoder-first-pipeline-num-layers", a.decoder_first_pipeline_num_layers,
                 "Layers of the first pipeline stage (the rest split evenly)")
      ->check(positive_integer());
  app.add_option("--decoder-last-pipeline-num-layers", a.decoder_last_pipeline_num_layers,
                 "Layers of the last pipeline stage (the rest split evenly)")
      ->check(positive_integer());
  app.add_flag("--account-for-embedding-in-pipeline-split", a.account_for_embedding_in_pipeline_split,
               "Count the embedding as one layer when splitting layers over stages");
  app.add_flag("--account-for-loss-in-pipeline-split", a.account_for_loss_in_pipeline_split,
               "Count the loss as one layer when splitting layers over stages");
  app.add_option("--microbatch-group-size-per-virtual-pipeline-stage", a.microbatch_group_size_per_vp_stage,
                 "Micro-batches run through each model chunk in turn (interleaved; default pp)")
      ->check(positive_integer());
  app.add_flag("--overlap-p2p-communication,!--no-overlap-p2p-communication", a.overlap_p2p_comm,
               "Pipeline sends and receives on a communication stream, each waited for only by the compute that "
               "uses its data, so computes run while transfers are in flight (1F1B and interleaved; same results)");
  app.add_flag("--use-distributed-optimizer", a.use_distributed_optimizer,
               "Shard the optimizer state over data-parallel ranks (ZeRO-1)");
  app.add_flag("--use-precision-aware-optimizer", a.use_precision_aware_optimizer,
               "With --bf16: keep the fp32 main parameters as int16 remainders beside the bf16 parameters (2 bytes "
               "per parameter instead of 4, reconstructed exactly in the AdamW step)");
  app.add_flag("--overlap-grad-reduce", a.overlap_grad_reduce,
               "Reduce gradients in buckets, each as soon as the backward has produced it (overlapped)");
  app.add_flag("--overlap-param-gather", a.overlap_param_gather,
               "All-gather updated parameters asynchronously, waited for by the next forward (needs "
               "--use-distributed-optimizer and --overlap-grad-reduce)");
  app.add_flag("--grad-reduce-in-bf16", a.grad_reduce_in_bf16,
               "Reduce gradients over data-parallel ranks in bfloat16 (half the traffic; accumulation stays fp32)");
  app.add_flag("--use-megatron-fsdp", a.use_megatron_fsdp,
               "Megatron-FSDP: shard over data-parallel ranks as --data-parallel-sharding-strategy says "
               "(docs/fsdp.md)");
  app.add_option("--data-parallel-sharding-strategy", a.data_parallel_sharding_strategy,
                 "With --use-megatron-fsdp: no_shard (plain DDP), optim (the distributed optimizer, ZeRO-1); "
                 "optim_grads (ZeRO-2: gradients reduce-scattered per micro-batch into shards); optim_grads_params (ZeRO-3: "
                 "also the parameters, all-gathered per layer before use)")
      ->check(CLI::IsMember({"no_shard", "optim", "optim_grads", "optim_grads_params"}));
  app.add_option("--outer-dp-sharding-strategy", a.outer_dp_sharding_strategy,
                 "Megatron-FSDP's sharding across the --num-distributed-optimizer-instances instances: only no_shard "
                 "(the instances are replicas) is built")
      ->check(CLI::IsMember({"no_shard", "optim"}));
  app.add_option("--num-distributed-optimizer-instances", a.num_distributed_optimizer_instances,
                 "Replicas of the distributed optimizer (hybrid sharding): the data-parallel group splits into this "
                 "many instances of contiguous ranks, each sharding the optimizer state (and with optim_grads / "
                 "optim_grads_params the gradients and parameters) over its ranks; gradients are all-reduced "
                 "across the instances (docs/fsdp.md)")
      ->check(positive_integer());
  app.add_flag("--fsdp-double-buffer", a.fsdp_double_buffer,
               "Megatron-FSDP's persistent double buffers: the communication buffers here are always static "
               "(planned once), so this changes nothing");
  app.add_option("--megatron-fsdp-grad-comm-dtype", a.megatron_fsdp_grad_comm_dtype,
                 "Gradient reduction dtype under --use-megatron-fsdp: fp32, or bf16 (== --grad-reduce-in-bf16)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_flag("--ddp-copy-engine", a.ddp_copy_engine,
               "Data-parallel bucket collectives as copy-engine transfers between the GPUs of one host (no SMs "
               "taken from the compute; falls back to NCCL where the group does not allow it)");
  app.add_option_function<int64_t>(
      "--ddp-bucket-size", [&a](const int64_t& v) { a.ddp_bucket_size = v; },
      "Elements per gradient bucket with --overlap-grad-reduce (default max(40M, 1M x data-parallel size); 0 = one "
      "bucket)")
      ->check(integer_range(0));
  app.add_option("--distributed-timeout-minutes", a.distributed_timeout_minutes,
                 "A collective that does not finish in this time is an error")
      ->check(number_range(0, kNoMax, true))
      ->capture_default_str();
  app.add_option("--nproc-per-node", a.nproc_per_node, "Start N ranks on this machine (local launcher)")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--device", a.device, "cpu, cuda, cuda:N or auto")->capture_default_str();
  app.add_flag("!--no-progress", a.progress, "No progress line on a terminal");
  app.add_option("--cuda-graph-impl", a.cuda_graph.impl,
                 "CUDA graphs: none, local (the scopes of --cuda-graph-scope), full_iteration (the whole "
                 "forward and backward of a step as one graph) or transformer_engine (Megatron's per-layer "
                 "capture: the same as local)")
      ->check(CLI::IsMember({"none", "local", "full_iteration", "transformer_engine"}))
      ->capture_default_str();
  app.add_option("--cuda-graph-scope", a.cuda_graph.scope,
                 "What --cuda-graph-impl local captures: full_iteration, or per layer attn, mlp, moe, moe_router, "
                 "moe_preprocess (with moe_router: the router and the token dispatcher's preprocessing up to its "
                 "first host read)")
      ->check(CLI::IsMember({"full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess"}));
  app.add_option("--cuda-graph-warmup-steps", a.cuda_graph.warmup_steps,
                 "Eager training steps before the CUDA graphs are captured")
      ->check(integer_range(0))
      ->capture_default_str();
  app.add_flag("--cuda-graph-include-optimizer", a.cuda_graph.include_optimizer,
               "With a full-iteration graph: the optimizer step (clip, AdamW, loss scaler, parameter all-gather) "
               "is captured too, so a training step is one graph launch");
  app.parse_complete_callback([&app, &a] {
    a.flags_given.clear();
    for (const CLI::Option* o : app.get_options())
      if (o->count() > 0) a.flags_given.push_back(o->get_name());
    resolve_megatron_fsdp(a);  // at parse: the memory check before validation sees the resolved flags
  });
}

}  // namespace

void add_pretrain_options(CLI::App& app, PretrainArgs& a) {
  // Like argparse (Megatron): a flag given twice takes the last value.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  add_model_options(app, a);
  add_moe_options(app, a);
  add_training_options(app, a);
  data::add_data_options(app, a.data);
  add_checkpoint_options(app, a);
  add_parallel_options(app, a);
  add_megatron_compat_options(app, a);
}

namespace {

constexpr int64_t kMaxLogInterval = 100'000'000;  // 400 MB of buffered losses

// Flags that apply only to a feature: given without it, an error where Megatron-LM refuses them
// too or where its own scripts never pass them without the feature (the MoE flags: a dense model
// would train without a word), a warning where Megatron-LM ignores them silently and scripts
// copied from other configurations carry them (docs/flags.md "Flags of a feature not enabled").
void check_feature_flags(const PretrainArgs& a) {
  const auto given = [&](const std::string& f) {
    return std::find(a.flags_given.begin(), a.flags_given.end(), f) != a.flags_given.end();
  };
  std::vector<std::string> moe;
  for (const std::string& f : a.flags_given)
    if (f.starts_with("--moe-") || f == "--expert-tensor-parallel-size") moe.push_back(f);
  MT_REQUIRE(a.model.num_moe_experts > 0 || moe.empty(),
             "{} given without --num-experts: {} appl{} only to a mixture-of-experts model (--num-experts > 0); "
             "without it the model is dense",
             fmt::join(moe, ", "), moe.size() == 1 ? "it" : "they", moe.size() == 1 ? "ies" : "y");
  std::vector<std::string> mla;
  for (const std::string& f : a.flags_given)
    if (std::find(kMlaFlags.begin(), kMlaFlags.end(), f) != kMlaFlags.end()) mla.push_back(f);
  MT_REQUIRE(a.model.multi_latent_attention || mla.empty(),
             "{} given without --multi-latent-attention: {} appl{} only to multi-latent attention", fmt::join(mla, ", "),
             mla.size() == 1 ? "it" : "they", mla.size() == 1 ? "ies" : "y");
  struct Ignored {
    bool feature_on;
    const char* feature;
    std::vector<std::string> flags;
  };
  const Ignored ignored[] = {
      {a.fp16, "--fp16 (dynamic loss scaling)",
       {"--loss-scale", "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis"}},
      {a.model.position_embedding_type == PositionEmbeddingType::kRope, "--position-embedding-type rope",
       {"--rotary-base", "--rotary-percent", "--rotary-interleaved"}},
      {a.context_parallel_size > 1, "--context-parallel-size > 1",
       {"--cp-comm-type", "--hierarchical-context-parallel-sizes"}},
      {a.model.fp8 != Fp8Format::kNone, "--fp8-format",
       {"--fp8-recipe", "--fp8-margin", "--fp8-amax-history-len", "--fp8-amax-compute-algo",
        "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"}},
      {a.model.mtp_num_layers > 0, "--mtp-num-layers > 0", {"--mtp-loss-scaling-factor"}},
      {!a.tensorboard_dir.empty(), "--tensorboard-dir",
       {"--tensorboard-log-interval", "--log-timers-to-tensorboard", "--log-memory-to-tensorboard",
        "--log-validation-ppl-to-tensorboard"}},
  };
  if (read_launch_env().rank != 0) return;  // warnings once, from rank 0
  for (const Ignored& i : ignored) {
    if (i.feature_on) continue;
    std::vector<std::string> found;
    for (const std::string& f : i.flags)
      if (given(f)) found.push_back(f);
    if (!found.empty())
      log_warn("{} ignored: {} appl{} only with {}", fmt::join(found, ", "), found.size() == 1 ? "it" : "they",
               found.size() == 1 ? "ies" : "y", i.feature);
  }
}

}  // namespace

bool CudaGraphOptions::full_iteration() const {
  return impl == "full_iteration" ||
         (impl == "local" && std::find(scope.begin(), scope.end(), "full_iteration") != scope.end());
}

bool CudaGraphOptions::captures(const std::string& s) const {
  return per_layer() && (scope.empty() || std::find(scope.begin(), scope.end(), s) != scope.end());
}

namespace {

// The capture rules (docs/cuda_graphs.md): flag combinations a captured step cannot honour.
void validate_cuda_graph_args(const PretrainArgs& a) {
  const CudaGraphOptions& g = a.cuda_graph;
  if (!g.enabled()) {
    MT_REQUIRE(g.scope.empty() && !g.include_optimizer,
               "--cuda-graph-scope / --cuda-graph-include-optimizer given with --cuda-graph-impl none");
    return;
  }
  const bool full = g.full_iteration();
  MT_REQUIRE(!full || g.scope.size() <= 1,
             "--cuda-graph-scope full_iteration cannot be combined with per-layer scopes (got {} scopes)",
             g.scope.size());
  const bool preprocess = std::find(g.scope.begin(), g.scope.end(), "moe_preprocess") != g.scope.end();
  // Megatron-Core (TransformerConfig.__post_init__): moe_preprocess extends the router's graph
  MT_REQUIRE(!preprocess || std::find(g.scope.begin(), g.scope.end(), "moe_router") != g.scope.end(),
             "--cuda-graph-scope {}: moe_preprocess needs moe_router as well (the dispatcher's preprocessing is "
             "captured together with the router, as in Megatron-Core); use --cuda-graph-scope moe_router "
             "moe_preprocess",
             fmt::join(g.scope, " "));
  MT_REQUIRE(!preprocess || a.model.num_moe_experts > 0,
             "--cuda-graph-scope moe_preprocess needs a mixture-of-experts model (--num-experts > 0, got {})",
             a.model.num_moe_experts);
  MT_REQUIRE(!g.include_optimizer || full, "--cuda-graph-include-optimizer needs a full-iteration graph");
  MT_REQUIRE(full || a.model.recompute_granularity != RecomputeGranularity::kFull,
             "--cuda-graph-impl local with --recompute-granularity full is not supported: the recomputed layers "
             "share one buffer set, per-layer graphs are keyed by activation slot (use --cuda-graph-impl "
             "full_iteration)");
  MT_REQUIRE(g.warmup_steps >= 1,
             "--cuda-graph-warmup-steps {}: at least 1 eager step is needed before the capture (first-use "
             "initialisation such as the MoE expert bias must not be captured)", g.warmup_steps);
  MT_REQUIRE(a.timing_log_level == 0,
             "--timing-log-level {} with CUDA graphs: the timers of a captured step cannot be recorded "
             "(use --timing-log-level 0)", a.timing_log_level);
  MT_REQUIRE(!a.overlap_param_gather,
             "--overlap-param-gather with CUDA graphs: the next step's forward would wait on an all-gather "
             "issued outside its graph; drop --overlap-param-gather");
  MT_REQUIRE(full || !a.model.moe_router_force_load_balancing || (!g.captures("moe") && !g.captures("moe_router")),
             "--moe-router-force-load-balancing with the per-layer moe / moe_router scope: its random logits are keyed "
             "by the micro-batch on the host (use --cuda-graph-impl full_iteration, or scopes attn mlp)");
  if (a.model.num_moe_experts > 0 && (full || g.captures("moe"))) {  // the MoE block inside a graph
    MT_REQUIRE(a.model.moe_token_dispatcher_type != MoeDispatcher::kAllToAll || a.model.moe_received_token_capacity > 0,
               "--cuda-graph-impl {} with --moe-token-dispatcher-type alltoall needs --moe-received-token-capacity: "
               "without static receive buffers the all-to-all's split sizes are read on the host (a "
               "synchronisation a graph cannot hold)",
               g.impl);
    MT_REQUIRE(a.model.moe_grouped_gemm,
               "--cuda-graph-impl {} with MoE needs --moe-grouped-gemm: without it the experts' row counts are "
               "read on the host (one synchronisation per MoE layer)", g.impl);
  }
}

// --use-megatron-fsdp and its options (docs/fsdp.md): the built strategies become today's flags
// (no_shard: plain DDP; optim: --use-distributed-optimizer); --num-distributed-optimizer-instances
// (hybrid sharding, also with the plain distributed optimizer); the rest is refused, naming it.
void resolve_megatron_fsdp(PretrainArgs& a) {
  const auto given = [&](const std::string& f) {
    return std::find(a.flags_given.begin(), a.flags_given.end(), f) != a.flags_given.end();
  };
  if (!a.use_megatron_fsdp) {
    for (const char* f : {"--data-parallel-sharding-strategy", "--outer-dp-sharding-strategy", "--fsdp-double-buffer",
                          "--megatron-fsdp-grad-comm-dtype"})
      MT_REQUIRE(!given(f), "{} given without --use-megatron-fsdp: it applies only to Megatron-FSDP", f);
  }
  const std::string& s = a.data_parallel_sharding_strategy;
  MT_REQUIRE(s == "no_shard" || s == "optim" || s == "optim_grads" || s == "optim_grads_params",
             "--data-parallel-sharding-strategy {} is not built (docs/fsdp.md); built: no_shard (plain DDP), "
             "optim (the distributed optimizer, ZeRO-1), optim_grads (ZeRO-2) and optim_grads_params (ZeRO-3)",
             s);
  MT_REQUIRE(a.outer_dp_sharding_strategy == "no_shard",
             "--outer-dp-sharding-strategy {} (the optimizer state sharded across instances too) is not built yet; "
             "built: no_shard (the --num-distributed-optimizer-instances instances are replicas)",
             a.outer_dp_sharding_strategy);
  if (a.use_megatron_fsdp) {
    // Megatron-FSDP's scripts pass --use-distributed-optimizer beside every strategy; it is the
    // strategy that decides here, so only no_shard with it is a contradiction.
    MT_REQUIRE(s != "no_shard" || !a.use_distributed_optimizer,
               "--use-distributed-optimizer contradicts --data-parallel-sharding-strategy no_shard (optimizer state "
               "not sharded); use --data-parallel-sharding-strategy optim");
    a.use_distributed_optimizer = s == "optim" || s == "optim_grads" || s == "optim_grads_params";
  }
  // Hybrid sharding (docs/fsdp.md): k replicas of the distributed optimizer, each sharded over
  // DP/k ranks (the division is checked where the group sizes are known: instance_group_size).
  if (const int k = a.num_distributed_optimizer_instances; k != 1) {
    MT_REQUIRE(a.use_distributed_optimizer,
               "--num-distributed-optimizer-instances {} needs the distributed optimizer (--use-distributed-optimizer, "
               "or --use-megatron-fsdp with --data-parallel-sharding-strategy optim, optim_grads or "
               "optim_grads_params): the instances are replicas of the sharded optimizer state",
               k);
    MT_REQUIRE(!a.ddp_copy_engine, "--num-distributed-optimizer-instances {} with --ddp-copy-engine is not built", k);
    MT_REQUIRE(!a.model.fp8_param, "--num-distributed-optimizer-instances {} with --fp8-param-gather is not built",
               k);
    MT_REQUIRE(a.optim.optimizer != "muon", "--num-distributed-optimizer-instances {} with --optimizer muon is not built",
               k);
  }
  if (!a.use_megatron_fsdp) return;
  if (s == "optim_grads" || s == "optim_grads_params") {
    // What the gradient (and parameter) staging (docs/fsdp.md) does not support yet. (The
    // interleaved schedule is built: buckets per model chunk, ParamLayout::split_model_chunks.)
    // The full-iteration graph is built (docs/fsdp.md "CUDA graphs of the whole step"): every step
    // starts and ends with nothing bound, so a replay takes the captured step's bindings. Per-layer
    // graphs are not: they replay one captured layer region for other micro-batches and passes.
    MT_REQUIRE(!a.cuda_graph.enabled() || a.cuda_graph.full_iteration(),
               "--data-parallel-sharding-strategy {} with per-layer CUDA graphs (--cuda-graph-impl {}{}{}) is not "
               "built: a captured layer region holds the addresses of the staging slots its buckets had at the "
               "capture (the gradient slot, bound by the host inside the layer's backward, which a replay skips; "
               "under optim_grads_params also the parameter slot its weights were gathered into), while a "
               "layer's slots depend on what else is bound or in flight when it runs, which can differ between "
               "micro-batches, passes and steps; use --cuda-graph-impl full_iteration (docs/fsdp.md)",
               s, a.cuda_graph.impl, a.cuda_graph.scope.empty() ? "" : " --cuda-graph-scope ",
               fmt::join(a.cuda_graph.scope, " "));
    MT_REQUIRE(!a.ddp_copy_engine, "--data-parallel-sharding-strategy {} with --ddp-copy-engine is not built", s);
  }
  if (s == "optim_grads_params") {
    // What the parameter staging (docs/fsdp.md "optim_grads_params") does not support.
    MT_REQUIRE(a.model.fp8 == Fp8Format::kNone,
               "--data-parallel-sharding-strategy optim_grads_params with --fp8-format is not built (the FP8 weights "
               "are quantised from whole parameters once per step; docs/fsdp.md)");
    MT_REQUIRE(!a.overlap_param_gather,
               "--overlap-param-gather with --data-parallel-sharding-strategy optim_grads_params: the parameters are "
               "all-gathered per layer before use (prefetched), not after the optimizer step; drop the flag");
    MT_REQUIRE(a.optim.optimizer != "muon",
               "--optimizer muon with --data-parallel-sharding-strategy optim_grads_params is not built (Muon reads "
               "whole gradient matrices)");
  }
  if (a.megatron_fsdp_grad_comm_dtype == "bf16") a.grad_reduce_in_bf16 = true;
  MT_REQUIRE(a.megatron_fsdp_grad_comm_dtype != "fp32" || !a.grad_reduce_in_bf16,
             "--megatron-fsdp-grad-comm-dtype fp32 contradicts --grad-reduce-in-bf16");
}

}  // namespace

void validate_pretrain_args(PretrainArgs& a) {
  check_megatron_compat(a);
  // Megatron's Transformer Engine capture is per layer, what local does here (docs/cuda_graphs.md).
  if (a.cuda_graph.impl == "transformer_engine") a.cuda_graph.impl = "local";
  check_feature_flags(a);
  validate_cuda_graph_args(a);
  MT_REQUIRE(!(a.bf16 && a.fp16), "--bf16 and --fp16 are mutually exclusive");
  // Megatron: --num-query-groups only takes effect with --group-query-attention.
  MT_REQUIRE(!(a.model.multi_latent_attention && a.group_query_attention),
             "--group-query-attention is mutually exclusive with --multi-latent-attention (Megatron's rule: MLA gives "
             "every head its own key and value)");
  MT_REQUIRE(a.group_query_attention || a.model.num_query_groups == 0,
             "--num-query-groups {} given without --group-query-attention", a.model.num_query_groups);
  MT_REQUIRE(!a.group_query_attention || a.model.num_query_groups > 0,
             "--group-query-attention needs --num-query-groups (a positive number of key/value heads)");
  if (a.model.num_moe_experts > 0) {
    a.model.moe_layer_pattern = parse_moe_layer_freq(a.moe_layer_freq, a.model.num_layers);
    MT_REQUIRE(a.expert_model_parallel_size >= 1, "--expert-model-parallel-size must be >= 1, got {}",
               a.expert_model_parallel_size);
    MT_REQUIRE(a.expert_tensor_parallel_size >= 0, "--expert-tensor-parallel-size must be >= 1, got {}",
               a.expert_tensor_parallel_size);
  } else {
    MT_REQUIRE(a.expert_model_parallel_size == 1, "--expert-model-parallel-size {} needs --num-experts",
               a.expert_model_parallel_size);
  }
  MT_REQUIRE(a.micro_batch_size > 0, "--micro-batch-size must be positive, got {}", a.micro_batch_size);
  MT_REQUIRE(a.data_parallel_size >= 1 && a.micro_batch_size <= INT64_MAX / a.data_parallel_size,
             "--micro-batch-size {} times data-parallel size {} overflows a 64-bit integer", a.micro_batch_size,
             a.data_parallel_size);
  if (a.global_batch_size == 0) a.global_batch_size = a.micro_batch_size * a.data_parallel_size;
  MT_REQUIRE(a.global_batch_size > 0, "--global-batch-size must be positive, got {}", a.global_batch_size);
  MT_REQUIRE(a.global_batch_size % (a.micro_batch_size * a.data_parallel_size) == 0,
             "--global-batch-size {} is not divisible by --micro-batch-size {} times data-parallel size {}",
             a.global_batch_size, a.micro_batch_size, a.data_parallel_size);
  resolve_batch_schedule(a);
  resolve_sample_based_training(a);
  MT_REQUIRE(a.distributed_timeout_minutes > 0, "--distributed-timeout-minutes must be positive, got {}",
             a.distributed_timeout_minutes);
  MT_REQUIRE(!a.overlap_param_gather || a.use_distributed_optimizer,
             "--overlap-param-gather requires --use-distributed-optimizer (Megatron: only supported with the "
             "distributed optimizer)");
  MT_REQUIRE(!a.overlap_param_gather || a.overlap_grad_reduce,
             "--overlap-param-gather requires --overlap-grad-reduce");
  MT_REQUIRE(!a.model.fp8_param || a.use_distributed_optimizer,
             "--fp8-param-gather requires --use-distributed-optimizer (the distributed optimizer gathers the FP8 "
             "weights, as in Megatron)");
  MT_REQUIRE(!a.model.fp8_param || a.model.fp8 != Fp8Format::kNone, "--fp8-param-gather needs --fp8-format");
  // Not a flag: delayed scaling's fused FP8 producers (docs/fp8.md "What fuses") for measurements
  // (bench/fp8_profile.sh): MT_FP8_FUSED_PRODUCERS=1 the norms' and the activation's (SwiGLU or
  // GELU), =act the activation's (the default), =0 none.
  if (const char* e = std::getenv("MT_FP8_FUSED_PRODUCERS")) {
    const std::string v(e);
    MT_REQUIRE(v == "1" || v == "act" || v == "0", "MT_FP8_FUSED_PRODUCERS={}: expected 1, act or 0", v);
    a.model.fp8_fused_norm = v == "1";
    a.model.fp8_fused_activation = v != "0";
  }
  // Megatron: with bf16 and the default fp32 --main-params-dtype this stores the main parameters
  // as remainders (optimizer_config.py store_param_remainders). Unlike Megatron it does not need
  // --use-distributed-optimizer.
  MT_REQUIRE(!a.use_precision_aware_optimizer || a.bf16,
             "--use-precision-aware-optimizer needs --bf16 (it stores the fp32 main parameters as int16 remainders "
             "beside bf16 parameters), got model dtype {}",
             dtype_name(a.dtype()));
  a.optim.store_param_remainders = a.use_precision_aware_optimizer;
  MT_REQUIRE(!a.ddp_bucket_size || *a.ddp_bucket_size >= 0, "--ddp-bucket-size must be >= 0 elements, got {}",
             a.ddp_bucket_size.value_or(0));
  MT_REQUIRE(a.train_iters > 0, "--train-iters must be positive, got {}", a.train_iters);
  MT_REQUIRE(a.lr >= 0, "--lr must be >= 0, got {}", a.lr);
  MT_REQUIRE(a.log_interval > 0, "--log-interval must be positive, got {}", a.log_interval);
  // The trainer keeps the loss of every iteration of a log interval on the device. An interval
  // longer than the run logs as one of --train-iters does (at the last iteration only), so it is
  // shortened to that; what remains is bounded (4 bytes per iteration).
  MT_REQUIRE(std::min(a.log_interval, a.train_iters) <= kMaxLogInterval,
             "--log-interval {} with --train-iters {}: at most {} iterations per log line (the losses of one "
             "interval are kept on the device, 4 bytes per iteration)",
             a.log_interval, a.train_iters, kMaxLogInterval);
  a.log_interval = std::min(a.log_interval, a.train_iters);
  MT_REQUIRE(a.eval_interval > 0, "--eval-interval must be positive, got {}", a.eval_interval);
  MT_REQUIRE(a.eval_iters >= 0, "--eval-iters must be >= 0, got {}", a.eval_iters);
  Timers::check_level(a.timing_log_level);
  parse_timing_log_option(a.timing_log_option);
  MT_REQUIRE(a.save_interval >= 0, "--save-interval must be >= 0, got {}", a.save_interval);
  MT_REQUIRE(a.exit_interval >= 0, "--exit-interval must be >= 0, got {}", a.exit_interval);
  MT_REQUIRE(a.save_interval == 0 || !a.save.empty(), "--save-interval {} given without --save", a.save_interval);
  MT_REQUIRE(a.exit_duration_in_mins >= 0, "--exit-duration-in-mins must be >= 0, got {}", a.exit_duration_in_mins);
  MT_REQUIRE(!a.async_save || !a.save.empty(), "--async-save given without --save");
  MT_REQUIRE(a.tensorboard_log_interval > 0, "--tensorboard-log-interval must be positive, got {}",
             a.tensorboard_log_interval);
  MT_REQUIRE(a.data.mock_data || !a.data.data_path.empty() || !a.data.train_data_path.empty(),
             "no training data: give --data-path (or --train-data-path), or --mock-data");
  MT_REQUIRE(a.loss_scale >= 0, "--loss-scale must be >= 0, got {}", a.loss_scale);
  MT_REQUIRE(a.min_loss_scale > 0, "--min-loss-scale must be positive, got {}", a.min_loss_scale);
  MT_REQUIRE(a.initial_loss_scale >= a.min_loss_scale, "--initial-loss-scale {} is below --min-loss-scale {}",
             a.initial_loss_scale, a.min_loss_scale);
  MT_REQUIRE(a.loss_scale_window > 0, "--loss-scale-window must be positive, got {}", a.loss_scale_window);
  MT_REQUIRE(a.hysteresis > 0, "--hysteresis must be positive, got {}", a.hysteresis);
  auto& sc = a.optim.scaler;
  sc.dynamic = a.fp16 && a.loss_scale == 0;
  sc.initial_scale = a.fp16 ? (a.loss_scale > 0 ? a.loss_scale : a.initial_loss_scale) : 1.f;
  sc.min_scale = a.min_loss_scale;
  sc.growth_interval = a.loss_scale_window;
  sc.hysteresis = a.hysteresis;
  a.model.validate(a.tensor_model_parallel_size);
  MT_REQUIRE(a.optim.optimizer == "adam" || a.optim.optimizer == "muon", "--optimizer '{}' is not one of adam, muon",
             a.optim.optimizer);
  if (a.optim.optimizer == "muon") {
    // Megatron's _get_qkv_split_shapes: a query group's rows of Q, K and V in linear_qkv.
    a.optim.muon.qkv_q_rows = a.model.num_attention_heads / a.model.query_groups() * a.model.head_dim();
    a.optim.muon.qkv_kv_rows = a.model.head_dim();
    validate_muon_config(a.optim.muon);
  }
  (void)learning_rate(a.lr_schedule(), 0);  // validates the schedule
  // Megatron ignores --decoupled-min-lr without --decoupled-lr; so does this.
  a.optim.decoupled_lr = a.decoupled_lr >= 0;
  if (a.optim.decoupled_lr) {
    try {
      (void)learning_rate(a.decoupled_lr_schedule(), 0);
    } catch (const Error& e) {
      MT_FAIL("--decoupled-lr {} / --decoupled-min-lr {}: the embedding and output layer's schedule is invalid: {}",
              a.decoupled_lr, a.decoupled_min_lr >= 0 ? fmt::format("{}", a.decoupled_min_lr) : "unset (--min-lr)",
              e.what());
    }
  }
}

void add_generate_options(CLI::App& app, GenerateArgs& a) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--load", a.load, "Checkpoint directory")->required();
  app.add_option("--vocab-file", a.vocab_file, "GPT-2 vocab.json / encoder.json");
  app.add_option("--merge-file", a.merge_file, "GPT-2 merges.txt / vocab.bpe");
  app.add_option("--tokenizer-type", a.tokenizer_type, "Tokenizer of --tokenizer-model")->capture_default_str();
  app.add_option("--tokenizer-model", a.tokenizer_model,
                 "tokenizer.json (HuggingFaceTokenizer) or SentencePiece model; default: the files import-hf "
                 "stored beside the checkpoint");
  data::add_tiktoken_options(app, a.tiktoken);
  app.add_option("--prompt", a.prompts, "Text to continue (repeat for a batch of prompts)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--prompt-file", a.prompt_file, "File with one prompt per line (added to --prompt)");
  app.add_option("--out-seq-length,--max-new-tokens", a.out_seq_length, "Tokens to generate per prompt")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--micro-batch-size", a.micro_batch_size, "Prompts generated together (0 = all)")
      ->check(integer_range(0))
      ->capture_default_str();
  app.add_option("--seq-length", a.seq_length,
                 "Context length: prompt + generated tokens (0 = the checkpoint's --seq-length)")
      ->check(integer_range(0))
      ->capture_default_str();
  app.add_flag("--no-kv-cache", a.no_kv_cache, "Recompute the whole prefix for every token (reference path)");
  app.add_option("--tensor-model-parallel-size", a.tensor_model_parallel_size, "Tensor-parallel size")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--pipeline-model-parallel-size", a.pipeline_model_parallel_size, "Pipeline-parallel size")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_option("--nproc-per-node", a.nproc_per_node, "Start N ranks on this machine (local launcher)")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_flag("--bf16", a.bf16, "bf16 weights and activations (CUDA)");
  app.add_flag("--fp16", a.fp16, "fp16 weights and activations (CUDA)");
  app.add_option("--temperature", a.temperature, "Sampling temperature")
      ->check(number_range(0, kNoMax, true))
      ->capture_default_str();
  app.add_option("--top-k", a.top_k, "Sample from the k most likely tokens (0 = off)")
      ->check(integer_range(0))
      ->capture_default_str();
  app.add_option("--top-p", a.top_p, "Nucleus sampling probability mass (0 = off)")
      ->check(number_range(0, 1))
      ->capture_default_str();
  app.add_flag("--greedy", a.greedy, "Greedy decoding (argmax)");
  app.add_option("--seed", a.seed, "Sampling seed")->capture_default_str();
  app.add_option("--device", a.device, "cpu, cuda, cuda:N or auto")->capture_default_str();
  app.add_option("--num-samples", a.num_samples, "Number of samples")->check(positive_integer())->capture_default_str();
}

}  // namespace mt
