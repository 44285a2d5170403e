// N ranks produce what 1 rank produces (docs/architecture.md principle 4), ranks as threads on CPU in fp32:
// tensor parallelism (TP 2, 4; with and without sequence parallelism) x data parallelism (with
// and without the distributed optimizer); pipeline parallelism PP in {2, 4} x VPP in {1, 2} x
// micro-batches in {PP, 2·PP, 3·PP}, uneven first/last stages, a micro-batch group size; combined
// TP·PP·DP layouts; overlapped bucket reduction and parameter all-gather; MoE with expert
// parallelism and both token dispatchers; multi-latent attention (Mla/*). For each: three training iterations with
// dropout, weight decay and clipping; the losses of every iteration, the gradients of the last
// iteration and the parameters after it, gathered from every stage and shard, equal the
// single-rank run (rel. 1e-5). Also: the buffer plans' memory bounds, and errors for mismatched
// layouts before any communication.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <random>

#include "comm/thread_comm.h"
#include "core/cuda_graph.h"
#include "model/gpt_model.h"
#include "model/layer_graphs.h"
#include "model/layers/multi_token_prediction.h"
#include "optim/grad_sync.h"
#include "ops/elementwise.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include "testing/testing.h"
#include "shard_gather.h"
#include "train/pipeline.h"
#include "train/train_step.h"
#include "train/training_setup.h"

