// AdamW over the flat fp32 main parameters with fp32 moments, global-norm clipping and the
// loss scaler, all on the device (Megatron's MixedPrecisionOptimizer / FP32Optimizer /
// DistributedOptimizer roles); data-parallel reduction through GradSync (optim/grad_sync.h).
// The whole step is stream-ordered with no host sync; its results (grad norm, found_inf,
// loss scale, skipped count) stay in a device struct read at log intervals.
#pragma once
#include "comm/communicator.h"
#include "core/buffer.h"
#include "core/timers.h"
#include "model/params.h"
#include "ops/optimizer.h"
#include "optim/grad_sync.h"
#include "optim/muon.h"

namespace mt {

struct OptimizerConfig {
  float beta1 = 0.9f;          ///< --adam-beta1
  float beta2 = 0.999f;        ///< --adam-beta2
  float eps = 1e-8f;           ///< --adam-eps
  float weight_decay = 0.01f;  ///< --weight-decay (not applied to biases and norm weights)
  float clip_grad = 1.0f;      ///< --clip-grad (0 = off)
  /// --use-precision-aware-optimizer (with --bf16): the fp32 main parameters are stored as the
  /// bf16 model parameters plus int16 remainders (Megatron's store_param_remainders;
  /// ParamStore::store_main_as_remainders), 2 bytes per element instead of 4. Needs bf16 model
  /// parameters (mt::Error naming the flag otherwise).
  bool store_param_remainders = false;
  /// --decoupled-lr: the input embedding and the output layer (is_embedding_or_output_parameter)
  /// are stepped at their own learning rate, AdamWOptimizer::step's decoupled_lr (Megatron's
  /// param group with max_lr = --decoupled-lr, min_lr = --decoupled-min-lr;
  /// megatron/core/optimizer/__init__.py get_standard_config_overrides). false = one rate.
  bool decoupled_lr = false;
  LossScalerConfig scaler{};
  /// --optimizer adam|muon (Megatron's names; "adam" is AdamW). muon: the Muon parameters
  /// (is_muon_parameter) are stepped by Muon (optim/muon.h, options in `muon`), the rest by AdamW.
  std::string optimizer = "adam";
  MuonConfig muon{};
};

/// Megatron's is_embedding_or_output_parameter (set in LanguageModule's
/// setup_embeddings_and_output_layer): the word embedding (embedding.word_embeddings.weight,
/// also its tied copy on the last pipeline stage) and the untied output layer's weight
/// (output_layer.weight). Position embeddings are not.
bool is_embedding_or_output_parameter(const ParamInfo& p);

/// The groups the optimizer reduces over. dp: gradients are summed over it before the step
/// (each rank's loss gradient already carries 1/dp). mp: the gradient norm's sum of squares is
/// summed over it (tensor · pipeline parallel); parameters replicated over TP count on TP rank 0
/// only (tp_rank).
struct OptimizerGroups {
  std::shared_ptr<Communicator> dp, mp;
  int tp_rank = 0;
  /// --use-distributed-optimizer (ZeRO-1, Rajbhandari et al. 2020 §5; Megatron's
  /// DistributedOptimizer): data-parallel rank d owns the d-th 1/DP slice of every gradient
  /// bucket (GradSync::owned_ranges). Gradients are reduce-scattered instead of all-reduced,
  /// AdamW moments and the fp32 main parameters (bf16/fp16 models) exist only for the owned
  /// elements (optimizer memory / DP), and the updated parameters are all-gathered.
  bool distributed = false;
  /// The expert tensor × expert model × pipeline parallel group (MoE; Megatron's
  /// expert_tensor_model_pipeline_parallel_group): the expert parameters' sum of squares (owned
  /// elements, summed over EDP first when sharded) is summed over it and added to the dense one.
  /// nullptr = a single rank.
  std::shared_ptr<Communicator> expert_mp;
  /// --optimizer muon: the tensor-parallel groups of the dense and the expert parameters (their
  /// shards are orthogonalised as --muon-tp-mode says). nullptr = a single rank.
  std::shared_ptr<Communicator> tp, etp;
};

/// AdamW on the elements this rank owns (GradSync::owned_ranges: the whole flat buffer, or with
/// the distributed optimizer one slice per bucket; Megatron's DistributedOptimizer over
/// megatron/core/optimizer/distrib_optimizer.py). Optimizer state is stored compactly: the
/// owned ranges concatenated in ascending order ("state index").
class AdamWOptimizer {
 public:
  /// Compatible form: owns a GradSync(params, groups.dp, {use_distributed_optimizer =
  /// groups.distributed}) without overlap (every bucket reduced inside step()). With
  /// config.store_param_remainders the fp32 main parameters become int16 remainders first
  /// (ParamStore::store_main_as_remainders); with the distributed optimizer and a bf16/fp16 model
  /// they are then sharded (ParamStore::shard_main). Errors: mt::Error for a hyper-parameter out
  /// of range (naming the flag), store_param_remainders without bf16 parameters, and GradSync's
  /// errors.
  AdamWOptimizer(ParamStore& params, const OptimizerConfig& config, const Stream& stream,
                 OptimizerGroups groups = {});
  /// With an external GradSync (not owned; must outlive the optimizer; the model's hooks call
  /// it). groups.mp and groups.tp_rank are used; groups.dp and groups.distributed must be unset
  /// or agree with `sync` (error otherwise).
  AdamWOptimizer(GradSync& sync, const OptimizerConfig& config, const Stream& stream, OptimizerGroups groups = {});

