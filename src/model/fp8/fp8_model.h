// The model-wide part of FP8 training (docs/fp8.md): which linear layers run in FP8, the scaling
// state of all of this rank's FP8 tensors in one device buffer, the weights' quantisation once per
// step, delayed scaling's per-step amax reduction and scale update, and the state checkpoints keep.
// GPTModel owns one when --fp8-format is given; the linear layers find it through their
// ParamRegistry (ParamRegistry::fp8) and register an Fp8Linear each.
//
// The state buffer holds, per decoder layer with FP8 linears on this rank, two fp32 blocks named as
// Transformer Engine's fp8_meta: "scaling_fwd" [R, 2n] (columns 2j, 2j + 1: linear j's x and w,
// FP8 e4m3) and "scaling_bwd" [R, n] (column j: linear j's dy, e4m3 or e5m2), n the layer's linear
// count (the MoE experts count all E global experts, so that every layout has the same columns),
// with the rows
//   0 .. H-1  the amax history (delayed scaling, H = --fp8-amax-history-len; row 0 records the step),
//   H         the last all-reduced amax (current scaling),
//   H + 1     the scale, H + 2 its inverse.
// Live, a block's column c is column kStateStride·c of an fp32 [R, kStateStride·columns] array (the
// columns between are padding: zero histories, which fp8_delayed_scale_update leaves alone), so that
// every value starts 16 bytes after its row neighbour: the FP8 GEMMs read the scale_inv row in place
// (cuBLASLt rejects scale pointers that are not 16-byte aligned; docs/fp8.md). Checkpoints and
// layer_state see the blocks packed, [R, 2n] / [R, n], as before (format unchanged).
// Delayed scaling reduces the records over every rank of the pipeline stage (TP x CP x DP, which
// holds the EP and expert-TP ranks too; Megatron's amax reduction group with CP) once per step,
// after the last backward: the state is then the same on every rank of a stage, and checkpoints
// store it once per layer as "decoder.layers.<L>.fp8_meta.scaling_fwd" / ".scaling_bwd" (resume is
// bitwise). The other recipes carry nothing from step to step.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "model/fp8/fp8_linear.h"
#include "model/transformer_config.h"

namespace mt {

class Fp8Model {
 public:
  /// config: fp8 on (TransformerConfig::fp8 != kNone). groups: this rank's process groups (tp, cp,
  /// tp_cp, dp_cp). Errors: mt::Error for --fp8-param-gather with the blockwise recipe (its 128x128
  /// weight blocks cross the distributed optimizer's flat slices).
  Fp8Model(const TransformerConfig& config, const ProcessGroups& groups);
  Fp8Model(const Fp8Model&) = delete;
  Fp8Model& operator=(const Fp8Model&) = delete;

  const Fp8Settings& settings() const { return settings_; }
  /// The prefix of the shared scratch keys of the linear `name` (a parameter prefix): "fp8." for
  /// every linear but the shared experts' under --moe-shared-expert-overlap, which run on a side
  /// stream beside the routed experts' FP8 GEMMs and get scratch of their own
  /// ("fp8.shared_experts.").
  std::string scratch_prefix(const std::string& name) const;