namespace mt {
namespace {

using testing::OwnedTensor;
using testing::place;

constexpr int kIters = 3;

/// The model families under test: GPT-2 style, Llama style (GQA with query groups < heads, RoPE,
/// SwiGLU, RMSNorm, untied output layer, no biases) and Qwen 3 style (Llama + QK-norm + QKV bias).
/// kMoe: the Llama style with MoE layers in layers 1, 3, 5, 7 (4 experts, top-2, load-balancing
/// and z-losses); kMoeSigmoid: MoE in every layer with a DeepSeek-style router (sigmoid scores,
/// group-limited top-k, scaling, the sequence-level load-balancing loss, the aux-loss-free expert
/// bias with a large update rate so that the selection changes between iterations) and a shared
/// expert; kMoeForced: kMoe with --moe-router-force-load-balancing (random logits keyed by the
/// global token); kMoeGlobal: kMoe with --moe-router-load-balancing-type global_aux_loss and no dropout
/// (its single-rank reference runs the union of the DP ranks' micro-batches as one micro-batch,
/// whose dropout masks would be keyed differently); kMoeFp64: kMoe with --moe-router-dtype fp64 (the
/// router GEMM and the routing math in double); kMoeMultiLb: kMoe with two load-balancing types at once
/// (aux_loss 0.1 and seq_aux_loss 0.05, Megatron's list) and a gated shared expert
/// (--moe-shared-expert-gate).
/// kMla: the Llama style with multi-latent attention (query latent, YaRN with positions beyond
/// the original context, mscale_all_dim, v heads padded to d_n + d_r); kMlaNoLora: a full query
/// projection, plain RoPE, q/k heads padded to d_v; kMlaMoe: kMla with kMoe's MoE layers.
enum class Arch { kGpt, kLlama, kQwen, kMoe, kMoeSigmoid, kMoeForced, kMoeGlobal, kMoeFp64, kMoeMultiLb,
                  kMla, kMlaNoLora, kMlaMoe };

TransformerConfig config(Arch arch = Arch::kGpt) {
  TransformerConfig c;
  c.num_layers = 8;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.seq_length = 8;
  c.vocab_size = 61;  // padded to 64 for tp 1, 2 and 4
  c.make_vocab_size_divisible_by = 8;
  c.hidden_dropout = 0.1f;
  c.attention_dropout = 0.1f;
  c.init_method_std = 0.1f;
  if (arch != Arch::kGpt) {
    c.hidden_size = 32;
    c.num_attention_heads = 8;
    c.num_query_groups = 4;  // two query heads per group; TP 4 keeps one group per rank
    c.ffn_hidden_size = 48;
    c.gated_linear_unit = true;
    c.normalization = Normalization::kRMSNorm;
    c.position_embedding_type = PositionEmbeddingType::kRope;
    c.rotary_percent = 0.5f;  // 2 of 4 channels: the pass-through part is exercised too
    c.untie_embeddings_and_output_weights = true;
    c.add_bias_linear = false;
  }
  if (arch == Arch::kMla || arch == Arch::kMlaNoLora || arch == Arch::kMlaMoe) {
    c.num_attention_heads = 4;  // TP 4 keeps one head per rank
    c.num_query_groups = 0;
    c.rotary_percent = 1.f;
    c.multi_latent_attention = true;
    c.kv_lora_rank = 8;
    c.qk_head_dim = 6;
    c.qk_pos_emb_head_dim = 4;
    if (arch == Arch::kMlaNoLora) {
      c.rope_type = RopeType::kRope;
      c.v_head_dim = 12;  // > d_n + d_r = 10: the query/key heads padded
    } else {
      c.q_lora_rank = 12;
      c.v_head_dim = 5;  // < 10: the value heads padded
      c.rotary_scaling_factor = 4.f;
      c.original_max_position_embeddings = 4;  // < seq_length 8
      c.beta_fast = 4.f;
      c.beta_slow = 1.f;
      c.mscale = 0.9f;
      c.mscale_all_dim = 0.7f;
    }
  }
  if (arch == Arch::kMoe || arch == Arch::kMoeSigmoid || arch == Arch::kMoeForced || arch == Arch::kMoeGlobal ||
      arch == Arch::kMoeFp64 || arch == Arch::kMoeMultiLb || arch == Arch::kMlaMoe) {
    c.num_moe_experts = 4;
    c.moe_ffn_hidden_size = 24;
    c.moe_router_topk = 2;
    c.moe_aux_loss_coeff = {0.1f};
    c.moe_z_loss_coeff = 0.01f;
    if (arch != Arch::kMoeSigmoid) {
      c.moe_layer_pattern = parse_moe_layer_freq("[0,1]*4", c.num_layers);
      c.moe_router_force_load_balancing = arch == Arch::kMoeForced;
      if (arch == Arch::kMoeFp64) c.moe_router_dtype = DType::kF64;
      if (arch == Arch::kMoeMultiLb) {
        c.moe_router_load_balancing_type = {MoeLoadBalancing::kAuxLoss, MoeLoadBalancing::kSeqAuxLoss};
        c.moe_aux_loss_coeff = {0.1f, 0.05f};
        c.moe_shared_expert_intermediate_size = 16;  // and a gated shared expert (Qwen 2 MoE's)
        c.moe_shared_expert_gate = true;
      }
      if (arch == Arch::kMoeGlobal) {
        c.moe_router_load_balancing_type = {MoeLoadBalancing::kGlobalAuxLoss};
        c.hidden_dropout = c.attention_dropout = 0.f;
      }
    } else {
      c.moe_router_load_balancing_type = {MoeLoadBalancing::kSeqAuxLoss};
      c.moe_router_enable_expert_bias = true;
      c.moe_router_bias_update_rate = 0.05f;
      c.moe_router_score_function = MoeScoreFunction::kSigmoid;
      c.moe_router_num_groups = 2;
      c.moe_router_group_topk = 1;
      c.moe_router_topk_scaling_factor = 2.f;
      c.moe_shared_expert_intermediate_size = 16;
    }
  }
  if (arch == Arch::kQwen) {
    c.add_qkv_bias = true;
    c.qk_layernorm = true;
    c.kv_channels = 8;  // heads·kv_channels = 64 != hidden 32, as Qwen 3 allows
  }
  return c;
}

constexpr float kDecoupledLr = 3e-2f;  // --decoupled-lr of the layouts that set it (--lr: 1e-2)

struct Layout {
  Arch arch = Arch::kGpt;
  /// Vocabulary 67 padded to a multiple of 8·TP (72, 80, 96 at TP 1, 2, 4): the padding differs
  /// between the layouts, and must not change the losses or the real rows' gradients.
  bool odd_vocab = false;
  bool flash = false;  ///< --attention-backend flash (the CPU reference of the flash kernels)
  int tp = 1, pp = 1, dp = 1, vpp = 0;
  int ep = 1, etp = 0;  // MoE: expert model / tensor parallel sizes (etp 0 = tp)
  int micro_total = 1;  // micro-batches per iteration over all DP ranks
  int64_t first = -1, last = -1;  // --decoder-first/last-pipeline-num-layers
  int group_size = 0;             // --microbatch-group-size-per-virtual-pipeline-stage
  bool sp = false, zero = false;
  bool overlap = false;  // --overlap-grad-reduce (+ --overlap-param-gather with zero), small buckets
  bool a2a = false;      // MoE: --moe-token-dispatcher-type alltoall (the reference is allgather)
  // MoE token dropping (the reference drops alike: its micro-batches have the ranks' token count)
  double capacity = 0;       // --moe-expert-capacity-factor (0 = dropless)
  bool drop_position = false;  // --moe-token-drop-policy position (else probs)
  bool pad = false;          // --moe-pad-expert-input-to-capacity
  bool grouped = false;      // --moe-grouped-gemm (the reference runs the per-expert loop)
  int echo = 0;              // --moe-enable-echo with this many spare slots per EP rank (alltoall)
  int64_t received = 0;      // --moe-received-token-capacity (static alltoall blocks; large: no overflow)
  bool slot_keys = false;    // per-layer CUDA graph mode: dropout keyed by the slot's device micro-batch key
  // per-layer CUDA graphs with --cuda-graph-scope moe_router moe_preprocess (eager on the CPU: the
  // region split, router + dispatcher preprocessing and their backward, must not change results)
  bool preprocess = false;
  // Activation recompute (the reference keeps everything): 's' selective (core_attn), 'm'
  // selective layernorm + mlp_act + moe_act, 'M' selective layernorm + mlp, 'u' full uniform, 'b'
  // full block, with recompute_layers (--recompute-num-layers)
  char recompute = 0;
  int recompute_layers = 0;
  int64_t head_chunk = 0;  // rows per chunk of the LM head's logits (0: the default, all 16 rows)
  bool tp_overlap = false;  // --tp-comm-overlap (with sp)
  bool overlap_p2p = false;  // --overlap-p2p-communication (pipeline transfers on their own stream)
  bool decoupled_lr = false;  // --decoupled-lr: the embedding and output layer step at kDecoupledLr
  bool one_p = false;         // --apply-layernorm-1p: norm weights zero-centred (scale 1 + w)
  int mtp = 0;         // --mtp-num-layers (the MTP layers on the last stage)
  bool tied = false;   // the Llama / MoE families with a tied output layer
  // Reference only: each micro-batch is the union (along b) of `merge` consecutive sample groups,
  // i.e. of the DP ranks' micro-batches of one step (global_aux_loss: the global micro-batch).
  int merge = 1;
  std::string name() const {
    std::string s = fmt::format("{}{}tp{}_pp{}_dp{}_vpp{}_m{}",
                                arch == Arch::kGpt     ? ""
                                : arch == Arch::kLlama ? "llama_"
                                : arch == Arch::kQwen  ? "qwen_"
                                : arch == Arch::kMoe   ? "moe_"
                                : arch == Arch::kMoeForced ? "moe_forced_"
                                : arch == Arch::kMoeGlobal ? "moe_global_"
                                : arch == Arch::kMoeFp64   ? "moe_fp64_"
                                : arch == Arch::kMoeMultiLb ? "moe_multilb_"
                                : arch == Arch::kMla        ? "mla_"
                                : arch == Arch::kMlaNoLora  ? "mla_nolora_"
                                : arch == Arch::kMlaMoe     ? "mla_moe_"
                                                       : "moe_sigmoid_",
                                std::string(odd_vocab ? "vocab67_" : "") + (flash ? "flash_" : ""), tp, pp, dp, vpp,
                                micro_total);
    if (first >= 0) s += fmt::format("_first{}", first);
    if (last >= 0) s += fmt::format("_last{}", last);
    if (group_size > 0) s += fmt::format("_g{}", group_size);
    if (ep > 1) s += fmt::format("_ep{}", ep);
    if (etp > 0) s += fmt::format("_etp{}", etp);
    if (sp) s += "_sp";
    if (zero) s += "_distopt";
    if (overlap) s += "_overlap";
    if (a2a) s += "_a2a";
    if (capacity > 0) s += fmt::format("_cap{}{}{}", static_cast<int>(capacity * 100), drop_position ? "_pos" : "",
                                       pad ? "_pad" : "");
    if (grouped) s += "_gg";
    if (echo > 0) s += fmt::format("_echo{}", echo);
    if (received > 0) s += fmt::format("_recv{}", received);
    if (slot_keys) s += "_slotkeys";
    if (head_chunk > 0) s += fmt::format("_headchunk{}", head_chunk);
    if (tp_overlap) s += "_tpoverlap";
    if (overlap_p2p) s += "_p2poverlap";
    if (decoupled_lr) s += "_decoupledlr";
    if (one_p) s += "_layernorm1p";
    if (mtp > 0) s += fmt::format("_mtp{}", mtp);
    if (tied) s += "_tied";
    if (preprocess) s += "_moe_preprocess";
    if (recompute == 's') s += "_rc_selective";
    if (recompute == 'm') s += "_rc_norm_act";
    if (recompute == 'M') s += "_rc_norm_mlp";
    if (recompute == 'L') s += "_rc_mla_up_proj";
    if (recompute == 'u' || recompute == 'b')
      s += fmt::format("_rc_{}{}", recompute == 'u' ? "uniform" : "block", recompute_layers);
    return s;
  }
};

struct Result {
  std::vector<double> losses;
  std::map<std::string, int64_t> vocab_numel;  // vocabulary tensors: elements of the real rows
  std::map<std::string, std::vector<float>> grads, params;
  std::map<std::string, std::vector<float>> copy_params;  // the last stage's embedding copy
  std::vector<int> slots;                                 // per pipeline rank: activation slots
  std::vector<double> mtp;  // per MTP depth: its losses over the iterations, summed over DP
  int64_t rerouted = 0;    // ECHO: slots sent to clones, summed over the ranks and layers
  int64_t overflowed = 0;  // --moe-received-token-capacity: slots dropped, summed likewise
  int64_t echo_bytes = 0;  // ECHO's used-slot transfers: bytes written, summed over the ranks
};


// Forwards to GradSync, counting grads_ready reports per parameter (the ParamGradHooks contract).
struct CountingHooks final : ParamGradHooks {
  CountingHooks(GradSync& s, size_t n) : sync(s), counts(n, 0) {}
  void params_needed(size_t first, size_t end, const Stream& st) override { sync.params_needed(first, end, st); }
  void grads_ready(size_t first, size_t end, const Stream& st) override {
    for (size_t i = first; i < end; ++i) ++counts[i];
    sync.grads_ready(first, end, st);
  }
  GradSync& sync;
  std::vector<int> counts;
};

Result run_layout(const Layout& L, const std::vector<int32_t>& tokens, const std::vector<int32_t>& labels,
                  int64_t mb) {
  TransformerConfig c = config(L.arch);
  if (L.odd_vocab) c.vocab_size = 67;
  if (L.flash) c.attention_backend = AttentionBackend::kFlash;
  if (L.a2a) c.moe_token_dispatcher_type = MoeDispatcher::kAllToAll;
  c.moe_grouped_gemm = L.grouped;
  c.moe_enable_echo = L.echo > 0;
  c.moe_num_echo_experts = L.echo;
  c.moe_received_token_capacity = L.received;
  c.tp_comm_overlap = L.tp_overlap;
  c.layernorm_zero_centered_gamma = L.one_p;
  if (L.recompute == 'L') {  // the local attention's recompute reads the packed qkv: re-made from the latents
    c.recompute_granularity = RecomputeGranularity::kSelective;
    c.recompute_modules = parse_recompute_modules({"core_attn", "mla_up_proj"});
  }
  c.mtp_num_layers = L.mtp;
  c.mtp_loss_scaling_factor = 0.5f;  // large enough that the MTP gradients matter
  if (L.tied) c.untie_embeddings_and_output_weights = false;
  if (L.recompute == 's' || L.recompute == 'm' || L.recompute == 'M') {
    c.recompute_granularity = RecomputeGranularity::kSelective;
    if (L.recompute != 's')
      c.recompute_modules = RecomputeModules{false, true, L.recompute == 'M', L.recompute == 'm', L.recompute == 'm'};
  }
  if (L.recompute == 'u' || L.recompute == 'b') {
    c.recompute_granularity = RecomputeGranularity::kFull;
    c.recompute_method = L.recompute == 'u' ? RecomputeMethod::kUniform : RecomputeMethod::kBlock;
    c.recompute_method_set = true;
    c.recompute_num_layers = L.recompute_layers;
  }
  if (L.capacity > 0) {
    c.moe_expert_capacity_set = true;
    c.moe_expert_capacity_factor = L.capacity;
    c.moe_token_drop_policy = L.drop_position ? MoeTokenDropPolicy::kPosition : MoeTokenDropPolicy::kProbs;
    c.moe_pad_expert_input_to_capacity = L.pad;
  }
  const int64_t S = c.seq_length;
  const int world_size = L.tp * L.pp * L.dp;
  const int M = L.micro_total / (L.dp * L.merge);
  const int64_t B = mb * L.merge;  // the micro-batch size
  Result out;
  out.losses.assign(kIters, 0.0);
  out.slots.resize(static_cast<size_t>(L.pp));
  out.mtp.assign(static_cast<size_t>(L.mtp), 0.0);
  std::mutex mu;
  run_thread_ranks(world_size, [&](int, std::shared_ptr<Communicator> world) {
    ModelSetupOptions o;
    o.model = c;
    o.parallel.tp = L.tp;
    o.parallel.pp = L.pp;
    o.parallel.vpp = L.vpp;
    o.parallel.ep = L.ep;
    o.parallel.etp = L.etp;
    o.pipeline.first_stage_layers = L.first;
    o.pipeline.last_stage_layers = L.last;
    o.num_microbatches = M;
    o.microbatch_group_size = L.group_size;
    o.overlap_p2p_comm = L.overlap_p2p;
    o.micro_batch_size = B;
    o.sequence_parallel = L.sp;
    // With overlap: buckets of ~2 layers, reductions started by the model's grads_ready reports
    // (the tied embedding's after the embedding-group all-reduce).
    o.param_layout.bucket_size = L.overlap ? 2000 : 0;
    o.ddp = DdpConfig{L.overlap, L.overlap && L.zero, L.zero};
    o.optim.weight_decay = 0.1f;
    o.optim.clip_grad = 0.05f;  // active: the step depends on the global norm over all stages
    // Adam's m / (sqrt(v) + eps) turns a small relative gradient difference on a near-zero
    // element into an O(1) update difference (the key bias has an exactly-zero gradient, so its
    // fp32 value is pure rounding noise); eps 1e-3 keeps updates proportional to the gradients,
    // so parameters compare at the gradients' precision.
    o.optim.eps = 1e-3f;
    o.optim.decoupled_lr = L.decoupled_lr;
    if (L.head_chunk > 0) o.head_chunk_bytes = static_cast<size_t>(L.head_chunk * c.padded_vocab_size(L.tp) / L.tp) * 4;
    Stream st(Device::cpu());
    ModelSetup setup(world, o, st);
    const ProcessGroups& g = setup.groups();
    const int pp_rank = g.pp->rank();
    const PipelinePlan& plan = setup.train_plan();
    GPTModel& model = setup.model();
    PipelineExecutor& executor = setup.executor();
    EXPECT_EQ(executor.overlaps_p2p(), L.overlap_p2p && L.pp > 1);
    if (L.slot_keys || L.preprocess) executor.use_slot_keys();
    LayerGraphs graphs(false, false, false, /*moe_router=*/true, /*moe_preprocess=*/true);
    if (L.preprocess) {
      graphs.set_capturing(true);  // the CPU runs every region eagerly (model/layer_graphs.h)
      model.set_layer_graphs(&graphs);
    }
    GradSync& sync = setup.grad_sync();
    AdamWOptimizer& opt = setup.optimizer();
    CountingHooks reports(sync, model.params().size());
    model.set_hooks(&reports);
    model.params().initialize(1234, st);
    if (L.overlap && pp_rank == 0) EXPECT_GT(model.params().buckets().size(), 2u);
    const int d = g.dp->rank();
    std::vector<OwnedTensor> tok, lab, mtp_tok, mtp_lab, mtp_mask;
    std::vector<MicroBatch> mbs;
    for (int m = 0; m < M; ++m) {
      const int64_t gm = static_cast<int64_t>(m) * L.dp + d;  // Megatron's sampler order
      std::vector<int32_t> t(S * B), l(S * B);
      for (int64_t q = 0; q < L.merge; ++q)  // sample group gm·merge + q at columns [q·mb, (q + 1)·mb)
        for (int64_t i = 0; i < S; ++i)
          for (int64_t j = 0; j < mb; ++j) {
            t[i * B + q * mb + j] = tokens[(gm * L.merge + q) * S * mb + i * mb + j];
            l[i * B + q * mb + j] = labels[(gm * L.merge + q) * S * mb + i * mb + j];
          }
      tok.push_back(testing::make_int_tensor(t, Device::cpu(), {S, B}, st));
      lab.push_back(testing::make_int_tensor(l, Device::cpu(), {S, B}, st));
      if (L.mtp > 0) {
        const MtpInputs in = make_mtp_inputs(L.mtp, S, B, t.data(), l.data(), nullptr);
        mtp_tok.push_back(testing::make_int_tensor(in.tokens, Device::cpu(), {L.mtp, S, B}, st));
        mtp_lab.push_back(testing::make_int_tensor(in.labels, Device::cpu(), {L.mtp, S, B}, st));
        mtp_mask.push_back(testing::make_tensor(in.loss_mask, DType::kF32, Device::cpu(), {L.mtp, S, B}, st));
      }
    }
    OwnedTensor loss(DType::kF32, Device::cpu(), {1});
    for (int m = 0; m < M; ++m) {
      MicroBatch b{tok[m].t, lab[m].t, Tensor()};
      b.loss_weight = 1.0f / static_cast<float>(S * B * M * L.dp);
      b.aux_loss_weight = 1.0f / static_cast<float>(M * L.dp);
      if (L.mtp > 0) {
        b.mtp_tokens = mtp_tok[m].t;
        b.mtp_labels = mtp_lab[m].t;
        b.mtp_loss_mask = mtp_mask[m].t;
      }
      mbs.push_back(b);
    }
    // docs/architecture.md principles 1 and 5: after the first step (first-use initialisation) a
    // training step allocates nothing and never waits on the host, except the MoE paths that read
    // expert counts or split sizes on the host (without --moe-grouped-gemm, or the alltoall
    // dispatcher without static receive blocks). On the CPU a host read needs no synchronisation,
    // so this counts explicit Stream::synchronize calls (the `_sync` functions); on CUDA the
    // full-iteration graph capture (tests/train/cuda_graph_cuda_test.cpp) fails on any.
    const bool host_counts = c.num_moe_experts > 0 && (!L.grouped || (L.a2a && L.received == 0));
    for (int it = 0; it < kIters; ++it) {
      fill(loss, 0.f, st);
      const uint64_t allocs = buffer_allocation_count(), syncs = host_sync_count();
      StepOptions so{77, it, 1e-2f, d, L.dp};
      so.decoupled_lr = kDecoupledLr;  // ignored without L.decoupled_lr
      train_step(model, executor, plan, opt, mbs, so, loss, st);
      if (it > 0) {
        EXPECT_EQ(buffer_allocation_count(), allocs) << "allocations in step " << it;
        if (!host_counts) EXPECT_EQ(host_sync_count(), syncs) << "host synchronisations in step " << it;
      }
      // The model (and the embedding-group step) reported every parameter exactly once.
      for (size_t i = 0; i < reports.counts.size(); ++i)
        EXPECT_EQ(reports.counts[i], 1) << model.params().info(i).name << " iteration " << it;
      std::fill(reports.counts.begin(), reports.counts.end(), 0);
      const float l = loss.t.data_as<float>()[0];
      std::lock_guard<std::mutex> lock(mu);
      if (g.tp->rank() == 0) out.losses[it] += l;  // only the last stage has a loss; sum over DP
    }
    // Every step was applied (a non-finite gradient norm would skip all of them in every layout
    // alike, which the comparisons below could not see).
    EXPECT_EQ(opt.read_scalars_sync(st).skipped_iters, 0) << L.name();
    {
      std::lock_guard<std::mutex> lock(mu);
      if (g.tp->rank() == 0 && d == 0) out.slots[static_cast<size_t>(pp_rank)] = plan.activation_slots;
      if (const Tensor ml = model.mtp_losses(); !ml.empty() && g.tp->rank() == 0) {  // the last stage's
        const std::vector<float> v = testing::to_host(ml, st);
        for (size_t k = 0; k < v.size(); ++k) out.mtp[k] += v[k];
      }
      const MoeDispatchStats ds = model.moe_dispatch_stats(st);
      out.rerouted += ds.rerouted;
      out.overflowed += ds.overflowed;
      out.echo_bytes += ds.echo_bytes;
    }
    // Every rank reports (data-parallel replicas write identical values; with expert parallelism
    // the DP ranks hold different experts).
    const ParamStore& P = model.params();
    sync.finish_param_sync(st);
    const std::vector<ParamStore::Range>* owned = L.zero ? &opt.owned_ranges() : nullptr;
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < P.size(); ++i) {
      const auto& info = P.info(i);
      int64_t gnumel = 1;
      for (auto x : info.global_shape) gnumel *= x;
      if (info.shared_embedding_copy) {
        auto& cp = out.copy_params[info.name];
        cp.resize(gnumel, NAN);
        if (d == 0) place(cp, info, testing::to_host(P.main(i), st));
        continue;
      }
      if (info.vocab_rows > 0) out.vocab_numel[info.name] = info.vocab_rows * (gnumel / info.global_shape[0]);
      auto& gg = out.grads[info.name];
      auto& gp = out.params[info.name];
      gg.resize(gnumel, NAN);
      gp.resize(gnumel, NAN);
      place(gg, info, testing::to_host(P.grad(i), st), owned);
      place(gp, info, testing::to_host(P.main(i), st));
    }
  });
  return out;
}

class ParallelLayouts : public ::testing::TestWithParam<Layout> {};

TEST_P(ParallelLayouts, MatchesSingleRank) {
  const Layout L = GetParam();
  TransformerConfig c = config(L.arch);
  if (L.tied) c.untie_embeddings_and_output_weights = false;
  const int64_t mb = 2;
  // Vocabulary tensors compare on their real rows; their padding rows stay exactly zero.
  auto real_rows = [](const Result& r, const std::string& name, const std::vector<float>& v) {
    auto it = r.vocab_numel.find(name);
    if (it == r.vocab_numel.end()) return v;
    for (size_t e = static_cast<size_t>(it->second); e < v.size(); ++e)
      EXPECT_EQ(v[e], 0.f) << name << " padding element " << e;
    return std::vector<float>(v.begin(), v.begin() + it->second);
  };
  // The data of a layout is a function of its name, not of the run's MT_TEST_SEED: an MoE router
  // picks its top-k by comparisons, so weights that differ from the reference's at rounding level
  // (other summation orders) can, for rare data, flip a near-tied selection after a few updates and
  // move the loss discontinuously. A fixed draw per layout keeps each comparison reproducible.
  std::mt19937_64 rng(std::hash<std::string>{}(L.name()));
  std::uniform_int_distribution<int32_t> draw(0, 60);
  std::vector<int32_t> tokens(static_cast<size_t>(L.micro_total * mb * c.seq_length)), labels(tokens.size());
  for (auto& t : tokens) t = draw(rng);
  for (auto& t : labels) t = draw(rng);
  Layout one;
  one.arch = L.arch;
  one.odd_vocab = L.odd_vocab;
  one.flash = L.flash;
  one.micro_total = L.micro_total;
  one.capacity = L.capacity;
  one.drop_position = L.drop_position;
  one.pad = L.pad;
  one.decoupled_lr = L.decoupled_lr;
  one.one_p = L.one_p;
  one.mtp = L.mtp;
  one.tied = L.tied;
  // global_aux_loss: the loss of each micro-batch step reads the counts of all DP ranks' micro-batches
  // of that step, so the reference runs their union as one micro-batch (as many steps, b·DP)
  if (L.arch == Arch::kMoeGlobal) one.merge = L.dp;
  const Result ref = run_layout(one, tokens, labels, mb);
  if (L.capacity > 0 && L.capacity < 1) {  // fewer slots kept than routed: the losses must change
    one.capacity = 0;
    const Result dropless = run_layout(one, tokens, labels, mb);
    double diff = 0;
    for (int it = 0; it < kIters; ++it) diff = std::max(diff, std::fabs(dropless.losses[it] - ref.losses[it]));
    EXPECT_GT(diff, 1e-5 * ref.losses[0]) << "the capacity dropped nothing";
  }
  const Result par = run_layout(L, tokens, labels, mb);
  if (L.echo > 0 && L.received == 0)
    EXPECT_GT(par.rerouted, 0) << "ECHO rerouted nothing: the test would not exercise the clones";
  if (L.received > 0) EXPECT_EQ(par.overflowed, 0) << "the capacity must hold every slot to match the reference";
  if (L.echo > 0 && L.received > 0) {  // the static path counts no reroutes on the host: its dropless
    Layout twin = L;                   // twin routes the same first step and must have rerouted
    twin.received = 0;
    EXPECT_GT(run_layout(twin, tokens, labels, mb).rerouted, 0) << "ECHO rerouted nothing";
    // thread ranks: the clones travel by the used-slot transfers (EchoPeers), which moved something
    EXPECT_GT(par.echo_bytes, 0) << "ECHO's used-slot transfers sent nothing";
  }
  for (int it = 0; it < kIters; ++it) EXPECT_NEAR(par.losses[it], ref.losses[it], 1e-5 * ref.losses[it]) << it;
  ASSERT_EQ(par.mtp.size(), ref.mtp.size());
  for (size_t k = 0; k < ref.mtp.size(); ++k) {
    EXPECT_GT(ref.mtp[k], 0.0) << "MTP depth " << k + 1 << " logged no loss";
    EXPECT_NEAR(par.mtp[k], ref.mtp[k], 1e-5 * ref.mtp[k]) << "MTP depth " << k + 1;
  }
  ASSERT_EQ(par.grads.size(), ref.grads.size());
  for (const auto& [name, g] : ref.grads) {
    ASSERT_TRUE(par.grads.count(name)) << name << " missing";
    ASSERT_TRUE(testing::all_finite(par.grads.at(name))) << name << " not fully gathered";
    const double eg = testing::rel_err(real_rows(par, name, par.grads.at(name)), real_rows(ref, name, g));
    const double ep =
        testing::rel_err(real_rows(par, name, par.params.at(name)), real_rows(ref, name, ref.params.at(name)));
    EXPECT_LT(eg, 1e-5) << "grad " << name;
    EXPECT_LT(ep, 1e-5) << "param " << name;
  }
  // The last stage's copy of the word embedding (a tied output layer's, or the MTP's of an untied
  // model) stays identical to the first stage's.
  if (L.pp > 1 && (c.tied_output() || L.mtp > 0)) {
    ASSERT_EQ(par.copy_params.size(), 1u);
    const auto& cp = par.copy_params.begin()->second;
    EXPECT_EQ(cp, par.params.at(par.copy_params.begin()->first));
  } else {
    EXPECT_TRUE(par.copy_params.empty());
  }
  // Memory: 1F1B keeps at most pp − rank micro-batches of activations on rank `rank`.
  if (L.pp > 1 && L.vpp <= 1)
    for (int r = 0; r < L.pp; ++r) EXPECT_LE(par.slots[r], L.pp - r) << "rank " << r;
}

Layout grid_layout(Arch arch, int tp, int pp, int dp, int vpp, int micro_total);

std::vector<Layout> layouts() {
  std::vector<Layout> v;
  // Tensor x data parallelism (no pipeline): {tp, dp, sp, distributed optimizer}.
  for (const auto& [tp, dp, sp, zero] : {std::tuple{2, 1, false, false}, std::tuple{4, 1, false, false},
                                          std::tuple{2, 1, true, false}, std::tuple{4, 1, true, false},
                                          std::tuple{1, 2, false, false}, std::tuple{2, 2, false, false},
                                          std::tuple{2, 2, true, false}, std::tuple{1, 2, false, true},
                                          std::tuple{2, 2, true, true}}) {
    Layout L;
    L.tp = tp;
    L.dp = dp;
    L.sp = sp;
    L.zero = zero;
    L.micro_total = 4;
    v.push_back(L);
  }
  for (int pp : {2, 4})
    for (int vpp : {0, 2})
      for (int k : {1, 2, 3}) {
        Layout L;
        L.pp = pp;
        L.vpp = vpp;
        L.micro_total = k * pp;
        v.push_back(L);
      }
  // The LM head in chunks of 5 of its 16 rows (5, 5, 5, 1): vocab-parallel statistics per chunk,
  // the dx rows of each chunk reduced (SP: reduce-scattered) once, the gradients made in the forward.
  for (const auto& [tp, sp, dp, zero, pp, vpp, arch] :
       {std::tuple{2, true, 1, false, 1, 0, Arch::kGpt}, std::tuple{4, false, 1, false, 1, 0, Arch::kGpt},
        std::tuple{1, false, 2, true, 1, 0, Arch::kGpt}, std::tuple{1, false, 1, false, 2, 2, Arch::kGpt},
        std::tuple{2, true, 1, false, 2, 0, Arch::kLlama}}) {
    Layout L;
    L.arch = arch;
    L.tp = tp;
    L.sp = sp;
    L.dp = dp;
    L.zero = zero;
    L.pp = pp;
    L.vpp = vpp;
    L.odd_vocab = arch == Arch::kGpt;
    L.micro_total = 4;
    L.head_chunk = 5;
    v.push_back(L);
  }
  // --decoupled-lr: the embedding (first stage) and the output layer (last stage; GPT: the tied
  // embedding's copy) at their own rate, with TP, PP and the distributed optimizer's shards.
  for (const auto& [tp, pp, dp, zero, arch] :
       {std::tuple{2, 2, 1, false, Arch::kLlama}, std::tuple{1, 2, 2, true, Arch::kLlama},
        std::tuple{2, 1, 2, true, Arch::kGpt}, std::tuple{1, 2, 1, false, Arch::kGpt}}) {
    Layout L = grid_layout(arch, tp, pp, dp, 0, 4);
    L.zero = zero;
    L.decoupled_lr = true;
    v.push_back(L);
  }
  // --apply-layernorm-1p: LayerNorm (GPT: the weights' gradients summed over TP with SP) and
  // RMSNorm with q/k norms (Qwen) under TP, PP and the distributed optimizer.
  for (const auto& [tp, pp, dp, zero, arch] :
       {std::tuple{2, 1, 2, true, Arch::kGpt}, std::tuple{2, 2, 1, false, Arch::kQwen}}) {
    Layout L = grid_layout(arch, tp, pp, dp, 0, 4);
    L.zero = zero;
    L.one_p = true;
    v.push_back(L);
  }
  Layout u;  // uneven first / last stages: 1 + 3 + 3 + 1 -> first 1, last 1, middle 3 each
  u.pp = 4;
  u.micro_total = 4;
  u.first = 1;
  u.last = 1;
  v.push_back(u);
  u.pp = 2;
  u.first = 3;
  u.last = -1;  // 3 + 5
  v.push_back(u);
  Layout g;  // interleaved with a micro-batch group size other than pp
  g.pp = 2;
  g.vpp = 2;
  g.micro_total = 6;
  g.group_size = 3;
  v.push_back(g);
  Layout t;  // TP2·PP2·DP2 = 8 ranks
  t.tp = 2;
  t.pp = 2;
  t.dp = 2;
  t.micro_total = 8;
  v.push_back(t);
  t.sp = true;
  t.zero = true;
  v.push_back(t);
  t.vpp = 2;
  v.push_back(t);
  t.overlap = true;
  v.push_back(t);
  t.vpp = 0;
  t.zero = false;
  v.push_back(t);
  Layout o;  // PP 4 with overlapped bucket reduction
  o.pp = 4;
  o.micro_total = 8;
  o.overlap = true;
  v.push_back(o);
  // --overlap-p2p-communication: interleaved PP 4, and TP 2 + SP x PP 2 x DP 2 with VPP, the
  // distributed optimizer and overlapped reduction.
  Layout q;
  q.pp = 4;
  q.vpp = 2;
  q.micro_total = 8;
  q.overlap_p2p = true;
  v.push_back(q);
  t.vpp = 2;
  t.zero = t.overlap = t.overlap_p2p = true;
  v.push_back(t);
  // Vocabulary padding that differs with the TP size (issue 21).
  for (const auto& [tp, sp, pp] : {std::tuple{2, false, 1}, std::tuple{4, true, 1}, std::tuple{2, true, 2}}) {
    Layout p;
    p.odd_vocab = true;
    p.tp = tp;
    p.sp = sp;
    p.pp = pp;
    p.micro_total = 2 * pp;
    v.push_back(p);
  }
  // Flash attention (its dropout keyed like the local one's) under TP + SP and PP.
  for (Arch arch : {Arch::kGpt, Arch::kLlama}) {
    for (const auto& [tp, pp, dp] : {std::tuple{2, 1, 1}, std::tuple{2, 2, 2}}) {
      Layout f;
      f.flash = true;
      f.arch = arch;
      f.tp = tp;
      f.pp = pp;
      f.dp = dp;
      f.sp = tp > 1;
      f.micro_total = 2 * pp * dp;
      v.push_back(f);
    }
  }
  // Llama and Qwen 3 style models under every kind of parallelism.
  // One layout of a model family, two micro-batches per pipeline stage and DP rank.
  auto add = [&v](Arch arch, int tp, int pp, int dp, int vpp, bool sp, bool zero, bool overlap, int ep = 1,
                  int etp = 0, bool a2a = false) {
    Layout a;
    a.arch = arch;
    a.tp = tp;
    a.pp = pp;
    a.dp = dp;
    a.vpp = vpp;
    a.ep = ep;
    a.etp = etp;
    a.sp = sp;
    a.zero = zero;
    a.overlap = overlap;
    a.a2a = a2a;
    a.micro_total = 2 * pp * dp;
    v.push_back(a);
  };
  for (Arch arch : {Arch::kLlama, Arch::kQwen}) {
    for (const auto& [tp, pp, dp, vpp, sp, zero, overlap] :
         {std::tuple{2, 1, 1, 0, false, false, false}, std::tuple{4, 1, 1, 0, true, false, false},
          std::tuple{2, 1, 1, 0, true, false, false}, std::tuple{1, 1, 2, 0, false, true, false},
          std::tuple{1, 2, 1, 0, false, false, false}, std::tuple{1, 2, 1, 2, false, false, false},
          std::tuple{2, 2, 2, 0, true, true, false}, std::tuple{2, 2, 2, 2, true, true, true}})
      add(arch, tp, pp, dp, vpp, sp, zero, overlap);
  }
  // MoE with expert parallelism (experts split over EP ranks, tokens all-gathered over the expert
  // tensor x expert model parallel group, expert gradients reduced over the expert-data-parallel
  // group) and MoE parallel folding (expert TP != TP).
  for (Arch arch : {Arch::kMoe, Arch::kMoeSigmoid}) {
    for (const auto& [tp, pp, dp, ep, etp, sp, zero, overlap] :
         {std::tuple{1, 1, 2, 2, 0, false, false, false}, std::tuple{1, 1, 4, 4, 0, false, false, false},
          std::tuple{1, 1, 4, 2, 0, false, true, false}, std::tuple{2, 1, 2, 2, 1, true, false, false},
          std::tuple{2, 1, 2, 4, 1, true, true, false}, std::tuple{2, 1, 1, 1, 1, true, false, false},
          std::tuple{2, 2, 2, 2, 2, true, true, true}, std::tuple{1, 2, 2, 2, 0, false, true, true}})
      add(arch, tp, pp, dp, /*vpp=*/0, sp, zero, overlap, ep, etp);
  }
  // --moe-router-load-balancing-type global_aux_loss (the counts of the global batch so far, summed
  // over TP × DP and averaged over the step's micro-batches, reset each step): DP 2, TP 2 + SP,
  // EP 2 (both dispatchers), PP 2 and VPP with several micro-batches, and everything combined with
  // the distributed optimizer and overlapped reduction; against one rank running the same steps.
  for (const auto& [tp, pp, dp, vpp, ep, sp, zero, overlap, a2a] :
       {std::tuple{1, 1, 2, 0, 1, false, false, false, false}, std::tuple{2, 1, 1, 0, 1, true, false, false, false},
        std::tuple{1, 1, 2, 0, 2, false, false, false, false}, std::tuple{1, 1, 2, 0, 2, false, true, false, true},
        std::tuple{1, 2, 1, 0, 1, false, false, false, false}, std::tuple{1, 2, 1, 2, 1, false, false, false, false},
        std::tuple{2, 2, 2, 0, 2, true, true, true, false}})
    add(Arch::kMoeGlobal, tp, pp, dp, vpp, sp, zero, overlap, ep, 0, a2a);
  // --moe-router-dtype fp64: TP 2 + SP (the router weight's gradient summed over TP), EP 2 with
  // both dispatchers, expert TP 1 under TP 2 with DP, and PP with the distributed optimizer.
  add(Arch::kMoeFp64, 2, 1, 1, 0, true, false, false);
  add(Arch::kMoeFp64, 1, 1, 2, 0, false, false, false, 2, 0);
  add(Arch::kMoeFp64, 1, 1, 2, 0, false, false, false, 2, 0, true);
  add(Arch::kMoeFp64, 2, 1, 2, 0, true, false, false, 2, 1);
  add(Arch::kMoeFp64, 1, 2, 2, 0, false, true, false, 2, 0);
  // Multi-token prediction (--mtp-num-layers, on the last stage): TP 2 with and without SP, DP 2
  // with the distributed optimizer, PP 2 and PP 2 x VPP 2 (the last stage's copy of the word
  // embedding feeds the MTP embedding: a tied output layer's, or with an untied output layer a copy
  // of its own, all-reduced with the first stage's; also with DP 2, the distributed optimizer and
  // overlapped reduction), EP 2 with MoE MTP layers (the last layer's kind; DeepSeek's router),
  // and TP 2 + SP x PP 2 x DP 2 x EP 2 combined.
  auto mtp = [&](Arch arch, int tp, int pp, int dp, int vpp, bool sp, bool zero, bool overlap, int ep, int depths,
                 bool tied) {
    add(arch, tp, pp, dp, vpp, sp, zero, overlap, ep);
    v.back().mtp = depths;
    v.back().tied = tied;
  };
  mtp(Arch::kLlama, 2, 1, 1, 0, true, false, false, 1, 2, false);
  mtp(Arch::kLlama, 2, 1, 1, 0, false, false, false, 1, 1, false);
  mtp(Arch::kLlama, 1, 1, 2, 0, false, true, false, 1, 2, false);
  mtp(Arch::kQwen, 2, 1, 2, 0, true, true, true, 1, 1, true);
  mtp(Arch::kLlama, 1, 2, 1, 0, false, false, false, 1, 1, true);
  mtp(Arch::kLlama, 1, 2, 1, 2, false, false, false, 1, 2, true);
  mtp(Arch::kLlama, 1, 2, 1, 0, false, false, false, 1, 1, false);
  mtp(Arch::kLlama, 1, 2, 1, 2, false, false, false, 1, 2, false);
  mtp(Arch::kLlama, 1, 2, 2, 0, false, true, true, 1, 1, false);
  mtp(Arch::kMoeSigmoid, 1, 1, 2, 0, false, false, false, 2, 1, false);
  mtp(Arch::kMoe, 2, 2, 2, 0, true, true, false, 2, 1, true);
  // Two load-balancing types at once (aux_loss + seq_aux_loss): TP 2 + SP (the per-sequence counts
  // summed over the TP pieces of each sequence), EP 2 with DP, PP 2, and TP 2 + SP with EP 2 / ETP 1.
  add(Arch::kMoeMultiLb, 2, 1, 1, 0, true, false, false);
  add(Arch::kMoeMultiLb, 1, 1, 2, 0, false, false, false, 2, 0);
  add(Arch::kMoeMultiLb, 1, 2, 1, 0, false, false, false);
  add(Arch::kMoeMultiLb, 2, 1, 2, 0, true, true, false, 2, 1);
  // Random router logits keyed by the global token: the same selection under TP + SP, DP and EP.
  add(Arch::kMoeForced, 2, 1, 2, 0, true, false, false);
  add(Arch::kMoeForced, 1, 1, 2, 0, false, false, false, 2, 0);
  // MoE (expert parallelism 1: experts split like the dense MLP over TP, tokens all-gathered over
  // the TP group) under every kind of parallelism.
  for (Arch arch : {Arch::kMoe, Arch::kMoeSigmoid}) {
    for (const auto& [tp, pp, dp, vpp, sp, zero, overlap] :
         {std::tuple{2, 1, 1, 0, true, false, false}, std::tuple{4, 1, 1, 0, true, false, false},
          std::tuple{1, 1, 2, 0, false, false, false}, std::tuple{1, 1, 2, 0, false, true, false},
          std::tuple{1, 2, 1, 0, false, false, false}, std::tuple{1, 2, 1, 2, false, false, false},
          std::tuple{2, 2, 2, 0, true, true, false}, std::tuple{2, 2, 2, 2, true, true, true}})
      add(arch, tp, pp, dp, vpp, sp, zero, overlap);
  }
  // MoE with the alltoall token dispatcher (each rank routes its own tokens; all_to_allv over EP,
  // all-gather / reduce-scatter of unequal sizes over ETP, chunks regrouped by local expert)
  // against the single-rank allgather run: EP 2 (two local experts: regrouping) and 4 (one),
  // EP x TP + SP x DP, expert TP 2 with and without EP, EP with PP and VPP, with and without the
  // distributed optimizer.
  for (const auto& [arch, tp, pp, dp, vpp, ep, etp, sp, zero, overlap] :
       {std::tuple{Arch::kMoe, 1, 1, 2, 0, 2, 0, false, false, false},
        std::tuple{Arch::kMoe, 1, 1, 4, 0, 4, 0, false, false, false},
        std::tuple{Arch::kMoe, 1, 1, 4, 0, 2, 0, false, true, false},
        std::tuple{Arch::kMoe, 2, 1, 2, 0, 2, 1, true, false, false},
        std::tuple{Arch::kMoe, 2, 1, 2, 0, 4, 1, true, true, false},
        std::tuple{Arch::kMoe, 2, 1, 2, 0, 2, 2, true, false, false},
        std::tuple{Arch::kMoe, 2, 1, 1, 0, 1, 0, true, false, false},
        std::tuple{Arch::kMoe, 2, 2, 2, 0, 2, 2, true, true, true},
        std::tuple{Arch::kMoe, 1, 2, 2, 0, 2, 0, false, false, false},
        std::tuple{Arch::kMoe, 1, 2, 2, 2, 2, 0, false, true, true},
        std::tuple{Arch::kMoeSigmoid, 1, 1, 4, 0, 4, 0, false, false, false},
        std::tuple{Arch::kMoeSigmoid, 2, 1, 2, 0, 2, 1, true, true, false},
        std::tuple{Arch::kMoeSigmoid, 2, 2, 2, 0, 2, 2, true, true, true},
        // the MoE parallel folding example of the Megatron-Core MoE paper: 16 ranks, dense
        // TP4-PP2-DP2 beside expert ETP1-EP4-EDP2-PP2
        std::tuple{Arch::kMoe, 4, 2, 2, 0, 4, 1, true, true, false}})
    add(arch, tp, pp, dp, vpp, sp, zero, overlap, ep, etp, /*a2a=*/true);
  // Token dropping at an expert capacity (both policies, padding, both dispatchers).
  for (const auto& [arch, pp, dp, ep, a2a, zero, capacity, position, pad] :
       {std::tuple{Arch::kMoe, 1, 2, 2, true, false, 0.5, false, false},
        std::tuple{Arch::kMoe, 1, 4, 4, false, false, 0.75, true, true},
        std::tuple{Arch::kMoeSigmoid, 2, 2, 2, true, true, 1.0, true, false}}) {
    add(arch, 1, pp, dp, 0, false, zero, false, ep, 0, a2a);
    v.back().capacity = capacity;
    v.back().drop_position = position;
    v.back().pad = pad;
  }
  // --moe-grouped-gemm (grouped GEMMs over the planned rows, device-side counts; the allgather
  // dispatcher without host counts) against the single-rank per-expert loop: EP, expert TP under
  // TP + SP, EP x PP (several activation slots), the distributed optimizer, the alltoall dispatcher
  // (host counts uploaded), token dropping under both dispatchers.
  for (const auto& [arch, tp, pp, dp, ep, etp, sp, zero, a2a, capacity] :
       {std::tuple{Arch::kMoe, 1, 1, 2, 2, 0, false, false, false, 0.0},
        std::tuple{Arch::kMoe, 2, 1, 2, 2, 1, true, false, false, 0.0},
        std::tuple{Arch::kMoe, 2, 1, 1, 1, 0, true, false, false, 0.0},
        std::tuple{Arch::kMoe, 1, 2, 2, 2, 0, false, true, false, 0.0},
        std::tuple{Arch::kMoeSigmoid, 1, 1, 4, 4, 0, false, true, false, 0.0},
        std::tuple{Arch::kMoe, 2, 1, 2, 2, 2, true, false, true, 0.0},
        std::tuple{Arch::kMoe, 1, 1, 4, 4, 0, false, false, false, 0.75},
        std::tuple{Arch::kMoe, 1, 1, 2, 2, 0, false, false, true, 0.5},
        // the capacity-bounded expert rows under expert TP 2 (each ETP rank's sources capped alone;
        // TP 1: under SP a rank's router sees s / tp tokens, so its capacity is not the reference's)
        std::tuple{Arch::kMoe, 1, 1, 4, 2, 2, false, false, true, 0.5}}) {
    add(arch, tp, pp, dp, 0, sp, zero, false, ep, etp, a2a);
    v.back().capacity = capacity;
    v.back().grouped = true;
  }
  // ECHO (hot experts cloned into spare slots of under-loaded EP ranks, their weights sent there
  // and their gradients returned): the same losses and gradients as the single-rank dropless run.
  // EP 2 and 4, one and two spare slots, the grouped GEMM, EP x DP with the distributed optimizer,
  // EP x PP and VPP (several activation slots: each keeps its own placement), TP + SP with expert
  // TP 1, token dropping before the plan.
  for (const auto& [arch, tp, pp, dp, vpp, ep, sp, zero, echo, grouped, capacity] :
       {std::tuple{Arch::kMoe, 1, 1, 2, 0, 2, false, false, 1, false, 0.0},
        std::tuple{Arch::kMoe, 1, 1, 4, 0, 4, false, false, 2, false, 0.0},
        std::tuple{Arch::kMoe, 1, 1, 4, 0, 4, false, true, 1, true, 0.0},
        std::tuple{Arch::kMoe, 1, 1, 4, 0, 2, false, true, 2, false, 0.0},
        std::tuple{Arch::kMoe, 1, 2, 2, 0, 2, false, false, 1, false, 0.0},
        std::tuple{Arch::kMoe, 1, 2, 2, 2, 2, false, true, 1, true, 0.0},
        std::tuple{Arch::kMoe, 2, 1, 2, 0, 4, true, false, 1, false, 0.0},
        std::tuple{Arch::kMoeSigmoid, 1, 1, 4, 0, 4, false, false, 1, true, 0.0},
        std::tuple{Arch::kMoe, 1, 1, 2, 0, 2, false, false, 1, false, 0.75},
        std::tuple{Arch::kMoe, 1, 1, 4, 0, 4, false, false, 1, false, 0.5}}) {
    add(arch, tp, pp, dp, vpp, sp, zero, false, ep, tp > 1 ? 1 : 0, /*a2a=*/true);
    v.back().echo = echo;
    v.back().grouped = grouped;
    v.back().capacity = capacity;
  }
  // Static receive blocks (--moe-received-token-capacity, capacity large enough for every slot:
  // the capturable alltoall path equals the dropless one): EP 2 and 4, expert TP 2 (equal
  // all-gather / reduce-scatter of the blocks), TP + SP with expert TP 1, EP x PP with VPP and the
  // distributed optimizer, token dropping before the dispatch.
  for (const auto& [arch, tp, pp, dp, vpp, ep, etp, sp, zero, capacity] :
       {std::tuple{Arch::kMoe, 1, 1, 2, 0, 2, 0, false, false, 0.0},
        std::tuple{Arch::kMoe, 1, 1, 4, 0, 4, 0, false, true, 0.0},
        std::tuple{Arch::kMoe, 2, 1, 2, 0, 2, 2, true, false, 0.0},
        std::tuple{Arch::kMoe, 2, 1, 2, 0, 4, 1, true, true, 0.0},
        std::tuple{Arch::kMoe, 1, 2, 2, 2, 2, 0, false, true, 0.0},
        std::tuple{Arch::kMoeSigmoid, 1, 1, 4, 0, 4, 0, false, false, 0.0},
        std::tuple{Arch::kMoe, 1, 1, 2, 0, 2, 0, false, false, 0.5}}) {
    add(arch, tp, pp, dp, vpp, sp, zero, false, ep, etp, /*a2a=*/true);
    v.back().grouped = true;
    v.back().received = 4096;
    v.back().capacity = capacity;
  }
  // ECHO on the capturable path: plan, rerouting and the clones' weight / gradient exchange on the
  // device (fixed all-to-alls of EP·S expert blocks).
  for (const auto& [arch, tp, pp, dp, vpp, ep, sp, zero, echo] :
       {std::tuple{Arch::kMoe, 1, 1, 2, 0, 2, false, false, 1}, std::tuple{Arch::kMoe, 1, 1, 4, 0, 4, false, true, 2},
        std::tuple{Arch::kMoe, 1, 2, 2, 2, 2, false, true, 1}, std::tuple{Arch::kMoe, 2, 1, 2, 0, 4, true, false, 1},
        std::tuple{Arch::kMoeSigmoid, 1, 1, 4, 0, 4, false, false, 1}}) {
    add(arch, tp, pp, dp, vpp, sp, zero, false, ep, tp > 1 ? 1 : 0, /*a2a=*/true);
    v.back().grouped = true;
    v.back().received = 4096;
    v.back().echo = echo;
  }
  // ECHO with expert tensor parallelism 2 (EP 2 x ETP 2: one plan on the whole ETP x EP grid, made
  // from the selections of both ETP ranks of each EP rank; every clone slot computes with its own ETP
  // rank's shard of the home expert, and returns that shard's gradient): ETP over the DP ranks (TP 1,
  // MoE parallel folding) and ETP = TP 2 with SP, both alltoall dispatchers (dropless; static
  // receive blocks with the plan and the weight exchange on the device), one and two spare slots,
  // the distributed optimizer, EP x ETP x PP.
  for (const auto& [arch, tp, pp, dp, sp, zero, echo, grouped, received] :
       {std::tuple{Arch::kMoe, 1, 1, 4, false, false, 1, false, 0},
        std::tuple{Arch::kMoe, 1, 1, 4, false, false, 1, true, 4096},
        std::tuple{Arch::kMoe, 2, 1, 2, true, false, 1, false, 0},
        std::tuple{Arch::kMoe, 2, 1, 2, true, false, 2, true, 4096},
        std::tuple{Arch::kMoe, 1, 1, 4, false, true, 2, true, 0},
        std::tuple{Arch::kMoe, 2, 2, 2, true, true, 1, false, 0},
        std::tuple{Arch::kMoeSigmoid, 2, 2, 2, true, false, 1, true, 4096}}) {
    add(arch, tp, pp, dp, /*vpp=*/0, sp, zero, false, /*ep=*/2, /*etp=*/2, /*a2a=*/true);
    v.back().echo = echo;
    v.back().grouped = grouped;
    v.back().received = received;
  }
  // The micro-batch key of the dropout read from the activation slot's device key (the per-layer
  // CUDA graph mode; slots reused by later micro-batches): the same masks as the host key, under
  // PP with VPP (slot reuse across chunks), TP + SP, flash attention's dropout, MoE.
  for (const auto& [arch, flash, tp, pp, dp, vpp, sp] :
       {std::tuple{Arch::kGpt, false, 1, 2, 1, 2, false}, std::tuple{Arch::kGpt, true, 2, 2, 1, 0, true},
        std::tuple{Arch::kLlama, false, 2, 1, 2, 0, true}, std::tuple{Arch::kMoe, false, 1, 2, 2, 0, false}}) {
    add(arch, tp, pp, dp, vpp, sp, false, false);
    v.back().flash = flash;
    v.back().micro_total = 4 * pp * dp;
    v.back().slot_keys = true;
  }
  // Per-layer graphs with the moe_router and moe_preprocess scopes (run eagerly here): the router
  // and each dispatcher's preprocessing as one region, forward and backward, under EP 2 and 4:
  // allgather (host counts, and grouped GEMM with EP x PP slots), alltoall dropless (host counts;
  // with expert TP 2; with ECHO's host placement), alltoall static blocks (with ECHO on the device,
  // and with token dropping).
  for (const auto& [arch, tp, pp, dp, ep, etp, sp, a2a, grouped, echo, received, capacity] :
       {std::tuple{Arch::kMoe, 1, 1, 2, 2, 0, false, false, false, 0, 0, 0.0},
        std::tuple{Arch::kMoe, 1, 2, 2, 2, 0, false, false, true, 0, 0, 0.0},
        std::tuple{Arch::kMoe, 1, 1, 4, 4, 0, false, true, false, 0, 0, 0.0},
        std::tuple{Arch::kMoe, 2, 1, 2, 2, 2, true, true, true, 0, 0, 0.0},
        std::tuple{Arch::kMoe, 1, 1, 2, 2, 0, false, true, false, 1, 0, 0.0},
        std::tuple{Arch::kMoeSigmoid, 1, 1, 4, 4, 0, false, true, true, 1, 4096, 0.0},
        std::tuple{Arch::kMoe, 1, 1, 2, 2, 0, false, true, true, 0, 4096, 0.5}}) {
    add(arch, tp, pp, dp, 0, sp, false, false, ep, etp, a2a);
    v.back().grouped = grouped;
    v.back().echo = echo;
    v.back().received = received;
    v.back().capacity = capacity;
    v.back().preprocess = true;
  }
  // Activation recompute under parallelism (several activation slots sharing one recompute area,
  // groups that end a pipeline chunk and feed the next stage, recomputed collectives of TP + SP,
  // EP dispatch and ECHO): selective with the local attention, full uniform and block, dense, flash
  // and MoE, against one rank without recompute.
  for (const auto& [arch, flash, tp, pp, dp, vpp, ep, sp, zero, a2a, rc, n] :
       {std::tuple{Arch::kGpt, false, 2, 2, 2, 2, 1, true, true, false, 'u', 1},
        std::tuple{Arch::kGpt, false, 1, 4, 1, 0, 1, false, false, false, 'b', 1},
        std::tuple{Arch::kLlama, false, 2, 1, 2, 0, 1, true, true, false, 's', 0},
        std::tuple{Arch::kLlama, true, 2, 2, 2, 0, 1, true, false, false, 'u', 3},
        std::tuple{Arch::kMoe, false, 1, 2, 2, 2, 2, false, true, true, 'u', 1},
        std::tuple{Arch::kMoeSigmoid, false, 2, 1, 2, 0, 2, true, false, false, 'b', 2},
        std::tuple{Arch::kGpt, false, 2, 2, 2, 2, 1, true, true, false, 'm', 0},
        std::tuple{Arch::kLlama, true, 2, 2, 1, 0, 1, true, false, false, 'M', 0},
        std::tuple{Arch::kMoe, false, 1, 2, 2, 0, 2, false, true, true, 'm', 0}}) {
    add(arch, tp, pp, dp, vpp, sp, zero, false, ep, ep > 1 && tp > 1 ? 1 : 0, a2a);
    v.back().flash = flash;
    v.back().recompute = rc;
    v.back().recompute_layers = n;
  }
  add(Arch::kMoe, 1, 1, 2, 0, false, false, false, 2, 0, /*a2a=*/true);  // ECHO's placement recomputed
  v.back().echo = 1;
  v.back().recompute = 'u';
  v.back().recompute_layers = 2;
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, ParallelLayouts, ::testing::ValuesIn(layouts()),
                         [](const auto& info) { return info.param.name(); });

// Multi-latent attention (model/layers/mla_attention.h) under TP (+ SP: the replicated
// down-projections' gradients summed over TP, k_pe gathered), PP / VPP, DP with the distributed
// optimizer, EP with MoE layers, flash attention (the saved packed qkv and padded context), and
// recompute (core_attn + mla_up_proj; full).
std::vector<Layout> mla_layouts() {
  std::vector<Layout> v;
  for (const auto& [arch, tp, pp, dp, vpp, sp, zero] :
       {std::tuple{Arch::kMla, 2, 1, 1, 0, false, false}, std::tuple{Arch::kMla, 2, 1, 1, 0, true, false},
        std::tuple{Arch::kMla, 4, 1, 1, 0, true, false}, std::tuple{Arch::kMla, 1, 2, 1, 0, false, false},
        std::tuple{Arch::kMla, 1, 2, 1, 2, false, false}, std::tuple{Arch::kMla, 1, 1, 2, 0, false, true},
        std::tuple{Arch::kMla, 2, 2, 2, 0, true, true}, std::tuple{Arch::kMlaNoLora, 2, 1, 1, 0, true, false},
        std::tuple{Arch::kMlaNoLora, 1, 2, 2, 0, false, true}}) {
    Layout L = grid_layout(arch, tp, pp, dp, vpp, 2 * pp * dp);
    L.sp = sp;
    L.zero = zero;
    v.push_back(L);
  }
  for (const auto& [tp, dp, ep, sp] : {std::tuple{1, 2, 2, false}, std::tuple{2, 2, 2, true}}) {
    Layout L = grid_layout(Arch::kMlaMoe, tp, 1, dp, 0, 2 * dp);
    L.ep = ep;
    L.etp = tp > 1 ? 1 : 0;
    L.sp = sp;
    v.push_back(L);
  }
  for (const auto& [arch, tp, flash, rc, layers] :
       {std::tuple{Arch::kMla, 2, true, '\0', 0}, std::tuple{Arch::kMlaNoLora, 2, true, '\0', 0},
        std::tuple{Arch::kMla, 2, false, 'L', 0}, std::tuple{Arch::kMla, 2, true, 'L', 0},
        std::tuple{Arch::kMla, 2, false, 'u', 2}}) {
    Layout L = grid_layout(arch, tp, 1, 1, 0, 2);
    L.sp = true;
    L.flash = flash;
    L.recompute = rc;
    L.recompute_layers = layers;
    v.push_back(L);
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Mla, ParallelLayouts, ::testing::ValuesIn(mla_layouts()),
                         [](const auto& info) { return info.param.name(); });

// --tp-comm-overlap changes no bit (docs/parallelism.md "Tensor-parallel communication overlap"):
// the same layout with and without it gives the same losses, gradients and parameters exactly —
// the blocked GEMMs compute each row as the whole GEMM does, and the reduce-scatter's pieces are
// summed in the thread communicator's order. (The plain layouts equal one rank in ParallelLayouts.)
// TP 2 and 4 with SP for the GPT, Llama (GQA, SwiGLU, no biases) and Qwen 3 (QKV bias, QK-norm)
// styles; combined with PP, VPP, DP and the distributed optimizer with overlapped reduction; the
// LM head in chunks; selective recompute of the norms and MLP (the input all-gather redone) and
// full recompute (the overlapped forward re-run); flash attention; MoE (the attention's linears;
// the experts' dispatch is not a TP region).
class TpCommOverlapLayouts : public ::testing::TestWithParam<Layout> {};

// Losses, gradients and parameters of two runs equal bit for bit.
void expect_bitwise_equal(const Result& a, const Result& b) {
  auto bits_equal = [](const std::vector<float>& x, const std::vector<float>& y, const std::string& what) {
    ASSERT_EQ(x.size(), y.size()) << what;
    size_t diff = 0, first = x.size();
    for (size_t i = 0; i < x.size(); ++i)
      if (std::memcmp(&x[i], &y[i], sizeof(float)) != 0 && diff++ == 0) first = i;
    EXPECT_EQ(diff, 0u) << what << ": " << diff << " of " << x.size() << " elements differ, the first at " << first
                        << " (" << (first < x.size() ? x[first] : 0.f) << " vs " << (first < x.size() ? y[first] : 0.f)
                        << ")";
  };
  for (int it = 0; it < kIters; ++it) EXPECT_EQ(a.losses[it], b.losses[it]) << "loss " << it;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (const auto& [name, g] : b.grads) {
    ASSERT_TRUE(a.grads.count(name)) << name;
    bits_equal(a.grads.at(name), g, "grad " + name);
    bits_equal(a.params.at(name), b.params.at(name), "param " + name);
  }
}

// Random tokens and labels of a layout, a function of its name (as in MatchesSingleRank).
std::pair<std::vector<int32_t>, std::vector<int32_t>> layout_data(const Layout& L, int64_t mb) {
  std::mt19937_64 rng(std::hash<std::string>{}(L.name()));
  std::uniform_int_distribution<int32_t> draw(0, 60);
  std::vector<int32_t> tokens(static_cast<size_t>(L.micro_total * mb * config(L.arch).seq_length)),
      labels(tokens.size());
  for (auto& t : tokens) t = draw(rng);
  for (auto& t : labels) t = draw(rng);
  return {tokens, labels};
}

// Layout L (with `flag` set) and L without it train to the same losses, gradients and parameters,
// bit for bit.
void expect_flag_changes_no_bit(Layout L, bool Layout::*flag) {
  const int64_t mb = 2;
  const auto [tokens, labels] = layout_data(L, mb);
  const Result with = run_layout(L, tokens, labels, mb);
  L.*flag = false;
  const Result without = run_layout(L, tokens, labels, mb);
  expect_bitwise_equal(with, without);
}

TEST_P(TpCommOverlapLayouts, BitwiseEqualWithout) { expect_flag_changes_no_bit(GetParam(), &Layout::tp_overlap); }

// A layout of `arch` on a TP x PP x DP grid (interleaved when vpp > 1; sequence parallel when tp > 1).
Layout grid_layout(Arch arch, int tp, int pp, int dp, int vpp, int micro_total) {
  Layout L;
  L.arch = arch;
  L.tp = tp;
  L.pp = pp;
  L.dp = dp;
  L.vpp = vpp;
  L.sp = tp > 1;
  L.micro_total = micro_total;
  return L;
}

std::vector<Layout> tp_overlap_layouts() {
  std::vector<Layout> v;
  auto add = [&v](Arch arch, int tp, int pp, int dp, int vpp) {
    v.push_back(grid_layout(arch, tp, pp, dp, vpp, 2 * pp * dp));
    v.back().tp_overlap = true;
  };
  for (Arch arch : {Arch::kGpt, Arch::kLlama, Arch::kQwen})
    for (int tp : {2, 4}) add(arch, tp, 1, 1, 0);
  add(Arch::kGpt, 2, 2, 2, 2);  // with the distributed optimizer and overlapped bucket reduction
  v.back().zero = v.back().overlap = true;
  add(Arch::kLlama, 2, 2, 2, 0);
  v.back().zero = true;
  add(Arch::kGpt, 4, 1, 1, 0);  // the LM head in chunks of 5 rows, a padded vocabulary
  v.back().head_chunk = 5;
  v.back().odd_vocab = true;
  add(Arch::kLlama, 2, 1, 2, 0);  // selective recompute: the norms (input all-gather redone) and MLP
  v.back().recompute = 'M';
  add(Arch::kGpt, 2, 1, 2, 0);  // the norms and the GELU (its bias gradient after the blocked dgrad)
  v.back().recompute = 'm';
  add(Arch::kGpt, 2, 2, 1, 0);  // full recompute: the overlapped forward re-run before the backward
  v.back().recompute = 'u';
  v.back().recompute_layers = 2;
  add(Arch::kLlama, 4, 1, 1, 0);
  v.back().flash = true;
  add(Arch::kMoe, 2, 1, 2, 0);
  add(Arch::kMla, 2, 1, 1, 0);  // multi-latent attention: the latents' all-gathers in the up-projections
  add(Arch::kMlaNoLora, 4, 1, 1, 0);
  v.back().recompute = 'L';  // the up-projections re-run on the kept gathered latents
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, TpCommOverlapLayouts, ::testing::ValuesIn(tp_overlap_layouts()),
                         [](const auto& info) { return info.param.name(); });

// --overlap-p2p-communication changes no bit (docs/parallelism.md "Overlapped p2p"): the same
// transfers of the same tensors, only issued on the executor's communication stream and waited for
// where their data is used. 1F1B at PP 2 and 4, interleaved (VPP 2) at PP 2 and 4 and with a
// micro-batch group size other than pp, uneven first / last stages, TP 2 + SP x PP 2 x DP 2 with
// the distributed optimizer and overlapped reduction and parameter gather (Llama style), full
// recompute. (The layouts without the flag equal one rank in ParallelLayouts; two of the
// overlapped ones are there too.)
class P2pOverlapLayouts : public ::testing::TestWithParam<Layout> {};

TEST_P(P2pOverlapLayouts, BitwiseEqualWithout) { expect_flag_changes_no_bit(GetParam(), &Layout::overlap_p2p); }

std::vector<Layout> p2p_overlap_layouts() {
  std::vector<Layout> v;
  auto add = [&v](Arch arch, int tp, int pp, int dp, int vpp, int micro_total) {
    v.push_back(grid_layout(arch, tp, pp, dp, vpp, micro_total));
    v.back().overlap_p2p = true;
  };
  add(Arch::kGpt, 1, 2, 1, 0, 4);
  add(Arch::kGpt, 1, 4, 1, 0, 8);
  add(Arch::kGpt, 1, 2, 1, 2, 4);
  add(Arch::kGpt, 1, 4, 1, 2, 8);
  add(Arch::kGpt, 1, 2, 1, 2, 6);
  v.back().group_size = 3;
  add(Arch::kGpt, 1, 4, 1, 0, 4);  // uneven stages 1 + 3 + 3 + 1
  v.back().first = v.back().last = 1;
  add(Arch::kLlama, 2, 2, 2, 2, 8);
  v.back().zero = v.back().overlap = true;
  add(Arch::kGpt, 1, 2, 1, 0, 4);
  v.back().recompute = 'u';
  v.back().recompute_layers = 2;
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, P2pOverlapLayouts, ::testing::ValuesIn(p2p_overlap_layouts()),
                         [](const auto& info) { return info.param.name(); });

std::vector<pipeline::LayerRange> chunks_of(int pp_rank, int pp, int vpp, int64_t layers) {
  pipeline::PipelineLayout layout;
  layout.num_layers = layers;
  layout.pp = pp;
  layout.vpp = vpp;
  return pipeline::layers_of(pp_rank, layout);
}

// global_aux_loss: train_step zeroes the step's token-count accumulators (on the device, after the
// last backward), so with a learning rate of 0 (the parameters stay) a second step repeats the
// first step's load-balancing loss exactly; without the reset its mean counts would include the
// first step's micro-batches.
TEST(GlobalAuxLoss, TrainStepRestartsTheCountsEachStep) {
  const TransformerConfig c = config(Arch::kMoeGlobal);
  const int64_t S = c.seq_length, mb = 2;
  const int M = 3;
  run_thread_ranks(1, [&](int, std::shared_ptr<Communicator> world) {
    ModelSetupOptions o;
    o.model = c;
    o.num_microbatches = M;
    o.micro_batch_size = mb;
    Stream st(Device::cpu());
    ModelSetup setup(world, o, st);
    GPTModel& model = setup.model();
    model.params().initialize(1234, st);
    std::vector<OwnedTensor> tok, lab;
    std::vector<MicroBatch> mbs;
    for (int m = 0; m < M; ++m) {  // different micro-batches: different counts
      tok.push_back(testing::make_int_tensor(testing::randint(S * mb, 0, 61), Device::cpu(), {S, mb}, st));
      lab.push_back(testing::make_int_tensor(testing::randint(S * mb, 0, 61), Device::cpu(), {S, mb}, st));
    }
    for (int m = 0; m < M; ++m) {
      MicroBatch b{tok[m].t, lab[m].t, Tensor()};
      b.loss_weight = 1.0f / static_cast<float>(S * mb * M);
      b.aux_loss_weight = 1.0f / static_cast<float>(M);
      mbs.push_back(b);
    }
    OwnedTensor loss(DType::kF32, Device::cpu(), {1});
    std::vector<std::vector<double>> stats;
    for (int it = 0; it < 2; ++it) {
      fill(loss, 0.f, st);
      model.reset_moe_stats(st);
      train_step(model, setup.executor(), setup.train_plan(), setup.optimizer(), mbs, {77, it, 0.f, 0, 1}, loss, st);
      stats.push_back(model.moe_loss_stats(st));
    }
    const size_t per = static_cast<size_t>(kMoeStatLosses + c.num_moe_experts);
    for (int64_t l = 1; l < c.num_layers; l += 2) {  // the MoE layers
      const size_t i = per * static_cast<size_t>(l) + static_cast<size_t>(MoeLoadBalancing::kGlobalAuxLoss);
      EXPECT_GT(stats[0][i], 0.0) << l;
      EXPECT_EQ(stats[1][i], stats[0][i]) << "layer " << l << ": global load-balancing loss of step 2";
    }
  });
}

TEST(PipelinePlan, MemoryBounds) {
  for (int pp : {2, 4, 8})
    for (int m : {pp, 2 * pp, 4 * pp + 1}) {
      pipeline::ScheduleConfig sc;
      sc.pp = pp;
      sc.num_microbatches = m;
      for (int r = 0; r < pp; ++r) {
        const PipelinePlan p = plan_pipeline(sc, r, chunks_of(r, pp, 0, 2 * pp));
        EXPECT_EQ(p.activation_slots, std::min(pp - r, m)) << "pp " << pp << " m " << m << " rank " << r;
        EXPECT_LE(p.inputs_per_chunk[0], std::min(pp - r, m) + 1) << "pp " << pp << " m " << m << " rank " << r;
        // Gradients in flight: the last stage produces them, the first consumes them.
        if (pp > 1) EXPECT_GE(p.grad_buffers, 1);
      }
      // Forward-only (evaluation): activations are released once sent.
      sc.forward_only = true;
      for (int r = 0; r < pp; ++r) {
        const PipelinePlan p = plan_pipeline(sc, r, chunks_of(r, pp, 0, 2 * pp));
        EXPECT_LE(p.activation_slots, 2) << "forward-only pp " << pp << " rank " << r;
        EXPECT_EQ(p.grad_buffers, 0);
      }
    }
  // Interleaved: Megatron's bound of live activations per rank: the warm-up forwards
  // (pp − rank − 1)·2 + (V − 1)·G, plus the one of the first steady-state pair.
  for (int pp : {2, 4})
    for (int m : {pp, 2 * pp, 3 * pp}) {
      pipeline::ScheduleConfig sc;
      sc.pp = pp;
      sc.vpp = 2;
      sc.num_microbatches = m;
      for (int r = 0; r < pp; ++r) {
        const PipelinePlan p = plan_pipeline(sc, r, chunks_of(r, pp, 2, 2 * pp));
        const int warmup = std::min((pp - r - 1) * 2 + (2 - 1) * pp, 2 * m);
        EXPECT_EQ(p.activation_slots, std::min(warmup + 1, 2 * m)) << "pp " << pp << " m " << m << " rank " << r;
      }
    }
}

// The static-buffer reuse of partial CUDA graphs (docs/cuda_graphs.md): PP 4, VPP 2, 8
// micro-batches. Walking each rank's order, a forward takes an activation slot (its static input
// and saved tensors) that no (micro-batch, chunk) still waiting for its backward holds, and a
// slot is released by the backward of its forward; the number of slots is the schedule's
// in-flight bound (PP − rank − 1)·2 + (VPP − 1)·PP + 1 (11, 9, 7, 5), not the 16 forwards.
TEST(PipelinePlan, StaticBufferReuseFollowsTheSchedule) {
  const int pp = 4, vpp = 2, m = 8;
  pipeline::ScheduleConfig sc;
  sc.pp = pp;
  sc.vpp = vpp;
  sc.num_microbatches = m;
  for (int r = 0; r < pp; ++r) {
    SCOPED_TRACE(r);
    const PipelinePlan p = plan_pipeline(sc, r, chunks_of(r, pp, vpp, 2 * pp));
    EXPECT_EQ(p.activation_slots, (pp - r - 1) * 2 + (vpp - 1) * pp + 1);
    std::map<int, std::pair<int, int>> holder;  // slot -> (micro-batch, chunk) in flight
    std::map<std::pair<int, int>, int> slot_of;
    int forwards = 0, peak = 0;
    for (size_t i = 0; i < p.actions.size(); ++i) {
      const pipeline::Action& a = p.actions[i];
      const std::pair<int, int> key{a.microbatch, a.chunk};
      if (a.kind == pipeline::ActionKind::kForward) {
        const int slot = p.buffers[i].slot;
        ASSERT_GE(slot, 0);
        ASSERT_LT(slot, p.activation_slots);
        EXPECT_EQ(holder.count(slot), 0u) << "forward " << pipeline::to_string(a) << " reuses slot " << slot
                                          << " before its holder's backward";
        holder[slot] = key;
        slot_of[key] = slot;
        ++forwards;
        peak = std::max(peak, static_cast<int>(holder.size()));
      } else if (a.kind == pipeline::ActionKind::kBackward) {
        ASSERT_EQ(slot_of.count(key), 1u);
        EXPECT_EQ(p.buffers[i].slot, slot_of[key]) << "the backward reads its forward's slot";
        holder.erase(slot_of[key]);
      }
    }
    EXPECT_EQ(forwards, m * vpp);
    EXPECT_TRUE(holder.empty());
    EXPECT_EQ(peak, p.activation_slots);
  }
}

TEST(PipelinePlan, MismatchedLayoutsFailBeforeCommunication) {
  pipeline::ScheduleConfig sc;
  sc.pp = 4;
  sc.vpp = 2;
  sc.num_microbatches = 6;  // not a multiple of pp with interleaving
  EXPECT_THROW(plan_pipeline(sc, 0, chunks_of(0, 4, 2, 8)), Error);
  sc.num_microbatches = 8;
  EXPECT_THROW(plan_pipeline(sc, 0, chunks_of(0, 4, 0, 8)), Error);  // 1 chunk given, 2 expected
  pipeline::PipelineLayout layout;
  layout.num_layers = 10;
  layout.pp = 4;  // 10 layers do not split over 4 stages
  EXPECT_THROW(pipeline::layers_of(0, layout), Error);
}

}  // namespace
}  // namespace mt