  /// One optimizer step at learning rate `lr` on the gradients accumulated in params:
  /// GradSync::finish_grad_sync (reduces over DP whatever was not reduced yet), global norm over
  /// the owned elements (summed over DP when sharded, then over MP), clip, AdamW on the owned
  /// elements, loss-scaler update, then GradSync::start_param_sync (all-gather of the updated
  /// parameters with the distributed optimizer; asynchronous with --overlap-param-gather).
  /// timers (optional): the optimizer, optimizer-clip-main-grad, optimizer-inner-step and
  /// params-all-gather timers (core/timers.h) are recorded around those phases.
  /// lr_ptr: when set, the rate is read from this device fp32 when the step runs (StepValues,
  /// train/train_step.h; CUDA graph replay) and `lr` is only checked.
  /// decoupled_lr, decoupled_lr_ptr: the same for the embedding and output-layer parameters when
  /// config().decoupled_lr (ignored otherwise).
  void step(float lr, const Stream& stream, Timers* timers = nullptr, const float* lr_ptr = nullptr,
            float decoupled_lr = 0.f, const float* decoupled_lr_ptr = nullptr);
  /// Device fp32 [1] view of the current loss scale (multiplies the loss gradient).
  Tensor loss_scale_tensor() const;
  /// Device struct as a uint8 tensor.
  Tensor scalars() const { return scalars_.as(DType::kU8, {static_cast<int64_t>(sizeof(OptimizerScalars))}); }
  /// Copies the scalars to the host and waits: call at log intervals only.
  OptimizerScalars read_scalars_sync(const Stream& stream) const;
  void write_scalars(const OptimizerScalars& s, const Stream& stream);
  /// AdamW moments of the owned elements: fp32 [owned_elements()], owned ranges concatenated.
  /// With --optimizer muon the state is laid out differently (moments_flat() false): exp_avg holds
  /// the AdamW elements' first moments (owned elements outside the Muon matrices, ascending) then
  /// the Muon matrices' momentum (ascending); exp_avg_sq only the AdamW elements'
  /// [adamw_state_elements()] (Muon keeps one buffer instead of two moments). Read them by
  /// parameter through gather_moments.
  Tensor exp_avg() const { return exp_avg_.as(DType::kF32, {owned_n_}); }
  Tensor exp_avg_sq() const { return exp_avg_sq_.as(DType::kF32, {v_n_}); }
  int64_t adamw_state_elements() const { return v_n_; }
  /// exp_avg / exp_avg_sq are indexed by the flat index ([total], one owned range, AdamW only):
  /// no distributed optimizer and no Muon. Otherwise use gather_moments / scatter_moments.
  bool moments_flat() const { return !sync_->distributed() && !muon_; }
  /// Owned flat ranges, ascending (GradSync::owned_ranges).
  const std::vector<ParamStore::Range>& owned_ranges() const { return sync_->owned_ranges(); }
  int64_t owned_elements() const { return owned_n_; }
  bool distributed() const { return sync_->distributed(); }
  GradSync& grad_sync() const { return *sync_; }
  /// Elements of optimizer state stored on this rank: both moments (fp32) plus the main
  /// parameters held beyond the model parameters (ParamStore::main_storage_elements: fp32, or
  /// int16 remainders). With N = total elements: 2·N (fp32 model) or 3·N (bf16/fp16), divided by
  /// DP with the distributed optimizer. For memory use state_bytes().
  /// With Muon: exp_avg for every owned element, exp_avg_sq for the AdamW ones only.
  int64_t state_elements() const { return owned_n_ + v_n_ + params_.main_storage_elements(); }
  /// Bytes of that state: 8 per owned element for the moments plus ParamStore::main_storage_bytes
  /// (4 per stored main element, 2 with remainders): 12·N (bf16/fp16) or 10·N
  /// (--use-precision-aware-optimizer), divided by DP with the distributed optimizer.
  int64_t state_bytes() const { return 4 * (owned_n_ + v_n_) + params_.main_storage_bytes(); }
  /// Checkpoint support, outside a training step. gather_*: full-length fp32 [total] tensors on
  /// the device (copies, or all-gathered over DP per bucket with the distributed optimizer;
  /// collective). gather_main: the fp32 main parameters (waits for parameter all-gathers in
  /// flight; remainders are merged with the bf16 parameters first, exact).
  /// scatter_moments: takes this rank's owned elements of full-length m, v.
  void gather_moments(const Tensor& m, const Tensor& v, const Stream& stream) const;
  void gather_main(const Tensor& full, const Stream& stream) const;
  void scatter_moments(const Tensor& m, const Tensor& v, const Stream& stream);
  const OptimizerConfig& config() const { return config_; }
  /// The Muon part (nullptr with --optimizer adam).
  const MuonStep* muon() const { return muon_.get(); }