  // --- registration (module constructors) ---
  /// The decoder layer of a parameter prefix "decoder.layers.<L>[.…]", or -1 for any other prefix
  /// (the embedding, the output layer: never FP8).
  static int64_t decoder_layer(const std::string& prefix);
  /// Whether the linear layers of decoder layer `layer` run in FP8 (TransformerConfig::fp8_layer).
  bool layer_on(int64_t layer) const { return layer >= 0 && config_.fp8_layer(layer); }
  /// Reserves `count` consecutive linear columns of `layer` (the MoE experts reserve 2·E at once)
  /// and returns the first.
  int64_t reserve(int64_t layer, int64_t count);
  /// An FP8 linear for column `column` of `layer` (from reserve), registered for the state,
  /// planning and the weights' quantisation; owned by the caller, which must not move it.
  /// dense: a ColumnParallelLinear / RowParallelLinear (tp_linear); else a MoE expert's, whose
  /// weights keep the model-dtype gather of the distributed optimizer and so keep their own FP8
  /// copies when the optimizer shards the main parameters (weights_in_params).
  std::unique_ptr<Fp8Linear> make_linear(int64_t layer, int64_t column, std::string name, const ParamRef* weight,
                                         int64_t out, int64_t in, Fp8Groups groups, bool dense = false);
  /// The Fp8Linear of a ColumnParallelLinear (row = false) or RowParallelLinear (row = true) with
  /// parameter prefix `prefix` and local weight [out, in], over the model's TP group; nullptr when
  /// that layer runs bf16 (not a decoder layer's, or a bf16 first / last layer).
  std::unique_ptr<Fp8Linear> tp_linear(const std::string& prefix, bool row, const ParamRef* weight, int64_t out,
                                       int64_t in);
  /// The reduction groups of a ColumnParallelLinear / RowParallelLinear over the model's TP group
  /// (docs/fp8.md table): column x over CP (gathered or replicated over TP), w over TP, dy over
  /// TP x CP; row x over TP x CP, w over TP, dy over CP. The sequence-parallel shards of column x
  /// and row dy (gathered block by block) over TP x CP.
  Fp8Groups column_groups() const;
  Fp8Groups row_groups() const;

  /// Whether the FP8 linears keep their weight copies wq, wq_t in the bytes of their bf16 weights'
  /// storage (TransformerConfig::fp8_weights_in_params; docs/fp8.md "Memory"): a bf16 model whose
  /// fp32 main parameters are a separate copy (not int16 remainders beside the bf16 ones:
  /// --use-precision-aware-optimizer), quantised from those main parameters (rounded to bf16 as the
  /// optimizer rounds them), which every rank holds whole without the distributed optimizer and
  /// whose owned slices --fp8-param-gather quantises and all-gathers with it. Otherwise (an fp32
  /// model, remainders, the distributed optimizer without --fp8-param-gather: the whole weight
  /// exists only as the bf16 all-gather) the copies are separate. dp_cp, edp: the data-parallel ×
  /// context-parallel and expert-data-parallel sizes — with dp_cp = 1 < edp the optimizer shards the
  /// main parameters (over the experts' group) but no FP8 gather refills the dense weights, so the
  /// copies are separate there too.
  static bool weights_in_params(DType model_dtype, bool store_param_remainders, bool distributed_optimizer,
                                bool fp8_param, int dp_cp, int edp) {
    return model_dtype == DType::kBF16 && !store_param_remainders &&
           (!distributed_optimizer || (fp8_param && (dp_cp > 1 || edp <= 1)));
  }
  /// A linear whose weight copies live in its parameter storage (weights_in_params) for a dense
  /// (tp_linear) or expert weight: the experts keep the model-dtype gather, so only without the
  /// distributed optimizer (TransformerConfig::fp8_param off under weights_in_params).
  bool linear_in_params(bool dense) const { return config_.fp8_weights_in_params && (dense || !config_.fp8_param); }
  /// A copy of src for the quantiser of a weight kept in its parameter storage (Fp8Linear::in_params)
  /// when the storage is about to receive its FP8 copies and no fp32 main parameters hold the whole
  /// weight (sharded by --fp8-param-gather's distributed optimizer: the bf16 storage the weight
  /// initialisation or a checkpoint load wrote is the source), or (blockwise) the bf16 rounding of
  /// the fp32 main parameters. src: [n] bf16 (copied as it is) or fp32 (rounded to nearest even, the
  /// optimizer's rounding); returns [n] bf16 with bf16 activations (GPU), else (the CPU's fp32 ops)
  /// the bf16 values widened to fp32 (exact). In the scratch planned for the largest such weight (the
  /// key "fp8.dyq_t", a backward temporary of the linears, free between layers: the weights are
  /// quantised before a layer's forward, so no memory is added unless the weight needs more).
  /// Errors: mt::Error for a weight larger than planned, or when nothing was planned.
  Tensor stage_weight(const Tensor& src, const Stream& stream) const;
  /// x (fp32 [1]) rounded to bf16 in place (round to nearest even, as the optimizer rounds).
  void round_to_bf16(const Tensor& x, const Stream& stream) const;

  // --- the model (GPTModel) ---
  /// Persistent: the state buffer (live, strided), its packed checkpoint copy (delayed scaling) and
  /// every linear's FP8 weight copies; binds the linears' state views. Once per planning pass,
  /// outside any area.
  void plan(BufferPlanner& planner);
  /// Bytes plan() requests (the memory estimate's "FP8 weights, staging and scaling state").
  size_t planned_bytes() const { return planned_bytes_; }
  /// After the placing pass: scales 1, amaxes and histories 0. Synchronises a stream of its own.
  void initialize(Device device);
  /// Whether the forwards that follow are training forwards (delayed scaling records their
  /// amaxes; evaluation forwards use the scales without recording).
  void set_training(bool training) { training_ = training; }
  bool training() const { return training_; }
  /// Quantises the weights of decoder layer `layer`'s FP8 linears unless already done this step;
  /// force: the step's first forward of the layer (the optimizer changed the weights since).
  /// Current scaling all-reduces each weight's amax over its shards. A weight in its parameter
  /// storage (Fp8Linear::in_params) is quantised from its whole fp32 main parameters; when those
  /// are sharded (--fp8-param-gather) the FP8 gather fills it, and only a freshly initialised or
  /// loaded storage (bf16) is quantised here, once (its amax recorded, delayed scaling, whatever
  /// the forward: the next forwards skip it). Errors: mt::Error for such a weight that the
  /// optimizer changed and no FP8 gather filled.
  void quantize_weights(int64_t layer, bool force, const Stream& stream);
  /// Marks every weight for quantisation at its next forward.
  void invalidate_weights();

  // --- --fp8-param-gather (optim/grad_sync.h: GradSync::set_fp8_param_gather) ---
  /// This rank's FP8 linears, in registration order.
  std::vector<Fp8Linear*> linears() const;
  /// Their weights' parameter names ("<linear>.weight"), in the same order.
  std::vector<std::string> weight_names() const;
  /// The weights' amaxes (fp32 [n], one per gathered weight, each the max over this rank's owned
  /// slice): all-reduced MAX over the TP group, then DP x CP — every rank of the stage holds a part
  /// of each weight (docs/fp8.md "Layout invariance"). Collective over the stage.
  void reduce_weight_amaxes(const Tensor& amaxes, const Stream& stream);
  /// `linears` get their wq / wq_t from the distributed optimizer's FP8 all-gather from now on:
  /// quantize_weights skips them while weights_gathered (set after each gather; cleared by
  /// load_state, whose parameters the gather has not seen: the next forward quantises them).
  void set_param_gather(const std::vector<Fp8Linear*>& linears);
  void set_weights_gathered(bool gathered) { weights_gathered_ = gathered; }
  bool weights_gathered() const { return weights_gathered_; }
  /// Once per training step after the last backward (GPTModel::finish_step): delayed scaling
  /// all-reduces the recorded amaxes (MAX over tp, then dp_cp) and updates every history and scale
  /// (fp8_delayed_scale_update); nothing for the other recipes. Collective over the stage.
  void finish_step(const Stream& stream);
  /// The checkpointed state (delayed scaling; empty otherwise): ("decoder.layers.<L>.fp8_meta.
  /// scaling_fwd" / "scaling_bwd", fp32 [R, 2n] / [R, n]), replicated over the stage: the packed
  /// copy, written from the live state here (a host round trip; synchronises `stream`). A
  /// checkpoint load writes these tensors; load_state then makes them live.
  std::vector<std::pair<std::string, Tensor>> persistent_state(const Stream& stream) const;
  /// After a checkpoint load wrote persistent_state's tensors: unpacks them into the live state
  /// (a host round trip; synchronises `stream`). Nothing for the recipes without state.
  void load_state(const Stream& stream);
  /// The state blocks of decoder layer `layer` ({fwd, bwd}: packed [R, 2n] / [R, n] copies, written
  /// from the live state here; synchronises `stream`; empty tensors when the layer has no FP8
  /// linear on this rank). For tests and logging: valid until the next call.
  std::pair<Tensor, Tensor> layer_state(int64_t layer, const Stream& stream) const;
  /// Rows of a state block: history rows + amax + scale + scale_inv.
  int64_t state_rows() const { return history_rows() + 3; }
  /// Forwards of this rank's FP8 linears that took a fused producer's input (Fp8Linear::fused_inputs).
  int64_t fused_inputs() const { return sum_over_linears(&Fp8Linear::fused_inputs); }
  /// Backwards of this rank's FP8 linears that took a fused producer's dy (Fp8Linear::fused_grads).
  int64_t fused_grads() const { return sum_over_linears(&Fp8Linear::fused_grads); }
  /// fp32 elements from one column of the live state to the next (16 bytes: cuBLASLt's alignment
  /// of scale pointers).
  static constexpr int64_t kStateStride = 4;