 private:
  void init(const Stream& stream);
  // Copies compact owned state into the owned ranges of `full` and all-gathers every bucket.
  void gather_compact(const Tensor& full, const Tensor& compact, const Stream& stream) const;
  // With the distributed optimizer: all-gathers every bucket of `full` from the owned ranges.
  void all_gather_owned(const Tensor& full, const Stream& stream) const;
  // An owned run of elements: flat [begin, begin + n), state index `state`.
  struct Piece {
    int64_t begin, n, state;
  };
  std::vector<Piece> owned_pieces(const std::vector<ParamStore::Range>& ranges) const;

  ParamStore& params_;
  OptimizerConfig config_;
  OptimizerGroups groups_;
  std::unique_ptr<GradSync> own_sync_;
  GradSync* sync_ = nullptr;
  Buffer exp_avg_, exp_avg_sq_, scalars_;
  int64_t owned_n_ = 0, v_n_ = 0;
  // Where exp_avg / exp_avg_sq keep each owned flat run (state = index in that buffer), ascending
  // by flat index: with Muon the AdamW runs first, the Muon runs after (exp_avg_sq: AdamW only).
  std::vector<Piece> m_layout_, v_layout_;
  // The state index (in m_layout_) of an owned piece (its `state` is the owned-range index).
  int64_t moment_index(const Piece& p) const;
  // Planned once: owned pieces counted in the gradient norm on this rank; every owned piece with
  // its weight-decay flag, chunked for adamw_multi_step (with config_.decoupled_lr the embedding
  // and output-layer pieces in decoupled_plan_ instead, empty on ranks without them).
  std::vector<Piece> norm_pieces_, expert_norm_pieces_;
  AdamWPlan adamw_plan_, decoupled_plan_;
  // --optimizer muon: the Muon step and the plan applying its updates (the momentum lives in
  // exp_avg_ at the Muon parameters' state indices; their exp_avg_sq stays zero).
  std::unique_ptr<MuonStep> muon_;
  AdamWPlan muon_plan_;
  Buffer expert_scalars_;  // OptimizerScalars whose grad_sumsq accumulates the expert pieces
  Buffer host_scalars_;  // pinned
};

}  // namespace mt