 private:
  int64_t history_rows() const { return settings_.delayed() ? settings_.amax_history_len : 0; }
  struct LayerEntry {
    int64_t layer = 0, columns = 0;
    std::vector<Fp8Linear*> linears;     // this rank's, registered
    std::vector<int64_t> linear_column;  // their columns
    std::vector<uint8_t> gathered;       // per linear: filled by the FP8 parameter all-gather
    Tensor fwd, bwd;                     // live: [R, kStateStride·2·columns], [R, kStateStride·columns]
    Tensor fwd_packed, bwd_packed;       // [R, 2·columns], [R, columns]: the checkpoint layout
    bool weights_ready = false;
    bool storage_fresh = true;  // the in-parameter weights' storage holds bf16 (initialise / load)
  };
  LayerEntry& entry(int64_t layer);
  const LayerEntry* find(int64_t layer) const;
  // Σ over this rank's registered linears of (linear->*count)().
  int64_t sum_over_linears(int64_t (Fp8Linear::*count)() const) const {
    int64_t n = 0;
    for (const LayerEntry& e : layers_)
      for (const Fp8Linear* l : e.linears) n += (l->*count)();
    return n;
  }
  Fp8TensorState tensor_state(const Tensor& block, int64_t column) const;
  // Copies the live state into the packed blocks (pack) or back (!pack), through the host.
  void repack(bool pack, const Stream& stream) const;
  // Bytes stage_weight needs for n elements: 2 n with bf16 activations, 6 n otherwise.
  size_t stage_bytes(int64_t n) const;

  TransformerConfig config_;
  Fp8Settings settings_;
  std::shared_ptr<Communicator> tp_, cp_, tp_cp_, dp_cp_;
  std::vector<LayerEntry> layers_;  // in registration (= layer) order
  Tensor state_;                    // all live blocks
  Tensor packed_;                   // all packed blocks (the checkpoint layout)
  size_t planned_bytes_ = 0;
  bool training_ = true;
  bool weights_gathered_ = false;
  bool stepped_ = false;  // finish_step ran since initialize / load_state
  Tensor weight_stage_;   // scratch bytes: the largest staged in-parameter weight (stage_weight)
  Tensor bf16_temp_;      // bf16 [8]: round_to_bf16
  DType act_dtype_ = DType::kBF16;
};

}  // namespace mt
